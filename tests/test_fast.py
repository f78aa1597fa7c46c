"""fast.py: every CPU fast path against the reference it replaces (float64), and the whole model
with the switches on and off."""
import pytest
import torch

import fast
from fast import LinearLogSoftmax, linear_log_softmax, project
from heads import Head, log_softmax_at
from model import LanguageModel
from conftest import steps


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


SWITCHES = ("FUSED_OUTPUT_LAYER", "FEW_ROW_PROJECTION")


def switched(monkeypatch, on):
    for name in SWITCHES:
        monkeypatch.setattr(fast, name, on)


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


def test_fast_paths_step_aside_where_they_do_not_apply():
    """Off the eager CPU float path (a bias, float64 vs float32 weights, autocast) the reference
    runs; on it, the fast one."""
    h, W = torch.randn(5, 8), torch.randn(30, 8)
    assert fast.fused_applies(h, W, None) and not fast.fused_applies(h, W, torch.zeros(30))
    assert not fast.fused_applies(h.double(), W, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast.fused_applies(h, W, None)
    assert fast.few_rows(h, W, None) and not fast.few_rows(torch.randn(1, 8), W, None)
    assert not fast.few_rows(torch.randn(200, 8), W, None)
    head = Head("softmax", 8, 30, 0, bias=True)
    torch.testing.assert_close(head.target_log_probs(h.unsqueeze(0), torch.zeros(1, 5).long())[0],
                               head(h.unsqueeze(0))[0][..., 0])
