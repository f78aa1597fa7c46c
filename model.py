"""Backbones: RNN (tanh), LSTM and GPT-2, under one contract, plus the LanguageModel that joins a
backbone to an output head (heads.py).

Papers: the survey (../shared/papers/survey-text-generation-with-neural-networks.txt) for the
RNN / LSTM / Transformer language models; NMST paper appendix D for the sizes (RNN 2x256,
LSTM 2x512, tied input/output embeddings, dropout 0.3 / 0.5; GPT-2 124M, dropout 0.1);
GPT-2 (Radford et al. 2019) for the architecture: learned absolute positions, pre-LayerNorm
blocks, GELU MLP, causal self-attention, weight tying.

The contract every backbone follows (every head and every decoder relies on it):

    h, state = backbone(idx, state=None, lengths=None)
        idx      (B, T) token ids, right-padded when `lengths` is given
        state    None (start of sequence) or what the previous call returned
        lengths  (B,) number of real tokens of each row of idx (None: all T are real)
        h        (B, T, D) final hidden states (rows past `lengths` are garbage)
        state    the incremental state after the last *real* token of each row:
                   RNN  h_n (layers, B, D)           LSTM (h_n, c_n)
                   GPT  (kv, key_valid, next_pos): per-layer (k, v) caches (B, H, Tc, hd),
                        key_valid (B, Tc) bool (False on padded slots), next_pos (B,) long
    state = backbone.reorder_state(state, index)   # select / repeat batch rows (beam search)

Feeding a sequence token by token through `state` gives the same h as one full pass
(tests/test_model.py checks this in float64).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from heads import Head, every_step

MODELS = ("rnn", "lstm", "gpt")


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------
def dropout(x, p, training=True):
    """Inverted dropout: each element is zeroed with probability p, the rest scaled by 1 / (1 - p).
    On CPU the keep mask is drawn as raw 32-bit random integers r (uniform on [-2^31, 2^31)),
    kept iff r >= round(p 2^32) - 2^31: the drop probability is exact to 2^-32, and drawing it
    this way is 2x faster than torch's bernoulli_ mask here (1.0 vs 2.0 ms forward for a
    (1024, 256) tensor on the 2-core CPU), which matters: a GPT step has 4 n_layer + 1 of them.
    Elsewhere (CUDA, or under torch.compile) F.dropout."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or torch.compiler.is_compiling():  # (inductor fuses its own)
        return F.dropout(x, p, True)
    n = x.numel()
    r = torch.empty((n + 1) // 2, dtype=torch.int64).random_(-2 ** 63, None)  # full 64-bit range
    keep = r.view(torch.int32)[:n].view(x.shape) >= round(p * 2 ** 32) - 2 ** 31
    return x * (keep * torch.tensor(1.0 / (1.0 - p), dtype=x.dtype))  # the mask in x's dtype


class Dropout(nn.Dropout):
    """nn.Dropout with the faster CPU mask of `dropout` (same module, same state dict)."""

    def forward(self, x):
        return dropout(x, self.p, self.training)


# ---------------------------------------------------------------------------------------------
# RNN / LSTM
# ---------------------------------------------------------------------------------------------
class Recurrent(nn.Module):
    """Embedding -> dropout -> n_layer nn.RNN(tanh) / nn.LSTM (dropout between layers) -> dropout.
    d_model is both the embedding and the hidden size, so the output layer can be tied."""

    def __init__(self, cell, vocab_size, d_model=512, n_layer=2, dropout=0.5, locked_dropout=False):
        super().__init__()
        assert cell in ("rnn", "lstm")
        self.cell, self.d_model, self.locked, self.p = cell, d_model, locked_dropout, dropout
        self.wte = nn.Embedding(vocab_size, d_model)
        self.drop = Dropout(dropout)
        rnn_cls = nn.LSTM if cell == "lstm" else nn.RNN
        kw = {} if cell == "lstm" else {"nonlinearity": "tanh"}
        self.rnn = rnn_cls(d_model, d_model, num_layers=n_layer, dropout=dropout if n_layer > 1 else 0.0,
                           batch_first=True, **kw)
        nn.init.uniform_(self.wte.weight, -0.1, 0.1)

    def _dropout(self, x):
        """Standard dropout, or variational / locked dropout (one mask per sequence, shared over
        time, as in AWD-LSTM; CT paper eq. 8's regularised setting) with --locked_dropout."""
        if not self.locked or not self.training or self.p == 0:
            return self.drop(x)
        return x * dropout(x.new_ones(x.size(0), 1, x.size(2)), self.p)  # (B, 1, D): one mask per sequence

    def forward(self, idx, state=None, lengths=None):
        x = self._dropout(self.wte(idx))  # (B, T, D)
        if lengths is None:
            out, state = self.rnn(x, state)
        else:  # packed, so that the returned state is the one after each row's last real token
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, state = self.rnn(packed, state)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=idx.size(1))
        dropped = self._dropout(out)
        self.last_output = (out, dropped)  # for AR / TAR (CT paper eq. 8): before and after dropout
        return dropped, state

    def activation_regularisation(self, ar, tar):
        """CT paper eq. 8 (from AWD-LSTM), on the last layer's output of the latest forward:
        AR  = ar  * mean(dropped output ^ 2)                 (penalises large activations)
        TAR = tar * mean((h_t - h_{t-1}) ^ 2), raw output     (penalises fast changes)."""
        raw, dropped = self.last_output
        return ar * dropped.float().pow(2).mean() + tar * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()

    @staticmethod
    def reorder_state(state, index):
        if isinstance(state, tuple):  # LSTM (h, c), each (layers, B, D)
            return tuple(s.index_select(1, index) for s in state)
        return state.index_select(1, index)


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x, past=None, attn_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        p = self.dropout if self.training else 0.0
        if p > 0 and x.device.type == "cpu" and not torch.compiler.is_compiling():  # sdpa's CPU math, faster mask
            y = self._math_attention(q, k, v, attn_mask, p)
        elif isinstance(attn_mask, str):  # "causal": a fresh sequence, no cache, no padding
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # None (attend to everything) or a boolean (B, 1, T, Tc+T) mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)

    @staticmethod
    def _math_attention(q, k, v, attn_mask, p):
        """dropout(softmax(q k^T / sqrt(hd) + mask)) v: what sdpa itself runs on CPU when there is
        dropout (it has no fused CPU kernel for it), with `dropout`'s faster mask.
        q (B, H, T, hd), k, v (B, H, S, hd), attn_mask "causal" (S = T), None, bool (B, 1, T, S)
        or an additive float mask broadcastable to (B, H, T, S) (InsNet's relative-position
        bias) -> (B, H, T, hd)."""
        T, S = q.size(2), k.size(2)
        att = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-2, -1))  # (B, H, T, S)
        if isinstance(attn_mask, str):
            attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_()
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = attn_mask | ~attn_mask.any(-1, keepdim=True)  # a query with no visible key
            att.masked_fill_(~attn_mask, float("-inf"))  # (a padded row): any finite output
        elif attn_mask is not None:
            att = att + attn_mask
        return torch.matmul(dropout(att.softmax(-1), p), v)


