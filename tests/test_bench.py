"""bench.py's benchmarks run end to end at toy sizes and print their tables.  What they print is
a measurement, not asserted (figures are not tests) -- except where a benchmark checks a fact
beside its timings: nanogen's greedy decoding picks HuggingFace generate()'s tokens."""
import re

import pytest

import bench

pytestmark = pytest.mark.slow  # seconds each: python -m pytest -m "" runs them
GPT = ["--gpt_layers", "1", "--gpt_dim", "32", "--gpt_heads", "2"]


@pytest.mark.parametrize("argv, last_row", [
    (["train", "--models", "gpt", "--iters", "1", "--rounds", "1", *GPT],  # (one 1024-token sequence)
     "(st/sm, nmst/sm: time of a step relative to the softmax head's"),
    (["train_hf", "--iters", "1", "--rounds", "1", "--batch", "1", "--seq", "8", "--parts", *GPT],
     "  its 3 matrix products"),
    (["decode", "--iters", "1", "--prompts", "2", "--new_tokens", "3", *GPT], "beam-4"),
    (["fast", "--iters", "1", "--rounds", "1", "--batch", "1", "--seq", "8", "--prompts", "2",
      "--new_tokens", "2", *GPT], "KEEP_FREED_MEMORY"),
    (["checkpoint", "--mb", "1"], "format 2"),
    (["insnet", "--iters", "1", "--seqs", "2", "--batch", "2", "--it_batch", "2", "--lengths", "8",
      *GPT], "     8 "),
])
def test_each_benchmark_prints_its_table(argv, last_row, capsys):
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith(last_row), out
    if argv[0] == "decode":
        greedy = next(line for line in out if line.startswith("greedy")).split()
        assert greedy[-1] == "True"  # the same tokens as HF's greedy generate()


def test_the_survey_comparison_trains_each_architecture(capsys, monkeypatch):
    """bench.py arch at a half-second budget and toy sizes: a row per architecture, the parameter
    formulas equal to the counted parameters, and nothing but training in the budget (no
    termination probe, no curves.png)."""
    import train
    monkeypatch.setattr(bench, "ARCH", {"rnn": dict(n_layer=2, d_model=16),
                                        "lstm": dict(n_layer=1, d_model=16),
                                        "gcnn": dict(n_layer=1, d_model=16, kernel_size=4),
                                        "gpt": dict(n_layer=1, d_model=16, n_head=2)})
    argvs, real_fit = [], train.fit
    monkeypatch.setattr(train, "fit", lambda argv, advise=True: argvs.append(argv) or real_fit(argv, advise))
    assert bench.main(["arch", "--budget", "0.5", "--eval_every", "2", "--limit", "8"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[-4:]
    assert [r.split()[0] for r in rows] == ["rnn", "lstm", "gcnn", "gpt"]
    params = [re.findall(r"\b\d[\d,]*\b", r)[:2] for r in rows]  # after the shape (2x16 k4)
    assert all(formula == counted for formula, counted in params), rows
    assert all("--probe" in a and a[a.index("--probe") + 1] == "0" and "--no_curves" in a
               for a in argvs)
