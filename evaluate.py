"""Evaluate a checkpoint: perplexity, the non-termination study, the temperature report, and for
story checkpoints NLL, BLEU and storyline keyword inclusion.

    python evaluate.py --ckpt out/wikitext2-lstm-nmst/ckpt_best.pt --split valid --out res.json
    python evaluate.py --ckpt CKPT --no_ppl --decoder greedy --L 10 100 1000 --plot figs/ --out g
    python evaluate.py --compare va.json st.json nmst.json --plot figs/   # overlay the studies

The file opens with what training's evaluations share with this command (perplexity, the
termination probe), then the command, then the studies.  The study (--decoder) continues every
context once up to max(--L) tokens: r_nt(L) (NMST paper eq. 11) and its curve (Fig. 2, 7), the
lengths (Fig. 8), unique non-terminated continuations, examples, and p(eos) along true
continuations (Fig. 3).  Its figures and tables are curves.py's.
"""

import argparse
import json
import math
import os
import time
from collections import Counter

import torch
from tqdm import tqdm

import curves
from common import (
    INT0,
    INT1,
    LENGTH,
    RUN_FILES,
    Parser,
    UserError,
    all_sum,
    autocast,
    check_output,
    check_vocab,
    get_device,
    load_checkpoint,
    run,
    world,
    write_file,
)
from data.loader import batchify, bptt_windows, eval_batches, get_batch, load_data
from data.stories import BOS, EOS, PAD, SEP, keyword_positions
from decode import (
    SAMPLING,
    STORY_DECODERS,
    add_decoding_flags,
    check_decoder_args,
    decode,
    decode_in_batches,
    decode_stats,
    decoder_options,
    eos_probs,
    longest_continuation,
    non_termination_ratio,
    sampling_generator,
)
from insnet import INSERTION, Decoding, generate
from model import LanguageModel, eval_mode


# ----- perplexity and the probe: what training's evaluations and this command share -----------
@torch.no_grad()
def perplexity(args, model, data, split="valid", limit=None, device="cpu"):
    """A split's figures: dict(nll per predicted token or event, ppl, ...).  Completion (NMST):
    the continuation's tokens (eos included), the mean p(eos) at the true end; stream (CT): every
    token, the state carried on; stories: per story too, a bound on -log p(story).  limit: the
    first N sequences (stream: tokens a column).  torchrun: each process every world-th batch.
    Autocast, if any, is the caller's (`with ctx: perplexity(...)`); the batches come in the
    sizes args gives."""
    limit = limit or args.eval_seqs or None
    if args.task == "stream":
        # The usual 10 evaluation columns (or the first `limit` tokens of each).
        columns = batchify(data["streams"][split], 10, split)[:, : limit and limit + 1]
        data = {**data, split: columns}
    rank, procs = world()
    keys = eval_batches(args, data, split, limit)
    # Each process scores every procs-th batch; a stream carries its state from window to
    # window, so one process reads it all.
    if args.task != "stream":
        keys = keys[rank::procs]
    # The sums of SUMS, on the device (one read at the end).
    # (float64: millions of log-probabilities are summed)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    state = None
    # (a progress bar on a terminal, from the first process only)
    bar = tqdm(keys, f"perplexity ({split})", disable=True if rank else None, leave=False)
    with eval_mode(model):
        for key in bar:
            batch = get_batch(args, data, key, device, split)
            # The same call as a training step's: log p of the targets, the mask of those that
            # count, the state (a stream's goes on).
            log_p, mask, state = model(batch, state)
            sums += batch_sums(args, batch, log_p, mask)
    totals = dict(zip(SUMS, all_sum(sums.tolist(), device)))
    # A perplexity over no token is no number (it would print 1.00).
    if totals["n"] == 0:
        raise UserError(
            f"the {split} split holds no sequence that fits this model (no token to score): "
            f"no perplexity"
        )
    total = len(data[split]) if limit is None else min(limit, len(data[split]))
    return figures(args, totals, total)


# What perplexity sums over the batches: -log p and the count of the targets, p(eos) at the true
# end, the sequences, log n! of the insertion orders, and -log p and the count of the targets of
# the lines whose continuation is longer than eos alone.
SUMS = ("nll", "n", "end", "sequences", "log_orders", "nll_long", "n_long")


