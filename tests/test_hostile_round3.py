"""Hostile inputs, third pass (issue 78), one test per class (RESULTS.md, the failure table):
output paths checked before any work, reproduce.py --jobs under signals, resume with changed
flags, a resumed run's log, flags reaching code that does not expect them, weak messages."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import bench
import common
import curves
import evaluate
import reproduce
import sample
import train
from conftest import ROOT, TINY_LSTM, assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = TINY_LSTM + ["--max_iters", "4", "--eval_interval", "2", "--probe", "0"]


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


def test_a_stopped_then_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path):
    """A stop between two evaluations (a signal, here set as the run's sync reads step 3): the
    next evaluation's train loss covers the whole interval (its sums are in the checkpoint), so
    log.jsonl equals the uninterrupted run's but for the clocks."""
    flags = TINY + ["--max_iters", "8", "--eval_interval", "5", "--log_interval", "1"]
    train.main(flags + ["--out_dir", str(tmp_path / "ref")])
    real = curves.append

    def signal_at_step_3(path, *records):
        if any(r.get("step") == 3 for r in records):
            train.STOP.append("SIGTERM")
        real(path, *records)

    out = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(curves, "append", signal_at_step_3)
        train.main(flags + ["--out_dir", out])
    state = common.load_checkpoint(f"{out}/ckpt_last.pt")["state"]
    assert state["step"] == 4 and state["stopped"] == "SIGTERM" and state["since"]["n"] > 0
    assert reproduce.run_status(out) == "stopped by SIGTERM"
    train.main(flags + ["--out_dir", out, "--resume"])
    assert reproduce.run_status(out) is None

    def log(folder):
        clocks = ("tokens_per_s", "elapsed_s", "mfu")
        return [
            {k: v for k, v in r.items() if k not in clocks}
            for r in curves.read_log(os.path.join(folder, "log.jsonl"))
        ]

    assert log(out) == log(tmp_path / "ref") and len(log(out)) == 2


def test_sigterm_to_reproduce_jobs_stops_its_children_cleanly(tmp_path):
    """A real SIGTERM to a real `reproduce.py --jobs 2`: passed on to its train.py children (each
    writes its checkpoint, marked stopped), no table, one line, no child left running: the same
    command would go on from their checkpoints."""
    out = tmp_path / "r"
    argv = ["nmst-table1", "--scale", "tiny", "--heads", "softmax", "nmst", "--jobs", "2"]
    argv += ["--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, "reproduce.py", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    started = [out / "runs" / f"lstm-{h}-s0" / "steps.jsonl" for h in ("softmax", "nmst")]
    deadline = time.time() + 120
    while time.time() < deadline and not all(f.exists() for f in started):
        time.sleep(0.01)  # (both children are training: their logs are started)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert_one_line_error(p.returncode, err, "stopped by SIGTERM; the runs' checkpoints are in")
    assert not (out / "table.md").exists()
    children = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and str(out).encode() in read_bytes(f"/proc/{pid}/cmdline")
    ]
    assert children == []
    stopped = [
        log for log in (out / "runs").glob("*.log") if "stopped by SIGTERM" in log.read_text()
    ]
    assert stopped  # (a child may have finished first: not both)
    for log in stopped:  # its checkpoint says so (reproduce.py reads it)
        assert reproduce.run_status(str(log)[: -len(".log")]) == "stopped by SIGTERM"


@pytest.mark.parametrize("when", ["at start-up", "while training"])
def test_ctrl_c_to_reproduce_jobs_reaches_its_children_as_ctrl_c(when, tmp_path):
    """A real Ctrl-C (SIGINT) to a real `reproduce.py --jobs 2` reaches each train.py child as
    the Ctrl-C it was, as it would a run started by hand: while training, a clean stop (its
    checkpoint marked "stopped by Ctrl-C"); at start-up (no handler of train.py's yet) Python's
    KeyboardInterrupt, said in its log (never a silent kill, never an empty log: the logs are
    written unbuffered).  One line, no table, no child left running."""
    out, heads = tmp_path / "r", ("softmax", "nmst")
    argv = ["nmst-table1", "--scale", "tiny", "--heads", *heads, "--jobs", "2", "--out", str(out)]
    p = subprocess.Popen(
        [sys.executable, "reproduce.py", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    logs = [out / "runs" / f"lstm-{h}-s0.log" for h in heads]
    ready = [out / "runs" / f"lstm-{h}-s0" / "steps.jsonl" for h in heads]

    def started():
        if when == "at start-up":
            return len(children(out, b"train.py")) == 2
        return all(map(os.path.exists, ready))

    deadline = time.time() + 120
    while time.time() < deadline and not started():
        time.sleep(0.01)
    # At start-up: past the interpreter's first milliseconds (its own Ctrl-C handler), into the
    # imports of train.py, before train.py sets its handler.
    if when == "at start-up":
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert_one_line_error(p.returncode, err, "stopped by Ctrl-C; the runs' checkpoints are in")
    assert not (out / "table.md").exists() and children(out) == []
    said = [log.read_text() for log in logs]
    assert all("Ctrl-C" in text or "KeyboardInterrupt" in text for text in said), said
    if when == "while training":
        for log in logs:
            assert reproduce.run_status(str(log)[: -len(".log")]) in ("stopped by Ctrl-C", None)
        assert any("Ctrl-C: finishing this step" in text for text in said)


def children(out, name=b""):
    """The processes whose command line names the folder out (and name)."""
    return [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit()
        and str(out).encode() in read_bytes(f"/proc/{pid}/cmdline")
        and name in read_bytes(f"/proc/{pid}/cmdline")
    ]


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # (a process that ended meanwhile)
        return b""


def test_a_capped_run_is_partial_until_trained_to_its_end(tmp_path, capsys):
    """--max_minutes stops a run early: the table names it PARTIAL; the same command without the
    cap (or with --max_minutes 0: none) trains it on to its end, and the note goes."""
    argv = ["nmst-table1", "--scale", "tiny", "--heads", "nmst", "--out", str(tmp_path / "r")]
    assert reproduce.main(argv + ["--max_minutes", "0.00001"]) == 0
    table = (tmp_path / "r" / "table.md").read_text()
    assert "PARTIAL: lstm-nmst-s0 stopped at the --max_minutes cap" in table
    run = str(tmp_path / "r" / "runs" / "lstm-nmst-s0")
    assert reproduce.run_status(run) == "partial"
    assert reproduce.main(argv + ["--max_minutes", "0"]) == 0
    assert reproduce.run_status(run) is None
    assert "PARTIAL" not in (tmp_path / "r" / "table.md").read_text()
    assert common.load_checkpoint(f"{run}/ckpt_last.pt")["state"]["step"] == 6
    capsys.readouterr()


def test_resume_refuses_every_flag_that_changes_what_the_run_computes(tmp_path, capsys):
    """A stream run resumed with another --batch_size (its saved state has the old batch), --bptt
    or --max_tokens, and a flag typed at its default but not the run's (--seed 0 on a seed-5
    run): one line each; how long it goes on may change."""
    out = str(tmp_path / "stream")
    flags = "--model lstm --task stream --dataset ptb --d_model 8 --batch_size 4 --bptt 10".split()
    flags += ["--eval_seqs", "50", "--seed", "5", "--out_dir", out]
    train.main(flags + ["--max_iters", "1"])
    resume = ["--out_dir", out, "--resume", "--max_iters", "2"]
    for typed, said in (
        (["--batch_size", "6"], "has batch_size=4, not 6"),
        (["--bptt", "12"], "has bptt=10, not 12"),
        (["--max_tokens", "64"], "has max_tokens=None, not 64"),
        (["--seed", "0"], "has seed=5, not 0"),
    ):
        rc, err = run_in_process(train.main, resume + typed, capsys)
        assert_one_line_error(rc, err, f"the checkpoint in {out} {said}: drop that flag")
    train.main(resume + ["--lr", "1e-3"])  # the run's own value (the recipe's), typed: taken
    train.main(resume + ["--max_iters", "3", "--patience", "4", "--probe", "0"])
    assert common.load_checkpoint(f"{out}/ckpt_last.pt")["state"]["step"] == 3


def test_flags_reaching_code_that_does_not_expect_them(tmp_path, capsys):
    """--max_tokens on a story checkpoint (a TypeError where train.py refuses it in one line),
    both batching flags at once, and sample.py's --prompt_file - with standard input closed."""
    out = tmp_path / "story"
    story = "--model insnet --dataset synthetic --synthetic_count 4 --n_layer 1 --d_model 16"
    story += " --n_head 2 --block_size 256 --batch_size 4 --max_iters 2 --eval_interval 2"
    train.main(story.split() + ["--warmup", "0", "--out_dir", str(out)])
    cases = (
        (["--max_tokens", "100"], "a story checkpoint is batched by --batch_size (stories)"),
        (["--max_tokens", "100", "--batch_size", "2"], "--max_tokens, not both"),
    )
    for flags, message in cases:
        rc, err = run_in_process(
            evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), *flags], capsys
        )
        assert_one_line_error(rc, err, message)
    text = tmp_path / "text"
    train.main(TINY + ["--max_iters", "1", "--out_dir", str(text)])
    sample = [sys.executable, "sample.py", "--ckpt", str(text / "ckpt_last.pt")]
    p = subprocess.run(
        [*sample, "--prompt_file", "-"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        text=True,
        capture_output=True,
        preexec_fn=lambda: os.close(0),
    )
    assert_one_line_error(p.returncode, p.stderr, "--prompt_file -: standard input is closed")


def test_weak_messages_made_plain(lstm_run, tmp_path, capsys, monkeypatch):
    """A hand-made checkpoint with the right top-level keys, a hand-edited meta.json (another
    shape, an unknown dtype: rebuilt, never a traceback), a float count of sequences."""
    import torch

    import data.prepare as prepare

    real = common.load_checkpoint(str(lstm_run / "ckpt_best.pt"))
    for name, args, state in (("no-args", {}, {}), ("no-state", real["args"], {})):
        path = tmp_path / f"{name}.pt"
        torch.save(dict(real, args=args, state=state), path)
        for main, flags in ((evaluate.main, []), (sample.main, ["--prompt", "the"])):
            rc, err = run_in_process(main, ["--ckpt", str(path), *flags], capsys)
            assert_one_line_error(rc, err, "is not a checkpoint written by train.py (incomplete")
    hand = tmp_path / "hand"
    hand.mkdir()
    torch.save(
        dict(
            config=real["config"],
            model=real["model"],
            args=real["args"],
            vocab=real["vocab"],
            state=real["state"],
        ),
        hand / "ckpt_last.pt",
    )
    rc, err = run_in_process(train.main, ["--out_dir", str(hand), "--resume"], capsys)
    assert_one_line_error(rc, err, "holds no training state to resume")
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    folder = prepare.prepare("ptb", verbose=False)
    meta = os.path.join(folder, "meta.json")
    good = open(meta).read()
    for edit in ('{"version": %d, "fingerprints": "x"}', "[1]", "dtype"):
        text = good.replace('"uint16"', '"float128"') if edit == "dtype" else edit
        if "%d" in text:
            text = text % prepare.VERSION
        open(meta, "w").write(text)
        prepare.check_prepared.cache_clear()
        assert prepare.prepare("ptb", verbose=False) == folder  # rebuilt
        assert open(meta).read() == good
    gpt = tmp_path / "gpt"
    flags = "--model gpt --n_layer 1 --d_model 16 --n_head 2 --block_size 24 --batch_size 4"
    train.main(TINY + flags.split() + ["--max_iters", "1", "--out_dir", str(gpt)])
    capsys.readouterr()
    evaluate.main(["--ckpt", str(gpt / "ckpt_last.pt"), "--limit", "40"])
    assert re.search(r"\n\(\d+ sequences longer than the model's window", capsys.readouterr().out)
