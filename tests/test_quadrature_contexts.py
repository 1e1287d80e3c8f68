"""Context-centred grids of the quadrature engine against references written outside it.

Closed forms: numpy's Gaussian conditionals of a Normal-Normal (PPCA) model
for 1-3 latent dims; non-Gaussian likelihoods: dense numpy grids.
"""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats
from scipy.special import logsumexp

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals.quadrature import QuadratureConditionals
from pyro_mpt.conditionals.quadrature_contexts import gaussian_datapoints, nonquadratic_rms, token_quadratics
from pyro_mpt.conditionals.quadrature_rules import gaussian_grid
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_conditionals, outlying_poisson_counts


def _prepared(engine, model, x):
    tokens = trace_tokens(model, None, (x,), {})
    return engine.prepare(tokens, model, None, (x,), {})


def _masks(rate, q, n, D, seed):
    """Random target masks at ``rate`` (at least one target each), or leave-one-out when rate is None."""
    if rate is None:
        return torch.eye(D, dtype=torch.bool)[:, None, :].expand(D, n, D).clone()
    g = np.random.default_rng(seed)
    m = g.random((q, n, D)) < rate
    m[..., 0] |= ~m.any(-1)
    return torch.as_tensor(m)


def test_projection_recovers_quadratic_log_likelihoods(float64):
    """b = E[f e], A = E[f (e e^T - I)] under the Gauss-Hermite rule give a
    quadratic's gradient and Hessian at 0 exactly (to 1e-10), in chunks of nodes too."""
    K, n, D = 2, 3, 4
    e, log_w = gaussian_grid(5, K)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, D, generator=g, dtype=torch.float64)
    b = torch.randn(n, D, K, generator=g, dtype=torch.float64)
    M = torch.randn(n, D, K, K, generator=g, dtype=torch.float64)
    A = M + M.transpose(-1, -2)
    T = a[:, None] + torch.einsum("ndk,qk->nqd", b, e) + 0.5 * torch.einsum("qk,ndkl,ql->nqd", e, A, e)
    log_pi = (-0.5 * e.pow(2).sum(-1) * 0.3 + 2.0)[None]  # a quadratic prior: A = -0.3 I
    parts = [(sl, log_pi[:, sl], T[:, sl]) for sl in (slice(0, 7), slice(7, 25))]
    quad = token_quadratics(e, log_w, parts)
    assert torch.allclose(quad.grad, b, rtol=0, atol=1e-10)
    assert torch.allclose(quad.hess, A, rtol=0, atol=1e-10)
    assert torch.allclose(quad.prior_grad, torch.zeros(n, K, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(quad.prior_hess, -0.3 * torch.eye(K, dtype=torch.float64).expand(n, K, K), atol=1e-10)
    assert bool(quad.finite.all())


def test_non_quadratic_part_of_each_token_matches_a_least_squares_fit(float64):
    """nonquadratic_rms: the root mean square (under the rule's weights) of a
    token's log-likelihood minus its weighted least-squares quadratic, as numpy fits it;
    zero for quadratics (a datapoint of them is gaussian_datapoints'), not for a cubic term."""
    K, n, D = 2, 3, 4
    e, log_w = gaussian_grid(6, K)
    g = torch.Generator().manual_seed(1)
    b = torch.randn(n, D, K, generator=g, dtype=torch.float64)
    M = torch.randn(n, D, K, K, generator=g, dtype=torch.float64)
    T = 5.0 + torch.einsum("ndk,qk->nqd", b, e) + 0.5 * torch.einsum("qk,ndkl,ql->nqd", e, M + M.transpose(-1, -2), e)
    T[1, :, 2] += 0.05 * e[:, 0] ** 3 - 0.02 * e[:, 1] ** 4  # one token of datapoint 1 is not quadratic
    log_pi = (-0.5 * e.pow(2).sum(-1) + 1.0)[None]
    parts = [(sl, log_pi[:, sl], T[:, sl]) for sl in (slice(0, 10), slice(10, 36))]
    quad = token_quadratics(e, log_w, parts)
    nonquadratic = nonquadratic_rms(e, log_w, parts)[0]
    w = log_w.exp().numpy()
    E = e.numpy()
    X = np.column_stack([np.ones(len(E)), E, E[:, 0] ** 2, E[:, 1] ** 2, E[:, 0] * E[:, 1]])
    for i in range(n):
        for d in range(D):
            f = T[i, :, d].numpy()
            coef = np.linalg.lstsq(X * np.sqrt(w)[:, None], f * np.sqrt(w), rcond=None)[0]
            rms = np.sqrt(np.sum(w * (f - X @ coef) ** 2))
            assert abs(nonquadratic[i, d].item() - rms) < 1e-6, (i, d)  # sqrt(eps) of the values: a difference of squares
    assert nonquadratic[1, 2].item() > 1e-2
    assert gaussian_datapoints(quad, e, log_w, parts).tolist() == [True, False, True]
    # asked for some datapoints, the table's rows of those only are read (T's other rows NaN here)
    hidden = [(sl, lp, torch.where(torch.tensor([False, False, True])[:, None, None], math.nan, t)) for sl, lp, t in parts]
    assert quad.gaussian_rows(torch.tensor([True, True, False]), e, log_w, hidden)[:2].tolist() == [True, False]
    assert quad.gaussian_rows(torch.tensor([False, False, True]), e, log_w, parts).tolist() == [True, False, True]


def test_target_grids_leave_gaussian_models_alone_and_serve_the_others(float64, monkeypatch):
    """A grid of its own per unresolved target is a model run: PPCA's Gaussian corrections
    are exact already (its conditionals match numpy's with no such run), Poisson tokens
    with an outlying count still get theirs."""
    import pyro_mpt.conditionals.quadrature as quadrature

    runs = []
    real = quadrature.context_partials

    def spy(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(quadrature, "context_partials", spy)

    def model_runs(model, x, mask, with_target_grids):
        # context_partials calls of one evaluation, with or without the target grids
        engine = QuadratureConditionals(8)
        if not with_target_grids:
            engine._target_grids = lambda state, quad, models, own, target, ctx, num, *rest: num
        state = _prepared(engine, model, x)
        runs.clear()
        out = engine.mask_log_prob(state, x, mask)
        return out, len(runs)

    pyro.clear_param_store()
    g = torch.Generator().manual_seed(3)
    D, n = 10, 6
    W = torch.randn(D, 1, generator=g, dtype=torch.float64) * 2.0  # sharp tokens: prior-sized grids miss them
    x = torch.randn(n, 1, generator=g, dtype=torch.float64) @ W.T + 0.3 * torch.randn(n, D, generator=g, dtype=torch.float64)

    def ppca(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.3).to_event(1), obs=x)

    mask = _masks(0.9, 40, n, D, seed=5)
    got, calls = model_runs(ppca, x, mask, True)
    _, calls_without = model_runs(ppca, x, mask, False)
    assert calls == calls_without
    cov = (W @ W.T + 0.09 * torch.eye(D, dtype=torch.float64)).numpy()
    ref = numpy_conditionals(np.zeros(D), cov, x.numpy(), mask.numpy())
    assert np.abs(got.numpy() - ref)[mask.numpy()].max() < 1e-8
    # Poisson tokens (not quadratic in the latent) with an outlying count: target grids run
    model, xp, _ = outlying_poisson_counts(D=8, n=3)
    mask = _masks(0.9, 20, 3, 8, seed=6)
    _, calls = model_runs(model, xp, mask, True)
    _, calls_without = model_runs(model, xp, mask, False)
    assert calls > calls_without


@pytest.mark.parametrize("K", [1, 2, 3])
def test_gaussian_model_conditionals_are_exact_at_every_masking_rate(float64, K):
    """PPCA written for quadrature (a Normal likelihood): with the default grid
    the conditionals equal numpy's Gaussian ones to 1e-8 at every masking rate
    (measured <= 6e-13 for K = 2), where the grid centred on the full posterior
    alone (context_grids=False) is off by nats at high rates."""
    D, n, sigma = 8, 4, 0.3
    g = torch.Generator().manual_seed(K)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(n, K, generator=g, dtype=torch.float64) @ W.T + sigma * torch.randn(n, D, generator=g, dtype=torch.float64)

    def ppca(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, sigma).to_event(1), obs=x)

    C = W.numpy() @ W.numpy().T + sigma**2 * np.eye(D)
    worst_single = 0.0
    for rate in (None, 0.25, 0.5, 0.9):
        mask = _masks(rate, 4, n, D, seed=1)
        ref = numpy_conditionals(np.zeros(D), C, x.numpy(), mask.numpy())
        engine = QuadratureConditionals()
        lp = engine.mask_log_prob(_prepared(engine, ppca, x), x, mask).numpy()
        assert np.abs(lp - ref)[mask.numpy()].max() < 1e-8, rate
        single = QuadratureConditionals(context_grids=False)
        lp1 = single.mask_log_prob(_prepared(single, ppca, x), x, mask).numpy()
        worst_single = max(worst_single, np.abs(lp1 - ref)[mask.numpy()].max())
    assert worst_single > 0.1


def _bernoulli_case(D=20, n=5, seed=0, half_width=7.0, points=401):
    """A 2-D standard normal latent, ``D`` Bernoulli tokens with logits ``W z``: the model,
    ``n`` datapoints drawn from it, and numpy's dense grid of ``points**2`` nodes on
    ``[-half_width, half_width]**2``: log prior ``(G,)``, token log-likelihoods ``(G, n, D)``
    and the node spacing."""
    g = torch.Generator().manual_seed(seed)
    W = 1.5 * torch.randn(D, 2, generator=g, dtype=torch.float64)
    x = torch.bernoulli(torch.sigmoid(torch.randn(n, 2, generator=g, dtype=torch.float64) @ W.T), generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T).to_event(1), obs=x)

    a = np.linspace(-half_width, half_width, points)
    Z = np.stack(np.meshgrid(a, a, indexing="ij"), -1).reshape(-1, 2)
    log_prior = stats.norm.logpdf(Z).sum(1)
    f = Z @ W.numpy().T  # (G, D)
    log_lik = -np.logaddexp(0.0, -np.where(x.numpy()[None] > 0, 1.0, -1.0) * f[:, None, :])  # (G, n, D)
    return model, x, log_prior, log_lik, a[1] - a[0]


