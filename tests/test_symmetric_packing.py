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
