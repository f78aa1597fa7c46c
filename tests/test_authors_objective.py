"""--protocol authors: the objective of the authors' code (nyu-dl/non-monotonic-self-terminating-lm,
src/wiki2), each piece on values worked out by hand in float64: their ST's floor at 1e-20
(model_utils.py:78, 100-101), their ST's and NMST's context (model_utils.py:80-82, 155-160, 190),
their per-batch divisor (train.py:61-62, 69).  And --protocol paper's values as they were."""

import math

import numpy as np
import pytest
import torch

from data.loader import collate
from heads import Head, nmst_log_probs, st_log_alpha, st_log_probs
from model import LanguageModel

EPS = 0.1
KEEP = math.log1p(-EPS)


def sigmoid(z):
    return 1 / (1 + math.exp(-z))


def identity_head(kind, V, authors=True):
    """A head on V = D whose logits are h itself (U = I), eos = 0: a test writes the logits."""
    head = Head(kind, V, V, 0, EPS, authors=authors).double()
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.weight[:V] = torch.eye(V, dtype=torch.float64)
    return head


def test_a_target_below_the_floor_scores_the_floor_renormalised_and_passes_no_gradient():
    """One continuation position (t = 1), z_eos = 0, one non-eos logit 0, the other V - 2 at -100:
    1 - alpha = 0.9 / 2 = 0.45 goes all to the logit-0 token; each of the others has p ~ 1e-44,
    clamped to 1e-20, so the row sums to Z = 1 + (V - 2) 1e-20.  V = 10^6 + 2 makes log Z = 1e-14,
    which float64 resolves."""
    V = 10**6 + 2
    z = torch.full((1, 1, V), -100.0, dtype=torch.float64)
    z[..., :2] = 0.0
    z.requires_grad_(True)
    log_p, _ = st_log_probs(z, torch.ones(1, 1, dtype=torch.long), 0, EPS, authors=True)
    small = 0.45 * math.exp(-100) / (1 + (V - 2) * math.exp(-100))
    log_z = math.log1p((V - 2) * (1e-20 - small))
    assert log_z == pytest.approx(1e-14, rel=1e-6)
    got = log_p.detach()[0, 0].tolist()
    # (5e-16: a few units in the last place; the renormalisation moves them by 1e-14)
    assert got[1] == pytest.approx(math.log(0.45) - log_z, abs=5e-16)
    assert got[7] == pytest.approx(math.log(1e-20) - log_z, abs=5e-15)
    assert got[0] == pytest.approx(math.log(0.55) - log_z, abs=5e-16)
    # The floored target's only gradient is the normaliser's, of order 1e-20 a logit; a target
    # above the floor gets one of order 1 (at z_eos: 1 - sigma).
    (g,) = torch.autograd.grad(log_p[0, 0, 7], z, retain_graph=True)
    assert float(g.abs().max()) < 1e-18
    (g,) = torch.autograd.grad(log_p[0, 0, 1], z)
    assert float(g[0, 0, 0]) == pytest.approx(0.5, rel=1e-6)


def test_each_st_factor_is_floored_at_1e_20():
    """model_utils.py:78: beta_t = max((1 - eps) sigma(z_eos), 1e-20).  At z_eos = -60, (1 - eps)
    sigma = 7.8e-27: the factor is 1e-20 and passes no gradient; the paper's is the true one."""
    z = torch.tensor([[-60.0, 3.0]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[1, 2]])
    _, log_keep, _ = st_log_alpha(z, t, EPS, authors=True)
    assert log_keep[0].tolist() == pytest.approx(
        [math.log(1e-20), math.log(1e-20) + KEEP + math.log(sigmoid(3.0))], rel=1e-14
    )
    (g,) = torch.autograd.grad(log_keep[0, 1], z)
    assert g[0].tolist() == pytest.approx([0.0, 1 - sigmoid(3.0)], abs=1e-15)
    _, paper, _ = st_log_alpha(z.detach(), t, EPS)
    assert float(paper[0, 0]) == pytest.approx(KEEP - 60.0, abs=1e-12)


