"""Groups of tokens joined only by a few global latents (Pyro's radon model at scale):
the Gaussian engine's arrowhead route (gaussian_global_groups) against the dense loading
and scipy's multivariate normal."""

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from scipy.stats import multivariate_normal

from models import numpy_leave_one_out

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals
import pyro_mpt.conditionals.gaussian as gaussian_module
from pyro_mpt.conditionals.gaussian_global_groups import GlobalGroupsState
from pyro_mpt.mask_blocks import MaskBlock
from pyro_mpt.conditionals.gaussian_marginal import gaussian_marginal
from pyro_mpt.observed_tokens import trace_tokens

pytestmark = pytest.mark.usefixtures("float64")

N, G = 240, 24
B, SA, SY, MU0, SMU = 0.3, 1.2, 0.8, 0.5, 2.0


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    grp = torch.randint(0, G, (N,), generator=g)
    u = torch.randn(N, generator=g, dtype=torch.float64)
    y = torch.randn(G, generator=g, dtype=torch.float64)[grp] + 0.5 * u + 0.7 * torch.randn(N, generator=g, dtype=torch.float64)
    return grp, u, y


def radon(grp, u, y, coupling=None):
    """County intercepts around a global mean, a global random slope on the covariate, as
    Pyro's radon model writes them; ``coupling`` (a parameter at 0) loads each observation
    on the next county's intercept too: zero in value, not in its derivative."""
    b = pyro.param("b", torch.tensor(B))
    sa = pyro.param("sa", torch.tensor(SA), constraint=dist.constraints.positive)
    sy = pyro.param("sy", torch.tensor(SY), constraint=dist.constraints.positive)
    mu_a = pyro.sample("mu_a", dist.Normal(MU0, SMU))
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", G):
        a = pyro.sample("a", dist.Normal(mu_a, sa))
    loc = a[..., grp] + (b + slope) * u
    if coupling is not None:
        loc = loc + pyro.param("c", torch.tensor(0.0)) * a[..., (grp + 1) % G]
    with pyro.plate("data", N):
        pyro.sample("y", dist.Normal(loc, sy), obs=y)


def _state(model, args, engine):
    tokens = trace_tokens(model, None, args, {}, token_plates=("data",))
    return engine.prepare(tokens, model, None, args, {})


