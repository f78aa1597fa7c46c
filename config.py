"""train.py's configuration, as nanoGPT's configurator.py: the flags, their layering (each
flag's default, the --model recipe of train.py's RECIPES over it, what you type over both; on
--resume the checkpoint's arguments), and the checks of combinations that cannot work.

    args, ckpt = get_args(argv, RECIPES, AUTHORS)      # train.py's first line
"""

import argparse
import os

from common import (
    DECAY,
    FRACTION,
    INT0,
    INT1,
    LENGTH,
    NONNEG,
    OPEN_UNIT,
    POS,
    SEED,
    Parser,
    UserError,
    load_checkpoint,
    world,
)
from data.prepare import DATASETS, VOCABS
from heads import HEADS, TERMINATION_HEADS
from insnet import INSERTION
from model import MODELS, WINDOWED

# The story data sets (InsNet); the others are data/prepare.py's DATASETS.
STORY_DATASETS = ("rocstories", "synthetic")
# GPT-2's sizes: (n_layer, n_head, d_model); V = 50257, 1024 positions.
GPT2_SIZES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
ALL_DATASETS = (*DATASETS, *STORY_DATASETS)
SCHEDULES = ("plateau", "linear", "constant")
# The tasks: completion (NMST), stream (CT), story / storyline (InsNet).
TASKS = ("completion", "stream", "story", "storyline")
DTYPES = ("float32", "bfloat16", "float16")
# The flags a --model recipe sets (train.py's RECIPES); their parser default is None.
RECIPE_FLAGS = "n_layer d_model dropout lr lr_schedule batch_size max_tokens max_iters".split()
RECIPE_FLAGS += "eval_interval weight_decay decay_steps warmup".split()


class Help(argparse.HelpFormatter):
    """--help: each flag's help ends with its default, or says that the --model recipe sets it."""

    def _get_help_string(self, action):
        default = DEFAULTS.get(action.dest)
        if default is not None:
            return f"{action.help} (default: {default})".strip()
        if action.dest in RECIPE_FLAGS:
            return f"{action.help} (default: the --model recipe)".strip()
        return action.help


def parser():
    """train.py's flags, one a line, in six groups (the parser's defaults are DEFAULTS)."""
    p = Parser(description="Train a nanogen model.", formatter_class=Help)
    what_is_trained_flags(p)
    data_flags(p)
    run_flags(p)
    shape_flags(p)
    optimization_flags(p)
    stopping_flags(p)
    return p


def what_is_trained_flags(p):
    """What is trained: the model, its output head, the task."""
    # The backbones of model.py and the insertion models of insnet.py; a --model brings its
    # recipe (train.py's RECIPES).
    p.add_argument("--model", default="gpt", choices=(*MODELS, *INSERTION), help="the model")
    # softmax (VA, NMST eq. 2), st (eq. 9), nmst (eq. 10); mos, ct, ctmos (CT eq. 4, 6, 7)
    p.add_argument("--head", default="softmax", choices=HEADS, help="the output head")
    # The task follows from the data unless you name it: completions for text, stories for
    # the story data; a stream (CT's continuous text) must be asked for.
    p.add_argument("--task", choices=TASKS, help="None: the dataset's")
    # The NMST paper's epsilon: p(eos) reaches 1/2 by t = ln 2 / epsilon (Theorem 3).
    p.add_argument("--epsilon", default=1e-5, type=OPEN_UNIT, help="ST / NMST")


def data_flags(p):
    """The data."""
    # data/prepare.py's data sets, your own text ("text", in --data_dir), and the story data.
    p.add_argument("--dataset", default="wikitext103", choices=ALL_DATASETS, help="the data set")
    # The paper's text and the authors' code differ in their sequences, batches and loss
    # (docs/protocol.md): the protocol is part of the prepared data and of the checkpoint.
    p.add_argument(
        "--protocol", default="paper", choices=("paper", "authors"), help="the objective"
    )
    # wikitext2, ptb, text: word or char; text: bpe (GPT-2's) too
    p.add_argument("--vocab", default="word", choices=VOCABS, help="the vocabulary")
    # (an absolute path: a resumed run, or reproduce.py, may start elsewhere)
    p.add_argument("--data_dir", type=os.path.abspath, help="None: $NANOGEN_DATA, or download")


