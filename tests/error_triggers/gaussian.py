"""Triggers of the docs/errors.md rows raised by gaussian."""

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, GaussianConditionals, MaskedPretrainingLoss

from models import make_full_gaussian, make_singular_ppca

from error_triggers.registry import trigger
from error_triggers.common import _bernoulli_model, _x


@trigger("gaussian-method")
def _():
    GaussianConditionals(method="woodbury")


@trigger("gaussian-jitter")
def _():
    GaussianConditionals(jitter=-1e-6)


@trigger("gaussian-lowrank-of-dense")
def _():
    model, x, _ = make_full_gaussian(3, 4)
    MaskedPretrainingLoss(conditionals=GaussianConditionals(method="lowrank")).loss(model, None, x)


@trigger("gaussian-negative-noise")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            fn = dist.LowRankMultivariateNormal(torch.zeros(3), torch.ones(3, 1), torch.tensor([1.0, -1.0, 1.0]))
            pyro.sample("x", fn, obs=x)

    with pyro.validation_enabled(False):
        MaskedPretrainingLoss(conditionals=GaussianConditionals(method="lowrank")).loss(model, None, _x())


def _singular_model():
    """Rank-1 PPCA whose covariance has mean diagonal 3.125 (the number docs/errors.md quotes)."""
    model, x, _ = make_singular_ppca(1e-9, w=[1.0, 2.0, -1.0, 0.5])
    return model, x


@trigger("gaussian-not-positive-definite")
def _():
    model, x = _singular_model()
    MaskedPretrainingLoss(conditionals=GaussianConditionals(method="dense", max_jitter=0.0)).loss(model, None, x)


@trigger("gaussian-jitter-rescue")
def _():
    model, x = _singular_model()
    MaskedPretrainingLoss(conditionals=GaussianConditionals(method="dense")).loss(model, None, x)


@trigger("gaussian-latent-kind")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Gamma(2.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ torch.ones(2, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())


@trigger("gaussian-latent-discrete")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Bernoulli(0.5))
            pyro.sample("x", dist.Normal(c.unsqueeze(-1) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())


@trigger("gaussian-observation-kind")
def _():
    MaskedPretrainingLoss(conditionals="gaussian").loss(_bernoulli_model(), None, torch.ones(4, 3))


@trigger("gaussian-noise-depends-on-latents")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(torch.zeros(3), z.exp()).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())


@trigger("gaussian-latent-scale-depends")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            b = pyro.sample("b", dist.Normal(0.0, a.exp()).to_event(1))
            pyro.sample("x", dist.Normal((a + b) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())


@trigger("gaussian-not-affine")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.sin() * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())




@trigger("gaussian-not-affine-at-posterior")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.clamp(-3.5, 3.5) * torch.ones(3), 0.3).to_event(1), obs=x)

    Evidence(model, method="exact")(torch.full((2, 3), 6.0))


@trigger("gaussian-noise-depends-at-posterior")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            scale = 0.3 + (z - 3.5).clamp(min=0.0)
            pyro.sample("x", dist.Normal(z * torch.ones(3), scale).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, torch.full((2, 3), 6.0))


@trigger("second-derivatives")
def _():
    # PPCA, masks shared by the batch, data many against the tokens: the aggregated form
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 2, generator=g)
    x = torch.randn(200, 4, generator=g)

    def model(x):
        s = pyro.param("s2nd", torch.tensor(0.5), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    loss = MaskedPretrainingLoss(masks="all", share_masks=True, conditionals="gaussian")
    value = loss.differentiable_loss(model, None, x)
    torch.autograd.grad(value, pyro.param("s2nd").unconstrained(), create_graph=True)


@trigger("gaussian-jitter-swamps-token")
def _():
    # explosive dynamics: the sequence's variances grow as 3^(2 t), 1e38 apart over 40 steps
    eye = torch.eye(2, dtype=torch.float64)
    lds = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), eye), 3.0 * eye,
                           dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), eye), torch.ones(2, 1, dtype=torch.float64),
                           dist.Normal(torch.zeros(1, dtype=torch.float64), 1.0).to_event(1), duration=40)

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", lds, obs=x)

    MaskedPretrainingLoss(conditionals=GaussianConditionals(method="dense")).loss(
        model, None, torch.randn(2, 40, 1, dtype=torch.float64))


@trigger("gaussian-per-point-fallback")
def _():
    G = 40
    grp = torch.arange(120) % G
    y = torch.randn(120)

    def model(grp, y):
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 120):
            pyro.sample("y", dist.Normal(a[grp], 0.5), obs=y)  # a[grp] indexes the points' dim

    MaskedPretrainingLoss(token_plates=("data",), conditionals="gaussian").loss(model, None, grp, y)