def _loss_and_grads(engine, masks, args, model=radon, names=("b", "sa", "sy"), seed=0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    loss = MaskedPretrainingLoss(masks=masks, conditionals=engine, token_plates=("data",))
    value = loss.differentiable_loss(model, None, *args)
    return value.item(), torch.autograd.grad(value, [pyro.param(k).unconstrained() for k in names])


@pytest.fixture(params=[False, True], ids=["whole table", "in chunks"])
def chunked(request, monkeypatch):
    """The groups found from the whole loading, or from its nonzeros a chunk of latents at a
    time (what loadings of CHUNKED_MIN_TABLE entries or more take; here every loading)."""
    if request.param:
        monkeypatch.setattr(gaussian_module, "CHUNKED_MIN_TABLE", 0)
        calls = []
        original = gaussian_module.loading_nonzeros_in_chunks
        monkeypatch.setattr(gaussian_module, "loading_nonzeros_in_chunks",
                            lambda *a: calls.append(1) or original(*a))
        monkeypatch.setattr(gaussian_module, "gaussian_marginal", _no_whole_table)
        return calls
    return None


def _no_whole_table(*args, **kwargs):
    raise AssertionError("the whole loading was derived, where its chunks' nonzeros serve")


@pytest.mark.parametrize("masks", ["uniform", "pll", "order", "all"])
def test_global_groups_equal_the_dense_loading(masks, chunked, monkeypatch):
    """Loss and gradient of every schedule kind (random masks, one target each, an
    ordering, every size) by the arrowhead over 24 counties joined by two global latents
    equal the dense loading's (groups=False) to 1e-10, on the same masks; the state is the
    arrowhead's, from the first call, whether the groups come from the whole loading or
    from its nonzeros in chunks of latents (then no whole table is made)."""
    args = _data()
    pyro.clear_param_store()
    assert isinstance(_state(radon, args, GaussianConditionals()), GlobalGroupsState)
    value, grads = _loss_and_grads(GaussianConditionals(), masks, args)
    assert chunked is None or len(chunked) == 2
    monkeypatch.undo()  # the reference derives the whole loading
    want, grads_want = _loss_and_grads(GaussianConditionals(groups=False), masks, args)
    assert abs(value - want) < 1e-10 * abs(want)
    for g, gw in zip(grads, grads_want):
        assert torch.allclose(g, gw, rtol=1e-9, atol=1e-10)


def test_global_groups_evidence_and_curve_match_scipy_and_the_dense_loading():
    """Evidence equals scipy's multivariate normal of the model's covariance written out
    (global mean and slope, county intercepts, noise) to 1e-9, at the first call and at a
    later one (the loading then from one model run a colour); the "order" curve (chain
    terms by position) equals the dense loading's to 1e-10."""
    grp, u, y = args = _data(1)
    pyro.clear_param_store()
    evidence = Evidence(radon, token_plates=("data",))
    one_hot = np.zeros((N, G))
    one_hot[np.arange(N), grp.numpy()] = 1
    un = u.numpy()
    cov = SMU**2 + SA**2 * one_hot @ one_hot.T + np.outer(un, un) + SY**2 * np.eye(N)
    want = multivariate_normal(MU0 + B * un, cov).logpdf(y.numpy())
    for _ in range(2):
        assert abs(float(evidence(*args).detach()) - want) < 1e-9 * abs(want)
    curves = []
    for engine in (GaussianConditionals(), GaussianConditionals(groups=False)):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        loss = MaskedPretrainingLoss(masks="order", conditionals=engine, token_plates=("data",))
        curves.append(np.array(loss.curve(radon, None, *args).score))
    assert np.allclose(curves[0], curves[1], rtol=1e-10, atol=1e-12)


def test_a_loading_zero_only_in_value_keeps_the_dense_loading():
    """A coupling parameter at 0 loads every observation on the next county's intercept:
    the groups would drop entries whose derivative is not zero, so the engine keeps the
    dense loading, and the coupling's gradient equals the dense loading's (1e-10)."""
    args = _data(2)

    def coupled(grp, u, y):
        radon(grp, u, y, coupling=True)

    pyro.clear_param_store()
    assert not isinstance(_state(coupled, args, GaussianConditionals()), GlobalGroupsState)
    names = ("b", "sa", "sy", "c")
    value, grads = _loss_and_grads(GaussianConditionals(), "uniform", args, coupled, names)
    want, grads_want = _loss_and_grads(GaussianConditionals(groups=False), "uniform", args, coupled, names)
    assert abs(value - want) < 1e-10 * abs(want) and float(grads_want[-1].abs()) > 1e-3
    for g, gw in zip(grads, grads_want):
        assert torch.allclose(g, gw, rtol=1e-9, atol=1e-10)


def test_missing_observations_keep_the_arrowhead():
    """A fifth of the observations missing (``.mask(m)``): the route is kept (before, one
    missing observation of 10000 sent every step to the dense loading, 130x slower); each
    schedule's loss and gradient equal the dense loading's (1e-10), and Evidence is scipy's
    density of the observed sub-vector."""
    grp, u, y = args = _data(3)
    m = torch.rand(N, generator=torch.Generator().manual_seed(5)) > 0.2

    def masked(grp, u, y):
        b = pyro.param("b", torch.tensor(B))
        sa = pyro.param("sa", torch.tensor(SA), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(SY), constraint=dist.constraints.positive)
        mu_a = pyro.sample("mu_a", dist.Normal(MU0, SMU))
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(mu_a, sa))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + b * u, sy).mask(m), obs=y)

    pyro.clear_param_store()
    assert isinstance(_state(masked, args, GaussianConditionals()), GlobalGroupsState)
    for masks in ("uniform", "pll", "order"):
        value, grads = _loss_and_grads(GaussianConditionals(), masks, args, masked)
        want, grads_want = _loss_and_grads(GaussianConditionals(groups=False), masks, args, masked)
        assert abs(value - want) < 1e-10 * abs(want)
        for g, gw in zip(grads, grads_want):
            assert torch.allclose(g, gw, rtol=1e-9, atol=1e-10)
    pyro.clear_param_store()
    got = float(Evidence(masked, token_plates=("data",))(*args).detach())
    keep = m.numpy()
    one_hot = np.zeros((N, G))
    one_hot[np.arange(N), grp.numpy()] = 1
    cov = SMU**2 + SA**2 * one_hot @ one_hot.T + SY**2 * np.eye(N)
    want = multivariate_normal((MU0 + B * u.numpy())[keep], cov[np.ix_(keep, keep)]).logpdf(y.numpy()[keep])
    assert abs(got - want) < 1e-9 * abs(want)
    # "pll": each observed token given the other observed ones, from one pass (the arrowhead's
    # posterior given the observed tokens; before, every query took the masks: 20000
    # observations in 1000 groups, minutes a step), against numpy's inverse of the observed
    # sub-covariance
    pyro.clear_param_store()
    made = []
    original = MaskBlock.masks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MaskBlock, "masks", lambda self: made.append(1) or original(self))
        pll = MaskedPretrainingLoss(masks="pll", token_plates=("data",)).score(masked, None, *args).detach()
    assert made == []
    sub = cov[np.ix_(keep, keep)]
    want = numpy_leave_one_out(sub, (y.numpy() - MU0 - B * u.numpy())[keep]).sum()
    assert abs(float(pll) - want) < 1e-9 * abs(want)


