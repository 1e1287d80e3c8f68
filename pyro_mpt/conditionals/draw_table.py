r"""The importance engine's table of draws shared by every query, in chunks with bounded memory.

With the prior as proposal, or an autoguide's defensive mixture (neither reads the data),
one set of :math:`S` draws per datapoint serves every query: the table
:math:`T_{isd} = \log p(x_{id} \mid z_{is})` with the draws' log-weights
:math:`\log w_{is}`. :class:`DrawTable` holds it in chunks of draws
(:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`, ``(n, S_c, D)`` each), every
chunk drawn on a random stream of its own, seeded from one number that the table draws
from torch's global stream when it is made: a chunk can be drawn again, equal, at any
later pass, and a seed set before the loss still fixes every draw.

* The leading chunks, up to ``cache_elements`` table entries, are **kept**: their tables
  stay for every query of the evaluation, but not the model's intermediates that made
  them. Each is made in a recomputed region (:func:`~pyro_mpt.recompute.recomputed`), so
  the backward pass runs the model on its draws once more, after every query's gradient
  has reached the table: a kept entry costs its value, its exp-space copy, its
  gradient's buffer and one block's gradient (about 18 bytes at the peak in float32),
  where the model's saved intermediates cost several more (a PPCA's table of 1e8 entries
  with them: 4.4 GB; without, 2.2 GB).
* The other chunks are **streamed**: drawn and reduced chunk by chunk at every pass
  (:meth:`DrawTable.reduce`, :func:`~pyro_mpt.conditionals.streamed_sums.streamed_log_sums`),
  so that the peak memory is the kept entries plus one chunk's working set whatever
  :math:`S n D`, with gradients too. The price is model runs per chunk and pass: one
  without a graph for the value, one with it for the gradient, and one more in the
  backward pass.
"""

import functools

import torch

from ..random_streams import seeded_streams
from ..recompute import recomputed
from .mixture import combine_partials
from .mixture_chunks import MixtureChunk
from .streamed_sums import streamed_log_sums

__all__ = ["DrawTable"]

# spreads the chunks' seeds over the 63-bit range: consecutive integers would seed
# torch's Mersenne Twister with states that differ in a few bits only
_GOLDEN = 0x9E3779B97F4A7C15


