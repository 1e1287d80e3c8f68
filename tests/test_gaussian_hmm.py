"""The Kalman engine for an observed dist.GaussianHMM (conditionals='gaussian_hmm'): masked
conditionals against numpy/scipy conditioning of the sequence's joint Gaussian (written here),
evidence and gradients against Pyro's own GaussianHMM.log_prob, and the routing of "auto"."""

import math

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from scipy.stats import multivariate_normal, norm

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import (
    AUTO_MIN_TOKENS, EngineNotApplicable, GaussianConditionals, GaussianHMMConditionals, auto_engine,
)
from pyro_mpt.conditionals.gaussian_hmm import WIDE_HIDDEN
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_conditionals, numpy_lds_moments, saved_numel, sequences_model


def make_hmm(T, H, O, *, time_varying, full_noise, seed=0, requires_grad=False):
    """A GaussianHMM as users write it (torch, float64) and its parts per step (numpy)."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    lead = (T,) if time_varying else ()
    A = (0.6 * r(*lead, H, H) / H**0.5).requires_grad_(requires_grad)
    C = r(*lead, H, O).requires_grad_(requires_grad)
    m0, L0 = r(H), r(H, H)
    S0 = L0 @ L0.T + torch.eye(H, dtype=torch.float64)
    b, q = r(H), 0.3 + torch.rand(H, generator=g, dtype=torch.float64)
    d = r(O)
    if full_noise:
        LR = r(O, O)
        Rm = LR @ LR.T + 0.5 * torch.eye(O, dtype=torch.float64)
        obs = dist.MultivariateNormal(d, Rm)
    else:
        s = 0.4 + torch.rand(O, generator=g, dtype=torch.float64)
        Rm = torch.diag(s**2)
        obs = dist.Normal(d, s).to_event(1)
    hmm = dist.GaussianHMM(dist.MultivariateNormal(m0, S0), A, dist.Normal(b, q).to_event(1), C, obs, duration=T)
    steps = lambda t: [t.detach().numpy()] * T if t.dim() == 2 else list(t.detach().numpy())  # noqa: E731
    parts = (m0.numpy(), S0.numpy(), steps(A), [b.numpy()] * T, [np.diag(q.numpy() ** 2)] * T, steps(C),
             [d.numpy()] * T, [Rm.numpy()] * T)
    return hmm, parts


@pytest.mark.parametrize("T,H,O,time_varying,full_noise", [
    (1, 2, 2, False, False),
    (7, 3, 2, True, True),  # 7 steps: blocks of 3, the last padded
    (12, 2, 1, False, False),
    (5, 7, 3, True, True),  # H = 7: the LAPACK routines instead of the elementwise ones
    (4, 2, 7, False, True),  # O = 7 likewise for the observation noise
])
def test_masked_conditionals_equal_conditioning_of_the_joint_gaussian(T, H, O, time_varying, full_noise, float64):
    """Every (mask, datapoint) pair's targets, random masks including an empty context and a
    full one: the engine's log p(x_j | x_R) equals conditioning the sequence's joint Gaussian
    (moments and conditionals in numpy) to 1e-9."""
    hmm, parts = make_hmm(T, H, O, time_varying=time_varying, full_noise=full_noise)
    n, D = 3, T * O
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(6, n, D, generator=g) < 0.5
    mask[0] = True  # no context
    mask[1, :, 0] = True
    mask[1, :, 1:] = False  # one target
    got = engine.mask_log_prob(state, tokens.value, mask).numpy()
    mean, cov = numpy_lds_moments(*parts)
    want = numpy_conditionals(mean, cov, x.reshape(n, D).numpy(), mask.numpy())
    assert np.abs(np.where(mask.numpy(), got - want, 0.0)).max() < 1e-9


@pytest.mark.parametrize("full_noise", [False, True])
def test_evidence_and_gradients_equal_pyro_log_prob(full_noise, float64):
    """log_evidence (the blocked filter) equals Pyro's GaussianHMM.log_prob, with the gradients
    with respect to the transition and observation matrices (autograd through Pyro's parallel
    scan), to 1e-9; with missing tokens it equals scipy's density of the observed sub-vector."""
    T, H, O, n = 23, 2, 2, 4
    g = torch.Generator().manual_seed(3)
    A = (0.5 * torch.randn(T, H, H, generator=g, dtype=torch.float64)).requires_grad_()
    C = torch.randn(H, O, generator=g, dtype=torch.float64).requires_grad_()
    init = dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), torch.eye(H, dtype=torch.float64))
    trans = dist.Normal(torch.tensor(0.1, dtype=torch.float64), 0.6).expand([H]).to_event(1)
    obs = (dist.MultivariateNormal(torch.zeros(O, dtype=torch.float64), torch.tensor([[1.0, 0.4], [0.4, 0.8]], dtype=torch.float64))
           if full_noise else dist.Normal(0.0, torch.tensor(0.5, dtype=torch.float64)).expand([O]).to_event(1))
    hmm = dist.GaussianHMM(init, A, trans, C, obs, duration=T)
    x = torch.randn(n, T, O, generator=g, dtype=torch.float64)
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    got = engine.log_evidence(state, tokens.value)
    want = hmm.log_prob(x)
    assert torch.allclose(got, want, rtol=0, atol=1e-9)
    for a, b in zip(torch.autograd.grad(got.sum(), (A, C), retain_graph=True), torch.autograd.grad(want.sum(), (A, C))):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)
    # missing tokens: the density of the observed ones
    observed = torch.rand(n, T * O, generator=g) < 0.6
    with torch.no_grad():
        got = engine.log_evidence(state, tokens.value, observed).numpy()
        mean, cov = hmm_dense(hmm, T)
    for i in range(n):
        keep = observed[i].numpy()
        ref = multivariate_normal.logpdf(x.reshape(n, -1)[i, keep].numpy(), mean[keep], cov[np.ix_(keep, keep)])
        assert abs(got[i] - ref) < 1e-9


