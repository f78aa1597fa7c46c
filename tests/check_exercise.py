"""Grades a coursework exercise (docs/exercises.md) on the code of a nanogen folder:

    python -m tests.check_exercise 1        (or 2, 3; --root FOLDER grades the code there)

Each check prints `ok` or `FAIL` and, when it fails, the input where it failed, the expected and
the found value.  The exit status is 0 when every check passes, 1 when one fails, 2 when the
folder holds no nanogen code.  The checks grade what the code does, not how it is written:

  1. the head "logt", alpha_t = sigmoid(z_eos + w log t): its names; the formula in float64 at
     w = -1.5, 0.5 and 2, through Head.forward and Head.target_log_probs too; finite and exact in
     float32 at eos logits up to +-100 and t up to 10^6; p(eos) in float32 under bf16 autocast (a
     GPU's numerics, reproduced on the CPU); t an integer or a float tensor or a Python int; w an
     nn.Parameter that starts at 0, each head's and each model's own, learned in a short run.
  2. the decoder "typical" against locally typical sampling (Meister et al. 2022) in float64, on
     random, flat and peaked rows, rows with -inf log-probs, temperatures near 0 and ties at the
     threshold p; its --p checked; its draws in decode() at the reference's frequencies.
  3. the dilated gated CNN: its names; causal, with the receptive field's edge at exactly
     (k - 1)(2^n_layer - 1) + 1 tokens; its cached state after right-padded prompts and after
     reorder_state giving what a full forward gives.

tests/test_check_exercise.py holds the wrong answers each check must catch."""

import argparse
import contextlib
import importlib
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules of a nanogen folder: those a check imports come from the graded folder, and
# the checker's own (of this tree) are put back afterwards.
PROJECT = ("heads", "model", "decode", "train", "evaluate", "insnet", "curves", "data", "common")
PROJECT += ("sample", "reproduce", "bench")
# The modules the checks import: a folder without them holds no nanogen code to grade.
NEEDED = ("heads.py", "model.py", "decode.py", "train.py", "common.py")
# w = 0, the head's initial value, would hide a wrong use of log t.
W_VALUES = (-1.5, 0.5, 2.0)
# Context and padding positions (t <= 0), the first steps, and t as far as decoding reaches.
T_VALUES = (-3, 0, 1, 2, 3, 7, 1000, 10**6 + 1)
# Eos logits as far as the heads promise finite log-probs (heads.py: logits up to +-100).
Z_EXTREMES = (-100.0, -60.0, -20.0, -1.0, 0.0, 1.0, 20.0, 60.0, 100.0)


@contextlib.contextmanager
def code_of(root):
    """The project's modules imported from root while the block runs; those imported before are
    put back afterwards (the checker's own tests grade copies of the code in one process)."""
    # A module imported before (this tree's, or an earlier graded folder's) must not answer
    # for root's.
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in PROJECT}
    saved_path = list(sys.path)
    for name in saved:
        del sys.modules[name]
    # Only root's code is graded: no other folder on the path (the working directory, this
    # tree) may lend it a module it lacks.
    others = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.curdir, "heads.py"))]
    sys.path[:] = [root, *others]
    # A folder made since the interpreter started is found only with fresh caches.
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in [n for n in sys.modules if n.split(".")[0] in PROJECT]:
            del sys.modules[name]
        sys.modules.update(saved)


def fmt(x):
    """A number of a message: 6 significant digits (ints, -inf and nan as they are)."""
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def compare(found, expected, what, rtol=1e-5, **inputs):
    """found against the float64 reference `expected` (same shape), each element within rtol of
    it relative to 1 + |expected| (equal infinities pass), else an AssertionError naming the
    worst element's inputs (inputs: name -> a tensor broadcastable to expected's shape, or a
    number), the expected and the found value."""
    # A relative error to 1 + |expected|: absolute near 0, relative for log-probs of -100.
    found = torch.as_tensor(found).detach().double()
    if found.shape != expected.shape:
        shapes = f"expected shape {tuple(expected.shape)}, found {tuple(found.shape)}"
        raise AssertionError(f"{what}: {shapes}")
    err = ((found - expected).abs() / (1 + expected.abs())).masked_fill(found == expected, 0.0)
    # NaN anywhere, or a finite value where an infinity is expected: the worst there can be.
    err = err.nan_to_num(nan=math.inf).flatten()
    worst = int(err.argmax())
    if not err[worst] > rtol:
        return
    # The worst element's inputs, as the student would pass them.
    at = []
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.broadcast_to(expected.shape).flatten()[worst]
        at.append(f"{name} = {fmt(value)}")
    e, f = expected.flatten()[worst].item(), found.flatten()[worst].item()
    # As many digits as tell the two apart: a float32 rounding shows at the 8th only.
    digits = next((d for d in (6, 10) if f"{e:.{d}g}" != f"{f:.{d}g}"), 17)
    raise AssertionError(
        f"{what} at {', '.join(at)}: expected {e:.{digits}g}, found {f:.{digits}g}"
    )


def call(what, function, *args, **kwargs):
    """function(*args, **kwargs), an exception of the graded code turned into a finding that
    names the call."""
    # The graded code may raise anything: the finding names the call that raised it.
    try:
        return function(*args, **kwargs)
    except Exception as e:
        raise AssertionError(f"{what}: expected a result, found {type(e).__name__}: {e}") from e


# --- exercise 1: the head "logt" --------------------------------------------------------------
def logt_a(z_eos, t, w):
    """The reference's argument a = z_eos + w log t in float64, t <= 0 read as t = 1:
    log alpha_t = logsigmoid(a), log(1 - alpha_t) = logsigmoid(-a)."""
    # Float64 from whatever the check passes (a float32 z_eos is taken at its exact value).
    t = torch.as_tensor(t).clamp(min=1).double()
    return torch.as_tensor(z_eos).double() + w * torch.log(t)


