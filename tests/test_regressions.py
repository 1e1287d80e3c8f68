"""Regressions found in a review of the library: each test failed before its fix.

The small models here are defined in this module on purpose (the shared test
helpers are being reorganized elsewhere); they may move to tests/models.py later.
"""

import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, MaskedPretrainingLoss


N, D, K, SIGMA = 6, 4, 2, 0.5


def _token_plate_ppca(seed=0):
    """PPCA with its tokens in a plate (no event dims) and its exact log-density."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x, obs_mask=None):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + b, SIGMA), obs=x, obs_mask=obs_mask)

    def exact(x, observed=None):
        """log N(x_i; b, W W^T + s^2 I), or of each observed sub-vector x_{O_i}."""
        S = W @ W.T + SIGMA**2 * torch.eye(D, dtype=torch.float64)
        if observed is None:
            return torch.distributions.MultivariateNormal(b, S).log_prob(x)
        return torch.stack([
            torch.distributions.MultivariateNormal(b[o], S[o][:, o]).log_prob(xi[o]) for xi, o in zip(x, observed)
        ])

    return model, x, exact


# ---------------------------------------------------------------------- token plates
def test_token_plate_is_detected_with_a_single_datapoint():
    """A data plate of size 1 still holds the latent, so the token plate is found."""
    model, x, exact = _token_plate_ppca()
    full = Evidence(model)(x)
    one = Evidence(model)(x[:1])
    assert one.shape == (1,)
    assert abs(float(one[0] - full[0])) < 1e-10
    assert abs(float(one[0] - exact(x[:1])[0])) < 1e-10
    score = MaskedPretrainingLoss(conditionals="gaussian", masks="order").score(model, None, x[:1])
    assert abs(float(score[0] - full[0])) < 1e-10


def test_token_plate_detection_ignores_size_one_plates_of_the_latents():
    """Latents in the data plate, one of them also in a plate of size 1: their layouts
    agree on every plate that has more than one element, so "tokens" is detected."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x):
        data = pyro.plate("data", x.shape[0], dim=-2)
        with data:
            c = pyro.sample("c", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("groups", 1, dim=-3), data:
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + c, SIGMA), obs=x)

    S = W @ W.T + torch.ones(D, D, dtype=torch.float64) + SIGMA**2 * torch.eye(D, dtype=torch.float64)
    truth = torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), S).log_prob(x)
    for n in (N, 1):
        value = Evidence(model)(x[:n])
        assert value.shape == (1, n)
        assert float((value[0] - truth[:n]).abs().max()) < 1e-10


# ---------------------------------------------------------------------- Gaussian refusals
def _low_rank_observation(layout):
    """A latent-free LowRankMultivariateNormal over E = 2 dims of T = 3 tokens, either
    inside a token plate or with an extra event dim (.to_event(1))."""
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(3, 2, generator=g, dtype=torch.float64)
    F = torch.randn(2, 1, generator=g, dtype=torch.float64)
    psi = torch.rand(2, generator=g, dtype=torch.float64) + 0.5
    x = torch.randn(5, 3, 2, generator=g, dtype=torch.float64)

    def model(x):
        if layout == "token-plate":
            with pyro.plate("data", x.shape[0], dim=-2), pyro.plate("tokens", 3, dim=-1):
                pyro.sample("x", dist.LowRankMultivariateNormal(loc, F, psi), obs=x)
        else:
            with pyro.plate("data", x.shape[0]):
                pyro.sample("x", dist.LowRankMultivariateNormal(loc, F, psi).to_event(1), obs=x)

    return model, x


@pytest.mark.parametrize(
    "layout,message",
    [
        ("token-plate", r"Observed site 'x' is a LowRankMultivariateNormal inside the token plate\(s\) 'tokens'"),
        ("to-event", r"Observed site 'x': a LowRankMultivariateNormal with extra event dims is not supported"),
    ],
    ids=["token-plate", "to-event"],
)
def test_low_rank_normal_in_a_token_plate_or_with_extra_event_dims_is_refused(layout, message):
    """Refused like a MultivariateNormal there, not a RuntimeError from a shape mismatch."""
    from pyro_mpt.conditionals import NotLinearGaussianError

    model, x = _low_rank_observation(layout)
    plates = ("tokens",) if layout == "token-plate" else None
    with pytest.raises(NotLinearGaussianError, match=message):
        Evidence(model, token_plates=plates)(x)
    with pytest.raises(NotLinearGaussianError, match=message):
        MaskedPretrainingLoss(conditionals="gaussian", masks="order", token_plates=plates).score(model, None, x)


