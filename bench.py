"""Benchmarks that print side-by-side tables (nanoGPT style).  Not tests: figures, not asserts.

    python bench.py train     # train-step tokens/s: LSTM and GPT x softmax / ST / NMST heads
    python bench.py train_hf  # train-step tokens/s: nanogen GPT vs HF GPT2LMHeadModel, same config (--parts:
                              # the body and the output layer, each timed alone)
    python bench.py decode    # batched greedy and beam-4 continuation tokens/s: nanogen vs HF generate()
    python bench.py insnet    # InsNet paper Fig. 12: time per training epoch vs length, InsNet / IT / L2R
    python bench.py table4 --ckpts VA ST NMST   # NMST paper Table 4: r_nt(1000) x 6 decoders, timed

Every figure is measured on the machine that runs it; the README lists the ones we measured,
with the hardware and the command.
"""
import argparse
import os
import statistics
import time

import torch

from evaluate import resolve_device
from model import LanguageModel


def cfg_for(model, head, V, **kw):
    cfg = dict(model=model, head=head, epsilon=1e-5, vocab_size=V, eos_id=V - 1, n_layer=2, d_model=512,
               dropout=0.0, tie=True, n_head=12, block_size=1024, bias=True)
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


def bench_train(args):
    device = resolve_device(args.device)
    setups = [("lstm", dict(n_layer=2, d_model=512), 33278, args.batch, args.seq),  # paper's WikiText-2 LSTM
              ("gpt", dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads), 50257, 1, 1024)]
    print(f"train step, device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'model':6s} {'shape':>22s} {'V':>6s} {'tokens/step':>11s} " +
          " ".join(f"{h + ' tok/s':>14s}" for h in ("softmax", "st", "nmst")) + f" {'st/sm':>6s} {'nmst/sm':>7s}")
    for model, kw, V, B, T in setups:
        if model not in args.models:
            continue
        rates = []
        for head in ("softmax", "st", "nmst"):
            torch.manual_seed(0)
            lm = LanguageModel(cfg_for(model, head, V, **kw)).to(device).train()
            opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=True)  # as train.py
            x = torch.randint(0, V - 1, (B, T), device=device)
            y = torch.randint(0, V, (B, T), device=device)

            def step():
                loss = -lm.target_log_probs(x, y, -8).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            dt = timed(step, 1, args.iters, device)
            rates.append(B * T / dt)
        shape = f"{kw['n_layer']}x{kw['d_model']}" + (f" h{kw['n_head']}" if model == "gpt" else "")
        print(f"{model:6s} {shape:>22s} {V:6d} {B * T:11d} " + " ".join(f"{r:14.0f}" for r in rates) +
              f" {rates[0] / rates[1]:6.2f} {rates[0] / rates[2]:7.2f}")
    print("(st/sm, nmst/sm: time of a step relative to the softmax head's)")


