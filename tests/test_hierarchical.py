"""Global and hierarchical latents (issue 13 §4): the whole dataset's evidence log p(x_1..N).

References are dense numpy closed forms of the (N*D)-dimensional Gaussian marginal,
written here from the model's equations.
"""

import itertools
import warnings

import numpy as np
import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import HierarchicalGaussianConditionals, NumericalWarning
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_leave_one_out

TOL = 1e-8


def _params(D, K, G, seed=0):
    g = np.random.default_rng(seed)
    return g.normal(size=(D, K)), g.normal(size=(K, G)), g.normal(size=D), g.normal(size=(N_MAX, D))


N_MAX = 8


def _hierarchy(W, A, c, s=0.7, tau=0.8, mvn_global=False):
    """mu ~ N(0, I_G) (or N(0, L L^T)); z_n ~ N(A mu, tau^2 I); x_n ~ N(W z_n + c, s^2 I)."""
    Wt, At, ct = (torch.tensor(t) for t in (W, A, c))
    G = At.shape[1]
    L = torch.tensor([[1.0, 0.0], [0.5, 0.8]], dtype=torch.float64)[:G, :G]

    def model(x):
        if mvn_global:
            mu = pyro.sample("mu", dist.MultivariateNormal(torch.zeros(G, dtype=x.dtype), scale_tril=L))
        else:
            mu = pyro.sample("mu", dist.Normal(torch.zeros(G, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu @ At.T, tau).to_event(1))
            pyro.sample("x", dist.Normal(z @ Wt.T + ct, s).to_event(1), obs=x)

    def dense(x, mvn=mvn_global):
        N, D = x.shape
        Sg = (L @ L.T).numpy() if mvn else np.eye(G)
        WA = W @ A
        cov = np.kron(np.ones((N, N)), WA @ Sg @ WA.T) + np.kron(np.eye(N), tau**2 * W @ W.T + s**2 * np.eye(D))
        mean = np.tile(c, N)
        return mean, cov

    return model, dense


def _masked_hierarchy(W, A, c, m):
    """The hierarchy of :func:`_hierarchy` (s = 0.7, tau = 0.8, G = 2) with the tokens outside
    the bool mask ``m`` (N, D) missing."""
    Wt, At, ct = (torch.tensor(t) for t in (W, A, c))

    def masked(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu @ At.T, 0.8).to_event(1))
            pyro.sample("x", dist.Normal(z @ Wt.T + ct, 0.7).mask(m).to_event(1), obs=x)

    return masked


