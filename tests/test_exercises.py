"""The coursework exercises (docs/exercises.md), each done once from its own text on a copy of the
code (the tree's own answer where it holds one, else tests/solutions), graded by `python -m
tests.check_exercise N` and then used: exercise 1's head answers its question through
`reproduce.py nmst-table1 --scale tiny --heads ... logt`; a head name without its branch is an
error, never a silent ST; the typical decoder samples in sample.py and evaluate.py like the
others; the dilated gated CNN passes the contract and cached-decoding tests, trains and
decodes (those end to end: slow).  Fast: the tree, and each solution applied to a copy of it,
pass the project's style (`ruff format --check`, `ruff check`), as CI checks it."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from solutions import (
    AlreadyDone,
    answered_copy,
    apply,
    copy_of_the_code,
    edits_of,
    exercise_done,
    solved_copy,
)


def exercise_text(n):
    """docs/exercises.md's exercise n: its backticked spans, whitespace collapsed."""
    # The exercises are numbered items between these two headings.
    text = open(os.path.join(ROOT, "docs", "exercises.md"), encoding="utf-8").read()
    section = text[text.index("## The exercises") : text.index("## What the checkers check")]
    part = re.split(r"\n(?=\d\. \*)", section)[n]
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", part)]


# The tracked files' text: what a clone holds.
def code_text(*names):
    files = subprocess.run(
        ["git", "ls-files", *names], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    return "\n".join(open(os.path.join(ROOT, f), encoding="utf-8").read() for f in files)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_text_names_real_places_and_is_what_the_solution_does(n):
    """Every place an exercise's text names exists in the code (or is one the exercise makes),
    every piece of code it spells out is in its solution (`...`: anything)."""
    code = code_text("*.py")
    # A name the exercise creates is in its solution's text, not yet in the code.
    done = " ".join(" ".join(new.split()) for _, _, new in edits_of(n))
    for span in exercise_text(n):
        # The exercise's own checker.
        if span.startswith("python -m tests.check_exercise"):
            assert span.split()[3:] == [str(n)], span
        # The command run below.
        elif span.startswith("python "):
            assert n == 1 and span.split()[1:] == REPRODUCE_LOGT, span
        # A flag of a command.
        elif span.startswith("--"):
            flag = span.split()[0]
            assert f'"{flag}"' in code or f'("{flag[2:]}",' in code, span
        elif span.endswith(".py"):
            assert os.path.isfile(os.path.join(ROOT, span)), span
        # A name, module.name or Class.method.
        elif re.fullmatch(r"[\w.]+", span):
            *owner, name = span.split(".")
            where = code_text(f"{owner[0]}.py") if owner and owner[0].islower() else code
            assert re.search(rf"\b{name}\b", where + done), span
            if owner and not owner[0].islower():
                assert re.search(rf"class {owner[0]}\b[^\n]*:\n(.*\n)*?    def {name}\(", where), (
                    span
                )
        # Code, in the solution's text.
        else:
            assert re.search(".*?".join(map(re.escape, span.split("..."))), done), span


REPRODUCE_LOGT = "reproduce.py nmst-table1 --scale cpu --heads softmax nmst logt".split()


def graded_copy(n, dest):
    """A copy of the code answering exercise n, which the exercise's checker passes."""
    # The checker as a student runs it, in the copy: its exit status says all passed.
    answered_copy(n, str(dest))
    p = subprocess.run(
        [sys.executable, "-m", "tests.check_exercise", str(n)],
        cwd=dest,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and f"exercise {n}:" in p.stdout, p.stdout + p.stderr[-3000:]
    return dest


@pytest.mark.slow
def test_exercise_1_a_fourth_head_goes_through_reproduce(tmp_path):
    code = graded_copy(1, tmp_path / "code")
    out = tmp_path / "results"
    # The text's command, at seconds' scale.
    command = [a.replace("cpu", "tiny") for a in REPRODUCE_LOGT]
    p = subprocess.run(
        [sys.executable, *command, "--out", str(out)],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    table = (out / "table.md").read_text()
    # A head with no epsilon: no Theorem 3 cells, and a row of its own.
    assert "| LOGT | - |" in table and "no conclusion" in table and "± 0.0" not in table
    assert (out / "r_nt.png").exists()


@pytest.mark.slow
def test_a_head_without_its_branch_is_an_error(tmp_path):
    """Only the name added to HEADS (the branches forgotten): an error, not a silent ST."""
    if exercise_done(1):
        pytest.skip("exercise 1 is done in this tree: its first two steps cannot be replayed")
    code = tmp_path / "code"
    copy_of_the_code(str(code))
    apply(str(code), edits_of(1)[:2])
    # Each path of the head called with the name known and no branch: both must refuse.
    probe = (
        "import torch, heads\n"
        "h = heads.Head('logt', 4, 10, 0)\n"
        "x = torch.randn(1, 3, 4)\n"
        "targets = torch.ones(1, 3, dtype=torch.long)\n"
        "for call in (lambda: h(x, torch.ones(1, 3)),\n"
        "             lambda: h.target_log_probs(x, targets, torch.ones(1, 3))):\n"
        "    try:\n        call()\n        print('SILENT')\n"
        "    except ValueError as e:\n        print('REFUSED', e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe], cwd=code, capture_output=True, text=True, timeout=120
    )
    assert p.stdout.count("REFUSED") == 2 and "SILENT" not in p.stdout, p.stdout + p.stderr


# A training run of seconds on PTB: two steps, one evaluation, no probe.
TINY_RUN = (
    "--dataset ptb --d_model 16 --batch_size 8 --max_iters 2 --eval_interval 2 "
    "--eval_seqs 8 --probe 0 --out_dir run"
)


@pytest.mark.slow
def test_exercise_2_a_new_decoder_samples_like_the_others(tmp_path):
    code = graded_copy(2, tmp_path / "code")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*args):
        p = subprocess.run(
            [sys.executable, *args], cwd=code, capture_output=True, text=True, timeout=300, env=env
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    # A checkpoint to decode from: the decoder is what is tested.
    run(*f"train.py --model lstm --n_layer 1 {TINY_RUN}".split())
    ckpt = os.path.join("run", "ckpt_best.pt")
    # sample.py and evaluate.py take the new decoder through their flags like the others.
    typical = "--decoder typical --p 0.9 --temperature 0.8 --L 5".split()
    p = run("sample.py", "--ckpt", ckpt, "--prompt", "the company said", *typical)
    # It draws: a fresh seed, said.
    assert "repeats this sample" in p.stderr and ">>>" in p.stdout
    p = run(
        "evaluate.py", "--ckpt", ckpt, *"--no_ppl --decoder typical --p 0.9 --L 5 --limit 4".split()
    )
    assert "typical" in p.stdout


@pytest.mark.slow
def test_exercise_3_a_new_backbone_passes_the_contract_trains_and_decodes(tmp_path):
    # The copy holds the tests too: the contract tests run on the new backbone.
    code = graded_copy(3, tmp_path / "code")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The new backbone's name is the student's choice ("dgcnn" in the solution).
    shipped = "('rnn', 'lstm', 'gcnn', 'gpt')"
    name = subprocess.run(
        [sys.executable, "-c", f"import model; print(*set(model.MODELS) - set({shipped}))"],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()

    def run(*args):
        p = subprocess.run(
            [sys.executable, *args], cwd=code, capture_output=True, text=True, timeout=300, env=env
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    # The contract and cached == re-encoded tests, selected by the new name.
    tests = "tests/test_model.py tests/test_decode.py"
    p = run(*f"-m pytest -q -rA -p no:cacheprovider {tests} -k {name}".split())
    assert (
        f"test_cached_equals_uncached[greedy-kw0-nmst-{name}]" in p.stdout
        and "failed" not in p.stdout
    )
    run(*f"train.py --model {name} --kernel_size 3 --n_layer 3 --block_size 64 {TINY_RUN}".split())
    ckpt = os.path.join("run", "ckpt_best.pt")
    p = run("evaluate.py", "--ckpt", ckpt, *"--decoder greedy --L 5 --limit 4".split())
    assert "ppl" in p.stdout and "greedy" in p.stdout


def ruff(*args, cwd):
    """ruff (requirements.txt pins it) run in cwd with the tree's settings -> its output, or
    None when it passes."""
    # The interpreter's own ruff: the version requirements.txt pins, whatever is on PATH.
    p = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    if p.returncode == 0:
        return None
    return f"ruff {' '.join(args)} in {cwd}:\n{p.stdout[-3000:]}{p.stderr[-1000:]}"


def test_the_tree_passes_the_style_ruff_format_and_ruff_check():
    """What CI checks first, said before a commit: run `ruff format .`, then fix what `ruff
    check .` names (ruff.toml: lines of at most 100 characters, imports sorted, McCabe <= 10)."""
    # The order CI runs them: the layout first, then the rules.
    for args in (["format", "--check", "."], ["check", "."]):
        wrong = ruff(*args, cwd=ROOT)
        assert wrong is None, wrong


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_solution_leaves_a_tree_that_passes_the_style(n, tmp_path):
    """The worked solution applied to a copy of the code: the lines a student copies pass
    `ruff format --check` and `ruff check` as the rest of the tree does."""
    # The copy holds ruff.toml: the settings of the tree apply.
    try:
        solved_copy(n, str(tmp_path))
    except AlreadyDone as e:
        pytest.skip(f"{e}: the tree's own style test grades your answer")
    for args in (["format", "--check", "."], ["check", "."]):
        wrong = ruff(*args, cwd=tmp_path)
        assert wrong is None, wrong
