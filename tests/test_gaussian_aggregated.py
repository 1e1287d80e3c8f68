"""The Gaussian engine's weighted sum over masks shared by the batch (one aggregated
quadratic form per datapoint), against dense conditionals computed mask by mask in
numpy, and its use by the loss (blocks of shared masks merged into groups)."""

import math

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import GaussianConditionals, MaskedPretrainingLoss
from pyro_mpt.conditionals.gaussian_aggregated import GRAM_BLOCKED_WIDTH, _weighted_gram, aggregated_cheaper
from pyro_mpt.conditionals.gaussian_jitter import factor_whole
from pyro_mpt.conditionals.gaussian_marginal import GaussianMarginal
from pyro_mpt.mask_blocks import MaskBlock
from pyro_mpt.masks import MaskSchedule

from models import make_ppca

pytestmark = pytest.mark.usefixtures("float64")


def numpy_weighted_sum(S, mu, x, mask, coef):
    """sum_q coef_q sum_{j in M_q} log N(x_j; conditional mean, variance), a loop over masks in numpy."""
    S, mu, x, mask, coef = (np.asarray(a) for a in (S, mu, x, mask, coef))
    out = np.zeros(x.shape[0])
    for q in range(mask.shape[0]):
        T, R = np.flatnonzero(mask[q]), np.flatnonzero(~mask[q])
        mean = np.broadcast_to(mu[T], (x.shape[0], T.size))
        var = np.diag(S[np.ix_(T, T)]).copy()
        if R.size:
            B = np.linalg.solve(S[np.ix_(R, R)], S[np.ix_(R, T)])
            mean = mean + (x[:, R] - mu[R]) @ B
            var -= np.einsum("rt,rt->t", S[np.ix_(R, T)], B)
        out += coef[q] * (-0.5 * (np.log(2 * np.pi * var) + (x[:, T] - mean) ** 2 / var)).sum(-1)
    return out


def torch_weighted_sum(S, mu, x, mask, coef):
    """The same loop in torch (differentiable), for gradient references."""
    out = x.new_zeros(x.shape[0])
    for q in range(mask.shape[0]):
        T, R = mask[q].nonzero()[:, 0], (~mask[q]).nonzero()[:, 0]
        mean, var = mu[T].expand(x.shape[0], -1), torch.diagonal(S[T][:, T])
        if R.numel():
            B = torch.linalg.solve(S[R][:, R], S[R][:, T])
            mean = mean + (x[:, R] - mu[R]) @ B
            var = var - (S[R][:, T] * B).sum(0)
        out = out + coef[q] * (-0.5 * (torch.log(2 * math.pi * var) + (x[:, T] - mean) ** 2 / var)).sum(-1)
    return out


def problem(n, D, R, P, seed):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, R, generator=g, dtype=torch.float64)
    psi = 0.3 + torch.rand(D, generator=g, dtype=torch.float64)
    mu = torch.randn(D, generator=g, dtype=torch.float64)
    S = F @ F.T + torch.diag(psi)
    x = mu + torch.randn(n, D, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(S).T
    sizes = torch.randint(1, D + 1, (P,), generator=g)
    mask = torch.rand(P, D, generator=g).argsort(-1) < sizes[:, None]
    mask[0] = True  # an empty context
    coef = torch.rand(P, generator=g, dtype=torch.float64)
    return F, psi, mu, S, x, mask, coef


def state_of(F, psi, mu, dense, dtype=torch.float64):
    if dense:
        m = GaussianMarginal(mu[None].to(dtype), covariance=(F @ F.T + torch.diag(psi))[None].to(dtype), site="x")
    else:
        m = GaussianMarginal(mu[None].to(dtype), cov_factor=F[None].to(dtype), cov_diag=psi[None].to(dtype), site="x")
    factor_whole(m)
    return m


# (n, D, R, dense): the aggregated form where the data are many against the tokens
AGGREGATED = [(300, 12, 3, False), (200, 30, 7, False), (300, 12, 3, True), (200, 20, 20, True)]


@pytest.mark.parametrize("n,D,R,dense", AGGREGATED)
def test_aggregated_equals_numpy(n, D, R, dense):
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=23, seed=D + R)
    assert aggregated_cheaper(n, D, None if dense else R)
    engine = GaussianConditionals()
    m = state_of(F, psi, mu, dense)
    assert engine.weighted_sum_elements(m, x) < n * D  # the aggregated form's working set
    got = engine.weighted_mask_sum(m, x, mask, coef)
    want = numpy_weighted_sum(S, mu, x, mask, coef)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-8)


@pytest.mark.parametrize("n,D,R,dense,max_elements", [c + (2**24,) for c in AGGREGATED[:1] + AGGREGATED[2:]] + [(300, 12, 3, False, 1)])
def test_aggregated_gradient_equals_autograd_of_loop(n, D, R, dense, max_elements):
    # max_elements=1: the low-rank form's backward pass chunk by chunk, one mask each
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=9, seed=7)
    F, psi, mu, x = (t.clone().requires_grad_() for t in (F, psi, mu, x))
    engine = GaussianConditionals(max_elements=max_elements)
    u = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    m = state_of(F, psi, mu, dense)
    got = torch.autograd.grad((u * engine.weighted_mask_sum(m, x, mask, coef)).sum(), (F, psi, mu, x))
    want = torch.autograd.grad((u * torch_weighted_sum(F @ F.T + torch.diag(psi), mu, x, mask, coef)).sum(), (F, psi, mu, x))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


