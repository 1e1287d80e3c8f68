"""Every user-facing error and warning of pyro_mpt: one row each in docs/errors.md, one trigger each here.

``docs/errors.md`` is the source of truth for the expected exception type and
message: each row's message cell holds fragments of the real message,
separated by `` … ``, that must appear in it in order. :func:`test_table_and_triggers_are_in_sync`
keeps the table and :data:`TRIGGERS` one-to-one, and :func:`test_every_message_in_the_code_has_a_row`
checks that every exception or warning message written in pyro_mpt/ is produced by some
trigger, or is an internal one listed in :data:`INTERNAL`.
"""

import ast
import builtins
import contextlib
import io
import math
import re
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints

import pyro_mpt
import pyro_mpt.compare
import pyro_mpt.datasets
import pyro_mpt.masks
import pyro_mpt.vae
from pyro_mpt import (
    EncodeDecodeConditionals,
    Evidence,
    GaussianConditionals,
    ImportanceConditionals,
    MaskedPretrainingLoss,
    MPTCurve,
    QuadratureConditionals,
)
from pyro_mpt.conditionals.quadrature_rules import hermite_rule

from models import (
    exact_posterior_guide,
    make_full_gaussian,
    make_ppca,
    make_singular_ppca,
    tiny_bert,
    tiny_vit_mae,
)

ERRORS_MD = Path(__file__).resolve().parents[1] / "docs" / "errors.md"

TRIGGERS = {}


def trigger(row_id):
    """Register the function that triggers row ``row_id`` of docs/errors.md."""

    def register(fn):
        assert row_id not in TRIGGERS, row_id
        TRIGGERS[row_id] = fn
        return fn

    return register


# ---------------------------------------------------------------------- models
def _x(n=4, D=3):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(0))


def _ppca(D=3, K=1, n=4):
    model, x, _ = make_ppca(D, K, n)
    return model, x


def _bernoulli_model(K=1, D=3):
    W = torch.ones(D, K)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T).to_event(1), obs=x)

    return model


def _global_latent_model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=x)


# ---------------------------------------------------------------------- sites.py
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


@trigger("sites-global-latent")
def _():
    MaskedPretrainingLoss(conditionals="gaussian").loss(_global_latent_model, None, _x())


@trigger("sites-latent-extra-plate")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            with pyro.plate("k", 2):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z.sum(0, keepdim=True).T.expand(-1, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, _x())

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


@trigger("sites-token-plates-none")
def _():
    Evidence(_plates_only, token_plates=())(_x())


@trigger("sites-token-plate-subsampled")
def _():
    MaskedPretrainingLoss().loss(lambda x: _token_plate_model(x, subsample_size=2), None, _x())


@trigger("sites-latent-in-token-plate")
def _():
    model = lambda x: _token_plate_model(x, latent_in_tokens=True)  # noqa: E731
    MaskedPretrainingLoss(token_plates=("tokens",)).loss(model, None, _x())


@trigger("sites-batch-dim-not-a-plate")
def _():
    def model(x):
        pyro.sample("x", dist.Normal(torch.zeros(4, 3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, _x())


@trigger("sites-token-scale-varies")
def _():
    model = lambda x: _token_plate_model(x, token_scale=torch.arange(1.0, 4.0))  # noqa: E731
    MaskedPretrainingLoss().loss(model, None, _x())


def _missing_ppca(observed):
    """PPCA whose tokens are missing where ``observed`` is False (via dist.mask), with an
    amortized guide."""

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).mask(observed).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    return model, guide


def _observed(n=4, D=3):
    m = torch.ones(n, D, dtype=torch.bool)
    m[0, 1:] = False  # datapoint 0 observes one token of three
    return m


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


@trigger("sites-out-of-support")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Bernoulli(logits=z[..., None].expand(z.shape + (3,))).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]]))


# ---------------------------------------------------------------------- masks.py
@trigger("masks-num-masks")
def _():
    MaskedPretrainingLoss(num_masks=0)


@trigger("masks-no-tokens")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, torch.zeros(4, 0))


@trigger("masks-check-no-tokens")
def _():
    pyro_mpt.masks.make_schedule("uniform").check(0)


@trigger("masks-exhaustive-too-many-tokens")
def _():
    model, x = _ppca(D=17)
    MaskedPretrainingLoss(masks="exhaustive").loss(model, None, x)


@trigger("masks-rate-out-of-range")
def _():
    MaskedPretrainingLoss(masks=1.5)


@trigger("masks-rate-one-token")
def _():
    model, x = _ppca(D=1)
    MaskedPretrainingLoss(masks=0.5).loss(model, None, x)


@trigger("masks-rate-rounds-to-zero")
def _():
    model, x = _ppca(D=3)
    MaskedPretrainingLoss(masks=0.1).loss(model, None, x)


@trigger("masks-rate-rounds-to-zero-missing")
def _():
    model, _ = _missing_ppca(_observed())
    MaskedPretrainingLoss(masks=0.2).loss(model, None, _x())


