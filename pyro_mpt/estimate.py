r"""Where a mask schedule meets a conditional engine: the MPT estimate of :math:`\log p(x_i)`.

A schedule (:mod:`pyro_mpt.masks`) says *which* queries to make and how to
weight them, as blocks of masks or orderings; an engine
(:mod:`pyro_mpt.conditionals`) says how a log-conditional is computed. This
module runs each block through the engine and sums the weighted scores,

.. math::

    \widehat{\log p}(x_i) = \sum_q w_{qi}\, \hat S_{qi}, \qquad
    \hat S_{qi} = \frac{1}{M_q} \sum_{j \in \mathcal M_q}
        \log p(x_{ij} \mid x_{i\mathcal R_q}),

so neither side knows the other: schedules never call an engine, and
engines never see a schedule.
"""

import dataclasses
import functools
import inspect
import itertools

import torch
from tqdm.auto import tqdm

from .mask_bits import pack_bits, unpack_bits
from .mask_blocks import ChainBlock, MaskBlock
from .recompute import recomputed

__all__ = ["block_scores", "mpt_estimate"]


def block_scores(block, engine, state, x, per_size=False):
    r"""Per-query scores :math:`\hat S_q`, sizes :math:`M_q` and weights :math:`w_q` of one block.

    :param block: a :class:`~pyro_mpt.mask_blocks.MaskBlock` or
        :class:`~pyro_mpt.mask_blocks.ChainBlock`.
    :param ~pyro_mpt.conditionals.ConditionalEngine engine: the engine.
    :param state: the engine's state from ``prepare``.
    :param torch.Tensor x: tokens ``(n, D)``.
    :param bool per_size: for a chain block, one query per position (needed
        for curves: ``p * D`` rows); otherwise one row per ordering holding its
        chain-rule sum, which an engine may compute on a cheaper path
        (:meth:`~pyro_mpt.conditionals.ConditionalEngine.chain_sums`). Mask
        blocks always have one size per query.
    :returns: ``(shat, size, weight)``, each ``(rows, n)``.

    Example::

        >>> block = next(make_schedule("order").blocks(n, D))
        >>> shat, size, weight = block_scores(block, engine, state, x)   # (1, n) each
        >>> (weight * shat).sum(0)                                       # log p(x_i) with exact conditionals
    """
    if isinstance(block, MaskBlock):
        return _mask_scores(block, engine, state, x)
    if isinstance(block, ChainBlock):
        if block.observed is not None:
            return _chain_scores_missing(block, engine, state, x, per_size)
        return _chain_scores(block, engine, state, x, per_size)
    raise TypeError(
        f"A mask schedule yielded {type(block).__name__}; schedules yield MaskBlock or ChainBlock "
        f"(pyro_mpt.mask_blocks)."
    )


def _mask_scores(block, engine, state, x):
    n = x.shape[0]
    mask = block.masks()  # drawn once per evaluation for a block that draws them
    if block.context is None:
        sums = engine.mask_sums(state, x, mask)  # (q, n)
    else:
        # tokens outside the context (missing ones) are neither conditioned on nor summed
        sums = engine.mask_sums_within(state, x, block.targets_within_context(mask), block.context)
    shat = sums / block.size.to(sums.dtype).clamp_min(1)
    if block.gain is not None:
        gain = block.gain.to(sums.dtype)
        shat = torch.where(gain > 0, shat * gain, torch.zeros((), dtype=shat.dtype, device=shat.device))
    q = shat.shape[0]
    return shat, block.size.expand(q, n), block.weight.to(sums.dtype).expand(q, n)


def _summed_orders(block, engine, state, x):
    # the orderings for chain_sums: a stand-in of their shape where the engine reads only that
    if engine.chain_sums_reads_order(state):
        return block.orders()
    return torch.zeros((), dtype=torch.long, device=x.device).expand(block.orders_shape())


