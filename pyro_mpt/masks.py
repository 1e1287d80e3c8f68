r"""Mask schedules: which masked-token queries to make, and how to weight them.

Proposition 1 of Moreno-Muñoz et al. (2023) writes the log-marginal likelihood
of a datapoint with :math:`D` tokens as the cumulative masked pre-training score

.. math::

    \log p(x) = \sum_{M=1}^{D} S(x; M), \qquad
    S(x; M) = \frac{1}{M}\,\mathbb{E}_{|\mathcal{M}|=M}
        \Big[\sum_{j\in\mathcal{M}} \log p(x_j \mid x_{\mathcal{R}})\Big],

where :math:`\mathcal{R}` is the complement of the mask :math:`\mathcal{M}`.
A schedule chooses masks and weights :math:`w` so that
:math:`\sum_q w_q \hat S_q` estimates :math:`\log p(x)` (or, for a fixed rate, a
known biased version of it), with :math:`\hat S_q = \frac1M\sum_{j\in\mathcal M_q}
\log p(x_j\mid x_{\mathcal R_q})` the score of query :math:`q`.

Schedules emit queries in *blocks* bounded by an element budget, so that any
schedule runs in bounded memory with any engine: masks
(:class:`~pyro_mpt.mask_blocks.MaskBlock`, the masked tokens are the targets,
the others the context) or orderings for the chain rule :math:`\log p(x) =
\sum_t \log p(x_{\pi_t}\mid x_{\pi_{t+1:D}})`
(:class:`~pyro_mpt.mask_blocks.ChainBlock`), which engines may compute faster
than :math:`D` separate mask queries.

Within a block, the term at size :math:`M` is an unbiased estimate of
:math:`S(x; M)`, which is what :class:`~pyro_mpt.curve.MPTCurve` averages.
A schedule only says which queries and which weights; running them through
an engine is :func:`~pyro_mpt.estimate.mpt_estimate`'s job.

**Missing tokens.** With ``observed=`` (bool ``(n, D)``) Proposition 1 runs
over each datapoint's :math:`D_i` observed tokens; every schedule draws and
builds its blocks through :class:`~pyro_mpt.missing_tokens.MaskableTokens`,
which says how once for all (see :mod:`pyro_mpt.missing_tokens`).
"""

import functools
import math
from numbers import Real

import torch

from .mask_blocks import MaskBlock
from .missing_tokens import MaskableTokens
from .counts import checked_flag, is_count, rate_count, written_rates

__all__ = [
    "MaskSchedule",
    "AllSizes",
    "UniformSizes",
    "RandomOrders",
    "Exhaustive",
    "FixedRate",
    "PseudoLikelihood",
    "make_schedule",
    "MAX_EXHAUSTIVE_TOKENS",
]

#: ``"exhaustive"`` enumerates :math:`2^D - 1` masks; beyond this D it refuses.
MAX_EXHAUSTIVE_TOKENS = 16


def _draw_masks(tokens, ranks, p, sizes):
    """Masks of sizes ``sizes`` (``(q,)``): nested in the orderings ``ranks[p]``, or independent when ``ranks`` is None."""
    mask = tokens.masks(sizes[:, None], sizes.numel()) if ranks is None else ranks[p] < sizes[:, None, None]
    return tokens.observed_only(mask)


