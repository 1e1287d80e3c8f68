r"""The tokens a mask schedule draws its masks among: every datapoint's :math:`D`, or its :math:`D_i` observed ones.

With ``observed=`` (bool ``(n, D)``, from a masked observation), datapoint
:math:`i` has :math:`D_i` observed tokens and Proposition 1 runs over them:
:math:`\log p(x_{O_i}) = \sum_{M=1}^{D_i} S(x_{O_i}; M)`. Every schedule
serves missing tokens the same way, and :class:`MaskableTokens` is where
that way is written:

* masks are drawn per datapoint among its observed tokens, whatever
  ``share_masks`` says (one mask set cannot fit every datapoint's tokens);
* the missing tokens are hidden from the engines as extra masked tokens (the
  block's ``context``), so they are never context, and left out of the sums,
  so they are never targets;
* the weights use :math:`D_i` where a schedule's use :math:`D`, and a query
  a datapoint has no counterpart of (a size above its :math:`D_i`, a mask
  holding one of its missing tokens) gets a zero ``gain``: for curves,
  :math:`S(x_i; M) = 0` for :math:`M > D_i`, so the area stays the mean
  :math:`\log p(x_{O_i})`;
* orderings put each datapoint's missing tokens first, so that no observed
  token has them in its context.

A schedule asks a :class:`MaskableTokens` for its draws and its blocks in
terms of its ``count`` (:math:`D`, or the :math:`D_i`) and
says only which masks and which weights.
"""

import torch

from .mask_blocks import ChainBlock, MaskBlock
from .mask_draws import random_masks, random_order, random_ranks

__all__ = ["MaskableTokens"]


class MaskableTokens:
    r"""The tokens of ``n`` datapoints of ``D`` tokens that a schedule masks.

    :param int n: number of datapoints.
    :param int D: number of tokens per datapoint.
    :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens;
        None when no token is missing.
    :param bool share_masks: draw one mask set for the whole batch (ignored
        with missing tokens, whose masks are per datapoint).
    :param device: where the draws are made.

    Attributes: ``rows``, the rows masks are drawn for (1 when shared by the
    batch, else ``n``); ``count``, the tokens each datapoint's masks are drawn
    among: the int :math:`D`, or long ``(n,)`` :math:`D_i` with missing tokens.

    Example::

        >>> tokens = MaskableTokens(n, D, observed)
        >>> ranks = tokens.ranks(4)                       # (4, n, D): observed tokens ranked first
        >>> block = tokens.block(ranks < 2, torch.full((4, 1), 2), tokens.per_token(4).expand(4, -1))
    """

    def __init__(self, n, D, observed=None, *, share_masks=False, device=None):
        self.n, self.D, self.observed, self.device = n, D, observed, device
        self.rows = 1 if share_masks and observed is None else n
        self.count = D if observed is None else observed.sum(-1)

    def spans(self, total, max_elements):
        """``(start, stop)`` of consecutive spans of ``total`` queries, each within ``max_elements`` of ``(q, n, D)``."""
        per_block = max(1, max_elements // (self.n * self.D))
        for start in range(0, total, per_block):
            yield start, min(total, start + per_block)

    def ranks(self, num):
        """Ranks ``(num, rows, D)`` of uniformly random orderings; observed tokens take the first ranks."""
        return random_ranks((num, self.rows, self.D), self.device, self.observed)

    def order(self, num):
        """Uniformly random orderings ``(num, rows, D)``; each lists its missing tokens first."""
        return random_order((num, self.rows, self.D), self.device, self.observed)

    def masks(self, sizes, num):
        """Independent uniform masks ``(num, rows, D)`` of ``sizes`` (broadcastable to ``(num, rows)``) among the observed tokens."""
        return random_masks(sizes, (num, self.rows, self.D), self.device, self.observed)

    def observed_only(self, mask):
        """``mask`` without the missing tokens (a size above :math:`D_i` reaches them in :meth:`ranks`)."""
        return mask if self.observed is None else mask & self.observed

    def within(self, mask):
        """Bool ``(q, n)``: whether each mask ``(q, 1, D)`` shared by the batch holds only observed tokens
        of each datapoint; None without missing tokens."""
        return None if self.observed is None else ~(mask & ~self.observed).any(-1)

    def per_token(self, num_masks):
        r"""Weights :math:`D / P` ``(1, 1)``, or :math:`D_i / P` ``(1, n)``, float64: a size-uniform query scaled by the token count."""
        if self.observed is None:
            return torch.full((1, 1), float(self.D) / num_masks, dtype=torch.float64, device=self.device)
        return (self.count.to(torch.float64) / num_masks)[None]

    def block(self, mask, size, weight, gain=None, *, draw=None):
        """A :class:`~pyro_mpt.mask_blocks.MaskBlock` of masks ``(q, rows, D)``, with the missing tokens hidden.

        :param torch.Tensor gain: ``(q, n)`` or ``(q, 1)``, each query's factor
            per datapoint, used with missing tokens only; default: 1 for a
            datapoint with an observed token, 0 for one without (its
            :math:`\\log p` is 0).
        :param callable draw: instead of ``mask``, a function of no arguments
            that draws the masks. Masks per datapoint (``q n D`` bytes a
            block) are then drawn when the block is evaluated, so that none
            waits in memory for the backward pass; masks shared by the batch,
            and masks with missing tokens, are drawn now and kept as ``mask``.
        """
        # the masks of the schedules' own draws hide their sizes: not counted again
        counted = draw is not None
        if draw is not None and (self.rows == 1 or self.observed is not None):
            mask, draw = draw(), None
        if self.observed is None:
            return MaskBlock(mask, size, weight, draw=draw, counted=counted)
        if gain is None:
            gain = (self.count > 0)[None].expand(size.shape[0], self.n)
        return MaskBlock(mask, size, weight, self.observed[None], gain, draw=draw, counted=counted)

    def chain(self, order, weight, *, num=None):
        """A :class:`~pyro_mpt.mask_blocks.ChainBlock` of orderings from :meth:`order`; with
        ``order`` None, ``num`` orderings drawn when the block's engine first reads them."""
        if order is not None:
            return ChainBlock(order, weight, self.observed)
        return ChainBlock(None, weight, self.observed, draw=lambda: self.order(num), shape=(num, self.rows, self.D))
