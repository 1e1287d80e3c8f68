"""Uniformly random orderings, ranks and masks of the tokens, the draws every random schedule is made of.

Each draw sorts i.i.d. uniforms, vectorized over queries and datapoints (masks
whose sizes the rows share count integer keys instead, :func:`smallest_keys`); with
``observed=`` (bool ``(rows, D)``) the missing tokens of each row are kept out
of the masks (see :mod:`pyro_mpt.masks`).
"""

import torch

__all__ = ["random_order", "random_ranks", "random_masks", "random_keys", "smallest_keys", "KEY_BITS", "KEY_TOKENS"]


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
    (one sort of i.i.d. uniforms and one scatter, an exact size M; sizes shared
    by at least 16 rows count integer keys instead, :func:`smallest_keys`). With
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


#: rows per size from which selecting (one pass over the block) beats one sort per row
_SELECT_ROWS = 16

#: bits of the integer keys of :func:`random_masks` when the sizes are shared by the
#: rows: four keys come from one 64-bit draw, and ties between keys, which would
#: decide a mask by position, are redrawn (:func:`smallest_keys`)
KEY_BITS = 15

#: rows longer than this draw float64 keys instead (a tie at the boundary of a row of
#: D integer keys, redrawn, has probability about D / 2**KEY_BITS)
KEY_TOKENS = 2048


def _selected_masks(sizes, shape, device):
    """:func:`random_masks` for sizes ``(q,)`` shared by the rows: the tokens of the M
    smallest of i.i.d. uniform integer keys, found by two counting passes
    (:func:`smallest_keys`), with the rows whose M-th and (M+1)-th smallest keys tie
    drawn again until none does.

    Exact: the keys of a row are exchangeable, and so they remain given that
    their boundary does not tie (an event symmetric in the tokens), so the M
    smallest are a uniform M-subset; rows and queries draw independent keys. On
    a CPU this costs a third of drawing float64 keys and selecting the M-th
    smallest of each row (``kthvalue`` keeps indices and copies every row).
    """
    q, rows, D = shape
    if D > KEY_TOKENS:
        u = torch.rand(shape, device=device, dtype=torch.float64)
        mask = torch.empty(shape, dtype=torch.bool, device=u.device)
        for i, M in enumerate(sizes.tolist()):
            torch.le(u[i], u[i].kthvalue(M, -1, keepdim=True).values, out=mask[i])
        return mask
    sizes = sizes.to(device=device)
    want = sizes[:, None].expand(q, rows).reshape(-1)
    mask, exact = smallest_keys(random_keys(shape, device).reshape(q * rows, D), want)
    redraw = (~exact).nonzero()[:, 0]
    while redraw.numel():
        again, exact = smallest_keys(random_keys((redraw.numel(), D), device), want[redraw])
        mask[redraw] = again
        redraw = redraw[~exact]
    return mask.reshape(shape)


def random_keys(shape, device):
    """I.i.d. uniform integer keys on ``0 .. 2**KEY_BITS - 1``, int16 ``shape``.

    One 64-bit draw gives four keys: ``random_()`` fills int64 with 63 uniform
    bits, whose four 16-bit words, cut to their low ``KEY_BITS`` bits, are
    independent and uniform.

    Example::

        >>> random_keys((2, 5), None)    # 10 keys in [0, 32768)
    """
    *lead, D = shape
    words = torch.empty(*lead, (D + 3) // 4, dtype=torch.int64, device=device).random_()
    return words.view(torch.int16)[..., :D] & ((1 << KEY_BITS) - 1)


def _index_dtype(top):
    return torch.int32 if top < 2**31 else torch.int64


def _row_counts(index, rows, bins):
    """Counts ``(rows, bins)`` of the row-offset bin indices ``index`` ``(rows, D)``."""
    return torch.bincount(index.reshape(-1), minlength=rows * bins).view(rows, bins)


def smallest_keys(keys, sizes):
    r"""The keys at most each row's M-th smallest, ``M = sizes``, and whether they are M.

    A counting pass instead of a selection per row: the histogram of each row's
    high key bits locates the bin of its M-th smallest key; the few keys in that
    bin, sorted, give its value :math:`t`; the mask is :math:`k \le t`. It has
    M tokens unless keys tie at :math:`t` (then more), which the sorted keys show.

    :param torch.Tensor keys: int16 ``(rows, D)`` in ``0 .. 2**KEY_BITS - 1``.
    :param torch.Tensor sizes: long ``(rows,)``, each in ``1..D``.
    :returns: bool ``(rows, D)``, the mask, and bool ``(rows,)``, True where it has
        exactly M tokens.

    Example::

        >>> smallest_keys(torch.tensor([[5, 1, 9, 3]], dtype=torch.int16), torch.tensor([2]))
        (tensor([[False,  True, False,  True]]), tensor([True]))
    """
    rows, D = keys.shape
    low_bits = max(0, KEY_BITS - 7)
    bins, width = 1 << (KEY_BITS - low_bits), 1 << low_bits
    # per-row histograms as one bincount over row-offset bins (int32 offsets: a
    # scatter would need an int64 index, twice the passes)
    rows_at = torch.arange(rows, device=keys.device, dtype=_index_dtype(rows * bins))[:, None]
    high = keys >> low_bits
    below = _row_counts(high + rows_at * bins, rows, bins).cumsum(-1)
    b = (below < sizes[:, None]).sum(-1)  # the bin of the M-th smallest key
    before = torch.where(b > 0, below.gather(1, (b - 1).clamp_min(0)[:, None])[:, 0], 0)
    need = sizes - before  # the need-th smallest of the keys in bin b, >= 1
    count = below.gather(1, b[:, None])[:, 0] - before  # keys in bin b, >= need
    # those keys are few (about D / bins a row): list them, sorted by (row, low bits)
    rows_in, cols_in = (high == b[:, None].to(high.dtype)).nonzero(as_tuple=True)
    low = (keys[rows_in, cols_in] & (width - 1)).long()
    listed = (rows_in * width + low).sort().values
    start = count.cumsum(0) - count
    t = listed[start + need - 1] - torch.arange(rows, device=keys.device) * width + b * width
    # a tie at t: the next key of the bin (when there is one) has the same low bits
    nxt = listed[(start + need).clamp_max(listed.numel() - 1)]
    exact = (need == count) | (nxt != listed[start + need - 1])
    return keys <= t[:, None].to(keys.dtype), exact
