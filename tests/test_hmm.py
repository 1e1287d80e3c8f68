"""Exact conditionals of an observed DiscreteHMM by forward--backward (issue 13 §2)."""

import itertools

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro.distributions import constraints
from pyro.infer import SVI, config_enumerate
from pyro.optim import Adam
from scipy.special import logsumexp
from scipy.stats import norm, poisson

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import DiscreteHMMConditionals, EngineNotApplicable, EnumerateConditionals, auto_engine
from pyro_mpt.observed_tokens import trace_tokens

from models import saved_numel


# ---------------------------------------------------------------------- references
def numpy_forward(log_init, log_trans, log_emit):
    """log p(x) by the forward algorithm: h_{-1} ~ init, h_t | h_{t-1} ~ trans,
    emission log-likelihoods log_emit (T, S) of h_t."""
    alpha = log_init
    for t in range(log_emit.shape[0]):
        alpha = logsumexp(alpha[:, None] + log_trans, axis=0) + log_emit[t]
    return logsumexp(alpha)


def brute_force_log_marginal(log_init, log_trans, log_emit, keep):
    """log p(x_keep) by summing over every hidden path (S^(T+1) of them); log_emit (T, S, E),
    keep bool (T, E)."""
    T, S, E = log_emit.shape
    total = []
    for path in itertools.product(range(S), repeat=T + 1):
        lp = log_init[path[0]]
        for t in range(T):
            lp += log_trans[path[t], path[t + 1]] + (log_emit[t, path[t + 1]] * keep[t]).sum()
        total.append(lp)
    return logsumexp(total)


def make_hmm(S=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = torch.randn(S, generator=g, dtype=torch.float64)
    trans = torch.randn(S, S, generator=g, dtype=torch.float64)
    locs = 2 * torch.randn(S, generator=g, dtype=torch.float64)
    scales = 0.5 + torch.rand(S, generator=g, dtype=torch.float64)

    def hmm(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Normal(locs, scales)), obs=x)

    def emissions(x):  # (n, T, S)
        return norm.logpdf(x.numpy()[..., None], locs.numpy(), scales.numpy())

    log_init = torch.log_softmax(init, 0).numpy()
    log_trans = torch.log_softmax(trans, -1).numpy()
    return hmm, log_init, log_trans, emissions


# ---------------------------------------------------------------------- identities
def test_evidence_matches_numpy_forward_and_log_prob(float64):
    hmm, log_init, log_trans, emissions = make_hmm()
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    ref = np.array([numpy_forward(log_init, log_trans, e) for e in emissions(x)])
    got = Evidence(hmm, method="exact")(x)
    assert np.abs(got.numpy() - ref).max() < 1e-10
    tokens = trace_tokens(hmm, None, (x,), {})
    assert torch.allclose(got, tokens.site["fn"].log_prob(x), rtol=0, atol=1e-10)
    engine, _ = auto_engine(tokens, hmm, None, (x,), {})
    assert isinstance(engine, DiscreteHMMConditionals)


def test_exhaustive_and_every_ordering_equal_log_p(float64):
    T = 5
    hmm, log_init, log_trans, emissions = make_hmm(seed=2)
    x = torch.randn(4, T, generator=torch.Generator().manual_seed(3))
    ref = np.array([numpy_forward(log_init, log_trans, e) for e in emissions(x)])
    score = MaskedPretrainingLoss(masks="exhaustive").score(hmm, None, x)
    assert np.abs(score.numpy() - ref).max() < 1e-8
    engine = DiscreteHMMConditionals()
    tokens = trace_tokens(hmm, None, (x,), {})
    state = engine.prepare(tokens, hmm, None, (x,), {})
    orders = torch.tensor(list(itertools.permutations(range(T))))[:, None, :]  # all 120
    chains = engine.chain_log_prob(state, tokens.value, orders).sum(-1)
    assert np.abs(chains.numpy() - ref[None]).max() < 1e-8
    curve = MaskedPretrainingLoss(conditionals="hmm", masks="order").curve(hmm, None, x)
    assert abs(curve.area() - ref.mean()) < 1e-8


def test_leave_one_out_and_random_masks_match_brute_force(float64):
    """p(x_t | x_-t) and random masked conditionals against sums over all 3^6 hidden paths."""
    T = 5
    hmm, log_init, log_trans, emissions = make_hmm(seed=4)
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(5))
    engine = DiscreteHMMConditionals()
    tokens = trace_tokens(hmm, None, (x,), {})
    state = engine.prepare(tokens, hmm, None, (x,), {})
    loo = torch.eye(T, dtype=torch.bool)[:, None, :].expand(T, 3, T)
    g = torch.Generator().manual_seed(6)
    masks = torch.cat([loo, torch.rand(4, 3, T, generator=g) < 0.5], 0)
    logc = engine.mask_log_prob(state, tokens.value, masks).numpy()
    E = emissions(x)[..., None]  # (n, T, S, 1)
    for q in range(masks.shape[0]):
        for i in range(3):
            ctx = ~masks[q, i].numpy()
            den = brute_force_log_marginal(log_init, log_trans, E[i], ctx[:, None])
            for t in np.flatnonzero(masks[q, i].numpy()):
                keep = ctx.copy()
                keep[t] = True
                num = brute_force_log_marginal(log_init, log_trans, E[i], keep[:, None])
                assert abs(logc[q, i, t] - (num - den)) < 1e-10


