"""Each paper result in one command: train what it needs (finished runs are reused), evaluate,
write the paper's table with nanogen's numbers beside, the figures and the raw numbers (JSON).

    python reproduce.py nmst-table1 --scale cpu   # or nmst-table4, ct-table3, insnet-storyline
    python reproduce.py nmst-table1 --scale paper --models rnn --seeds 1 --budget_minutes 360

Scales: tiny (seconds: the tests' check), cpu (<= 10 minutes each on 2 CPU cores), paper (the
papers' settings: GPU days, which --models, --seeds and --budget_minutes cut).  docs/reproduce.md.
"""

import argparse
import itertools
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import scipy.stats
import torch

import bench
import common
import curves
import evaluate
import train
from common import UserError, check_output, run, write_file
from decode import SAMPLING
from heads import EPSILON_HEADS, paper_name, t_half
from heads import HEADS as HEADS_AVAILABLE

RESULTS = ("nmst-table1", "nmst-table4", "ct-table3", "insnet-storyline")
HEADS = ("softmax", "st", "nmst")  # the default of --heads (any head of heads.HEADS may be given)
SMOKE = ["", "- smoke test (tiny scale: a few steps, one seed): no conclusion."]
TABLE4 = "topk-2 topk-4 nucleus-0.2 nucleus-0.4 beam-2 beam-4"
EVAL_SEQS = 400  # the validation sequences of a run's own evaluations (tiny and cpu scales)
ALPHA = 0.05  # the level at which a difference between heads is called

# --- the settings of every result: a row a scale ----------------------------------------------
# The small models' flags (train.py's).  The paper scale keeps each recipe; its Table 1 trains
# under --protocol authors, as the NMST authors' code that made the paper's numbers did.
TINY = "--d_model 16 --batch_size 8 --n_layer 1 --train_seqs 200"
SMALL = "--d_model 128 --dropout 0.1 --lr 3e-3 --lr_schedule constant --batch_size 32"
GPT = f"--n_layer 2 --n_head 4 --block_size 1024 {SMALL} --lr 1e-3"
NMST_COLUMNS = ("dataset", "steps", "seeds", "contexts", "L", "fig2_L", "eps", "models", "flags")
# The cpu scale takes PTB (a 10k vocabulary is cheaper than WikiText-2's 33k) and the paper's
# eps = 1e-5: Theorem 3's t_1/2 = 69,315 lies far beyond L = 1000, so every r_nt in its tables is
# learned (at eps = 1e-3, t_1/2 = 693 < L would decide ST / NMST's r_nt(1000) under greedy,
# top-k and nucleus).  steps: --max_iters (None: the recipe's, to early stop); contexts: the
# validation contexts decoded (None: all); fig2_L: greedy's largest L (Fig. 2 reaches 1e5, but
# GPT-2's window stops Table 4 at 1000).
# fmt: off
NMST1 = {
    "tiny":  ("ptb",       6,    1,  6,    40,   40,      1e-3, "lstm",     TINY),
    "cpu":   ("ptb",       300,  3,  100,  1000, 1000,    1e-5, "rnn lstm", SMALL),
    "paper": ("wikitext2", None, 10, None, 1000, 100_000, 1e-5, "rnn lstm", "--protocol authors"),
}
NMST4 = {
    "tiny":  ("ptb",         6,    1,  6,    40,   40,   1e-3, "lstm", TINY),
    "cpu":   ("ptb",         300,  3,  100,  1000, 1000, 1e-5, "gpt",  GPT),
    "paper": ("wikitext103", None, 10, None, 1000, 1000, 1e-5, "gpt",  "--init_from gpt2"),
}
# Each scale's decoders: Table 1's tiny and cpu scales one of each kind (Fig. 7), the paper all.
DECODERS = {
    (1, "tiny"): "greedy", (1, "cpu"): "greedy topk-2 nucleus-0.4 beam-2",
    (1, "paper"): f"greedy {TABLE4}", (4, "tiny"): "greedy topk-2 beam-2",
    (4, "cpu"): TABLE4, (4, "paper"): TABLE4,
}
# CT Table 3 (PTB, without finetuning): the paper's 3-layer AWD-LSTM (960-960-620, M = 15, AR 2 /
# TAR 1) is approximated at paper scale by nanogen's LSTM (one width for every layer, no weight
# drop).  limit: the tokens scored of each of the 10 evaluation columns (None: all).
CT_MODEL = "--model lstm --task stream --dataset ptb"
CT = {  # scale: seeds, limit, train.py's flags
    "tiny":  (1,  100,  "--d_model 16 --n_layer 1 --batch_size 8 --bptt 20 --n_experts 2"
                        " --max_iters 4 --eval_interval 4 --eval_seqs 200"),
    "cpu":   (3,  2000, "--d_model 64 --dropout 0.1 --batch_size 20 --bptt 35 --n_experts 2"
                        " --lr 3e-3 --lr_schedule constant --max_iters 200 --eval_interval 200"
                        " --eval_seqs 1000"),
    "paper": (10, None, "--n_layer 3 --d_model 960 --dropout 0.4 --batch_size 12 --bptt 70"
                        " --n_experts 15 --ar 2 --tar 1 --locked_dropout --lr 1e-3"),
}
# InsNet Table 3 (golden storylines): InsNet-full against L2R-PNW on ROCStories, greedy decoding
# of the first test stories (None: all); the paper: base size, 80k steps (the recipe's).
INSNET = {  # scale: seeds, stories, train.py's flags
    "tiny":  (1, 3,    "--n_layer 1 --d_model 16 --n_head 2 --batch_size 8 --max_iters 4"
                       " --eval_interval 4 --eval_seqs 16 --train_seqs 64 --warmup 0"),
    "cpu":   (3, 100,  "--n_layer 2 --d_model 64 --n_head 4 --batch_size 32 --lr 2e-3 --warmup 30"
                       " --max_iters 500 --decay_steps 500 --eval_interval 500 --eval_seqs 200"),
    "paper": (3, None, ""),
}
# Fig. 12's timings (bench.py insnet): the cpu scale's 2 x 256 model makes the output layer weigh
# as in a real one.
FIG12 = {  # scale: --gpt_dim, --seqs, --batch, --it_batch, --iters, --lengths
    "tiny":  (64,  4,  8,  2, 1, "20 40"),
    "cpu":   (256, 16, 16, 4, 2, "20 40 80 120 160"),
    "paper": (256, 16, 16, 4, 2, "20 40 60 80 100 120 160"),
}
# fmt: on

