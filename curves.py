"""Watch runs learn: a run's curves.png (train.py redraws it at every evaluation) and several runs
side by side, each labelled by the flags in which the runs differ.

    python curves.py out/ptb-lstm-softmax out/ptb-lstm-st out/ptb-lstm-nmst --out cmp.png

A run's figure: train and validation perplexity (log axis) and the learning rate against steps,
and the termination probe (NMST paper eq. 11: r_nt(L) of greedy continuations of fixed validation
contexts, and the mean p(eos) at the true end) when the run has one.
"""

import argparse
import importlib.util
import itertools
import json
import math
import os

import numpy as np

from common import (
    UserError,
    append_lines,
    check_output,
    pyplot,
    run,
    save_figure,
    world,
    write_file,
)
from heads import EPSILON_HEADS, paper_name
from model import MODELS

# The flags that say where and how a run ran, not what it computes: never in a label.
NOT_LABELS = "out_dir data_dir weights resume device dtype compile peak_flops log_interval".split()
NOT_LABELS += ["no_curves", "tensorboard"]
# The numbers every record of a run's log holds (train.py writes them; a hand-edit may not).
NUMBERS = {
    "log.jsonl": ("step", "train_loss", "val_loss", "val_ppl", "lr"),
    "steps.jsonl": ("step", "loss"),
}
# ... and those of an evaluation that ran the termination probe.
PROBE = ("probe_r_nt", "probe_L", "probe_n", "eos_prob_at_end")
# The token of a run's vocabulary (--vocab; WikiText-103 is GPT-2's BPE).
UNITS = {"char": "character", "bpe": "BPE token"}


# The records of a run's .jsonl log up to `step`; a line torn by a crash is skipped, a record
# that is not as train.py writes it (a number missing or not a number) is an error.
def read_log(path, step=math.inf):
    records = []
    if not os.path.exists(path):
        return records
    # (a log of another name, bench.py's say: its records need a step only)
    need = NUMBERS.get(os.path.basename(path), ("step",))
    # (undecodable bytes: a torn or garbled line, skipped)
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            # A kill mid-append tears the last line only, whose steps come after the last
            # checkpoint: a resumed run logs them again.  A record that is wrong was edited.
            try:
                record = json.loads(line)
            except ValueError:
                continue
            # (a line that is no record at all, a list or a string, is skipped as a torn one)
            if not isinstance(record, dict):
                continue
            check_record(record, need, f"{path} line {n}")
            if record["step"] <= step:
                records.append(record)
    return records


# A log record: a JSON object whose `need` keys (and the probe's, if any) are numbers.
def check_record(record, need, where):
    if "probe_r_nt" in record:
        need = need + PROBE
    for key in need:
        value = record.get(key)
        # (a step counts whole steps; a bool is an int to Python, but no number)
        kind = int if key == "step" else (int, float)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"{where}: {key} is {json.dumps(value)}, not a number: mend or remove it"
            )


# A run's args.json: its flags (a JSON object), or {} where there is none.
def read_args(folder):
    path = os.path.join(folder, "args.json")
    # (a run of an early version had none: it is labelled by its folder)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            args = json.load(f)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise UserError(
            f"{path} is no JSON object of the run's flags (cut short? edited?): remove it, and "
            f"the run is labelled by its folder"
        )
    return args


# A run's folder, checked before anything is read (start_logs makes it): writable, and a
# fresh run never writes over another's checkpoints; --tensorboard: the package there.
def check_out_dir(out_dir, tensorboard=False, resume=False):
    if not resume and any(os.path.exists(f"{out_dir}/ckpt_{n}.pt") for n in ("last", "best")):
        raise UserError(
            f"{out_dir} already holds a run: continue it with --resume, or choose another --out_dir"
        )
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard")
    check_output(out_dir, "--out_dir", folder=True)  # (nothing written: start_logs makes it)