class MaskSchedule:
    """Base class of mask schedules.

    A schedule turns ``(n, D)`` into blocks of queries whose weighted scores sum
    to an estimate of :math:`\\log p(x)` (or of its biased fixed-rate version).

    :param int num_masks: number of random masks (or orderings) per datapoint
        and per step; must be at least 1.
    :param bool share_masks: draw one mask set for the whole batch instead of
        independent masks per datapoint.

    Example::

        >>> schedule = make_schedule("all", num_masks=2, share_masks=True)
        >>> block = next(schedule.blocks(4, 5))  # 4 datapoints of 5 tokens
        >>> block.mask.shape, block.size.shape  # (q, 1, D): one set shared by the batch
        (torch.Size([10, 1, 5]), torch.Size([10, 1]))
    """

    #: True when every mask size M = 1..D gets queries (so a curve is complete).
    covers_all_sizes = False

    def __init__(self, num_masks=1, *, share_masks=False):
        # numpy integers too (np.arange / grids of settings), as the adapters take them
        if not is_count(num_masks):
            raise ValueError(
                f"num_masks must be a positive integer (masks per datapoint), got {num_masks!r}."
            )
        self.num_masks = int(num_masks)
        self.share_masks = _checked_share_masks(share_masks)

    def curve_mask_sharing(self):
        """How the masks this schedule draws are shared by the batch, for the curve's
        standard errors (:class:`~pyro_mpt.curve.CurveAccumulator`'s ``shared``): False
        (per datapoint, or not random), True (shared), ``"sizes"`` (shared, each mask
        size's drawn independently of the others').

        :returns: bool or str.
        """
        return self.share_masks

    def check(self, D):
        """Raise ``ValueError`` when the schedule cannot serve ``D`` tokens."""
        if D < 1:
            raise ValueError(
                f"Masked pre-training needs at least one token, got D={D} tokens per "
                f"datapoint. Give each datapoint at least one token."
            )

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        """Yield :class:`~pyro_mpt.mask_blocks.MaskBlock` or :class:`~pyro_mpt.mask_blocks.ChainBlock` objects.

        :param int n: number of datapoints.
        :param int D: number of tokens per datapoint.
        :param int max_elements: bound on ``q * n * D`` per block.
        :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens;
            None when none is missing (see :mod:`pyro_mpt.missing_tokens`).
            Masks are then drawn per datapoint, whatever ``share_masks``
            says. Part of the contract: every schedule takes it, and a
            schedule whose ``blocks`` does not is refused when tokens are
            missing.
        """
        raise NotImplementedError

    def for_curve(self, share_masks=None):
        """The schedule :meth:`~pyro_mpt.MaskedPretrainingLoss.curve` uses.

        This schedule when it covers every mask size, else ``"all"`` with this
        schedule's ``num_masks``.

        :param bool share_masks: one mask set for the whole batch (True), masks
            per datapoint (False), or this schedule's own choice (None).
        :rtype: MaskSchedule
        """
        if self.covers_all_sizes:
            return self
        share = self.share_masks if share_masks is None else share_masks
        return AllSizes(self.num_masks, share_masks=share)

    def maskable_tokens(self, n, D, device=None, observed=None):
        """The tokens this schedule draws its masks among."""
        return MaskableTokens(n, D, observed, share_masks=self.share_masks, device=device)

    def __repr__(self):
        return f"{type(self).__name__}(num_masks={self.num_masks}{self._shared_repr()})"

    def _shared_repr(self):
        # the default (masks per datapoint) is left out, so that the common reprs stay short
        return ", share_masks=True" if self.share_masks else ""


class AllSizes(MaskSchedule):
    r"""Every mask size :math:`M = 1..D` with ``num_masks`` random masks each.

    .. math:: \hat L = \frac{1}{P}\sum_{p=1}^P \sum_{M=1}^D \hat S_p(x; M)

    The paper's cumulative MPT (``masks="all"``): for every size :math:`M` and
    every repetition :math:`p`, an *independent* uniformly random mask of size
    :math:`M` (per datapoint, or one set for the batch with
    ``share_masks=True``, as the authors' code draws them). Each
    :math:`\hat S_p(x; M)` is unbiased for :math:`S(x; M)`, so the sum is
    unbiased for :math:`\log p(x)`, and the :math:`D` terms' mask noise is
    independent: the variance of the sum is the sum of the per-size variances.

    With ``nested=True`` (``masks="nested"``) the masks of one repetition are
    instead the first :math:`M` tokens of *one* random permutation. Each mask
    is still uniform over the subsets of its size (so the sum stays
    unbiased), but the :math:`D` terms share one draw and move together: the
    per-size errors add up coherently instead of averaging out. On PPCA at its
    true parameters (:math:`N = 200`, :math:`D = 50`, :math:`K = 5`, one
    repetition) the spread of the mean estimate over mask seeds is several
    times that of ``"all"`` (``tests/test_masks.py``); on the paper's Table-1
    PPCA (:math:`D = 200`) 2.6--4.5 times. Same cost per query: it exists to
    reproduce earlier runs and the HuggingFace adapters' nested curves.

    :param bool nested: nest the masks of one repetition (one permutation).

    Example::

        >>> loss = MaskedPretrainingLoss(masks=AllSizes(4, share_masks=True))  # masks="all", num_masks=4
        >>> next(AllSizes(1, share_masks=True).blocks(4, 5)).size[:, 0].tolist()  # every size once
        [1, 2, 3, 4, 5]
    """

    covers_all_sizes = True

    def __init__(self, num_masks=1, *, nested=False, share_masks=False):
        super().__init__(num_masks, share_masks=share_masks)
        self.nested = checked_flag(nested, "nested", "prefixes of one random ordering", "independent masks of each size")

    def for_curve(self, share_masks=None):
        if share_masks is None or share_masks == self.share_masks:
            return self
        return AllSizes(self.num_masks, nested=self.nested, share_masks=share_masks)

    def curve_mask_sharing(self):
        # nested masks are prefixes of one ordering: their sizes' draws are not independent
        return "sizes" if self.share_masks and not self.nested else self.share_masks

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        tokens = self.maskable_tokens(n, D, device, observed)
        ranks = tokens.ranks(self.num_masks) if self.nested else None
        sizes = torch.arange(1, D + 1, device=device)
        weight = torch.full((1, 1), 1.0 / self.num_masks, dtype=torch.float64, device=device)
        # queries enumerate (mask set p, size M) pairs; independent masks are
        # drawn block by block, so drawing them stays within the block's budget
        for start, stop in tokens.spans(self.num_masks * D, max_elements):
            idx = torch.arange(start, stop, device=device)
            p, m = idx // D, sizes[idx % D]
            q = idx.numel()
            draw = functools.partial(_draw_masks, tokens, ranks, p, m)
            # sizes above a datapoint's D_i have no mask: S(x_i; M) = 0 there
            yield tokens.block(None, m[:, None].expand(q, 1), weight.expand(q, 1), m[:, None] <= tokens.count, draw=draw)

    def __repr__(self):
        extra = ", nested=True" if self.nested else ""
        return f"AllSizes(num_masks={self.num_masks}{extra}{self._shared_repr()})"


