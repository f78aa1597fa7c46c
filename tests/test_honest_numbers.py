"""No silently wrong number: an evaluation reads the sequences it says it reads, a perplexity
over no token is refused, a run evaluates each step once, and the termination probe stops when
the run is asked to stop."""

import argparse
import json
import os
import signal
import time

import numpy as np
import pytest
import torch

import config
import evaluate
import train
from conftest import TINY_LSTM, assert_one_line_error, run_in_process
from model import LanguageModel

TINY = TINY_LSTM + ["--probe", "0", "--no_curves"]


def tiny_lm(vocab_size, eos_id):
    cfg = dict(config.DEFAULTS, model="lstm", n_layer=1, d_model=8, dropout=0.0)
    cfg = dict(cfg, tie=True, bias=True, vocab_size=vocab_size, eos_id=eos_id)
    return LanguageModel(cfg)


def completion_args(**over):
    a = dict(config.DEFAULTS, model="lstm", task="completion", dataset="ptb", window=None)
    a.update(batch_size=8, max_tokens=None, train_seqs=0, eval_seqs=0, **over)
    return argparse.Namespace(**a)


class Split:
    """A split of hand-made sequences, as data/loader.CompletionSplit serves them."""

    def __init__(self, seqs, contexts):
        self.seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
        self.lengths = np.array([len(s) for s in seqs])
        self.contexts = np.asarray(contexts, dtype=np.int64)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]


def test_an_evaluation_of_the_train_split_reads_its_limit(ptb):
    """--split train --limit 5 scores 5 sequences (it scored them all, and said -195 skipped)."""
    _, splits = ptb
    res = evaluate.perplexity(completion_args(), tiny_lm(10_000, 0), dict(splits), "train", 5)
    assert res["sequences"] == 5 and res["skipped"] == 0


def test_a_perplexity_over_no_token_is_refused():
    """No sequence fits the window: an error, not a perplexity of 1.00."""
    data = dict(valid=Split([[5, 6, 7, 8, 1]] * 3, [2] * 3))
    args = completion_args(window=2)
    with pytest.raises(evaluate.UserError, match="no token to score"):
        evaluate.perplexity(args, tiny_lm(16, 1), data, "valid")


def test_nanogen_metric_over_no_long_line_is_no_number():
    """Every continuation is eos alone: nanogen's metric has no token, so it gives no number
    (it printed "1.00 over 0 tokens"); the metric over every target still has one."""
    data = dict(valid=Split([[5, 6, 7, 1]] * 3, [3] * 3))
    args = completion_args()
    res = evaluate.perplexity(args, tiny_lm(16, 1), data, "valid")
    assert res["ppl_nanogen"] is None and res["tokens_nanogen"] == 0 and res["tokens"] == 3
    assert "- (no such line here)" in evaluate.report(args, res, "valid")


def test_the_probe_length_is_bounded(capsys):
    rc, err = run_in_process(train.main, TINY + ["--probe_L", "2000000"], capsys)
    assert_one_line_error(rc, err, "--probe_L")


@pytest.mark.slow
def test_an_epoch_limit_evaluates_the_last_step_once(tmp_path):
    """--max_epochs with an --eval_interval that falls on the epoch's last step: one evaluation of
    that step (a second counted as a plateau and halved the learning rate)."""
    out = tmp_path / "run"
    flags = ["--max_epochs", "1", "--eval_interval", "6", "--lr_schedule", "plateau"]
    train.main(TINY + flags + ["--out_dir", str(out)])
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in log] == [6, 12]
    assert {r["lr"] for r in log} == {3e-3}


@pytest.mark.slow
def test_a_signal_during_the_probe_stops_the_run(tmp_path, monkeypatch):
    """A model that never ends makes the probe decode --probe_L tokens a context: SIGTERM there
    gives the probe up, and the run stops with its checkpoint as after any signal."""

    def endless_probe(args, model, data):
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(train, "probe", endless_probe)
    out = tmp_path / "run"
    flags = ["--max_iters", "4", "--eval_interval", "2", "--probe", "4"]
    train.main(TINY_LSTM + flags + ["--out_dir", str(out)])
    ckpt = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert ckpt["state"]["stopped"] == "SIGTERM" and ckpt["state"]["step"] == 2
