"""Evaluate a checkpoint: perplexity, the non-termination study, the temperature report, and for
story checkpoints NLL, BLEU and storyline keyword inclusion.

    python evaluate.py --ckpt out/wikitext2-lstm-nmst/ckpt_best.pt --split valid --out res.json
    python evaluate.py --ckpt CKPT --no_ppl --decoder greedy --L 10 100 1000 --plot figs/ --out g
    python evaluate.py --compare va.json st.json nmst.json --plot figs/   # overlay the studies

The study (--decoder) continues every context once up to max(--L) tokens: r_nt(L) (NMST paper
eq. 11) and its curve (Fig. 2, 7), the lengths (Fig. 8), unique non-terminated continuations,
examples, and p(eos) along true continuations (Fig. 3).
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
    POS,
    RUN_FILES,
    SEED,
    Parser,
    UserError,
    all_sum,
    autocast,
    check_output,
    check_vocab,
    get_device,
    load_checkpoint,
    number,
    run,
    world,
    write_file,
)
from data.loader import batchify, bptt_windows, collate, epoch_batches, load_data, to_device
from data.stories import BOS, EOS, PAD, SEP, keyword_positions
from decode import (
    DECODER_OPTIONS,
    DECODERS,
    STORY_DECODERS,
    check_decoder_args,
    decode,
    decode_in_batches,
    decode_stats,
    eos_probs,
    longest_continuation,
    non_termination_ratio,
    sampling_generator,
)
from heads import EPSILON_HEADS, paper_name
from insnet import INSERTION, Decoding, generate, story_batch
from model import LanguageModel, eval_mode

STUDY_FLAGS = (
    "L",
    "k",
    "p",
    "beam_size",
    "temperature",
    "consistent",
    "length_penalty",
    "decode_batch",
    "examples",
    "traces",
)


def parser():
    p = Parser(description="Evaluate a checkpoint (perplexity, non-termination study, BLEU).")
    p.add_argument("--ckpt", help="a checkpoint of train.py (required unless --compare)")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    p.add_argument("--data_dir", help="the data (default: the run's, $NANOGEN_DATA, a download)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto)")
    p.add_argument("--batch_size", type=INT1, help="sequences per batch (default: the run's)")
    p.add_argument("--max_tokens", type=INT1, help="padded tokens per batch (default: the run's)")
    p.add_argument("--limit", type=INT1, help="the first N sequences (stream: tokens a column)")
    p.add_argument("--out", help="the results as JSON")
    p.add_argument("--no_ppl", action="store_true", help="no perplexity pass")
    add_decoding_flags(p)
    p.add_argument(
        "--L",
        type=number(int, lambda v: 1 <= v <= 10**6, "in [1, 10^6]"),
        nargs="+",
        default=[10, 100, 1000],
        help="r_nt(L) thresholds; decodes run to max(L)",
    )
    p.add_argument(
        "--decode_batch",
        type=INT1,
        help="prompts decoded together (default: 64 on a CPU; on a GPU as many as fit a quarter "
        "of its free memory)",
    )
    p.add_argument("--examples", type=INT0, default=3, help="examples of each kind")
    p.add_argument("--traces", type=INT0, default=5, help="sequences with p(eos) traces (Fig. 3)")
    p.add_argument("--plot", metavar="DIR", help="PNG figures of the study into DIR")
    p.add_argument(
        "--tau_report",
        action="store_true",
        help="ct / ctmos: temperature by position "
        "and the words of highest / lowest temperature (CT paper Fig. 1, Tables 5-6)",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="JSON",
        help="no evaluation: the studies of "
        "these --out files side by side (and overlaid with --plot)",
    )
    return p


def add_decoding_flags(p):
    """The decoders' flags, as evaluate.py and sample.py take them."""
    p.add_argument("--decoder", choices=DECODERS, help="decode every context (the study)")
    p.add_argument("--k", type=INT1, help="top-k")
    p.add_argument("--p", type=number(float, lambda v: 0 < v <= 1, "in (0, 1]"), help="nucleus mu")
    p.add_argument("--beam_size", type=number(int, lambda v: 1 <= v <= 1000, "in [1, 1000]"))
    p.add_argument("--temperature", type=POS, default=1.0, help="sampling temperature")
    p.add_argument("--consistent", action="store_true", help="top-k / nucleus: always keep eos")
    p.add_argument(
        "--length_penalty",
        type=number(float, lambda v: v >= 0, ">= 0"),
        default=0.0,
        help="beam: s / |y|^a",
    )
    p.add_argument("--seed", type=SEED, help="sampling seed")


