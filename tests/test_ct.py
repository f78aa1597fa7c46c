"""Contextual temperature paper: MoS (eq. 4), CT (eq. 5-6), CT-MoS (eq. 7), LS (eq. 8), and the
continuous-LM (stream) mode with truncated BPTT."""

import json
import os

import numpy as np
import pytest
import torch

import common
import evaluate
import train
from conftest import assert_one_line_error, run_in_process, target_log_p
from data.loader import batchify, bptt_windows
from heads import (
    Head,
    contextual_temperature,
    ct_log_probs,
    loss_scale,
    mos_log_probs,
    softmax_log_probs,
)
from model import LanguageModel

torch.manual_seed(0)


def test_mos_one_expert_is_softmax():
    z = torch.randn(3, 5, 1, 40, dtype=torch.float64) * 10
    torch.testing.assert_close(
        mos_log_probs(torch.randn(3, 5, 1, dtype=torch.float64), z), softmax_log_probs(z[..., 0, :])
    )
    head = Head("mos", 16, 40, 0, n_experts=1).double()
    h = torch.randn(2, 7, 16, dtype=torch.float64)
    ref = softmax_log_probs(
        head.proj(torch.tanh(head.latent(h)))[..., :40]
    )  # (U's rows past V: padding)
    torch.testing.assert_close(head(h)[0], ref)


def test_mos_is_the_probability_mixture():
    prior, z = (
        torch.randn(4, 3, dtype=torch.float64),
        torch.randn(4, 3, 11, dtype=torch.float64) * 5,
    )
    direct = (torch.softmax(prior, -1).unsqueeze(-1) * torch.softmax(z, -1)).sum(
        -2
    )  # eq. 4 as written
    torch.testing.assert_close(mos_log_probs(prior, z).exp(), direct)