# log.jsonl and steps.jsonl: a fresh run (step 0) starts them, a resumed one keeps their
# records up to its checkpoint's step; args.json: what the run is labelled by.  An interrupted
# write's temporary file is removed.
def start_logs(out_dir, args, step=0):
    os.makedirs(out_dir, exist_ok=True)
    # (common.write_file's temporaries, of a write a kill -9 interrupted; a file of yours that
    # ends in .tmp is not one of them)
    for name in os.listdir(out_dir):
        if name.endswith((".pt.tmp", ".png.tmp", ".json.tmp", ".jsonl.tmp")):
            os.remove(os.path.join(out_dir, name))
    # The records after the checkpoint's step are the ones the resumed run logs again.
    for name in ("log.jsonl", "steps.jsonl"):
        kept = read_log(os.path.join(out_dir, name), step) if step else []
        lines = [json.dumps(r) + "\n" for r in kept]
        write_file(os.path.join(out_dir, name), lambda f: f.writelines(lines))
    write_file(os.path.join(out_dir, "args.json"), lambda f: json.dump(args, f))


def append(path, *records):  # records added to a log, each a line (all, or none and an error)
    append_lines(path, [json.dumps(r) + "\n" for r in records])


# An evaluation's record: a line of log.jsonl, TensorBoard's scalars (--tensorboard), and
# curves.png drawn again.
def log_evaluation(out_dir, record, tensorboard=False, draw=True):
    append(os.path.join(out_dir, "log.jsonl"), record)
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(os.path.join(out_dir, "tensorboard")) as w:
            # (numbers only: a flag such as best, or mfu's None, is no scalar)
            for k, v in record.items():
                if type(v) in (int, float):
                    w.add_scalar(k, v, record["step"])
    if draw:
        draw_run(out_dir)


# ----- what a run prints: its first line, how it ended --------------------
# The run's first line: what trains on what, its size, where (resumed_at: a step, or None).
def run_line(args, model, data, device, ctx, resumed_at):
    what = args.head if args.model in MODELS else args.task
    line = (
        f"{args.model} + {what} on {args.dataset}: {model.num_params():,} parameters, "
        f"V={data['vocab_size']:,}, {device}"
    )
    if hasattr(ctx, "fast_dtype"):
        line += f", {str(ctx.fast_dtype)[6:]} autocast"
    if resumed_at is not None:
        line += f", resuming at step {resumed_at}"
    if data.get("note"):
        line += f"; {data['note']}"
    return line


# The run's last line: stopped by a signal short of its end, or done, and why.
def say_how_it_ended(args, st, stop, why):
    if world()[0] != 0:
        return
    if stop and not why:
        print(
            f"stopped by {stop} after step {st.step}; {args.out_dir}/ckpt_last.pt written: "
            f"the same command with --resume goes on"
        )
        return
    ppl = math.exp(min(st.best_val, 700))
    print(
        f"done ({why}) after {st.step} steps; best validation loss {st.best_val:.4f} (ppl "
        f"{ppl:.2f}); checkpoints in {args.out_dir}"
    )


def ppl(loss):
    return math.exp(min(loss, 50))  # (a diverged run's 1e300 would overflow the log axis)


# OUT_DIR/curves.png from the run's log.jsonl and steps.jsonl.
def draw_run(out_dir):
    plt, log = pyplot(), read_log(os.path.join(out_dir, "log.jsonl"))
    if not log:
        return
    # A third panel for the probe, when the run ran it.
    probe = [r for r in log if "probe_r_nt" in r]
    fig, ax = plt.subplots(1, 3 if probe else 2, figsize=(12 if probe else 8.5, 3.4))
    steps = read_log(os.path.join(out_dir, "steps.jsonl"))
    # Every step's loss, as a running mean of 10.
    ys = [r["loss"] for r in steps]
    mean = [ppl(np.mean(ys[max(0, i - 9) : i + 1])) for i in range(len(ys))]
    ax[0].plot([r["step"] for r in steps], mean, alpha=0.35, lw=1, label="each step")
    for key, style, label in (("train_loss", "o-", "train"), ("val_loss", "s-", "validation")):
        ax[0].plot([r["step"] for r in log], [ppl(r[key]) for r in log], style, label=label)
    ax[0].set(yscale="log", xlabel="step", title="perplexity")
    ax[1].plot([r["step"] for r in log], [r["lr"] for r in log], ".-", color="0.3")
    ax[1].set(xlabel="step", title="learning rate")
    if probe:
        at, L, n = [r["step"] for r in probe], probe[-1]["probe_L"], probe[-1]["probe_n"]
        ax[2].plot(
            at, [r["probe_r_nt"] for r in probe], "o-", c="tab:red", label=f"r_nt({L}), greedy"
        )
        end = [r["eos_prob_at_end"] for r in probe]
        ax[2].plot(at, end, "^-", c="tab:blue", label="mean p(eos) at the true end")
        ax[2].set(xlabel="step", ylim=(-0.02, 1.02), title=f"termination probe ({n} contexts)")
    # (the learning rate's panel has one line: no legend)
    for a in ax[::2]:
        a.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(out_dir)), fontsize=9)
    save_figure(fig, os.path.join(out_dir, "curves.png"))


