"""The value every evidence method returns: per-datapoint :math:`\\log p(x_i)` with its uncertainty.

A leaf module: the methods (:mod:`~pyro_mpt.evidence.exact`,
:mod:`~pyro_mpt.evidence.quadrature`, :mod:`~pyro_mpt.evidence.importance`)
and :class:`~pyro_mpt.evidence.Evidence` all build on it, and it imports none
of them.
"""

from dataclasses import dataclass, field

import torch

__all__ = ["EvidenceResult"]


@dataclass
class EvidenceResult:
    """Per-datapoint log-evidence with its uncertainty.

    :param torch.Tensor log_evidence: :math:`\\log p(x_i)`, the site's batch shape.
    :param torch.Tensor stderr: standard error per datapoint (zeros when exact).
    :param dict diagnostics: method-specific diagnostics.

    Example::

        >>> res = Evidence(ppca, method="quadrature").estimate(x)
        >>> res.total(), res.stderr.max(), res.diagnostics["ess"].min()
    """

    log_evidence: torch.Tensor
    stderr: torch.Tensor
    diagnostics: dict = field(default_factory=dict)

    def total(self):
        """:math:`\\sum_i \\log p(x_i)` as a float (without its graph: torch 2.11 warns on a
        float of a tensor that requires grad)."""
        return float(self.log_evidence.detach().sum())
