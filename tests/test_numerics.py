"""Numerics: float32 against float64 at D = 512, the jitter rescue, log-space sums, empty contexts and targets."""

import contextlib
import math
import warnings

import numpy as np
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
from pyro_mpt.conditionals.gaussian_lowrank import lowrank_log_prob
from pyro_mpt.observed_tokens import trace_tokens

from models import evidence_case, exact_posterior_guide, make_ppca, make_singular_ppca, score_case


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


# Relative tolerance per datapoint, |f32 - f64| / |f64|: ten times the largest
# value measured over five data/mask seeds with N = 4 and with N = 6 (in
# parentheses), D = 512.
# |log p(x_i)| is about 400 here, so 1e-6 is about 4e-4 nats.
FLOAT32_CASES = {
    # low-rank Woodbury masks, one mask set per datapoint (1.9e-7)
    "gaussian-lowrank": (score_case(lambda: GaussianConditionals(method="lowrank"), "uniform", 8), 2e-6),
    # low-rank masks shared by the batch: the matrix-product path (1.7e-7)
    "gaussian-lowrank-shared": (
        score_case(lambda: GaussianConditionals(method="lowrank"), "uniform", 8, share_masks=True), 2e-6),
    # the chain rule telescopes to the centred low-rank log-density (1.9e-7)
    "gaussian-lowrank-order": (score_case(lambda: GaussianConditionals(method="lowrank"), "order", 1), 3e-6),
    # dense: one Cholesky of the D x D context covariance per query (2.6e-5)
    "gaussian-dense": (score_case(lambda: GaussianConditionals(method="dense"), "uniform", 2), 3e-4),
    # adaptive quadrature; the float32 Newton search stops at a looser tolerance (9.0e-6)
    "quadrature": (score_case(QuadratureConditionals, "uniform", 4), 1e-4),
    # encode-decode, S = 16, T = 2 (1.5e-6)
    "encode_decode": (score_case(lambda: EncodeDecodeConditionals(16, 2), "uniform", 2, guide=True), 2e-5),
    # importance, the prior as proposal, S = 256 (1.3e-5)
    "importance-prior": (score_case(lambda: ImportanceConditionals(256, proposal="prior"), "uniform", 4), 1.5e-4),
    # importance, the guide on imputed data as proposal, S = 64 (1.8e-5)
    "importance-guide": (
        score_case(lambda: ImportanceConditionals(64, proposal="guide"), "uniform", 2, guide=True), 2e-4),
    "evidence-exact": (evidence_case("exact"), 3e-6),  # (1.9e-7)
    "evidence-quadrature": (evidence_case("quadrature"), 1e-6),  # (8.8e-8)
    "evidence-importance": (evidence_case("importance", guide=True, num_samples=100, psis=False), 2e-6),  # (1.5e-7)
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
            pyro.clear_param_store()
            model, x, _ = make_ppca(D512, K2, N4, dtype=dtype)  # drawn in float64 and cast
            pyro.set_rng_seed(1)
            with common_random_numbers():
                value = run(model, exact_posterior_guide, x)
            assert value.dtype == dtype and value.shape == (N4,)
            out[dtype] = value.detach().double()
    rel = ((out[torch.float32] - out[torch.float64]).abs() / out[torch.float64].abs()).max()
    assert float(rel) < tol, (case, float(rel))
    # the comparison is not vacuous: the values are of the size of log p(x_i)
    assert float(out[torch.float64].abs().min()) > 300


def _ppca512_with_missing(dtype):
    """PPCA at D = 512 (K = 2, noise 0.5, N = 4; parameters drawn in float64 and cast)
    with about a quarter of each datapoint's tokens missing (masked observation)."""
    D, K, n = 512, 2, 4
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    mu0 = torch.randn(D, generator=g, dtype=torch.float64)
    z = torch.randn(n, K, generator=g, dtype=torch.float64)
    x = z @ W0.T + mu0 + 0.5 * torch.randn(n, D, generator=g, dtype=torch.float64)
    observed = torch.rand(n, D, generator=g) > 0.25
    W, mu, s = W0.to(dtype), mu0.to(dtype), torch.tensor(0.5, dtype=dtype)

    def model(x, obs_mask):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).mask(obs_mask).to_event(1), obs=x)

    def exact(x):  # float64, one observed sub-vector at a time
        S = W0 @ W0.T + 0.25 * torch.eye(D, dtype=torch.float64)
        return torch.stack([
            torch.distributions.MultivariateNormal(mu0[o], S[o][:, o]).log_prob(xi[o])
            for xi, o in zip(x.double(), observed)
        ])

    return model, x.to(dtype), observed, exact


