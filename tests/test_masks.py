"""Mask schedules: unbiasedness, bias of fixed rates, variance, reproducibility."""

import math

import numpy as np

import pytest
import scipy.stats
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals
from pyro_mpt.mask_blocks import ChainBlock, MaskBlock
from pyro_mpt.masks import (
    AllSizes, Exhaustive, FixedRate, MaskSchedule, PseudoLikelihood, RandomOrders, UniformSizes, make_schedule,
)
from pyro_mpt.mask_draws import random_ranks

from models import make_ppca, numpy_conditionals, numpy_leave_one_out

pytestmark = pytest.mark.usefixtures("float64")

R = 4000  # independent draws of each estimator (one per replicated datapoint)


def _draws(masks, D=10, K=2, num_masks=1, **kw):
    """R independent estimates of log p(x) for one datapoint, and its exact value."""
    model, x, exact = make_ppca(D, K, N=1, seed=11)
    xr = x.expand(R, D).contiguous()
    est = MaskedPretrainingLoss(masks=masks, num_masks=num_masks, **kw).score(model, None, xr)
    return est.detach(), float(exact(x)[0]), model, x


@pytest.mark.parametrize("masks", ["all", "nested", "uniform", "stratified"])
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
    assert all(b.masks().shape[0] <= 3 for b in all_blocks)
    sizes = torch.cat([b.size.reshape(-1) for b in all_blocks])
    assert sorted(sizes.tolist()) == sorted(list(range(1, D + 1)) * 2)
    for b in all_blocks:
        m = b.masks()
        assert torch.equal(m.sum(-1), b.size.expand(m.shape[:2]))
    ex = list(Exhaustive().blocks(n, D))
    assert sum(b.mask.shape[0] for b in ex) == 2**D - 1
    weights = torch.cat([b.weight.reshape(-1) for b in ex])
    sizes = torch.cat([b.size.reshape(-1) for b in ex])
    for M in range(1, D + 1):
        assert abs(float(weights[sizes == M].sum()) - 1.0) < 1e-12
    (chain,) = list(RandomOrders(3).blocks(n, D))
    assert isinstance(chain, ChainBlock)
    assert torch.equal(chain.orders().sort(-1).values, torch.arange(D).expand(3, n, D))
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
    ranks = random_ranks((200, 6, 9), None, observed)
    assert torch.equal(ranks.sort(-1).values, torch.arange(9).expand(200, 6, 9))  # permutations
    assert bool(((ranks < counts[:, None]) == observed).all())  # observed tokens take the first ranks
    (block,) = RandomOrders(200).blocks(6, 9, observed=observed)
    first = torch.arange(9) < (9 - counts)[:, None]  # the first m_i positions
    assert bool((observed.expand(200, 6, 9).gather(-1, block.orders()) != first).all())
    # each token of a complete datapoint leads some ordering (a miss has probability 5e-10)
    lead = block.orders()[:, 1, 0]
    assert set(lead.tolist()) == set(range(9))


def test_all_has_far_less_spread_than_nested_and_is_unbiased():
    """The paper's estimator ("all": an independent mask per size) against the nested
    masks (one permutation per repetition), P = 1, masks shared by the batch as in the
    paper's Table 1: the mean estimate over N = 200 datapoints, over 40 mask seeds.
    Measured: std 0.35 ("all") vs 0.94 ("nested") nats, ratio 0.37; asserted < 0.6
    (the ratio of two 40-draw standard deviations has a relative error of ~16 %)."""
    model, x, exact = make_ppca(50, 5, N=200, seed=3)
    truth = float(exact(x).detach().mean())
    spread = {}
    for masks in ("all", "nested"):
        est = []
        for seed in range(40):
            pyro.set_rng_seed(seed)
            with torch.no_grad():
                est.append(MaskedPretrainingLoss(masks=masks, share_masks=True).score(model, None, x).mean())
        est = torch.stack(est)
        se = float(est.std()) / math.sqrt(len(est))
        assert abs(float(est.mean()) - truth) < 4 * se, (masks, float(est.mean()), truth, se)
        spread[masks] = float(est.std())
    assert spread["all"] > 0.1  # random, so the comparison has power
    assert spread["all"] < 0.6 * spread["nested"], spread


