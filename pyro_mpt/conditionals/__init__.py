"""Conditional engines: how :math:`\\log p(x_j \\mid x_{\\mathcal R})` is computed.

===================  =============================================================
name                 what the model needs
===================  =============================================================
``"gaussian_hmm"``   an observed ``dist.GaussianHMM`` and no latent site, by
                     Kalman filtering and smoothing (linear in the steps;
                     ``"auto"`` takes it from 256 tokens a sequence)
``"gaussian"``       a Gaussian marginal: Gaussian observation without latents
                     (also in independent blocks, e.g. a multi-output GP, or a
                     ``GaussianHMM``), or Normal latents with a Normal
                     observation affine in them
``"hierarchical"``   a linear-Gaussian hierarchy: global latents and local
                     latents in a token plate of units
                     (``token_plates=("data",)`` makes the whole dataset one
                     datapoint), at a cost linear in the tokens
``"quadrature"``     tokens independent given continuous latents local to each
                     datapoint with at most 4 dims in all (any factorized
                     observation: Bernoulli, Categorical, Poisson, Normal, ...)
``"enumerate"``      tokens independent given discrete latents with finite
                     support local to each datapoint (Categorical, Bernoulli,
                     ...), summed over their joint support
``"hmm"``            an observed ``dist.DiscreteHMM`` (time steps as tokens),
                     by forward--backward
===================  =============================================================

Sampling engines, for latent models beyond closed forms and grids:

====================  =======================================================
name                  what the model needs
====================  =======================================================
``"encode_decode"``   tokens independent given latents local to each
                      datapoint, and an amortized guide (encoder) that reads
                      the data; recursive encoding--decoding (Rezende et al.
                      2014, app. F)
``"importance"``      tokens independent given latents local to each
                      datapoint (any number, continuous or discrete);
                      self-normalized importance sampling with the guide or
                      the prior as proposal
====================  =======================================================

``"auto"`` tries them in this order: ``"encode_decode"`` only when a guide that
reads the data is given, and ``"importance"`` (last) serves any model with
local latents and factorized tokens, with the prior as proposal when there is
no guide. It logs its choice and the reasons the earlier engines declined
(``logging`` at INFO, logger ``"pyro_mpt"``), and warns
(:class:`~pyro_mpt.conditionals.base.SlowEngineWarning`) when it picks a
quadrature grid of more than :data:`~pyro_mpt.conditionals.AUTO_GRID_WARNING` nodes although a guide
is given: such a grid costs more per step than the sampling engines that
would use the guide. It also warns
(:class:`~pyro_mpt.conditionals.base.EngineFallbackWarning`) when it passes over an
engine because the model failed when that engine ran it (not because of the
engine's checks of the model's form), e.g. a shape bug that only enumerated values
expose, which would otherwise send a mixture to approximate importance sampling
unnoticed.
"""

import difflib
import functools
import inspect
import logging
import warnings

from .base import (
    ConditionalEngine,
    EngineFallbackWarning,
    EngineNotApplicable,
    NumericalWarning,
    QuadratureAccuracyWarning,
    SlowEngineWarning,
    model_failed,
    fits_form,
)
from .gaussian import GaussianConditionals
from .gaussian_hmm import AUTO_MIN_TOKENS, GaussianHMMConditionals, GaussianHMMState
from .hierarchical import HierarchicalGaussianConditionals, HierarchicalGaussianState
from .gaussian_marginal import GaussianMarginal, NotLinearGaussianError, gaussian_marginal
from .quadrature import QuadratureConditionals
from .quadrature_table import QuadratureState
from .quadrature_nodes import NotQuadratureError
from .encode_decode import EncodeDecodeConditionals, EncodeDecodeState
from .importance import ImportanceConditionals, ImportanceState
from .enumerate import EnumerateConditionals, EnumerateState
from .hmm import DiscreteHMMConditionals, DiscreteHMMState
from .gaussian_mixture import GaussianMixtureTable
from .mixture import MixtureTable
from .data_args import guide_latents
from ..code_origin import user_stacklevel