class UniformSizes(MaskSchedule):
    r"""One mask size per mask, drawn uniformly from :math:`1..D`, scaled by D.

    .. math:: \hat L = \frac{1}{P}\sum_{p=1}^P D\,\hat S_p(x; M_p),
        \quad M_p \sim \mathcal{U}\{1, \dots, D\}

    Unbiased for :math:`\log p(x)`. With ``stratified=True`` the sizes are
    stratified: with :math:`P > 1` masks, mask :math:`p` of every datapoint gets
    :math:`M = \lfloor D (p + u)/P\rfloor + 1`, :math:`u \sim \mathcal U(0, 1)`;
    with one mask, the datapoints of the batch share the strata in a random
    order (:math:`M_i = \lfloor D(\sigma(i) + u_i)/n\rfloor + 1`). Each size is
    still marginally uniform, so the estimate stays unbiased, while the sizes
    spread evenly over :math:`1..D`, lowering the variance of each datapoint's
    estimate (or, with one mask, of the batch sum).

    Example::

        >>> loss = MaskedPretrainingLoss(masks=UniformSizes(8, stratified=True))  # masks="stratified", num_masks=8
        >>> next(UniformSizes(3).blocks(4, 5)).mask.shape  # 3 masks for each of 4 datapoints
        torch.Size([3, 4, 5])
    """

    def __init__(self, num_masks=1, *, stratified=False, share_masks=False):
        super().__init__(num_masks, share_masks=share_masks)
        self.stratified = checked_flag(stratified, "stratified", "sizes stratified over 1..D", "sizes drawn uniformly")

    def _sizes(self, rows, D, device):
        """Sizes ``(P, rows)``; ``D`` is an int or, with missing tokens, the counts ``(rows,)``."""
        P = self.num_masks
        if not self.stratified:
            if not torch.is_tensor(D):
                return torch.randint(1, D + 1, (P, rows), device=device)
            # per-datapoint D_i: M_i = floor(D_i u) + 1, one stratum of one slot
            strata, slots = 0, 1
        elif P > 1:
            # each datapoint's P masks take one stratum each
            strata = torch.arange(P, device=device)[:, None].expand(P, rows)
            slots = P
        else:
            # one mask per datapoint: stratify across the batch instead
            strata = torch.randperm(rows, device=device)[None]
            slots = rows
        u = torch.rand(P, rows, device=device, dtype=torch.float64)
        top = (D - 1).clamp(min=0) if torch.is_tensor(D) else D - 1
        return (D * (strata + u) / slots).floor().long().clamp_(max=top) + 1

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        tokens = self.maskable_tokens(n, D, device, observed)
        sizes = self._sizes(tokens.rows, tokens.count, device)
        w = tokens.per_token(self.num_masks)
        for start, stop in tokens.spans(self.num_masks, max_elements):
            m = sizes[start:stop]
            # each mask a uniform M-subset by counting keys, not a sort per row (the sort
            # was most of a default step at D = 1000: 61 of 115 ms, factor analysis, N = 1000)
            yield tokens.block(tokens.masks(m, stop - start), m, w.expand(stop - start, -1))

    def __repr__(self):
        return f"UniformSizes(num_masks={self.num_masks}, stratified={self.stratified}{self._shared_repr()})"


