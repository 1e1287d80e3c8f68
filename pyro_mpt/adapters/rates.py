r"""MPT curves over masking *rates*, for models whose inputs vary in length.

The Pyro loss indexes its curve by the mask size :math:`M = 1..D`. A corpus of
sentences or images has a different number of maskable tokens :math:`L_i` per
item, so the network adapters index the curve by the masking rate :math:`r`
instead and give item :math:`i` the exact mask count

.. math:: M_i(r) = \max\big(1, \operatorname{round}(r L_i)\big)

(``round`` halves away from zero, and :math:`M_i \le L_i`). Proposition 1 then
reads as a Riemann sum over rates,

.. math:: \log p(x_i) = \sum_{M=1}^{L_i} S(x_i; M)
    \approx L_i \int_0^1 S(x_i; r L_i)\,dr
    \approx L_i \sum_k w_k\, S(x_i; M_i(r_k)),

with :math:`w_k` the width of the cell of rate :math:`r_k` (midpoints between
neighbouring rates, the outer cells stretched to 0 and 1):
:meth:`RateCurve.area`. The paper's Table 2 uses a different, fixed convention
(:func:`table2_area`).

Masks are drawn from one :class:`torch.Generator` per item, seeded from
``(seed, item index)``, as ``num_masks`` random permutations per item; the mask
of size :math:`M` is the first :math:`M` tokens of a permutation. The masks of
different rates are thus *nested* (common random numbers across the curve) and
do not depend on how items are batched, sharded or ordered.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..curve import CurveAccumulator, MPTCurve
from ..counts import rate_count, written_rates

__all__ = [
    "RateCurve",
    "table2_area",
    "rate_grid",
    "parse_rates",
    "mask_counts",
    "rate_weights",
    "item_seed",
    "item_generator",
    "nested_ranks",
    "PAPER_MLM_RATES",
    "PAPER_MAE_RATES",
]

#: The paper's BERT grid (section 3.2): 1 %, 2 %, ..., 99 %.
PAPER_MLM_RATES = np.round(np.arange(1, 100) / 100.0, 10)
#: The ViT-MAE grid of Fig. 6: 5 %, 10 %, ..., 95 %.
PAPER_MAE_RATES = np.round(np.arange(5, 100, 5) / 100.0, 10)


def rate_grid(start, stop, step):
    """Rates ``start, start + step, ..., stop`` (inclusive), rounded to 1e-10.

    Example::

        >>> rate_grid(0.05, 0.95, 0.05).size
        19
    """
    n = int(np.floor((stop - start) / step + 1e-9)) + 1
    return np.round(start + step * np.arange(n), 10)


def parse_rates(spec):
    """Rates from a command-line string: ``"0.01:0.99:0.01"`` (start:stop:step,
    inclusive) or a comma list ``"0.05,0.15,0.5"``; values in (0, 1).

    :raises ValueError: naming the bad value.

    Example::

        >>> parse_rates("0.1:0.3:0.1")
        array([0.1, 0.2, 0.3])
        >>> parse_rates("0.05,0.15,0.5")
        array([0.05, 0.15, 0.5 ])
    """
    spec = str(spec).strip()
    unreadable = ValueError(
        f"Cannot read rates {spec!r}; write start:stop:step (e.g. 0.01:0.99:0.01) "
        f"or a comma list (e.g. 0.05,0.15,0.5)."
    )
    try:
        if ":" in spec:
            start, stop, step = (float(v) for v in spec.split(":"))
        else:
            rates = np.array([float(v) for v in spec.split(",") if v.strip()])
    except ValueError:
        raise unreadable from None
    if ":" in spec:
        if step <= 0 or stop < start:
            raise ValueError(
                f"Rates {spec!r}: start:stop:step needs start <= stop and a positive step "
                f"(e.g. 0.1:0.5:0.1), got start {start:g}, stop {stop:g}, step {step:g}."
            )
        try:
            rates = rate_grid(start, stop, step)
        except ValueError:  # NaN bounds or step: no grid
            raise unreadable from None
    # the spec's own words, not check_rates' Python example: the spec comes from a command line
    if rates.size == 0 or not np.all((rates > 0) & (rates < 1)) or np.any(np.diff(rates) <= 0):
        raise ValueError(
            f"Rates {spec!r} give {rates.tolist()!r}; masking rates must increase and lie strictly "
            f"between 0 and 1, e.g. 0.01:0.99:0.01 or 0.05,0.15,0.5."
        )
    return check_rates(rates)


def check_rates(rates):
    """Validate and return rates as a sorted float64 array in (0, 1) (float32 rates as written,
    :func:`~pyro_mpt.counts.written_rates`)."""
    rates = written_rates(rates).reshape(-1)
    if rates.size == 0 or not np.all((rates > 0) & (rates < 1)):
        raise ValueError(
            f"rates must be a non-empty list of masking rates in (0, 1), got {rates.tolist()!r}; "
            f"e.g. rates=np.arange(1, 100) / 100."
        )
    if np.any(np.diff(rates) <= 0):
        raise ValueError(f"rates must be strictly increasing, got {rates.tolist()!r}.")
    return rates


def mask_counts(rates, lengths):
    r"""Exact mask counts :math:`M = \min(L, \max(1, \lfloor rL + 1/2\rfloor))`, halves
    rounded up as the rate is written (:func:`~pyro_mpt.counts.rate_count`).

    :param rates: ``(R,)`` masking rates.
    :param lengths: ``(n,)`` numbers of maskable tokens.
    :returns: long tensor ``(n, R)``.
    """
    r = torch.as_tensor(written_rates(rates), device="cpu")
    L = torch.as_tensor(np.asarray(lengths), device="cpu").to(torch.int64)
    m = rate_count(r[None, :], L[:, None])
    return torch.minimum(m.clamp(min=1), L[:, None])


def rate_weights(rates):
    r"""Cell widths :math:`w_k` of a Riemann sum of :math:`\int_0^1 S(r)\,dr`.

    Cell :math:`k` spans the midpoints to its neighbours; the first cell starts
    at 0 and the last ends at 1, so :math:`\sum_k w_k = 1`. On the paper's grid
    (1 %..99 %) every inner cell is 0.01 wide and the two outer ones 0.015.
    """
    r = check_rates(rates)
    edges = np.concatenate([[0.0], (r[1:] + r[:-1]) / 2.0, [1.0]])
    return np.diff(edges)


def item_seed(seed, index):
    """A 63-bit seed derived from ``(seed, index)`` (``numpy.random.SeedSequence``)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(index)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def item_generator(seed, index):
    """A CPU :class:`torch.Generator` seeded with :func:`item_seed`.

    One stream per item makes an item's masks independent of batching,
    sharding and of which other items are scored.
    """
    g = torch.Generator()
    g.manual_seed(item_seed(seed, index))
    return g


