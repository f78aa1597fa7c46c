"""The exercise checker (tests/check_exercise.py) grades: each solution of tests/solutions passes
it, and each wrong answer below (a mutant: one edit of the solved code) fails every check named
beside it, with a message that gives the expected and the found value.  A checker that stops
catching one of them fails here.  Besides: the checker refuses a folder without nanogen code and
grades the folder it is given, never the working directory, and a graded sys.exit() is a failure.

Each class of a check holds three wrong answers at least; the fast suite runs the first of each
class (FAST), `python -m pytest -m ""` all of them."""

import os
import shutil

import pytest

import check_exercise
from solutions import AlreadyDone, apply, copy_of_the_code, exercise_done, solved_copy

# The lines of the worked solutions the wrong answers edit.
LOGT_BODY = (
    "    z_eos = _eos_precision(z_eos)\n"
    "    t = torch.clamp(torch.as_tensor(t, device=z_eos.device), min=1).to(z_eos.dtype)\n"
    "    a = z_eos + w * torch.log(t)\n"
)
LOGT_RETURN = "    return F.logsigmoid(a), F.logsigmoid(-a)"
LOGT_T = (
    "    t = torch.clamp(torch.as_tensor(t, device=z_eos.device), min=1).to(z_eos.dtype)\n    a ="
)
W_INIT = "self.w = nn.Parameter(torch.zeros(()))"
ENTROPY = (
    "    entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)"
)
KEEP = "    keep = before < p - 1e-6\n"
MASK_RETURN = "    keep[..., 0] = True\n    return torch.zeros_like(keep).scatter_(-1, order, keep)"
TYPICAL_BRANCH = '    elif decoder == "typical":\n        mask = typical_mask(lp, p)\n'
SPANS = "        self.spans = [(kernel_size - 1) * 2**i for i in range(n_layer)]"
DGCNN_END = (
    "            x = x + self.drop(h)\n"
    "        return self.ln_f(x), (new_past, pos0 + n_real, end + T)\n\n\nclass LanguageModel"
)
DGCNN_CONV = (
    "        for ln, conv, p, span in zip(self.ln, self.convs, past, self.spans):\n"
    "            h, padded = conv(ln(x), p)\n"
)


def reorder_override(body):
    """A DilatedGCNN.reorder_state of one body line (its own, in place of GCNN's)."""
    method = f"\n\n    @staticmethod\n    def reorder_state(state, index):\n        {body}"
    return ("model.py", DGCNN_END, DGCNN_END.replace("T)\n\n\n", f"T){method}\n\n\n"))


