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

from data import UserError
from data.prepare import cache_dir, check_sha256, download, sha256_file

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
        raise UserError(f"not a Plan-and-Write story line (title <EOT> keywords <EOL> story): "
                        f"{line[:80]!r}") from None
    return dict(title=title.split(), keywords=keywords.split(),
                story=[w for w in story.split() if w != "</s>"])


def rocstories_folder(data_dir=None):
    """The folder with the Plan-and-Write files: DATA_DIR/rocstories/plan-and-write or DATA_DIR
    itself (a local copy), else the download cache (dev and test are downloaded when missing).
    dev and test, under their official names, must match their sha256 wherever they are."""
    data_dir = data_dir or os.environ.get("NANOGEN_DATA")
    candidates = [os.path.join(data_dir, "rocstories", "plan-and-write"), data_dir] \
        if data_dir else [os.path.join(cache_dir(), "downloads", "rocstories")]
    folder = next((f for f in candidates if os.path.exists(
        os.path.join(f, ROC_FILE.format(split="test")))), candidates[0])
    for split, sha in ROC_SHA256.items():
        path = os.path.join(folder, ROC_FILE.format(split=split))
        if os.path.exists(path):
            check_sha256(path, sha)
        elif data_dir:
            raise UserError(f"ROCStories {split} is not in {folder}: the data folder {data_dir} "
                            f"(--data_dir / NANOGEN_DATA) must hold rocstories/plan-and-write/ "
                            f"or the Plan-and-Write files themselves")
        else:
            download(ROC_URL.format(split=split), path, sha)
    return folder


@functools.lru_cache(maxsize=8)
def read_stories(path):
    """The parsed stories of one Plan-and-Write file (kept for the process: reproduce.py reads
    them for every run)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [parse_story(line) for line in f if line.strip()]
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"could not read {path}: {str(e)[:160]} (not a UTF-8 text file?)") from None


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
        raise UserError(f"the insertion models train on --dataset rocstories or synthetic, "
                        f"not {dataset}")
    stories = load_rocstories(data_dir, verbose)
    words = vocab or build_vocab(stories["train"], min_count)
    stoi = {w: i for i, w in enumerate(words)}
    splits = {k: [encode_story(s, stoi, task, model) for s in stories[k]]
              for k in ("train", "valid", "test")}
    return StoryData(words, splits, stories, stories["note"], stories["sources"])


# ---------------------------------------------------------------------------------------------
# batches of stories: the insertion models' orders (insnet.py), the L2R baseline's tokens
# ---------------------------------------------------------------------------------------------
def insertion_order(length, n_given, keyword_pos=(), mode="random", generator=None):
    """One insertion order (length,) for a sequence BOS x_1 .. x_{length-2} EOS.
    BOS (position 0) and EOS (position length-1) come first, then the given prefix positions
    1 .. n_given-1 left to right (a conditioning title + separator: n_given counts BOS), then the
    keyword positions (storyline constraints, left to right), then the rest: uniformly random
    (mode 'random', the paper's training orders) or left to right (mode 'l2r', InsNet-l2r)."""
    given = [0, length - 1, *range(1, n_given), *sorted(keyword_pos)]
    rest = sorted(set(range(length)) - set(given))
    if mode == "random":
        rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    elif mode != "l2r":
        raise ValueError(f"unknown insertion order '{mode}' (random or l2r)")
    return torch.tensor(given + rest, dtype=torch.long)


def collate_insertions(seqs, n_given, keyword_pos, mode, generator=None, device="cpu"):
    """A training / scoring batch: seqs, list of 1-D token lists (BOS .. EOS in final order);
    n_given[b]: BOS + the given prefix (title + separator: 1 when there is none); keyword_pos[b]:
    positions given as keywords.  -> dict for InsertionModel.sequence_log_probs."""
    B, n = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(B, n, dtype=torch.long)
    order = torch.arange(n).repeat(B, 1)  # padded steps keep order values >= the length
    given = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.as_tensor(s)
        order[b, :len(s)] = insertion_order(len(s), n_given[b], keyword_pos[b], mode, generator)
        given[b] = 1 + n_given[b] + len(keyword_pos[b])  # BOS, EOS, prefix, keywords
    lengths = torch.tensor([len(s) for s in seqs])
    slot_start = torch.tensor([g - 1 for g in n_given])  # the gap right after the prefix
    batch = dict(tokens=tokens, order=order, lengths=lengths, n_given=given, slot_start=slot_start)
    return {k: v.to(device) for k, v in batch.items()}


def story_batch(seqs, insertion, order="random", generator=None, device="cpu"):
    """A batch of encoded stories.  An insertion model's: one insertion order per sequence
    (collate_insertions); the L2R baseline's: right-padded inputs and targets, its loss on the
    tokens after the given prefix (EOS included).  n: the predicted events (tokens; insertions and
    the termination), n_inputs: the tokens read, both host ints."""
    toks = [s["tokens"] for s in seqs]
    if insertion:
        batch = collate_insertions(toks, [s["n_given"] for s in seqs],
                                   [s["keyword_pos"] for s in seqs], order, generator, device)
        given = sum(1 + s["n_given"] + len(s["keyword_pos"]) for s in seqs)  # BOS EOS prefix kws
        return dict(batch, n=sum(map(len, toks)) - given + len(seqs), n_inputs=sum(map(len, toks)))
    tokens = torch.zeros(len(toks), max(map(len, toks)), dtype=torch.long)
    for b, t in enumerate(toks):
        tokens[b, :len(t)] = torch.as_tensor(t)
    lengths, given = torch.tensor([len(t) for t in toks]), torch.tensor([s["n_given"] for s in seqs])
    pos = torch.arange(tokens.size(1) - 1)
    mask = (pos >= (given - 1).unsqueeze(1)) & (pos < (lengths - 1).unsqueeze(1))
    tokens, mask = tokens.to(device), mask.to(device)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], t=None, mask=mask, n_inputs=sum(
        map(len, toks)), n=sum(len(t) - s["n_given"] for t, s in zip(toks, seqs)))
