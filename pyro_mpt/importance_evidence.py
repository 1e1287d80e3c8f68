r"""Importance-sampled evidence :math:`\log p(x_i)` with PSIS diagnostics, and a correct IWAE loss.

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
memory. Every log-density is read per datapoint *without* the minibatch scale;
the scale :math:`s_i` (``N / B`` of a subsampled plate, times any
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
  ``arviz.psislw`` (Vehtari et al. 2024). :math:`\hat k > 0.7` means the weights'
  variance is effectively infinite: the estimate and its standard error are
  unreliable. :math:`\hat k` is NaN (undefined) where the largest weights are
  tied -- a discrete latent drawn from its prior -- or :math:`S < 25`; those
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
from pyro.infer.elbo import ELBO
from pyro.infer.util import torch_item
from pyro.util import warn_if_nan

from .conditionals.base import EngineNotApplicable
from .conditionals.latent_runs import LatentRunner, logmeanexp, refuse_missing
from .guide_checks import check_guide_sites, check_proposal_density
from .importance_weights import effective_sample_size, psis_khat, warn_poor_weights
from .sites import trace_tokens

__all__ = [
    "importance_log_weights",
    "importance_evidence",
    "ImportanceWeightedELBO",
]


def importance_log_weights(
    tokens, model, guide, args, kwargs, num_samples, chunk_size=None, max_elements=2**24, who="importance sampling",
    instead=None, density_instead="a guide with a density over the latents (e.g. AutoNormal)",
):
    r"""Log-weights :math:`\log p(x_i, z_s) - \log r(z_s \mid x_i)`, ``(S, n)``.

    :param ~pyro_mpt.sites.ObservedTokens tokens: the traced tokens.
    :param callable model: the Pyro model.
    :param callable guide: the proposal (a guide), or None for the prior.
    :param int num_samples: ``S``.
    :param int chunk_size: draws per vectorized run; default
        ``max(1, max_elements // (n * D))``.
    :param str who: the caller, named in error messages.
    :param str instead: what to use instead when a guide meets missing tokens,
        named in the message.
    :param str density_instead: what to use instead of a point-mass guide.
    :raises ValueError: when a latent is shared by several datapoints, when
        a guide would read missing tokens, or when the guide is a point mass.
    """
    if guide is not None:
        refuse_missing(tokens, who, ValueError, instead)
        check_proposal_density(tokens, who, density_instead)
    try:
        runner = LatentRunner(tokens, model, guide, args, kwargs, None, who)
    except EngineNotApplicable as e:
        raise ValueError(str(e)) from e
    n, D = tokens.num_data, tokens.num_tokens
    if chunk_size is None:
        chunk_size = max(1, int(max_elements) // max(1, n * D))
    parts = []
    for start in range(0, num_samples, chunk_size):
        parts.append(runner.log_weights(min(chunk_size, num_samples - start)))
    return torch.cat(parts, 0)


def importance_evidence(evidence, tokens, args, kwargs):
    r"""``Evidence(method="importance")``: importance-sampled :math:`\log p(x_i)`.

    Options (``Evidence(..., **options)``):

    * ``num_samples`` -- draws per datapoint (default 1000);
    * ``chunk_size`` -- draws per vectorized run (default from ``max_elements``);
    * ``max_elements`` -- bound on ``chunk_size * n * D`` (default ``2**24``);
    * ``proposal`` -- ``"auto"`` (the guide, or the prior without one or when
      tokens are missing), ``"guide"`` or ``"prior"``;
    * ``khat_threshold`` -- warn when some :math:`\hat k` exceeds it (default 0.7);
    * ``min_ess`` -- where :math:`\hat k` is undefined (tied weights of a
      discrete latent, :math:`S < 25`) or not computed, warn when the ESS is
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
    from .evidence import EvidenceResult

    options = dict(evidence.options)
    num_samples = options.pop("num_samples", 1000)
    chunk_size = options.pop("chunk_size", None)
    max_elements = options.pop("max_elements", 2**24)
    proposal = options.pop("proposal", "auto")
    threshold = options.pop("khat_threshold", 0.7)
    min_ess = options.pop("min_ess", 10.0)
    psis = options.pop("psis", True)
    if options:
        raise ValueError(
            f"Evidence(method='importance') got unknown option(s) {', '.join(map(repr, options))}; "
            f"use num_samples, chunk_size, max_elements, proposal, khat_threshold, min_ess, psis."
        )
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"Evidence(method='importance', num_samples={num_samples!r}): give a positive integer.")
    if proposal not in ("auto", "guide", "prior"):
        raise ValueError(f"Evidence(method='importance', proposal={proposal!r}): use 'auto', 'guide' or 'prior'.")
    if proposal == "guide" and evidence.guide is None:
        raise ValueError("Evidence(method='importance', proposal='guide') needs a guide; pass one, or use proposal='prior'.")
    # with missing tokens "auto" uses the prior, which leaves them out exactly
    auto_prior = proposal == "auto" and tokens.observed is not None
    guide = None if proposal == "prior" or auto_prior else evidence.guide
    lw = importance_log_weights(
        tokens, evidence.model, guide, args, kwargs, num_samples, chunk_size, max_elements,
        who="Evidence(method='importance')",
        instead="method='exact', 'quadrature' or proposal='prior' (each leaves missing tokens out exactly)",
        density_instead="a guide with a density over the latents (e.g. AutoNormal, or dist.Normal in "
        "place of dist.Delta), proposal='prior', or method='exact' / 'quadrature'",
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
            threshold, min_ess, stacklevel=4,
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


class ImportanceWeightedELBO(ELBO):
    r"""The importance-weighted bound (IWAE) with the minibatch scale outside the log-mean-exp.

    .. math::

        \mathcal L = -\sum_i s_i \log \frac1K \sum_{k=1}^K
            \frac{p(x_i, z_{ik})}{q(z_{ik} \mid x_i)},

    with :math:`s_i` the datapoint's plate scale (``N / B`` for a subsampled
    plate). Pyro 1.9's ``RenyiELBO(alpha=0)`` computes the same bound for
    :math:`s_i = 1` but puts :math:`s_i` inside the log-sum-exp; this class is
    correct under subsampling and offers ``differentiable_loss``. The guide's
    sites must be reparameterizable (``has_rsample``) for unbiased gradients.
    Latents must be local to each datapoint.

    :param int num_particles: :math:`K`.
    :param str obs_site: the observed site (when the model observes several).
    :param tuple token_plates: the observed site's plates over tokens (see
        :class:`~pyro_mpt.MaskedPretrainingLoss`); None detects them.
    :param int max_plate_nesting: plate dims of the model (guessed when inf).
    :param int chunk_size: particles per vectorized run (default: all).

    Example::

        >>> svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-3}), ImportanceWeightedELBO(num_particles=8))
    """

    def __init__(
        self, num_particles=8, *, obs_site=None, token_plates=None, max_plate_nesting=float("inf"), chunk_size=None
    ):
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting)
        self.obs_site = obs_site
        self.token_plates = token_plates
        self.chunk_size = chunk_size

    def _tokens(self, model, guide, args, kwargs):
        mpn = None if self.max_plate_nesting == float("inf") else self.max_plate_nesting
        tokens = trace_tokens(model, guide, args, kwargs, self.obs_site, mpn, self.token_plates)
        check_guide_sites(tokens)
        return tokens

    def _get_trace(self, model, guide, args, kwargs):
        tokens = self._tokens(model, guide, args, kwargs)
        return tokens.model_trace, tokens.guide_trace

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """:math:`-\\sum_i s_i \\log\\hat p_K(x_i)`, a differentiable scalar."""
        tokens = self._tokens(model, guide, args, kwargs)
        K = self.num_particles
        lw = importance_log_weights(
            tokens, model, guide, args, kwargs, K, self.chunk_size or K, who="ImportanceWeightedELBO",
            instead="MaskedPretrainingLoss, which leaves missing tokens out exactly",
            density_instead="a guide with a density over the latents (e.g. AutoNormal); for MAP "
            "estimation with AutoDelta use Trace_ELBO",
        )
        loss = -(tokens.scale * logmeanexp(lw, 0)).sum()
        warn_if_nan(loss, "loss")
        return loss

    def loss(self, model, guide, *args, **kwargs):
        """The loss as a float, without gradients."""
        with torch.no_grad():
            return torch_item(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """The loss as a float; also back-propagates it into the parameters."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        return torch_item(loss)
