"""Train a nanogen model: flags and recipes, then set-up (data, model, DDP, resume), then the loop.

python train.py --model lstm --head nmst --dataset wikitext2        # NMST Table 1's LSTM
python train.py --init_from gpt2 --head nmst --dataset wikitext103   # GPT-2 finetuning
python train.py --model lstm --task stream --head ctmos --dataset ptb   # CT paper
python train.py --model insnet --dataset rocstories --task storyline    # InsNet
torchrun --nproc_per_node=4 train.py --head nmst --dataset wikitext103  # (... --resume: go on)
"""

import argparse
import atexit
import dataclasses
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 (now: DDP importing it later pins the group at exit)
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import curves
from common import (
    FRACTION,
    INT0,
    INT1,
    NONNEG,
    POS,
    SEED,
    Parser,
    UserError,
    all_sum,
    autocast,
    check_vocab,
    compile_model,
    copy_checkpoint,
    get_device,
    load_checkpoint,
    lock_folder,
    number,
    peak_flops,
    release_folder,
    run,
    save_checkpoint,
    world,
)
from data import gpt2_weights
from data.loader import check_fits, epoch_batches, load_data, targets_per_batch
from data.prepare import DATASETS, VOCABS
from evaluate import get_batch, perplexity, probe, score, scored
from heads import HEADS, TERMINATION_HEADS, loss_scale
from insnet import INSERTION
from model import MODELS, WINDOWED, LanguageModel, gpt_state_from_hf

# ----- flags: their defaults, the --model's recipe over them (NMST paper section 4 and app. D;
# InsNet paper section 4.3; gcnn and gpt from scratch: nanogen's), what you type over both -------
STORY_DATASETS = ("rocstories", "synthetic")
GPT2_SIZES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}  # (n_layer, n_head, d_model); V = 50257, 1024 positions
# Each --model's recipe: the flags it sets, under what you type (NMST paper section 4 and app. D;
# InsNet paper section 4.3; gcnn and gpt from scratch: nanogen's).
RECIPES = {
    "rnn": {
        "n_layer": 2,
        "d_model": 256,
        "dropout": 0.3,
        "lr": 1e-3,
        "lr_schedule": "plateau",
        "batch_size": 32,
        "max_iters": 0,
        "eval_interval": 0,
        "weight_decay": 0.01,
        "decay_steps": 500_000,
        "warmup": 0,
    },
    "lstm": {
        "n_layer": 2,
        "d_model": 512,
        "dropout": 0.5,
        "lr": 1e-3,
        "lr_schedule": "plateau",
        "batch_size": 32,
        "max_iters": 0,
        "eval_interval": 0,
        "weight_decay": 0.01,
        "decay_steps": 500_000,
        "warmup": 0,
    },
    "gcnn": {
        "n_layer": 8,
        "d_model": 512,
        "dropout": 0.1,
        "lr": 1e-3,
        "lr_schedule": "plateau",
        "batch_size": 32,
        "max_iters": 0,
        "eval_interval": 0,
        "weight_decay": 0.01,
        "decay_steps": 500_000,
        "warmup": 0,
    },
    # nanoGPT's
    "gpt": {
        "n_layer": 12,
        "d_model": 768,
        "dropout": 0.1,
        "lr": 6e-4,
        "lr_schedule": "linear",
        "max_tokens": 1024,
        "max_iters": 300_000,
        "eval_interval": 2000,
        "weight_decay": 0.01,
        "decay_steps": 300_000,
        "warmup": 2000,
    },
    # --init_from gpt2...: NMST section 4.2
    "gpt_finetune": {
        "n_layer": 12,
        "d_model": 768,
        "dropout": 0.1,
        "lr": 5e-5,
        "lr_schedule": "linear",
        "max_tokens": 1024,
        "max_iters": 300_000,
        "eval_interval": 2000,
        "weight_decay": 0.01,
        "decay_steps": 500_000,
        "warmup": 0,
    },
    # every model on the story data
    "story": {
        "n_layer": 12,
        "d_model": 768,
        "dropout": 0.1,
        "lr": 1e-4,
        "lr_schedule": "linear",
        "batch_size": 64,
        "max_iters": 80_000,
        "eval_interval": 1000,
        "weight_decay": 0.02,
        "decay_steps": 80_000,
        "warmup": 400,
    },
}
# --protocol authors: the settings of the NMST authors' src/wiki2 (train.py, utils.py) that differ
# from the rnn / lstm recipe. Its sequences, batches, context loss, N(0, 1) embeddings, no dropout
# between the layers and weight decay on every parameter are in data/ and model.py.
AUTHORS = {"beta2": 0.999, "batch_size": 32, "lr": 1e-3, "max_epochs": 70, "patience": 10}


