"""Scales on sites (``poutine.scale``, subsampled plates) and what the MPT loss does with them.

The loss is ``-sum_i s_i log p(x_i)`` with ``s_i`` the observed site's scale; a scale
on a latent alone (KL annealing) has no term to weight once the latent is integrated
out, so it is refused rather than ignored.
"""

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDelta
from scipy.special import logsumexp
from scipy.stats import multivariate_normal, norm

from pyro_mpt import ImportanceWeightedELBO, MaskedPretrainingLoss

N, D, K, SIGMA = 6, 3, 1, 0.5


def _data():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return W, x


def _ppca(W, beta=1.0, weights=None, model_scale=None, subsample=None):
    """PPCA as in Pyro's tutorials, with ``poutine.scale(beta)`` on the latent, datapoint
    ``weights`` on the observation and an optional subsampled plate."""

    def model(x):
        with pyro.plate("data", x.shape[0], subsample=subsample) as i:
            with poutine.scale(scale=beta):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0).expand([K]).to_event(1))
            with poutine.scale(scale=1.0 if weights is None else weights[i]):
                pyro.sample("x", dist.Normal(z @ W.T, SIGMA).to_event(1), obs=x[i])

    return model if model_scale is None else poutine.scale(model, scale=model_scale)


def _exact(W, x):
    cov = (W @ W.T).numpy() + SIGMA**2 * np.eye(D)
    return multivariate_normal(np.zeros(D), cov).logpdf(x.numpy())


@pytest.mark.parametrize("engine", ["auto", "gaussian", "quadrature", "importance"])
def test_a_scale_on_a_latent_alone_is_refused(engine):
    """KL annealing written as in Pyro (poutine.scale around the latent): before, every engine
    integrated z out and returned the unscaled loss, whatever beta (34.67 for beta = 0.1 and 1)."""
    W, x = _data()
    loss = MaskedPretrainingLoss(conditionals=engine, masks="exhaustive")
    with pytest.raises(ValueError, match=r"latent site 'z' has scale 0\.1 .* observed site 'x' has 1\b.*Trace_ELBO"):
        loss.loss(_ppca(W, beta=0.1), None, x)
    # per-datapoint scales on the latent, and ones unlike the observation's weights, too
    with pytest.raises(ValueError, match="latent site 'z' has scale 0.5 to 2"):
        loss.loss(_ppca(W, beta=torch.linspace(0.5, 2.0, N, dtype=torch.float64)), None, x)
    with pytest.raises(ValueError, match="ImportanceWeightedELBO: latent site 'z'"):
        ImportanceWeightedELBO(num_particles=2).loss(_ppca(W, beta=0.1), lambda x: None, x)


def test_a_scale_on_the_guide_alone_is_refused():
    """poutine.scale around the guide alone: the importance weights p(x, z) / q(z) have no
    place for it, and ImportanceWeightedELBO returned the unscaled loss (equal to 1e-15),
    silently. A guide scaled like the whole model is the Pyro way to scale a loss and is
    served: the loss is s times the unscaled one (the same draws)."""
    W, x = _data()
    # the exact posterior of z given x_i, q(z) = N(m_i, v)
    v = 1.0 / (1.0 + float((W.T @ W).squeeze()) / SIGMA**2)
    mean = v * (x @ W) / SIGMA**2

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(mean, v**0.5).to_event(1))

    model = _ppca(W)
    for loss in (ImportanceWeightedELBO(num_particles=4), MaskedPretrainingLoss(conditionals="importance", masks="exhaustive")):
        with pytest.raises(ValueError, match=r"the guide's site 'z' has scale 0\.3 .* observed site 'x' has 1\b"):
            loss.loss(model, poutine.scale(guide, scale=0.3), x)
    iw = ImportanceWeightedELBO(num_particles=4)
    pyro.set_rng_seed(0)
    plain = iw.loss(model, guide, x)
    pyro.set_rng_seed(0)
    scaled = iw.loss(poutine.scale(model, scale=0.3), poutine.scale(guide, scale=0.3), x)
    assert abs(scaled - 0.3 * plain) < 1e-10
    # the exact posterior as proposal: every weight is p(x_i)
    assert abs(plain + _exact(W, x).sum()) < 1e-10


def test_a_scale_on_a_discrete_latent_is_refused_by_enumeration():
    x = torch.tensor([[0.0, 0.5], [3.0, 2.5], [0.2, -0.1]], dtype=torch.float64)

    def mixture(x):
        with pyro.plate("data", x.shape[0]), poutine.scale(scale=0.3):
            c = pyro.sample("c", dist.Bernoulli(torch.tensor(0.4, dtype=x.dtype)))
            with poutine.scale(scale=1 / 0.3):  # the observation itself unscaled
                pyro.sample("x", dist.Normal(3.0 * c.unsqueeze(-1) * torch.ones(2, dtype=x.dtype), 1.0).to_event(1), obs=x)

    with pytest.raises(ValueError, match="latent site 'c' has scale 0.3"):
        MaskedPretrainingLoss(conditionals="enumerate", masks="exhaustive").loss(mixture, None, x)