def _global_mean_ppca(N, D, K, seed):
    """PPCA with a global latent mean: mu ~ N(0, I_K), z_n ~ N(mu, 0.7^2 I), x_n ~ N(W z_n, 0.5^2 I),
    W a param started at ``W0`` (D, K). Returns the model (run once, its param in a cleared
    store), data ``x`` (N, D) and ``W0``, both standard normal draws of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.sample("mu", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu, 0.7).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    pyro.clear_param_store()
    model(x)
    return model, x, W0


def _global_mean_ppca_log_prob(W, x):
    """log p(x) of :func:`_global_mean_ppca` by torch's dense MultivariateNormal of vec x (N D),
    Cov = 1 1^T kron W W^T + I kron (0.49 W W^T + 0.25 I), differentiable in ``W``."""
    N, D = x.shape
    cov = torch.kron(torch.ones(N, N, dtype=torch.float64), W @ W.T) + torch.kron(
        torch.eye(N, dtype=torch.float64), 0.49 * W @ W.T + 0.25 * torch.eye(D, dtype=torch.float64)
    )
    return torch.distributions.MultivariateNormal(torch.zeros(N * D, dtype=torch.float64), cov).log_prob(x.reshape(-1))


def _gauss_logpdf(v, mean, cov):
    r = v - mean
    return -0.5 * (len(v) * np.log(2 * np.pi) + np.linalg.slogdet(cov)[1] + r @ np.linalg.solve(cov, r))


@pytest.mark.parametrize("mvn_global", [False, True])
@pytest.mark.parametrize("N", [1, 3, 5])
def test_hierarchical_evidence_equals_the_dense_closed_form(N, mvn_global):
    W, A, c, X = _params(3, 2, 2)
    model, dense = _hierarchy(W, A, c, mvn_global=mvn_global)
    x = torch.tensor(X[:N])
    mean, cov = dense(X[:N])
    exact = _gauss_logpdf(X[:N].reshape(-1), mean, cov)
    value = Evidence(model, method="exact", token_plates=("data",))(x)
    assert value.shape == ()
    assert abs(float(value) - exact) < TOL
    if N == 1:
        return
    # the dense Gaussian engine cannot take the local latents; the message says what can
    with pytest.raises(ValueError, match="sits in token plate\\(s\\) 'data'.*conditionals='hierarchical'"):
        MaskedPretrainingLoss(conditionals="gaussian", token_plates=("data",)).loss(model, None, x)


def test_masked_conditionals_match_numpy_and_exhaustive_and_order_equal_the_evidence():
    N = 3
    W, A, c, X = _params(2, 1, 2, seed=1)
    model, dense = _hierarchy(W, A, c)
    xn = X[:N]
    x = torch.tensor(xn)
    mean, cov = dense(xn)
    v = xn.reshape(-1)
    exact = _gauss_logpdf(v, mean, cov)
    ND = v.size
    # random masks against numpy's conditionals
    engine = HierarchicalGaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {}, token_plates=("data",))
    state = engine.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 1, ND, generator=g) < 0.5
    mask[:, :, 0] = True
    logc = engine.mask_log_prob(state, tokens.value, mask)
    for q in range(5):
        m = mask[q, 0].numpy()
        R = ~m
        for j in np.flatnonzero(m):
            if R.any():
                k = cov[j, R] @ np.linalg.inv(cov[np.ix_(R, R)])
                mu_j, var = mean[j] + k @ (v[R] - mean[R]), cov[j, j] - k @ cov[R, j]
            else:
                mu_j, var = mean[j], cov[j, j]
            ref = -0.5 * (np.log(2 * np.pi * var) + (v[j] - mu_j) ** 2 / var)
            assert abs(float(logc[q, 0, j]) - ref) < TOL
    # exhaustive and every ordering give log p(x_1..N) (auto picks the engine)
    for masks in ("exhaustive", "order"):
        loss = MaskedPretrainingLoss(masks=masks, token_plates=("data",))
        assert abs(float(loss.score(model, None, x)) - exact) < TOL
    order = torch.tensor(list(itertools.permutations(range(ND))))[::37][:, None, :]
    chain = engine.chain_log_prob(state, tokens.value, order).sum(-1)
    assert float((chain - exact).abs().max()) < TOL


def test_units_in_groups_and_per_token_latents():
    # groups are datapoints (plate "groups"), units inside each (token plate "units"),
    # a global latent per group and a local latent per unit; and a latent per token
    G, U, D = 2, 3, 2
    g = np.random.default_rng(3)
    w, b, X = g.normal(size=D), g.normal(size=D), g.normal(size=(G, U, D))
    wt, bt = torch.tensor(w), torch.tensor(b)

    def model(x):
        with pyro.plate("groups", G, dim=-2):
            m = pyro.sample("m", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            with pyro.plate("units", U, dim=-1):
                z = pyro.sample("z", dist.Normal(0.5 * m, 0.9))
                pyro.sample("x", dist.Normal(z[..., None] * wt + m[..., None] * bt, 0.6).to_event(1), obs=x)

    value = Evidence(model, method="exact", token_plates=("units",))(torch.tensor(X))
    assert value.shape == (G,)
    # the orderings' suffix-sum path equals one mask query per position (the base engine's)
    from pyro_mpt.conditionals.base import ConditionalEngine

    engine = HierarchicalGaussianConditionals()
    tokens = trace_tokens(model, None, (torch.tensor(X),), {}, token_plates=("units",))
    state = engine.prepare(tokens, model, None, (torch.tensor(X),), {})
    order = torch.stack([torch.stack([torch.randperm(U * D) for _ in range(G)]) for _ in range(3)])
    fast = engine.chain_log_prob(state, tokens.value, order)
    slow = ConditionalEngine.chain_log_prob(engine, state, tokens.value, order)
    assert float((fast - slow).abs().max()) < TOL
    assert float((fast.sum(-1) - value.detach()).abs().max()) < TOL
    a_vec = np.tile(0.5 * w + b, U)  # loading of m on the U*D tokens
    B = np.kron(np.eye(U), 0.9 * w[:, None])
    cov = np.outer(a_vec, a_vec) + B @ B.T + 0.36 * np.eye(U * D)
    for i in range(G):
        assert abs(float(value[i]) - _gauss_logpdf(X[i].reshape(-1), np.zeros(U * D), cov)) < TOL

    def per_token(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            with pyro.plate("tokens", x.shape[1], dim=-1):
                e = pyro.sample("e", dist.Normal(torch.zeros((), dtype=x.dtype), 0.5))
                pyro.sample("x", dist.Normal(z + e, 1.0), obs=x)

    x = torch.tensor(g.normal(size=(4, 3)))
    value = MaskedPretrainingLoss(masks="order", token_plates=("tokens",)).score(per_token, None, x)
    cov = np.ones((3, 3)) + (0.25 + 1.0) * np.eye(3)
    ref = [_gauss_logpdf(r, np.zeros(3), cov) for r in x.numpy()]
    assert np.abs(value.detach().numpy() - ref).max() < TOL


@pytest.mark.parametrize("where", ["global", "local"])
def test_a_piecewise_linear_hierarchy_is_refused(where):
    # relu(mu + 2.5) (or of a local latent): the old single random probe had
    # every coordinate above -2.5 and the hierarchy was served as linear
    # (order MPT -26.59 for the global case); the probes at +-3 prior sds catch the kink
    W, _, _, X = _params(3, 2, 1, seed=4)
    Wt = torch.tensor(W)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
            if where == "global":
                loc = torch.relu(mu + 2.5) + z @ Wt.T
            else:
                loc = mu + torch.relu(z + 2.5) @ Wt.T
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    x = torch.tensor(X[:4])
    with pytest.raises(ValueError, match="not affine in the latents with each unit of plate 'data'"):
        MaskedPretrainingLoss(masks="order", conditionals="hierarchical", token_plates=("data",)).score(model, None, x)


def test_not_a_hierarchy_is_refused_and_importance_serves_it_with_a_guide():
    from pyro.infer.autoguide import AutoMultivariateNormal

    W, A, c, X = _params(2, 1, 1, seed=2)
    Wt = torch.tensor(W)

    def cross(x):  # unit n reads the local latent of unit 0 too: not conditionally independent
        mu = pyro.sample("mu", dist.Normal(torch.zeros(1, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
            loc = (z + z[..., :1, :]) @ Wt.T
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    x = torch.tensor(X[:3])
    with pytest.raises(ValueError, match="not affine in the latents with each unit of plate 'data' reading only its own.*conditionals='importance'"):
        MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("data",)).loss(cross, None, x)

    def poisson(x):  # a non-Gaussian hierarchy: importance sampling over all the latents
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu, 0.5))
            pyro.sample("x", dist.Poisson(z.exp()[..., None].expand(z.shape + (2,))).to_event(1), obs=x)

    xp = torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    # brute force: log p(x) by Gauss-Hermite quadrature over mu and each z_n (the units
    # are independent given mu), 80 nodes per dim
    from scipy import stats
    t, wq = np.polynomial.hermite_e.hermegauss(80)
    wq = wq / wq.sum()
    m = t  # mu nodes, N(0, 1)
    z = m[:, None] + 0.5 * t[None, :]  # z nodes given mu, N(mu, 0.5^2)
    per_unit = [(stats.poisson.pmf(row[None, None, :], np.exp(z)[..., None]).prod(-1) * wq).sum(-1) for row in xp.numpy()]
    exact = np.log((np.prod(per_unit, 0) * wq).sum())
    pyro.set_rng_seed(0)
    # a joint guide: mu and the z_n are correlated a posteriori (a mean-field guide is a
    # narrower proposal, with heavier-tailed weights)
    guide = AutoMultivariateNormal(poisson)
    svi = pyro.infer.SVI(poisson, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    for _ in range(400):
        svi.step(xp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = Evidence(poisson, guide, method="importance", num_samples=4000, token_plates=("data",)).estimate(xp)
    assert res.log_evidence.shape == ()
    assert abs(float(res.log_evidence) - exact) < 4 * float(res.stderr), (float(res.log_evidence), exact, float(res.stderr))
    assert float(res.diagnostics["khat"]) < 0.7


def test_bayesian_regression_whole_dataset_evidence_through_the_gaussian_engine():
    # global latents only: the Gaussian engine serves the whole dataset as one datapoint
    g = np.random.default_rng(4)
    N, P = 6, 2
    C, y = g.normal(size=(N, P)), g.normal(size=(N, 1))
    Ct = torch.tensor(C)

    def regression(y):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=y.dtype), 1.0).to_event(1))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("y", dist.Normal((Ct @ w)[..., None], 0.5).to_event(1), obs=y)

    exact = _gauss_logpdf(y[:, 0], np.zeros(N), C @ C.T + 0.25 * np.eye(N))
    value = Evidence(regression, method="exact", token_plates=("data",))(torch.tensor(y))
    assert abs(float(value) - exact) < TOL
    score = MaskedPretrainingLoss(masks="order", token_plates=("data",)).score(regression, None, torch.tensor(y))
    assert abs(float(score) - exact) < TOL


def test_bayesian_regression_in_the_tutorial_form_names_token_plates_and_then_is_exact():
    # Pyro's regression tutorial: weights and intercept outside the data plate, a
    # scalar observation in it. The refusal said only "no event dims"; it now
    # names the shared latents and token_plates=('data',), which gives scipy's value
    g = np.random.default_rng(6)
    N, P = 7, 3
    X, y = torch.tensor(g.normal(size=(N, P))), torch.tensor(g.normal(size=N))

    def regression(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros((), dtype=X.dtype), 1.0).expand([P]).to_event(1))
        b0 = pyro.sample("b0", dist.Normal(torch.zeros((), dtype=X.dtype), 10.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ w + b0, 0.5), obs=y)

    with pytest.raises(ValueError, match=r"latent site\(s\) 'w', 'b0' sit outside its plate\(s\) 'data'.*token_plates=\('data',\)"):
        MaskedPretrainingLoss().loss(regression, None, X, y)
    exact = _gauss_logpdf(y.numpy(), np.zeros(N), X.numpy() @ X.numpy().T + 100.0 + 0.25 * np.eye(N))
    assert abs(float(Evidence(regression, token_plates=("data",))(X, y)) - exact) < TOL
    score = MaskedPretrainingLoss(masks="order", token_plates=("data",)).score(regression, None, X, y)
    assert abs(float(score) - exact) < TOL


def test_gradient_matches_the_dense_gaussian_and_svi_runs():
    # the engine's log p(x_1..N) is differentiable in the model's params: its gradient
    # equals that of torch's dense MultivariateNormal built here from the equations
    model, x, W0 = _global_mean_ppca(N=4, D=3, K=2, seed=5)
    W = pyro.param("W").unconstrained()
    value = Evidence(model, method="exact", token_plates=("data",))(x)
    (grad,) = torch.autograd.grad(value, W)
    Wd = W0.clone().requires_grad_(True)
    dense = _global_mean_ppca_log_prob(Wd, x)
    (ref,) = torch.autograd.grad(dense, Wd)
    assert abs(float(value) - float(dense)) < TOL
    assert float((grad - ref).abs().max()) < 1e-8
    svi = pyro.infer.SVI(model, lambda x: None, pyro.optim.Adam({"lr": 0.01}),
                         MaskedPretrainingLoss(masks="uniform", token_plates=("data",)))
    losses = [svi.step(x) for _ in range(3)]
    assert np.isfinite(losses).all() and not torch.equal(pyro.param("W").detach(), W0)


def test_missing_tokens_give_the_evidence_of_the_observed_tokens():
    N = 4
    W, A, c, X = _params(3, 2, 2, seed=6)
    m = torch.rand(N, 3, generator=torch.Generator().manual_seed(1)) > 0.3
    masked = _masked_hierarchy(W, A, c, m)
    _, dense = _hierarchy(W, A, c)
    mean, cov = dense(X[:N])
    o = m.numpy().reshape(-1)
    ref = _gauss_logpdf(X[:N].reshape(-1)[o], mean[o], cov[np.ix_(o, o)])
    x = torch.tensor(X[:N])
    assert abs(float(Evidence(masked, method="exact", token_plates=("data",))(x)) - ref) < TOL
    score = MaskedPretrainingLoss(masks="order", token_plates=("data",)).score(masked, None, x)
    assert abs(float(score) - ref) < TOL


def _dense_logpdf(x, A, g_scale, b, s):
    """log N(vec x; 0, 1 1^T kron g_scale^2 A A^T + I kron (b b^T + s^2 I)), by numpy."""
    X, A, b = (np.asarray(t, dtype=float) for t in (x, A, b))
    N, D = X.shape
    cov = np.kron(np.ones((N, N)), g_scale**2 * A @ A.T) + np.kron(np.eye(N), np.outer(b, b) + s**2 * np.eye(D))
    return _gauss_logpdf(X.reshape(-1), np.zeros(N * D), cov)


def test_a_model_that_does_not_broadcast_runs_point_by_point():
    """(g @ A.T).unsqueeze(-2) is right for an unbatched g but adds a dim under an extra
    plate, and a prior written out per datapoint (.expand(N, K)) fails there: both are run
    once per noise point (exact) instead of being refused, so 'auto' no longer falls to
    importance sampling (100 nats off on N=100); values and gradients against numpy's
    dense closed form."""
    torch.manual_seed(3)
    N, D, G = 6, 3, 2
    A = torch.randn(D, G, dtype=torch.float64)
    ones = torch.ones(D, dtype=torch.float64)

    def grown(x):
        g = pyro.sample("g", dist.Normal(torch.zeros(G, dtype=x.dtype), 1.3).to_event(1))
        with pyro.plate("data", N):
            u = pyro.sample("u", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))
            pyro.sample("x", dist.Normal((g @ A.T).unsqueeze(-2) + 2.0 * u.unsqueeze(-1), 0.7).to_event(1), obs=x)

    def written_out(x):
        sd = pyro.param("sd", torch.tensor(0.7, dtype=x.dtype), constraint=dist.constraints.positive)
        g = pyro.sample("g", dist.Normal(torch.zeros(G, dtype=x.dtype), 1.3).to_event(1))
        with pyro.plate("data", x.shape[0]):
            u = pyro.sample("u", dist.Normal(torch.zeros(x.shape[0], 1, dtype=x.dtype),
                                             torch.ones(x.shape[0], 1, dtype=x.dtype)).to_event(1))
            loc = (g @ A.T).expand(x.shape[0], D) + 2.0 * u * ones
            pyro.sample("x", dist.Normal(loc, sd).to_event(1), obs=x)

    x = torch.randn(N, D, dtype=torch.float64)
    ref = _dense_logpdf(x, A, 1.3, 2.0 * ones, 0.7)
    for model in (grown, written_out):
        pyro.clear_param_store()
        assert abs(float(Evidence(model, method="exact", token_plates=("data",))(x)) - ref) < TOL
        loss = MaskedPretrainingLoss(masks="order", token_plates=("data",))
        assert abs(float(loss.differentiable_loss(model, None, x)) + ref) < TOL
        assert [type(e).__name__ for e in loss.memory.auto_engines.values()] == ["HierarchicalGaussianConditionals"]
    # the gradient in the observation's scale, against numpy's derivative of the dense form
    pyro.clear_param_store()
    MaskedPretrainingLoss(masks="order", token_plates=("data",)).differentiable_loss(written_out, None, x).backward()
    h = 1e-6
    dref = (_dense_logpdf(x, A, 1.3, 2.0 * ones, 0.7 + h) - _dense_logpdf(x, A, 1.3, 2.0 * ones, 0.7 - h)) / (2 * h)
    grad = pyro.param("sd").unconstrained().grad  # d/d log sd
    assert abs(float(grad) + 0.7 * dref) < 1e-6 * max(1.0, abs(dref))


def test_a_global_latent_in_a_plate_of_its_own():
    """mu written as pyro.plate("g", G) around scalar Normals (not .to_event(1)) is a global
    latent whose plate is its event dim: exact under "auto" (before: refused, and "auto"
    fell to importance sampling, N=100: 113 nats off, 75x the time); evidence and order
    MPT vs numpy's dense closed form, and equal to the .to_event(1) spelling."""
    W, A, c, X = _params(3, 2, 2)
    Wt, At, ct = (torch.tensor(t) for t in (W, A, c))
    G = At.shape[1]

    def model(x):
        with pyro.plate("g", G):
            mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu @ At.T, 0.8).to_event(1))
            pyro.sample("x", dist.Normal(z @ Wt.T + ct, 0.7).to_event(1), obs=x)

    evented, dense = _hierarchy(W, A, c)
    x = torch.tensor(X[:5])
    mean, cov = dense(X[:5])
    ref = _gauss_logpdf(X[:5].reshape(-1), mean, cov)
    assert abs(float(Evidence(model, method="exact", token_plates=("data",))(x)) - ref) < TOL
    loss = MaskedPretrainingLoss(masks="order", token_plates=("data",))
    assert abs(float(loss.loss(model, None, x)) + ref) < TOL
    assert [type(e).__name__ for e in loss.memory.auto_engines.values()] == ["HierarchicalGaussianConditionals"]
    torch.manual_seed(0)
    a = MaskedPretrainingLoss(masks="uniform", num_masks=3, token_plates=("data",)).loss(model, None, x)
    torch.manual_seed(0)
    b = MaskedPretrainingLoss(masks="uniform", num_masks=3, token_plates=("data",)).loss(evented, None, x)
    assert abs(a - b) < TOL