def test_vector_emissions_time_varying_and_batched(float64):
    """Emissions of 2 independent elements per step (tokens t * 2 + e), a time-varying
    transition matrix and per-sequence initial logits; masks against brute force."""
    S, T, E, n = 2, 3, 2, 2
    g = torch.Generator().manual_seed(7)
    init = torch.randn(n, S, generator=g)
    trans = torch.randn(T, S, S, generator=g)
    locs = torch.randn(S, E, generator=g)

    def hmm(x):
        with pyro.plate("sequences", x.shape[0]):
            obs = dist.Normal(locs, 1.0).to_event(1)
            pyro.sample("x", dist.DiscreteHMM(init, trans, obs), obs=x)

    x = torch.randn(n, T, E, generator=g)
    tokens = trace_tokens(hmm, None, (x,), {})
    assert tokens.value.shape == (n, T * E)
    engine = DiscreteHMMConditionals()
    state = engine.prepare(tokens, hmm, None, (x,), {})
    masks = torch.rand(5, n, T * E, generator=g) < 0.5
    logc = engine.mask_log_prob(state, tokens.value, masks).numpy()
    emit = norm.logpdf(x.numpy()[:, :, None, :], locs.numpy()[None, None], 1.0)  # (n, T, S, E)
    lt = torch.log_softmax(trans, -1).numpy()
    for i in range(n):
        li = torch.log_softmax(init[i], 0).numpy()
        # a time-varying chain: brute force over paths with per-step matrices
        def marg(keep):
            out = []
            for path in itertools.product(range(S), repeat=T + 1):
                lp = li[path[0]] + sum(
                    lt[t, path[t], path[t + 1]] + (emit[i, t, path[t + 1]] * keep[t]).sum() for t in range(T)
                )
                out.append(lp)
            return logsumexp(out)

        full = np.ones((T, E), bool)
        assert abs(Evidence(hmm, method="exact")(x)[i].item() - marg(full)) < 1e-10
        for q in range(5):
            ctx = ~masks[q, i].numpy().reshape(T, E)
            for j in np.flatnonzero(masks[q, i].numpy()):
                keep = ctx.copy()
                keep[j // E, j % E] = True
                assert abs(logc[q, i, j] - (marg(keep) - marg(ctx))) < 1e-10


# ---------------------------------------------------------------------- training
def _sample_hmm(N, T, seed):
    rng = np.random.default_rng(seed)
    A = np.array([[0.85, 0.15], [0.2, 0.8]])
    locs = np.array([-1.0, 1.5])
    h = rng.choice(2, size=N)
    xs = []
    for _ in range(T):
        h = np.where(rng.random(N) < A[h, 0], 0, 1)
        xs.append(locs[h] + 0.7 * rng.standard_normal(N))
    return torch.tensor(np.stack(xs, 1))


def _hmm_model(x):
    init = pyro.param("init", torch.zeros(2))
    trans = pyro.param("trans", torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    locs = pyro.param("locs", torch.tensor([-0.5, 0.5]))
    scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
    with pyro.plate("sequences", x.shape[0]):
        pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Normal(locs, scale)), obs=x)


def _log_likelihood(x):
    """Mean DiscreteHMM.log_prob per sequence at the current params (Pyro's forward algorithm)."""
    names = ["init", "trans", "locs", "scale"]
    init, trans, locs, scale = (pyro.param(n) for n in names)
    return dist.DiscreteHMM(init, trans, dist.Normal(locs, scale)).log_prob(x).mean()


