"""NMST eq. 3 under any batching, the authors' protocol (--protocol authors) on the real
WikiText-2, and the two perplexities of NMST Table 1."""

import argparse
import math

import numpy as np
import pytest
import torch

import common
import config
import train
from data.loader import epoch_batches, load_data, sequence_targets, targets_per_batch
from data.prepare import CONTEXT_LEN
from model import LanguageModel


def run_args(protocol="paper", **over):
    a = dict(config.DEFAULTS, model="lstm", task="completion", dataset="wikitext2", window=None)
    a.update(protocol=protocol, batch_size=32, max_tokens=None, train_seqs=0, **over)
    return argparse.Namespace(**a)


# The authors' prepared WikiText-2 takes a second and a half to read: its tests are slow ones.
slow_data = pytest.mark.slow


@pytest.fixture(scope="module")
def authors():
    args = run_args("authors")
    return args, load_data(args, verbose=False)


@slow_data
def test_the_authors_counts_on_wikitext2(authors):
    """The counts of the authors' src/wiki2 pipeline, worked out from their code (data.py: every
    line kept, <bos>, <cpad> to 10 words, "" as <unk>; train.py: the loss and its divisor;
    DataLoader(batch_size=32, shuffle=True); the validation metric from position 10 on)."""
    args, data = authors
    train_split, valid = data["train"], data["valid"]
    cpad = data["vocab"]["tokens"].index("<cpad>")
    assert len(train_split) == 36_718
    # the loss's terms: every target but padding (their loss sums the <cpad> targets too) ...
    assert int(sequence_targets(train_split.lengths, train_split.contexts, True).sum()) == 2_243_404
    # ... and their divisor, which leaves the <cpad> targets out
    n_cpad = int((np.asarray(train_split.tokens) == cpad).sum())
    assert 2_243_404 - n_cpad == 2_101_579
    assert len(epoch_batches(args, data, 0)) == 1_148
    # the validation metric: the continuation targets of every line, one eos for a short one
    assert len(valid) == 3_760
    assert int((valid.lengths - valid.contexts).sum()) == 195_390
    assert int((valid.lengths - valid.contexts == 1).sum()) == 1_983
    assert set(valid.contexts.tolist()) == {CONTEXT_LEN + 1}


@slow_data
def test_an_empty_and_a_short_line_as_the_authors_form_them(authors):
    """WikiText-2's first train line is empty: <bos> <cpad> x9 <unk> <eos>."""
    _, data = authors
    words = data["vocab"]["tokens"]
    first = [words[i] for i in data["train"][0]]
    assert first == ["<bos>", *["<cpad>"] * 9, "<unk>", "<eos>"]


@slow_data
def test_the_authors_batches_are_random_not_sorted(authors):
    args, data = authors
    keys = epoch_batches(args, data, 0)
    lengths = [float(np.mean(data["train"].lengths[k])) for k in keys]
    assert lengths != sorted(lengths)
    assert sorted(np.concatenate(keys).tolist()) == list(range(len(data["train"])))
    again = epoch_batches(args, data, 0)
    assert all((a == b).all() for a, b in zip(keys, again))


@slow_data
def test_the_authors_divisor_over_an_epoch(authors):
    """Each training batch carries the authors' count (no padding, no <cpad>): over the epoch they
    add up to 2,101,579, the corpus count; the first line (empty: <bos> <cpad> x9 <unk> <eos>)
    alone counts 2 of its 11 targets."""
    from data.loader import get_batch

    args, data = authors
    keys = epoch_batches(args, data, 0)
    counts = [get_batch(args, data, k, "cpu", training=True)["n_authors"] for k in keys]
    assert sum(counts) == 2_101_579
    first = get_batch(args, data, [0], "cpu", training=True)
    assert (first["n"], first["n_authors"]) == (11, 2)


@slow_data
def test_the_authors_loss_counts_the_context_targets_and_evaluation_does_not(authors):
    from data.loader import get_batch

    args, data = authors
    key = epoch_batches(args, data, 0)[0]
    train_batch = get_batch(args, data, key, "cpu", "train", training=True)
    # (the same lines, read as an evaluation of any split reads them)
    eval_batch = get_batch(args, dict(data, valid=data["train"]), key, "cpu", "valid")
    eval_train = get_batch(args, data, key, "cpu", "train")
    assert torch.equal(eval_train["mask"], eval_batch["mask"])
    lengths = data["train"].lengths[key]
    assert train_batch["n"] == int((lengths - 1).sum()) == int(train_batch["mask"].sum())
    continuation = lengths - data["train"].contexts[key]
    assert int(eval_batch["mask"].sum()) == int(continuation.sum())


