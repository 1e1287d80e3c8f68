"""Models written the ordinary way that are as cheap as PPCA must not take a slower
path of the Gaussian engine (issue 14 §2, "no slow corner").

Each test checks the structure that makes the path cheap -- the largest tensor
that a loss + gradient creates, or the shapes of the marginal -- and the numbers
against references written outside the library (numpy, torch.distributions).
"""

import math

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals, gaussian_marginal
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_leave_one_out


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest storage any op returns
    (forward and backward passes alike; views count by their storage, so an
    expanded tensor counts as what it was expanded from)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.untyped_storage().nbytes() // t.element_size())
        return out


def _numpy_mvn_log_prob(x, loc, cov):
    L = np.linalg.cholesky(cov)
    u = np.linalg.solve(L, (x - loc).T)
    return -0.5 * (x.shape[1] * np.log(2 * np.pi) + 2 * np.log(np.diag(L)).sum() + (u**2).sum(0))


def test_exact_evidence_of_a_dense_shared_covariance_solves_the_batch_at_once():
    # a MultivariateNormal observation with one covariance for the batch: the
    # exact log-density solves its factor against all residuals as one matrix.
    # Broadcast against each datapoint, the solve and its gradient held an
    # (n, D, D) copy of the factor (67x slower at n=1000, D=100).
    n, D, K = 300, 40, 3
    g = torch.Generator().manual_seed(5)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    Psi = A @ A.T / D + 0.5 * torch.eye(D, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * 2

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z @ W.T, covariance_matrix=Psi), obs=x)

    pyro.clear_param_store()
    evidence = Evidence(model)
    evidence(x)
    W = pyro.param("W").unconstrained()
    # without validation: torch's check of the model's own covariance, broadcast
    # to the batch, is paid by any inference of this model (Trace_ELBO too)
    with pyro.validation_enabled(False), LargestTensor() as largest:
        lp = evidence(x)
        (grad,) = torch.autograd.grad(lp.sum(), W)
    assert largest.numel <= 4 * (n * D + D * D), largest.numel  # n * D * D = 480000

    S = (W0 @ W0.T + Psi).numpy()
    assert np.allclose(lp.detach().numpy(), _numpy_mvn_log_prob(x.numpy(), 0.0, S), atol=1e-8, rtol=0)
    Wr = W0.clone().requires_grad_()
    ref = dist.MultivariateNormal(torch.zeros(D, dtype=torch.float64), Wr @ Wr.T + Psi).log_prob(x).sum()
    (grad_ref,) = torch.autograd.grad(ref, Wr)
    assert torch.allclose(grad, grad_ref, atol=1e-8, rtol=1e-10)


@pytest.mark.parametrize("written", ["group_mean", "prior_mean"])
def test_a_location_that_varies_by_datapoint_runs_the_model_at_three_points(written):
    # a mean per group (tab[g_i]) or a latent prior mean per datapoint varies the
    # observed location by datapoint while the loading stays shared. Once the
    # engine has seen that, it runs the model at three per-datapoint points
    # (0, e_i for the first K datapoints, a random one) instead of K + 2 points
    # for every datapoint: (K + 2) n D values and their backward were 50 times
    # the exact log-density at K=50, D=200, n=1000
    n, D, K, G = 120, 9, 30, 4
    g = torch.Generator().manual_seed(7)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64) / K**0.5
    tab0 = torch.randn(G, D, generator=g, dtype=torch.float64)
    m0 = torch.randn(n, K, generator=g, dtype=torch.float64)
    grp = torch.randint(0, G, (n,), generator=g)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    s = 0.6

    def model(x):
        W, tab = pyro.param("W", W0.clone()), pyro.param("tab", tab0.clone())
        with pyro.plate("data", x.shape[0]):
            if written == "group_mean":
                z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            else:
                z = pyro.sample("z", dist.Normal(m0, torch.ones(n, K, dtype=x.dtype)).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + tab[grp], s).to_event(1), obs=x)

    pyro.clear_param_store()
    evidence = Evidence(model)
    evidence(x)  # learns that the location varies by datapoint
    with LargestTensor() as largest:
        lp = evidence(x)
        grads = torch.autograd.grad(lp.sum(), [pyro.param("W").unconstrained(), pyro.param("tab").unconstrained()])
    assert largest.numel <= 4 * n * (D + K), largest.numel  # (K + 2) n D = 34560

    # outside the library: the marginal N(tab[g_i] + W m_i, W W^T + s^2 I), by torch.distributions
    W, tab = W0.clone().requires_grad_(), tab0.clone().requires_grad_()
    loc = tab[grp] + (m0 @ W.T if written == "prior_mean" else 0.0)
    ref = torch.distributions.LowRankMultivariateNormal(loc, W, torch.full((D,), s**2, dtype=torch.float64)).log_prob(x)
    assert torch.allclose(lp, ref, atol=1e-9, rtol=0)
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), [W, tab])):
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-9)


