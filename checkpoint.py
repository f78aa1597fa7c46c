"""Checkpoints on disk, and HuggingFace GPT-2 weights: what comes into and goes out of a model.

Format 2 (`nanogen-checkpoint-2`): a plain `torch.save` zip, streamed into a temporary file
beside the destination while its sha256 is taken; the digest goes into the zip's archive
comment; then fsync and rename.  A crash leaves the old file or the new one; a file damaged
later fails its digest on load (torch's zip reader does not notice a flipped byte); writing
holds no copy of the state.  Format 1 (`nanogen-checkpoint-1`, the state pickled to bytes with
their sha256) is still read.  Loading is `torch.load(weights_only=True)`: never pickled code.
A training run's checkpoint holds config, model, optimizer, train_state, task_state, rng, args
(train.py's arguments), data (what the data was made from), run_id and the scaler.
"""
import hashlib
import io
import os
import pickle
import zipfile

import torch

from cli import UserError, atomic_file

FORMAT = "nanogen-checkpoint-2"
LEGACY_FORMAT = "nanogen-checkpoint-1"
MAGIC = FORMAT.encode() + b" sha256="
EOCD = b"PK\x05\x06"  # zip end-of-central-directory record: 22 bytes + the archive comment


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the CLIs print it as one line."""


class _HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save streams into it)."""

    def __init__(self, f):
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, b):
        self.sha.update(b)
        try:
            return self.f.write(b)
        except OSError as e:  # torch's zip writer may hide it behind its own RuntimeError
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def save(obj, path):
    """Stream obj into a temporary file next to `path` with its sha256 in the zip comment,
    fsync, rename over `path` (cli.atomic_file).  A failure (a full disk) leaves the previous
    file intact."""
    try:
        with atomic_file(path, "w+b") as f:
            writer = _HashingWriter(f)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            f.seek(-22, os.SEEK_END)  # torch ends the zip with an end record without a comment
            end = f.read(22)
            assert end[:4] == EOCD and end[-2:] == b"\0\0", "unexpected zip layout from torch.save"
            comment = MAGIC + writer.sha.hexdigest().encode()
            f.seek(-2, os.SEEK_END)
            f.write(len(comment).to_bytes(2, "little") + comment)
    except UserError as e:
        raise CheckpointError(f"{e} (the previous checkpoint, if any, is intact)") from None


def _digest_ok(path, comment, expected):
    """sha256 of the bytes torch wrote: the file without the comment, its length field 0."""
    size = os.path.getsize(path) - len(comment) - 2
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while size > 0:
            block = f.read(min(size, 1 << 22))
            if not block:
                return False
            h.update(block)
            size -= len(block)
    h.update(b"\0\0")
    return h.hexdigest() == expected


