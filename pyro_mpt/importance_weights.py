r"""Diagnostics of importance weights: effective sample size and PSIS :math:`\hat k`.

Every importance-sampling estimate in pyro_mpt (``Evidence(method="importance")``,
``conditionals="importance"``) reads the reliability of its weights
:math:`w_s`, :math:`s = 1..S`, off two numbers per estimate:

* the effective sample size :math:`\mathrm{ESS} = (\sum_s w_s)^2 / \sum_s w_s^2`;
* the Pareto shape :math:`\hat k` fitted to the largest weights by
  Pareto smoothed importance sampling (PSIS, Vehtari et al. 2024; the fit of
  ``arviz.psislw``, written here without importing arviz). :math:`\hat k > 0.7` means the
  weights' variance is effectively infinite: the estimate and its standard
  error are unreliable.

**When** :math:`\hat k` **is undefined.** The Pareto fit needs a continuous
tail: it uses the :math:`M + 1` largest weights,
:math:`M = \lceil \min(S/5,\, 3\sqrt S)\rceil`. Weights of a *discrete*
latent drawn from its prior take one value per latent value, so the tail is
a few tied values -- a Pareto fit then reports :math:`\hat k = \infty`, a false
alarm: tied weights are bounded, their variance is finite and the delta-method
standard error is valid. :func:`psis_khat` reports :math:`\hat k` as NaN
(undefined) when fewer than half of those :math:`M + 1` weights, or fewer
than 6, are distinct (to a few units in the last place); this also covers
:math:`S \le 20`, where the tail has too few draws for a fit. Where
:math:`\hat k` is undefined (or not computed), the weights are judged by
their ESS alone: fewer than ``min_ess`` effective samples (default 10) means
the estimate rests on a handful of draws. Equal weights (a zero-variance
proposal such as the exact posterior) have no tail and get
:math:`\hat k = -\infty`.

:func:`warn_poor_weights` applies both rules and issues one
:class:`ImportanceSamplingWarning` per call that carries the numbers.
"""

import math
import warnings

import torch
from .code_origin import user_stacklevel

__all__ = [
    "ImportanceSamplingWarning",
    "effective_sample_size",
    "psis_khat",
    "poor_weights",
    "warn_poor_weights",
]


class ImportanceSamplingWarning(UserWarning):
    """Importance weights too poor to trust the estimate (PSIS :math:`\\hat k > 0.7`, or few effective samples).

    :param str message: the warning text.
    :param torch.Tensor khat: :math:`\\hat k` of the estimates checked (NaN where undefined).
    :param torch.Tensor ess: their effective sample sizes.
    """

    def __init__(self, message, *, khat=None, ess=None):
        super().__init__(message)
        self.khat = khat
        self.ess = ess


def effective_sample_size(log_weights, dim=0):
    """:math:`(\\sum_s w_s)^2 / \\sum_s w_s^2` along ``dim`` (detached)."""
    lw = log_weights.detach()
    return torch.exp(2 * torch.logsumexp(lw, dim) - torch.logsumexp(2 * lw, dim))


def _tail_size(S):
    # PSIS's tail length (arviz.psislw with reff = 1)
    return int(math.ceil(min(S / 5.0, 3 * math.sqrt(S))))


#: Zhang & Stephens' (2009) empirical-Bayes fit of the generalized Pareto shape: prior
#: scale of the grid of b values, and Vehtari et al.'s (2024) weakly informative prior on
#: k (PRIOR_K pseudo-observations at 0.5), as ``arviz.psislw`` fits them
GRID_PRIOR_SCALE = 3.0
PRIOR_K = 10.0

#: elements of the fit's largest tables, ``(rows, grid, m)`` and ``(rows, grid, grid)``, per
#: group of rows fitted together: all of a batch's columns at once took 25 to 60 times the
#: bytes of the log-weights (S = 1000, 10000 datapoints: 40 MB of float32 weights, 1.0 GB
#: more peak RSS; S = 100, 100000 datapoints: 2.4 GB)
FIT_ELEMENTS = 2**21