def hmm_dense(hmm, T):
    """The sequence's joint Gaussian from Pyro's own density: x's mean is where the
    log-density's gradient vanishes and its covariance the inverse of minus its Hessian."""
    D = T * hmm.obs_dim
    f = lambda v: hmm.log_prob(v.reshape(T, hmm.obs_dim))  # noqa: E731
    z = torch.zeros(D, dtype=torch.float64)
    Hs = torch.autograd.functional.hessian(f, z)
    gr = torch.autograd.functional.jacobian(f, z)
    prec = -Hs
    mean = torch.linalg.solve(prec, gr)
    return mean.numpy(), torch.linalg.inv(prec).numpy()


@pytest.mark.parametrize("full_noise", [False, True])
def test_training_gradients_equal_the_dense_path(full_noise, float64):
    """The default loss (masks per datapoint) and 'all' with masks shared: the Kalman engine and
    the dense covariance give the same value and gradients of the Pyro params, with the same
    masks (1e-9), also when the masks are split into chunks recomputed in the backward pass;
    with a full observation noise too (a context element's own conditional is not formed: its
    variance would be zero and its gradient not finite)."""
    T, H, n = 9, 2, 5
    O = 2 if full_noise else 1
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def model(x):
        A = pyro.param("A", 0.5 * torch.eye(H, dtype=torch.float64) + 0.1)
        C = pyro.param("C", torch.ones(H, O, dtype=torch.float64))
        s = pyro.param("s", torch.tensor(0.5, dtype=torch.float64), constraint=dist.constraints.positive)
        init = dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), torch.eye(H, dtype=torch.float64))
        trans = dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), 0.3 * torch.eye(H, dtype=torch.float64))
        if full_noise:
            tril = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64) * s
            obs = dist.MultivariateNormal(torch.zeros(O, dtype=torch.float64), scale_tril=tril)
        else:
            obs = dist.Normal(0.0, s).expand([O]).to_event(1)
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.GaussianHMM(init, A, trans, C, obs), obs=x)

    for kw in ({}, {"masks": "all", "share_masks": True}):
        results = []
        for engine in (GaussianConditionals("dense"), GaussianHMMConditionals(), GaussianHMMConditionals(max_elements=500)):
            pyro.clear_param_store()
            pyro.set_rng_seed(5)
            loss = MaskedPretrainingLoss(conditionals=engine, **kw).differentiable_loss(model, None, x)
            params = [pyro.param(k).unconstrained() for k in ("A", "C", "s")]
            results.append((loss.detach(), torch.autograd.grad(loss, params)))
        for value, grads in results[1:]:
            assert abs(float(value - results[0][0])) < 1e-9 * abs(float(value))
            for a, b in zip(grads, results[0][1]):
                assert torch.isfinite(a).all()
                assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