def test_independent_groups_from_the_chunks_nonzeros(chunked, monkeypatch):
    """Random intercepts without a global latent (independent groups): from the whole
    loading or from its chunks' nonzeros, the loss and gradient equal the dense loading's
    (1e-10); a location that is not affine in the intercepts (relu) is refused as before,
    the chunks' pattern notwithstanding (the colours' probes catch it)."""
    grp, u, y = args = _data(4)

    def intercepts(grp, u, y, kink=False):
        b = pyro.param("b", torch.tensor(B))
        sa = pyro.param("sa", torch.tensor(SA), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(SY), constraint=dist.constraints.positive)
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(0.0, sa))
        loc = a[..., grp] + b * u
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(torch.relu(loc + 1.0) if kink else loc, sy), obs=y)

    value, grads = _loss_and_grads(GaussianConditionals(), "uniform", args, intercepts)
    assert chunked is None or len(chunked) == 1
    if chunked is not None:
        with pytest.raises(AssertionError, match="whole loading was derived"):
            # the relu's colours fail their probes: the whole marginal is asked for (and
            # would refuse the model, as it does below without the stand-in)
            _loss_and_grads(GaussianConditionals(), "uniform", args, lambda *a: intercepts(*a, kink=True))
    monkeypatch.undo()
    want, grads_want = _loss_and_grads(GaussianConditionals(groups=False), "uniform", args, intercepts)
    assert abs(value - want) < 1e-10 * abs(want)
    for g, gw in zip(grads, grads_want):
        assert torch.allclose(g, gw, rtol=1e-9, atol=1e-10)
    from pyro_mpt.conditionals.gaussian_marginal import NotLinearGaussianError
    with pytest.raises(NotLinearGaussianError, match="not affine"):
        _loss_and_grads(GaussianConditionals(), "uniform", args, lambda *a: intercepts(*a, kink=True))


