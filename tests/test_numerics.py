"""Numerics: float32 against float64 at D = 512, the jitter rescue, log-space sums, empty contexts and targets."""

import contextlib
import warnings

import pytest
import torch
import torch.distributions.multivariate_normal as torch_mvn
import torch.distributions.normal as torch_normal
import pyro
import pyro.distributions as dist

from pyro_mpt import (
    EncodeDecodeConditionals,
    Evidence,
    GaussianConditionals,
    ImportanceConditionals,
    MaskedPretrainingLoss,
    NumericalWarning,
    QuadratureConditionals,
)
from pyro_mpt.conditionals import GaussianMarginal
from pyro_mpt.conditionals.gaussian import _lowrank_log_prob
from pyro_mpt.sites import trace_tokens

from models import make_ppca
from test_importance import exact_posterior_guide


pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def common_random_numbers():
    """Draw every Normal / MultivariateNormal variate in float64 and cast it.

    float32 and float64 draw different streams from one seed; with this the
    float32 run gets the float64 run's draws rounded to float32, so the two
    runs differ by rounding only. ``Normal.sample`` (used to impute tokens) is
    routed through ``rsample`` for the same reason.
    """

    def standard_normal(shape, dtype, device):
        return torch.randn(shape, dtype=torch.float64, device=device).to(dtype)

    def sample(self, sample_shape=torch.Size()):
        with torch.no_grad():
            return self.rsample(sample_shape)

    saved = torch_normal._standard_normal, torch_mvn._standard_normal, torch_normal.Normal.sample
    torch_normal._standard_normal = torch_mvn._standard_normal = standard_normal
    torch_normal.Normal.sample = sample
    try:
        yield
    finally:
        torch_normal._standard_normal, torch_mvn._standard_normal, torch_normal.Normal.sample = saved


# ---------------------------------------------------------------------- float32 vs float64
D512, K2, N4 = 512, 2, 4


