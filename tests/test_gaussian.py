"""The Gaussian closed-form engine and the marginal it derives from Pyro models."""

import math
import warnings

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, GaussianConditionals, MaskedPretrainingLoss, NumericalWarning
from pyro_mpt.conditionals import NotLinearGaussianError, gaussian_marginal
from pyro_mpt.conditionals import gaussian_independent
from pyro_mpt.conditionals.gaussian_shared import lowrank_shared_data
from pyro_mpt.mask_blocks import MaskBlock
from pyro_mpt.masks import MaskSchedule
from pyro_mpt.observed_tokens import trace_tokens

from models import make_full_gaussian, make_ppca

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("D", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_exhaustive_equals_exact_ppca(D, method):
    model, x, exact = make_ppca(D, K=2, N=7, seed=D)
    loss = MaskedPretrainingLoss(masks="exhaustive", conditionals=GaussianConditionals(method=method))
    est = loss.score(model, None, x)
    assert est.shape == (7,)
    assert torch.allclose(est, exact(x), atol=1e-8, rtol=0)


@pytest.mark.parametrize("D", [2, 3, 4, 5, 6, 7])
def test_exhaustive_equals_exact_full_covariance(D):
    model, x, exact = make_full_gaussian(D, N=5, seed=D)
    est = MaskedPretrainingLoss(masks="exhaustive").score(model, None, x)
    assert torch.allclose(est, exact(x), atol=1e-8, rtol=0)


@pytest.mark.parametrize("method", ["lowrank", "dense"])
@pytest.mark.parametrize("share", [False, True])
def test_order_is_exact_with_zero_variance(method, share):
    model, x, exact = make_ppca(12, K=3, N=9)
    engine = GaussianConditionals(method=method)
    draws = torch.stack(
        [
            MaskedPretrainingLoss(masks="order", conditionals=engine, share_masks=share).score(model, None, x)
            for _ in range(20)
        ]
    )
    assert draws.std(0).max() < 1e-10
    assert torch.allclose(draws.mean(0), exact(x), atol=1e-9, rtol=0)


def test_chain_fast_path_matches_mask_queries():
    """The sequential low-rank/dense chain paths equal the generic one-mask-per-position path."""
    model, x, _ = make_ppca(8, K=2, N=4)
    tokens = trace_tokens(model, None, (x,), {})
    order = torch.rand(3, 4, 8).argsort(-1)
    for method in ["lowrank", "dense"]:
        engine = GaussianConditionals(method=method)
        state = engine.prepare(tokens, model, None, (x,), {})
        fast = engine.chain_log_prob(state, tokens.value, order)
        slow = super(GaussianConditionals, engine).chain_log_prob(state, tokens.value, order)
        assert torch.allclose(fast, slow, atol=1e-10, rtol=0)


@pytest.mark.parametrize("rows", [1, 4])
def test_shared_chain_path_matches_generic(rows):
    model, x, _ = make_ppca(8, K=3, N=4)
    tokens = trace_tokens(model, None, (x,), {})
    order = torch.rand(3, rows, 8).argsort(-1)
    engine = GaussianConditionals(max_elements=64)
    state = engine.prepare(tokens, model, None, (x,), {})
    fast = engine.chain_log_prob(state, tokens.value, order)
    slow = super(GaussianConditionals, engine).chain_log_prob(state, tokens.value, order)
    assert torch.allclose(fast, slow, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_shared_mask_sums_match_the_table_path(dtype, tol):
    """The matrix-product path for shared masks equals summing the (q, n, D) table
    computed in float64, also in float32 with small noise (where an uncentred
    expansion would cancel)."""
    model64, x64, _ = make_ppca(12, K=2, N=30, sigma=0.01)
    mask = torch.rand(7, 1, 12) < 0.5
    mask[:, :, 0] = True
    reference = GaussianConditionals(method="lowrank")
    tokens64 = trace_tokens(model64, None, (x64,), {})
    state64 = reference.prepare(tokens64, model64, None, (x64,), {})
    slow = super(GaussianConditionals, reference).mask_sums(state64, tokens64.value, mask).detach()
    pyro.clear_param_store()
    model, x, _ = make_ppca(12, K=2, N=30, sigma=0.01, dtype=dtype)  # the same parameters and data, cast
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    fast = engine.mask_sums(state, tokens.value, mask)
    assert fast.shape == (7, 30)
    err = float(((fast.double() - slow).abs() / slow.abs().max()).max())
    assert err < tol, err


@pytest.mark.parametrize("K,method", [(3, "auto"), (12, "auto"), (12, "dense"), (70, "auto")])
def test_shared_mask_sums_equal_brute_force_conditionals(K, method):
    """Masks shared by the batch, every size 1..D (several groups of sizes, the
    empty context included), on each path the engine takes for them (rank <= 8:
    products with the whole residual table; larger rank: gathered targets;
    dense): the sums equal numpy's per-mask dense conditionals to 1e-10, and
    their gradient equals that of a per-mask torch.linalg.solve loop to 1e-8."""
    D, N = 64, 300
    model, x, _ = make_ppca(D, K=K, N=N, sigma=0.5)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(D, D, generator=g).argsort(-1) < torch.arange(1, D + 1)[:, None]  # (q, D), sizes 1..D
    engine = GaussianConditionals(method=method)
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    fast = engine.mask_sums(state, tokens.value, mask[:, None])
    assert fast.shape == (D, N)
    W, mu, s = (pyro.param(n) for n in ("W", "mu", "s"))

    def brute(W, mu, s, x, lib):  # per mask, the dense conditionals of its targets (numpy or torch)
        cov = W @ W.T + s**2 * lib.eye(D)
        r = x - mu
        rows = []
        for m in mask.numpy():
            t, c = np.nonzero(m)[0], np.nonzero(~m)[0]
            mean, var = 0.0 * r[:, t], cov[t, t]
            if len(c):
                B = lib.linalg.solve(cov[c][:, c], cov[c][:, t])  # (|c|, |t|)
                mean, var = r[:, c] @ B, var - (cov[c][:, t] * B).sum(0)
            rows.append((-0.5 * (math.log(2 * math.pi) + lib.log(var) + (r[:, t] - mean) ** 2 / var)).sum(-1))
        return rows

    ref = np.stack(brute(*(t.detach().numpy() for t in (W, mu, s, x)), np))
    assert np.allclose(fast.detach().numpy(), ref, rtol=1e-10, atol=0)
    grads = torch.autograd.grad(fast.sum(), (W, mu))
    loop = torch.stack(brute(W, mu, s, x, torch)).sum()
    for a, b in zip(grads, torch.autograd.grad(loop, (W, mu))):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-8 * float(b.abs().max()))


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("K,chunk", [(1, None), (2, None), (3, None), (2, 20), (3, 20)])
def test_independent_mask_sums_equal_brute_force_conditionals(K, chunk, keep, monkeypatch):
    """Masks drawn per datapoint (sums over each mask's targets, or its context where
    that is smaller, in cache-sized chunks with a written backward; closed-form 2 x 2
    inverses at K <= 2, factorizations above; each row's small pieces recomputed in
    the backward pass or kept from the forward pass): the sums equal numpy's dense
    conditionals per (mask, datapoint) to 1e-10, and their gradient in W, mu and s
    that of a torch.linalg.solve loop to 1e-8."""
    if chunk is not None:  # chunks of 2 rows: several per mask
        monkeypatch.setattr(gaussian_independent, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(gaussian_independent, "KEPT_PIECES_BITS_RATIO", 10**6 if keep else 0)
    D, N, q = 10, 6, 5
    model, x, _ = make_ppca(D, K=K, N=N, sigma=0.5)
    g = torch.Generator().manual_seed(2)
    sizes = torch.tensor([1, 3, 5, 9, 10])[:, None, None]
    mask = torch.rand(q, N, D, generator=g).argsort(-1) < sizes  # (q, N, D), the last with no context
    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    fast = engine.mask_sums(state, tokens.value, mask)
    assert fast.shape == (q, N)
    W, mu, s = (pyro.param(n) for n in ("W", "mu", "s"))

    def brute(W, mu, s, x, lib):
        cov = W @ W.T + s**2 * lib.eye(D)
        r = x - mu
        out = []
        for k in range(q):
            for i in range(N):
                m = mask[k, i].numpy()
                t, c = np.nonzero(m)[0], np.nonzero(~m)[0]
                mean, var = 0.0 * r[i, t], cov[t, t]
                if len(c):
                    B = lib.linalg.solve(cov[c][:, c], cov[c][:, t])
                    mean, var = r[i, c] @ B, var - (cov[c][:, t] * B).sum(0)
                out.append((-0.5 * (math.log(2 * math.pi) + lib.log(var) + (r[i, t] - mean) ** 2 / var)).sum())
        return out

    ref = np.array(brute(*(t.detach().numpy() for t in (W, mu, s, x)), np)).reshape(q, N)
    assert np.allclose(fast.detach().numpy(), ref, rtol=1e-10, atol=0)
    params = (W, mu, pyro.param("s").unconstrained())
    grads = torch.autograd.grad(fast.sum(), params)
    loop = torch.stack(brute(W, mu, s, x, torch)).sum()
    for a, b in zip(grads, torch.autograd.grad(loop, params)):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-8 * float(b.abs().max()))


def test_independent_masks_float32_one_column_with_one_high_signal_token():
    """Factor analysis with one column and one token of high signal (loading 3000 x the
    others', noise sd 1) in float32, masks per datapoint: the state stays float32 (one
    column: eps^2 kappa), and a mask whose targets hold that token but are fewer than its
    context formed Lambda as lam0 - S(targets), a difference of terms of size 9e6: a
    mask's sum was 1.1 nats off and the W gradient 18%. Against numpy's dense
    conditionals of the float32-rounded model in float64 (measured after: 4e-6 nats,
    gradient 6e-7 relative to a float64 torch loop's)."""
    D, K, N, q = 10, 1, 40, 6
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    W0[0] *= 3000
    x = (torch.randn(N, K, generator=g, dtype=torch.float64) @ W0.T + torch.randn(N, D, generator=g, dtype=torch.float64)).float()

    def model(x):
        W = pyro.param("W", W0.float())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float32), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 1.0).to_event(1), obs=x)

    sizes = torch.tensor([1, 2, 3, 4, 6, 9])[:, None, None]
    mask = torch.rand(q, N, D, generator=g).argsort(-1) < sizes
    mask[:, :, 0] = True  # the high-signal token among the targets
    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    assert state.loc.dtype == torch.float32
    # the kernel itself: the engine now sends this state (2 eps kappa > 1e-3) to the per-mask path
    fast = gaussian_independent.lowrank_independent_sums(state, tokens.value, mask, lowrank_shared_data(state, tokens.value))
    W = pyro.param("W")

    def brute(W, x, lib):
        cov = W @ W.T + lib.eye(D)
        out = []
        for k in range(q):
            for i in range(N):
                m = mask[k, i].numpy()
                t, c = np.nonzero(m)[0], np.nonzero(~m)[0]
                B = lib.linalg.solve(cov[c][:, c], cov[c][:, t])
                mean, var = x[i, c] @ B, cov[t, t] - (cov[c][:, t] * B).sum(0)
                out.append((-0.5 * (math.log(2 * math.pi) + lib.log(var) + (x[i, t] - mean) ** 2 / var)).sum())
        return out

    ref = np.array(brute(W.detach().double().numpy(), x.double().numpy(), np)).reshape(q, N)
    assert np.abs(fast.detach().double().numpy() - ref).max() <= 1e-4
    (got,) = torch.autograd.grad(fast.sum(), W)
    W64 = W.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(torch.stack(brute(W64, x.double(), torch)).sum(), W64)
    assert float((got.double() - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_independent_masks_float64_tiny_noise_gradient_of_the_noise():
    """Factor analysis in float64 with noise variance ~1e-8 (sd 1e-4) against a unit
    loading, D = 12, K = 11, masks per datapoint: the sums over masks drawn per datapoint
    (gaussian_independent) keep their values but their noise gradient lost digits (here
    2.9e-3 relative off a float64 torch.linalg.solve loop's; 14% at variance 1e-10,
    K = 5), so such states take the per-mask conditionals (2 eps kappa > 1e-8): measured
    5.5e-6 after."""
    D, K, N, q = 12, 11, 40, 4
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g)
    psi0 = 1e-8 * (0.5 + torch.rand(D, generator=g))
    x = torch.randn(N, K, generator=g) @ W0.T + psi0.sqrt() * torch.randn(N, D, generator=g)

    def model(x):
        psi = pyro.param("psi", psi0.clone(), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W0.T, psi.sqrt()).to_event(1), obs=x)

    mask = torch.rand(q, N, D, generator=g).argsort(-1) < torch.tensor([1, 3, 6, 9])[:, None, None]
    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    assert state.is_low_rank and not engine.recomputes_mask_sums(state, tokens.value, mask)
    leaf = pyro.param("psi").unconstrained()
    (got,) = torch.autograd.grad(engine.mask_sums(state, tokens.value, mask).sum(), leaf)
    cov = W0 @ W0.T + torch.diag(pyro.param("psi"))
    loop = 0.0
    for k in range(q):
        for i in range(N):
            t, c = mask[k, i].nonzero()[:, 0], (~mask[k, i]).nonzero()[:, 0]
            B = torch.linalg.solve(cov[c][:, c], cov[c][:, t])
            mean, var = x[i, c] @ B, torch.diagonal(cov)[t] - (cov[c][:, t] * B).sum(0)
            loop = loop + (-0.5 * (math.log(2 * math.pi) + var.log() + (x[i, t] - mean) ** 2 / var)).sum()
    (want,) = torch.autograd.grad(loop, leaf)
    assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max())


