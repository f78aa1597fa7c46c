"""Train a nanogen model: one loop for every task (tasks.py) and every model.

    python train.py --model lstm --head nmst --dataset wikitext2     # the 2x512 LSTM recipe
    python train.py --head nmst --dataset wikitext103                # GPT-2 shape, from scratch
    python train.py --init_from gpt2 --head nmst --dataset wikitext103   # GPT-2 finetuning
    python train.py --model lstm --task stream --head ctmos --dataset ptb  # CT paper
    python train.py --model insnet --dataset rocstories [--task storyline]  # InsNet
    python train.py ... --resume                                     # go on from ckpt_last.pt

Loss: NMST paper eq. 3, the negative log-likelihood of the continuation tokens (eos included)
given the context, averaged over a batch's tokens (the other tasks: tasks.py).  The defaults of
each --model are recipes.RECIPES (NMST paper section 4 and appendix D; InsNet paper section
4.3); a flag given on the command line wins, and recipes.RULES rejects combinations that cannot
work, before anything is read or written.  Gradient-norm clipping at 1.0 is nanogen's choice
(the paper does not say).
"""
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time

import torch

import cli
import fast
from checkpoint import CheckpointError, load_pretrained_gpt2
from checkpoint import load as load_checkpoint
from checkpoint import save as save_checkpoint
from recipes import STORY, build_parser, model_config, resolve, resume_args
from tasks import build_model, check_same_data, load_task, token_count

# --------------------------------------------------------------------------------------------
# optimisation
# --------------------------------------------------------------------------------------------
def configure_optimizer(lm, args, device):
    """AdamW; weight decay on matrices (dim >= 2) only, not on biases / LayerNorm gains."""
    params = {id(p): p for p in lm.parameters() if p.requires_grad}.values()  # tied: once
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    fused = device.split(":")[0] in ("cuda", "cpu")  # one kernel for all tensors
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=fused)


def learning_rate(args, st):
    """plateau / constant: the current lr (plateau lowers it after evaluations); linear: warm-up
    over --warmup steps, then linear decay to 0 at --decay_steps."""
    if args.lr_schedule != "linear":
        return st.lr
    warm = min(1.0, (st.step + 1) / args.warmup) if args.warmup else 1.0
    return args.lr * warm * max(0.0, 1.0 - st.step / args.decay_steps)


# --------------------------------------------------------------------------------------------
# run bookkeeping: the folder, its lock, logs, checkpoints and stop signals
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_val: float = math.inf
    bad_evals: int = 0
    lr: float = 0.0
    done: str = None
    elapsed: float = 0.0  # seconds of training, evaluations included, over all resumes


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM",
                signal.SIGHUP: "SIGHUP"}