# (the wrong answer, its edit of the solved code: file, old, new, the checks that must fail)
MUTANTS = {
    1: [
        (
            # p(eos) becomes 1 - alpha_t: every value off but at a = 0.
            "log alpha and log(1 - alpha) swapped",
            ("heads.py", LOGT_RETURN, "    return F.logsigmoid(-a), F.logsigmoid(a)"),
            ("check_logt_formula", "check_logt_head"),
        ),
        (
            # Right at w = 0, the initial value: wrong at every w the checks use.
            "z - w log t for z + w log t",
            ("heads.py", "a = z_eos + w * torch.log(t)", "a = z_eos - w * torch.log(t)"),
            ("check_logt_formula",),
        ),
        (
            # Linear in t: at t = 10^6 + 1 it is off by six orders of magnitude.
            "w t for w log t",
            ("heads.py", "a = z_eos + w * torch.log(t)", "a = z_eos + w * t"),
            ("check_logt_formula",),
        ),
        (
            # The commands would not treat it as a head that models the end.
            "the head left out of TERMINATION_HEADS",
            (
                "heads.py",
                'TERMINATION_HEADS = ("st", "nmst", "logt")',
                'TERMINATION_HEADS = ("st", "nmst")',
            ),
            ("check_logt_names",),
        ),
        (
            # Not registered: no optimizer step, no checkpoint, no gradient.
            "w a plain tensor, never learned",
            ("heads.py", W_INIT, "self.w = torch.zeros(())"),
            ("check_logt_parameter", "check_logt_learns"),
        ),
        (
            # log(0) = -inf and log(-3) = NaN at the context positions the decoders read.
            "t not clamped to t >= 1 (log 0 at context positions)",
            ("heads.py", LOGT_T, LOGT_T.replace("torch.clamp(", "(").replace(", min=1)", ")")),
            ("check_logt_formula",),
        ),
        (
            # The loss path then refuses the head: training cannot run.
            "no branch in target_log_probs",
            (
                "heads.py",
                '        elif self.kind == "logt":\n'
                "            log_alpha, log_one_minus_alpha = logt_log_alpha(z_eos, t, self.w)\n",
                "",
            ),
            ("check_logt_head",),
        ),
        # Numerics: finite and exact in float32 at logits up to +-100.
        (
            # sigmoid(a) rounds to 1 in float32 from a = 17 on.
            "log(1 - alpha_t) as log(1 - sigmoid(a)) (-inf at z_eos = 20 in float32)",
            (
                "heads.py",
                LOGT_RETURN,
                "    return F.logsigmoid(a), torch.log(1 - torch.sigmoid(a))",
            ),
            ("check_logt_float32",),
        ),
        (
            # sigmoid(a) underflows to 0 in float32 below a = -88.
            "log alpha_t as log(sigmoid(a)) (-inf below a = -88 in float32)",
            ("heads.py", LOGT_RETURN, "    return torch.log(torch.sigmoid(a)), F.logsigmoid(-a)"),
            ("check_logt_float32",),
        ),
        (
            # log alpha_t = -e^-a is a denormal near a = 100, 0 beyond: precision lost, then -inf.
            "log(1 - alpha_t) as log(-expm1(log alpha_t)) (0 at z_eos = 100 in float32)",
            (
                "heads.py",
                LOGT_RETURN,
                "    return F.logsigmoid(a), torch.log(-torch.expm1(F.logsigmoid(a)))",
            ),
            ("check_logt_float32",),
        ),
        (
            # A floor hides the -inf and keeps the error: -69 where -20 is right.
            "log(1 - sigmoid(a) + 1e-30): finite, and wrong",
            (
                "heads.py",
                LOGT_RETURN,
                "    return F.logsigmoid(a), torch.log(1 - torch.sigmoid(a) + 1e-30)",
            ),
            ("check_logt_float32",),
        ),
        # bf16 autocast: the eos terms in float32 at least.
        (
            # bf16 holds 8 bits: t = 300 .. 303 give one p(eos).
            "the eos logit left in bf16 under autocast",
            ("heads.py", LOGT_BODY, LOGT_BODY.replace("    z_eos = _eos_precision(z_eos)\n", "")),
            ("check_logt_autocast",),
        ),
        (
            # t rounded to bf16 (300, 300, 302, 304) before the upcast.
            "t cast to the bf16 logit's dtype before the logit is raised to float32",
            ("heads.py", LOGT_BODY, "".join(LOGT_BODY.splitlines(True)[i] for i in (1, 0, 2))),
            ("check_logt_autocast",),
        ),
        (
            # w = 1.3 becomes 1.296875: p(eos) off by 1.6 % at t = 300.
            "w cast to the bf16 logit's dtype",
            ("heads.py", LOGT_BODY, "    w = w.to(z_eos.dtype)\n" + LOGT_BODY),
            ("check_logt_autocast",),
        ),
        # Input dtypes.
        (
            # torch.log of an integer tensor is float32, whatever the logit's dtype.
            "t left an integer (its log in float32)",
            ("heads.py", LOGT_T, LOGT_T.replace(".to(z_eos.dtype)", "")),
            ("check_logt_dtypes",),
        ),
        (
            # A float64 run then computes log t in float32.
            "t cast to float32 whatever z_eos's dtype",
            ("heads.py", LOGT_T, LOGT_T.replace(".to(z_eos.dtype)", ".float()")),
            ("check_logt_dtypes",),
        ),
        (
            # A float64 model gets float32 log-probs back.
            "the result in float32 whatever z_eos's dtype",
            (
                "heads.py",
                LOGT_RETURN,
                "    return F.logsigmoid(a).float(), F.logsigmoid(-a).float()",
            ),
            ("check_logt_dtypes",),
        ),
        (
            # A Python int has no clamp: the step a caller passes as a number fails.
            "t.clamp, a tensor's method (t a Python int fails)",
            ("heads.py", LOGT_T, "    t = t.clamp(min=1).to(z_eos.dtype)\n    a ="),
            ("check_logt_dtypes",),
        ),
        # The initial value the exercise states: w = 0.
        (
            # The exercise says 0: a head that starts with p(eos) growing as t.
            "w starting at 1",
            ("heads.py", W_INIT, "self.w = nn.Parameter(torch.ones(()))"),
            ("check_logt_initial",),
        ),
        (
            # Each run would start from another w: results not reproducible from the seed alone.
            "w starting at random",
            ("heads.py", W_INIT, "self.w = nn.Parameter(torch.randn(()))"),
            ("check_logt_initial",),
        ),
        (
            # Any value but the stated 0.
            "w starting at 0.5",
            ("heads.py", W_INIT, "self.w = nn.Parameter(torch.full((), 0.5))"),
            ("check_logt_initial",),
        ),
        # Ownership: each head, each model its own w.
        (
            # A second run of one process starts from the first run's learned w.
            "one w shared by every Head (a module-level Parameter)",
            (
                "heads.py",
                W_INIT,
                'self.w = globals().setdefault("SHARED_W", nn.Parameter(torch.zeros(())))',
            ),
            ("check_logt_ownership",),
        ),
        (
            # Two Parameters, one storage: setting one sets the other.
            "every head's w a Parameter over one tensor (shared storage)",
            (
                "heads.py",
                W_INIT,
                'self.w = nn.Parameter(globals().setdefault("ZERO", torch.zeros(())))',
            ),
            ("check_logt_ownership",),
        ),
        (
            # The class holds the one w: every head of the process shares it.
            "w made once, kept on the class",
            (
                "heads.py",
                W_INIT,
                'if "w_all" not in vars(Head):\n'
                "                Head.w_all = nn.Parameter(torch.zeros(()))\n"
                "            self.w = Head.w_all",
            ),
            ("check_logt_ownership",),
        ),
    ],
    2: [
        (
            # Not a decoder that draws: no seed, no --temperature.
            "typical left out of SAMPLING",
            (
                "decode.py",
                'SAMPLING = ("sample", "topk", "nucleus", "typical")',
                'SAMPLING = ("sample", "topk", "nucleus")',
            ),
            ("check_typical_names",),
        ),
        (
            # Nucleus sampling: the mode first, where typical sampling may leave it out.
            "tokens ranked by probability (nucleus sampling), not by distance to the entropy",
            (
                "decode.py",
                "order = (-log_probs - entropy).abs().argsort(-1)",
                "order = (-log_probs).argsort(-1)",
            ),
            ("check_typical_filter", "check_typical_peaked"),
        ),
        (
            # The set then holds less than p.
            "the token that reaches the mass p left out",
            ("decode.py", KEEP, "    keep = mass < p\n"),
            ("check_typical_filter", "check_typical_flat"),
        ),
        (
            # The name known, the filter missing: refused by filter_log_probs.
            "no branch in filter_log_probs",
            ("decode.py", TYPICAL_BRANCH, ""),
            ("check_typical_draws", "check_typical_filter"),
        ),
        (
            # A missing --p reaches the filter as None.
            "--p not checked",
            (
                "decode.py",
                'if decoder in ("nucleus", "typical") and (p is None',
                'if decoder in ("nucleus",) and (p is None',
            ),
            ("check_typical_args",),
        ),
        # Flat rows and ties at the threshold.
        (
            # A flat row is all ties: kept whole whatever p says.
            "every token tied at the set's edge kept (a threshold on the distance)",
            (
                "decode.py",
                MASK_RETURN,
                "    keep[..., 0] = True\n"
                "    distance = (-log_probs - entropy).abs()\n"
                "    edge = distance.gather(-1, order).gather(-1, keep.sum(-1, keepdim=True) - 1)\n"
                "    return distance <= edge",
            ),
            ("check_typical_flat", "check_typical_ties"),
        ),
        (
            # log 0.25 in float32 gives 0.25 - 1e-9: two tokens of four kept at p = 0.25.
            "no margin for rounding: a mass a hair below p has not reached it",
            ("decode.py", KEEP, "    keep = before < p\n"),
            ("check_typical_flat", "check_typical_ties"),
        ),
        (
            # A mass that reaches p exactly takes one token more.
            "a mass equal to p not reached (before <= p)",
            ("decode.py", KEEP, "    keep = before <= p\n"),
            ("check_typical_ties",),
        ),
        # Peaked rows.
        (
            # The mode, atypical, joins a set it does not belong to.
            "the most probable token always kept (as nucleus_mask keeps it)",
            (
                "decode.py",
                MASK_RETURN,
                "    keep[..., 0] = True\n"
                "    mask = torch.zeros_like(keep).scatter_(-1, order, keep)\n"
                "    return mask | (log_probs == log_probs.amax(-1, keepdim=True))",
            ),
            ("check_typical_peaked",),
        ),
        (
            # H in bits against -log p in nats: another set wherever they differ.
            "the entropy in bits",
            ("decode.py", ENTROPY, ENTROPY + " / math.log(2)"),
            ("check_typical_peaked",),
        ),
        (
            # H / V: the tokens nearest it are the most probable.
            "the entropy a mean over the vocabulary",
            ("decode.py", ENTROPY, ENTROPY.replace(".sum(", ".mean(")),
            ("check_typical_peaked",),
        ),
        # Rows with -inf log-probs.
        (
            # A banned token makes H NaN: the order, and the set, are arbitrary.
            "0 * -inf = NaN in the entropy",
            ("decode.py", ENTROPY, ENTROPY.replace(".nan_to_num(neginf=0.0)", "")),
            ("check_typical_inf_rows",),
        ),
        (
            # log(0) = -inf again: 0 * -inf is NaN.
            "the entropy from p log p (log 0 = -inf)",
            (
                "decode.py",
                ENTROPY,
                "    probs = log_probs.exp()\n"
                "    entropy = -(probs * probs.log()).sum(-1, keepdim=True)",
            ),
            ("check_typical_inf_rows",),
        ),
        (
            # H = 0 ranks the tokens by probability: nucleus sampling on those rows.
            "a NaN entropy read as 0",
            (
                "decode.py",
                ENTROPY,
                "    entropy = -(log_probs.exp() * log_probs).sum(-1, keepdim=True)"
                ".nan_to_num(0.0)",
            ),
            ("check_typical_inf_rows",),
        ),
        # Temperatures near 0.
        (
            # At temperature 1e-3 the tempered distribution is its mode alone.
            "the set of the untempered distribution",
            (
                "decode.py",
                TYPICAL_BRANCH,
                TYPICAL_BRANCH.replace("typical_mask(lp, p)", "typical_mask(log_probs, p)"),
            ),
            ("check_typical_temperature",),
        ),
        (
            # Sampling at temperature 1 whatever --temperature says.
            "the temperature ignored",
            (
                "decode.py",
                TYPICAL_BRANCH,
                '    elif decoder == "typical":\n'
                "        return log_probs.masked_fill(~typical_mask(log_probs, p), -math.inf)\n",
            ),
            ("check_typical_temperature",),
        ),
        (
            # log p / 1e-39 overflows to -inf everywhere: NaN.
            "the temperature applied again, without filter_log_probs's shift",
            (
                "decode.py",
                TYPICAL_BRANCH,
                TYPICAL_BRANCH.replace(
                    "typical_mask(lp, p)",
                    "typical_mask((log_probs / temperature).log_softmax(-1), p)",
                ),
            ),
            ("check_typical_temperature",),
        ),
    ],
    3: [
        # The receptive field's edge.
        (
            # Field (k - 1) n_layer + 1 inputs, not (k - 1)(2^n_layer - 1) + 1.
            "no dilation (a plain GCNN)",
            ("model.py", SPANS, "        self.spans = [kernel_size - 1] * n_layer"),
            ("check_dilated_field",),
        ),
        (
            # Each layer one step too wide: the field twice as wide, less one.
            "dilations 2, 4, 8, ... (2^(l+1))",
            ("model.py", SPANS, SPANS.replace("2**i", "2 ** (i + 1)")),
            ("check_dilated_field",),
        ),
        (
            # Linear growth: the field falls short from the third layer on.
            "dilations 1, 2, 3, ... (l + 1)",
            ("model.py", SPANS, SPANS.replace("2**i", "(i + 1)")),
            ("check_dilated_field",),
        ),
        (
            # Decoding would not know that the model has a window.
            "left out of WINDOWED",
            ("model.py", 'WINDOWED = ("gcnn", "gpt", "dgcnn")', 'WINDOWED = ("gcnn", "gpt")'),
            ("check_dilated_names",),
        ),
        # The padding side.
        (
            # A short prompt's state then holds its padding.
            "the state cut from the end of the padded input, whatever the prompt's length",
            (
                "model.py",
                "            new_past.append("
                "padded.gather(1, keep.expand(-1, -1, self.d_model)))\n",
                "            new_past.append(padded[:, -span:])\n",
            ),
            ("check_dilated_state",),
        ),
        (
            # Every row's state as if its prompt filled the batch.
            "the prompts' lengths ignored (the state after the padding)",
            (
                "model.py",
                "lengths.to(dev)\n        x = self.drop(",
                "lengths.to(dev)\n        n_real = torch.full((B,), T, device=dev)\n"
                "        x = self.drop(",
            ),
            ("check_dilated_state",),
        ),
        (
            # A short prompt's next token gets the padded length's position.
            "the positions going on after the padding",
            ("model.py", DGCNN_END, DGCNN_END.replace("pos0 + n_real", "pos0 + T")),
            ("check_dilated_state",),
        ),
        (
            # An output reads later inputs.
            "the convolution's zeros on the right (not causal)",
            (
                "model.py",
                DGCNN_CONV,
                DGCNN_CONV.replace(
                    "            h, padded = conv(ln(x), p)\n",
                    "            y = torch.cat([ln(x), p], 1).transpose(1, 2)\n"
                    "            proj, gate = conv.conv(y).transpose(1, 2).chunk(2, dim=-1)\n"
                    "            h = proj * torch.sigmoid(gate)\n"
                    "            padded = torch.cat([p, ln(x)], 1)\n",
                ),
            ),
            ("check_dilated_field", "check_dilated_state"),
        ),
        # The cache after reordering.
        (
            # Beam search keeps the rows of hypotheses it dropped.
            "reorder_state leaving the state as it is",
            reorder_override("return state"),
            ("check_dilated_reorder",),
        ),
        (
            # A moved row keeps another row's positions.
            "reorder_state reordering the inputs kept, not the positions",
            reorder_override("return [p[index] for p in state[0]], state[1], state[2]"),
            ("check_dilated_reorder",),
        ),
        (
            # A moved row keeps another row's past inputs.
            "reorder_state reordering the positions, not the inputs kept",
            reorder_override("return state[0], state[1][index], state[2]"),
            ("check_dilated_reorder",),
        ),
        (
            # Right for beam search's swap of two rows, wrong for any other index.
            "reorder_state flipping the rows (right only for a swap of two)",
            reorder_override("return [p.flip(0) for p in state[0]], state[1].flip(0), state[2]"),
            ("check_dilated_reorder",),
        ),
    ],
}
# The first wrong answer of each class runs in the fast suite; the others under -m "".
FAST = {
    "log alpha and log(1 - alpha) swapped",
    "the head left out of TERMINATION_HEADS",
    "w a plain tensor, never learned",
    "no branch in target_log_probs",
    "log(1 - alpha_t) as log(1 - sigmoid(a)) (-inf at z_eos = 20 in float32)",
    "the eos logit left in bf16 under autocast",
    "t left an integer (its log in float32)",
    "w starting at 0.5",
    "one w shared by every Head (a module-level Parameter)",
    "typical left out of SAMPLING",
    "tokens ranked by probability (nucleus sampling), not by distance to the entropy",
    "no branch in filter_log_probs",
    "--p not checked",
    "every token tied at the set's edge kept (a threshold on the distance)",
    "no margin for rounding: a mass a hair below p has not reached it",
    "0 * -inf = NaN in the entropy",
    "the set of the untempered distribution",
    "no dilation (a plain GCNN)",
    "left out of WINDOWED",
    "the state cut from the end of the padded input, whatever the prompt's length",
    "reorder_state reordering the positions, not the inputs kept",
}