__all__ = [
    "ConditionalEngine",
    "EngineNotApplicable",
    "NumericalWarning",
    "QuadratureAccuracyWarning",
    "SlowEngineWarning",
    "EngineFallbackWarning",
    "GaussianHMMConditionals",
    "GaussianHMMState",
    "GaussianConditionals",
    "HierarchicalGaussianConditionals",
    "HierarchicalGaussianState",
    "GaussianMarginal",
    "NotLinearGaussianError",
    "gaussian_marginal",
    "QuadratureConditionals",
    "QuadratureState",
    "NotQuadratureError",
    "EncodeDecodeConditionals",
    "EncodeDecodeState",
    "ImportanceConditionals",
    "ImportanceState",
    "EnumerateConditionals",
    "EnumerateState",
    "DiscreteHMMConditionals",
    "DiscreteHMMState",
    "MixtureTable",
    "GaussianMixtureTable",
    "ENGINES",
    "engine_name",
    "AUTO_GRID_WARNING",
    "AUTO_MIN_TOKENS",
    "AUTO_OPTIONS",
    "make_engine",
    "auto_engine",
    "option_names",
    "unknown_options_message",
]

#: engines by name, tried in this order by ``conditionals="auto"``
ENGINES = {
    "gaussian_hmm": GaussianHMMConditionals,
    "gaussian": GaussianConditionals,
    "hierarchical": HierarchicalGaussianConditionals,
    "quadrature": QuadratureConditionals,
    "enumerate": EnumerateConditionals,
    "hmm": DiscreteHMMConditionals,
    "encode_decode": EncodeDecodeConditionals,
    "importance": ImportanceConditionals,
}

#: constructor options that ``"auto"`` gives an engine beyond the user's: the Kalman engine
#: only for sequences long enough that it beats the dense covariance, and masks drawn per
#: datapoint sent to the dense covariance where its cost rule says that is cheaper
AUTO_OPTIONS = {"gaussian_hmm": {"min_tokens": AUTO_MIN_TOKENS, "dense_per_datapoint": True}}

#: ``"auto"`` warns when, with a guide given, it picks a quadrature grid with
#: more nodes than this: more than the 256 draws of ``"importance"``'s default,
#: so more decoder evaluations per step than any sampling engine's defaults
AUTO_GRID_WARNING = 256

logger = logging.getLogger("pyro_mpt")

#: what each engine needs, for error messages
REQUIREMENTS = {
    "gaussian_hmm": "an observed dist.GaussianHMM site (its elements as tokens) and no latent site",
    "gaussian": "Normal latents local to each datapoint and a Normal (or "
    "MultivariateNormal) observation whose location is affine in them, or a "
    "Gaussian observation without latents (MultivariateNormal, also over several "
    "blocks as a multi-output GP, or GaussianHMM)",
    "hierarchical": "a linear-Gaussian hierarchy: Normal latents inside one token plate "
    "of units (e.g. token_plates=('data',)) and outside it, and a Normal observation "
    "affine in them",
    "quadrature": "an observation that factorizes over tokens given continuous "
    "latents local to each datapoint (Normal/MultivariateNormal, scalar "
    "Gamma, Beta, Uniform, ..., or Dirichlet) with at most 4 latent dims per datapoint "
    "(a Dirichlet over K categories counts K - 1)",
    "enumerate": "discrete latents with finite support (Categorical, Bernoulli, "
    "...) local to each datapoint, at most max_support joint values, and tokens "
    "independent given them (or, with Normal latents too, linear-Gaussian components)",
    "hmm": "an observed dist.DiscreteHMM site (time steps as tokens) and no other latent",
    "encode_decode": "an amortized guide (encoder) that takes the data through "
    "one argument, latents local to each datapoint, and tokens independent "
    "given them",
    "importance": "latents local to each datapoint and tokens independent given "
    "them (any observation whose base distribution has no event dims)",
}


