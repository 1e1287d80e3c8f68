"""Property-based tests of the Gaussian closed-form engine.

For random linear-Gaussian models over random shapes, plates and dtypes:
exhaustive MPT equals the exact LML; "order" has zero variance; results are
invariant to chunk sizes and to the order of datapoints; the loss is invariant
to permuting tokens together with the model's parameters.
"""

import math

import pytest
import torch
import pyro
import pyro.distributions as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyro_mpt import Evidence, GaussianConditionals, MaskedPretrainingLoss

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

DTYPES = st.sampled_from([torch.float32, torch.float64])
METHODS = st.sampled_from(["lowrank", "dense"])
SEEDS = st.integers(0, 2**31 - 1)


def _tol(dtype):
    # (rtol, atol) relative to the magnitude of the exact LML
    return (1e-3, 1e-3) if dtype == torch.float32 else (1e-8, 1e-8)


def assert_close(actual, expected, dtype):
    rtol, atol = _tol(dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == dtype, actual.dtype
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}\n{actual}\n{expected}"


# --------------------------------------------------------------------------- models
class LinearGaussian:
    """x = W z + mu + noise over D tokens, z ~ N(0, I_K), with arbitrary batch and event layouts.

    ``batch``: the batch shape (one plate per dim); ``event``: the observation's
    event shape (its product is D); ``per_token``: factor-analysis noise (one
    scale per token) instead of one shared scale.
    """

    def __init__(self, batch, event, K, dtype, seed, per_token):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.event, self.K, self.dtype = tuple(batch), tuple(event), K, dtype
        self.D = D = math.prod(event)
        self.W0 = torch.randn(D, K, generator=g, dtype=torch.float64).to(dtype)
        self.mu0 = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
        if per_token:
            self.s0 = (0.4 + torch.rand(D, generator=g, dtype=torch.float64)).to(dtype)
        else:
            self.s0 = (0.4 + torch.rand((), generator=g, dtype=torch.float64)).to(dtype)
        z = torch.randn(*batch, K, generator=g, dtype=torch.float64).to(dtype)
        eps = torch.randn(*batch, D, generator=g, dtype=torch.float64).to(dtype)
        self.x = (z @ self.W0.T + self.mu0 + self.s0 * eps).reshape(*batch, *event)

    def params(self, W0=None, mu0=None, s0=None):
        pyro.clear_param_store()
        self.W0 = self.W0 if W0 is None else W0
        self.mu0 = self.mu0 if mu0 is None else mu0
        self.s0 = self.s0 if s0 is None else s0
        return self

    def __call__(self, x):
        W = pyro.param("W", self.W0.clone())
        mu = pyro.param("mu", self.mu0.clone())
        s = pyro.param("s", self.s0.clone(), constraint=dist.constraints.positive)
        batch = x.shape[: x.dim() - len(self.event)]
        plates = [
            pyro.plate(f"plate_{i}", size, dim=i - len(batch)) for i, size in enumerate(batch)
        ]
        for p in plates:
            p.__enter__()
        try:
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=self.dtype), 1.0).expand([self.K]).to_event(1))
            loc = (z @ W.T + mu).reshape(*z.shape[:-1], *self.event)
            scale = s.reshape(self.event) if s.dim() else s
            pyro.sample("x", dist.Normal(loc, scale).to_event(len(self.event)), obs=x)
        finally:
            for p in reversed(plates):
                p.__exit__(None, None, None)

    def exact(self, x):
        W, mu, s = self.W0.double(), self.mu0.double(), self.s0.double()
        cov = W @ W.T + torch.diag((s * torch.ones(self.D, dtype=torch.float64)) ** 2)
        flat = x.reshape(*x.shape[: x.dim() - len(self.event)], self.D).double()
        return torch.distributions.MultivariateNormal(mu, cov).log_prob(flat).to(self.dtype)


@st.composite
def flat_models(draw, max_D=7, max_N=5):
    D = draw(st.integers(1, max_D))
    K = draw(st.integers(1, 4))
    N = draw(st.integers(1, max_N))
    dtype = draw(DTYPES)
    per_token = draw(st.booleans())
    return LinearGaussian((N,), (D,), K, dtype, draw(SEEDS), per_token)


@st.composite
def any_models(draw):
    """Flat, nested-plate (A, B) and image-shaped (.to_event(2)) observations."""
    kind = draw(st.sampled_from(["flat", "nested", "image"]))
    K = draw(st.integers(1, 4))
    dtype = draw(DTYPES)
    per_token = draw(st.booleans())
    if kind == "flat":
        batch, event = (draw(st.integers(1, 5)),), (draw(st.integers(1, 7)),)
    elif kind == "nested":
        batch = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
        event = (draw(st.integers(1, 6)),)
    else:
        batch = (draw(st.integers(1, 4)),)
        event = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    return LinearGaussian(batch, event, K, dtype, draw(SEEDS), per_token)


def score(m, masks="exhaustive", method="lowrank", seed=0, x=None, **kw):
    engine_kw = {k: kw.pop(k) for k in ["max_elements"] if k in kw}
    pyro.set_rng_seed(seed)
    loss = MaskedPretrainingLoss(masks=masks, conditionals=GaussianConditionals(method=method, **engine_kw), **kw)
    with torch.no_grad():
        return loss.score(m, None, m.x if x is None else x)


