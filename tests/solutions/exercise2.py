"""The solution of exercise 2 (README, Coursework): typical sampling (Meister et al. 2022), --p
the kept mass.  Try the exercise before reading on; `python -m tests.check_exercise 2` grades
your own answer.

EDITS: (file, anchor, what replaces it), applied by solutions.apply."""

EDITS = [
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