def test_all_draws_independent_uniform_masks_per_size_and_nested_does_not():
    """Every "all" mask has its exact size and is uniform over the subsets of that size
    (each token in a size-M mask with frequency M / D); masks of sizes M < M' of one
    repetition are nested only by chance, while "nested" masks always are."""
    n, D = 400, 8
    (blk,) = list(AllSizes(1).blocks(n, D))
    masks = blk.masks()  # drawn when read: once
    assert torch.equal(masks.sum(-1), blk.size.expand(D, n))
    freq = masks.double().mean(1)  # (M, D): frequency of each token at each size
    expected = torch.arange(1, D + 1, dtype=torch.float64)[:, None] / D
    # binomial standard error of a frequency over n = 400 rows is at most 0.025
    assert float((freq - expected).abs().max()) < 0.11
    # independent masks: the size-4 mask lies inside the size-6 one with probability
    # C(D-4, 2) / C(D, 6) = 6/28 (within 4 binomial standard errors over n rows)
    nested = ~(masks[3] & ~masks[5]).any(-1)
    p = 6 / 28
    assert abs(float(nested.double().mean()) - p) < 4 * math.sqrt(p * (1 - p) / n)
    (nb,) = list(AllSizes(1, nested=True).blocks(n, D))
    nested_masks = nb.masks()
    assert not bool((nested_masks[:-1] & ~nested_masks[1:]).any())  # each mask holds the smaller ones
    assert torch.equal(nested_masks.sum(-1), nb.size.expand(D, n))
    # missing tokens: masks among the observed tokens only, of the asked size where it fits
    observed = torch.rand(n, D) > 0.3
    counts = observed.sum(-1)
    (ob,) = list(AllSizes(1).blocks(n, D, observed=observed))
    assert not bool((ob.mask & ~observed).any())
    sizes = torch.arange(1, D + 1)[:, None]
    assert torch.equal(ob.mask.sum(-1), torch.minimum(sizes, counts))
    assert torch.equal(ob.gain, sizes <= counts)


def test_pll_schedule_is_every_leave_one_out_query():
    """masks="pll": D masks of size 1 (the identity), weight 1, shared by the batch; with
    missing tokens, gain 0 where the target is missing and D / D_i where it is observed, weight
    D_i / D (each PLL term counts once, the curve's point is the mean over the D_i observed
    tokens); make_schedule names it."""
    blocks = list(make_schedule("pll").blocks(3, 5, max_elements=3 * 5 * 2))
    assert [b.masks().shape for b in blocks] == [(2, 1, 5), (2, 1, 5), (1, 1, 5)]
    assert torch.equal(torch.cat([b.masks()[:, 0] for b in blocks]), torch.eye(5, dtype=torch.bool))
    # the targets name each query's one token (engines with a leave-one-out pass read them
    # instead of the masks, which are then never made)
    assert all(b.mask is None for b in blocks)
    assert torch.equal(torch.cat([b.targets for b in blocks]), torch.arange(5))
    assert all(bool((b.weight == 1).all()) and bool((b.size == 1).all()) for b in blocks)
    observed = torch.tensor([[True, False, True, True, True]] * 3)
    (ob,) = list(PseudoLikelihood().blocks(3, 5, observed=observed))
    assert torch.equal(ob.gain, observed.T * (5 / 4))
    assert ob.mask is None and torch.equal(ob.masks()[:, 0], torch.eye(5, dtype=torch.bool)) and torch.equal(ob.targets, torch.arange(5))
    assert torch.equal(ob.context[0], observed)
    assert torch.allclose(ob.weight, torch.full((5, 3), 4 / 5, dtype=torch.float64))


class _NoLeaveOneOutPass(GaussianConditionals):
    """The Gaussian engine without its leave-one-out table: the pll's queries take the mask paths."""

    def leave_one_out_log_prob(self, state, x):
        return None


