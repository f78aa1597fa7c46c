"""Grades a coursework exercise of the README on the code of this folder:

    python -m tests.check_exercise 1        (or 2, 3)

Each check prints `ok` or `FAIL` with what it found; the exit status is 0 when every check
passes, 1 when one fails.  The checks grade what the code does, not how it is written:

  1. the head "logt", alpha_t = sigmoid(z_eos + w log t), against that formula in float64 at
     several non-zero w (t <= 0 read as t = 1), through Head.forward and Head.target_log_probs;
     w an nn.Parameter that gets a gradient and grows in a short training run whose sequences
     all end at t = 8; "logt" in HEADS and TERMINATION_HEADS.
  2. the decoder "typical" against locally typical sampling (Meister et al. 2022) in float64,
     in DECODERS and SAMPLING, its --p read and checked, its draws in decode() at the
     frequencies of that reference.
  3. the new backbone in MODELS, WINDOWED and train.RECIPES, causal, with the receptive field of
     dilations 1, 2, 4, ... ((k - 1)(2^n_layer - 1) + 1 tokens), and its cached state giving
     what a full forward gives, for right-padded prompts and after reorder_state.

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
PROJECT = ("heads", "model", "decode", "train", "evaluate", "insnet", "curves", "data")
# w = 0, the head's initial value, would hide a wrong use of log t.
W_VALUES = (-1.5, 0.5, 2.0)
T_VALUES = (-3, 0, 1, 2, 3, 7, 1000, 10**6)


@contextlib.contextmanager
def code_of(root):
    """The project's modules imported from root while the block runs; those imported before are
    put back afterwards (the checker's own tests grade copies of the code in one process)."""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in PROJECT}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(root)
        for name in [n for n in sys.modules if n.split(".")[0] in PROJECT]:
            del sys.modules[name]
        sys.modules.update(saved)


def close(actual, expected, what):
    """float32 rounding is accepted; a wrong formula is not."""
    actual = torch.as_tensor(actual).double()
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    err = (actual - expected).abs().max().item()
    if not err <= 1e-5:
        raise AssertionError(f"{what}: off by {err:.3g} from the float64 reference")


# --- exercise 1: the head "logt" --------------------------------------------------------------
def logt_alpha(z_eos, t, w):
    """The reference: alpha_t = sigmoid(z_eos + w log t), float64, t <= 0 read as t = 1."""
    return torch.sigmoid(z_eos.double() + w * torch.log(t.clamp(min=1).double()))


def check_logt_names():
    """heads.HEADS and heads.TERMINATION_HEADS hold "logt", and the head refuses to run without t"""
    import heads

    assert "logt" in heads.HEADS, "add 'logt' to heads.HEADS"
    assert "logt" in heads.TERMINATION_HEADS, (
        "add 'logt' to heads.TERMINATION_HEADS: it reads t, and the commands ask this list which "
        "heads model the end of a sequence"
    )
    head = heads.Head("logt", 8, 12, 3)
    try:
        head(torch.randn(1, 2, 8), None)
    except ValueError:
        return
    raise AssertionError("Head('logt') ran without t: it must refuse (Head._needs_t)")


def check_logt_formula():
    """heads.logt_log_alpha(z_eos, t, w) equals sigmoid(z_eos + w log t) in float64 at w = -1.5,
    0.5, 2 (t <= 0 read as t = 1)"""
    import heads

    torch.manual_seed(0)
    t = torch.tensor(T_VALUES).expand(4, -1)
    z = torch.randn(t.shape, dtype=torch.float64) * 5
    for w in W_VALUES:
        alpha = logt_alpha(z, t, w)
        log_alpha, log_one_minus_alpha = heads.logt_log_alpha(z, t, torch.tensor(w))
        close(log_alpha.exp(), alpha, f"alpha_t at w = {w}")
        close(log_one_minus_alpha.exp(), 1 - alpha, f"1 - alpha_t at w = {w}")


def check_logt_head():
    """Head("logt") gives p(eos) = alpha_t and (1 - alpha_t) softmax over the rest, in float64 at
    w = -1.5, 0.5, 2, through forward and target_log_probs"""
    import heads

    torch.manual_seed(0)
    V, eos = 12, 3
    head = heads.Head("logt", 8, V, eos).double()
    assert isinstance(getattr(head, "w", None), torch.Tensor), "Head('logt') has no tensor self.w"
    t = torch.tensor(T_VALUES).expand(2, -1)
    h = torch.randn(2, t.shape[1], 8, dtype=torch.float64)
    targets = torch.randint(0, V, t.shape)
    targets[:, ::2] = eos
    for w in W_VALUES:
        with torch.no_grad():
            head.w.fill_(w)
            logits = F.linear(h, head.proj.weight[:V])
            alpha = logt_alpha(logits[..., eos], t, w)
            rest = logits.index_fill(-1, torch.tensor([eos]), -math.inf).softmax(-1)
            p = rest * (1 - alpha).unsqueeze(-1)
            p[..., eos] = alpha
            log_p, _ = head(h, t)
            close(log_p.exp(), p, f"Head.forward at w = {w}")
            part, _ = head.target_log_probs(h, targets, t)
            close(
                part.exp(),
                p.gather(-1, targets.unsqueeze(-1))[..., 0],
                f"target_log_probs, w = {w}",
            )


def check_logt_parameter():
    """Head("logt").w is an nn.Parameter of the head (the optimizer and the checkpoint see it)"""
    import heads

    head = heads.Head("logt", 8, 12, 3)
    w = getattr(head, "w", None)
    assert isinstance(w, torch.nn.Parameter), f"Head('logt').w is {type(w).__name__}, no Parameter"
    assert any(p is w for p in head.parameters()), "self.w is not among head.parameters()"
    assert w.dim() == 0, f"w is one learned scalar: shape (), not {tuple(w.shape)}"


def check_logt_learns():
    """w gets a gradient and moves in a short training run on sequences whose p(eos) grows as
    sigmoid(2 log t) (one h per sequence, so only w can follow t), and through LanguageModel"""
    import heads
    import model

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
    opt = torch.optim.Adam(head.parameters(), lr=0.1)
    for step in range(30):
        log_p = head.target_log_probs(h, targets, t)[0]
        loss = -(log_p * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        grad = head.w.grad
        assert step > 0 or (grad is not None and float(grad) != 0.0), "w gets no gradient"
        opt.step()
    w = float(head.w.detach())
    assert w > 1.0, f"w = {w:.3f} after 30 steps on data made with w = 2 (expected > 1)"
    cfg = dict(model="lstm", head="logt", epsilon=None, vocab_size=12, eos_id=3, n_layer=1)
    lm = model.LanguageModel(dict(cfg, d_model=8, dropout=0.0, tie=False))
    idx = torch.randint(0, 12, (2, 6))
    log_p = lm(dict(inputs=idx, t=torch.arange(-2, 4).expand(2, 6), targets=idx, mask=None))[0]
    log_p.mean().backward()
    grad = lm.head.w.grad
    assert grad is not None and float(grad) != 0.0, "LanguageModel's loss gives w no gradient"


# --- exercise 2: the decoder "typical" --------------------------------------------------------
def typical_reference(log_probs, p, temperature=1.0):
    """Locally typical sampling, float64: the tokens whose -log p is closest to the entropy H,
    kept until their mass reaches p, renormalised.  -> (q (N, V), whether the row's set is
    clear: no mass within 1e-4 of p at its boundary)."""
    lp = torch.log_softmax(log_probs.double() / temperature, -1)
    entropy = -(lp.exp() * lp).sum(-1, keepdim=True)
    order = (-lp - entropy).abs().argsort(-1)
    mass = lp.gather(-1, order).exp().cumsum(-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], -1)
    keep = torch.zeros_like(lp, dtype=torch.bool).scatter_(-1, order, before < p)
    q = lp.exp() * keep
    return q / q.sum(-1, keepdim=True), ((before - p).abs() > 1e-4).all(-1)


def check_typical_names():
    """decode.DECODERS and decode.SAMPLING (the decoders that draw) hold "typical"; it takes a
    --temperature"""
    import decode

    assert "typical" in decode.DECODERS, "add 'typical' to decode.DECODERS"
    assert "typical" in decode.SAMPLING, "add 'typical' to decode.SAMPLING (the decoders that draw)"
    decode.check_decoder_args("typical", p=0.9, temperature=0.8)


def check_typical_args():
    """check_decoder_args: typical reads --p and refuses it missing or outside (0, 1] in one line"""
    import decode
    from common import UserError

    decode.check_decoder_args("typical", p=0.9)
    for p in (None, 0.0, 1.5):
        try:
            decode.check_decoder_args("typical", p=p)
        except UserError:
            continue
        raise AssertionError(f"--decoder typical with --p {p} is accepted: refuse it (UserError)")


def check_typical_filter():
    """decode.filter_log_probs(..., "typical", p=...) equals the float64 reference at p = 0.2,
    0.5, 0.9, 0.95, peaked and flat rows, temperature 1 and 0.7"""
    import decode

    torch.manual_seed(0)
    for scale in (0.5, 2.0, 5.0):
        log_probs = torch.log_softmax(torch.randn(32, 40) * scale, -1)
        for p in (0.2, 0.5, 0.9, 0.95):
            for temperature in (1.0, 0.7):
                q, clear = typical_reference(log_probs, p, temperature)
                got = decode.filter_log_probs(log_probs, "typical", p=p, temperature=temperature)
                what = f"q at p = {p}, temperature {temperature}, logit scale {scale}"
                close(got.exp()[clear], q[clear], what)


def check_typical_draws():
    """decode(..., "typical", p=0.6) draws the first token at the reference's frequencies"""
    import decode
    import model

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, -1.0, 0.5, -0.5, 0.0, 1.0], dtype=torch.float64)
    cfg = dict(model="lstm", head="softmax", epsilon=None, vocab_size=7, eos_id=2, n_layer=1)
    lm = model.LanguageModel(dict(cfg, d_model=4, dropout=0.0, tie=False)).double()
    with torch.no_grad():
        lm.head.proj.weight.zero_()
        padding = torch.zeros(lm.head.proj.weight.shape[0] - 7, dtype=torch.float64)
        lm.head.proj.bias = torch.nn.Parameter(torch.cat([logits, padding]))
    n = 4000
    g = torch.Generator().manual_seed(0)
    out = decode.decode(lm, [torch.tensor([1])] * n, 1, "typical", p=0.6, generator=g)
    counts = torch.bincount(torch.tensor([x[0] for x in out["tokens"]]), minlength=7).double()
    expected = n * typical_reference(torch.log_softmax(logits, -1)[None], 0.6)[0][0]
    outside = int(counts[expected == 0].sum())
    assert outside == 0, f"{outside} of {n} draws lie outside the typical set"
    kept = expected > 0
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 20.5, (
        f"frequencies {counts.tolist()} against {expected.tolist()} (chi2 {chi2:.1f})"
    )