@trigger("loss-schedule-without-observed")
def _():
    from pyro_mpt.masks import RandomOrders

    class OldSchedule(RandomOrders):
        """A schedule written before missing tokens: its blocks take no observed=."""

        def blocks(self, n, D, *, max_elements=2**22, device=None):
            return super().blocks(n, D, max_elements=max_elements, device=device)

    model, _ = _missing_ppca(_observed())
    MaskedPretrainingLoss(masks=OldSchedule()).loss(model, None, _x())


@trigger("masks-unknown-name")
def _():
    MaskedPretrainingLoss(masks="random")


@trigger("masks-wrong-type")
def _():
    MaskedPretrainingLoss(masks=[1, 2])


# ---------------------------------------------------------------------- engine choice
@trigger("engine-unknown-name")
def _():
    MaskedPretrainingLoss(conditionals="exact")


@trigger("engine-auto-unknown-option")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(num_sample=8).loss(model, None, x)


@trigger("engine-auto-none-applies")
def _():
    MaskedPretrainingLoss().loss(_global_latent_model, None, _x())


@trigger("engine-x-shape")
def _():
    from pyro_mpt.sites import trace_tokens

    model, x = _ppca()
    tokens = trace_tokens(model, None, (x,), {})
    engine = QuadratureConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    engine.mask_log_prob(state, x[:2], torch.ones(1, 2, 3, dtype=torch.bool))


# ---------------------------------------------------------------------- gaussian
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


@trigger("gaussian-mvn-extra-event-dims")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            fn = dist.MultivariateNormal(torch.zeros(3), torch.eye(3)).expand([2]).to_event(1)
            pyro.sample("x", fn, obs=x.reshape(-1, 2, 3))

    MaskedPretrainingLoss(conditionals="gaussian").loss(model, None, torch.zeros(4, 6))


@trigger("gaussian-mvn-in-token-plate")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", 2, dim=-1):
                loc = z.unsqueeze(-1).expand(z.shape[:-1] + (2, 2))
                pyro.sample("x", dist.MultivariateNormal(loc, torch.eye(2)), obs=x.reshape(-1, 2, 2))

    Evidence(model)(torch.zeros(4, 4))


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


# ---------------------------------------------------------------------- quadrature
@trigger("quadrature-num-nodes")
def _():
    QuadratureConditionals(num_nodes=0)


@trigger("quadrature-max-latent-dim")
def _():
    QuadratureConditionals(max_latent_dim=5)


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
            p = pyro.sample("p", dist.Dirichlet(torch.ones(3)))
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


def _mm_model(x):
    W = torch.ones(3, 1)
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        pyro.sample("x", dist.Normal(torch.mm(z, W.T), 1.0).to_event(1), obs=x)  # 2-D only


@trigger("quadrature-model-does-not-broadcast")
def _():
    MaskedPretrainingLoss(conditionals="quadrature").loss(_mm_model, None, _x())


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


@trigger("evidence-quadrature-tol")
def _():
    model, x, _ = make_ppca(12, 2, 4, sigma=0.05)
    Evidence(model, method="quadrature", num_nodes=3, adaptive=False, tol=1e-9)(x)


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


# ---------------------------------------------------------------------- encode_decode / importance
def _guided_ppca():
    model, x = _ppca(D=3, K=1)
    return model, exact_posterior_guide, x


@trigger("engine-tokens-not-independent")
def _():
    model, x, _ = make_full_gaussian(3, 4)

    def guide(x):
        pass

    MaskedPretrainingLoss(conditionals="importance").loss(model, guide, x)


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


@trigger("importance-guide-needed")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals=ImportanceConditionals(proposal="guide")).loss(model, None, x)


# ---------------------------------------------------------------------- latent_runs.py
@trigger("data-arg-type")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=0.5)).loss(model, guide, x)


@trigger("data-arg-unknown-keyword")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg="data")).loss(model, guide, x)


@trigger("data-arg-position")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=2)).loss(model, guide, x)


def _two_arg_models():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model2(x, y):
        model(x)

    def guide2(x, y):
        guide(x)

    return model2, guide2, x


@trigger("data-arg-not-the-data")
def _():
    model, guide, x = _two_arg_models()
    loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=1))
    loss.loss(model, guide, x, torch.zeros(4, 3))


@trigger("data-arg-not-found")
def _():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model0():
        model(x)

    def guide0():
        guide(x)

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model0, guide0)


@trigger("data-arg-ambiguous")
def _():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model2(x, y):
        model(x + 0)  # the observed value is a new tensor, equal to both arguments

    def guide2(x, y):
        guide(x)

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model2, guide2, x, x.clone())


@trigger("runner-global-latent")
def _():
    MaskedPretrainingLoss(conditionals="importance").loss(_global_latent_model, None, _x())


@trigger("runner-model-does-not-broadcast")
def _():
    MaskedPretrainingLoss(conditionals="importance").loss(_mm_model, None, _x())


