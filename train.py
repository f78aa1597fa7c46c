"""Train a nanogen model: flags and recipes, then set-up (data, model, DDP, resume), then the loop.

    python train.py --model lstm --head nmst --dataset wikitext2     # the 2x512 LSTM recipe
    python train.py --head nmst --dataset wikitext103                # GPT-2 shape, from scratch
    python train.py --init_from gpt2 --head nmst --dataset wikitext103   # GPT-2 finetuning
    python train.py --model lstm --task stream --head ctmos --dataset ptb  # CT paper
    python train.py --model insnet --dataset rocstories [--task storyline]  # InsNet
    python train.py ... --resume                                     # go on from ckpt_last.pt
    torchrun --nproc_per_node=4 train.py --head nmst --dataset wikitext103

A step: the lr -> each micro-batch through one call of the model, whose masked mean -log p is
the loss (NMST paper eq. 3) -> backward -> clip (at 1.0: nanogen's choice) -> optimizer step.
Every --log_interval steps the losses are read (one read) into steps.jsonl and the processes
agree whether to stop (a signal, --max_minutes); every --eval_interval steps (0: each epoch's
end) the validation loss, the termination probe and ckpt_last.pt / ckpt_best.pt.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import curves
from data import UserError
from data.loader import batches, batchify, bptt_windows, collate, load, to_device
from data.prepare import DATASETS, VOCABS, cache_dir, download, tokenizer
from data.stories import EOS, load_sequences, story_batch
from decode import decode_in_batches, longest_continuation, non_termination_ratio
from heads import HEADS, TERMINATION_HEADS, loss_scale
from insnet import InsertionTransformer, InsNet
from model import MODELS, WINDOWED, LanguageModel, eval_mode, gpt_state_from_hf

# ---------------------------------------------------------------------------------------------
# flags: DEFAULTS; over them the recipe of the --model (NMST paper section 4 and appendix D,
# InsNet paper section 4.3; gcnn and gpt from scratch: nanogen's); over both what you type
# ---------------------------------------------------------------------------------------------
INSERTION = {"insnet": InsNet, "insertion_transformer": InsertionTransformer}
STORY_DATASETS = ("rocstories", "synthetic")
GPT2_SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
              "gpt2-xl": (48, 25, 1600)}  # (n_layer, n_head, d_model); V = 50257, 1024 positions
RECURRENT = dict(n_layer=2, d_model=512, dropout=0.5, lr=1e-3, lr_schedule="plateau", batch_size=32,
                 max_iters=0, eval_interval=0, weight_decay=0.01, decay_steps=500_000, warmup=0)
GPT = dict(n_layer=12, d_model=768, dropout=0.1, lr=6e-4, lr_schedule="linear", max_tokens=1024,
           max_iters=300_000, eval_interval=2000, weight_decay=0.01, decay_steps=300_000, warmup=2000)
RECIPES = {"rnn": dict(RECURRENT, d_model=256, dropout=0.3), "lstm": RECURRENT,
           "gcnn": dict(RECURRENT, n_layer=8, dropout=0.1), "gpt": GPT,  # nanoGPT's
           "gpt_finetune": dict(GPT, lr=5e-5, decay_steps=500_000, warmup=0),  # NMST section 4.2
           "story": dict(n_layer=12, d_model=768, dropout=0.1, lr=1e-4, lr_schedule="linear",
                         batch_size=64, max_iters=80_000, eval_interval=1000, weight_decay=0.02,
                         decay_steps=80_000, warmup=400)}  # every model on the story data
DEFAULTS = dict(
    model="gpt", head="softmax", task=None, dataset="wikitext103", vocab="word", data_dir=None,
    out_dir=None, init_from="scratch", weights=None, seed=0, device="auto", dtype="auto",
    compile=False, peak_flops=None, resume=False, epsilon=1e-5, n_head=12, block_size=1024,
    kernel_size=4, no_tie=False, no_bias=False, n_experts=4, ct_alpha=1.0, ct_beta=0.5, ct_rank=0,
    temperature=1.0, locked_dropout=False, order="random", max_offset=256, min_count=2,
    synthetic_count=200, beta1=0.9, beta2=0.99, grad_clip=1.0, lr_decay=0.5, patience=10,
    batch_size=None, max_tokens=None, bptt=70, loss_scaling=False, ar=0.0, tar=0.0,
    grad_accum=None, max_epochs=70, max_minutes=0.0, log_interval=10, eval_seqs=0, train_seqs=0,
    probe=64, probe_L=200, no_curves=False, tensorboard=False)


def number(kind, ok, words):
    """An argparse type: a finite number of `kind` for which ok(value) holds."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value
    return parse