# The papers' numbers beside nanogen's: NMST Table 1 (perplexity, authors' metric), Table 4
# (r_nt(1000), a row a head, in the order of TABLE4), CT Table 3, InsNet Table 3.
PAPER_TABLE1 = {  # VA+, ST+, NMST+ (the order of HEADS)
    "rnn": "178.6 ± 6.3 | 180.4 ± 3.3 | 177.4 ± 4.5",
    "lstm": "101.6 ± 1.0 | 104.5 ± 1.4 | 101.5 ± 0.8",
}
PAPER_TABLE4 = {
    "softmax": "0.0 ± 0.0 | 0.0 ± 0.0 | 0.25 ± 0.08 | 0.14 ± 0.05 | 0.05 ± 0.02 | 0.03 ± 0.01",
    "st": "0.0 ± 0.0 | 0.0 ± 0.0 | 0.73 ± 0.11 | 0.55 ± 0.15 | 0.29 ± 0.10 | 0.15 ± 0.07",
    "nmst": "0.0 ± 0.0 | 0.0 ± 0.0 | 0.21 ± 0.10 | 0.10 ± 0.06 | 0.03 ± 0.02 | 0.01 ± 0.01",
}
CT_ROWS = (
    ("softmax", "softmax", "", "60.7 / 58.8 (AWD-LSTM, Table 1)"),
    ("MoS (tau = 0.5)", "mos", "0.5", "60.73 / 58.38"),
    ("MoS (tau = 1.0)", "mos", "", "58.08 / 55.97"),
    ("MoS (tau = 4.0)", "mos", "4", "57.39 / 55.21"),
    ("CT", "ct", "", "- (not reported)"),
    ("CT-MoS", "ctmos", "", "56.95 / 54.69"),
)  # label, head, --temperature (none: 1), the paper's valid / test
INSNET_ROWS = (
    ("insnet", "InsNet (constrained)", "52.86 / 36.86 / 26.39 / 19.35, 100%"),
    ("gpt", "L2R-PNW", "51.74 / 35.74 / 25.64 / 18.95, 95.40%"),
)  # model, label, the paper's BLEU-1 to 4 and storyline inclusion
# The directions the papers claim, (a, b): a's value above b's.  NMST's perplexities: "NMST+ ...
# better than ST+"; its greedy r_nt (Table 1, Fig. 2): VA+ loops where ST+ and NMST+ end; its
# Table 4: NMST+'s r_nt below VA+'s.  Every other pair is tested two-sided.
PPL_CLAIMS = {("st", "nmst"): "greater", ("nmst", "st"): "less"}
GREEDY_CLAIMS = {("softmax", "st"): "greater", ("softmax", "nmst"): "greater"}
TABLE4_CLAIMS = {("softmax", "nmst"): "greater"}


# NMST Table 1 or 4 at a scale (its row of NMST1 / NMST4) as a dict, the models' flags and
# the decoders as lists.
def nmst_settings(scale, table):
    cfg = dict(zip(NMST_COLUMNS, {1: NMST1, 4: NMST4}[table][scale]))
    # Every model of a row trains with the row's flags: the scales differ in size, not by model.
    cfg["models"] = {m: cfg["flags"].split() for m in cfg["models"].split()}
    cfg["decoders"] = DECODERS[table, scale].split()
    return cfg


# --- running: train (or reuse), evaluate (or reuse) -------------------------------------------
# Train, go on with or reuse every run of the plan [(name, flags)]: in turn in this process,
# or --jobs at once as `python train.py` processes.  -> {name: its ckpt_best.pt}.
def train_all(plan, args):
    cap = run_cap(len(plan), args)
    runs = []
    for name, flags in plan:
        out = os.path.join(args.runs, name)
        argv = [*flags, *cap, "--out_dir", out]
        # A run with a checkpoint goes on from it (a finished one stops at once: reused).
        if os.path.isfile(f"{out}/ckpt_last.pt"):
            argv.append("--resume")
        runs.append((out, argv))
    # One run at a time needs no process of its own: train.main runs here, where a Ctrl-C
    # reaches it directly.
    if args.jobs == 1:
        codes, stop = train_in_turn(runs)
    else:
        codes, stop = train_processes(runs, args.jobs)
    check_trained([name for name, _ in plan], codes, stop, args)
    return {name: os.path.join(args.runs, name, "ckpt_best.pt") for name, _ in plan}


