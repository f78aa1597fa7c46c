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
        # (N,) tokens, eos included
        self.lengths = np.diff(self.offsets)
        self.contexts = np.fromfile(os.path.join(folder, f"{split}.ctx"), np.int32).astype(np.int64)
        # The id of <cpad> (the authors' protocol), which the authors' divisor leaves out.
        words = meta["vocab"]["tokens"] if isinstance(meta["vocab"], dict) else []
        self.cpad = words.index("<cpad>") if "<cpad>" in words else None

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)

    def context(self, i):
        """The context x of sequence i: what a decoder is prompted with."""
        return self[i][: self.contexts[i]]


def memmap(path, dtype):
    """A read-only memmap (an empty file: a split of your own text that kept no line)."""
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
    # Stories are few and small: they are read whole (data/stories.py).
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
    # A stream trains on --batch_size columns of the continuous text (CT paper).
    if args.task == "stream":
        data["train"] = batchify(streams["train"], args.batch_size)
    return data


def epoch_batches(args, data, epoch):
    """The keys of a training epoch's batches, a pure function of (seed, epoch): a resumed run
    replays them (stories: a key seeds its insertion orders).  --train_seqs: the first N."""
    # The order is a pure function of (seed, epoch): a resumed run replays it.
    rng = np.random.default_rng([args.seed, epoch])
    limit = args.train_seqs or None
    if args.protocol == "authors" and args.task == "completion":
        # The authors' DataLoader(shuffle=True): random batches, each padded to its longest line.
        order = rng.permutation(len(data["train"].lengths[:limit]))
        size = args.batch_size or 32
        return [order[i : i + size] for i in range(0, len(order), size)]
    return split_batches(args, data, "train", limit, (rng, epoch))


def eval_batches(args, data, split, limit=None):
    """The keys of an evaluation's batches of a split: in order, the first `limit` sequences
    (stream: every window of the columns)."""
    return split_batches(args, data, split, limit, (None, 0))


def split_batches(args, data, split, limit, shuffle):
    """The batches of a split's first `limit` sequences; shuffle = (a numpy Generator or None:
    in order, the epoch that seeds the stories' insertion orders)."""
    rng, epoch = shuffle
    # A stream is cut in truncated-BPTT windows, in order (the state goes on from one to the next).
    if args.task == "stream":
        return bptt_windows(data[split].size(1), args.bptt)
    if args.task in ("story", "storyline"):
        index = batches([len(s["tokens"]) for s in data[split][:limit]], args.batch_size, rng=rng)
        # A batch's key seeds its insertion orders: below 2^63 for any --seed (a generator's seed
        # is a 64-bit integer), and unchanged for the seeds below ~9.2e6 where it always was.
        key = (args.seed * 1_000_003 + epoch) * 1_000_003
        return [(ix, (key + j) % 2**63) for j, ix in enumerate(index)]
    lengths = data[split].lengths[:limit]
    sizes = dict(batch_size=args.batch_size, max_tokens=args.max_tokens)
    # (an evaluation of a checkpoint without either: batches of 32 lines)
    if not any(sizes.values()):
        sizes = dict(batch_size=32)
    return batches(lengths, **sizes, rng=rng, max_len=args.window)


def targets_per_batch(args, data):
    """The mean count of predicted tokens (or events) in an epoch's training batches.

    NMST eq. 3 is a mean over every target token of the data, each weighted alike.  Batches are
    sorted by length, so a batch of short lines holds few targets: dividing each step's summed
    NLL by its own batch's count would weigh each of those tokens several times more (the eos
    targets 3.7x their share on WikiText-2).  Every step divides by this one number instead
    (--protocol authors: by each batch's own count, as the authors' code does: collate)."""
    keys = epoch_batches(args, data, 0)
    # The count of each batch: a stream window's every token, a story's events, a line's
    # continuation (the authors' protocol: its context's targets too).
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
    # The continuation starts after the context; a context of 0 still predicts from position 0.
    return np.maximum(lengths - np.maximum(contexts, 1), 0)


