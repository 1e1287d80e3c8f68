"""Models and data of different float dtypes: every schedule and engine returns torch's
promotion of the two, as Pyro's own log-densities do (float64 parameters, float32 data:
float64), and computes in it."""

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from scipy.stats import multivariate_normal

from pyro_mpt import Evidence, MaskedPretrainingLoss

N, D, K = 5, 4, 1
PAIRS = [(torch.float64, torch.float32), (torch.float32, torch.float64)]
SCHEDULES = ["uniform", "stratified", "all", "nested", "order", "exhaustive", "pll", 0.5]


def _w(dtype):
    return torch.randn(D, K, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)


def _ppca(dtype):
    W = _w(dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=dtype), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, torch.tensor(0.5, dtype=dtype)).to_event(1), obs=x)

    return model, {}


def _bernoulli(dtype):
    W = _w(dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=dtype), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T).to_event(1), obs=x)

    return model, {}


def _mixture(dtype):
    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Bernoulli(torch.tensor(0.4, dtype=dtype)))
            loc = 3.0 * c.unsqueeze(-1) * torch.ones(D, dtype=dtype)
            pyro.sample("x", dist.Normal(loc, torch.tensor(1.0, dtype=dtype)).to_event(1), obs=x)

    return model, {}


def _hmm(dtype):
    init, trans = torch.zeros(2, dtype=dtype), torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=dtype)
    locs = torch.tensor([0.0, 2.0], dtype=dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Normal(locs, 1.0)), obs=x)

    return model, {}


def _hierarchy(dtype, tau=0.8, s=0.7):
    W = _w(dtype)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(K, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu, tau).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    return model, {"token_plates": ("data",)}


CASES = {
    "gaussian": (_ppca, SCHEDULES),
    "quadrature": (_bernoulli, SCHEDULES),
    "importance": (_ppca, ["uniform", "order", "exhaustive"]),
    "enumerate": (_mixture, SCHEDULES),
    "hmm": (_hmm, SCHEDULES),
    # one datapoint of N D = 20 tokens: too many for "exhaustive"
    "hierarchical": (_hierarchy, ["uniform", "all", "order", "pll", 0.5]),
}


