"""torchrun with 2 CPU processes (gloo) == 1 process with the same global batch: rank-sharded
micro-batches, gradient accumulation scaled by the world size, all-reduced metrics."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

ARGS = ["--model", "lstm", "--head", "st", "--epsilon", "1e-3", "--dataset", "wikitext2", "--d_model", "32",
        "--dropout", "0", "--batch_size", "4", "--grad_accum", "2", "--lr", "3e-3", "--train_seqs", "200",
        "--eval_seqs", "40", "--max_iters", "8", "--eval_interval", "4", "--seed", "3"]


def run(cmd, out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd + ARGS + ["--out_dir", str(out_dir)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]


def test_two_processes_match_one(tmp_path):
    one = run([sys.executable, "train.py"], tmp_path / "one")
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"],
              tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [4, 8]
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4 * abs(a["train_loss"])
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-4 * abs(a["val_loss"])
    assert one[1]["val_loss"] < one[0]["val_loss"]