INT1, INT0 = number(int, lambda v: v >= 1, ">= 1"), number(int, lambda v: v >= 0, ">= 0")
POS, NONNEG = number(float, lambda v: v > 0, "> 0"), number(float, lambda v: v >= 0, ">= 0")
FRACTION = number(float, lambda v: 0 <= v < 1, "in [0, 1)")
SEED = number(int, lambda v: 0 <= v < 2 ** 63, "in [0, 2^63)")
FLAGS = [  # (flag, type: a tuple is the choices, bool a switch; help)
    ("model", (*MODELS, *INSERTION), "backbone (insnet, insertion_transformer: insnet.py)"),
    ("head", HEADS, "softmax (VA, NMST eq. 2), st (eq. 9), nmst (eq. 10), mos, ct, ctmos (CT "
     "paper eq. 4, 6, 7: full rows of K*V floats a token: size the batch to fit)"),
    ("task", ("completion", "stream", "story", "storyline"), "completion (NMST paper), stream "
     "(CT paper, rnn / lstm), story / storyline (InsNet); default: by the dataset"),
    ("epsilon", number(float, lambda v: 0 < v < 1, "in (0, 1)"), "eps of ST / NMST"),
    ("dataset", (*DATASETS, *STORY_DATASETS), "text: your own, in --data_dir"),
    ("vocab", VOCABS, "wikitext2, ptb, text: word or char; text: also bpe (GPT-2's)"),
    ("data_dir", str, "local data (default $NANOGEN_DATA, else download); text: DIR/train.txt"),
    ("out_dir", str, "checkpoints and logs (default out/DATASET-MODEL-HEAD)"),
    ("init_from", ("scratch", *GPT2_SIZES), "start from GPT-2's weights (and shape)"),
    ("weights", str, "--init_from: a local copy of the weights (file or folder)"),
    ("seed", SEED, ""), ("device", str, "cpu, cuda, cuda:N (auto: cuda where there is one)"),
    ("dtype", ("auto", "float32", "bfloat16", "float16"), "autocast on CUDA (auto: bfloat16 "
     "where the GPU has it, else float32; float16 scales the loss)"),
    ("compile", bool, "torch.compile the model"),
    ("peak_flops", POS, "peak FLOP/s of one device, for MFU"),
    ("resume", bool, "go on from out_dir/ckpt_last.pt (the model's shape comes from it)"),
    ("n_layer", INT1, ""), ("d_model", INT1, "embedding = hidden size"),
    ("n_head", INT1, "attention heads"), ("block_size", INT1, "GPT / GCNN window, story canvas"),
    ("kernel_size", INT1, "gcnn: kernel width k"), ("dropout", FRACTION, ""),
    ("no_tie", bool, "untied output embeddings"), ("no_bias", bool, "GPT without biases"),
    ("n_experts", INT1, "mos / ctmos: softmaxes K"), ("ct_alpha", NONNEG, "ct: alpha, CT eq. 6"),
    ("ct_beta", POS, "ct: beta, CT eq. 6"), ("ct_rank", INT0, "ct: rank of W_tau (0: full)"),
    ("temperature", POS, "softmax / mos: a constant temperature"),
    ("locked_dropout", bool, "rnn / lstm: one dropout mask per sequence (AWD-LSTM)"),
    ("order", ("random", "l2r"), "insertion order of the training sequences"),
    ("max_offset", INT1, "insnet: offsets clipped to [-K, K]"),
    ("min_count", INT1, "rocstories: rarer words are <unk>"),
    ("synthetic_count", INT1, "synthetic: sequences per length"),
    ("lr", POS, "AdamW learning rate"), ("beta1", FRACTION, ""), ("beta2", FRACTION, ""),
    ("weight_decay", NONNEG, "on matrices only"), ("grad_clip", NONNEG, "max norm (0: off)"),
    ("lr_schedule", ("plateau", "linear", "constant"), "plateau: x --lr_decay at an evaluation "
     "that does not improve; linear: --warmup steps up, then down to 0 at --decay_steps"),
    ("lr_decay", number(float, lambda v: 0 < v <= 1, "in (0, 1]"), "plateau factor"),
    ("decay_steps", INT1, ""), ("warmup", INT0, ""),
    ("patience", INT1, "stop after N evaluations without improvement"),
    ("batch_size", INT1, "sequences per batch"), ("max_tokens", INT1, "padded tokens per batch"),
    ("bptt", INT1, "stream: window length"), ("loss_scaling", bool, "ct / ctmos: CT eq. 8's LS"),
    ("ar", NONNEG, "rnn / lstm: activation regularisation"), ("tar", NONNEG, "temporal AR"),
    ("grad_accum", INT1, "batches a step over all processes (default: one a process)"),
    ("max_epochs", INT1, ""), ("max_iters", INT0, "step limit (0: none)"),
    ("max_minutes", NONNEG, "training time limit, evaluations included (0: none)"),
    ("eval_interval", INT0, "evaluate every N steps (0: at each epoch's end)"),
    ("log_interval", INT1, "steps between the reads of the losses (steps.jsonl)"),
    ("eval_seqs", INT0, "validate on the first N sequences (0: all)"),
    ("train_seqs", INT0, "train on the first N sequences (0: all)"),
    ("probe", INT0, "termination probe: greedy-decode N validation contexts (0: off)"),
    ("probe_L", INT1, "the probe's length cap L"), ("no_curves", bool, "no OUT_DIR/curves.png"),
    ("tensorboard", bool, "also log to OUT_DIR/tensorboard (pip install tensorboard)")]


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit status 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parser():
    p = Parser(description="Train a nanogen model (defaults: train.DEFAULTS, RECIPES).")
    for flag, kind, text in FLAGS:  # every default None: what you did not type is not set
        default = DEFAULTS.get(flag)
        text += f" (default: {'the --model recipe' if default is None else default})"
        if kind is bool:
            p.add_argument(f"--{flag}", action="store_true", default=None, help=text)
        else:
            p.add_argument(f"--{flag}", **({"choices": kind} if isinstance(kind, tuple) else
                                          {"type": kind}), help=text)
    return p


def get_args(argv=None):
    """-> (args, the checkpoint to resume or None).  DEFAULTS, the --model recipe over them, the
    flags you typed over both; --resume: the checkpoint's own arguments, the typed flags over
    them (a model of another shape is refused when its config is compared)."""
    typed = {k: v for k, v in vars(parser().parse_args(argv)).items() if v is not None}
    if typed.get("data_dir"):  # kept with the run: evaluate.py may run from another folder
        typed["data_dir"] = os.path.abspath(typed["data_dir"])
    a = {**DEFAULTS, **typed}
    story = a["dataset"] in STORY_DATASETS or a["model"] in INSERTION
    recipe = RECIPES["story" if story else "gpt_finetune" if a["init_from"] != "scratch" else
                     a["model"]]
    if {"batch_size", "max_tokens"} & set(typed):  # you chose how to batch
        recipe = {k: v for k, v in recipe.items() if k not in ("batch_size", "max_tokens")}
    a = {**DEFAULTS, **recipe, **typed}
    if a["init_from"] != "scratch":  # GPT-2's shape
        shape = dict(zip(("n_layer", "n_head", "d_model"), GPT2_SIZES[a["init_from"]]),
                     block_size=1024, no_bias=False, no_tie=False)
        for k, v in shape.items():
            if typed.get(k, v) != v:
                raise UserError(f"--init_from {a['init_from']} has --{k} {v}: drop --{k}")
        a.update(shape)
    a["task"] = a["task"] or ("story" if story else "completion")
    a["grad_accum"] = a["grad_accum"] or int(os.environ.get("WORLD_SIZE", 1))
    a["out_dir"] = a["out_dir"] or os.path.join("out", run_name(a))
    ckpt = None
    if a["resume"]:
        path = os.path.join(a["out_dir"], "ckpt_last.pt")
        if not os.path.exists(path):
            raise UserError(f"--resume: no checkpoint in {a['out_dir']}; start without --resume")
        ckpt = load_checkpoint(path)
        a = {**ckpt["args"], **typed, "out_dir": a["out_dir"]}
        if a["data_dir"] and not os.path.isdir(a["data_dir"]):
            raise UserError(f"the run's --data_dir {a['data_dir']} is not there (moved?): give "
                            f"--data_dir DIR where its data is now")
    args = argparse.Namespace(**a)
    check_args(args)
    return args, ckpt


