"""train.py / evaluate.py end to end on real PTB (tiny models, seconds), resume, and bad input:
one clear error line, non-zero exit, no traceback."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import common
import curves
import evaluate
import train
from common import load_checkpoint
from conftest import ROOT, assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them

TINY = [
    "--dataset",
    "ptb",
    "--d_model",
    "32",
    "--n_head",
    "2",
    "--lr",
    "3e-3",
    "--train_seqs",
    "400",
    "--eval_seqs",
    "60",
    "--seed",
    "1",
    "--no_curves",
]  # (curves.png: test_watching.py)


def tiny_args(model, head, out_dir, iters=24, every=12):
    size = ["--max_tokens", "1200"] if model == "gpt" else ["--batch_size", "8"]
    return (
        TINY
        + size
        + [
            "--model",
            model,
            "--head",
            head,
            "--out_dir",
            str(out_dir),
            "--max_iters",
            str(iters),
            "--eval_interval",
            str(every),
        ]
    )


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("model", ["rnn", "lstm", "gpt"])
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_train_lowers_loss_and_evaluate_reads_checkpoint(model, head, tmp_path, wikitext2):
    out = tmp_path / "run"
    train.main(tiny_args(model, head, out))
    log = read_log(out)
    assert [r["step"] for r in log] == [12, 24]
    assert log[1]["train_loss"] < log[0]["train_loss"] and log[1]["val_loss"] < log[0]["val_loss"]
    assert {"ckpt_best.pt", "ckpt_last.pt", "log.jsonl"} <= set(os.listdir(out))
    res_path = tmp_path / "res.json"
    evaluate.main(
        [
            "--ckpt",
            str(out / "ckpt_best.pt"),
            "--split",
            "valid",
            "--limit",
            "60",
            "--out",
            str(res_path),
        ]
    )
    res = json.loads(res_path.read_text())
    assert res["head"] == head and res["model"] == model and res["sequences"] == 60
    assert (
        abs(res["nll"] - log[1]["val_loss"]) < 1e-4
    )  # the same number train.py logged for the best model
    assert 0 < res["eos_prob_at_end"] < 1


def test_resume_continues_and_reproduces(tmp_path, wikitext2, capsys):
    """Stop at step 12, resume to 24: same step count, same losses and weights as one run."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(tiny_args("lstm", "st", straight, iters=24, every=6))
    train.main(tiny_args("lstm", "st", split, iters=12, every=6))
    train.main(
        tiny_args("lstm", "st", split, iters=24, every=6)[:-4] + ["--max_iters", "24", "--resume"]
    )
    a, b = read_log(straight), read_log(split)
    assert [r["step"] for r in b] == [6, 12, 18, 24]
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == rb["train_loss"] and ra["val_loss"] == rb["val_loss"]
    wa = load_checkpoint(str(straight / "ckpt_last.pt"))
    wb = load_checkpoint(str(split / "ckpt_last.pt"))
    assert wb["state"]["step"] == 24
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    moved = tmp_path / "moved"  # a resumed run writes where its folder is now, not where it was
    os.rename(split, moved)
    train.main(
        tiny_args("lstm", "st", moved, iters=24, every=6)[:-4] + ["--max_iters", "30", "--resume"]
    )
    assert (
        not split.exists() and load_checkpoint(str(moved / "ckpt_last.pt"))["state"]["step"] == 30
    )
    capsys.readouterr()  # a lower limit, already passed: said so, nothing trained
    train.main(
        tiny_args("lstm", "st", moved, iters=24, every=6)[:-4] + ["--max_iters", "20", "--resume"]
    )
    assert "already finished (reached --max_iters 20)" in capsys.readouterr().out
    assert [r["step"] for r in read_log(moved)] == [6, 12, 18, 24, 30]


