"""Conditional engines: how :math:`\\log p(x_j \\mid x_{\\mathcal R})` is computed.

=================  ==========================================================
name               what the model needs
=================  ==========================================================
``"gaussian"``     a Gaussian marginal: Gaussian observation without latents,
                   or Normal latents with a Normal observation affine in them
=================  ==========================================================
"""

from .base import ConditionalEngine, EngineNotApplicable
from .gaussian import GaussianConditionals
from .gaussian_marginal import GaussianMarginal, NotLinearGaussianError, gaussian_marginal

__all__ = [
    "ConditionalEngine",
    "EngineNotApplicable",
    "GaussianConditionals",
    "GaussianMarginal",
    "NotLinearGaussianError",
    "gaussian_marginal",
    "ENGINES",
    "make_engine",
    "auto_engine",
]

#: engines by name, tried in this order by ``conditionals="auto"``
ENGINES = {
    "gaussian": GaussianConditionals,
}

#: what each engine needs, for error messages
REQUIREMENTS = {
    "gaussian": "Normal latents local to each datapoint and a Normal (or "
    "MultivariateNormal) observation whose location is affine in them, or a "
    "Gaussian observation without latents",
}


def make_engine(spec, **options):
    """An engine from a name or an instance; ``"auto"`` returns None (resolved per model).

    :param spec: ``"auto"``, an engine name (see :data:`ENGINES`) or a
        :class:`ConditionalEngine`.
    :param options: passed to the engine's constructor.
    """
    if isinstance(spec, ConditionalEngine):
        return spec
    if spec == "auto":
        return None
    if isinstance(spec, str) and spec in ENGINES:
        return ENGINES[spec](**options)
    names = ", ".join(repr(k) for k in ["auto", *ENGINES])
    raise ValueError(
        f"Unknown conditionals={spec!r}; use one of {names} or a ConditionalEngine instance."
    )


def auto_engine(tokens, model, guide, args, kwargs, **options):
    """Pick the first engine of :data:`ENGINES` that serves the model.

    :returns: ``(engine, state)`` with the state already prepared.
    :raises ValueError: listing the engines and what each needs, when none applies.
    """
    reasons = {}
    for name, cls in ENGINES.items():
        engine = cls(**options)
        try:
            return engine, engine.prepare(tokens, model, guide, args, kwargs)
        except EngineNotApplicable as e:
            reasons[name] = str(e)
    lines = "\n".join(
        f"  - {name!r}: needs {REQUIREMENTS[name]}.\n    Here: {reasons.get(name, 'n/a')}"
        for name in ENGINES
    )
    raise ValueError(
        f"conditionals='auto' found no engine for the model of observed site "
        f"{tokens.name!r}. Engines and what they need:\n{lines}"
    )
