"""Train a nanogen model: flags and recipes, then set-up (data, model, DDP, resume), then the loop.

python train.py --model lstm --head nmst --dataset wikitext2        # NMST Table 1's LSTM
python train.py --init_from gpt2 --head nmst --dataset wikitext103   # GPT-2 finetuning
python train.py --model lstm --task stream --head ctmos --dataset ptb   # CT paper
python train.py --model insnet --dataset rocstories --task storyline    # InsNet
torchrun --nproc_per_node=4 train.py --head nmst --dataset wikitext103  # (... --resume: go on)
"""

import argparse
import atexit
import math
import os
import shutil
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
    get_device,
    load_checkpoint,
    number,
    peak_flops,
    run,
    save_checkpoint,
    world,
)
from data import gpt2_weights
from data.loader import check_fits, epoch_batches, load_data, targets_per_batch
from data.prepare import DATASETS, VOCABS
from evaluate import get_batch, perplexity, probe, score
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
RECURRENT = dict(
    n_layer=2,
    d_model=512,
    dropout=0.5,
    lr=1e-3,
    lr_schedule="plateau",
    batch_size=32,
    max_iters=0,
    eval_interval=0,
    weight_decay=0.01,
    decay_steps=500_000,
    warmup=0,
)
GPT = dict(
    n_layer=12,
    d_model=768,
    dropout=0.1,
    lr=6e-4,
    lr_schedule="linear",
    max_tokens=1024,
    max_iters=300_000,
    eval_interval=2000,
    weight_decay=0.01,
    decay_steps=300_000,
    warmup=2000,
)
RECIPES = {
    "rnn": dict(RECURRENT, d_model=256, dropout=0.3),
    "lstm": RECURRENT,
    "gcnn": dict(RECURRENT, n_layer=8, dropout=0.1),
    "gpt": GPT,  # nanoGPT's
    "gpt_finetune": dict(GPT, lr=5e-5, decay_steps=500_000, warmup=0),  # NMST section 4.2
    "story": dict(
        n_layer=12,
        d_model=768,
        dropout=0.1,
        lr=1e-4,
        lr_schedule="linear",
        batch_size=64,
        max_iters=80_000,
        eval_interval=1000,
        weight_decay=0.02,
        decay_steps=80_000,
        warmup=400,
    ),
}  # every model on the story data
# --protocol authors: the settings of the NMST authors' src/wiki2 (train.py, utils.py) that differ
# from the rnn / lstm recipe; its sequences, batches, context loss, N(0, 1) embeddings, no dropout
# between the layers and weight decay on every parameter are in data/ and model.py
AUTHORS = dict(beta2=0.999, batch_size=32, lr=1e-3, max_epochs=70, patience=10)