def run_name(a):
    if a["dataset"] in STORY_DATASETS:
        return f"{a['dataset']}-{a['task']}-{a['model']}" + ("-l2r" if a["order"] == "l2r" else "")
    return f"{a['dataset']}{'' if a['vocab'] == 'word' else '-' + a['vocab']}-{a['model']}-{a['head']}"


def check_args(a):
    """The combinations that cannot work, or would silently do nothing: one line each."""
    story, insertion = a.dataset in STORY_DATASETS, a.model in INSERTION
    bpe = a.dataset == "wikitext103" or (a.dataset, a.vocab) == ("text", "bpe")
    for wrong, message in [
            (insertion and not story, f"--model {a.model} trains on --dataset rocstories or synthetic"),
            (story and a.model not in (*INSERTION, "gpt"), f"--dataset {a.dataset} is for --model "
             f"insnet, insertion_transformer or gpt (the L2R baseline)"),
            (story and a.head != "softmax", "the story models have the softmax head: drop --head"),
            (story != (a.task in ("story", "storyline")), f"--task {a.task} is not for --dataset "
             f"{a.dataset} (stories: story or storyline; text: completion or stream)"),
            (a.task == "storyline" and a.dataset != "rocstories", "--task storyline needs the "
             "storylines of --dataset rocstories"),
            (a.task == "stream" and a.model not in ("rnn", "lstm"), "--task stream is for --model "
             "rnn or lstm (the CT paper's continuous LM)"),
            (a.task == "stream" and a.head in TERMINATION_HEADS, f"--head {a.head} models the end of "
             f"a sequence: use it with --task completion"),
            (a.init_from != "scratch" and (a.model != "gpt" or not bpe), f"--init_from "
             f"{a.init_from} is GPT-2: --model gpt on BPE data (wikitext103, or text --vocab bpe)"),
            (a.weights and a.init_from == "scratch", "--weights goes with --init_from gpt2 ..."),
            (a.loss_scaling and a.head not in ("ct", "ctmos"), "--loss_scaling scales by the "
             "contextual temperature: use --head ct or ctmos"),
            ((a.ar or a.tar or a.locked_dropout) and a.model not in ("rnn", "lstm"),
             "--ar / --tar / --locked_dropout act on the last layer of --model rnn or lstm"),
            (a.temperature != 1 and a.head not in ("softmax", "mos"), f"a constant --temperature "
             f"is the baseline of the softmax / mos heads, not of {a.head}"),
            (a.batch_size and a.max_tokens or story and a.max_tokens, "give --batch_size "
             "(sequences per batch) or --max_tokens (tokens per batch), not both; stories: "
             "--batch_size"),
            (a.model in ("gpt", *INSERTION) and a.d_model % a.n_head, f"--d_model {a.d_model} "
             f"must be divisible by --n_head {a.n_head}"),
            (a.order != "random" and not insertion, "--order is for insnet / insertion_transformer")]:
        if wrong:
            raise UserError(message)


def model_config(args, data):
    """The architecture, as the plain dict a checkpoint keeps (model.py reads what it needs)."""
    keys = ("model", "head", "epsilon", "n_layer", "d_model", "n_head", "block_size", "dropout",
            "kernel_size", "locked_dropout", "n_experts", "ct_alpha", "ct_beta", "ct_rank",
            "temperature", "max_offset")
    return dict({k: getattr(args, k) for k in keys}, tie=not args.no_tie, bias=not args.no_bias,
                vocab_size=data["vocab_size"], eos_id=data["eos_id"])


def build_model(cfg):
    """InsNet, IT-vanilla, or a LanguageModel (backbone + head), from a config dict."""
    return INSERTION.get(cfg["model"], LanguageModel)(cfg)


# ---------------------------------------------------------------------------------------------
# data: each task's batches (completion: data/loader.py; stream: BPTT windows; stories)
# ---------------------------------------------------------------------------------------------
def load_data(args, verbose=True):
    """dict(vocab, vocab_size, eos_id, and per split what the task reads: CompletionSplit
    memmaps; a stream's columns (train: --batch_size, evaluation: 10); encoded stories)."""
    if args.task in ("story", "storyline"):
        d = load_sequences(args.dataset, args.task, args.model, args.data_dir, args.min_count,
                           args.synthetic_count, verbose=verbose)
        return dict(d.splits, train=d.splits["train"][:args.train_seqs or None], vocab=d.vocab,
                    vocab_size=len(d.vocab), eos_id=EOS, stories=d.stories, note=d.note)
    meta, splits, streams = load(args.dataset, args.data_dir, args.vocab, verbose)
    data = dict(vocab=meta["vocab"], vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                tokenizer=tokenizer(meta["vocab"]), streams=streams)
    if args.task == "stream":  # (the evaluation columns: batchified when evaluated)
        return dict(data, train=batchify(streams["train"], args.batch_size))
    return dict(data, **splits)


def epoch_batches(args, data, epoch):
    """The keys of an epoch's batches: a pure function of (seed, epoch), so a resumed run
    replays them (stories: each batch's key seeds its insertion orders)."""
    if args.task == "stream":
        return bptt_windows(data["train"].size(1), args.bptt)
    if args.task in ("story", "storyline"):
        index = batches([len(s["tokens"]) for s in data["train"]], args.batch_size, shuffle=True,
                        seed=args.seed, epoch=epoch)
        return [(ix, (args.seed * 1_000_003 + epoch) * 1_000_003 + j) for j, ix in enumerate(index)]
    return batches(data["train"].lengths, args.batch_size, args.max_tokens, shuffle=True,
                   seed=args.seed, epoch=epoch, limit=args.train_seqs or None, max_len=window(args))