def _data(dtype, binary=False):
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return (x > 0).to(dtype) if binary else x.to(dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the prior as proposal: k-hat warnings
@pytest.mark.parametrize("params, data", PAIRS, ids=["f64-params-f32-data", "f32-params-f64-data"])
@pytest.mark.parametrize("engine", list(CASES))
def test_every_schedule_and_engine_returns_the_promoted_dtype(engine, params, data):
    """Before: the Gaussian engine's sums over masks (per datapoint, and the aggregated form of
    shared ones) came back in the data's float32 while "order" and "pll" gave float64; the
    hierarchical engine crashed on either pair (its probes in the data's dtype met the model's)."""
    build, schedules = CASES[engine]
    model, options = build(params)
    x = _data(data, binary=engine == "quadrature")
    want = torch.promote_types(params, data)
    pyro.set_rng_seed(0)
    for masks in schedules:
        for share in (False, True):
            loss = MaskedPretrainingLoss(conditionals=engine, masks=masks, share_masks=share, **options)
            assert loss.score(model, None, x).dtype == want, (masks, share)
            assert loss.differentiable_loss(model, None, x).dtype == want, (masks, share)
    if engine in ("gaussian", "enumerate", "hmm", "hierarchical"):
        assert Evidence(model, method="exact", **options)(x).dtype == want


@pytest.mark.parametrize("share", [False, True])
def test_float64_model_on_float32_data_keeps_float64_digits(share):
    """float64 parameters, float32 data: the exact schedules equal scipy's log-density of the
    (float32-rounded) data in float64 to 1e-10 relative; before, the sums over masks came back
    rounded to float32 (about 1e-7 relative off)."""
    model, _ = _ppca(torch.float64)
    x = _data(torch.float32)
    W = _w(torch.float64).numpy()
    ref = multivariate_normal(np.zeros(D), W @ W.T + 0.25 * np.eye(D)).logpdf(x.double().numpy())
    for masks in ["exhaustive", "order"]:
        got = MaskedPretrainingLoss(masks=masks, share_masks=share).score(model, None, x)
        assert got.dtype == torch.float64
        assert np.abs(got.numpy() - ref).max() < 1e-10 * np.abs(ref).max()
    # a loss whose blocks of shared masks take the aggregated form (many datapoints)
    xl = torch.randn(400, D, generator=torch.Generator().manual_seed(2)).float()
    refl = multivariate_normal(np.zeros(D), W @ W.T + 0.25 * np.eye(D)).logpdf(xl.double().numpy()).sum()
    got = MaskedPretrainingLoss(masks="exhaustive", share_masks=True).differentiable_loss(model, None, xl)
    assert got.dtype == torch.float64 and abs(got.item() + refl) < 1e-10 * abs(refl)


@pytest.mark.parametrize("params, data", PAIRS, ids=["f64-params-f32-data", "f32-params-f64-data"])
def test_hierarchy_of_mixed_dtypes_matches_the_dense_closed_form(params, data):
    """The whole dataset as one datapoint (token_plates=("data",)): log N(vec x; 0, Sigma) with
    Sigma = 1 1^T (x) W W^T + I (x) (tau^2 W W^T + s^2 I), by numpy, to the rounding of the
    narrower dtype (before: a dtype error inside the engine)."""
    tau, s = 0.8, 0.7
    model, options = _hierarchy(params, tau, s)
    x = _data(data)
    W = _w(params).double().numpy()
    WW = W @ W.T
    cov = np.kron(np.ones((N, N)), WW) + np.kron(np.eye(N), tau**2 * WW + s**2 * np.eye(D))
    ref = multivariate_normal(np.zeros(N * D), cov).logpdf(x.double().numpy().reshape(-1))
    got = MaskedPretrainingLoss(conditionals="hierarchical", masks="order", **options).score(model, None, x)
    assert got.dtype == torch.float64
    assert abs(float(got.sum()) - ref) < 1e3 * torch.finfo(torch.float32).eps * abs(ref)


@pytest.mark.parametrize("likelihood", ["normal", "bernoulli"])
def test_quadrature_with_a_two_dimensional_latent_and_float32_parameters_on_float64_data(likelihood):
    """The context grids' standard rule came in the parameters' float32 and their centres in the
    data's float64: "expected scalar type Float but found Double" for "uniform", "exhaustive",
    "pll" and curves along orderings (the one-latent tests did not reach it). Now float64, equal
    to the same model with float64 parameters of the float32 values, to float32's rounding of
    the model's own arithmetic."""
    K2 = 2
    W32 = torch.randn(D, K2, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    mu32 = torch.linspace(-0.5, 0.5, D).float()

    def build(dtype):
        W, mu = W32.to(dtype), mu32.to(dtype)

        def model(x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=dtype), 1.0).expand([K2]).to_event(1))
                loc = z @ W.T + mu
                obs = dist.Normal(loc, torch.tensor(0.5, dtype=dtype)) if likelihood == "normal" else dist.Bernoulli(logits=loc)
                pyro.sample("x", obs.to_event(1), obs=x)

        return model

    x = _data(torch.float64, binary=likelihood == "bernoulli")
    for masks in ("uniform", "exhaustive", "pll", "order"):
        got, want = [], []
        for dtype, out in ((torch.float32, got), (torch.float64, want)):
            pyro.set_rng_seed(0)
            loss = MaskedPretrainingLoss(conditionals="quadrature", masks=masks)
            out.append(loss.score(build(dtype), None, x))
            if masks == "order":
                out.append(torch.as_tensor(loss.curve(build(dtype), None, x).score))
        for a, b in zip(got, want):
            assert a.dtype == torch.float64
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (masks, float((a - b).abs().max()))
