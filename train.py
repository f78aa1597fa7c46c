"""Train a nanogen model: one loop for every model and task, read top to bottom.

    python train.py --model lstm --head nmst --dataset wikitext2     # the 2x512 LSTM recipe
    python train.py --head nmst --dataset wikitext103                # GPT-2 shape, from scratch
    python train.py --init_from gpt2 --head nmst --dataset wikitext103   # GPT-2 finetuning
    python train.py --model lstm --task stream --head ctmos --dataset ptb  # CT paper
    python train.py --model insnet --dataset rocstories [--task storyline]  # InsNet
    python train.py ... --resume                                     # go on from ckpt_last.pt

main / fit: the flags (recipes.py: the defaults of each --model, from NMST paper section 4 and
appendix D and InsNet paper section 4.3; a flag you type always wins) -> the data (tasks.py) ->
the model -> the run folder (runs.py) -> the loop.  The loop: the step's learning rate ->
micro-batches, each scored by NMST paper eq. 3 (the mean -log p over the continuation tokens,
in `accumulate`) -> clip (at 1.0: nanogen's choice, the paper does not say) -> optimizer step
-> log, evaluate, checkpoint, stop.
"""
import contextlib
import math
import sys
import time

import torch

import cli
import runs
from checkpoint import fetch_hf_weights, load_pretrained_gpt2
from cli import UserError
from recipes import STORY, model_config, parse_args
from tasks import build_model, check_same_data, load_task, unwrap


def main(argv=None):
    """`python train.py ...`: exit status 0, also when a signal stopped the run (its checkpoint
    is written; --resume goes on from it)."""
    fit(argv)
    return 0