def test_a_loading_that_varies_by_datapoint_is_not_taken_for_a_shared_one():
    # the three-point run verifies the shared loading at a random point per
    # datapoint: a loading scaled by a covariate falls back to K + 2 points
    n, D, K = 40, 5, 3
    g = torch.Generator().manual_seed(8)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    c = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(n, D, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", n):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(c[:, None] * (z @ W.T) + b, 0.4).to_event(1), obs=x)

    pyro.clear_param_store()
    evidence = Evidence(model)
    first = evidence(x)
    second = evidence(x)
    F = c[:, None, None] * W0  # (n, D, K)
    ref = torch.distributions.LowRankMultivariateNormal(b, F, torch.full((D,), 0.16, dtype=torch.float64)).log_prob(x)
    assert torch.allclose(first, ref, atol=1e-9, rtol=0) and torch.allclose(second, ref, atol=1e-9, rtol=0)


def test_a_model_that_does_not_broadcast_is_run_three_times_not_k_plus_two():
    # loc.reshape(n, 3, 4) (an image written for its own batch) cannot run
    # under an extra batch dim, so the marginal runs the model once per point.
    # With a shared loading, three per-datapoint points do instead of K + 2
    # (52 runs at K=50: 27-56x the PPCA written to broadcast)
    n, D, K = 50, 12, 20
    g = torch.Generator().manual_seed(9)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64) / K**0.5
    mu0 = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(n, 3, 4, generator=g, dtype=torch.float64)
    calls = []

    def image(x):
        calls.append(1)
        W, mu = pyro.param("W", W0.clone()), pyro.param("mu", mu0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            loc = (z @ W.T + mu).reshape(x.shape[0], 3, 4)
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(2), obs=x)

    pyro.clear_param_store()
    evidence = Evidence(image)
    evidence(x)  # finds the mode that works
    calls.clear()
    lp = evidence(x)
    assert len(calls) == 1 + 3, len(calls)  # the trace of the data, three points (the posterior points: once per data)

    W, mu = W0.clone().requires_grad_(), mu0.clone().requires_grad_()
    ref = torch.distributions.LowRankMultivariateNormal(mu, W, torch.full((D,), 0.25, dtype=torch.float64))
    ref = ref.log_prob(x.reshape(n, D))
    assert torch.allclose(lp, ref, atol=1e-9, rtol=0)
    got = torch.autograd.grad(lp.sum(), [pyro.param("W").unconstrained(), pyro.param("mu").unconstrained()])
    for a, b in zip(got, torch.autograd.grad(ref.sum(), [W, mu])):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-9)


def _mvn_noise_model(n, D, K, noise):
    g = torch.Generator().manual_seed(10)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi0 = torch.rand(D, generator=g, dtype=torch.float64) + 0.3

    def model(x):
        W = pyro.param("W", W0.clone())
        psi = pyro.param("psi", psi0.clone(), constraint=dist.constraints.positive)
        if noise == "scale_tril":
            kw = dict(scale_tril=psi.sqrt().diag_embed())
        elif noise == "covariance":
            kw = dict(covariance_matrix=torch.diag(psi))
        else:  # a Cholesky parameter that starts diagonal: its off-diagonal entries are free
            kw = dict(scale_tril=pyro.param("L", psi0.sqrt().diag_embed(), constraint=dist.constraints.lower_cholesky))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z @ W.T, **kw), obs=x)

    return model, W0, psi0