def window(args):
    return args.block_size if args.model in WINDOWED else None


def get_batch(args, data, key, device, split="train"):
    """One batch: inputs, targets, t and the loss mask (completion), or a window of the stream's
    columns, or stories; n: the predicted tokens or events, n_inputs: the tokens read (host ints)."""
    if args.task == "stream":
        (i, L), cols = key, data[split]
        x, y = cols[:, i:i + L], cols[:, i + 1:i + 1 + L]
        return dict(inputs=to_device(x, device), targets=to_device(y, device), t=None, mask=None,
                    start=i, n=y.numel(), n_inputs=x.numel())
    if args.task in ("story", "storyline"):
        index, order_seed = key
        return story_batch([data[split][i] for i in index], args.model in INSERTION, args.order,
                           torch.Generator().manual_seed(order_seed), device)
    batch = collate(data[split], key, device)
    return dict(batch, n=batch["n_targets"])


def score(model, batch, state=None):
    """One call of the model -> (log p of every predicted token or event (B, T), the mask of those
    that count, the recurrent state).  Left to right: log p(y_t | y_<t, x) (--task stream: going
    on from the previous window's state); insertion models (InsNet paper): log p(slot) +
    log p(token | slot) of every insertion, then log p(terminate) on the finished canvas."""
    if "order" in batch:
        s = model(**{k: batch[k] for k in ("tokens", "order", "lengths", "n_given", "slot_start")})
        end = torch.ones_like(s["loss_mask"][:, :1])
        return (torch.cat([s["slot"] + s["token"], s["end"].unsqueeze(1)], 1),
                torch.cat([s["loss_mask"], end], 1), None)
    log_p, state = model(batch["inputs"], batch["t"], state, targets=batch["targets"])
    if "start" not in batch:  # not a stream: every batch starts afresh
        return log_p.float(), batch["mask"], None
    return log_p.float(), torch.ones_like(log_p, dtype=torch.bool), state


# ---------------------------------------------------------------------------------------------
# evaluation: perplexity of completion and stream, the stories' NLL; the termination probe
# ---------------------------------------------------------------------------------------------
def evaluate_batches(args, data, split, limit=None, sizes=None):
    """The keys of a split's evaluation batches (its first `limit` sequences; stream: windows)."""
    if args.task == "stream":
        return bptt_windows(data[split].size(1), args.bptt)
    if args.task in ("story", "storyline"):
        index = batches([len(s["tokens"]) for s in data[split][:limit]], args.batch_size)
        return [(ix, args.seed * 1_000_003 + j) for j, ix in enumerate(index)]
    sizes = sizes or dict(batch_size=args.batch_size, max_tokens=args.max_tokens)
    return batches(data[split].lengths, limit=limit, max_len=window(args), **(
        sizes if sizes["batch_size"] or sizes["max_tokens"] else dict(batch_size=32)))


@torch.no_grad()
def evaluate(args, model, data, split="valid", limit=None, device="cpu", ctx=nullcontext(),
             desc=None, sizes=None):
    """A split's figures: dict(nll per predicted token or event, ppl, tokens, sequences, ...).
    Completion (NMST paper): the mean NLL of the continuation tokens (eos included) given the
    context, and the mean p(eos) at the true end; stream (CT paper): of every token, the state
    carried from window to window; stories: also per story, and a bound on -log p(story).
    limit: the first N sequences (stream: N tokens of each column; default --eval_seqs).  Under
    torchrun each process scores every world-th batch and the sums are added."""
    limit, stream, story = limit or args.eval_seqs or None, args.task == "stream", \
        args.task in ("story", "storyline")
    if stream:  # the usual 10 evaluation columns, or the first `limit` tokens of each
        data = dict(data, **{split: batchify(data["streams"][split], 10, split)[:, :limit and limit + 1]})
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    keys = evaluate_batches(args, data, split, limit, sizes)
    sums, state = torch.zeros(5, dtype=torch.float64, device=device), None  # nll, n, p(eos), seqs, n!
    with eval_mode(model):
        for key in tqdm(keys if stream else keys[rank::world], desc, disable=None if desc else True,
                        leave=False):
            b = get_batch(args, data, key, device, split)
            with ctx:
                log_p, mask, state = score(model, b, state)
            n = mask.sum(1)
            end = log_p.gather(1, (b["lengths"] - 2).unsqueeze(1)).exp().sum() \
                if "lengths" in b and not story else 0.0  # p(eos) at the final eos
            orders = torch.lgamma(n.double()).sum() if story and args.order == "random" and \
                args.model in INSERTION else 0.0  # log n!: n - 1 insertions, then termination
            sums += torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in (
                -log_p.double()[mask].sum(), n.sum(), end, 0 if stream else len(n), orders)])
    nll, n, end, seqs, log_orders = all_sum(sums.tolist(), device)
    res = dict(nll=nll / max(n, 1), ppl=math.exp(min(nll / max(n, 1), 700)), tokens=int(n),
               sequences=int(seqs))
    if story:  # by Jensen's inequality, -log p(x) <= E_pi[-log p(x, pi)] - log n!
        return dict(res, nll_per_story=nll / max(seqs, 1), nll_bound_per_story=(nll - log_orders)
                    / max(seqs, 1))
    total = len(data[split]) if limit is None else min(limit, len(data[split]))
    return res if stream else dict(res, eos_prob_at_end=end / max(seqs, 1), skipped=total - int(seqs))