def test_dense_path_gradients_are_finite_for_random_masks():
    model, x, exact = make_ppca(5, K=6, N=8)  # K >= D: the dense path
    for masks in ["all", "uniform", 0.4]:
        loss = MaskedPretrainingLoss(masks=masks, num_masks=3)
        value = loss.differentiable_loss(model, None, x)
        grads = torch.autograd.grad(value, [pyro.param(n).unconstrained() for n in ["W", "mu", "s"]])
        assert all(torch.isfinite(g).all() for g in grads), masks


def test_lowrank_and_dense_conditionals_agree():
    model, x, _ = make_ppca(9, K=2, N=6)
    tokens = trace_tokens(model, None, (x,), {})
    mask = torch.rand(5, 6, 9) < 0.4
    mask[..., 0] = True
    out = []
    for method in ["lowrank", "dense"]:
        engine = GaussianConditionals(method=method)
        state = engine.prepare(tokens, model, None, (x,), {})
        out.append(torch.where(mask, engine.mask_log_prob(state, tokens.value, mask), 0.0))
    assert torch.allclose(out[0], out[1], atol=1e-10, rtol=0)


def test_conditional_matches_textbook_formula():
    """One query against S_MR S_RR^-1 computed by hand (paper Eq. 7)."""
    model, x, _ = make_ppca(6, K=2, N=1)
    W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
    S = W @ W.T + s**2 * torch.eye(6)
    R, j = [0, 2, 5], 3
    SRR_inv = torch.linalg.inv(S[R][:, R])
    m = mu[j] + S[j, R] @ SRR_inv @ (x[0, R] - mu[R])
    v = S[j, j] - S[j, R] @ SRR_inv @ S[R, j]
    expected = torch.distributions.Normal(m, v.sqrt()).log_prob(x[0, j])
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = torch.ones(1, 1, 6, dtype=torch.bool)
    mask[..., R] = False
    got = engine.mask_log_prob(state, tokens.value, mask)[0, 0, j]
    assert abs(float(got - expected)) < 1e-12