@pytest.mark.parametrize("noise", ["scale_tril", "covariance", "free_cholesky"])
def test_a_diagonal_noise_written_as_a_multivariate_normal_takes_the_low_rank_path(noise):
    # MultivariateNormal(loc, scale_tril=s * I) is Normal(loc, s).to_event(1):
    # kept dense, every mask cost O(D^3) (uniform masks: 17x PPCA at D=200,
    # K=50). A Cholesky parameter that is diagonal only at its current value
    # keeps the dense path: the gradient of its off-diagonal entries is not zero
    n, D, K = 30, 6, 2
    model, W0, psi0 = _mvn_noise_model(n, D, K, noise)
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    pyro.clear_param_store()
    tokens = trace_tokens(model, None, (x,), {})
    m = gaussian_marginal(tokens, model, (x,), {})
    assert m.is_low_rank == (noise != "free_cholesky")
    if m.is_low_rank:
        assert m.cov_factor.shape == (1, D, K) and m.cov_diag.shape == (1, D)

    names = ["W", "L"] if noise == "free_cholesky" else ["W", "psi"]
    params = [pyro.param(k).unconstrained() for k in names]
    lp = MaskedPretrainingLoss(masks="order").score(model, None, x)
    got = torch.autograd.grad(lp.sum(), params)

    # outside the library: torch.distributions' MultivariateNormal on the marginal
    W = W0.clone().requires_grad_()
    if noise == "free_cholesky":
        L = psi0.sqrt().diag_embed().requires_grad_()
        cov, wrt = W @ W.T + L @ L.T, [W, L]
    else:
        u = psi0.log().requires_grad_()  # psi's unconstrained value
        cov, wrt = W @ W.T + torch.diag(u.exp()), [W, u]
    ref = torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), cov).log_prob(x)
    assert torch.allclose(lp, ref, atol=1e-9, rtol=0)
    want = torch.autograd.grad(ref.sum(), wrt)
    if noise == "free_cholesky":
        # lower_cholesky's unconstrained space: off-diagonal entries as they are
        assert bool(got[1].tril(-1).ne(0).any())
        assert torch.allclose(got[1].tril(-1), want[1].tril(-1), atol=1e-8, rtol=1e-8)
        want = want[:1]
        got = got[:1]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-8)


def test_importance_runs_a_model_that_reshapes_by_its_batch_size_one_value_at_a_time():
    # loc.reshape(n, 2, -1) runs in the particle plate but puts the particles into
    # the event: the log-density then broadcast them against the data (a raw
    # shape error, or 45 GB at n=1000, D=200). The runner now treats it as a model
    # that does not broadcast: one run per value, warned, and the right numbers
    from pyro_mpt.conditionals import SlowEngineWarning

    n, D = 5, 6
    g = torch.Generator().manual_seed(12)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, 3, generator=g, dtype=torch.float64)

    def image(y):
        with pyro.plate("data", y.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1, dtype=y.dtype), 1.0).to_event(1))
            loc = (z * w).reshape(y.shape[0], 2, -1)
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(2), obs=y)

    pyro.set_rng_seed(0)
    with pytest.warns(SlowEngineWarning, match="does not broadcast over that dim"):
        result = Evidence(image, method="importance", num_samples=400).estimate(y)
    exact = torch.distributions.LowRankMultivariateNormal(
        torch.zeros(D, dtype=torch.float64), w[:, None], torch.ones(D, dtype=torch.float64)
    ).log_prob(y.reshape(n, D))
    assert result.log_evidence.shape == (n,)
    assert bool(((result.log_evidence - exact).abs() <= 5 * result.stderr + 1e-3).all()), (result.log_evidence, exact)


