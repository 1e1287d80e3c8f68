"""Adapters: MPT curves and likelihood-style scores for pre-trained networks.

* :class:`MaskedLMScorer` -- HuggingFace masked LMs (BERT, RoBERTa, DistilBERT,
  ALBERT, ...): MPT curve over masking rates, cumulative MPT score per
  sequence, pseudo-log-likelihood.
* :class:`MAEScorer` -- HuggingFace ``ViTMAEForPreTraining``: MSE and Gaussian
  log-density curves over masking rates.
* :class:`RateCurve`, :func:`table2_area` -- curves indexed by masking rate and
  the paper's Table 2 area convention.

``transformers`` is imported lazily, and the names below on first use
(:mod:`~pyro_mpt.lazy_exports`): importing this package, or its torch-free
:mod:`~pyro_mpt.adapters.loading`, loads no torch.
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

_SOURCES = {
    "MaskedLMScorer": ".masked_lm",
    "MAEScorer": ".vit_mae",
    "Encoded": ".mlm_inputs",
    "masked_lm_head": ".mlm_forward",
    "RateCurve": ".rates",
    "table2_area": ".rates",
    "rate_grid": ".rates",
    "parse_rates": ".rates",
    "PAPER_MLM_RATES": ".rates",
    "PAPER_MAE_RATES": ".rates",
}

if TYPE_CHECKING:
    from .masked_lm import MaskedLMScorer
    from .mlm_forward import masked_lm_head
    from .mlm_inputs import Encoded
    from .rates import PAPER_MAE_RATES, PAPER_MLM_RATES, RateCurve, parse_rates, rate_grid, table2_area
    from .vit_mae import MAEScorer

__all__ = [
    "MaskedLMScorer",
    "MAEScorer",
    "Encoded",
    "masked_lm_head",
    "RateCurve",
    "table2_area",
    "rate_grid",
    "parse_rates",
    "PAPER_MLM_RATES",
    "PAPER_MAE_RATES",
]

__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