def fit(argv=None, advise=True):
    """The run: flags -> data -> model -> run folder -> the loop.  -> None when the run finished
    (or had), else the signal that stopped it or came after its last step ("Ctrl-C", ...).
    advise=False: a command that trains several runs says how to go on after a signal."""
    args, ckpt = parse_args(argv)  # flags, recipes, rules; --resume: the run's own arguments
    runs.check_folder(args)  # on every process, before torchrun's process group exists
    dist = cli.setup_distributed(args)
    cli.setup_device(dist.device)  # before anything touches the device
    if args.compile:
        cli.check_compiler(dist.device)  # refused now, not at the first step after the data
    torch.manual_seed(args.seed + dist.rank)  # before the model is built: its initial weights
    weights = None  # GPT-2's, found or downloaded (by rank 0) before the data is prepared
    if args.init_from != "scratch" and ckpt is None:
        weights = dist.rank0_first(lambda: args.weights or fetch_hf_weights(args.init_from))
    vocab = ckpt["data"].get("vocab") if ckpt else None
    task = dist.rank0_first(lambda: load_task(vars(args), args.data_dir, vocab=vocab,
                                              verbose=dist.rank == 0))  # one process prepares
    if ckpt:
        check_same_data(ckpt["data"], task.signature, ("train", "valid"), args.out_dir)
    check_data_fits(args, task)
    cfg = model_config(args, task.vocab_size, task.eos_id)
    lm = build_model(cfg)
    if weights:
        load_pretrained_gpt2(lm, args.init_from, weights)
    lm = lm.to(dist.device)  # the first CUDA kernel
    optimizer = configure_optimizer(lm, args, dist.device)
    fp16 = cli.autocast_dtype(dist.device, args.dtype) == torch.float16  # needs loss scaling
    run = runs.Run(args, dist, torch.amp.GradScaler(dist.device.split(":")[0], enabled=fp16),
                   task.tokens_per_epoch(), len(task.epoch(0)) // args.grad_accum)
    if ckpt is not None and not run.restore(ckpt, lm, optimizer, task, cfg):
        return None
    if args.compile:
        compile_model(lm)
    model = lm
    if dist.world > 1:  # gradients all-reduced on each step's last micro-batch
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(lm, device_ids=[int(dist.device[5:])] if dist.device[:4] == "cuda" else None)
    with run:
        dist.rank0_first(lambda: run.open(resuming=args.resume))  # the lock: rank 0's
        if dist.rank == 0:
            announce(args, task, lm, dist, ckpt)
        message = train(args, task, model, optimizer, run, cfg)
        if dist.rank == 0 and (advise or not run.stop_requested):
            print(message, flush=True)
        if dist.world > 1:  # (signals still reach run's handler: a second one is no kill)
            torch.distributed.destroy_process_group()
    return run.signalled if dist.world == 1 else run.stop_requested  # (torchrun: the agreed)


def train(args, task, model, optimizer, run, cfg):
    """One loop for every task: lr -> micro-batches -> clip -> step -> log, evaluate,
    checkpoint, stop.  model: the model, or its DDP wrapper under torchrun."""
    lm, st, dist = unwrap(model), run.state, run.dist
    autocast = cli.autocast_context(dist.device, args.dtype)
    clock = Clock(time.time() - st.elapsed, mfu_per_token(args, task, lm, dist))

    def save(name):
        run.save(name, lm, optimizer, task, cfg)

    def evaluate():  # then ckpt_last.pt; the next tok/s counts from after its writing
        validate(args, task, lm, run, save, autocast, clock)
        save("ckpt_last.pt")
        run.restart_interval()
    while not st.done:
        keys = task.epoch(st.epoch)
        n_steps = len(keys) // args.grad_accum  # the last len % grad_accum batches are skipped
        for s in progress(range(st.batch_in_epoch, n_steps), st, n_steps, dist.rank):
            t_step = time.time()
            st.lr = learning_rate(args, st)
            for group in optimizer.param_groups:
                group["lr"] = st.lr
            step_keys = keys[s * args.grad_accum:(s + 1) * args.grad_accum]
            loss, bad = accumulate(task, model, step_keys, run, autocast)
            run.scaler.unscale_(optimizer)  # (every scaler call is a no-op unless float16)
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(lm.parameters(), args.grad_clip)
            run.scaler.step(optimizer)
            run.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            st.step, st.batch_in_epoch = st.step + 1, s + 1
            run.after_step(loss, bad, time.time() - t_step)
            st.elapsed = time.time() - clock.start
            st.done = run.should_stop()  # the same answer on every process
            if (args.eval_interval and st.step % args.eval_interval == 0) or st.done:
                evaluate()
            if st.done or run.stop_requested:
                break
        if run.stop_requested:
            run.flush()
            save("ckpt_last.pt")
            return run.stopped_message()
        if not st.done:
            next_epoch(args, run, evaluate, save)
    return f"done ({st.done}) after {st.step} steps; best validation loss {st.best_val:.4f} " \
           f"(ppl {math.exp(min(st.best_val, 700)):.2f}); checkpoints in {args.out_dir}"


def accumulate(task, model, keys, run, autocast):
    """Forward and backward over one step's micro-batches (this process's share of `keys`).
    The loss is NMST paper eq. 3: the mean negative log-likelihood of the continuation tokens
    (eos included) given the context; stories: of the predicted events; CT paper eq. 8's
    penalties where asked.  Nothing is read back from the device here (Run.flush reads the
    losses).  -> (the last micro-batch's loss, its count of non-finite losses)."""
    dist = run.dist
    accum = len(keys) // dist.world
    model.train()
    bad = 0
    for j in range(accum):
        batch = task.batch(keys[dist.rank * accum + j], dist.device)
        if dist.world > 1:  # DDP: all-reduce the gradients on the last micro-batch only
            model.require_backward_grad_sync = j == accum - 1
        with autocast or contextlib.nullcontext():
            log_p, mask, n = task.scores(model, batch)  # (B, T), (B, T), a host int
            nll = -torch.where(mask, log_p, 0.0).sum()  # -sum over the continuation tokens
            loss = task.penalised(model, nll / n)  # eq. 3's mean (+ LS, AR, TAR)
        run.scaler.scale(loss / accum).backward()
        bad = bad + (~torch.isfinite(loss.detach())).int()
        run.tally(nll, n, batch["n_inputs"])
    return loss, bad


def validate(args, task, lm, run, save, autocast, clock):
    """Evaluate, log one line, keep the best checkpoint, lower a plateau lr, stop early."""
    st, r, dist = run.state, run.since_eval, run.dist
    run.flush()
    nll, n, tokens = dist.all_sum([float(r["nll"]), r["n"], r["tokens"]])
    tok_per_s = tokens / max(time.time() - r["t0"], 1e-9)
    val = task.evaluate(lm, dist.device, rank=dist.rank, world=dist.world, autocast=autocast)
    if not math.isfinite(val["nll"]):
        raise UserError(f"non-finite validation loss at step {st.step}; stopping. "
                        f"{run.last_good().capitalize()} (try a lower --lr)")
    improved = val["nll"] < st.best_val
    st.best_val, st.bad_evals = min(st.best_val, val["nll"]), 0 if improved else st.bad_evals + 1
    if not improved and args.lr_schedule == "plateau":
        st.lr *= args.lr_decay
    if st.bad_evals >= args.patience:
        st.done = f"early stop: no improvement in {args.patience} evaluations"
    mfu = tok_per_s * clock.mfu_per_token if clock.mfu_per_token else None
    rec = dict(step=st.step, epoch=st.epoch, train_loss=nll / max(n, 1), val_loss=val["nll"],
               val_ppl=math.exp(min(val["nll"], 700)), lr=st.lr, tokens_per_s=tok_per_s, mfu=mfu,
               best=improved, elapsed_s=time.time() - clock.start,
               **{k: v for k, v in val.items() if k == "nll_per_story"})
    probe = run_probe(args, task, lm, val, dist) if dist.rank == 0 else None
    if dist.rank == 0:
        print(f"step {st.step:7d} | epoch {st.epoch:3d} | train loss {rec['train_loss']:.4f} | "
              f"val loss {val['nll']:.4f} | val ppl {rec['val_ppl']:9.2f} | lr {st.lr:.2e} | "
              f"{tok_per_s:8.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
              + (" | best" if improved else ""), flush=True)
        if probe:
            rec.update({k: v for k, v in probe.items() if k != "line"})
            print(probe["line"], flush=True)
    run.append("log.jsonl", rec)
    if improved:
        save("ckpt_best.pt")
    if dist.rank == 0:
        run.draw(rec)  # curves.png (and TensorBoard when asked)


def run_probe(args, task, lm, val, dist):
    """The termination probe (NMST paper eq. 11 during training): greedy continuations of
    --probe validation contexts up to --probe_L tokens; r_nt, the mean length, the mean p(eos)
    at the true end (from the evaluation), one example and where and why it stopped.  Its time
    counts as training time.  -> the log fields and the line to print, or None."""
    t0 = time.time()
    p = task.probe(lm, dist.device, args.probe, args.probe_L) if args.probe else None
    if p is None:
        return None
    context, tokens, ended = p["example"]
    tok = task.tokenizer()
    body = [t for t in tokens if t != task.eos_id]
    why = f"eos at t={len(tokens)}" if ended else f"cut at L={p['L']}: not terminated"
    text = tok.decode(body)
    line = (f"        probe: r_nt({p['L']}) {p['r_nt']:.3f} over {p['n']} contexts | mean length "
            f"{p['mean_length']:.1f} | p(eos) at the true end {val['eos_prob_at_end']:.4f} | "
            f"\"{tok.decode(context)}\" >>> \"{text[:120]}{'...' if len(text) > 120 else ''}\" "
            f"[{why}]")
    return dict(probe_r_nt=p["r_nt"], probe_L=p["L"], probe_n=p["n"],
                probe_mean_length=p["mean_length"], probe_eos_at_end=val["eos_prob_at_end"],
                probe_seconds=time.time() - t0, line=line)


def next_epoch(args, run, evaluate, save):
    """The epoch's end: the next epoch (or --max_epochs reached); without --eval_interval, or
    at the end, evaluate what was trained since the last evaluation, and checkpoint."""
    st = run.state
    st.epoch, st.batch_in_epoch = st.epoch + 1, 0
    if st.epoch >= args.max_epochs:
        st.done = f"reached --max_epochs {args.max_epochs}"
    if not args.eval_interval or st.done:
        run.flush()
        if run.dist.all_sum([run.since_eval["n"]])[0]:
            evaluate()  # (and ckpt_last.pt)
        else:
            save("ckpt_last.pt")


# --------------------------------------------------------------------------------------------
# the pieces the loop uses
# --------------------------------------------------------------------------------------------
class Clock:
    """When training started (resumes included) and, on a GPU, what one token/s is in MFU."""

    def __init__(self, start, mfu_per_token):
        self.start, self.mfu_per_token = start, mfu_per_token


def mfu_per_token(args, task, lm, dist):
    """MFU of one token/s: training FLOPs per token at the mean training length over the peak
    of all processes' devices (None where no peak is known, or for the story models)."""
    peak, length = cli.peak_flops(args, dist.device), task.mean_length()
    if not peak or length is None:
        return None
    return lm.flops_per_token(length) / (peak * dist.world)


def configure_optimizer(lm, args, device):
    """AdamW; weight decay on matrices (dim >= 2) only, not on biases / LayerNorm gains."""
    params = {id(p): p for p in lm.parameters() if p.requires_grad}.values()  # tied: once
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    fused = device.split(":")[0] in ("cuda", "cpu")  # one kernel for all tensors
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=fused)