def test_a_low_rank_multivariate_normal_latent_is_served_in_closed_form():
    # LowRankMultivariateNormal(0, F, d) is a Gaussian latent like any other: it
    # was refused, so "auto" chose adaptive quadrature (45x slower at n=300,
    # D=30, K=4; importance beyond a few latent dims) and Evidence refused
    n, D, K = 40, 7, 3
    g = torch.Generator().manual_seed(13)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    F0 = torch.randn(K, 2, generator=g, dtype=torch.float64)
    d0 = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    x = torch.randn(n, D, generator=g, dtype=torch.float64)

    def model(x):
        W, F = pyro.param("W", W0.clone()), pyro.param("F", F0.clone())
        d = pyro.param("d", d0.clone(), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.LowRankMultivariateNormal(torch.zeros(K, dtype=x.dtype), F, d))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="order")
    lp = loss.score(model, None, x)
    assert [type(e).__name__ for e in loss.memory.auto_engines.values()] == ["GaussianConditionals"]
    ev = Evidence(model)(x)
    got = torch.autograd.grad(lp.sum(), [pyro.param(k).unconstrained() for k in ("W", "F", "d")])

    W, F, u = W0.clone().requires_grad_(), F0.clone().requires_grad_(), d0.log().requires_grad_()
    cov = W @ (F @ F.T + torch.diag(u.exp())) @ W.T + 0.25 * torch.eye(D, dtype=torch.float64)
    ref = torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), cov).log_prob(x)
    assert torch.allclose(lp, ref, atol=1e-9, rtol=0) and torch.allclose(ev, ref, atol=1e-9, rtol=0)
    for a, b in zip(got, torch.autograd.grad(ref.sum(), [W, F, u])):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-8)


def test_a_normal_latent_written_as_an_affine_transform_is_served_in_closed_form():
    # TransformedDistribution(Normal(0, 1), [AffineTransform(m, s)]) is N(m, |s|):
    # "auto" chose prior importance sampling for it (7 s at n=300, D=30, K=3,
    # and 58 nats off with 256 samples); now the Gaussian engine, exact
    from pyro.distributions.transforms import AffineTransform

    n, D, K = 30, 6, 2
    g = torch.Generator().manual_seed(14)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    m0 = torch.randn(K, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)

    def model(x):
        W, m = pyro.param("W", W0.clone()), pyro.param("m", m0.clone())
        s = pyro.param("s", torch.tensor(1.5, dtype=torch.float64), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            base = dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1)
            z = pyro.sample("z", dist.TransformedDistribution(base, [AffineTransform(m, -s, event_dim=1)]))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="order")
    lp = loss.score(model, None, x)
    assert [type(e).__name__ for e in loss.memory.auto_engines.values()] == ["GaussianConditionals"]
    got = torch.autograd.grad(lp.sum(), [pyro.param(k).unconstrained() for k in ("W", "m", "s")])

    W, m = W0.clone().requires_grad_(), m0.clone().requires_grad_()
    u = torch.tensor(1.5, dtype=torch.float64).log().requires_grad_()
    ref = torch.distributions.LowRankMultivariateNormal(m @ W.T, u.exp() * W, torch.full((D,), 0.25, dtype=torch.float64))
    ref = ref.log_prob(x)
    assert torch.allclose(lp, ref, atol=1e-9, rtol=0)
    for a, b in zip(got, torch.autograd.grad(ref.sum(), [W, m, u])):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-8)


_PER_MASK_PATHS = ("lowrank_shared_sums", "lowrank_shared_sums_embedded", "dense_shared_sums", "lowrank_weighted_sum",
                   "dense_weighted_sum", "lowrank_masks", "dense_masks", "routed_dense_sums",
                   "lowrank_independent_sums")


def _refuse_paths(monkeypatch, names=_PER_MASK_PATHS, what="a per-mask path"):
    """Make the Gaussian engine's paths ``names`` fail the test when taken (the spy of
    the tests that a cheaper path serves the queries)."""
    import pyro_mpt.conditionals.gaussian as gaussian_module

    for name in names:
        monkeypatch.setattr(gaussian_module, name, lambda *a, _n=name, **k: pytest.fail(f"{_n}: {what}"))