# train.py's cap on each of n runs, said before they start: --max_minutes as given (0: none,
# which lifts a capped run's cap), or --budget_minutes shared by the waves of --jobs runs.
def run_cap(n, args):
    # The runs train in waves of --jobs at once: a budget is shared by the waves, not the runs.
    waves = math.ceil(n / args.jobs)
    if args.budget_minutes:
        args.max_minutes = args.budget_minutes / waves
    # A cap of 0 lifts the one a run was started with: resumed without one, it goes on to its end.
    cap = ["--max_minutes", f"{args.max_minutes or 0:g}"]
    most = ""
    if args.max_minutes:
        most = f": {waves * args.max_minutes:g} min of training, and each run's set-up and "
        most += "evaluations"
    # A budget's runs stop at an epoch's end, so that no evaluation of half an epoch lowers a
    # plateau learning rate: one epoch may run past the run's share.
    if args.budget_minutes:
        cap.append("--whole_epochs")
        most += f" (each run stops at the first epoch's end past {args.max_minutes:g} min)"
    print(f"training {n} runs, {args.jobs} at a time{most}", flush=True)
    return cap


# Each run by train.main in this process.  -> (no exit statuses, the signal that stopped a
# run or None): a stopped run has written its checkpoint, and the command stops there too.
def train_in_turn(runs):
    for _, argv in runs:
        train.main(argv)
        # A signal stopped the run (its checkpoint written): the command stops there too.
        if train.STOP:
            return [], train.STOP[0]
    return [], None


# Each run's `python -u train.py` (its output, unbuffered, in RUNS/NAME.log), jobs at once.
# -> (the exit statuses, None for a run not started; the first stop's name, or None).
def train_processes(runs, jobs):
    running, stops = [], []
    # Each child has a session of its own, so a Ctrl-C at the terminal reaches it once, from here,
    # as the signal it was: Ctrl-C and SIGTERM stop a run cleanly (its checkpoint written), a
    # second Ctrl-C aborts it, as they would a run started by hand.  The lock makes a start and a
    # signal one after the other: each child gets each signal exactly once.
    lock = threading.RLock()

    def on_signal(signum, frame):
        with lock:
            stops.append({signal.SIGINT: "Ctrl-C"}.get(signum, signal.Signals(signum).name))
            for p in running:
                p.send_signal(signum)

    def start(run):
        with lock:
            # After a stop no further run starts.
            if stops:
                return None
            with open(f"{run[0]}.log", "a") as log:
                # -u: a child's output reaches its log as it is printed, so a child stopped
                # early leaves what it said.
                cmd = [sys.executable, "-u", train.__file__, *run[1]]
                p = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            running.append(p)
        return p.wait()

    # This process passes signals on only while its children run; the handlers before come back.
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ThreadPoolExecutor(jobs) as pool:
            codes = list(pool.map(start, runs))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return codes, (stops or [None])[0]


# One line and no table when a run was stopped, failed or ended short; the runs that
# --max_minutes stopped are noted (args.partial) for the table to say so.
def check_trained(names, codes, stop, args):
    again = "the same command goes on from there"
    if stop:
        raise UserError(f"stopped by {stop}; the runs' checkpoints are in {args.runs}: {again}")
    failed = sum(c != 0 for c in codes)
    if failed:
        raise UserError(f"{failed} of {len(names)} runs failed: see their .log in {args.runs}")
    # A run that exited without an error may still have stopped short: its checkpoint says.
    status = {name: run_status(os.path.join(args.runs, name)) for name in names}
    short = [f"{name} ({why})" for name, why in status.items() if why not in (None, "partial")]
    if short:
        raise UserError(
            f"{len(short)} of {len(names)} runs stopped before their end: {', '.join(short)}; "
            f"{again}"
        )
    args.partial += [name for name, why in status.items() if why == "partial"]


# -> None for a run trained to its end, "partial" for one its --max_minutes stopped, else why
# it stopped short: train.py's checkpoint says (its state's "stopped": the signal that stopped
# it, the one convention for a run stopped by a signal).
def run_status(out):
    path = os.path.join(out, "ckpt_last.pt")
    if not os.path.isfile(path):
        return "no checkpoint: it was killed before its first evaluation"
    ckpt = common.load_checkpoint(path)
    st, cap = ckpt["state"], ckpt["args"].get("max_minutes")
    # The run's own limits without its time cap: one reached, it is finished, capped or not.
    if train.limit_reached(argparse.Namespace(**dict(ckpt["args"], max_minutes=0)), st):
        return None
    if st.get("stopped"):
        return f"stopped by {st['stopped']}"
    if cap and st.get("elapsed", 0) >= 60 * cap:
        return "partial"
    return "stopped before its end"


# evaluate.evaluate_once's result, evaluated again where a result written by an earlier
# version lacks what this one reads (needs: the keys down to a value, outermost first).
def evaluated(ckpt, flags, path, needs):
    found = res = evaluate.evaluate_once(ckpt, flags, path)
    for key in needs:
        if not isinstance(found, dict) or key not in found:
            # The file goes first: evaluate_once would reuse it (the same request, newer than
            # the run's checkpoint).
            print(f"{path}: written by an earlier version, evaluated again", flush=True)
            os.remove(path)
            return evaluate.evaluate_once(ckpt, flags, path)
        found = found[key]
    return res


# --- the statistics every table says ----------------------------------------------------------
# mean ± the sample standard deviation (ddof 1) over seeds; one seed: the value alone (one
# run has no spread to show).  Every table says n in its first line.
def mean_std(values, digits=1):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


# Welch's t-test of two heads' per-seed values (unequal variances): its p-value; nan with
# one seed on a side (no spread: nothing is called).  alternative "greater": a above b.
def welch(a, b, alternative="two-sided"):
    # Welch's test needs a spread on each side.
    if len(a) < 2 or len(b) < 2:
        return math.nan
    # Seeds that agree exactly on both sides (r_nt 0 everywhere) leave t = 0 / 0: scipy warns and
    # says nan, where the data show no difference at all.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        test = scipy.stats.ttest_ind(a, b, equal_var=False, alternative=alternative)
    return 1.0 if math.isnan(test.pvalue) else float(test.pvalue)


