"""A run's data and its batches: the prepared sequences (data/prepare.py), a stream's columns,
stories (data/stories.py).  A sequence s = (x_1..x_c, y_1..y_T), y_T = eos, c its context length.
The model reads s[:-1] and predicts s[1:]: the continuation targets y_1..y_T sit at positions
c-1 .. len-2, and position i is continuation step t = i - c + 2 (t = 1 at y_1, NMST eq. 10;
t <= 0 on the context).  `collate` builds t and the loss mask: only continuation targets enter
the loss (NMST eq. 3).  Batches are sorted by length (ties random): `batch_size` sequences (RNN /
LSTM; paper: 32), or (max_tokens // T, T) with T rounded up to a `bucket` (GPT; paper: 1024
tokens), shuffled; the order is a pure function of (seed, epoch): a resumed run replays it.
"""

import math
import os

import numpy as np
import torch

from common import UserError
from data.prepare import SPLITS, load_meta, prepare, tokenizer
from data.stories import EOS, load_sequences, story_targets


class CompletionSplit:
    """One split as memmaps: tokens (flat), offsets (N + 1), the context length of each sequence."""

    def __init__(self, folder, split, meta):
        self.tokens = memmap(os.path.join(folder, f"{split}.bin"), meta["dtype"])
        self.offsets = np.fromfile(os.path.join(folder, f"{split}.idx"), dtype=np.int64)
        self.lengths = np.diff(self.offsets)  # (N,) tokens, eos included
        self.contexts = np.fromfile(os.path.join(folder, f"{split}.ctx"), np.int32).astype(np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)

    def context(self, i):  # the context x of sequence i: what a decoder is prompted with
        return self[i][: self.contexts[i]]


def memmap(path, dtype):  # read-only (an empty file: a split of your own text that kept no line)
    return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def load(dataset, data_dir=None, vocab="word", verbose=True, protocol="paper"):
    """-> meta, the splits, their streams."""
    folder = prepare(dataset, data_dir, vocab, verbose, protocol)
    meta = load_meta(folder)
    return (
        meta,
        {s: CompletionSplit(folder, s, meta) for s in SPLITS},
        {s: memmap(os.path.join(folder, f"{s}.stream.bin"), meta["dtype"]) for s in SPLITS},
    )


def load_data(args, verbose=True):
    """A run's data: dict(vocab, vocab_size, eos_id, and per split what its task reads)."""
    if args.task in ("story", "storyline"):
        d = load_sequences(args, verbose)
        return dict(
            d, train=d["train"][: args.train_seqs or None], vocab_size=len(d["vocab"]), eos_id=EOS
        )
    meta, splits, streams = load(args.dataset, args.data_dir, args.vocab, verbose, args.protocol)
    data = dict(
        splits,
        vocab=meta["vocab"],
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        tokenizer=tokenizer(meta["vocab"]),
        streams=streams,
    )
    if args.task == "stream":
        data["train"] = batchify(streams["train"], args.batch_size)
    return data


def epoch_batches(args, data, epoch, split="train", limit=None, sizes=None):
    """The keys of an epoch's batches, a pure function of (seed, epoch): a resumed run replays them
    (stories: a key seeds its insertion orders).  Not "train": in order, the first `limit` only."""
    if args.task == "stream":
        return bptt_windows(data[split].size(1), args.bptt)
    # The training split's order is shuffled, a pure function of (seed, epoch); the others' not.
    rng = None
    if split == "train":
        rng = np.random.default_rng([args.seed, epoch])
    if args.task in ("story", "storyline"):
        index = batches([len(s["tokens"]) for s in data[split][:limit]], args.batch_size, rng=rng)
        # A batch's key seeds its insertion orders: below 2^63 for any --seed (a generator's seed
        # is a 64-bit integer), and unchanged for the seeds below ~9.2e6 where it always was.
        key = (args.seed * 1_000_003 + epoch) * 1_000_003
        return [(ix, (key + j) % 2**63) for j, ix in enumerate(index)]
    if split == "train":
        limit = args.train_seqs or None
    lengths = data[split].lengths[:limit]
    if args.protocol == "authors" and split == "train":
        # The authors' DataLoader(shuffle=True): random batches, each padded to its longest line.
        order = rng.permutation(len(lengths))
        size = args.batch_size or 32
        return [order[i : i + size] for i in range(0, len(order), size)]
    sizes = sizes or dict(batch_size=args.batch_size, max_tokens=args.max_tokens)
    if not any(sizes.values()):
        sizes = dict(batch_size=32)
    return batches(lengths, **sizes, rng=rng, max_len=args.window)