def nested_ranks(generator, num_masks, length):
    """Ranks of ``num_masks`` random permutations of ``length`` tokens.

    Token ``j`` is in the mask of size ``M`` of permutation ``k`` iff
    ``ranks[k, j] < M``, so masks of growing size are nested.

    :returns: long tensor ``(num_masks, length)``.
    """
    return torch.rand((num_masks, length), generator=generator, device=generator.device).argsort(-1).argsort(-1)


@dataclass
class RateCurve(MPTCurve):
    r"""An :class:`~pyro_mpt.curve.MPTCurve` indexed by masking rate.

    ``score[k]`` is the mean over items and masks of
    :math:`\hat S(x_i; M_i(r_k))`, the mean masked-token log-probability at rate
    :math:`r_k`; ``rates`` holds :math:`r_k`, ``sizes`` the mean mask count and
    ``num_tokens`` the mean number :math:`\bar L` of maskable tokens.

    :param numpy.ndarray per_item: ``(n, R)``, each item's score averaged over
        its masks.
    :param numpy.ndarray lengths: ``(n,)``, maskable tokens :math:`L_i` per item.
    :param numpy.ndarray per_mask: ``(R, K)``, the scores of each of the
        :math:`K` masks when the curve has a single item, else None. The masks
        are independent random permutations, so a single item's standard
        errors are over its masks (NaN with one mask), not 0.

    Example::

        >>> curve = scorer.curve(texts)
        >>> curve.area()             # mean-length LML approximation
        >>> curve.per_item_area()    # one approximation per text
        >>> table2_area(curve)       # the paper's Table 2 convention
    """

    per_item: Optional[np.ndarray] = None
    lengths: Optional[np.ndarray] = None
    per_mask: Optional[np.ndarray] = None

    def area(self, num_tokens=None):
        r""":math:`D \sum_k w_k S(r_k)`, the Riemann sum of :math:`D\int_0^1 S(r)dr`.

        :math:`S(r)` is a step function: rate :math:`r` masks :math:`M = \max(1, \lfloor rL
        + 1/2\rfloor)` tokens, so :math:`M = 1` holds the rates below :math:`1.5/L` and
        :math:`M = L` those above :math:`1 - 0.5/L`, and the integral is
        :math:`\sum_M S(M) + \tfrac12(S(1) - S(L))`, half the curve's drop away from the
        cumulative score however fine the grid (the scorers' ``score()`` estimates
        :math:`\sum_M S(M)` itself).

        :param float num_tokens: :math:`D`; default the mean number of maskable
            tokens of the scored items.
        """
        D = self.num_tokens if num_tokens is None else num_tokens
        if np.isnan(self.score).any():
            bad = np.asarray(self.rates)[np.isnan(self.score)].tolist()
            raise ValueError(
                f"The curve is NaN at rate(s) {bad}, so its area is undefined; check the "
                f"per-item scores (curve.per_item) for NaN values, or drop those rates."
            )
        return float(D * np.sum(rate_weights(self.rates) * self.score))

    def area_stderr(self, num_tokens=None):
        r"""Standard error of :meth:`area`.

        The area is the mean over items of :math:`a_i = D\sum_k w_k \bar
        S_i(r_k)`, so its error is :math:`\operatorname{sd}_i(a_i)/\sqrt n`; an
        item's masks are nested across rates, so its scores at different
        rates are correlated and adding per-rate errors in quadrature would
        understate it. With a single item, the same over its :math:`K` masks'
        areas (NaN when :math:`K = 1`). Without per-item scores, the per-rate
        errors are added as if independent.
        """
        D = self.num_tokens if num_tokens is None else num_tokens
        w = rate_weights(self.rates)
        if self.per_item is not None and len(self.per_item) > 1:
            a = D * (np.asarray(self.per_item, dtype=np.float64) @ w)
            return float(a.std(ddof=1) / np.sqrt(len(a)))
        if self.per_mask is not None:
            # one item: its masks' areas are independent draws (nested across rates within a mask)
            a = D * (w @ np.asarray(self.per_mask, dtype=np.float64))
            return float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else float("nan")
        return float(D * np.sqrt(np.sum((w * self.stderr) ** 2)))

    def per_item_area(self):
        r""":math:`L_i \sum_k w_k \bar S_i(r_k)` per item, shape ``(n,)``: the Riemann sum of
        :math:`L_i\int_0^1 S_i(r)dr`, which is :math:`\tfrac12(S_i(1) - S_i(L_i))` away from
        the cumulative score :math:`\sum_M S_i(M)` (see :meth:`area`)."""
        if self.per_item is None:
            raise ValueError(
                "This curve was built without per-item scores (per_item=None); build it with "
                "rate_curve(values, rates, lengths), as the scorers do."
            )
        return self.lengths * (self.per_item @ rate_weights(self.rates))

    def to_dict(self):
        """JSON-ready summary: rates, curve, standard errors, areas."""
        out = {
            "rates": self.rates.tolist(),
            "score": self.score.tolist(),
            "stderr": self.stderr.tolist(),
            "count": None if self.count is None else np.asarray(self.count).tolist(),
            "mean_mask_size": np.asarray(self.sizes, dtype=float).tolist(),
            "mean_num_tokens": float(self.num_tokens),
            "area": self.area(),
            "area_stderr": self.area_stderr(),
            "label": self.label,
        }
        if self.per_item is not None:
            out["per_item_area"] = self.per_item_area().tolist()
            out["lengths"] = np.asarray(self.lengths).tolist()
        # an unknown standard error (one item, one mask) is null: NaN is not JSON
        out["stderr"] = [None if np.isnan(v) else v for v in out["stderr"]]
        out["area_stderr"] = None if np.isnan(out["area_stderr"]) else out["area_stderr"]
        return out