def learning_rate(args, st):
    """plateau / constant: the current lr (plateau lowers it after evaluations); linear: a linear
    warm-up over --warmup steps times a linear decay to 0 at --decay_steps (both from step 0)."""
    if args.lr_schedule != "linear":
        return st.lr
    warm = min(1.0, (st.step + 1) / args.warmup) if args.warmup else 1.0
    return args.lr * warm * max(0.0, 1.0 - st.step / args.decay_steps)


def progress(steps, st, n_steps, rank):
    """The epoch's steps with a tqdm bar on the main process's terminal."""
    from tqdm import tqdm
    return tqdm(steps, total=n_steps, initial=st.batch_in_epoch, desc=f"epoch {st.epoch}",
                leave=False, disable=None if rank == 0 else True)


def check_data_fits(args, task):
    """Runs that would silently do nothing are errors: no optimizer step in an epoch, nothing to
    validate on, a story longer than the window (the task's own check_fits, first)."""
    task.check_fits(args)
    n_batches = len(task.epoch(0))
    if n_batches // args.grad_accum == 0:
        raise UserError(f"an epoch here has {n_batches} batch(es), fewer than --grad_accum "
                        f"{args.grad_accum}: no optimizer step would run (lower --grad_accum or "
                        f"--batch_size / --max_tokens, raise --train_seqs, or check that "
                        f"--block_size {args.block_size} holds some training sequences)")


