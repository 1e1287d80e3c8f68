"""Triggers of the docs/errors.md rows raised by encode_decode / importance."""

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import EncodeDecodeConditionals, ImportanceConditionals, MaskedPretrainingLoss

from models import make_full_gaussian

from error_triggers.registry import trigger
from error_triggers.common import _guided_ppca, _ppca, _x


@trigger("engine-tokens-hidden-chain")
def _():
    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            b = pyro.sample("b", dist.Normal(0.0, 1.0))
            emission = dist.Normal(torch.tensor([-1.0, 1.0]) + b[..., None, None], 1.0)
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), emission), obs=x)

    MaskedPretrainingLoss(conditionals="importance").loss(model, None, torch.randn(3, 5))


@trigger("engine-tokens-not-independent")
def _():
    model, x, _ = make_full_gaussian(3, 4)

    def guide(x):
        pass

    MaskedPretrainingLoss(conditionals="importance").loss(model, guide, x)


@trigger("engine-multinomial-counts")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            theta = pyro.sample("theta", dist.Dirichlet(torch.ones(3)))
            pyro.sample("x", dist.Multinomial(5, theta), obs=x)

    MaskedPretrainingLoss(conditionals="importance").loss(model, None, torch.tensor([[2.0, 2.0, 1.0], [0.0, 5.0, 0.0]]))


@trigger("engine-one-hot-tokens")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.ones(2) / 2))
            pyro.sample("x", dist.OneHotCategorical(torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])[c]), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, torch.eye(3)[[0, 2]])


@trigger("encode-decode-autoguide")
def _():
    from pyro.infer.autoguide import AutoDiagonalNormal

    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, AutoDiagonalNormal(model), x)


@trigger("encode-decode-autodelta")
def _():
    from pyro.infer.autoguide import AutoDelta

    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, AutoDelta(model), x)


@trigger("encode-decode-init")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(init="zeros")).loss(model, guide, x)


@trigger("encode-decode-counts")
def _():
    EncodeDecodeConditionals(num_samples=0)


@trigger("encode-decode-mode")
def _():
    EncodeDecodeConditionals(encode="mode")


@trigger("encode-decode-needs-guide")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, None, x)


@trigger("encode-decode-not-amortized")
def _():
    model, x = _ppca()
    z_loc = torch.zeros(4, 1, dtype=torch.float64)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(z_loc, 1.0).to_event(1))

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, x)


@trigger("latent-mean-undefined")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Stable(0.5, 0.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, _x())


@trigger("importance-num-samples")
def _():
    ImportanceConditionals(num_samples=0)


@trigger("importance-proposal")
def _():
    ImportanceConditionals(proposal="posterior")


@trigger("importance-num-iterations")
def _():
    ImportanceConditionals(num_iterations=-1)


@trigger("importance-prior-weight")
def _():
    ImportanceConditionals(prior_weight=1.0)


@trigger("importance-num-chains")
def _():
    ImportanceConditionals(num_chains=0)


@trigger("importance-cache-elements")
def _():
    ImportanceConditionals(cache_elements=-1)


@trigger("importance-guide-needed")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals=ImportanceConditionals(proposal="guide")).loss(model, None, x)




@trigger("encode-decode-chains-ran-away")
def _():
    b = torch.tensor([1.0, 2.0, 1.5])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Poisson(torch.exp(b * z.unsqueeze(-1))).to_event(1), obs=x)

    def guide(x):  # an encoder that grows with the counts: the chains feed it larger ones
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x.sum(-1), 0.1))

    MaskedPretrainingLoss(conditionals="encode_decode", masks="order", check_amortized=False).score(
        model, guide, torch.tensor([[3.0, 5.0, 4.0], [1.0, 2.0, 6.0]]))


@trigger("runner-log-density-nan")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            # the rate overflows to inf for z > 0.09: Poisson's log_prob is inf - inf there
            pyro.sample("x", dist.Poisson(torch.exp(1000.0 * z).unsqueeze(-1).expand(-1, 3)).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="importance", proposal="prior", masks="order").score(
        model, None, torch.tensor([[3.0, 5.0, 4.0], [1.0, 2.0, 6.0]]))