# What tells each run apart: the flags whose values differ between the runs (a head by the
# papers' name, as in every figure; eps only where a head has one), or its folder.
def labels(runs):
    args = [a for a, _ in runs]

    # A softmax run's --epsilon is a default it never reads: no label of it.
    def reads(a, k):
        return k != "epsilon" or a.get("head") in EPSILON_HEADS

    # These flags' values stand alone in a label, and come first.
    what = ("model", "head", "dataset", "task")
    flags = sorted({k for a in args for k in a} - set(NOT_LABELS), key=lambda k: (k not in what, k))
    keys = [k for k in flags if len({json.dumps(a.get(k)) for a in args if reads(a, k)}) > 1]
    # (runs alike in every flag are at least named by their head)
    keys = keys or ["head"]
    names = []
    for a, folder in runs:
        words = [label_word(a, k, what) for k in keys if k in a and reads(a, k)]
        names.append(" ".join(words) or os.path.basename(os.path.normpath(folder)))
    if len(set(names)) < len(names):  # alike in every flag: told apart by their folders
        names = [f"{n} ({os.path.normpath(f)})" for n, (_, f) in zip(names, runs)]
    return names


# The word of flag k in a run's label: a head by the papers' name, a value that stands alone,
# or k=value.
def label_word(a, k, what):
    # (str: a hand-edited args.json may hold any JSON value)
    if k == "head":
        return paper_name(str(a[k]))
    if k in what:
        return str(a[k])
    return f"{k}={a.get(k)}"


# What a run's validation perplexity measures: its task's metric (completion: nanogen's, the
# continuations of lines of > 10 tokens, or --protocol authors' over every line) per token of
# its vocabulary, or per insertion event.
def metric(a):
    task, unit = a.get("task", "completion"), UNITS.get(a.get("vocab"), "word")
    whose = {"completion": "nanogen's", "stream": "the stream's"}.get(task, f"the {task}'s")
    if a.get("protocol") == "authors":
        whose = "the authors'"
    if a.get("dataset") == "wikitext103":
        unit = "BPE token"
    if task in ("story", "storyline") and a.get("model") != "gpt":
        unit = "insertion event"
    return f"{whose} metric, per {unit}"