def test_pll_of_a_hierarchy_takes_the_full_data_posterior_once(monkeypatch):
    """masks="pll" on a linear-Gaussian hierarchy (N = 6 units of D = 3 tokens, one
    datapoint): every leave-one-out conditional from the full-data posterior (leverages
    by Sherman-Morrison) instead of one masked query per token (N D = 1000 tokens: 946
    -> 7 ms a step, one thread). Loss vs numpy's inverse of the dense (N D)-dimensional
    covariance (Rasmussen & Williams eqs. 5.10-5.12, 1e-8), gradient in W vs autograd of
    the same closed form in torch."""
    monkeypatch.setattr(HierarchicalGaussianConditionals, "mask_log_prob",
                        lambda *a, **k: pytest.fail("one masked query per token"))
    W, A, c, X = _params(3, 2, 2, seed=5)
    s, tau = 0.7, 0.8
    At, ct = torch.tensor(A), torch.tensor(c)
    x = torch.tensor(X[:6])
    N, D = x.shape

    def model(x):
        Wp = pyro.param("W", torch.tensor(W))
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu @ At.T, tau).to_event(1))
            pyro.sample("x", dist.Normal(z @ Wp.T + ct, s).to_event(1), obs=x)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="pll", conditionals="hierarchical", token_plates=("data",))
    value = loss.differentiable_loss(model, None, x)
    (grad,) = torch.autograd.grad(value, pyro.param("W").unconstrained())

    _, dense = _hierarchy(W, A, c, s=s, tau=tau)
    mean, cov = dense(X[:N])
    want = numpy_leave_one_out(cov, X[:N].reshape(-1) - mean).sum()
    assert abs(value.item() + want) < TOL * max(1.0, abs(want))

    Wr = torch.tensor(W, requires_grad=True)
    WA = Wr @ At
    cov_t = torch.kron(torch.ones(N, N, dtype=torch.float64), WA @ WA.T) + torch.kron(
        torch.eye(N, dtype=torch.float64), tau**2 * Wr @ Wr.T + s**2 * torch.eye(D, dtype=torch.float64))
    Ki_t = torch.linalg.inv(cov_t)
    v_t = 1 / torch.diagonal(Ki_t)
    r = (x - ct).reshape(-1)
    ref = -(-0.5 * (torch.log(2 * np.pi * v_t) + (Ki_t @ r) ** 2 * v_t)).sum()
    (grad_ref,) = torch.autograd.grad(ref, Wr)
    assert torch.allclose(grad, grad_ref, rtol=1e-8, atol=1e-8 * float(grad_ref.abs().max()))


