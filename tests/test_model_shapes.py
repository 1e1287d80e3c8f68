"""Model shapes users bring (issue 7, item 1): each is supported with the right number or refused clearly.

Supported shapes are checked against the exact log-marginal likelihood or against an
equivalent simpler model (the ``.to_event`` twin of a token-plate model); refused ones by
the error type and message. docs/model_shapes.md lists every shape and its test.
"""

import math
import warnings

import numpy as np
import scipy.stats
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.nn import PyroModule, PyroParam, PyroSample

from pyro_mpt import Evidence, GaussianConditionals, MaskedPretrainingLoss
from pyro_mpt.conditionals import EncodeDecodeConditionals, EngineNotApplicable, ImportanceConditionals, NotLinearGaussianError
from pyro_mpt.conditionals.base import ConditionalEngine
from pyro_mpt.importance_weighted_elbo import ImportanceWeightedELBO
from pyro_mpt.masks import MaskSchedule, RandomOrders
from pyro_mpt.observed_tokens import trace_tokens

N, D, K, SIGMA = 6, 4, 2, 0.5
TOL = 1e-10


def _params(D=D, K=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return W, b, x


def _exact(W, b, x, observed=None):
    """log N(x_i; b, W W^T + s^2 I) per datapoint, over the observed tokens of each."""
    S = W @ W.T + SIGMA**2 * torch.eye(W.shape[0], dtype=W.dtype)
    if observed is None:
        return torch.distributions.MultivariateNormal(b, S).log_prob(x)
    out = []
    for i in range(x.shape[0]):
        o = observed[i]
        lp = torch.distributions.MultivariateNormal(b[o], S[o][:, o]).log_prob(x[i, o]) if o.any() else x.new_zeros(())
        out.append(lp)
    return torch.stack(out)


def _twin(W, b):
    """PPCA with the tokens as event dims."""

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + b, SIGMA).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x @ W / 4, 0.7).to_event(1))

    return model, guide


def _plated(W, b, obs_mask=None):
    """The same PPCA with the tokens in a pyro.plate (and an optional obs_mask)."""

    def model(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))  # (n, 1, K)
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + b, SIGMA), obs=x, obs_mask=obs_mask)

    def guide(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            pyro.sample("z", dist.Normal((x @ W / 4).unsqueeze(-2), 0.7).to_event(1))

    return model, guide


def _same_seed(fn, seed=1):
    torch.manual_seed(seed)
    return fn()


# ---------------------------------------------------------------------- token plates
@pytest.mark.parametrize("token_plates", [None, ("tokens",)])
@pytest.mark.parametrize("engine", ["gaussian", "quadrature"])
@pytest.mark.parametrize("masks", ["exhaustive", "order", "all", "uniform"])
def test_token_plate_equals_to_event_twin(float64, engine, masks, token_plates):
    """Loss, score and curve of the plate-over-tokens model equal those of its .to_event(1)
    twin (same seed), whether the token plate is named or detected."""
    W, b, x = _params()
    twin, _ = _twin(W, b)
    plated, _ = _plated(W, b)
    loss_t = MaskedPretrainingLoss(conditionals=engine, masks=masks)
    loss_p = MaskedPretrainingLoss(conditionals=engine, masks=masks, token_plates=token_plates)
    a = _same_seed(lambda: loss_t.score(twin, None, x))
    c = _same_seed(lambda: loss_p.score(plated, None, x))
    assert c.shape == (N,)
    assert torch.allclose(a, c, atol=TOL, rtol=0)
    lt = _same_seed(lambda: loss_t.loss(twin, None, x))
    lp = _same_seed(lambda: loss_p.loss(plated, None, x))
    assert abs(lt - lp) < TOL
    if masks in ("exhaustive", "order"):
        assert torch.allclose(c, _exact(W, b, x), atol=1e-8, rtol=0)
        ct = _same_seed(lambda: loss_t.curve(twin, None, x))
        cp = _same_seed(lambda: loss_p.curve(plated, None, x))
        assert abs(ct.area() - cp.area()) < TOL
        assert float(abs(ct.score - cp.score).max()) < TOL


@pytest.mark.parametrize("method", ["exact", "quadrature"])
def test_token_plate_evidence_equals_twin(float64, method):
    W, b, x = _params()
    twin, _ = _twin(W, b)
    plated, _ = _plated(W, b)
    a = Evidence(twin, method=method)(x)
    c = Evidence(plated, method=method, token_plates=("tokens",))(x)
    assert c.shape == (N,)
    assert torch.allclose(a, c, atol=TOL, rtol=0)
    assert torch.allclose(c, _exact(W, b, x), atol=1e-8, rtol=0)


def test_token_plates_in_any_layout_equal_the_to_event_twin(float64):
    """A token plate left of the data plate (with an event dim), and two token plates,
    flatten in the site's layout and give the numbers of the .to_event(2) twin."""
    C, H = 2, 3
    g = torch.Generator().manual_seed(3)
    W = torch.randn(C, H, K, generator=g, dtype=torch.float64)
    b = torch.randn(C, H, generator=g, dtype=torch.float64)
    x = torch.randn(N, C, H, generator=g, dtype=torch.float64)

    def twin(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            loc = (z[..., None, None, :] * W).sum(-1) + b
            pyro.sample("x", dist.Normal(loc, SIGMA).to_event(2), obs=x)

    def channel_plate(xt):  # xt: (C, n, H): the channel plate at dim -2, datapoints at -1
        with pyro.plate("data", xt.shape[1], dim=-1):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=xt.dtype), 1.0).to_event(1))
            with pyro.plate("channels", C, dim=-2):
                loc = (z[..., :, None, :] * W[:, None]).sum(-1) + b[:, None]
                pyro.sample("x", dist.Normal(loc, SIGMA).to_event(1), obs=xt)

    def two_plates(x):
        with pyro.plate("data", x.shape[0], dim=-3):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            with pyro.plate("c", C, dim=-2), pyro.plate("h", H, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + b, SIGMA), obs=x)

    xt = x.permute(1, 0, 2).contiguous()
    ref = Evidence(twin)(x)
    for model, data in [(channel_plate, xt), (two_plates, x)]:
        assert torch.allclose(Evidence(model)(data), ref, atol=TOL, rtol=0)
        for engine, masks in [("gaussian", "exhaustive"), ("quadrature", "order")]:
            got = MaskedPretrainingLoss(conditionals=engine, masks=masks).score(model, None, data)
            assert torch.allclose(got, ref, atol=1e-8, rtol=0)
    tokens = trace_tokens(channel_plate, None, (xt,), {})
    assert tokens.token_plates == ("channels",) and tokens.token_dims == (-2,)
    assert torch.equal(tokens.value, x.reshape(N, C * H))
    assert torch.equal(tokens.to_site(tokens.value), xt)


@pytest.mark.parametrize("kind", ["importance_prior", "importance_guide", "encode_decode", "evidence", "iwae"])
def test_token_plate_sampling_engines_equal_the_twin_with_the_same_seed(float64, kind):
    W, b, x = _params()
    twin, twin_guide = _twin(W, b)
    plated, plated_guide = _plated(W, b)

    def run(model, guide):
        if kind == "importance_prior":
            return MaskedPretrainingLoss(conditionals="importance", masks="all", num_samples=40).score(model, None, x)
        if kind == "importance_guide":
            loss = MaskedPretrainingLoss(conditionals="importance", proposal="guide", masks="all", num_samples=12)
            return loss.score(model, guide, x)
        if kind == "encode_decode":
            loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 2), masks=0.5, num_masks=2)
            return loss.score(model, guide, x)
        if kind == "evidence":
            return Evidence(model, guide, method="importance", num_samples=50, psis=False)(x)
        return torch.tensor(ImportanceWeightedELBO(5).loss(model, guide, x))

    a = _same_seed(lambda: run(twin, twin_guide))
    c = _same_seed(lambda: run(plated, plated_guide))
    assert torch.allclose(a, c, atol=TOL, rtol=0)


def test_token_plate_with_subsampled_data_plate_scales_by_N_over_B(float64):
    W, b, x = _params()

    def model(x, idx):
        with pyro.plate("data", N, subsample=idx, dim=-2) as i:
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            with pyro.plate("tokens", D, dim=-1):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + b, SIGMA), obs=x[i])

    idx = torch.tensor([1, 4])
    value = MaskedPretrainingLoss(masks="order").loss(model, None, x, idx)
    assert abs(value + N / 2 * float(_exact(W, b, x)[idx].sum())) < 1e-9


def test_plate_of_items_inside_groups_is_detected_as_tokens(float64):
    """A latent per group, items in a plate without latents: the items are the group's tokens
    (they share its latent), so log p(x_g) is the marginal of the flattened items x event."""
    G, I = 4, 3
    g = torch.Generator().manual_seed(5)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(G, I, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("groups", G, dim=-2):
            u = pyro.sample("u", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))  # (G, 1, K)
            with pyro.plate("items", I, dim=-1):
                pyro.sample("x", dist.Normal(u @ W.T, SIGMA).to_event(1), obs=x)

    WI = W.repeat(I, 1)  # (I * D, K): every item loads on the group's latent
    S = WI @ WI.T + SIGMA**2 * torch.eye(I * D, dtype=torch.float64)
    exact = torch.distributions.MultivariateNormal(torch.zeros(I * D, dtype=torch.float64), S).log_prob(x.reshape(G, -1))
    assert trace_tokens(model, None, (x,), {}).token_plates == ("items",)
    assert torch.allclose(Evidence(model)(x), exact, atol=TOL, rtol=0)
    assert torch.allclose(MaskedPretrainingLoss(masks="order").score(model, None, x), exact, atol=1e-8, rtol=0)
    # token_plates=() takes every plate as a datapoint plate: u is then shared by the items
    with pytest.raises(NotLinearGaussianError, match="'u' is outside the plate\\(s\\) 'items'"):
        Evidence(model, token_plates=())(x)


def test_token_plate_is_detected_with_a_single_datapoint():
    """A data plate of size 1 still holds the latent, so the token plate is found."""
    W, b, x = _params()
    model, _ = _plated(W, b)
    full = Evidence(model)(x)
    one = Evidence(model)(x[:1])
    assert one.shape == (1,)
    assert abs(float(one[0] - full[0])) < 1e-10
    assert abs(float(one[0] - _exact(W, b, x[:1])[0])) < 1e-10
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


def test_plates_of_one_element_keep_their_role(float64):
    """A hierarchy's plates are told apart by their latents whatever their size: a batch of
    one group (a minibatch of one) had its members taken for datapoints and the group's
    latent for a global one (refused by every engine, "auto" too), and one member per group
    was refused as having no tokens. Against scipy's multivariate normal of each group."""
    mu0, tau, om, sig = 0.5, 1.3, 0.6, 0.4

    def three_levels(x):  # groups x members x K measurements
        G, M, K = x.shape
        with pyro.plate("groups", G, dim=-2):
            th = pyro.sample("th", dist.Normal(torch.tensor(mu0), tau).expand([G, 1]))
            with pyro.plate("members", M, dim=-1):
                u = pyro.sample("u", dist.Normal(th, om))
                pyro.sample("x", dist.Normal(u.unsqueeze(-1).expand(u.shape + (K,)), sig).to_event(1), obs=x)

    def two_levels(x):  # members x groups, no event dims
        M, G = x.shape
        with pyro.plate("groups", G, dim=-1):
            th = pyro.sample("th", dist.Normal(torch.tensor(mu0), tau))
            with pyro.plate("members", M, dim=-2):
                pyro.sample("x", dist.Normal(th, sig), obs=x)

    def truth(group, member_of, member_sd):
        same = member_of[:, None] == member_of[None, :]
        cov = sig**2 * np.eye(len(group)) + member_sd**2 * same + tau**2
        return scipy.stats.multivariate_normal(np.full(len(group), mu0), cov).logpdf(group)

    x = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(0))
    for G, M in ((3, 4), (1, 4), (1, 1), (2, 1)):
        xs = x[:G, :M]
        want = np.array([truth(g.reshape(-1).numpy(), np.repeat(np.arange(M), 2), om) for g in xs])
        for value in (Evidence(three_levels)(xs), MaskedPretrainingLoss(masks="order").score(three_levels, None, xs)):
            assert value.shape == (G,) and np.abs(value.detach().numpy() - want).max() < 1e-10
    y = x[..., 0].T  # (members, groups)
    for M in (4, 1):
        want = np.array([truth(col.numpy(), np.arange(M), 0.0) for col in y[:M].T])
        for value in (Evidence(two_levels)(y[:M]), MaskedPretrainingLoss(masks="order").score(two_levels, None, y[:M])):
            assert value.shape == (3,) and np.abs(value.detach().numpy() - want).max() < 1e-10


