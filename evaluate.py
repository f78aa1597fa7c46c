"""Evaluate a nanogen checkpoint: perplexity, the non-termination study, the temperature report,
and, for story checkpoints, NLL, BLEU and keyword inclusion.

    python evaluate.py --ckpt out/wikitext2-lstm-nmst/ckpt_best.pt --split valid --out res.json
    python evaluate.py --ckpt ... --decoder greedy --L 10 100 1000 --plot figs/ --out greedy.json
    python evaluate.py --compare va.json st.json nmst.json --plot figs/   # overlay r_nt(L) curves

Perplexity: NMST paper section 4 (tasks.CompletionTask.evaluate).  The study (--decoder) continues
every context once up to max(--L) tokens: r_nt(L) (NMST eq. 11) and its curve, lengths (Fig. 8),
unique non-terminated continuations, examples, p(eos) along true continuations (Fig. 3).
"""
import json
import math
import os
import sys
import time

import torch

import cli
from cli import UserError
from checkpoint import check_run
from checkpoint import load as load_checkpoint
from data.loader import bptt_windows
from decode import (DECODERS, STORY_DECODERS, check_decoder_args, decode, decode_in_batches,
                    decode_stats, eos_probs, longest_continuation, sampling_generator)
from heads import TERMINATION_HEADS, paper_name
from model import eval_mode
from tasks import STORY_DATASETS, checkpoint_task, model_from_checkpoint


def build_parser():
    p = cli.CLIParser(description="Evaluate a nanogen checkpoint (perplexity, non-termination "
                                  "study, BLEU).")
    p.add_argument("--ckpt", default=None, help="checkpoint written by train.py (ckpt_best.pt / "
                                                "ckpt_last.pt); required unless --compare")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    p.add_argument("--data_dir", default=None, help="local dataset folder (default: the "
                   "run's --data_dir while it is there, else $NANOGEN_DATA, else download)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto)")
    p.add_argument("--batch_size", type=cli.in_range(int, "--batch_size", ">=1"), default=None,
                   help="sequences per batch")
    p.add_argument("--max_tokens", type=cli.in_range(int, "--max_tokens", ">=1"), default=None,
                   help="padded tokens per batch (GPT)")
    p.add_argument("--limit", type=cli.in_range(int, "--limit", ">=1"), default=None,
                   help="evaluate only the first N sequences (stream: N tokens of each column)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no_ppl", action="store_true", help="skip the perplexity pass")
    d = p.add_argument_group("non-termination study (decode.py)")
    d.add_argument("--decoder", default=None, choices=DECODERS, help="decode every context")
    d.add_argument("--L", type=cli.in_range(int, "--L", "L"), nargs="+", default=[10, 100, 1000],
                   help="r_nt(L) thresholds; decodes run to max(L) (default 10 100 1000)")
    cli.add_decoding_flags(d)
    d.add_argument("--seed", type=cli.in_range(int, "--seed", "seed"), default=0,
                   help="sampling seed")
    d.add_argument("--decode_batch", type=cli.in_range(int, "--decode_batch", ">=1"), default=64,
                   help="prompts decoded together")
    d.add_argument("--examples", type=cli.in_range(int, "--examples", ">=0"), default=3,
                   help="examples of each kind to keep")
    d.add_argument("--traces", type=cli.in_range(int, "--traces", ">=0"), default=5,
                   help="sequences with p(eos) traces (Fig. 3)")
    d.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures into DIR")
    p.add_argument("--tau_report", action="store_true", help="ct / ctmos: temperature by position "
                   "and the highest / lowest temperature words (CT paper Fig. 1, Tables 5-6)")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="no evaluation: overlay the studies in these --out files (with --plot)")
    return p


def given(args, flag):
    """Set to other than its default: how the rules below tell that a flag was asked for."""
    return getattr(args, flag) != DEFAULTS[flag]


DEFAULTS = vars(build_parser().parse_args([]))
STUDY_OPTIONS = ("L", "k", "p", "beam_size", "temperature", "consistent", "length_penalty",
                 "decode_batch", "examples", "traces")
