"""MaskedPretrainingLoss under Pyro's ELBO contract: SVI, module style, PyroModule, minibatches, errors."""

import math

import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroModule, PyroParam, PyroSample
from pyro.optim import Adam

from pyro_mpt import Evidence, MaskedPretrainingLoss

from models import make_ppca


def ml_lml_ppca(x, K):
    """Closed-form maximum-likelihood PPCA (Tipping & Bishop 1999): mean log p(x_i) at the optimum."""
    N, D = x.shape
    mu = x.mean(0)
    xc = x - mu
    evals, evecs = torch.linalg.eigh(xc.T @ xc / N)
    evals, evecs = evals.flip(0), evecs.flip(1)
    s2 = evals[K:].mean()
    W = evecs[:, :K] * (evals[:K] - s2).sqrt()
    S = W @ W.T + s2 * torch.eye(D, dtype=x.dtype)
    return float(torch.distributions.MultivariateNormal(mu, S).log_prob(x).mean())


def test_svi_uniform_masks_reach_the_maximum_likelihood_lml():
    pyro.set_rng_seed(0)
    N, D, K = 2000, 10, 2
    W_true = torch.randn(D, K)
    x = torch.randn(N, K) @ W_true.T + 0.5 * torch.randn(N, D)

    def ppca(x):
        W = pyro.param("W", torch.randn(D, K))
        mu = pyro.param("mu", torch.zeros(D))
        s = pyro.param("s", torch.tensor(1.0), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    loss = MaskedPretrainingLoss(masks="uniform", num_masks=1)
    svi = SVI(ppca, lambda x: None, Adam({"lr": 2e-2}), loss=loss)
    start = float(Evidence(ppca)(x).mean())
    for _ in range(1000):
        value = svi.step(x)
    assert math.isfinite(value)
    final = float(Evidence(ppca)(x).mean())
    best = ml_lml_ppca(x, K)
    assert final < best + 1e-6  # nobody beats the maximum likelihood
    assert best - final < 0.05, (start, final, best)


def test_loss_value_is_minus_scaled_sum_and_grads_are_set():
    model, x, exact = make_ppca(6, 2, N=10)
    loss = MaskedPretrainingLoss(masks="order")
    value = loss.loss(model, None, x)
    assert isinstance(value, float)
    assert abs(value + float(exact(x).sum())) < 1e-4
    W = pyro.param("W").unconstrained()
    W.grad = None
    value2 = loss.loss_and_grads(model, None, x)
    assert abs(value2 - value) < 1e-4 and W.grad is not None
    expected = torch.autograd.grad(-exact(x).sum(), W)[0]
    assert torch.allclose(W.grad, expected, atol=1e-3)


def test_module_style_loss(float64):
    model, x, exact = make_ppca(5, 2, N=8)
    guide = lambda x: None  # noqa: E731
    module = MaskedPretrainingLoss(masks="exhaustive")(model, guide)
    assert isinstance(module, torch.nn.Module)
    out = module(x)
    assert out.requires_grad
    assert abs(float(out) + float(exact(x).sum())) < 1e-8


def test_pyro_module_model_trains_in_module_style(float64):
    D, K, N = 6, 2, 200
    pyro.set_rng_seed(1)
    W_true = torch.randn(D, K)
    x = torch.randn(N, K) @ W_true.T + 0.3 * torch.randn(N, D)

    class PPCA(PyroModule):
        def __init__(self):
            super().__init__()
            self.W = PyroParam(0.1 * torch.randn(D, K))
            self.log_s = PyroParam(torch.tensor(0.0))
            self.z_prior = PyroSample(dist.Normal(0.0, 1.0).expand([K]).to_event(1))

        def forward(self, x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
                return pyro.sample("x", dist.Normal(z @ self.W.T, self.log_s.exp()).to_event(1), obs=x)

    model = PPCA()
    loss_fn = MaskedPretrainingLoss(masks="uniform", num_masks=4)(model, lambda x: None)
    params = list(loss_fn.parameters())
    assert len(params) == 2
    opt = torch.optim.Adam(params, lr=0.05)
    before = float(Evidence(model)(x).mean())
    for _ in range(150):
        opt.zero_grad()
        loss_fn(x).backward()
        opt.step()
    after = float(Evidence(model)(x).mean())
    assert after > before + 1.0
    assert ml_lml_ppca(x, K) - after < 0.1


def test_subsampled_plate_scales_each_datapoint(float64):
    model_full, x, exact = make_ppca(6, 2, N=12)
    W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
    N = x.shape[0]

    def model(x, idx=None, subsample_size=None):
        with pyro.plate("data", N, subsample=idx, subsample_size=subsample_size) as i:
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x[i])

    loss = MaskedPretrainingLoss(masks="order")
    idx = torch.tensor([1, 4, 7])
    got = loss.loss(model, None, x, idx)
    assert abs(got + N / 3 * float(exact(x)[idx].sum())) < 1e-9
    # averaging over random minibatches gives the full-data loss: the minibatch loss is unbiased
    full = -float(exact(x).sum())
    draws = torch.tensor([loss.loss(model, None, x, None, 3) for _ in range(3000)])
    se = float(draws.std()) / math.sqrt(len(draws))
    assert abs(float(draws.mean()) - full) < 4 * se
    assert float(draws.std()) > 0.1


def test_guide_with_subsampled_plate_is_replayed(float64):
    """The minibatch drawn by the guide's plate is the one the model scores."""
    _, x, exact = make_ppca(5, 2, N=10)
    W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
    seen = []

    def model(x):
        with pyro.plate("data", 10, subsample_size=4) as i:
            seen.append(i.clone())
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x[i])

    def guide(x):
        with pyro.plate("data", 10, subsample_size=4):
            pass

    value = MaskedPretrainingLoss(masks="order").loss(model, guide, x)
    assert all(torch.equal(i, seen[0]) for i in seen)
    assert abs(value + 2.5 * float(exact(x)[seen[0]].sum())) < 1e-9