@pytest.fixture(scope="module")
def solved_roots(tmp_path_factory):
    """{n: a copy of the code with exercise n solved}, made once; None where the tree holds its
    own answer (graded by test_exercises.py)."""
    roots = {}
    for n in (1, 2, 3):
        try:
            dest = tmp_path_factory.mktemp(f"solved{n}")
            solved_copy(n, str(dest))
            roots[n] = str(dest)
        except AlreadyDone:
            roots[n] = None
    return roots


def solved(n, roots, dest):
    """A fresh copy of the solved code of exercise n in dest (skipped where the tree holds its
    own answer: python -m tests.check_exercise N grades it)."""
    if roots[n] is None:
        pytest.skip(f"exercise {n} is done in this tree: python -m tests.check_exercise {n}")
    shutil.copytree(roots[n], dest, ignore=shutil.ignore_patterns("__pycache__"))
    return str(dest)


def failures(n, root, only=None):
    """{the check's name: what it found} of the checks of exercise n (only: those named) that
    fail on root."""
    names = [c.__name__ for c in check_exercise.CHECKS[n] if only is None or c.__name__ in only]
    return {
        name: wrong
        for name, (_, wrong) in zip(names, check_exercise.grade(n, root, only))
        if wrong is not None
    }


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_solution_passes(n, solved_roots, tmp_path, capsys):
    root = solved(n, solved_roots, tmp_path / "code")
    assert check_exercise.main([str(n), "--root", root]) == 0
    out = capsys.readouterr().out
    n_checks = len(check_exercise.CHECKS[n])
    assert "FAIL" not in out and f"{n_checks} of {n_checks} checks pass" in out, out