def test_svi_by_mpt_reaches_the_maximum_likelihood_fit(float64):
    """MPT with uniform masks (100 SVI steps) reaches the log-likelihood of the fit that
    maximizes DiscreteHMM.log_prob directly (L-BFGS) within 0.05 nats per sequence."""
    x = _sample_hmm(60, 8, seed=0)
    _hmm_model(x)
    params = [pyro.param(n).unconstrained() for n in ["init", "trans", "locs", "scale"]]
    opt = torch.optim.LBFGS(params, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -_log_likelihood(x)
        loss.backward()
        return loss

    opt.step(closure)
    best = _log_likelihood(x).item()
    pyro.clear_param_store()
    _hmm_model(x)
    start = _log_likelihood(x).item()
    svi = SVI(_hmm_model, lambda x: None, Adam({"lr": 0.05}), MaskedPretrainingLoss(masks="uniform", num_masks=2))
    for _ in range(100):
        svi.step(x)
    final = _log_likelihood(x).item()
    # measured: start -14.37, maximum likelihood -11.711, after MPT -11.724 nats per sequence
    assert start < best - 2
    assert abs(final - best) < 0.05


@config_enumerate
def _markov_hmm_model(x):
    """The model of _hmm_model written the Pyro-tutorial way, for TraceEnum_ELBO: the
    state before the first step, then one enumerated state and one observation per step."""
    init = pyro.param("init", torch.zeros(2))
    trans = pyro.param("trans", torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    locs = pyro.param("locs", torch.tensor([-0.5, 0.5]))
    scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
    with pyro.plate("sequences", x.shape[0]):
        h = pyro.sample("h_init", dist.Categorical(logits=init))
        for t in pyro.markov(range(x.shape[1])):
            h = pyro.sample(f"h_{t}", dist.Categorical(logits=trans[h]))
            pyro.sample(f"x_{t}", dist.Normal(locs[h], scale), obs=x[:, t])


def test_svi_by_mpt_reaches_the_traceenum_elbo_fit(float64):
    """The same HMM trained by SVI twice from the same start, 150 Adam steps each:
    with TraceEnum_ELBO on the tutorial form (hidden states enumerated, so the ELBO is
    the exact log-likelihood: its loss equals -sum DiscreteHMM.log_prob to 1e-8 at the
    start) and with MPT (uniform masks) on the DiscreteHMM form. The two fits' mean
    log-likelihoods per sequence agree within 0.05 nats, and their emission means
    within 0.1."""
    from pyro.infer import TraceEnum_ELBO

    x = _sample_hmm(60, 8, seed=1)
    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    _hmm_model(x)
    start = _log_likelihood(x).item()
    enum_loss = elbo.loss(_markov_hmm_model, lambda x: None, x)
    assert abs(enum_loss + 60 * start) < 1e-8

    fits = {}
    for name, model, loss in (("enum", _markov_hmm_model, elbo),
                              ("mpt", _hmm_model, MaskedPretrainingLoss(masks="uniform", num_masks=2))):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, lambda x: None, Adam({"lr": 0.05}), loss)
        for _ in range(150):
            svi.step(x)
        fits[name] = (_log_likelihood(x).item(), pyro.param("locs").detach().sort().values)
    # measured: start -13.970, TraceEnum_ELBO -11.711, MPT -11.726 nats per sequence;
    # emission means (-0.998, 1.421) and (-1.051, 1.374)
    assert fits["enum"][0] > start + 2
    assert abs(fits["mpt"][0] - fits["enum"][0]) < 0.05
    assert (fits["mpt"][1] - fits["enum"][1]).abs().max() < 0.1


# ---------------------------------------------------------------------- the tutorial form
@config_enumerate
def markov_hmm(y):
    """Pyro's HMM tutorial form: one observed site per step, hidden states in pyro.markov."""
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    locs = torch.tensor([[-1.0, 0.0], [1.0, 2.0]])
    with pyro.plate("sequences", y.shape[0]):
        h = 0
        for t in pyro.markov(range(y.shape[1])):
            h = pyro.sample(f"h_{t}", dist.Categorical(probs[h]))
            pyro.sample(f"y_{t}", dist.Normal(locs[h], 1.0).to_event(1), obs=y[:, t])


def test_tutorial_form_is_refused_with_a_pointer_to_discrete_hmm():
    """Refused as several observed sites; with obs_site and extra_sites='drop' it is
    log p(y_0) (before: refused, the enumeration dims of pyro.markov being recycled)."""
    y = torch.randn(3, 4, 2)
    with pytest.raises(ValueError, match=r"observes several sites .* one dist\.DiscreteHMM site"):
        MaskedPretrainingLoss().score(markov_hmm, None, y)
    with pytest.raises(ValueError, match=r"would drop observed site\(s\) 'y_1', 'y_2', 'y_3' .* steps of a pyro\.markov chain: write the sequence as one dist\.DiscreteHMM site"):
        MaskedPretrainingLoss(obs_site="y_0").score(markov_hmm, None, y)
    # asked for log p(y_0) alone, the chain is summed jointly: its first step's mixture
    got = MaskedPretrainingLoss(conditionals="enumerate", obs_site="y_0", extra_sites="drop", masks="exhaustive")
    locs = np.array([[-1.0, 0.0], [1.0, 2.0]])
    ref = logsumexp(np.log([0.9, 0.1]) + norm.logpdf(y[:, 0, None, :].numpy(), locs).sum(-1), -1)
    assert np.abs(got.score(markov_hmm, None, y).numpy() - ref).max() < 1e-6


def test_hmm_engine_refuses_other_observations():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    x = torch.randn(2, 3)
    tokens = trace_tokens(model, None, (x,), {})
    with pytest.raises(EngineNotApplicable, match=r"needs observed site .x. to be a dist\.DiscreteHMM \(time steps as tokens\); it is Normal"):
        DiscreteHMMConditionals().prepare(tokens, model, None, (x,), {})
    with pytest.raises(EngineNotApplicable, match="has no latent site"):
        EnumerateConditionals().prepare(tokens, model, None, (x,), {})


def test_leave_one_out_queries_take_one_forward_backward_pass(monkeypatch):
    """Queries that each hide one token (the "pll" schedule) are answered from one
    forward--backward pass over the whole sequence, not one pass per query (T = 30,
    S = 5: 3.0 s -> 0.09 s float32 on this machine); each conditional equals numpy's
    forward algorithm with and without that token, also for vector emissions (E = 2)
    and as a gradient against the per-query path."""
    import pyro_mpt.conditionals.hmm as hmm_module

    N, T, S, E = 7, 6, 3, 2
    g = torch.Generator().manual_seed(5)
    init = torch.randn(S, generator=g, dtype=torch.float64).log_softmax(-1)
    trans = torch.randn(S, S, generator=g, dtype=torch.float64).log_softmax(-1)
    locs = torch.randn(S, E, generator=g, dtype=torch.float64)
    x = torch.randn(N, T, E, generator=g, dtype=torch.float64)

    def model(x):
        loc = pyro.param("loc", locs.clone())
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Normal(loc, 1.0).to_event(1)), obs=x)

    def forward(keep):  # numpy: log p(x_R), the chain starting at h_{-1} ~ init
        e = norm.logpdf(x.numpy()[:, :, None, :], locs.numpy()[None, None], 1.0)  # (N, T, S, E)
        phi = (e * keep.reshape(1, T, 1, E)).sum(-1)
        a = np.broadcast_to(init.numpy(), (N, S))
        for t in range(T):
            a = logsumexp(a[:, :, None] + trans.numpy()[None], axis=1) + phi[:, t]
        return logsumexp(a, axis=1)

    full = forward(np.ones(T * E))
    ref = np.stack([full - forward(1.0 - np.eye(T * E)[j]) for j in range(T * E)], -1)  # (N, D)
    tokens = trace_tokens(model, None, (x,), {})
    engine = DiscreteHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = torch.eye(T * E, dtype=torch.bool)[:, None, :].expand(-1, N, -1)  # query j hides token j
    leading = []
    messages = hmm_module._messages_forward
    monkeypatch.setattr(hmm_module, "_messages_forward", lambda a, M: leading.append(M.shape[0]) or messages(a, M))
    got = engine.mask_log_prob(state, x.reshape(N, -1), mask)
    assert leading and set(leading) == {1}  # one pass (the forward and backward messages) for all 12 queries
    assert np.abs(got.detach().numpy()[np.arange(T * E), :, np.arange(T * E)].T - ref).max() < 1e-10
    # the score of the "pll" schedule, and its gradient against the per-query path (two queries, not one each)
    pyro.clear_param_store()
    pll = MaskedPretrainingLoss(conditionals="hmm", masks="pll").score(model, None, x)
    assert np.abs(pll.detach().numpy() - ref.sum(-1)).max() < 1e-9
    pyro.clear_param_store()
    state = engine.prepare(trace_tokens(model, None, (x,), {}), model, None, (x,), {})
    one = engine.mask_log_prob(state, x.reshape(N, -1), mask)[mask].sum()
    (grad_one,) = torch.autograd.grad(one, pyro.param("loc"), retain_graph=True)
    per_query = torch.cat([engine.mask_log_prob(state, x.reshape(N, -1), mask[j : j + 1]) for j in range(T * E)])
    (grad_each,) = torch.autograd.grad(per_query[mask].sum(), pyro.param("loc"))
    assert torch.allclose(grad_one, grad_each, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("T", [1, 2, 4, 7, 16, 30, 101])
def test_blocked_messages_equal_the_sequential_forward_algorithm(T, sequential, monkeypatch):
    """``_messages_forward`` (blocks of about sqrt(T) steps, or step by step for a large
    batch) against numpy's step-by-step forward recursion, for lengths with and without
    padding of the last block, on a batch of two chains with every message kept; the
    gradient of a weighted sum of the messages against autograd of a torch loop."""
    from pyro_mpt.conditionals import hmm as hmm_module

    monkeypatch.setattr(hmm_module, "SEQUENTIAL_ELEMENTS", 1 if sequential else 2**62)
    S = 3
    g = torch.Generator().manual_seed(T)
    M = torch.randn(2, T, S, S, generator=g, dtype=torch.float64).requires_grad_()
    start = torch.randn(2, S, generator=g, dtype=torch.float64)
    messages = hmm_module._messages_forward(start, M)
    got = messages.detach().numpy()
    for i in range(2):
        a = start[i].numpy()
        for t in range(T):
            a = logsumexp(a[:, None] + M[i, t].detach().numpy(), axis=0)
            assert np.abs(got[i, t] - a).max() < 1e-12
    weight = torch.randn(messages.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((weight * messages).sum(), M)
    a, loop = start, []
    for t in range(T):
        a = torch.logsumexp(a.unsqueeze(-1) + M[:, t], -2)
        loop.append(a)
    (want,) = torch.autograd.grad((weight * torch.stack(loop, 1)).sum(), M)
    assert (grad - want).abs().max() < 1e-12


def test_chunks_of_masks_are_recomputed_and_their_tables_not_kept(float64):
    """Masks per datapoint in several chunks (max_elements of one query a chunk) are
    recomputed in the backward pass: the tensors kept for it (saved-tensor hooks) are a
    fraction of the unchunked engine's (masks='all', S = 6, 100 sequences of 100 steps,
    loss + gradient: peak RSS 2.4 -> 0.44 GB, 8.4 -> 10.4 s, one thread), with the same
    conditionals and parameter gradients (1e-10), which equal sums over every hidden path."""
    T, n, S = 6, 3, 3
    g = torch.Generator().manual_seed(20)
    init = torch.randn(S, generator=g, dtype=torch.float64).requires_grad_()
    trans = torch.randn(S, S, generator=g, dtype=torch.float64).requires_grad_()
    locs = 2 * torch.randn(S, generator=g, dtype=torch.float64)
    scales = 0.5 + torch.rand(S, generator=g, dtype=torch.float64)

    def hmm(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Normal(locs, scales)), obs=x)

    x = torch.randn(n, T, generator=g, dtype=torch.float64)
    mask = torch.rand(4, n, T, generator=g) < 0.5
    mask[:, :, 0] = True
    results = []
    for max_elements in (2**24, n * T * S**3):  # one chunk; one query a chunk
        tokens = trace_tokens(hmm, None, (x,), {})  # a graph of its own from the parameters
        engine = DiscreteHMMConditionals(max_elements=max_elements)
        state = engine.prepare(tokens, hmm, None, (x,), {})
        saved, logc = saved_numel(lambda: engine.mask_log_prob(state, tokens.value, mask))
        value = torch.where(mask, logc, torch.zeros((), dtype=logc.dtype)).sum()
        results.append((logc.detach(), torch.autograd.grad(value, [init, trans]), saved))
    (whole, grads_whole, kept_whole), (chunked, grads_chunked, kept_chunked) = results
    assert kept_chunked < kept_whole / 4, (kept_chunked, kept_whole)
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-10)
    for a, b in zip(grads_chunked, grads_whole):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    log_init = torch.log_softmax(init, 0).detach().numpy()
    log_trans = torch.log_softmax(trans, -1).detach().numpy()
    E = norm.logpdf(x.numpy()[..., None], locs.numpy(), scales.numpy())[..., None]  # (n, T, S, 1)
    for q in range(mask.shape[0]):
        for i in range(n):
            ctx = ~mask[q, i].numpy()
            den = brute_force_log_marginal(log_init, log_trans, E[i], ctx[:, None])
            for t in np.flatnonzero(mask[q, i].numpy()):
                keep = ctx.copy()
                keep[t] = True
                num = brute_force_log_marginal(log_init, log_trans, E[i], keep[:, None])
                assert abs(float(chunked[q, i, t]) - (num - den)) < 1e-10