def test_a_mixed_model_in_nested_plates_takes_the_outer_token_plate_as_units():
    """Random intercepts and slopes per group, observations in a plate nested in the
    groups' (the way Pyro users write a linear mixed model), both plates token plates:
    the groups are the units. Refused before ("exactly one token plate"), and 'auto'
    fell back to importance sampling."""
    G, n = 4, 5
    g = np.random.default_rng(11)
    t, y = g.normal(size=(G, n)), g.normal(size=(G, n)) + 1.0
    sa, sb, s, s0, beta = 1.1, 0.6, 0.4, 1.5, (0.8, 0.4)

    def lmm(t, y):
        mu0 = pyro.sample("mu0", dist.Normal(torch.zeros((), dtype=y.dtype), s0))
        with pyro.plate("groups", G, dim=-2):
            a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=y.dtype), sa))
            b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=y.dtype), sb))
            with pyro.plate("obs", n, dim=-1):
                pyro.sample("y", dist.Normal(mu0 + beta[0] + a + (beta[1] + b) * t, s), obs=y)

    # the (G n)-dimensional marginal from the model's equations
    A = np.kron(np.eye(G), np.ones((n, 1)))
    B = np.zeros((G * n, G))
    for k in range(G):
        B[k * n:(k + 1) * n, k] = t[k]
    cov = s0**2 * np.ones((G * n, G * n)) + sa**2 * A @ A.T + sb**2 * B @ B.T + s**2 * np.eye(G * n)
    mean = beta[0] + beta[1] * t.ravel()
    ref = _gauss_logpdf(y.ravel(), mean, cov)
    tt, yt = torch.tensor(t), torch.tensor(y)
    kw = dict(token_plates=("groups", "obs"))
    assert abs(float(Evidence(lmm, method="exact", **kw)(tt, yt)) - ref) < TOL
    loss = MaskedPretrainingLoss(masks="order", **kw)
    assert abs(float(loss.score(lmm, None, tt, yt)) - ref) < TOL
    assert isinstance(loss.memory.auto_engines[next(iter(loss.memory.auto_engines))], HierarchicalGaussianConditionals)
    pll = MaskedPretrainingLoss(masks="pll", conditionals="hierarchical", **kw).score(lmm, None, tt, yt)
    assert abs(float(pll) - numpy_leave_one_out(cov, y.ravel() - mean).sum()) < TOL


