"""heads.py against the papers' formulas written out in float64: NMST paper eq. 2 / 9 / 10 (the
pure functions and every Head), CT paper eq. 4-7 (every Head); numerics at the extremes."""

import itertools
import math

import pytest
import torch

from conftest import steps
from heads import HEADS, Head, log1mexp, nmst_log_probs, softmax_log_probs, st_log_probs

torch.manual_seed(0)


def direct_nmst(z, t, eos, eps):
    """eq. 10 as written, float64: alpha_t and (1 - alpha_t) * softmax over the non-eos tokens."""
    sig = 1.0 / (1.0 + torch.exp(-z[..., eos]))
    alpha = (1 - sig) * (1 - (1 - eps) ** t) + sig
    return _spread(z, eos, alpha)


def direct_st(z, t0, eos, eps):
    """eq. 9 as written, float64, z (B, T, V) at steps t0, t0+1, ...:
    alpha_t = 1 - prod (1-eps) sig."""
    sig = 1.0 / (1.0 + torch.exp(-z[..., eos]))
    alpha = 1 - torch.cumprod((1 - eps) * sig, dim=-1)
    assert t0 == 1
    return _spread(z, eos, alpha)


# eq. 9 / 10's second line: the other tokens share 1 - alpha_t as their softmax without eos.
def _spread(z, eos, alpha):
    rest = z.clone()
    rest[..., eos] = -float("inf")
    p = torch.softmax(rest, dim=-1) * (1 - alpha).unsqueeze(-1)
    p[..., eos] = alpha
    return p


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("eos", [0, 5, 11])
def test_nmst_matches_eq10_float64(scale, eos):
    # Logits up to +-100 at scale 100; eps from the papers' 1e-5 to a large 0.3.
    z = torch.randn(3, 7, 12, dtype=torch.float64) * scale
    for eps in (1e-5, 1e-2, 0.3):
        t = torch.arange(1, 8, dtype=torch.float64).expand(3, 7)
        p = nmst_log_probs(z, t, eos, eps).exp()
        torch.testing.assert_close(p, direct_nmst(z, t, eos, eps), atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("eos", [0, 5, 11])
def test_st_matches_eq9_float64(scale, eos):
    # t = 1, 2, ...: the product of eq. 9 runs over the whole row.
    z = torch.randn(3, 9, 12, dtype=torch.float64) * scale
    for eps in (1e-5, 1e-2, 0.3):
        p, _ = st_log_probs(z, steps(1, z.shape[:-1]), eos, eps)
        torch.testing.assert_close(p.exp(), direct_st(z, 1, eos, eps), atol=1e-12, rtol=1e-9)


def test_softmax_matches_eq2():
    # Logits of +-100: a softmax without its max shift would overflow exp.
    z = torch.randn(4, 6, 10, dtype=torch.float64) * 30
    torch.testing.assert_close(
        softmax_log_probs(z).exp(), torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    )


@pytest.mark.parametrize("eps", [1e-8, 1e-5, 1e-2, 0.5])
@pytest.mark.parametrize("t", [1, 7, 1000, 10**6])
def test_float32_finite_and_normalised_extremes(eps, t):
    """float32, logits up to +-100, eps down to 1e-8, t up to 1e6: finite, rows sum to 1."""
    z = torch.tensor(
        [
            [[100.0, -100.0, 0.0, 50.0, -100.0]],
            [[-100.0, 100.0, 3.0, -50.0, 100.0]],
            [[0.0, 0.0, 0.0, 0.0, 0.0]],
        ]
    )  # (3, 1, 5)
    # 50 steps of one row: ST's running product over many positions in float32.
    for eos in (0, 1, 4):
        z50 = z.expand(3, 50, 5).contiguous()
        for lp in (
            nmst_log_probs(z, t, eos, eps),
            st_log_probs(z, steps(t, z.shape[:-1]), eos, eps)[0],
            st_log_probs(z50, steps(t, z50.shape[:-1]), eos, eps)[0],
        ):
            assert lp.dtype == torch.float32
            assert not torch.isnan(lp).any()
            assert torch.isfinite(lp[..., eos]).all(), "p(eos) must never be 0"
            assert torch.allclose(torch.logsumexp(lp, -1), torch.zeros(()), atol=1e-5)


def test_float32_agrees_with_float64_at_tiny_eps():
    """The reference code's 1-(1-eps)^t is 0 in float32 at eps=1e-8; log space keeps it."""
    z = torch.randn(2, 5, 8, dtype=torch.float64) * 5
    # sigma(z_eos) ~ 1e-13: p(eos) is dominated by the lower bound.
    z[..., 3] = -30.0
    # float32 within 1e-4 of float64, and p(eos) the lower bound 1 - (1 - eps)^t itself.
    for t in (1, 10, 10**4):
        lp64 = nmst_log_probs(z, t, 3, 1e-8)
        lp32 = nmst_log_probs(z.float(), t, 3, 1e-8)
        torch.testing.assert_close(lp32.double(), lp64, atol=1e-4, rtol=1e-5)
        assert abs(lp64[0, 0, 3].exp().item() / (1 - (1 - 1e-8) ** t) - 1) < 1e-3


def test_nmst_lower_bound():
    z = torch.randn(64, 30, 9, dtype=torch.float64) * 8
    for eps in (1e-4, 0.05):
        t = torch.arange(1, 31, dtype=torch.float64)
        # Theorem 3's premise: p(eos) >= 1 - (1 - eps)^t whatever the logits.
        p_eos = nmst_log_probs(z, t, 2, eps)[..., 2].exp()
        assert (p_eos >= 1 - (1 - eps) ** t - 1e-12).all()


def test_st_p_eos_non_decreasing():
    z = torch.randn(64, 40, 9, dtype=torch.float64) * 8
    # ST's product only shrinks: p(eos) never goes down (what NMST lets it do).
    p_eos = st_log_probs(z, steps(1, z.shape[:-1]), 2, 1e-3)[0][..., 2].exp()
    assert (p_eos[:, 1:] >= p_eos[:, :-1] - 1e-15).all()


def test_nmst_can_decrease():
    """Remark 1: a sequence may 'almost end' and continue: NMST lets p(eos) go down, ST cannot."""
    z = torch.zeros(1, 2, 4, dtype=torch.float64)
    # The eos logit high at t = 1, low at t = 2.
    z[0, 0, 0], z[0, 1, 0] = 5.0, -5.0
    p_nmst = nmst_log_probs(z, 1 + torch.arange(2), 0, 1e-3)[..., 0].exp()[0]
    p_st = st_log_probs(z, steps(1, z.shape[:-1]), 0, 1e-3)[0][..., 0].exp()[0]
    assert p_nmst[1] < p_nmst[0] - 0.9
    assert p_st[1] >= p_st[0]


def test_st_incremental_equals_full():
    z = torch.randn(3, 25, 11, dtype=torch.float64) * 4
    # 5 context positions, then t = 1..20.
    full, keep_full = st_log_probs(z, steps(-4, z.shape[:-1]), 6, 1e-2)
    # The same row in pieces (of 3, 2, 1, 11 and 8 positions), the running product carried.
    parts, keep = [], None
    for lo, hi in [(0, 3), (3, 5), (5, 6), (6, 17), (17, 25)]:
        lp, keep = st_log_probs(z[:, lo:hi], steps(-4 + lo, (3, hi - lo)), 6, 1e-2, keep)
        parts.append(lp)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    torch.testing.assert_close(keep, keep_full)
    # A per-position t tensor gives the same.
    t = (-4 + torch.arange(25)).expand(3, 25)
    torch.testing.assert_close(st_log_probs(z, t, 6, 1e-2)[0], full)


def test_context_positions_convention():
    """t <= 0 is scored as a fresh t = 1 step, finite, not carried into ST's running product."""
    z = torch.randn(2, 4, 6, dtype=torch.float64)
    # t = 0 is scored as t = 1 (NMST), each context position as a fresh product (ST).
    ctx = nmst_log_probs(z, 0, 1, 0.1)
    torch.testing.assert_close(ctx, nmst_log_probs(z, 1, 1, 0.1))
    lp, keep = st_log_probs(z, steps(-10, z.shape[:-1]), 1, 0.1)
    for j in range(4):
        torch.testing.assert_close(
            lp[:, j], st_log_probs(z[:, j : j + 1], steps(1, (2, 1)), 1, 0.1)[0][:, 0]
        )
    torch.testing.assert_close(keep, torch.zeros(2, dtype=torch.float64))
    assert torch.isfinite(lp).all() and torch.isfinite(ctx).all()


def test_log1mexp():
    # From -1e-20 (log(1 - e^a) near log|a|) to -1000 (near -e^a): both branches.
    a = -torch.logspace(-20, 3, 200, dtype=torch.float64)
    torch.testing.assert_close(log1mexp(a), torch.log(-torch.expm1(a)))
    a32 = a.float()
    assert torch.isfinite(log1mexp(a32)).all()


def test_gradients_finite_at_extremes():
    # float32 logits up to +-300 and eps = 1e-8: the backward pass stays finite too.
    z = (torch.randn(2, 6, 7) * 100).requires_grad_()
    for f in (
        lambda z: nmst_log_probs(z, 3, 0, 1e-8),
        lambda z: st_log_probs(z, steps(1, (2, 6)), 0, 1e-8)[0],
    ):
        z.grad = None
        f(z).gather(-1, torch.randint(0, 7, (2, 6, 1))).sum().backward()
        assert torch.isfinite(z.grad).all()


def test_head_target_log_probs_equal_gather():
    """With and without a bias, values and gradients."""
    torch.manual_seed(1)
    h = torch.randn(3, 12, 16, dtype=torch.float64, requires_grad=True)
    # The loss path (target_log_probs) is the full distribution's gather, in value and gradient.
    for kind, eos, bias in itertools.product(("softmax", "st", "nmst"), (0, 9, 29), (True, False)):
        head = Head(kind, 16, 30, eos, 1e-3, bias=bias).double()
        y = torch.randint(0, 30, (3, 12))
        y[:, 4] = eos
        full, k1 = head(h, steps(-3, (3, 12)))
        full = full.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        part, k2 = head.target_log_probs(h, y, steps(-3, (3, 12)))
        torch.testing.assert_close(part, full)
        assert (k1 is None and k2 is None) or torch.allclose(k1, k2)
        u = torch.randn(3, 12, dtype=torch.float64)
        torch.testing.assert_close(
            torch.autograd.grad((part * u).sum(), (h, head.proj.weight)),
            torch.autograd.grad((full * u).sum(), (h, head.proj.weight)),
        )
    # The softmax head's constant temperature (CT paper Table 3's baseline).
    for bias in (True, False):
        head = Head("softmax", 16, 30, 0, bias=bias, temperature=2.5).double()
        y = torch.randint(0, 30, (3, 12))
        full = head(h)[0].gather(-1, y.unsqueeze(-1)).squeeze(-1)
        part = head.target_log_probs(h, y)[0]
        torch.testing.assert_close(part, full)
        torch.testing.assert_close(
            torch.autograd.grad(part.sum(), (h, head.proj.weight)),
            torch.autograd.grad(full.sum(), (h, head.proj.weight)),
        )


# Every shipped head with the options that change its formula: (kind, options).
HEAD_CASES = [
    ("softmax", {}),
    ("softmax", dict(temperature=2.5)),
    ("st", {}),
    ("nmst", {}),
    ("mos", dict(n_experts=3)),
    ("mos", dict(n_experts=3, temperature=0.7)),
    ("ct", dict(ct_alpha=1.0, ct_beta=0.5)),
    ("ct", dict(ct_alpha=0.2, ct_beta=2.0, ct_rank=4)),
    ("ctmos", dict(n_experts=3, ct_alpha=1.0, ct_beta=0.5)),
    ("ctmos", dict(n_experts=2, ct_alpha=0.2, ct_beta=2.0, ct_rank=4)),
]


def softmax(z):
    """softmax over the last dimension as written, exp(z) / sum exp(z), shifted by the max."""
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def direct_head(head, h, t):
    """p (B, T, V) of a shipped Head from its parameters, each paper's formula written out in
    float64 (no function of heads.py): NMST paper eq. 2 / 9 / 10, CT paper eq. 4-7.  The
    sub-layers (prior, latents, W_tau) are plain nn.Linear, called as such."""
    V, eos, kind = head.vocab_size, head.eos_id, head.kind
    b = 0.0 if head.proj.bias is None else head.proj.bias[:V]
    z = h @ head.proj.weight[:V].T + b  # (B, T, V)
    if kind == "softmax":
        return softmax(z / head.temperature)
    if kind == "nmst":
        return direct_nmst(z, t.clamp(min=1).double(), eos, head.epsilon)
    if kind == "st":
        # eq. 9 over the continuation (t >= 1); a context position is a fresh t = 1 step.
        term = (1 - head.epsilon) * torch.sigmoid(z[..., eos])
        keep = torch.cumprod(torch.where(t >= 1, term, torch.ones_like(term)), -1)
        return _spread(z, eos, torch.where(t >= 1, 1 - keep, 1 - term))
    tau = 1.0
    if kind in ("ct", "ctmos"):
        # CT eq. 6: tau = (softmax(W_tau h) + alpha) / beta, one per vocabulary entry.
        tau = (softmax(head.tau(h)) + head.ct_alpha) / head.ct_beta
    if kind == "ct":
        return softmax(z / tau)  # eq. 5
    # MoS (eq. 4; CT-MoS eq. 7 divides every expert's logits by tau): sum_k pi_k softmax(z_k).
    B, T, D = h.shape
    latent = torch.tanh(head.latent(h)).view(B, T, head.n_experts, D)
    z_k = latent @ head.proj.weight[:V].T + b  # (B, T, K, V)
    if kind == "mos":
        tau = head.temperature
    else:
        tau = tau.unsqueeze(-2)
    pi = softmax(head.prior(h)).unsqueeze(-1)  # (B, T, K, 1)
    return (pi * softmax(z_k / tau)).sum(-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind, options", HEAD_CASES, ids=[f"{k}{o}" for k, o in HEAD_CASES])
def test_every_head_is_its_formula_float64(kind, options, bias):
    """Head.forward and Head.target_log_probs of every shipped head equal its paper's formula
    written out in float64 (direct_head), logits up to about +-60, at context and continuation
    positions: a formula error in any head fails here."""
    torch.manual_seed(0)
    for eos in (0, 11):
        head = Head(kind, 8, 12, eos, 1e-2, bias=bias, **options).double()
        # Parameters far from their initialisation: every term of the formula counts.
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 1.5)
        h = torch.randn(2, 9, 8, dtype=torch.float64) * 3
        t = steps(-2, (2, 9))
        expected = direct_head(head, h, t)
        log_p, _ = head(h, t)
        torch.testing.assert_close(log_p.exp(), expected, atol=1e-12, rtol=1e-9)
        y = torch.randint(0, 12, (2, 9))
        # Eos targets and others: both parts of a termination head are scored.
        y[:, ::3] = eos
        part, _ = head.target_log_probs(h, y, t)
        wanted = expected.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(part.exp(), wanted, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("eps", [0.0, 1.0, -0.1, 1.5])
def test_epsilon_outside_open_interval_rejected(eps):
    with pytest.raises(ValueError, match="epsilon"):
        Head("nmst", 4, 10, 0, eps)
    with pytest.raises(ValueError, match="epsilon"):
        nmst_log_probs(torch.zeros(1, 3), 1, 0, eps)


def test_unknown_head_rejected():
    with pytest.raises(ValueError, match="unknown head"):
        Head("adaptive", 4, 10, 0)


def test_math_constants():
    """the lower bound t_1/2 used in Theorem 3: 1-(1-eps)^t > 1/2 first at
    ceil(log 2 / -log(1-eps))."""
    eps = 0.1
    t_half = math.ceil(math.log(0.5) / math.log1p(-eps))
    # sigma(-50) ~ 2e-22: p(eos) is the lower bound, which passes 1/2 first at t_half.
    p = nmst_log_probs(torch.full((1, 4), -50.0, dtype=torch.float64), t_half, 0, eps)[0, 0].exp()
    assert (
        p > 0.5
        and nmst_log_probs(torch.full((1, 4), -50.0, dtype=torch.float64), t_half - 1, 0, eps)[
            0, 0
        ].exp()
        < 0.5
    )


@pytest.mark.parametrize("kind", HEADS)
def test_every_head_keeps_the_contract(kind):
    """What every head in HEADS must do (a head added to HEADS is checked too): log-probs finite
    and normalised at every position -- context and padding ones (t <= 0) included, which the
    decoders and analyses read though the loss does not -- and finite gradients."""
    torch.manual_seed(0)
    # Every option a head reads, given: each head takes the ones it needs.
    head = Head(kind, 8, 12, 3, 1e-3, n_experts=2, ct_alpha=1.0, ct_beta=0.5)
    h = torch.randn(2, 7, 8, requires_grad=True)
    # Context and padding positions (t <= 0), the first steps, and t as far as decoding goes.
    t = torch.tensor([-3, -1, 0, 1, 2, 10**3, 10**6]).expand(2, 7)
    log_p, _ = head(h, t)
    part, _ = head.target_log_probs(h, torch.randint(0, 12, (2, 7)), t)
    assert torch.isfinite(log_p).all() and torch.isfinite(part).all(), kind
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)
    part.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in [h, *head.parameters()] if p.grad is not None)
