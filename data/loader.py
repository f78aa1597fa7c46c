"""A run's data and its batches: the prepared sequences (data/prepare.py) by length, a stream's
columns, stories (data/stories.py).

A sequence s = (x_1..x_c, y_1..y_T) with y_T = eos and c its context length (10 tokens; at char
level the characters of its first 10 words).  The model reads s[:-1] and predicts s[1:]: position
i predicts s[i+1], so the continuation targets y_1..y_T sit at positions c-1 .. len-2, and
position i is continuation step t = i - c + 2: t = 1 at y_1 (NMST eq. 10), t <= 0 on the
context.  `collate` builds t and the loss mask once for the whole batch: only continuation targets
enter the loss (NMST paper eq. 3), context targets and padding never do.

Batches are length-bucketed: sequences sorted by length (ties in a random order), cut into
batches of `batch_size` sequences (RNN/LSTM; paper: 32) or of at most `max_tokens` padded tokens
(GPT; paper: 1024), the batch order shuffled.  The order is a pure function of (seed, epoch), so
a resumed run replays it exactly without storing any RNG state.
"""
import os

import numpy as np
import torch

from data import UserError
from data.prepare import CONTEXT_LEN, SPLITS, load_meta, prepare, tokenizer
from data.stories import EOS, load_sequences, story_batch


class CompletionSplit:
    """One split as memmaps: tokens (flat), offsets (N + 1), the context length of each sequence."""

    def __init__(self, folder, split, meta):
        self.tokens = memmap(os.path.join(folder, f"{split}.bin"), meta["dtype"])
        self.offsets = np.fromfile(os.path.join(folder, f"{split}.idx"), dtype=np.int64)
        self.lengths = np.diff(self.offsets)  # (N,) tokens, eos included
        ctx = os.path.join(folder, f"{split}.ctx")
        self.contexts = np.fromfile(ctx, dtype=np.int32).astype(np.int64) if os.path.exists(ctx) \
            else np.full(len(self.lengths), CONTEXT_LEN, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], dtype=np.int64)

    def context(self, i):
        """The context x of sequence i: what a decoder is prompted with."""
        return self[i][:self.contexts[i]]


def memmap(path, dtype):
    """A read-only memmap (an empty file, a split of your own text that kept no line: empty)."""
    return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def load(dataset, data_dir=None, vocab="word", verbose=True):
    """-> (meta, {split: CompletionSplit}, {split: the token stream (N,)}), prepared if needed."""
    meta = load_meta(folder := prepare(dataset, data_dir, vocab, verbose))
    return meta, {s: CompletionSplit(folder, s, meta) for s in SPLITS}, {
        s: memmap(os.path.join(folder, f"{s}.stream.bin"), meta["dtype"]) for s in SPLITS}


def load_data(args, verbose=True):
    """A run's data: dict(vocab, vocab_size, eos_id, and per split what its task reads: a
    CompletionSplit; stories; a stream's training columns, its evaluation ones from "streams")."""
    if args.task in ("story", "storyline"):
        d = load_sequences(args.dataset, args.task, args.model, args.data_dir, args.min_count,
                           args.synthetic_count, verbose=verbose)
        return dict(d.splits, train=d.splits["train"][:args.train_seqs or None], vocab=d.vocab,
                    vocab_size=len(d.vocab), eos_id=EOS, stories=d.stories, note=d.note)
    meta, splits, streams = load(args.dataset, args.data_dir, args.vocab, verbose)
    data = dict(splits, vocab=meta["vocab"], vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                tokenizer=tokenizer(meta["vocab"]), streams=streams)
    return dict(data, train=batchify(streams["train"], args.batch_size)) if args.task == "stream" \
        else data


def epoch_batches(args, data, epoch, split="train", limit=None, sizes=None):
    """The keys of an epoch's batches, a pure function of (seed, epoch): a resumed run replays them
    (stories: a key seeds its batch's insertion orders).  An evaluation's (split != "train"): in
    order, of the first `limit` sequences, by the run's sizes or `sizes`."""
    train = split == "train"
    if args.task == "stream":
        return bptt_windows(data[split].size(1), args.bptt)
    if args.task in ("story", "storyline"):
        index = batches([len(s["tokens"]) for s in data[split][:limit]], args.batch_size,
                        shuffle=train, seed=args.seed, epoch=epoch)
        return [(ix, (args.seed * 1_000_003 + epoch) * 1_000_003 + j) for j, ix in enumerate(index)]
    sizes = sizes or dict(batch_size=args.batch_size, max_tokens=args.max_tokens)
    return batches(data[split].lengths, **(sizes if any(sizes.values()) else dict(batch_size=32)),
                   shuffle=train, seed=args.seed, epoch=epoch, max_len=args.window,
                   limit=(args.train_seqs or None) if train else limit)