def _ppca512(dtype, seed=0):
    """PPCA at D = 512 with parameters drawn in float64 and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D512, K2, generator=g, dtype=torch.float64)
    mu0 = torch.randn(D512, generator=g, dtype=torch.float64)
    z = torch.randn(N4, K2, generator=g, dtype=torch.float64)
    x = z @ W0.T + mu0 + 0.5 * torch.randn(N4, D512, generator=g, dtype=torch.float64)
    W, mu, s = W0.to(dtype), mu0.to(dtype), torch.tensor(0.5, dtype=dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K2, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    def guide(x):  # the exact posterior
        cov = torch.linalg.inv(torch.eye(K2, dtype=dtype) + W.T @ W / s**2)
        loc = ((x - mu) @ W / s**2) @ cov
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.MultivariateNormal(loc, covariance_matrix=cov))

    return model, guide, x.to(dtype)


def _score(engine, masks, num_masks, guide=True, **kw):
    def run(model, g, x):
        loss = MaskedPretrainingLoss(conditionals=engine(), masks=masks, num_masks=num_masks, **kw)
        return loss.score(model, g if guide else None, x)

    return run


def _evidence(method, guide=False, **options):
    def run(model, g, x):
        return Evidence(model, g if guide else None, method=method, **options)(x)

    return run


# Relative tolerance per datapoint, |f32 - f64| / |f64|: ten times the largest
# value measured over five data/mask seeds with N = 4 and with N = 6 (in
# parentheses), D = 512.
# |log p(x_i)| is about 400 here, so 1e-6 is about 4e-4 nats.
FLOAT32_CASES = {
    # low-rank Woodbury masks, one mask set per datapoint (1.9e-7)
    "gaussian-lowrank": (_score(lambda: GaussianConditionals(method="lowrank"), "uniform", 8), 2e-6),
    # low-rank masks shared by the batch: the matrix-product path (1.7e-7)
    "gaussian-lowrank-shared": (
        _score(lambda: GaussianConditionals(method="lowrank"), "uniform", 8, share_masks=True), 2e-6),
    # the chain rule telescopes to the centred low-rank log-density (2.1e-7)
    "gaussian-lowrank-order": (_score(lambda: GaussianConditionals(method="lowrank"), "order", 1), 3e-6),
    # dense: one Cholesky of the D x D context covariance per query (2.6e-5)
    "gaussian-dense": (_score(lambda: GaussianConditionals(method="dense"), "uniform", 2), 3e-4),
    # adaptive quadrature; the float32 Newton search stops at a looser tolerance (9.0e-6)
    "quadrature": (_score(QuadratureConditionals, "uniform", 4), 1e-4),
    # encode-decode, S = 16, T = 2 (1.5e-6)
    "encode_decode": (_score(lambda: EncodeDecodeConditionals(16, 2), "uniform", 2), 2e-5),
    # importance, the prior as proposal, S = 256 (1.3e-5)
    "importance-prior": (_score(lambda: ImportanceConditionals(256, proposal="prior"), "uniform", 4), 1.5e-4),
    # importance, the guide on imputed data as proposal, S = 64 (1.8e-5)
    "importance-guide": (_score(lambda: ImportanceConditionals(64, proposal="guide"), "uniform", 2), 2e-4),
    "evidence-exact": (_evidence("exact"), 3e-6),  # (2.1e-7)
    "evidence-quadrature": (_evidence("quadrature"), 1e-6),  # (8.8e-8)
    "evidence-importance": (_evidence("importance", guide=True, num_samples=100, psis=False), 2e-6),  # (1.5e-7)
}


@pytest.mark.parametrize("case", list(FLOAT32_CASES))
def test_float32_agrees_with_float64_at_D512(case):
    """Same parameters (cast), same data, same masks and (common) random draws:
    float32 and float64 estimates of log p(x_i) agree to the stated relative tolerance."""
    run, tol = FLOAT32_CASES[case]
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)  # no rescue on a well-posed model
        for dtype in (torch.float32, torch.float64):
            model, guide, x = _ppca512(dtype)
            pyro.set_rng_seed(1)
            with common_random_numbers():
                value = run(model, guide, x)
            assert value.dtype == dtype and value.shape == (N4,)
            out[dtype] = value.detach().double()
    rel = ((out[torch.float32] - out[torch.float64]).abs() / out[torch.float64].abs()).max()
    assert float(rel) < tol, (case, float(rel))
    # the comparison is not vacuous: the values are of the size of log p(x_i)
    assert float(out[torch.float64].abs().min()) > 300


# ---------------------------------------------------------------------- centred low-rank log-density
@pytest.mark.parametrize("rows", [1, 5])
def test_centred_lowrank_log_density_equals_torch_with_gradients(rows):
    g = torch.Generator().manual_seed(3)
    D, R, n = 7, 3, 5
    F = torch.randn(rows, D, R, generator=g, dtype=torch.float64).requires_grad_()
    psi = (0.1 + torch.rand(rows, D, generator=g, dtype=torch.float64)).requires_grad_()
    loc = torch.randn(rows, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    ours = _lowrank_log_prob(GaussianMarginal(loc, cov_factor=F, cov_diag=psi), x)
    ref = dist.LowRankMultivariateNormal(loc, F, psi).log_prob(x)
    assert ours.shape == (n,)
    assert torch.allclose(ours, ref, atol=1e-11, rtol=0)
    for a, b in zip(torch.autograd.grad(ours.sum(), (F, psi, loc)), torch.autograd.grad(ref.sum(), (F, psi, loc))):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


# ---------------------------------------------------------------------- jitter rescue
def _singular_ppca(noise, dtype=torch.float64, D=8, N=5):
    """PPCA whose loading has two equal columns (rank 1) and a tiny noise scale:
    its covariance W W^T + noise^2 I is singular to working precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, 1, generator=g, dtype=torch.float64)
    W = torch.cat([w, w], 1).to(dtype)
    x = (torch.randn(N, 1, generator=g, dtype=torch.float64) @ w.T).to(dtype)
    s = torch.tensor(noise, dtype=dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    return model, x


@pytest.mark.parametrize("method", ["dense", "lowrank"])
@pytest.mark.parametrize("dtype,noise,first", [(torch.float64, 1e-9, 1e-8), (torch.float32, 1e-5, 1e-5)])
def test_near_singular_covariance_is_rescued_with_a_warning_naming_the_jitter(method, dtype, noise, first):
    model, x = _singular_ppca(noise, dtype)
    with pytest.raises(ValueError, match=r"site 'x' is not positive definite.*even with jitter up to 0 x"):
        MaskedPretrainingLoss(conditionals=GaussianConditionals(method, max_jitter=0.0), masks="all").score(model, None, x)
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="exhaustive")
    name = str(dtype).replace("torch.", "")
    with pytest.warns(NumericalWarning, match=rf"covariance of site 'x' is not positive definite in {name} "
                      r".*added jitter \S+ \(1e-0\d x its mean diagonal") as rec:
        value = loss.score(model, None, x)
    found = [r.message for r in rec if isinstance(r.message, NumericalWarning)]
    w = found[-1]  # each increase of the jitter warns with the total so far
    assert all(a.jitter < b.jitter for a, b in zip(found, found[1:]))
    assert w.site == "x" and f"added jitter {w.jitter:.3g} " in str(w)
    g = torch.Generator().manual_seed(0)
    wcol = torch.randn(8, 1, generator=g, dtype=torch.float64)
    scale = noise**2 + 2 * float(wcol.pow(2).mean())  # mean diagonal of W W^T + noise^2 I
    assert first * scale * 0.999 <= w.jitter <= 1e-4 * scale * 1.001
    assert bool(torch.isfinite(value).all())
    # the same jitter added explicitly gives the same number, without a rescue
    explicit = MaskedPretrainingLoss(
        conditionals=GaussianConditionals(method, jitter=w.jitter, max_jitter=0.0), masks="exhaustive"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        expected = explicit.score(model, None, x)
    assert torch.allclose(value, expected, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    # and the exhaustive sum is the exact log-density of the jittered model
    if dtype == torch.float64:
        W = torch.cat([wcol, wcol], 1)
        cov = W @ W.T + (noise**2 + w.jitter) * torch.eye(8, dtype=torch.float64)
        exact = torch.distributions.MultivariateNormal(torch.zeros(8, dtype=torch.float64), cov).log_prob(x)
        assert torch.allclose(value, exact, rtol=1e-9, atol=0)


def test_rescue_also_serves_exact_evidence():
    model, x = _singular_ppca(1e-9)
    with pytest.warns(NumericalWarning, match="site 'x'"):
        value = Evidence(model, method="exact")(x)
    assert value.shape == (5,) and bool(torch.isfinite(value).all())
    with pytest.raises(ValueError, match="site 'x' is not positive definite"):
        Evidence(model, method="exact", max_jitter=0.0)(x)


# ---------------------------------------------------------------------- log space
def test_sharp_gaussian_beyond_exp_overflow_quadrature_and_importance_stay_exact():
    """sigma = 1e-3 at D = 512: log p(x_i) is about +2800, so exp(log p) overflows
    float64 (max about e^709); the quadrature conditionals and the importance
    evidence (exact posterior as proposal) still match the closed form."""
    model, x, exact = make_ppca(512, 1, 4, sigma=1e-3)
    truth = exact(x)
    assert float(truth.min()) > 2000
    tokens = trace_tokens(model, None, (x,), {})
    gauss, quad = GaussianConditionals(), QuadratureConditionals()
    gs, qs = gauss.prepare(tokens, model, None, (x,), {}), quad.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 4, 512, generator=g) < torch.tensor([0.1, 0.3, 0.5])[:, None, None]
    ref = gauss.mask_log_prob(gs, x, mask)
    out = quad.mask_log_prob(qs, x, mask)
    assert float((out - ref)[mask].abs().max()) < 1e-5  # measured 8.3e-7
    assert float((quad.log_evidence(qs, x) - truth).abs().max()) < 1e-6  # measured 1.1e-7
    ev = Evidence(model, exact_posterior_guide(1), method="importance", num_samples=10, psis=False)(x)
    assert float((ev - truth).abs().max()) < 1e-6  # measured 1.1e-7


def _far_bernoulli(D=512, K=2, N=4):
    """Bernoulli tokens whose every latent value predicts ones (logits 10 + z W^T)
    for coin-flip data: each draw's log-likelihood is about -2400, far below
    log(tiny) = -745, so weights computed by exp would all underflow to 0."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    A = torch.randn(D, K, generator=g, dtype=torch.float64) / D
    x = torch.bernoulli(torch.full((N, D), 0.5, dtype=torch.float64), generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=10 + z @ W.T).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x @ A, 1.0).to_event(1))

    return model, guide, x


@pytest.mark.parametrize(
    "engine",
    [
        lambda: ImportanceConditionals(64, proposal="prior"),
        lambda: QuadratureConditionals(),
        lambda: QuadratureConditionals(8, adaptive=False, min_ess=None),
    ],
    ids=["importance-prior", "quadrature-adaptive", "quadrature-prior"],
)
def test_tabled_engines_sum_weights_in_log_space_where_exp_underflows(engine):
    """The table engines sum weights by shifted exp-space matrix products with an
    exact log-sum-exp fallback; they agree with a plain torch.logsumexp over
    the same table although every unshifted weight underflows."""
    model, _, x = _far_bernoulli()
    N, D = x.shape
    tokens = trace_tokens(model, None, (x,), {})
    eng = engine()
    state = eng.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 1, D, generator=g) < torch.tensor([0.1, 0.5, 0.9])[:, None, None]
    out = eng.mask_log_prob(state, x, mask)
    chunks = [state.chunk] if hasattr(state, "chunk") else state.chunks
    logw = torch.cat([c.logw for c in chunks], -1)  # (r, S)
    T = torch.cat([c.T for c in chunks], 1)  # (n, S, D)
    ctx = (~mask).to(T.dtype).expand(3, N, D)
    base = logw[None] + torch.einsum("nsd,qnd->qns", T, ctx)  # (q, n, S)
    ref = torch.logsumexp(base.unsqueeze(-1) + T, -2) - torch.logsumexp(base, -1).unsqueeze(-1)
    assert float(base.amax(-1).min()) < -745  # exp(base) is 0 in float64 for every draw
    assert bool(torch.isfinite(out).all())
    assert float((out - ref).abs().max()) < 1e-9  # measured 1.8e-12


@pytest.mark.parametrize("engine", ["encode_decode", "importance-guide"])
def test_sampling_engines_stay_finite_where_exp_underflows(engine):
    model, guide, x = _far_bernoulli()
    eng = EncodeDecodeConditionals(8, 2) if engine == "encode_decode" else ImportanceConditionals(32, proposal="guide")
    tokens = trace_tokens(model, guide, (x,), {})
    state = eng.prepare(tokens, model, guide, (x,), {})
    mask = torch.rand(2, 4, 512) < 0.5
    out = eng.mask_log_prob(state, x, mask)
    assert bool(torch.isfinite(out).all()) and float(out.max()) <= 0.0  # Bernoulli log-probabilities
    lw = eng.log_evidence(state, x)
    assert bool(torch.isfinite(lw).all()) and float(lw.max()) < -745


# ---------------------------------------------------------------------- empty contexts and targets
ENGINES = {
    "gaussian-lowrank": (lambda: GaussianConditionals(method="lowrank"), False),
    "gaussian-dense": (lambda: GaussianConditionals(method="dense"), False),
    "quadrature-adaptive": (lambda: QuadratureConditionals(), False),
    "quadrature-prior": (lambda: QuadratureConditionals(adaptive=False), False),
    "encode_decode": (lambda: EncodeDecodeConditionals(8, 2), True),
    "importance-prior": (lambda: ImportanceConditionals(64, proposal="prior"), False),
    "importance-guide": (lambda: ImportanceConditionals(32, proposal="guide"), True),
}


def _params():
    return [pyro.param(k).unconstrained() for k in ("W", "mu", "s")]


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("rows", [4, 1])
def test_empty_context_and_empty_target_masks_give_finite_values_and_gradients(name, rows):
    make, uses_guide = ENGINES[name]
    D, N = 3, 4
    model, x, _ = make_ppca(D, 2, N)
    guide = exact_posterior_guide(2) if uses_guide else None
    tokens = trace_tokens(model, guide, (x,), {})
    eng = make()
    state = eng.prepare(tokens, model, guide, (x,), {})
    everything = torch.ones(2, rows, D, dtype=torch.bool)  # M = D: no context
    nothing = torch.zeros(2, rows, D, dtype=torch.bool)  # no target
    full = eng.mask_sums(state, x, everything)
    none = eng.mask_sums(state, x, nothing)
    assert full.shape == none.shape == (2, N)
    assert bool(torch.isfinite(full).all()) and bool(torch.isfinite(eng.mask_log_prob(state, x, everything)).all())
    assert bool(torch.isfinite(eng.mask_log_prob(state, x, nothing)).all())
    assert bool((none == 0).all())
    W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
    marginals = dist.Normal(mu, (W.pow(2).sum(-1) + s**2).sqrt()).log_prob(x).sum(-1)  # sum_j log p(x_j)
    if name.startswith("gaussian"):
        assert torch.allclose(full, marginals.expand(2, N), atol=1e-10, rtol=0)
    elif name == "quadrature-prior":
        assert torch.allclose(full, marginals.expand(2, N), atol=5e-4, rtol=0)  # measured 4.5e-5
    grads = torch.autograd.grad((full + none).sum(), _params(), allow_unused=True)
    assert any(gr is not None for gr in grads)
    assert all(gr is None or bool(torch.isfinite(gr).all()) for gr in grads)


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("D", [1, 3])
def test_loss_with_full_masks_has_finite_value_and_gradients(name, D):
    """"all", "order" and "exhaustive" include the mask M = D (empty context)."""
    make, uses_guide = ENGINES[name]
    model, x, exact = make_ppca(D, 1, 4)
    guide = exact_posterior_guide(1) if uses_guide else None
    for masks in ["all", "order", "exhaustive"]:
        loss = MaskedPretrainingLoss(conditionals=make(), masks=masks, num_masks=2)
        value = loss.differentiable_loss(model, guide, x)
        assert bool(torch.isfinite(value))
        grads = torch.autograd.grad(value, _params(), allow_unused=True)
        assert all(gr is None or bool(torch.isfinite(gr).all()) for gr in grads), (masks, grads)
        if masks != "all" and name.startswith("gaussian"):  # exact, whatever the draws
            assert abs(float(value) + float(exact(x).sum())) < 1e-9
        if masks != "all" and name == "quadrature-prior":  # the Gauss-Hermite mixture's evidence
            assert abs(float(value) + float(exact(x).sum())) < 5e-3  # measured 4.9e-4 (D = 3)
