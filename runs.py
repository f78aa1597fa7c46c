"""A training run's folder and books, so that train.py can be read as the loop alone.

The folder (--out_dir) is locked for the run's length, and knows its run (run.json: an id that
every checkpoint written there carries, so a foreign ckpt_last.pt is refused).  A fresh run
refuses a folder holding a run.  Logs are appended line by line: steps.jsonl gets every step's
loss (read from the device every --log_interval steps), log.jsonl every evaluation; on resume
the records past the checkpoint, and any damaged line, are dropped (saying so).  Checkpoints are
written atomically (checkpoint.py) with every process's RNG state.  Ctrl-C, SIGTERM and SIGHUP
finish the step, write ckpt_last.pt and exit 0; under torchrun the stop decisions (signals,
--max_minutes) are taken together, so every process stops on the same step.
"""
import dataclasses
import json
import math
import os
import signal
import sys
import time
import uuid

import torch

try:
    import fcntl
except ImportError:  # Windows: msvcrt's lock, exclusive only
    fcntl = None
    import msvcrt

import cli
from checkpoint import CheckpointError
from checkpoint import save as save_checkpoint
from cli import UserError

OWN = ("ckpt_last.pt", "ckpt_best.pt", "log.jsonl", "steps.jsonl")  # what makes a folder a run's
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
if hasattr(signal, "SIGHUP"):  # (not on Windows)
    SIGNAL_NAMES[signal.SIGHUP] = "SIGHUP"


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