def get_batch(args, data, key, device, split="train"):
    """One batch: inputs, targets, t and the loss mask (completion), a window of the stream's
    columns, or stories; n (the predicted tokens or events) and n_inputs: host ints."""
    if args.task == "stream":
        (i, L), cols = key, data[split]
        return dict(inputs=to_device(cols[:, i:i + L], device), t=None, mask=None, start=i,
                    targets=to_device(cols[:, i + 1:i + 1 + L], device), n=cols[:, :L].numel(),
                    n_inputs=cols[:, :L].numel())
    if args.task in ("story", "storyline"):  # (the story models: the L2R GPT, insertion models)
        return story_batch([data[split][i] for i in key[0]], args.model != "gpt", args.order,
                           torch.Generator().manual_seed(key[1]), device)
    return dict(batch := collate(data[split], key, device), n=batch["n_targets"])


def batches(lengths, batch_size=None, max_tokens=None, shuffle=False, seed=0, epoch=0, limit=None,
            max_len=None):
    """Length-bucketed batches: a list of index arrays into `lengths`, of batch_size sequences or
    max_tokens (B * longest input <= max_tokens; a longer sequence: a batch of its own).  limit:
    the first `limit` sequences only; max_len: leave out longer inputs (a GPT's window)."""
    lengths = np.asarray(lengths)[:limit]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    if max_len is not None:
        order = order[lengths[order] - 1 <= max_len]
    order = order[np.argsort(lengths[order] - 1, kind="stable")]  # by input length, ties random
    if batch_size is not None:
        out = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    else:
        out, start = [], 0
        for i in range(len(order)):  # lengths ascend: the last one of a batch is its longest
            if i > start and (i + 1 - start) * (lengths[order[i]] - 1) > max_tokens:
                out.append(order[start:i])
                start = i
        out += [order[start:]] if start < len(order) else []
    return [out[j] for j in rng.permutation(len(out))] if shuffle else out


def collate(split, index, device="cpu"):
    """index -> one right-padded batch: inputs and targets (B, L-1), t (B, L-1) the continuation
    step of every input position (0 on padding), mask (B, L-1) True where the target is a
    continuation token, lengths (B,); n_targets (the mask's count) and n_inputs as host ints, so
    that the loss reads nothing back.  Built on the host, copied once."""
    seqs = [split[i] for i in index]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), dtype=np.int64)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    n, ctx = np.array([len(s) for s in seqs]), split.contexts[np.asarray(index)]
    t, mask = continuation_steps(torch.from_numpy(ctx), torch.from_numpy(n), tokens.shape[1] - 1)
    host = dict(tokens=torch.from_numpy(tokens), lengths=torch.from_numpy(n), t=t, mask=mask)
    batch = {k: to_device(v, device) for k, v in host.items()}
    return dict(batch, inputs=batch["tokens"][:, :-1], targets=batch["tokens"][:, 1:],
                n_targets=int(np.maximum(n - np.maximum(ctx, 1), 0).sum()), n_inputs=int((n - 1).sum()))


def continuation_steps(contexts, lengths, T):
    """contexts, lengths (B,) -> t (B, T): position i of a row is continuation step
    i - context + 2 (1 at the first continuation target), 0 on padding; and the loss mask (B, T):
    positions context-1 .. length-2, whose targets are continuation tokens."""
    pos = torch.arange(T, device=lengths.device)
    real = pos < (lengths - 1).unsqueeze(1)
    t = torch.where(real, pos - contexts.unsqueeze(1) + 2, 0)
    return t, real & (t >= 1)


def to_device(x, device):
    """A host tensor on `device`: pinned and non-blocking when that is a GPU."""
    return x.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" \
        else x.to(device)


def batchify(stream, bsz, split="train"):
    """Continuous LM (CT paper, as AWD-LSTM): the stream cut into bsz equal columns, the N % bsz
    tail dropped.  (N,) -> LongTensor (bsz, N // bsz); row b is one contiguous piece."""
    if (n := len(stream) // bsz) < 2:  # every column needs an input and a target
        raise UserError(f"the {split} split is too short for a stream of {bsz} columns: "
                        f"{len(stream)} tokens (a smaller --batch_size, or more text)")
    return torch.from_numpy(np.asarray(stream[:n * bsz], dtype=np.int64).reshape(bsz, n))


def bptt_windows(n_cols, bptt):
    """Truncated-BPTT windows over (bsz, n_cols) columns: (start, length) pairs whose inputs
    [start, start+length) and targets [start+1, start+length+1) cover the targets 1 .. n_cols-1
    exactly once."""
    return [(i, min(bptt, n_cols - 1 - i)) for i in range(0, n_cols - 1, bptt)]