@pytest.mark.parametrize("noise", [1e-2, 1e-3])
def test_float32_mixed_model_with_600_tokens_computes_in_float64(noise):
    """A float32 linear mixed model, 100 groups of 6 observations (D = 600) with noise sd
    1e-2 or 1e-3: the posterior precision's trace is ~1e9-1e11, so float32 arithmetic
    cancels log p's Mahalanobis sums to nothing (Evidence was 1.8 nats off at 1e-2,
    and the 'order' chain failed in a Cholesky at 1e-3). The state now computes in
    float64: Evidence, 'order' and 'pll' equal numpy's float64 closed form of the model
    as float32 rounds its data to 100 float32 eps (relative), in float32."""
    G, n = 100, 6
    g = np.random.default_rng(5)
    t = torch.tensor(g.normal(size=(G, n)), dtype=torch.float32)
    y = torch.tensor(1.0 + 0.5 * t.double().numpy() + 3 * g.normal(size=(G, 1)) + noise * g.normal(size=(G, n)),
                     dtype=torch.float32)

    def lmm(t, y):
        mu0 = pyro.sample("mu0", dist.Normal(torch.tensor(0.0), 10.0))
        with pyro.plate("groups", G, dim=-2):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0), 3.0))
            b = pyro.sample("b", dist.Normal(torch.tensor(0.0), 0.5))
            with pyro.plate("obs", n, dim=-1):
                pyro.sample("y", dist.Normal(mu0 + 0.75 + a + (0.5 + b) * t, noise), obs=y)

    tn, yn = t.double().numpy(), y.double().numpy().ravel()
    A = np.kron(np.eye(G), np.ones((n, 1)))
    B = np.zeros((G * n, G))
    for k in range(G):
        B[k * n:(k + 1) * n, k] = tn[k]
    noise32 = float(torch.tensor(noise, dtype=torch.float32))  # the scale the model computes with
    cov = 100 * np.ones((G * n, G * n)) + 9 * A @ A.T + 0.25 * B @ B.T + noise32**2 * np.eye(G * n)
    r = yn - (0.75 + 0.5 * tn.ravel())
    L = np.linalg.cholesky(cov)
    ref = -0.5 * (np.linalg.solve(L, r) ** 2).sum() - np.log(np.diag(L)).sum() - 0.5 * G * n * np.log(2 * np.pi)
    kw = dict(token_plates=("groups", "obs"))
    tol = 100 * torch.finfo(torch.float32).eps
    values = {
        "exact": (Evidence(lmm, method="exact", **kw)(t, y), ref),
        "order": (MaskedPretrainingLoss(masks="order", **kw).score(lmm, None, t, y), ref),
        "pll": (MaskedPretrainingLoss(masks="pll", **kw).score(lmm, None, t, y), numpy_leave_one_out(cov, r).sum()),
    }
    for name, (value, expected) in values.items():
        assert value.dtype == torch.float32, name
        assert abs(float(value) - expected) <= tol * abs(expected), (name, float(value), expected)


