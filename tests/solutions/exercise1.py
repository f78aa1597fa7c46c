"""The solution of exercise 1 (docs/exercises.md): a termination head alpha_t = sigmoid(z_eos +
w log t) with a learned scalar w.  Try the exercise before reading on; `python -m
tests.check_exercise 1` grades your own answer.

EDITS: (file, anchor, what replaces it), in the exercise's order, applied by solutions.apply.
Applied, they leave a tree that `ruff format --check` and `ruff check` pass."""

# Head.__init__'s line that the head's parameter follows.
VOCAB_SIZE_LINE = (
    "        self.vocab_size = vocab_size  # U's rows past it are padding, sliced off (padded)"
)
# Each edit's anchor is a line of the shipped code; its new text keeps the anchor's meaning
# and adds the exercise's lines beside it.
EDITS = [
    (
        "heads.py",
        'HEADS = ("softmax", "st", "nmst", "mos", "ct", "ctmos")',
        'HEADS = ("softmax", "st", "nmst", "mos", "ct", "ctmos", "logt")',
    ),
    (
        "heads.py",
        'TERMINATION_HEADS = ("st", "nmst")',
        'TERMINATION_HEADS = ("st", "nmst", "logt")',
    ),
    (
        "heads.py",
        "def st_log_alpha(",
        '''def logt_log_alpha(z_eos, t, w):
    """Coursework exercise 1:  alpha_t = sigmoid(z_eos + w log t), w a learned scalar.
    In log space, with a = z_eos + w log t:  log(alpha_t) = logsigmoid(a),
    log(1 - alpha_t) = logsigmoid(-a).  z_eos (...); t (...) (t <= 0: scored as t = 1)
    -> (log_alpha, log_one_minus_alpha), each (...)."""
    # The eos terms in float32 at least: under bf16 autocast t = 300 .. 303 would share one
    # p(eos).  t <= 0 (context, padding) is scored as t = 1, and t takes z_eos's dtype before
    # its log (the log of an integer tensor is float32).
    z_eos = _eos_precision(z_eos)
    t = torch.clamp(torch.as_tensor(t, device=z_eos.device), min=1).to(z_eos.dtype)
    a = z_eos + w * torch.log(t)
    # Not log(1 - sigmoid(a)): sigmoid(a) is 1 in float32 from a = 17 on, its log -inf.
    return F.logsigmoid(a), F.logsigmoid(-a)


def st_log_alpha(''',
    ),
    (
        "heads.py",
        VOCAB_SIZE_LINE,
        VOCAB_SIZE_LINE + "\n"
        "        # Each head its own learned w, 0 at the start: p(eos) = sigmoid(z_eos) then.\n"
        '        if kind == "logt":\n'
        "            self.w = nn.Parameter(torch.zeros(()))",
    ),
    (
        "heads.py",
        '        if self.kind == "st":\n            return st_log_probs(',
        '        if self.kind == "logt":\n'
        "            z_eos = logits[..., self.eos_id]\n"
        "            log_alpha, log_one_minus_alpha = logt_log_alpha(z_eos, t, self.w)\n"
        "            return _assemble(logits, self.eos_id, log_alpha, log_one_minus_alpha), None\n"
        '        if self.kind == "st":\n            return st_log_probs(',
    ),
    (
        "heads.py",
        '        elif self.kind == "st":\n            log_alpha, log_one_minus_alpha, head_state',
        '        elif self.kind == "logt":\n'
        "            log_alpha, log_one_minus_alpha = logt_log_alpha(z_eos, t, self.w)\n"
        '        elif self.kind == "st":\n            log_alpha, log_one_minus_alpha, head_state',
    ),
    # The student's own float64 test of the formula, beside the shipped heads' tests.
    (
        "tests/test_heads.py",
        "def test_softmax_matches_eq2():",
        '''@pytest.mark.parametrize("w", [-1.5, 0.5, 2.0])
def test_logt_matches_its_formula_float64(w):
    """alpha_t = sigmoid(z_eos + w log t), t <= 0 scored as t = 1."""
    from heads import logt_log_alpha

    z = torch.randn(3, 7, dtype=torch.float64) * 10
    t = steps(-2, z.shape)
    alpha = torch.sigmoid(z + w * torch.log(t.clamp(min=1).double()))
    log_alpha, log_one_minus_alpha = logt_log_alpha(z, t, torch.tensor(w))
    torch.testing.assert_close(log_alpha.exp(), alpha, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(log_one_minus_alpha.exp(), 1 - alpha, atol=1e-12, rtol=1e-9)


def test_softmax_matches_eq2():''',
    ),
]
