"""data/stories.py, BLEU, and the insertion models through train.py / evaluate.py end to end."""

import json
import os
import random
import re

import pytest

import evaluate
import insnet
import sample
import train
from common import load_checkpoint
from conftest import run_cli
from data.stories import (
    BOS,
    EOS,
    SEP,
    UNK,
    build_vocab,
    encode_story,
    keyword_positions,
    parse_story,
    synthetic,
)
from evaluate import bleu

LINE = (
    "the pet bug <EOT> oliver spotted jar hoped safe <EOL> </s> oliver was playing . </s> "
    "he spotted a bug ."
)


def test_parse_and_encode_a_story():
    s = parse_story(LINE)
    assert s["title"] == ["the", "pet", "bug"] and s["keywords"] == [
        "oliver",
        "spotted",
        "jar",
        "hoped",
        "safe",
    ]
    assert s["story"] == "oliver was playing . he spotted a bug .".split()
    assert keyword_positions(s["story"], s["keywords"]) == [
        0,
        5,
    ]  # jar / hoped / safe are not in this story
    vocab = build_vocab([s], min_count=1)
    stoi = {w: i for i, w in enumerate(vocab)}
    ins = encode_story(s, stoi, "storyline", "insnet")
    assert (
        ins["tokens"][:5] == [BOS, stoi["the"], stoi["pet"], stoi["bug"], SEP]
        and ins["tokens"][-1] == EOS
    )
    assert ins["n_given"] == 5 and ins["keyword_pos"] == [5, 10]
    assert [ins["tokens"][p] for p in ins["keyword_pos"]] == [stoi["oliver"], stoi["spotted"]]
    l2r = encode_story(s, stoi, "storyline", "gpt")  # the storyline is a prefix for L2R
    assert l2r["n_given"] == 5 + 5 + 1 and l2r["tokens"][5:11] == [
        *(stoi[k] for k in s["keywords"]),
        SEP,
    ]
    assert encode_story(s, {}, "story", "insnet")["tokens"][1:4] == [UNK] * 3
    with pytest.raises(Exception, match="not a Plan-and-Write story line"):
        parse_story("no separators here")


def test_synthetic_lengths_and_vocabulary():
    data = synthetic(3, lengths=(20, 160), vocab_size=30000)
    assert [len(d["tokens"]) - 2 for d in data] == [20] * 3 + [160] * 3
    assert all(5 <= t < 30000 for d in data for t in d["tokens"][1:-1])


def test_bleu_matches_nltk():
    from nltk.translate import bleu_score as nltk_bleu  # in requirements.txt: fail, never skip

    rng = random.Random(0)
    words = "a b c d e f g".split()
    corpora = [
        ([["the", "cat", "sat", "on", "the", "mat"]], [["the", "cat", "is", "on", "the", "mat"]])
    ]
    for n_sent in (3, 10):  # random corpora with much n-gram overlap, shorter and longer hypotheses
        refs = [[rng.choice(words) for _ in range(rng.randint(5, 12))] for _ in range(n_sent)]
        hyps = [
            r[: rng.randint(3, len(r))] + [rng.choice(words) for _ in range(rng.randint(0, 4))]
            for r in refs
        ]
        corpora.append((hyps, refs))
    for hyps, refs in corpora:
        for n in range(1, 5):
            expected = 100 * nltk_bleu.corpus_bleu([[r] for r in refs], hyps, weights=[1 / n] * n)
            assert bleu(hyps, refs, n) == pytest.approx(expected, abs=1e-9)
    assert bleu([["x", "y"]], [["a", "b"]], 2) == 0.0
    assert len(keyword_positions("a b c a".split(), ["a", "c", "b", "a"])) == 3  # (the inclusion)


def test_bleu_equals_sacrebleu_without_smoothing():
    """What bleu() equals on any corpus: sacrebleu's corpus BLEU with no tokenisation and no
    smoothing, hypotheses shorter than 4 tokens included (where nltk's corpus_bleu differs)."""
    import sacrebleu  # in requirements.txt: fail, never skip

    rng = random.Random(1)
    words = "a b c d e".split()
    for trial in range(30):
        refs = [[rng.choice(words) for _ in range(rng.randint(1, 9))] for _ in range(6)]
        hyps = [[rng.choice(words) for _ in range(rng.randint(1, 9))] for _ in range(6)]
        hyps[trial % 6] = hyps[trial % 6][:2]  # always one hypothesis shorter than 4 tokens
        for n in (1, 2, 4):
            ref = sacrebleu.metrics.BLEU(
                tokenize="none", smooth_method="none", max_ngram_order=n, effective_order=False
            )
            expected = ref.corpus_score(
                [" ".join(h) for h in hyps], [[" ".join(r) for r in refs]]
            ).score
            assert bleu(hyps, refs, n) == pytest.approx(expected, abs=1e-9), (trial, n)


@pytest.fixture(scope="module")
def rocstories():
    from data.stories import load_rocstories

    return load_rocstories(verbose=False)