# (fraction, max_elements): 2**24 one chunk, its Y kept; 2000 one mask a chunk, none kept;
# 20000 chunks of 11 masks, some on each path, Y kept
@pytest.mark.parametrize("fraction,max_elements", [(1.0, 2**24), (1.0, 2000), (0.5, 2000), (0.5, 20000)])
def test_lowrank_form_context_path_equals_numpy_and_autograd_of_loop(monkeypatch, fraction, max_elements):
    """The low-rank form's context path (products over each mask's context rows, Y_m kept for
    the backward pass within max_elements // 4, else made again): for every chunk (fraction 1)
    or for the chunks whose contexts are at most half the tokens (both paths in one call), the
    score equals numpy's per-mask conditioning (1e-10) and the gradients autograd of a per-mask
    loop in torch (1e-8)."""
    import pyro_mpt.conditionals.gaussian_lowrank_form as form

    monkeypatch.setattr(form, "CONTEXT_MIN_RANK", 1)
    monkeypatch.setattr(form, "CONTEXT_FRACTION", fraction)
    n, D, R = 200, 30, 7
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=31, seed=17)
    mask[1] = False
    mask[1, 4] = True  # one target
    engine = GaussianConditionals(max_elements=max_elements)
    got = engine.weighted_mask_sum(state_of(F, psi, mu, False), x, mask, coef)
    np.testing.assert_allclose(got.numpy(), numpy_weighted_sum(S, mu, x, mask, coef), rtol=1e-10, atol=1e-8)
    F, psi, mu, x = (t.clone().requires_grad_() for t in (F, psi, mu, x))
    u = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((u * engine.weighted_mask_sum(state_of(F, psi, mu, False), x, mask, coef)).sum(), (F, psi, mu, x))
    want = torch.autograd.grad((u * torch_weighted_sum(F @ F.T + torch.diag(psi), mu, x, mask, coef)).sum(), (F, psi, mu, x))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


def test_dense_form_gradient_of_a_raw_covariance_equals_autograd_of_loop():
    # the dense form's backward pass is written out (DenseForm): against a
    # covariance given as a leaf tensor (its symmetric part is what any
    # symmetric parametrization sees), through the factor L0 = chol(S) too
    n, D, R = 200, 16, 16
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=13, seed=11)
    mask[1] = False
    mask[1, 3] = True  # one target
    S, mu, x = (t.clone().requires_grad_() for t in (S, mu, x))
    u = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    m = GaussianMarginal(mu[None], covariance=S[None], site="x")
    factor_whole(m)
    got = torch.autograd.grad((u * GaussianConditionals().weighted_mask_sum(m, x, mask, coef)).sum(), (S, mu, x))
    want = torch.autograd.grad((u * torch_weighted_sum(S, mu, x, mask, coef)).sum(), (S, mu, x))
    sym = lambda g: 0.5 * (g + g.T)  # noqa: E731
    got, want = (sym(got[0]),) + got[1:], (sym(want[0]),) + want[1:]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


@pytest.mark.parametrize("n,D,R,dense", AGGREGATED)
def test_aggregated_float32_within_rounding(n, D, R, dense):
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=23, seed=3)
    m = state_of(F, psi, mu, dense, torch.float32)
    got = GaussianConditionals().weighted_mask_sum(m, x.float(), mask, coef.float())
    assert got.dtype == torch.float32
    want = numpy_weighted_sum(S, mu, x, mask, coef)
    # float32 rounding of the data and parameters moves each conditional by
    # about eps times its standardized residual and the sums over D tokens
    tol = 50 * D * torch.finfo(torch.float32).eps * np.abs(want).max()
    assert np.abs(got.double().numpy() - want).max() <= tol


def test_few_masks_on_the_lowrank_path_take_the_per_mask_path(monkeypatch):
    # the aggregated form's one product with the data, 2 n (D + R)^2, is not
    # repaid by fewer than 4 masks at n = 1000, D = 10, R = 2 (4 n D R - 2 R (D + R)^2 = 79424 a mask)
    import pyro_mpt.conditionals.gaussian as gaussian_module

    n, D, R = 1000, 10, 2
    assert aggregated_cheaper(n, D, R) and not aggregated_cheaper(n, D, R, masks=3) and aggregated_cheaper(n, D, R, masks=4)
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=23, seed=4)
    calls = []
    real = gaussian_module.lowrank_weighted_sum
    monkeypatch.setattr(gaussian_module, "lowrank_weighted_sum", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = GaussianConditionals()
    for P, aggregated in ((1, 0), (3, 0), (4, 1), (23, 1)):
        calls.clear()
        got = engine.weighted_mask_sum(state_of(F, psi, mu, False), x, mask[:P], coef[:P])
        assert len(calls) == aggregated
        np.testing.assert_allclose(got.numpy(), numpy_weighted_sum(S, mu, x, mask[:P], coef[:P]), rtol=1e-10, atol=1e-8)


@pytest.mark.parametrize("dense", [False, True])
def test_few_data_take_the_per_mask_path(dense):
    n, D, R = 5, 30, 4
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=11, seed=2)
    assert not aggregated_cheaper(n, D, None if dense else R)
    engine = GaussianConditionals()
    m = state_of(F, psi, mu, dense)
    # the per-mask sums' working set: each mask's (D, R) loading rows or (D, D) covariance
    # blocks outweigh its n * D conditionals at few data (mpt_estimate then splits blocks)
    assert engine.weighted_sum_elements(m, x) > n * D
    got = engine.weighted_mask_sum(m, x, mask, coef)
    np.testing.assert_allclose(got.numpy(), numpy_weighted_sum(S, mu, x, mask, coef), rtol=1e-10, atol=1e-8)


class Replay(MaskSchedule):
    """Pre-drawn shared blocks, in small pieces (as a schedule chunks them at large n * D)."""

    def __init__(self, blocks):
        super().__init__(1, share_masks=True)
        self._blocks = blocks

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        yield from self._blocks


class Counting(GaussianConditionals):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def weighted_mask_sum(self, state, x, mask, coef):
        self.calls.append(mask.shape[0])
        return super().weighted_mask_sum(state, x, mask, coef)


