"""What every command shares (as minGPT's mingpt/utils.py): the one-line error and the entry
point, output-path checks, argparse types, the device and autocast, torchrun's rank and sums,
and checkpoints (atomic writes, safe loads)."""

import argparse
import contextlib
import ctypes
import fcntl
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist


class UserError(Exception):
    """A problem the user can fix (a flag, a file, the data): every command prints it as one line
    `error: ...` and exits with status 2.  Any other exception is a bug and keeps its traceback."""


def run(main):
    """Every command's entry point: a UserError is one line (exit 2), a bug a traceback; Ctrl-C,
    or a SIGTERM sigterm_interrupts() raised, one line and 128 + the signal (as a shell says)."""
    try:
        sys.exit(main())
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt as e:
        # (the status a shell gives a process the signal ended: a script tells the two apart)
        name = (e.args or ["Ctrl-C"])[0]
        sys.stderr.write(f"error: interrupted ({name})\n")
        sys.exit(128 + (signal.SIGTERM if name == "SIGTERM" else signal.SIGINT))


# SIGTERM's handler while a block must clean up after itself (sigterm_interrupts).
def raise_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


@contextlib.contextmanager
def sigterm_interrupts():
    """While the block runs, SIGTERM raises KeyboardInterrupt("SIGTERM"), as Ctrl-C raises its
    own: the block's cleanup (a `finally`) runs, where the default SIGTERM would end the process
    mid-write.  A handler the command set itself is left alone."""
    # Python sets handlers from the main thread only; a command's own handler (train.py's stop
    # flag, reproduce.py's forwarding to its children) decides for itself.
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# The files of a run folder that train.py and evaluate.py read: no output may replace them.
RUN_FILES = ("ckpt_last.pt", "ckpt_best.pt", "log.jsonl", "steps.jsonl", "args.json")


def check_output(path, flag, reads=(), folder=False):
    """An output path (a file, or with folder=True a folder written into), checked by every command
    before any work starts: a one-line error naming it and why.  A file output is no folder, no
    checkpoint, no file the run reads (reads: files, and folders whose every file it reads), and
    a regular file or nothing yet."""
    if not path:
        return
    real, why = os.path.realpath(path), None
    # write_file renames a new file over the path: a link, a FIFO or a device node there would
    # be replaced by it (as root, --out /dev/null would replace the system's /dev/null).
    special = os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path))
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        why = "it is not a folder"
    elif not folder and (path.endswith(("/", os.sep)) or os.path.isdir(path)):
        why = "it is a folder: give a file name"
    elif not folder and (path.endswith(".pt") or os.path.exists(path) and reads_it(real, reads)):
        raise UserError(
            f"{flag} {path} would replace a checkpoint or an input: choose another path"
        )
    elif not folder and special:
        why = "it is not a regular file (a link, a FIFO or a device): give a file's path"
    else:
        why = unwritable(real if folder else os.path.dirname(real))
    if why:
        raise UserError(f"cannot write to {flag} {path}: {why}")


# Both sides resolved (links, "..") before they are compared.
def reads_it(real, reads):  # is the (resolved) path one of the files read, or in a folder read?
    for x in (os.path.realpath(x) for x in reads if x):
        if real == x or real.startswith(x + os.sep):
            return True
    return False


def unwritable(folder):
    """-> why no file can be written into folder (or the folders made for it), or None: a
    temporary file, never seen, is made in the nearest existing folder (root ignores the mode
    bits, a read-only file system does not)."""
    top = folder
    while not os.path.lexists(top):
        top = os.path.dirname(top)
    if not os.path.isdir(top):
        return f"{top} is not a folder"
    try:
        tempfile.TemporaryFile(dir=top).close()
    except OSError as e:
        return f"{top}: {e.strerror or e}"
    return None


