"""Shared test setup.  Real data: $NANOGEN_DATA when set (CI: ../shared/data), otherwise the
datasets are downloaded, as on a user's machine.  Every test session prepares its data in a
temporary cache of its own (never the user's ~/.cache/nanogen)."""
import os
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))
SESSION_CACHE = tempfile.mkdtemp(prefix="nanogen-test-cache-")
os.environ["NANOGEN_CACHE"] = SESSION_CACHE  # subprocesses inherit it


def pytest_sessionfinish(session, exitstatus):
    import shutil
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def steps(first, shape):
    """The continuation step t of every position, (..., T) for `shape` (..., T): first, first+1,
    ... along the last dimension (what data/loader.collate and decode.py build)."""
    first = torch.as_tensor(first)
    return (first.reshape(*first.shape, 1) + torch.arange(shape[-1])).expand(*shape)


@pytest.fixture(scope="session")
def wikitext2():
    from data.loader import load
    return load("wikitext2", verbose=False)