class MLP(nn.Module):
    def __init__(self, n_embd, dropout, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x, past=None, attn_mask=None):
        a, kv = self.attn(self.ln_1(x), past, attn_mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


class GPT(nn.Module):
    """GPT-2: token + learned position embeddings, n_layer pre-LN blocks, final LayerNorm.
    Module names follow GPT-2's checkpoints (wte, wpe, h.i.attn.c_attn, ...)."""

    def __init__(self, vocab_size, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1, bias=True):
        super().__init__()
        self.block_size, self.d_model, self.n_layer = block_size, n_embd, n_layer
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, state=None, lengths=None):
        B, T = idx.shape
        dev = idx.device
        new_valid = torch.ones(B, T, dtype=torch.bool, device=dev) if lengths is None else \
            torch.arange(T, device=dev) < lengths.to(dev).unsqueeze(1)  # (B, T)
        if state is None:
            kv, key_valid, pos0 = [None] * self.n_layer, new_valid[:, :0], torch.zeros(B, dtype=torch.long, device=dev)
        else:
            kv, key_valid, pos0 = state
        pos = pos0.unsqueeze(1) + torch.arange(T, device=dev)  # (B, T) absolute positions
        last = T if state is None else int(pos.max()) + 1  # a fresh sequence: no device sync
        if last > self.block_size:
            raise ValueError(f"sequence of {last} tokens exceeds the GPT context window "
                             f"(block_size={self.block_size})")
        Tc = key_valid.size(1)
        key_valid = torch.cat([key_valid, new_valid], dim=1)  # (B, Tc + T)
        if Tc == 0 and lengths is None:
            attn_mask = "causal"  # a fresh, unpadded sequence: plain causal attention (training path)
        elif T == 1 and (lengths is None or bool(key_valid.all())) and (state is None or bool(key_valid.all())):
            attn_mask = None  # one new token, no padded keys: it attends to every cached key
        else:  # cache and/or padding: an explicit boolean mask
            causal = torch.arange(Tc + T, device=dev) <= (Tc + torch.arange(T, device=dev)).unsqueeze(1)  # (T, Tc+T)
            attn_mask = (causal.unsqueeze(0) & key_valid.unsqueeze(1)).unsqueeze(1)  # (B, 1, T, Tc+T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        new_kv = []
        for block, past in zip(self.h, kv):
            x, layer_kv = block(x, past, attn_mask)
            new_kv.append(layer_kv)
        n_real = new_valid.sum(1) if lengths is not None else torch.full((B,), T, device=dev)
        return self.ln_f(x), (new_kv, key_valid, pos0 + n_real)

    @staticmethod
    def reorder_state(state, index):
        kv, key_valid, pos = state
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
        return kv, key_valid.index_select(0, index), pos.index_select(0, index)