class RandomOrders(MaskSchedule):
    r"""The chain rule along ``num_masks`` random orderings of the tokens.

    .. math:: \hat L = \frac1P\sum_{p=1}^P\sum_{t=1}^D
        \log p(x_{\pi_p(t)} \mid x_{\pi_p(t+1)}, \dots, x_{\pi_p(D)})

    Position :math:`t` is a query of mask size :math:`M = t` (its context holds
    the :math:`D - t` tokens after it), so every size gets one query per ordering.
    When the conditionals come from one joint distribution (Gaussian closed
    form, exact quadrature) each ordering gives :math:`\log p(x)` exactly and the
    estimate has zero variance.

    Example::

        >>> loss = MaskedPretrainingLoss(masks=RandomOrders(1, share_masks=True))  # masks="order"
        >>> loss.score(ppca, None, x)  # (N,): log p(x_i) exactly for a linear-Gaussian model
    """

    covers_all_sizes = True

    def for_curve(self, share_masks=None):
        if share_masks is None or share_masks == self.share_masks:
            return self
        return RandomOrders(self.num_masks, share_masks=share_masks)

    def curve_mask_sharing(self):
        # one ordering's positions each hold a token of their own: nearly independent draws
        return "orders" if self.share_masks else False

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        tokens = self.maskable_tokens(n, D, device, observed)
        w = torch.full((1, 1), 1.0 / self.num_masks, dtype=torch.float64, device=device)
        if tokens.rows > 1:
            # orderings per datapoint (a sort of n D keys each) are drawn only if the
            # engine reads them: exact engines' chain sums are log p(x) whatever they are
            for start, stop in tokens.spans(self.num_masks, max_elements):
                yield tokens.chain(None, w.expand(stop - start, 1), num=stop - start)
            return
        order = tokens.order(self.num_masks)  # missing tokens first
        for start, stop in tokens.spans(self.num_masks, max_elements):
            yield tokens.chain(order[start:stop], w.expand(stop - start, 1))


class Exhaustive(MaskSchedule):
    r"""Every non-empty subset of the tokens: the exact Proposition-1 sum.

    .. math:: \hat L = \sum_{M=1}^D \binom{D}{M}^{-1}
        \sum_{|\mathcal M| = M} \hat S(x; \mathcal M)

    Deterministic; equals :math:`\log p(x)` when the conditionals come from one
    joint. Enumerates :math:`2^D - 1` masks shared by the whole batch, so it
    refuses :math:`D >` :data:`MAX_EXHAUSTIVE_TOKENS`. ``num_masks`` is unused.

    Example::

        >>> next(Exhaustive().blocks(4, 5)).mask.shape  # the 2^5 - 1 subsets, shared by the batch
        torch.Size([31, 1, 5])
    """

    covers_all_sizes = True

    def __init__(self, num_masks=1, *, share_masks=True):
        # every mask is the batch's (none is drawn): the flag is checked, not used
        _checked_share_masks(share_masks)
        super().__init__(num_masks, share_masks=True)

    def curve_mask_sharing(self):
        return False  # every subset: no mask is drawn

    def check(self, D):
        super().check(D)
        if D > MAX_EXHAUSTIVE_TOKENS:
            raise ValueError(
                f'masks="exhaustive" enumerates 2^D - 1 masks and supports '
                f"D <= {MAX_EXHAUSTIVE_TOKENS} tokens, got D={D} ({2**D - 1} masks). "
                f'Use masks="order" (the chain rule along random orderings: exact where the engine '
                f'computes the model\'s conditionals exactly, e.g. a Gaussian model\'s; an unbiased '
                f'estimate of the sum otherwise, a masked LM\'s included) or "all".'
            )

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        codes = torch.arange(1, 2**D, device=device)
        bits = (codes[:, None] >> torch.arange(D, device=device)) & 1
        masks = bits.bool()
        sizes = bits.sum(-1)
        binom = torch.tensor(
            [[math.comb(c, m) for m in range(D + 1)] for c in range(D + 1)],
            dtype=torch.float64,
            device=device,
        )  # binom[c, m] = C(c, m)
        weights = 1.0 / binom[D, sizes]
        tokens = self.maskable_tokens(n, D, device, observed)
        for start, stop in tokens.spans(codes.numel(), max_elements):
            m, s = masks[start:stop, None, :], sizes[start:stop]
            gain = None
            if observed is not None:
                # the subsets of each datapoint's observed tokens, weighted 1 / C(D_i, M):
                # the gain C(D, M) / C(D_i, M) turns the shared weight 1 / C(D, M) into it
                gain = torch.where(tokens.within(m), binom[D, s][:, None] / binom[tokens.count][:, s].T, 0.0)
            yield tokens.block(m, s[:, None], weights[start:stop, None], gain)

    def __repr__(self):
        return "Exhaustive()"


