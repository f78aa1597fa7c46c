"""Benchmarks that print side-by-side tables.  Not tests: figures, not asserts."""

#   python bench.py train      # train-step tokens/s: LSTM and GPT x the heads, and plain PyTorch
#   python bench.py batches    # the (B, T) shapes and padding of an epoch of --max_tokens batches
#   python bench.py decode     # greedy and beam-4 tokens/s: nanogen against HF generate()
#   python bench.py insnet     # InsNet paper Fig. 12: epoch time by length, InsNet / IT / L2R
#   python bench.py arch       # the survey's RNN / LSTM / GCNN / GPT side by side on PTB
#   python bench.py gpu        # on a GPU: the train table at GPT-2 124M (eager, compiled; MFU)
#   python bench.py authors --authors_src PATH   # --protocol authors against the authors' code
#   python bench.py padding    # an authors' epoch against a paper's, real tokens alone and dense
#
# Every figure is of the machine that runs it; RESULTS.md has ours, with their commands.

import argparse
import contextlib
import dataclasses
import importlib.util
import math
import os
import statistics
import tempfile
import time

import torch

import common
import config
import curves
import evaluate
import insnet
import train
from common import check_output
from data import loader
from data.loader import batches, bucket, epoch_batches, load, load_data, story_batch
from data.prepare import DATASETS
from data.stories import synthetic
from decode import decode
from heads import paper_name
from model import LanguageModel, gpt_state_from_hf


# A model's config (train.model_config's dict) at the NMST paper's LSTM shape; kw over it.
def cfg_for(model, head, V, **kw):
    cfg = dict(model=model, head=head, epsilon=1e-5, vocab_size=V, eos_id=V - 1, n_layer=2)
    cfg.update(d_model=512, dropout=0.0, tie=True, n_head=12, block_size=1024, bias=True)
    return cfg | kw


# The GPT shape of the flags.
def gpt_shape(args):
    return dict(n_layer=args.gpt_layers, d_model=args.gpt_dim, n_head=args.gpt_heads)


# Seconds per call of fn, after `warmup` calls (a GPU synchronised around the clock).
def timed(fn, warmup, iters, device):
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


# Median seconds per call of every fn over `rounds` rounds, alternating them and who goes first
# (a CPU box drifts by +-5 % within minutes).
def alternating(fns, rounds, iters, device):
    for fn in fns.values():  # warm-up
        fn()
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(timed(fns[name], 0, iters, device))
    return {name: statistics.median(t) for name, t in times.items()}


