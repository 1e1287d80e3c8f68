r"""``Evidence(method="quadrature")``: :math:`\log p(x_i)` by Gauss–Hermite quadrature, with an error estimate.

Tensor-grid (optionally adaptive) integration over the low-dimensional latents
of any factorized-likelihood model, computed by
:class:`~pyro_mpt.conditionals.quadrature.QuadratureConditionals`; the error
estimate compares the rule with a second, coarser one on the same centres.
"""

import math
import warnings
from numbers import Real

import torch

from ..conditionals.base import EngineNotApplicable, QuadratureAccuracyWarning
from ..conditionals import option_names
from ..conditionals.quadrature import QuadratureConditionals, rule_rounding
from ..conditionals.quadrature_rules import default_num_nodes
from .engine_advice import in_evidence_terms
from .result import EvidenceResult
from ..code_origin import user_stacklevel
from ..counts import is_count

__all__ = ["quadrature_evidence", "WARN_TOL", "QUADRATURE_OPTIONS"]

#: the options of ``Evidence(method="quadrature")``: the engine's and the error estimate's
QUADRATURE_OPTIONS = option_names(QuadratureConditionals) | {"tol", "warn_tol", "error_nodes"}

#: ``Evidence(method="quadrature")`` warns when the error estimate of some
#: datapoint's :math:`\log p(x_i)` exceeds this many nats (option ``warn_tol``)
WARN_TOL = 1e-3


#: the advice where the error is another mode's mass, which more nodes do not reach
OTHER_MODE_ADVICE = (
    "most of it is a second mode of the posterior beyond the adaptive grid, centred on one mode, "
    "so more nodes do not help; use method='importance' with a guide that covers the modes, or "
    "adaptive=False with nodes enough to resolve each mode (num_nodes=...)"
)


def _another_mode(missing, error, worst):
    """Whether another mode's mass is most of the worst datapoint's error estimate."""
    return missing is not None and bool(2 * missing[worst] > error[worst])


