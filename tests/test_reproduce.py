"""reproduce.py without training: its statistics (Welch's t-test, one-sided where the paper claims a
direction), the verdict lines they make, its flags, the cap on each run, results written by an
earlier version, and a full disk at the results."""

import argparse
import math
import os

import pytest
import scipy.stats

import common
import evaluate
import reproduce
from conftest import assert_one_line_error, run_in_process


def test_welch_is_the_textbook_test_and_scipys():
    """Hand-made seeds: the p-value equals Welch's t and Welch-Satterthwaite's degrees of freedom
    worked by hand, and scipy's own call; one-sided halves it in the direction of the data."""
    a, b = [1.0, 2.0, 4.0], [3.5, 5.0, 6.5, 7.0]
    va, vb = 7 / 3, 2.5  # sample variances (ddof 1): [1, 2, 4] and [3.5, 5, 6.5, 7]
    se2 = va / 3 + vb / 4
    t = (7 / 3 - 5.5) / math.sqrt(se2)
    df = se2**2 / ((va / 3) ** 2 / 2 + (vb / 4) ** 2 / 3)
    p = 2 * scipy.stats.t.sf(abs(t), df)
    assert reproduce.welch(a, b) == pytest.approx(p, rel=1e-12)
    assert reproduce.welch(a, b) == scipy.stats.ttest_ind(a, b, equal_var=False).pvalue
    # a lies below b: "less" (a below) is half the two-sided p, "greater" its complement
    assert reproduce.welch(a, b, "less") == pytest.approx(p / 2, rel=1e-12)
    assert reproduce.welch(a, b, "greater") == pytest.approx(1 - p / 2, rel=1e-12)
    assert 0.04 < p < 0.05  # (apart at 5 % two-sided; one-sided the other way: not)
    # one seed on a side: no test at all; seeds alike on both sides: no difference
    assert math.isnan(reproduce.welch([1.0], [2.0, 3.0]))
    assert reproduce.welch([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]) == 1.0


def test_a_comparison_says_its_p_and_its_call():
    a, b = [1.0, 2.0, 4.0], [3.5, 5.0, 6.5, 7.0]
    assert reproduce.compared("VA+", a, "ST+", b, 1) == (
        "VA+ 2.3 vs ST+ 5.5: p = 0.049: apart at 5 %"
    )
    assert reproduce.compared("VA+", a, "ST+", b, 1, "greater") == (
        "VA+ 2.3 vs ST+ 5.5: p = 0.98 (VA+ above): not resolved"
    )
    assert reproduce.compared("ST+", b, "NMST+", a, 1, "greater").endswith(
        "p = 0.024 (ST+ above): apart at 5 %"
    )
    assert (
        reproduce.compared("VA+", [2.0], "ST+", b, 1) == "VA+ 2.0 vs ST+ 5.5: one seed, not tested"
    )


def table4_runs(cfg, heads, st_nucleus):
    """Table 4's results: r_nt(1000) 0 everywhere but ST+'s nucleus-0.2 (one value a seed)."""
    out = {}
    for head in heads:
        seeds = []
        for seed in range(len(st_nucleus)):
            ratio = {d: 0.0 for d in cfg["decoders"]}
            if head == "st":
                ratio["nucleus-0.2"] = st_nucleus[seed]
            seeds.append({d: {"decoding": {"r_nt": {"1000": ratio[d]}}} for d in ratio})
        out["gpt", head] = seeds
    return out