def test_token_plate_scale_per_datapoint_is_read_without_expanding_over_tokens():
    """poutine.scale with one weight per datapoint (shape (n, 1), broadcast over the
    token plate) weights each datapoint; a weight per token is refused."""
    W, b, x = _params()
    model, _ = _plated(W, b)
    weights = torch.arange(1.0, N + 1, dtype=torch.float64)
    scaled = poutine.scale(model, scale=weights[:, None])
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks="order")
    assert abs(loss.loss(scaled, None, x) + float((weights * _exact(W, b, x)).sum())) < 1e-9
    per_token = poutine.scale(model, scale=torch.arange(1.0, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="has a scale that varies over its tokens"):
        loss.loss(per_token, None, x)


def test_token_plate_refusals_name_the_plates_and_the_option(float64):
    x = torch.randn(N, D)

    def latent_free(x):
        with pyro.plate("data", N, dim=-2), pyro.plate("tokens", D, dim=-1):
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)

    with pytest.raises(ValueError, match=r"(?s)no event dims and sits in the plates 'data' \(dim -2, size 6\), 'tokens'.*ambiguous.*token_plates="):
        MaskedPretrainingLoss().loss(latent_free, None, x)
    # naming the plate resolves it: independent standard normal tokens
    exact = torch.distributions.Normal(0.0, 1.0).log_prob(x).sum(-1)
    assert torch.allclose(Evidence(latent_free, token_plates="tokens")(x), exact, atol=TOL)
    with pytest.raises(ValueError, match="token_plates=\\('toks',\\): observed site 'x' is in no plate named 'toks'"):
        Evidence(latent_free, token_plates=("toks",))(x)
    with pytest.raises(ValueError, match="token_plates=\\(\\) names none of its plates"):
        Evidence(latent_free, token_plates=())(x)

    def per_token_latent(x):
        with pyro.plate("data", N, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", D, dim=-1):
                e = pyro.sample("e", dist.Normal(0.0, 1.0))
                pyro.sample("x", dist.Normal(z + e, 1.0), obs=x)

    # a latent per token: the per-datapoint engines refuse it, the hierarchical one serves it
    with pytest.raises(ValueError, match="Latent site 'e' sits in token plate\\(s\\) 'tokens'.*one latent per unit of tokens.*conditionals='hierarchical'"):
        MaskedPretrainingLoss(conditionals="gaussian", token_plates=("tokens",)).loss(per_token_latent, None, x)
    cov = torch.ones(D, D) + 2 * torch.eye(D)  # z + e + noise: 1 + 1 + 1 on the diagonal
    ref = torch.distributions.MultivariateNormal(torch.zeros(D), cov).log_prob(x)
    value = MaskedPretrainingLoss(masks="order", token_plates=("tokens",)).score(per_token_latent, None, x)
    assert torch.allclose(value, ref, atol=TOL)

    def subsampled_tokens(x):
        with pyro.plate("data", N, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", D, subsample_size=2, dim=-1) as j:
                pyro.sample("x", dist.Normal(z, 1.0), obs=x[:, j])

    with pytest.raises(ValueError, match="Token plate 'tokens' of observed site 'x' subsamples 2 of 4 tokens"):
        MaskedPretrainingLoss().loss(subsampled_tokens, None, x)

    def token_scale(x):
        with pyro.plate("data", N, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", D, dim=-1), poutine.scale(scale=torch.arange(1.0, D + 1)):
                pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    with pytest.raises(ValueError, match="scale that varies over its tokens"):
        MaskedPretrainingLoss().loss(token_scale, None, x)


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


@pytest.mark.parametrize("layout", ["token-plate", "to-event"])
def test_low_rank_normal_in_a_token_plate_or_with_extra_event_dims_is_served_blockwise(layout, float64):
    """Three independent LowRankMultivariateNormal blocks of 2 tokens: the exact evidence
    and the order schedule equal torch's LowRankMultivariateNormal.log_prob summed over
    the blocks (1e-10); each block keeps its own location."""
    model, x = _low_rank_observation(layout)
    plates = ("tokens",) if layout == "token-plate" else None
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(3, 2, generator=g, dtype=torch.float64)
    F = torch.randn(2, 1, generator=g, dtype=torch.float64)
    psi = torch.rand(2, generator=g, dtype=torch.float64) + 0.5
    want = dist.LowRankMultivariateNormal(loc, F, psi).log_prob(x).sum(-1)
    got = Evidence(model, token_plates=plates)(x)
    assert (got - want).abs().max() < 1e-10
    score = MaskedPretrainingLoss(conditionals="gaussian", masks="order", token_plates=plates).score(model, None, x)
    assert (score - want).abs().max() < 1e-10


# ---------------------------------------------------------------------- missing tokens
def _mask(seed=2):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(N, D, generator=g) > 0.35
    m[0] = False  # nothing observed: log p = 0
    m[1] = True  # everything observed
    return m


def _missing_models(W, b, m):
    """The same PPCA with missing tokens declared three ways."""
    obs_mask, _ = _plated(W, b, obs_mask=m)

    def dist_mask(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + b, SIGMA).mask(m).to_event(1), obs=x)

    def poutine_mask(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            with pyro.plate("tokens", D, dim=-1), poutine.mask(mask=m):
                pyro.sample("x", dist.Normal((z * W).sum(-1) + b, SIGMA), obs=x)

    return {"obs_mask": obs_mask, "dist.mask": dist_mask, "poutine.mask": poutine_mask}


@pytest.mark.parametrize("how", ["obs_mask", "dist.mask", "poutine.mask"])
@pytest.mark.parametrize("engine", ["gaussian", "quadrature"])
def test_missing_tokens_proposition_1_over_the_observed_tokens(float64, how, engine):
    """Exhaustive and ordering MPT over each datapoint's D_i observed tokens equal the exact
    log-density of its observed sub-vector; so do Evidence and the curve's area (over the
    datapoints with observed tokens)."""
    W, b, x = _params()
    m = _mask()
    exact = _exact(W, b, x, m)
    model = _missing_models(W, b, m)[how]
    data = torch.where(m, x, torch.full_like(x, math.nan)) if how == "obs_mask" else x
    tokens = trace_tokens(model, None, (data,), {})
    assert torch.equal(tokens.observed, m) and "x_unobserved" not in tokens.latent_names
    for masks in ["exhaustive", "order"]:
        got = MaskedPretrainingLoss(conditionals=engine, masks=masks).score(model, None, data)
        assert torch.allclose(got, exact, atol=TOL, rtol=0), masks
        curve = MaskedPretrainingLoss(conditionals=engine, masks=masks).curve(model, None, data)
        # a datapoint without observed tokens scores 0 and is no point of the curve
        present = m.any(-1)
        assert abs(curve.area() - float(exact[present].mean())) < TOL
    method = "exact" if engine == "gaussian" else "quadrature"
    assert torch.allclose(Evidence(model, method=method)(data), exact, atol=TOL, rtol=0)


@pytest.mark.parametrize("masks", ["all", "uniform", "stratified"])
def test_missing_tokens_random_schedules_are_unbiased(float64, masks):
    W, b, x = _params()
    m = _mask()
    model = _missing_models(W, b, m)["dist.mask"]
    loss = MaskedPretrainingLoss(masks=masks)
    draws = torch.stack([loss.score(model, None, x) for _ in range(300)])
    err = (draws.mean(0) - _exact(W, b, x, m))[1:]
    se = draws.std(0)[1:] / math.sqrt(draws.shape[0])
    assert float((err.abs() / se).max()) < 4.0, (err, se)
    assert torch.equal(draws[:, 0], torch.zeros_like(draws[:, 0]))  # no observed token: log p = 0


def test_missing_tokens_fixed_rate_masks_round_rate_times_D_i(float64):
    """A rate that masks every observed token leaves no context: D_i S(x_i; D_i) is the sum
    of the observed tokens' marginals. A rate that masks none of some D_i is refused."""
    W, b, x = _params()
    m = _mask()
    model = _missing_models(W, b, m)["dist.mask"]
    var = (W**2).sum(-1) + SIGMA**2
    lp = torch.distributions.Normal(b, var.sqrt()).log_prob(x)
    expected = torch.where(m, lp, torch.zeros_like(lp)).sum(-1)
    got = MaskedPretrainingLoss(masks=0.99).score(model, None, x)
    assert torch.allclose(got, expected, atol=TOL, rtol=0)
    m2 = m.clone()
    m2[2] = torch.tensor([True, False, False, False])
    model2 = _missing_models(W, b, m2)["dist.mask"]
    with pytest.raises(ValueError, match=r"masks=0\.2 masks round\(0\.2 \* D_i\) = 0 .*fewest: D_i = 1"):
        MaskedPretrainingLoss(masks=0.2).loss(model2, None, x)


def test_missing_tokens_prior_importance_telescopes_and_evidence_is_within_stderr(float64):
    W, b, x = _params()
    m = _mask()
    model = _missing_models(W, b, m)["obs_mask"]
    data = torch.where(m, x, torch.full_like(x, math.nan))
    order = _same_seed(lambda: MaskedPretrainingLoss(conditionals="importance", masks="order", num_samples=500).score(model, None, data))
    exh = _same_seed(lambda: MaskedPretrainingLoss(conditionals="importance", masks="exhaustive", num_samples=500).score(model, None, data))
    assert torch.allclose(order, exh, atol=1e-9, rtol=0)  # the prior draws form one joint
    res = Evidence(model, method="importance", num_samples=4000).estimate(data)
    exact = _exact(W, b, x, m)
    assert float(res.log_evidence[0]) == 0.0
    assert float(((res.log_evidence - exact)[1:] / res.stderr[1:]).abs().max()) < 4.5


def test_missing_tokens_gradients_match_the_exact_gradient(float64):
    """NaN placeholders at missing tokens never reach a gradient."""
    _, b, x = _params()
    m = _mask()
    W = torch.nn.Parameter(_params()[0])
    model, _ = _plated(W, b, obs_mask=m)
    data = torch.where(m, x, torch.full_like(x, math.nan))
    (g_exact,) = torch.autograd.grad(_exact(W, b, x, m).sum(), W)
    for engine in ["gaussian", "quadrature"]:
        loss = MaskedPretrainingLoss(conditionals=engine, masks="order").differentiable_loss(model, None, data)
        (g,) = torch.autograd.grad(loss, W)
        assert torch.allclose(-g, g_exact, atol=1e-8), engine


@pytest.mark.parametrize("method", ["lowrank", "dense"])
def test_order_with_missing_tokens_uses_one_exact_evaluation(method):
    """With missing tokens, masks="order" sums each ordering through chain_sums: for
    a Gaussian the observed targets telescope to log N(x_O), equal to the generic
    per-position sum, without the p * n * D conditionals of chain_log_prob."""
    W, b, x = _params()
    observed = torch.ones(N, D, dtype=torch.bool)
    observed[0, 1] = observed[2, :3] = observed[3, 0] = False
    model, _ = _plated(W, b, obs_mask=observed)
    engine = GaussianConditionals(method)
    tokens = trace_tokens(model, None, (x,), {})
    state = engine.prepare(tokens, model, None, (x,), {})
    (block,) = RandomOrders(3).blocks(N, D, observed=observed)
    fast = engine.chain_sums(state, tokens.value, block.orders(), observed=observed)
    generic = ConditionalEngine.chain_sums(engine, state, tokens.value, block.orders(), observed=observed)
    assert fast.shape == generic.shape == (3, N)
    assert float((fast - generic).abs().max()) < 1e-10
    truth = _exact(W, b, x, observed)
    assert float((fast - truth).abs().max()) < 1e-10

    calls = []
    engine.chain_log_prob = lambda *a, **k: calls.append(1) or GaussianConditionals.chain_log_prob(engine, *a, **k)
    loss = MaskedPretrainingLoss(conditionals=engine, masks="order", num_masks=4)
    value = loss.loss(model, None, x)
    assert calls == []
    assert abs(value + float(truth.sum())) < 1e-9


def test_missing_integer_tokens_are_filled_once_for_both_layouts():
    """Missing tokens get an observed value of the same token where their own is not a value
    of the site (here 7, or -1, for a Categorical of 3); the token matrix and the site's value
    are the float cast of the (integer) data, filled the same way (the site's value stayed
    integer, and a Poisson's lgamma(x + 1) there ran in torch's default dtype)."""
    x = torch.tensor([[7, 1, 2], [2, -1, 1], [1, 2, 0], [7, 7, 2]])
    observed = torch.tensor([[False, True, True], [True, False, True], [True, True, True], [False, False, True]])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Categorical(logits=torch.zeros(3, 3)).mask(observed).to_event(1), obs=x)

    tokens = trace_tokens(model, None, (x,), {})
    assert torch.equal(tokens.observed, observed)
    assert tokens.site_value.dtype == tokens.value.dtype and torch.is_floating_point(tokens.value)
    expected = torch.tensor([[2, 1, 2], [2, 1, 1], [1, 2, 0], [2, 1, 2]])  # first observed value per token
    assert torch.equal(tokens.site_value, expected.to(tokens.value.dtype))
    assert torch.equal(tokens.value, expected.to(tokens.value.dtype))


def test_missing_tokens_get_a_value_in_their_own_datapoints_support(float64):
    """A Binomial whose total_count differs by datapoint, a token missing where the datapoint
    has 2 trials: the other datapoint's value of that token (7) was put there, outside the
    support, and every estimate failed with Pyro's support error on valid data. Such a token now
    gets a draw of the site's distribution (the global random stream left as it was): the
    quadrature evidence and "order" score, and the enumerated mixture's, equal scipy's
    references over the observed tokens."""
    from scipy import integrate, stats
    from scipy.special import logsumexp

    tot = torch.tensor([[10.0, 10.0], [2.0, 10.0]])
    x = torch.tensor([[7.0, 3.0], [1.0, 4.0]])
    m = torch.tensor([[True, True], [False, True]])

    def latent(tot, x, m):
        with pyro.plate("data", 2):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0), 1.0))
            pyro.sample("x", dist.Binomial(tot, logits=z[..., None]).mask(m).to_event(1), obs=x)

    probs = [[0.3, 0.6], [0.7, 0.2]]

    def mixture(tot, x, m):
        with pyro.plate("data", 2):
            c = pyro.sample("c", dist.Categorical(torch.tensor([0.5, 0.5])))
            pyro.sample("x", dist.Binomial(tot, probs=torch.tensor(probs)[c]).mask(m).to_event(1), obs=x)

    def observed_terms(i, p):
        return sum(stats.binom.logpmf(x[i, d].item(), tot[i, d].item(), p[d]) for d in range(2) if m[i, d])

    def latent_ref(i):
        f = lambda z: math.exp(stats.norm.logpdf(z) + observed_terms(i, [1 / (1 + math.exp(-z))] * 2))  # noqa: E731
        return math.log(integrate.quad(f, -15, 15, epsabs=0, epsrel=1e-12)[0])

    latent_want = torch.tensor([latent_ref(0), latent_ref(1)])
    mixture_want = torch.tensor([logsumexp([math.log(0.5) + observed_terms(i, probs[k]) for k in range(2)]) for i in range(2)])
    state = torch.get_rng_state()
    tokens = trace_tokens(latent, None, (tot, x, m), {})
    assert torch.equal(torch.get_rng_state(), state)
    assert bool(((tokens.site_value >= 0) & (tokens.site_value <= tot)).all())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the quadrature engine's accuracy notes
        torch.testing.assert_close(Evidence(latent, method="quadrature", num_nodes=64)(tot, x, m), latent_want,
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(MaskedPretrainingLoss(masks="order", conditionals="quadrature", num_nodes=64)
                                   .score(latent, None, tot, x, m), latent_want, rtol=0, atol=1e-6)
    torch.testing.assert_close(Evidence(mixture)(tot, x, m), mixture_want, rtol=0, atol=1e-10)
    torch.testing.assert_close(MaskedPretrainingLoss(masks="order").score(mixture, None, tot, x, m), mixture_want,
                               rtol=0, atol=1e-10)


def test_a_valid_placeholder_at_a_missing_token_is_kept(float64):
    """A class per datapoint sets the upper end of a Uniform (lo_i, lo_i + w_i (1 + e^{s_c})), a
    token missing with the placeholder lo_i + 0.01, which every class's support holds: it was
    replaced by another datapoint's value of the token, outside some class's interval, and the
    enumeration failed with Pyro's support error (as Pyro's TraceEnum_ELBO does not). A
    placeholder that is finite and in the support now stays: Evidence and the "order" score
    equal numpy's log-sum-exp over the classes."""
    from scipy.special import logsumexp

    lo = torch.tensor([0.0, 5.0, 1.0, -3.0])
    wd = torch.tensor([1.0, 2.0, 3.0, 1.5])
    s = torch.tensor([-2.0, 0.0, 2.0])  # widths that differ by the class: a draw at one class lies outside another
    logits = torch.tensor([-0.8646, 0.2990, 0.4192])
    m = torch.tensor([[False, True, True], [True, True, True], [True, False, True], [True, True, False]])
    x = torch.tensor([[0.5, 0.2, 0.9], [6.9, 5.1, 6.0], [3.9, 2.2, 1.5], [-2.0, -1.7, -2.9]])
    x = torch.where(m, x, lo[:, None] + 0.01)

    def model(x):
        with pyro.plate("data", 4):
            c = pyro.sample("c", dist.Categorical(logits=logits))
            high = lo[:, None] + wd[:, None] * (1 + s[c].exp()[..., None])
            pyro.sample("x", dist.Uniform(lo[:, None].expand(high.shape), high).mask(m).to_event(1), obs=x)

    log_pi = torch.log_softmax(logits, -1).numpy()
    want = []
    for i in range(4):
        terms = []
        for c in range(3):
            high = float(lo[i] + wd[i] * (1 + s[c].exp()))
            inside = all(lo[i] <= x[i, d] < high for d in range(3) if m[i, d])
            terms.append(log_pi[c] - int(m[i].sum()) * np.log(high - float(lo[i])) if inside else -np.inf)
        want.append(logsumexp(terms))
    want = torch.tensor(want)
    torch.testing.assert_close(Evidence(model)(x), want, rtol=0, atol=1e-10)
    torch.testing.assert_close(MaskedPretrainingLoss(masks="order").score(model, None, x), want, rtol=0, atol=1e-10)


def test_missing_tokens_refused_where_the_guide_reads_the_data(float64):
    W, b, x = _params()
    m = _mask()
    model, guide = _plated(W, b, obs_mask=m)
    data = torch.where(m, x, torch.zeros_like(x))
    partial = m.any(-1) & ~m.all(-1)  # datapoint 0, masked out whole, is not counted
    msg = (
        f"does not support missing tokens: observed site 'x_observed' has {int((~m[partial]).sum())} missing "
        f"\\(masked\\) token\\(s\\) in {int(partial.sum())} datapoint\\(s\\) with observed tokens too"
    )
    with pytest.raises(EngineNotApplicable, match=msg):
        MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, data)
    with pytest.raises(EngineNotApplicable, match=msg):
        MaskedPretrainingLoss(conditionals="importance", proposal="guide").loss(model, guide, data)
    with pytest.raises(ValueError, match=msg):
        ImportanceWeightedELBO(4).loss(model, guide, data)
    with pytest.raises(ValueError, match=msg):
        Evidence(model, guide, method="importance", proposal="guide")(data)
    # "auto" picks what leaves the missing tokens out exactly
    exact = _exact(W, b, x, m)
    assert torch.allclose(MaskedPretrainingLoss(masks="order").score(model, guide, data), exact, atol=1e-9)