# ---------------------------------------------------------------------- exact evidence with missing tokens
def _ppca512_with_missing(dtype):
    """PPCA at D = 512 (K = 2, noise 0.5, N = 4; parameters drawn in float64 and cast)
    with about a quarter of each datapoint's tokens missing (masked observation)."""
    D, K, n = 512, 2, 4
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    mu0 = torch.randn(D, generator=g, dtype=torch.float64)
    z = torch.randn(n, K, generator=g, dtype=torch.float64)
    x = z @ W0.T + mu0 + 0.5 * torch.randn(n, D, generator=g, dtype=torch.float64)
    observed = torch.rand(n, D, generator=g) > 0.25
    W, mu, s = W0.to(dtype), mu0.to(dtype), torch.tensor(0.5, dtype=dtype)

    def model(x, obs_mask):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).mask(obs_mask).to_event(1), obs=x)

    def exact(x):  # float64, one observed sub-vector at a time
        S = W0 @ W0.T + 0.25 * torch.eye(D, dtype=torch.float64)
        return torch.stack([
            torch.distributions.MultivariateNormal(mu0[o], S[o][:, o]).log_prob(xi[o])
            for xi, o in zip(x.double(), observed)
        ])

    return model, x.to(dtype), observed, exact


def test_exact_evidence_with_missing_tokens_is_accurate_in_float32_at_D512():
    """The observed sub-vector's density in the centred low-rank form: float32 agrees
    with float64 within the 3e-6 (relative) that docs/numerics.md states for
    Evidence(method="exact"); the Woodbury form was off by up to 3.6 nats here."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model, x, observed, exact = _ppca512_with_missing(dtype)
        out[dtype] = Evidence(model, method="exact")(x, observed).double()
    truth = exact(x)
    assert float(truth.abs().min()) > 250  # |log p(x_O)| is large: the comparison is not vacuous
    assert float((out[torch.float64] - truth).abs().max()) < 1e-8
    rel = ((out[torch.float32] - out[torch.float64]).abs() / out[torch.float64].abs()).max()
    assert float(rel) < 3e-6, float(rel)


# ---------------------------------------------------------------------- "order" with missing tokens
@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_order_with_missing_tokens_uses_one_exact_evaluation(method):
    """With missing tokens, masks="order" sums each ordering through chain_sums: for
    a Gaussian the observed targets telescope to log N(x_O), equal to the generic
    per-position sum, without the p * n * D conditionals of chain_log_prob."""
    from pyro_mpt import GaussianConditionals
    from pyro_mpt.conditionals.base import ConditionalEngine
    from pyro_mpt.masks import RandomOrders
    from pyro_mpt.sites import trace_tokens

    model, x, exact = _token_plate_ppca()
    observed = torch.ones(N, D, dtype=torch.bool)
    observed[0, 1] = observed[2, :3] = observed[3, 0] = False
    engine = GaussianConditionals(method)
    tokens = trace_tokens(model, None, (x, observed), {})
    state = engine.prepare(tokens, model, None, (x, observed), {})
    (block,) = RandomOrders(3).blocks(N, D, observed=observed)
    fast = engine.chain_sums(state, tokens.value, block.order, observed=observed)
    generic = ConditionalEngine.chain_sums(engine, state, tokens.value, block.order, observed=observed)
    assert fast.shape == generic.shape == (3, N)
    assert float((fast - generic).abs().max()) < 1e-10
    truth = exact(x, observed)
    assert float((fast - truth).abs().max()) < 1e-10

    calls = []
    engine.chain_log_prob = lambda *a, **k: calls.append(1) or GaussianConditionals.chain_log_prob(engine, *a, **k)
    loss = MaskedPretrainingLoss(conditionals=engine, masks="order", num_masks=4)
    value = loss.loss(model, None, x, observed)
    assert calls == []
    assert abs(value + float(truth.sum())) < 1e-9


# ---------------------------------------------------------------------- Gaussian factorizations
@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_exact_log_density_reuses_the_factor_of_prepare(method, monkeypatch):
    """prepare factors the whole covariance once (to rescue it early); the exact
    log-density behind masks="order" and Evidence reuses that factor."""
    from pyro_mpt import GaussianConditionals

    model, x, exact = _token_plate_ppca()
    truth = exact(x)
    shapes = []
    cholesky_ex = torch.linalg.cholesky_ex

    def spy(A, **kw):
        shapes.append(tuple(A.shape))
        return cholesky_ex(A, **kw)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", spy)
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order", num_masks=3)
    value = loss.differentiable_loss(model, None, x)
    assert shapes == [(1, K, K) if method == "lowrank" else (1, D, D)]
    assert abs(float(value) + float(truth.sum())) < 1e-10
    shapes.clear()
    assert float((Evidence(model, method="exact")(x) - truth).abs().max()) < 1e-10
    assert len(shapes) == 1


def _singular_ppca(noise=1e-9, D=8, n=5):
    """PPCA (float64) whose loading has two equal columns and a tiny noise scale:
    W W^T + noise^2 I is singular to working precision, so the rescue adds jitter."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, 1, generator=g, dtype=torch.float64)
    W = torch.cat([w, w], 1)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64) @ w.T

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, noise).to_event(1), obs=x)

    return model, x


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_jitter_rescue_is_remembered_across_steps_and_warns_once(method):
    """The relative jitter the rescue reached is the starting point of the next
    calls of the same engine: one warning over five loss evaluations (every call
    is counted, whatever the warning filters), and the same value each time."""
    import warnings

    from pyro_mpt import GaussianConditionals, NumericalWarning

    model, x = _singular_ppca()
    loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks="order")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        values = [loss.loss(model, None, x) for _ in range(5)]
    found = [r.message for r in rec if issubclass(r.category, NumericalWarning)]
    assert len(found) == 1 and found[0].site == "x"
    assert found[0].jitter > 0 and f"added jitter {found[0].jitter:.3g} " in str(found[0])
    assert values == [values[0]] * 5
    # the value is that of the jittered model, the same as the jitter passed explicitly
    explicit = MaskedPretrainingLoss(
        conditionals=GaussianConditionals(method, jitter=found[0].jitter, max_jitter=0.0), masks="order"
    )
    assert abs(explicit.loss(model, None, x) - values[0]) < 1e-9 * abs(values[0])


