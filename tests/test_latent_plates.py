"""Latent dims declared with a ``pyro.plate`` inside the data plate (PPCA written
``with pyro.plate("k", K): z = pyro.sample("z", Normal(0, 1))``): the Gaussian
engine takes that plate's dims as event dims of the latent, so the model gets
its exact marginal. Reference: torch's LowRankMultivariateNormal(mu, W, s^2 I),
written outside the library."""

import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals

N, D, K = 7, 5, 3


def _params():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(D, K, generator=g, dtype=torch.float64).requires_grad_()
    mu = torch.randn(D, generator=g, dtype=torch.float64).requires_grad_()
    log_s = torch.tensor(-0.3, dtype=torch.float64, requires_grad=True)
    x = 2 * torch.randn(N, D, generator=g, dtype=torch.float64)
    return W, mu, log_s, x


def _models(W, mu, log_s):
    def data_left(x):  # data plate at -2, latent plate at -1: z is (N, K)
        with pyro.plate("data", N, dim=-2):
            with pyro.plate("k", K, dim=-1):
                z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            loc = (z @ W.T + mu).unsqueeze(-2)
            pyro.sample("x", dist.Normal(loc, log_s.exp()).to_event(1), obs=x.unsqueeze(-2))

    def data_right(x):  # data plate at -1, latent plate at -2: z is (K, N), transposed for the observation
        with pyro.plate("data", N, dim=-1):
            with pyro.plate("k", K, dim=-2):
                z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            pyro.sample("x", dist.Normal(z.transpose(-1, -2) @ W.T + mu, log_s.exp()).to_event(1), obs=x)

    def implicit_dims(x):  # no dims given: Pyro puts "data" at -1 and "k" at -2
        with pyro.plate("data", N):
            with pyro.plate("k", K):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
            loc = torch.einsum("kn,dk->nd", z, W) + mu
            pyro.sample("x", dist.Normal(loc, log_s.exp()).to_event(1), obs=x)

    def broadcasting(x):  # data at -1, latent plate at -2, observation written to broadcast over dims on the left
        with pyro.plate("data", N, dim=-1):
            with pyro.plate("k", K, dim=-2):
                z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            loc = (z.unsqueeze(-1) * W.T.unsqueeze(-2)).sum(-3) + mu  # (..., N, D)
            pyro.sample("x", dist.Normal(loc, log_s.exp()).to_event(1), obs=x)

    def matrix_t(x):  # z.T, written for the plain (K, N) shape only
        with pyro.plate("data", N):
            with pyro.plate("k", K):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
            pyro.sample("x", dist.Normal(z.T @ W.T + mu, log_s.exp()).to_event(1), obs=x)

    return {"data_left": data_left, "data_right": data_right, "implicit_dims": implicit_dims,
            "broadcasting": broadcasting, "matrix_t": matrix_t}


LAYOUTS = ["data_left", "data_right", "implicit_dims", "broadcasting", "matrix_t"]


def _reference(W, mu, log_s, x):
    cov_diag = (2 * log_s).exp().expand(D)
    return torch.distributions.LowRankMultivariateNormal(mu, W, cov_diag).log_prob(x)


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")  # matrix_t, run once with the points' dim
@pytest.mark.parametrize("layout", LAYOUTS)
def test_evidence_and_gradients_match_the_low_rank_normal(layout):
    W, mu, log_s, x = _params()
    model = _models(W, mu, log_s)[layout]
    truth = _reference(W, mu, log_s, x)
    got = Evidence(model, method="exact")(x)
    assert got.shape == ((N, 1) if layout == "data_left" else (N,))  # the observed site's batch shape
    got = got.reshape(N)
    assert float((got - truth).abs().max()) < 1e-8
    g_got = torch.autograd.grad(got.sum(), (W, mu, log_s))
    g_ref = torch.autograd.grad(truth.sum(), (W, mu, log_s))
    for a, b in zip(g_got, g_ref):
        assert float((a - b).abs().max()) < 1e-8


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")  # matrix_t, run once with the points' dim
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masks", ["exhaustive", "order"])
def test_mpt_score_is_exact_and_auto_picks_the_gaussian_engine(layout, masks):
    W, mu, log_s, x = _params()
    model = _models(W, mu, log_s)[layout]
    truth = _reference(W, mu, log_s, x)
    loss = MaskedPretrainingLoss(masks=masks)  # conditionals="auto"
    score = loss.score(model, None, x).reshape(N)
    assert float((score - truth).abs().max()) < 1e-8
    assert [type(e) for e in loss.memory.auto_engines.values()] == [GaussianConditionals]
    g_got = torch.autograd.grad(loss.differentiable_loss(model, None, x), (W, mu, log_s))
    g_ref = torch.autograd.grad(-truth.sum(), (W, mu, log_s))
    for a, b in zip(g_got, g_ref):
        assert float((a - b).abs().max()) < 1e-8