def _auto_routed(T, H, n, seed):
    """A homogeneous GaussianHMM of T steps (one element each) over n sequences, its model,
    data and tokens, and the engine "auto" picks for it."""
    hmm, _ = make_hmm(T, H, 1, time_varying=False, full_noise=False, seed=seed)
    x = torch.randn(n, T, 1, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    return hmm, model, x, tokens, auto_engine(tokens, model, None, (x,), {})[0]


def test_auto_routes_long_sequences_to_the_kalman_engine(float64):
    """'auto' and Evidence take the Kalman engine from AUTO_MIN_TOKENS tokens a sequence and the
    dense covariance below; both give Pyro's log_prob (1e-8); the engine declines a model with a
    latent and a site holding several sequences per datapoint."""
    H, O = 2, 1
    for T, kalman in ((AUTO_MIN_TOKENS - 1, False), (AUTO_MIN_TOKENS, True)):
        hmm, model, x, tokens, engine = _auto_routed(T, H, 2, seed=6)
        assert isinstance(engine, GaussianHMMConditionals) == kalman
        assert isinstance(engine, GaussianConditionals) != kalman
        assert torch.allclose(Evidence(model)(x), hmm.log_prob(x), rtol=0, atol=1e-8)
        assert torch.allclose(MaskedPretrainingLoss(masks="order").score(model, None, x), hmm.log_prob(x), rtol=0, atol=1e-8)
    hmm, _ = make_hmm(6, H, O, time_varying=False, full_noise=False)
    x = torch.randn(2, 6, O, dtype=torch.float64)

    def with_latent(x):
        eye = torch.eye(H, dtype=torch.float64)
        with pyro.plate("sequences", 2):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            obs = dist.Normal(z[..., None, None].expand(2, 1, O), 1.0).to_event(1)
            lds = dist.GaussianHMM(dist.MultivariateNormal(0 * eye[0], eye), 0.5 * eye, dist.MultivariateNormal(0 * eye[0], eye),
                                   torch.ones(H, O, dtype=torch.float64), obs)
            pyro.sample("x", lds, obs=x)

    def several(x):
        with pyro.plate("data", 1):
            pyro.sample("x", hmm.expand_by([2]).to_event(1), obs=x[None])

    for model, args, what in ((with_latent, (x,), "latent site"), (several, (x,), "per datapoint")):
        tokens = trace_tokens(model, None, args, {})
        with pytest.raises(EngineNotApplicable, match=what):
            GaussianHMMConditionals().prepare(tokens, model, None, args, {})


@pytest.mark.parametrize("H,O", [(2, 1), (4, 3), (8, 2)])
def test_saved_tensors_per_chunk_within_max_elements(H, O, float64):
    """The tensors the engine keeps for the backward pass of one chunk of (mask, datapoint)
    pairs stay within max_elements (counted by saved-tensor hooks), so a block of masks split
    into chunks recomputed in the backward pass keeps its memory bounded."""
    T, n, q = 16, 3, 8
    hmm, _ = make_hmm(T, H, O, time_varying=False, full_noise=True, seed=8, requires_grad=True)
    # gradients with respect to the parameters and the data record the whole computation
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(9), dtype=torch.float64).requires_grad_()
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    engine.max_elements = budget = 2 * n * engine._per_pair(state)  # two masks a chunk
    mask = torch.rand(q, n, T * O, generator=torch.Generator().manual_seed(10)) < 0.5
    saved, _ = saved_numel(lambda: engine.mask_log_prob(state, tokens.value, mask[:2]))
    assert budget / 4 < saved <= budget, (saved, budget)