def batch_sums(args, batch, log_p, mask):
    """A batch's SUMS, a float64 vector on the device."""
    n = mask.sum(1).double()
    zero = torch.zeros((), device=log_p.device)
    end = zero
    # p(eos) at the true end of each line
    if args.task == "completion":
        end = log_p.gather(1, batch["lengths"].unsqueeze(1) - 2).exp()
    orders = zero
    # An insertion model's random orders: n - 1 insertions, then termination.
    if args.model in INSERTION and args.order == "random":
        orders = torch.lgamma(n)
    nll_rows = -torch.where(mask, log_p.double(), 0.0).sum(1)  # (B,)
    # nanogen's metric leaves out the lines whose continuation is eos alone (<= 10 words).
    long = n > 1
    sequences = len(n)
    if args.task == "stream":
        sequences = 0
    values = [nll_rows.sum(), n.sum(), end.sum(), zero + sequences, orders.sum()]
    values += [nll_rows[long].sum(), n[long].sum()]
    return torch.stack([v.double() for v in values])


def figures(args, totals, total):
    """The split's figures from its totals (SUMS); total: the sequences asked for."""
    nll, n, seqs = totals["nll"], totals["n"], totals["sequences"]
    res = dict(nll=nll / n, ppl=math.exp(min(nll / n, 700)), tokens=int(n), sequences=int(seqs))
    if args.task in ("story", "storyline"):
        # By Jensen's inequality, -log p(x) <= E_pi[-log p(x, pi)] - log n!.
        bound = (nll - totals["log_orders"]) / max(seqs, 1)
        return dict(res, nll_per_story=nll / max(seqs, 1), nll_bound_per_story=bound)
    if args.task == "stream":
        return res
    # Both perplexities of NMST Table 1, each over its own tokens: nanogen's (the continuations of
    # the lines of more than 10 words) and the authors' (their code's: one eos target more for
    # every shorter line, which only the authors' protocol keeps).
    res.update(ppl_nanogen=None, tokens_nanogen=int(totals["n_long"]))
    res.update(ppl_authors=None, tokens_authors=None)
    # (no line longer than its context here: nanogen's metric has no token, so no number)
    if totals["n_long"]:
        res["ppl_nanogen"] = math.exp(min(totals["nll_long"] / totals["n_long"], 700))
    if args.protocol == "authors":
        res.update(ppl_authors=res["ppl"], tokens_authors=int(n))
    end = totals["end"] / max(seqs, 1)
    return dict(res, eos_prob_at_end=end, skipped=total - int(seqs))


def probe(args, model, data):
    """The termination probe (NMST paper eq. 11): greedy continuations of the first --probe
    validation contexts up to --probe_L tokens, as `evaluate.py --decoder greedy --limit --L`."""
    split, t0, n = data["valid"], time.time(), min(args.probe, len(data["valid"]))
    # (no validation context, or none that leaves room in the window: no probe)
    if n == 0:
        return {}
    # A window model's context and continuation must fit its window.
    cap = longest_continuation(model, int(split.contexts[:n].max(initial=0)))
    L = args.probe_L
    if cap is not None:
        L = min(args.probe_L, cap)
    if L < 1:
        return {}
    res = decode_in_batches(model, [torch.as_tensor(split.context(i)) for i in range(n)], L)
    rec = dict(
        probe_r_nt=non_termination_ratio(res["lengths"], res["terminated"], L),
        probe_L=L,
        probe_n=n,
        probe_mean_length=float(res["lengths"].double().mean()),
    )
    print(probe_line(rec, res, split.context(0), data), flush=True)
    return dict(rec, probe_seconds=time.time() - t0)


def probe_line(rec, res, context, data):
    """The probe's line: r_nt, the mean length, the first context, its continuation, its end."""
    tokens, ended, tok = res["tokens"][0], bool(res["terminated"][0]), data["tokenizer"]
    text = tok.decode([t for t in tokens if t != data["eos_id"]])
    if len(text) > 120:
        text = text[:120] + "..."
    end = f"cut at L={rec['probe_L']}: not terminated"
    if ended:
        end = f"eos at t={len(tokens)}"
    if ended and len(tokens) == 1:
        end += ": the model ended at once"
    return (
        f"        probe: r_nt({rec['probe_L']}) {rec['probe_r_nt']:.3f} over {rec['probe_n']} "
        f"contexts | mean length {rec['probe_mean_length']:.1f} | "
        f'"{tok.decode(context.tolist())}" >>> "{text}" [{end}]'
    )


# An evaluation's line in a training run: its losses, perplexity, rate, speed (and MFU).
def evaluation_line(rec, improved):
    line = (
        f"step {rec['step']:7d} | epoch {rec['epoch']:3d} | train loss {rec['train_loss']:.4f} "
        f"| val loss {rec['val_loss']:.4f} | val ppl {rec['val_ppl']:9.2f} | lr {rec['lr']:.2e} | "
        f"{rec['tokens_per_s']:8.0f} tok/s"
    )
    if rec["mfu"]:
        line += f" | mfu {100 * rec['mfu']:.1f}%"
    if improved:
        line += " | best"
    return line