def _gpd_fit(tail):
    r"""Generalized Pareto ``(k, sigma)`` per row of exceedances ``tail`` ``(c, m)`` (ascending,
    positive, float64): Zhang & Stephens' (2009) posterior mean of :math:`b = -k/\sigma` over a
    grid of :math:`30 + \lfloor\sqrt m\rfloor` values, each weighted by its profile
    likelihood, then :math:`k` shrunk towards 0.5 by ``PRIOR_K`` pseudo-observations."""
    c, m = tail.shape
    grid = 30 + int(math.sqrt(m))
    step = max(1, FIT_ELEMENTS // (grid * max(grid, m)))
    if c > step:
        fits = [_gpd_fit(tail[i : i + step]) for i in range(0, c, step)]
        return torch.cat([k for k, _ in fits]), torch.cat([sigma for _, sigma in fits])
    j = torch.arange(1, grid + 1, dtype=tail.dtype, device=tail.device)
    quartile = tail[:, int(m / 4 + 0.5) - 1 : int(m / 4 + 0.5)]
    b = (1 - torch.sqrt(grid / (j - 0.5))) / (GRID_PRIOR_SCALE * quartile) + 1 / tail[:, -1:]  # (c, grid)
    k = torch.log1p(-b[:, :, None] * tail[:, None, :]).mean(-1)
    profile = m * (torch.log(-b / k) - k - 1)
    weights = 1 / torch.exp(profile[:, None, :] - profile[:, :, None]).sum(-1)
    weights = torch.where(weights >= 10 * torch.finfo(tail.dtype).eps, weights, torch.zeros_like(weights))
    b_post = (b * weights).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True)
    k_post = torch.log1p(-b_post * tail).mean(-1)
    sigma = -k_post / b_post[:, 0]
    return (m * k_post + PRIOR_K * 0.5) / (m + PRIOR_K), sigma


def _pareto_smoothed(rel, M):
    r"""PSIS of each column of ``rel`` ``(S, c)`` (float64, column maxima 0): the weights
    above the :math:`(M+1)`-th largest are replaced by the quantiles
    :math:`(i - \tfrac12)/m` of the generalized Pareto fitted to their exceedances and
    capped at the largest raw weight. Returns ``(k (c,), smoothed (S, c))``; :math:`k = \infty`
    where 4 or fewer weights exceed the cutoff, and the raw weights where the fit fails.

    Written here (the tail length, the fit and the quantiles as ``arviz.psislw``, Vehtari et
    al. 2024, computes them) because importing arviz takes 1.3 s of CPU, which the first step
    of every importance-sampling loss paid."""
    S, c = rel.shape
    order = rel.argsort(0)  # ascending
    cutoff = rel.gather(0, order[S - M - 1 : S - M]).clamp_min(math.log(torch.finfo(torch.float64).tiny))  # (1, c)
    above = rel > cutoff
    count = above.sum(0)
    khat = torch.full((c,), math.inf, dtype=rel.dtype, device=rel.device)
    smoothed = rel.clone()
    for m in count.unique().tolist():  # one length in all but tied tails
        if m <= 4:
            continue
        cols = (count == m).nonzero().flatten()
        idx = order[S - m :, cols]  # (m, c'), ascending: ties at the cutoff sort below it
        floor = cutoff[0, cols, None].exp()
        raw = rel[idx, cols]  # (m, c')
        tail = (raw.T.exp() - floor).contiguous()
        k, sigma = _gpd_fit(tail)
        p = (torch.arange(m, dtype=rel.dtype, device=rel.device) + 0.5) / m
        small = k.abs() < torch.finfo(rel.dtype).eps
        kk = torch.where(small, torch.ones_like(k), k)[:, None]
        q = torch.where(small[:, None], -torch.log1p(-p), torch.expm1(-kk * torch.log1p(-p)) / kk) * sigma[:, None]
        new = torch.log(q + floor).clamp_max(0)
        ok = torch.isfinite(k) & (sigma > 0) & torch.isfinite(new).all(-1)
        khat[cols] = k
        # only the tail's entries change: written at their (draw, column) pairs, not through
        # copies of whole columns (three more tables of the log-weights' size at the peak)
        smoothed[idx, cols] = torch.where(ok[None, :], new.T, raw)
    return khat, smoothed


