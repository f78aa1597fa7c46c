"""Train a sequence-completion language model with a VA / ST / NMST head.

    python train.py --init_from gpt2 --head nmst --dataset wikitext103  # the paper's GPT-2 finetuning recipe
    python train.py --head nmst --dataset wikitext103                 # the same GPT-2 shape, from scratch
    python train.py --model lstm --head nmst --dataset wikitext2      # the paper's 2x512 LSTM recipe
    python train.py ... --resume                                      # continue from out_dir/ckpt_last.pt
    python train.py --model insnet --dataset rocstories               # InsNet: title -> story (insnet.py)
    python train.py --model insnet --dataset rocstories --task storyline   # keywords given: constrained
    python train.py --model gpt --dataset rocstories                  # its L2R baseline, same data

Loss: NMST paper eq. 3, the negative log-likelihood of the continuation tokens y_1..y_T (eos
included) given the 10-token context, averaged over the tokens of each batch.  Recipes (NMST
paper section 4 and appendix D), the defaults for each --model:
  rnn / lstm  2 layers x 256 / 512, tied embeddings, dropout 0.3 / 0.5, 32 sequences per batch,
              AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.01, halve the lr when the
              validation perplexity does not improve for an epoch, early stopping after 10
              epochs without improvement, at most 70 epochs
  gpt         GPT-2 124M shape (12 x 768, 12 heads, 1024 positions), dropout 0.1, length-
              bucketed batches of at most 1024 tokens, AdamW lr 5e-5, betas (0.9, 0.99), weight
              decay 0.01 (not on biases / LayerNorm), linear decay over 500k steps, 300k steps
  insnet / insertion_transformer (InsNet paper section 4.3): base size (12 x 768, 12 heads),
              dropout 0.1, 64 sequences per batch, lr 1e-4 with 400 warm-up steps and linear
              decay over 80000 steps, weight decay 0.02; one random insertion order per sequence
              per batch (--order l2r: left to right).  --dataset rocstories / synthetic only.
Gradient-norm clipping at 1.0 is nanogen's choice (the paper does not say).
"""
import contextlib
import json
import math
import os
import sys
import time

import torch

from data.loader import batches, batchify, bptt_windows, collate, load, load_stream
from data.prepare import DATASETS
from data.stories import load_sequences
from evaluate import (CLIParser, batch_log_probs, perplexity, resolve_device, run_cli, story_model, story_nll,
                      story_perplexity, stream_perplexity)
from heads import HEADS, loss_scale
from model import (GPT2_SIZES, MODELS, CheckpointError, LanguageModel, _test_kill_point, load_checkpoint,
                   load_pretrained_gpt2, model_config, save_checkpoint)

# defaults that depend on --model: (rnn, lstm, gpt)
PER_MODEL = dict(
    n_layer=(2, 2, 12), d_model=(256, 512, 768), dropout=(0.3, 0.5, 0.1), lr=(1e-3, 1e-3, 5e-5),
    lr_schedule=("plateau", "plateau", "linear"), batch_size=(32, 32, None), max_tokens=(None, None, 1024),
    max_iters=(0, 0, 300_000), eval_interval=(0, 0, 2000),
)
STORY_DATASETS = ("rocstories", "synthetic")  # sequences for the insertion models (data/stories.py)
INSERTION_MODELS = ("insnet", "insertion_transformer")
# the insertion models' defaults (InsNet paper section 4.3)
PER_INSERTION_MODEL = dict(n_layer=12, d_model=768, dropout=0.1, lr=1e-4, lr_schedule="linear", batch_size=64,
                           max_iters=80_000, eval_interval=1000, decay_steps=80_000, warmup=400, weight_decay=0.02)
ARCH_KEYS = ("model", "head", "epsilon", "n_layer", "d_model", "n_head", "block_size", "dropout", "no_tie", "no_bias",
             "init_from", "task", "n_experts", "ct_alpha", "ct_beta", "ct_rank", "temperature", "locked_dropout",
             "order", "max_offset", "min_count", "synthetic_count")
RESUMABLE_OVERRIDES = ("max_iters", "max_epochs", "device", "compile", "eval_interval", "eval_seqs", "data_dir",
                       "patience", "peak_flops")


