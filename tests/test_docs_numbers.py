"""The numbers the README and RESULTS.md print are what this code prints: the quick start's
validation perplexity, and a table of `reproduce.py` at the tiny scale, re-derived here (slow:
CI runs them), so that a change that moves them fails a test instead of a student's comparison."""

import os
import re
import shlex

import pytest

import curves
import reproduce
import train
from conftest import ROOT

pytestmark = pytest.mark.slow


def readme_quick_start():
    """-> (the README's first train.py command as flags, the step of the evaluation line it quotes,
    that line's validation perplexity as printed)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Two commands", 1)[1]
    commands = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    command = next(line for line in commands.splitlines() if line.startswith("python train.py"))
    quoted = re.search(r"^step +(\d+) \|.*\| val ppl +([\d.]+) \|", section, re.M)
    return shlex.split(command)[2:], int(quoted[1]), quoted[2]


def test_the_quick_start_prints_the_readmes_perplexity(tmp_path, monkeypatch):
    flags, step, ppl = readme_quick_start()
    # (the README's command, run from the tree's root, into a folder of the test's)
    monkeypatch.chdir(ROOT)
    train.main(flags + ["--out_dir", str(tmp_path / "run")])
    log = curves.read_log(str(tmp_path / "run" / "log.jsonl"))
    found = [f"{r['val_ppl']:.2f}" for r in log if r["step"] == step]
    assert found == [ppl], f"README.md quotes val ppl {ppl} at step {step}; the code prints {found}"


def results_tiny_table():
    """-> the table lines RESULTS.md quotes of `reproduce.py nmst-table1 --scale tiny`."""
    text = open(os.path.join(ROOT, "RESULTS.md"), encoding="utf-8").read()
    section = text.split("re-derived by tests/test_docs_numbers.py", 1)[1]
    block = section.split("```\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("|")]


def test_the_tiny_table_is_the_one_results_md_quotes(tmp_path):
    quoted = results_tiny_table()
    out = tmp_path / "r"
    reproduce.main(["nmst-table1", "--scale", "tiny", "--out", str(out), "--runs", str(out / "x")])
    table = (out / "table.md").read_text()
    missing = [line for line in quoted if line not in table]
    assert len(quoted) >= 3 and not missing, (
        f"RESULTS.md quotes rows the code no longer prints: {missing}"
    )