def _padded_ppca(W, b, keep):
    """PPCA whose datapoints outside ``keep`` are masked out whole (padding rows)."""

    def model(x):
        with pyro.plate("data", x.shape[0]), poutine.mask(mask=keep):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + b, SIGMA).to_event(1), obs=x)

    return model


def test_masked_datapoints_count_zero_and_nan_at_observed_tokens_is_refused(float64):
    W, b, x = _params()
    keep = torch.tensor([True, False, True, True, False, True])

    model = _padded_ppca(W, b, keep)

    expected = torch.where(keep, _exact(W, b, x), torch.zeros(N, dtype=x.dtype))
    assert torch.allclose(MaskedPretrainingLoss(masks="order").score(model, None, x), expected, atol=1e-9)
    m = _mask()
    plated, _ = _plated(W, b, obs_mask=m)
    bad = torch.where(m, x, torch.full_like(x, math.nan))
    bad[1, 0] = math.nan  # datapoint 1 observes every token
    with pytest.raises(ValueError, match="'x_observed' contains 1 NaN or infinite value\\(s\\) at observed tokens"):
        MaskedPretrainingLoss().loss(plated, None, bad)


def _exact_posterior_guide(W, b, keep=None):
    """The amortized exact posterior of PPCA, q(z | x_i) = p(z | x_i): every importance
    weight is log p(x_i) itself; ``keep`` masks its datapoints as the model's."""
    prec = torch.eye(K, dtype=W.dtype) + W.T @ W / SIGMA**2
    cov = torch.linalg.inv(prec)

    def guide(x):
        mean = (x - b) @ W @ cov / SIGMA**2
        with pyro.plate("data", x.shape[0]), poutine.mask(mask=True if keep is None else keep):
            pyro.sample("z", dist.MultivariateNormal(mean, cov))

    return guide