@pytest.mark.parametrize("H,O,full_noise", [(2, 2, True), (7, 1, False)])
def test_leave_one_out_queries_take_one_smoothing_pass(H, O, full_noise, float64):
    """masks='pll' (every query hides one token): each leave-one-out conditional from one
    smoothing pass with the whole sequence in context, never one filter and smoother per query
    (spy; the per-query path took 20 s against the dense path's 0.1 s at T = 300, loss and
    gradient). The PLL equals numpy conditioning of the joint Gaussian (1e-9); with missing
    tokens each observed target is conditioned on the other observed tokens alone and a
    missing target scores 0; loss and gradients equal the dense path's (1e-9)."""
    T, n = 9, 3
    hmm, parts = make_hmm(T, H, O, time_varying=True, full_noise=full_noise, seed=8)
    D = T * O
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    calls = []
    conditionals = engine._conditionals
    engine._conditionals = lambda *a: calls.append(1) or conditionals(*a)
    mean, cov = numpy_lds_moments(*parts)
    xn = x.reshape(n, D).numpy()
    eye = torch.eye(D, dtype=torch.bool)
    got = engine.mask_sums(state, tokens.value, eye[:, None]).numpy()  # (D, n)
    want = numpy_conditionals(mean, cov, xn, np.broadcast_to(eye[:, None].numpy(), (D, n, D)))
    assert np.abs(got - want.sum(-1)).max() < 1e-9
    observed = torch.rand(n, D, generator=torch.Generator().manual_seed(10)) < 0.6
    observed[:, 0] = True
    got = engine.mask_sums_within(state, tokens.value, eye[:, None], observed[None]).numpy()
    for i in range(n):
        keep = observed[i].numpy()
        sub = numpy_conditionals(mean[keep], cov[np.ix_(keep, keep)], xn[i : i + 1, keep],
                                 np.eye(keep.sum(), dtype=bool)[:, None])
        want = np.zeros(D)
        want[keep] = sub.sum(-1)[:, 0]
        assert np.abs(got[:, i] - want).max() < 1e-9
    assert not calls

    m0, S0, A0, b, Q, C, d, R = (torch.as_tensor(t if i < 2 else t[0]) for i, t in enumerate(parts))
    init, trans, obs = dist.MultivariateNormal(m0, S0), dist.MultivariateNormal(b, Q), dist.MultivariateNormal(d, R)

    def trained(x):
        A = pyro.param("A", A0)
        with pyro.plate("sequences", n):
            pyro.sample("x", dist.GaussianHMM(init, A, trans, C, obs, duration=T), obs=x)

    results = []
    for eng in (GaussianConditionals("dense"), engine):
        pyro.clear_param_store()
        loss = MaskedPretrainingLoss(conditionals=eng, masks="pll").differentiable_loss(trained, None, x)
        results.append((loss.detach(), torch.autograd.grad(loss, [pyro.param("A").unconstrained()])[0]))
    assert abs(float(results[1][0] - results[0][0])) < 1e-9 * abs(float(results[0][0]))
    assert torch.allclose(results[1][1], results[0][1], rtol=1e-9, atol=1e-9)
    assert not calls


