"""Output heads: how a language model turns a hidden state h_t into p(y_t | y_<t, x).

Papers and equations implemented here (each exactly once, next to a comment naming it):
  * Vanilla softmax (VA)                      NMST paper, eq. 2
  * Self-terminating (ST, Welleck et al. 2020) NMST paper, eq. 9
  * Non-monotonic self-terminating (NMST)     NMST paper, eq. 10
(Choi et al., "A Non-monotonic Self-terminating Language Model", ICLR 2023;
 ../shared/papers/nmst-non-monotonic-self-terminating-lm.txt)

Each parametrization is a *pure function* from logits z = U h (..., V) to log-probabilities,
plus a thin nn.Module (`Head`) that owns the output projection U (optionally tied to the input
embedding) and calls the pure function.

Notation.  z_eos = u_eos^T h_t is the eos logit, z_v the others.  t is the continuation step
index: t = 1 at the first continuation token (the token right after the 10-token context), so
eq. 10's lower bound is 1 - (1 - eps)^t.

Everything is computed in log space, so that the log-probs stay finite and normalised in
float32 for eps in [1e-8, 0.5], t up to 1e6 and logits up to +-100:
    log(1 - alpha_t)  is a *sum* of logsigmoid / log1p terms (never 1 - something tiny),
    log(alpha_t)      is log1mexp(log(1 - alpha_t)) or a logaddexp of two finite terms.
(The reference NMST code evaluates 1 - (1 - eps)^t in float32, which is exactly 0 at
eps = 1e-8, and returns NaN.)

Convention for context positions (t <= 0).  The loss never scores them, but decoders and
analyses may look at them, so they must be finite: a context position is scored *as if the
continuation started there*, i.e. with t = 1 and (ST) a fresh one-term product that is not
carried into the running `log_keep`.  p(eos) is then >= eps > 0 there, never -inf.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

HEADS = ("softmax", "st", "nmst")


# ---------------------------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------------------------
def log1mexp(a):
    """log(1 - exp(a)) for a <= 0, stable everywhere (Maechler 2012): two branches at -log 2."""
    a = torch.clamp(a, max=0.0)
    small = a > -math.log(2.0)
    # evaluate each branch only where it is accurate, and keep the other branch finite
    out_small = torch.log(-torch.expm1(torch.where(small, a, torch.full_like(a, -1.0))))
    out_large = torch.log1p(-torch.exp(torch.where(small, torch.full_like(a, -1.0), a)))
    return torch.where(small, out_small, out_large)


def _check_epsilon(epsilon):
    if not (0.0 < float(epsilon) < 1.0):
        raise ValueError(f"epsilon must lie in (0, 1), got {epsilon}")


# ---------------------------------------------------------------------------------------------
# the three parametrizations (pure functions)
# ---------------------------------------------------------------------------------------------
def softmax_log_probs(logits):
    """VA, NMST paper eq. 2:  p(y_t = v) = exp(u_v^T h_t) / sum_v' exp(u_v'^T h_t).
    logits (..., V) -> log_probs (..., V)."""
    return F.log_softmax(logits, dim=-1)


def nmst_log_alpha(z_eos, t, epsilon):
    """NMST, NMST paper eq. 10:
        alpha_t = (1 - sigma(z_eos)) * (1 - (1 - eps)^t) + sigma(z_eos)
    i.e. a convex combination, with weight sigma(z_eos), of the lower bound 1 - (1 - eps)^t and 1.
    In log space:
        log(1 - alpha_t) = logsigmoid(-z_eos) + t * log1p(-eps)
        log(alpha_t)     = logaddexp(logsigmoid(z_eos), logsigmoid(-z_eos) + log1mexp(t*log1p(-eps)))
    z_eos (...); t int or tensor broadcastable to (...) (t <= 0: scored as t = 1)
    -> (log_alpha, log_one_minus_alpha), each (...)."""
    _check_epsilon(epsilon)
    t = torch.clamp(torch.as_tensor(t, device=z_eos.device), min=1).to(z_eos.dtype)
    log_lower_keep = t * math.log1p(-epsilon)  # log (1 - eps)^t
    log_one_minus_alpha = F.logsigmoid(-z_eos) + log_lower_keep
    log_alpha = torch.logaddexp(F.logsigmoid(z_eos), F.logsigmoid(-z_eos) + log1mexp(log_lower_keep))
    return log_alpha, log_one_minus_alpha


def st_log_alpha(z_eos, t, epsilon, log_keep=None):
    """ST, NMST paper eq. 9 (Welleck et al. 2020):
        alpha_t = 1 - prod_{t'=1}^{t} (1 - eps) * sigma(z_eos,t')
    so log(1 - alpha_t) = log_keep_t = sum_{t'<=t} [log1p(-eps) + logsigmoid(z_eos,t')] and
    log(alpha_t) = log1mexp(log_keep_t).

    z_eos (..., T) over *consecutive* steps; t is the step index of each position: an int
    (step of the first position; later ones t+1, t+2, ...), a (...,) tensor of first-position
    steps per sequence, or a (..., T) tensor giving every position's step.  log_keep (...,)
    is the running sum *before* the first position (None = empty product).  Positions with
    t <= 0 (context) get a fresh one-term product and do not enter the running sum.
    -> (log_alpha (..., T), log_one_minus_alpha (..., T), log_keep (...,) after the last position)."""
    _check_epsilon(epsilon)
    T = z_eos.size(-1)
    t = torch.as_tensor(t, device=z_eos.device)
    if t.dim() == 0 or t.dim() < z_eos.dim() or t.size(-1) != T:
        t = t.unsqueeze(-1) + torch.arange(T, device=z_eos.device)  # first-position step -> every position
    t = t.expand(z_eos.shape)
    term = math.log1p(-epsilon) + F.logsigmoid(z_eos)  # log((1 - eps) sigma(z_eos,t'))
    in_continuation = t >= 1
    if log_keep is None:
        log_keep = torch.zeros(z_eos.shape[:-1], dtype=z_eos.dtype, device=z_eos.device)
    running = log_keep.unsqueeze(-1) + torch.cumsum(torch.where(in_continuation, term, 0.0), dim=-1)
    log_one_minus_alpha = torch.where(in_continuation, running, term)
    return log1mexp(log_one_minus_alpha), log_one_minus_alpha, running[..., -1]


def _log_softmax_without_eos(logits, eos_id):
    """log( exp(z_v) / sum_{v' != eos} exp(z_v') ) for every v (-inf at eos): the shared
    non-eos factor of eq. 9 and eq. 10.  logits (..., V) -> (..., V)."""
    is_eos = torch.arange(logits.size(-1), device=logits.device) == eos_id
    z_rest = logits.masked_fill(is_eos, float("-inf"))
    return z_rest - torch.logsumexp(z_rest, dim=-1, keepdim=True), is_eos


def _assemble(logits, eos_id, log_alpha, log_one_minus_alpha):
    """p(eos) = alpha_t at eos_id and, for v != eos (eq. 9 / 10, second line),
        p(v) = (1 - alpha_t) * exp(z_v) / sum_{v' != eos} exp(z_v').
    logits (..., V); log_alpha, log_one_minus_alpha (...)  ->  log_probs (..., V)."""
    log_rest, is_eos = _log_softmax_without_eos(logits, eos_id)
    return torch.where(is_eos, log_alpha.unsqueeze(-1), log_one_minus_alpha.unsqueeze(-1) + log_rest)


def nmst_log_probs(logits, t, eos_id, epsilon):
    """NMST (eq. 10) log-probabilities.  logits (..., V), t as in nmst_log_alpha -> (..., V)."""
    return _assemble(logits, eos_id, *nmst_log_alpha(logits[..., eos_id], t, epsilon))


def st_log_probs(logits, t, eos_id, epsilon, log_keep=None):
    """ST (eq. 9) log-probabilities.  logits (..., T, V), t / log_keep as in st_log_alpha
    -> (log_probs (..., T, V), log_keep (...,) after the last position)."""
    log_alpha, log_one_minus_alpha, log_keep = st_log_alpha(logits[..., eos_id], t, epsilon, log_keep)
    return _assemble(logits, eos_id, log_alpha, log_one_minus_alpha), log_keep


# ---------------------------------------------------------------------------------------------
# nn.Module wrapper: owns the output projection U (V, D), optionally tied to the embedding
# ---------------------------------------------------------------------------------------------
class Head(nn.Module):
    """Output layer: h (B, T, D) -> log_probs (B, T, V).

    forward(h, t, head_state) returns (log_probs, new_head_state); the head state is the ST
    running `log_keep` (B,) and None for softmax / NMST.  t is the continuation step index of
    the first position (int or (B,) tensor) or of every position ((B, T) tensor)."""

    def __init__(self, kind, d_model, vocab_size, eos_id, epsilon=1e-5, bias=False):
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"unknown head '{kind}' (choose from {', '.join(HEADS)})")
        if kind != "softmax":
            _check_epsilon(epsilon)
        self.kind, self.eos_id, self.epsilon = kind, int(eos_id), float(epsilon)
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)

    def forward(self, h, t=1, head_state=None):
        """h (B, T, D) -> (log_probs (B, T, V), head_state)."""
        logits = self.proj(h)  # (B, T, V)
        if self.kind == "softmax":
            return softmax_log_probs(logits), None
        if self.kind == "nmst":
            return nmst_log_probs(logits, every_step(t, h), self.eos_id, self.epsilon), None
        return st_log_probs(logits, t, self.eos_id, self.epsilon, head_state)

    def target_log_probs(self, h, targets, t=1, head_state=None):
        """log p(targets) only: the training / evaluation path.  Tests check it equals
        forward(...).gather(targets).  h (B, T, D), targets (B, T) -> (log_p (B, T), head_state).

        It never builds the (B, T, V) log-probabilities: on CPU every extra pass over them costs
        as much as the matrix product.  For ST / NMST the eos row of U is projected on its own
        (z_eos, (B, T)) and the other V-1 rows feed one fused cross entropy, which *is* the
        non-eos factor  exp(z_v) / sum_{v' != eos} exp(z_v')  of eq. 9 / 10; the eos part
        reuses nmst_log_alpha / st_log_alpha.  So ST / NMST cost the same as softmax."""
        B, T = targets.shape
        if self.kind == "softmax":
            return -F.cross_entropy(self.proj(h).flatten(0, 1), targets.flatten(), reduction="none").view(B, T), None
        e, W, bias = self.eos_id, self.proj.weight, self.proj.bias
        z_eos = h @ W[e] + (bias[e] if bias is not None else 0.0)  # (B, T)
        logits_rest = F.linear(h, torch.cat([W[:e], W[e + 1:]]),
                               None if bias is None else torch.cat([bias[:e], bias[e + 1:]]))  # (B, T, V-1)
        is_eos = targets == e
        rest_targets = torch.where(targets > e, targets - 1, targets).masked_fill(is_eos, 0)
        log_rest = -F.cross_entropy(logits_rest.flatten(0, 1), rest_targets.flatten(), reduction="none").view(B, T)
        if self.kind == "nmst":
            log_alpha, log_one_minus_alpha = nmst_log_alpha(z_eos, every_step(t, h), self.epsilon)
        else:
            log_alpha, log_one_minus_alpha, head_state = st_log_alpha(z_eos, t, self.epsilon, head_state)
        return torch.where(is_eos, log_alpha, log_one_minus_alpha + log_rest), head_state

    def extra_repr(self):
        eps = "" if self.kind == "softmax" else f", epsilon={self.epsilon:g}"
        return f"kind={self.kind}, eos_id={self.eos_id}{eps}"


def every_step(t, h):
    """t as a first-position step (int / (B,)) or per position ((B, T)) -> (B, T) (or (1, T))
    for h (B, T, ...)."""
    t = torch.as_tensor(t, device=h.device)
    if t.dim() < 2:
        t = t.reshape(-1, 1) + torch.arange(h.size(1), device=h.device)
    return t