def test_ct_with_unit_temperature_is_softmax():
    z = torch.randn(2, 6, 30, dtype=torch.float64) * 20
    torch.testing.assert_close(ct_log_probs(z, torch.ones_like(z)), softmax_log_probs(z))
    V = 30
    head = Head(
        "ct", 8, V, 0, ct_alpha=1 - 1 / V, ct_beta=1.0
    ).double()  # tau = (1/V + alpha)/beta = 1
    with torch.no_grad():
        head.tau.weight.zero_()
        head.tau.bias.zero_()
    h = torch.randn(2, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(head.temperatures(h), torch.ones(2, 6, V, dtype=torch.float64))
    torch.testing.assert_close(head(h)[0], softmax_log_probs(head.proj(h)[..., :V]))


@pytest.mark.parametrize("kind", ["mos", "ct", "ctmos"])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_rows_normalised_tau_range_and_gradients(kind, scale):
    head = Head(
        kind, 12, 50, 0, n_experts=3, ct_alpha=1.0, ct_beta=0.5, ct_rank=4 if kind == "ctmos" else 0
    )
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(scale)
    h = (torch.randn(3, 9, 12) * scale).requires_grad_()
    lp, _ = head(h)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(torch.logsumexp(lp, -1), torch.zeros(3, 9), atol=1e-5, rtol=0)
    lp.gather(-1, torch.randint(0, 50, (3, 9, 1))).sum().backward()
    assert torch.isfinite(h.grad).all() and all(
        torch.isfinite(p.grad).all() for p in head.parameters()
    )
    if kind != "mos":
        tau = head.temperatures(h.detach())
        a, b = head.ct_alpha, head.ct_beta
        assert (tau >= a / b - 1e-6).all() and (tau <= (1 + a) / b + 1e-6).all()


def test_mean_tau_identity_makes_loss_scaling_a_constant():
    for V, a, b in [(10, 1.0, 0.5), (10_000, 0.0, 1.0), (33, 2.0, 3.0)]:
        tau = contextual_temperature(torch.randn(4, 7, V, dtype=torch.float64) * 30, a, b)
        torch.testing.assert_close(
            tau.mean(-1), torch.full((4, 7), loss_scale(V, a, b), dtype=torch.float64)
        )


def test_constant_temperature_baseline():
    head = Head("mos", 8, 20, 0, n_experts=2, temperature=4.0).double()
    h = torch.randn(2, 3, 8, dtype=torch.float64)
    ref = mos_log_probs(head.prior(h), head._expert_logits(h) / 4.0)
    torch.testing.assert_close(head(h)[0], ref)
    with pytest.raises(ValueError, match="constant --temperature"):
        Head("ct", 8, 20, 0, temperature=2.0)


def test_batchify_and_bptt_cover_every_token_once():
    stream = np.arange(1003)
    data = batchify(stream, 4)
    assert data.shape == (4, 250) and (data.flatten() == torch.arange(1000)).all()
    seen = []
    for i, L in bptt_windows(data.size(1), 7):
        x, y = data[:, i : i + L], data[:, i + 1 : i + 1 + L]
        assert (y == x + 1).all()
        seen.append(y)
    targets = torch.cat(seen, 1)
    assert targets.shape == (4, 249)  # every column but the first is a target exactly once
    assert sorted(targets.flatten().tolist()) == sorted(set(range(1000)) - {0, 250, 500, 750})


def test_hidden_state_detached_between_windows():
    cfg = dict(
        model="lstm",
        head="ctmos",
        epsilon=1e-5,
        ct_alpha=1.0,
        ct_beta=0.5,
        vocab_size=30,
        eos_id=0,
        n_layer=2,
        d_model=8,
        dropout=0.0,
        tie=True,
        n_experts=2,
        ct_rank=0,
    )
    lm = LanguageModel(cfg)
    data = torch.randint(0, 30, (3, 21))
    lp1, state = target_log_p(lm, data[:, :10], None, data[:, 1:11])
    lp1.sum().backward()
    detached = common.state_to(state, "cpu", detach=True)
    lp2, _ = target_log_p(lm, data[:, 10:20], None, data[:, 11:21], detached)
    lp2.sum().backward()  # fine: no path into the first window's (freed) graph
    assert all(s.grad_fn is None for s in common.state_to(state, "cpu", detach=True))
    lp3, _ = target_log_p(lm, data[:, 10:20], None, data[:, 11:21], state)
    with pytest.raises(RuntimeError):
        lp3.sum().backward()  # without detaching, backward runs into the first window
    # evaluation carries the state across all windows, without autograd (else one graph grows
    # over the whole split)
    grad, read = [], lm.forward

    def forward(*a, **k):
        grad.append(torch.is_grad_enabled())
        return read(*a, **k)

    lm.forward = forward
    args = train.argparse.Namespace(model="lstm", task="stream", bptt=5, eval_seqs=0)
    stream = torch.randint(0, 30, (200,))  # 10 columns of 20 tokens: 19 targets each, in 4 windows
    assert (
        evaluate.perplexity(args, lm, dict(streams=dict(valid=stream)))["tokens"] == 10 * 19
        and grad == [False] * 4
    )


@pytest.mark.slow
@pytest.mark.parametrize("head", ["mos", "ct", "ctmos"])
def test_stream_training_on_real_ptb(head, tmp_path, capsys):
    out = tmp_path / head
    args = [
        "--model",
        "lstm",
        "--head",
        head,
        "--task",
        "stream",
        "--dataset",
        "ptb",
        "--d_model",
        "32",
        "--batch_size",
        "8",
        "--bptt",
        "20",
        "--max_iters",
        "30",
        "--eval_interval",
        "15",
        "--eval_seqs",
        "300",
        "--lr",
        "5e-3",
        "--n_experts",
        "2",
        "--ct_rank",
        "8",
        "--no_curves",
        "--out_dir",
        str(out),
    ]
    if head != "mos":
        args += ["--loss_scaling"]
    train.main(args + ["--ar", "1", "--tar", "1", "--locked_dropout"])
    log = [json.loads(x) for x in open(out / "log.jsonl")]
    assert log[1]["val_loss"] < log[0]["val_loss"] and log[1]["train_loss"] < log[0]["train_loss"]
    res = tmp_path / "res.json"
    evaluate.main(
        ["--ckpt", str(out / "ckpt_best.pt"), "--out", str(res)]
        + ([] if head == "ct" else ["--limit", "500"])
    )
    r = json.loads(res.read_text())  # the batchified valid targets (all, or 500 a column)
    assert r["task"] == "stream" and r["tokens"] == (
        73_760 // 10 * 10 - 10 if head == "ct" else 5000
    )
    assert os.path.exists(out / "ckpt_last.pt")
    capsys.readouterr()
    for flags, msg in (
        (
            ["--decoder", "greedy"],
            "--decoder continues completion contexts, not a --task stream run",
        ),
        (["--tau_report"], "a ct / ctmos head"),
    ):
        if head == "mos" or "--decoder" in flags:
            rc, err = run_in_process(
                evaluate.main, ["--ckpt", str(out / "ckpt_best.pt"), *flags], capsys
            )
            assert rc == 2 and msg in err
    if head != "mos":
        rep_path = tmp_path / "tau.json"
        evaluate.main(
            [
                "--ckpt",
                str(out / "ckpt_best.pt"),
                "--no_ppl",
                "--tau_report",
                "--out",
                str(rep_path),
                "--plot",
                str(tmp_path / "figs"),
            ]
        )
        assert (tmp_path / "figs" / "tau_by_position.png").stat().st_size > 10_000
        rep = json.loads(rep_path.read_text())["tau_report"]
        assert rep["sentences"] > 500 and len(rep["position_mean"]) == 15
        assert all(
            2.0 <= m <= 4.0 for m in rep["position_mean"]
        )  # (alpha/beta, (1+alpha)/beta) = (2, 4)
        assert rep["highest"][0][1] >= rep["lowest"][0][1]
        evaluate.main(
            [
                "--ckpt",
                str(out / "ckpt_best.pt"),
                "--no_ppl",
                "--tau_report",
                "--limit",
                "400",
                "--out",
                str(rep_path),
            ]
        )  # --limit: the first 400 tokens of each column
        assert (
            0 < json.loads(rep_path.read_text())["tau_report"]["sentences"] < rep["sentences"] / 10
        )
        capsys.readouterr()  # 15 words a column hold no 16-24-word sentence
        rc, err = run_in_process(
            evaluate.main,
            ["--ckpt", str(out / "ckpt_best.pt"), "--no_ppl", "--tau_report", "--limit", "15"],
            capsys,
        )
        assert rc == 2 and "no sentence of 16-24 words" in err


@pytest.mark.slow
def test_the_temperature_report_is_word_level(tmp_path, capsys):
    """CT paper Fig. 1 / Tables 5-6 count words: a char-level checkpoint is refused (it printed
    16-24 characters as '16-24 words')."""
    out = tmp_path / "char"
    train.main(
        [
            "--model",
            "lstm",
            "--head",
            "ct",
            "--task",
            "stream",
            "--dataset",
            "ptb",
            "--vocab",
            "char",
            "--d_model",
            "8",
            "--max_iters",
            "1",
            "--bptt",
            "10",
            "--out_dir",
            str(out),
        ]
    )
    capsys.readouterr()
    rc, err = run_in_process(
        evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), "--tau_report"], capsys
    )
    assert_one_line_error(rc, err, "word-level analysis")


