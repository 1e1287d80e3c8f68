"""Dense masks drawn per datapoint: summed conditionals (the Gaussian engine) and per-token
conditionals with context densities (Gaussian mixtures), with written backward passes.

References: for every (mask, datapoint) pair a loop of one-dimensional conditionals, each
from ``torch.linalg.solve`` on the pair's own context block (values also checked against
scipy), differentiated by autograd.
"""

import itertools

import numpy as np
import pytest
import scipy.stats
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals
from pyro_mpt.conditionals import gaussian_dense_independent as gdi
from pyro_mpt.observed_tokens import trace_tokens

from models import assert_close_to_rounding, saved_numel


def brute_sums(S, r, mask):
    """``(q, n)``: sum over each pair's targets of log N(r_j; S_jR S_RR^-1 r_R, S_jj - S_jR S_RR^-1 S_Rj)."""
    q, n, D = mask.shape
    rows = []
    for i in range(q):
        row = []
        for k in range(n):
            t, c = mask[i, k].nonzero().flatten(), (~mask[i, k]).nonzero().flatten()
            total = r.new_zeros(())
            for j in t.tolist():
                if len(c):
                    sol = torch.linalg.solve(S[c][:, c], torch.stack([r[k, c], S[c, j]], -1))
                    mean, var = S[j, c] @ sol[:, 0], S[j, j] - S[j, c] @ sol[:, 1]
                else:
                    mean, var = r.new_zeros(()), S[j, j]
                total = total + torch.distributions.Normal(mean, var.sqrt()).log_prob(r[k, j])
            row.append(total)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def masks(q, n, D, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(q, n, D, generator=g) < 0.5
    mask[0, 0] = True  # every token a target: no context
    mask[-1, -1] = False
    mask[-1, -1, 2] = True  # one target, the rest context
    mask[0, 1] = False  # no target: contributes nothing
    return mask


@pytest.mark.parametrize("loc_rows", [1, 4])
@pytest.mark.parametrize("max_elements", [36, 100, 2**20])  # one pair a chunk, two, all
def test_sums_and_gradients_match_a_loop_of_conditionals(loc_rows, max_elements):
    q, n, D = 3, 4, 6
    g = torch.Generator().manual_seed(1)
    A = torch.randn(D, D, generator=g, dtype=torch.float64).requires_grad_()
    loc = torch.randn(loc_rows, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(q, n, generator=g, dtype=torch.float64)
    mask = masks(q, n, D, seed=2)

    def cov(A):
        return A @ A.T + 0.3 * torch.eye(D, dtype=torch.float64)

    got = gdi.DenseIndependentSums.apply(cov(A), x, loc, mask, max_elements, "x")
    want = brute_sums(cov(A), x - loc, mask)
    assert_close_to_rounding(got, want, torch.float64)
    assert got[0, 1] == 0
    # one pair against scipy's conditional of the multivariate normal
    S, r = cov(A).detach().numpy(), (x - loc).detach().numpy()[1]
    t, c = mask[1, 1].numpy(), ~mask[1, 1].numpy()
    cond = S[np.ix_(t, c)] @ np.linalg.inv(S[np.ix_(c, c)])
    mean, var = cond @ r[c], np.diag(S[np.ix_(t, t)] - cond @ S[np.ix_(c, t)])
    assert abs(float(got[1, 1]) - scipy.stats.norm.logpdf(r[t], mean, np.sqrt(var)).sum()) < 1e-12

    grads = torch.autograd.grad((weight * got).sum(), (A, loc, x))
    expected = torch.autograd.grad((weight * want).sum(), (A, loc, x))
    for a, b in zip(grads, expected):
        assert_close_to_rounding(a, b, torch.float64)


def full_gaussian_model(D, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    L0 = torch.linalg.cholesky(torch.cov(torch.randn(D, 3 * D, generator=g, dtype=torch.float64)))
    x = torch.randn(N, D, generator=g, dtype=torch.float64) @ L0.T + 1.0

    def model(x):
        L = pyro.param("L", L0.clone(), constraint=dist.constraints.lower_cholesky)
        loc = pyro.param("loc", torch.zeros(D, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(loc, scale_tril=L), obs=x)

    return model, x


def test_engine_sums_masks_per_datapoint_with_the_written_backward(monkeypatch):
    pyro.clear_param_store()
    D, N, q = 5, 6, 2
    model, x = full_gaussian_model(D, N)
    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = masks(q, N, D, seed=3)
    calls = []
    apply = gdi.DenseIndependentSums.apply
    monkeypatch.setattr(gdi.DenseIndependentSums, "apply", lambda *a: calls.append(1) or apply(*a))
    assert engine.recomputes_mask_sums(state, tokens.value, mask)
    got = engine.mask_sums(state, tokens.value, mask)
    assert calls, "masks per datapoint on a dense covariance shared by the batch take the written backward"

    L, loc = pyro.param("L"), pyro.param("loc")
    want = brute_sums(L @ L.T, x - loc, mask)
    assert_close_to_rounding(got, want, torch.float64)
    params = [pyro.param("L").unconstrained(), pyro.param("loc").unconstrained()]
    weight = torch.linspace(0.5, 2.0, q * N, dtype=torch.float64).view(q, N)
    for a, b in zip(torch.autograd.grad((weight * got).sum(), params), torch.autograd.grad((weight * want).sum(), params)):
        assert_close_to_rounding(a, b, torch.float64)


def test_training_loss_with_masks_per_datapoint_matches_the_loop():
    """The loss ``MaskedPretrainingLoss`` gives with the ``"exhaustive"``-free default
    schedule, masks per datapoint, equals its estimate from the loop's conditionals."""
    pyro.clear_param_store()
    D, N = 4, 5
    model, x = full_gaussian_model(D, N, seed=4)
    loss = MaskedPretrainingLoss(masks="all", share_masks=False)
    pyro.set_rng_seed(7)
    value = loss.differentiable_loss(model, lambda x: None, x)
    # the same masks: "all" draws, for every size M, one uniformly random M-subset per datapoint
    pyro.set_rng_seed(7)
    blocks = list(loss.schedule.blocks(N, D, max_elements=loss.chunk_size))
    L, loc = pyro.param("L"), pyro.param("loc")
    estimate = x.new_zeros(N)
    for block in blocks:
        mask = block.masks()
        sums = brute_sums(L @ L.T, x - loc, mask.expand(-1, N, -1))
        estimate = estimate + (block.weight.to(sums.dtype) * sums / block.size.to(sums.dtype)).sum(0)
    assert_close_to_rounding(value, -estimate.sum(), torch.float64)


def conditional(S, r, t, c):
    """log N(r_t; S_tc S_cc^-1 r_c, S_tt - S_tc S_cc^-1 S_ct) by a solve on the context block."""
    if len(c) == 0:
        return torch.distributions.Normal(0.0, S[t, t].sqrt()).log_prob(r[t])
    sol = torch.linalg.solve(S[c][:, c], torch.stack([r[c], S[c, t]], -1))
    return torch.distributions.Normal(S[t, c] @ sol[:, 0], (S[t, t] - S[t, c] @ sol[:, 1]).sqrt()).log_prob(r[t])


@pytest.mark.parametrize("keep_elements", [0, 2**20])  # every chunk recomputed; every chunk kept
@pytest.mark.parametrize("max_elements", [25, 8 * 25, 2**20])  # one pair a chunk, four, all
def test_component_conditionals_and_context_densities_match_a_loop(max_elements, keep_elements):
    """``DenseContextConditionals`` (a mixture's pieces) against a loop: per component and
    pair, each target's conditional given the pair's context and the context's density
    (``MultivariateNormal`` on the pair's own block), with random weights on both outputs
    for the gradients; chunks of one pair, of several (contexts and target sets of
    different sizes padded to the chunk's largest) and of all."""
    q, n, D, K = 2, 3, 5, 2
    g = torch.Generator().manual_seed(4)
    A = torch.randn(K, D, D, generator=g, dtype=torch.float64).requires_grad_()
    loc = torch.randn(K, n, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64).requires_grad_()
    context = ~masks(q, n, D, seed=6)
    wc = torch.randn(q, K, n, D, generator=g, dtype=torch.float64)
    wr = torch.randn(q, K, n, generator=g, dtype=torch.float64)
    S = A @ A.mT + 0.4 * torch.eye(D, dtype=torch.float64)

    log_c_ref = torch.zeros(q, K, n, D, dtype=torch.float64)
    log_r_ref = torch.zeros(q, K, n, dtype=torch.float64)
    for i, k, j in itertools.product(range(q), range(K), range(n)):
        c = context[i, j].nonzero().flatten()
        r = x[j] - loc[k, j]
        if len(c):
            zero = torch.zeros(len(c), dtype=torch.float64)
            log_r_ref[i, k, j] = torch.distributions.MultivariateNormal(zero, S[k][c][:, c]).log_prob(r[c])
        for t in (~context[i, j]).nonzero().flatten().tolist():
            log_c_ref[i, k, j, t] = conditional(S[k], r, t, c)
    got_c, got_r = gdi.DenseContextConditionals.apply(S, x, loc, context, max_elements, "x", keep_elements)
    assert_close_to_rounding(got_r, log_r_ref, torch.float64)
    assert_close_to_rounding(got_c, log_c_ref, torch.float64)
    grads = torch.autograd.grad((wc * got_c).sum() + (wr * got_r).sum(), (A, loc, x), retain_graph=True)
    expected = torch.autograd.grad((wc * log_c_ref).sum() + (wr * log_r_ref).sum(), (A, loc, x))
    for a, b in zip(grads, expected):
        assert_close_to_rounding(a, b, torch.float64)


def test_gaussian_mixture_with_contexts_per_datapoint_takes_the_written_backward(monkeypatch):
    """``GaussianMixtureTable`` with a context per datapoint and covariances shared by the
    batch: its log-conditionals against the mixture's conditional computed in a loop
    (weights times context densities times each component's conditional), through
    ``DenseContextConditionals`` (spy)."""
    from pyro_mpt.conditionals.gaussian_mixture import GaussianMixtureTable

    q, n, D, K = 2, 4, 4, 3
    g = torch.Generator().manual_seed(8)
    A = torch.randn(K, D, D, generator=g, dtype=torch.float64)
    S = A @ A.mT + 0.5 * torch.eye(D, dtype=torch.float64)
    loc = torch.randn(K, 1, D, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    logw = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), 0)
    context = ~masks(q, n, D, seed=9)
    calls = []
    apply = gdi.DenseContextConditionals.apply
    monkeypatch.setattr(gdi.DenseContextConditionals, "apply", lambda *a: calls.append(1) or apply(*a))
    got = GaussianMixtureTable(logw, loc, S[:, None], x).log_conditionals(context, target=~context)
    assert calls
    for i, j in itertools.product(range(q), range(n)):
        c = context[i, j].nonzero().flatten()
        base = []
        for k in range(K):
            r = x[j] - loc[k, 0]
            dens = torch.zeros((), dtype=torch.float64) if not len(c) else torch.distributions.MultivariateNormal(
                torch.zeros(len(c), dtype=torch.float64), S[k][c][:, c]).log_prob(r[c])
            base.append(logw[k] + dens)
        base = torch.stack(base)
        for t in (~context[i, j]).nonzero().flatten().tolist():
            each = torch.stack([conditional(S[k], x[j] - loc[k, 0], t, c) for k in range(K)])
            want = (base + each).logsumexp(0) - base.logsumexp(0)
            assert abs(float(got[i, j, t] - want)) < 1e-12


def test_chunks_factor_their_largest_context_not_the_whole_covariance(monkeypatch):
    """Pairs sorted by context size: a chunk whose contexts hold at most 2 of D = 8 tokens
    factors 2 x 2 blocks (before: every pair's context embedded in a D x D matrix), and its
    sums still match the loop."""
    q, n, D = 1, 6, 8
    g = torch.Generator().manual_seed(11)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    S = A @ A.T + 0.5 * torch.eye(D, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(q, n, D, dtype=torch.bool)
    mask[0, torch.arange(n), torch.arange(n)] = False  # one context token each
    mask[0, 0, 7] = False  # two for one pair
    sizes = []
    factor = gdi.cholesky
    monkeypatch.setattr(gdi, "cholesky", lambda X, *a: sizes.append(X.shape[-1]) or factor(X, *a))
    got = gdi.DenseIndependentSums.apply(S, x, torch.zeros(1, D, dtype=torch.float64), mask, 2**20, "x")
    assert sizes == [2]
    assert_close_to_rounding(got, brute_sums(S, x, mask), torch.float64)


def test_kept_chunks_stay_within_their_budget():
    """``keep_elements`` bounds the floating-point tables that ``DenseContextConditionals``
    keeps for its backward pass (beyond them: its inputs, the context bits and the kept
    chunks' token indices); 0 keeps none of them, and a kept chunk's gradient equals the
    recomputed one's."""
    q, n, D, K = 3, 40, 6, 2
    g = torch.Generator().manual_seed(12)
    A = torch.randn(K, D, D, generator=g, dtype=torch.float64)
    S = (A @ A.mT + 0.4 * torch.eye(D, dtype=torch.float64)).requires_grad_()
    loc = torch.randn(K, 1, D, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    context = torch.rand(q, n, D, generator=g) < 0.5
    base = S.numel() + x.numel() + loc.numel() + context.numel()  # an upper bound of the inputs and bits
    grads = []
    for keep in (0, 300, 10**6):
        kept, (log_c, log_r) = saved_numel(
            lambda: gdi.DenseContextConditionals.apply(S, x, loc, context, 8 * D * D, "x", keep))
        indices = 2 * q * n * D  # the kept chunks' token indices, at most
        assert kept <= base + (keep and keep + indices), (keep, kept)
        grads.append(torch.autograd.grad(log_c.sum() + log_r.sum(), S)[0])
        if keep == 10**6:
            assert kept > base + 300  # the check can fail: everything kept
    for a in grads[1:]:
        assert_close_to_rounding(a, grads[0], torch.float64)