def number(kind, ok, words):
    """An argparse type: a finite number of `kind` for which ok(value) holds."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        # (float() reads "nan" and "inf": no flag's value)
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    return parse


INT1 = number(int, lambda v: v >= 1, ">= 1")
INT0 = number(int, lambda v: v >= 0, ">= 0")


POS = number(float, lambda v: v > 0, "> 0")
NONNEG = number(float, lambda v: v >= 0, ">= 0")
FRACTION = number(float, lambda v: 0 <= v < 1, "in [0, 1)")
SEED = number(int, lambda v: 0 <= v < 2**63, "in [0, 2^63)")
# epsilon's range, the plateau's factor, a decoding length (capped: a model that never ends
# cannot keep a command decoding for ever)
OPEN_UNIT = number(float, lambda v: 0 < v < 1, "in (0, 1)")
DECAY = number(float, lambda v: 0 < v <= 1, "in (0, 1]")
LENGTH = number(int, lambda v: 1 <= v <= 10**6, "in [1, 10^6]")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def get_device(name, local_rank=None):
    """--device -> 'cpu' or 'cuda:N', this process's, set up for speed."""
    device = name
    if name == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device {name}: unknown device (use auto, cpu, cuda or cuda:N)")
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0) if local_rank is None else local_rank
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
        device = f"cuda:{index}"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.enable_cudnn_sdp(False)  # it plans anew for every (B, T) it meets
    elif sys.platform == "linux":
        # glibc: keep freed (B*T, V) tensors in the heap, rather than unmap them and page-fault
        # them in anew every step (2x faster).
        libc = ctypes.CDLL(None)
        libc.mallopt(-4, 0)  # M_MMAP_MAX = 0
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD
    return device


def autocast(device, dtype):
    """--dtype's autocast on CUDA (auto: bfloat16 where native), else none: float32."""
    # (float16 only when asked: its range needs the GradScaler train.py then turns on)
    native = device.startswith("cuda") and torch.cuda.is_bf16_supported(including_emulation=False)
    dt = {
        "auto": torch.bfloat16 if native else None,
        "float32": None,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    return torch.autocast("cuda", dtype=dt) if device.startswith("cuda") and dt else nullcontext()


def precision(device, dtype):
    """The precision --dtype gives a run on device: float32, or autocast's bfloat16 / float16."""
    return str(getattr(autocast(device, dtype), "fast_dtype", torch.float32)).removeprefix("torch.")


def world():  # (this process's rank, the number of processes): torchrun's, or (0, 1)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def all_sum(values, device):  # a list of numbers summed over the processes (one collective)
    if not dist.is_initialized():
        return values
    # float64: a sum of token counts passes float32's 2^24 exact integers within one epoch.
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return summed.tolist()


def write_file(path, write, binary=False, note=""):
    """Every file a command writes goes through here: write(f) fills a temporary file beside
    `path`, flushed to the disk, then renamed over `path` (os.replace), so that a reader, a kill
    or a full disk finds the old file or the new, never half of one.  Any error removes the
    temporary; an OSError (a full disk, a read-only one) is one line naming the file, and note."""
    # The temporary sits beside the target: a rename is atomic within one file system only.
    tmp = f"{path}.tmp"
    mode, encoding = "w", "utf-8"
    if binary:
        mode, encoding = "wb", None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, mode, encoding=encoding) as f:
            write(f)
            # On the disk before the rename: a power cut never leaves the name on an empty file.
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        # Ctrl-C and bugs too: no half-written temporary stays behind.  (A kill -9 cannot be
        # caught: the next run in a run's folder removes its temporaries.)
        if os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise UserError(f"could not write {path}: {e.strerror or e}{note}") from None
        raise


def append_lines(path, lines):
    """Lines added at the end of a log: all of them or, on an error (a full disk), none: the file
    is cut back to what it held, and the error is one line.  (No fsync: a log is appended every
    few steps, and its reader skips a line a crash tore.)"""
    data, size = memoryview("".join(lines).encode()), None
    try:
        # Unbuffered: each write is one system call whose count is seen here (a buffered file
        # would hide a partial write until it is closed).
        with open(path, "ab", buffering=0) as f:
            size = f.tell()
            # A write may take part of the data (the disk filling up): the rest goes next.
            while data:
                data = data[f.write(data) :]
    except OSError as e:
        # A torn last line would be lost anyway: the log ends where it ended before.
        if size is not None:
            os.truncate(path, size)
        raise UserError(
            f"could not write {path}: {e.strerror or e} (its earlier lines are kept)"
        ) from None


