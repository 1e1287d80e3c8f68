"""Models that cannot run vectorized (issue 13 §7): the sampling engines run them one point at a time.

``PyroModule[nn.Linear]`` with sampled weights calls ``F.linear``, which takes a 2-D
weight only, so the model fails in a particle plate. The reference is a broadcast-
friendly twin of the same model (same sites, same priors) and the exact evidence.
"""

import warnings

import numpy as np
import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import SlowEngineWarning

N, D, K = 6, 3, 1


class BayesianLinear(PyroModule):
    def __init__(self):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](K, D)
        self.linear.weight = PyroSample(dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([D, K]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([D]).to_event(1))

    def forward(self, c, x):
        loc = self.linear(c)  # the weights are sampled once, outside the data plate
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)


def twin(c, x):
    """The same model written to broadcast over extra batch dims on the left."""
    W = pyro.sample("linear.weight", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0).expand([D, K]).to_event(2))
    b = pyro.sample("linear.bias", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0).expand([D]).to_event(1))
    loc = (W @ c[..., None]).squeeze(-1) + b
    with pyro.plate("data", x.shape[0]):
        pyro.sample("x", dist.Normal(loc, 0.5).to_event(1), obs=x)


def _data():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = c @ torch.randn(K, D, generator=g, dtype=torch.float64) + 0.5 * torch.randn(N, D, generator=g, dtype=torch.float64)
    return c, x


def test_per_point_importance_equals_the_vectorized_twin_and_the_exact_evidence():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    c, x = _data()
    model = BayesianLinear()
    guide = AutoMultivariateNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(300):
        svi.step(c, x)
    ev = dict(method="importance", num_samples=200, token_plates=("data",))
    pyro.set_rng_seed(1)
    with pytest.warns(SlowEngineWarning, match="running it once per value instead") as record:
        res = Evidence(model, guide, **ev).estimate(c, x)
    assert sum(issubclass(w.category, SlowEngineWarning) for w in record) == 1  # once per call
    pyro.set_rng_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowEngineWarning)  # the twin runs vectorized
        twin_res = Evidence(twin, guide, **ev).estimate(c, x)
    # the same guide draws, each decoded one point at a time or all at once
    assert abs(float(res.log_evidence) - float(twin_res.log_evidence)) < 1e-10
    # and that estimator is right: with many draws (vectorized) it meets the exact evidence
    exact = float(Evidence(twin, method="exact", token_plates=("data",))(c, x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        many = Evidence(twin, guide, method="importance", num_samples=20000, token_plates=("data",)).estimate(c, x)
    assert abs(float(many.log_evidence) - exact) < 4 * float(many.stderr)
    assert abs(float(Evidence(model, method="exact", token_plates=("data",))(c, x)) - exact) < 1e-10


def test_per_point_importance_conditionals_train_in_svi_and_large_calls_are_refused():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    c, x = _data()
    model = BayesianLinear()
    from pyro_mpt.conditionals import ImportanceConditionals

    loss = MaskedPretrainingLoss(conditionals=ImportanceConditionals(32, diagnostics=False), token_plates=("data",))
    svi = SVI(model, lambda c, x: None, Adam({"lr": 0.01}), loss)
    with pytest.warns(SlowEngineWarning):
        losses = [svi.step(c, x) for _ in range(2)]
    assert np.isfinite(losses).all()
    with pytest.raises(ValueError, match="3000 model runs, more than 2048.*torch.matmul instead of nn.Linear"):
        Evidence(model, method="importance", num_samples=3000, token_plates=("data",))(c, x)