def test_a_run_killed_before_its_first_checkpoint_starts_afresh(tmp_path, wikitext2, capsys):
    """Logs but no checkpoint (killed before the first evaluation): --resume has nothing to go on
    from, and a fresh run starts the logs anew."""
    out = tmp_path / "early"
    train.main(tiny_args("lstm", "st", out, iters=6, every=6))
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        os.remove(out / name)
    rc, err = run_in_process(
        train.main, tiny_args("lstm", "st", out, iters=6, every=6) + ["--resume"], capsys
    )
    assert_one_line_error(rc, err, "--resume: no checkpoint in")
    train.main(tiny_args("lstm", "st", out, iters=6, every=6))
    assert [r["step"] for r in read_log(out)] == [6]


def run_cli(script, *args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "transformer"], "invalid choice: 'transformer'"),
        (["--head", "softmax2"], "invalid choice: 'softmax2'"),
        (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
        (["--head", "nmst", "--epsilon", "0"], "argument --epsilon: must be in (0, 1), got 0"),
        (["--head", "st", "--epsilon", "1.5"], "argument --epsilon: must be in (0, 1), got 1.5"),
        (["--model", "gpt", "--d_model", "30", "--n_head", "4"], "must be divisible"),
    ],
)
def test_train_bad_input(args, pattern, tmp_path, capsys):
    rc, err = run_in_process(train.main, [*args, "--out_dir", str(tmp_path / "o")], capsys)
    assert_one_line_error(rc, err, pattern)
    assert not (tmp_path / "o").exists()  # nothing written


def test_missing_data_offline(tmp_path):
    env = {"NANOGEN_DATA": "", "NANOGEN_CACHE": str(tmp_path / "cache"), "NANOGEN_OFFLINE": "1"}
    rc, _, err = run_cli(
        "train.py",
        "--model",
        "lstm",
        "--dataset",
        "wikitext2",
        "--out_dir",
        str(tmp_path / "o"),
        env_extra=env,
    )
    assert_one_line_error(rc, err, "NANOGEN_OFFLINE is set: pass --data_dir DIR")


def test_resume_without_checkpoint(tmp_path):
    rc, _, err = run_cli(
        "train.py",
        "--model",
        "lstm",
        "--dataset",
        "wikitext2",
        "--resume",
        "--out_dir",
        str(tmp_path / "none"),
    )
    assert_one_line_error(rc, err, "--resume: no checkpoint")


def test_corrupt_and_foreign_checkpoints(tmp_path, capsys):
    """Not a checkpoint, a plain torch file, pickled code, a truncated checkpoint, a missing file, a
    folder: one line each, and never torch's advice to load unsafely."""
    bad, plain, evil = tmp_path / "bad.pt", tmp_path / "plain.pt", tmp_path / "evil.pt"
    bad.write_bytes(b"this is not a checkpoint")
    torch.save({"weights": torch.zeros(3)}, plain)
    torch.save({"payload": subprocess.Popen}, evil)  # pickled code
    good = tmp_path / "good.pt"
    common.save_checkpoint(
        dict(config={}, model={}, args={}, vocab="gpt2", state={}, w=torch.randn(1000)), str(good)
    )
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:3000])
    for path, said in (
        (bad, "is not a readable nanogen checkpoint"),
        (plain, "is not a checkpoint written by train.py"),
        (evil, "is not a readable nanogen checkpoint"),
        (tmp_path / "cut.pt", "is not a readable nanogen checkpoint"),
        (tmp_path / "missing.pt", "no checkpoint at"),
        (tmp_path, "no checkpoint at"),
    ):
        rc, err = run_in_process(evaluate.main, ["--ckpt", str(path)], capsys)
        assert_one_line_error(rc, err, said)
        assert "weights_only=False" not in err


