"""Training tasks: how batches are made, resumed and scored.  train.py's one loop runs any of
them; evaluate.py scores checkpoints with the same code.

    CompletionTask  sequence completion (NMST paper section 4): -log p(y | x) over the
                    continuation tokens y of each line, x its first 10 words
    StreamTask      continuous language modelling (CT paper): truncated BPTT over the
                    concatenated corpus, the hidden state carried (and detached) across windows
    StoryTask       stories for the insertion models (InsNet paper) and their L2R baseline:
                    -log p over a sequence's predicted events along one insertion order

Every task has the same parts:
    epoch(e)              -> the keys of epoch e's batches: a pure function of (seed, e), so a
                             resumed run replays them exactly
    batch(key, device)    -> a dict of tensors (t, the continuation step of every position, is
                             built here, once: data/loader.collate) and n_inputs, the tokens it
                             holds (a host int)
    scores(model, batch)  -> (log p of every predicted token or event (B, T), the mask of those
                             that count, their number n as a host int): train.py's loss is
                             -sum(log p over the mask) / n, NMST paper eq. 3
    penalised(model, l)   -> the loss with CT paper eq. 8's LS / AR / TAR (the LM tasks)
    evaluate(model, dev)  -> the validation figures (nll per predicted event first)
    state() / load_state  what must survive a resume besides the model (StreamTask: the hidden
                          state)
    tokens_per_epoch(), mean_length(), check_fits(args): what train.py reports and checks
and `signature`, what its data was made from (checkpoints keep it; evaluate.py and --resume
refuse other data), `note`, what the user should know about the data, vocab_size and eos_id.
"""
import contextlib
import hashlib
import math
import os

import numpy as np
import torch

from checkpoint import CheckpointError
from cli import Dist, UserError, bar
from data.loader import batches, batchify, bptt_windows, collate, load, load_stream
from data.prepare import CONTEXT_LEN, tokenizer_of, vocabulary_of
from data.stories import EOS, load_sequences
from heads import loss_scale
from insnet import InsertionTransformer, InsNet, collate_insertions
from model import WINDOWED, LanguageModel, eval_mode

INSERTION_MODELS = dict(insnet=InsNet, insertion_transformer=InsertionTransformer)
STORY_DATASETS = ("rocstories", "synthetic")


def build_model(cfg):
    """The model of a config dict: InsNet, IT-vanilla, or a LanguageModel (backbone + head)."""
    return INSERTION_MODELS.get(cfg["model"], LanguageModel)(cfg)


def model_from_checkpoint(ckpt, path="checkpoint"):
    """Build the checkpoint's model and load its weights; a mismatch names the file."""
    try:
        model = build_model(ckpt["config"])
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: its weights do not fit its model config ({first})") \
            from None
    return model


def to_device(state, device):
    """A tensor or tuple of tensors (or None) on `device`; from the host asynchronously (pinned
    memory, non-blocking) when that is a GPU."""
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(to_device(s, device) for s in state)
    if state.device.type == "cpu" and torch.device(device).type == "cuda":
        return state.pin_memory().to(device, non_blocking=True)
    return state.to(device)


def detach(state):
    """Cut the graph of a recurrent state (tensor or tuple of tensors)."""
    if state is None:
        return None
    return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()


def unwrap(model):
    """The LanguageModel inside a DistributedDataParallel wrapper (or the model itself)."""
    return getattr(model, "module", model)


class Task:
    """What every task shares: its data's signature and note, no penalty on the loss, nothing
    to carry across a resume besides the model (StreamTask overrides), no contexts to decode
    (CompletionTask overrides)."""

    def __init__(self, signature=None, note=""):
        self.signature, self.note = signature or {}, note

    def penalised(self, model, loss):
        return loss

    def state(self):
        return {}

    def load_state(self, state):
        pass

    def decodable_split(self, name):
        raise UserError("--decoder continues the contexts of sequence-completion data; this "
                        "checkpoint was trained on another task (use a completion model)")

    def mean_length(self):
        """The mean training sequence length (for the MFU estimate), or None."""
        return None

    def probe(self, lm, device, n, L):
        """The termination probe of a training run (CompletionTask has contexts to continue)."""
        return None