def _dense_conditionals(log_prior, log_lik, mask):
    # log-likelihoods of Bernoulli tokens are <= 0: exp() of them cannot overflow
    lik = np.exp(log_lik)
    out = np.zeros(mask.shape)
    for a in range(mask.shape[0]):
        base = log_prior[:, None] + np.einsum("gnd,nd->gn", log_lik, (~mask[a]).astype(float))
        top = base.max(0)
        p = np.exp(base - top)  # (G, n)
        out[a] = np.log(np.einsum("gn,gnd->nd", p, lik)) - np.log(p.sum(0))[:, None]
    return out


def test_bernoulli_conditionals_match_a_dense_grid_at_every_rate(float64):
    """A 2-D latent, 20 Bernoulli tokens: the default conditionals are within
    0.03 nats of a dense 401 x 401 numpy grid at every masking rate (measured
    2.6e-3, 7.9e-4, 5.3e-3, 1.2e-2 at M = 1 and rates 0.25, 0.5, 0.9), where
    the full-posterior grid alone is off by more than 0.1 at rate 0.9."""
    model, x, log_prior, log_lik, _ = _bernoulli_case()
    n, D = x.shape
    for rate in (None, 0.25, 0.5, 0.9):
        mask = _masks(rate, 3, n, D, seed=1)
        ref = _dense_conditionals(log_prior, log_lik, mask.numpy())
        engine = QuadratureConditionals()
        lp = engine.mask_log_prob(_prepared(engine, model, x), x, mask).numpy()
        err = np.abs(lp - ref)[mask.numpy()]
        assert err.max() < 0.03, rate
        if rate == 0.9:
            single = QuadratureConditionals(context_grids=False)
            lp1 = single.mask_log_prob(_prepared(single, model, x), x, mask).numpy()
            assert np.abs(lp1 - ref)[mask.numpy()].max() > 0.1


