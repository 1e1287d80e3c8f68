"""Triggers of the docs/errors.md rows raised by conditionals/hierarchical.py."""

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import MaskedPretrainingLoss

from error_triggers.registry import trigger
from error_triggers.common import _ppca


def _x(n=4, D=2):
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@trigger("hierarchical-one-token-plate")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="hierarchical").loss(model, None, x)


@trigger("hierarchical-units-inside")
def _():
    def lmm(y):
        with pyro.plate("groups", y.shape[1], dim=-1):
            a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
            with pyro.plate("obs", y.shape[0], dim=-2):
                pyro.sample("y", dist.Normal(a, 0.5), obs=y)

    loss = MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("groups", "obs"))
    loss.loss(lmm, None, torch.zeros(3, 2, dtype=torch.float64))


@trigger("hierarchical-no-local-latent")
def _():
    def regression(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(w, 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("data",)).loss(regression, None, _x())


def _pairs_around_a_global_mean(scale_of):
    """mu ~ N(0, 1) global, z_n ~ N(mu, 1) local, x_n ~ N(z_n, scale_of(mu)) on 2 tokens."""

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z[..., None].expand(z.shape + (2,)), scale_of(mu)).to_event(1), obs=x)

    return model


@trigger("hierarchical-not-linear-gaussian")
def _():
    lognormal_scale = _pairs_around_a_global_mean(lambda mu: mu.exp()[..., None])
    MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("data",)).loss(lognormal_scale, None, _x())


@trigger("hierarchical-discrete-latent")
def _():
    def classes(y):
        with pyro.plate("groups", y.shape[0], dim=-2):
            c = pyro.sample("c", dist.Categorical(torch.ones(2, dtype=y.dtype) / 2))
            with pyro.plate("items", y.shape[1], dim=-1):
                a = pyro.sample("a", dist.Normal(c.to(y.dtype), 1.0))
                pyro.sample("y", dist.Normal(a, 0.5), obs=y)

    MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("items",)).loss(classes, None, _x())


@trigger("hierarchical-tiny-noise")
def _():
    tiny = _pairs_around_a_global_mean(lambda mu: 1e-7)
    MaskedPretrainingLoss(masks="uniform", token_plates=("data",)).loss(tiny, None, _x(8))