# 'VA+ 0.120 vs ST+ 0.000: p = 0.031 (VA+ above): apart at 5 %', or '...: not resolved'.
def compared(name_a, a, name_b, b, digits=3, alternative="two-sided"):
    means = f"{name_a} {statistics.mean(a):.{digits}f} vs {name_b} {statistics.mean(b):.{digits}f}"
    p = welch(a, b, alternative)
    if math.isnan(p):
        return f"{means}: one seed, not tested"
    # The side printed is the direction tested: the paper's claim, where it makes one.
    side = {"greater": f" ({name_a} above)", "less": f" ({name_a} below)"}.get(alternative, "")
    verdict = "apart at 5 %" if p < ALPHA else "not resolved"
    return f"{means}: p = {p:.2g}{side}: {verdict}"


# Each pair (a, b) of heads compared by Welch's test, one-sided where claims names the
# paper's direction.  values: {head: per-seed values}.  -> (the text, the pairs apart at 5 %).
def calls(values, pairs, claims, digits=3):
    texts, apart = [], []
    for a, b in pairs:
        side = claims.get((a, b), "two-sided")
        texts.append(compared(paper_name(a), values[a], paper_name(b), values[b], digits, side))
        if welch(values[a], values[b], side) < ALPHA:
            apart.append((a, b))
    return "; ".join(texts), apart


# Four evaluations per run (and as many termination probes: the curves over training);
# tiny: one.
def base_flags(cfg, model, head, seed):
    flags = f"--model {model} --head {head}".split()
    # Only the termination heads read eps (NMST eq. 9, 10).
    if head in EPSILON_HEADS:
        flags += ["--epsilon", str(cfg["eps"])]
    flags += f"--dataset {cfg['dataset']} --seed {seed}".split() + cfg["models"][model]
    # The paper scale keeps the recipe's own steps and evaluations.
    if cfg["steps"]:
        # Four evaluations give the curves over training four points; a smoke run's few steps, one.
        every = cfg["steps"] // 4 if cfg["steps"] >= 20 else cfg["steps"]
        flags += ["--max_iters", str(cfg["steps"]), "--eval_interval", str(every)]
        flags += ["--eval_seqs", str(EVAL_SEQS)]
    return flags


# --- NMST Table 1 + Fig. 2 / 7, NMST Table 4 --------------------------------------------------
def run_nmst(table, args):
    cfg = nmst_settings(args.scale, table)
    # The scale's settings cut to what the user asked for: --models, --seeds.
    cfg["models"] = {m: cfg["models"][m] for m in args.models or cfg["models"]}
    cfg["seeds"] = args.seeds or cfg["seeds"]
    # A --heads subset keeps the rows of the heads already finished in this results folder.
    done, grid = [], list(itertools.product(cfg["models"], range(cfg["seeds"])))
    for h in HEADS_AVAILABLE:
        ready = all(os.path.exists(f"{args.out}/{m}-{h}-s{s}-ppl.json") for m, s in grid)
        if ready and h not in args.heads:
            done.append(h)
    # A copy of args: the finished heads join this table's rows, not the next result's.
    args = argparse.Namespace(**{**vars(args), "heads": args.heads + done})
    runs = nmst_runs(cfg, args)
    if table == 4:
        lines = report_table4(cfg, runs, args)
    else:
        lines = report_table1(cfg, runs, args)
    half, path = t_half(cfg["eps"]), os.path.join(args.out, "r_nt.png")
    curves.r_nt_figure(runs, args.heads, cfg["decoders"], half, path)
    seqs = f"the first {EVAL_SEQS}" if cfg["steps"] else "all"
    lines += curves.over_training(cfg["models"], args.heads, args.runs, args.out, seqs, cfg["eps"])
    return lines, {f"{m}/{h}": res for (m, h), res in runs.items()}


# Train every (model, head, seed), evaluate perplexity and decode every context with every
# decoder (sampling decoders: the run's seed).  -> {(model, head): [per-seed results]}.
def nmst_runs(cfg, args):
    limit = ["--limit", str(cfg["contexts"])] if cfg["contexts"] else []
    grid = list(itertools.product(cfg["models"], args.heads, range(cfg["seeds"])))
    names = [f"{model}-{head}-s{seed}" for model, head, seed in grid]
    ckpts = train_all([(name, base_flags(cfg, *run)) for name, run in zip(names, grid)], args)
    runs = {}
    for k, (name, (model, head, seed)) in enumerate(zip(names, grid)):
        print(f"[{k + 1}/{len(grid)}] evaluating {name}", flush=True)
        # Perplexity on the whole split, but for the smoke test.
        ppl_flags = ["--split", "valid", *(limit if args.scale == "tiny" else [])]
        path = f"{args.out}/{name}-ppl.json"
        ppl = evaluated(ckpts[name], ppl_flags, path, ["ppl_nanogen"])
        r = {key: ppl[key] for key in ("ppl", "ppl_nanogen", "ppl_authors")}
        for dec in cfg["decoders"]:
            flags = [*study_flags(cfg, dec), *limit, "--traces", "3"]
            # The sampling decoders draw with the run's seed, so that each seed's numbers repeat.
            if dec.partition("-")[0] in SAMPLING:
                flags += ["--seed", str(seed)]
            path = f"{args.out}/{name}-{dec}.json"
            r[dec] = evaluated(ckpts[name], flags, path, ["decoding", "r_nt_curve"])
        runs.setdefault((model, head), []).append(r)
    return runs


