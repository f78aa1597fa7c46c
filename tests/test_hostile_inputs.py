"""Hostile inputs, one test per class (RESULTS.md, the failure table): numeric flags at the edge
of floating point, story checkpoints' decoder flags, multi-file outputs all or nothing, typed
flags on resume, a foreign checkpoint in a run folder, a damaged log line, an output naming an
input, prepared data damaged in place, a read-only or full cache, malformed HF weights, a
malformed study, a damaged reproduce.py folder."""
import json
import os
import shutil

import pytest
import torch

import cli
import evaluate
import recipes
import reproduce
import runs
import sample
import train
from checkpoint import CheckpointError, read_hf_weights
from conftest import assert_one_line_error, run_in_process

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
TINY = ["--model", "lstm", "--head", "nmst", "--epsilon", "1e-3", "--dataset", "ptb", "--d_model", "16",
        "--dropout", "0.1", "--batch_size", "8", "--lr", "3e-3", "--train_seqs", "96", "--eval_seqs", "16",
        "--max_iters", "4", "--eval_interval", "2", "--seed", "2"]
STORY = ["--model", "insnet", "--dataset", "synthetic", "--synthetic_count", "4", "--n_layer", "1",
         "--d_model", "16", "--n_head", "2", "--block_size", "256", "--batch_size", "4", "--max_iters", "2",
         "--eval_interval", "2", "--warmup", "0"]