@pytest.mark.parametrize(
    "args,msg",
    [
        (
            ["--task", "stream", "--head", "nmst", "--model", "lstm"],
            "use it with --task completion",
        ),
        (["--task", "stream", "--model", "gpt"], "--task stream is for --model rnn or lstm"),
        (
            ["--head", "softmax", "--loss_scaling", "--model", "lstm"],
            "--loss_scaling needs --head ct or ctmos",
        ),
        (["--head", "ct", "--temperature", "2", "--model", "lstm"], "constant --temperature"),
    ],
)
def test_bad_flag_combinations(args, msg, tmp_path, capsys):
    rc, err = run_in_process(
        train.main,
        [*args, "--dataset", "ptb", "--out_dir", str(tmp_path / "o"), "--max_iters", "1"],
        capsys,
    )
    assert_one_line_error(rc, err, msg)


def test_activation_regularisation_and_locked_dropout():
    """AR / TAR against their direct formulas; locked dropout uses one mask over time."""
    cfg = dict(
        model="lstm",
        head="softmax",
        epsilon=1e-5,
        vocab_size=30,
        eos_id=0,
        n_layer=2,
        d_model=16,
        dropout=0.5,
        tie=True,
        locked_dropout=True,
    )
    lm = LanguageModel(cfg).train()
    lm.log_probs(torch.randint(0, 30, (3, 9)), None)
    raw, dropped = lm.backbone.last_output
    ar = (dropped**2).mean()
    tar = sum(((raw[:, t] - raw[:, t - 1]) ** 2).sum() for t in range(1, 9)) / (3 * 8 * 16)
    torch.testing.assert_close(lm.backbone.activation_regularisation(2.0, 0.0), 2.0 * ar)
    torch.testing.assert_close(lm.backbone.activation_regularisation(0.0, 3.0), 3.0 * tar)
    x = torch.ones(2, 7, 16)
    zeros = lm.backbone._dropout(x) == 0  # (2, 7, 16)
    assert zeros.any() and (zeros == zeros[:, :1]).all()  # the same units dropped at every step
    assert (
        not (lm.backbone.drop(x) == 0).eq((lm.backbone.drop(x) == 0)[:, :1]).all()
    )  # plain dropout varies


def test_tau_by_position_takes_the_16_to_24_word_sentences():
    column = [
        0,
        *range(1, 21),
        0,
        7,
        8,
        0,
        *range(1, 10),
    ]  # a cut one, 20 words, 2 words, a cut one
    assert evaluate.sentences(column, eos_id=0) == [
        (1, 21)
    ]  # the 20 next words after the first eos
    assert evaluate.sentences(column[20:], eos_id=0) == []