def test_datapoints_masked_out_whole_are_served_where_the_guide_reads_the_data(float64):
    """Padding rows masked out whole (poutine.mask over datapoints): the estimators that run
    the guide on the data score them 0 whatever their placeholder values, and the other rows
    as without them (they were refused as missing tokens). With the exact posterior as the
    guide every importance weight of a kept row is its log p(x_i) (numpy's closed form)."""
    W, b, x = _params()
    keep = torch.tensor([True, False, True, True, False, True])

    model = _padded_ppca(W, b, keep)

    S_ = W.numpy() @ W.numpy().T + SIGMA**2 * np.eye(D)
    exact = torch.from_numpy(scipy.stats.multivariate_normal(b.numpy(), S_).logpdf(x.numpy()))
    expected = torch.where(keep, exact, torch.zeros(()))
    other = x.clone()
    other[~keep] = 40.0  # other placeholders
    for guide in (_exact_posterior_guide(W, b), _exact_posterior_guide(W, b, keep)):
        result = Evidence(model, guide, method="importance", num_samples=20).estimate(x)
        assert result.diagnostics["proposal"] == "guide"  # "auto" takes the guide
        assert torch.allclose(result.log_evidence, expected, atol=1e-9)
        assert torch.allclose(result.diagnostics["ess"][~keep], torch.full((2,), 20.0, dtype=torch.float64), rtol=1e-12)
        assert float(result.stderr[~keep].abs().max()) < 1e-7  # sqrt of rounding
        assert torch.equal(result.diagnostics["khat"][~keep], torch.full((2,), -math.inf, dtype=torch.float64))
        for data in (x, other):
            assert abs(ImportanceWeightedELBO(5).loss(model, guide, data) + float(exact[keep].sum())) < 1e-8

    # the conditionals of the engines that run the guide: 0 at the padding rows, the other
    # rows' estimates and the loss's gradient the same whatever the placeholders
    guide = _exact_posterior_guide(W, b)
    for options in ({"conditionals": "encode_decode"}, {"conditionals": "importance", "num_samples": 64}):
        for masks in ("all", "order"):
            runs = []
            for data in (x, other):
                Wp = W.clone().requires_grad_()

                def trained(x, Wp=Wp):
                    with pyro.plate("data", x.shape[0]), poutine.mask(mask=keep):
                        z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
                        pyro.sample("x", dist.Normal(z @ Wp.T + b, SIGMA).to_event(1), obs=x)

                pyro.set_rng_seed(3)
                loss = MaskedPretrainingLoss(masks=masks, **options)
                score = loss.score(trained, guide, data)
                pyro.set_rng_seed(3)
                (grad,) = torch.autograd.grad(loss.differentiable_loss(trained, guide, data), Wp)
                runs.append((score.detach(), grad))
            (s0, g0), (s1, g1) = runs
            assert torch.equal(s0[~keep], torch.zeros(2, dtype=torch.float64)), (options, masks)
            assert bool(s0[keep].isfinite().all())
            assert torch.allclose(s0, s1, atol=1e-10, rtol=0), (options, masks)
            assert torch.allclose(g0, g1, atol=1e-10, rtol=0), (options, masks)

    # the padding rows' weights (proposed here far wider than the prior) are not judged
    def wide(x):
        with pyro.plate("data", x.shape[0]):
            scale = torch.where(keep, 0.5, 30.0).to(x.dtype).unsqueeze(-1).expand(x.shape[0], K)
            pyro.sample("z", dist.Normal(torch.zeros_like(scale), scale).to_event(1))

    engine = ImportanceConditionals(num_samples=200)
    tokens = trace_tokens(model, wide, (x,), {})
    state = engine.prepare(tokens, model, wide, (x,), {})
    assert state.proposal == "guide"
    engine.mask_log_prob(state, tokens.value, torch.rand(3, N, D, generator=torch.Generator().manual_seed(0)) < 0.5)
    assert torch.equal(state.diagnostics["khat"][~keep], torch.full((2,), -math.inf, dtype=torch.float64))
    assert torch.equal(state.diagnostics["ess"][~keep], torch.full((2,), 200.0, dtype=torch.float64))
    assert bool(state.diagnostics["ess"][keep].lt(200).all())


@pytest.mark.parametrize("method", ["exact", "quadrature", "importance"])
def test_evidence_of_a_datapoint_masked_out_whole_is_zero_in_float32(method):
    """log p of no observation is 0, not the rounding of the missing tokens' terms added and
    taken off again (float32, exact route: -4.8e-7)."""
    W, b, x = (t.float() for t in _params())
    keep = torch.tensor([True, False, True, True, False, True])

    model = _padded_ppca(W, b, keep)

    result = Evidence(model, method=method, num_samples=50).estimate(x) if method == "importance" else \
        Evidence(model, method=method).estimate(x)
    assert torch.equal(result.log_evidence[~keep], torch.zeros(2))
    assert torch.equal(result.stderr[~keep], torch.zeros(2))
    assert bool((result.log_evidence[keep] < -1).all())


# ---------------------------------------------------------------------- other shapes
def test_pyro_module_with_pyro_sample_prior_on_a_local_latent(float64):
    W, b, x = _params()

    class PPCA(PyroModule):
        def __init__(self):
            super().__init__()
            self.W = PyroParam(W.clone())
            self.z = PyroSample(lambda self: dist.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))

        def forward(self, x):
            with pyro.plate("data", x.shape[0]):
                z = self.z  # a local latent: sampled inside the data plate
                return pyro.sample("x", dist.Normal(z @ self.W.T + b, SIGMA).to_event(1), obs=x)

    model = PPCA()
    exact = _exact(W, b, x)
    assert torch.allclose(Evidence(model)(x), exact, atol=TOL)
    assert torch.allclose(MaskedPretrainingLoss(masks="exhaustive").score(model, None, x), exact, atol=1e-8)
    assert torch.allclose(MaskedPretrainingLoss(conditionals="quadrature", masks="order").score(model, None, x), exact, atol=1e-8)


def test_pyro_module_with_pyro_sample_weight_priors_is_refused_as_global(float64):
    """PyroSample priors on weights (a Bayesian layer) are latents shared by all datapoints."""
    x = torch.randn(N, D)

    class BayesianDecoder(PyroModule):
        def __init__(self):
            super().__init__()
            self.linear = PyroModule[torch.nn.Linear](K, D)
            self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([D, K]).to_event(2))

        def forward(self, x):
            weight = self.linear.weight  # sampled once, outside the data plate
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
                return pyro.sample("x", dist.Normal(z @ weight.T + self.linear.bias, SIGMA).to_event(1), obs=x)

    model = BayesianDecoder()
    with pytest.raises(ValueError, match="(?s)'linear.weight' is outside the plate\\(s\\) 'data'.*global latent.*token_plates=\\('data',\\)"):
        MaskedPretrainingLoss().loss(model, None, x)


@pytest.mark.parametrize("engine", ["gaussian", "quadrature"])
def test_covariates_enter_the_location(float64, engine):
    W, b, x = _params()
    c = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)[:, None]
    B = torch.randn(1, D, dtype=torch.float64)

    def model(x, c):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(c @ B + z @ W.T + b, SIGMA).to_event(1), obs=x)

    exact = _exact(W, b, x - c @ B)
    got = MaskedPretrainingLoss(conditionals=engine, masks="order").score(model, None, x, c)
    assert torch.allclose(got, exact, atol=1e-8)


def test_poutine_scale_and_subsampling_multiply_each_datapoint(float64):
    W, b, x = _params()

    def model(x, idx):
        with pyro.plate("data", N, subsample=idx) as i:
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + b, SIGMA).to_event(1), obs=x[i])

    idx = torch.tensor([0, 3, 5])
    scaled = poutine.scale(model, scale=0.25)
    expected = -0.25 * N / 3 * float(_exact(W, b, x)[idx].sum())
    for engine in ["gaussian", "quadrature"]:
        got = MaskedPretrainingLoss(conditionals=engine, masks="order").loss(scaled, None, x, idx)
        assert abs(got - expected) < 1e-9, engine


@pytest.mark.parametrize("engine", ["gaussian", "quadrature"])
def test_image_to_event_3_tokens_are_the_flattened_pixels(float64, engine):
    C, H, Wd = 2, 2, 2
    Dimg = C * H * Wd
    W, b, _ = _params(D=Dimg, seed=4)
    x = torch.randn(N, C, H, Wd, dtype=torch.float64)

    def image(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            loc = (z @ W.T + b).reshape(z.shape[:-1] + (C, H, Wd))
            pyro.sample("x", dist.Normal(loc, SIGMA).to_event(3), obs=x)

    exact = _exact(W, b, x.reshape(N, Dimg))
    got = MaskedPretrainingLoss(conditionals=engine, masks="order").score(image, None, x)
    assert torch.allclose(got, exact, atol=1e-8)


def test_several_local_latent_sites_equal_the_stacked_latent(float64):
    W, b, x = _params(K=3)

    def two_sites(x):
        with pyro.plate("data", x.shape[0]):
            z1 = pyro.sample("z1", dist.Normal(torch.zeros(1, dtype=x.dtype), 1.0).to_event(1))
            z2 = pyro.sample("z2", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z1 @ W[:, :1].T + z2 @ W[:, 1:].T + b, SIGMA).to_event(1), obs=x)

    exact = _exact(W, b, x)
    assert torch.allclose(Evidence(two_sites)(x), exact, atol=TOL)
    for engine in ["gaussian", "quadrature"]:
        got = MaskedPretrainingLoss(conditionals=engine, masks="exhaustive").score(two_sites, None, x)
        assert torch.allclose(got, exact, atol=1e-8), engine


def _nested_data_plates(A=2, B=3):
    """PPCA with its N = A B datapoints in two nested plates ("a" at dim -2, "b" at dim -1):
    the model, the data ``(A, B, D)`` and the exact ``log p(x_ab)`` ``(A, B)``."""
    W, b, x = _params()

    def nested(x):
        with pyro.plate("a", A, dim=-2), pyro.plate("b", B, dim=-1):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + b, SIGMA).to_event(1), obs=x)

    return nested, x.reshape(A, B, D), _exact(W, b, x).reshape(A, B)


def test_nested_data_plates_and_extra_batch_dims(float64):
    """Datapoints in two nested plates keep their batch shape; a larger max_plate_nesting
    (extra, unused batch dims on the left) changes nothing."""
    nested, x2, exact = _nested_data_plates()
    A, B = x2.shape[:2]
    for mpn in [float("inf"), 4]:
        for engine in ["gaussian", "quadrature"]:
            loss = MaskedPretrainingLoss(conditionals=engine, masks="order", max_plate_nesting=mpn)
            got = loss.score(nested, None, x2)
            assert got.shape == (A, B)
            assert torch.allclose(got, exact, atol=1e-8), (engine, mpn)
    assert torch.allclose(Evidence(nested, max_plate_nesting=4)(x2), exact, atol=TOL)


def test_integer_placeholders_at_missing_tokens_pass_the_integer_data_check(float64):
    """Categorical tokens with -1 at the missing ones (dist.mask), validation off: the integer-data
    check scores zeros, not the data, so the placeholders do not read as a dtype error; the
    order MPT equals scipy's quad over the observed tokens."""
    from scipy import integrate, stats
    from scipy.special import log_softmax

    g = torch.Generator().manual_seed(5)
    N_, D_ = 4, 5
    x = torch.randint(0, 3, (N_, D_), generator=g)
    keep = torch.rand(N_, D_, generator=g) > 0.3
    keep[:, 0] = True
    x[~keep] = -1

    def model(x):
        with pyro.plate("data", N_):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            logits = torch.stack([z, -z, 0 * z], -1)[..., None, :].expand(z.shape + (D_, 3))
            pyro.sample("x", dist.Categorical(logits=logits).mask(keep).to_event(1), obs=x)

    def quad(row, obs):
        def f(z):
            lp = log_softmax(np.array([z, -z, 0.0]))
            return math.exp(stats.norm.logpdf(z) + lp[row[obs]].sum())

        return math.log(integrate.quad(f, -12, 12, epsabs=0, epsrel=1e-12)[0])

    truth = np.array([quad(x[i].numpy(), keep[i].numpy()) for i in range(N_)])
    pyro.enable_validation(False)
    try:
        score = MaskedPretrainingLoss(masks="order").score(model, None, x)
    finally:
        pyro.enable_validation(True)
    np.testing.assert_allclose(score.detach().numpy(), truth, rtol=0, atol=1e-8)


def test_max_plate_nesting_below_the_models_plates_is_raised_to_them(float64):
    """max_plate_nesting=1 for a model whose plates use dims -1 and -2: the engines' plate of
    points went to dim -2, inside the model's 'a': quadrature fell back to one model run per
    node with a warning that the model does not broadcast, importance refused the model.
    Now the model's own plate dims are taken (more is harmless): every engine runs vectorized
    and gives the exact value (importance within 4 of its standard errors)."""
    import warnings

    from pyro_mpt.conditionals import SlowEngineWarning

    nested, x2, exact = _nested_data_plates()
    A, B = x2.shape[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowEngineWarning)
        for engine in ["gaussian", "quadrature"]:
            got = MaskedPretrainingLoss(conditionals=engine, masks="order", max_plate_nesting=1).score(nested, None, x2)
            assert torch.allclose(got, exact, atol=1e-8), engine
        pyro.set_rng_seed(0)
        res = Evidence(nested, method="importance", num_samples=4000, max_plate_nesting=1).estimate(x2)
    assert res.log_evidence.shape == (A, B)
    assert bool(((res.log_evidence - exact).abs() <= 4 * res.stderr + 1e-12).all())