RULES = [  # (broken(args), message): the rules between flags (each flag checks its own range)
    (lambda a: not a.compare and not a.ckpt, "the following arguments are required: --ckpt (or "
     "--compare JSON ...) (see evaluate.py --help)"),  # (as argparse says it)
    (lambda a: a.compare and any(given(a, k) for k in DEFAULTS if k not in ("compare", "plot")),
     "--compare overlays studies already written (--out files) and evaluates nothing: it takes "
     "only --plot"),
    (lambda a: not a.decoder and any(given(a, k) for k in STUDY_OPTIONS),
     " / ".join("--" + k for k in STUDY_OPTIONS) + " are options of a --decoder (the decoding "
     "study): give one"),
    (lambda a: a.plot and not (a.decoder or a.tau_report or a.compare), "--plot draws the figures "
     "of --decoder, --tau_report or --compare: give one of them"),
    (lambda a: a.no_ppl and not (a.decoder or a.tau_report), "--no_ppl skips the perplexity: with "
     "no --decoder or --tau_report there is nothing left to do"),
    (lambda a: a.no_ppl and (a.batch_size or a.max_tokens), "--batch_size / --max_tokens batch "
     "the perplexity pass, which --no_ppl skips (a --decoder batches by --decode_batch): drop "
     "them"),
]
TEXT_RULES = [  # a left-to-right text checkpoint's (STORY_RULES: a story checkpoint's)
    (lambda a: given(a, "seed") and not a.decoder, "--seed seeds a --decoder (and a story "
     "checkpoint's insertion orders); nothing else here is random: drop it or give a --decoder"),
]


def check_args(args):
    cli.check_rules(RULES, args)
    if args.decoder:
        check_decoder_args(args.decoder, args.k, args.p, args.beam_size, args.temperature,
                           min(args.L), args.consistent, args.length_penalty)
    inputs = [args.ckpt, *(args.compare or [])]
    cli.check_output(args.out, "--out", inputs=inputs)
    cli.check_output(args.plot, "--plot", folder=True, inputs=inputs)


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.compare:
        return compare(args)
    device = cli.setup_device(cli.resolve_device(args.device))  # as train.py's
    ckpt = check_run(load_checkpoint(args.ckpt), args.ckpt)
    t0 = time.time()
    story = ckpt["args"]["dataset"] in STORY_DATASETS
    res = (evaluate_stories if story else evaluate_completion)(args, ckpt, device)
    res["seconds"] = round(time.time() - t0, 2)
    if args.out:
        cli.write_json(args.out, res)
    return 0


def load_for(args, ckpt, device):
    """The checkpoint's task (its data, checked to be the data it was made from) and model."""
    sizes = {k: getattr(args, k) for k in ("batch_size", "max_tokens") if getattr(args, k)}
    task = checkpoint_task(ckpt, args.data_dir, (args.split,), args.ckpt, sizes)
    return task, model_from_checkpoint(ckpt, args.ckpt).to(device)


def describe(ckpt, args):
    cfg = ckpt["config"]
    return dict(ckpt=os.path.abspath(args.ckpt), split=args.split,
                dataset=ckpt["args"]["dataset"], model=cfg["model"], head=cfg.get("head"),
                epsilon=cfg.get("epsilon"), step=ckpt["train_state"]["step"],
                task=ckpt["args"].get("task") or "completion")


