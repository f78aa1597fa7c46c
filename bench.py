"""Benchmarks that print side-by-side tables (nanoGPT style).  Not tests: figures, not asserts.

    python bench.py train       # train-step tokens/s: LSTM and GPT x softmax / ST / NMST heads
    python bench.py train_hf    # train step: nanogen GPT vs HF GPT2LMHeadModel (--parts: the body
                                # and the output layer, each timed alone)
    python bench.py decode      # greedy and beam-4 tokens/s: nanogen vs HF generate()
    python bench.py fast        # every fast path of fast.py on vs off (what each one pays)
    python bench.py checkpoint  # writing a checkpoint: time, peak extra memory, file size
    python bench.py insnet      # InsNet paper Fig. 12: epoch time vs length, InsNet / IT / L2R
    python bench.py arch        # the survey's RNN / LSTM / GCNN / GPT comparison (costs, speed)
    python bench.py gpu         # on a CUDA machine (after `python -m pytest -q -m cuda`): the GPT-2
                                # 124M bf16 compiled step (tokens/s, MFU) and nanogen vs HF

Every figure is measured on the machine that runs it; the README lists the ones we measured,
with the hardware and the command.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import cli
import fast
import train
from model import WINDOWED, LanguageModel


def cfg_for(model, head, V, **kw):
    cfg = dict(model=model, head=head, epsilon=1e-5, vocab_size=V, eos_id=V - 1, n_layer=2,
               d_model=512, dropout=0.0, tie=True, n_head=12, block_size=1024, bias=True)
    cfg.update(kw)
    return cfg


def timed(fn, warmup, iters, device):
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def alternating(fns, rounds, iters, device):
    """Time every fn `rounds` times, alternating them and who goes first (this box drifts by
    +-5 % within minutes): -> {name: [seconds per call, one per round]}."""
    for fn in fns.values():  # warm-up
        fn()
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(timed(fns[name], 0, iters, device))
    return times


def steps(first, shape):
    return (first + torch.arange(shape[-1])).expand(*shape)


def train_step(lm, x, y, t=None):
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=True)  # as train.py

    def step():
        loss = -lm.target_log_probs(x, y, t).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


# --------------------------------------------------------------------------------------------
# train steps: the heads, and nanogen vs HuggingFace
# --------------------------------------------------------------------------------------------
def bench_train(args):
    device = cli.resolve_device(args.device)
    setups = [("lstm", dict(n_layer=2, d_model=512), 33278, args.batch, args.seq),  # WikiText-2
              ("gpt", dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads),
               50257, 1, 1024)]
    print(f"train step, device {device}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'model':6s} {'shape':>12s} {'V':>6s} {'tokens/step':>11s} " +
          " ".join(f"{h + ' tok/s':>14s}" for h in ("softmax", "st", "nmst")) +
          f" {'st/sm':>6s} {'nmst/sm':>7s}")
    for model, kw, V, B, T in setups:
        if model not in args.models:
            continue
        fns = {}
        for head in ("softmax", "st", "nmst"):
            torch.manual_seed(0)
            lm = LanguageModel(cfg_for(model, head, V, **kw)).to(device).train()
            x, y = (torch.randint(0, V - 1, (B, T), device=device) for _ in range(2))
            fns[head] = train_step(lm, x, y, steps(-8, (B, T)).to(device))
        times = alternating(fns, args.rounds, args.iters, device)
        sec = {h: statistics.median(v) for h, v in times.items()}
        shape = f"{kw['n_layer']}x{kw['d_model']}" + (f" h{kw['n_head']}" if model == "gpt" else "")
        print(f"{model:6s} {shape:>12s} {V:6d} {B * T:11d} " +
              " ".join(f"{B * T / sec[h]:14.0f}" for h in sec) +
              f" {sec['st'] / sec['softmax']:6.2f} {sec['nmst'] / sec['softmax']:7.2f}")
    print("(st/sm, nmst/sm: time of a step relative to the softmax head's, medians of "
          f"{args.rounds} alternating rounds)")


def hf_models(args, device, dropout):
    from transformers import GPT2Config, GPT2LMHeadModel
    from checkpoint import gpt_state_from_hf
    V, L, D, H = 50257, args.gpt_layers, args.gpt_dim, args.gpt_heads
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=1024, n_embd=D, n_layer=L,
                                    n_head=H, resid_pdrop=dropout, embd_pdrop=dropout,
                                    attn_pdrop=dropout)).to(device)
    hf.loss_type = "ForCausalLM"  # (transformers 5 finds none in the class name, and warns)
    lm = LanguageModel(cfg_for("gpt", "softmax", V, eos_id=50256, n_layer=L, d_model=D,
                               n_head=H, dropout=dropout)).to(device)
    lm.load_state_dict(gpt_state_from_hf(hf.state_dict(), lm))
    return hf, lm


def bench_train_hf(args):
    if not has_transformers():
        return
    device = cli.resolve_device(args.device)
    hf, lm = hf_models(args, device, 0.1)
    B, T = args.batch, args.seq
    x = torch.randint(0, 50257, (B, T + 1), device=device)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)

    def hf_step():
        loss = hf(x[:, :T], labels=x[:, :T]).loss  # HF shifts the labels itself
        opt_hf.zero_grad(set_to_none=True)
        loss.backward()
        opt_hf.step()
    times = alternating({"nanogen": train_step(lm.train(), x[:, :T], x[:, 1:]),
                         "HF": hf_step}, args.rounds, args.iters, device)
    ratios = sorted(h / n for n, h in zip(times["nanogen"], times["HF"]))
    med = statistics.median
    print(f"train step, GPT-2 shape {args.gpt_layers}x{args.gpt_dim} h{args.gpt_heads}, "
          f"V=50257, batch {B} x {T} tokens, dropout 0.1, device {device}, threads "
          f"{torch.get_num_threads()}, {args.rounds} alternating rounds of {args.iters} steps")
    print(f"{'nanogen tok/s':>14s} {'HF tok/s':>10s} {'speedup':>8s} {'min':>6s} {'max':>6s}  "
          f"(medians over rounds)")
    print(f"{B * T / med(times['nanogen']):14.0f} {B * T / med(times['HF']):10.0f} "
          f"{med(ratios):8.2f} {ratios[0]:6.2f} {ratios[-1]:6.2f}")
    if args.parts:
        train_step_parts(lm, hf, x[:, :T], x[:, 1:], args, device)


def has_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("this benchmark compares against HuggingFace transformers: pip install transformers")
        return False
    return True


def train_step_parts(lm, hf, idx, targets, args, device):
    """--parts: where a train step's time goes, each piece timed alone (forward + backward), the
    median of --rounds: the transformer body of both models; the output layer + loss as nanogen
    runs it and as linear + cross_entropy (what HF's loss amounts to); the three (N, D) x (D, V)
    matrix products any output layer has to run, and their GFLOP/s."""
    import torch.nn.functional as F
    N, D = idx.numel(), lm.backbone.d_model
    h = torch.randn(N, D, device=device, requires_grad=True)
    W = lm.head.proj.weight.detach().clone().requires_grad_()
    y, g = targets.reshape(-1), torch.randn(*idx.shape, D, device=device)
    z = torch.empty(W.size(0), N, device=device)
    gh, gW = torch.empty(N, D, device=device), torch.empty_like(W)

    def body(model):
        def run():
            out = model(idx)
            (out[0] if isinstance(out, tuple) else out.last_hidden_state).backward(g)
            model.zero_grad(set_to_none=True)
        return run

    def head(fn):
        def run():
            fn().backward()
            h.grad = W.grad = None
        return run

    def products():
        with torch.no_grad():
            torch.mm(W, h.t(), out=z)  # logits
            torch.mm(z.t(), W, out=gh)  # dL/dh
            torch.mm(z, h, out=gW)  # dL/dU
    pieces = (("body: nanogen GPT", body(lm.backbone)),
              ("body: HF GPT2Model", body(hf.transformer)),
              ("output layer: nanogen", head(lambda: -lm.head.target_log_probs(
                  h.unsqueeze(0), y.unsqueeze(0))[0].sum())),
              ("output layer: linear + cross_entropy", head(
                  lambda: F.cross_entropy(F.linear(h, W), y, reduction="sum"))),
              ("its 3 matrix products", products))
    print(f"\nparts (forward + backward, ms, median of {args.rounds} x {args.iters}):")
    for name, fn in pieces:
        fn()
        ms = 1e3 * statistics.median(timed(fn, 0, args.iters, device) for _ in range(args.rounds))
        extra = f"  ({6 * N * D * W.size(0) / ms / 1e6:.0f} GFLOP/s)" if fn is products else ""
        print(f"  {name:38s} {ms:8.1f}{extra}")


def bench_decode(args):
    if not has_transformers():
        return
    from decode import decode
    device = cli.resolve_device(args.device)
    hf, lm = hf_models(args, device, 0.0)
    hf.eval(), lm.eval()
    prompts = torch.randint(0, 50256, (args.prompts, 10), device=device)
    N = args.new_tokens
    print(f"decode, GPT-2 shape {args.gpt_layers}x{args.gpt_dim} h{args.gpt_heads}, V=50257, "
          f"{args.prompts} prompts x 10 tokens, {N} new tokens, device {device}, threads "
          f"{torch.get_num_threads()}")
    print(f"{'decoder':8s} {'nanogen tok/s':>14s} {'HF tok/s':>10s} {'speedup':>8s} "
          f"{'same tokens':>12s}")
    for name, beams in (("greedy", 1), ("beam-4", 4)):
        res = {}

        def ours():
            kw = dict(decoder="greedy") if beams == 1 else dict(decoder="beam", beam_size=beams)
            res["ours"] = decode(lm, prompts, N, **kw)

        def theirs():
            with torch.no_grad():
                res["hf"] = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                        max_new_tokens=N, min_new_tokens=N if beams == 1 else 0,
                                        do_sample=False, num_beams=beams, pad_token_id=50256,
                                        eos_token_id=50256, early_stopping=beams > 1)
        t_ours, t_hf = timed(ours, 1, args.iters, device), timed(theirs, 1, args.iters, device)
        n_ours = sum(len(t) for t in res["ours"]["tokens"])
        n_hf = int((res["hf"][:, 10:] != -1).sum())
        same = "-" if beams > 1 else str(all(res["hf"][i, 10:10 + len(t)].tolist() == t
                                             for i, t in enumerate(res["ours"]["tokens"])))
        print(f"{name:8s} {n_ours / t_ours:14.0f} {n_hf / t_hf:10.0f} "
              f"{(n_ours / t_ours) / (n_hf / t_hf):8.2f} {same:>12s}")


# --------------------------------------------------------------------------------------------
# fast.py: what each fast path pays
# --------------------------------------------------------------------------------------------
def with_switch(name, on, make):
    """make() -> fn, built and run with fast.<name> = on, the other switches on."""
    def run():
        setattr(fast, name, on)
        try:
            fn()
        finally:
            setattr(fast, name, True)
    setattr(fast, name, on)
    fn = make()
    setattr(fast, name, True)
    return run


def bench_fast(args):
    """Each switch of fast.py on vs off, everything else on: a GPT train step (the output
    layer), decoding (the few-row projection), and the allocator setting in fresh processes
    (glibc's setting cannot be undone in one)."""
    device = cli.resolve_device("cpu")
    V, B, T = 50257, args.batch, args.seq
    shape = dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads)
    x = torch.randint(0, V, (B, T + 1))

    def gpt_step():
        torch.manual_seed(0)
        lm = LanguageModel(cfg_for("gpt", "softmax", V, dropout=0.1, **shape)).train()
        return train_step(lm, x[:, :T], x[:, 1:])

    def greedy():
        from decode import decode
        torch.manual_seed(0)
        lm = LanguageModel(cfg_for("gpt", "softmax", V, dropout=0.0, **shape)).eval()
        return lambda: decode(lm, x[:args.prompts, :10], args.new_tokens)
    print(f"fast.py switches on vs off, GPT-2 shape {args.gpt_layers}x{args.gpt_dim}, V={V}, "
          f"batch {B} x {T}, cpu, threads {torch.get_num_threads()}, medians of {args.rounds} "
          f"alternating rounds of {args.iters}")
    print(f"{'switch':20s} {'measured on':24s} {'on (ms)':>9s} {'off (ms)':>9s} {'off/on':>7s}")
    for name, make, what in (("FUSED_OUTPUT_LAYER", gpt_step, "GPT train step"),
                             ("FEW_ROW_PROJECTION", greedy, f"greedy, {args.prompts} prompts")):
        times = alternating({on: with_switch(name, on, make) for on in (True, False)},
                            args.rounds, args.iters, device)
        on, off = (1e3 * statistics.median(times[k]) for k in (True, False))
        print(f"{name:20s} {what:24s} {on:9.1f} {off:9.1f} {off / on:7.2f}", flush=True)
    on, off = (allocator_run(keep, args) for keep in (True, False))
    print(f"{'KEEP_FREED_MEMORY':20s} {'LSTM V=33278 forward':24s} {on:9.1f} {off:9.1f} "
          f"{off / on:7.2f}")


ALLOCATOR_CHILD = """
import statistics, sys, torch, fast, bench
from model import LanguageModel
if {keep}:
    fast.tune_cpu_allocator()
torch.manual_seed(0)
lm = LanguageModel(bench.cfg_for("lstm", "softmax", 33278, d_model=64)).eval()
x = torch.randint(0, 33277, (16, 121))
def step():
    with torch.no_grad():
        lm(x[:, :-1], None)
print(1e3 * statistics.median(bench.timed(step, 1, {iters}, "cpu") for _ in range({rounds})))
"""


def allocator_run(keep, args):
    """ms per full-distribution forward (16 x 120 tokens x V: what decoding and the MoS / CT
    heads allocate), in a fresh process with or without the allocator setting."""
    code = ALLOCATOR_CHILD.format(keep=keep, iters=args.iters, rounds=args.rounds)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), check=True)
    return float(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# checkpoints: the streaming writer against the format-1 one
# --------------------------------------------------------------------------------------------
CHECKPOINT_CHILD = """
import hashlib, io, os, resource, sys, time, torch
sys.path.insert(0, {root!r})
import checkpoint
state = dict(model={{f"w{{i}}": torch.randn({numel}) for i in range(10)}},
             config={{"model": "gpt"}})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if {writer!r} == "torch.save":
    with open({path!r}, "wb") as f:
        torch.save(state, f); f.flush(); os.fsync(f.fileno())
elif {writer!r} == "format 1":  # the writer before the streaming one: pickled to bytes, twice
    buf = io.BytesIO(); torch.save(state, buf); payload = buf.getvalue()
    with open({path!r}, "wb") as f:
        torch.save(dict(format="nanogen-checkpoint-1", sha256=hashlib.sha256(payload).hexdigest(),
                        payload=payload), f); f.flush(); os.fsync(f.fileno())
else:
    checkpoint.save(state, {path!r})
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if {writer!r} != "torch.save":
    checkpoint.load({path!r})
mb = 2 ** 20 if sys.platform == "darwin" else 2 ** 10  # ru_maxrss: bytes on macOS, KiB on Linux
print(dt, (peak - base) / mb, os.path.getsize({path!r}) / 2 ** 20, time.perf_counter() - t0)
"""


def bench_checkpoint(args):
    """Writing a --mb state (ten tensors) with plain torch.save, the format-1 writer and
    checkpoint.save (format 2), each in a fresh process: seconds, peak resident memory above
    the state's, file size, and the time to load it back with the integrity check."""
    import tempfile
    if sys.platform == "win32":
        raise cli.UserError("bench.py checkpoint reads the peak memory with the resource module "
                            "(Linux, macOS), which Windows lacks")
    numel = int(args.mb * 2 ** 20 / 4 / 10)
    root = os.path.dirname(os.path.abspath(__file__))
    print(f"checkpoint of a {args.mb} MB state (10 float32 tensors), {tempfile.gettempdir()}, "
          f"one fresh process per writer")
    print(f"{'writer':14s} {'write s':>8s} {'peak extra MB':>14s} {'file MB':>8s} {'load s':>7s}")
    for writer in ("torch.save", "format 1", "format 2"):
        with tempfile.TemporaryDirectory() as d:
            code = CHECKPOINT_CHILD.format(root=root, numel=numel, writer=writer,
                                           path=os.path.join(d, "ckpt.pt"))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True)
        dt, extra, size, load = map(float, out.stdout.split())
        load_s = "-" if writer == "torch.save" else f"{load:7.2f}"
        print(f"{writer:14s} {dt:8.2f} {extra:14.0f} {size:8.1f} {load_s:>7s}")