def test_help_lists_the_flags():
    rc, out, _ = run_cli("train.py", "--help")
    assert rc == 0
    for flag in (
        "--model",
        "--head",
        "--epsilon",
        "--dataset",
        "--data_dir",
        "--out_dir",
        "--seed",
        "--device",
        "--dtype",
        "--compile",
        "--resume",
        "--lr",
        "--patience",
        "--max_epochs",
        "--max_iters",
        "--batch_size",
        "--max_tokens",
        "--grad_clip",
        "--eval_interval",
    ):
        assert flag in out
    text = " ".join(
        out.split("options:")[1].split()
    )  # each flag's help: up to the next "--flag METAVAR"
    help_of = {part.split()[0]: part for part in re.split(r" (?=--\w+ (?:[A-Z0-9_]+ |\{))", text)}
    assert (
        help_of["--patience"].endswith("(default: 10)") and "(default: 0.99)" in help_of["--beta2"]
    )
    assert help_of["--lr"].endswith("(default: the --model recipe)")  # (train.RECIPES)
    assert "recipe" not in help_of["--data_dir"] + help_of["--out_dir"]  # (no recipe sets them)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, wikitext2):
    out = tmp_path_factory.mktemp("tiny") / "run"
    train.main(tiny_args("lstm", "nmst", out, iters=6, every=6))
    return out / "ckpt_last.pt"


def test_model_and_optimiser_flags_do_what_they_say(tmp_path):
    """--no_tie, --no_bias, --beta1 / --beta2, --peak_flops (the MFU column), --no_curves on a
    GPT; --max_offset and --min_count on InsNet: each reaches the model, the optimizer, the log
    or the vocabulary."""
    gpt = tmp_path / "gpt"
    train.main(
        [
            "--model",
            "gpt",
            "--n_layer",
            "1",
            "--d_model",
            "16",
            "--n_head",
            "2",
            "--block_size",
            "64",
            "--dataset",
            "ptb",
            "--batch_size",
            "4",
            "--train_seqs",
            "32",
            "--eval_seqs",
            "8",
            "--max_iters",
            "2",
            "--eval_interval",
            "2",
            "--no_tie",
            "--no_bias",
            "--beta1",
            "0.8",
            "--beta2",
            "0.95",
            "--peak_flops",
            "1e12",
            "--no_curves",
            "--out_dir",
            str(gpt),
        ]
    )
    ckpt = load_checkpoint(str(gpt / "ckpt_last.pt"))
    assert (ckpt["config"]["tie"], ckpt["config"]["bias"]) == (False, False)
    assert not [k for k in ckpt["model"] if k.endswith("bias")]
    assert not torch.equal(ckpt["model"]["head.proj.weight"], ckpt["model"]["backbone.wte.weight"])
    assert ckpt["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert read_log(gpt)[0]["mfu"] > 0 and not (gpt / "curves.png").exists()
    runs = {}
    for name, flags in (("default", []), ("flags", ["--max_offset", "4", "--min_count", "50"])):
        runs[name] = tmp_path / name
        train.main(
            [
                "--model",
                "insnet",
                "--dataset",
                "rocstories",
                "--n_layer",
                "1",
                "--d_model",
                "16",
                "--n_head",
                "2",
                "--batch_size",
                "4",
                "--train_seqs",
                "8",
                "--eval_seqs",
                "4",
                "--max_iters",
                "1",
                "--eval_interval",
                "1",
                "--warmup",
                "0",
                "--probe",
                "0",
                "--out_dir",
                str(runs[name]),
                *flags,
            ]
        )
    default, flagged = (
        load_checkpoint(str(runs[n] / "ckpt_last.pt"))["config"] for n in ("default", "flags")
    )
    assert (default["max_offset"], flagged["max_offset"]) == (256, 4)
    assert flagged["vocab_size"] < default["vocab_size"] / 3  # words seen < 50 times are <unk>


@pytest.mark.parametrize(
    "decoder,extra",
    [
        ("greedy", []),
        ("topk", ["--k", "2"]),
        ("nucleus", ["--p", "0.4"]),
        ("beam", ["--beam_size", "2"]),
        ("topk", ["--k", "2", "--consistent"]),
        ("beam", ["--beam_size", "2", "--length_penalty", "1"]),
    ],
)
def test_evaluate_decoding_study(decoder, extra, tiny_ckpt, tmp_path):
    out = tmp_path / "study.json"
    args = [
        "--ckpt",
        str(tiny_ckpt),
        "--no_ppl",
        "--decoder",
        decoder,
        *extra,
        "--L",
        "3",
        "10",
        "30",
        "--limit",
        "12",
        "--traces",
        "2",
        "--out",
        str(out),
    ]
    evaluate.main(args)
    res = json.loads(out.read_text())
    d = res["decoding"]
    r = [d["r_nt"][L] for L in ("3", "10", "30")]
    assert r[0] >= r[1] >= r[2] and all(0 <= x <= 1 for x in r)
    assert (
        d["n"] == 12 and len(d["generated_lengths"]) == 12 and len(d["ground_truth_lengths"]) == 12
    )
    assert all(n is None or 1 <= n <= 30 for n in d["generated_lengths"])
    assert d["examples"] and all(len(ex["context"].split()) == 10 for ex in d["examples"])
    assert len(res["eos_traces"]) == 2
    assert (d["consistent"], d["length_penalty"]) == (
        "--consistent" in extra,
        float("--length_penalty" in extra),
    )
    assert all(0 < p < 1 for p in res["eos_traces"][0]["p_eos"])


def test_evaluate_batching_flags_change_only_the_batching(tiny_ckpt, tmp_path):
    """--batch_size / --max_tokens replace the run's batching: the same sequences, the same NLL
    (up to float32 summation order)."""
    results = []
    for flags in ([], ["--batch_size", "3"], ["--max_tokens", "50"]):
        out = tmp_path / f"r{len(results)}.json"
        evaluate.main(["--ckpt", str(tiny_ckpt), "--limit", "40", "--out", str(out), *flags])
        results.append(json.loads(out.read_text()))
    for r in results[1:]:
        assert (
            r["sequences"] == results[0]["sequences"] == 40 and r["tokens"] == results[0]["tokens"]
        )
        assert r["nll"] == pytest.approx(results[0]["nll"], rel=1e-6)


def test_epsilon_is_shown_for_the_heads_that_read_it(capsys):
    """eps belongs to ST / NMST (eq. 9, 10): the study table leaves it out for the other heads (a
    MoS study showed the unused default 1e-05)."""

    def study(head):
        decoding = dict(
            decoder="greedy", r_nt={"10": 0.5}, mean_length=2.0, unique_non_terminated=None, n=4
        )
        return dict(model="lstm", head=head, epsilon=1e-5, dataset="ptb", decoding=decoding)

    curves.print_study_table([study("mos"), study("nmst")])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["lstm", "mos", "-"], ["lstm", "nmst", "1e-05"]]


def test_compared_lengths_draw_each_cut_continuation_at_its_own_L(tmp_path, monkeypatch):
    """Fig. 8 of studies decoded to different L: a continuation cut at L = 20 is drawn (and
    labelled) at 20, not at the other study's 100."""
    import matplotlib.axes

    drawn = []
    real_hist = matplotlib.axes.Axes.hist
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "hist",
        lambda ax, x, **kw: drawn.append((list(x), kw["label"])) or real_hist(ax, x, **kw),
    )

    def study(L, lengths, head):
        decoding = dict(
            decoder="greedy",
            r_nt={"5": 0.5, str(L): 0.5},
            r_nt_curve={"5": 0.5},
            generated_lengths=lengths,
            ground_truth_lengths=[3, 4],
        )
        return dict(model="lstm", head=head, epsilon=1e-3, dataset="ptb", decoding=decoding)

    curves.plot_study([study(20, [3, None], "st"), study(100, [None, 7], "nmst")], str(tmp_path))
    assert drawn[1:] == [
        ([3, 20], "ST+ (1 non-terminated, drawn at L=20)"),
        ([100, 7], "NMST+ (1 non-terminated, drawn at L=100)"),
    ]


def test_evaluate_plots_and_compare(tiny_ckpt, tmp_path, monkeypatch, capsys):
    a = tmp_path / "a.json"
    evaluate.main(
        [
            "--ckpt",
            str(tiny_ckpt),
            "--no_ppl",
            "--decoder",
            "greedy",
            "--L",
            "5",
            "20",
            "--limit",
            "8",
            "--traces",
            "1",
            "--out",
            str(a),
        ]
    )
    figs = tmp_path / "figs"
    evaluate.main(["--compare", str(a), str(a), "--plot", str(figs)])
    assert sorted(os.listdir(figs)) == ["lengths.png", "p_eos.png", "r_nt.png"]


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--decoder", "topk", "--k", "0"], "argument --k: must be >= 1, got 0"),
        (["--decoder", "topk"], "top-k needs --k >= 1"),
        (["--decoder", "nucleus", "--p", "1.5"], "argument --p: must be in (0, 1], got 1.5"),
        (["--decoder", "nucleus", "--p", "0"], "argument --p: must be in (0, 1], got 0"),
        (
            ["--decoder", "beam", "--beam_size", "0"],
            "argument --beam_size: must be in [1, 1000], got 0",
        ),
        (["--decoder", "greedy", "--L", "0"], "argument --L: must be in [1, 10^6], got 0"),
        (["--decoder", "bfs"], "invalid choice: 'bfs'"),
        (
            ["--compare", "a.json"],
            "--compare draws studies already written (--out files) and takes only --plot",
        ),
    ],
)
def test_evaluate_bad_decoder_input(args, pattern, tmp_path, capsys):
    rc, err = run_in_process(evaluate.main, ["--ckpt", str(tmp_path / "x.pt"), *args], capsys)
    assert_one_line_error(rc, err, pattern)


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["arch", "--eval_every", "0"], "argument --eval_every: must be >= 1, got 0"),
        (["insnet", "--lengths", "20", "0"], "argument --lengths: must be >= 1, got 0"),
        (["arch", "--budget", "nan"], "argument --budget: must be > 0, got nan"),
        (["train", "--rounds", "two"], "argument --rounds: expected int, got 'two'"),
        (
            ["decode", "--gpt_dim", "10", "--gpt_heads", "3"],
            "--gpt_dim must be a multiple of --gpt_heads",
        ),
        (["train", "--seq", "1025"], "--seq <= 1024"),
        (["insnet", "--lengths", "20", "255"], "--lengths <= 254"),
    ],
)
def test_bench_flag_ranges(args, pattern, capsys):
    import bench

    rc, err = run_in_process(bench.main, args, capsys)
    assert_one_line_error(rc, err, pattern)