class LanguageModelTask(Task):
    """What the completion and stream tasks share: a prepared dataset (meta, its folder, its
    tokenizer) and CT paper eq. 8's penalties on the loss."""

    def __init__(self, meta=None, folder=None, loss_scale=1.0, ar=0.0, tar=0.0, **info):
        super().__init__(**info)
        self.meta, self.folder = meta or {}, folder
        self.loss_scale, self.ar, self.tar = loss_scale, ar, tar
        self.vocab_size, self.eos_id = self.meta.get("vocab_size"), self.meta.get("eos_id")

    def tokenizer(self):
        return tokenizer_of(self.folder, self.meta)

    def columns(self, split, limit=None):
        """A split's token stream (every line + eos) as the 10 evaluation columns (CT paper);
        limit: the first N tokens of each column."""
        data = long_enough(batchify(load_stream(self.folder, split), 10), split)
        return data[:, :limit + 1] if limit else data

    def penalised(self, model, ce):
        """ce * LS (eq. 8's loss scaling, a constant) + AR / TAR on the last recurrent layer."""
        loss = ce * self.loss_scale
        if self.ar or self.tar:
            loss = loss + unwrap(model).backbone.activation_regularisation(self.ar, self.tar)
        return loss


class CompletionTask(LanguageModelTask):
    """Sequence completion (NMST paper section 4, eq. 3)."""

    def __init__(self, splits, batch_size=None, max_tokens=None, max_len=None, seed=0,
                 train_seqs=0, eval_seqs=0, **kw):
        super().__init__(folder=splits["train"].folder, **kw)
        self.splits, self.seed, self.train_seqs, self.eval_seqs = splits, seed, train_seqs, \
            eval_seqs
        self.sizes = dict(batch_size=batch_size, max_tokens=max_tokens, max_len=max_len)
        self.note = self.note or self.window_note()

    def epoch(self, e):
        return batches(self.splits["train"].lengths, shuffle=True, seed=self.seed, epoch=e,
                       limit=self.train_seqs or None, **self.sizes)

    def batch(self, index, device, split="train"):
        return collate(self.splits[split], index, device)

    def scores(self, model, batch):
        """log p of every target (B, T), the mask of the continuation tokens (eos included) and
        their number (counted on the host by collate: no device read)."""
        return self.loss_terms(model, batch), batch["mask"], batch["n_targets"]

    def decodable_split(self, name):
        return self.splits[name]

    @torch.no_grad()
    def probe(self, lm, device, n, L, decode_batch=64):
        """The termination probe (train.py, at every evaluation): greedy continuations of the
        first n validation contexts, up to L tokens (less where a window is shorter), batched as
        evaluate.py --decoder greedy --limit n --L L does, so its r_nt(L) is evaluate.py's.
        -> dict(r_nt, L, n, mean_length, example: the first continuation), or None."""
        from decode import decode_in_batches, longest_continuation, non_termination_ratio
        split = self.splits["valid"]
        n = min(n, len(split))
        cap = longest_continuation(lm, max((int(split.contexts[i]) for i in range(n)), default=0))
        L = L if cap is None else min(L, cap)
        if n == 0 or L < 1:
            return None
        res = decode_in_batches(lm, [torch.as_tensor(split.context(i)) for i in range(n)], L,
                                "greedy", decode_batch)
        lengths, done = res["lengths"], res["terminated"]
        return dict(r_nt=non_termination_ratio(lengths, done, L), L=L, n=n,
                    mean_length=float(lengths.double().mean()),
                    example=(split.context(0).tolist(), res["tokens"][0], bool(done[0])))

    def lengths(self, split="train", window=True):
        """The lengths of the sequences an epoch (train) or a validation (valid) reads:
        --train_seqs / --eval_seqs of them, less those the window of a GPT / GCNN leaves out."""
        n = self.splits[split].lengths[:(self.train_seqs if split == "train" else
                                         self.eval_seqs) or None]
        m = self.sizes["max_len"]
        return n if m is None or not window else n[n - 1 <= m]

    def window_note(self):
        """What the window leaves out of training and validation ('' when nothing)."""
        sizes = {s: (len(self.lengths(s, window=False)), len(self.lengths(s)))
                 for s in ("train", "valid")}
        if all(n == kept for n, kept in sizes.values()):
            return ""
        return " and ".join(f"{n - kept:,} of {n:,} {s}" for s, (n, kept) in sizes.items()) + \
            f" sequences are longer than the {self.sizes['max_len']}-token window (--block_size) " \
            f"and left out"

    def tokens_per_epoch(self):
        return int(np.sum(self.lengths() - 1))

    def mean_length(self):
        return self.tokens_per_epoch() / max(1, len(self.lengths()))

    def check_fits(self, args):
        """Something to train and validate on (a split of your own text may keep no sequence;
        a window may leave every sequence out)."""
        for name in ("train", "valid"):
            if not len(self.splits[name]):
                own = "; without valid.txt / test.txt, train.txt's last lines are held out " \
                    "for them" if args.dataset == "text" else ""
                unit = "GPT-2 BPE tokens" if self.meta.get("tokenizer") == "gpt2" else "words"
                raise UserError(f"the {name} split of {args.dataset} holds no sequence: "
                                f"sequence completion needs lines of more than {CONTEXT_LEN} "
                                f"{unit} (the first {CONTEXT_LEN} are the context){own}")
        if not len(batches(self.splits["valid"].lengths, limit=self.eval_seqs or None,
                           **self.eval_sizes())):
            which = f"each of the first {self.eval_seqs} (--eval_seqs)" if self.eval_seqs else \
                "every one"
            raise UserError(f"no validation sequence fits the --block_size {args.block_size} "
                            f"window: {which} is longer; raise --block_size"
                            + (" or --eval_seqs" if self.eval_seqs else ""))

    def report(self, res, split):
        if res["sequences"] == 0 and not res["skipped"]:
            raise UserError(f"the {split} split holds no sequence: nothing to evaluate")
        if res["sequences"] == 0:
            raise UserError(f"no {split} sequence fits this model (all {res['skipped']} are "
                            f"longer than its context window): nothing to evaluate")
        return (f"{'split':6s} {'sequences':>9s} {'tokens':>9s} {'nll':>7s} {'ppl':>9s} "
                f"{'p(eos@end)':>10s}\n{split:6s} {res['sequences']:9d} {res['tokens']:9d} "
                f"{res['nll']:7.4f} {res['ppl']:9.2f} {res['eos_prob_at_end']:10.4f}"
                + (f"\n({res['skipped']:,} longer sequences do not fit the model's "
                   f"{self.sizes['max_len']}-token window: left out)" if res["skipped"] else ""))

    @torch.no_grad()
    def evaluate(self, lm, device, split="valid", limit=None, rank=0, world=1, autocast=None,
                 desc=None):
        """Perplexity exactly as the NMST paper uses it: exp of the mean NLL over the
        continuation tokens (eos included) given the context; also the mean p(eos) at the true
        end.  Under torchrun each process scores every world-th batch and the sums are
        all-reduced.  -> dict(nll, ppl, tokens, sequences, skipped, eos_prob_at_end)."""
        data = self.splits[split]
        limit = limit if limit is not None else (self.eval_seqs or None)
        sums = torch.zeros(4, dtype=torch.float64)  # nll, tokens, p(eos) at the end, sequences
        with eval_mode(lm):
            for index in bar(batches(data.lengths, limit=limit, **self.eval_sizes())[rank::world],
                             desc):
                b = collate(data, index, device)
                with autocast or contextlib.nullcontext():
                    log_p = self.loss_terms(lm, b)
                last = log_p.gather(1, (b["lengths"] - 2).unsqueeze(1))  # the final eos
                sums += torch.tensor([-log_p[b["mask"]].sum().item(), int(b["mask"].sum()),
                                      last.exp().sum().item(), len(index)], dtype=torch.float64)
        sums = torch.tensor(Dist(rank, world, device).all_sum(sums.tolist()))
        considered = len(data) if limit is None else min(limit, len(data))
        nll = sums[0].item() / max(sums[1].item(), 1)
        return dict(nll=nll, ppl=math.exp(min(nll, 700.0)), tokens=int(sums[1]),
                    sequences=int(sums[3]), skipped=considered - int(sums[3]),
                    eos_prob_at_end=sums[2].item() / max(sums[3].item(), 1))

    def eval_sizes(self):
        """Evaluation batches: the training ones, by tokens or 32 sequences."""
        s = dict(self.sizes)
        if s["batch_size"] is None and s["max_tokens"] is None:
            s["batch_size"] = 32
        return s

    @staticmethod
    def loss_terms(lm, b):
        """log p(target) at every position of a collated batch, float32.  -> (B, T)"""
        return lm(b["inputs"], b["t"], targets=b["targets"]).float()