def test_rocstories_splits(rocstories):
    """Here (dev and test only) nanogen trains on dev minus 500 held-out validation stories."""
    assert (
        len(rocstories["train"]) + len(rocstories["valid"]) == 9816
        and len(rocstories["test"]) == 9816
    )
    assert len(rocstories["valid"]) == 500 and "no train file" in rocstories["note"]
    assert all(len(s["keywords"]) == 5 for s in rocstories["test"])


def test_prepare_reports_rocstories(capsys, tmp_path, monkeypatch):
    """python -m data.prepare --dataset rocstories: its files found (or downloaded) and counted."""
    from common import UserError
    from data import prepare

    prepare.main(["--dataset", "rocstories"])
    assert "9316 / 500 / 9816 stories" in capsys.readouterr().out
    with pytest.raises(UserError, match="ROCStories dev is not in .*must hold rocstories/"):
        prepare.main(
            ["--dataset", "rocstories", "--data_dir", str(tmp_path)]
        )  # a local copy, not a download
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    monkeypatch.delenv("NANOGEN_DATA", raising=False)
    with pytest.raises(UserError, match="NANOGEN_OFFLINE is set"):
        prepare.main(["--dataset", "rocstories"])


TINY = [
    "--n_layer",
    "1",
    "--d_model",
    "32",
    "--n_head",
    "2",
    "--batch_size",
    "16",
    "--lr",
    "3e-3",
    "--warmup",
    "0",
    "--train_seqs",
    "128",
    "--eval_seqs",
    "16",
    "--max_iters",
    "8",
    "--eval_interval",
    "4",
    "--no_curves",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,task,order",
    [
        ("insnet", "storyline", "random"),
        ("insertion_transformer", "story", "l2r"),
        ("gpt", "storyline", "random"),
    ],
)
def test_train_and_evaluate_stories(model, task, order, tmp_path, monkeypatch, rocstories):
    out = tmp_path / "run"
    args = TINY + [
        "--model",
        model,
        "--dataset",
        "rocstories",
        "--task",
        task,
        "--out_dir",
        str(out),
    ]
    if order != "random":
        args += ["--order", order]
    train.main(args)
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in log] == [4, 8] and log[1]["val_loss"] < log[0]["val_loss"]
    ckpt = load_checkpoint(str(out / "ckpt_last.pt"))
    assert ckpt["config"]["model"] == model and ckpt["vocab"][:5] == [
        "<pad>",
        "<bos>",
        "<eos>",
        "<sep>",
        "<unk>",
    ]
    res, room = tmp_path / "res.json", []  # the story words each generation may write
    real_decode, real_generate = evaluate.decode, insnet.generate
    monkeypatch.setattr(
        evaluate,
        "decode",
        lambda m, x, L, *a, **kw: room.append(L) or real_decode(m, x, L, *a, **kw),
    )
    monkeypatch.setattr(
        evaluate,
        "generate",
        lambda m, given, n, *a, **kw: (
            room.append(n - (a[0].slot_start + 1) - 1) or real_generate(m, given, n, *a, **kw)
        ),
    )  # (canvas: prefix, story, EOS)
    evaluate.main(
        [
            "--ckpt",
            str(out / "ckpt_best.pt"),
            "--split",
            "test",
            "--limit",
            "3",
            "--decoder",
            "greedy",
            "--out",
            str(res),
        ]
    )
    assert room == [
        2 * len(s["story"]) + 10 for s in rocstories["test"][:3]
    ]  # the same for L2R and insertion
    r = json.load(open(res))
    assert (
        r["sequences"] == 3
        and r["nll_per_story"] > 0
        and set(r["generation"]["bleu"]) == {"1", "2", "3", "4"}
    )
    assert (r["nll_bound_per_story"] < r["nll_per_story"]) == (model != "gpt" and order == "random")
    if task == "storyline" and model == "insnet":
        assert r["generation"]["keyword_inclusion"] == 1.0  # by construction
    # resume continues where it stopped
    train.main(args + ["--max_iters", "10", "--resume"])
    assert load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "insertion_transformer"])