def compare_log_alpha(found, z_eos, t, w, what, rtol=1e-5):
    """logt_log_alpha's (log alpha_t, log(1 - alpha_t)) against the float64 formula (what: the
    precision, how t was given)."""
    a = logt_a(z_eos, t, w)
    # Log space, compared as log-probs: exp would hide every error below 1e-5.
    expected = (F.logsigmoid(a), F.logsigmoid(-a))
    for part, wanted, name in zip(found, expected, ("log alpha_t", "log(1 - alpha_t)")):
        compare(part, wanted, f"{name} ({what})", rtol, z_eos=z_eos, t=t, w=w)


def logt_reference(logits, t, w, eos):
    """log p of every token under the logt head in float64: log alpha_t at eos, log(1 - alpha_t)
    + the softmax over the other tokens elsewhere.  logits (..., V), t (...) -> (..., V)."""
    a = logt_a(logits[..., eos], t, w)
    # The non-eos tokens share 1 - alpha_t as their softmax without eos says.
    rest = logits.index_fill(-1, torch.tensor([eos]), -math.inf).log_softmax(-1)
    log_p = rest + F.logsigmoid(-a).unsqueeze(-1)
    return log_p.index_copy(-1, torch.tensor([eos]), F.logsigmoid(a).unsqueeze(-1))


def compare_head(head, h, steps, what, rtol=1e-5, **inputs):
    """Head.forward's log p of every token and Head.target_log_probs's against logt_reference,
    at the head's w, with the logits h gives at the steps t (inputs: what names a position, (B, T)
    each)."""
    V, eos, w = head.vocab_size, head.eos_id, float(head.w.detach())
    expected = logt_reference(F.linear(h.double(), head.proj.weight[:V].double()), steps, w, eos)
    # Every other target is eos: both of the head's parts are scored.
    targets = torch.arange(steps.numel()).view(steps.shape) % V
    targets[..., ::2] = eos
    log_p = call(f"Head.forward ({what})", head, h, steps)[0]
    # The inputs name a position; a token of it is named by its index.
    where = {k: v.unsqueeze(-1) for k, v in inputs.items()}
    compare(
        log_p, expected, f"Head.forward's log p ({what})", rtol, w=w, token=torch.arange(V), **where
    )
    part = call(f"Head.target_log_probs ({what})", head.target_log_probs, h, targets, steps)[0]
    expected = expected.gather(-1, targets.unsqueeze(-1))[..., 0]
    compare(part, expected, f"Head.target_log_probs ({what})", rtol, w=w, target=targets, **inputs)


def tiny_lm(backbone, head="logt"):
    """A LanguageModel small enough for a check (vocabulary 12, eos 3)."""
    import model

    cfg = dict(model=backbone, head=head, epsilon=None, vocab_size=12, eos_id=3, n_layer=1)
    # Untied, so that the head's U is its own; no bias, as the shipped configs.
    cfg.update(d_model=8, dropout=0.0, tie=False, block_size=16, kernel_size=2, n_head=2)
    return model.LanguageModel(dict(cfg, bias=False))


def check_logt_names():
    """heads.HEADS and heads.TERMINATION_HEADS hold "logt", and the head refuses to run without t"""
    import heads

    assert "logt" in heads.HEADS, f"heads.HEADS: expected 'logt' in it, found {heads.HEADS}"
    # The commands ask this list which heads model the end of a sequence (and read t).
    assert "logt" in heads.TERMINATION_HEADS, (
        f"heads.TERMINATION_HEADS: expected 'logt' in it, found {heads.TERMINATION_HEADS}"
    )
    # A termination head without t would score every position as if it were t = 1.
    head = heads.Head("logt", 8, 12, 3)
    try:
        head(torch.randn(1, 2, 8), None)
    except ValueError:
        return
    raise AssertionError("Head('logt') with t = None: expected a ValueError, found a result")


def check_logt_formula():
    """heads.logt_log_alpha(z_eos, t, w) gives log sigmoid(z_eos + w log t) and log(1 - that) in
    float64 at w = -1.5, 0.5, 2 (t <= 0 read as t = 1)"""
    import heads

    torch.manual_seed(0)
    # Logits of a trained model's size: the formula, not the numerics, is graded here.
    t = torch.tensor(T_VALUES).expand(4, -1)
    z = torch.randn(t.shape, dtype=torch.float64) * 5
    for w in W_VALUES:
        found = call(f"logt_log_alpha(z_eos, t, {w})", heads.logt_log_alpha, z, t, torch.tensor(w))
        compare_log_alpha(found, z, t, w, "float64", 1e-6)


def check_logt_float32():
    """finite and exact in float32 at eos logits from -100 to 100 and t up to 10^6 (log(1 -
    sigmoid(a)) as written is -inf at z_eos = 20): logt_log_alpha, and every token's log p through
    Head.forward and Head.target_log_probs"""
    import heads

    # Every eos logit at every t: float32 has no room to spare at either end.
    z = torch.tensor(Z_EXTREMES).view(-1, 1).expand(-1, len(T_VALUES))
    t = torch.tensor(T_VALUES).expand_as(z)
    for w in W_VALUES:
        found = call(f"logt_log_alpha(z_eos, t, {w})", heads.logt_log_alpha, z, t, torch.tensor(w))
        compare_log_alpha(found, z, t, w, "float32")
    # The head's U is the identity, so h is the logits: those eos logits, the others random
    # within +-100.
    # Float32 as training runs it without autocast.
    V, eos = 12, 3
    head = heads.Head("logt", V, V, eos)
    torch.manual_seed(0)
    h = (torch.rand(*z.shape, V) * 200 - 100).index_copy(-1, torch.tensor([eos]), z[..., None])
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.weight[:V] = torch.eye(V)
        for w in W_VALUES:
            head.w.fill_(w)
            compare_head(head, h, t, "float32", z_eos=z, t=t)


