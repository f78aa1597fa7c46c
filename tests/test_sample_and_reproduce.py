"""A student's first hour: sample.py on tiny checkpoints (word, BPE, InsNet), reproduce.py end to
end at the tiny scale (and reused on a second run), and --compare plots of runs that differ by
decoder."""

import io
import json
import os

import pytest

import config
import evaluate
import reproduce
import sample
import train
from conftest import assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints of every kind sample.py reads."""
    root = tmp_path_factory.mktemp("sample")
    common = [
        "--d_model",
        "32",
        "--n_head",
        "2",
        "--lr",
        "3e-3",
        "--max_iters",
        "6",
        "--eval_interval",
        "6",
        "--eval_seqs",
        "16",
        "--train_seqs",
        "200",
    ]
    runs = {
        "word": [
            "--model",
            "lstm",
            "--head",
            "nmst",
            "--epsilon",
            "1e-2",
            "--dataset",
            "ptb",
            "--batch_size",
            "8",
        ],
        "bpe": [
            "--model",
            "gpt",
            "--head",
            "st",
            "--epsilon",
            "1e-2",
            "--n_layer",
            "1",
            "--dataset",
            "wikitext103",
            "--batch_size",
            "4",
            "--block_size",
            "64",
        ],
        "insnet": [
            "--model",
            "insnet",
            "--dataset",
            "rocstories",
            "--task",
            "storyline",
            "--n_layer",
            "1",
            "--batch_size",
            "8",
            "--warmup",
            "0",
        ],
        "l2r_story": [
            "--model",
            "gpt",
            "--dataset",
            "rocstories",
            "--task",
            "storyline",
            "--n_layer",
            "1",
            "--batch_size",
            "8",
            "--warmup",
            "0",
        ],
    }
    out = {}
    for name, flags in runs.items():
        train.main([*flags, *common, "--out_dir", str(root / name)])
        out[name] = str(root / name / "ckpt_last.pt")
    return out


def test_sample_word_level_prompt_with_p_eos(ckpts, capsys):
    sample.main(
        [
            "--ckpt",
            ckpts["word"],
            "--prompt",
            "the company said it would",
            "--prompt",
            "stocks fell",
            "--L",
            "12",
            "--show_eos",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ">>>" in ln]
    assert len(heads) == 2 and heads[0].startswith("the company said it would >>> ")
    assert all(
        ln.endswith("[eos]")
        or ln.endswith(  # said why: Theorem 3's bound lies beyond L
            "[length cap 12: not terminated]  (NMST: p(eos) passes 1/2 by t = ln 2 / eps = 69; "
            "--L 12 cut it before)"
        )
        for ln in heads
    )
    steps = [ln for ln in out if "p(eos)=" in ln]
    assert 2 <= len(steps) <= 24 and all(
        0 < float(ln.split("p(eos)=")[1].split()[0]) <= 1 for ln in steps
    )
    rc, err = run_in_process(
        sample.main, ["--ckpt", ckpts["word"], "--prompt", "Stocks zyzzyva"], capsys
    )
    assert_one_line_error(
        rc,
        err,
        "not in the model's vocabulary: 'Stocks', 'zyzzyva'; the data "
        "is lower-cased (--allow_unk reads them as <unk>)",
    )
    sample.main(["--ckpt", ckpts["word"], "--prompt", "zyzzyva fell", "--allow_unk", "--L", "3"])
    assert capsys.readouterr().out.startswith("zyzzyva fell >>> ")


def test_tokens_decode_with_single_spaces():
    from data.prepare import BPE, Vocabulary

    words, bpe = (
        Vocabulary("word", ["<eos>", "<unk>", "a"]),
        BPE(),
    )  # BPE's tokens carry their space
    end = bpe.enc.encode_ordinary(" the end") + [bpe.eos_id]  # (--show_eos decodes eos alone)
    assert (bpe.decode(end), bpe.decode([bpe.eos_id]), words.decode([2, 2, 0])) == (
        " the end <|endoftext|>",
        "<|endoftext|>",
        "a a <eos>",
    )


def test_sample_bpe_prompt_and_the_window(ckpts, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The history of the city\nIn 1990 , the band\n")
    sample.main(
        [
            "--ckpt",
            ckpts["bpe"],
            "--prompt_file",
            str(prompts),
            "--decoder",
            "topk",
            "--k",
            "3",
            "--L",
            "10",
        ]
    )
    out = [ln for ln in capsys.readouterr().out.splitlines() if ">>>" in ln]
    assert len(out) == 2 and out[1].startswith("In 1990 , the band >>> ")
    rc, err = run_in_process(
        sample.main, ["--ckpt", ckpts["bpe"], "--prompt", "The history", "--L", "100"], capsys
    )
    assert_one_line_error(rc, err, "context window of 64 tokens: use --L 63 or less")
    rc, err = run_in_process(
        sample.main, ["--ckpt", ckpts["bpe"], "--prompt", "a b " * 40, "--L", "1"], capsys
    )
    assert_one_line_error(rc, err, "context window of 64 tokens: use a shorter prompt")
    res = tmp_path / "study.json"  # p(eos) traces of the sequences that fit the window only
    evaluate.main(
        [
            "--ckpt",
            ckpts["bpe"],
            "--no_ppl",
            "--decoder",
            "greedy",
            "--L",
            "5",
            "--limit",
            "4",
            "--traces",
            "2",
            "--out",
            str(res),
        ]
    )
    traces = json.loads(res.read_text())["eos_traces"]
    assert len(traces) == 2 and all(10 + len(t["p_eos"]) - 1 <= 64 for t in traces)


def test_sample_a_left_to_right_story(ckpts, capsys):
    """The L2R baseline continues "title <sep> storyline <sep>": one line, the title first."""
    sample.main(
        [
            "--ckpt",
            ckpts["l2r_story"],
            "--title",
            "the big game",
            "--keywords",
            "team",
            "won",
            "--L",
            "6",
            "--decoder",
            "topk",
            "--k",
            "3",
            "--seed",
            "1",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("the big game >>> ")
    assert out[0].endswith("[eos]") or out[0].endswith("[length cap 6]")
    assert len(out[0].split(">>> ")[1].split()) <= 6 + 3  # at most L words, then "[length cap 6]"
    rc, err = run_in_process(
        sample.main, ["--ckpt", ckpts["l2r_story"], "--title", "a game"], capsys
    )
    assert_one_line_error(rc, err, "give --keywords")  # it was trained on title + storyline
    rc, err = run_in_process(
        sample.main,
        ["--ckpt", ckpts["l2r_story"], "--title", "The Game!", "--keywords", "won"],
        capsys,
    )  # the data: "game !"
    assert_one_line_error(rc, err, "not in the model's vocabulary: 'game!'")


def test_a_long_prompt_file_is_decoded_64_prompts_at_a_time_and_dash_is_stdin(
    ckpts, capsys, tmp_path, monkeypatch
):
    import decode

    sizes, real = [], decode.decode
    monkeypatch.setattr(
        decode,
        "decode",
        lambda lm, prompts, *a, **k: sizes.append(len(prompts)) or real(lm, prompts, *a, **k),
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"the company said {i}\n" for i in range(70)))
    sample.main(["--ckpt", ckpts["word"], "--prompt_file", str(prompts), "--L", "3", "--allow_unk"])
    out = [ln for ln in capsys.readouterr().out.splitlines() if ">>>" in ln]
    assert sizes == [64, 6] and [ln.split(" >>>")[0] for ln in out] == [
        f"the company said {i}" for i in range(70)
    ]
    monkeypatch.setattr(
        "sys.stdin", io.StringIO("\ufeffprices rose\n\nthe company said\n")
    )  # --prompt_file -, a BOM
    sample.main(["--ckpt", ckpts["word"], "--prompt_file", "-", "--L", "3"])
    out = [ln for ln in capsys.readouterr().out.splitlines() if ">>>" in ln]
    assert [ln.split(" >>>")[0] for ln in out] == ["prices rose", "the company said"]


def test_sample_takes_consistent_topk_and_a_beams_length_penalty(ckpts, capsys, monkeypatch):
    """The decoder options evaluate.py's study has, passed to the decoder, and refused where the
    decoder (or a story checkpoint) would ignore them."""
    import decode

    seen, real = [], decode.decode
    monkeypatch.setattr(
        decode, "decode", lambda lm, prompts, *a, **k: seen.append(k) or real(lm, prompts, *a, **k)
    )
    flags = ["--ckpt", ckpts["word"], "--prompt", "the company said it", "--L", "8"]
    sample.main(flags + ["--decoder", "topk", "--k", "2", "--consistent", "--seed", "0"])
    sample.main(flags + ["--decoder", "beam", "--beam_size", "2", "--length_penalty", "0.7"])
    assert [(k["consistent"], k["length_penalty"]) for k in seen] == [(True, 0.0), (False, 0.7)]
    for extra, error in (
        (["--consistent"], "--decoder greedy does not use --consistent: drop it"),
        (
            ["--decoder", "topk", "--k", "2", "--length_penalty", "1"],
            "--decoder topk does not use --length_penalty: drop it",
        ),
    ):
        assert_one_line_error(*run_in_process(sample.main, flags + extra, capsys), error)
    story = [
        "--ckpt",
        ckpts["insnet"],
        "--title",
        "the game",
        "--keywords",
        "won",
        "--decoder",
        "topk",
        "--k",
        "2",
    ]
    assert_one_line_error(
        *run_in_process(sample.main, story + ["--consistent"], capsys),
        "--consistent are for text checkpoints",
    )
    assert_one_line_error(
        *run_in_process(sample.main, story + ["--length_penalty", "1"], capsys),
        "--decoder topk does not use --length_penalty: drop it",
    )


def test_a_sample_without_seed_says_the_seed_that_repeats_it(ckpts, capsys):
    flags = ["--ckpt", ckpts["word"], "--prompt", "the company said it", "--L", "8"]
    sample.main(flags + ["--decoder", "sample"])
    first = capsys.readouterr()
    seed = first.err.split("(--seed ")[1].split()[0]
    sample.main(flags + ["--decoder", "sample", "--seed", seed])
    again = capsys.readouterr()
    assert again.out == first.out and again.err == ""
    sample.main(flags + ["--decoder", "beam", "--beam_size", "2"])
    assert "seed" not in capsys.readouterr().err  # beam search draws nothing


def test_sample_insnet_shows_the_canvas_after_each_insertion(ckpts, capsys, tmp_path, monkeypatch):
    flags = [
        "--ckpt",
        ckpts["insnet"],
        "--title",
        "the big game",
        "--keywords",
        "team",
        "won",
        "--L",
        "6",
    ]
    sample.main(flags)
    out = capsys.readouterr().out.splitlines()
    for var in ("NANOGEN_DATA", "NANOGEN_CACHE"):  # no data anywhere: the checkpoint's vocabulary
        monkeypatch.setenv(var, str(tmp_path / "empty"))
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    sample.main(flags)
    assert capsys.readouterr().out.splitlines() == out
    sample.main(flags[:5] + ["Team  won", ""] + flags[7:])  # one quoted argument
    assert capsys.readouterr().out.splitlines() == out
    steps = [ln for ln in out if "p(terminate)=" in ln]
    assert 1 <= len(steps) <= 7 and out[-1].startswith("[") and steps[0].startswith("  0  ")
    assert len(steps) == int(out[-1].split(" after ")[1].split()[0]) + 1  # every canvas: the given
    assert steps[0].split()[2:] == ["the", "big", "game", "<sep>", "team", "won"]  # one, the last
    assert all("team" in ln and "won" in ln for ln in steps)  # the keywords are on every canvas
    assert len(steps[-1].split()) > len(steps[0].split()) or len(steps) == 1


def test_reproduce_every_result_at_the_tiny_scale(tmp_path, capsys, monkeypatch):
    """Each command end to end: the table with the paper's numbers, the raw JSON, the figures;
    a second run reuses the finished runs (no training step is repeated)."""
    out = tmp_path / "results"
    reproduce.main(["all", "--scale", "tiny", "--out", str(out)])
    first = capsys.readouterr().out
    expected = {
        "nmst-table1": ["(101.6 ± 1.0)", "r_nt.png"],
        "nmst-table4": ["(0.05 ± 0.02)", None],
        "ct-table3": ["56.95 / 54.69", None],
        "insnet-storyline": ["52.86 / 36.86 / 26.39 / 19.35", "fig12.png"],
    }
    for name, (paper, figure) in expected.items():
        folder = out / f"{name}-tiny"
        table = (folder / "table.md").read_text()
        assert paper in table and "scale tiny" in table
        verdicts = [ln for ln in table.splitlines() if ln.startswith("- ")]
        assert len(set(verdicts)) == len(verdicts)  # each claim checked and said once
        assert json.loads((folder / "results.json").read_text())["result"] == name
        if figure:
            assert (folder / figure).stat().st_size > 1000
    for name in ("nmst-table1", "nmst-table4"):  # heads by the paper's names, as in the figures
        assert "| VA+ |" in (out / f"{name}-tiny" / "table.md").read_text()
    assert first.count("done (reached") > 0
    run = json.loads((out / "nmst-table1-tiny" / "runs" / "lstm-nmst-s0" / "args.json").read_text())
    table1 = (out / "nmst-table1-tiny" / "table.md").read_text()  # the over-training table says
    assert f"perplexity on the first {run['eval_seqs']} validation" in table1  # its split
    reproduce.main(["nmst-table1", "--scale", "tiny", "--out", str(out / "nmst-table1-tiny")])
    again = capsys.readouterr().out
    assert "done (reached" not in again and "already finished" in again
    reproduce.main(
        [
            "nmst-table1",
            "--scale",
            "tiny",
            "--heads",
            "softmax",
            "--out",
            str(out / "nmst-table1-tiny"),
        ]
    )
    table = (out / "nmst-table1-tiny" / "table.md").read_text()  # a --heads subset keeps the
    assert all(f"| {h} |" in table for h in ("VA+", "ST+", "NMST+"))  # finished heads' rows
    assert "done (reached" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "result, dataset",
    [
        ("nmst-table1", "wikitext2"),
        ("nmst-table4", "wikitext103"),
        ("ct-table3", "ptb"),
        ("insnet-storyline", "rocstories"),
    ],
)
def test_the_paper_scale_starts_its_first_run(result, dataset, tmp_path, monkeypatch):
    """--scale paper takes GPU days, but each command must reach its first run with flags that
    train.py accepts (nmst-table1 crashed on the step count the paper scale leaves unset)."""

    class Started(Exception):
        pass

    def main(argv):
        main.args = config.get_args(argv, train.RECIPES, train.AUTHORS)[0]  # (and its checks)
        main.typed = set(config.typed_flags(argv))
        raise Started

    monkeypatch.setattr(train, "main", main)
    with pytest.raises(Started):
        reproduce.main([result, "--scale", "paper", "--out", str(tmp_path / "r")])
    assert (
        main.args.dataset == dataset and not {"max_iters", "eval_interval"} & main.typed
    )  # the recipe's
    if result == "nmst-table4":
        assert main.args.init_from == "gpt2" and main.args.epsilon == 1e-5


def test_jobs_train_the_runs_as_processes_side_by_side(tmp_path, capsys, monkeypatch):
    """--jobs 2: the runs train as two `python train.py` processes at once (their output in
    RUNS/NAME.log), each capped by --max_minutes; the expected time is said first, the table says
    the grid may be partial, and the same command reuses the runs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "r"
    argv = [
        "nmst-table1",
        "--scale",
        "tiny",
        "--heads",
        "softmax",
        "nmst",
        "--jobs",
        "2",
        "--max_minutes",
        "5",
        "--out",
        str(out),
    ]
    assert reproduce.main(argv) == 0
    printed = capsys.readouterr().out
    assert "training 2 runs, 2 at a time: 5 min of training, and each run's set-up" in printed
    for name in ("lstm-softmax-s0", "lstm-nmst-s0"):
        assert "parameters" in (out / "runs" / f"{name}.log").read_text()
        assert json.load(open(out / "runs" / name / "args.json"))["max_minutes"] == 5
    assert "each run capped at 5 min: none reached it" in (out / "table.md").read_text()
    assert reproduce.main(argv) == 0  # again: each process finds its run finished
    assert "this run already finished" in (out / "runs" / "lstm-nmst-s0.log").read_text()


