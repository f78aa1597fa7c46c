"""Train a nanogen model: the recipes, the set-up (data, model, DDP, resume), the loop, then
the bookkeeping (logs, evaluations, checkpoints).  The flags and their checks are config.py's.

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
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 (now: DDP importing it later pins the group at exit)
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import curves
from common import (
    STOP,
    Stopped,
    UserError,
    all_sum,
    at_once,
    autocast,
    check_vocab,
    compile_model,
    copy_checkpoint,
    get_device,
    lock_folder,
    mfu_per_token,
    release_folder,
    restore_rng,
    run,
    save_checkpoint,
    state_to,
    stop_on_signals,
    unwrapped,
    world,
)
from config import get_args, model_config
from data import gpt2_weights
from data.loader import check_fits, epoch_batches, get_batch, load_data, targets_per_batch
from evaluate import evaluation_line, perplexity, probe
from heads import TERMINATION_HEADS, loss_scale
from insnet import INSERTION
from model import LanguageModel, gpt_state_from_hf

# ----- the recipes: the settings each --model starts from ------------------------------------
# Each recipe sets these flags under what you type (NMST paper section 4 and appendix D; InsNet
# paper section 4.3; gcnn and gpt from scratch: nanogen's).  The recurrent and convolutional
# models share the NMST paper's optimization: AdamW at 1e-3, halved when an evaluation at an
# epoch's end does not improve, batches of 32 lines.
PLATEAU = {
    "lr": 1e-3,
    "lr_schedule": "plateau",
    "batch_size": 32,
    "max_iters": 0,
    "eval_interval": 0,
    "weight_decay": 0.01,
    "decay_steps": 500_000,
    "warmup": 0,
}
# The transformers share GPT-2's small shape and a rate that decays linearly to 0.
GPT2 = {"n_layer": 12, "d_model": 768, "dropout": 0.1, "lr_schedule": "linear", "max_tokens": 1024}
RECIPES = {
    "rnn": {**PLATEAU, "n_layer": 2, "d_model": 256, "dropout": 0.3},
    "lstm": {**PLATEAU, "n_layer": 2, "d_model": 512, "dropout": 0.5},
    "gcnn": {**PLATEAU, "n_layer": 8, "d_model": 512, "dropout": 0.1},
    # nanoGPT's
    "gpt": {
        **GPT2,
        "lr": 6e-4,
        "max_iters": 300_000,
        "eval_interval": 2000,
        "weight_decay": 0.01,
        "decay_steps": 300_000,
        "warmup": 2000,
    },
    # --init_from gpt2...: NMST section 4.2
    "gpt_finetune": {
        **GPT2,
        "lr": 5e-5,
        "max_iters": 300_000,
        "eval_interval": 2000,
        "weight_decay": 0.01,
        "decay_steps": 500_000,
        "warmup": 0,
    },
    # every model on the story data: batches of 64 stories
    "story": {
        **GPT2,
        "lr": 1e-4,
        "max_tokens": None,
        "batch_size": 64,
        "max_iters": 80_000,
        "eval_interval": 1000,
        "weight_decay": 0.02,
        "decay_steps": 80_000,
        "warmup": 400,
    },
}
# --protocol authors: the settings of the NMST authors' src/wiki2 (train.py, utils.py) that
# differ from the rnn / lstm recipe, in float32 as they trained.  Its sequences, batches, context
# loss, N(0, 1) embeddings, no dropout between the layers and weight decay on every parameter
# are in data/ and model.py.
AUTHORS = {"beta2": 0.999, "batch_size": 32, "lr": 1e-3, "max_epochs": 70, "patience": 10}
AUTHORS["dtype"] = "float32"


# ----- the set-up: data, model, DDP, resume ---------------------------------------------------
def main(argv=None):
    args, ckpt = get_args(argv, RECIPES, AUTHORS)
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
    # NMST eq. 3's divisor: the mean count of targets in an epoch's batches (data/loader.py).
    data["targets_per_batch"] = targets_per_batch(args, data)
    run, st = build(args, ckpt, data, hf, device)
    # A run owns its folder while it runs: a second train.py into it is refused in one line
    # (here, before the first write, so that an error above leaves no folder behind).
    lock_folder(args.out_dir)
    try:
        start(run, st, ckpt)
    finally:
        release_folder(args.out_dir)


def start(run, st, ckpt):
    """The logs (a resumed run keeps its records up to its step), then the loop, unless the run
    already reached a limit."""
    args = run.args
    why = limit_reached(args, st)
    if why:
        print(f"{args.out_dir}: this run already finished ({why}); raise the limit to go on")
        return
    hidden = None
    if ckpt:
        hidden = ckpt["hidden"]
    # Ctrl-C and SIGTERM from the first log on: the step finishes, ckpt_last.pt is written, the
    # run exits 0.
    with stop_on_signals():
        if world()[0] == 0:
            curves.start_logs(args.out_dir, vars(args), st.step if args.resume else 0)
        train(run, st, hidden)


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
        print(curves.run_line(args, model, data, device, ctx, resumed_at), flush=True)
    if args.compile:
        # CUDA graphs capture one (B, T) each: for one batch a step, in few shapes.
        one_batch = args.grad_accum == procs
        few_shapes = args.task == "stream" or bool(args.max_tokens)
        graphs = device.startswith("cuda") and one_batch and few_shapes
        model = compile_model(model, graphs=graphs)
    if dist.is_initialized():
        model = DDP(model, device_ids=[device] if device.startswith("cuda") else None)
    return Run(args, model, unwrapped(model), optimizer, scaler, ctx, data, device), st


# ----- the loop: epochs of steps -------------------------------------------------------------
def learning_rate(args, st):
    """plateau / constant: the lr (plateau: lowered at evaluations); linear: warm-up, then to 0."""
    if args.lr_schedule != "linear":
        return st.lr
    warm = 1.0
    if args.warmup:
        warm = min(1.0, (st.step + 1) / args.warmup)
    return args.lr * warm * max(0.0, 1.0 - st.step / args.decay_steps)


def train(run, st, hidden):
    """The loop: epochs of steps, each followed by its bookkeeping (every --log_interval steps
    the losses are read and the processes agree on stopping; evaluations, checkpoints)."""
    args = run.args
    rank, procs = world()
    # The clock goes on from the checkpoint's.
    t0 = time.time() - st.elapsed
    # The steps whose losses are not read yet: (step, lr, the loss on the device).
    pending = []
    # The sums since the last evaluation, for its train loss and tokens/s (nll: on the device).
    since = dict(nll=0.0, n=0, tokens=0, t0=time.time())
    resume_state(st, since)
    hidden = state_to(hidden, run.device)
    why = None
    stop = None
    while not (why or stop):
        keys = epoch_batches(args, run.data, st.epoch)
        # A step reads --grad_accum batches, accum of them on each process (the last
        # len(keys) % grad_accum batches of an epoch are skipped).
        n_steps = len(keys) // args.grad_accum
        accum = args.grad_accum // procs
        for s in progress(st, n_steps):
            first = s * args.grad_accum + rank * accum
            hidden = step(run, st, keys[first : first + accum], hidden, since)
            # The bookkeeping: count, log, stop, evaluate, checkpoint.
            st.step += 1
            st.batch_in_epoch = s + 1
            st.elapsed = time.time() - t0
            pending.append((st.step, st.lr, since.pop("step_loss")))
            stop, why = after_step(run, st, hidden, pending, since)
            if why or stop:
                break
        else:
            # The epoch's end.
            st.epoch += 1
            st.batch_in_epoch = 0
            why = after_epoch(run, st, hidden, pending, since)
    # A signal stopped the run short of its end (at its last step it simply ended): the losses
    # logged, the interval's sums kept, ckpt_last.pt.
    if stop and not why:
        sync(args, pending, run.device, st)
        stop_state(st, since, stop, run.device)
        save(run, st, hidden)
    curves.say_how_it_ended(args, st, stop, why)


def step(run, st, keys, hidden, since):
    """One optimizer step over this process's batches `keys`: batch -> one call of the model ->
    the loss (NMST eq. 3) -> backward, for each; then clip and step.  -> the recurrent state."""
    args, model, data, scaler = run.args, run.model, run.data, run.scaler
    # Set this step's learning rate.
    st.lr = learning_rate(args, st)
    for group in run.optimizer.param_groups:
        group["lr"] = st.lr
    # What is logged: the mean -log p a token of the step's batches.
    since["step_loss"] = 0.0
    for j, key in enumerate(keys):
        # The batch: inputs, targets, t and the mask of the targets in the loss (data/loader.py).
        batch = get_batch(args, data, key, run.device, training=True)
        if world()[1] > 1:
            # Only the last micro-batch's backward all-reduces the gradients (model.no_sync()
            # only toggles this flag; nanoGPT sets it too).
            model.require_backward_grad_sync = j == len(keys) - 1
        if batch.get("start") == 0:
            # Each epoch starts the streams afresh.
            hidden = None
        with run.ctx:
            # One call of the model: log p of every target (B, T), the mask of those that count,
            # the recurrent state to go on from (model.py, heads.py).
            log_p, mask, hidden = model(batch, hidden)
            # -log p of the batch's targets, summed
            nll = -torch.where(mask, log_p, 0.0).sum()
            # NMST eq. 3, the mean over every target of the data: the sum divided by the epoch's
            # mean count a batch, the same for every batch, so that each token weighs alike
            # whatever the length of its batch's lines.  --protocol authors divides each batch by
            # its own count of targets, <cpad> left out (their train.py:61-62, 69), which its
            # batches carry (data/loader.collate).
            divisor = batch.get("n_authors", data["targets_per_batch"])
            loss = nll / divisor
            if args.loss_scaling:
                # CT eq. 8's loss scaling LS
                loss = loss * loss_scale(data["vocab_size"], args.ct_alpha, args.ct_beta)
            if args.ar or args.tar:
                # CT eq. 8's activation regularisation of a recurrent backbone
                loss = loss + run.raw.backbone.activation_regularisation(args.ar, args.tar)
        # The loss is divided by the micro-batches: the accumulated gradient is their mean.
        # (The scaler does nothing but in float16.)
        scaler.scale(loss / len(keys)).backward()
        # Truncated BPTT: the next window's gradient does not reach into this one.
        hidden = state_to(hidden, run.device, detach=True)
        since["step_loss"] += nll.detach() / batch["n"] / len(keys)
        since["nll"] += nll.detach().double()
        since["n"] += batch["n"]
        since["tokens"] += batch["n_inputs"]
    # Clip the gradient (unscaled first, in float16), then step.
    scaler.unscale_(run.optimizer)
    if args.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.raw.parameters(), args.grad_clip)
    scaler.step(run.optimizer)
    scaler.update()
    # Flush the gradients as soon as we can: their memory is not needed any more.
    run.optimizer.zero_grad(set_to_none=True)
    return hidden


# ----- the bookkeeping: counters, evaluations, logs, checkpoints, limits ---------------------
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


def progress(st, n_steps):
    """The epoch's steps from where the run is, with a progress bar on rank 0's terminal."""
    return tqdm(
        range(st.batch_in_epoch, n_steps),
        f"epoch {st.epoch}",
        n_steps,
        leave=False,
        initial=st.batch_in_epoch,
        disable=True if world()[0] else None,
    )


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
        # A signal during the evaluation (the probe, say) stops the run before another step.
        if STOP and world()[1] == 1:
            stop = STOP[0]
    return stop, why


def after_epoch(run, st, hidden, pending, since):
    """The bookkeeping of an epoch's end: without --eval_interval an evaluation; with it, one if
    the run stops here.  -> why the run stops, or None."""
    if not run.args.eval_interval:
        return validate(run, st, hidden, pending, since)
    why = limit_reached(run.args, st)
    # A step just evaluated is not evaluated again: the repeat would count as a plateau.
    if why and st.step % run.args.eval_interval:
        return validate(run, st, hidden, pending, since) or why
    return why


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
            rec.update(probe_unless_stopped(args, raw, data))
        curves.log_evaluation(args.out_dir, rec, args.tensorboard, not args.no_curves)
    save(run, st, hidden, best=improved)
    # (tok/s: counted after the writing)
    since.update(nll=0.0, n=0, tokens=0, t0=time.time())
    # (an early stop, say)
    return limit_reached(args, st) or late


def probe_unless_stopped(args, model, data):
    """The termination probe's record, or {} when a signal gave it up: a model that loops makes
    it decode --probe_L tokens a context, too long to wait for."""
    try:
        with at_once():
            return probe(args, model, data)
    except Stopped:
        print("        probe: given up (stopping)", flush=True)
        return {}


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


if __name__ == "__main__":
    run(main)
