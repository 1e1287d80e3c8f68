"""Importance-sampled evidence (PSIS diagnostics, minibatch scale, IWAE) and importance conditionals."""

import math
import warnings

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, ImportanceConditionals, ImportanceSamplingWarning, ImportanceWeightedELBO, MaskedPretrainingLoss
from pyro_mpt.conditionals import EngineNotApplicable, GaussianConditionals, QuadratureConditionals
from pyro_mpt.observed_tokens import trace_tokens

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


@pytest.mark.parametrize("bad", [dict(num_particles=0), dict(num_particles=2.5), dict(chunk_size=-1), dict(chunk_size=0)])
def test_iwae_and_importance_evidence_counts_are_checked(bad):
    """num_particles=0 / chunk_size=0 ended in "range() arg 3 must not be zero", chunk_size=-1
    in torch.cat's error, num_particles=2.5 in a TypeError; now messages that name the option.
    Valid counts, numpy ones too, give the exact LML with the exact posterior as proposal
    (vs torch's dense MultivariateNormal, 1e-8)."""
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=rf"ImportanceWeightedELBO\({name}={value}\): give a positive integer"):
        ImportanceWeightedELBO(**bad)
    model, x, exact = make_ppca(4, 2, N=6)
    if name == "chunk_size":
        with pytest.raises(ValueError, match=rf"Evidence\(method='importance', chunk_size={value}\): give a positive integer"):
            Evidence(model, exact_posterior_guide, method="importance", num_samples=5, chunk_size=value)(x)
    iwae = ImportanceWeightedELBO(num_particles=np.int64(5), chunk_size=np.int64(2))
    assert abs(iwae.loss(model, exact_posterior_guide, x) + float(exact(x).sum())) < 1e-8
    got = Evidence(model, exact_posterior_guide, method="importance", num_samples=5, chunk_size=np.int64(2))(x)
    assert float((got - exact(x)).abs().max()) < 1e-8


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
    out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
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
    out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
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
    chain, diag = engine.chain_log_prob_and_diagnostics(state, x, order)
    chain = chain.sum(-1)  # (3, n)
    assert torch.allclose(chain, lml.expand(3, 4), atol=1e-9)
    assert diag["ess"].shape == (3, 4, 5)
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
    with pytest.raises(ValueError, match="takes no option.*'num_sample'.*did you mean num_samples="):
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
    out, diag = engine.mask_log_prob_and_diagnostics(engine.prepare(tokens, model, None, (x,), {}), x, mask)
    z = ((out - ref) / diag["stderr"])[mask]
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
    out, diag = engine.mask_log_prob_and_diagnostics(engine.prepare(tokens, model, None, (x,), {}), tokens.value, mask)
    z = ((out - ref) / diag["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z


# ---------------------------------------------------------------------- issue 11: proposals and diagnostics
def _mixture(N=200, seed=0):
    """A 3-component mixture with a discrete latent c, its data, and log p(x_i) by enumeration (scipy)."""
    import numpy as np
    from scipy.special import logsumexp
    from scipy.stats import norm

    pi = np.array([0.5, 0.3, 0.2])
    mus = np.array([[-2.0, 0.0, 1.0, 2.0], [1.0, 1.0, -1.0, 0.0], [3.0, -2.0, 0.0, 1.0]])
    rng = np.random.default_rng(seed)
    c = rng.choice(3, N, p=pi)
    x = mus[c] + rng.standard_normal((N, 4))
    exact = logsumexp(np.log(pi) + norm.logpdf(x[:, None, :], mus[None], 1.0).sum(-1), axis=1)
    P, M = torch.tensor(pi), torch.tensor(mus)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(P))
            pyro.sample("x", dist.Normal(M[c], 1.0).to_event(1), obs=x)

    return model, torch.tensor(x), torch.tensor(exact)


def test_discrete_latent_prior_proposal_gives_no_false_alarm_and_covers_the_enumerated_lml():
    """Tied weights (3 distinct values) have no Pareto tail: k-hat is undefined (NaN), the
    ESS decides, and no warning fires; the estimates match scipy's enumeration."""
    model, x, exact = _mixture()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportanceSamplingWarning)
        res = Evidence(model, None, method="importance", num_samples=1000).estimate(x)
        loss = MaskedPretrainingLoss(conditionals=ImportanceConditionals(1000, proposal="prior"), masks="order")
        score = loss.score(model, None, x)
    assert bool(res.diagnostics["khat"].isnan().all())
    assert float(res.diagnostics["ess"].min()) > 100
    z = (res.log_evidence - exact) / res.stderr
    assert float(z.abs().max()) < 4.0
    assert float((z.abs() < 2).double().mean()) > 0.9
    # orderings with prior draws telescope to the same kind of estimate
    assert float(((score.detach() - exact) / res.stderr).abs().max()) < 5.0


def test_khat_is_undefined_for_too_few_draws_but_equal_weights_stay_minus_inf():
    from pyro_mpt.importance_weights import psis_khat

    g = torch.Generator().manual_seed(0)
    lw = torch.randn(20, 3, generator=g, dtype=torch.float64)  # S <= 20: a tail of 4 draws
    lw[:, 2] = 1.5
    khat, smoothed = psis_khat(lw)
    assert bool(khat[:2].isnan().all()) and float(khat[2]) == -math.inf
    assert torch.allclose(smoothed, lw, rtol=0, atol=1e-14)  # nothing is smoothed without a fit
    heavy = torch.distributions.Pareto(1.0, 0.5).sample((2000, 2)).log().double()  # tail index 2: k = 2
    k, _ = psis_khat(heavy)
    assert bool((k > 1.0).all())