def test_jobs_that_fail_are_counted_and_said(tmp_path, monkeypatch, capsys):
    """--jobs: a run whose process exits non-zero (whatever its status) is one failed run, and
    the command stops with one line before evaluating anything."""
    codes = iter([0, 2, 1])

    class Exits:  # a train.py process that exits at once, with the next status
        def __init__(self, *a, **k):
            self.code = next(codes)

        def wait(self):
            return self.code

    monkeypatch.setattr(reproduce.subprocess, "Popen", Exits)
    argv = [
        "nmst-table1",
        "--scale",
        "tiny",
        "--heads",
        "softmax",
        "st",
        "nmst",
        "--jobs",
        "2",
        "--out",
        str(tmp_path / "r"),
    ]
    rc, err = run_in_process(reproduce.main, argv, capsys)
    assert_one_line_error(rc, err, "2 of 3 runs failed: see their .log in ")
    assert not list((tmp_path / "r").glob("*.json"))


@pytest.mark.parametrize("signal_name", ["Ctrl-C", "SIGTERM"])
def test_a_signal_that_stops_a_run_stops_reproduce(signal_name, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or a scheduler's SIGTERM) during one of reproduce.py's trainings stops the command
    there, with its checkpoint; it does not go on to evaluate a half-trained run and train the
    next one.  The same command then goes on."""
    calls = []
    monkeypatch.setattr(
        train, "main", lambda argv: calls.append(argv) or train.STOP.append(signal_name)
    )
    out = ["nmst-table1", "--scale", "tiny", "--out", str(tmp_path / "r")]
    rc, err = run_in_process(reproduce.main, out, capsys)
    assert len(calls) == 1 and not (tmp_path / "r" / "lstm-softmax-s0-ppl.json").exists()
    assert_one_line_error(rc, err, f"stopped by {signal_name}; the runs' checkpoints are in ")
    assert err.rstrip().endswith("the same command goes on from there")
    train.STOP.clear()


def test_a_new_runs_error_is_not_called_a_reuse_problem(tmp_path, monkeypatch, capsys):
    """An error of a run reproduce.py starts (offline: no GPT-2 weights) is said as it is; only a
    run it continues can be one it 'cannot reuse or continue'."""
    from common import UserError

    def offline(argv):
        raise UserError("could not download gpt2 (offline?); pass --weights PATH")

    monkeypatch.setattr(train, "main", offline)
    rc, err = run_in_process(
        reproduce.main, ["nmst-table4", "--scale", "tiny", "--out", str(tmp_path / "r")], capsys
    )
    assert_one_line_error(rc, err, "error: could not download gpt2 (offline?); pass --weights PATH")


def test_a_results_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    """The runs' folder is made before any training, and a failure is one line (a traceback)."""

    def full_disk(path, exist_ok=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "makedirs", full_disk)
    rc, err = run_in_process(
        reproduce.main, ["nmst-table1", "--scale", "tiny", "--out", str(tmp_path / "r")], capsys
    )
    assert_one_line_error(rc, err, f"--runs {tmp_path / 'r' / 'runs'} cannot be made: No space")


def test_compare_runs_that_differ_by_decoder(tmp_path, ckpts, monkeypatch):
    """--compare of studies that differ by decoder, not head: distinct colours, labels that
    name the decoder, a title that fits all runs; p(eos) traces of the same sequences overlaid
    (one study traced two sequences, the other one)."""
    import curves

    paths = []
    for dec, traces in ((["--decoder", "greedy"], "2"), (["--decoder", "topk", "--k", "2"], "1")):
        p = tmp_path / f"{dec[1]}.json"
        evaluate.main(
            [
                "--ckpt",
                ckpts["word"],
                "--no_ppl",
                *dec,
                "--L",
                "5",
                "20",
                "--limit",
                "6",
                "--traces",
                traces,
                "--out",
                str(p),
            ]
        )
        paths.append(str(p))
    figures = {}
    monkeypatch.setattr(
        curves, "save_figure", lambda fig, path: figures.update({os.path.basename(path): fig})
    )
    evaluate.main(["--compare", *paths, "--plot", str(tmp_path / "figs")])
    ax = figures["r_nt.png"].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["greedy", "topk-2"]
    assert len({line.get_color() for line in ax.get_lines()}) == 2
    title = ax.get_title()
    assert "ptb" in title and "lstm" in title and "greedy" not in title
    panels = figures["p_eos.png"].axes
    assert [len(ax.get_lines()) for ax in panels] == [2, 1]
    assert [ax.get_title() for ax in panels] == ["sequence 0", "sequence 1"]


def test_compare_tells_every_study_apart(tmp_path, ckpts, monkeypatch):
    """Studies alike but for the sampling temperature, and two files of the same study: every
    run has its own legend entry (the legend keeps one entry per label)."""
    import shutil

    import curves

    paths = []
    for name, dec in (("t05", ["--temperature", "0.5"]), ("t1", [])):
        paths.append(str(tmp_path / f"{name}.json"))
        evaluate.main(
            [
                "--ckpt",
                ckpts["word"],
                "--no_ppl",
                "--decoder",
                "sample",
                *dec,
                "--L",
                "5",
                "--limit",
                "4",
                "--out",
                paths[-1],
            ]
        )
    shutil.copy(paths[1], tmp_path / "again.json")
    figures = {}
    monkeypatch.setattr(
        curves, "save_figure", lambda fig, path: figures.update({os.path.basename(path): fig})
    )

    def legend(*files):
        evaluate.main(["--compare", *files, "--plot", str(tmp_path / "figs")])
        return [t.get_text() for t in figures["r_nt.png"].axes[0].get_legend().get_texts()]

    assert legend(*paths) == ["sample/T0.5", "sample"]
    assert legend(*paths, str(tmp_path / "again.json")) == [
        "sample/T0.5 (t05.json)",
        "sample (t1.json)",
        "sample (again.json)",
    ]


def test_the_verdicts_weigh_what_the_claims_name(tmp_path, monkeypatch):
    """At the cpu scale a table says the paper's claim checked on its numbers, called by Welch's
    t-test at 5 % (one-sided where the paper claims a direction): NMST Table 1 sets VA+ against
    the termination heads (ST+ / NMST+) only, at the largest L below t_1/2 (eps 1e-5: L = 1000;
    beyond it Theorem 3 decides), and draws no conclusion without both;
    CT Table 3 sets CT-MoS against the constant-temperature MoS rows (not against CT)."""
    import argparse

    cfg = reproduce.nmst_settings("cpu", 1)

    def verdict(rates, ppl=(100.0, 110.0), line=1):
        """{head: greedy r_nt(1000) per seed} -> the RNN's termination line (1; 0: the first),
        or its perplexity line (2)."""
        runs = {
            (m, h): [
                {"greedy": {"decoding": {"r_nt": {"1000": r}}}, "ppl_nanogen": ppl[i % 2] + 50 * k}
                for i, r in enumerate(v)
            ]
            for m in cfg["models"]
            for k, (h, v) in enumerate(rates.items())
        }
        args = argparse.Namespace(scale="cpu", heads=list(rates))
        if line == 2:
            return reproduce.verdict_table1(cfg, runs, args)[1]
        return reproduce.termination_shown(cfg, runs, args)[line]

    # two seeds 0.1 apart, 0.25 above: beyond 2 SE, but p = 0.063 (one-sided, 1 df); three: apart
    assert verdict(dict(softmax=[0.2, 0.3], nmst=[0.0, 0.0])) == (
        "  RNN, greedy r_nt(1000): VA+ 0.250 vs NMST+ 0.000: p = 0.063 (VA+ above): not resolved."
    )
    assert verdict(dict(softmax=[0.2, 0.21, 0.25], nmst=[0.0, 0.0, 0.01])) == (
        "  RNN, greedy r_nt(1000): VA+ 0.220 vs NMST+ 0.003: p = 0.0018 (VA+ above): apart at 5 %."
    )
    assert "r_nt(1000) (learned, L < t_1/2)" in verdict(dict(softmax=[0.2], nmst=[0.0]), line=0)
    assert verdict(dict(softmax=[0.2, 0.0], st=[0.0, 0.0], nmst=[0.0, 0.0])).endswith(
        "VA+ 0.100 vs ST+ 0.000: p = 0.25 (VA+ above): not resolved; "
        "VA+ 0.100 vs NMST+ 0.000: p = 0.25 (VA+ above): not resolved."
    )
    # exercise 1's head reads t but is not one of the claim's: it adds a row, no comparison
    assert "logt" not in verdict(dict(softmax=[0.2, 0.3], nmst=[0.0, 0.0], logt=[0.3, 0.3]))
    assert "MoS" not in verdict(dict(softmax=[0.2, 0.3], nmst=[0.0, 0.0], mos=[0.3, 0.3]))
    # the perplexities: heads 50 apart, the seeds 10 apart (apart) or 60 (not resolved)
    assert verdict(dict(softmax=[0.2, 0.0], nmst=[0.0, 0.0]), line=2) == (
        "- RNN, perplexity (nanogen's metric): VA+ 105.0 vs NMST+ 155.0: p = 0.019: apart at 5 %."
    )
    assert verdict(dict(softmax=[0.2, 0.0], nmst=[0.0, 0.0]), (60.0, 120.0), line=2).endswith(
        "VA+ 90.0 vs NMST+ 140.0: p = 0.36: not resolved."
    )
    for rates in (dict(softmax=[0.2]), dict(softmax=[0.2], mos=[0.0]), dict(nmst=[0.0])):
        assert verdict(rates, line=0) == (
            "- No conclusion on termination: the paper compares VA+ with ST+ / NMST+."
        )
    ppl = {"softmax": 70, "mos0.5": 65, "mos": 64, "mos4": 63, "ct": 55, "ctmos": 60}
    noise = {"spread": 0.0}
    monkeypatch.setattr(
        reproduce, "train_all", lambda plan, args: {name: "ckpt" for name, _ in plan}
    )

    def evaluate_once(ckpt, flags, path):
        label, _, rest = os.path.basename(path).partition("-s")
        return dict(ppl=ppl[label] + noise["spread"] * (int(rest[0]) - 1))

    monkeypatch.setattr(evaluate, "evaluate_once", evaluate_once)
    args = argparse.Namespace(scale="cpu", runs=str(tmp_path), out=str(tmp_path), seeds=None)
    assert reproduce.run_ct(args)[0][1] == (
        "- The paper's claim (CT-MoS beats every constant-temperature MoS) holds at this scale; "
        "lowest mean validation perplexity: CT."
    )
    noise["spread"] = 10.0  # seeds 10 apart: a 3-5 point gap is not resolved at 5 %
    assert "is not resolvable at this scale" in reproduce.run_ct(args)[0][1]
    noise["spread"], ppl["mos4"] = 0.0, 59
    assert "does NOT hold" in reproduce.run_ct(args)[0][1]


def test_table1_puts_every_value_under_its_model():
    """A row per head and a column per model: VA's LSTM perplexity sits under LSTM (it once
    fell under RNN NMST+), and eps is shown only for the heads that read it."""
    import argparse

    cfg = dict(models={"rnn": [], "lstm": []}, seeds=1, dataset="ptb", eps=1e-3, flags="")
    runs = {
        (m, h): [dict(ppl_nanogen=float(100 * i + j), ppl_authors=None)]
        for i, m in enumerate(cfg["models"], 1)
        for j, h in enumerate(("softmax", "nmst", "mos"))
    }
    args = argparse.Namespace(scale="tiny", heads=["softmax", "nmst", "mos"])
    rows = reproduce.report_table1(dict(cfg, decoders=[], L=10, contexts=4), runs, args)
    # Table 1 itself: after its first lines, before the r_nt table
    rows = rows[rows.index("") + 1 :]
    rows = rows[: rows.index("")]
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in rows if ln.startswith("| ")]
    assert table[0] == ["head", "eps", "RNN", "LSTM"]
    cols = {row[0]: dict(zip(table[0], row)) for row in table[1:]}
    assert all(len(row) == 4 for row in table)
    assert cols["VA+"]["LSTM"].startswith("200.0 / - (") and cols["VA+"]["eps"] == "-"
    assert cols["NMST+"]["RNN"].startswith("101.0 / - (") and cols["NMST+"]["eps"] == "0.001"
    assert cols["MoS"]["LSTM"] == "202.0 / - (-)" and cols["MoS"]["eps"] == "-"  # ("+": NMST's)