FLAGS = [  # (flag, default (None: a recipe's, or none), type (tuple: choices; bool: switch), help)
    ("model", "gpt", (*MODELS, *INSERTION), "insnet, insertion_transformer: insnet.py"),
    (
        "head",
        "softmax",
        HEADS,
        "softmax (VA, NMST eq. 2), st (eq. 9), nmst (eq. 10), mos, ct, "
        "ctmos (CT eq. 4, 6, 7: K*V floats a token, size the batch to fit)",
    ),
    (
        "task",
        None,
        ("completion", "stream", "story", "storyline"),
        "completion (NMST), stream "
        "(CT, rnn / lstm), story / storyline (InsNet); default: by the dataset",
    ),
    ("epsilon", 1e-5, number(float, lambda v: 0 < v < 1, "in (0, 1)"), "ST / NMST"),
    ("dataset", "wikitext103", (*DATASETS, *STORY_DATASETS), "text: your own, in --data_dir"),
    (
        "protocol",
        "paper",
        ("paper", "authors"),
        "paper: the NMST paper's text (lines of > 10 words, the continuation's loss); authors: "
        "the code that made its Table 1 (every line, <bos>, <cpad>, the context's loss too)",
    ),
    ("vocab", "word", VOCABS, "wikitext2, ptb, text: word or char; text: bpe (GPT-2's) too"),
    ("data_dir", None, os.path.abspath, "local data (default $NANOGEN_DATA, else download)"),
    ("out_dir", None, str, "default out/DATASET-MODEL-HEAD"),
    ("seed", 0, SEED, ""),
    ("init_from", "scratch", ("scratch", *GPT2_SIZES), "GPT-2's weights (and shape)"),
    ("weights", None, str, "--init_from's, a local copy"),
    ("device", "auto", str, "cpu, cuda:N"),
    (
        "dtype",
        "auto",
        ("auto", "float32", "bfloat16", "float16"),
        "autocast on CUDA (auto: bfloat16 where native, else float32)",
    ),
    ("compile", False, bool, "torch.compile"),
    ("peak_flops", None, POS, "for MFU"),
    ("resume", False, bool, "from out_dir/ckpt_last.pt"),
    ("n_layer", None, INT1, ""),
    ("d_model", None, INT1, ""),
    ("n_head", 12, INT1, ""),
    ("block_size", 1024, INT1, "GPT / GCNN window, story canvas"),
    ("dropout", None, FRACTION, ""),
    ("kernel_size", 4, INT1, "gcnn"),
    ("no_tie", False, bool, ""),
    ("no_bias", False, bool, "gpt"),
    ("n_experts", 4, INT1, "mos / ctmos: K"),
    ("ct_alpha", 1.0, NONNEG, "CT eq. 6"),
    ("ct_beta", 0.5, POS, "CT eq. 6"),
    ("ct_rank", 0, INT0, "ct: rank of W_tau (0: full)"),
    ("temperature", 1.0, POS, "softmax / mos: a constant one"),
    ("max_offset", 256, INT1, "insnet"),
    ("locked_dropout", False, bool, "rnn / lstm: a dropout mask per sequence (AWD-LSTM)"),
    ("order", "random", ("random", "l2r"), "insertion order"),
    ("lr", None, POS, ""),
    ("min_count", 2, INT1, "rocstories: rarer words are <unk>"),
    ("warmup", None, INT0, ""),
    ("synthetic_count", 200, INT1, "synthetic: sequences per length"),
    ("max_epochs", 70, INT1, ""),
    ("beta1", 0.9, FRACTION, ""),
    ("beta2", 0.99, FRACTION, ""),
    ("weight_decay", None, NONNEG, ""),
    ("grad_clip", 1.0, NONNEG, "0: off"),
    (
        "lr_schedule",
        None,
        ("plateau", "linear", "constant"),
        "plateau: x --lr_decay at an evaluation that does not improve; linear: up for --warmup "
        "steps, down to 0 at --decay_steps",
    ),
    ("decay_steps", None, INT1, ""),
    ("lr_decay", 0.5, number(float, lambda v: 0 < v <= 1, "in (0, 1]"), ""),
    ("patience", 10, INT1, "evaluations without improvement"),
    ("batch_size", None, INT1, ""),
    ("max_tokens", None, INT1, "padded tokens a batch"),
    ("bptt", 70, INT1, "stream: its window"),
    ("loss_scaling", False, bool, "CT eq. 8's LS"),
    ("ar", 0.0, NONNEG, "rnn / lstm: CT eq. 8"),
    ("tar", 0.0, NONNEG, "rnn / lstm: CT eq. 8"),
    ("max_iters", None, INT0, "0: none"),
    ("grad_accum", None, INT1, "batches a step over all processes (default: one a process)"),
    ("max_minutes", 0.0, NONNEG, "0: none"),
    ("whole_epochs", False, bool, "--max_minutes stops a run at an epoch's end, not mid-epoch"),
    ("eval_interval", None, INT0, "0: at epoch ends"),
    ("log_interval", 10, INT1, "steps between loss reads / stop checks"),
    ("train_seqs", 0, INT0, "0: all"),
    ("eval_seqs", 0, INT0, "validate on the first N (0: all)"),
    ("probe", 64, INT0, "termination probe: greedy-decode N validation contexts (0: off)"),
    ("probe_L", 200, INT1, "the probe's L"),
    ("no_curves", False, bool, "no OUT_DIR/curves.png"),
    ("tensorboard", False, bool, "also OUT_DIR/tensorboard (pip install tensorboard)"),
]
DEFAULTS = {flag: default for flag, default, _, _ in FLAGS}


