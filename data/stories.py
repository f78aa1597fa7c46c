"""Sequences for the insertion models (insnet.py) and their left-to-right baseline.  ROCStories
(InsNet paper section 4.1; Yao et al. 2019, "Plan-and-Write"): one story a line,
    title <EOT> k1 k2 k3 k4 k5 <EOL> </s> s1 </s> s2 </s> s3 </s> s4 </s> s5
lower-cased and tokenised; k1..k5 is the storyline (a keyword a sentence).  Without a train file
(the public copy has dev and test) nanogen trains on dev but its last 500 stories, validates on
those, tests on test, and says so.  Vocabulary: <pad> <bos> <eos> <sep> <unk>, then the words of
the training stories seen >= min_count times.  Sequences (final order):
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

from common import UserError
from data import cache_dir, download, not_utf8

# The specials first, so that their ids are the same in every vocabulary (PAD = 0: padding is
# zeros, as torch pads).
SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
PAD, BOS, EOS, SEP, UNK = range(len(SPECIALS))
ROC_FILE = "ROCStories_all_merge_tokenize.titlesepkeysepstory.{split}"
# A pinned commit of a public copy: the file a run reads cannot change under the same URL.
ROC_URL = (
    "https://raw.githubusercontent.com/shelleyyyyu/graph-generation/"
    "2b4387d0627fc178c1e7ba4895ab9080d6211c44/rocstory_plan_write/" + ROC_FILE
)
ROC_SHA256 = dict(
    dev="c3e7be4ad9c8cb3bac23d44c4da64d1dcd74df8c06470ec85d7256a3c433f100",
    test="5d66b870705cf56cf94d663b6f690d80a6f538e064c5ac54387b1c798d926ac3",
)
# Validation stories taken from dev when there is no train file.
HELD_OUT = 500
# InsNet section 4.1's synthetic lengths and vocabulary.
SYNTHETIC_LENGTHS = (20, 40, 60, 80, 100, 120, 160)
SYNTHETIC_VOCAB = 30000


def parse_story(line):
    """One Plan-and-Write line -> dict(title, keywords, story) as lists of words."""
    try:
        title, rest = line.split("<EOT>")
        keywords, story = rest.split("<EOL>")
    except ValueError:
        raise UserError(
            f"not a Plan-and-Write story line (title <EOT> keywords <EOL> story): {line[:80]!r}"
        ) from None
    # </s> only separates the sentences: no word of the story.
    return dict(
        title=title.split(),
        keywords=keywords.split(),
        story=[w for w in story.split() if w != "</s>"],
    )


def rocstories_folder(data_dir=None):
    """The folder with the Plan-and-Write files: DATA_DIR/rocstories/plan-and-write or DATA_DIR
    itself (a local copy), else the download cache (dev and test downloaded when missing); dev
    and test must match their sha256 wherever they are."""
    data_dir = data_dir or os.environ.get("NANOGEN_DATA")
    folder = (
        os.path.join(data_dir, "rocstories", "plan-and-write")
        if data_dir
        else os.path.join(cache_dir(), "downloads", "rocstories")
    )
    # (a folder holding the files themselves is taken too)
    if data_dir and not os.path.isdir(folder):
        folder = data_dir
    for split, sha in ROC_SHA256.items():
        path = os.path.join(folder, ROC_FILE.format(split=split))
        if data_dir and not os.path.exists(path):
            raise UserError(
                f"ROCStories {split} is not in {folder}: --data_dir / NANOGEN_DATA "
                f"must hold rocstories/plan-and-write/ or the Plan-and-Write files"
            )
        # (there already: checked against its sha256, not downloaded again)
        download(ROC_URL.format(split=split), path, sha)
    return folder


# Kept: reproduce.py trains and evaluates several models on the same files in one process.
@functools.lru_cache(maxsize=8)
def read_stories(path):
    """The parsed stories of one Plan-and-Write file (kept: reproduce.py reads them every run)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [parse_story(line) for line in f if line.strip()]
    # (the line and byte that are not UTF-8, read again as bytes, rather than a stream position)
    except UnicodeDecodeError:
        raise UserError(f"{not_utf8(path)} is not UTF-8 text: convert it to UTF-8") from None
    except OSError as e:
        raise UserError(f"could not read {path}: {e.strerror or e}") from None


