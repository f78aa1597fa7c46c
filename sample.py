"""Continue your own text with a trained checkpoint, and watch where (and why) it stops.

    python sample.py --ckpt out/ptb-lstm-nmst/ckpt_best.pt --prompt "the company said it"
    python sample.py --ckpt STORYLINE_CKPT --title "the big game" --keywords team practiced won

A continuation ends in [eos] when the model chose eos, or is cut at --L tokens; --show_eos
prints p(eos) at every step.  Insertion checkpoints print the canvas after every insertion, with
p(terminate).  The checkpoint carries its vocabulary.  Word-level prompts are written as the data
is (PTB: lower case; "rose ," and "company 's"); --allow_unk reads unknown words as <unk>.
"""

import math
import sys

import torch

from common import Parser, UserError, get_device, load_checkpoint, number, run
from data.prepare import check_known, encode_prompt, tokenizer
from data.stories import BOS, EOS, PAD, SEP, SPECIALS, encode_story
from decode import (
    DECODERS,
    SAMPLING,
    STORY_DECODERS,
    add_decoding_flags,
    check_decoder_args,
    decode,
    decode_in_batches,
    decoder_options,
    eos_probs,
    sampling_generator,
)
from evaluate import model_from_checkpoint
from insnet import INSERTION, Decoding, generate

# --L: tokens generated (insertions), at most a million as in evaluate.py.
LENGTH = number(int, lambda v: 1 <= v <= 10**6, "in [1, 10^6]")


def parser():
    p = Parser(description="Continue a prompt with a nanogen checkpoint.")
    p.add_argument("--ckpt", required=True, help="a checkpoint of train.py")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    p.add_argument("--prompt_file", help="one prompt a line (-: standard input)")
    p.add_argument("--title", help="story checkpoints: the title")
    p.add_argument("--keywords", nargs="*", default=[], help="storyline checkpoints: its keywords")
    # The decoders' flags are evaluate.py's own, checked alike (check_flags).
    add_decoding_flags(p)
    p.add_argument("--L", type=LENGTH, default=100, help="the length cap: tokens generated")
    p.add_argument("--show_eos", action="store_true", help="print p(eos) at every step")
    p.add_argument("--allow_unk", action="store_true", help="read unknown words as <unk>")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    # A quoted --keywords "team won" is two keywords, as two arguments would be.
    args.decoder, args.keywords = args.decoder or "greedy", " ".join(args.keywords).split()
    ckpt, device = load_checkpoint(args.ckpt), get_device(args.device)
    story = ckpt["args"]["task"] in ("story", "storyline")
    check_flags(args, story)
    # A sample drawn without --seed gets a fresh seed, said, so that it can be repeated.
    if args.seed is None and args.decoder in SAMPLING:
        args.seed = int(torch.randint(2**31, ()))
        print(f"seed {args.seed} (--seed {args.seed} repeats this sample)", file=sys.stderr)
    model = model_from_checkpoint(ckpt, args.ckpt).to(device)
    g = sampling_generator(device, args.seed or 0)
    if story:
        return sample_story(args, ckpt, model, g, device)
    prompts, tok = read_prompts(args), tokenizer(ckpt["vocab"])
    # Each prompt as its checkpoint's protocol formed a training context, or p(eos) is off.
    ids = [encode_prompt(tok, x, ckpt["args"]["protocol"], args.allow_unk) for x in prompts]
    # At most 64 prompts are decoded together, to bound memory; more get a progress bar.
    bar = "sampling" if len(ids) > 64 else None
    options = dict(decoder_options(args), decoder=args.decoder, generator=g)
    tensors = [torch.tensor(x, device=device) for x in ids]
    out = decode_in_batches(model, tensors, args.L, 64, bar, **options)
    print_continuations(args, model, tok, prompts, ids, out)


