"""Triggers of the docs/errors.md rows raised by quadrature."""

import torch
import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

from pyro_mpt import Evidence, MaskedPretrainingLoss, QuadratureConditionals
from pyro_mpt.conditionals.quadrature_rules import hermite_rule

from models import make_ppca

from error_triggers.registry import trigger
from error_triggers.common import _global_latent_model, _mm_model, _ppca, _x


@trigger("quadrature-num-nodes")
def _():
    QuadratureConditionals(num_nodes=0)


@trigger("quadrature-max-latent-dim")
def _():
    QuadratureConditionals(max_latent_dim=5)


@trigger("quadrature-target-grids")
def _():
    QuadratureConditionals(target_grids=-1)


@trigger("quadrature-rule-num-nodes")
def _():
    hermite_rule(0)


@trigger("quadrature-discrete-latent")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Bernoulli(0.5).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(c.expand(-1, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, _x())


@trigger("quadrature-latent-kind")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            p = pyro.sample("p", dist.ProjectedNormal(torch.ones(3)))  # on the sphere: no biject_to
            pyro.sample("x", dist.Normal(p, 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, _x())


class _NoBijection(dist.Gamma):
    """A continuous scalar latent whose support has no bijection to the real line."""

    support = constraints.dependent


@trigger("quadrature-no-bijection")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            s = pyro.sample("s", _NoBijection(2.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(s.expand(-1, 3), 1.0).to_event(1), obs=x)

    with pyro.validation_enabled(False):
        MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, _x())


@trigger("quadrature-too-many-latent-dims")
def _():
    model, x = _ppca(D=6, K=5)
    MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, x)


@trigger("quadrature-observation-not-factorized")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z.expand(-1, 3), torch.eye(3)), obs=x)

    MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, _x())


@trigger("quadrature-per-node-fallback")
def _():
    MaskedPretrainingLoss(conditionals="quadrature").loss(_mm_model, None, _x())


@trigger("quadrature-node-runs")
def _():
    quad = QuadratureConditionals(num_nodes=100, adaptive=False, min_ess=None, max_node_runs=50)
    MaskedPretrainingLoss(conditionals=quad).loss(_mm_model, None, _x())


@trigger("quadrature-model-does-not-broadcast")
def _():
    def model(x):
        W = torch.ones(3, 1)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            loc = torch.mm(z, W.T)
            if bool((z.abs() > 6).any()):
                raise ValueError("the model was written for |z| <= 6")  # the outer Hermite nodes
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals=QuadratureConditionals(num_nodes=40, adaptive=False)).loss(model, None, _x())


@trigger("quadrature-laplace-not-finite")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Uniform(torch.zeros(3), z.exp() * torch.ones(3) + 1).to_event(1), obs=x)

    with pyro.validation_enabled(False):
        MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, -torch.ones(4, 3))


@trigger("quadrature-grid-too-coarse")
def _():
    model, x, _ = make_ppca(12, 2, 4, sigma=0.05)
    engine = QuadratureConditionals(3, adaptive=False)
    MaskedPretrainingLoss(conditionals=engine).loss(model, None, x)


@trigger("quadrature-log-density-nan")
def _():
    W = torch.tensor([[4.0], [0.5], [-0.3]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Poisson((z @ W.T + 3.0).exp()).to_event(1), obs=x)

    # float32: the rate overflows at the outer nodes of a 128-node prior-centred grid
    MaskedPretrainingLoss(conditionals=QuadratureConditionals(adaptive=False)).loss(model, None, torch.ones(3, 3))


@trigger("evidence-quadrature-tolerance-value")
def _():
    model, x, _ = make_ppca(4, 1, 3)
    Evidence(model, method="quadrature", tol=-1)(x)


@trigger("evidence-quadrature-error-nodes")
def _():
    model, x, _ = make_ppca(4, 1, 3)
    Evidence(model, method="quadrature", error_nodes=0)(x)


@trigger("evidence-quadrature-tol")
def _():
    model, x, _ = make_ppca(12, 2, 4, sigma=0.05)
    Evidence(model, method="quadrature", num_nodes=3, adaptive=False, tol=1e-9)(x)


@trigger("evidence-quadrature-tol-rounding")
def _():
    g = torch.Generator().manual_seed(6)
    w, b = 0.5 * torch.randn(800, generator=g), torch.randn(800, generator=g)  # float32, |log p| about 1260

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z * w + b, 0.05).to_event(1), obs=x)

    x = torch.randn(1, 1, generator=g) * w + b + 0.05 * torch.randn(1, 800, generator=g)
    Evidence(model, method="quadrature", tol=5e-4)(x)