def targets_per_batch(args, data):
    """The mean count of predicted tokens (or events) in an epoch's training batches.

    NMST eq. 3 is a mean over every target token of the data, each weighted alike.  Batches are
    sorted by length, so a batch of short lines holds few targets: dividing each step's summed
    NLL by its own batch's count would weigh each of those tokens several times more (the eos
    targets 3.7x their share on WikiText-2).  Every step divides by this one number instead."""
    keys = epoch_batches(args, data, 0)
    if args.task == "stream":
        counts = [data["train"].size(0) * length for _, length in keys]
    elif args.task in ("story", "storyline"):
        per_story = [story_targets(s, args.model != "gpt") for s in data["train"]]
        counts = [sum(per_story[i] for i in index) for index, _ in keys]
    else:
        split = data["train"]
        per_sequence = sequence_targets(split.lengths, split.contexts, args.protocol == "authors")
        counts = [int(per_sequence[index].sum()) for index in keys]
    return sum(counts) / max(len(counts), 1)


def sequence_targets(lengths, contexts, context_loss=False):
    """(N,) the targets of each sequence that enter the loss: its continuation (NMST eq. 3), or
    with context_loss (the authors' protocol) every token after the first."""
    if context_loss:
        return lengths - 1
    return np.maximum(lengths - np.maximum(contexts, 1), 0)


def check_fits(args, data):
    """A run that would silently do nothing is an error: no step, nothing to validate on."""
    n = len(epoch_batches(args, data, 0))
    if n < args.grad_accum:
        raise UserError(
            f"an epoch has {n} batch(es), fewer than --grad_accum {args.grad_accum}: "
            f"no step would run ({too_few(args, data)})"
        )
    if args.task == "stream":
        batchify(data["streams"]["valid"], 10, "valid")  # (an error when too short)
    if args.task == "completion" and not epoch_batches(
        args, data, 0, "valid", args.eval_seqs or None
    ):
        raise UserError(
            f"no validation sequence fits the --block_size {args.block_size} window "
            f"(or the split holds none): raise --block_size"
        )
    stories = args.task in ("story", "storyline")
    longest = max(len(s["tokens"]) for k in ("train", "valid") for s in data[k]) if stories else 0
    if longest - (args.model == "gpt") > args.block_size:  # (L2R: reads all tokens but the last)
        raise UserError(f"a story of {longest} tokens exceeds --block_size {args.block_size}")


def too_few(args, data):
    """Why an epoch of completion has too few batches: no line long enough, or none that fits the
    window, or too few lines for --grad_accum."""
    if args.task != "completion":
        return "it needs more data"
    lengths = data["train"].lengths[: args.train_seqs or None]
    if not len(lengths):
        return "it needs lines of more than 10 tokens"
    if args.window and args.protocol != "authors" and min(lengths) - 1 > args.window:
        return f"every training line is longer than the --block_size {args.window} window"
    return "it needs more lines, or a smaller --batch_size / --max_tokens"