def test_masks_shared_by_the_batch_take_the_dense_covariance(float64, monkeypatch):
    """Masks shared by the batch (all but 'pll') go to the dense covariance's aggregated forms,
    which factorize each mask once for every datapoint; masks drawn per datapoint and the
    leave-one-out queries stay with the smoother. The shared loss equals the dense engine's
    with the same masks (1e-9)."""
    T, H, O, n = 12, 2, 1, 4
    hmm, _ = make_hmm(T, H, O, time_varying=False, full_noise=False, seed=11)
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    model = sequences_model(hmm, n)
    calls = []
    original = GaussianHMMConditionals._dense
    monkeypatch.setattr(GaussianHMMConditionals, "_dense", lambda self, state: calls.append(1) or original(self, state))
    for kw, dense in (({"masks": "all", "share_masks": True}, True), ({"masks": "all"}, False), ({"masks": "pll"}, False)):
        calls.clear()
        values = []
        for engine in (GaussianHMMConditionals(), GaussianConditionals("dense")):
            pyro.set_rng_seed(13)
            values.append(MaskedPretrainingLoss(conditionals=engine, **kw).loss(model, None, x))
        assert bool(calls) == dense, kw
        assert abs(values[0] - values[1]) < 1e-9 * abs(values[1])


def test_auto_threshold_grows_with_a_wide_hidden_state(float64):
    """Above hidden dim WIDE_HIDDEN the Kalman engine's steps cost more than the dense
    covariance until min_tokens * H / WIDE_HIDDEN tokens (H = 32, 256 tokens: 2.8 s against
    1.1 s, loss and gradient): 'auto' keeps the dense path below that and takes the Kalman
    engine from it (it took the Kalman engine from 256 tokens at any H); both equal Pyro's
    log_prob (1e-8), and the refusal names the scaled count."""
    H = 13
    need = math.ceil(AUTO_MIN_TOKENS * H / WIDE_HIDDEN)
    for T, kalman in ((AUTO_MIN_TOKENS, False), (need - 1, False), (need, True)):
        hmm, model, x, tokens, engine = _auto_routed(T, H, 1, seed=11)
        assert isinstance(engine, GaussianHMMConditionals) == kalman
        assert torch.allclose(Evidence(model)(x), hmm.log_prob(x), rtol=0, atol=1e-8)
        if not kalman:
            with pytest.raises(EngineNotApplicable, match=rf"fewer than {need} \(min_tokens=256 times hidden_dim 13 / 12\)"):
                GaussianHMMConditionals(min_tokens=AUTO_MIN_TOKENS).prepare(tokens, model, None, (x,), {})


@pytest.mark.parametrize("T", [1, 2, 5, 64, 300])
def test_evidence_by_pairwise_products_equals_pyro_log_prob(T, float64, monkeypatch):
    """log_evidence (and so Evidence and every 'order' sum) multiplies the steps' factors in
    pairs, log2 T levels, without the forward messages (spy: they are never formed; T = 1000,
    H = 2, N = 20, one thread, order loss + gradient 139 -> 58 ms, Trace_ELBO 60 ms), at
    lengths odd, even and a power of two: value and gradients equal Pyro's
    GaussianHMM.log_prob (1e-9 relative)."""
    import pyro_mpt.conditionals.gaussian_hmm as module

    monkeypatch.setattr(module, "forward_messages", lambda *a: pytest.fail("forward messages formed"))
    H, O, n = 3, 2, 2
    g = torch.Generator().manual_seed(14)
    A = (0.5 * torch.randn(T, H, H, generator=g, dtype=torch.float64) / H**0.5).requires_grad_()
    eye = torch.eye(H, dtype=torch.float64)
    hmm = dist.GaussianHMM(dist.MultivariateNormal(torch.randn(H, generator=g, dtype=torch.float64), 2 * eye), A,
                           dist.MultivariateNormal(0.1 * torch.ones(H, dtype=torch.float64), 0.4 * eye + 0.1),
                           torch.randn(H, O, generator=g, dtype=torch.float64),
                           dist.MultivariateNormal(torch.zeros(O, dtype=torch.float64), torch.tensor([[1.0, 0.4], [0.4, 0.8]], dtype=torch.float64)),
                           duration=T)
    x = torch.randn(n, T, O, generator=g, dtype=torch.float64)
    model = sequences_model(hmm, n)
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    got = engine.log_evidence(engine.prepare(tokens, model, None, (x,), {}), tokens.value)
    want = hmm.log_prob(x)
    assert torch.allclose(got, want, rtol=1e-9, atol=0)
    (a,), (b,) = torch.autograd.grad(got.sum(), [A], retain_graph=True), torch.autograd.grad(want.sum(), [A])
    assert torch.allclose(a, b, rtol=1e-9, atol=1e-9 * float(b.abs().max()))