def test_pll_masks_are_made_only_for_an_engine_without_a_leave_one_out_pass(float64, monkeypatch):
    """"pll" on PPCA (D = 30, chunk_size small enough for 15 blocks): with the Gaussian engine's
    one-pass table no block's masks are made (D^2 bits: 3 s a step at D = 40000, against 25 ms
    for the table) and the loss is numpy's leave-one-out sum (Rasmussen & Williams 5.10-5.12)
    to 1e-10; an engine without the table makes them, block by block, and gives the same loss
    and gradient to 1e-10; the curve's one point (the accumulator's path) too."""
    D, N = 30, 6
    model, x, _ = make_ppca(D, 3, N=N, seed=7)
    made = []
    original = MaskBlock.masks
    monkeypatch.setattr(MaskBlock, "masks", lambda self: made.append(1) or original(self))
    W, mu, s2 = (pyro.param(k).detach().numpy() for k in ("W", "mu", "s"))
    want = numpy_leave_one_out(W @ W.T + s2**2 * np.eye(D), x.numpy() - mu).sum()

    def run(engine):
        pyro.get_param_store()["W"].grad = None
        loss = MaskedPretrainingLoss(masks="pll", chunk_size=N * D * 2, conditionals=engine)
        value = loss.differentiable_loss(model, None, x)
        (grad,) = torch.autograd.grad(value, [pyro.param("W").unconstrained()])
        return value.item(), grad, loss.curve(model, None, x).score[0]

    served, grad, point = run(GaussianConditionals())
    assert made == [] and abs(served + want) < 1e-10 * abs(want)
    fallback, grad_b, point_b = run(_NoLeaveOneOutPass())
    assert len(made) >= 2 * 15  # the loss's blocks and the curve's
    assert abs(fallback - served) < 1e-10 * abs(want)
    assert torch.allclose(grad_b, grad, rtol=1e-10, atol=1e-10)
    assert abs(point - point_b) < 1e-10 * abs(point) and abs(point - want / (N * D)) < 1e-10 * abs(point)


def test_leave_one_out_blocks_beside_other_blocks_in_one_schedule(float64):
    """A schedule that yields one-target blocks (with targets) between blocks of other masks:
    the loss is the sum of the two schedules' losses to 1e-10, whichever engine serves the
    one-target blocks (the table or the masks)."""
    D, N = 9, 5
    model, x, _ = make_ppca(D, 2, N=N, seed=3)

    class Mixed(MaskSchedule):
        covers_all_sizes = False

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            pll = list(PseudoLikelihood().blocks(n, D, max_elements=n * D * 4, device=device))
            exact = list(Exhaustive().blocks(n, D, device=device))
            yield pll[0]
            yield from exact
            yield from pll[1:]

    for engine in (GaussianConditionals(), _NoLeaveOneOutPass()):
        mixed = MaskedPretrainingLoss(masks=Mixed(share_masks=True), conditionals=engine).loss(model, None, x)
        apart = sum(MaskedPretrainingLoss(masks=m, conditionals=engine).loss(model, None, x) for m in ("pll", "exhaustive"))
        assert abs(mixed - apart) < 1e-10 * abs(apart)


def test_pll_is_D_times_the_exact_M1_term(float64):
    """PLL = D S(x; 1), with S(x; 1) from the exhaustive curve (both exact), to 1e-10;
    and the PLL curve has exactly that single point, with no area."""
    D = 8
    model, x, _ = make_ppca(D, 2, N=5, seed=4)
    pll = MaskedPretrainingLoss(masks="pll").score(model, None, x).detach()
    curve = MaskedPretrainingLoss(masks="exhaustive").curve(model, None, x)
    assert abs(float(pll.mean()) - D * curve.score[0]) < 1e-10
    pc = MaskedPretrainingLoss(masks="pll").curve(model, None, x)
    assert abs(pc.score[0] - curve.score[0]) < 1e-12
    assert pc.count[0] == 5 * D and bool(math.isnan(pc.score[1]))
    with pytest.raises(ValueError, match="area is incomplete"):
        pc.area()


def test_pll_with_missing_tokens_leaves_them_out(float64):
    """With an obs_mask, PLL runs over each datapoint's observed tokens: the closed-form
    leave-one-out (Rasmussen & Williams eq. 5.12) on the observed sub-covariance, in numpy."""
    np = pytest.importorskip("numpy")
    D, K, N = 7, 2, 4
    g = torch.Generator().manual_seed(5)
    W, mu = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    x = torch.randn(N, D, generator=g)
    observed = torch.rand(N, D, generator=g) > 0.35
    observed[0] = True

    def model(x):
        with pyro.plate("data", N, dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))  # (N, 1, K)
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + mu, 0.5), obs=x, obs_mask=observed)

    got = MaskedPretrainingLoss(masks="pll").score(model, None, x).detach().numpy()
    S = (W @ W.T + 0.25 * torch.eye(D)).numpy()
    for i in range(N):
        o = observed[i].numpy()
        r = (x[i] - mu).numpy()[o]
        Ki = np.linalg.inv(S[np.ix_(o, o)])
        var = 1 / np.diag(Ki)
        want = np.sum(-0.5 * np.log(2 * np.pi * var) - 0.5 * (Ki @ r) ** 2 * var)
        assert abs(got[i] - want) < 1e-10, (i, got[i], want)