def test_latent_in_a_plate_the_observation_lacks_is_event_dims_for_the_closed_forms(float64):
    """A datapoint's latent dims in a plate of their own: the Gaussian and quadrature engines
    take the plate's dims as event dims of the latent, exactly (importance sums it per
    datapoint, see test_importance.py::test_latents_in_an_extra_plate_are_summed_per_datapoint;
    more layouts in test_latent_plates.py)."""
    W, b, x = _params()

    def model(x):
        with pyro.plate("data", x.shape[0], dim=-1):
            with pyro.plate("k", K, dim=-2):
                z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            loc = torch.einsum("dk,...kn->...nd", W, z).unsqueeze(-3) + b
            pyro.sample("x", dist.Normal(loc, SIGMA).to_event(1), obs=x)

    for engine in ["gaussian", "quadrature"]:
        score = MaskedPretrainingLoss(conditionals=engine, masks="order").score(model, None, x)
        assert torch.allclose(score.reshape(-1), _exact(W, b, x), atol=1e-8)


def test_missing_tokens_with_a_schedule_that_cannot_leave_them_out_is_refused(float64):
    class OldSchedule(RandomOrders):
        def blocks(self, n, D, *, max_elements=2**22, device=None):
            return super().blocks(n, D, max_elements=max_elements, device=device)

    W, b, x = _params()
    model = _missing_models(W, b, _mask())["dist.mask"]
    with pytest.raises(ValueError, match="missing \\(masked\\) tokens, but the mask schedule .* takes no observed= argument"):
        MaskedPretrainingLoss(masks=OldSchedule()).loss(model, None, x)
    # without missing tokens it keeps working
    twin, _ = _twin(W, b)
    assert torch.allclose(MaskedPretrainingLoss(masks=OldSchedule()).score(twin, None, x), _exact(W, b, x), atol=1e-8)


def test_schedule_whose_blocks_takes_kwargs_serves_missing_tokens():
    """A schedule forwarding **kwargs to a built-in one receives observed=."""

    class Forwarding(MaskSchedule):
        covers_all_sizes = True

        def blocks(self, n, D, **kwargs):
            return RandomOrders(2).blocks(n, D, **kwargs)

    W, b, x = _params()
    observed = torch.ones(N, D, dtype=torch.bool)
    observed[1, 2] = observed[4, :2] = False
    model, _ = _plated(W, b, obs_mask=observed)
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks=Forwarding())
    for _ in range(2):
        score = loss.score(model, None, x)
        assert float((score - _exact(W, b, x, observed)).abs().max()) < 1e-10



def test_a_schedule_written_on_maskable_tokens_serves_missing_tokens(float64):
    """The recipe of docs/architecture.md: a schedule that draws and builds its blocks through
    MaskSchedule.maskable_tokens handles missing tokens without a branch of its own. Its
    leave-one-out masks give sum_{j in O_i} log p(x_j | x_{O_i minus j}) (brute-force Gaussian
    conditioning on each observed sub-vector) and its orderings log p(x_{O_i}) (the closed form)."""
    class LeaveOneOutThenOrder(MaskSchedule):
        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            tokens = self.maskable_tokens(n, D, device, observed)
            eye = torch.eye(D, dtype=torch.bool)[:, None, :]  # (D, 1, D), shared by the batch
            one = torch.ones((D, 1), dtype=torch.long)
            yield tokens.block(eye, one, torch.ones((D, 1), dtype=torch.float64), tokens.within(eye))
            yield tokens.chain(tokens.order(2), torch.full((2, 1), 0.5, dtype=torch.float64))

    W, b, x = _params()
    m = _mask()
    model = _missing_models(W, b, m)["dist.mask"]
    S = (W @ W.T + SIGMA**2 * torch.eye(D, dtype=torch.float64)).numpy()
    loo = np.zeros(N)
    for i in range(N):
        o = np.flatnonzero(m[i].numpy())
        for j in o:
            r = o[o != j]
            xi, mu = x[i].numpy(), b.numpy()
            k = S[j, r] @ np.linalg.inv(S[np.ix_(r, r)]) if len(r) else np.zeros(0)
            mean, var = mu[j] + k @ (xi[r] - mu[r]), S[j, j] - k @ S[r, j]
            loo[i] += -0.5 * (np.log(2 * np.pi * var) + (xi[j] - mean) ** 2 / var)
    got = MaskedPretrainingLoss(conditionals="gaussian", masks=LeaveOneOutThenOrder()).score(model, None, x)
    want = torch.from_numpy(loo) + _exact(W, b, x, m)
    assert torch.allclose(got, want, atol=1e-8, rtol=0), (got, want)

# ---------------------------------------------------------------------- validating the observed site
def _shared_logit_model(likelihood):
    """One standard normal latent z per datapoint shared by its 3 tokens: Bernoulli(logits=z)
    or Poisson(rate=exp(z)); with ``guide``, an amortized guide for encode_decode."""

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(()), 1.0))
            eta = z[..., None].expand(z.shape + (3,))
            fn = dist.Bernoulli(logits=eta) if likelihood == "bernoulli" else dist.Poisson(eta.exp())
            pyro.sample("x", fn.to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(0.1 * x.sum(-1), 1.0))

    return model, guide


def _shared_logit_evidence(likelihood, row):
    """log p(x) of one datapoint by scipy quadrature over z, with Pyro's log-density formula
    (Bernoulli: x z - softplus(z); Poisson: x z - e^z - lgamma(x + 1)) evaluated as is, also
    outside the support."""
    from scipy import integrate, special, stats

    row = np.asarray(row, dtype=float)
    if likelihood == "bernoulli":
        loglik = lambda z: float((row * z - np.logaddexp(0.0, z)).sum())  # noqa: E731
    else:
        loglik = lambda z: float((row * z - np.exp(z) - special.gammaln(row + 1)).sum())  # noqa: E731
    value, _ = integrate.quad(lambda z: np.exp(loglik(z)) * stats.norm.pdf(z), -12, 12, epsabs=0, epsrel=1e-12)
    return math.log(value)


@pytest.mark.parametrize(
    "likelihood,bad,support",
    [("bernoulli", 2.0, r"Boolean\(\) of its Bernoulli"), ("poisson", 2.5, r"IntegerGreaterThan\(lower_bound=0\) of its Poisson")],
)
def test_out_of_support_data_is_refused_by_every_engine_and_evidence(float64, likelihood, bad, support):
    """A Bernoulli observation of 2 or a Poisson count of 2.5: Pyro's Trace_ELBO raises, and
    so does every pyro_mpt entry point, naming the site, the support, the value and where it
    is; the same data in the support gives the scipy value."""
    model, guide = _shared_logit_model(likelihood)
    x = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    x_bad = x.clone()
    x_bad[1, 2] = bad
    with pytest.raises(ValueError, match="to be within the support"):  # the reference: Pyro's own check
        pyro.infer.Trace_ELBO().loss(model, guide, x_bad)
    message = rf"Observed site 'x' has 1 value\(s\) outside the support {support} distribution, e.g. {bad:g} at datapoint 1, token 2"
    calls = [
        lambda: MaskedPretrainingLoss().loss(model, None, x_bad),
        lambda: MaskedPretrainingLoss(conditionals="quadrature").loss(model, None, x_bad),
        lambda: MaskedPretrainingLoss(conditionals="importance").score(model, None, x_bad),
        lambda: MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, x_bad),
        lambda: MaskedPretrainingLoss(masks="all").curve(model, None, x_bad),
        lambda: Evidence(model, method="quadrature")(x_bad),
        lambda: Evidence(model, guide, method="importance")(x_bad),
        lambda: ImportanceWeightedELBO(4).loss(model, guide, x_bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    expected = torch.tensor([_shared_logit_evidence(likelihood, row) for row in x.tolist()])
    assert torch.allclose(Evidence(model, method="quadrature", num_nodes=32)(x), expected, atol=1e-7)
    loss = MaskedPretrainingLoss(conditionals="quadrature", masks="exhaustive", num_nodes=32)
    assert torch.allclose(loss.score(model, None, x), expected, atol=1e-7)


def test_a_distribution_built_without_validation_takes_its_values_as_trace_elbo_does(float64):
    """Pyro's VAE tutorial scores gray levels in [0, 1] with ``Bernoulli(probs,
    validate_args=False)``: Trace_ELBO takes them, pyro_mpt refused them as outside the
    support (only the global pyro.validation_enabled(False) got past). A distribution built
    with validate_args=False is not checked: Evidence, the exhaustive score and the loss equal
    scipy's quadrature of Pyro's formula x z - softplus(z), with validation on."""
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(()), 1.0))
            probs = torch.sigmoid(z[..., None].expand(z.shape + (3,)))
            pyro.sample("x", dist.Bernoulli(probs, validate_args=False).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(0.1 * x.sum(-1), 1.0))

    x = torch.tensor([[0.25, 1.0, 0.5], [0.0, 0.75, 0.125]])
    expected = torch.tensor([_shared_logit_evidence("bernoulli", row) for row in x.tolist()])
    with pyro.validation_enabled(True):
        pyro.infer.Trace_ELBO().loss(model, guide, x)  # the reference takes them
        assert torch.allclose(Evidence(model, method="quadrature", num_nodes=32)(x), expected, atol=1e-7)
        loss = MaskedPretrainingLoss(conditionals="quadrature", masks="exhaustive", num_nodes=32)
        assert torch.allclose(loss.score(model, None, x), expected, atol=1e-7)
        assert abs(loss.loss(model, None, x) + float(expected.sum())) < 1e-6
        # a Bernoulli built with validation keeps the check
        strict = lambda x: model_strict(x)  # noqa: E731

        def model_strict(x):
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(torch.zeros(()), 1.0))
                pyro.sample("x", dist.Bernoulli(logits=z[..., None].expand(z.shape + (3,))).to_event(1), obs=x)

        with pytest.raises(ValueError, match="outside the support Boolean"):
            MaskedPretrainingLoss().loss(strict, None, x)


def test_out_of_support_message_names_per_token_bounds_at_the_offending_token(float64):
    # A Binomial with a total count per token has a support whose bounds are
    # tensors: the message printed them whole (a 5 x 4 tensor here, thousands of
    # lines for a real data set). It now names the bound at the offending token,
    # checked against the total count written here.
    total = torch.tensor([3.0, 5.0, 8.0, 2.0])

    def model(x):
        with pyro.plate("data", x.shape[0]):
            p = pyro.sample("p", dist.Beta(2.0, 3.0))
            pyro.sample("x", dist.Binomial(total, p.unsqueeze(-1).expand(p.shape + (4,))).to_event(1), obs=x)

    x = torch.tensor([[1.0, 2.0, 3.0, 1.0]] * 5)
    x[3, 1] = 6.0  # above its total count of 5
    with pytest.raises(ValueError) as info:
        MaskedPretrainingLoss().loss(model, None, x)
    message = str(info.value)
    assert "e.g. 6 at datapoint 3, token 1, where it is IntegerInterval(lower_bound=0, upper_bound=5);" in message
    assert "tensor" not in message and len(message) < 700


