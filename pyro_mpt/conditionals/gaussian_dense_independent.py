r"""Dense log-conditionals for masks drawn per datapoint, with the backward pass written out:
their sums (:class:`DenseIndependentSums`: the Gaussian engine's route for the pairs of no
fewer targets than context tokens, or for every pair where the covariance is
ill-conditioned, beside
:func:`~pyro_mpt.conditionals.gaussian_dense_precision.routed_dense_sums`' precision route)
and, per token and component, with the contexts' densities
(:class:`DenseContextConditionals`, Gaussian mixtures).

For a full covariance :math:`\Sigma` shared by the batch and a mask per
(query, datapoint) pair with targets :math:`\mathcal M` and context
:math:`\mathcal R`, the pair's share of the estimate is

.. math::

    s = -\tfrac12\sum_{j\in\mathcal M}\Big[\log 2\pi v_j + \frac{d_j^2}{v_j}\Big],\qquad
    d = r_{\mathcal M} - \Sigma_{\mathcal M\mathcal R}\alpha,\quad
    \alpha = X^{-1}r_{\mathcal R},\quad
    v_j = \Sigma_{jj} - \Sigma_{j\mathcal R}X^{-1}\Sigma_{\mathcal Rj},

with :math:`X = \Sigma_{\mathcal R\mathcal R}` and :math:`r = x - \mu`. Recorded op by
op, the backward pass of the factorization and the two triangular solves makes about
twenty passes over the pairs' tables, and activation checkpointing runs the forward pass
a second time (measured: 90 % of a training step at D = 200). Here, with
:math:`\bar d_j = -g\,d_j/v_j`, :math:`\bar v_j = -\tfrac g2(1/v_j - d_j^2/v_j^2)`
(zero at the context), :math:`B = X^{-1}\Sigma_{\mathcal R\mathcal M}` and
:math:`u = B\bar d_{\mathcal M}`:

.. math::

    \bar r_{\mathcal M} = \bar d,\quad \bar r_{\mathcal R} = -u,\qquad
    \bar\Sigma_{\mathcal R\mathcal M} \mathrel{+}= -2B\operatorname{diag}(\bar v) - \alpha\bar d^\top,\quad
    \bar\Sigma_{\mathcal R\mathcal R} \mathrel{+}= B\operatorname{diag}(\bar v)B^\top + u\alpha^\top,\quad
    \bar\Sigma_{jj} \mathrel{+}= \bar v_j,

summed over the pairs and symmetrized, :math:`\tfrac12(\bar\Sigma + \bar\Sigma^\top)`: the
gradient of a function of the symmetric :math:`\Sigma`.

Each pair's blocks are compact: the pairs are sorted by context size, and a chunk of
them gathers its contexts into ``s x s`` blocks and its targets into ``s x m`` ones
(``s``, ``m`` the chunk's largest context and target set, ``s + m`` about ``D``), padded
by tokens of variance 1, uncorrelated with everything. With sizes uniform on ``0..D``
that is about a seventh of the flops of embedding every context in a ``D x D`` matrix
(identity at the targets), what this module did before: at D = 50 (a full-covariance
Gaussian mixture, four components, N = 1000, one thread) a step went from 350 to 220 ms.
The backward pass recomputes each chunk's factor, so that nothing of the size of the
pairs' tables outlives the forward pass, except the chunks' pieces kept within
``keep_elements`` (a mixture's :class:`DenseContextConditionals`; the Gaussian engine's
first block of masks in :class:`DenseIndependentSums`, the largest contexts first).
"""

import bisect

import torch

from ..mask_bits import pack_bits, unpack_bits
from .gaussian_linalg import LOG_2PI, cholesky, tril_inverse
from .written_backward import KeptChunks, first_order_backward

__all__ = ["DenseContextConditionals", "DenseIndependentSums", "costliest_first", "padded_tokens", "sorted_spans"]


#: bytes of a chunk's ``(pairs, s, s + m)`` tables on the CPU: the dozen passes over a
#: chunk's tables then run in a core's cache (measured at D = 200: 1.5x faster than 64 MB
#: tables); a GPU takes chunks of ``max_elements``, as many pairs as its kernels can fill
CHUNK_BYTES = 2**20