def test_curve_shares_masks_by_default_unless_asked():
    """curve() draws one mask set for the batch unless share_masks=False (or a schedule
    instance) says otherwise; the loss and score keep masks per datapoint."""
    assert MaskedPretrainingLoss().schedule.share_masks is False
    shared = MaskedPretrainingLoss()._curve_share
    assert make_schedule("uniform").for_curve(shared).share_masks is True
    assert make_schedule("all").for_curve(True).share_masks is True
    assert make_schedule("nested").for_curve(True).nested
    assert MaskedPretrainingLoss(share_masks=False)._curve_share is False
    assert MaskedPretrainingLoss(masks=AllSizes(2))._curve_share is None
    assert make_schedule("order").for_curve(True).share_masks is True
    sched = PseudoLikelihood()
    assert sched.for_curve(False) is sched


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


def test_num_masks_beside_a_schedule_instance_is_its_count_or_refused():
    """MaskedPretrainingLoss(masks=UniformSizes(2), num_masks=8) ran 2 masks a datapoint
    without a word; now refused, naming both counts. The schedule's own count (or the
    default 1) is taken: 2 masks of each of 3 datapoints, counted in the block."""
    with pytest.raises(ValueError, match=r"num_masks=8 beside the schedule UniformSizes\(num_masks=2.*UniformSizes\(num_masks=8"):
        MaskedPretrainingLoss(masks=UniformSizes(2), num_masks=8)
    with pytest.raises(ValueError, match="num_masks=3 beside the schedule RandomOrders"):
        make_schedule(RandomOrders(1), num_masks=3)
    for num_masks in (1, 2):
        schedule = MaskedPretrainingLoss(masks=UniformSizes(2), num_masks=num_masks).schedule
        assert schedule.num_masks == 2
        assert next(schedule.blocks(3, 5)).mask.shape == (2, 3, 5)


def test_share_masks_beside_a_schedule_instance_is_its_choice_or_refused():
    """masks=UniformSizes(2), share_masks=True trained on masks per datapoint (the instance's
    choice) while curve() shared them: now refused. Equal choices are taken, and curve() keeps
    the instance's: per-datapoint masks of 3 datapoints, (q, 3, D); shared, (q, 1, D)."""
    with pytest.raises(ValueError, match=r"share_masks=True beside the schedule UniformSizes.*draws masks per datapoint"):
        MaskedPretrainingLoss(masks=UniformSizes(2), share_masks=True)
    with pytest.raises(ValueError, match="share_masks=False beside the schedule Exhaustive.*shares one mask set"):
        make_schedule(Exhaustive(), share_masks=False)
    for share in (False, True):
        for given in (None, share):
            loss = MaskedPretrainingLoss(masks=UniformSizes(2, share_masks=share), share_masks=given)
            assert next(loss.schedule.blocks(3, 5)).mask.shape[1] == (1 if share else 3)
            curve_schedule = loss.schedule.for_curve(loss._curve_share)
            assert next(curve_schedule.blocks(3, 5)).masks().shape[1] == (1 if share else 3)
    # names and rates: share_masks=None is per datapoint for training, shared for curves
    loss = MaskedPretrainingLoss(masks="uniform")
    assert next(loss.schedule.blocks(3, 5)).mask.shape[1] == 3
    assert next(loss.schedule.for_curve(loss._curve_share).blocks(3, 5)).masks().shape[1] == 1


def test_exhaustive_refuses_large_D():
    model, x, _ = make_ppca(17, 2, N=2)
    with pytest.raises(ValueError, match=r"D <= 16.*got D=17.*masks=\"order\""):
        MaskedPretrainingLoss(masks="exhaustive").loss(model, None, x)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="Unknown mask schedule masks='bert'"):
        make_schedule("bert")
    with pytest.raises(TypeError, match="masks must be"):
        make_schedule([0.1])


