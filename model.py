"""Backbones: RNN (tanh), LSTM and GPT-2, under one contract, plus the LanguageModel that joins a
backbone to an output head (heads.py).

Papers: the survey ("Text generation with neural networks") for the
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
                   GPT  GPTState(kv, key_valid, next_pos, end, padded): per-layer (k, v)
                        caches (B, H, Tc, hd), key_valid (B, Tc) bool (False on padded slots),
                        next_pos (B,) long, and on the host end >= max(next_pos) and whether
                        any slot is padded (so a decoding step reads nothing back)
                   GCNN (past, next_pos, end): per layer the last k-1 inputs (B, k-1, D)
    state = backbone.reorder_state(state, index)   # select / repeat batch rows (beam search)

Feeding a sequence token by token through `state` gives the same h as one full pass
(tests/test_model.py checks this in float64).  Every backbone is causal, so a right-padded batch
needs no `lengths` when only the real positions' outputs are read and no state is kept (training
and perplexity): the padding comes after them and cannot change them.  That path runs
attention with is_causal and no mask (FlashAttention on a GPU).  The RNN / LSTM are given the
lengths there all the same and run packed (the LSTM on a GPU only: PACKED_ON), at the cost of
the real tokens.
"""

import collections
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from common import UserError
from heads import Head, padded

MODELS = ("rnn", "lstm", "gcnn", "gpt")
WINDOWED = ("gcnn", "gpt")  # learned positions: a context window of block_size tokens
# Where a batch of lines runs its recurrent backbone packed (LanguageModel.forward): on a GPU, and
# the tanh RNN on a CPU too.  On a CPU torch's packed LSTM is 1.4-5x slower than its fused dense
# kernel even with 3/4 of a batch padding, while the packed RNN gains where padding is heavy
# (RESULTS.md); padding after a row's real inputs cannot change them, so dense gives the same.
PACKED_ON = {"rnn": ("cpu", "cuda"), "lstm": ("cuda",)}


