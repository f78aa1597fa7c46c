"""sample.py feeds a prompt as training formed a context (the authors' protocol: <bos> and <cpad>
too), refuses control tokens, text that is not UTF-8 and a --seed that nothing draws with, each in
one line, and reads as named steps."""

import ast
import io
import os
import subprocess

import pytest
import torch

import sample
import train
from common import UserError
from conftest import ROOT, assert_one_line_error, run_in_process
from data.loader import collate, load
from data.prepare import Vocabulary, encode_prompt


def authors_vocabulary():
    return Vocabulary.build("word", ["a b c d e f g h i j k l"], protocol="authors")


def test_an_authors_prompt_opens_with_bos_and_is_padded_as_training_pads_it():
    tok = authors_vocabulary()
    bos, cpad, a, b, c = (tok.stoi[w] for w in ("<bos>", "<cpad>", "a", "b", "c"))
    assert encode_prompt(tok, "a b c", "authors") == [bos, *[cpad] * 7, a, b, c]
    eleven = "a b c d e f g h i j k"
    assert encode_prompt(tok, eleven, "authors") == [bos, *encode_prompt(tok, eleven)]
    assert encode_prompt(tok, "a b c") == [a, b, c]


@pytest.mark.parametrize("word", ["<bos>", "<cpad>", "<eos>", "<unk>"])
def test_a_control_token_in_a_prompt_is_one_line(word):
    with pytest.raises(UserError, match=f"^{word}: .* are control tokens, not text"):
        encode_prompt(authors_vocabulary(), f"a {word} b", "authors", allow_unk=True)
    # (a character model reads "<bos>" as five characters)
    chars = Vocabulary.build("char", ["<bos> a b"])
    assert len(encode_prompt(chars, "<bos>")) == len("<bos> ")


