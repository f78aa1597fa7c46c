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


def _step_index(t, like):
    """t (int or tensor broadcastable to like.shape[:-1]) -> float tensor of steps, clamped to >= 1."""
    t = torch.as_tensor(t, device=like.device)
    return torch.clamp(t, min=1).to(like.dtype).expand(like.shape[:-1])


def _assemble(logits, eos_id, log_alpha, log_one_minus_alpha):
    """Shared by eq. 9 and eq. 10: put p(eos) = alpha_t at eos_id and spread (1 - alpha_t) over
    the other tokens with a softmax that excludes eos:
        p(v) = (1 - alpha_t) * exp(z_v) / sum_{v' != eos} exp(z_v'),   v != eos.
    logits (..., V); log_alpha, log_one_minus_alpha (...)  ->  log_probs (..., V)."""
    V = logits.size(-1)
    is_eos = torch.arange(V, device=logits.device) == eos_id  # (V,)
    z_rest = logits.masked_fill(is_eos, float("-inf"))
    log_softmax_rest = z_rest - torch.logsumexp(z_rest, dim=-1, keepdim=True)  # -inf at eos
    out = log_one_minus_alpha.unsqueeze(-1) + log_softmax_rest
    return torch.where(is_eos, log_alpha.unsqueeze(-1), out)


# ---------------------------------------------------------------------------------------------
# the three parametrizations (pure functions)
# ---------------------------------------------------------------------------------------------
def softmax_log_probs(logits):
    """VA, NMST paper eq. 2:  p(y_t = v) = exp(u_v^T h_t) / sum_v' exp(u_v'^T h_t).
    logits (..., V) -> log_probs (..., V)."""
    return F.log_softmax(logits, dim=-1)


def nmst_log_probs(logits, t, eos_id, epsilon):
    """NMST, NMST paper eq. 10:
        alpha_t = (1 - sigma(z_eos)) * (1 - (1 - eps)^t) + sigma(z_eos)
    i.e. a convex combination, with weight sigma(z_eos), of the lower bound 1 - (1 - eps)^t and 1.
    In log space:
        log(1 - alpha_t) = logsigmoid(-z_eos) + t * log1p(-eps)
        log(alpha_t)     = logaddexp(logsigmoid(z_eos), logsigmoid(-z_eos) + log1mexp(t*log1p(-eps)))
    logits (..., V); t int or tensor broadcastable to (...) (t <= 0: scored as t = 1)
    -> log_probs (..., V)."""
    _check_epsilon(epsilon)
    t = _step_index(t, logits)
    z_eos = logits[..., eos_id]
    log_lower_keep = t * math.log1p(-epsilon)  # log (1 - eps)^t, (...)
    log_one_minus_alpha = F.logsigmoid(-z_eos) + log_lower_keep
    log_alpha = torch.logaddexp(F.logsigmoid(z_eos), F.logsigmoid(-z_eos) + log1mexp(log_lower_keep))
    return _assemble(logits, eos_id, log_alpha, log_one_minus_alpha)


def st_log_probs(logits, t, eos_id, epsilon, log_keep=None):
    """ST, NMST paper eq. 9 (Welleck et al. 2020):
        alpha_t = 1 - prod_{t'=1}^{t} (1 - eps) * sigma(z_eos,t')
    so log(1 - alpha_t) = log_keep_t = sum_{t'<=t} [log1p(-eps) + logsigmoid(z_eos,t')] and
    log(alpha_t) = log1mexp(log_keep_t).

    logits (B, T, V) (or (..., T, V)) over *consecutive* steps; t is the step index of each
    position: an int (step of the first position, later positions t+1, t+2, ...), a (...,)
    tensor of first-position steps per sequence, or a (..., T) tensor giving every position's
    step.  log_keep (...,) is the running sum *before* the first position (None = empty product).
    Positions with t <= 0 (context) are scored with a fresh one-term product and do not enter
    the running sum.
    -> (log_probs (..., T, V), log_keep (...,) after the last position)."""
    _check_epsilon(epsilon)
    T = logits.size(-2)
    t = torch.as_tensor(t, device=logits.device)
    if t.dim() == 0 or t.dim() < logits.dim() - 1 or t.size(-1) != T:
        # a first-position step (scalar or per-sequence): positions are t, t+1, ..., t+T-1
        t = t.unsqueeze(-1) + torch.arange(T, device=logits.device)
    t = t.expand(logits.shape[:-1])
    z_eos = logits[..., eos_id]  # (..., T)
    term = math.log1p(-epsilon) + F.logsigmoid(z_eos)  # log((1-eps) sigma(z_eos,t')), (..., T)
    in_continuation = t >= 1
    if log_keep is None:
        log_keep = torch.zeros(logits.shape[:-2], dtype=logits.dtype, device=logits.device)
    running = log_keep.unsqueeze(-1) + torch.cumsum(torch.where(in_continuation, term, 0.0), dim=-1)
    log_one_minus_alpha = torch.where(in_continuation, running, term)
    log_alpha = log1mexp(log_one_minus_alpha)
    return _assemble(logits, eos_id, log_alpha, log_one_minus_alpha), running[..., -1]


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
        logits = self.proj(h)  # (B, T, V)
        if self.kind == "softmax":
            return softmax_log_probs(logits), None
        if self.kind == "nmst":
            t = torch.as_tensor(t, device=h.device)
            if t.dim() < 2:  # first-position step -> every position's step, (B, T)
                t = t.reshape(-1, 1) + torch.arange(h.size(1), device=h.device)
            return nmst_log_probs(logits, t, self.eos_id, self.epsilon), None
        return st_log_probs(logits, t, self.eos_id, self.epsilon, head_state)

    def extra_repr(self):
        eps = "" if self.kind == "softmax" else f", epsilon={self.epsilon:g}"
        return f"kind={self.kind}, eos_id={self.eos_id}{eps}"
