"""What every entry point shares (train.py, evaluate.py, sample.py, reproduce.py, bench.py and
`python -m data.prepare`): one-line errors, the device (one process or torchrun, autocast, the
peak FLOP/s of the MFU column), output files checked before the work and written atomically.

The promise the CLIs keep: a user error prints one line, `error: <what is wrong and the fix>`,
exits with status 2, prints no traceback and writes no file.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile

import torch


class UserError(Exception):
    """A problem the user can fix (a flag, a file, the data); printed as one `error:` line."""


class CLIParser(argparse.ArgumentParser):
    """argparse whose errors are one line ('error: ... (see PROG --help)'), exit status 2, and
    whose help says each flag's default."""

    def format_help(self):
        for a in self._actions:  # unless the help says it, or there is none (None, off)
            if a.option_strings and "default" not in (a.help or "") and \
                    not any(a.default is d for d in (None, False, argparse.SUPPRESS)):
                a.help = f"{a.help or ''} (default: %(default)s)".lstrip()
        return super().format_help()

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def is_out_of_memory(e):
    """torch's CPU allocator raises RuntimeError('... can't allocate memory ...'), CUDA its own."""
    text = str(e)
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or \
        "can't allocate memory" in text or "not enough memory" in text


def run_cli(main, argv=None):
    """Run a CLI main(); a user error (UserError) becomes one 'error: ...' line and exit status
    2, Ctrl-C (outside training, which handles it itself) one line and status 130, running out
    of memory one line; every other exception is a bug and keeps its traceback."""
    WRITTEN.clear()
    for stream in (sys.stdout, sys.stderr):  # text a console cannot show (Windows' cp1252, a
        if hasattr(stream, "reconfigure"):  # latin-1 LANG): caf\xe9, not a traceback
            stream.reconfigure(errors="backslashreplace")
    try:
        return main(argv) or 0
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except UserError as e:  # anything else is a bug: its traceback is shown
        error_line(e)
    except KeyboardInterrupt:
        kept = [p for p in dict.fromkeys(WRITTEN) if os.path.exists(p)]  # (not temporary ones)
        done = f"written before it: {', '.join(kept)}" if kept else "no result was written"
        error_line(f"interrupted (Ctrl-C); {done}")
        return 130
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        error_line("out of memory: the model, its batch or its decoding does not fit; use "
                   "smaller --batch_size / --max_tokens / --bptt / --decode_batch / --L / "
                   "--beam_size, or a smaller model (--d_model / --n_layer)")
    return 2


def bar(items, desc):
    """items, with a tqdm bar on a terminal when desc is given (evaluate.py's long passes)."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, disable=None if desc else True, leave=False)


def error_line(text):
    """'error: TEXT' in one write (print writes the newline apart, and stderr writes through):
    under torchrun the processes' lines cannot interleave."""
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()


RANGES = {  # a flag's range -> (test, words); NaN and infinities are never in one
    ">=1": (lambda v: v >= 1, "must be >= 1"), ">=0": (lambda v: v >= 0, "must be >= 0"),
    ">0": (lambda v: v > 0, "must be a positive number (> 0)"),
    "(0,1)": (lambda v: 0 < v < 1, "must lie in (0, 1)"),
    "[0,1)": (lambda v: 0 <= v < 1, "must lie in [0, 1)"),
    "(0,1]": (lambda v: 0 < v <= 1, "must lie in (0, 1]"),
    "seed": (lambda v: 0 <= v < 2 ** 63, "must lie in [0, 2^63)"),
    "L": (lambda v: 1 <= v <= 10 ** 6, "must lie in [1, 10^6] (tokens decoded)"),
    "beam": (lambda v: 1 <= v <= 1000, "must lie in [1, 1000]"),
}


def in_range(kind, flag, spec):
    """An argparse type: a number of `kind` (int / float) within RANGES[spec], or one line
    naming the flag, its range and the value."""
    test, words = RANGES[spec]

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} takes {what}, got {text!r}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"{flag} {words}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def add_decoding_flags(p):
    """--k, --p, --beam_size, --temperature, --consistent, --length_penalty: the decoders' own
    flags, with their ranges, as evaluate.py and sample.py both take them
    (decode.check_decoder_args checks the rest)."""
    p.add_argument("--k", type=in_range(int, "--k", ">=1"), default=None, help="top-k")
    p.add_argument("--p", type=in_range(float, "--p", "(0,1]"), default=None,
                   help="nucleus threshold mu, in (0, 1]")
    p.add_argument("--beam_size", type=in_range(int, "--beam_size", "beam"), default=None,
                   help="beam width")
    p.add_argument("--temperature", type=in_range(float, "--temperature", ">0"), default=1.0,
                   help="sampling temperature")
    p.add_argument("--consistent", action="store_true", help="top-k / nucleus: always keep eos")
    p.add_argument("--length_penalty", type=in_range(float, "--length_penalty", ">=0"),
                   default=0.0, help="beam: s / |y|^a (0: off)")