class Run:
    """One run's folder and books (see the module docstring).  dist: cli.Dist; scaler: the
    float16 GradScaler (a disabled one otherwise); epoch_tokens: for the CPU epoch estimate."""

    def __init__(self, args, dist, scaler, epoch_tokens=0, epoch_steps=1):
        self.args, self.out_dir, self.dist, self.scaler = args, args.out_dir, dist, scaler
        self.master, self.epoch_tokens, self.epoch_steps = dist.rank == 0, epoch_tokens, \
            max(epoch_steps, 1)
        self.timed = []  # (seconds, tokens) of the steps timed for the CPU estimate
        self.warm = 4 if args.compile else 1  # steps left out of it (--compile: recompiles)
        self.state, self.lock = TrainState(lr=args.lr), None
        self.signalled = None  # the signal this process got (set by its handler, at any time)
        self.stop_requested = None  # the stop every process agreed on (set by should_stop)
        self.restart_interval()  # self.since_eval: the sums of the steps since an evaluation
        self.step_tokens = 0  # tokens of the step under way
        self.pending = []  # (step, lr, loss tensor, non-finite tensor) not yet in steps.jsonl
        self.first_step, self.run_id, self.previous = 0, None, {}
        self.tensorboard = None  # a SummaryWriter with --tensorboard (rank 0)

    def path(self, name):
        return os.path.join(self.out_dir, name)

    # -- the folder ---------------------------------------------------------------------------
    def open(self, resuming):
        """Lock the folder (before anything is written), learn or make its run id, clean it."""
        if not self.master:
            return
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.lock = open(self.path(".lock"), "a+")
        except OSError as e:
            raise UserError(f"cannot write to --out_dir {self.out_dir}: {e.strerror or e}") \
                from None
        take_lock(self.lock, self.out_dir)
        held = refuse_a_run_there(self.out_dir, resuming)  # unless one appeared since
        if resuming and "ckpt_last.pt" not in held:  # killed before its first checkpoint, or
            # between writing ckpt_best.pt and ckpt_last.pt: the newest there is, the same state
            print(f"note: {self.out_dir} holds no ckpt_last.pt: " + (
                f"going on from ckpt_best.pt (step {self.state.step})" if "ckpt_best.pt" in held
                else "the run stopped before its first checkpoint; starting again from step 0"),
                file=sys.stderr)
        self.run_id = self.run_id or folder_run_id(self.out_dir) or uuid.uuid4().hex
        cli.write_json(self.path("run.json"), dict(run_id=self.run_id, args=vars(self.args)))
        for name in os.listdir(self.out_dir):  # an interrupted atomic write's temporary file
            if name.startswith(".") and name.endswith(".tmp"):  # (checkpoint, curves.png, ...)
                os.remove(self.path(name))
        for name in ("log.jsonl", "steps.jsonl"):
            keep_log_until(self.path(name), self.state.step)
        if self.args.tensorboard:
            self.tensorboard = summary_writer()(self.path("tensorboard"),
                                                purge_step=self.state.step + 1)

    def draw(self, record):
        """After an evaluation: RUN/curves.png redrawn from the logs (curves.py; one warning,
        not a failure, when it cannot be written) and, with --tensorboard, the record's
        scalars."""
        if not self.args.no_curves:
            import curves
            curves.draw_run(self.out_dir)
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                        key not in ("step", "epoch"):
                    self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()

    def append(self, name, record):
        if not self.master:
            return
        try:
            with open(self.path(name), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise UserError(f"could not append to {self.path(name)}: {e.strerror or e}; "
                            f"{self.last_good()}") from None

    def last_good(self):
        last = self.path("ckpt_last.pt")
        return f"the last good checkpoint is {last}" if os.path.exists(last) else \
            "no checkpoint was written yet"

    # -- every step -----------------------------------------------------------------------------
    def restart_interval(self):
        """Count the next evaluation's interval afresh: its nll, counts, tokens and clock."""
        self.since_eval = dict(nll=0.0, n=0, tokens=0, t0=time.time())

    def tally(self, nll, n, tokens):
        """Running sums since the last evaluation: the nll on the device, the counts on the
        host (nothing is read back)."""
        r = self.since_eval
        r["nll"], r["n"], r["tokens"] = r["nll"] + nll.detach().double(), r["n"] + n, \
            r["tokens"] + tokens
        self.step_tokens += tokens

    def after_step(self, loss, bad, seconds):
        """Keep the step's loss on the device; every --log_interval steps (and before any
        evaluation, checkpoint or stop) `flush` reads them all at once into steps.jsonl.  On a
        CPU, after steps 2-4 (the first warms up: allocator, compile; with --compile steps
        5-7, after the recompiles of new shapes), the time an epoch and the run will take."""
        st = self.state
        self.pending.append((st.step, st.lr, loss.detach(), bad))
        if st.step % self.args.log_interval == 0:
            self.flush()
        if self.first_step + self.warm < st.step <= self.first_step + self.warm + 3:
            self.timed.append((seconds, self.step_tokens))
        self.step_tokens = 0
        if st.step == self.first_step + self.warm + 3 and self.master and \
                self.dist.device == "cpu":
            self.estimate()

    def estimate(self):
        """The speed of steps 2-4 or 5-7 (no evaluation counted), an epoch's time and the run's
        (--max_iters, else --max_epochs; --max_minutes when sooner) at that speed: the steps
        left hold an epoch's mean tokens per step (the timed steps' may be shorter or longer)."""
        seconds = max(sum(s for s, _ in self.timed), 1e-9)
        rate = max(sum(n for _, n in self.timed) * self.dist.world / seconds, 1e-9)
        args, st = self.args, self.state
        total = args.max_iters or args.max_epochs * self.epoch_steps
        left = max(total - st.step, 0) * self.epoch_tokens / self.epoch_steps / rate
        capped = args.max_minutes and 60 * args.max_minutes - st.elapsed < left
        left = max(60 * args.max_minutes - st.elapsed, 0) if capped else left
        print(f"\n{rate:,.0f} tokens/s on this CPU: {hours(self.epoch_tokens / rate)} "
              f"per epoch; this run ({total:,} steps"
              + (f", about {total / self.epoch_steps:,.1f} epochs" if args.max_iters else "")
              + f") has about {hours(left)} to go" + (" (--max_minutes)" if capped else "")
              + ("; runs sized for a laptop: `python reproduce.py RESULT --scale cpu` (README, "
                 "Coursework)" if left > 3600 else ""), flush=True)

    def flush(self):
        """Read the pending steps' losses (one read), append them to steps.jsonl, and stop the
        run when a loss was not finite on any process."""
        if not self.pending:
            return
        losses = torch.stack([p[2].float() for p in self.pending])
        bad = torch.stack([torch.as_tensor(p[3], device=losses.device) for p in self.pending])
        if self.dist.world > 1:
            import torch.distributed as tdist
            bad = bad.float()
            tdist.all_reduce(bad)
        values = torch.cat([losses, bad.float()]).tolist()  # the one read
        n, records, self.pending = len(self.pending), self.pending, []
        for (step, lr, _, _), loss in zip(records, values[:n]):
            self.append("steps.jsonl", dict(step=step, loss=loss, lr=lr))
        first_bad = next((r[0] for r, b in zip(records, values[n:]) if b), None)
        if first_bad is not None:
            raise UserError(f"non-finite training loss at step {first_bad}; stopping. "
                            f"{self.last_good().capitalize()} (try a lower --lr or --grad_clip)")

    def should_stop(self):
        """-> why every process stops after this step, or None: the step / time limit and the
        signals, decided together so that all processes stop on the same step (one small
        all-reduce per step under torchrun; each process's clock only votes).  A signal that
        arrives once this process has voted waits for the next step's vote."""
        st, args, dist = self.state, self.args, self.dist
        done, signalled = limit_reached(args, st), self.signalled
        if dist.world == 1:
            self.stop_requested = signalled
            return done
        votes = dist.all_sum([float(done is not None), float(signalled is not None)])
        if votes[1]:
            self.stop_requested = signalled or "a signal to another process"
        if votes[0] and not done:
            done = f"reached --max_minutes {args.max_minutes:g} (on another process's clock)"
        return done

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, name, lm, optimizer, task, cfg):
        if not bool(torch.stack([torch.isfinite(p).all() for p in lm.parameters()]).all()):
            raise UserError(f"non-finite weights at step {self.state.step}; stopping. "
                            f"{self.last_good().capitalize()} (try a lower --lr or --grad_clip)")
        ranks = rng_states(self.dist)  # every process's generators (each draws its own dropout)
        if not self.master:
            return
        save_checkpoint(dict(config=cfg, model=lm.state_dict(), optimizer=optimizer.state_dict(),
                             train_state=dataclasses.asdict(self.state),
                             task_state=task.state(), rng=dict(ranks[0], ranks=ranks),
                             args=vars(self.args), data=task.signature, run_id=self.run_id,
                             scaler=self.scaler.state_dict() if self.scaler.is_enabled()
                             else None),
                        self.path(name))

    def restore(self, ckpt, lm, optimizer, task, cfg):
        """Model, optimizer, counters, RNG, scaler and task state from the checkpoint.  -> False
        when the run had already finished (nothing to do)."""
        if ckpt["config"] != cfg:
            raise CheckpointError(f"the checkpoint in {self.out_dir} does not match this model "
                                  f"/ vocabulary")
        self.run_id = ckpt.get("run_id")
        lm.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        saved = dict(ckpt["train_state"])
        task.load_state(ckpt.get("task_state") or dict(hidden=saved.pop("hidden", None)))
        self.state = TrainState(**{f.name: saved[f.name]
                                   for f in dataclasses.fields(TrainState) if f.name in saved})
        restore_rng(ckpt["rng"], self.dist, self.args.seed, self.state.step)
        if self.scaler.is_enabled() and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        st, args = self.state, self.args
        self.first_step = st.step
        if st.done and st.done.startswith("reached"):  # a step / epoch / time limit: may be raised
            again = limit_reached(args, st) or (st.epoch >= args.max_epochs and
                                                f"reached --max_epochs {args.max_epochs}")
            st.done = again and f"{again}, at step {st.step}"
        if st.done and st.done.startswith("early stop") and st.bad_evals < args.patience:
            st.done = None  # a larger --patience: go on
        if st.done and self.master:
            more = "--patience" if st.done.startswith("early stop") else \
                "--max_iters / --max_epochs / --max_minutes"
            print(f"{args.out_dir}: this run already finished ({st.done}); nothing to do (raise "
                  f"{more} to go on)")
        return not st.done

    def stopped_message(self):
        best = os.path.exists(self.path("ckpt_best.pt"))
        return (f"stopped by {self.stop_requested} after step {self.state.step}; checkpoint "
                f"written: continue with the same command and --resume.  evaluate.py can read "
                f"{self.path('ckpt_last.pt')}" + ("" if best else " (no ckpt_best.pt yet: no "
                                                                  "evaluation has run)"))

    # -- signals --------------------------------------------------------------------------------
    def __enter__(self):
        self.previous = {s: signal.signal(s, self._stop) for s in SIGNAL_NAMES}
        return self

    def _stop(self, signum, frame):
        alone = self.dist.world == 1
        if self.signalled or self.stop_requested:
            if signum == signal.SIGINT and alone:  # Ctrl-C again: abort now
                raise KeyboardInterrupt
            return  # already stopping (torchrun forwards a signal the scheduler also sent)
        self.signalled = SIGNAL_NAMES.get(signum, signal.Signals(signum).name)
        again = " (Ctrl-C again to abort)" if alone else ""
        print(f"\n{self.signalled}: finishing this step and writing a checkpoint{again}",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.lock:
            self.lock.close()
        return False


def hours(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def limit_reached(args, st):
    """-> why the run stops after this step (--max_iters, --max_minutes), or None."""
    if args.max_iters and st.step >= args.max_iters:
        return f"reached --max_iters {args.max_iters}"
    if args.max_minutes and st.elapsed >= 60 * args.max_minutes:
        return f"reached --max_minutes {args.max_minutes:g}"
    return None


def check_folder(args):
    """Before anything else (on every process, so that none is left waiting for a collective
    when one refuses): the folder must not be in use, a fresh run must not find a run there,
    --resume must find something to resume, and --tensorboard must find its package."""
    if os.path.islink(args.out_dir) and not os.path.exists(args.out_dir):
        raise UserError(f"--out_dir {args.out_dir} is a symbolic link to a missing folder "
                        f"({os.readlink(args.out_dir)}): create that folder, or choose another "
                        f"--out_dir")
    cli.check_output(args.out_dir, "--out_dir", folder=True)  # a file there, or no way to write
    try:  # only looked at, not held (Windows has no shared lock: there Run.open's lock refuses)
        lock = open(os.path.join(args.out_dir, ".lock")) if fcntl else None
    except OSError:  # no lock file, or no folder (Run.open says when it cannot be written)
        lock = None
    if lock is not None:
        with lock:
            take_lock(lock, args.out_dir, shared=True)
    held = refuse_a_run_there(args.out_dir, args.resume)
    if args.resume and not held:  # (logs alone, or ckpt_best.pt alone: Run.open says so)
        raise CheckpointError(f"--resume: no checkpoint in {args.out_dir}; start without --resume")
    if args.tensorboard:  # (refused now, not once the data is prepared)
        summary_writer()


def summary_writer():
    """--tensorboard: torch's SummaryWriter class, or a one-line error naming the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                        "(then: tensorboard --logdir OUT_DIR)") from None
    return SummaryWriter


def take_lock(lock, out_dir, shared=False):
    """flock without waiting (Windows: msvcrt.locking of the first byte); held by another run:
    a user error."""
    try:
        if fcntl:
            fcntl.flock(lock, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        else:
            lock.seek(0)
            msvcrt.locking(lock.fileno(), msvcrt.LK_NBLCK, 1)
    except OSError:
        raise UserError(f"{out_dir} is in use by another training run: wait for it, or choose "
                        f"another --out_dir") from None


def refuse_a_run_there(out_dir, resuming):
    """-> what of a run the folder holds; a fresh run (not resuming) refuses any of it."""
    held = [n for n in OWN if os.path.exists(os.path.join(out_dir, n))]
    if held and not resuming:
        raise UserError(f"{out_dir} already holds a run ({', '.join(held)}): continue it with "
                        f"--resume, or choose another --out_dir")
    return held


def resume_from(out_dir):
    """The checkpoint --resume goes on from: ckpt_last.pt, else ckpt_best.pt (written at the same
    evaluation, just before it), else None."""
    paths = [os.path.join(out_dir, n) for n in ("ckpt_last.pt", "ckpt_best.pt")]
    return next((p for p in paths if os.path.exists(p)), None)


def check_own_checkpoint(ckpt, path):
    """A checkpoint copied in from another run would be resumed in place and mix two runs' logs
    and best checkpoints: the run id of the folder (of path) must be the checkpoint's."""
    out_dir = os.path.dirname(path)
    own, theirs = folder_run_id(out_dir), ckpt.get("run_id")
    if own and theirs and own != theirs:
        raise CheckpointError(f"{path} belongs to another run than {out_dir} "
                              f"(run id {theirs[:8]}, the folder's {own[:8]}): resume it in its "
                              f"own folder, or start a new run elsewhere")


def read_run(out_dir):
    """out_dir/run.json (the run's id and arguments) as a dict; {} when absent or damaged."""
    try:
        with open(os.path.join(out_dir, "run.json")) as f:
            run = json.load(f)
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def folder_run_id(out_dir):
    run_id = read_run(out_dir).get("run_id")
    return run_id if isinstance(run_id, str) else None


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
        torch.manual_seed(((seed * 1_000_003 + dist.rank) * 1_000_003 + step) % 2 ** 63)


def keep_log_until(path, step):
    """The logs may hold records past the checkpoint a run resumes from, a torn last line (a
    crash or a full disk mid-write) or a damaged line: keep every whole record up to `step`,
    skip the rest, and say what was dropped besides records past the checkpoint."""
    if not os.path.exists(path):
        return
    keep, damaged = [], []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
                if record["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                damaged.append(number)
    if damaged:
        print(f"note: {path}: skipped {len(damaged)} damaged line(s) (line "
              f"{', '.join(map(str, damaged[:5]))}{'...' if len(damaged) > 5 else ''}); every "
              f"whole record up to step {step} is kept", file=sys.stderr)
    with cli.atomic_file(path) as f:
        f.writelines(keep)