# --------------------------------------------------------------------------------------------
# InsNet paper Fig. 12
# --------------------------------------------------------------------------------------------
def bench_insnet(args):
    """InsNet paper Fig. 12 (section 5.1): seconds per training epoch (forward, backward, AdamW)
    on the synthetic benchmark (V = 30000, random sequences) at each length, for InsNet,
    IT-vanilla and the L2R GPT of the same shape, side by side; --plot PATH draws the curves."""
    device = cli.resolve_device(args.device)
    shape = dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads,
                 dropout=0.0, block_size=INSNET_WINDOW)
    cfgs = dict(insnet=dict(shape, model="insnet", vocab_size=30000, max_offset=INSNET_WINDOW),
                insertion_transformer=dict(shape, model="insertion_transformer", vocab_size=30000),
                gpt=cfg_for("gpt", "softmax", 30000, eos_id=2, **shape))
    print(f"seconds per epoch of {args.seqs} sequences (batch {args.batch}, mean of {args.iters} "
          f"epochs after one warm-up; IT-vanilla batch {args.it_batch}, one epoch), "
          f"{shape['n_layer']} x {shape['d_model']}, V=30000, device {device}, threads "
          f"{torch.get_num_threads()}")
    print(f"{'length':>6s} {'InsNet':>9s} {'IT-vanilla':>11s} {'L2R':>9s} {'InsNet/L2R':>11s} "
          f"{'IT/InsNet':>10s}")
    rows = []
    for n in args.lengths:
        t = {name: insnet_epoch_time(name, cfg, n, args, device) for name, cfg in cfgs.items()}
        rows.append((n, t["insnet"], t["insertion_transformer"], t["gpt"]))
        print(f"{n:6d} {t['insnet']:9.2f} {t['insertion_transformer']:11.2f} {t['gpt']:9.2f} "
              f"{t['insnet'] / t['gpt']:11.2f} {t['insertion_transformer'] / t['insnet']:10.1f}",
              flush=True)
    if args.plot:
        plot_insnet(rows, args, shape)


