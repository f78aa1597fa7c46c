"""decode.py: cached == uncached, greedy == argmax, eq. 13 / 15 candidate sets, sampling
frequencies, beam == exact MAP, Theorem 3 (NMST terminates), VA's inconsistency, r_nt."""

import heapq

import pytest
import torch
import torch.nn as nn

from common import UserError
from conftest import RecomputeStepper, steps
from decode import (
    decode,
    decode_in_batches,
    decode_stats,
    eos_probs,
    filter_log_probs,
    non_termination_ratio,
    nucleus_mask,
    topk_mask,
)
from heads import nmst_log_probs, softmax_log_probs
from model import MODELS, LanguageModel

EOS = 2
D = 16  # the toy models' width


def toy(model, head, V=30, eps=0.05, eos_bias=-4.0, seed=0):
    """A random model with an output bias, so p(eos) can be set (random init puts eos on top).
    eos_bias < 0 makes eos unlikely; for ST the eos logit is the *keep* weight sigma(z) of eq. 9,
    so the sign is flipped there."""
    cfg = dict(
        model=model,
        head=head,
        epsilon=eps,
        vocab_size=V,
        eos_id=EOS,
        n_layer=2,
        d_model=D,
        dropout=0.0,
        tie=False,
        n_head=2,
        block_size=320,
        bias=True,
        kernel_size=3,
    )
    torch.manual_seed(seed)
    lm = LanguageModel(cfg).double().eval()
    lm.head.proj = nn.Linear(D, V, bias=True).double()
    with torch.no_grad():
        lm.head.proj.weight.mul_(6.0)
        lm.head.proj.bias.zero_()
        lm.head.proj.bias[EOS] = -eos_bias if head == "st" else eos_bias
    return lm


def unigram(logits, head="softmax", eps=0.05):
    """A model whose next-token logits are `logits` whatever the prefix."""
    lm = toy("lstm", head, V=len(logits), eps=eps)
    with torch.no_grad():
        lm.head.proj.weight.zero_()
        lm.head.proj.bias.copy_(torch.as_tensor(logits, dtype=torch.float64))
    return lm


PROMPTS = [torch.tensor(x) for x in ([5, 6, 7], [9] * 10, [3, 4, 5, 6, 7, 8, 9], [12, 13])]


@pytest.mark.parametrize("model", [m for m in MODELS if m != "rnn"])  # (rnn: lstm's code)
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
@pytest.mark.parametrize(
    "decoder,kw", [("greedy", {}), ("beam", dict(beam_size=3)), ("beam", dict(beam_size=1))]
)
def test_cached_equals_uncached(model, head, decoder, kw, monkeypatch):
    import decode as decode_module

    lm = toy(model, head, eps=0.002, eos_bias=-8.0)
    a = decode(lm, PROMPTS, 40, decoder, **kw)
    monkeypatch.setattr(decode_module, "CachedStepper", RecomputeStepper)  # re-encode every prefix
    b = decode(lm, PROMPTS, 40, decoder, **kw)
    assert a["tokens"] == b["tokens"]
    assert torch.equal(a["terminated"], b["terminated"])
    torch.testing.assert_close(a["scores"], b["scores"])
    assert max(a["lengths"].tolist()) > 3  # not a trivial immediate eos


def test_greedy_is_argmax_of_full_forward():
    lm = toy("gpt", "nmst", eps=0.01, eos_bias=-2.0)
    out = decode(lm, PROMPTS, 25, "greedy")
    for x, y in zip(PROMPTS, out["tokens"]):
        seq = torch.cat([x, torch.tensor(y)])
        lp, _ = lm.log_probs(seq.unsqueeze(0), steps(2 - len(x), (1, len(seq))))
        pred = lp[0, len(x) - 1 : len(seq) - 1].argmax(-1)
        assert pred.tolist() == y


