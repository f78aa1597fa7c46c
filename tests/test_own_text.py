"""Your own text (--dataset text --data_dir DIR), at word, char and BPE level: it trains,
evaluates, and samples with no data at all (the checkpoint carries its vocabulary); too little
text, or text that is not UTF-8, is one line; and sample.py and evaluate.py agree to the token
on a GPT's context window."""

import os
import shutil

import pytest

import evaluate
import sample
import train
from conftest import ROOT, assert_one_line_error, run_in_process
from data.prepare import prepare

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them
SHARED = os.environ.get("NANOGEN_DATA") or os.path.join(ROOT, "..", "shared", "data")


@pytest.fixture(scope="module")
def own_text(tmp_path_factory):
    """A folder with a train.txt only: 1,500 lines of PTB, lower-cased words (valid and test
    are held out of it)."""
    folder = tmp_path_factory.mktemp("mytext")
    ptb = os.path.join(SHARED, "ptb", "ptb.train.txt")
    if not os.path.exists(ptb):
        ptb = os.path.join(SHARED, "ptb.train.txt")
    with open(ptb) as f:
        lines = [line for _, line in zip(range(1500), f)]
    (folder / "train.txt").write_text("".join(lines))
    return folder


@pytest.mark.parametrize("vocab,model", [("word", "lstm"), ("char", "lstm"), ("bpe", "gpt")])
def test_own_text_trains_evaluates_and_samples_without_data(
    vocab, model, own_text, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    monkeypatch.chdir(own_text.parent)  # a relative --data_dir ...
    flags = [
        "--dataset",
        "text",
        "--data_dir",
        own_text.name,
        "--vocab",
        vocab,
        "--model",
        model,
        "--head",
        "nmst",
        "--epsilon",
        "1e-3",
        "--d_model",
        "32",
        "--n_layer",
        "1",
        "--n_head",
        "2",
        "--block_size",
        "512",
        "--batch_size",
        "8",
        "--lr",
        "3e-3",
        "--max_iters",
        "4",
        "--eval_interval",
        "2",
        "--out_dir",
        str(out),
    ]
    train.main(flags)
    err = capsys.readouterr().err
    assert f"note: your text from {own_text} (valid and test held out of train.txt)" in err
    assert "official" not in err  # (a folder of one's own text is no copy of anything)
    evaluate.main(["--ckpt", str(out / "ckpt_best.pt"), "--data_dir", str(own_text)])
    with_dir = capsys.readouterr().out
    assert "ppl" in with_dir
    monkeypatch.chdir(tmp_path)  # ... is the same folder seen from elsewhere
    evaluate.main(["--ckpt", str(out / "ckpt_best.pt")])  # the run's own --data_dir
    assert capsys.readouterr().out == with_dir
    # sampling needs no data: no --data_dir, no NANOGEN_DATA, an empty cache
    monkeypatch.delenv("NANOGEN_DATA", raising=False)
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    sample.main(
        [
            "--ckpt",
            str(out / "ckpt_best.pt"),
            "--prompt",
            "the company said it",
            "--L",
            "8",
            "--allow_unk",
        ]
    )
    assert ">>>" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "empty-cache" / "prepared")


def test_own_text_needs_a_train_file(tmp_path, capsys):
    rc, err = run_in_process(
        train.main,
        [
            "--dataset",
            "text",
            "--data_dir",
            str(tmp_path),
            "--model",
            "lstm",
            "--out_dir",
            str(tmp_path / "run"),
        ],
        capsys,
    )
    assert_one_line_error(rc, err, "DIR/train.txt")