@pytest.mark.parametrize("method", ["lowrank", "dense"])
@pytest.mark.parametrize("chunk_size", [2**22, 60])
def test_loss_merges_shared_blocks_and_matches_the_loop(method, chunk_size):
    D, K, N = 10, 3, 200
    model, x, _ = make_ppca(D, K, N, seed=4)
    g = torch.Generator().manual_seed(0)
    masks = torch.stack([torch.randperm(D, generator=g) < M for M in range(1, D + 1)])
    weight = torch.rand(D, 1, generator=g, dtype=torch.float64)
    # one mask a block: merged into one group, or several with a small chunk_size
    blocks = [MaskBlock(masks[i : i + 1, None], torch.tensor([[i + 1]]), weight[i : i + 1]) for i in range(D)]
    engine = Counting(method=method)
    loss = MaskedPretrainingLoss(masks=Replay(blocks), conditionals=engine, chunk_size=chunk_size)

    W, mu, s = (pyro.param(k).unconstrained() for k in ("W", "mu", "s"))
    est = loss.score(model, None, x)
    S = pyro.param("W") @ pyro.param("W").T + pyro.param("s") ** 2 * torch.eye(D)
    coef = weight[:, 0] / torch.arange(1, D + 1)
    want = torch_weighted_sum(S, pyro.param("mu"), x, masks, coef)
    np.testing.assert_allclose(est.detach().numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-8)
    assert sum(engine.calls) == D
    # the default chunk_size holds all masks in one group; 60 elements one mask a group
    assert len(engine.calls) == 1 if chunk_size == 2**22 else len(engine.calls) > 1
    # gradients through the merged (and, past the first group, recomputed) groups
    engine.calls.clear()
    got = torch.autograd.grad(loss.differentiable_loss(model, None, x), (W, mu, s))
    ref = -torch_weighted_sum(
        pyro.param("W") @ pyro.param("W").T + pyro.param("s") ** 2 * torch.eye(D), pyro.param("mu"), x, masks, coef
    ).sum()
    want_g = torch.autograd.grad(ref, (W, mu, s))
    for a, b in zip(got, want_g):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


def tokens_model(W, mu, observed=None):
    D, K = W.shape

    def model(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))  # (N, 1, K)
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + mu, 0.5), obs=x, obs_mask=observed)

    return model


@pytest.mark.parametrize("missing", [False, True])
def test_exhaustive_through_the_aggregated_form_is_exact(missing):
    """Every subset of D = 6 tokens, shared by the batch: with no token missing the
    engine's weighted sum takes the aggregated form and the estimate is log N(x_i; mu, S)
    (Proposition 1); with missing tokens (blocks with a context and per-datapoint gains)
    the blocks fall back to the per-mask sums, and it is log N(x_{O_i}), both in numpy."""
    D, K, N = 6, 2, 60
    assert aggregated_cheaper(N, D, K)
    g = torch.Generator().manual_seed(8)
    W, mu = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    x = mu + torch.randn(N, K, generator=g) @ W.T + 0.5 * torch.randn(N, D, generator=g)
    observed = None
    if missing:
        observed = torch.rand(N, D, generator=g) > 0.3
        observed[0] = True
    engine = Counting()
    got = MaskedPretrainingLoss(masks="exhaustive", conditionals=engine).score(tokens_model(W, mu, observed), None, x)
    assert (len(engine.calls) == 0) == missing
    S = (W @ W.T + 0.25 * torch.eye(D)).numpy()
    for i in range(N):
        o = np.ones(D, bool) if observed is None else observed[i].numpy()
        r = (x[i] - mu).numpy()[o]
        So = S[np.ix_(o, o)]
        want = -0.5 * (o.sum() * np.log(2 * np.pi) + np.linalg.slogdet(So)[1] + r @ np.linalg.solve(So, r))
        assert abs(float(got[i]) - want) < 1e-8 * max(1.0, abs(want)), (i, float(got[i]), want)


@pytest.mark.parametrize("loc_rows", [None, 1, 40])
@pytest.mark.parametrize("x_grad", [False, True])
def test_whitened_quad_value_and_gradients(loc_rows, x_grad):
    # the dense form's data term with its backward pass written out: the value against
    # numpy, the gradients of x, a location (shared as (D,) or (1, D), or per datapoint),
    # M and a non-symmetric A against autograd of the plain expression with A's symmetric part
    from pyro_mpt.conditionals.gaussian_aggregated import WhitenedQuad

    n, D = 40, 7
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    loc = torch.randn((D,) if loc_rows is None else (loc_rows, D), generator=g, dtype=torch.float64)
    M = torch.randn(D, D, generator=g, dtype=torch.float64)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    e = (x - loc).numpy() @ M.numpy().T
    want = np.einsum("ni,ij,nj->n", e, 0.5 * (A + A.T).numpy(), e)
    leaves = [t.clone().requires_grad_() for t in (x, loc, M, A)]
    if not x_grad:
        leaves[0].requires_grad_(False)
    got = WhitenedQuad.apply(*leaves)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12)
    wrt = leaves if x_grad else leaves[1:]
    grads = torch.autograd.grad((w * got).sum(), wrt)
    ref_leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    xr, lr, Mr, Ar = ref_leaves
    er = (xr - lr) @ Mr.T
    ref = (w * ((er @ (0.5 * (Ar + Ar.T))) * er).sum(-1)).sum()
    want_g = torch.autograd.grad(ref, ref_leaves if x_grad else ref_leaves[1:])
    for a, b in zip(grads, want_g):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12 * float(b.abs().max()))


# ---------------------------------------------------------------------- models a user writes
def rows_weighted_sum(S, loc, x, mask, coef):
    """numpy_weighted_sum with a location per datapoint ``loc`` (n, D), through the residuals."""
    return numpy_weighted_sum(S, np.zeros(S.shape[0]), np.asarray(x) - np.asarray(loc), mask, coef)


