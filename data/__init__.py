"""nanogen's data: prepare.py (download, verify, tokenize), loader.py (batches: where t is made),
stories.py (ROCStories, InsNet's synthetic data); here checked downloads, GPT-2's weights too."""

import hashlib
import os
import urllib.request

import torch
from tqdm import tqdm

from common import UserError, sigterm_interrupts


def cache_dir():  # $NANOGEN_CACHE, default ~/.cache/nanogen: downloads and prepared data
    return os.path.expanduser(os.environ.get("NANOGEN_CACHE") or "~/.cache/nanogen")


def sha256_file(path):
    # In blocks of 1 MB: a 180 MB archive is hashed without being read into memory.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def not_utf8(path):
    """-> 'PATH line N (byte 0xXX)' where a text file is first not UTF-8, or None."""
    # Lines as bytes: a newline byte never sits inside a UTF-8 character, so each line decodes
    # on its own, and the first that does not is the one to name.
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path} line {n} (byte 0x{line[e.start]:02x})"
    return None


# A file under an official name that is not the official file would give other numbers than
# the papers' under the papers' name: refused, never used.
def check_sha256(path, expected):
    got = sha256_file(path)
    if got != expected:
        raise UserError(
            f"checksum mismatch for {path}: sha256 {got}, expected {expected} (a "
            f"corrupt or wrong file: delete it, or point --data_dir at a good copy)"
        )
    return path


def download(url, dest, sha256=None, hint="pass --data_dir DIR (or set NANOGEN_DATA)"):
    """url -> dest with a progress bar, checked against sha256 (when published), then renamed into
    place: nothing is left at dest unless it is whole and right.  A dest already there is kept."""
    # (a download completed earlier, checked again: a cache can be damaged too)
    if os.path.exists(dest):
        return check_sha256(dest, sha256) if sha256 else dest
    if os.environ.get("NANOGEN_OFFLINE"):
        raise UserError(
            f"{os.path.basename(dest)} is not in {os.path.dirname(dest)} and "
            f"NANOGEN_OFFLINE is set: {hint}"
        )
    # Into dest.part, renamed once checked: a reader of dest never sees half a download.
    part = dest + ".part"
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with (
            urllib.request.urlopen(url, timeout=60) as r,
            open(part, "wb") as f,
            tqdm(
                total=int(r.headers.get("Content-Length") or 0) or None,
                unit="B",
                unit_scale=True,
                desc=os.path.basename(dest),
                disable=None,
            ) as bar,
            # (SIGTERM as Ctrl-C: the partial file is removed below)
            sigterm_interrupts(),
        ):
            # (in blocks of 1 MB: the bar moves, and memory stays small)
            for block in iter(lambda: r.read(1 << 20), b""):
                bar.update(f.write(block))
        if sha256:
            check_sha256(part, sha256)
        os.replace(part, dest)
    except OSError as e:  # (urllib's URLError is an OSError)
        raise UserError(
            f"could not download {url} ({getattr(e, 'reason', e)}); offline? {hint}"
        ) from None
    finally:
        # A failed check, an error, Ctrl-C, SIGTERM: the partial file goes with them.
        if os.path.exists(part):
            os.remove(part)
    return dest


# (GPT-2's weights on the HuggingFace hub, as safetensors: no pickle to load)
HF_HUB = "https://huggingface.co/{name}/resolve/main/model.safetensors"


def gpt2_weights(name, path=None):
    """GPT-2's HuggingFace state_dict from `path` (a file, or a folder holding model.safetensors or
    pytorch_model.bin), else from the hub, downloaded into the cache once."""
    if path is None:  # (downloaded once)
        path = download(
            HF_HUB.format(name=name),
            f"{cache_dir()}/hub/{name}/model.safetensors",
            hint="pass --weights PATH to a local copy",
        )
    # A folder as HuggingFace saves one: its weights file, safetensors first.
    for file in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(path, file) if os.path.isfile(os.path.join(path, file)) else path
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        # weights_only: a .bin file is a pickle, which could run code when loaded otherwise.
        state = dict(torch.load(path, map_location="cpu", weights_only=True))
        if not all(torch.is_tensor(v) for v in state.values()):
            raise TypeError("not a state_dict")
        return state
    except Exception as e:  # missing, truncated, not a weights file
        raise UserError(
            f"--weights {path}: not a readable GPT-2 checkpoint ({type(e).__name__})"
        ) from None