class StreamTask(LanguageModelTask):
    """Continuous language modelling (CT paper, as AWD-LSTM): the corpus cut into batch_size
    columns, truncated BPTT windows, the hidden state carried and detached between windows and
    reset at each epoch's start; validation on 10 columns (the usual evaluation batch)."""

    def __init__(self, folder, batch_size, bptt, eval_seqs=0, **kw):
        super().__init__(folder=folder, **kw)
        self.bptt, self.hidden = bptt, None
        self.train = batchify(load_stream(folder, "train"), batch_size)
        self.valid = batchify(load_stream(folder, "valid"), 10)
        if eval_seqs:  # the first N tokens of each of the 10 validation columns
            self.valid = self.valid[:, :eval_seqs + 1]

    def epoch(self, e):
        return bptt_windows(self.train.size(1), self.bptt)

    def batch(self, window, device):
        i, L = window
        x, y = self.train[:, i:i + L], self.train[:, i + 1:i + 1 + L]
        return dict(x=to_device(x, device), y=to_device(y, device), start=i, n_inputs=x.numel())

    def scores(self, model, batch):
        """log p of every target of the window, all of which count; the hidden state goes on
        from the previous window (detached: truncated BPTT)."""
        if batch["start"] == 0:  # each epoch starts the streams afresh
            self.hidden = None
        hidden = to_device(self.hidden, batch["x"].device)  # a resumed state comes from disk
        log_p, hidden = model.stream_log_probs(batch["x"], batch["y"], hidden)
        self.hidden = detach(hidden)  # truncated BPTT: no gradient into the past
        return log_p.float(), torch.ones_like(batch["y"], dtype=torch.bool), batch["y"].numel()

    def evaluate(self, lm, device, split="valid", limit=None, desc=None, **_):
        """Continuous-LM perplexity of a split; limit: the first N tokens of each column."""
        data = long_enough(self.valid, split) if split == "valid" and not limit else \
            self.columns(split, limit)
        return stream_perplexity(lm, data, self.bptt, device, desc)

    def report(self, res, split):
        return (f"{split}: stream perplexity {res['ppl']:.2f} (nll {res['nll']:.4f} over "
                f"{res['tokens']:,} tokens, batch 10, BPTT {self.bptt})")

    def tokens_per_epoch(self):
        return int(self.train.numel())

    def mean_length(self):
        return self.bptt

    def check_fits(self, args):
        long_enough(self.train, "train")
        long_enough(self.valid, "valid")

    def state(self):
        return dict(hidden=self.hidden)

    def load_state(self, state):
        self.hidden = state.get("hidden")