def test_exact_evidence_with_missing_tokens_is_accurate_in_float32_at_D512():
    """The observed sub-vector's density in the centred low-rank form: float32 agrees
    with float64 within the 3e-6 (relative) that docs/numerics.md states for
    Evidence(method="exact"); the Woodbury form was off by up to 3.6 nats here."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model, x, observed, exact = _ppca512_with_missing(dtype)
        out[dtype] = Evidence(model, method="exact")(x, observed).double()
    truth = exact(x)
    assert float(truth.abs().min()) > 250  # |log p(x_O)| is large: the comparison is not vacuous
    assert float((out[torch.float64] - truth).abs().max()) < 1e-8
    rel = ((out[torch.float32] - out[torch.float64]).abs() / out[torch.float64].abs()).max()
    assert float(rel) < 3e-6, float(rel)


# ---------------------------------------------------------------------- centred low-rank log-density
@pytest.mark.parametrize("rows", [1, 5])
def test_centred_lowrank_log_density_equals_torch_with_gradients(rows):
    g = torch.Generator().manual_seed(3)
    D, R, n = 7, 3, 5
    F = torch.randn(rows, D, R, generator=g, dtype=torch.float64).requires_grad_()
    psi = (0.1 + torch.rand(rows, D, generator=g, dtype=torch.float64)).requires_grad_()
    loc = torch.randn(rows, D, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    ours = lowrank_log_prob(GaussianMarginal(loc, cov_factor=F, cov_diag=psi), x)
    ref = dist.LowRankMultivariateNormal(loc, F, psi).log_prob(x)
    assert ours.shape == (n,)
    assert torch.allclose(ours, ref, atol=1e-11, rtol=0)
    for a, b in zip(torch.autograd.grad(ours.sum(), (F, psi, loc)), torch.autograd.grad(ref.sum(), (F, psi, loc))):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


# ---------------------------------------------------------------------- jitter rescue
@pytest.mark.parametrize("method", ["dense", "lowrank"])
@pytest.mark.parametrize("dtype,noise,first", [(torch.float64, 1e-9, 1e-8), (torch.float32, 1e-9, 1e-8)])
def test_near_singular_covariance_is_rescued_with_a_warning_naming_the_jitter(method, dtype, noise, first):
    """Noise variance 1e-18 against a rank-1 loading: singular even in float64, in
    which the engine computes float32 data that its dtype cannot hold."""
    model, x, W = make_singular_ppca(noise, dtype=dtype)
    with pytest.raises(ValueError, match=r"site 'x' is not positive definite.*even with jitter up to 0 x"):
        MaskedPretrainingLoss(conditionals=GaussianConditionals(method, max_jitter=0.0), masks="all").score(model, None, x)
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="exhaustive")
    name = "float64" + (" \\(computed in float64 for float32 data\\)" if dtype == torch.float32 else "")
    with pytest.warns(NumericalWarning, match=rf"covariance of site 'x' is not positive definite in {name} "
                      r".*added jitter \S+ \(1e-0\d x its mean diagonal") as rec:
        value = loss.score(model, None, x)
    found = [r.message for r in rec if isinstance(r.message, NumericalWarning)]
    w = found[-1]  # each increase of the jitter warns with the total so far
    assert w.site == "x" and f"added jitter {w.jitter:.3g} " in str(w)
    # the ladder is deterministic: `first` x the mean diagonal, then ten times more per
    # retry; its first step already rescues this model, so it warns once
    scale = noise**2 + float(W.pow(2).sum(-1).mean())  # mean diagonal of W W^T + noise^2 I
    assert [f.jitter for f in found] == pytest.approx([first * scale], rel=1e-12 if dtype == torch.float64 else 1e-6)
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
        cov = W @ W.T + (noise**2 + w.jitter) * torch.eye(8, dtype=torch.float64)
        exact = torch.distributions.MultivariateNormal(torch.zeros(8, dtype=torch.float64), cov).log_prob(x)
        assert torch.allclose(value, exact, rtol=1e-9, atol=0)


def test_rescue_also_serves_exact_evidence():
    noise = 1e-9
    model, x, W = make_singular_ppca(noise)
    with pytest.warns(NumericalWarning, match="site 'x'") as rec:
        value = Evidence(model, method="exact")(x)
    (w,) = [r.message for r in rec if isinstance(r.message, NumericalWarning)]
    assert value.shape == (5,)
    # the exact log-density of the jittered model; its covariance has condition number
    # 8e8, so about 9 digits are left (measured 6.4e-10)
    cov = W @ W.T + (noise**2 + w.jitter) * torch.eye(8, dtype=torch.float64)
    exact = torch.distributions.MultivariateNormal(torch.zeros(8, dtype=torch.float64), cov).log_prob(x)
    assert torch.allclose(value, exact, rtol=3e-9, atol=0)
    with pytest.raises(ValueError, match="site 'x' is not positive definite"):
        Evidence(model, method="exact", max_jitter=0.0)(x)


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_jitter_rescue_is_remembered_across_steps_and_warns_once(method):
    """The relative jitter the rescue reached is the starting point of the next
    calls of the same engine: one warning over five loss evaluations (every call
    is counted, whatever the warning filters), and the same value each time."""
    model, x, _ = make_singular_ppca(1e-9)
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        values = [loss.loss(model, None, x) for _ in range(5)]
    found = [r.message for r in rec if issubclass(r.category, NumericalWarning)]
    assert len(found) == 1 and found[0].site == "x"
    assert found[0].jitter > 0 and f"added jitter {found[0].jitter:.3g} " in str(found[0])
    assert values == [values[0]] * 5
    # the value is that of the jittered model, the same as the jitter passed explicitly
    explicit = MaskedPretrainingLoss(
        conditionals=GaussianConditionals(method, jitter=found[0].jitter, max_jitter=0.0), masks="order"
    )
    assert abs(explicit.loss(model, None, x) - values[0]) < 1e-9 * abs(values[0])


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_remembered_jitter_leaves_a_covariance_that_is_well_posed_again(method):
    """The remembered jitter was added whatever the covariance had become: after a step at a
    singular noise (1e-9, rescued with a warning), a noise of 0.1 got the old jitter too, the
    same loss object 0.1 nats off a fresh one, with no warning. Now the covariance as it is is
    factored first: the value equals scipy's and a fresh loss's; back at the singular noise,
    the remembered jitter serves again, with the first value and no second warning."""
    from scipy.stats import multivariate_normal

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g, dtype=torch.float64)
    W = torch.cat([w, w], 1)
    x = torch.randn(5, 1, generator=g, dtype=torch.float64) @ w.T

    def model(x):
        s = pyro.param("s", torch.tensor(1e-9, dtype=torch.float64), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    def set_noise(value):
        pyro.get_param_store()["s"] = torch.tensor(value, dtype=torch.float64)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = loss.loss(model, None, x)
        set_noise(0.1)
        again = loss.loss(model, None, x)
        fresh = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order").loss(model, None, x)
        set_noise(1e-9)
        back = loss.loss(model, None, x)
    ref = -multivariate_normal(np.zeros(8), (W @ W.T).numpy() + 0.01 * np.eye(8)).logpdf(x.numpy()).sum()
    assert abs(again - ref) < 1e-9 * abs(ref) and abs(again - fresh) < 1e-12 * abs(ref)
    assert back == first
    assert len([r for r in rec if issubclass(r.category, NumericalWarning)]) == 1


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
    ev = Evidence(model, exact_posterior_guide, method="importance", num_samples=10, psis=False)(x)
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
        # one grid: the check reads the engine's own table (context grids reduce theirs the same way)
        lambda: QuadratureConditionals(context_grids=False),
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
    chunks = list(state.table.parts()) if hasattr(state, "table") else state.chunks
    logw = torch.cat([c.log_weights for c in chunks], -1)  # (r, S)
    T = torch.cat([c.table for c in chunks], 1)  # (n, S, D)
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
    guide = exact_posterior_guide if uses_guide else None
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
    if name.startswith("gaussian") or name == "quadrature-adaptive":
        # the adaptive engine gives an empty context a grid on the prior, corrected in closed
        # form for Gaussian likelihoods: the exact marginals (a grid on the full posterior
        # alone was 0.6 to 2.1 nats below them)
        assert torch.allclose(full, marginals.expand(2, N), atol=1e-10, rtol=0)
    elif name == "quadrature-prior":
        assert torch.allclose(full, marginals.expand(2, N), atol=5e-4, rtol=0)  # measured 4.5e-5
    elif name == "importance-prior":
        chunks = list(state.table.parts()) if hasattr(state, "table") else state.chunks
        logw = torch.cat([c.log_weights for c in chunks], -1).detach()  # (1 or n, S)
        T = torch.cat([c.table for c in chunks], 1).detach()  # (n, S, D): log p(x_d | z_s)
        # an empty context has normalizer one: each target is the mixture sum_s w_s p(x_j | z_s)
        mixture = torch.logsumexp(logw.unsqueeze(-1) + T, -2).sum(-1)
        assert torch.allclose(full, mixture.expand(2, N), atol=1e-12, rtol=0)
        err = (full[0] - marginals).detach()
        # S prior draws with equal weights: sum_j log(mean_s a_sj) is within 4 Monte Carlo standard
        # errors of sum_j log p(x_j); by the delta method its variance is var_s(sum_j a_sj / abar_j) / S
        assert bool((logw == logw[..., :1]).all())
        a = (T - T.amax(1, keepdim=True)).exp()  # (n, S, D), a shifted p(x_j | z_s)
        g = (a / a.mean(1, keepdim=True)).sum(-1)  # (n, S)
        stderr = g.std(1) / math.sqrt(g.shape[1])
        assert float((err.abs() / stderr).max()) < 4  # measured 1.4
    grads = torch.autograd.grad((full + none).sum(), _params(), allow_unused=True)
    assert any(gr is not None for gr in grads)
    assert all(gr is None or bool(torch.isfinite(gr).all()) for gr in grads)


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("D", [1, 3])
def test_loss_with_full_masks_has_finite_value_and_gradients(name, D):
    """"all", "order" and "exhaustive" include the mask M = D (empty context)."""
    make, uses_guide = ENGINES[name]
    model, x, exact = make_ppca(D, 1, 4)
    guide = exact_posterior_guide if uses_guide else None
    for masks in ["all", "order", "exhaustive"]:
        loss = MaskedPretrainingLoss(conditionals=make(), masks=masks, num_masks=2)
        value = loss.differentiable_loss(model, guide, x)
        assert bool(torch.isfinite(value))
        grads = torch.autograd.grad(value, _params(), allow_unused=True)
        assert all(gr is None or bool(torch.isfinite(gr).all()) for gr in grads), (masks, grads)
        if masks != "all" and (name.startswith("gaussian") or name == "quadrature-adaptive"):
            # exact, whatever the draws; the adaptive mixture telescopes to its (accurate) evidence
            assert abs(float(value) + float(exact(x).sum())) < 1e-9  # measured 2e-15 (quadrature-adaptive)
        if masks != "all" and name == "quadrature-prior":  # the Gauss-Hermite mixture's evidence
            assert abs(float(value) + float(exact(x).sum())) < 5e-3  # measured 4.9e-4 (D = 3)


# ---------------------------------------------------------------------- ill-conditioned low-rank models
def _two_column_ppca(noise, equal, dtype, D=8, N=5, seed=0):
    """PPCA with a loading of two equal columns (rank 1) or two distinct ones, and data
    drawn from the noise-free model; returns the model, the data and the float64
    covariance of the model as the dtype holds it (its parameters rounded to dtype)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D, 2, generator=g, dtype=torch.float64)
    if equal:
        w[:, 1] = w[:, 0]
    x = (torch.randn(N, 2, generator=g, dtype=torch.float64) @ w.T).to(dtype)
    W, s = w.to(dtype), torch.tensor(noise, dtype=dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    cov = W.double() @ W.double().T + float(s) ** 2 * torch.eye(D, dtype=torch.float64)
    return model, x, cov


@pytest.mark.parametrize("path", ["auto", "lowrank", "dense"])
@pytest.mark.parametrize("equal", [True, False], ids=["rank1", "rank2"])
@pytest.mark.parametrize("noise", [1e-3, 1e-4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_noise_two_column_ppca_is_exact_without_jitter(dtype, noise, equal, path):
    """Issue 11 b. Noise variance 1e-6 or 1e-8 against loadings of norm ~3: in float32 the
    engine used to add jitter 15-1500 x the noise variance and move log p by 5.4 and 14.3
    nats per datapoint (rank 1; 21 nats with two distinct columns at 1e-4, through the
    one-token contexts), with only an "added jitter" warning. The low-rank pieces
    (and the dense covariance) are now computed in float64 when float32 cannot hold them:
    exact evidence, the exhaustive and the ordering schedules all equal scipy's log-density
    of the model, as float32 rounds its parameters, to 100 float32 eps (relative; the
    result is stored in float32), or 1e-8 in float64 (measured 2e-9), without a warning."""
    from scipy.stats import multivariate_normal

    model, x, cov = _two_column_ppca(noise, equal, dtype)
    ref = torch.as_tensor(multivariate_normal(torch.zeros(8).numpy(), cov.numpy()).logpdf(x.double().numpy()))
    tol = 100 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 1e-8
    engine = GaussianConditionals(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        values = {
            "exact": Evidence(model, method="exact", path=path)(x),
            "exhaustive": MaskedPretrainingLoss(masks="exhaustive", conditionals=engine).score(model, None, x),
            "order": MaskedPretrainingLoss(masks="order", conditionals=engine).score(model, None, x),
        }
    for name, value in values.items():
        assert value.dtype == dtype, name
        assert torch.allclose(value.double(), ref, rtol=tol, atol=tol * float(ref.abs().max())), name


def test_float32_gradients_through_the_widened_lowrank_path_match_float64():
    """The float64 pieces are computed from the float32 parameters by casts, so gradients
    reach them: the float32 gradient of the exact evidence equals the float64 one (of the
    same parameters and data, rounded to float32: the gradient moves by O(1) with the
    rounding of the data off the loading's span, divided by the noise variance 1e-6) to
    100 float32 eps relative to its largest entry."""
    grads = {}
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(8, 2, generator=g, dtype=torch.float64)
    w0[:, 1] = w0[:, 0]
    x0 = torch.randn(5, 1, generator=g, dtype=torch.float64) @ w0[:, :1].T
    w0, x0 = w0.float().double(), x0.float().double()
    for dtype in (torch.float32, torch.float64):
        pyro.clear_param_store()
        x = x0.to(dtype)

        def model(x):
            W = pyro.param("W", w0.to(dtype))
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
                pyro.sample("x", dist.Normal(z @ W.T, torch.tensor(1e-3, dtype=dtype)).to_event(1), obs=x)

        with warnings.catch_warnings():
            warnings.simplefilter("error", NumericalWarning)
            value = Evidence(model, method="exact")(x).sum()
        (grads[dtype],) = torch.autograd.grad(value, [pyro.param("W").unconstrained()])
    g32, g64 = grads[torch.float32].double(), grads[torch.float64]
    assert bool(torch.isfinite(g32).all())
    assert (g32 - g64).abs().max() <= 100 * torch.finfo(torch.float32).eps * g64.abs().max()


def test_rescue_warning_estimates_its_change_of_log_p():
    """A covariance singular in float64 (rank-1 loading, noise variance 1e-18): the
    warning states the change of log p through the log-determinant, which the closed
    form of the eigenvalues (2|w|^2 + nu, and nu six times) gives here: on the low-rank
    path the bound 0.5 sum_j log(1 + tau / psi_j), at least the true change; on the
    dense path an estimate from below, within a factor 2 of it."""
    noise = 1e-9
    model, x, W = make_singular_ppca(noise)  # D = 8
    nu = noise**2
    for method in ("lowrank", "dense"):
        with pytest.warns(NumericalWarning, match=r"changes log p through its log-determinant by an estimated") as rec:
            MaskedPretrainingLoss(masks="order", conditionals=GaussianConditionals(method)).score(model, None, x)
        (w,) = [r.message for r in rec if isinstance(r.message, NumericalWarning)]
        lam = torch.tensor([float(W.pow(2).sum()) + nu] + [nu] * 7, dtype=torch.float64)
        true = float(0.5 * torch.log1p(w.jitter / lam).sum())
        assert f"an estimated {w.log_prob_change:.3g} nats" in str(w)
        if method == "lowrank":
            # (psi is read back as (nu + tau) - tau: 1e-5 of nu is lost, 1e-5 nats of the bound)
            assert w.log_prob_change == pytest.approx(0.5 * 8 * math.log1p(w.jitter / nu), abs=1e-4)
            assert w.log_prob_change >= true
        else:
            assert true / 2 <= w.log_prob_change <= true


def _digits_ppca(noise, dtype, pixels=None):
    """sklearn's PCA of the digits (8 x 8 pixels, rank 61, or a subset of the pixels) as a
    Pyro PPCA: W = components_.T sqrt(explained_variance_ - noise), mean_, noise scale
    sqrt(noise); ``noise=None`` takes sklearn's noise_variance_ (about 1e-15 or 1e-30
    by version). Returns the model, the first three digits, and the covariance and mean in
    float64 as the dtype holds them."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.decomposition import PCA

    X = load_digits().data
    if pixels is not None:
        X = X[:, pixels]
    rank = int(torch.linalg.matrix_rank(torch.as_tensor(X - X.mean(0))))
    pca = PCA(n_components=rank).fit(X)
    noise = float(pca.noise_variance_) if noise is None else noise
    W = torch.as_tensor(pca.components_.T * (pca.explained_variance_ - noise) ** 0.5).to(dtype)
    mu, s = torch.as_tensor(pca.mean_).to(dtype), torch.tensor(noise**0.5, dtype=dtype)
    x = torch.as_tensor(X[:3]).to(dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(rank, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    cov = W.double() @ W.double().T + float(s) ** 2 * torch.eye(W.shape[0], dtype=torch.float64)
    return model, x, cov, mu.double()


def _mpmath_logpdf(cov, mu, x, dps=40):
    """log N(x_i; mu, cov) in ``dps``-digit arithmetic (mpmath), from one Cholesky factor."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(dps):
        L = mpmath.cholesky(mpmath.matrix(cov.tolist()))
        logdet = 2 * mpmath.fsum(mpmath.log(L[i, i]) for i in range(L.rows))
        out = []
        n = L.rows
        for xi in x.double():
            r, u = (xi - mu).tolist(), []
            for i in range(n):  # forward substitution L u = r
                u.append((r[i] - mpmath.fsum(L[i, k] * u[k] for k in range(i))) / L[i, i])
            maha = mpmath.fsum(ui**2 for ui in u)
            out.append(float(-0.5 * (len(xi) * mpmath.log(2 * mpmath.pi) + logdet + maha)))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("noise", [None, 1e-30], ids=["sklearn", "1e-30"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiny_noise_digits_pca_matches_a_high_precision_reference(dtype, noise):
    """Issue 11 c. With noise variance 1e-30 against the digits' variance (about 18 per
    pixel), the default low-rank path returned -186.2, -172.7, -625.6 (float64) and
    -3e19 (float32) where 40-digit arithmetic gives -94.29, -63.51, -498.15 (this sklearn;
    the issue's sklearn gave other parameters), without a warning: the Woodbury residual
    e / psi divides rounding errors by 1e-30. The engine now sees that the low-rank pieces
    cannot be held even in float64 and takes the dense path (float64 for float32 data),
    which Evidence(method='exact') and the 'order' schedule follow; the values equal the
    mpmath reference to 1e-8 relative in float64 (measured 3e-12) and 100 float32 eps in
    float32 (measured 2e-6: the float32 marginal is derived by differencing locations)."""
    model, x, cov, mu = _digits_ppca(noise, dtype)
    ref = _mpmath_logpdf(cov, mu, x)
    tol = 100 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 1e-8
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        exact = Evidence(model, method="exact")(x)
        order = MaskedPretrainingLoss(masks="order").score(model, None, x)
    for value in (exact, order):
        assert value.dtype == dtype
        assert torch.allclose(value.double(), ref, rtol=tol, atol=0)
    # asking for the low-rank path explicitly: jitter on the noise, with a warning that
    # states its change of log p (a bound, at least the true change)
    with pytest.warns(NumericalWarning, match=r"site 'x' .*an estimated \S+ nats per datapoint") as rec:
        value = Evidence(model, method="exact", path="lowrank")(x)
    (w,) = [r.message for r in rec if isinstance(r.message, NumericalWarning)]
    assert w.log_prob_change >= float((value.double() - ref).abs().max())


def test_tiny_noise_exhaustive_masks_on_twelve_digit_pixels():
    """Issue 11 c on a few tokens: twelve pixels of the digits, one of them always 0 (rank
    11), sklearn's PCA with 11 components and noise variance 1e-30; the exhaustive schedule
    (4096 masks) equals the 40-digit log-density to 1e-8 relative (float64)."""
    pixels = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13]
    model, x, cov, mu = _digits_ppca(1e-30, torch.float64, pixels)
    ref = _mpmath_logpdf(cov, mu, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        value = MaskedPretrainingLoss(masks="exhaustive").score(model, None, x)
    assert torch.allclose(value, ref, rtol=1e-8, atol=0)


@pytest.mark.parametrize("equal", [True, False], ids=["rank1", "rank2"])
@pytest.mark.parametrize("noise", [0.1, 0.06])
def test_float32_lowrank_path_below_the_widening_threshold_is_within_eps_kappa(noise, equal):
    """Below the threshold eps kappa <= 1e-3 (kappa = tr(F^T Psi^-1 F), 2.5e-4 and 7e-4
    here) the low-rank path stays in float32; its error against scipy's log-density of
    the float32-rounded model is then at most eps kappa nats per datapoint, the stated
    tolerance (measured up to 8e-5 nats, 0.12 eps kappa, rank 1 with the 'order' schedule)."""
    from scipy.stats import multivariate_normal

    model, x, cov = _two_column_ppca(noise, equal, torch.float32)
    ref = torch.as_tensor(multivariate_normal(torch.zeros(8).numpy(), cov.numpy()).logpdf(x.double().numpy()))
    tokens = trace_tokens(model, None, (x,), {})
    state = GaussianConditionals("lowrank").prepare(tokens, model, None, (x,), {})
    assert state.data_dtype is None and state.loc.dtype == torch.float32  # not widened
    kappa = float((state.cov_factor.double().pow(2).sum(-1) / state.cov_diag.double()).sum(-1).max())
    bound = torch.finfo(torch.float32).eps * kappa
    assert 1e-4 < bound <= 1e-3
    for masks in ("exhaustive", "order"):
        value = MaskedPretrainingLoss(masks=masks, conditionals=GaussianConditionals("lowrank")).score(model, None, x)
        assert (value.double() - ref).abs().max() <= bound, masks


def test_float32_dense_noise_plus_latents_is_summed_in_float64():
    """A MultivariateNormal observation with a dense scale_tril (smallest noise variance
    about 1e-6) around latents with loadings of norm ~7: W W^T + noise rounded in float32
    is not positive definite, so the float64 path took it rounded and added jitter (7-12
    nats per datapoint, with an "added jitter" warning). The terms are now summed in
    float64: exact evidence, 'order' and 'pll' equal numpy's float64 closed form of the
    float32-rounded model (Rasmussen & Williams 5.10-5.12 for 'pll') to 100 float32 eps
    relative, without a warning; the gradient of 'order' equals autograd of the
    closed-form log-density in float64."""
    import numpy as np
    from models import numpy_leave_one_out

    g = torch.Generator().manual_seed(3)
    N, D, K, s = 4, 60, 5, 1e-3
    W0 = (3.0 * torch.randn(D, K, generator=g, dtype=torch.float64)).float()
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    L0 = torch.linalg.cholesky(0.01 * A @ A.T / D + s**2 * torch.eye(D, dtype=torch.float64)).float()
    x = (torch.randn(N, K, generator=g, dtype=torch.float64) @ W0.double().T
         + (L0.double() @ torch.randn(D, N, generator=g, dtype=torch.float64)).T).float()

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z @ W.T, scale_tril=L0), obs=x)

    W64, L64, x64 = W0.double().numpy(), L0.double().numpy(), x.double().numpy()
    cov = W64 @ W64.T + L64 @ L64.T
    Lc = np.linalg.cholesky(cov)
    sol = np.linalg.solve(Lc, x64.T)
    ref = -0.5 * (sol**2).sum(0) - np.log(np.diag(Lc)).sum() - 0.5 * D * math.log(2 * math.pi)
    pll_ref = numpy_leave_one_out(cov, x64).sum(-1)
    tol = 100 * torch.finfo(torch.float32).eps
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        values = {
            "exact": (Evidence(model, method="exact")(x), ref),
            "order": (MaskedPretrainingLoss(masks="order").score(model, None, x), ref),
            "pll": (MaskedPretrainingLoss(masks="pll").score(model, None, x), pll_ref),
        }
        for name, (value, expected) in values.items():
            assert value.dtype == torch.float32, name
            assert np.abs(value.detach().double().numpy() - expected).max() <= tol * np.abs(expected).max(), name
        loss = MaskedPretrainingLoss(masks="order").differentiable_loss(model, lambda x: None, x)
    (grad,) = torch.autograd.grad(loss, [pyro.param("W").unconstrained()])
    W = W0.double().requires_grad_()
    ref_loss = -torch_mvn.MultivariateNormal(torch.zeros(D, dtype=torch.float64), W @ W.T + L0.double() @ L0.double().T).log_prob(x.double()).sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, [W])
    assert float((grad.double() - ref_grad).abs().max()) <= tol * float(ref_grad.abs().max())


def test_float32_gp_of_600_points_takes_the_scale_tril_in_float64():
    """pyro.contrib.gp's GPRegression in float32, 600 points, noise variance 5e-5: the
    observation is MultivariateNormal(0, scale_tril=T); its float32 covariance T T^T,
    cast to float64, had lost the small noise's digits (Evidence 7-28 times the
    tolerance off the model's log-density, by thread count; 0.06 nats at 1e-4). T is now
    multiplied in float64: Evidence, 'order' and 'pll' equal the float64 closed forms of
    N(0, T T^T) (R&W 5.10-5.12 for 'pll') to 100 float32 eps relative (measured 0.003 of
    it)."""
    import numpy as np
    import pyro.contrib.gp as gp
    from models import numpy_leave_one_out

    pyro.clear_param_store()
    g = torch.Generator().manual_seed(2)
    N, noise = 600, 5e-5
    X = 10 * torch.rand(N, generator=g)
    y = torch.sin(X) + noise**0.5 * torch.randn(N, generator=g)
    kernel = gp.kernels.RBF(1, variance=torch.tensor(1.0), lengthscale=torch.tensor(1.0))
    gpr = gp.models.GPRegression(X, y, kernel, noise=torch.tensor(noise))
    T = pyro.poutine.trace(gpr.model).get_trace().nodes["y"]["fn"].scale_tril.detach().double().numpy()
    cov, yn = T @ T.T, y.double().numpy()
    ref = -0.5 * (np.linalg.solve(T, yn) ** 2).sum() - np.log(np.diag(T)).sum() - 0.5 * N * math.log(2 * math.pi)
    tol = 100 * torch.finfo(torch.float32).eps
    values = {
        "exact": (Evidence(gpr.model, method="exact")(), ref),
        "order": (MaskedPretrainingLoss(masks="order").score(gpr.model, None), ref),
        "pll": (MaskedPretrainingLoss(masks="pll").score(gpr.model, None), numpy_leave_one_out(cov, yn).sum()),
    }
    for name, (value, expected) in values.items():
        assert value.dtype == torch.float32, name
        assert abs(float(value) - expected) <= tol * abs(expected), (name, float(value), expected)


def test_float32_gp_given_its_covariance_matrix_is_scored_as_that_matrix():
    """A float32 GP written with covariance_matrix=K (RBF kernel, noise variance 1e-6): the
    engine took the Cholesky factor T that torch made of K in float32, which had already lost
    the small noise, so N(0, T T^T) was scored (54932 nats off at D = 30, the variance's
    gradient 24 % off at D = 500), with no warning. It now takes K itself, widened: Evidence,
    'order' and 'pll' equal the float64 closed forms of the float32 K (R&W 5.10-5.12 for
    'pll') to 100 float32 eps relative, and the 'order' gradient autograd of that log-density."""
    import numpy as np
    from models import numpy_leave_one_out

    pyro.clear_param_store()
    g = torch.Generator().manual_seed(5)
    D = 30
    X = torch.linspace(0, 3, D)
    y = torch.sin(2 * X) + 1e-3 * torch.randn(D, generator=g)

    def kernel(ls, var, noise):
        K = var * torch.exp(-0.5 * (X[:, None] - X[None, :]) ** 2 / ls**2)
        return K + noise * torch.eye(D, dtype=K.dtype)

    def model(y):
        ls = pyro.param("ls", torch.tensor(0.7), constraint=dist.constraints.positive)
        var = pyro.param("var", torch.tensor(1.3), constraint=dist.constraints.positive)
        noise = pyro.param("noise", torch.tensor(1e-6), constraint=dist.constraints.positive)
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(D), covariance_matrix=kernel(ls, var, noise)), obs=y)

    K = kernel(torch.tensor(0.7), torch.tensor(1.3), torch.tensor(1e-6)).double().numpy()
    yn = y.double().numpy()
    Lc = np.linalg.cholesky(K)
    ref = -0.5 * (np.linalg.solve(Lc, yn) ** 2).sum() - np.log(np.diag(Lc)).sum() - 0.5 * D * math.log(2 * math.pi)
    tol = 100 * torch.finfo(torch.float32).eps
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        values = {
            "exact": (Evidence(model, method="exact")(y), ref),
            "order": (MaskedPretrainingLoss(masks="order").score(model, None, y), ref),
            "pll": (MaskedPretrainingLoss(masks="pll").score(model, None, y), numpy_leave_one_out(K, yn).sum()),
        }
        for name, (value, expected) in values.items():
            assert abs(float(value) - expected) <= tol * abs(expected), (name, float(value), expected)
        loss = MaskedPretrainingLoss(masks="order").differentiable_loss(model, lambda y: None, y)
    params = [pyro.param(k).unconstrained() for k in ("ls", "var", "noise")]
    grads = torch.autograd.grad(loss, params)
    # the reference: K made in float32 from the same params (the model's own rounding), then float64
    cov = kernel(*[pyro.param(k) for k in ("ls", "var", "noise")]).double()
    ref_loss = -torch_mvn.MultivariateNormal(torch.zeros(D, dtype=torch.float64), covariance_matrix=cov).log_prob(y.double())
    ref_grads = torch.autograd.grad(ref_loss, params)
    for a, b in zip(grads, ref_grads):
        assert abs(float(a) - float(b)) <= 1e-4 * max(1.0, abs(float(b))), (float(a), float(b))


def test_tril_inverse_matches_numpy_inverse_batched():
    from pyro_mpt.conditionals.gaussian_linalg import tril_inverse

    rng = np.random.default_rng(3)
    A = rng.standard_normal((4, 3, 6, 6))
    S = A @ np.swapaxes(A, -1, -2) + 6 * np.eye(6)
    L = np.linalg.cholesky(S)
    got = tril_inverse(torch.from_numpy(L)).numpy()
    np.testing.assert_allclose(got, np.linalg.inv(L), rtol=1e-12, atol=1e-13)
    assert np.all(np.triu(got, 1) == 0)


def test_tril_inverse_transposed_matches_numpy_batched():
    """L^-T from the solve from the right, and (L L^T)^-1 = X X^T, against numpy's inverses
    (1e-12), on row-major and column-major batches of factors."""
    from pyro_mpt.conditionals.gaussian_linalg import tril_inverse_transposed

    rng = np.random.default_rng(4)
    A = rng.standard_normal((5, 2, 7, 9))
    S = A @ np.swapaxes(A, -1, -2) + 2 * np.eye(7)
    L = torch.from_numpy(np.linalg.cholesky(S))
    for factor in (L, L.mT.contiguous().mT):
        X = tril_inverse_transposed(factor)
        np.testing.assert_allclose(X.numpy(), np.swapaxes(np.linalg.inv(L.numpy()), -1, -2), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose((X @ X.mT).numpy(), np.linalg.inv(S), rtol=1e-11, atol=1e-12 * np.abs(np.linalg.inv(S)).max())
