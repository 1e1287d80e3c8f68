"""The mask draws against references outside the library: chi-square tests of the
subset frequencies (scipy), brute-force order statistics, fixed seeds."""


import pytest
import torch
from scipy.stats import chisquare

import pyro_mpt.mask_draws as mask_draws
from pyro_mpt.mask_draws import random_keys, random_masks, smallest_keys

#: a fixed-seed chi-square test fails with probability P_MIN when the draws are right
P_MIN = 1e-4


def _subset_counts(masks, D):
    """Counts of each subset (as a D-bit code) among bool masks ``(rows, D)``."""
    codes = (masks.long() << torch.arange(D)).sum(-1)
    return torch.bincount(codes, minlength=2**D)


@pytest.mark.parametrize("key_bits", [mask_draws.KEY_BITS, 2])
def test_masks_with_shared_sizes_are_independent_uniform_subsets(monkeypatch, key_bits):
    """Each mask is uniform over the C(D, M) subsets of its size, and the masks of two
    sizes in one datapoint are independent (their joint is uniform over the pairs).
    With 2-bit keys nearly every row ties at its boundary and is drawn again: the
    redrawing must not bias the subsets either."""
    monkeypatch.setattr(mask_draws, "KEY_BITS", key_bits)
    torch.manual_seed(0)
    D, n = 5, 6000
    sizes = torch.tensor([[2], [3]])
    masks = random_masks(sizes, (2, n, D), None)  # rows >= 16: the counting path
    assert torch.equal(masks.sum(-1), sizes.expand(2, n))
    subsets = {M: [c for c in range(2**D) if bin(c).count("1") == M] for M in (2, 3)}
    for i, M in enumerate((2, 3)):
        counts = _subset_counts(masks[i], D)[subsets[M]]
        assert int(counts.sum()) == n
        assert chisquare(counts.numpy()).pvalue > P_MIN
    # the joint of (size-2 mask, size-3 mask) of each datapoint: 10 x 10 cells
    index = {M: {c: k for k, c in enumerate(subsets[M])} for M in (2, 3)}
    c2 = (masks[0].long() << torch.arange(D)).sum(-1).tolist()
    c3 = (masks[1].long() << torch.arange(D)).sum(-1).tolist()
    joint = torch.zeros(10, 10, dtype=torch.long)
    for a, b in zip(c2, c3):
        joint[index[2][a], index[3][b]] += 1
    assert chisquare(joint.flatten().numpy()).pvalue > P_MIN


def test_masks_are_independent_across_datapoints_and_queries():
    """The pairs (mask of datapoint i, mask of datapoint i + 1) and (query 0, query 1)
    of one datapoint are uniform over the pairs of subsets."""
    torch.manual_seed(1)
    D, n = 4, 8000
    masks = random_masks(torch.tensor([[2], [2]]), (2, n, D), None)
    codes = (masks.long() << torch.arange(D)).sum(-1)  # (2, n)
    subsets = [c for c in range(2**D) if bin(c).count("1") == 2]
    index = torch.full((2**D,), -1, dtype=torch.long)
    index[subsets] = torch.arange(6)
    k = index[codes]
    across_rows = torch.bincount(k[0, 0::2] * 6 + k[0, 1::2], minlength=36)
    across_queries = torch.bincount(k[0] * 6 + k[1], minlength=36)
    for counts in (across_rows, across_queries):
        assert chisquare(counts.numpy()).pvalue > P_MIN


def test_smallest_keys_is_the_brute_force_order_statistic():
    """The mask holds the keys at most each row's M-th smallest (a full sort), ties included."""
    g = torch.Generator().manual_seed(2)
    rows, D = 300, 37
    keys = torch.randint(0, 2**mask_draws.KEY_BITS, (rows, D), generator=g).to(torch.int16)
    keys[:100] = keys[:100] % 7  # many ties
    sizes = torch.randint(1, D + 1, (rows,), generator=g)
    kth = keys.long().sort(-1).values.gather(1, (sizes - 1)[:, None])
    mask, exact = smallest_keys(keys, sizes)
    assert torch.equal(mask, keys.long() <= kth)
    assert torch.equal(exact, mask.sum(-1) == sizes)
    assert 0 < int((~exact).sum()) < rows  # the test has ties and rows without


def test_random_keys_are_uniform_in_every_word():
    """Each of the four keys cut from one 64-bit draw is uniform on 0 .. 2**KEY_BITS - 1
    (the draw's top bit is always 0, so the top word must be cut like the others)."""
    torch.manual_seed(3)
    keys = random_keys((20000, 8), None).long()
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**mask_draws.KEY_BITS
    for word in range(4):
        top = keys[:, word::4] >> (mask_draws.KEY_BITS - 4)  # 16 bins of the high bits
        counts = torch.bincount(top.flatten(), minlength=16)
        assert chisquare(counts.numpy()).pvalue > P_MIN


def test_long_rows_draw_exact_sizes():
    """Rows longer than the integer keys serve (float64 keys) still get exact sizes."""
    torch.manual_seed(4)
    D = mask_draws.KEY_TOKENS + 1
    sizes = torch.tensor([[1], [D // 2], [D]])
    masks = random_masks(sizes, (3, 16, D), None)
    assert torch.equal(masks.sum(-1), sizes.expand(3, 16))
