"""model.py: one contract for every backbone; incremental == full forward (float64, 1e-6)."""

import os
import shutil

import pytest
import torch

import common
from conftest import DEVICES, steps, target_log_p
from model import MODELS, LanguageModel

V, EOS = 40, 3


def make(model, head="softmax", **kw):
    cfg = dict(
        model=model,
        head=head,
        epsilon=1e-2,
        vocab_size=V,
        eos_id=EOS,
        n_layer=2,
        d_model=24,
        dropout=0.0,
        tie=True,
        n_head=4,
        block_size=48,
        bias=True,
        kernel_size=3,
    )
    cfg.update(kw)
    torch.manual_seed(0)
    return LanguageModel(cfg).double().eval()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_incremental_equals_full(model, head):
    lm = make(model, head)
    idx = torch.randint(0, V, (3, 30))
    with torch.no_grad():
        full, _ = lm.log_probs(idx, steps(-8, (3, 30)))
        h_full, _ = lm.backbone(idx)
        state, outs, hs = None, [], []
        for i in range(30):
            h, bstate = lm.backbone(idx[:, i : i + 1], None if state is None else state[0])
            hs.append(h)
            lp, state = lm.log_probs(idx[:, i : i + 1], steps(-8 + i, (3, 1)), state=state)
            outs.append(lp)
        # uneven chunks through the same state
        state, chunks = None, []
        for lo, hi in [(0, 11), (11, 12), (12, 20), (20, 30)]:
            lp, state = lm.log_probs(idx[:, lo:hi], steps(-8 + lo, (3, hi - lo)), state=state)
            chunks.append(lp)
    torch.testing.assert_close(torch.cat(hs, 1), h_full, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_right_padding_lengths_and_state(model):
    """With lengths, each row's outputs and final state equal those of the row alone."""
    lm = make(model, "st")
    idx = torch.randint(0, V, (3, 14))
    lengths = torch.tensor([14, 9, 4])
    nxt = torch.randint(0, V, (3, 1))
    t = torch.where(torch.arange(14) < lengths.unsqueeze(1), steps(-8, (3, 14)), 0)  # 0: padding
    with torch.no_grad():
        lp, state = lm.log_probs(idx, t, lengths=lengths)
        lp_next, _ = lm.log_probs(nxt, (-8 + lengths).unsqueeze(1), state=state)
        for b in range(3):
            L = int(lengths[b])
            alone, st = lm.log_probs(idx[b : b + 1, :L], steps(-8, (1, L)))
            torch.testing.assert_close(lp[b, :L], alone[0], atol=1e-9, rtol=0)
            nxt_alone, _ = lm.log_probs(nxt[b : b + 1], steps(-8 + L, (1, 1)), state=st)
            torch.testing.assert_close(lp_next[b], nxt_alone[0], atol=1e-9, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_reorder_state(model):
    lm = make(model, "st")
    idx = torch.randint(0, V, (3, 6))
    nxt = torch.randint(0, V, (4, 1))
    order = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = lm.log_probs(idx, steps(-2, (3, 6)))
        a, _ = lm.log_probs(nxt, steps(5, (4, 1)), state=lm.reorder_state(state, order))
        _, state2 = lm.log_probs(idx[order], steps(-2, (4, 6)))
        b, _ = lm.log_probs(nxt, steps(5, (4, 1)), state=state2)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_target_log_probs_and_normalisation(model, head):
    lm = make(model, head)
    idx, y = torch.randint(0, V, (2, 15)), torch.randint(0, V, (2, 15))
    y[:, 12] = EOS
    with torch.no_grad():
        lp, _ = lm.log_probs(idx, steps(-8, (2, 15)))
        torch.testing.assert_close(
            target_log_p(lm, idx, steps(-8, (2, 15)), y)[0],
            lp.gather(-1, y.unsqueeze(-1)).squeeze(-1),
        )
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, 15, dtype=torch.float64))


def test_weight_tying_and_gpt_window():
    lm = make("gpt")
    assert lm.head.proj.weight is lm.backbone.wte.weight
    assert (
        make("lstm", tie=False).head.proj.weight is not make("lstm", tie=False).backbone.wte.weight
    )
    with pytest.raises(ValueError, match="context window"):
        lm.log_probs(torch.zeros(1, 49, dtype=torch.long), steps(1, (1, 49)))


