"""The coursework exercises (README), done by following their own text on a copy of the code: a
new termination head, alpha_t = sigmoid(z_eos + w log t), goes through training, evaluation and
`reproduce.py nmst-table1 --scale tiny --heads ... logt`; a head name without its branch is an
error, never a silent ST; a new decoder (typical sampling) samples in sample.py and evaluate.py
like the others; a new backbone (a dilated gated CNN) passes the contract and cached-decoding
tests, trains and decodes."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # end to end: python -m pytest -m "" runs them

# the exercise's places, in the README's order: (file, anchor, what is put before / after it)
EXERCISE_1 = [
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
    """Coursework exercise 1: alpha_t = sigmoid(z_eos + w log t), w a learned scalar.
    -> (log alpha_t, log(1 - alpha_t))."""
    a = z_eos.float() + w * torch.log(torch.clamp(torch.as_tensor(t, device=z_eos.device), min=1)
                                      .float())
    return F.logsigmoid(a), F.logsigmoid(-a)


def st_log_alpha(''',
    ),
    (
        "heads.py",
        "        self.vocab_size = vocab_size  # U's rows past it are padding, sliced off (padded)",
        "        self.vocab_size = vocab_size  # U's rows past it are padding, sliced off (padded)\n"
        '        if kind == "logt":\n            self.w = nn.Parameter(torch.zeros(()))',
    ),
    (
        "heads.py",
        '        if self.kind == "st":\n            return st_log_probs(',
        '        if self.kind == "logt":\n            return _assemble(logits, self.eos_id, *logt_log_alpha('
        "logits[..., self.eos_id], t, self.w)), None\n"
        '        if self.kind == "st":\n            return st_log_probs(',
    ),
    (
        "heads.py",
        '        elif self.kind == "st":\n            log_alpha, log_one_minus_alpha, head_state',
        '        elif self.kind == "logt":\n            log_alpha, log_one_minus_alpha = logt_log_alpha(z_eos, t, '
        'self.w)\n        elif self.kind == "st":\n            log_alpha, log_one_minus_alpha, head_state',
    ),
]


EXERCISE_2 = [  # typical sampling (Meister et al. 2022), --p the kept mass
    (
        "decode.py",
        'DECODERS = ("greedy", "sample", "topk", "nucleus", "beam")',
        'DECODERS = ("greedy", "sample", "topk", "nucleus", "beam", "typical")',
    ),
    (
        "decode.py",
        'SAMPLING = ("sample", "topk", "nucleus")',
        'SAMPLING = ("sample", "topk", "nucleus", "typical")',
    ),
    (
        "decode.py",
        "def filter_log_probs(",
        """def typical_mask(log_probs, p):
    \"\"\"The tokens whose -log p is closest to the entropy, kept until their mass reaches p.\"\"\"
    entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    order = (-log_probs - entropy).abs().argsort(-1)
    mass = log_probs.gather(-1, order).exp().cumsum(-1)
    keep = torch.cat([torch.ones_like(mass[..., :1], dtype=torch.bool), mass[..., :-1] < p], -1)
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def filter_log_probs(""",
    ),
    (
        "decode.py",
        '    elif decoder == "nucleus":\n        mask = nucleus_mask(lp, p)',
        '    elif decoder == "nucleus":\n        mask = nucleus_mask(lp, p)\n    elif decoder == "typical":\n'
        "        mask = typical_mask(lp, p)",
    ),
    (
        "decode.py",
        '("--p", p is not None, ("nucleus",))',
        '("--p", p is not None, ("nucleus", "typical"))',
    ),
    (
        "decode.py",
        'if decoder == "nucleus" and (p is None',
        'if decoder in ("nucleus", "typical") and (p is None',
    ),
]


EXERCISE_3 = [  # a dilated gated CNN: layer l looks 2^l positions apart; it takes --kernel_size
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
        self.spans = [(kernel_size - 1) * 2 ** i for i in range(n_layer)]
        for conv, span in zip(self.convs, self.spans):
            conv.conv.dilation = (span // (kernel_size - 1),)

    def forward(self, idx, state=None, lengths=None):
        B, T = idx.shape
        dev = idx.device
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
            keep = n_real.view(B, 1, 1) + torch.arange(span, device=dev).view(1, -1, 1)
            new_past.append(padded.gather(1, keep.expand(-1, -1, self.d_model)))
            x = x + self.drop(h)
        return self.ln_f(x), (new_past, pos0 + n_real, end + T)


class LanguageModel(nn.Module):""",
    ),
    (
        "model.py",
        '    if cfg["model"] in ("rnn", "lstm"):\n        return Recurrent(',
        '    if cfg["model"] == "dgcnn":\n        return DilatedGCNN(V, cfg["block_size"], cfg["n_layer"], D, '
        'cfg["kernel_size"], cfg["dropout"])\n    if cfg["model"] in ("rnn", "lstm"):\n        return Recurrent(',
    ),
    (
        "train.py",
        '"gcnn": dict(RECURRENT, n_layer=8, dropout=0.1),',
        '"gcnn": dict(RECURRENT, n_layer=8, dropout=0.1),\n           "dgcnn": dict(RECURRENT, n_layer=6, dropout=0.1),',
    ),
]