def decoder_options(a):
    """The decoder's own arguments among the parsed decoding flags: {k, p, beam_size, ...}."""
    return {name: getattr(a, name) for name in DECODER_OPTIONS}


def check_flags(a):
    """The flag combinations that would do nothing: one line each; -> the flags given."""
    given = {k for k, v in vars(a).items() if v != parser().get_default(k)}
    study = {k for k in STUDY_FLAGS if k in given}
    # What to evaluate
    if not a.compare and not a.ckpt:
        raise UserError("give --ckpt CKPT (or --compare JSON ...)")
    if a.compare and given - {"compare", "plot"}:
        raise UserError(
            "--compare draws studies already written (--out files) and takes only --plot"
        )
    # Flags that only a study, a figure or the perplexity pass reads
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
    if a.no_ppl and (a.batch_size or a.max_tokens):
        raise UserError(
            "--batch_size / --max_tokens batch the perplexity pass, which --no_ppl skips"
        )
    if a.decoder:
        check_decoder_args(a.decoder, **decoder_options(a))
    if a.compare:  # (with --ckpt: checked in load_run, where the run's data folder is known)
        check_output(a.plot, "--plot", a.compare, folder=True)
    return given


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
    model = model_from_checkpoint(ckpt, path)  # (before the data is read)
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
    if sizes and args.task == "stream":
        raise UserError("a stream checkpoint reads 10 columns: drop --batch_size / --max_tokens")
    if sizes and all(sizes):
        raise UserError("give --batch_size (sequences a batch) or --max_tokens, not both")
    if sizes and sizes[1] and args.task in ("story", "storyline"):
        raise UserError("a story checkpoint is batched by --batch_size (stories), not --max_tokens")
    if sizes:
        args.batch_size, args.max_tokens = sizes
    data = load_data(args, verbose=False)
    check_vocab(ckpt, data, path)
    return ckpt, args, data, model.to(device)


def main(argv=None):
    a = parser().parse_args(argv)
    given = check_flags(a)
    if a.compare:
        return compare(a)
    device = get_device(a.device)
    sizes = (a.batch_size, a.max_tokens) if a.batch_size or a.max_tokens else None
    outputs = [(a.out, "--out", False), (a.plot, "--plot", True)]
    ckpt, args, data, model = load_run(a.ckpt, a.data_dir, device, sizes, outputs)
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
    story = args.task in ("story", "storyline")
    if story and (a.tau_report or a.plot or {"consistent", "L", "traces", "decode_batch"} & given):
        raise UserError(
            "--tau_report / --plot / --consistent / --L / --traces / --decode_batch "
            "are for left-to-right text checkpoints, not a story one (NLL, BLEU)"
        )
    if a.decoder and args.task != "completion" and not story:
        raise UserError(f"--decoder continues completion contexts, not a --task {args.task} run")
    if not a.no_ppl:
        # (--batch_size / --max_tokens: load_run set them on args)
        with autocast(device, args.dtype):
            res.update(perplexity(args, model, data, a.split, a.limit, device))
        print(report(args, res, a.split))
    if story and a.decoder:
        res["generation"] = story_generation(model, args, data, a, device)
    elif a.decoder:
        res.update(
            decoding=decoding_study(model, data, a, device),
            eos_traces=eos_traces(model, data[a.split], a.traces),
        )
        print_study_table([res])
        if a.plot:
            plot_study([res], a.plot)
    if a.tau_report:
        res["tau_report"] = tau_report(model, args, data, a, device)
    if a.out:
        write_json(a.out, res)


def report(args, res, split):
    if args.task == "stream":
        return (
            f"{split}: stream perplexity {res['ppl']:.2f} (nll {res['nll']:.4f} over "
            f"{res['tokens']:,} tokens, 10 columns, BPTT {args.bptt})"
        )
    if args.task in ("story", "storyline"):
        bound = (
            f"; -log p(story) <= {res['nll_bound_per_story']:.2f} (mean over orders - log n!)"
            if args.order == "random" and args.model in INSERTION
            else ""
        )
        return (
            f"{args.dataset} {split} {args.model}: {res['sequences']} stories, NLL "
            f"{res['nll_per_story']:.2f} per story, {res['nll']:.4f} per event (ppl "
            f"{res['ppl']:.2f}){bound}"
        )
    if res["sequences"] == 0:
        raise UserError(f"the {split} split holds no sequence that fits this model: no perplexity")
    lines = [
        f"{'split':6s} {'sequences':>9s} {'tokens':>9s} {'nll':>7s} {'ppl':>9s} "
        f"{'p(eos@end)':>10s}",
        f"{split:6s} {res['sequences']:9d} {res['tokens']:9d} {res['nll']:7.4f} "
        f"{res['ppl']:9.2f} {res['eos_prob_at_end']:10.4f}",
        f"perplexity, nanogen's metric (the continuations of lines of > 10 tokens): "
        f"{res['ppl_nanogen']:.2f} over {res['tokens_nanogen']:,} tokens",
    ]
    if res["ppl_authors"] is None:
        lines.append(
            "perplexity, the authors' metric (one eos target more for each shorter line): "
            "- (a --protocol paper run keeps no such line)"
        )
    else:
        lines.append(
            f"perplexity, the authors' metric (one eos target more for each shorter line): "
            f"{res['ppl_authors']:.2f} over {res['tokens_authors']:,} tokens"
        )
    if res["skipped"]:
        lines.append(f"({res['skipped']:,} sequences longer than the model's window left out)")
    return "\n".join(lines)


