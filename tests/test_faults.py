"""Faults: kill -9 at random moments and inside a step / an evaluation / a checkpoint write,
then --resume reproduces the uninterrupted run's per-step losses exactly; Ctrl-C; non-finite
loss; a full disk; determinism."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import common
import heads
import train
from common import load_checkpoint, save_checkpoint
from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them

WORKER = os.path.join(ROOT, "tests", "train_worker.py")

ARGS = [
    "--model",
    "lstm",
    "--head",
    "nmst",
    "--epsilon",
    "1e-3",
    "--dataset",
    "ptb",
    "--d_model",
    "32",
    "--dropout",
    "0.3",
    "--batch_size",
    "8",
    "--lr",
    "3e-3",
    "--train_seqs",
    "120",
    "--eval_seqs",
    "24",
    "--probe",
    "8",
    "--probe_L",
    "20",
    "--no_curves",
    "--max_iters",
    "16",
    "--eval_interval",
    "4",
    "--seed",
    "5",
]  # (the figure: tests/test_watching.py; here only the last test draws it)


def losses(out_dir):
    with open(os.path.join(out_dir, "steps.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def start(out_dir, kill=None, signal_at=""):
    env = dict(
        os.environ, OMP_NUM_THREADS="1", NANOGEN_TEST_WORKER=f"kill={kill}" if kill else signal_at
    )
    resume = ["--resume"] if os.path.exists(os.path.join(out_dir, "ckpt_last.pt")) else []
    return subprocess.Popen(
        [sys.executable, WORKER, *ARGS, "--out_dir", str(out_dir), "--log_interval", "1", *resume],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_to_end(out_dir):
    p = start(out_dir)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    return losses(out_dir)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, ptb):
    """The uninterrupted run, in a subprocess like the faulty ones (same thread count: bit-exact
    comparisons need the same reduction order): (its folder, its losses)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    return out, run_to_end(out)


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[1]


