"""The layout a reader relies on: no import cycle between nanogen's files (function-local imports
counted too, so that none can hide one), and the paper files (heads, model, decode, insnet)
import no command file; the guided step (docs/step.md) names places that exist."""

import ast
import os
import re

from conftest import ROOT

CONCEPT = {"heads", "model", "decode", "insnet"}
COMMANDS = {"train", "evaluate", "sample", "reproduce", "bench", "curves"}  # (common: shared)


def modules():
    """{module name: the project modules it imports, wherever in the file}."""
    files = [f for f in os.listdir(ROOT) if f.endswith(".py")] + [
        f"data/{f}" for f in os.listdir(os.path.join(ROOT, "data")) if f.endswith(".py")
    ]
    names = {f[:-3].replace("/", ".").replace(".__init__", ""): f for f in files}
    graph = {}
    for name, f in names.items():
        imported = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in imported if m in names and m != name}
    return graph


def test_no_import_cycle():
    graph, state = modules(), {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(m) :] + [m])}")
        if m not in state:
            state[m] = "open"
            for n in sorted(graph[m]):
                visit(n, path + [m])
            state[m] = "done"

    for m in sorted(graph):
        visit(m, [])
    assert {"train", "heads", "data", "data.loader", "common"} <= set(graph)  # (the walk saw them)


def test_paper_files_import_no_command():
    graph = modules()
    for m in CONCEPT:
        assert not graph[m] & COMMANDS, (m, graph[m] & COMMANDS)


def test_imports_point_down():
    """common.py stands on nothing of nanogen's; data/ on common alone (and its own files);
    nothing imports train.py but the drivers that call its main (reproduce, bench)."""
    graph = modules()
    assert graph["common"] == set()
    for m in [m for m in graph if m == "data" or m.startswith("data.")]:
        outside = {n for n in graph[m] if n != "data" and not n.startswith("data.")}
        assert outside <= {"common"}, (m, outside)
    importers = {m for m, imported in graph.items() if "train" in imported}
    assert importers <= {"reproduce", "bench"}, importers
    assert "evaluate" in graph["train"] and "train" not in graph["evaluate"]


def defined_names(path):
    """The names a file defines: its functions, classes and module-level assignments, and
    Class.method for the methods of its classes."""
    names = set()
    for node in ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_the_guided_step_names_live_places():
    """docs/step.md (linked from the README) names places as `file:function` or
    `file:Class.method`: each exists, and each line of its Python excerpts is in the code."""
    step = open(os.path.join(ROOT, "docs", "step.md"), encoding="utf-8").read()
    assert "(docs/step.md)" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    anchors = re.findall(r"([\w/]+\.py):([A-Za-z_][\w.]*\w)", step)
    assert len(anchors) >= 20, anchors
    missing = [f"{path}:{name}" for path, name in anchors if name not in defined_names(path)]
    assert not missing, f"docs/step.md names places that are gone: {missing}"
    code = "".join(open(os.path.join(ROOT, f), encoding="utf-8").read() for f in ("train.py",))
    for block in re.findall(r"```python\n(.*?)```", step, re.S):
        for line in block.splitlines():
            statement = line.split("  #")[0].strip()
            assert statement in code, f"docs/step.md quotes a line train.py no longer has: {line}"
