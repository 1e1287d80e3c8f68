r"""Masks stored as bits: eight tokens a byte, for what keeps masks for a backward pass.

Bool masks take a byte per token; a block of masks recomputed in the backward
pass (:mod:`~pyro_mpt.estimate`) or an engine that remakes its tables there
(:mod:`~pyro_mpt.conditionals.gaussian_independent`) keeps them as bits
instead, an eighth of the memory. Token ``8 b + k`` is bit ``k`` of byte ``b``
(``numpy.packbits(..., bitorder="little")``).
"""

import functools

import torch

__all__ = ["pack_bits", "unpack_bits"]

#: 2**(56 - 7k), k = 0..7: multiplying eight 0/1 bytes (little-endian in an int64)
#: by it puts byte k's bit at bit 56 + k, every other partial product below bit 56
#: (no two at one position, so no carry) or above bit 63 (dropped)
_GATHER_BITS = 0x0102040810204080


def pack_bits(mask):
    """Bool ``(..., D)`` as uint8 ``(..., ceil(D / 8))``, token ``8 b + k`` at bit ``k`` of byte ``b``.

    One multiply and shift per eight tokens (an int64 view of the bool bytes)
    instead of a shift per token."""
    pad = -mask.shape[-1] % 8
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    mask = mask.contiguous()
    if mask.storage_offset() % 8 or any(s % 8 for s in mask.stride()[:-1]):
        # a contiguous view that starts mid-word or keeps a size-1 dim's odd stride (e.g.
        # base[:1, :1, 1:9]) has no int64 view: a fresh copy in the standard layout has
        mask = torch.empty(mask.shape, dtype=mask.dtype, device=mask.device).copy_(mask)
    words = mask.view(torch.uint8).view(torch.int64)
    return (words * _GATHER_BITS).bitwise_right_shift_(56).bitwise_and_(0xFF).to(torch.uint8)


@functools.lru_cache(maxsize=8)
def _byte_table(device):
    """int64 ``(256,)``: byte value -> its eight bits as eight 0/1 bytes."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return bits.to(torch.uint8).view(torch.int64)[:, 0]


def unpack_bits(bits, D):
    """The bool ``(..., D)`` of :func:`pack_bits`, by a table lookup per byte
    (``index_select`` with int32 indices: a quarter of the time of indexing with
    the int64 bytes)."""
    index = bits.reshape(-1).to(torch.int32)
    words = _byte_table(bits.device).index_select(0, index).view(bits.shape)  # (..., ceil(D / 8)) int64
    return words.view(torch.bool)[..., :D]