@pytest.mark.parametrize("masks", ["exhaustive", "order"])
def test_gradient_equals_exact_lml_gradient(masks):
    model, x, exact = make_ppca(5, K=2, N=8)
    loss = MaskedPretrainingLoss(masks=masks)
    params = [pyro.param(n).unconstrained() for n in ["W", "mu", "s"]]
    g_mpt = torch.autograd.grad(loss.differentiable_loss(model, None, x), params)
    g_exact = torch.autograd.grad(-Evidence(model)(x).sum(), params)
    for a, b in zip(g_mpt, g_exact):
        assert torch.allclose(a, b, atol=1e-8, rtol=0)


def test_chunked_equals_unchunked():
    model, x, _ = make_ppca(10, K=2, N=13)
    small = GaussianConditionals(max_elements=50)
    for masks in ["all", "order", "uniform"]:
        pyro.set_rng_seed(3)
        a = MaskedPretrainingLoss(masks=masks, num_masks=3).score(model, None, x)
        pyro.set_rng_seed(3)
        b = MaskedPretrainingLoss(masks=masks, num_masks=3, conditionals=small, chunk_size=37).score(
            model, None, x
        )
        assert torch.allclose(a, b, atol=1e-10, rtol=0), masks


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_exact_log_density_reuses_the_factor_of_prepare(method, monkeypatch):
    """prepare factors the whole covariance once (to rescue it early); the exact
    log-density behind masks="order" and Evidence reuses that factor."""
    D, K = 4, 2
    model, x, exact = make_ppca(D, K, N=6)
    truth = exact(x)
    shapes = []
    cholesky_ex = torch.linalg.cholesky_ex

    def spy(A, **kw):
        shapes.append(tuple(A.shape))
        return cholesky_ex(A, **kw)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", spy)
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order", num_masks=3)
    value = loss.differentiable_loss(model, None, x)
    assert shapes == [(1, K, K) if method == "lowrank" else (1, D, D)]
    assert abs(float(value) + float(truth.sum())) < 1e-10
    shapes.clear()
    assert float((Evidence(model, method="exact")(x) - truth).abs().max()) < 1e-10
    assert len(shapes) == 1


# ---------------------------------------------------------------- marginals of various models


def _marginal(model, *args):
    tokens = trace_tokens(model, None, args, {})
    return gaussian_marginal(tokens, model, args, {}), tokens


def test_factor_analysis_with_per_token_noise():
    D, K, N = 6, 2, 5
    W = torch.randn(D, K)
    psi = torch.rand(D) + 0.2
    x = torch.randn(N, D)

    def fa(x):
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, psi.sqrt()).to_event(1), obs=x)

    m, _ = _marginal(fa, x)
    assert m.loc.shape == (1, D) and m.cov_factor.shape == (1, D, K)
    exact = torch.distributions.LowRankMultivariateNormal(torch.zeros(D), W, psi).log_prob(x)
    assert torch.allclose(Evidence(fa)(x), exact, atol=1e-12)
    est = MaskedPretrainingLoss(masks="exhaustive").score(fa, None, x)
    assert torch.allclose(est, exact, atol=1e-8)


def test_model_with_covariates_has_per_datapoint_marginal():
    D, K, N, C = 4, 2, 6, 3
    c = torch.randn(N, C)
    B = torch.randn(C, D)
    W = torch.randn(D, K)

    def reg(x, c):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            # the loading depends on the covariate: W_i = W * (1 + c_i0)
            loc = c @ B + (1 + c[:, :1]) * (z @ W.T)
            pyro.sample("x", dist.Normal(loc, 0.3).to_event(1), obs=x)

    x = torch.randn(N, D)
    m, _ = _marginal(reg, x, c)
    assert m.loc.shape == (N, D) and m.cov_factor.shape == (N, D, K)
    Wi = (1 + c[:, :1, None]) * W
    exact = torch.distributions.LowRankMultivariateNormal(c @ B, Wi, torch.full((D,), 0.09)).log_prob(x)
    assert torch.allclose(Evidence(reg)(x, c), exact, atol=1e-12)
    est = MaskedPretrainingLoss(masks="exhaustive").score(reg, None, x, c)
    assert torch.allclose(est, exact, atol=1e-8)


def _brute_mpt(S, loc, x, masks, weights):
    """Per-datapoint sum_q w_q / M_q sum_{j in mask q} log p(x_ij | x_i,rest): numpy, one mask at a time."""
    out = np.zeros(x.shape[0])
    r = x - loc
    for m, w in zip(masks, weights):
        t, c = np.flatnonzero(m), np.flatnonzero(~m)
        mean, var = np.zeros((x.shape[0], len(t))), np.diag(S)[t].copy()
        if len(c):
            B = np.linalg.solve(S[np.ix_(c, c)], S[np.ix_(c, t)])
            mean, var = r[:, c] @ B, var - np.einsum("ct,ct->t", S[np.ix_(c, t)], B)
        out += w * (-0.5 * (np.log(2 * np.pi * var) + (r[:, t] - mean) ** 2 / var)).sum(1) / len(t)
    return out


@pytest.mark.parametrize("noise", ["diag", "mvn"])
def test_covariates_in_the_location_leave_the_covariance_shared(noise):
    # x_i = c_i B + W z_i + noise: the location varies by datapoint, the
    # covariance does not. The marginal keeps it at one row, so each mask's
    # factor is computed once for the batch (kept per datapoint it cost 100x at
    # n=1000, D=200), and the shared-mask scores match numpy's conditionals.
    D, K, N, C, P = 7, 2, 30, 3, 12
    g = torch.Generator().manual_seed(11)
    W = torch.randn(D, K, generator=g)
    B = torch.randn(C, D, generator=g)
    c = torch.randn(N, C, generator=g)
    A = torch.randn(D, D, generator=g)
    noise_cov = A @ A.T / D + 0.3 * torch.eye(D) if noise == "mvn" else torch.diag(torch.rand(D, generator=g) + 0.2)
    x = torch.randn(N, K, generator=g) @ W.T + c @ B + torch.randn(N, D, generator=g) @ torch.linalg.cholesky(noise_cov).T

    def reg(x, c):
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            loc = c @ B + z @ W.T
            if noise == "mvn":
                pyro.sample("x", dist.MultivariateNormal(loc, noise_cov), obs=x)
            else:
                pyro.sample("x", dist.Normal(loc, noise_cov.diagonal().sqrt()).to_event(1), obs=x)

    m, _ = _marginal(reg, x, c)
    assert m.loc.shape == (N, D)
    shared = m.cov_factor if m.is_low_rank else m.covariance
    assert shared.shape[0] == 1, shared.shape
    S = (W @ W.T + noise_cov).numpy()
    assert np.allclose(m.dense()[0].numpy(), S, atol=1e-12)

    masks = torch.rand(P, D, generator=g).argsort(-1) < torch.randint(1, D + 1, (P, 1), generator=g)
    weights = torch.rand(P, generator=g) + 0.5
    ref = _brute_mpt(S, (c @ B).numpy(), x.numpy(), masks.numpy(), weights.numpy())

    class Given(MaskSchedule):
        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            yield MaskBlock(masks[:, None], masks.sum(-1, keepdim=True), weights[:, None])

    got = MaskedPretrainingLoss(masks=Given(share_masks=True)).score(reg, None, x, c)
    assert np.allclose(got.numpy(), ref, atol=1e-9, rtol=0)


