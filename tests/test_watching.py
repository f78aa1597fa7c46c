"""Watching a run learn: the termination probe equals evaluate.py's greedy study, curves.png is
redrawn at every evaluation (a figure that cannot be written is a warning), TensorBoard gets the
same scalars, runs side by side are labelled by the flags that differ, and a resumed run leaves
the logs of an uninterrupted one."""
import json
import os
import shutil
import sys
import time
import types

import pytest

import cli
import curves
import evaluate
import runs
import train
from conftest import assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = ["--model", "lstm", "--epsilon", "1e-3", "--dataset", "ptb", "--d_model", "16", "--dropout", "0.1",
        "--batch_size", "8", "--lr", "3e-3", "--train_seqs", "96", "--eval_seqs", "16", "--seed", "2",
        "--probe", "16", "--probe_L", "30", "--log_interval", "1"]
TIMING = ("tokens_per_s", "elapsed_s", "probe_seconds", "mfu")


def log(folder):
    return [json.loads(line) for line in open(folder / "log.jsonl")]


def test_the_probe_is_evaluate_greedy(tmp_path, monkeypatch):
    import tasks
    bars = []  # evaluate.py's perplexity pass has a progress bar, train.py's evaluations none
    monkeypatch.setattr(tasks, "bar", lambda items, desc: bars.append(desc) or items)
    out = tmp_path / "run"
    assert train.main(TINY + ["--head", "softmax", "--max_iters", "4", "--eval_interval", "2", "--out_dir",
                              str(out)]) == 0
    last = log(out)[-1]
    study = tmp_path / "greedy.json"
    assert evaluate.main(["--ckpt", str(out / "ckpt_last.pt"), "--decoder", "greedy", "--L", "30", "--limit",
                          "16", "--out", str(study)]) == 0
    d = json.loads(study.read_text())
    assert last["probe_r_nt"] == d["decoding"]["r_nt"]["30"]
    assert last["probe_mean_length"] == pytest.approx(d["decoding"]["mean_length"])
    assert last["probe_eos_at_end"] == pytest.approx(d["eos_prob_at_end"], rel=1e-6)
    assert set(bars) == {None, "perplexity (valid)"} and bars[-1] == "perplexity (valid)"


def test_tokens_per_second_leave_out_checkpoint_writing(tmp_path, monkeypatch):
    """tok/s (and MFU) count the training steps since the last evaluation, not the writing of
    its checkpoints (GPT-2 124M with AdamW: 1.5 GB each).  Here each write takes 1000 s."""
    late, write = [0.0], runs.save_checkpoint
    clock = types.SimpleNamespace(time=lambda: time.time() + late[0])
    monkeypatch.setattr(train, "time", clock)  # the loop's clock, and the run's (interval starts)
    monkeypatch.setattr(runs, "time", clock)
    monkeypatch.setattr(runs, "save_checkpoint", lambda obj, path: late.__setitem__(0, late[0] + 1000)
                        or write(obj, path))
    out = tmp_path / "run"
    assert train.main(TINY + ["--head", "nmst", "--max_iters", "6", "--eval_interval", "2", "--probe", "0",
                              "--out_dir", str(out)]) == 0
    rates = [r["tokens_per_s"] for r in log(out)]
    assert len(rates) == 3 and min(rates) > 50, rates  # 2 steps of ~200 tokens: < 1 with a write


def test_each_evaluation_redraws_the_curves_and_writes_ckpt_last_once(tmp_path, monkeypatch, capsys):
    drawn, written = [], []
    draw, write = curves.draw_run, runs.save_checkpoint
    monkeypatch.setattr(curves, "draw_run", lambda folder: drawn.append(draw(folder)))
    monkeypatch.setattr(runs, "save_checkpoint", lambda obj, path: written.append(os.path.basename(path))
                        or write(obj, path))
    out = tmp_path / "run"
    assert train.main(TINY + ["--head", "nmst", "--max_iters", "6", "--eval_interval", "2", "--out_dir",
                              str(out)]) == 0
    assert drawn == [str(out / "curves.png")] * 3 and (out / "curves.png").stat().st_size > 10_000
    assert written.count("ckpt_last.pt") == 3  # steps 2, 4, 6: the end is not written twice
    assert "probe: r_nt(30)" in capsys.readouterr().out


def test_a_figure_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, capsys):
    def refuse(fig, path):
        raise cli.UserError(f"could not write {path}: Read-only file system")
    monkeypatch.setattr(cli, "save_figure", refuse)
    assert train.main(TINY + ["--head", "st", "--max_iters", "2", "--eval_interval", "2", "--out_dir",
                              str(tmp_path / "run")]) == 0
    assert "warning: could not write" in capsys.readouterr().err


