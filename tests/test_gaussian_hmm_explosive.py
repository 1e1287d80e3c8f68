"""The Kalman engine on a dist.GaussianHMM with explosive dynamics (transition matrices of
spectral radius > 1), whose states' variance grows as rho^(2k) over k steps without context:
masked conditionals and evidence against a textbook moment-form Kalman filter in mpmath (written
here, at enough digits for the variance's growth), against numpy conditioning of the joint
Gaussian where float64 holds it, gradients against autograd of Pyro's GaussianHMM.log_prob and
of the information form, SVI through radius > 1, and the dense covariance's refusal."""

import mpmath as mp
import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianHMMConditionals
from pyro_mpt.conditionals import gaussian_hmm
from pyro_mpt.observed_tokens import trace_tokens

from models import numpy_conditionals, numpy_lds_moments, sequences_model


def mp_log_density(parts, x, keep, dps):
    """log p(x[keep]) of a GaussianHMM (row vectors, per-step parts as numpy_lds_moments takes
    them) by the textbook moment-form Kalman filter in mpmath at ``dps`` digits: predict, then
    condition on the step's kept elements through the innovation covariance."""
    m0, S0, A, b, Q, C, d, R = parts
    T, O = x.shape
    with mp.workdps(dps):
        M = lambda a: mp.matrix(np.atleast_2d(a).tolist())  # noqa: E731
        m, P, total = M(m0), M(S0), mp.mpf(0)
        for t in range(T):
            At = M(A[t])
            m, P = m * At + M(b[t]), At.T * P * At + M(Q[t])
            idx = [o for o in range(O) if keep[t, o]]
            if not idx:
                continue
            Ct, Rt = M(C[t]), M(R[t])
            Cc = mp.matrix([[Ct[i, o] for o in idx] for i in range(Ct.rows)])
            Rc = mp.matrix([[Rt[i, j] for j in idx] for i in idx])
            r = mp.matrix([[x[t, o] - d[t][o] for o in idx]]) - m * Cc
            S = Cc.T * P * Cc + Rc
            Si = S**-1
            total += -0.5 * (r * Si * r.T)[0, 0] - 0.5 * mp.log(mp.det(S)) - 0.5 * len(idx) * mp.log(2 * mp.pi)
            K = P * Cc * Si
            m, P = m + r * K.T, P - K * S * K.T
        return float(total)