def build_parser():
    p = CLIParser(description="Train a VA / ST / NMST sequence-completion language model (nanogen).")
    g = p.add_argument_group("what to train")
    g.add_argument("--model", default="gpt", choices=MODELS + INSERTION_MODELS,
                   help="backbone (default gpt); insnet / insertion_transformer: insertion-based (insnet.py)")
    g.add_argument("--head", default="softmax", choices=HEADS, help="output head: softmax (VA, eq. 2), "
                   "st (eq. 9), nmst (eq. 10) of the NMST paper; mos (eq. 4), ct (eq. 5-6), ctmos (eq. 7) of "
                   "the contextual-temperature paper (default softmax)")
    g.add_argument("--task", default="completion", choices=["completion", "stream", "story", "storyline"],
                   help="completion: sequence completion (NMST paper); stream: continuous LM with truncated "
                        "BPTT over the concatenated corpus (CT paper; rnn/lstm)")
    g.add_argument("--epsilon", type=float, default=1e-5, help="eps of ST / NMST, in (0, 1) (default 1e-5)")
    g.add_argument("--dataset", default="wikitext103", choices=sorted(DATASETS) + list(STORY_DATASETS),
                   help="(default wikitext103); rocstories / synthetic: for insnet, insertion_transformer, gpt")
    g.add_argument("--data_dir", default=None, help="folder with the dataset archives/files "
                   "(default: $NANOGEN_DATA, else download into $NANOGEN_CACHE or ~/.cache/nanogen)")
    g.add_argument("--out_dir", default=None, help="checkpoints and log (default out/DATASET-MODEL-HEAD)")
    g.add_argument("--init_from", default="scratch", choices=["scratch", *GPT2_SIZES],
                   help="scratch, or pretrained GPT-2 weights (HuggingFace format; sets the GPT-2 shape)")
    g.add_argument("--weights", default=None, help="local GPT-2 weights: a pytorch_model.bin / model.safetensors "
                                                   "file or a folder holding one (default: download from the hub)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype on CUDA (auto: bfloat16 when supported); CPU always runs float32")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--peak_flops", type=float, default=None, help="device peak FLOP/s for the MFU column "
                   "(default: a table of GPUs; none on CPU)")
    g.add_argument("--resume", action="store_true", help="continue from out_dir/ckpt_last.pt")
    a = p.add_argument_group("architecture (defaults per --model: rnn 2x256, lstm 2x512, gpt 12x768)")
    a.add_argument("--n_layer", type=int, default=None)
    a.add_argument("--d_model", type=int, default=None, help="embedding = hidden size")
    a.add_argument("--n_head", type=int, default=12, help="GPT attention heads")
    a.add_argument("--block_size", type=int, default=1024, help="GPT context window")
    a.add_argument("--dropout", type=float, default=None, help="(rnn 0.3, lstm 0.5, gpt 0.1)")
    a.add_argument("--no_tie", action="store_true", help="do not tie input and output embeddings")
    a.add_argument("--no_bias", action="store_true", help="GPT without biases in Linear / LayerNorm")
    a.add_argument("--n_experts", type=int, default=4, help="mos / ctmos: number of softmaxes K")
    a.add_argument("--ct_alpha", type=float, default=1.0, help="ct / ctmos: alpha of eq. 6")
    a.add_argument("--ct_beta", type=float, default=0.5, help="ct / ctmos: beta of eq. 6")
    a.add_argument("--ct_rank", type=int, default=0, help="ct / ctmos: factorise W_tau = W_tau1 W_tau2 with "
                                                          "this rank (0: one D x V matrix)")
    a.add_argument("--temperature", type=float, default=1.0, help="softmax / mos: a constant temperature "
                                                                  "(the CT paper's Table 3 baseline)")
    a.add_argument("--locked_dropout", action="store_true", help="rnn/lstm: variational (locked) dropout on "
                                                                 "the embeddings and the last layer's output")
    i = p.add_argument_group("insertion models and story data (insnet.py, data/stories.py)")
    i.add_argument("--order", default="random", choices=["random", "l2r"], help="insertion order of the training "
                   "sequences: uniformly random per sequence per batch, or left to right (InsNet-l2r)")
    i.add_argument("--max_offset", type=int, default=256, help="insnet: offsets are clipped to [-K, K]")
    i.add_argument("--min_count", type=int, default=2, help="rocstories: words seen fewer times become <unk>")
    i.add_argument("--synthetic_count", type=int, default=200, help="synthetic: sequences per length (paper 25000)")
    i.add_argument("--warmup", type=int, default=None, help="linear lr warm-up steps (insertion models: 400)")
    o = p.add_argument_group("optimisation (defaults per --model, see the docstring)")
    o.add_argument("--lr", type=float, default=None, help="AdamW learning rate (rnn/lstm 1e-3, gpt 5e-5)")
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.99)
    o.add_argument("--weight_decay", type=float, default=None, help="not applied to biases / norms (0.01; "
                   "insertion models 0.02)")
    o.add_argument("--grad_clip", type=float, default=1.0, help="max gradient norm (0: off)")
    o.add_argument("--lr_schedule", default=None, choices=["plateau", "linear", "constant"],
                   help="plateau: multiply by --lr_decay when validation does not improve (rnn/lstm); "
                        "linear: decay to 0 over --decay_steps (gpt)")
    o.add_argument("--lr_decay", type=float, default=0.5, help="plateau factor (default 0.5: halve)")
    o.add_argument("--decay_steps", type=int, default=None, help="linear schedule length (500k; insertion 80k)")
    o.add_argument("--patience", type=int, default=10, help="early stopping: evaluations without improvement")
    o.add_argument("--batch_size", type=int, default=None, help="sequences per batch (rnn/lstm: 32)")
    o.add_argument("--max_tokens", type=int, default=None, help="padded tokens per batch (gpt: 1024)")
    o.add_argument("--bptt", type=int, default=70, help="stream: truncated-BPTT window length")
    o.add_argument("--loss_scaling", action="store_true", help="ct / ctmos: multiply the cross entropy by "
                   "mean(tau) (CT paper eq. 8's LS; a constant, see heads.loss_scale)")
    o.add_argument("--ar", type=float, default=0.0, help="activation regularisation gamma_1 (CT eq. 8, rnn/lstm)")
    o.add_argument("--tar", type=float, default=0.0, help="temporal activation regularisation gamma_2 (rnn/lstm)")
    o.add_argument("--grad_accum", type=int, default=1, help="batches per optimizer step, over all processes "
                                                             "(torchrun: each process takes grad_accum / N)")
    o.add_argument("--max_epochs", type=int, default=70)
    o.add_argument("--max_iters", type=int, default=None, help="stop after this many steps (0: no limit; "
                                                               "gpt default 300000)")
    o.add_argument("--eval_interval", type=int, default=None, help="evaluate every N steps (0: every epoch; "
                                                                   "rnn/lstm 0, gpt 2000)")
    o.add_argument("--eval_seqs", type=int, default=0, help="validate on the first N sequences only (0: all; "
                                                             "stream: the first N tokens of each column)")
    o.add_argument("--train_seqs", type=int, default=0, help="train on the first N sequences only (0: all)")
    return p


