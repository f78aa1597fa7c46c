"""The solutions of the three coursework exercises (docs/exercises.md), as edits of the code (one
module each), and the helpers that apply them to a copy of the code, never to the tree itself."""

import importlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A tree where the exercise is done (a student's) holds these; its anchors are gone then.
DONE = {
    1: ("heads.py", '"logt"'),
    2: ("decode.py", '"typical"'),
    3: ("model.py", 'MODELS = ("rnn", "lstm", "gcnn", "gpt")'),
}


class AlreadyDone(Exception):
    """The tree holds its own answer to the exercise: there is nothing to apply."""


def copy_of_the_code(dest):
    """The tracked Python files (tests included), data/ and the style's settings (ruff.toml) of
    the tree, copied to dest."""
    # The tracked files only: the copy is the code as a clone holds it, without runs or caches.
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if name.endswith(".py") or name.startswith("data/") or name == "ruff.toml":
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            # Bytes as they are: the style check compares the copy with the tree line for line.
            with open(os.path.join(ROOT, name), "rb") as src:
                data = src.read()
            with open(os.path.join(dest, name), "wb") as out:
                out.write(data)


def exercise_done(n):
    """Whether the tree itself already holds an answer to exercise n."""
    name, mark = DONE[n]
    text = open(os.path.join(ROOT, name), encoding="utf-8").read()
    # Exercise 3 adds a name to MODELS: the tuple as shipped is then gone.
    if n == 3:
        return mark not in text
    return mark in text


def apply(dest, edits):
    """Replace each anchor (found exactly once) of the copy in dest by its new text."""
    for name, anchor, new in edits:
        path = os.path.join(dest, name)
        text = open(path, encoding="utf-8").read()
        # An anchor found twice (or not at all) means the code moved under the solution: an error,
        # not an edit of the wrong place.
        assert text.count(anchor) == 1, (name, anchor)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text.replace(anchor, new))


def solved_copy(n, dest):
    """A copy of the code in dest with exercise n's solution applied.  Raises AlreadyDone when
    the tree holds its own answer (apply would not find the anchors there)."""
    if exercise_done(n):
        raise AlreadyDone(f"exercise {n} is done in this tree: python -m tests.check_exercise {n}")
    copy_of_the_code(dest)
    apply(dest, edits_of(n))


def answered_copy(n, dest):
    """A copy of the code in dest that answers exercise n: the tree's own answer where it holds
    one (a student's, graded as it is), else the solution applied."""
    # The student's answer graded as written; the solution only where there is none.
    copy_of_the_code(dest)
    if not exercise_done(n):
        apply(dest, edits_of(n))


def edits_of(n):
    return importlib.import_module(f"solutions.exercise{n}").EDITS