def check_logt_autocast():
    """under bf16 autocast on the CPU (a GPU's numerics), p(eos) at t = 300..303 is computed in
    float32 at least: four different values, each the float64 formula's, through Head.forward and
    Head.target_log_probs"""
    import heads

    eos, z_eos = 3, -10.0
    head = heads.Head("logt", 8, 12, eos)
    t = torch.arange(300, 304).expand(2, 4)
    # One h for every position, and an eos logit that bf16 holds exactly: only t moves p(eos),
    # and only the head's own arithmetic can round it.
    h = torch.randn(2, 1, 8).expand(2, 4, 8).clone()
    h[..., 0] = z_eos
    with torch.no_grad():
        head.proj.weight[eos] = torch.eye(8)[0]
    targets = torch.full(t.shape, eos)
    # w = 1.3 is no bf16 number: a w rounded to bf16 shows too.
    for w in (1.3, -0.7):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            head.w.fill_(w)
            log_p = call("Head.forward under autocast", head, h, t)[0][..., eos]
            what = "Head.target_log_probs under autocast"
            part = call(what, head.target_log_probs, h, targets, t)[0]
        expected = F.logsigmoid(logt_a(z_eos, t, float(head.w.detach())))
        for found, path in ((log_p, "Head.forward"), (part, "Head.target_log_probs")):
            # bf16 keeps 8 bits: a, near 9 at w = 1.3, moves by less than its step from t = 300
            # to 303, so the four p(eos) come out equal.
            values = found[0].exp().tolist()
            if len(set(values)) < 4:
                shown = ", ".join(fmt(v) for v in values)
                wanted = ", ".join(fmt(v) for v in expected[0].exp().tolist())
                raise AssertionError(
                    f"{path}'s p(eos) at t = 300..303, w = {w} under bf16 autocast: expected "
                    f"{wanted}, found {shown} (the eos terms rounded to bf16)"
                )
            what = f"{path}'s log p(eos) under bf16 autocast"
            compare(found, expected, what, z_eos=z_eos, t=t, w=w)


def check_logt_dtypes():
    """t given as an int64, int32 or float64 tensor or as a Python int gives the float64 formula
    to 1e-10 (an integer t's log is float32); the result has z_eos's dtype, float32 at least"""
    import heads

    torch.manual_seed(0)
    t = torch.tensor(T_VALUES).expand(3, -1)
    z = torch.randn(t.shape, dtype=torch.float64) * 5
    w = torch.tensor(2.0, dtype=torch.float64)
    # The batch makes t an int64 tensor; tests and analyses pass other tensors or a plain int.
    # Each t as it may come, graded against the same float64 values.
    for given in (t, t.int(), t.double(), 7, 10**6 + 1):
        kind = f"a {given.dtype} tensor" if isinstance(given, torch.Tensor) else "a Python int"
        found = call(f"logt_log_alpha with t {kind}", heads.logt_log_alpha, z, given, w)
        # 1e-10: float64 throughout; a step through float32 is off by 1e-8 or so.
        compare_log_alpha(found, z, given, 2.0, f"float64, t {kind}", 1e-10)
    # The eos terms keep the logit's precision and raise bf16 / float16 to float32 (as
    # nmst_log_alpha does): the log-probs are then assembled in that dtype.
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        expected = torch.promote_types(dtype, torch.float32)
        what = f"logt_log_alpha for a {dtype} z_eos"
        found = call(what, heads.logt_log_alpha, z.to(dtype), t, w.float())
        for part, name in zip(found, ("log alpha_t", "log(1 - alpha_t)")):
            assert part.dtype == expected, (
                f"{name} for a {dtype} z_eos: expected dtype {expected}, found {part.dtype}"
            )


def check_logt_head():
    """Head("logt") gives p(eos) = alpha_t and (1 - alpha_t) softmax over the rest, in float64 at
    w = -1.5, 0.5, 2, through forward and target_log_probs"""
    import heads

    torch.manual_seed(0)
    head = heads.Head("logt", 8, 12, 3).double()
    kind = type(getattr(head, "w", None)).__name__
    assert isinstance(getattr(head, "w", None), torch.Tensor), (
        f"Head('logt').w: expected a tensor, found {kind}"
    )
    # A float64 head: any difference from the formula beyond 1e-9 is the formula's.
    t = torch.tensor(T_VALUES).expand(2, -1)
    h = torch.randn(2, t.shape[1], 8, dtype=torch.float64)
    for w in W_VALUES:
        with torch.no_grad():
            head.w.fill_(w)
            compare_head(head, h, t, "float64", 1e-9, t=t)


def check_logt_parameter():
    """Head("logt").w is an nn.Parameter of the head (the optimizer and the checkpoint see it)"""
    import heads

    head = heads.Head("logt", 8, 12, 3)
    w = getattr(head, "w", None)
    kind = type(w).__name__
    assert isinstance(w, torch.nn.Parameter), f"Head('logt').w: expected a Parameter, found {kind}"
    # A Parameter kept where the module does not register it is not trained nor saved.
    assert any(p is w for p in head.parameters()), (
        "head.parameters(): expected self.w among them, found it missing"
    )
    assert w.dim() == 0, f"w, one learned scalar: expected shape (), found {tuple(w.shape)}"