def bench_train_hf(args):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("bench.py train_hf compares against HuggingFace transformers: pip install transformers")
        return
    device = resolve_device(args.device)
    V, B, T = 50257, args.batch, args.seq
    L, D, H = args.gpt_layers, args.gpt_dim, args.gpt_heads
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=1024, n_embd=D, n_layer=L, n_head=H)).to(device).train()
    lm = LanguageModel(cfg_for("gpt", "softmax", V, eos_id=50256, n_layer=L, d_model=D, n_head=H,
                               dropout=0.1)).to(device).train()
    x = torch.randint(0, V, (B, T + 1), device=device)
    steps = {}
    for name, model in (("nanogen", lm), ("HF", hf)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # train.py's optimizer, for both

        def step(model=model, opt=opt):
            if model is hf:
                loss = model(x[:, :T], labels=x[:, :T]).loss  # HF shifts the labels itself
            else:
                loss = -model.target_log_probs(x[:, :T], x[:, 1:], 1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        steps[name] = step
    # alternate the two, `--rounds` times: this box's speed drifts by +-5 % within minutes
    # (other tenants, turbo), more than the difference measured, so each round compares the two
    # under the same conditions, and the median round's ratio is the figure
    for name in steps:  # warm-up
        steps[name]()
    times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):  # who goes first alternates too
            times[name].append(timed(steps[name], 0, args.iters, device))
    ratios = sorted(h / n for n, h in zip(times["nanogen"], times["HF"]))
    median = statistics.median
    print(f"train step, GPT-2 shape {L}x{D} h{H}, V={V}, batch {B} x {T} tokens, dropout 0.1, device {device}, "
          f"threads {torch.get_num_threads()}, {args.rounds} alternating rounds of {args.iters} steps")
    print(f"{'nanogen tok/s':>14s} {'HF tok/s':>10s} {'speedup':>8s} {'min':>6s} {'max':>6s}  (medians over rounds)")
    print(f"{B * T / median(times['nanogen']):14.0f} {B * T / median(times['HF']):10.0f} {median(ratios):8.2f} "
          f"{ratios[0]:6.2f} {ratios[-1]:6.2f}")
    if args.parts:
        train_step_parts(lm, hf, x[:, :T], x[:, 1:], args, device)


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
    V = W.size(0)
    z = torch.empty(V, N, device=device)
    gh, gW = torch.empty(N, D, device=device), torch.empty(V, D, device=device)

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
    pieces = (("body: nanogen GPT", body(lm.backbone)), ("body: HF GPT2Model", body(hf.transformer)),
              ("output layer: nanogen", head(lambda: -lm.head.target_log_probs(h.unsqueeze(0), y.unsqueeze(0))[0].sum())),
              ("output layer: linear + cross_entropy", head(lambda: F.cross_entropy(F.linear(h, W), y, reduction="sum"))),
              ("its 3 matrix products", products))
    print(f"\nparts (forward + backward, ms, median of {args.rounds} x {args.iters}):")
    for name, fn in pieces:
        fn()
        ms = 1e3 * statistics.median(timed(fn, 0, args.iters, device) for _ in range(args.rounds))
        extra = f"  ({3 * 2 * N * D * V / ms / 1e6:.0f} GFLOP/s)" if fn is products else ""
        print(f"  {name:38s} {ms:8.1f}{extra}")


def bench_decode(args):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("bench.py decode compares against HuggingFace transformers: pip install transformers")
        return
    from decode import decode
    from model import gpt_state_from_hf
    device = resolve_device(args.device)
    V = 50257
    torch.manual_seed(0)
    hf_cfg = GPT2Config(vocab_size=V, n_positions=1024, n_embd=args.gpt_dim, n_layer=args.gpt_layers,
                        n_head=args.gpt_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(hf_cfg).to(device).eval()
    lm = LanguageModel(cfg_for("gpt", "softmax", V, eos_id=50256, n_layer=args.gpt_layers, d_model=args.gpt_dim,
                               n_head=args.gpt_heads)).to(device).eval()
    lm.load_state_dict(gpt_state_from_hf(hf.state_dict(), lm))
    prompts = torch.randint(0, V - 1, (args.prompts, 10), device=device)
    N = args.new_tokens
    print(f"decode, GPT-2 shape {args.gpt_layers}x{args.gpt_dim} h{args.gpt_heads}, V={V}, {args.prompts} prompts x 10 "
          f"tokens, {N} new tokens, device {device}, threads {torch.get_num_threads()}")
    print(f"{'decoder':8s} {'nanogen tok/s':>14s} {'HF tok/s':>10s} {'speedup':>8s} {'same tokens':>12s}")
    for name, beams in (("greedy", 1), ("beam-4", 4)):
        res = {}

        def ours():
            kw = dict(decoder="greedy") if beams == 1 else dict(decoder="beam", beam_size=beams)
            res["ours"] = decode(lm, prompts, N, **kw)

        def theirs():
            with torch.no_grad():
                res["hf"] = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=N,
                                        min_new_tokens=N if beams == 1 else 0, do_sample=False, num_beams=beams,
                                        pad_token_id=50256, eos_token_id=50256,
                                        early_stopping=True if beams > 1 else False)
        t_ours = timed(ours, 1, args.iters, device)
        t_hf = timed(theirs, 1, args.iters, device)
        n_ours = sum(len(t) for t in res["ours"]["tokens"])
        n_hf = int((res["hf"][:, 10:] != -1).sum())
        same = "-"
        if beams == 1:
            same = str(all(res["hf"][i, 10:10 + len(t)].tolist() == t for i, t in enumerate(res["ours"]["tokens"])))
        print(f"{name:8s} {n_ours / t_ours:14.0f} {n_hf / t_hf:10.0f} {(n_ours / t_ours) / (n_hf / t_hf):8.2f} "
              f"{same:>12s}")


def bench_insnet(args):
    """InsNet paper Fig. 12 (section 5.1): seconds per training epoch (forward, backward, AdamW) on
    the synthetic benchmark (V = 30000, random sequences) at each length, for InsNet, IT-vanilla
    and the L2R GPT of the same shape, side by side; --plot PATH draws the curves."""
    from data.stories import synthetic
    from evaluate import story_model, story_nll
    device = resolve_device(args.device)
    shape = dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads, dropout=0.0, block_size=256)
    cfgs = dict(insnet=dict(shape, model="insnet", vocab_size=30000, max_offset=256),
                insertion_transformer=dict(shape, model="insertion_transformer", vocab_size=30000),
                gpt=cfg_for("gpt", "softmax", 30000, eos_id=2, **shape))
    print(f"seconds per epoch of {args.seqs} sequences (batch {args.batch}, mean of {args.iters} epochs after one "
          f"warm-up; IT-vanilla batch {args.it_batch}, one epoch), "
          f"{shape['n_layer']} x {shape['d_model']}, V=30000, device {device}, threads {torch.get_num_threads()}")
    print(f"{'length':>6s} {'InsNet':>9s} {'IT-vanilla':>11s} {'L2R':>9s} {'InsNet/L2R':>11s} {'IT/InsNet':>10s}")
    rows = []
    for n in args.lengths:
        data = synthetic(args.seqs, lengths=(n,), seed=n)
        t = {}
        for name, cfg in cfgs.items():
            torch.manual_seed(0)
            model = story_model(cfg).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            bs = args.it_batch if name == "insertion_transformer" else args.batch
            g = torch.Generator().manual_seed(0)

            def epoch():
                for i in range(0, len(data), bs):
                    nll, events = story_nll(model, data[i:i + bs], "random", g, device)
                    opt.zero_grad(set_to_none=True)
                    (nll.sum() / events.sum()).backward()
                    opt.step()

            it = name == "insertion_transformer"  # minutes per epoch at length 160: timed once
            t[name] = timed(epoch, 0 if it else 1, 1 if it else args.iters, device)
        rows.append((n, t["insnet"], t["insertion_transformer"], t["gpt"]))
        print(f"{n:6d} {t['insnet']:9.2f} {t['insertion_transformer']:11.2f} {t['gpt']:9.2f} "
              f"{t['insnet'] / t['gpt']:11.2f} {t['insertion_transformer'] / t['insnet']:10.1f}", flush=True)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for col, label in ((1, "InsNet"), (2, "IT-vanilla"), (3, "L2R")):
            ax.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=label)
        ax.set(xlabel="sequence length", ylabel="seconds per epoch", yscale="log",
               title=f"{args.seqs} sequences / epoch, {shape['n_layer']}x{shape['d_model']}, CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


TABLE4 = (("top-2", "topk", dict(k=2)), ("top-4", "topk", dict(k=4)), ("nucleus-0.2", "nucleus", dict(p=0.2)),
          ("nucleus-0.4", "nucleus", dict(p=0.4)), ("beam-2", "beam", dict(beam_size=2)),
          ("beam-4", "beam", dict(beam_size=4)))


def bench_table4(args):
    """NMST paper Table 4: r_nt(L) of every checkpoint (VA / ST / NMST) under top-{2,4},
    nucleus-{0.2,0.4} and beam-{2,4} on the validation contexts, mean +- std over --runs seeds
    (beam search is deterministic: run once), with the wall time of every cell and of the grid."""
    from types import SimpleNamespace

    from data.loader import load
    from evaluate import decoding_study, detokenizer
    from model import load_checkpoint, model_from_checkpoint
    if not args.ckpts:
        raise SystemExit("bench.py table4 needs --ckpts CKPT [CKPT ...] (e.g. the VA, ST and NMST checkpoints)")
    device = resolve_device(args.device)
    cells, seconds = {}, {}
    grid_t0 = time.perf_counter()
    for path in args.ckpts:
        ckpt = load_checkpoint(path)
        meta, splits = load(ckpt["args"]["dataset"], args.data_dir)
        split, lm = splits["valid"], model_from_checkpoint(ckpt).to(device).eval()
        cfg = ckpt["config"]
        row = cfg["head"] + ("" if cfg["head"] == "softmax" else f" {cfg['epsilon']:.0e}")
        detok = detokenizer(meta, os.path.dirname(split.tokens.filename))
        for name, decoder, kw in TABLE4:
            t0, r_nt = time.perf_counter(), []
            for seed in range(1 if decoder == "beam" else args.runs):
                study_args = SimpleNamespace(limit=args.limit, L=[args.L], seed=seed, decode_batch=args.decode_batch,
                                             decoder=decoder, k=kw.get("k"), p=kw.get("p"),
                                             beam_size=kw.get("beam_size"), temperature=1.0, consistent=False,
                                             length_penalty=0.0, examples=0)
                stats = decoding_study(lm, split, study_args, meta["context_len"], detok, device)
                r_nt.append(stats["r_nt"][args.L])
            cells[row, name] = r_nt
            seconds[row, name] = time.perf_counter() - t0
            print(f"{row} {name}: r_nt({args.L}) {statistics.mean(r_nt):.3f} ({seconds[row, name]:.0f} s)", flush=True)
    total = time.perf_counter() - grid_t0
    rows = list(dict.fromkeys(r for r, _ in cells))
    print(f"\nTable 4: r_nt({args.L}), mean +- std over {args.runs} run(s) (beam: 1), "
          f"{args.limit or 'all'} validation contexts, device {device}, threads {torch.get_num_threads()}")
    print(f"{'head':12s} " + " ".join(f"{name:>13s}" for name, _, _ in TABLE4))
    for r in rows:
        print(f"{r:12s} " + " ".join(f"{statistics.mean(v):6.3f}+-{statistics.pstdev(v):.3f}"
                                     for v in (cells[r, name] for name, _, _ in TABLE4)))
    print(f"{'seconds':12s} " + " ".join(f"{name:>13s}" for name, _, _ in TABLE4))
    for r in rows:
        print(f"{r:12s} " + " ".join(f"{seconds[r, name]:13.0f}" for name, _, _ in TABLE4))
    print(f"grid: {len(cells)} cells in {total:.0f} s ({total / 60:.1f} min)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["train", "train_hf", "decode", "insnet", "table4"])
    p.add_argument("--device", default="auto")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=9, help="train_hf: alternating rounds; the median round's speedup counts")
    p.add_argument("--parts", action="store_true", help="train_hf: also time the body and output layer alone")
    p.add_argument("--models", nargs="+", default=["lstm", "gpt"])
    p.add_argument("--batch", type=int, default=32, help="sequences per batch (train: LSTM; train_hf: GPT)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (train: LSTM; train_hf: GPT)")
    p.add_argument("--gpt_layers", type=int, default=12)
    p.add_argument("--gpt_dim", type=int, default=768)
    p.add_argument("--gpt_heads", type=int, default=12)
    p.add_argument("--prompts", type=int, default=8, help="decode: prompts decoded together")
    p.add_argument("--new_tokens", type=int, default=64, help="decode: tokens generated per prompt")
    p.add_argument("--lengths", type=int, nargs="+", default=[20, 40, 60, 80, 100, 120, 160], help="insnet")
    p.add_argument("--seqs", type=int, default=16, help="insnet: sequences per epoch and length (paper 25000)")
    p.add_argument("--it_batch", type=int, default=2, help="insnet: IT-vanilla batch (it encodes every canvas)")
    p.add_argument("--plot", default=None, help="insnet: write the Fig. 12 curves to this PNG")
    p.add_argument("--ckpts", nargs="+", default=None, help="table4: the checkpoints (VA, ST, NMST)")
    p.add_argument("--limit", type=int, default=None, help="table4: first N validation contexts (default all)")
    p.add_argument("--L", type=int, default=1000, help="table4: maximum continuation length")
    p.add_argument("--runs", type=int, default=1, help="table4: seeds per sampling decoder (paper: 10)")
    p.add_argument("--decode_batch", type=int, default=64, help="table4: prompts decoded together")
    p.add_argument("--data_dir", default=None,
                   help="table4: local dataset folder (default: $NANOGEN_DATA, else download)")
    args = p.parse_args()
    {"train": bench_train, "train_hf": bench_train_hf, "decode": bench_decode, "insnet": bench_insnet,
     "table4": bench_table4}[args.what](args)


if __name__ == "__main__":
    main()