def test_a_mask_over_steps_is_refused_naming_the_steps():
    """poutine.mask over a DiscreteHMM's steps (one mask entry per step) cannot mask
    them (its log_prob has the batch shape): the refusal names the value's event
    shape (T,) = (5,); it said (1,), the event shape a DiscreteHMM without duration
    declares whatever its steps."""
    init, trans = torch.zeros(2), torch.zeros(2, 2)
    x = torch.ones(3, 5)

    def model(x, m):
        with pyro.plate("seq", x.shape[0]), pyro.poutine.mask(mask=m):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Poisson(torch.tensor([1.0, 4.0]))), obs=x)

    m = torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5\).*batch shape \(3,\).*its event shape \(5,\) holds"):
        Evidence(model)(x, m)


def test_pll_takes_one_forward_backward_pass_per_step(float64, monkeypatch):
    """masks="pll" with chunk_size = 2 n T (two queries a block, 3 blocks): every query hides one step, so
    one forward-backward pass serves all of them (DiscreteHMMConditionals.weighted_mask_sum);
    each block ran the pass again (200 sequences of 1000 steps: 50 passes, 56.5 s a step
    against 0.16 s for DiscreteHMM.log_prob). The score against numpy's forward algorithm,
    log p(x) - log p(x_-t) summed over t (1e-10)."""
    T, n = 6, 4
    hmm, log_init, log_trans, emissions = make_hmm(seed=8)
    x = torch.randn(n, T, generator=torch.Generator().manual_seed(9))
    passes = []
    original = DiscreteHMMConditionals.leave_one_out_table
    monkeypatch.setattr(DiscreteHMMConditionals, "leave_one_out_table",
                        lambda self, state: passes.append(1) or original(self, state))
    score = MaskedPretrainingLoss(masks="pll", chunk_size=2 * n * T).score(hmm, None, x)
    assert len(passes) == 1
    for i, e in enumerate(emissions(x)):
        full = numpy_forward(log_init, log_trans, e)
        ref = 0.0
        for t in range(T):
            hidden = e.copy()
            hidden[t] = 0.0  # x_t summed out
            ref += full - numpy_forward(log_init, log_trans, hidden)
        assert abs(float(score[i]) - ref) < 1e-10 * max(1.0, abs(ref))