def _zip_dir(tmp_path, members):
    import zipfile

    d = tmp_path / "data"
    d.mkdir()
    with zipfile.ZipFile(
        d / ("wikitext-2-v1.zip" if "../evil" not in members else "copy.zip"), "w"
    ) as z:
        for name, text in members.items():
            z.writestr(name, text)
    return d


LINE = " ".join(f"w{i}" for i in range(14)) + " \n"


def test_archive_with_wrong_sha256_cli(tmp_path):
    d = _zip_dir(
        tmp_path, {f"wikitext-2/wiki.{s}.tokens": LINE for s in ("train", "valid", "test")}
    )
    rc, _, err = run_cli(
        "train.py",
        "--model",
        "lstm",
        "--dataset",
        "wikitext2",
        "--data_dir",
        str(d),
        "--out_dir",
        str(tmp_path / "o"),
        env_extra={"NANOGEN_CACHE": str(tmp_path / "c")},
    )
    assert_one_line_error(rc, err, "checksum mismatch")


def test_resume_with_another_head_or_model(tmp_path, wikitext2):
    out = tmp_path / "run"
    train.main(tiny_args("lstm", "st", out, iters=2, every=2))
    for flags, name in (
        (["--head", "nmst"], "head=st, not nmst"),
        (["--model", "rnn"], "model=lstm, not rnn"),
    ):
        rc, _, err = run_cli(
            "train.py",
            *tiny_args("lstm", "st", out, iters=4, every=2)[:-8],
            *flags,
            "--out_dir",
            str(out),
            "--resume",
        )
        assert_one_line_error(rc, err, f"the checkpoint in {out} has {name}: drop that flag")
    train.main(
        ["--out_dir", str(out), "--resume", "--max_iters", "4"]
    )  # its shape from the checkpoint
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == 4


