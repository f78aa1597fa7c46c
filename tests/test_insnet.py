"""insnet.py: the offset matrix (InsNet section 3.1, Fig. 5-6)."""
import torch

from insnet import Canvas, causal_mask, offset_matrix

PAPER_ROWS = [[0], [-1, 0], [-1, 1, 0], [-2, 1, -1, 0], [-1, 3, 1, 2, 0], [-3, 2, -1, 1, -2, 0],
              [-5, 1, -3, -1, -4, -2, 0]]


def test_paper_example():
    """'BOS EOS have pen I a .' inserted into 'I have a pen .': order [0, 6, 2, 4, 1, 3, 5]."""
    off = offset_matrix(torch.tensor([0, 6, 2, 4, 1, 3, 5]))
    for j, row in enumerate(PAPER_ROWS):
        assert off[j, :j + 1].tolist() == row
        assert (off[j, j + 1:] == 0).all()


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
            row = off[j, :j + 1]
            assert row[j] == 0 and len(set(row.tolist())) == j + 1
            assert sorted((row - row.min()).tolist()) == list(range(j + 1))  # the ranks of j+1 canvas tokens


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
    off = offset_matrix(canvas.order())
    for j, row in enumerate(rows):
        assert torch.equal(off[j, :j + 1], row)