def test_few_shared_masks_on_a_long_sequence_stay_with_the_smoother(float64, monkeypatch):
    """A few masks shared by the batch on a long sequence are smoothed, not sent to the dense
    covariance, whose preparation costs O(T^3) (one mask at T = 2000, N = 20, loss and
    gradient: 14 s and 2.4 GB dense, 0.55 s and 0.34 GB smoothed); many shared masks
    ('all') still go there (spy on the dense state). Loss and gradient equal the dense
    engine's with the same masks (1e-9)."""
    T, H, O, n = 130, 2, 1, 1
    hmm, _ = make_hmm(T, H, O, time_varying=False, full_noise=False, seed=16)
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    calls = []
    original = GaussianHMMConditionals._dense
    monkeypatch.setattr(GaussianHMMConditionals, "_dense", lambda self, state: calls.append(1) or original(self, state))
    A = torch.tensor([[0.5, 0.1], [0.0, 0.4]], dtype=torch.float64)

    def model(x):
        A_ = pyro.param("A", A)
        lds = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), torch.eye(H, dtype=torch.float64)),
                               A_, dist.Normal(torch.tensor(0.0, dtype=torch.float64), 0.5).expand([H]).to_event(1),
                               torch.ones(H, O, dtype=torch.float64),
                               dist.Normal(torch.tensor(0.0, dtype=torch.float64), 0.6).expand([O]).to_event(1), duration=T)
        with pyro.plate("sequences", n):
            pyro.sample("x", lds, obs=x)

    for kw, dense in (({"share_masks": True}, False), ({"masks": "stratified", "share_masks": True}, False),
                      ({"masks": "all", "share_masks": True}, True)):
        calls.clear()
        results = []
        for engine in (GaussianHMMConditionals(), GaussianConditionals("dense")):
            pyro.clear_param_store()
            pyro.set_rng_seed(18)
            loss = MaskedPretrainingLoss(conditionals=engine, **kw).differentiable_loss(model, None, x)
            results.append((loss.detach(), torch.autograd.grad(loss, [pyro.param("A").unconstrained()])[0]))
        assert bool(calls) == dense, kw
        assert abs(float(results[0][0] - results[1][0])) < 1e-9 * abs(float(results[1][0]))
        assert torch.allclose(results[0][1], results[1][1], rtol=1e-9, atol=1e-9)