def test_tensorboard_gets_the_logged_scalars(tmp_path, monkeypatch):
    scalars = []

    class SummaryWriter:
        def __init__(self, folder, purge_step=None):
            self.folder = folder

        def add_scalar(self, key, value, step):
            scalars.append((key, step))

        def flush(self):
            pass

        def close(self):
            pass
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    assert train.main(TINY + ["--head", "nmst", "--max_iters", "2", "--eval_interval", "2", "--tensorboard",
                              "--out_dir", str(tmp_path / "run")]) == 0
    assert {"val_ppl", "train_loss", "lr", "probe_r_nt"} <= {k for k, _ in scalars}


def test_tensorboard_missing_is_refused_before_anything_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # (not installed)
    rc, err = run_in_process(train.main, TINY + ["--tensorboard", "--out_dir", str(tmp_path / "run")],
                             capsys)
    assert_one_line_error(rc, err, "--tensorboard needs the tensorboard package: pip install")
    assert not (tmp_path / "run").exists()  # (it came once the data and the folder were made)


def test_runs_side_by_side_are_labelled_by_what_differs(tmp_path, capsys, monkeypatch):
    folders = []
    for head in ("softmax", "nmst"):
        folders.append(str(tmp_path / head))
        assert train.main(TINY + ["--head", head, "--max_iters", "4", "--eval_interval", "2", "--out_dir",
                                  folders[-1]]) == 0
    capsys.readouterr()
    assert curves.main([*folders, "--out", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "| run (head) |" in out and "| softmax |" in out and "| nmst |" in out
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert cli.run_cli(curves.main, [*folders, "--out", str(tmp_path / "cmp.pdf")]) == 2  # not a PNG
    assert "figures are written as PNG" in capsys.readouterr().err and not (tmp_path / "cmp.pdf").exists()
    ckpt = folders[1] + "/ckpt_best.pt"  # a checkpoint, a typo: named as what they are
    assert cli.run_cli(curves.main, [folders[0], ckpt, "--out", str(tmp_path / "cmp3.png")]) == 2
    assert f"{ckpt} is not a folder: give run folders" in capsys.readouterr().err
    log = tmp_path / "nmst" / "log.jsonl"  # lines that are JSON but not evaluations are skipped
    records = log.read_text().splitlines()
    log.write_text("\n".join(['[1]', '{"step": 1}', records[0], '{"step": 3, "val_loss": "x"}',
                              records[1][:-1] + ', "probe_L": null}', "\xff", '"a"', ""]))
    (tmp_path / "softmax" / "run.json").write_text("[]")
    assert curves.main([*folders, "--out", str(tmp_path / "cmp2.png")]) == 0
    damaged = capsys.readouterr().out
    assert damaged.count("\n") == out.count("\n") and (tmp_path / "cmp2.png").exists()
    assert curves.draw_run(folders[1], str(tmp_path / "one.png")) == str(tmp_path / "one.png")
    (tmp_path / "nmst" / "log.jsonl").write_text(records[0] + "\n")  # one evaluation: a marker, not an empty line
    drawn = []
    monkeypatch.setattr(curves, "save", lambda fig, path: drawn.append(fig))
    curves.overlay(folders, str(tmp_path / "cmp4.png"))
    (ppl_panel, _), = [fig.axes for fig in drawn]
    assert [len(line.get_xdata()) for line in ppl_panel.lines] == [2, 1]
    assert all(line.get_marker() not in ("None", "", None) for line in ppl_panel.lines)
    assert len(drawn[0].legends) == 1 and ppl_panel.get_legend() is None  # one legend, under both panels
    again = str(tmp_path / "again")  # the same flags, another folder: labelled by the folders
    shutil.copytree(folders[1], again)
    rows, _ = curves.overlay([folders[1], again], str(tmp_path / "cmp5.png"))
    assert [r.split(" |")[0] for r in rows[2:]] == [f"| lstm ({folders[1]})", f"| lstm ({again})"]


def test_a_label_names_every_flag_that_differs():
    runs = [dict(head="mos", temperature=t, seed=1, lr=0.003, d_model=128, loss_scaling=False,
                 lr_schedule="linear", out_dir=f"out/{t}") for t in (0.5, 1.0, 4.0)]
    runs[0].update(head="ct", loss_scaling=True, lr_schedule="constant")
    keys = curves.differing(runs)  # not out_dir: where a run is, not what it trained
    assert keys == ["head", "loss_scaling", "lr_schedule", "temperature"]
    assert [curves.label(r, keys, "run") for r in runs] == [
        "ct loss_scaling=True lr_schedule=constant temperature=0.5",
        "mos loss_scaling=False lr_schedule=linear temperature=1",
        "mos loss_scaling=False lr_schedule=linear temperature=4"]
    assert curves.label(runs[0], ["seed", "lr", "d_model"], "run") == "seed=1 lr=0.003 d_model=128"
    assert curves.label({"seed": None}, ["seed"], "out/run") == "run"
    assert [curves.label(dict(head=h, epsilon=e), ["head", "epsilon"], "run") for h, e in
            (("softmax", 1e-5), ("nmst", 1e-3))] == ["softmax", "nmst epsilon=0.001"]
    stream, *completion = (dict(model="lstm", head="ct", task=t, probe=p, lr_schedule="plateau", dataset="ptb")
                           for t, p in (("stream", 64), ("completion", 4), ("completion", 8)))  # a stream run is never probed
    keys = curves.differing([stream, *completion])
    assert [curves.label(r, keys, "run") for r in (stream, *completion)] == [
        "stream", "completion probe=4", "completion probe=8"]
    heads = [dict(head="softmax", epsilon=1e-5)] + [dict(head=h, epsilon=1e-3) for h in ("st", "nmst")]
    assert curves.differing(heads) == ["head"]  # eps alike where it is read (softmax ignores its default)
    assert curves.differing([*heads, dict(head="nmst", epsilon=1e-4)]) == ["head", "epsilon"]


def test_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    flags = TINY + ["--head", "nmst", "--eval_interval", "2"]
    assert train.main(flags + ["--max_iters", "6", "--out_dir", str(whole)]) == 0
    assert train.main(flags + ["--max_iters", "2", "--out_dir", str(parts)]) == 0
    assert train.main(flags + ["--max_iters", "6", "--out_dir", str(parts), "--resume"]) == 0

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
    env.update(MPLCONFIGDIR="/dev/null/nowhere", XDG_CACHE_HOME="/dev/null/nowhere", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "train.py", *TINY, "--head", "nmst", "--max_iters", "2", "--eval_interval",
                        "2", "--out_dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "run" / "curves.png").exists()


def test_the_cpu_estimate_times_steps_after_the_warm_up(capsys):
    """Steps 2-4 (the first warms up); with --compile steps 5-7, after the recompiles of new
    shapes (one at step 2 made the estimate ten times too slow)."""
    import torch
    from runs import Run
    for compiled, timed in ((False, [2, 3, 4]), (True, [5, 6, 7])):
        args = types.SimpleNamespace(out_dir="unused", lr=1e-3, compile=compiled, log_interval=99,
                                     max_iters=10, max_epochs=1, max_minutes=None)
        run = Run(args, cli.Dist(), scaler=None, epoch_tokens=1000, epoch_steps=10)
        for step in range(1, 9):
            run.state.step, run.step_tokens = step, 100
            run.after_step(torch.zeros(()), torch.tensor(False), seconds=float(step))
        assert run.timed == [(float(s), 100) for s in timed]
        assert capsys.readouterr().out.count("tokens/s on this CPU") == 1


def test_the_cpu_estimate_of_the_run_agrees_with_its_epoch_time(capsys):
    """The timed steps held 100 tokens each, an epoch's steps hold 200 on average: the run's time
    is its epochs times the epoch's time (the steps' seconds alone said half)."""
    import torch
    from runs import Run
    args = types.SimpleNamespace(out_dir="unused", lr=1e-3, compile=False, log_interval=99,
                                 max_iters=None, max_epochs=30, max_minutes=None)
    run = Run(args, cli.Dist(), scaler=None, epoch_tokens=120_000, epoch_steps=600)
    for step in range(1, 5):
        run.state.step, run.step_tokens = step, 100
        run.after_step(torch.zeros(()), torch.tensor(False), seconds=1.0)
    out = capsys.readouterr().out  # 100 tokens/s: 20 min an epoch, 30 epochs less 4 steps
    assert "100 tokens/s on this CPU: 20.0 min per epoch" in out
    assert f"has about {(30 * 600 - 4) * 200 / 100 / 3600:.1f} h to go;" in out
    args.max_minutes = 90  # sooner than the epochs: the time limit is the run's
    run.first_step, run.timed = 4, []
    for step in range(5, 9):
        run.state.step, run.step_tokens = step, 100
        run.after_step(torch.zeros(()), torch.tensor(False), seconds=1.0)
    assert "this run (18,000 steps) has about 1.5 h to go (--max_minutes);" in capsys.readouterr().out