def test_noise_written_out_per_datapoint_is_shared_by_the_batch():
    # s * torch.ones_like(x) holds one value per datapoint and token, all rows
    # equal: the marginal keeps it at one row (as for an expanded scale), and
    # the scores are those of the model written with the scalar scale
    model, x, exact = make_ppca(6, K=2, N=9, seed=3)

    def written_out(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(x.shape[0], 2), torch.ones(x.shape[0], 2)).to_event(1))
            W = pyro.param("W")
            pyro.sample("x", dist.Normal(z @ W.T + pyro.param("mu"), pyro.param("s") * torch.ones_like(x)).to_event(1), obs=x)

    model(x)  # the params
    m, _ = _marginal(written_out, x)
    assert m.cov_factor.shape[0] == 1 and m.cov_diag.shape[0] == 1
    loss = MaskedPretrainingLoss(masks="order")
    assert torch.allclose(loss.score(written_out, None, x), exact(x), atol=1e-9, rtol=0)


def test_hierarchical_linear_gaussian_latents():
    D, N = 5, 4
    A = torch.randn(3, 2)
    W = torch.randn(D, 3)

    def hier(x):
        with pyro.plate("data", N):
            z1 = pyro.sample("z1", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            z2 = pyro.sample("z2", dist.Normal(z1 @ A.T, 0.5).to_event(1))
            pyro.sample("x", dist.Normal(z2 @ W.T, 0.4).to_event(1), obs=x)

    x = torch.randn(N, D)
    cov_z2 = A @ A.T + 0.25 * torch.eye(3)
    S = W @ cov_z2 @ W.T + 0.16 * torch.eye(D)
    exact = torch.distributions.MultivariateNormal(torch.zeros(D), S).log_prob(x)
    assert torch.allclose(Evidence(hier)(x), exact, atol=1e-12)
    assert torch.allclose(MaskedPretrainingLoss(masks="order").score(hier, None, x), exact, atol=1e-9)


def test_multivariate_normal_latent_and_mvn_observation_noise():
    D, K, N = 4, 2, 3
    Lz = torch.tensor([[1.0, 0.0], [0.5, 0.8]])
    W = torch.randn(D, K)
    A = torch.randn(D, D)
    Sn = A @ A.T / D + 0.3 * torch.eye(D)

    def model(x):
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.MultivariateNormal(torch.zeros(K), scale_tril=Lz))
            pyro.sample("x", dist.MultivariateNormal(z @ W.T, Sn), obs=x)

    x = torch.randn(N, D)
    S = W @ Lz @ Lz.T @ W.T + Sn
    exact = torch.distributions.MultivariateNormal(torch.zeros(D), S).log_prob(x)
    assert torch.allclose(Evidence(model)(x), exact, atol=1e-12)
    assert torch.allclose(MaskedPretrainingLoss(masks="exhaustive").score(model, None, x), exact, atol=1e-8)


@pytest.mark.parametrize("kind", ["lowrank", "diag", "mvn"])
def test_latent_free_gaussian_observations(kind):
    D, N = 5, 4
    F = torch.randn(D, 2)
    d = torch.rand(D) + 0.5
    mu = torch.randn(D)
    x = torch.randn(N, D)
    fns = {
        "lowrank": lambda: dist.LowRankMultivariateNormal(mu, F, d),
        "diag": lambda: dist.Normal(mu, d.sqrt()).to_event(1),
        "mvn": lambda: dist.MultivariateNormal(mu, F @ F.T + torch.diag(d)),
    }

    def model(x):
        with pyro.plate("data", N):
            pyro.sample("x", fns[kind](), obs=x)

    exact = fns[kind]().log_prob(x)
    assert torch.allclose(Evidence(model)(x), exact, atol=1e-12)
    assert torch.allclose(MaskedPretrainingLoss(masks="exhaustive").score(model, None, x), exact, atol=1e-8)


def test_image_event_shape_tokens_are_flattened():
    C, H, Wd, K, N = 1, 2, 3, 2, 4
    D = C * H * Wd
    W = torch.randn(D, K)

    def model(x):
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            loc = (z @ W.T).reshape(-1, C, H, Wd) if z.dim() == 2 else (z @ W.T).reshape(z.shape[:-1] + (C, H, Wd))
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(3), obs=x)

    x = torch.randn(N, C, H, Wd)
    exact = torch.distributions.LowRankMultivariateNormal(torch.zeros(D), W, torch.full((D,), 0.25)).log_prob(
        x.reshape(N, D)
    )
    assert torch.allclose(Evidence(model)(x), exact, atol=1e-12)
    assert torch.allclose(MaskedPretrainingLoss(masks="order").score(model, None, x), exact, atol=1e-9)


def test_non_vectorizable_model_with_vectorize_false():
    """A model that uses torch.mm cannot broadcast over the basis plate; vectorize=False works."""
    D, K, N = 4, 2, 3
    W = torch.randn(D, K)

    def model(x):
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            loc = torch.mm(z.reshape(N, K), W.T)
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    x = torch.randn(N, D)
    exact = torch.distributions.LowRankMultivariateNormal(torch.zeros(D), W, torch.full((D,), 0.25)).log_prob(x)
    got = Evidence(model, vectorize=False)(x)
    assert torch.allclose(got, exact, atol=1e-12)
    loss = MaskedPretrainingLoss(masks="order", conditionals=GaussianConditionals(vectorize=False))
    assert torch.allclose(loss.score(model, None, x), exact, atol=1e-9)


