"""insnet.py: the offset matrix (InsNet section 3.1, Fig. 5-6)."""

import torch

from insnet import Canvas, causal_mask, offset_matrix

PAPER_ROWS = [
    [0],
    [-1, 0],
    [-1, 1, 0],
    [-2, 1, -1, 0],
    [-1, 3, 1, 2, 0],
    [-3, 2, -1, 1, -2, 0],
    [-5, 1, -3, -1, -4, -2, 0],
]


def test_paper_example():
    """'BOS EOS have pen I a .' inserted into 'I have a pen .': order [0, 6, 2, 4, 1, 3, 5]."""
    off = offset_matrix(torch.tensor([0, 6, 2, 4, 1, 3, 5]))
    for j, row in enumerate(PAPER_ROWS):
        assert off[j, : j + 1].tolist() == row
        assert (off[j, j + 1 :] == 0).all()


def test_left_to_right_is_i_minus_j():
    n = 9
    off = offset_matrix(torch.arange(n))
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="xy")
    assert torch.equal(off, (i - j) * causal_mask(n))


def test_rows_are_distinct_integers_of_a_permutation():
    g = torch.Generator().manual_seed(0)
    for n in (2, 5, 17):
        order = torch.randperm(n, generator=g)
        off = offset_matrix(order)
        for j in range(n):
            row = off[j, : j + 1]
            assert row[j] == 0 and len(set(row.tolist())) == j + 1
            assert sorted((row - row.min()).tolist()) == list(
                range(j + 1)
            )  # the ranks of j+1 canvas tokens


def test_invariant_to_order_preserving_relabelling():
    order = torch.tensor([0, 6, 2, 4, 1, 3, 5])
    relabelled = order * 10 + 3  # same relative order, other values
    assert torch.equal(offset_matrix(order), offset_matrix(relabelled))


def test_batched_equals_per_sequence():
    g = torch.Generator().manual_seed(1)
    orders = torch.stack([torch.randperm(12, generator=g) for _ in range(4)])
    batch = offset_matrix(orders)
    for b in range(4):
        assert torch.equal(batch[b], offset_matrix(orders[b]))


def test_incremental_rows_equal_batch_rows():
    """Decoding inserts at canvas slots; each insertion's row equals the batch matrix's row."""
    g = torch.Generator().manual_seed(2)
    canvas = Canvas()
    rows = [canvas.insert(0)]  # BOS
    rows.append(canvas.insert(1))  # EOS after it
    for _ in range(10):
        rows.append(canvas.insert(int(torch.randint(1, len(canvas.positions), (1,), generator=g))))
    off = offset_matrix(canvas.positions.clone())
    for j, row in enumerate(rows):
        assert torch.equal(off[j, : j + 1], row)


# ---------------------------------------------------------------------------------------------
# the model: slot distribution, teacher forcing == cached decoding, constraints, re-encoding
# ---------------------------------------------------------------------------------------------
import itertools  # noqa: E402

import pytest  # noqa: E402

from data.loader import collate_insertions, insertion_order  # noqa: E402
from insnet import (  # noqa: E402
    Decoding,
    InsertionTransformer,
    InsNet,
    canvas_steps,
    generate,
    insertion_targets,
    start_canvas,
)  # noqa: E402


def story_nll(m, batch):
    """-log p of each (sequence, order) and its number of events, from the model's call."""
    log_p, mask, _ = m(batch)
    return -(log_p * mask).sum(1), mask.sum(1)


CFG = dict(vocab_size=23, n_layer=2, n_head=2, d_model=16, dropout=0.0, max_offset=6, block_size=40)
MODELS = dict(insnet=InsNet, insertion_transformer=InsertionTransformer)


def tiny(name, seed=0):
    torch.manual_seed(seed)
    m = MODELS[name](dict(CFG, model=name)).double().eval()
    with torch.no_grad():  # larger weights than GPT-2's init: sharper, more varied distributions
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def a_batch(seed=0):
    """Two padded sequences: one with a 2-token given prefix (title + SEP) and a keyword, one
    without."""
    seqs = [[1, 9, 3, 5, 6, 7, 10, 8, 11, 12, 2], [1, 13, 14, 15, 2]]
    return seqs, collate_insertions(
        seqs, [3, 1], [[5], []], "random", torch.Generator().manual_seed(seed)
    )


def test_canvas_steps_is_the_sorted_canvas():
    order = torch.stack([torch.tensor([0, 6, 2, 4, 1, 3, 5]), torch.tensor([0, 6, 1, 2, 3, 4, 5])])
    canvas = canvas_steps(order)
    for b, j in itertools.product(range(2), range(7)):
        by_position = sorted(
            range(j + 1), key=lambda i: int(order[b, i])
        )  # steps 0..j left to right
        assert canvas[b, j, : j + 1].tolist() == by_position