def test_exhaustive_mpt_with_context_grids_recovers_the_true_evidence(float64):
    """Proposition 1 with the default grids: the conditionals no longer come
    from one mixture, so exhaustive MPT is the true log p(x) up to the rule's
    accuracy, not to rounding: within 5e-3 nats of the dense grid's log p(x)
    (D = 8 Bernoulli tokens, K = 2)."""
    model, x, log_prior, log_lik, step = _bernoulli_case(D=8, n=4, seed=2, half_width=8.0, points=641)
    truth = logsumexp(log_prior[:, None] + log_lik.sum(-1), 0) + 2 * math.log(step)
    score = MaskedPretrainingLoss(conditionals="quadrature", masks="exhaustive").score(model, None, x)
    assert np.abs(score.detach().numpy() - truth).max() < 5e-3
    ev = Evidence(model, method="quadrature")(x).detach().numpy()
    assert np.abs(ev - truth).max() < 1e-4


def test_evidence_error_estimate_covers_the_true_error(float64):
    """Evidence(method="quadrature")'s stderr against a dense numpy grid, on the
    case where the 2m/3-node rule alone was optimistic (a 2-D latent, 3 Poisson
    tokens, 20 datapoints: one true error 2.4 times that difference): with the
    (m - 1)-node rule compared too, every datapoint is covered."""
    D, K, n = 3, 2, 20
    g = torch.Generator().manual_seed(0)
    W = 0.5 * torch.randn(D, K, generator=g, dtype=torch.float64)
    z = torch.randn(n, K, generator=g, dtype=torch.float64)
    x = torch.poisson(torch.exp(z @ W.T), generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            zz = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(zz @ W.T)).to_event(1), obs=x)

    from scipy.special import gammaln

    a = np.linspace(-9, 9, 601)
    Z = np.stack(np.meshgrid(a, a, indexing="ij"), -1).reshape(-1, 2)
    f = Z @ W.numpy().T  # log-rates (G, D)
    xs = x.numpy()
    log_lik = f @ xs.T - np.exp(f).sum(1)[:, None] - gammaln(xs + 1).sum(1)[None]  # (G, n): Poisson log-pmf, summed
    truth = logsumexp(stats.norm.logpdf(Z).sum(1)[:, None] + log_lik, 0) + 2 * math.log(a[1] - a[0])
    ev = Evidence(model, method="quadrature").estimate(x)
    value = ev.log_evidence.detach().numpy()
    true = np.abs(value - truth)
    assert (true <= ev.stderr.numpy()).all()
    coarse_only = np.abs(value - ev.diagnostics["coarse"].numpy())
    assert (true > coarse_only).any()  # the case the second rule is there for
    assert ev.diagnostics["previous"] is not None


