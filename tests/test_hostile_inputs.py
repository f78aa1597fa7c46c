"""Hostile inputs, one test per class (RESULTS.md, the failure table): numeric flags at the edge
of floating point, story checkpoints' decoder flags, another model on resume, a damaged log
line, an output naming an input, prepared data damaged in place, a read-only or full cache,
malformed HF weights, a malformed study, reproduce.py's flags and results."""

import json
import os
import shutil

import pytest
import torch

import common
import curves
import data
import evaluate
import reproduce
import sample
import train
from conftest import TINY_LSTM, assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = TINY_LSTM + ["--max_iters", "4", "--eval_interval", "2"]
STORY = [
    "--model",
    "insnet",
    "--dataset",
    "synthetic",
    "--synthetic_count",
    "4",
    "--n_layer",
    "1",
    "--d_model",
    "16",
    "--n_head",
    "2",
    "--block_size",
    "256",
    "--batch_size",
    "4",
    "--max_iters",
    "2",
    "--eval_interval",
    "2",
    "--warmup",
    "0",
]


@pytest.fixture(scope="module")
def story_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("story") / "run"
    train.main(STORY + ["--out_dir", str(out)])
    return str(out / "ckpt_last.pt")


def test_numbers_at_the_edge_of_floating_point(lstm_run, capsys):
    """A temperature that underflows samples greedily; absurd lengths, beams and seeds are one
    line each, in every entry point."""
    ckpt = str(lstm_run / "ckpt_best.pt")
    common = ["--ckpt", ckpt, "--prompt", "the company said it", "--L", "12", "--seed", "1"]
    sample.main(common[:-2] + ["--decoder", "greedy"])
    greedy = capsys.readouterr().out
    for decoder in (["sample"], ["topk", "--k", "5"], ["nucleus", "--p", "0.9"]):
        sample.main(common + ["--decoder", *decoder, "--temperature", "1e-39"])
        assert capsys.readouterr().out == greedy
    for main, flags, msg in (
        (sample.main, ["--ckpt", ckpt, "--prompt", "the", "--L", str(10**30)], "--L: must be in"),
        (
            sample.main,
            ["--ckpt", ckpt, "--prompt", "the", "--decoder", "beam", "--beam_size", str(10**30)],
            "--beam_size: must be in",
        ),
        (
            sample.main,
            ["--ckpt", ckpt, "--prompt", "the", "--seed", str(2**64)],
            "--seed: must be in",
        ),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--decoder", "sample", "--seed", str(2**64)],
            "--seed: must be in",
        ),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--decoder", "sample", "--temperature", "inf"],
            "--temperature",
        ),
        (train.main, TINY + ["--seed", str(2**64)], "--seed: must be in"),
    ):
        assert_one_line_error(*run_in_process(main, flags, capsys), msg)


def test_story_checkpoints_check_their_decoder_flags(story_ckpt, capsys, tmp_path):
    for main, flags, msg in (
        (sample.main, ["--decoder", "topk"], "top-k needs --k"),  # (synthetic: no title)
        (sample.main, ["--decoder", "sample", "--p", "0.5"], "does not use --p"),
        (sample.main, ["--L", "0"], "--L: must be in"),
        (
            sample.main,
            ["--decoder", "nucleus", "--p", "0.5"],
            "--decoder nucleus is not for this checkpoint (choose from greedy, sample, topk)",
        ),
        (sample.main, ["--title", "w10"], "generates from <bos> alone"),
        (sample.main, ["--title", "w10", "--prompt", "w11"], "a story checkpoint takes --title"),
        (sample.main, ["--title", "w10", "--show_eos"], "a story checkpoint takes --title"),
        (evaluate.main, ["--decoder", "topk", "--no_ppl"], "top-k needs --k"),
        (
            evaluate.main,
            ["--decoder", "beam", "--beam_size", "2"],
            "--decoder beam is not for this checkpoint (choose from greedy, sample, topk)",
        ),
        (evaluate.main, ["--tau_report"], "are for left-to-right text checkpoints"),
        (
            evaluate.main,
            ["--decoder", "greedy", "--plot", str(tmp_path / "figs")],
            "are for left-to-right text checkpoints",
        ),
        (
            evaluate.main,
            ["--decoder", "greedy", "--L", "5"],
            "are for left-to-right text checkpoints",
        ),
        (evaluate.main, ["--decoder", "greedy", "--traces", "2"], "are for left-to-right text"),
        (evaluate.main, ["--no_ppl"], "--no_ppl leaves nothing to do"),
    ):
        assert_one_line_error(*run_in_process(main, ["--ckpt", story_ckpt, *flags], capsys), msg)
    evaluate.main(["--ckpt", story_ckpt, "--batch_size", "3"])  # stories batch by sequences
    capsys.readouterr()
    sample.main(["--ckpt", story_ckpt, "--L", "3", "--seed", "1", "--decoder", "sample"])
    canvases = [ln.split("=", 1)[1].split()[1:] for ln in capsys.readouterr().out.splitlines()[:-1]]
    assert canvases[0] == [] and all(w[0] == "w" and int(w[1:]) for c in canvases for w in c)