def long_enough(data, split):
    """A batchified split (bsz, N) whose columns hold a target each (N >= 2; a small text cut
    into many columns may not), else a one-line error."""
    if data.size(1) < 2:
        fix = "a smaller --batch_size, or more text" if split == "train" else "more text"
        raise UserError(f"the {split} split is too short for a stream: {data.numel()} tokens in "
                        f"{data.size(0)} columns ({fix})")
    return data


@torch.no_grad()
def stream_perplexity(lm, data, bptt, device="cpu", desc=None):
    """Continuous-LM perplexity (CT paper): exp of the mean NLL over every target token of a
    batchified stream (bsz, N), hidden state carried across BPTT windows."""
    nll, n, state = 0.0, 0, None
    with eval_mode(lm):
        for i, L in bar(bptt_windows(data.size(1), bptt), desc):
            x, y = data[:, i:i + L].to(device), data[:, i + 1:i + 1 + L].to(device)
            log_p, state = lm.stream_log_probs(x, y, state)
            nll -= log_p.double().sum().item()
            n += y.numel()
    return dict(nll=nll / n, ppl=math.exp(min(nll / n, 700.0)), tokens=n)


# ---------------------------------------------------------------------------------------------
# stories: the insertion models (insnet.py) and their L2R baseline (InsNet paper section 5)
# ---------------------------------------------------------------------------------------------
INSERTION_BATCH = ("tokens", "order", "lengths", "n_given", "slot_start")