def leaf_run(tmp_path, monkeypatch, protocol):
    """One epoch of train.py's loop on 3,000 WikiText-2 lines, with each batch's log p a leaf
    tensor: its gradient is the weight the loss gives every target token.  -> [(log p, batch)]
    of every step."""
    seen = []

    def leaf_forward(model, batch, state=None):
        log_p = torch.zeros(batch["targets"].shape, requires_grad=torch.is_grad_enabled())
        if torch.is_grad_enabled():
            seen.append((log_p, batch))
        return log_p, batch["mask"], None

    # (the step's one call of the model)
    monkeypatch.setattr(LanguageModel, "forward", leaf_forward)
    out = tmp_path / protocol
    flags = "--model lstm --dataset wikitext2 --n_layer 1 --d_model 8 --batch_size 32"
    flags += " --train_seqs 3000 --max_epochs 1 --eval_seqs 8 --probe 0 --no_curves"
    train.main(flags.split() + ["--protocol", protocol, "--out_dir", str(out)])
    return seen


def gradient_shares(tmp_path, monkeypatch, protocol):
    """-> the total weight and token count of the eos targets, of the targets of the shortest
    lines, of all targets over leaf_run's epoch; the steps."""
    seen = leaf_run(tmp_path, monkeypatch, protocol)
    weight, count = np.zeros(3), np.zeros(3)
    for log_p, batch in seen:
        mask, grad = batch["mask"], -log_p.grad
        targets = batch["targets"]
        shortest = (batch["lengths"] - 1 <= CONTEXT_LEN + 3).unsqueeze(1)
        for i, cls in enumerate((targets == 0, shortest.expand_as(mask), torch.ones_like(mask))):
            weight[i] += float(grad[mask & cls].sum())
            count[i] += int((mask & cls).sum())
    return weight, count, len(seen)


@pytest.mark.slow
def test_every_target_token_weighs_alike_over_an_epoch(tmp_path, monkeypatch):
    """NMST eq. 3 is the mean over all targets: over an epoch of length-sorted batches the eos
    targets' and the shortest lines' share of the gradient is their share of the tokens.
    Dividing each batch by its own count instead would give the eos targets several times their
    share (checked on these batches)."""
    weight, count, steps = gradient_shares(tmp_path, monkeypatch, "paper")
    assert weight[:2] / weight[2] == pytest.approx(count[:2] / count[2], rel=1e-6)
    # (each step's weights add up to its count over the epoch's mean count: 1 a step on average)
    assert weight[2] == pytest.approx(steps, rel=1e-6)
    assert count[0] / count[2] < 0.02  # (eos: one target a line of > 10 words)


@pytest.mark.slow
def test_the_authors_loss_divides_each_batch_by_its_own_count(tmp_path, monkeypatch, authors):
    """--protocol authors, their train.py:61-62, 69: every target of a batch, <cpad> ones too,
    weighs 1 / (the batch's targets that are neither padding nor <cpad>)."""
    _, data = authors
    cpad = data["vocab"]["tokens"].index("<cpad>")
    seen, with_cpad = leaf_run(tmp_path, monkeypatch, "authors"), 0
    assert len(seen) == 94
    for log_p, batch in seen:
        mask, targets = batch["mask"], batch["targets"]
        own = int((mask & (targets != cpad)).sum())
        assert batch["n_authors"] == own
        torch.testing.assert_close(-log_p.grad, mask / own, rtol=1e-6, atol=0)
        with_cpad += own < int(mask.sum())
    # (most random batches hold a line of fewer than 10 words)
    assert with_cpad > 50


@pytest.mark.slow
def test_a_per_batch_mean_would_overweigh_the_eos_targets(wikitext2):
    """The skew the fixed divisor removes is real on these batches: a per-batch mean gives the
    eos targets of WikiText-2's sorted batches over 3x their token share (so the test above can
    fail)."""
    args = run_args("paper")
    _, splits = wikitext2
    split = splits["train"]
    per_seq = sequence_targets(split.lengths, split.contexts)
    keys = epoch_batches(args, dict(train=split), 0)
    eos_weight = sum(len(k) / per_seq[k].sum() for k in keys) / len(keys)
    eos_share = len(split) / per_seq.sum()
    assert eos_weight / eos_share > 3