# evaluate.py's flags for one decoder's study: one decode to its largest L gives r_nt at
# every L of the curve (greedy: to fig2_L, Fig. 2's; the others: to L).
def study_flags(cfg, dec):
    top = cfg["fig2_L"] if dec == "greedy" else cfg["L"]
    points = {1, 3, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000, cfg["L"], top}
    curve = [str(x) for x in sorted(points) if x <= top]
    # A decoder's name is its kind and its value: topk-2 is --decoder topk --k 2.
    kind, _, value = dec.partition("-")
    flag = {"topk": "--k", "nucleus": "--p", "beam": "--beam_size"}.get(kind)
    return ["--no_ppl", "--decoder", kind, *([flag, value] if flag else []), "--L", *curve]


def r_nt(results, dec, L):
    return [res[dec]["decoding"]["r_nt"][str(L)] for res in results]


# A table's r_nt(L): mean ± std over the seeds, marked * where Theorem 3 decides it.
def cell(cfg, results, head, dec, L):
    mark = " *" if forced(cfg, head, dec, L) else ""
    return mean_std(r_nt(results, dec, L), 3) + mark


# Whether Theorem 3 decides r_nt(L) of this cell: ST / NMST past t_1/2 under greedy (it must
# end there), top-k or nucleus (eos is the top token: a step ends with p > 1/2).
def forced(cfg, head, dec, L):
    incomplete = dec.split("-")[0] in ("greedy", "topk", "nucleus")
    return head in EPSILON_HEADS and incomplete and L >= t_half(cfg["eps"])


# A table's first lines: what it shows, n, and which of its cells the setting decides.
def table_head(cfg, args, what):
    half = t_half(cfg["eps"])
    # The runs' precision on this machine: train.py's --dtype auto, or under --protocol authors
    # the authors' own (train.AUTHORS: float32).
    device, dtype = common.get_device("auto"), "auto"
    if "--protocol authors" in cfg["flags"]:
        dtype = train.AUTHORS["dtype"]
    lines = [
        f"NMST {what} (scale {args.scale}, {cfg['dataset']}, every run in "
        f"{common.precision(device, dtype)}: --dtype {dtype}): mean ± sample std (ddof 1) over "
        f"n = {cfg['seeds']} seed(s); differences are called by Welch's t-test at 5 % (p "
        f"one-sided where the paper claims a direction).",
        f"- Theorem 3 decides, not training, every r_nt(L) of ST+ / NMST+ under greedy, top-k and "
        f"nucleus at L >= t_1/2 = {half:,} (eps = {cfg['eps']:g}): those cells are marked *.",
    ]
    if cfg["seeds"] == 1:
        lines.append("- One seed: no spread, so no difference is called.")
    return lines


# Perplexity by head (a row, by the papers' names: VA+, ST+, NMST+, MoS, ...) and model (a
# column), both metrics, the paper's value beside; eps only for the heads that read it.
def report_table1(cfg, runs, args):
    models = list(cfg["models"])
    lines = [
        *table_head(cfg, args, "Table 1: validation perplexity"),
        "- Each cell: nanogen's metric (the continuations of lines of > 10 words) / the authors' "
        "(one eos target more for each shorter line; only a --protocol authors run keeps those "
        "lines), then in () the paper's, which is the authors' metric (WikiText-2, eps = 1e-5, "
        "10 runs, converged 2x256 RNN / 2x512 LSTM).",
        *termination_shown(cfg, runs, args),
        "",
        "| head | eps | " + " | ".join(m.upper() for m in models) + " |",
        "|---|---|" + "---|" * len(models),
    ]
    for h in args.heads:
        eps = f"{cfg['eps']:g}" if h in EPSILON_HEADS else "-"
        cells = []
        for m in models:
            ours = mean_std([r["ppl_nanogen"] for r in runs[m, h]])
            theirs = mean_std([r["ppl_authors"] for r in runs[m, h]])
            paper = dict(zip(HEADS, PAPER_TABLE1.get(m, "").split(" | ")))
            cells.append(f"{ours} / {theirs} ({paper.get(h, '-')})")
        lines.append(f"| {paper_name(h)} | {eps} | " + " | ".join(cells) + " |")
    return lines + rnt_rows(cfg, runs, args) + verdict_table1(cfg, runs, args)


# Table 1's first lines on the paper's termination finding (greedy: VA+ loops, ST+ / NMST+
# end), where training decides it: VA+'s r_nt against each ST+ / NMST+'s at the largest L
# below t_1/2, one-sided; the finding shows where VA+'s lies above at 5 %.
def termination_shown(cfg, runs, args):
    others = [h for h in args.heads if h in EPSILON_HEADS]
    if args.scale == "tiny":
        return []
    if "softmax" not in args.heads or not others:
        return ["- No conclusion on termination: the paper compares VA+ with ST+ / NMST+."]
    # The largest L below t_1/2: there training decides r_nt, not Theorem 3.
    L = max(x for x in (10, 100, 1000, cfg["L"]) if x <= cfg["L"] and x < t_half(cfg["eps"]))
    lines, shown, not_shown = [], [], []
    for m in cfg["models"]:
        values = {h: r_nt(runs[m, h], "greedy", L) for h in ["softmax", *others]}
        # The finding is VA+ above: only that one-sided call shows it.
        text, apart = calls(values, [("softmax", h) for h in others], GREEDY_CLAIMS)
        lines.append(f"  {m.upper()}, greedy r_nt({L}): {text}.")
        for h in others:
            found = shown if ("softmax", h) in apart else not_shown
            found.append(f"{m.upper()} {paper_name(h)}")
    summary = (
        f"- The paper's termination finding (greedy: VA+ loops, ST+ / NMST+ end) at r_nt({L}) "
        f"(learned, L < t_1/2), VA+ above at 5 %: shown for {', '.join(shown) or 'none'}; "
        f"NOT shown for {', '.join(not_shown) or 'none'}."
    )
    return [summary, *lines]


