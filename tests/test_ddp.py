"""train.py under torchrun with 2 CPU processes (gloo): the same numbers as 1 process with the
same global batch; story models; stop decisions taken together (time limit on disagreeing
clocks, a storm of SIGTERMs, a signal to one process, a second signal at exit); every
process's own RNG after a resume (fresh ones on another number of processes); one process
prepares the data; a user error stops every process with one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
ARGS = [
    "--model",
    "lstm",
    "--head",
    "st",
    "--epsilon",
    "1e-3",
    "--dataset",
    "ptb",
    "--d_model",
    "32",
    "--dropout",
    "0",
    "--batch_size",
    "4",
    "--grad_accum",
    "2",
    "--lr",
    "3e-3",
    "--train_seqs",
    "200",
    "--eval_seqs",
    "40",
    "--probe",
    "5",
    "--probe_L",
    "24",
    "--no_curves",
    "--max_iters",
    "8",
    "--eval_interval",
    "4",
    "--seed",
    "3",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
WORKER = os.path.join(ROOT, "tests", "train_worker.py")


def run(cmd, out_dir, args=ARGS, env=None, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    p = subprocess.run(
        cmd + args + ["--out_dir", str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def log(out_dir, name="log.jsonl"):
    return [json.loads(line) for line in open(os.path.join(out_dir, name))]


def test_two_processes_match_one(tmp_path):
    run([sys.executable, "train.py"], tmp_path / "one")
    run(TORCHRUN + ["train.py"], tmp_path / "two", [a for a in ARGS if a != "--no_curves"])
    one, two = log(tmp_path / "one"), log(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [4, 8]
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4 * abs(a["train_loss"])
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-4 * abs(a["val_loss"])
    assert one[1]["val_loss"] < one[0]["val_loss"]
    steps_one, steps_two = (
        log(tmp_path / "one", "steps.jsonl"),
        log(tmp_path / "two", "steps.jsonl"),
    )
    assert (
        len(steps_one) == len(steps_two) == 8
    )  # each step's loss: the mean over every micro-batch
    for a, b in zip(steps_one, steps_two):  # and process, whatever the process count
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(a["loss"])
    assert (tmp_path / "two" / "curves.png").stat().st_size > 10_000  # drawn by rank 0


@pytest.mark.parametrize("model", ["insnet", "insertion_transformer"])
def test_story_models_train_under_torchrun(model, tmp_path):
    """The insertion models' loss goes through forward, so DDP syncs their gradients; without
    --grad_accum each process takes one batch a step (the README's torchrun command)."""
    args = [
        "--model",
        model,
        "--dataset",
        "synthetic",
        "--synthetic_count",
        "8",
        "--n_layer",
        "1",
        "--d_model",
        "32",
        "--n_head",
        "2",
        "--block_size",
        "256",
        "--batch_size",
        "4",
        "--max_iters",
        "4",
        "--eval_interval",
        "2",
        "--warmup",
        "0",
        "--no_curves",
    ]
    run(TORCHRUN + ["train.py"], tmp_path / model, args)
    assert [r["step"] for r in log(tmp_path / model)] == [2, 4]
    assert json.loads((tmp_path / model / "args.json").read_text())["grad_accum"] == 2


def test_time_limit_is_decided_together(tmp_path):
    """Rank 1's clock runs 20x fast: without a shared decision it would stop steps before rank 0
    (a collective mismatch or a hang); both stop on the same step, with a checkpoint."""
    out = tmp_path / "clock"
    args = [a for a in ARGS if a not in ("--max_iters", "8")] + [
        "--max_minutes",
        "0.02",
        "--log_interval",
        "1",
        "--eval_interval",
        "0",
        "--max_iters",
        "100000",
    ]
    p = run(TORCHRUN + [WORKER], out, args, env=dict(NANOGEN_TEST_WORKER="fast_clock"))
    assert "reached --max_minutes" in p.stdout, p.stdout[-2000:]
    from common import load_checkpoint

    steps = [r["step"] for r in log(out, "steps.jsonl")]
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == steps[-1] > 0


def test_a_storm_of_sigterms_still_checkpoints(tmp_path):
    """A scheduler signals torchrun and the workers (torchrun forwards its own): every process
    gets SIGTERM two or three times.  They stop on the same step, write the checkpoint and
    exit 0 (torchrun itself reports the signal it got)."""
    out = tmp_path / "storm"
    args = [a for a in ARGS if a not in ("--max_iters", "8")] + [
        "--max_iters",
        "100000",
        "--log_interval",
        "1",
        "--eval_interval",
        "1000",
    ]
    p = subprocess.Popen(
        TORCHRUN + ["train.py", *args, "--out_dir", str(out)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        os.path.exists(out / "steps.jsonl") and len(log(out, "steps.jsonl")) >= 3
    ):
        time.sleep(0.2)
    for _ in range(2):
        os.killpg(p.pid, signal.SIGTERM)
        time.sleep(0.3)
    stdout, stderr = p.communicate(timeout=120)
    assert "stopped by SIGTERM after step" in stdout, (stdout[-2000:], stderr[-3000:])
    # torchrun's own traceback reports the second signal it got; no worker has one or failed
    assert 'train.py", line' not in stderr and "exitcode" not in stderr, stderr[-3000:]
    from common import load_checkpoint

    step = load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"]
    assert f"after step {step};" in stdout and log(out, "steps.jsonl")[-1]["step"] == step


def test_a_signal_to_one_process_stops_them_all(tmp_path):
    """SIGTERM to rank 1 alone (its step 3): rank 0 learns it from the stop check shared every
    --log_interval steps (here 2: after step 4); both stop after that step, write the checkpoint
    and exit 0."""
    out = tmp_path / "one_signal"
    args = [a for a in ARGS if a not in ("--max_iters", "8")] + [
        "--max_iters",
        "100",
        "--log_interval",
        "2",
        "--eval_interval",
        "20",
    ]
    p = run(TORCHRUN + [WORKER], out, args, env=dict(NANOGEN_TEST_WORKER="sigterm=3"))
    assert "stopped by a signal to another process after step 4;" in p.stdout, p.stdout[-2000:]
    from common import load_checkpoint

    assert (
        load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"]
        == 4
        == log(out, "steps.jsonl")[-1]["step"]
    )


def test_a_second_signal_at_exit_is_no_kill(tmp_path):
    """A scheduler's second SIGTERM reaches every process as it leaves (its process group being
    destroyed, after the message): each still exits 0 and rank 0's message is not lost. The group's
    threads are gone before the interpreter's exit (left running there, a process rarely aborts)."""
    out = tmp_path / "exit"
    args = [a for a in ARGS if a not in ("--max_iters", "8")] + [
        "--max_iters",
        "100",
        "--log_interval",
        "1",
    ]
    p = run(TORCHRUN + [WORKER], out, args, env=dict(NANOGEN_TEST_WORKER="sigterm_at_exit=3"))
    assert "stopped by a signal to another process after step 3;" in p.stdout, p.stdout[-2000:]
    left = [line for line in p.stdout.splitlines() if line.startswith("threads left:")]
    assert len(left) == 2 and not any("gloo" in line for line in left), left


def test_every_process_resumes_its_own_rng(tmp_path):
    """With dropout each process draws its own masks; a run resumed at step 4 trains on exactly
    as an uninterrupted one (rank 1 does not get rank 0's generator)."""
    args = [*ARGS]
    args[args.index("--dropout") + 1] = "0.3"
    run(TORCHRUN + ["train.py"], tmp_path / "whole", args)
    part = [*args]
    part[part.index("--max_iters") + 1] = "4"
    run(TORCHRUN + ["train.py"], tmp_path / "parts", part)
    shutil.copytree(tmp_path / "parts", tmp_path / "alone")
    run(TORCHRUN + ["train.py"], tmp_path / "parts", args + ["--resume"])
    whole, parts = log(tmp_path / "whole"), log(tmp_path / "parts")
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in whole] == [
        (r["step"], r["train_loss"], r["val_loss"]) for r in parts
    ]
    from common import load_checkpoint

    ranks = load_checkpoint(str(tmp_path / "parts" / "ckpt_last.pt"))["rng"]
    assert len(ranks) == 2 and not (ranks[0]["cpu"] == ranks[1]["cpu"]).all()
    run([sys.executable, "train.py"], tmp_path / "alone", args + ["--resume"])  # 2 -> 1 process:
    alone = log(tmp_path / "alone")  # the same batches, fresh generators from (seed, rank, step)
    assert [r["step"] for r in alone] == [4, 8] and alone[0] == parts[0]
    assert len(load_checkpoint(str(tmp_path / "alone" / "ckpt_last.pt"))["rng"]) == 1


def test_one_process_prepares_the_data(tmp_path):
    """On a fresh cache only rank 0 prepares; rank 1 waits and reads its folder."""
    p = run(
        TORCHRUN + [WORKER],
        tmp_path / "prep",
        ARGS[:-6] + ["--max_iters", "1", "--eval_interval", "1"],
        env=dict(NANOGEN_TEST_WORKER="count_build", NANOGEN_CACHE=str(tmp_path / "cache")),
    )
    assert p.stdout.count("BUILD rank") == 1 and "BUILD rank 0" in p.stdout, p.stdout[-2000:]


def test_a_user_error_stops_every_process_with_one_line(tmp_path):
    """A fresh run into a folder that holds a checkpoint: each process says so in one line, no
    traceback from a process left waiting in a collective. (torchrun stops the others as soon as
    one exits, so a slower process may be stopped before it prints: one line at least.)"""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "ckpt_last.pt").write_bytes(b"a checkpoint")
    p = run(TORCHRUN + ["train.py"], out, check=False)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(errors) <= 2 and all("already holds a run" in e for e in errors), p.stderr[
        -3000:
    ]
    ours = [
        ln for ln in p.stderr.splitlines() if f'File "{ROOT}' in ln and "site-packages" not in ln
    ]
    assert not ours, p.stderr[-3000:]  # torchrun reports the exit status; no traceback of ours