def pyplot():  # matplotlib.pyplot without a display, imported when a figure is drawn
    # (imported here: a command that draws nothing never pays matplotlib's import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path):
    """A figure as a PNG, written atomically; a figure that cannot be written is one warning."""
    import matplotlib.pyplot as plt

    try:
        png = dict(dpi=120, format="png", bbox_inches="tight")
        write_file(path, lambda f: fig.savefig(f, **png), binary=True)
    except UserError as e:
        # A figure is a view of the logs: the run goes on without it.
        print(f"warning: {e}", file=sys.stderr)
    finally:
        plt.close(fig)


# What a failed checkpoint write leaves: write_file never touches the file it would replace.
INTACT = " (the previous checkpoint, if any, is intact)"


def save_checkpoint(obj, path):
    """torch.save through write_file: a crash leaves the old checkpoint or the new."""
    try:
        write_file(path, lambda f: torch.save(obj, f), binary=True, note=INTACT)
    except RuntimeError as e:
        # torch's zip writer says a full disk as a RuntimeError; its last line is the reason.
        reason = str(e).strip().splitlines()[-1][:200]
        raise UserError(f"could not write {path}: {reason}{INTACT}") from None


def copy_checkpoint(source, path):
    """A copy of a checkpoint (ckpt_best.pt -> ckpt_last.pt), written as any other file."""

    # A copy, not a second torch.save: the same bytes, without serializing the model again.
    def copy(f):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f)

    write_file(path, copy, binary=True, note=INTACT)


# The run folders this process holds: their real path -> the open lock file.
HELD = {}


def lock_folder(folder):
    """A run owns its folder while it runs: an exclusive flock on FOLDER/.lock, held by the first
    process of a torchrun for all.  The kernel drops it with the process, so a killed run leaves
    no stale lock; a folder another process holds is a one-line error."""
    # An earlier run of this process in the folder, ended on an error, may still hold it.
    release_folder(folder)
    if world()[0] != 0:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, ".lock"), "w")
        HELD[os.path.realpath(folder)] = f
        # A flock, not a file of a process id: the kernel lets go of it however the process
        # ends, so there is never a stale lock to remove by hand.  Not waiting: the second run
        # is told at once, rather than starting hours later.
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        release_folder(folder)
        raise UserError(
            f"another run is writing into {folder}: wait for it to end, or choose another --out_dir"
        ) from None
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {folder}: {e.strerror or e}") from None


def release_folder(folder):  # let go of a folder lock_folder took (nothing if none)
    held = HELD.pop(os.path.realpath(folder), None)
    if held:
        held.close()


# What every reader of a checkpoint relies on, and its type (a hand-made one may lack it).
RUN_KEYS = dict(
    args=dict(model=str, head=str, task=str, dataset=str, window=(int, type(None))),
    state=dict(step=int),
)
# A flag's value as train.py keeps it in a checkpoint's args (no flag takes a list).
FLAG_VALUE = (str, int, float, bool, type(None))