def _non_broadcasting_ppca(fail=False, N=6, D=4, K=2, sigma=0.5):
    """PPCA whose model reshapes its latent to (n, K), so it cannot run in an extra
    plate on the left; counts its runs. With ``fail`` it also raises at z = 0 (the
    first noise point of every run mode), a genuine model error."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    runs = []

    def model(x):
        runs.append(1)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            if fail and bool((z == 0).all(-1).any()):
                raise RuntimeError("boom: the model fails at z = 0")
            loc = z.reshape(x.shape[0], K) @ W.T
            pyro.sample("x", dist.Normal(loc, sigma).to_event(1), obs=x)

    def exact(x):
        S = W @ W.T + sigma**2 * torch.eye(D, dtype=torch.float64)
        return torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), S).log_prob(x)

    return model, x, runs, exact


def test_gaussian_marginal_remembers_the_run_mode_that_worked():
    """Step 1 runs the model once to trace it, once in each failing vectorized mode
    and K + 4 times per point (0, e_k and three probes); later steps go straight to
    the per-point runs, at three per-datapoint points (the loading is shared). The first
    step runs it once more where the data put the posterior (the posterior points; once
    per model and data)."""
    K = 2
    model, x, runs, exact = _non_broadcasting_ppca(K=K)
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    counts, values = [], []
    for _ in range(3):
        runs.clear()
        values.append(loss.loss(model, None, x))
        counts.append(len(runs))
    assert counts == [1 + 2 + (K + 4) + 1, 1 + 3, 1 + 3]
    # step 1 (K + 4 points) and later steps (three) round differently
    assert max(abs(v - values[0]) for v in values) < 1e-10
    assert abs(values[0] + float(exact(x).sum())) < 1e-10


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("extra", [2, 3, 4, 5])
def test_a_latent_reshaped_to_the_batch_is_right_when_the_batch_has_as_many_datapoints_as_noise_points(K, extra):
    # z.reshape(n, K) in the compact run (latent (P, 1, K), P noise points)
    # succeeds when n = P and turns the points into datapoints: the marginal
    # read a zero loading, 16.6 nats off at n = 4, K = 2 (P was K + 2), 63 at
    # n = 5, K = 3. Every n around the point count, against torch's LowRankMultivariateNormal
    model, x, runs, exact = _non_broadcasting_ppca(N=K + extra, K=K)
    assert torch.allclose(Evidence(model, method="exact")(x), exact(x), atol=1e-10, rtol=0)
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    for _ in range(2):  # the first call and the remembered run mode
        assert abs(loss.loss(model, None, x) + float(exact(x).sum())) < 1e-9


def test_gaussian_marginal_raises_a_genuine_model_error_with_the_first_failure_chained():
    model, x, runs, _ = _non_broadcasting_ppca(fail=True)
    with pytest.raises(RuntimeError, match="boom") as info:
        Evidence(model, method="exact")(x)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    # Pyro's trace re-raises a model error with the trace shapes: the last run's
    # failure, and chained to it the first (vectorized) run's, each so wrapped
    runs_failed = [e for e in chain if "boom" in str(e) and "Trace Shapes" in str(e)]
    assert len(runs_failed) == 2, chain


# ---------------------------------------------------------------- refusals


def test_nonlinear_model_is_refused_naming_the_site():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("obs", dist.Normal(torch.tanh(z).sum(-1, keepdim=True).expand(-1, 3) if z.dim() == 2 else torch.tanh(z).sum(-1, keepdim=True).expand(z.shape[:-1] + (3,)), 0.5).to_event(1), obs=x)

    x = torch.randn(4, 3)
    with pytest.raises(NotLinearGaussianError, match="'obs' is not affine"):
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, x)


@pytest.mark.parametrize("kink", [1.0, -1.0, 2.5])
def test_piecewise_linear_location_is_refused_not_served_as_its_linear_piece(kink):
    # relu(z + 1): the old probes (0, e_k and one normal point, whose
    # coordinates are all negative above -1) lay on one linear piece, and the
    # engine returned the density of that piece, the model without the relu
    # (relu(z - 1): without the latent), up to 0.34 nats off the true
    # log p(x_i) (scipy quad below). The probes now put every noise coordinate
    # at +-3 prior standard deviations.
    from scipy import integrate
    from scipy.stats import norm

    g = torch.Generator().manual_seed(9)
    N, D, sig = 5, 4, 0.3
    w, b = torch.randn(D, generator=g), torch.randn(D, generator=g)
    z0 = torch.randn(N, generator=g)
    x = torch.relu(z0 + kink)[:, None] * w + b + sig * torch.randn(N, D, generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(torch.relu(z + kink).unsqueeze(-1) * w + b, sig).to_event(1), obs=x)

    with pytest.raises(NotLinearGaussianError, match="'x' is not affine"):
        MaskedPretrainingLoss(masks="order", conditionals="gaussian").score(model, None, x)
    with pytest.raises(NotLinearGaussianError, match="'x' is not affine"):
        Evidence(model, method="exact")(x)

    if kink == 2.5:
        return  # no datapoint of this draw near the kink: the linear piece is right for it
    # what the old probes returned, the density of the piece they sat on, is off the true value
    def true_lml(xi):
        f = lambda z: norm.pdf(z) * np.prod(norm.pdf(xi, max(z + kink, 0.0) * w.numpy() + b.numpy(), sig))
        parts = [(-14.0, -kink), (-kink, 14.0)]
        return np.log(sum(integrate.quad(f, lo, hi, epsabs=0, epsrel=1e-12, limit=200)[0] for lo, hi in parts))

    ref = np.array([true_lml(xi) for xi in x.numpy()])
    cov = np.outer(w.numpy(), w.numpy()) + sig**2 * np.eye(D)
    piece = (b + kink * w).numpy() if kink > 0 else b.numpy()  # relu(z + 1) = z + 1; relu(z - 1) = 0
    cov = cov if kink > 0 else sig**2 * np.eye(D)
    lin = np.array([_mvn_logpdf(xi, piece, cov) for xi in x.numpy()])
    assert np.abs(lin - ref).max() > 0.1


def test_affinity_probes_reach_three_prior_sds_with_both_signs():
    from pyro_mpt.conditionals.plate_runs import PROBE_REACH, affinity_probes, alternating_signs

    probes = affinity_probes(5, torch.Generator().manual_seed(1), torch.float64, "cpu")
    assert probes.shape == (3, 5) and PROBE_REACH == 3.0
    assert bool(((probes[1].abs() >= 2.5) & (probes[1].abs() <= 3.5)).all())
    assert torch.equal(probes[2], -probes[1])
    rows = alternating_signs(5, 4, torch.Generator().manual_seed(2), torch.float64, "cpu")
    assert bool(((rows.abs() >= 2.5) & (rows.abs() <= 3.5)).all())
    assert torch.equal(rows[1], -rows[0]) and torch.equal(rows[3], -rows[2])
    assert len(set(rows.abs().reshape(-1).tolist())) > 4  # sizes drawn, not all r


def test_kept_probes_and_their_generator_equal_a_fresh_draw():
    # fixed_probes keeps the draw: the probes and the generator's next draws (the
    # per-datapoint probes of the "rows" runs) equal those of a freshly seeded generator
    from pyro_mpt.conditionals.plate_runs import PROBE_SEED, affinity_probes, alternating_signs, fixed_probes

    for _ in range(2):
        probes, gen = fixed_probes(4, torch.float32, "cpu")
        fresh = torch.Generator().manual_seed(PROBE_SEED)
        assert torch.equal(probes, affinity_probes(4, fresh, torch.float32, "cpu"))
        assert torch.equal(alternating_signs(6, 4, gen, torch.float32, "cpu"), alternating_signs(6, 4, fresh, torch.float32, "cpu"))


def test_signal_to_noise_follows_in_place_changes_and_new_tensors():
    # remembered for the last (F, psi) by identity and version: an in-place change of
    # either, or another tensor, is computed afresh (numpy reference)
    from pyro_mpt.conditionals.gaussian_linalg import signal_to_noise

    g = torch.Generator().manual_seed(3)
    F, psi = torch.randn(6, 2, generator=g, dtype=torch.float64), 0.5 + torch.rand(6, generator=g, dtype=torch.float64)
    ref = lambda: float(((F.numpy() ** 2).sum(-1) / psi.numpy()).sum())  # noqa: E731
    assert signal_to_noise(F, psi) == pytest.approx(ref(), rel=1e-14)
    psi.mul_(2)
    assert signal_to_noise(F, psi) == pytest.approx(ref(), rel=1e-14)
    F[0, 0] += 10.0
    assert signal_to_noise(F, psi) == pytest.approx(ref(), rel=1e-14)
    F = F.clone() * 3
    assert signal_to_noise(F, psi) == pytest.approx(ref(), rel=1e-14)


@pytest.mark.parametrize("n, j", [(9, 8), (12, 9)])
def test_a_loading_that_varies_by_datapoint_along_a_latent_difference_is_not_taken_for_shared(n, j):
    # loc = c_i (z1 - z2) w: with probes of equal sizes (+-3 exactly), a row
    # whose signs are (1, 1) sees no loading at all and cannot tell c_i from
    # c_0; the first call finds a shared loading (c = 1) and remembers the
    # per-datapoint run, the second has c_j = 2 and was 0.67 nats off torch's
    # density (n = 9, j = 8). The sizes are drawn, so every datapoint's loading is checked
    D = 3
    g = torch.Generator().manual_seed(11)
    w, B, x = torch.randn(D, generator=g), torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    c = torch.ones(n)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(c[:, None] * (z[..., :1] - z[..., 1:]) * w + B, 0.5).to_event(1), obs=x)

    evidence = Evidence(model, method="exact")
    evidence(x)
    c[j] = 2.0
    F = torch.stack([w, -w], -1) * c[:, None, None]  # (n, D, 2)
    ref = torch.distributions.LowRankMultivariateNormal(B, F, torch.full((D,), 0.25)).log_prob(x)
    assert torch.allclose(evidence(x), ref, atol=1e-10, rtol=0)


def test_piecewise_linear_location_is_refused_in_the_per_datapoint_run():
    # a location that varies by datapoint sends later calls to the run at three
    # per-datapoint points; with normal probes there, relu(z + 2) in a batch of
    # four passed the check (12 coordinates, all above -2) and was served as linear
    N, D, K, sig = 4, 5, 3, 0.4
    g = torch.Generator().manual_seed(10)
    W, B = torch.randn(D, K, generator=g), torch.randn(N, D, generator=g)
    # data from the model, so that the posterior too stays where relu(z + 10) is linear
    # (data far from it put the posterior past the kink, which the posterior points refuse)
    x = (torch.randn(N, K, generator=g) + 10.0) @ W.T + B + sig * torch.randn(N, D, generator=g)
    shift = {"c": 10.0}

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(torch.relu(z + shift["c"]) @ W.T + B, sig).to_event(1), obs=x)

    evidence = Evidence(model, method="exact")
    evidence(x)  # linear within +-3 prior sds: served, and the per-datapoint run remembered
    got = evidence(x)
    cov = (W @ W.T).numpy() + sig**2 * np.eye(D)
    ref = [_mvn_logpdf(xi, mi, cov) for xi, mi in zip(x.numpy(), (B + 10.0 * W.sum(1)).numpy())]
    assert np.allclose(got.numpy(), ref, atol=1e-8, rtol=0)
    shift["c"] = 2.0
    with pytest.raises(NotLinearGaussianError, match="'x' is not affine"):
        evidence(x)


def test_a_clamp_beyond_the_prior_probes_is_refused_where_the_data_put_the_posterior():
    """z ~ N(0, 1), x_j ~ N(clamp(z, -3.5, 3.5), 0.3): affine at every probe within 3 prior
    sds, but a datapoint at 6 puts its posterior past the clamp. Before, Evidence(method=
    "exact") returned the model without the clamp there (-18.27 for a true -180.5, stderr 0);
    now the posterior points refuse it and "auto" integrates numerically (scipy's quad as
    the reference). Data whose posteriors stay inside keep the closed form."""
    from scipy import integrate
    from scipy.stats import norm

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z.clamp(-3.5, 3.5).unsqueeze(-1).expand(z.shape + (5,))
            pyro.sample("x", dist.Normal(loc, 0.3).to_event(1), obs=x)

    x = torch.tensor([[0.5] * 5, [3.0] * 5, [6.0] * 5], dtype=torch.float64)

    def truth(row):
        f = lambda z: np.exp(norm.logpdf(z) + norm.logpdf(row, np.clip(z, -3.5, 3.5), 0.3).sum() + 150.0)
        return np.log(integrate.quad(f, -12, 12, points=[-3.5, 3.5], limit=200, epsabs=0, epsrel=1e-12)[0]) - 150.0

    ref = np.array([truth(r) for r in x.numpy()])
    with pytest.raises(NotLinearGaussianError, match="not where the data put the posterior"):
        Evidence(model, method="exact")(x)
    inside = Evidence(model, method="exact")(x[:2]).numpy()
    cov = 0.3**2 * np.eye(5) + np.ones((5, 5))
    assert np.allclose(inside, [_mvn_logpdf(r, np.zeros(5), cov) for r in x[:2].numpy()], atol=1e-10, rtol=0)
    # the clamp 4.2 posterior sds past the mean at 3: its effect is 1.2e-4 nats, which the
    # posterior points (the mean and 3 sds) do not reach
    assert np.abs(inside - ref[:2]).max() < 1e-3
    from pyro_mpt.conditionals import QuadratureConditionals, auto_engine

    # "auto" goes on to quadrature, whose default grid says it cannot resolve the far datapoint
    with pytest.raises(ValueError, match="QuadratureConditionals: .* too coarse for site 'x'"):
        MaskedPretrainingLoss(masks="order").score(model, None, x)
    assert isinstance(auto_engine(trace_tokens(model, None, (x[:2],), {}), model, None, (x[:2],), {})[0],
                      GaussianConditionals)
    loss = MaskedPretrainingLoss(masks="order", conditionals=QuadratureConditionals(num_nodes=256))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the grid's accuracy warning at the kink
        score = loss.score(model, None, x).numpy()
    assert np.abs(score - ref).max() < 0.1  # 0.05 at the far datapoint: the kink slows the grid down

    # checked again for other data -- a permutation of the same values too, which a
    # fingerprint of sums alone took for the same data -- and for moved parameters
    def one_token(x):
        w = pyro.param("w_one_token", torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.clamp(-4.0, 4.0).unsqueeze(-1) * w, 0.1).to_event(1), obs=x)

    inside = torch.tensor([[0.0, 10.0, 0.0]], dtype=torch.float64)  # the posterior stays at 0
    evidence = Evidence(one_token, method="exact")
    evidence(inside)
    with pytest.raises(NotLinearGaussianError, match="not where the data put the posterior"):
        evidence(torch.tensor([[10.0, 0.0, 0.0]], dtype=torch.float64))
    evidence(inside)
    with torch.no_grad():
        pyro.param("w_one_token").copy_(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    with pytest.raises(NotLinearGaussianError, match="not where the data put the posterior"):
        evidence(inside)


def _mvn_logpdf(x, mean, cov):
    from scipy.stats import multivariate_normal

    return multivariate_normal(mean, cov).logpdf(x)


def test_latent_dependent_noise_is_refused():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(torch.zeros(3), z.exp()).to_event(1), obs=x)

    with pytest.raises(NotLinearGaussianError, match="noise of observed site 'x' depends on the latents"):
        Evidence(model)(torch.randn(4, 3))


def test_non_gaussian_latent_is_refused():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Gamma(2.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ torch.ones(2, 3), 1.0).to_event(1), obs=x)

    with pytest.raises(NotLinearGaussianError, match="latent site 'z' is Gamma"):
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, torch.randn(4, 3))


def test_non_gaussian_observation_is_refused():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ torch.ones(2, 3)).to_event(1), obs=x)

    with pytest.raises(NotLinearGaussianError, match="'x' is Bernoulli"):
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, torch.ones(4, 3))


def test_global_latent_is_refused():
    def model(x):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=x)

    with pytest.raises(NotLinearGaussianError, match="'mu' is outside the plate"):
        Evidence(model)(torch.randn(4, 3))


def test_not_positive_definite_covariance_is_rescued_or_says_what_to_try():
    D = 4

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.LowRankMultivariateNormal(torch.zeros(D), torch.ones(D, 1), torch.full((D,), 1e-30)), obs=x)

    x = torch.randn(3, D)
    loss = MaskedPretrainingLoss(masks="exhaustive", conditionals=GaussianConditionals(method="dense", max_jitter=0))
    with pytest.raises(ValueError, match="site 'x' is not positive definite.*float64.*jitter"):
        loss.loss(model, None, x)
    def exact(jitter):  # -sum_i log p(x_i) of the model with `jitter` added to its covariance diagonal
        cov = torch.ones(D, D) + (1e-30 + jitter) * torch.eye(D)
        return -float(torch.distributions.MultivariateNormal(torch.zeros(D), cov).log_prob(x).sum())

    rescued = MaskedPretrainingLoss(masks="exhaustive", conditionals=GaussianConditionals(method="dense"))
    with pytest.warns(NumericalWarning, match="site 'x' .*added jitter 1e-08 "):
        value = rescued.loss(model, None, x)
    # the exhaustive sum is the exact value for the jittered model, whose covariance has
    # condition number 4e8 (measured 4.8e-10 relative)
    assert value == pytest.approx(exact(1e-8), rel=2e-9, abs=0)
    jittered = MaskedPretrainingLoss(masks="order", conditionals=GaussianConditionals(method="dense", jitter=1e-3))
    assert jittered.loss(model, None, x) == pytest.approx(exact(1e-3), rel=1e-12, abs=0)


def test_first_call_imports_no_sympy():
    """torch.broadcast_shapes imports sympy on its first call (2-3 s); the loss and
    Evidence use Pyro's broadcast_shape, so a fresh interpreter never loads it."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pyro, pyro.distributions as dist\n"
        "from pyro_mpt import Evidence, MaskedPretrainingLoss\n"
        "def ppca(x):\n"
        "    W = pyro.param('W', torch.ones(6, 2))\n"
        "    with pyro.plate('data', x.shape[0]):\n"
        "        z = pyro.sample('z', dist.Normal(0.0, 1.0).expand([2]).to_event(1))\n"
        "        pyro.sample('x', dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)\n"
        "x = torch.randn(5, 6)\n"
        "Evidence(ppca)(x).sum().backward()\n"
        "MaskedPretrainingLoss(masks='all').differentiable_loss(ppca, None, x).backward()\n"
        "print('sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