def test_first_evaluation_warns_when_the_conditionals_are_estimated_off(float64):
    """check_tol: on its first evaluation the engine compares its conditionals with
    the 2m/3- and (m-1)-node rules' and warns above 1e-2 nats (0.1 before: an
    error of 1e-2 never warned), once per engine: a 2-D Poisson model with an
    outlying count, leave-one-out masks, 4 nodes per dim (estimate 2.7 nats)
    and the default 8 x 8 grid (estimate 2.8e-2; true error 4.6e-3 against a
    dense grid in tests/test_quadrature.py::test_conditional_error_estimate_covers_leave_one_out_errors:
    the estimate is conservative) warn once; 12 x 12 nodes (estimate 4.3e-3) are quiet."""
    import warnings

    model, x, _ = outlying_poisson_counts()
    n, D = x.shape
    mask = torch.eye(D, dtype=torch.bool)[:, None, :].expand(D, n, D)
    for m, expected in ((4, 1), (None, 1), (12, 0)):
        engine = QuadratureConditionals(m)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(2):
                engine.mask_log_prob(_prepared(engine, model, x), x, mask)
        found = [w for w in rec if "estimated to be off" in str(w.message)]
        assert len(found) == expected, (m, [str(w.message) for w in rec])
    engine = QuadratureConditionals(4, check_tol=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        engine.mask_log_prob(_prepared(engine, model, x), x, mask)
    assert not [w for w in rec if "estimated to be off" in str(w.message)]


def _every_mask(D):
    """Every non-empty target set of ``D`` tokens, ``(2^D - 1, 1, D)`` bool."""
    bits = (np.arange(1, 2**D)[:, None] >> np.arange(D)) & 1
    return torch.as_tensor(bits.astype(bool))[:, None, :]


@pytest.mark.parametrize("family", ["gamma_poisson", "beta_binomial"])
def test_conjugate_conditionals_at_every_context_match_scipy(float64, family):
    """A 1-D conjugate latent (a Gamma rate of Poisson counts, a Beta probability of
    Binomial counts), written as users write it: with the default 32 nodes every
    conditional of every mask is within 1e-4 nats of scipy's posterior
    predictive (nbinom, betabinom; measured 2.8e-5 and 4.1e-6), and exhaustive
    MPT within 1e-4 of scipy's chain rule (6.6e-6 and 8.9e-7). Before, a query
    whose context's Gaussian model the 32-node full grid resolved kept that grid,
    although the context's true posterior (one count of five) is wider and
    heavier-tailed in the latent's unconstrained coordinates: 1.7e-2 and 1.4e-3
    nats off (Gamma-Poisson exhaustive: 3.4e-3)."""
    n, D = 6, 5
    g = torch.Generator().manual_seed(0)
    if family == "gamma_poisson":
        a, b = 2.5, 0.7
        x = torch.poisson(torch.full((n, D), 3.0), generator=g)

        def model(x):
            with pyro.plate("data", x.shape[0]):
                lam = pyro.sample("lam", dist.Gamma(a, b))
                pyro.sample("x", dist.Poisson(lam.unsqueeze(-1)).expand(lam.shape + (D,)).to_event(1), obs=x)

        def predictive(xs, ctx):  # (n, D) given ctx (n, D) bool
            shape = a + (xs * ctx).sum(1, keepdims=True)
            rate = b + ctx.sum(1, keepdims=True)
            return stats.nbinom.logpmf(xs, shape, rate / (rate + 1))

        def log_evidence(xs):
            return stats.nbinom.logpmf(xs[:, 0], a, b / (b + 1)) + sum(
                predictive(xs, np.broadcast_to(np.arange(D) < j, xs.shape))[:, j] for j in range(1, D)
            )
    else:
        a, b, trials = 2.0, 3.0, 7
        x = torch.binomial(torch.full((n, D), float(trials)), torch.full((n, D), 0.3), generator=g)

        def model(x):
            with pyro.plate("data", x.shape[0]):
                p = pyro.sample("p", dist.Beta(a, b))
                pyro.sample("x", dist.Binomial(trials, p.unsqueeze(-1)).expand(p.shape + (D,)).to_event(1), obs=x)

        def predictive(xs, ctx):
            s = (xs * ctx).sum(1, keepdims=True)
            return stats.betabinom.logpmf(xs, trials, a + s, b + trials * ctx.sum(1, keepdims=True) - s)

        def log_evidence(xs):
            return stats.betabinom.logpmf(xs[:, 0], trials, a, b) + sum(
                predictive(xs, np.broadcast_to(np.arange(D) < j, xs.shape))[:, j] for j in range(1, D)
            )

    mask = _every_mask(D)
    engine = QuadratureConditionals()
    lp = engine.mask_log_prob(_prepared(engine, model, x), x, mask).numpy()
    xs = x.numpy()
    ref = np.stack([predictive(xs, np.broadcast_to(~m[0].numpy(), xs.shape)) for m in mask])
    full = mask.expand(-1, n, -1).numpy()
    assert np.abs(lp - ref)[full].max() < 1e-4
    score = MaskedPretrainingLoss(masks="exhaustive").score(model, None, x).detach().numpy()
    assert np.abs(score - log_evidence(xs)).max() < 1e-4


def test_student_t_conditionals_at_every_context_match_a_dense_grid(float64):
    """Tokens whose log-likelihood is convex where the full posterior lies (a
    Student-t's tail): z ~ N(0, 1), x_d ~ StudentT(4, b_d + w_d z, 0.5), D = 6.
    Every conditional of every mask is within 0.02 nats of a dense numpy grid
    (measured 4.5e-3). Before, the contexts' Gaussian models extrapolated a token's
    positive curvature from the full posterior to a context's: log p(x_0 | x_1) of
    the first datapoint was +30.3 for -2.69 (a Student-t of scale 0.5 has density
    below 1), while the exhaustive sum cancelled it."""
    b = np.array([1.54099607, -0.2934289, -2.17878938, 0.56843126, -1.08452237, -1.39859545])
    w = np.array([0.60502028, 1.25703955, -1.07888639, -0.60501528, -0.89495301, 0.27305472])
    outlier = [-1.30664587, -4.38726568, -0.94288933, 1.69190967, 0.75408053, -1.32156074]
    g = np.random.default_rng(3)
    z = g.standard_normal((5, 1))
    others = b + z * w + 0.5 * g.standard_t(4.0, (5, 6))
    x = torch.tensor(np.vstack([outlier, others]))
    D = 6
    bt, wt = torch.tensor(b), torch.tensor(w)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.StudentT(4.0, bt + z * wt, 0.5).to_event(1), obs=x)

    grid = np.linspace(-12.0, 12.0, 24001)
    log_prior = stats.norm.logpdf(grid)
    log_lik = stats.t.logpdf(x.numpy()[None], 4.0, b + grid[:, None, None] * w, 0.5)  # (G, n, D)
    mask = _every_mask(D).expand(-1, x.shape[0], -1)
    ref = _dense_conditionals(log_prior, log_lik, mask.numpy())
    engine = QuadratureConditionals(check_tol=None)
    lp = engine.mask_log_prob(_prepared(engine, model, x), x, mask).numpy()
    err = np.abs(lp - ref)[mask.numpy()]
    assert err.max() < 0.02


