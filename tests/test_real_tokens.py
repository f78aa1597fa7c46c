"""Only real tokens cost: a right-padded batch of lines runs the output layer on the targets that
count alone and the RNN / LSTM packed, with the numbers of the dense path (every position
computed, the loss masked) in float64: every head, RNN, LSTM and GPT, the paper's continuation
loss and the authors' objective (their context loss, ST's floor, the context's p(eos))."""

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import PackedSequence
from torch.utils._python_dispatch import TorchDispatchMode

import model
from conftest import small_cfg
from data.loader import pad_batch
from heads import HEADS
from model import LanguageModel

V, EOS = 100, 7  # U has padded(V) = 128 rows: the only matmul output 128 wide
LENGTHS, CONTEXTS = (3, 41, 14, 26), (1, 10, 10, 4)  # lines of very different lengths


MODEL_PACKED_ON = model.PACKED_ON


@pytest.fixture(autouse=True)
def packed_on_the_cpu(monkeypatch):
    # A GPU runs both recurrent backbones packed (model.PACKED_ON); here the CPU does too.
    monkeypatch.setattr(model, "PACKED_ON", {"rnn": ("cpu",), "lstm": ("cpu",)})


def make(arch, head, protocol="paper"):
    cfg = small_cfg(arch, head, n_layer=2, block_size=64, protocol=protocol)
    torch.manual_seed(0)
    return LanguageModel(cfg).double().train()


def lines(context_loss):
    """A padded batch of lines ending in eos (the authors' protocol: context targets count)."""
    rng = np.random.default_rng(0)
    seqs = [np.append(rng.choice(np.arange(8, V), n - 1), EOS) for n in LENGTHS]
    return pad_batch(seqs, np.array(CONTEXTS), context_loss=context_loss)


def dense(batch):
    """The batch without the positions that count and the rows' lengths: every position is
    computed (the output layer on each, an RNN unpacked), as a stream's."""
    return {k: v for k, v in batch.items() if k not in ("rows", "input_lengths")}


def loss_and_grads(lm, batch, mask):
    """The training loss (the masked sum over the batch's count) and every parameter's gradient."""
    lm.zero_grad()
    log_p = lm(batch)[0]
    loss = -torch.where(mask, log_p, 0.0).sum() / int(mask.sum())
    loss.backward()
    return loss.detach(), torch.where(mask, log_p, 0.0).detach(), [p.grad for p in lm.parameters()]


class OutputRows(TorchDispatchMode):
    """Counts the rows of the matrix products with the output layer's width (padded(V) = 128)."""

    rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.rows += out.size(0) if out.size(-1) == 128 else 0
        return out


@pytest.mark.parametrize("protocol", ["paper", "authors"])
@pytest.mark.parametrize("arch", ["rnn", "lstm", "gpt"])
@pytest.mark.parametrize("head", HEADS)
def test_real_targets_alone_give_the_dense_loss_and_gradients(head, arch, protocol):
    # (the authors' protocol: their context loss and their objective, ST's floor among it)
    lm, batch = make(arch, head, protocol), lines(context_loss=protocol == "authors")
    mask = batch["mask"]
    assert torch.equal(batch["rows"], mask.flatten().nonzero().squeeze(1))
    loss, log_p, grads = loss_and_grads(lm, batch, mask)
    dense_loss, dense_log_p, dense_grads = loss_and_grads(lm, dense(batch), mask)
    torch.testing.assert_close(loss, dense_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(log_p, dense_log_p, rtol=0, atol=1e-6)
    for g, dense_g in zip(grads, dense_grads):
        torch.testing.assert_close(g, dense_g, rtol=0, atol=1e-6)
    assert 0 < int(mask.sum()) <= mask.numel() // 2  # (half the positions or more: padding)


@pytest.mark.parametrize("head", HEADS)
def test_the_output_layer_sees_the_counted_targets_alone(head):
    lm, batch = make("gpt", head), lines(False)
    experts = 2 if head in ("mos", "ctmos") else 1
    with torch.no_grad(), OutputRows() as rows:
        lm(batch)
    assert rows.rows == int(batch["mask"].sum()) * experts
    with torch.no_grad(), OutputRows() as dense_rows:
        lm(dense(batch))
    assert dense_rows.rows == batch["mask"].numel() * experts


@pytest.mark.parametrize("arch", ["rnn", "lstm"])
def test_a_recurrent_backbone_reads_the_real_inputs_alone(arch):
    lm, batch, seen = make(arch, "nmst"), lines(True), []
    lm.backbone.rnn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    lm(batch)
    assert isinstance(seen[0], PackedSequence)
    assert seen[0].data.size(0) == sum(n - 1 for n in LENGTHS)


def test_a_cpu_runs_the_lstm_dense_and_the_rnn_packed(monkeypatch):
    # (model.py's own choice: the packed LSTM is the slower one on a CPU)
    monkeypatch.setattr(model, "PACKED_ON", MODEL_PACKED_ON)
    seen = []
    for arch in ("rnn", "lstm"):
        lm = make(arch, "nmst")
        lm.backbone.rnn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        lm(lines(True))
    assert isinstance(seen[0], PackedSequence)
    assert not isinstance(seen[1], PackedSequence)