def test_auto_sends_masks_per_datapoint_to_the_dense_covariance_where_cheaper(float64, monkeypatch):
    """Masks drawn per datapoint on sequences of AUTO_MIN_TOKENS to about 470 tokens cost
    the smoother more than the dense covariance's sums over the pairs (masks='all', T = 256,
    H = 2, N = 4, loss + gradient, one thread: 5.2 s against 3.1 s): 'auto' sends them there
    by a measured cost rule (spy on the dense state), and their sums equal numpy's
    conditioning of the sequence's joint Gaussian on the same masks; the engine asked for by
    name smooths them (same sums), and so does 'auto' for one mask per datapoint on a
    sequence of 1000 tokens, where smoothing is the cheaper."""
    calls = []
    original = GaussianHMMConditionals._dense
    monkeypatch.setattr(GaussianHMMConditionals, "_dense", lambda self, state: calls.append(1) or original(self, state))
    T, n = AUTO_MIN_TOKENS, 2
    hmm, model, x, tokens, engine = _auto_routed(T, 2, n, seed=20)
    assert isinstance(engine, GaussianHMMConditionals) and engine.dense_per_datapoint
    _, parts = make_hmm(T, 2, 1, time_varying=False, full_noise=False, seed=20)
    g = torch.Generator().manual_seed(21)
    # 12 masks of 2 datapoints: enough pairs to pay for the dense covariance's preparation
    mask = torch.rand(12, n, T, generator=g) < torch.linspace(0.05, 0.95, 12)[:, None, None]
    mean, cov = numpy_lds_moments(*parts)
    xs = x.reshape(n, T).numpy()
    want = np.zeros((12, n))
    for a in range(12):
        for i in range(n):
            # every target of the pair from one solve against its context block
            t, c = mask[a, i].numpy(), ~mask[a, i].numpy()
            G = np.linalg.solve(cov[np.ix_(c, c)], cov[np.ix_(c, t)])
            m = mean[t] + G.T @ (xs[i, c] - mean[c])
            v = np.diag(cov)[t] - (G * cov[np.ix_(c, t)]).sum(0)
            want[a, i] = norm.logpdf(xs[i, t], m, np.sqrt(v)).sum()
    for chosen, dense in ((engine, True), (GaussianHMMConditionals(), False)):
        calls.clear()
        got = chosen.mask_sums(chosen.prepare(tokens, model, None, (x,), {}), tokens.value, mask)
        assert bool(calls) == dense
        assert np.abs(got.numpy() - want).max() < 1e-9 * np.abs(want).max()
    calls.clear()
    hmm, model, x, tokens, engine = _auto_routed(1000, 2, 1, seed=22)
    state = engine.prepare(tokens, model, None, (x,), {})
    mask = torch.rand(1, 1, 1000, generator=g) < 0.5
    assert engine.recomputes_mask_sums(state, tokens.value, mask) is False
    sums = engine.mask_sums(state, tokens.value, mask)
    assert not calls and torch.isfinite(sums).all()


def test_a_markov_state_space_model_is_pointed_to_gaussian_hmm():
    """A linear-Gaussian state space model in pyro.markov, one observed site per step, is
    refused with a pointer to dist.GaussianHMM (before: to dist.DiscreteHMM, for discrete
    states); written so, it gives the Kalman filter's log p(x), Pyro's own log_prob (1e-10)."""
    T = 5
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def markov(x):
        with pyro.plate("data", x.shape[0]):
            z = torch.zeros(x.shape[0], dtype=torch.float64)
            for t in pyro.markov(range(T)):
                z = pyro.sample(f"z_{t}", dist.Normal(0.8 * z, 1.0))
                pyro.sample(f"x_{t}", dist.Normal(z, 0.5), obs=x[:, t])

    with pytest.raises(ValueError, match=r"one dist\.GaussianHMM site \(linear-Gaussian states"):
        Evidence(markov, method="exact")(x)
    one = torch.ones(1, 1, dtype=torch.float64)
    hmm = dist.GaussianHMM(dist.Normal(torch.zeros(1, dtype=torch.float64), 1.0).to_event(1), 0.8 * one,
                           dist.Normal(torch.zeros(1, dtype=torch.float64), 1.0).to_event(1), one,
                           dist.Normal(torch.zeros(1, dtype=torch.float64), 0.5).to_event(1), duration=T)

    def written(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", hmm, obs=x.unsqueeze(-1))

    assert torch.allclose(Evidence(written, method="exact")(x), hmm.log_prob(x.unsqueeze(-1)), rtol=0, atol=1e-10)
