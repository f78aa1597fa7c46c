"""The solution of exercise 2 (docs/exercises.md): typical sampling (Meister et al. 2022), --p
the kept mass.  Try the exercise before reading on; `python -m tests.check_exercise 2` grades
your own answer.

EDITS: (file, anchor, what replaces it), applied by solutions.apply.  Applied, they leave a tree
that `ruff format --check` and `ruff check` pass."""

# Each edit's anchor is a line of the shipped code: the new decoder goes beside nucleus
# sampling in every place that lists the decoders.
EDITS = [
    (
        "decode.py",
        'DECODERS = ("greedy", "sample", "topk", "nucleus", "beam")',
        'DECODERS = ("greedy", "sample", "topk", "nucleus", "beam", "typical")',
    ),
    # The comment of SAMPLING's line moves above it: with "typical" it would pass 100 characters.
    (
        "decode.py",
        'SAMPLING = ("sample", "topk", "nucleus")  '
        "# the decoders that draw (greedy and beam do not)",
        "# The decoders that draw (greedy and beam do not).\n"
        'SAMPLING = ("sample", "topk", "nucleus", "typical")',
    ),
    (
        "decode.py",
        "def filter_log_probs(",
        '''def typical_mask(log_probs, p):
    """Locally typical sampling (Meister et al. 2022): the tokens whose -log p lies closest to
    the entropy H, kept until their mass reaches p (a mass within 1e-6 of p has reached it, as
    in nucleus_mask).  log_probs (N, V) -> bool (N, V)."""
    # A token of probability 0 adds 0 to the entropy, not 0 * -inf = NaN.
    entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    order = (-log_probs - entropy).abs().argsort(-1)
    # The tokens closest to H first; their mass summed in float64, as nucleus_mask sums it.
    mass = log_probs.gather(-1, order).double().exp().cumsum(-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], -1)
    # A token is kept while the mass before it is below p; a mass within 1e-6 of p has reached
    # it (rounding decides no set), and the closest token is always kept.
    keep = before < p - 1e-6
    keep[..., 0] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def filter_log_probs(''',
    ),
    (
        "decode.py",
        '    elif decoder == "nucleus":\n        mask = nucleus_mask(lp, p)',
        '    elif decoder == "nucleus":\n        mask = nucleus_mask(lp, p)\n'
        '    elif decoder == "typical":\n'
        "        mask = typical_mask(lp, p)",
    ),
    # --p is read by typical sampling too, and checked as nucleus sampling's.
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