# --- exercise 3: a dilated gated CNN ----------------------------------------------------------
SHIPPED = ("rnn", "lstm", "gcnn", "gpt")


def new_backbone(kernel_size=3, n_layer=3):
    """(name, the backbone built by model.build_backbone) of the one name added to MODELS."""
    import model

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
    assert name in model.WINDOWED, f"add '{name}' to model.WINDOWED (learned positions: a window)"
    assert name in train.RECIPES, f"give '{name}' its defaults in train.RECIPES"
    cfg = dict(model=name, head="nmst", epsilon=1e-3, vocab_size=30, eos_id=3, n_layer=3)
    cfg.update(d_model=8, dropout=0.0, tie=True, block_size=64, kernel_size=3, n_head=2)
    lm = model.LanguageModel(cfg)
    idx = torch.randint(0, 30, (2, 20))
    log_p = lm(dict(inputs=idx, t=torch.arange(-5, 15).expand(2, 20), targets=idx, mask=None))[0]
    assert torch.isfinite(log_p).all(), "the loss path gives a non-finite log p"


def check_dilated_field():
    """causal, and output t reads exactly inputs t - (k-1)(2^n_layer - 1) .. t (dilations 1, 2,
    4, ...), for k = 2 and 3, n_layer = 3 and 4"""
    for k, n_layer in ((2, 4), (3, 3)):
        _, backbone = new_backbone(k, n_layer)
        T = 24
        idx = torch.randint(0, 30, (1, T))
        with torch.no_grad():
            base = backbone(idx)[0][0]
            reads = []
            for j in range(T):
                other = idx.clone()
                other[0, j] = (other[0, j] + 1) % 30
                changed = (backbone(other)[0][0] - base).abs().amax(-1) > 1e-10
                assert not changed[:j].any(), f"not causal: input {j} changes earlier outputs"
                reads.append(bool(changed[T - 1]))
        field = (k - 1) * (2**n_layer - 1) + 1
        seen = [j for j in range(T) if reads[j]]
        expected = list(range(T - field, T))
        assert seen == expected, (
            f"k = {k}, n_layer = {n_layer}: the last output reads inputs {seen[0]}..{seen[-1]} "
            f"({len(seen)} of them), expected {expected[0]}..{T - 1} ({field})"
        )