# ----- the command: flags, the checkpoint's run, the report -----------------------------------
# The flags that only a --decoder study reads.
STUDY_FLAGS = "L k p beam_size temperature consistent length_penalty decode_batch examples".split()
STUDY_FLAGS += ["traces", "seed"]


def parser():
    p = Parser(description="Evaluate a checkpoint (perplexity, non-termination study, BLEU).")
    # What is evaluated: a checkpoint on a split of its own data (its args name the data).
    p.add_argument("--ckpt", help="a checkpoint of train.py (required unless --compare)")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    p.add_argument("--data_dir", help="the data (default: the run's, $NANOGEN_DATA, a download)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto)")
    # The perplexity pass's batches: any size gives the same numbers, only faster or slower.
    p.add_argument("--batch_size", type=INT1, help="sequences per batch (default: the run's)")
    p.add_argument("--max_tokens", type=INT1, help="padded tokens per batch (default: the run's)")
    p.add_argument("--limit", type=INT1, help="the first N sequences (stream: tokens a column)")
    # Everything printed is also written to --out, for reproduce.py and --compare.
    p.add_argument("--out", help="the results as JSON")
    p.add_argument("--no_ppl", action="store_true", help="no perplexity pass")
    # The decoders' flags are decode.py's, shared with sample.py; the study's own follow.
    add_decoding_flags(p)
    L = "r_nt(L)'s L (a decode runs to the largest)"
    p.add_argument("--L", type=LENGTH, nargs="+", default=[10, 100, 1000], help=L)
    batch = "prompts decoded together (default: 64 on a CPU; a GPU: a quarter of its memory's)"
    p.add_argument("--decode_batch", type=INT1, help=batch)
    p.add_argument("--examples", type=INT0, default=3, help="examples of each kind")
    p.add_argument("--traces", type=INT0, default=5, help="sequences with p(eos) traces (Fig. 3)")
    # The figures are curves.py's (NMST Fig. 2, 3, 7, 8; CT Fig. 1).
    p.add_argument("--plot", metavar="DIR", help="PNG figures of the study into DIR")
    tau = "ct / ctmos: the temperature by position, its hottest and coldest words (CT Fig. 1)"
    p.add_argument("--tau_report", action="store_true", help=tau)
    compare = "no evaluation: the studies of earlier --out files side by side (--plot: overlaid)"
    p.add_argument("--compare", nargs="+", metavar="JSON", help=compare)
    return p


def check_flags(a):
    """The flag combinations that would do nothing: one line each; -> the flags given."""
    given = {k for k, v in vars(a).items() if v != parser().get_default(k)}
    # What to evaluate
    if not a.compare and not a.ckpt:
        raise UserError("give --ckpt CKPT (or --compare JSON ...)")
    if a.compare and given - {"compare", "plot"}:
        raise UserError(
            "--compare draws studies already written (--out files) and takes only --plot"
        )
    check_study_flags(a, given)
    if a.decoder:
        check_decoder_args(a.decoder, **decoder_options(a))
    # (with --ckpt: checked in load_run, where the run's data folder is known)
    if a.compare:
        check_output(a.plot, "--plot", a.compare, folder=True)
    return given


def check_study_flags(a, given):
    """The flags that only a study, a figure or the perplexity pass reads."""
    study = {k for k in STUDY_FLAGS if k in given}
    if study and not a.decoder:
        raise UserError(
            f"--{' / --'.join(sorted(study))} are options of a --decoder study: give one"
        )
    if a.plot and not (a.decoder or a.tau_report or a.compare):
        raise UserError(
            "--plot draws the figures of --decoder, --tau_report or --compare: give one"
        )
    if a.no_ppl and not (a.decoder or a.tau_report):
        raise UserError("--no_ppl leaves nothing to do: give a --decoder or --tau_report")
    # Greedy and beam search draw nothing, so a seed would silently change nothing.
    if a.seed is not None and a.decoder and a.decoder not in SAMPLING:
        raise UserError(f"--decoder {a.decoder} does not use --seed: drop it")
    if a.no_ppl and (a.batch_size or a.max_tokens):
        raise UserError(
            "--batch_size / --max_tokens batch the perplexity pass, which --no_ppl skips"
        )