def write_json(path, obj):  # (common.write_file: whole or not at all, a full disk one line)
    write_file(path, lambda f: json.dump(obj, f, indent=1))


def evaluate_once(ckpt, flags, path):
    """main's result for (ckpt, flags), kept at path (JSON) and reused while it holds the same
    request on an unchanged checkpoint (anything else there is evaluated again): reproduce.py's."""
    try:
        with open(path) as f:
            res = json.load(f)
        if res.get("request") == flags and os.path.getmtime(path) >= os.path.getmtime(ckpt):
            return res
    except (OSError, ValueError, AttributeError):  # absent, not JSON, not a dict
        pass
    main(["--ckpt", ckpt, *flags, "--out", path])
    with open(path) as f:
        res = dict(json.load(f), request=flags)
    write_json(path, res)
    return res


# --- the decoding study (NMST paper section 4) ------------------------------------------------
def decoding_study(model, data, a, device):
    """Decode every context of the split once up to max(L): r_nt(L), its curve, the lengths,
    uniqueness and examples (NMST paper Table 2-4, Fig. 2, 7, 8)."""
    split = data[a.split]
    n = len(split) if a.limit is None else min(a.limit, len(split))
    if n == 0:
        raise UserError(f"the {a.split} split holds no sequence: no context to decode")
    contexts = [torch.as_tensor(split.context(i)) for i in range(n)]
    cap = longest_continuation(model, max(map(len, contexts)))
    if cap is not None and max(a.L) > cap:
        raise UserError(
            f"--L {max(a.L)} does not fit the model's window: a context and its "
            f"continuation must fit, use --L {cap} or less"
        )
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
    stats = decode_stats(result, a.L)
    curve = sorted({int(round(x)) for x in torch.logspace(0, math.log10(max(a.L)), 60).tolist()})
    detok = data["tokenizer"].decode
    examples, seen = [], Counter()
    for i, toks in enumerate(result["tokens"]):
        done, c = bool(result["terminated"][i]), int(split.contexts[i])
        if seen[done] < a.examples:
            seen[done] += 1
            continuation = detok(toks[:200])
            if len(toks) > 200:
                continuation += " ..."
            ex = dict(
                index=i,
                terminated=done,
                context=detok(split[i][:c].tolist()),
                continuation=continuation,
                ground_truth=detok(split[i][c:].tolist()[:200]),
            )
            examples.append(ex)
            print(
                f"\n[{'terminated' if done else 'NOT terminated'}] context: {ex['context']}"
                f"\n  continuation: {ex['continuation'][:400]}"
            )
    return dict(
        stats,
        r_nt_curve=decode_stats(result, curve)["r_nt"],
        examples=examples,
        generated_lengths=[
            m if done else None
            for m, done in zip(result["lengths"].tolist(), result["terminated"].tolist())
        ],
        ground_truth_lengths=(split.lengths[:n] - split.contexts[:n]).tolist(),
        **{
            k: getattr(a, k)
            for k in (
                "decoder",
                "k",
                "p",
                "beam_size",
                "temperature",
                "consistent",
                "length_penalty",
                "seed",
            )
        },
    )


def decode_batch_size(model, L, beams, device):
    """--decode_batch's default.  On a CPU 64 (512 contexts to L = 100: 16 a batch was 3-9x
    slower, 64 to 512 within 1.5x: RESULTS.md).  On a GPU, where a step of 64 rows costs about
    what one of thousands does, as many rows as fit a quarter of the free memory: a step's few
    (rows, V) float32 tensors, and a window model's key / value cache to L tokens.  Finished rows
    leave the batch as they end."""
    if not device.startswith("cuda"):
        return 64
    cfg = model.cfg
    row = 4 * 4 * cfg["vocab_size"]
    if cfg["model"] in ("gpt", "gcnn"):
        row += 4 * 2 * cfg["n_layer"] * cfg["d_model"] * min(L + 64, cfg["block_size"])
    free = torch.cuda.mem_get_info(device)[0]
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