def test_one_draw_is_judged_by_its_effective_samples():
    """num_samples=1: one weight is no evidence of equal weights, so k-hat is undefined
    (NaN) and its one effective sample warns, as 2-9 draws do. Before, it counted as an
    exact proposal (k-hat -inf) and the estimate, its standard error NaN, was silent."""
    from pyro_mpt.importance_weights import psis_khat

    assert bool(psis_khat(torch.zeros(1, 3, dtype=torch.float64))[0].isnan().all())
    model, x, _ = make_ppca(D=4, K=2, N=5)
    for S in (1, 2):
        with pytest.warns(ImportanceSamplingWarning, match="effective samples"):
            Evidence(model, method="importance", num_samples=S).estimate(x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pareto_smoothing_matches_arviz_psislw():
    """psis_khat's k-hat and smoothed log-weights (written in torch) against arviz.psislw
    (normalize=False) to 1e-12, float64: light and heavy tails, large offsets, S = 30, and
    columns whose tail is shortened by weights tied at the cutoff (a tail length of their own)."""
    import warnings

    import arviz as az
    from pyro_mpt.importance_weights import psis_khat

    g = torch.Generator().manual_seed(0)
    tied = torch.randn(500, 3, generator=g, dtype=torch.float64)
    for c, ties in enumerate((2, 5)):  # the (M + 1)-th largest weight and the ones below it equal
        col = tied[:, c].sort().values
        tied[:, c] = torch.cat([col[: 500 - 68 - ties], col[500 - 68 - 1].expand(ties), col[500 - 68 :]])
    cases = [
        2 * torch.randn(1000, 7, generator=g, dtype=torch.float64),
        torch.distributions.Pareto(1.0, 0.5).sample((2000, 3)).log().double(),  # k = 2
        torch.randn(30, 4, generator=g, dtype=torch.float64),
        5 * torch.randn(4000, 3, generator=g, dtype=torch.float64) + 300,
        tied,
    ]
    for lw in cases:
        khat, smoothed = psis_khat(lw)
        top = lw.amax(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_smoothed, ref_k = az.psislw((lw - top).T.numpy(), normalize=False)
        ref_k = torch.as_tensor(ref_k, dtype=torch.float64).reshape(-1)
        assert torch.allclose(khat, ref_k, rtol=1e-12, atol=1e-12), (khat, ref_k)
        assert torch.allclose(smoothed, torch.as_tensor(ref_smoothed).T + top, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pareto_smoothing_of_zero_weights_float32_and_fits_in_groups_matches_arviz(monkeypatch):
    """psis_khat against arviz.psislw (normalize=False) where some draws have weight zero
    (-inf log-weights: 30 % of a column, or all but 10 draws, then k-hat is NaN and nothing
    is smoothed), for float32 log-weights (to float32's rounding), and with the tail fits
    made in groups of 7 columns (FIT_ELEMENTS) instead of all at once: float64 to 1e-12."""
    import warnings

    import arviz as az
    from pyro_mpt import importance_weights
    from pyro_mpt.importance_weights import psis_khat

    g = torch.Generator().manual_seed(3)
    zero = 2 * torch.randn(1000, 3, generator=g, dtype=torch.float64)
    zero[:300, 0] = -math.inf
    zero[:990, 1] = -math.inf
    many = torch.randn(400, 50, generator=g, dtype=torch.float64) * torch.linspace(0.5, 4.0, 50, dtype=torch.float64)
    light = (2 * torch.randn(1000, 3, generator=g)).float()
    for lw, grouped in ((zero, False), (light, False), (many, False), (many, True)):
        if grouped:  # a tail of 60 draws and a grid of 37 values: 7 columns a group
            monkeypatch.setattr(importance_weights, "FIT_ELEMENTS", 7 * 37 * 60)
        khat, smoothed = psis_khat(lw)
        ref = lw.double()
        top = ref.amax(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_smoothed, ref_k = az.psislw((ref - top).T.numpy(), normalize=False)
        ref_k = torch.as_tensor(ref_k, dtype=torch.float64).reshape(-1)
        ref_smoothed = torch.as_tensor(ref_smoothed).T + top
        tol = 1e-12 if lw.dtype == torch.float64 else 1e-5
        if lw is zero:  # too few distinct weights in column 1's tail: undefined, the raw weights kept
            assert bool(khat[1].isnan()) and torch.allclose(smoothed[:, 1], lw[:, 1], rtol=0, atol=1e-14)
            khat, smoothed, ref_k, ref_smoothed = khat[0::2], smoothed[:, 0::2], ref_k[0::2], ref_smoothed[:, 0::2]
            assert torch.equal(smoothed.isinf(), ref_smoothed.isinf())
            smoothed, ref_smoothed = smoothed.nan_to_num(neginf=0.0), ref_smoothed.nan_to_num(neginf=0.0)
        assert torch.allclose(khat.double(), ref_k, rtol=tol, atol=tol), (khat, ref_k)
        assert torch.allclose(smoothed.double(), ref_smoothed, rtol=tol, atol=tol)


def test_importance_sampling_imports_no_arviz():
    """The k-hat of an importance-sampling loss and of Evidence(method='importance') is fitted
    without arviz, whose import took 1.3 s of CPU on the first call; a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pyro, pyro.distributions as dist\n"
        "from pyro_mpt import MaskedPretrainingLoss, Evidence\n"
        "x = torch.randn(20, 6)\n"
        "def model(x):\n"
        "    with pyro.plate('data', 20):\n"
        "        z = pyro.sample('z', dist.Normal(0., 1.).expand([6]).to_event(1))\n"
        "        pyro.sample('x', dist.Normal(z.tanh(), 0.5).to_event(1), obs=x)\n"
        "loss = MaskedPretrainingLoss(conditionals='importance', num_samples=100)\n"
        "loss.loss(model, None, x)\n"
        "r = Evidence(model, method='importance', num_samples=100).estimate(x)\n"
        "assert bool(torch.isfinite(r.diagnostics['khat']).all())\n"
        "print('arviz' if 'arviz' in sys.modules else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean"


def _pyromodule_ppca(D, K, sigma, N, seed=0):
    from pyro.nn import PyroModule, PyroParam

    class PPCA(PyroModule):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.W = PyroParam(torch.randn(D, K, generator=g, dtype=torch.float64))
            self.mu = PyroParam(torch.randn(D, generator=g, dtype=torch.float64))
            self.s = PyroParam(torch.tensor(sigma, dtype=torch.float64), constraint=dist.constraints.positive)

        def forward(self, x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
                pyro.sample("x", dist.Normal(z @ self.W.T + self.mu, self.s).to_event(1), obs=x)

    m = PPCA()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        x = torch.randn(N, K, generator=g, dtype=torch.float64) @ m.W.T + m.mu
        x = x + sigma * torch.randn(N, D, generator=g, dtype=torch.float64)
    return m, x


def test_importance_engine_warns_once_when_prior_draws_miss_the_posterior():
    """PyroModule PPCA, 20 tokens, noise 0.1: 4096 prior draws are off by nats; one warning
    per engine, with k-hat on the state, on the warning and in the returned diagnostics."""
    m, x = _pyromodule_ppca(20, 2, 0.1, N=6)
    exact = Evidence(m, method="exact")(x).detach()
    engine = ImportanceConditionals(4096, proposal="prior")
    loss = MaskedPretrainingLoss(conditionals=engine, masks="order", num_masks=3, chunk_size=6 * 20)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        score = loss.score(m, None, x).detach()
    found = [w for w in rec if issubclass(w.category, ImportanceSamplingWarning)]
    assert len(found) == 1, [str(w.message) for w in rec]
    assert "k-hat > 0.7" in str(found[0].message)
    assert float((score - exact).abs().max()) > 0.5  # the estimate is indeed off
    warning = found[0].message
    assert float(warning.khat.nan_to_num(-1).max()) > 0.7 and warning.ess.shape == (6,)
    # the orderings' diagnostics come back with their terms, k-hat per datapoint; the engine
    # said it once (a warning per evaluation flooded training loops: 152 in 225 SVI steps)
    tokens, _, state = loss._prepare(m, None, (x,), {})
    order = torch.stack([torch.randperm(20) for _ in range(3)])[:, None, :]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportanceSamplingWarning)
        _, diag = engine.chain_log_prob_and_diagnostics(state, tokens.value, order)
    assert diag["khat"].shape == (6,)
    # the state carries the whole evaluation's diagnostics, and the engine counts them
    tokens, _, state = loss._prepare(m, None, (x,), {})
    engine.mask_log_prob(state, tokens.value, _masks(4, 6, 20))
    assert state.warned and float(state.diagnostics["khat"].max()) > 0.7
    assert state.diagnostics["ess"].shape == (6,)
    assert engine.poor_weight_evaluations == 3
    # a new engine says it again
    fresh = ImportanceConditionals(4096, proposal="prior")
    with pytest.warns(ImportanceSamplingWarning):
        MaskedPretrainingLoss(conditionals=fresh, masks="order", num_masks=3).score(m, None, x)


def test_importance_engine_is_silent_when_the_prior_is_a_good_proposal():
    m, x = _pyromodule_ppca(3, 1, 2.0, N=6)
    exact = Evidence(m, method="exact")(x).detach()
    engine = ImportanceConditionals(4096, proposal="prior")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportanceSamplingWarning)
        score = MaskedPretrainingLoss(conditionals=engine, masks="order").score(m, None, x).detach()
        tokens = trace_tokens(m, None, (x,), {})
        state = engine.prepare(tokens, m, None, (x,), {})
        engine.mask_log_prob(state, tokens.value, _masks(4, 6, 3))
    assert float(state.diagnostics["khat"].max()) < 0.5
    res = Evidence(m, method="importance", num_samples=4096).estimate(x)
    assert float(((score - exact) / res.stderr).abs().max()) < 4.5


def _delta_guide(x):
    with pyro.plate("data", x.shape[0]):
        pyro.sample("z", dist.Delta(torch.zeros(x.shape[0], 2, dtype=x.dtype)).to_event(1))


def _tiny_scale_guide(x):
    # a Normal whose scale vanishes below float64 rounding: a point mass in all but name
    with pyro.plate("data", x.shape[0]):
        pyro.sample("z", dist.Normal(torch.ones(x.shape[0], 2, dtype=x.dtype), 1e-300).to_event(1))


@pytest.mark.parametrize("kind", ["autodelta", "delta", "tiny_scale"])
def test_point_mass_proposals_are_refused(kind):
    from pyro.infer.autoguide import AutoDelta

    model, x, exact = make_ppca(6, 2, N=10)
    guide = {"autodelta": AutoDelta(model), "delta": _delta_guide, "tiny_scale": _tiny_scale_guide}[kind]
    with pytest.raises(ValueError, match="guide site 'z'.*point mass at 10 of 10.*AutoNormal.*method='exact'"):
        Evidence(model, guide, method="importance", num_samples=100)(x)
    with pytest.raises(ValueError, match="point mass.*conditionals='gaussian'"):
        MaskedPretrainingLoss(conditionals="importance").loss(model, guide, x)
    with pytest.raises(ValueError, match="point mass.*Trace_ELBO"):
        ImportanceWeightedELBO(4).loss(model, guide, x)
    # the prior proposal does not read the guide
    res = Evidence(model, guide, method="importance", num_samples=4000, proposal="prior").estimate(x)
    assert float(((res.log_evidence - exact(x)) / res.stderr).abs().max()) < 4.5


def test_a_guide_with_a_density_is_accepted_and_a_one_hot_discrete_guide_is_refused():
    from pyro.infer.autoguide import AutoNormal

    model, x, exact = make_ppca(4, 2, N=8, sigma=1.0)
    guide = AutoNormal(model, init_scale=1.0)
    res = Evidence(model, guide, method="importance", num_samples=4000).estimate(x)
    assert float(((res.log_evidence - exact(x)) / res.stderr).abs().max()) < 4.5
    mix, xm, exact_m = _mixture(N=6)
    P = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)

    def one_hot(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(P.expand(x.shape[0], 3)))

    with pytest.raises(ValueError, match="guide site 'c' \\(Categorical\\) is a point mass at 6 of 6"):
        Evidence(mix, one_hot, method="importance", num_samples=50)(xm)

    def spread(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).expand(x.shape[0], 3)))

    res = Evidence(mix, spread, method="importance", num_samples=2000).estimate(xm)
    assert float(((res.log_evidence - exact_m) / res.stderr).abs().max()) < 4.0


def _renamed_guide(x):
    with pyro.plate("data", x.shape[0]):
        pyro.sample("zz", dist.Normal(torch.zeros(x.shape[0], 2, dtype=x.dtype), 1.0).to_event(1))


@pytest.mark.parametrize("conditionals", ["auto", "gaussian", "importance"])
def test_a_guide_whose_names_miss_the_model_warns(conditionals):
    model, x, exact = make_ppca(5, 2, N=6)
    loss = MaskedPretrainingLoss(conditionals=conditionals, masks="order")
    with pytest.warns(UserWarning, match="not in the model: 'zz'; model latent\\(s\\) the guide does not sample: 'z'"):
        value = loss.score(model, _renamed_guide, x)
    assert value.shape == (6,)
    with pytest.warns(UserWarning, match="does not match the model"), pytest.raises(ValueError, match="'zz'"):
        Evidence(model, _renamed_guide, method="importance", num_samples=10)(x)


def test_the_guide_check_runs_only_with_pyro_validation():
    """Like Pyro's check_model_guide_match, the guide check is a per-step validation: off
    under pyro.validation_enabled(False). The Gaussian engine ignores the guide, so the
    score is the exact log p(x_i) either way."""
    model, x, exact = make_ppca(5, 2, N=6)
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    with pytest.warns(UserWarning, match="does not match the model"):
        on = loss.score(model, _renamed_guide, x)
    with pyro.validation_enabled(False), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        off = loss.score(model, _renamed_guide, x)
    assert not [w for w in rec if "does not match the model" in str(w.message)]
    ref = exact(x)  # the closed-form MultivariateNormal marginal
    assert torch.allclose(on, ref, atol=1e-8) and torch.allclose(off, ref, atol=1e-8)


def test_a_partial_guide_warns_and_matching_or_no_op_guides_do_not():
    from pyro.infer.autoguide import AutoNormal

    def model(x):
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Normal(torch.zeros(1, dtype=x.dtype), 1.0).to_event(1))
            b = pyro.sample("b", dist.Normal(a, 1.0).to_event(1))
            pyro.sample("x", dist.Normal(a + b, 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    def partial(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("a", dist.Normal(torch.zeros(x.shape[0], 1, dtype=x.dtype), 1.0).to_event(1))

    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="not in the model: none; model latent\\(s\\) the guide does not sample: 'b'"):
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, partial, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, lambda x: None, x)
        MaskedPretrainingLoss(conditionals="gaussian").loss(model, AutoNormal(model), x)


@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_self_normalized_conditionals_match_logsumexp_in_value_and_gradient(spread):
    """Also with log-weights hundreds of nats apart (spread 300), where most exponents lie
    below exp's underflow and are taken as 0 from ``exp_floor`` on."""
    from pyro_mpt.conditionals.importance_self_normalized import self_normalized_conditionals

    g = torch.Generator().manual_seed(0)
    S, q, n, D = 9, 2, 3, 5
    lw0 = (spread * torch.randn(S, q, n, generator=g, dtype=torch.float64)).requires_grad_()
    T = (-3 * torch.rand(S, q, n, D, generator=g, dtype=torch.float64)).requires_grad_()
    ctx = (torch.rand(q, n, D, generator=g) < 0.5).double()
    G = torch.randn(q, n, D, generator=g, dtype=torch.float64)
    out, lw, omega, pi2, pi_omega = self_normalized_conditionals(lw0, T, ctx)
    grads = torch.autograd.grad((out * G).sum(), (lw0, T))
    # reference: the estimator written out with autograd through logsumexp, and the
    # diagnostics' sums by a loop over draws
    lw_ref = lw0 + (T * ctx).sum(-1)
    ref = torch.logsumexp(lw_ref.unsqueeze(-1) + T, 0) - torch.logsumexp(lw_ref, 0).unsqueeze(-1)
    ref_grads = torch.autograd.grad((ref * G).sum(), (lw0, T))
    w = torch.softmax(lw_ref.detach(), 0)
    p = torch.softmax(lw_ref.detach().unsqueeze(-1) + T.detach(), 0)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    # the weights' rounding is that of log-weights of size ~ spread
    tol = 1e-14 * spread
    assert torch.allclose(omega, w, rtol=0, atol=tol)
    assert torch.allclose(pi2, sum(p[s] ** 2 for s in range(S)), rtol=0, atol=tol)
    assert torch.allclose(pi_omega, sum(p[s] * w[s].unsqueeze(-1) for s in range(S)), rtol=0, atol=tol)


def test_iwelbo_warns_on_guide_draws_without_rsample_and_its_value_stays_exact(float64):
    """A Categorical guide site has no rsample: the bound's gradient misses its score-function
    term (biased, as with Pyro's RenyiELBO), which was silent; now one UserWarning names the
    site. The value is unchanged: with the exact posterior over the assignment as the guide,
    every weight is p(x_i), so the loss is -sum_i log p(x_i) of the two-component mixture
    (scipy log-sum-exp). A reparameterized guide gives no warning."""
    import numpy as np
    from scipy.special import logsumexp
    from scipy.stats import norm

    w = torch.tensor([0.3, 0.7])
    locs = torch.tensor([-1.0, 1.5])
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    joint = np.log(w.numpy())[None] + norm(locs.numpy()[None, None], 1.0).logpdf(x.numpy()[..., None]).sum(1)
    evidence = logsumexp(joint, 1)
    posterior = torch.as_tensor(np.exp(joint - evidence[:, None]))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(w))
            pyro.sample("x", dist.Normal(locs[c][..., None].expand(c.shape + (3,)), 1.0).to_event(1), obs=x)

    logits = posterior.log().requires_grad_()

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(logits=logits))

    iwelbo = ImportanceWeightedELBO(num_particles=4)
    with pytest.warns(UserWarning, match=r"guide site\(s\) 'c' \(Categorical\) have no reparameterized sampler"):
        loss = iwelbo.differentiable_loss(model, guide, x)
    assert float(loss) == pytest.approx(-evidence.sum(), abs=1e-10)
    # with the guide's probabilities fixed there is no guide gradient to bias: no warning
    def fixed_guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(posterior))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fixed = ImportanceWeightedELBO(num_particles=4).differentiable_loss(model, fixed_guide, x)
    assert float(fixed) == pytest.approx(-evidence.sum(), abs=1e-10)

    def normal_model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z[..., None].expand(z.shape + (3,)), 1.0).to_event(1), obs=x)

    def normal_guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x.mean(-1), 0.5))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ImportanceWeightedELBO(num_particles=4).differentiable_loss(normal_model, normal_guide, x)