def main(argv=None):
    a = parser().parse_args(argv)
    given = check_flags(a)
    if a.compare:
        return compare(a)
    device = get_device(a.device)
    sizes = None
    if a.batch_size or a.max_tokens:
        sizes = (a.batch_size, a.max_tokens)
    outputs = [(a.out, "--out", False), (a.plot, "--plot", True)]
    ckpt, args, data, model = load_run(a.ckpt, a.data_dir, device, sizes, outputs)
    check_task_flags(a, args, given)
    res = dict(
        ckpt=os.path.abspath(a.ckpt),
        split=a.split,
        dataset=args.dataset,
        model=args.model,
        head=args.head,
        epsilon=args.epsilon,
        step=ckpt["state"]["step"],
        task=args.task,
    )
    if not a.no_ppl:
        # (--batch_size / --max_tokens: load_run set them on args)
        with autocast(device, args.dtype):
            res.update(perplexity(args, model, data, a.split, a.limit, device))
        print(report(args, res, a.split))
    studies(a, args, data, model, device, res)
    if a.out:
        write_json(a.out, res)


def check_task_flags(a, args, given):
    """The flags that the checkpoint's task does not read."""
    story = args.task in ("story", "storyline")
    text_only = {"consistent", "L", "traces", "decode_batch"} & given
    if story and (a.tau_report or a.plot or text_only):
        raise UserError(
            "--tau_report / --plot / --consistent / --L / --traces / --decode_batch "
            "are for left-to-right text checkpoints, not a story one (NLL, BLEU)"
        )
    if a.decoder and args.task == "stream":
        raise UserError(f"--decoder continues completion contexts, not a --task {args.task} run")


def studies(a, args, data, model, device, res):
    """What the flags ask beyond perplexity, added to res: generation (stories), the decoding
    study, the temperature report."""
    if a.decoder and args.task in ("story", "storyline"):
        res["generation"] = story_generation(model, args, data, a, device)
    elif a.decoder:
        res.update(
            decoding=decoding_study(model, data, a, device),
            eos_traces=eos_traces(model, data[a.split], a.traces),
        )
        curves.print_study_table([res])
        if a.plot:
            curves.plot_study([res], a.plot)
    if a.tau_report:
        res["tau_report"] = tau_report(model, args, data, a, device)