def test_chain_terms_along_an_ordering_match_a_dense_grid(float64):
    """Per-position terms along an ordering (curves with masks="order") are conditionals
    given ever fewer tokens: z ~ N(0, 1), x_d ~ Gamma(3, 3 exp(-(a_d z / 2 + b_d))),
    D = 40. Every term is within 0.02 nats of a dense numpy grid (measured 1.6e-7) and they
    still sum to log p(x). Before, they were the full-posterior grid's ratios, which
    telescope to log p(x) while the last ones (contexts of a few tokens) were up to 0.84
    nats off, with no warning."""
    D, n = 40, 3
    g = np.random.default_rng(7)
    a, b = 3.0 * g.standard_normal(D), 0.5 * g.standard_normal(D)
    rate = lambda z: 3.0 * np.exp(-(0.5 * a * z + b))  # noqa: E731
    x = torch.tensor(g.gamma(3.0, 1.0 / rate(1.2 * g.standard_normal((n, 1)))))
    at, bt = torch.tensor(a), torch.tensor(b)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Gamma(3.0, 3.0 * torch.exp(-(0.5 * at * z + bt))).to_event(1), obs=x)

    grid = np.linspace(-10.0, 10.0, 20001)
    log_prior = stats.norm.logpdf(grid)
    log_lik = stats.gamma.logpdf(x.numpy()[None], 3.0, scale=1.0 / rate(grid[:, None, None]))  # (G, n, D)
    order = torch.as_tensor(g.permutation(D))[None, None, :]  # (1, 1, D)
    ref = np.empty((n, D))
    for t in range(D):  # position t: log p(x_{o_t} | x_{o_{t+1}}, ..., x_{o_D})
        ctx = log_prior[:, None] + log_lik[:, :, order[0, 0, t + 1 :].numpy()].sum(-1)
        j = int(order[0, 0, t])
        ref[:, t] = logsumexp(ctx + log_lik[:, :, j], 0) - logsumexp(ctx, 0)
    engine = QuadratureConditionals(check_tol=None)
    lp = engine.chain_log_prob(_prepared(engine, model, x), x, order)[0].numpy()
    assert np.abs(lp - ref).max() < 0.02
    assert np.abs(lp.sum(-1) - ref.sum(-1)).max() < 0.02


