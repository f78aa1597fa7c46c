"""What no formatter undoes, checked on every Python file of the project (tests included):
`ruff format` and `ruff check` (ruff.toml; CI runs both) make the layout, this test rejects the
golf that hides branching.  One idea a line."""

import ast
import os
import subprocess

from conftest import ROOT


def project_files():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [f for f in listed if os.path.exists(os.path.join(ROOT, f))]


def is_condition(node):
    """A value that reads as a truth test: a comparison, and / or / not, a bool() or is... call."""
    if isinstance(node, (ast.Compare, ast.BoolOp)):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = getattr(func, "id", getattr(func, "attr", ""))
        return name in ("bool", "isfile", "isdir", "exists")
    return False


def is_sequence(node):
    if isinstance(node, (ast.List, ast.Tuple, ast.JoinedStr)):
        return True
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def parameters(node):
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    count = len([n for n in names if n not in ("self", "cls")])
    return count + (a.vararg is not None) + (a.kwarg is not None)


def golf(path):
    """-> ['file:line what'] for each construct the style rejects."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        found += [f"{where} {what}" for what in hidden_branches(node) + golfed_lines(node)]
    return found + too_many_parameters(tree, path)


def hidden_branches(node):
    """A walrus, a nested conditional expression, a conditional expression as a statement."""
    found = []
    if isinstance(node, ast.NamedExpr):
        found.append("walrus :=")
    if isinstance(node, ast.IfExp):
        inner = [n for part in (node.test, node.body, node.orelse) for n in ast.walk(part)]
        if any(isinstance(n, ast.IfExp) for n in inner):
            found.append("nested conditional expression")
    if isinstance(node, ast.Expr) and isinstance(node.value, (ast.IfExp, ast.Tuple)):
        found.append("a conditional expression or tuple as a statement")
    return found


def golfed_lines(node):
    """A sequence times a condition, return print(...), a lambda given a name."""
    found = []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        pairs = ((node.left, node.right), (node.right, node.left))
        if any(is_sequence(a) and is_condition(b) for a, b in pairs):
            found.append("sequence * condition")
    if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
        if getattr(node.value.func, "id", "") == "print":
            found.append("return print(...)")
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
        found.append("a lambda given a name (write a def)")
    return found


def too_many_parameters(tree, path):
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if parameters(node) > 6:
                found.append(f"{path}:{node.lineno} {node.name} takes {parameters(node)} (<= 6)")
    return found


def test_no_golf_in_any_file():
    found = [line for path in project_files() for line in golf(path)]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_name(tmp_path, monkeypatch):
    """Each rule on a file that breaks it once (so the test above can fail)."""
    lines = [
        "if (n := 3):\n    pass",
        "x = 1 if a else 2 if b else 3",
        "print(1) if a else print(2)",
        'flags = ["--resume"] * os.path.isfile(p)',
        "def f():\n    return print(1)",
        "g = lambda x: x",
        "def h(a, b, c, d, e, f, g):\n    pass",
    ]
    monkeypatch.setattr("test_style.ROOT", str(tmp_path))
    for i, text in enumerate(lines):
        (tmp_path / f"bad{i}.py").write_text(text + "\n")
        assert len(golf(f"bad{i}.py")) == 1, text
    (tmp_path / "good.py").write_text("def h(self, a, b, c, d, e, f):\n    x = 1 if a else 2\n")
    assert golf("good.py") == []