class Help(argparse.HelpFormatter):
    """--help: each flag's help ends with its default (DEFAULTS), or says that the --model recipe
    sets it."""

    def _get_help_string(self, action):
        default = DEFAULTS.get(action.dest)
        if default is not None:
            return f"{action.help} (default: {default})"
        if any(action.dest in recipe for recipe in RECIPES.values()):
            return f"{action.help} (default: the --model recipe)"
        return action.help


def parser():
    """train.py's flags, one a line (the parser's defaults are DEFAULTS)."""
    p = Parser(description="Train a nanogen model.", formatter_class=Help)
    # --- what is trained: the model, its output head, the task
    p.add_argument(
        "--model",
        default="gpt",
        choices=(*MODELS, *INSERTION),
        help="insnet, insertion_transformer: insnet.py",
    )
    p.add_argument(
        "--head",
        default="softmax",
        choices=HEADS,
        help="softmax (VA, NMST eq. 2), st (eq. 9), nmst (eq. 10), mos, ct, ctmos (CT eq. 4, 6, 7)",
    )
    p.add_argument(
        "--task",
        choices=("completion", "stream", "story", "storyline"),
        help="completion (NMST), stream (CT), story / storyline (InsNet); None: by the dataset",
    )
    p.add_argument(
        "--epsilon",
        default=1e-5,
        type=number(float, lambda v: 0 < v < 1, "in (0, 1)"),
        help="ST / NMST",
    )
    # --- the data
    p.add_argument(
        "--dataset",
        default="wikitext103",
        choices=(*DATASETS, *STORY_DATASETS),
        help="text: your own, in --data_dir",
    )
    p.add_argument(
        "--protocol",
        default="paper",
        choices=("paper", "authors"),
        help="paper: the NMST paper's text; authors: the code that made its Table 1 (README)",
    )
    p.add_argument(
        "--vocab",
        default="word",
        choices=VOCABS,
        help="wikitext2, ptb, text: word or char; text: bpe (GPT-2's) too",
    )
    p.add_argument(
        "--data_dir", type=os.path.abspath, help="local data (None: $NANOGEN_DATA, else download)"
    )
    # --- the run: where it writes, where it starts from, where it runs
    p.add_argument("--out_dir", help="None: out/DATASET-MODEL-HEAD")
    p.add_argument("--seed", default=0, type=SEED, help="the random seed")
    p.add_argument(
        "--init_from",
        default="scratch",
        choices=("scratch", *GPT2_SIZES),
        help="GPT-2's weights (and shape)",
    )
    p.add_argument("--weights", help="--init_from's, a local copy")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="autocast on CUDA (auto: bfloat16 where native)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile")
    p.add_argument("--peak_flops", type=POS, help="for MFU")
    p.add_argument("--resume", action="store_true", help="from out_dir/ckpt_last.pt")
    # --- the model's shape
    p.add_argument("--n_layer", type=INT1, help="layers")
    p.add_argument("--d_model", type=INT1, help="the width")
    p.add_argument("--n_head", default=12, type=INT1, help="gpt: attention heads")
    p.add_argument("--block_size", default=1024, type=INT1, help="GPT / GCNN window, story canvas")
    p.add_argument("--dropout", type=FRACTION, help="the dropout rate")
    p.add_argument("--kernel_size", default=4, type=INT1, help="gcnn")
    p.add_argument("--no_tie", action="store_true", help="untie the input and output embeddings")
    p.add_argument("--no_bias", action="store_true", help="gpt")
    p.add_argument("--n_experts", default=4, type=INT1, help="mos / ctmos: K")
    p.add_argument("--ct_alpha", default=1.0, type=NONNEG, help="CT eq. 6")
    p.add_argument("--ct_beta", default=0.5, type=POS, help="CT eq. 6")
    p.add_argument("--ct_rank", default=0, type=INT0, help="ct: rank of W_tau (0: full)")
    p.add_argument("--temperature", default=1.0, type=POS, help="softmax / mos: a constant one")
    p.add_argument("--max_offset", default=256, type=INT1, help="insnet")
    p.add_argument("--locked_dropout", action="store_true", help="rnn / lstm: a mask per sequence")
    p.add_argument("--order", default="random", choices=("random", "l2r"), help="insertion order")
    p.add_argument("--min_count", default=2, type=INT1, help="rocstories: rarer words are <unk>")
    p.add_argument(
        "--synthetic_count", default=200, type=INT1, help="synthetic: sequences a length"
    )
    # --- optimization
    p.add_argument("--lr", type=POS, help="the peak learning rate")
    p.add_argument("--warmup", type=INT0, help="linear: steps up to --lr")
    p.add_argument("--max_epochs", default=70, type=INT1, help="epochs at most")
    p.add_argument("--beta1", default=0.9, type=FRACTION, help="AdamW")
    p.add_argument("--beta2", default=0.99, type=FRACTION, help="AdamW")
    p.add_argument("--weight_decay", type=NONNEG, help="AdamW")
    p.add_argument("--grad_clip", default=1.0, type=NONNEG, help="0: off")
    p.add_argument(
        "--lr_schedule",
        choices=("plateau", "linear", "constant"),
        help="plateau: x --lr_decay if an evaluation does not improve; linear: 0 at --decay_steps",
    )
    p.add_argument("--decay_steps", type=INT1, help="linear: the step the rate reaches 0")
    p.add_argument(
        "--lr_decay",
        default=0.5,
        type=number(float, lambda v: 0 < v <= 1, "in (0, 1]"),
        help="plateau: the factor",
    )
    p.add_argument("--patience", default=10, type=INT1, help="evaluations without improvement")
    p.add_argument("--batch_size", type=INT1, help="sequences a batch")
    p.add_argument("--max_tokens", type=INT1, help="padded tokens a batch")
    p.add_argument("--bptt", default=70, type=INT1, help="stream: its window")
    p.add_argument("--loss_scaling", action="store_true", help="CT eq. 8's LS")
    p.add_argument("--ar", default=0.0, type=NONNEG, help="rnn / lstm: CT eq. 8")
    p.add_argument("--tar", default=0.0, type=NONNEG, help="rnn / lstm: CT eq. 8")
    p.add_argument(
        "--grad_accum", type=INT1, help="batches a step over all processes (None: one a process)"
    )
    # --- when to stop, evaluate and log
    p.add_argument("--max_iters", type=INT0, help="0: none")
    p.add_argument("--max_minutes", default=0.0, type=NONNEG, help="0: none")
    p.add_argument(
        "--whole_epochs", action="store_true", help="--max_minutes stops at an epoch's end"
    )
    p.add_argument("--eval_interval", type=INT0, help="0: at epoch ends")
    p.add_argument(
        "--log_interval", default=10, type=INT1, help="steps between loss reads / stop checks"
    )
    p.add_argument("--train_seqs", default=0, type=INT0, help="0: all")
    p.add_argument("--eval_seqs", default=0, type=INT0, help="validate on the first N (0: all)")
    p.add_argument(
        "--probe",
        default=64,
        type=INT0,
        help="termination probe: greedy-decode N validation contexts (0: off)",
    )
    p.add_argument("--probe_L", default=200, type=INT1, help="the probe's L")
    p.add_argument("--no_curves", action="store_true", help="no OUT_DIR/curves.png")
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also OUT_DIR/tensorboard (pip install tensorboard)",
    )
    return p


