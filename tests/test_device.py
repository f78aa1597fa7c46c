"""The CUDA paths, tested without a GPU: a faked one-GPU machine up to the first kernel, the
tensor reads of a training step counted with a TorchDispatchMode, unmasked training attention,
compiled models that stop recompiling, float32 eos terms under autocast, devices of carried
state and of sampling generators, the MFU arithmetic."""

import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import common
import config
import decode
import evaluate
import train
from conftest import DEVICES, run_cli, steps, target_log_p
from data.loader import collate, epoch_batches, get_batch
from heads import nmst_log_probs
from model import MODELS, LanguageModel

TINY = [
    "--dataset",
    "ptb",
    "--d_model",
    "32",
    "--n_layer",
    "1",
    "--n_head",
    "2",
    "--block_size",
    "64",
    "--batch_size",
    "4",
    "--train_seqs",
    "64",
    "--eval_seqs",
    "16",
    "--max_iters",
    "20",
    "--eval_interval",
    "20",
    "--lr",
    "3e-3",
    "--no_curves",
]


# ---------------------------------------------------------------------------------------------
# a faked one-GPU machine: train.py's device set-up runs up to the first real kernel
# ---------------------------------------------------------------------------------------------
REAL_GPU = torch.cuda.is_available()  # asked before any test fakes one


@pytest.fixture
def device_flags():
    """The process-wide switches common.get_device sets (TF32, cuDNN attention), restored after."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


@pytest.fixture
def one_fake_gpu(monkeypatch, device_flags):
    """torch believes in one CUDA device; set_device runs torch's own index validation and
    records the index it would select.  The first real CUDA kernel still fails (CPU build)."""
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", selected.append, raising=False)
    return selected


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_default_run_on_one_gpu_reaches_the_first_kernel(one_fake_gpu, device, tmp_path):
    """`python train.py ...` with --device auto / cuda on a one-GPU machine: cuda:0 is selected
    (an index-less "cuda" is refused by torch.cuda.set_device), TF32 is on, cuDNN's attention
    (a plan built for every new batch shape) is off, and the run gets as far as moving the model
    to the GPU -- where a CPU build of torch stops, with torch's own error and a traceback (not
    a one-line user error)."""
    argv = ["--model", "lstm", *TINY, "--device", device, "--out_dir", str(tmp_path / "run")]
    if REAL_GPU:  # a CUDA build on a GPU machine: past the first kernel, the run trains to its end
        assert run_cli(train.main, argv) == 0
    else:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            run_cli(train.main, argv)
    assert one_fake_gpu == [0]
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert common.get_device(device) == "cuda:0"


def test_a_missing_gpu_or_an_unknown_device_is_a_user_error(one_fake_gpu):
    with pytest.raises(common.UserError, match="this machine has 1 GPU"):
        common.get_device("cuda:1")
    with pytest.raises(
        common.UserError, match="--device mps: unknown device"
    ):  # (MPS has no float64)
        common.get_device("mps")


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's heap")
def test_a_cpu_keeps_freed_memory_in_the_heap(monkeypatch):
    """On a CPU, large freed tensors stay in glibc's heap (M_MMAP_MAX = 0, M_TRIM_THRESHOLD high):
    a step does not page-fault its (B*T, V) tensors in anew."""
    calls = []
    monkeypatch.setattr(
        common.ctypes,
        "CDLL",
        lambda name: types.SimpleNamespace(
            mallopt=lambda option, value: calls.append((option, value))
        ),
    )
    assert common.get_device("cpu") == "cpu"
    assert calls == [(-4, 0), (-1, 2**31 - 1)]


@pytest.mark.slow
@pytest.mark.skipif(REAL_GPU, reason="a real GPU: `python bench.py gpu` times it")
def test_bench_gpu_reaches_its_first_kernel(one_fake_gpu, monkeypatch, capsys):
    """`python bench.py gpu`, the README's first command on a GPU machine: cuda:0 selected, the
    device named, GPT-2 124M's batch (8 x 1024) made first, on the GPU: its first CUDA kernel is
    where a CPU build stops, with torch's own error."""
    import bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    made, randint = [], torch.randint
    monkeypatch.setattr(
        torch, "randint", lambda *a, **k: made.append((a[2], k.get("device"))) or randint(*a, **k)
    )
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        bench.main(["gpu"])
    out = capsys.readouterr().out
    assert (
        one_fake_gpu == [0]
        and out.startswith("NVIDIA H100 80GB HBM3, torch")
        and "train step, cuda:0" in out
    )
    assert made == [((8, 1024), "cuda:0")]