def check_logt_initial():
    """w starts at 0 (docs/exercises.md: torch.zeros(())) in a new Head("logt") and in a new
    LanguageModel of every shipped backbone"""
    import heads

    found = float(heads.Head("logt", 8, 12, 3).w.detach())
    assert found == 0.0, f"a new Head('logt', 8, 12, 3).w: expected 0, found {fmt(found)}"
    # A backbone's initialisation (GPT's, GCNN's apply) must leave the head's w alone.
    for backbone in SHIPPED:
        found = float(tiny_lm(backbone).head.w.detach())
        assert found == 0.0, f"a new {backbone} model's head.w: expected 0, found {fmt(found)}"


def check_logt_ownership():
    """each Head("logt") and each LanguageModel owns its w: setting or training one leaves the
    others' at 0, a head made afterwards starts at 0, and a checkpoint (state_dict) keeps it"""
    import heads

    first, second = heads.Head("logt", 8, 12, 3), heads.Head("logt", 8, 12, 3)
    with torch.no_grad():
        first.w.fill_(1.5)
    # reproduce.py --jobs 1 trains its runs in one process: a shared w would carry over.
    third = heads.Head("logt", 8, 12, 3)
    for name, head in (("a second", second), ("a later", third)):
        found = float(head.w.detach())
        assert found == 0.0, (
            f"{name} Head('logt')'s w once the first one's is set to 1.5: expected 0 (each head "
            f"its own w), found {fmt(found)}"
        )
    # Two models, as two runs of one process: training one must leave the other alone.
    models = [tiny_lm("lstm"), tiny_lm("lstm")]
    idx = torch.randint(0, 12, (2, 6))
    batch = dict(inputs=idx, t=torch.arange(-2, 4).expand(2, 6), targets=idx, mask=None)
    log_p = models[0](batch)[0]
    (-log_p.mean()).backward()
    # One step of gradient descent on the first model's parameters, as an optimizer takes it.
    with torch.no_grad():
        for p in models[0].parameters():
            if p.grad is not None:
                p -= p.grad
    trained, other = (float(m.head.w.detach()) for m in models)
    assert trained != 0.0, "a trained model's head.w: expected it moved from 0, found 0"
    assert other == 0.0, (
        f"a second model's head.w after a training step of the first (whose w is now "
        f"{fmt(trained)}): expected 0, found {fmt(other)}"
    )
    # A w outside the checkpoint would be lost at --resume and in evaluate.py.
    state = models[0].state_dict()
    assert "head.w" in state, f"the checkpoint's keys: expected head.w, found {sorted(state)}"
    models[1].load_state_dict(state)
    found = float(models[1].head.w.detach())
    assert found == trained, (
        f"head.w from a checkpoint: expected {fmt(trained)}, found {fmt(found)}"
    )


def check_logt_learns():
    """w gets a gradient and moves in a short training run on sequences whose p(eos) grows as
    sigmoid(2 log t) (one h per sequence, so only w can follow t), and through LanguageModel"""
    import heads

    torch.manual_seed(0)
    head = heads.Head("logt", 8, 12, 3)
    B, T = 64, 10
    h = torch.randn(B, 1, 8).expand(B, T, 8)
    t = torch.arange(1, T + 1).expand(B, T)
    # Each sequence ends at its first step whose coin comes up eos (at T at the latest).
    ends = torch.rand(B, T) < torch.sigmoid(2 * torch.log(t.double()))
    ends[:, -1] = True
    length = ends.int().argmax(-1, keepdim=True) + 1
    targets = torch.randint(4, 12, (B, T)).masked_fill(t == length, 3)
    mask = t <= length
    # The other tokens' part is one softmax per sequence: only w can learn that p(eos) grows.
    # Plain gradient descent (step 2): the run needs no optimizer to find w near 2.
    for step in range(30):
        log_p = head.target_log_probs(h, targets, t)[0]
        loss = -(log_p * mask).sum() / mask.sum()
        head.zero_grad()
        loss.backward()
        grad = head.w.grad
        assert step > 0 or (grad is not None and float(grad) != 0.0), (
            "w's gradient in a training step: expected a non-zero one, found none"
        )
        with torch.no_grad():
            for p in head.parameters():
                if p.grad is not None:
                    p -= 2.0 * p.grad
    w = float(head.w.detach())
    assert w > 1.0, f"w after 30 steps on data made with w = 2: expected > 1, found {w:.3f}"
    # The loss path of training (LanguageModel with targets) must reach w as well.
    lm = tiny_lm("lstm")
    idx = torch.randint(0, 12, (2, 6))
    log_p = lm(dict(inputs=idx, t=torch.arange(-2, 4).expand(2, 6), targets=idx, mask=None))[0]
    log_p.mean().backward()
    grad = lm.head.w.grad
    assert grad is not None and float(grad) != 0.0, (
        "w's gradient through LanguageModel's loss: expected a non-zero one, found none"
    )


# --- exercise 2: the decoder "typical" --------------------------------------------------------
# A mass within this of p has reached it: float rounding decides no set (as decode.nucleus_mask).
REACHED = 1e-6


def typical_reference(log_probs, p, temperature=1.0):
    """Locally typical sampling in float64 (Meister et al. 2022), after filter_log_probs's
    temperature: the tokens whose -log p lies closest to the entropy H, kept in that order while
    the mass before them is below p (less REACHED).  -> (lp (N, V) the tempered log-probs,
    distance |-log p - H| (N, V), keep (N, V) bool, clear (N,): no mass before a token within
    REACHED / 2 of the threshold, where float32 rounding could decide)."""
    x = log_probs.double()
    # filter_log_probs's temperature: shifted first, so that 1e-39 leaves the mode at 0.
    lp = torch.log_softmax((x - x.amax(-1, keepdim=True)) / temperature, -1)
    # 0 log 0 = 0: a token of probability 0 adds nothing to H.
    entropy = -(lp.exp() * lp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    distance = (-lp - entropy).abs()
    # Ties in distance are ordered by index here; the grading accepts either order.
    order = distance.argsort(dim=-1, stable=True)
    mass = lp.gather(-1, order).exp().cumsum(-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], -1)
    threshold = p - REACHED
    keep = torch.zeros_like(lp, dtype=torch.bool).scatter_(-1, order, before < threshold)
    # Random rows whose masses come that close to the threshold are not graded: float32
    # rounding, not the rule, would decide them.
    clear = ((before - threshold).abs() > REACHED / 2).all(-1)
    return lp, distance, keep, clear