# --------------------------------------------------------------------------------------------
# perplexity, the decoding study and the temperature report
# --------------------------------------------------------------------------------------------
def evaluate_completion(args, ckpt, device):
    cli.check_rules(TEXT_RULES, args)
    task, lm = load_for(args, ckpt, device)
    res = describe(ckpt, args)
    split = task.decodable_split(args.split) if args.decoder else None  # refused before any pass
    if args.tau_report:
        check_tau(ckpt)
        data = task.columns(args.split, args.limit)  # --limit: as the stream perplexity
        spans = sentence_spans(data, task.eos_id)  # none: refused before any pass
    if not args.no_ppl:
        res.update(task.evaluate(lm, device, split=args.split, limit=args.limit,
                                 desc=f"perplexity ({args.split})"))
        print(task.report(res, args.split))
    if args.decoder:
        study = decoding_study(lm, split, args, task.tokenizer().decode, device)
        study.update(decoder=args.decoder, k=args.k, p=args.p, beam_size=args.beam_size,
                     temperature=args.temperature, consistent=args.consistent,
                     length_penalty=args.length_penalty, seed=args.seed)
        res["decoding"] = study
        res["eos_traces"] = eos_traces(lm, split, args.traces)
        print_study_table([res])
        for ex in study["examples"]:
            tag = "terminated" if ex["terminated"] else "NOT terminated"
            print(f"\n[{tag}] context: {ex['context']}\n  continuation: {ex['continuation'][:400]}")
        if args.plot:
            plot_study([res], args.plot)
    if args.tau_report:
        res["tau_report"] = tau_job(args, ckpt, task, lm, device, data, spans)
    return res


def eos_traces(lm, split, n):
    """p(eos | y_<t, x) at every continuation step t of the first n sequences (paper Fig. 3)
    that fit the model's window (GPT, GCNN; as in perplexity, longer ones are left out)."""
    out = []
    for i in range(len(split)):
        if len(out) == n:
            break
        c, seq = int(split.contexts[i]), split[i].tolist()
        cap = longest_continuation(lm, c)
        if cap is None or len(seq) - c <= cap:
            out.append(dict(index=i, tokens=seq[c:], p_eos=eos_probs(lm, seq[:c], seq[c:])))
    return out


def decoding_study(lm, split, args, detok, device):
    """Decode every context once up to max(L); r_nt(L), lengths, uniqueness, examples."""
    n = len(split) if args.limit is None else min(args.limit, len(split))
    if n == 0:
        raise UserError(f"the {args.split} split holds no sequence: no context to decode")
    result = decode_in_batches(
        lm, [torch.as_tensor(split.context(i)) for i in range(n)], max(args.L), args.decoder,
        args.decode_batch, desc=f"decoding ({args.decoder})", k=args.k, p=args.p,
        beam_size=args.beam_size, temperature=args.temperature, consistent=args.consistent,
        generator=sampling_generator(device, args.seed), length_penalty=args.length_penalty)
    stats = decode_stats(result, args.L)
    grid = torch.logspace(0, math.log10(max(args.L)), 60).tolist()
    curve_L = sorted(set(int(round(x)) for x in grid))
    stats["r_nt_curve"] = decode_stats(result, curve_L)["r_nt"]
    stats["generated_lengths"] = [n_ if done else None for n_, done in
                                  zip(result["lengths"].tolist(), result["terminated"].tolist())]
    stats["ground_truth_lengths"] = (split.lengths[:n] - split.contexts[:n]).tolist()
    stats["examples"] = study_examples(split, result, args.examples, detok)
    return stats


def study_examples(split, result, k, detok):
    """Up to k terminated and k non-terminated continuations, with context and ground truth."""
    examples, seen = [], {True: 0, False: 0}
    for i, toks in enumerate(result["tokens"]):
        done = bool(result["terminated"][i])
        if seen[done] < k:
            seen[done] += 1
            c = int(split.contexts[i])
            examples.append(dict(index=i, terminated=done, context=detok(split[i][:c].tolist()),
                                 continuation=detok(toks[:200]) + (" ..." if len(toks) > 200
                                                                   else ""),
                                 ground_truth=detok(split[i][c:].tolist()[:200])))
    return examples


def check_tau(ckpt):
    if ckpt["config"].get("head") not in ("ct", "ctmos"):
        raise UserError(f"--tau_report needs a contextual-temperature head (ct / ctmos), not "
                        f"{ckpt['config'].get('head')}")
    if ckpt["config"]["model"] not in ("rnn", "lstm"):
        raise UserError("--tau_report reads the text as a stream: use an rnn / lstm checkpoint")
    tokens = ckpt.get("data", {}).get("tokenizer", "word")
    if tokens != "word":
        raise UserError(f"--tau_report is the CT paper's word-level analysis (sentences of 16-24 "
                        f"words): this checkpoint reads {tokens} tokens")