# A training step as train.py runs one (one call of the model, eq. 3, AdamW fused), or of another
# model's `loss()`.
def train_step(model, x, y, t=None, ctx=None, loss=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with ctx or contextlib.nullcontext():
            value = loss() if loss else -model(dict(inputs=x, t=t, targets=y, mask=None))[0].mean()
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()

    return step


# The same step in plain PyTorch at the same shape and V: for the LSTM pytorch/examples' word LM
# (nn.Embedding, nn.LSTM, a tied nn.Linear, cross_entropy: written here), for the GPT
# HuggingFace's GPT2LMHeadModel (its logits, the same cross_entropy).
def reference_step(model, args, x, y, ctx=None):
    torch.manual_seed(0)
    if model == "gpt":
        net = hf_models(args, x.device, 0.0)[0]

        def logits():
            return net(x).logits

    else:
        lstm = torch.nn.LSTM(512, 512, 2, batch_first=True)
        layers = [torch.nn.Embedding(33278, 512), lstm, torch.nn.Linear(512, 33278)]
        net = torch.nn.ModuleList(layers).to(x.device)
        net[2].weight = net[0].weight

        def logits():
            return net[2](net[1](net[0](x))[0])

    def loss():
        return torch.nn.functional.cross_entropy(logits().flatten(0, 1).float(), y.flatten())

    return train_step(net, x, y, ctx=ctx, loss=loss)


# Tokens/s of a train step by head (ST / NMST cost what softmax costs; --compile: softmax as
# train.py --compile compiles it, and static; 1st step's s) beside plain PyTorch at the same shape
# (reference_step): the LSTM in float32, the GPT under `ctx` (gpu: bf16 autocast); MFU.
def bench_train(args, device, ctx=None):
    heads = ["softmax", "st", "nmst"]
    if args.compile:
        heads += ["compiled", "static"]
    heads.append("reference")
    print(
        f"train step, {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"medians of {args.rounds} alternating rounds\n{'model':5s} {'V':>6s} {'B x T':>9s} "
        + " ".join(f"{h:>9s}" for h in heads)
        + " (tok/s)  softmax/reference  MFU"
    )
    for model, kw, V, B, T in (
        ("gpt", gpt_shape(args), 50257, args.gpt_batch, 1024),
        ("lstm", dict(n_layer=2, d_model=512), 33278, args.batch, args.seq),
    ):
        x, y = (torch.randint(0, V - 1, (B, T), device=device) for _ in range(2))
        t, fns = (torch.arange(T, device=device) - 8).expand(B, T), {}
        c = ctx if model == "gpt" else None  # (the recurrent layers run in float32 anyway)
        for head in heads[:-1]:
            torch.manual_seed(0)
            compiled = head in ("compiled", "static")  # train.py --compile's; static shapes
            lm = LanguageModel(cfg_for(model, "softmax" if compiled else head, V, **kw))
            lm.to(device).train()
            net = lm
            if compiled:
                graphs = device.startswith("cuda")
                net = common.compile_model(lm, dynamic=head == "compiled", graphs=graphs)
            fns[head] = train_step(net, x, y, t, c)
        fns["reference"] = reference_step(model, args, x, y, c)
        first = {h: timed(fns[h], 0, 1, device) for h in heads if h in ("compiled", "static")}
        sec = alternating(fns, args.rounds, args.iters, device)
        peak = common.peak_flops(device, "bfloat16" if c else "float32")
        mfu = [
            f"{h} {100 * B * T / sec[h] * lm.flops_per_token(T) / peak:.1f}%"
            for h in heads
            if peak and h in ("softmax", "compiled", "static")
        ]
        print(
            f"{model:5s} {V:6d} {f'{B} x {T}':>9s} "
            + " ".join(f"{B * T / sec[h]:9.0f}" for h in heads)
            + f" {sec['reference'] / sec['softmax']:18.2f}  {' '.join(mfu) or '-'}"
            + "".join(f"; 1st {h} step {s:.1f} s" for h, s in first.items())
        )


# HF's GPT2LMHeadModel and nanogen's GPT with the same (random) weights.
def hf_models(args, device, dropout):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    drop = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    shape = dict(n_embd=args.gpt_dim, n_layer=args.gpt_layers, n_head=args.gpt_heads)
    hf = GPT2LMHeadModel(GPT2Config(**shape, **drop)).to(device)
    # (transformers 5 finds no loss type in the class name, and warns)
    hf.loss_type = "ForCausalLM"
    cfg = cfg_for("gpt", "softmax", 50257, eos_id=50256, dropout=dropout, **gpt_shape(args))
    lm = LanguageModel(cfg)
    lm.load_state_dict(gpt_state_from_hf(hf.state_dict(), lm))
    return hf, lm.to(device)


# Greedy and beam-4 decoding, nanogen against HF generate() (greedy: the same tokens).
def bench_decode(args, device):
    hf, lm = (m.eval() for m in hf_models(args, device, 0.0))
    prompts, N = torch.randint(0, 50256, (args.prompts, 10), device=device), args.new_tokens
    print(
        f"decode, GPT-2 shape {args.gpt_layers}x{args.gpt_dim} h{args.gpt_heads}, V=50257, "
        f"{args.prompts} prompts x 10 tokens, {N} new tokens, {device}\n{'decoder':8s} "
        f"{'nanogen tok/s':>14s} {'HF tok/s':>10s} {'speedup':>8s} {'same tokens':>12s}"
    )
    for name, beams in (("greedy", 1), ("beam-4", 4)):
        res = {}
        decoder, beam_size = ("beam", beams) if beams > 1 else ("greedy", None)
        # HF's generate() as nanogen decodes: N new tokens (greedy: all N), eos = pad = 50256.
        hf_kw = dict(max_new_tokens=N, num_beams=beams, min_new_tokens=N if beams == 1 else 0)
        hf_kw.update(do_sample=False, pad_token_id=50256, eos_token_id=50256)

        def ours():
            res["ours"] = decode(lm, prompts, N, decoder, beam_size=beam_size)

        def theirs():
            mask = torch.ones_like(prompts)
            res["hf"] = hf.generate(prompts, attention_mask=mask, early_stopping=beams > 1, **hf_kw)

        with torch.no_grad():
            t_ours, t_hf = timed(ours, 1, args.iters, device), timed(theirs, 1, args.iters, device)
        ours_tokens = res["ours"]["tokens"]
        n_ours, n_hf = sum(map(len, ours_tokens)), res["hf"][:, 10:].numel()
        # Greedy: whether both picked the same tokens (HF's rows hold the 10 prompt tokens first).
        same = "-"
        if beams == 1:
            hf_rows = [res["hf"][i, 10 : 10 + len(t)].tolist() for i, t in enumerate(ours_tokens)]
            same = str(hf_rows == ours_tokens)
        print(
            f"{name:8s} {n_ours / t_ours:14.0f} {n_hf / t_hf:10.0f} "
            f"{n_ours / t_ours / (n_hf / t_hf):8.2f} {same:>12s}"
        )


# InsNet paper Fig. 12 (section 5.1): seconds per training epoch (forward, backward, AdamW) on
# the synthetic benchmark (V = 30000) at each length: InsNet, IT-vanilla, and the L2R GPT of the
# same shape.  -> the table's lines (printed; --plot: the figure).
def bench_insnet(args, device):
    shape = dict(gpt_shape(args), dropout=0.0, block_size=256, max_offset=256, vocab_size=30000)
    lines = [
        f"seconds per epoch of {args.seqs} sequences (batch {args.batch}, mean of {args.iters}"
        f" epochs after one warm-up; IT-vanilla batch {args.it_batch}, one epoch), "
        f"{args.gpt_layers} x {args.gpt_dim}, V=30000, {device}, threads "
        f"{torch.get_num_threads()}",
        f"{'length':>6s} {'InsNet':>9s} {'IT-vanilla':>11s} "
        f"{'L2R':>9s} {'InsNet/L2R':>11s} {'IT/InsNet':>10s}",
    ]
    print("\n".join(lines))
    rows = []
    for n in args.lengths:
        cfg = dict(cfg_for("gpt", "softmax", 30000, eos_id=2), **shape)
        models = ("insnet", "insertion_transformer", "gpt")
        t = [epoch_time(m, dict(cfg, model=m), n, args, device) for m in models]
        rows.append((n, *t))
        lines.append(
            f"{n:6d} {t[0]:9.2f} {t[1]:11.2f} {t[2]:9.2f} {t[0] / t[2]:11.2f} {t[1] / t[0]:10.1f}"
        )
        print(lines[-1], flush=True)
    if args.plot:
        title = f"{args.seqs} sequences / epoch, {args.gpt_layers}x{args.gpt_dim}, {device}"
        curves.epoch_times(rows, title, args.plot)
    return lines


def epoch_time(name, cfg, n, args, device):
    data, it = synthetic(args.seqs, lengths=(n,), seed=n), name == "insertion_transformer"
    torch.manual_seed(0)
    model = insnet.INSERTION.get(cfg["model"], LanguageModel)(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bs = args.it_batch if it else args.batch
    g = torch.Generator().manual_seed(0)

    def epoch():
        for i in range(0, len(data), bs):
            batch = story_batch(data[i : i + bs], name != "gpt", "random", g, device)
            log_p, mask, _ = model(batch)
            opt.zero_grad(set_to_none=True)
            (-torch.where(mask, log_p, 0.0).sum() / batch["n"]).backward()
            opt.step()

    return timed(epoch, 0 if it else 1, 1 if it else args.iters, device)  # IT: minutes at 160


ARCH = (("rnn", 8, 256), ("lstm", 2, 256), ("gcnn", 2, 256), ("gpt", 2, 208))


# The survey's recurrent, convolutional and attention backbones at comparable sizes (each body
# ~16 D^2 weights) trained on PTB for the same --budget seconds: parameters, training and
# greedy-decoding tokens/s, validation perplexity.
def bench_arch(args, device):
    rows = [
        f"PTB, word level, {args.budget:g} s of training each (batch 32, lr 2e-3, dropout "
        f"0.1), {device}, threads {torch.get_num_threads()}\n{'model':5s} {'shape':8s} "
        f"{'params':>10s} {'train tok/s':>11s} {'decode tok/s':>12s} {'steps':>6s} val ppl"
    ]
    for model, n_layer, d_model in ARCH:
        with tempfile.TemporaryDirectory() as out:
            flags = (
                f"--model {model} --dataset ptb --n_layer {n_layer} --d_model {d_model} "
                f"--n_head 4 --block_size 256 --dropout 0.1 --batch_size 32 --lr 2e-3 "
                f"--lr_schedule constant --max_iters 0 --max_minutes {args.budget / 60} "
                f"--probe 0 --no_curves --eval_interval {args.eval_every} --eval_seqs 300"
            ).split()
            train.main([*flags, "--out_dir", out, "--device", device])
            ckpt, run, data, lm = evaluate.load_run(f"{out}/ckpt_last.pt", device=device)
            log = curves.read_log(os.path.join(out, "log.jsonl"))
        prompts = [torch.as_tensor(data["valid"].context(i), device=device) for i in range(16)]
        n = sum(map(len, decode(lm, prompts, 64)["tokens"]))  # (the warm-up; greedy: the same)
        tps = n / timed(lambda: decode(lm, prompts, 64), 0, 3, device)
        ppl = evaluate.perplexity(run, lm, data, "valid", 1000, device)["ppl"]
        rows.append(
            f"{model:5s} {f'{n_layer}x{d_model}':8s} {lm.num_params():10,d} "
            f"{statistics.median(r['tokens_per_s'] for r in log):11.0f} {tps:12.0f} "
            f"{ckpt['state']['step']:6d} {ppl:8.1f}"
        )
    print("\n".join(rows))  # (the table after the runs' own lines)


# On a GPU: the train-step table at the NMST paper's LSTM (2 x 512, 32 x 128, float32) and GPT-2
# 124M (8 x 1024, bf16 autocast), eager and compiled; then decoding against HF.
def bench_gpu(args, device):
    if not device.startswith("cuda"):
        print("no CUDA device here: bench.py gpu times nanogen's CUDA paths (nothing to do)")
        return
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    vars(args).update(
        gpt_layers=12, gpt_dim=768, gpt_heads=12, gpt_batch=8, batch=32, prompts=32, compile=True
    )
    bench_train(args, device, torch.autocast("cuda", dtype=torch.bfloat16))
    bench_decode(args, device)


# One epoch of --max_tokens batches as train.py makes them (data/loader.batches: T rounded up to
# its bucket, B = max_tokens // T): their (B, T) shapes and the padding they cost.
def bench_batches(args, device):
    _, splits, _ = load(args.dataset, verbose=False)
    print(
        f"{args.dataset}, --max_tokens {args.max_tokens}, window 1024\n{'split':6s} "
        f"{'batches':>8s} {'shapes':>7s} {'padding':>8s} {'real tokens a batch':>20s}"
    )
    for name, split in splits.items():
        keys = batches(split.lengths, max_tokens=args.max_tokens, max_len=1024)
        shapes = [(len(k), int(bucket(split.lengths[k].max() - 1, 1024))) for k in keys]
        real = int(sum(split.lengths[k].sum() - len(k) for k in keys))
        waste, per_batch = 100 - 100 * real / sum(b * t for b, t in shapes), real / len(keys)
        print(f"{name:6s} {len(keys):8d} {len(set(shapes)):7d} {waste:7.1f}% {per_batch:20.0f}")


# The authors' model of each head (their model_utils.py).
THEIR_CLASSES = dict(softmax="VanillaLM", st="SelfTerminatingLM", nmst="NonMonotonicSTLM")


def authors_pair(theirs, head, tokens, batch, cpad):
    # One head both ways on the batch (tokens in their ids, V + 1 = theirs with <pad>), float64,
    # nanogen's seeded --protocol authors weights in both; each loss divided as each divides it,
    # 4 lines at a time (a float64 row of V: 0.27 MB a position).
    # -> (-log p (B, T): nanogen's, theirs; the gradients' pairs; the divisors)
    V = len(theirs.lookup.weight) - 1
    torch.manual_seed(0)
    ours = LanguageModel(cfg_for("rnn", head, V + 1, d_model=256, protocol="authors")).double()
    with torch.no_grad():
        # (their nn.Embedding(padding_idx) starts <pad>'s row at 0)
        ours.backbone.wte.weight[V - 1] = 0
    state = {k.replace("wte.", "lookup."): v for k, v in ours.backbone.state_dict().items()}
    state["lookup.weight"] = state["projection.weight"] = state["lookup.weight"][: V + 1]
    theirs.load_state_dict(state)
    # Their loss and divisor: utils.py:48-51 (the criterion), train.py:61-62, 66, 69.
    criterion = torch.nn.CrossEntropyLoss if head == "softmax" else torch.nn.NLLLoss
    targets = tokens[:, 1:]
    n = int(targets.ne(V - 1).count_nonzero()) - int(targets.eq(cpad).count_nonzero())
    nll = torch.zeros(targets.shape, dtype=torch.float64)
    loss = torch.zeros_like(nll)
    for rows in torch.arange(len(tokens)).split(4):
        x, y, mask = tokens[rows, :-1], targets[rows], batch["mask"][rows]
        scored = ours(dict(inputs=x, t=batch["t"][rows], targets=y, mask=None))[0]
        part = -torch.where(mask, scored, 0.0)
        (part.sum() / batch["n_authors"]).backward()
        out = theirs(x).flatten(0, 1)
        theirs_part = criterion(ignore_index=V - 1, reduction="none")(out, y.flatten())
        (theirs_part.sum() / n).backward()
        nll[rows], loss[rows] = part.detach(), theirs_part.detach().view(y.shape)
    # Their parameters by name: lookup (U tied to it) and the RNN's; nanogen's V + 1 rows of wte.
    mine = dict(ours.backbone.named_parameters())
    grads = [
        (mine[k.replace("lookup", "wte")].grad[: len(q)], q.grad)
        for k, q in theirs.named_parameters()
    ]
    return nll, loss, grads, (batch["n_authors"], n)


def bench_authors(args, device):
    # NMST Table 1's objective: nanogen's --protocol authors beside the authors' own functions
    # (model_utils.py of --authors_src, their src/wiki2, loaded from its file) on the authors'
    # first WikiText-2 batch, float64, on the CPU.
    path = os.path.join(args.authors_src or "", "model_utils.py")
    if not os.path.isfile(path):
        raise common.UserError("bench.py authors: --authors_src is the authors' src/wiki2 folder")
    spec = importlib.util.spec_from_file_location("model_utils", path)
    their_code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(their_code)
    argv = "--model rnn --dataset wikitext2 --protocol authors".split()
    run = config.get_args(argv, train.RECIPES, train.AUTHORS)[0]
    data = load_data(run, verbose=False)
    b = evaluate.get_batch(run, data, epoch_batches(run, data, 0)[0], "cpu", "train")
    # Their ids: eos last (their ST reads logits[:eos]), <pad> before it; nanogen's eos is 0.
    V = data["vocab_size"]
    real = torch.arange(b["tokens"].size(1)) < b["lengths"].unsqueeze(1)
    tokens = torch.where(real, torch.where(b["tokens"] == 0, V, b["tokens"] - 1), V - 1)
    cpad = data["vocab"]["tokens"].index("<cpad>") - 1
    kw = dict(num_embeddings=V + 1, output_dim=V + 1, eos_idx=V, pad_idx=V - 1, rnn_type="nn.RNN")
    kw.update(embedding_dim=256, hidden_size=256, num_layers=2, dropout=0.0, rnn_dropout=0.0)
    kw.update(tie_weights=1, epsilon=1e-5, mask_context_k=10)
    context = b["mask"] & (b["t"] <= 0)
    print(
        f"the authors' first WikiText-2 batch (B x T = {tuple(b['inputs'].shape)}), "
        f"{int(b['mask'].sum())} targets ({int(context.sum())} in the context), 2 x 256 RNN, "
        f"eps 1e-5, seed 0, float64; torch {torch.__version__}\n"
        f"{'head':6s} {'divisor ours / theirs':>21s} {'p<=1e-20':>8s} {'max |d log p|':>13s} "
        f"{'(context)':>9s} {'max |d grad|':>12s} {'max |grad|':>10s}"
    )
    for head, name in THEIR_CLASSES.items():
        theirs = getattr(their_code, name)(argparse.Namespace(**kw)).double()
        ours, loss, grads, divisors = authors_pair(theirs, head, tokens, b, cpad)
        d = (ours - loss).abs()
        floored = int((b["mask"] & (loss > -math.log(1e-20) - 1e-9)).sum())
        print(
            f"{paper_name(head):6s} {f'{divisors[0]} / {divisors[1]}':>21s} {floored:8d} "
            f"{float(d[b['mask']].max()):13.1e} {float(d[context].max()):9.1e} "
            f"{max(float((p - q).abs().max()) for p, q in grads):12.1e} "
            f"{max(float(q.abs().max()) for _, q in grads):10.2f}"
        )


def bench_padding(args, device):
    # NMST Table 1's RNN (2 x 256, NMST head) on WikiText-2, one train.py step a batch: the
    # authors' protocol (random batches of 32 lines, each padded to its longest, context targets
    # counted) against the paper's (batches of like lengths), computing the real tokens alone
    # ("real": on a GPU the RNN packed too) or every padded position ("dense": the output
    # layer on all, the RNN unpacked).
    # An epoch's seconds: the mean step of --steps batches (the middle one of each of --steps
    # equal slices of the epoch's batches sorted by width), times the epoch's batches.
    runs = {p: padding_run(p, device, args.steps) for p in ("paper", "authors")}
    sec = {(p, way): 0.0 for p in runs for way in ("dense", "real")}
    st, since = train.Counters(lr=1e-3), dict(nll=0.0, n=0, tokens=0)
    # Side by side: each slice's batch of both protocols, both ways, in alternating order (the
    # first round is a warm-up, not counted).
    for i in range(-1, args.steps):
        for protocol, run in runs.items():
            for way in ("dense", "real")[:: 1 - 2 * (i % 2)]:
                t0 = time.perf_counter()
                train.step(run[way], st, [run["picked"][max(i, 0)]], None, since)
                if i >= 0:
                    sec[protocol, way] += (time.perf_counter() - t0) / args.steps
    hours = {k: s * runs[k[0]]["batches"] / 3600 for k, s in sec.items()}
    print(
        f"WikiText-2, rnn 2 x 256 + nmst, {device}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}; a step: the mean of {args.steps}; an epoch: x its batches\n"
        "protocol batches  positions real targets step: dense   real speed-up epoch: dense h real h"
    )
    for p, run in runs.items():
        dense, real = sec[p, "dense"], sec[p, "real"]
        h = f"{hours[p, 'dense']:14.2f} {hours[p, 'real']:6.2f}"
        print(f"{run['line']} {dense:11.2f} {real:6.2f} {dense / real:8.2f} {h}")
    ratio = [f"{k} {hours['authors', k] / hours['paper', k]:.2f}x" for k in ("dense", "real")]
    print(f"an authors' epoch / a paper's: {', '.join(ratio)}")


def padding_run(protocol, device, steps):
    # bench_padding's run of a protocol: its table line, batches, `steps` picked batches, and
    # the run two ways (its model computing the real tokens alone, every position).
    argv = f"--model rnn --head nmst --dataset wikitext2 --protocol {protocol} --device {device}"
    args = config.get_args(argv.split(), train.RECIPES, train.AUTHORS)[0]
    data = load_data(args, verbose=False)
    data["targets_per_batch"] = loader.targets_per_batch(args, data)
    run, lengths = train.build(args, None, data, None, device)[0], data["train"].lengths
    keys = sorted(epoch_batches(args, data, 0), key=lambda k: lengths[k].max())
    positions = sum(len(k) * (lengths[k].max() - 1) for k in keys)
    real = data["targets_per_batch"] * len(keys)

    # The dense way: a batch without its rows and input_lengths computes every position (the
    # output layer on each, an RNN unpacked), as before only the real tokens were computed.
    def model(batch, state):
        return run.raw({k: v for k, v in batch.items() if k not in ("rows", "input_lengths")})

    return dict(
        line=f"{protocol:8s} {len(keys):7d} {positions:10,d} {real:12,.0f}",
        batches=len(keys),
        picked=[keys[(2 * i + 1) * len(keys) // (2 * steps)] for i in range(steps)],
        real=run,
        dense=dataclasses.replace(run, model=model),
    )


def parser():
    p, pos = common.Parser(description=__doc__.splitlines()[0]), common.INT1
    what = ["train", "batches", "decode", "insnet", "arch", "gpu", "authors", "padding"]
    p.add_argument("what", choices=what)
    p.add_argument("--authors_src", help="authors: the folder src/wiki2 of the authors' code")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", action="store_true", help="train: also softmax compiled")
    p.add_argument("--dataset", default="wikitext103", choices=DATASETS, help="batches")
    # The sizes, each a positive integer.
    sizes = dict(iters=3, rounds=9, batch=8, seq=128, prompts=8, new_tokens=64, gpt_layers=4)
    sizes.update(gpt_dim=256, gpt_heads=4, gpt_batch=1, max_tokens=1024, seqs=16, it_batch=2)
    # (padding: --steps, the batches each protocol is timed on each way)
    for flag, default in dict(sizes, eval_every=100, steps=8).items():
        p.add_argument(f"--{flag}", type=pos, default=default)
    p.add_argument("--lengths", type=pos, nargs="+", default=[20, 40, 60, 80, 100, 120, 160])
    p.add_argument("--budget", type=common.POS, default=120, help="arch: seconds per model")
    p.add_argument("--plot", help="insnet: the figure (PNG)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    # The GPT's heads divide its width; lengths within the models' windows.
    wrong = [args.gpt_dim % args.gpt_heads, max(args.lengths) > 254, args.seq > 1024]
    if any(wrong) or args.new_tokens > 1015:
        raise common.UserError(
            "--gpt_dim must be a multiple of --gpt_heads; --lengths <= 254, "
            "--seq <= 1024, --new_tokens <= 1015 (the models' windows)"
        )
    check_output(args.plot, "--plot")
    globals()[f"bench_{args.what}"](args, common.get_device(args.device))


if __name__ == "__main__":
    common.run(main)