@pytest.fixture(scope="module")
def lstm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lstm") / "run"
    assert train.main(TINY + ["--out_dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def story_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("story") / "run"
    assert train.main(STORY + ["--out_dir", str(out)]) == 0
    return str(out / "ckpt_last.pt")


def test_numbers_at_the_edge_of_floating_point(lstm_run, capsys):
    """A temperature that underflows samples greedily; absurd lengths, beams and seeds are one
    line each, in every entry point."""
    ckpt = str(lstm_run / "ckpt_best.pt")
    common = ["--ckpt", ckpt, "--prompt", "the company said it", "--L", "12", "--seed", "1"]
    assert sample.main(common + ["--decoder", "greedy"]) == 0
    greedy = capsys.readouterr().out
    for decoder in (["sample"], ["topk", "--k", "5"], ["nucleus", "--p", "0.9"]):
        assert sample.main(common + ["--decoder", *decoder, "--temperature", "1e-39"]) == 0
        assert capsys.readouterr().out == greedy
    for main, flags, msg in (
            (sample.main, ["--ckpt", ckpt, "--prompt", "the", "--L", str(10 ** 30)], "--L must lie in"),
            (sample.main, ["--ckpt", ckpt, "--prompt", "the", "--decoder", "beam", "--beam_size", str(10 ** 30)],
             "--beam_size must lie in"),
            (sample.main, ["--ckpt", ckpt, "--prompt", "the", "--seed", str(2 ** 64)], "--seed must lie in"),
            (evaluate.main, ["--ckpt", ckpt, "--decoder", "sample", "--seed", str(2 ** 64)], "--seed must lie in"),
            (evaluate.main, ["--ckpt", ckpt, "--decoder", "sample", "--temperature", "inf"], "--temperature"),
            (train.main, TINY + ["--seed", str(2 ** 64)], "--seed must lie in")):
        assert_one_line_error(*run_in_process(main, flags, capsys), msg)


def test_story_checkpoints_check_their_decoder_flags(story_ckpt, capsys):
    for main, flags, msg in (
            (sample.main, ["--decoder", "topk"], "top-k needs --k"),  # (synthetic: no title)
            (sample.main, ["--decoder", "sample", "--p", "0.5"], "does not use --p"),
            (sample.main, ["--L", "0"], "--L must lie in"),
            (sample.main, ["--decoder", "nucleus", "--p", "0.5"], "--decoder nucleus is not for this checkpoint (choose from greedy, sample, topk)"),
            (sample.main, ["--title", "w10"], "generates from <bos> alone"),
            (sample.main, ["--title", "w10", "--prompt", "w11"], "a story checkpoint takes --title"),
            (sample.main, ["--title", "w10", "--show_eos"], "a story checkpoint takes --title"),
            (evaluate.main, ["--decoder", "topk", "--no_ppl"], "top-k needs --k"),
            (evaluate.main, ["--decoder", "beam", "--beam_size", "2"], "--decoder beam is not for this checkpoint (choose from greedy, sample, topk)"),
            (evaluate.main, ["--tau_report"], "--tau_report is for left-to-right text checkpoints"),
            (evaluate.main, ["--decoder", "greedy", "--plot", "figs"], "--plot is for left-to-right text checkpoints"),
            (evaluate.main, ["--decoder", "greedy", "--L", "5"], "--L is for left-to-right text checkpoints"),
            (evaluate.main, ["--decoder", "greedy", "--traces", "2"], "--traces is for left-to-right text"),
            (evaluate.main, ["--no_ppl"], "nothing left to do"),
            (evaluate.main, ["--max_tokens", "100"], "stories are batched by --batch_size")):
        assert_one_line_error(*run_in_process(main, ["--ckpt", story_ckpt, *flags], capsys), msg)
    assert evaluate.main(["--ckpt", story_ckpt, "--batch_size", "3"]) == 0  # stories batch by sequences
    capsys.readouterr()
    assert sample.main(["--ckpt", story_ckpt, "--L", "3", "--seed", "1", "--decoder", "sample"]) == 0
    canvases = [ln.split("=", 1)[1].split()[1:] for ln in capsys.readouterr().out.splitlines()[:-1]]
    assert canvases[0] == [] and all(w[0] == "w" and int(w[1:]) for c in canvases for w in c)


def test_a_set_of_figures_is_written_all_or_nothing(tmp_path):
    """Interrupted while the figures are drawn: the folder keeps the previous run's set; a
    complete set replaces it, and a figure this run does not draw is removed."""
    folder = tmp_path / "figs"
    folder.mkdir()
    for name in evaluate.STUDY_FIGURES:
        (folder / name).write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with cli.file_set(str(folder), evaluate.STUDY_FIGURES) as tmp:
            open(os.path.join(tmp, "r_nt.png"), "w").write("new")
            raise KeyboardInterrupt
    assert all((folder / n).read_text() == "old" for n in evaluate.STUDY_FIGURES)
    with cli.file_set(str(folder), evaluate.STUDY_FIGURES) as tmp:
        for name in ("r_nt.png", "lengths.png"):  # no traces: no p_eos.png
            open(os.path.join(tmp, name), "w").write("new")
    assert sorted(os.listdir(folder)) == ["lengths.png", "r_nt.png"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


def test_a_flag_typed_at_its_default_is_honoured_or_refused_on_resume(lstm_run, tmp_path, capsys):
    """--model gpt and --head softmax are argparse's defaults, typed here on an LSTM NMST run."""
    out = tmp_path / "resume"
    shutil.copytree(lstm_run, out)
    os.remove(out / "run.json")  # (a copy is another folder; here it stands in for the same run)
    for flag in (["--model", "gpt"], ["--head", "softmax"], ["--dropout", "0.1", "--seed", "0"]):
        rc, err = run_in_process(train.main, TINY + ["--out_dir", str(out), "--resume", *flag], capsys)
        assert_one_line_error(rc, err, "was trained with")


def test_a_foreign_checkpoint_in_a_run_folder_is_refused(lstm_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert train.main(TINY + ["--out_dir", str(other), "--seed", "3"]) == 0
    shutil.copy(lstm_run / "ckpt_last.pt", other / "ckpt_last.pt")
    rc, err = run_in_process(train.main, TINY + ["--out_dir", str(other), "--seed", "3", "--resume",
                                                 "--max_iters", "6"], capsys)
    assert_one_line_error(rc, err, "belongs to another run")
    for damaged in ("", "[1]", '{"run_id": 5}'):  # a damaged run.json: the run id is unknown
        (other / "run.json").write_text(damaged)
        assert runs.folder_run_id(str(other)) is None


def test_a_damaged_log_line_costs_only_itself(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    lines = [json.dumps(dict(step=i, loss=1.0)) for i in range(1, 11)]
    lines[3] = "\x00garbage{"
    path.write_text("\n".join(lines) + "\n")
    runs.keep_log_until(str(path), 8)
    kept = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert kept == [1, 2, 3, 5, 6, 7, 8]
    assert "skipped 1 damaged line(s) (line 4)" in capsys.readouterr().err


def test_an_output_never_replaces_an_input_or_a_checkpoint(lstm_run, tmp_path, capsys):
    ckpt = tmp_path / "c.pt"
    shutil.copy(lstm_run / "ckpt_best.pt", ckpt)
    before = ckpt.read_bytes()
    for out, msg in ((ckpt, "also an input"), (lstm_run / "ckpt_last.pt", "is a checkpoint")):
        rc, err = run_in_process(evaluate.main, ["--ckpt", str(ckpt), "--out", str(out)], capsys)
        assert_one_line_error(rc, err, msg)
    assert ckpt.read_bytes() == before


def test_prepared_data_damaged_in_place_is_found_and_rebuilt(tmp_path, monkeypatch, capsys):
    """A byte changed in a prepared file, its size kept: the fingerprints catch it (once per
    process) and the folder is rebuilt, giving the same sequences as before."""
    import data.prepare as prepare
    from data.loader import load
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    _, splits = load("ptb", verbose=False)
    folder, first = splits["train"].folder, splits["train"][0].copy()
    raw = bytearray(open(os.path.join(folder, "train.bin"), "rb").read())
    raw[0] ^= 0x01
    open(os.path.join(folder, "train.bin"), "wb").write(bytes(raw))
    monkeypatch.setattr(prepare, "VERIFIED", set())  # a new process
    _, splits = load("ptb", verbose=True)
    assert "differs from what meta.json recorded" in capsys.readouterr().err
    assert (splits["train"][0] == first).all()


def test_a_read_only_or_full_cache_is_one_line(tmp_path, monkeypatch):
    import tempfile

    import data.prepare as prepare
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    out = prepare.prepared_dir("ptb", prepare.locate("ptb"))
    stale = tmp_path / "cache" / "prepared" / f".{os.path.basename(out)}-999999999-abc"
    stale.mkdir(parents=True)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(prepare.DataError, match="No space left on device"):
        prepare.prepare("ptb", verbose=False)
    assert not stale.exists()  # a killed preparation's temporary folder is removed


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
    with pytest.raises(CheckpointError, match="GPT-2"):
        read_hf_weights(str(tmp_path))


def test_a_malformed_study_is_one_line(lstm_run, tmp_path, capsys):
    study = tmp_path / "s.json"
    assert evaluate.main(["--ckpt", str(lstm_run / "ckpt_best.pt"), "--no_ppl", "--decoder", "greedy", "--L",
                          "5", "--limit", "4", "--out", str(study)]) == 0
    good = json.loads(study.read_text())
    for damage in (lambda r: r["decoding"].pop("mean_length"), lambda r: r["decoding"]["r_nt"].update(x=1),
                   lambda r: r.update(eos_traces=[1]), lambda r: r.update(epsilon="x"),
                   lambda r: r.update(head=None), lambda r: r["decoding"].update(n=1.5),
                   lambda r: r["decoding"].update(unique_non_terminated="x"),
                   lambda r: r["eos_traces"][0].update(p_eos=["x"])):
        r = json.loads(json.dumps(good))
        damage(r)
        study.write_text(json.dumps(r))
        assert_one_line_error(*run_in_process(evaluate.main, ["--compare", str(study)], capsys), "damaged study")


def test_reproduce_over_a_damaged_results_folder(tmp_path, monkeypatch):
    """A finished run whose checkpoint was removed: one line naming the folder to delete (and
    no advice of a flag reproduce.py does not have)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "steps.jsonl").write_text("")
    monkeypatch.setattr(train, "fit", lambda argv, advise=True: None)  # "already finished"
    with pytest.raises(cli.UserError, match="delete") as e:
        reproduce.train_once(str(out), ["--model", "lstm"])
    assert "--resume" not in str(e.value)

    def refused(argv, advise=True):
        raise cli.UserError("x already holds a run: continue it with --resume")
    monkeypatch.setattr(train, "fit", refused)
    with pytest.raises(cli.UserError, match="delete"):
        reproduce.train_once(str(out), ["--model", "lstm"])


def test_reproduce_refuses_a_head_given_twice(tmp_path, capsys):
    """It would count one run as two seeds (a spread of 0 over 'two seeds') in every table; and
    --heads where no head is compared."""
    argv = ["nmst-table1", "--scale", "tiny", "--heads", "nmst", "st", "nmst", "--out", str(tmp_path / "r")]
    assert_one_line_error(*run_in_process(reproduce.main, argv, capsys), "--heads names a head twice")
    argv = ["ct-table3", "--scale", "tiny", "--heads", "nmst", "--out", str(tmp_path / "r")]  # ignored there
    assert_one_line_error(*run_in_process(reproduce.main, argv, capsys), "--heads is for nmst-table1")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("saved", ["", "[1]", '{"request": ["--split", "valid"], "ppl": 1}'])
def test_reproduce_evaluates_again_over_a_damaged_or_stale_result(saved, tmp_path, monkeypatch):
    ckpt, path = tmp_path / "ckpt_best.pt", tmp_path / "r.json"
    ckpt.write_text("")
    path.write_text(saved)  # written after the checkpoint; the last one asks for another split
    calls = []
    monkeypatch.setattr(evaluate, "main", lambda argv: calls.append(argv) or cli.write_json(
        argv[-1], {"ppl": 2.0}))
    res = reproduce.evaluate_once(str(ckpt), ["--split", "test"], str(path))
    assert len(calls) == 1 and res == {"ppl": 2.0, "request": ["--split", "test"]}
    assert reproduce.evaluate_once(str(ckpt), ["--split", "test"], str(path)) == res
    assert len(calls) == 1  # the second time it is reused


def test_the_smaller_things(lstm_run, tmp_path, capsys):
    """A control token in a prompt, an empty prompt file, a story flag for a text checkpoint,
    evaluate.py flags of a decoder not asked for (--k, --temperature, --seed too) or of a
    perplexity skipped, a dangling symbolic link as --out_dir, a JSON given as a checkpoint
    (never torch's advice to load unsafely), an early-stopped run's resume advice (and that
    following it works)."""
    ckpt = str(lstm_run / "ckpt_best.pt")
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    study = tmp_path / "x.json"
    study.write_text('{"a": 1}')
    for main, flags, msg in (
            (sample.main, ["--ckpt", ckpt, "--prompt", "the company <eos> said"], "a control token"),
            (sample.main, ["--ckpt", ckpt, "--prompt_file", str(empty)], "holds no prompt"),
            (sample.main, ["--ckpt", ckpt, "--prompt", "the", "--title", "a"], "--title / --keywords are for story"),
            (evaluate.main, ["--ckpt", ckpt, "--decoder", "greedy", "--consistent"],
             "--decoder greedy does not use --consistent: drop it"),
            (evaluate.main, ["--ckpt", ckpt, "--decoder", "topk", "--k", "2", "--length_penalty", "1"],
             "--decoder topk does not use --length_penalty: drop it"),
            (evaluate.main, ["--ckpt", ckpt, "--consistent"], "are options of a --decoder"),
            (evaluate.main, ["--ckpt", ckpt, "--L", "10", "100"], "are options of a --decoder"),
            (evaluate.main, ["--ckpt", ckpt, "--temperature", "0.5"], "are options of a --decoder"),
            (evaluate.main, ["--ckpt", ckpt, "--k", "5"], "are options of a --decoder"),
            (evaluate.main, ["--ckpt", ckpt, "--seed", "3"], "--seed seeds a --decoder"),
            (evaluate.main, ["--ckpt", ckpt, "--no_ppl", "--decoder", "greedy", "--batch_size", "8"],
             "which --no_ppl skips"),
            (evaluate.main, ["--ckpt", ckpt, "--plot", str(tmp_path / "figs")], "--plot draws the figures of"),
            (train.main, TINY + ["--out_dir", str(link)], "symbolic link to a missing folder"),
            (evaluate.main, ["--ckpt", str(study)], "is not a")):
        rc, err = run_in_process(main, flags, capsys)
        assert_one_line_error(rc, err, msg)
        assert "weights_only=False" not in err and "weights_only` set to `False" not in err
    out = tmp_path / "early"
    flags = TINY + ["--out_dir", str(out), "--lr", "1e-30", "--max_iters", "40", "--patience", "1"]
    assert train.main(flags) == 0
    assert "early stop" in capsys.readouterr().out
    assert train.main(flags + ["--resume"]) == 0
    assert "raise --patience to go on" in capsys.readouterr().out
    assert train.main([*flags[:-1], "3", "--resume"]) == 0  # --patience 3: it goes on
    assert "early stop: no improvement in 3" in capsys.readouterr().out


def test_flags_that_do_not_apply_are_said(tmp_path, capsys):
    assert train.main(TINY + ["--n_head", "4", "--warmup", "3", "--out_dir", str(tmp_path / "r"),
                              "--max_iters", "1", "--eval_interval", "1"]) == 0
    assert "note: --n_head, --warmup do not apply to --model lstm" in capsys.readouterr().out
    # the probe continues completion contexts: a stream run has none
    recipes.parse_args(["--model", "lstm", "--dataset", "ptb", "--task", "stream", "--probe", "8",
                        "--train_seqs", "9"])
    assert "note: --train_seqs, --probe do not apply to --model lstm --head softmax --task " \
        "stream" in capsys.readouterr().out
    recipes.parse_args(["--model", "insnet", "--dataset", "rocstories", "--no_tie"])
    assert "note: --no_tie does not apply to --model insnet" in capsys.readouterr().out
    # eps is read by the ST / NMST heads alone (eq. 9, 10); the insertion models take no
    # temperature (both were ignored without a word)
    recipes.parse_args(["--model", "lstm", "--dataset", "ptb", "--epsilon", "1e-3"])
    assert "note: --epsilon does not apply to --model lstm --head softmax" in \
        capsys.readouterr().out
    recipes.parse_args(["--model", "insnet", "--dataset", "synthetic", "--temperature", "2",
                        "--data_dir", str(tmp_path)])  # (its data is generated)
    assert "note: --temperature, --data_dir do not apply to --model insnet" in \
        capsys.readouterr().out
    # WikiText-103 is GPT-2 BPE, the story data have their own words: --vocab word was ignored
    recipes.parse_args(["--dataset", "wikitext103", "--vocab", "word"])
    assert "note: --vocab does not apply to --model gpt --head softmax --task completion " \
        "--dataset wikitext103" in capsys.readouterr().out
    recipes.parse_args(["--model", "lstm", "--dataset", "ptb", "--head", "st", "--epsilon", "1e-3",
                        "--vocab", "word"])
    assert "note" not in capsys.readouterr().out


def test_batching_flags_on_a_stream_checkpoint_are_refused(tmp_path, capsys):
    out = tmp_path / "stream"
    assert train.main(["--model", "lstm", "--task", "stream", "--dataset", "ptb", "--d_model", "8",
                       "--batch_size", "4", "--bptt", "10", "--max_iters", "1", "--eval_seqs", "50",
                       "--out_dir", str(out)]) == 0
    rc, err = run_in_process(evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), "--batch_size", "7"], capsys)
    assert_one_line_error(rc, err, "do not apply to a stream checkpoint")