def story_batch(seqs, kind, order="random", generator=None, device="cpu"):
    """A batch of encoded story sequences.  L2R (gpt): right-padded tokens and the mask of the
    tokens after the given prefix (EOS included).  Insertion models: one insertion order per
    sequence (`order`: random from `generator`, or l2r), insnet.collate_insertions.  Both with
    n_events (the predicted events: tokens; insertions + termination) and n_inputs, host ints."""
    toks = [s["tokens"] for s in seqs]
    sizes = dict(n_inputs=sum(map(len, toks)))
    if kind in INSERTION_MODELS:
        batch = collate_insertions(toks, [s["n_given"] for s in seqs],
                                   [s["keyword_pos"] for s in seqs], order, generator, device)
        given = [1 + s["n_given"] + len(s["keyword_pos"]) for s in seqs]  # BOS EOS prefix kws
        return dict(batch, n_events=sum(len(t) - g + 1 for t, g in zip(toks, given)), **sizes)
    L = max(len(t) for t in toks)
    tokens = torch.zeros(len(toks), L, dtype=torch.long)
    for b, t in enumerate(toks):
        tokens[b, :len(t)] = torch.as_tensor(t)
    lengths = torch.tensor([len(t) for t in toks])
    pos = torch.arange(L - 1)
    given = torch.tensor([s["n_given"] for s in seqs])
    mask = (pos >= (given - 1).unsqueeze(1)) & (pos < (lengths - 1).unsqueeze(1))
    batch = {k: v.to(device) for k, v in dict(tokens=tokens, lengths=lengths, mask=mask).items()}
    return dict(batch, n_events=sum(len(t) - s["n_given"] for t, s in zip(toks, seqs)), **sizes)


def story_scores(model, batch):
    """log p of every predicted event (B, T) and the mask of those that count.  L2R: the tokens
    after the given prefix.  Insertion models (through forward, so that DDP sees training): per
    step log p(slot) + log p(token | slot) of every non-given insertion, then the termination."""
    if "order" not in batch:
        log_p = model(batch["tokens"][:, :-1], None, targets=batch["tokens"][:, 1:])
        return log_p.float(), batch["mask"]
    sc = model(**{k: batch[k] for k in INSERTION_BATCH})
    log_p = torch.cat([sc["slot"] + sc["token"], sc["end"].unsqueeze(1)], 1)
    return log_p, torch.cat([sc["loss_mask"], torch.ones_like(sc["loss_mask"][:, :1])], 1)


def story_nll(model, batch):
    """-log p of each sequence of a batch (B,) (insertion models: of the (sequence, order) pair:
    its slot, token and termination terms) and its number of predicted events (B,)."""
    if "order" in batch:
        sc = model(**{k: batch[k] for k in INSERTION_BATCH})
        return -(sc["slot"].sum(1) + sc["token"].sum(1) + sc["end"]), sc["loss_mask"].sum(1) + 1
    log_p, mask = story_scores(model, batch)
    return -(log_p * mask).sum(1), mask.sum(1)


