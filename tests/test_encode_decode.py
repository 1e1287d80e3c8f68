"""Recursive encode–decode conditionals: convergence to the closed form, gradients, fallbacks, errors."""

import math
import warnings

import pytest
import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import EncodeDecodeConditionals, MaskedPretrainingLoss
from pyro_mpt.conditionals import EngineNotApplicable, GaussianConditionals
from pyro_mpt.guide_elbo import WithGuideELBO
from pyro_mpt.observed_tokens import trace_tokens
from pyro_mpt.experiments.vae import DeepVAE

from models import exact_posterior_guide, make_ppca


def _setup(seed=0, D=6, K=2, N=8, q=4, rate=0.4):
    pyro.set_rng_seed(seed)
    model, x, exact = make_ppca(D, K, N, seed=seed)
    guide = exact_posterior_guide
    tokens = trace_tokens(model, guide, (x,), {})
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(q, N, D, generator=g) < rate
    mask[..., 0] = True
    gauss = GaussianConditionals()
    ref = gauss.mask_log_prob(gauss.prepare(tokens, model, None, (x,), {}), x, mask)
    return model, guide, x, tokens, mask, ref


def test_sampling_chains_approach_the_closed_form_as_S_and_T_grow():
    """Exact encoder and decoder: the rounds are a Gibbs sampler of p(z, x_M | x_R)."""
    model, guide, x, tokens, mask, ref = _setup(seed=0)
    errors = []
    for S, T in [(16, 0), (64, 2), (256, 5), (2000, 30)]:
        engine = EncodeDecodeConditionals(S, T, encode="sample", decode="sample")
        state = engine.prepare(tokens, model, guide, (x,), {})
        out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
        errors.append(float((out - ref)[mask].abs().mean()))
        assert diag["stderr"].shape == mask.shape
    # measured (3 seeds): 0.93-1.75, 0.30-0.62, 0.12-0.21, 0.011-0.030
    assert errors == sorted(errors, reverse=True), errors
    assert errors[0] > 0.5
    assert errors[-1] < 0.06, errors
    assert float((out - ref)[mask].abs().max()) < 0.8


def test_mean_rounds_converge_to_the_full_posterior_variance_formula():
    r"""With means, the completed input converges to E[x_M | x_R] and the final draws are
    N(E[z | x_R], Sigma_full): the estimate tends to N(x_j; E[x_j | x_R], s^2 + w_j Sigma_full w_j^T)."""
    model, guide, x, tokens, mask, ref = _setup(seed=1, q=3)
    W, mu, s = (pyro.param(k).detach() for k in ("W", "mu", "s"))
    K = W.shape[1]
    cov_full = torch.linalg.inv(torch.eye(K, dtype=x.dtype) + W.T @ W / s**2)
    expected = torch.empty_like(ref)
    for qi in range(mask.shape[0]):
        for i in range(x.shape[0]):
            R = ~mask[qi, i]
            WR = W[R]
            prec = torch.eye(K, dtype=x.dtype) + WR.T @ WR / s**2
            m = torch.linalg.solve(prec, WR.T @ (x[i, R] - mu[R]) / s**2)
            var = s**2 + ((W @ cov_full) * W).sum(-1)
            expected[qi, i] = torch.distributions.Normal(W @ m + mu, var.sqrt()).log_prob(x[i])
    engine = EncodeDecodeConditionals(4000, 60, encode="mean", decode="mean")
    state = engine.prepare(tokens, model, guide, (x,), {})
    out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
    z = ((out - expected) / diag["stderr"])[mask]
    assert float(z.abs().max()) < 4.5, z
    # and it is biased against the true conditional (the variance is too small)
    assert float((out - ref)[mask].abs().mean()) > 5 * float((out - expected)[mask].abs().mean())