def edit_of(n, mutant):
    """The edit of exercise n's wrong answer of that name."""
    return next(edit for name, edit, _ in MUTANTS[n] if name == mutant)


def mutant_params():
    for n, mutants in MUTANTS.items():
        for mutant, edit, checks in mutants:
            marks = () if mutant in FAST else (pytest.mark.slow,)
            yield pytest.param(n, mutant, edit, checks, id=mutant, marks=marks)


@pytest.mark.parametrize("n, mutant, edit, checks", list(mutant_params()))
def test_a_wrong_answer_fails(n, mutant, edit, checks, solved_roots, tmp_path):
    root = solved(n, solved_roots, tmp_path / "code")
    apply(root, [edit])
    found = failures(n, root, checks)
    for check in checks:
        assert check in found, f"{mutant}: {check} passes"
        # The message says what was expected and what was found (and, for values, where).
        message = found[check]
        assert "expected" in message and "found" in message, f"{mutant}: {message}"


def test_every_class_holds_three_wrong_answers():
    """Each check of a class (numerics, autocast, dtypes, initial value, ownership; flat, peaked,
    -inf rows, temperature, ties; field, padding side, reordering) is failed by three wrong
    answers at least, one of them in the fast suite; every other check by one at least."""
    named = [(m, c) for ms in MUTANTS.values() for m, _, cs in ms for c in cs]
    for n, checks in check_exercise.CHECKS.items():
        for check in checks:
            mutants = [m for m, c in named if c == check.__name__]
            if check.__name__.endswith(
                ("_names", "_args", "_parameter", "_learns", "_head", "_draws")
            ):
                assert mutants, check.__name__
                continue
            assert len(mutants) >= 3 and set(mutants) & FAST, (check.__name__, mutants)