def probe(args, model, data):
    """The termination probe (NMST paper eq. 11, during training): greedy continuations of the
    first --probe validation contexts up to --probe_L tokens (less where the window is shorter),
    batched as `evaluate.py --decoder greedy --limit N --L L`, so its r_nt(L) is that one's."""
    split, t0 = data["valid"], time.time()
    n = min(args.probe, len(split))
    cap = longest_continuation(model, int(split.contexts[:n].max(initial=0)))
    L = args.probe_L if cap is None else min(args.probe_L, cap)
    if n == 0 or L < 1:
        return {}, ""
    res = decode_in_batches(model, [torch.as_tensor(split.context(i)) for i in range(n)], L)
    tok, (tokens, ended) = data["tokenizer"], (res["tokens"][0], bool(res["terminated"][0]))
    text = tok.decode([t for t in tokens if t != data["eos_id"]])
    rec = dict(probe_r_nt=non_termination_ratio(res["lengths"], res["terminated"], L), probe_L=L,
               probe_n=n, probe_mean_length=float(res["lengths"].double().mean()),
               probe_seconds=time.time() - t0)
    return rec, (f"        probe: r_nt({L}) {rec['probe_r_nt']:.3f} over {n} contexts | mean "
                 f"length {rec['probe_mean_length']:.1f} | \"{tok.decode(split.context(0).tolist())}\""
                 f" >>> \"{text[:120]}{'...' if len(text) > 120 else ''}\" ["
                 + (f"eos at t={len(tokens)}]" if ended else f"cut at L={L}: not terminated]"))