def tau_job(args, ckpt, task, lm, device, data, spans):
    from recipes import build_parser
    bptt = ckpt["args"].get("bptt") or build_parser().get_default("bptt")
    rep = tau_report(lm, data, bptt, spans, task.tokenizer().decode, device)
    print(f"temperature of the next word by position ({rep['sentences']} sentences of 16-24 "
          f"words):")
    for name, m_, c in zip(rep["positions"], rep["position_mean"], rep["position_ci95"]):
        print(f"  {name:8s} {m_:.6f} +- {c:.6f}")
    print("highest mean tau:", ", ".join(f"{w} {t:.6f}" for w, t in rep["highest"]))
    print("lowest mean tau: ", ", ".join(f"{w} {t:.6f}" for w, t in rep["lowest"]))
    if args.plot:
        plot_tau(rep, os.path.join(args.plot, "tau_by_position.png"))
    return rep


@torch.no_grad()
def tau_report(lm, data, bptt, spans, detok, device="cpu", top=10):
    """The contextual temperature along the text (CT paper Fig. 1, Tables 5-6).  The model reads
    the batchified stream (bsz, N) as in evaluation; at every position we keep tau of the word
    that actually comes next, and the mean tau of every vocabulary entry.  Sentences (lines)
    of 16-24 words are 'normalised' to their first 5, middle 5 and last 5 words, as in the
    paper, and the mean and 95% interval of tau at each of those 15 positions is reported."""
    V = lm.cfg["vocab_size"]
    tau_next = torch.zeros(data.size(0), data.size(1) - 1, dtype=torch.float64)
    tau_sum, n_pos, state = torch.zeros(V, dtype=torch.float64), 0, None
    with eval_mode(lm):
        for i, L in bptt_windows(data.size(1), bptt):
            x, y = data[:, i:i + L].to(device), data[:, i + 1:i + 1 + L].to(device)
            h, state = lm.backbone(x, state)
            tau = lm.head.temperatures(h).double()  # (bsz, L, V)
            tau_next[:, i:i + L] = tau.gather(-1, y.unsqueeze(-1)).squeeze(-1).cpu()
            tau_sum += tau.sum((0, 1)).cpu()
            n_pos += y.numel()
    table = normalised_sentences(spans, tau_next)  # (sentences, 15)
    mean, half = table.mean(0), 1.96 * table.std(0) / math.sqrt(len(table))
    tau_mean = tau_sum / n_pos
    order = torch.argsort(tau_mean, descending=True)
    return dict(sentences=len(table), position_mean=mean.tolist(), position_ci95=half.tolist(),
                positions=[f"{part}-{i + 1}" for part in ("first", "mid", "last")
                           for i in range(5)],
                highest=[(detok([int(v)]), tau_mean[v].item()) for v in order[:top]],
                lowest=[(detok([int(v)]), tau_mean[v].item()) for v in order[-top:].flip(0)])


def sentence_spans(data, eos_id):
    """(column, start, end) of every 16-24-word sentence of the batchified stream data (bsz, N),
    as positions of next words: a sentence starts after an eos (each column's first, cut one is
    skipped)."""
    spans = []
    for b in range(data.size(0)):
        start = None
        for j, tok in enumerate(data[b, 1:].tolist()):
            if tok == eos_id:
                if start is not None and 15 < j - start < 25:
                    spans.append((b, start, j))
                start = j + 1
    if not spans:
        raise UserError("no sentence of 16-24 words in this split (or within --limit): the "
                        "temperature report needs some")
    return spans


def normalised_sentences(spans, tau_next):
    """tau of the first 5, middle 5 and last 5 words of every sentence span."""
    rows = []
    for b, start, end in spans:
        words = tau_next[b, start:end]
        mid = (len(words) - 5) // 2
        rows.append(torch.cat([words[:5], words[mid:mid + 5], words[-5:]]))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------