def test_guides_that_cannot_stack_fall_back_to_one_call_per_query():
    model, _, x, tokens, mask, ref = _setup(seed=2, q=3, N=5)
    K = 2
    c = torch.zeros(x.shape[0], dtype=x.dtype)  # a per-datapoint argument: stacking copies of x breaks it

    def model2(x, c):
        model(x)

    def guide2(x, c):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        cov = torch.linalg.inv(torch.eye(K, dtype=x.dtype) + W.T @ W / s**2)
        loc = ((x - mu) @ W / s**2) @ cov + c[:, None]
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.MultivariateNormal(loc, covariance_matrix=cov))

    outs = []
    for m, g, args in [(model, exact_posterior_guide, (x,)), (model2, guide2, (x, c))]:
        tokens2 = trace_tokens(m, g, args, {})
        engine = EncodeDecodeConditionals(2000, 30, encode="mean", decode="mean")
        state = engine.prepare(tokens2, m, g, args, {})
        if m is model2:
            with pytest.warns(RuntimeWarning, match="once per copy"):
                out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
            assert state.runner.stacking is False
            # the decision is remembered: no second trial, no second warning
            state = engine.prepare(tokens2, m, g, args, {})
            assert state.runner.stacking is False
        else:
            out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
            assert state.runner.stacking is True
        outs.append((out, diag["stderr"]))
    (a, sa), (b, sb) = outs
    z = ((a - b) / (sa**2 + sb**2).sqrt())[mask]
    assert float(z.abs().max()) < 4.5


def _vae(D=12, K=6, N=16):
    x = torch.randint(0, 2, (N, D)).float()
    return DeepVAE(D, K, hidden=(16,)), x


def test_gradients_reach_the_decoder_and_optionally_the_encoder():
    vae, x = _vae()
    for encoder_grad in (False, True):
        pyro.clear_param_store()
        vae.zero_grad()
        loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 2, encoder_grad=encoder_grad), masks=0.5)
        loss.differentiable_loss(vae.model, vae.guide, x).backward()
        dec = [p.grad for p in vae.decoder.parameters()]
        enc = [p.grad for p in vae.encoder.parameters()]
        assert all(g is not None and float(g.abs().sum()) > 0 for g in dec)
        if encoder_grad:
            assert all(g is not None and float(g.abs().sum()) > 0 for g in enc)
        else:
            assert all(g is None for g in enc)


def test_with_guide_elbo_trains_the_encoder_and_leaves_decoder_gradients_to_mpt():
    vae, x = _vae()
    mpt = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 2), masks=0.5)
    grads = []
    for loss in (mpt, WithGuideELBO(mpt)):
        vae.zero_grad()
        pyro.set_rng_seed(3)
        loss.loss_and_grads(vae.model, vae.guide, x)
        grads.append(([p.grad.clone() for p in vae.decoder.parameters()], [p.grad for p in vae.encoder.parameters()]))
    for a, b in zip(grads[0][0], grads[1][0]):
        assert torch.equal(a, b)
    assert all(g is None for g in grads[0][1])
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads[1][1])


