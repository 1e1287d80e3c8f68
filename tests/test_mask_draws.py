"""The mask draws against references outside the library: chi-square tests of the
subset frequencies (scipy), brute-force order statistics, fixed seeds."""


import pytest
import torch
from scipy.stats import chi2, chisquare

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
    """The mask holds exactly M keys: every key below the M-th smallest (a full sort)
    and none above it, ties at the M-th broken among the tied keys only."""
    g = torch.Generator().manual_seed(2)
    rows, D = 300, 37
    bins = 2 ** mask_draws._key_bits(D)
    keys = torch.randint(0, bins, (rows, D), generator=g).to(torch.uint8)
    keys[:100] = keys[:100] % 3  # many ties
    sizes = torch.randint(1, D + 1, (rows,), generator=g)
    kth = keys.long().sort(-1).values.gather(1, (sizes - 1)[:, None])
    mask = smallest_keys(keys, sizes)
    assert torch.equal(mask.sum(-1), sizes)
    assert bool((mask | (keys.long() >= kth)).all())  # every key below the M-th is in
    assert not bool((mask & (keys.long() > kth)).any())  # no key above it
    tied = ((keys.long() == kth).sum(-1) > 1) & (mask & (keys.long() == kth)).sum(-1).lt((keys.long() == kth).sum(-1))
    assert int(tied.sum()) > 50  # the test breaks ties in many rows


def test_random_keys_are_uniform_in_every_byte():
    """Each of the eight keys cut from one 64-bit draw is uniform on 0 .. 2**KEY_BITS - 1
    (the draw covers the full 64-bit range, so the top byte must be uniform too)."""
    torch.manual_seed(3)
    D = 2**mask_draws.KEY_BITS
    keys = random_keys((20000, 16), None).long()  # 16 tokens: 4-bit keys
    bits = mask_draws._key_bits(16)
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**bits
    keys = random_keys((3000, D), None).long()
    assert int(keys.max()) < 2**mask_draws.KEY_BITS
    for byte in range(8):
        counts = torch.bincount(keys[:, byte::8].flatten(), minlength=D)
        assert chisquare(counts.numpy()).pvalue > P_MIN


