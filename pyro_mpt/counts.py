"""Counts a user passes (masks, samples, nodes, particles, iterations, chunk sizes), the
flags beside them, and the count of tokens a masking rate takes.

One predicate for every such argument, so that each check takes the same values:
Python and numpy integers (``numbers.Integral``: a grid of settings made with
``np.arange`` gives ``np.int64``), never a bool (``True`` is an ``int``), never a
float (``batch_size=2.5`` once ran as 2). Each caller writes its own message, which
names the argument and what it counts.

Example::

    >>> is_count(np.int64(4)), is_count(True), is_count(2.0), is_count(0, minimum=0)
    (True, False, False, True)
"""

import math
from numbers import Integral

import numpy as np
import torch

__all__ = ["is_count", "checked_flag", "rate_count", "written_rates"]

#: decimals to which :func:`rate_count` takes the product of a rate and a length
RATE_DECIMALS = 9


def is_count(value, minimum=1):
    """Whether ``value`` is an integer (Python's or numpy's, not a bool) of at least ``minimum``.

    :param value: the argument as given.
    :param int minimum: the smallest count accepted (1; 0 where none is meaningful).
    :rtype: bool
    """
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum


def checked_flag(value, name, true_means, false_means):
    """``value`` as a bool: True, False or a numpy/torch boolean scalar; anything else is
    refused by ``name`` (``share_masks="no"``, ``nested="no"``, ``progress="no"`` were
    taken as True: a non-empty string).

    :param str true_means: what True asks for, named in the message.
    :param str false_means: what False asks for.
    :raises TypeError: naming the argument, both meanings and the value.

    Example::

        >>> checked_flag(np.bool_(True), "nested", "nested masks", "independent masks")
        True
    """
    if isinstance(value, bool):
        return value
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(value, "shape", None) == () and str(dtype) in ("bool", "torch.bool"):
        return bool(value)
    raise TypeError(f"{name} must be True ({true_means}) or False ({false_means}), got {value!r}.")


def rate_count(rate, length):
    r"""The tokens a masking rate :math:`r` masks of :math:`L`: :math:`\lfloor rL + 1/2\rfloor`,
    halves rounded up, with :math:`rL` first taken to ``RATE_DECIMALS`` decimals, so that a
    rate written in decimals rounds its exact halves up as written: in binary
    :math:`0.29 \cdot 50 = 14.4999\ldots` and :math:`0.07 \cdot 50 = 3.5000\ldots01`, and
    both count as the halves they are (15 and 4; before, 14 and 4).

    :param rate: a float, or a float64 tensor broadcastable against ``length``.
    :param length: an int, or an integer tensor.
    :returns: an int, or a long tensor of the broadcast shape.

    Example::

        >>> rate_count(0.29, 50), rate_count(0.25, 10), rate_count(0.15, 3)
        (15, 3, 0)
    """
    if torch.is_tensor(rate) or torch.is_tensor(length):
        # on the tensors' own device (never the default one; torch.round's decimals= makes its
        # scale there, so the scale is applied here)
        device = (length if torch.is_tensor(length) else rate).device
        product = torch.as_tensor(rate, dtype=torch.float64, device=device) * torch.as_tensor(length, device=device).to(torch.float64)
        scale = 10.0**RATE_DECIMALS
        return ((product * scale).round() / scale + 0.5).floor().long()
    return int(math.floor(round(float(rate) * int(length), RATE_DECIMALS) + 0.5))


def written_rates(rates):
    r"""Masking rates as float64, each float32 or float16 rate read as the shortest decimal that
    names it in its own dtype: ``np.float32(0.29)`` is 0.28999999165... in float64, whose count
    of 50 tokens :func:`rate_count` rounds to 14, where the rate as written, 0.29, gives 15.
    Float64 rates are taken as they are; bfloat16 ones (numpy has no such type) by their
    float32 value.

    :param rates: a number, or an array or tensor of them.
    :returns: a float64 ``numpy.ndarray`` of the same shape (0-dim for a number).

    Example::

        >>> float(written_rates(np.float32(0.29)))
        0.29
    """
    if torch.is_tensor(rates):
        rates = rates.detach().cpu()
        rates = rates.float().numpy() if rates.dtype == torch.bfloat16 else rates.numpy()
    rates = np.asarray(rates)
    if rates.dtype in (np.float32, np.float16):
        narrow = rates.dtype.type
        return np.array([float(str(narrow(v))) for v in rates.reshape(-1)], dtype=np.float64).reshape(rates.shape)
    return rates.astype(np.float64)