def test_masked_emissions_are_missing_steps(float64):
    """A DiscreteHMM whose observation_dist is masked (.mask(m)) leaves those steps, or
    elements of a step, out of its log_prob: they are missing tokens. Evidence, the "order"
    score and pll equal the brute-force sums over hidden paths with those emissions left out
    (they were scored as observed: 1-8 nats off, no warning), and the "order" loss equals
    -sum DiscreteHMM.log_prob (Pyro's own forward algorithm, which honours the mask)."""
    g = torch.Generator().manual_seed(4)
    n, T, S, E = 3, 4, 2, 2
    init, trans = torch.randn(S, generator=g), torch.randn(S, S, generator=g)
    locs, scales = 2 * torch.randn(S, E, generator=g), 0.5 + torch.rand(S, E, generator=g)
    x = torch.randn(n, T, E, generator=g)
    step = torch.rand(n, T, generator=g) > 0.3  # whole steps
    elem = torch.rand(n, T, E, generator=g) > 0.2  # single elements of a step
    step[0] = True
    step[1, :] = torch.tensor([True, False, False, True])

    def hmm(x):
        emission = dist.Normal(locs, scales).expand([n, T, S, E]).mask(elem[:, :, None]).to_event(1)
        with pyro.plate("sequences", n):
            pyro.sample("x", dist.DiscreteHMM(init, trans, emission.mask(step[..., None])), obs=x)

    keep = (step[..., None] & elem).numpy()  # (n, T, E)
    log_init = torch.log_softmax(init, 0).numpy()
    log_trans = torch.log_softmax(trans, -1).numpy()
    log_emit = norm.logpdf(x.numpy()[:, :, None, :], locs.numpy(), scales.numpy())  # (n, T, S, E)
    ref = np.array([brute_force_log_marginal(log_init, log_trans, log_emit[i], keep[i]) for i in range(n)])
    assert keep.sum() < keep.size - 3  # some steps and elements are missing
    pyro_lp = dist.DiscreteHMM(init, trans, dist.Normal(locs, scales).expand([n, T, S, E]).mask(
        elem[:, :, None]).to_event(1).mask(step[..., None])).log_prob(x).numpy()
    np.testing.assert_allclose(pyro_lp, ref, atol=1e-10)

    np.testing.assert_allclose(Evidence(hmm)(x).numpy(), ref, atol=1e-10)
    order = MaskedPretrainingLoss(masks="order")
    np.testing.assert_allclose(order.score(hmm, None, x).numpy(), ref, atol=1e-10)
    assert abs(order.loss(hmm, None, x) + ref.sum()) < 1e-9
    pll = MaskedPretrainingLoss(masks="pll").score(hmm, None, x).numpy()
    for i in range(n):
        total, tokens = 0.0, np.argwhere(keep[i])
        for t, e in tokens:
            rest = keep[i].copy()
            rest[t, e] = False
            total += ref[i] - brute_force_log_marginal(log_init, log_trans, log_emit[i], rest)
        assert abs(pll[i] - total) < 1e-10  # the pseudo-log-likelihood: the sum over the observed tokens