def test_pll_blocks_hold_only_their_own_rows():
    """``masks="pll"`` in spans of queries: each span's masks are the identity's rows
    ``start..stop`` (checked against numpy's identity) in storage of their own, ``q x D``
    bytes, not views of one ``D x D`` identity (400 MB for one datapoint of 20000 tokens)."""
    import numpy as np

    from pyro_mpt import MaskedPretrainingLoss

    D = 50
    blocks = list(MaskedPretrainingLoss(masks="pll").schedule.blocks(1, D, max_elements=7 * D))
    assert len(blocks) == 8
    rows = []
    for block in blocks:
        mask = block.masks()
        assert mask.untyped_storage().nbytes() == mask.numel() < D * D
        rows.append(mask[:, 0].numpy())
    assert np.array_equal(np.concatenate(rows), np.eye(D, dtype=bool))


def test_fixed_rate_at_least_one_clamps_the_rounded_count():
    from pyro_mpt.masks import FixedRate

    rate = FixedRate(0.15, 2, at_least_one=True)
    # round(0.15 L) for L = 1, 3, 4, 20 is 0, 0, 1, 3 (halves up); clamped to 1..L
    assert rate.size(torch.tensor([1, 3, 4, 20])).tolist() == [1, 1, 1, 3]
    assert [rate.size(L) for L in (1, 3, 20)] == [1, 1, 3]
    (block,) = list(rate.blocks(2, 3))
    assert block.size.tolist() == [[1], [1]] and block.masks().sum(-1).eq(1).all()  # (masks, 1) shared size
    with pytest.raises(ValueError, match="round"):
        list(FixedRate(0.15).blocks(2, 3))


def test_orderings_per_datapoint_are_drawn_only_for_engines_that_read_them(monkeypatch):
    # an exact engine's chain sums are log p(x) whatever the orderings: none is drawn for it
    # (n permutations of D tokens, a sort of n D keys); a sampling engine reads and gets them
    import numpy as np
    from scipy.stats import multivariate_normal

    import pyro_mpt.missing_tokens as missing_tokens
    from models import exact_posterior_guide

    pyro.clear_param_store()
    model, x, _ = make_ppca(D=6, K=2, N=40)
    drawn = []
    real = missing_tokens.random_order

    def spy(shape, device, observed=None):
        drawn.append(tuple(shape))
        return real(shape, device, observed)

    monkeypatch.setattr(missing_tokens, "random_order", spy)
    torch.manual_seed(0)
    score = MaskedPretrainingLoss(masks="order", num_masks=3).score(model, None, x)
    assert drawn == []
    W, mu, s = (pyro.param(k).detach().numpy() for k in ("W", "mu", "s"))
    ref = multivariate_normal(mu, W @ W.T + s**2 * np.eye(6)).logpdf(x.numpy())
    assert np.abs(score.detach().numpy() - ref).max() < 1e-10
    # missing tokens: the observed sub-vector's density, again without orderings
    observed = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    observed[:, 0] = True

    def masked(x):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).mask(observed).to_event(1), obs=x)

    part = MaskedPretrainingLoss(masks="order", num_masks=2).score(masked, None, x)
    assert drawn == []
    for i in (0, 7):
        o = observed[i].numpy()
        cov = (W @ W.T + s**2 * np.eye(6))[np.ix_(o, o)]
        assert abs(part[i].item() - multivariate_normal(mu[o], cov).logpdf(x[i].numpy()[o])) < 1e-10
    # a sampling engine reads each ordering: 3 per datapoint, drawn when its block is evaluated
    torch.manual_seed(0)
    MaskedPretrainingLoss(masks="order", num_masks=3, conditionals="importance", num_samples=16).score(
        model, exact_posterior_guide, x
    )
    assert drawn == [(3, 40, 6)]


def test_chain_block_draws_its_orderings_once():
    calls = []

    def draw():
        calls.append(1)
        return torch.stack([torch.randperm(5) for _ in range(2)])[:, None]

    block = ChainBlock(None, torch.ones(2, 1), draw=draw, shape=(2, 1, 5))
    assert block.orders_shape() == (2, 1, 5) and calls == []
    first = block.orders()
    assert block.orders() is first and calls == [1]
    assert torch.equal(first.sort(-1).values, torch.arange(5).expand(2, 1, 5))