def explosive_hmm(T, H, O, rho, *, mixed, seed=0):
    """A homogeneous GaussianHMM whose transition matrix has spectral radius ``rho``: ``rho``
    times a rotation (every direction grows alike), or (``mixed``) eigenvalues from 0.3 to ``rho``
    with non-orthogonal eigenvectors; its parts per step (numpy)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if mixed:
        V = r(H, H)
        A = torch.linalg.solve(V, torch.diag(torch.linspace(0.3, rho, H, dtype=torch.float64)) @ V)
    else:
        U = torch.linalg.qr(r(H, H))[0]
        if torch.linalg.det(U) < 0:
            U[:, 0] = -U[:, 0]  # a rotation: a reflection's symmetric square leaves directions uninformed
        A = rho * U
    C, m0, b, d = r(H, O), r(H), 0.1 * r(H), r(O)
    q, s = torch.full((H,), 0.5, dtype=torch.float64), 0.5 + torch.rand(O, generator=g, dtype=torch.float64)
    S0 = torch.eye(H, dtype=torch.float64)
    hmm = dist.GaussianHMM(dist.MultivariateNormal(m0, S0), A, dist.Normal(b, q).to_event(1), C,
                           dist.Normal(d, s).to_event(1), duration=T)
    parts = (m0.numpy(), S0.numpy(), [A.numpy()] * T, [b.numpy()] * T, [np.diag(q.numpy() ** 2)] * T,
             [C.numpy()] * T, [d.numpy()] * T, [np.diag(s.numpy() ** 2)] * T)
    return hmm, parts


def _prepared(hmm, x):
    model = sequences_model(hmm, x.shape[0])
    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    return engine, engine.prepare(tokens, model, None, (x,), {}), tokens


def _stretch_masks(n, D, g):
    """Masks (4, n, D): a masked half in the middle, the second half and the first eighth,
    everything but the first and last eighth, and random at rate 0.9 (long runs)."""
    mask = torch.zeros(4, n, D, dtype=torch.bool)
    mask[0, :, D // 4 : 3 * D // 4] = True
    mask[1, :, D // 2 :] = True
    mask[1, :, : D // 8] = True
    mask[2, :, D // 8 : D - D // 8] = True
    mask[3] = torch.rand(n, D, generator=g) < 0.9
    return mask


@pytest.mark.parametrize("T,H,O,rho,mixed", [
    (300, 2, 1, 1.22, False),  # the new user's radius: variance 1e26 over the masked half
    (200, 2, 1, 1.5, False),  # 1e35 over the second half, 1e53 at the last step
    (160, 4, 2, 1.3, True),  # 0.3 .. 1.3: covariances of condition 1e18 and beyond
])
def test_masked_conditionals_equal_an_mpmath_kalman_filter(T, H, O, rho, mixed, float64):
    """log p(x_j | x_R) for targets on long masked stretches (in the middle, to the end, the
    whole inside, random at rate 0.9) equals log p(x_{R+j}) - log p(x_R) by an mpmath filter
    at 120 digits to 1e-8 (measured: below 4e-13; on main the engine raised
    gaussian-hmm-not-finite on the first three masks), and log_evidence to 1e-8 too."""
    hmm, parts = explosive_hmm(T, H, O, rho, mixed=mixed)
    n, D = 2, T * O
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, T, O, generator=g, dtype=torch.float64)
    engine, state, tokens = _prepared(hmm, x)
    assert state.explosive
    mask = _stretch_masks(n, D, g)
    got = engine.mask_log_prob(state, tokens.value, mask).numpy()
    worst = 0.0
    for a in range(mask.shape[0]):
        for i in range(n):
            keep = (~mask[a, i]).reshape(T, O).numpy()
            base = mp_log_density(parts, x[i].numpy(), keep, 120)
            targets = np.flatnonzero(mask[a, i].numpy())
            for j in targets[np.linspace(0, len(targets) - 1, 4).astype(int)]:
                more = keep.copy()
                more.reshape(-1)[j] = True
                worst = max(worst, abs(got[a, i, j] - (mp_log_density(parts, x[i].numpy(), more, 120) - base)))
    assert worst < 1e-8
    want = [mp_log_density(parts, x[i].numpy(), np.ones((T, O), bool), 120) for i in range(n)]
    assert np.abs(engine.log_evidence(state, tokens.value).numpy() - want).max() < 1e-8
    observed = ~mask[1]
    want = [mp_log_density(parts, x[i].numpy(), observed[i].reshape(T, O).numpy(), 120) for i in range(n)]
    assert np.abs(engine.log_evidence(state, tokens.value, observed).numpy() - want).max() < 1e-8


def test_square_root_filter_equals_conditioning_of_the_joint_gaussian(float64, monkeypatch):
    """Where float64 holds the sequence's joint Gaussian (radius 1.08, 40 steps: variances
    within 1e3 of each other), the square-root filter, forced at every step, gives numpy's
    conditionals to 1e-9 and the same value and gradients (A, C, the noise scale) as the
    information form, to 1e-9."""
    T, H, O, n = 40, 3, 2, 2
    g = torch.Generator().manual_seed(7)
    A0 = 1.08 * torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))[0]
    C0 = torch.randn(H, O, generator=g, dtype=torch.float64)
    x = torch.randn(n, T, O, generator=g, dtype=torch.float64)
    mask = torch.rand(3, n, T * O, generator=g) < 0.6
    mask[0, :, 10:70] = True

    def run(rtol):
        monkeypatch.setattr(gaussian_hmm, "INFORMATION_RTOL", rtol)
        A, C = A0.clone().requires_grad_(), C0.clone().requires_grad_()
        s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        hmm = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), torch.eye(H, dtype=torch.float64)),
                               A, dist.Normal(torch.zeros(H, dtype=torch.float64), 0.6).to_event(1), C,
                               dist.Normal(torch.zeros(O, dtype=torch.float64), s).to_event(1), duration=T)
        engine, state, tokens = _prepared(hmm, x)
        lp = engine.mask_log_prob(state, tokens.value, mask)
        value = torch.where(mask, lp, 0.0).sum()
        return lp.detach().numpy(), value.detach(), torch.autograd.grad(value, (A, C, s))

    root, root_value, root_grads = run(float("inf"))  # no step trusts the information form
    info, info_value, info_grads = run(0.0)  # every step does
    parts = (np.zeros(H), np.eye(H), [A0.numpy()] * T, [np.zeros(H)] * T, [0.36 * np.eye(H)] * T, [C0.numpy()] * T,
             [np.zeros(O)] * T, [0.49 * np.eye(O)] * T)
    mean, cov = numpy_lds_moments(*parts)
    want = numpy_conditionals(mean, cov, x.reshape(n, -1).numpy(), mask.numpy())
    assert np.abs(np.where(mask.numpy(), root - want, 0.0)).max() < 1e-9
    assert np.abs(np.where(mask.numpy(), info - want, 0.0)).max() < 1e-9
    assert abs(float(root_value - info_value)) < 1e-9 * abs(float(info_value))
    for a, b in zip(root_grads, info_grads):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


def test_evidence_gradients_equal_autograd_of_pyro_log_prob(float64):
    """log_evidence at radius 1.25 over 120 steps (the square-root filter) and its gradients
    with respect to the transition and observation matrices equal Pyro's GaussianHMM.log_prob
    and autograd through it, to 1e-8 (relative); the values equal the mpmath filter to 1e-8."""
    T, H, O, n = 120, 2, 1, 3
    _, parts = explosive_hmm(T, H, O, 1.25, mixed=False, seed=3)
    A = torch.tensor(parts[2][0]).requires_grad_()
    C = torch.tensor(parts[5][0]).requires_grad_()
    hmm = dist.GaussianHMM(dist.MultivariateNormal(torch.tensor(parts[0]), torch.tensor(parts[1])), A,
                           dist.Normal(torch.tensor(parts[3][0]), 0.5).to_event(1), C,
                           dist.Normal(torch.tensor(parts[6][0]), torch.tensor(np.sqrt(np.diag(parts[7][0])))).to_event(1),
                           duration=T)
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    engine, state, tokens = _prepared(hmm, x)
    got = engine.log_evidence(state, tokens.value)
    want = hmm.log_prob(x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-8)
    ref = [mp_log_density(parts, x[i].numpy(), np.ones((T, O), bool), 100) for i in range(n)]
    assert np.abs(got.detach().numpy() - ref).max() < 1e-8
    for a, b in zip(torch.autograd.grad(got.sum(), (A, C), retain_graph=True), torch.autograd.grad(want.sum(), (A, C))):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-8 * float(b.abs().max()))


def _lds(T, A, C, q=0.1):
    H, O = C.shape
    eye = torch.eye(H, dtype=torch.float64)
    return dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), eye), A,
                            dist.MultivariateNormal(torch.zeros(H, dtype=torch.float64), q * eye), C,
                            dist.Normal(torch.zeros(O, dtype=torch.float64), 0.5).to_event(1), duration=T)


def test_svi_trains_through_explosive_dynamics(float64):
    """The new user's scenario: SVI (Adam, lr 0.03, the default MaskedPretrainingLoss) on 400
    steps of a GaussianHMM whose transition matrix starts at spectral radius 1.5 (a rotation;
    variances to 1.5^800 = 1e141): main raised gaussian-hmm-not-finite at the first step; here
    every loss and the parameters stay finite with the radius above 1.4, and at the trained
    parameters Evidence equals the mpmath filter to 1e-8 and so does a conditional at the end
    of a 200-step masked stretch."""
    T, H, O, n = 400, 2, 1, 4
    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(n, T, O, generator=g, dtype=torch.float64).cumsum(1)
    c, s_ = np.cos(0.4), np.sin(0.4)

    def model(x):
        A = pyro.param("A", torch.tensor([[1.5 * c, -1.5 * s_], [1.5 * s_, 1.5 * c]], dtype=torch.float64))
        C = pyro.param("C", torch.tensor([[1.0], [0.3]], dtype=torch.float64))
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", _lds(T, A, C), obs=x)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(model, lambda x: None, Adam({"lr": 0.03}), loss=MaskedPretrainingLoss())
    for _ in range(3):
        assert np.isfinite(svi.step(x))
        assert torch.isfinite(pyro.param("A")).all() and torch.isfinite(pyro.param("C")).all()
        assert float(torch.linalg.eigvals(pyro.param("A").detach()).abs().max()) > 1.4
    A, C = pyro.param("A").detach(), pyro.param("C").detach()
    parts = (np.zeros(H), np.eye(H), [A.numpy()] * T, [np.zeros(H)] * T, [0.1 * np.eye(H)] * T, [C.numpy()] * T,
             [np.zeros(O)] * T, [0.25 * np.eye(O)] * T)
    got = Evidence(model, method="exact")(x).detach().numpy()
    want = [mp_log_density(parts, x[i].numpy(), np.ones((T, O), bool), 200) for i in range(n)]
    assert np.abs(got - want).max() < 1e-8
    engine, state, tokens = _prepared(_lds(T, A, C), x)
    mask = torch.zeros(1, n, T, dtype=torch.bool)
    mask[0, :, 200:] = True
    got = engine.mask_log_prob(state, tokens.value, mask)[0, :, T - 1].numpy()
    keep = (~mask[0]).reshape(n, T, O).numpy()
    for i in range(2):
        more = keep[i].copy()
        more[T - 1] = True
        want = mp_log_density(parts, x[i].numpy(), more, 200) - mp_log_density(parts, x[i].numpy(), keep[i], 200)
        assert abs(got[i] - want) < 1e-8


def test_a_hardly_informed_expanding_direction_is_refused(float64):
    """C = (1, 1) and A near 1.35 I leave the direction (1, -1) expanding and informed only
    through A's small off-diagonal part: with 115 of 120 steps masked at random, smoothed
    precisions are singular to float64's rounding, and the engine raises (the information
    form and the square-root smoother were 13 nats off the mpmath filter there)."""
    T, H, n = 120, 2, 2
    A = 1.35 * torch.eye(H, dtype=torch.float64) + 0.05 * torch.randn(H, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = 0.3 * torch.randn(n, T, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64).cumsum(1)
    engine, state, tokens = _prepared(_lds(T, A, torch.ones(H, 1, dtype=torch.float64)), x)
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(8, n, T, dtype=torch.bool)
    for a in range(8):
        for i in range(n):
            mask[a, i, torch.randperm(T, generator=g)[:115]] = True
    with pytest.raises(ValueError, match="hardly informed"):
        engine.mask_log_prob(state, tokens.value, mask)


def test_dense_covariance_refuses_jitter_that_swamps_a_token(float64):
    """The dense path (Evidence path='dense') on radius 1.5, 20 hidden dims, 256 steps: its
    covariance's variances span 1e90, the jitter the rescue would need (relative to the mean
    diagonal) is 1e79 times the smallest token's variance, and it raises (main returned
    469 508 against the exact 13 132 behind a warning) while "auto" takes the Kalman engine,
    whose value equals Pyro's GaussianHMM.log_prob to a relative 1e-8 (Pyro's own scaled
    information form is 1e-6 nats off an mpmath filter here, this engine 3e-11)."""
    T, H, O, n = 256, 20, 1, 1
    hmm, _ = explosive_hmm(T, H, O, 1.5, mixed=False, seed=2)
    x = torch.randn(n, T, O, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    model = sequences_model(hmm, n)
    with pytest.raises(ValueError, match="smallest variance"):
        Evidence(model, method="exact", path="dense")(x)
    got = Evidence(model, method="exact")(x).detach()
    assert torch.allclose(got, hmm.log_prob(x), rtol=1e-8, atol=0)
