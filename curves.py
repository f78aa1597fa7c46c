"""Watch runs learn: a run's curves.png (train.py redraws it at every evaluation) and several runs
side by side, each labelled by the flags in which the runs differ.

    python curves.py out/ptb-lstm-softmax out/ptb-lstm-st out/ptb-lstm-nmst --out cmp.png

A run's figure: train and validation perplexity (log axis) and the learning rate against steps,
and the termination probe (NMST paper eq. 11: r_nt(L) of greedy continuations of fixed validation
contexts, and the mean p(eos) at the true end) when the run has one.
"""

import argparse
import importlib.util
import json
import math
import os

import numpy as np

from common import UserError, append_lines, check_output, pyplot, run, save_figure, write_file
from heads import EPSILON_HEADS, paper_name

# Where and how a run ran, not what it computed: never in a label.
NOT_LABELS = ("out_dir", "data_dir", "weights", "resume", "device", "dtype", "compile")
NOT_LABELS += ("peak_flops", "log_interval", "no_curves", "tensorboard")
# The numbers every record of a run's log holds (train.py writes them; a hand-edit may not).
NUMBERS = {
    "log.jsonl": ("step", "train_loss", "val_loss", "val_ppl", "lr"),
    "steps.jsonl": ("step", "loss"),
}
# ... and those of an evaluation that ran the termination probe.
PROBE = ("probe_r_nt", "probe_L", "probe_n", "eos_prob_at_end")
# The token of a run's vocabulary (--vocab; WikiText-103 is GPT-2's BPE).
UNITS = {"char": "character", "bpe": "BPE token"}


def read_log(path, step=math.inf):
    """The records of a run's .jsonl log up to `step`; a line torn by a crash is skipped, a record
    that is not as train.py writes it (a number missing or not a number) is an error."""
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


def check_record(record, need, where):
    """A log record: a JSON object whose `need` keys (and the probe's, if any) are numbers."""
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


def read_args(folder):
    """A run's args.json: its flags (a JSON object), or {} where there is none."""
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


def check_out_dir(out_dir, tensorboard=False, resume=False):
    """A run's folder, checked before anything is read (start_logs makes it): writable, and a
    fresh run never writes over another's checkpoints; --tensorboard: the package there."""
    if not resume and any(os.path.exists(f"{out_dir}/ckpt_{n}.pt") for n in ("last", "best")):
        raise UserError(
            f"{out_dir} already holds a run: continue it with --resume, or choose another --out_dir"
        )
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard")
    check_output(out_dir, "--out_dir", folder=True)  # (nothing written: start_logs makes it)


def start_logs(out_dir, args, step=0):
    """log.jsonl and steps.jsonl: a fresh run (step 0) starts them, a resumed one keeps their
    records up to its checkpoint's step; args.json: what the run is labelled by.  An interrupted
    write's temporary file is removed."""
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


def log_evaluation(out_dir, record, tensorboard=False, draw=True):
    """An evaluation's record: a line of log.jsonl, TensorBoard's scalars (--tensorboard), and
    curves.png drawn again."""
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


def ppl(loss):
    return math.exp(min(loss, 50))  # (a diverged run's 1e300 would overflow the log axis)


def draw_run(out_dir):
    """OUT_DIR/curves.png from the run's log.jsonl and steps.jsonl."""
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


def labels(runs):
    """What tells each run apart: the flags whose values differ between the runs (a head by the
    papers' name, as in every figure; eps only where a head has one), or its folder."""
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


def label_word(a, k, what):
    """The word of flag k in a run's label: a head by the papers' name, a value that stands alone,
    or k=value."""
    # (str: a hand-edited args.json may hold any JSON value)
    if k == "head":
        return paper_name(str(a[k]))
    if k in what:
        return str(a[k])
    return f"{k}={a.get(k)}"


def metric(a):
    """What a run's validation perplexity measures: its task's metric (completion: nanogen's, the
    continuations of lines of > 10 tokens, or --protocol authors' over every line) per token of
    its vocabulary, or per insertion event."""
    task, unit = a.get("task", "completion"), UNITS.get(a.get("vocab"), "word")
    whose = {"completion": "nanogen's", "stream": "the stream's"}.get(task, f"the {task}'s")
    if a.get("protocol") == "authors":
        whose = "the authors'"
    if a.get("dataset") == "wikitext103":
        unit = "BPE token"
    if task in ("story", "storyline") and a.get("model") != "gpt":
        unit = "insertion event"
    return f"{whose} metric, per {unit}"


def overlay(folders, path):
    """Runs side by side: validation perplexity and the probe's r_nt against steps, and a table
    of their best values.  -> the table's lines (the figure goes to `path`)."""
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