def exercise_text(n):
    """The README's exercise n: its backticked spans, whitespace collapsed."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[
        text.index("Three exercises that need a code change:") : text.index("## On a GPU")
    ]
    part = re.split(r"\n(?=\d\. \*)", section)[n]
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", part)]


def code_text(*names):
    files = subprocess.run(
        ["git", "ls-files", *names], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    return "\n".join(open(os.path.join(ROOT, f), encoding="utf-8").read() for f in files)


@pytest.mark.parametrize("n, edits", [(1, EXERCISE_1), (2, EXERCISE_2), (3, EXERCISE_3)])
def test_the_text_names_real_places_and_is_what_the_tests_do(n, edits):
    """Every place an exercise's text names exists in the code (or is one the exercise makes),
    every piece of code it spells out is in the edits these tests apply (`...`: anything)."""
    code, done = code_text("*.py"), " ".join(" ".join(new.split()) for _, _, new in edits)
    for span in exercise_text(n):
        if span.startswith("python "):
            assert n == 1 and span.split()[1:] == REPRODUCE_LOGT, span  # the command run below
        elif span.startswith("--"):
            flag = span.split()[0]  # a flag of a command
            assert f'"{flag}"' in code or f'("{flag[2:]}",' in code, span
        elif span.endswith(".py"):
            assert os.path.isfile(os.path.join(ROOT, span)), span
        elif re.fullmatch(r"[\w.]+", span):  # a name, module.name or Class.method
            *owner, name = span.split(".")
            where = code_text(f"{owner[0]}.py") if owner and owner[0].islower() else code
            assert re.search(rf"\b{name}\b", where + done), span
            if owner and not owner[0].islower():
                assert re.search(rf"class {owner[0]}\b[^\n]*:\n(.*\n)*?    def {name}\(", where), (
                    span
                )
        else:  # code
            assert re.search(".*?".join(map(re.escape, span.split("..."))), done), span


REPRODUCE_LOGT = "reproduce.py nmst-table1 --scale cpu --heads softmax nmst logt".split()


def copy_of_the_code(dest):
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    for name in files:
        if name.endswith(".py") or name.startswith("data/"):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            with (
                open(os.path.join(ROOT, name), "rb") as src,
                open(os.path.join(dest, name), "wb") as out,
            ):
                out.write(src.read())


def apply(dest, edits):
    for name, anchor, new in edits:
        path = os.path.join(dest, name)
        text = open(path).read()
        assert text.count(anchor) == 1, (name, anchor)  # the exercise's text names real places
        open(path, "w").write(text.replace(anchor, new))


def test_exercise_1_a_fourth_head_goes_through_reproduce(tmp_path):
    code = tmp_path / "code"
    copy_of_the_code(str(code))
    apply(str(code), EXERCISE_1)
    out = tmp_path / "results"
    command = [
        a.replace("cpu", "tiny") for a in REPRODUCE_LOGT
    ]  # the text's command, at seconds' scale
    p = subprocess.run(
        [sys.executable, *command, "--out", str(out)],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    table = (out / "table.md").read_text()
    assert (
        "| LOGT | - |" in table and "no conclusion" in table and "± 0.0" not in table
    )  # (no epsilon)
    assert (out / "r_nt.png").exists()


def test_a_head_without_its_branch_is_an_error(tmp_path):
    """Only the name added to HEADS (the branches forgotten): an error, not a silent ST."""
    code = tmp_path / "code"
    copy_of_the_code(str(code))
    apply(str(code), EXERCISE_1[:2])
    probe = (
        "import torch, heads\n"
        "h = heads.Head('logt', 4, 10, 0)\n"
        "x = torch.randn(1, 3, 4)\n"
        "for call in (lambda: h(x, torch.ones(1, 3)), lambda: h.target_log_probs(x, torch.ones(1, 3, "
        "dtype=torch.long), torch.ones(1, 3))):\n"
        "    try:\n        call()\n        print('SILENT')\n"
        "    except ValueError as e:\n        print('REFUSED', e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe], cwd=code, capture_output=True, text=True, timeout=120
    )
    assert p.stdout.count("REFUSED") == 2 and "SILENT" not in p.stdout, p.stdout + p.stderr


def test_exercise_2_a_new_decoder_samples_like_the_others(tmp_path):
    code = tmp_path / "code"
    copy_of_the_code(str(code))
    apply(str(code), EXERCISE_2)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*args):
        p = subprocess.run(
            [sys.executable, *args], cwd=code, capture_output=True, text=True, timeout=300, env=env
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    run(
        "train.py",
        "--model",
        "lstm",
        "--dataset",
        "ptb",
        "--d_model",
        "16",
        "--n_layer",
        "1",
        "--batch_size",
        "8",
        "--max_iters",
        "2",
        "--eval_interval",
        "2",
        "--eval_seqs",
        "8",
        "--probe",
        "0",
        "--out_dir",
        "run",
    )
    ckpt = os.path.join("run", "ckpt_best.pt")
    p = run(
        "sample.py",
        "--ckpt",
        ckpt,
        "--prompt",
        "the company said",
        "--decoder",
        "typical",
        "--p",
        "0.9",
        "--temperature",
        "0.8",
        "--L",
        "5",
    )
    assert "repeats this sample" in p.stderr and ">>>" in p.stdout  # it draws: a fresh seed, said
    p = run(
        "evaluate.py",
        "--ckpt",
        ckpt,
        "--no_ppl",
        "--decoder",
        "typical",
        "--p",
        "0.9",
        "--L",
        "5",
        "--limit",
        "4",
    )
    assert "typical" in p.stdout


def test_exercise_3_a_new_backbone_passes_the_contract_trains_and_decodes(tmp_path):
    code = tmp_path / "code"
    copy_of_the_code(str(code))  # (the tests too)
    apply(str(code), EXERCISE_3)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*args):
        p = subprocess.run(
            [sys.executable, *args], cwd=code, capture_output=True, text=True, timeout=300, env=env
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    p = run(
        "-m",
        "pytest",
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        "tests/test_model.py",
        "tests/test_decode.py",
        "-k",
        "dgcnn",
    )
    assert (
        "test_cached_equals_uncached[greedy-kw0-nmst-dgcnn]" in p.stdout
        and "failed" not in p.stdout
    )
    run(
        "train.py",
        "--model",
        "dgcnn",
        "--kernel_size",
        "3",
        "--n_layer",
        "3",
        "--dataset",
        "ptb",
        "--d_model",
        "16",
        "--block_size",
        "64",
        "--batch_size",
        "8",
        "--max_iters",
        "2",
        "--eval_interval",
        "2",
        "--eval_seqs",
        "8",
        "--probe",
        "0",
        "--out_dir",
        "run",
    )
    p = run(
        "evaluate.py",
        "--ckpt",
        os.path.join("run", "ckpt_best.pt"),
        "--decoder",
        "greedy",
        "--L",
        "5",
        "--limit",
        "4",
    )
    assert "ppl" in p.stdout and "greedy" in p.stdout
