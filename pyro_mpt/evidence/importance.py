r"""``Evidence(method="importance")``: importance-sampled :math:`\log p(x_i)` with PSIS diagnostics.

For a model with latents local to each datapoint and a proposal
:math:`r(z \mid x_i)` (the guide, or the prior when there is none),

.. math::

    \log p(x_i) \approx \log \frac1S \sum_{s=1}^S w_{is}, \qquad
    \log w_{is} = \log p(x_i, z_{is}) - \log r(z_{is} \mid x_i),
    \quad z_{is} \sim r(\cdot \mid x_i),

an estimate whose exponential is unbiased for :math:`p(x_i)` (so its log is
biased low by about half its relative variance) and which is exact for any
:math:`S` when the proposal is the exact posterior. The draws are vectorized
in a particle plate (``"_mpt_particles"`` at dim
``-(max_plate_nesting + 1)``) and chunked over samples (``chunk_size``) to bound
memory, with gradients too: the chunks after the first are recomputed in the
backward pass rather than kept for it. Every log-density is read per datapoint
*without* the minibatch scale; the scale :math:`s_i` (``N / B`` of a subsampled plate, times any
``poutine.scale``) multiplies the per-datapoint log-mean-exp afterwards,
:math:`\sum_i s_i \log \hat p(x_i)` -- Pyro 1.9's ``RenyiELBO`` applies it
inside the log-sum-exp, which is wrong whenever :math:`s_i \ne 1`.

Diagnostics per datapoint (:class:`~pyro_mpt.evidence.EvidenceResult`):

* ``stderr`` -- the delta-method standard error
  :math:`\sqrt{(S\sum_s\omega_s^2 - 1)/(S-1)}` with
  :math:`\omega_s = w_s/\sum_t w_t` (relative standard deviation of the mean
  weight, which is the standard error of its log);
* ``ess`` -- :math:`1/\sum_s \omega_s^2`;
* ``khat`` -- the Pareto shape :math:`\hat k` of the largest weights, from
  PSIS as ``arviz.psislw`` fits it (Vehtari et al. 2024; written in torch). :math:`\hat k > 0.7` means the weights'
  variance is effectively infinite: the estimate and its standard error are
  unreliable. :math:`\hat k` is NaN (undefined) where the largest weights are
  tied -- a discrete latent drawn from its prior -- or :math:`S \le 20`; those
  datapoints are judged by their ESS instead (see
  :mod:`~pyro_mpt.importance_weights`). One
  :class:`~pyro_mpt.importance_weights.ImportanceSamplingWarning` per call
  names the datapoints whose weights are poor.
* ``psis_log_evidence`` -- the estimate from Pareto-smoothed weights.

The proposal must have a density over the model's latents: a point mass (an
``AutoDelta`` MAP guide, a ``dist.Delta`` site) is refused, since its weights
:math:`p(x_i, z_0)/q(z_0)` estimate the joint at one point, not the evidence
(see :func:`~pyro_mpt.guide_checks.check_proposal_density`).
"""

import math

import torch

from ..conditionals.base import EngineNotApplicable
from ..conditionals.data_args import refuse_missing, whole_datapoints_missing
from ..conditionals.latent_runs import LatentRunner, logmeanexp
from ..guide_checks import check_proposal_density, warn_not_reparameterized
from ..conditionals.guide_proposals import AutoguideProposal, is_autoguide
from ..importance_weights import effective_sample_size, psis_khat, warn_poor_weights
from ..recompute import recomputed
from .result import EvidenceResult
from ..counts import is_count

__all__ = ["importance_log_weights", "importance_evidence", "IMPORTANCE_OPTIONS"]

#: the options of ``Evidence(method="importance")``
IMPORTANCE_OPTIONS = frozenset(
    {"num_samples", "chunk_size", "max_elements", "proposal", "khat_threshold", "min_ess", "psis"}
)


