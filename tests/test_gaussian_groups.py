"""Sparse loadings served as independent groups (``conditionals/gaussian_groups.py``):
random intercepts, nested and crossed groups scored as one datapoint, against numpy and
scipy closed forms and against torch's dense ``MultivariateNormal``."""

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from scipy.stats import multivariate_normal

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals
from pyro_mpt.conditionals.gaussian_groups import GroupedGaussianState, loading_components
from pyro_mpt.observed_tokens import trace_tokens

F64 = torch.float64


def numpy_conditional(x, mean, cov, target, context):
    """log N(x_target | x_context) by the Schur complement of the full covariance, in numpy."""
    c = np.asarray(context, dtype=bool)
    if not c.any():
        return multivariate_normal.logpdf(x[target], mean[target], cov[target, target])
    k = cov[target, c]
    w = np.linalg.solve(cov[np.ix_(c, c)], k)
    m = mean[target] + w @ (x[c] - mean[c])
    v = cov[target, target] - k @ w
    return -0.5 * (np.log(2 * np.pi * v) + (x[target] - m) ** 2 / v)


def _random_effects(kind, N=90, seed=0):
    """A regression with random effects, the N observations one datapoint
    (``token_plates=("data",)``), float64. ``kind``: ``"intercepts"`` (G = 14 groups,
    group 13 without observations, sizes ragged), ``"nested"`` (3 regions > 12 counties,
    each observation loads on its county and its county's region), ``"crossed"`` (two
    crossed factors of 5 and 4 levels: one component). Returns ``(model, args, moments)``,
    ``moments()`` the mean and covariance in torch, written from the params (with their
    graph: torch's dense ``MultivariateNormal`` gives the reference gradient)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(N, generator=g, dtype=F64)
    G = {"intercepts": 14, "nested": 12, "crossed": 5}[kind]
    grp = torch.randint(0, G - 1 if kind == "intercepts" else G, (N,), generator=g)
    region = torch.arange(G) % 3  # county -> region
    other = torch.randint(0, 4, (N,), generator=g)
    y = torch.randn(N, generator=g, dtype=F64)

    def model(y):
        b = pyro.param("b", torch.tensor(0.3, dtype=F64))
        sa = pyro.param("sa", torch.tensor(0.8, dtype=F64), constraint=dist.constraints.positive)
        sr = pyro.param("sr", torch.tensor(1.3, dtype=F64), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(0.6, dtype=F64), constraint=dist.constraints.positive)
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), sa))
        loc = a[..., grp] + b * u
        if kind == "nested":
            with pyro.plate("regions", 3):
                r = pyro.sample("r", dist.Normal(torch.tensor(0.0, dtype=F64), sr))
            loc = loc + r[..., region[grp]]
        elif kind == "crossed":
            with pyro.plate("levels", 4):
                c = pyro.sample("c", dist.Normal(torch.tensor(0.0, dtype=F64), sr))
            loc = loc + c[..., other]
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(loc, sy), obs=y)

    def moments():
        b, sa, sr, sy = (pyro.param(k) for k in ("b", "sa", "sr", "sy"))
        A = torch.nn.functional.one_hot(grp, G).to(F64)
        cov = sa**2 * A @ A.T + sy**2 * torch.eye(N, dtype=F64)
        if kind == "nested":
            Rg = torch.nn.functional.one_hot(region[grp], 3).to(F64)
            cov = cov + sr**2 * Rg @ Rg.T
        elif kind == "crossed":
            C = torch.nn.functional.one_hot(other, 4).to(F64)
            cov = cov + sr**2 * C @ C.T
        return b * u, cov

    return model, (y,), moments


def _components_by_brute_force(cov):
    """Connected components of the nonzero pattern of a covariance, by a Python closure."""
    D = cov.shape[0]
    label = list(range(D))
    changed = True
    while changed:
        changed = False
        for i in range(D):
            for j in range(D):
                if cov[i, j] != 0 and label[j] != label[i]:
                    label[i] = label[j] = min(label[i], label[j])
                    changed = True
    return len(set(label))


@pytest.mark.parametrize("kind", ["intercepts", "nested"])
def test_grouped_evidence_and_gradient_against_per_group_closed_forms(kind):
    """Random intercepts (14 groups, one with no observation) and nested groups (regions >
    counties): the state is split into the covariance's connected components (counted by
    brute force), and Evidence equals the sum over groups of scipy's log-density of each
    group's block (1e-8); its gradient into b, sa, sr, sy equals that of torch's dense
    MultivariateNormal on the whole covariance (1e-8)."""
    pyro.clear_param_store()
    model, args, moments = _random_effects(kind)
    tokens = trace_tokens(model, None, args, {}, token_plates=("data",))
    state = GaussianConditionals().prepare(tokens, model, None, args, {})
    assert isinstance(state, GroupedGaussianState)
    mean, cov = (t.detach().numpy() for t in moments())
    assert state.num_blocks == _components_by_brute_force(cov)

    y = args[0].numpy()
    want = 0.0
    _, comp = np.unique(np.abs(cov) > 0, axis=0, return_inverse=True)
    for c in np.unique(comp):
        idx = np.flatnonzero(comp == c)
        want += multivariate_normal.logpdf(y[idx], mean[idx], cov[np.ix_(idx, idx)])
    evidence = Evidence(model, token_plates=("data",))
    got = evidence(*args).sum()
    assert abs(float(got) - want) < 1e-8
    assert abs(want - multivariate_normal.logpdf(y, mean, cov)) < 1e-8  # the groups are independent

    leaves = [pyro.param(k).unconstrained() for k in ("b", "sa", "sr", "sy")]
    grads = torch.autograd.grad(got, leaves, allow_unused=True)
    loc, full = moments()
    ref = torch.distributions.MultivariateNormal(loc, full).log_prob(args[0])
    want_grads = torch.autograd.grad(ref, leaves, allow_unused=True)
    for got_grad, want_grad in zip(grads, want_grads):
        if want_grad is None:  # sr outside the intercepts' model
            assert got_grad is None
        else:
            assert abs(float(got_grad) - float(want_grad)) < 1e-8


@pytest.mark.parametrize("kind", ["intercepts", "nested", "crossed"])
def test_masked_conditionals_chains_and_pll_against_numpy(kind):
    """Per-token log-conditionals of 4 random masks, their sums, every leave-one-out
    conditional (``masks="pll"``) and the chain terms of 2 random orderings equal numpy's
    Schur complements of the whole covariance (1e-8); crossed factors (one component)
    keep the ungrouped path and the same numbers."""
    pyro.clear_param_store()
    model, args, moments = _random_effects(kind, N=60, seed=1)
    tokens = trace_tokens(model, None, args, {}, token_plates=("data",))
    engine = GaussianConditionals()
    state = engine.prepare(tokens, model, None, args, {})
    assert isinstance(state, GroupedGaussianState) == (kind != "crossed")
    mean, cov = (t.detach().numpy() for t in moments())
    x, D = tokens.value, 60
    flat = x[0].numpy()

    g = torch.Generator().manual_seed(5)
    masks = torch.rand(4, 1, D, generator=g) < 0.4
    logc = engine.mask_log_prob(state, x, masks).detach().numpy()
    sums = engine.mask_sums(state, x, masks).detach().numpy()
    for q in range(4):
        m = masks[q, 0].numpy()
        refs = [numpy_conditional(flat, mean, cov, j, ~m) for j in np.flatnonzero(m)]
        assert np.abs(logc[q, 0, m] - refs).max() < 1e-8
        assert abs(sums[q, 0] - sum(refs)) < 1e-8

    loo = [numpy_conditional(flat, mean, cov, j, np.arange(D) != j) for j in range(D)]
    pll = MaskedPretrainingLoss(masks="pll", token_plates=("data",)).score(model, None, *args)
    assert abs(float(pll) - sum(loo)) < 1e-8

    order = torch.stack([torch.randperm(D, generator=g) for _ in range(2)])[:, None]
    chain = engine.chain_log_prob(state, x, order).detach().numpy()
    for p in range(2):
        o = order[p, 0].numpy()
        later = np.zeros(D, dtype=bool)  # term t conditions on the tokens after position t
        for t in range(D - 1, -1, -1):
            assert abs(chain[p, 0, t] - numpy_conditional(flat, mean, cov, o[t], later.copy())) < 1e-8
            later[o[t]] = True
        assert abs(chain[p, 0].sum() - multivariate_normal.logpdf(flat, mean, cov)) < 1e-8


def test_a_zero_that_carries_a_gradient_keeps_the_dense_loading():
    """Per-observation loading weights ``w`` that start at zero for a third of the
    observations: their loading entries are zero in value, so the pattern splits them off
    their groups, but d(log p)/dw there is not zero. The engine keeps the dense loading,
    and the gradient into w equals torch's dense MultivariateNormal's (1e-8), also after a
    call without gradients (whose groups are not reused under autograd); a grouped state
    would give those observations zero gradient."""
    pyro.clear_param_store()
    N, G = 45, 6
    g = torch.Generator().manual_seed(7)
    grp = torch.randint(0, G, (N,), generator=g)
    y = torch.randn(N, generator=g, dtype=F64)
    w0 = torch.where(torch.arange(N) % 3 == 0, 0.0, 1.0).to(F64)

    def model(y):
        w = pyro.param("w", w0.clone())
        sy = pyro.param("sy", torch.tensor(0.5, dtype=F64), constraint=dist.constraints.positive)
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(w * a[..., grp], sy), obs=y)

    tokens = trace_tokens(model, None, (y,), {}, token_plates=("data",))
    state = GaussianConditionals().prepare(tokens, model, None, (y,), {})
    assert not isinstance(state, GroupedGaussianState)
    evidence = Evidence(model, token_plates=("data",))
    with torch.no_grad():
        evidence(y)  # without gradients the zeros are dropped; the groups found serve no gradient
    got = evidence(y).sum()
    w, sy = pyro.param("w"), pyro.param("sy")
    (gw,) = torch.autograd.grad(got, [w])
    A = torch.nn.functional.one_hot(grp, G).to(F64) * w[:, None]
    ref = torch.distributions.MultivariateNormal(torch.zeros(N, dtype=F64), A @ A.T + sy**2 * torch.eye(N, dtype=F64))
    (rw,) = torch.autograd.grad(ref.log_prob(y), [w])
    assert float(rw[::3].abs().max()) > 1e-3  # the zero entries do carry a gradient
    assert float((gw - rw).abs().max()) < 1e-8


def test_loading_components_labels_tokens_and_latents():
    """Tokens 0, 2 share latent 0; token 1 loads on latents 1 and 3 (one component);
    token 3 on nothing (alone); latent 2 on no token (-1)."""
    F = torch.zeros(1, 4, 4)
    F[0, 0, 0] = F[0, 2, 0] = 1.0
    F[0, 1, 1] = F[0, 1, 3] = 2.0
    tokens, latents = loading_components(F)
    assert tokens.tolist() == [0, 1, 0, 2]
    assert latents.tolist() == [0, 1, -1, 1]


def test_later_calls_run_the_model_once_a_colour_and_notice_new_groups(monkeypatch):
    """The engine keeps the groups it found: the next call derives the loading from the
    model run at r + 4 points (random intercepts: 5, not G + 4 = 18) and gives scipy's
    per-group density and torch's dense gradient (1e-8). Called on other data of the same
    size (observations moved to other groups), the colouring's loading is off the model's
    at the probes: the engine derives it whole again (and checks the new groups' dropped
    zeros), and the numbers follow the new groups (1e-8)."""
    import pyro_mpt.conditionals.gaussian_groups as groups_module

    colored = []  # what each run at the colours' points did
    real = groups_module.gaussian_marginal

    def spy(*args, **kwargs):
        try:
            out = real(*args, **kwargs)
        except Exception:
            colored.append("refused")
            raise
        colored.append("served")
        return out

    monkeypatch.setattr(groups_module, "gaussian_marginal", spy)
    pyro.clear_param_store()
    N, G = 70, 14
    g = torch.Generator().manual_seed(9)
    u = torch.randn(N, generator=g, dtype=F64)
    y = torch.randn(N, generator=g, dtype=F64)
    groupings = [torch.randint(0, G, (N,), generator=g) for _ in range(2)]

    def model(grp, y):
        b = pyro.param("b", torch.tensor(0.3, dtype=F64))
        sa = pyro.param("sa", torch.tensor(0.8, dtype=F64), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(0.6, dtype=F64), constraint=dist.constraints.positive)
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), sa))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + b * u, sy), obs=y)

    evidence = Evidence(model, token_plates=("data",))
    # the first call finds the groups from the loading derived whole, checks its dropped
    # zeros at the colours' points, plain and weighted, and takes the groups' loading from them
    evidence(groupings[0], y)
    assert colored == ["served"] * 3
    leaves = [pyro.param(k).unconstrained() for k in ("b", "sa", "sy")]
    new_groups = ["refused"] + ["served"] * 3  # derived whole again, the new groups checked
    for grp, runs in ((groupings[0], ["served"]), (groupings[1], new_groups), (groupings[1], ["served"])):
        colored.clear()
        got = evidence(grp, y).sum()
        assert colored == runs
        b, sa, sy = (pyro.param(k) for k in ("b", "sa", "sy"))
        A = torch.nn.functional.one_hot(grp, G).to(F64)
        ref = torch.distributions.MultivariateNormal(b * u, sa**2 * A @ A.T + sy**2 * torch.eye(N, dtype=F64))
        want = sum(
            multivariate_normal.logpdf(y[grp == k].numpy(), (b * u)[grp == k].detach().numpy(),
                                       ref.covariance_matrix[grp == k][:, grp == k].detach().numpy())
            for k in range(G) if bool((grp == k).any())
        )
        assert abs(float(got) - want) < 1e-8
        for got_grad, want_grad in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(ref.log_prob(y), leaves)):
            assert abs(float(got_grad) - float(want_grad)) < 1e-8


def test_float32_random_intercepts_are_grouped_and_match_float64_scipy():
    """float32 data and params (torch's default): the dropped zeros' check passes on
    rounding alone (the loading is a difference of float32 model runs), the groups serve
    this call and the next one (from the colours' points), and Evidence is within float32
    rounding of scipy's float64 density (1e-5 relative)."""
    pyro.clear_param_store()
    N, G = 120, 25
    g = torch.Generator().manual_seed(13)
    grp, u = torch.randint(0, G, (N,), generator=g), torch.randn(N, generator=g)
    y = torch.randn(N, generator=g)

    def model(y):
        b = pyro.param("b", torch.tensor(0.3))
        sa = pyro.param("sa", torch.tensor(0.8), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(0.6), constraint=dist.constraints.positive)
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(0.0, sa))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + b * u, sy), obs=y)

    engine = GaussianConditionals()
    tokens = trace_tokens(model, None, (y,), {}, token_plates=("data",))
    b, sa, sy = (float(pyro.param(k)) for k in ("b", "sa", "sy"))
    A = np.eye(G)[grp.numpy()]
    want = multivariate_normal.logpdf(y.double().numpy(), b * u.double().numpy(), sa**2 * A @ A.T + sy**2 * np.eye(N))
    for _ in range(2):
        state = engine.prepare(tokens, model, None, (y,), {})
        assert isinstance(state, GroupedGaussianState)
        got = float(engine.log_evidence(state, tokens.value).sum())
        assert abs(got - want) < 1e-5 * abs(want)
    assert engine.memory.colors  # the second call ran at the colours' points