@pytest.mark.parametrize("options", [{"adaptive": False}, {"context_grids": False}])
def test_grids_without_contexts_check_their_first_conditionals(float64, options):
    """A bimodal posterior, z ~ N(0, 1), x_d ~ N(|a_d| |z|, 0.5), D = 10: the prior-centred
    grid's leave-one-out conditionals are up to 0.91 nats off a dense numpy grid with its
    two sharp modes on about one node each (effective nodes 2.0-2.3 in such cases, above
    the ESS warning's level), the one-mixture conditionals of context_grids=False 1.78. Both
    now take the first evaluation's check and warn, whether the conditionals come from
    the "pll" table, masks or an ordering's terms; before, only context grids were checked."""
    import warnings

    from pyro_mpt.conditionals import QuadratureAccuracyWarning

    D, n = 10, 4
    g = np.random.default_rng(3)
    a = np.abs(1.5 * g.standard_normal(D))
    x = torch.tensor(a * np.abs(1.2 * g.standard_normal((n, 1))) + 0.5 * g.standard_normal((n, D)))
    at = torch.tensor(a)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.abs() * at, 0.5).to_event(1), obs=x)

    grid = np.linspace(-8.0, 8.0, 160001)
    log_lik = stats.norm.logpdf(x.numpy()[None], np.abs(grid)[:, None, None] * a, 0.5)
    loo = torch.eye(D, dtype=torch.bool)[:, None, :].expand(D, n, D)
    ref = _dense_conditionals(stats.norm.logpdf(grid), log_lik, loo.numpy())
    order = torch.arange(D)[None, None, :]
    for ask in ("pll", "masks", "order"):
        engine = QuadratureConditionals(**options)
        state = _prepared(engine, model, x)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            if ask == "pll":
                lp = engine.leave_one_out_log_prob(state, x)
                if lp is None:  # served by masks on this grid
                    continue
                lp = lp.T[:, :, None].expand(D, n, D).numpy()
            elif ask == "masks":
                lp = engine.mask_log_prob(state, x, loo).numpy()
            else:
                engine.chain_log_prob(state, x, order)
        found = [w for w in rec if issubclass(w.category, QuadratureAccuracyWarning) and "conditionals" in str(w.message)]
        assert len(found) == 1, (ask, [str(w.message) for w in rec])
        if ask != "order":
            assert np.abs(lp - ref)[loo.numpy()].max() > 0.1, ask


