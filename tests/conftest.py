"""Shared test setup.  Real data: $NANOGEN_DATA when set (CI: ../shared/data), otherwise the
datasets are downloaded, as on a user's machine.  The data is prepared in a cache of the tests'
own (never the user's ~/.cache/nanogen): with $NANOGEN_DATA, a temporary one per session (CI
starts clean); without it, ~/.cache/nanogen-tests (or $NANOGEN_TEST_CACHE), kept between runs
so that a student's second run downloads and prepares nothing.

`python -m pytest -q` runs the fast tests; `-m ""` adds the slow ones (marked `slow`: end to
end, subprocesses, torchrun), which CI runs."""

import os
import shutil
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))
if os.environ.get("NANOGEN_DATA"):
    SESSION_CACHE = tempfile.mkdtemp(prefix="nanogen-test-cache-")
else:
    SESSION_CACHE = os.path.expanduser(
        os.environ.get("NANOGEN_TEST_CACHE") or os.path.join("~", ".cache", "nanogen-tests")
    )
os.environ["NANOGEN_CACHE"] = SESSION_CACHE  # subprocesses inherit it


# the devices the device-generic equalities run on: the CPU always, CUDA where there is one
# (marked `cuda`: `python -m pytest -q -m cuda` runs them first on a new GPU machine)
DEVICES = [
    "cpu",
    *([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []),
]


@pytest.fixture
def no_tf32():
    """float32 products in full float32 while a test runs (CUDA's TF32 off), as they were after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("NANOGEN_DATA"):
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


# The tiny run the failure tests train (an LSTM + NMST on 96 PTB lines), before their own flags.
TINY_LSTM = (
    "--model lstm --head nmst --epsilon 1e-3 --dataset ptb --d_model 16 --dropout 0.1 "
    "--batch_size 8 --lr 3e-3 --train_seqs 96 --eval_seqs 16 --seed 2"
).split()


@pytest.fixture(scope="module")
def lstm_run(tmp_path_factory, request):
    """A finished run of the test module's TINY flags, trained once a module: its folder."""
    import train

    out = tmp_path_factory.mktemp("lstm") / "run"
    train.main(request.module.TINY + ["--out_dir", str(out)])
    return out


def small_cfg(arch, head, **over):
    """A small model's config for the float64 equality tests: V = 100 (U padded to 128 rows),
    eos 7, one layer of 16; `over` changes any of it."""
    cfg = dict(model=arch, head=head, epsilon=1e-2, vocab_size=100, eos_id=7, n_layer=1)
    cfg.update(d_model=16, dropout=0.0, tie=True, n_head=2, block_size=32, bias=True)
    cfg.update(kernel_size=3, n_experts=2, ct_alpha=1.0, ct_beta=0.5)
    return dict(cfg, **over)


def steps(first, shape):
    """The continuation step t of every position, (..., T) for `shape` (..., T): first, first+1,
    ... along the last dimension (what data/loader.collate and decode.py build)."""
    first = torch.as_tensor(first)
    return (first.reshape(*first.shape, 1) + torch.arange(shape[-1])).expand(*shape)


@pytest.fixture(scope="session")
def wikitext2():
    from data.loader import load

    return load("wikitext2", verbose=False)[:2]


@pytest.fixture(scope="session")
def ptb():
    from data.loader import load

    return load("ptb", verbose=False)[:2]


class RecomputeStepper:
    """Re-encodes the whole prefix at every step: slow, the reference the cached decoders are
    tested against (monkeypatch it over decode.CachedStepper)."""

    def __init__(self, lm):
        self.lm = lm

    def start(self, prompts, lengths):
        self.rows = [prompts[i, : lengths[i]] for i in range(len(lengths))]
        self.n_prompt = lengths.clone()
        return self._last()

    def _last(self):
        out = []
        for row, n in zip(self.rows, self.n_prompt.tolist()):
            steps = torch.arange(len(row), device=row.device).unsqueeze(0) - n + 2  # (1, L)
            lp, _ = self.lm.log_probs(row.unsqueeze(0), steps)
            out.append(lp[0, -1])
        return torch.stack(out)

    def advance(self, tokens, t):
        self.rows = [torch.cat([row, tok.view(1)]) for row, tok in zip(self.rows, tokens)]
        return self._last()

    def reorder(self, index):
        self.rows = [self.rows[i] for i in index.tolist()]
        self.n_prompt = self.n_prompt[index]


def target_log_p(lm, inputs, t, targets, state=None):
    """log p of the targets (B, T) and the state after them, by the model's training call (a
    stream's batch: no mask)."""
    log_p, _, state = lm(dict(inputs=inputs, t=t, targets=targets, mask=None), state)
    return log_p, state


def run_cli(main, argv=None):
    """A command's exit status as the shell sees it (common.run), without a new interpreter."""
    from common import run

    try:
        run(lambda: main(argv))
    except SystemExit as e:
        return e.code or 0
    raise AssertionError("common.run returned without exiting")


def run_in_process(main, argv, capsys):
    """A command's error path without a new interpreter: -> (exit status, stderr).  Any exception
    other than the commands' one-line errors propagates and fails the test."""
    from common import run

    try:
        run(lambda: main(argv))
    except SystemExit as e:  # (run always exits; argparse's errors too)
        return e.code or 0, capsys.readouterr().err  # (sys.exit(None): status 0)
    raise AssertionError("common.run returned without exiting")


def assert_one_line_error(rc, stderr, pattern):
    """Exit status, no traceback, one line 'error: ...' (besides the counts data/prepare.py
    prints when a test's call is the first to prepare some data: a matter of test order)."""
    lines = [
        ln
        for ln in stderr.splitlines()
        if ln.strip()
        and not ln.startswith("  ")
        and not (": vocabulary " in ln and ", eos id " in ln)
    ]
    assert rc != 0, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert pattern in lines[0], lines[0]