def user_model(kind, D, K, N, seed):
    """A factor analysis with a noise scale per token and covariates in the location
    (``"fa"``), or a ``LowRankMultivariateNormal`` observation without latents
    (``"lrmvn"``); returns the model, its arguments, its param names and a function
    of the param store giving the covariance and the location per datapoint."""
    g = torch.Generator().manual_seed(seed)
    W0, mu0 = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    sd0 = (0.3 + torch.rand(D, generator=g)).sqrt()
    c, B0 = torch.randn(N, 2, generator=g), torch.randn(2, D, generator=g)
    x = torch.randn(N, K, generator=g) @ W0.T + mu0 + c @ B0 + sd0 * torch.randn(N, D, generator=g)

    def model(x, c):
        W, mu = pyro.param("W", W0.clone()), pyro.param("mu", mu0.clone())
        sd = pyro.param("sd", sd0.clone(), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            if kind == "lrmvn":
                pyro.sample("x", dist.LowRankMultivariateNormal(mu, W, sd**2), obs=x)
                return
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu + c @ pyro.param("B", B0.clone()), sd).to_event(1), obs=x)

    def cov_loc():
        W, mu, sd = (pyro.param(k) for k in ("W", "mu", "sd"))
        loc = mu.expand(N, D) if kind == "lrmvn" else mu + c @ pyro.param("B")
        return W @ W.T + torch.diag(sd**2), loc

    names = ("W", "mu", "sd") + (() if kind == "lrmvn" else ("B",))
    return model, (x, c), names, cov_loc


# (kind, D, K, N, P, max_elements, chunk_size): K = 1, K close to D (still low rank),
# the form's outer and inner chunks (7 and 4 masks at max_elements=2000, D=15, K=4)
# and several merged groups (chunk_size of 13 masks' working set)
USER_CASES = [
    ("fa", 12, 3, 300, 40, 2**24, 2**22),
    ("fa", 20, 1, 300, 30, 2**24, 2**22),
    ("lrmvn", 30, 25, 2500, 30, 2**24, 2**22),
    ("fa", 15, 4, 300, 80, 2000, 2 * (16 + 15) * 13),
]


@pytest.mark.parametrize("kind,D,K,N,P,max_elements,chunk_size", USER_CASES)
def test_user_models_score_and_gradients_equal_the_per_mask_loop(kind, D, K, N, P, max_elements, chunk_size):
    """The loss on shared masks (the aggregated low-rank form) of models written as a
    user would: the score against numpy's per-mask conditioning (1e-10) and the
    parameters' gradients against autograd of a per-mask loop in torch (1e-8), with
    empty-context and single-token masks among them."""
    model, args, names, cov_loc = user_model(kind, D, K, N, seed=D + K)
    g = torch.Generator().manual_seed(P)
    mask = torch.rand(P, D, generator=g).argsort(-1) < torch.randint(1, D + 1, (P, 1), generator=g)
    mask[0], mask[1] = True, torch.arange(D) == 2  # all tokens targets; one target
    weight = torch.rand(P, 1, generator=g, dtype=torch.float64) + 0.5
    blocks = [MaskBlock(mask[i : i + 1, None], mask[i : i + 1].sum(-1, keepdim=True), weight[i : i + 1]) for i in range(P)]
    engine = Counting(max_elements=max_elements)
    loss = MaskedPretrainingLoss(masks=Replay(blocks), conditionals=engine, chunk_size=chunk_size)
    got = loss.score(model, None, *args)
    assert engine.calls and sum(engine.calls) == P  # through the aggregated form
    coef = weight[:, 0] / mask.sum(-1)
    S, loc = cov_loc()
    want = rows_weighted_sum(S.detach(), loc.detach(), args[0], mask, coef)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    leaves = [pyro.param(k).unconstrained() for k in names]
    got_g = torch.autograd.grad(loss.differentiable_loss(model, None, *args), leaves)
    S, loc = cov_loc()
    want_g = torch.autograd.grad(-torch_weighted_sum(S, torch.zeros(D), args[0] - loc, mask, coef).sum(), leaves)
    for k, a, b in zip(names, got_g, want_g):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()), err_msg=k)