def parser():
    p = Parser(description="Train a nanogen model.")
    for flag, default, kind, text in FLAGS:  # no default here: a flag you did not type is None
        text += (
            f" (default: {default})"
            if default is not None
            else (
                " (default: the --model recipe)" if any(flag in r for r in RECIPES.values()) else ""
            )
        )
        p.add_argument(
            f"--{flag}",
            help=text,
            **(
                dict(action="store_true", default=None)
                if kind is bool
                else dict(choices=kind)
                if isinstance(kind, tuple)
                else dict(type=kind)
            ),
        )
    return p


def get_args(argv=None):
    """-> (args, the checkpoint to resume or None): DEFAULTS, the --model recipe over them, the
    flags you typed over both; --resume: the checkpoint's arguments, the typed flags over them."""
    typed = {k: v for k, v in vars(parser().parse_args(argv)).items() if v is not None}
    a = {**DEFAULTS, **typed}
    story = a["dataset"] in STORY_DATASETS or a["model"] in INSERTION
    recipe = RECIPES[
        "story" if story else "gpt_finetune" if a["init_from"] != "scratch" else a["model"]
    ]
    if a["protocol"] == "authors":
        recipe = {**recipe, **AUTHORS}
    batching = ("batch_size", "max_tokens")  # a recipe's batching yields to yours
    a = {
        **DEFAULTS,
        **{k: v for k, v in recipe.items() if not set(batching) & set(typed) or k not in batching},
        **typed,
    }
    if a["init_from"] != "scratch":  # GPT-2's shape
        shape = dict(
            zip(("n_layer", "n_head", "d_model"), GPT2_SIZES[a["init_from"]]),
            block_size=1024,
            no_bias=False,
            no_tie=False,
        )
        for k in (k for k, v in shape.items() if typed.get(k, v) != v):
            raise UserError(f"--init_from {a['init_from']} has --{k} {shape[k]}: drop --{k}")
        a.update(shape)
    a["task"] = a["task"] or ("story" if story else "completion")
    a["window"] = a["block_size"] if a["model"] in WINDOWED else None  # (GPT, GCNN's positions)
    a["grad_accum"] = a["grad_accum"] or world()[1]
    a["out_dir"], ckpt = a["out_dir"] or os.path.join("out", run_name(a)), None
    if a["resume"]:
        if not os.path.exists(path := os.path.join(a["out_dir"], "ckpt_last.pt")):
            raise UserError(f"--resume: no checkpoint in {a['out_dir']}; start without --resume")
        ckpt = load_checkpoint(path)
        if not (
            {"optimizer", "rng", "scaler", "hidden"} <= set(ckpt) and "elapsed" in ckpt["state"]
        ):
            raise UserError(f"{path} holds no training state to resume (not train.py's)")
        check_resume_flags(typed, ckpt["args"], a["out_dir"])
        a = {**ckpt["args"], **typed, "out_dir": a["out_dir"]}
        if a["data_dir"] and not os.path.isdir(a["data_dir"]):
            raise UserError(
                f"the run's --data_dir {a['data_dir']} is not there (moved?): give "
                f"--data_dir DIR where its data is now"
            )
    check_args(argparse.Namespace(**a))
    return argparse.Namespace(**a), ckpt


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
    story, insertion, procs = a.dataset in STORY_DATASETS, a.model in INSERTION, world()[1]
    bpe = a.dataset == "wikitext103" or (a.dataset, a.vocab) == ("text", "bpe")
    for wrong, message in [
        (insertion and not story, f"--model {a.model} trains on rocstories or synthetic"),
        (
            story and a.model not in (*INSERTION, "gpt"),
            f"--dataset {a.dataset} is for --model "
            f"insnet, insertion_transformer or gpt (the L2R baseline)",
        ),
        (story and a.head != "softmax", "the story models have the softmax head: drop --head"),
        (
            story != (a.task in ("story", "storyline")),
            f"--task {a.task} is not for --dataset "
            f"{a.dataset} (stories: story or storyline; text: completion or stream)",
        ),
        (
            a.task == "storyline" and a.dataset != "rocstories",
            "--task storyline needs the storylines of rocstories",
        ),
        (
            a.task == "stream" and a.model not in ("rnn", "lstm"),
            "--task stream is for --model "
            "rnn or lstm (the CT paper's continuous LM), on one process",
        ),
        (
            a.task == "stream" and a.head in TERMINATION_HEADS,
            f"--head {a.head} models the end of a sequence: use it with --task completion",
        ),
        (
            a.init_from != "scratch" and (a.model != "gpt" or not bpe),
            f"--init_from "
            f"{a.init_from} is GPT-2: --model gpt on BPE data (wikitext103, text --vocab bpe)",
        ),
        (a.weights and a.init_from == "scratch", "--weights goes with --init_from gpt2..."),
        (
            a.loss_scaling and a.head not in ("ct", "ctmos"),
            "--loss_scaling needs --head ct or ctmos (CT eq. 8)",
        ),
        (
            (a.ar or a.tar or a.locked_dropout) and a.model not in ("rnn", "lstm"),
            "--ar / --tar / --locked_dropout are for --model rnn or lstm",
        ),
        (
            a.temperature != 1 and a.head not in ("softmax", "mos"),
            f"a constant --temperature is the baseline of the softmax / mos heads, not of {a.head}",
        ),
        (
            a.max_tokens and (a.batch_size or story),
            "give --batch_size (sequences a batch) or "
            "--max_tokens (tokens a batch), not both; stories: --batch_size",
        ),
        (
            a.model in ("gpt", *INSERTION) and a.d_model % a.n_head,
            f"--d_model {a.d_model} must be divisible by --n_head {a.n_head}",
        ),
        (a.order != "random" and not insertion, "--order is for insnet, insertion_transformer"),
        (
            a.protocol == "authors" and (a.model not in ("rnn", "lstm") or a.max_tokens),
            "--protocol authors is the authors' rnn / lstm code: --model rnn or lstm, --batch_size",
        ),
        (
            procs > 1 and (a.task == "stream" or a.grad_accum % procs),
            f"under torchrun "
            f"--grad_accum ({a.grad_accum}) is a multiple of the {procs} processes, no stream",
        ),
    ]:
        if wrong:
            raise UserError(message)


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


