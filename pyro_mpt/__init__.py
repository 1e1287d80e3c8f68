"""pyro_mpt: masked pre-training as a training objective and evidence estimator for Pyro.

Public API::

    from pyro_mpt import MaskedPretrainingLoss, Evidence, MPTCurve
"""

from .conditionals import ConditionalEngine, GaussianConditionals, QuadratureConditionals
from .conditionals import EncodeDecodeConditionals, ImportanceConditionals, NumericalWarning
from .curve import MPTCurve
from .evidence import Evidence, EvidenceResult
from .importance_weighted_elbo import ImportanceWeightedELBO
from .importance_weights import ImportanceSamplingWarning
from .loss import MaskedPretrainingLoss
from .masks import AllSizes, Exhaustive, FixedRate, MaskSchedule, PseudoLikelihood, RandomOrders, UniformSizes

__version__ = "0.1.0"

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
