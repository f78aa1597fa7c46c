"""model.py: one contract for every backbone; incremental == full forward (float64, 1e-6)."""
import os
import shutil

import pytest
import torch

from model import LanguageModel

V, EOS = 40, 3


def make(model, head="softmax", **kw):
    cfg = dict(model=model, head=head, epsilon=1e-2, vocab_size=V, eos_id=EOS, n_layer=2, d_model=24, dropout=0.0,
               tie=True, n_head=4, block_size=48, bias=True)
    cfg.update(kw)
    torch.manual_seed(0)
    return LanguageModel(cfg).double().eval()


@pytest.mark.parametrize("model", ["rnn", "lstm", "gpt"])
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_incremental_equals_full(model, head):
    lm = make(model, head)
    idx = torch.randint(0, V, (3, 30))
    with torch.no_grad():
        full, _ = lm(idx, t=-8)
        h_full, _ = lm.backbone(idx)
        state, steps, hs = None, [], []
        for i in range(30):
            h, bstate = lm.backbone(idx[:, i:i + 1], None if state is None else state[0])
            hs.append(h)
            lp, state = lm(idx[:, i:i + 1], t=-8 + i, state=state)
            steps.append(lp)
        # uneven chunks through the same state
        state, chunks = None, []
        for lo, hi in [(0, 11), (11, 12), (12, 20), (20, 30)]:
            lp, state = lm(idx[:, lo:hi], t=-8 + lo, state=state)
            chunks.append(lp)
    torch.testing.assert_close(torch.cat(hs, 1), h_full, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model", ["rnn", "lstm", "gpt"])
def test_right_padding_lengths_and_state(model):
    """With lengths, each row's outputs and final state equal those of the row alone."""
    lm = make(model, "st")
    idx = torch.randint(0, V, (3, 14))
    lengths = torch.tensor([14, 9, 4])
    nxt = torch.randint(0, V, (3, 1))
    with torch.no_grad():
        lp, state = lm(idx, -8, lengths=lengths)
        lp_next, _ = lm(nxt, -8 + lengths, state=state)
        for b in range(3):
            L = int(lengths[b])
            alone, st = lm(idx[b:b + 1, :L], -8)
            torch.testing.assert_close(lp[b, :L], alone[0], atol=1e-9, rtol=0)
            nxt_alone, _ = lm(nxt[b:b + 1], -8 + L, state=st)
            torch.testing.assert_close(lp_next[b], nxt_alone[0], atol=1e-9, rtol=0)


@pytest.mark.parametrize("model", ["rnn", "lstm", "gpt"])
def test_reorder_state(model):
    lm = make(model, "st")
    idx = torch.randint(0, V, (3, 6))
    nxt = torch.randint(0, V, (4, 1))
    order = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = lm(idx, -2)
        a, _ = lm(nxt, 5, state=lm.reorder_state(state, order))
        _, state2 = lm(idx[order], -2)
        b, _ = lm(nxt, 5, state=state2)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


@pytest.mark.parametrize("model", ["rnn", "lstm", "gpt"])
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_target_log_probs_and_normalisation(model, head):
    lm = make(model, head)
    idx, y = torch.randint(0, V, (2, 15)), torch.randint(0, V, (2, 15))
    y[:, 12] = EOS
    with torch.no_grad():
        lp, _ = lm(idx, -8)
        torch.testing.assert_close(lm.target_log_probs(idx, y, -8), lp.gather(-1, y.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, 15, dtype=torch.float64))


def test_weight_tying_and_gpt_window():
    lm = make("gpt")
    assert lm.head.proj.weight is lm.backbone.wte.weight
    assert make("lstm", tie=False).head.proj.weight is not make("lstm", tie=False).backbone.wte.weight
    with pytest.raises(ValueError, match="context window"):
        lm(torch.zeros(1, 49, dtype=torch.long), 1)


def test_unknown_model_rejected():
    with pytest.raises(ValueError, match="unknown model"):
        make("transformer-xl")


@pytest.mark.skipif(not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")),
                    reason="torch.compile (inductor) needs a C++ compiler on CPU")
def test_compiled_model_matches_eager():
    """What train.py --compile does (LanguageModel.compile(): torch.compile, inductor on CPU):
    the same log-probs and gradients as the eager model, and unchanged state_dict keys (so
    checkpoints of compiled runs load into plain models).  A tiny model: inductor compiles in
    about 20 s here."""
    torch.manual_seed(0)
    cfg = dict(model="gpt", head="nmst", epsilon=1e-3, vocab_size=50, eos_id=49, n_layer=1, d_model=16, n_head=2,
               block_size=32, dropout=0.0, tie=True, bias=True)
    eager, compiled = LanguageModel(cfg), LanguageModel(cfg)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    torch._dynamo.utils.counters.clear()
    assert compiled._compiled_call_impl is not None  # calls now go through torch.compile
    x = torch.randint(0, 50, (2, 12))
    grads = []
    for lm in (eager, compiled):
        log_p = lm(x[:, :-1], 1, targets=x[:, 1:])  # the training path (through forward)
        log_p.sum().backward()
        grads.append((log_p.detach(), [p.grad.clone() for p in lm.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    for g_c, g_e in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-5)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not torch._dynamo.utils.counters["graph_break"]  # the training path is one graph


def test_dropout_under_compile_is_one_graph():
    """Under torch.compile `dropout` hands over to F.dropout (inductor's own fused mask) instead
    of breaking the graph at random_."""
    from model import dropout
    f = torch.compile(lambda x: dropout(x, 0.5), fullgraph=True)  # fullgraph: a graph break raises
    assert set(f(torch.ones(1000)).unique().tolist()) == {0.0, 2.0}


def test_dropout_mask_rate_scale_gradient_and_seed():
    from model import Dropout, dropout
    x = torch.ones(400, 1000, dtype=torch.float64, requires_grad=True)
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0) is x
    torch.manual_seed(1)
    y = dropout(x, 0.3)
    assert y.dtype == torch.float64
    kept = y != 0
    rate = 1 - kept.double().mean().item()
    assert abs(rate - 0.3) < 5 * (0.3 * 0.7 / y.numel()) ** 0.5  # 5 sigma
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.7))  # survivors scaled by 1 / (1 - p)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d y / d x = mask / (1 - p)
    torch.manual_seed(1)
    assert torch.equal(dropout(x, 0.3), y)  # torch.manual_seed makes it reproducible
    for p in (0.02, 0.5, 0.9):  # other rates: the threshold maps p to the integer range correctly
        r = 1 - (dropout(torch.ones(200_000), p) != 0).double().mean().item()
        assert abs(r - p) < 5 * (p * (1 - p) / 200_000) ** 0.5, (p, r)
    assert dropout(torch.ones(5), 1.0).eq(0).all()
    m = Dropout(0.5)
    assert isinstance(m, torch.nn.Dropout) and m.eval()(x) is x