# The defaults of every flag; a recipe goes over them (get_args).
DEFAULTS = vars(parser().parse_args([]))


def typed_flags(argv):
    """-> {flag: value} of the flags typed on the command line (the parser's defaults set to None
    first, so whatever is not None was typed)."""
    p = parser()
    p.set_defaults(**dict.fromkeys(DEFAULTS))
    return {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}


def get_args(argv=None):
    """-> (args, the checkpoint to resume or None): DEFAULTS, the --model recipe over them, the
    flags you typed over both; --resume: the checkpoint's arguments, the typed flags over them."""
    typed = typed_flags(argv)
    a = {**DEFAULTS, **typed}
    story = a["dataset"] in STORY_DATASETS or a["model"] in INSERTION
    recipe = RECIPES[recipe_name(a, story)]
    if a["protocol"] == "authors":
        recipe = {**recipe, **AUTHORS}
    # A recipe's batching yields to yours: --batch_size or --max_tokens typed drops both of its.
    if {"batch_size", "max_tokens"} & set(typed):
        recipe = {k: v for k, v in recipe.items() if k not in ("batch_size", "max_tokens")}
    a = {**DEFAULTS, **recipe, **typed}
    if a["init_from"] != "scratch":
        a.update(gpt2_shape(a["init_from"], typed))
    if not a["task"]:
        a["task"] = "story" if story else "completion"
    # GPT and GCNN read a window of positions; the recurrent models read any length.
    a["window"] = a["block_size"] if a["model"] in WINDOWED else None
    a["grad_accum"] = a["grad_accum"] or world()[1]
    a["out_dir"] = a["out_dir"] or os.path.join("out", run_name(a))
    ckpt = None
    if a["resume"]:
        ckpt = resume_checkpoint(a["out_dir"])
        check_resume_flags(typed, ckpt["args"], a["out_dir"])
        a = {**ckpt["args"], **typed, "out_dir": a["out_dir"]}
        if a["data_dir"] and not os.path.isdir(a["data_dir"]):
            raise UserError(
                f"the run's --data_dir {a['data_dir']} is not there (moved?): give "
                f"--data_dir DIR where its data is now"
            )
    check_args(argparse.Namespace(**a))
    return argparse.Namespace(**a), ckpt


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


