import numpy as np
import torch

from pyro_mpt.conditionals.gaussian_linalg import SymmetricPacking


def test_packing_round_trips_and_its_weighted_inner_product_is_the_full_one():
    """Against numpy: the packed entries are the upper triangle (row-major), unpacking
    restores the symmetric matrix, the features are the rows' outer products' upper
    entries, and sum(off * pack(M) * features_j) = f_j^T M f_j."""
    g = torch.Generator().manual_seed(0)
    R, D = 4, 7
    X = torch.randn(3, R, R, generator=g, dtype=torch.float64)
    M = X + X.transpose(-1, -2)
    F = torch.randn(D, R, generator=g, dtype=torch.float64)
    pk = SymmetricPacking(R, torch.float64)
    iu = np.triu_indices(R)
    np.testing.assert_array_equal(pk.pack(M).numpy(), M.numpy()[:, iu[0], iu[1]])
    assert torch.equal(pk.unpack(pk.pack(M)), M)
    outer = np.einsum("ja,jb->jab", F.numpy(), F.numpy())
    np.testing.assert_array_equal(pk.features(F).numpy(), outer[:, iu[0], iu[1]])
    want = np.einsum("ja,mab,jb->mj", F.numpy(), M.numpy(), F.numpy())
    got = (pk.pack(M) * pk.off) @ pk.features(F).T
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-13)


def test_features_of_a_large_loading_equal_numpy():
    """The features' two ways (float64: from the full outer products below 2**22 of them;
    else by column selections) give numpy's products exactly, in float32 and float64."""
    g = torch.Generator().manual_seed(1)
    for D, R in ((30, 20), (420, 100)):  # 12000 and 4.2e6 > 2**22 outer products
        iu = np.triu_indices(R)
        for dtype in (torch.float32, torch.float64):
            F = torch.randn(D, R, generator=g, dtype=dtype)
            want = F.numpy()[:, iu[0]] * F.numpy()[:, iu[1]]
            np.testing.assert_array_equal(SymmetricPacking(R, dtype).features(F).numpy(), want)


def test_lowrank_form_packing_feature_major_against_numpy():
    """LowRankForm's packing holds the features feature-major (the rows' outer products'
    upper entries, exactly numpy's), and rows_times_f gives M_j F_j for the symmetric M_j
    packed in the columns of its argument, against numpy's unpacked products (1e-13)."""
    from pyro_mpt.conditionals.gaussian_lowrank_form import _Packing

    g = torch.Generator().manual_seed(2)
    for D, R, dtype, tol in ((7, 4, torch.float64, 1e-13), (30, 9, torch.float32, 1e-5)):
        F = torch.randn(D, R, generator=g, dtype=dtype)
        pk = _Packing(F.T.contiguous().T)  # a column-major loading, as PPCA's W^T^T
        iu = np.triu_indices(R)
        np.testing.assert_array_equal(pk.FFT.T.numpy(), F.numpy()[:, iu[0]] * F.numpy()[:, iu[1]])
        X = torch.randn(D, R, R, generator=g, dtype=torch.float64)
        M = (X + X.transpose(-1, -2)).to(dtype)
        want = np.einsum("jab,jb->ja", M.double().numpy(), F.double().numpy())
        got = pk.rows_times_f(pk.pack(M).T.contiguous())
        assert got.shape == (D, R)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol * np.abs(want).max())