def test_autocast_dtype_is_native_bf16_or_float32(monkeypatch):
    """auto: bfloat16 only where the GPU runs it natively (no emulation), else float32;
    float16 is honoured (train.py then scales the loss with a GradScaler)."""
    seen = []

    def native(including_emulation=True):
        seen.append(including_emulation)
        return native.answer

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", native)
    native.answer = True
    assert common.autocast("cuda:0", "auto").fast_dtype == torch.bfloat16
    native.answer = False
    assert not hasattr(common.autocast("cuda:0", "auto"), "fast_dtype")  # float32 (T4, V100)
    assert seen == [False, False]
    assert common.autocast("cuda:0", "float16").fast_dtype == torch.float16
    assert not hasattr(common.autocast("cpu", "bfloat16"), "fast_dtype")


@pytest.mark.slow
def test_float16_trains_with_a_grad_scaler(monkeypatch, tmp_path, capsys):
    """With float16 autocast (emulated here on the CPU) the loop scales the loss, unscales
    before clipping and steps through the scaler; the checkpoint keeps the scaler's state."""
    monkeypatch.setattr(
        train, "autocast", lambda device, dtype: torch.autocast("cpu", dtype=torch.float16)
    )
    out = tmp_path / "fp16"
    train.main(
        [
            "--model",
            "gpt",
            *TINY,
            "--device",
            "cpu",
            "--dropout",
            "0",
            "--out_dir",
            str(out),
            "--max_iters",
            "6",
            "--eval_interval",
            "3",
        ]
    )
    assert "cpu, float16 autocast" in capsys.readouterr().out  # the precision is said
    ckpt = common.load_checkpoint(str(out / "ckpt_last.pt"))
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0
    import json

    logs = [json.loads(line) for line in open(out / "log.jsonl")]
    assert (
        all(math.isfinite(r["val_loss"]) for r in logs)
        and logs[-1]["val_loss"] < logs[0]["val_loss"] + 0.5
    )


# ---------------------------------------------------------------------------------------------
# host-device syncs: tensor reads per optimizer step
# ---------------------------------------------------------------------------------------------
class ReadCounter(TorchDispatchMode):
    """Counts the reads of tensor values back to Python: item() / bool() / int() (aten
    _local_scalar_dense) and tolist(); `paused` leaves evaluation and checkpoints out."""

    def __init__(self):
        super().__init__()
        self.reads, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "lstm"])
def test_at_most_one_read_per_training_step(model, monkeypatch, tmp_path):
    """A training step reads no tensor back: the losses are read every --log_interval steps;
    evaluation and checkpoint writing, which may read, are not counted.  Goal: <= 1 read per
    optimizer step."""
    counter = ReadCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        counter.reads += not counter.paused
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    for name in ("validate", "check_fits", "save"):
        monkeypatch.setattr(train, name, paused(counter, getattr(train, name)))
    with counter:
        train.main(["--model", model, *TINY, "--device", "cpu", "--out_dir", str(tmp_path / model)])
    assert counter.reads / 20 <= 1, counter.reads


def paused(counter, fn):
    def run(*a, **k):
        was, counter.paused = counter.paused, True
        try:
            return fn(*a, **k)
        finally:
            counter.paused = was

    return run


