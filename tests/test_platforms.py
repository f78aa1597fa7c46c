"""Machines other than this Linux box, faked as test_device.py fakes a GPU: Windows (no fcntl,
no SIGHUP, msvcrt's lock; os.kill(pid, 0) sends Ctrl-C there) and a console or locale that
cannot show every character (Windows' cp1252 when output is redirected, LANG=C): the runs go on,
the folder lock still refuses a second run, and text that cannot be shown is escaped."""
import fcntl
import os
import subprocess
import sys
import types

import pytest

from conftest import ROOT, assert_one_line_error, run_in_process

# Windows as train.py meets it: `import fcntl` fails, signal has no SIGHUP, and msvcrt.locking
# is the folder lock (here POSIX record locks, which the test's own lockf meets)
FAKE_WINDOWS = """
import fcntl, os, runpy, signal, subprocess, sys, types  # (subprocess probes msvcrt)
msvcrt = types.ModuleType("msvcrt")
msvcrt.LK_NBLCK = 2
def locking(fd, mode, nbytes):
    assert mode == msvcrt.LK_NBLCK and os.lseek(fd, 0, os.SEEK_CUR) == 0
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, nbytes)
msvcrt.locking = locking
sys.modules.update(fcntl=None, msvcrt=msvcrt)
del signal.SIGHUP
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
TINY = ["--model", "lstm", "--head", "nmst", "--epsilon", "1e-3", "--d_model", "16",
        "--n_layer", "1", "--batch_size", "4", "--eval_interval", "2", "--seed", "1"]
ASCII_LOCALE = dict(LC_ALL="C", LANG="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")


def run(cmd, env=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONIOENCODING"} | (env or {})
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          encoding="utf-8", errors="replace", timeout=300)


@pytest.mark.slow
def test_a_windows_machine_trains_and_its_lock_refuses_a_second_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", FAKE_WINDOWS, "train.py", *TINY, "--dataset", "ptb",
           "--train_seqs", "64", "--eval_seqs", "8", "--out_dir", str(out)]
    p = run(cmd + ["--max_iters", "2"])
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (out / "ckpt_last.pt").exists()
    with open(out / ".lock", "a+") as lock:  # another run holds the folder
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB, 1)
        p = run(cmd + ["--max_iters", "4", "--resume"])
    assert p.returncode == 2 and "is in use by another training run" in p.stderr, p.stderr
    p = run(cmd + ["--max_iters", "4", "--resume"])
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_preparation_folder_is_never_probed_with_os_kill_on_windows(monkeypatch):
    from data import prepare

    def kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) on Windows sends a Ctrl-C")
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(os, "kill", kill)
    assert prepare._alive(12345)


@pytest.mark.slow
def test_text_a_console_cannot_show_is_escaped(tmp_path):
    """Under an ASCII locale a run on text with accents prints them as \\x.. escapes (its probe
    line) instead of a UnicodeEncodeError, and files are written in UTF-8 whatever the locale."""
    words = "le café de la gare est très calme le soir et les trains sont à l'heure"
    (tmp_path / "train.txt").write_text(f"{words}\n" * 200, encoding="utf-8")
    p = run([sys.executable, "train.py", *TINY, "--dataset", "text", "--data_dir", str(tmp_path),
             "--max_iters", "2", "--probe", "4", "--out_dir", str(tmp_path / "run")],
            ASCII_LOCALE)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "le caf\\xe9 de la gare" in p.stdout, p.stdout
    table = tmp_path / "table.md"
    p = run([sys.executable, "-c", f"import cli\nwith cli.atomic_file({str(table)!r}) as f:\n"
             f"    f.write('101.5 \\u00b1 0.8')"], ASCII_LOCALE)
    assert p.returncode == 0, p.stderr[-2000:]
    assert table.read_bytes() == "101.5 ± 0.8".encode("utf-8")


def test_the_checkpoint_benchmark_reads_peak_memory_on_macos_and_refuses_windows(
        tmp_path, monkeypatch, capsys):
    """ru_maxrss counts KiB on Linux and bytes on macOS: a 1 GiB peak is 1024 MB on both; Windows
    has no resource module: one line."""
    import bench
    for platform, peak in (("linux", 2 ** 20), ("darwin", 2 ** 30)):
        rss = iter([0, peak])
        fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(
            ru_maxrss=next(rss)))
        monkeypatch.setitem(sys.modules, "resource", fake)
        monkeypatch.setattr(sys, "platform", platform)
        exec(bench.CHECKPOINT_CHILD.format(root=ROOT, numel=10, writer="format 2",
                                           path=str(tmp_path / "ckpt.pt")), {})
        assert float(capsys.readouterr().out.split()[1]) == 1024
    monkeypatch.setattr(sys, "platform", "win32")
    rc, err = run_in_process(bench.main, ["checkpoint", "--mb", "1"], capsys)
    assert_one_line_error(rc, err, "which Windows lacks")