def test_too_little_text_is_one_line(tmp_path, capsys):
    """A train.txt whose lines are all held out or too short, and an empty test.txt: one line
    each (an empty prepared split was numpy's 'cannot mmap an empty file'); so is text that is
    not UTF-8, or that marks its lines' ends with the word <eos> (it would be read as eos)."""
    small, text = tmp_path / "small", tmp_path / "text"
    small.mkdir()
    text.mkdir()
    (small / "train.txt").write_text("a b c\n" + " ".join(f"w{i}" for i in range(30)) + "\n")

    def line(i):
        return " ".join(f"w{(i * j) % 30}" for j in range(15)) + "\n"

    (text / "train.txt").write_text("".join(map(line, range(40))))
    (text / "valid.txt").write_text("".join(map(line, range(5))))
    (text / "test.txt").write_text("")
    latin1 = tmp_path / "latin1"
    latin1.mkdir()
    (latin1 / "train.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    rc, err = run_in_process(
        train.main,
        ["--dataset", "text", "--data_dir", str(latin1), "--out_dir", str(tmp_path / "never")],
        capsys,
    )
    assert_one_line_error(rc, err, "is not UTF-8")
    marked = tmp_path / "marked"  # a corpus exported with its own end markers (in any split)
    shutil.copytree(text, marked)
    (marked / "valid.txt").write_text(line(1).replace("\n", " <eos>\n"))
    rc, err = run_in_process(
        train.main,
        ["--dataset", "text", "--data_dir", str(marked), "--out_dir", str(tmp_path / "never")],
        capsys,
    )
    assert_one_line_error(rc, err, "your valid text holds the word <eos>: nanogen ends every line")
    tiny = [
        "--dataset",
        "text",
        "--model",
        "lstm",
        "--d_model",
        "8",
        "--batch_size",
        "4",
        "--max_iters",
        "2",
        "--out_dir",
        str(tmp_path / "never"),
    ]  # (a later --out_dir wins)
    for folder in (small, text):  # prepared quietly first: the errors are then the only output
        prepare("text", str(folder), verbose=False)
    for task, msg in (
        ("completion", "needs lines of more than 10 tokens"),
        ("stream", "the train split is too short for a stream"),
    ):
        rc, err = run_in_process(
            train.main,
            [*tiny, "--data_dir", str(small), "--task", task, "--out_dir", str(tmp_path / task)],
            capsys,
        )
        assert_one_line_error(rc, err, msg)
        train.main(
            [
                *tiny,
                "--data_dir",
                str(text),
                "--task",
                task,
                "--out_dir",
                str(tmp_path / f"run-{task}"),
            ]
        )
    prepare("text", str(small), verbose=False, vocab="bpe")
    rc, err = run_in_process(
        train.main, [*tiny, "--data_dir", str(small), "--vocab", "bpe"], capsys
    )
    assert_one_line_error(rc, err, "needs lines of more than 10 tokens")
    ckpt = ["--data_dir", str(text), "--split", "test", "--ckpt"]
    for run, flags, msg in (
        ("completion", [], "the test split holds no sequence that fits"),
        ("completion", ["--no_ppl", "--decoder", "greedy"], "no context to decode"),
        ("stream", [], "the test split is too short for a stream"),
    ):
        rc, err = run_in_process(
            evaluate.main, [*ckpt, str(tmp_path / f"run-{run}" / "ckpt_last.pt"), *flags], capsys
        )
        assert_one_line_error(rc, err, msg)


def test_sample_and_evaluate_agree_on_the_context_window(tmp_path, capsys):
    """A 10-token prompt and --L tokens use 10 + L - 1 positions (the last token is never fed
    back): with a 64-token window, --L 55 fits and --L 56 does not, in both commands."""
    out = tmp_path / "gpt"
    train.main(
        [
            "--model",
            "gpt",
            "--head",
            "softmax",
            "--dataset",
            "ptb",
            "--d_model",
            "16",
            "--n_layer",
            "1",
            "--n_head",
            "2",
            "--block_size",
            "64",
            "--batch_size",
            "8",
            "--train_seqs",
            "64",
            "--eval_seqs",
            "8",
            "--max_iters",
            "1",
            "--eval_interval",
            "1",
            "--out_dir",
            str(out),
        ]
    )
    ckpt = str(out / "ckpt_last.pt")
    prompt = "the company said it will sell the unit to its parent"  # 11 words: use the first 10
    prompt = " ".join(prompt.split()[:10])
    for L, fits in ((55, True), (56, False)):
        rc, err = run_in_process(
            sample.main, ["--ckpt", ckpt, "--prompt", prompt, "--L", str(L)], capsys
        )
        rc2, err2 = run_in_process(
            evaluate.main,
            ["--ckpt", ckpt, "--no_ppl", "--decoder", "greedy", "--L", str(L), "--limit", "2"],
            capsys,
        )
        if fits:
            assert rc == 0 and rc2 == 0, (err, err2)
        else:
            assert_one_line_error(rc, err, "use --L 55 or less")
            assert_one_line_error(rc2, err2, "use --L 55 or less")


