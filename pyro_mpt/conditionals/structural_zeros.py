r"""Zeros of a tensor that are zero in their derivatives too.

A tensor computed from parameters can hold entries that are zero only at the
parameters' current value (a loading parameter that starts at zero), whose
derivatives still carry gradient; an engine that drops such entries (a dense
covariance that is diagonal, a sparse loading split into groups) would lose
that gradient. One product of the zeros' Jacobian with a random vector tells
the two kinds apart.
"""

import torch

__all__ = ["derivatives_negligible", "diagonal_variances", "graph_leaves"]


def diagonal_variances(cov):
    r"""The diagonal of a covariance written densely that is diagonal, or None.

    ``MultivariateNormal(loc, scale_tril=s * torch.eye(D))`` is the noise of
    ``Normal(loc, s).to_event(1)``; kept dense, every mask costs
    :math:`O(D^3)` instead of :math:`O(D K^2)` (20-70 times PPCA's time at
    D=100..200). The diagonal alone carries the whole gradient only when the
    off-diagonal entries, zero in value, are also zero in their derivatives
    with respect to whatever they are computed from (a ``scale_tril``
    parameter that happens to be diagonal is not): checked by one product of
    their Jacobian with a random vector.

    Example::

        >>> diagonal_variances(torch.diag(torch.tensor([1.0, 2.0])))   # tensor([1., 2.])
    """
    eye = torch.eye(cov.shape[-1], dtype=torch.bool, device=cov.device)
    off = cov.masked_fill(eye, 0.0)
    if bool(off.detach().ne(0).any()):
        return None
    if off.requires_grad:
        leaves = graph_leaves(off.grad_fn)
        gen = torch.Generator(device="cpu").manual_seed(20231208)
        probe = torch.randn(off.shape, generator=gen, dtype=off.dtype).to(off.device)
        grads = torch.autograd.grad(off, leaves, probe, retain_graph=True, allow_unused=True)
        if any(g is not None and bool(g.ne(0).any()) for g in grads):
            return None
    return torch.diagonal(cov, dim1=-2, dim2=-1)


def graph_leaves(fn):
    """The leaf tensors an autograd graph reaches from node ``fn``.

    Example::

        >>> w = torch.ones(2, requires_grad=True)
        >>> graph_leaves((2 * w).grad_fn) == [w]   # [True]
    """
    leaves, seen, stack = [], set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        else:
            stack.extend(child for child, _ in node.next_functions)
    return leaves


def derivatives_negligible(t, reference):
    r"""Whether the derivatives of ``t`` (zero in value) are negligible against those of
    ``reference``: the product of each Jacobian with one random vector, that of ``t``
    within :math:`\sqrt{\epsilon}` of that of ``reference`` in every leaf. Not exactly
    zero: a loading written as a difference of model runs, ``loc(e_k) - loc(0)``, rounds
    the derivative of a zero entry (``d(b u_j - b u_j)/db``) to a few ulps of its sums.

    :param torch.Tensor t: zero in value, possibly computed from parameters.
    :param torch.Tensor reference: of ``t``'s shape, the derivatives' scale.
    :rtype: bool

    Example::

        >>> w = torch.tensor([0.0, 2.0], requires_grad=True)
        >>> derivatives_negligible(w[0] * 0.0, w[1] * 1.0)   # True
        >>> derivatives_negligible(w[0] * 1.0, w[1] * 1.0)   # False: w[0] is 0 only in value
    """
    if not t.requires_grad:
        return True
    leaves = graph_leaves(t.grad_fn)
    gen = torch.Generator(device="cpu").manual_seed(20240611)
    probe = torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)
    at_t = torch.autograd.grad((t * probe).sum(), leaves, retain_graph=True, allow_unused=True)
    scale = [None] * len(leaves)
    if reference.requires_grad:
        scale = torch.autograd.grad((reference * probe).sum(), leaves, retain_graph=True, allow_unused=True)
    size = max([float(g.abs().max()) for g in scale if g is not None and g.numel()] + [0.0])
    worst = max([float(g.abs().max()) for g in at_t if g is not None and g.numel()] + [0.0])
    return worst <= torch.finfo(t.dtype).eps ** 0.5 * size
