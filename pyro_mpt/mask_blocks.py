"""The queries a mask schedule emits, in blocks: :class:`MaskBlock` and :class:`ChainBlock`.

A block says which masks (or orderings) to ask and how to weight each
query's score; :func:`~pyro_mpt.estimate.block_scores` runs it through an
engine. See :mod:`pyro_mpt.masks` for the schedules that make them.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["MaskBlock", "ChainBlock"]


@dataclass
class MaskBlock:
    """A block of mask queries.

    :param torch.Tensor mask: bool, ``(q, n, D)`` with ``n`` the batch size or 1;
        True marks a masked (target) token.
    :param torch.Tensor size: long, ``(q, n)`` or ``(q, 1)``; the mask size M.
    :param torch.Tensor weight: ``(q, n)`` or ``(q, 1)``; the weight of each
        query's score :math:`\\hat S_q` in the estimate.
    :param torch.Tensor context: bool ``(1, n, D)``, the tokens that may be
        context (the observed ones); None: every unmasked token.
    :param torch.Tensor gain: ``(q, n)`` factor on each score; 0 where a
        datapoint has no such query (a mask size above its :math:`D_i`).
    :param callable draw: when given (``mask`` is then None), a function of no
        arguments that draws the block's masks from the global random state.
        They are drawn each time the block is evaluated and do not outlive the
        evaluation: a block recomputed in the backward pass redraws the same
        masks from the same random state instead of keeping them alive (one
        byte per query and token). Read the masks with :meth:`masks`.
    :param torch.Tensor targets: long ``(q,)``, when every query hides one token and is
        shared by the batch (``mask[k, 0]`` is True at ``targets[k]`` alone): the tokens.
        An engine with a leave-one-out pass
        (:meth:`~pyro_mpt.conditionals.ConditionalEngine.leave_one_out_log_prob`) then
        serves the block from it without its masks, which may be left to ``draw``.
    :param bool counted: True when the masks are known to hide ``size`` tokens (drawn by
        the built-in schedules), so that :meth:`masks` need not count them.

    Example::

        >>> block = next(AllSizes(1).blocks(n, D))
        >>> block.masks().sum(-1)          # (q, n): the sizes block.size
    """

    mask: Optional[torch.Tensor]
    size: torch.Tensor
    weight: torch.Tensor
    context: Optional[torch.Tensor] = None
    gain: Optional[torch.Tensor] = None
    draw: Optional[Callable[[], torch.Tensor]] = None
    targets: Optional[torch.Tensor] = None
    counted: bool = False

    def masks(self):
        """The block's masks, bool ``(q, n, D)`` or ``(q, 1, D)``: ``mask``, or a fresh ``draw()``.

        :raises TypeError: when they are not bool (an integer 0/1 mask's ``~`` is not its
            complement: the dense Gaussian kernels took ``~mask`` as the context, and a
            uint8 mask put the loss 1.0e8 off).
        :raises ValueError: when the masks do not hide ``size`` tokens (within ``context``,
            where it is given) in a query of nonzero ``gain`` (each score is divided by its ``size``: a custom schedule
            that gave every query size 1 scaled its terms by M, silently). They are
            counted at the block's first read unless marked ``counted`` (the built-in
            schedules' own draws, whose count would be a pass over ``q n D`` bytes at
            every evaluation, 5 % of the step of ``"all"`` with masks per datapoint)."""
        mask = self.mask if self.draw is None else self.draw()
        if mask.dtype != torch.bool:
            raise TypeError(
                f"A mask schedule's MaskBlock holds {mask.dtype} masks of shape {tuple(mask.shape)}; "
                f"masks are bool, True at a target token: give mask.bool() (pyro_mpt.mask_blocks)."
            )
        if not self.counted:
            self._check_sizes(mask)
            # a block evaluated again (recomputed, replayed) holds the same masks, or draws them alike
            self.counted = True
        return mask

    def __post_init__(self):
        # a block that names its targets is served without its masks (leave-one-out passes):
        # each query hides its one target, so its size is 1 (size 2 halved the pll, silently)
        if self.targets is not None and not self.counted and bool((self.size != 1).any()):
            q = int((self.size != 1).nonzero()[0, 0])
            raise ValueError(
                f"A mask schedule's MaskBlock query {q} names one target token (targets=) but its size "
                f"says {int(self.size.reshape(self.size.shape[0], -1)[q].amax())}; each query's score is "
                f"its masked tokens' log-probability divided by its size: give size 1 for every query "
                f"(pyro_mpt.mask_blocks)."
            )

    def targets_within_context(self, mask):
        """``mask`` with the tokens outside ``context`` (missing ones) taken out: they are
        never targets (a custom block whose mask also hid a missing token had that token's
        term in its score)."""
        return mask if self.context is None else mask & self.context

    def _check_sizes(self, mask):
        # uint8 sums into int16 (int32 past its range): a quarter of the time of a bool sum
        wide = torch.int16 if mask.shape[-1] < 2**15 else torch.int32
        count = self.targets_within_context(mask).view(torch.uint8).sum(-1, dtype=wide)
        wrong = count != self.size.to(wide)
        if self.gain is not None:
            wrong = wrong & (self.gain != 0)  # a datapoint without such a query (a size above its D_i)
        if bool(wrong.any()):
            q, i = (int(k) for k in wrong.nonzero()[0])
            raise ValueError(
                f"A mask schedule's MaskBlock query {q} hides {int(count[q, min(i, count.shape[1] - 1)])} "
                f"tokens of datapoint {i} but its size says {int(self.size[q, min(i, self.size.shape[1] - 1)])}; "
                f"each query's score is its masked tokens' log-probability divided by its size: give "
                f"size=(mask & context).sum(-1), or size=mask.sum(-1) without a context (pyro_mpt.mask_blocks)."
            )


@dataclass
class ChainBlock:
    """A block of complete orderings for the chain rule.

    :param torch.Tensor order: long, ``(p, n, D)`` or ``(p, 1, D)``; each row is a
        permutation of the tokens.
    :param torch.Tensor weight: ``(p, n)`` or ``(p, 1)``; weight of each ordering.
    :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens; the
        orderings list each datapoint's missing tokens first. None when none is
        missing.
    :param callable draw: when given (``order`` is then None), a function of no
        arguments that draws the block's orderings from the global random state,
        called the first time :meth:`orders` is read: an engine whose chain sums do
        not depend on the orderings
        (:meth:`~pyro_mpt.conditionals.ConditionalEngine.chain_sums_reads_order`)
        never pays for them.
    :param tuple shape: ``(p, n, D)``, the orderings' shape, with ``draw``.

    Example::

        >>> block = next(RandomOrders(2).blocks(n, D))
        >>> block.orders().shape         # (2, n, D), drawn now
    """

    order: Optional[torch.Tensor]
    weight: torch.Tensor
    observed: Optional[torch.Tensor] = None
    draw: Optional[Callable[[], torch.Tensor]] = None
    shape: Optional[tuple] = None

    def orders(self):
        """The block's orderings, long ``(p, n, D)`` or ``(p, 1, D)``: ``order``, or ``draw()``
        the first time (kept for later reads)."""
        if self.order is None:
            self.order = self.draw()
        return self.order

    def orders_shape(self):
        """``(p, n|1, D)`` without drawing the orderings."""
        return tuple(self.order.shape) if self.order is not None else tuple(self.shape)
