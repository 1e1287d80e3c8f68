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
