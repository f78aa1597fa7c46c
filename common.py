"""What every command shares (as minGPT's mingpt/utils.py): the one-line error and the entry
point, output-path checks, argparse types, the device and autocast, torchrun's rank and sums,
and checkpoints (atomic writes, safe loads)."""

import argparse
import contextlib
import ctypes
import math
import os
import re
import signal
import sys
import tempfile
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist


class UserError(Exception):
    """A problem the user can fix (a flag, a file, the data): every command prints it as one line
    `error: ...` and exits with status 2.  Any other exception is a bug and keeps its traceback."""


def run(main):  # every command's entry point: a UserError is one line (exit 2), a bug a traceback
    try:
        sys.exit(main())
    except (UserError, KeyboardInterrupt) as e:
        sys.stderr.write(f"error: {e if isinstance(e, UserError) else 'interrupted (Ctrl-C)'}\n")
        sys.exit(2 if isinstance(e, UserError) else 130)


# The files of a run folder that train.py and evaluate.py read: no output may replace them.
RUN_FILES = ("ckpt_last.pt", "ckpt_best.pt", "log.jsonl", "steps.jsonl", "args.json")


def check_output(path, flag, reads=(), folder=False):
    """An output path (a file, or with folder=True a folder written into), checked by every command
    before any work starts: a one-line error naming it and why.  A file output is no folder, no
    checkpoint, and no file the run reads (reads: files, and folders whose every file it reads)."""
    if not path:
        return
    real, why = os.path.realpath(path), None
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        why = "it is not a folder"
    elif not folder and (path.endswith(("/", os.sep)) or os.path.isdir(path)):
        why = "it is a folder: give a file name"
    elif not folder and (path.endswith(".pt") or os.path.exists(path) and reads_it(real, reads)):
        raise UserError(
            f"{flag} {path} would replace a checkpoint or an input: choose another path"
        )
    else:
        why = unwritable(real if folder else os.path.dirname(real))
    if why:
        raise UserError(f"cannot write to {flag} {path}: {why}")


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
    native = device.startswith("cuda") and torch.cuda.is_bf16_supported(including_emulation=False)
    dt = {
        "auto": torch.bfloat16 if native else None,
        "float32": None,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    return torch.autocast("cuda", dtype=dt) if device.startswith("cuda") and dt else nullcontext()


def world():  # (this process's rank, the number of processes): torchrun's, or (0, 1)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def all_sum(values, device):  # a list of numbers summed over the processes (one collective)
    if not dist.is_initialized():
        return values
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return summed.tolist()


def save_checkpoint(obj, path):
    """torch.save into a temporary file, then os.replace: a crash leaves the old file or the new."""
    try:
        torch.save(obj, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    except (OSError, RuntimeError) as e:  # a full disk (torch's zip writer: a RuntimeError)
        if os.path.exists(f"{path}.tmp"):
            os.remove(f"{path}.tmp")
        raise UserError(
            f"could not write {path}: {str(e).strip().splitlines()[-1][:200]} (the "
            f"previous checkpoint, if any, is intact)"
        ) from None


RUN_KEYS = (
    ("args", ("model", "head", "task", "dataset", "window")),
    ("state", ("step",)),
)  # what every reader of a checkpoint relies on (a hand-made one may lack it)


def load_checkpoint(path):
    """A checkpoint of train.py, loaded safely (weights_only: never pickled code)."""
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
    if not all(isinstance(ckpt[k], dict) and set(need) <= set(ckpt[k]) for k, need in RUN_KEYS):
        raise UserError(f"{path} is not a checkpoint written by train.py (incomplete args / state)")
    # (a checkpoint written before --protocol was the paper's)
    ckpt["args"].setdefault("protocol", "paper")
    wte = ckpt["model"].get("backbone.wte.weight", ckpt["model"].get("wte.weight"))
    # (heads.padded: the vocabulary's rows padded to a multiple of 64)
    if wte is not None and len(wte) % 64:
        raise UserError(f"{path} was written before nanogen padded the vocabulary: train it again")
    return ckpt


def check_vocab(ckpt, data, path):  # no silently wrong number: a model reads its own vocabulary
    if ckpt["vocab"] != data["vocab"] or ckpt["config"]["eos_id"] != data["eos_id"]:
        raise UserError(
            f"{path} was trained on another vocabulary than the "
            f"{ckpt['args']['dataset']} data here (point --data_dir at its data)"
        )


def compile_model(model, backend="inductor", dynamic=True, graphs=False):
    """-> the model compiled for the train step: dynamic shapes; no matmul padding (it baked the
    first T in the backward); CUDA graphs (not for micro-batches: a replay reuses their grads)."""
    return torch.compile(
        model,
        dynamic=dynamic,
        backend=backend,
        options={"shape_padding": False, "triton.cudagraphs": graphs}
        if backend == "inductor"
        else None,
    )


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
