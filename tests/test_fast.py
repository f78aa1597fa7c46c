"""fast.py: every CPU fast path against the reference it replaces (float64 where it is math,
statistics where it is randomness), and the whole model with the switches on and off."""
import pytest
import torch
import torch.nn.functional as F

import fast
from fast import Dropout, LinearLogSoftmax, dropout, linear_log_softmax, math_attention, project
from heads import Head, log_softmax_at
from model import LanguageModel
from tests.conftest import steps


@pytest.mark.parametrize("exclude", [None, 0, 17, 42])
@pytest.mark.parametrize("far", [False, True])
def test_linear_log_softmax_matches_direct_formula(monkeypatch, exclude, far):
    """The blocked, fused output layer (CPU training path) against log_softmax(h U^T) in float64:
    values, both gradients (gradcheck) and the no-grad path, with blocks that do not divide V.
    far: later blocks hold logits far above the first block's maxima, so the shift moves (runs
    of blocks with different shifts in the backward pass)."""
    monkeypatch.setattr(LinearLogSoftmax, "block_elements", 7 * 6)  # 6 rows -> blocks of 7 vocabulary rows
    torch.manual_seed(0)
    h = torch.randn(6, 5, dtype=torch.float64)
    W = torch.randn(43, 5, dtype=torch.float64)
    if far:  # rows 20 and 36 (3rd and 6th blocks) get logits hundreds of nats away
        W[20] *= 40
        W[36] *= 80
        z0 = (h @ W.t())
        assert ((z0[:, 14:] - z0[:, :7].amax(-1, keepdim=True)) > 50).any(), "the test must move the shift"
    h.requires_grad_()
    W.requires_grad_()
    y = torch.randint(0, 43, (6,))
    if exclude is not None:
        y = y.masked_fill(y == exclude, (exclude + 1) % 43)
    z = h @ W.t()
    if exclude is not None:
        z = z.index_fill(-1, torch.tensor([exclude]), float("-inf"))
    direct = torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    fused = LinearLogSoftmax.apply(h, W, y, exclude)
    torch.testing.assert_close(fused, direct, rtol=0, atol=1e-12)
    u = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((fused * u).sum(), (h, W)),
                               torch.autograd.grad((direct * u).sum(), (h, W)), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda h, W: LinearLogSoftmax.apply(h, W, y, exclude), (h, W))
    with torch.no_grad():
        torch.testing.assert_close(LinearLogSoftmax.apply(h, W, y, exclude), direct, rtol=0, atol=1e-12)
    # the reference path (heads.log_softmax_at: linear + cross_entropy) gives the same numbers
    torch.testing.assert_close(log_softmax_at(h, W, y, exclude), direct, rtol=0, atol=1e-12)
    torch.testing.assert_close(linear_log_softmax(h, W, y, exclude), direct, rtol=0, atol=1e-12)


def test_project_equals_linear():
    torch.manual_seed(0)
    W = torch.randn(301, 16)
    for shape in ((1, 16), (3, 1, 16), (8, 16), (40, 3, 16)):  # 1, 3, 8 and 120 rows
        h = torch.randn(*shape)
        torch.testing.assert_close(project(h, W), torch.nn.functional.linear(h, W), rtol=1e-5, atol=1e-5)


