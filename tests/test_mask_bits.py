"""Masks stored as bits (``pyro_mpt.mask_bits``) against numpy's little-endian packbits."""

import numpy as np
import pytest
import torch

from pyro_mpt.mask_bits import pack_bits, unpack_bits


@pytest.mark.parametrize("shape", [(3, 8), (2, 5, 13), (4, 1, 64), (7, 1)])
def test_pack_bits_is_numpy_packbits_and_unpack_inverts_it(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(sum(shape))) < 0.4
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8
    np.testing.assert_array_equal(bits.numpy(), np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack_bits(bits, shape[-1]), mask)


def test_pack_bits_of_views_that_start_mid_word():
    """Views of a larger mask: a contiguous one whose first token is not at a multiple of
    eight bytes (one row's tokens 1..8 of 9; it raised a RuntimeError from the int64 view),
    strided ones and a transposed one, against numpy's packbits."""
    base = torch.rand(3, 4, 25, generator=torch.Generator().manual_seed(0)) < 0.5
    views = [base[:1, :1, 1:9], base[:1, :1, 3:20], base[:, 1:3, 8:16], base[..., ::2], base.transpose(0, 1)]
    for view in views:
        bits = pack_bits(view)
        np.testing.assert_array_equal(bits.numpy(), np.packbits(view.numpy(), axis=-1, bitorder="little"))
        assert torch.equal(unpack_bits(bits, view.shape[-1]), view)
