"""Gaussian observations over several independent blocks of tokens (multi-output GPs,
MultivariateNormal with extra event dims) and GaussianHMM through the Gaussian engine
(issue 13 §5, §2)."""

import itertools

import numpy as np
import pytest
import torch
import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
from scipy.stats import multivariate_normal

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals, auto_engine
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_lds_moments


# ---------------------------------------------------------------------- references
def numpy_conditional(x, mean, cov, target, context):
    """log N(x_target | x_context) by the Schur complement, in numpy."""
    c = np.asarray(context, dtype=bool)
    if not c.any():
        return multivariate_normal.logpdf(x[target], mean[target], cov[target, target])
    S_cc = cov[np.ix_(c, c)]
    k = cov[target, c]
    w = np.linalg.solve(S_cc, k)
    m = mean[target] + w @ (x[c] - mean[c])
    v = cov[target, target] - k @ w
    return -0.5 * (np.log(2 * np.pi * v) + (x[target] - m) ** 2 / v)


def block_diag(*blocks):
    D = sum(b.shape[0] for b in blocks)
    out = np.zeros((D, D))
    i = 0
    for b in blocks:
        out[i : i + b.shape[0], i : i + b.shape[0]] = b
        i += b.shape[0]
    return out


def _gp(N=5, outputs=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = 5 * torch.rand(N, 1, generator=g, dtype=torch.float64)
    y = torch.stack([torch.sin(X[:, 0] + k) for k in range(outputs)]) + 0.3 * torch.randn(
        outputs, N, generator=g, dtype=torch.float64
    )
    kernel = gp.kernels.RBF(1, variance=torch.tensor(1.3, dtype=torch.float64),
                            lengthscale=torch.tensor(0.9, dtype=torch.float64))
    gpr = gp.models.GPRegression(X, y, kernel, noise=torch.tensor(0.05, dtype=torch.float64))
    K = (gpr.kernel(X) + (gpr.noise + gpr.jitter) * torch.eye(N)).detach().numpy()
    return gpr, X, y, K


# ---------------------------------------------------------------------- multi-output GP
def test_multi_output_gp_evidence_is_the_sum_over_outputs_and_shares_one_factor(float64):
    """GPRegression with y of shape (2, N) (Pyro writes MultivariateNormal(0, K).expand_by([2])
    .to_event(1)): Evidence equals scipy's log N(y_k; 0, K) summed over the outputs (1e-8),
    its gradient in the kernel and noise parameters equals that of torch's
    MultivariateNormal.log_prob summed (1e-8), and the engine keeps one N x N covariance
    for both outputs (no (2N)^2 matrix)."""
    gpr, X, y, K = _gp()
    want = sum(multivariate_normal.logpdf(y[k].numpy(), np.zeros(5), K) for k in range(2))
    got = Evidence(gpr.model)()
    assert got.shape == ()
    assert abs(float(got) - want) < 1e-8

    params = [gpr.kernel.variance_unconstrained, gpr.kernel.lengthscale_unconstrained, gpr.noise_unconstrained]
    grads = torch.autograd.grad(Evidence(gpr.model)(), params)
    cov = gpr.kernel(X) + (gpr.noise + gpr.jitter) * torch.eye(5)
    ref = dist.MultivariateNormal(torch.zeros(5), cov).log_prob(y).sum()
    for a, b in zip(grads, torch.autograd.grad(ref, params)):
        assert abs(float(a) - float(b)) < 1e-8 * max(1.0, abs(float(b)))

    tokens = trace_tokens(gpr.model, None, (), {})
    engine, state = auto_engine(tokens, gpr.model, None, (), {})
    assert isinstance(engine, GaussianConditionals)
    assert state.num_blocks == 2 and tuple(state.inner.covariance.shape) == (1, 5, 5)


def test_multi_output_gp_exhaustive_order_and_chains_equal_the_evidence(float64):
    """Exhaustive MPT (1023 masks of the 10 tokens) and the order schedule equal the
    evidence (1e-8); the engine's chain-rule terms along 3 random orderings of all 10
    tokens equal numpy's Schur-complement conditionals of the block-diagonal covariance
    (1e-8), each block conditioning only on its own earlier-revealed tokens."""
    gpr, X, y, K = _gp()
    want = sum(multivariate_normal.logpdf(y[k].numpy(), np.zeros(5), K) for k in range(2))
    exhaustive = MaskedPretrainingLoss(masks="exhaustive").score(gpr.model, None)
    order = MaskedPretrainingLoss(masks="order", num_masks=2).score(gpr.model, None)
    assert abs(float(exhaustive) - want) < 1e-8
    assert abs(float(order) - want) < 1e-8

    tokens = trace_tokens(gpr.model, None, (), {})
    engine = GaussianConditionals()
    state = engine.prepare(tokens, gpr.model, None, (), {})
    g = torch.Generator().manual_seed(1)
    orders = torch.stack([torch.randperm(10, generator=g) for _ in range(3)])[:, None, :]
    terms = engine.chain_log_prob(state, tokens.value, orders)  # (3, 1, 10)
    cov = block_diag(K, K)
    x = y.reshape(-1).numpy()
    for p in range(3):
        o = orders[p, 0].numpy()
        for t in range(10):
            context = np.zeros(10, bool)
            context[o[t + 1 :]] = True
            ref = numpy_conditional(x, np.zeros(10), cov, o[t], context)
            assert abs(float(terms[p, 0, t]) - ref) < 1e-8
        assert abs(float(terms[p, 0].sum()) - want) < 1e-8


def test_multi_output_gp_pll_is_the_brute_force_leave_one_out(float64):
    """masks="pll": sum over the 2N tokens of log p(y_kj | y_-kj), which for independent
    outputs is each output's leave-one-out (numpy Schur complement on the 2N x 2N
    block-diagonal covariance, 1e-8); the loss's gradient in the kernel and noise
    parameters equals autograd of the closed-form leave-one-out (1e-8)."""
    gpr, X, y, K = _gp()
    cov = block_diag(K, K)
    x = y.reshape(-1).numpy()
    want = sum(numpy_conditional(x, np.zeros(10), cov, j, np.arange(10) != j) for j in range(10))
    got = MaskedPretrainingLoss(masks="pll").score(gpr.model, None)
    assert abs(float(got) - want) < 1e-8

    # gradient: autograd of Rasmussen & Williams eq. 5.12 per output, written with torch.linalg.inv
    params = [gpr.kernel.variance_unconstrained, gpr.kernel.lengthscale_unconstrained, gpr.noise_unconstrained]
    loss = MaskedPretrainingLoss(masks="pll").differentiable_loss(gpr.model, lambda: None)
    Ki = torch.linalg.inv(gpr.kernel(X) + (gpr.noise + gpr.jitter) * torch.eye(5))
    v = 1 / torch.diagonal(Ki)
    ref = -(-0.5 * torch.log(2 * np.pi * v) - 0.5 * (y @ Ki) ** 2 * v).sum()
    assert abs(float(loss) - float(ref)) < 1e-8
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
        assert abs(float(a) - float(b)) < 1e-8 * max(1.0, abs(float(b)))


# ---------------------------------------------------------------------- per-block covariances
def _blocks_model(seed=2, n=3, B=3, N=3):
    """n datapoints, each B MultivariateNormal blocks of N tokens with their own means
    and covariances (.to_event(1) over the blocks)."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(n, B, N, generator=g, dtype=torch.float64)
    L = torch.randn(B, N, N, generator=g, dtype=torch.float64)
    cov = L @ L.transpose(-1, -2) + torch.eye(N, dtype=torch.float64)
    x = torch.randn(n, B, N, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(loc, cov).to_event(1), obs=x)

    dense = [block_diag(*cov.numpy()) for _ in range(n)]
    return model, x, loc.reshape(n, -1).numpy(), dense


def test_float32_multi_output_gp_keeps_its_small_noise():
    """float32 GPRegression, RBF with lengthscale 10 and noise 1e-6, three outputs: the blocks'
    covariance was torch's float32 L L^T of the model's scale_tril, which loses the noise
    (log p 3832 nats above the reference, silently), where the single-output path forms it in
    float64. Evidence and the "order" score now equal scipy's density under L L^T in float64
    (L: the float32 model's own factor), and the sum of the single-output values."""
    torch.manual_seed(8)
    N, B = 50, 3
    X = torch.linspace(0, 5, N)[:, None]
    Y = (torch.sin(X[:, 0]).double() + 0.01 * torch.randn(B, N, dtype=torch.float64)).float()

    def gpr(y):
        pyro.clear_param_store()
        return gp.models.GPRegression(X, y, gp.kernels.RBF(1, lengthscale=torch.tensor(10.0)), noise=torch.tensor(1e-6))

    L = pyro.poutine.trace(gpr(Y[0]).model).get_trace().nodes["y"]["fn"].scale_tril.detach().double().numpy()
    ref = sum(multivariate_normal(np.zeros(N), L @ L.T).logpdf(r) for r in Y.double().numpy())
    tol = 1e-5 * abs(ref)  # float32 results of a float64 computation
    multi = float(Evidence(gpr(Y).model)())
    assert abs(multi - ref) < tol, (multi, ref)
    assert abs(float(MaskedPretrainingLoss(masks="order").score(gpr(Y).model, None)) - ref) < tol
    assert abs(sum(float(Evidence(gpr(Y[b]).model)()) for b in range(B)) - ref) < tol


def test_blocks_with_their_own_covariances_random_masks_against_numpy(float64):
    """Per-datapoint means and per-block covariances: Evidence and exhaustive MPT equal
    scipy's density of the block-diagonal Gaussian (1e-8); the log-conditionals of 6 random
    masks per datapoint equal numpy's Schur complements (1e-8)."""
    model, x, mean, dense = _blocks_model()
    n, D = 3, 9
    flat = x.reshape(n, D).numpy()
    want = np.array([multivariate_normal.logpdf(flat[i], mean[i], dense[i]) for i in range(n)])
    assert np.abs(Evidence(model)(x).numpy() - want).max() < 1e-8
    assert np.abs(MaskedPretrainingLoss(masks="exhaustive").score(model, None, x).numpy() - want).max() < 1e-8

    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(3)
    masks = torch.rand(6, n, D, generator=g) < 0.5
    logc = engine.mask_log_prob(state, tokens.value, masks).numpy()
    sums = engine.mask_sums(state, tokens.value, masks).numpy()
    for q, i in itertools.product(range(6), range(n)):
        m = masks[q, i].numpy()
        refs = [numpy_conditional(flat[i], mean[i], dense[i], j, ~m) for j in np.flatnonzero(m)]
        assert np.abs(logc[q, i, m] - refs).max(initial=0) < 1e-8
        assert abs(sums[q, i] - sum(refs)) < 1e-8


def test_latent_shared_by_blocks_gives_the_dense_marginal(float64):
    """A latent z ~ N(0, 1) in the location of two MultivariateNormal blocks (in a token
    plate, and with .to_event(1)) couples the blocks: the marginal is N(0, I + 1 1^T) over
    the 4 tokens (scipy, 1e-10 for Evidence, 1e-8 for exhaustive MPT)."""
    x = torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def in_token_plate(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", 2, dim=-1):
                loc = z.unsqueeze(-1).expand(z.shape[:-1] + (2, 2))
                pyro.sample("x", dist.MultivariateNormal(loc, torch.eye(2)), obs=x)

    def to_event(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            loc = z[:, None, None].expand(z.shape + (2, 2))
            pyro.sample("x", dist.MultivariateNormal(loc, torch.eye(2)).to_event(1), obs=x)

    want = multivariate_normal.logpdf(x.reshape(4, 4).numpy(), np.zeros(4), np.eye(4) + 1)
    for model, plates in ((in_token_plate, ("tokens",)), (to_event, None)):
        got = Evidence(model, token_plates=plates)(x)
        assert np.abs(got.numpy() - want).max() < 1e-10
        score = MaskedPretrainingLoss(masks="exhaustive", token_plates=plates).score(model, None, x)
        assert np.abs(score.numpy() - want).max() < 1e-8


# ---------------------------------------------------------------------- GaussianHMM
def _gaussian_hmm(seed=5, time_varying=False, H=2, O=2, T=4):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    def spd(*s):
        L = r(*s)
        return L @ L.transpose(-1, -2) + torch.eye(s[-1], dtype=torch.float64)

    init = dist.MultivariateNormal(r(H), spd(H, H))
    if time_varying:
        trans = dist.MultivariateNormal(r(T, H), spd(T, H, H))
        obs = dist.MultivariateNormal(r(T, O), spd(T, O, O))
        return dist.GaussianHMM(init, 0.6 * r(T, H, H), trans, r(T, H, O), obs)
    trans = dist.Normal(r(H), torch.rand(H, generator=g, dtype=torch.float64) + 0.5).to_event(1)
    obs = dist.Normal(r(O), torch.rand(O, generator=g, dtype=torch.float64) + 0.5).to_event(1)
    return dist.GaussianHMM(init, 0.6 * r(H, H), trans, r(H, O), obs)


@pytest.mark.parametrize("time_varying", [False, True], ids=["homogeneous", "time-varying"])
def test_gaussian_hmm_evidence_exhaustive_and_order_equal_log_prob(time_varying, float64):
    """An observed dist.GaussianHMM (T = 4 steps of O = 2, so D = 8 tokens) in a plate of
    sequences: "auto" picks the Gaussian engine; Evidence, exhaustive MPT (255 masks), the
    order schedule and the engine's chain terms along 4 random orderings all equal
    GaussianHMM.log_prob (Pyro's parallel-scan Kalman filter) to 1e-8."""
    hmm = _gaussian_hmm(time_varying=time_varying)
    x = torch.randn(5, 4, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", hmm, obs=x)

    want = hmm.log_prob(x)
    assert (Evidence(model, method="exact")(x) - want).abs().max() < 1e-8
    assert (MaskedPretrainingLoss(masks="exhaustive").score(model, None, x) - want).abs().max() < 1e-8
    assert (MaskedPretrainingLoss(masks="order").score(model, None, x) - want).abs().max() < 1e-8
    tokens = trace_tokens(model, None, (x,), {})
    engine, state = auto_engine(tokens, model, None, (x,), {})
    assert isinstance(engine, GaussianConditionals)
    g = torch.Generator().manual_seed(7)
    orders = torch.stack([torch.randperm(8, generator=g) for _ in range(4)])[:, None, :]
    chains = engine.chain_log_prob(state, tokens.value, orders).sum(-1)
    assert (chains - want).abs().max() < 1e-8


def test_gaussian_hmms_as_blocks_of_a_datapoint(float64):
    """Two GaussianHMM sequences per datapoint (.expand_by([2]).to_event(1)): the
    homogeneous HMM's free time dim is read from the data, and Evidence and the order
    schedule equal GaussianHMM.log_prob summed over the two sequences (1e-8)."""
    hmm = _gaussian_hmm(seed=8)
    x = torch.randn(3, 2, 5, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", hmm.expand_by([2]).to_event(1), obs=x)

    want = hmm.log_prob(x).sum(-1)
    assert (Evidence(model)(x) - want).abs().max() < 1e-8
    assert (MaskedPretrainingLoss(masks="order").score(model, None, x) - want).abs().max() < 1e-8


def test_missing_blocks_are_left_out(float64):
    """Whole blocks missing (dist.mask over the blocks, inside .to_event): Evidence, the
    order schedule and exhaustive MPT equal the density of the observed blocks alone
    (scipy, 1e-8); a datapoint with no observed block scores 0."""
    model, x, mean, dense = _blocks_model(seed=10)
    n, B, N = 3, 3, 3
    observed = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])

    def masked(x):
        g = torch.Generator().manual_seed(10)
        loc = torch.randn(n, B, N, generator=g, dtype=torch.float64)
        L = torch.randn(B, N, N, generator=g, dtype=torch.float64)
        cov = L @ L.transpose(-1, -2) + torch.eye(N, dtype=torch.float64)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(loc, cov).mask(observed).to_event(1), obs=x)

    flat = x.reshape(n, B * N).numpy()
    want = []
    for i in range(n):
        keep = np.repeat(observed[i].numpy(), N)
        want.append(multivariate_normal.logpdf(flat[i, keep], mean[i, keep], dense[i][np.ix_(keep, keep)]) if keep.any() else 0.0)
    want = np.array(want)
    assert np.abs(Evidence(masked)(x).numpy() - want).max() < 1e-8
    assert np.abs(MaskedPretrainingLoss(masks="order").score(masked, None, x).numpy() - want).max() < 1e-8
    assert np.abs(MaskedPretrainingLoss(masks="exhaustive").score(masked, None, x).numpy() - want).max() < 1e-8


def test_gaussian_hmm_with_a_latent_offset_matches_numpy_moments(float64):
    """A GaussianHMM whose observation offset is a latent z ~ N(0, 1) per sequence: the
    marginal is N(mu, Sigma + 1 1^T) with (mu, Sigma) the linear dynamical system's moments,
    written in numpy; Evidence and exhaustive MPT equal scipy's density (1e-8)."""
    g = torch.Generator().manual_seed(11)
    H, O, T = 2, 2, 3

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    m0, L0, A, b, C, d = r(H), r(H, H), 0.5 * r(H, H), r(H), r(H, O), r(O)
    S0 = L0 @ L0.T + torch.eye(H)
    q, s = torch.rand(H, generator=g) + 0.5, torch.rand(O, generator=g) + 0.5
    x = r(4, T, O)

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            obs = dist.Normal(d + z[..., None, None], s).to_event(1)
            hmm = dist.GaussianHMM(dist.MultivariateNormal(m0, S0), A, dist.Normal(b, q).to_event(1), C, obs)
            pyro.sample("x", hmm, obs=x)

    mean, cov = numpy_lds_moments(m0.numpy(), S0.numpy(), [A.numpy()] * T, [b.numpy()] * T, [np.diag(q.numpy() ** 2)] * T,
                                  [C.numpy()] * T, [d.numpy()] * T, [np.diag(s.numpy() ** 2)] * T)
    want = multivariate_normal.logpdf(x.reshape(4, -1).numpy(), mean, cov + 1.0)
    assert np.abs(Evidence(model)(x).numpy() - want).max() < 1e-8
    assert np.abs(MaskedPretrainingLoss(masks="exhaustive").score(model, None, x).numpy() - want).max() < 1e-8


def test_multi_output_sparse_gp_is_served_on_the_low_rank_path(float64):
    """SparseGPRegression (approx "DTC" and "FITC") with y of shape (2, N) observes a
    LowRankMultivariateNormal expanded over the outputs: Evidence and the order schedule
    equal Pyro's log_prob of that site (1e-8), with one shared low-rank block."""
    g = torch.Generator().manual_seed(12)
    X = 5 * torch.rand(30, 1, generator=g, dtype=torch.float64)
    y = torch.randn(2, 30, generator=g, dtype=torch.float64)
    Xu = torch.linspace(0, 5, 6, dtype=torch.float64)[:, None]
    for approx in ("DTC", "FITC"):
        sgp = gp.models.SparseGPRegression(X, y, gp.kernels.RBF(1), Xu, noise=torch.tensor(0.1), approx=approx)
        want = float(pyro.poutine.trace(sgp.model).get_trace().nodes["y"]["fn"].log_prob(y))
        assert abs(float(Evidence(sgp.model)()) - want) < 1e-8
        assert abs(float(MaskedPretrainingLoss(masks="order").score(sgp.model, None)) - want) < 1e-8
        tokens = trace_tokens(sgp.model, None, (), {})
        state = GaussianConditionals().prepare(tokens, sgp.model, None, (), {})
        assert state.num_blocks == 2 and state.inner.is_low_rank and state.inner.cov_factor.shape[0] == 1


def test_gaussian_hmm_expanded_over_the_batch_has_its_moments_built_once():
    """A GaussianHMM with shared parameters expanded to 6 sequences (as Pyro's plate does):
    its moments are built once (batch of size 1, broadcast to the 6), and the Gaussian
    they make is Pyro's own ``GaussianHMM.log_prob`` of every sequence."""
    from pyro_mpt.conditionals.linear_dynamical import gaussian_hmm_moments

    g = torch.Generator().manual_seed(3)
    H, O, T = 2, 1, 7
    A = 0.6 * torch.randn(H, H, generator=g, dtype=torch.float64)
    C = torch.randn(H, O, generator=g, dtype=torch.float64)
    init = dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), torch.eye(H, dtype=torch.float64))
    trans = dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), 0.3 * torch.eye(H, dtype=torch.float64))
    obs = dist.MultivariateNormal(torch.zeros(O, dtype=torch.float64), 0.5 * torch.eye(O, dtype=torch.float64))
    hmm = dist.GaussianHMM(init, A, trans, C, obs, duration=T).expand([6])
    loc, cov = gaussian_hmm_moments(hmm, T)
    assert loc.shape[:-1].numel() == 1 and cov.shape[:-2].numel() == 1
    x = torch.randn(6, T, O, generator=g, dtype=torch.float64)
    got = dist.MultivariateNormal(loc, cov).log_prob(x.reshape(6, T * O))
    assert torch.allclose(got, hmm.log_prob(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("time_varying", [False, True], ids=["homogeneous", "time-varying"])
@pytest.mark.parametrize("H", [3, 9])
def test_gaussian_hmm_moments_of_a_long_sequence_and_their_gradients(time_varying, H, float64):
    """The moments of a GaussianHMM over T = 37 steps, for small and larger hidden states,
    homogeneous and time-varying: the Gaussian they make equals
    Pyro's GaussianHMM.log_prob (its parallel-scan Kalman filter) to 1e-9, and so do its
    gradients with respect to the transition and observation matrices (autograd through
    Pyro's filter). The noises have one scale shared by the coordinates, as users write them
    (``dist.Normal(loc, 0.5).to_event(1)``; they used to crash the moments)."""
    from pyro_mpt.conditionals.linear_dynamical import gaussian_hmm_moments

    g = torch.Generator().manual_seed(13)
    O, T = 2, 37
    shape = (T,) if time_varying else ()
    # spectral radius below one (orthogonal times 0.9, perturbed): covariances stay O(1) over 37 steps
    Qr = torch.linalg.qr(torch.randn(*shape, H, H, generator=g, dtype=torch.float64))[0]
    A = (0.9 * Qr + 0.02 * torch.randn(*shape, H, H, generator=g, dtype=torch.float64)).requires_grad_()
    C = torch.randn(*shape, H, O, generator=g, dtype=torch.float64).requires_grad_()
    init = dist.MultivariateNormal(torch.randn(H, generator=g, dtype=torch.float64), torch.eye(H, dtype=torch.float64))
    trans = dist.Normal(torch.randn(H, generator=g, dtype=torch.float64), 0.5).to_event(1)
    L = torch.randn(O, O, generator=g, dtype=torch.float64)
    obs = dist.MultivariateNormal(torch.randn(O, generator=g, dtype=torch.float64), L @ L.T + torch.eye(O, dtype=torch.float64))
    if not time_varying:  # one location and scale shared by the coordinates, as users write it
        obs = dist.Normal(torch.tensor(0.2, dtype=torch.float64), 0.7).expand([O]).to_event(1)
    hmm = dist.GaussianHMM(init, A, trans, C, obs, duration=T)
    x = torch.randn(3, T, O, generator=g, dtype=torch.float64)
    loc, cov = gaussian_hmm_moments(hmm, T)
    got = dist.MultivariateNormal(loc, cov).log_prob(x.reshape(3, T * O))
    want = hmm.log_prob(x)
    assert torch.allclose(got, want, rtol=0, atol=1e-9)
    grads = torch.autograd.grad(got.sum(), (A, C), retain_graph=True)
    wants = torch.autograd.grad(want.sum(), (A, C))
    for a, b in zip(grads, wants):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)
