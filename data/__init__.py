"""nanogen's data: prepare.py (download, verify, tokenize), loader.py (batches: where t is made),
stories.py (ROCStories, InsNet's synthetic data); here the one-line error and checked downloads."""

import hashlib
import os
import sys
import tempfile
import urllib.request

from tqdm import tqdm


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


def cache_dir():  # $NANOGEN_CACHE, default ~/.cache/nanogen: downloads and prepared data
    return os.path.expanduser(os.environ.get("NANOGEN_CACHE") or "~/.cache/nanogen")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path, expected):
    if (got := sha256_file(path)) != expected:
        raise UserError(
            f"checksum mismatch for {path}: sha256 {got}, expected {expected} (a "
            f"corrupt or wrong file: delete it, or point --data_dir at a good copy)"
        )
    return path


def download(url, dest, sha256=None, hint="pass --data_dir DIR (or set NANOGEN_DATA)"):
    """url -> dest with a progress bar, checked against sha256 (when published), then renamed into
    place: nothing is left at dest unless it is whole and right.  A dest already there is kept."""
    if os.path.exists(dest):
        return check_sha256(dest, sha256) if sha256 else dest
    if os.environ.get("NANOGEN_OFFLINE"):
        raise UserError(
            f"{os.path.basename(dest)} is not in {os.path.dirname(dest)} and "
            f"NANOGEN_OFFLINE is set: {hint}"
        )
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
        ):
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
        if os.path.exists(part):
            os.remove(part)
    return dest