def test_validation_off_turns_the_per_step_checks_off(float64):
    """Under pyro.validation_enabled(False), as in Pyro, the data is not checked: the
    Bernoulli observation of 2 is scored with Pyro's formula x z - softplus(z) (scipy
    reference), a NaN reaches the loss (Pyro's NaN warning), and a scale that varies over the
    tokens is not refused."""
    model, _ = _shared_logit_model("bernoulli")
    x = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]])
    with pyro.validation_enabled(False):
        value = Evidence(model, method="quadrature", num_nodes=32)(x)
    expected = torch.tensor([_shared_logit_evidence("bernoulli", row) for row in x.tolist()])
    assert torch.allclose(value, expected, atol=1e-7)

    W, b, xg = _params()
    twin, _ = _twin(W, b)
    xg = xg.clone()
    xg[0, 1] = math.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        MaskedPretrainingLoss(conditionals="gaussian").loss(twin, None, xg)
    with pyro.validation_enabled(False), pytest.warns(UserWarning, match="Encountered NaN"):
        assert math.isnan(MaskedPretrainingLoss(conditionals="gaussian").loss(twin, None, xg))

    def scaled(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", x.shape[1], dim=-1), poutine.scale(scale=torch.arange(1.0, x.shape[1] + 1)):
                pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    x3 = torch.randn(4, 3)
    with pytest.raises(ValueError, match="scale that varies over its tokens"):
        MaskedPretrainingLoss().loss(scaled, None, x3)
    with pyro.validation_enabled(False):
        assert math.isfinite(MaskedPretrainingLoss().loss(scaled, None, x3))


def _x1_x2_model():
    """z ~ N(0, I_2) per datapoint; x1 | z ~ N(A z + b, 0.5^2 I_3) and x2 | z ~ N(c . z, 0.3^2)."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(3, 2, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    c = torch.randn(2, generator=g, dtype=torch.float64)

    def model(x1, x2):
        with pyro.plate("data", x1.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=x1.dtype), 1.0).to_event(1))
            pyro.sample("x1", dist.Normal(z @ A.T + b, 0.5).to_event(1), obs=x1)
            pyro.sample("x2", dist.Normal((z @ c)[..., None], 0.3).to_event(1), obs=x2)

    x1 = torch.randn(5, 3, generator=g, dtype=torch.float64)
    x2 = torch.randn(5, 1, generator=g, dtype=torch.float64)
    return model, (x1, x2), (A.numpy(), b.numpy(), c.numpy())


def test_other_observed_site_is_refused_unless_dropped_and_then_gives_log_p_x1(float64):
    """obs_site='x1' beside an observed x2: refused, naming x2 and extra_sites="drop"; with
    it, every path returns log p(x1) (x2 integrated out), scipy's
    log N(x1; b, A A^T + 0.25 I), which differs from log p(x1 | x2) here by more than 0.1."""
    from scipy import stats

    model, (x1, x2), (A, b, c) = _x1_x2_model()
    message = r"would drop observed site\(s\) 'x2' \(integrated out: the result is log p\(x1\), not log p\(x1 \| x2\)\)\. Pass extra_sites=\"drop\""
    with pytest.raises(ValueError, match=message):
        Evidence(model, obs_site="x1")(x1, x2)
    with pytest.raises(ValueError, match=message):
        MaskedPretrainingLoss(obs_site="x1").loss(model, None, x1, x2)
    S = A @ A.T + 0.25 * np.eye(3)
    expected = torch.from_numpy(stats.multivariate_normal(b, S).logpdf(x1.numpy()))
    # the conditional, for contrast: log p(x1, x2) - log p(x2)
    joint = stats.multivariate_normal(
        np.r_[b, 0.0], np.block([[S, (A @ c)[:, None]], [(A @ c)[None], np.array([[c @ c + 0.09]])]])
    ).logpdf(np.c_[x1.numpy(), x2.numpy()])
    conditional = joint - stats.norm(0.0, math.sqrt(c @ c + 0.09)).logpdf(x2.numpy()[:, 0])
    assert float(np.abs(conditional - expected.numpy()).max()) > 0.1
    drop = dict(obs_site="x1", extra_sites="drop")
    assert torch.allclose(Evidence(model, **drop)(x1, x2), expected, atol=1e-10, rtol=0)
    assert torch.allclose(Evidence(model, method="quadrature", **drop)(x1, x2), expected, atol=1e-8, rtol=0)
    score = MaskedPretrainingLoss(masks="exhaustive", conditionals="gaussian", **drop).score(model, None, x1, x2)
    assert torch.allclose(score, expected, atol=1e-10, rtol=0)


def test_sparse_gp_vfe_factor_is_refused_unless_dropped(float64):
    """Pyro's SparseGPRegression(approx="VFE") adds its trace term with pyro.factor: refused,
    naming the factor; with extra_sites="drop" the evidence is the DTC value
    log N(y; 0, Q_ff + noise I), Q_ff = K_fu (K_uu + jitter I)^-1 K_uf (numpy), which is the
    VFE bound plus tr(K_ff - Q_ff) / (2 noise) (2.24 nats here)."""
    import pyro.contrib.gp as gp
    from scipy import stats

    g = torch.Generator().manual_seed(0)
    X = 5 * torch.rand(20, generator=g, dtype=torch.float64)
    y = torch.sin(X) + 0.3 * torch.randn(20, generator=g, dtype=torch.float64)
    Xu = torch.linspace(0.0, 5.0, 5, dtype=torch.float64)
    noise = 0.1
    sgpr = gp.models.SparseGPRegression(X, y, gp.kernels.RBF(1), Xu, noise=torch.tensor(noise), approx="VFE")
    with pytest.raises(ValueError, match=r"would drop pyro.factor site\(s\) 'trace_term' .* Pass extra_sites=\"drop\""):
        Evidence(sgpr.model)()
    with pytest.raises(ValueError, match=r"pyro.factor site\(s\) 'trace_term'"):
        MaskedPretrainingLoss().loss(sgpr.model, sgpr.guide)

    rbf = lambda a, b: np.exp(-0.5 * (a[:, None] - b[None, :]) ** 2)  # noqa: E731  (variance 1, lengthscale 1)
    Xn, Xun, yn = X.numpy(), Xu.numpy(), y.numpy()
    Kuf = rbf(Xun, Xn)
    Qff = Kuf.T @ np.linalg.solve(rbf(Xun, Xun) + sgpr.jitter * np.eye(5), Kuf)
    dtc = stats.multivariate_normal(np.zeros(20), Qff + noise * np.eye(20)).logpdf(yn)
    trace_term = (1.0 - np.diag(Qff)).sum() / noise / 2
    assert trace_term > 2  # what dropping the factor changes
    value = Evidence(sgpr.model, extra_sites="drop")()
    assert value.shape == () and abs(float(value) - dtc) < 1e-8
    # chain-rule orderings are exact with closed-form conditionals
    score = MaskedPretrainingLoss(masks="order", conditionals="gaussian", extra_sites="drop").score(sgpr.model, None)
    assert abs(float(score) - dtc) < 1e-8
    # the VFE bound with the factor (Pyro's own trace) is the DTC value minus the trace term
    model_trace = poutine.trace(sgpr.model).get_trace()
    assert abs(float(model_trace.log_prob_sum()) - (dtc - trace_term)) < 1e-8


def test_raw_errors_become_messages_naming_the_site_and_the_fix(float64):
    """float16 models, empty batches and data with the wrong number of tokens ended in errors
    from inside torch or Pyro ("cholesky_cpu" not implemented for 'Half', ZeroDivisionError,
    a broadcast error); each entry point now names the site (or plate) and the fix. float16
    data in a float64 model computes in float64: it equals the float64 value of the rounded
    data."""
    from models import make_ppca

    model16, x16, _ = make_ppca(3, 1, 4, dtype=torch.float16)
    for call in [
        lambda: MaskedPretrainingLoss(conditionals="gaussian").loss(model16, None, x16),
        lambda: MaskedPretrainingLoss(conditionals="quadrature").loss(model16, None, x16),
        lambda: Evidence(model16)(x16),
        lambda: Evidence(model16, method="importance")(x16),
    ]:
        with pytest.raises(ValueError, match=r"Observed site 'x' computes in float16 .* needs float32 or float64.* x.double\(\)"):
            call()
    pyro.clear_param_store()
    model_bf, x_bf, _ = make_ppca(3, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"computes in bfloat16"):
        MaskedPretrainingLoss().loss(model_bf, None, x_bf)
    pyro.clear_param_store()
    model, x, exact = make_ppca(3, 1, 4)
    rounded = x.half()
    assert torch.allclose(Evidence(model)(rounded), exact(rounded.double()), atol=1e-10, rtol=0)

    empty = r"pyro.plate 'data' has size 0: the batch is empty, .* Pass at least one datapoint"
    for call in [
        lambda: MaskedPretrainingLoss().loss(model, None, x[:0]),
        lambda: MaskedPretrainingLoss(conditionals="quadrature").score(model, None, x[:0]),
        lambda: Evidence(model, method="importance")(x[:0]),
        lambda: ImportanceWeightedELBO(4).loss(model, lambda x: None, x[:0]),
    ]:
        with pytest.raises(ValueError, match=empty):
            call()

    wide = torch.randn(4, 5, dtype=torch.float64)
    shape = (
        r"Observed site 'x' got data of shape \(4, 5\), but its Normal distribution has batch shape \(4,\) "
        r"and event shape \(3,\): the data's last 1 dim\(s\) must equal \(3,\) .* Pass data with the "
        r"model's number of tokens per datapoint"
    )
    for call in [
        lambda: MaskedPretrainingLoss().loss(model, None, wide),
        lambda: MaskedPretrainingLoss(conditionals="importance").loss(model, None, wide),
        lambda: Evidence(model)(wide),
        lambda: Evidence(model, method="quadrature")(wide),
    ]:
        with pytest.raises(ValueError, match=shape):
            call()


def test_scalar_observation_with_a_local_latent_is_one_token_per_datapoint():
    """A scalar observation whose plate holds a latent per element (Pyro's 1-D GMM
    tutorial; before: refused, "has no event dims, so it has no tokens") has one token per
    datapoint, so every schedule gives log p(x_i): the GMM by enumeration against scipy's
    log-sum-exp, a Poisson-lognormal by quadrature against scipy.integrate.quad, the
    gradient of a Normal-Normal model against its closed form. Without a latent the
    plate stays ambiguous and is refused (test_loss.py::test_tokens_without_event_dims_are_refused)."""
    from scipy import integrate
    from scipy.special import logsumexp
    from scipy.stats import norm, poisson

    x = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0], dtype=torch.float64)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    locs = torch.tensor([0.5, 11.0], dtype=torch.float64)

    def gmm(data):
        with pyro.plate("data", len(data)):
            a = pyro.sample("assignment", dist.Categorical(w), infer={"enumerate": "parallel"})
            pyro.sample("obs", dist.Normal(locs[a], 1.5), obs=data)

    ref = logsumexp(norm.logpdf(x.numpy()[:, None], locs.numpy(), 1.5) + np.log(w.numpy()), axis=1)
    assert np.allclose(Evidence(gmm)(x).numpy(), ref, atol=1e-10)
    assert np.allclose(Evidence(gmm)(x[:1]).numpy(), ref[:1], atol=1e-10)  # a batch of one datapoint
    for masks in ["exhaustive", "uniform", "pll"]:
        assert np.allclose(MaskedPretrainingLoss(masks=masks).score(gmm, None, x).numpy(), ref, atol=1e-10)

    counts = torch.tensor([0.0, 2.0, 5.0, 1.0], dtype=torch.float64)

    def poisson_lognormal(data):
        with pyro.plate("data", len(data)):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.5, dtype=torch.float64), 0.8))
            pyro.sample("obs", dist.Poisson(torch.exp(z)), obs=data)

    ref = [math.log(integrate.quad(lambda z: math.exp(norm.logpdf(z, 0.5, 0.8) + poisson.logpmf(c, math.exp(z))),
                                   -10, 10, epsabs=0, epsrel=1e-12, limit=200)[0]) for c in counts.tolist()]
    got = MaskedPretrainingLoss(masks="all", conditionals="quadrature").score(poisson_lognormal, None, counts)
    assert np.allclose(got.numpy(), ref, atol=1e-9)

    y = torch.tensor([-0.3, 1.2, 2.5], dtype=torch.float64)

    def normal_normal(data):
        s = pyro.param("s", torch.tensor(0.7, dtype=torch.float64), constraint=dist.constraints.positive)
        with pyro.plate("data", len(data)):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.5, dtype=torch.float64), 0.8))
            pyro.sample("obs", dist.Normal(2 * z, s), obs=data)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="order").differentiable_loss(normal_normal, None, y)
    loss.backward()
    s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    ref = -torch.distributions.Normal(1.0, (4 * 0.64 + s**2).sqrt()).log_prob(y).sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-10
    # the gradient with respect to the unconstrained log s: d/dlog s = s d/ds
    assert abs(pyro.param("s").unconstrained().grad.item() - 0.7 * s.grad.item()) < 1e-10


def test_float32_parameters_with_float64_data_are_scored_as_pyro_scores_them():
    """Data from numpy (float64) with torch's default float32 parameters: Pyro's log-densities
    promote to float64, and so must the engines (before: quadrature failed in a batched
    product, "expected scalar type Float but found Double"; the Gaussian engine fed float64
    latents to ``z @ W.T`` with a float32 ``W``). Values against the float64 model within
    float32 rounding, and gradients reach the float32 parameters."""
    g = torch.Generator().manual_seed(3)
    counts = torch.poisson(2 * torch.ones(5, 3, dtype=torch.float64), generator=g)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)

    def poisson_factor(dtype):
        def model(data):
            a = pyro.param("a", torch.tensor([0.5, 1.0, -0.7], dtype=dtype))
            with pyro.plate("data", len(data)):
                z = pyro.sample("z", dist.Normal(torch.tensor(0.5, dtype=dtype), 0.8))
                pyro.sample("obs", dist.Poisson(torch.exp(a * z.unsqueeze(-1))).to_event(1), obs=data)
        return model

    def ppca(dtype):
        def model(data):
            W = pyro.param("W", torch.tensor([[0.0, 3.0], [1.0, 1.0], [2.0, -1.0]], dtype=dtype))
            with pyro.plate("data", len(data)):
                z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
                pyro.sample("obs", dist.Normal(z @ W.T, 0.5).to_event(1), obs=data)
        return model

    eps = torch.finfo(torch.float32).eps
    for make, data, engine in [(poisson_factor, counts, "quadrature"), (ppca, x, "gaussian")]:
        for masks in ["exhaustive", "all", "order"]:
            pyro.clear_param_store()
            ref = MaskedPretrainingLoss(masks=masks, conditionals=engine).score(make(torch.float64), None, data)
            pyro.clear_param_store()
            loss = MaskedPretrainingLoss(masks=masks, conditionals=engine)
            got = loss.score(make(torch.float32), None, data)
            assert got.dtype == torch.float64
            if masks != "all":  # "all" draws its masks at random
                assert torch.allclose(got.detach(), ref.detach(), rtol=0, atol=100 * eps * ref.abs().max().item())
            (-got.sum()).backward()
            grads = [p.grad for p in pyro.get_param_store().values()]
            assert all(g is not None and g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads)


def test_exact_evidence_of_a_model_without_latents_is_its_log_likelihood():
    """A GLM (no latent): Evidence(method="exact") is the log-likelihood (before: refused,
    "needs a Gaussian marginal, discrete latents only, or a DiscreteHMM"), against scipy,
    with missing tokens left out."""
    from scipy.stats import poisson

    x = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, 5.0]], dtype=torch.float64)
    rate = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    observed = torch.tensor([[True, False, True], [True, True, True]])

    def glm(data):
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Poisson(rate).mask(observed).to_event(1), obs=data)

    ref = (poisson.logpmf(x.numpy(), rate.numpy()) * observed.numpy()).sum(-1)
    assert np.allclose(Evidence(glm)(x).numpy(), ref, atol=1e-12)


def test_integer_data_is_refused_only_where_log_prob_cannot_score_it(float64):
    """int64 or bool 0/1 data for a Bernoulli observation: torch's log_prob raises a dtype error
    (Trace_ELBO too), which came out of an engine naming no site after a misleading
    'running it once per node' warning; now refused up front, naming the site, the dtype and
    x.to(torch.float64). The float data then equals scipy's quad, and integer counts for a
    Poisson observation, which log_prob scores, are served and equal it too."""
    from scipy import integrate, stats

    g = torch.Generator().manual_seed(0)
    xb = (torch.rand(4, 5, generator=g, dtype=torch.float64) < 0.5).long()
    xp = torch.poisson(torch.full((4, 5), 2.0, dtype=torch.float64), generator=g).long()

    def model(x, family):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            eta = (0.5 + 0.5 * z)[..., None].expand(z.shape + (5,))
            obs = dist.Bernoulli(logits=eta) if family == "bernoulli" else dist.Poisson(eta.exp())
            pyro.sample("x", obs.to_event(1), obs=x)

    def quad(xi, family):
        def lik(z):
            eta = 0.5 + 0.5 * z
            if family == "bernoulli":
                return stats.bernoulli(1 / (1 + np.exp(-eta))).logpmf(xi).sum()
            return stats.poisson(np.exp(eta)).logpmf(xi).sum()

        f = lambda z: np.exp(stats.norm.logpdf(z) + lik(z))
        return math.log(integrate.quad(f, -12, 12, epsabs=0, epsrel=1e-12)[0])

    for data in (xb, xb.bool()):
        with pytest.raises(ValueError, match=r"Observed site 'x' holds (int64|bool) data, which its Bernoulli .*x\.to\(torch\.float64\)"):
            MaskedPretrainingLoss(masks="order").score(model, None, data, "bernoulli")
        with pytest.raises(ValueError, match="holds .* data"):
            Evidence(model, method="quadrature")(data, "bernoulli")
    for data, family in ((xb.double(), "bernoulli"), (xp, "poisson")):
        truth = np.array([quad(row.numpy(), family) for row in data])
        score = MaskedPretrainingLoss(masks="order").score(model, None, data, family)
        np.testing.assert_allclose(score.detach().numpy(), truth, rtol=0, atol=1e-8)


def test_poutine_reparam_models_are_served_as_their_originals(float64):
    # poutine.reparam (LocScaleReparam, TransformReparam: the non-centred
    # parameterization of hierarchical models) records the original latent as an
    # observed Delta(...).mask(False), as Pyro simulates pyro.deterministic. It
    # was read as a second observed site and every estimate refused the model
    # ("The model observes several sites ('z', 'x')"). References: scipy's
    # Gaussian marginal; for the Poisson-lognormal model scipy's quad.
    from scipy.integrate import quad
    from scipy.stats import multivariate_normal, norm, poisson
    from pyro.infer.reparam import LocScaleReparam, TransformReparam

    g = torch.Generator().manual_seed(4)
    N, D, K, s = 6, 5, 2, 0.7
    W = torch.randn(D, K, generator=g)
    m = torch.randn(K, generator=g)
    x = torch.randn(N, K, generator=g) @ W.T + s * torch.randn(N, D, generator=g)

    def ppca(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(m, 2.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    ref = multivariate_normal((W @ m).numpy(), 4 * (W @ W.T).numpy() + s**2 * np.eye(D)).logpdf(x.numpy())
    for centered in (0.0, 0.5):
        model = poutine.reparam(ppca, config={"z": LocScaleReparam(centered)})
        assert np.abs(Evidence(model)(x).detach().numpy() - ref).max() < 1e-8
        for masks in ["exhaustive", "order"]:
            score = MaskedPretrainingLoss(masks=masks).score(model, None, x)  # "auto": the Gaussian engine
            assert np.abs(score.detach().numpy() - ref).max() < 1e-8

    counts = torch.poisson(torch.full((N, D), 2.0), generator=g)

    def poisson_lognormal(x):
        with pyro.plate("data", x.shape[0]):
            rate = pyro.sample("rate", dist.LogNormal(torch.tensor(0.3), 0.5))
            pyro.sample("x", dist.Poisson(rate.unsqueeze(-1).expand(rate.shape + (D,))).to_event(1), obs=x)

    model = poutine.reparam(poisson_lognormal, config={"rate": TransformReparam()})  # a Normal 'rate_base'

    def log_marginal(row):
        f = lambda u: np.exp(norm.logpdf(u, 0.3, 0.5) + poisson.logpmf(row, np.exp(u)).sum() - top)  # noqa: E731
        us = np.linspace(-4, 4, 2001)
        top = max(norm.logpdf(u, 0.3, 0.5) + poisson.logpmf(row, np.exp(u)).sum() for u in us)
        return np.log(quad(f, -4, 4, epsabs=0, epsrel=1e-13, limit=200)[0]) + top

    ref = np.array([log_marginal(row) for row in counts.numpy()])
    for fn in (model, poisson_lognormal):
        score = MaskedPretrainingLoss(masks="order").score(fn, None, counts)  # "auto": quadrature
        assert np.abs(score.detach().numpy() - ref).max() < 1e-8


def test_a_latent_fixed_by_poutine_condition_is_a_given_value(float64):
    # poutine.condition(model, {"z": z0}) makes the latent z an observed site
    # sampled before x. The refusal said the result would be "log p(x), not
    # log p(x | z)" (z integrated out); it is the reverse: the model reads z0 as
    # given, and extra_sites="drop" gives log p(x | z = z0) with the other latent
    # integrated out. Reference: scipy's N(x; W z0, s^2 I + 1 1^T).
    from scipy.stats import multivariate_normal

    g = torch.Generator().manual_seed(6)
    N, D, K, s = 6, 5, 2, 0.7
    W = torch.randn(D, K, generator=g)
    x = torch.randn(N, D, generator=g)
    z0 = torch.randn(N, K, generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            shift = pyro.sample("shift", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z @ W.T + shift.unsqueeze(-1), s).to_event(1), obs=x)

    conditioned = poutine.condition(model, data={"z": z0})
    with pytest.raises(ValueError, match=r"drop the log-density of observed site\(s\) 'z', sampled before 'x' .*log p\(x \| z\) when z depend"):
        Evidence(conditioned, obs_site="x")(x)
    cov = s**2 * np.eye(D) + np.ones((D, D))
    ref = np.array([multivariate_normal((W @ z0[i]).numpy(), cov).logpdf(x[i].numpy()) for i in range(N)])
    drop = dict(obs_site="x", extra_sites="drop")
    assert np.abs(Evidence(conditioned, **drop)(x).detach().numpy() - ref).max() < 1e-8
    score = MaskedPretrainingLoss(masks="order", **drop).score(conditioned, None, x)
    assert np.abs(score.detach().numpy() - ref).max() < 1e-8


def test_observations_in_a_python_loop_point_to_one_site_in_a_plate(float64):
    """Pyro's SVI tutorial's coin samples obs_0..obs_9 in a loop: the refusal said to pick one
    with obs_site=, which would score one toss. It now says to write one site in a plate with
    token_plates=("data",); written so, the evidence is the Beta-Binomial closed form."""
    from scipy.special import betaln

    data = torch.cat([torch.ones(6), torch.zeros(4)])

    def coin_loop(data):
        f = pyro.sample("latent_fairness", dist.Beta(10.0, 10.0))
        for i in range(len(data)):
            pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])

    def coin(data):
        f = pyro.sample("latent_fairness", dist.Beta(10.0, 10.0))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Bernoulli(f), obs=data)

    with pytest.raises(ValueError, match=r"look like one observation written in a Python loop.*token_plates=\('data',\)"):
        MaskedPretrainingLoss().loss(coin_loop, None, data)

    def two_views(data):
        f = pyro.sample("latent_fairness", dist.Beta(10.0, 10.0))
        with pyro.plate("data", len(data)):
            pyro.sample("x1", dist.Bernoulli(f), obs=data)
            pyro.sample("x2", dist.Bernoulli(f), obs=data)

    with pytest.raises(ValueError, match=r"say which one holds the tokens with obs_site="):
        MaskedPretrainingLoss().loss(two_views, None, data)
    ref = betaln(16, 14) - betaln(10, 10)
    assert abs(float(Evidence(coin, method="quadrature", token_plates=("data",))(data)) - ref) < 1e-8
    assert abs(MaskedPretrainingLoss(masks="order", token_plates=("data",)).loss(coin, None, data) + ref) < 1e-8


def test_missing_values_of_another_observed_site_are_no_latents(float64):
    """x and y share z; x has missing tokens (obs_mask=), so Pyro draws them in a latent
    'x_unobserved'. Scoring y (obs_site="y", extra_sites="drop") refused that draw as a masked
    latent, with every engine and schedule, while Evidence gave log p(y); and quadrature
    counted its dims as latent dims (K = 5 for a 1-D z). Now every estimate is log p(y_i):
    scipy's multivariate normal of y's marginal, to 1e-10 (exact engines), and the
    quadrature engine serves the 1-D z."""
    g = torch.Generator().manual_seed(14)
    n, Dx, Dy = 5, 4, 3
    W, V = torch.randn(Dx, 1, generator=g), torch.randn(Dy, 1, generator=g)
    z = torch.randn(n, 1, generator=g)
    x = z @ W.T + 0.6 * torch.randn(n, Dx, generator=g)
    y = z @ V.T + 0.4 * torch.randn(n, Dy, generator=g)
    mx = torch.rand(n, Dx, generator=g) > 0.3

    def model(x, y, mx):
        with pyro.plate("data", n, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            with pyro.plate("tx", Dx, dim=-1):
                pyro.sample("x", dist.Normal((z * W.T).sum(-1), 0.6), obs=x, obs_mask=mx)
            pyro.sample("y", dist.Normal((z[..., None, :] * V).sum(-1), 0.4).to_event(1), obs=y.unsqueeze(-2))

    ref = scipy.stats.multivariate_normal(np.zeros(Dy), (V @ V.T).numpy() + 0.16 * np.eye(Dy)).logpdf(y.numpy())
    kw = dict(obs_site="y", extra_sites="drop")
    assert np.abs(Evidence(model, **kw)(x, y, mx).detach().numpy().reshape(-1) - ref).max() < 1e-10
    for conditionals in ("auto", "gaussian", "quadrature"):
        score = MaskedPretrainingLoss(conditionals=conditionals, masks="order", **kw).score(model, None, x, y, mx)
        tol = 1e-10 if conditionals != "quadrature" else 1e-6
        assert np.abs(score.detach().numpy().reshape(-1) - ref).max() < tol
    quad = Evidence(model, method="quadrature", **kw)(x, y, mx).detach().numpy().reshape(-1)
    assert np.abs(quad - ref).max() < 1e-6


def test_autoguides_of_a_model_with_missing_tokens_are_proposals(float64):
    """Pyro's autoguides of a PPCA with obs_mask= hold a site for Pyro's draw of the missing
    values ('x_unobserved'); as importance proposals they were refused ("not a latent of the
    model; build the autoguide from this model"), and Evidence refused any guide with missing
    tokens ("runs the guide on the data"), which an autoguide does not. Now q is the guide's
    marginal over z: AutoNormal, AutoDiagonalNormal and AutoMultivariateNormal fitted by
    Trace_ELBO give Evidence and the importance engine's "order" score within 5 standard errors
    (Evidence's own) and 0.1 nats of the exact log p(x_obs)."""
    from pyro.infer.autoguide import AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal

    from models import fit_guide

    g = torch.Generator().manual_seed(3)
    W0, b0 = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    x = torch.randn(6, K, generator=g) @ W0.T + b0 + SIGMA * torch.randn(6, D, generator=g)
    m = torch.rand(6, D, generator=g) > 0.35
    m[:, 0] = True
    model, _ = _plated(W0, b0, obs_mask=m)
    exact = Evidence(model)(x).detach()
    for make in (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = fit_guide(model, make(model), x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = Evidence(model, guide, method="importance", num_samples=2000).estimate(x)
            score = MaskedPretrainingLoss(conditionals="importance", proposal="guide", num_samples=2000,
                                          masks="order").score(model, guide, x).detach()
        value, stderr = est.log_evidence.detach(), est.stderr.detach()
        assert ((value - exact).abs() <= 5 * stderr + 1e-3).all() and (value - exact).abs().max() < 0.1, make.__name__
        assert (score - exact).abs().max() < 0.1, make.__name__


def test_nan_at_a_token_an_all_true_obs_mask_marks_observed_is_named_as_such(float64):
    """obs_mask= of all True and a NaN in the data: the message told the user to mark the NaN
    missing with obs_mask=, which they had passed; it says the NaN is at an observed token."""
    g = torch.Generator().manual_seed(2)
    W, b = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    x = torch.randn(N, D, generator=g)
    x[1, 2] = math.nan
    model, _ = _plated(W, b, obs_mask=torch.ones(N, D, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"contains 1 NaN or infinite value\(s\) at observed tokens; remove or impute them") as info:
        MaskedPretrainingLoss(masks="order").score(model, None, x)
    assert "obs_mask=" not in str(info.value)


def test_missing_value_draws_the_model_reads_stay_latents(float64):
    """y reads the values Pyro fills in for x's missing tokens (y ~ N(b z + c mean(x), s)): those
    draws are latents of log p(y), not left out (leaving them out gave random numbers, up to
    1.1 nats off). Evidence(method="exact") integrates them: scipy's multivariate normal of y's
    marginal, x's own term left out (extra_sites="drop"), its observed tokens constants in y's mean and
    its missing ones integrated with z."""
    g = torch.Generator().manual_seed(4)
    n, Dx = 5, 4
    x = torch.randn(n, Dx, generator=g)
    mx = torch.tensor([[True, False, True, False]] * n)
    b, c = 0.8, 0.6

    def model(x, y, mx):
        with pyro.plate("data", n, dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            with pyro.plate("tx", Dx, dim=-1):
                filled = pyro.sample("x", dist.Normal(z[..., 0], 0.5), obs=x, obs_mask=mx)
            loc = b * z[..., 0] + c * filled.mean(-1, keepdim=True)
            pyro.sample("y", dist.Normal(loc.unsqueeze(-1).expand(loc.shape + (2,)), 0.5).to_event(1),
                        obs=y.unsqueeze(-2))

    y = torch.randn(n, 2, generator=g)
    # y_k = b z + c (sum_obs x + sum_miss u) / Dx + e_k, u_j = z + 0.5 eps_j, given the observed x
    ref = []
    for i in range(n):
        obs = x[i][mx[i]].numpy()
        k = int((~mx[i]).sum())
        # x's own term is dropped (extra_sites="drop"), its observed tokens read as constants in y's
        # mean: z and x's missing tokens u come from their prior
        mz, vz = 0.0, 1.0
        a = b + c * k / Dx  # the coefficient of z in y's mean
        mean = a * mz + c * obs.sum() / Dx
        var = a**2 * vz + (c / Dx) ** 2 * k * 0.25
        ref.append(scipy.stats.multivariate_normal(np.full(2, mean), var * np.ones((2, 2)) + 0.25 * np.eye(2)).logpdf(y[i].numpy()))
    value = Evidence(model, obs_site="y", extra_sites="drop")(x, y, mx).detach().numpy().reshape(-1)
    assert np.abs(value - np.array(ref)).max() < 1e-8


def test_autoguide_proposals_with_missing_value_draws_before_the_latents(float64):
    """An obs_mask site sampled before the latent z puts its missing-value draws first in a joint
    autoguide's vector; the proposal's per-datapoint coordinates were counted in the full vector
    but read from the vector without those draws (IndexError), and an AutoGuideList part that holds
    only them failed in torch.cat. Evidence and the importance engine now use q's marginal over z:
    within 0.1 nats of the exact log p(y)."""
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoMultivariateNormal, AutoNormal
    from pyro.optim import Adam

    g = torch.Generator().manual_seed(7)
    n = 4
    y, w = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
    mw = torch.tensor([[True, False]] * n)

    def model(y, w, mw):
        with pyro.plate("data", n, dim=-2):
            with pyro.plate("tw", 2, dim=-1):
                pyro.sample("w", dist.Normal(0.0, 1.0), obs=w, obs_mask=mw)
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            with pyro.plate("ty", 3, dim=-1):
                pyro.sample("y", dist.Normal(z[..., 0, :], 0.5), obs=y)

    kw = dict(obs_site="y", extra_sites="drop")
    exact = scipy.stats.multivariate_normal(np.zeros(3), np.ones((3, 3)) + 0.25 * np.eye(3)).logpdf(y.numpy())

    def listed():
        guide = AutoGuideList(model)
        guide.append(AutoNormal(poutine.block(model, expose=["z"])))
        guide.append(AutoDiagonalNormal(poutine.block(model, hide=["z"])))
        return guide

    for make in (AutoDiagonalNormal, AutoMultivariateNormal, listed):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = make(model) if make is not listed else listed()
        svi = SVI(model, guide, Adam({"lr": 0.05}), Trace_ELBO())
        for _ in range(200):
            svi.step(y, w, mw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ev = Evidence(model, guide, method="importance", num_samples=4000, **kw)(y, w, mw).detach().numpy().reshape(-1)
            sc = MaskedPretrainingLoss(conditionals="importance", proposal="guide", masks="order", num_samples=2000,
                                       **kw).score(model, guide, y, w, mw).detach().numpy().reshape(-1)
        assert np.abs(ev - exact).max() < 0.1 and np.abs(sc - exact).max() < 0.1, getattr(make, "__name__", "list")


def test_plate_roles_follow_the_data_sets_sizes_not_the_minibatchs(float64):
    """A plate subsampled to one element is still a plate of N: a latent outside it is a global
    latent (with subsample_size=1 it was integrated per datapoint, silently: 43.41 against the
    model's 38.04, every estimate), and a datapoint's latent inside it keeps its role (the loss
    is N times the minibatch's log p, against scipy). A scalar observation in two plates with
    latents that do not tell their roles apart is refused at every size (a switch per token
    alone was refused at 2 x 3 and read as 3 datapoints at 1 x 3 and 3 x 1)."""
    N, D = 5, 3
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def shared_mean(x):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        with pyro.plate("data", N, subsample_size=1) as i:
            u = pyro.sample("u", dist.Normal(mu, 0.5))
            pyro.sample("x", dist.Normal(u.unsqueeze(-1).expand(1, D), 0.3).to_event(1), obs=x[i])

    for run in (lambda: Evidence(shared_mean)(x), lambda: MaskedPretrainingLoss(masks="order").loss(shared_mean, None, x)):
        with pytest.raises(ValueError, match="Latent site 'mu' is outside the plate"):
            run()

    def own_mean(x):
        with pyro.plate("data", N, subsample_size=1) as i:
            u = pyro.sample("u", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            pyro.sample("x", dist.Normal(u.unsqueeze(-1).expand(1, D), 0.3).to_event(1), obs=x[i])

    cov = 0.09 * np.eye(D) + 1.0
    for seed in range(3):
        pyro.set_rng_seed(seed)
        picked = int(poutine.trace(own_mean).get_trace(x).nodes["data"]["value"])
        want = -N * scipy.stats.multivariate_normal(np.zeros(D), cov).logpdf(x[picked].numpy())
        pyro.set_rng_seed(seed)
        assert abs(MaskedPretrainingLoss(masks="order").loss(own_mean, None, x) - want) < 1e-9

    def switches(x):
        with pyro.plate("data", x.shape[0], dim=-2), pyro.plate("tokens", x.shape[1], dim=-1):
            on = pyro.sample("on", dist.Bernoulli(torch.tensor(0.3, dtype=torch.float64)))
            pyro.sample("x", dist.Normal(2.0 * on, 1.0), obs=x)

    for n, d in ((2, 3), (1, 3), (3, 1)):
        with pytest.raises(ValueError, match="is ambiguous"):
            Evidence(switches)(x[:n, :d])