def quadrature_evidence(evidence, tokens, args, kwargs):
    r"""``Evidence(method="quadrature")``: :math:`\log p(x_i)` by quadrature, with an error estimate.

    Options (``Evidence(..., **options)``): those of
    :class:`~pyro_mpt.conditionals.quadrature.QuadratureConditionals` (``num_nodes``, ``adaptive``, ...), plus

    * ``error_nodes`` -- nodes per dim of the second, coarser rule whose
      difference gives the error estimate (default ``max(1, 2 m // 3)`` for
      ``m`` nodes per dim; the rule with ``m - 1`` nodes per dim is compared too, or with
      ``m + 1`` where ``m - 1`` is the coarser rule's own or none, ``m <= 3``);
    * ``tol`` -- raise when the estimated error of some datapoint, less the dtype's rounding
      (below), exceeds it, or the rounding alone does;
    * ``warn_tol`` -- without ``tol``, warn (:class:`~pyro_mpt.conditionals.base.QuadratureAccuracyWarning`, naming the
      site, the largest estimate and ``num_nodes``) when the estimated error of
      some datapoint exceeds it (default :data:`WARN_TOL`; None: never).

    The error estimate of the rule's value :math:`\hat\ell_m` is

    .. math::

        \hat\epsilon = \max\big(|\hat\ell_m - \hat\ell_{m'}|,\;
        |\hat\ell_m - \hat\ell_{m-1}|\big) + 8\varepsilon(|\hat\ell_m| + 1)
        \quad\text{(adaptive)}, \qquad
        \hat\epsilon = \max\big(|\hat\ell_m - \hat\ell_{m'}|,\;
        |\hat\ell_m - \hat\ell^{a}| + |\hat\ell^{a} - \hat\ell^{a'}|\big)
        + 8\varepsilon(|\hat\ell_m| + 1)
        \quad\text{(prior-centred)},

    with :math:`\hat\ell^{a}, \hat\ell^{a'}` the adaptive rule and its
    coarser companion (the default adaptive grid, or as many nodes per dim as
    ``num_nodes`` asks for the prior-centred rule when that is more, so that
    the reference's own error does not bound the estimate from below), and
    :math:`\varepsilon` the dtype's machine epsilon (the rule's own rounding, which
    more nodes cannot lower: ``tol`` and ``warn_tol`` judge the rest, and a ``tol``
    below the rounding alone is refused, saying so).
    Two rules can be off by nearly the same amount by chance, so one
    difference alone can be far below the error (measured: a true error 2.4
    times the :math:`m'` difference); two differences rarely both are. Two
    prior-centred rules that both miss a sharp peak
    are off by similar, unrelated amounts, so their difference alone can be
    smaller than either error; the second term bounds the error by the
    triangle inequality through the adaptive rule, which resolves such peaks.
    It is an estimate, not a bound: it assumes the finer of two rules is the
    more accurate. A warning (the engine's ``ess_warning``) says when some
    posterior sits on too few effective nodes, whatever ``adaptive``.

    :param ~pyro_mpt.evidence.Evidence evidence: the estimator (its options and engines).
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param tuple args: the model's arguments.
    :param dict kwargs: its keyword arguments.
    :returns: :class:`~pyro_mpt.evidence.EvidenceResult` whose ``stderr`` is the
        per-datapoint error estimate :math:`\hat\epsilon` and whose
        diagnostics hold ``num_nodes``, ``error_nodes``, ``coarse`` (the coarser
        estimate), ``previous`` (the rule with ``m - 1`` nodes per dim, or ``m + 1`` where
        that is the coarser rule or there is none; adaptive grids only, else None),
        ``reference`` (the adaptive value, prior-centred grids only,
        else None), ``ess`` and ``axis_ess`` (effective nodes in all and per
        latent axis), each with the observed site's batch shape (``axis_ess``
        with the latent axis last), and ``adaptive``.

    Example::

        >>> result = Evidence(model, method="quadrature", num_nodes=12).estimate(x)
        >>> result.log_evidence, result.stderr   # (n,) each
    """
    options = dict(evidence.options)
    tol = options.pop("tol", None)
    warn_tol = options.pop("warn_tol", WARN_TOL)
    error_nodes = options.pop("error_nodes", None)
    # tol=-1 was read as an accuracy no rule reaches ("8 nodes per latent dim are too few for tol=-1")
    for label, value in (("tol", tol), ("warn_tol", warn_tol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real) or not value > 0 or math.isnan(value)):
            raise ValueError(
                f"Evidence(method='quadrature', {label}={value!r}): give a positive number of nats "
                f"(the largest error estimate of log p(x_i) accepted), or None."
            )
    if error_nodes is not None and not is_count(error_nodes):
        raise ValueError(
            f"Evidence(method='quadrature', error_nodes={error_nodes!r}): give a positive integer "
            f"(nodes per latent dim of the coarser rule), or None for the default."
        )
    options.setdefault("min_ess", 0.0)  # report the effective nodes, never raise
    # one engine per option set, kept in Evidence.engines: repeated calls on
    # the same data (e.g. every few epochs of training) warm-start the adaptive
    # search from the previous centres (the same value to the Newton tolerance)
    def engine_for(opts):
        key = ("quadrature", repr(sorted(opts.items())))
        if key not in evidence.engines:
            evidence.engines[key] = QuadratureConditionals(**opts)
        return evidence.engines[key]

    def evaluate(engine, differentiable):
        try:
            with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
                state = engine.prepare(tokens, evidence.model, evidence.guide, args, kwargs)
                value = engine.log_evidence(state, tokens.value)
        except EngineNotApplicable as e:
            raise type(e)(in_evidence_terms(f"Evidence(method='quadrature') cannot serve this model. {e}")) from e
        return state, value

    def companion(engine, state, nodes):
        # the coarser rule on the same centres (no second search), quiet: its
        # effective nodes are fewer by design
        try:
            other_engine, other = engine.companion(state, nodes)
        except EngineNotApplicable as e:
            raise type(e)(in_evidence_terms(f"Evidence(method='quadrature') cannot serve this model. {e}")) from e
        with torch.no_grad():
            return other_engine.log_evidence(other, tokens.value)

    engine = engine_for(options)
    state, value = evaluate(engine, True)
    K = state.latent_dim
    m = round(state.num_nodes ** (1.0 / K)) if K else 1
    if error_nodes is None:
        error_nodes = max(1, (2 * m) // 3)
    coarse = companion(engine, state, error_nodes)
    error = (value.detach() - coarse).abs()
    between = error
    # a second coarser rule: two rules' errors can cancel by chance (measured: 2.4x
    # the reported error on 1 of 20 datapoints with the 2m/3 rule alone), two pairs
    # rarely do
    previous = None
    # the rule with one node fewer a dim; where that is error_nodes' own rule (m <= 3, m - 1 = 2m/3)
    # or none (m = 1), one more: a single difference stood for the error there (3 nodes: 7e-3
    # nats off a Poisson model, reported as 7e-7, no warning)
    second = m - 1 if m - 1 >= 1 and m - 1 != error_nodes else m + 1
    if engine.adaptive and K > 0 and second != error_nodes:
        previous = companion(engine, state, second)
        error = torch.maximum(error, (value.detach() - previous).abs())
    # the rule's own rounding: its log-sum of Q terms of size |log p(x)|; more nodes cannot
    # lower it, so tol and warn_tol judge the rest
    rounding = rule_rounding(value.detach())
    error = error + rounding
    # another mode beyond the adaptive grid: the coarser rules share the grid's centre and
    # cannot see the mass it leaves out (the engine's Laplace estimate of it)
    missing = state.missing_mass
    if missing is not None:
        error = error + missing.to(error.dtype)
    moved = error  # the rules' differences, before the reference's triangle below
    reference = None
    if not engine.adaptive and K > 0:
        # the reference's own error enters the estimate: at the default adaptive
        # grid (8 nodes a dim at K = 2) it is ~1e-3 on a Normal-InverseGamma
        # model, so a prior grid asked for with more nodes could never report
        # less, and tol= refused it saying to use more nodes. Asked for more
        # nodes than that default, the reference takes as many.
        asked = options.get("num_nodes")
        ref_nodes = asked if asked is not None and asked > default_num_nodes(K, True) else None
        ref_options = dict(options, adaptive=True, num_nodes=ref_nodes, ess_warning=None)
        ref_engine = engine_for(ref_options)
        ref_state, reference = evaluate(ref_engine, False)
        m_ref = round(ref_state.num_nodes ** (1.0 / K))
        ref_error = (reference - companion(ref_engine, ref_state, max(1, (2 * m_ref) // 3))).abs()
        if ref_state.missing_mass is not None:
            ref_error = ref_error + ref_state.missing_mass.to(ref_error.dtype)
        error = torch.maximum(error, (value.detach() - reference).abs() + ref_error)
    if tol is not None and bool((rounding > tol).any()):
        worst = int(rounding.argmax())
        raise ValueError(
            f"Evidence(method='quadrature'): tol={tol} is below the rounding of log p(x) in "
            f"{str(value.dtype).replace('torch.', '')} alone, up to {float(rounding[worst]):.3g} nats "
            f"(datapoint {worst}, log p = {float(value[worst]):.6g}: 8 eps (|log p| + 1)), which more "
            f"nodes cannot lower. Compute in float64, or pass a larger tol."
        )
    if tol is not None and bool((error - rounding > tol).any()):
        worst = int((error - rounding).argmax())
        if reference is None or bool(moved[worst] >= error[worst]):
            rules = f"{error_nodes}{'' if previous is None else f' or {second}'} and {m}"
            why = (f"the estimate moves by up to {float(error[worst] - rounding[worst]):.3g} (datapoint {worst}) "
                   f"between {rules} nodes per dim")
        else:
            # the triangle through the adaptive reference: two prior grids that agree can both be off
            why = (f"the estimated error is up to {float(error[worst]):.3g} (datapoint {worst}): the distance to "
                   f"the adaptive rule plus that rule's own error (the estimate moves by only "
                   f"{float(between[worst]):.3g} between {error_nodes} and {m} nodes per dim)")
        if _another_mode(missing, error, worst):
            raise ValueError(
                f"Evidence(method='quadrature'): the estimated error is up to {float(error[worst]):.3g} "
                f"nats (datapoint {worst}) for tol={tol}: {OTHER_MODE_ADVICE}."
            )
        raise ValueError(
            f"Evidence(method='quadrature'): {m} nodes per latent dim are too few for "
            f"tol={tol}: {why}. Use "
            f"more nodes (num_nodes=...)"
            f"{'' if engine.adaptive else ' or adaptive=True'}."
        )
    if tol is None and warn_tol is not None and bool((error - rounding > warn_tol).any()):
        worst = int((error - rounding).argmax())
        warnings.warn(QuadratureAccuracyWarning(
            f"Evidence(method='quadrature'): log p(x) of site {tokens.name!r} is estimated to be "
            f"off by up to {float(error[worst]):.3g} nats (datapoint {worst}; "
            f"{int((error - rounding > warn_tol).sum())} of {error.numel()} above warn_tol={warn_tol:g} "
            f"beside the dtype's rounding) with "
            f"{m} nodes per latent dim{' (adaptive)' if engine.adaptive else ' (prior-centred)'}. "
            + (f"{OTHER_MODE_ADVICE[0].upper()}{OTHER_MODE_ADVICE[1:]}" if _another_mode(missing, error, worst) else
               f"Use more nodes (num_nodes=...){'' if engine.adaptive else ' or adaptive=True'}")
            + "; the per-datapoint estimates are the result's stderr; warn_tol=None silences this.",
            site=tokens.name, error=float(error[worst])),
            stacklevel=user_stacklevel(),
        )
    # per-datapoint diagnostics in the site's batch shape, like the value they describe
    # (flat, a (n, 1) batch minus its (n,) coarse estimate broadcast to (n, n))
    def unflat(t, trailing=False):
        if t is None:  # no latent: no nodes to count
            return None
        return tokens.unflatten(t.movedim(0, -1)).movedim(0, -1) if trailing else tokens.unflatten(t)

    diagnostics = {
        "num_nodes": m,
        "error_nodes": int(error_nodes),
        "coarse": unflat(coarse),
        "previous": unflat(previous),
        "reference": unflat(reference),
        "ess": unflat(state.ess),
        "axis_ess": unflat(state.axis_ess, trailing=True),
        "adaptive": engine.adaptive,
    }
    return EvidenceResult(value, error, diagnostics)
