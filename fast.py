"""CPU fast paths, each beside the reference it replaces, the way nanoGPT keeps `self.flash`
beside its hand-written attention.  The textbook files (heads.py, model.py) compute everything
the plain way; each switch below puts one fast path in, at one visible line of theirs:

    FUSED_OUTPUT_LAYER   heads.Head.target_log_probs: the output layer and log-softmax as one
                         blocked autograd function (LinearLogSoftmax) instead of linear +
                         cross_entropy, which write (N, V) logits, log-probs and gradients
    FEW_ROW_PROJECTION   heads.Head.forward: decoding's few-row projection computed as U h^T,
                         the orientation MKL is faster at for a handful of rows
    KEEP_FREED_MEMORY    train.py / evaluate.py on CPU: glibc keeps freed memory instead of
                         mmap-ing every large tensor anew (tune_cpu_allocator)

Each is tested against its reference (tests/test_fast.py) and kept only while
`python bench.py fast` shows it pays; the README has the figures (two earlier ones, dropout
masks from 32-bit integers and sdpa's math path with them, no longer paid and were removed).
Elsewhere (CUDA, autocast, torch.compile, mixed dtypes) the reference path runs.
"""
import math

import torch

FUSED_OUTPUT_LAYER = True
FEW_ROW_PROJECTION = True
KEEP_FREED_MEMORY = True


def eager_cpu(x):
    """The fast paths are hand-scheduled for eager CPU execution only."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# the output layer + log-softmax (training and perplexity)
# ---------------------------------------------------------------------------------------------
def fused_applies(h, W, bias):
    return eager_cpu(h) and bias is None and h.dtype == W.dtype and h.numel() > 0 \
        and not torch.is_autocast_enabled("cpu")


LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


class LinearLogSoftmax(torch.autograd.Function):
    """log p(y) = z_y - log sum_v exp(z_v) with z = U h (NMST paper eq. 2, in log space), for one
    target per row, without ever holding (N, V) log-probabilities or their gradient.

    The vocabulary is walked in blocks of U's rows: each block's logits z_b = U_b h^T (V_b, N)
    are computed and, while still in cache, turned into e_b = exp(z_b - m) and summed, with one
    shift m per row (N,) for every block: the first block's row maxima.  A later block only
    moves the shift (an online logsumexp step) when its sum of e_b passes 2^64 (a logit ~44
    above m), so the blocks usually share one m.  e = exp(z - m) (V, N) is kept for the backward
    pass, where softmax = e exp(m - lse) enters the two matrix products (dL/dh = g^T U,
    dL/dU = g h), one pair per run of blocks with the same shift, with the per-row factor
    applied on the small (N, D) side.  Everything is in base 2 (exp2 is cheaper than exp on
    CPU).  `python bench.py fast` times it against linear + cross_entropy and against the three
    matrix products any output layer must run.

    `exclude` drops one vocabulary entry from the normaliser: the non-eos factor
    exp(z_v) / sum_{v' != eos} exp(z_v') of NMST eq. 9 / 10.  Targets must differ from it.
    h (N, D), W (V, D), targets (N,) -> log p(targets) (N,)."""

    block_elements = 1 << 20  # logits per vocabulary block: 4 MB in fp32, cache-sized
    max_log2_sum = 64.0  # a block whose sum of exp2(z' - m) passes 2^64 gets a new shift

    @staticmethod
    def forward(ctx, h, W, targets, exclude=None):
        N, V = h.size(0), W.size(0)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        block = min(V, max(1, LinearLogSoftmax.block_elements // max(N, 1)))
        kept = torch.empty(V, N, dtype=h.dtype) if keep else None  # e = exp(z - m)
        scratch = None if keep else torch.empty(block, N, dtype=h.dtype)
        h2 = h * LOG2E
        m, s, runs = None, None, []  # shift, sum of exp2(z' - m) (N,); (first row, shift) per run
        for v0 in range(0, V, block):
            v1 = min(v0 + block, V)
            out = kept[v0:v1] if keep else scratch[:v1 - v0]
            z_b = _block_logits(W, h2, v0, v1, out, exclude)
            if m is not None:  # the current shift, in place, while the block is in cache
                s_b = z_b.sub_(m).exp2_().sum(0)
                if bool((s_b <= 2.0 ** LinearLogSoftmax.max_log2_sum).all()):
                    s.add_(s_b)
                    continue
                z_b = _block_logits(W, h2, v0, v1, out, exclude)  # a logit far above m: new shift
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
            # -grad * softmax = e * scale, scale = -grad * exp(m - lse) per row of h: applied on
            # the (N, D) side of each product, never on e
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


def _block_logits(W, h2, v0, v1, out, exclude):
    """(V_b, N) = (h U_b^T)^T log2(e), eos set to -inf when it is excluded from the normaliser."""
    z = torch.mm(W[v0:v1], h2.t(), out=out)
    if exclude is not None and v0 <= exclude < v1:
        z[exclude - v0] = float("-inf")
    return z


def linear_log_softmax(h, W, targets, exclude=None, bias=None):
    """heads.log_softmax_at, fused (bias-free: see fused_applies).
    h (..., D), W (V, D), targets (...) -> (...)."""
    assert bias is None, "the fused output layer has no bias"
    shape = targets.shape
    h2 = h.reshape(-1, h.size(-1)).contiguous()
    return LinearLogSoftmax.apply(h2, W, targets.reshape(-1), exclude).view(shape)


# ---------------------------------------------------------------------------------------------
# the few-row projection (decoding)
# ---------------------------------------------------------------------------------------------
FEW_ROWS = (2, 128)  # the row counts where U h^T beats h U^T here (README: the sweep)


def few_rows(h, W, bias):
    rows = h.numel() // max(h.size(-1), 1)
    return eager_cpu(h) and bias is None and h.dtype == W.dtype and \
        FEW_ROWS[0] <= rows <= FEW_ROWS[1]


def project(h, W):
    """z = U h for a few rows, computed as (U h^T)^T.  h (..., D), W (V, D) -> (..., V)."""
    rows = h.numel() // h.size(-1)
    z_t = torch.mm(W, h.reshape(rows, h.size(-1)).t())  # (V, M)
    return z_t.t().contiguous().view(*h.shape[:-1], W.size(0))


# ---------------------------------------------------------------------------------------------
# the allocator
# ---------------------------------------------------------------------------------------------
def tune_cpu_allocator():
    """Keep freed memory in glibc's heap instead of mmap/munmap-ing every large tensor, which
    page-faults each (N, V) logits tensor in anew (python bench.py fast measures it)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: never serve malloc by mmap
        libc.mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD: do not hand the heap top back eagerly
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass
