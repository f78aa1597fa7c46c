"""Continue your own text with a trained checkpoint, and watch where (and why) it stops.

    python sample.py --ckpt out/ptb-lstm-nmst/ckpt_best.pt --prompt "the company said it"
    python sample.py --ckpt CKPT --prompt_file prompts.txt --decoder topk --k 4 --show_eos
    python sample.py --ckpt out/rocstories-storyline-insnet/ckpt_best.pt --title "the big game" \\
        --keywords team practiced won

Left-to-right checkpoints print each continuation and how it ended: [eos] when the model chose
eos, [length cap L] when it was cut at --L tokens (the continuation did not terminate).  With
--show_eos every generated token is printed with p(eos) at that step, the quantity the NMST
paper is about (VA, ST and NMST heads model it differently).  Insertion checkpoints (InsNet,
IT-vanilla) take a title (and storyline keywords; synthetic ones nothing) and print the given
canvas, then the canvas after every insertion, with p(terminate).  No data is read: the
checkpoint carries its vocabulary.  Word-level prompts must be in the model's vocabulary, written
as the data is (PTB is lower-cased; punctuation stands apart: "rose ," and "company 's");
--allow_unk reads unknown words as <unk>.  A char-level prompt is read as
whole words and the space after them, as every training context ends.
"""
import math
import pathlib
import re
import sys

import torch

import cli
from cli import UserError
from checkpoint import check_run
from checkpoint import load as load_checkpoint
from decode import (DECODERS, SAMPLING, STORY_DECODERS, check_decoder_args, decode,
                    decode_in_batches, eos_probs, sampling_generator)
from data.prepare import tokenizer_from
from tasks import INSERTION_MODELS, STORY_DATASETS, checkpoint_task, model_from_checkpoint


def build_parser():
    p = cli.CLIParser(description="Continue a prompt with a nanogen checkpoint.")
    p.add_argument("--ckpt", required=True, help="a checkpoint written by train.py")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    p.add_argument("--prompt_file", default=None, help="one prompt per line (-: standard input)")
    p.add_argument("--title", default=None, help="insertion / story checkpoints: the title")
    p.add_argument("--keywords", nargs="*", default=[], help="storyline checkpoints: keywords")
    p.add_argument("--decoder", default="greedy", choices=DECODERS)
    p.add_argument("--L", type=cli.in_range(int, "--L", "L"), default=100,
                   help="the length cap (tokens generated)")
    cli.add_decoding_flags(p)
    p.add_argument("--seed", type=cli.in_range(int, "--seed", "seed"), default=None,
                   help="sampling seed (default: a fresh one, printed so the run can be repeated)")
    p.add_argument("--show_eos", action="store_true", help="print p(eos) at every step")
    p.add_argument("--allow_unk", action="store_true", help="read unknown words as <unk>")
    p.add_argument("--data_dir", default=None, help="local dataset folder: the vocabulary of a "
                   "checkpoint older than the ones that carry it")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if any)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.keywords = " ".join(args.keywords).split()  # --keywords "team won" = --keywords team won
    prompts = read_prompts(args)
    ckpt = check_run(load_checkpoint(args.ckpt), args.ckpt)
    story = ckpt["args"]["dataset"] in STORY_DATASETS
    cli.check_rules(STORY_RULES if story else TEXT_RULES, args)  # refused, not silently ignored
    device = cli.setup_device(cli.resolve_device(args.device))
    model = model_from_checkpoint(ckpt, args.ckpt).to(device)
    if story:
        return sample_story(args, ckpt, model, device)
    if not prompts:
        raise UserError("give --prompt TEXT (or --prompt_file FILE, - for standard input) to "
                        "continue")
    check_decoder_args(args.decoder, args.k, args.p, args.beam_size, args.temperature, args.L,
                       args.consistent, args.length_penalty)
    tok = checkpoint_tokenizer(ckpt, args)
    ids = [encode_prompt(tok, text, args.allow_unk) for text in prompts]
    out = decode_in_batches(  # a --prompt_file of thousands: 64 prompts at a time
        model, [torch.tensor(x, device=device) for x in ids], args.L, args.decoder, 64,
        desc="sampling" if len(ids) > 64 else None, k=args.k, p=args.p,
        beam_size=args.beam_size, temperature=args.temperature, consistent=args.consistent,
        length_penalty=args.length_penalty, generator=sampling_generator(device, choose_seed(args)))
    for text, x, toks, done in zip(prompts, ids, out["tokens"], out["terminated"].tolist()):
        show(model, tok, text, x, toks, done, args)
    return 0


STORY_RULES = [(lambda a: a.prompt or a.prompt_file or a.show_eos or a.consistent, "--prompt / "
                 "--prompt_file / --show_eos / --consistent are for left-to-right text "
                 "checkpoints; a story checkpoint takes --title TEXT (and --keywords)")]
