"""The vocabulary padded to a multiple of 64 rows (heads.padded): the same numbers as an unpadded
model with the same weights (float64), padded ids never produced, parameters and FLOPs counted
over the rows in use, an older unpadded checkpoint refused in one line."""

import pytest
import torch

import common
import heads
import insnet
import model
from conftest import small_cfg, steps, target_log_p
from heads import HEADS
from model import LanguageModel

V, EOS = 100, 7  # padded to 128


def make(arch, head, pad=True, monkeypatch=None, **kw):
    if not pad:  # the same model without padding rows
        monkeypatch.setattr(heads, "padded", lambda v: v)
        monkeypatch.setattr(model, "padded", lambda v: v)
    torch.manual_seed(0)
    lm = LanguageModel(small_cfg(arch, head, **kw)).double().eval()
    monkeypatch and monkeypatch.undo()
    return lm


@pytest.mark.parametrize("arch", ["lstm", "gpt"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("tie", [True, False])
def test_padded_equals_unpadded_with_the_same_weights(arch, head, tie, monkeypatch):
    lm, ref = make(arch, head, tie=tie), make(arch, head, False, monkeypatch, tie=tie)
    assert lm.head.proj.weight.shape[0] == 128 == lm.backbone.wte.weight.shape[0]
    assert ref.head.proj.weight.shape[0] == V
    with torch.no_grad():  # the padding rows made large: they must still count for nothing
        lm.head.proj.weight[V:] = 1e3 * torch.randn(28, 16, dtype=torch.float64)
    own = ref.state_dict()
    # Each tensor cut to ref's shape, dimension by dimension (a 0-d parameter, a head's learned
    # scalar say, stays as it is).
    ref.load_state_dict({k: v[tuple(map(slice, own[k].shape))] for k, v in lm.state_dict().items()})
    idx, t = torch.randint(0, V, (3, 12)), steps(-4, (3, 12))
    with torch.no_grad():
        lp, _ = lm.log_probs(idx, t)
        torch.testing.assert_close(
            lp, ref.log_probs(idx, t)[0], rtol=0, atol=1e-12
        )  # (B, T, V): the real rows only
        torch.testing.assert_close(
            target_log_p(lm, idx, t, idx)[0],
            target_log_p(ref, idx, t, idx)[0],
            rtol=0,
            atol=1e-12,
        )
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 12, dtype=torch.float64))
    counts = lm.num_params(), lm.flops_per_token(12)
    monkeypatch.setattr(model, "padded", lambda v: v)  # ref's rows are all in use
    assert counts == (ref.num_params(), ref.flops_per_token(12))
    assert counts[0] == sum(p.numel() for p in ref.parameters())


def test_insnet_never_inserts_a_padding_id():
    cfg = dict(
        model="insnet",
        vocab_size=V,
        d_model=16,
        n_layer=1,
        n_head=2,
        dropout=0.0,
        max_offset=8,
        block_size=32,
    )
    torch.manual_seed(0)
    m = insnet.InsNet(cfg).eval()
    assert m.wte.weight.shape[0] == 128
    with torch.no_grad():
        m.wte.weight[V:] = (
            1e3  # (tied: the output rows) the most probable tokens, were they not masked
        )
        logits = m.token_logits(torch.randn(5, 16))
    assert torch.isinf(logits[:, V:]).all() and torch.isfinite(logits[:, :V]).all()
    g = torch.Generator().manual_seed(0)
    out = insnet.generate(m, [1, 2], 20, insnet.Decoding("sample", min_len=10), generator=g)
    assert out["inserted"] > 0 and max(out["tokens"]) < V


def test_an_unpadded_checkpoint_is_refused_in_one_line(tmp_path):
    lm = make("lstm", "nmst")
    state = {
        k: v[:V] if k.endswith(("wte.weight", "proj.weight")) else v
        for k, v in lm.state_dict().items()
    }
    args = dict(model="lstm", head="nmst", task="completion", dataset="ptb", window=None)
    ckpt = dict(config=lm.cfg, model=state, args=args, vocab={}, state=dict(step=0))
    torch.save(ckpt, tmp_path / "old.pt")
    with pytest.raises(common.UserError, match="written before nanogen padded the vocabulary"):
        common.load_checkpoint(str(tmp_path / "old.pt"))
    torch.save(dict(ckpt, model=lm.state_dict()), tmp_path / "new.pt")
    assert (
        common.load_checkpoint(str(tmp_path / "new.pt"))["model"]["backbone.wte.weight"].shape[0]
        == 128
    )


@pytest.mark.parametrize("head", ["softmax", "st", "nmst"])
def test_the_loss_path_s_masking_is_not_recorded_by_autograd(head):
    """The padding rows (and ST / NMST's eos) are set to -inf outside autograd: a recorded
    in-place fill of the (B, T, padded(V)) logits would copy their whole gradient in backward
    (CopySlices), a pass over the largest tensor of a GPT-2 step.  (Its gradient is checked
    against the full forward in test_heads.py.)"""
    lm = make("gpt", head)
    idx = torch.randint(0, V, (2, 12))
    log_p = target_log_p(lm, idx, steps(-4, (2, 12)), idx)[0]
    seen, todo = set(), [log_p.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [f for f, _ in fn.next_functions]
    names = {type(fn).__name__ for fn in seen}
    assert "CopySlices" not in names, names