def test_greedy_decoding_reads_once_per_token():
    """Greedy decoding keeps tokens, scores and lengths on the device: one read per token
    (how many rows just ended), plus a few at the start and end."""
    torch.manual_seed(0)
    cfg = dict(
        model="gpt",
        head="nmst",
        epsilon=1e-9,
        vocab_size=50,
        eos_id=49,
        n_layer=1,
        d_model=16,
        n_head=2,
        block_size=128,
        dropout=0.0,
        tie=True,
        bias=True,
    )
    lm = LanguageModel(cfg).eval()
    prompts = [torch.randint(0, 49, (n,)) for n in (5, 7, 6)]
    counter = ReadCounter()
    with counter:
        out = decode.decode(lm, prompts, 40, "greedy")
    tokens = int(out["lengths"].max())
    assert counter.reads <= tokens + 5, (counter.reads, tokens)


# ---------------------------------------------------------------------------------------------
# attention without a mask in training and perplexity
# ---------------------------------------------------------------------------------------------
def test_training_and_perplexity_attention_is_unmasked(monkeypatch, wikitext2):
    """Right-padded batches go through sdpa with is_causal and no mask (FlashAttention on a
    GPU), and their real positions equal each sequence scored alone."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorded(*a, attn_mask=None, is_causal=False, **k):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*a, attn_mask=attn_mask, is_causal=is_causal, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    _, splits = wikitext2
    torch.manual_seed(0)
    lm = LanguageModel(
        dict(
            model="gpt",
            head="st",
            epsilon=1e-3,
            vocab_size=33278,
            eos_id=0,
            n_layer=1,
            d_model=16,
            n_head=2,
            block_size=512,
            dropout=0.0,
            tie=True,
            bias=True,
        )
    )
    index = [3, 10, 57, 99]
    batch = dict(collate(splits["valid"], index), n=1)
    assert int(batch["lengths"].min()) < int(batch["lengths"].max())  # really padded
    log_p, mask, _ = lm(batch)
    (-log_p[mask].sum()).backward()
    args = train.argparse.Namespace(
        **dict(config.DEFAULTS, task="completion", batch_size=4, eval_seqs=8, window=None)
    )
    evaluate.perplexity(args, lm, dict(splits))
    assert calls and all(calls_ == (True, True) for calls_ in calls)
    for b, i in enumerate(index):
        alone = lm(dict(collate(splits["valid"], [i]), n=1))[0]
        n = alone.size(1)
        torch.testing.assert_close(log_p[b, :n], alone[0], rtol=1e-6, atol=1e-5)  # float32 rounding


# ---------------------------------------------------------------------------------------------
# torch.compile: no recompiles after warm-up
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "gcnn", "lstm"])
def test_compiled_models_stop_recompiling(model, wikitext2):
    """train.py --compile compiles with dynamic shapes: batches of ever new (B, T) reuse the
    graph; at most one more compile (torch specialises a batch of one sequence).  Counted with
    dynamo's CompileCounter backend (dynamo decides recompiles, whatever the backend)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    _, splits = wikitext2
    cfg = dict(
        model=model,
        head="nmst",
        epsilon=1e-3,
        vocab_size=33278,
        eos_id=0,
        n_layer=1,
        d_model=16,
        dropout=0.1,
        tie=True,
        n_head=2,
        block_size=512,
        bias=True,
        kernel_size=3,
    )
    counter = CompileCounter()
    lm = common.compile_model(LanguageModel(cfg).train(), backend=counter)
    args = train.argparse.Namespace(
        **dict(
            config.DEFAULTS,
            task="completion",
            max_tokens=600,
            train_seqs=400,
            model=model,
            window=None if model == "lstm" else 1024,
        )
    )
    shapes, counts = set(), []
    for key in epoch_batches(args, dict(splits), 0)[:16]:
        batch = get_batch(args, dict(splits), key, "cpu")
        shapes.add(tuple(batch["inputs"].shape))
        log_p, mask, _ = lm(batch)
        (-log_p[mask].sum() / batch["n"]).backward()
        counts.append(counter.frame_count)
    assert len(shapes) >= 8
    per_compile = counts[0]
    assert counts[-1] <= 2 * per_compile, counts