def _safe_load(path_or_buffer, name, map_location):
    try:
        return torch.load(path_or_buffer, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text advises unsafe loading: never repeated
        text = str(e)
        why = text.split("WeightsUnpickler error:")[-1].strip().splitlines()[0] \
            if "WeightsUnpickler error:" in text else "unsupported content"
        raise CheckpointError(f"{name} is not a nanogen checkpoint: safe (weights_only) loading "
                              f"refused it ({why[:160]}); nanogen never loads pickled code") \
            from None
    except Exception as e:  # truncated / not a torch file
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        raise CheckpointError(f"{name} is not a readable nanogen checkpoint (damaged or "
                              f"truncated? {type(e).__name__}: {msg})") from None


def _zip_comment(path):
    try:
        with zipfile.ZipFile(path) as z:
            return z.comment
    except (zipfile.BadZipFile, OSError, ValueError):
        return b""


def load(path, map_location="cpu"):
    """Read a nanogen checkpoint (format 2, or format 1) safely and check it.  Every way it can
    be unusable is a CheckpointError that names the file and the problem."""
    if os.path.isdir(path):  # a run folder: which of its checkpoints is the user's choice
        found = sorted(f for f in os.listdir(path) if f.endswith(".pt")) or ["none"]
        raise CheckpointError(f"{path} is a folder: give a checkpoint file in it (there: "
                              f"{', '.join(found)})")
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")
    comment = _zip_comment(path)
    if comment.startswith(MAGIC):
        if not _digest_ok(path, comment, comment[len(MAGIC):].decode(errors="replace")):
            raise CheckpointError(f"{path} is damaged: its content does not match its sha256")
        ckpt = _safe_load(path, path, map_location)
    else:
        outer = _safe_load(path, path, map_location)
        if not isinstance(outer, dict) or outer.get("format") != LEGACY_FORMAT or \
                not isinstance(outer.get("payload"), bytes):
            raise CheckpointError(f"{path} is not a nanogen checkpoint (neither format {FORMAT} "
                                  f"nor {LEGACY_FORMAT})")
        if hashlib.sha256(outer["payload"]).hexdigest() != outer.get("sha256"):
            raise CheckpointError(f"{path} is damaged: its content does not match its sha256")
        ckpt = _safe_load(io.BytesIO(outer["payload"]), path, map_location)
    check_contents(ckpt, path)
    return ckpt


def check_contents(ckpt, path):
    """The right wrapper is not enough: a model state of finite tensors and a config."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"{path} is not a nanogen checkpoint (no model inside)")
    if not isinstance(ckpt.get("config"), dict) or "model" not in ckpt["config"]:
        raise CheckpointError(f"{path} has no model config: it was not written by train.py")
    for name, w in ckpt["model"].items():
        if not torch.is_tensor(w):
            raise CheckpointError(f"{path}: model entry {name!r} is not a tensor")
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            raise CheckpointError(f"{path} holds non-finite weights ({name}): a broken model; "
                                  f"use an earlier checkpoint")


def check_run(ckpt, path):
    """What evaluate.py / sample.py read besides the model: the run's arguments and counters."""
    for key in ("args", "train_state"):
        if not isinstance(ckpt.get(key), dict):
            raise CheckpointError(f"{path} lacks its '{key}': it was not written by train.py")
    if "dataset" not in ckpt["args"] or "step" not in ckpt["train_state"]:
        raise CheckpointError(f"{path} does not say which data it was trained on: it was not "
                              f"written by train.py")
    return ckpt


# ---------------------------------------------------------------------------------------------
# HuggingFace GPT-2 checkpoints -> nanogen (train.py --init_from; bench.py and tests)
# ---------------------------------------------------------------------------------------------
GPT2_SIZES = {  # name: (n_layer, n_head, n_embd); all have V = 50257 and 1024 positions
    "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
HF_HUB = "https://huggingface.co/{name}/resolve/main/{file}"
HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt_state_from_hf(hf_state, lm):
    """Map a HuggingFace GPT2LMHeadModel state_dict onto lm (a LanguageModel with a GPT
    backbone).  HF stores the four projections as Conv1D (in, out): they are transposed to
    nn.Linear (out, in).  Shapes are checked key by key; the causal-mask buffers are skipped.
    A head's own parameters (MoS's prior and latent, CT's temperature) are not GPT-2's: they
    keep their initialisation."""
    own = lm.state_dict()
    out = {}
    for k, v in hf_state.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue  # buffers / the tied output matrix (= wte)
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        target = "backbone." + name
        if target not in own:
            raise UserError(f"unexpected GPT-2 weight {k!r}")
        if name.endswith(HF_CONV1D):
            v = v.t()
        if tuple(v.shape) != tuple(own[target].shape):
            raise UserError(f"GPT-2 weight {k!r} has shape {tuple(v.shape)}, the model expects "
                            f"{tuple(own[target].shape)}: wrong --n_layer / --d_model / "
                            f"--n_head / vocabulary?")
        out[target] = v
    missing = [k for k in own if k.startswith("backbone.") and k not in out]
    if missing:
        raise UserError(f"the GPT-2 checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    out["head.proj.weight"] = out["backbone.wte.weight"]
    out.update({k: v for k, v in own.items() if k not in out})  # MoS / CT: kept as initialised
    return out


def _hf_file_in(folder):
    """model.safetensors (when the safetensors package is there) or pytorch_model.bin."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and (name.endswith(".bin") or _has_safetensors()):
            return path
    raise CheckpointError(f"no model.safetensors / pytorch_model.bin in {folder}")


def _has_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True


def read_hf_weights(path):
    """A HuggingFace GPT-2 state_dict from a file or a folder holding one: model.safetensors or
    pytorch_model.bin (read with torch.load(weights_only=True))."""
    if os.path.isdir(path):
        path = _hf_file_in(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"--weights {path}: no such file")
    try:
        if path.endswith(".safetensors"):
            if not _has_safetensors():
                raise CheckpointError(f"{path} needs the safetensors package (pip install "
                                      f"safetensors)")
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # truncated, malformed, not a weights file at all
        reason = str(e).splitlines()[0][:120] if str(e) else ""
        raise CheckpointError(f"{path} is not a readable GPT-2 checkpoint "
                              f"({type(e).__name__}: {reason})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path} does not hold a GPT-2 state dict (names -> tensors)")
    return state


def fetch_hf_weights(name):
    """Download GPT-2 weights from the HuggingFace hub into the cache (progress bar); no checksum
    is published in a stable place, so the file is checked by loading it."""
    from data.prepare import DataError, cache_dir, download
    folder = os.path.join(cache_dir(), "hub", name)
    files = ("model.safetensors", "pytorch_model.bin") if _has_safetensors() else \
        ("pytorch_model.bin",)
    for file in files:
        if os.path.isfile(os.path.join(folder, file)):
            return os.path.join(folder, file)
    if os.environ.get("NANOGEN_OFFLINE"):
        raise CheckpointError(f"{name} weights are not in {folder} and NANOGEN_OFFLINE is set: "
                              f"pass --weights PATH")
    errors = []
    for file in files:
        try:
            return download(HF_HUB.format(name=name, file=file), os.path.join(folder, file))
        except DataError as e:
            errors.append(str(e))
    raise CheckpointError(errors[-1])


def load_pretrained_gpt2(lm, name, weights=None):
    """--init_from gpt2*: copy HF GPT-2 weights (local --weights, else the hub) into lm."""
    hf_state = read_hf_weights(weights) if weights else read_hf_weights(fetch_hf_weights(name))
    lm.load_state_dict(gpt_state_from_hf(hf_state, lm))
    return lm