def make_engine(spec, **options):
    """An engine from a name or an instance; ``"auto"`` returns None (resolved per model).

    :param spec: ``"auto"``, an engine name (see :data:`ENGINES`) or a
        :class:`ConditionalEngine`.
    :param options: passed to the engine's constructor.
    :raises ValueError: for an option that the named engine (with ``"auto"``: every engine)
        does not take, naming the options it takes; and for any option beside an engine
        instance, which would not reach it.

    Example::

        >>> make_engine("quadrature", num_nodes=20)
        QuadratureConditionals(num_nodes=20, adaptive=True)
        >>> make_engine("auto") is None
        True
    """
    if isinstance(spec, ConditionalEngine):
        if options:
            # an instance is built already: the options would be dropped without a word
            # (MaskedPretrainingLoss(conditionals=QuadratureConditionals(), num_nodes=3) kept
            # the default grid)
            listed = ", ".join(f"{k}={v!r}" for k, v in options.items())
            params = inspect.signature(type(spec).__init__).parameters.values()
            unknown = sorted(set(options) - option_names(type(spec)))
            if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
                # the advice below would end in the constructor's TypeError (QuadratureConditionals
                # takes no num_samples): say what it takes, and where the option belongs
                elsewhere = {k: [f"conditionals={n!r}" for n, c in ENGINES.items() if k in option_names(c)] for k in unknown}
                known = ", ".join(f"{k}={v!r}" for k, v in options.items() if k not in unknown)
                raise ValueError(
                    unknown_options_message(f"conditionals={spec!r}", unknown, option_names(type(spec)), elsewhere)
                    + (f" Pass {known} to its constructor, {type(spec).__name__}({known})." if known else "")
                )
            raise ValueError(
                f"conditionals={spec!r} is an engine instance, so the option(s) {listed} would "
                f"not reach it: pass them to its constructor, {type(spec).__name__}({listed}), "
                f"or name the engine, conditionals=<name>, with the options beside it."
            )
        return spec
    if spec == "auto":
        check_auto_options(options)
        return None
    if isinstance(spec, str) and spec in ENGINES:
        cls = ENGINES[spec]
        unknown = sorted(set(options) - option_names(cls))
        if unknown:
            elsewhere = {k: [f"conditionals={n!r}" for n, c in ENGINES.items() if k in option_names(c)] for k in unknown}
            raise ValueError(unknown_options_message(f"conditionals={spec!r}", unknown, option_names(cls), elsewhere))
        return cls(**options)
    names = ", ".join(repr(k) for k in ["auto", *ENGINES])
    raise ValueError(
        f"Unknown conditionals={spec!r}; use one of {names} or a ConditionalEngine instance."
    )


def engine_name(engine):
    """The name :data:`ENGINES` gives ``engine``'s class (a subclass: its nearest registered
    base's), else the class's own name.

    Example::

        >>> engine_name(GaussianConditionals())
        'gaussian'
    """
    for cls in type(engine).__mro__:
        for name, registered in ENGINES.items():
            if cls is registered:
                return name
    return type(engine).__name__


def option_names(cls):
    """The keyword options of an engine class's constructor (all of them are keywords).

    :param type cls: a :class:`ConditionalEngine` subclass.
    :returns: frozenset of names.

    Example::

        >>> sorted(option_names(EnumerateConditionals))
        ['max_elements', 'max_support']
    """
    return _accepted_options(cls)


def unknown_options_message(who, unknown, accepted, elsewhere=None):
    """The message for options that ``who`` does not take: what it takes, close spellings.

    :param str who: the callee as the user wrote it, e.g. ``"conditionals='gaussian'"``.
    :param list unknown: the option names it does not take.
    :param accepted: the names it takes.
    :param dict elsewhere: ``{option: [where it belongs, ...]}`` for options that another
        estimator or method takes (e.g. ``num_samples`` of ``method='importance'``).
    :returns: str.
    """
    hints = []
    for name in unknown:
        if elsewhere and elsewhere.get(name):
            hints.append(f"{name!r} is an option of {' and '.join(elsewhere[name])}")
            continue
        close = difflib.get_close_matches(name, sorted(accepted), n=1, cutoff=0.75)
        if close:
            hints.append(f"did you mean {close[0]}= for {name}=?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (
        f"{who} takes no option(s) {', '.join(map(repr, unknown))}{hint}. Its options: "
        f"{', '.join(sorted(accepted)) or 'none'}; check the spelling, or leave them out."
    )