def load_rocstories(data_dir=None, verbose=True):
    """-> dict(train, valid, test: lists of parsed stories, note: how the splits were made)."""
    folder = rocstories_folder(data_dir)
    path = {
        split: os.path.join(folder, ROC_FILE.format(split=split))
        for split in ("train", "dev", "test")
    }
    dev, test = read_stories(path["dev"]), read_stories(path["test"])
    # The public copy has no train file: dev gives the training stories but its last 500.
    if os.path.exists(path["train"]):
        out = dict(train=read_stories(path["train"]), valid=dev, test=test, note="train/dev/test")
    else:
        out = dict(
            train=dev[:-HELD_OUT],
            valid=dev[-HELD_OUT:],
            test=test,
            note=f"no train file: "
            f"train on dev[:-{HELD_OUT}], validate on dev[-{HELD_OUT}:], test on test",
        )
    if verbose:
        print(
            f"rocstories ({folder}): {out['note']}; {len(out['train'])} / "
            f"{len(out['valid'])} / {len(out['test'])} stories"
        )
    return out


def build_vocab(stories, min_count=2):
    """Specials, then the training stories' words seen >= min_count times, most frequent first."""
    counts = collections.Counter(
        w for s in stories for part in ("title", "keywords", "story") for w in s[part]
    )
    # Ties by the word: the vocabulary, and so every id, is the same on every machine.
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return list(SPECIALS) + words


def keyword_positions(story, keywords):
    """Index in `story` of each keyword, matched in order; keywords not found are left out."""
    pos = []
    # Each keyword is searched for after the one before.
    for k in keywords:
        start = 0
        if pos:
            start = pos[-1] + 1
        if k in story[start:]:
            pos.append(story.index(k, start))
    return pos


def encode_story(story, stoi, task, model):
    """-> dict(tokens (final order), n_given: BOS + given prefix, keyword_pos, keywords (ids))."""

    # (a word seen fewer than min_count times in training is <unk>)
    def ids(words):
        return [stoi.get(w, UNK) for w in words]

    title, story_ids, kw = ids(story["title"]), ids(story["story"]), ids(story["keywords"])
    # The L2R baseline cannot insert: it reads the storyline as a prefix instead.
    l2r_storyline = task == "storyline" and model == "gpt"
    prefix = [BOS, *title, SEP, *kw, SEP] if l2r_storyline else [BOS, *title, SEP]
    kpos = (
        []
        if task != "storyline" or l2r_storyline
        else [len(prefix) + i for i in keyword_positions(story["story"], story["keywords"])]
    )
    return dict(
        tokens=prefix + story_ids + [EOS], n_given=len(prefix), keyword_pos=kpos, keywords=kw
    )


def synthetic(n_per_length, lengths=SYNTHETIC_LENGTHS, vocab_size=SYNTHETIC_VOCAB, seed=0):
    """InsNet section 4.1: random sequences over a vocabulary of 30000 (the specials included)."""
    # Seeded: every run, and every split (seeds 0, 1, 2), draws the same sequences.
    g, V = torch.Generator().manual_seed(seed), vocab_size
    return [
        dict(tokens=[BOS, *x, EOS], n_given=1, keyword_pos=[], keywords=[])
        for n in lengths
        for x in torch.randint(len(SPECIALS), V, (n_per_length, n), generator=g).tolist()
    ]


def load_sequences(args, verbose=True):
    """The sequences of args.dataset for args.task and args.model (args.data_dir, min_count,
    synthetic_count).  -> dict(vocab, train / valid / test (encoded), stories ({split: parsed} or
    None), note)."""
    synthetic_count = args.synthetic_count
    if args.dataset == "synthetic":
        # A tenth as many for validation and test, at least one a length.
        n_eval = max(1, synthetic_count // 10)
        return dict(
            vocab=[*SPECIALS, *(f"w{i}" for i in range(SYNTHETIC_VOCAB - len(SPECIALS)))],
            train=synthetic(synthetic_count, seed=0),
            valid=synthetic(n_eval, seed=1),
            test=synthetic(n_eval, seed=2),
            stories=None,
            note=f"synthetic: {synthetic_count} sequences per length {SYNTHETIC_LENGTHS}",
        )
    stories = load_rocstories(args.data_dir, verbose)
    # The vocabulary of the training stories alone: validation words unseen there are <unk>.
    vocab = build_vocab(stories["train"], args.min_count)
    stoi = {w: i for i, w in enumerate(vocab)}
    return dict(
        vocab=vocab,
        stories=stories,
        note=stories["note"],
        **{
            k: [encode_story(s, stoi, args.task, args.model) for s in stories[k]]
            for k in ("train", "valid", "test")
        },
    )


def story_targets(seq, insertion):
    """The predicted events of one encoded story.  An insertion model predicts every token but
    BOS, EOS, the given prefix and the keywords, then the termination; the L2R baseline every
    token after the given prefix, EOS included."""
    # (n_given counts BOS; the insertion events end with the termination, in place of EOS)
    if insertion:
        return len(seq["tokens"]) - seq["n_given"] - len(seq["keyword_pos"])
    return max(len(seq["tokens"]) - max(seq["n_given"], 1), 0)