# The count of a message, singular or plural.
def tokens(n):
    return "1 token" if n == 1 else f"{n} tokens"


def typical_row_error(found, lp, distance, keep):
    """What one row of filter_log_probs's log q (V,) gets wrong against the reference's row
    (typical_reference's lp, distance, keep), or None.  Tokens tied in distance at the set's edge
    may be kept either way; the set's size and mass may not change."""
    if found.isnan().any():
        token = int(found.isnan().nonzero()[0])
        return f"log q of token {token}: expected a number or -inf, found nan"
    # Tied tokens have one probability: the set's size and mass are the same whichever is kept.
    kept = found > -math.inf
    n, n_ref = int(kept.sum()), int(keep.sum())
    mass, mass_ref = float(lp.exp()[kept].sum()), float(lp.exp()[keep].sum())
    if n != n_ref or abs(mass - mass_ref) > REACHED:
        return f"expected {tokens(n_ref)} of mass {fmt(mass_ref)}, found {n} of mass {fmt(mass)}"
    # Closest first: no token left out may lie nearer to H than one kept (a token of
    # probability 0 never counts).
    inside = distance.masked_fill(~kept, -math.inf)
    outside = distance.masked_fill(kept | (lp == -math.inf), math.inf)
    if inside.max() > outside.min() + 1e-9:
        a, b = int(inside.argmax()), int(outside.argmin())
        return (
            f"expected token {b} (|-log p - H| = {fmt(outside[b])}) kept before token {a} "
            f"({fmt(inside[a])}), found token {a} kept and not {b}"
        )
    # The kept tokens' probabilities renormalised, in log space.
    expected = (lp - lp[kept].logsumexp(-1)).masked_fill(~kept, -math.inf)
    try:
        compare(found, expected, "log q", token=torch.arange(len(found)))
    except AssertionError as e:
        return str(e)
    return None


def compare_typical(found, log_probs, p, what, temperature=1.0, rows=None):
    """filter_log_probs's log q (N, V) against typical_reference row by row (the clear rows): an
    AssertionError naming the row (rows: a description of each), p and the temperature."""
    lp, distance, keep, clear = typical_reference(log_probs, p, temperature)
    found = torch.as_tensor(found).detach().double()
    if found.shape != lp.shape:
        raise AssertionError(
            f"{what}: expected shape {tuple(lp.shape)}, found {tuple(found.shape)}"
        )
    # All rows at once; the first wrong one is then explained on its own.
    wrong = clear & typical_rows_wrong(found, lp, distance, keep)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        row = f"row {i}" if rows is None else rows[i]
        message = typical_row_error(found[i], lp[i], distance[i], keep[i])
        raise AssertionError(f"{what} ({row}, p = {p}, temperature {temperature}): {message}")


def typical_rows_wrong(found, lp, distance, keep):
    """Whether each row of found (N, V) breaks a rule of typical_row_error: its checks at once,
    so that many rows cost one pass.  -> bool (N,)."""
    kept = found > -math.inf
    # Each rule of typical_row_error, for every row at once.
    probs = lp.exp()
    mass_off = ((probs * kept).sum(-1) - (probs * keep).sum(-1)).abs() > REACHED
    inside = distance.masked_fill(~kept, -math.inf).amax(-1)
    outside = distance.masked_fill(kept | (lp == -math.inf), math.inf).amin(-1)
    expected = lp - lp.masked_fill(~kept, -math.inf).logsumexp(-1, keepdim=True)
    err = ((found - expected).abs() / (1 + expected.abs())).masked_fill(~kept, 0.0)
    wrong = found.isnan().any(-1) | (kept.sum(-1) != keep.sum(-1)) | mass_off
    return wrong | (inside > outside + 1e-9) | (err > 1e-5).any(-1)


def typical_filter(decoder_module, log_probs, p, temperature=1.0):
    """decode.filter_log_probs(log_probs, "typical", p=p, temperature=...), an exception named."""
    what = f"filter_log_probs(..., 'typical', p={p}, temperature={temperature})"
    return call(
        what, decoder_module.filter_log_probs, log_probs, "typical", p=p, temperature=temperature
    )


def check_typical_names():
    """decode.DECODERS and decode.SAMPLING (the decoders that draw) hold "typical"; it takes a
    --temperature"""
    import decode

    assert "typical" in decode.DECODERS, (
        f"decode.DECODERS: expected 'typical' in it, found {decode.DECODERS}"
    )
    assert "typical" in decode.SAMPLING, (
        f"decode.SAMPLING (the decoders that draw): expected 'typical' in it, found "
        f"{decode.SAMPLING}"
    )
    # A decoder that draws takes --temperature: check_decoder_args would refuse it otherwise.
    decode.check_decoder_args("typical", p=0.9, temperature=0.8)


def check_typical_args():
    """check_decoder_args: typical reads --p and refuses it missing or outside (0, 1] in one line"""
    import decode
    from common import UserError

    decode.check_decoder_args("typical", p=0.9)
    # A missing --p, and one on each side of (0, 1].
    for p in (None, 0.0, 1.5):
        try:
            decode.check_decoder_args("typical", p=p)
        except UserError:
            continue
        raise AssertionError(f"--decoder typical with --p {p}: expected a UserError, found none")