@pytest.mark.parametrize("form", ["counties", "ppca", "dense"])
def test_pll_takes_one_factorization_for_all_its_queries(form, monkeypatch):
    # masks="pll" hides each token once: one factorization of the covariance gives
    # every leave-one-out conditional. Through the per-mask sums it took D context
    # factorizations: Pyro's radon model (1000 houses, 85 counties, one datapoint of
    # 1000 tokens) 7.3 s a step, now 0.03 s; a GP of 300 points 4.4 -> 0.4 s
    _refuse_paths(monkeypatch)
    g = torch.Generator().manual_seed(11)
    f64 = dict(generator=g, dtype=torch.float64)
    if form == "counties":
        # a varying-intercept regression written as in Pyro's examples: 60 responses,
        # 12 groups and a global mean, scored as one datapoint (rank 13 over 60 tokens)
        N, G = 60, 12
        grp, u = torch.randint(0, G, (N,), generator=g), torch.randn(N, **f64)
        x = torch.randn(N, **f64)[None]

        def model(x):
            b = pyro.param("b", torch.tensor(0.4, dtype=torch.float64))
            sa = pyro.param("sa", torch.tensor(0.9, dtype=torch.float64), constraint=dist.constraints.positive)
            sy = pyro.param("sy", torch.tensor(0.7, dtype=torch.float64), constraint=dist.constraints.positive)
            mu_a = pyro.sample("mu_a", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 2.0))
            with pyro.plate("groups", G):
                a = pyro.sample("a", dist.Normal(mu_a, sa))
            with pyro.plate("data", N):
                pyro.sample("y", dist.Normal(a[..., grp] + b * u, sy), obs=x[0])

        def moments():
            b, sa, sy = (pyro.param(k) for k in ("b", "sa", "sy"))
            A = torch.nn.functional.one_hot(grp, G).to(torch.float64)
            return b * u, 4.0 + sa**2 * A @ A.T + sy**2 * torch.eye(N, dtype=torch.float64)

        options, args = dict(token_plates=("data",)), (x,)
    elif form == "ppca":
        n, D, K = 200, 12, 3
        x = torch.randn(n, D, **f64)
        W0 = torch.randn(D, K, **f64)

        def model(x):
            W = pyro.param("W", W0.clone())
            s = pyro.param("s", torch.tensor(0.5, dtype=torch.float64), constraint=dist.constraints.positive)
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
                pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

        def moments():
            W, s = pyro.param("W"), pyro.param("s")
            return torch.zeros(D, dtype=torch.float64), W @ W.T + s**2 * torch.eye(D, dtype=torch.float64)

        options, args = {}, (x,)
    else:
        # a GP written with a MultivariateNormal observation: the dense path
        N = 40
        t = torch.linspace(0, 5, N, dtype=torch.float64)
        x = (torch.sin(t) + 0.2 * torch.randn(N, **f64))[None]

        def moments():
            ls, s = pyro.param("ls"), pyro.param("s")
            return torch.zeros(N, dtype=torch.float64), torch.exp(-0.5 * (t[:, None] - t) ** 2 / ls**2) + s**2 * torch.eye(N, dtype=torch.float64)

        def model(x):
            pyro.param("ls", torch.tensor(0.8, dtype=torch.float64), constraint=dist.constraints.positive)
            pyro.param("s", torch.tensor(0.3, dtype=torch.float64), constraint=dist.constraints.positive)
            loc, S = moments()
            pyro.sample("y", dist.MultivariateNormal(loc, covariance_matrix=S), obs=x[0])

        options, args = {}, (x,)

    pyro.clear_param_store()
    pyro.poutine.trace(model).get_trace(*args)  # registers the params
    leaves = [p.unconstrained() for p in pyro.get_param_store().values()]
    loss = MaskedPretrainingLoss(masks="pll", **options)
    value = loss.differentiable_loss(model, None, *args)
    grads = torch.autograd.grad(value, leaves)
    loc, S = moments()
    want = numpy_leave_one_out(S.detach().numpy(), (x - loc).detach().numpy()).sum()
    assert abs(value.item() + want) <= 1e-8 * abs(want)
    # the gradient: autograd of the same closed form written with torch.linalg.inv
    Ki = torch.linalg.inv(S)
    var = 1 / torch.diagonal(Ki)
    ref = -(-0.5 * (torch.log(2 * math.pi * var) + ((x - loc) @ Ki) ** 2 * var)).sum()
    for got, exp in zip(grads, torch.autograd.grad(ref, leaves)):
        assert torch.allclose(got, exp, rtol=1e-8, atol=1e-8 * float(exp.abs().max()))
    # score() and the curve's one point (no gradient) take the same table
    score = MaskedPretrainingLoss(masks="pll", **options).score(model, None, *args)
    assert abs(score.sum().item() - want) <= 1e-8 * abs(want)


