"""Recipes and rules: train.py's flags, the defaults of each --model as one table, and the flag
combinations that cannot work as one list of (condition, message) rules.

A recipe is a paper's setting (NMST paper section 4 and appendix D; InsNet paper section 4.3).
A flag given on the command line always wins; defaults fill only what was not given, and
nothing is rewritten: a combination that cannot work is an error naming the flag and the fix,
raised before anything is read or written (`parse_args`).  A value of one flag that can never
work is refused by the flag's own argparse type (its range is written with it); RULES holds
the rules between flags.
"""
import os
from collections import ChainMap

import cli
from checkpoint import GPT2_SIZES, CheckpointError
from checkpoint import load as load_checkpoint
from runs import check_own_checkpoint, resume_from
from data.prepare import DATASETS, VOCABS
from heads import HEADS, TERMINATION_HEADS
from model import MODELS, WINDOWED
from tasks import INSERTION_MODELS, STORY_DATASETS, data_moved

# --------------------------------------------------------------------------------------------
# recipes: the defaults of each --model ("story": every model on rocstories / synthetic)
# --------------------------------------------------------------------------------------------
RECURRENT_RECIPE = dict(n_layer=2, d_model=512, dropout=0.5, lr=1e-3, lr_schedule="plateau",
                        batch_size=32, max_tokens=None, max_iters=0, eval_interval=0,
                        weight_decay=0.01, decay_steps=500_000, warmup=0)
GPT_RECIPE = dict(n_layer=12, d_model=768, dropout=0.1, lr=6e-4, lr_schedule="linear",
                  batch_size=None, max_tokens=1024, max_iters=300_000, eval_interval=2000,
                  weight_decay=0.01, decay_steps=300_000, warmup=2000)
RECIPES = {  # NMST paper appendix D (rnn, lstm), 4.2 (gpt_finetune); InsNet paper 4.3 (story);
    # gcnn and gpt from scratch: nanogen's (the paper only finetunes GPT-2)
    "rnn": dict(RECURRENT_RECIPE, d_model=256, dropout=0.3),
    "lstm": RECURRENT_RECIPE,
    "gcnn": dict(RECURRENT_RECIPE, n_layer=8, dropout=0.1),
    "gpt": GPT_RECIPE,  # from scratch: nanoGPT's
    "gpt_finetune": dict(GPT_RECIPE, lr=5e-5, decay_steps=500_000, warmup=0),  # NMST 4.2
    "story": dict(n_layer=12, d_model=768, dropout=0.1, lr=1e-4, lr_schedule="linear",
                  batch_size=64, max_tokens=None, max_iters=80_000, eval_interval=1000,
                  weight_decay=0.02, decay_steps=80_000, warmup=400),
}
ARCH_KEYS = ("model", "head", "epsilon", "n_layer", "d_model", "n_head", "block_size", "dropout",
             "no_tie", "no_bias", "init_from", "task", "n_experts", "ct_alpha", "ct_beta",
             "ct_rank", "temperature", "locked_dropout", "order", "max_offset", "min_count",
             "synthetic_count", "vocab", "dataset", "kernel_size")
RESUMABLE = ("max_iters", "max_epochs", "device", "compile", "eval_interval", "eval_seqs",
             "data_dir", "patience", "peak_flops", "max_minutes", "log_interval", "dtype", "probe",
             "probe_L", "no_curves", "tensorboard")  # flags a --resume may change