def test_insertion_order_and_targets():
    g = torch.Generator().manual_seed(0)
    o = insertion_order(12, 3, [7, 5], "random", g)
    assert o[:6].tolist() == [0, 11, 1, 2, 5, 7]  # BOS, EOS, prefix, keywords in order
    assert sorted(o.tolist()) == list(range(12))
    assert insertion_order(6, 1, [], "l2r").tolist() == [0, 5, 1, 2, 3, 4]
    # l2r: every token goes into the last gap (just before EOS)
    assert insertion_targets(torch.tensor([[0, 5, 1, 2, 3, 4]]))[0, 2:].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown insertion order"):
        insertion_order(6, 1, [], "r2l")


@pytest.mark.parametrize("name", MODELS)
def test_slot_distribution_sums_to_one_over_valid_gaps(name):
    """p(slot) is a distribution over the open gaps plus termination; the first real choice on
    the canvas [BOS, EOS] has a single gap; gaps inside a given prefix get probability 0."""
    m = tiny(name)
    state = m.start()
    m.push(state, 1, 0)
    m.push(state, 2, 1)
    lp = m.next_slot_log_probs(state, 0)
    assert lp.shape == (2,) and torch.isclose(lp.exp().sum(), torch.tensor(1.0, dtype=lp.dtype))
    for n_canvas, tok in enumerate(
        (9, 3, 5), start=2
    ):  # a title token, SEP, a story token, each before EOS
        m.push(state, tok, n_canvas - 1)
    lp = m.next_slot_log_probs(state, 2)  # canvas BOS t SEP w EOS: gaps 0, 1 lie in the prefix
    assert lp.shape == (5,) and torch.isinf(lp[:2]).all() and torch.isfinite(lp[2:]).all()
    assert torch.isclose(lp.exp().sum(), torch.tensor(1.0, dtype=lp.dtype))
    tok = m.next_token_log_probs(state, 3)
    assert torch.isclose(tok.exp().sum(), torch.tensor(1.0, dtype=tok.dtype))


@pytest.mark.parametrize("name", MODELS)
def test_cached_decoding_equals_teacher_forcing(name):
    """Replaying a trajectory insertion by insertion (InsNet: key/value cache, one new token per
    step; IT: re-encoding) gives the teacher-forced log p(slot), log p(token | slot) and
    log p(terminate) of the batched, padded training pass, in float64."""
    m = tiny(name)
    seqs, batch = a_batch()
    sc = m.sequence_log_probs(**batch)
    for b, seq in enumerate(seqs):
        n = len(seq)
        order, gaps = batch["order"][b, :n], insertion_targets(batch["order"][b : b + 1, :n])[0]
        state = m.start()
        for s in range(n):
            tok = seq[int(order[s])]
            if s >= int(batch["n_given"][b]):
                slot_lp = m.next_slot_log_probs(state, int(batch["slot_start"][b]))
                torch.testing.assert_close(slot_lp[gaps[s]], sc["slot"][b, s], rtol=0, atol=1e-12)
                tok_lp = m.next_token_log_probs(state, int(gaps[s]))
                torch.testing.assert_close(tok_lp[tok], sc["token"][b, s], rtol=0, atol=1e-12)
            else:
                assert sc["slot"][b, s] == 0 and sc["token"][b, s] == 0  # given steps cost nothing
            m.push(state, tok, 0 if s == 0 else int(gaps[s]) + 1)
        end = m.next_slot_log_probs(state, int(batch["slot_start"][b]))[-1]
        torch.testing.assert_close(end, sc["end"][b], rtol=0, atol=1e-12)


def test_gap_logits_equal_the_direct_formula():
    """The decomposed gap logit q . W [h_l; h_r; h_j] + q . b, against building the slot vector."""
    m = tiny("insnet")
    state = m.start()
    for tok, slot in ((1, 0), (2, 1), (7, 1), (8, 1), (9, 3)):
        m.push(state, tok, slot)
    h, canvas = state["h"], torch.argsort(state["canvas"].positions)
    direct = torch.stack(
        [
            m.slot_query(m.slot_proj(torch.cat([h[canvas[g]], h[canvas[g + 1]], h[-1]])))[0]
            for g in range(len(canvas) - 1)
        ]
        + [m.end_proj(h[-1])[0]]
    )
    torch.testing.assert_close(
        m.next_slot_log_probs(state, 0), torch.log_softmax(direct, 0), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("name", MODELS)
def test_constrained_decoding_keeps_every_keyword_in_order(name):
    m = tiny(name).float()
    title, keywords = [9, 10], [5, 6, 5, 7]
    for seed, decoder in itertools.product(range(4), ("greedy", "sample", "topk")):
        out = generate(
            m,
            [1, *title, 3, *keywords, 2],
            30,
            Decoding(decoder, k=3, slot_start=3, banned=(0, 1, 2, 3), min_len=4),
            generator=torch.Generator().manual_seed(seed),
        )
        toks = out["tokens"]
        assert toks[:4] == [1, *title, 3] and toks[-1] == 2  # the prefix is closed, EOS stays last
        kept = [t for t, given in zip(toks[4:-1], out["given"][4:-1]) if given]
        assert kept == keywords and out["inserted"] >= 4 and len(toks) <= 30
        assert not set(toks[4:-1]) & {0, 1, 2, 3}  # banned tokens are never inserted


def test_insnet_encodes_each_token_once_and_it_reencodes():
    """Decoding n insertions: InsNet runs n new token positions through the transformer (a
    key/value cache); IT-vanilla re-encodes the whole canvas before every insertion."""
    ins, it = tiny("insnet").float(), tiny("insertion_transformer").float()
    outs, seen = [], {}
    for m in (ins, it):
        seen[m] = encoded(m)
        outs.append(
            generate(
                m,
                [1, 2],
                12,
                Decoding("sample", banned=(0, 1, 2, 3), min_len=10),
                generator=torch.Generator().manual_seed(0),
            )
        )
    assert outs[0]["inserted"] == outs[1]["inserted"] == 10
    assert sum(b * t for b, t in seen[ins]) == 12  # BOS, EOS and 10 insertions: each token once
    assert sum(b for b, _ in seen[it]) == 10 and sum(b * t for b, t in seen[it]) == sum(
        range(2, 12)
    )


def encoded(m):
    """-> a list that receives the (sequences, positions) of every batch entering m's first
    transformer block: the tokens the model encodes."""
    seen = []
    m.h[0].register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape[:2])))
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_training_pass_is_one_pass_for_insnet(name):
    m = tiny(name)
    _, batch = a_batch()
    seen = encoded(m)
    nll, events = story_nll(m, batch)
    assert (
        torch.isfinite(nll).all() and (nll > 0).all() and events.tolist() == [10 - 3 - 1 + 1, 3 + 1]
    )
    if name == "insnet":
        assert seen == [(2, 11)]  # one causal pass over the padded batch
    else:
        assert sum(b for b, _ in seen) == 11 + 5  # one full encoding per canvas of each sequence


