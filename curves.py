"""Watch runs learn: one run's curves (train.py redraws RUN/curves.png at every evaluation) and
several runs side by side.

    python curves.py out/ptb-lstm-softmax out/ptb-lstm-st out/ptb-lstm-nmst --out cmp.png

A run's figure: train and validation perplexity (log axis) and the learning rate against steps,
and the termination probe (NMST paper eq. 11: r_nt(L) of greedy continuations of fixed
validation contexts, and the mean p(eos) at the true end) when the run has one.  Side by side:
validation perplexity and the probe's r_nt(L) of every run, each labelled by the flags in which
the runs differ, and a table of the best values.  Figures are written atomically; a figure that
cannot be written is one warning, never a failed run.
"""
import json
import math
import os
import sys
import types

import cli
from runs import read_run

LABEL_FLAGS = ("model", "head", "epsilon", "dataset", "vocab", "d_model", "n_layer", "lr",
               "dropout", "seed", "task", "order")  # first, in this order; then any other flag
NOT_LABELS = ("out_dir", "data_dir", "weights", "resume", "device", "dtype", "compile",
              "peak_flops", "log_interval", "no_curves", "tensorboard")  # where, not what


EVALUATION = ("step", "train_loss", "val_loss", "val_ppl", "lr")  # what every log.jsonl line has
PROBE = ("probe_r_nt", "probe_eos_at_end", "probe_L", "probe_n")  # and the probe's, when it ran


def has_numbers(record, keys):
    return all(isinstance(record.get(k), (int, float)) for k in keys)


def read_records(folder, name="log.jsonl", keys=EVALUATION):
    """A run's records (log.jsonl: its evaluations; steps.jsonl: its steps) that hold the numbers
    `keys` (a torn or damaged line is skipped)."""
    records = []
    try:
        with open(os.path.join(folder, name), errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and has_numbers(record, keys):
                    records.append(record)
    except OSError:
        pass
    return records


def read_steps(folder):
    """(step, loss) of every logged step."""
    return [(r["step"], r["loss"]) for r in read_records(folder, "steps.jsonl", ("step", "loss"))]


def read_args(folder):
    args = read_run(folder).get("args")
    return args if isinstance(args, dict) else {}


def ppl(loss):
    """exp(loss), drawn at most at e^50 (a diverged run's 1e300 would overflow the log axis)."""
    return math.exp(min(loss, 50.0))


def draw_run(folder, path=None):
    """RUN/curves.png from its logs; -> the path, or None (and one warning) when it could not
    be drawn or written."""
    path = path or os.path.join(folder, "curves.png")
    log = read_records(folder)
    plt = cli.pyplot(quiet=True)
    if not log or plt is None:
        return None
    probe = [r for r in log if has_numbers(r, PROBE)]
    fig, axes = plt.subplots(1, 3 if probe else 2, figsize=(12 if probe else 8.5, 3.4))
    steps = [r["step"] for r in log]
    every = read_steps(folder)
    if every:  # every step's training loss, as a running mean over 10 steps
        xs, ys = zip(*every)
        mean = [sum(ys[max(0, i - 9):i + 1]) / len(ys[max(0, i - 9):i + 1]) for i in range(len(ys))]
        axes[0].plot(xs, [ppl(v) for v in mean], "-", color="C0", alpha=0.35, lw=1,
                     label="train, per step (mean of 10)")
    axes[0].plot(steps, [ppl(r["train_loss"]) for r in log], "o-", label="train")
    axes[0].plot(steps, [ppl(r["val_loss"]) for r in log], "s-", label="validation")
    axes[0].set(yscale="log", xlabel="step", ylabel="perplexity (log axis)", title="perplexity")
    axes[0].legend(fontsize=8)
    axes[1].plot(steps, [r["lr"] for r in log], ".-", color="0.3")
    axes[1].set(xlabel="step", ylabel="learning rate", title="learning rate")
    if probe:
        L = probe[-1]["probe_L"]
        ps = [r["step"] for r in probe]
        axes[2].plot(ps, [r["probe_r_nt"] for r in probe], "o-", color="tab:red",
                     label=f"r_nt({L}), greedy")
        axes[2].plot(ps, [r["probe_eos_at_end"] for r in probe], "^-", color="tab:blue",
                     label="mean p(eos) at the true end")
        axes[2].set(xlabel="step", ylim=(-0.02, 1.02), title=f"termination probe "
                    f"({probe[-1]['probe_n']} contexts)")
        axes[2].legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(folder)), fontsize=9)
    return save(fig, path)


def save(fig, path):
    try:
        cli.save_figure(fig, path)
    except cli.UserError as e:
        print(f"warning: {e} (training goes on)", file=sys.stderr)
        return None
    return path