@functools.lru_cache(maxsize=None)
def _accepted_options(cls):
    # read once a class: inspect.signature of the eight engines took 0.36 ms, a tenth of a whole
    # D = 10 PPCA step, at every call of a fresh loss ("auto" chooses again)
    return frozenset(
        name for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


def check_auto_options(options):
    """Refuse options that no engine takes (``"auto"`` gives each engine the ones it knows).

    :raises ValueError: naming them.
    """
    unused = set(options).difference(*(_accepted_options(cls) for cls in ENGINES.values()))
    if unused:
        raise ValueError(
            f"conditionals='auto': no engine takes the option(s) {sorted(unused)}; "
            f"check their spelling, or choose the engine by name."
        )


def auto_engine(tokens, model, guide, args, kwargs, **options):
    """Pick the first engine of :data:`ENGINES` that serves the model.

    :returns: ``(engine, state)`` with the state already prepared.
    :raises ValueError: listing the engines and what each needs, when none applies.

    Example::

        >>> tokens = trace_tokens(ppca, None, (x,), {})
        >>> engine, state = auto_engine(tokens, ppca, None, (x,), {})  # GaussianConditionals for PPCA
    """
    check_auto_options(options)
    accepted = {name: _accepted_options(cls) for name, cls in ENGINES.items()}
    reasons, failed = {}, {}
    for name, cls in ENGINES.items():
        # each engine takes the options it knows; e.g. num_samples is only for sampling engines
        engine = cls(**{**AUTO_OPTIONS.get(name, {}), **{k: v for k, v in options.items() if k in accepted[name]}})
        try:
            state = engine.prepare(tokens, model, guide, args, kwargs)
        except EngineNotApplicable as e:
            reasons[name] = str(e)
            if model_failed(e) or fits_form(e):
                failed[name] = str(e)
            continue
        _report_choice(tokens, name, state, reasons)
        if failed:
            _warn_fallback(tokens, name, failed)
        return engine, state
    lines = "\n".join(
        f"  - {name!r}: needs {REQUIREMENTS[name]}.\n    Here: {reasons.get(name, 'n/a')}"
        for name in ENGINES
    )
    raise ValueError(
        f"conditionals='auto' found no engine for the model of observed site "
        f"{tokens.name!r}. Engines and what they need:\n{lines}"
    )


def _warn_fallback(tokens, name, failed):
    """Warn that ``"auto"`` passed over engines made for the model because the model failed under them."""
    listed = "\n".join(f"  - {k!r}: {v}" for k, v in failed.items())
    warnings.warn(
        EngineFallbackWarning(
            f"conditionals='auto' chose {name!r} for observed site {tokens.name!r} after "
            f"passing over {', '.join(map(repr, failed))}, made for models of this form, "
            f"because the model failed when run there or is written in a way it does not "
            f"read:\n{listed}\nFix the model as that says "
            f"(the earlier engine is exact or cheaper), or choose conditionals={name!r} by name "
            f"to keep it and silence this warning.",
            engine=name,
            failed=failed,
        ),
        stacklevel=user_stacklevel(),
    )


def _report_choice(tokens, name, state, reasons):
    """Log which engine ``"auto"`` chose and why; warn when it is a large grid despite a guide."""
    if logger.isEnabledFor(logging.INFO):
        declined = "; ".join(f"{k!r} declined: {v}" for k, v in reasons.items())
        logger.info(
            "conditionals='auto' chose %r for observed site %r: the first engine of %s that "
            "serves the model%s",
            name, tokens.name, list(ENGINES), f" ({declined})" if declined else "",
        )
    nodes = getattr(state, "num_nodes", None)
    if name == "quadrature" and nodes is not None and nodes > AUTO_GRID_WARNING and guide_latents(tokens):
        K = state.latent_dim
        m = round(nodes ** (1.0 / K)) if K else 1
        warning = SlowEngineWarning(
            f"conditionals='auto' chose 'quadrature' for observed site {tokens.name!r}: a grid "
            f"of {nodes} nodes ({m} per latent dim, K={K}) per datapoint, each a full model "
            f"evaluation with gradient, although a guide is given: the sampling engines that "
            f"use it ('encode_decode', 'importance') cost far less per step (see the amortized "
            f"engines' section of docs/benchmarks.md). Choose the engine by name: "
            f"conditionals='encode_decode' or 'importance' for speed, or "
            f"conditionals='quadrature' (num_nodes=... for a smaller grid) to keep the "
            f"grid's accuracy and silence this warning.",
            engine="quadrature",
            size=nodes,
        )
        warnings.warn(warning, stacklevel=user_stacklevel())
