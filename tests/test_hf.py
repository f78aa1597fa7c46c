"""nanogen's GPT == HuggingFace GPT2LMHeadModel with the same weights (a randomly initialised
HF-format model the test builds itself): logits and greedy decoding."""

import os

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import data
from common import UserError, load_checkpoint
from decode import decode
from model import LanguageModel, gpt_state_from_hf


def pair(n_layer=2, n_embd=64, n_head=4, V=101, seed=0):
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_positions=128,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    with torch.no_grad():  # non-trivial LayerNorm / bias values, so a missed mapping shows
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = dict(
        model="gpt",
        head="softmax",
        epsilon=1e-5,
        vocab_size=V,
        eos_id=V - 1,
        n_layer=n_layer,
        d_model=n_embd,
        dropout=0.0,
        tie=True,
        n_head=n_head,
        block_size=128,
        bias=True,
    )
    lm = LanguageModel(cfg).eval()
    lm.load_state_dict(gpt_state_from_hf(hf.state_dict(), lm))
    return hf, lm


def test_logits_match_hf():
    hf, lm = pair()
    idx = torch.randint(0, 100, (3, 40))
    with torch.no_grad():
        ref = torch.log_softmax(hf(idx).logits, -1)
        ours, _ = lm.log_probs(idx, None)
    assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_tokens_match_hf_generate():
    hf, lm = pair(seed=1)
    prompts = torch.randint(0, 100, (4, 10))
    with torch.no_grad():
        ref = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=100,
            eos_token_id=100,
        )
    out = decode(lm, prompts, 20, "greedy")
    for i, toks in enumerate(out["tokens"]):
        assert toks == ref[i, 10 : 10 + len(toks)].tolist()
        assert len(toks) == 20 or toks[-1] == 100


@pytest.mark.parametrize("head", ["mos", "ct", "ctmos"])
def test_heads_of_their_own_keep_their_initialisation(head):
    """--init_from gpt2 --head mos / ct / ctmos: GPT-2's weights loaded, the head's own
    parameters (not GPT-2's) as initialised."""
    hf, ref = pair()
    lm = LanguageModel(dict(ref.cfg, head=head, n_experts=3, ct_alpha=1.0, ct_beta=0.5))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    lm.load_state_dict(gpt_state_from_hf(hf.state_dict(), lm))
    for k, v in lm.state_dict().items():
        if k.startswith("backbone.") or k == "head.proj.weight":
            assert torch.equal(v, ref.state_dict()[k]), k
        else:
            assert torch.equal(v, before[k]), k


def test_shape_mismatch_is_refused():
    hf, _ = pair(n_embd=64)
    _, lm = pair(n_embd=32)
    with pytest.raises(UserError, match="does not fit the model"):
        gpt_state_from_hf(hf.state_dict(), lm)


@pytest.mark.slow
def test_train_init_from_hf_checkpoint(tmp_path):
    """--init_from gpt2 --weights DIR with a HF-format checkpoint (pytorch_model.bin) saved by
    the test: the run starts from exactly those weights (same loss as HF's at step 0)."""
    import json
    import os

    import train
    from config import GPT2_SIZES

    GPT2_SIZES["tiny-test"] = (2, 2, 32)  # (and a choice of --init_from: parser() reads it)
    try:
        hf = GPT2LMHeadModel(
            GPT2Config(vocab_size=50257, n_positions=1024, n_embd=32, n_layer=2, n_head=2)
        )
        folder = tmp_path / "hf"
        folder.mkdir()
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
        out = tmp_path / "run"
        base = [
            "--init_from",
            "tiny-test",
            "--weights",
            str(folder),
            "--head",
            "nmst",
            "--max_iters",
            "2",
            "--eval_interval",
            "1",
            "--eval_seqs",
            "8",
            "--train_seqs",
            "30",
            "--lr",
            "1e-12",
            "--dropout",
            "0",
        ]
        train.main(base + ["--dataset", "wikitext103", "--out_dir", str(out)])
        ckpt = load_checkpoint(str(out / "ckpt_best.pt"))
        ref = hf.state_dict()["transformer.h.0.attn.c_attn.weight"].t()
        assert (ckpt["model"]["backbone.h.0.attn.c_attn.weight"] - ref).abs().max() < 1e-6
        log = [json.loads(x) for x in open(out / "log.jsonl")]
        assert (
            abs(log[0]["val_loss"] - log[1]["val_loss"]) < 1e-5
        )  # lr ~ 0: the loaded weights stay put
        assert os.path.exists(out / "ckpt_best.pt")
        # your own text in GPT-2's BPE finetunes the same weights
        text = tmp_path / "mytext"
        text.mkdir()
        (text / "train.txt").write_text(
            "the company said it would sell its stake in the unit to a group "
            "of investors for cash\n" * 60
        )
        train.main(
            base
            + [
                "--dataset",
                "text",
                "--data_dir",
                str(text),
                "--vocab",
                "bpe",
                "--out_dir",
                str(tmp_path / "own"),
            ]
        )
        ckpt = load_checkpoint(str(tmp_path / "own" / "ckpt_best.pt"))
        assert (ckpt["model"]["backbone.h.0.attn.c_attn.weight"] - ref).abs().max() < 1e-6
    finally:
        GPT2_SIZES.pop("tiny-test")


def test_hub_download_path(tmp_path, monkeypatch):
    """data.gpt2_weights downloads into the cache (here from a file:// 'hub') and reuses it;
    offline with no cached copy it says to pass --weights."""
    from safetensors.torch import save_file

    hf, lm = pair(seed=2)
    (tmp_path / "hub" / "gpt2").mkdir(parents=True)
    save_file(
        {k: v.clone() for k, v in hf.state_dict().items()},
        tmp_path / "hub" / "gpt2" / "model.safetensors",
    )
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "HF_HUB", (tmp_path / "hub").as_uri() + "/{name}/model.safetensors")
    fresh = LanguageModel(lm.cfg)
    fresh.load_state_dict(gpt_state_from_hf(data.gpt2_weights("gpt2"), fresh))
    assert os.path.exists(tmp_path / "cache" / "hub" / "gpt2" / "model.safetensors")
    for k, v in lm.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    assert set(data.gpt2_weights("gpt2")) == set(hf.state_dict())  # cached: no network needed
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="NANOGEN_OFFLINE is set: pass --weights PATH"):
        data.gpt2_weights("gpt2")
    monkeypatch.delenv("NANOGEN_OFFLINE")
    monkeypatch.setattr(data, "HF_HUB", (tmp_path / "nohub").as_uri() + "/{name}/model.safetensors")
    with pytest.raises(
        UserError, match="^could not download file://.*offline\\? pass --weights PATH"
    ):
        data.gpt2_weights("gpt2")  # the hub unreachable: one sentence, one fix


def test_missing_weights_are_said_before_the_data_is_read(tmp_path, monkeypatch):
    """A --weights path that is not there, or GPT-2 weights that cannot be downloaded (offline, not
    in the cache): said at once, not after the data is prepared and the model built."""
    import train

    monkeypatch.setattr(train, "load_data", lambda *a, **k: pytest.fail("read the data"))
    with pytest.raises(UserError, match="not a readable GPT-2 checkpoint"):
        train.main(
            [
                "--init_from",
                "gpt2",
                "--weights",
                str(tmp_path / "gpt2"),
                "--out_dir",
                str(tmp_path / "run"),
            ]
        )
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    with pytest.raises(UserError, match="NANOGEN_OFFLINE is set: pass --weights PATH"):
        train.main(["--init_from", "gpt2", "--out_dir", str(tmp_path / "run")])