def model_from_checkpoint(ckpt, path):
    try:
        model = INSERTION.get(ckpt["config"]["model"], LanguageModel)(ckpt["config"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        why = " ".join(str(e).split())[:160]
        raise UserError(f"{path}: its weights do not fit its model config ({why})") from None
    return model


def load_run(path, data_dir=None, device="cpu", sizes=None, outputs=()):
    """A checkpoint's run: its arguments (on all of its data), its data (checked to carry the
    checkpoint's vocabulary) and its model.  -> (ckpt, args, data, model).  outputs: (path,
    flag, is a folder) checked before the data is read, never replacing what the run reads."""
    ckpt = load_checkpoint(path)
    # The model is built before the data is read: weights that do not fit fail fast.
    model = model_from_checkpoint(ckpt, path)
    args = argparse.Namespace(**dict(ckpt["args"], train_seqs=0, eval_seqs=0))
    if data_dir or (args.data_dir and not os.path.isdir(args.data_dir)):
        if not data_dir and args.dataset == "text":
            raise UserError(
                f"the run's --data_dir {args.data_dir} is not there (moved?): give "
                f"--data_dir DIR where its text is now"
            )
        args.data_dir = data_dir
    run_dir, data_folder = os.path.dirname(path), args.data_dir or os.environ.get("NANOGEN_DATA")
    reads = [path, data_folder, *(os.path.join(run_dir, name) for name in RUN_FILES)]
    for out, flag, folder in outputs:
        check_output(out, flag, reads, folder)
    if sizes:
        check_sizes(args, sizes)
        args.batch_size, args.max_tokens = sizes
    data = load_data(args, verbose=False)
    check_vocab(ckpt, data, path)
    return ckpt, args, data, model.to(device)


def check_sizes(args, sizes):
    """--batch_size / --max_tokens, as the checkpoint's task takes them."""
    if args.task == "stream":
        raise UserError("a stream checkpoint reads 10 columns: drop --batch_size / --max_tokens")
    if all(sizes):
        raise UserError("give --batch_size (sequences a batch) or --max_tokens, not both")
    if sizes[1] and args.task in ("story", "storyline"):
        raise UserError("a story checkpoint is batched by --batch_size (stories), not --max_tokens")


def report(args, res, split):
    """The perplexity pass's lines, as the task defines its figures."""
    if args.task == "stream":
        return (
            f"{split}: stream perplexity {res['ppl']:.2f} (nll {res['nll']:.4f} over "
            f"{res['tokens']:,} tokens, 10 columns, BPTT {args.bptt})"
        )
    if args.task in ("story", "storyline"):
        return story_report(args, res, split)
    if res["sequences"] == 0:
        raise UserError(f"the {split} split holds no sequence that fits this model: no perplexity")
    lines = [
        f"{'split':6s} {'sequences':>9s} {'tokens':>9s} {'nll':>7s} {'ppl':>9s} "
        f"{'p(eos@end)':>10s}",
        f"{split:6s} {res['sequences']:9d} {res['tokens']:9d} {res['nll']:7.4f} "
        f"{res['ppl']:9.2f} {res['eos_prob_at_end']:10.4f}",
    ]
    # Both of Table 1's perplexities, each "-" where it has no token.
    nanogen = "- (no such line here)"
    if res["ppl_nanogen"] is not None:
        nanogen = f"{res['ppl_nanogen']:.2f} over {res['tokens_nanogen']:,} tokens"
    lines.append(
        f"perplexity, nanogen's metric (the continuations of lines of > 10 tokens): {nanogen}"
    )
    authors = "- (a --protocol paper run keeps no such line)"
    if res["ppl_authors"] is not None:
        authors = f"{res['ppl_authors']:.2f} over {res['tokens_authors']:,} tokens"
    lines.append(
        f"perplexity, the authors' metric (one eos target more for each shorter line): {authors}"
    )
    if res["skipped"]:
        lines.append(f"({res['skipped']:,} sequences longer than the model's window left out)")
    return "\n".join(lines)


def story_report(args, res, split):
    """A story checkpoint's line: NLL per story and per event (an insertion model's: a bound)."""
    bound = ""
    if args.order == "random" and args.model in INSERTION:
        bound = f"; -log p(story) <= {res['nll_bound_per_story']:.2f} (mean over orders - log n!)"
    return (
        f"{args.dataset} {split} {args.model}: {res['sequences']} stories, NLL "
        f"{res['nll_per_story']:.2f} per story, {res['nll']:.4f} per event (ppl "
        f"{res['ppl']:.2f}){bound}"
    )


def write_json(path, obj):
    """obj as JSON at path, whole or not at all (common.write_file: a full disk is one line)."""
    write_file(path, lambda f: json.dump(obj, f, indent=1))


def evaluate_once(ckpt, flags, path):
    """main's result for (ckpt, flags), kept at path (JSON) and reused while it holds the same
    request on an unchanged checkpoint (anything else there is evaluated again): reproduce.py's."""
    # A result is kept only for the same request on a checkpoint no newer than it: a run trained
    # on since then is evaluated again.
    try:
        with open(path) as f:
            res = json.load(f)
        if res.get("request") == flags and os.path.getmtime(path) >= os.path.getmtime(ckpt):
            return res
    # (absent, not JSON, not a dict: evaluated again)
    except (OSError, ValueError, AttributeError):
        pass
    main(["--ckpt", ckpt, *flags, "--out", path])
    with open(path) as f:
        res = dict(json.load(f), request=flags)
    write_json(path, res)
    return res


# ----- the decoding study (NMST paper section 4) ----------------------------------------------
def decoding_study(model, data, a, device):
    """Decode every context of the split once up to max(L): r_nt(L), its curve, the lengths,
    uniqueness and examples (NMST paper Table 2-4, Fig. 2, 7, 8)."""
    split = data[a.split]
    n = len(split)
    if a.limit is not None:
        n = min(a.limit, len(split))
    if n == 0:
        raise UserError(f"the {a.split} split holds no sequence: no context to decode")
    contexts = [torch.as_tensor(split.context(i)) for i in range(n)]
    # A window model's context and continuation must fit its window.
    cap = longest_continuation(model, max(map(len, contexts)))
    if cap is not None and max(a.L) > cap:
        raise UserError(
            f"--L {max(a.L)} does not fit the model's window: a context and its "
            f"continuation must fit, use --L {cap} or less"
        )
    # One decode to max(L) gives every smaller L.
    result = decode_in_batches(
        model,
        contexts,
        max(a.L),
        a.decode_batch or decode_batch_size(model, max(a.L), a.beam_size or 1, device),
        f"decoding ({a.decoder})",
        decoder=a.decoder,
        generator=sampling_generator(device, a.seed or 0),
        **decoder_options(a),
    )
    # r_nt(L) at 60 L's spread evenly on a log axis up to max(L) (the figure's curve)
    curve = sorted({int(round(x)) for x in torch.logspace(0, math.log10(max(a.L)), 60).tolist()})
    lengths = zip(result["lengths"].tolist(), result["terminated"].tolist())
    return dict(
        decode_stats(result, a.L),
        r_nt_curve=decode_stats(result, curve)["r_nt"],
        examples=examples(result, split, data["tokenizer"], a.examples),
        generated_lengths=[m if done else None for m, done in lengths],
        ground_truth_lengths=(split.lengths[:n] - split.contexts[:n]).tolist(),
        decoder=a.decoder,
        seed=a.seed,
        **decoder_options(a),
    )


def examples(result, split, tokenizer, count):
    """The first `count` terminated and `count` non-terminated continuations, printed and kept
    with their context and the true continuation."""
    out, seen = [], Counter()
    for i, toks in enumerate(result["tokens"]):
        done, c = bool(result["terminated"][i]), int(split.contexts[i])
        if seen[done] == count:
            continue
        seen[done] += 1
        continuation = tokenizer.decode(toks[:200])
        if len(toks) > 200:
            continuation += " ..."
        ex = dict(
            index=i,
            terminated=done,
            context=tokenizer.decode(split[i][:c].tolist()),
            continuation=continuation,
            ground_truth=tokenizer.decode(split[i][c:].tolist()[:200]),
        )
        out.append(ex)
        status = "NOT terminated"
        if done:
            status = "terminated"
        print(f"\n[{status}] context: {ex['context']}\n  continuation: {continuation[:400]}")
    return out


def decode_batch_size(model, L, beams, device):
    """--decode_batch's default.  On a CPU 64 (512 contexts to L = 100: 16 a batch was 3-9x
    slower, 64 to 512 within 1.5x: RESULTS.md).  On a GPU, where a step of 64 rows costs about
    what one of thousands does, as many rows as fit a quarter of the free memory: a step's few
    (rows, V) float32 tensors, and a window model's key / value cache to L tokens.  Finished rows
    leave the batch as they end."""
    if not device.startswith("cuda"):
        return 64
    cfg = model.cfg
    # Bytes a row: a step's four (V,) float32 tensors, and a window model's cache.
    row = 4 * 4 * cfg["vocab_size"]
    if cfg["model"] in ("gpt", "gcnn"):
        row += 4 * 2 * cfg["n_layer"] * cfg["d_model"] * min(L + 64, cfg["block_size"])
    free = torch.cuda.mem_get_info(device)[0]
    # Beam search keeps beams rows a prompt.
    return max(1, min(4096, free // 4 // (row * beams)))


def eos_traces(model, split, n):
    """p(eos | y_<t, x) along the true continuation of the first n sequences that fit the model's
    window (NMST paper Fig. 3)."""
    out = []
    for i in range(len(split)):
        if len(out) == n:
            break
        c, seq = int(split.contexts[i]), split[i].tolist()
        L = longest_continuation(model, c)
        # (None: no window, every continuation fits)
        if L is None or len(seq) - c <= L:
            out.append(dict(index=i, p_eos=eos_probs(model, seq[:c], seq[c:])))
    return out


# ----- the temperature report (CT paper Fig. 1, Tables 5-6) -----------------------------------
def tau_report(model, args, data, a, device, top=10):
    """The contextual temperature along the text (the split's 10 evaluation columns read as a
    stream): tau of the word that comes next at every position, and each word's mean tau.
    Sentences of 16-24 words are cut to their first, middle and last 5 words, as in the paper,
    and tau at each of those 15 positions is averaged (with a 95% interval)."""
    ct_word_model = args.head in ("ct", "ctmos") and args.model in ("rnn", "lstm")
    if not ct_word_model or data["tokenizer"].kind != "word":
        raise UserError(
            "--tau_report is the CT paper's word-level analysis: a ct / ctmos head on "
            "an rnn / lstm, word-level data"
        )
    # The split read as the CT paper's evaluation reads it: 10 columns of the stream.
    cols = batchify(data["streams"][a.split], 10, a.split)[:, : a.limit and a.limit + 1]
    spans = [
        (b, s, e) for b in range(10) for s, e in sentences(cols[b, 1:].tolist(), data["eos_id"])
    ]
    if not spans:
        raise UserError("no sentence of 16-24 words here (or within --limit): nothing to report")
    tau_next, tau_mean = temperatures(model, cols, args.bptt, device)
    # (sentences, 15): the first, middle and last 5 words of each
    rows = torch.stack(
        [
            torch.cat([w[:5], w[(len(w) - 5) // 2 :][:5], w[-5:]])
            for w in (tau_next[b, s:e] for b, s, e in spans)
        ]
    )
    # The vocabulary by mean temperature, highest first (CT Tables 5-6).
    order = torch.argsort(tau_mean, descending=True)

    def word(v):
        # (the word, its mean tau)
        return data["tokenizer"].decode([int(v)]), tau_mean[v].item()

    rep = dict(
        sentences=len(rows),
        position_mean=rows.mean(0).tolist(),
        position_ci95=(1.96 * rows.std(0) / math.sqrt(len(rows))).tolist(),
        positions=[f"{part}-{i + 1}" for part in ("first", "mid", "last") for i in range(5)],
        highest=[word(v) for v in order[:top]],
        lowest=[word(v) for v in order[-top:].flip(0)],
    )
    print_tau_report(rep)
    if a.plot:
        curves.tau_figure(rep, os.path.join(a.plot, "tau_by_position.png"))
    return rep


@torch.no_grad()
def temperatures(model, cols, bptt, device):
    """CT eq. 6's tau along the columns read as a stream: -> (tau of the next word at every
    position (10, n - 1), each word's mean tau over every position (V,))."""
    tau_next = torch.zeros(10, cols.size(1) - 1, dtype=torch.float64)
    tau_sum, n, state = 0.0, 0, None
    with eval_mode(model):
        for i, L in bptt_windows(cols.size(1), bptt):
            x, y = cols[:, i : i + L].to(device), cols[:, i + 1 : i + 1 + L].to(device)
            h, state = model.backbone(x, state)
            tau = model.head.temperatures(h).double()  # (10, L, V)
            tau_next[:, i : i + L] = tau.gather(-1, y.unsqueeze(-1)).squeeze(-1).cpu()
            tau_sum, n = tau_sum + tau.sum((0, 1)).cpu(), n + y.numel()
    return tau_next, tau_sum / n


def print_tau_report(rep):
    print(
        f"temperature of the next word by position ({rep['sentences']} sentences of 16-24 words):"
    )
    for name, m, c in zip(rep["positions"], rep["position_mean"], rep["position_ci95"]):
        print(f"  {name:8s} {m:.6f} +- {c:.6f}")
    print("highest mean tau:", ", ".join(f"{w} {t:.6f}" for w, t in rep["highest"]))
    print("lowest mean tau: ", ", ".join(f"{w} {t:.6f}" for w, t in rep["lowest"]))


def sentences(column, eos_id):
    """(start, end) of every 16-24-word sentence of a column (positions of next words): a
    sentence starts after an eos (the column's first, cut one is skipped)."""
    out, start = [], None
    # A sentence ends at each eos; the paper keeps those of 16-24 words.
    for j, tok in enumerate(column):
        if tok == eos_id:
            if start is not None and 15 < j - start < 25:
                out.append((start, j))
            start = j + 1
    return out


# ----- stories: generation, BLEU, keyword inclusion (InsNet paper section 5) ------------------
# --- stories: generation, BLEU, keyword inclusion (InsNet paper section 5) --------------------
def bleu(hypotheses, references, max_n=4):
    """Corpus BLEU-max_n (Papineni et al. 2002), one reference a hypothesis, no smoothing, in
    percent: BP * exp(mean_{n<=max_n} log p_n), p_n the clipped n-gram precision over the corpus,
    BP = exp(1 - r/c) when c < r; 0 when some p_n = 0 (as sacrebleu's corpus_bleu, tokenize and
    smoothing "none", and nltk's when every hypothesis has at least max_n tokens: tests)."""
    # The clipped n-gram matches and the n-gram counts, summed over the corpus, and the lengths.
    matches, totals, c, r = [0] * max_n, [0] * max_n, 0, 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        c, r = c + len(hyp), r + len(ref)
        for n in range(1, max_n + 1):
            h = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
            rc = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(k, rc[g]) for g, k in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    # Without smoothing one empty precision makes the geometric mean 0.
    if c == 0 or min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_n
    return 100.0 * (1.0 if c > r else math.exp(1 - r / c)) * math.exp(log_p)


@torch.no_grad()
def story_generation(model, args, data, a, device):
    """A story for each (title[, storyline]) of the split, scored against the reference story:
    BLEU-1..4 and, for --task storyline, the share of storyline keywords found in order (InsNet:
    100 % by construction, the keywords are given canvas tokens)."""
    # Insertion decoding chooses a slot, then a token: greedy, sampling and top-k only.
    check_decoder_args(a.decoder, STORY_DECODERS, **decoder_options(a))
    if not data["stories"]:
        raise UserError("generation is scored against ROCStories: use a rocstories checkpoint")
    g = sampling_generator(device, a.seed or 0)
    hyps, refs, included, total, shown = [], [], 0, 0, []
    for i, story in enumerate(data["stories"][a.split][: a.limit]):
        hyp = one_story(model, args, a, data, i, g)
        hyps.append(hyp)
        refs.append(story["story"])
        total += len(story["keywords"])
        # the storyline's keywords found in order
        included += len(keyword_positions(hyp, story["keywords"]))
        if len(shown) < a.examples:
            shown.append(
                dict(
                    title=" ".join(story["title"]),
                    storyline=" ".join(story["keywords"]),
                    generated=" ".join(hyp),
                    reference=" ".join(story["story"]),
                )
            )
    inclusion = None
    if args.task == "storyline" and total:
        inclusion = included / total
    gen = dict(
        bleu={n: bleu(hyps, refs, n) for n in range(1, 5)},
        stories=len(hyps),
        repeating=sum(map(repeats_a_4gram, hyps)) / max(len(hyps), 1),
        keyword_inclusion=inclusion,
        mean_length=sum(map(len, hyps)) / max(len(hyps), 1),
        examples=shown,
        decoder=a.decoder,
        k=a.k,
        temperature=a.temperature,
    )
    print_generation(gen)
    return gen


def one_story(model, args, a, data, i, g):
    """The words of the split's story i as generated: an insertion model fills the canvas BOS
    title SEP [keywords] EOS in; a left-to-right one continues BOS title SEP.  Each story may
    have twice its reference's words + 10, within the model's window.  g: the sampling
    generator, on the model's device."""
    story, seq, vocab = data["stories"][a.split][i], data[a.split][i], data["vocab"]
    # The control tokens are never generated as words.
    banned = (PAD, BOS, EOS, SEP)
    prefix, cap = seq["tokens"][: seq["n_given"]], 2 * len(story["story"]) + 10
    if args.model not in INSERTION:
        L = min(cap, longest_continuation(model, len(prefix)))
        prompt = [torch.tensor(prefix, device=g.device)]
        out = decode(model, prompt, L, a.decoder, k=a.k, temperature=a.temperature, generator=g)
        return [vocab[t] for t in out["tokens"][0] if t not in banned]
    keywords = []
    if args.task == "storyline":
        keywords = seq["keywords"]
    out = generate(
        model,
        [*prefix, *keywords, EOS],
        min(len(prefix) + cap + 1, model.max_canvas() or math.inf),
        Decoding(a.decoder, a.k, a.temperature, len(prefix) - 1, banned),
        generator=g,
    )
    # A given keyword keeps its word, <unk> or not.
    words = iter(story["keywords"])
    placed = zip(out["tokens"][len(prefix) : -1], out["given"][len(prefix) : -1])
    return [next(words) if given else vocab[t] for t, given in placed]


def print_generation(gen):
    b, kw = gen["bleu"], gen["keyword_inclusion"]
    included = ""
    if kw is not None:
        included = f", storyline keywords included {100 * kw:.2f}%"
    print(
        f"generation ({gen['decoder']}): BLEU-1/2/3/4 {b[1]:.2f} / {b[2]:.2f} / {b[3]:.2f} / "
        f"{b[4]:.2f}, mean length {gen['mean_length']:.1f}{included}"
    )
    for ex in gen["examples"]:
        print(
            f"  [{ex['title']} | {ex['storyline']}] {ex['generated']}\n    reference: "
            f"{ex['reference']}"
        )


def repeats_a_4gram(words):
    """Whether a generated story holds some 4-gram twice: the mark of a decoder in a loop."""
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(set(grams)) < len(grams)


# ----- --compare: studies side by side --------------------------------------------------------
# What a study's --out file holds (a run's keys, its decoding study's keys).
STUDY_KEYS = ("model", "head", "epsilon", "dataset")
DECODING_KEYS = ("decoder", "r_nt", "r_nt_curve", "mean_length", "n", "generated_lengths")


def compare(a):
    """--compare: the studies of earlier --out files side by side (and overlaid with --plot)."""
    results = []
    for path in a.compare:
        try:
            with open(path) as f:
                r = json.load(f)
            ok = set(STUDY_KEYS) <= r.keys() and set(DECODING_KEYS) <= r["decoding"].keys()
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise UserError(f"--compare: {path} is not a study of evaluate.py --decoder ... --out")
        results.append(r)
    curves.print_study_table(results)
    if a.plot:
        curves.plot_study(results, a.plot, a.compare)


if __name__ == "__main__":
    run(main)