def _one_target_masks(start, stop, D, device):
    """Masks ``(stop - start, 1, D)`` whose query ``k`` hides token ``start + k`` alone, made
    per span (rows of one D x D identity were D^2 bytes for any span: 400 MB for one
    datapoint of 20000 tokens)."""
    q = stop - start
    mask = torch.zeros((q, 1, D), dtype=torch.bool, device=device)
    mask.view(q, D).diagonal(start).fill_(True)
    return mask


class PseudoLikelihood(MaskSchedule):
    r"""The pseudo-log-likelihood of Besag (1975): every leave-one-out query.

    .. math:: \operatorname{PLL}(x) = \sum_{j=1}^D \log p(x_j \mid x_{-j})
        = D\,S(x; 1)

    The :math:`D` masks of size 1, shared by the batch: the :math:`M = 1` term
    of Proposition 1, computed exactly (no randomness), times :math:`D`.
    **Not** an estimate of :math:`\log p(x)`: it leaves out the sizes
    :math:`M \ge 2` (for a Gaussian process it is the leave-one-out
    predictive log-probability of Rasmussen & Williams, eqs. 5.10--5.12). As a
    loss it trains by pseudo-likelihood; with missing tokens it runs over each
    datapoint's observed tokens, :math:`\sum_{j\in O}\log p(x_j\mid
    x_{O\setminus j})`. Its curve (:meth:`~pyro_mpt.MaskedPretrainingLoss.curve`)
    has the single point :math:`M = 1`, exact, and no area; with missing tokens
    :math:`S(x_i; 1)` is the mean over the :math:`D_i` observed tokens.
    ``num_masks`` and ``share_masks`` are unused.

    Example::

        >>> MaskedPretrainingLoss(masks="pll").score(model, None, x)  # (N,) PLL per datapoint
    """

    def __init__(self, num_masks=1, *, share_masks=True):
        # every mask is the batch's (none is drawn): the flag is checked, not used
        _checked_share_masks(share_masks)
        super().__init__(num_masks, share_masks=True)

    def curve_mask_sharing(self):
        return False  # every token once: no mask is drawn

    def for_curve(self, share_masks=None):
        return self

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        tokens = self.maskable_tokens(n, D, device, observed)
        one = torch.ones((1, 1), dtype=torch.long, device=device)
        w = torch.ones((1, 1), dtype=torch.float64, device=device)
        if observed is not None:
            # S(x_i; 1) is the mean over the D_i observed tokens, not over all D: each observed
            # target counts D / D_i in the curve's values and weighs D_i / D in the PLL
            share = tokens.count.to(torch.float64) / D
            w = share[None]
        every = torch.arange(D, device=device)
        for start, stop in tokens.spans(D, max_elements):
            q = stop - start
            targets = every[start:stop]
            draw = functools.partial(_one_target_masks, start, stop, D, device)
            if observed is None:
                # the masks are made only for an engine without a leave-one-out pass
                # (MaskBlock.targets): D^2 bits, 3 s a step at D = 40000
                yield MaskBlock(None, one.expand(q, 1), w.expand(q, -1), draw=draw, targets=targets, counted=True)
                continue
            # a missing token is no target (gain 0) and no one's context; query k's target is
            # observed where observed[:, start + k] is (no (q, n, D) pass over the masks)
            gain = torch.where(observed.T[targets], 1.0 / share.clamp_min(1.0 / D)[None], 0.0)
            yield MaskBlock(None, one.expand(q, 1), w.expand(q, -1), observed[None], gain, draw=draw, targets=targets,
                            counted=True)

    def __repr__(self):
        return "PseudoLikelihood()"


