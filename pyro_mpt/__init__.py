"""pyro_mpt: masked pre-training as a training objective and evidence estimator for Pyro.

Public API::

    from pyro_mpt import MaskedPretrainingLoss, Evidence, MPTCurve

The names below are imported from their modules on first use
(:mod:`~pyro_mpt.lazy_exports`): ``import pyro_mpt`` and the ``pyro-mpt``
command's argument parsing load neither torch nor Pyro.
"""

from typing import TYPE_CHECKING

from .lazy_exports import lazy_exports

__version__ = "0.1.0"

#: each public name -> the module (relative to this package) that defines it
_SOURCES = {
    "MaskedPretrainingLoss": ".loss",
    "Evidence": ".evidence",
    "EvidenceResult": ".evidence",
    "MPTCurve": ".curve",
    "ConditionalEngine": ".conditionals",
    "GaussianConditionals": ".conditionals",
    "QuadratureConditionals": ".conditionals",
    "EncodeDecodeConditionals": ".conditionals",
    "ImportanceConditionals": ".conditionals",
    "ImportanceWeightedELBO": ".importance_weighted_elbo",
    "ImportanceSamplingWarning": ".importance_weights",
    "NumericalWarning": ".conditionals",
    "MaskSchedule": ".masks",
    "AllSizes": ".masks",
    "UniformSizes": ".masks",
    "RandomOrders": ".masks",
    "Exhaustive": ".masks",
    "FixedRate": ".masks",
    "PseudoLikelihood": ".masks",
}

__all__ = [
    "MaskedPretrainingLoss",
    "Evidence",
    "EvidenceResult",
    "MPTCurve",
    "ConditionalEngine",
    "GaussianConditionals",
    "QuadratureConditionals",
    "EncodeDecodeConditionals",
    "ImportanceConditionals",
    "ImportanceWeightedELBO",
    "ImportanceSamplingWarning",
    "NumericalWarning",
    "MaskSchedule",
    "AllSizes",
    "UniformSizes",
    "RandomOrders",
    "Exhaustive",
    "FixedRate",
    "PseudoLikelihood",
]

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .conditionals import ConditionalEngine, GaussianConditionals, QuadratureConditionals
    from .conditionals import EncodeDecodeConditionals, ImportanceConditionals, NumericalWarning
    from .curve import MPTCurve
    from .evidence import Evidence, EvidenceResult
    from .importance_weighted_elbo import ImportanceWeightedELBO
    from .importance_weights import ImportanceSamplingWarning
    from .loss import MaskedPretrainingLoss
    from .masks import AllSizes, Exhaustive, FixedRate, MaskSchedule, PseudoLikelihood
    from .masks import RandomOrders, UniformSizes


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