@contextlib.contextmanager
def eval_mode(module):
    """Evaluation mode (no dropout) inside the block, the module's previous mode after it."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


# --- RNN / LSTM -------------------------------------------------------------------------------
class Recurrent(nn.Module):
    """Embedding -> dropout -> n_layer nn.RNN(tanh) / nn.LSTM (dropout between layers) -> dropout.
    d_model is both the embedding and the hidden size, so the output layer can be tied."""

    def __init__(self, cell, vocab_size, d_model=512, n_layer=2, dropout=0.5, locked_dropout=False):
        super().__init__()
        if cell not in ("rnn", "lstm"):
            raise ValueError(f"unknown recurrent cell '{cell}' (rnn or lstm)")
        self.cell, self.d_model, self.locked, self.p = cell, d_model, locked_dropout, dropout
        self.wte = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        rnn_cls = nn.LSTM if cell == "lstm" else nn.RNN
        kw = {} if cell == "lstm" else {"nonlinearity": "tanh"}
        self.rnn = rnn_cls(
            d_model,
            d_model,
            num_layers=n_layer,
            batch_first=True,
            dropout=dropout if n_layer > 1 else 0.0,
            **kw,
        )
        nn.init.uniform_(self.wte.weight, -0.1, 0.1)

    def _dropout(self, x):
        """Standard dropout, or variational / locked dropout (one mask per sequence, shared over
        time, as in AWD-LSTM; CT paper eq. 8's regularised setting) with --locked_dropout."""
        if not self.locked or not self.training or self.p == 0:
            return self.drop(x)
        return x * self.drop(x.new_ones(x.size(0), 1, x.size(2)))  # (B, 1, D): one mask per row

    def forward(self, idx, state=None, lengths=None):
        x = self._dropout(self.wte(idx))  # (B, T, D)
        # float32 even under autocast: autocast's cuDNN RNN wrapper casts to float16 whatever
        # dtype was asked (README, GPU), which would silently train an LSTM in unscaled fp16
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(self.rnn.weight_ih_l0.dtype)
            if lengths is None:
                out, state = self.rnn(x, state)
            else:
                # Packed: each row runs over its real tokens alone, and the returned state is
                # the one after its last real token (a decoder's prompt goes on from there).
                packed = pack_padded_sequence(
                    x, lengths.cpu(), batch_first=True, enforce_sorted=False
                )
                # The zero start state made here: nn.LSTM would read the batch size back from
                # the packed batch sizes (a tensor read a call) to make it.
                if state is None:
                    zeros = x.new_zeros(self.rnn.num_layers, x.size(0), self.d_model)
                    state = (zeros, zeros) if self.cell == "lstm" else zeros  # LSTM: (h, c)
                out, state = self.rnn(packed, state)
                out, _ = pad_packed_sequence(out, batch_first=True, total_length=idx.size(1))
        dropped = self._dropout(out)
        # Kept for AR / TAR (CT paper eq. 8), which read the output before and after dropout.
        self.last_output = (out, dropped)
        return dropped, state

    def activation_regularisation(self, ar, tar):
        """CT paper eq. 8 (from AWD-LSTM), on the last layer's output of the latest forward:
        AR  = ar  * mean(dropped output ^ 2)                 (penalises large activations)
        TAR = tar * mean((h_t - h_{t-1}) ^ 2), raw output     (penalises fast changes)."""
        raw, dropped = self.last_output
        return (
            ar * dropped.float().pow(2).mean()
            + tar * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()
        )

    @staticmethod
    def reorder_state(state, index):
        # The batch is dimension 1 of a recurrent state: (layers, B, D).
        if isinstance(state, tuple):  # LSTM (h, c)
            return tuple(s.index_select(1, index) for s in state)
        return state.index_select(1, index)


# --- GPT-2 ------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x, past=None, attn_mask=None):
        """x (B, T, C), past (k, v) cache or None, attn_mask "causal" (a fresh unpadded
        sequence), None (attend to every key) or a boolean / additive (B, 1|H, T, Tc+T) mask
        -> (y (B, T, C), (k, v) including this call's keys and values)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        if past is not None:  # (B, H, Tc + T, hd)
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        p = self.dropout if self.training else 0.0
        if isinstance(attn_mask, str):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, n_embd, dropout, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

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


GPTState = collections.namedtuple("GPTState", "kv key_valid next_pos end padded")  # (contract)


class GPT(nn.Module):
    """GPT-2: token + learned position embeddings, n_layer pre-LN blocks, final LayerNorm.
    Module names follow GPT-2's checkpoints (wte, wpe, h.i.attn.c_attn, ...)."""

    def __init__(self, cfg):
        """cfg: a config dict's vocab_size, block_size, n_layer, n_head, d_model (n_embd),
        dropout, bias."""
        super().__init__()
        vocab_size, block_size, n_embd = cfg["vocab_size"], cfg["block_size"], cfg["d_model"]
        n_layer, n_head, dropout, bias = cfg["n_layer"], cfg["n_head"], cfg["dropout"], cfg["bias"]
        self.block_size, self.d_model, self.n_layer = block_size, n_embd, n_layer
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.apply(self._init_weights)
        # GPT-2 scales the projections into the residual stream by 1 / sqrt(2 n_layer): each
        # block adds two of them, and the stream's variance should not grow with the depth.
        for name, p in self.named_parameters():
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
        new_valid = (
            torch.ones(B, T, dtype=torch.bool, device=dev)
            if lengths is None
            else torch.arange(T, device=dev) < lengths.to(dev).unsqueeze(1)
        )  # (B, T)
        if state is None:
            state = GPTState(
                [None] * self.n_layer,
                new_valid[:, :0],
                torch.zeros(B, dtype=torch.long, device=dev),
                0,
                False,
            )
        # Absolute positions: each row goes on from its own count of real tokens.
        pos = state.next_pos.unsqueeze(1) + torch.arange(T, device=dev)  # (B, T)
        # Checked on the host (end bounds every row's position): no device sync.
        if state.end + T > self.block_size:
            raise ValueError(
                f"sequence of {state.end + T} tokens exceeds the GPT context window "
                f"(block_size={self.block_size})"
            )
        # Whether a padded key exists decides the mask: none lets sdpa run unmasked (causal).
        padded = state.padded or (lengths is not None and bool((lengths < T).any()))
        attn_mask, key_valid = self.attention_mask(state.key_valid, new_valid, padded)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        new_kv = []
        for block, past in zip(self.h, state.kv):
            x, layer_kv = block(x, past, attn_mask)
            new_kv.append(layer_kv)
        n_real = new_valid.sum(1) if lengths is not None else T
        return self.ln_f(x), GPTState(
            new_kv, key_valid, state.next_pos + n_real, state.end + T, padded
        )

    @staticmethod
    def attention_mask(key_valid, new_valid, padded):
        """key_valid (B, Tc) of the cache, new_valid (B, T) of this call, padded: whether any
        key so far is padding -> (mask, key_valid (B, Tc + T)).  The mask is "causal" for a
        fresh unpadded sequence (training, perplexity), None for one new token with no padded
        key (it sees the whole cache), else boolean (B, 1, T, Tc + T): causal and no padded key
        (decoding right-padded prompts of different lengths)."""
        Tc, T = key_valid.size(1), new_valid.size(1)
        key_valid = torch.cat([key_valid, new_valid], dim=1)  # (B, Tc + T)
        # Without a padded key a query needs no mask beyond causality: sdpa's fast paths.
        if Tc == 0 and not padded:
            return "causal", key_valid
        if T == 1 and not padded:
            return None, key_valid
        dev = key_valid.device
        causal = torch.arange(Tc + T, device=dev) <= (Tc + torch.arange(T, device=dev)).unsqueeze(1)
        return (causal.unsqueeze(0) & key_valid.unsqueeze(1)).unsqueeze(1), key_valid

    @staticmethod
    def reorder_state(state, index):
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in state.kv]
        return state._replace(
            kv=kv,
            key_valid=state.key_valid.index_select(0, index),
            next_pos=state.next_pos.index_select(0, index),
        )


