r"""Diagnostics of importance weights: effective sample size and PSIS :math:`\hat k`.

Every importance-sampling estimate in pyro_mpt (``Evidence(method="importance")``,
``conditionals="importance"``) reads the reliability of its weights
:math:`w_s`, :math:`s = 1..S`, off two numbers per estimate:

* the effective sample size :math:`\mathrm{ESS} = (\sum_s w_s)^2 / \sum_s w_s^2`;
* the Pareto shape :math:`\hat k` fitted to the largest weights by
  ``arviz.psislw`` (Vehtari et al. 2024). :math:`\hat k > 0.7` means the
  weights' variance is effectively infinite: the estimate and its standard
  error are unreliable.

**When** :math:`\hat k` **is undefined.** The Pareto fit needs a continuous
tail: it uses the :math:`M + 1` largest weights,
:math:`M = \lceil \min(S/5,\, 3\sqrt S)\rceil`. Weights of a *discrete*
latent drawn from its prior take one value per latent value, so the tail is
a few tied values -- ``arviz`` then reports :math:`\hat k = \infty`, a false
alarm: tied weights are bounded, their variance is finite and the delta-method
standard error is valid. :func:`psis_khat` reports :math:`\hat k` as NaN
(undefined) when fewer than half of those :math:`M + 1` weights, or fewer
than 6, are distinct (to a few units in the last place); this also covers
:math:`S < 25`, where the tail has too few draws for a fit. Where
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

import numpy as np
import torch

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
    # arviz.psislw's tail length with reff = 1
    return int(math.ceil(min(S / 5.0, 3 * math.sqrt(S))))


def psis_khat(log_weights, fit=True):
    """Pareto :math:`\\hat k` per column from ``arviz.psislw``, NaN where it is undefined.

    Columns whose weights are all equal get :math:`-\\infty`; columns whose
    tail has too few distinct weights (tied weights of a discrete latent, or
    :math:`S < 25`) get NaN and keep their raw weights (see the module docstring).

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
    rel = (lw - finite_top).double()  # arviz overflows on large log-weights
    # ties to a few ulps: identical latent values can round differently in different SIMD lanes
    tol = 16 * torch.finfo(lw.dtype).eps * finite_top.abs().clamp_min(1.0).double()
    flat = rel.amin(0) > -tol
    m = min(S, _tail_size(S) + 1)
    tail = rel.topk(m, 0).values  # (m, n), descending
    distinct = 1 + ((tail[:-1] - tail[1:]) > tol).sum(0)
    defined = ~flat & (distinct >= max(6, (m + 1) // 2)) & fit
    khat = torch.full((n,), math.nan, dtype=torch.float64, device="cpu")  # arviz's side
    smoothed = rel.clone()
    cols = defined.nonzero().flatten()
    if len(cols):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import arviz as az

            sm, k = az.psislw(rel[:, cols].T.cpu().numpy(), normalize=False)  # samples last
        smoothed[:, cols] = torch.as_tensor(np.asarray(sm), device="cpu").T.to(smoothed)
        khat[cols.cpu()] = torch.as_tensor(np.asarray(k), dtype=torch.float64, device="cpu").reshape(-1)
    khat = khat.to(device=lw.device, dtype=lw.dtype)
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


def warn_poor_weights(who, what, khat, ess, advice, khat_threshold=0.7, min_ess=10.0, stacklevel=3):
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
            stacklevel=stacklevel,
        )
    return bad