RESUME_MAY_CHANGE = (
    "out_dir",
    "resume",
    "data_dir",
    "device",
    "dtype",
    "compile",
    "peak_flops",
    "max_iters",
    "max_epochs",
    "max_minutes",
    "whole_epochs",
    "patience",
    "log_interval",
    "probe",
    "probe_L",
    "no_curves",
    "tensorboard",
)  # where, how and how long a resumed run goes on; it computes what it did


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
    """The flags of one head or one model, the batching, torchrun."""
    story = a.dataset in STORY_DATASETS
    insertion = a.model in INSERTION
    recurrent = a.model in ("rnn", "lstm")
    procs = world()[1]
    # Flags of one head or one model
    if a.loss_scaling and a.head not in ("ct", "ctmos"):
        raise UserError("--loss_scaling needs --head ct or ctmos (CT eq. 8)")
    if (a.ar or a.tar or a.locked_dropout) and not recurrent:
        raise UserError("--ar / --tar / --locked_dropout are for --model rnn or lstm")
    if a.temperature != 1 and a.head not in ("softmax", "mos"):
        raise UserError(
            f"a constant --temperature is the baseline of the softmax / mos heads, not of {a.head}"
        )
    # Batching and shape
    if a.max_tokens and (a.batch_size or story):
        raise UserError(
            "give --batch_size (sequences a batch) or "
            "--max_tokens (tokens a batch), not both; stories: --batch_size"
        )
    if a.model in ("gpt", *INSERTION) and a.d_model % a.n_head:
        raise UserError(f"--d_model {a.d_model} must be divisible by --n_head {a.n_head}")
    if a.order != "random" and not insertion:
        raise UserError("--order is for insnet, insertion_transformer")
    if a.protocol == "authors" and (not recurrent or a.max_tokens):
        raise UserError(
            "--protocol authors is the authors' rnn / lstm code: --model rnn or lstm, --batch_size"
        )
    # torchrun
    if procs > 1 and (a.task == "stream" or a.grad_accum % procs):
        raise UserError(
            f"under torchrun "
            f"--grad_accum ({a.grad_accum}) is a multiple of the {procs} processes, no stream"
        )


SHAPE = (
    "model",
    "head",
    "epsilon",
    "n_layer",
    "d_model",
    "n_head",
    "block_size",
    "dropout",
    "kernel_size",
    "locked_dropout",
    "n_experts",
    "ct_alpha",
    "ct_beta",
    "ct_rank",
    "temperature",
    "max_offset",
    "protocol",
    "no_tie",
    "no_bias",
)  # the flags of a model's shape


def model_config(args, data):
    """The architecture, the plain dict a checkpoint keeps (model.py reads what it needs)."""
    return dict(
        {k: getattr(args, k) for k in SHAPE[:-2]},
        tie=not args.no_tie,
        bias=not args.no_bias,
        vocab_size=data["vocab_size"],
        eos_id=data["eos_id"],
    )


# ----- the run: set-up (data, model, DDP, resume), then the loop ------------------------------
STOP = []  # the signals that asked this process to stop (on_signal appends, at any moment)