def check_typical_filter():
    """decode.filter_log_probs(..., "typical", p=...) equals the float64 reference at p = 0.2,
    0.5, 0.9, 0.95, random rows of three logit scales, temperature 1 and 0.7"""
    import decode

    torch.manual_seed(0)
    # From nearly flat to peaked rows, as a language model's are.
    for scale in (0.5, 2.0, 5.0):
        log_probs = torch.log_softmax(torch.randn(32, 40) * scale, -1)
        for p in (0.2, 0.5, 0.9, 0.95):
            for temperature in (1.0, 0.7):
                found = typical_filter(decode, log_probs, p, temperature)
                what = f"log q, random logits of scale {scale}"
                compare_typical(found, log_probs, p, what, temperature)


def flat_rows():
    """(V, p, a flat row (1, V) of log-probs): each size's, at p that some number of its tokens
    reaches exactly."""
    for V in (4, 10, 40, 100):
        # Most of these p are reached exactly by some number of 1/V: ties at the threshold.
        for p in (0.1, 0.25, 0.3, 0.5, 0.75, 0.9):
            yield V, p, torch.log_softmax(torch.zeros(1, V), -1)


def check_typical_flat():
    """flat rows (4, 10, 40 and 100 tokens of equal probability): as many tokens kept as reach p,
    each at 1/that many, p = 0.1 .. 0.9"""
    import decode

    # Every token is as far from H as every other: any of them may be kept, the count may
    # not change.
    for V, p, log_probs in flat_rows():
        found = typical_filter(decode, log_probs, p)
        compare_typical(found, log_probs, p, "log q", rows=[f"a flat row of {V} tokens"])


def peaked_rows():
    """(description, log-probs (V,)) of rows where one token stands out."""
    rows = []
    # A mode so probable that it is the typical set alone.
    one = torch.zeros(12)
    one[5] = 10.0
    rows.append(("one token at 0.9995 of 12", one))
    # The mode is atypical there (its -log p far below H): the typical set leaves it out.
    for top, n in ((0.4, 20), (0.6, 20), (0.3, 60)):
        probs = torch.full((n + 1,), (1 - top) / n)
        probs[n // 2] = top
        rows.append((f"a mode of {top} among {n} tokens of {fmt((1 - top) / n)}", probs.log()))
    torch.manual_seed(3)
    # Logits up to +-100: float32 log-probs of -200 whose probabilities are 0.
    for scale in (20.0, 100.0):
        rows.append((f"random logits of scale {scale:g}", torch.randn(30) * scale))
    return rows


def check_typical_peaked():
    """peaked rows: one token at 0.9995, a mode the typical set leaves out (its -log p far below
    the entropy), logits up to +-100 in float32; p = 0.2, 0.5, 0.9"""
    import decode

    for name, logits in peaked_rows():
        # Float32, as decode() passes the log-probs to filter_log_probs.
        log_probs = torch.log_softmax(logits.float()[None], -1)
        for p in (0.2, 0.5, 0.9):
            found = typical_filter(decode, log_probs, p)
            compare_typical(found, log_probs, p, "log q", rows=[name])


def check_typical_inf_rows():
    """rows with -inf log-probs (a third of the tokens banned, one or two finite tokens, an
    atypical mode beside -inf): no NaN, no token of probability 0, the float64 reference's set"""
    import decode

    torch.manual_seed(4)
    logits = torch.randn(6, 30) * 2
    # -inf where a decoder bans tokens (padding rows, insertion decoding's BOS / EOS).
    logits[:2, torch.randperm(30)[:10]] = -math.inf
    logits[2, 1:] = -math.inf
    logits[3, 2:] = -math.inf
    logits[4, :] = -math.inf
    logits[4, [3, 17]] = torch.tensor([0.0, 1.0])
    logits[5] = math.log(0.6 / 20)
    logits[5, 7] = math.log(0.4)
    logits[5, 21:] = -math.inf
    names = ["a third banned", "a third banned", "one finite token", "two equal finite tokens"]
    names += ["two finite tokens", "a mode of 0.4 among 20 tokens of 0.03, 9 banned"]
    log_probs = torch.log_softmax(logits, -1)
    for p in (0.2, 0.5, 0.9):
        found = typical_filter(decode, log_probs, p)
        compare_typical(found, log_probs, p, "log q", rows=names)


def check_typical_temperature():
    """temperatures near 0 (1e-3, 1e-8, 1e-39): the tempered distribution's typical set, its mode
    alone, with no NaN"""
    import decode

    torch.manual_seed(5)
    # At these temperatures the tempered distribution is the mode alone: its typical set too.
    log_probs = torch.log_softmax(torch.randn(16, 30) * 2, -1)
    for temperature in (1e-3, 1e-8, 1e-39):
        for p in (0.2, 0.9):
            found = typical_filter(decode, log_probs, p, temperature)
            compare_typical(found, log_probs, p, "log q", temperature)


def check_typical_ties():
    """ties at the threshold: tokens of equal probability whose mass reaches p exactly (0.3 +
    0.3 at p = 0.6, 0.25 x 2 at p = 0.5, ...): the set stops there, however the sum rounds, and
    either of two tied tokens may be the one kept"""
    import decode

    # (name, the probabilities, p that a number of the tied tokens reaches exactly).
    rows = (
        ("0.3, 0.3, 0.2, 0.2", (0.3, 0.3, 0.2, 0.2), (0.3, 0.5, 0.6, 0.7, 0.8)),
        ("0.25 x 4", (0.25,) * 4, (0.25, 0.5, 0.75)),
        ("0.4, 0.4, 0.1, 0.1", (0.4, 0.4, 0.1, 0.1), (0.4, 0.8, 0.9)),
        ("0.1 x 10", (0.1,) * 10, (0.1, 0.3, 0.6, 0.7)),
        ("0.05 x 20", (0.05,) * 20, (0.15, 0.35, 0.45, 0.55, 0.65, 0.85)),
    )
    for name, probs, ps in rows:
        # Float32 log-probs whose sums come a hair above or below p: the margin decides alike.
        log_probs = torch.tensor(probs).log()[None]
        for p in ps:
            found = typical_filter(decode, log_probs, p)
            compare_typical(found, log_probs, p, "log q", rows=[name])


def check_typical_draws():
    """decode(..., "typical", p=0.6) draws the first token at the reference's frequencies"""
    import decode
    import model

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, -1.0, 0.5, -0.5, 0.0, 1.0], dtype=torch.float64)
    cfg = dict(model="lstm", head="softmax", epsilon=None, vocab_size=7, eos_id=2, n_layer=1)
    lm = model.LanguageModel(dict(cfg, d_model=4, dropout=0.0, tie=False)).double()
    # A model whose first token's distribution is these logits whatever the prompt.
    with torch.no_grad():
        lm.head.proj.weight.zero_()
        padding = torch.zeros(lm.head.proj.weight.shape[0] - 7, dtype=torch.float64)
        lm.head.proj.bias = torch.nn.Parameter(torch.cat([logits, padding]))
    n = 4000
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor([1])] * n
    what = "decode(lm, prompts, 1, 'typical', p=0.6)"
    out = call(what, decode.decode, lm, prompts, 1, "typical", p=0.6, generator=g)
    counts = torch.bincount(torch.tensor([x[0] for x in out["tokens"]]), minlength=7).double()
    # The reference's q: the kept tokens' probabilities, renormalised.
    lp, _, keep, _ = typical_reference(torch.log_softmax(logits, -1)[None], 0.6)
    q = lp.exp() * keep
    expected = n * (q / q.sum())[0]
    outside = int(counts[expected == 0].sum())
    assert outside == 0, f"draws outside the typical set: expected 0 of {n}, found {outside}"
    kept = expected > 0
    # 20.5: chi-square's 0.999 quantile at 5 degrees of freedom or fewer: 1 run in 1000
    # would fail an exact sampler; a wrong set fails it every time.
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 20.5, (
        f"draws of each token: expected {[round(x) for x in expected.tolist()]}, found "
        f"{[int(x) for x in counts.tolist()]} (chi2 {chi2:.1f})"
    )