def test_checkpoint_for_another_vocabulary(tmp_path, tiny_ckpt):
    from data.loader import load

    load("wikitext2", verbose=False)  # prepared beforehand: the CLI's only output is the error
    ckpt = load_checkpoint(str(tiny_ckpt))
    ckpt["args"]["dataset"] = "wikitext2"  # a PTB model (V = 10,000) against WikiText-2's (33,278)
    bad = tmp_path / "ptb.pt"
    common.save_checkpoint(ckpt, str(bad))
    rc, _, err = run_cli("evaluate.py", "--ckpt", str(bad))
    assert_one_line_error(rc, err, "was trained on another vocabulary than the wikitext2 data")
    ckpt = load_checkpoint(str(tiny_ckpt))  # the same size, two words swapped: still another
    ckpt["vocab"]["tokens"][5:7] = ckpt["vocab"]["tokens"][6:4:-1]
    common.save_checkpoint(ckpt, str(bad))
    rc, _, err = run_cli("evaluate.py", "--ckpt", str(bad))
    assert_one_line_error(rc, err, "was trained on another vocabulary than the ptb data")


def test_prompt_longer_than_the_window_cli(tmp_path, wikitext2):
    out = tmp_path / "gpt"
    train.main(tiny_args("gpt", "softmax", out, iters=1, every=1) + ["--block_size", "64"])
    rc, _, err = run_cli(
        "evaluate.py",
        "--ckpt",
        str(out / "ckpt_last.pt"),
        "--no_ppl",
        "--decoder",
        "greedy",
        "--L",
        "100",
        "--limit",
        "2",
    )
    assert_one_line_error(
        rc,
        err,
        "--L 100 does not fit the model's window: a context and its continuation "
        "must fit, use --L 55 or less",
    )


def test_init_from_gpt2_needs_the_gpt_model(tmp_path):
    rc, _, err = run_cli(
        "train.py", "--model", "lstm", "--init_from", "gpt2", "--out_dir", str(tmp_path / "o")
    )
    assert_one_line_error(rc, err, "--init_from gpt2 is GPT-2: --model gpt on BPE data")


def test_plateau_halves_lr_and_early_stopping(tmp_path, wikitext2):
    """lr 1e-30 leaves the weights unchanged, so validation never improves after the first
    evaluation: the plateau schedule halves the lr at each one and patience 2 stops the run."""
    out = tmp_path / "plateau"
    args = tiny_args("lstm", "softmax", out, iters=30, every=2)
    args[args.index("--lr") + 1] = "1e-30"
    train.main(args + ["--patience", "2"])
    log = read_log(out)
    assert [r["step"] for r in log] == [2, 4, 6]
    assert [r["best"] for r in log] == [True, False, False]
    assert [r["lr"] for r in log] == [1e-30, 5e-31, 2.5e-31]
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["bad_evals"] == 2