def test_targets_per_batch_is_the_epochs_mean(wikitext2):
    args = run_args("paper")
    _, splits = wikitext2
    split = splits["train"]
    data = dict(train=split)
    keys = epoch_batches(args, data, 0)
    per_seq = sequence_targets(split.lengths, split.contexts)
    assert targets_per_batch(args, data) == pytest.approx(per_seq.sum() / len(keys))


@pytest.mark.slow
def test_evaluate_reports_both_perplexities(tmp_path, capsys):
    """An authors'-protocol run: its own perplexity is the authors' metric (every line); nanogen's
    leaves out the lines whose continuation is eos alone, over fewer tokens."""
    import evaluate

    out = tmp_path / "run"
    flags = "--model rnn --head nmst --dataset wikitext2 --protocol authors --n_layer 1"
    flags += " --d_model 16 --max_iters 2 --train_seqs 200 --eval_seqs 300 --probe 0 --no_curves"
    train.main(flags.split() + ["--out_dir", str(out)])
    evaluate.main(["--ckpt", str(out / "ckpt_last.pt"), "--limit", "300", "--out", str(out / "r")])
    text = capsys.readouterr().out
    assert "nanogen's metric" in text and "the authors' metric" in text
    import json

    res = json.loads((out / "r").read_text())
    assert res["ppl_authors"] == res["ppl"]
    assert res["tokens_nanogen"] < res["tokens_authors"] == res["tokens"]
    assert math.isfinite(res["ppl_nanogen"]) and res["ppl_nanogen"] != res["ppl_authors"]


def test_the_authors_model_and_optimizer(tmp_path):
    """--protocol authors: N(0, 1) embeddings, no dropout between the LSTM layers, AdamW betas
    (0.9, 0.999) with weight decay on every parameter (biases too)."""
    argv = "--model lstm --dataset wikitext2 --protocol authors --d_model 64".split()
    args, _ = config.get_args(
        argv + ["--out_dir", str(tmp_path / "a")], train.RECIPES, train.AUTHORS
    )
    assert (args.beta2, args.batch_size, args.lr, args.max_epochs) == (0.999, 32, 1e-3, 70)
    data = dict(vocab_size=5000, eos_id=0, vocab=None)
    from model import LanguageModel

    lm = LanguageModel(config.model_config(args, data))
    assert lm.backbone.rnn.dropout == 0.0 and lm.backbone.drop.p == 0.5
    assert 0.9 < float(lm.backbone.wte.weight.detach().std()) < 1.1
    paper = LanguageModel(
        config.model_config(argparse.Namespace(**dict(vars(args), protocol="paper")), data)
    )
    assert (
        paper.backbone.rnn.dropout == 0.5
        and float(paper.backbone.wte.weight.detach().abs().max()) <= 0.1
    )


@pytest.mark.slow  # (a training run, end to end)
def test_whole_epochs_stops_a_capped_run_at_an_epochs_end(tmp_path):
    """--max_minutes past its time: after the step that passes it, or with --whole_epochs at the
    end of that epoch (3 batches of 32 here), so no evaluation falls mid-epoch."""
    flags = "--model rnn --dataset wikitext2 --n_layer 1 --d_model 8 --batch_size 32"
    flags += " --train_seqs 96 --eval_seqs 8 --probe 0 --no_curves --max_minutes 1e-9"
    train.main(flags.split() + ["--out_dir", str(tmp_path / "any")])
    train.main(flags.split() + ["--whole_epochs", "--out_dir", str(tmp_path / "whole")])
    steps = [
        common.load_checkpoint(str(tmp_path / name / "ckpt_last.pt"))["state"]["step"]
        for name in ("any", "whole")
    ]
    assert steps == [1, 3]


def test_theorem_3s_cells_and_welchs_calls():
    import reproduce
    from heads import t_half

    assert t_half(1e-3) == 693 and t_half(1e-5) == 69_315
    cfg = dict(eps=1e-3)
    assert reproduce.forced(cfg, "nmst", "greedy", 1000) and reproduce.forced(
        cfg, "st", "topk-2", 693
    )
    assert not reproduce.forced(cfg, "nmst", "greedy", 692)
    assert not reproduce.forced(cfg, "softmax", "greedy", 1000)
    assert not reproduce.forced(cfg, "st", "beam-2", 1000)
    # ddof 1: [1, 3] has sample std sqrt(2); means 2 and 5 lie 3 apart: Welch's t = 2.12 with
    # 2 degrees of freedom, p = 0.17 two-sided (beyond 2 SE, but not at 5 %), 0.084 one-sided
    assert reproduce.mean_std([1.0, 3.0]) == "2.0 ± 1.4"
    assert 0.167 < reproduce.welch([1.0, 3.0], [4.0, 6.0]) < 0.168
    assert 0.083 < reproduce.welch([1.0, 3.0], [4.0, 6.0], "less") < 0.084
    assert reproduce.welch([1.0, 1.5], [9.0, 9.5]) < 0.05
    assert math.isnan(reproduce.welch([1.0], [9.0]))


