"""The exercise checker (tests/check_exercise.py) grades: each solution of tests/solutions passes
it, and each wrong answer below (a mutant: one edit of the solved code) fails the check named
beside it.  A checker that stops catching one of them fails here."""

import os

import pytest

import check_exercise
from solutions import AlreadyDone, apply, solved_copy

# (the wrong answer, its edit of the solved code: file, old, new, the check that must fail)
MUTANTS = {
    1: [
        (
            "log alpha and log(1 - alpha) swapped",
            (
                "heads.py",
                "return F.logsigmoid(a), F.logsigmoid(-a)",
                "return F.logsigmoid(-a), F.logsigmoid(a)",
            ),
            "check_logt_formula",
        ),
        (
            "z - w log t for z + w log t",
            ("heads.py", "a = z_eos + w * torch.log(t)", "a = z_eos - w * torch.log(t)"),
            "check_logt_formula",
        ),
        (
            "w t for w log t",
            ("heads.py", "a = z_eos + w * torch.log(t)", "a = z_eos + w * t"),
            "check_logt_formula",
        ),
        (
            "the head left out of TERMINATION_HEADS",
            (
                "heads.py",
                'TERMINATION_HEADS = ("st", "nmst", "logt")',
                'TERMINATION_HEADS = ("st", "nmst")',
            ),
            "check_logt_names",
        ),
        (
            "w a plain tensor, never learned",
            ("heads.py", "self.w = nn.Parameter(torch.zeros(()))", "self.w = torch.zeros(())"),
            "check_logt_parameter",
        ),
        (
            "w a plain tensor, never learned (the training run sees it too)",
            ("heads.py", "self.w = nn.Parameter(torch.zeros(()))", "self.w = torch.zeros(())"),
            "check_logt_learns",
        ),
        (
            "t not clamped to t >= 1 (log 0 at context positions)",
            (
                "heads.py",
                "min=1).to(z_eos.dtype)\n    a = z_eos",
                ").to(z_eos.dtype)\n    a = z_eos",
            ),
            "check_logt_formula",
        ),
        (
            "no branch in target_log_probs",
            (
                "heads.py",
                '        elif self.kind == "logt":\n            log_alpha, log_one_minus_alpha = logt_log_alpha(z_eos, t, self.w)\n',
                "",
            ),
            "check_logt_head",
        ),
    ],
    2: [
        (
            "typical left out of SAMPLING",
            (
                "decode.py",
                'SAMPLING = ("sample", "topk", "nucleus", "typical")',
                'SAMPLING = ("sample", "topk", "nucleus")',
            ),
            "check_typical_names",
        ),
        (
            "tokens ranked by probability (nucleus sampling), not by distance to the entropy",
            (
                "decode.py",
                "order = (-log_probs - entropy).abs().argsort(-1)",
                "order = (-log_probs).argsort(-1)",
            ),
            "check_typical_filter",
        ),
        (
            "the token that reaches the mass p left out",
            (
                "decode.py",
                "keep = torch.cat([torch.ones_like(mass[..., :1], dtype=torch.bool), mass[..., :-1] < p], -1)",
                "keep = mass < p",
            ),
            "check_typical_filter",
        ),
        (
            "no branch in filter_log_probs (plain sampling)",
            (
                "decode.py",
                '    elif decoder == "typical":\n        mask = typical_mask(lp, p)\n',
                "",
            ),
            "check_typical_draws",
        ),
        (
            "--p not checked",
            (
                "decode.py",
                'if decoder in ("nucleus", "typical") and (p is None',
                'if decoder in ("nucleus",) and (p is None',
            ),
            "check_typical_args",
        ),
    ],
    3: [
        (
            "no dilation (a plain GCNN)",
            ("model.py", "            conv.conv.dilation = (span // (kernel_size - 1),)\n", ""),
            "check_dilated_field",
        ),
        (
            "the state cut from the end of the padded input, whatever the prompt's length",
            (
                "model.py",
                "            new_past.append(padded.gather(1, keep.expand(-1, -1, self.d_model)))\n",
                "            new_past.append(padded[:, -span:])\n",
            ),
            "check_dilated_state",
        ),
        (
            "left out of WINDOWED",
            ("model.py", 'WINDOWED = ("gcnn", "gpt", "dgcnn")', 'WINDOWED = ("gcnn", "gpt")'),
            "check_dilated_names",
        ),
    ],
}


def solved(n, dest):
    try:
        solved_copy(n, str(dest))
    except AlreadyDone as e:
        pytest.skip(f"{e} grades your answer")
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
def test_the_solution_passes(n, tmp_path, capsys):
    root = solved(n, tmp_path)
    assert check_exercise.main([str(n), "--root", root]) == 0
    out = capsys.readouterr().out
    n_checks = len(check_exercise.CHECKS[n])
    assert "FAIL" not in out and f"{n_checks} of {n_checks} checks pass" in out, out


@pytest.mark.parametrize(
    "n, mutant, edit, check",
    [(n, m, e, c) for n, ms in MUTANTS.items() for m, e, c in ms],
    ids=[m for ms in MUTANTS.values() for m, _, _ in ms],
)
def test_a_wrong_answer_fails(n, mutant, edit, check, tmp_path):
    root = solved(n, tmp_path)
    apply(root, [edit])
    assert check in failures(n, root, [check]), mutant


def test_the_command_says_fail_and_exits_1_on_a_wrong_answer(tmp_path, capsys):
    root = solved(1, tmp_path)
    apply(root, [MUTANTS[1][0][1]])
    assert check_exercise.main(["1", "--root", root]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  heads.logt_log_alpha(z_eos, t, w) equals" in out
        and "exercise 1: 2 of 5 checks pass" in out
    ), out


def test_the_checker_grades_the_code_it_is_given_and_puts_the_tree_back(tmp_path):
    """grade() imports the graded copy's modules and afterwards the tree's own ones again."""
    import heads

    root = solved(1, tmp_path)
    check_exercise.grade(1, root)
    import heads as after

    assert after is heads and os.path.dirname(heads.__file__) == check_exercise.ROOT