def importance_log_weights(
    tokens, model, guide, args, kwargs, num_samples, chunk_size=None, max_elements=2**24, who="importance sampling",
    instead=None, density_instead="a guide with a density over the latents (e.g. AutoNormal)", recompute=False,
):
    r"""Log-weights :math:`\log p(x_i, z_s) - \log r(z_s \mid x_i)`, ``(S, n)``.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable model: the Pyro model.
    :param callable guide: the proposal (a guide), or None for the prior.
    :param int num_samples: ``S``.
    :param int chunk_size: draws per vectorized run; default
        ``max(1, max_elements // (n * D))``.
    :param str who: the caller, named in error messages.
    :param str instead: what to use instead when a guide meets missing tokens,
        named in the message.
    :param str density_instead: what to use instead of a point-mass guide.
    :param bool recompute: with gradients on, run every chunk after the first under
        activation checkpointing (recomputed in the backward pass from the same random
        state, so from the same draws): the graph kept for the backward pass is one
        chunk's, not ``num_samples``' worth, and a call that is never differentiated
        pays nothing for it.
    :raises ValueError: when a latent is shared by several datapoints, when
        a guide would read missing tokens, or when the guide is a point mass.
    """
    if guide is not None:
        if not is_autoguide(guide):
            # an autoguide does not read the data: missing tokens are no obstacle (the loss's
            # importance engine took the same guide that Evidence refused for it)
            refuse_missing(tokens, who, ValueError, instead)
        check_proposal_density(tokens, who, density_instead)
    try:
        runner = LatentRunner(tokens, model, guide, args, kwargs, None, who)
    except EngineNotApplicable as e:
        raise ValueError(str(e)) from e
    # an autoguide's density comes from its parameters (per-datapoint marginals of a joint one)
    source = AutoguideProposal(guide, runner, who) if is_autoguide(guide) else runner
    n, D = tokens.num_data, tokens.num_tokens
    if chunk_size is None:
        chunk_size = max(1, int(max_elements) // max(1, n * D))
    parts = []
    for start in range(0, num_samples, chunk_size):
        rows = min(chunk_size, num_samples - start)
        if recompute and start > 0 and torch.is_grad_enabled():
            # the first chunk settles how the model runs (vectorized or one value at a
            # time, RunMemory), so a recomputation repeats the same runs
            parts.append(recomputed(source.log_weights, rows))
        else:
            parts.append(source.log_weights(rows))
    lw = torch.cat(parts, 0)
    if guide is not None and tokens.observed is not None:
        # padding rows masked out whole (whole_datapoints_missing): log p of no observation is 0,
        # as the prior proposal gives it, whatever the guide proposed from their placeholders
        lw = torch.where(tokens.present, lw, torch.zeros((), dtype=lw.dtype, device=lw.device))
    return lw


def importance_evidence(evidence, tokens, args, kwargs):
    r"""``Evidence(method="importance")``: importance-sampled :math:`\log p(x_i)`.

    Options (``Evidence(..., **options)``):

    * ``num_samples`` -- draws per datapoint (default 1000);
    * ``chunk_size`` -- draws per vectorized run (default from ``max_elements``);
    * ``max_elements`` -- bound on ``chunk_size * n * D`` (default ``2**24``);
    * ``proposal`` -- ``"auto"`` (the guide, or the prior without one or when
      tokens are missing within a datapoint), ``"guide"`` or ``"prior"``;
    * ``khat_threshold`` -- warn when some :math:`\hat k` exceeds it (default 0.7);
    * ``min_ess`` -- where :math:`\hat k` is undefined (tied weights of a
      discrete latent, :math:`S \le 20`) or not computed, warn when the ESS is
      below it (default 10);
    * ``psis`` -- compute :math:`\hat k` and the smoothed estimate (default True;
      needs ``num_samples >= 10``).

    :returns: :class:`~pyro_mpt.evidence.EvidenceResult` whose ``stderr`` is the
        delta-method standard error and whose diagnostics hold ``khat``,
        ``ess``, ``psis_log_evidence`` and ``scale`` (each with the observed
        site's batch shape), ``num_samples`` and ``proposal``. The full-data
        estimate from a minibatch is ``(scale * log_evidence).sum()``.

    Example::

        >>> res = Evidence(vae.model, vae.guide, method="importance", num_samples=500).estimate(x)
        >>> res.log_evidence.mean(), res.stderr.pow(2).mean().sqrt(), res.diagnostics["khat"].max()
    """
    options = dict(evidence.options)
    num_samples = options.pop("num_samples", 1000)
    chunk_size = options.pop("chunk_size", None)
    max_elements = options.pop("max_elements", 2**24)
    proposal = options.pop("proposal", "auto")
    threshold = options.pop("khat_threshold", 0.7)
    min_ess = options.pop("min_ess", 10.0)
    psis = options.pop("psis", True)  # any other option was refused by Evidence (IMPORTANCE_OPTIONS)
    if not is_count(num_samples):
        raise ValueError(f"Evidence(method='importance', num_samples={num_samples!r}): give a positive integer.")
    num_samples = int(num_samples)  # numpy integers too (a grid of settings)
    # chunk_size=0 ended in "range() arg 3 must not be zero", a negative one in torch.cat's error
    if chunk_size is not None and not is_count(chunk_size):
        raise ValueError(
            f"Evidence(method='importance', chunk_size={chunk_size!r}): give a positive integer (draws per "
            f"vectorized run), or None to size the runs by max_elements."
        )
    if proposal not in ("auto", "guide", "prior"):
        raise ValueError(f"Evidence(method='importance', proposal={proposal!r}): use 'auto', 'guide' or 'prior'.")
    if proposal == "guide" and evidence.guide is None:
        raise ValueError("Evidence(method='importance', proposal='guide') needs a guide; pass one, or use proposal='prior'.")
    # with missing tokens "auto" uses the prior, which leaves them out exactly; the guide
    # where they are whole datapoints (padding rows), which it never conditions on
    auto_prior = proposal == "auto" and tokens.observed is not None and not whole_datapoints_missing(tokens)
    guide = None if proposal == "prior" or auto_prior else evidence.guide
    if guide is not None:
        warn_not_reparameterized(tokens, "Evidence(method='importance')", evidence.warned_sites)
    lw = importance_log_weights(
        tokens, evidence.model, guide, args, kwargs, num_samples, chunk_size, max_elements,
        who="Evidence(method='importance')",
        instead="method='exact', 'quadrature' or proposal='prior' (each leaves missing tokens out exactly)",
        density_instead="a guide with a density over the latents (e.g. AutoNormal, or dist.Normal in "
        "place of dist.Delta), proposal='prior', or method='exact' / 'quadrature'",
        recompute=True,
    )
    S = num_samples
    value = logmeanexp(lw, 0)
    with torch.no_grad():
        omega = torch.softmax(lw.detach(), 0)
        sum_w2 = omega.pow(2).sum(0)
        ess = effective_sample_size(lw)
        if S > 1:
            stderr = ((S * sum_w2 - 1.0) / (S - 1)).clamp_min(0).sqrt()
        else:
            stderr = torch.full_like(value.detach(), math.nan)
        khat = psis_value = None
        fit = psis and S >= 10
        check, smoothed = psis_khat(lw, fit)
        if fit:
            khat, psis_value = check, logmeanexp(smoothed, 0)
        warn_poor_weights(
            "Evidence(method='importance')", "datapoint(s)", check, ess,
            "Use a guide closer to the posterior as the proposal, or (much) more samples.",
            threshold, min_ess,
        )
    unflat = tokens.unflatten
    diagnostics = {
        "khat": None if khat is None else unflat(khat),
        "ess": unflat(ess),
        "psis_log_evidence": None if psis_value is None else unflat(psis_value),
        "scale": unflat(tokens.scale.detach()),
        "num_samples": S,
        "proposal": "prior" if guide is None else "guide",
    }
    return EvidenceResult(value, stderr, diagnostics)