def test_the_st_context_has_p_eos_0_and_stays_out_of_the_product():
    """model_utils.py:80-82: beta = 1 at the context's positions (t <= 0): p(eos) = 0, clamped to
    1e-20, and the non-eos tokens share 1; the product starts at t = 1.  V = 4, eos = 0."""
    z = torch.tensor(
        [
            [
                [2.0, 1.0, 0.0, -1.0],
                [-3.0, 0.5, 0.5, 0.0],
                [0.7, 0.0, 2.0, 1.0],
                [1.5, 1.0, 1.0, 1.0],
            ]
        ],
        dtype=torch.float64,
        requires_grad=True,
    )
    t = torch.tensor([[-1, 0, 1, 2]])
    log_p, log_keep = identity_head("st", 4)(z, t)
    for i in range(2):
        rest = [math.exp(v) for v in z[0, i, 1:].tolist()]
        # Z = 1 + 1e-20: float64 rounds it to 1 (as their code's sum does)
        want = [math.log(1e-20)] + [math.log(r / sum(rest)) for r in rest]
        assert log_p[0, i].tolist() == pytest.approx(want, abs=1e-14)
    keep1 = (1 - EPS) * sigmoid(0.7)
    keep2 = keep1 * (1 - EPS) * sigmoid(1.5)
    for i, keep in ((2, keep1), (3, keep2)):
        rest = [math.exp(v) for v in z[0, i, 1:].tolist()]
        want = [math.log(1 - keep)] + [math.log(keep * r / sum(rest)) for r in rest]
        assert log_p[0, i].tolist() == pytest.approx(want, abs=1e-14)
    assert float(log_keep.detach()[0]) == pytest.approx(math.log(keep2), abs=1e-14)
    # No gradient reaches the context's eos logit, and none is NaN.
    (g,) = torch.autograd.grad(log_p[0, :2, 1:].sum() + log_p[0, 2:].sum(), z)
    assert torch.isfinite(g).all() and g[0, :2, 0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("z_eos", [0.0, 2.0, -4.0])
def test_the_nmst_context_has_log_bound_1(z_eos):
    """model_utils.py:155-160, 190: at the context, log (1 - eps)^t is 1 and f_lb is 1e-35, then
    the row is renormalised: 1 - alpha ~ e (1 - sigma), alpha ~ sigma + 1e-35 (1 - sigma).  At
    t = 1 eq. 10 itself: alpha = (1 - sigma) eps + sigma."""
    z = torch.tensor([[[z_eos, 1.0, 0.0], [z_eos, 1.0, 0.0]]], dtype=torch.float64)
    log_p = nmst_log_probs(z, torch.tensor([[0, 1]]), 0, EPS, authors=True)
    s = sigmoid(z_eos)
    rest = [math.e / (math.e + 1), 1 / (math.e + 1)]
    eos, other = s + 1e-35 * (1 - s), math.e * (1 - s)
    want = [eos / (eos + other)] + [other / (eos + other) * r for r in rest]
    assert log_p[0, 0].exp().tolist() == pytest.approx(want, rel=1e-13)
    alpha = (1 - s) * EPS + s
    want = [alpha] + [(1 - alpha) * r for r in rest]
    assert log_p[0, 1].exp().tolist() == pytest.approx(want, rel=1e-13)
    paper = nmst_log_probs(z, torch.tensor([[0, 1]]), 0, EPS)
    assert paper[0, 0].exp().tolist() == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize("kind", ["softmax", "st", "nmst"])
def test_the_loss_path_is_the_full_rows_under_the_authors_protocol(kind):
    """Head.target_log_probs (training, perplexity) equals forward(...) at the targets, context
    included, and ST's running product comes out the same."""
    torch.manual_seed(0)
    head = Head(kind, 6, 9, 2, 1e-3, authors=True).double()
    h = torch.randn(3, 14, 6, dtype=torch.float64) * 8
    t = (torch.arange(14) - 9).expand(3, 14)
    y = torch.randint(0, 9, (3, 14))
    full, state = head(h, t)
    got, got_state = head.target_log_probs(h, y, t)
    torch.testing.assert_close(
        got, full.gather(-1, y.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-12
    )
    assert (state is None) == (got_state is None)
    if state is not None:
        torch.testing.assert_close(got_state, state, rtol=0, atol=1e-12)


def test_the_model_config_chooses_the_objective():
    cfg = dict(model="rnn", head="st", epsilon=1e-5, vocab_size=70, eos_id=0, n_layer=1)
    cfg.update(d_model=8, dropout=0.0, tie=True)
    assert LanguageModel(dict(cfg, protocol="authors")).head.authors
    assert not LanguageModel(dict(cfg, protocol="paper")).head.authors
    assert not LanguageModel(cfg).head.authors


# log p(targets) of three seeded heads under eq. 9 / 10 (--protocol paper), as the code gave them
# before --protocol authors had its own objective: they stay to the last digit.
PAPER = dict(
    softmax=[-0.7927811704608839, -3.497859402520290, -2.784646837522916, -2.398604074936528,
             -2.837171705018266, -2.481237921638460, -2.204138448088031, -0.6653855170168245,
             -1.424073079449715, -1.709462057195608, -3.656267506901851, -1.504603428216522],
    st=[-1.848877951621423, -2.892087288396822, -2.992107193357858, -2.800991245304925,
        -0.3095828552475112, -5.080287327622569, -1.915764685577028, -1.551891443024635,
        -1.114066415876587, -3.111371561259995, -0.05148949312926131, -1.470620178469021],
    nmst=[-1.204627682510137, -3.779949462918810, -4.307576999949442, -3.144450694017742,
          -0.5931221292797326, -2.912305685509516, -3.461782811791998, -0.1765544962644141,
          -0.09736164334043829, -2.279136181175388, -0.9989457494107888, -3.974251152346594],
)  # fmt: skip


@pytest.mark.parametrize("kind", ["softmax", "st", "nmst"])
def test_the_paper_protocol_keeps_its_values(kind):
    torch.manual_seed(0)
    head = Head(kind, 5, 7, 2, 0.05).double()
    h = torch.randn(2, 6, 5, dtype=torch.float64) * 3
    t = torch.tensor([[-2, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0]])
    y = torch.tensor([[1, 3, 4, 0, 2, 6], [5, 2, 2, 6, 2, 0]])
    log_p = head.target_log_probs(h, y, t)[0]
    assert log_p.flatten().tolist() == pytest.approx(PAPER[kind], rel=1e-14, abs=1e-15)


class Split:
    """Two lines as the authors form them (<bos> = 1, <cpad> = 2, eos = 0): a 1-word line padded
    with 9 <cpad>, and a 12-word line."""

    seqs = [np.array([1, *[2] * 9, 7, 0]), np.array([1, *range(5, 17), 0])]
    contexts = np.array([11, 11])
    cpad = 2

    def __getitem__(self, i):
        return self.seqs[i]


def test_the_authors_batch_carries_its_own_count_without_cpad():
    """train.py:61-62: non-padding targets (11 + 13) less the <cpad> ones (9) = 15; the loss sums
    all 24 (the mask), and a batch not under their loss carries no such count."""
    b = collate(Split(), [0, 1], context_loss=True)
    assert (b["n"], int(b["mask"].sum()), b["n_authors"]) == (24, 24, 15)
    assert collate(Split(), [1], context_loss=True)["n_authors"] == 13
    assert "n_authors" not in collate(Split(), [0, 1])


def test_the_comparison_script_needs_the_authors_code(tmp_path):
    import bench
    import common

    with pytest.raises(common.UserError, match="--authors_src"):
        bench.main(["authors", "--authors_src", str(tmp_path)])
