"""Watching a run learn: the termination probe equals evaluate.py's greedy study, curves.png is
redrawn at every evaluation (a figure that cannot be written is a warning), TensorBoard gets the
same scalars, runs side by side are labelled by the flags that differ, and a resumed run leaves
the logs of an uninterrupted one."""

import importlib.machinery
import json
import os
import shutil
import sys
import time
import types

import pytest
import torch

import common
import curves
import evaluate
import train
from conftest import assert_one_line_error, run_cli, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = [
    "--model",
    "lstm",
    "--epsilon",
    "1e-3",
    "--dataset",
    "ptb",
    "--d_model",
    "16",
    "--dropout",
    "0.1",
    "--batch_size",
    "8",
    "--lr",
    "3e-3",
    "--train_seqs",
    "96",
    "--eval_seqs",
    "16",
    "--seed",
    "2",
    "--probe",
    "16",
    "--probe_L",
    "30",
    "--log_interval",
    "1",
]
TIMING = ("tokens_per_s", "elapsed_s", "probe_seconds", "mfu")


def log(folder):
    return [json.loads(line) for line in open(folder / "log.jsonl")]


def test_the_probe_is_evaluate_greedy(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train.main(
        TINY
        + ["--head", "softmax", "--max_iters", "4", "--eval_interval", "2", "--out_dir", str(out)]
    )
    last = log(out)[-1]
    study = tmp_path / "greedy.json"
    evaluate.main(
        [
            "--ckpt",
            str(out / "ckpt_last.pt"),
            "--decoder",
            "greedy",
            "--L",
            "30",
            "--limit",
            "16",
            "--out",
            str(study),
        ]
    )
    d = json.loads(study.read_text())
    assert last["probe_r_nt"] == d["decoding"]["r_nt"]["30"]
    assert last["probe_mean_length"] == pytest.approx(d["decoding"]["mean_length"])
    assert last["eos_prob_at_end"] == pytest.approx(d["eos_prob_at_end"], rel=1e-6)


@pytest.mark.parametrize(
    "tokens, said", [([0], "[eos at t=1: the model ended at once]"), ([5, 0], '"5" [eos at t=2]')]
)
def test_the_probe_says_when_its_example_ended_at_once(tokens, said, monkeypatch, capsys):
    """An example continuation that is only eos prints as "", and the line says why."""
    import numpy as np

    result = dict(
        tokens=[tokens],
        terminated=torch.tensor([True]),
        lengths=torch.tensor([len(tokens)]),
        scores=torch.zeros(1),
    )
    monkeypatch.setattr(evaluate, "decode_in_batches", lambda *a, **kw: result)

    # One validation sequence, whose context is 1 2 3.
    class Split:
        contexts = np.array([3])

        def __len__(self):
            return 1

        def context(self, i):
            return np.array([1, 2, 3])

    split = Split()
    words = types.SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    data = dict(valid=split, tokenizer=words, eos_id=0)
    lm = types.SimpleNamespace(cfg=dict(model="lstm"))
    evaluate.probe(types.SimpleNamespace(probe=1, probe_L=30), lm, data)
    out = capsys.readouterr().out
    assert said in out, out
    assert ("ended at once" in out) == (tokens == [0]), out


def test_tokens_per_second_leave_out_checkpoint_writing(tmp_path, monkeypatch):
    """tok/s (and MFU) count the training steps since the last evaluation, not the writing of
    its checkpoints (GPT-2 124M with AdamW: 1.5 GB each).  Here each write takes 1000 s."""
    late, write = [0.0], common.save_checkpoint
    monkeypatch.setattr(train, "time", types.SimpleNamespace(time=lambda: time.time() + late[0]))
    monkeypatch.setattr(
        train,
        "save_checkpoint",
        lambda obj, path: late.__setitem__(0, late[0] + 1000) or write(obj, path),
    )
    out = tmp_path / "run"
    train.main(
        TINY
        + [
            "--head",
            "nmst",
            "--max_iters",
            "6",
            "--eval_interval",
            "2",
            "--probe",
            "0",
            "--out_dir",
            str(out),
        ]
    )
    rates = [r["tokens_per_s"] for r in log(out)]
    assert len(rates) == 3 and min(rates) > 50, rates  # 2 steps of ~200 tokens: < 1 with a write


def test_each_evaluation_redraws_the_curves_and_writes_ckpt_last_once(
    tmp_path, monkeypatch, capsys
):
    drawn, written = [], []
    draw, write = curves.draw_run, common.save_checkpoint
    monkeypatch.setattr(curves, "draw_run", lambda folder: drawn.append(folder) or draw(folder))
    monkeypatch.setattr(
        train, "save_checkpoint", lambda obj, path: written.append(path) or write(obj, path)
    )
    out = tmp_path / "run"
    train.main(
        TINY + ["--head", "nmst", "--max_iters", "6", "--eval_interval", "2", "--out_dir", str(out)]
    )
    assert drawn == [str(out)] * 3 and (out / "curves.png").stat().st_size > 10_000
    assert len(written) == 3  # steps 2, 4, 6: the end is not written twice
    assert "probe: r_nt(30)" in capsys.readouterr().out


def test_a_figure_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    def refuse(fig, path, **kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refuse)
    train.main(
        TINY
        + [
            "--head",
            "st",
            "--max_iters",
            "2",
            "--eval_interval",
            "2",
            "--out_dir",
            str(tmp_path / "run"),
        ]
    )
    assert "warning: could not write" in capsys.readouterr().err


def test_tensorboard_gets_the_logged_scalars(tmp_path, monkeypatch):
    scalars = []

    class SummaryWriter:
        def __init__(self, folder, purge_step=None):
            self.folder = folder

        def add_scalar(self, key, value, step):
            scalars.append((key, step))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    monkeypatch.setitem(
        sys.modules,
        "tensorboard",
        types.SimpleNamespace(__spec__=importlib.machinery.ModuleSpec("tensorboard", None)),
    )  # (installed)
    train.main(
        TINY
        + [
            "--head",
            "nmst",
            "--max_iters",
            "2",
            "--eval_interval",
            "2",
            "--tensorboard",
            "--out_dir",
            str(tmp_path / "run"),
        ]
    )
    assert {"val_ppl", "train_loss", "lr", "probe_r_nt"} <= {k for k, _ in scalars}


def test_tensorboard_missing_is_refused_before_anything_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # (not installed)
    rc, err = run_in_process(
        train.main, TINY + ["--tensorboard", "--out_dir", str(tmp_path / "run")], capsys
    )
    assert_one_line_error(rc, err, "--tensorboard needs the tensorboard package: pip install")
    assert not (tmp_path / "run").exists()  # (said before the data and the folder are made)


def test_runs_side_by_side_are_labelled_by_what_differs(tmp_path, capsys, monkeypatch):
    folders = []
    for head in ("softmax", "nmst"):
        folders.append(str(tmp_path / head))
        train.main(
            TINY
            + ["--head", head, "--max_iters", "4", "--eval_interval", "2", "--out_dir", folders[-1]]
        )
    capsys.readouterr()
    curves.main([*folders, "--out", str(tmp_path / "cmp.png")])
    out = capsys.readouterr().out
    assert (
        "| VA+ |" in out and "| NMST+ |" in out
    )  # (the papers' names; eps: nmst's alone, no label)
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert run_cli(curves.main, [*folders, "--out", str(tmp_path / "cmp.pdf")]) == 2  # not a PNG
    assert (
        "is a PNG: name it .png" in capsys.readouterr().err and not (tmp_path / "cmp.pdf").exists()
    )
    ckpt = folders[1] + "/ckpt_best.pt"  # a checkpoint, a typo: named as what they are
    assert run_cli(curves.main, [folders[0], ckpt, "--out", str(tmp_path / "cmp3.png")]) == 2
    assert f"no evaluations logged in {ckpt}" in capsys.readouterr().err
    log = tmp_path / "nmst" / "log.jsonl"  # lines that are not JSON objects are skipped
    records = log.read_text().splitlines()
    log.write_text("\n".join(["[1]", records[0], records[1][:40], records[1], "\xff", '"a"', ""]))
    curves.main([*folders, "--out", str(tmp_path / "cmp2.png")])
    assert capsys.readouterr().out == out and (tmp_path / "cmp2.png").exists()
    again = str(tmp_path / "again")  # the same flags, another folder: labelled by the folders
    shutil.copytree(folders[1], again)
    rows = curves.overlay([folders[1], again], str(tmp_path / "cmp5.png"))
    assert [r.split(" |")[0] for r in rows[2:]] == [f"| NMST+ ({folders[1]})", f"| NMST+ ({again})"]


def test_a_label_names_every_flag_that_differs():
    runs = [
        dict(
            head="mos",
            temperature=t,
            seed=1,
            lr=0.003,
            d_model=128,
            loss_scaling=False,
            lr_schedule="linear",
            out_dir=f"out/{t}",
        )
        for t in (0.5, 1.0, 4.0)
    ]
    runs[0].update(head="ct", loss_scaling=True, lr_schedule="constant")
    assert curves.labels([(r, "run") for r in runs]) == [  # not out_dir: where a run is, not what
        "CT loss_scaling=True lr_schedule=constant temperature=0.5",
        "MoS loss_scaling=False lr_schedule=linear temperature=1.0",
        "MoS loss_scaling=False lr_schedule=linear temperature=4.0",
    ]
    heads = [dict(head="softmax", epsilon=1e-5)] + [
        dict(head=h, epsilon=1e-3) for h in ("st", "nmst")
    ]
    assert curves.labels([(h, "run") for h in heads]) == [
        "VA+",
        "ST+",
        "NMST+",
    ]  # eps alike where read
    assert curves.labels([(h, "run") for h in heads + [dict(head="nmst", epsilon=1e-4)]])[2:] == [
        "NMST+ epsilon=0.001",
        "NMST+ epsilon=0.0001",
    ]
    assert curves.labels([({}, "out/a"), ({}, "out/b")]) == ["a", "b"]  # no args.json: the folders


def test_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    flags = TINY + ["--head", "nmst", "--eval_interval", "2"]
    train.main(flags + ["--max_iters", "6", "--out_dir", str(whole)])
    train.main(flags + ["--max_iters", "2", "--out_dir", str(parts)])
    train.main(flags + ["--max_iters", "6", "--out_dir", str(parts), "--resume"])

    def same(records):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in records]

    assert same(log(whole)) == same(log(parts))
    assert (parts / "curves.png").exists()


def test_no_display_and_no_font_cache_still_train(tmp_path):
    """matplotlib with no display and an unwritable config / font-cache folder: the run trains
    and draws (matplotlib falls back to a temporary folder)."""
    import os
    import subprocess

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    env.update(
        MPLCONFIGDIR="/dev/null/nowhere", XDG_CACHE_HOME="/dev/null/nowhere", OMP_NUM_THREADS="1"
    )
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            *TINY,
            "--head",
            "nmst",
            "--max_iters",
            "2",
            "--eval_interval",
            "2",
            "--out_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "run" / "curves.png").exists()


def test_a_folder_made_meanwhile_by_another_torchrun_process_is_no_error(tmp_path):
    """Every process of a torchrun checks --out_dir at once: the check makes nothing (no race
    between one process's look and another's making), and a folder already made passes."""
    curves.check_out_dir(str(tmp_path / "run"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "run").mkdir()  # another process's
    curves.check_out_dir(str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run") == []
    (tmp_path / "file").write_text("")  # a file where a folder would go: still refused
    with pytest.raises(curves.UserError, match="cannot write to --out_dir"):
        curves.check_out_dir(str(tmp_path / "file" / "run"))
