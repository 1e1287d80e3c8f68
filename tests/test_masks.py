"""Mask schedules: unbiasedness, bias of fixed rates, variance, reproducibility."""

import math

import pytest
import torch
import pyro

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.masks import (
    AllSizes, ChainBlock, Exhaustive, FixedRate, MaskBlock, RandomOrders, UniformSizes, _random_ranks, make_schedule,
)

from models import make_ppca

pytestmark = pytest.mark.usefixtures("float64")

R = 4000  # independent draws of each estimator (one per replicated datapoint)


def _draws(masks, D=10, K=2, num_masks=1, **kw):
    """R independent estimates of log p(x) for one datapoint, and its exact value."""
    model, x, exact = make_ppca(D, K, N=1, seed=11)
    xr = x.expand(R, D).contiguous()
    est = MaskedPretrainingLoss(masks=masks, num_masks=num_masks, **kw).score(model, None, xr)
    return est.detach(), float(exact(x)[0]), model, x


@pytest.mark.parametrize("masks", ["all", "uniform", "stratified"])
def test_schedules_are_unbiased(masks):
    est, truth, _, _ = _draws(masks)
    se = est.std() / math.sqrt(R)
    assert abs(float(est.mean()) - truth) < 4 * float(se), (float(est.mean()), truth, float(se))
    # the draws really are random, so the test above has power
    assert float(est.std()) > 1e-3


def test_shared_masks_are_unbiased_across_steps():
    model, x, exact = make_ppca(8, 2, N=3, seed=2)
    draws = torch.stack(
        [MaskedPretrainingLoss(masks="uniform", share_masks=True).score(model, None, x).detach() for _ in range(1500)]
    )
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - exact(x)).abs() < 4 * se).all()


def test_order_has_zero_variance():
    est, truth, _, _ = _draws("order")
    assert float(est.std()) < 1e-10
    assert abs(float(est.mean()) - truth) < 1e-9


@pytest.mark.parametrize("rate", [0.15, 0.5])
def test_fixed_rate_expectation_equals_enumerated_bias(rate):
    D = 8
    est, truth, model, x = _draws(rate, D=D)
    # S(x; M) for every M, by enumerating every subset
    curve = MaskedPretrainingLoss(masks="exhaustive").curve(model, None, x)
    M = int(math.floor(rate * D + 0.5))
    expected = D * curve.score[M - 1]
    se = float(est.std()) / math.sqrt(R)
    assert abs(float(est.mean()) - expected) < 4 * se
    # ... and it is biased for log p(x): the bias is many standard errors away
    assert abs(expected - truth) > 20 * se
    assert abs(curve.area() - truth) < 1e-9


def test_stratified_sizes_reduce_variance():
    plain, _, _, _ = _draws("uniform", num_masks=8)
    strat, _, _, _ = _draws("stratified", num_masks=8)
    assert float(strat.var()) < 0.5 * float(plain.var())


def test_stratified_sizes_are_marginally_uniform():
    sched = UniformSizes(3, stratified=True)
    sizes = torch.cat([sched._sizes(5, 7, None).reshape(-1) for _ in range(4000)])
    freq = torch.bincount(sizes, minlength=8)[1:].double() / sizes.numel()
    assert sizes.min() >= 1 and sizes.max() <= 7
    assert (freq - 1 / 7).abs().max() < 0.01


def test_masks_reproducible_under_pyro_seed():
    model, x, _ = make_ppca(10, 2, N=20)
    out = []
    for _ in range(2):
        pyro.set_rng_seed(123)
        out.append(MaskedPretrainingLoss(masks="uniform").score(model, None, x))
    assert torch.equal(out[0], out[1])
    pyro.set_rng_seed(124)
    assert not torch.equal(out[0], MaskedPretrainingLoss(masks="uniform").score(model, None, x))


def test_masks_independent_across_datapoints_by_default():
    blocks = list(UniformSizes(1).blocks(50, 10))
    assert blocks[0].mask.shape == (1, 50, 10)
    assert len({tuple(r.tolist()) for r in blocks[0].mask[0]}) > 10
    shared = list(UniformSizes(1, share_masks=True).blocks(50, 10))
    assert shared[0].mask.shape == (1, 1, 10)