def test_near_full_contexts_keep_the_local_curvature_of_their_tokens(float64):
    """x_d ~ N(w_d z + c_d z^2, 0.4): near the full posterior some tokens' log-likelihoods are
    convex in z while their sum is not. The leave-one-out conditionals (the "pll" table) are
    within 1e-3 nats of a dense numpy grid (measured 1e-5). Clipping each token's convex
    curvature, rather than the sum over a model's tokens, made them 0.15 nats off."""
    D, n = 8, 12
    torch.manual_seed(3)  # the case found: float64 draws of torch's global generator
    wt, ct = torch.randn(D), 0.6 * torch.randn(D)
    z0 = torch.randn(n)
    x = wt * z0[:, None] + ct * z0[:, None] ** 2 + 0.4 * torch.randn(n, D)
    x[:, 0] += 3.0
    w, c, xs = wt.numpy(), ct.numpy(), x.numpy()

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)).unsqueeze(-1)
            pyro.sample("x", dist.Normal(wt * z + ct * z**2, 0.4).to_event(1), obs=x)

    grid = np.linspace(-8.0, 8.0, 16001)
    log_lik = stats.norm.logpdf(xs[None], w * grid[:, None, None] + c * grid[:, None, None] ** 2, 0.4)
    full = stats.norm.logpdf(grid)[:, None] + log_lik.sum(-1)  # (G, n)
    ref = logsumexp(full, 0)[:, None] - logsumexp(full[..., None] - log_lik, 0)  # (n, D)
    engine = QuadratureConditionals(check_tol=None)
    loo = torch.eye(D, dtype=torch.bool)[:, None, :].expand(D, n, D)
    lp = engine.mask_log_prob(_prepared(engine, model, x), x, loo).numpy()
    assert np.abs(lp - ref.T[:, :, None])[loo.numpy()].max() < 1e-3
    pll = MaskedPretrainingLoss(conditionals=QuadratureConditionals(check_tol=None), masks="pll").score(model, None, x)
    assert np.abs(pll.numpy() - ref.sum(-1)).max() < 1e-3


