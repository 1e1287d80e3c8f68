r"""Autograd Functions whose backward pass is written out for first derivatives only.

Several kernels (the Gaussian engine's aggregated and independent-mask forms,
the mixture chunks' partial sums, the self-normalized importance weights) are
``torch.autograd.Function`` objects with a hand-written backward pass: it reads
tensors saved by the forward pass, computed without a graph, so a graph built
over it (``create_graph=True``) would treat them as constants and give wrong
second derivatives without an error. :func:`first_order_backward` refuses that.
Such a backward pass either computes its chunks' tables again or reads them from the
forward pass; :class:`KeptChunks` keeps those that fit in a budget of elements.
"""

import functools

import torch

__all__ = ["KeptChunks", "first_order_backward"]


def first_order_backward(backward):
    """Decorates the ``backward`` of an autograd Function whose backward pass is
    written out for first derivatives: it runs without recording (as under
    ``torch.autograd.function.once_differentiable``), and a backward pass asked
    to build a graph (``create_graph=True``, e.g. for a Hessian) is refused.
    ``once_differentiable`` alone refuses only when the incoming gradient has a
    graph; for the gradient of a loss it has none, and its result, constant in
    the inputs, would silently give wrong second derivatives.

    Example::

        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     @first_order_backward
        ...     def backward(ctx, g):
        ...         return 2 * ctx.saved_tensors[0] * g
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def guarded(ctx, *grads):
        if torch.is_grad_enabled():
            name = type(ctx).__name__.removesuffix("Backward")
            raise RuntimeError(
                f"Second derivatives (create_graph=True) through pyro_mpt's {name} are not "
                f"available: its backward pass is written out for first derivatives only. Take second "
                f"derivatives of the loss by finite differences of its gradient instead."
            )
        return once(ctx, *grads)

    return guarded


class KeptChunks:
    """The chunks' tables that a forward pass keeps for its written-out backward pass, as
    many as fit in a budget of elements, offered chunk by chunk: the backward pass reads
    them instead of computing their chunks again and recomputes the rest, so that what is
    kept stays bounded whatever the number of chunks.

    :param int budget: elements that may be kept (0: none).
    :ivar list tensors: the kept chunks' tensors, in the order offered (to save for backward).
    :ivar list flags: one bool a chunk offered: whether it was kept.

    Example::

        >>> keep = KeptChunks(2**22)
        >>> for chunk in chunks:                       # forward pass
        ...     L, d = tables(chunk)
        ...     keep.offer((L, d), L.numel() + d.numel())
        >>> ctx.save_for_backward(*inputs, *keep.tensors)
        >>> ctx.kept = keep.flags
        >>> restored = KeptChunks.restore(ctx.saved_tensors[len(inputs):], ctx.kept, 2)
        >>> for chunk in chunks:                       # backward pass, the same order
        ...     L, d = next(restored) or tables(chunk)
    """

    def __init__(self, budget):
        self.budget, self.tensors, self.flags = budget, [], []

    def offer(self, tensors, size):
        """Keeps a chunk's ``tensors`` (``size`` elements in all) where they fit in what is
        left of the budget; records in ``flags`` whether they were kept."""
        take = size <= self.budget
        if take:
            self.budget -= size
            self.tensors.extend(tensors)
        self.flags.append(take)

    @staticmethod
    def restore(tensors, flags, per_chunk, rebuild=tuple):
        """An iterator over the chunks, in the order offered: ``rebuild`` of a kept chunk's
        ``per_chunk`` tensors (their tuple by default), None for a chunk to compute again.

        :param tensors: the saved ``tensors``.
        :param flags: the saved ``flags``.
        :param int per_chunk: tensors a kept chunk offered.
        :param callable rebuild: what a kept chunk's tuple of tensors becomes.
        """
        it = iter(tensors)
        for take in flags:
            yield rebuild(tuple(next(it) for _ in range(per_chunk))) if take else None