def test_linear_log_softmax_float32_large_logits(monkeypatch):
    """float32 with logits spread over hundreds of nats, the largest in late blocks (the shift
    moves several times): finite, and equal to the float64 formula to float32 precision."""
    monkeypatch.setattr(LinearLogSoftmax, "block_elements", 16 * 8)  # blocks of 16 vocabulary rows
    torch.manual_seed(0)
    h = torch.randn(8, 6)
    W = torch.randn(100, 6) * torch.linspace(1, 60, 100).unsqueeze(1)  # |logits| up to ~400
    y = torch.randint(0, 100, (8,))
    h32, W32 = h.clone().requires_grad_(), W.clone().requires_grad_()
    h64, W64 = h.double().requires_grad_(), W.double().requires_grad_()
    fused = LinearLogSoftmax.apply(h32, W32, y, None)
    direct = torch.log_softmax(h64 @ W64.t(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(fused.double(), direct, rtol=1e-5, atol=1e-3)
    fused.sum().backward()
    direct.sum().backward()
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(W32.grad.double(), W64.grad, rtol=1e-4, atol=1e-3)


def test_dropout_under_compile_is_one_graph():
    """Under torch.compile `dropout` hands over to F.dropout (inductor's own fused mask) instead
    of breaking the graph at random_."""
    f = torch.compile(lambda x: dropout(x, 0.5), fullgraph=True)  # fullgraph: a graph break raises
    assert set(f(torch.ones(1000)).unique().tolist()) == {0.0, 2.0}


def test_dropout_mask_rate_scale_gradient_and_seed():
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
    """The CPU training path with dropout (fast.math_attention) is sdpa's
    attention: with a drop probability below 2^-32 nothing is dropped, and values and gradients
    equal sdpa's without dropout (float64)."""
    import torch.nn.functional as F
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
    ours = math_attention(q, k, v, attn_mask, 1e-15)
    theirs = F.scaled_dot_product_attention(q, k, v, **ref)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    g = torch.randn_like(ours)
    inputs = (q, k, v) + ((attn_mask,) if mask == "additive" else ())
    grads = torch.autograd.grad(ours, inputs, g)
    for a, b in zip(grads, torch.autograd.grad(theirs, inputs, g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # a row with no visible key (what a zero-length padded row gives) stays finite
    empty = torch.zeros(1, 1, T, k.size(2), dtype=torch.bool)
    assert torch.isfinite(math_attention(q, k, v, empty, 0.1)).all()


SWITCHES = ("FUSED_OUTPUT_LAYER", "FEW_ROW_PROJECTION", "INTEGER_DROPOUT", "MATH_ATTENTION")


def switched(monkeypatch, on):
    for name in SWITCHES:
        monkeypatch.setattr(fast, name, on)
    import model
    monkeypatch.setattr(model, "Dropout", fast.Dropout if on else torch.nn.Dropout)


@pytest.mark.parametrize("kind", ["gpt", "lstm"])
@pytest.mark.parametrize("head", ["softmax", "nmst", "st"])
def test_whole_model_fast_equals_reference(kind, head, monkeypatch):
    """The training loss and its gradients, and decoding's few-row log-probs, with every fast
    path switched on equal the reference path's (float32, dropout off: the same numbers in
    another order)."""
    cfg = dict(model=kind, head=head, epsilon=1e-3, vocab_size=300, eos_id=7, n_layer=2,
               d_model=32, n_head=4, block_size=64, dropout=0.0, tie=True, bias=False)
    x = torch.randint(0, 300, (4, 20))
    t = steps(-3, (4, 19))
    out = []
    for on in (True, False):
        switched(monkeypatch, on)
        torch.manual_seed(0)
        lm = LanguageModel(cfg)
        lp = lm(x[:, :-1], t, targets=x[:, 1:])
        lp.sum().backward()
        with torch.no_grad():
            few, _ = lm(x[:, :1], torch.ones(4, 1, dtype=torch.long))  # 4 rows: decoding
        out.append((lp.detach(), [p.grad for p in lm.parameters()], few))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[0][2], out[1][2], rtol=1e-5, atol=1e-5)


def test_integer_dropout_has_the_reference_distribution():
    """fast.Dropout and nn.Dropout: the same module (state dict, eval mode), the same keep rate
    and survivor scale (5 sigma), different random streams."""
    x = torch.ones(300_000)
    a, b = Dropout(0.25), torch.nn.Dropout(0.25)
    assert a.state_dict() == b.state_dict() == {}
    for m in (a, b):
        y = m(x)
        rate = (y == 0).double().mean().item()
        assert abs(rate - 0.25) < 5 * (0.25 * 0.75 / x.numel()) ** 0.5
        assert torch.allclose(y[y != 0], torch.tensor(1 / 0.75))
        assert m.eval()(x) is x
        m.train()


def test_fast_paths_step_aside_where_they_do_not_apply():
    """Off the eager CPU float path (a bias, float64 vs float32 weights, autocast, compile) the
    reference runs; on it, the fast one."""
    h, W = torch.randn(5, 8), torch.randn(30, 8)
    assert fast.fused_applies(h, W, None) and not fast.fused_applies(h, W, torch.zeros(30))
    assert not fast.fused_applies(h.double(), W, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast.fused_applies(h, W, None)
    assert fast.few_rows(h, W, None) and not fast.few_rows(torch.randn(1, 8), W, None)
    assert not fast.few_rows(torch.randn(200, 8), W, None)
    q = torch.randn(1, 2, 3, 4)
    assert fast.math_attention_applies(q, 0.1) and not fast.math_attention_applies(q, 0.0)
    head = Head("softmax", 8, 30, 0, bias=True)
    torch.testing.assert_close(head.target_log_probs(h.unsqueeze(0), torch.zeros(1, 5).long())[0],
                               head(h.unsqueeze(0))[0][..., 0])
