"""Faults by class, on real tiny runs: no silent wrong number, no lost work, no run that silently
does nothing, no traceback for a user's error; a real SIGTERM, and a real full disk where the
machine allows it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import common
import config
import evaluate
import train
from common import load_checkpoint, save_checkpoint
from conftest import ROOT, TINY_LSTM, assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them

SHARED = os.environ.get("NANOGEN_DATA") or os.path.join(ROOT, "..", "shared", "data")
TINY = list(TINY_LSTM)


def tiny_run(out, iters=4, every=2, extra=()):
    train.main(
        TINY
        + ["--out_dir", str(out), "--max_iters", str(iters), "--eval_interval", str(every), *extra]
    )
    return out


def steps_of(out):
    return [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]


def reordered_wikitext2(folder):
    """WikiText-2 with the train lines reversed: the same words, so the same vocabulary size,
    but ranked in another order (ties by first occurrence): every id means another word."""
    folder.mkdir()
    with (
        zipfile.ZipFile(os.path.join(SHARED, "wikitext-2-v1.zip")) as z,
        zipfile.ZipFile(folder / "copy.zip", "w") as out,
    ):
        for name in z.namelist():
            data = z.read(name)
            if name.endswith("wiki.train.tokens"):
                data = b"\n".join(reversed(data.split(b"\n")))
            out.writestr(name, data)
    return folder


def test_silent_wrong_numbers_are_refused(tmp_path, capsys):
    """Other data behind the same vocabulary size, --limit 0 and a truncated prepared cache: each
    is refused or repaired, never a quiet wrong figure."""
    out = tmp_path / "run"
    train.main(
        [
            "--model",
            "lstm",
            "--dataset",
            "wikitext2",
            "--d_model",
            "8",
            "--batch_size",
            "8",
            "--train_seqs",
            "40",
            "--eval_seqs",
            "8",
            "--max_iters",
            "2",
            "--eval_interval",
            "2",
            "--out_dir",
            str(out),
        ]
    )
    other = reordered_wikitext2(tmp_path / "other")
    ckpt = str(out / "ckpt_last.pt")
    rc, err = run_in_process(
        evaluate.main, ["--ckpt", ckpt, "--data_dir", str(other), "--limit", "4"], capsys
    )
    assert_one_line_error(rc, err, "was trained on another vocabulary than the wikitext2 data")
    rc, err = run_in_process(
        train.main,
        [
            "--model",
            "lstm",
            "--dataset",
            "wikitext2",
            "--out_dir",
            str(out),
            "--resume",
            "--data_dir",
            str(other),
            "--max_iters",
            "4",
        ],
        capsys,
    )
    assert_one_line_error(rc, err, "was trained on another vocabulary")
    rc, err = run_in_process(evaluate.main, ["--ckpt", ckpt, "--limit", "0"], capsys)
    assert_one_line_error(rc, err, "argument --limit: must be >= 1, got 0")
    # a truncated valid.idx in the prepared cache: rebuilt (with a note), the full count again
    from data.loader import load
    from data.prepare import check_prepared, prepare

    folder = prepare("wikitext2", verbose=False)
    with open(os.path.join(folder, "valid.idx"), "r+b") as f:
        f.truncate(100 * 8)
    check_prepared.cache_clear()  # (checked once per process: as in a new one)
    meta2, splits2, _ = load("wikitext2", verbose=True)
    assert len(splits2["valid"]) == 1777 and "damaged (valid.idx differ" in capsys.readouterr().err


def test_evaluate_reads_the_runs_own_data_folder(tmp_path, capsys, monkeypatch):
    """A run trained on a local copy (--data_dir) is evaluated from it, offline and without
    NANOGEN_DATA (it tried to download its data); once that folder is gone, from NANOGEN_DATA."""
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(SHARED, "ptb"), copy)
    ckpt = str(tiny_run(tmp_path / "run", 1, 1, ["--data_dir", str(copy)]) / "ckpt_last.pt")
    capsys.readouterr()
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    monkeypatch.delenv("NANOGEN_DATA", raising=False)
    evaluate.main(["--ckpt", ckpt, "--limit", "4"])
    from_copy = capsys.readouterr().out
    shutil.rmtree(copy)
    monkeypatch.setenv("NANOGEN_DATA", SHARED)
    evaluate.main(["--ckpt", ckpt, "--limit", "4"])
    assert "ppl" in from_copy and capsys.readouterr().out == from_copy


def test_lost_work_is_prevented(tmp_path, capsys):
    """A trained model is never replaced, a torn log line never blocks a resume, and evaluate.py
    refuses an output path before it computes anything, and one that would replace an input or
    a checkpoint."""
    out = tiny_run(tmp_path / "run")
    os.remove(out / "ckpt_last.pt")  # only the best model is left: a new run must not replace it
    rc, err = run_in_process(train.main, TINY + ["--out_dir", str(out), "--max_iters", "2"], capsys)
    assert_one_line_error(rc, err, "already holds a run: continue it with --resume")
    # torn last lines (a crash or a full disk mid-write) are dropped on resume
    torn = tiny_run(tmp_path / "torn", iters=4, every=2)
    for name in ("steps.jsonl", "log.jsonl"):
        with open(torn / name, "a") as f:
            f.write('{"step": 5, "lo')
    train.main(TINY + ["--out_dir", str(torn), "--max_iters", "6", "--resume"])
    assert [r["step"] for r in steps_of(torn)] == [1, 2, 3, 4, 5, 6]
    # evaluate.py: an --out / --plot it could not write is an error before any work
    for flags, msg in (
        (["--out", str(tmp_path / "file.txt" / "res.json")], "cannot write to --out"),
        (["--decoder", "greedy", "--plot", str(torn / "steps.jsonl")], "cannot write to --plot"),
        (["--out", str(torn / "ckpt_best.pt")], "would replace a checkpoint or an input"),
        (["--out", str(torn / "ckpt_last.pt")], "would replace a checkpoint or an input"),
    ):
        (tmp_path / "file.txt").write_text("x")
        t0 = time.time()
        rc, err = run_in_process(
            evaluate.main, ["--ckpt", str(torn / "ckpt_last.pt"), *flags], capsys
        )
        assert_one_line_error(rc, err, msg)
        assert time.time() - t0 < 1.0  # refused up front, not after an evaluation


@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_termination_signals_checkpoint_like_ctrl_c(sig, tmp_path):
    """What schedulers and `docker stop` send: the step finishes, ckpt_last.pt is written, the
    run exits 0 and resumes to the end."""
    out = tmp_path / sig
    args = [
        sys.executable,
        "train.py",
        *TINY,
        "--out_dir",
        str(out),
        "--max_iters",
        "100000",
        "--eval_interval",
        "50000",
    ]
    p = subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        os.path.exists(out / "steps.jsonl") and len(steps_of(out)) >= 3
    ):
        time.sleep(0.2)
    p.send_signal(getattr(signal, sig))
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0 and f"stopped by {sig} after step" in stdout, err[-2000:]
    step = load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"]
    assert 3 <= step < 50000
    train.main(
        TINY
        + [
            "--out_dir",
            str(out),
            "--max_iters",
            str(step + 2),
            "--resume",
            "--eval_interval",
            "50000",
        ]
    )
    assert [r["step"] for r in steps_of(out)] == list(range(1, step + 3))


def mount_tmpfs(path, size):
    path.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}): no real full disk to test on")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:120]}): no real full disk")


def test_real_full_disk(tmp_path, capsys):
    """An 8 MB tmpfs filled up: the checkpoint that does not fit is an error naming the disk and
    leaves the previous one intact, and once space is freed the run resumes to exactly the
    uninterrupted run's losses."""
    ref = tiny_run(tmp_path / "ref", iters=6, every=2)
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "8m")
    try:
        out = tiny_run(disk / "run", iters=2, every=2)
        filler = disk / "filler"
        with open(filler, "wb") as f:  # leave ~100 KB: logs fit, a 2 MB checkpoint does not
            f.write(b"\0" * (shutil.disk_usage(disk).free - 100_000))
        rc, err = run_in_process(
            train.main,
            TINY + ["--out_dir", str(out), "--max_iters", "6", "--eval_interval", "2", "--resume"],
            capsys,
        )
        assert_one_line_error(rc, err, "(the previous checkpoint, if any, is intact)")
        assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == 2
        assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
        os.remove(filler)
        train.main(
            TINY + ["--out_dir", str(out), "--max_iters", "6", "--eval_interval", "2", "--resume"]
        )
        assert steps_of(out) == steps_of(ref)  # bit for bit, as if nothing had happened
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_resume_removes_the_temporary_files_of_interrupted_writes(tmp_path):
    """A SIGKILL during an atomic write (a checkpoint, curves.png) leaves its temporary file;
    the next run in the folder removes them, and nothing else."""
    out = tiny_run(tmp_path / "run", iters=2, every=2)
    stale = ["ckpt_last.pt.tmp", "ckpt_best.pt.tmp", "curves.png.tmp"]
    for name in [*stale, "notes.tmp"]:
        (out / name).write_bytes(b"half")
    train.main(
        TINY + ["--out_dir", str(out), "--max_iters", "4", "--eval_interval", "2", "--resume"]
    )
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == ["notes.tmp"]