def test_a_message_names_the_input_the_expected_and_the_found_value(solved_roots, tmp_path):
    """What a student reads for log(1 - sigmoid(a)) computed as written."""
    root = solved(1, solved_roots, tmp_path / "code")
    apply(
        root,
        [edit_of(1, "log(1 - alpha_t) as log(1 - sigmoid(a)) (-inf at z_eos = 20 in float32)")],
    )
    message = failures(1, root, ["check_logt_float32"])["check_logt_float32"]
    assert "log(1 - alpha_t) (float32) at z_eos = 20, t = " in message, message
    assert "expected -20" in message and "found -inf" in message, message


def test_the_command_says_fail_and_exits_1_on_a_wrong_answer(solved_roots, tmp_path, capsys):
    root = solved(1, solved_roots, tmp_path / "code")
    apply(root, [edit_of(1, "log alpha and log(1 - alpha) swapped")])
    assert check_exercise.main(["1", "--root", root]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  heads.logt_log_alpha(z_eos, t, w) gives" in out
        and "exercise 1: 4 of 10 checks pass" in out
    ), out


def test_the_checker_grades_the_code_it_is_given_and_puts_the_tree_back(solved_roots, tmp_path):
    """grade() imports the graded copy's modules and afterwards the tree's own ones again."""
    import heads

    root = solved(1, solved_roots, tmp_path / "code")
    check_exercise.grade(1, root, ["check_logt_names"])
    import heads as after

    assert after is heads and os.path.dirname(heads.__file__) == check_exercise.ROOT