def check_flags(args, story):
    """The flags this checkpoint would ignore, refused in one line each, as evaluate.py does."""
    # A story checkpoint's --consistent is refused below, in a story's words.
    options = dict(decoder_options(args), consistent=args.consistent and not story)
    check_decoder_args(args.decoder, STORY_DECODERS if story else DECODERS, **options)
    # The flags of the other kind of checkpoint would be ignored.
    if story and (args.prompt or args.prompt_file or args.show_eos or args.consistent):
        raise UserError(
            "--prompt / --prompt_file / --show_eos / --consistent are for text "
            "checkpoints; a story checkpoint takes --title (and --keywords)"
        )
    if not story and (args.title or args.keywords):
        raise UserError(
            "--title / --keywords are for story checkpoints; this one continues --prompt"
        )
    # Greedy and beam search draw nothing, so a seed would silently change nothing.
    if args.seed is not None and args.decoder not in SAMPLING:
        raise UserError(f"--decoder {args.decoder} does not use --seed: drop it")


def read_prompts(args):
    """Every --prompt, then the non-empty lines of --prompt_file: the texts to continue."""
    for text in args.prompt:
        check_utf8(text, "--prompt")
    lines = read_prompt_file(args.prompt_file) if args.prompt_file else []
    # A blank line of a file separates prompts; a --prompt of spaces alone would continue nothing.
    prompts = args.prompt + [line for line in lines if line.strip()]
    if not prompts or not all(x.strip() for x in prompts):
        raise UserError("give some text to continue: --prompt TEXT, or --prompt_file FILE")
    return prompts


def read_prompt_file(name):
    """The lines of a file (-: standard input), each checked to be UTF-8 text."""
    # A process started with its standard input closed has none to read.
    if name == "-" and sys.stdin is None:
        raise UserError("--prompt_file -: standard input is closed: give --prompt_file FILE")
    # Bytes that are not UTF-8 are kept as the command line keeps them, so that the line
    # holding them can be named below.
    try:
        if name == "-":
            raw = getattr(sys.stdin, "buffer", None)
            text = raw.read().decode("utf-8", "surrogateescape") if raw else sys.stdin.read()
        else:
            text = open(name, encoding="utf-8", errors="surrogateescape").read()
    except OSError as e:
        raise UserError(f"--prompt_file {name}: {e}") from None
    # A byte-order mark is not text.
    lines = text.lstrip("\ufeff").splitlines()
    for n, line in enumerate(lines, start=1):
        check_utf8(line, f"--prompt_file {name}, line {n}")
    return lines


def check_utf8(text, where):
    """Text that is not UTF-8 is one line showing its bytes, never '\\udcff' read as a word."""
    # Python hands over the command line's bytes that are not UTF-8 (and here a file's) as lone
    # surrogates; written back with surrogateescape they are the bytes again.
    shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if shown != text:
        raise UserError(f'{where}: "{shown}" is not UTF-8 text: give it in UTF-8')


def print_continuations(args, model, tok, prompts, ids, out):
    """One line a prompt: the prompt >>> its continuation, how it ended (and p(eos) each step)."""
    for text, prompt, toks, done in zip(prompts, ids, out["tokens"], out["terminated"].tolist()):
        # eos is not printed as a word: "[eos]" says that the model chose it.
        body = tok.decode([t for t in toks if t != model.eos_id]).strip()
        ended = "[eos]" if done else f"[length cap {args.L}: not terminated]"
        print(" ".join(s for s in (text, ">>>", body, ended) if s) + why(model, done, args))
        steps = zip(toks, eos_probs(model, prompt, toks)) if args.show_eos else []
        for t, (token, p_eos) in enumerate(steps, start=1):
            print(f"    t={t:4d}  p(eos)={p_eos:.4f}  {tok.decode([token])!r}")


def why(model, done, args):
    """Why a continuation was cut: -> "" or the step NMST Theorem 3 promises termination by."""
    head, eps = model.cfg["head"], model.cfg["epsilon"]
    # ST / NMST's p(eos) passes 1/2 by t = ln 2 / eps: an --L below that cuts it before.
    bound = math.log(2) / -math.log1p(-eps) if head in ("st", "nmst") else 0
    if done or bound <= args.L:
        return ""
    said = f"p(eos) passes 1/2 by t = ln 2 / eps = {bound:,.0f}; --L {args.L} cut it before"
    return f"  ({head.upper()}: {said})"