@trigger("runner-guide-extra-site")
def _():
    model, x = _ppca()

    def guide(x):
        pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    engine = ImportanceConditionals(proposal="guide", impute=False)
    MaskedPretrainingLoss(conditionals=engine).loss(model, guide, x)


def _mm_guide(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))
    torch.mm(z, torch.ones(1, 1, dtype=z.dtype))  # 2-D only: fails with a particle dim on the left


@trigger("runner-guide-does-not-broadcast")
def _():
    model, x = _ppca()
    engine = ImportanceConditionals(proposal="guide", impute=False)
    MaskedPretrainingLoss(conditionals=engine).loss(model, _mm_guide, x)


@trigger("runner-guide-fails-on-imputed-data")
def _():
    model, x = _ppca()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        MaskedPretrainingLoss(conditionals="encode_decode").loss(model, _mm_guide, x)


@trigger("runner-guide-stacking-fallback")
def _():
    model, x = _ppca()

    def guide(x):
        with pyro.plate("data", 4):  # a fixed plate size: stacked copies do not fit
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 1), num_masks=2).loss(model, guide, x)


@trigger("missing-tokens-guide-engine")
def _():
    model, guide = _missing_ppca(_observed())
    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, _x())


@trigger("importance-poor-weights")
def _():
    model, x, _ = make_ppca(20, 2, 4, sigma=0.1)
    engine = ImportanceConditionals(256, proposal="prior")
    MaskedPretrainingLoss(conditionals=engine, masks="order").loss(model, None, x)


@trigger("guide-point-mass")
def _():
    from pyro.infer.autoguide import AutoDelta

    model, x = _ppca()
    Evidence(model, AutoDelta(model), method="importance", num_samples=10)(x)


@trigger("guide-sites-mismatch")
def _():
    model, x = _ppca()

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("zz", dist.Normal(torch.zeros(x.shape[0], 1, dtype=x.dtype), 1.0).to_event(1))

    MaskedPretrainingLoss().loss(model, guide, x)


@trigger("runner-auxiliary-outside-data-plate")
def _():
    from pyro.infer.autoguide import AutoMultivariateNormal

    model, x = _ppca()
    Evidence(model, AutoMultivariateNormal(model), method="importance", num_samples=10)(x)


@trigger("runner-auxiliary-not-replayable")
def _():
    from pyro.infer.autoguide import AutoNormal

    model, x = _ppca()
    engine = ImportanceConditionals(16, proposal="guide")
    MaskedPretrainingLoss(conditionals=engine).loss(model, AutoNormal(model), x)


# ---------------------------------------------------------------------- enumerate / hmm / mixture
def _categorical_model(obs="normal", max_support=None):
    w = torch.tensor([0.2, 0.3, 0.5])
    locs = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(w))
            if obs == "mvn":
                pyro.sample("x", dist.MultivariateNormal(locs[z], torch.eye(3)), obs=x)
            elif obs == "reshape":  # a reshape to the data's shape does not broadcast
                pyro.sample("x", dist.Normal(locs[z].reshape(x.shape), 1.0).to_event(1), obs=x)
            else:
                pyro.sample("x", dist.Normal(locs[z], 1.0).to_event(1), obs=x)

    return model


def _hmm_obs(emission=None, latent=False):
    def model(x):
        if latent:
            with pyro.plate("data", x.shape[0]):
                pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("sequences", x.shape[0]):
            obs = emission if emission is not None else dist.Normal(torch.zeros(2), 1.0)
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), obs), obs=x)

    return model


@trigger("enumerate-no-latent")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("enumerate-not-discrete")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_bernoulli_model(), None, torch.ones(4, 3))


@trigger("enumerate-support-too-large")
def _():
    MaskedPretrainingLoss(conditionals="enumerate", max_support=2).loss(_categorical_model(), None, _x())


@trigger("enumerate-tokens-not-independent")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_categorical_model("mvn"), None, _x())


@trigger("enumerate-model-failed")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_categorical_model("reshape"), None, _x())


@trigger("enumerate-markov")
def _():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    locs = torch.tensor([[-1.0, 0.0], [1.0, 2.0]])

    def markov_hmm(y):  # the form of Pyro's HMM tutorial
        with pyro.plate("sequences", y.shape[0]):
            h = 0
            for t in pyro.markov(range(y.shape[1])):
                h = pyro.sample(f"h_{t}", dist.Categorical(probs[h]))
                pyro.sample(f"y_{t}", dist.Normal(locs[h], 1.0).to_event(1), obs=y[:, t])

    MaskedPretrainingLoss(conditionals="enumerate", obs_site="y_0", extra_sites="drop").loss(
        markov_hmm, None, torch.randn(3, 4, 2)
    )


