"""Sequences for the insertion models (insnet.py) and their left-to-right baseline: ROCStories with
Plan-and-Write storylines, and InsNet's synthetic efficiency benchmark.

ROCStories (InsNet paper section 4.1; Yao et al. 2019, "Plan-and-Write"): one story per line,
    title <EOT> k1 k2 k3 k4 k5 <EOL> </s> s1 </s> s2 </s> s3 </s> s4 </s> s5
lower-cased and tokenised; k1..k5 is the storyline (one keyword per sentence).  The files are
the public Plan-and-Write split (train / dev / test, about 78.5k / 9,816 / 9,816 stories).  When
the train file is absent (only dev and test are public in that copy), nanogen trains
on dev minus its last 500 stories, validates on those 500 and tests on test, and says so.

Word-level vocabulary from the training stories (words seen >= min_count times; the rest are
<unk>), after the special tokens <pad> <bos> <eos> <sep> <unk>.  Sequences, in final order:
    task story      BOS title SEP story EOS                      given: BOS title SEP
    task storyline  insertion models: the same sequence, with the storyline keywords found in
                    the story given as well (inserted first: constrained generation);
                    L2R: BOS title SEP k1..k5 SEP story EOS      given: all before the story
    synthetic       BOS x_1 .. x_n EOS, x uniform over V = 30000, n in {20, 40, ..., 160}
"""
import collections
import functools
import os

import torch

from data.prepare import DataError, cache_dir, check_sha256, default_data_dir, download, sha256_file

SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
PAD, BOS, EOS, SEP, UNK = range(len(SPECIALS))
ROC_FILE = "ROCStories_all_merge_tokenize.titlesepkeysepstory.{split}"
ROC_URL = ("https://raw.githubusercontent.com/shelleyyyyu/graph-generation/"
           "2b4387d0627fc178c1e7ba4895ab9080d6211c44/rocstory_plan_write/" + ROC_FILE)
ROC_SHA256 = dict(dev="c3e7be4ad9c8cb3bac23d44c4da64d1dcd74df8c06470ec85d7256a3c433f100",
                  test="5d66b870705cf56cf94d663b6f690d80a6f538e064c5ac54387b1c798d926ac3")
HELD_OUT = 500  # validation stories taken from dev when there is no train file
SYNTHETIC_LENGTHS = (20, 40, 60, 80, 100, 120, 160)
SYNTHETIC_VOCAB = 30000


def parse_story(line):
    """One Plan-and-Write line -> dict(title, keywords, story) as lists of words."""
    try:
        title, rest = line.split("<EOT>")
        keywords, story = rest.split("<EOL>")
    except ValueError:
        raise DataError(f"not a Plan-and-Write story line (title <EOT> keywords <EOL> story): "
                        f"{line[:80]!r}") from None
    return dict(title=title.split(), keywords=keywords.split(),
                story=[w for w in story.split() if w != "</s>"])


def rocstories_folder(data_dir=None):
    """The folder with the Plan-and-Write files: DATA_DIR/rocstories/plan-and-write or DATA_DIR
    itself (a local copy), else the download cache (dev and test are downloaded when missing).
    dev and test, under their official names, must match their sha256 wherever they are."""
    data_dir = default_data_dir(data_dir)
    candidates = [os.path.join(data_dir, "rocstories", "plan-and-write"), data_dir] \
        if data_dir else [os.path.join(cache_dir(), "downloads", "rocstories")]
    folder = next((f for f in candidates if os.path.exists(
        os.path.join(f, ROC_FILE.format(split="test")))), candidates[0])
    for split, sha in ROC_SHA256.items():
        path = os.path.join(folder, ROC_FILE.format(split=split))
        if os.path.exists(path):
            check_sha256(path, sha)
        elif data_dir:
            raise DataError(f"ROCStories {split} is not in {folder}: the data folder {data_dir} "
                            f"(--data_dir / NANOGEN_DATA) must hold rocstories/plan-and-write/ "
                            f"or the Plan-and-Write files themselves")
        elif os.environ.get("NANOGEN_OFFLINE"):
            raise DataError(f"ROCStories {split} is not in the cache ({folder}) and "
                            f"NANOGEN_OFFLINE is set: pass --data_dir DIR (or set NANOGEN_DATA) "
                            f"to a folder with rocstories/plan-and-write/")
        else:
            download(ROC_URL.format(split=split), path, sha)
    return folder


def read_stories(path):
    """Parsed stories of one Plan-and-Write file (text that is not UTF-8 is a DataError); kept
    for the process, per file version (reproduce.py reads them for every run)."""
    stat = os.stat(path)
    return [dict(s) for s in _parsed(path, stat.st_size, stat.st_mtime_ns)]


