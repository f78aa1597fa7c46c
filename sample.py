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
from data.prepare import tokenizer
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


def main(argv=None):
    p = Parser(description="Continue a prompt with a nanogen checkpoint.")
    p.add_argument("--ckpt", required=True, help="a checkpoint of train.py")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    p.add_argument("--prompt_file", help="one prompt a line (-: standard input)")
    p.add_argument("--title", help="story checkpoints: the title")
    p.add_argument("--keywords", nargs="*", default=[], help="storyline checkpoints: its keywords")
    add_decoding_flags(p)
    p.add_argument(
        "--L",
        type=number(int, lambda v: 1 <= v <= 10**6, "in [1, 10^6]"),
        default=100,
        help="the length cap: tokens generated",
    )
    p.add_argument("--show_eos", action="store_true", help="print p(eos) at every step")
    p.add_argument("--allow_unk", action="store_true", help="read unknown words as <unk>")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto)")
    args = p.parse_args(argv)
    args.decoder, args.keywords = args.decoder or "greedy", " ".join(args.keywords).split()
    ckpt, device = load_checkpoint(args.ckpt), get_device(args.device)
    story = ckpt["args"]["task"] in ("story", "storyline")
    allowed = STORY_DECODERS if story else DECODERS
    # A story checkpoint's --consistent is refused below, in a story's words.
    options = dict(decoder_options(args), consistent=args.consistent and not story)
    check_decoder_args(args.decoder, allowed, **options)
    if story and (args.prompt or args.prompt_file or args.show_eos or args.consistent):
        raise UserError(
            "--prompt / --prompt_file / --show_eos / --consistent are for text "
            "checkpoints; a story checkpoint takes --title (and --keywords)"
        )
    if not story and (args.title or args.keywords):
        raise UserError(
            "--title / --keywords are for story checkpoints; this one continues --prompt"
        )
    if args.seed is None and args.decoder in SAMPLING:
        args.seed = int(torch.randint(2**31, ()))  # a fresh one, said: the sample can be repeated
        print(f"seed {args.seed} (--seed {args.seed} repeats this sample)", file=sys.stderr)
    model = model_from_checkpoint(ckpt, args.ckpt).to(device)
    g = sampling_generator(device, args.seed or 0)
    if story:
        return sample_story(args, ckpt, model, g, device)
    if args.prompt_file == "-" and sys.stdin is None:  # (started with standard input closed)
        raise UserError("--prompt_file -: standard input is closed: give --prompt_file FILE")
    text = ""
    try:
        if args.prompt_file == "-":
            text = sys.stdin.read()
        elif args.prompt_file:
            text = open(args.prompt_file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompt_file {args.prompt_file}: {e}") from None
    # A byte-order mark is not text.
    prompts = args.prompt + [ln for ln in text.lstrip("\ufeff").splitlines() if ln.strip()]
    if not prompts or not all(x.strip() for x in prompts):
        raise UserError("give some text to continue: --prompt TEXT, or --prompt_file FILE")
    tok = tokenizer(ckpt["vocab"])
    ids = [encode(tok, text, args.allow_unk) for text in prompts]
    out = decode_in_batches(
        model,
        [torch.tensor(x, device=device) for x in ids],
        args.L,
        64,
        "sampling" if len(ids) > 64 else None,
        decoder=args.decoder,
        generator=g,
        **decoder_options(args),
    )
    for text, x, toks, done in zip(prompts, ids, out["tokens"], out["terminated"].tolist()):
        body = tok.decode([t for t in toks if t != model.eos_id]).strip()
        ended = "[eos]" if done else f"[length cap {args.L}: not terminated]"
        print(" ".join(x for x in (text, ">>>", body, ended) if x) + why(model, done, args))
        for t, (token, p_eos) in enumerate(
            zip(toks, eos_probs(model, x, toks)) if args.show_eos else [], start=1
        ):
            print(f"    t={t:4d}  p(eos)={p_eos:.4f}  {tok.decode([token])!r}")


def encode(tok, text, allow_unk):
    """Prompt text -> ids (char level: its words and a space, as a training context); unknown
    words are an error naming them (or <unk> with --allow_unk)."""
    if tok.kind == "gpt2":
        return tok.enc.encode_ordinary(text.strip())
    pieces = tok.split(text) + ([" "] if tok.kind == "char" else [])
    if tok.kind == "word" and {"<eos>", "<unk>"} & set(pieces):
        raise UserError("<eos> / <unk> in the prompt are control tokens, not text: leave them out")
    check_known(pieces, tok.stoi, allow_unk and tok.unk is not None)
    return [tok.stoi.get(w, tok.unk) for w in pieces]


def check_known(words, stoi, allow_unk):
    """Unknown words are an error naming them (and the data's lower case), unless read as <unk>."""
    unknown = sorted({w for w in words if w not in stoi})
    if unknown and not allow_unk:
        lower = "; the data is lower-cased" if any(w.lower() in stoi for w in unknown) else ""
        raise UserError(
            f"not in the model's vocabulary: {', '.join(map(repr, unknown[:12]))}"
            f"{lower} (--allow_unk reads them as <unk>)"
        )


def why(model, done, args):  # NMST Theorem 3: ST / NMST's p(eos) passes 1/2 by t = ln 2 / eps
    head, eps = model.cfg["head"], model.cfg["epsilon"]
    bound = math.log(2) / -math.log1p(-eps) if head in ("st", "nmst") else 0
    return (
        f"  ({head.upper()}: p(eos) passes 1/2 by t = ln 2 / eps = {bound:,.0f}; --L {args.L} "
        f"cut it before)"
        if not done and bound > args.L
        else ""
    )


def sample_story(args, ckpt, model, g, device):
    """L2R continues "title [storyline]"; an insertion model fills the canvas BOS title SEP
    [keywords] EOS and prints it as given and after every insertion.  synthetic: from <bos>."""
    task, vocab = ckpt["args"]["task"], ckpt["vocab"]
    synthetic = ckpt["args"]["dataset"] == "synthetic"
    if synthetic == bool(args.title or args.keywords) or not synthetic and not args.title.strip():
        raise UserError(
            "a synthetic checkpoint generates from <bos> alone; a story checkpoint "
            "takes --title TEXT (and --keywords for a storyline one)"
        )
    insertion, stoi = ckpt["config"]["model"] in INSERTION, {w: i for i, w in enumerate(vocab)}
    if not insertion and bool(args.keywords) != (task == "storyline"):  # its training prefix
        raise UserError(
            f"this L2R checkpoint was trained on --task {task}: "
            f"{'give' if task == 'storyline' else 'drop'} --keywords"
        )
    title, keywords = (args.title or "").lower().split(), [k.lower() for k in args.keywords]
    if set(title + keywords) & set(SPECIALS):
        raise UserError("a control token is not a word: leave it out of --title / --keywords")
    check_known(title + keywords, stoi, args.allow_unk)
    enc = encode_story(
        dict(title=title, keywords=keywords, story=[]), stoi, task, ckpt["config"]["model"]
    )
    prefix, kws = ([BOS], []) if synthetic else (enc["tokens"][: enc["n_given"]], enc["keywords"])
    if not insertion:
        out = decode(
            model,
            [torch.tensor(prefix, device=device)],
            args.L,
            args.decoder,
            k=args.k,
            temperature=args.temperature,
            generator=g,
        )
        story = " ".join(vocab[t] for t in out["tokens"][0] if t not in (PAD, BOS, EOS, SEP))
        ended = "[eos]" if out["terminated"][0] else f"[length cap {args.L}]"
        print(f"{args.title or ''} >>> {story} {ended}".strip())
        return
    given, trace = len(prefix) + len(kws) + 1, []
    if model.max_canvas() and given + args.L > model.max_canvas():  # IT-vanilla's positions
        raise UserError(
            f"{given} given tokens + --L {args.L} exceed the model's "
            f"{model.max_canvas()} positions: a smaller --L"
        )
    out = generate(
        model,
        [*prefix, *kws, EOS],
        given + args.L,
        Decoding(args.decoder, args.k, args.temperature, len(prefix) - 1, (PAD, BOS, EOS, SEP)),
        generator=g,
        trace=trace,
    )
    for step, (canvas, p_end) in enumerate(trace):  # step 0: the given canvas
        print(f"{step:3d}  p(terminate)={p_end:.3f}  {' '.join(vocab[t] for t in canvas[1:-1])}")
    print(
        f"[{'terminated' if out['terminated'] else f'length cap {args.L}'} after "
        f"{out['inserted']} insertion{'' if out['inserted'] == 1 else 's'}]"
    )


if __name__ == "__main__":
    run(main)