def run_flags(p):
    """The run: where it writes, where it starts from, where it runs."""
    # A run owns its folder: its checkpoints, logs, args.json and curves.png.
    p.add_argument("--out_dir", help="None: out/DATASET-MODEL-HEAD")
    p.add_argument("--seed", default=0, type=SEED, help="the random seed")
    # (GPT2_SIZES read when the parser is made: a test adds a size of its own)
    inits = ("scratch", *GPT2_SIZES)
    p.add_argument("--init_from", default="scratch", choices=inits, help="GPT-2's weights")
    # (a machine without internet access loads GPT-2's weights from a file)
    p.add_argument("--weights", help="--init_from's, a local copy")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N")
    # On a CPU every run is float32; autocast is for CUDA (auto: bfloat16 where native).
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="CUDA's autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile")
    p.add_argument("--peak_flops", type=POS, help="for MFU")
    p.add_argument("--resume", action="store_true", help="from out_dir/ckpt_last.pt")


def shape_flags(p):
    """The model's shape."""
    # The recipe sets the size; each flag here overrides one dimension of it.
    p.add_argument("--n_layer", type=INT1, help="layers")
    p.add_argument("--d_model", type=INT1, help="the width")
    p.add_argument("--n_head", default=12, type=INT1, help="gpt: attention heads")
    p.add_argument("--block_size", default=1024, type=INT1, help="GPT / GCNN window, story canvas")
    p.add_argument("--dropout", type=FRACTION, help="the dropout rate")
    p.add_argument("--kernel_size", default=4, type=INT1, help="gcnn")
    p.add_argument("--no_tie", action="store_true", help="untie the input and output embeddings")
    p.add_argument("--no_bias", action="store_true", help="gpt")
    # The CT paper's heads: K experts (MoS) and the temperature's alpha and beta (eq. 6).
    p.add_argument("--n_experts", default=4, type=INT1, help="mos / ctmos: K")
    p.add_argument("--ct_alpha", default=1.0, type=NONNEG, help="CT eq. 6")
    p.add_argument("--ct_beta", default=0.5, type=POS, help="CT eq. 6")
    p.add_argument("--ct_rank", default=0, type=INT0, help="ct: rank of W_tau (0: full)")
    p.add_argument("--temperature", default=1.0, type=POS, help="softmax / mos: a constant one")
    # InsNet: offsets beyond K share one learned bias; the insertion order of training.
    p.add_argument("--max_offset", default=256, type=INT1, help="insnet")
    p.add_argument("--locked_dropout", action="store_true", help="rnn / lstm: a mask per sequence")
    p.add_argument("--order", default="random", choices=("random", "l2r"), help="insertion order")
    # The story data's vocabulary and the synthetic data's size.
    p.add_argument("--min_count", default=2, type=INT1, help="rocstories: rarer words are <unk>")
    p.add_argument("--synthetic_count", default=200, type=INT1, help="synthetic: a length's")


def optimization_flags(p):
    """Optimization."""
    # AdamW with the recipe's rate and schedule; the NMST paper's recurrent models halve the
    # rate when an evaluation does not improve (plateau); linear: 0 at --decay_steps.
    p.add_argument("--lr", type=POS, help="the peak learning rate")
    p.add_argument("--warmup", type=INT0, help="linear: steps up to --lr")
    p.add_argument("--max_epochs", default=70, type=INT1, help="epochs at most")
    p.add_argument("--beta1", default=0.9, type=FRACTION, help="AdamW")
    p.add_argument("--beta2", default=0.99, type=FRACTION, help="AdamW")
    p.add_argument("--weight_decay", type=NONNEG, help="AdamW")
    p.add_argument("--grad_clip", default=1.0, type=NONNEG, help="0: off")
    p.add_argument("--lr_schedule", choices=SCHEDULES, help="the rate's schedule")
    p.add_argument("--decay_steps", type=INT1, help="linear: the step the rate reaches 0")
    p.add_argument("--lr_decay", default=0.5, type=DECAY, help="plateau: the factor")
    p.add_argument("--patience", default=10, type=INT1, help="evaluations without improvement")
    # A batch is a number of lines (the NMST paper's recurrent models: 32) or a number of
    # tokens (GPT: 1024), never both.
    p.add_argument("--batch_size", type=INT1, help="sequences a batch")
    p.add_argument("--max_tokens", type=INT1, help="padded tokens a batch")
    p.add_argument("--bptt", default=70, type=INT1, help="stream: its window")
    # The CT paper's regularisers of eq. 8.
    p.add_argument("--loss_scaling", action="store_true", help="CT eq. 8's LS")
    p.add_argument("--ar", default=0.0, type=NONNEG, help="rnn / lstm: CT eq. 8")
    p.add_argument("--tar", default=0.0, type=NONNEG, help="rnn / lstm: CT eq. 8")
    # Under torchrun each process reads its share of a step's batches.
    p.add_argument("--grad_accum", type=INT1, help="batches a step (None: one a process)")