def insnet_epoch_time(name, cfg, n, args, device):
    from data.stories import synthetic
    from tasks import build_model, story_batch, story_nll
    data = synthetic(args.seqs, lengths=(n,), seed=n)
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    it = name == "insertion_transformer"  # minutes per epoch at length 160: timed once
    bs = args.it_batch if it else args.batch
    g = torch.Generator().manual_seed(0)

    def epoch():
        for i in range(0, len(data), bs):
            nll, events = story_nll(model, story_batch(data[i:i + bs], cfg["model"], "random", g,
                                                       device))
            opt.zero_grad(set_to_none=True)
            (nll.sum() / events.sum()).backward()
            opt.step()
    return timed(epoch, 0 if it else 1, 1 if it else args.iters, device)


def plot_insnet(rows, args, shape):
    plt = cli.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for col, label in ((1, "InsNet"), (2, "IT-vanilla"), (3, "L2R")):
        ax.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=label)
    ax.set(xlabel="sequence length", ylabel="seconds per epoch", yscale="log",
           title=f"{args.seqs} sequences / epoch, {shape['n_layer']}x{shape['d_model']}, CPU")
    ax.legend()
    cli.save_figure(fig, args.plot)


# --------------------------------------------------------------------------------------------
# the survey's comparison: recurrent, convolutional, attention (its sections 3.2, 4.2, 5.2)
# --------------------------------------------------------------------------------------------
ARCH = {  # comparable size: each body ~16 D^2 weights at D = 256 (GPT: 24 D^2 at D = 208)
    "rnn": dict(n_layer=8, d_model=256),
    "lstm": dict(n_layer=2, d_model=256),
    "gcnn": dict(n_layer=2, d_model=256, kernel_size=4),
    "gpt": dict(n_layer=2, d_model=208, n_head=4),
}