def test_placeholders_at_missing_steps_pass_the_support_check(float64):
    """Placeholders (NaN, -1, 0.5) at the steps a DiscreteHMM's observation_dist masks out are
    missing tokens, as at any other site: under Pyro's validation they were refused as
    outside the support, counted and shown as the sequence's observed steps (the HMM's
    support, independent over the steps, failed whole sequences). The scores equal the
    brute-force sums over hidden paths of the observed steps, and a bad value at an observed
    step is named at its own token, with a pointer to the observation's .mask()."""
    g = torch.Generator().manual_seed(5)
    n, T, S = 2, 6, 2
    init, trans = torch.randn(S, generator=g), torch.randn(S, S, generator=g)
    rates = torch.tensor([1.0, 3.0])
    x = torch.tensor([[1.0, 3.0, 0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, 2.0, 3.0]])
    keep = torch.ones(n, T, dtype=torch.bool)
    keep[0, 4:] = False
    keep[1, 1] = False

    def hmm(x):
        with pyro.plate("sequences", n):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.Poisson(rates).mask(keep[..., None])), obs=x)

    log_init = torch.log_softmax(init, 0).numpy()
    log_trans = torch.log_softmax(trans, -1).numpy()
    log_emit = poisson.logpmf(x.numpy()[:, :, None], rates.numpy())[..., None]  # (n, T, S, 1)
    ref = np.array([brute_force_log_marginal(log_init, log_trans, log_emit[i], keep[i, :, None].numpy()) for i in range(n)])
    with pyro.validation_enabled(True):
        for placeholder in (float("nan"), -1.0, 0.5):
            xp = torch.where(keep, x, torch.tensor(placeholder))
            np.testing.assert_allclose(Evidence(hmm)(xp).numpy(), ref, atol=1e-10)
            np.testing.assert_allclose(MaskedPretrainingLoss(masks="order").score(hmm, None, xp).numpy(), ref, atol=1e-10)
        bad = x.clone()
        bad[1, 3] = 2.5  # observed
        bad[0, 5] = float("nan")  # missing
        with pytest.raises(ValueError, match=r"has 1 value\(s\) outside .* e\.g\. 2\.5 at datapoint 1, token 3; .*observation_dist\.mask"):
            MaskedPretrainingLoss(masks="order").score(hmm, None, bad)