def test_a_folder_without_nanogen_code_is_refused_in_one_line(tmp_path, capsys):
    """An empty --root (or one that lacks a module the checks import) is exit 2 and one line, not
    a grade of the working directory's code."""
    assert check_exercise.main(["1", "--root", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"error: --root {tmp_path} holds no nanogen code (heads.py"), err
    code = tmp_path / "code"
    copy_of_the_code(str(code))
    os.remove(code / "decode.py")
    assert check_exercise.main(["2", "--root", str(code)]) == 2
    assert "(decode.py missing)" in capsys.readouterr().err


def test_the_root_is_graded_never_the_working_directory(
    solved_roots, tmp_path, monkeypatch, capsys
):
    """Run from a solved tree (the working directory first on sys.path, as `python -m` puts
    it), --root naming the code as shipped: the shipped code is graded, and fails."""
    if exercise_done(1):
        pytest.skip("exercise 1 is done in this tree: there is no unsolved copy to grade")
    solved_tree = solved(1, solved_roots, tmp_path / "solved")
    shipped = tmp_path / "shipped"
    copy_of_the_code(str(shipped))
    monkeypatch.chdir(solved_tree)
    monkeypatch.syspath_prepend(solved_tree)
    monkeypatch.syspath_prepend("")
    assert check_exercise.main(["1", "--root", str(shipped)]) == 1
    out = capsys.readouterr().out
    assert "heads.HEADS: expected 'logt' in it" in out and "exercise 1: 0 of 10" in out, out


def test_a_sys_exit_in_the_graded_code_is_a_failure(solved_roots, tmp_path, capsys):
    """sys.exit() in a graded function, or when a graded module is imported: FAIL and exit 1,
    never a silent exit 0."""
    root = solved(1, solved_roots, tmp_path / "code")
    apply(root, [("heads.py", LOGT_RETURN, '    __import__("sys").exit()')])
    assert check_exercise.main(["1", "--root", root]) == 1
    out = capsys.readouterr().out
    assert "FAIL  heads.logt_log_alpha" in out and "SystemExit" in out, out
    apply(root, [("heads.py", "import math\n", "import math\nimport sys\n\nsys.exit(0)\n")])
    assert check_exercise.main(["1", "--root", root]) == 1
    out = capsys.readouterr().out
    assert "exercise 1: 0 of 10 checks pass" in out and "SystemExit" in out, out