def test_runs_that_would_do_nothing_are_errors(tmp_path, capsys):
    """Zero optimizer steps per epoch, a schedule that would turn the lr negative or divide by
    zero: errors naming the flag, before anything is written."""
    cases = [
        (["--grad_accum", "20"], "fewer than --grad_accum 20: no step would run"),
        (
            ["--model", "gpt", "--n_head", "2", "--block_size", "8", "--batch_size", "8"],
            "fewer than --grad_accum 1",
        ),  # (no training sequence fits either)
        (
            [
                "--model",
                "gpt",
                "--n_head",
                "2",
                "--block_size",
                "11",
                "--batch_size",
                "8",
                "--train_seqs",
                "0",
            ],
            "no validation sequence fits the --block_size 11 window",
        ),  # (PTB: train inputs of 11, valid 12+)
        (["--lr_decay", "-0.5"], "argument --lr_decay: must be in (0, 1], got -0.5"),
        (["--warmup", "-3", "--lr_schedule", "linear"], "argument --warmup: must be >= 0, got -3"),
        (
            ["--decay_steps", "0", "--lr_schedule", "linear"],
            "argument --decay_steps: must be >= 1, got 0",
        ),
    ]
    for flags, msg in cases:
        out = tmp_path / "o"
        rc, err = run_in_process(train.main, TINY + ["--out_dir", str(out), *flags], capsys)
        assert_one_line_error(rc, err, msg)
        assert not out.exists(), flags


