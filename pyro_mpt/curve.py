r"""The MPT curve: the masked pre-training score :math:`S(x; M)` per mask size.

Proposition 1 reads the log-marginal likelihood as the area under this curve,
:math:`\log p(x) = \sum_{M=1}^D S(x; M)`. :class:`MPTCurve` holds the mean over
the data of the estimated :math:`S(x; M)` with its standard error, and is shared
by the Pyro loss (:meth:`~pyro_mpt.MaskedPretrainingLoss.curve`) and the
HuggingFace adapters.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

__all__ = ["MPTCurve", "CurveAccumulator"]


@dataclass
class MPTCurve:
    r"""Mean masked-token log-probability per mask size.

    :param numpy.ndarray sizes: mask sizes :math:`M`, shape ``(S,)``.
    :param int num_tokens: :math:`D`, the number of tokens (so ``rates = sizes / D``).
    :param numpy.ndarray score: mean of :math:`\hat S(x; M)` over data and masks,
        shape ``(S,)``; NaN where a size received no query.
    :param numpy.ndarray stderr: standard error of ``score``, shape ``(S,)``.
    :param numpy.ndarray count: number of (datapoint, mask) values per size.
    :param str label: legend label for :meth:`plot`.
    :param numpy.ndarray item_areas: ``(n,)`` per-datapoint areas
        :math:`\sum_M \hat S(x_i; M)`, whose mean is :meth:`area`; they give
        :meth:`area_stderr`.
    :param numpy.ndarray mask_variance: ``(S,)``, with masks shared by the batch, the
        variance of each size's mean that the draw of the masks adds (common to every
        datapoint, so not in the spread of ``item_areas``), counted in ``stderr``; None
        (no such variance, or unknown).
    :param float area_mask_variance: the same for the area, counted in
        :meth:`area_stderr` (the sum of ``mask_variance`` where the sizes' masks are
        drawn independently; from the spread of the mask sets' areas where they are not,
        nested masks or orderings); None (no such variance), NaN (shared masks whose
        variance is not known: :meth:`area_stderr` is NaN).

    Example::

        >>> curve = loss.curve(model, None, x)
        >>> curve.area()        # estimate of the mean log p(x_i)
        >>> curve.plot()        # S(x; M) against the masking rate
    """

    sizes: np.ndarray
    num_tokens: int
    score: np.ndarray
    stderr: np.ndarray
    count: np.ndarray = field(default=None)
    label: Optional[str] = None
    rates_override: Optional[np.ndarray] = None
    item_areas: Optional[np.ndarray] = None
    mask_variance: Optional[np.ndarray] = None
    area_mask_variance: Optional[float] = None

    @property
    def rates(self):
        """Masking rates :math:`M / D`, shape ``(S,)``."""
        if self.rates_override is not None:
            return self.rates_override
        return np.asarray(self.sizes, dtype=float) / float(self.num_tokens)

    def area(self):
        r"""The cumulative score :math:`\sum_M S(x; M)`: the LML estimate per datapoint.

        :raises ValueError: when some sizes got no query (the area would be
            incomplete); use a schedule that covers every size (``"all"``,
            ``"order"``, ``"exhaustive"``).
        """
        if np.isnan(self.score).any():
            missing = int(np.isnan(self.score).sum())
            raise ValueError(
                f"The curve has no value at {missing} mask size(s), so its area is "
                f"incomplete; compute it with masks='all', 'order' or 'exhaustive'."
            )
        return float(np.sum(self.score))

    def area_stderr(self):
        r"""Standard error of :meth:`area`.

        From the per-datapoint areas when the curve has them (the loss's
        :meth:`~pyro_mpt.MaskedPretrainingLoss.curve` records them):
        :math:`\operatorname{sd}_i(a_i)/\sqrt n`. This is right although the
        sizes may be correlated: the masks of ``"nested"`` and ``"order"`` are
        nested (prefixes of one ordering), so one datapoint's
        :math:`\hat S(x_i; M)` move together over :math:`M`, and adding the
        per-size errors in quadrature would understate the error about
        twofold (``"all"`` draws its sizes independently). It is the error of
        the area as an estimate of the mean log-likelihood of the population the
        data are drawn from: it counts the spread of :math:`\log p(x_i)` over
        the data as well as the mask noise, so it bounds the mask noise alone
        from above (tightly when one mask set per datapoint dominates, loosely
        with many). With masks shared by the batch (``share_masks=True``, the
        default of :meth:`~pyro_mpt.MaskedPretrainingLoss.curve`) the mask
        draw is common to all datapoints and does not show in that spread: its
        variance (``area_mask_variance``) is added; where it is not known (one set of
        nested masks or orderings, see :class:`CurveAccumulator`) it is NaN, and so is
        this error. With one datapoint (the whole data set one
        datapoint, ``token_plates``) it is the masks' share alone, the error of that
        datapoint's own area, where it is known, else NaN.
        Without per-datapoint areas, the per-size errors are added as if independent.
        NaN where some sizes got no query (:meth:`area` refuses such a curve: e.g. the
        ``"pll"`` schedule's, one size): the per-datapoint sums over the sizes that did
        are not areas.
        """
        if np.isnan(self.score).any():
            return float("nan")
        if self.item_areas is not None:
            a = np.asarray(self.item_areas, dtype=np.float64)
            # one datapoint (e.g. the whole data set under token_plates): the error of its own
            # area, the masks' share, where known; else NaN, as its per-size errors
            if len(a) < 2:
                mask = self.area_mask_variance
                return float("nan") if mask is None else float(np.sqrt(mask))
            var = a.var(ddof=1) / len(a)
            if self.area_mask_variance is not None:
                var += self.area_mask_variance
            return float(np.sqrt(var))
        return float(np.sqrt(np.nansum(np.asarray(self.stderr) ** 2)))

    def plot(self, ax=None, *, color=None, fill=True, annotate=True, **kwargs):
        """Draw :math:`S(x; M)` against the masking rate (in %), like the paper's Fig. 4.

        :param matplotlib.axes.Axes ax: axes to draw on; a new figure when None.
        :param bool fill: shade the area under the curve.
        :param bool annotate: write the area in the legend label.
        :returns: the axes.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")  # the y label inside the figure
        x = 100.0 * self.rates
        label = self.label or "MPT curve"
        if annotate and not np.isnan(self.score).any():
            label = f"{label} (area {self.area():.2f})"
        (line,) = ax.plot(x, self.score, color=color, label=label, **kwargs)
        ok = ~np.isnan(self.score)
        if fill:
            ax.fill_between(x[ok], self.score[ok], np.nanmin(self.score), color=line.get_color(), alpha=0.15)
        ax.fill_between(
            x[ok],
            (self.score - 2 * self.stderr)[ok],
            (self.score + 2 * self.stderr)[ok],
            color=line.get_color(),
            alpha=0.3,
            linewidth=0,
        )
        ax.set_xlabel("masking rate (%)")
        ax.set_ylabel(r"$S(x; M)$: mean masked log-prob")
        ax.legend(loc="lower left")
        return ax


class CurveAccumulator:
    r"""Accumulate per-query scores into per-size sums for an :class:`MPTCurve`.

    Scores arrive as ``(rows, n)`` tables whose columns are the datapoints.
    ``score[M]`` is the mean of every value of size :math:`M`. Its standard
    error is taken over the datapoints, not over the values: the
    :math:`P` masks of one datapoint at one size (``num_masks``, the subsets of
    ``"exhaustive"``, masks shared by the batch) share that datapoint's
    :math:`S(x_i; M)`, so their spread is not :math:`nP` independent draws,
    and treating it so understated the error (PPCA, :math:`D = 8`,
    :math:`N = 200`, over 40 data draws: ``"exhaustive"`` 0.004 against a
    spread of 0.022 at :math:`M = 4`; ``"all"`` with 8 masks 0.011 against
    0.022). With :math:`s_i, c_i` the sum and count
    of datapoint :math:`i`'s values at size :math:`M` and
    :math:`\bar S = \sum_i s_i / \sum_i c_i`,

    .. math:: \operatorname{se}(\bar S)^2 = \frac{n_M}{n_M - 1}
        \frac{\sum_i (s_i - \bar S c_i)^2}{(\sum_i c_i)^2}

    over the :math:`n_M` datapoints with a value at that size (the ratio
    estimator's variance, clustered by datapoint; with equal counts it is
    :math:`\operatorname{sd}_i(s_i / c_i)/\sqrt{n_M}`). With one datapoint
    it is NaN, not 0: the spread over datapoints is unknown, and the spread of
    its masks cannot stand in (for ``"exhaustive"`` they are not random draws); where its
    masks' variance is estimated (below), the error is that alone, the error of the one
    datapoint's own curve (a data set scored as one datapoint under ``token_plates``).

    With masks shared by the batch (``shared``), the draw of a size's masks moves every
    datapoint's value together, which the spread over the datapoints does not see (PPCA,
    :math:`N = 500`, :math:`D = 10`, one mask set: the area's spread over mask seeds 0.38
    nats, its standard error from the data alone 0.11). Its variance is added to each
    size's: with :math:`P \ge 2` mask sets, from the spread of their means,
    :math:`\operatorname{var}_p(\bar S_p(M))/P` (where the sets drew the same masks, a
    spread of exactly 0 at a size of more than one mask, the roughness estimate below
    stands in, or NaN where there is none); with one (``shared="sizes"``: sizes drawn
    independently, as ``"all"`` draws them), from the roughness of the curve, whose
    expectation is smooth in :math:`M` while the masks of two sizes are independent
    draws. A size's mean averages :math:`M` of the :math:`D` tokens' conditionals, drawn
    without replacement, so its variance is about :math:`\sigma^2_M = c\,f_M` with
    :math:`f_M = (D - M)/(M(D - 1))` (largest at :math:`M = 1`, 0 at :math:`M = D`, one
    mask); the second differences :math:`d_M = \bar S(M-1) - 2\bar S(M) + \bar S(M+1)`
    have variance :math:`c\,(f_{M-1} + 4f_M + f_{M+1})`, so :math:`c` at :math:`M` is
    :math:`\sum d^2 / \sum (f_{M'-1} + 4f_{M'} + f_{M'+1})` over the sizes :math:`M'`
    within ``max(2, D // 10)`` of :math:`M` (per-size errors over mask seeds: 0.81--1.0
    of the spread at :math:`M = 1`, against 0.49--0.72 with a flat level). The curve's
    curvature adds to it (an estimate from above: a four-token mixture's bent curve read
    9 times its mask noise); with fewer than 3 sizes it is not estimated, and with 3
    (one difference) it is rough. One ordering shared by the batch (``shared="orders"``)
    holds at its position :math:`M` one token's conditional, a token of its own at each
    position: the same roughness estimate serves it with a flat shape, :math:`f_M = 1`
    (PPCA, :math:`D` = 8 and 20, over 100 mask and data seeds: 0.9--1.6 of the spread per
    size, against 0.24--1.05 from the data alone; the contexts, nested along the ordering,
    move together and are not seen). One set of nested masks (``"nested"``, ``shared=True``)
    moves its sizes together, so the roughness does not see its noise, and nothing is
    added: its per-size errors are the data's alone (0.3--1.0 of the spread on that PPCA),
    and ``num_masks >= 2`` gives the spread of the sets. The area's variance is the sum
    over the sizes where their draws are independent (``shared="sizes"``); nested masks and
    orderings move their sizes together, so there it is the spread of the mask sets' areas
    over :math:`P` (:meth:`start_replicate` before each set's queries), and with one set it
    is not estimated.

    :param int num_tokens: D.
    :param shared: False (masks per datapoint, or no random masks: nothing added), True
        (masks shared by the batch), ``"sizes"`` (shared, each size's masks drawn
        independently of the others') or ``"orders"`` (shared orderings).
    :param torch.Tensor present: bool ``(n,)``, the datapoints of the curve; None: all. A
        datapoint with no observed token (a padding row masked out whole) has no
        curve, and counted as zeros it shrank every mean by the share of padding.
    :param int observed_tokens: with masks shared by the batch, its datapoints' observed
        tokens where that is fewer than ``num_tokens`` (one datapoint with missing tokens):
        the sizes above hold exact zeros and the size itself every observed token, so none
        of them has a mask variance. None: ``num_tokens``.

    Example::

        >>> acc = CurveAccumulator(2)
        >>> acc.add(torch.tensor([[-1.0, -2.0], [-3.0, -2.0]]), torch.tensor([[1, 1], [2, 2]]))
        >>> acc.result().score
        array([-1.5, -2.5])
    """

    def __init__(self, num_tokens, shared=False, present=None, observed_tokens=None):
        self.num_tokens = num_tokens
        self.shared = shared
        self.present = present
        self.observed_tokens = num_tokens if observed_tokens is None else int(observed_tokens)
        self._sum = None
        self._items = []
        # per mask set (start_replicate; one where it is not called) and size: the number,
        # sum and sum of squares of the shared masks' means over the data
        self._replicates = []
        self._replicate_items = []

    def start_replicate(self):
        """The queries added from now on, and the areas of :meth:`add_items`, are one more
        set of masks, drawn independently of the others (shared by the batch): the
        spread of the sets' areas gives the area's mask variance (nested masks and
        orderings, whose sizes move together)."""
        if self._items:
            self._replicate_items.append(self._items)
            self._items = []
        self._replicates.append(np.zeros((3, self.num_tokens)))

    def add_items(self, areas):
        r"""Record per-datapoint areas :math:`\sum_M \hat S(x_i; M)`, shape ``(n,)``,
        for :meth:`MPTCurve.area_stderr`."""
        areas = areas.detach().reshape(-1)
        if self.present is not None:
            areas = areas[self.present.to(areas.device)]
        self._items.append(areas.double().cpu())

    def add(self, shat, size):
        """Add scores ``shat`` with mask sizes ``size``, both ``(rows, n)``: column ``i`` holds
        datapoint ``i``'s values (the same datapoints at every call)."""
        shat = shat.detach().double()
        shat = shat.reshape(-1, shat.shape[-1])
        idx = (size.reshape(shat.shape) - 1).to(shat.device)
        if self.present is not None:
            keep = self.present.to(shat.device)
            shat, idx = shat[:, keep], idx[:, keep]
        n = shat.shape[-1]
        if self._sum is None:
            # (D, n): each datapoint's sum per size, for the clustered standard error
            self._sum = torch.zeros((self.num_tokens, n), dtype=torch.float64, device=shat.device)
            # values per size and datapoint: one count per size while every datapoint has the
            # same (a row gives each datapoint a value of its size); a (D, n) table once they differ
            self._rows = torch.zeros(self.num_tokens, dtype=torch.float64, device=shat.device)
            self._counts = None
        if shat.numel() == 0:
            return
        if self.shared:
            # each row one mask (or one position of an ordering) for the whole batch
            means = shat.mean(1).cpu().numpy()
            rows = idx[:, 0].cpu().numpy()
            if not self._replicates:
                self._replicates.append(np.zeros((3, self.num_tokens)))
            for k, v in enumerate((np.ones_like(means), means, means**2)):
                np.add.at(self._replicates[-1][k], rows, v)
        col = torch.arange(n, device=shat.device).expand_as(idx)
        self._sum.index_put_((idx, col), shat, accumulate=True)
        if self._counts is None and bool((idx == idx[:, :1]).all()):
            self._rows.index_add_(0, idx[:, 0], torch.ones_like(shat[:, 0]))
            return
        if self._counts is None:
            self._counts = self._rows[:, None].expand(-1, n).clone()
        self._counts.index_put_((idx, col), torch.ones_like(shat), accumulate=True)

    def result(self, label=None):
        s = self._sum.cpu().numpy()
        c = (self._rows[:, None] if self._counts is None else self._counts).cpu().numpy()
        c = np.broadcast_to(c, s.shape)
        n = c.sum(1)
        items = (c > 0).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = s.sum(1) / n
            dev = ((s - mean[:, None] * c) ** 2).sum(1)
            stderr = np.sqrt(dev * items / np.maximum(items - 1, 1)) / n
        mean = np.where(n > 0, mean, np.nan)
        # one datapoint: unknown, not 0 (a random estimate reported as exact)
        stderr = np.where(items > 1, stderr, np.nan)
        mask_variance = self._mask_variance(mean)
        if mask_variance is not None:
            # the whole batch one datapoint (token_plates over the data set): its curve's error
            # is its masks' alone, with no population of datapoints to estimate beyond it
            data = 0.0 if bool((items <= 1).all()) else stderr**2
            stderr = np.sqrt(data + mask_variance)
        sizes = np.arange(1, self.num_tokens + 1)
        sets = self._replicate_items + ([self._items] if self._items else [])
        # each datapoint's area: the mean over the mask sets of its area in each
        areas = np.mean([torch.cat(items).numpy() for items in sets], 0) if sets else None
        return MPTCurve(sizes, self.num_tokens, mean, stderr, n.astype(int), label, item_areas=areas,
                        mask_variance=mask_variance, area_mask_variance=self._area_mask_variance(mask_variance))

    def _area_mask_variance(self, mask_variance):
        """The variance the shared masks' draw adds to the area: None where masks are not
        shared; NaN where they are and no spread shows the draw (one set of nested masks or
        orderings moves the whole area with it, and the data's spread alone understated
        the error: area z-scores of RMS 7.7 over 30 seeds on PPCA, nested masks)."""
        if not self.shared:
            return None
        if len(self._replicates) >= 2:
            count, total, _ = np.stack(self._replicates, 1)  # (P, D) each
            with np.errstate(invalid="ignore", divide="ignore"):
                areas = np.where(count > 0, total / count, 0.0).sum(1)
            return float(areas.var(ddof=1) / len(areas))
        if self.shared == "sizes" and mask_variance is not None:
            # a size with values and no variance estimate (below 3 sizes, sets that drew the same
            # masks) leaves the area's unknown: nansum dropped it (D = 2: +- 0 for a random area)
            return float(np.sum(mask_variance[self._replicate_totals()[0] > 0]))
        return float("nan")

    def _mask_variance(self, mean):
        """Per size, the variance the shared masks' draw adds to its mean, ``(D,)``; None
        where masks are not shared or it is not estimated (see the class docstring)."""
        if not self.shared:
            return None
        count, total, squares = self._replicate_totals()
        # sizes without values (above a one-datapoint curve's observed tokens) have no variance
        if bool((count[count > 0] >= 2).all()) and bool((count > 0).any()):
            with np.errstate(invalid="ignore", divide="ignore"):
                var = np.maximum((squares - total**2 / count) / (count - 1), 0.0) / count
            var = np.where(count > 0, var, np.nan)
            # sets that drew the same masks (two of the C(D, M) subsets, chance 1 / C(D, M)) agree
            # exactly: a random mean then read as exact (a one-datapoint curve at M = 2 of D = 6,
            # -0.472 +- 0 against the exact -0.766). Where a size has more than one mask, a zero
            # spread is no estimate: the roughness of the curve stands in for it, else unknown
            # (at the largest size, all of a datapoint's observed tokens, one mask: exact, but an
            # ordering's last position holds one token's marginal, random too; above it, exact zeros)
            sizes = np.arange(1, self.num_tokens + 1)
            last_random = self.observed_tokens - 1 + (self.shared == "orders")
            unseen = (var == 0) & (sizes <= last_random)
            if bool(unseen.any()):
                rough = self._roughness_variance(mean)
                var = np.where(unseen, np.nan if rough is None else rough, var)
            # a one-datapoint curve's sizes past its observed tokens: no draw moves them (the
            # roughness model counted 0.45 there, doubling the area's error)
            return np.where(sizes > last_random + 1, np.where(count > 0, 0.0, np.nan), var)
        return self._roughness_variance(mean)

    def _replicate_totals(self):
        """Per size, the number, sum and sum of squares of the shared masks' means, over all the
        mask sets, ``(3, D)``."""
        return sum(self._replicates, np.zeros((3, self.num_tokens)))

    def _roughness_variance(self, mean):
        """Per size, the mask variance estimated from the roughness of the curve of one
        mask set (see the class docstring), ``(D,)``; None where it is not estimated."""
        D = self.num_tokens
        if self.shared not in ("sizes", "orders") or D < 3 or not bool(np.isfinite(mean).all()):
            return None
        sizes = np.arange(1, D + 1)
        if self.shared == "sizes":
            # the noise's shape over the sizes: M of the D tokens' conditionals averaged, without
            # replacement, so about c (D - M) / (M (D - 1)), largest at M = 1 and 0 at M = D (one mask)
            shape = (D - sizes) / (sizes * (D - 1.0))
        else:
            # an ordering's position M holds one token's conditional, its token of its own: the
            # token's draw is the noise, of a level c that varies slowly with M
            shape = np.ones(D)
        d2 = np.diff(mean, 2) ** 2  # (D - 2,): entry k centred at size index k + 1
        g = shape[:-2] + 4 * shape[1:-1] + shape[2:]  # its variance over c
        half = max(2, D // 10)
        # each size's c from the entries centred within half of it (ratio of sums, by cumulative sums)
        num, den = (np.concatenate([[0.0], np.cumsum(v)]) for v in (d2, g))
        M = np.arange(D)
        lo = np.clip(M - 1 - half, 0, D - 2)
        hi = np.clip(M + half, 0, D - 2)
        return (num[hi] - num[lo]) / (den[hi] - den[lo]) * shape