def test_pll_of_a_multi_output_gp_takes_one_factorization_for_all_its_queries(monkeypatch):
    # GPRegression with outputs y (B, N): B blocks sharing the kernel's N x N factor; a
    # token's conditional given the rest is the one given the rest of its output. Each
    # of the B N leave-one-out queries was one block query (B = 3, N = 150: 415 -> 6 ms
    # a step, float64, one thread)
    import pyro.contrib.gp as gp

    _refuse_paths(monkeypatch)
    g = torch.Generator().manual_seed(3)
    B, N = 3, 25
    X = torch.linspace(0, 5, N, dtype=torch.float64)
    y = torch.sin(X) + 0.3 * torch.randn(B, N, generator=g, dtype=torch.float64)
    pyro.clear_param_store()
    gpr = gp.models.GPRegression(X, y, gp.kernels.RBF(1).double(), noise=torch.tensor(0.2, dtype=torch.float64))
    loss = MaskedPretrainingLoss(masks="pll")
    params = [gpr.kernel.variance_unconstrained, gpr.kernel.lengthscale_unconstrained, gpr.noise_unconstrained]
    value = loss.differentiable_loss(gpr.model, lambda: None)
    grads = torch.autograd.grad(value, params)
    S = gpr.kernel(X) + (gpr.noise + gpr.jitter) * torch.eye(N, dtype=torch.float64)
    want = numpy_leave_one_out(S.detach().numpy(), y.numpy()).sum()
    assert abs(value.item() + want) <= 1e-8 * abs(want)
    Ki = torch.linalg.inv(S)
    var = 1 / torch.diagonal(Ki)
    ref = -(-0.5 * (torch.log(2 * math.pi * var) + (y @ Ki) ** 2 * var)).sum()
    for got, exp in zip(grads, torch.autograd.grad(ref, params)):
        assert abs(got.item() - exp.item()) <= 1e-8 * max(1.0, abs(exp.item()))


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_missing_tokens_with_masks_per_datapoint_take_the_independent_sums(method, monkeypatch):
    """Missing tokens (dist.mask) make a datapoint's context its observed tokens: the
    queries went through the per-(mask, datapoint) conditionals (lowrank_masks, a
    (q, n, D) table and its graph per block, checkpointed); the independent sums
    take them, hiding the missing tokens and summing the targets alone. PPCA N=1000,
    D=200, K=5, 10 % missing, masks='all', one thread: 9.5 -> 3.2 s, peak RSS 1.56 ->
    0.59 GB."""
    from pyro_mpt.masks import AllSizes, MaskSchedule

    _refuse_paths(monkeypatch, ("lowrank_masks", "dense_masks"), "per (mask, datapoint)")
    g = torch.Generator().manual_seed(21)
    n, D, K = 7, 9, 2
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    observed = torch.rand(n, D, generator=g) > 0.3
    observed[0] = True  # one datapoint without missing tokens

    def ppca(x):
        W = pyro.param("W", W0.clone())
        s = pyro.param("s", torch.tensor(0.6, dtype=torch.float64), constraint=dist.constraints.positive)
        with pyro.plate("data", n):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).mask(observed).to_event(1), obs=x)

    torch.manual_seed(4)
    blocks = list(AllSizes(2).blocks(n, D, max_elements=3 * n * D, observed=observed))
    for b in blocks:
        b.mask, b.draw = b.masks(), None
    assert len(blocks) >= 2 and blocks[0].mask.shape[1] == n

    class Replay(MaskSchedule):
        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            yield from blocks

    pyro.clear_param_store()
    pyro.poutine.trace(ppca).get_trace(x)
    leaves = [pyro.param("W").unconstrained(), pyro.param("s").unconstrained()]
    loss = MaskedPretrainingLoss(masks=Replay(1), conditionals=GaussianConditionals(method))
    value = loss.differentiable_loss(ppca, None, x)
    grads = torch.autograd.grad(value, leaves)

    # numpy: each target's Gaussian conditional on the datapoint's observed context;
    # torch: the same loop, for the gradient
    W, s = pyro.param("W"), pyro.param("s")
    S = W @ W.T + s**2 * torch.eye(D, dtype=torch.float64)
    Sn, xn = S.detach().numpy(), x.numpy()
    want, ref = 0.0, 0.0
    for b in blocks:
        for q in range(b.mask.shape[0]):
            for i in range(n):
                gain = float(b.gain[q, i])
                if gain <= 0:
                    continue
                coef = float(b.weight[q, 0]) * gain / max(int(b.size[q, 0]), 1)
                t = b.mask[q, i].numpy()
                c = observed[i].numpy() & ~t
                B = np.linalg.solve(Sn[np.ix_(c, c)], Sn[np.ix_(c, t)])
                mean, var = B.T @ xn[i, c], np.diag(Sn[np.ix_(t, t)]) - np.einsum("ct,ct->t", Sn[np.ix_(c, t)], B)
                want += coef * (-0.5 * (np.log(2 * np.pi * var) + (xn[i, t] - mean) ** 2 / var)).sum()
                tt, cc = b.mask[q, i], torch.as_tensor(c)
                Bt = torch.linalg.solve(S[cc][:, cc], S[cc][:, tt])
                m_t, v_t = Bt.T @ x[i, cc], S[tt][:, tt].diagonal() - (S[cc][:, tt] * Bt).sum(0)
                ref = ref + coef * (-0.5 * (torch.log(2 * math.pi * v_t) + (x[i, tt] - m_t) ** 2 / v_t)).sum()
    assert abs(value.item() + want) <= 1e-8 * abs(want)
    for got, exp in zip(grads, torch.autograd.grad(-ref, leaves)):
        assert torch.allclose(got, exp, rtol=1e-8, atol=1e-8 * float(exp.abs().max()))


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_pll_with_a_noise_scale_per_datapoint_factors_each_datapoint_once(method, monkeypatch):
    # a noise scale that depends on a covariate (heteroscedastic factor analysis) gives
    # every datapoint its own covariance: the leave-one-out table factors each datapoint's
    # once, where the per-mask paths factored a context per token and datapoint (N=1000,
    # D=50, K=5, one thread: 506 -> 17 ms a step; Evidence 6 ms)
    _refuse_paths(monkeypatch)
    g = torch.Generator().manual_seed(8)
    n, D, K = 30, 7, 2
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    u = torch.randn(n, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)

    def model(x):
        W = pyro.param("W", W0.clone())
        a = pyro.param("a", torch.tensor(0.4, dtype=torch.float64))
        with pyro.plate("data", n):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, (a * u).exp().unsqueeze(-1)).to_event(1), obs=x)

    pyro.clear_param_store()
    pyro.poutine.trace(model).get_trace(x)
    leaves = [pyro.param(k).unconstrained() for k in ("W", "a")]
    loss = MaskedPretrainingLoss(masks="pll", conditionals=GaussianConditionals(method))
    value = loss.differentiable_loss(model, None, x)
    grads = torch.autograd.grad(value, leaves)
    W, a = pyro.param("W"), pyro.param("a")
    S = W @ W.T + torch.diag_embed((2 * a * u).exp().unsqueeze(-1).expand(n, D))  # (n, D, D)
    Sn = S.detach().numpy()
    want = sum(numpy_leave_one_out(Sn[i], x[i : i + 1].numpy()).sum() for i in range(n))
    assert abs(value.item() + want) <= 1e-8 * abs(want)
    Ki = torch.linalg.inv(S)
    var = 1 / torch.diagonal(Ki, dim1=-2, dim2=-1)
    ref = -(-0.5 * (torch.log(2 * math.pi * var) + (Ki @ x.unsqueeze(-1)).squeeze(-1) ** 2 * var)).sum()
    for got, exp in zip(grads, torch.autograd.grad(ref, leaves)):
        assert torch.allclose(got, exp, rtol=1e-8, atol=1e-8 * float(exp.abs().max()))