class StoryTask(Task):
    """Stories (InsNet paper section 4): the loss of a batch is the mean -log p over its
    predicted events (slot + token per insertion, termination; L2R: tokens), one fresh
    insertion order per sequence per batch, drawn from a generator seeded by the batch's key
    (so a resumed run draws the same orders)."""

    def __init__(self, data, kind, order="random", batch_size=32, seed=0, train_seqs=0,
                 eval_seqs=0, variant="story", **info):
        super().__init__(note=data.note, **info)
        self.data, self.kind, self.order, self.batch_size, self.seed = data, kind, order, \
            batch_size, seed
        self.variant, self.vocab_size, self.eos_id = variant, len(data.vocab), EOS
        self.splits = dict(data.splits, train=data.splits["train"][:train_seqs or None],
                           valid=data.splits["valid"][:eval_seqs or None])

    def epoch(self, e):
        index = batches([len(s["tokens"]) for s in self.splits["train"]], self.batch_size,
                        shuffle=True, seed=self.seed, epoch=e)
        return [(ix, (self.seed * 1_000_003 + e) * 1_000_003 + j) for j, ix in enumerate(index)]

    def batch(self, key, device):
        index, order_seed = key
        seqs = [self.splits["train"][i] for i in index]
        return story_batch(seqs, self.kind, self.order, torch.Generator().manual_seed(order_seed),
                           device)

    def scores(self, model, batch):
        return (*story_scores(model, batch), batch["n_events"])

    def tokens_per_epoch(self):
        return sum(len(s["tokens"]) for s in self.splits["train"])

    def check_fits(self, args):
        """Every canvas within --block_size (insertion models: the whole sequence; L2R: its
        inputs, all tokens but the last)."""
        longest = max(len(s["tokens"]) for split in self.splits.values() for s in split)
        need = longest if self.kind in INSERTION_MODELS else longest - 1
        if need > args.block_size:
            raise UserError(f"a sequence of {longest} tokens exceeds --block_size "
                            f"{args.block_size}: use --block_size {need} or more")

    @torch.no_grad()
    def evaluate(self, model, device, split="valid", limit=None, seed=None, desc=None, **_):
        """-> dict(nll (per event), nll_per_story, ppl (= exp nll), stories, events,
        nll_bound_per_story).  The orders come from one generator seeded with `seed` (the run's
        seed): the same for every call.  With random orders, nll_per_story estimates
        E_pi[-log p(x, pi)] over the n! orders of a story's n inserted tokens, and by Jensen's
        inequality with the uniform order distribution  -log p(x) = -log sum_pi p(x, pi) <=
        E_pi[-log p(x, pi)] - log n!,  so nll_bound_per_story = nll_per_story - mean log n!
        bounds -log p(story) from above and is comparable with L2R's NLL."""
        seqs = self.splits[split][:limit]
        g = torch.Generator().manual_seed(self.seed if seed is None else seed)
        nll, events, log_orders = 0.0, 0, 0.0
        random_orders = self.order == "random" and self.kind in INSERTION_MODELS
        with eval_mode(model):
            for index in bar(batches([len(s["tokens"]) for s in seqs], self.batch_size), desc):
                b_nll, b_events = story_nll(model, story_batch([seqs[i] for i in index], self.kind,
                                                               self.order, g, device))
                nll += b_nll.sum().item()
                events += int(b_events.sum())
                if random_orders:  # log n! with n = events - 1 insertions (then termination)
                    log_orders += sum(math.lgamma(int(e)) for e in b_events)
        per_event, n = nll / max(events, 1), max(len(seqs), 1)
        return dict(nll=per_event, nll_per_event=per_event, nll_per_story=nll / n,
                    ppl=math.exp(min(per_event, 700.0)),
                    stories=len(seqs), events=events, nll_bound_per_story=(nll - log_orders) / n)


# ---------------------------------------------------------------------------------------------
# a run's task and data, from train.py's arguments (or the ones a checkpoint keeps)
# ---------------------------------------------------------------------------------------------
def load_task(a, data_dir=None, vocab=None, verbose=True):
    """The task of a run described by `a` (a dict of train.py's arguments) with its data.
    vocab: a story checkpoint's own vocabulary."""
    if a["dataset"] in STORY_DATASETS:
        return _story_task(a, data_dir, vocab, verbose)
    meta, splits = load(a["dataset"], data_dir, verbose=verbose, vocab=a.get("vocab") or "word")
    folder = splits["train"].folder
    ls = loss_scale(meta["vocab_size"], a["ct_alpha"], a["ct_beta"]) if a.get("loss_scaling") \
        else 1.0
    signature = dict(dataset=a["dataset"], vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                     tokenizer=meta["tokenizer"], source=meta["source"]["sha256"],
                     fingerprints=meta["fingerprints"],  # and what encodes / decodes text:
                     vocabulary=vocabulary_of(tokenizer_of(folder, meta)))
    kw = dict(meta=meta, signature=signature, loss_scale=ls, ar=a.get("ar", 0.0),
              tar=a.get("tar", 0.0))
    if a.get("task") == "stream":
        return StreamTask(folder, a["batch_size"], a["bptt"], a.get("eval_seqs", 0), **kw)
    max_len = a.get("block_size") if a["model"] in WINDOWED else None
    return CompletionTask(splits, a.get("batch_size"), a.get("max_tokens"), max_len,
                          a.get("seed", 0), a.get("train_seqs", 0), a.get("eval_seqs", 0), **kw)