def test_share_masks_must_be_a_bool():
    """share_masks="no" was taken as True (a non-empty string); numpy and torch boolean
    scalars are bools, anything else is refused by name."""
    import numpy as np

    for bad in ["no", "yes", 1, 0.0, torch.tensor([True])]:
        with pytest.raises(TypeError, match="share_masks must be True .* or False"):
            MaskedPretrainingLoss(masks="all", share_masks=bad)
        with pytest.raises(TypeError, match="share_masks must be True"):
            UniformSizes(2, share_masks=bad)
    for flag in [np.bool_(True), torch.tensor(True)]:
        assert MaskedPretrainingLoss(masks="all", share_masks=flag).schedule.share_masks is True
        assert UniformSizes(2, share_masks=flag).share_masks is True
    assert MaskedPretrainingLoss(masks="uniform", share_masks=np.bool_(False)).schedule.share_masks is False


def test_pll_with_missing_tokens_from_the_observed_posterior(float64, monkeypatch):
    """PPCA with a fifth of the tokens missing (``.mask(m)``): "pll" sums log p(x_j | x_{O \\ j})
    over each datapoint's observed tokens from one posterior a datapoint, no mask made (D = 8000,
    n = 4: 12.4 s -> 0.07 s a step); equal to numpy's leave-one-out of each datapoint's
    observed sub-covariance (1e-10), and to the per-mask path's loss, gradient and curve point."""
    D, N, K = 12, 5, 2
    model0, x, _ = make_ppca(D, K, N=N, seed=9)
    m = torch.rand(N, D, generator=torch.Generator().manual_seed(2)) > 0.2
    W0, mu0 = pyro.param("W").detach().clone(), pyro.param("mu").detach().clone()

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.param("mu", mu0.clone())
        s = pyro.param("s", torch.tensor(0.5, dtype=torch.float64), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).mask(m).to_event(1), obs=x)

    made = []
    original = MaskBlock.masks
    monkeypatch.setattr(MaskBlock, "masks", lambda self: made.append(1) or original(self))

    def run(engine):
        pyro.clear_param_store()
        loss = MaskedPretrainingLoss(masks="pll", conditionals=engine)
        value = loss.differentiable_loss(model, None, x)
        (grad,) = torch.autograd.grad(value, [pyro.param("W").unconstrained()])
        return value.item(), grad, loss.score(model, None, x).detach(), loss.curve(model, None, x).score[0]

    value, grad, score, point = run(GaussianConditionals())
    assert made == []
    S = (W0 @ W0.T).numpy() + 0.25 * np.eye(D)
    for i in range(N):
        o = m[i].numpy()
        want = numpy_leave_one_out(S[np.ix_(o, o)], (x[i] - mu0).numpy()[o]).sum()
        assert abs(float(score[i]) - want) < 1e-10 * abs(want)
    value_b, grad_b, _, point_b = run(_NoLeaveOneOutPass())
    assert made and abs(value - value_b) < 1e-10 * abs(value_b)
    assert torch.allclose(grad, grad_b, rtol=1e-9, atol=1e-12)
    assert abs(point - point_b) < 1e-10 * abs(point_b)