class Stopped(UserError):
    """A signal stopped a run that a longer command (reproduce.py, bench.py arch) started."""


def fit_or_stop(argv):
    """fit, for a command that trains several runs: a signal that stopped this one stops the
    command too (Ctrl-C as a KeyboardInterrupt), rather than going on to the next."""
    stopped = fit(argv, advise=False)
    if stopped == "Ctrl-C":
        raise KeyboardInterrupt
    if stopped:
        raise Stopped(f"stopped by {stopped}")


def compile_model(lm, backend="inductor"):
    """torch.compile in place (state_dict keys stay unchanged), with dynamic shapes: batches
    come in ever new (B, T), which would otherwise recompile until torch gives up.  On a GPU,
    inductor pads the (D, V = 50257) product to V = 50264 for the tensor cores; the backward
    then bakes the first batch's T into that activation's strides, and every new T recompiled
    GPT-2 124M (RESULTS.md, "On a GPU"): no padding (shape_padding off)."""
    options = {"shape_padding": False} if backend == "inductor" else None
    lm.compile(dynamic=True, backend=backend, options=options)


def announce(args, task, lm, dist, ckpt):
    """What is about to be trained, before the first step."""
    what = f"{args.model} + {args.head} head" if args.dataset not in STORY else \
        f"{args.model} ({args.task}{', order ' + args.order if args.model != 'gpt' else ''})"
    print(f"{what} on {args.dataset}: {lm.num_params():,} parameters, V={task.vocab_size:,}, "
          f"{task.tokens_per_epoch():,} training tokens per epoch, device {dist.device}"
          + (f" x {dist.world} processes" if dist.world > 1 else "")
          + precision(dist.device, args.dtype)
          + (f", resuming at step {ckpt['train_state']['step']}" if ckpt else "")
          + (f"; {task.note}" if task.note else ""), flush=True)


def precision(device, dtype):
    """announce()'s words on the arithmetic: the autocast dtype, or why it is float32."""
    low = cli.autocast_dtype(device, dtype)  # None: float32
    if low:
        return f", {str(low)[6:]} autocast"
    if dtype in ("bfloat16", "float16"):
        return f", float32 (--dtype {dtype} is for CUDA)"
    if dtype == "auto" and device.startswith("cuda"):
        return ", float32 (this GPU has no native bfloat16; --dtype float16 uses its tensor cores)"
    return ""


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
