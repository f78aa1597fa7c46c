"""nanogen's data: prepare.py (download, verify, tokenize), loader.py (batches: where t is made),
stories.py (ROCStories, InsNet's synthetic data); here the one-line error and checked downloads."""

import hashlib
import os
import sys
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
