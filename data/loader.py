"""Reading prepared sequences (data/prepare.py) and batching them by length.

A sequence s = (x_1..x_c, y_1..y_T) with y_T = eos and c its context length (10 tokens; at
char level the characters of its first 10 words).  The model reads s[:-1] and predicts s[1:]:
position i (0-based) predicts s[i+1], so the continuation targets y_1..y_T sit at positions
c-1 .. len-2, and position i is continuation step t = i - c + 2: t = 1 at y_1 (NMST eq. 10),
t <= 0 on the context.  `collate` builds t and the loss mask once, for the whole batch; only
continuation targets enter the loss (NMST paper eq. 3), context targets and padding never do.

Batches are length-bucketed: sequences sorted by length (ties in a random order), cut into
batches of `batch_size` sequences (RNN/LSTM; paper: 32) or of at most `max_tokens` padded
tokens (GPT; paper: 1024), and the batch order shuffled.  The order is a pure function of
(seed, epoch), so a resumed run replays it exactly without storing any RNG state.
"""
import os

import numpy as np
import torch

from data.prepare import CONTEXT_LEN, DataError, check_prepared, load_meta, prepare


class CompletionSplit:
    """One split of a prepared dataset as memmaps: tokens (flat), offsets (N + 1) and the
    context length of every sequence."""

    def __init__(self, folder, split, meta=None):
        self.meta = meta or load_meta(folder)
        self.folder, self.split = folder, split
        self.tokens = memmap(os.path.join(folder, f"{split}.bin"), self.meta["dtype"])
        self.offsets = np.fromfile(os.path.join(folder, f"{split}.idx"), dtype=np.int64)
        self.lengths = np.diff(self.offsets)  # (N,) tokens incl. eos
        ctx = os.path.join(folder, f"{split}.ctx")
        self.contexts = np.fromfile(ctx, dtype=np.int32).astype(np.int64) if os.path.exists(ctx) \
            else np.full(len(self.lengths), CONTEXT_LEN, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], dtype=np.int64)

    def context(self, i):
        """The context x of sequence i (what a decoder is prompted with)."""
        return self[i][:self.contexts[i]]


def load_stream(folder, split):
    """The continuous token stream of a split (--task stream) as a memmap (N,)."""
    return memmap(os.path.join(folder, f"{split}.stream.bin"), load_meta(folder)["dtype"])


def memmap(path, dtype):
    """A read-only memmap of a prepared file; an empty file (a split of your own text that kept
    no line) is an empty array, which numpy cannot map."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def batchify(stream, bsz):
    """Continuous LM (CT paper, as in AWD-LSTM): cut the stream into bsz equal columns,
    dropping the N % bsz tail.  (N,) -> LongTensor (bsz, N // bsz); row b is a contiguous piece."""
    n = len(stream) // bsz
    return torch.from_numpy(np.asarray(stream[:n * bsz], dtype=np.int64).reshape(bsz, n))


def bptt_windows(n_cols, bptt):
    """Truncated-BPTT windows over a batchified (bsz, n_cols) array: (start, length) pairs whose
    inputs [start, start+length) and targets [start+1, start+length+1) cover every target column
    1 .. n_cols-1 exactly once."""
    return [(i, min(bptt, n_cols - 1 - i)) for i in range(0, n_cols - 1, bptt)]


def load(dataset, data_dir=None, verbose=True, vocab="word"):
    """-> (meta, {split: CompletionSplit}) after preparing (or checking) the dataset."""
    folder = prepare(dataset, data_dir, verbose=verbose, vocab=vocab)
    meta = load_meta(folder)
    problem = check_prepared(folder, meta)
    if problem:  # changed between prepare() and now: refuse rather than read garbage
        raise DataError(f"the prepared data in {folder} changed while in use ({problem})")
    splits = {s: CompletionSplit(folder, s, meta) for s in ("train", "valid", "test")}
    return meta, splits


def batches(lengths, batch_size=None, max_tokens=None, shuffle=False, seed=0, epoch=0, limit=None,
            max_len=None):
    """Length-bucketed batches: a list of index arrays into `lengths`.
    Exactly one of batch_size (sequences per batch) / max_tokens (B * longest input <=
    max_tokens; a longer sequence gets a batch of its own).  limit: use only the first `limit`
    sequences; max_len: leave out sequences whose model input (length - 1) is longer (a GPT's
    window)."""
    if (batch_size is None) == (max_tokens is None):
        raise ValueError("give exactly one of batch_size / max_tokens")
    lengths = np.asarray(lengths)[:limit]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    if max_len is not None:
        order = order[lengths[order] - 1 <= max_len]
    order = order[np.argsort(lengths[order] - 1, kind="stable")]  # by input length, ties random
    if batch_size is not None:
        out = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    else:
        out = token_budget_batches(order, lengths, max_tokens)
    if shuffle:
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def token_budget_batches(order, lengths, max_tokens):
    """Cut `order` (ascending lengths) into batches of at most max_tokens padded input tokens."""
    out, start = [], 0
    for i in range(len(order)):
        # lengths ascend, so the longest input of order[start:i+1] is the last one
        if i > start and (i + 1 - start) * (lengths[order[i]] - 1) > max_tokens:
            out.append(order[start:i])
            start = i
    if start < len(order):
        out.append(order[start:])
    return out


def collate(split, index, device="cpu", pad_id=0):
    """index -> one batch, right-padded: tokens (B, L), lengths (B,), the model's inputs and
    targets (B, L-1), t (B, L-1) the continuation step of every input position (0 on padding)
    and mask (B, L-1), True where the target is a continuation token; n_targets (the mask's
    count) and n_inputs (real input tokens) as host ints, so the loss reads nothing back.
    Built on the host and copied once (pinned, non-blocking on a GPU)."""
    seqs = [split[i] for i in index]
    L = max(len(s) for s in seqs)
    tokens = np.full((len(seqs), L), pad_id, dtype=np.int64)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    n = np.array([len(s) for s in seqs], dtype=np.int64)
    ctx = split.contexts[np.asarray(index)]
    t, mask = continuation_steps(torch.from_numpy(ctx), torch.from_numpy(n), L - 1)
    host = dict(tokens=torch.from_numpy(tokens), lengths=torch.from_numpy(n), t=t, mask=mask)
    if torch.device(device).type == "cuda":
        batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in host.items()}
    else:
        batch = {k: v.to(device) for k, v in host.items()}
    tokens = batch["tokens"]
    return dict(batch, inputs=tokens[:, :-1], targets=tokens[:, 1:],
                n_targets=int(np.maximum(n - np.maximum(ctx, 1), 0).sum()),
                n_inputs=int((n - 1).sum()))


def continuation_steps(contexts, lengths, T):
    """contexts, lengths (B,) -> t (B, T): position i of a row is continuation step
    i - context + 2 (1 at the first continuation target), 0 on padding; and the loss mask
    (B, T): positions context-1 .. length-2, whose targets are continuation tokens."""
    pos = torch.arange(T, device=lengths.device)
    real = pos < (lengths - 1).unsqueeze(1)
    t = torch.where(real, pos - contexts.unsqueeze(1) + 2, 0)
    return t, real & (t >= 1)