def resolve_story_args(args):
    """--dataset rocstories / synthetic: the insertion models and their L2R baseline (gpt)."""
    if args.dataset not in STORY_DATASETS:
        raise ValueError(f"--model {args.model} trains on --dataset rocstories or synthetic, not {args.dataset}")
    if args.model not in INSERTION_MODELS + ("gpt",):
        raise ValueError(f"--dataset {args.dataset} is for --model insnet, insertion_transformer or gpt (L2R)")
    if args.head != "softmax":
        raise ValueError(f"--head {args.head} is an output head of the left-to-right models on the NMST / CT data; "
                         f"the story runs use the softmax head")
    if args.task in ("completion", "stream"):
        if args.task == "stream":
            raise ValueError("--task stream is for the recurrent models; story tasks: --task story or storyline")
        args.task = "story"
    if args.task == "storyline" and args.dataset == "synthetic":
        raise ValueError("--task storyline needs ROCStories' storylines (--dataset rocstories)")
    if args.init_from != "scratch" or args.weights:
        raise ValueError("--init_from / --weights load GPT-2 weights for the WikiText-103 recipe, not for story runs")
    if args.order != "random" and args.model not in INSERTION_MODELS:
        raise ValueError("--order is the insertion order of --model insnet / insertion_transformer")
    for k, v in PER_INSERTION_MODEL.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_tokens is not None:
        raise ValueError("story runs batch by --batch_size sequences, not --max_tokens")
    if args.max_offset < 1 or args.synthetic_count < 1 or args.min_count < 1:
        raise ValueError("--max_offset, --synthetic_count and --min_count must be >= 1")
    for k in ("n_layer", "d_model", "n_head", "block_size", "max_epochs", "batch_size", "grad_accum"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k} must be >= 1, got {getattr(args, k)}")
    if args.d_model % args.n_head:
        raise ValueError(f"--d_model {args.d_model} must be divisible by --n_head {args.n_head}")
    if not 0.0 <= args.dropout < 1.0 or args.lr <= 0:
        raise ValueError("--dropout must lie in [0, 1) and --lr be > 0")
    if args.out_dir is None:
        args.out_dir = os.path.join("out", f"{args.dataset}-{args.task}-{args.model}"
                                    + ("-l2r" if args.order == "l2r" else ""))
    return args


def resolve_args(args):
    """Fill the per-model defaults and reject bad values with a clear message."""
    if args.dataset in STORY_DATASETS or args.model in INSERTION_MODELS:
        return resolve_story_args(args)
    for k, v in dict(weight_decay=0.01, decay_steps=500_000, warmup=0).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.order != "random":
        raise ValueError("--order is the insertion order of --model insnet / insertion_transformer")
    if args.task in ("story", "storyline"):
        raise ValueError(f"--task {args.task} is for --dataset rocstories")
    if args.init_from != "scratch":
        if args.model != "gpt":
            raise ValueError(f"--init_from {args.init_from} loads GPT-2 weights: use it with --model gpt")
        args.n_layer, args.n_head, args.d_model = GPT2_SIZES[args.init_from]
        args.block_size, args.no_bias, args.no_tie = 1024, False, False
    elif args.weights:
        raise ValueError("--weights is for --init_from gpt2 / gpt2-medium / gpt2-large / gpt2-xl")
    col = MODELS.index(args.model)
    for k, vals in PER_MODEL.items():
        if getattr(args, k) is None:
            setattr(args, k, vals[col])
    if args.batch_size is not None and args.max_tokens is not None:
        args.batch_size = None if args.model == "gpt" else args.batch_size
        args.max_tokens = None if args.model != "gpt" else args.max_tokens
    if args.head != "softmax" and not (0.0 < args.epsilon < 1.0):
        raise ValueError(f"--epsilon must lie in (0, 1), got {args.epsilon}")
    for k in ("n_layer", "d_model", "n_head", "block_size", "max_epochs"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k} must be >= 1, got {getattr(args, k)}")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if (args.batch_size or args.max_tokens or 0) < 1:
        raise ValueError("--batch_size / --max_tokens must be >= 1")
    if args.grad_accum < 1:
        raise ValueError(f"--grad_accum must be >= 1, got {args.grad_accum}")
    if args.task == "stream":
        if args.model == "gpt":
            raise ValueError("--task stream runs the recurrent models (CT paper): use --model rnn or lstm")
        if args.head in ("st", "nmst"):
            raise ValueError(f"--head {args.head} models the end of a sequence: use it with --task completion")
        if args.bptt < 1:
            raise ValueError(f"--bptt must be >= 1, got {args.bptt}")
    if args.temperature != 1.0 and args.head not in ("softmax", "mos"):
        raise ValueError(f"a constant --temperature is the baseline of the softmax / mos heads, not of {args.head}")
    if args.loss_scaling and args.head not in ("ct", "ctmos"):
        raise ValueError("--loss_scaling scales by the contextual temperature: use --head ct or ctmos")
    if (args.ar or args.tar or args.locked_dropout) and args.model == "gpt":
        raise ValueError("--ar / --tar / --locked_dropout act on the recurrent models' last layer (rnn/lstm)")
    if args.model == "gpt" and args.d_model % args.n_head:
        raise ValueError(f"--d_model {args.d_model} must be divisible by --n_head {args.n_head}")
    if args.out_dir is None:
        args.out_dir = os.path.join("out", f"{args.dataset}-{args.model}-{args.head}")
    return args