# Runs side by side: validation perplexity and the probe's r_nt against steps, and a table
# of their best values.  -> the table's lines (the figure goes to `path`).
def overlay(folders, path):
    runs, logs = [], []
    for folder in folders:
        log = read_log(os.path.join(folder, "log.jsonl"))
        if not log:
            raise UserError(
                f"no evaluations logged in {folder} (a run folder of train.py holds log.jsonl)"
            )
        runs.append((read_args(folder), folder))
        logs.append(log)
    # The flags that differ may not say it: --vocab char is named "vocab=char", not "per
    # character", and the protocol's metric is not named by its flag at all.
    names, plt, metrics = labels(runs), pyplot(), [metric(a) for a, _ in runs]
    if len(set(metrics)) > 1:
        # Perplexities under different metrics do not compare: each run names its own.
        names = [f"{n} [{m}]" for n, m in zip(names, metrics)]
    rows = [
        "| run | best val ppl | at step | last r_nt(L) | last p(eos) at end |",
        "|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (name, log) in enumerate(zip(names, logs)):
        # The best evaluation is the one ckpt_best.pt holds; the probe's last is the latest.
        best, probe = min(log, key=lambda r: r["val_loss"]), [r for r in log if "probe_r_nt" in r]
        last = "- | - |"
        if probe:
            last = f"{probe[-1]['probe_r_nt']:.3f} (L={probe[-1]['probe_L']}) | "
            last += f"{probe[-1]['eos_prob_at_end']:.4f} |"
        rows.append(f"| {name} | {best['val_ppl']:.2f} | {best['step']} | {last}")
        # Line styles and markers as well as colours: the figure reads in grey print too.
        lines = ("-", "--", ":", "-.")[i % 4]
        style = dict(color=f"C{i}", linestyle=lines, marker="o^sD"[i % 4], fillstyle="none")
        ax[0].plot([r["step"] for r in log], [ppl(r["val_loss"]) for r in log], label=name, **style)
        ax[1].plot([r["step"] for r in probe], [r["probe_r_nt"] for r in probe], **style)
    ax[0].set(yscale="log", xlabel="step", ylabel="validation perplexity")
    ax[1].set(xlabel="step", ylabel="r_nt(L), greedy", ylim=(-0.02, 1.02), title="the probe")
    handles = ax[0].get_legend_handles_labels()
    fig.legend(*handles, loc="upper left", bbox_to_anchor=(0, 0), fontsize=8)
    save_figure(fig, path)
    return rows


# ----- the decoding studies of evaluate.py: their table and figures ---------------------------
# A study's decoder in a few characters: greedy, topk-10, nucleus-0.9+c, beam-4/lp1, ...
def decoder_name(d):
    name = d["decoder"]
    # The value that makes the decoder what it is: k, p or the beam's size.
    extra = dict(topk=f"-{d.get('k')}", nucleus=f"-{d.get('p')}", beam=f"-{d.get('beam_size')}")
    name += extra.get(d["decoder"], "")
    if d.get("consistent"):
        name += "+c"
    if d.get("length_penalty"):
        name += f"/lp{d['length_penalty']:g}"
    t = d.get("temperature") or 1
    if t != 1:
        name += f"/T{t:g}"
    return name


# A row a study: r_nt(L) for every L, the mean length, unique non-terminated (eps only for
# the heads that read it).
def print_study_table(results):
    # A column for every L of any study (a study without it shows nan).
    Ls = sorted({int(L) for r in results for L in r["decoding"]["r_nt"]})
    r_nt_columns = " ".join(f"{'r_nt(%d)' % L:>11s}" for L in Ls)
    print(
        f"{'model':5s} {'head':8s} {'eps':>7s} {'decoder':12s} {r_nt_columns} "
        f"{'mean len':>9s} {'uniq non-term':>13s} {'n':>6s}"
    )
    for r in results:
        d, eps = r["decoding"], "-"
        if r["head"] in EPSILON_HEADS:
            eps = f"{r['epsilon']:.0e}"
        r_nt = {int(L): v for L, v in d["r_nt"].items()}
        values = " ".join(f"{r_nt.get(L, math.nan):11.4f}" for L in Ls)
        print(
            f"{r['model']:5s} {r['head']:8s} {eps:>7s} {decoder_name(d):12s} {values} "
            f"{d['mean_length']:9.1f} {d['unique_non_terminated'] or math.nan:13.3f} {d['n']:6d}"
        )


# r_nt(L) (log-log, Fig. 2 / 7), the length histograms (Fig. 8) and p(eos) traces (Fig. 3)
# into out_dir, the runs labelled by what differs between them.
def plot_study(results, out_dir, files=None):
    names, title = study_labels(results, files)
    os.makedirs(out_dir, exist_ok=True)
    # One function a figure; p(eos) traces only where a study kept them.
    paths = [os.path.join(out_dir, "r_nt.png"), os.path.join(out_dir, "lengths.png")]
    save_figure(study_r_nt_figure(results, names, title), paths[0])
    save_figure(lengths_figure(results, names), paths[1])
    fig = eos_figure(results, names)
    if fig:
        paths.append(os.path.join(out_dir, "p_eos.png"))
        save_figure(fig, paths[-1])
    print(f"wrote {', '.join(paths)}")


# -> (each study's label: what differs between them (head, eps, model, decoder, dataset),
# the title: what they share).
def study_labels(results, files):
    parts = []
    for r in results:
        eps = ""
        if r["head"] in EPSILON_HEADS:
            eps = f"eps={r['epsilon']:g}"
        decoder = decoder_name(r["decoding"])
        part = dict(head=paper_name(r["head"]), eps=eps, model=r["model"], decoder=decoder)
        parts.append(dict(part, dataset=r["dataset"]))
    # A label says what differs; what all share goes to the title.
    varying = [k for k in parts[0] if len({p[k] for p in parts}) > 1] or ["head"]
    names = [" ".join(p[k] for k in varying if p[k]) for p in parts]
    # Two files of one run: told apart by their file names.
    if len(set(names)) < len(names) and files:
        names = [f"{x} ({os.path.basename(f)})" for x, f in zip(names, files)]
    title = ", ".join(parts[0][k] for k in ("decoder", "dataset", "model") if k not in varying)
    return names, title


# The i-th study's colour and dash, the same in every figure (grey print tells them apart).
def study_style(i):
    return dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[i % 4])