# --------------------------------------------------------------------------- properties
@settings(max_examples=80, **SETTINGS)
@given(m=any_models(), method=METHODS)
def test_exhaustive_equals_exact(m, method):
    m.params()
    est = score(m, "exhaustive", method)
    assert est.shape == m.batch
    assert_close(est, m.exact(m.x), m.dtype)


@settings(max_examples=40, **SETTINGS)
@given(m=any_models())
def test_evidence_exact_matches_closed_form(m):
    m.params()
    with torch.no_grad():
        ev = Evidence(m)(m.x)
    assert ev.shape == m.batch
    assert_close(ev, m.exact(m.x), m.dtype)


@settings(max_examples=50, **SETTINGS)
@given(
    m=any_models(),
    method=METHODS,
    share=st.booleans(),
    num_masks=st.integers(1, 5),
    seeds=st.lists(SEEDS, min_size=2, max_size=3, unique=True),
)
def test_order_zero_variance_and_exact(m, method, share, num_masks, seeds):
    m.params()
    draws = torch.stack(
        [score(m, "order", method, seed=s, num_masks=num_masks, share_masks=share) for s in seeds]
    )
    exact = m.exact(m.x)
    for d in draws:
        assert_close(d, exact, m.dtype)
    rtol, atol = _tol(m.dtype)
    assert (draws - draws[0]).abs().max() <= atol + rtol * exact.abs().max()


@settings(max_examples=40, **SETTINGS)
@given(m=flat_models(), method=METHODS, masks=st.sampled_from(["order", "exhaustive"]), seed=SEEDS)
def test_curve_area_is_mean_exact(m, method, masks, seed):
    m.params()
    pyro.set_rng_seed(seed)
    loss = MaskedPretrainingLoss(masks=masks, conditionals=GaussianConditionals(method=method))
    area = torch.as_tensor(float(loss.curve(m, None, m.x).area()), dtype=torch.float64)
    exact = m.exact(m.x).double().mean()
    rtol, atol = _tol(m.dtype)
    assert abs(area - exact) <= atol + rtol * abs(exact), (area, exact)


@settings(max_examples=50, **SETTINGS)
@given(
    m=flat_models(max_N=6),
    method=METHODS,
    masks=st.sampled_from(["exhaustive", "order", "uniform", "stratified", "all"]),
    chunk_size=st.integers(1, 200),
    max_elements=st.integers(1, 200),
    seed=SEEDS,
)
def test_chunk_size_invariance(m, method, masks, chunk_size, max_elements, seed):
    """Same seed, any chunking of masks (loss) and of queries (engine): the same estimate."""
    m.params()
    kw = {} if masks == "exhaustive" else {"num_masks": 2}
    ref = score(m, masks, method, seed=seed, **kw)
    chunked = score(m, masks, method, seed=seed, chunk_size=chunk_size, max_elements=max_elements, **kw)
    assert_close(chunked, ref, m.dtype)


@settings(max_examples=50, **SETTINGS)
@given(
    m=any_models(),
    method=METHODS,
    masks=st.sampled_from(["exhaustive", "order", "uniform-shared", "all-shared"]),
    data=st.data(),
    seed=SEEDS,
)
def test_datapoint_order_invariance(m, method, masks, data, seed):
    m.params()
    n = math.prod(m.batch)
    perm = torch.tensor(data.draw(st.permutations(list(range(n)))))
    kw = {}
    if masks.endswith("-shared"):
        masks, kw = masks[: -len("-shared")], {"share_masks": True, "num_masks": 2}
    ref = score(m, masks, method, seed=seed, **kw)
    flat_x = m.x.reshape(n, *m.event)
    xp = flat_x[perm].reshape(m.x.shape)
    est = score(m, masks, method, seed=seed, x=xp, **kw)
    assert_close(est.reshape(n), ref.reshape(n)[perm], m.dtype)


@settings(max_examples=50, **SETTINGS)
@given(m=any_models(), method=METHODS, masks=st.sampled_from(["exhaustive", "order"]), data=st.data())
def test_token_permutation_invariance(m, method, masks, data):
    """Permuting x's tokens with W's rows, mu and the per-token noise leaves the score unchanged."""
    m.params()
    ref = score(m, masks, method, seed=1)
    perm = torch.tensor(data.draw(st.permutations(list(range(m.D)))))
    lead = m.x.shape[: m.x.dim() - len(m.event)]
    xp = m.x.reshape(*lead, m.D)[..., perm].reshape(m.x.shape)
    s0 = m.s0[perm] if m.s0.dim() else m.s0
    m.params(W0=m.W0[perm], mu0=m.mu0[perm], s0=s0)
    est = score(m, masks, method, seed=2, x=xp)
    assert_close(est, ref, m.dtype)


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_order_float64_non_power_of_two_num_masks(method):
    """Schedule weights like 1/3 keep float64 precision under a float32 default dtype."""
    assert torch.get_default_dtype() == torch.float32
    m = LinearGaussian((3,), (5,), 3, torch.float64, 43, False).params()
    est = score(m, "order", method, seed=0, num_masks=3)
    assert_close(est, m.exact(m.x), torch.float64)