def check_out_dir(path):
    """Fail before training, not at the first checkpoint, when out_dir cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write to --out_dir {path}: {e.strerror or e}") from None


def configure_optimizer(lm, args, device):
    """AdamW; weight decay on matrices (dim >= 2) only, not on biases / LayerNorm gains."""
    params = {id(p): p for p in lm.parameters() if p.requires_grad}.values()  # tied weights once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=args.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    fused = device.split(":")[0] in ("cuda", "cpu")  # one kernel for all tensors: on CPU 7x faster than foreach
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=fused)


def autocast_context(device, dtype):
    if not device.startswith("cuda") or dtype == "float32":
        return None
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return torch.autocast("cuda", dtype=getattr(torch, dtype))


def resume_args(args, explicit, ckpt):
    """On --resume the run's own arguments come back; a few may be changed on the command line."""
    saved = dict(ckpt["args"])
    clash = [k for k in ARCH_KEYS + ("dataset",) if k in explicit and explicit[k] != saved.get(k)]
    if clash:
        k = clash[0]
        raise CheckpointError(f"the checkpoint in {args.out_dir} was trained with --{k} {saved.get(k)}, not "
                              f"{explicit[k]}; use another --out_dir for a new run")
    for k in RESUMABLE_OVERRIDES:
        if k in explicit:
            saved[k] = explicit[k]
    saved["resume"], saved["out_dir"] = True, args.out_dir  # the folder may have been moved: write where it is
    return type(args)(**saved)


# bf16 dense tensor peak FLOP/s by device name, for MFU (TF32 is half of it; CPUs: pass --peak_flops)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}


def peak_flops(args, device):
    if args.peak_flops:
        return args.peak_flops
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak if autocast_context(device, args.dtype) is not None else peak / 2
    return None


def flops_per_token(lm, cfg, seq_len):
    """Training FLOPs per token: 6 N for the matmul weights (forward + backward; the output
    projection counts, the position-embedding lookup does not) plus, for GPT, attention's
    12 L d T at the mean training length T (PaLM appendix B, as in nanoGPT)."""
    n = lm.num_params()
    if cfg["model"] == "gpt":
        n -= lm.backbone.wpe.weight.numel()
    if not cfg["tie"]:
        n -= lm.backbone.wte.weight.numel()  # the input lookup is no matmul (tied: it is the output matmul)
    attn = 12 * cfg["n_layer"] * cfg["d_model"] * seq_len if cfg["model"] == "gpt" else 0
    return 6 * n + attn