def test_mask_free_pieces_are_computed_once_per_loss_and_kept_on_the_state(monkeypatch):
    # many blocks of shared masks on the per-mask path (few data against the
    # tokens): the full-data pieces are computed once for the loss and its
    # backward (recomputed blocks read them from the state), and a change of
    # the jitter drops them with the factor they were computed from
    import pyro_mpt.conditionals.gaussian as gaussian_module
    from pyro_mpt.conditionals.gaussian_jitter import set_jitter

    model, x, exact = make_ppca(30, K=2, N=3, seed=5)
    calls = []
    real = gaussian_module.lowrank_shared_data
    monkeypatch.setattr(gaussian_module, "lowrank_shared_data", lambda m, x: calls.append(1) or real(m, x))
    loss = MaskedPretrainingLoss(masks="all", share_masks=True, conditionals="gaussian", chunk_size=3 * 30 * 4)
    value = loss.differentiable_loss(model, None, x)
    value.backward()
    assert len(calls) == 1
    # (chunk_size gives 8 blocks of 4 masks; (D + R)^2 > 2nD keeps the per-mask path, unmerged)
    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = torch.rand(5, 30).argsort(-1) < 10
    first = engine.mask_sums(state, x, mask[:, None])
    assert state.data_pieces is not None and state.data_pieces[0] is x
    set_jitter(state, 1e-3)
    assert state.data_pieces is None and state.factor is None
    again = engine.mask_sums(state, x, mask[:, None])
    assert not torch.allclose(first, again, atol=1e-9, rtol=0)  # the jittered covariance, not stale pieces