# --- exercise 3: a dilated gated CNN ----------------------------------------------------------
SHIPPED = ("rnn", "lstm", "gcnn", "gpt")


def new_backbone(kernel_size=3, n_layer=3):
    """(name, the backbone built by model.build_backbone) of the one name added to MODELS."""
    import model

    # The name is the student's choice: the one MODELS holds beside the shipped four.
    added = [m for m in model.MODELS if m not in SHIPPED]
    assert len(added) == 1, f"expected one new name in model.MODELS, found {added}"
    cfg = dict(model=added[0], vocab_size=30, block_size=64, n_layer=n_layer, d_model=8)
    torch.manual_seed(0)
    backbone = model.build_backbone(dict(cfg, kernel_size=kernel_size, dropout=0.0, n_head=2))
    return added[0], backbone.double().eval()


def check_dilated_names():
    """the new name is in model.MODELS, model.WINDOWED and train.RECIPES, and LanguageModel
    builds it and gives a finite loss"""
    import model
    import train

    name, _ = new_backbone()
    # Learned positions make a window: the commands ask WINDOWED which models have one.
    assert name in model.WINDOWED, (
        f"model.WINDOWED: expected '{name}' in it, found {model.WINDOWED}"
    )
    assert name in train.RECIPES, (
        f"train.RECIPES (each model's defaults): expected '{name}' in it, found "
        f"{tuple(train.RECIPES)}"
    )
    # The training path end to end: embedding, backbone, a termination head, the loss.
    cfg = dict(model=name, head="nmst", epsilon=1e-3, vocab_size=30, eos_id=3, n_layer=3)
    cfg.update(d_model=8, dropout=0.0, tie=True, block_size=64, kernel_size=3, n_head=2)
    lm = model.LanguageModel(cfg)
    idx = torch.randint(0, 30, (2, 20))
    log_p = lm(dict(inputs=idx, t=torch.arange(-5, 15).expand(2, 20), targets=idx, mask=None))[0]
    assert torch.isfinite(log_p).all(), "the loss path's log p: expected finite, found inf or nan"


def check_dilated_field():
    """causal, and the receptive field's edge: output t reads exactly inputs t - (k-1)(2^n_layer
    - 1) .. t (dilations 1, 2, 4, ...), for k = 2 and 3, n_layer = 3 and 4"""
    for k, n_layer in ((2, 4), (3, 3)):
        _, backbone = new_backbone(k, n_layer)
        # Longer than both fields (16 and 15 inputs): the edge shows on both sides.
        T = 40
        idx = torch.randint(0, 30, (1, T))
        # Row j + 1 changes input j alone: the outputs it changes are those that read input j.
        others = idx.repeat(T + 1, 1)
        others[1:].diagonal().add_(1).remainder_(30)
        with torch.no_grad():
            out = backbone(others)[0]
        # changed[j, t]: input j changes output t.
        changed = (out[1:] - out[:1]).abs().amax(-1) > 1e-10
        early = changed.tril(-1)
        if early.any():
            j, t = (int(x) for x in early.nonzero()[0])
            raise AssertionError(
                f"k = {k}, n_layer = {n_layer}: expected input {j} to change outputs {j} and "
                f"later only (causal), found it changes output {t}"
            )
        # Layer l adds (k - 1) 2^l inputs: (k - 1)(1 + 2 + ... + 2^(n-1)) + 1 in all.
        field = (k - 1) * (2**n_layer - 1) + 1
        seen = changed[:, T - 1].nonzero()[:, 0].tolist()
        expected = list(range(T - field, T))
        assert seen == expected, (
            f"k = {k}, n_layer = {n_layer}: expected output {T - 1} to read inputs "
            f"{expected[0]}..{T - 1} ({field}), found {seen[0]}..{seen[-1]} ({len(seen)} inputs)"
        )