# ---------------------------------------------------------------------- gaussian_marginal run modes
def _non_broadcasting_ppca(fail=False):
    """PPCA whose model reshapes its latent to (n, K), so it cannot run in an extra
    plate on the left; counts its runs. With ``fail`` it also raises at z = 0 (the
    first noise point of every run mode), a genuine model error."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    runs = []

    def model(x):
        runs.append(1)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            if fail and bool((z == 0).all(-1).any()):
                raise RuntimeError("boom: the model fails at z = 0")
            loc = z.reshape(x.shape[0], K) @ W.T
            pyro.sample("x", dist.Normal(loc, SIGMA).to_event(1), obs=x)

    def exact(x):
        S = W @ W.T + SIGMA**2 * torch.eye(D, dtype=torch.float64)
        return torch.distributions.MultivariateNormal(torch.zeros(D, dtype=torch.float64), S).log_prob(x)

    return model, x, runs, exact


def test_gaussian_marginal_remembers_the_run_mode_that_worked():
    """Step 1 runs the model once to trace it, once in each failing vectorized mode
    and K + 2 times per point; later steps go straight to the per-point runs."""
    model, x, runs, exact = _non_broadcasting_ppca()
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    counts, values = [], []
    for _ in range(3):
        runs.clear()
        values.append(loss.loss(model, None, x))
        counts.append(len(runs))
    assert counts == [1 + 2 + (K + 2), 1 + (K + 2), 1 + (K + 2)]
    assert values == [values[0]] * 3
    assert abs(values[0] + float(exact(x).sum())) < 1e-10


def test_gaussian_marginal_raises_a_genuine_model_error_with_the_first_failure_chained():
    model, x, runs, _ = _non_broadcasting_ppca(fail=True)
    with pytest.raises(RuntimeError, match="boom") as info:
        Evidence(model, method="exact")(x)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    # Pyro's trace re-raises a model error with the trace shapes: the last run's
    # failure, and chained to it the first (vectorized) run's, each so wrapped
    runs_failed = [e for e in chain if "boom" in str(e) and "Trace Shapes" in str(e)]
    assert len(runs_failed) == 2, chain


# ---------------------------------------------------------------------- trace_tokens
def test_missing_integer_tokens_are_filled_once_for_both_layouts():
    """Missing tokens get an observed value of the same token; the token matrix is
    the float cast of the site's (integer) value, filled the same way."""
    from pyro_mpt.sites import trace_tokens

    x = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 2, 2]])
    observed = torch.tensor([[False, True, True], [True, False, True], [True, True, True], [False, False, True]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Categorical(logits=torch.zeros(3, 3)).mask(observed).to_event(1), obs=x)

    tokens = trace_tokens(model, None, (x,), {})
    assert torch.equal(tokens.observed, observed)
    assert tokens.site_value.dtype == torch.long and torch.is_floating_point(tokens.value)
    expected = torch.tensor([[2, 1, 2], [2, 1, 1], [1, 2, 0], [2, 1, 2]])  # first observed value per token
    assert torch.equal(tokens.site_value, expected)
    assert torch.equal(tokens.value, expected.to(tokens.value.dtype))


def test_token_plate_scale_per_datapoint_is_read_without_expanding_over_tokens():
    """poutine.scale with one weight per datapoint (shape (n, 1), broadcast over the
    token plate) weights each datapoint; a weight per token is refused."""
    from pyro import poutine

    model, x, exact = _token_plate_ppca()
    weights = torch.arange(1.0, N + 1, dtype=torch.float64)
    scaled = poutine.scale(model, scale=weights[:, None])
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    assert abs(loss.loss(scaled, None, x) + float((weights * exact(x)).sum())) < 1e-9
    per_token = poutine.scale(model, scale=torch.arange(1.0, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="has a scale that varies over its tokens"):
        loss.loss(per_token, None, x)


# ---------------------------------------------------------------------- masks
def test_random_ranks_put_missing_tokens_last_and_orders_put_them_first():
    """One ordering helper serves both: masks (ranks < M) draw among the observed
    tokens, orderings list the missing tokens first (never context of an observed one)."""
    from pyro_mpt.masks import RandomOrders, _random_ranks

    g = torch.Generator().manual_seed(1)
    observed = torch.rand(6, 9, generator=g) > 0.4
    observed[0] = False
    observed[1] = True
    counts = observed.sum(-1)
    ranks = _random_ranks((200, 6, 9), None, observed)
    assert torch.equal(ranks.sort(-1).values, torch.arange(9).expand(200, 6, 9))  # permutations
    assert bool(((ranks < counts[:, None]) == observed).all())  # observed tokens take the first ranks
    (block,) = RandomOrders(200).blocks(6, 9, observed=observed)
    first = torch.arange(9) < (9 - counts)[:, None]  # the first m_i positions
    assert bool((observed.expand(200, 6, 9).gather(-1, block.order) != first).all())
    # each token of a complete datapoint leads some ordering (a miss has probability 5e-10)
    lead = block.order[:, 1, 0]
    assert set(lead.tolist()) == set(range(9))


def test_schedule_whose_blocks_takes_kwargs_serves_missing_tokens():
    """A schedule forwarding **kwargs to a built-in one receives observed=."""
    from pyro_mpt.masks import MaskSchedule, RandomOrders

    class Forwarding(MaskSchedule):
        covers_all_sizes = True

        def blocks(self, n, D, **kwargs):
            return RandomOrders(2).blocks(n, D, **kwargs)

    model, x, exact = _token_plate_ppca()
    observed = torch.ones(N, D, dtype=torch.bool)
    observed[1, 2] = observed[4, :2] = False
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks=Forwarding())
    for _ in range(2):
        score = loss.score(model, None, x, observed)
        assert float((score - exact(x, observed)).abs().max()) < 1e-10