@pytest.mark.parametrize("mask", ["causal", "none", "padded", "additive"])
def test_math_attention_equals_sdpa(mask):
    """The CPU training path with dropout (CausalSelfAttention._math_attention) is sdpa's
    attention: with a drop probability below 2^-32 nothing is dropped, and values and gradients
    equal sdpa's without dropout (float64)."""
    import torch.nn.functional as F
    from model import CausalSelfAttention
    torch.manual_seed(0)
    B, H, T, S, hd = 2, 3, 5, 7, 4
    q = torch.randn(B, H, T, hd, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, S if mask != "causal" else T, hd, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    if mask == "causal":
        attn_mask, ref = "causal", dict(is_causal=True)
    elif mask == "none":
        attn_mask = None
        ref = dict(attn_mask=None)
    elif mask == "padded":  # cache of 2 + 5 new tokens, row 1 padded after 3 keys
        causal = torch.arange(S) <= (2 + torch.arange(T)).unsqueeze(1)
        valid = torch.tensor([[True] * S, [True] * 3 + [False] * (S - 3)])
        attn_mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)
        ref = dict(attn_mask=attn_mask)
    else:  # a float bias with -inf entries, as InsNet's relative-position attention passes
        causal = torch.arange(S) <= (2 + torch.arange(T)).unsqueeze(1)
        attn_mask = torch.randn(B, H, T, S, dtype=torch.float64).masked_fill(~causal, float("-inf"))
        attn_mask.requires_grad_()  # the bias is learned: its gradient must match too
        ref = dict(attn_mask=attn_mask)
    ours = CausalSelfAttention._math_attention(q, k, v, attn_mask, 1e-15)
    theirs = F.scaled_dot_product_attention(q, k, v, **ref)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    g = torch.randn_like(ours)
    inputs = (q, k, v) + ((attn_mask,) if mask == "additive" else ())
    grads = torch.autograd.grad(ours, inputs, g)
    for a, b in zip(grads, torch.autograd.grad(theirs, inputs, g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # a row with no visible key (what a zero-length padded row gives) stays finite
    empty = torch.zeros(1, 1, T, k.size(2), dtype=torch.bool)
    assert torch.isfinite(CausalSelfAttention._math_attention(q, k, v, empty, 0.1)).all()


def test_gpt_training_dropout_on_cpu_drops_attention_weights():
    """In training mode on CPU the GPT takes the math path: outputs differ between two forward
    passes (dropout), and with dropout 0 training equals evaluation."""
    lm = make("gpt", dropout=0.3).float().train()
    idx = torch.randint(0, V, (2, 12))
    a, b = lm.backbone(idx)[0], lm.backbone(idx)[0]
    assert not torch.allclose(a, b)
    lm0 = make("gpt", dropout=0.0).float().train()
    torch.testing.assert_close(lm0.backbone(idx)[0], lm0.eval().backbone(idx)[0])