def batches(lengths, batch_size=None, max_tokens=None, rng=None, max_len=None):
    """Batches by input length: index arrays into `lengths` of batch_size sequences, or of
    max_tokens // T sequences of inputs up to T (their bucket; the last few join the next one).
    rng: a numpy Generator that shuffles (the ties within a length, then the batches' order);
    None: in order.  max_len: leave out longer inputs (a GPT's window)."""
    lengths = np.asarray(lengths)
    order = np.arange(len(lengths))
    if rng is not None:
        order = rng.permutation(len(lengths))
    order = order[lengths[order] - 1 <= (max_len or math.inf)]
    order = order[np.argsort(lengths[order] - 1, kind="stable")]  # by input length, ties random
    if batch_size is not None:
        out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    else:  # (B, T) from a few shapes, which a compiled step keeps
        T, out, rest = bucket(lengths[order] - 1, max_len or math.inf), [], order[:0]
        for b in np.unique(T):
            pool, B = np.concatenate([rest, order[T == b]]), max(1, max_tokens // int(b))
            k = len(pool) - len(pool) % B
            out, rest = out + [pool[i : i + B] for i in range(0, k, B)], pool[k:]
        out += [rest] if len(rest) else []
    if rng is not None:
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def bucket(n, cap=math.inf):  # lengths n up to a quarter octave (8, 16, ..., 64, 80, ...) <= cap
    step = 2 ** np.maximum(3, np.ceil(np.log2(np.maximum(n, 1))) - 3).astype(np.int64)
    return np.minimum(-(-np.asarray(n) // step) * step, cap).astype(np.int64)


def collate(split, index, device="cpu", cap=None, context_loss=False):
    """The batch of sequences `index` of a split (cap: T padded to its bucket, --max_tokens)."""
    width = cap and int(bucket(split.lengths[index].max() - 1, cap)) + 1
    ctx = split.contexts[np.asarray(index)]
    return pad_batch([split[i] for i in index], ctx, device, width, context_loss)


def pad_batch(seqs, ctx, device="cpu", width=None, context_loss=False):
    """Sequences and their context lengths -> one right-padded batch: inputs and targets (B, L-1),
    t (B, L-1) the continuation step of every input position (0 on padding), mask (B, L-1) True
    where the target enters the loss, lengths (B,); n (the mask's count) and n_inputs as host
    ints, so that the loss reads nothing back.  Built on the host, copied once.

        tokens   x1 x2 x3 y1 y2 y3 eos  0  0        (context c = 3, length 7, padded to 9)
        inputs   x1 x2 x3 y1 y2 y3 eos  0
        targets  x2 x3 y1 y2 y3 eos  0  0
        t        -1  0  1  2  3  4   0  0           (t = 1 where the target is y1)
        mask      .  .  1  1  1  1   .  .           (context_loss: 1 on x2, x3 too)
    """
    tokens = np.zeros((len(seqs), width or max(map(len, seqs))), dtype=np.int64)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    n = np.array([len(s) for s in seqs])
    t, mask = continuation_steps(torch.from_numpy(ctx), torch.from_numpy(n), tokens.shape[1] - 1)
    if context_loss:
        mask = torch.arange(tokens.shape[1] - 1) < torch.from_numpy(n - 1).unsqueeze(1)
    host = dict(tokens=torch.from_numpy(tokens), lengths=torch.from_numpy(n), t=t, mask=mask)
    batch = {k: to_device(v, device) for k, v in host.items()}
    return dict(
        batch,
        inputs=batch["tokens"][:, :-1],
        targets=batch["tokens"][:, 1:],
        n=int(sequence_targets(n, ctx, context_loss).sum()),
        n_inputs=int((n - 1).sum()),
    )


def continuation_steps(contexts, lengths, T):
    """contexts, lengths (B,) -> t (B, T): position i is continuation step i - context + 2 (0 on
    padding); and the loss mask (B, T): positions context-1 .. length-2 (continuation targets)."""
    pos = torch.arange(T, device=lengths.device)
    real = pos < (lengths - 1).unsqueeze(1)
    t = torch.where(real, pos - contexts.unsqueeze(1) + 2, 0)
    return t, real & (t >= 1)


def to_device(x, device):  # a host tensor on `device`: pinned and non-blocking on a GPU
    return (
        x.pin_memory().to(device, non_blocking=True)
        if torch.device(device).type == "cuda"
        else x.to(device)
    )


def batchify(stream, bsz, split="train"):
    """Continuous LM (CT paper, AWD-LSTM): the stream (N,) cut into bsz rows (bsz, N // bsz),
    each a contiguous stretch of the text; the tail that fills no row is dropped.  The alphabet
    as the stream, bsz = 4 (as pytorch/examples word_language_model draws it):

        a b c d e f g h i j k l m n o p q r s t u v w x y z
                                 |
                                 v
        a b c d e f     row b goes on where row b-1 stopped; the model reads the rows side
        g h i j k l     by side, one column a step, each row with its own hidden state
        m n o p q r     (y z: dropped)
        s t u v w x
    """
    n = len(stream) // bsz
    # Every row needs an input and a target.
    if n < 2:
        raise UserError(
            f"the {split} split is too short for a stream of {bsz} columns: "
            f"{len(stream)} tokens (a smaller --batch_size, or more text)"
        )
    return torch.from_numpy(np.asarray(stream[: n * bsz], dtype=np.int64).reshape(bsz, n))


def bptt_windows(n_cols, bptt):
    """Truncated-BPTT windows over (bsz, n_cols) columns: (start, length) pairs whose targets
    [start+1, start+length+1) cover the targets 1 .. n_cols-1 exactly once.  The rows above
    (n_cols = 6) with bptt = 2 give (0, 2), (2, 2), (4, 1):

        columns   0 1 | 2 3 | 4 5
        inputs    a b | c d | e       window (0, 2): inputs  a b   targets  b c
        targets   b c | d e | f                              g h            h i
                                                             m n            n o
                                                             s t            t u

    Column 0 is only an input, the last column only a target; the hidden state carries over
    from one window to the next.
    """
    return [(i, min(bptt, n_cols - 1 - i)) for i in range(0, n_cols - 1, bptt)]
