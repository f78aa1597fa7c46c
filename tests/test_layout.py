"""The layout a reader relies on: no import cycle between nanogen's files (function-local imports
counted too, so that none can hide one), and the paper files (heads, model, decode, insnet)
import no command file."""

import ast
import os

from conftest import ROOT

CONCEPT = {"heads", "model", "decode", "insnet"}
COMMANDS = {"train", "evaluate", "sample", "reproduce", "bench", "curves"}


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
    assert {"train", "heads", "data", "data.loader"} <= set(graph)  # (the walk saw the files)


def test_paper_files_import_no_command():
    graph = modules()
    for m in CONCEPT:
        assert not graph[m] & COMMANDS, (m, graph[m] & COMMANDS)
    assert graph["data"] == set()  # the shared error and downloads stand on nothing of nanogen's