# ---------------------------------------------------------------------------------------------
# set-up: the device and torchrun, checkpoints, GPT-2's weights, logs and curves.png
# ---------------------------------------------------------------------------------------------
def get_device(name, local_rank=None):
    """--device -> 'cpu' or 'cuda:N' (auto: cuda:0 where there is a GPU; under torchrun
    cuda:LOCAL_RANK), made this process's device: on CUDA with TF32 float32 products and without
    cuDNN's attention, which builds a plan for every new (B, T) and nanogen's come in many."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device {name}: unknown device (use auto, cpu, cuda or cuda:N)")
    if device.startswith("cuda"):
        index = local_rank if local_rank is not None else int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s)")
        device = f"cuda:{index}"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def autocast(device, dtype):
    """torch.autocast for --dtype on CUDA (auto: bfloat16 where the GPU runs it natively, else
    float32), else a null context: float32."""
    if device.startswith("cuda") and dtype != "float32":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        dt = getattr(torch, dtype) if dtype != "auto" else torch.bfloat16 if native else None
        if dt is not None:
            return torch.autocast("cuda", dtype=dt)
    return nullcontext()


def all_sum(values, device):
    """A list of numbers summed over the processes (one collective), or as it is."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def save_checkpoint(obj, path):
    """torch.save into a temporary file beside `path`, then os.replace: a crash leaves the old
    file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk (torch's zip writer: a RuntimeError)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write {path}: {str(e).strip().splitlines()[-1][:200]} (the "
                        f"previous checkpoint, if any, is intact)") from None


def load_checkpoint(path):
    """A checkpoint of train.py, loaded safely (weights_only: never pickled code)."""
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, damaged, not a torch file, holding pickled code
        raise UserError(f"{path} is not a readable nanogen checkpoint (damaged or truncated? "
                        f"{type(e).__name__})") from None
    if not (isinstance(ckpt, dict) and {"config", "model", "args", "vocab", "state"} <= set(ckpt)):
        raise UserError(f"{path} is not a checkpoint written by train.py")
    return ckpt


def model_from_checkpoint(ckpt, path):
    try:
        model = build_model(ckpt["config"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise UserError(f"{path}: its weights do not fit its model config "
                        f"({str(e).strip()[:160]})") from None
    return model


def check_vocab(ckpt, data, path):
    """No silently wrong number: a checkpoint reads only data of its own vocabulary."""
    if ckpt["vocab"] != data["vocab"] or ckpt["config"]["eos_id"] != data["eos_id"]:
        raise UserError(f"{path} was trained on another vocabulary than the {ckpt['args']['dataset']}"
                        f" data prepared here (point --data_dir at the data it was trained on)")


HF_HUB = "https://huggingface.co/{name}/resolve/main/model.safetensors"


def gpt2_weights(name, path=None):
    """--init_from: GPT-2's HuggingFace state_dict from --weights (a file, or a folder holding
    model.safetensors or pytorch_model.bin), else from the hub, downloaded into the cache once."""
    if path is None:
        path = os.path.join(cache_dir(), "hub", name, "model.safetensors")
        if not os.path.exists(path):
            download(HF_HUB.format(name=name), path, hint="pass --weights PATH to a local copy")
    for file in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(path, file) if os.path.isfile(os.path.join(path, file)) else path
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = dict(torch.load(path, map_location="cpu", weights_only=True))
        assert all(torch.is_tensor(v) for v in state.values()), "not a state_dict of tensors"
        return state
    except Exception as e:  # missing, truncated, not a weights file
        raise UserError(f"--weights {path}: not a readable GPT-2 checkpoint ({type(e).__name__})") \
            from None


# ---------------------------------------------------------------------------------------------
# the run: set-up (data, model, DDP, resume), then the loop
# ---------------------------------------------------------------------------------------------
STOP = []  # the signals that asked this process to stop (on_signal appends, at any moment)


def on_signal(signum, frame):
    """Ctrl-C, SIGTERM: the step finishes, ckpt_last.pt is written, the run exits 0."""
    if STOP and signum == signal.SIGINT and not dist.is_initialized():
        raise KeyboardInterrupt  # Ctrl-C twice: abort now
    STOP.append("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)
    print(f"\n{STOP[-1]}: finishing this step and writing a checkpoint", file=sys.stderr)


def main(argv=None):
    args, ckpt = get_args(argv)
    if not args.resume and any(os.path.exists(os.path.join(args.out_dir, f"ckpt_{n}.pt"))
                               for n in ("last", "best")):
        raise UserError(f"{args.out_dir} already holds a run: continue it with --resume, or choose "
                        f"another --out_dir")
    try:
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        os.makedirs(args.out_dir, exist_ok=True)
    except ImportError:
        raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") \
            from None
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {args.out_dir}: {e.strerror or e}") from None
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1 and (args.task == "stream" or args.grad_accum % world):
        raise UserError(f"under torchrun --grad_accum ({args.grad_accum}) must be a multiple of the "
                        f"{world} processes, and --task stream runs on one process")
    device = get_device(args.device, int(os.environ["LOCAL_RANK"]) if world > 1 else None)
    if world > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    torch.manual_seed(args.seed + rank)  # before the model is built: its initial weights
    weights = None if args.init_from == "scratch" or ckpt else gpt2_weights(args.init_from,
                                                                            args.weights)
    data = load_data(args, verbose=rank == 0) if rank == 0 else None  # rank 0 prepares it,
    if world > 1:  # then the others read it
        dist.barrier()
        data = data or load_data(args, verbose=False)
    model, optimizer, scaler, ctx, st = build(args, ckpt, data, weights, device)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device] if device[:4] == "cuda" else None)
    start_logs(args, st["step"], rank)
    STOP.clear()
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        train(args, model, optimizer, scaler, ctx, data, st, ckpt and ckpt["hidden"], device)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


def build(args, ckpt, data, weights, device):
    """The model (from scratch, from GPT-2's weights, or the checkpoint's), AdamW, the float16
    loss scaler, the autocast context and the counters; -> (model, optimizer, scaler, ctx, st)."""
    cfg = model_config(args, data)
    if ckpt:  # --resume: the model's shape is the checkpoint's
        check_vocab(ckpt, data, os.path.join(args.out_dir, "ckpt_last.pt"))
        diff = [k for k in cfg if cfg[k] != ckpt["config"].get(k)]
        if diff:
            raise UserError(f"the checkpoint in {args.out_dir} has {diff[0]}="
                            f"{ckpt['config'].get(diff[0])}, not {cfg[diff[0]]}: drop that flag, "
                            f"or use another --out_dir for a new run")
    check_fits(args, data)
    model = build_model(cfg)
    try:
        model.load_state_dict(gpt_state_from_hf(weights, model)) if weights else None
    except ValueError as e:
        raise UserError(f"--init_from {args.init_from}: {e}") from None
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # weight decay on matrices, not on biases and norms
        [dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
         dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
        lr=args.lr, betas=(args.beta1, args.beta2), fused=True)
    ctx = autocast(device, args.dtype)
    fp16 = getattr(ctx, "fast_dtype", None) == torch.float16
    scaler = torch.amp.GradScaler(device[:4], enabled=fp16)
    st = dict(step=0, epoch=0, batch_in_epoch=0, best_val=math.inf, bad_evals=0, lr=args.lr,
              elapsed=0.0)
    if ckpt:  # the model, optimizer, counters, this process's RNG and the scaler
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        st = ckpt["state"]
        restore_rng(ckpt["rng"], args.seed, st["step"], device)
        scaler.load_state_dict(ckpt["scaler"]) if ckpt["scaler"] else None
    if args.compile:
        compile_model(model)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{args.model} + {args.head if args.model in MODELS else args.task} on "
              f"{args.dataset}: {sum(p.numel() for p in params):,} parameters, "
              f"V={data['vocab_size']:,}, device {device}" + (
                  f", {str(ctx.fast_dtype)[6:]} autocast" if hasattr(ctx, "fast_dtype") else "")
              + (f", resuming at step {st['step']}" if ckpt else "")
              + (f"; {data['note']}" if data.get("note") else ""), flush=True)
    return model, optimizer, scaler, ctx, st


def train(args, model, optimizer, scaler, ctx, data, st, hidden, device):
    """The loop: lr -> micro-batches, each scored by one call of the model (NMST eq. 3) -> clip
    -> step; every --log_interval steps the losses are read and the processes agree on stopping;
    evaluations and checkpoints (validate).  model: under torchrun its DDP wrapper."""
    raw, world = getattr(model, "module", model), dist.get_world_size() if dist.is_initialized() else 1
    rank, accum = dist.get_rank() if world > 1 else 0, args.grad_accum // world
    ls = loss_scale(data["vocab_size"], args.ct_alpha, args.ct_beta) if args.loss_scaling else 1.0
    t0, since, pending, stop = time.time() - st["elapsed"], new_interval(device), [], None
    hidden, why = to(hidden, device), limit_reached(args, st)
    if why:
        return print(f"{args.out_dir}: this run already finished ({why}); raise the limit to go on")
    while not why:
        keys = epoch_batches(args, data, st["epoch"])
        n_steps = len(keys) // args.grad_accum  # (the last len % grad_accum batches are skipped)
        for s in tqdm(range(st["batch_in_epoch"], n_steps), f"epoch {st['epoch']}", n_steps,
                      leave=False, initial=st["batch_in_epoch"], disable=True if rank else None):
            st["lr"] = learning_rate(args, st)
            for group in optimizer.param_groups:
                group["lr"] = st["lr"]
            step_loss = 0.0
            for j in range(accum):  # this process's micro-batches
                batch = get_batch(args, data, keys[s * args.grad_accum + rank * accum + j], device)
                if world > 1:  # DDP: the gradients are all-reduced on the last micro-batch only
                    model.require_backward_grad_sync = j == accum - 1
                if args.task == "stream" and batch["start"] == 0:
                    hidden = None  # each epoch starts the streams afresh
                with ctx:
                    log_p, mask, hidden = score(model, batch, hidden)
                    nll = -torch.where(mask, log_p, 0.0).sum()  # -log p of the predicted tokens
                    loss = nll / batch["n"] * ls  # NMST eq. 3: their mean (CT eq. 8: x LS, + AR, TAR)
                    if args.ar or args.tar:
                        loss = loss + raw.backbone.activation_regularisation(args.ar, args.tar)
                scaler.scale(loss / accum).backward()  # (every scaler call: a no-op but in fp16)
                hidden = to(hidden, device, detach=True)  # truncated BPTT: not into the past
                step_loss = step_loss + loss.detach() / accum
                since.update(nll=since["nll"] + nll.detach().double(), n=since["n"] + batch["n"],
                             tokens=since["tokens"] + batch["n_inputs"])
            scaler.unscale_(optimizer)
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            st.update(step=st["step"] + 1, batch_in_epoch=s + 1, elapsed=time.time() - t0)
            pending.append((st["step"], st["lr"], step_loss))
            stop = STOP[0] if STOP and world == 1 else None  # (torchrun: decided together)
            if st["step"] % args.log_interval == 0:
                stop, why = sync(args, pending, device, st) or (stop, None)
            why = why or limit_reached(args, st)
            if (args.eval_interval and st["step"] % args.eval_interval == 0) or why:
                why = validate(args, raw, optimizer, scaler, ctx, data, st, hidden, device,
                               pending, since) or why
            if why or stop:
                break
        if stop:
            sync(args, pending, device, st)
            save(args, raw, optimizer, scaler, data, st, hidden, rank)
            return print(f"stopped by {stop} after step {st['step']}; {args.out_dir}/ckpt_last.pt"
                         f" written: the same command with --resume goes on") if rank == 0 else None
        if not why:  # the epoch's end: without --eval_interval (or at the end), an evaluation
            st.update(epoch=st["epoch"] + 1, batch_in_epoch=0)
            why = limit_reached(args, st)
            if not args.eval_interval or why:
                why = validate(args, raw, optimizer, scaler, ctx, data, st, hidden, device,
                               pending, since) or why
    if rank == 0:
        print(f"done ({why}) after {st['step']} steps; best validation loss {st['best_val']:.4f} "
              f"(ppl {math.exp(min(st['best_val'], 700)):.2f}); checkpoints in {args.out_dir}")


def validate(args, model, optimizer, scaler, ctx, data, st, hidden, device, pending, since):
    """Evaluate, log one line (and the probe's), lower a plateau lr, write ckpt_last.pt (and
    ckpt_best.pt when it improved); -> why the run stops early, or None."""
    sync(args, pending, device, st)
    rank = dist.get_rank() if dist.is_initialized() else 0
    nll, n, tokens = all_sum([since["nll"].item(), since["n"], since["tokens"]], device)
    tok_per_s = tokens / max(time.time() - since["t0"], 1e-9)
    val = evaluate(args, model, data, "valid", device=device, ctx=ctx)
    if not math.isfinite(val["nll"]):
        raise UserError(f"non-finite validation loss at step {st['step']}; stopping (try a lower "
                        f"--lr). " + last_good(args))
    improved = val["nll"] < st["best_val"]
    st.update(best_val=min(st["best_val"], val["nll"]), bad_evals=0 if improved else
              st["bad_evals"] + 1)
    if not improved and args.lr_schedule == "plateau":
        st["lr"] *= args.lr_decay
    mfu = tok_per_s * mfu_per_token(args, model, data, device)
    rec = dict(step=st["step"], epoch=st["epoch"], train_loss=nll / max(n, 1), val_loss=val["nll"],
               val_ppl=val["ppl"], lr=st["lr"], tokens_per_s=tok_per_s, mfu=mfu or None,
               best=improved, elapsed_s=st["elapsed"], **{k: v for k, v in val.items() if k in (
                   "eos_prob_at_end", "nll_per_story")})
    if rank == 0:
        print(f"step {st['step']:7d} | epoch {st['epoch']:3d} | train loss {rec['train_loss']:.4f} "
              f"| val loss {val['nll']:.4f} | val ppl {val['ppl']:9.2f} | lr {st['lr']:.2e} | "
              f"{tok_per_s:8.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
              + (" | best" if improved else ""), flush=True)
        probe_rec, line = probe(args, model, data) if args.probe and args.task == "completion" \
            else ({}, "")
        print(line, flush=True) if line else None
        with open(os.path.join(args.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(dict(rec, **probe_rec)) + "\n")
        if not args.no_curves:
            curves.draw_run(args.out_dir)
        tensorboard(args, dict(rec, **probe_rec))
    save(args, model, optimizer, scaler, data, st, hidden, rank, best=improved)
    since.update(new_interval(device))  # the next tok/s counts from after the writing
    return f"early stop: no improvement in {args.patience} evaluations" \
        if st["bad_evals"] >= args.patience else None


def sync(args, pending, device, st):
    """The pending steps' losses (each the mean over its micro-batches and the processes) and the
    processes' stop flags, in one collective and one read; steps.jsonl gets the losses, and a
    non-finite one stops the run.  -> None, or (the signal, a time limit) when one stops it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    late = args.max_minutes and st["elapsed"] >= 60 * args.max_minutes
    values = torch.cat([torch.stack([p[2] for p in pending]).float().reshape(-1) if pending else
                        torch.zeros(0, device=device), torch.tensor([bool(STOP), late],
                                                                    dtype=torch.float, device=device)])
    if world > 1:
        dist.all_reduce(values)
    values, n = values.tolist(), len(pending)
    records = [dict(step=step, loss=v / world, lr=lr) for (step, lr, _), v in zip(pending, values)]
    pending.clear()
    if (not dist.is_initialized() or dist.get_rank() == 0) and records:
        with open(os.path.join(args.out_dir, "steps.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    if bad:
        raise UserError(f"non-finite training loss at step {bad[0]}; stopping (try a lower --lr). "
                        + last_good(args))
    stop = (STOP[0] if STOP else "a signal to another process") if values[n] else None
    late = f"reached --max_minutes {args.max_minutes:g}" if values[n + 1] else None
    return (stop, late) if stop or late else None


def save(args, model, optimizer, scaler, data, st, hidden, rank, best=False):
    """ckpt_last.pt (and a copy as ckpt_best.pt): the model, optimizer, counters, every process's
    RNG, the scaler, the stream's state, the arguments and the vocabulary."""
    own = dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state() if torch.cuda.is_available()
               and next(model.parameters()).is_cuda else None)
    rng = [own] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(rng, own)
    if rank == 0:  # ckpt_best.pt first: a kill between the two leaves ckpt_last.pt the older one
        first, last = (os.path.join(args.out_dir, n) for n in ("ckpt_best.pt" if best else
                                                                "ckpt_last.pt", "ckpt_last.pt"))
        save_checkpoint(dict(config=model.cfg, model=model.state_dict(), args=vars(args),
                             optimizer=optimizer.state_dict(), state=dict(st), rng=rng,
                             vocab=data["vocab"], hidden=hidden, scaler=scaler.state_dict() if
                             scaler.is_enabled() else None), first)
        if best:
            shutil.copyfile(first, last + ".tmp")
            os.replace(last + ".tmp", last)


def last_good(args):
    last = os.path.join(args.out_dir, "ckpt_last.pt")
    return f"The last good checkpoint is {last}" if os.path.exists(last) else "No checkpoint yet"


def restore_rng(rng, seed, step, device):
    """This process's generators from the checkpoint; written by another number of processes:
    fresh ones from (seed, rank, step)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if len(rng) != (dist.get_world_size() if dist.is_initialized() else 1):
        return torch.manual_seed(((seed * 1_000_003 + rank) * 1_000_003 + step) % 2 ** 63)
    torch.set_rng_state(rng[rank]["cpu"])
    if device.startswith("cuda") and rng[rank]["cuda"] is not None:
        torch.cuda.set_rng_state(rng[rank]["cuda"])


def start_logs(args, step, rank):
    """log.jsonl and steps.jsonl: a fresh run starts them; a resumed one keeps their records up to
    its checkpoint's step (what came after it will be logged again).  args.json: what curves.py
    labels the run by.  An interrupted write's temporary file is removed."""
    for name in os.listdir(args.out_dir) if rank == 0 else []:
        if name.endswith((".pt.tmp", ".png.tmp")):
            os.remove(os.path.join(args.out_dir, name))
    for name in ("log.jsonl", "steps.jsonl"):
        path = os.path.join(args.out_dir, name)
        kept = curves.read_log(path, step) if args.resume else []
        if rank == 0:
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
    if rank == 0:
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f)


