r"""``Evidence(method="exact")``: :math:`\log p(x_i)` in closed form or by exact summation.

* models with a Gaussian marginal: :math:`\log\mathcal N(x_i; \mu, \Sigma)`
  (see :func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal`);
* linear-Gaussian hierarchies, global latents and local ones in a token plate
  (see :mod:`~pyro_mpt.conditionals.hierarchical`);
* models whose latents are all discrete: the sum over the joint support (see
  :mod:`~pyro_mpt.conditionals.enumerate`);
* an observed ``DiscreteHMM``: the forward algorithm (see
  :mod:`~pyro_mpt.conditionals.hmm`); an observed ``GaussianHMM`` of at least
  :data:`~pyro_mpt.conditionals.gaussian_hmm.AUTO_MIN_TOKENS` tokens: the Kalman
  filter (see :mod:`~pyro_mpt.conditionals.gaussian_hmm`; shorter ones, and any
  with ``path=`` given, through their dense covariance);
* models without latents (a Poisson or Bernoulli GLM): the log-likelihood itself.

With missing tokens each value is the density of the datapoint's observed
sub-vector.
"""

import torch

from ..conditionals import (
    option_names,
    AUTO_MIN_TOKENS,
    DiscreteHMMConditionals,
    EnumerateConditionals,
    GaussianHMMConditionals,
    GaussianConditionals,
    HierarchicalGaussianConditionals,
    QuadratureConditionals,
)
from ..conditionals.base import EngineNotApplicable, fits_form, model_failed
from .engine_advice import in_evidence_terms
from .result import EvidenceResult

__all__ = ["exact_evidence", "EXACT_OPTIONS"]

#: the options of ``Evidence(method="exact")``: those of
#: :class:`~pyro_mpt.conditionals.GaussianConditionals`, its ``method`` spelled ``path``, and
#: the enumeration route's ``max_support``
EXACT_OPTIONS = (option_names(GaussianConditionals) - {"method"}) | {"path", "max_support"}


def exact_evidence(evidence, tokens, args, kwargs):
    r"""``Evidence(method="exact")``: exact :math:`\log p(x_i)`, ``stderr`` zero.

    Options (``Evidence(..., **options)``): ``path`` -- ``"auto"``,
    ``"lowrank"`` or ``"dense"``, the ``method`` of
    :class:`~pyro_mpt.conditionals.GaussianConditionals` (``Evidence``'s own
    ``method`` names the estimator) --, ``jitter``, ``max_jitter``, ``vectorize``; and
    ``max_support``, the joint values of discrete latents that the enumeration route sums
    (:class:`~pyro_mpt.conditionals.EnumerateConditionals`, default 4096).

    :param ~pyro_mpt.evidence.Evidence evidence: the estimator (model, guide, options).
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :returns: :class:`~pyro_mpt.evidence.EvidenceResult` with values of
        shape ``(n,)`` and ``diagnostics["engine"]``, the
        :class:`~pyro_mpt.conditionals.ConditionalEngine` that computed them.
    :raises EngineNotApplicable: when the model has no Gaussian marginal, has
        a continuous latent outside a Gaussian marginal and no ``DiscreteHMM``.

    Example::

        >>> Evidence(ppca, method="exact", path="dense").estimate(x).log_evidence   # (N,)
    """
    options = dict(evidence.options)
    # the enumeration route's option, which its refusal of a larger support names
    enumerate_options = {k: options.pop(k) for k in ("max_support",) if k in options}
    # kept in Evidence.engines, as the loss keeps its engine: later calls start
    # from the way of running the model that worked (a model that does not
    # broadcast is not run in the failing modes again; one whose location
    # varies by datapoint is run at three points, not K + 4)
    key = ("exact", repr(sorted(options.items())))
    if key not in evidence.engines:
        evidence.engines[key] = GaussianConditionals(options.pop("path", "auto"), **options)
    engine = evidence.engines[key]
    kalman = None if "path" in evidence.options else _long_gaussian_hmm(evidence, tokens, args, kwargs)
    try:
        engine, state = kalman or (engine, engine.prepare(tokens, evidence.model, evidence.guide, args, kwargs))
    except EngineNotApplicable as e:
        # a linear-Gaussian hierarchy (local latents in a token plate), or exact sums
        # over discrete latents (a finite mixture, or an HMM's chain)
        declined, failed = [], []
        routes = [("hierarchical", HierarchicalGaussianConditionals()),
                  ("enumerate", EnumerateConditionals(**enumerate_options)), ("hmm", DiscreteHMMConditionals())]
        if not tokens.latent_names:
            # nothing to integrate: the one-node "grid" of no latent dims is the likelihood itself
            routes.append(("no latent", QuadratureConditionals()))
        for label, other in routes:
            try:
                engine, state = other, other.prepare(tokens, evidence.model, evidence.guide, args, kwargs)
                break
            except EngineNotApplicable as why:
                declined.append(f"{label!r}: {why}")
                if model_failed(why):
                    failed.append(f"the {label!r} route, made for this form, ran the model and it failed: {why}")
                elif fits_form(why):
                    failed.append(f"the {label!r} route, made for this form, needs the model written otherwise: {why}")
        else:
            # every route's reason: the one that nearly applies is often not the Gaussian one; a
            # route under which the model itself failed first (it opened with the Gaussian route's
            # advice to use the engine that had just failed, its reason deep in the paragraph)
            raise type(e)(in_evidence_terms(
                "".join(f"Evidence(method='exact'): {f} " for f in failed)
                + f"Evidence(method='exact') needs a model with a Gaussian marginal (also a "
                f"linear-Gaussian hierarchy), discrete latents (a finite mixture, also of "
                f"linear-Gaussian components), or a DiscreteHMM observation. {e} The other exact "
                f"routes declined -- " + " ".join(declined)
            )) from e
    if isinstance(engine, QuadratureConditionals):  # its table already leaves missing tokens out
        value = engine.log_evidence(state, tokens.value)
    else:
        value = engine.log_evidence(state, tokens.value, tokens.observed)
    return EvidenceResult(value, torch.zeros_like(value.detach()), {"engine": engine})


def _long_gaussian_hmm(evidence, tokens, args, kwargs):
    """``(engine, state)`` of the Kalman engine for an observed ``GaussianHMM`` of at least
    :data:`~pyro_mpt.conditionals.gaussian_hmm.AUTO_MIN_TOKENS` tokens (its filter is linear
    in the steps, the dense covariance cubic); None for other models."""
    kalman = GaussianHMMConditionals(min_tokens=AUTO_MIN_TOKENS)
    try:
        return kalman, kalman.prepare(tokens, evidence.model, evidence.guide, args, kwargs)
    except EngineNotApplicable:
        return None