# --- the temperature report (CT paper Fig. 1, Tables 5-6) -------------------------------------
@torch.no_grad()
def tau_report(model, args, data, a, device, top=10):
    """The contextual temperature along the text (the split's 10 evaluation columns read as a
    stream): tau of the word that comes next at every position, and each word's mean tau.
    Sentences of 16-24 words are cut to their first, middle and last 5 words, as in the paper,
    and tau at each of those 15 positions is averaged (with a 95% interval)."""
    if (
        args.head not in ("ct", "ctmos")
        or args.model not in ("rnn", "lstm")
        or data["tokenizer"].kind != "word"
    ):
        raise UserError(
            "--tau_report is the CT paper's word-level analysis: a ct / ctmos head on "
            "an rnn / lstm, word-level data"
        )
    cols = batchify(data["streams"][a.split], 10, a.split)[:, : a.limit and a.limit + 1]
    spans = [
        (b, s, e) for b in range(10) for s, e in sentences(cols[b, 1:].tolist(), data["eos_id"])
    ]
    if not spans:
        raise UserError("no sentence of 16-24 words here (or within --limit): nothing to report")
    tau_next = torch.zeros(10, cols.size(1) - 1, dtype=torch.float64)
    tau_sum, n, state = torch.zeros(data["vocab_size"], dtype=torch.float64), 0, None
    with eval_mode(model):
        for i, L in bptt_windows(cols.size(1), args.bptt):
            x, y = cols[:, i : i + L].to(device), cols[:, i + 1 : i + 1 + L].to(device)
            h, state = model.backbone(x, state)
            tau = model.head.temperatures(h).double()  # (10, L, V), CT eq. 6
            tau_next[:, i : i + L] = tau.gather(-1, y.unsqueeze(-1)).squeeze(-1).cpu()
            tau_sum, n = tau_sum + tau.sum((0, 1)).cpu(), n + y.numel()
    rows = torch.stack(
        [
            torch.cat([w[:5], w[(len(w) - 5) // 2 :][:5], w[-5:]])
            for w in (tau_next[b, s:e] for b, s, e in spans)
        ]
    )  # (sentences, 15)
    mean = rows.mean(0)
    half = 1.96 * rows.std(0) / math.sqrt(len(rows))
    order = torch.argsort(tau_sum / n, descending=True)

    def word(v):  # (the word, its mean tau)
        return data["tokenizer"].decode([int(v)]), (tau_sum[v] / n).item()

    rep = dict(
        sentences=len(rows),
        position_mean=mean.tolist(),
        position_ci95=half.tolist(),
        positions=[f"{part}-{i + 1}" for part in ("first", "mid", "last") for i in range(5)],
        highest=[word(v) for v in order[:top]],
        lowest=[word(v) for v in order[-top:].flip(0)],
    )
    print(f"temperature of the next word by position ({len(rows)} sentences of 16-24 words):")
    for name, m, c in zip(rep["positions"], rep["position_mean"], rep["position_ci95"]):
        print(f"  {name:8s} {m:.6f} +- {c:.6f}")
    print("highest mean tau:", ", ".join(f"{w} {t:.6f}" for w, t in rep["highest"]))
    print("lowest mean tau: ", ", ".join(f"{w} {t:.6f}" for w, t in rep["lowest"]))
    if a.plot:
        fig, ax = curves.pyplot().subplots(figsize=(7, 3.5))
        ax.errorbar(range(15), rep["position_mean"], yerr=rep["position_ci95"], fmt="o-", capsize=3)
        ax.set_xticks(range(15), rep["positions"], rotation=60, fontsize=7)
        ax.set(
            ylabel="tau of the next word",
            title=f"contextual temperature by position ({rep['sentences']} sentences)",
        )
        curves.save_figure(fig, os.path.join(a.plot, "tau_by_position.png"))
    return rep


def sentences(column, eos_id):
    """(start, end) of every 16-24-word sentence of a column (positions of next words): a
    sentence starts after an eos (the column's first, cut one is skipped)."""
    out, start = [], None
    for j, tok in enumerate(column):
        if tok == eos_id:
            if start is not None and 15 < j - start < 25:
                out.append((start, j))
            start = j + 1
    return out


# --- stories: generation, BLEU, keyword inclusion (InsNet paper section 5) --------------------
def bleu(hypotheses, references, max_n=4):
    """Corpus BLEU-max_n (Papineni et al. 2002), one reference a hypothesis, no smoothing, in
    percent: BP * exp(mean_{n<=max_n} log p_n), p_n the clipped n-gram precision over the corpus,
    BP = exp(1 - r/c) when c < r; 0 when some p_n = 0 (as sacrebleu's corpus_bleu, tokenize and
    smoothing "none", and nltk's when every hypothesis has at least max_n tokens: tests)."""
    matches, totals, c, r = [0] * max_n, [0] * max_n, 0, 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        c, r = c + len(hyp), r + len(ref)
        for n in range(1, max_n + 1):
            h = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
            rc = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(k, rc[g]) for g, k in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    if c == 0 or min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_n
    return 100.0 * (1.0 if c > r else math.exp(1 - r / c)) * math.exp(log_p)


@torch.no_grad()
def story_generation(model, args, data, a, device):
    """A story for each (title[, storyline]) of the split, scored against the reference story:
    BLEU-1..4 and, for --task storyline, the share of storyline keywords found in order (InsNet:
    100 % by construction, the keywords are given canvas tokens).  Each story may have twice its
    reference's words + 10, within the model's window."""
    check_decoder_args(a.decoder, STORY_DECODERS, **decoder_options(a))
    if not data["stories"]:
        raise UserError("generation is scored against ROCStories: use a rocstories checkpoint")
    vocab, g, banned = data["vocab"], sampling_generator(device, a.seed or 0), (PAD, BOS, EOS, SEP)
    hyps, refs, included, total, shown = [], [], 0, 0, []
    for story, seq in list(zip(data["stories"][a.split], data[a.split]))[: a.limit]:
        prefix, cap = seq["tokens"][: seq["n_given"]], 2 * len(story["story"]) + 10
        if args.model in INSERTION:  # the canvas BOS title SEP [keywords] EOS, filled in
            kw = seq["keywords"] if args.task == "storyline" else []
            out = generate(
                model,
                [*prefix, *kw, EOS],
                min(len(prefix) + cap + 1, model.max_canvas() or math.inf),
                Decoding(a.decoder, a.k, a.temperature, len(prefix) - 1, banned),
                generator=g,
            )
            words = iter(story["keywords"])  # a given keyword keeps its word, <unk> or not
            hyp = [
                next(words) if given else vocab[t]
                for t, given in zip(out["tokens"][len(prefix) : -1], out["given"][len(prefix) : -1])
            ]
        else:
            L = min(cap, longest_continuation(model, len(prefix)))
            out = decode(
                model,
                [torch.tensor(prefix, device=device)],
                L,
                a.decoder,
                k=a.k,
                temperature=a.temperature,
                generator=g,
            )
            hyp = [vocab[t] for t in out["tokens"][0] if t not in banned]
        hyps.append(hyp)
        refs.append(story["story"])
        total += len(story["keywords"])
        included += len(keyword_positions(hyp, story["keywords"]))  # found in order
        if len(shown) < a.examples:
            shown.append(
                dict(
                    title=" ".join(story["title"]),
                    storyline=" ".join(story["keywords"]),
                    generated=" ".join(hyp),
                    reference=" ".join(story["story"]),
                )
            )
    gen = dict(
        bleu={n: bleu(hyps, refs, n) for n in range(1, 5)},
        stories=len(hyps),
        repeating=sum(map(repeats_a_4gram, hyps)) / max(len(hyps), 1),
        keyword_inclusion=included / total if args.task == "storyline" and total else None,
        mean_length=sum(map(len, hyps)) / max(len(hyps), 1),
        examples=shown,
        decoder=a.decoder,
        k=a.k,
        temperature=a.temperature,
    )
    b, kw = gen["bleu"], gen["keyword_inclusion"]
    print(
        f"generation ({a.decoder}): BLEU-1/2/3/4 {b[1]:.2f} / {b[2]:.2f} / {b[3]:.2f} / "
        f"{b[4]:.2f}, mean length {gen['mean_length']:.1f}"
        + (f", storyline keywords included {100 * kw:.2f}%" if kw is not None else "")
    )
    for ex in shown:
        print(
            f"  [{ex['title']} | {ex['storyline']}] {ex['generated']}\n    reference: "
            f"{ex['reference']}"
        )
    return gen


def repeats_a_4gram(words):
    """Whether a generated story holds some 4-gram twice: the mark of a decoder in a loop."""
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(set(grams)) < len(grams)


# --- studies side by side: the table and the figures ------------------------------------------
def compare(a):
    """--compare: the studies of earlier --out files side by side (and overlaid with --plot)."""
    results = []
    for path in a.compare:
        try:
            with open(path) as f:
                r = json.load(f)
            ok = {"model", "head", "epsilon", "dataset"} <= r.keys() and {
                "decoder",
                "r_nt",
                "r_nt_curve",
                "mean_length",
                "n",
                "generated_lengths",
            } <= r["decoding"].keys()
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise UserError(f"--compare: {path} is not a study of evaluate.py --decoder ... --out")
        results.append(r)
    print_study_table(results)
    if a.plot:
        plot_study(results, a.plot, a.compare)


def decoder_name(d):
    extra = {
        "topk": f"-{d.get('k')}",
        "nucleus": f"-{d.get('p')}",
        "beam": f"-{d.get('beam_size')}",
    }.get(d["decoder"], "")
    t = d.get("temperature") or 1
    return (
        d["decoder"]
        + extra
        + ("+c" if d.get("consistent") else "")
        + (f"/lp{d['length_penalty']:g}" if d.get("length_penalty") else "")
        + (f"/T{t:g}" if t != 1 else "")
    )


def print_study_table(results):
    """A row a study: r_nt(L) for every L, the mean length, unique non-terminated (eps only for
    the heads that read it)."""
    Ls = sorted({int(L) for r in results for L in r["decoding"]["r_nt"]})
    print(
        f"{'model':5s} {'head':8s} {'eps':>7s} {'decoder':12s} "
        + " ".join(f"{'r_nt(%d)' % L:>11s}" for L in Ls)
        + f" {'mean len':>9s} {'uniq non-term':>13s} "
        f"{'n':>6s}"
    )
    for r in results:
        d, eps = r["decoding"], f"{r['epsilon']:.0e}" if r["head"] in EPSILON_HEADS else "-"
        r_nt = {int(L): v for L, v in d["r_nt"].items()}
        print(
            f"{r['model']:5s} {r['head']:8s} {eps:>7s} {decoder_name(d):12s} "
            + " ".join(f"{r_nt.get(L, math.nan):11.4f}" for L in Ls)
            + f" {d['mean_length']:9.1f} "
            f"{d['unique_non_terminated'] or math.nan:13.3f} {d['n']:6d}"
        )


def plot_study(results, out_dir, files=None):
    """r_nt(L) (log-log, Fig. 2 / 7), the length histograms (Fig. 8) and p(eos) traces (Fig. 3),
    the runs labelled by what differs between them (head, eps, model, decoder, dataset)."""
    plt = curves.pyplot()
    parts = [
        dict(
            head=paper_name(r["head"]),
            eps=f"eps={r['epsilon']:g}" if r["head"] in EPSILON_HEADS else "",
            model=r["model"],
            decoder=decoder_name(r["decoding"]),
            dataset=r["dataset"],
        )
        for r in results
    ]
    varying = [k for k in parts[0] if len({p[k] for p in parts}) > 1] or ["head"]
    labels = [" ".join(p[k] for k in varying if p[k]) for p in parts]
    if len(set(labels)) < len(labels) and files:  # two files of one run
        labels = [f"{x} ({os.path.basename(f)})" for x, f in zip(labels, files)]
    title = ", ".join(parts[0][k] for k in ("decoder", "dataset", "model") if k not in varying)
    figs = {name: plt.subplots(figsize=(5.5, 4)) for name in ("r_nt", "lengths")}
    cut = [max(int(L) for L in r["decoding"]["r_nt"]) for r in results]
    bins = torch.linspace(0, max(cut) + 1, 41).tolist()
    truth = results[0]["decoding"]["ground_truth_lengths"]
    figs["lengths"][1].hist(
        [min(m, max(cut)) for m in truth], bins=bins, alpha=0.4, color="gray", label="ground truth"
    )
    traced = [{t["index"]: t["p_eos"] for t in r.get("eos_traces") or []} for r in results]
    shown = next((list(t)[:3] for t in traced if t), [])
    if shown:
        figs["p_eos"] = plt.subplots(len(shown), 1, figsize=(7, 6), squeeze=False)
    for i, (r, label, L) in enumerate(zip(results, labels, cut)):
        style = dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[i % 4])
        curve, lengths = r["decoding"]["r_nt_curve"], r["decoding"]["generated_lengths"]
        figs["r_nt"][1].plot(
            [int(x) for x in curve], [max(y, 1e-4) for y in curve.values()], label=label, **style
        )
        n_cut = sum(m is None for m in lengths)
        figs["lengths"][1].hist(
            [L if m is None else m for m in lengths],
            bins=bins,
            histtype="step",
            color=style["color"],
            label=f"{label} ({n_cut} non-terminated, drawn at L={L})" if n_cut else label,
        )
        for ax, index in zip(figs["p_eos"][1][:, 0] if shown else [], shown):
            if index in traced[i]:
                ax.plot(range(1, len(traced[i][index]) + 1), traced[i][index], label=label, **style)
                ax.set(yscale="log", ylabel="p(eos)", title=f"sequence {index}")
    figs["r_nt"][1].set(
        xscale="log",
        yscale="log",
        xlabel="L",
        ylabel="r_nt(L)  (0 drawn at 1e-4)",
        title="non-termination ratio" + (f" ({title})" if title else ""),
    )
    figs["lengths"][1].set(xlabel="continuation length", ylabel="count", yscale="log")
    os.makedirs(out_dir, exist_ok=True)
    for name, (fig, ax) in figs.items():
        (ax[0, 0] if name == "p_eos" else ax).legend(fontsize=8)
        curves.save_figure(fig, os.path.join(out_dir, f"{name}.png"))
    print(f"wrote {', '.join(os.path.join(out_dir, n + '.png') for n in figs)}")


def scored(args):
    """What score() computes for a run's batches: "insertion" (an insertion model's events),
    "stream" (CT's continuous text: every token counts, the state goes on) or "tokens" (the
    masked targets of a padded batch: completions, left-to-right stories)."""
    if args.model in INSERTION:
        return "insertion"
    if args.task == "stream":
        return "stream"
    return "tokens"


def score(model, batch, kind, state=None):
    """One call of the model -> (log p of every predicted token or event (B, T), the mask of those
    that count, the stream's state).  kind: scored(args).  Insertion models (InsNet paper):
    log p(slot) + log p(token | slot) of every insertion, then log p(terminate) on the finished
    canvas."""
    if kind == "insertion":
        s = model(**{k: batch[k] for k in ("tokens", "order", "lengths", "n_given", "slot_start")})
        return (
            torch.cat([s["slot"] + s["token"], s["end"].unsqueeze(1)], 1),
            torch.cat([s["loss_mask"], torch.ones_like(s["loss_mask"][:, :1])], 1),
            None,
        )
    log_p, state = model(batch["inputs"], batch["t"], state, targets=batch["targets"])
    if kind == "stream":
        return log_p.float(), torch.ones_like(log_p, dtype=torch.bool), state
    # Every other batch starts afresh.
    return log_p.float(), batch["mask"], None


@torch.no_grad()
def perplexity(args, model, data, split="valid", limit=None, device="cpu"):
    """A split's figures: dict(nll per predicted token or event, ppl, ...).  Completion (NMST):
    the continuation's tokens (eos included), the mean p(eos) at the true end; stream (CT): every
    token, the state carried on; stories: per story too, a bound on -log p(story).  limit: the
    first N sequences (stream: tokens a column).  torchrun: each process every world-th batch.
    Autocast, if any, is the caller's (`with ctx: perplexity(...)`); the batches come in the
    sizes args gives."""
    limit = limit or args.eval_seqs or None
    stream = args.task == "stream"
    story = args.task in ("story", "storyline")
    # The insertion models' bound on -log p(story) subtracts log n! (n - 1 insertions in a
    # random order, then termination).
    orderless = story and args.order == "random" and args.model in INSERTION
    if stream:  # the usual 10 evaluation columns (or the first `limit` tokens of each)
        columns = batchify(data["streams"][split], 10, split)[:, : limit and limit + 1]
        data = {**data, split: columns}
    rank, procs = world()
    keys = epoch_batches(args, data, 0, split, limit)
    if not stream:  # (a stream carries its state from window to window: one process reads all)
        keys = keys[rank::procs]
    # nll, n, p(eos) at the end, sequences, log n!, and nll, n of the rows of > 1 target
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    state, kind = None, scored(args)
    # (a progress bar on a terminal, from the first process only)
    bar = tqdm(keys, f"perplexity ({split})", disable=True if rank else None, leave=False)
    with eval_mode(model):
        for key in bar:
            b = get_batch(args, data, key, device, split)
            log_p, mask, state = score(model, b, kind, state)
            n = mask.sum(1).double()
            zero = torch.zeros((), device=device)
            end = zero
            if not (stream or story):  # p(eos) at the true end of each line
                end = log_p.gather(1, b["lengths"].unsqueeze(1) - 2).exp()
            orders = zero
            if orderless:
                orders = torch.lgamma(n)
            nll_rows = -torch.where(mask, log_p.double(), 0.0).sum(1)  # (B,)
            # nanogen's metric leaves out the lines whose continuation is eos alone (<= 10 words)
            long = n > 1
            sums += torch.stack(
                [
                    nll_rows.sum(),
                    n.sum(),
                    end.sum().double(),
                    zero.double() + (0 if stream else len(n)),
                    orders.sum().double(),
                    nll_rows[long].sum(),
                    n[long].sum(),
                ]
            )
    nll, n, end, seqs, log_orders, nll_long, n_long = all_sum(sums.tolist(), device)
    res = dict(
        nll=nll / max(n, 1),
        ppl=math.exp(min(nll / max(n, 1), 700)),
        tokens=int(n),
        sequences=int(seqs),
    )
    if story:  # by Jensen's inequality, -log p(x) <= E_pi[-log p(x, pi)] - log n!
        return dict(
            res,
            nll_per_story=nll / max(seqs, 1),
            nll_bound_per_story=(nll - log_orders) / max(seqs, 1),
        )
    if stream:
        return res
    # Both perplexities of NMST Table 1, each over its own tokens: nanogen's (the continuations of
    # the lines of more than 10 words) and the authors' (their code's: one eos target more for
    # every shorter line, which only the authors' protocol keeps)
    res.update(
        ppl_nanogen=math.exp(min(nll_long / max(n_long, 1), 700)),
        tokens_nanogen=int(n_long),
        ppl_authors=None,
        tokens_authors=None,
    )
    if args.protocol == "authors":
        res.update(ppl_authors=res["ppl"], tokens_authors=int(n))
    total = len(data[split]) if limit is None else min(limit, len(data[split]))
    return dict(res, eos_prob_at_end=end / max(seqs, 1), skipped=total - int(seqs))


def probe(args, model, data):
    """The termination probe (NMST paper eq. 11): greedy continuations of the first --probe
    validation contexts up to --probe_L tokens, as `evaluate.py --decoder greedy --limit --L`."""
    split, t0, n = data["valid"], time.time(), min(args.probe, len(data["valid"]))
    if n == 0:
        return {}
    cap = longest_continuation(model, int(split.contexts[:n].max(initial=0)))
    L = args.probe_L
    if cap is not None:
        L = min(args.probe_L, cap)
    if L < 1:
        return {}
    res = decode_in_batches(model, [torch.as_tensor(split.context(i)) for i in range(n)], L)
    tokens, ended, tok = res["tokens"][0], bool(res["terminated"][0]), data["tokenizer"]
    text = tok.decode([t for t in tokens if t != data["eos_id"]])
    rec = dict(
        probe_r_nt=non_termination_ratio(res["lengths"], res["terminated"], L),
        probe_L=L,
        probe_n=n,
        probe_mean_length=float(res["lengths"].double().mean()),
    )
    end = f"eos at t={len(tokens)}" if ended else f"cut at L={L}: not terminated"
    if ended and len(tokens) == 1:
        end += ": the model ended at once"
    print(
        f"        probe: r_nt({L}) {rec['probe_r_nt']:.3f} over {n} contexts | mean length "
        f'{rec["probe_mean_length"]:.1f} | "{tok.decode(split.context(0).tolist())}" >>> '
        f'"{text[:120]}{"..." if len(text) > 120 else ""}" [{end}]',
        flush=True,
    )
    return dict(rec, probe_seconds=time.time() - t0)


def get_batch(args, data, key, device, split="train"):
    """One batch: inputs, targets, t and the loss mask (completion), a window of the stream's
    columns, or stories; n (the predicted tokens or events) and n_inputs: host ints."""
    if args.task == "stream":
        (i, L), cols = key, data[split]
        return dict(
            inputs=to_device(cols[:, i : i + L], device),
            t=None,
            mask=None,
            start=i,
            targets=to_device(cols[:, i + 1 : i + 1 + L], device),
            n=cols[:, :L].numel(),
            n_inputs=cols[:, :L].numel(),
        )
    if args.task in ("story", "storyline"):
        return story_batch(
            [data[split][i] for i in key[0]],
            args.model != "gpt",
            args.order,
            torch.Generator().manual_seed(key[1]),
            device,
        )
    cap = args.max_tokens and (args.window or math.inf)
    # The authors' protocol trains on the context's targets too (their loss has no context mask);
    # every evaluation scores the continuation alone.
    context_loss = args.protocol == "authors" and split == "train"
    return collate(data[split], key, device, cap, context_loss)


if __name__ == "__main__":
    run(main)