@pytest.mark.parametrize("masks", ["exhaustive", "pll", "uniform"])
def test_corrected_conditionals_carry_their_gradient(float64, masks):
    """The Gaussian corrections (control variates on grids that do not resolve a query) were
    added without their gradient: the loss was exact, its gradient the uncorrected rule's (a
    linear-Gaussian model, quadrature by name: 6 % off its exact gradient with exhaustive masks,
    27-118 % with one token, 29 standard errors over "uniform" draws). Against autograd of the
    closed form: log N(x; 0, W W^T + s^2 I) for the exhaustive schedule, the sum of the
    precision's leave-one-out conditionals for "pll"; "uniform" over fixed seeds, whose
    per-seed gradients must equal the Gaussian engine's (exact in closed form, same masks)."""
    N, D, K = 4, 3, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    def gradient(conditionals, seed=0):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        loss = MaskedPretrainingLoss(masks=masks, conditionals=conditionals).differentiable_loss(model, None, x)
        return torch.autograd.grad(loss, [pyro.param("W").unconstrained()])[0]

    W = W0.clone().requires_grad_()
    cov = W @ W.T + 0.25 * torch.eye(D, dtype=torch.float64)
    if masks == "pll":
        prec = torch.linalg.inv(cov)
        d = torch.diagonal(prec)
        exact = -torch.distributions.Normal(x - (x @ prec) / d, d.rsqrt()).log_prob(x).sum()
    else:
        exact = -torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), cov).log_prob(x).sum()
    want = torch.autograd.grad(exact, [W])[0]
    if masks == "uniform":
        for seed in range(5):
            assert torch.allclose(gradient("quadrature", seed), gradient("gaussian", seed), rtol=1e-8, atol=1e-10)
        return
    assert torch.allclose(gradient("quadrature"), want, rtol=1e-9, atol=1e-11)