@trigger("evidence-quadrature-not-applicable")
def _():
    Evidence(_global_latent_model, method="quadrature")(_x())


def _sharp_poisson():
    """A 1-D latent whose posterior given 40 counts is much narrower than the prior."""
    g = torch.Generator().manual_seed(0)
    x = torch.poisson(torch.full((3, 40), 5.0, dtype=torch.float64), generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            rate = torch.exp(1.0 + z)[..., None].expand(z.shape + (40,))
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)

    return model, x


@trigger("quadrature-grid-unresolved")
def _():
    model, x = _sharp_poisson()
    Evidence(model, method="quadrature", adaptive=False, num_nodes=8)(x)


@trigger("quadrature-newton-not-converged")
def _():
    model, x = _sharp_poisson()
    MaskedPretrainingLoss(conditionals=QuadratureConditionals(newton_steps=0)).loss(model, None, x)


@trigger("evidence-quadrature-inaccurate")
def _():
    g = torch.Generator().manual_seed(0)
    W = 1.5 * torch.randn(3, 2, generator=g)
    x = torch.poisson(torch.exp(torch.randn(6, 2, generator=g) @ W.T), generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(z @ W.T)).to_event(1), obs=x)

    Evidence(model, method="quadrature", num_nodes=3)(x)


@trigger("quadrature-conditionals-inaccurate")
def _():
    g = torch.Generator().manual_seed(0)
    W = 0.7 * torch.randn(12, 2, generator=g)
    x = torch.poisson(torch.exp(torch.randn(4, 2, generator=g) @ W.T), generator=g)
    x[:, 0] = 7.0

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(z @ W.T)).to_event(1), obs=x)

    MaskedPretrainingLoss(masks="pll", conditionals=QuadratureConditionals(4)).loss(model, None, x)


@trigger("quadrature-evidence-inaccurate")
def _():
    # the stick-breaking coordinates' exponential tails: 8 nodes a dim leave ~1e-3 nats
    x = torch.tensor([[0.0, 1.0, 2.0, 2.0], [1.0, 1.0, 0.0, 2.0]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            th = pyro.sample("th", dist.Dirichlet(torch.tensor([1.5, 2.0, 0.7])))
            pyro.sample("x", dist.Categorical(th.unsqueeze(-2).expand(th.shape[:-1] + (4, 3))).to_event(1), obs=x)

    MaskedPretrainingLoss(masks="order").loss(model, None, x)


def _two_mode_model():
    """z ~ N(0, 2), x_d ~ N(z^2, 0.5): the posterior given x near 4 has two equal modes at +-2."""
    x = torch.tensor([[4.2, 3.7, 4.1, 3.9, 4.5, 4.0]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 2.0))
            pyro.sample("x", dist.Normal((z**2).unsqueeze(-1) * torch.ones(x.shape[-1]), 0.5).to_event(1), obs=x)

    return model, x


@trigger("quadrature-other-mode")
def _():
    model, x = _two_mode_model()
    MaskedPretrainingLoss(masks="order", conditionals="quadrature").score(model, None, x)


@trigger("evidence-quadrature-other-mode")
def _():
    model, x = _two_mode_model()
    Evidence(model, method="quadrature", check_modes=True)(x)


@trigger("evidence-quadrature-tol-other-mode")
def _():
    model, x = _two_mode_model()
    Evidence(model, method="quadrature", tol=1e-3)(x)