def test_compile_asks_inductor_for_no_matmul_padding(monkeypatch):
    """On a GPU inductor pads the (D, V = 50257) product to V = 50264 for the tensor cores, and
    its backward bakes the first batch's T into the padded activation's strides: GPT-2 124M
    recompiled at every new T (RESULTS.md, "On a GPU").  compile_model turns that off (and asks
    for CUDA graphs when told to: train.py on a GPU, with batches in few shapes)."""
    seen = {}
    monkeypatch.setattr(train.torch, "compile", lambda model, **kw: seen.update(kw) or model)
    lm = tiny_lm("gpt", "softmax", "cpu")
    assert common.compile_model(lm) is lm
    assert seen == dict(
        dynamic=True,
        backend="inductor",
        options={"shape_padding": False, "triton.cudagraphs": False},
    )
    common.compile_model(lm, dynamic=False, graphs=True)  # (bench.py's static column, on a GPU)
    assert seen["dynamic"] is False and seen["options"]["triton.cudagraphs"] is True
    monkeypatch.undo()
    assert common.compile_model(lm, backend="eager")._orig_mod is lm  # (train.py's `raw`)


COMPILED_RUNS = [
    [
        "--model",
        "gpt",
        "--task",
        "completion",
        "--n_head",
        "4",
        "--max_tokens",
        "512",
        "--eval_seqs",
        "200",
        *accum,
    ]
    for accum in ([], ["--grad_accum", "2"])
] + [["--model", "lstm", "--task", "stream", "--bptt", "35", "--batch_size", "8"]]