def test_order_sums_are_the_evidence_without_the_chain_terms(monkeypatch):
    """Every ordering of the hierarchy's Gaussian joint telescopes to log p(x): 'order' takes
    the evidence's one posterior factorization, not each ordering's suffix sums (spy: the
    chain terms are never formed; PPCA with a global latent mean, 200 units of 20 tokens,
    K = 3, loss + gradient, one thread: 287 -> 10 ms, Evidence 11 ms). Loss and gradient
    equal torch's dense MultivariateNormal built here from the equations (1e-8), also with
    missing tokens (numpy's density of the observed sub-vector)."""
    import pyro_mpt.conditionals.hierarchical as module

    monkeypatch.setattr(module, "chain_terms", lambda *a: pytest.fail("chain terms formed"))
    N = 5
    model, x, W0 = _global_mean_ppca(N=N, D=3, K=2, seed=9)
    loss = MaskedPretrainingLoss(masks="order", num_masks=3, token_plates=("data",))
    value = -loss.differentiable_loss(model, None, x)
    (grad,) = torch.autograd.grad(value, pyro.param("W").unconstrained())
    Wd = W0.clone().requires_grad_(True)
    dense = _global_mean_ppca_log_prob(Wd, x)
    (ref,) = torch.autograd.grad(dense, Wd)
    assert abs(float(value) - float(dense)) < TOL
    assert float((grad - ref).abs().max()) < 1e-8
    # missing tokens: the density of the observed ones
    W, A, c, X = _params(3, 2, 2, seed=10)
    m = torch.rand(N, 3, generator=torch.Generator().manual_seed(11)) > 0.3
    masked = _masked_hierarchy(W, A, c, m)
    _, dense_moments = _hierarchy(W, A, c)
    mean, cov = dense_moments(X[:N])
    o = m.numpy().reshape(-1)
    want = _gauss_logpdf(X[:N].reshape(-1)[o], mean[o], cov[np.ix_(o, o)])
    score = MaskedPretrainingLoss(masks="order", num_masks=2, token_plates=("data",)).score(masked, None, torch.tensor(X[:N]))
    assert abs(float(score) - want) < TOL


def test_pll_of_a_hierarchy_in_many_blocks_takes_one_group(monkeypatch):
    """With the schedule's blocks far smaller than the pll's queries (chunk_size=36: two of
    the 18 queries a block), the hierarchy's leave-one-out queries take one pass
    (leave_one_out_log_prob, asked once for every block's targets): one full-data posterior, not one per block recomputed in the
    backward pass (PPCA with a global latent mean, 200 units of 20 tokens, one thread,
    loss + gradient: 287 -> 46 ms with the counting of the targets, Evidence 11 ms; the first
    call no longer imports torch._dynamo for the checkpoints, 3.8 -> 0.5 s). Loss vs numpy's
    inverse of the dense covariance (1e-8)."""
    calls = []
    original = HierarchicalGaussianConditionals.leave_one_out_log_prob
    monkeypatch.setattr(HierarchicalGaussianConditionals, "leave_one_out_log_prob",
                        lambda self, *a: calls.append(1) or original(self, *a))
    W, A, c, X = _params(3, 2, 2, seed=12)
    model, dense = _hierarchy(W, A, c)
    x = torch.tensor(X[:6])
    loss = MaskedPretrainingLoss(masks="pll", chunk_size=36, token_plates=("data",))
    value = loss.differentiable_loss(model, None, x)
    assert len(calls) == 1
    mean, cov = dense(X[:6])
    want = numpy_leave_one_out(cov, X[:6].reshape(-1) - mean).sum()
    assert abs(value.item() + want) < TOL * max(1.0, abs(want))


def test_pll_without_the_leave_one_out_table_takes_the_masks():
    """A subclass whose leave_one_out_log_prob gives None (as the engine's contract allows):
    "pll" then takes the per-mask path (it crashed on the missing table) and equals the
    table's score to 1e-10."""
    W, A, c, X = _params(3, 2, 2, seed=12)
    model, _ = _hierarchy(W, A, c)
    x = torch.tensor(X[:4])

    class PerMask(HierarchicalGaussianConditionals):
        def leave_one_out_log_prob(self, state, x):
            return None

    scores = [MaskedPretrainingLoss(masks="pll", conditionals=engine, token_plates=("data",)).score(model, None, x)
              for engine in (HierarchicalGaussianConditionals(), PerMask())]
    assert torch.allclose(scores[0], scores[1], rtol=1e-10, atol=0)


@pytest.mark.parametrize("given", [None, ("groups",), ("members",)])
def test_the_global_latent_message_names_every_plate_to_make_tokens(given):
    """A global mean over groups of members (two nested plates): the refusal's suggested
    token_plates, followed as written, gives the whole dataset's evidence, scipy's
    multivariate normal of the written-out covariance (1e-8). Before, it named only the
    plates the latent missed, sending the user from ('groups',) to ('members',) and back."""
    import re

    from scipy.stats import multivariate_normal

    G, M, tau, s = 3, 4, 1.3, 0.4
    x = torch.randn(G, M, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2

    def model(x):
        m0 = pyro.sample("m0", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 2.0))
        with pyro.plate("groups", G, dim=-2):
            a = pyro.sample("a", dist.Normal(m0, tau))
            with pyro.plate("members", M, dim=-1):
                pyro.sample("x", dist.Normal(a, s), obs=x)

    options = {} if given is None else {"token_plates": given}
    with pytest.raises(ValueError, match="global latent") as err:
        Evidence(model, method="exact", **options)(x)
    suggested = eval(re.search(r"pass token_plates=(\(.*?\)) so that", str(err.value)).group(1))
    assert set(suggested) == {"groups", "members"}
    group = np.repeat(np.arange(G), M)
    cov = 4.0 + tau**2 * (group[:, None] == group[None, :]) + s**2 * np.eye(G * M)
    ref = multivariate_normal(np.zeros(G * M), cov).logpdf(x.numpy().reshape(-1))
    got = Evidence(model, method="exact", token_plates=suggested)(x)
    assert abs(float(got.sum()) - ref) < 1e-8