# stories: NLL, generation, BLEU, keyword inclusion (InsNet paper section 5)
# --------------------------------------------------------------------------------------------
def evaluate_stories(args, ckpt, device):
    """A story checkpoint: the NLL of the split and, with --decoder greedy / sample / topk,
    generated stories scored with BLEU-1..4 against the references (and keyword inclusion for
    --task storyline)."""
    cli.check_rules(STORY_RULES, args)
    if args.decoder:
        check_decoder_args(args.decoder, args.k, args.p, args.beam_size, args.temperature,
                           min(args.L), allowed=STORY_DECODERS)
    task, model = load_for(args, ckpt, device)
    if args.decoder and task.data.stories is None:
        raise UserError("generation is scored against ROCStories references: use a rocstories "
                        "checkpoint")
    res = dict(describe(ckpt, args), order=task.order, data_note=task.note)
    name = res["model"] + ("-l2r" if task.order == "l2r" else "")
    if not args.no_ppl:
        res.update(task.evaluate(model, device, split=args.split, limit=args.limit,
                                 seed=args.seed, desc=f"NLL ({args.split})"))
        bound = f"; -log p(story) <= {res['nll_bound_per_story']:.2f} (mean over orders - log " \
                f"n!)" if task.order == "random" and res["model"] != "gpt" else ""
        print(f"{res['dataset']} {args.split} {name}: {res['stories']} stories, NLL "
              f"{res['nll_per_story']:.2f} per story, {res['nll_per_event']:.4f} per event "
              f"(ppl {res['ppl']:.2f}){bound}")
    if args.decoder:
        gen = story_generation(model, task, args, device)
        res["generation"] = dict(gen, decoder=args.decoder, k=args.k, temperature=args.temperature)
        b = gen["bleu"]
        kw = gen["keyword_inclusion"]
        print(f"generation ({args.decoder}): BLEU-1/2/3/4 {b[1]:.2f} / {b[2]:.2f} / {b[3]:.2f} / "
              f"{b[4]:.2f}, mean length {gen['mean_length']:.1f}"
              + (f", storyline keywords included {100 * kw:.2f}%" if kw is not None else ""))
        for ex in gen["examples"]:
            print(f"  [{ex['title']} | {ex['storyline']}] {ex['generated']}\n"
                  f"    reference: {ex['reference']}")
    return res


STORY_RULES = [(lambda a, flag=flag: given(a, flag),
                 f"--{flag} is for left-to-right text checkpoints; a story checkpoint reports its "
                 f"NLL and, with --decoder, the BLEU of stories generated one by one up to twice "
                 f"their reference story's length + 10 words (within the model's window)")
               for flag in ("tau_report", "plot", "consistent", "L", "traces", "decode_batch")]


def bleu(hypotheses, references, max_n=4):
    """Corpus BLEU-max_n (Papineni et al. 2002), one reference per hypothesis, no smoothing, in
    percent: BP * exp(mean_{n<=max_n} log p_n), p_n the clipped n-gram precision summed over
    the corpus, BP = exp(1 - r/c) when the hypotheses are shorter in total (c < r); 0 when some
    p_n = 0.  It equals sacrebleu's corpus_bleu with tokenize="none", smooth_method="none"
    (tests), and nltk's corpus_bleu when every hypothesis has at least max_n tokens."""
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
def story_generation(model, task, args, device):
    """Generate a story for each (title[, storyline]) of the split and score it against the
    reference story: BLEU-1..4 and, for --task storyline, the share of storyline keywords found
    in the story in order (InsNet: 100% by construction, the keywords are given canvas tokens).
    -> dict(bleu: {1..4}, keyword_inclusion, mean_length, stories, examples)."""
    stories = task.data.stories[args.split][:args.limit]
    seqs = task.data.splits[args.split][:args.limit]
    g = sampling_generator(device, args.seed)
    hyps, refs, included, total, shown = [], [], 0, 0, []
    storyline = task.variant == "storyline"
    for story, seq in zip(stories, seqs):
        words = generate_story(model, task, story, seq, args, g, device)
        hyps.append(words)
        refs.append(story["story"])
        if storyline:
            total += len(story["keywords"])
            included += in_order(words, story["keywords"])
        if len(shown) < args.examples:
            shown.append(dict(title=" ".join(story["title"]), storyline=" ".join(story["keywords"]),
                              generated=" ".join(words), reference=" ".join(story["story"])))
    return dict(bleu={n: bleu(hyps, refs, n) for n in range(1, 5)},
                keyword_inclusion=(included / total) if total else None,
                mean_length=sum(map(len, hyps)) / max(len(hyps), 1), stories=len(hyps),
                examples=shown)