def test_a_byte_order_mark_is_not_text(tmp_path, monkeypatch):
    """A file saved with a UTF-8 BOM (Windows editors): its first word is the word, not
    '\\ufeff' + the word, in the vocabulary (sample.py's --prompt_file:
    test_sample_and_reproduce)."""
    from data.prepare import load_meta, tokenizer

    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    line = "the cat sat on the mat and then the dog ran far away from it\n"
    (tmp_path / "train.txt").write_text("\ufeff" + line * 30, encoding="utf-8")
    folder = prepare("text", str(tmp_path), verbose=False)
    tok = tokenizer(load_meta(folder)["vocab"])
    assert "the" in tok.stoi and not any("\ufeff" in w for w in tok.tokens)


def test_a_run_whose_data_moved_says_so(own_text, tmp_path, capsys):
    text, out = tmp_path / "text", tmp_path / "run"
    shutil.copytree(own_text, text)
    flags = [
        "--dataset",
        "text",
        "--model",
        "lstm",
        "--d_model",
        "8",
        "--n_layer",
        "1",
        "--batch_size",
        "8",
        "--eval_interval",
        "1",
        "--probe",
        "0",
        "--out_dir",
        str(out),
    ]
    train.main([*flags, "--data_dir", str(text), "--max_iters", "1"])
    text.rename(tmp_path / "moved")
    capsys.readouterr()  # (the first run's notes and counts)
    rc, err = run_in_process(train.main, [*flags, "--max_iters", "2", "--resume"], capsys)
    assert_one_line_error(
        rc, err, f"the run's --data_dir {text} is not there (moved?): give --data_dir DIR"
    )
    train.main([*flags, "--max_iters", "2", "--resume", "--data_dir", str(tmp_path / "moved")])
    (tmp_path / "moved").rename(text)  # evaluate.py: the checkpoint names the folder it left
    ckpt = str(out / "ckpt_last.pt")
    rc, err = run_in_process(evaluate.main, ["--ckpt", ckpt], capsys)
    assert_one_line_error(
        rc, err, f"the run's --data_dir {tmp_path / 'moved'} is not there (moved?)"
    )
    evaluate.main(
        [
            "--ckpt",
            ckpt,
            "--data_dir",
            str(text),
            "--no_ppl",
            "--decoder",
            "greedy",
            "--L",
            "2",
            "--limit",
            "2",
        ]
    )


def test_a_run_that_read_its_text_through_nanogen_data_evaluates(
    own_text, tmp_path, monkeypatch, capsys
):
    """No --data_dir, $NANOGEN_DATA naming the text: evaluate.py reads it there as train.py did,
    and without it says in one line where the text must be given."""
    out = tmp_path / "run"
    monkeypatch.setenv("NANOGEN_DATA", str(own_text))
    train.main(
        [
            "--dataset",
            "text",
            "--model",
            "lstm",
            "--d_model",
            "8",
            "--n_layer",
            "1",
            "--batch_size",
            "8",
            "--max_iters",
            "1",
            "--eval_interval",
            "1",
            "--probe",
            "0",
            "--out_dir",
            str(out),
        ]
    )
    ckpt = str(out / "ckpt_best.pt")
    evaluate.main(["--ckpt", ckpt, "--limit", "4"])
    assert "ppl" in capsys.readouterr().out
    monkeypatch.delenv("NANOGEN_DATA")
    rc, err = run_in_process(evaluate.main, ["--ckpt", ckpt], capsys)
    assert_one_line_error(
        rc, err, "--dataset text reads your own text: --data_dir DIR with DIR/train.txt"
    )