def _tiny_noise_hierarchy(sd, N=12, D=4, seed=2):
    """g ~ N(0, I_2) global, z_n ~ N(0, 1) local, x_n ~ N(c + W z_n + A g, diag(psi)) with noise
    sd ``sd`` against unit loadings; returns the model, data (float64) and an mpmath (40 digits)
    function ``log_density(keep)`` of the tokens at the bool (N*D,) ``keep`` (all by default)
    and ``conditional(j, context)``, both of the model's float64 numbers as exact reals."""
    import mpmath
    from scipy.linalg import block_diag

    mpmath.mp.dps = 40
    g = np.random.default_rng(seed)
    W, A, c = g.normal(size=(D, 1)), g.normal(size=(D, 2)), g.normal(size=D)
    psi = sd**2 * (0.5 + g.random(D))
    X = c + g.normal(size=(N, 1)) @ W.T + g.normal(size=2) @ A.T + np.sqrt(psi) * g.normal(size=(N, D))
    t = torch.tensor

    def model(x):
        gl = pyro.sample("g", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(torch.zeros(1, dtype=torch.float64), 1.0).to_event(1))
            loc = t(c) + z @ t(W).T + (gl @ t(A).T)[..., None, :]
            pyro.sample("x", dist.Normal(loc, t(psi).sqrt()).to_event(1), obs=x)

    L = mpmath.matrix(np.hstack([np.tile(A, (N, 1)), block_diag(*[W] * N)]).tolist())
    S = L * L.T  # exact products of the float64 loadings: rounding L L^T first loses the noise
    for i, p in enumerate(np.tile(psi, N)):
        S[i, i] += mpmath.mpf(float(p))
    r = (X - c).reshape(-1)

    def log_density(keep=None):
        idx = np.arange(N * D) if keep is None else np.flatnonzero(keep)
        Sk = mpmath.matrix([[S[i, j] for j in idx] for i in idx])
        rk = mpmath.matrix([r[i] for i in idx])
        quad = (rk.T * mpmath.lu_solve(Sk, rk))[0]
        return float(-0.5 * (len(idx) * mpmath.log(2 * mpmath.pi) + mpmath.log(mpmath.det(Sk)) + quad))

    def conditional(j, context):
        keep = np.zeros(N * D, dtype=bool)
        keep[context] = True
        without = log_density(keep) if keep.any() else 0.0
        keep[j] = True
        return log_density(keep) - without

    return model, torch.tensor(X), log_density, conditional