# r_nt(L) at L = 10, 100 and the largest L, by model, head and decoder.
def rnt_rows(cfg, runs, args):
    # L = 10 and 100 show how soon the continuations end; the largest L, whether they end at all.
    Ls = [L for L in (10, 100, cfg["L"]) if L <= cfg["L"]]
    lines = [
        "",
        f"Non-termination ratio r_nt(L) by decoder ({cfg['contexts'] or 'all'} validation "
        f"contexts; Fig. 2 and 7; * decided by Theorem 3):",
        "",
        "| model | head | decoder | " + " | ".join(f"r_nt({L})" for L in Ls) + " | mean length |",
        "|---|---|---|" + "---|" * (1 + len(Ls)),
    ]
    for ((m, h), res), dec in itertools.product(runs.items(), cfg["decoders"]):
        cells = [cell(cfg, res, h, dec, L) for L in Ls]
        length = mean_std([r[dec]["decoding"]["mean_length"] for r in res])
        lines.append(f"| {m} | {paper_name(h)} | {dec} | " + " | ".join(cells) + f" | {length} |")
    return lines


# The perplexities, head against head (nanogen's metric); at the tiny scale (a smoke test: a
# few steps, one seed) no conclusion is drawn.
def verdict_table1(cfg, runs, args):
    if args.scale == "tiny":
        return SMOKE
    out = [""]
    for m in cfg["models"]:
        ppl = {h: [r["ppl_nanogen"] for r in runs[m, h]] for h in args.heads}
        text, _ = calls(ppl, itertools.combinations(args.heads, 2), PPL_CLAIMS, 1)
        out.append(f"- {m.upper()}, perplexity (nanogen's metric): {text}.")
    return out


# r_nt(L) by head (a row) and decoder (a column), the paper's beside; then each decoder's
# learned ST+ / NMST+ cells against VA+'s.
def report_table4(cfg, runs, args):
    # Table 4 compares the heads on one model, the scale's first (GPT-2 in the paper).
    decs, model, L = cfg["decoders"], next(iter(cfg["models"])), cfg["L"]
    lines = [
        *table_head(cfg, args, f"Table 4: r_nt({L})"),
        f"- {cfg['contexts'] or 'all'} validation contexts, {model} (beam: the seeds' models); "
        f"in () the paper's (GPT-2 finetuned on WikiText-103, eps = 1e-5).",
    ]
    table = ["", "| head | " + " | ".join(decs) + " |", "|---" * (1 + len(decs)) + "|"]
    for h in args.heads:
        paper = dict(zip(TABLE4.split(), PAPER_TABLE4.get(h, "").split(" | ")))
        cells = [f"{cell(cfg, runs[model, h], h, d, L)} ({paper.get(d, '-')})" for d in decs]
        table.append(f"| {paper_name(h)} | " + " | ".join(cells) + " |")
    if args.scale == "tiny":
        return lines + table + SMOKE
    if "softmax" not in args.heads:
        return lines + table
    out, apart = table4_calls(cfg, runs, args)
    # The paper's finding is a difference from VA+: with none measured, the table says so first.
    if apart == 0:
        lines.append(
            "- No learned ST+ / NMST+ cell differs from VA+'s at 5 %: the paper's finding (ST+ "
            "fails under nucleus sampling and beam search; NMST+ does not) is NOT shown here."
        )
    return lines + table + out


# Each decoder's learned ST+ / NMST+ cells against VA+'s (NMST+ one-sided: the paper's
# NMST+ below VA+).  -> (the lines, how many differ at 5 %).
def table4_calls(cfg, runs, args):
    model, out, apart = next(iter(cfg["models"])), [""], 0
    for d in cfg["decoders"]:
        free = [h for h in args.heads if h != "softmax" and not forced(cfg, h, d, cfg["L"])]
        values = {h: r_nt(runs[model, h], d, cfg["L"]) for h in ["softmax", *free]}
        text, pairs = calls(values, [("softmax", h) for h in free], TABLE4_CLAIMS)
        apart += len(pairs)
        nothing = "every ST+ / NMST+ cell is decided by Theorem 3: nothing to call"
        out.append(f"- {d}: {text or nothing}.")
    return out, apart


# --- CT Table 3 -------------------------------------------------------------------------------
def run_ct(args):
    seeds, limit, flags = CT[args.scale]
    limit = ["--limit", str(limit)] if limit else []
    plan = []
    # A run a (row, seed): the MoS rows differ by their constant temperature alone.
    for (label, head, tau, _), seed in itertools.product(CT_ROWS, range(args.seeds or seeds)):
        temperature = ["--temperature", tau] if tau else []
        argv = [*CT_MODEL.split(), *flags.split(), "--head", head, *temperature]
        plan.append((f"{head}{tau}-s{seed}", [*argv, "--seed", str(seed)], label))
    runs, ckpts = {}, train_all([p[:2] for p in plan], args)
    for k, (name, _, label) in enumerate(plan):
        print(f"[{k + 1}/{len(plan)}] evaluating {name}", flush=True)
        ppl = {}
        # Both splits: the paper's table gives the validation and the test perplexity.
        for split in ("valid", "test"):
            path = f"{args.out}/{name}-{split}.json"
            ppl[split] = evaluated(ckpts[name], ["--split", split, *limit], path, ["ppl"])["ppl"]
        runs.setdefault(label, []).append(ppl)
    lines = [
        f"CT Table 3 (scale {args.scale}): PTB, continuous LM, perplexity valid / test, "
        f"mean ± sample std (ddof 1) over n = {len(runs['CT'])} seed(s), differences by Welch's "
        f"t-test at 5 %.  Paper: AWD-LSTM-size models without finetuning.",
        *ct_verdict(runs, args),
        "",
        "| model | nanogen valid | nanogen test | paper valid / test |",
        "|---|---|---|---|",
    ]
    for label, _, _, paper in CT_ROWS:
        valid = mean_std([r["valid"] for r in runs[label]])
        test = mean_std([r["test"] for r in runs[label]])
        lines.append(f"| {label} | {valid} | {test} | {paper} |")
    return lines, runs


