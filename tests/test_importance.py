"""Importance-sampled evidence (PSIS diagnostics, minibatch scale, IWAE) and importance conditionals."""

import math
import warnings

import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, ImportanceConditionals, ImportanceSamplingWarning, ImportanceWeightedELBO, MaskedPretrainingLoss
from pyro_mpt.conditionals import EngineNotApplicable, GaussianConditionals, QuadratureConditionals
from pyro_mpt.sites import trace_tokens

from models import exact_posterior_guide, make_ppca


# ---------------------------------------------------------------------- evidence
@pytest.mark.parametrize("S", [1, 2, 17])
def test_exact_posterior_proposal_gives_the_exact_lml_for_any_S(S):
    model, x, exact = make_ppca(6, 2, N=15)
    guide = exact_posterior_guide
    res = Evidence(model, guide, method="importance", num_samples=S, chunk_size=5).estimate(x)
    assert torch.allclose(res.log_evidence, exact(x), atol=1e-6, rtol=0)
    if S >= 2:
        assert float(res.stderr.max()) < 1e-6  # zero-variance proposal
        assert torch.allclose(res.diagnostics["ess"], torch.full((15,), float(S), dtype=torch.float64))


def test_exact_posterior_gives_zero_variance_khat_and_exact_gradients():
    model, x, exact = make_ppca(5, 2, N=8)
    guide = exact_posterior_guide
    res = Evidence(model, guide, method="importance", num_samples=50).estimate(x)
    assert bool((res.diagnostics["khat"] == -math.inf).all())
    params = [pyro.param(k).unconstrained() for k in ("W", "mu", "s")]
    g_is = torch.autograd.grad(res.log_evidence.sum(), params)
    g_ex = torch.autograd.grad(exact(x).sum(), params)
    for a, b in zip(g_is, g_ex):
        assert torch.allclose(a, b, atol=1e-8)


def test_prior_proposal_converges_within_its_standard_error():
    pyro.set_rng_seed(1)
    model, x, exact = make_ppca(3, 2, N=12, sigma=1.0)
    ref = exact(x)
    errs = []
    for S in (500, 20000):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ImportanceSamplingWarning)
            res = Evidence(model, None, method="importance", num_samples=S).estimate(x)
        z = (res.log_evidence - ref) / res.stderr
        assert float(z.abs().max()) < 4.0, (S, z)
        errs.append(float(res.stderr.mean()))
        assert res.diagnostics["proposal"] == "prior"
    # the standard error shrinks like 1 / sqrt(S)
    assert errs[1] == pytest.approx(errs[0] * math.sqrt(500 / 20000), rel=0.3)
    assert float((res.log_evidence - ref).abs().max()) < 0.05


def test_heavy_tailed_weights_warn_with_khat():
    pyro.set_rng_seed(0)
    model, x, exact = make_ppca(20, 2, N=4, sigma=0.3)
    with pytest.warns(ImportanceSamplingWarning, match="k-hat"):
        res = Evidence(model, None, method="importance", num_samples=200).estimate(x)
    assert float(res.diagnostics["khat"].max()) > 0.7
    assert res.diagnostics["khat"].shape == (4,)


def test_minibatch_scale_is_applied_outside_the_log_mean_exp():
    """A subsampled plate: per-datapoint values are unscaled, the loss scales them by N / B."""
    _, x, exact = make_ppca(4, 2, N=40)
    N, B = 40, 8
    idx = torch.arange(8, 16)

    def model(x):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        with pyro.plate("data", N, subsample=idx):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", N, subsample=idx):
            W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
            cov = torch.linalg.inv(torch.eye(2, dtype=x.dtype) + W.T @ W / s**2)
            loc = ((x - mu) @ W / s**2) @ cov
            pyro.sample("z", dist.MultivariateNormal(loc, covariance_matrix=cov))

    xb = x[idx]
    res = Evidence(model, guide, method="importance", num_samples=16).estimate(xb)
    assert torch.allclose(res.log_evidence, exact(xb), atol=1e-6)
    assert torch.allclose(res.diagnostics["scale"], torch.full((B,), N / B, dtype=torch.float64))
    loss = ImportanceWeightedELBO(num_particles=16).differentiable_loss(model, guide, xb)
    assert float(loss) == pytest.approx(-(N / B) * float(exact(xb).sum()), abs=1e-6)


def test_iwae_bound_is_below_the_lml_and_tightens_with_particles():
    pyro.set_rng_seed(0)
    model, x, exact = make_ppca(6, 2, N=30, sigma=0.7)

    def rough_guide(x):  # a poor mean-field proposal
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(torch.zeros(x.shape[0], 2, dtype=x.dtype), 1.0).to_event(1))

    ref = float(exact(x).sum())
    bounds = []
    for K in (1, 64):
        vals = [-ImportanceWeightedELBO(num_particles=K).loss(model, rough_guide, x) for _ in range(5)]
        bounds.append(sum(vals) / len(vals))
    assert bounds[0] < bounds[1] < ref + 1.0