def rate_curve(values, rates, lengths, label=None):
    """Build a :class:`RateCurve` from per-query scores.

    :param torch.Tensor values: ``(n, R, K)`` scores :math:`\\hat S` of item i,
        rate k, mask p.
    :param rates: ``(R,)``.
    :param lengths: ``(n,)`` maskable tokens.
    """
    values = torch.as_tensor(values, dtype=torch.float64, device="cpu")
    n, R, K = values.shape
    acc = CurveAccumulator(R)
    # one add in a fixed order: sums do not depend on how the values were computed; the
    # items as columns, so that each rate's standard error is over items, not item x mask
    size = torch.arange(1, R + 1, device="cpu").view(R, 1, 1).expand(R, K, n)
    acc.add(values.permute(1, 2, 0).reshape(R * K, n), size.reshape(R * K, n))
    base = acc.result(label)
    stderr, per_mask = base.stderr, None
    if n == 1:
        # one item: its K masks are independent permutations, the only randomness left
        per_mask = values[0].numpy()
        stderr = per_mask.std(-1, ddof=1) / np.sqrt(K) if K > 1 else np.full(R, np.nan)
    lengths = np.asarray(lengths, dtype=np.float64)
    m = mask_counts(rates, lengths).double().mean(0).numpy()
    return RateCurve(
        sizes=m,
        num_tokens=float(lengths.mean()),
        score=base.score,
        stderr=stderr,
        count=base.count,
        label=label,
        rates_override=np.asarray(rates, dtype=np.float64),
        per_item=values.mean(-1).numpy(),
        lengths=lengths,
        per_mask=per_mask,
    )