class DrawTable:
    r"""``S`` draws per datapoint shared by every query, in chunks of draws.

    :param callable draw: ``draw(start, rows)`` -> ``(log_weights, table)``: runs the
        model at ``rows`` new draws (the draws ``start .. start + rows - 1`` of the
        ``S``), drawing its random numbers from torch's streams, and returns their
        log-weights ``(r, rows)`` (``r`` 1 or ``n``; the :math:`-\log S` included) and
        the table ``(n, rows, D)``.
    :param int num_samples: ``S``.
    :param int draw_chunk: draws per chunk.
    :param int cache_elements: table entries kept (whole chunks, from the first, in one
        table); the rest are streamed.
    :param int num_data: ``n``.
    :param int num_tokens: ``D``.

    Example::

        >>> table = DrawTable(draw, 256, 64, 2**27, n, D)
        >>> num, den = table.reduce(lambda chunk, ctx: chunk.mask_partials(ctx), ctx)
    """

    def __init__(self, draw, num_samples, draw_chunk, cache_elements, num_data, num_tokens):
        self.draw = draw
        self.num_samples = int(num_samples)
        self.draw_chunk = max(1, int(draw_chunk))
        self.num_data, self.num_tokens = int(num_data), int(num_tokens)
        # one number from the global stream: the table is reproducible under a seed set
        # before it, and the next evaluation (the global stream moved on) draws anew; on the
        # CPU stream explicitly (a default device of "meta" or CUDA would not give the number)
        self.seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        per_chunk = self.draw_chunk * self.num_data * self.num_tokens
        slices = self.slices()
        keep = len(slices) if self.num_samples * self.num_data * self.num_tokens <= cache_elements else (
            int(cache_elements) // max(1, per_chunk)
        )
        #: the draws kept, the leading :attr:`num_kept`, as one
        #: :class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk` (None when none is kept)
        self.kept = self._kept_table(slices[:keep]) if keep else None

    @property
    def num_kept(self):
        """The draws kept, the leading ones."""
        return 0 if self.kept is None else self.kept.table.shape[1]

    def _kept_table(self, slices):
        """The kept chunks as one table, each chunk copied in as it is made: one reduction per
        query block over them all, whose saved pieces do not grow with their number (a
        reduction per chunk saved each chunk's ``(n, q, D)`` products and partials for the
        backward pass: PPCA N = 800, D = 200, 256 draws, masks="all", 2.2 GB peak in chunks of
        2**24 entries and 3.6 GB in chunks of 2**22)."""
        logws, table = [], None
        for sl in slices:
            chunk = recomputed(self.compute_chunk, sl)
            if table is None:
                table = chunk.table.new_empty((self.num_data, slices[-1].stop, self.num_tokens))
            table[:, sl] = chunk.table
            logws.append(chunk.log_weights)
        rows = max(lw.shape[0] for lw in logws)
        return MixtureChunk(torch.cat([lw.expand(rows, -1) for lw in logws], -1), table)

    def slices(self):
        """The draws of each chunk, ``draw_chunk`` each (the last may be shorter)."""
        S, step = self.num_samples, self.draw_chunk
        return [slice(s, min(S, s + step)) for s in range(0, S, step)]

    def streamed_slices(self):
        """The slices of the chunks not kept."""
        return [sl for sl in self.slices() if sl.start >= self.num_kept]

    def compute_chunk(self, sl):
        """Draw the chunk ``sl`` on its own random stream and run the model there.

        :rtype: ~pyro_mpt.conditionals.mixture_chunks.MixtureChunk
        """
        index = sl.start // self.draw_chunk
        with seeded_streams((self.seed + _GOLDEN * (index + 1)) % 2**63):
            log_weights, table = self.draw(sl.start, sl.stop - sl.start)
        return MixtureChunk(log_weights, table)

    def reduce(self, reducer, *inputs, visit=None):
        """Apply ``reducer(chunk, *inputs)`` to every chunk; combine with logaddexp.

        The kept chunks are reduced as they are; the streamed ones are drawn again chunk by
        chunk (:func:`~pyro_mpt.conditionals.streamed_sums.streamed_log_sums`: a pass without a
        graph for the value, one recomputed region per chunk for the gradient), so that none
        outlives its reduction.

        :param callable reducer: ``reducer(chunk, *inputs)`` -> a tuple of partial log-sums.
        :param callable visit: called without a graph with every chunk, detached (the kept
            draws chunk by chunk, as :meth:`parts`; a streamed chunk as its value's pass
            draws it, so that what ``visit`` computes costs no model run of its own).
        :returns: the combined tuple (:func:`~pyro_mpt.conditionals.mixture.combine_partials`).
        """
        total = None if self.kept is None else reducer(self.kept, *inputs)
        if visit is not None and self.kept is not None:
            with torch.no_grad():
                for part in self._kept_parts():
                    visit(part)
        makers = [functools.partial(self.compute_chunk, sl) for sl in self.streamed_slices()]
        if makers:
            seen = None if visit is None else (lambda chunk: visit(chunk.detached()))
            total = combine_partials(total, streamed_log_sums(makers, reducer, *inputs, visit=seen))
        return total

    def parts(self):
        """Every chunk, detached, in order of the draws: the kept ones as they are, the
        streamed ones drawn again (call it under ``torch.no_grad()``: for diagnostics).

        :returns: an iterator of :class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`.
        """
        yield from self._kept_parts()
        for sl in self.streamed_slices():
            yield self.compute_chunk(sl).detached()

    def _kept_parts(self):
        if self.kept is not None:
            kept = self.kept.detached()
            for sl in self.slices():
                if sl.start < self.num_kept:
                    # views of the kept table, chunk by chunk: what a diagnostic makes of each
                    # (squares, copies) stays the size of a chunk
                    yield kept.narrowed(sl)

    def __repr__(self):
        return f"DrawTable(num_samples={self.num_samples}, kept={self.num_kept}, streamed={self.num_samples - self.num_kept})"