def test_mixture_of_hmms_is_summed_exactly(float64):
    """A class latent per sequence that picks its transition matrix and emission locations (a
    mixture of HMMs, which TraceEnum_ELBO serves): every engine refused it, "auto" too. Now
    "enumerate" sums the classes over each class's forward--backward sums: Evidence, the
    "order" and "exhaustive" scores and pll equal brute-force sums over classes and hidden
    paths, with missing steps too, and the loss and its gradient equal TraceEnum_ELBO's."""
    from pyro.infer import TraceEnum_ELBO

    g = torch.Generator().manual_seed(11)
    n, T, S, C = 4, 4, 2, 3
    x = torch.randn(n, T, generator=g)
    keep = torch.rand(n, T, generator=g) > 0.25
    keep[0] = True
    w0 = torch.softmax(torch.randn(C, generator=g), 0)
    trans0 = torch.randn(C, S, S, generator=g)
    locs0 = 2 * torch.randn(C, S, generator=g)

    @config_enumerate
    def model(x):
        w = pyro.param("w", w0.clone(), constraint=constraints.simplex)
        trans = pyro.param("trans", trans0.clone())
        locs = pyro.param("locs", locs0.clone())
        with pyro.plate("sequences", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(w))
            emission = dist.Normal(locs[c].unsqueeze(-2), 1.0).expand(c.shape + (T, S)).mask(keep[..., None])
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(S), trans[c].unsqueeze(-3), emission), obs=x)

    def reference(keep_i, i):
        logs = []
        for k in range(C):
            emit = norm.logpdf(x[i].numpy()[:, None], locs0[k].numpy(), 1.0)[:, :, None]  # (T, S, 1)
            lp = brute_force_log_marginal(np.log([0.5, 0.5]), torch.log_softmax(trans0[k], -1).numpy(), emit,
                                          keep_i[:, None])
            logs.append(np.log(w0[k].item()) + lp)
        return logsumexp(logs)

    pyro.clear_param_store()
    obs = keep.numpy()
    ref = np.array([reference(obs[i], i) for i in range(n)])
    np.testing.assert_allclose(Evidence(model)(x).detach().numpy(), ref, atol=1e-10)
    for masks in ("order", "exhaustive"):
        np.testing.assert_allclose(MaskedPretrainingLoss(masks=masks).score(model, None, x).detach().numpy(), ref,
                                   atol=1e-10)
    pll = MaskedPretrainingLoss(masks="pll").score(model, None, x).detach().numpy()
    for i in range(n):
        want = 0.0
        for t in np.flatnonzero(obs[i]):
            rest = obs[i].copy()
            rest[t] = False
            want += ref[i] - reference(rest, i)
        assert abs(pll[i] - want) < 1e-10
    # loss and gradient against TraceEnum_ELBO's exact log-likelihood
    params = [pyro.param(k).unconstrained() for k in ("w", "trans", "locs")]
    loss = MaskedPretrainingLoss(masks="order").differentiable_loss(model, None, x)
    grads = torch.autograd.grad(loss, params)
    want = TraceEnum_ELBO(max_plate_nesting=1).differentiable_loss(model, lambda x: None, x)
    want_grads = torch.autograd.grad(want, params)
    assert abs(float(loss) - float(want)) < 1e-10 and abs(float(loss) + ref.sum()) < 1e-9
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_structural_zeros_give_the_gradients_of_the_log_likelihood(float64):
    """A left-to-right (change-point) chain, whose transition matrix has zeros: every
    gradient is that of a plain torch forward algorithm with the zeros written as 1e-300
    (finite logs, so autograd of torch.logsumexp is exact there; the paths it adds weigh
    1e-300). Before, a log-sum of terms that are all -inf (a state unreachable at some step)
    had a NaN derivative, and SVI wrote NaN into the emission means."""
    T, n = 8, 3
    init = torch.tensor([1.0, 0.0, 0.0])
    trans = torch.tensor([[0.8, 0.2, 0.0], [0.0, 0.7, 0.3], [0.0, 0.0, 1.0]])
    locs = torch.tensor([-2.0, 0.0, 2.0], requires_grad=True)
    x = torch.tensor([[-2.1, -1.7, 0.3, 0.1, -0.2, 2.2, 1.9, 2.4],
                      [-1.9, -2.3, -2.0, -1.6, 0.2, 0.4, 1.8, 2.0],
                      [-2.0, 0.1, 0.3, -0.4, 0.2, 0.0, -0.1, 2.1]])

    def hmm(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init.log(), trans.log(), dist.Normal(locs, 0.5)), obs=x)

    def reference(keep):  # sum over sequences of log p(x_keep), keep (T,) bool
        log_init, log_trans = init.clamp_min(1e-300).log(), trans.clamp_min(1e-300).log()
        emit = dist.Normal(locs, 0.5).log_prob(x[..., None]) * keep[:, None]  # (n, T, S)
        alpha = log_init.expand(n, 3)
        for t in range(T):
            alpha = torch.logsumexp(alpha[..., :, None] + log_trans, -2) + emit[:, t]
        return torch.logsumexp(alpha, -1).sum()

    full = torch.ones(T, dtype=torch.bool)
    log_p = reference(full)
    pll = sum(log_p - reference(full & (torch.arange(T) != t)) for t in range(T))
    expected = {"order": -log_p, "exhaustive": -log_p, "pll": -pll}
    for masks, ref in expected.items():
        got = MaskedPretrainingLoss(masks=masks).differentiable_loss(hmm, None, x)
        g_got, g_ref = (torch.autograd.grad(v, locs, retain_graph=True)[0] for v in (got, ref))
        assert abs(float(got - ref)) < 1e-10, masks
        assert torch.allclose(g_got, g_ref, rtol=0, atol=1e-10), (masks, g_got, g_ref)
    ev = Evidence(hmm)(x).sum()
    assert torch.allclose(torch.autograd.grad(ev, locs)[0], torch.autograd.grad(log_p, locs)[0], rtol=0, atol=1e-10)