def test_subsampled_plate_scales_the_aggregated_loss():
    """pyro.plate("data", N, subsample_size=n): the loss is -(N / n) times the sum over
    the subsample of the per-mask loop, its gradients to 1e-8."""
    D, K, N, n, P = 14, 3, 1000, 300, 30
    model0, (x, _), names, _ = user_model("fa", D, K, N, seed=3)
    drawn = []

    def model(x):
        W, mu = pyro.param("W"), pyro.param("mu")
        sd = pyro.param("sd", constraint=dist.constraints.positive)
        with pyro.plate("data", N, subsample_size=n) as idx:
            drawn.append(idx)
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, sd).to_event(1), obs=x[idx])

    model0(x, torch.zeros(N, 2))  # the params
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(P, D, generator=g).argsort(-1) < torch.randint(1, D + 1, (P, 1), generator=g)
    weight = torch.rand(P, 1, generator=g, dtype=torch.float64) + 0.5
    engine = Counting()
    loss = MaskedPretrainingLoss(masks=Replay([MaskBlock(mask[:, None], mask.sum(-1, keepdim=True), weight)]), conditionals=engine)
    leaves = [pyro.param(k).unconstrained() for k in ("W", "mu", "sd")]
    value = loss.differentiable_loss(model, None, x)
    assert engine.calls == [P] and all(torch.equal(i, drawn[-1]) for i in drawn)
    W, mu, sd = (pyro.param(k) for k in ("W", "mu", "sd"))
    ref = -(N / n) * torch_weighted_sum(W @ W.T + torch.diag(sd**2), mu, x[drawn[-1]], mask, weight[:, 0] / mask.sum(-1)).sum()
    assert abs(float(value) - float(ref)) <= 1e-10 * abs(float(ref))
    for a, b in zip(torch.autograd.grad(value, leaves), torch.autograd.grad(ref, leaves)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


# ---------------------------------------------------------------------- second derivatives
@pytest.mark.parametrize("path", ["lowrank-shared", "dense-shared", "lowrank-per-datapoint", "order"])
def test_second_derivatives_through_written_backward_passes_are_refused(path):
    """The backward passes written out for first derivatives (QuadraticRows, LowRankForm,
    WhitenedQuad, DenseForm, IndependentLowRankSums, SharedLowRankLogProb) refuse
    create_graph=True: under once_differentiable alone their result was constant in the
    parameters, and a Hessian-vector product came out silently wrong (measured 100% off
    finite differences of the gradient on all four paths)."""
    # the exact log-density's written backward pass serves a location shared by the batch
    model, args, names, _ = user_model("lrmvn" if path == "order" else "fa", 10, 2, 300, seed=1)
    masks, share = {"order": ("order", None)}.get(path, ("all", path.endswith("shared")))
    method = "dense" if path.startswith("dense") else "lowrank"
    loss = MaskedPretrainingLoss(masks=masks, share_masks=share, conditionals=GaussianConditionals(method))
    model(*args)
    sd = pyro.param("sd").unconstrained()
    value = loss.differentiable_loss(model, None, *args)
    with pytest.raises(RuntimeError, match=r"Second derivatives \(create_graph=True\) through pyro_mpt's"):
        torch.autograd.grad(value, sd, create_graph=True)
    # first derivatives are unchanged
    assert torch.isfinite(torch.autograd.grad(loss.differentiable_loss(model, None, *args), sd)[0]).all()


def test_second_derivatives_of_the_per_mask_path_equal_the_loop(monkeypatch):
    """Where no backward pass is written out (few data: the per-mask path, recorded op by
    op), a Hessian-vector product of the loss equals that of the torch per-mask loop (1e-8)."""
    D = 8
    model, args, names, cov_loc = user_model("fa", D, 2, 5, seed=2)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(3, D, generator=g).argsort(-1) < torch.tensor([[1], [4], [8]])
    weight = torch.rand(3, 1, generator=g, dtype=torch.float64)
    import pyro_mpt.conditionals.gaussian as gaussian_module

    aggregated = []
    real = gaussian_module.lowrank_weighted_sum
    monkeypatch.setattr(gaussian_module, "lowrank_weighted_sum", lambda *a, **k: aggregated.append(1) or real(*a, **k))
    loss = MaskedPretrainingLoss(masks=Replay([MaskBlock(mask[:, None], mask.sum(-1, keepdim=True), weight)]))
    model(*args)
    sd = pyro.param("sd").unconstrained()
    v = torch.randn(D, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss.differentiable_loss(model, None, *args), sd, create_graph=True)
    assert aggregated == []  # few data: the per-mask sums, not the aggregated form
    (got,) = torch.autograd.grad(grad @ v, sd)
    S, loc = cov_loc()
    ref = -torch_weighted_sum(S, torch.zeros(D), args[0] - loc, mask, weight[:, 0] / mask.sum(-1)).sum()
    (grad_ref,) = torch.autograd.grad(ref, sd, create_graph=True)
    (want,) = torch.autograd.grad(grad_ref @ v, sd)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-8, atol=1e-8 * float(want.abs().max()))


@pytest.mark.parametrize("D,K,psi,tol", [(50, 5, 0.25, 2e-5), (100, 20, 1.0, 5e-4)])
def test_float32_noise_gradient_of_the_aggregated_form(D, K, psi, tol):
    """The noise scale's gradient of the aggregated form in float32 against a float64
    per-mask loop on the float32-rounded model (relative to its size). Recorded apart,
    its paths through X_m = Fp^T diag(t_m) and through delta = zhat - Fp^T e are terms of
    order 1/psi that cancel: 1.6e-4 and 2.5e-3 off before (measured after: 2.4e-6, 6.4e-5)."""
    N = 1000
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g)
    x = (torch.randn(N, K, generator=g) @ W0.T + psi**0.5 * torch.randn(N, D, generator=g)).float()
    mask = torch.rand(D, D, generator=g).argsort(-1) < torch.arange(1, D + 1)[:, None]  # every size

    def model(x):
        W = pyro.param("W", W0.float())
        s = pyro.param("s", torch.tensor(psi**0.5, dtype=torch.float32), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float32), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    engine = Counting()
    blocks = [MaskBlock(mask[:, None], mask.sum(-1, keepdim=True), torch.ones(D, 1, dtype=torch.float64))]
    loss = MaskedPretrainingLoss(masks=Replay(blocks), conditionals=engine)
    model(x)
    s = pyro.param("s").unconstrained()
    (got,) = torch.autograd.grad(loss.differentiable_loss(model, None, x), s)
    assert engine.calls == [D] and got.dtype == torch.float32
    s64 = s.detach().double().requires_grad_()
    W = pyro.param("W").detach().double()
    S = W @ W.T + torch.exp(s64) ** 2 * torch.eye(D)  # constraints.positive: exp of the unconstrained
    ref = -torch_weighted_sum(S, torch.zeros(D), x.double(), mask, 1.0 / mask.sum(-1)).sum()
    (want,) = torch.autograd.grad(ref, s64)
    assert abs(float(got) - float(want)) <= tol * abs(float(want)), (float(got), float(want))


def _float32_ppca(D, K, N, seed, noise_sd):
    """A float32 PPCA as a user writes it, its data and its loading ``W0`` ``(D, K)``;
    ``noise_sd(W0)`` gives the noise scale."""
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float32)
    sigma = noise_sd(W0)
    x = torch.randn(N, K, generator=g, dtype=torch.float32) @ W0.T + sigma * torch.randn(N, D, generator=g, dtype=torch.float32)

    def ppca(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float32), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, sigma).to_event(1), obs=x)

    return ppca, x, W0



