"""A Gaussian mixture's per-datapoint conditionals through the components' precisions
(pairs with fewer targets than context tokens).

References: a loop over (mask, component, datapoint) of one-dimensional conditionals from
``torch.linalg.solve`` on the pair's own context block and the context's density from
``scipy.stats.multivariate_normal``, differentiated by autograd.
"""

import itertools

import numpy as np
import pytest
import scipy.stats
import torch

from pyro_mpt.conditionals import gaussian_dense_independent as gdi
from pyro_mpt.conditionals import gaussian_dense_precision as gdp

from models import assert_close_to_rounding, saved_numel


def loop_reference(S, x, loc, context):
    """``(q, K, n, D)`` log-conditionals (0 at the context) and ``(q, K, n)`` context densities."""
    q, n, D = context.shape
    K = S.shape[0]
    log_c = [[[None] * n for _ in range(K)] for _ in range(q)]
    log_r = [[[None] * n for _ in range(K)] for _ in range(q)]
    for i, k, j in itertools.product(range(q), range(K), range(n)):
        c = context[i, j].nonzero().flatten()
        r = x[j] - loc[k, j if loc.shape[1] > 1 else 0]
        row = [r.new_zeros(())] * D
        for t in (~context[i, j]).nonzero().flatten().tolist():
            if len(c):
                sol = torch.linalg.solve(S[k][c][:, c], torch.stack([r[c], S[k][c, t]], -1))
                mean, var = S[k][t, c] @ sol[:, 0], S[k][t, t] - S[k][t, c] @ sol[:, 1]
            else:
                mean, var = r.new_zeros(()), S[k][t, t]
            row[t] = torch.distributions.Normal(mean, var.sqrt()).log_prob(r[t])
        log_c[i][k][j] = torch.stack(row)
        if len(c):
            log_r[i][k][j] = torch.distributions.MultivariateNormal(r.new_zeros(len(c)), S[k][c][:, c]).log_prob(r[c])
        else:
            log_r[i][k][j] = r.new_zeros(())
    return (torch.stack([torch.stack([torch.stack(b) for b in a]) for a in log_c]),
            torch.stack([torch.stack([torch.stack(b) for b in a]) for a in log_r]))


def spd(K, D, g, dtype=torch.float64):
    """``(S, A)``: ``S = A A^T / D + I / 2`` with ``A`` a leaf, so that gradients compare
    through ``A`` (a loop's gradient of ``S`` itself is not symmetrized)."""
    A = torch.randn(K, D, D, generator=g, dtype=dtype).requires_grad_()
    return A @ A.mT / D + 0.5 * torch.eye(D, dtype=dtype), A