def test_table_4s_verdict_lines_come_and_go_with_the_test():
    """The 'NOT shown' line stands while no learned cell differs from VA+'s at 5 %, goes with one
    that does, and stays with one seed (n = 1 calls nothing)."""
    cfg = reproduce.nmst_settings("cpu", 4)
    args = argparse.Namespace(scale="cpu", heads=["softmax", "st", "nmst"])
    loud = reproduce.report_table4(cfg, table4_runs(cfg, args.heads, [0.7, 0.75, 0.8]), args)
    assert not any("NOT shown" in line for line in loud)
    assert "- nucleus-0.2: VA+ 0.000 vs ST+ 0.750: p = 0.0015: apart at 5 %; " in "\n".join(loud)
    # NMST+ against VA+ is one-sided (the paper: NMST+'s r_nt below VA+'s)
    assert "VA+ 0.000 vs NMST+ 0.000: p = 1 (VA+ above): not resolved." in "\n".join(loud)
    cfg["seeds"] = 1
    one = reproduce.report_table4(cfg, table4_runs(cfg, args.heads, [0.75]), args)
    assert any("is NOT shown here" in line for line in one[:5])
    assert "- One seed: no spread, so no difference is called." in one
    assert "VA+ 0.000 vs ST+ 0.750: one seed, not tested" in "\n".join(one)


def test_a_table_says_the_precision_its_runs_train_in():
    """Table 1's paper scale: the authors' float32, on any machine; the cpu scale: --dtype auto,
    which is float32 on a CPU (autocast only on CUDA)."""
    args = argparse.Namespace(scale="paper")
    paper = reproduce.table_head(reproduce.nmst_settings("paper", 1), args, "Table 1")
    assert "every run in float32: --dtype float32)" in paper[0]
    args.scale = "cpu"
    cpu = reproduce.table_head(reproduce.nmst_settings("cpu", 1), args, "Table 1")
    assert "(scale cpu, ptb, every run in " in cpu[0]
    assert common.precision("cpu", "bfloat16") == "float32"


def test_table_4_is_reported_without_table_1s_decoders(tmp_path, monkeypatch):
    """Table 4 decodes no greedy: its report is Table 4's alone (Table 1's asked for greedy)."""
    cfg = reproduce.nmst_settings("cpu", 4)
    heads = ["softmax", "st", "nmst"]
    monkeypatch.setattr(reproduce, "nmst_runs", lambda c, a: table4_runs(cfg, heads, [0.7, 0.8]))
    monkeypatch.setattr(reproduce.curves, "r_nt_figure", lambda *a: None)
    monkeypatch.setattr(reproduce.curves, "over_training", lambda *a: [])
    args = argparse.Namespace(scale="cpu", heads=heads, models=None, seeds=2)
    args.out = args.runs = str(tmp_path)
    lines, raw = reproduce.run_nmst(4, args)
    assert lines[0].startswith("NMST Table 4: r_nt(1000)") and set(raw) == {
        "gpt/" + h for h in heads
    }


def test_table_1s_perplexity_calls_are_one_sided_for_st_against_nmst():
    """The paper claims NMST+ below ST+ (one-sided); VA+ against either is two-sided."""
    cfg = dict(reproduce.nmst_settings("cpu", 1), models={"rnn": []})
    args = argparse.Namespace(scale="cpu", heads=["softmax", "st", "nmst"])
    ppl = {"softmax": [100.0, 104.0, 108.0], "st": [110.0, 112.0, 114.0], "nmst": [100, 101, 105]}
    runs = {("rnn", h): [{"ppl_nanogen": x} for x in v] for h, v in ppl.items()}
    line = reproduce.verdict_table1(cfg, runs, args)[1]
    st_nmst = scipy.stats.ttest_ind(ppl["st"], ppl["nmst"], equal_var=False, alternative="greater")
    assert line.startswith("- RNN, perplexity (nanogen's metric): VA+ 104.0 vs ST+ 112.0: p = ")
    assert f"ST+ 112.0 vs NMST+ 102.0: p = {st_nmst.pvalue:.2g} (ST+ above): apart at 5 %." in line


def test_the_flags_that_cut_a_table_are_checked_before_anything_is_made(tmp_path, capsys):
    out = ["--out", str(tmp_path / "r")]
    for argv, message in (
        (
            ["nmst-table1", "--models", "gpt"],
            "--models: nmst-table1 at --scale cpu trains rnn lstm",
        ),
        (["nmst-table4", "--models", "rnn"], "--models: nmst-table4 at --scale cpu trains gpt"),
        (["ct-table3", "--models", "lstm"], "--models is for nmst-table1 / nmst-table4"),
        (["all", "--models", "lstm"], "--models is for nmst-table1 / nmst-table4, not all"),
        (
            ["nmst-table1", "--budget_minutes", "60", "--max_minutes", "5"],
            "give --budget_minutes (the table's) or --max_minutes (each run's)",
        ),
        (["nmst-table1", "--scale", "lease"], "invalid choice: 'lease'"),
    ):
        assert_one_line_error(*run_in_process(reproduce.main, argv + out, capsys), message)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("jobs, each", [(1, "2"), (3, "6")])
