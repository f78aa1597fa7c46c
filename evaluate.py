"""Evaluate a nanogen checkpoint on a data split: perplexity, and the non-termination study.

    python evaluate.py --ckpt out/wikitext2-lstm-nmst/ckpt_best.pt --split valid --out results.json
    python evaluate.py --ckpt ... --decoder greedy --L 10 100 1000 --plot figs/ --out greedy.json
    python evaluate.py --compare va.json st.json nmst.json --plot figs/   # overlay r_nt(L) curves

Perplexity exactly as the NMST paper (section 4) uses it: exp of the mean negative
log-likelihood over the continuation tokens y_1..y_T (eos included) given the 10-token
context, i.e. exp(-sum_n sum_t log p(y_t^n | y_<t^n, x^n) / sum_n T^n).  Also reported: the
mean probability the model puts on eos at the true end of each sequence, p(y_T = eos | y_<T, x).

With --decoder (decode.py) every context x (the first 10 tokens of each sequence of the split)
is continued once, up to max(--L) tokens, and the study reports (NMST paper section 4-5):
  * r_nt(L) for every requested L (eq. 11), plus the whole curve r_nt(1..max L) in the JSON;
  * the mean continuation length, the share of unique continuations among the non-terminated;
  * examples (paper Table 3 style): context, generated continuation, ground truth;
  * the length distribution of generated vs ground-truth continuations (paper Fig. 8);
  * p(eos | y_<t, x) along ground-truth continuations (paper Fig. 3).
--plot DIR writes PNGs of these (r_nt(L) on log-log axes as in Fig. 2 / 7) when matplotlib is
installed, and says so when it is not.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

from data.loader import FIRST_STEP, batches, collate, load, loss_mask
from data.prepare import DataError
from decode import DECODERS, check_decoder_args, decode, decode_stats
from model import CheckpointError, load_checkpoint, model_from_checkpoint


class CLIParser(argparse.ArgumentParser):
    """argparse whose errors are one line ('error: ... (see --help)'), exit status 2."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def run_cli(main, argv=None):
    """Run a CLI main(); a user error becomes one 'error: ...' line and exit status 2."""
    try:
        return main(argv) or 0
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def batch_log_probs(lm, batch):
    """Continuation log-probs of one collated batch: (log_p (B, T), mask (B, T))."""
    tokens, lengths = batch["tokens"], batch["lengths"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = loss_mask(lengths, inputs.size(1))
    log_p = lm(inputs, FIRST_STEP, lengths=lengths - 1, targets=targets)
    return log_p, mask


@torch.no_grad()
def perplexity(lm, split, device="cpu", batch_size=None, max_tokens=None, limit=None, autocast=None, max_len=None,
               rank=0, world=1):
    """-> dict(nll, ppl, tokens, sequences, eos_prob_at_end) over the continuation tokens.
    max_len: skip sequences whose model input is longer (a GPT's window); counted in 'skipped'.
    rank / world: under torchrun each process scores every world-th batch, and the sums are
    all-reduced, so every process returns the same figures."""
    was_training = lm.training
    lm.eval()
    if batch_size is None and max_tokens is None:
        batch_size = 32
    nll_sum, n_tok, eos_p_sum, n_seq = 0.0, 0, 0.0, 0
    for index in batches(split.lengths, batch_size=batch_size, max_tokens=max_tokens, limit=limit,
                         max_len=max_len)[rank::world]:
        batch = collate(split, index, device)
        with autocast or contextlib.nullcontext():
            log_p, mask = batch_log_probs(lm, batch)
        log_p = log_p.float()
        nll_sum -= log_p[mask].sum().item()
        n_tok += int(mask.sum())
        last = batch["lengths"] - 2  # position predicting the final eos
        eos_p_sum += log_p.gather(1, last.unsqueeze(1)).exp().sum().item()
        n_seq += len(index)
    lm.train(was_training)
    if world > 1:
        import torch.distributed as dist
        sums = torch.tensor([nll_sum, n_tok, eos_p_sum, n_seq], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        nll_sum, n_tok, eos_p_sum, n_seq = sums[0].item(), int(sums[1].item()), sums[2].item(), int(sums[3].item())
    nll = nll_sum / max(n_tok, 1)
    considered = len(split) if limit is None else min(limit, len(split))
    return dict(nll=nll, ppl=math.exp(min(nll, 700.0)), tokens=n_tok, sequences=n_seq,
                skipped=considered - n_seq, eos_prob_at_end=eos_p_sum / max(n_seq, 1))


# ---------------------------------------------------------------------------------------------
# stories: the insertion models (insnet.py) and their L2R baseline (InsNet paper section 5)
# ---------------------------------------------------------------------------------------------
def story_model(cfg):
    """The model of a story checkpoint config: InsNet, IT-vanilla or the L2R GPT."""
    from insnet import InsertionTransformer, InsNet
    from model import LanguageModel
    return dict(insnet=InsNet, insertion_transformer=InsertionTransformer).get(cfg["model"], LanguageModel)(cfg)


def story_nll(model, seqs, order="random", generator=None, device="cpu"):
    """-log p of each sequence of a batch (B,) and its number of predicted events (B,).
    L2R (gpt): the tokens after the given prefix, EOS included.  Insertion models: the slot and
    token of every non-given insertion plus the termination, along one insertion order per
    sequence (`order`: random with `generator`, or l2r); the NLL of the (sequence, order) pair."""
    from insnet import collate_insertions, sequence_nll
    toks = [s["tokens"] for s in seqs]
    if model.cfg["model"] == "gpt":
        L = max(len(t) for t in toks)
        tokens = torch.zeros(len(toks), L, dtype=torch.long)
        for b, t in enumerate(toks):
            tokens[b, :len(t)] = torch.as_tensor(t)
        tokens = tokens.to(device)
        lengths = torch.tensor([len(t) for t in toks], device=device)
        log_p = model(tokens[:, :-1], 1, lengths=lengths - 1, targets=tokens[:, 1:])  # (B, L-1)
        pos = torch.arange(L - 1, device=device)
        given = torch.tensor([s["n_given"] for s in seqs], device=device)
        mask = (pos >= (given - 1).unsqueeze(1)) & (pos < (lengths - 1).unsqueeze(1))
        return -(log_p.float() * mask).sum(1), mask.sum(1)
    batch = collate_insertions(toks, [s["n_given"] for s in seqs], [s["keyword_pos"] for s in seqs], order,
                               generator, device)
    return sequence_nll(model.sequence_log_probs(**batch))


@torch.no_grad()
def story_perplexity(model, seqs, order="random", batch_size=32, device="cpu", seed=0, limit=None):
    """-> dict(nll_per_story, nll_per_event, ppl (= exp nll_per_event), stories, events,
    nll_bound_per_story).  The insertion orders are drawn from a generator seeded with `seed`: the
    same for every call.  With random orders, nll_per_story estimates E_pi[-log p(x, pi)] over
    the n! orders of a story's n inserted tokens, and by Jensen's inequality with the uniform
    order distribution  -log p(x) = -log sum_pi p(x, pi) <= E_pi[-log p(x, pi)] - log n!,  so
    nll_bound_per_story = nll_per_story - mean log n!  bounds -log p(story) from above and is
    comparable with L2R's NLL (for L2R and --order l2r it is the NLL itself)."""
    from data.loader import batches as length_batches
    was_training = model.training
    model.eval()
    seqs = seqs[:limit]
    g = torch.Generator().manual_seed(seed)
    nll, events, log_orders = 0.0, 0, 0.0
    random_orders = order == "random" and model.cfg["model"] != "gpt"
    for index in length_batches([len(s["tokens"]) for s in seqs], batch_size=batch_size):
        b_nll, b_events = story_nll(model, [seqs[i] for i in index], order, g, device)
        nll += b_nll.sum().item()
        events += int(b_events.sum())
        if random_orders:  # log n! with n = events - 1 insertions (the termination is the last event)
            log_orders += sum(math.lgamma(int(e)) for e in b_events)
    model.train(was_training)
    per_event = nll / max(events, 1)
    n = max(len(seqs), 1)
    return dict(nll_per_story=nll / n, nll_per_event=per_event, ppl=math.exp(min(per_event, 700.0)),
                stories=len(seqs), events=events, nll_bound_per_story=(nll - log_orders) / n)


def bleu(hypotheses, references, max_n=4):
    """Corpus BLEU-max_n (Papineni et al. 2002), one reference per hypothesis, no smoothing, in
    percent: BP * exp(mean_{n<=max_n} log p_n), p_n the clipped n-gram precision summed over the
    corpus, BP = exp(1 - r/c) when the hypotheses are shorter in total (c < r).  0 when some p_n = 0."""
    from collections import Counter
    matches, totals = [0] * max_n, [0] * max_n
    c = r = 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        c, r = c + len(hyp), r + len(ref)
        for n in range(1, max_n + 1):
            h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
            rc = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(k, rc[g]) for g, k in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    if c == 0 or min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_n
    bp = 1.0 if c > r else math.exp(1 - r / c)
    return 100.0 * bp * math.exp(log_p)


@torch.no_grad()
def story_generation(model, stories, seqs, vocab, task, decoder="greedy", k=None, temperature=1.0, seed=0,
                     max_len=None, device="cpu", examples=3):
    """Generate a story for each (title[, storyline]) and score it against the reference story:
    BLEU-1..4 and, for --task storyline, the share of storyline keywords that appear in the story
    in order (InsNet: 100% by construction, the keywords are given canvas tokens).
    -> dict(bleu: {1..4}, keyword_inclusion, mean_length, examples)."""
    from data.stories import BOS, EOS, PAD, SEP
    from insnet import generate
    g = torch.Generator().manual_seed(seed)
    hyps, refs, included, total, shown = [], [], 0, 0, []
    is_l2r = model.cfg["model"] == "gpt"
    banned = (PAD, BOS, EOS, SEP)
    for story, seq in zip(stories, seqs):
        prefix = seq["tokens"][:seq["n_given"]]
        cap = max_len or 2 * len(seq["tokens"]) + 10
        if is_l2r:
            out = decode(model, [torch.tensor(prefix, device=device)], cap, decoder=decoder, k=k,
                         temperature=temperature, generator=g)["tokens"][0]
            gen = [t for t in out if t not in banned]
        else:
            kw = seq["keywords"] if task == "storyline" else []  # constrained: keywords are given canvas tokens
            out = generate(model, [*prefix, *kw, EOS], cap, decoder=decoder, k=k, temperature=temperature,
                           slot_start=len(prefix) - 1, banned=banned, generator=g)
            kw_words = iter(story["keywords"])  # a given keyword keeps its word (even when it is <unk> in V)
            words = [next(kw_words) if given else vocab[t] for t, given in
                     zip(out["tokens"][len(prefix):-1], out["given"][len(prefix):-1])]
        if is_l2r:
            words = [vocab[t] for t in gen]
        hyps.append(words)
        refs.append(story["story"])
        if task == "storyline":
            total += len(story["keywords"])
            included += _in_order(words, story["keywords"])
        if len(shown) < examples:
            shown.append(dict(title=" ".join(story["title"]), storyline=" ".join(story["keywords"]),
                              generated=" ".join(words), reference=" ".join(story["story"])))
    return dict(bleu={n: bleu(hyps, refs, n) for n in range(1, 5)},
                keyword_inclusion=(included / total) if total else None,
                mean_length=sum(map(len, hyps)) / max(len(hyps), 1), stories=len(hyps), examples=shown)


def _in_order(words, keywords):
    """How many keywords occur in `words` as a subsequence, matched greedily left to right."""
    found, start = 0, 0
    for k in keywords:
        if k in words[start:]:
            start = words.index(k, start) + 1
            found += 1
    return found


@torch.no_grad()
def stream_perplexity(lm, data, bptt, device="cpu"):
    """Continuous-LM perplexity (CT paper): exp of the mean NLL over every target token of a
    batchified stream (bsz, N), hidden state carried across BPTT windows."""
    from data.loader import bptt_windows
    was_training = lm.training
    lm.eval()
    nll, n, state = 0.0, 0, None
    for i, L in bptt_windows(data.size(1), bptt):
        x, y = data[:, i:i + L].to(device), data[:, i + 1:i + 1 + L].to(device)
        log_p, state = lm.stream_log_probs(x, y, state)
        nll -= log_p.double().sum().item()
        n += y.numel()
    lm.train(was_training)
    return dict(nll=nll / n, ppl=math.exp(min(nll / n, 700.0)), tokens=n)


@torch.no_grad()
def tau_report(lm, data, bptt, eos_id, detok, device="cpu", top=10):
    """The contextual temperature along the text (CT paper Fig. 1, Tables 5-6).  The model reads
    the batchified stream (bsz, N) as in evaluation; at every position we keep tau of the word
    that actually comes next, and the mean tau of every vocabulary entry.  Sentences (lines)
    of 16-24 words are 'normalised' to their first 5, middle 5 and last 5 words, as in the paper,
    and the mean and 95% interval of tau at each of those 15 positions is reported."""
    from data.loader import bptt_windows
    lm.eval()
    V = lm.cfg["vocab_size"]
    tau_next = torch.zeros(data.size(0), data.size(1) - 1, dtype=torch.float64)
    tau_sum, n_pos, state = torch.zeros(V, dtype=torch.float64), 0, None
    for i, L in bptt_windows(data.size(1), bptt):
        x, y = data[:, i:i + L].to(device), data[:, i + 1:i + 1 + L].to(device)
        h, state = lm.backbone(x, state)
        tau = lm.head.temperatures(h).double()  # (bsz, L, V)
        tau_next[:, i:i + L] = tau.gather(-1, y.unsqueeze(-1)).squeeze(-1).cpu()
        tau_sum += tau.sum((0, 1)).cpu()
        n_pos += y.numel()
    rows = []
    for b in range(data.size(0)):
        targets = data[b, 1:].tolist()
        start = None  # sentence boundaries: a sentence starts after an eos (the first one is cut, skipped)
        for j, tok in enumerate(targets):
            if tok == eos_id:
                if start is not None and 15 < j - start < 25:
                    words = tau_next[b, start:j]
                    mid = (len(words) - 5) // 2
                    rows.append(torch.cat([words[:5], words[mid:mid + 5], words[-5:]]))
                start = j + 1
    if not rows:
        raise ValueError("no sentence of 16-24 words in this split: the temperature report needs some")
    table = torch.stack(rows)  # (sentences, 15)
    mean, half = table.mean(0), 1.96 * table.std(0) / math.sqrt(len(rows))
    tau_mean = tau_sum / n_pos
    order = torch.argsort(tau_mean, descending=True)
    return dict(sentences=len(rows), position_mean=mean.tolist(), position_ci95=half.tolist(),
                positions=[f"first-{i + 1}" for i in range(5)] + [f"mid-{i + 1}" for i in range(5)] +
                [f"last-{i + 1}" for i in range(5)],
                highest=[(detok([int(v)]), tau_mean[v].item()) for v in order[:top]],
                lowest=[(detok([int(v)]), tau_mean[v].item()) for v in order[-top:].flip(0)])


def plot_tau(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install matplotlib); no figures written", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(15)
    ax.errorbar(x, report["position_mean"], yerr=report["position_ci95"], fmt="o-", capsize=3)
    ax.set_xticks(list(x), report["positions"], rotation=60, fontsize=7)
    ax.set(ylabel="tau of the next word", title=f"contextual temperature by position ({report['sentences']} sentences)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def detokenizer(meta, folder):
    """token ids -> text: the word-level vocabulary, or GPT-2 BPE."""
    if meta["tokenizer"] == "word":
        with open(os.path.join(folder, "vocab.txt"), encoding="utf-8") as f:
            vocab = f.read().split("\n")
        return lambda ids: " ".join(vocab[i] for i in ids)
    from data.prepare import gpt2_encoding
    enc = gpt2_encoding()
    return lambda ids: enc.decode([i for i in ids if i != meta["eos_id"]]) + \
        (" <|endoftext|>" if meta["eos_id"] in ids else "")


@torch.no_grad()
def eos_traces(lm, split, n, context_len):
    """p(eos | y_<t, x) at every continuation step t of the first n sequences (paper Fig. 3)."""
    lm.eval()
    out = []
    for i in range(min(n, len(split))):
        seq = torch.as_tensor(split[i], device=next(lm.parameters()).device)
        lp, _ = lm(seq[:-1].unsqueeze(0), 2 - context_len)
        out.append(dict(index=i, tokens=seq[context_len:].tolist(),
                        p_eos=lp[0, context_len - 1:, lm.eos_id].exp().tolist()))
    return out


def decoding_study(lm, split, args, context_len, detok, device):
    """Decode every context once up to max(L); r_nt(L), lengths, uniqueness, examples."""
    from tqdm import tqdm
    n = len(split) if args.limit is None else min(args.limit, len(split))
    Lmax = max(args.L)
    gen = torch.Generator().manual_seed(args.seed)
    tokens, lengths, terminated = [], [], []
    for lo in tqdm(range(0, n, args.decode_batch), desc=f"decoding ({args.decoder})", disable=None):
        prompts = [torch.as_tensor(split[i][:context_len]) for i in range(lo, min(n, lo + args.decode_batch))]
        res = decode(lm, prompts, Lmax, args.decoder, k=args.k, p=args.p, beam_size=args.beam_size,
                     temperature=args.temperature, consistent=args.consistent, generator=gen,
                     length_penalty=args.length_penalty)
        tokens += res["tokens"]
        lengths.append(res["lengths"])
        terminated.append(res["terminated"])
    result = dict(tokens=tokens, lengths=torch.cat(lengths), terminated=torch.cat(terminated))
    stats = decode_stats(result, args.L)
    curve_L = sorted(set(int(round(x)) for x in torch.logspace(0, math.log10(Lmax), 60).tolist()))
    stats["r_nt_curve"] = decode_stats(result, curve_L)["r_nt"]
    truth = (torch.as_tensor(split.lengths[:n]) - context_len).tolist()  # ground-truth |y| incl. eos
    stats["generated_lengths"] = [n_ if done else None for n_, done in
                                  zip(result["lengths"].tolist(), result["terminated"].tolist())]
    stats["ground_truth_lengths"] = truth
    examples, seen_nt, seen_t = [], 0, 0
    for i in range(n):
        done = bool(result["terminated"][i])
        if (done and seen_t < args.examples) or (not done and seen_nt < args.examples):
            seen_t, seen_nt = seen_t + done, seen_nt + (not done)
            examples.append(dict(index=i, terminated=done, context=detok(split[i][:context_len].tolist()),
                                 continuation=detok(tokens[i][:200]) + (" ..." if len(tokens[i]) > 200 else ""),
                                 ground_truth=detok(split[i][context_len:].tolist()[:200])))
    stats["examples"] = examples
    return stats


def plot_study(results, out_dir):
    """PNGs: r_nt(L) (log-log, Fig. 2 / 7), length histograms (Fig. 8), p(eos) traces (Fig. 3)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install matplotlib); no figures written", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    style = {"softmax": ("tab:red", ":"), "st": ("tab:blue", "--"), "nmst": ("tab:green", "-")}
    runs = [r for r in results if "decoding" in r]
    if runs:
        fig, ax = plt.subplots(figsize=(5, 4))
        for r in runs:
            curve = r["decoding"]["r_nt_curve"]
            Ls, ys = [int(L) for L in curve], list(curve.values())
            color, ls = style.get(r["head"], ("k", "-"))
            eps = "" if r["head"] == "softmax" else f" eps={r['epsilon']:g}"
            ax.plot(Ls, [max(y, 1e-4) for y in ys], ls, color=color, label=f"{r['head'].upper()}+{r['model']}{eps}")
        ax.set(xscale="log", yscale="log", xlabel="L", ylabel="r_nt(L)",
               title=f"non-termination ratio, {runs[0]['decoding']['decoder']} ({runs[0]['dataset']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "r_nt.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(5, 4))
        Lmax = max(max(r["decoding"]["r_nt"], key=int) for r in runs)
        bins = torch.linspace(0, int(Lmax) + 1, 41).tolist()
        ax.hist([min(n, int(Lmax)) for n in runs[0]["decoding"]["ground_truth_lengths"]], bins=bins, alpha=0.4,
                color="gray", label="ground truth")
        for r in runs:
            gl = [int(Lmax) if n is None else n for n in r["decoding"]["generated_lengths"]]
            ax.hist(gl, bins=bins, histtype="step", color=style.get(r["head"], ("k", "-"))[0],
                    label=f"{r['head'].upper()} (non-terminated at L)")
        ax.set(xlabel="continuation length", ylabel="count", yscale="log", title="length distribution")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "lengths.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    traced = [r for r in results if r.get("eos_traces")]
    if traced:
        fig, axes = plt.subplots(len(traced[0]["eos_traces"][:3]), 1, figsize=(7, 6), squeeze=False)
        for j, ax in enumerate(axes[:, 0]):
            for r in traced:
                tr = r["eos_traces"][j]
                ax.plot(range(1, len(tr["p_eos"]) + 1), tr["p_eos"], style.get(r["head"], ("k", "-"))[1],
                        color=style.get(r["head"], ("k", "-"))[0], label=r["head"].upper())
            ax.set(yscale="log", ylabel="p(eos)", xlabel="t" if j == len(axes) - 1 else None)
            ax.set_title(f"validation sequence {traced[0]['eos_traces'][j]['index']}", fontsize=8)
        axes[0, 0].legend(fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "p_eos.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    for w in written:
        print(f"wrote {w}")
    return written


def build_parser():
    p = CLIParser(description="Evaluate a nanogen checkpoint: continuation perplexity (NMST paper section 4).")
    p.add_argument("--ckpt", default=None, help="checkpoint written by train.py (ckpt_best.pt / ckpt_last.pt); "
                                                "required unless --compare")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    p.add_argument("--data_dir", default=None, help="local dataset folder (default: $NANOGEN_DATA, else download)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    p.add_argument("--batch_size", type=int, default=None, help="sequences per batch (default 32; RNN/LSTM)")
    p.add_argument("--max_tokens", type=int, default=None, help="padded tokens per batch (GPT; default: the "
                                                                "checkpoint's --max_tokens)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N sequences")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no_ppl", action="store_true", help="skip the perplexity pass")
    d = p.add_argument_group("non-termination study (decode.py)")
    d.add_argument("--decoder", default=None, choices=DECODERS, help="decode every context of the split")
    d.add_argument("--L", type=int, nargs="+", default=[10, 100, 1000], help="r_nt(L) thresholds; decodes run "
                                                                             "to max(L) (default 10 100 1000)")
    d.add_argument("--k", type=int, default=None, help="top-k")
    d.add_argument("--p", type=float, default=None, help="nucleus threshold mu, in (0, 1]")
    d.add_argument("--beam_size", type=int, default=None, help="beam width")
    d.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (sample/topk/nucleus)")
    d.add_argument("--consistent", action="store_true", help="top-k / nucleus: always keep eos in V_t "
                                                             "(Welleck et al.'s consistent variant)")
    d.add_argument("--length_penalty", type=float, default=0.0, help="beam: final score s / |y|^a (default 0: off)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed")
    d.add_argument("--decode_batch", type=int, default=64, help="prompts decoded together")
    d.add_argument("--examples", type=int, default=3, help="terminated and non-terminated examples to keep")
    d.add_argument("--traces", type=int, default=5, help="sequences with p(eos | prefix) traces (Fig. 3)")
    d.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures into DIR")
    p.add_argument("--tau_report", action="store_true", help="ct / ctmos: temperature by position in the sentence "
                   "and the highest / lowest temperature words (CT paper Fig. 1, Tables 5-6)")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="no evaluation: overlay the studies in these --out files (use with --plot)")
    return p


def tune_cpu_allocator():
    """Keep freed memory in glibc's heap instead of mmap/munmap-ing every large tensor: each
    (B, T, V) logits tensor is far above glibc's mmap threshold, and page-faulting it in anew
    at every step halves CPU training speed (measured: 4.4k vs 2.1k tok/s, LSTM d=64, V=33k)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: never serve malloc by mmap
        libc.mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD: do not hand the heap top back eagerly
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def resolve_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for, but CUDA is not available here (use --device cpu)")
    if name == "cpu":
        tune_cpu_allocator()
    return name


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.compare and not args.ckpt:
        parser.error("the following arguments are required: --ckpt (or --compare JSON ...)")
    if args.compare:
        results = []
        for path in args.compare:
            try:
                with open(path) as f:
                    results.append(json.load(f))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--compare: cannot read {path}: {e}") from None
        print_study_table(results)
        if args.plot:
            plot_study(results, args.plot)
        return 0
    if args.decoder:
        check_decoder_args(args.decoder, args.k, args.p, args.beam_size, args.temperature, min(args.L))
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.ckpt)
    targs = ckpt["args"]
    if targs["dataset"] in ("rocstories", "synthetic"):
        return evaluate_stories(args, ckpt, device)
    meta, splits = load(targs["dataset"], args.data_dir)
    if meta["vocab_size"] != ckpt["config"]["vocab_size"] or meta["eos_id"] != ckpt["config"]["eos_id"]:
        raise CheckpointError(f"{args.ckpt} was trained on another vocabulary (V={ckpt['config']['vocab_size']}) "
                              f"than the prepared {targs['dataset']} (V={meta['vocab_size']})")
    lm = model_from_checkpoint(ckpt).to(device)
    if args.batch_size is None and args.max_tokens is None:
        if targs.get("model") == "gpt":
            args.max_tokens = targs.get("max_tokens") or 1024
        else:
            args.batch_size = targs.get("batch_size") or 32
    t0 = time.time()
    max_len = ckpt["config"].get("block_size") if ckpt["config"]["model"] == "gpt" else None
    split = splits[args.split]
    res = dict(ckpt=os.path.abspath(args.ckpt), split=args.split, dataset=targs["dataset"],
               model=ckpt["config"]["model"], head=ckpt["config"]["head"], epsilon=ckpt["config"]["epsilon"],
               step=ckpt["train_state"]["step"], task=targs.get("task", "completion"))
    if res["task"] == "stream" and not args.no_ppl:  # continuous LM (CT paper): batch size 10, BPTT windows
        from data.loader import batchify, load_stream
        data = batchify(load_stream(os.path.dirname(split.tokens.filename), args.split), 10)
        res.update(stream_perplexity(lm, data, targs.get("bptt", 70), device))
        print(f"{'dataset':10s} {'split':6s} {'model':5s} {'head':8s} {'tokens':>9s} {'nll':>7s} {'ppl':>9s}  (stream)")
        print(f"{res['dataset']:10s} {res['split']:6s} {res['model']:5s} {res['head']:8s} {res['tokens']:9d} "
              f"{res['nll']:7.4f} {res['ppl']:9.2f}")
    elif not args.no_ppl:
        res.update(perplexity(lm, split, device, args.batch_size, args.max_tokens, args.limit, max_len=max_len))
        print(f"{'dataset':10s} {'split':6s} {'model':5s} {'head':8s} {'sequences':>9s} {'tokens':>9s} "
              f"{'nll':>7s} {'ppl':>9s} {'p(eos@end)':>10s}")
        print(f"{res['dataset']:10s} {res['split']:6s} {res['model']:5s} {res['head']:8s} {res['sequences']:9d} "
              f"{res['tokens']:9d} {res['nll']:7.4f} {res['ppl']:9.2f} {res['eos_prob_at_end']:10.4f}")
    if args.decoder:
        folder = os.path.dirname(split.tokens.filename)
        study = decoding_study(lm, split, args, meta["context_len"], detokenizer(meta, folder), device)
        study.update(decoder=args.decoder, k=args.k, p=args.p, beam_size=args.beam_size,
                     temperature=args.temperature, consistent=args.consistent, seed=args.seed)
        res["decoding"] = study
        res["eos_traces"] = eos_traces(lm, split, args.traces, meta["context_len"])
        print_study_table([res])
        for ex in study["examples"]:
            tag = "terminated" if ex["terminated"] else "NOT terminated"
            print(f"\n[{tag}] context: {ex['context']}\n  continuation: {ex['continuation'][:400]}")
    if args.tau_report:
        if ckpt["config"]["head"] not in ("ct", "ctmos"):
            raise ValueError(f"--tau_report needs a contextual-temperature head (ct / ctmos), not {ckpt['config']['head']}")
        if ckpt["config"]["model"] == "gpt":
            raise ValueError("--tau_report reads the text as a stream: use an rnn / lstm checkpoint")
        from data.loader import batchify, load_stream
        folder = os.path.dirname(split.tokens.filename)
        data = batchify(load_stream(folder, args.split), 10)
        rep = tau_report(lm, data, targs.get("bptt", 70), meta["eos_id"], detokenizer(meta, folder), device)
        res["tau_report"] = rep
        print(f"temperature of the next word by position ({rep['sentences']} sentences of 16-24 words):")
        for name, m_, c in zip(rep["positions"], rep["position_mean"], rep["position_ci95"]):
            print(f"  {name:8s} {m_:.6f} +- {c:.6f}")
        print("highest mean tau:", ", ".join(f"{w} {t:.6f}" for w, t in rep["highest"]))
        print("lowest mean tau: ", ", ".join(f"{w} {t:.6f}" for w, t in rep["lowest"]))
        if args.plot:
            plot_tau(rep, os.path.join(args.plot, "tau_by_position.png"))
    res["seconds"] = round(time.time() - t0, 2)
    if args.plot and args.decoder:
        plot_study([res], args.plot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def evaluate_stories(args, ckpt, device):
    """A story checkpoint (insnet / insertion_transformer / gpt on rocstories or synthetic): the
    NLL of the split, and with --decoder greedy / sample / topk, generated stories scored with
    BLEU-1..4 against the references (and keyword inclusion for --task storyline)."""
    from data.stories import load_sequences
    targs, cfg = ckpt["args"], ckpt["config"]
    if args.decoder not in (None, "greedy", "sample", "topk"):
        raise ValueError(f"--decoder {args.decoder}: story checkpoints decode with greedy, sample or topk")
    vocab, splits, stories, note = load_sequences(targs["dataset"], targs["task"], cfg["model"], args.data_dir,
                                                  targs["min_count"], targs["synthetic_count"],
                                                  vocab=ckpt["data"].get("vocab"))
    model = story_model(cfg)
    model.load_state_dict(ckpt["model"])
    model.to(device)
    seqs = splits[args.split][:args.limit]
    res = dict(ckpt=os.path.abspath(args.ckpt), split=args.split, dataset=targs["dataset"], task=targs["task"],
               model=cfg["model"], order=targs.get("order"), step=ckpt["train_state"]["step"], data_note=note)
    if not args.no_ppl:
        res.update(story_perplexity(model, seqs, targs.get("order", "random"), args.batch_size or 32, device,
                                    seed=args.seed))
        print(f"{res['dataset']} {res['split']} {res['model']}{'-l2r' if res['order'] == 'l2r' else ''}: "
              f"{res['stories']} stories, NLL {res['nll_per_story']:.2f} per story, {res['nll_per_event']:.4f} "
              f"per event (ppl {res['ppl']:.2f})" + (f"; -log p(story) <= {res['nll_bound_per_story']:.2f} (mean over "
                                                     f"orders - log n!)" if res["order"] == "random" and
                                                     res["model"] != "gpt" else ""))
    if args.decoder:
        if stories is None:
            raise ValueError("generation is scored against ROCStories references: use a rocstories checkpoint")
        gen = story_generation(model, stories[args.split][:args.limit], seqs, vocab, targs["task"], args.decoder,
                               args.k, args.temperature, args.seed, device=device, examples=args.examples)
        res["generation"] = dict(gen, decoder=args.decoder, k=args.k, temperature=args.temperature)
        b = gen["bleu"]
        print(f"generation ({args.decoder}): BLEU-1/2/3/4 {b[1]:.2f} / {b[2]:.2f} / {b[3]:.2f} / {b[4]:.2f}, "
              f"mean length {gen['mean_length']:.1f}" + (f", storyline keywords included {100 * gen['keyword_inclusion']:.2f}%"
                                                        if gen["keyword_inclusion"] is not None else ""))
        for ex in gen["examples"]:
            print(f"  [{ex['title']} | {ex['storyline']}] {ex['generated']}\n    reference: {ex['reference']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def print_study_table(results):
    """One row per decoding study: r_nt(L) for every L, mean length, unique share among non-terminated."""
    rows = [r for r in results if "decoding" in r]
    if not rows:
        return
    Ls = sorted({int(L) for r in rows for L in r["decoding"]["r_nt"]})
    print(f"{'model':5s} {'head':8s} {'eps':>7s} {'decoder':12s} " + " ".join(f"{'r_nt(%d)' % L:>11s}" for L in Ls)
          + f" {'mean len':>9s} {'uniq non-term':>13s} {'n':>6s}")
    for r in rows:
        d = r["decoding"]
        r_nt = {int(L): v for L, v in d["r_nt"].items()}
        dec = d["decoder"] + {"topk": f"-{d['k']}", "nucleus": f"-{d['p']}", "beam": f"-{d['beam_size']}"}.get(
            d["decoder"], "") + ("+c" if d.get("consistent") else "")
        eps = "-" if r["head"] == "softmax" else f"{r['epsilon']:.0e}"
        print(f"{r['model']:5s} {r['head']:8s} {eps:>7s} {dec:12s} "
              + " ".join(f"{r_nt.get(L, float('nan')):11.4f}" for L in Ls)
              + f" {d['mean_length']:9.1f} {d['unique_non_terminated']:13.3f} {d['n']:6d}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