def test_one_column_float32_small_noise_exhaustive_is_exact_to_float32():
    """PPCA with one column and noise sd 1e-4 in float32, as a user writes it: the state
    stays float32 (with one column its bound is eps^2 kappa), but the aggregated form's
    y^T A y cancels terms of size kappa = tr(F^T Psi^-1 F) ~ 6e8, so those states take the
    per-mask sums. Exhaustive masks against scipy's log-density of the float32 model:
    107.8 nats off (log p ~ -36) and the W gradient 27x off before; measured after:
    2.4e-3 nats, gradient 3.4e-4 relative to the float64 LowRankMultivariateNormal's."""
    from scipy.stats import multivariate_normal

    D, N, sigma = 6, 100, 1e-4
    ppca, x, W0 = _float32_ppca(D, 1, N, 0, lambda W0: sigma)

    var = float(torch.tensor(sigma, dtype=torch.float32)) ** 2
    W = W0.double()
    ref = multivariate_normal(np.zeros(D), (W @ W.T).numpy() + var * np.eye(D)).logpdf(x.double().numpy())
    loss = MaskedPretrainingLoss(masks="exhaustive")
    value = loss.score(ppca, None, x).detach()
    assert value.dtype == torch.float32
    assert np.abs(value.double().numpy() - ref).max() <= 2e-2
    Wp = pyro.param("W").unconstrained()
    (got,) = torch.autograd.grad(loss.differentiable_loss(ppca, None, x), Wp)
    W64 = Wp.detach().double().requires_grad_()
    lml = dist.LowRankMultivariateNormal(torch.zeros(D), W64, torch.full((D,), var)).log_prob(x.double()).sum()
    (want,) = torch.autograd.grad(-lml, W64)
    assert float((got.double() - want).abs().max()) <= 3e-3 * float(want.abs().max())


def test_float64_small_noise_exhaustive_is_exact_to_1e8():
    """PPCA in float64 with noise sd 1e-4 against a unit loading (D = 10, K = 2): the
    aggregated form's y^T A y loses about 2 eps kappa nats (kappa ~ 1e9 here), so the
    engine takes the per-mask sums where 2 eps kappa > 1e-8. Exhaustive masks against
    50-digit arithmetic on the exact covariance W W^T + sigma^2 I: 2.3e-7 nats off before,
    measured 2.9e-9 after."""
    mpmath = pytest.importorskip("mpmath")
    D, K, N, sigma = 10, 2, 40, 1e-4
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g)
    x = torch.randn(N, K, generator=g) @ W0.T + sigma * torch.randn(N, D, generator=g)

    def ppca(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, sigma).to_event(1), obs=x)

    value = MaskedPretrainingLoss(masks="exhaustive").score(ppca, None, x).detach()
    with mpmath.workdps(50):
        Wm = [[mpmath.mpf(float(w)) for w in row] for row in W0]
        cov = mpmath.matrix([[mpmath.fsum(Wm[i][k] * Wm[j][k] for k in range(K)) + (mpmath.mpf(sigma) ** 2 if i == j else 0)
                              for j in range(D)] for i in range(D)])
        inv, logdet = cov**-1, mpmath.log(mpmath.det(cov))
        ref = []
        for xi in x.tolist():
            r = mpmath.matrix([mpmath.mpf(v) for v in xi])
            ref.append(float(-0.5 * (D * mpmath.log(2 * mpmath.pi) + logdet + (r.T * inv * r)[0])))
    assert float((value - torch.tensor(ref)).abs().max()) <= 1e-8


@pytest.mark.parametrize("share", [True, False])
def test_float32_state_between_the_two_bounds_takes_the_form_in_float64(monkeypatch, share):
    """A float32 PPCA whose kappa = tr(F^T Psi^-1 F) is 6000: the state stays float32
    (eps kappa = 7e-4 <= 1e-3), but the aggregated form of shared masks and the sums over
    masks drawn per datapoint lose 2 eps kappa = 1.4e-3 > 1e-3 there. They run in float64
    instead of giving way to the per-mask conditionals (5-8x slower at D = 200-512).
    Exhaustive masks against scipy's log-density of the float32 model and the float64
    LowRankMultivariateNormal's gradient; the spy shows the float64 path was taken."""
    from scipy.stats import multivariate_normal

    from pyro_mpt.conditionals import gaussian

    D, N = 10, 200
    def noise_sd(W0):  # kappa = tr(W^T W) / sigma^2 = 6000
        return float((W0.double().pow(2).sum() / 6000.0).sqrt())

    ppca, x, W0 = _float32_ppca(D, 2, N, 1, noise_sd)
    sigma = noise_sd(W0)

    seen = []
    name = "lowrank_weighted_sum" if share else "lowrank_independent_sums"
    original = getattr(gaussian, name)

    def spy(state, *args, **kwargs):
        seen.append(state.cov_factor.dtype)
        return original(state, *args, **kwargs)

    monkeypatch.setattr(gaussian, name, spy)
    var = float(torch.tensor(sigma, dtype=torch.float32)) ** 2
    kappa = float(W0.double().pow(2).sum() / var)
    eps = torch.finfo(torch.float32).eps
    assert eps * kappa <= 1e-3 < 2 * eps * kappa
    W = W0.double()
    ref = multivariate_normal(np.zeros(D), (W @ W.T).numpy() + var * np.eye(D)).logpdf(x.double().numpy())
    if share:
        loss = MaskedPretrainingLoss(masks="exhaustive")
    else:
        # every nonempty mask, repeated for each datapoint: masks per datapoint whose
        # weighted sum is still log p (weight 1 / C(D, M) a mask of size M)
        bits = (torch.arange(1, 2**D)[:, None] >> torch.arange(D)) & 1
        masks = bits.bool()
        size = masks.sum(-1, keepdim=True)
        weight = torch.tensor([[1.0 / math.comb(D, int(m))] for m in size[:, 0]], dtype=torch.float32)
        block = MaskBlock(masks[:, None].expand(-1, N, D).contiguous(), size, weight)
        loss = MaskedPretrainingLoss(masks=Replay([block]))
    value = loss.score(ppca, None, x).detach()
    assert value.dtype == torch.float32 and seen and set(seen) == {torch.float64}
    assert np.abs(value.double().numpy() - ref).max() <= 4 * eps * np.abs(ref).max()
    Wp = pyro.param("W").unconstrained()
    (got,) = torch.autograd.grad(loss.differentiable_loss(ppca, None, x), Wp)
    W64 = Wp.detach().double().requires_grad_()
    lml = dist.LowRankMultivariateNormal(torch.zeros(D, dtype=torch.float64), W64, torch.full((D,), var, dtype=torch.float64))
    (want,) = torch.autograd.grad(-lml.log_prob(x.double()).sum(), W64)
    assert float((got.double() - want).abs().max()) <= 16 * eps * float(want.abs().max())