def test_kill9_then_resume_reproduces_the_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "faulty"
    # fixed kill points: inside a step, inside an evaluation, inside a checkpoint write (after the
    # temporary file is written, before the rename)
    for kill in ("step:3", "evaluation:2", "checkpoint:2"):
        p = start(out, kill)
        p.communicate(timeout=300)
        assert p.returncode == -signal.SIGKILL
    # then a kill at a random moment of training (the run resumed: its steps.jsonl rewritten; about
    # 1 s of training is left on two cores)
    p, before = start(out), os.path.getmtime(out / "steps.jsonl")
    while os.path.getmtime(out / "steps.jsonl") == before and p.poll() is None:
        time.sleep(0.005)
    time.sleep(random.Random(0).uniform(0, 0.5))
    assert p.poll() is None, "the run ended before the random kill"
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=300)
    p = start(out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert losses(out) == reference  # same data order, dropout, optimizer, schedule: bit for bit
    assert not [
        f for f in os.listdir(out) if f.endswith(".tmp")
    ]  # stale temporary files cleaned up
    best, last = (
        load_checkpoint(str(out / "ckpt_best.pt")),
        load_checkpoint(str(out / "ckpt_last.pt")),
    )
    assert last["state"]["step"] == 16 and best["state"]["best_val"] == last["state"]["best_val"]


def test_ctrl_c_writes_a_resumable_checkpoint(reference, tmp_path):
    """SIGINT arrives during step 6 (after its backward): the step finishes, its checkpoint is
    written, exit 0; --resume then gives the uninterrupted run's losses."""
    out = tmp_path / "sigint"
    p = start(out, signal_at="sigint=6")
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "stopped by Ctrl-C after step 6" in stdout, err[-2000:]
    assert "Traceback" not in err
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == 6
    p = start(out)
    p.communicate(timeout=300)
    assert p.returncode == 0 and losses(out) == reference


def test_disk_full_during_a_checkpoint_write(tmp_path, monkeypatch):
    """The disk fills up while a checkpoint is written: one line naming the file and the disk, the
    previous checkpoint intact, no temporary file left."""
    path = tmp_path / "ckpt_last.pt"
    args = dict(model="gpt", head="softmax", task="completion", dataset="ptb", window=None)
    ckpt = dict(model={"w": torch.ones(3)}, config={}, args=args, vocab="gpt2", state=dict(step=0))
    save_checkpoint(ckpt, str(path))
    real_save = torch.save

    def full(obj, f):
        real_save(obj, f)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0\n"
            "PytorchStreamWriter failed writing file data/0: file write failed"
        )

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(
        common.UserError, match="could not write .*file write failed.*previous checkpoint.*intact"
    ):
        save_checkpoint(dict(ckpt, model={"w": torch.zeros(3)}), str(path))
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(
        load_checkpoint(str(path))["model"]["w"], torch.ones(3)
    )  # the old one survived
    assert os.listdir(tmp_path) == ["ckpt_last.pt"]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # curves.png of a diverging run draws
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, ptb, capsys):
    out = tmp_path / "nan"
    args = [a for a in ARGS[:-6] if a != "--no_curves"] + [
        "--max_iters",
        "30",
        "--eval_interval",
        "1",
        "--lr",
        "1e30",
        "--grad_clip",
        "0",
        "--out_dir",
        str(out),
    ]
    rc = run_cli(train.main, args)
    err = capsys.readouterr().err
    assert rc == 2 and "non-finite" in err and "at step" in err and "ckpt_last.pt, if any" in err
    ckpt = load_checkpoint(str(out / "ckpt_last.pt"))
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_a_head_not_finite_at_t_0_is_named_as_the_suspect(tmp_path, ptb, capsys, monkeypatch):
    """Exercise 1's mistake (log t with no clamp at context / padding positions, t <= 0) trains
    to NaN; the message names the head's values there."""

    def unclamped(z_eos, t, epsilon, authors=False):
        a = z_eos.float() + 0.1 * torch.log(t.float())  # NaN at t < 0, -inf at 0: NaN gradients
        return torch.nn.functional.logsigmoid(a), torch.nn.functional.logsigmoid(-a)

    monkeypatch.setattr(heads, "nmst_log_alpha", unclamped)
    rc = run_cli(
        train.main,
        ARGS[:-6]
        + [
            "--max_iters",
            "4",
            "--eval_interval",
            "2",
            "--log_interval",
            "1",
            "--out_dir",
            str(tmp_path / "nan"),
        ],
    )
    err = capsys.readouterr().err
    assert (
        rc == 2 and "non-finite training loss" in err and "--head nmst's values at t <= 0" in err
    ), err
    monkeypatch.undo()  # the message names the head only where it reads t
    rc = run_cli(
        train.main,
        ARGS[:-6]
        + [
            "--head",
            "softmax",
            "--max_iters",
            "30",
            "--eval_interval",
            "1",
            "--lr",
            "1e30",
            "--grad_clip",
            "0",
            "--out_dir",
            str(tmp_path / "va"),
        ],
    )
    err = capsys.readouterr().err
    assert rc == 2 and "non-finite" in err and "t <= 0" not in err, err


def test_existing_run_is_not_overwritten(tmp_path, ptb, capsys):
    out = tmp_path / "twice"
    train.main(ARGS[:-6] + ["--max_iters", "2", "--eval_interval", "1", "--out_dir", str(out)])
    assert run_cli(train.main, ARGS + ["--out_dir", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_unwritable_out_dir(tmp_path, capsys, monkeypatch):
    """A file as --out_dir, a folder under a file, or one in /proc: one line, before any data is
    read."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(train, "load_data", lambda *a, **k: pytest.fail("the data was read"))
    for out in (blocker, blocker / "sub", "/proc/nanogen-run"):
        assert run_cli(train.main, ARGS + ["--out_dir", str(out)]) == 2
        assert f"cannot write to --out_dir {out}" in capsys.readouterr().err


def test_same_seed_same_decodes(reference_run, tmp_path):
    """(The same seed giving the same losses: every resumed run above equals the reference.)"""
    out = reference_run[0]
    import evaluate

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        evaluate.main(
            [
                "--ckpt",
                str(out / "ckpt_last.pt"),
                "--no_ppl",
                "--decoder",
                "nucleus",
                "--p",
                "0.9",
                "--L",
                "20",
                "--limit",
                "10",
                "--seed",
                "3",
                "--out",
                str(path),
            ]
        )
    assert (
        json.loads(a.read_text())["decoding"]["generated_lengths"]
        == json.loads(b.read_text())["decoding"]["generated_lengths"]
    )