def generate_story(model, task, story, seq, args, g, device):
    """One story's words: L2R continues the given prefix; an insertion model fills the canvas
    BOS title SEP [keywords] EOS (a given keyword keeps its word even when it is <unk>).  Either
    writes at most twice the reference story's words + 10, within the window of a model that
    has one."""
    from data.stories import BOS, EOS, PAD, SEP
    from insnet import generate
    vocab, banned = task.data.vocab, (PAD, BOS, EOS, SEP)
    prefix = seq["tokens"][:seq["n_given"]]
    cap = 2 * len(story["story"]) + 10  # story words, the same for every model
    if task.kind == "gpt":
        cap = min(cap, longest_continuation(model, len(prefix)))
        out = decode(model, [torch.tensor(prefix, device=device)], cap, decoder=args.decoder,
                     k=args.k, temperature=args.temperature, generator=g)["tokens"][0]
        return [vocab[t] for t in out if t not in banned]
    kw = seq["keywords"] if task.variant == "storyline" else []  # constrained: given tokens
    canvas = len(prefix) + cap + 1  # the prefix, at most cap story words, EOS
    out = generate(model, [*prefix, *kw, EOS], min(canvas, model.max_canvas() or canvas),
                   decoder=args.decoder, k=args.k, temperature=args.temperature,
                   slot_start=len(prefix) - 1, banned=banned, generator=g)
    kw_words = iter(story["keywords"])
    return [next(kw_words) if given else vocab[t] for t, given in
            zip(out["tokens"][len(prefix):-1], out["given"][len(prefix):-1])]


def in_order(words, keywords):
    """How many keywords occur in `words` as a subsequence, matched greedily left to right."""
    found, start = 0, 0
    for k in keywords:
        if k in words[start:]:
            start = words.index(k, start) + 1
            found += 1
    return found


# --------------------------------------------------------------------------------------------
# tables and figures
# --------------------------------------------------------------------------------------------
def compare(args):
    """--compare: the studies of earlier --out files side by side (and overlaid with --plot)."""
    results = []
    for path in args.compare:
        try:
            with open(path) as f:
                r = json.load(f)
        except OSError as e:
            raise UserError(f"--compare: cannot read {path}: {e.strerror or e}") from None
        except ValueError:  # not JSON (a checkpoint, say)
            r = None
        if not isinstance(r, dict) or not isinstance(r.get("decoding"), dict) or \
                "r_nt_curve" not in r["decoding"]:
            raise UserError(f"--compare: {path} is not an evaluate.py --decoder study (not JSON, "
                            f"or no 'decoding' section); write one with --decoder ... --out")
        problem = study_problem(r)
        if problem:
            raise UserError(f"--compare: {path} is a damaged study ({problem}); write it again "
                            f"with evaluate.py --decoder ... --out")
        results.append(r)
    print_study_table(results)
    if args.plot:
        plot_study(results, args.plot, args.compare)
    return 0


NUMBER, TEXT, OPTIONAL = (int, float), (str,), (int, float, type(None))  # null: NaN in JSON
STUDY = dict(model=TEXT, dataset=TEXT, head=TEXT, epsilon=NUMBER)
DECODING = dict(decoder=TEXT, r_nt=dict, r_nt_curve=dict, mean_length=NUMBER, n=int,
                unique_non_terminated=OPTIONAL, generated_lengths=list,
                ground_truth_lengths=list)