@trigger("sites-markov-observed-sites")
def _():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    locs = torch.tensor([[-1.0, 0.0], [1.0, 2.0]])

    def markov_hmm(y):
        with pyro.plate("sequences", y.shape[0]):
            h = 0
            for t in pyro.markov(range(y.shape[1])):
                h = pyro.sample(f"h_{t}", dist.Categorical(probs[h]))
                pyro.sample(f"y_{t}", dist.Normal(locs[h], 1.0).to_event(1), obs=y[:, t])

    MaskedPretrainingLoss(obs_site="y_0").loss(markov_hmm, None, torch.randn(3, 4, 2))


@trigger("enumerate-component-not-gaussian")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(torch.ones(2) / 2))
            r = pyro.sample("r", dist.Gamma(2.0, 1.0))
            pyro.sample("x", dist.Normal((z * r).unsqueeze(-1) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("enumerate-discrete-after-continuous")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            z = pyro.sample("z", dist.Bernoulli(logits=u))
            pyro.sample("x", dist.Normal((z + u).unsqueeze(-1) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("hmm-not-discrete-hmm")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="hmm").loss(model, None, x)


@trigger("hmm-other-latents")
def _():
    MaskedPretrainingLoss(conditionals="hmm").loss(_hmm_obs(latent=True), None, torch.randn(3, 5))


@trigger("hmm-emission-event")
def _():
    emission = dist.MultivariateNormal(torch.zeros(2, 2), torch.eye(2))
    MaskedPretrainingLoss(conditionals="hmm").loss(_hmm_obs(emission), None, torch.randn(3, 5, 2))


@trigger("mixture-table-shape")
def _():
    pyro_mpt.conditionals.MixtureTable(torch.zeros(3), torch.zeros(3, 4))


@trigger("mixture-weights-shape")
def _():
    pyro_mpt.conditionals.MixtureTable(torch.zeros(2), torch.zeros(3, 4, 5))


# ---------------------------------------------------------------------- evidence
@trigger("evidence-unknown-method")
def _():
    Evidence(lambda x: None, method="laplace")


@trigger("evidence-exact-not-gaussian")
def _():
    Evidence(_bernoulli_model(), method="exact")(torch.ones(4, 3))


@trigger("evidence-importance-unknown-option")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", samples=10)(x)


@trigger("evidence-importance-num-samples")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", num_samples=0)(x)


@trigger("evidence-importance-proposal")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", proposal="posterior")(x)


@trigger("evidence-importance-needs-guide")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", proposal="guide")(x)


@trigger("evidence-importance-global-latent")
def _():
    Evidence(_global_latent_model, method="importance")(_x())


@trigger("evidence-importance-khat")
def _():
    model, x, _ = make_ppca(20, 2, 4, sigma=0.1)
    Evidence(model, method="importance", num_samples=50)(x)


@trigger("missing-tokens-guide-evidence")
def _():
    model, guide = _missing_ppca(_observed())
    Evidence(model, guide, method="importance", proposal="guide")(_x())


@trigger("missing-tokens-iwelbo")
def _():
    from pyro_mpt.importance_evidence import ImportanceWeightedELBO

    model, guide = _missing_ppca(_observed())
    ImportanceWeightedELBO(4).loss(model, guide, _x())


@trigger("evidence-importance-few-effective-samples")
def _():
    probs = torch.tensor([0.999, 0.001], dtype=torch.float64)
    locs = torch.tensor([[0.0, 0.0, 0.0], [6.0, 6.0, 6.0]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(probs))
            pyro.sample("x", dist.Normal(locs[c], 1.0).to_event(1), obs=x)

    Evidence(model, method="importance", num_samples=2000)(torch.full((1, 3), 6.0, dtype=torch.float64))


# ---------------------------------------------------------------------- curve, compare, vae, datasets
@trigger("curve-area-incomplete")
def _():
    MPTCurve(np.arange(1, 4), 3, np.array([-1.0, np.nan, -2.0]), np.zeros(3)).area()


@trigger("compare-spec-number")
def _():
    pyro_mpt.compare.make_loss("iwae:eight")


@trigger("compare-spec-type")
def _():
    pyro_mpt.compare.make_loss(3)


@trigger("compare-mpt-encoder")
def _():
    pyro_mpt.compare.make_loss("elbo", mpt_encoder="guide")


@trigger("compare-spec-conditionals")
def _():
    pyro_mpt.compare.make_loss("mpt:0.3:exact")


@trigger("compare-spec-unknown")
def _():
    pyro_mpt.compare.make_loss("kl")


@trigger("compare-unknown-loss-name")
def _():
    pyro_mpt.compare.Comparison([pyro_mpt.compare.RunResult("elbo")])["iwae"]


@trigger("compare-loss-diverged")
def _():
    from pyro.infer import Trace_ELBO

    class NaNLoss(Trace_ELBO):
        def loss_and_grads(self, model, guide, *args, **kwargs):
            return math.nan

    vae = pyro_mpt.vae.DeepVAE(3, 1, (4,))
    result = pyro_mpt.compare.compare(
        lambda: vae, torch.ones(4, 3), torch.ones(2, 3), {"nan": NaNLoss()}, epochs=1, eval_samples=2
    )
    # compare records the failure as "TypeName: message" instead of raising it:
    # re-raise the recorded type, so the row checks the library's exception type
    name, message = result["nan"].error.split(": ", 1)
    raise getattr(builtins, name)(message)


@trigger("vae-likelihood")
def _():
    pyro_mpt.vae.DeepVAE(3, likelihood="poisson")


@trigger("datasets-n-test")
def _():
    pytest.importorskip("sklearn")
    pyro_mpt.datasets.load_dataset("digits", n_test=5000)


@trigger("datasets-unknown")
def _():
    pyro_mpt.datasets.load_dataset("cifar")


@trigger("datasets-needs-sklearn")
def _():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sklearn.datasets", None)
        pyro_mpt.datasets.load_dataset("digits")


@trigger("datasets-needs-torchvision")
def _():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torchvision", None)
        pyro_mpt.datasets.load_dataset("mnist")


# ---------------------------------------------------------------------- adapters: rates, batching
@trigger("rates-unreadable")
def _():
    from pyro_mpt.adapters import parse_rates

    parse_rates("0.1:x:0.1")


@trigger("rates-out-of-range")
def _():
    from pyro_mpt.adapters.rates import check_rates

    check_rates([0.0, 0.5])


@trigger("rates-not-increasing")
def _():
    from pyro_mpt.adapters.rates import check_rates

    check_rates([0.5, 0.2])


def _rate_curve(values):
    from pyro_mpt.adapters.rates import rate_curve

    return rate_curve(torch.tensor(values, dtype=torch.float64)[:, :, None], [0.25, 0.5], [4])


@trigger("rates-area-nan")
def _():
    _rate_curve([[-1.0, math.nan]]).area()


@trigger("rates-no-per-item")
def _():
    curve = _rate_curve([[-1.0, -2.0]])
    curve.per_item = None
    curve.per_item_area()


@trigger("rates-table2-grid")
def _():
    from pyro_mpt.adapters import table2_area

    table2_area(_rate_curve([[-1.0, -2.0]]))


@trigger("batching-max-tokens")
def _():
    from pyro_mpt.adapters.batching import pack

    list(pack([(3, [0])], lambda i: 1, 0))


# ---------------------------------------------------------------------- adapters: masked LM
def _bert(tmp=None, tokenizer=True):
    pytest.importorskip("transformers")
    return tiny_bert((tmp or _tmpdir()) if tokenizer else None)


_TMP = {}


@pytest.fixture(autouse=True)
def _tmp_base(tmp_path):
    _TMP["base"] = tmp_path  # triggers take no arguments; their files go under pytest's tmp_path
    yield
    _TMP.clear()


def _tmpdir():
    import tempfile

    return tempfile.mkdtemp(dir=_TMP.get("base"))


def _scorer(**kw):
    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = _bert()
    return MaskedLMScorer(model, tok, **kw)


@trigger("mlm-head-argument")
def _():
    _scorer(head="lm")


@trigger("mlm-budgets")
def _():
    _scorer(max_tokens=0)


@trigger("mlm-no-mask-token")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0])


@trigger("mlm-no-special-ids")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0], mask_token_id=4)