def test_a_flag_typed_at_its_default_is_refused_on_resume(lstm_run, tmp_path, capsys):
    """--model gpt and --head softmax are the defaults, typed here on an LSTM NMST run."""
    out = tmp_path / "resume"
    shutil.copytree(lstm_run, out)
    for flag, said in (
        (["--model", "gpt"], "model=lstm, not gpt"),
        (["--head", "softmax"], "head=nmst, not softmax"),
    ):
        rc, err = run_in_process(
            train.main, TINY + ["--out_dir", str(out), "--resume", *flag], capsys
        )
        assert_one_line_error(rc, err, said)


def test_a_damaged_log_line_costs_only_itself(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    lines = [json.dumps(dict(step=i, loss=1.0)) for i in range(1, 11)]
    lines[3] = "\x00garbage{"
    path.write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in curves.read_log(str(path), 8)] == [1, 2, 3, 5, 6, 7, 8]


def test_an_output_never_replaces_an_input_or_a_checkpoint(lstm_run, tmp_path, capsys):
    ckpt = tmp_path / "c.pt"
    shutil.copy(lstm_run / "ckpt_best.pt", ckpt)
    before = ckpt.read_bytes()
    for out, msg in (
        (ckpt, "would replace a checkpoint"),
        (lstm_run / "ckpt_last.pt", "would replace a checkpoint"),
    ):
        rc, err = run_in_process(evaluate.main, ["--ckpt", str(ckpt), "--out", str(out)], capsys)
        assert_one_line_error(rc, err, msg)
    assert ckpt.read_bytes() == before


def test_prepared_data_damaged_in_place_is_found_and_rebuilt(tmp_path, monkeypatch, capsys):
    """A byte changed in a prepared file, its size kept: the fingerprints catch it (once per
    process) and the folder is rebuilt, giving the same sequences as before."""
    import data.prepare as prepare
    from data.loader import load

    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    folder = prepare.prepare("ptb", verbose=False)
    first = load("ptb", verbose=False)[1]["train"][0].copy()
    raw = bytearray(open(os.path.join(folder, "train.bin"), "rb").read())
    raw[0] ^= 0x01
    open(os.path.join(folder, "train.bin"), "wb").write(bytes(raw))
    prepare.check_prepared.cache_clear()  # a new process
    _, splits, _ = load("ptb", verbose=True)
    assert "train.bin differ from meta.json" in capsys.readouterr().err
    assert (splits["train"][0] == first).all()


def test_a_read_only_or_full_cache_is_one_line(tmp_path, monkeypatch):
    import tempfile

    import data.prepare as prepare

    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(common.UserError, match="No space left on device .set NANOGEN_CACHE"):
        prepare.prepare("ptb", verbose=False)


@pytest.mark.parametrize("content", ["truncated safetensors", "a list", "a dict of strings"])
def test_malformed_hf_weights_are_one_line(content, tmp_path):
    if content == "truncated safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({"w": torch.zeros(100)}, str(path))
        path.write_bytes(path.read_bytes()[:60])
    else:
        path = tmp_path / "pytorch_model.bin"
        torch.save([torch.zeros(3)] if content == "a list" else {"w": "x"}, str(path))
    with pytest.raises(common.UserError, match="not a readable GPT-2 checkpoint"):
        data.gpt2_weights("gpt2", str(tmp_path))


def test_a_malformed_study_is_one_line(lstm_run, tmp_path, capsys):
    study = tmp_path / "s.json"
    evaluate.main(
        [
            "--ckpt",
            str(lstm_run / "ckpt_best.pt"),
            "--no_ppl",
            "--decoder",
            "greedy",
            "--L",
            "5",
            "--limit",
            "4",
            "--out",
            str(study),
        ]
    )
    good = json.loads(study.read_text())
    for damage in (
        lambda r: r["decoding"].pop("mean_length"),
        lambda r: r["decoding"].pop("r_nt_curve"),
        lambda r: r.pop("head"),
        lambda r: r.update(decoding="x"),
        lambda r: r.clear(),
    ):
        r = json.loads(json.dumps(good))
        damage(r)
        study.write_text(json.dumps(r))
        assert_one_line_error(
            *run_in_process(evaluate.main, ["--compare", str(study)], capsys),
            "is not a study of evaluate.py --decoder",
        )


