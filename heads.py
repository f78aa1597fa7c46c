"""Output heads: how a language model turns a hidden state h_t into p(y_t | y_<t, x).

Papers and equations implemented here (each exactly once, next to a comment naming it):
  * Vanilla softmax (VA)                      NMST paper, eq. 2
  * Self-terminating (ST, Welleck et al. 2020) NMST paper, eq. 9
  * Non-monotonic self-terminating (NMST)     NMST paper, eq. 10
(Choi et al., "A Non-monotonic Self-terminating Language Model", ICLR 2023)
  * Mixture of Softmaxes (MoS, Yang et al. 2018)   CT paper, eq. 4
  * Contextual temperature (CT)                    CT paper, eq. 5-6
  * CT-MoS                                         CT paper, eq. 7
  * loss scaling (LS)                              CT paper, eq. 8
(Wang et al., "Contextual Temperature for Language Modeling", 2020)

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

`--protocol authors` (Head(..., authors=True)) is the objective of the code that made NMST
Table 1 (nyu-dl/non-monotonic-self-terminating-lm, src/wiki2/model_utils.py), whose loss does
score the context: its ST forces p(eos) = 0 there and floors every p at 1e-20, renormalised; its
NMST takes the context's log-bound as 1 and renormalises (docs/protocol.md).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

HEADS = ("softmax", "st", "nmst", "mos", "ct", "ctmos")
# The heads that model the end of a sequence: they read t.
TERMINATION_HEADS = ("st", "nmst")
# The heads with an epsilon (eq. 9, 10).
EPSILON_HEADS = ("st", "nmst")
PAPER_NAMES = dict(softmax="VA+", st="ST+", nmst="NMST+", mos="MoS", ct="CT", ctmos="CT-MoS")


def paper_name(head):
    """The papers' name of a head (NMST paper section 4, CT paper; a head of your own: its name
    in capitals)."""
    return PAPER_NAMES.get(head, head.upper())


def t_half(epsilon):
    """NMST Theorem 3: ST / NMST's p(eos) >= 1 - (1 - eps)^t passes 1/2 first at this t; from
    then on greedy decoding must end, and top-k / nucleus sampling ends a step with p > 1/2."""
    return math.ceil(math.log(2) / -math.log1p(-epsilon))


def padded(vocab_size):
    """The rows of the embedding and U: the vocabulary padded to a multiple of 64 (tensor-core
    shapes, as nanoGPT's 50304); the padding rows are never produced, decoded or normalised over."""
    return -(-vocab_size // 64) * 64


# --- numerics ---------------------------------------------------------------------------------
def log1mexp(a):
    """log(1 - exp(a)) for a <= 0, stable everywhere (Maechler 2012): two branches at -log 2."""
    a = torch.clamp(a, max=0.0)
    small = a > -math.log(2.0)
    # evaluate each branch only where it is accurate, and keep the other branch finite
    out_small = torch.log(-torch.expm1(torch.where(small, a, torch.full_like(a, -1.0))))
    out_large = torch.log1p(-torch.exp(torch.where(small, torch.full_like(a, -1.0), a)))
    return torch.where(small, out_small, out_large)


def _eos_precision(z_eos):
    """The eos terms of eq. 9 / 10 run in float32 at least, also under bf16 / fp16 autocast:
    there t (up to 1e6) and t * log(1 - eps) would be rounded (bf16 holds integers exactly only
    up to 256, so consecutive t would share one p(eos))."""
    return z_eos.to(torch.promote_types(z_eos.dtype, torch.float32))


# The authors' constants (their model_utils.py:58, 144): ST's floor on every p and on each factor
# of its product, and NMST's lower bound f_lb on the context.
LOG_FLOOR = math.log(1e-20)
LOG_NMST_CONTEXT_BOUND = math.log(1e-35)


# eps = 0 is the softmax's (no lower bound, no termination guarantee), eps = 1 ends at t = 1.
def _check_epsilon(epsilon):
    if not (0.0 < float(epsilon) < 1.0):
        raise ValueError(f"epsilon must lie in (0, 1), got {epsilon}")


# --- the three parametrizations (pure functions) ----------------------------------------------
def softmax_log_probs(logits):
    """VA, NMST paper eq. 2:  p(y_t = v) = exp(u_v^T h_t) / sum_v' exp(u_v'^T h_t).
    logits (..., V) -> log_probs (..., V)."""
    return F.log_softmax(logits, dim=-1)


def nmst_log_alpha(z_eos, t, epsilon, authors=False):
    """NMST, NMST paper eq. 10:
        alpha_t = (1 - sigma(z_eos)) * (1 - (1 - eps)^t) + sigma(z_eos)
    i.e. a convex combination, with weight sigma(z_eos), of the lower bound 1 - (1 - eps)^t and 1.
    In log space:
        log(1 - alpha_t) = logsigmoid(-z_eos) + t * log1p(-eps)
        log(alpha_t)     = logaddexp(logsigmoid(z_eos),
                                   logsigmoid(-z_eos) + log1mexp(t * log1p(-eps)))
    z_eos (...); t (...) the continuation step of each position (t <= 0: scored as t = 1, or
    with authors as the authors' code scores its context)
    -> (log_alpha, log_one_minus_alpha), each (...)."""
    _check_epsilon(epsilon)
    z_eos = _eos_precision(z_eos)
    t = torch.as_tensor(t, device=z_eos.device)
    # log (1 - eps)^t and log f_lb(t) = log(1 - (1 - eps)^t), the lower bound
    log_lower_keep = torch.clamp(t, min=1).to(z_eos.dtype) * math.log1p(-epsilon)
    log_lower = log1mexp(log_lower_keep)
    if authors:
        # The authors' context (their model_utils.py:155-160): the log-bound log (1 - eps)^t is
        # 1 there (not 0: 1 - alpha gets e (1 - sigma)) and the lower bound f_lb is 1e-35.
        context = t <= 0
        log_lower_keep = torch.where(context, 1.0, log_lower_keep)
        log_lower = torch.where(context, LOG_NMST_CONTEXT_BOUND, log_lower)
    log_one_minus_alpha = F.logsigmoid(-z_eos) + log_lower_keep
    log_alpha = torch.logaddexp(F.logsigmoid(z_eos), F.logsigmoid(-z_eos) + log_lower)
    if not authors:
        return log_alpha, log_one_minus_alpha
    # Their model_utils.py:190 renormalises every row; only a context row sums to other than 1
    # (the non-eos factor sums to 1), so its normaliser is 1 - alpha + alpha.
    log_z = torch.where(context, torch.logaddexp(log_alpha, log_one_minus_alpha), 0.0)
    return log_alpha - log_z, log_one_minus_alpha - log_z


def st_log_alpha(z_eos, t, epsilon, log_keep=None, authors=False):
    """ST, NMST paper eq. 9 (Welleck et al. 2020):
        alpha_t = 1 - prod_{t'=1}^{t} (1 - eps) * sigma(z_eos,t')
    so log(1 - alpha_t) = log_keep_t = sum_{t'<=t} [log1p(-eps) + logsigmoid(z_eos,t')] and
    log(alpha_t) = log1mexp(log_keep_t).

    z_eos (..., T) over *consecutive* positions, t (..., T) the step of every position (the
    batch makes it: data/loader.py collate, decode.py).  log_keep (...,) is the running sum
    *before* the first position (None = empty product).  Positions with t <= 0 (context,
    padding) get a fresh one-term product and do not enter the running sum (authors: p(eos) = 0
    there, and each factor floored at 1e-20).
    -> (log_alpha (..., T), log_one_minus_alpha (..., T), log_keep (...,) after the last)."""
    _check_epsilon(epsilon)
    z_eos = _eos_precision(z_eos)
    t = t.expand(z_eos.shape)
    # log((1 - eps) sigma(z_eos,t')), one factor of the product
    term = math.log1p(-epsilon) + F.logsigmoid(z_eos)
    if authors:
        # Their model_utils.py:78 floors each factor: beta = max((1 - eps) sigma(z_eos), 1e-20).
        term = torch.clamp(term, min=LOG_FLOOR)
    in_continuation = t >= 1
    if log_keep is None:
        log_keep = torch.zeros(z_eos.shape[:-1], dtype=z_eos.dtype, device=z_eos.device)
    running = log_keep.unsqueeze(-1) + torch.cumsum(torch.where(in_continuation, term, 0.0), -1)
    log_one_minus_alpha = torch.where(in_continuation, running, term)
    log_alpha = log1mexp(log_one_minus_alpha)
    if authors:
        # Their model_utils.py:80-82 sets beta = 1 on the context: p(eos) = 0 (log: -inf, a
        # constant, so that no gradient reaches log1mexp(0)) and 1 - alpha = 1.
        log_alpha = torch.where(in_continuation, log_alpha, -math.inf)
        log_one_minus_alpha = torch.where(in_continuation, running, 0.0)
    return log_alpha, log_one_minus_alpha, running[..., -1]


def authors_floor(log_probs):
    """The authors' ST smoothing (their model_utils.py:100-101): every p clamped at 1e-20, then
    the row renormalised, Z = sum_v max(p_v, 1e-20).  A target below the floor scores
    log(1e-20 / Z) and passes no gradient of its own.  log_probs (..., V) -> (..., V)."""
    floored = torch.clamp(log_probs, min=LOG_FLOOR)
    return floored - torch.logsumexp(floored, dim=-1, keepdim=True)


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
    return torch.where(
        is_eos, log_alpha.unsqueeze(-1), log_one_minus_alpha.unsqueeze(-1) + log_rest
    )


def nmst_log_probs(logits, t, eos_id, epsilon, authors=False):
    """NMST (eq. 10) log-probabilities.  logits (..., V), t (...) -> (..., V)."""
    return _assemble(logits, eos_id, *nmst_log_alpha(logits[..., eos_id], t, epsilon, authors))


def st_log_probs(logits, t, eos_id, epsilon, log_keep=None, authors=False):
    """ST (eq. 9) log-probabilities.  logits (..., T, V), t (..., T), log_keep as in st_log_alpha
    -> (log_probs (..., T, V), log_keep (...,) after the last position)."""
    log_alpha, log_one_minus_alpha, log_keep = st_log_alpha(
        logits[..., eos_id], t, epsilon, log_keep, authors
    )
    log_probs = _assemble(logits, eos_id, log_alpha, log_one_minus_alpha)
    if authors:
        log_probs = authors_floor(log_probs)
    return log_probs, log_keep


def mos_log_probs(prior_logits, expert_logits):
    """MoS, CT paper eq. 4:  P(x_t) = sum_m pi_m softmax(z_m),  pi = softmax(W_p h).
    The mixture is taken in log space, log P = logsumexp_m (log pi_m + log_softmax(z_m)):
    no additive 1e-8 fudge, exact and finite.  CT-MoS (eq. 7) passes z_m / tau.
    prior_logits (..., K), expert_logits (..., K, V) -> log_probs (..., V)."""
    log_pi = F.log_softmax(prior_logits, dim=-1).unsqueeze(-1)  # (..., K, 1)
    return torch.logsumexp(log_pi + F.log_softmax(expert_logits, dim=-1), dim=-2)


def contextual_temperature(tau_logits, alpha, beta):
    """CT paper eq. 6:  tau = (softmax(h W_tau) + alpha) / beta, one temperature per vocabulary
    entry, in (alpha/beta, (1+alpha)/beta).  tau_logits (..., V) -> tau (..., V)."""
    return (torch.softmax(tau_logits, dim=-1) + alpha) / beta


def ct_log_probs(logits, tau):
    """CT paper eq. 5:  P(x_t) = softmax(z / tau), element-wise division.  -> (..., V)."""
    return F.log_softmax(logits / tau, dim=-1)


def loss_scale(vocab_size, alpha, beta):
    """CT paper eq. 8's LS factor, mean_i tau_i.  With the softmax-normalised tau of eq. 6 the
    softmax sums to 1 over the vocabulary, so mean_i tau_i = (1/V + alpha) / beta for every
    context: LS is a *constant* multiplier on the cross entropy (tests check the identity)."""
    return (1.0 / vocab_size + alpha) / beta


# --- the loss path: log p(target) without the (B, T, V) log-probabilities ---------------------
def log_softmax_at(h, W, targets, V, exclude=None, bias=None):
    """log softmax(U h + b)[targets] over the V real rows of U, without `exclude` when it is
    given (the non-eos factor of eq. 9 / 10).  The textbook way: linear, then cross_entropy.
    h (..., D), W (padded(V), D), targets (...) -> (...)."""
    logits = F.linear(h, W, bias)  # (..., padded(V))
    # The padding rows (and `exclude`) get -inf: no mass.  The fill is not recorded: a -inf
    # logit's gradient is 0 and linear's backward does not read its output, whereas a recorded
    # fill would copy the whole gradient.
    with torch.no_grad():
        logits[..., V:] = float("-inf")
        if exclude is not None:
            logits[..., exclude] = float("-inf")
    return -F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(
        targets.shape
    )


def rows_of(x, rows):
    """x (B, T, ...) at the flat positions `rows` (N,) of its (B * T) -> (N, ...); None: x."""
    return x if rows is None else x.flatten(0, 1)[rows]


def scattered(values, rows, shape):
    """values (N,) of the flat positions `rows` -> (B, T) = shape, 0 elsewhere; None: values."""
    if rows is None:
        return values
    return values.new_zeros(shape.numel()).index_copy(0, rows, values).view(shape)


# --- nn.Module wrapper: owns the output projection U (V, D), optionally tied to the embedding ---
def check_head_options(kind, epsilon, temperature):
    """A head's options (ranges: train.py's flags), each read only by the heads that use it."""
    if kind not in HEADS:
        raise ValueError(f"unknown head '{kind}' (choose from {', '.join(HEADS)})")
    # eq. 9, 10: epsilon in (0, 1)
    if kind in EPSILON_HEADS:
        _check_epsilon(epsilon)
    if temperature != 1.0 and kind not in ("softmax", "mos"):
        raise ValueError(
            f"a constant --temperature is the baseline of the softmax / mos heads, not of {kind}"
        )


HEAD_OPTIONS = dict(
    bias=False, n_experts=1, ct_alpha=None, ct_beta=None, ct_rank=0, temperature=1.0, authors=False
)


class Head(nn.Module):
    """Output layer: h (B, T, D) -> log_probs (B, T, V).

    forward(h, t, head_state) returns (log_probs, new_head_state); the head state is the ST
    running `log_keep` (B,) and None for the others.  t (B, T) is the continuation step of every
    position (only ST / NMST read it; None is fine for the others)."""

    def __init__(self, kind, d_model, vocab_size, eos_id, epsilon=None, **options):
        """options (HEAD_OPTIONS gives their defaults): bias (of U), n_experts (MoS), ct_alpha,
        ct_beta and ct_rank (CT), a constant temperature, authors (ST / NMST as the authors'
        code computes them: --protocol authors)."""
        super().__init__()
        unknown = set(options) - set(HEAD_OPTIONS)
        if unknown:
            raise TypeError(f"Head() got unknown options: {', '.join(sorted(unknown))}")
        o = dict(HEAD_OPTIONS, **options)
        check_head_options(kind, epsilon, o["temperature"])
        self.kind, self.eos_id, self.epsilon = kind, int(eos_id), epsilon
        self.temperature = float(o["temperature"])
        self.authors = bool(o["authors"])
        self.ct_alpha, self.ct_beta = o["ct_alpha"], o["ct_beta"]
        # U, the (tied) decoder
        self.proj = nn.Linear(d_model, padded(vocab_size), bias=o["bias"])
        self.vocab_size = vocab_size  # U's rows past it are padding, sliced off (padded)
        # MoS: prior W_p and per-expert latents tanh(W_k h)
        if kind in ("mos", "ctmos"):
            self.n_experts = o["n_experts"]
            self.prior = nn.Linear(d_model, self.n_experts, bias=False)
            self.latent = nn.Linear(d_model, self.n_experts * d_model)
        # CT: W_tau, optionally factorised as W_tau1 W_tau2 of rank ct_rank.
        ct_rank = o["ct_rank"]
        if kind in ("ct", "ctmos") and ct_rank <= 0:
            self.tau = nn.Linear(d_model, vocab_size)
        elif kind in ("ct", "ctmos"):
            self.tau = nn.Sequential(
                nn.Linear(d_model, ct_rank, bias=False), nn.Linear(ct_rank, vocab_size)
            )

    def temperatures(self, h):
        """The temperature vector tau (B, T, V) of the CT heads (CT paper eq. 6)."""
        return contextual_temperature(self.tau(h), self.ct_alpha, self.ct_beta)

    def _expert_logits(self, h):
        """MoS experts z_m = U tanh(W_m h): h (..., D) -> (..., K, V)."""
        latent = torch.tanh(self.latent(h)).unflatten(-1, (self.n_experts, h.size(-1)))
        return self.proj(latent)[..., : self.vocab_size]

    def _needs_t(self, t):
        if self.kind in TERMINATION_HEADS and t is None:
            raise ValueError(f"the {self.kind} head needs the continuation step t of each position")

    def forward(self, h, t=None, head_state=None):
        """h (B, T, D), t (B, T) -> (log_probs (B, T, V), head_state)."""
        self._needs_t(t)
        if self.kind == "mos":
            return mos_log_probs(self.prior(h), self._expert_logits(h) / self.temperature), None
        # eq. 7: the same contextual tau divides every expert's logits
        if self.kind == "ctmos":
            tau = self.temperatures(h).unsqueeze(-2)
            return mos_log_probs(self.prior(h), self._expert_logits(h) / tau), None
        # The real rows of U only: the padding rows are no tokens.
        logits = self.proj(h)[..., : self.vocab_size]  # (B, T, V)
        if self.kind == "ct":
            return ct_log_probs(logits, self.temperatures(h)), None
        if self.kind == "softmax":
            # A constant temperature c: no division at c = 1 (decoding).
            if self.temperature != 1:
                logits = logits / self.temperature
            return softmax_log_probs(logits), None
        if self.kind == "nmst":
            return nmst_log_probs(logits, t, self.eos_id, self.epsilon, self.authors), None
        if self.kind == "st":
            return st_log_probs(logits, t, self.eos_id, self.epsilon, head_state, self.authors)
        raise ValueError(f"Head.forward has no branch for the head {self.kind!r}")

    def target_log_probs(self, h, targets, t=None, head_state=None, rows=None):
        """log p(targets) only: the training / evaluation path.  Tests check it equals
        forward(...).gather(targets).  h (B, T, D), targets (B, T), t (B, T), rows (N,) the flat
        positions whose targets count (None: all) -> (log_p (B, T), 0 off rows; head_state).
        U h and its normaliser run on the rows alone; the eos terms keep the (B, T) layout.

        Softmax: log_softmax_at, with a constant temperature c as z / c = U (h / c) + b / c.
        ST / NMST: the eos row of U is projected on its own (z_eos, (B, T)) and log_softmax_at
        with eos left out of the normaliser gives the non-eos factor
        exp(z_v) / sum_{v' != eos} exp(z_v') of eq. 9 / 10; the eos part is nmst_log_alpha /
        st_log_alpha.  So ST / NMST cost what softmax costs (python bench.py train)."""
        self._needs_t(t)
        h_rows = rows_of(h, rows)  # (N, D); without rows: h (B, T, D)
        if self.kind in ("mos", "ct", "ctmos"):  # mixtures, per-token temperatures: the full rows
            log_p = self(h_rows)[0].gather(-1, rows_of(targets, rows).unsqueeze(-1)).squeeze(-1)
            return scattered(log_p, rows, targets.shape), None
        W, bias = self.proj.weight, self.proj.bias
        if self.kind == "softmax":
            c = self.temperature
            if c != 1.0:
                h_rows = h_rows / c
            if c != 1.0 and bias is not None:
                bias = bias / c
            log_p = log_softmax_at(h_rows, W, rows_of(targets, rows), self.vocab_size, None, bias)
            return scattered(log_p, rows, targets.shape), None
        e = self.eos_id
        z_eos = h @ W[e] + (bias[e] if bias is not None else 0.0)  # (B, T)
        # The authors' ST: its floor renormalises over every entry of the row, so the full rows.
        if self.kind == "st" and self.authors:
            alphas = st_log_alpha(z_eos, t, self.epsilon, head_state, True)
            return self._floored_at(h_rows, targets, rows, alphas)
        # The eos targets take log_alpha below: any non-eos stand-in target will do for them.
        is_eos = targets == e
        stand_in = rows_of(targets.masked_fill(is_eos, (e + 1) % self.vocab_size), rows)
        log_rest = log_softmax_at(h_rows, W, stand_in, self.vocab_size, e, bias)
        log_rest = scattered(log_rest, rows, targets.shape)  # (B, T)
        if self.kind == "nmst":
            log_alpha, log_one_minus_alpha = nmst_log_alpha(z_eos, t, self.epsilon, self.authors)
        elif self.kind == "st":
            log_alpha, log_one_minus_alpha, head_state = st_log_alpha(
                z_eos, t, self.epsilon, head_state
            )
        else:
            raise ValueError(f"Head.target_log_probs has no branch for the head {self.kind!r}")
        return torch.where(is_eos, log_alpha, log_one_minus_alpha + log_rest), head_state

    def _floored_at(self, h_rows, targets, rows, alphas):
        """The authors' ST (st_log_probs, authors) at the rows, alphas = st_log_alpha's output
        along the sequence (B, T).  -> (log_p (B, T), 0 off rows; log_keep)."""
        logits = self.proj(h_rows)[..., : self.vocab_size]  # (N, V)
        log_alpha, log_one_minus_alpha = (rows_of(a, rows) for a in alphas[:2])
        log_probs = authors_floor(_assemble(logits, self.eos_id, log_alpha, log_one_minus_alpha))
        log_p = log_probs.gather(-1, rows_of(targets, rows).unsqueeze(-1)).squeeze(-1)
        return scattered(log_p, rows, targets.shape), alphas[2]