# --- gated convolutional LM (the survey's chapter 4; Dauphin et al. 2017) ---------------------
class GatedConv(nn.Module):
    """One gated convolutional layer, the survey's eq. 4.1:
        H(X) = (X * W + b) (x) sigmoid(X * V + c)
    with W, V (k, D, D) kernels (one Conv1d of 2D output channels, [W; V]), made causal by
    zero-padding the input with k-1 positions on the left: output t sees inputs t-k+1 .. t."""

    def __init__(self, d_model, kernel_size):
        super().__init__()
        self.k = kernel_size
        self.conv = nn.Conv1d(d_model, 2 * d_model, kernel_size)  # [X * W + b ; X * V + c]

    def forward(self, x, past):
        """x (B, T, D), past (B, k-1, D): the layer's previous k-1 inputs (zeros at the start)
        -> (H (B, T, D), the padded input (B, k-1+T, D) the next call's past is cut from)."""
        # Left padding by the past inputs: output t sees no input after t (causal), and a
        # token-by-token call sees what a full pass sees.
        padded = torch.cat([past, x], dim=1)
        z = self.conv(padded.transpose(1, 2)).transpose(1, 2)  # (B, T, 2D)
        proj, gate = z.chunk(2, dim=-1)
        return proj * torch.sigmoid(gate), padded  # eq. 4.1