@trigger("mlm-head-masked-unknown-class")
def _():
    transformers = pytest.importorskip("transformers")
    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = _bert()

    class MyMaskedLM(transformers.BertForMaskedLM):
        pass

    MaskedLMScorer(MyMaskedLM(model.config), tok, head="masked")


@trigger("mlm-text-column")
def _():
    datasets = pytest.importorskip("datasets")
    _scorer().curve(datasets.Dataset.from_dict({"sentence": ["a b"]}), rates=[0.5])


@trigger("mlm-mapping-without-input-ids")
def _():
    _scorer().curve({"ids": [[2, 5, 3]]}, rates=[0.5])


@trigger("mlm-one-string")
def _():
    _scorer().curve("a b c", rates=[0.5])


@trigger("mlm-empty-inputs")
def _():
    _scorer().curve([], rates=[0.5])


@trigger("mlm-inputs-type")
def _():
    _scorer().curve([1, 2], rates=[0.5])


@trigger("mlm-text-needs-tokenizer")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0], mask_token_id=4, special_token_ids=[0, 2, 3, 4]).curve(["a b"])


@trigger("mlm-attention-mask-length")
def _():
    _scorer().curve({"input_ids": [[2, 5, 6, 3]], "attention_mask": [[1, 1, 1]]}, rates=[0.5])


@trigger("mlm-no-maskable-token")
def _():
    _scorer().curve({"input_ids": [[2, 3]]}, rates=[0.5])


@trigger("mlm-word-l2r-needs-words")
def _():
    _scorer().pll({"input_ids": [[2, 5, 6, 3]]}, word_l2r=True)


@trigger("mlm-positive-int")
def _():
    _scorer().curve(["a b"], rates=[0.5], num_masks=0)