def test_evidence_importance_warns_once_where_a_guide_draw_has_no_rsample(float64):
    """Evidence(method="importance") differentiated through a Categorical guide site misses the
    draws' score-function term, so the guide's gradient is biased: at S = 1 and a uniform guide
    the computed gradient averages 0 over 400 seeds (within 4 standard errors) while the
    gradient of the objective E_q[log p(x, c) - log q(c)] (numpy, summed over c) is 0.2-0.5 per
    logit. The estimator now names the site once (a UserWarning), not under torch.no_grad();
    the value is the mixture's evidence (scipy) with the exact posterior as the guide."""
    import numpy as np
    from scipy.special import logsumexp
    from scipy.stats import norm

    w = np.array([0.3, 0.7])
    locs = torch.tensor([-1.0, 1.5])
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    joint = np.log(w)[None] + norm(locs.numpy()[None, None], 1.0).logpdf(x.numpy()[..., None]).sum(1)
    evidence = logsumexp(joint, 1)
    logits = torch.tensor(joint - evidence[:, None]).requires_grad_()

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.tensor(w)))
            pyro.sample("x", dist.Normal(locs[c][..., None].expand(c.shape + (3,)), 1.0).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(logits=logits))

    est = Evidence(model, guide, method="importance", num_samples=8, psis=False)
    with pytest.warns(UserWarning, match=r"Evidence\(method='importance'\): guide site\(s\) 'c' \(Categorical\)"):
        value = est(x)
    np.testing.assert_allclose(value.detach().numpy(), evidence, atol=1e-10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        est(x)  # once per estimator
        with torch.no_grad():
            Evidence(model, guide, method="importance", num_samples=8, psis=False)(x)
    # the bias the warning is about, at S = 1 and a uniform guide q: the objective
    # E_q[log p(x, c) - log q(c)] has the gradient (diag(q) - q q^T)(log p(x, c) - log q(c) - 1)
    # (numpy, summed over c), but the computed gradient -d log q(c)/d logits has expectation 0
    q = np.full(2, 0.5)
    b = joint - np.log(q)[None] - 1
    expected = (b * q[None] - q[None] * (b * q[None]).sum(1, keepdims=True))
    assert np.abs(expected).max() > 0.1
    uniform = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)

    def uniform_guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(logits=uniform))

    pyro.set_rng_seed(0)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(400):
            (g,) = torch.autograd.grad(
                Evidence(model, uniform_guide, method="importance", num_samples=1, psis=False)(x).sum(), uniform
            )
            grads.append(g.numpy())
    grads = np.stack(grads)
    se = grads.std(0) / np.sqrt(len(grads))
    assert np.all(np.abs(grads.mean(0)) < 4 * se)
    assert np.all(np.abs(grads.mean(0) - expected) > 4 * se)