@pytest.mark.parametrize("sd", [1e-4, 1e-7])
def test_tiny_noise_keeps_the_evidence_exact_and_warns_for_small_contexts(sd):
    """float64, noise sd 1e-4 / 1e-7 against unit loadings (48 tokens, tr P ~ 1e10 / 1e16).
    The evidence wrote r^T Sigma^-1 r as r^T Psi^-1 r - eta^T m, cancelling terms of size tr P:
    Evidence and the "order" loss were 3e-6 / 12 nats off an exact (mpmath) reference, silently;
    now the minimum of |e|^2/psi + |m|^2 at the posterior means, within 1e-8 relative.
    Masked conditionals keep 2e-8 nats at sd 1e-4; at 1e-7 those given fewer context tokens
    than latent dimensions lose ~1e-3 nats to the rounding of the posterior precision (its
    eigenvalues near 1), silently before: the masked schedules now say so (NumericalWarning),
    where Evidence, "order" and "pll", which keep their digits, do not."""
    model, x, log_density, conditional = _tiny_noise_hierarchy(sd)
    ref = log_density()
    kw = dict(token_plates=("data",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ev = float(Evidence(model, **kw)(x))
        order = float(MaskedPretrainingLoss(masks="order", **kw).score(model, None, x))
        MaskedPretrainingLoss(masks="pll", **kw).score(model, None, x)
    assert abs(ev - ref) <= 1e-8 * abs(ref), (ev, ref)
    assert abs(order - ref) <= 1e-8 * abs(ref), (order, ref)

    engine = HierarchicalGaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {}, token_plates=("data",))
    state = engine.prepare(tokens, model, None, (x,), {})
    T = x.numel()
    rng = np.random.default_rng(0)
    mask = np.stack([rng.permutation(T) < m for m in (3, T // 2, T - 2)])
    if sd == 1e-7:
        with pytest.warns(NumericalWarning, match="tiny against its loadings"):
            engine.mask_log_prob(state, tokens.value, torch.tensor(mask)[:, None])
        with pytest.warns(NumericalWarning, match="tiny against its loadings"):
            MaskedPretrainingLoss(masks="uniform", **kw).score(model, None, x)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = engine.mask_log_prob(state, tokens.value, torch.tensor(mask)[:, None])[:, 0]
    for q in range(mask.shape[0]):
        context = np.flatnonzero(~mask[q])
        for j in np.flatnonzero(mask[q])[:3]:
            assert abs(float(out[q, j]) - conditional(j, context)) < 2e-8, (q, j)


def test_a_latent_per_token_inside_the_units_is_a_local_latent():
    """Units (plate "data", dim -2) with a local latent z and a per-token offset e in the inner
    token plate "tokens", the whole dataset one datapoint (token_plates=("data", "tokens")):
    "hierarchical" refused e as sitting in a plate "the observation lacks" (it does not) and
    "auto" sampled it by importance, 0.2 nats off. The per-token offsets are the unit's local
    coordinates: Evidence, "order", "pll" and the masked conditionals equal the dense numpy
    closed form, and "auto" chooses "hierarchical"."""
    N, D = 4, 3
    g = np.random.default_rng(7)
    x = torch.tensor(g.normal(size=(N, D)))
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)

    def model(x):
        m = pyro.sample("m", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("data", N, dim=-2):
            z = pyro.sample("z", dist.Normal(m, 1.0))
            with pyro.plate("tokens", D, dim=-1):
                e = pyro.sample("e", dist.Normal(torch.zeros((), dtype=x.dtype), 0.5))
                pyro.sample("x", dist.Normal(z * w + e, 0.8), obs=x)

    T = N * D
    a = np.tile(w.numpy(), N)  # the global m reaches token (u, j) through z_u: w_j
    B = np.kron(np.eye(N), w.numpy()[:, None])
    cov = np.outer(a, a) + B @ B.T + (0.25 + 0.64) * np.eye(T)
    ref = _gauss_logpdf(x.numpy().reshape(-1), np.zeros(T), cov)
    kw = dict(token_plates=("data", "tokens"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert abs(float(Evidence(model, **kw)(x)) - ref) < TOL
        loss = MaskedPretrainingLoss(masks="order", **kw)
        assert abs(float(loss.score(model, None, x)) - ref) < TOL
        assert type(loss.memory.auto_engines.popitem()[1]).__name__ == "HierarchicalGaussianConditionals"
        pll = float(MaskedPretrainingLoss(masks="pll", **kw).score(model, None, x))
    assert abs(pll - numpy_leave_one_out(cov, x.numpy().reshape(-1)).sum()) < TOL
    engine = HierarchicalGaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {}, **kw)
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = torch.rand(3, T, generator=torch.Generator().manual_seed(1)) < 0.5
    out = engine.mask_log_prob(state, tokens.value, mask[:, None])[:, 0]
    r = x.numpy().reshape(-1)
    for q in range(3):
        m = mask[q].numpy()
        R = ~m
        K = np.linalg.solve(cov[np.ix_(R, R)], cov[np.ix_(R, m)])
        mean, var = K.T @ r[R], np.diag(cov[np.ix_(m, m)]) - (cov[np.ix_(R, m)] * K).sum(0)
        expected = -0.5 * (np.log(2 * np.pi * var) + (r[m] - mean) ** 2 / var)
        assert np.abs(out[q, mask[q]].numpy() - expected).max() < TOL


def test_affine_transforms_of_normals_are_normals():
    """Eight schools with theta ~ TransformedDistribution(Normal(0, 1), AffineTransform(mu, tau))
    and the observation an affine transform of a Normal: a linear-Gaussian hierarchy, which
    "hierarchical" and Evidence(method="exact") refused ("is TransformedDistribution, not
    Normal") and "auto" sampled by prior importance, 0.16 nats off without a warning. Evidence and
    the "order" score equal scipy's multivariate normal of the model's marginal."""
    from pyro.distributions.transforms import AffineTransform
    from scipy.stats import multivariate_normal

    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=torch.float64)
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=torch.float64)
    J, tau = 8, 3.0

    def schools(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(1.0, dtype=torch.float64), 5.0))
        with pyro.plate("schools", J):
            theta = pyro.sample("theta", dist.TransformedDistribution(
                dist.Normal(torch.zeros((), dtype=torch.float64), 1.0), [AffineTransform(mu, tau)]))
            # the observation as 2 + 0.5 * N(2 (theta - 2), sigma / 0.5): N(theta, sigma)
            obs = dist.TransformedDistribution(dist.Normal(2 * (theta - 2), sigma / 0.5), [AffineTransform(2.0, 0.5)])
            pyro.sample("obs", obs, obs=y)

    ref = multivariate_normal(np.ones(J), 25 * np.ones((J, J)) + tau**2 * np.eye(J) + np.diag(sigma.numpy() ** 2)).logpdf(y.numpy())
    kw = dict(token_plates=("schools",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert abs(float(Evidence(schools, **kw)(y)) - ref) < TOL
        assert abs(float(MaskedPretrainingLoss(masks="order", **kw).score(schools, None, y)) - ref) < TOL
        assert abs(float(MaskedPretrainingLoss(conditionals="hierarchical", masks="order", **kw).score(schools, None, y)) - ref) < TOL


def test_groups_declared_inside_their_observations_lead_the_refusals(float64):
    """A global mean around groups declared inside their observations' plate, with both as
    token plates (as the refusal of the global mean advises): the hierarchical engine, made for
    the model, refuses the plate order and says how to declare them; that advice came after the
    Gaussian route's, which told an Evidence(method='exact') caller to use
    Evidence(method='exact'), and "auto" went to importance sampling with no word of it (2.2
    nats off). Declared as advised, the model is exact against scipy."""
    import scipy.stats
    from pyro_mpt.conditionals import EngineFallbackWarning, EngineNotApplicable

    mu0, tau, sig, smu = 0.5, 1.3, 0.4, 2.0

    def inside(x):  # (members, groups): the groups at the inner dim
        mu = pyro.sample("mu", dist.Normal(torch.tensor(mu0), smu))
        with pyro.plate("groups", x.shape[1], dim=-1):
            th = pyro.sample("th", dist.Normal(mu, tau))
            with pyro.plate("members", x.shape[0], dim=-2):
                pyro.sample("x", dist.Normal(th, sig), obs=x)

    def around(x):  # (groups, members), as the refusal says
        mu = pyro.sample("mu", dist.Normal(torch.tensor(mu0), smu))
        with pyro.plate("groups", x.shape[0], dim=-2):
            th = pyro.sample("th", dist.Normal(mu, tau))
            with pyro.plate("members", x.shape[1], dim=-1):
                pyro.sample("x", dist.Normal(th, sig), obs=x)

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) + 1
    with pytest.raises(EngineNotApplicable) as refusal:
        Evidence(inside, token_plates=("members", "groups"))(x)
    assert str(refusal.value).startswith(
        "Evidence(method='exact'): the 'hierarchical' route, made for this form, needs the model written "
        "otherwise: conditionals='hierarchical' takes the outermost token plate 'members'"
    )
    with pytest.warns(EngineFallbackWarning, match="(?s)passing over 'hierarchical'.*Declare the plates the other way"):
        MaskedPretrainingLoss(masks="order", token_plates=("members", "groups")).score(inside, None, x)
    groups = np.tile(np.arange(4), 3)  # the groups of x's entries, row-major
    cov = sig**2 * np.eye(12) + tau**2 * (groups[:, None] == groups[None, :]) + smu**2
    truth = scipy.stats.multivariate_normal(np.full(12, mu0), cov).logpdf(x.reshape(-1).numpy())
    value = Evidence(around, token_plates=("groups", "members"))(x.T)
    assert abs(float(value.sum()) - truth) < 1e-10