def test_a_latent_plate_and_an_event_dim_together():
    # z in plate "k" (K) with its own event dim 2: coordinates K * 2, ordered (plate, event)
    g = torch.Generator().manual_seed(5)
    A = torch.randn(D, K, 2, generator=g, dtype=torch.float64)
    mu = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", N, dim=-1):
            with pyro.plate("k", K, dim=-2):
                z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))  # (K, N, 2)
            loc = torch.einsum("...knj,dkj->...nd", z, A) + mu
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)

    truth = torch.distributions.LowRankMultivariateNormal(mu, A.reshape(D, 2 * K), torch.full((D,), 0.25, dtype=torch.float64)).log_prob(x)
    assert float((Evidence(model, method="exact")(x) - truth).abs().max()) < 1e-8


def test_quadrature_takes_the_plate_as_event_dims():
    # non-Gaussian latents: the plate writing and the .to_event(1) writing are the same
    # model, so quadrature's values agree (same nodes); Normal latents: exact
    g = torch.Generator().manual_seed(7)
    W = torch.randn(4, 2, generator=g, dtype=torch.float64)
    mu = torch.randn(4, generator=g, dtype=torch.float64)
    x = 2 * torch.randn(6, 4, generator=g, dtype=torch.float64)

    def in_plate(prior):
        def model(x):
            with pyro.plate("data", 6, dim=-1):
                with pyro.plate("k", 2, dim=-2):
                    z = pyro.sample("z", prior)  # (..., 2, 6)
                loc = (z.unsqueeze(-1) * W.T.unsqueeze(-2)).sum(-3, keepdim=True) + mu  # broadcasts over dims on the left
                pyro.sample("x", dist.Normal(loc, 0.7).to_event(1), obs=x)
        return model

    def as_event(prior):
        def model(x):
            with pyro.plate("data", 6, dim=-1):
                z = pyro.sample("z", prior.expand([2]).to_event(1))
                pyro.sample("x", dist.Normal(z @ W.T + mu, 0.7).to_event(1), obs=x)
        return model

    gamma = dist.Gamma(torch.tensor(2.0, dtype=torch.float64), 1.0)
    a = Evidence(in_plate(gamma), method="quadrature")(x).reshape(6)
    b = Evidence(as_event(gamma), method="quadrature")(x)
    assert float((a - b).abs().max()) < 1e-8 * float(b.abs().max())
    normal = dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    truth = torch.distributions.LowRankMultivariateNormal(mu, W, torch.full((4,), 0.49, dtype=torch.float64)).log_prob(x)
    score = MaskedPretrainingLoss(conditionals="quadrature", masks="order").score(in_plate(normal), None, x).reshape(6)
    assert float((score - truth).abs().max()) < 1e-8


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")
@pytest.mark.parametrize("layout", ["matrix_t", "implicit_dims"])
def test_quadrature_runs_a_transposed_latent_one_node_at_a_time(layout):
    # z.T and einsum("kn,dk->nd") fail in the node plate: run per node, exact for a Gaussian posterior
    from pyro_mpt.conditionals import SlowEngineWarning

    W, mu, log_s, x = _params()
    model = _models(W, mu, log_s)[layout]
    truth = _reference(W, mu, log_s, x)
    with pytest.warns(SlowEngineWarning, match="once per node"):
        got = Evidence(model, method="quadrature", num_nodes=3, adaptive=True)(x).reshape(N)
    assert float((got - truth).abs().max()) < 1e-8
    g_got = torch.autograd.grad(got.sum(), (W, mu, log_s))
    g_ref = torch.autograd.grad(truth.sum(), (W, mu, log_s))
    for a, b in zip(g_got, g_ref):
        assert float((a - b).abs().max()) < 1e-8