def load_checkpoint(path):
    """A checkpoint of train.py, loaded safely (weights_only: never pickled code), and checked to
    hold what its readers (evaluate, sample, --resume) rely on."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # missing, a folder, truncated, not a torch file, pickled code
        raise UserError(
            f"no checkpoint at {path}"
            if not os.path.isfile(path)
            else f"{path} is not a readable nanogen checkpoint ({type(e).__name__})"
        ) from None
    if not (isinstance(ckpt, dict) and {"config", "model", "args", "vocab", "state"} <= set(ckpt)):
        raise UserError(f"{path} is not a checkpoint written by train.py")
    check_run_keys(ckpt, path)
    # (a checkpoint written before --protocol was the paper's)
    ckpt["args"].setdefault("protocol", "paper")
    wte = ckpt["model"].get("backbone.wte.weight", ckpt["model"].get("wte.weight"))
    # (heads.padded: the vocabulary's rows padded to a multiple of 64)
    if wte is not None and len(wte) % 64:
        raise UserError(f"{path} was written before nanogen padded the vocabulary: train it again")
    return ckpt


def check_run_keys(ckpt, path):
    """A checkpoint's args and state: the keys its readers rely on, each of its type (a flag of
    the args: a number, a string, a bool or None), or one line naming the first that is not."""
    what = f"{path} is not a checkpoint written by train.py"
    # (said here, once: a wrong type would otherwise surface as a TypeError deep in a resumed run)
    for part, need in RUN_KEYS.items():
        if not (isinstance(ckpt[part], dict) and set(need) <= set(ckpt[part])):
            raise UserError(f"{what} (incomplete args / state)")
        wrong = [k for k, kind in need.items() if not isinstance(ckpt[part][k], kind)]
        if part == "args":
            wrong += [k for k, v in ckpt[part].items() if not isinstance(v, FLAG_VALUE)]
        if wrong:
            value = ckpt[part][wrong[0]]
            raise UserError(f"{what}: its {part} hold {wrong[0]} = {value!r} (train it again)")


def check_vocab(ckpt, data, path):  # no silently wrong number: a model reads its own vocabulary
    if ckpt["vocab"] != data["vocab"] or ckpt["config"]["eos_id"] != data["eos_id"]:
        raise UserError(
            f"{path} was trained on another vocabulary than the "
            f"{ckpt['args']['dataset']} data here (point --data_dir at its data)"
        )


def compile_model(model, backend="inductor", dynamic=True, graphs=False):
    """-> the model compiled for the train step: dynamic shapes; no matmul padding (it baked the
    first T in the backward); CUDA graphs (not for micro-batches: a replay reuses their grads)."""
    # (another backend: a test's, or bench.py's eager one, with no options of inductor's)
    if backend != "inductor":
        return torch.compile(model, dynamic=dynamic, backend=backend)
    # Inductor builds C++ for a model on the CPU, and Triton a C launcher on the GPU: without the
    # compiler the first step would fail deep inside them (an 80-line traceback), so the one
    # they would look for is looked for now.
    from torch._inductor import config

    compilers = [c for c in config.cpp.cxx if c]
    if next(model.parameters()).is_cuda:
        compilers = [os.environ.get("CC") or "gcc", "clang"]
    if not any(shutil.which(c) for c in compilers):
        raise UserError(
            f"--compile needs a compiler ({' or '.join(compilers)}): install one (apt install "
            f"g++), or drop --compile"
        )
    options = {"shape_padding": False, "triton.cudagraphs": graphs}
    return torch.compile(model, dynamic=dynamic, backend=backend, options=options)


PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # bf16 dense


def peak_flops(device, dtype):  # a known GPU's dense peak FLOP/s (PEAK_FLOPS; float32: half), or 0
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0) / (1 + (dtype == "float32"))


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


def state_to(state, device, detach=False):
    """A recurrent state (a tensor, a tuple of them, or None) on device.  detach: a detached copy
    (a CUDA graph's next replay reuses its outputs)."""
    if isinstance(state, tuple):
        return tuple(state_to(s, device, detach) for s in state)
    if state is None:
        return None
    if detach:
        state = state.detach().clone()
    return state.to(device)


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


# ----- stopping on a signal: a long loop ends cleanly on Ctrl-C or SIGTERM ---------------------
# The signals that asked this process to stop (on_signal appends, at any moment): train.py's loop
# reads it after each step, reproduce.py after each run.
STOP = []
# True while a block runs that cannot wait for its step's end (the termination probe).
AT_ONCE = []


class Stopped(Exception):
    """A signal inside an at_once() block: the block is given up."""


def on_signal(signum, frame):
    """Ctrl-C, SIGTERM: the loop finishes its step, writes its checkpoint and exits 0."""
    if STOP and signum == signal.SIGINT and not dist.is_initialized():
        # Ctrl-C twice: abort now.
        raise KeyboardInterrupt
    if signum == signal.SIGINT:
        STOP.append("Ctrl-C")
    else:
        STOP.append(signal.Signals(signum).name)
    print(f"\n{STOP[-1]}: finishing this step and writing a checkpoint", file=sys.stderr)
    if AT_ONCE:
        raise Stopped


@contextlib.contextmanager
def stop_on_signals():
    """Ctrl-C and SIGTERM append to STOP while the block runs (on_signal)."""
    STOP.clear()
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        # The handlers are put back, but for a stopped run, or under torchrun: there a second
        # signal as the process leaves is no kill.
        if not (STOP or dist.is_initialized()):
            for s, handler in handlers.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def at_once():
    """A signal inside the block raises Stopped at once."""
    AT_ONCE.append(True)
    try:
        yield
    finally:
        AT_ONCE.clear()