def test_multivariate_normal_emissions_match_brute_force(float64):
    """Emissions with correlated elements (a full covariance per state), tokens t * 2 + e:
    masked conditionals against sums over all 2^5 hidden paths of scipy's Gaussian marginals
    on each step's kept elements (1e-10); Evidence, exhaustive and order scores and the
    order loss's gradient equal DiscreteHMM.log_prob's. Before, every engine refused it."""
    from scipy.stats import multivariate_normal

    T, S, E, n = 4, 2, 2, 3
    g = torch.Generator().manual_seed(8)
    init = torch.randn(S, generator=g, dtype=torch.float64)
    trans = torch.randn(S, S, generator=g, dtype=torch.float64)
    locs = (2 * torch.randn(S, E, generator=g, dtype=torch.float64)).requires_grad_()
    A = torch.randn(S, E, E, generator=g, dtype=torch.float64)
    cov = A @ A.transpose(-1, -2) + 0.3 * torch.eye(E, dtype=torch.float64)
    x = torch.randn(n, T, E, generator=g, dtype=torch.float64)

    def hmm(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(init, trans, dist.MultivariateNormal(locs, cov)), obs=x)

    log_init = torch.log_softmax(init, 0).numpy()
    log_trans = torch.log_softmax(trans, -1).numpy()
    mu, C = locs.detach().numpy(), cov.numpy()

    def log_marginal(i, keep):  # keep (T, E) bool
        total = []
        for path in itertools.product(range(S), repeat=T + 1):
            lp = log_init[path[0]]
            for t in range(T):
                s, k = path[t + 1], keep[t]
                lp += log_trans[path[t], s]
                if k.any():
                    lp += multivariate_normal(mu[s][k], C[s][np.ix_(k, k)]).logpdf(x[i, t].numpy()[k])
            total.append(lp)
        return logsumexp(total)

    engine = DiscreteHMMConditionals()
    tokens = trace_tokens(hmm, None, (x,), {})
    state = engine.prepare(tokens, hmm, None, (x,), {})
    masks = torch.rand(3, n, T * E, generator=torch.Generator().manual_seed(9)) < 0.5
    masks[..., 0] = True
    logc = engine.mask_log_prob(state, tokens.value, masks).detach().numpy()
    for q in range(3):
        for i in range(n):
            ctx = ~masks[q, i].numpy().reshape(T, E)
            den = log_marginal(i, ctx)
            for j in np.flatnonzero(masks[q, i].numpy()):
                keep = ctx.copy()
                keep[j // E, j % E] = True
                assert abs(logc[q, i, j] - (log_marginal(i, keep) - den)) < 1e-10, (q, i, j)
    ref = dist.DiscreteHMM(init, trans, dist.MultivariateNormal(locs, cov)).log_prob(x)
    assert torch.allclose(Evidence(hmm)(x), ref, rtol=0, atol=1e-10)
    for masks in ("exhaustive", "order"):
        assert torch.allclose(MaskedPretrainingLoss(masks=masks).score(hmm, None, x), ref, rtol=0, atol=1e-10)
    loss = MaskedPretrainingLoss(masks="order").differentiable_loss(hmm, None, x)
    grad = torch.autograd.grad(loss, locs)[0]
    assert torch.allclose(grad, torch.autograd.grad(-ref.sum(), locs)[0], rtol=0, atol=1e-10)