def sorted_spans(size, elements, itemsize, max_elements, device):
    """Spans of pairs sorted by ``size``, each as long as its tables allow: yields
    ``(pairs, lo, hi)``, the indices of a span's pairs and its smallest and largest size.

    A span takes as many pairs as keep ``elements(count, lo, hi)`` (the elements of its
    tables, growing with the span) within ``max_elements``, on the CPU also within
    ``CHUNK_BYTES`` of ``itemsize``-byte entries; at least one pair.

    :param torch.Tensor size: long ``(P,)``.
    :param callable elements: ``(count, lo, hi) -> int``, nondecreasing in ``count`` and ``hi``.

    Example::

        >>> [p.tolist() for p, lo, hi in sorted_spans(torch.tensor([3, 1, 2]), lambda c, lo, hi: c * hi, 4, 5, "cpu")]
        [[1, 2], [0]]
    """
    budget = max_elements
    if torch.device(device).type == "cpu":
        budget = min(budget, CHUNK_BYTES // itemsize)
    order = torch.argsort(size, stable=True)
    sizes = size[order].tolist()  # one host sync for every span's bounds
    start, P = 0, len(sizes)
    while start < P:
        lo = sizes[start]

        def span_elements(stop):
            return elements(stop - start, lo, sizes[stop - 1])

        # the largest stop within budget (the elements grow with the span's last, largest size)
        stop = max(start + 1, bisect.bisect_right(range(start + 1, P + 1), budget, key=span_elements) + start)
        yield order[start:stop], lo, sizes[stop - 1]
        start = stop


def _sorted_chunks(context, itemsize, max_elements, device):
    """Chunks of the pairs, by context size: yields ``(pairs, s, m)``, the indices of a
    chunk's pairs, its largest context ``s`` and its largest target set ``m``.

    Sorted by size, a chunk's pairs factor ``s x s`` blocks and solve ``s x m`` ones
    (``s + m`` about ``D``) instead of each embedding its context in a ``D x D`` matrix:
    with sizes uniform on ``0..D``, about a seventh of the embedded form's flops. A chunk
    takes as many pairs as keep its ``(pairs, s, s + m)`` tables within ``max_elements``
    (on the CPU also within ``CHUNK_BYTES``): sized by ``D x D`` instead, chunks of small
    contexts were a few pairs each, their kernels' fixed cost most of a step at D = 200."""
    D = context.shape[-1]

    def elements(count, lo, hi):
        return count * max(1, hi) * (max(1, hi) + max(1, D - lo))

    for pairs, lo, hi in sorted_spans(context.sum(-1), elements, itemsize, max_elements, device):
        yield pairs, max(1, hi), max(1, D - lo)


def padded_tokens(S, r):
    """``S`` ``(K, D, D)`` (a covariance or a precision) and ``r`` ``(K, P, D)`` with ``2 D``
    padding tokens appended: diagonal 1, uncorrelated, ``r`` 0. A pair's compact blocks
    index a padding token of their own at each position past its tokens, which makes
    them the identity there, and uncorrelated, without masks.

    Example::

        >>> Sp, rp = padded_tokens(torch.eye(2)[None] * 4, torch.ones(1, 3, 2))
        >>> Sp.shape, rp.shape
        (torch.Size([1, 6, 6]), torch.Size([1, 3, 6]))
    """
    K, D = S.shape[0], S.shape[-1]
    Sp = S.new_zeros(K, 3 * D, 3 * D)
    Sp[:, :D, :D] = S
    Sp[:, D:, D:].diagonal(dim1=-2, dim2=-1).fill_(1)
    return Sp, torch.nn.functional.pad(r, (0, 2 * D))


class _Pieces:
    r"""A chunk's conditionals on compact blocks, for every component at once: the context
    factors ``L`` (``s x s``, identity past each pair's context), ``B0 = L^-1 S_RM``
    (``s x m``), ``alpha``, the targets' variances ``v`` and residuals ``d`` (``m``; 1 and 0
    past each pair's targets).

    :param Sp: ``(K, 3D, 3D)`` and :param rp: ``(K, P, 3D)``, from :func:`padded_tokens`.
    :param context: bool ``(P, D)``. :param int s: the chunk's largest context.
    :param int m: its largest target set."""

    def __init__(self, Sp, rp, context, s, m, site, check_pivots=True):
        P, D = context.shape
        K = Sp.shape[0]
        # each pair's context tokens (targets) in token order, then padding tokens
        nR = context.sum(-1, keepdim=True)
        pos = torch.arange(max(s, m), device=rp.device)
        R = torch.sort((~context).to(torch.uint8), dim=-1, stable=True).indices[:, :s]
        self.R = torch.where(pos[:s] < nR, R, D + pos[:s])
        M = torch.sort(context.to(torch.uint8), dim=-1, stable=True).indices[:, :m]
        self.M = torch.where(pos[:m] < D - nR, M, D + s + pos[:m])
        self.nR = nR.squeeze(-1).to(Sp.dtype)
        self._flat_indices(D)
        E = 3 * D
        flatS = Sp.view(K, E * E)
        X = flatS.index_select(1, self.iX).view(K, P, s, s)
        self.C = flatS.index_select(1, self.iC).view(K, P, s, m)
        if check_pivots:  # the Gaussian engine's factorization, whose refusal starts its jitter rescue
            self.L = cholesky(X, "context covariance S_RR", site)
        else:  # a mixture's, as on its path for masks shared by the batch
            self.L = torch.linalg.cholesky(X)
        self.B0 = torch.linalg.solve_triangular(self.L, self.C, upper=False)
        # the column norms in one pass over B0 (pow and sum make two); 1 at the padding
        self.v = flatS.index_select(1, self.M.view(-1) * (E + 1)).view(K, P, m) - torch.linalg.vector_norm(
            self.B0, dim=-2).square()
        self.rR = rp.gather(-1, self.R.expand(K, -1, -1))  # (K, P, s), 0 at the padding
        self.alpha = torch.cholesky_solve(self.rR.unsqueeze(-1), self.L).squeeze(-1)
        rM = rp.gather(-1, self.M.expand(K, -1, -1))
        self.d = rM - (self.alpha.unsqueeze(-2) @ self.C).squeeze(-2)  # (K, P, m), 0 at the padding

    #: what the backward pass reads; a chunk kept by the forward pass keeps these
    KEPT = ("R", "M", "L", "B0", "alpha", "d", "v")

    def _flat_indices(self, D):
        # positions in the flattened padded table: one index_select per block (and its
        # gradient one index_add_), where broadcast advanced indexing is several times slower
        E = 3 * D
        self.iX = (self.R.unsqueeze(-1) * E + self.R.unsqueeze(-2)).view(-1)
        self.iC = (self.R.unsqueeze(-1) * E + self.M.unsqueeze(-2)).view(-1)

    def kept(self):
        """The tensors of :attr:`KEPT`, for :meth:`restored`."""
        return tuple(getattr(self, k) for k in self.KEPT)

    @classmethod
    def restored(cls, tensors, D):
        """The pieces of a chunk from its :meth:`kept` tensors, for the backward pass."""
        pc = cls.__new__(cls)
        for k, t in zip(cls.KEPT, tensors):
            setattr(pc, k, t)
        pc._flat_indices(D)
        return pc

    @staticmethod
    def numel(K, P, s, m):
        """Elements of a chunk's kept floating-point tables."""
        return K * P * (s * s + s * m + s + 2 * m)

    def _scatter(self, index, values, D):
        """``(K, P, D)`` with ``values`` ``(K, P, w)`` added at ``index`` ``(P, w)``, the padding dropped."""
        out = values.new_zeros(values.shape[:-1] + (3 * D,))
        return out.scatter_add_(-1, index.expand(values.shape[0], -1, -1), values)[..., :D]

    def log_conditionals(self, D):
        """``(K, P, D)``: the targets' log-conditionals, 0 at the context."""
        logc = -0.5 * (LOG_2PI + self.v.log() + self.d * self.d / self.v)
        return self._scatter(self.M, logc, D)

    def log_context(self):
        r"""``(K, P)``: :math:`\log\mathcal N(r_{\mathcal R}; 0, X)`."""
        logdet = 2 * torch.diagonal(self.L, dim1=-2, dim2=-1).log().sum(-1)  # the padding adds 0
        return -0.5 * ((self.rR * self.alpha).sum(-1) + logdet + self.nR * LOG_2PI)

    def backward(self, gcp, gR, G):
        r"""One chunk's gradient: adds :math:`\bar\Sigma`'s terms, before symmetrization, to
        ``G`` (``(K, 9 D^2)``, the padding's rows and columns discarded by the caller),
        returns :math:`\bar r` ``(K, P, D)``.

        :param gcp: the upstream gradient of the log-conditionals ``(K, P, 3 D)``, 0 at
            the padding. :param gR: that of :math:`\log p(x_{\mathcal R})` ``(K, P)``, or None."""
        K, D = gcp.shape[0], gcp.shape[-1] // 3
        gc = gcp.gather(-1, self.M.expand(K, -1, -1))
        gd = -gc * self.d / self.v
        gv = (-0.5 * gc) * (1 - self.d * self.d / self.v) / self.v
        B = torch.linalg.solve_triangular(self.L.transpose(-1, -2), self.B0, upper=True)  # X^-1 S_RM
        u = (B @ gd.unsqueeze(-1)).squeeze(-1)  # (K, P, s)
        Bv = B * gv.unsqueeze(-2)
        gC = -2 * Bv - self.alpha.unsqueeze(-1) * gd.unsqueeze(-2)
        gX = Bv @ B.transpose(-1, -2) + u.unsqueeze(-1) * self.alpha.unsqueeze(-2)
        gRr = -u
        if gR is not None:
            # log N(r_R; 0, X): r_R's gradient -X^-1 r_R = -alpha, X's (alpha alpha^T - X^-1) / 2
            gRr = gRr - gR.unsqueeze(-1) * self.alpha
            # X^-1 = W^T W with W = L^-1: a triangular solve and a batched product take half the
            # time of LAPACK's per-matrix cholesky_inverse at these sizes
            W = tril_inverse(self.L)
            gX = gX - (0.5 * gR)[..., None, None] * (W.transpose(-1, -2) @ W)
            gX = gX + (0.5 * gR.unsqueeze(-1) * self.alpha).unsqueeze(-1) * self.alpha.unsqueeze(-2)
        E = 3 * D
        G.index_add_(1, self.iX, gX.reshape(K, -1))
        G.index_add_(1, self.iC, gC.reshape(K, -1))
        G.index_add_(1, self.M.view(-1) * (E + 1), gv.reshape(K, -1))
        return self._scatter(self.M, gd, D) + self._scatter(self.R, gRr, D)


def _restored(tensors, flags, D):
    """The chunks' :class:`_Pieces` the forward pass kept, or None (recompute), in order."""
    return KeptChunks.restore(tensors, flags, len(_Pieces.KEPT), lambda kept: _Pieces.restored(kept, D))


class DenseIndependentSums(torch.autograd.Function):
    r"""The summed log-conditionals of dense masks drawn per datapoint, ``(q, n)``, with
    the backward pass written out (see the module docstring for the formulas).

    :param S: ``(D, D)``, symmetric positive definite. :param x: ``(n, D)``.
    :param loc: :math:`\mu`, ``(1|n, D)``. :param mask: bool ``(q, n, D)``, kept as
        bits (:func:`~pyro_mpt.mask_bits.pack_bits`) for the backward pass.
    :param int max_elements: elements of a chunk's ``(pairs, s, s + m)`` tables.
    :param str site: for error messages.
    :param observed: ``(n, D)``, 1 at an observed token and 0 at a missing one (hidden
        but not summed), in ``S``'s dtype, or None.
    :param int min_targets: the pairs with fewer targets are left to another route (their
        sums 0 here).
    :param bits: ``pack_bits(mask)`` where the caller has it (shared with another route's
        Function, so that a block of masks keeps its bits once), or None.
    :param int keep_elements: elements of the chunks' tables kept for the backward pass,
        the largest contexts first (the rest is recomputed there); 0: none.
    :returns: ``(q, n)``.

    Example::

        >>> sums = DenseIndependentSums.apply(cov, x, loc, mask, 2**24, "x")  # mask (q, n, D)
        >>> sums.sum().backward()   # gradients of cov, x and loc; the chunks are recomputed
    """

    @staticmethod
    def forward(ctx, S, x, loc, mask, max_elements, site, observed=None, min_targets=0, bits=None, keep_elements=0):
        """``(q, n)``."""
        q, n, D = mask.shape
        r = x - loc
        flat = mask.reshape(q * n, D)
        out = S.new_zeros(q * n)
        rows = torch.arange(q * n, device=r.device) % n
        Sp, rp = padded_tokens(S[None], r[None])
        keep = KeptChunks(keep_elements if any(ctx.needs_input_grad[:3]) else 0)
        for sl, s, m in _chunks_from(flat, min_targets, S.element_size(), max_elements, S.device):
            pc = _Pieces(Sp, rp[:, rows[sl]], ~flat[sl], s, m, site)
            logc = pc.log_conditionals(D)[0]
            out[sl] = (logc if observed is None else logc * observed[rows[sl]]).sum(-1)
            keep.offer(pc.kept(), _Pieces.numel(1, len(sl), s, m))
        ctx.observed = observed
        # x and loc rather than r: they are shared by every block of masks, r would be one more
        # (n, D) table kept per block (the engine's blocks are not checkpointed: each keeps only
        # this and what keep_elements allows, and its other chunks are recomputed)
        ctx.save_for_backward(S, x, loc, pack_bits(mask) if bits is None else bits, *keep.tensors)
        ctx.kept = keep.flags
        ctx.max_elements, ctx.site, ctx.num_tokens, ctx.min_targets = max_elements, site, D, min_targets
        return out.view(q, n)

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of ``S``, ``x`` and ``loc``."""
        S, x, loc, bits = ctx.saved_tensors[:4]
        kept = _restored(ctx.saved_tensors[4:], ctx.kept, ctx.num_tokens)
        mask = unpack_bits(bits, ctx.num_tokens)
        q, n, D = mask.shape
        r = x - loc
        flat, gflat = mask.reshape(q * n, D), g.reshape(q * n, 1)
        rows = torch.arange(q * n, device=r.device) % n
        gr = torch.zeros_like(r)
        Sp, rp = padded_tokens(S[None], r[None])
        G = torch.zeros_like(Sp).view(1, -1)  # S's gradient before symmetrization, padded
        for sl, s, m in _chunks_from(flat, ctx.min_targets, S.element_size(), ctx.max_elements, S.device):
            pc = next(kept) or _Pieces(Sp, rp[:, rows[sl]], ~flat[sl], s, m, ctx.site)
            gc = gflat[sl].expand(-1, D) if ctx.observed is None else gflat[sl] * ctx.observed[rows[sl]]
            gr.index_add_(0, rows[sl], pc.backward(torch.nn.functional.pad(gc, (0, 2 * D))[None], None, G)[0])
        G = G.view(3 * D, 3 * D)[:D, :D]
        gS = 0.5 * (G + G.T)
        gloc = (-gr).sum_to_size(loc.shape) if ctx.needs_input_grad[2] else None
        return gS, gr if ctx.needs_input_grad[1] else None, gloc, None, None, None, None, None, None, None


def _chunks_from(flat, min_targets, itemsize, max_elements, device):
    """:func:`_sorted_chunks` of the pairs of ``flat`` ``(P, D)`` (True at a target) with at
    least ``min_targets`` targets, their indices into ``flat``, the largest contexts first
    (:func:`costliest_first`)."""
    selected = flat.sum(-1) >= min_targets if min_targets > 0 else None
    return costliest_first(lambda pairs: _sorted_chunks(~pairs, itemsize, max_elements, device), flat, selected)


def costliest_first(chunks, flat, selected=None):
    """The chunks ``chunks(pairs)`` of the pairs ``flat`` ``(P, ...)``, or of those where
    ``selected``, with their indices into ``flat``, in reverse order: a chunker that sorts the
    pairs by cost (:func:`sorted_spans`) so gives the costliest first, which a budget of
    kept chunks (:class:`~pyro_mpt.conditionals.written_backward.KeptChunks`) keeps, as
    those the backward pass would take longest to compute again.

    :param callable chunks: ``chunks(pairs)`` -> ``(indices, *sizes)`` per chunk, indices
        into ``pairs``.
    :param torch.Tensor flat: the pairs.
    :param torch.Tensor selected: bool ``(P,)``, or None (every pair).
    :returns: an iterator of ``(indices into flat, *sizes)``.

    Example::

        >>> for pairs, s, m in costliest_first(chunker, flat, flat.sum(-1) >= 3):
        ...     ...   # the pairs of 3 targets or more, the most costly chunk first
    """
    sel = None if selected is None else selected.nonzero().squeeze(-1)
    for pairs, *sizes in reversed(list(chunks(flat if sel is None else flat[sel]))):
        yield (pairs if sel is None else sel[pairs], *sizes)


class DenseContextConditionals(torch.autograd.Function):
    r"""Per-token log-conditionals and context log-densities of Gaussian components for
    contexts drawn per datapoint, with the backward pass written out: for component
    :math:`k`, query :math:`q` and datapoint :math:`i` with context :math:`\mathcal R`,
    :math:`\log\mathcal N_k(x_{ij}\mid x_{i\mathcal R})` at the targets (0 at the
    context) and :math:`\log\mathcal N(x_{i\mathcal R}; \mu_{k\mathcal R},
    \Sigma_{k\mathcal R\mathcal R})`, what a mixture of Gaussians combines
    (:class:`~pyro_mpt.conditionals.gaussian_mixture.GaussianMixtureTable`). The
    gradients are those of :class:`DenseIndependentSums` with a weight per token, and of
    the context density :math:`\bar r_{\mathcal R} = -\bar\ell\,\alpha`,
    :math:`\bar\Sigma_{\mathcal R\mathcal R} = \tfrac{\bar\ell}2(\alpha\alpha^\top - X^{-1})`.

    :param S: ``(K, D, D)``, the components' covariances. :param x: ``(n, D)``.
    :param loc: ``(K, n|1, D)``. :param context: bool ``(q, n, D)``, kept as bits.
    :param int max_elements: elements of a chunk's ``(pairs, s, s + m)`` tables.
    :param str site: for error messages.
    :param int keep_elements: elements of the chunks' tables kept for the backward pass
        (the rest is recomputed there); 0: none.
    :returns: ``(q, K, n, D)`` and ``(q, K, n)``.

    Example::

        >>> log_c, log_ctx = DenseContextConditionals.apply(covs, x, locs, context, 2**24, "x", 2**22)
    """

    @staticmethod
    def forward(ctx, S, x, loc, context, max_elements, site, keep_elements=0):
        """``(log_c, log_ctx)``."""
        q, n, D = context.shape
        K = S.shape[0]
        flat = ~context.reshape(q * n, D)
        rows = torch.arange(q * n, device=x.device) % n
        log_c, log_ctx = S.new_empty(K, q * n, D), S.new_empty(K, q * n)
        Sp, rp = padded_tokens(S, x - loc)  # (K, n, 3 D)
        keep = KeptChunks(keep_elements if any(ctx.needs_input_grad[:3]) else 0)
        for sl, s, m in _sorted_chunks(~flat, K * S.element_size(), max_elements // K, S.device):
            pc = _Pieces(Sp, rp[:, rows[sl]], ~flat[sl], s, m, site, check_pivots=False)
            log_c[:, sl], log_ctx[:, sl] = pc.log_conditionals(D), pc.log_context()
            keep.offer(pc.kept(), _Pieces.numel(K, len(sl), s, m))
        ctx.save_for_backward(S, x, loc, pack_bits(context), *keep.tensors)
        ctx.kept = keep.flags
        ctx.max_elements, ctx.site, ctx.num_tokens = max_elements, site, D
        return log_c.view(K, q, n, D).transpose(0, 1), log_ctx.view(K, q, n).transpose(0, 1)

    @staticmethod
    @first_order_backward
    def backward(ctx, gc, gR):
        """The gradients of ``S``, ``x`` and ``loc``."""
        S, x, loc, bits = ctx.saved_tensors[:4]
        kept = _restored(ctx.saved_tensors[4:], ctx.kept, ctx.num_tokens)
        context = unpack_bits(bits, ctx.num_tokens)
        q, n, D = context.shape
        flat = ~context.reshape(q * n, D)
        rows = torch.arange(q * n, device=x.device) % n
        K = S.shape[0]
        gc = gc.transpose(0, 1).reshape(K, q * n, D)
        gR = gR.transpose(0, 1).reshape(K, q * n)
        Sp, rp = padded_tokens(S, x - loc)  # (K, n, 3 D)
        gr = torch.zeros_like(rp[..., :D])
        G = torch.zeros_like(Sp).view(K, -1)  # S's gradient before symmetrization, padded
        gc = torch.nn.functional.pad(gc, (0, 2 * D))
        for sl, s, m in _sorted_chunks(~flat, K * S.element_size(), ctx.max_elements // K, S.device):
            pc = next(kept) or _Pieces(Sp, rp[:, rows[sl]], ~flat[sl], s, m, ctx.site, check_pivots=False)
            gr.index_add_(1, rows[sl], pc.backward(gc[:, sl], gR[:, sl], G))
        G = G.view(K, 3 * D, 3 * D)[:, :D, :D]
        gS = 0.5 * (G + G.transpose(-1, -2))
        gloc = (-gr).sum_to_size(loc.shape) if ctx.needs_input_grad[2] else None
        return gS, gr.sum(0), gloc, None, None, None, None
