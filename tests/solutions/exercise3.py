"""The solution of exercise 3 (docs/exercises.md): a dilated gated CNN, "dgcnn", whose layer l
convolves inputs 2^l positions apart.  Try the exercise before reading on; `python -m
tests.check_exercise 3` grades your own answer.

EDITS: (file, anchor, what replaces it), applied by solutions.apply.  Applied, they leave a tree
that `ruff format --check` and `ruff check` pass."""

# Each edit's anchor is a line of the shipped code: the new backbone goes beside GCNN in the
# lists of models, in build_backbone and in train.py's recipes.
EDITS = [
    # Its name in MODELS and WINDOWED: the commands build it, and decoding knows its window.
    (
        "model.py",
        'MODELS = ("rnn", "lstm", "gcnn", "gpt")',
        'MODELS = ("rnn", "lstm", "gcnn", "gpt", "dgcnn")',
    ),
    ("model.py", 'WINDOWED = ("gcnn", "gpt")', 'WINDOWED = ("gcnn", "gpt", "dgcnn")'),
    (
        "model.py",
        "class LanguageModel(nn.Module):",
        """class DilatedGCNN(GCNN):
    \"\"\"GCNN whose layer l convolves inputs d = 2^l apart; its state keeps (k-1) d inputs.\"\"\"

    def __init__(self, vocab_size, block_size, n_layer, d_model, kernel_size, dropout):
        super().__init__(vocab_size, block_size, n_layer, d_model, kernel_size, dropout)
        # Layer l reads k inputs 2^l apart: (k - 1) 2^l past inputs, which its state keeps.
        self.spans = [(kernel_size - 1) * 2**i for i in range(n_layer)]
        for conv, span in zip(self.convs, self.spans):
            conv.conv.dilation = (span // (kernel_size - 1),)

    def forward(self, idx, state=None, lengths=None):
        B, T = idx.shape
        dev = idx.device
        # A new sequence: zeros before its first token, as GCNN's causal padding.
        if state is None:
            past = [torch.zeros(B, s, self.d_model, device=dev) for s in self.spans]
            state = (past, torch.zeros(B, dtype=torch.long, device=dev), 0)
        past, pos0, end = state
        if end + T > self.block_size:
            raise ValueError("longer than the window")
        n_real = torch.full((B,), T, device=dev) if lengths is None else lengths.to(dev)
        x = self.drop(self.wte(idx) + self.wpe(pos0.unsqueeze(1) + torch.arange(T, device=dev)))
        new_past = []
        for ln, conv, p, span in zip(self.ln, self.convs, past, self.spans):
            h, padded = conv(ln(x), p)
            # Each row's last span real inputs: a right-padded prompt ends before the batch.
            keep = n_real.view(B, 1, 1) + torch.arange(span, device=dev).view(1, -1, 1)
            new_past.append(padded.gather(1, keep.expand(-1, -1, self.d_model)))
            x = x + self.drop(h)
        return self.ln_f(x), (new_past, pos0 + n_real, end + T)


class LanguageModel(nn.Module):""",
    ),
    # Its branch in build_backbone, before the recurrent ones.
    (
        "model.py",
        '    if cfg["model"] in ("rnn", "lstm"):\n        rnn = Recurrent(',
        '    if cfg["model"] == "dgcnn":\n'
        "        return DilatedGCNN(\n"
        '            V, cfg["block_size"], cfg["n_layer"], D, cfg["kernel_size"], cfg["dropout"]\n'
        "        )\n"
        '    if cfg["model"] in ("rnn", "lstm"):\n        rnn = Recurrent(',
    ),
    # train.py's recipes: the anchor is the shipped GCNN's entry, the new one goes before it.
    (
        "train.py",
        '    "gcnn": {**PLATEAU',
        '    "dgcnn": {**PLATEAU, "n_layer": 6, "d_model": 512, "dropout": 0.1},\n'
        '    "gcnn": {**PLATEAU',
    ),
]