FLAGS = {  # group: [(flag, argparse keywords)]; None defaults come from RECIPES
    "run": [
        ("--model", dict(default="gpt", choices=MODELS + tuple(INSERTION_MODELS),
                         help="backbone (default gpt); insnet / insertion_transformer: "
                              "insertion-based (insnet.py)")),
        ("--head", dict(default="softmax", choices=HEADS,
                        help="softmax (VA, NMST eq. 2), st (eq. 9), nmst (eq. 10); mos, ct, ctmos "
                             "(CT paper eq. 4, 6, 7), which hold full float32 rows per token: "
                             "K*V*4 bytes (mos, ctmos; K = --n_experts) or 2*V*4 (ct), about 3x "
                             "that with gradients, e.g. 6.6 GB for 8192 tokens at K=4, V=50257: "
                             "size the batch to fit")),
        ("--task", dict(default=None, choices=["completion", "stream", "story", "storyline"],
                        help="completion (default; NMST paper), stream (CT paper, rnn/lstm), "
                             "story / storyline (default story on story data)")),
        ("--epsilon", dict(range="(0,1)", type=float, default=1e-5,
                           help="eps of ST / NMST, in (0, 1)")),
        ("--dataset", dict(default="wikitext103", choices=sorted(DATASETS) + list(STORY_DATASETS),
                           help="(default wikitext103)")),
        ("--vocab", dict(default="word", choices=VOCABS,
                         help="wikitext2 / ptb: word or char; text: word, char or bpe (GPT-2's)")),
        ("--data_dir", dict(default=None,
                            help="folder with the dataset files (default $NANOGEN_DATA, else "
                                 "download); --dataset text: your train.txt [valid.txt "
                                 "test.txt]")),
        ("--out_dir", dict(default=None, help="checkpoints and logs (default out/...)")),
        ("--init_from", dict(default="scratch", choices=ChainMap({"scratch": 0}, GPT2_SIZES),
                             help="pretrained GPT-2 weights (sets the GPT-2 shape)")),
        ("--weights", dict(default=None, help="local GPT-2 weights (file or folder)")),
        ("--seed", dict(range="seed", type=int, default=0)),
        ("--device", dict(default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if any)")),
        ("--dtype", dict(default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="autocast dtype on CUDA (auto: bfloat16 where the GPU runs it "
                              "natively, else float32; float16 trains with a GradScaler)")),
        ("--compile", dict(action="store_true", help="torch.compile the model")),
        ("--peak_flops", dict(range=">0", type=float, default=None,
                              help="peak FLOP/s for the MFU column")),
        ("--resume", dict(action="store_true", help="continue from out_dir/ckpt_last.pt (else "
                                                    "ckpt_best.pt)")),
    ],
    "architecture": [
        ("--n_layer", dict(range=">=1", type=int, default=None)),
        ("--d_model", dict(range=">=1", type=int, default=None, help="embedding = hidden size")),
        ("--n_head", dict(range=">=1", type=int, default=12, help="attention heads")),
        ("--block_size", dict(range=">=1", type=int, default=1024,
                              help="GPT / GCNN window; stories: the longest sequence")),
        ("--kernel_size", dict(range=">=1", type=int, default=4, help="gcnn: kernel width k")),
        ("--dropout", dict(range="[0,1)", type=float, default=None)),
        ("--no_tie", dict(action="store_true", help="untied output embeddings")),
        ("--no_bias", dict(action="store_true", help="GPT without biases")),
        ("--n_experts", dict(range=">=1", type=int, default=4, help="mos / ctmos: softmaxes K")),
        ("--ct_alpha", dict(range=">=0", type=float, default=1.0, help="ct: alpha of eq. 6")),
        ("--ct_beta", dict(range=">0", type=float, default=0.5, help="ct: beta of eq. 6")),
        ("--ct_rank", dict(range=">=0", type=int, default=0, help="ct: rank of W_tau (0: full)")),
        ("--temperature", dict(range=">0", type=float, default=1.0,
                               help="softmax / mos: a constant temperature")),
        ("--locked_dropout", dict(action="store_true",
                                  help="rnn/lstm: variational dropout on the embeddings and the "
                                       "output")),
    ],
    "stories": [
        ("--order", dict(default="random", choices=["random", "l2r"],
                         help="insertion order of the training sequences")),
        ("--max_offset", dict(range=">=1", type=int, default=256, help="insnet: offset clip K")),
        ("--min_count", dict(range=">=1", type=int, default=2,
                             help="rocstories: rarer words -> <unk>")),
        ("--synthetic_count", dict(range=">=1", type=int, default=200,
                                   help="synthetic: per length")),
    ],
    "optimisation": [
        ("--lr", dict(range=">0", type=float, default=None, help="AdamW learning rate")),
        ("--beta1", dict(range="[0,1)", type=float, default=0.9)),
        ("--beta2", dict(range="[0,1)", type=float, default=0.99)),
        ("--weight_decay", dict(range=">=0", type=float, default=None,
                                help="not on biases/norms")),
        ("--grad_clip", dict(range=">=0", type=float, default=1.0, help="max grad norm (0: off)")),
        ("--lr_schedule", dict(default=None, choices=["plateau", "linear", "constant"],
                               help="plateau: x --lr_decay when validation does not improve; "
                                    "linear: to 0 over --decay_steps")),
        ("--lr_decay", dict(range="(0,1]", type=float, default=0.5,
                            help="plateau factor, (0, 1]")),
        ("--decay_steps", dict(range=">=1", type=int, default=None,
                               help="linear schedule length")),
        ("--warmup", dict(range=">=0", type=int, default=None, help="linear lr warm-up steps")),
        ("--patience", dict(range=">=1", type=int, default=10,
                            help="early stopping: evaluations without improvement")),
        ("--batch_size", dict(range=">=1", type=int, default=None, help="sequences per batch")),
        ("--max_tokens", dict(range=">=1", type=int, default=None,
                              help="padded tokens per batch")),
        ("--bptt", dict(range=">=1", type=int, default=70, help="stream: BPTT window length")),
        ("--loss_scaling", dict(action="store_true", help="ct / ctmos: CT eq. 8's LS")),
        ("--ar", dict(range=">=0", type=float, default=0.0,
                      help="activation regularisation (rnn/lstm)")),
        ("--tar", dict(range=">=0", type=float, default=0.0, help="temporal AR (rnn/lstm)")),
        ("--grad_accum", dict(range=">=1", type=int, default=None,
                              help="batches per optimizer step, over all processes (default: one "
                                   "per process)")),
        ("--max_epochs", dict(range=">=1", type=int, default=70)),
        ("--max_iters", dict(range=">=0", type=int, default=None, help="step limit (0: none)")),
        ("--max_minutes", dict(range=">=0", type=float, default=0.0,
                               help="stop after this much training time, evaluations included (0: "
                                    "no limit)")),
        ("--eval_interval", dict(range=">=0", type=int, default=None,
                                 help="evaluate every N steps (0: every epoch)")),
        ("--log_interval", dict(range=">=1", type=int, default=10,
                                help="steps.jsonl: losses read from the device every N steps")),
        ("--eval_seqs", dict(range=">=0", type=int, default=0,
                             help="validate on the first N (0: all)")),
        ("--train_seqs", dict(range=">=0", type=int, default=0,
                              help="train on the first N (0: all)")),
    ],
    "watching": [
        ("--probe", dict(range=">=0", type=int, default=64,
                         help="termination probe at each evaluation: greedy-decode N validation "
                              "contexts (0: off)")),
        ("--probe_L", dict(range=">=1", type=int, default=200,
                           help="probe: the length cap L of r_nt(L)")),
        ("--no_curves", dict(action="store_true",
                             help="do not draw OUT_DIR/curves.png at each evaluation")),
        ("--tensorboard", dict(action="store_true",
                               help="also log the scalars to OUT_DIR/tensorboard (pip install "
                                    "tensorboard)")),
    ],
}


def build_parser():
    p = cli.CLIParser(description="Train a nanogen model (defaults per --model: "
                                  "recipes.RECIPES).")
    for group, flags in FLAGS.items():
        g = p.add_argument_group(group)
        for flag, kw in flags:
            kw = dict(kw)
            if "range" in kw:  # the flag's own range, checked as it is parsed
                kw["type"] = cli.in_range(kw["type"], flag, kw.pop("range"))
            if flag[2:] in RECIPES["lstm"]:  # (None: filled from the recipe)
                kw["help"] = f"{kw.get('help', '')} (default: the --model recipe)".lstrip()
            g.add_argument(flag, **kw)
    return p


# --------------------------------------------------------------------------------------------
# rules: (broken(args), message naming the flag and the fix), checked before anything is written
# --------------------------------------------------------------------------------------------
RECURRENT, STORY = ("rnn", "lstm"), STORY_DATASETS
RULES = [
    (lambda a: a.model in INSERTION_MODELS and a.dataset not in STORY,
     "--model {model} trains on --dataset rocstories or synthetic, not {dataset}"),
    (lambda a: a.dataset in STORY and a.model not in (*INSERTION_MODELS, "gpt"),
     "--dataset {dataset} is for --model insnet, insertion_transformer or gpt (L2R)"),
    (lambda a: a.dataset in STORY and a.head != "softmax", "--head {head} is an output head of the "
     "left-to-right models on the NMST / CT data; the story runs use the softmax head"),
    (lambda a: a.dataset in STORY and a.task == "stream", "--task stream is for the recurrent "
     "models; story tasks: --task story or storyline"),
    (lambda a: a.dataset in STORY and a.task == "completion", "--task completion is for the "
     "WikiText / PTB data; story runs take --task story or storyline"),
    (lambda a: a.task == "storyline" and a.dataset != "rocstories",
     "--task storyline needs ROCStories' storylines (--dataset rocstories)"),
    (lambda a: a.task == "story" and a.dataset not in STORY,
     "--task story is for the story data: --dataset rocstories or synthetic"),
    (lambda a: a.dataset in STORY and (a.init_from != "scratch" or a.weights), "--init_from / "
     "--weights load GPT-2 weights for the WikiText-103 recipe, not for story runs"),
    (lambda a: a.order != "random" and a.model not in INSERTION_MODELS,
     "--order is the insertion order of --model insnet / insertion_transformer"),
    (lambda a: a.dataset in STORY and a.max_tokens is not None,
     "story runs batch by --batch_size sequences, not --max_tokens"),
    (lambda a: a.init_from != "scratch" and DATASETS.get(a.dataset, {}).get("tokenizer") != "gpt2"
     and a.dataset not in STORY and (a.dataset, a.vocab) != ("text", "bpe"), "--init_from "
     "{init_from} needs the GPT-2 BPE vocabulary: use --dataset wikitext103, or your own text "
     "with --vocab bpe"),
    (lambda a: a.init_from != "scratch" and a.model != "gpt",
     "--init_from {init_from} loads GPT-2 weights: use it with --model gpt"),
    (lambda a: a.weights and a.init_from == "scratch",
     "--weights is for --init_from gpt2 / gpt2-medium / gpt2-large / gpt2-xl"),
    (lambda a: a.weights and not os.path.exists(a.weights), "--weights {weights}: no such file or "
     "folder"),  # (said before the data is prepared, not after)
    (lambda a: a.task == "stream" and a.model not in RECURRENT,
     "--task stream runs the recurrent models (CT paper): use --model rnn or lstm"),
    (lambda a: a.task == "stream" and a.head in TERMINATION_HEADS,
     "--head {head} models the end of a sequence: use it with --task completion"),
    (lambda a: a.temperature != 1.0 and a.head not in ("softmax", "mos"),
     "a constant --temperature is the baseline of the softmax / mos heads, not of {head}"),
    (lambda a: a.loss_scaling and a.head not in ("ct", "ctmos"),
     "--loss_scaling scales by the contextual temperature: use --head ct or ctmos"),
    (lambda a: (a.ar or a.tar or a.locked_dropout) and a.model not in RECURRENT,
     "--ar / --tar / --locked_dropout act on the recurrent models' last layer (rnn/lstm)"),
    (lambda a: a.kernel_size != 4 and a.model != "gcnn", "--kernel_size is the width of the "
     "gcnn's convolutions; --model {model} has none"),
    (lambda a: a.vocab == "bpe" and a.dataset != "text",
     "--vocab bpe is for --dataset text (wikitext103 is BPE already; wikitext2 / ptb: word, char)"),
    (lambda a: a.dataset == "text" and not (a.data_dir or os.environ.get("NANOGEN_DATA")),
     "--dataset text reads your own text: --data_dir DIR with DIR/train.txt (valid.txt, test.txt "
     "optional)"),
    (lambda a: a.vocab == "char" and a.dataset not in ("wikitext2", "ptb", "text"),
     "--vocab char is for the word-level datasets (wikitext2, ptb), not {dataset}"),
    (lambda a: a.batch_size is not None and a.max_tokens is not None,
     "give --batch_size (sequences per batch) or --max_tokens (tokens per batch), not both"),
    (lambda a: a.model in ("gpt", *INSERTION_MODELS) and a.d_model % a.n_head,
     "--d_model {d_model} must be divisible by --n_head {n_head}"),
]


def parse_args(argv=None):
    """train.py's arguments: the flags typed, the recipe's defaults for the rest, the rules;
    with --resume, the run's own arguments (a typed flag is honoured where a resumed run may
    change it, refused where it differs from the run's) and its checkpoint.
    -> (args, the checkpoint to resume or None)."""
    args, explicit = typed_args(argv)
    out_dir = args.out_dir or os.path.join("out", default_run_name(args))
    path = resume_from(out_dir)
    if args.resume and path:  # the run's own arguments, already resolved
        args.out_dir, ckpt = out_dir, load_checkpoint(path)
        check_own_checkpoint(ckpt, path)  # not a checkpoint copied in from another run
        return resume_args(args, explicit, ckpt["args"]), ckpt
    args = resolve(args, explicit)
    unused = [f"--{k}" for k, applies in APPLIES if k in explicit and not applies(args)]
    if unused:  # said, not silently dropped (not refused: scripts pass them to every model)
        print(f"note: {', '.join(unused)} do{'es' if len(unused) == 1 else ''} not apply to "
              f"--model {args.model} --head {args.head} --task {args.task} --dataset "
              f"{args.dataset} and {'is' if len(unused) == 1 else 'are'} ignored")
    return args, None


APPLIES = [  # (flag, does it apply to these arguments?)
    ("epsilon", lambda a: a.head in TERMINATION_HEADS),  # eq. 9, 10
    ("temperature", lambda a: a.model not in INSERTION_MODELS),  # (softmax / mos: RULES)
    ("n_head", lambda a: a.model in ("gpt", *INSERTION_MODELS)),
    ("block_size", lambda a: a.model in (*WINDOWED, *INSERTION_MODELS)),
    ("warmup", lambda a: a.lr_schedule == "linear"),
    ("decay_steps", lambda a: a.lr_schedule == "linear"),
    ("lr_decay", lambda a: a.lr_schedule == "plateau"),
    ("bptt", lambda a: a.task == "stream"),
    ("n_experts", lambda a: a.head in ("mos", "ctmos")),
    ("ct_rank", lambda a: a.head in ("ct", "ctmos")),
    ("ct_alpha", lambda a: a.head in ("ct", "ctmos")),
    ("ct_beta", lambda a: a.head in ("ct", "ctmos")),
    ("max_offset", lambda a: a.model == "insnet"),
    ("min_count", lambda a: a.dataset == "rocstories"),
    ("synthetic_count", lambda a: a.dataset == "synthetic"),
    ("data_dir", lambda a: a.dataset != "synthetic"),  # (generated)
    ("vocab", lambda a: a.dataset in ("wikitext2", "ptb", "text")),  # (others: their own)
    ("no_bias", lambda a: a.model == "gpt"),
    ("no_tie", lambda a: a.model not in INSERTION_MODELS),  # (always tied: insnet.py)
    ("train_seqs", lambda a: a.task != "stream"),  # (a stream trains on the whole corpus)
    ("probe", lambda a: a.task == "completion"),  # (contexts to continue)
    ("probe_L", lambda a: a.task == "completion"),
]


def typed_args(argv=None):
    """-> (the arguments as parsed, recipes not yet applied; {flag: value} of those typed)."""
    args = build_parser().parse_args(argv)
    if args.data_dir:  # kept with the run: --resume and evaluate.py may run from another folder
        args.data_dir = os.path.abspath(args.data_dir)
    return args, {k: getattr(args, k) for k in typed_flags(argv)}


def typed_flags(argv=None):
    """The destinations of the flags typed on the command line, whatever their values (also
    one typed at its default value): the same parser with every default suppressed."""
    import argparse
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def resolve(args, explicit):
    """Fill the defaults (RECIPES; the GPT-2 shape of --init_from; the task of the dataset),
    then check RULES.  Explicit flags are never changed."""
    story = args.dataset in STORY or args.model in INSERTION_MODELS
    name = "story" if story else "gpt_finetune" if args.init_from != "scratch" else args.model
    recipe = dict(RECIPES[name])
    if "batch_size" in explicit or "max_tokens" in explicit:  # the user picked how to batch
        recipe.update(batch_size=None, max_tokens=None)
    if args.init_from != "scratch":
        pretrained_shape(args, explicit)
    for k, v in recipe.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.grad_accum is None:  # one batch per process: torchrun sets WORLD_SIZE
        args.grad_accum = int(os.environ.get("WORLD_SIZE", "1"))
    if args.task is None:
        args.task = "story" if args.dataset in STORY else "completion"
    cli.check_rules(RULES, args)
    if args.out_dir is None:
        args.out_dir = os.path.join("out", default_run_name(args))
    return args


def pretrained_shape(args, explicit):
    """--init_from gpt2*: the pretrained model's shape; a different explicit one is an error."""
    shape = dict(zip(("n_layer", "n_head", "d_model"), GPT2_SIZES[args.init_from]))
    for k, v in dict(shape, block_size=1024, no_bias=False, no_tie=False).items():
        if k in explicit and explicit[k] != v:
            raise cli.UserError(f"--init_from {args.init_from} has --{k} {v}; drop --{k}")
        setattr(args, k, v)


def default_run_name(a):
    if a.dataset in STORY:
        return f"{a.dataset}-{a.task or 'story'}-{a.model}" + ("-l2r" if a.order == "l2r" else "")
    return f"{a.dataset}{'' if a.vocab == 'word' else '-' + a.vocab}-{a.model}-{a.head}"


def resume_args(args, explicit, run_args):
    """On --resume the run's own arguments (run_args: its checkpoint's) come back; RESUMABLE
    flags may be changed, any other flag that differs is an error (nothing is silently
    ignored)."""
    saved = dict(vars(build_parser().parse_args([])), **run_args)
    for k, v in explicit.items():
        if k not in RESUMABLE + ("resume", "out_dir") and saved.get(k) != v:
            what = "a flag a resumed run cannot change" if k not in ARCH_KEYS else "its model/data"
            raise CheckpointError(f"the checkpoint in {args.out_dir} was trained with --{k} "
                                  f"{saved.get(k)}, not {v} ({what}); drop --{k} or use another "
                                  f"--out_dir for a new run")
        if k in RESUMABLE:
            saved[k] = v
    if saved.get("data_dir") and not os.path.isdir(saved["data_dir"]):
        raise data_moved(saved["data_dir"])
    saved["resume"], saved["out_dir"] = True, args.out_dir  # where the folder is now
    return type(args)(**saved)


def model_config(args, vocab_size, eos_id):
    """The architecture part of the arguments, as the plain dict checkpoints keep."""
    cfg = dict(model=args.model, vocab_size=vocab_size, n_layer=args.n_layer,
               d_model=args.d_model, dropout=args.dropout)
    if args.model in INSERTION_MODELS:
        cfg.update(n_head=args.n_head, block_size=args.block_size)
        return dict(cfg, max_offset=args.max_offset) if args.model == "insnet" else cfg
    cfg.update(head=args.head, epsilon=args.epsilon, eos_id=eos_id, tie=not args.no_tie)
    if args.model in WINDOWED:  # learned positions: a window of block_size tokens
        cfg.update(block_size=args.block_size)
    if args.model == "gpt":
        cfg.update(n_head=args.n_head, bias=not args.no_bias)
    if args.model == "gcnn":  # (a convolutional model of your own: its kernel_size too)
        cfg.update(kernel_size=args.kernel_size)
    if args.model in RECURRENT and args.locked_dropout:
        cfg.update(locked_dropout=True)
    if args.head in ("mos", "ctmos"):
        cfg.update(n_experts=args.n_experts)
    if args.head in ("ct", "ctmos"):
        cfg.update(ct_alpha=args.ct_alpha, ct_beta=args.ct_beta, ct_rank=args.ct_rank)
    if args.temperature != 1.0:
        cfg.update(temperature=args.temperature)
    return cfg