TEXT_RULES = [(lambda a: a.title or a.keywords, "--title / --keywords are for story checkpoints; "
               "this one continues --prompt TEXT")]


def checkpoint_tokenizer(ckpt, args):
    """The checkpoint's own vocabulary (no data needed); a checkpoint written before they carried
    one reads it from its prepared data."""
    vocabulary = ckpt.get("data", {}).get("vocabulary")
    if vocabulary:
        return tokenizer_from(vocabulary)
    return checkpoint_task(ckpt, args.data_dir, splits=(), path=args.ckpt).tokenizer()


def choose_seed(args):
    """--seed, or a fresh one for a sampling decoder, said so that the sample can be repeated
    (greedy and beam search draw nothing: seed 0)."""
    sampling = args.decoder in SAMPLING
    if args.seed is None:
        args.seed = int(torch.randint(0, 2 ** 31, ()).item()) if sampling else 0
        if sampling:
            print(f"seed {args.seed} (pass --seed {args.seed} to repeat this sample)",
                  file=sys.stderr)
    torch.manual_seed(args.seed)
    return args.seed


def read_prompts(args):
    prompts = list(args.prompt)
    if args.prompt_file:
        try:  # -: standard input (`... | python sample.py --prompt_file -`); a BOM is not text
            text = sys.stdin.read() if args.prompt_file == "-" else \
                pathlib.Path(args.prompt_file).read_text(encoding="utf-8")
            prompts += [ln for ln in text.lstrip("\ufeff").split("\n") if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompt_file {args.prompt_file}: {e}") from None
    if args.prompt_file and len(prompts) == len(args.prompt):
        raise UserError(f"--prompt_file {args.prompt_file} holds no prompt (no line with text)")
    if any(not p.strip() for p in prompts):
        raise UserError("an empty --prompt: give some text to continue")
    return prompts


def encode_prompt(tok, text, allow_unk):
    """Prompt text -> token ids (char level: its words and a space, a context as in training);
    word / char level: unknown pieces are an error naming them (or <unk> with --allow_unk)."""
    if tok.kind == "gpt2":
        return tok.enc.encode_ordinary(text.strip())
    pieces = tok.split(text)
    if tok.kind == "char":  # whole words and the space after them, as every training context
        pieces.append(" ")
    control = sorted({w for w in pieces if w in ("<eos>", "<unk>")} if tok.kind == "word" else ())
    if control:
        raise UserError(f"{', '.join(control)} in the prompt is a control token, not text: leave "
                        f"it out (the model decides where the text ends)")
    unknown = sorted({w for w in pieces if w not in tok.stoi})
    if unknown and (not allow_unk or tok.unk is None):
        raise not_in_vocabulary(unknown, tok.stoi, has_unk=tok.unk is not None)
    if unknown:
        print(f"note: read as <unk>: {', '.join(unknown)}", file=sys.stderr)
    return [tok.stoi.get(w, tok.unk) for w in pieces]


def not_in_vocabulary(unknown, stoi, has_unk=True):
    """The error naming unknown words, with what they miss of the data's writing: its lower case,
    and punctuation and 's standing apart ('rose ,' and "company 's" in WikiText, 'dog !' in
    ROCStories)."""
    hint = "; the data is lower-cased" if any(w.lower() in stoi for w in unknown) else ""
    for w in unknown:
        pieces = re.findall(r"'\w+|\w+|[^\w\s]", w)
        if len(pieces) > 1 and all(p in stoi or p.lower() in stoi for p in pieces):
            hint += f"; its punctuation stands apart, as in {' '.join(pieces)!r} for {w!r}"
            break
    fix = " (or --allow_unk to read them as <unk>)" if has_unk else ""
    return UserError(f"not in the model's vocabulary: {', '.join(map(repr, unknown[:12]))}{hint}"
                     f"{fix}")


def show(model, tok, text, prompt_ids, toks, terminated, args):
    ended = "[eos]" if terminated else f"[length cap {args.L}: not terminated]"
    body = [t for t in toks if t != model.eos_id]
    shown = (text, ">>>", tok.decode(body).strip(), ended)  # (an empty continuation: no gap)
    print(" ".join(part for part in shown if part) + why(model, toks, terminated, args))
    if args.show_eos:
        for t, (token, p_eos) in enumerate(zip(toks, eos_probs(model, prompt_ids, toks)),
                                           start=1):
            print(f"    t={t:4d}  p(eos)={p_eos:.4f}  {tok.decode([token])!r}")


def why(model, toks, terminated, args):
    """What the user may wonder about: an ST / NMST continuation cut before its guaranteed end
    (p(eos) >= 1 - (1 - eps)^t passes 1/2 at t = ln 2 / eps, NMST paper Theorem 3), and a beam
    search whose best finished hypothesis is eos alone."""
    head, eps = model.cfg.get("head"), model.cfg.get("epsilon")
    if not terminated and head in ("st", "nmst"):
        bound = math.log(2) / -math.log1p(-eps)
        if bound > args.L:
            return (f"  (the {head.upper()} head's p(eos) passes 1/2 by t = ln 2 / eps = "
                    f"{bound:,.0f} at the latest; --L {args.L} cut it before that)")
    if terminated and toks == [model.eos_id] and args.decoder == "beam":
        return "  (beam search: eos alone was the best-scoring finished hypothesis)"
    return ""


def sample_story(args, ckpt, model, device):
    """A story checkpoint: L2R continues "title [storyline]"; an insertion model fills the
    canvas, printed as given and after every insertion.  No data is read: the checkpoint
    carries its vocabulary (synthetic: w0, w1, ...)."""
    from data.stories import BOS, EOS, PAD, SEP, synthetic_vocab
    synthetic = ckpt["args"]["dataset"] == "synthetic"  # InsNet's benchmark: from <bos> alone
    if synthetic and (args.title or args.keywords):
        raise UserError("a synthetic checkpoint generates from <bos> alone: drop --title / "
                        "--keywords")
    if not synthetic and not (args.title or "").strip():
        raise UserError("story checkpoints take --title TEXT (and --keywords for storyline runs)")
    check_decoder_args(args.decoder, args.k, args.p, args.beam_size, args.temperature, args.L,
                       length_penalty=args.length_penalty, allowed=STORY_DECODERS)
    vocab = synthetic_vocab() if synthetic else ckpt["data"].get("vocab") or \
        checkpoint_task(ckpt, args.data_dir, splits=(), path=args.ckpt).data.vocab  # (older)
    kind, variant = ckpt["config"]["model"], ckpt["args"]["task"]
    l2r = kind not in INSERTION_MODELS
    if l2r and bool(args.keywords) != (variant == "storyline"):  # its training prefix
        raise UserError("this L2R checkpoint continues a title and its storyline: give --keywords"
                        if not args.keywords else "this L2R checkpoint continues a title alone "
                        "(--task story): drop --keywords")
    prefix, kws = ([BOS], []) if synthetic else story_prefix(vocab, args, variant, kind)
    if l2r:
        out = decode(model, [torch.tensor(prefix, device=device)], args.L, args.decoder, k=args.k,
                     temperature=args.temperature,
                     generator=sampling_generator(device, choose_seed(args)))
        story = [vocab[t] for t in out["tokens"][0] if t not in (PAD, BOS, EOS, SEP)]
        ended = "[eos]" if bool(out["terminated"][0]) else f"[length cap {args.L}]"
        print(f"{args.title or ''} >>> {' '.join(story)} {ended}".strip())
        return 0
    return insertion_trace(args, model, vocab, prefix, kws, (PAD, BOS, EOS, SEP), device)


def story_prefix(vocab, args, variant, kind):
    """--title and --keywords (lower-cased, like the data) -> the prefix the checkpoint was
    trained to continue, as data.stories.encode_story makes it, and the keywords' ids."""
    from data.stories import SPECIALS, encode_story
    stoi = {w: i for i, w in enumerate(vocab)}
    title, keywords = args.title.lower().split(), [k.lower() for k in args.keywords]
    words = title + keywords
    control = sorted({w for w in words if w in SPECIALS})
    if control:
        raise UserError(f"{', '.join(control)}: a control token, not a word: leave it out of "
                        f"--title / --keywords")
    unknown = [w for w in words if w not in stoi]
    if unknown and not args.allow_unk:
        raise not_in_vocabulary(unknown, stoi)
    enc = encode_story(dict(title=title, keywords=keywords, story=[]), stoi, variant, kind)
    return enc["tokens"][:enc["n_given"]], enc["keywords"]


def insertion_trace(args, model, vocab, prefix, kws, banned, device):
    from insnet import generate
    from data.stories import EOS
    trace, given = [], len(prefix) + len(kws) + 1
    if model.max_canvas() and given + args.L > model.max_canvas():  # IT-vanilla's positions
        room = model.max_canvas() - given
        raise UserError(f"a canvas of {given} given tokens + L={args.L} exceeds the "
                        f"{model.max_canvas()} positions of the model: " +
                        (f"use --L {room} or less" if room >= 1 else
                         "use a shorter --title or fewer --keywords"))
    out = generate(model, [*prefix, *kws, EOS], given + args.L,
                   decoder=args.decoder, k=args.k, temperature=args.temperature,
                   slot_start=len(prefix) - 1, banned=banned, trace=trace,
                   generator=sampling_generator(device, choose_seed(args)))
    for step, (canvas, p_end) in enumerate(trace):  # step 0: the given canvas
        print(f"{step:3d}  p(terminate)={p_end:.3f}  {' '.join(vocab[t] for t in canvas[1:-1])}")
    ended = "terminated" if out["terminated"] else f"length cap {args.L}"
    print(f"[{ended} after {out['inserted']} insertion{'' if out['inserted'] == 1 else 's'}]")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