def test_no_tracebacks(tmp_path, capsys, monkeypatch):
    """A damaged prepared cache, a zip member with a bad CRC, text that is not UTF-8, a cache
    path that is a file, an unknown device, checkpoints with the wrong contents, --compare of a
    non-study, data.prepare / bench.py errors, Ctrl-C in evaluate.py: each one line, exit 2 (130
    for Ctrl-C), no traceback."""
    from data.loader import load
    from data.prepare import check_prepared, prepare

    for name in ("valid.bin", "meta.json"):  # missing files: rebuilt
        os.remove(os.path.join(prepare("ptb", verbose=False), name))
        check_prepared.cache_clear()
        assert len(load("ptb", verbose=False)[1]["valid"]) == 2863
    assert "is damaged" in capsys.readouterr().err  # (said, and rebuilt)
    lines = "\n".join(" ".join(f"w{i}" for i in range(12)) for _ in range(50)) + "\n"
    bad_crc = tmp_path / "crc"
    bad_crc.mkdir()
    with zipfile.ZipFile(bad_crc / "copy.zip", "w") as z:  # stored, so a flipped byte stays
        for s in ("train", "valid", "test"):
            z.writestr(f"wikitext-2/wiki.{s}.tokens", lines)
    raw = bytearray((bad_crc / "copy.zip").read_bytes())
    raw[raw.index(b"w11") + 1] ^= 1
    (bad_crc / "copy.zip").write_bytes(bytes(raw))
    utf = tmp_path / "utf" / "wikitext-2"
    utf.mkdir(parents=True)
    for s in ("train", "valid", "test"):
        (utf / f"wiki.{s}.tokens").write_bytes(
            lines.encode() + (b"\xff\xfe\n" if s == "valid" else b"")
        )
    cache_file = tmp_path / "cache-is-a-file"
    cache_file.write_text("x")
    cases = [
        (["--dataset", "wikitext2", "--data_dir", str(bad_crc)], {}, "Bad CRC-32"),
        (["--dataset", "wikitext2", "--data_dir", str(utf.parent)], {}, "not UTF-8"),
        (["--dataset", "ptb"], {"NANOGEN_CACHE": str(cache_file)}, "set NANOGEN_CACHE"),
        (["--dataset", "ptb", "--device", "tpu"], {}, "--device tpu: unknown device"),
    ]
    for flags, env, msg in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        rc, err = run_in_process(
            train.main, ["--model", "lstm", *flags, "--out_dir", str(tmp_path / "o")], capsys
        )
        assert_one_line_error(rc, err, msg)
        for k in env:
            monkeypatch.undo()
    wrapper_cases(tmp_path, capsys)
    entry_points_and_interrupts(tmp_path, capsys, monkeypatch)


