"""Triggers of the docs/errors.md rows raised by engine choice."""

import torch

from pyro_mpt import MaskedPretrainingLoss, QuadratureConditionals


from error_triggers.registry import trigger
from error_triggers.common import _global_latent_model, _ppca, _x


@trigger("engine-unknown-name")
def _():
    MaskedPretrainingLoss(conditionals="exact")


@trigger("engine-auto-unknown-option")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(num_sample=8).loss(model, None, x)


@trigger("engine-unknown-option")
def _():
    MaskedPretrainingLoss(conditionals="quadrature", num_samples=64)


@trigger("engine-instance-options")
def _():
    MaskedPretrainingLoss(conditionals=QuadratureConditionals(), num_nodes=3)


@trigger("loss-misspelled-keyword")
def _():
    MaskedPretrainingLoss(mask="all")


@trigger("loss-chunk-size")
def _():
    MaskedPretrainingLoss(chunk_size=0)


@trigger("loss-elbo-option")
def _():
    MaskedPretrainingLoss(num_particles=10)


@trigger("engine-auto-none-applies")
def _():
    MaskedPretrainingLoss().loss(_global_latent_model, None, _x())


@trigger("engine-x-shape")
def _():
    from pyro_mpt.observed_tokens import trace_tokens

    model, x = _ppca()
    tokens = trace_tokens(model, None, (x,), {})
    engine = QuadratureConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    engine.mask_log_prob(state, x[:2], torch.ones(1, 2, 3, dtype=torch.bool))




@trigger("engine-auto-slow-grid")
def _():
    from pyro_mpt.experiments.vae import DeepVAE

    torch.manual_seed(0)
    vae = DeepVAE(6, latent_dim=4, hidden=(8,))
    x = torch.bernoulli(torch.full((3, 6), 0.5))
    MaskedPretrainingLoss().loss(vae.model, vae.guide, x)


@trigger("engine-auto-fallback")
def _():
    import pyro
    import pyro.distributions as dist

    # more components than the enumerate engine runs one value at a time (MAX_VALUE_RUNS = 64)
    locs = torch.randn(65, 2, generator=torch.Generator().manual_seed(0))
    x = torch.tensor([[-3.1, 0.2], [2.9, 1.1], [3.2, 0.8]])

    def gmm(x):
        n = x.shape[0]
        with pyro.plate("data", n):
            assignment = pyro.sample("assignment", dist.Categorical(torch.ones(65) / 65))
            loc = locs[assignment.reshape(-1, n)].reshape(assignment.shape + (2,))
            pyro.sample("obs", dist.Normal(loc, 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(num_samples=8).loss(gmm, None, x)
