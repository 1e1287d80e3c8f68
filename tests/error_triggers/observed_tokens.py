"""Triggers of the docs/errors.md rows raised by observed_tokens.py and token_site.py (ids "sites-...")."""

import math

import torch
import pyro
import pyro.distributions as dist
from pyro import poutine

from pyro_mpt import Evidence, ImportanceWeightedELBO, MaskedPretrainingLoss

from models import make_ppca

from error_triggers.registry import trigger
from error_triggers.common import _global_latent_model, _guided_ppca, _missing_ppca, _observed, _ppca, _x


@trigger("sites-no-observed-site")
def _():
    def model(x):
        pyro.sample("z", dist.Normal(0.0, 1.0))

    MaskedPretrainingLoss().loss(model, None, _x())


@trigger("sites-several-observed-sites")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("a", dist.Normal(0.0, 1.0).expand([3]).to_event(1), obs=x)
            pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, _x())


@trigger("sites-observations-in-a-loop")
def _():
    data = torch.tensor([1.0, 0.0, 1.0])

    def coin(data):
        f = pyro.sample("latent_fairness", dist.Beta(10.0, 10.0))
        for i in range(len(data)):
            pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])

    MaskedPretrainingLoss().loss(coin, None, data)


@trigger("sites-obs-site-unknown")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(obs_site="y").loss(model, None, x)


@trigger("sites-obs-site-not-observed")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(obs_site="z").loss(model, None, x)


@trigger("sites-non-finite-data")
def _():
    model, x = _ppca()
    x = x.clone()
    x[0, 0] = math.nan
    MaskedPretrainingLoss().loss(model, None, x)


@trigger("sites-latent-scale")
def _():
    def annealed(x):
        with pyro.plate("data", x.shape[0]):
            with poutine.scale(scale=0.1):
                z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(annealed, None, _x())


@trigger("sites-guide-scale")
def _():
    model, guide, x = _guided_ppca()
    ImportanceWeightedELBO(num_particles=2).loss(model, poutine.scale(guide, scale=0.3), x)


@trigger("sites-latent-mask")
def _():
    def masked(x):
        with pyro.plate("data", x.shape[0]):
            with poutine.mask(mask=torch.tensor([True, False, True, True])):
                z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(masked, None, _x())


@trigger("sites-read-missing-draws")
def _():
    x = torch.randn(3, 2)
    mx = torch.tensor([[True, False]] * 3)

    def reads(x, y, mx):
        with pyro.plate("data", 3, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            with pyro.plate("tx", 2, dim=-1):
                filled = pyro.sample("x", dist.Normal(z[..., 0], 1.0), obs=x, obs_mask=mx)
            loc = z[..., 0] + filled.mean(-1, keepdim=True)
            pyro.sample("y", dist.Normal(loc.unsqueeze(-1).expand(loc.shape + (2,)), 1.0).to_event(1),
                        obs=y.unsqueeze(-2))

    MaskedPretrainingLoss(obs_site="y", extra_sites="drop").loss(reads, None, x, torch.randn(3, 2), mx)


@trigger("sites-global-latent")
def _():
    MaskedPretrainingLoss(conditionals="gaussian").loss(_global_latent_model, None, _x())


def _plates_only(x):
    """Tokens in a plate, no latent: the plates alone do not say which runs over tokens."""
    with pyro.plate("data", x.shape[0], dim=-2), pyro.plate("tokens", x.shape[1], dim=-1):
        pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)


def _token_plate_model(x, latent_in_tokens=False, subsample_size=None, token_scale=None):
    """A datapoint latent z, the tokens in a plate; optionally a latent per token, a
    subsampled token plate, or a scale that varies over the tokens."""
    with pyro.plate("data", x.shape[0], dim=-2):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("tokens", x.shape[1], subsample_size=subsample_size, dim=-1) as j:
            loc = z + pyro.sample("e", dist.Normal(0.0, 1.0)) if latent_in_tokens else z
            with poutine.scale(scale=token_scale if token_scale is not None else 1.0):
                pyro.sample("x", dist.Normal(loc, 1.0), obs=x[:, j])


@trigger("sites-token-plates-unknown")
def _():
    Evidence(_plates_only, token_plates=("toks",))(_x())


@trigger("sites-token-plates-ambiguous")
def _():
    MaskedPretrainingLoss().loss(_plates_only, None, _x())


@trigger("sites-no-event-dims")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)

    MaskedPretrainingLoss().loss(model, None, _x()[:, 0])