# The paper's claim (CT-MoS beats every constant-temperature MoS), one-sided: it holds where
# CT-MoS lies below every MoS at 5 %, and does not where a MoS lies below CT-MoS at 5 %.
def ct_verdict(runs, args):
    if args.scale == "tiny":
        return SMOKE[1:]
    valid = {label: [r["valid"] for r in runs[label]] for label in runs}
    ct, mos = valid["CT-MoS"], {label: valid[label] for label, h, _, _ in CT_ROWS if h == "mos"}
    pairs = [compared("CT-MoS", ct, label, v, 2, "less") for label, v in mos.items()]
    verdict = "is not resolvable at this scale (not every MoS lies above CT-MoS at 5 %)"
    if all(welch(ct, v, "less") < ALPHA for v in mos.values()):
        verdict = "holds at this scale"
    elif any(welch(ct, v, "greater") < ALPHA for v in mos.values()):
        verdict = "does NOT hold at this scale (a MoS lies below CT-MoS at 5 %)"
    # The lowest mean is said whatever the calls: it is the reader's first question.
    best = min(valid, key=lambda label: statistics.mean(valid[label]))
    return [
        f"- The paper's claim (CT-MoS beats every constant-temperature MoS) {verdict}; lowest "
        f"mean validation perplexity: {best}.",
        "- Validation: " + "; ".join(pairs) + ".",
    ]


# --- InsNet: storyline-constrained generation (Table 3) and Fig. 12 ---------------------------
def run_insnet(args):
    seeds, stories, flags = INSNET[args.scale]
    limit = ["--limit", str(stories)] if stories else []
    plan = []
    for model, seed in itertools.product(("insnet", "gpt"), range(args.seeds or seeds)):
        task = f"--model {model} --dataset rocstories --task storyline --seed {seed}"
        plan.append((f"{model}-s{seed}", [*task.split(), *flags.split()], model))
    runs, ckpts = {}, train_all([p[:2] for p in plan], args)
    study = ["--split", "test", "--decoder", "greedy", "--no_ppl", *limit]
    for k, (name, _, model) in enumerate(plan):
        print(f"[{k + 1}/{len(plan)}] generating the stories of {name}", flush=True)
        path = os.path.join(args.out, f"{name}-generation.json")
        res = evaluated(ckpts[name], study, path, ["generation", "repeating"])
        runs.setdefault(model, []).append(res["generation"])
    looping = {model: [100 * r["repeating"] for r in runs[model]] for model in runs}
    bleu4 = {model: [r["bleu"]["4"] for r in runs[model]] for model in runs}
    lines = [
        f"InsNet Table 3 (scale {args.scale}): ROCStories, golden storylines, greedy "
        f"decoding of {stories or 'all'} test stories, mean ± sample std (ddof 1) over "
        f"n = {len(runs['gpt'])} seed(s), differences by Welch's t-test at 5 %.",
        *insnet_findings(looping, bleu4),
        "",
        "| model | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | storyline inclusion | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, label, paper in INSNET_ROWS:
        g = runs[model]
        bleu = [mean_std([r["bleu"][str(n)] for r in g], 2) for n in range(1, 5)]
        inc = mean_std([100 * r["keyword_inclusion"] for r in g], 1)
        lines.append(f"| {label} | " + " | ".join(bleu) + f" | {inc} % | {paper} |")
    return lines + fig12(args), runs


# The InsNet table's first lines from each seed's share of looping stories (%) and BLEU-4 of
# both models ({"insnet": [...], "gpt": [...]}): what was measured, and whether the paper's
# comparison (InsNet above L2R: one-sided) can show in it.
def insnet_findings(looping, bleu4):
    bleu = compared("InsNet", bleu4["insnet"], "L2R", bleu4["gpt"], 2, "greater")
    lines = [
        f"- Stories that repeat a 4-gram (a decoder in a loop): InsNet "
        f"{mean_std(looping['insnet'])} %, L2R {mean_std(looping['gpt'])} %.",
        f"- BLEU-4: {bleu}.",
        "- InsNet's storyline inclusion is 100 % by construction (the keywords are canvas tokens), "
        "and its BLEU counts those given words too.",
    ]
    # The paper compares two trained generators; a model that loops in most stories is not one.
    if max(statistics.mean(looping[model]) for model in looping) > 50:
        lines.append(
            "- So the paper's comparison is NOT shown at this scale: a model loops in most "
            "stories, and the BLEU gap measures undertraining and the given keywords."
        )
    return lines


# Fig. 12: bench.py insnet's seconds per epoch by length, InsNet / IT-vanilla / L2R.
def fig12(args):
    dim, seqs, batch, it_batch, iters, lengths = FIG12[args.scale]
    flags = f"--gpt_layers 2 --gpt_dim {dim} --gpt_heads 4 --seqs {seqs} --batch {batch} "
    flags += f"--it_batch {it_batch} --iters {iters} --lengths {lengths}"
    flags = [*flags.split(), "--plot", os.path.join(args.out, "fig12.png")]
    bench_args = bench.parser().parse_args(["insnet", *flags])
    lines = bench.bench_insnet(bench_args, common.get_device("cpu"))
    return ["", f"Fig. 12 (python bench.py insnet {' '.join(flags)}):", "", "```", *lines, "```"]


# --- the command ------------------------------------------------------------------------------
def parser():
    p = common.Parser(
        description="Reproduce a paper result in one command: train (or reuse the runs), "
        "evaluate, write the paper's table beside nanogen's (docs/reproduce.md)."
    )
    p.add_argument("what", choices=[*RESULTS, "all"])
    p.add_argument("--scale", default="cpu", choices=["tiny", "cpu", "paper"])
    p.add_argument("--out", default=None, help="results folder (default results/NAME-SCALE)")
    p.add_argument("--runs", default=None, help="training runs (default OUT/runs)")
    heads = "nmst-table1 / nmst-table4: the heads compared (default softmax st nmst)"
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS_AVAILABLE, help=heads)
    models = "nmst-table1 / nmst-table4: some of the scale's models (default all: rnn lstm, gpt)"
    p.add_argument("--models", nargs="+", choices=["rnn", "lstm", "gpt"], help=models)
    p.add_argument("--seeds", type=common.INT1, help="seeds a row (default the scale's: 1, 3, 10)")
    jobs = "runs trained at once (default 1; on a GPU one a 24 GiB of its memory)"
    p.add_argument("--jobs", type=common.INT1, help=jobs)
    cap = "caps each run's training: a partial grid, said so (0: no cap; a capped run goes on)"
    p.add_argument("--max_minutes", type=common.NONNEG, help=cap)
    budget = "the table's training time, shared by its runs, each stopping at an epoch's end"
    p.add_argument("--budget_minutes", type=common.POS, help=budget)
    return p