def table2_area(curve, num_tokens=512, step=0.01, strict=True):
    r"""The area convention we infer for the paper's Table 2 (BERT on GLUE).

    .. math:: A_{\text{Table 2}} = \sum_{k=1}^{99} \bar S(r_k) \times 0.01 \times 512,
        \qquad r_k = k / 100,

    i.e. the mean masked-token log-probability at each of the 99 rates, summed,
    times the rate step and BERT's maximum sequence length 512, whatever the
    actual sentence lengths. The paper says only that it computed "the mean
    cross-entropy per each rate of masking between 1% and 99%" and never
    mentions 512; the scale is inferred from the magnitudes (a random-init BERT,
    about uniform over its 30522 tokens, gives
    :math:`-\log 30522 \times 0.99 \times 512 \approx -5234`; the paper's
    random-init row is -5245 … -5362). It is a scaled mean curve height, not a
    per-sentence LML estimate: GLUE sentences have far fewer than 512 tokens.
    Use :meth:`RateCurve.per_item_area` or
    :meth:`~pyro_mpt.adapters.MaskedLMScorer.score` for those.

    :param RateCurve curve: a curve on the 1 %..99 % grid.
    :param float num_tokens: 512, BERT's maximum length (inferred, see above).
    :param float step: 0.01, the step of the 1 %..99 % grid.
    :param bool strict: refuse curves on another rate grid.
    :rtype: float

    Example::

        >>> curve = scorer.curve(sentences, rates=PAPER_MLM_RATES)  # MaskedLMScorer, 1 %..99 %
        >>> table2_area(curve)  # comparable with the paper's Table 2
    """
    rates = np.asarray(curve.rates)
    if strict and (rates.shape != PAPER_MLM_RATES.shape or not np.allclose(rates, PAPER_MLM_RATES)):
        raise ValueError(
            f"table2_area reproduces the paper's 99-rate grid (1%..99%); this curve has "
            f"{rates.size} rates from {rates.min():.3g} to {rates.max():.3g}. Compute it with "
            f"rates=PAPER_MLM_RATES, or pass strict=False to apply the formula anyway."
        )
    return float(np.sum(curve.score) * step * num_tokens)