def test_story_generation_stays_within_the_window(model, tmp_path, capsys):
    """A model with a window (the L2R GPT, IT-vanilla's positions) that holds every story: its
    generated stories stop at the window (they were cut at twice the reference + 10 tokens, past
    it: an error); sample.py says which --L fits."""
    out, res = tmp_path / "run", tmp_path / "res.json"
    train.main(
        TINY
        + [
            "--model",
            model,
            "--dataset",
            "rocstories",
            "--block_size",
            "120",
            "--max_iters",
            "2",
            "--out_dir",
            str(out),
        ]
    )
    evaluate.main(
        [
            "--ckpt",
            str(out / "ckpt_best.pt"),
            "--split",
            "test",
            "--limit",
            "8",
            "--no_ppl",
            "--decoder",
            "greedy",
            "--out",
            str(res),
        ]
    )
    assert 0 < json.load(open(res))["generation"]["mean_length"] <= 120
    assert (
        run_cli(
            sample.main, ["--ckpt", str(out / "ckpt_best.pt"), "--title", "a day", "--L", "200"]
        )
        == 2
    )
    assert re.search(
        r"positions: a smaller --L|window of 120 tokens: use --L \d+ or less",
        capsys.readouterr().err,
    )
    assert (
        run_cli(
            sample.main, ["--ckpt", str(out / "ckpt_best.pt"), "--title", "a day " * 60, "--L", "1"]
        )
        == 2
    )  # no room left at all
    assert re.search(r"a smaller --L|use a shorter prompt", capsys.readouterr().err)
    keywords = (
        [] if model == "gpt" else [(["--title", "a day", "--keywords", "<sep>"], "control token")]
    )
    for flags, msg in [
        (["--title", "   "], "takes --title"),
        (["--title", "a <eos>"], "control token"),
        *keywords,
    ]:
        assert run_cli(sample.main, ["--ckpt", str(out / "ckpt_best.pt"), *flags]) == 2
        assert msg in capsys.readouterr().err
    if model == "gpt":  # trained on titles alone (--task story): no storyline to condition on
        assert (
            run_cli(
                sample.main,
                ["--ckpt", str(out / "ckpt_best.pt"), "--title", "a day", "--keywords", "team"],
            )
            == 2
        )
        assert "drop --keywords" in capsys.readouterr().err


@pytest.mark.slow
def test_synthetic_runs_all_three_models(tmp_path, capsys):
    for model in ("insnet", "insertion_transformer", "gpt"):
        out = tmp_path / model
        train.main(
            [
                "--model",
                model,
                "--dataset",
                "synthetic",
                "--synthetic_count",
                "2",
                "--n_layer",
                "1",
                "--d_model",
                "16",
                "--n_head",
                "2",
                "--batch_size",
                "7",
                "--max_iters",
                "2",
                "--out_dir",
                str(out),
                "--block_size",
                "200",
            ]
        )
        assert os.path.exists(out / "ckpt_last.pt")
        # trained from <bos> alone: sample.py generates from it, and refuses a title
        capsys.readouterr()
        sample.main(["--ckpt", str(out / "ckpt_last.pt"), "--L", "3"])
        shown = capsys.readouterr().out
        assert ">>> w" in shown if model == "gpt" else shown.startswith("  0  p(terminate)=")
        assert run_cli(sample.main, ["--ckpt", str(out / "ckpt_last.pt"), "--title", "w5"]) == 2
        assert "generates from <bos> alone" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "insnet", "--dataset", "wikitext2"], "trains on rocstories or synthetic"),
        (
            ["--model", "lstm", "--dataset", "rocstories"],
            "is for --model insnet, insertion_transformer or gpt",
        ),
        (
            ["--model", "insnet", "--dataset", "rocstories", "--head", "nmst"],
            "the story models have the softmax head",
        ),
        (
            ["--model", "insnet", "--dataset", "synthetic", "--task", "storyline"],
            "needs the storylines of",
        ),
        (
            ["--model", "insnet", "--dataset", "rocstories", "--task", "stream"],
            "--task stream is not for --dataset",
        ),
        (["--model", "gpt", "--dataset", "rocstories", "--init_from", "gpt2"], "on BPE data"),
        (["--model", "gpt", "--dataset", "rocstories", "--order", "l2r"], "--order is for insnet"),
        (["--model", "lstm", "--dataset", "wikitext2", "--order", "l2r"], "--order is for insnet"),
        (
            ["--model", "lstm", "--dataset", "wikitext2", "--task", "story"],
            "--task story is not for --dataset wikitext2",
        ),
        (
            ["--model", "insnet", "--dataset", "rocstories", "--max_tokens", "1000"],
            "stories: --batch_size",
        ),
        (
            ["--model", "insnet", "--dataset", "rocstories", "--block_size", "20"],
            "a story of 112 tokens exceeds --block_size 20",
        ),
        (
            ["--model", "gpt", "--dataset", "rocstories", "--block_size", "20"],
            "exceeds --block_size 20",
        ),
    ],
)
@pytest.mark.slow
def test_story_bad_input(args, pattern, tmp_path, capsys):
    assert run_cli(train.main, args + ["--out_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and pattern in err[0], err


@pytest.mark.slow
def test_evaluate_story_bad_decoder(tmp_path, capsys):
    out = tmp_path / "run"
    train.main(
        [
            "--model",
            "insnet",
            "--dataset",
            "synthetic",
            "--synthetic_count",
            "1",
            "--n_layer",
            "1",
            "--d_model",
            "16",
            "--n_head",
            "2",
            "--max_iters",
            "1",
            "--out_dir",
            str(out),
            "--block_size",
            "200",
        ]
    )
    assert (
        run_cli(
            evaluate.main,
            ["--ckpt", str(out / "ckpt_last.pt"), "--decoder", "beam", "--beam_size", "2"],
        )
        == 2
    )
    assert "choose from greedy, sample, topk" in capsys.readouterr().err
    assert run_cli(evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), "--decoder", "greedy"]) == 2
    assert "scored against ROCStories" in capsys.readouterr().err