def test_observed_scales_multiply_each_datapoints_log_evidence():
    """Datapoint weights on the observation, a whole-model scale and a subsampled plate: the
    exact schedules' loss is -sum_i s_i log N(x_i; 0, W W^T + sigma^2 I) (scipy), s_i the product."""
    W, x = _data()
    ref = _exact(W, x)
    weights = torch.linspace(0.5, 3.0, N, dtype=torch.float64)
    idx = torch.tensor([4, 1, 2])
    cases = [
        (_ppca(W, weights=weights), weights.numpy(), slice(None)),
        (_ppca(W, model_scale=0.25), np.full(N, 0.25), slice(None)),
        # beta equal to the observation's scale: the whole datapoint's joint density scaled alike
        (_ppca(W, beta=0.25, model_scale=None, weights=torch.full((N,), 0.25, dtype=torch.float64)),
         np.full(N, 0.25), slice(None)),
        (_ppca(W, weights=weights, subsample=idx), N / 3 * weights[idx].numpy(), idx.numpy()),
        (_ppca(W, model_scale=0.5, subsample=idx), np.full(3, N / 3 * 0.5), idx.numpy()),
    ]
    for model, scale, rows in cases:
        want = -(scale * ref[rows]).sum()
        for engine, masks in [("gaussian", "exhaustive"), ("gaussian", "order"), ("quadrature", "order")]:
            got = MaskedPretrainingLoss(conditionals=engine, masks=masks).loss(model, None, x)
            assert abs(got - want) < 1e-8 * abs(want), (engine, masks, got, want)


def test_a_scale_on_a_point_mass_global_weights_its_log_prior():
    """A global latent held at an AutoDelta point mass keeps its scale: the loss is
    -[sum_i log p(x_i | theta) + 0.5 log p(theta)], as TraceEnum_ELBO computes it."""
    data = torch.tensor([0.0, 1.0, 10.0, 11.0, 2.0], dtype=torch.float64)

    @config_enumerate
    def gmm(data):
        with poutine.scale(scale=0.5):
            loc = pyro.sample("loc", dist.Normal(torch.tensor(0.0, dtype=data.dtype), 10.0))
        with pyro.plate("data", len(data)):
            a = pyro.sample("a", dist.Bernoulli(torch.tensor(0.3, dtype=data.dtype)))
            pyro.sample("obs", dist.Normal(loc * a, 1.5), obs=data)

    pyro.clear_param_store()
    guide = AutoDelta(poutine.block(gmm, expose=["loc"]), init_loc_fn=lambda site: torch.tensor(9.0, dtype=torch.float64))
    got = MaskedPretrainingLoss(masks="exhaustive").loss(gmm, guide, data)
    ref = TraceEnum_ELBO(max_plate_nesting=1).loss(gmm, guide, data)
    x = data.numpy()
    closed = -(logsumexp([np.log(0.7) + norm.logpdf(x, 0.0, 1.5), np.log(0.3) + norm.logpdf(x, 9.0, 1.5)], axis=0).sum()
               + 0.5 * norm.logpdf(9.0, 0.0, 10.0))
    assert abs(ref - closed) < 1e-10 * abs(closed)
    assert abs(got - closed) < 1e-10 * abs(closed)


def test_a_mask_on_a_latent_alone_is_refused_and_a_mask_on_the_datapoint_drops_it():
    """poutine.mask (or dist.mask) on the latent alone was ignored like a scale (the loss equal
    to the unmasked one, 39.72 here); around the latent and its observation it leaves the
    datapoint out: the loss is -sum of log N(x_i; 0, W W^T + sigma^2 I) over the kept ones."""
    W, x = _data()
    keep = torch.tensor([True, False, True, True, False, True])

    def model(mask_latent, mask_obs, dist_mask=False):
        def fn(x):
            with pyro.plate("data", x.shape[0]):
                prior = dist.Normal(torch.zeros((), dtype=x.dtype), 1.0).expand([K]).to_event(1)
                with poutine.mask(mask=keep if mask_latent and not dist_mask else True):
                    z = pyro.sample("z", prior.mask(keep) if dist_mask else prior)
                with poutine.mask(mask=keep if mask_obs else True):
                    pyro.sample("x", dist.Normal(z @ W.T, SIGMA).to_event(1), obs=x)
        return fn

    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="exhaustive")
    for dist_mask in (False, True):
        with pytest.raises(ValueError, match=r"latent site 'z' is masked .* at 2 element\(s\) .*Mask the observation too"):
            loss.loss(model(True, False, dist_mask), None, x)
    want = -_exact(W, x)[keep.numpy()].sum()
    for engine in ["gaussian", "quadrature"]:
        got = MaskedPretrainingLoss(conditionals=engine, masks="exhaustive").loss(model(True, True), None, x)
        assert abs(got - want) < 1e-8 * abs(want)