class _PerQuery(ImportanceConditionals):
    """The engine without its leave-one-out table: the "pll" queries take mask_log_prob."""

    def leave_one_out_log_prob(self, state, x):
        return None


@pytest.mark.parametrize("proposal", ["prior", "autoguide"])
def test_pll_from_the_draws_one_table_equals_the_per_query_path(proposal, monkeypatch):
    """"pll" on Poisson tokens with a 2-D latent (D = 60, N = 12, 256 draws, the same seed): the
    leave-one-out table (no mask_log_prob call; D = 400, N = 50: 4.2 -> 0.95 s a step) gives
    the per-query path's loss and gradient to 1e-12 / 1e-10, and the same weights warning
    (k-hat and effective samples of each datapoint's worst query); with an AutoNormal guide's
    draws as the proposal too."""
    from pyro.infer.autoguide import AutoNormal

    D, N = 60, 12
    g = torch.Generator().manual_seed(4)
    W0 = 0.3 * torch.randn(D, 2, generator=g, dtype=torch.float64)
    x = torch.poisson(torch.exp(torch.randn(N, 2, generator=g, dtype=torch.float64) @ W0.T), generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Poisson((z @ W.T).exp()).to_event(1), obs=x)

    calls = []
    original = ImportanceConditionals.mask_log_prob
    monkeypatch.setattr(ImportanceConditionals, "mask_log_prob",
                        lambda self, *a: calls.append(1) or original(self, *a))
    results = []
    for cls in (ImportanceConditionals, _PerQuery):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model, init_scale=0.5) if proposal == "autoguide" else None
        if guide is not None:
            guide(x)  # its parameters, made before the draws
        engine = cls(256, proposal="guide" if guide is not None else "prior")
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            value = MaskedPretrainingLoss(masks="pll", conditionals=engine).differentiable_loss(model, guide, x)
        (grad,) = torch.autograd.grad(value, [pyro.param("W").unconstrained()])
        messages = [str(w.message) for w in rec if issubclass(w.category, ImportanceSamplingWarning)]
        results.append((value.item(), grad, messages, len(calls)))
    (v, gr, m, c), (v_b, gr_b, m_b, c_b) = results
    assert c == 0 and c_b > 0
    assert abs(v - v_b) < 1e-12 * abs(v_b)
    assert torch.allclose(gr, gr_b, rtol=1e-10, atol=1e-12)
    assert m == m_b and (len(m) == 1 if proposal == "prior" else True)  # 256 prior draws miss the posteriors