if torch.cuda.is_available():  # (only where it can run, as DEVICES' cuda cases: no skip)

    @pytest.mark.slow
    @pytest.mark.cuda
    def test_compiled_gpt2_on_the_gpu_stops_recompiling():
        """GPT-2 124M with the NMST head, compiled as train.py --compile does, under bf16 autocast:
        batches of new (B, T) reuse the first batch's graphs (inductor, not a counting backend)."""
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        lm = LanguageModel(
            dict(
                model="gpt",
                head="nmst",
                epsilon=1e-3,
                vocab_size=50257,
                eos_id=50256,
                n_layer=12,
                d_model=768,
                n_head=12,
                block_size=1024,
                dropout=0.1,
                tie=True,
                bias=True,
            )
        ).cuda()
        lm = common.compile_model(lm, graphs=True)  # (train.py on a GPU: --max_tokens batches)
        frames = []
        for B, T in ((6, 158), (3, 345), (5, 187)):
            x = torch.randint(0, 50256, (B, T), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                log_p = target_log_p(lm, x, steps(-8, (B, T)).cuda(), x)[0]
            lm.zero_grad(set_to_none=True)  # as train.py: the last replay's gradients are not kept
            log_p.float().sum().backward()
            frames.append(counters["frames"]["ok"])
        assert frames[1:] == frames[:1] * 2, frames

    @pytest.mark.slow
    @pytest.mark.cuda
    @pytest.mark.parametrize("flags", COMPILED_RUNS)
    def test_a_compiled_run_on_the_gpu_equals_an_eager_one(flags, tmp_path, no_tf32):
        """train.py --compile (on a GPU: CUDA graphs for --max_tokens batches and a stream, a
        capture a (B, T); none with micro-batches; a stream's state goes from one replay into the
        next) trains as the eager run: the same training and validation losses, float32."""
        logs = []
        for run in ("eager", "compiled"):
            compile_flag = []
            if run == "compiled":
                compile_flag = ["--compile"]
            train.main(
                flags
                + [
                    "--dataset",
                    "ptb",
                    "--n_layer",
                    "2",
                    "--d_model",
                    "64",
                    "--dropout",
                    "0",
                    "--max_iters",
                    "6",
                    "--eval_interval",
                    "3",
                    "--dtype",
                    "float32",
                    "--warmup",
                    "0",
                    "--lr",
                    "3e-3",
                    "--probe",
                    "0",
                    "--no_curves",
                    "--device",
                    "cuda",
                    "--out_dir",
                    str(tmp_path / run),
                ]
                + compile_flag
            )
            logs.append(
                [
                    json.loads(line)[key]
                    for name, key in (("steps.jsonl", "loss"), ("log.jsonl", "val_loss"))
                    for line in open(tmp_path / run / name)
                ]
            )
        assert len(logs[0]) == 8 and logs[1] == pytest.approx(logs[0], rel=1e-4)

    @pytest.mark.cuda
    def test_training_attention_on_the_gpu_goes_to_flash_not_cudnn(device_flags):
        """After common.get_device, a training step's attention (bfloat16, CausalSelfAttention's
        packed q / k / v, dropout 0.1, causal) goes to flash attention (on Ampere and newer), not
        to cuDNN's, which builds a plan for every new (B, T) (torch's first choice on an H100)."""
        from torch.nn.attention import SDPBackend

        common.get_device("cuda:0")
        B, T, H, hd = 3, 187, 12, 64
        x = torch.randn(B, T, 3 * H * hd, device="cuda", dtype=torch.bfloat16)
        q, k, v = (z.view(B, T, H, hd).transpose(1, 2) for z in x.split(H * hd, dim=2))
        choice = torch._fused_sdp_choice(q, k, v, dropout_p=0.1, is_causal=True)
        assert SDPBackend(choice) != SDPBackend.CUDNN_ATTENTION
        if torch.cuda.get_device_capability() >= (8, 0):  # flash attention: Ampere and newer
            assert SDPBackend(choice) == SDPBackend.FLASH_ATTENTION


# ---------------------------------------------------------------------------------------------
# numerics under autocast
# ---------------------------------------------------------------------------------------------
def test_nmst_eos_terms_stay_float32_under_bf16_autocast():
    """Under bf16 autocast (CPU rules here, the CUDA ones alike) t and the eos terms stay in
    float32: 1023 consecutive t give 1023 distinct p(eos), each close to float64."""
    z = torch.randn(1, 1023, 20, dtype=torch.float64)
    t = steps(1, (1, 1023))
    ref = nmst_log_probs(z, t, 19, 1e-3)[..., 19].exp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.randn(1, 1023, 8)
        lm = torch.nn.Linear(8, 20)
        low = lm(h)  # a bf16 tensor, as the head's logits are under autocast
        assert low.dtype == torch.bfloat16
        got = nmst_log_probs(z.bfloat16(), t, 19, 1e-3)[..., 19]
    assert got.dtype == torch.float32
    assert len(set(got.exp().flatten().tolist())) == 1023
    assert float((got.exp().double() - ref).abs().max()) < 2e-2


def test_recurrent_layers_run_float32_under_autocast():
    """autocast's cuDNN RNN wrapper casts to float16 whatever dtype is asked (README, GPU):
    the recurrent layers run outside autocast, in float32."""
    cfg = dict(
        model="lstm",
        head="softmax",
        epsilon=1e-3,
        vocab_size=30,
        eos_id=0,
        n_layer=1,
        d_model=8,
        dropout=0.0,
        tie=True,
    )
    lm = LanguageModel(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, (h_n, c_n) = lm.backbone(torch.randint(0, 30, (2, 5)))
    assert h.dtype == h_n.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# where carried state and sampling live
# ---------------------------------------------------------------------------------------------
def test_a_resumed_stream_state_moves_to_the_device():
    """A checkpoint's hidden state is loaded on the CPU; the loop moves it to the model's device
    (here 'meta', standing in for a GPU) and detaches it after each window."""
    state = (torch.zeros(1, 2, 4, requires_grad=True) * 2, torch.zeros(1, 2, 4))
    moved = common.state_to(state, "meta", detach=True)
    assert [(s.device.type, s.grad_fn) for s in moved] == [("meta", None)] * 2 and common.state_to(
        None, "meta"
    ) is None


def test_sampling_generator_lives_with_the_probabilities():
    """Sampling draws on the model's device with a generator made there (decode.sampling_generator);
    a generator elsewhere is refused with a message (torch.multinomial's own error is obscure)."""
    log_q = torch.log_softmax(torch.randn(3, 10), -1)
    g = decode.sampling_generator("cpu", 7)
    assert g.device == log_q.device
    a = decode.draw(log_q, g)
    b = decode.draw(log_q, decode.sampling_generator("cpu", 7))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="sampling_generator"):
        decode.draw(log_q, types.SimpleNamespace(device=torch.device("cuda", 0)))


# ---------------------------------------------------------------------------------------------
# MFU
# ---------------------------------------------------------------------------------------------
def test_peak_flops_of_a_few_gpus(monkeypatch):
    """MFU's peak: --peak_flops, else the bf16 dense peak of a few known GPUs (float32: half)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: monkeypatch.name)
    args = types.SimpleNamespace(peak_flops=None, dtype="auto", task="stream", bptt=10)
    lm = types.SimpleNamespace(flops_per_token=lambda length: 1e12)
    for name, peak in (
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 0),
    ):
        monkeypatch.name = name
        assert common.mfu_per_token(args, lm, {}, "cuda:0") == (1e12 / peak if peak else 0.0)
    monkeypatch.name = "NVIDIA A100-SXM4-80GB"
    assert (
        common.mfu_per_token(
            types.SimpleNamespace(**dict(vars(args), dtype="float32")), lm, {}, "cuda:0"
        )
        == 1e12 / 156e12
    )  # TF32: half
    assert common.mfu_per_token(args, lm, {}, "cpu") == 0.0  # (no peak known: no MFU column)


def test_mos_flops_count_every_expert():
    """The output projection runs once per mixture component."""
    cfg = dict(
        model="lstm",
        head="mos",
        epsilon=1e-3,
        vocab_size=100,
        eos_id=0,
        n_layer=1,
        d_model=8,
        dropout=0.0,
        tie=True,
        n_experts=4,
    )
    lm, base = LanguageModel(cfg), LanguageModel(dict(cfg, n_experts=1))
    extra = sum(p.numel() for p in lm.parameters()) - sum(p.numel() for p in base.parameters())
    assert lm.flops_per_token(10) - base.flops_per_token(10) == 6 * (extra + 3 * 100 * 8)


# ---------------------------------------------------------------------------------------------
# the equalities to check first on a new GPU machine (`python -m pytest -q -m cuda`): each one
# runs on every device present, the CPU always, CUDA where there is one; float32, TF32 off
# ---------------------------------------------------------------------------------------------
def tiny_lm(model, head, device):
    torch.manual_seed(0)
    return (
        LanguageModel(
            dict(
                model=model,
                head=head,
                epsilon=1e-3,
                vocab_size=64,
                eos_id=63,
                n_layer=2,
                d_model=32,
                n_head=4,
                block_size=64,
                kernel_size=3,
                dropout=0.0,
                tie=True,
                bias=True,
            )
        )
        .to(device)
        .eval()
    )


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("device", DEVICES)
def test_cached_steps_equal_one_full_forward_in_float32(device):
    """Token-by-token steps through the state == one full forward, every backbone x ST/NMST,
    with the device's own float32 kernels (cuDNN RNN, sdpa; test_model does it in float64)."""
    for model in MODELS:
        for head in ("st", "nmst"):
            lm = tiny_lm(model, head, device)
            idx = torch.randint(0, 63, (3, 20), device=device)
            t = steps(-4, (3, 20)).to(device)
            with torch.no_grad():
                full, _ = lm.log_probs(idx, t)
                state, rows = None, []
                for i in range(20):
                    lp, state = lm.log_probs(idx[:, i : i + 1], t[:, i : i + 1], state)
                    rows.append(lp)
            torch.testing.assert_close(torch.cat(rows, 1), full, atol=1e-4, rtol=0)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("device", DEVICES)
def test_termination_heads_on_the_device_equal_float64(device):
    """The ST / NMST log-probs in float32 on the device (relative error 1e-5: they reach
    hundreds of nats), and p(eos) under bf16 autocast for t up to 10^4, against float64."""
    from heads import st_log_probs

    torch.manual_seed(0)
    z = 5 * torch.randn(2, 1000, 64, dtype=torch.float64)
    t = steps(1, (2, 1000))
    zd, td = z.float().to(device), t.to(device)
    for got, ref in (
        (nmst_log_probs(zd, td * 10, 63, 1e-3), nmst_log_probs(z, t * 10, 63, 1e-3)),
        (st_log_probs(zd, td, 63, 1e-3)[0], st_log_probs(z, t, 63, 1e-3)[0]),
    ):
        assert float(((got.cpu().double() - ref).abs() / ref.abs().clamp(min=1)).max()) < 1e-5
    z16 = z.bfloat16()  # under autocast the logits are bf16; t and the eos terms must not be
    with torch.autocast(device, dtype=torch.bfloat16):
        lp = nmst_log_probs(z16.to(device), td * 10, 63, 1e-3)
    ref16 = nmst_log_probs(z16.double(), t * 10, 63, 1e-3)[..., 63].exp()
    torch.testing.assert_close(lp[..., 63].double().exp().cpu(), ref16, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.usefixtures("no_tf32")  # train.py turns TF32 on for CUDA: undone afterwards
@pytest.mark.parametrize("device", DEVICES)
def test_a_resumed_run_on_the_device_equals_an_uninterrupted_one(device, tmp_path):
    """train.py on the device with dropout: 6 steps, or 3 steps then --resume to 6: the same
    validation losses (the device's RNG state goes into the checkpoint and back)."""
    flags = [
        "--model",
        "gpt",
        "--dataset",
        "synthetic",
        "--synthetic_count",
        "16",
        "--n_layer",
        "2",
        "--d_model",
        "64",
        "--n_head",
        "4",
        "--block_size",
        "256",
        "--batch_size",
        "8",
        "--eval_interval",
        "3",
        "--device",
        device,
        "--seed",
        "1",
        "--warmup",
        "0",
        "--dropout",
        "0.1",
    ]
    logs = []
    for run, stops in (("a", [6]), ("b", [3, 6])):
        for i, n in enumerate(stops):
            train.main(
                flags
                + ["--out_dir", str(tmp_path / run), "--max_iters", str(n)]
                + (["--resume"] if i else [])
            )
        logs.append([json.loads(line)["val_loss"] for line in open(tmp_path / run / "log.jsonl")])
    assert len(logs[0]) == 2 and logs[0] == pytest.approx(logs[1], abs=1e-5)


def test_mfu_counts_the_sequences_trained_on(wikitext2):
    """MFU divides tokens/s by the peak at the mean length of the sequences actually trained on
    (--train_seqs; a GPT's window leaves out longer ones), not of the whole split."""
    _, splits = wikitext2
    seen = []
    lm = types.SimpleNamespace(flops_per_token=lambda length: seen.append(length) or 1e9)
    args = types.SimpleNamespace(
        peak_flops=1e12, dtype="auto", task="completion", train_seqs=10, model="lstm", window=None
    )
    assert common.mfu_per_token(args, lm, dict(splits), "cpu") == pytest.approx(1e-3)
    args.train_seqs, args.window = 0, 40
    common.mfu_per_token(args, lm, dict(splits), "cpu")
    inputs = splits["train"].lengths - 1
    assert seen == pytest.approx([float(inputs[:10].mean()), float(inputs[inputs <= 40].mean())])