def setup_distributed(args):
    """torchrun sets WORLD_SIZE / RANK / LOCAL_RANK: one process per device, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, args.device
    import torch.distributed as dist
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda") or args.device.startswith("cuda")
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    if args.task == "stream":
        raise ValueError("--task stream runs on one process (no torchrun)")
    if args.grad_accum % world:
        raise ValueError(f"--grad_accum {args.grad_accum} must be a multiple of the {world} processes")
    return rank, world, (f"cuda:{local}" if cuda else "cpu")


def all_sum(values, world, device):
    """Sum a list of floats over the processes (identity for one process)."""
    if world == 1:
        return values
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def truncate_log(path, step):
    """After a crash the logs may hold records past the checkpoint we resume from: drop them, so
    the logs describe the one trajectory the run really follows."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class Interrupt:
    """Ctrl-C (SIGINT): finish the current step, write a resumable checkpoint, exit 0."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        import signal
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupted: finishing this step and writing a checkpoint (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        import signal
        signal.signal(signal.SIGINT, self.previous)
        return False


def detach(state):
    """Cut the graph of a recurrent state (tensor or tuple of tensors)."""
    if state is None:
        return None
    return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()


def optimizer_step(params, optimizer, args, state, s, logged_loss, shown_loss, steps_path, bar, master=True):
    """Clip, step, and the bookkeeping both training loops share after batch s of an epoch:
    the step counters, one steps.jsonl line, the progress bar, the --max_iters limit.
    -> True when an evaluation is due (a multiple of --eval_interval, or the run is done)."""
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state["step"] += 1
    state["batch_in_epoch"] = s + 1
    if master:
        with open(steps_path, "a") as f:
            f.write(json.dumps(dict(step=state["step"], loss=logged_loss, lr=state["lr"])) + "\n")
    bar.update(1)
    bar.set_postfix(loss=f"{shown_loss:.3f}")
    if args.max_iters and state["step"] >= args.max_iters:
        state["done"] = f"reached --max_iters {args.max_iters}"
    return bool((args.eval_interval and state["step"] % args.eval_interval == 0) or state["done"])


STOPPED = "stopped by Ctrl-C after step {step}; checkpoint written: continue with the same command and --resume"


def end_epoch(args, state):
    """Move to the next epoch (and stop at --max_epochs).  -> True when the epoch's evaluation and
    checkpoint are due (no --eval_interval, or the run is done)."""
    state["epoch"] += 1
    state["batch_in_epoch"] = 0
    if state["epoch"] >= args.max_epochs:
        state["done"] = f"reached --max_epochs {args.max_epochs}"
    return not args.eval_interval or bool(state["done"])


def scheduled_lr(args, step):
    """Linear warm-up over --warmup steps, then linear decay to 0 at --decay_steps."""
    warm = min(1.0, (step + 1) / args.warmup) if getattr(args, "warmup", 0) else 1.0
    return args.lr * warm * max(0.0, 1.0 - step / args.decay_steps)


def prepare_out_dir(args, ckpt):
    """Writable out_dir, leftovers of an interrupted checkpoint write removed, no silent overwrite."""
    check_out_dir(args.out_dir)
    for name in os.listdir(args.out_dir):  # temporary files of a write that a crash interrupted
        if name.startswith(".ckpt_") and name.endswith(".tmp"):
            os.remove(os.path.join(args.out_dir, name))
    if ckpt is None and os.path.exists(os.path.join(args.out_dir, "ckpt_last.pt")):
        raise ValueError(f"{args.out_dir} already holds a run (ckpt_last.pt): continue it with --resume, "
                         f"or choose another --out_dir")


def story_config(args, vocab_size):
    """The architecture part of a story run, stored in its checkpoints."""
    from data.stories import EOS
    if args.model == "gpt":
        return model_config(args, vocab_size, EOS)
    cfg = dict(model=args.model, vocab_size=vocab_size, n_layer=args.n_layer, d_model=args.d_model,
               n_head=args.n_head, dropout=args.dropout, block_size=args.block_size)
    if args.model == "insnet":
        cfg.update(max_offset=args.max_offset)
    return cfg


def train_stories(args, ckpt, stop):
    """InsNet / IT-vanilla / L2R on ROCStories or the synthetic benchmark (one process).
    Loss: the mean over a batch's predicted events (slot + token per insertion, termination;
    L2R: tokens) of -log p; one fresh insertion order per sequence per batch, drawn from a
    generator seeded by (seed, step), so a resumed run draws the same orders."""
    device = resolve_device(args.device)
    prepare_out_dir(args, ckpt)
    torch.manual_seed(args.seed)
    saved_vocab = ckpt["data"].get("vocab") if ckpt else None
    vocab, splits, _, note = load_sequences(args.dataset, args.task, args.model, args.data_dir, args.min_count,
                                            args.synthetic_count, vocab=saved_vocab)
    too_long = max(len(s["tokens"]) for split in splits.values() for s in split)
    if too_long > args.block_size:
        raise ValueError(f"a sequence of {too_long} tokens exceeds --block_size {args.block_size}")
    cfg = story_config(args, len(vocab))
    model = story_model(cfg)
    model.to(device)
    optimizer = configure_optimizer(model, args, device)
    state = dict(step=0, epoch=0, batch_in_epoch=0, best_val=math.inf, bad_evals=0, lr=args.lr, done=None)
    if ckpt is not None:
        if ckpt["config"] != cfg:
            raise CheckpointError(f"{args.out_dir}/ckpt_last.pt does not match this model/vocabulary")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.update(ckpt["train_state"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if state["done"] and state["done"].startswith("reached"):
            state["done"] = None
            if args.max_iters and state["step"] >= args.max_iters or state["epoch"] >= args.max_epochs:
                state["done"] = "reached the same limit again"
        if state["done"]:
            print(f"{args.out_dir}: this run already finished ({state['done']}); nothing to do")
            return 0
    train, valid = splits["train"], splits["valid"][:args.eval_seqs or None]
    train = train[:args.train_seqs or None]
    log_path, steps_path = os.path.join(args.out_dir, "log.jsonl"), os.path.join(args.out_dir, "steps.jsonl")
    truncate_log(log_path, state["step"])
    truncate_log(steps_path, state["step"])
    print(f"{args.model} on {args.dataset} ({args.task}{', order ' + args.order if args.model != 'gpt' else ''}): "
          f"{model.num_params():,} parameters, V={len(vocab):,}, device {device}; {note}"
          + (", resuming at step %d" % state["step"] if ckpt else ""))

    def checkpoint(name):
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise ValueError(f"non-finite weights at step {state['step']}; stopping (try a lower --lr)")
        data = dict(dataset=args.dataset, vocab_size=len(vocab), task=args.task)
        if args.dataset == "rocstories":
            data["vocab"] = vocab
        save_checkpoint(dict(config=cfg, model=model.state_dict(), optimizer=optimizer.state_dict(),
                             train_state=state, rng=dict(torch=torch.get_rng_state()), args=vars(args), data=data),
                        os.path.join(args.out_dir, name))

    def evaluate_and_log(run):
        val = story_perplexity(model, valid, args.order, args.batch_size, device, seed=args.seed)
        if not math.isfinite(val["nll_per_event"]):
            raise ValueError(f"non-finite validation loss at step {state['step']}; stopping")
        improved = val["nll_per_event"] < state["best_val"]
        state["bad_evals"] = 0 if improved else state["bad_evals"] + 1
        state["best_val"] = min(state["best_val"], val["nll_per_event"])
        if state["bad_evals"] >= args.patience:
            state["done"] = f"early stop: no improvement in {args.patience} evaluations"
        rec = dict(step=state["step"], epoch=state["epoch"], train_loss=run["loss"] / max(run["n"], 1),
                   val_loss=val["nll_per_event"], val_nll_per_story=val["nll_per_story"], lr=state["lr"],
                   seq_per_s=run["seqs"] / max(time.time() - run["t0"], 1e-9), best=improved)
        print(f"step {rec['step']:7d} | epoch {rec['epoch']:3d} | train loss {rec['train_loss']:.4f} | val loss "
              f"{rec['val_loss']:.4f} | val nll/story {rec['val_nll_per_story']:8.2f} | lr {state['lr']:.2e} | "
              f"{rec['seq_per_s']:7.1f} seq/s" + (" | best" if improved else ""), flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if improved:
            checkpoint("ckpt_best.pt")
        run.update(loss=0.0, n=0, seqs=0, t0=time.time())

    from tqdm import tqdm
    run = dict(loss=0.0, n=0, seqs=0, t0=time.time())
    while state["done"] is None:
        order = batches([len(s["tokens"]) for s in train], batch_size=args.batch_size, shuffle=True, seed=args.seed,
                        epoch=state["epoch"])
        n_steps = len(order) // args.grad_accum
        bar = tqdm(total=n_steps, initial=state["batch_in_epoch"], desc=f"epoch {state['epoch']}", leave=False,
                   disable=None)
        for s in range(state["batch_in_epoch"], n_steps):
            if args.lr_schedule == "linear":
                state["lr"] = scheduled_lr(args, state["step"])
            for group in optimizer.param_groups:
                group["lr"] = state["lr"]
            model.train()
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + state["step"])  # this step's insertion orders
            for j in range(args.grad_accum):
                seqs = [train[i] for i in order[s * args.grad_accum + j]]
                nll, events = story_nll(model, seqs, args.order, g, device)
                loss = nll.sum() / events.sum()
                if not torch.isfinite(loss):
                    raise ValueError(f"non-finite training loss at step {state['step'] + 1}; stopping. The last "
                                     f"good checkpoint is {os.path.join(args.out_dir, 'ckpt_last.pt')}")
                (loss / args.grad_accum).backward()
                _test_kill_point("step")
                run["loss"] += nll.sum().item()
                run["n"] += int(events.sum())
                run["seqs"] += len(seqs)
            if optimizer_step(model.parameters(), optimizer, args, state, s, loss.item(), loss.item(), steps_path, bar):
                evaluate_and_log(run)
                checkpoint("ckpt_last.pt")
            if state["done"]:
                break
            if stop.requested:
                checkpoint("ckpt_last.pt")
                print(STOPPED.format(step=state['step']))
                return 0
        bar.close()
        if state["done"]:
            break
        if end_epoch(args, state):
            if run["n"]:
                evaluate_and_log(run)
            checkpoint("ckpt_last.pt")
    checkpoint("ckpt_last.pt")
    print(f"done ({state['done']}) after {state['step']} steps; best val loss {state['best_val']:.4f} per event; "
          f"checkpoints in {args.out_dir}")
    return 0


def main(argv=None):
    """Ctrl-C during training writes a resumable checkpoint and returns 0 (see Interrupt)."""
    with Interrupt() as stop:
        return run_training(argv, stop)


def run_training(argv, stop):
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = {k: v for k, v in vars(args).items() if v != parser.get_default(k)}
    args = resolve_args(args)
    ckpt = None
    if args.resume:
        path = os.path.join(args.out_dir, "ckpt_last.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"--resume: no checkpoint {path}; start without --resume")
        ckpt = load_checkpoint(path)
        args = resume_args(args, explicit, ckpt)
    if args.dataset in STORY_DATASETS:
        return train_stories(args, ckpt, stop)
    rank, world, device_name = setup_distributed(args)
    master = rank == 0
    device = resolve_device(device_name)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if master:
        prepare_out_dir(args, ckpt)
    torch.manual_seed(args.seed + rank)

    meta, splits = load(args.dataset, args.data_dir, verbose=master)
    train_split, valid_split = splits["train"], splits["valid"]
    if args.task == "stream":  # batchified continuous streams (CT paper / AWD-LSTM): eval batch size 10
        folder = os.path.dirname(train_split.tokens.filename)
        train_stream = batchify(load_stream(folder, "train"), args.batch_size)
        valid_stream = batchify(load_stream(folder, "valid"), 10)
        if args.eval_seqs:  # stream mode: the first N tokens of each of the 10 validation columns
            valid_stream = valid_stream[:, :args.eval_seqs + 1]
    cfg = model_config(args, meta["vocab_size"], meta["eos_id"])
    lm = LanguageModel(cfg)
    if args.init_from != "scratch" and ckpt is None:
        if meta["tokenizer"] != "gpt2":
            raise ValueError(f"--init_from {args.init_from} needs the GPT-2 BPE vocabulary; {args.dataset} is "
                             f"{meta['tokenizer']}-level (use --dataset wikitext103)")
        load_pretrained_gpt2(lm, args.init_from, args.weights)
        if master:
            print(f"loaded pretrained {args.init_from} weights" + (f" from {args.weights}" if args.weights else ""))
    lm = lm.to(device)
    optimizer = configure_optimizer(lm, args, device)
    state = dict(step=0, epoch=0, batch_in_epoch=0, best_val=math.inf, bad_evals=0, lr=args.lr, done=None,
                 hidden=None)  # stream mode: the recurrent state carried into the next window
    if ckpt is not None:
        if ckpt["config"] != cfg:
            raise CheckpointError(f"{args.out_dir}/ckpt_last.pt does not match this model/vocabulary")
        lm.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.update(ckpt["train_state"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.startswith("cuda") and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        if state["done"] and state["done"].startswith("reached"):  # a step / epoch limit: may be raised
            state["done"] = None
            if args.max_iters and state["step"] >= args.max_iters or state["epoch"] >= args.max_epochs:
                state["done"] = "reached the same limit again"
        if state["done"]:
            if master:
                print(f"{args.out_dir}: this run already finished ({state['done']}); nothing to do "
                      f"(raise --max_iters / --max_epochs to go on)")
            return 0
    if args.compile:  # compile the model in place (state_dict keys stay unchanged)
        lm.compile()
    model = lm
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(lm, device_ids=[int(device.split(":")[1])] if device.startswith("cuda") else None)
    autocast = autocast_context(device, args.dtype)
    max_len = args.block_size if args.model == "gpt" else None
    bkw = dict(batch_size=args.batch_size, max_tokens=args.max_tokens)
    log_path = os.path.join(args.out_dir, "log.jsonl")
    steps_path = os.path.join(args.out_dir, "steps.jsonl")  # one line per optimizer step: the loss
    if master:  # a fresh run starts its logs anew; a resumed one drops what came after its checkpoint
        truncate_log(log_path, state["step"])
        truncate_log(steps_path, state["step"])
    accum = args.grad_accum // world  # micro-batches per process per optimizer step
    peak, fpt = peak_flops(args, device), flops_per_token(lm, cfg, float(train_split.lengths.mean() - 1))
    if master:
        print(f"{args.model} + {args.head} head on {args.dataset}: {lm.num_params():,} parameters, "
              f"V={meta['vocab_size']:,}, device {device}" + (f" x {world} processes" if world > 1 else "")
              + (", resuming at step %d" % state["step"] if ckpt else ""))

    def fail_non_finite(what):
        raise ValueError(f"non-finite {what} at step {state['step']}; stopping. The last good checkpoint is "
                         f"{os.path.join(args.out_dir, 'ckpt_last.pt')} (try a lower --lr or --grad_clip)")

    def checkpoint(name):
        if not all(bool(torch.isfinite(p).all()) for p in lm.parameters()):
            fail_non_finite("weights")  # never overwrite a good checkpoint with a broken model
        if not master:
            return
        rng = dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state() if device.startswith("cuda") else None)
        save_checkpoint(dict(config=cfg, model=lm.state_dict(), optimizer=optimizer.state_dict(), train_state=state,
                             rng=rng, args=vars(args), data=dict(dataset=args.dataset, vocab_size=meta["vocab_size"],
                                                                 eos_id=meta["eos_id"], source=meta["source"]["sha256"])),
                        os.path.join(args.out_dir, name))

    def evaluate_and_log(run):
        train_loss_sum, train_n, tokens = all_sum([run["loss"], run["n"], run["tok"]], world, device)
        tok_per_s = tokens / max(time.time() - run["t0"], 1e-9)
        _test_kill_point("evaluation")
        if args.task == "stream":
            val = stream_perplexity(lm, valid_stream, args.bptt, device)
        else:
            val = perplexity(lm, valid_split, device, limit=args.eval_seqs or None, autocast=autocast,
                             max_len=max_len, rank=rank, world=world, **bkw)
        if not math.isfinite(val["nll"]):
            fail_non_finite("validation loss")
        improved = val["nll"] < state["best_val"]
        if improved:
            state["best_val"], state["bad_evals"] = val["nll"], 0
        else:
            state["bad_evals"] += 1
            if args.lr_schedule == "plateau":
                state["lr"] *= args.lr_decay
        if state["bad_evals"] >= args.patience:
            state["done"] = f"early stop: no improvement in {args.patience} evaluations"
        train_loss = train_loss_sum / max(train_n, 1)
        mfu = tok_per_s * fpt / peak if peak else None
        rec = dict(step=state["step"], epoch=state["epoch"], train_loss=train_loss, val_loss=val["nll"],
                   val_ppl=val["ppl"], lr=state["lr"], tokens_per_s=tok_per_s, mfu=mfu, best=improved)
        if master:
            print(f"step {rec['step']:7d} | epoch {rec['epoch']:3d} | train loss {train_loss:.4f} | "
                  f"val loss {val['nll']:.4f} | val ppl {val['ppl']:9.2f} | lr {state['lr']:.2e} | "
                  f"{tok_per_s:8.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                  + (" | best" if improved else ""), flush=True)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if improved:
            checkpoint("ckpt_best.pt")
        run.update(loss=0.0, n=0, tok=0, t0=time.time())

    ls = loss_scale(meta["vocab_size"], args.ct_alpha, args.ct_beta) if args.loss_scaling else 1.0

    def micro_loss(batch):
        """-> (loss to backpropagate, cross entropy, number of target tokens, input tokens)."""
        with autocast or contextlib.nullcontext():
            if args.task == "stream":
                x, y = batch
                log_p, state["hidden"] = lm.stream_log_probs(x, y, state["hidden"])
                state["hidden"] = detach(state["hidden"])  # truncated BPTT: no gradient into the past
                n, n_in = y.numel(), y.numel()
                ce = -log_p.float().mean()
            else:
                log_p, mask = batch_log_probs(model, batch)
                n, n_in = int(mask.sum()), int((batch["lengths"] - 1).sum())
                ce = -log_p[mask].float().sum() / n
            loss = ce * ls
            if args.ar or args.tar:  # CT paper eq. 8 (AWD-LSTM): on the last layer's output
                loss = loss + lm.backbone.activation_regularisation(args.ar, args.tar)
        return loss, ce, n, n_in

    from tqdm import tqdm
    run = dict(loss=0.0, n=0, tok=0, t0=time.time())
    while state["done"] is None:
        if args.task == "stream":
            order = bptt_windows(train_stream.size(1), args.bptt)
            if state["batch_in_epoch"] == 0:
                state["hidden"] = None  # each epoch starts the streams afresh
        else:
            order = batches(train_split.lengths, shuffle=True, seed=args.seed, epoch=state["epoch"],
                            limit=args.train_seqs or None, max_len=max_len, **bkw)
        n_steps = len(order) // args.grad_accum  # an epoch's last len % grad_accum batches are skipped
        bar = tqdm(total=n_steps, initial=state["batch_in_epoch"], desc=f"epoch {state['epoch']}",
                   disable=None if master else True, leave=False)
        for s in range(state["batch_in_epoch"], n_steps):
            if args.lr_schedule == "linear":
                state["lr"] = scheduled_lr(args, state["step"])
            for group in optimizer.param_groups:
                group["lr"] = state["lr"]
            model.train()
            finite = True
            for j in range(accum):  # this process's micro-batches of global step s
                item = order[s * args.grad_accum + rank * accum + j]
                if args.task == "stream":
                    i, L = item
                    batch = (train_stream[:, i:i + L].to(device), train_stream[:, i + 1:i + 1 + L].to(device))
                else:
                    batch = collate(train_split, item, device)
                if world > 1:
                    model.require_backward_grad_sync = j == accum - 1  # all-reduce on the last one only
                loss, ce, n, n_in = micro_loss(batch)
                finite = finite and bool(torch.isfinite(loss))
                (loss / accum).backward()
                _test_kill_point("step")
                run["loss"] += ce.item() * n
                run["n"] += n
                run["tok"] += n_in
            if world > 1:
                finite = all_sum([float(not finite)], world, device)[0] == 0
            if not finite:
                state["step"] += 1  # name the step that failed
                fail_non_finite("training loss")
            if optimizer_step(lm.parameters(), optimizer, args, state, s, ce.item(), loss.item(), steps_path, bar,
                              master):
                evaluate_and_log(run)
                checkpoint("ckpt_last.pt")
            if state["done"]:
                break
            if stop.requested:
                checkpoint("ckpt_last.pt")
                if master:
                    print(STOPPED.format(step=state['step']))
                return 0
        bar.close()
        if state["done"]:
            break
        if end_epoch(args, state):
            if all_sum([run["n"]], world, device)[0]:
                evaluate_and_log(run)
            checkpoint("ckpt_last.pt")
    checkpoint("ckpt_last.pt")
    if master:
        print(f"done ({state['done']}) after {state['step']} steps; best val ppl "
              f"{math.exp(min(state['best_val'], 700)):.2f}; checkpoints in {args.out_dir}")
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