def test_linear_schedule_warms_up_and_decays_to_zero(tmp_path, wikitext2):
    """--lr_schedule linear: step s (1-based) trains at
    lr * min(1, s / warmup) * max(0, 1 - (s - 1) / decay_steps), as steps.jsonl logs it: up for 4
    steps, then down to 0 at step 11 and after."""
    out = tmp_path / "linear"
    args = tiny_args("lstm", "softmax", out, iters=12, every=12)
    args[args.index("--lr") + 1] = "1e-3"
    train.main(args + ["--lr_schedule", "linear", "--warmup", "4", "--decay_steps", "10"])
    with open(out / "steps.jsonl") as f:
        lrs = [json.loads(line)["lr"] for line in f]
    expected = [1e-3 * min(1, s / 4) * max(0.0, 1 - (s - 1) / 10) for s in range(1, 13)]
    assert lrs == pytest.approx(expected, abs=1e-15) and lrs[-2:] == [0.0, 0.0]


def test_epochs_evaluate_at_each_end_and_stop_at_max_epochs(tmp_path, wikitext2):
    """The recurrent recipes' default (--eval_interval 0): an evaluation at the end of every
    epoch (40 sequences in batches of 8: 5 steps each), and --max_epochs stops the run."""
    out = tmp_path / "epochs"
    args = tiny_args("lstm", "softmax", out) + [
        "--train_seqs",
        "40",
        "--eval_interval",
        "0",
        "--max_epochs",
        "2",
        "--max_iters",
        "0",
    ]
    train.main(args)
    assert [(r["step"], r["epoch"]) for r in read_log(out)] == [(5, 1), (10, 2)]
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["epoch"] == 2


def test_a_missing_argument_is_one_line(capsys):
    rc, _, err = run_cli("evaluate.py")
    assert_one_line_error(rc, err, "give --ckpt CKPT (or --compare JSON ...)")


def test_gcnn_and_char_vocabulary_end_to_end(tmp_path):
    """The new backbone and the new vocabulary through train.py and evaluate.py: loss falls,
    perplexity and a decoding study read the checkpoint, the char model decodes characters."""
    runs = {
        "gcnn": [
            "--model",
            "gcnn",
            "--n_layer",
            "2",
            "--kernel_size",
            "3",
            "--block_size",
            "128",
            "--head",
            "nmst",
        ],
        "char": ["--model", "lstm", "--vocab", "char", "--n_layer", "1"],
    }
    for name, flags in runs.items():
        out = tmp_path / name
        train.main(
            [
                "--dataset",
                "ptb",
                "--d_model",
                "32",
                "--batch_size",
                "8",
                "--lr",
                "3e-3",
                "--train_seqs",
                "200",
                "--eval_seqs",
                "20",
                "--max_iters",
                "12",
                "--eval_interval",
                "6",
                "--out_dir",
                str(out),
                *flags,
            ]
        )
        log = read_log(out)
        assert log[1]["val_loss"] < log[0]["val_loss"]
        res = tmp_path / f"{name}.json"
        evaluate.main(
            [
                "--ckpt",
                str(out / "ckpt_best.pt"),
                "--limit",
                "20",
                "--decoder",
                "greedy",
                "--L",
                "5",
                "40",
                "--out",
                str(res),
            ]
        )
        r = json.loads(res.read_text())
        assert (
            r["model"] == flags[1]
            and r["sequences"] == 20
            and abs(r["nll"] - log[1]["val_loss"]) < 1e-4
        )
        ex = r["decoding"]["examples"][0]
        if name == "char":  # the context: 10 words and a space, as characters
            assert len(ex["context"].split()) == 10 and ex["context"].endswith(" ")


def test_an_error_line_is_one_write_and_a_bug_keeps_its_traceback(monkeypatch):
    """Under torchrun every process writes its error line to one stderr: written whole in one
    call (print writes the newline apart, and two processes' lines ran together).  Any other
    exception is a bug: not turned into a line."""
    writes = []
    monkeypatch.setattr(
        sys,
        "stderr",
        type("Err", (), dict(write=lambda self, s: writes.append(s), flush=lambda self: None))(),
    )

    def fails(argv):
        raise common.UserError("the folder is in use")

    with pytest.raises(SystemExit) as e:
        common.run(lambda: fails([]))
    assert e.value.code == 2 and writes == ["error: the folder is in use\n"]

    def bug():
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        common.run(bug)