def differing(args_list):
    """The flags whose values differ between the runs that read them (what labels them: eps of
    ST / NMST runs, not the default a softmax run ignored)."""
    known = [(a, not_applying(a)) for a in args_list if a]  # (no readable run.json: its folder)
    rest = sorted({k for a, _ in known for k in a} - {*LABEL_FLAGS, *NOT_LABELS})
    keys = [k for k in (*LABEL_FLAGS, *rest)
            if len({repr(a.get(k)) for a, unused in known if k not in unused}) > 1]
    return keys or ["model"]


def label(args, keys, folder):
    """The words of LABEL_FLAGS stand alone (lstm, nmst); any other value names its flag (lr=0.003,
    seed=1, temperature=4, loss_scaling=True)."""
    def part(k, v):
        return v if isinstance(v, str) and k in LABEL_FLAGS else \
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
    unused = not_applying(args)
    return " ".join(part(k, args[k]) for k in keys if args.get(k) is not None and
                    k not in unused) or os.path.basename(os.path.abspath(folder))


def not_applying(args):
    """The flags a run ignored, which do not label it: recipes.APPLIES (--probe on a stream
    run, --n_head on an LSTM, eps outside the ST / NMST heads, ...)."""
    from recipes import APPLIES
    a = types.SimpleNamespace(**args)
    out = set()
    for k, applies in APPLIES:
        try:
            if not applies(a):
                out.add(k)
        except AttributeError:  # a run.json without that argument
            pass
    return out


def overlay(folders, path):
    """Several runs side by side (validation perplexity; the probe's r_nt) and a table of their
    best values.  -> (the table's lines, the figure's path or None)."""
    strays = [f for f in folders if not os.path.isdir(f)]
    if strays:
        raise cli.UserError(f"{strays[0]} is not a folder: give run folders (train.py's "
                            f"--out_dir)")
    runs = [(f, read_args(f), read_records(f)) for f in folders]
    missing = [f for f, _, log in runs if not log]
    if missing:
        raise cli.UserError(f"no evaluations logged in {', '.join(missing)} (a run folder of "
                            f"train.py holds log.jsonl)")
    keys = differing([a for _, a, _ in runs])
    rows = [f"| run ({', '.join(keys)}) | best val ppl | at step | last r_nt(L) | last p(eos) "
            f"at end |", "|---|---|---|---|---|"]
    plt = cli.pyplot(quiet=True)
    fig, axes = (None, None) if plt is None else plt.subplots(1, 2, figsize=(10, 3.6))
    names = [label(args, keys, folder) for folder, args, _ in runs]
    if len(set(names)) < len(names):  # runs alike in every flag: told apart by their folders
        names = [f"{n} ({os.path.normpath(f)})" for n, f in zip(names, folders)]
    for i, ((folder, args, log), name) in enumerate(zip(runs, names)):
        best = min(log, key=lambda r: r["val_loss"])
        probe = [r for r in log if has_numbers(r, PROBE)]
        rows.append(f"| {name} | {best['val_ppl']:.2f} | {best['step']} | "
                    + (f"{probe[-1]['probe_r_nt']:.3f} (L={probe[-1]['probe_L']}) | "
                       f"{probe[-1]['probe_eos_at_end']:.4f} |" if probe else "- | - |"))
        if axes is not None:
            style = dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[i % 4],
                         marker="os^D"[i % 4], fillstyle="none")  # (a run of one evaluation)
            axes[0].plot([r["step"] for r in log], [ppl(r["val_loss"]) for r in log], label=name,
                         **style)
            if probe:
                axes[1].plot([r["step"] for r in probe], [r["probe_r_nt"] for r in probe],
                             **style)
    if axes is None:
        return rows, None
    axes[0].set(yscale="log", xlabel="step", ylabel="validation perplexity (log axis)")
    L = next((r["probe_L"] for _, _, log in runs for r in log if has_numbers(r, PROBE)), "L")
    axes[1].set(xlabel="step", ylabel=f"r_nt({L}), greedy", ylim=(-0.02, 1.02),
                title="termination probe")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(0, 0),
               fontsize=8)  # one legend for both panels, below them (labels may be long)
    return rows, save(fig, path)


def main(argv=None):
    p = cli.CLIParser(description="Runs side by side: validation perplexity and the termination "
                                  "probe against steps, labelled by the flags that differ.")
    p.add_argument("runs", nargs="+", help="run folders of train.py (--out_dir)")
    p.add_argument("--out", default="curves.png", help="the PNG (default curves.png)")
    args = p.parse_args(argv)
    cli.check_output(args.out, "--out", inputs=args.runs, png=True)
    rows, path = overlay(args.runs, args.out)
    print("\n".join(rows))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