def test_long_rows_draw_exact_sizes():
    """Rows far longer than the key's values (dozens of ties at each boundary) still
    get exact sizes, also when D is not a multiple of 8."""
    torch.manual_seed(4)
    D = 3001
    sizes = torch.tensor([[1], [D // 2], [D]])
    masks = random_masks(sizes, (3, 16, D), None)
    assert torch.equal(masks.sum(-1), sizes.expand(3, 16))


#: a token's inclusion count may stray this many binomial standard errors from M/D
Z_MAX = 5.0


def test_each_token_is_masked_with_probability_m_over_d():
    """At a D of the benchmarks' size (each key value held by a few tokens, D not a
    multiple of 8), the inclusion counts of the tokens over n independent rows: each
    binomial(n, M/D), within Z_MAX standard errors; together chi-square with D - 1
    degrees of freedom (their covariance is that of a uniform M-subset); and without
    a trend in the token's position (what breaking ties by position would leave)."""
    torch.manual_seed(5)
    D, n = 300, 20000
    sizes = torch.tensor([1, 7, 150, 299])
    masks = random_masks(sizes[:, None], (4, n, D), None)
    assert torch.equal(masks.sum(-1), sizes[:, None].expand(4, n))
    p = sizes[:, None].double() / D
    var = n * p * (1 - p)  # (4, 1)
    z = (masks.sum(1).double() - n * p) / var.sqrt()  # (4, D)
    assert float(z.abs().max()) < Z_MAX
    # Cov(count_j, count_k) = -var / (D - 1): sum z^2 (D - 1) / D is chi-square(D - 1)
    for stat in (z.square().sum(-1) * (D - 1) / D).tolist():
        assert chi2.sf(stat, D - 1) > P_MIN
    c = torch.arange(D, dtype=torch.float64) - (D - 1) / 2
    trend = (masks.sum(1).double() * c).sum(-1) / (var[:, 0] * D / (D - 1) * c.square().sum()).sqrt()
    assert float(trend.abs().max()) < Z_MAX


def test_masks_do_not_depend_on_the_thread_count():
    """One seed draws the same masks on one thread and on two."""
    threads = torch.get_num_threads()
    try:
        drawn = []
        for t in (1, 2):
            torch.set_num_threads(t)
            torch.manual_seed(6)
            drawn.append(random_masks(torch.tensor([[3], [200]]), (2, 1500, 257), None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(drawn[0], drawn[1])


def test_smallest_keys_takes_expanded_sizes_without_a_warning():
    """Sizes broadcast over the rows (stride 0, as the missing-token schedules pass them) give
    exactly M tokens a row, the lowest keys, and no torch 'non-contiguous' UserWarning (which
    reached users once per program)."""
    import warnings

    keys = torch.tensor([[3, 1, 2, 0, 1], [0, 2, 2, 3, 1], [1, 0, 3, 2, 2]], dtype=torch.uint8)
    sizes = torch.tensor(2).expand(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = smallest_keys(keys, sizes)
    assert mask.sum(-1).tolist() == [2, 2, 2]
    # row 0: keys 0 (col 3) and one of the two 1s; row 1: 0 and 1 (cols 0, 4); row 2: 0, 1 (cols 1, 0)
    assert mask[0, 3] and mask[1, 0] and mask[1, 4] and mask[2, 0] and mask[2, 1]


@pytest.mark.parametrize("key_bits", [mask_draws.KEY_BITS, 2])
def test_masks_among_observed_tokens_are_uniform_subsets_of_them(monkeypatch, key_bits):
    """With missing tokens, sizes shared by the rows take the counting path (no sort:
    the orderings' argsort made 10 % missing tokens cost 2.6x the step at D = 200) and
    each mask is a uniform subset of its row's observed tokens: exactly min(M, D_i) of
    them, never a missing one, every min(M, D_i)-subset equally often (chi-square).
    With 2-bit keys the missing tokens' key ties the drawn ones' bins often."""
    monkeypatch.setattr(mask_draws, "KEY_BITS", key_bits)

    def no_sort(*args, **kwargs):
        raise AssertionError("masks with shared sizes were drawn by sorting")

    monkeypatch.setattr(mask_draws, "random_order", no_sort)
    torch.manual_seed(7)
    D, reps = 6, 4000
    patterns = torch.tensor([[1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0], [0] * 6, [0, 1, 1, 0, 1, 0]]).bool()
    observed = patterns.repeat(reps, 1)  # (5 reps, D): row r has pattern r % 5
    sizes = torch.tensor([[1], [2], [3], [6]])
    masks = random_masks(sizes, (4, observed.shape[0], D), None, observed)
    count = observed.sum(-1)
    assert not bool((masks & ~observed).any())
    assert torch.equal(masks.sum(-1), torch.minimum(sizes, count))
    for q, M in enumerate(sizes[:, 0].tolist()):
        for r, pattern in enumerate(patterns):
            m = min(M, int(pattern.sum()))
            if m in (0, int(pattern.sum())):
                continue  # one subset only: checked by the sizes above
            obs = pattern.nonzero()[:, 0].tolist()
            cells = [c for c in range(2**D) if bin(c).count("1") == m and all(c >> j & 1 == 0 for j in range(D) if j not in obs)]
            counts = _subset_counts(masks[q, r::5], D)[cells]
            assert int(counts.sum()) == reps
            assert chisquare(counts.numpy()).pvalue > P_MIN


def test_many_sizes_of_one_row_are_counted_and_uniform(monkeypatch):
    """Masks of one row per size (one datapoint of many tokens, masks shared by the batch)
    count keys once the block is large enough (no sort: 2000 sizes of one row of 2000
    tokens, 285 ms sorted, 18 ms counted, a sixth of a masks='all' step of a Bayesian
    linear regression scored as one datapoint), and each mask is uniform over the C(64, 2)
    pairs of tokens (chi-square over the 2016 cells)."""

    def no_sort(*args, **kwargs):
        raise AssertionError("a large block of one row per size was drawn by sorting")

    monkeypatch.setattr(mask_draws, "random_order", no_sort)
    torch.manual_seed(8)
    q, D = 12000, 64
    masks = random_masks(torch.full((q, 1), 2), (q, 1, D), None)[:, 0]
    assert torch.equal(masks.sum(-1), torch.full((q,), 2))
    first = masks.long().argmax(-1)
    second = D - 1 - masks.long().flip(-1).argmax(-1)
    cells = torch.bincount(first * D + second, minlength=D * D).view(D, D)
    counts = cells[torch.triu_indices(D, D, 1).unbind()]
    assert int(counts.sum()) == q
    assert chisquare(counts.numpy()).pvalue > P_MIN


def test_masks_with_a_size_per_row_are_uniform_subsets_of_that_size():
    """Sizes per row (the "uniform" schedule's masks per datapoint) on the counting path:
    each row gets exactly its size, and the rows of each size are uniform over its C(D, M)
    subsets (chi-square per size), with missing tokens never drawn."""
    torch.manual_seed(3)
    D, n = 5, 12000
    sizes = torch.randint(1, D + 1, (2, n))
    masks = random_masks(sizes, (2, n, D), None)
    assert torch.equal(masks.sum(-1), sizes)
    for M in range(1, D + 1):
        rows = masks[sizes == M]
        subsets = [c for c in range(2**D) if bin(c).count("1") == M]
        counts = _subset_counts(rows, D)[subsets]
        assert int(counts.sum()) == rows.shape[0]
        if len(subsets) > 1:
            assert chisquare(counts.numpy()).pvalue > P_MIN
    observed = torch.rand(n, D) < 0.7
    capped = torch.minimum(sizes, observed.sum(-1).clamp_min(1))
    masks = random_masks(capped, (2, n, D), None, observed)
    assert not bool((masks & ~observed).any())
    assert torch.equal(masks.sum(-1), torch.minimum(capped, observed.sum(-1)))


def test_uniform_schedule_draws_its_masks_per_datapoint_without_sorting(monkeypatch):
    """masks="uniform" (the loss's default) with masks per datapoint draws each mask by
    counting keys: a sort of D uniforms per datapoint was most of a default step at D = 1000
    (61 of 115 ms, factor analysis, N = 1000, one thread; counted: 4.4 ms)."""
    from pyro_mpt.masks import make_schedule

    def no_sort(*args, **kwargs):
        raise AssertionError("the uniform masks sorted their keys")

    monkeypatch.setattr(mask_draws, "random_order", no_sort)
    torch.manual_seed(4)
    for stratified in (False, True):
        schedule = make_schedule("stratified" if stratified else "uniform", 3, False)
        block = next(schedule.blocks(100, 80))
        mask = block.masks()
        assert mask.shape == (3, 100, 80) and torch.equal(mask.sum(-1), block.size.expand(3, 100))