@pytest.mark.parametrize("keep_elements", [0, 2**20])  # every chunk recomputed; every chunk kept
@pytest.mark.parametrize("max_elements", [2, 40, 2**20])  # one pair a chunk, several, all
def test_precision_route_matches_a_loop(monkeypatch, max_elements, keep_elements):
    """Values and gradients (of S, loc and x, random weights on both outputs) against the
    loop, with pairs on both routes: targets fewer than, equal to and more than the context,
    no target at all (the context density is the full joint's) and no context."""
    q, n, D, K = 2, 5, 6, 2
    g = torch.Generator().manual_seed(21)
    S, A = spd(K, D, g)
    loc = torch.randn(K, n, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64).requires_grad_()
    context = torch.rand(q, n, D, generator=g) < torch.linspace(0.1, 0.9, n)[:, None]
    context[0, 0] = True  # no target
    context[0, 1] = False  # no context
    context[1, 2] = torch.arange(D) < 4  # two targets, four context tokens
    context[1, 3] = torch.arange(D) < 3  # as many targets as context tokens: the context's route
    calls = []
    apply = gdp.PrecisionTargetConditionals.apply
    monkeypatch.setattr(gdp.PrecisionTargetConditionals, "apply", lambda *a: calls.append(a[3].shape[0]) or apply(*a))
    got_c, got_r = gdp.dense_context_conditionals(S, x, loc, context, max_elements, "x", keep_elements)
    assert calls == [int((2 * context.sum(-1) > D).sum())]
    ref_c, ref_r = loop_reference(S, x, loc, context)
    assert_close_to_rounding(got_c, ref_c, torch.float64)
    assert_close_to_rounding(got_r, ref_r, torch.float64)
    # the full joint's density (no target) from scipy, outside torch
    want = scipy.stats.multivariate_normal(loc[1, 0].detach().numpy(), S[1].detach().numpy()).logpdf(x[0].detach().numpy())
    assert abs(float(got_r[0, 1, 0]) - want) < 1e-12 * max(1.0, abs(want))
    wc = torch.randn(q, K, n, D, generator=g, dtype=torch.float64)
    wr = torch.randn(q, K, n, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((wc * got_c).sum() + (wr * got_r).sum(), (A, loc, x), retain_graph=True)
    expected = torch.autograd.grad((wc * ref_c).sum() + (wr * ref_r).sum(), (A, loc, x))
    for a, b in zip(grads, expected):
        assert_close_to_rounding(a, b, torch.float64)


def rotated(K, D, eigenvalues, g):
    Q = torch.linalg.qr(torch.randn(K, D, D, generator=g, dtype=torch.float64))[0]
    S = Q @ torch.diag_embed(eigenvalues.expand(K, D)) @ Q.mT
    return 0.5 * (S + S.mT)


@pytest.mark.parametrize("condition", [1e2, 1e5])
def test_float32_precision_route_keeps_the_context_routes_digits(monkeypatch, condition):
    """float32 against float64: on components of condition number 1e2 the precision route
    is taken and its errors stay within 4x the context route's (measured: 1-3x at 1e1..1e3;
    the two lose digits alike as the condition grows); at 1e5, past MAX_CONDITION, every
    pair takes the context route."""
    q, n, D, K = 1, 200, 20, 2
    g = torch.Generator().manual_seed(22)
    S = rotated(K, D, torch.logspace(0, np.log10(condition), D, dtype=torch.float64), g)
    loc = torch.zeros(K, 1, D, dtype=torch.float64)
    x = (torch.linalg.cholesky(S[0]) @ torch.randn(D, n, generator=g, dtype=torch.float64)).T
    context = torch.rand(q, n, D, generator=g) < torch.rand(q, n, 1, generator=g)
    calls = []
    apply = gdp.PrecisionTargetConditionals.apply
    monkeypatch.setattr(gdp.PrecisionTargetConditionals, "apply", lambda *a: calls.append(1) or apply(*a))
    ref = gdi.DenseContextConditionals.apply(S, x, loc, context, 2**22, "x", 0)
    f32 = (S.float(), x.float(), loc.float(), context, 2**22, "x", 0)
    old = gdi.DenseContextConditionals.apply(*f32)
    new = gdp.dense_context_conditionals(*f32)
    assert bool(calls) == (condition < 1e4)
    for a, b, r in zip(old, new, ref):
        err_old = float((a.double() - r).abs().max())
        err_new = float((b.double() - r).abs().max())
        assert err_new <= 4 * err_old + 1e-5, (err_new, err_old)


def test_precision_routes_kept_tables_stay_within_their_budget():
    """``keep_elements`` bounds the tables that the two routes keep for the backward pass
    together (beyond them: inputs, the pairs' rows, bits and token indices); kept and
    recomputed chunks give equal gradients."""
    q, n, D, K = 3, 40, 6, 2
    g = torch.Generator().manual_seed(23)
    S = spd(K, D, g)[0].detach().requires_grad_()
    loc = torch.randn(K, 1, D, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    context = torch.rand(q, n, D, generator=g) < 0.5
    # inputs, the precisions, the (K, n, D) residual products, Cholesky factors, bits and
    # rows: an upper bound of what is saved whatever is kept
    base = 4 * S.numel() + 4 * x.numel() * K + 2 * q * n * D + 8 * q * n
    grads = []
    for keep in (0, 300, 10**6):
        kept, (log_c, log_r) = saved_numel(lambda: gdp.dense_context_conditionals(S, x, loc, context, 8 * D * D, "x", keep))
        assert kept <= base + (keep and keep + 2 * q * n * D), (keep, kept)
        if keep == 10**6:
            assert kept > base + 300  # the check can fail: everything kept
        grads.append(torch.autograd.grad(log_c.sum() + log_r.sum(), S)[0])
    for a in grads[1:]:
        assert_close_to_rounding(a, grads[0], torch.float64)


class _State:
    """The fields of a dense Gaussian state that ``routed_dense_sums`` reads."""

    def __init__(self, S, loc):
        self.covariance, self.loc, self.site = S[None], loc, "x"


def spy(monkeypatch, cls):
    """The number of pairs each ``cls.apply`` call's own route serves (its outputs not 0 by
    its route), in order."""
    calls = []
    apply = cls.apply

    def served(a):
        if cls is gdi.DenseIndependentSums:
            return int((a[3].sum(-1) >= (a[7] if len(a) > 7 else 0)).sum())
        return int((a[2].sum(-1) <= a[5]).sum())

    monkeypatch.setattr(cls, "apply", lambda *a: calls.append(served(a)) or apply(*a))
    return calls


@pytest.mark.parametrize("keep", [0, 300, 2**20])  # every chunk recomputed; the costliest kept; every chunk kept
@pytest.mark.parametrize("missing", [False, True])
@pytest.mark.parametrize("loc_rows", [1, 5])
@pytest.mark.parametrize("max_elements", [1, 40, 2**20])  # one pair a chunk (on both routes), several, all
def test_routed_sums_match_a_loop(monkeypatch, max_elements, loc_rows, missing, keep):
    """A single Gaussian's summed conditionals with masks per datapoint, each pair on its
    route (fewer targets than context tokens: the precision's; else the context's): values
    and gradients (of S through its factor, loc and x; random weights per pair) against the
    loop's conditionals, with missing tokens (hidden, never summed) or without; pairs with no
    target, no context, one target, and as many targets as context tokens."""
    q, n, D = 3, 5, 6
    g = torch.Generator().manual_seed(31)
    S, A = spd(1, D, g)
    loc = torch.randn(loc_rows, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(q, n, D, generator=g) < torch.linspace(0.1, 0.9, n)[:, None]
    mask[0, 0] = False  # no target
    mask[0, 1] = True  # no context
    mask[1, 2] = torch.arange(D) == 4  # one target
    mask[1, 3] = torch.arange(D) < 3  # as many targets as context tokens: the context's route
    observed = torch.rand(n, D, generator=g) < 0.7 if missing else None
    prec_calls, ctx_calls = spy(monkeypatch, gdp.PrecisionTargetSums), spy(monkeypatch, gdi.DenseIndependentSums)
    got = gdp.routed_dense_sums(_State(S[0], loc), x, mask, max_elements, observed, None, keep)
    n_prec = int((2 * mask.sum(-1) < D).sum())
    assert prec_calls == [n_prec] and ctx_calls == [q * n - n_prec]
    log_c = loop_reference(S, x, loc[None], ~mask)[0][:, 0]  # (q, n, D), 0 at the context
    want = (log_c * (1.0 if observed is None else observed.double())).sum(-1)
    assert_close_to_rounding(got, want, torch.float64)
    w = torch.randn(q, n, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((w * got).sum(), (A, loc, x), retain_graph=True)
    expected = torch.autograd.grad((w * want).sum(), (A, loc, x))
    for a, b in zip(grads, expected):
        assert_close_to_rounding(a, b, torch.float64)


def test_routed_sums_value_of_one_pair_against_scipy():
    """One pair on the precision route (two targets of seven) against scipy's conditional
    of the multivariate normal, outside torch: each target's marginal given the context."""
    D = 7
    g = torch.Generator().manual_seed(32)
    S = spd(1, D, g)[0][0].detach()
    x = torch.randn(1, D, generator=g, dtype=torch.float64)
    mask = torch.zeros(1, 1, D, dtype=torch.bool)
    mask[0, 0, [1, 5]] = True
    got = float(gdp.routed_dense_sums(_State(S, torch.zeros(1, D, dtype=torch.float64)), x, mask, 2**20))
    Sn, r = S.numpy(), x[0].numpy()
    t, c = mask[0, 0].numpy(), ~mask[0, 0].numpy()
    cond = Sn[np.ix_(t, c)] @ np.linalg.inv(Sn[np.ix_(c, c)])
    mean, var = cond @ r[c], np.diag(Sn[np.ix_(t, t)] - cond @ Sn[np.ix_(c, t)])
    want = scipy.stats.norm.logpdf(r[t], mean, np.sqrt(var)).sum()
    assert abs(got - want) < 1e-12 * max(1.0, abs(want))


@pytest.mark.parametrize("condition", [1e2, 1e5])
def test_float32_routed_sums_keep_the_context_routes_digits(monkeypatch, condition):
    """float32 against float64: at condition number 1e2 the precision route serves the pairs
    of few targets and the sums' errors (values and S's gradient) stay within 4x the context
    route's alone; at 1e5, past MAX_CONDITION, every pair takes the context route."""
    q, n, D = 1, 300, 20
    g = torch.Generator().manual_seed(33)
    S = rotated(1, D, torch.logspace(0, np.log10(condition), D, dtype=torch.float64), g)[0]
    x = (torch.linalg.cholesky(S) @ torch.randn(D, n, generator=g, dtype=torch.float64)).T
    mask = torch.rand(q, n, D, generator=g) < torch.rand(q, n, 1, generator=g)
    loc = torch.zeros(1, D, dtype=torch.float64)
    w = torch.rand(q, n, generator=g, dtype=torch.float64)

    def run(fn, dtype):
        Sd = S.to(dtype).requires_grad_()
        out = fn(Sd, dtype)
        return out.double(), torch.autograd.grad((w.to(dtype) * out).sum(), Sd)[0].double()

    def old(Sd, dtype):
        return gdi.DenseIndependentSums.apply(Sd, x.to(dtype), loc.to(dtype), mask, 2**22, "x")

    def new(Sd, dtype):
        return gdp.routed_dense_sums(_State(Sd, loc.to(dtype)), x.to(dtype), mask, 2**22)

    ref = run(old, torch.float64)
    calls = spy(monkeypatch, gdp.PrecisionTargetSums)
    got_old, got_new = run(old, torch.float32), run(new, torch.float32)
    assert bool(calls) == (condition < 1e4)
    for a, b, r in zip(got_old, got_new, ref):
        err_old = float((a - r).abs().max())
        err_new = float((b - r).abs().max())
        assert err_new <= 4 * err_old + 1e-5 * float(r.abs().max()), (err_new, err_old)


def test_precision_sums_keep_only_their_inputs_and_bits():
    """What the precision route saves for its backward pass: its inputs (the precision,
    ``y``) and the masks' bits, none of the chunks' tables (they are recomputed); the
    gradient is that of a chunk of every pair, and the pairs past ``max_targets`` have sums
    0 and no gradient."""
    q, n, D = 4, 50, 8
    g = torch.Generator().manual_seed(34)
    Lam = torch.linalg.inv(spd(1, D, g)[0][0].detach()).requires_grad_()
    y = torch.randn(n, D, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(q, n, D, generator=g) < 0.4
    grads = []
    for max_elements in (1, 2**20):
        saved, out = saved_numel(lambda: gdp.PrecisionTargetSums.apply(Lam, y, mask, max_elements, None, 3))
        assert saved <= Lam.numel() + y.numel() + q * n * ((D + 7) // 8), saved
        assert bool((out[mask.sum(-1) > 3] == 0).all()) and bool((out[mask.sum(-1) <= 3] != 0).any())
        grads.append(torch.autograd.grad(out.sum(), (Lam, y)))
    for a, b in zip(*grads):
        assert_close_to_rounding(a, b, torch.float64)


def test_training_loss_over_several_blocks_takes_both_routes_and_one_precision(monkeypatch):
    """``MaskedPretrainingLoss`` with masks per datapoint on a full-covariance MVN whose
    ``scale_tril`` and mean are params, ``masks="all"`` in blocks of one mask (``chunk_size
    = N D``): the loss and its gradients against the loop's conditionals of the same masks,
    differentiated by autograd; every block takes the precision route for its pairs of few
    targets, from one precision per step (its check made once, not per block)."""
    import pyro
    import pyro.distributions as dist
    from pyro_mpt import MaskedPretrainingLoss

    pyro.clear_param_store()
    D, N = 7, 6
    g = torch.Generator().manual_seed(35)
    L0 = torch.linalg.cholesky(spd(1, D, g)[0][0].detach())
    x = torch.randn(N, D, generator=g, dtype=torch.float64) @ L0.T + 0.5

    def model(x):
        L = pyro.param("L", L0.clone(), constraint=dist.constraints.lower_cholesky)
        loc = pyro.param("loc", torch.full((D,), 0.3, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(loc, scale_tril=L), obs=x)

    checks, blocks_seen = [], spy(monkeypatch, gdp.PrecisionTargetSums)
    fits = gdp.precision_route_fits
    monkeypatch.setattr(gdp, "precision_route_fits", lambda S: checks.append(1) or fits(S))
    loss = MaskedPretrainingLoss(masks="all", share_masks=False, chunk_size=N * D)
    pyro.set_rng_seed(8)
    value = loss.differentiable_loss(model, None, x)
    assert len(checks) == 1 and len(blocks_seen) == (D - 1) // 2  # sizes 1..3 of 7 have few targets
    params = [pyro.param("L").unconstrained(), pyro.param("loc").unconstrained()]
    got = torch.autograd.grad(value, params)

    pyro.set_rng_seed(8)
    blocks = list(loss.schedule.blocks(N, D, max_elements=loss.chunk_size))
    L, loc = pyro.param("L"), pyro.param("loc")
    S = L @ L.T
    estimate = x.new_zeros(())
    for block in blocks:
        mask = block.masks().expand(-1, N, -1)
        log_c = loop_reference(S[None], x, loc[None, None], ~mask)[0][:, 0]
        sums = (log_c * mask).sum(-1)
        estimate = estimate + (block.weight.to(sums.dtype) * sums / block.size.to(sums.dtype)).sum()
    assert_close_to_rounding(value, -estimate, torch.float64)
    for a, b in zip(got, torch.autograd.grad(-estimate, params)):
        assert_close_to_rounding(a, b, torch.float64)


def test_routed_sums_keep_their_first_blocks_tables_within_the_budget():
    """``keep_elements`` bounds the floating-point tables the two routes keep for the backward
    pass together, and only the first block of masks of a state (``kept``) keeps any: a second
    block saves no more than with nothing kept; kept and recomputed chunks give equal
    gradients."""
    q, n, D = 2, 40, 8
    g = torch.Generator().manual_seed(36)
    S = spd(1, D, g)[0][0].detach().requires_grad_()
    loc = torch.zeros(1, D, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    mask = torch.rand(q, n, D, generator=g) < torch.rand(q, n, 1, generator=g)
    state = _State(S, loc)
    # inputs, bits, and the precision, y and their graph (once per state): what is saved whatever is kept
    base = 4 * S.numel() + 3 * x.numel() + q * n * D
    indices = q * n * 2 * D  # the kept chunks' token indices (R and M, or M), beyond the floating-point tables
    grads = []
    for keep in (0, 500, 10**7):
        kept = {}
        saved, out = saved_numel(lambda: gdp.routed_dense_sums(state, x, mask, 2**10, None, kept, keep))
        assert saved <= base + (keep and min(keep, 10**6) + indices), (keep, saved)
        if keep == 10**7:
            assert saved > base + 500  # the check can fail: everything kept
        again, out2 = saved_numel(lambda: gdp.routed_dense_sums(state, x, mask, 2**10, None, kept, keep))
        assert again <= base, again  # a later block of the same state: inputs (shared) and bits, nothing kept
        grads.append(torch.autograd.grad(out.sum() + out2.sum(), S)[0])
    for a in grads[1:]:
        assert_close_to_rounding(a, grads[0], torch.float64)