@dataclasses.dataclass
class Counters:
    """Where the run is: what a checkpoint keeps (its "state") to go on from."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # the epoch's steps done
    best_val: float = math.inf
    bad_evals: int = 0  # evaluations since the best one
    lr: float = 0.0
    elapsed: float = 0.0  # seconds of training, over every resume
    # A run stopped by a signal keeps the signal (reproduce.py reads it) and the sums of its
    # interval since the last evaluation (all processes'), for the next evaluation's train loss.
    stopped: str | None = None
    since: dict | None = None


@dataclasses.dataclass
class Run:
    """What the loop works with, made once by build."""

    args: argparse.Namespace
    model: torch.nn.Module  # what the step calls: compiled and DDP-wrapped, if so
    raw: torch.nn.Module  # the model itself: its weights, its cfg, its parameters to clip
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # float16's loss scaler (off otherwise)
    ctx: object  # autocast, or a null context
    data: dict
    device: str


def on_signal(signum, frame):
    """Ctrl-C, SIGTERM: the step finishes, ckpt_last.pt is written (its state "stopped" by the
    signal), the run exits 0."""
    if STOP and signum == signal.SIGINT and not dist.is_initialized():
        raise KeyboardInterrupt  # Ctrl-C twice: abort now
    if signum == signal.SIGINT:
        STOP.append("Ctrl-C")
    else:
        STOP.append(signal.Signals(signum).name)
    print(f"\n{STOP[-1]}: finishing this step and writing a checkpoint", file=sys.stderr)


def main(argv=None):
    args, ckpt = get_args(argv)
    curves.check_out_dir(args.out_dir, args.tensorboard, args.resume)
    # DDP: torchrun's environment says this process's rank and the number of processes.
    rank, procs = world()
    local_rank = None
    if procs > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
    device = get_device(args.device, local_rank)
    if procs > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        # The group goes on every way out, after the DDP model went.
        atexit.register(dist.destroy_process_group)
    # Seeded before the model is built: its initial weights.
    torch.manual_seed(args.seed + rank)
    hf = None
    if not ckpt and args.init_from != "scratch":
        hf = gpt2_weights(args.init_from, args.weights)
    # Rank 0 prepares the data (a download, a build), then the other processes read it.
    data = None
    if rank == 0:
        data = load_data(args)
    if procs > 1:
        dist.barrier()
        data = data or load_data(args, verbose=False)
    data["targets_per_batch"] = targets_per_batch(args, data)
    run, st = build(args, ckpt, data, hf, device)
    # A run owns its folder while it runs: a second train.py into it is refused in one line
    # (here, before the first write, so that an error above leaves no folder behind).
    lock_folder(args.out_dir)
    if rank == 0:
        curves.start_logs(args.out_dir, vars(args), st.step if args.resume else 0)
    STOP.clear()
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    hidden = None
    if ckpt:
        hidden = ckpt["hidden"]
    try:
        why = limit_reached(args, st)
        if why:
            print(f"{args.out_dir}: this run already finished ({why}); raise the limit to go on")
        else:
            train(run, st, hidden)
    finally:
        release_folder(args.out_dir)
        # The handlers are put back, but for a stopped run, or under torchrun: there a second
        # signal as the process leaves is no kill.
        if not (STOP or dist.is_initialized()):
            for s, handler in handlers.items():
                signal.signal(s, handler)


def build(args, ckpt, data, weights, device):
    """The model (new, GPT-2's, the checkpoint's), AdamW, the float16 scaler, autocast, counters.
    -> (Run, Counters)."""
    cfg = model_config(args, data)
    rank, procs = world()
    if ckpt:  # --resume: the checkpoint's vocabulary (its shape: get_args)
        check_vocab(ckpt, data, f"{args.out_dir}/ckpt_last.pt")
    check_fits(args, data)
    # InsNet, IT-vanilla, or a backbone and a head
    model = INSERTION.get(cfg["model"], LanguageModel)(cfg)
    if weights:  # (weights that do not fit: a UserError)
        model.load_state_dict(gpt_state_from_hf(weights, model))
    params = list(model.to(device).parameters())
    # Weight decay on the matrices, not on biases and norms (the authors' protocol: on every one).
    decay_all = args.protocol == "authors"
    decayed = [p for p in params if p.dim() >= 2 or decay_all]
    not_decayed = [p for p in params if p.dim() < 2 and not decay_all]
    optimizer = torch.optim.AdamW(
        [
            dict(params=decayed, weight_decay=args.weight_decay),
            dict(params=not_decayed, weight_decay=0.0),
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=True,
    )
    ctx = autocast(device, args.dtype)
    float16 = getattr(ctx, "fast_dtype", 0) == torch.float16
    scaler = torch.amp.GradScaler(device[:4], enabled=float16)
    st = Counters(lr=args.lr)
    if ckpt:
        # The checkpoint's model, optimizer, counters, scaler, and this process's RNG.
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        st = Counters(**ckpt["state"])
        restore_rng(args, ckpt["rng"], st.step)
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
    if rank == 0:
        resumed_at = st.step if ckpt else None
        print(run_line(args, model, data, device, ctx, resumed_at), flush=True)
    if args.compile:
        # CUDA graphs capture one (B, T) each: for one batch a step, in few shapes.
        one_batch = args.grad_accum == procs
        few_shapes = args.task == "stream" or bool(args.max_tokens)
        graphs = device.startswith("cuda") and one_batch and few_shapes
        model = compile_model(model, graphs=graphs)
    if dist.is_initialized():
        model = DDP(model, device_ids=[device] if device.startswith("cuda") else None)
    return Run(args, model, unwrapped(model), optimizer, scaler, ctx, data, device), st


def unwrapped(model):
    """The model itself, under DDP's and torch.compile's wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def restore_rng(args, rng, step):
    """This process's RNG state from the checkpoint; one saved by another number of processes: a
    fresh generator, from seed, rank and step."""
    rank, procs = world()
    if len(rng) != procs:
        torch.manual_seed(((args.seed * 1_000_003 + rank) * 1_000_003 + step) % 2**63)
        return
    torch.set_rng_state(rng[rank]["cpu"])
    if rng[rank]["cuda"] is not None:
        torch.cuda.set_rng_state(rng[rank]["cuda"])


def run_line(args, model, data, device, ctx, resumed_at):
    """The run's first line: what trains on what, its size, where (resumed_at: a step, or None)."""
    what = args.head if args.model in MODELS else args.task
    line = (
        f"{args.model} + {what} on {args.dataset}: {model.num_params():,} parameters, "
        f"V={data['vocab_size']:,}, {device}"
    )
    if hasattr(ctx, "fast_dtype"):
        line += f", {str(ctx.fast_dtype)[6:]} autocast"
    if resumed_at is not None:
        line += f", resuming at step {resumed_at}"
    if data.get("note"):
        line += f"; {data['note']}"
    return line