# ---------------------------------------------------------------------- conditionals
def _masks(q, n, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(q, n, D, generator=g) < 0.5
    mask[..., 0] = True  # at least one target
    return mask


def test_prior_importance_conditionals_match_the_gaussian_closed_form_within_stderr():
    pyro.set_rng_seed(0)
    model, x, exact = make_ppca(6, 2, N=6)
    tokens = trace_tokens(model, None, (x,), {})
    gauss = GaussianConditionals()
    ref = gauss.mask_log_prob(gauss.prepare(tokens, model, None, (x,), {}), x, _masks(4, 6, 6))
    engine = ImportanceConditionals(20000, proposal="prior")
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = _masks(4, 6, 6)
    out = engine.mask_log_prob(state, x, mask)
    diag = engine.last_diagnostics
    assert diag["ess"].shape == (4, 6) and diag["stderr"].shape == (4, 6, 6)
    z = ((out - ref) / diag["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z
    assert float(z.pow(2).mean()) < 2.0  # the standard errors are calibrated
    # fewer context tokens, more effective samples
    n_ctx = (~mask).sum(-1).double()
    assert torch.corrcoef(torch.stack([n_ctx.flatten(), diag["ess"].log().flatten()]))[0, 1] < -0.5


def test_guide_importance_conditionals_match_the_closed_form_within_stderr():
    pyro.set_rng_seed(0)
    model, x, exact = make_ppca(6, 2, N=5)
    guide = exact_posterior_guide
    tokens = trace_tokens(model, guide, (x,), {})
    mask = _masks(3, 5, 6, seed=1)
    gauss = GaussianConditionals()
    ref = gauss.mask_log_prob(gauss.prepare(tokens, model, None, (x,), {}), x, mask)
    engine = ImportanceConditionals(4000, proposal="guide", num_chains=8, num_iterations=3)
    state = engine.prepare(tokens, model, guide, (x,), {})
    assert state.imputed and state.runner.data.key == 0
    out = engine.mask_log_prob(state, x, mask)
    diag = engine.last_diagnostics
    z = ((out - ref) / diag["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z
    assert float((out - ref)[mask].abs().max()) < 0.25
    assert float(diag["ess"].min()) > 20


def test_prior_draws_form_one_joint_so_the_chain_rule_and_exhaustive_sum_telescope():
    """With prior draws all conditionals come from one mixture: Proposition 1 holds exactly."""
    pyro.set_rng_seed(0)
    model, x, exact = make_ppca(5, 2, N=4)
    tokens = trace_tokens(model, None, (x,), {})
    engine = ImportanceConditionals(300, proposal="prior")
    state = engine.prepare(tokens, model, None, (x,), {})
    lml = engine.log_evidence(state, x)
    order = torch.stack([torch.randperm(5) for _ in range(3)])[:, None, :]
    chain = engine.chain_log_prob(state, x, order).sum(-1)  # (3, n)
    assert torch.allclose(chain, lml.expand(3, 4), atol=1e-9)
    assert engine.last_diagnostics["ess"].shape == (3, 4, 5)
    # the exhaustive Proposition-1 sum through the mask path agrees too
    loss = MaskedPretrainingLoss(conditionals=engine, masks="exhaustive")
    est = loss._estimate(loss.schedule, tokens, engine, state)
    assert torch.allclose(est, lml, atol=1e-9)


def test_importance_serves_nonlinear_models_beyond_quadrature_in_auto_and_trains():
    pyro.set_rng_seed(0)
    D, K, N = 8, 6, 20
    x = torch.randint(0, 2, (N, D)).double()

    def model(x):
        W = pyro.param("W", 0.3 * torch.randn(D, K, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=torch.tanh(z) @ W.T).to_event(1), obs=x)

    loss = MaskedPretrainingLoss(masks="uniform")  # conditionals="auto"
    tokens, engine, state = loss._prepare(model, None, (x,), {})
    assert isinstance(engine, ImportanceConditionals) and state.proposal == "prior"
    opt = pyro.optim.Adam({"lr": 0.05})
    svi = pyro.infer.SVI(model, lambda x: None, opt, loss)
    before = pyro.param("W").detach().clone()
    for _ in range(5):
        value = svi.step(x)
    assert math.isfinite(value)
    assert not torch.equal(before, pyro.param("W").detach())


def test_importance_errors_name_the_site():
    model, x, exact = make_ppca(4, 2, N=5)

    def global_model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(4, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(w, 1.0).to_event(1), obs=x)

    with pytest.raises(ValueError, match="'w'.*global latent"):
        Evidence(global_model, None, method="importance", num_samples=4)(x)

    def mvn_model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(4, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z, torch.eye(4, dtype=x.dtype)), obs=x)

    tokens = trace_tokens(mvn_model, None, (x,), {})
    with pytest.raises(EngineNotApplicable, match="'x'.*independent given the latents"):
        ImportanceConditionals(8).prepare(tokens, mvn_model, None, (x,), {})
    # the evidence needs no factorization
    assert Evidence(mvn_model, None, method="importance", num_samples=8, psis=False)(x).shape == (5,)
    with pytest.raises(ValueError, match="unknown option"):
        Evidence(model, None, method="importance", num_sample=8)(x)


def test_several_latent_sites_match_the_closed_form_within_stderr():
    """Two latent sites, the second depending on the first: importance vs Gaussian closed form."""
    pyro.set_rng_seed(0)
    D, N = 5, 6
    g = torch.Generator().manual_seed(0)
    W1, W2 = torch.randn(D, 2, generator=g, dtype=torch.float64), torch.randn(D, 1, generator=g, dtype=torch.float64)
    A = torch.randn(1, 2, generator=g, dtype=torch.float64)
    z1 = torch.randn(N, 2, generator=g, dtype=torch.float64)
    z2 = z1 @ A.T + 0.5 * torch.randn(N, 1, generator=g, dtype=torch.float64)
    x = z1 @ W1.T + z2 @ W2.T + 0.8 * torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z1 = pyro.sample("z1", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
            z2 = pyro.sample("z2", dist.Normal(z1 @ A.T, 0.5).to_event(1))
            pyro.sample("x", dist.Normal(z1 @ W1.T + z2 @ W2.T, 0.8).to_event(1), obs=x)

    tokens = trace_tokens(model, None, (x,), {})
    mask = _masks(3, N, D, seed=2)
    gauss = GaussianConditionals()
    ref = gauss.mask_log_prob(gauss.prepare(tokens, model, None, (x,), {}), x, mask)
    engine = ImportanceConditionals(20000, proposal="prior")
    out = engine.mask_log_prob(engine.prepare(tokens, model, None, (x,), {}), x, mask)
    z = ((out - ref) / engine.last_diagnostics["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z
    res = Evidence(model, None, method="importance", num_samples=20000).estimate(x)
    ex = Evidence(model, None, method="exact")(x)
    assert float(((res.log_evidence - ex) / res.stderr).abs().max()) < 4.5


def test_latents_in_an_extra_plate_are_summed_per_datapoint():
    """z[k, i] in a plate over k inside the data plate; orthogonal loadings make the exact
    posterior factorize over k, so an exact guide in the same plates gives log p(x) exactly."""
    D, K, N, s = 6, 3, 7, 0.6
    g = torch.Generator().manual_seed(0)
    W = torch.linalg.qr(torch.randn(D, K, generator=g, dtype=torch.float64))[0] * torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0], dim=-1):
            with pyro.plate("k", K, dim=-2):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))  # (K, n)
            loc = torch.einsum("dk,...kn->...nd", W, z).unsqueeze(-3)  # keep dim -3 for particles
            pyro.sample("x", dist.Normal(loc, s).to_event(1), obs=x)

    def guide(x):
        prec = 1.0 + (W**2).sum(0) / s**2  # (K,)
        loc = (x @ W / s**2 / prec).T  # (K, n)
        with pyro.plate("data", x.shape[0], dim=-1):
            with pyro.plate("k", K, dim=-2):
                pyro.sample("z", dist.Normal(loc, prec.rsqrt()[:, None]))

    exact = torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), W @ W.T + s**2 * torch.eye(D, dtype=torch.float64)).log_prob(x)
    res = Evidence(model, guide, method="importance", num_samples=5).estimate(x)
    assert torch.allclose(res.log_evidence, exact, atol=1e-6)


def test_integer_tokens_match_quadrature_within_stderr():
    """Poisson counts given a 2-d latent: importance (prior) vs a fine quadrature grid."""
    pyro.set_rng_seed(0)
    D, K, N = 6, 2, 5
    g = torch.Generator().manual_seed(0)
    W = 0.5 * torch.randn(D, K, generator=g, dtype=torch.float64)
    z = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = torch.poisson(torch.exp(z @ W.T + 0.5), generator=g).long()

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(z @ W.T + 0.5)).to_event(1), obs=x)

    tokens = trace_tokens(model, None, (x,), {})
    mask = _masks(3, N, D, seed=3)
    quad = QuadratureConditionals(120)  # converged to ~1e-4 (40 nodes are off by 1e-2)
    ref = quad.mask_log_prob(quad.prepare(tokens, model, None, (x,), {}), tokens.value, mask)
    engine = ImportanceConditionals(20000, proposal="prior")
    out = engine.mask_log_prob(engine.prepare(tokens, model, None, (x,), {}), tokens.value, mask)
    z = ((out - ref) / engine.last_diagnostics["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z