def test_block_structure_and_budget():
    n, D = 6, 5
    all_blocks = list(AllSizes(2).blocks(n, D, max_elements=n * D * 3))
    assert all(b.mask.shape[0] <= 3 for b in all_blocks)
    sizes = torch.cat([b.size.reshape(-1) for b in all_blocks])
    assert sorted(sizes.tolist()) == sorted(list(range(1, D + 1)) * 2)
    for b in all_blocks:
        assert torch.equal(b.mask.sum(-1), b.size.expand(b.mask.shape[:2]))
    ex = list(Exhaustive().blocks(n, D))
    assert sum(b.mask.shape[0] for b in ex) == 2**D - 1
    weights = torch.cat([b.weight.reshape(-1) for b in ex])
    sizes = torch.cat([b.size.reshape(-1) for b in ex])
    for M in range(1, D + 1):
        assert abs(float(weights[sizes == M].sum()) - 1.0) < 1e-12
    (chain,) = list(RandomOrders(3).blocks(n, D))
    assert isinstance(chain, ChainBlock)
    assert torch.equal(chain.order.sort(-1).values, torch.arange(D).expand(3, n, D))
    (fixed,) = list(FixedRate(0.4, 2).blocks(n, D))
    assert isinstance(fixed, MaskBlock) and (fixed.mask.sum(-1) == 2).all()


def test_random_ranks_put_missing_tokens_last_and_orders_put_them_first():
    """One ordering helper serves both: masks (ranks < M) draw among the observed
    tokens, orderings list the missing tokens first (never context of an observed one)."""
    g = torch.Generator().manual_seed(1)
    observed = torch.rand(6, 9, generator=g) > 0.4
    observed[0] = False
    observed[1] = True
    counts = observed.sum(-1)
    ranks = _random_ranks((200, 6, 9), None, observed)
    assert torch.equal(ranks.sort(-1).values, torch.arange(9).expand(200, 6, 9))  # permutations
    assert bool(((ranks < counts[:, None]) == observed).all())  # observed tokens take the first ranks
    (block,) = RandomOrders(200).blocks(6, 9, observed=observed)
    first = torch.arange(9) < (9 - counts)[:, None]  # the first m_i positions
    assert bool((observed.expand(200, 6, 9).gather(-1, block.order) != first).all())
    # each token of a complete datapoint leads some ordering (a miss has probability 5e-10)
    lead = block.order[:, 1, 0]
    assert set(lead.tolist()) == set(range(9))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("rate", [0.0, 1.0, 1.5, -0.2])
def test_rate_outside_unit_interval(rate):
    with pytest.raises(ValueError, match=r"float in \(0, 1\)"):
        MaskedPretrainingLoss(masks=rate)


def test_rate_rounding_to_zero_tokens():
    model, x, _ = make_ppca(10, 2, N=3)
    with pytest.raises(ValueError, match=r"round\(0.01 \* 10\) = 0.*at least 0.05"):
        MaskedPretrainingLoss(masks=0.01).loss(model, None, x)


def test_one_token_with_fixed_rate():
    model, x, _ = make_ppca(1, 1, N=3)
    with pytest.raises(ValueError, match="needs D >= 2 tokens.*got D=1"):
        MaskedPretrainingLoss(masks=0.5).loss(model, None, x)
    # schedules that cover every size still work: with D = 1 they are log p(x) itself
    est = MaskedPretrainingLoss(masks="all").score(model, None, x)
    assert torch.isfinite(est).all()


@pytest.mark.parametrize("num_masks", [0, -1, 1.5, True])
def test_num_masks_must_be_positive_integer(num_masks):
    with pytest.raises(ValueError, match="num_masks must be a positive integer"):
        MaskedPretrainingLoss(masks="uniform", num_masks=num_masks)


def test_exhaustive_refuses_large_D():
    model, x, _ = make_ppca(17, 2, N=2)
    with pytest.raises(ValueError, match=r"D <= 16.*got D=17.*masks=\"order\""):
        MaskedPretrainingLoss(masks="exhaustive").loss(model, None, x)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="Unknown mask schedule masks='bert'"):
        make_schedule("bert")
    with pytest.raises(TypeError, match="masks must be"):
        make_schedule([0.1])