def arch_costs(model, s, V, T, block):
    """The survey's costs of one architecture: parameters by formula (PyTorch's layers: two LSTM
    bias vectors, no peepholes; GPT with biases and LayerNorms), forward FLOPs per token
    (O(NTD^2), O(LTKD^2), O(LT^2 D) per sequence; 2 FLOPs per multiply-add, the output layer
    2DV apart), sequential steps for a T-token sequence, the path between positions i and i+k
    (k = 16) and the receptive field."""
    N, D, k = s["n_layer"], s["d_model"], s.get("kernel_size", 0)
    body = {"rnn": N * (2 * D * D + 2 * D), "lstm": N * (8 * D * D + 8 * D),
            "gcnn": N * (2 * k * D * D + 4 * D) + block * D + 2 * D,
            "gpt": N * (12 * D * D + 13 * D) + 2 * D + block * D}[model]
    flops = {"rnn": 4 * N * D * D, "lstm": 16 * N * D * D, "gcnn": 4 * k * N * D * D,
             "gpt": 24 * N * D * D + 2 * N * T * D}[model]
    field = (k - 1) * N + 1 if model == "gcnn" else (block if model == "gpt" else "all")
    path = {"rnn": "16", "lstm": "16", "gpt": "1"}.get(model)  # recurrent steps / attention hops
    if model == "gcnn":  # convolution layers, each moving k-1 positions back
        path = str(-(-16 // (k - 1))) if 16 < field else "beyond"
    seq = str(round(T) * N) if model in ("rnn", "lstm") else str(N)  # T per layer, or layers
    return dict(params_formula=body + V * D, flops=flops, flops_out=2 * D * V, sequential=seq,
                path16=path, field=field)


def bench_arch(args):
    """RNN, LSTM, GCNN and GPT at a comparable parameter count on the same data (PTB word-level
    sequence completion, softmax head): the survey's costs beside what they measure here: train
    tokens/s, greedy decode tokens/s, and validation perplexity after the same wall-clock
    training budget (--budget seconds, evaluations included).  --plot: perplexity vs time."""
    import tempfile
    from checkpoint import load
    from tasks import checkpoint_task, model_from_checkpoint
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, s in ARCH.items():
            out = os.path.join(tmp, model)
            flags = [f"--{k}={v}" for k, v in s.items()] + \
                (["--block_size", "256"] if model in WINDOWED else [])
            train.fit_or_stop(["--model", model, "--dataset", "ptb", "--head", "softmax",
                               *flags, "--dropout", "0.1", "--batch_size", "32", "--lr", "2e-3",
                               "--lr_schedule", "constant", "--max_iters", "0", "--max_minutes",
                               str(args.budget / 60), "--eval_interval", str(args.eval_every),
                               "--eval_seqs", "300", "--probe", "0", "--no_curves",  # training
                               "--out_dir", out, "--seed", "0",
                               *(["--data_dir", args.data_dir] if args.data_dir else [])])
            ckpt = load(os.path.join(out, "ckpt_last.pt"))
            task = checkpoint_task(ckpt, args.data_dir)
            lm = model_from_checkpoint(ckpt).eval()
            log = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
            curves[model] = [(r["elapsed_s"], r["val_ppl"]) for r in log]
            rows.append(arch_row(model, s, lm, task, ckpt, log, args))
    print_arch(rows, args)
    if args.plot:
        plot_arch(curves, args)


def arch_row(model, s, lm, task, ckpt, log, args):
    from decode import decode
    split = task.splits["valid"]
    T = float(np.mean(task.splits["train"].lengths - 1))
    res = task.evaluate(lm, "cpu", limit=args.limit)
    prompts = [torch.as_tensor(split.context(i)) for i in range(16)]
    out = decode(lm, prompts, 64)  # the warm-up; greedy: the same tokens at every call
    dec = sum(len(t) for t in out["tokens"]) / timed(lambda: decode(lm, prompts, 64), 0, 3, "cpu")
    steps = ckpt["train_state"]["step"]
    train_tps = float(np.median([r["tokens_per_s"] for r in log]))  # between evaluations
    return dict(model=model, shape=s, counted=lm.num_params(), steps=steps, train_tps=train_tps,
                decode_tps=dec, ppl=res["ppl"], T=T,
                **arch_costs(model, s, task.vocab_size, T, 256))


def print_arch(rows, args):
    validated = f"the first {args.limit}" if args.limit else "all"
    print(f"\nthe survey's comparison on PTB (V=10000, word level, sequence completion), "
          f"{args.budget:g} s of training each (batch 32, lr 2e-3, dropout 0.1), validation on "
          f"{validated} sequences, cpu, threads {torch.get_num_threads()}; "
          f"sequential steps for a T = {rows[0]['T']:.1f}-token sequence (the mean)")
    print(f"{'model':5s} {'shape':14s} {'params (formula)':>16s} {'counted':>9s} "
          f"{'MFLOP/tok body + out':>20s} {'seq. steps':>10s} {'path i->i+16':>12s} "
          f"{'recept. field':>13s} {'train tok/s':>11s} {'decode tok/s':>12s} {'steps':>6s} "
          f"{'val ppl':>8s}")
    for r in rows:
        s = r["shape"]
        kernel = f" k{s['kernel_size']}" if "kernel_size" in s else ""
        shape = f"{s['n_layer']}x{s['d_model']}{kernel}"
        print(f"{r['model']:5s} {shape:14s} {r['params_formula']:16,d} {r['counted']:9,d} "
              f"{r['flops'] / 1e6:10.2f} + {r['flops_out'] / 1e6:7.2f} {r['sequential']:>10s} "
              f"{r['path16']:>12s} {str(r['field']):>13s} {r['train_tps']:11.0f} "
              f"{r['decode_tps']:12.0f} {r['steps']:6d} {r['ppl']:8.1f}")


def plot_arch(curves, args):
    plt = cli.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for model, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=model.upper())
    ax.set(xlabel="training time (s, evaluations included)", ylabel="validation perplexity",
           yscale="log", title="PTB, comparable sizes, CPU")
    ax.legend()
    cli.save_figure(fig, args.plot)


# --------------------------------------------------------------------------------------------
# gpu: the timings on a new GPU machine
# --------------------------------------------------------------------------------------------
def bench_gpu(args):
    """The GPT-2 124M step, then nanogen vs HF (the equalities first: python -m pytest -m cuda)."""
    if not torch.cuda.is_available():
        print("no CUDA device here: `python bench.py gpu` times nanogen's CUDA paths on a GPU "
              "machine (nothing to do)")
        return
    device = cli.resolve_device(args.device)  # (made this process's device by main)
    cli.check_compiler(device)  # the GPT-2 step is compiled: Triton needs a C compiler
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, bf16 native {torch.cuda.is_bf16_supported(False)}")
    gpt2_step(args, device)
    args.gpt_layers, args.gpt_dim, args.gpt_heads = 12, 768, 12  # GPT-2 124M vs HF
    args.iters, args.rounds = min(args.iters, 3), min(args.rounds, 3)
    bench_train_hf(args)
    args.prompts = 32
    bench_decode(args)


def gpt2_step(args, device, B=8, T=1024):
    """GPT-2 124M, bf16 autocast, torch.compile, fused AdamW: tokens/s and MFU."""
    torch.manual_seed(0)
    lm = LanguageModel(cfg_for("gpt", "softmax", 50257, eos_id=50256, n_layer=12, d_model=768,
                               n_head=12, dropout=0.1)).to(device).train()
    train.compile_model(lm)  # as train.py --compile does
    x = torch.randint(0, 50257, (B, T + 1), device=device)
    step = train_step(lm, x[:, :T], x[:, 1:])

    def bf16_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step()
    sec = timed(bf16_step, 3, args.iters * 3, device)
    peak = cli.peak_flops(argparse.Namespace(peak_flops=None, dtype="bfloat16"), device)
    mfu = B * T / sec * lm.flops_per_token(T) / peak if peak else float("nan")
    print(f"GPT-2 124M train step, bf16 autocast, compiled, batch {B} x {T}: "
          f"{B * T / sec:,.0f} tokens/s, {1e3 * sec:.1f} ms/step, MFU {100 * mfu:.1f}% "
          f"(peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s)")


# --------------------------------------------------------------------------------------------
def build_parser():
    def pos(kind, flag):
        return cli.in_range(kind, flag, ">=1")
    p = cli.CLIParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["train", "train_hf", "decode", "fast", "checkpoint", "insnet",
                                    "arch", "gpu"])
    p.add_argument("--device", default="auto")
    p.add_argument("--iters", type=pos(int, "--iters"), default=3)
    p.add_argument("--rounds", type=pos(int, "--rounds"), default=9,
                   help="alternating rounds (the median counts)")
    p.add_argument("--parts", action="store_true", help="train_hf: the body / output layer alone")
    p.add_argument("--models", nargs="+", default=["lstm", "gpt"], choices=["lstm", "gpt"],
                   help="train: which models")
    p.add_argument("--batch", type=pos(int, "--batch"), default=8,
                   help="sequences per batch (train: the lstm row; its gpt row is one sequence)")
    p.add_argument("--seq", type=pos(int, "--seq"), default=128,
                   help="tokens per sequence (train: the lstm row; its gpt row's is 1024)")
    p.add_argument("--gpt_layers", type=pos(int, "--gpt_layers"), default=4)
    p.add_argument("--gpt_dim", type=pos(int, "--gpt_dim"), default=256)
    p.add_argument("--gpt_heads", type=pos(int, "--gpt_heads"), default=4)
    p.add_argument("--prompts", type=pos(int, "--prompts"), default=8,
                   help="decode: prompts decoded together")
    p.add_argument("--new_tokens", type=pos(int, "--new_tokens"), default=64,
                   help="decode: tokens per prompt")
    p.add_argument("--mb", type=cli.in_range(float, "--mb", ">0"), default=500,
                   help="checkpoint: the state's size in MB")
    p.add_argument("--lengths", type=pos(int, "--lengths"), nargs="+",
                   default=[20, 40, 60, 80, 100, 120, 160], help="insnet: sequence lengths")
    p.add_argument("--seqs", type=pos(int, "--seqs"), default=16,
                   help="insnet: sequences per epoch and length")
    p.add_argument("--it_batch", type=pos(int, "--it_batch"), default=2,
                   help="insnet: IT-vanilla batch")
    p.add_argument("--plot", default=None, help="insnet / arch: write the figure to this PNG")
    p.add_argument("--limit", type=pos(int, "--limit"), default=None,
                   help="arch: validation sequences")
    p.add_argument("--data_dir", default=None, help="arch: local dataset folder")
    p.add_argument("--budget", type=cli.in_range(float, "--budget", ">0"), default=120,
                   help="arch: training seconds per model")
    p.add_argument("--eval_every", type=pos(int, "--eval_every"), default=100,
                   help="arch: steps between evaluations")
    return p