def check_rules(rules, args):
    """Flag rules as data: the first (broken(args), message) whose condition holds is the error;
    the message may name flags as {flag} (their values)."""
    for broken, message in rules:
        if broken(args):
            raise UserError(message.format(**vars(args)))


DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def resolve_device(name):
    """'auto' -> cuda:0 when CUDA is available, else cpu; 'cuda' -> cuda:0.  A CUDA device always
    comes back with its index (torch.cuda.set_device refuses one without); an unknown or absent
    device, or MPS, is a user error."""
    if not DEVICE.match(name or ""):
        raise UserError(f"--device {name}: unknown device (use auto, cpu, cuda or cuda:N)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} asked for, but CUDA is not available here "
                            f"(use --device cpu)")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                            f"CUDA device(s)")
        name = f"cuda:{index}"
    if name == "mps":  # (Metal has no float64; torch refuses it on MPS with a TypeError)
        raise UserError("--device mps is not supported: nanogen sums losses and decoder scores "
                        "in float64, which MPS does not have (use --device cpu)")
    return name


def setup_device(device):
    """Make `device` (resolve_device's answer) this process's device: on CUDA the current device,
    TF32 for float32 matrix products and no cuDNN attention (train, evaluate and sample alike);
    on CPU the allocator fast path (fast.py)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # cuDNN's attention (torch's first choice on an H100) builds a plan for every new (B, T),
        # and nanogen's batches and decoding steps come in ever new ones (RESULTS.md, "On a GPU")
        torch.backends.cuda.enable_cudnn_sdp(False)
    elif device == "cpu":
        import fast
        if fast.KEEP_FREED_MEMORY:
            fast.tune_cpu_allocator()
    return device


def autocast_dtype(device, dtype):
    """--dtype -> the autocast dtype on CUDA, or None (float32).  auto: bfloat16 where the GPU
    runs it natively (Ampere and newer), else float32; float16 trains with a GradScaler."""
    if not device.startswith("cuda") or dtype == "float32":
        return None
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else None
    return getattr(torch, dtype)


def autocast_context(device, dtype):
    """A torch.autocast context for --dtype on CUDA; None (float32) elsewhere."""
    dt = autocast_dtype(device, dtype)
    return None if dt is None else torch.autocast(device.split(":")[0], dtype=dt)


def check_compiler(device):
    """--compile builds kernels at the first step: on the CPU inductor's C++, on a GPU Triton's
    (whose launcher needs a C compiler: $CC, gcc or clang; Windows' Triton brings one).  A machine
    without one is a one-line error before anything is read."""
    if device.startswith("cuda"):
        if sys.platform != "win32" and not (os.environ.get("CC") or shutil.which("gcc") or
                                             shutil.which("clang")):
            raise UserError("--compile on a GPU needs a C compiler for Triton (install gcc or "
                            "clang, or set CC), or train without --compile")
        return
    if device != "cpu":
        return
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        get_cpp_compiler()
    except RuntimeError:  # inductor's InvalidCxxCompiler (Windows: no cl)
        raise UserError("--compile on the CPU needs a C++ compiler (torch's inductor found none: "
                        "install g++ or clang++, or set CXX), or train without --compile") from None


# dense bf16 tensor-core peak FLOP/s per GPU by device name, for MFU (TF32 is half; CPUs: pass
# --peak_flops).  Matched in this order (H100 PCIe / NVL before the SXM's "H100", L40S and L40
# before L4).  V100 and T4: fp16 tensor cores, no TF32 (float32 runs at their plain FP32 peak).
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 125e12, "L4": 121e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}
FLOAT32_WITHOUT_TF32 = {"V100": 15.7e12, "T4": 8.1e12}


def peak_flops(args, device, name=None):
    """Peak FLOP/s of one device (--peak_flops, else the table by CUDA device name)."""
    if args.peak_flops or not device.startswith("cuda"):
        return args.peak_flops
    name = name or torch.cuda.get_device_name(device)
    low_precision = autocast_dtype(device, args.dtype) is not None
    key = next((k for k in PEAK_FLOPS if k in name), None)
    if key is None or low_precision:
        return PEAK_FLOPS.get(key)
    return FLOAT32_WITHOUT_TF32.get(key, PEAK_FLOPS[key] / 2)


@dataclasses.dataclass
class Dist:
    """This process under torchrun (one process per device; gloo on CPU), or alone."""
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    def all_sum(self, values):
        """Sum a list of numbers over the processes (one collective, one read)."""
        if self.world == 1:
            return values
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def rank0_first(self, fn):
        """fn() on rank 0 alone, then (when it worked) on the others: what rank 0 downloads or
        prepares, they read.  A UserError on rank 0 becomes a one-line UserError on every rank
        (not a collective mismatch there)."""
        if self.world == 1:
            return fn()
        error = None
        if self.rank == 0:
            try:
                result = fn()
            except UserError as e:
                error = e
        failed = self.all_sum([float(error is not None)])[0]
        if error is not None:
            raise error
        if failed:
            raise UserError("rank 0 stopped with the error above; this process stops too")
        return result if self.rank == 0 else fn()


def setup_distributed(args):
    """torchrun sets WORLD_SIZE / RANK / LOCAL_RANK: one process per device (cuda:LOCAL_RANK),
    nccl on CUDA, gloo on CPU.  Flag errors are raised before the process group exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(0, 1, resolve_device(args.device))
    if args.task == "stream":
        raise UserError("--task stream runs on one process (no torchrun)")
    if args.grad_accum % world:
        raise UserError(f"--grad_accum {args.grad_accum} must be a multiple of the {world} "
                        f"processes")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(args.device)
    device = f"cuda:{local}" if device.startswith("cuda") else device
    if device.startswith("cuda") and local >= torch.cuda.device_count():
        raise UserError(f"torchrun started {world} processes per node but this machine has "
                        f"{torch.cuda.device_count()} CUDA device(s)")
    import torch.distributed as dist
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Dist(int(os.environ["RANK"]), world, device)


# ---------------------------------------------------------------------------------------------
# output files: checked before the work, written atomically
# ---------------------------------------------------------------------------------------------
def check_output(path, flag, folder=False, inputs=(), png=False):
    """Fail now, not after minutes of work, when `path` (a file, or with folder=True a folder of
    files) cannot be written, or would replace one of the command's `inputs` or a checkpoint;
    png=True: a figure, which save_figure writes as PNG.  Nothing is left behind."""
    if path is None:
        return
    if png and not path.lower().endswith(".png"):
        raise UserError(f"{flag} {path}: figures are written as PNG; name the file .png")
    target = os.path.abspath(path)
    for source in inputs:
        if source and os.path.abspath(source) == target or (
                source and os.path.exists(source) and os.path.exists(target) and
                os.path.samefile(source, target)):
            raise UserError(f"{flag} {path} is also an input of this command: it would be "
                            f"replaced; choose another path")
    if not folder and os.path.isfile(target) and is_checkpoint(target):
        raise UserError(f"{flag} {path} is a checkpoint: it would be replaced; choose another "
                        f"path")
    if os.path.exists(target) and os.path.isdir(target) != folder:
        kind = "a folder" if os.path.isdir(target) else "a file"
        raise UserError(f"{flag} {path} is {kind}; give a {'folder' if folder else 'file'} path")
    existing = target if folder and os.path.isdir(target) else os.path.dirname(target)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not can_make_a_file(existing):
        raise UserError(f"{flag} {path} cannot be written ({existing} is not a writable folder)")


def can_make_a_file(folder):
    """Tried (and removed at once): access() lets root pass anywhere, /proc included."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def is_checkpoint(path):
    """A torch.save file (a zip holding data.pkl), which no other output may replace."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("data.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """Write `path` through a temporary file in its folder, fsync-ed and renamed into place: a
    reader never sees half a file, and an error leaves the old one (or none)."""
    folder, tmp = os.path.dirname(os.path.abspath(path)), None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                                   dir=folder)
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # as open() would (mkstemp makes it 0600)
        os.replace(tmp, path)
        WRITTEN.append(path)
    except OSError as e:
        raise UserError(f"could not write {path}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)


WRITTEN = []  # every output this process wrote (the Ctrl-C message names them)


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path, obj):
    """Strict JSON (a NaN or an infinity is written as null, which every reader accepts)."""
    with atomic_file(path) as f:
        json.dump(finite(obj), f, indent=1, allow_nan=False)


def finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


@contextlib.contextmanager
def file_set(folder, names):
    """Write a set of files (a study's figures) all or nothing: into a temporary folder beside
    `folder`, then moved in together; a file of the set that this run did not write (e.g.
    p_eos.png without traces) is removed, so the folder never mixes two runs' figures.  Yields
    the temporary folder."""
    parent, tmp = os.path.dirname(os.path.abspath(folder)), None
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="." + os.path.basename(os.path.abspath(folder)) + ".",
                               dir=parent)
        yield tmp
        made = set(os.listdir(tmp))
        for name in names:
            path = os.path.join(folder, name)
            if name in made:
                os.replace(os.path.join(tmp, name), path)
                WRITTEN.append(path)
            elif os.path.exists(path):
                os.remove(path)
    except OSError as e:
        raise UserError(f"could not write into {folder}: {e.strerror or e}") from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def save_figure(fig, path):
    """matplotlib figure -> laid out, PNG written atomically, closed (also when writing fails)."""
    import matplotlib.pyplot as plt
    try:
        fig.tight_layout()
        with atomic_file(path, "wb") as f:
            fig.savefig(f, dpi=120, format="png", bbox_inches="tight")  # (legends outside)
    finally:
        plt.close(fig)


def pyplot(quiet=False):
    """matplotlib.pyplot with a file-only backend (no display needed), or None (and a note,
    once) when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not (quiet and pyplot.said):
            print("note: figures need matplotlib (pip install matplotlib); none written",
                  file=sys.stderr)
        pyplot.said = True
        return None
    return plt


pyplot.said = False