@trigger("sites-no-event-dims-global-latents")
def _():
    def regression(X, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        b0 = pyro.sample("b0", dist.Normal(0.0, 10.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ w + b0, 0.5), obs=y)

    X = _x()
    MaskedPretrainingLoss().loss(regression, None, X, X[:, 0])


@trigger("sites-token-plates-none")
def _():
    Evidence(_plates_only, token_plates=())(_x())


@trigger("sites-token-plate-subsampled")
def _():
    MaskedPretrainingLoss().loss(lambda x: _token_plate_model(x, subsample_size=2), None, _x())


@trigger("sites-latent-in-token-plate")
def _():
    model = lambda x: _token_plate_model(x, latent_in_tokens=True)  # noqa: E731
    MaskedPretrainingLoss(conditionals="gaussian", token_plates=("tokens",)).loss(model, None, _x())


@trigger("sites-batch-dim-not-a-plate")
def _():
    def model(x):
        pyro.sample("x", dist.Normal(torch.zeros(4, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, _x())


@trigger("sites-token-scale-varies")
def _():
    model = lambda x: _token_plate_model(x, token_scale=torch.arange(1.0, 4.0))  # noqa: E731
    MaskedPretrainingLoss().loss(model, None, _x())


@trigger("sites-non-finite-observed-tokens")
def _():
    model, _ = _missing_ppca(_observed())
    x = _x()
    x[0, 1] = math.nan  # a missing token: ignored
    x[2, 0] = math.nan  # an observed one: refused
    MaskedPretrainingLoss().loss(model, None, x)


@trigger("sites-empty-plate")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss().loss(model, None, x[:0])


def _two_observed_sites(x, y):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).to_event(1), obs=x)
        pyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)


@trigger("sites-extra-sites-option")
def _():
    Evidence(_two_observed_sites, obs_site="x", extra_sites="ignore")(_x(), _x()[:, :1])


@trigger("sites-extra-observed-site")
def _():
    MaskedPretrainingLoss(obs_site="x").loss(_two_observed_sites, None, _x(), _x()[:, :1])


@trigger("sites-extra-observed-before")
def _():
    from pyro import poutine

    z0 = torch.zeros(_x().shape[0], 1)
    conditioned = poutine.condition(_two_observed_sites, data={"z": z0})
    MaskedPretrainingLoss(obs_site="x").loss(conditioned, None, _x(), _x()[:, :1])


@trigger("sites-extra-factor")
def _():
    model, x = _ppca()

    def with_factor(x):
        model(x)
        pyro.factor("f", torch.tensor(1.0))

    Evidence(with_factor)(x)


@trigger("sites-data-shape")
def _():
    model, _ = _ppca()
    MaskedPretrainingLoss().loss(model, None, torch.randn(4, 5, dtype=torch.float64))


@trigger("sites-low-precision")
def _():
    model, x, _ = make_ppca(3, 1, 4, dtype=torch.float16)
    MaskedPretrainingLoss().loss(model, None, x)


@trigger("sites-latent-low-precision")
def _():
    W = torch.randn(4, 2).half()

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0).half(), 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.6).to_event(1), obs=x)

    Evidence(model, method="quadrature")(torch.randn(5, 4))


@trigger("sites-integer-data")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Bernoulli(logits=z[..., None].expand(z.shape + (3,))).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, torch.tensor([[0, 1, 1], [1, 0, 1]]))


@trigger("sites-out-of-support")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Bernoulli(logits=z[..., None].expand(z.shape + (3,))).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]]))




@trigger("sites-mask-shape")
def _():
    hmm = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(2), torch.eye(2)), 0.5 * torch.eye(2),
                           dist.MultivariateNormal(torch.zeros(2), torch.eye(2)), torch.ones(2, 2),
                           dist.Normal(torch.zeros(2), 1.0).to_event(1), duration=5)
    missing = torch.rand(4, 5, 2) < 0.8

    def model(x):
        with pyro.plate("data", 4), poutine.mask(mask=missing):
            pyro.sample("x", hmm, obs=x)

    Evidence(model)(torch.randn(4, 5, 2))


@trigger("sites-hmm-mask-state")
def _():
    m = torch.ones(4, 5, 2, dtype=torch.bool)
    m[0, 1, 0] = False  # step 1 of sequence 0 left out under state 0 only

    def model(x):
        emission = dist.Poisson(torch.tensor([0.5, 4.0])).expand([4, 5, 2]).mask(m)
        with pyro.plate("data", 4):
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), emission), obs=x)

    Evidence(model)(torch.ones(4, 5))