@pytest.mark.parametrize("broadcasts", [True, False], ids=["broadcasts", "X @ w"])
def test_a_loading_without_groups_is_searched_once(chunked, monkeypatch, broadcasts):
    """A Bayesian regression scored as one datapoint (5 weights on every observation: no
    groups; written so that it broadcasts over the noise points, or as ``X @ w``, whose
    vectorized run fails): the chunks' search finds nothing at the first call and is not
    made again at the next (it would add the loading's model runs to every step); the loss
    is scipy's density."""
    g = torch.Generator().manual_seed(6)
    X = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = X @ torch.randn(5, generator=g, dtype=torch.float64) + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)

    def regression(X, y):
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(torch.zeros(5, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal((w.unsqueeze(-2) * X).sum(-1) if broadcasts else X @ w, s), obs=y)

    if chunked is not None:
        monkeypatch.setattr(gaussian_module, "gaussian_marginal", gaussian_marginal)
    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="order", conditionals=GaussianConditionals(), token_plates=("data",))
    values = [loss.loss(regression, None, X, y) for _ in range(2)]
    assert chunked is None or len(chunked) == 1
    assert abs(values[1] - values[0]) < 1e-12 * abs(values[0])
    S = 0.25 * np.eye(N) + (X @ X.T).numpy()
    want = -multivariate_normal(np.zeros(N), S).logpdf(y.numpy())
    assert abs(values[0] - want) < 1e-9 * abs(want)


def test_varying_slopes_around_a_mean_slope_on_some_observations():
    """Varying intercepts and slopes per county around a global mean of each, the slope on a
    covariate that is 1 for a third of the observations (the mean slope loads on those alone,
    fewer than half the tokens): the widest columns are taken as the global latents until the
    counties split (before, this model kept the dense loading: 3000 observations in 300
    counties, 0.9 s a step against 0.08 s); loss and gradient equal the dense loading's (1e-10)."""
    grp, u, y = _data(7)
    floor = (torch.rand(N, generator=torch.Generator().manual_seed(8)) < 1 / 3).to(torch.float64)
    args = (grp, floor, y)

    def slopes(grp, floor, y):
        sa = pyro.param("sa", torch.tensor(SA), constraint=dist.constraints.positive)
        sb = pyro.param("sb", torch.tensor(0.4), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(SY), constraint=dist.constraints.positive)
        mu_a = pyro.sample("mu_a", dist.Normal(MU0, SMU))
        mu_b = pyro.sample("mu_b", dist.Normal(0.0, 1.0))
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(mu_a, sa))
            b = pyro.sample("b", dist.Normal(mu_b, sb))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + b[..., grp] * floor, sy), obs=y)

    pyro.clear_param_store()
    assert isinstance(_state(slopes, args, GaussianConditionals()), GlobalGroupsState)
    names = ("sa", "sb", "sy")
    value, grads = _loss_and_grads(GaussianConditionals(), "uniform", args, slopes, names)
    want, grads_want = _loss_and_grads(GaussianConditionals(groups=False), "uniform", args, slopes, names)
    assert abs(value - want) < 1e-10 * abs(want)
    for g, gw in zip(grads, grads_want):
        assert torch.allclose(g, gw, rtol=1e-9, atol=1e-10)


def test_data_in_one_group_leaves_no_local_group(float64):
    """A random intercept whose data all fall in one of its groups: that group's column loads
    every token, so it is set apart as global and no local group is left (an IndexError in
    group_layout). Evidence and the "order" score equal scipy's dense marginal, also for one
    loss whose groups change between calls (one group, then two)."""
    G, N = 10, 40
    g = torch.Generator().manual_seed(7)
    u, y = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def model(y, grp):
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(0.0, 0.8))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + 0.3 * u, 0.5), obs=y)

    def exact(grp):
        Z = np.eye(G)[grp.numpy()]
        return multivariate_normal(0.3 * u.numpy(), 0.64 * Z @ Z.T + 0.25 * np.eye(N)).logpdf(y.numpy())

    loss = MaskedPretrainingLoss(masks="order", token_plates=("data",))
    for grp in (torch.zeros(N, dtype=torch.long), torch.arange(N) % 2, torch.zeros(N, dtype=torch.long)):
        ref = exact(grp)
        assert abs(float(Evidence(model, token_plates=("data",))(y, grp)) - ref) < 1e-9
        assert abs(float(loss.score(model, None, y, grp)) - ref) < 1e-9