def test_poutine_scale_multiplies_the_loss(float64):
    model, x, exact = make_ppca(5, 2, N=6)
    loss = MaskedPretrainingLoss(masks="order")
    scaled = pyro.poutine.scale(model, scale=0.25)
    assert abs(loss.loss(scaled, None, x) - 0.25 * loss.loss(model, None, x)) < 1e-9


def test_trace_elbo_side_by_side(float64):
    """MPT and Trace_ELBO train the same model and guide-free/guided variants coexist."""
    from pyro.infer.autoguide import AutoNormal

    model, x, exact = make_ppca(5, 2, N=50)
    guide = AutoNormal(model)
    elbo = Trace_ELBO().loss(model, guide, x)
    mpt = MaskedPretrainingLoss(masks="order").loss(model, guide, x)
    # the ELBO is a lower bound of log p(x); order-MPT is log p(x) exactly
    assert -elbo <= -mpt + 1e-9
    assert abs(mpt + float(exact(x).sum())) < 1e-8


# ---------------------------------------------------------------- bad input


def test_no_observed_site():
    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="no observed sample site"):
        MaskedPretrainingLoss().loss(model, None)


def test_several_observed_sites_need_obs_site(float64):
    def model(x, y):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ torch.ones(2, 3), 1.0).to_event(1), obs=x)
            pyro.sample("y", dist.Normal(z.sum(-1, keepdim=True), 1.0).to_event(1), obs=y)

    x, y = torch.randn(4, 3), torch.randn(4, 1)
    with pytest.raises(ValueError, match=r"several sites \('x', 'y'\).*obs_site="):
        MaskedPretrainingLoss().loss(model, None, x, y)
    with pytest.raises(ValueError, match="obs_site='w' is not a site"):
        MaskedPretrainingLoss(obs_site="w").loss(model, None, x, y)
    with pytest.raises(ValueError, match="obs_site='z' is not an observed sample site"):
        MaskedPretrainingLoss(obs_site="z").loss(model, None, x, y)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_observation_names_the_site(bad):
    model, x, _ = make_ppca(4, 2, N=3, dtype=torch.float32)
    x = x.clone()
    x[1, 2] = bad
    with pytest.raises(ValueError, match=r"Observed site 'x' contains 1 NaN or infinite"):
        MaskedPretrainingLoss().loss(model, None, x)


def test_tokens_without_event_dims_are_refused():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)

    with pytest.raises(ValueError, match=r"'x' has no event dims.*to_event"):
        MaskedPretrainingLoss().loss(model, None, torch.randn(5))


def test_batch_dims_must_be_plates():
    def model(x):
        pyro.sample("x", dist.Normal(torch.zeros(5, 3), 1.0).to_event(1), obs=x)

    with pytest.raises(ValueError, match=r"dim -1 \(size 5\) is not a pyro.plate"):
        MaskedPretrainingLoss().loss(model, None, torch.randn(5, 3))


def test_auto_lists_the_engines_when_none_applies():
    def model(x):
        # a Poisson observation (not Gaussian) with a latent shared by all datapoints
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Poisson(torch.exp(w)).to_event(1), obs=x)

    with pytest.raises(ValueError, match=r"(?s)conditionals='auto' found no engine.*'gaussian': needs"):
        MaskedPretrainingLoss(conditionals="auto").loss(model, None, torch.ones(4, 3))


def test_unknown_engine_name():
    with pytest.raises(ValueError, match="Unknown conditionals='magic'"):
        MaskedPretrainingLoss(conditionals="magic")