def study_problem(r):
    """-> what a study JSON lacks for the table and the figures, or None."""
    for part, spec in ((r, STUDY), (r["decoding"], DECODING)):
        for key, kinds in spec.items():
            if not isinstance(part.get(key), kinds):
                return f"'{key}' is missing or of the wrong kind"
    d = r["decoding"]
    for key in ("r_nt", "r_nt_curve"):
        if not d[key] or not all(str(k).isdigit() and isinstance(v, NUMBER)
                                 for k, v in d[key].items()):
            return f"'{key}' is not a table of L -> ratio"
    if not all(isinstance(n, int) for n in d["ground_truth_lengths"]) or \
            not all(n is None or isinstance(n, int) for n in d["generated_lengths"]):
        return "the lengths are not integers"
    traces = r.get("eos_traces") or []
    if not isinstance(traces, list) or not all(
            isinstance(t, dict) and isinstance(t.get("index"), int) and
            isinstance(t.get("p_eos"), list) and all(isinstance(p, NUMBER) for p in t["p_eos"])
            for t in traces):
        return "'eos_traces' is malformed"
    return None


def run_label(r, varying):
    """What tells run r apart from the others: the fields that vary among them."""
    d = r["decoding"]
    parts = {"head": paper_name(r["head"]) if r["head"] else r["model"],
             "epsilon": f"eps={r['epsilon']:g}" if r["head"] in TERMINATION_HEADS else "",
             "model": r["model"], "decoder": decoder_name(d), "dataset": r["dataset"]}
    return " ".join(parts[k] for k in ("head", "epsilon", "model", "decoder", "dataset")
                    if k in varying and parts[k]) or parts["head"]


def decoder_name(d):
    extra = {"topk": f"-{d.get('k')}", "nucleus": f"-{d.get('p')}",
             "beam": f"-{d.get('beam_size')}"}.get(d["decoder"], "")
    T = d.get("temperature")
    return d["decoder"] + extra + ("+c" if d.get("consistent") else "") + \
        (f"/lp{d['length_penalty']:g}" if d.get("length_penalty") else "") + \
        (f"/T{T:g}" if isinstance(T, NUMBER) and T != 1 else "")


def print_study_table(results):
    """One row per decoding study: r_nt(L) for every L, mean length, unique non-terminated."""
    rows = [r for r in results if "decoding" in r]
    if not rows:
        return
    Ls = sorted({int(L) for r in rows for L in r["decoding"]["r_nt"]})
    print(f"{'model':5s} {'head':8s} {'eps':>7s} {'decoder':12s} "
          + " ".join(f"{'r_nt(%d)' % L:>11s}" for L in Ls)
          + f" {'mean len':>9s} {'uniq non-term':>13s} {'n':>6s}")
    for r in rows:
        d = r["decoding"]
        r_nt = {int(L): v for L, v in d["r_nt"].items()}
        eps = f"{r['epsilon']:.0e}" if r["head"] in TERMINATION_HEADS else "-"  # (eq. 9, 10)
        print(f"{r['model']:5s} {r['head']:8s} {eps:>7s} {decoder_name(d):12s} "
              + " ".join(f"{r_nt.get(L, float('nan')):11.4f}" for L in Ls)
              + f" {d['mean_length']:9.1f} {none_nan(d['unique_non_terminated']):13.3f} "
                f"{d['n']:6d}")


def none_nan(x):
    """JSON writes NaN as null (strict JSON): read back as NaN."""
    return float("nan") if x is None else x


def plot_study(results, out_dir, files=None):
    """PNGs: r_nt(L) (log-log, Fig. 2 / 7), length histograms (Fig. 8), p(eos) traces (Fig. 3).
    Runs get distinct colours and labels naming what differs between them (head, epsilon,
    model, decoder, dataset; else their --compare files); the title names what they share."""
    plt = cli.pyplot()
    if plt is None:
        return []
    keys = ("head", "epsilon", "model", "decoder", "dataset")
    values = {k: {decoder_name(r["decoding"]) if k == "decoder" else r.get(k) for r in results}
              for k in keys}
    varying = {k for k, v in values.items() if len(v) > 1}
    shared = ", ".join(str(next(iter(values[k]))) for k in ("decoder", "dataset", "model")
                       if k not in varying)
    styles = [(f"C{i}", ("-", "--", ":", "-.")[i % 4]) for i in range(len(results))]
    labels = [run_label(r, varying) for r in results]
    if len(set(labels)) < len(labels) and files:  # e.g. two checkpoints of one run
        labels = [f"{lab} ({os.path.basename(f)})" for lab, f in zip(labels, files)]
    with cli.file_set(out_dir, STUDY_FIGURES) as tmp:  # all of them, or none
        made = [plot_r_nt(plt, results, labels, styles, shared, tmp),
                plot_lengths(plt, results, labels, styles, tmp),
                plot_traces(plt, results, labels, styles, tmp)]
    written = [os.path.join(out_dir, os.path.basename(m)) for m in made if m]
    print(f"wrote {', '.join(written)}")
    return written