# ---------------------------------------------------------------------------------------------
# backbone + head
# ---------------------------------------------------------------------------------------------
def model_config(args, vocab_size, eos_id):
    """The architecture part of the train.py arguments, as a plain dict stored in checkpoints."""
    cfg = dict(model=args.model, head=args.head, epsilon=args.epsilon, vocab_size=vocab_size, eos_id=eos_id,
               n_layer=args.n_layer, d_model=args.d_model, dropout=args.dropout, tie=not args.no_tie)
    if args.model == "gpt":
        cfg.update(n_head=args.n_head, block_size=args.block_size, bias=not args.no_bias)
    if args.model != "gpt" and args.locked_dropout:
        cfg.update(locked_dropout=True)
    if args.head in ("mos", "ctmos"):
        cfg.update(n_experts=args.n_experts)
    if args.head in ("ct", "ctmos"):
        cfg.update(ct_alpha=args.ct_alpha, ct_beta=args.ct_beta, ct_rank=args.ct_rank)
    if args.temperature != 1.0:
        cfg.update(temperature=args.temperature)
    return cfg


class LanguageModel(nn.Module):
    """p(y_t | y_<t, x) = head(backbone(tokens)).  Built from a plain config dict (model_config)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg["model"] not in MODELS:
            raise ValueError(f"unknown model '{cfg['model']}' (choose from {', '.join(MODELS)})")
        self.cfg = dict(cfg)
        V, D = cfg["vocab_size"], cfg["d_model"]
        if cfg["model"] == "gpt":
            self.backbone = GPT(V, cfg["block_size"], cfg["n_layer"], cfg["n_head"], D, cfg["dropout"], cfg["bias"])
        else:
            self.backbone = Recurrent(cfg["model"], V, D, cfg["n_layer"], cfg["dropout"], cfg.get("locked_dropout", False))
        self.head = Head(cfg["head"], D, V, cfg["eos_id"], cfg["epsilon"], n_experts=cfg.get("n_experts", 1),
                         ct_alpha=cfg.get("ct_alpha", 1.0), ct_beta=cfg.get("ct_beta", 0.5),
                         ct_rank=cfg.get("ct_rank", 0), temperature=cfg.get("temperature", 1.0))
        if cfg["tie"]:  # weight tying (NMST paper appendix D; GPT-2)
            self.head.proj.weight = self.backbone.wte.weight

    @property
    def eos_id(self):
        return self.head.eos_id

    def forward(self, idx, t, state=None, lengths=None, targets=None):
        """idx (B, T); t: continuation step of the first position (int / (B,)) or of every
        position ((B, T)); state = (backbone_state, head_state) or None.
        -> log_probs (B, T, V), new state.   With targets (B, T): -> log p(targets) (B, T), as
        target_log_probs (so that DistributedDataParallel, which hooks forward, sees training)."""
        if targets is not None:
            return self.target_log_probs(idx, targets, t, lengths)
        bstate, hstate = (None, None) if state is None else state
        h, bstate = self.backbone(idx, bstate, lengths)
        if lengths is not None:  # padded positions are no continuation step: ST must not count them
            t = every_step(t, h)
            t = torch.where(torch.arange(h.size(1), device=h.device) < lengths.to(h.device).unsqueeze(1), t, 0)
        log_probs, hstate = self.head(h, t, hstate)
        return log_probs, (bstate, hstate)

    def prompt(self, idx, lengths):
        """Encode right-padded prompts (B, P) and return log p(y_1 | x) (B, V) with the state after
        each prompt: the head runs on the last prompt position only (t = 1).  Context positions
        never enter the ST running product, so the head state starts empty."""
        h, bstate = self.backbone(idx, None, lengths)
        h_last = h[torch.arange(idx.size(0), device=h.device), lengths - 1].unsqueeze(1)  # (B, 1, D)
        log_probs, hstate = self.head(h_last, 1, None)
        return log_probs[:, 0], (bstate, hstate)

    def target_log_probs(self, idx, targets, t, lengths=None):
        """log p(targets (B, T) | prefix) from a fresh start, without the full (B, T, V)
        log-probabilities (training / perplexity path).  -> (B, T)."""
        h, _ = self.backbone(idx, None, lengths)
        return self.head.target_log_probs(h, targets, t)[0]

    def stream_log_probs(self, idx, targets, state=None):
        """Continuous LM (--task stream): log p(targets) (B, T) continuing from the backbone
        state of the previous window, and the new state (to be detached by the caller)."""
        h, state = self.backbone(idx, state)
        return self.head.target_log_probs(h, targets, 1)[0], state

    def reorder_state(self, state, index):
        bstate, hstate = state
        return self.backbone.reorder_state(bstate, index), (None if hstate is None else hstate.index_select(0, index))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------------------------
# checkpoints: written atomically, read with weights_only=True
# ---------------------------------------------------------------------------------------------
CKPT_FORMAT = "nanogen-checkpoint-1"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the CLIs print it as one line."""


