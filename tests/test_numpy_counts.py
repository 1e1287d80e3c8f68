"""Counts and options given as numpy scalars (a grid of settings from ``np.arange`` or
``np.linspace``): the loss, the engines and ``Evidence`` take them as the Python numbers they
equal, as the HuggingFace adapters already did. ``num_masks=np.int64(3)`` was refused with
"num_masks must be a positive integer ..., got np.int64(3)" (and so were ``num_nodes``,
``num_samples``, ``num_chains``, ``num_iterations``, and ``jitter=np.float32(0)``). Every value is
checked against scipy written here.
"""

import numpy as np
import pytest
import pyro
import pyro.distributions as dist
import torch
from scipy import integrate, stats

from pyro_mpt import (
    EncodeDecodeConditionals, Evidence, GaussianConditionals, ImportanceConditionals, MaskedPretrainingLoss,
)

from models import exact_posterior_guide, make_ppca

pytestmark = pytest.mark.usefixtures("float64")


def _scipy_ppca_lml(x):
    """log N(x_i; mu, W W^T + s^2 I) at make_ppca's params, by scipy."""
    W, mu, s = (pyro.param(k).detach().numpy() for k in ("W", "mu", "s"))
    cov = W @ W.T + s**2 * np.eye(W.shape[0])
    return stats.multivariate_normal(mu, cov).logpdf(x.numpy())


def test_numpy_counts_of_the_loss_and_the_gaussian_engine():
    model, x, _ = make_ppca(5, 2, N=6, seed=3)
    ref = _scipy_ppca_lml(x)
    loss = MaskedPretrainingLoss(masks="order", num_masks=np.int64(3), chunk_size=np.int64(2 * 6 * 5))
    assert type(loss.schedule.num_masks) is int and loss.schedule.num_masks == 3
    np.testing.assert_allclose(loss.score(model, None, x).detach().numpy(), ref, rtol=0, atol=1e-10)
    engine = GaussianConditionals(jitter=np.float32(0.0), max_jitter=np.float32(1e-3))
    score = MaskedPretrainingLoss(conditionals=engine, masks="exhaustive").score(model, None, x)
    np.testing.assert_allclose(score.detach().numpy(), ref, rtol=0, atol=1e-10)
    # random schedules: the numpy count draws what the int draws
    for masks in ("all", "stratified"):
        pyro.set_rng_seed(4)
        a = MaskedPretrainingLoss(masks=masks, num_masks=np.int32(2)).score(model, None, x)
        pyro.set_rng_seed(4)
        b = MaskedPretrainingLoss(masks=masks, num_masks=2).score(model, None, x)
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=0, atol=1e-12)
        assert float((a.detach() - torch.as_tensor(ref)).abs().max()) > 1e-6  # random: the comparison above has power


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_chunk_size_must_be_a_positive_integer(bad):
    # 0 and -5 ran silently one query per block, 2.5 ran as 2
    with pytest.raises(ValueError, match=r"chunk_size=.*give a positive integer"):
        MaskedPretrainingLoss(chunk_size=bad)


def test_numpy_node_count_of_quadrature():
    a, b = np.array([0.3, -0.2, 0.5]), np.array([0.8, -0.5, 0.3])
    x = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 4.0]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.5, 1.2))
            rate = (torch.as_tensor(a) + torch.as_tensor(b) * z.unsqueeze(-1)).exp()
            pyro.sample("x", dist.Poisson(rate).to_event(1), obs=x)

    def lml(xi):
        f = lambda z: np.exp(stats.poisson(np.exp(a + b * z)).logpmf(xi).sum() + stats.norm(0.5, 1.2).logpdf(z))
        return np.log(integrate.quad(f, -12, 12, epsabs=0, epsrel=1e-12, limit=200)[0])

    ref = np.array([lml(xi) for xi in x.numpy()])
    ev = Evidence(model, method="quadrature", num_nodes=np.int64(24), init_nodes=np.int64(12))(x)
    np.testing.assert_allclose(ev.detach().numpy(), ref, rtol=0, atol=1e-8)
    order = MaskedPretrainingLoss(conditionals="quadrature", masks="order", num_nodes=np.int64(24))
    np.testing.assert_allclose(order.score(model, None, x).detach().numpy(), ref, rtol=0, atol=1e-8)


def test_numpy_counts_of_importance_sampling():
    model, x, _ = make_ppca(4, 2, N=5, seed=5)
    ref = _scipy_ppca_lml(x)
    # the exact posterior as proposal: every draw's weight is p(x_i), for any number of draws
    res = Evidence(model, exact_posterior_guide, method="importance", num_samples=np.int64(7)).estimate(x)
    np.testing.assert_allclose(res.log_evidence.detach().numpy(), ref, rtol=0, atol=1e-8)
    engine = ImportanceConditionals(num_samples=np.int64(64), num_chains=np.int64(1), num_iterations=np.int64(0))
    assert (engine.num_samples, engine.num_chains, engine.num_iterations) == (64, 1, 0)
    assert all(type(v) is int for v in (engine.num_samples, engine.num_chains, engine.num_iterations))
    pyro.set_rng_seed(6)
    a = MaskedPretrainingLoss(conditionals=engine, masks="order").score(model, None, x)
    pyro.set_rng_seed(6)
    b = MaskedPretrainingLoss(conditionals="importance", num_samples=64, masks="order").score(model, None, x)
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=0, atol=1e-12)
    # prior draws: the chain sums telescope to an importance estimate of log p(x_i), near scipy's
    # (64 prior draws: about 1 nat off at worst over seeds; its accuracy is test_importance's)
    assert float(np.abs(a.detach().numpy() - ref).max()) < 2.0
    ed = EncodeDecodeConditionals(num_samples=np.int64(4), num_iterations=np.int64(2))
    assert (ed.num_samples, ed.num_iterations) == (4, 2) and type(ed.num_samples) is int