def stopping_flags(p):
    """When to stop, evaluate and log."""
    # The run stops at the first limit reached, or at an early stop after --patience
    # evaluations without improvement.
    p.add_argument("--max_iters", type=INT0, help="0: none")
    p.add_argument("--max_minutes", default=0.0, type=NONNEG, help="0: none")
    p.add_argument("--whole_epochs", action="store_true", help="--max_minutes at an epoch's end")
    p.add_argument("--eval_interval", type=INT0, help="0: at epoch ends")
    p.add_argument("--log_interval", default=10, type=INT1, help="steps between loss reads")
    # (fewer training and validation lines: a quick run, or a test)
    p.add_argument("--train_seqs", default=0, type=INT0, help="0: all")
    p.add_argument("--eval_seqs", default=0, type=INT0, help="validate on the first N (0: all)")
    # The termination probe greedy-decodes N validation contexts at every evaluation; its L is
    # capped, as evaluate.py's --L is, so that a model that never ends cannot keep the run
    # decoding for ever.
    p.add_argument("--probe", default=64, type=INT0, help="termination probe: contexts (0: off)")
    p.add_argument("--probe_L", default=200, type=LENGTH, help="the probe's L")
    p.add_argument("--no_curves", action="store_true", help="no OUT_DIR/curves.png")
    p.add_argument("--tensorboard", action="store_true", help="OUT_DIR/tensorboard too")


# The defaults of every flag; a recipe goes over them (get_args).
DEFAULTS = vars(parser().parse_args([]))


def typed_flags(argv):
    """-> {flag: value} of the flags typed on the command line (the parser's defaults set to None
    first, so whatever is not None was typed)."""
    p = parser()
    p.set_defaults(**dict.fromkeys(DEFAULTS))
    return {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}


def get_args(argv, recipes, authors):
    """-> (args, the checkpoint to resume or None).  The layers, each over the one before: every
    flag's default (DEFAULTS), the --model's recipe (train.py's RECIPES; --protocol authors: the
    authors' settings over it), the flags you typed; on --resume the checkpoint's arguments with
    the flags you typed over them."""
    typed = typed_flags(argv)
    a = {**DEFAULTS, **typed}
    story = a["dataset"] in STORY_DATASETS or a["model"] in INSERTION
    recipe = recipes[recipe_name(a, story)]
    if a["protocol"] == "authors":
        recipe = {**recipe, **authors}
    # A recipe's batching yields to yours: --batch_size or --max_tokens typed drops both of its.
    if {"batch_size", "max_tokens"} & set(typed):
        recipe = {k: v for k, v in recipe.items() if k not in ("batch_size", "max_tokens")}
    a = {**DEFAULTS, **recipe, **typed}
    derive_flags(a, typed, story)
    ckpt = None
    if a["resume"]:
        ckpt = resume_checkpoint(a["out_dir"])
        a = resumed_flags(a, typed, ckpt)
    check_args(argparse.Namespace(**a))
    return argparse.Namespace(**a), ckpt