def _test_kill_point(name):
    """Test hook (tests/test_faults.py): NANOGEN_TEST_KILL=name:n SIGKILLs this process the n-th
    time it passes `name`, to crash at exact moments (inside a checkpoint write, ...)."""
    import os
    spec = os.environ.get("NANOGEN_TEST_KILL", "")
    if not spec.startswith(name + ":"):
        return
    count = _test_kill_point.seen.get(name, 0) + 1
    _test_kill_point.seen[name] = count
    if count == int(spec.split(":")[1]):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


_test_kill_point.seen = {}


def save_checkpoint(obj, path):
    """The checkpoint is serialised, its sha256 taken, and both written to a temporary file in
    the same folder, fsync-ed, then renamed over `path`: a crash leaves the old file or the new
    one, never half of one, and a file damaged later fails its checksum on load."""
    import hashlib
    import io
    import os
    import tempfile
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(format=CKPT_FORMAT, sha256=hashlib.sha256(payload).hexdigest(), payload=payload), f)
            _test_kill_point("checkpoint-write")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"could not write {path}: {e.strerror or e} (the previous checkpoint, if any, "
                              f"is intact)") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, map_location="cpu"):
    """torch.load(weights_only=True): tensors and plain containers only, never pickled code;
    then the payload's sha256 is checked, so a truncated or damaged file is named as such."""
    import hashlib
    import io
    import os
    import pickle
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")

    def safe_load(f):
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported content"
            raise CheckpointError(f"{path} was refused by safe (weights_only) loading: {first[:200]}") from None
        except Exception as e:  # truncated / not a torch file
            raise CheckpointError(f"{path} is not a readable nanogen checkpoint (damaged or truncated? "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    outer = safe_load(path)
    if not isinstance(outer, dict) or outer.get("format") != CKPT_FORMAT or "payload" not in outer:
        raise CheckpointError(f"{path} is not a nanogen checkpoint (no '{CKPT_FORMAT}' marker)")
    if hashlib.sha256(outer["payload"]).hexdigest() != outer.get("sha256"):
        raise CheckpointError(f"{path} is damaged: its content does not match its sha256")
    ckpt = safe_load(io.BytesIO(outer["payload"]))
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a nanogen checkpoint (no model inside)")
    return ckpt


def model_from_checkpoint(ckpt):
    lm = LanguageModel(ckpt["config"])
    lm.load_state_dict(ckpt["model"])
    return lm


# ---------------------------------------------------------------------------------------------
# HuggingFace GPT-2 checkpoints -> nanogen (used by bench.py; the --init_from loader builds on it)
# ---------------------------------------------------------------------------------------------
HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt_state_from_hf(hf_state, lm):
    """Map a HuggingFace GPT2LMHeadModel state_dict onto lm (a LanguageModel with a GPT backbone).
    HF stores the four projections as Conv1D (in, out): they are transposed to nn.Linear (out, in).
    Shapes are checked key by key; the attention's causal-mask buffers are skipped."""
    own = lm.state_dict()
    out = {}
    for k, v in hf_state.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue  # buffers / the tied output matrix (= wte)
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        target = "backbone." + name
        if target not in own:
            raise ValueError(f"unexpected GPT-2 weight {k!r}")
        if name.endswith(HF_CONV1D):
            v = v.t()
        if tuple(v.shape) != tuple(own[target].shape):
            raise ValueError(f"GPT-2 weight {k!r} has shape {tuple(v.shape)}, the model expects "
                             f"{tuple(own[target].shape)}: wrong --n_layer / --d_model / --n_head / vocabulary?")
        out[target] = v
    missing = [k for k in own if k.startswith("backbone.") and k not in out]
    if missing:
        raise ValueError(f"the GPT-2 checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    out["head.proj.weight"] = out["backbone.wte.weight"]
    return out


GPT2_SIZES = {  # name: (n_layer, n_head, n_embd); all have V = 50257 and 1024 positions
    "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600),
}
HF_HUB = "https://huggingface.co/{name}/resolve/main/{file}"


def read_hf_weights(path):
    """A HuggingFace GPT-2 state_dict from a file or a folder holding model.safetensors (needs the
    safetensors package) or pytorch_model.bin (read with torch.load(weights_only=True))."""
    import os
    if os.path.isdir(path):
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                if name.endswith(".safetensors"):
                    try:
                        import safetensors  # noqa: F401
                    except ImportError:
                        continue
                path = os.path.join(path, name)
                break
        else:
            raise CheckpointError(f"no model.safetensors / pytorch_model.bin in {path}")
    if not os.path.isfile(path):
        raise CheckpointError(f"--weights {path}: no such file")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{path} needs the safetensors package (pip install safetensors)") from None
        return load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable GPT-2 checkpoint ({type(e).__name__})") from None


def fetch_hf_weights(name):
    """Download GPT-2 weights from the HuggingFace hub into the cache (progress bar); no checksum
    is published in a stable place, so the file is checked by loading it."""
    import os
    from data.prepare import cache_dir, DataError
    folder = os.path.join(cache_dir(), "hub", name)
    try:
        import safetensors  # noqa: F401
        files = ("model.safetensors", "pytorch_model.bin")
    except ImportError:
        files = ("pytorch_model.bin",)
    for file in files:
        if os.path.isfile(os.path.join(folder, file)):
            return os.path.join(folder, file)
    if os.environ.get("NANOGEN_OFFLINE"):
        raise CheckpointError(f"{name} weights are not in {folder} and NANOGEN_OFFLINE is set: pass --weights PATH")
    from data.prepare import download
    errors = []
    for file in files:
        try:
            return download(HF_HUB.format(name=name, file=file), os.path.join(folder, file))
        except DataError as e:
            errors.append(str(e))
    raise CheckpointError(f"could not download {name} ({errors[-1]}); pass --weights PATH to a local copy")


def load_pretrained_gpt2(lm, name, weights=None):
    """--init_from gpt2*: copy HF GPT-2 weights (local --weights, else the hub) into lm."""
    hf_state = read_hf_weights(weights) if weights else read_hf_weights(fetch_hf_weights(name))
    lm.load_state_dict(gpt_state_from_hf(hf_state, lm))
    return lm
