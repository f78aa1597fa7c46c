"""bench.py's benchmarks run end to end at toy sizes and print their tables.  What they print is
a measurement, not asserted (figures are not tests) -- except where a benchmark checks a fact
beside its timings: nanogen's greedy decoding picks HuggingFace generate()'s tokens."""

import pytest

import bench
import common
import train

pytestmark = pytest.mark.slow  # seconds each: python -m pytest -m "" runs them
GPT = ["--gpt_layers", "1", "--gpt_dim", "32", "--gpt_heads", "2"]


@pytest.mark.parametrize(
    "argv, last_row",
    [
        (["train", "--iters", "1", "--rounds", "1", "--batch", "1", "--seq", "8", *GPT], "lstm "),
        (["batches", "--dataset", "ptb"], "test "),
        (["decode", "--iters", "1", "--prompts", "2", "--new_tokens", "3", *GPT], "beam-4"),
        (
            [
                "insnet",
                "--iters",
                "1",
                "--seqs",
                "2",
                "--batch",
                "2",
                "--it_batch",
                "2",
                "--lengths",
                "8",
                *GPT,
            ],
            "     8 ",
        ),
        (["gpu"], "no CUDA device here"),
        # (Table 1's RNN on all of WikiText-2, both protocols, one batch each way: 20 s)
        (["padding", "--steps", "1"], "an authors' epoch / a paper's"),
    ],
)
def test_each_benchmark_prints_its_table(argv, last_row, capsys):
    if argv == ["gpu"] and train.torch.cuda.is_available():
        pytest.skip("a GPU: python bench.py gpu times it for real")
    bench.main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith(last_row), out
    if argv[0] == "decode":
        greedy = next(line for line in out if line.startswith("greedy")).split()
        assert greedy[-1] == "True"  # the same tokens as HF's greedy generate()


def test_the_survey_comparison_trains_each_architecture(capsys, monkeypatch):
    """bench.py arch at a half-second budget and toy sizes: a row per architecture, and nothing
    but training in the budget (no termination probe, no curves.png)."""
    monkeypatch.setattr(
        bench, "ARCH", (("rnn", 2, 16), ("lstm", 1, 16), ("gcnn", 1, 16), ("gpt", 1, 16))
    )
    argvs, real = [], train.main
    monkeypatch.setattr(train, "main", lambda argv: argvs.append(argv) or real(argv))
    bench.main(["arch", "--budget", "0.5", "--eval_every", "2"])
    rows = capsys.readouterr().out.strip().splitlines()[-4:]
    assert [r.split()[0] for r in rows] == ["rnn", "lstm", "gcnn", "gpt"]
    assert all(a[a.index("--probe") + 1] == "0" and "--no_curves" in a for a in argvs)


def test_the_timed_train_step_runs_the_compiled_model():
    """bench.py gpu compiles the model as train.py --compile does and times bench.train_step:
    that step must go through the compiled forward (dynamo's CompileCounter counts its frames)."""
    from torch._dynamo.testing import CompileCounter

    train.torch._dynamo.reset()
    counter = CompileCounter()
    lm = common.compile_model(
        bench.LanguageModel(
            bench.cfg_for("gpt", "softmax", 64, n_layer=1, d_model=16, n_head=2)
        ).train(),
        backend=counter,
    )
    x = train.torch.randint(0, 63, (2, 9))
    bench.train_step(lm, x[:, :8], x[:, 1:])()
    assert counter.frame_count >= 1