def derive_flags(a, typed, story):
    """The flags that follow from others: GPT-2's shape, the task, the window, --grad_accum's
    default and the run's folder."""
    if a["init_from"] != "scratch":
        a.update(gpt2_shape(a["init_from"], typed))
    # The task a data set is for: stories, or the NMST paper's completions.
    if not a["task"] and story:
        a["task"] = "story"
    if not a["task"]:
        a["task"] = "completion"
    # GPT and GCNN read a window of positions; the recurrent models read any length.
    a["window"] = None
    if a["model"] in WINDOWED:
        a["window"] = a["block_size"]
    # One batch a step on each process, unless you ask for more.
    a["grad_accum"] = a["grad_accum"] or world()[1]
    a["out_dir"] = a["out_dir"] or os.path.join("out", run_name(a))


def resumed_flags(a, typed, ckpt):
    """--resume: the checkpoint's arguments, the flags you typed over them (those that would
    change what the run computes are refused)."""
    check_resume_flags(typed, ckpt["args"], a["out_dir"])
    a = {**ckpt["args"], **typed, "out_dir": a["out_dir"]}
    if a["data_dir"] and not os.path.isdir(a["data_dir"]):
        raise UserError(
            f"the run's --data_dir {a['data_dir']} is not there (moved?): give "
            f"--data_dir DIR where its data is now"
        )
    return a


def recipe_name(a, story):
    """The story data's recipe, GPT-2 finetuning's, or the --model's own."""
    if story:
        return "story"
    if a["init_from"] != "scratch":
        return "gpt_finetune"
    return a["model"]


def gpt2_shape(init_from, typed):
    """--init_from's shape, the flags it fixes; a typed flag that differs is refused."""
    n_layer, n_head, d_model = GPT2_SIZES[init_from]
    shape = dict(
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        block_size=1024,
        no_bias=False,
        no_tie=False,
    )
    for k, v in shape.items():
        if typed.get(k, v) != v:
            raise UserError(f"--init_from {init_from} has --{k} {v}: drop --{k}")
    return shape


def resume_checkpoint(out_dir):
    """--resume: out_dir's ckpt_last.pt, checked to hold a training state."""
    path = os.path.join(out_dir, "ckpt_last.pt")
    if not os.path.exists(path):
        raise UserError(f"--resume: no checkpoint in {out_dir}; start without --resume")
    ckpt = load_checkpoint(path)
    resumable = {"optimizer", "rng", "scaler", "hidden"} <= set(ckpt)
    if not (resumable and "elapsed" in ckpt["state"]):
        raise UserError(f"{path} holds no training state to resume (not train.py's)")
    return ckpt


# Where, how and how long a resumed run goes on: the flags --resume may change (what the run
# computes stays what it was).
RESUME_MAY_CHANGE = "out_dir resume data_dir device dtype compile peak_flops max_iters".split()
RESUME_MAY_CHANGE += "max_epochs max_minutes whole_epochs patience log_interval probe".split()
RESUME_MAY_CHANGE += "probe_L no_curves tensorboard".split()


def check_resume_flags(typed, saved, out_dir):
    """--resume: a typed flag (even one at its default) that would change what the run computes
    (its shape, data, batches, seed, optimizer, evaluations) is refused, never silently taken."""
    changed = [
        k for k in typed if k not in RESUME_MAY_CHANGE and k in saved and typed[k] != saved[k]
    ]
    if changed:
        k = changed[0]
        raise UserError(
            f"the checkpoint in {out_dir} has {k}={saved[k]}, not {typed[k]}: drop that "
            f"flag, or use another --out_dir for a new run"
        )


def run_name(a):
    if a["dataset"] in STORY_DATASETS:
        return f"{a['dataset']}-{a['task']}-{a['model']}" + ("-l2r" if a["order"] == "l2r" else "")
    vocab = "" if a["vocab"] == "word" else "-" + a["vocab"]
    return f"{a['dataset']}{vocab}-{a['model']}-{a['head']}"


def check_args(a):
    """The combinations that cannot work, or would silently do nothing: one line each."""
    check_data_args(a)
    check_model_args(a)
    check_run_args(a)