def right_padded(idx, lengths):
    """The first max(lengths) tokens of each row of idx, random tokens past its length (the
    padding must not matter, whatever it holds)."""
    prompts = idx[:, : int(lengths.max())].clone()
    pad = torch.arange(prompts.shape[1]) >= lengths[:, None]
    # Not the zeros a padding usually holds: a state that reads the padding then shows.
    prompts[pad] = (prompts[pad] + 7) % 30
    return prompts


def check_dilated_state():
    """the padding side: after right-padded prompts (lengths 12, 5 and 1, random padding tokens)
    the prompt's outputs and the cached state, one token at a time, give what a full forward
    gives"""
    _, backbone = new_backbone()
    torch.manual_seed(1)
    idx = torch.randint(0, 30, (3, 30))
    # The longest prompt, a shorter one, and one token: the padding fills the two last rows.
    lengths = torch.tensor([12, 5, 1])
    rows = torch.arange(3)
    with torch.no_grad():
        full = backbone(idx)[0]
        h, state = call("the prompts' forward", backbone, right_padded(idx, lengths), None, lengths)
        last = h[rows, lengths - 1]
        what = "the output at a right-padded prompt's last token"
        compare(last, full[rows, lengths - 1], what, 1e-7, prompt_length=lengths[:, None])
        # Each row goes on with its own sequence's next token, at its own position.
        for i in range(10):
            at = lengths + i
            h, state = call("a cached step", backbone, idx[rows, at].unsqueeze(1), state)
            what = f"the cached output {i + 1} token(s) after right-padded prompts"
            compare(h[:, 0], full[rows, at], what, 1e-7, prompt_length=lengths[:, None])


def check_dilated_reorder():
    """the cache after reordering: reorder_state with rows repeated and dropped (index 2, 0, 0,
    1, then 3, 1, as beam search does) goes on as a full forward of each row's sequence"""
    _, backbone = new_backbone()
    torch.manual_seed(2)
    idx = torch.randint(0, 30, (3, 30))
    # Rows of three lengths: a row moved to another's place keeps its own positions.
    lengths = torch.tensor([12, 5, 9])
    with torch.no_grad():
        full = backbone(idx)[0]
        _, state = backbone(right_padded(idx, lengths), None, lengths)
        source, at = torch.arange(3), lengths.clone()
        # The first two steps go on from the prompts; each reordering then repeats and drops rows.
        for index in ([0, 1, 2], [2, 0, 0, 1], [3, 1]):
            after = f"after reorder_state(state, {index})"
            index = torch.tensor(index)
            state = call(after, backbone.reorder_state, state, index)
            source, at = source[index], at[index]
            for i in range(2):
                h, state = call(f"the step {i + 1} {after}", backbone, idx[source, at, None], state)
                what = f"the cached output {i + 1} token(s) {after}"
                # Each row is the sequence it was reordered from, at its own next position.
                where = dict(sequence=source[:, None], position=at[:, None])
                compare(h[:, 0], full[source, at], what, 1e-7, **where)
                at = at + 1


CHECKS = {
    1: (
        check_logt_names,
        check_logt_formula,
        check_logt_float32,
        check_logt_autocast,
        check_logt_dtypes,
        check_logt_head,
        check_logt_parameter,
        check_logt_initial,
        check_logt_ownership,
        check_logt_learns,
    ),
    2: (
        check_typical_names,
        check_typical_args,
        check_typical_filter,
        check_typical_flat,
        check_typical_peaked,
        check_typical_inf_rows,
        check_typical_temperature,
        check_typical_ties,
        check_typical_draws,
    ),
    3: (check_dilated_names, check_dilated_field, check_dilated_state, check_dilated_reorder),
}


# A root is refused before any import: an empty folder would grade nothing (or, on
# sys.path, another tree's code).
def missing_code(root):
    """The modules the checks import that root lacks (all of them: root is no nanogen folder)."""
    return [name for name in NEEDED if not os.path.isfile(os.path.join(root, name))]


def grade(n, root=ROOT, only=None):
    """-> [(what a check asks, None or what it found wrong)] for exercise n on the code in root
    (only: the names of the checks to run, default all)."""
    results = []
    # The checks seed torch's generator: the caller's random state is left as it was.
    with code_of(root), torch.random.fork_rng():
        for check in [c for c in CHECKS[n] if only is None or c.__name__ in only]:
            what = " ".join(check.__doc__.split())
            try:
                check()
                results.append((what, None))
            # A wrong answer may raise anything, sys.exit() included: a finding about the code,
            # not a crash of the checker (nor its silent end).
            except (Exception, SystemExit) as e:
                results.append((what, f"{type(e).__name__}: {e}"))
    return results


def main(argv=None):
    # The command: one exercise, the folder to grade.
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exercise", type=int, choices=sorted(CHECKS))
    parser.add_argument("--root", default=ROOT, help="the code to grade (default: this tree)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    missing = missing_code(root)
    if missing:
        print(
            f"error: --root {args.root} holds no nanogen code ({', '.join(missing)} missing)",
            file=sys.stderr,
        )
        return 2
    results = grade(args.exercise, root)
    for what, wrong in results:
        if wrong is None:
            print(f"ok    {what}")
        else:
            print(f"FAIL  {what}\n      {wrong}")
    failed = sum(wrong is not None for _, wrong in results)
    print(f"exercise {args.exercise}: {len(results) - failed} of {len(results)} checks pass")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