# r_nt(L) against L, log-log (NMST Fig. 2, 7); 0 is drawn at 1e-4.
def study_r_nt_figure(results, names, title):
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    for i, (r, name) in enumerate(zip(results, names)):
        curve = r["decoding"]["r_nt_curve"]
        # r_nt = 0 has no place on a log axis: it is drawn at the 1e-4 floor.
        xs, ys = [int(x) for x in curve], [max(y, 1e-4) for y in curve.values()]
        ax.plot(xs, ys, label=name, **study_style(i))
    if title:
        title = f" ({title})"
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="r_nt(L)  (0 drawn at 1e-4)")
    ax.set(title="non-termination ratio" + title)
    ax.legend(fontsize=8)
    return fig


# The continuations' lengths against the true ones (NMST Fig. 8); a non-terminated one is
# drawn at its study's L.
def lengths_figure(results, names):
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    # Each study's L: where its non-terminated continuations were cut.
    cut = [max(int(L) for L in r["decoding"]["r_nt"]) for r in results]
    bins = np.linspace(0, max(cut) + 1, 41).tolist()
    truth = [min(m, max(cut)) for m in results[0]["decoding"]["ground_truth_lengths"]]
    ax.hist(truth, bins=bins, alpha=0.4, color="gray", label="ground truth")
    for i, (r, name, L) in enumerate(zip(results, names, cut)):
        lengths = r["decoding"]["generated_lengths"]
        n_cut = sum(m is None for m in lengths)
        if n_cut:
            name = f"{name} ({n_cut} non-terminated, drawn at L={L})"
        drawn = [L if m is None else m for m in lengths]
        ax.hist(drawn, bins=bins, histtype="step", color=study_style(i)["color"], label=name)
    ax.set(xlabel="continuation length", ylabel="count", yscale="log")
    ax.legend(fontsize=8)
    return fig


# p(eos) along the first three traced true continuations (NMST Fig. 3), or None.
def eos_figure(results, names):
    traced = [{t["index"]: t["p_eos"] for t in r.get("eos_traces") or []} for r in results]
    # The sequences the first study traced (a window model may skip long ones).
    shown = next((list(t)[:3] for t in traced if t), [])
    if not shown:
        return None
    fig, ax = pyplot().subplots(len(shown), 1, figsize=(7, 6), squeeze=False)
    for i, name in enumerate(names):
        for axis, index in zip(ax[:, 0], shown):
            if index in traced[i]:
                p_eos = traced[i][index]
                axis.plot(range(1, len(p_eos) + 1), p_eos, label=name, **study_style(i))
                axis.set(yscale="log", ylabel="p(eos)", title=f"sequence {index}")
    ax[0, 0].legend(fontsize=8)
    return fig


# The contextual temperature of the next word by position in the sentence (CT Fig. 1).
def tau_figure(rep, path):
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    ax.errorbar(range(15), rep["position_mean"], yerr=rep["position_ci95"], fmt="o-", capsize=3)
    ax.set_xticks(range(15), rep["positions"], rotation=60, fontsize=7)
    ax.set(
        ylabel="tau of the next word",
        title=f"contextual temperature by position ({rep['sentences']} sentences)",
    )
    save_figure(fig, path)