def test_table_4_says_first_when_no_cell_differs_from_va():
    """NMST Table 4 at a scale where nothing loops: its first lines say that the paper's finding is
    not shown; one ST+ cell apart from VA+ at 5 % (Welch) removes that line."""
    import argparse

    import reproduce

    cfg = reproduce.nmst_settings("cpu", 4)
    args = argparse.Namespace(scale="cpu", heads=["softmax", "st", "nmst"])

    def runs(st_nucleus):
        out = {}
        for head in args.heads:
            seeds = []
            for seed in range(3):
                ratio = {d: 0.0 for d in cfg["decoders"]}
                if head == "st":
                    ratio["nucleus-0.2"] = st_nucleus[seed]
                seeds.append({d: {"decoding": {"r_nt": {"1000": ratio[d]}}} for d in ratio})
            out["gpt", head] = seeds
        return out

    quiet = reproduce.report_table4(cfg, runs([0.0, 0.01, 0.0]), args)
    assert any("is NOT shown here" in line for line in quiet[:5])
    loud = reproduce.report_table4(cfg, runs([0.7, 0.75, 0.8]), args)
    assert not any("NOT shown" in line for line in loud)
    assert any("nucleus-0.2: VA+ 0.000 vs ST+ 0.750: p = 0.0015: apart at 5 %" in ln for ln in loud)


def test_table_1_says_first_where_the_termination_finding_shows():
    """Table 1's first lines: the (model, head) where VA+'s greedy r_nt lies above at 5 % (Welch,
    one-sided: the paper's finding), and where not (not resolved, or the other way round)."""
    import argparse

    import reproduce

    cfg = reproduce.nmst_settings("cpu", 1)
    args = argparse.Namespace(scale="cpu", heads=["softmax", "st", "nmst"])
    greedy = {
        ("rnn", "softmax"): [0.0, 0.0, 0.0],
        ("rnn", "st"): [0.0, 0.0, 0.0],
        ("rnn", "nmst"): [0.3, 0.4, 0.5],
        ("lstm", "softmax"): [0.2, 0.1, 0.25],
        ("lstm", "st"): [0.0, 0.0, 0.0],
        ("lstm", "nmst"): [0.0, 0.5, 0.2],
    }
    runs = {
        key: [{"greedy": {"decoding": {"r_nt": {"1000": x}}}} for x in seeds]
        for key, seeds in greedy.items()
    }
    line, rnn, lstm = reproduce.termination_shown(cfg, runs, args)
    assert "r_nt(1000)" in line
    assert "shown for LSTM ST+; NOT shown for RNN ST+, RNN NMST+, LSTM NMST+" in line
    assert "LSTM, greedy r_nt(1000): VA+ 0.183 vs ST+ 0.000: p = 0.027 (VA+ above): apart" in lstm
    assert "VA+ 0.183 vs NMST+ 0.233: p = 0.62 (VA+ above): not resolved." in lstm


def test_fig_2_decodes_greedy_to_1e5_at_paper_scale():
    """Fig. 2 needs L well past t_1/2 (69,315 at eps = 1e-5): Table 1's paper scale decodes greedy
    to 1e5 in one decode (every smaller L of the curve from it), the other decoders to 1000."""
    import reproduce

    paper = reproduce.nmst_settings("paper", 1)
    greedy = reproduce.study_flags(paper, "greedy")
    assert greedy[greedy.index("--L") + 1 :] == [
        "1",
        "3",
        "10",
        "30",
        "100",
        "300",
        "1000",
        "3000",
        "10000",
        "30000",
        "100000",
    ]
    nucleus = reproduce.study_flags(paper, "nucleus-0.2")
    assert nucleus[-1] == "1000" and "--p" in nucleus
    cpu = reproduce.nmst_settings("cpu", 1)
    assert reproduce.study_flags(cpu, "greedy")[-1] == "1000"


