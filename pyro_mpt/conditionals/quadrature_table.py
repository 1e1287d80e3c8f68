r"""The quadrature engine's table: the rule's nodes and the token log-likelihoods at them.

:class:`QuadratureState` holds the nodes and log-weights of one evaluation's
rule and the table :math:`T_{iqd} = \log p(x_{id} \mid z_q)` in chunks of
nodes (:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`): the leading
chunks kept (all of them when the table is small), the others streamed -- rebuilt
by the model run at each pass -- and reduced chunk by chunk
(:meth:`QuadratureState.reduce`, :func:`~pyro_mpt.conditionals.streamed_sums.streamed_log_sums`).
"""

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .mixture import combine_partials
from .mixture_chunks import MixtureChunk
from .streamed_sums import streamed_log_sums
from ..recompute import recomputed

__all__ = ["QuadratureState"]


@dataclass
class QuadratureState:
    """The quadrature rule of one loss evaluation, and its token table.

    :param torch.Tensor nodes: node coordinates ``(r, Q, K)`` (``r`` is 1 when the
        grid is shared by the batch, else ``n``); detached.
    :param torch.Tensor log_weights: rule log-weights ``(r, Q)`` for Lebesgue
        measure in the node coordinates; detached.
    :param int num_data: ``n``.
    :param int num_tokens: ``D``.
    :param int node_chunk: nodes per chunk of the table.
    :param list chunks: the cached table chunks, the leading ones of :meth:`slices`
        (all of them when the table fits the cache), or None when all are streamed.
    :param torch.Tensor ess: per-datapoint effective number of nodes of the
        posterior given all tokens, ``(n,)`` (None when not checked; for a
        streamed table it is filled by the first query).
    :param torch.Tensor axis_ess: the same per grid axis, ``(n, K)``
        (:func:`~pyro_mpt.conditionals.quadrature_rules.effective_nodes`).
    :param tuple frame: for an adaptive grid, ``(centre (r, K), sqrt_cov (r, K, K),
        std_nodes (Q, K), std_log_weights (Q,))``: the nodes are
        ``centre + sqrt_cov @ std_nodes`` (:func:`~pyro_mpt.conditionals.quadrature_rules.affine_grid`);
        None for a prior-centred grid.
    :param tuple prior_frame: for an adaptive grid over latents that are not all
        whitened normals, ``(centre (r, K), sqrt_cov (r, K, K))`` of the Laplace
        approximation of the prior in the node coordinates; the context grids model
        the prior by it (:func:`~pyro_mpt.conditionals.quadrature_contexts.prior_quadratic`).
        None otherwise.
    :param torch.Tensor missing_mass: for an adaptive grid whose engine looked for other
        modes, the log-evidence of each datapoint that they hold beyond the grid's reach,
        ``(n,)`` (:meth:`~pyro_mpt.conditionals.laplace.LaplaceSearch.other_modes`; 0 where
        none was found); None otherwise.
    :param quadratics: the table's projection onto quadratics
        (:func:`~pyro_mpt.conditionals.quadrature_contexts.token_quadratics`),
        computed by the first query that needs it.
    :param graded_quadratics: the same projection with the table's graph, for
        corrections that carry the gradient; computed by the first query that needs it.
    """

    nodes: torch.Tensor
    log_weights: torch.Tensor
    num_data: int
    num_tokens: int
    node_chunk: int
    runner: object = field(repr=False)
    chunks: Optional[list] = field(default=None, repr=False)
    ess: Optional[torch.Tensor] = None
    axis_ess: Optional[torch.Tensor] = None
    ess_pending: bool = False
    frame: Optional[tuple] = field(default=None, repr=False)
    prior_frame: Optional[tuple] = field(default=None, repr=False)
    missing_mass: Optional[torch.Tensor] = field(default=None, repr=False)
    quadratics: object = field(default=None, repr=False)
    graded_quadratics: object = field(default=None, repr=False)

    @property
    def num_nodes(self):
        """``Q``, the total number of nodes."""
        return self.nodes.shape[1]

    @property
    def nodes_per_dim(self):
        """``m``, nodes per latent dim of the tensor grid (``Q = m ** K``; ``Q`` when ``K`` is 0)."""
        return round(self.num_nodes ** (1.0 / max(1, self.latent_dim)))

    @property
    def latent_dim(self):
        return self.nodes.shape[2]

    def slices(self):
        """The node slices of the table's chunks, ``node_chunk`` nodes each (the last may be shorter)."""
        Q = self.num_nodes
        return [slice(s, min(Q, s + self.node_chunk)) for s in range(0, Q, self.node_chunk)]

    def streamed_slices(self):
        """The node slices not kept in ``chunks`` (all of them when none is kept)."""
        return self.slices()[len(self.chunks or ()):]

    def compute_chunk(self, sl):
        """Run the model on the nodes ``sl``.

        :rtype: ~pyro_mpt.conditionals.mixture_chunks.MixtureChunk
        """
        u = self.nodes[:, sl].transpose(0, 1)  # (Qc, r, K)
        log_pi, logp = self.runner.run(u)
        logw = self.log_weights[:, sl] + log_pi.transpose(0, 1)
        # a strided view: the reductions are batched matrix products that read it as is
        return MixtureChunk(logw, logp.transpose(0, 1))

    def detached_parts(self):
        """``(slice, log_prior (r, Q_c), table (n, Q_c, D))`` per chunk, detached: the kept
        chunks as they are, the streamed ones run again without a graph."""
        with torch.no_grad():
            for sl, log_prior, table in self._parts(self.compute_chunk):
                yield sl, log_prior.detach(), table.detach()

    def graded_parts(self):
        """``(slice, log_prior (r, Q_c), table (n, Q_c, D))`` per chunk with their graph: the
        kept chunks as they are, the streamed ones run again under activation recomputation
        (:func:`~pyro_mpt.recompute.recomputed`: the backward pass runs them once more)."""
        return self._parts(lambda sl: recomputed(self.compute_chunk, sl))

    def _parts(self, make):
        # the kept chunks, and the streamed ones made by ``make(slice)``; the chunk's weights
        # are the rule's times the prior density at the nodes
        for sl in self.slices():
            index = sl.start // self.node_chunk
            kept = self.chunks is not None and index < len(self.chunks)
            chunk = self.chunks[index] if kept else make(sl)
            yield sl, chunk.log_weights - self.log_weights[:, sl].to(chunk.log_weights.dtype), chunk.table

    def has_graph(self):
        """Whether the table carries a graph, or may (a streamed table is not run to tell)."""
        if not torch.is_grad_enabled():
            return False
        if len(self.chunks or ()) < len(self.slices()):
            return True
        return any(c.table.requires_grad or c.log_weights.requires_grad for c in self.chunks)

    def reduce(self, reducer, *inputs, check_ess=None):
        """Apply ``reducer(chunk, *inputs)`` to every chunk of the table; combine with logaddexp.

        The kept chunks are reduced as they are; the streamed ones are rebuilt
        chunk by chunk (:func:`~pyro_mpt.conditionals.streamed_sums.streamed_log_sums`: a
        pass without a graph for the value, one recomputed region per chunk for the
        gradient), so that none of them, nor its partial sums, is kept. On the first pass over a streamed table with
        ``ess_pending``, ``check_ess(state, log_joints)`` gets the per-node log
        joints ``(n, Q)`` (no extra pass).

        :param callable reducer: ``reducer(chunk, *inputs)`` -> a tuple of
            partial log-sums (:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`).
        :returns: the combined tuple (:func:`~pyro_mpt.conditionals.mixture.combine_partials`).
        """
        total = None
        joints = []
        for chunk in self.chunks or ():
            if self.ess_pending:
                joints.append(chunk.joint().detach())
            total = combine_partials(total, reducer(chunk, *inputs))
        makers = [functools.partial(self.compute_chunk, sl) for sl in self.streamed_slices()]
        if makers:
            visit = (lambda chunk: joints.append(chunk.joint())) if self.ess_pending else None
            total = combine_partials(total, streamed_log_sums(makers, reducer, *inputs, visit=visit))
        if self.ess_pending:
            self.ess_pending = False
            if check_ess is not None:
                check_ess(self, torch.cat(joints, -1))
        return total