def train(run, st, hidden):
    """The loop: lr -> micro-batches, each scored by one call of the model (NMST eq. 3) -> clip ->
    step; every --log_interval steps the losses are read and the processes agree on stopping."""
    args, data, device = run.args, run.data, run.device
    model, raw, optimizer, scaler = run.model, run.raw, run.optimizer, run.scaler
    rank, procs = world()
    # --grad_accum counts the batches of a step over all processes: accum of them each.
    accum = args.grad_accum // procs
    # CT eq. 8's loss scaling LS (1: none)
    ls = 1.0
    if args.loss_scaling:
        ls = loss_scale(data["vocab_size"], args.ct_alpha, args.ct_beta)
    # The clock goes on from the checkpoint's.
    t0 = time.time() - st.elapsed
    # The steps whose losses are not read yet: (step, lr, the loss on the device).
    pending = []
    # The sums since the last evaluation, for its train loss and tokens/s (nll: on the device).
    since = dict(nll=0.0, n=0, tokens=0, t0=time.time())
    resume_state(st, since)
    hidden = to(hidden, device)
    why = None
    stop = None
    # What score() computes for this run's batches (insertion events, stream tokens, targets).
    kind = scored(args)
    while not (why or stop):
        keys = epoch_batches(args, data, st.epoch)
        # (the last len(keys) % grad_accum batches of an epoch are skipped)
        n_steps = len(keys) // args.grad_accum
        steps = tqdm(
            range(st.batch_in_epoch, n_steps),
            f"epoch {st.epoch}",
            n_steps,
            leave=False,
            initial=st.batch_in_epoch,
            disable=True if rank else None,
        )
        for s in steps:
            # ---- the step ----
            # Set this step's learning rate.
            st.lr = learning_rate(args, st)
            for group in optimizer.param_groups:
                group["lr"] = st.lr
            # Forward and backward this process's micro-batches; their gradients add up.
            step_loss = 0.0
            for j in range(accum):
                batch = get_batch(args, data, keys[s * args.grad_accum + rank * accum + j], device)
                if procs > 1:
                    # In DDP training only the last micro-batch's backward needs to all-reduce
                    # the gradients. The official way is the model.no_sync() context manager;
                    # it only toggles this flag (as nanoGPT does).
                    model.require_backward_grad_sync = j == accum - 1
                if batch.get("start") == 0:
                    # Each epoch starts the streams afresh.
                    hidden = None
                with run.ctx:
                    # One call of the model: log p of the targets, the mask of those that count.
                    log_p, mask, hidden = score(model, batch, kind, hidden)
                    # -log p of the batch's predicted tokens, summed
                    nll = -torch.where(mask, log_p, 0.0).sum()
                    # NMST eq. 3, the mean over every target of the data: the sum divided by the
                    # epoch's mean count a batch, the same for every batch, so that each token
                    # weighs alike whatever the length of its batch's lines (CT eq. 8: x LS).
                    loss = nll / data["targets_per_batch"] * ls
                    if args.ar or args.tar:
                        # CT eq. 8's activation regularisation of a recurrent backbone
                        loss = loss + raw.backbone.activation_regularisation(args.ar, args.tar)
                # The loss is divided by accum: the accumulated gradient is the mean of the
                # micro-batches'. (The scaler does nothing but in float16.)
                scaler.scale(loss / accum).backward()
                # Truncated BPTT: the next window's gradient does not reach into this one.
                hidden = to(hidden, device, detach=True)
                # What is logged: the batch's own mean -log p a token.
                step_loss += nll.detach() / batch["n"] / accum
                since["nll"] += nll.detach().double()
                since["n"] += batch["n"]
                since["tokens"] += batch["n_inputs"]
            # Clip the gradient (unscaled first, in float16), then step.
            scaler.unscale_(optimizer)
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            # Flush the gradients as soon as we can: their memory is not needed any more.
            optimizer.zero_grad(set_to_none=True)
            # ---- bookkeeping: count, log, stop, evaluate, checkpoint ----
            st.step += 1
            st.batch_in_epoch = s + 1
            st.elapsed = time.time() - t0
            pending.append((st.step, st.lr, step_loss))
            stop, why = after_step(run, st, hidden, pending, since)
            if why or stop:
                break
        else:
            # The epoch's end.
            st.epoch += 1
            st.batch_in_epoch = 0
            why = after_epoch(run, st, hidden, pending, since)
    if stop:
        # A signal stopped the run: the losses logged, the interval's sums kept, ckpt_last.pt.
        sync(args, pending, device, st)
        stop_state(st, since, stop, device)
        save(run, st, hidden)
    say_how_it_ended(args, st, stop, why)


