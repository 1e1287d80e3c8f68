r"""Evidence estimators: per-datapoint :math:`\log p(x_i)` to compare MPT against.

One module per method, each a function
``(evidence, tokens, args, kwargs) -> EvidenceResult`` registered in
:data:`METHODS`; the
result type lives in the leaf module :mod:`~pyro_mpt.evidence.result`. Imports
run one way: this package builds on :mod:`pyro_mpt.conditionals`, never the
reverse.

``Evidence(model, guide, method=...)`` is called with the model's arguments and
returns one log-evidence per datapoint, with the observed site's batch shape:

* ``"exact"`` -- the closed form :math:`\log\mathcal N(x_i; \mu, \Sigma)` for
  models with a Gaussian marginal (see
  :func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal`); the sum
  over the joint support for models whose latents are all discrete (see
  :mod:`~pyro_mpt.conditionals.enumerate`); the forward algorithm for an
  observed ``DiscreteHMM`` (see :mod:`~pyro_mpt.conditionals.hmm`) --
  :func:`~pyro_mpt.evidence.exact.exact_evidence`.
* ``"quadrature"`` -- tensor-grid (optionally adaptive) Gauss–Hermite
  integration over low-dimensional latents of any factorized-likelihood model,
  with an error estimate from a second, coarser rule (see
  :func:`~pyro_mpt.evidence.quadrature.quadrature_evidence`).
* ``"importance"`` -- importance sampling with the guide (or the prior) as
  proposal, for any model with latents local to each datapoint, with standard
  errors and PSIS :math:`\hat k` diagnostics (see
  :func:`~pyro_mpt.evidence.importance.importance_evidence`).

:meth:`Evidence.estimate` returns the full result (standard errors,
diagnostics) and calling the object returns the values.
"""

import torch
import pyro.distributions as dist

from ..arg_checks import Revalidate, args_valid, checkable, quiet_or_validated
from ..conditionals import unknown_options_message
from ..guide_checks import check_guide_sites
from ..hidden_randomness import check_no_hidden_randomness
from ..model_keys import PassedChecks, callable_key
from ..observed_tokens import LATENT_MEANS, trace_tokens
from ..point_latents import trace_with_point_globals
from .exact import EXACT_OPTIONS, exact_evidence
from .importance import IMPORTANCE_OPTIONS, importance_evidence
from .quadrature import QUADRATURE_OPTIONS, quadrature_evidence
from .result import EvidenceResult

__all__ = ["Evidence", "EvidenceResult", "METHODS", "METHOD_OPTIONS"]

#: evidence methods by name, each ``(evidence, tokens, args, kwargs) -> EvidenceResult``
METHODS = {"exact": exact_evidence, "quadrature": quadrature_evidence, "importance": importance_evidence}

#: the options each method takes, checked when an ``Evidence`` is built (a method added to
#: :data:`METHODS` without an entry here checks its own)
METHOD_OPTIONS = {"exact": EXACT_OPTIONS, "quadrature": QUADRATURE_OPTIONS, "importance": IMPORTANCE_OPTIONS}

#: the models whose last validated call (of any ``Evidence`` of the same model, guide, method
#: and observed site) found that their trace may be made without Pyro's validation
#: (``"quiet"``) and with the latents at their prior means (``"mean"``; see
#: :meth:`Evidence.estimate`): kept across estimators, since ``Evidence(model)(x)`` is
#: often built afresh at every call (a monitoring line in a training loop), which paid a
#: validated trace with drawn latents each time (PPCA D = 512, K = 50: 2.3 ms float32,
#: 6 ms float64 of a 24 / 44 ms call, one thread). The routes are hints: a trace they
#: do not serve is made again with validation (:class:`~pyro_mpt.arg_checks.Revalidate`).
_ROUTES = PassedChecks(keep=8)