# ---------------------------------------------------------------------- target blocks of the precision
def numpy_target_blocks(S, mask, coef):
    """sum_m E^T C W C E and sum_m a sum_j log(2 pi v_j), with C = S_TT - S_TR S_RR^-1 S_RT
    (the conditional covariance from the covariance, not through the precision), in numpy."""
    S, mask, coef = np.asarray(S), np.asarray(mask), np.asarray(coef)
    D = S.shape[0]
    A, logdet = np.zeros((D, D)), 0.0
    for q in range(mask.shape[0]):
        T, R = np.flatnonzero(mask[q]), np.flatnonzero(~mask[q])
        C = S[np.ix_(T, T)] - (S[np.ix_(T, R)] @ np.linalg.solve(S[np.ix_(R, R)], S[np.ix_(R, T)]) if R.size else 0)
        v = np.diag(C)
        A[np.ix_(T, T)] += C @ np.diag(coef[q] / v) @ C
        logdet += coef[q] * np.log(2 * np.pi * v).sum()
    return A, logdet


def test_target_blocks_equal_numpy_conditioning_and_pass_gradcheck():
    """TargetBlockForm's A and log-determinant against numpy's conditional covariances
    (1e-11), on masks of every kind: all tokens targets, one target, groups padded to
    their largest mask (a small max_elements: several groups); its written-out gradient
    with respect to the precision against finite differences (torch.autograd.gradcheck)."""
    from pyro_mpt.conditionals.gaussian_target_form import TargetBlockForm, target_form_groups

    g = torch.Generator().manual_seed(5)
    D, R = 9, 4
    F = torch.randn(D, R, generator=g, dtype=torch.float64)
    S = F @ F.T + torch.diag(0.3 + torch.rand(D, generator=g, dtype=torch.float64))
    sizes = torch.tensor([D, 1, 1, 2, 4, 5, 5, 8, 4, 7])
    mask = torch.rand(len(sizes), D, generator=g).argsort(-1) < sizes[:, None]
    coef = torch.rand(len(sizes), generator=g, dtype=torch.float64) + 0.5
    groups = target_form_groups(mask, 512)
    assert len(groups) >= 4 and any((idx == D).any() for _, idx in groups)  # padded groups
    assert sorted(torch.cat([rows for rows, _ in groups]).tolist()) == list(range(len(sizes)))
    A_ref, logdet_ref = numpy_target_blocks(S, mask, coef)
    # with the factor (F, psi): the groups of Mp >= 6 (Mp^3 >= R^2 D) from the context's R x R precision
    psi = torch.diagonal(S) - (F * F).sum(-1)
    assert any(idx.shape[-1] ** 3 >= R * R * D for _, idx in groups) and any(idx.shape[-1] ** 3 < R * R * D for _, idx in groups)
    for factor in (None, (F, psi)):
        A, logdet = TargetBlockForm.apply(torch.linalg.inv(S), groups, coef, "x", factor)
        np.testing.assert_allclose(A.numpy(), A_ref, rtol=1e-11, atol=1e-11 * np.abs(A_ref).max())
        assert abs(float(logdet) - logdet_ref) <= 1e-11 * abs(logdet_ref)
    P = torch.linalg.inv(S).requires_grad_()
    # the form reads a symmetric precision: check along symmetric directions
    sym = lambda P: TargetBlockForm.apply(0.5 * (P + P.T), groups, coef, "x")  # noqa: E731
    assert torch.autograd.gradcheck(lambda P: sym(P)[0], (P,), atol=1e-7)
    assert torch.autograd.gradcheck(lambda P: sym(P)[1], (P,), atol=1e-7)


def test_masks_split_between_target_blocks_and_the_context_side_match_the_loop(monkeypatch):
    """PPCA with a loading of rank K = 60 over D = 80 tokens: masks with few targets take
    the target blocks of the precision, the others the low-rank context side (a spy sees
    both); the score equals numpy's per-mask conditioning (1e-10) and the gradients autograd
    of a per-mask loop in torch (1e-8). Where a token has no loading and a noise variance
    of 1e-12, the bound on the blocks' condition number exceeds the form's tolerance: all
    masks stay on the context side, with the same agreement."""
    import pyro_mpt.conditionals.gaussian_aggregated as aggregated

    calls = {"blocks": 0, "context": 0}
    blocks, context = aggregated.TargetBlockForm.apply, aggregated.LowRankForm.apply

    def spy(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    monkeypatch.setattr(aggregated.TargetBlockForm, "apply", spy("blocks", blocks))
    monkeypatch.setattr(aggregated.LowRankForm, "apply", spy("context", context))
    D, K, N, P = 80, 60, 200, 40
    for split in (True, False):
        calls.update(blocks=0, context=0)
        model, args, names, cov_loc = user_model("fa", D, K, N, seed=11)
        pyro.clear_param_store()
        model(*args)
        if not split:
            pyro.param("W").unconstrained().data[5] = 0.0
            pyro.param("sd").unconstrained().data[5] = math.log(1e-6)
        g = torch.Generator().manual_seed(P)
        mask = torch.rand(P, D, generator=g).argsort(-1) < torch.randint(1, D + 1, (P, 1), generator=g)
        mask[0], mask[1] = True, torch.arange(D) == 2
        weight = torch.rand(P, 1, generator=g, dtype=torch.float64) + 0.5
        loss = MaskedPretrainingLoss(masks=Replay([MaskBlock(mask[:, None], mask.sum(-1, keepdim=True), weight)]))
        coef = weight[:, 0] / mask.sum(-1)
        leaves = [pyro.param(k).unconstrained() for k in names]
        value = loss.differentiable_loss(model, None, *args)
        assert (calls["blocks"] > 0) == split and calls["context"] > 0
        S, loc = cov_loc()
        want = rows_weighted_sum(S.detach(), loc.detach(), args[0], mask, coef).sum()
        assert abs(-float(value) - want) <= 1e-10 * abs(want)
        ref = -torch_weighted_sum(S, torch.zeros(D), args[0] - loc, mask, coef).sum()
        for k, a, b in zip(names, torch.autograd.grad(value, leaves), torch.autograd.grad(ref, leaves)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()), err_msg=k)