def test_with_guide_elbo_in_pyros_module_style_gives_the_loss_and_grads_gradients():
    """``WithGuideELBO(loss)(model, guide)(x).backward()`` (Pyro's module style; before: an
    AttributeError, no differentiable_loss): the inner loss's value, and the gradients of
    ``loss_and_grads`` (SVI style) for the decoder and the encoder, from the same draws. The
    encoder's ELBO part is checked against Trace_ELBO's own gradient."""
    from pyro.infer import Trace_ELBO

    vae, x = _vae()
    mpt = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 2, encoder_grad=False), masks=0.5)
    with_guide = WithGuideELBO(mpt, weight=0.5)
    runs = []
    for style in ("svi", "module"):
        vae.zero_grad()
        pyro.set_rng_seed(3)
        if style == "svi":
            value = with_guide.loss_and_grads(vae.model, vae.guide, x)
        else:
            out = with_guide(vae.model, vae.guide)(x)
            out.backward()
            value = float(out)
        runs.append((value, [p.grad.clone() for p in vae.parameters()]))
    (v0, g0), (v1, g1) = runs
    assert v0 == pytest.approx(v1, rel=1e-12)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the encoder's gradient is the weighted ELBO's alone (encoder_grad=False): Trace_ELBO's, same draws
    vae.zero_grad()
    pyro.set_rng_seed(3)
    mpt.differentiable_loss(vae.model, vae.guide, x)  # the inner loss's draws come first,
    with_guide._guide_params(vae.guide, (x,), {})  # then the guide's run that finds its parameters
    (0.5 * Trace_ELBO().differentiable_loss(vae.model, vae.guide, x)).backward()
    for p, g in zip(vae.parameters(), g1):
        if any(p is q for q in vae.encoder.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_auto_picks_encode_decode_for_an_amortized_guide_beyond_quadrature():
    vae, x = _vae(K=6)
    loss = MaskedPretrainingLoss(masks=0.33)
    tokens, engine, state = loss._prepare(vae.model, vae.guide, (x,), {})
    assert isinstance(engine, EncodeDecodeConditionals)
    assert state.runner.data.key == 0
    assert math.isfinite(loss.loss(vae.model, vae.guide, x))


def test_auto_logs_its_choice_and_warns_once_on_a_large_grid_despite_a_guide(caplog):
    import logging
    import warnings

    from pyro_mpt.conditionals import AUTO_GRID_WARNING, SlowEngineWarning

    torch.manual_seed(0)
    vae = DeepVAE(6, latent_dim=4, hidden=(8,))
    x = torch.bernoulli(torch.full((3, 6), 0.5))
    loss = MaskedPretrainingLoss()
    with caplog.at_level(logging.INFO, logger="pyro_mpt"), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):  # the loss keeps the engine: one choice, one warning
            loss.loss(vae.model, vae.guide, x)
    slow = [w for w in rec if issubclass(w.category, SlowEngineWarning)]
    assert len(slow) == 1
    assert slow[0].message.engine == "quadrature" and slow[0].message.size == 5**4 > AUTO_GRID_WARNING
    chosen = [r.getMessage() for r in caplog.records if r.name == "pyro_mpt"]
    assert len(chosen) == 1
    assert "chose 'quadrature'" in chosen[0] and "'gaussian' declined" in chosen[0]
    # no guide, or a grid no larger than the threshold: the choice is logged, not warned
    for guide, num_nodes in ((lambda x: None, None), (vae.guide, 4)):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            MaskedPretrainingLoss(num_nodes=num_nodes).loss(vae.model, guide, x)
        assert not [w for w in rec if issubclass(w.category, SlowEngineWarning)]


def test_encode_decode_errors():
    vae, x = _vae()
    tokens = trace_tokens(vae.model, None, (x,), {})
    with pytest.raises(EngineNotApplicable, match="no guide"):
        EncodeDecodeConditionals().prepare(tokens, vae.model, None, (x,), {})

    def fixed_guide(x):  # one parameter per datapoint, like AutoNormal: not an encoder
        loc = pyro.param("loc", torch.zeros(x.shape[0], 6))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))

    tokens = trace_tokens(vae.model, fixed_guide, (x,), {})
    with pytest.raises(EngineNotApplicable, match="amortized guide"):
        EncodeDecodeConditionals().prepare(tokens, vae.model, fixed_guide, (x,), {})

    big = torch.cat([x, torch.ones(x.shape[0], 3)], -1)

    def sliced_model(data):
        vae.model(data[:, :12])

    def sliced_guide(data):
        vae.guide(data[:, :12])

    tokens = trace_tokens(sliced_model, sliced_guide, (big,), {})
    with pytest.raises(EngineNotApplicable, match="data_arg"):
        EncodeDecodeConditionals().prepare(tokens, sliced_model, sliced_guide, (big,), {})
    with pytest.raises(ValueError, match="data_arg=0 does not hold the tokens"):
        EncodeDecodeConditionals(data_arg=0).prepare(tokens, sliced_model, sliced_guide, (big,), {})
    with pytest.raises(ValueError, match="num_samples"):
        EncodeDecodeConditionals(num_samples=0)
    with pytest.raises(ValueError, match="decode"):
        EncodeDecodeConditionals(decode="mode")


