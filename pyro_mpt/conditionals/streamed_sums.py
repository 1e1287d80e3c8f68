r"""Log-sums over chunks of points that are made anew at every pass, with the memory of one chunk.

A table of many latent points (quadrature nodes, importance draws) too large to keep is
made chunk by chunk by a model run and reduced to partial log-sums per chunk
(:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`), combined with logaddexp.
Combined with autograd, every chunk's partials (``(q, n, D)`` for a block of queries) are
kept for the backward pass by the logaddexp that takes them, however each chunk itself is
recomputed: the memory grows with the number of chunks. :func:`streamed_log_sums` keeps
none: its value is the combined total :math:`L = \log\sum_k e^{P_k}` of a pass without a
graph, and its gradient comes from a second pass, chunk by chunk, each in a recomputed
region (:func:`~pyro_mpt.recompute.recomputed`) that returns
:math:`r_k = e^{P_k - \bar L}` (:math:`\bar L` the total, detached), summed as
:math:`L = \bar L + \sum_k (r_k - \bar r_k)` (:math:`\bar r_k` detached: each term is 0),
whose gradient is :math:`\sum_k e^{P_k - L}\,\nabla P_k = \nabla L`. A subtraction and a
sum save no tensor, so nothing of a chunk outlives its region. The price: each chunk is
made once more (the pass without a graph).
"""

import math

import torch

from ..recompute import recomputed
from .mixture import combine_partials

__all__ = ["streamed_log_sums"]


def streamed_log_sums(makers, reducer, *inputs, visit=None):
    r"""The partial log-sums of chunks made by ``makers``, combined, with memory of one chunk.

    :param list makers: zero-argument callables, each making one chunk (a
        :class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`; deterministic: they
        are called again for the gradient and in the backward pass).
    :param callable reducer: ``reducer(chunk, *inputs)`` -> a tuple of partial log-sums.
    :param callable visit: called with each chunk of the pass without a graph (once per
        chunk and call), e.g. for checks or diagnostics on the table: what it computes costs
        no model run of its own.
    :returns: the combined tuple, as
        :func:`~pyro_mpt.conditionals.mixture.combine_partials` of every chunk's would be
        (None without chunks); with gradients on, differentiable.

    Example::

        >>> num, den = streamed_log_sums([lambda: table.compute_chunk(sl) for sl in slices],
        ...                              MixtureChunk.mask_partials, ctx)
    """
    total = None
    with torch.no_grad():
        for make in makers:
            chunk = make()
            if visit is not None:
                visit(chunk)
            total = combine_partials(total, reducer(chunk, *inputs))
    if total is None or not torch.is_grad_enabled():
        return total
    # where the total is -inf every part is: a share of 0, not exp(-inf + inf)
    shift = tuple(torch.where(torch.isfinite(t), t, torch.full_like(t, math.inf)) for t in total)
    acc = None
    for make in makers:

        def shares(*inp, make=make):
            return tuple(torch.exp(p - s) for p, s in zip(reducer(make(), *inp), shift))

        terms = tuple(r - r.detach() for r in recomputed(shares, *inputs))
        acc = terms if acc is None else tuple(a + t for a, t in zip(acc, terms))
    return tuple(t + a for t, a in zip(total, acc))