def test_beam_size_one_is_greedy():
    lm = toy("lstm", "st", eps=0.01, eos_bias=-2.0)
    assert (
        decode(lm, PROMPTS, 30, "greedy")["tokens"]
        == decode(lm, PROMPTS, 30, "beam", beam_size=1)["tokens"]
    )


def test_topk_candidate_set_eq13():
    lp = torch.log_softmax(
        torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]]), -1
    )
    m = topk_mask(lp, 2)
    assert m[0].tolist() == [False, True, False, True, False]
    assert m.sum(1).tolist() == [2, 2]  # ties: still exactly k
    for k in (1, 3, 5, 9):
        mk = topk_mask(lp, k)
        assert mk.sum(1).tolist() == [min(k, 5)] * 2
        # eq. 6: min over V_t >= max over the rest
        for row, mask in zip(lp, mk):
            if (~mask).any():
                assert row[mask].min() >= row[~mask].max()


def test_nucleus_candidate_set_eq15():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    lp = p.log()
    assert nucleus_mask(lp, 0.5)[0].tolist() == [True, False, False, False]
    assert nucleus_mask(lp, 0.6)[0].tolist() == [True, True, False, False]
    assert nucleus_mask(lp, 0.8)[0].tolist() == [True, True, False, False]
    assert nucleus_mask(lp, 0.81)[0].tolist() == [True, True, True, False]
    assert nucleus_mask(lp, 1.0)[0].tolist() == [True, True, True, True]
    assert nucleus_mask(lp, 1e-6).sum(1).tolist() == [1, 1]  # at least one token
    # smallest set: removing its least probable member drops the mass below p
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        q = torch.softmax(torch.randn(1, 20, generator=g) * 2, -1)
        mu = float(torch.rand(1, generator=g))
        m = nucleus_mask(q.log(), mu)[0]
        assert q[0][m].sum() >= mu - 1e-6
        assert q[0][m].sum() - q[0][m].min() < mu


def test_nucleus_p1_keeps_the_whole_support():
    """eq. 15 with p = 1: every token of non-zero probability, however small (a tail below the
    1e-6 rounding slack included); tokens of probability 0 (-inf) stay out."""
    lp = torch.log_softmax(torch.tensor([[10.0, 0.0, -9.0, -14.0, -20.0, float("-inf")]]), -1)
    assert lp[0, 2:5].exp().sum() < 1e-6
    assert nucleus_mask(lp, 1.0).tolist() == [[True, True, True, True, True, False]]
    assert nucleus_mask(lp.double(), 1.0)[0, :5].all()


def test_consistent_keeps_eos():
    lp = torch.log_softmax(torch.tensor([[5.0, 4.0, -3.0, 1.0]]), -1)
    assert torch.isinf(filter_log_probs(lp, "topk", k=2)[0, 2])
    q = filter_log_probs(lp, "topk", k=2, always=2)
    assert torch.isfinite(q[0, 2]) and abs(q.exp().sum() - 1) < 1e-6
    assert torch.isfinite(filter_log_probs(lp, "nucleus", p=0.3, always=2)[0, 2])


@pytest.mark.parametrize(
    "decoder,kw,allowed",
    [
        ("sample", dict(temperature=1.0), None),
        ("sample", dict(temperature=0.7), None),
        ("topk", dict(k=3), [0, 1, 3]),
        ("nucleus", dict(p=0.6), [0, 1]),
    ],
)
def test_sampling_frequencies_match_filtered_distribution(decoder, kw, allowed):
    logits = torch.tensor([2.0, 1.5, -1.0, 0.5, -0.5, 0.0], dtype=torch.float64)  # eos = 2
    lm = unigram(logits)
    n = 20000
    g = torch.Generator().manual_seed(123)
    out = decode(lm, [torch.tensor([1])] * n, 1, decoder, generator=g, **kw)
    counts = torch.bincount(torch.tensor([t[0] for t in out["tokens"]]), minlength=6).double()
    q = filter_log_probs(
        torch.log_softmax(logits, -1).unsqueeze(0),
        decoder,
        **{k: v for k, v in kw.items()},
    )[0].exp()
    if allowed is not None:
        assert set(torch.nonzero(counts).flatten().tolist()) == set(allowed)
    expected = q * n
    nz = expected > 0
    chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
    assert chi2 < 20.5, (chi2, counts, expected)  # df <= 5: p ~ 0.001
    if decoder == "sample" and kw["temperature"] == 0.7:
        torch.testing.assert_close(q, torch.softmax(logits / 0.7, -1))