STUDY_FIGURES = ("r_nt.png", "lengths.png", "p_eos.png")


def plot_r_nt(plt, results, labels, styles, shared, out_dir):
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for r, label, (color, ls) in zip(results, labels, styles):
        curve = r["decoding"]["r_nt_curve"]
        ax.plot([int(L) for L in curve], [max(y, 1e-4) for y in curve.values()], ls, color=color,
                label=label)
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="r_nt(L)  (0 drawn at 1e-4)",
           title=f"non-termination ratio ({shared})" if shared else "non-termination ratio")
    return finish(fig, ax, os.path.join(out_dir, "r_nt.png"))


def plot_lengths(plt, results, labels, styles, out_dir):
    fig, ax = plt.subplots(figsize=(5.5, 4))
    cut_at = [max(int(L) for L in r["decoding"]["r_nt"]) for r in results]  # each study's max L
    Lmax = max(cut_at)
    bins = torch.linspace(0, Lmax + 1, 41).tolist()
    ax.hist([min(n, Lmax) for n in results[0]["decoding"]["ground_truth_lengths"]], bins=bins,
            alpha=0.4, color="gray", label="ground truth")
    for r, label, (color, _), L in zip(results, labels, styles, cut_at):
        gl = [L if n is None else n for n in r["decoding"]["generated_lengths"]]
        cut = sum(n is None for n in r["decoding"]["generated_lengths"])
        ax.hist(gl, bins=bins, histtype="step", color=color,
                label=f"{label} ({cut} non-terminated, drawn at L={L})" if cut else label)
    ax.set(xlabel="continuation length", ylabel="count", yscale="log",
           title="length distribution")
    return finish(fig, ax, os.path.join(out_dir, "lengths.png"))


def plot_traces(plt, results, labels, styles, out_dir):
    """p(eos) along the first (up to 3) traced sequences of the first run that has traces; each
    run draws its own trace of the same sequence (same split and index), where it has one."""
    traces = [{(r.get("split"), t["index"]): t["p_eos"] for t in r.get("eos_traces") or []}
              for r in results]
    shown = next((list(t)[:3] for t in traces if t), None)
    if shown is None:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 6), squeeze=False)
    for j, (ax, (split, index)) in enumerate(zip(axes[:, 0], shown)):
        for tr, label, (color, ls) in zip(traces, labels, styles):
            if (split, index) in tr:
                p_eos = tr[split, index]
                ax.plot(range(1, len(p_eos) + 1), p_eos, ls, color=color, label=label)
        ax.set(yscale="log", ylabel="p(eos)", xlabel="t" if j == len(shown) - 1 else None)
        ax.set_title(f"{split or 'validation'} sequence {index}", fontsize=8)
    return finish(fig, axes[0, 0], os.path.join(out_dir, "p_eos.png"))


def finish(fig, ax, path):
    """Legend (one entry per run, however many curves it drew), layout, the PNG written
    atomically; -> its path."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    cli.save_figure(fig, path)
    return path


def plot_tau(report, path):
    plt = cli.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(15)
    ax.errorbar(x, report["position_mean"], yerr=report["position_ci95"], fmt="o-", capsize=3)
    ax.set_xticks(list(x), report["positions"], rotation=60, fontsize=7)
    ax.set(ylabel="tau of the next word",
           title=f"contextual temperature by position ({report['sentences']} sentences)")
    cli.save_figure(fig, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
