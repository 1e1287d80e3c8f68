"""Uniformly random orderings, ranks and masks of the tokens, the draws every random schedule is made of.

Each draw sorts i.i.d. uniforms, vectorized over queries and datapoints; with
``observed=`` (bool ``(rows, D)``) the missing tokens of each row are kept out
of the masks (see :mod:`pyro_mpt.masks`).
"""

import torch

__all__ = ["random_order", "random_ranks", "random_masks"]


def random_order(shape, device, observed=None):
    """Uniformly random orderings of the tokens (argsort of i.i.d. uniforms).

    With ``observed`` (bool ``(n, D)``) each row lists its missing tokens first
    and then its observed ones, both in uniformly random order: the chain rule
    conditions each position on the positions after it, so no observed token
    has a missing one in its context.

    :param tuple shape: ``(..., rows, D)``.
    :returns: long ``shape``, a permutation of ``0..D-1`` per row.

    Example::

        >>> random_order((4, 1, 6), None)     # 4 orderings of 6 tokens, shared by the batch
    """
    # float64 keys: float32 has 2^24 values, so at D = 512 about 1 % of the rows
    # would hold a tie, which argsort breaks by position rather than at random
    u = torch.rand(shape, device=device, dtype=torch.float64)
    if observed is not None:
        u = u - (~observed).to(u.dtype)
    return u.argsort(-1)


def random_ranks(shape, device, observed=None):
    """Ranks of the tokens in a uniformly random order, for masks ``ranks < M``.

    With ``observed`` (bool ``(n, D)``) the observed tokens take the first ranks,
    in uniformly random order, and the missing ones the last.

    Example::

        >>> masks = random_ranks((8, n, D), None) < 3     # 8 uniform masks of size 3 per datapoint
    """
    order = random_order(shape, device, observed)
    # the inverse permutation by one scatter (a second argsort would cost a sort)
    positions = torch.arange(shape[-1], device=order.device).expand(shape)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    if observed is not None:
        # the order lists the missing tokens first: rotate them to the last ranks
        ranks = (ranks - (~observed).sum(-1, keepdim=True)) % shape[-1]
    return ranks


def random_masks(sizes, shape, device, observed=None):
    """Independent uniformly random masks of the given sizes, bool ``shape = (q, rows, D)``.

    ``sizes`` (long, broadcastable to ``(q, rows)``) gives each mask's size M;
    the mask holds the first M tokens of a fresh uniformly random ordering
    (one sort of i.i.d. uniforms and one scatter, an exact size M). With
    ``observed`` (bool ``(rows, D)``) the masks are drawn among each row's
    observed tokens (the orderings list the missing ones first).

    Example::

        >>> random_masks(torch.arange(1, 6)[:, None], (5, 1, 5), None).sum(-1)   # sizes 1..5
    """
    if observed is None and sizes.shape[-1] == 1 and shape[1] >= _SELECT_ROWS and torch.device(device or "cpu").type == "cpu":
        return _selected_masks(sizes[..., 0], shape, device)
    order = random_order(shape, device, observed)
    pos = torch.arange(shape[-1], device=device)
    first = sizes[..., None]
    if observed is not None:
        # skip the m_i missing tokens that lead each ordering
        skip = (~observed).sum(-1, keepdim=True)  # (rows, 1)
        take = (pos >= skip) & (pos < skip + first)
    else:
        take = pos < first
    return torch.zeros(shape, dtype=torch.bool, device=device).scatter_(-1, order, take.expand(shape))


#: rows per size from which selecting (one call per query) beats one sort of the block
_SELECT_ROWS = 16


def _selected_masks(sizes, shape, device):
    """:func:`random_masks` for sizes ``(q,)`` shared by the rows, by selection instead of sorting.

    The first M tokens of the ordering ``argsort(u)`` are the tokens whose keys are
    at most the M-th smallest key of the row: the same masks from the same keys,
    found by a linear-time selection per query (on a CPU, sorting rows of keys
    costs 2-3 times more than selecting, and 10 times more than drawing them).
    """
    u = torch.rand(shape, device=device, dtype=torch.float64)
    mask = torch.empty(shape, dtype=torch.bool, device=u.device)
    for i, M in enumerate(sizes.tolist()):
        torch.le(u[i], u[i].kthvalue(M, -1, keepdim=True).values, out=mask[i])
    return mask