def test_a_discrete_latent_is_encoded_at_a_value_of_its_support():
    """A guide with a Bernoulli site (a two-component mixture's exact posterior).

    The amortization check and the mean rounds set latents to their "mean"; a
    Bernoulli's mean (0.56) is no value of the latent, and the guide's
    log-density of it failed Pyro's support check, so the engine crashed on any
    guide with a discrete site. The sampling rounds are a Gibbs sampler of
    p(c, x_M | x_R): the conditionals meet numpy's sums over c within 4
    standard errors (S = 3000 chains of T = 8 rounds).
    """
    import numpy as np
    from scipy.special import logsumexp

    pyro.set_rng_seed(0)
    N, D, w = 5, 4, 0.4
    mu = torch.tensor([[-1.0, 0.5, 1.0, -0.5], [1.0, -1.0, 0.0, 1.5]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Bernoulli(torch.tensor(w, dtype=torch.float64)))
            pyro.sample("x", dist.Normal(mu[c.long()], 1.0).to_event(1), obs=x)

    def guide(x):
        # the exact posterior q(c = 1 | x), computed from the data it is given
        log_odds = math.log(w / (1 - w)) + dist.Normal(mu[1], 1.0).log_prob(x).sum(-1) \
            - dist.Normal(mu[0], 1.0).log_prob(x).sum(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Bernoulli(logits=log_odds))

    x = mu[torch.tensor([0, 1, 1, 0, 1])] + torch.randn(N, D, dtype=torch.float64)
    mask = torch.zeros(1, N, D, dtype=torch.bool)
    mask[0, :, [0, 2]] = True
    # numpy reference: log p(x_j | x_R) = log sum_c p(c) p(x_R | c) p(x_j | c) - log sum_c p(c) p(x_R | c)
    X, M = x.numpy(), mu.numpy()
    lp = -0.5 * (X[:, None, :] - M[None]) ** 2 - 0.5 * np.log(2 * np.pi)  # (N, 2, D)
    prior = np.log([1 - w, w])[None, :]
    ctx = prior + lp[:, :, [1, 3]].sum(-1)
    ref = logsumexp(ctx[:, :, None] + lp, 1) - logsumexp(ctx, 1)[:, None]

    tokens = trace_tokens(model, guide, (x,), {})
    engine = EncodeDecodeConditionals(3000, 8, encode="sample", decode="sample")
    state = engine.prepare(tokens, model, guide, (x,), {})
    out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
    z = (out[0] - torch.from_numpy(ref)) / diag["stderr"][0]
    assert z[:, [0, 2]].abs().max() < 4, z
    # the mean rounds run (the latent at its most probable value), and give finite conditionals
    engine = EncodeDecodeConditionals(4, 3, encode="mean", decode="mean")
    out = engine.mask_log_prob(engine.prepare(tokens, model, guide, (x,), {}), x, mask)
    assert torch.isfinite(out).all()


def test_mean_latents_sets_a_discrete_site_to_its_most_probable_value():
    """MeanLatents against numpy's argmax over the support, first value on ties."""
    import numpy as np
    from pyro import poutine
    from pyro_mpt.conditionals.plate_runs import MeanLatents

    probs = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2]])
    p = torch.tensor([0.4, 0.5, 0.7])

    def fn():
        pyro.sample("c", dist.Categorical(probs))
        pyro.sample("b", dist.Bernoulli(p))
        pyro.sample("e", dist.Bernoulli(p).to_event(1))
        pyro.sample("k", dist.Poisson(torch.tensor([3.5, 0.2])))
        pyro.sample("n", dist.Binomial(torch.tensor([10.0, 4.0]), torch.tensor([0.33, 0.9])))
        pyro.sample("z", dist.Normal(torch.tensor([1.5]), 2.0))

    trace = poutine.trace(MeanLatents()(fn)).get_trace()
    assert trace.nodes["c"]["value"].tolist() == np.argmax(probs.numpy(), 1).tolist()
    bern = np.argmax(np.stack([1 - p.numpy(), p.numpy()]), 0).astype(float).tolist()
    assert trace.nodes["b"]["value"].tolist() == bern == [0.0, 0.0, 1.0]
    assert trace.nodes["e"]["value"].tolist() == bern
    assert trace.nodes["k"]["value"].tolist() == [3.0, 0.0]
    # total counts that differ have no enumerated support: their mode, scipy's argmax of the pmf
    from scipy import stats

    pmf_max = [float(np.argmax(stats.binom(n, q).pmf(np.arange(n + 1)))) for n, q in [(10, 0.33), (4, 0.9)]]
    assert trace.nodes["n"]["value"].tolist() == pmf_max
    assert trace.nodes["z"]["value"].tolist() == [1.5]