def exact_map(lm, prompt, max_len=60):
    """Uniform-cost search: the most probable *finished* continuation (scores only decrease
    along a prefix, so the first eos-ended sequence popped is the MAP)."""
    heap = [(0.0, ())]
    while heap:
        neg, seq = heapq.heappop(heap)
        if seq and seq[-1] == EOS:
            return list(seq), -neg
        if len(seq) >= max_len:
            continue
        full = torch.cat([prompt, torch.tensor(seq, dtype=torch.long)])
        lp, _ = lm.log_probs(full.unsqueeze(0), steps(2 - len(prompt), (1, len(full))))
        for v, log_p in enumerate(lp[0, -1].tolist()):
            heapq.heappush(heap, (neg - log_p, seq + (v,)))
    raise AssertionError("no finished sequence")


class BigramLM(nn.Module):
    """A toy model with the LanguageModel interface: next-token logits = table[last token],
    through the softmax or NMST head.  Its MAP continuation is a real multi-token sequence."""

    def __init__(self, table, head="softmax", eps=0.1):
        super().__init__()
        self.table = nn.Parameter(torch.as_tensor(table, dtype=torch.float64))
        self.cfg, self.eos_id, self.kind, self.eps = dict(model="bigram"), EOS, head, eps

    def log_probs(self, idx, t, state=None, lengths=None):
        logits = self.table[idx]  # (B, T, V)
        lp = (
            softmax_log_probs(logits)
            if self.kind == "softmax"
            else nmst_log_probs(logits, t, EOS, self.eps)
        )
        return lp, (None, None)

    def prompt(self, idx, lengths):
        lp, state = self.log_probs(idx, steps(2 - lengths, idx.shape))
        return lp[torch.arange(len(lengths)), lengths - 1], state

    def reorder_state(self, state, index):
        return state


