"""Hostile inputs, third pass (issue 78), one test per class (RESULTS.md, the failure table):
output paths checked before any work, reproduce.py --jobs under signals, resume with changed
flags, a resumed run's log, flags reaching code that does not expect them, weak messages."""

import os
import subprocess
import time

import pytest

import bench
import curves
import evaluate
import reproduce
import train
from conftest import assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = (
    "--model lstm --head nmst --epsilon 1e-3 --dataset ptb --d_model 16 --dropout 0.1 "
    "--batch_size 8 --lr 3e-3 --train_seqs 96 --eval_seqs 16 --max_iters 4 --eval_interval 2 "
    "--seed 2 --probe 0"
).split()


@pytest.fixture(scope="module")
def lstm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lstm") / "run"
    train.main(TINY + ["--out_dir", str(out)])
    return out


@pytest.fixture
def read_only(tmp_path):
    """A real read-only folder: its mode bits for a user, a read-only tmpfs for root (who ignores
    the mode bits)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({r.stderr.strip()[:120]})")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_every_output_path_is_checked_before_any_work(lstm_run, read_only, tmp_path, capsys):
    """An existing folder, a trailing slash, a read-only folder, a file the run reads (its
    checkpoint, log, data): one line naming the path, before anything is computed, nothing
    replaced; an output in folders still to be made is made."""
    ckpt = str(lstm_run / "ckpt_best.pt")
    data = os.path.join(os.environ.get("NANOGEN_DATA", ""), "ptb", "ptb.valid.txt")
    (tmp_path / "folder").mkdir()
    log = (lstm_run / "log.jsonl").read_bytes()
    ro = str(read_only)
    evaluation = ["--ckpt", ckpt, "--decoder", "greedy", "--L", "3", "--limit", "2"]
    for main, flags, msg in (
        (evaluate.main, ["--out", str(tmp_path / "folder")], "it is a folder"),
        (evaluate.main, ["--out", str(tmp_path / "new") + "/"], "it is a folder"),
        (evaluate.main, ["--out", f"{ro}/res.json"], f"cannot write to --out {ro}/res.json: "),
        (evaluate.main, ["--plot", f"{ro}/figs"], "Read-only file system"),
        (evaluate.main, ["--out", str(lstm_run / "log.jsonl")], "would replace a checkpoint or"),
        (evaluate.main, ["--out", str(lstm_run / "args.json")], "would replace a checkpoint or"),
        (bench.main, ["insnet", "--plot", ckpt], "--plot"),
        (bench.main, ["insnet", "--plot", f"{ro}/fig.png"], "Read-only file system"),
        (bench.main, ["insnet", "--plot", str(tmp_path / "folder")], "it is a folder"),
        (train.main, TINY + ["--out_dir", f"{ro}/run"], "Read-only file system"),
        (train.main, TINY + ["--out_dir", str(lstm_run / "log.jsonl")], "it is not a folder"),
        (
            reproduce.main,
            ["nmst-table1", "--scale", "tiny", "--out", f"{ro}/r"],
            "Read-only file system",
        ),
        (curves.main, [str(lstm_run), "--out", f"{ro}/c.png"], "Read-only file system"),
    ):
        if main is evaluate.main:
            flags = evaluation + flags
        t0 = time.time()
        assert_one_line_error(*run_in_process(main, flags, capsys), msg)
        assert time.time() - t0 < 5  # refused up front, not after the work
    if os.path.isfile(data):  # the run's data (from $NANOGEN_DATA)
        rc, err = run_in_process(evaluate.main, ["--ckpt", ckpt, "--out", data], capsys)
        assert_one_line_error(rc, err, "would replace a checkpoint or an input")
    assert (lstm_run / "log.jsonl").read_bytes() == log and os.listdir(read_only) == []
    evaluate.main(evaluation + ["--no_ppl", "--out", str(tmp_path / "a" / "b" / "res.json")])
    assert (tmp_path / "a" / "b" / "res.json").is_file()