def test_custom_block_sizes_are_counted(float64):
    """A custom schedule's MaskBlock divides each query's summed log-conditionals by its
    ``size``: sizes that match the masks give numpy's conditionals summed over the
    targets over the mask size (to 1e-10), and a size that does not (every query
    given size 1, the loss silently M times a query's terms) is refused, for stored masks
    and for masks from ``draw``, naming the query, the datapoint and both counts."""
    D, N, K = 6, 3, 2
    model, x, _ = make_ppca(D, K, N=N, seed=6)
    W, mu, s = (pyro.param(k).detach().numpy() for k in ("W", "mu", "s"))
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, D + 1, (4, N, 1), generator=g)
    mask = torch.rand(4, N, D, generator=g).argsort(-1) < sizes
    weight = torch.rand(4, N, generator=g, dtype=torch.float64)
    terms = numpy_conditionals(mu, W @ W.T + s**2 * np.eye(D), x.numpy(), mask.numpy()).sum(-1)
    want = (weight.numpy() * terms / sizes[..., 0].numpy()).sum(0)

    class Given(MaskSchedule):
        covers_all_sizes = False

        def __init__(self, size, drawn=False):
            super().__init__(1)
            self.size, self.drawn = size, drawn

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            if self.drawn:
                yield MaskBlock(None, self.size, weight, draw=lambda: mask)
            else:
                yield MaskBlock(mask, self.size, weight)

    for drawn in (False, True):
        got = MaskedPretrainingLoss(masks=Given(sizes[..., 0], drawn)).score(model, None, x)
        assert np.abs(got.detach().numpy() - want).max() < 1e-10
        ones = torch.ones(4, N, dtype=torch.long)
        first = int(sizes[0, 0, 0])
        if first == 1:
            first_wrong = np.flatnonzero(sizes[..., 0].numpy().reshape(-1) != 1)[0]
            q, i = divmod(int(first_wrong), N)
        else:
            q, i = 0, 0
        with pytest.raises(ValueError, match=rf"query {q} hides {int(sizes[q, i, 0])} tokens of datapoint {i} but its size says 1"):
            MaskedPretrainingLoss(masks=Given(ones, drawn)).score(model, None, x)


def test_schedule_flags_must_be_bools():
    """nested="no" gave nested masks, stratified="no" stratified sizes, at_least_one="no" raised
    a zero count to 1, and the schedules that draw no mask took share_masks="x" without a word:
    each flag is refused by name unless it is a bool (numpy and torch boolean scalars are)."""
    import numpy as np

    makers = {
        "nested": lambda v: AllSizes(2, nested=v),
        "stratified": lambda v: UniformSizes(2, stratified=v),
        "at_least_one": lambda v: FixedRate(0.1, at_least_one=v),
        "share_masks": lambda v: PseudoLikelihood(share_masks=v),
    }
    for name, make in makers.items():
        for bad in ["no", 1, 0.0, torch.tensor([True])]:
            with pytest.raises(TypeError, match=rf"{name} must be True \(.*\) or False \(.*\), got"):
                make(bad)
        for flag in [np.bool_(False), torch.tensor(False), False]:
            make(flag)
    assert AllSizes(2, nested=np.bool_(True)).nested is True
    with pytest.raises(TypeError, match=r"progress must be True \(a progress bar in score\(\) and curve\(\)\) or False"):
        MaskedPretrainingLoss(progress="no")
    with pytest.raises(TypeError, match="share_masks must be True"):
        Exhaustive(share_masks="x")


def test_rate_counts_round_the_written_halves_up():
    """A rate r masks floor(r L + 1/2) of L tokens with r L as the decimal rate is written:
    exact rational arithmetic (fractions.Fraction of the rate's decimal string) over the rates
    0.01..0.99 and L = 1..200. Before, binary rounding took 0.29 * 50 = 14.4999... down to 14
    (2 of the paper's 99 rates at L = 50). FixedRate.size, the adapters' mask_counts and
    rate_count agree with it."""
    from fractions import Fraction

    from pyro_mpt.adapters.rates import mask_counts
    from pyro_mpt.counts import rate_count

    rates = [k / 100 for k in range(1, 100)]
    lengths = np.arange(1, 201)
    want = np.array([[int(Fraction(str(r)) * int(L) + Fraction(1, 2)) for r in rates] for L in lengths])
    got = mask_counts(rates, lengths).numpy()
    assert (got == np.clip(want, 1, lengths[:, None])).all()
    assert rate_count(0.29, 50) == 15 and rate_count(0.25, 10) == 3
    for k in (7, 29, 57, 25, 15):
        r = k / 100
        assert FixedRate(r).size(50) == want[49, k - 1]
        sizes = FixedRate(r, at_least_one=True).size(torch.as_tensor(lengths))
        assert (sizes.numpy() == np.clip(want[:, k - 1], 1, lengths)).all()