def wrapper_cases(tmp_path, capsys):
    """Checkpoints with the wrong contents; --compare of a non-study."""
    cfg = dict(
        config.DEFAULTS,
        model="lstm",
        head="softmax",
        vocab_size=10,
        eos_id=0,
        n_layer=1,
        d_model=4,
        dropout=0.0,
        tie=True,
        bias=True,
    )
    forged = {
        "no-config.pt": dict(model={"w": torch.zeros(2)}),
        "wrong-shapes.pt": dict(
            model={"w": torch.zeros(2)},
            config=cfg,
            args=dict(cfg, task="completion", dataset="ptb", window=None),
            vocab="gpt2",
            state=dict(step=1),
        ),
    }
    msgs = {
        "no-config.pt": "is not a checkpoint written by train.py",
        "wrong-shapes.pt": "do not fit its model",
    }
    for name, obj in forged.items():
        save_checkpoint(obj, str(tmp_path / name))
        rc, err = run_in_process(evaluate.main, ["--ckpt", str(tmp_path / name)], capsys)
        assert_one_line_error(rc, err, msgs[name])
    (tmp_path / "notastudy.json").write_text(json.dumps({"head": "nmst"}))
    for study in ("notastudy.json", "no-config.pt"):  # (a checkpoint: not even JSON)
        rc, err = run_in_process(evaluate.main, ["--compare", str(tmp_path / study)], capsys)
        assert_one_line_error(rc, err, f"{study} is not a study of evaluate.py --decoder")


def entry_points_and_interrupts(tmp_path, capsys, monkeypatch):
    nowhere = ["--dataset", "wikitext2", "--data_dir", str(tmp_path / "nowhere")]
    for cmd, msg in (
        ([sys.executable, "-m", "data.prepare", *nowhere], "no wikitext2 data in"),
        ([sys.executable, "data/prepare.py", *nowhere], "no wikitext2 data in"),  # nanoGPT's way
        ([sys.executable, "bench.py", "train", "--iters", "0"], "--iters: must be >= 1"),
    ):
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert_one_line_error(p.returncode, p.stderr, msg)
    out = tiny_run(tmp_path / "ctrlc", iters=2, every=2)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "decoding_study", interrupted)
    res = tmp_path / "never.json"
    rc, err = run_in_process(
        evaluate.main,
        ["--ckpt", str(out / "ckpt_last.pt"), "--no_ppl", "--decoder", "greedy", "--out", str(res)],
        capsys,
    )
    assert rc == 130 and err.strip() == "error: interrupted (Ctrl-C)"
    assert not res.exists()


def test_an_output_whose_folder_cannot_be_made_is_a_user_error(tmp_path, capsys):
    """A checkpoint, or reproduce.py's --runs, under a path whose folder is a file: one line, no
    traceback, nothing left behind."""
    import reproduce

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(common.UserError, match="could not write .*the previous checkpoint"):
        save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a_file" / "ckpt_last.pt"))
    rc, err = run_in_process(
        reproduce.main,
        [
            "nmst-table1",
            "--scale",
            "tiny",
            "--out",
            str(tmp_path / "res"),
            "--runs",
            str(tmp_path / "a_file" / "runs"),
        ],
        capsys,
    )
    assert_one_line_error(rc, err, "--runs")
    assert os.listdir(tmp_path) == ["a_file"]


@pytest.mark.parametrize(
    "flag,value,msg",
    [
        ("--lr", "-1", "--lr: must be > 0, got -1"),
        ("--lr", "nan", "--lr: must be > 0, got nan"),
        ("--patience", "0", "--patience: must be >= 1"),
        ("--grad_clip", "-1", "--grad_clip: must be >= 0"),
        ("--weight_decay", "-0.1", "--weight_decay: must be >= 0"),
        ("--seed", "-1", "--seed: must be in [0, 2^63)"),
        ("--ar", "nan", "--ar: must be >= 0"),
        ("--tar", "-1", "--tar: must be >= 0"),
        ("--batch_size", "0", "--batch_size: must be >= 1"),
        ("--eval_seqs", "-1", "--eval_seqs: must be >= 0"),
        ("--train_seqs", "-5", "--train_seqs: must"),
        ("--max_iters", "-1", "--max_iters: must be >= 0"),
        ("--bptt", "0", "--bptt: must be >= 1"),
        ("--eval_interval", "-2", "--eval_interval: must be"),
        ("--n_layer", "0", "--n_layer: must"),
        ("--dropout", "1", "--dropout: must be in [0, 1)"),
        ("--beta2", "1", "--beta2: must be in [0, 1)"),
        ("--block_size", "0", "--block_size: must be >= 1"),
        ("--epsilon", "nan", "--epsilon: must"),
        ("--max_epochs", "0", "--max_epochs: must be >= 1"),
        ("--n_experts", "0", "--n_experts: must"),
        ("--lr", "fast", "--lr: expected float, got 'fast'"),
    ],
)
def test_bad_flag_values(flag, value, msg, tmp_path, capsys):
    """Every numeric flag with an impossible value (NaN included): one line naming the flag,
    exit 2, nothing written."""
    rc, err = run_in_process(
        train.main, TINY + [flag, value, "--out_dir", str(tmp_path / "o")], capsys
    )
    assert_one_line_error(rc, err, msg)
    assert not (tmp_path / "o").exists()