@functools.lru_cache(maxsize=8)
def _parsed(path, size, mtime):
    try:
        with open(path, encoding="utf-8") as f:
            return [parse_story(line) for line in f if line.strip()]
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"could not read {path}: {str(e)[:160]} (not a UTF-8 text file?)") from None


def load_rocstories(data_dir=None, verbose=True):
    """-> dict(train, valid, test: lists of parsed stories, note: how the splits were made)."""
    folder = rocstories_folder(data_dir)
    path = lambda split: os.path.join(folder, ROC_FILE.format(split=split))  # noqa: E731
    dev, test = read_stories(path("dev")), read_stories(path("test"))
    sources = {s: sha256_file(path(s)) for s in ("dev", "test")}
    if os.path.exists(path("train")):
        sources["train"] = sha256_file(path("train"))
        out = dict(train=read_stories(path("train")), valid=dev, test=test,
                   note="train / dev / test")
    else:
        out = dict(train=dev[:-HELD_OUT], valid=dev[-HELD_OUT:], test=test,
                   note=f"no train file: training on dev[:-{HELD_OUT}], validating on "
                        f"dev[-{HELD_OUT}:], testing on test")
    out["sources"] = sources
    if verbose:
        print(f"rocstories ({folder}): {out['note']}; {len(out['train'])} / "
              f"{len(out['valid'])} / {len(out['test'])} stories")
    return out


def build_vocab(stories, min_count=2):
    """Specials, then the words of the training stories seen >= min_count times, most frequent
    first."""
    counts = collections.Counter(w for s in stories for part in ("title", "keywords", "story")
                                 for w in s[part])
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return list(SPECIALS) + words


def keyword_positions(story, keywords):
    """Index in `story` of each keyword, matched in order (first occurrence after the previous
    match); keywords not found are left out."""
    pos, start = [], 0
    for k in keywords:
        if k in story[start:]:
            i = story.index(k, start)
            pos.append(i)
            start = i + 1
    return pos


def encode_story(story, stoi, task, model):
    """-> dict(tokens (final order), n_given: BOS + given prefix, keyword_pos, keywords (ids))."""
    ids = lambda words: [stoi.get(w, UNK) for w in words]  # noqa: E731
    title, story_ids, kw = ids(story["title"]), ids(story["story"]), ids(story["keywords"])
    if task == "storyline" and model == "gpt":  # L2R conditions on the storyline as a prefix
        prefix = [BOS, *title, SEP, *kw, SEP]
        return dict(tokens=prefix + story_ids + [EOS], n_given=len(prefix), keyword_pos=[],
                    keywords=kw)
    prefix = [BOS, *title, SEP]
    kpos = [] if task != "storyline" else \
        [len(prefix) + i for i in keyword_positions(story["story"], story["keywords"])]
    return dict(tokens=prefix + story_ids + [EOS], n_given=len(prefix), keyword_pos=kpos,
                keywords=kw)


def synthetic(n_per_length, lengths=SYNTHETIC_LENGTHS, vocab_size=SYNTHETIC_VOCAB, seed=0):
    """InsNet section 4.1: random sequences over a vocabulary of 30000 (the specials included)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        for x in torch.randint(len(SPECIALS), vocab_size, (n_per_length, n), generator=g).tolist():
            out.append(dict(tokens=[BOS, *x, EOS], n_given=1, keyword_pos=[], keywords=[]))
    return out


def synthetic_vocab():
    return [*SPECIALS, *(f"w{i}" for i in range(SYNTHETIC_VOCAB - len(SPECIALS)))]


StoryData = collections.namedtuple("StoryData", "vocab splits stories note sources")


def load_sequences(dataset, task, model, data_dir=None, min_count=2, synthetic_count=200,
                   vocab=None, verbose=True):
    """-> StoryData(vocab list, {split: encoded sequences}, {split: parsed stories} or None,
    note, sources: what the data was made from, for checkpoints to record)."""
    if dataset == "synthetic":
        words = vocab or synthetic_vocab()
        n_eval = max(1, synthetic_count // 10)
        splits = dict(train=synthetic(synthetic_count, seed=0), valid=synthetic(n_eval, seed=1),
                      test=synthetic(n_eval, seed=2))
        note = f"synthetic: {synthetic_count} sequences per length {SYNTHETIC_LENGTHS}"
        return StoryData(words, splits, None, note, dict(synthetic=synthetic_count))
    if dataset != "rocstories":
        raise DataError(f"the insertion models train on --dataset rocstories or synthetic, "
                        f"not {dataset}")
    stories = load_rocstories(data_dir, verbose)
    words = vocab or build_vocab(stories["train"], min_count)
    stoi = {w: i for i, w in enumerate(words)}
    splits = {k: [encode_story(s, stoi, task, model) for s in stories[k]]
              for k in ("train", "valid", "test")}
    return StoryData(words, splits, stories, stories["note"], stories["sources"])