def after_step(run, st, hidden, pending, since):
    """The bookkeeping of a step: every --log_interval steps the pending losses are read and the
    processes agree on stopping; at --eval_interval, or at a limit, an evaluation.
    -> (the signal that stops the run, or None; why the run stops, or None)."""
    args = run.args
    stop = None
    # (under torchrun the processes decide together, in sync)
    if STOP and world()[1] == 1:
        stop = STOP[0]
    why = None
    if st.step % args.log_interval == 0:
        synced = sync(args, pending, run.device, st)
        if synced:
            stop, why = synced
    if not why:
        why = limit_reached(args, st)
    if (args.eval_interval and st.step % args.eval_interval == 0) or why:
        why = validate(run, st, hidden, pending, since) or why
    return stop, why


def after_epoch(run, st, hidden, pending, since):
    """The bookkeeping of an epoch's end: without --eval_interval an evaluation; with it, one if
    the run stops here.  -> why the run stops, or None."""
    if not run.args.eval_interval:
        return validate(run, st, hidden, pending, since)
    why = limit_reached(run.args, st)
    if why:
        return validate(run, st, hidden, pending, since) or why
    return None


def say_how_it_ended(args, st, stop, why):
    if world()[0] != 0:
        return
    if stop:
        print(
            f"stopped by {stop} after step {st.step}; {args.out_dir}/ckpt_last.pt written: "
            f"the same command with --resume goes on"
        )
        return
    ppl = math.exp(min(st.best_val, 700))
    print(
        f"done ({why}) after {st.step} steps; best validation loss {st.best_val:.4f} (ppl "
        f"{ppl:.2f}); checkpoints in {args.out_dir}"
    )


def validate(run, st, hidden, pending, since):
    """Evaluate, log, probe, lower a plateau lr, checkpoint; -> why the run stops now, or None."""
    args, raw, data, device = run.args, run.raw, run.data, run.device
    # Under torchrun the processes' clocks are read together here: --whole_epochs' stop.
    synced = sync(args, pending, device, st)
    late = synced[1] if synced else None
    nll, n, tokens = all_sum([float(since["nll"]), since["n"], since["tokens"]], device)
    tok_per_s = tokens / max(time.time() - since["t0"], 1e-9)
    with run.ctx:
        val = perplexity(args, raw, data, "valid", device=device)
    if not math.isfinite(val["nll"]):
        raise UserError(
            f"non-finite validation loss at step {st.step}; stopping (try a lower "
            f"--lr): ckpt_last.pt, if any, holds the last evaluation's weights"
        )
    # The best loss, the evaluations since it, and a plateau lr lowered when it did not improve
    improved = val["nll"] < st.best_val
    st.best_val = min(st.best_val, val["nll"])
    if improved:
        st.bad_evals = 0
    else:
        st.bad_evals += 1
    if not improved and args.lr_schedule == "plateau":
        st.lr *= args.lr_decay
    mfu = tok_per_s * mfu_per_token(args, raw, data, device)
    rec = dict(
        step=st.step,
        epoch=st.epoch,
        train_loss=nll / max(n, 1),
        val_loss=val["nll"],
        val_ppl=val["ppl"],
        lr=st.lr,
        tokens_per_s=tok_per_s,
        mfu=mfu or None,
        best=improved,
        elapsed_s=st.elapsed,
        **{k: v for k, v in val.items() if k in ("eos_prob_at_end", "nll_per_story")},
    )
    if world()[0] == 0:
        print(evaluation_line(rec, improved), flush=True)
        if args.probe and args.task == "completion":
            rec.update(probe(args, raw, data))
        curves.log_evaluation(args.out_dir, rec, args.tensorboard, not args.no_curves)
    save(run, st, hidden, best=improved)
    # (tok/s: counted after the writing)
    since.update(nll=0.0, n=0, tokens=0, t0=time.time())
    # (an early stop, say)
    return limit_reached(args, st) or late


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


def sync(args, pending, device, st):
    """The pending steps' losses and the stop flags, in one collective and one read, into
    steps.jsonl; -> None, or (signal, time limit)."""
    rank, procs = world()
    late = args.max_minutes and st.elapsed >= 60 * args.max_minutes and at_a_stop(args, st)
    flags = torch.tensor([float(bool(STOP)), float(late)], device=device)
    values = flags
    if pending:
        values = torch.cat([torch.stack([p[2] for p in pending]).float(), flags])
    if procs > 1:
        dist.all_reduce(values)
    *losses, signalled, timed_out = values.tolist()
    records = [dict(step=step, loss=v / procs, lr=lr) for (step, lr, _), v in zip(pending, losses)]
    pending.clear()
    if rank == 0:
        curves.append(f"{args.out_dir}/steps.jsonl", *records)
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    if bad:
        hint = ""
        if args.head in TERMINATION_HEADS:
            hint = f"; are --head {args.head}'s values at t <= 0 finite?"
        raise UserError(
            f"non-finite training loss at step {bad[0]}; stopping (try a lower --lr{hint}): "
            f"ckpt_last.pt, if any, holds the last weights"
        )
    stop = None
    if signalled and STOP:
        stop = STOP[0]
    elif signalled:
        stop = "a signal to another process"
    late = None
    if timed_out:
        late = f"reached --max_minutes {args.max_minutes:g}"
    if stop or late:
        return stop, late
    return None