class FixedRate(MaskSchedule):
    r"""A fixed masking rate :math:`r`, as in BERT (15 %) or the paper's 20 %.

    .. math:: \hat L_r = \frac{1}{P}\sum_{p=1}^P D\,\hat S_p(x; M),\quad
        M = \operatorname{round}(r D)

    **Biased**: its expectation is :math:`D\,S(x; M)`, not :math:`\log p(x)`.
    Training on it still raises :math:`\log p(x)`, but it need not reach the
    maximum: with most tokens in context the objective is nearly flat in some
    directions (for PPCA, the scale of :math:`W`), so the fit can stop short of
    the maximum-likelihood solution. On the PPCA of the paper's Fig. 2 that is
    slow optimization, not a different optimum: the exact 20 % objective's
    maximizer has the maximum-likelihood LML (``examples/ppca_fixed_rate_optimum.py``).
    The bias :math:`D\,S(x;M) - \sum_{M'} S(x;M')` is constant in the data size
    and can be computed exactly by enumeration for small D (``masks="exhaustive"``
    gives every :math:`S(x; M)` through :meth:`MaskedPretrainingLoss.curve`).

    :param float rate: the masking rate, in (0, 1).
    :param bool at_least_one: mask :math:`\max(1, \operatorname{round}(rD))`
        tokens (at most :math:`D`) instead of refusing a :math:`D` whose
        rounded count is 0: the rule of the adapters' rate curves, for corpora
        whose sequences vary in length (a 3-token sentence at 15 %).

    Example::

        >>> loss = MaskedPretrainingLoss(masks=0.15)  # FixedRate(0.15): BERT's rate
        >>> next(FixedRate(0.2, 2).blocks(3, 10)).size.tolist()  # round(0.2 * 10) targets a mask
        [[2], [2]]
        >>> FixedRate(0.15, at_least_one=True).size(3)  # round(0.45) = 0, raised to 1
        1
    """

    def __init__(self, rate, num_masks=1, *, share_masks=False, at_least_one=False):
        super().__init__(num_masks, share_masks=share_masks)
        if isinstance(rate, bool) or not isinstance(rate, Real) or not 0.0 < rate < 1.0:
            raise ValueError(
                f"A fixed masking rate must be a float in (0, 1), got {rate!r}; "
                f'e.g. masks=0.15, or masks="uniform" for an unbiased schedule.'
            )
        self.rate = float(written_rates(rate))  # a float32 0.29 is 0.29, as written
        self.at_least_one = checked_flag(
            at_least_one, "at_least_one", "mask at least one token", "refuse a D whose rounded count is 0"
        )

    def size(self, D):
        r"""The mask size :math:`\operatorname{round}(r D)`, halves up
        (:func:`~pyro_mpt.counts.rate_count`; with ``at_least_one``, clamped to :math:`1..D`): an int for an int ``D``, long ``(n,)`` for counts ``(n,)``."""
        M = rate_count(self.rate, D)
        if torch.is_tensor(D):
            return torch.minimum(M.clamp(min=1), D.long()) if self.at_least_one else M
        return min(max(M, 1), int(D)) if self.at_least_one else M

    def check(self, D):
        super().check(D)
        if self.at_least_one:
            return
        if D < 2:
            raise ValueError(
                f"A fixed masking rate needs D >= 2 tokens (some masked, some "
                f"context), got D={D}. With one token use masks=\"all\"."
            )
        M = self.size(D)
        if M < 1:
            raise ValueError(
                f"masks={self.rate} masks round({self.rate} * {D}) = 0 of D={D} tokens; "
                f"use a rate of at least {0.5 / D:.3g}."
            )

    def _check_counts(self, counts):
        """Raise ``ValueError`` when the rate masks no token of a datapoint's ``counts`` (long ``(n,)``) observed ones."""
        short = (counts > 0) & (self.size(counts) < 1)
        if bool(short.any()):
            fewest = int(counts[short].min())
            raise ValueError(
                f"masks={self.rate} masks round({self.rate} * D_i) = 0 of the D_i observed "
                f"tokens of {int(short.sum())} datapoint(s) with missing tokens (fewest: "
                f"D_i = {fewest}); use a rate of at least {0.5 / fewest:.3g}, or "
                f'masks="uniform".'
            )

    def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
        self.check(D)
        tokens = self.maskable_tokens(n, D, device, observed)
        if observed is not None:
            self._check_counts(tokens.count)
        # M = round(rate D), or per datapoint round(rate D_i) of its observed tokens
        size = torch.as_tensor(self.size(tokens.count), device=device).reshape(1, -1)
        w = tokens.per_token(self.num_masks)
        for start, stop in tokens.spans(self.num_masks, max_elements):
            q = stop - start
            yield tokens.block(tokens.ranks(q) < size[..., None], size.expand(q, -1), w.expand(q, -1))

    def __repr__(self):
        extra = ", at_least_one=True" if self.at_least_one else ""
        return f"FixedRate({self.rate}, num_masks={self.num_masks}{self._shared_repr()}{extra})"


