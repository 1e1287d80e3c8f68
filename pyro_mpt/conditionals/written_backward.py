r"""Autograd Functions whose backward pass is written out for first derivatives only.

Several kernels (the Gaussian engine's aggregated and independent-mask forms,
the mixture chunks' partial sums, the self-normalized importance weights) are
``torch.autograd.Function`` objects with a hand-written backward pass: it reads
tensors saved by the forward pass, computed without a graph, so a graph built
over it (``create_graph=True``) would treat them as constants and give wrong
second derivatives without an error. :func:`first_order_backward` refuses that.
"""

import functools

import torch

__all__ = ["first_order_backward"]


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