def test_lowrank_precision_is_checked_once_per_call_and_the_loss_unchanged(monkeypatch):
    # the state's dtype is chosen by lowrank_dtype; the factorization of the
    # whole covariance does not repeat the check (the jitter only raises psi),
    # and the model's affinity check runs outside autograd: the loss and its
    # gradient are those of the exact log-density (order schedule) all the same
    import pyro_mpt.conditionals.gaussian as gaussian_module
    import pyro_mpt.conditionals.gaussian_jitter as jitter_module

    model, x, exact = make_ppca(8, K=2, N=40, seed=3)
    calls = []
    for module in (gaussian_module, jitter_module):
        real = module.lowrank_dtype
        monkeypatch.setattr(module, "lowrank_dtype", lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    value = MaskedPretrainingLoss(masks="order", share_masks=True, conditionals="gaussian").differentiable_loss(model, None, x)
    assert len(calls) == 1
    np.testing.assert_allclose(float(value), -float(exact(x).sum()), rtol=1e-10)
    W = pyro.param("W").unconstrained()
    got = torch.autograd.grad(value, W)[0]
    want = torch.autograd.grad(-exact(x).sum(), W)[0]  # torch's MultivariateNormal
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-8, atol=1e-10)


def test_affine_transformed_normal_observation_is_gaussian(float64):
    # TransformedDistribution(Normal(m, s), [AffineTransform(a, b)]) is N(a + b m, |b| s):
    # the Gaussian engine read it for latents but refused it as an observation
    # ("needs a Gaussian observed site; 'x' is TransformedDistribution"), so
    # Evidence(method='exact') failed and "auto" fell to quadrature (K <= 4) or
    # importance sampling. The transform's location may depend on the latents.
    # Reference: scipy's Gaussian marginal.
    from scipy.stats import multivariate_normal

    g = torch.Generator().manual_seed(5)
    n, D, K, s = 5, 6, 5, 0.6
    W = torch.randn(D, K, generator=g)
    c = torch.randn(D, generator=g)
    x = torch.randn(n, K, generator=g) @ W.T + c + s * torch.randn(n, D, generator=g)
    ref = multivariate_normal(c.numpy(), (W @ W.T).numpy() + s**2 * np.eye(D)).logpdf(x.numpy())

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            fn = dist.TransformedDistribution(dist.Normal(c / 4, s / 2), [dist.transforms.AffineTransform(z @ W.T + c / 2, 2.0)])
            pyro.sample("x", fn.to_event(1), obs=x)

    assert np.abs(Evidence(model, method="exact")(x).detach().numpy() - ref).max() < 1e-8
    for masks in ["exhaustive", "order"]:
        score = MaskedPretrainingLoss(masks=masks).score(model, None, x)  # "auto": the Gaussian engine
        assert np.abs(score.detach().numpy() - ref).max() < 1e-8