def _chain_scores(block, engine, state, x, per_size):
    n, D = x.shape
    p = block.orders_shape()[0]
    if not per_size:
        sums = engine.chain_sums(state, x, _summed_orders(block, engine, state, x))  # (p, n)
        size = torch.full((p, n), D, device=x.device)
        return sums, size, block.weight.to(sums.dtype).expand(p, n)
    logc = engine.chain_log_prob(state, x, block.orders())  # (p, n, D) by position
    shat = logc.permute(0, 2, 1).reshape(p * D, n)
    size = torch.arange(1, D + 1, device=x.device).repeat(p)[:, None].expand(p * D, n)
    weight = block.weight.to(logc.dtype).expand(p, n).repeat_interleave(D, dim=0)
    return shat, size, weight


def _chain_scores_missing(block, engine, state, x, per_size):
    # the first m positions of each ordering hold the m missing tokens:
    # their terms are dropped, and position t >= m of the rest is a query of
    # size t + 1 - m; the dropped positions stand for sizes D_i + 1..D, where
    # S(x_i; M) = 0
    n, D = x.shape
    p = block.orders_shape()[0]
    m = (~block.observed).sum(-1, keepdim=True).to(x.device)  # (n, 1) missing tokens
    if not per_size:
        # the sum over the observed targets is log p(x_O) for exact engines,
        # which chain_sums may compute without the per-position terms
        sums = engine.chain_sums(state, x, _summed_orders(block, engine, state, x), observed=block.observed)  # (p, n)
        return sums, (D - m[:, 0]).expand(p, n), block.weight.to(sums.dtype).expand(p, n)
    pos = torch.arange(D, device=x.device)
    valid = pos >= m  # (n, D)
    logc = engine.chain_log_prob(state, x, block.orders())  # (p, n, D)
    logc = torch.where(valid, logc, torch.zeros((), dtype=logc.dtype, device=logc.device))
    weight = block.weight.to(logc.dtype).expand(p, n)
    shat = logc.permute(0, 2, 1).reshape(p * D, n)
    size = torch.where(valid, pos + 1 - m, D - pos).T.repeat(p, 1)  # (p * D, n)
    return shat, size, weight.repeat_interleave(D, dim=0)


def _schedule_blocks(schedule, tokens, max_elements):
    x = tokens.value
    n, D = x.shape
    if tokens.observed is None:
        return schedule.blocks(n, D, max_elements=max_elements, device=x.device)
    # observed= is part of MaskSchedule.blocks' contract; a schedule written
    # without it would fail inside its own code with a TypeError naming no fix
    params = inspect.signature(schedule.blocks).parameters.values()
    if not any(p.name == "observed" or p.kind is p.VAR_KEYWORD for p in params):
        raise ValueError(
            f"Observed site {tokens.name!r} has missing (masked) tokens, but the "
            f"mask schedule {schedule!r} takes no observed= argument to leave them "
            f"out; give its blocks an observed=None argument and draw through "
            f"self.maskable_tokens(n, D, device, observed) (pyro_mpt.missing_tokens), "
            f"use a built-in schedule, or impute the missing tokens."
        )
    return schedule.blocks(n, D, max_elements=max_elements, device=x.device, observed=tokens.observed)