def test_a_budget_is_shared_by_the_waves_of_runs(jobs, each, capsys):
    """--budget_minutes: each run's --max_minutes is the budget over the waves of --jobs runs
    (--jobs 1 honoured: three in turn), stopping at an epoch's end; said before training."""
    args = argparse.Namespace(jobs=jobs, budget_minutes=6.0, max_minutes=None)
    assert reproduce.run_cap(3, args) == ["--max_minutes", each, "--whole_epochs"]
    assert capsys.readouterr().out == (
        f"training 3 runs, {jobs} at a time: 6 min of training, and each run's set-up and "
        f"evaluations (each run stops at the first epoch's end past {each} min)\n"
    )
    args = argparse.Namespace(jobs=jobs, budget_minutes=None, max_minutes=None)
    assert reproduce.run_cap(3, args) == ["--max_minutes", "0"]
    assert capsys.readouterr().out == f"training 3 runs, {jobs} at a time\n"


def test_results_of_an_earlier_version_are_evaluated_again(tmp_path, monkeypatch, capsys):
    """A results folder of an earlier version holds perplexities without ppl_nanogen (and
    decoding studies without r_nt_curve): each is evaluated again, not a KeyError."""
    cfg = dict(reproduce.nmst_settings("tiny", 1), decoders=["greedy"])
    args = argparse.Namespace(scale="tiny", heads=["nmst"], out=str(tmp_path), runs=str(tmp_path))
    ckpt = tmp_path / "ckpt_best.pt"
    ckpt.write_text("")
    monkeypatch.setattr(reproduce, "train_all", lambda plan, args: {"lstm-nmst-s0": str(ckpt)})
    ppl_flags, study = ["--split", "valid", "--limit", "6"], reproduce.study_flags(cfg, "greedy")
    study += ["--limit", "6", "--seed", "0", "--traces", "3"]
    old = {"ppl": [ppl_flags, {"ppl": 9.0}], "greedy": [study, {"decoding": {"r_nt": {}}}]}
    for name, (flags, res) in old.items():  # written after the checkpoint, for the same request
        evaluate.write_json(str(tmp_path / f"lstm-nmst-s0-{name}.json"), dict(res, request=flags))
    now = {"ppl": 9.0, "ppl_nanogen": 9.5, "ppl_authors": None, "decoding": {"r_nt_curve": {}}}
    calls = []
    monkeypatch.setattr(
        evaluate, "main", lambda argv: calls.append(argv) or evaluate.write_json(argv[-1], now)
    )
    runs = reproduce.nmst_runs(cfg, args)
    assert runs["lstm", "nmst"][0]["ppl_nanogen"] == 9.5 and len(calls) == 2
    assert "written by an earlier version, evaluated again" in capsys.readouterr().out
    reproduce.nmst_runs(cfg, args)
    assert len(calls) == 2  # (the new results are reused)


@pytest.mark.parametrize("fails", ["fsync", "replace"])
def test_a_full_disk_at_the_results_is_one_line(fails, tmp_path, monkeypatch, capsys):
    """results.json or table.md on a full disk: one line, no temporary file left."""

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    # (the disk fills as a file is flushed, or as it is renamed into place)
    monkeypatch.setattr(os, fails, full)
    argv = ["nmst-table1", "--scale", "tiny", "--out", str(tmp_path)]
    monkeypatch.setattr(reproduce, "run_nmst", lambda table, args: (["a table"], {}))
    rc, err = run_in_process(reproduce.main, argv, capsys)
    assert_one_line_error(rc, err, f"could not write {tmp_path}/")
    assert "No space left" in err
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert not (tmp_path / "table.md").exists()