def check_dilated_state():
    """the cached state (one token at a time after right-padded prompts, and after reorder_state)
    gives what a full forward gives"""
    _, backbone = new_backbone()
    torch.manual_seed(1)
    idx = torch.randint(0, 30, (2, 30))
    lengths = torch.tensor([12, 5])
    with torch.no_grad():
        full = backbone(idx)[0]
        prompts = idx[:, :12].clone()
        prompts[1, 5:] = 0
        _, state = backbone(prompts, None, lengths)
        state = backbone.reorder_state(state, torch.tensor([1, 0]))
        for i in range(10):
            rows = lengths.flip(0) + i
            tokens = idx.flip(0)[torch.arange(2), rows].unsqueeze(1)
            h, state = backbone(tokens, state)
            expect = full.flip(0)[torch.arange(2), rows]
            close(h[:, 0], expect, f"the cached output {i + 1} token(s) after the prompts")


CHECKS = {
    1: (
        check_logt_names,
        check_logt_formula,
        check_logt_head,
        check_logt_parameter,
        check_logt_learns,
    ),
    2: (check_typical_names, check_typical_args, check_typical_filter, check_typical_draws),
    3: (check_dilated_names, check_dilated_field, check_dilated_state),
}


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
            # A wrong answer may raise anything: that is a finding about the code, not a crash.
            except Exception as e:
                results.append((what, f"{type(e).__name__}: {e}"))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exercise", type=int, choices=sorted(CHECKS))
    parser.add_argument("--root", default=ROOT, help="the code to grade (default: this tree)")
    args = parser.parse_args(argv)
    results = grade(args.exercise, os.path.abspath(args.root))
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