def mpt_estimate(schedule, tokens, engine, state, *, max_elements=2**22, accumulator=None, progress=None):
    r"""The MPT estimate :math:`\sum_q w_q \hat S_q` of :math:`\log p(x_i)` per datapoint, ``(n,)``.

    :param ~pyro_mpt.masks.MaskSchedule schedule: which queries, with which weights.
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens; with
        missing tokens the schedule receives ``observed=`` and leaves them out.
    :param ~pyro_mpt.conditionals.ConditionalEngine engine: the engine.
    :param state: the engine's state for ``tokens``.
    :param int max_elements: bound on ``queries * n * D`` per block. Peak
        memory is bounded by one block's working set, with gradients too:
        every block after the first is recomputed in the backward pass
        instead of kept alive for it. Without ``accumulator``, consecutive
        blocks of masks shared by the batch (no missing tokens) are merged
        into groups of ``max_elements`` over the engine's working set per
        query (:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_sum_elements`),
        each one :meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum`
        call, when that working set differs from ``n * D``: below it, fewer and
        larger groups; above it (per-mask factors larger than the data, e.g. one
        datapoint of many tokens), smaller ones. At ``n * D`` the blocks are
        evaluated as the schedule yields them, so that a sampling engine draws
        as it did.
    :param ~pyro_mpt.curve.CurveAccumulator accumulator: when given, every
        query's score is also added to it by size (for curves).
    :param str progress: a progress-bar label, or None for no bar.
    :raises ValueError: when tokens are missing and the schedule's ``blocks``
        takes no ``observed=``.

    Example::

        >>> tokens = trace_tokens(ppca, None, (x,), {})
        >>> engine = GaussianConditionals(); state = engine.prepare(tokens, ppca, None, (x,), {})
        >>> mpt_estimate(make_schedule("order"), tokens, engine, state)   # (N,), exact log p(x_i)
    """
    x = tokens.value
    schedule.check(x.shape[1])
    blocks = _schedule_blocks(schedule, tokens, max_elements)
    if progress is not None:
        blocks = tqdm(blocks, desc=progress, leave=False)
    # queries that each hide one token, from the engine's one pass where it has one; the
    # other blocks go on below
    one_pass = _LeaveOneOutQueries(engine, state, x, accumulator)
    blocks = one_pass.others(blocks)
    estimate = x.new_zeros(x.shape[0])
    if accumulator is not None:
        for block in blocks:
            shat, size, weight = block_scores(block, engine, state, x, per_size=True)
            estimate = estimate + (weight * shat).sum(0)
            accumulator.add(shat, size)
        return one_pass.added_to(estimate)
    # the first block's masks, when they are already drawn (drawing them here would
    # change what a later block draws), tell the engine which of its paths serves them
    blocks = iter(blocks)
    first = next(blocks, None)
    if first is None:
        return one_pass.added_to(estimate)
    blocks = itertools.chain([first], blocks)
    shared = _shared(first)  # None unless a MaskBlock whose masks are drawn
    per_query = max(1, int(engine.weighted_sum_elements(state, x, None if shared is None else shared[0])))
    if per_query != x.shape[0] * x.shape[1]:
        # the engine's weighted sum needs less than the n * D per query the
        # schedule chunked by: fewer, larger groups; or more (per-mask factors
        # larger than the data, e.g. one datapoint of many tokens): smaller
        # ones, so that no group keeps more than max_elements for the backward pass
        blocks = _merged(blocks, max(1, max_elements // per_query))
    for k, item in enumerate(blocks):
        # the first item keeps its intermediates: one item's worth, no
        # recomputation when the schedule fits a single one, and what an
        # engine keeps on its state across items (mask-free pieces, e.g.
        # GaussianMarginal.data_pieces) is computed outside any recomputed
        # one, so every recomputation repeats only its own forward
        if isinstance(item, _SharedGroup):
            estimate = estimate + _group_estimate(item, engine, state, x, recompute=k > 0)
        else:
            estimate = estimate + _block_estimate(item, engine, state, x, recompute=k > 0)
    return one_pass.added_to(estimate)


class _LeaveOneOutQueries:
    r"""The blocks whose queries each hide one token, shared by the batch
    (:class:`~pyro_mpt.mask_blocks.MaskBlock` ``targets``), summed from the engine's
    leave-one-out table
    (:meth:`~pyro_mpt.conditionals.ConditionalEngine.leave_one_out_log_prob`), asked once:
    :math:`\sum_q c_q \ell_{i j_q} = (\ell w)_i` with :math:`w_j = \sum_{q: j_q = j} c_q`.
    Their masks are never made (the ``"pll"`` schedule's are :math:`D^2` bits: at
    :math:`D = 40000` they took 3 s a step, against 25 ms for the table). Where the engine
    has no table the blocks go on, their masks made, to the engine's mask paths."""

    def __init__(self, engine, state, x, accumulator):
        self.engine, self.state, self.x, self.accumulator = engine, state, x, accumulator
        self.table, self.asked, self.observed = None, False, None
        self.served = []  # (targets, weight, size) of each served block, summed once at the end
        self.parts = []  # the served blocks' sums where their weights are per datapoint

    def others(self, blocks):
        """The blocks not served here, ``MaskBlock`` ones of one target each with their masks made."""
        for block in blocks:
            if not self._serves(block):
                if isinstance(block, MaskBlock) and block.targets is not None and block.mask is None:
                    # made now, so that the shared-mask paths may merge them as before
                    block = dataclasses.replace(block, mask=block.masks(), draw=None)
                yield block
                continue
            per_datapoint = block.gain is not None or block.weight.shape[-1] != 1
            if not per_datapoint:
                self.served.append((block.targets, block.weight[:, 0], block.size[:, 0]))
                if self.accumulator is None:
                    continue
            rows = self.table.T[block.targets]  # (q, n): each query's one conditional
            shat = rows / block.size.to(rows.dtype).clamp_min(1)
            if block.gain is not None:
                # missing tokens: a missing target's query scores 0, an observed one's is scaled
                gain = block.gain.to(rows.dtype)
                shat = torch.where(gain > 0, shat * gain, torch.zeros((), dtype=rows.dtype, device=rows.device))
            if per_datapoint:
                self.parts.append((block.weight.to(rows.dtype) * shat).sum(0))
            if self.accumulator is not None:
                self.accumulator.add(shat, block.size.expand(shat.shape))

    def _serves(self, block):
        if not isinstance(block, MaskBlock) or block.targets is None:
            return False
        if block.size.shape[-1] != 1 or (block.context is not None and block.context.shape[0] != 1):
            return False
        observed = None if block.context is None else block.context[0]
        if not self.asked:
            self.table, self.asked, self.observed = self._table(observed), True, observed
        elif (observed is None) != (self.observed is None) or (observed is not None and not torch.equal(observed, self.observed)):
            return False  # another context than the table's
        return self.table is not None

    def _table(self, observed):
        if observed is None:
            return self.engine.leave_one_out_log_prob(self.state, self.x)
        # an engine written before observed= (a subclass overriding the method with two
        # arguments) has no pass with missing tokens: its queries take the masks
        params = inspect.signature(self.engine.leave_one_out_log_prob).parameters.values()
        if not any(p.name == "observed" or p.kind is p.VAR_KEYWORD for p in params):
            return None
        return self.engine.leave_one_out_log_prob(self.state, self.x, observed=observed)

    def added_to(self, estimate):
        """``estimate`` plus the served queries' weighted sum, ``(n,)``."""
        for part in self.parts:
            estimate = estimate + part
        if not self.served:
            return estimate
        targets, weight, size = (torch.cat(t).to(self.x.device) for t in zip(*self.served))
        coef = weight.to(torch.float64) / size.to(torch.float64).clamp_min(1)
        w = torch.zeros(self.x.shape[1], dtype=torch.float64, device=self.x.device).index_add_(0, targets, coef)
        return estimate + self.table @ w.to(self.table.dtype)


@dataclasses.dataclass
class _SharedGroup:
    """Masks shared by the batch, from one or more consecutive blocks: ``mask``
    bool ``(q, D)`` and ``coef`` ``(q,)``, each query's weight over its size."""

    mask: torch.Tensor
    coef: torch.Tensor


def _shared(block):
    """The block as ``(mask (q, D), coef (q,))`` when its queries are shared by the
    batch with one weight each, without context or gain; else None."""
    if not isinstance(block, MaskBlock) or block.mask is None or block.context is not None or block.gain is not None:
        return None
    mask = block.masks()  # block.mask, checked
    if mask.shape[1] != 1 or block.size.shape[-1] != 1 or block.weight.shape[-1] != 1:
        return None
    size = block.size[:, 0].to(torch.float64).clamp_min(1)
    return mask[:, 0], block.weight[:, 0].to(torch.float64) / size


def _merged(blocks, per_group):
    """The blocks, with runs of consecutive shared-mask blocks merged into
    :class:`_SharedGroup` objects of at most ``per_group`` queries: a schedule
    chunks its blocks by ``n * D`` per query, an engine's weighted sum may need
    far less (:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_sum_elements`)."""
    masks, coefs, count = [], [], 0
    for block in blocks:
        shared = _shared(block)
        if shared is None:
            if masks:
                yield from _groups(masks, coefs, per_group)
                masks, coefs, count = [], [], 0
            yield block
            continue
        masks.append(shared[0])
        coefs.append(shared[1])
        count += shared[0].shape[0]
        if count >= per_group:
            # full groups go out now: the schedule's later blocks wait unmade
            mask, coef = torch.cat(masks), torch.cat(coefs)
            full = (count // per_group) * per_group
            yield from _groups([mask[:full]], [coef[:full]], per_group)
            masks, coefs, count = [mask[full:]], [coef[full:]], count - full
    if count:
        yield from _groups(masks, coefs, per_group)


def _groups(masks, coefs, per_group):
    mask, coef = torch.cat(masks), torch.cat(coefs)
    for start in range(0, mask.shape[0], per_group):
        yield _SharedGroup(mask[start : start + per_group], coef[start : start + per_group])


def _group_estimate(group, engine, state, x, recompute=True):
    """One group's contribution to the estimate, ``(n,)``, recomputed in the
    backward pass like :func:`_block_estimate`'s blocks."""
    return _recomputed(recompute, engine.weighted_mask_sum, state, x, group.mask, group.coef)


def _weighted_sum(block, engine, state, x):
    shat, _, weight = block_scores(block, engine, state, x)
    return (weight * shat).sum(0)


def _block_estimate(block, engine, state, x, recompute=True):
    r"""One block's contribution :math:`\sum_q w_q \hat S_q` to the estimate, ``(n,)``.

    With gradients on and ``recompute``, the block is evaluated under
    non-reentrant activation checkpointing: none of its intermediate tensors
    outlives the forward pass, and the backward pass recomputes them one block
    at a time (from the same random state, so a sampling engine redraws the
    same samples). Kept instead, every block's intermediates would stay alive
    until ``backward()``: peak memory would grow with the number of blocks
    rather than be bounded by the block size. The price is a second forward
    evaluation of the recomputed blocks. A block whose engine recomputes its
    own tables in its backward pass
    (:meth:`~pyro_mpt.conditionals.ConditionalEngine.recomputes_mask_sums`) is
    evaluated once, without checkpointing.
    """
    if recompute and torch.is_grad_enabled() and isinstance(block, MaskBlock):
        mask = block.masks()
        if engine.recomputes_mask_sums(state, x, mask, block.context):
            # the engine's backward pass recomputes its tables itself: checkpointing
            # would only evaluate the block twice
            return _weighted_sum(dataclasses.replace(block, mask=mask, draw=None), engine, state, x)
        if block.draw is not None:
            # masks drawn once and kept as bits for the recomputation (an eighth of
            # the bool masks): redrawing them would cost more than the engine's work
            block = dataclasses.replace(block, draw=functools.partial(unpack_bits, pack_bits(mask), mask.shape[-1]))
    if (recompute and torch.is_grad_enabled() and isinstance(block, ChainBlock) and block.order is None
            and engine.chain_sums_reads_order(state)):
        # orderings drawn here, outside the recomputed region: drawn in its first run, they
        # were kept on the block, so its second run skipped the draw and a sampling engine's
        # draws after them shifted (importance sampling with a guide, masks="order": the
        # gradient 0.25 off the loss's own finite differences); kept in the narrowest integers
        order = block.orders()
        small = order.to(torch.int16 if order.shape[-1] <= torch.iinfo(torch.int16).max else torch.int32)
        block = dataclasses.replace(block, order=None, draw=functools.partial(_widened, small))
    return _recomputed(recompute, _weighted_sum, block, engine, state, x)


def _widened(order):
    return order.long()


def _recomputed(recompute, fn, *args):
    """``fn(*args)``, its intermediates recomputed in the backward pass (from the
    same random state, :func:`~pyro_mpt.recompute.recomputed`) when ``recompute``
    and gradients are on."""
    if not (recompute and torch.is_grad_enabled()):
        return fn(*args)
    return recomputed(fn, *args)