def test_reproduce_refuses_a_head_given_twice(tmp_path, capsys):
    """It would count one run as two seeds (a spread of 0 over 'two seeds') in every table; and
    --heads where no head is compared."""
    argv = [
        "nmst-table1",
        "--scale",
        "tiny",
        "--heads",
        "nmst",
        "st",
        "nmst",
        "--out",
        str(tmp_path / "r"),
    ]
    assert_one_line_error(
        *run_in_process(reproduce.main, argv, capsys), "--heads names a head twice"
    )
    argv = [
        "ct-table3",
        "--scale",
        "tiny",
        "--heads",
        "nmst",
        "--out",
        str(tmp_path / "r"),
    ]  # ignored there
    assert_one_line_error(
        *run_in_process(reproduce.main, argv, capsys), "--heads is for nmst-table1"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("saved", ["", "[1]", '{"request": ["--split", "valid"], "ppl": 1}'])
def test_reproduce_evaluates_again_over_a_damaged_or_stale_result(saved, tmp_path, monkeypatch):
    ckpt, path = tmp_path / "ckpt_best.pt", tmp_path / "r.json"
    ckpt.write_text("")
    path.write_text(saved)  # written after the checkpoint; the last one asks for another split
    calls = []
    monkeypatch.setattr(
        evaluate,
        "main",
        lambda argv: calls.append(argv) or evaluate.write_json(argv[-1], {"ppl": 2.0}),
    )
    res = evaluate.evaluate_once(str(ckpt), ["--split", "test"], str(path))
    assert len(calls) == 1 and res == {"ppl": 2.0, "request": ["--split", "test"]}
    assert evaluate.evaluate_once(str(ckpt), ["--split", "test"], str(path)) == res
    assert len(calls) == 1  # the second time it is reused


def test_the_smaller_things(lstm_run, tmp_path, capsys):
    """A control token in a prompt, an empty prompt file, a story flag for a text checkpoint,
    evaluate.py flags of a decoder not asked for (--k, --temperature too) or of a perplexity
    skipped, a dangling symbolic link as --out_dir, a JSON given as a checkpoint (never torch's
    advice to load unsafely), an early-stopped run's resume (and a larger --patience)."""
    ckpt = str(lstm_run / "ckpt_best.pt")
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    study = tmp_path / "x.json"
    study.write_text('{"a": 1}')
    for main, flags, msg in (
        (sample.main, ["--ckpt", ckpt, "--prompt", "the company <eos> said"], "are control tokens"),
        (sample.main, ["--ckpt", ckpt, "--prompt_file", str(empty)], "give some text to continue"),
        (
            sample.main,
            ["--ckpt", ckpt, "--prompt", "the", "--title", "a"],
            "--title / --keywords are for story",
        ),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--decoder", "greedy", "--consistent"],
            "--decoder greedy does not use --consistent: drop it",
        ),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--decoder", "topk", "--k", "2", "--length_penalty", "1"],
            "--decoder topk does not use --length_penalty: drop it",
        ),
        (evaluate.main, ["--ckpt", ckpt, "--consistent"], "are options of a --decoder"),
        (evaluate.main, ["--ckpt", ckpt, "--L", "10", "100"], "are options of a --decoder"),
        (evaluate.main, ["--ckpt", ckpt, "--temperature", "0.5"], "are options of a --decoder"),
        (evaluate.main, ["--ckpt", ckpt, "--k", "5"], "are options of a --decoder"),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--no_ppl", "--decoder", "greedy", "--batch_size", "8"],
            "which --no_ppl skips",
        ),
        (
            evaluate.main,
            ["--ckpt", ckpt, "--plot", str(tmp_path / "figs")],
            "--plot draws the figures of",
        ),
        (train.main, TINY + ["--out_dir", str(link)], "cannot write to --out_dir"),
        (evaluate.main, ["--ckpt", str(study)], "is not a"),
    ):
        rc, err = run_in_process(main, flags, capsys)
        assert_one_line_error(rc, err, msg)
        assert "weights_only=False" not in err and "weights_only` set to `False" not in err
    out = tmp_path / "early"
    flags = TINY + ["--out_dir", str(out), "--lr", "1e-30", "--max_iters", "40", "--patience", "1"]
    train.main(flags)
    assert "early stop" in capsys.readouterr().out
    train.main(flags + ["--resume"])
    assert "already finished (early stop" in capsys.readouterr().out
    train.main([*flags[:-1], "3", "--resume"])  # --patience 3: it goes on
    assert "early stop: no improvement in 3" in capsys.readouterr().out


def test_batching_flags_on_a_stream_checkpoint_are_refused(tmp_path, capsys):
    out = tmp_path / "stream"
    train.main(
        [
            "--model",
            "lstm",
            "--task",
            "stream",
            "--dataset",
            "ptb",
            "--d_model",
            "8",
            "--batch_size",
            "4",
            "--bptt",
            "10",
            "--max_iters",
            "1",
            "--eval_seqs",
            "50",
            "--out_dir",
            str(out),
        ]
    )
    rc, err = run_in_process(
        evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), "--batch_size", "7"], capsys
    )
    assert_one_line_error(rc, err, "a stream checkpoint reads 10 columns: drop --batch_size")