def save(run, st, hidden, best=False):
    """ckpt_last.pt (improved: ckpt_best.pt, then ckpt_last.pt its copy: a kill between the two
    leaves ckpt_last.pt the older): model, optimizer, counters, every process's RNG, arguments..."""
    model = run.raw
    own = dict(cpu=torch.get_rng_state(), cuda=None)
    if next(model.parameters()).is_cuda:
        own["cuda"] = torch.cuda.get_rng_state()
    rng = [own] * world()[1]
    if dist.is_initialized():
        dist.all_gather_object(rng, own)
    if world()[0] != 0:
        return
    last = f"{run.args.out_dir}/ckpt_last.pt"
    first = last
    if best:
        first = f"{run.args.out_dir}/ckpt_best.pt"
    scaler = None
    if run.scaler.is_enabled():
        scaler = run.scaler.state_dict()
    ckpt = dict(
        config=model.cfg,
        model=model.state_dict(),
        args=vars(run.args),
        optimizer=run.optimizer.state_dict(),
        state=dataclasses.asdict(st),
        rng=rng,
        vocab=run.data["vocab"],
        hidden=hidden,
        scaler=scaler,
    )
    save_checkpoint(ckpt, first)
    if best:
        copy_checkpoint(first, last)


def stop_state(st, since, stop, device):
    """A run stopped by a signal says so in its checkpoint's state ("stopped": what reproduce.py
    reads), and keeps its interval's sums since the last evaluation (all processes') for the next
    evaluation's train loss."""
    nll, n = all_sum([float(since["nll"]), since["n"]], device)
    st.stopped = stop
    st.since = dict(nll=nll, n=n)


def resume_state(st, since):
    """A resumed run is no longer stopped, and goes on with the interval's sums it kept (rank 0
    alone: they are every process's)."""
    kept = st.since or {}
    st.stopped = None
    st.since = None
    if world()[0] == 0:
        since.update(kept)


def to(state, device, detach=False):
    """A recurrent state (a tensor, a tuple of them, or None) on device.  detach: a detached copy
    (a CUDA graph's next replay reuses its outputs)."""
    if isinstance(state, tuple):
        return tuple(to(s, device, detach) for s in state)
    if state is None:
        return None
    if detach:
        state = state.detach().clone()
    return state.to(device)


def limit_reached(args, st):
    """-> why the run stops now, or None (--max_minutes under torchrun: decided in sync).  st: the
    Counters, or a checkpoint's dict of them (reproduce.py reads a checkpoint)."""
    if isinstance(st, dict):
        st = Counters(**st)
    if args.max_iters and st.step >= args.max_iters:
        return f"reached --max_iters {args.max_iters}"
    if st.epoch >= args.max_epochs:
        return f"reached --max_epochs {args.max_epochs}"
    late = args.max_minutes and st.elapsed >= 60 * args.max_minutes
    if late and at_a_stop(args, st) and not dist.is_initialized():
        return f"reached --max_minutes {args.max_minutes:g}"
    if st.bad_evals >= args.patience:
        return f"early stop: no improvement in {args.patience} evaluations"
    return None


def at_a_stop(args, st):
    """Where --max_minutes may stop a run: after any step; with --whole_epochs only at an epoch's
    end (so that no evaluation of half an epoch lowers a plateau lr)."""
    return not args.whole_epochs or st.batch_in_epoch == 0


def learning_rate(args, st):
    """plateau / constant: the lr (plateau: lowered at evaluations); linear: warm-up, then to 0."""
    if args.lr_schedule != "linear":
        return st.lr
    warm = 1.0
    if args.warmup:
        warm = min(1.0, (st.step + 1) / args.warmup)
    return args.lr * warm * max(0.0, 1.0 - st.step / args.decay_steps)


def mfu_per_token(args, model, data, device):
    """MFU of one token/s: FLOPs a token at the mean length trained on / all processes' peak."""
    peak = args.peak_flops or peak_flops(device, args.dtype)
    if args.task == "completion":
        inputs = data["train"].lengths[: args.train_seqs or None] - 1
        length = float(np.mean(inputs[inputs <= (args.window or math.inf)]))
    elif args.task == "stream":
        length = args.bptt
    else:
        length = 0  # (stories: no MFU)
    if not (peak and length):
        return 0.0
    return model.flops_per_token(length) / (peak * world()[1])


if __name__ == "__main__":
    run(main)
