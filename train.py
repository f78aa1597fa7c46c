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
from cli import UserError
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
        self.pending = []  # (step, lr, loss tensor, non-finite tensor) not yet in steps.jsonl
        self.distributed = False  # under torchrun a repeated signal never aborts (see _stop)

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
            raise UserError(f"cannot write to --out_dir {self.out_dir}: {e.strerror or e}") \
                from None
        import fcntl
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"{self.out_dir} is in use by another training run: wait for it, or "
                            f"choose another --out_dir") from None
        held = [n for n in self.OWN if os.path.exists(self.path(n))]
        if held and not resuming:  # (check_run_folder said so already, unless it appeared since)
            raise UserError(f"{self.out_dir} already holds a run ({', '.join(held)}): continue "
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
            raise UserError(f"could not append to {self.path(name)}: {e.strerror or e}; "
                            f"{self.last_good()}") from None

    def after_step(self, loss, bad, dist):
        """Keep the step's loss on the device; every --log_interval steps (and before any
        evaluation, checkpoint or stop) `flush` reads them all at once into steps.jsonl, so a
        GPU step waits for no read-back.  Three steps in, on a CPU, the time an epoch will take
        (and where to find a run sized for a laptop)."""
        st = self.state
        self.pending.append((st.step, st.lr, loss.value.detach(), bad))
        if st.step % self.args.log_interval == 0:
            self.flush(dist)
        if st.step == self.first_step + 3 and self.master and dist.device == "cpu":
            r = self.since_eval
            rate = r["tokens"] * dist.world / max(time.time() - r["t0"], 1e-9)
            hours = self.epoch_tokens / max(rate, 1e-9) / 3600
            took = f"{hours:.1f} h" if hours >= 1 else f"{60 * hours:.1f} min"
            print(f"\n{rate:,.0f} tokens/s on this CPU: about {took} per epoch"
                  + ("; for a run sized for a laptop see `python reproduce.py nmst-table1 "
                     "--scale cpu` (README, Coursework)" if hours > 1 else ""), flush=True)

    def flush(self, dist):
        """Read the pending steps' losses (one read), append them to steps.jsonl, and stop the
        run when a loss was not finite on any process."""
        if not self.pending:
            return
        losses = torch.stack([p[2].float() for p in self.pending])
        bad = torch.stack([p[3] for p in self.pending]).float()
        if dist.world > 1:
            import torch.distributed as tdist
            tdist.all_reduce(bad)
        values = torch.cat([losses, bad]).tolist()  # the one read
        n, records, self.pending = len(self.pending), self.pending, []
        for (step, lr, _, _), loss in zip(records, values[:n]):
            self.append("steps.jsonl", dict(step=step, loss=loss, lr=lr))
        first_bad = next((r[0] for r, b in zip(records, values[n:]) if b), None)
        if first_bad is not None:
            raise UserError(f"non-finite training loss at step {first_bad}; stopping. "
                            f"{self.last_good().capitalize()} (try a lower --lr or --grad_clip)")

    def should_stop(self, dist):
        """-> why every process stops after this step, or None: the step / time limit and the
        signals, decided together so that all processes stop on the same step (one small
        all-reduce per step under torchrun; each clock only votes)."""
        st, args = self.state, self.args
        done = limit_reached(args, st)
        if dist.world == 1:
            return done
        votes = dist.all_sum([float(done is not None), float(self.stop_requested is not None)])
        if votes[1] and not self.stop_requested:
            self.stop_requested = "a signal to another process"
        if votes[0] and not done:
            done = f"reached --max_minutes {args.max_minutes:g} (on another process's clock)"
        return done

    def last_good(self):
        last = self.path("ckpt_last.pt")
        return f"the last good checkpoint is {last}" if os.path.exists(last) else \
            "no checkpoint was written yet"

    def save(self, name, lm, optimizer, task, cfg, data, dist, scaler=None):
        if not bool(torch.stack([torch.isfinite(p).all() for p in lm.parameters()]).all()):
            raise UserError(f"non-finite weights at step {self.state.step}; stopping. "
                            f"{self.last_good().capitalize()} (try a lower --lr or --grad_clip)")
        ranks = rng_states(dist)  # every process's generators (each draws its own dropout)
        if not self.master:
            return
        save_checkpoint(dict(config=cfg, model=lm.state_dict(), optimizer=optimizer.state_dict(),
                             train_state=dataclasses.asdict(self.state),
                             task_state=task.state(), rng=dict(ranks[0], ranks=ranks),
                             args=vars(self.args), data=data,
                             scaler=scaler.state_dict() if scaler else None),
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
        restore_rng(ckpt["rng"], dist, self.args.seed, self.state.step)
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
        if self.stop_requested:
            if signum == signal.SIGINT and not self.distributed:  # Ctrl-C again: abort now
                raise KeyboardInterrupt
            return  # already stopping (torchrun forwards a signal the scheduler also sent)
        self.stop_requested = SIGNAL_NAMES.get(signum, signal.Signals(signum).name)
        again = "" if self.distributed else " (Ctrl-C again to abort)"
        print(f"\n{self.stop_requested}: finishing this step and writing a checkpoint{again}",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.lock:
            self.lock.close()
        return False


def rng_states(dist):
    """[dict(torch=..., cuda=...)] of every process, rank by rank (gathered under torchrun)."""
    own = dict(torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state() if dist.device.startswith("cuda") else None)
    if dist.world == 1:
        return [own]
    import torch.distributed as tdist
    ranks = [None] * dist.world
    tdist.all_gather_object(ranks, own)
    return ranks


def restore_rng(rng, dist, seed, step):
    """This process's own generators from a checkpoint; when it was written by another number
    of processes, a fresh state per process from (seed, rank, step) instead."""
    ranks = rng.get("ranks") or [dict(torch=rng["torch"], cuda=rng.get("cuda"))]
    if len(ranks) == dist.world:
        mine = ranks[dist.rank]
        torch.set_rng_state(mine["torch"])
        if dist.device.startswith("cuda") and mine.get("cuda") is not None:
            torch.cuda.set_rng_state(mine["cuda"])
    else:
        torch.manual_seed((seed * 1_000_003 + dist.rank) * 1_000_003 + step)


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
            loss, bad = accumulate(task, model, keys[s * args.grad_accum:(s + 1) *
                                                     args.grad_accum], run, dist, autocast)
            run.scaler.unscale_(optimizer)  # (every scaler call is a no-op unless float16)
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(lm.parameters(), args.grad_clip)
            run.scaler.step(optimizer)
            run.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            st.step, st.batch_in_epoch = st.step + 1, s + 1
            run.after_step(loss, bad, dist)
            st.elapsed = time.time() - run.t_start
            st.done = run.should_stop(dist)
            if (args.eval_interval and st.step % args.eval_interval == 0) or st.done:
                validate(args, task, lm, run, dist, save, autocast)
                save("ckpt_last.pt")
            if st.done or run.stop_requested:
                break
        if run.stop_requested:
            run.flush(dist)
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
    gradients averaged.  Nothing is read back from the device here: the loss sums and the count
    of non-finite losses stay there (Run.flush reads them).  -> (the last Loss, non-finite
    micro-batches (a 0-dim tensor))."""
    accum = len(keys) // dist.world
    model.train()
    bad = 0
    for j in range(accum):
        batch = task.batch(keys[dist.rank * accum + j], dist.device)
        if dist.world > 1:  # all-reduce the gradients on the last micro-batch only
            model.require_backward_grad_sync = j == accum - 1
        with autocast or contextlib.nullcontext():
            loss = task.loss(model, batch)
        run.scaler.scale(loss.value / accum).backward()
        bad = bad + (~torch.isfinite(loss.value.detach())).int()
        tally(run, loss)
    return loss, bad


def next_epoch(args, task, lm, run, dist, save, autocast):
    """The epoch's end: the next epoch (or --max_epochs reached); without --eval_interval, or
    at the end, evaluate what was trained since the last evaluation, and checkpoint."""
    st = run.state
    st.epoch, st.batch_in_epoch = st.epoch + 1, 0
    if st.epoch >= args.max_epochs:
        st.done = f"reached --max_epochs {args.max_epochs}"
    if not args.eval_interval or st.done:
        run.flush(dist)
        if dist.all_sum([run.since_eval["n"]])[0]:
            validate(args, task, lm, run, dist, save, autocast)
        save("ckpt_last.pt")


def progress(steps, st, n_steps, rank):
    """The epoch's steps with a tqdm bar on the main process's terminal."""
    from tqdm import tqdm
    return tqdm(steps, total=n_steps, initial=st.batch_in_epoch, desc=f"epoch {st.epoch}",
                leave=False, disable=None if rank == 0 else True)


def tally(run, loss):
    """Running sums since the last evaluation: the nll on the device, the counts on the host."""
    r = run.since_eval
    r["nll"], r["n"], r["tokens"] = r["nll"] + loss.nll.detach().double(), r["n"] + loss.n, \
        r["tokens"] + loss.tokens


def validate(args, task, lm, run, dist, save, autocast):
    """Evaluate, log one line, keep the best checkpoint, lower a plateau lr, stop early."""
    st, r = run.state, run.since_eval
    run.flush(dist)
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
    mfu = tok_per_s * run.flops_per_token / (run.peak * dist.world) if run.peak else None
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
    check_run_folder(args)  # on every process, before torchrun's process group exists
    dist = cli.setup_distributed(args)
    cli.setup_device(dist.device)  # cuda:N current, TF32; before anything touches the device
    master = dist.rank == 0
    torch.manual_seed(args.seed + dist.rank)  # before the model is built: its initial weights
    vocab = ckpt["data"].get("vocab") if ckpt else None
    task = dist.rank0_first(lambda: load_task(vars(args), args.data_dir, vocab=vocab,
                                              verbose=master))  # one process prepares the data
    if ckpt:
        check_same_data(ckpt["data"], task.signature, ("train", "valid"), path)
    check_data_fits(args, task, dist)
    cfg = model_config(args, task.vocab_size, task.eos_id)
    lm = build_model(cfg)
    if args.init_from != "scratch" and ckpt is None:
        if task.meta["tokenizer"] != "gpt2":
            raise UserError(f"--init_from {args.init_from} needs the GPT-2 BPE vocabulary; "
                            f"{args.dataset} is {task.meta['tokenizer']}-level (use wikitext103)")
        dist.rank0_first(lambda: load_pretrained_gpt2(lm, args.init_from, args.weights))
    return run_training(args, task, lm, cfg, ckpt, dist)


def check_run_folder(args):
    """A fresh run refuses a folder that holds a run (every process checks, so that none is
    left waiting for a collective when rank 0 refuses)."""
    import fcntl
    try:
        lock = open(os.path.join(args.out_dir, ".lock"))  # only looked at, not held
    except OSError:  # no lock file, or no folder (Run.open says when it cannot be written)
        lock = None
    if lock is not None:
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise UserError(f"{args.out_dir} is in use by another training run: wait for "
                                f"it, or choose another --out_dir") from None
    held = [n for n in Run.OWN if os.path.exists(os.path.join(args.out_dir, n))]
    if held and not args.resume:
        raise UserError(f"{args.out_dir} already holds a run ({', '.join(held)}): continue "
                        f"it with --resume, or choose another --out_dir")


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
        raise UserError(f"an epoch here has {n_batches} batch(es), fewer than --grad_accum "
                        f"{args.grad_accum}: no optimizer step would run (lower --grad_accum or "
                        f"--batch_size / --max_tokens, raise --train_seqs, or check that "
                        f"--block_size {args.block_size} holds some training sequences)")
    if task.name == "completion":
        sizes = task.eval_sizes()
        if not len(batches_of(task, sizes)):
            raise UserError(f"no validation sequence fits (--eval_seqs {args.eval_seqs}, "
                            f"--block_size {args.block_size})")
    if task.name == "story":
        longest = max(len(s["tokens"]) for split in task.splits.values() for s in split)
        if longest > args.block_size:
            raise UserError(f"a sequence of {longest} tokens exceeds --block_size "
                            f"{args.block_size}")


def batches_of(task, sizes):
    from data.loader import batches
    return batches(task.splits["valid"].lengths, limit=task.eval_seqs or None, **sizes)


def run_training(args, task, lm, cfg, ckpt, dist):
    """Build the optimizer, restore a checkpoint, open the run folder and train."""
    lm = lm.to(dist.device)  # the first CUDA kernel
    optimizer = configure_optimizer(lm, args, dist.device)
    run = Run(args, master=dist.rank == 0)
    run.distributed = dist.world > 1
    # float16 needs loss scaling (its gradients underflow); a disabled scaler is a no-op
    fp16 = cli.autocast_dtype(dist.device, args.dtype) == torch.float16
    run.scaler = torch.amp.GradScaler(dist.device.split(":")[0], enabled=fp16)
    if ckpt is not None and not run.restore(ckpt, lm, optimizer, task, cfg, dist):
        return 0
    if ckpt is not None and fp16 and ckpt.get("scaler"):
        run.scaler.load_state_dict(ckpt["scaler"])
    if args.compile:
        compile_model(lm)
    model = lm
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [int(dist.device.split(":")[1])] if dist.device.startswith("cuda") else None
        model = DDP(lm, device_ids=ids)
    run.epoch_tokens, run.peak = token_count(task), cli.peak_flops(args, dist.device)
    sequences = 1 if task.name == "stream" else \
        max(1, min(len(task.splits["train"]), args.train_seqs or math.inf))
    run.flops_per_token = lm.flops_per_token(run.epoch_tokens / sequences) \
        if task.name != "story" else 0
    run.first_step = run.state.step

    def save(name):
        run.save(name, lm, optimizer, task, cfg, task.signature, dist, run.scaler)

    with run:
        dist.rank0_first(lambda: run.open(resuming=args.resume))  # the lock: rank 0's
        if dist.rank == 0:
            announce(args, task, lm, dist, ckpt)
        message = train(args, task, lm, model, optimizer, run, dist, save)
    if dist.rank == 0:
        print(message)
    if dist.world > 1:
        import torch.distributed as tdist
        tdist.destroy_process_group()
    return 0


def compile_model(lm, backend="inductor"):
    """torch.compile in place (state_dict keys stay unchanged), with dynamic shapes: batches
    come in ever new (B, T), which would otherwise recompile until torch gives up."""
    lm.compile(dynamic=True, backend=backend)


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