def sample_story(args, ckpt, model, g, device):
    """An L2R model continues "title [storyline]"; an insertion model fills its canvas."""
    prefix, keywords = story_prompt(args, ckpt)
    if ckpt["config"]["model"] in INSERTION:
        return fill_canvas(args, model, prefix, keywords, g, ckpt["vocab"])
    options = dict(k=args.k, temperature=args.temperature, generator=g)
    out = decode(model, [torch.tensor(prefix, device=device)], args.L, args.decoder, **options)
    story = " ".join(ckpt["vocab"][t] for t in out["tokens"][0] if t not in (PAD, BOS, EOS, SEP))
    ended = "[eos]" if out["terminated"][0] else f"[length cap {args.L}]"
    print(f"{args.title or ''} >>> {story} {ended}".strip())


def story_prompt(args, ckpt):
    """--title / --keywords, checked -> (the prefix continued, the keywords an insertion places)."""
    task, stoi = ckpt["args"]["task"], {w: i for i, w in enumerate(ckpt["vocab"])}
    check_utf8(" ".join([args.title or "", *args.keywords]).strip(), "--title / --keywords")
    synthetic = ckpt["args"]["dataset"] == "synthetic"
    # A synthetic model generates from <bos> alone; a story model continues a title.
    no_title = not synthetic and not (args.title or "").strip()
    if no_title or synthetic and (args.title or args.keywords):
        raise UserError(
            "a synthetic checkpoint generates from <bos> alone; a story checkpoint "
            "takes --title TEXT (and --keywords for a storyline one)"
        )
    # An L2R model was trained with keywords in its prefix exactly when its task is storyline.
    insertion = ckpt["config"]["model"] in INSERTION
    if not insertion and bool(args.keywords) != (task == "storyline"):
        raise UserError(
            f"this L2R checkpoint was trained on --task {task}: "
            f"{'give' if task == 'storyline' else 'drop'} --keywords"
        )
    if synthetic:
        return [BOS], []
    title, keywords = args.title.lower().split(), [k.lower() for k in args.keywords]
    if set(title + keywords) & set(SPECIALS):
        raise UserError("a control token is not a word: leave it out of --title / --keywords")
    check_known(title + keywords, stoi, args.allow_unk)
    story = dict(title=title, keywords=keywords, story=[])
    enc = encode_story(story, stoi, task, ckpt["config"]["model"])
    return enc["tokens"][: enc["n_given"]], enc["keywords"]


def fill_canvas(args, model, prefix, keywords, g, vocab):
    """Insertions into BOS title SEP [keywords] EOS, each canvas printed (step 0: as given)."""
    given, trace = len(prefix) + len(keywords) + 1, []
    # IT-vanilla learns one embedding a position: its canvas cannot outgrow them.
    if model.max_canvas() and given + args.L > model.max_canvas():
        raise UserError(
            f"{given} given tokens + --L {args.L} exceed the model's "
            f"{model.max_canvas()} positions: a smaller --L"
        )
    # The title is given whole (no gap left of its SEP opens); control tokens are never inserted.
    how = Decoding(args.decoder, args.k, args.temperature, len(prefix) - 1, (PAD, BOS, EOS, SEP))
    out = generate(model, [*prefix, *keywords, EOS], given + args.L, how, generator=g, trace=trace)
    for step, (canvas, p_end) in enumerate(trace):
        print(f"{step:3d}  p(terminate)={p_end:.3f}  {' '.join(vocab[t] for t in canvas[1:-1])}")
    ended = "terminated" if out["terminated"] else f"length cap {args.L}"
    print(f"[{ended} after {out['inserted']} insertion{'' if out['inserted'] == 1 else 's'}]")


if __name__ == "__main__":
    run(main)