GPT_SHAPE = "gpt_layers gpt_dim gpt_heads"
READS = dict(  # the flags each benchmark reads: another one given is refused, not ignored
    train=f"device iters rounds models batch seq {GPT_SHAPE}",
    train_hf=f"device iters rounds parts batch seq {GPT_SHAPE}",
    decode=f"device iters prompts new_tokens {GPT_SHAPE}",
    fast=f"iters rounds batch seq prompts new_tokens {GPT_SHAPE}",  # the CPU's fast paths
    checkpoint="mb", insnet=f"device iters batch seqs it_batch lengths plot {GPT_SHAPE}",
    arch="limit data_dir budget eval_every plot",  # trains on the CPU
    gpu="device iters rounds parts batch seq new_tokens")  # GPT-2 124M, 32 prompts


def check_args(args):
    """Refused before any timing: a flag the benchmark does not read (it would be ignored), a
    GPT shape or a size its models cannot hold."""
    defaults = vars(build_parser().parse_args([args.what]))
    reads = READS[args.what].split()
    if args.what == "train" and "lstm" not in args.models:  # the gpt row: one 1024-token sequence
        reads = [k for k in reads if k not in ("batch", "seq")]
    unread = [k for k, v in vars(args).items() if k != "what" and v != defaults[k]
              and k not in reads]
    if unread:
        raise cli.UserError(f"bench.py {args.what} does not read --{unread[0]} (it reads "
                            f"{', '.join('--' + k for k in reads)})")
    if args.gpt_dim % args.gpt_heads:
        raise cli.UserError(f"--gpt_dim {args.gpt_dim} must be divisible by --gpt_heads "
                            f"{args.gpt_heads}")
    for flag, most in LIMITS.get(args.what, ()):  # said before any timing, not a traceback in it
        value = max(args.lengths) if flag == "lengths" else getattr(args, flag)
        if value > most:
            raise cli.UserError(f"--{flag} {value} does not fit the models of bench.py "
                                f"{args.what}: use --{flag} {most} or less")


WINDOW = 1024  # the GPTs bench.py builds have GPT-2's positions
INSNET_WINDOW = 256  # bench.py insnet's models (the paper's Fig. 12 lengths fit)
LIMITS = dict(  # what the windows allow: 10 prompt tokens + new_tokens - 1, BOS + length + EOS
    train_hf=[("seq", WINDOW)], decode=[("new_tokens", WINDOW - 9)],
    fast=[("seq", WINDOW), ("new_tokens", WINDOW - 9)],
    gpu=[("seq", WINDOW), ("new_tokens", WINDOW - 9)], insnet=[("lengths", INSNET_WINDOW - 2)])


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    cli.check_output(args.plot, "--plot", png=True)
    cli.setup_device(cli.resolve_device(args.device))  # as train.py does, for every model
    globals()[f"bench_{args.what}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