def test_unknown_model_rejected():
    with pytest.raises(ValueError, match="unknown model"):
        make("transformer-xl")


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")),
    reason="torch.compile (inductor) needs a C++ compiler on CPU",
)
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_matches_eager(device):
    """What train.py --compile does (common.compile_model: torch.compile, inductor): the same
    log-probs and gradients as the eager model, and unchanged state_dict keys (so checkpoints of
    compiled runs load into plain models).  A tiny model: inductor compiles in about 20 s on
    the CPU."""
    torch.manual_seed(0)
    cfg = dict(
        model="gpt",
        head="nmst",
        epsilon=1e-3,
        vocab_size=50,
        eos_id=49,
        n_layer=1,
        d_model=16,
        n_head=2,
        block_size=32,
        dropout=0.0,
        tie=True,
        bias=True,
    )
    eager, plain = LanguageModel(cfg).to(device), LanguageModel(cfg).to(device)
    plain.load_state_dict(eager.state_dict())
    compiled = common.compile_model(plain)  # (no CUDA graphs: graphs=False, its default)
    torch._dynamo.utils.counters.clear()
    x = torch.randint(0, 50, (2, 12), device=device)
    grads = []
    for lm in (eager, compiled):
        # the training path
        log_p = target_log_p(lm, x[:, :-1], steps(1, (2, 11)).to(device), x[:, 1:])[0]
        log_p.sum().backward()
        grads.append((log_p.detach(), [p.grad.clone() for p in lm.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    for g_c, g_e in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-5)
    assert list(compiled._orig_mod.state_dict()) == list(eager.state_dict())  # (train.py's raw)
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # the calls went through torch.compile
    assert not torch._dynamo.utils.counters["graph_break"]  # the training path is one graph


def test_gpt_training_dropout_on_cpu_drops_attention_weights():
    """In training mode on CPU the GPT takes the math path: outputs differ between two forward
    passes (dropout), and with dropout 0 training equals evaluation."""
    lm = make("gpt", dropout=0.3).float().train()
    idx = torch.randint(0, V, (2, 12))
    a, b = lm.backbone(idx)[0], lm.backbone(idx)[0]
    assert not torch.allclose(a, b)
    lm0 = make("gpt", dropout=0.0).float().train()
    torch.testing.assert_close(lm0.backbone(idx)[0], lm0.eval().backbone(idx)[0])


def test_gated_conv_is_eq_4_1():
    """The survey's eq. 4.1, H = (X * W + b) (x) sigmoid(X * V + c), computed directly in
    float64 with the k-1 zero inputs on the left, against GatedConv (and its carried past)."""
    from model import GatedConv

    torch.manual_seed(0)
    B, T, D, k = 2, 9, 5, 3
    layer = GatedConv(D, k).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    W, V = layer.conv.weight[:D], layer.conv.weight[D:]  # (D_out, D_in, k) each
    b, c = layer.conv.bias[:D], layer.conv.bias[D:]
    xp = torch.cat([torch.zeros(B, k - 1, D, dtype=torch.float64), x], 1)
    direct = torch.zeros(B, T, D, dtype=torch.float64)
    for t in range(T):
        window = xp[:, t : t + k]  # (B, k, D): inputs t-k+1 .. t
        proj = torch.einsum("bjd,edj->be", window, W) + b
        gate = torch.einsum("bjd,edj->be", window, V) + c
        direct[:, t] = proj * torch.sigmoid(gate)
    out, padded = layer(x, torch.zeros(B, k - 1, D, dtype=torch.float64))
    torch.testing.assert_close(out, direct, rtol=0, atol=1e-12)
    split, _ = layer(x[:, 4:], padded[:, 4 : 4 + k - 1])  # the past carried across a split
    torch.testing.assert_close(split, direct[:, 4:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("model", MODELS)
def test_causality_no_output_depends_on_a_later_input(model):
    """Changing the token at position s changes no hidden state before s (and for the GCNN
    none beyond its receptive field (k-1) L + 1 either)."""
    lm = make(model)
    idx = torch.randint(0, V, (1, 20))
    with torch.no_grad():
        h, _ = lm.backbone(idx)
        for s in (0, 7, 19):
            other = idx.clone()
            other[0, s] = (other[0, s] + 1) % V
            h2, _ = lm.backbone(other)
            changed = (h2 - h).abs().amax(-1)[0] > 1e-12
            assert not changed[:s].any() and changed[s]
            if model == "gcnn":  # 2 layers, k = 3: positions s .. s+4 see the change
                assert not changed[s + 5 :].any()


def test_a_backbone_without_its_branch_is_an_error(monkeypatch):
    """Coursework exercise 3 half done (the name in MODELS, no branch in build_backbone): an
    error naming the place, not a recurrent backbone built silently."""
    import model

    monkeypatch.setattr(model, "MODELS", (*MODELS, "mybackbone"))  # (not exercise 3's name)
    with pytest.raises(ValueError, match="add its branch to build_backbone"):
        make("mybackbone")