@pytest.mark.parametrize("stream, missing", [(32, False), (96, False), (32, True), (96, True)])
def test_streamed_independent_sums_equal_a_dense_loop(monkeypatch, stream, missing):
    """The streamed path of the masks-per-datapoint sums (each row's small pieces solved
    for the whole block and kept, the elementwise passes in slices of STREAM_ELEMENTS
    tokens: here slices of 4 of a query's 6 datapoints (32 tokens) or of two whole
    queries (96)), with rows whose precision is summed over the targets and rows summed
    over the context, and missing tokens: values against numpy's dense conditionals per
    (mask, datapoint) to 1e-10, float64, and the loading and noise gradients of a
    weighted sum against autograd of a torch loop over the same conditionals."""
    monkeypatch.setattr(gaussian_independent, "KEPT_PIECES_BITS_RATIO", 10**6)
    monkeypatch.setattr(gaussian_independent, "STREAM_ELEMENTS", stream)
    D, K, n, q = 8, 2, 6, 5
    g = torch.Generator().manual_seed(11)
    F0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi0 = torch.rand(D, generator=g, dtype=torch.float64) + 0.3
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * 1.5
    sizes = torch.randint(1, D + 1, (q, n, 1), generator=g)
    targets = torch.rand(q, n, D, generator=g).argsort(-1) < sizes
    observed = torch.rand(n, D, generator=g) < 0.75 if missing else torch.ones(n, D, dtype=torch.bool)
    hidden = targets | ~observed  # the tokens outside each mask's context
    summed = targets & observed
    weight = torch.rand(q, n, generator=g, dtype=torch.float64)
    # both sides of the precision's sum occur: the targets hold more, and less, than half the signal
    snr = (F0 * F0).sum(-1) / psi0
    flipped = (hidden.double() @ snr) > 0.5 * snr.sum()
    assert 0 < int(flipped.sum()) < q * n

    F, psi = F0.clone().requires_grad_(), psi0.clone().requires_grad_()
    import types

    state = types.SimpleNamespace(cov_factor=F[None], cov_diag=psi[None], factor=None, loc=torch.zeros(D, dtype=torch.float64), site="x")
    got = gaussian_independent.lowrank_independent_sums(state, x, hidden, lowrank_shared_data(state, x), observed if missing else None)
    got_grad = torch.autograd.grad((weight * got).sum(), (F, psi))

    def loop(F, psi, lib, xs):
        cov = F @ F.T + lib.diag(psi)
        out = []
        for k in range(q):
            for i in range(n):
                c = np.nonzero(~hidden[k, i].numpy())[0]
                t = np.nonzero(summed[k, i].numpy())[0]
                B = lib.linalg.solve(cov[c][:, c], cov[c][:, t]) if len(c) else cov[:0][:, t]
                mean = xs[i, c] @ B
                var = lib.diag(cov[t][:, t]) - (cov[c][:, t] * B).sum(0)
                out.append((-0.5 * (math.log(2 * math.pi) + lib.log(var) + (xs[i, t] - mean) ** 2 / var)).sum())
        return out

    want = np.array(loop(F0.numpy(), psi0.numpy(), np, x.numpy()), dtype=float).reshape(q, n)
    assert np.abs(got.detach().numpy() - want).max() <= 1e-10 * max(1.0, np.abs(want).max())
    F64, psi64 = F0.clone().requires_grad_(), psi0.clone().requires_grad_()
    ref = torch.stack(loop(F64, psi64, torch, x)).reshape(q, n)
    want_grad = torch.autograd.grad((weight * ref).sum(), (F64, psi64))
    for a, b in zip(got_grad, want_grad):
        assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())


def test_a_model_that_does_not_broadcast_warns_once_and_keeps_its_exact_value():
    """A random-intercept model indexing its group latents as a[grp] cannot run at the K + 4
    noise points in one plate: the engine runs it once per point (K + 4 model runs a step)
    and says so once (SlowEngineWarning), then stays quiet; its value equals the same model
    written a[..., grp] (vectorized, no warning) and the exact density (numpy, 1e-10)."""
    import warnings

    from pyro_mpt.conditionals import SlowEngineWarning

    G, N = 40, 120
    g = torch.Generator().manual_seed(5)
    grp = torch.arange(N) % G
    y = torch.randn(N, generator=g, dtype=torch.float64)

    def make(index):
        def model(grp, y):
            with pyro.plate("groups", G):
                a = pyro.sample("a", dist.Normal(torch.tensor(0.3, dtype=torch.float64), 1.5))
            with pyro.plate("data", N):
                pyro.sample("y", dist.Normal(index(a, grp), 0.5), obs=y)

        return model

    values = {}
    for name, index in (("a[grp]", lambda a, i: a[i]), ("a[..., grp]", lambda a, i: a[..., i])):
        loss = MaskedPretrainingLoss(token_plates=("data",), masks="order")
        model = make(index)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values[name] = [float(loss.loss(model, None, grp, y)) for _ in range(3)]
        slow = [w for w in caught if issubclass(w.category, SlowEngineWarning)]
        assert len(slow) == (1 if name == "a[grp]" else 0), [str(w.message) for w in slow]
        if slow:
            assert "44 model runs a step" in str(slow[0].message) and "a[..., idx]" in str(slow[0].message)
    Z = (grp.numpy()[:, None] == np.arange(G)).astype(float)
    cov = 1.5**2 * Z @ Z.T + 0.25 * np.eye(N)
    r = y.numpy() - 0.3
    _, logdet = np.linalg.slogdet(cov)
    exact = -0.5 * (r @ np.linalg.solve(cov, r) + logdet + N * np.log(2 * np.pi))
    for vals in values.values():
        assert max(abs(v + exact) for v in vals) < 1e-10 * abs(exact)


def test_composed_and_nested_affine_normals_are_normals(float64):
    """A latent written as ComposeTransform([AffineTransform, AffineTransform]) of a Normal,
    and an observation as a TransformedDistribution of a TransformedDistribution of a Normal
    under an IndependentTransform: still Normals. Before, only a flat list of AffineTransforms
    was read as one: Evidence(method="exact") refused the model ("is TransformedDistribution")
    and "auto" sampled it. Reference: scipy's multivariate normal of the marginal."""
    from pyro.distributions.transforms import AffineTransform, ComposeTransform, IndependentTransform
    from scipy.stats import multivariate_normal

    g = torch.Generator().manual_seed(9)
    n, D, K, s = 4, 5, 2, 0.7
    W = torch.randn(D, K, generator=g)
    c = torch.randn(D, generator=g)
    x = torch.randn(n, D, generator=g) * 2
    # z = 1 + 3 (0.5 + 0.5 u), u ~ N(0, 1): z ~ N(2.5, 1.5^2)
    cov = 1.5**2 * (W @ W.T).numpy() + s**2 * np.eye(D)
    ref = multivariate_normal((2.5 * W.sum(1) + c).numpy(), cov).logpdf(x.numpy())

    def model(x):
        with pyro.plate("data", x.shape[0]):
            both = ComposeTransform([AffineTransform(0.5, 0.5), AffineTransform(1.0, 3.0)])
            z = pyro.sample("z", dist.TransformedDistribution(dist.Normal(0.0, 1.0).expand([K]).to_event(1), [both]))
            inner = dist.TransformedDistribution(dist.Normal(torch.zeros(D), s / 4).to_event(1),
                                                 [AffineTransform(1.0, 2.0, event_dim=1)])
            outer = dist.TransformedDistribution(inner, [IndependentTransform(AffineTransform(z @ W.T + c - 2.0, 2.0), 1)])
            pyro.sample("x", outer, obs=x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.abs(Evidence(model, method="exact")(x).detach().numpy() - ref).max() < 1e-8
        score = MaskedPretrainingLoss(masks="exhaustive").score(model, None, x)  # "auto": the Gaussian engine
    assert np.abs(score.detach().numpy() - ref).max() < 1e-8