class Run:
    """One run's folder and books.  The folder is locked for the run's length; a fresh run
    refuses a folder holding checkpoints or logs; logs are appended line by line (a torn last
    line is dropped on resume); checkpoints are written atomically (checkpoint.py); Ctrl-C,
    SIGTERM and SIGHUP finish the step, write ckpt_last.pt and exit 0."""
    OWN = ("ckpt_last.pt", "ckpt_best.pt", "log.jsonl", "steps.jsonl")

    def __init__(self, args, master=True):
        self.args, self.out_dir, self.master = args, args.out_dir, master
        self.state, self.stop_requested, self.lock = TrainState(lr=args.lr), None, None
        self.since_eval = dict(nll=0.0, n=0, tokens=0, t0=time.time())

    def path(self, name):
        return os.path.join(self.out_dir, name)

    def open(self, resuming):
        """Lock the folder (before anything is written) and clean it for this run."""
        if not self.master:
            return
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.lock = open(self.path(".lock"), "a+")
        except OSError as e:
            raise ValueError(f"cannot write to --out_dir {self.out_dir}: {e.strerror or e}") \
                from None
        import fcntl
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"{self.out_dir} is in use by another training run: wait for it, or "
                             f"choose another --out_dir") from None
        held = [n for n in self.OWN if os.path.exists(self.path(n))]
        if held and not resuming:
            raise ValueError(f"{self.out_dir} already holds a run ({', '.join(held)}): continue "
                             f"it with --resume, or choose another --out_dir")
        if resuming and "ckpt_last.pt" not in held:
            print(f"note: {self.out_dir} holds no checkpoint yet (the run stopped before its "
                  f"first one): starting again from step 0", file=sys.stderr)
        for name in os.listdir(self.out_dir):  # temporary files of an interrupted write
            if name.startswith(".ckpt_") and name.endswith(".tmp"):
                os.remove(self.path(name))
        for name in ("log.jsonl", "steps.jsonl"):
            keep_log_until(self.path(name), self.state.step)

    def append(self, name, record):
        if not self.master:
            return
        try:
            with open(self.path(name), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise ValueError(f"could not append to {self.path(name)}: {e.strerror or e}; "
                             f"{self.last_good()}") from None

    def after_step(self, loss, dist):
        """The step's line in steps.jsonl; three steps in, on a CPU, the time an epoch will take
        (and where to find a run sized for a laptop)."""
        st = self.state
        self.append("steps.jsonl", dict(step=st.step, loss=loss.value.item(), lr=st.lr))
        if st.step == self.first_step + 3 and self.master and dist.device == "cpu":
            r = self.since_eval
            rate = r["tokens"] * dist.world / max(time.time() - r["t0"], 1e-9)
            hours = self.epoch_tokens / max(rate, 1e-9) / 3600
            took = f"{hours:.1f} h" if hours >= 1 else f"{60 * hours:.1f} min"
            print(f"\n{rate:,.0f} tokens/s on this CPU: about {took} per epoch"
                  + ("; for a run sized for a laptop see `python reproduce.py nmst-table1 "
                     "--scale cpu` (README, Coursework)" if hours > 1 else ""), flush=True)

    def last_good(self):
        last = self.path("ckpt_last.pt")
        return f"the last good checkpoint is {last}" if os.path.exists(last) else \
            "no checkpoint was written yet"

    def save(self, name, lm, optimizer, task, cfg, data):
        if not all(bool(torch.isfinite(p).all()) for p in lm.parameters()):
            raise ValueError(f"non-finite weights at step {self.state.step}; stopping. "
                             f"{self.last_good().capitalize()} (try a lower --lr or --grad_clip)")
        if not self.master:
            return
        rng = dict(torch=torch.get_rng_state(),
                   cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        save_checkpoint(dict(config=cfg, model=lm.state_dict(), optimizer=optimizer.state_dict(),
                             train_state=dataclasses.asdict(self.state),
                             task_state=task.state(), rng=rng, args=vars(self.args), data=data),
                        self.path(name))

    def restore(self, ckpt, lm, optimizer, task, cfg, dist):
        """Model, optimizer, counters, RNG and task state from ckpt_last.pt.  -> False when the run
        had already finished (nothing to do)."""
        if ckpt["config"] != cfg:
            raise CheckpointError(f"{self.path('ckpt_last.pt')} does not match this model / "
                                  f"vocabulary")
        lm.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        saved = dict(ckpt["train_state"])
        task.load_state(ckpt.get("task_state") or dict(hidden=saved.pop("hidden", None)))
        self.state = TrainState(**{f.name: saved[f.name]
                                   for f in dataclasses.fields(TrainState) if f.name in saved})
        torch.set_rng_state(ckpt["rng"]["torch"])
        if dist.device.startswith("cuda") and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        st, args = self.state, self.args
        if st.done and st.done.startswith("reached"):  # a step / epoch / time limit: may be raised
            again = limit_reached(args, st) or st.epoch >= args.max_epochs
            st.done = "reached the same limit again" if again else None
        if st.done and dist.rank == 0:
            print(f"{args.out_dir}: this run already finished ({st.done}); nothing to do (raise "
                  f"--max_iters / --max_epochs / --max_minutes to go on)")
        return not st.done

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._stop) for s in
                         (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return self

    def _stop(self, signum, frame):
        if self.stop_requested:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.stop_requested = SIGNAL_NAMES.get(signum, signal.Signals(signum).name)
        print(f"\n{self.stop_requested}: finishing this step and writing a checkpoint (again to "
              f"abort)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.lock:
            self.lock.close()
        return False


def keep_log_until(path, step):
    """The logs may hold records past the checkpoint a run resumes from, or a torn last line
    (a crash or a full disk mid-write): keep the whole records up to `step`, drop the rest."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a torn or foreign line: everything after it is dropped too
    with cli.atomic_file(path) as f:
        f.writelines(keep)


# --------------------------------------------------------------------------------------------
# the training loop
# --------------------------------------------------------------------------------------------
def train(args, task, lm, model, optimizer, run, dist, save):
    """One loop for every task: lr -> micro-batches (gradient accumulation; DDP syncs on the
    last) -> clip -> step -> log, evaluate, checkpoint, stop.  The task makes and scores the
    batches (tasks.py); `run` keeps the books; `save(name)` writes a checkpoint."""
    st, autocast = run.state, cli.autocast_context(dist.device, args.dtype)
    run.t_start = time.time() - st.elapsed
    while not st.done:
        keys = task.epoch(st.epoch)
        n_steps = len(keys) // args.grad_accum  # the last len % grad_accum batches are skipped
        for s in progress(range(st.batch_in_epoch, n_steps), st, n_steps, dist.rank):
            st.lr = learning_rate(args, st)
            for group in optimizer.param_groups:
                group["lr"] = st.lr
            loss = accumulate(task, model, keys[s * args.grad_accum:(s + 1) * args.grad_accum],
                              run, dist, autocast)
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(lm.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            st.step, st.batch_in_epoch = st.step + 1, s + 1
            run.after_step(loss, dist)
            st.elapsed = time.time() - run.t_start
            st.done = limit_reached(args, st)
            if (args.eval_interval and st.step % args.eval_interval == 0) or st.done:
                validate(args, task, lm, run, dist, save, autocast)
                save("ckpt_last.pt")
            if st.done or run.stop_requested:
                break
        if run.stop_requested:
            save("ckpt_last.pt")
            return stopped_message(run)
        if not st.done:
            next_epoch(args, task, lm, run, dist, save, autocast)
    save("ckpt_last.pt")
    return f"done ({st.done}) after {st.step} steps; best validation loss {st.best_val:.4f} " \
           f"(ppl {math.exp(min(st.best_val, 700)):.2f}); checkpoints in {args.out_dir}"


def limit_reached(args, st):
    """-> why the run stops after this step (--max_iters, --max_minutes), or None."""
    if args.max_iters and st.step >= args.max_iters:
        return f"reached --max_iters {args.max_iters}"
    if args.max_minutes and st.elapsed >= 60 * args.max_minutes:
        return f"reached --max_minutes {args.max_minutes:g}"
    return None


def accumulate(task, model, keys, run, dist, autocast):
    """Forward and backward over one step's micro-batches (this process's share of `keys`),
    gradients averaged; a non-finite loss on any process stops the run.  -> the last Loss."""
    accum = len(keys) // dist.world
    model.train()
    bad = 0.0
    for j in range(accum):
        batch = task.batch(keys[dist.rank * accum + j], dist.device)
        if dist.world > 1:  # all-reduce the gradients on the last micro-batch only
            model.require_backward_grad_sync = j == accum - 1
        with autocast or contextlib.nullcontext():
            loss = task.loss(model, batch)
        (loss.value / accum).backward()
        cli.kill_point("step")
        bad += not bool(torch.isfinite(loss.value))
        tally(run, loss)
    if dist.all_sum([bad])[0]:
        raise ValueError(f"non-finite training loss at step {run.state.step + 1}; stopping. "
                         f"{run.last_good().capitalize()} (try a lower --lr or --grad_clip)")
    return loss


def next_epoch(args, task, lm, run, dist, save, autocast):
    """The epoch's end: the next epoch (or --max_epochs reached); without --eval_interval, or
    at the end, evaluate what was trained since the last evaluation, and checkpoint."""
    st = run.state
    st.epoch, st.batch_in_epoch = st.epoch + 1, 0
    if st.epoch >= args.max_epochs:
        st.done = f"reached --max_epochs {args.max_epochs}"
    if not args.eval_interval or st.done:
        if dist.all_sum([run.since_eval["n"]])[0]:
            validate(args, task, lm, run, dist, save, autocast)
        save("ckpt_last.pt")


def progress(steps, st, n_steps, rank):
    """The epoch's steps with a tqdm bar on the main process's terminal."""
    from tqdm import tqdm
    return tqdm(steps, total=n_steps, initial=st.batch_in_epoch, desc=f"epoch {st.epoch}",
                leave=False, disable=None if rank == 0 else True)


def tally(run, loss):
    r = run.since_eval
    r["nll"], r["n"], r["tokens"] = r["nll"] + loss.nll.item(), r["n"] + loss.n, \
        r["tokens"] + loss.tokens


def validate(args, task, lm, run, dist, save, autocast):
    """Evaluate, log one line, keep the best checkpoint, lower a plateau lr, stop early."""
    st, r = run.state, run.since_eval
    nll, n, tokens = dist.all_sum([r["nll"], r["n"], r["tokens"]])
    tok_per_s = tokens / max(time.time() - r["t0"], 1e-9)
    cli.kill_point("evaluation")
    val = task.evaluate(lm, dist.device, rank=dist.rank, world=dist.world, autocast=autocast)
    if not math.isfinite(val["nll"]):
        raise ValueError(f"non-finite validation loss at step {st.step}; stopping. "
                         f"{run.last_good().capitalize()} (try a lower --lr)")
    improved = val["nll"] < st.best_val
    st.best_val, st.bad_evals = min(st.best_val, val["nll"]), 0 if improved else st.bad_evals + 1
    if not improved and args.lr_schedule == "plateau":
        st.lr *= args.lr_decay
    if st.bad_evals >= args.patience:
        st.done = f"early stop: no improvement in {args.patience} evaluations"
    mfu = tok_per_s * run.flops_per_token / run.peak if run.peak else None
    rec = dict(step=st.step, epoch=st.epoch, train_loss=nll / max(n, 1), val_loss=val["nll"],
               val_ppl=math.exp(min(val["nll"], 700)), lr=st.lr, tokens_per_s=tok_per_s, mfu=mfu,
               best=improved, elapsed_s=time.time() - run.t_start,
               **{k: v for k, v in val.items() if k == "nll_per_story"})
    if dist.rank == 0:
        print(f"step {st.step:7d} | epoch {st.epoch:3d} | train loss {rec['train_loss']:.4f} | "
              f"val loss {val['nll']:.4f} | val ppl {rec['val_ppl']:9.2f} | lr {st.lr:.2e} | "
              f"{tok_per_s:8.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
              + (" | best" if improved else ""), flush=True)
    run.append("log.jsonl", rec)
    if improved:
        save("ckpt_best.pt")
    run.since_eval = dict(nll=0.0, n=0, tokens=0, t0=time.time())


def stopped_message(run):
    best = os.path.exists(run.path("ckpt_best.pt"))
    return (f"stopped by {run.stop_requested} after step {run.state.step}; checkpoint written: "
            f"continue with the same command and --resume.  evaluate.py can read "
            f"{run.path('ckpt_last.pt')}" + ("" if best else " (no ckpt_best.pt yet: no "
                                                             "evaluation has run)"))


# --------------------------------------------------------------------------------------------
# main: arguments -> data -> model -> run folder -> the loop
# --------------------------------------------------------------------------------------------
def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = {k: v for k, v in vars(args).items() if v != parser.get_default(k)}
    args, ckpt = resolve(args, explicit), None
    path = os.path.join(args.out_dir, "ckpt_last.pt")
    if args.resume and os.path.exists(path):
        ckpt = load_checkpoint(path)
        args = resume_args(args, explicit, ckpt, path)
    elif args.resume:
        check_nothing_to_resume(args.out_dir)
    dist = cli.setup_distributed(args)
    master = dist.rank == 0
    torch.manual_seed(args.seed + dist.rank)  # before the model is built: its initial weights
    task = load_task(vars(args), args.data_dir, vocab=ckpt["data"].get("vocab") if ckpt else None,
                     verbose=master)
    if ckpt:
        check_same_data(ckpt["data"], task.signature, ("train", "valid"), path)
    check_data_fits(args, task, dist)
    cfg = model_config(args, task.vocab_size, task.eos_id)
    lm = build_model(cfg)
    if args.init_from != "scratch" and ckpt is None:
        if task.meta["tokenizer"] != "gpt2":
            raise ValueError(f"--init_from {args.init_from} needs the GPT-2 BPE vocabulary; "
                             f"{args.dataset} is {task.meta['tokenizer']}-level (use wikitext103)")
        load_pretrained_gpt2(lm, args.init_from, args.weights)
    return run_training(args, task, lm, cfg, ckpt, dist)


def check_nothing_to_resume(out_dir):
    """--resume without ckpt_last.pt: an error, unless the folder holds only the logs of a run
    stopped before its first checkpoint, which then starts again from step 0 (Run.open says so)."""
    path = os.path.join(out_dir, "ckpt_last.pt")
    logs = [n for n in ("steps.jsonl", "log.jsonl") if os.path.exists(os.path.join(out_dir, n))]
    if not logs or os.path.exists(os.path.join(out_dir, "ckpt_best.pt")):
        raise CheckpointError(f"--resume: no checkpoint {path}; start without --resume")


def check_data_fits(args, task, dist):
    """Runs that would silently do nothing are errors: no optimizer step in an epoch, nothing to
    validate on, a story longer than the window."""
    n_batches = len(task.epoch(0))
    if n_batches // args.grad_accum == 0:
        raise ValueError(f"an epoch here has {n_batches} batch(es), fewer than --grad_accum "
                         f"{args.grad_accum}: no optimizer step would run (lower --grad_accum or "
                         f"--batch_size / --max_tokens, raise --train_seqs, or check that "
                         f"--block_size {args.block_size} holds some training sequences)")
    if task.name == "completion":
        sizes = task.eval_sizes()
        if not len(batches_of(task, sizes)):
            raise ValueError(f"no validation sequence fits (--eval_seqs {args.eval_seqs}, "
                             f"--block_size {args.block_size})")
    if task.name == "story":
        longest = max(len(s["tokens"]) for split in task.splits.values() for s in split)
        if longest > args.block_size:
            raise ValueError(f"a sequence of {longest} tokens exceeds --block_size "
                             f"{args.block_size}")


def batches_of(task, sizes):
    from data.loader import batches
    return batches(task.splits["valid"].lengths, limit=task.eval_seqs or None, **sizes)


def run_training(args, task, lm, cfg, ckpt, dist):
    """Build the optimizer, restore a checkpoint, open the run folder and train."""
    lm = lm.to(dist.device)
    if dist.device.startswith("cuda"):
        torch.cuda.set_device(dist.device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if dist.device == "cpu" and fast.KEEP_FREED_MEMORY:  # the CPU fast path (fast.py)
        fast.tune_cpu_allocator()
    optimizer = configure_optimizer(lm, args, dist.device)
    run = Run(args, master=dist.rank == 0)
    if ckpt is not None and not run.restore(ckpt, lm, optimizer, task, cfg, dist):
        return 0
    if args.compile:  # compile in place (state_dict keys stay unchanged)
        lm.compile()
    model = lm
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [int(dist.device.split(":")[1])] if dist.device.startswith("cuda") else None
        model = DDP(lm, device_ids=ids)
    run.epoch_tokens, run.peak = token_count(task), cli.peak_flops(args, dist.device)
    sequences = 1 if task.name == "stream" else max(1, len(task.splits["train"]))
    run.flops_per_token = lm.flops_per_token(run.epoch_tokens / sequences) \
        if task.name != "story" else 0
    run.first_step = run.state.step

    def save(name):
        run.save(name, lm, optimizer, task, cfg, task.signature)

    with run:
        run.open(resuming=args.resume)
        if dist.rank == 0:
            announce(args, task, lm, dist, ckpt)
        message = train(args, task, lm, model, optimizer, run, dist, save)
    if dist.rank == 0:
        print(message)
    if dist.world > 1:
        import torch.distributed as tdist
        tdist.destroy_process_group()
    return 0


def announce(args, task, lm, dist, ckpt):
    """What is about to be trained, before the first step."""
    what = f"{args.model} + {args.head} head" if args.dataset not in STORY else \
        f"{args.model} ({args.task}{', order ' + args.order if args.model != 'gpt' else ''})"
    print(f"{what} on {args.dataset}: {lm.num_params():,} parameters, V={task.vocab_size:,}, "
          f"{token_count(task):,} training tokens per epoch, device {dist.device}"
          + (f" x {dist.world} processes" if dist.world > 1 else "")
          + (f", resuming at step {ckpt['train_state']['step']}" if ckpt else "")
          + (f"; {task.note}" if task.note else ""), flush=True)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
