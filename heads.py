"""Output heads: how a language model turns a hidden state h_t into p(y_t | y_<t, x).

Papers and equations implemented here (each exactly once, next to a comment naming it):
  * Vanilla softmax (VA)                      NMST paper, eq. 2
  * Self-terminating (ST, Welleck et al. 2020) NMST paper, eq. 9
  * Non-monotonic self-terminating (NMST)     NMST paper, eq. 10
(Choi et al., "A Non-monotonic Self-terminating Language Model", ICLR 2023;
 ../shared/papers/nmst-non-monotonic-self-terminating-lm.txt)
  * Mixture of Softmaxes (MoS, Yang et al. 2018)   CT paper, eq. 4
  * Contextual temperature (CT)                    CT paper, eq. 5-6
  * CT-MoS                                         CT paper, eq. 7
  * loss scaling (LS)                              CT paper, eq. 8
(Wang et al., "Contextual Temperature for Language Modeling";
 ../shared/papers/contextual-temperature.txt)

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

HEADS = ("softmax", "st", "nmst", "mos", "ct", "ctmos")


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


def mos_log_probs(prior_logits, expert_logits):
    """MoS, CT paper eq. 4:  P(x_t) = sum_m pi_m softmax(z_m),  pi = softmax(W_p h).
    The mixture is taken in log space, log P = logsumexp_m (log pi_m + log_softmax(z_m)):
    no additive 1e-8 fudge, exact and finite.  CT-MoS (eq. 7) passes z_m / tau.
    prior_logits (..., K), expert_logits (..., K, V) -> log_probs (..., V)."""
    log_pi = F.log_softmax(prior_logits, dim=-1).unsqueeze(-1)  # (..., K, 1)
    return torch.logsumexp(log_pi + F.log_softmax(expert_logits, dim=-1), dim=-2)


def contextual_temperature(tau_logits, alpha=1.0, beta=0.5):
    """CT paper eq. 6:  tau = (softmax(h W_tau) + alpha) / beta, one temperature per vocabulary
    entry, in (alpha/beta, (1+alpha)/beta).  tau_logits (..., V) -> tau (..., V)."""
    return (torch.softmax(tau_logits, dim=-1) + alpha) / beta


def ct_log_probs(logits, tau):
    """CT paper eq. 5:  P(x_t) = softmax(z / tau), element-wise division.  -> (..., V)."""
    return F.log_softmax(logits / tau, dim=-1)


def loss_scale(vocab_size, alpha=1.0, beta=0.5):
    """CT paper eq. 8's LS factor, mean_i tau_i.  With the softmax-normalised tau of eq. 6 the
    softmax sums to 1 over the vocabulary, so mean_i tau_i = (1/V + alpha) / beta for every
    context: LS is a *constant* multiplier on the cross entropy (tests check the identity)."""
    return (1.0 / vocab_size + alpha) / beta


# ---------------------------------------------------------------------------------------------
# the output layer z = U h on CPU: the same numbers, computed in the order MKL is fastest at
# ---------------------------------------------------------------------------------------------
def project(h, W):
    """z = U h for every row of h (bias-free).  h (..., D), U = W (V, D) -> z (..., V).

    Decoding projects a few rows at a time (one per prompt / beam).  On CPU, MKL's sgemm is
    1.2-3.9x faster at the transposed product U h^T (V, M) than at h U^T (M, V) for 2..128
    rows (measured on this project's 2-core AMD box, V = 50257, D = 256: 2 rows 3.9x, 8 rows
    4.4 vs 10.1 ms, 128 rows 1.2x), so that product is computed and transposed back; elsewhere this is F.linear."""
    rows = h.numel() // max(h.size(-1), 1)
    if h.device.type != "cpu" or not 2 <= rows <= 128 or h.dtype != W.dtype:
        return F.linear(h, W)
    z_t = torch.mm(W, h.reshape(rows, h.size(-1)).t())  # (V, M)
    return z_t.t().contiguous().view(*h.shape[:-1], W.size(0))


LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


class LinearLogSoftmax(torch.autograd.Function):
    """log p(y) = z_y - log sum_v exp(z_v) with z = U h (NMST paper eq. 2, in log space), for one
    target per row, without ever holding (N, V) log-probabilities or their gradient.

    The vocabulary is walked in blocks of U's rows: each block's logits z_b = U_b h^T (V_b, N)
    are computed and, while still in cache, turned into e_b = exp(z_b - m) and summed, with one
    shift m per row (N,) for every block: the first block's row maxima.  A later block only
    moves the shift (an online logsumexp step) when its sum of e_b passes 2^64 (a logit ~44
    above m): so all blocks usually share one m and no block needs its own max.  e = exp(z - m)
    (V, N) is what is kept for the backward pass, where softmax = e exp(m - lse) enters the two
    matrix products (dL/dh = g^T U, dL/dU = g h), one product pair per run of blocks with the
    same shift, with the per-row factor exp(m - lse) times the incoming gradient applied on the
    small (N, D) side.  Everything is in base 2 (z' = U (h log2 e)^T, exp2), because exp2 is
    twice as fast as exp on CPU (0.36 vs 0.73 ms per 2^20 floats here).

    Against linear + cross_entropy (which writes logits, log-probs, a zero-filled one-hot
    gradient and the logits' gradient, each (N, V)) this takes 0.52 s instead of 0.63 s for
    N = 1024, D = 256, V = 50257, forward + backward, on the 2-core CPU, where the three matrix
    products alone take 0.48 s (`python bench.py train_hf --parts`, README).

    `exclude` drops one vocabulary entry from the normaliser: the non-eos factor
    exp(z_v) / sum_{v' != eos} exp(z_v') of eq. 9 / 10.  Targets must differ from `exclude`.
    h (N, D), W (V, D), targets (N,) -> log p(targets) (N,)."""

    block_elements = 1 << 20  # logits per vocabulary block: 4 MB in fp32, cache-sized
    max_log2_sum = 64.0  # a block whose sum of exp2(z' - m) passes 2^64 gets a new shift

    @staticmethod
    def forward(ctx, h, W, targets, exclude=None):
        N, V = h.size(0), W.size(0)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        block = min(V, max(1, LinearLogSoftmax.block_elements // max(N, 1)))
        kept = torch.empty(V, N, dtype=h.dtype, device=h.device) if keep else None  # e = exp(z - m)
        scratch = None if keep else torch.empty(block, N, dtype=h.dtype, device=h.device)
        h2 = h * LOG2E
        m, s = None, None  # shift (max of z' so far) and sum of exp2(z' - m), (N,) each
        runs = []  # (first vocabulary row, shift in natural-log units) of each run of blocks
        for v0 in range(0, V, block):
            v1 = min(v0 + block, V)
            out = kept[v0:v1] if keep else scratch[:v1 - v0]

            def logits():  # (V_b, N) = (h U_b^T)^T log2(e)
                z = torch.mm(W[v0:v1], h2.t(), out=out)
                if exclude is not None and v0 <= exclude < v1:
                    z[exclude - v0] = float("-inf")
                return z
            z_b = logits()
            if m is not None:  # the current shift, in place, while the block is in cache
                s_b = z_b.sub_(m).exp2_().sum(0)
                if bool((s_b <= 2.0 ** LinearLogSoftmax.max_log2_sum).all()):
                    s.add_(s_b)
                    continue
                z_b = logits()  # some logit is far above m: redo the block with a new shift
            m_new = z_b.amax(0) if m is None else torch.maximum(m, z_b.amax(0))
            s_b = z_b.sub_(m_new).exp2_().sum(0)
            s = s_b if m is None else s.mul_(torch.exp2(m - m_new)).add_(s_b)
            m = m_new
            runs.append((v0, m * LN2))
        lse = (m + torch.log2(s)) * LN2  # (N,)
        z_target = (h * W[targets]).sum(-1)  # (N,)
        if keep:
            ctx.save_for_backward(h, W, targets, kept, torch.stack([r[1] for r in runs]), lse)
            ctx.run_starts = [r[0] for r in runs] + [V]
        return z_target - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # grad (N,) = dL/dlog p(y)
        h, W, targets, kept, shifts, lse = ctx.saved_tensors
        need_h, need_W = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_W = torch.empty_like(W) if need_W else None
        starts = ctx.run_starts
        for r in range(len(starts) - 1):  # d log p(y) / dz = onehot(y) - softmax(z)
            v0, v1 = starts[r], starts[r + 1]
            # the softmax part, -grad * softmax = e * scale with scale = -grad * exp(m - lse) per
            # row of h: the scale goes on the (N, D) side of each product, never on e
            scale = torch.exp(shifts[r] - lse).mul_(-grad).unsqueeze(1)  # (N, 1)
            if need_h:
                grad_h.addcmul_(torch.mm(kept[v0:v1].t(), W[v0:v1]), scale)  # (N, D)
            if need_W:
                torch.mm(kept[v0:v1], h * scale, out=grad_W[v0:v1])  # (V_r, D)
        weighted = grad.unsqueeze(1)  # the one-hot part: + grad at (y, row)
        if need_h:
            grad_h.add_(weighted * W[targets])
        if need_W:
            grad_W.index_add_(0, targets, weighted * h)
        return grad_h, grad_W, None, None


def linear_log_softmax(h, W, targets, exclude=None, bias=None):
    """log softmax(U h + b)[targets] (over the vocabulary without `exclude` when given).
    h (..., D), W (V, D), targets (...) -> (...).  LinearLogSoftmax on CPU (bias-free, fp32 /
    fp64, not under torch.compile, which fuses the plain form itself); linear + cross_entropy
    elsewhere."""
    shape = targets.shape
    h2, y = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    if h.device.type == "cpu" and bias is None and h.dtype == W.dtype and y.numel() > 0 \
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu"):
        return LinearLogSoftmax.apply(h2.contiguous(), W, y, exclude).view(shape)
    logits = F.linear(h2, W, bias)  # (N, V)
    if exclude is not None:  # in place: linear's backward does not read its output
        logits[:, exclude] = float("-inf")
    return -F.cross_entropy(logits, y, reduction="none").view(shape)


# ---------------------------------------------------------------------------------------------
# nn.Module wrapper: owns the output projection U (V, D), optionally tied to the embedding
# ---------------------------------------------------------------------------------------------
class Head(nn.Module):
    """Output layer: h (B, T, D) -> log_probs (B, T, V).

    forward(h, t, head_state) returns (log_probs, new_head_state); the head state is the ST
    running `log_keep` (B,) and None for softmax / NMST.  t is the continuation step index of
    the first position (int or (B,) tensor) or of every position ((B, T) tensor)."""

    def __init__(self, kind, d_model, vocab_size, eos_id, epsilon=1e-5, bias=False, n_experts=1, ct_alpha=1.0,
                 ct_beta=0.5, ct_rank=0, temperature=1.0):
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"unknown head '{kind}' (choose from {', '.join(HEADS)})")
        if kind in ("st", "nmst"):
            _check_epsilon(epsilon)
        if n_experts < 1:
            raise ValueError(f"--n_experts must be >= 1, got {n_experts}")
        if not temperature > 0 or not ct_beta > 0 or ct_alpha < 0:
            raise ValueError("--temperature and --ct_beta must be > 0, --ct_alpha >= 0")
        if temperature != 1.0 and kind not in ("softmax", "mos"):
            raise ValueError(f"a constant --temperature is the baseline of the softmax / mos heads, not of {kind}")
        self.kind, self.eos_id, self.epsilon = kind, int(eos_id), float(epsilon)
        self.temperature, self.ct_alpha, self.ct_beta = float(temperature), float(ct_alpha), float(ct_beta)
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)  # U, the (tied) decoder
        if kind in ("mos", "ctmos"):  # MoS: prior W_p and per-expert latents tanh(W_k h)
            self.n_experts = n_experts
            self.prior = nn.Linear(d_model, n_experts, bias=False)
            self.latent = nn.Linear(d_model, n_experts * d_model)
        if kind in ("ct", "ctmos"):  # W_tau, optionally factorised W_tau1 W_tau2 (rank ct_rank)
            self.tau = nn.Linear(d_model, vocab_size) if ct_rank <= 0 else \
                nn.Sequential(nn.Linear(d_model, ct_rank, bias=False), nn.Linear(ct_rank, vocab_size))

    def temperatures(self, h):
        """The temperature vector tau (B, T, V) of the CT heads (CT paper eq. 6)."""
        return contextual_temperature(self.tau(h), self.ct_alpha, self.ct_beta)

    def _expert_logits(self, h):
        """MoS experts z_m = U tanh(W_m h): (B, T, K, V)."""
        B, T, D = h.shape
        latent = torch.tanh(self.latent(h)).view(B, T, self.n_experts, D)
        return self.proj(latent)

    def forward(self, h, t=1, head_state=None):
        """h (B, T, D) -> (log_probs (B, T, V), head_state)."""
        if self.kind == "mos":
            return mos_log_probs(self.prior(h), self._expert_logits(h) / self.temperature), None
        if self.kind == "ctmos":  # eq. 7: the same contextual tau divides every expert's logits
            return mos_log_probs(self.prior(h), self._expert_logits(h) / self.temperatures(h).unsqueeze(-2)), None
        logits = self.proj(h) if self.proj.bias is not None else project(h, self.proj.weight)  # (B, T, V)
        if self.kind == "ct":
            return ct_log_probs(logits, self.temperatures(h)), None
        if self.kind == "softmax":
            return softmax_log_probs(logits / self.temperature if self.temperature != 1.0 else logits), None
        if self.kind == "nmst":
            return nmst_log_probs(logits, every_step(t, h), self.eos_id, self.epsilon), None
        return st_log_probs(logits, t, self.eos_id, self.epsilon, head_state)

    def target_log_probs(self, h, targets, t=1, head_state=None):
        """log p(targets) only: the training / evaluation path.  Tests check it equals
        forward(...).gather(targets).  h (B, T, D), targets (B, T) -> (log_p (B, T), head_state).

        It never builds the (B, T, V) log-probabilities: on CPU every extra pass over them costs
        as much as the matrix product.  For ST / NMST the eos row of U is projected on its own
        (z_eos, (B, T)) and linear_log_softmax with eos left out of the normaliser gives the
        non-eos factor  exp(z_v) / sum_{v' != eos} exp(z_v')  of eq. 9 / 10; the eos part
        reuses nmst_log_alpha / st_log_alpha.  So ST / NMST cost the same as softmax; on CPU
        both run through LinearLogSoftmax."""
        if self.kind in ("mos", "ct", "ctmos"):  # mixtures / per-token temperatures: the full distribution
            return self(h, t)[0].gather(-1, targets.unsqueeze(-1)).squeeze(-1), None
        W, bias = self.proj.weight, self.proj.bias
        if self.kind == "softmax":  # a constant temperature c: z / c = U (h / c) + b / c
            c = self.temperature
            if c != 1.0:
                h, bias = h / c, (None if bias is None else bias / c)
            return linear_log_softmax(h, W, targets, bias=bias), None
        e = self.eos_id
        z_eos = h @ W[e] + (bias[e] if bias is not None else 0.0)  # (B, T)
        is_eos = targets == e  # those rows take log_alpha below: any non-eos stand-in target will do
        log_rest = linear_log_softmax(h, W, targets.masked_fill(is_eos, (e + 1) % W.size(0)), exclude=e, bias=bias)
        if self.kind == "nmst":
            log_alpha, log_one_minus_alpha = nmst_log_alpha(z_eos, every_step(t, h), self.epsilon)
        else:
            log_alpha, log_one_minus_alpha, head_state = st_log_alpha(z_eos, t, self.epsilon, head_state)
        return torch.where(is_eos, log_alpha, log_one_minus_alpha + log_rest), head_state

    def extra_repr(self):
        eps = f", epsilon={self.epsilon:g}" if self.kind in ("st", "nmst") else ""
        return f"kind={self.kind}, eos_id={self.eos_id}{eps}"


def every_step(t, h):
    """t as a first-position step (int / (B,)) or per position ((B, T)) -> (B, T) (or (1, T))
    for h (B, T, ...)."""
    t = torch.as_tensor(t, device=h.device)
    if t.dim() < 2:
        t = t.reshape(-1, 1) + torch.arange(h.size(1), device=h.device)
    return t