# --- the figures of reproduce.py's tables and bench.py insnet's Fig. 12 -----------------------
# NMST Fig. 2 / 7 (Table 4: the same per decoder): r_nt(L) against L (log-log), a panel per
# model and decoder, a curve per head.  runs: {(model, head): [each seed's results]}; half:
# t_1/2, drawn where the axis reaches it (Theorem 3: past it every ST / NMST greedy, top-k or
# nucleus continuation has ended).
def r_nt_figure(runs, heads, decoders, half, path):
    models = list(dict.fromkeys(m for m, _ in runs))
    rows, cols = len(models), len(decoders)
    fig, axes = pyplot().subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    panels = itertools.product(enumerate(models), enumerate(decoders), enumerate(heads))
    for (i, m), (j, d), (k, h) in panels:
        per_seed = [r[d]["decoding"]["r_nt_curve"] for r in runs[m, h]]
        r_nt_curve(axes[i, j], per_seed, k, paper_name(h))
        axes[i, j].set(xscale="log", yscale="log", ylim=(8e-4, 1.2), title=f"{m.upper()}, {d}")
    for ax in axes[-1]:
        ax.set_xlabel("L")
    for ax in axes[:, 0]:
        ax.set_ylabel("r_nt(L)  (0 drawn at 1e-3)")
    # After every curve: only then does an axis reach its full range, where t_1/2 may lie.
    for ax in axes.flat:
        if half <= ax.get_xlim()[1]:
            ax.axvline(half, color="grey", linewidth=0.8, linestyle=":", label="t_1/2")
    axes[0, 0].legend(fontsize=7)
    save_figure(fig, path)


# The k-th head's r_nt(L): the seeds' mean, their std as a band.  r_nt = 0 cannot be drawn on
# a log axis: it is drawn at the 1e-3 floor, and markers tell apart heads that share a curve.
def r_nt_curve(ax, per_seed, k, label):
    Ls = sorted(int(L) for L in per_seed[0])
    ys = np.maximum([[c[str(L)] for c in per_seed] for L in Ls], 1e-3)  # (L, seeds)
    # One seed has no spread: its band has no width.
    mean, sd = ys.mean(1), np.zeros(len(Ls))
    if len(per_seed) > 1:
        sd = ys.std(1, ddof=1)
    style = dict(color=f"C{k}", marker="o^sD"[k % 4], markersize=max(5 - k, 2), fillstyle="none")
    ax.plot(Ls, mean, ("-", "--", ":", "-.")[k % 4], label=label, **style)
    ax.fill_between(Ls, np.maximum(mean - sd, 1e-3), mean + sd, color=f"C{k}", alpha=0.15)


# Each model's heads over training (overlay: validation perplexity and the probe's r_nt
# against steps, seed 0 of each head, from the folder runs into out/training-MODEL.png): the
# table's lines.  seqs: the validation sequences the runs' own evaluations score.
def over_training(models, heads, runs, out, seqs, eps):
    lines = []
    # Seed 0 of each head: a curve a head keeps the figure readable.
    for m in models:
        folders = [os.path.join(runs, f"{m}-{h}-s0") for h in heads]
        lines += [
            "",
            f"Over training ({m}, seed 0; training-{m}.png): the runs' own evaluations "
            f"(perplexity on {seqs} validation sequences); the probe greedy-decodes 64 validation "
            f"contexts to L = 200 at each evaluation (ST / NMST may pass it: t½ = ln 2/eps = "
            f"{math.log(2) / eps:.0f}).",
            "",
            *overlay(folders, os.path.join(out, f"training-{m}.png")),
        ]
    return lines


# InsNet Fig. 12: seconds per training epoch against the sequence length (log), InsNet /
# IT-vanilla / L2R.  rows: (length, InsNet's, IT-vanilla's, L2R's seconds).
def epoch_times(rows, title, path):
    fig, ax = pyplot().subplots(figsize=(5, 3.5))
    for col, label in ((1, "InsNet"), (2, "IT-vanilla"), (3, "L2R")):
        ax.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=label)
    ax.set(xlabel="sequence length", ylabel="seconds per epoch", yscale="log", title=title)
    ax.legend()
    save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description="Runs side by side, labelled by the flags that differ.")
    p.add_argument("runs", nargs="+", help="run folders of train.py (--out_dir)")
    p.add_argument("--out", default="curves.png", help="the PNG (default curves.png)")
    args = p.parse_args(argv)
    # (a name ending .png is never a checkpoint, a log or any other input)
    if not args.out.endswith(".png"):
        raise UserError(f"--out {args.out}: the figure is a PNG: name it .png")
    check_output(args.out, "--out")
    print("\n".join(overlay(args.runs, args.out)))


if __name__ == "__main__":
    run(main)