def on_signal(signum, frame):
    """Ctrl-C, SIGTERM: the step finishes, ckpt_last.pt is written (its state "stopped" by the
    signal), the run exits 0."""
    if STOP and signum == signal.SIGINT and not dist.is_initialized():
        raise KeyboardInterrupt  # Ctrl-C twice: abort now
    STOP.append("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)
    print(f"\n{STOP[-1]}: finishing this step and writing a checkpoint", file=sys.stderr)


def main(argv=None):
    args, ckpt = get_args(argv)
    curves.check_out_dir(args.out_dir, args.tensorboard, args.resume)
    rank, procs = world()
    device = get_device(args.device, int(os.environ["LOCAL_RANK"]) if procs > 1 else None)
    if procs > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        atexit.register(dist.destroy_process_group)  # on every way out, after the DDP model went
    torch.manual_seed(args.seed + rank)  # before the model is built: its initial weights
    hf = None if ckpt or args.init_from == "scratch" else gpt2_weights(args.init_from, args.weights)
    data = load_data(args) if rank == 0 else None  # rank 0 prepares the data, then the others
    if procs > 1:  # read it
        dist.barrier()
        data = data or load_data(args, verbose=False)
    data["targets_per_batch"] = targets_per_batch(args, data)
    model, optimizer, scaler, ctx, st = build(args, ckpt, data, hf, device)
    if rank == 0:
        curves.start_logs(args.out_dir, vars(args), st["step"] if args.resume else 0)
    STOP.clear()
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        train(args, model, optimizer, scaler, ctx, data, st, ckpt and ckpt["hidden"], device)
    finally:  # (stopped, or under torchrun: a second signal as the process leaves is no kill)
        for s, handler in handlers.items() if not (STOP or dist.is_initialized()) else ():
            signal.signal(s, handler)


def build(args, ckpt, data, weights, device):
    """The model (new, GPT-2's, the checkpoint's), AdamW, the float16 scaler, autocast, counters."""
    cfg, (rank, procs) = model_config(args, data), world()
    if ckpt:  # --resume: the checkpoint's vocabulary (its shape: get_args)
        check_vocab(ckpt, data, f"{args.out_dir}/ckpt_last.pt")
    check_fits(args, data)
    model = INSERTION.get(cfg["model"], LanguageModel)(cfg)  # InsNet, IT-vanilla, backbone + head
    if weights:  # (weights that do not fit: a UserError)
        model.load_state_dict(gpt_state_from_hf(weights, model))
    params = list(model.to(device).parameters())
    # weight decay on matrices, not on biases and norms (the authors' protocol: on every one)
    decay_all = args.protocol == "authors"
    optimizer = torch.optim.AdamW(
        [
            dict(
                params=[p for p in params if p.dim() >= 2 or decay_all],
                weight_decay=args.weight_decay,
            ),
            dict(params=[p for p in params if p.dim() < 2 and not decay_all], weight_decay=0.0),
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=True,
    )
    ctx = autocast(device, args.dtype)
    scaler = torch.amp.GradScaler(
        device[:4], enabled=getattr(ctx, "fast_dtype", 0) == torch.float16
    )
    st = dict(
        step=0, epoch=0, batch_in_epoch=0, best_val=math.inf, bad_evals=0, lr=args.lr, elapsed=0.0
    )
    if ckpt:  # the model, optimizer, counters, scaler, and this process's RNG (saved by another
        model.load_state_dict(ckpt["model"])  # number of processes: fresh, from seed, rank, step)
        optimizer.load_state_dict(ckpt["optimizer"])
        st, rng = ckpt["state"], ckpt["rng"]
        if len(rng) != procs:
            torch.manual_seed(((args.seed * 1_000_003 + rank) * 1_000_003 + st["step"]) % 2**63)
        else:
            torch.set_rng_state(rng[rank]["cpu"])
            if rng[rank]["cuda"] is not None:
                torch.cuda.set_rng_state(rng[rank]["cuda"])
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
    if rank == 0:
        print(
            f"{args.model} + {args.head if args.model in MODELS else args.task} on {args.dataset}"
            f": {model.num_params():,} parameters, V={data['vocab_size']:,}, {device}"
            + (f", {str(ctx.fast_dtype)[6:]} autocast" if hasattr(ctx, "fast_dtype") else "")
            + (f", resuming at step {st['step']}" if ckpt else "")
            + (f"; {data['note']}" if data.get("note") else ""),
            flush=True,
        )
    if args.compile:  # CUDA graphs, a capture a (B, T): for one batch a step, in few shapes
        model = compile_model(
            model,
            graphs=device.startswith("cuda")
            and args.grad_accum == procs
            and (args.task == "stream" or bool(args.max_tokens)),
        )
    if dist.is_initialized():
        model = DDP(model, device_ids=[device] if device.startswith("cuda") else None)
    return model, optimizer, scaler, ctx, st


def train(args, model, optimizer, scaler, ctx, data, st, hidden, device):
    """The loop: lr -> micro-batches, each scored by one call of the model (NMST eq. 3) -> clip ->
    step; every --log_interval steps the losses are read and the processes agree on stopping."""
    raw, (rank, procs) = getattr(m := getattr(model, "module", model), "_orig_mod", m), world()
    accum = args.grad_accum // procs
    ls = loss_scale(data["vocab_size"], args.ct_alpha, args.ct_beta) if args.loss_scaling else 1.0
    t0, pending, stop = time.time() - st["elapsed"], [], None
    since = dict(nll=0.0, n=0, tokens=0, t0=time.time())  # (nll: summed on the device)
    resume_state(st, since)
    hidden, why = to(hidden, device), limit_reached(args, st)
    if why:
        return print(f"{args.out_dir}: this run already finished ({why}); raise the limit to go on")
    while not (why or stop):
        keys = epoch_batches(args, data, st["epoch"])
        n_steps = len(keys) // args.grad_accum  # (the last len % grad_accum batches are skipped)
        for s in tqdm(
            range(st["batch_in_epoch"], n_steps),
            f"epoch {st['epoch']}",
            n_steps,
            leave=False,
            initial=st["batch_in_epoch"],
            disable=True if rank else None,
        ):
            st["lr"] = learning_rate(args, st)
            for group in optimizer.param_groups:
                group["lr"] = st["lr"]
            step_loss = 0.0
            for j in range(accum):  # this process's micro-batches
                batch = get_batch(args, data, keys[s * args.grad_accum + rank * accum + j], device)
                if procs > 1:  # DDP: the gradients are all-reduced on the last micro-batch only
                    model.require_backward_grad_sync = j == accum - 1
                if batch.get("start") == 0:
                    hidden = None  # each epoch starts the streams afresh
                with ctx:
                    log_p, mask, hidden = score(model, batch, hidden)
                    # -log p of the batch's predicted tokens, summed
                    nll = -torch.where(mask, log_p, 0.0).sum()
                    # NMST eq. 3, the mean over every target of the data: the sum divided by the
                    # epoch's mean count a batch, the same for every batch, so that each token
                    # weighs alike whatever the length of its batch's lines (CT eq. 8: x LS)
                    loss = nll / data["targets_per_batch"] * ls
                    if args.ar or args.tar:
                        loss = loss + raw.backbone.activation_regularisation(args.ar, args.tar)
                scaler.scale(loss / accum).backward()  # (a scaler does nothing but in float16)
                hidden = to(hidden, device, detach=True)  # truncated BPTT: not into the past
                # (logged: the batch's own mean -log p a token)
                step_loss += nll.detach() / batch["n"] / accum
                since.update(
                    nll=since["nll"] + nll.detach().double(),
                    n=since["n"] + batch["n"],
                    tokens=since["tokens"] + batch["n_inputs"],
                )
            scaler.unscale_(optimizer)
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            st.update(step=st["step"] + 1, batch_in_epoch=s + 1, elapsed=time.time() - t0)
            pending.append((st["step"], st["lr"], step_loss))
            stop = STOP[0] if STOP and procs == 1 else None  # (torchrun: decided together)
            if st["step"] % args.log_interval == 0:
                stop, why = sync(args, pending, device, st) or (stop, None)
            why = why or limit_reached(args, st)
            if (args.eval_interval and st["step"] % args.eval_interval == 0) or why:
                why = (
                    validate(
                        args, raw, optimizer, scaler, ctx, data, st, hidden, device, pending, since
                    )
                    or why
                )
            if why or stop:
                break
        else:  # the epoch's end: without --eval_interval (or at the end) an evaluation
            st.update(epoch=st["epoch"] + 1, batch_in_epoch=0)
            if not args.eval_interval or (why := limit_reached(args, st)):
                why = (
                    validate(
                        args, raw, optimizer, scaler, ctx, data, st, hidden, device, pending, since
                    )
                    or why
                )
    if stop:
        sync(args, pending, device, st)
        stop_state(st, since, stop, device)
        save(args, raw, optimizer, scaler, data, st, hidden)
    if rank == 0:
        print(
            f"stopped by {stop} after step {st['step']}; {args.out_dir}/ckpt_last.pt written: "
            f"the same command with --resume goes on"
            if stop
            else f"done ({why}) after "
            f"{st['step']} steps; best validation loss {st['best_val']:.4f} (ppl "
            f"{math.exp(min(st['best_val'], 700)):.2f}); checkpoints in {args.out_dir}"
        )


def validate(args, raw, optimizer, scaler, ctx, data, st, hidden, device, pending, since):
    """Evaluate, log, probe, lower a plateau lr, checkpoint; -> why the run stops now, or None."""
    # (under torchrun the processes' clocks are read together here: --whole_epochs' stop)
    late = (sync(args, pending, device, st) or (None, None))[1]
    rank = world()[0]
    nll, n, tokens = all_sum([float(since["nll"]), since["n"], since["tokens"]], device)
    tok_per_s = tokens / max(time.time() - since["t0"], 1e-9)
    val = perplexity(args, raw, data, "valid", device=device, ctx=ctx)
    if not math.isfinite(val["nll"]):
        raise UserError(
            f"non-finite validation loss at step {st['step']}; stopping (try a lower "
            f"--lr): ckpt_last.pt, if any, holds the last evaluation's weights"
        )
    improved = val["nll"] < st["best_val"]
    st.update(
        best_val=min(st["best_val"], val["nll"]),
        bad_evals=0 if improved else st["bad_evals"] + 1,
        lr=st["lr"] * (args.lr_decay if not improved and args.lr_schedule == "plateau" else 1),
    )
    mfu = tok_per_s * mfu_per_token(args, raw, data, device)
    rec = dict(
        step=st["step"],
        epoch=st["epoch"],
        train_loss=nll / max(n, 1),
        val_loss=val["nll"],
        val_ppl=val["ppl"],
        lr=st["lr"],
        tokens_per_s=tok_per_s,
        mfu=mfu or None,
        best=improved,
        elapsed_s=st["elapsed"],
        **{k: v for k, v in val.items() if k in ("eos_prob_at_end", "nll_per_story")},
    )
    if rank == 0:
        print(
            f"step {st['step']:7d} | epoch {st['epoch']:3d} | train loss {rec['train_loss']:.4f} "
            f"| val loss {val['nll']:.4f} | val ppl {val['ppl']:9.2f} | lr {st['lr']:.2e} | "
            f"{tok_per_s:8.0f} tok/s"
            + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
            + (" | best" if improved else ""),
            flush=True,
        )
        if args.probe and args.task == "completion":
            rec.update(probe(args, raw, data))
        curves.log_evaluation(args.out_dir, rec, args.tensorboard, not args.no_curves)
    save(args, raw, optimizer, scaler, data, st, hidden, best=improved)
    since.update(nll=0.0, n=0, tokens=0, t0=time.time())  # (tok/s: counted after the writing)
    return limit_reached(args, st) or late  # (an early stop, say)


def sync(args, pending, device, st):
    """The pending steps' losses and the stop flags, in one collective and one read, into
    steps.jsonl; -> None, or (signal, time limit)."""
    rank, procs = world()
    late = args.max_minutes and st["elapsed"] >= 60 * args.max_minutes and at_a_stop(args, st)
    flags = torch.tensor([float(bool(STOP)), float(late)], device=device)
    values = torch.cat([torch.stack([p[2] for p in pending]).float(), flags]) if pending else flags
    if procs > 1:
        dist.all_reduce(values)
    *losses, signalled, late = values.tolist()
    records = [dict(step=step, loss=v / procs, lr=lr) for (step, lr, _), v in zip(pending, losses)]
    pending.clear()
    if rank == 0:
        curves.append(f"{args.out_dir}/steps.jsonl", *records)
    if bad := [r["step"] for r in records if not math.isfinite(r["loss"])]:
        raise UserError(
            f"non-finite training loss at step {bad[0]}; stopping (try a lower --lr"
            + f"; are --head {args.head}'s values at t <= 0 finite?"
            * (args.head in TERMINATION_HEADS)
            + "): ckpt_last.pt, if any, holds the last weights"
        )
    stop = (STOP[0] if STOP else "a signal to another process") if signalled else None
    late = f"reached --max_minutes {args.max_minutes:g}" if late else None
    return (stop, late) if stop or late else None


def save(args, model, optimizer, scaler, data, st, hidden, best=False):
    """ckpt_last.pt (improved: ckpt_best.pt, then ckpt_last.pt its copy: a kill between the two
    leaves ckpt_last.pt the older): model, optimizer, counters, every process's RNG, arguments..."""
    own = dict(
        cpu=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state() if next(model.parameters()).is_cuda else None,
    )
    rng = [own] * world()[1]
    if dist.is_initialized():
        dist.all_gather_object(rng, own)
    if world()[0] == 0:
        first, last = (f"{args.out_dir}/ckpt_{n}.pt" for n in ("best" if best else "last", "last"))
        save_checkpoint(
            dict(
                config=model.cfg,
                model=model.state_dict(),
                args=vars(args),
                optimizer=optimizer.state_dict(),
                state=dict(st),
                rng=rng,
                vocab=data["vocab"],
                hidden=hidden,
                scaler=scaler.state_dict() if scaler.is_enabled() else None,
            ),
            first,
        )
        if best:
            shutil.copyfile(first, f"{last}.tmp")
            os.replace(f"{last}.tmp", last)


def stop_state(st, since, stop, device):
    """A run stopped by a signal says so in its checkpoint's state ("stopped": what reproduce.py
    reads), and keeps its interval's sums since the last evaluation (all processes') for the next
    evaluation's train loss."""
    nll, n = all_sum([float(since["nll"]), since["n"]], device)
    st.update(stopped=stop, since=dict(nll=nll, n=n))


def resume_state(st, since):
    """A resumed run is no longer stopped, and goes on with the interval's sums it kept (rank 0
    alone: they are every process's)."""
    st.pop("stopped", None)
    kept = st.pop("since", {})
    if world()[0] == 0:
        since.update(kept)


def to(state, device, detach=False):  # a recurrent state (tensor, tuple, None) on device
    if isinstance(state, tuple):  # (detach copies: a CUDA graph's next replay reuses its outputs)
        return tuple(to(s, device, detach) for s in state)
    return state if state is None else (state.detach().clone() if detach else state).to(device)


def limit_reached(args, st):
    """-> why the run stops now, or None (--max_minutes under torchrun: decided in sync)."""
    if args.max_iters and st["step"] >= args.max_iters:
        return f"reached --max_iters {args.max_iters}"
    if st["epoch"] >= args.max_epochs:
        return f"reached --max_epochs {args.max_epochs}"
    late = args.max_minutes and st["elapsed"] >= 60 * args.max_minutes
    if late and at_a_stop(args, st) and not dist.is_initialized():
        return f"reached --max_minutes {args.max_minutes:g}"
    if st["bad_evals"] >= args.patience:
        return f"early stop: no improvement in {args.patience} evaluations"


def at_a_stop(args, st):
    """Where --max_minutes may stop a run: after any step; with --whole_epochs only at an epoch's
    end (so that no evaluation of half an epoch lowers a plateau lr)."""
    return not args.whole_epochs or st["batch_in_epoch"] == 0


def learning_rate(args, st):
    """plateau / constant: the lr (plateau: lowered at evaluations); linear: warm-up, then to 0."""
    if args.lr_schedule != "linear":
        return st["lr"]
    warm = min(1.0, (st["step"] + 1) / args.warmup) if args.warmup else 1.0
    return args.lr * warm * max(0.0, 1.0 - st["step"] / args.decay_steps)


def mfu_per_token(args, model, data, device):
    """MFU of one token/s: FLOPs a token at the mean length trained on / all processes' peak."""
    peak = args.peak_flops or peak_flops(device, args.dtype)
    if args.task == "completion":
        inputs = data["train"].lengths[: args.train_seqs or None] - 1
        length = float(np.mean(inputs[inputs <= (args.window or math.inf)]))
    else:
        length = args.bptt if args.task == "stream" else 0  # (stories: no MFU)
    return model.flops_per_token(length) / (peak * world()[1]) if peak and length else 0.0


if __name__ == "__main__":
    run(main)