def test_sample_py_reads_as_named_steps():
    """No function over 50 lines, McCabe <= 10 in each, and >= 10 % comment-only lines."""
    path = os.path.join(ROOT, "sample.py")
    lines = open(path, encoding="utf-8").read().splitlines()
    functions = [n for n in ast.walk(ast.parse("\n".join(lines))) if isinstance(n, ast.FunctionDef)]
    assert max(f.end_lineno - f.lineno + 1 for f in functions) <= 50
    comments = sum(line.strip().startswith("#") for line in lines)
    code = sum(bool(line.strip()) for line in lines) - comments
    assert comments >= 0.1 * code
    ruff = ["ruff", "check", "--isolated", "--select", "C901"]
    ruff += ["--config", "lint.mccabe.max-complexity=10", path]
    found = subprocess.run(ruff, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny --protocol authors run on PTB, and a tiny insertion model of synthetic stories."""
    root = tmp_path_factory.mktemp("runs")
    authors = "--model rnn --head nmst --dataset ptb --protocol authors --n_layer 1 --d_model 16"
    authors += " --max_iters 6 --train_seqs 200 --eval_seqs 16 --probe 0 --no_curves"
    train.main(authors.split() + ["--out_dir", str(root / "authors")])
    story = "--model insnet --dataset synthetic --synthetic_count 4 --n_layer 1 --d_model 16"
    story += " --n_head 2 --block_size 256 --batch_size 4 --max_iters 2 --eval_interval 2"
    train.main(story.split() + ["--warmup", "0", "--out_dir", str(root / "story")])
    return str(root / "authors" / "ckpt_last.pt"), str(root / "story" / "ckpt_last.pt")


@pytest.mark.slow
def test_an_authors_prompt_gets_the_p_eos_of_its_training_line(runs, capsys, monkeypatch):
    """p(eos) at the first step after a prompt is the model's at the same place of the training
    line holding those words: a short line (<cpad> padding) and a long one (its first 10 words)."""
    from evaluate import model_from_checkpoint

    ckpt = torch.load(runs[0], weights_only=True)
    model = model_from_checkpoint(ckpt, runs[0]).eval()
    meta, splits, _ = load("ptb", protocol="authors", verbose=False)
    train_split, words = splits["train"], meta["vocab"]["tokens"]
    # (a prompt may not hold <unk>: the first padded line without one, and the first line)
    padded = [i for i in range(100) if words[train_split[i][1]] == "<cpad>"]
    short = next(i for i in padded if words.index("<unk>") not in train_split.context(i))
    seen, real = [], sample.eos_probs
    monkeypatch.setattr(sample, "eos_probs", lambda *a: seen.append(real(*a)) or seen[-1])
    for i in (short, 0):
        batch = collate(train_split, [i])
        with torch.no_grad():
            log_p, _ = model.log_probs(batch["inputs"], batch["t"])
        # The first continuation step's p(eos): the prediction at the context's last token.
        expected = float(log_p[0, train_split.contexts[i] - 1, model.eos_id].exp())
        context = [words[t] for t in train_split.context(i)]
        prompt = " ".join(w for w in context if w not in ("<bos>", "<cpad>"))
        sample.main(["--ckpt", runs[0], "--prompt", prompt, "--L", "1", "--show_eos"])
        shown = float(capsys.readouterr().out.split("p(eos)=")[1].split()[0])
        assert seen[-1][0] == pytest.approx(expected, abs=1e-6)
        assert shown == pytest.approx(expected, abs=5e-5)


@pytest.mark.slow
def test_control_tokens_and_a_seed_nothing_draws_with_are_one_line(runs, capsys):
    text = ["--ckpt", runs[0], "--prompt", "the company said", "--L", "2"]
    for flags, message in (
        (["--prompt", "the <bos> said"], "<bos>: <bos>, <cpad>, <eos> and <unk> are control"),
        (["--prompt", "<cpad> said"], "<cpad>: <bos>, <cpad>, <eos> and <unk> are control"),
        (["--seed", "1"], "--decoder greedy does not use --seed: drop it"),
        (["--decoder", "beam", "--beam_size", "2", "--seed", "1"], "beam does not use --seed"),
    ):
        assert_one_line_error(*run_in_process(sample.main, text + flags, capsys), message)
    story = ["--ckpt", runs[1], "--L", "2", "--seed", "1"]
    assert_one_line_error(
        *run_in_process(sample.main, story, capsys), "greedy does not use --seed: drop it"
    )
    sample.main(story + ["--decoder", "sample"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("[")


@pytest.mark.slow
def test_text_that_is_not_utf8_is_one_line_naming_where(runs, capsys, monkeypatch, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"the company\nsaid \xff it\n")
    text = ["--ckpt", runs[0], "--L", "2"]
    expected = f'--prompt_file {bad}, line 2: "said \\xff it" is not UTF-8 text'
    assert_one_line_error(
        *run_in_process(sample.main, text + ["--prompt_file", str(bad)], capsys), expected
    )
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(bad.read_bytes())))
    assert_one_line_error(
        *run_in_process(sample.main, text + ["--prompt_file", "-"], capsys),
        '--prompt_file -, line 2: "said \\xff it" is not UTF-8 text',
    )
    # (the command line hands bytes that are not UTF-8 over as lone surrogates)
    for flags in (["--prompt", "said \udcff it"], ["--prompt", "said \udcff it", "--allow_unk"]):
        assert_one_line_error(
            *run_in_process(sample.main, text + flags, capsys),
            '--prompt: "said \\xff it" is not UTF-8 text',
        )
    story = ["--ckpt", runs[1], "--title", "w\udcff"]
    assert_one_line_error(
        *run_in_process(sample.main, story, capsys), '--title / --keywords: "w\\xff" is not UTF-8'
    )


@pytest.mark.slow
def test_keywords_without_a_title_is_one_line(runs, capsys, tmp_path):
    """A story checkpoint given --keywords and no --title (an AttributeError before)."""
    ckpt = torch.load(runs[1], weights_only=True)
    ckpt["args"]["dataset"] = "rocstories"
    torch.save(ckpt, tmp_path / "story.pt")
    assert_one_line_error(
        *run_in_process(
            sample.main, ["--ckpt", str(tmp_path / "story.pt"), "--keywords", "w1"], capsys
        ),
        "a story checkpoint takes --title TEXT",
    )