def psis_khat(log_weights, fit=True):
    """Pareto :math:`\\hat k` per column and the Pareto-smoothed log-weights (PSIS, as
    ``arviz.psislw`` computes them), NaN where :math:`\\hat k` is undefined.

    Columns of two or more weights, all equal, get :math:`-\\infty`; columns whose
    tail has too few distinct weights (tied weights of a discrete latent, or
    :math:`S \\le 20`, one weight) get NaN and keep their raw weights (see the module docstring).

    :param torch.Tensor log_weights: ``(S, n)``.
    :param bool fit: fit the tails; when False, only equal weights are
        detected (:math:`-\\infty`) and every other column is NaN.
    :returns: ``(khat (n,), smoothed log-weights (S, n))`` as tensors.

    Example::

        >>> khat, smoothed = psis_khat(torch.randn(1000, 3))
    """
    lw = log_weights.detach()
    S, n = lw.shape
    top = lw.amax(0)
    finite_top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    rel = (lw - finite_top).double()  # the weights' exceedances are exponentiated
    # ties to a few ulps: identical latent values can round differently in different SIMD lanes
    tol = 16 * torch.finfo(lw.dtype).eps * finite_top.abs().clamp_min(1.0).double()
    # one weight is not evidence of equal weights (an exact proposal): its column is
    # undefined and judged by its one effective sample
    flat = (rel.amin(0) > -tol) & (S > 1)
    m = min(S, _tail_size(S) + 1)
    tail = rel.topk(m, 0).values  # (m, n), descending
    distinct = 1 + ((tail[:-1] - tail[1:]) > tol).sum(0)
    defined = ~flat & (distinct >= max(6, (m + 1) // 2)) & fit
    khat = torch.full((n,), math.nan, dtype=torch.float64, device=rel.device)
    smoothed = rel.clone()
    cols = defined.nonzero().flatten()
    if len(cols):
        k, sm = _pareto_smoothed(rel[:, cols], _tail_size(S))
        smoothed[:, cols] = sm
        khat[cols] = k
    khat = khat.to(dtype=lw.dtype)
    khat = torch.where(flat, torch.full_like(khat, -math.inf), khat)
    return khat, (smoothed + finite_top.double()).to(lw)


def poor_weights(khat, ess, khat_threshold=0.7, min_ess=10.0):
    """Which estimates have unreliable weights: :math:`\\hat k` above the threshold, or,
    where :math:`\\hat k` is undefined (NaN) or not computed (None), ESS below ``min_ess``.

    :returns: a bool tensor of ``ess``'s shape.
    """
    undefined = torch.ones_like(ess, dtype=torch.bool) if khat is None else torch.isnan(khat)
    few = undefined & (ess < min_ess)
    if khat is None:
        return few
    return few | (khat > khat_threshold)


def warn_poor_weights(who, what, khat, ess, advice, khat_threshold=0.7, min_ess=10.0):
    """Issue one :class:`ImportanceSamplingWarning` when some weights are poor (see :func:`poor_weights`).

    :param str who: the estimator, named first in the message.
    :param str what: what the estimates are, e.g. ``"datapoint(s)"``.
    :param khat: :math:`\\hat k` per estimate, or None.
    :param torch.Tensor ess: ESS per estimate.
    :param str advice: what to do, the message's last sentence.
    :returns: the bool tensor of poor estimates.
    """
    bad = poor_weights(khat, ess, khat_threshold, min_ess)
    if bool(bad.any()):
        heavy = torch.zeros_like(bad) if khat is None else khat > khat_threshold
        few = bad & ~heavy
        kmax = "n/a" if not bool(heavy.any()) else f"{float(khat[heavy].max()):.2f}"
        emin = "n/a" if not bool(few.any()) else f"{float(ess[few].min()):.1f}"
        warnings.warn(
            ImportanceSamplingWarning(
                f"{who}: the importance weights of {int(bad.sum())} of {bad.numel()} {what} "
                f"are unreliable ({int(heavy.sum())} with Pareto k-hat > {khat_threshold}, max "
                f"{kmax}; {int(few.sum())} with k-hat undefined and fewer than {min_ess} "
                f"effective samples, min {emin}), so their estimates and standard errors "
                f"cannot be trusted. {advice}",
                khat=khat,
                ess=ess,
            ),
            stacklevel=user_stacklevel(),
        )
    return bad