def new_interval(device):
    """The sums of the steps since the last evaluation: nll (on the device), counts, the clock."""
    return dict(nll=torch.zeros((), dtype=torch.float64, device=device), n=0, tokens=0,
                t0=time.time())


def to(state, device, detach=False):
    """A recurrent state (a tensor, or a tuple of them, or None) on `device`, maybe detached."""
    if isinstance(state, tuple):
        return tuple(to(s, device, detach) for s in state)
    return state if state is None else (state.detach() if detach else state).to(device)


def limit_reached(args, st):
    """-> why the run stops now (--max_iters, --max_epochs, --patience; --max_minutes on one
    process, under torchrun decided together in sync), or None."""
    if args.max_iters and st["step"] >= args.max_iters:
        return f"reached --max_iters {args.max_iters}"
    if st["epoch"] >= args.max_epochs:
        return f"reached --max_epochs {args.max_epochs}"
    if st["bad_evals"] >= args.patience:
        return f"early stop: no improvement in {args.patience} evaluations"
    if args.max_minutes and st["elapsed"] >= 60 * args.max_minutes and not dist.is_initialized():
        return f"reached --max_minutes {args.max_minutes:g}"
    return None


def learning_rate(args, st):
    """plateau / constant: the current lr (plateau lowers it at evaluations); linear: a linear
    warm-up over --warmup steps times a linear decay to 0 at --decay_steps."""
    if args.lr_schedule != "linear":
        return st["lr"]
    warm = min(1.0, (st["step"] + 1) / args.warmup) if args.warmup else 1.0
    return args.lr * warm * max(0.0, 1.0 - st["step"] / args.decay_steps)