class GCNN(nn.Module):
    """Gated convolutional LM: token + learned position embeddings, n_layer residual blocks
    x + dropout(GatedConv(LayerNorm(x))), a final LayerNorm (the norms are nanogen's choice, for
    stable training; Dauphin et al. use weight normalisation), tied output.  Receptive field
    (k-1) n_layer + 1 tokens.  The incremental state is, per layer, its last k-1 inputs."""

    def __init__(
        self, vocab_size, block_size=1024, n_layer=8, d_model=512, kernel_size=4, dropout=0.1
    ):
        super().__init__()
        self.block_size, self.d_model, self.k = block_size, d_model, kernel_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.ln = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(n_layer)])
        self.convs = nn.ModuleList([GatedConv(d_model, kernel_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(GPT._init_weights)

    def forward(self, idx, state=None, lengths=None):
        B, T = idx.shape
        dev, k = idx.device, self.k
        if state is None:
            zeros = torch.zeros(B, k - 1, self.d_model, device=dev, dtype=self.wte.weight.dtype)
            state = ([zeros] * len(self.convs), torch.zeros(B, dtype=torch.long, device=dev), 0)
        # end bounds every row's position, on the host: the window is checked without a sync.
        past, pos0, end = state
        pos = pos0.unsqueeze(1) + torch.arange(T, device=dev)  # (B, T)
        if end + T > self.block_size:
            raise ValueError(
                f"sequence of {end + T} tokens exceeds the GCNN context window "
                f"(block_size={self.block_size})"
            )
        n_real = torch.full((B,), T, device=dev) if lengths is None else lengths.to(dev)
        # The next call's past: each row's last k-1 real inputs of its padded input (k-1 + T),
        # which end at index n_real + k-2 (right padding comes after them).
        keep = n_real.view(B, 1, 1) + torch.arange(k - 1, device=dev).view(1, -1, 1)  # (B,k-1,1)
        x, new_past = self.drop(self.wte(idx) + self.wpe(pos)), []
        for ln, conv, p in zip(self.ln, self.convs, past):
            h, padded = conv(ln(x), p)
            new_past.append(padded.gather(1, keep.expand(-1, -1, self.d_model)))  # last k-1 real
            x = x + self.drop(h)
        return self.ln_f(x), (new_past, pos0 + n_real, end + T)

    @staticmethod
    def reorder_state(state, index):
        past, pos, end = state
        return [p.index_select(0, index) for p in past], pos.index_select(0, index), end


# --- backbone + head --------------------------------------------------------------------------
def build_backbone(cfg):
    """The backbone of a config dict (train.py's model_config writes it, checkpoints keep it)."""
    V, D = cfg["vocab_size"], cfg["d_model"]
    # A checkpoint written before --protocol existed holds none: the paper's.
    if cfg.get("protocol") not in (None, "paper", "authors"):
        raise ValueError(f"unknown protocol '{cfg['protocol']}' (paper or authors)")
    if cfg["model"] == "gpt":
        return GPT(cfg)
    if cfg["model"] == "gcnn":
        return GCNN(V, cfg["block_size"], cfg["n_layer"], D, cfg["kernel_size"], cfg["dropout"])
    if cfg["model"] in ("rnn", "lstm"):
        rnn = Recurrent(
            cfg["model"], V, D, cfg["n_layer"], cfg["dropout"], cfg.get("locked_dropout", False)
        )
        if cfg.get("protocol") == "authors":
            # The authors' src/wiki2 (model_utils.py, README commands): nn.Embedding's own
            # N(0, 1) initialisation, and no dropout between the layers (--rnn-dropout 0.0).
            nn.init.normal_(rnn.wte.weight)
            rnn.rnn.dropout = 0.0
        return rnn
    raise ValueError(f"no backbone for model '{cfg['model']}': add its branch to build_backbone")


class LanguageModel(nn.Module):
    """p(y_t | y_<t, x) = head(backbone(tokens)), built from a plain config dict.

    t, the continuation step of every position, is a (B, T) tensor made where the tokens are
    (data/loader.collate, decode.py): t = 1 at the first continuation token, <= 0 on the
    context and on padding.  Only the ST / NMST heads read it."""

    def __init__(self, cfg):
        super().__init__()
        if cfg["model"] not in MODELS:
            raise ValueError(f"unknown model '{cfg['model']}' (choose from {', '.join(MODELS)})")
        self.cfg = dict(cfg)
        self.backbone = build_backbone(dict(cfg, vocab_size=padded(cfg["vocab_size"])))
        self.head = Head(
            cfg["head"],
            cfg["d_model"],
            cfg["vocab_size"],
            cfg["eos_id"],
            cfg["epsilon"],
            n_experts=cfg.get("n_experts", 1),
            ct_alpha=cfg.get("ct_alpha"),
            ct_beta=cfg.get("ct_beta"),
            ct_rank=cfg.get("ct_rank", 0),
            temperature=cfg.get("temperature", 1.0),
            authors=cfg.get("protocol") == "authors",
        )
        # Weight tying (NMST paper appendix D; GPT-2): U is the input embedding.
        if cfg["tie"]:
            self.head.proj.weight = self.backbone.wte.weight
        self.eos_id = self.head.eos_id

    def forward(self, batch, state=None):
        """The training and perplexity call, as nanoGPT's model(X, Y) returns its loss: a batch
        of data/loader.get_batch -> (log p of every target (B, T), the mask of the targets that
        count (B, T), the state to go on from).  The head gives log p of the targets alone,
        never the (B, T, V) log-probabilities, and only at the batch's rows (0 elsewhere: the
        mask says which count; no rows: every position).  state: the backbone's, or None."""
        # A batch of lines is right-padded (data/loader.pad_batch), and says where: a recurrent
        # backbone runs packed over each row's real inputs (PACKED_ON); every backbone is causal,
        # so the padding after the real positions cannot change them (the others read (B, T)).
        lengths = None
        if batch["inputs"].device.type in PACKED_ON.get(self.cfg["model"], ()):
            lengths = batch.get("input_lengths")  # (B,) on the host, or None: unpacked
        h, state = self.backbone(batch["inputs"], state, lengths)
        # The output layer (U: V x D) dominates a step: it runs on the batch's rows alone, the
        # flat positions of the targets that count (a stream has none: every position counts).
        rows = batch.get("rows")  # (N,)
        log_p = self.head.target_log_probs(h, batch["targets"], batch["t"], None, rows)[0]
        # The loss is summed in float32 at least, whatever autocast computed the head in.
        if log_p.dtype in (torch.float16, torch.bfloat16):
            log_p = log_p.float()
        if batch["mask"] is None:
            # A stream (CT's continuous text): every token counts, and the state goes on.
            return log_p, torch.ones_like(log_p, dtype=torch.bool), state
        # A batch of lines: each line starts afresh.
        return log_p, batch["mask"], None

    def log_probs(self, idx, t=None, state=None, lengths=None):
        """The decoders' call: every position's distribution.  idx (B, T), t (B, T); state =
        (backbone_state, head_state) or None -> log_probs (B, T, V), new state."""
        bstate, hstate = (None, None) if state is None else state
        h, bstate = self.backbone(idx, bstate, lengths)
        log_probs, hstate = self.head(h, t, hstate)
        return log_probs, (bstate, hstate)

    def prompt(self, idx, lengths):
        """Encode right-padded prompts (B, P) and return log p(y_1 | x) (B, V) with the state
        after each prompt: the head runs on the last prompt position only (t = 1).  Context
        positions never enter the ST running product, so the head state starts empty."""
        # The prompts are right-padded: the backbone is told their lengths (an RNN packed, GPT
        # masking the padded keys), so the state is the one after each prompt's last token.
        h, bstate = self.backbone(idx, None, lengths)
        rows = torch.arange(idx.size(0), device=h.device)
        h_last = h[rows, lengths - 1].unsqueeze(1)  # (B, 1, D)
        t = torch.ones(idx.size(0), 1, dtype=torch.long, device=h.device)
        log_probs, hstate = self.head(h_last, t, None)
        return log_probs[:, 0], (bstate, hstate)

    def reorder_state(self, state, index):
        # Beam search keeps, repeats or drops rows: the backbone's state and ST's running product.
        bstate, hstate = state
        hstate = None if hstate is None else hstate.index_select(0, index)
        return self.backbone.reorder_state(bstate, index), hstate

    def num_params(self):
        # Those in use: not the padding rows of the vocabulary (heads.padded), of the embedding
        # and, untied, of U too.
        V = self.cfg["vocab_size"]
        pad = (padded(V) - V) * self.cfg["d_model"]
        return sum(p.numel() for p in self.parameters()) - pad * (2 - self.cfg["tie"])

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6 N for the matmul weights (forward + backward; the output
        projection counts, the position-embedding lookup does not) plus, for GPT, attention's
        12 L d T at the mean training length T (PaLM appendix B, as nanoGPT's estimate_mfu)."""
        cfg, n = self.cfg, self.num_params()
        VD = cfg["vocab_size"] * cfg["d_model"]
        if cfg["model"] in WINDOWED:
            n -= self.backbone.wpe.weight.numel()
        # Untied, the input embedding is a lookup, no matmul: its weights do no FLOPs.
        if not cfg.get("tie", True):
            n -= VD
        # MoS: U projects each of the K experts' latents, K products of V x D a token.
        if cfg["head"] in ("mos", "ctmos"):
            n += (cfg["n_experts"] - 1) * VD
        attn = 12 * cfg["n_layer"] * cfg["d_model"] * seq_len if cfg["model"] == "gpt" else 0
        return 6 * n + attn


# --- GPT-2's pretrained weights (train.py --init_from gpt2) -----------------------------------
HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt_state_from_hf(hf_state, lm):
    """HuggingFace GPT2LMHeadModel's state_dict as lm's (a LanguageModel with a GPT backbone):
    its four Conv1D (in, out) matrices transposed to nn.Linear's (out, in), the attention-mask
    buffers skipped, U tied to wte; a head's own parameters (MoS, CT) keep their initialisation."""
    own, out = lm.state_dict(), {}
    for k, v in hf_state.items():
        # HF's causal-mask buffers are not weights, and its lm_head is tied to wte.
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue
        name = "backbone." + k.removeprefix("transformer.")
        v = v.t() if name.endswith(HF_CONV1D) else v
        # GPT-2's 50257 embedding rows, padded with zeros to the model's 50304 (heads.padded).
        if name == "backbone.wte.weight" and name in own:
            v = torch.cat([v, v.new_zeros(max(0, len(own[name]) - len(v)), *v.shape[1:])])
        if name not in own or v.shape != own[name].shape:
            raise UserError(f"the GPT-2 weight {k!r} {tuple(v.shape)} does not fit the model")
        out[name] = v
    missing = [k for k in own if k.startswith("backbone.") and k not in out]
    if missing:
        raise UserError(f"the GPT-2 weights lack {missing[0]} (and {len(missing) - 1} more)")
    return {**own, **out, "head.proj.weight": out["backbone.wte.weight"]}