def _story_task(a, data_dir, vocab, verbose):
    data = load_sequences(a["dataset"], a["task"], a["model"], data_dir, a.get("min_count", 2),
                          a.get("synthetic_count", 200), vocab=vocab, verbose=verbose)
    src = data.sources
    if a["dataset"] == "synthetic":
        prints = {s: f"synthetic-{src['synthetic']}-{s}" for s in ("train", "valid", "test")}
    else:  # without a train file, train and valid both come from dev
        prints = dict(train=src.get("train", src["dev"]), valid=src["dev"], test=src["test"])
    prints["vocab"] = hashlib.sha256("\n".join(data.vocab).encode()).hexdigest()
    signature = dict(dataset=a["dataset"], task=a["task"], vocab_size=len(data.vocab),
                     sources=src, fingerprints=prints)
    if a["dataset"] == "rocstories":
        signature["vocab"] = data.vocab
    return StoryTask(data, a["model"], a.get("order", "random"), a.get("batch_size") or 32,
                     a.get("seed", 0), a.get("train_seqs", 0), a.get("eval_seqs", 0),
                     variant=a["task"], signature=signature)


def checkpoint_task(ckpt, data_dir=None, splits=("valid", "test"), path="checkpoint", sizes=None):
    """The task of a checkpoint's run, on all of its data (no --train_seqs / --eval_seqs
    limits), checked to be the data it was made from (for the splits to be read), read from the
    run's --data_dir (while it is there) unless another is given.  sizes: evaluate.py's
    --batch_size / --max_tokens, replacing the run's batching."""
    from recipes import build_parser  # (recipes imports this module)
    a = {**vars(build_parser().parse_args([])), "model": ckpt["config"]["model"], **ckpt["args"],
         "train_seqs": 0, "eval_seqs": 0}
    if sizes and a.get("task") == "stream":
        raise UserError("--batch_size / --max_tokens do not apply to a stream checkpoint (its "
                        "perplexity reads 10 columns, as usual): drop them")
    if sizes and "max_tokens" in sizes and a["dataset"] in STORY_DATASETS:
        raise UserError("--max_tokens does not apply to a story checkpoint: stories are batched "
                        "by --batch_size sequences")
    a.update({"batch_size": None, "max_tokens": None, **sizes} if sizes else {})
    if data_dir is None and a.get("data_dir") and os.path.isdir(a["data_dir"]):
        data_dir = a["data_dir"]  # where the run read it: your own text, or a local copy
    elif data_dir is None and a["dataset"] == "text" and a.get("data_dir"):
        raise data_moved(a["data_dir"])  # (none recorded: $NANOGEN_DATA, as train.py read it)
    task = load_task(a, data_dir, vocab=ckpt.get("data", {}).get("vocab"), verbose=False)
    check_same_data(ckpt.get("data", {}), task.signature, splits, path)
    return task


def data_moved(data_dir):
    """The error when a run's --data_dir is gone (evaluate.py on your own text, --resume)."""
    return UserError(f"the run's --data_dir {data_dir} is not there (moved?): give --data_dir "
                     f"DIR where its data is now")


def check_same_data(saved, current, splits, path):
    """Refuse data whose content differs from what the checkpoint at `path` was made from:
    another vocabulary, or another version of the splits it is about to read."""
    if saved.get("vocab_size", current["vocab_size"]) != current["vocab_size"] or \
            saved.get("eos_id", current.get("eos_id")) != current.get("eos_id"):
        raise CheckpointError(f"{path} was trained on another vocabulary "
                              f"(V={saved.get('vocab_size')}) than the prepared "
                              f"{current['dataset']} (V={current['vocab_size']})")
    old, new = saved.get("fingerprints"), current["fingerprints"]
    if old:  # format-2 checkpoints: the vocabulary and every split read
        for part in ("vocab", *splits):
            if old.get(part) is not None and old.get(part) != new.get(part):
                what = "vocabulary" if part == "vocab" else f"{part} split"
                raise CheckpointError(
                    f"{path} was made from other {current['dataset']} data: its {what} differs "
                    f"from the one prepared here (point --data_dir at the data it was trained on, "
                    f"or train a new model)")
    elif saved.get("source") is not None and saved["source"] != current.get("source"):
        raise CheckpointError(f"{path} was made from another {current['dataset']} source (sha256 "
                              f"{str(saved['source'])[:24]}...) than the one found here (point "
                              f"--data_dir at the data it was trained on)")
