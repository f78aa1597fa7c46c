"""Shared test setup.  Real data: $NANOGEN_DATA when set (CI: ../shared/data), otherwise the
datasets are downloaded into the cache, as on a user's machine."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def wikitext2():
    from data.loader import load
    return load("wikitext2", verbose=False)