def test_schedule_reprs_rebuild_the_schedule():
    """A schedule's repr left out share_masks (and FixedRate's at_least_one), so that a
    printed schedule read as another: evaluated, each repr rebuilds an equal schedule."""
    namespace = dict(AllSizes=AllSizes, UniformSizes=UniformSizes, RandomOrders=RandomOrders,
                     Exhaustive=Exhaustive, PseudoLikelihood=PseudoLikelihood, FixedRate=FixedRate)
    for schedule in [AllSizes(2), AllSizes(2, share_masks=True), AllSizes(3, nested=True, share_masks=True),
                     UniformSizes(3, share_masks=True), UniformSizes(2, stratified=True), RandomOrders(2, share_masks=True),
                     Exhaustive(), PseudoLikelihood(), FixedRate(0.15, 2, share_masks=True, at_least_one=True)]:
        rebuilt = eval(repr(schedule), namespace)
        assert type(rebuilt) is type(schedule) and vars(rebuilt) == vars(schedule), repr(schedule)


def test_custom_blocks_target_only_context_tokens_and_named_targets_take_size_one(float64):
    """A custom block with a context (missing tokens) whose mask also hides a missing token
    scored that token's term too (the docs: missing tokens are never targets), and its size
    check counted it; a block that names its targets (targets=) was served by the leave-one-out
    pass without its masks, so a size of 2 halved the pll silently. Now a mask's targets are
    its tokens within the context: the score equals the block without the missing token (and
    numpy's conditional on the observed tokens), its size counts the observed targets, and a
    named-target block of size 2 is refused."""
    W = torch.tensor([[1.0], [0.5], [-1.0], [2.0]])
    observed = torch.tensor([[False, True, True, True]])

    def model(x, m):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).mask(m).to_event(1), obs=x)

    class Custom(MaskSchedule):
        covers_all_sizes = False

        def __init__(self, mask, size):
            super().__init__(1)
            self.mask, self.size = mask, size

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            yield MaskBlock(self.mask, self.size, torch.ones(1, 1), observed[None], torch.ones(1, n))

    x = torch.tensor([[0.3, -0.2, 1.0, 0.7]])
    C = (W @ W.T).numpy() + 0.25 * np.eye(4)
    # token 1 given tokens 2 and 3 (token 0 missing: neither context nor target)
    gain = np.linalg.solve(C[np.ix_([2, 3], [2, 3])], C[[2, 3], 1])
    want = scipy.stats.norm.logpdf(-0.2, gain @ x[0, [2, 3]].numpy(), np.sqrt(C[1, 1] - gain @ C[[2, 3], 1]))
    one = torch.tensor([[[False, True, False, False]]])
    both = torch.tensor([[[True, True, False, False]]])
    for mask in (one, both):
        got = MaskedPretrainingLoss(masks=Custom(mask, torch.ones(1, 1, dtype=torch.long))).score(model, None, x, observed)
        assert abs(float(got) - want) < 1e-10
    with pytest.raises(ValueError, match="query 0 hides 1 tokens of datapoint 0 but its size says 2"):
        MaskedPretrainingLoss(masks=Custom(both, torch.full((1, 1), 2))).score(model, None, x, observed)
    with pytest.raises(ValueError, match=r"names one target token \(targets=\) but its size says 2"):
        MaskBlock(None, torch.full((4, 1), 2), torch.ones(4, 1), targets=torch.arange(4),
                  draw=lambda: torch.eye(4, dtype=torch.bool)[:, None])


def test_float32_rates_count_as_written():
    """np.float32(0.29) is 0.28999999165... in float64, so 0.29 of 50 tokens counted 14 from a
    float32 rate and 15 from a Python float: a float32 rate is read as the shortest decimal
    that names it, for FixedRate and the adapters' counts alike (fractions.Fraction of that
    decimal as the reference)."""
    from fractions import Fraction

    from pyro_mpt.adapters.rates import mask_counts

    rates32 = (np.arange(1, 100) / 100).astype(np.float32)
    lengths = np.arange(1, 101)
    want = np.array([[int(Fraction(str(r)) * int(L) + Fraction(1, 2)) for r in rates32] for L in lengths])
    assert (mask_counts(rates32, lengths).numpy() == np.clip(want, 1, lengths[:, None])).all()
    assert (mask_counts(torch.from_numpy(rates32), lengths).numpy() == np.clip(want, 1, lengths[:, None])).all()
    assert FixedRate(np.float32(0.29)).size(50) == 15 and FixedRate(np.float32(0.3)).size(5) == 2
    # float16 rates by their own shortest decimal (0.7 of 5 is 4 as written; 3 through float32's)
    assert mask_counts(np.float16([0.1, 0.7]), [5]).tolist() == [[1, 4]]