def test_the_pll_gradient_with_the_exact_posterior_encoder_is_that_of_the_exact_pll():
    """PPCA (D = 4, K = 1) with the exact posterior as encoder and ``context_grad=True``: the
    pseudo-likelihood's gradient in the loadings equals torch's autograd of the exact one (each conditional of the
    multivariate normal from its precision matrix), within 10 % over 3 seeds of 256 draws and
    30 iterations. It was 55 % off at any number of draws (the draws' dependence on the
    loadings, through p(z | x_R), was left out: it was the gradient of log p(x) instead)."""
    D, K, sigma = 4, 1, 0.5
    W0 = torch.tensor([[1.0], [0.5], [-0.8], [1.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, K, generator=g, dtype=torch.float64) @ W0.T + sigma * torch.randn(10, D, generator=g, dtype=torch.float64)
    Wt = 1.3 * W0 + 0.2

    def model(x):
        W = pyro.param("W", Wt.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, sigma).to_event(1), obs=x)

    def exact_posterior(x):
        W = pyro.param("W").detach()
        cov = torch.linalg.inv(torch.eye(K, dtype=W.dtype) + W.T @ W / sigma**2)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.MultivariateNormal(x @ W @ cov / sigma**2, covariance_matrix=cov))

    W = Wt.clone().requires_grad_()
    P = torch.linalg.inv(W @ W.T + sigma**2 * torch.eye(D, dtype=W.dtype))
    d = P.diagonal()
    pll = torch.distributions.Normal(x - (x @ P) / d, d.rsqrt()).log_prob(x).sum()
    (want,) = torch.autograd.grad(-pll, W)
    grads = []
    for seed in range(3):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        pyro.param("W", Wt.clone())
        loss = MaskedPretrainingLoss(conditionals="encode_decode", masks="pll", num_samples=256, num_iterations=30,
                                     context_grad=True)
        loss.loss_and_grads(model, exact_posterior, x)
        grads.append(pyro.param("W").unconstrained().grad.clone())
    got = torch.stack(grads).mean(0)
    assert float((got - want).norm() / want.norm()) < 0.1


