"""Uniformly random orderings, ranks and masks of the tokens, the draws every random schedule is made of.

Each draw sorts i.i.d. uniforms, vectorized over queries and datapoints (masks
whose sizes the rows share count integer keys instead, :func:`smallest_keys`); with
``observed=`` (bool ``(rows, D)``) the missing tokens of each row are kept out
of the masks (see :mod:`pyro_mpt.masks`).
"""

import torch

__all__ = ["random_order", "random_ranks", "random_masks", "random_keys", "smallest_keys", "KEY_BITS"]


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
    (one sort of i.i.d. uniforms and one scatter, an exact size M). On the CPU
    the masks count integer keys instead (:func:`smallest_keys`) where that beats
    the sort: at least 16 rows, or a block of at least 2**14 elements of rows of
    at least 64 tokens (a size per row too: 1000 rows of 1000 tokens, one
    thread, 61 ms sorted, 4.4 ms counted). With ``observed`` (bool
    ``(rows, D)``) the masks are drawn among each row's observed tokens (the
    orderings list the missing ones first; the keys give them a key above every
    drawn one), a row's size capped at its number of observed tokens.

    Example::

        >>> random_masks(torch.arange(1, 6)[:, None], (5, 1, 5), None).sum(-1)   # sizes 1..5
    """
    if _counting_pays(shape) and torch.device(device or "cpu").type == "cpu":
        return _selected_masks(sizes, shape, device, observed)
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


#: rows from which selecting (one pass over the block) beats one sort per row
_SELECT_ROWS = 16

#: a block's elements (queries x rows x tokens) from which counting beats sorting even
#: with one row per size (one datapoint, or masks shared by the batch), at rows of at
#: least ``_SELECT_TOKENS_MIN`` tokens (one thread: 2000 sizes of one row of 2000 tokens,
#: 285 ms sorted, 18 ms counted; 64 x 256, 0.76 ms against 0.37 ms; 100 x 100 even;
#: 1000 x 16, 0.36 ms against 0.58 ms)
_SELECT_ELEMENTS = 2**14
_SELECT_TOKENS_MIN = 64


def _counting_pays(shape):
    """Whether :func:`random_masks` counts keys (:func:`smallest_keys`) instead of sorting, on the CPU."""
    q, rows, D = shape
    return rows >= _SELECT_ROWS or (q * rows * D >= _SELECT_ELEMENTS and D >= _SELECT_TOKENS_MIN)


#: bits of the coarse integer keys of :func:`random_masks` where it counts keys
#: (fewer for short rows, about one key per bin): eight keys come from
#: one 64-bit draw (at most 7 bits, so that ``b + 1`` fits the uint8
#: thresholds of :func:`smallest_keys`); ties between them are broken by fine keys drawn only for the
#: tokens that tie at a row's boundary (:func:`smallest_keys`)
KEY_BITS = 7

#: rows per call of :func:`smallest_keys` inside :func:`random_masks`: its
#: tables (int16 bin indices, the histograms) then stay in the core's cache
_SELECT_TOKENS = 2**19


def _selected_masks(sizes, shape, device, observed=None):
    """:func:`random_masks` for sizes broadcastable to ``(q, rows)``: the tokens of the M
    smallest of i.i.d. uniform keys per row (:func:`smallest_keys`).

    Exact: a row's keys (coarse, with fine keys breaking the ties at its
    boundary) are i.i.d. and continuous in effect, so the M smallest are a
    uniform M-subset; rows and queries draw independent keys. With
    ``observed``, a missing token's key is ``2**b``, above every drawn one, and a row's size
    is capped at its :math:`D_i` observed tokens, so the M smallest are a uniform
    M-subset of them (all of them above :math:`D_i`, as the orderings give).
    """
    q, rows, D = shape
    keys = random_keys((q, rows, D), device)
    want = sizes.to(device=keys.device).expand(q, rows)
    if observed is not None:
        keys.masked_fill_(~observed, 1 << _key_bits(D))
        count = observed.sum(-1)
        # a row without observed tokens takes one (missing) token, dropped below
        want = torch.minimum(want, count.clamp_min(1))
    mask = smallest_keys(keys.view(q * rows, D), want.reshape(-1)).view(shape)
    if observed is not None and bool((count == 0).any()):
        mask &= observed
    return mask


def _key_bits(D):
    """Coarse key bits for rows of D tokens: about one key per bin, at most :data:`KEY_BITS`."""
    return max(1, min(KEY_BITS, (D - 1).bit_length()))


def random_keys(shape, device):
    """I.i.d. uniform integer keys on ``0 .. 2**b - 1``, uint8 ``shape``, with
    ``b = min(KEY_BITS, ceil(log2 D))`` bits (about one key per value).

    One 64-bit draw over its full range gives eight keys (its eight bytes, cut
    to their low ``b`` bits), independent and uniform.

    Example::

        >>> random_keys((2, 5), None)    # 10 keys in [0, 8)
    """
    *lead, D = shape
    words = torch.empty(*lead, (D + 7) // 8, dtype=torch.int64, device=device).random_(-(2**63), None)
    keys = words.view(torch.uint8)[..., :D]
    return keys.bitwise_and_((1 << _key_bits(D)) - 1)


def smallest_keys(keys, sizes):
    r"""Each row's M smallest keys, ``M = sizes``, ties broken uniformly at random: bool ``(rows, D)``.

    A counting pass instead of a selection per row: the per-row histogram of
    the keys (``bincount`` over row-offset int16 bin indices) locates the
    value :math:`b` of each row's M-th smallest key; the mask holds the keys
    :math:`k < b` and, of the ``count`` keys equal to :math:`b`, the ``need``
    with the smallest fine keys, uniform 31-bit keys drawn for those tokens
    only. A fine key the row's boundary ties on is drawn again, for all the
    listed tokens, until none does (an event symmetric in each row's tokens,
    so the chosen subset stays uniform). Always exactly M tokens a row.

    :param torch.Tensor keys: uint8 ``(rows, D)``, each in ``0 .. 2**b`` (``b``
        as in :func:`random_keys`, which draws below ``2**b``; a larger key would count
        in the next row's bins). A key ``2**b`` is taken after every drawn one (a
        missing token, :func:`random_masks`).
    :param torch.Tensor sizes: long ``(rows,)``, each in ``1..D``.
    :returns: bool ``(rows, D)``.

    Example::

        >>> smallest_keys(torch.tensor([[3, 1, 2, 1]], dtype=torch.uint8), torch.tensor([2]))
        tensor([[False,  True, False,  True]])
    """
    rows, D = keys.shape
    device = keys.device
    # one bin above the drawn keys' for the key 2**b
    bins = (1 << _key_bits(D)) + 1
    # contiguous: an expanded (stride-0) row of sizes made searchsorted copy it, with a UserWarning
    sizes = sizes.to(device=device, dtype=torch.int64).contiguous()
    mask = torch.empty((rows, D), dtype=torch.bool, device=device)
    need, count = torch.empty_like(sizes), torch.empty_like(sizes)
    # the passes over the keys go in cache-sized parts, with their buffers reused
    step = min(rows, max(1, _SELECT_TOKENS // D))
    # a part's keys equal to b in the rows that take only some of them, padded to
    # whole 64-bit words for their listing
    width = -(-D // 8) * 8
    tie = torch.zeros((step, width), dtype=torch.bool, device=device)
    tied = []
    # the histograms over int16 row-offset bins, in sub-parts whose offsets fit (at
    # most 129 bins: 254 rows or more): half the copy of int32 bins, and a faster
    # bincount (one thread, 1000 x 512 keys: 0.70 -> 0.50 ms)
    sub = min(step, 32767 // bins)
    index = torch.empty((sub, D), dtype=torch.int16, device=device)
    offsets = (torch.arange(sub, dtype=index.dtype, device=device) * bins)[:, None]
    hist = torch.empty((step, bins), dtype=torch.int64, device=device)
    threshold = torch.empty((step, D), dtype=torch.uint8, device=device)
    for start in range(0, rows, step):
        part = slice(start, min(rows, start + step))
        k, r = keys[part], part.stop - part.start
        # per-row histograms as one bincount a sub-part over row-offset bins (the uint8
        # -> int copy and the in-place offset are vectorized; a promoting add is not)
        for s0 in range(0, r, sub):
            s1 = min(r, s0 + sub)
            idx = index[: s1 - s0].copy_(k[s0:s1]).add_(offsets[: s1 - s0])
            hist[s0:s1].view(-1).copy_(torch.bincount(idx.view(-1), minlength=(s1 - s0) * bins))
        below = hist[:r].cumsum_(-1)
        b = torch.searchsorted(below, sizes[part, None])  # (r, 1): the value of the M-th smallest
        before = below.gather(1, (b - 1).clamp_min(0)).masked_fill_(b == 0, 0)[:, 0]
        count[part] = below.gather(1, b)[:, 0] - before  # keys equal to b, >= need
        need[part] = sizes[part] - before  # how many of them the mask takes, >= 1
        partial = need[part] < count[part]
        # the mask is k < b, or k <= b (k < b + 1) where it takes every key equal to
        # b; comparisons against a full-width threshold (against a broadcast one the
        # kernel is a scalar loop, six times slower)
        thr = threshold[:r]
        thr.copy_((b[:, 0] + (~partial)).to(torch.uint8)[:, None].expand(r, D))
        torch.lt(k, thr, out=mask[part])
        thr.copy_(torch.where(partial, b[:, 0], 255).to(torch.uint8)[:, None].expand(r, D))  # 255: no key (<= 2**7)
        # the tied keys listed in row-major order: a nonzero over 64-bit words of the
        # bool table (an eighth of its length), then over the bytes of the words hit,
        # as flat positions in the padded table
        torch.eq(k, thr, out=tie[:r, :D])
        words = tie[:r].view(-1).view(torch.int64)
        hit = torch.nonzero(words, as_tuple=True)[0]
        j, bit = torch.nonzero(words.index_select(0, hit).view(torch.bool).view(-1, 8), as_tuple=True)
        tied.append(hit[j] * 8 + bit + start * width)
    partial = need < count
    if not bool(partial.any()):
        return mask
    flat = torch.cat(tied)
    rows_in, cols_in = flat // width, flat % width
    listed = torch.where(partial, count, 0)
    first = (torch.cumsum(listed, 0) - listed + need - 1)[partial]  # each partial row's need-th listed token
    while True:
        fine = rows_in * 2**31 + torch.empty_like(rows_in).random_(0, 2**31)
        ordered = fine.sort().values
        t = ordered[first]
        # a tie at the boundary: the next fine key of the row equals the need-th
        if not bool((ordered[first + 1] == t).any()):
            break
    cut = torch.zeros(rows, dtype=fine.dtype, device=device).index_copy_(0, partial.nonzero()[:, 0], t)
    take = fine <= cut[rows_in]
    mask.view(-1)[(rows_in * D + cols_in)[take]] = True
    return mask