def check_fits(args, data):
    """Runs that would silently do nothing are errors: no optimizer step in an epoch, no
    validation sequence within the window, a story longer than --block_size."""
    n = len(epoch_batches(args, data, 0))
    if n < args.grad_accum:
        raise UserError(f"an epoch here has {n} batch(es), fewer than --grad_accum {args.grad_accum}: "
                        f"no step would run (lower --grad_accum or --batch_size / --max_tokens; "
                        f"sequence completion needs lines of more than 10 tokens, the first 10 "
                        f"being the context; a --block_size window may hold none of them)")
    if args.task == "stream":
        batchify(data["streams"]["valid"], 10, "valid")  # (an error when too short)
    if args.task == "completion" and not evaluate_batches(args, data, "valid", args.eval_seqs or None):
        raise UserError(f"no validation sequence fits the --block_size {args.block_size} window "
                        f"(or the split holds none): raise --block_size")
    longest = max((len(s["tokens"]) for k in ("train", "valid") for s in data[k]), default=0) \
        if args.task in ("story", "storyline") else 0
    if longest - (args.model not in INSERTION) > args.block_size:
        raise UserError(f"a story of {longest} tokens exceeds --block_size {args.block_size}")


def compile_model(model, backend="inductor"):
    """torch.compile in place, with dynamic shapes: batches come in ever new (B, T).  No matmul
    padding: on a GPU inductor pads V = 50257 and bakes the first batch's T into the backward's
    strides, recompiling at every new length (RESULTS.md, "On a GPU")."""
    model.compile(dynamic=True, backend=backend,
                  options={"shape_padding": False} if backend == "inductor" else None)


def mfu_per_token(args, model, data, device):
    """MFU of one token/s: training FLOPs per token at the mean length of the sequences trained
    on, over the peak of every process's device (--peak_flops, else the bf16 dense peak of a few
    GPUs; float32: half).  0 where no peak is known, and for stories."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else ""
    peak = args.peak_flops or next((v for k, v in PEAK_FLOPS.items() if k in name), 0) / (
        2 if args.dtype == "float32" else 1)
    if args.task == "completion":
        inputs = data["train"].lengths[:args.train_seqs or None] - 1
        length = float(np.mean(inputs[inputs <= (window(args) or math.inf)]))
    else:
        length = args.bptt if args.task == "stream" else None
    if not peak or length is None:
        return 0.0
    return model.flops_per_token(length) / (peak * (dist.get_world_size() if dist.is_initialized()
                                                    else 1))


PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def tensorboard(args, record):
    """--tensorboard: the record's numbers as scalars in OUT_DIR/tensorboard."""
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(os.path.join(args.out_dir, "tensorboard")) as w:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    w.add_scalar(k, v, record["step"])


def run(main):
    """A command's entry point: a UserError is one line `error: ...` (one write: under torchrun
    the processes' lines never run together) and exit status 2; Ctrl-C outside training one
    line and status 130; anything else is a bug and keeps its traceback."""
    try:
        sys.exit(main())
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted (Ctrl-C)\n")
        sys.exit(130)


if __name__ == "__main__":
    run(main)