def test_the_insnet_table_says_when_its_models_loop():
    """InsNet Table 3's first lines: with most stories looping, the paper's comparison is said not
    to show; with trained generators (few loops) the BLEU call stands alone."""
    import reproduce

    bleu4 = {"insnet": [1.9, 2.0, 1.8], "gpt": [0.4, 0.5, 0.4]}
    looping = {"insnet": [99.0, 100.0, 100.0], "gpt": [100.0, 100.0, 100.0]}
    lines = reproduce.insnet_findings(looping, bleu4)
    assert "BLEU-4: InsNet 1.90 vs L2R 0.43: p = 6.7e-05 (InsNet above): apart at 5 %" in lines[1]
    assert "NOT shown at this scale" in lines[-1]
    trained = {"insnet": [3.0, 5.0, 4.0], "gpt": [10.0, 12.0, 8.0]}
    assert not any("NOT shown" in line for line in reproduce.insnet_findings(trained, bleu4))


@pytest.mark.slow
def test_table_1s_rnn_row_on_one_gpu_at_a_tiny_size(tmp_path, monkeypatch, capsys):
    """`reproduce.py nmst-table1 --scale paper --models rnn --seeds 1 --budget_minutes 6.5
    --jobs 3` (Table 1's row on one GPU), its models and decoding shrunk to run on a CPU: the RNN
    row's three heads trained at once under the authors' protocol (eps 1e-5, seed 0), each
    capped at the budget (one wave) and stopping at an epoch's end, the expected time said first,
    both perplexities in the table with the paper's RNN row beside."""
    import json

    import reproduce

    real = reproduce.nmst_settings

    def small(scale, table):
        cfg = real(scale, table)
        # (a few short batches: the authors' batches pad to their longest line, V = 33,280)
        tiny = "--d_model 16 --n_layer 1 --train_seqs 64 --batch_size 16 --max_epochs 2".split()
        tiny += ["--eval_seqs", "16"]
        if scale == "paper":
            models = {m: flags + tiny for m, flags in cfg["models"].items()}
            cfg.update(contexts=8, L=40, fig2_L=40, decoders=["greedy"], models=models)
        return cfg

    monkeypatch.setattr(reproduce, "nmst_settings", small)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "row"
    argv = ["nmst-table1", "--scale", "paper", "--models", "rnn", "--seeds", "1"]
    argv += ["--budget_minutes", "6.5", "--jobs", "3", "--out", str(out)]
    assert reproduce.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("training 3 runs, 3 at a time: 6.5 min of training")
    assert "(each run stops at the first epoch's end past 6.5 min)" in printed.splitlines()[0]
    for head in ("softmax", "st", "nmst"):
        a = json.load(open(out / "runs" / f"rnn-{head}-s0" / "args.json"))
        assert (a["protocol"], a["whole_epochs"], a["seed"], a["max_minutes"]) == (
            "authors",
            True,
            0,
            6.5,
        )
        assert a["epsilon"] == 1e-5 and a["max_epochs"] == 2
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| VA+", "| ST+", "| NMST+"))]
    # (the first three: Table 1's, both metrics; the paper's RNN row beside each)
    assert all(" / " in r and "/ - (" not in r for r in rows[:3])
    assert ["(178.6" in rows[0], "(180.4" in rows[1], "(177.4" in rows[2]] == [True] * 3
    assert "n = 1 seed(s)" in table and "t_1/2 = 69,315" in table
    assert "| LSTM" not in table


def test_the_decode_batch_is_sized_to_the_device(monkeypatch):
    """evaluate.py --decode_batch's default: 64 on a CPU; on a GPU what fits a quarter of the free
    memory (16 GiB free here): an RNN's rows are few bytes (capped at 4096), a GPT-2's key / value
    cache to L = 1000 takes 76 MB a row, a beam's row as many times more."""
    import types

    import evaluate

    rnn = types.SimpleNamespace(cfg=dict(model="rnn", vocab_size=33_280, n_layer=2, d_model=256))
    gpt = types.SimpleNamespace(
        cfg=dict(model="gpt", vocab_size=50_257, n_layer=12, d_model=768, block_size=1024)
    )
    assert evaluate.decode_batch_size(rnn, 1000, 1, "cpu") == 64
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 * 2**30, 80 * 2**30))
    assert evaluate.decode_batch_size(rnn, 100_000, 1, "cuda:0") == 4096
    assert evaluate.decode_batch_size(gpt, 1000, 1, "cuda:0") == 4 * 2**30 // 76_301_584
    assert evaluate.decode_batch_size(gpt, 1000, 4, "cuda:0") == 4 * 2**30 // (4 * 76_301_584)