def test_batch_equals_single_sequences():
    m = tiny("insnet")
    seqs, batch = a_batch(3)
    sc = m.sequence_log_probs(**batch)
    for b, seq in enumerate(seqs):
        one = {
            k: v[b : b + 1, : len(seq)] if v.dim() == 2 else v[b : b + 1] for k, v in batch.items()
        }
        single = m.sequence_log_probs(**one)
        torch.testing.assert_close(single["slot"][0], sc["slot"][b, : len(seq)], rtol=0, atol=1e-12)
        torch.testing.assert_close(
            single["token"][0], sc["token"][b, : len(seq)], rtol=0, atol=1e-12
        )
        torch.testing.assert_close(single["end"][0], sc["end"][b], rtol=0, atol=1e-12)


def test_relative_bias_gets_gradients():
    m = tiny("insnet").float().train()
    _, batch = a_batch()
    nll, _ = story_nll(m, batch)
    nll.sum().backward()
    assert m.rel_bias.grad.abs().sum() > 0 and m.slot_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", MODELS)
def test_decoding_starts_from_the_training_canvas(name):
    """generate()'s initial canvas (title prefix and keywords given) is the one training builds:
    the first slot distribution equals the teacher-forced one of a sequence with the same given
    tokens, and the canvas reads BOS title SEP keywords EOS."""
    m = tiny(name)
    seq = [1, 9, 10, 3, 5, 6, 11, 2]  # BOS t t SEP k k w EOS: keywords 5, 6 given, then w inserted
    batch = collate_insertions([seq], [4], [[4, 5]], "random", torch.Generator().manual_seed(0))
    sc = m.sequence_log_probs(**batch)
    state = start_canvas(m, [1, 9, 10, 3, 5, 6, 2])
    if name == "insnet":
        assert state["canvas"].positions.tolist() == [
            0,
            6,
            1,
            2,
            3,
            4,
            5,
        ]  # final positions of steps 0..6
    else:
        assert state["tokens"] == [1, 9, 10, 3, 5, 6, 2]
    gap = int(insertion_targets(batch["order"])[0, 7])
    torch.testing.assert_close(
        m.next_slot_log_probs(state, 3)[gap], sc["slot"][0, 7], rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        m.next_token_log_probs(state, gap)[11], sc["token"][0, 7], rtol=0, atol=1e-12
    )


def test_order_average_minus_log_n_factorial_bounds_the_nll():
    """-log p(x) = -log sum_pi p(x, pi) <= mean_pi[-log p(x, pi)] - log n!  (Jensen, uniform pi):
    evaluate.perplexity's nll_bound_per_story, checked exactly over all 4! orders."""
    import math

    m = tiny("insnet")
    seq = [1, 9, 3, 5, 6, 7, 8, 2]  # BOS title SEP + 4 story tokens + EOS
    nlls = []
    for perm in itertools.permutations([4, 5, 6, 7]):
        order = torch.tensor([[0, 7, 1, 2, *perm]])
        b = dict(
            tokens=torch.tensor([seq]),
            order=order,
            lengths=torch.tensor([8]),
            n_given=torch.tensor([4]),
            slot_start=torch.tensor([2]),
        )
        with torch.no_grad():
            nlls.append(float(story_nll(m, b)[0][0]))
    exact = -torch.logsumexp(-torch.tensor(nlls, dtype=torch.float64), 0)
    bound = sum(nlls) / len(nlls) - math.lgamma(5)
    assert bound >= exact - 1e-9 and min(nlls) >= exact  # any single order also bounds it