@trigger("mlm-truncation")
def _():
    _scorer(max_length=4).encode(["a b c d e f"])


@trigger("mlm-tokenizer-vocabulary")
def _():
    transformers = pytest.importorskip("transformers")
    from pyro_mpt.adapters import MaskedLMScorer

    special_only = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])})
    MaskedLMScorer(_bert(tokenizer=False)[0], special_only)


@trigger("mlm-all-unknown")
def _():
    _scorer().pll(["A B C"])


@trigger("mlm-ids-too-long")
def _():
    _scorer().pll({"input_ids": [[2] + [5] * 31 + [3]]})


@trigger("mlm-padding-without-attention-mask")
def _():
    _scorer().pll({"input_ids": [[2, 5, 6, 3, 0, 0]]})


@trigger("antibodies-empty-parents")
def _():
    from pyro_mpt.adapters.antibodies import variants

    variants([], 3)


@trigger("antibodies-mutation-rate")
def _():
    from pyro_mpt.adapters.antibodies import HEAVY, variants

    variants(HEAVY, 3, rate=1.5)


# ---------------------------------------------------------------------- adapters: ViT-MAE
def _mae(**kw):
    pytest.importorskip("transformers")
    from pyro_mpt.adapters import MAEScorer

    return MAEScorer(tiny_vit_mae(init=kw.pop("init", True)), **kw)


@trigger("mae-sigma2")
def _():
    _mae(sigma2=0.0)


@trigger("mae-batch-size")
def _():
    _mae(batch_size=0)


@trigger("mae-model-type")
def _():
    from pyro_mpt.adapters import MAEScorer

    MAEScorer(torch.nn.Linear(2, 2))


@trigger("mae-zero-position-embeddings")
def _():
    _mae(init=False)


@trigger("mae-image-batch-shape")
def _():
    _mae().curves(torch.zeros(3, 8, 8), rates=[0.5])


@trigger("mae-image-column")
def _():
    datasets = pytest.importorskip("datasets")
    _mae().curves(datasets.Dataset.from_dict({"img": [[0.0]]}), rates=[0.5])


@trigger("mae-needs-processor")
def _():
    _mae().curves([np.zeros((8, 8, 3))], rates=[0.5])


@trigger("mae-num-masked")
def _():
    scorer = _mae()
    scorer.reconstruction(torch.zeros(1, 3, 8, 8), 0, torch.arange(4)[None])


@trigger("mae-masks-not-honoured")
def _():
    scorer = _mae()
    scorer._keep_exactly = lambda num_kept: contextlib.nullcontext()  # a model that ignores the ratio
    scorer.reconstruction(torch.zeros(1, 3, 8, 8), 2, torch.arange(4)[None])


@trigger("mae-num-masks")
def _():
    _mae().curves(torch.zeros(1, 3, 8, 8), rates=[0.5], num_masks=0)


@trigger("mae-curve-kind")
def _():
    _mae().curve(torch.zeros(1, 3, 8, 8), rates=[0.5], kind="nll")


# ---------------------------------------------------------------------- adapters: loading and CLI
def _offline():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    return mp


def _loading():
    pytest.importorskip("transformers")
    from pyro_mpt.adapters import loading

    return loading


@trigger("load-unreachable")
def _():
    loading = _loading()
    mp = _offline()
    try:
        loading.load_masked_lm("no-such-org/no-such-model")
    finally:
        mp.undo()


@trigger("load-antiberty-not-installed")
def _():
    loading = _loading()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "antiberty", None)
        loading.antiberty_paths()