def test_target_form_condition_of_non_finite_parameters_is_infinite():
    """A NaN in the loading (a diverged step) keeps every mask on the context side, whose
    handling of it is the engine's as before, instead of stopping in eigvalsh with a LAPACK
    convergence error."""
    from pyro_mpt.conditionals.gaussian_target_form import target_form_condition

    F = torch.randn(20, 5, dtype=torch.float64)
    psi = torch.ones(20, dtype=torch.float64)
    assert target_form_condition(F, psi) == pytest.approx(float((1 + torch.linalg.matrix_norm(F, 2) ** 2) / 1))
    F[3, 2] = float("nan")
    assert target_form_condition(F, psi) == math.inf


def test_target_form_possible_bounds_what_target_form_cheaper_can_choose():
    """target_form_possible (sizes only) is False exactly where no set of P masks could get
    a target block from target_form_cheaper: checked against it with P one-target masks,
    the most any masks can save, over a grid of (P, D, R)."""
    from pyro_mpt.conditionals.gaussian_target_form import target_form_cheaper, target_form_possible

    for P in (1, 10, 100, 512):
        for D in (10, 50, 100, 200, 512):
            for R in (2, 10, 50):
                best = bool(target_form_cheaper(torch.ones(P, dtype=torch.long), D, R).any())
                assert target_form_possible(P, D, R) == best, (P, D, R)


def test_embedded_sums_values_and_gradients_equal_the_loop(monkeypatch):
    """A few masks at a small rank take the per-mask sums over the whole residual table
    (EmbeddedSums, backward pass written out): values against the numpy loop, gradients
    of the loading, noise, location and data against autograd of the torch loop."""
    import pyro_mpt.conditionals.gaussian_embedded as embedded_module

    n, D, R = 40, 10, 2
    F, psi, mu, S, x, mask, coef = problem(n, D, R, P=3, seed=12)
    assert not aggregated_cheaper(n, D, R, masks=3)
    calls = []
    real = embedded_module.EmbeddedSums.forward
    monkeypatch.setattr(embedded_module.EmbeddedSums, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
    F, psi, mu, x = (t.clone().requires_grad_() for t in (F, psi, mu, x))
    u = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = GaussianConditionals().weighted_mask_sum(state_of(F, psi, mu, False), x, mask, coef)
    assert calls
    np.testing.assert_allclose(got.detach().numpy(), numpy_weighted_sum(S, mu.detach(), x.detach(), mask, coef), rtol=1e-10, atol=1e-8)
    grads = torch.autograd.grad((u * got).sum(), (F, psi, mu, x))
    want = torch.autograd.grad((u * torch_weighted_sum(F @ F.T + torch.diag(psi), mu, x, mask, coef)).sum(), (F, psi, mu, x))
    for a, b in zip(grads, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-8 * float(b.abs().max()))


def test_embedded_sums_pass_gradcheck_and_gradgradcheck():
    """EmbeddedSums' written backward pass against finite differences, and its second
    derivatives (the recorded forward pass replayed) against finite differences of it."""
    from pyro_mpt.conditionals.gaussian_embedded import EmbeddedSums

    g = torch.Generator().manual_seed(5)
    D, R, n = 7, 3, 4
    F = torch.randn(D, R, generator=g, dtype=torch.float64)
    psi = 0.3 + torch.rand(D, generator=g, dtype=torch.float64)
    e, zhat = torch.randn(n, D, generator=g, dtype=torch.float64), torch.randn(n, R, generator=g, dtype=torch.float64)
    t = (torch.arange(D) < torch.tensor([[1], [4], [7]])).to(torch.float64)  # one target, some, all
    inputs = tuple(a.clone().requires_grad_() for a in (F, psi, e, zhat, e * e))
    f = lambda *a: EmbeddedSums.apply(*a, t, "x")  # noqa: E731
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_in_place_equals_numpy_and_keeps_the_pivot_check(dtype):
    from pyro_mpt.conditionals.gaussian_linalg import NotPositiveDefinite, cholesky

    g = np.random.default_rng(0)
    A = g.standard_normal((6, 9, 12))
    S = A @ np.swapaxes(A, -1, -2) / 12 + np.eye(9)
    want = np.linalg.cholesky(S)
    # column-major, as DenseForm builds its context blocks: factored in its own storage
    X = torch.tensor(np.swapaxes(S, -1, -2).copy(), dtype=dtype).transpose(-1, -2)
    ptr = X.data_ptr()
    L = cholesky(X, "x", overwrite=True)
    assert L.data_ptr() == ptr
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(torch.tril(L).double().numpy(), want, atol=tol * np.abs(want).max())
    # a row-major one is factored too (through a copy), and a matrix that lost its pivot is refused
    L = cholesky(torch.tensor(S, dtype=dtype), "x", overwrite=True)
    np.testing.assert_allclose(torch.tril(L).double().numpy(), want, atol=tol * np.abs(want).max())
    bad = S.copy()
    bad[2] = np.outer(bad[2][0], bad[2][0]) / bad[2][0, 0]  # rank one
    with pytest.raises(NotPositiveDefinite, match="context covariance"):
        cholesky(torch.tensor(bad, dtype=dtype), "context covariance", overwrite=True)


@pytest.mark.parametrize("d", [5, GRAM_BLOCKED_WIDTH + 21])
def test_quadratic_rows_weighted_gram_equals_numpy(d):
    """QuadraticRows' gradient of A, y^T diag(g) y, made from the column blocks on and above
    the diagonal at widths from GRAM_BLOCKED_WIDTH on (the rest mirrored), against numpy (1e-12)."""
    g = torch.Generator().manual_seed(3)
    y = torch.randn(37, d, generator=g, dtype=torch.float64)
    w = torch.randn(37, generator=g, dtype=torch.float64)
    want = y.numpy().T @ np.diag(w.numpy()) @ y.numpy()
    got = _weighted_gram(y, w)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