def test_guide_draws_outside_the_prior_support_get_weight_zero(float64):
    """A Normal guide for a Gamma latent draws negative rates: there the prior density is 0, so
    the draw's importance weight is 0. Before, with Pyro's validation off, the Poisson at a
    negative rate made the estimate, its standard error, the ESS and k-hat NaN, without a
    warning. (With validation on, the trace of the data at the guide's one draw fails with
    Pyro's rate-constraint error where that draw is negative, as Trace_ELBO does.) Reference:
    the Poisson-Gamma closed form (scipy's gammaln); within 4 standard errors."""
    validation = False
    from scipy.special import gammaln

    a, b, D = 2.0, 1.5, 4
    x = torch.tensor([[1.0, 2.0, 0.0, 3.0], [2.0, 2.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            rate = pyro.sample("rate", dist.Gamma(a, b))
            pyro.sample("x", dist.Poisson(rate.unsqueeze(-1).expand(rate.shape + (D,))).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("rate", dist.Normal(torch.ones(x.shape[0]), 0.6))  # about 5% of draws below 0

    s = x.sum(1).numpy()
    ref = a * np.log(b) - gammaln(a) + gammaln(a + s) - (a + s) * np.log(b + D) - gammaln(x.numpy() + 1).sum(1)
    pyro.set_rng_seed(0)
    with pyro.validation_enabled(validation):
        result = Evidence(model, guide, method="importance", num_samples=4000).estimate(x)
    value, stderr = result.log_evidence.numpy(), result.stderr.numpy()
    assert np.isfinite(value).all() and np.isfinite(stderr).all() and (stderr > 0).all()
    assert np.abs((value - ref) / stderr).max() < 4
    assert torch.isfinite(result.diagnostics["ess"]).all() and torch.isfinite(result.diagnostics["khat"]).all()


def test_a_support_that_depends_on_a_latent(float64):
    """x_j ~ Uniform(0, z), z ~ Uniform(0, 1): the trace checks the data at its one draw of z,
    which can exclude valid data; the message says so and how to skip the check (before, it
    blamed the data alone). With validation off, prior draws whose support excludes the data
    get density 0 and the estimate is within 4 standard errors of the closed form
    log((m^-2 - 1) / 2), m the largest token."""
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Uniform(0.0, 1.0))
            hi = z.unsqueeze(-1).expand(z.shape + (3,))
            pyro.sample("x", dist.Uniform(torch.zeros_like(hi), hi).to_event(1), obs=x)

    pyro.set_rng_seed(0)
    with pytest.raises(ValueError, match=r"If a latent sets the bounds .* pyro.validation_enabled\(False\) skips this check"):
        Evidence(model, method="importance")(torch.tensor([[0.1, 0.5, 0.999]]))
    x = torch.tensor([[0.1, 0.5, 0.6], [0.2, 0.3, 0.1]])
    m = x.max(1).values.numpy()
    ref = np.log((m**-2.0 - 1) / 2)
    pyro.set_rng_seed(0)
    with pyro.validation_enabled(False):
        result = Evidence(model, method="importance", num_samples=20000).estimate(x)
    assert np.abs((result.log_evidence.numpy() - ref) / result.stderr.numpy()).max() < 4


@pytest.mark.filterwarnings("ignore::pyro_mpt.ImportanceSamplingWarning")
def test_the_guide_on_the_original_data_is_defended_by_prior_draws(float64):
    """``impute=False`` (as when the guide's data argument cannot be found, e.g. a minibatch):
    the exact posterior given all tokens as proposal for every context, in the defensive
    mixture with the prior. Without the prior's share the weights had no finite variance
    and exhaustive MPT of PPCA overstated log p(x) by about a nat a datapoint (-35.3 at 512
    draws, -37.9 at 8192, for an exact -45.1 over 10 datapoints). Now within 0.25 nats of the
    closed form over two seeds of 4096 draws."""
    pyro.clear_param_store()
    model, x, exact = make_ppca(4, 1, 10, seed=4)
    want = float(exact(x).sum())
    got = []
    for seed in range(2):
        pyro.set_rng_seed(seed)
        loss = MaskedPretrainingLoss(conditionals="importance", masks="exhaustive", num_samples=4096, impute=False)
        got.append(float(loss.score(model, exact_posterior_guide, x).sum()))
    assert abs(np.mean(got) - want) < 0.25


@pytest.mark.filterwarnings("ignore::pyro_mpt.ImportanceSamplingWarning")
def test_a_guide_without_its_data_argument_is_said_once_at_info(float64, caplog):
    """A model and guide that do not take the data as an argument (here a closure over it):
    the engine runs the guide on the original data, which it says once, at INFO on the
    'pyro_mpt' logger (it was silent), and the estimate stays within 1 nat of the closed form."""
    import logging

    pyro.clear_param_store()
    model, x, exact = make_ppca(4, 1, 10, seed=4)

    def closed_model(n):
        model(x)

    def closed_guide(n):
        exact_posterior_guide(x)

    loss = MaskedPretrainingLoss(conditionals="importance", masks="exhaustive", num_samples=2048)
    with caplog.at_level(logging.INFO, logger="pyro_mpt"):
        values = [float(loss.score(closed_model, closed_guide, 10).sum()) for _ in range(2)]
    said = [r for r in caplog.records if "runs the guide on the original data" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert abs(np.mean(values) - float(exact(x).sum())) < 1.0


def test_prior_draws_of_a_discrete_latent_carry_its_weights_gradient():
    """A mixture of Poissons scored by prior importance sampling: the sampled class has no
    reparameterization, so the mixing logits got no gradient at all (0 for -129), and SVI left
    the weights at their start. The draws now carry it by the score function (a term of value
    0): with 4000 draws the gradient is within 2 % of autograd of the exact log-likelihood,
    and the value is unchanged."""
    g = torch.Generator().manual_seed(0)
    N, D = 300, 5
    rates = torch.tensor([1.0, 6.0], dtype=torch.float64)
    c = (torch.rand(N, generator=g) < 0.9).long()
    x = torch.poisson(rates[c].unsqueeze(-1).expand(N, D), generator=g)

    def model(x):
        logits = pyro.param("logits", torch.zeros(2, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            k = pyro.sample("k", dist.Categorical(logits=logits))
            pyro.sample("x", dist.Poisson(rates[k].unsqueeze(-1).expand(k.shape + (D,))).to_event(1), obs=x)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    score = MaskedPretrainingLoss(conditionals=ImportanceConditionals(4000, proposal="prior"), masks="order").score(
        model, None, x).sum()
    logits = pyro.param("logits").unconstrained()
    (got,) = torch.autograd.grad(score, [logits])
    ref_logits = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    per_class = dist.Poisson(rates[:, None, None]).log_prob(x).sum(-1)  # (2, N)
    exact = torch.logsumexp(torch.log_softmax(ref_logits, 0)[:, None] + per_class, 0).sum()
    (want,) = torch.autograd.grad(exact, [ref_logits])
    assert float(want.abs().max()) > 100
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
    assert abs(float(score) - float(exact)) < 1.0


def _bernoulli_mixture_model(N=10, D=5, K=3, seed=0):
    """A mixture with a sampled (not enumerated) component and a continuous scale: prior
    draws carry gradients along their path and by the score function."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(N, D, generator=g, dtype=torch.float64) < 0.4).to(torch.float64)
    logits0 = torch.randn(K, D, generator=g, dtype=torch.float64)

    def model(x):
        probs = pyro.param("mix", torch.full((K,), 1.0 / K, dtype=torch.float64), constraint=dist.constraints.simplex)
        logits = pyro.param("logits", logits0.clone())
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(probs))
            u = pyro.sample("u", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
            pyro.sample("x", dist.Bernoulli(logits=logits[c] + 0.5 * u[..., None]).to_event(1), obs=x)

    model(x)
    return model, x


@pytest.mark.filterwarnings("ignore::pyro_mpt.ImportanceSamplingWarning")
@pytest.mark.parametrize("masks", ["uniform", "order", "pll"])
@pytest.mark.parametrize("kind", ["prior-ppca", "prior-mixture", "autoguide"])
def test_streamed_draw_table_equals_the_kept_one_and_saves_one_chunk(kind, masks):
    """The draws shared by every query (prior, autoguide) in chunks of 6: kept whole, two kept
    and the rest streamed, or all streamed (``cache_elements``) give the same loss, gradient and
    diagnostics (float64 rounding): each chunk is drawn on its own seeded stream, so a streamed
    chunk drawn again at every block and in the backward pass is the same draws. Streamed, the
    bytes saved for backward do not grow with num_samples (4x the draws); kept, they do. Before,
    the table and the model's intermediates were kept whole (PPCA N = 2000, D = 200, 256 draws:
    4.4 GB, whatever chunk_size)."""
    from pyro.infer.autoguide import AutoNormal
    from models import assert_close_to_rounding, saved_numel

    pyro.clear_param_store()
    if kind == "prior-mixture":
        model, x = _bernoulli_mixture_model()
        guide = None
    else:
        model, x, _ = make_ppca(5, 2, N=10)
        guide = None
        if kind == "autoguide":
            guide = AutoNormal(model, init_scale=0.3)
            guide(x)
    n, D = x.shape
    leaves = [p.unconstrained() for p in pyro.get_param_store().values()]

    def run(num_samples, cache_chunks):
        engine = ImportanceConditionals(
            num_samples, proposal="guide" if guide else "prior", max_elements=6 * n * D,
            cache_elements=cache_chunks * 6 * n * D,
        )
        loss = MaskedPretrainingLoss(masks=masks, num_masks=3, share_masks=False, conditionals=engine, chunk_size=n * D)
        pyro.set_rng_seed(5)
        saved, value = saved_numel(lambda: loss.differentiable_loss(model, guide, x))
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
        tokens = trace_tokens(model, guide, (x,), {})
        pyro.set_rng_seed(6)
        state = engine.prepare(tokens, model, guide, (x,), {})
        mask = torch.rand(4, n, D, generator=torch.Generator().manual_seed(0)) < 0.5
        _, diag = engine.mask_log_prob_and_diagnostics(state, tokens.value, mask)
        return saved, value.detach(), grads, diag, engine.log_evidence(state, tokens.value).detach()

    kept = run(24, cache_chunks=4)
    for cache_chunks in (2, 0):
        other = run(24, cache_chunks)
        assert_close_to_rounding(other[1], kept[1], torch.float64)
        for a, b in zip(other[2], kept[2]):
            if b is not None:
                assert_close_to_rounding(a, b, torch.float64)
        for key in ("ess", "khat"):
            assert_close_to_rounding(other[3][key], kept[3][key], torch.float64)
        # a variance from differences of sums of squares: its rounding is that of the sums,
        # relative to a standard error near 0.1 (measured 8e-13)
        assert torch.allclose(other[3]["stderr"], kept[3]["stderr"], rtol=1e-9, atol=1e-11)
        assert_close_to_rounding(other[4], kept[4], torch.float64)
    # 4x the draws: streamed, the same bytes saved for backward but the chunks' checkpoints
    # (their inputs); kept whole, 4x the table and the model's intermediates
    streamed_few, streamed_many = run(24, 0)[0], run(96, 0)[0]
    kept_few, kept_many = kept[0], run(96, 16)[0]
    assert streamed_many - streamed_few <= 0.1 * streamed_few
    assert kept_many - kept_few >= 2 * kept_few


@pytest.mark.filterwarnings("ignore::pyro_mpt.ImportanceSamplingWarning")
def test_weight_diagnostics_are_made_once_per_block_not_again_in_the_backward_pass(monkeypatch):
    """The prior table's diagnostics (second moments of the weights) are made in a block's
    first run only: the backward pass's second run of a recomputed block skips them (before,
    every block after the first made them twice), and a streamed chunk's come from the pass
    that draws it for the value (no draw of their own)."""
    from pyro_mpt.conditionals.mixture_chunks import MixtureChunk

    pyro.clear_param_store()
    model, x, _ = make_ppca(5, 2, N=10)
    n, D = x.shape
    leaves = [p.unconstrained() for p in pyro.get_param_store().values()]
    calls = []
    original = MixtureChunk.second_moments
    monkeypatch.setattr(MixtureChunk, "second_moments", lambda self, ctx: calls.append(1) or original(self, ctx))
    for cache in (None, 0):
        extra = {} if cache is None else {"cache_elements": 0}
        engine = ImportanceConditionals(24, proposal="prior", max_elements=6 * n * D, **extra)
        loss = MaskedPretrainingLoss(masks="uniform", num_masks=3, share_masks=False, conditionals=engine,
                                     chunk_size=n * D)
        pyro.set_rng_seed(0)
        calls.clear()
        value = loss.differentiable_loss(model, None, x)
        forward = len(calls)
        torch.autograd.grad(value, leaves)
        assert forward == 3 * 4  # 3 blocks of one query, 4 chunks of draws each
        assert len(calls) == forward  # none in the backward pass