def check_data_args(a):
    """The data, the task and the model that reads them."""
    story = a.dataset in STORY_DATASETS
    insertion = a.model in INSERTION
    recurrent = a.model in ("rnn", "lstm")
    bpe = a.dataset == "wikitext103" or (a.dataset, a.vocab) == ("text", "bpe")
    # Stories and the insertion models
    if insertion and not story:
        raise UserError(f"--model {a.model} trains on rocstories or synthetic")
    if story and a.model not in (*INSERTION, "gpt"):
        raise UserError(
            f"--dataset {a.dataset} is for --model "
            f"insnet, insertion_transformer or gpt (the L2R baseline)"
        )
    if story and a.head != "softmax":
        raise UserError("the story models have the softmax head: drop --head")
    # The task
    if story != (a.task in ("story", "storyline")):
        raise UserError(
            f"--task {a.task} is not for --dataset "
            f"{a.dataset} (stories: story or storyline; text: completion or stream)"
        )
    if a.task == "storyline" and a.dataset != "rocstories":
        raise UserError("--task storyline needs the storylines of rocstories")
    if a.task == "stream" and not recurrent:
        raise UserError(
            "--task stream is for --model "
            "rnn or lstm (the CT paper's continuous LM), on one process"
        )
    if a.task == "stream" and a.head in TERMINATION_HEADS:
        raise UserError(
            f"--head {a.head} models the end of a sequence: use it with --task completion"
        )
    # GPT-2's weights
    if a.init_from != "scratch" and (a.model != "gpt" or not bpe):
        raise UserError(
            f"--init_from "
            f"{a.init_from} is GPT-2: --model gpt on BPE data (wikitext103, text --vocab bpe)"
        )
    if a.weights and a.init_from == "scratch":
        raise UserError("--weights goes with --init_from gpt2...")


def check_model_args(a):
    """The flags of one head or one model, and the model's shape."""
    recurrent = a.model in ("rnn", "lstm")
    if a.loss_scaling and a.head not in ("ct", "ctmos"):
        raise UserError("--loss_scaling needs --head ct or ctmos (CT eq. 8)")
    if (a.ar or a.tar or a.locked_dropout) and not recurrent:
        raise UserError("--ar / --tar / --locked_dropout are for --model rnn or lstm")
    if a.temperature != 1 and a.head not in ("softmax", "mos"):
        raise UserError(
            f"a constant --temperature is the baseline of the softmax / mos heads, not of {a.head}"
        )
    if a.model in ("gpt", *INSERTION) and a.d_model % a.n_head:
        raise UserError(f"--d_model {a.d_model} must be divisible by --n_head {a.n_head}")
    if a.order != "random" and a.model not in INSERTION:
        raise UserError("--order is for insnet, insertion_transformer")


def check_run_args(a):
    """The batching, the protocol, the stopping flags, torchrun."""
    story = a.dataset in STORY_DATASETS
    procs = world()[1]
    if a.max_tokens and (a.batch_size or story):
        raise UserError(
            "give --batch_size (sequences a batch) or "
            "--max_tokens (tokens a batch), not both; stories: --batch_size"
        )
    # The authors' code trains recurrent models on completions, in batches of lines.
    authors_setting = a.model in ("rnn", "lstm") and a.task == "completion" and not a.max_tokens
    if a.protocol == "authors" and not authors_setting:
        raise UserError(
            "--protocol authors is the authors' rnn / lstm code: --model rnn or lstm, "
            "--task completion, --batch_size"
        )
    # (a resumed run may lift its cap with --max_minutes 0, keeping --whole_epochs)
    if a.whole_epochs and not a.max_minutes and not a.resume:
        raise UserError("--whole_epochs makes --max_minutes stop at an epoch's end: give both")
    if procs > 1 and (a.task == "stream" or a.grad_accum % procs):
        raise UserError(
            f"under torchrun "
            f"--grad_accum ({a.grad_accum}) is a multiple of the {procs} processes, no stream"
        )


# The flags of a model's shape: its checkpoint's config keeps them (with tie and bias).
SHAPE = "model head epsilon n_layer d_model n_head block_size dropout kernel_size".split()
SHAPE += "locked_dropout n_experts ct_alpha ct_beta ct_rank temperature max_offset".split()
SHAPE += ["protocol"]


def model_config(args, data):
    """The architecture, the plain dict a checkpoint keeps (model.py reads what it needs)."""
    return dict(
        {k: getattr(args, k) for k in SHAPE},
        tie=not args.no_tie,
        bias=not args.no_bias,
        vocab_size=data["vocab_size"],
        eos_id=data["eos_id"],
    )