class Evidence:
    r"""Per-datapoint log-marginal likelihood :math:`\log p(x_i)` of a Pyro model.

    :param callable model: a Pyro model with one observed site (or ``obs_site``).
    :param callable guide: a guide (proposal for sampling methods), or None.
    :param str method: ``"exact"``, ``"quadrature"`` (see
        :func:`~pyro_mpt.evidence.quadrature.quadrature_evidence`) or ``"importance"``
        (see :func:`~pyro_mpt.evidence.importance.importance_evidence`).
    :param str obs_site: the observed site holding the tokens.
    :param str extra_sites: every method returns :math:`\log p(x_i)` of the
        token site alone, leaving out other observed sites (integrated out:
        :math:`\log p(x_i)`, not :math:`\log p(x_i \mid y_i)`) and ``pyro.factor``
        sites (dropped: a different model). ``"error"`` (default) refuses such a
        model, naming the sites; ``"drop"`` accepts that computation.
    :param tuple token_plates: the observed site's plates over tokens (see
        :class:`~pyro_mpt.MaskedPretrainingLoss`); None detects them.
    :param int max_plate_nesting: plate dims of the model; guessed when None.
    :param options: method options (for ``"exact"``: ``path`` -- ``"auto"``,
        ``"lowrank"`` or ``"dense"``, the ``method`` of
        :class:`~pyro_mpt.conditionals.GaussianConditionals` --, ``jitter``,
        ``max_jitter``, ``vectorize``; ``max_support``, the joint values of discrete latents
        summed exactly, default 4096).
    :ivar dict engines: the conditional engines a method built, by method and
        option set. Later calls reuse them, so adaptive quadrature warm-starts
        its search from the previous call's centres (the same value to the
        Newton tolerance); ``engines.clear()`` forgets them.

    The values are :math:`\log p(x_i)` of the model without any scale: a
    ``poutine.scale`` (on any site) and a subsampled plate's ``N / B`` weight
    a loss's terms, not the density, and are left to the caller (the
    importance result carries the observed site's scale as ``diagnostics["scale"]``).

    Example::

        >>> Evidence(ppca, method="exact")(x)          # shape (N,)
        >>> Evidence(ppca, method="exact")(x).sum()    # log p(x_1..N), differentiable
    """

    def __init__(
        self,
        model,
        guide=None,
        method="exact",
        *,
        obs_site=None,
        extra_sites="error",
        token_plates=None,
        max_plate_nesting=None,
        **options,
    ):
        if method not in METHODS:
            names = ", ".join(repr(k) for k in METHODS)
            raise ValueError(f"Unknown evidence method={method!r}; use one of {names}.")
        accepted = METHOD_OPTIONS.get(method)
        unknown = sorted(set(options) - accepted) if accepted is not None else []
        if unknown:
            # Evidence(model, num_samples=500) without method="importance" ended in a TypeError
            # of GaussianConditionals.__init__, an engine the caller never named
            elsewhere = {k: [f"method={m!r}" for m, names in METHOD_OPTIONS.items() if k in names] for k in unknown}
            raise ValueError(unknown_options_message(f"Evidence(method={method!r})", unknown, accepted, elsewhere))
        self.model = model
        self.guide = guide
        self.method = method
        self.obs_site = obs_site
        self.extra_sites = extra_sites
        self.token_plates = token_plates
        self.max_plate_nesting = max_plate_nesting
        self.options = options
        self.engines = {}
        #: guide sites already named by a once-per-estimator warning
        self.warned_sites = set()

    def estimate(self, *args, **kwargs):
        r"""Run the estimator and return the full :class:`EvidenceResult`.

        Global latents at a point mass of the guide (``AutoDelta``, fitted by MAP) are
        held at the guide's values: the values are then :math:`\log p(x_i \mid \hat\theta)`
        (see :mod:`~pyro_mpt.point_latents`).

        After a first call (of this or any ``Evidence`` of the same model, guide, method and
        ``obs_site``: the route is remembered per model across estimators), ``method="exact"`` traces a model whose distributions
        :mod:`~pyro_mpt.arg_checks` checks without Pyro's validation and checks them there
        (a latent mean's ``MultivariateNormal(z, scale_tril=L)`` holds ``L`` expanded to
        ``(N, D, D)``); should anything fail, it traces again with validation, so a bad
        argument raises Pyro's own error. Where the engine that served reads no latent
        draw (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.reads_latent_draws`, the
        Gaussian marginal), that trace puts the latents at their prior means (Pyro's
        ``init_to_mean``) instead of drawing them.
        """
        quiet = self._route("quiet") and dist.is_validation_enabled()

        def validated():
            if quiet:
                self._set_route("quiet", False)  # the validated trace fails as it always did, or serves
            return self._estimate(args, kwargs, validate_model=True)

        init = LATENT_MEANS if self._route("mean") else None
        return quiet_or_validated(
            quiet, lambda: self._estimate(args, kwargs, validate_model=False, latent_init=init), validated
        )

    def _estimate(self, args, kwargs, validate_model, latent_init=None):
        tokens, model, guide, points = trace_with_point_globals(
            lambda model, guide: self._trace(model, guide, args, kwargs, validate_model, latent_init),
            self.model, self.guide,
        )
        if not validate_model and (points or not args_valid(tokens.model_trace)):
            raise Revalidate
        check_guide_sites(tokens)
        if validate_model and self.method != "importance":
            # the integrating methods: a hidden draw would make every call's value another number
            # (importance sampling averages over it like over the latents it draws)
            check_no_hidden_randomness(
                tokens, model, args, kwargs, f"Evidence(method={self.method!r})",
                advice="; or use method='importance', which averages over it", key=self.model,
            )
        result = METHODS[self.method](_Fixed(self, model, guide) if points else self, tokens, args, kwargs)
        engine = result.diagnostics.get("engine")
        if latent_init is not None and (engine is None or engine.reads_latent_draws()):
            raise Revalidate  # another route than the remembered one, which reads the draws
        if validate_model:
            quiet = self.method == "exact" and not points and checkable(tokens.model_trace)
            self._set_route("quiet", quiet)
            self._set_route("mean", quiet and not engine.reads_latent_draws())
        if tokens.observed is not None:
            # a datapoint masked out whole: log p of no observation is 0 (the exact routes gave
            # rounding, -4.8e-7 in float32: log N(0; 0, 1) added and taken off per token)
            present = tokens.present
            zero = torch.zeros((), dtype=result.log_evidence.dtype, device=result.log_evidence.device)
            result.log_evidence = torch.where(present, result.log_evidence, zero)
            result.stderr = torch.where(present, result.stderr, zero)
        result.log_evidence = tokens.unflatten(result.log_evidence)
        result.stderr = tokens.unflatten(result.stderr)
        return result

    def _route_detail(self, kind):
        guide = None if self.guide is None else callable_key(self.guide)
        return (kind, guide, self.method, self.obs_site)

    def _route(self, kind):
        """Whether the route ``kind`` (``"quiet"`` or ``"mean"``, see ``_ROUTES``) served
        this model's last validated call."""
        return _ROUTES.passed(self.model, self._route_detail(kind))

    def _set_route(self, kind, on):
        if on:
            _ROUTES.add(self.model, self._route_detail(kind))
        else:
            _ROUTES.discard(self.model, self._route_detail(kind))

    def _trace(self, model, guide, args, kwargs, validate_model=True, latent_init=None):
        return trace_tokens(
            model, guide, args, kwargs, self.obs_site, self.max_plate_nesting, self.token_plates,
            extra_sites=self.extra_sites, validate_model=validate_model, latent_init=latent_init,
        )

    def __call__(self, *args, **kwargs):
        """Per-datapoint :math:`\\log p(x_i)`, with the observed site's batch shape."""
        return self.estimate(*args, **kwargs).log_evidence


class _Fixed:
    """An :class:`Evidence` seen by its method with the model and guide whose point-mass
    globals are fixed; options and engines are the estimator's own."""

    def __init__(self, evidence, model, guide):
        self._evidence = evidence
        self.model = model
        self.guide = guide

    def __getattr__(self, name):
        return getattr(self._evidence, name)
