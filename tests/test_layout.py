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


# The commands and their helpers: each explains itself in comment lines (the paper files too, but
# their docstrings carry most of it).
COMMAND_FILES = ["train.py", "config.py", "evaluate.py", "sample.py", "reproduce.py", "bench.py"]
COMMAND_FILES += ["curves.py", "common.py", "data/__init__.py", "data/loader.py"]
COMMAND_FILES += ["data/prepare.py", "data/stories.py"]
PAPER_FILES = ["heads.py", "model.py", "decode.py", "insnet.py"]


def comment_share(path):
    """-> (comment-only lines, code lines): a code line is neither blank nor a comment."""
    lines = [ln.strip() for ln in open(os.path.join(ROOT, path), encoding="utf-8")]
    comments = sum(ln.startswith("#") for ln in lines)
    code = sum(bool(ln) and not ln.startswith("#") for ln in lines)
    return comments, code


def test_every_command_file_explains_itself():
    """Every command file has at least 8 % comment-only lines of its code lines, the tree at least
    7 % (whole-sentence comments where a reader asks why: the anchors have 8-19 %)."""
    shares = {f: comment_share(f) for f in COMMAND_FILES + PAPER_FILES}
    for f, (comments, code) in sorted(shares.items()):
        print(f"{f:18s} {comments:4d} comment lines / {code:5d} code lines = {comments / code:.1%}")
    low = [f for f in COMMAND_FILES if shares[f][0] < 0.08 * shares[f][1]]
    assert not low, f"fewer than 8 % comment lines: {low}"
    comments, code = map(sum, zip(*shares.values()))
    assert comments >= 0.07 * code, comments / code


def test_functions_fit_a_screen():
    """No function over 60 formatted lines, at most two over 50 (nanoGPT has one)."""
    lengths = {}
    for path in COMMAND_FILES + PAPER_FILES:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())):
            if isinstance(node, ast.FunctionDef):
                lengths[f"{path}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert max(lengths.values()) <= 60, max(lengths.items(), key=lambda kv: kv[1])
    over_50 = [name for name, n in lengths.items() if n > 50]
    assert len(over_50) <= 2, over_50


# The modules a reader meets by name in README.md and docs/: `module.name` is checked against them.
MODULES = {m: f"{m}.py" for m in ("heads", "model", "decode", "insnet", "train", "config")}
MODULES.update({m: f"{m}.py" for m in ("evaluate", "sample", "curves", "common", "reproduce")})
MODULES.update({"bench": "bench.py", "data.loader": "data/loader.py"})
MODULES.update({"data.prepare": "data/prepare.py", "data.stories": "data/stories.py"})


# (a file name such as `curves.png` is no module's name)
SUFFIXES = ("py", "png", "json", "jsonl", "md", "txt", "pt")


def test_the_readme_and_docs_name_live_places():
    """Every `file.py:function` and `module.name` that README.md and docs/ name exists; the
    README fits on page one (200 lines)."""
    pages = ["README.md"] + [
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
    ]
    missing, named = [], 0
    for page in pages:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        places = re.findall(r"([\w/]+\.py):([A-Za-z_][\w.]*\w)", text)
        dotted = re.findall(r"`((?:data\.)?[a-z]+)\.([A-Za-z_][\w.]*\w)`", text)
        places += [(MODULES[m], n) for m, n in dotted if m in MODULES and n not in SUFFIXES]
        named += len(places)
        missing += [f"{page}: {p}:{n}" for p, n in places if n not in defined_names(p)]
    assert named >= 40 and not missing, missing
    assert len(open(os.path.join(ROOT, "README.md"), encoding="utf-8").readlines()) <= 200


def test_the_paper_files_import_in_reading_order():
    """The README's layering sentence: each paper file imports only the paper files read before
    it (heads, model, decode, insnet) and common.py."""
    graph = modules()
    for i, m in enumerate(["heads", "model", "decode", "insnet"]):
        allowed = {"heads", "model", "decode", "insnet"}.intersection(
            ["heads", "model", "decode", "insnet"][:i]
        )
        assert graph[m] <= allowed | {"common"}, (m, graph[m])