def table(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("head", ["softmax", "nmst"])
def test_beam_equals_exhaustive_search(head):
    """V = 3 and k = 27 >= every candidate set up to depth 4 (3, 6, 12, 24 candidates): when the
    MAP has length <= 4 the beam covers every prefix it can have, so (once the final set P is
    full) beam search returns the exact MAP found by uniform-cost search."""
    lengths = []
    for seed in range(12):
        lm = BigramLM(table(seed), head, eps=0.2)
        for prompt in (torch.tensor([0]), torch.tensor([1, 1]), torch.tensor([2, 0, 1])):
            seq, score = exact_map(lm, prompt)
            out = decode(lm, [prompt], 60, "beam", beam_size=27)
            if len(seq) > 4 or not out["terminated"][0]:
                continue  # outside the covered depth, or P never filled: no claim
            assert out["tokens"][0] == seq
            assert abs(out["scores"][0].item() - score) < 1e-9
            lengths.append(len(seq))
    assert (
        len(lengths) >= 20 and sum(n >= 2 for n in lengths) >= 5
    )  # real, multi-token MAPs were checked


@pytest.mark.parametrize("decoder,kw", [("greedy", {}), ("beam", dict(beam_size=3))])
def test_decoding_in_batches_changes_only_the_batching(decoder, kw):
    """evaluate.py --decode_batch / the training probe: any batch size decodes as one batch."""
    lm = toy("gpt", "nmst", eos_bias=-2.0)
    prompts = [
        torch.randint(3, 30, (n,), generator=torch.Generator().manual_seed(n)) for n in range(1, 9)
    ]
    whole = decode(lm, prompts, 25, decoder, **kw)
    for batch in (1, 3):
        part = decode_in_batches(lm, prompts, 25, batch, decoder=decoder, **kw)
        assert part["tokens"] == whole["tokens"] and torch.equal(
            part["terminated"], whole["terminated"]
        )
        assert torch.allclose(part["scores"], whole["scores"], atol=1e-9)


def test_beam_length_penalty_reranks_the_same_final_set():
    """eq. 19 with a length penalty a > 0: the search, and so the final set P, is the same; only
    the choice in P changes (argmax s / |y|^a): the raw score can only drop, the normalised one
    only rise, and on these models some choices do change (longer sequences win)."""
    changed = 0
    for seed in range(12):
        lm = BigramLM(table(seed), "softmax", eps=0.2)
        for prompt in (torch.tensor([0]), torch.tensor([1, 1]), torch.tensor([2, 0, 1])):
            plain, pen = (
                decode(lm, [prompt], 60, "beam", beam_size=4, length_penalty=a) for a in (0.0, 1.0)
            )
            assert bool(plain["terminated"][0]) == bool(pen["terminated"][0])
            (s0, s1), (n0, n1) = (
                (plain["scores"][0].item(), pen["scores"][0].item()),
                (len(plain["tokens"][0]), len(pen["tokens"][0])),
            )
            assert s1 <= s0 + 1e-12 and s1 / n1 >= s0 / n0 - 1e-12
            changed += plain["tokens"][0] != pen["tokens"][0]
            assert n1 >= n0 or plain["tokens"][0] == pen["tokens"][0]
    assert changed >= 3


def t_half(eps):
    """the first t with 1 - (1 - eps)^t > 1/2 (proof of Theorem 3, eq. 23)"""
    return next(t for t in range(1, 10**6) if 1 - (1 - eps) ** t > 0.5)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("seed", range(3))
def test_theorem3_nmst_terminates(model, seed):
    """Random-weight NMST models (eos pushed far down): greedy ends by t_1/2, beam-k by t_1/2 + k,
    top-k / nucleus by t_1/2 with eos in V_t from then on, for every prompt."""
    eps = 0.05
    th = t_half(eps)  # 14
    lm = toy(model, "nmst", eps=eps, eos_bias=-30.0, seed=seed)
    with torch.no_grad():
        lm.head.proj.weight.mul_(10.0)  # peaky non-eos distributions: only the bound ends a decode
    prompts = [torch.randint(3, 30, (n,)) for n in range(1, 13)]
    out = decode(lm, prompts, 200, "greedy")
    assert out["terminated"].all() and out["lengths"].max() <= th
    assert (
        out["lengths"].float().mean() > 2
    )  # eos pushed down: the bound, not the logits, ends most decodes
    for k in (2, 4):
        out = decode(lm, prompts, 200, "beam", beam_size=k)
        assert out["terminated"].all() and out["lengths"].max() <= th + k
    g = torch.Generator().manual_seed(seed)
    for dec, kw in (("topk", dict(k=2)), ("nucleus", dict(p=0.4))):
        out = decode(lm, prompts * 5, 300, dec, generator=g, **kw)
        assert out["terminated"].all()


def test_va_inconsistent_under_topk_but_not_consistent_topk():
    """A VA model whose eos is never in the top-2 never terminates under top-2 (the
    inconsistency of Welleck et al.); consistent top-2 keeps eos in V_t and terminates."""
    logits = [0.5, 0.4, -1.0, 0.0, 0.1]  # eos (2) ranked last at every step
    lm = unigram(logits)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor([1, 3])] * 50
    out = decode(lm, prompts, 300, "topk", k=2, generator=g)
    assert (
        not out["terminated"].any()
        and non_termination_ratio(out["lengths"], out["terminated"], 300) == 1.0
    )
    assert not decode(lm, prompts[:3], 300, "greedy")["terminated"].any()
    assert not decode(lm, prompts[:3], 100, "beam", beam_size=2)["terminated"].any()
    out = decode(lm, prompts, 300, "topk", k=2, generator=g, consistent=True)
    assert out["terminated"].all()
    # the same logits under NMST always terminate (Theorem 3)
    assert decode(unigram(logits, "nmst", eps=0.05), prompts, 300, "topk", k=2, generator=g)[
        "terminated"
    ].all()