def check_fits(args, data):
    """A run that would silently do nothing is an error: no step, nothing to validate on."""
    n = len(epoch_batches(args, data, 0))
    if n < args.grad_accum:
        raise UserError(
            f"an epoch has {n} batch(es), fewer than --grad_accum {args.grad_accum}: "
            f"no step would run ({too_few(args, data)})"
        )
    # (a validation stream too short for 10 columns is an error)
    if args.task == "stream":
        batchify(data["streams"]["valid"], 10, "valid")
    if args.task == "completion" and not eval_batches(args, data, "valid", args.eval_seqs or None):
        raise UserError(
            f"no validation sequence fits the --block_size {args.block_size} window "
            f"(or the split holds none): raise --block_size"
        )
    stories = args.task in ("story", "storyline")
    longest = max(len(s["tokens"]) for k in ("train", "valid") for s in data[k]) if stories else 0
    # (the left-to-right baseline reads every token but the last)
    if longest - (args.model == "gpt") > args.block_size:
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
    # A window model cannot read a longer input: those sequences are left out (and counted).
    order = order[lengths[order] - 1 <= (max_len or math.inf)]
    # By input length, ties in the random order: batches of similar lengths pad little.
    order = order[np.argsort(lengths[order] - 1, kind="stable")]
    if batch_size is not None:
        out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    else:
        # (B, T) from a few shapes, which a compiled step keeps: T its bucket, B = max_tokens // T
        T, out, rest = bucket(lengths[order] - 1, max_len or math.inf), [], order[:0]
        for b in np.unique(T):
            pool, B = np.concatenate([rest, order[T == b]]), max(1, max_tokens // int(b))
            k = len(pool) - len(pool) % B
            out, rest = out + [pool[i : i + B] for i in range(0, k, B)], pool[k:]
        out += [rest] if len(rest) else []
    if rng is not None:
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def bucket(n, cap=math.inf):
    """Lengths n rounded up to a quarter octave (8, 16, ..., 64, 80, ...), at most cap."""
    step = 2 ** np.maximum(3, np.ceil(np.log2(np.maximum(n, 1))) - 3).astype(np.int64)
    return np.minimum(-(-np.asarray(n) // step) * step, cap).astype(np.int64)


def get_batch(args, data, key, device, split="train", training=False):
    """One batch: inputs, targets, t and the loss mask (completion), a window of the stream's
    columns, or stories; n (the predicted tokens or events) and n_inputs: host ints.  training:
    a batch of the training loss (the authors' protocol counts its context targets too)."""
    # A stream's window: every token counts (mask None), the state goes on unless it starts.
    if args.task == "stream":
        (i, L), cols = key, data[split]
        return dict(
            inputs=to_device(cols[:, i : i + L], device),
            t=None,
            mask=None,
            start=i,
            targets=to_device(cols[:, i + 1 : i + 1 + L], device),
            n=cols[:, :L].numel(),
            n_inputs=cols[:, :L].numel(),
        )
    # Stories: the key's seed draws this batch's insertion orders, the same on a resume.
    if args.task in ("story", "storyline"):
        return story_batch(
            [data[split][i] for i in key[0]],
            args.model != "gpt",
            args.order,
            torch.Generator().manual_seed(key[1]),
            device,
        )
    # --max_tokens batches pad T to its bucket (few shapes), within the model's window.
    cap = args.max_tokens and (args.window or math.inf)
    # The authors' protocol trains on the context's targets too (their loss has no context mask);
    # every evaluation, of any split, scores the continuation alone.
    context_loss = args.protocol == "authors" and training
    return collate(data[split], key, device, cap, context_loss)


def collate(split, index, device="cpu", cap=None, context_loss=False):
    """The batch of sequences `index` of a split (cap: T padded to its bucket, --max_tokens)."""
    width = cap and int(bucket(split.lengths[index].max() - 1, cap)) + 1
    ctx = split.contexts[np.asarray(index)]
    seqs = [split[i] for i in index]
    batch = pad_batch(seqs, ctx, device, width, context_loss)
    if context_loss:
        # The authors' divisor, their train.py:61-62: the batch's own count of targets that are
        # neither padding nor <cpad> (their loss sums the <cpad> targets all the same).
        cpad_targets = sum(int((s[1:] == split.cpad).sum()) for s in seqs)
        batch["n_authors"] = batch["n"] - cpad_targets
    return batch


def pad_batch(seqs, ctx, device="cpu", width=None, context_loss=False):
    """Sequences and their context lengths -> one right-padded batch: inputs and targets (B, L-1),
    t (B, L-1) the continuation step of every input position (0 on padding), mask (B, L-1) True
    where the target enters the loss, rows (N,) its flat positions, lengths (B,); n (the mask's
    count) and n_inputs as host ints, so that the loss reads nothing back, and input_lengths
    (B,) on the host.  Built on the host, copied once.

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
    # t and the mask are made on the host from the lengths, then copied with the tokens.
    t, mask = continuation_steps(torch.from_numpy(ctx), torch.from_numpy(n), tokens.shape[1] - 1)
    # The authors' loss has no context mask: every real target counts.
    if context_loss:
        mask = torch.arange(tokens.shape[1] - 1) < torch.from_numpy(n - 1).unsqueeze(1)
    host = dict(tokens=torch.from_numpy(tokens), lengths=torch.from_numpy(n), t=t, mask=mask)
    # The flat positions (N,) of the targets that count: the model's output layer runs on them
    # alone.  Found here on the host, so that the model reads nothing back from the device.
    host["rows"] = mask.flatten().nonzero().squeeze(1)
    batch = {k: to_device(v, device) for k, v in host.items()}
    # The counts are host ints: the loss and the logs read nothing back from the device.
    return dict(
        batch,
        inputs=batch["tokens"][:, :-1],
        targets=batch["tokens"][:, 1:],
        n=int(sequence_targets(n, ctx, context_loss).sum()),
        n_inputs=int((n - 1).sum()),
        # Each row's inputs, on the host: a recurrent backbone runs packed over them alone.
        input_lengths=torch.from_numpy(n - 1),
    )


def continuation_steps(contexts, lengths, T):
    """contexts, lengths (B,) -> t (B, T): position i is continuation step i - context + 2 (0 on
    padding); and the loss mask (B, T): positions context-1 .. length-2 (continuation targets)."""
    pos = torch.arange(T, device=lengths.device)
    real = pos < (lengths - 1).unsqueeze(1)
    t = torch.where(real, pos - contexts.unsqueeze(1) + 2, 0)
    return t, real & (t >= 1)


def to_device(x, device):
    """A host tensor on `device`: pinned and non-blocking on a GPU, so the step does not wait."""
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


# ----- stories: an insertion order per story (InsNet), or a left-to-right batch ----------------
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
    n = max(map(len, seqs))
    # Right-padded tokens; the padding's order values stay >= the length (offset_matrix needs it).
    tokens = torch.zeros(len(seqs), n, dtype=torch.long)
    order = torch.arange(n).repeat(len(seqs), 1)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.as_tensor(s)
        order[b, : len(s)] = insertion_order(len(s), n_given[b], keyword_pos[b], mode, generator)
    batch = dict(
        tokens=tokens,
        order=order,
        lengths=torch.tensor([len(s) for s in seqs]),
        n_given=torch.tensor([1 + g + len(k) for g, k in zip(n_given, keyword_pos)]),
        slot_start=torch.tensor([g - 1 for g in n_given]),
    )  # the gap after the prefix
    return {k: v.to(device) for k, v in batch.items()}  # (n_given: BOS, EOS, prefix, keywords)


def story_batch(seqs, insertion, order="random", generator=None, device="cpu"):
    """A batch of encoded stories.  An insertion model's: one insertion order per sequence
    (collate_insertions); the L2R baseline's: a batch as pad_batch's, the given prefix its context
    (its loss on the tokens after the prefix, EOS included).  n: the predicted events (tokens;
    insertions and the termination), n_inputs: the tokens read, both host ints."""
    toks, n_given = [s["tokens"] for s in seqs], [s["n_given"] for s in seqs]
    if not insertion:
        return pad_batch(toks, np.array(n_given), device)
    kws = [s["keyword_pos"] for s in seqs]
    return dict(
        collate_insertions(toks, n_given, kws, order, generator, device),
        n=sum(story_targets(s, insertion) for s in seqs),
        n_inputs=sum(map(len, toks)),
    )