@trigger("load-antiberty-incomplete")
def _():
    loading = _loading()
    fake = types.ModuleType("antiberty")
    fake.__file__ = str(Path(_tmpdir()) / "__init__.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "antiberty", fake)
        loading.antiberty_paths()


@trigger("load-tokenizer")
def _():
    _loading().load_tokenizer(None, model_dir=_tmpdir())


@trigger("load-model")
def _():
    loading = _loading()
    d = Path(_tmpdir())
    (d / "config.json").write_text("{}")
    loading.load_masked_lm(str(d))


@trigger("load-vit-mae")
def _():
    loading = _loading()
    d = Path(_tmpdir())
    (d / "config.json").write_text('{"model_type": "vit_mae"}')
    loading.load_vit_mae(str(d))


@trigger("load-image-processor-fallback")
def _():
    loading = _loading()
    d = _tmpdir()
    _mae().model.config.save_pretrained(d)
    loading.load_vit_mae(d, random_init=True)


@trigger("load-split-missing")
def _():
    datasets = pytest.importorskip("datasets")
    loading = _loading()
    d = str(Path(_tmpdir()) / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(d)
    loading.load_texts(dataset=d, split="validation")


@trigger("load-file-type")
def _():
    loading = _loading()
    path = Path(_tmpdir()) / "data.xml"
    path.write_text("<a/>")
    loading.load_texts(dataset=str(path))


@trigger("load-dataset-unreachable")
def _():
    loading = _loading()
    mp = _offline()
    try:
        loading.load_texts(dataset="no-such-org/no-such-dataset")
    finally:
        mp.undo()


@trigger("load-one-text-source")
def _():
    _loading().load_texts()


@trigger("load-text-file-missing")
def _():
    _loading().load_texts(text_file=str(Path(_tmpdir()) / "missing.txt"))


def _csv(text):
    path = Path(_tmpdir()) / "data.csv"
    path.write_text(text)
    return str(path)


@trigger("load-no-text-column")
def _():
    _loading().load_texts(dataset=_csv("label,score\n1,2\n"))


@trigger("load-column-missing")
def _():
    _loading().load_texts(dataset=_csv("text,label\na,1\n"), columns=["sentence"])


@trigger("load-one-image-source")
def _():
    _loading().load_images()


@trigger("load-image-folder-missing")
def _():
    _loading().load_images(image_folder=str(Path(_tmpdir()) / "missing"))


@trigger("load-no-images")
def _():
    _loading().load_images(image_folder=_tmpdir())


@trigger("load-image-column")
def _():
    datasets = pytest.importorskip("datasets")
    d = str(Path(_tmpdir()) / "ds")
    datasets.Dataset.from_dict({"img": [0]}).save_to_disk(d)
    _loading().load_images(dataset=d)


def _cli(argv):
    """Run ``pyro-mpt argv``; turn its exit (status 2, message on stderr) into SystemExit(message)."""
    pytest.importorskip("transformers")
    from pyro_mpt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 2, e.code
            raise SystemExit(err.getvalue()) from None


@trigger("cli-sigma2")
def _():
    _cli(["mae-curve", "model", "--image-folder", _tmpdir(), "--sigma2", "big"])


@trigger("cli-resource-unavailable")
def _():
    text = Path(_tmpdir()) / "t.txt"
    text.write_text("a b\n")
    mp = _offline()
    try:
        _cli(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(text), "--no-plot"])
    finally:
        mp.undo()


@trigger("cli-empty-input")
def _():
    d = Path(_tmpdir())
    model, tok = _bert(d)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    text = d / "t.txt"
    text.write_text("\n\n")
    _cli(["mlm-curve", str(d), "--text-file", str(text), "--no-plot"])


@trigger("cli-positive-int")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--num-masks", "0"])


@trigger("cli-compare-failed")
def _():
    from pyro_mpt.cli import main

    mp = pytest.MonkeyPatch()
    mp.setattr(pyro_mpt.compare, "heldout_evidence", lambda *a, **k: 1 / 0)  # fails after training
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(["compare", "--n-train", "8", "--n-test", "4", "--epochs", "1", "--hidden", "4", "--losses", "elbo",
                  "--quiet"])
    except SystemExit as e:
        assert e.code == 1, e.code
        raise SystemExit(err.getvalue()) from None
    finally:
        mp.undo()


# ---------------------------------------------------------------------- the table
def _table_rows():
    """Rows ``(id, type, message)`` of the tables in docs/errors.md whose first cell is an id."""
    rows = []
    for line in ERRORS_MD.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            continue  # e.g. the internal errors, listed by where they are raised
        row_id = cells[0].strip("`")
        kind = cells[1].strip("`")
        message = cells[-1].strip().strip("`").replace("\\|", "|")
        rows.append((row_id, kind, message))
    return rows


ROWS = _table_rows()


def test_table_and_triggers_are_in_sync():
    ids = [r[0] for r in ROWS]
    assert len(ids) == len(set(ids)), "duplicate ids in docs/errors.md"
    assert set(ids) - set(TRIGGERS) == set(), "rows of docs/errors.md without a trigger here"
    assert set(TRIGGERS) - set(ids) == set(), "triggers here without a row in docs/errors.md"


def _fragments_pattern(message):
    return ".*".join(re.escape(f.strip()) for f in message.split("…"))


_OUTCOMES = {}


def _outcome(row_id):
    """Run the trigger of ``row_id`` once per session.

    :returns: ``(raised, warned)``: the exception as ``(type name, message)`` or
        None, and the warnings as a list of ``(category name, message)``.
    """
    if row_id not in _OUTCOMES:
        raised = None
        pyro.clear_param_store()  # as conftest does per test: a trigger may run inside another's test
        pyro.set_rng_seed(0)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                TRIGGERS[row_id]()
            except (pytest.skip.Exception, pytest.fail.Exception, KeyboardInterrupt):
                raise
            except BaseException as err:  # SystemExit too: the command line's errors
                text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
                raised = (type(err).__name__, text)
        _OUTCOMES[row_id] = (raised, [(w.category.__name__, str(w.message)) for w in rec])
    return _OUTCOMES[row_id]


@pytest.mark.parametrize("row_id,kind,message", ROWS, ids=[r[0] for r in ROWS])
def test_error_row(row_id, kind, message):
    """The row's trigger raises (or warns) with the row's type and message fragments."""
    raised, warned = _outcome(row_id)
    pattern = _fragments_pattern(message)
    if kind.endswith("Warning"):
        found = [m for k, m in warned if k == kind]
        assert found, f"{row_id}: no {kind}; got {warned}"
        assert any(re.search(pattern, m, re.S) for m in found), (row_id, found)
        return
    assert raised is not None, f"{row_id}: the trigger raised nothing; warnings: {warned}"
    name, text = raised
    assert name == kind, (row_id, name, text)
    assert re.search(pattern, text, re.S), (row_id, text)


# ---------------------------------------------------------------------- the code
SOURCE = Path(pyro_mpt.__file__).resolve().parent
_EXCEPTION_NAME = re.compile(r"_?[A-Z]\w*(Error|Exception|Warning|NotApplicable|Unavailable|Definite)$")

# Messages in pyro_mpt/ that no trigger produces, by "file::function": each guards an
# invariant that user input does not reach (docs/errors.md, "Internal errors").
INTERNAL = {
    "adapters/masked_lm.py::MaskedLMScorer.score.make_jobs": "a MaskBlock type not wired into the adapter",
    "conditionals/base.py::ConditionalEngine.log_evidence": "the default of engines without log p(x)",
    "conditionals/quadrature_rules.py::effective_nodes": "the engine passes tensor grids only",
    "conditionals/gaussian.py::GaussianConditionals._factor_whole": "caught by the jitter rescue",
    "conditionals/latent_runs.py::_pad": "Pyro's plate checks fire first",
    "conditionals/latent_runs.py::Decoded.obs_log_prob": "models that do not broadcast fail earlier",
    "conditionals/latent_runs.py::Decoded._token_tensor": "models that do not broadcast fail earlier",
    "conditionals/latent_runs.py::LatentRunner._guide_values": "caught by encode, which falls back",
    "conditionals/latent_runs.py::LatentRunner.encode": "engines encode only after locate_data_arg",
    "conditionals/quadrature.py::_ModelRunner._run": "models that do not broadcast fail earlier",
}


def _message_template(node):
    """The literal parts of a message expression, with None for each computed part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_template(node.left) + _message_template(node.right)
    return [None]


def _message_sites():
    """``(file::function, line, pattern)`` for every exception or warning built with a
    literal message in pyro_mpt/: ``raise E(...)``, ``E(...)`` for a class named like an
    exception, ``warnings.warn(...)`` and the command line's ``_fail(...)``. The pattern
    matches the messages it can produce (each computed part matches anything)."""
    sites = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        raised = {id(n.exc) for n in ast.walk(tree) if isinstance(n, ast.Raise)}

        def visit(node, qualname):
            for child in ast.iter_child_nodes(node):
                name = qualname
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{qualname}.{child.name}" if qualname else child.name
                if isinstance(child, ast.Call) and child.args:
                    fn = child.func
                    called = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
                    warn = called == "warn" and isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "") == "warnings"
                    fail = called == "_fail"  # the command line's error exit
                    if warn or fail or id(child) in raised or _EXCEPTION_NAME.match(called):
                        parts = _message_template(child.args[0])
                        # at least a few words of literal text: not a re-raise of str(e)
                        if sum(len(p) for p in parts if p) >= 10:
                            pattern = "".join(".*?" if p is None else re.escape(p) for p in parts)
                            key = f"{path.relative_to(SOURCE).as_posix()}::{name}"
                            sites.append((key, child.lineno, re.compile(pattern, re.S)))
                visit(child, name)

        visit(tree, "")
    return sites


def test_every_message_in_the_code_has_a_row():
    """Each exception or warning message written in pyro_mpt/ is produced by some row's
    trigger (so it has a row in docs/errors.md), or is listed in INTERNAL."""
    texts, skipped = [], []
    for row_id in TRIGGERS:
        try:
            raised, warned = _outcome(row_id)
        except pytest.skip.Exception:
            skipped.append(row_id)
            continue
        texts += ([raised[1]] if raised else []) + [m for _, m in warned]
    if skipped:
        pytest.skip(f"triggers skipped (optional dependencies missing): {skipped}")
    sites = _message_sites()
    assert len(sites) > 100  # the scan sees the code
    missing = [
        f"pyro_mpt/{key.split('::')[0]}:{line} ({key.split('::')[1]})"
        for key, line, pattern in sites
        if key not in INTERNAL and not any(pattern.search(t) for t in texts)
    ]
    assert not missing, "messages with no row in docs/errors.md (or entry in INTERNAL): " + ", ".join(missing)
    assert set(INTERNAL) <= {key for key, _, _ in sites}, "INTERNAL names functions without messages"
    internal_table = ERRORS_MD.read_text(encoding="utf-8").split("## Internal errors", 1)[1]
    unlisted = [key for key in INTERNAL if key.split("::")[1].rsplit(".", 1)[-1] not in internal_table]
    assert not unlisted, f"INTERNAL entries missing from the internal errors of docs/errors.md: {unlisted}"