def test_deterministic_under_seed():
    lm = toy("gpt", "nmst", eps=0.01, eos_bias=-1.0)
    a = decode(lm, PROMPTS * 3, 30, "nucleus", p=0.9, generator=torch.Generator().manual_seed(7))
    b = decode(lm, PROMPTS * 3, 30, "nucleus", p=0.9, generator=torch.Generator().manual_seed(7))
    assert a["tokens"] == b["tokens"]


def test_r_nt_and_stats_on_hand_made_decodes():
    result = dict(
        tokens=[[4, 2], [5, 5, 5, 5], [7, 8, 9, 2], [5, 5, 5, 5], [6, 6, 6, 6]],
        lengths=torch.tensor([2, 4, 4, 4, 4]),
        terminated=torch.tensor([True, False, True, False, False]),
    )
    s = decode_stats(result, [1, 2, 3, 4])
    assert s["r_nt"] == {1: 1.0, 2: 0.8, 3: 0.8, 4: 0.6}
    assert s["mean_length"] == 18 / 5 and s["n_non_terminated"] == 3
    assert s["unique_non_terminated"] == 2 / 3


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(decoder="topk", k=0), "--k >= 1"),
        (dict(decoder="nucleus", p=0.0), "--p in"),
        (dict(decoder="nucleus", p=1.5), "--p in"),
        (dict(decoder="beam", beam_size=0), "beam"),
        (dict(decoder="bfs"), "--decoder bfs is unknown"),
    ],
)  # (--L, --temperature: argparse)
def test_bad_decoder_arguments(kw, msg):
    lm = toy("lstm", "softmax")
    L = kw.pop("L", 5)
    with pytest.raises(UserError, match=msg):
        decode(lm, PROMPTS, L, **kw)


def test_prompt_longer_than_window():
    """A prompt of n tokens + L generated fits a window of 320 when n + L - 1 <= 320 (the last
    token is never fed back): exactly at the edge it decodes, one past it is refused."""
    lm = toy("gpt", "softmax")
    with pytest.raises(UserError, match="context window"):
        decode(lm, [torch.zeros(300, dtype=torch.long)], 40)
    from decode import longest_continuation

    assert (
        longest_continuation(lm, 300) == 21 and longest_continuation(toy("lstm", "st"), 300) is None
    )
    out = decode(lm, [torch.ones(300, dtype=torch.long)], 21)
    assert len(out["tokens"][0]) <= 21
    with pytest.raises(UserError, match="context window"):
        decode(lm, [torch.ones(300, dtype=torch.long)], 22)


@pytest.mark.parametrize("model,head", [("lstm", "st"), ("gpt", "nmst"), ("gcnn", "softmax")])
def test_eos_probs_equal_the_incremental_steps(model, head):
    """eos_probs (evaluate.py's Fig. 3 traces, sample.py --show_eos): one teacher-forced pass
    gives p(eos | x, y_<t) of the step-by-step forward with the state carried (t = 1 first)."""
    lm = toy(model, head)
    x, y = [5, 7, 9, 4], [11, 6, 13, EOS]
    with torch.no_grad():
        log_p, state = lm.log_probs(torch.tensor([x]), steps(2 - len(x), (1, len(x))))
        expected = [log_p[0, -1, EOS].exp().item()]
        for j, token in enumerate(y[:-1]):
            log_p, state = lm.log_probs(
                torch.tensor([[token]]), torch.tensor([[j + 2]]), state=state
            )
            expected.append(log_p[0, -1, EOS].exp().item())
    assert eos_probs(lm, x, y) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert lm.training is False
