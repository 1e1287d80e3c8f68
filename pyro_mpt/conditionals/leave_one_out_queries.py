r"""Queries that each hide one token (the ``"pll"`` schedule) served by one leave-one-out table.

An engine that computes every token's conditional given all the others,
:math:`\log p(x_j \mid x_{-j})` ``(n, D)``, in one pass (a finite mixture's table, an
HMM's forward--backward messages) serves :math:`D` such queries at the cost of one. In a
loss, the shared masks of a schedule reach the engine in groups
(:func:`~pyro_mpt.estimate.mpt_estimate`, by
:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_sum_elements`), and each group's
:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum` would take the pass
again: :class:`LeaveOneOutQueries` declares such queries a row of ``n`` sums each, so
that they form one group, and sums them from the table,

.. math::

    \sum_q c_q \log p(x_{j_q} \mid x_{-j_q}) = T\,w, \qquad w_j = \sum_{q:\, j_q = j} c_q.
"""

import torch

from .gaussian_leave_one_out import leave_one_out_targets

__all__ = ["LeaveOneOutQueries"]


class LeaveOneOutQueries:
    r"""Mixin of a :class:`~pyro_mpt.conditionals.ConditionalEngine` (listed before it)
    whose :meth:`leave_one_out_table` gives :math:`\log p(x_j \mid x_{-j})` of every token
    in one pass: masks shared by the batch that each hide one token take one such pass a
    step, whatever ``chunk_size`` (a Bernoulli mixture, K = 10, D = 784, N = 1000: 147 passes
    a step before, until the process was killed at 15 GB; an HMM of 200 sequences of 1000
    steps, S = 4: 50 passes, 56.5 s a step against 0.75 s). Other masks take the engine's
    own paths.

    Example::

        >>> class MyEngine(LeaveOneOutQueries, ConditionalEngine):
        ...     def serves_leave_one_out(self, state): return True
        ...     def leave_one_out_table(self, state): return table   # (n, D)
    """

    def serves_leave_one_out(self, state):
        """Whether :meth:`leave_one_out_table` gives the table for ``state``, without
        computing it.

        :returns: bool.
        """
        raise NotImplementedError

    def leave_one_out_table(self, state):
        r""":math:`\log p(x_j \mid x_{-j})` of every token given all the others, ``(n, D)``.

        :param state: from the engine's ``prepare``, with :meth:`serves_leave_one_out` True.
        :returns: ``(n, D)``.
        """
        raise NotImplementedError

    def weighted_sum_elements(self, state, x, mask=None):
        """``n`` (a row of sums per query) when every shared mask hides one token and the
        table serves them (one group, one pass), else the engine's own count."""
        if mask is not None and leave_one_out_targets(mask) is not None and self.serves_leave_one_out(state):
            return x.shape[0]
        return super().weighted_sum_elements(state, x, mask)

    def leave_one_out_log_prob(self, state, x, observed=None):
        """:meth:`leave_one_out_table` where :meth:`serves_leave_one_out`, else None (also
        with missing tokens, ``observed``)."""
        if observed is not None or not self.serves_leave_one_out(state):
            return None
        self._check_x(state, x)
        return self.leave_one_out_table(state)

    def weighted_mask_sum(self, state, x, mask, coef):
        r""":math:`\sum_q c_q \sum_{j \in \mathcal M_q} \log p(x_j \mid x_{-\mathcal M_q})` for
        masks ``(q, D)`` shared by the batch, ``(n,)``: from the leave-one-out table when
        every mask hides one token, else the engine's own sums."""
        targets = leave_one_out_targets(mask)
        table = None if targets is None else self.leave_one_out_log_prob(state, x)
        if table is None:
            return super().weighted_mask_sum(state, x, mask, coef)
        weight = torch.zeros(mask.shape[-1], dtype=table.dtype, device=table.device)
        return table @ weight.index_add(0, targets, coef.to(table.dtype))