_NAMED = {
    "all": AllSizes,
    "uniform": UniformSizes,
    "stratified": lambda num_masks, share_masks: UniformSizes(
        num_masks, stratified=True, share_masks=share_masks
    ),
    "order": RandomOrders,
    "exhaustive": Exhaustive,
    "nested": lambda num_masks, share_masks: AllSizes(num_masks, nested=True, share_masks=share_masks),
    "pll": PseudoLikelihood,
}


def _checked_share_masks(value):
    return checked_flag(value, "share_masks", "one mask set for the whole batch", "masks per datapoint")


def make_schedule(masks, num_masks=1, share_masks=None):
    """Build a schedule from a name, a rate or a :class:`MaskSchedule`.

    :param masks: ``"all"``, ``"uniform"``, ``"stratified"``, ``"order"``,
        ``"exhaustive"``, ``"nested"``, ``"pll"``, a float rate in (0, 1), or a
        :class:`MaskSchedule`.
    :param int num_masks: masks (or orderings) per datapoint; with a
        :class:`MaskSchedule`, 1 or the schedule's own count (it keeps it).
    :param bool share_masks: one mask set for the whole batch; None (default): masks per
        datapoint for a name or a rate, and a :class:`MaskSchedule`'s own choice (given,
        it must equal that choice).
    :rtype: MaskSchedule

    Example::

        >>> make_schedule("uniform", num_masks=4)
        UniformSizes(num_masks=4, stratified=False)
    """
    if share_masks is not None:
        share_masks = _checked_share_masks(share_masks)
    if isinstance(masks, MaskSchedule):
        # the instance carries its own count: num_masks=8 beside UniformSizes(2) ran 2 masks
        # without a word (1, the default, cannot be told from no count at all)
        if num_masks != 1 and num_masks != masks.num_masks:
            raise ValueError(
                f"num_masks={num_masks!r} beside the schedule {masks!r}, which draws its own "
                f"{masks.num_masks}; give the count to the schedule ({type(masks).__name__}(num_masks="
                f"{num_masks!r}, ...)) and leave num_masks out."
            )
        # and its own choice of shared masks: share_masks=True beside UniformSizes(2) trained on
        # masks per datapoint while curve() shared them
        if share_masks is not None and share_masks != masks.share_masks:
            raise ValueError(
                f"share_masks={share_masks!r} beside the schedule {masks!r}, which "
                f"{'shares one mask set across the batch' if masks.share_masks else 'draws masks per datapoint'}; "
                f"give the choice to the schedule ({type(masks).__name__}(..., share_masks={share_masks!r})) "
                f"where it takes one, and leave share_masks out."
            )
        return masks
    if isinstance(masks, str):
        if masks not in _NAMED:
            names = ", ".join(repr(k) for k in _NAMED)
            raise ValueError(
                f"Unknown mask schedule masks={masks!r}; use one of {names}, a rate "
                f"in (0, 1), or a MaskSchedule instance."
            )
        return _NAMED[masks](num_masks=num_masks, share_masks=bool(share_masks))
    if isinstance(masks, Real) and not isinstance(masks, bool):
        return FixedRate(masks, num_masks, share_masks=bool(share_masks))
    raise TypeError(
        f"masks must be a schedule name, a rate in (0, 1) or a MaskSchedule, got {masks!r}."
    )