# The flags' one-line errors, before any folder is made or any run trained.
def check_flags(args):
    # A GPU trains one run a 24 GiB of its memory at once by default, a CPU one.
    gib = torch.cuda.is_available() and torch.cuda.mem_get_info()[1] >> 30
    args.jobs = args.jobs or max(1, gib // 24)
    # One head twice would count one run as two seeds.
    if len(set(args.heads)) < len(args.heads):
        raise UserError("--heads names a head twice: give each head once")
    if args.heads != list(HEADS) and args.what in ("ct-table3", "insnet-storyline"):
        raise UserError(f"--heads is for nmst-table1 / nmst-table4 (and all), not {args.what}")
    if args.models and args.what not in ("nmst-table1", "nmst-table4"):
        raise UserError(f"--models is for nmst-table1 / nmst-table4, not {args.what}")
    known = nmst_settings(args.scale, int(args.what[-1]))["models"] if args.models else []
    if not set(args.models or []) <= set(known):
        raise UserError(f"--models: {args.what} at --scale {args.scale} trains {' '.join(known)}")
    # Both would set each run's cap, one over the other: the user says which.
    if args.budget_minutes and args.max_minutes is not None:
        raise UserError("give --budget_minutes (the table's) or --max_minutes (each run's)")


# One result: its folders checked and made (one line if they cannot be), its runs, its table
# and raw numbers written into args.out.
def reproduce_one(name, args):
    # The folders are checked and made before any training: a wrong --out costs nothing.
    check_output(args.out, "--out", folder=True)
    check_output(args.runs, "--runs", folder=True)
    try:
        os.makedirs(args.runs, exist_ok=True)
    except OSError as e:
        raise UserError(f"--runs {args.runs} cannot be made: {e.strerror or e}") from None
    t0 = time.time()
    if name.startswith("nmst"):
        lines, raw = run_nmst(int(name[-1]), args)
    elif name == "ct-table3":
        lines, raw = run_ct(args)
    else:
        lines, raw = run_insnet(args)
    minutes = (time.time() - t0) / 60
    note = f"({name}, scale {args.scale}: {minutes:.1f} min on this machine{cap_note(args)})"
    lines += ["", note]
    write_results(args.out, lines, dict(result=name, scale=args.scale, minutes=minutes, runs=raw))
    print("\n".join(lines) + f"\nwrote {os.path.join(args.out, 'table.md')} and results.json")


# The table's word on a cap: the runs it stopped before their end, named (partial until the
# same command, without the cap, trains them on).
def cap_note(args):
    if args.partial:
        return (
            f"; PARTIAL: {', '.join(args.partial)} stopped at the --max_minutes cap before their "
            f"end (without --max_minutes the same command trains them on)"
        )
    if args.max_minutes:
        return f"; each run capped at {args.max_minutes:g} min: none reached it"
    return ""


# results.json, then table.md, each whole or not at all (common.write_file: a full disk is
# one line, and no temporary file is left).
def write_results(out, lines, raw):
    # The raw numbers first: a table is never left without them.
    evaluate.write_json(os.path.join(out, "results.json"), raw)
    text = "\n".join(lines) + "\n"
    write_file(os.path.join(out, "table.md"), lambda f: f.write(text))


def main(argv=None):
    args = parser().parse_args(argv)
    check_flags(args)
    todo = RESULTS if args.what == "all" else (args.what,)
    base_out, base_runs = args.out, args.runs
    for name in todo:
        # One result given --out writes there; several, each into its own folder below it.
        args.out = os.path.join(base_out or "results", f"{name}-{args.scale}")
        if base_out and len(todo) == 1:
            args.out = base_out
        args.runs = base_runs or os.path.join(args.out, "runs")
        # The runs --max_minutes stopped (train_all's, shared by the copies of args a result makes)
        args.partial = []
        reproduce_one(name, args)
    return 0


if __name__ == "__main__":
    run(main)