def test_a_vae_with_an_untrained_encoder_trains_by_default_and_the_context_gradient_is_opt_in():
    """A tanh VAE whose encoder MPT does not train (encode_decode trains the decoder only): by
    default 60 SVI steps lower the loss by a quarter or more. The context gradient
    (``context_grad=True``), right where the encoder is the posterior, is noise with this one:
    with it as the default the same steps diverged (loss 1487 -> 113287 in 80 steps)."""
    from pyro.infer import SVI
    from pyro.optim import Adam

    def run(**opts):
        torch.manual_seed(0)
        pyro.set_rng_seed(0)
        pyro.clear_param_store()
        N, D, K = 64, 8, 2
        x = torch.tanh(torch.randn(N, K) @ torch.randn(K, D)) + 0.1 * torch.randn(N, D)
        dec = torch.nn.Sequential(torch.nn.Linear(K, 16), torch.nn.Tanh(), torch.nn.Linear(16, D))
        enc = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2 * K))

        def model(x):
            pyro.module("dec", dec)
            with pyro.plate("data", x.shape[0]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
                pyro.sample("x", dist.Normal(dec(z), 0.2).to_event(1), obs=x)

        def guide(x):
            pyro.module("enc", enc)
            with pyro.plate("data", x.shape[0]):
                h = enc(x)
                pyro.sample("z", dist.Normal(h[..., :K], torch.nn.functional.softplus(h[..., K:]) + 1e-2).to_event(1))

        svi = SVI(model, guide, Adam({"lr": 1e-2}), MaskedPretrainingLoss(conditionals="encode_decode", **opts))
        losses = [svi.step(x) for _ in range(60)]
        return sum(losses[:10]) / 10, sum(losses[-10:]) / 10

    first, last = run()
    assert last < 0.75 * first


def test_pyros_minibatch_idiom_with_the_dataset_indexed_inside_the_plate(float64):
    """``with pyro.plate("data", N, subsample=idx) as i: ... obs=x[i]`` with the whole dataset as
    the argument (before: refused, no argument equal to the tokens): the copies replace the
    minibatch's rows of the dataset, and every schedule's scores equal those of the same model
    and guide given the minibatch itself, same seeds (also with data_arg named)."""
    g = torch.Generator().manual_seed(0)
    N, D, K = 30, 5, 2
    W, x = torch.randn(D, K, generator=g), torch.randn(N, D, generator=g)
    enc = torch.nn.Linear(D, 2 * K).double()
    idx = torch.tensor([3, 7, 11, 20, 21, 29])

    def encode(xb):
        h = enc(xb)
        return dist.Normal(h[..., :K], torch.nn.functional.softplus(h[..., K:]) + 0.1).to_event(1)

    valid = torch.ones(N, dtype=torch.bool)
    valid[[7, 20]] = False  # padding rows masked out whole, their placeholders 0
    x[~valid] = 0.0
    padded = {"on": False}

    def mask(i):
        return valid[i] if padded["on"] else True

    def model_indexed(x, idx):
        with pyro.plate("data", N, subsample=idx) as i, pyro.poutine.mask(mask=mask(i)):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x[i])

    def guide_indexed(x, idx):
        pyro.module("enc", enc)
        with pyro.plate("data", N, subsample=idx) as i:
            pyro.sample("z", encode(x[i]))

    def model_batch(xb, idx):
        with pyro.plate("data", N, subsample=idx) as i, pyro.poutine.mask(mask=mask(i)):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=xb)

    def guide_batch(xb, idx):
        pyro.module("enc", enc)
        with pyro.plate("data", N, subsample=idx):
            pyro.sample("z", encode(xb))

    # and with padding rows in the minibatch (before: its placeholders, replaced in the traced
    # tokens, made no argument equal to them)
    for on, masks in ((False, "order"), (False, "all"), (False, "pll"), (True, "order"), (True, "all")):
        padded["on"] = on
        batch = torch.tensor([3, 7, 11, 20, 21, 29]) if on else idx
        scores = []
        for m, gd, data, options in ((model_indexed, guide_indexed, x, {}), (model_indexed, guide_indexed, x, {"data_arg": 0}),
                                     (model_batch, guide_batch, x[batch], {})):
            pyro.set_rng_seed(1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the batch form's copies fall back to one at a time
                engine = EncodeDecodeConditionals(**options)
                scores.append(MaskedPretrainingLoss(conditionals=engine, masks=masks).score(m, gd, data, batch))
        assert scores[0].shape == (6,) and bool(scores[0].isfinite().all())
        if on:
            assert torch.equal(scores[0][[1, 3]], torch.zeros(2, dtype=torch.float64))
        for other in scores[1:]:
            torch.testing.assert_close(scores[0], other, rtol=1e-12, atol=1e-10)
