"""``dense_dtype``'s precision decision against references written here: eight
steps of inverse iteration with the Cholesky factor (the procedure its docstring
states, step by step) and numpy's exact smallest eigenvalue."""

import numpy as np
import pytest
import torch

from pyro_mpt.conditionals.gaussian_linalg import PRECISION, dense_dtype


def inverse_iteration_dtype(cov):
    """The decision by eight explicit steps of inverse iteration on the scaled matrix."""
    d = torch.diagonal(cov, dim1=-2, dim2=-1).sqrt()
    L, info = torch.linalg.cholesky_ex(cov / (d.unsqueeze(-1) * d.unsqueeze(-2)))
    if bool((info != 0).any()):
        return torch.float64
    D = cov.shape[-1]
    v = torch.linspace(1.0, 2.0, D, dtype=cov.dtype).expand(L.shape[:-1]).unsqueeze(-1)
    for _ in range(8):
        v = torch.cholesky_solve(v, L)
        v = v / v.norm(dim=-2, keepdim=True)
    lam_min = 1.0 / torch.cholesky_solve(v, L).norm(dim=-2)
    bad = bool((~(torch.finfo(cov.dtype).eps * D / lam_min <= PRECISION)).any())
    return torch.float64 if bad else cov.dtype


def exact_bound(cov):
    """eps D / lambda_min of the diagonally scaled matrix, in numpy float64 (max over a batch)."""
    c = cov.double().numpy()
    d = np.sqrt(np.diagonal(c, axis1=-2, axis2=-1))
    lam = np.linalg.eigvalsh(c / (d[..., :, None] * d[..., None, :]))[..., 0]
    # a matrix that rounding to float32 left indefinite has no finite bound
    return float(np.max(np.where(lam > 0, np.finfo(np.float32).eps * c.shape[-1] / np.abs(lam), np.inf)))


def random_spd(D, cond, seed, batch=()):
    g = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(g.standard_normal(batch + (D, D)))
    lam = np.logspace(0, -np.log10(cond), D)
    # a random diagonal scale: the decision is about the scaled matrix
    s = np.exp(g.standard_normal(batch + (D,)))
    cov = (Q * lam) @ np.swapaxes(Q, -1, -2)
    cov = s[..., :, None] * cov * s[..., None, :]
    return torch.tensor(0.5 * (cov + np.swapaxes(cov, -1, -2)), dtype=torch.float32)


@pytest.mark.parametrize("D", [3, 20, 50])
def test_dense_dtype_matches_inverse_iteration_and_the_exact_eigenvalue(D):
    decided = {torch.float32: 0, torch.float64: 0}
    for i, cond in enumerate(np.logspace(0, 9, 28)):
        for seed in range(3):
            cov = random_spd(D, cond, 100 * i + seed)
            got = dense_dtype(cov)
            assert got == inverse_iteration_dtype(cov), (D, cond, seed)
            bound = exact_bound(cov)
            # away from the threshold the estimate's few steps cannot flip the decision
            if bound < PRECISION / 4:
                assert got == torch.float32, (D, cond, bound)
            elif bound > 4 * PRECISION:
                assert got == torch.float64, (D, cond, bound)
            decided[got] += 1
    # the sweep crosses the threshold: both decisions occur
    assert decided[torch.float32] > 10 and decided[torch.float64] > 10


def test_dense_dtype_on_a_batch_decides_by_its_worst_matrix():
    well = random_spd(30, 10.0, 1, batch=(4,))
    assert dense_dtype(well) == inverse_iteration_dtype(well) == torch.float32
    ill = torch.cat([well, random_spd(30, 1e9, 2, batch=(1,))])
    assert dense_dtype(ill) == inverse_iteration_dtype(ill) == torch.float64
    assert dense_dtype(ill.double()) == torch.float64


@pytest.mark.parametrize("D", [3, 20, 50])
def test_dense_dtype_with_the_noise_decides_as_without_it(D):
    # F F^T + diag(psi) of rank-deficient F (method="dense" on a low-rank marginal), over noise levels
    # that cross the threshold: the noise's bound psi_min / max_j S_jj on the smallest
    # eigenvalue of the scaled matrix settles the well-conditioned ones without a factor,
    # and gives the decision of the estimate (and of the exact eigenvalue, away from the threshold)
    g = np.random.default_rng(D)
    by_noise = 0
    decided = {torch.float32: 0, torch.float64: 0}
    for i, sd in enumerate(np.logspace(1, -5, 19)):
        F = g.standard_normal((D, max(1, D // 2))) / np.sqrt(D)
        psi = sd**2 * np.exp(0.5 * g.standard_normal(D))
        cov = torch.tensor(F @ F.T + np.diag(psi), dtype=torch.float32)
        noise = torch.tensor(psi, dtype=torch.float32)
        got = dense_dtype(cov, noise)
        assert got == dense_dtype(cov) == inverse_iteration_dtype(cov), (D, sd)
        # the bound the noise gives, in float64
        lam_bound = psi.min() / np.diagonal(F @ F.T + np.diag(psi)).max()
        if np.finfo(np.float32).eps * D / lam_bound <= 0.5 * PRECISION:
            by_noise += 1
            assert got == torch.float32 and exact_bound(cov) <= PRECISION, (D, sd)
        if exact_bound(cov) > 4 * PRECISION:
            assert got == torch.float64, (D, sd)
        decided[got] += 1
    assert by_noise >= 3 and decided[torch.float32] >= 3 and decided[torch.float64] >= 3


def test_dense_dtype_with_a_noise_of_zeros_or_nan_falls_back_to_the_estimate():
    cov = random_spd(20, 1e9, 3)
    for noise in (torch.zeros(20), torch.full((20,), float("nan"))):
        assert dense_dtype(cov, noise) == dense_dtype(cov) == torch.float64