def test_leave_one_out_targets_against_a_row_by_row_check():
    """leave_one_out_targets (one count over the table, then each row's first target) finds
    the target of every query exactly when each row hides one token, as a row-by-row
    Python check says: tables with a row of two targets and one of none (the same total),
    one query, an empty row, and a strided (non-contiguous) table."""
    from pyro_mpt.conditionals.gaussian_leave_one_out import leave_one_out_targets

    def brute(mask):
        rows = [torch.nonzero(r)[:, 0].tolist() for r in mask]
        if mask.shape[0] < 2 or any(len(r) != 1 for r in rows):
            return None
        return [r[0] for r in rows]

    g = torch.Generator().manual_seed(3)
    eye = torch.eye(7, dtype=torch.bool)[torch.randperm(7, generator=g)]
    two_and_none = eye.clone()
    two_and_none[1, :] = False
    two_and_none[2, torch.nonzero(eye[1])[0, 0]] = True
    cases = [eye, two_and_none, eye[:1], eye & False, eye.T.contiguous().T[:, ::2], eye[:, :5]]
    for mask in cases:
        got = leave_one_out_targets(mask)
        want = brute(mask)
        assert (got is None) == (want is None)
        if want is not None:
            assert got.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_loading_of_rank_near_d_takes_the_dense_path_for_masks_per_datapoint(dtype, monkeypatch):
    """Masks drawn per datapoint cost a low-rank query a K x K context precision, a dense one a
    block of at most D tokens: at K = 0.95 D (D = 40, N = 200, "all", one thread) the low-rank
    sums took 14.6 times the dense path's time and 17 times its memory (2.4 s, 631 MB). "auto"
    now takes the state's dense twin there: the same values and gradients as method="lowrank",
    with missing tokens too; at K = D/5 it keeps the low-rank sums."""
    import pyro_mpt.conditionals.gaussian as gaussian_module

    g = torch.Generator().manual_seed(5)
    n, D = 6, 10
    x = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    observed = torch.rand(n, D, generator=g) > 0.2
    observed[0] = True
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    real = gaussian_module.lowrank_independent_sums

    for K, twin in ((9, True), (2, False)):
        W0 = (torch.randn(D, K, generator=g, dtype=torch.float64) / math.sqrt(K)).to(dtype)

        def ppca(x, mask=None):
            W = pyro.param("W", W0.clone())
            s = pyro.param("s", torch.tensor(0.6, dtype=dtype), constraint=dist.constraints.positive)
            with pyro.plate("data", n):
                z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=dtype), 1.0).to_event(1))
                obs = dist.Normal(z @ W.T, s)
                pyro.sample("x", (obs if mask is None else obs.mask(mask)).to_event(1), obs=x)

        runs = {}
        for method in ("lowrank", "auto"):
            calls = []
            monkeypatch.setattr(gaussian_module, "lowrank_independent_sums",
                                lambda *a, _calls=calls, **k: _calls.append(1) or real(*a, **k))
            for mask in (None, observed):
                pyro.clear_param_store()
                pyro.poutine.trace(ppca).get_trace(x, mask)
                leaves = [pyro.param("W").unconstrained(), pyro.param("s").unconstrained()]
                torch.manual_seed(3)
                loss = MaskedPretrainingLoss(masks="all", num_masks=2, conditionals=GaussianConditionals(method))
                value = loss.differentiable_loss(ppca, None, x, mask)
                runs[method, mask is None] = (value.detach(), torch.autograd.grad(value, leaves))
            assert bool(calls) == (method == "lowrank" or not twin), (K, method)
        for full in (True, False):
            (v0, g0), (v1, g1) = runs["lowrank", full], runs["auto", full]
            assert v1.dtype == dtype and abs(float(v1 - v0)) <= tol * abs(float(v0))
            for a, b in zip(g0, g1):
                assert torch.allclose(a, b, rtol=tol, atol=tol * float(a.abs().max()))
