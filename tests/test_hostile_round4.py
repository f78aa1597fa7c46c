"""Hostile inputs, fourth pass, one mechanism per class: a full disk mid-write (every file a
command writes goes through common.write_file, every log line through common.append_lines),
output paths that are no regular file, a run folder held by one run at a time, data preparation
stopped midway, readers of a run's files given damaged ones; and the smaller cases (a large story
seed, control tokens and bytes that are not UTF-8 in your text, runs under two metrics side by
side, --compile without a C++ compiler, a line too long for the window)."""

import argparse
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

import common
import curves
import data.prepare as P
import evaluate
import train
from conftest import ROOT, TINY_LSTM, assert_one_line_error, run_in_process
from data.loader import epoch_batches
from data.stories import read_stories

TINY = TINY_LSTM + ["--max_iters", "2", "--eval_interval", "2", "--probe", "0", "--no_curves"]
slow = pytest.mark.slow


@pytest.fixture
def tmpfs(tmp_path):
    """A real small disk, to fill up: mount(size) -> a fresh tmpfs of that size (root only; the
    test is skipped where none can be mounted), unmounted after the test."""
    mounted = []

    def mount(size):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        try:
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"cannot mount a tmpfs here ({e})")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:120]})")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(disk):
    """Fill the disk up to its last byte (a file `filler`)."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def own_text(folder, lines=40):
    """A folder of your own text: train.txt of `lines` lines of 15 words."""
    folder.mkdir()
    words = [" ".join(f"w{(i * j) % 30}" for j in range(15)) for i in range(lines)]
    (folder / "train.txt").write_text("\n".join(words) + "\n")
    return folder


# --- a full disk: one line, the previous file intact, no temporary left ------------------------
@slow
def test_a_disk_with_room_for_one_checkpoint_but_not_two(lstm_run, tmpfs, capsys):
    """The first evaluation writes ckpt_best.pt, then its copy ckpt_last.pt, which does not fit:
    one line naming it, no temporary left, ckpt_best.pt whole."""
    size = os.path.getsize(lstm_run / "ckpt_best.pt")
    out = tmpfs(f"{3 * size // 2 // 1024 + 64}k") / "run"
    rc, err = run_in_process(train.main, TINY + ["--out_dir", str(out)], capsys)
    assert_one_line_error(rc, err, f"could not write {out}/ckpt_last.pt: No space left on device")
    assert "(the previous checkpoint, if any, is intact)" in err
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert common.load_checkpoint(str(out / "ckpt_best.pt"))["state"]["step"] == 2


def test_a_full_disk_while_a_log_is_appended(tmpfs):
    """steps.jsonl appended on a full disk (the records' first bytes still fit in the file's last
    page): one line, and the log as it was, no torn line."""
    path = tmpfs("64k") / "steps.jsonl"
    curves.append(str(path), *[dict(step=i, loss=1.0, lr=1e-3) for i in range(1, 11)])
    before = path.read_bytes()
    fill(path.parent)
    more = [dict(step=i, loss=1.0, lr=1e-3) for i in range(11, 2000)]
    with pytest.raises(
        common.UserError, match="No space left on device .its earlier lines are kept"
    ):
        curves.append(str(path), *more)
    assert path.read_bytes() == before
    assert [r["step"] for r in curves.read_log(str(path))] == list(range(1, 11))


def test_results_and_figures_on_a_full_disk(tmpfs, capsys):
    """evaluate.py / reproduce.py's JSON (write_json): one line, the old file intact; a figure:
    a warning; no temporary left by either."""
    disk = tmpfs("64k")
    res = disk / "res.json"
    evaluate.write_json(str(res), {"old": 1})
    fill(disk)
    with pytest.raises(common.UserError, match=f"could not write {res}: No space left on device"):
        evaluate.write_json(str(res), {"new": list(range(100_000))})
    fig, ax = common.pyplot().subplots()
    ax.plot(range(1000), [i**0.5 for i in range(1000)])
    curves.save_figure(fig, str(disk / "fig.png"))
    assert f"warning: could not write {disk}/fig.png: No space" in capsys.readouterr().err
    assert json.loads(res.read_text()) == {"old": 1}
    assert sorted(os.listdir(disk)) == ["filler", "res.json"]


def test_write_file_removes_its_temporary_on_any_error(tmp_path, monkeypatch):
    """An error that is not the disk's (a bug, Ctrl-C) keeps its kind, and the temporary goes;
    a failed fsync (the disk's last word) is one line."""
    path = tmp_path / "x.json"
    for error in (ValueError("a bug"), KeyboardInterrupt()):

        def write(f, error=error):
            f.write("half")
            raise error

        with pytest.raises(type(error)):
            common.write_file(str(path), write)

    def no_room(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_room)
    with pytest.raises(common.UserError, match=f"could not write {path}: No space"):
        common.write_file(str(path), lambda f: f.write("{}"))
    assert os.listdir(tmp_path) == []


# --- output paths: a regular file or nothing -------------------------------------------------
@slow
def test_outputs_that_are_no_regular_file_are_refused(lstm_run, tmp_path, capsys):
    """evaluate.py --out naming a FIFO, a link or a device node (a copy of /dev/null, made here:
    the system's own is never put at risk): one line, each left as it was."""
    fifo, link, target = tmp_path / "fifo", tmp_path / "link.json", tmp_path / "target.json"
    os.mkfifo(fifo)
    target.write_text("{}")
    link.symlink_to(target)
    paths = [fifo, link]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        paths.append(tmp_path / "null")
    ckpt = ["--ckpt", str(lstm_run / "ckpt_best.pt"), "--limit", "2"]
    for path in paths:
        rc, err = run_in_process(evaluate.main, ckpt + ["--out", str(path)], capsys)
        assert_one_line_error(rc, err, f"cannot write to --out {path}: it is not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link)
    assert target.read_text() == "{}"
    if os.geteuid() == 0:
        assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


# --- a run holds its folder ------------------------------------------------------------------
@slow
def test_a_run_folder_is_held_by_one_run_at_a_time(tmp_path, capsys):
    """A second train.py into the folder of a running one is refused in one line (the first's
    log untouched); after a kill -9 of the first, no stale lock: the folder is free."""
    out = tmp_path / "run"
    flags = TINY_LSTM + ["--max_iters", "100000", "--eval_interval", "100000", "--probe", "0"]
    first = subprocess.Popen(
        [sys.executable, "train.py", *flags, "--log_interval", "1", "--out_dir", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while not (out / "steps.jsonl").exists() or not (out / "steps.jsonl").stat().st_size:
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        rc, err = run_in_process(train.main, TINY + ["--out_dir", str(out)], capsys)
        assert_one_line_error(rc, err, f"another run is writing into {out}: wait for it to end")
        assert (out / "steps.jsonl").stat().st_size and not (out / "ckpt_last.pt").exists()
    finally:
        first.kill()
        first.wait()
    train.main(TINY + ["--out_dir", str(out)])
    assert common.load_checkpoint(str(out / "ckpt_last.pt"))["state"]["step"] == 2


# --- data preparation stopped midway ---------------------------------------------------------
SLOW_PREPARE = """
import sys, time
sys.path.insert(0, {root!r})
import common, data.prepare as P
real = P.write_split
def slow(lines, tok, split, *rest):
    counts = real(lines, tok, split, *rest)
    print("wrote", split, flush=True)
    time.sleep(120)
    return counts
P.write_split = slow
common.run(lambda: P.main(["--dataset", "text", "--data_dir", {text!r}]))
"""


def start_preparing(tmp_path):
    """python data/prepare.py on your own text, paused after its train split is written: -> the
    process, and the folder of the prepared data (its half-built folder is in there now)."""
    text = own_text(tmp_path / "text")
    script = SLOW_PREPARE.format(root=ROOT, text=str(text))
    env = dict(os.environ, NANOGEN_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdout.readline() == b"wrote train\n"
    prepared = tmp_path / "cache" / "prepared"
    half = [n for n in os.listdir(prepared) if n.startswith(".")]
    assert len(half) == 1 and os.path.exists(prepared / half[0] / "train.bin")
    return p, prepared


@slow
@pytest.mark.parametrize("sig, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_preparation_stopped_midway_leaves_nothing_half_built(sig, name, tmp_path):
    """A real SIGTERM (a scheduler's) or SIGINT (Ctrl-C) midway: one line, 128 + the signal, and
    nothing left in the prepared data's folder."""
    p, prepared = start_preparing(tmp_path)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig and err.decode().strip() == f"error: interrupted ({name})"
    assert os.listdir(prepared) == []


@slow
def test_a_killed_preparations_leftover_is_removed_by_the_next(tmp_path, monkeypatch):
    """kill -9 midway leaves a temporary folder, never read: the next preparation removes it,
    unless another process is preparing (holding the lock), whose folder it may be."""
    p, prepared = start_preparing(tmp_path)
    p.kill()
    p.wait()
    leftover = [n for n in os.listdir(prepared) if n.startswith(".")]
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    with open(f"{prepared}.lock") as other:
        fcntl.flock(other, fcntl.LOCK_SH)
        P.remove_leftovers(str(prepared))
        assert [n for n in os.listdir(prepared) if n.startswith(".")] == leftover
    folder = P.prepare("text", str(tmp_path / "text"), verbose=False)
    assert os.listdir(prepared) == [os.path.basename(folder)]


# --- readers of a run's files: one line on what is wrong -------------------------------------
@slow
def test_curves_on_damaged_run_files(lstm_run, tmp_path, capsys):
    """args.json cut short or a list, log.jsonl records hand-damaged (a missing key, a string
    step, a null loss): one line each, naming the file (and line) and what to do."""
    record = json.loads((lstm_run / "log.jsonl").read_text().splitlines()[0])
    no_lr = {k: v for k, v in record.items() if k != "lr"}
    cases = [
        ("args.json", '{"model": "lstm", "he', "args.json is no JSON object of the run's flags"),
        ("args.json", '["lstm", "nmst"]', "args.json is no JSON object of the run's flags"),
        ("log.jsonl", json.dumps(no_lr), "log.jsonl line 1: lr is null, not a number"),
        ("log.jsonl", json.dumps(dict(record, step="2")), 'line 1: step is "2", not a number'),
        ("log.jsonl", json.dumps(dict(record, val_loss=None)), "line 1: val_loss is null, not a"),
    ]
    for i, (name, text, msg) in enumerate(cases):
        run = tmp_path / f"run{i}"
        shutil.copytree(lstm_run, run)
        (run / name).write_text(text + "\n")
        rc, err = run_in_process(curves.main, [str(run), "--out", str(tmp_path / "c.png")], capsys)
        assert_one_line_error(rc, err, msg)
        assert "mend or remove it" in err or "remove it, and the run is labelled" in err


@slow
def test_resume_checks_the_checkpoints_args(lstm_run, tmp_path, capsys):
    """A checkpoint whose args hold a value no flag takes (a list) or a key of the wrong type:
    --resume (and evaluate.py) say so in one line."""
    out = tmp_path / "run"
    shutil.copytree(lstm_run, out)
    ckpt = torch.load(out / "ckpt_last.pt", weights_only=True)
    for damage, msg in (({"grad_clip": [1.0]}, "grad_clip = [1.0]"), ({"model": 5}, "model = 5")):
        torch.save(dict(ckpt, args={**ckpt["args"], **damage}), out / "ckpt_last.pt")
        for main, flags in (
            (train.main, [*TINY, "--out_dir", str(out), "--resume", "--max_iters", "4"]),
            (evaluate.main, ["--ckpt", str(out / "ckpt_last.pt"), "--limit", "2"]),
        ):
            rc, err = run_in_process(main, flags, capsys)
            assert_one_line_error(rc, err, "is not a checkpoint written by train.py: its args")
            assert msg in err


# --- the smaller cases -----------------------------------------------------------------------
def test_a_story_run_takes_every_allowed_seed():
    """A story batch's key seeds a torch generator: below 2^63 for every --seed < 2^63, and the
    same as before for the small seeds."""
    data = {"train": [dict(tokens=[1] * (5 + i)) for i in range(8)]}
    for seed in (0, 5, 9_300_000, 2**63 - 1):
        args = argparse.Namespace(task="story", seed=seed, batch_size=2, train_seqs=0)
        args.protocol = "paper"
        keys = epoch_batches(args, data, 3)
        assert all(0 <= key < 2**63 for _, key in keys)
        for _, key in keys:
            torch.Generator().manual_seed(key)
        if seed < 9_000_000:
            assert [k for _, k in keys] == [
                (seed * 1_000_003 + 3) * 1_000_003 + j for j in range(4)
            ]


def test_control_tokens_in_your_text_are_refused(tmp_path, monkeypatch):
    """<bos>, <cpad>, <eos>, <pad> written as words in your own text: one line naming the word
    (<unk> stays a word of yours: it marks an unknown one, as WikiText does)."""
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    for word in ("<bos>", "<cpad>", "<eos>", "<pad>"):
        text = own_text(tmp_path / word.strip("<>"))
        lines = (text / "train.txt").read_text()
        (text / "train.txt").write_text(
            f"a line of your text with {word} in it and more words\n{lines}"
        )
        with pytest.raises(common.UserError, match=f"your train text holds the word {word}: "):
            P.prepare("text", str(text), verbose=False)
    text = own_text(tmp_path / "unk")
    with open(text / "train.txt", "a") as f:
        f.write("a line of your text with <unk> in it and some more words\n")
    P.prepare("text", str(text), verbose=False)


def test_text_that_is_not_utf8_is_named_by_file_and_line(tmp_path, monkeypatch):
    """Your text, a WikiText copy or a story file with a byte that is not UTF-8: the file, the
    line and the byte, never a '\\udcff' or a position in a stream."""
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    text = own_text(tmp_path / "text")
    with open(text / "train.txt", "ab") as f:
        f.write(b"caf\xe9 au lait\n")
    with pytest.raises(
        common.UserError, match=f"{text}/train.txt line 41 .byte 0xe9. is not UTF-8"
    ):
        P.prepare("text", str(text), verbose=False)
    stories = tmp_path / "stories.txt"
    stories.write_bytes(b"title <EOT> a b <EOL> </s> one\ntitle <EOT> a \xff <EOL> </s> two\n")
    with pytest.raises(common.UserError, match=f"{stories} line 2 .byte 0xff. is not UTF-8"):
        read_stories(str(stories))


def test_runs_under_two_metrics_are_named(tmp_path):
    """curves.py side by side: a run's perplexity under nanogen's metric and one under the
    authors' (or per character) are not the same number: each run names its metric."""
    record = dict(step=2, train_loss=5.0, val_loss=5.0, val_ppl=148.4, lr=1e-3)
    folders = []
    for name, flags in (
        ("paper", dict(protocol="paper")),
        ("authors", dict(protocol="authors")),
        ("char", dict(protocol="paper", vocab="char")),
    ):
        folder = tmp_path / name
        folder.mkdir()
        args = dict(model="lstm", head="nmst", dataset="wikitext2", task="completion", **flags)
        (folder / "args.json").write_text(json.dumps(args))
        (folder / "log.jsonl").write_text(json.dumps(record) + "\n")
        folders.append(str(folder))
    rows = curves.overlay(folders, str(tmp_path / "c.png"))
    assert "[nanogen's metric, per word] | 148.40" in rows[2]
    assert "[the authors' metric, per word] | 148.40" in rows[3]
    assert "[nanogen's metric, per character] | 148.40" in rows[4]
    assert "[" not in "".join(curves.overlay(folders[:1] * 2, str(tmp_path / "c.png")))


def no_compiler():  # inductor's own search for a C++ compiler, told to find none
    from torch._inductor import config

    return config.patch({"cpp.cxx": (None, "no-such-c++-compiler")})


def test_compile_without_a_compiler_is_one_line():
    with (
        no_compiler(),
        pytest.raises(common.UserError, match="--compile needs a compiler .no-such-c"),
    ):
        common.compile_model(torch.nn.Linear(2, 2))


@slow
def test_compile_and_window_messages_in_a_run(tmp_path, capsys):
    """train.py --compile without a compiler: one line before the first step (it was an 80-line
    traceback from inside it); a GPT whose window no training line fits: said so (it was "lines
    of more than 10 tokens", of lines that have them)."""
    with no_compiler():
        flags = TINY + ["--compile", "--out_dir", str(tmp_path)]
        rc, err = run_in_process(train.main, flags, capsys)
    assert_one_line_error(rc, err, "--compile needs a compiler (no-such-c++-compiler)")
    gpt = ["--model", "gpt", "--n_head", "2", "--block_size", "8", "--batch_size", "8"]
    rc, err = run_in_process(train.main, TINY + gpt + ["--out_dir", str(tmp_path)], capsys)
    assert_one_line_error(rc, err, "every training line is longer than the --block_size 8 window")
