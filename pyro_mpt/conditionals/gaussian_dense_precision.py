r"""Per-datapoint conditionals through the precision, for the (mask, datapoint) pairs
with fewer targets than context tokens: a Gaussian mixture's components'
(:func:`dense_context_conditionals`) and a single Gaussian's summed conditionals
(:func:`routed_dense_sums`, the Gaussian engine's path for dense masks drawn per datapoint).

:class:`~pyro_mpt.conditionals.gaussian_dense_independent.DenseContextConditionals`
factors each pair's context block :math:`\Sigma_{\mathcal R\mathcal R}` (``s x s``).
With :math:`\Lambda = \Sigma^{-1}` (one factorization per component, shared by the
batch) and :math:`y = \Lambda r`, :math:`r = x - \mu`, the targets given the context
have precision :math:`\Lambda_{\mathcal M\mathcal M}` and residual from their
conditional mean :math:`d = \Lambda_{\mathcal M\mathcal M}^{-1} y_{\mathcal M}`, so

.. math::

    \log p(x_j\mid x_{\mathcal R}) = -\tfrac12\Big[\log 2\pi v_j + \frac{d_j^2}{v_j}\Big],
    \quad v_j = (\Lambda_{\mathcal M\mathcal M}^{-1})_{jj},\qquad
    \log p(x_{\mathcal R}) = \log p(x) - \log p(x_{\mathcal M}\mid x_{\mathcal R}),

with :math:`\log p(x_{\mathcal M}\mid x_{\mathcal R}) = -\tfrac12[m\log 2\pi -
\log|\Lambda_{\mathcal M\mathcal M}| + y_{\mathcal M}^\top d]`: one ``m x m``
factorization a pair instead of ``s x s`` and ``s x m`` solves. With sizes uniform on
``0..D`` half the pairs have ``m < s``. :class:`PrecisionTargetConditionals` writes the
backward pass out: with :math:`P = \Lambda_{\mathcal M\mathcal M}^{-1}`, the upstream
gradients :math:`\bar d, \bar v` of the residuals and variances (as in
:mod:`~pyro_mpt.conditionals.gaussian_dense_independent`), :math:`h` that of
:math:`\log p(x_{\mathcal M}\mid x_{\mathcal R})` and :math:`u = P\bar d`,

.. math::

    \bar\Lambda_{\mathcal M\mathcal M} = -u d^\top - P\operatorname{diag}(\bar v)P
    + \tfrac h2(P + dd^\top),\qquad \bar y_{\mathcal M} = u - h d.

:math:`\Lambda` and :math:`y` reach :math:`\Sigma`, :math:`x` and :math:`\mu` by autograd
(``K`` factorizations of ``D x D``). Where a component is ill-conditioned the precision
loses digits that the context route keeps: :func:`dense_context_conditionals` and
:func:`routed_dense_sums` take this route only while every component's condition number
is within :data:`MAX_CONDITION` of the dtype's precision.
"""

import torch

from ..recompute import not_recomputed, recomputing
from ..mask_bits import pack_bits, unpack_bits
from .gaussian_dense_independent import (
    DenseContextConditionals, DenseIndependentSums, costliest_first, padded_tokens, sorted_spans,
)
from .gaussian_linalg import LOG_2PI, tril_inverse
from .written_backward import KeptChunks, first_order_backward

__all__ = [
    "MAX_CONDITION", "PrecisionTargetConditionals", "PrecisionTargetSums", "dense_context_conditionals",
    "precision_route_fits", "routed_dense_sums",
]

#: the largest ``cond * eps`` (of a component's correlation matrix; ``eps`` the dtype's)
#: for which a mixture takes the precision route: in float32 a condition number up to
#: about 8e3. Conservative: measured against float64 on components of condition number
#: 1e1..1e6 (spread eigenvalues, a few tiny ones, tokens of scales 1e-3..1e3), the two
#: routes' float32 errors were within 1-3x of each other
MAX_CONDITION = 1e-3


def _target_chunks(target, itemsize, max_elements, device):
    """``(pairs, m)``: chunks of the pairs sorted by target count, each within
    ``max_elements`` (on the CPU also ``CHUNK_BYTES``) of its ``(pairs, m, m)`` tables."""
    spans = sorted_spans(target.sum(-1), lambda count, lo, hi: count * max(1, hi) ** 2, itemsize, max_elements, device)
    for pairs, lo, hi in spans:
        yield pairs, max(1, hi)


class _TargetPieces:
    r"""A chunk's target blocks for every component: the token indices ``M`` (padding
    tokens ``D + a`` past each pair's targets: precision 1, uncorrelated, ``y`` 0), the
    inverses ``W`` of the blocks' Cholesky factors (:math:`P = W^\top W`), the residuals
    ``d`` and variances ``v`` (1 and 0 at the padding).

    ``W`` rather than ``P``: the variances are ``W``'s column norms, so a forward pass
    whose chunks the backward pass recomputes never forms ``P`` (an ``m^3`` product)."""

    #: what the backward pass reads; a chunk kept by the forward pass keeps these
    KEPT = ("M", "W", "d", "v")

    def __init__(self, Lp, yp, target, m):
        K, D = Lp.shape[0], target.shape[-1]
        E = Lp.shape[-1]
        nM = target.sum(-1, keepdim=True)
        pos = torch.arange(m, device=yp.device)
        M = torch.sort((~target).to(torch.uint8), dim=-1, stable=True).indices[:, :m]
        self.M = torch.where(pos < nM, M, D + pos)
        A = Lp.view(K, E * E).index_select(1, self._iMM(E)).view(K, -1, m, m)
        L = torch.linalg.cholesky(A)
        self.W = tril_inverse(L)
        self.v = self.W.square().sum(-2)
        yM = yp.gather(-1, self.M.expand(K, -1, -1))
        self.d = torch.cholesky_solve(yM.unsqueeze(-1), L).squeeze(-1)
        logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)  # of Lambda_MM; the padding adds 0
        self.log_targets = -0.5 * (nM.squeeze(-1).to(A.dtype) * LOG_2PI - logdet + (yM * self.d).sum(-1))

    def kept(self):
        """The tensors of :attr:`KEPT`, for :meth:`restored`."""
        return tuple(getattr(self, k) for k in self.KEPT)

    @classmethod
    def restored(cls, tensors):
        """The pieces of a chunk from its :meth:`kept` tensors, for the backward pass."""
        pc = cls.__new__(cls)
        for k, t in zip(cls.KEPT, tensors):
            setattr(pc, k, t)
        return pc

    @staticmethod
    def numel(K, P, m):
        """Elements of a chunk's kept floating-point tables."""
        return K * P * (m * m + 2 * m)

    def _iMM(self, E):
        return (self.M.unsqueeze(-1) * E + self.M.unsqueeze(-2)).view(-1)

    def scatter(self, values, D):
        """``(K, P, D)`` with ``values`` ``(K, P, m)`` at the targets, the padding dropped."""
        out = values.new_zeros(values.shape[:-1] + (3 * D,))
        return out.scatter_add_(-1, self.M.expand(values.shape[0], -1, -1), values)[..., :D]

    def at_targets(self, table):
        """``(K, P, m)``: the entries of ``table`` ``(K, P, 3 D)`` at the pairs' target
        positions (the padding's entries where ``table`` has them)."""
        return table.gather(-1, self.M.expand(table.shape[0], -1, -1))

    def log_terms(self):
        r"""``(K, P, m)``: the targets' log-conditionals (:math:`-\tfrac12\log 2\pi` at the padding)."""
        return -0.5 * (LOG_2PI + self.v.log() + self.d * self.d / self.v)

    def log_conditionals(self, D):
        return self.scatter(self.log_terms(), D)

    def backward(self, gc, h, G, D):
        r"""Adds :math:`\bar\Lambda`'s terms to ``G`` ``(K, E^2)``; returns :math:`\bar y`
        ``(K, P, D)``. :param gc: the upstream gradient of the log-conditionals at the
        targets ``(K, P, m)``, 0 at the padding. :param h: that of :math:`\log p(x_{\mathcal M}
        \mid x_{\mathcal R})` ``(K, P)``, or None."""
        K = gc.shape[0]
        gd = -gc * self.d / self.v
        gv = (-0.5 * gc) * (1 - self.d * self.d / self.v) / self.v
        P = self.W.transpose(-1, -2) @ self.W
        u = (P @ gd.unsqueeze(-1)).squeeze(-1)
        if h is None:
            gA = -u.unsqueeze(-1) * self.d.unsqueeze(-2) - (P * gv.unsqueeze(-2)) @ P
            gy = u
        else:
            hd = h.unsqueeze(-1) * self.d
            gA = (0.5 * hd - u).unsqueeze(-1) * self.d.unsqueeze(-2) - (P * gv.unsqueeze(-2)) @ P
            gA = gA + (0.5 * h)[..., None, None] * P
            gy = u - hd
        G.index_add_(1, self._iMM(3 * D), gA.reshape(K, -1))
        return self.scatter(gy, D)


class PrecisionTargetConditionals(torch.autograd.Function):
    r"""Per-token log-conditionals and :math:`\log p(x_{\mathcal M}\mid x_{\mathcal R})`
    of Gaussian components from their precisions, for (mask, datapoint) pairs, with the
    backward pass written out (formulas in the module docstring).

    :param Lam: ``(K, D, D)``, the components' precisions :math:`\Lambda_k`.
    :param y: ``(K, n, D)``, :math:`\Lambda_k (x_i - \mu_k)` of the datapoints.
    :param rows: long ``(P,)``, each pair's datapoint.
    :param target: bool ``(P, D)``, True at a target token; kept as bits.
    :param int max_elements: elements of a chunk's ``(K, pairs, m, m)`` tables.
    :param int keep_elements: elements of the chunks' tables kept for the backward pass
        (the rest is recomputed there).
    :returns: ``(K, P, D)`` (0 at the context) and ``(K, P)``.

    Example::

        >>> log_c, log_t = PrecisionTargetConditionals.apply(Lam, y, rows, target, 2**24, 2**22)
    """

    @staticmethod
    def forward(ctx, Lam, y, rows, target, max_elements, keep_elements=0):
        """``(log_c, log_targets)``."""
        (K, _, D), P = y.shape, target.shape[0]
        Lp, yp = padded_tokens(Lam, y)
        log_c, log_t = y.new_empty(K, P, D), y.new_empty(K, P)
        keep = KeptChunks(keep_elements if any(ctx.needs_input_grad[:2]) else 0)
        for sl, m in _target_chunks(target, K * y.element_size(), max_elements // K, y.device):
            pc = _TargetPieces(Lp, yp[:, rows[sl]], target[sl], m)
            log_c[:, sl], log_t[:, sl] = pc.log_conditionals(D), pc.log_targets
            keep.offer(pc.kept(), _TargetPieces.numel(K, len(sl), m))
        ctx.save_for_backward(Lam, y, rows, pack_bits(target), *keep.tensors)
        ctx.flags, ctx.max_elements, ctx.num_tokens = keep.flags, max_elements, D
        return log_c, log_t

    @staticmethod
    @first_order_backward
    def backward(ctx, gc, gt):
        """The gradients of ``Lam`` and ``y``."""
        Lam, y, rows, bits = ctx.saved_tensors[:4]
        kept = _restored(ctx.saved_tensors[4:], ctx.flags)
        D = ctx.num_tokens
        target = unpack_bits(bits, D)
        K = y.shape[0]
        Lp, yp = padded_tokens(Lam, y)
        G = torch.zeros_like(Lp).view(K, -1)
        gy = torch.zeros_like(y)
        gc = torch.nn.functional.pad(gc, (0, 2 * D))
        chunks = _target_chunks(target, K * y.element_size(), ctx.max_elements // K, y.device)
        for sl, m in chunks:
            pc = next(kept) or _TargetPieces(Lp, yp[:, rows[sl]], target[sl], m)
            gy.index_add_(1, rows[sl], pc.backward(pc.at_targets(gc[:, sl]), gt[:, sl], G, D))
        G = G.view(K, 3 * D, 3 * D)[:, :D, :D]
        return 0.5 * (G + G.transpose(-1, -2)), gy, None, None, None, None


class PrecisionTargetSums(torch.autograd.Function):
    r"""The summed log-conditionals :math:`\sum_{j\in\mathcal M} w_j\log p(x_j\mid
    x_{\mathcal R})` of dense masks drawn per datapoint from one Gaussian's precision, for
    the (mask, datapoint) pairs of at most ``max_targets`` targets (the others' sums 0),
    with the backward pass written out: that of :class:`PrecisionTargetConditionals` with
    :math:`h = 0` and :math:`\bar c_j = g\,w_j`, where :math:`w_j` is 1 at an observed
    target and 0 at a missing one.

    :param Lam: ``(D, D)``, the precision :math:`\Lambda`. :param y: ``(n, D)``,
        :math:`\Lambda (x_i - \mu_i)`.
    :param mask: bool ``(q, n, D)``, True at a target token; kept as bits.
    :param int max_elements: elements of a chunk's ``(pairs, m, m)`` tables.
    :param observed: ``(n, D)``, 1 at an observed token and 0 at a missing one, in
        ``Lam``'s dtype, or None (every token observed).
    :param int max_targets: the pairs with more targets are left to another route.
    :param bits: ``pack_bits(mask)`` where the caller has it (shared with another route's
        Function), or None.
    :param int keep_elements: elements of the chunks' tables kept for the backward pass,
        the largest target sets first (the rest is recomputed there); 0: none.
    :returns: ``(q, n)``.

    Example::

        >>> sums = PrecisionTargetSums.apply(Lam, y, mask, 2**24, None, D // 2)   # (q, n)
        >>> sums.sum().backward()   # the chunks are recomputed
    """

    @staticmethod
    def forward(ctx, Lam, y, mask, max_elements, observed=None, max_targets=None, bits=None, keep_elements=0):
        """``(q, n)``."""
        q, n, D = mask.shape
        flat = mask.reshape(q * n, D)
        rows = torch.arange(q * n, device=y.device) % n
        Lp, yp = padded_tokens(Lam[None], y[None])
        out = y.new_zeros(q * n)
        keep = KeptChunks(keep_elements if any(ctx.needs_input_grad[:2]) else 0)
        for sl, m in _few_target_chunks(flat, max_targets, y.element_size(), max_elements, y.device):
            pc = _TargetPieces(Lp, yp[:, rows[sl]], flat[sl], m)
            out[sl] = (pc.log_terms()[0] * _target_weights(pc, observed, rows[sl], D)).sum(-1)
            keep.offer(pc.kept(), _TargetPieces.numel(1, len(sl), m))
        ctx.observed = observed
        ctx.save_for_backward(Lam, y, pack_bits(mask) if bits is None else bits, *keep.tensors)
        ctx.flags, ctx.max_elements, ctx.max_targets = keep.flags, max_elements, max_targets
        return out.view(q, n)

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of ``Lam`` and ``y``."""
        Lam, y, bits = ctx.saved_tensors[:3]
        kept = _restored(ctx.saved_tensors[3:], ctx.flags)
        D = Lam.shape[-1]
        mask = unpack_bits(bits, D)
        q, n, _ = mask.shape
        flat, g = mask.reshape(q * n, D), g.reshape(q * n)
        rows = torch.arange(q * n, device=y.device) % n
        Lp, yp = padded_tokens(Lam[None], y[None])
        G = torch.zeros_like(Lp).view(1, -1)
        gy = torch.zeros_like(y)
        chunks = _few_target_chunks(flat, ctx.max_targets, y.element_size(), ctx.max_elements, y.device)
        for sl, m in chunks:
            pc = next(kept) or _TargetPieces(Lp, yp[:, rows[sl]], flat[sl], m)
            gc = g[sl].unsqueeze(-1) * _target_weights(pc, ctx.observed, rows[sl], D)
            gy.index_add_(0, rows[sl], pc.backward(gc[None], None, G, D)[0])
        G = G.view(3 * D, 3 * D)[:D, :D]
        return 0.5 * (G + G.T), gy, None, None, None, None, None, None


def _restored(tensors, flags):
    """The chunks' :class:`_TargetPieces` the forward pass kept, or None (recompute), in order."""
    return KeptChunks.restore(tensors, flags, len(_TargetPieces.KEPT), _TargetPieces.restored)


def _few_target_chunks(flat, max_targets, itemsize, max_elements, device):
    """:func:`_target_chunks` of the pairs of ``flat`` ``(P, D)`` with at most
    ``max_targets`` targets (all where None), their indices into ``flat``, the largest
    target sets first (:func:`~pyro_mpt.conditionals.gaussian_dense_independent.costliest_first`)."""
    selected = None if max_targets is None else flat.sum(-1) <= max_targets
    return costliest_first(lambda pairs: _target_chunks(pairs, itemsize, max_elements, device), flat, selected)


def _target_weights(pc, observed, rows, D):
    """``(P, m)``: 1 at a chunk's observed targets, 0 at missing ones and at the padding."""
    if observed is None:
        return (pc.M < D).to(pc.d.dtype)
    return torch.nn.functional.pad(observed[rows], (0, 2 * D)).gather(-1, pc.M)


def precision_route_fits(S):
    """Whether every component's correlation matrix has its condition number within
    :data:`MAX_CONDITION` of ``S``'s dtype. The correlation's, not the covariance's: the
    factorizations' rounding does not grow with the tokens' scales (a covariance of
    tokens of scales 1e-2..1e2 has a condition number of 1e8, its correlation one of 10).

    :param S: ``(K, D, D)``, the components' covariances.
    :returns: bool; False also where a component is not positive definite.

    Example::

        >>> precision_route_fits(torch.eye(3)[None])
        True
    """
    with torch.no_grad():
        scale = torch.diagonal(S, dim1=-2, dim2=-1).clamp_min(torch.finfo(S.dtype).tiny).rsqrt()
        e = torch.linalg.eigvalsh(scale.unsqueeze(-1) * S * scale.unsqueeze(-2))
        lo, hi = e[..., 0], e[..., -1]
        return bool((lo > 0).all() and (hi * torch.finfo(S.dtype).eps <= MAX_CONDITION * lo).all())


def dense_context_conditionals(S, x, loc, context, max_elements, site, keep_elements=0):
    r"""What :class:`~pyro_mpt.conditionals.gaussian_dense_independent.DenseContextConditionals`
    returns (``(q, K, n, D)`` log-conditionals, ``(q, K, n)`` context log-densities), with
    the pairs of fewer targets than context tokens taken through the components'
    precisions (:class:`PrecisionTargetConditionals`) where they are well-conditioned.

    :param S: ``(K, D, D)``. :param x: ``(n, D)``. :param loc: ``(K, n|1, D)``.
    :param context: bool ``(q, n, D)``. :param int max_elements: as the Function's.
    :param str site: for error messages. :param int keep_elements: kept for the backward
        pass, shared by the two routes.
    :returns: ``(q, K, n, D)`` and ``(q, K, n)``.

    Example::

        >>> log_c, log_ctx = dense_context_conditionals(covs, x, locs, context, 2**24, "x", 2**22)
    """
    q, n, D = context.shape
    K = S.shape[0]
    flat = context.reshape(q * n, D)
    nR = flat.sum(-1)
    prec = 2 * nR > D
    if not bool(prec.any()) or not precision_route_fits(S):
        return DenseContextConditionals.apply(S, x, loc, context, max_elements, site, keep_elements)
    ia, ib = (~prec).nonzero().squeeze(-1), prec.nonzero().squeeze(-1)
    parts_c, parts_r = [], []
    if len(ia):
        ra = ia % n
        la = loc if loc.shape[1] == 1 else loc[:, ra]
        c, r = DenseContextConditionals.apply(
            S, x[ra], la, flat[ia][None], max_elements, site, keep_elements - keep_elements // 2)
        parts_c.append(c[0])
        parts_r.append(r[0])
    rb = ib % n
    Lc = torch.linalg.cholesky(S)
    Lam = torch.cholesky_inverse(Lc)
    res = x - loc  # (K, n, D)
    yfull = res @ Lam
    log_x = -0.5 * ((res * yfull).sum(-1) + 2 * torch.diagonal(Lc, dim1=-2, dim2=-1).log().sum(-1)[:, None]
                    + D * LOG_2PI)  # (K, n)
    c, t = PrecisionTargetConditionals.apply(Lam, yfull, rb, ~flat[ib], max_elements, keep_elements // 2)
    parts_c.append(c)
    parts_r.append(log_x[:, rb] - t)
    inv = torch.empty_like(nR, dtype=torch.long)
    inv[torch.cat([ia, ib])] = torch.arange(q * n, device=inv.device)
    log_c = torch.cat(parts_c, 1).index_select(1, inv)
    log_r = torch.cat(parts_r, 1).index_select(1, inv)
    return log_c.view(K, q, n, D).transpose(0, 1), log_r.view(K, q, n).transpose(0, 1)


def routed_dense_sums(m, x, mask, max_elements, observed=None, kept=None, keep_elements=0):
    r""":math:`\sum_{j\in\mathcal M}\log p(x_j\mid x_{\mathcal R})` for dense masks drawn per
    datapoint, ``(q, n)``, the Gaussian engine's, with each (mask, datapoint) pair on its
    cheaper route: the pairs of fewer targets than context tokens through the precision
    :math:`\Lambda = \Sigma^{-1}` (:class:`PrecisionTargetSums`, an ``m x m``
    factorization a pair), the others through their context blocks
    (:class:`~pyro_mpt.conditionals.gaussian_dense_independent.DenseIndependentSums`,
    ``s x s``), where the covariance is well-conditioned (:func:`precision_route_fits`).
    With sizes uniform on ``0..D`` a pair's cubic term drops from :math:`E[s^3] = D^3/4`
    to :math:`E[\min(s, m)^3] = D^3/32`.

    :param m: the dense state, its covariance shared by the batch (``(1, D, D)``).
    :param torch.Tensor x: ``(n, D)``, in the state's dtype.
    :param torch.Tensor mask: bool ``(q, n, D)``, True at a target token.
    :param int max_elements: elements of a chunk's tables, on either route.
    :param torch.Tensor observed: bool ``(n, D)``, True at an observed token (the targets
        of ``mask`` outside it are hidden but not summed: missing tokens), or None.
    :param dict kept: where the route's check, :math:`\Lambda` and :math:`\Lambda(x - \mu)`
        live across the blocks of masks of one state and data (computed by the first
        block, with their autograd graph: the blocks' gradients meet there and reach
        :math:`\Sigma` once), or None (computed here).
    :param int keep_elements: elements of the chunks' tables that the first block of
        masks of ``kept`` keeps for the backward pass, shared by the two routes (the rest,
        and every later block's, recomputed there).
    :returns: ``(q, n)``.

    Example::

        >>> routed_dense_sums(state, x, mask, 2**24)   # (q, n)
    """
    S, loc = m.covariance[0], m.loc
    o = None if observed is None else observed.to(x.dtype)
    q, n, D = mask.shape
    # the switch m < s measured (one thread, loss + gradient): m < c s for c from 0.75 to 1.5 within
    # 5 % of it at D = 50 and D = 200, c = 0.5 or 2 slower by 10-20 % at D = 200
    few = (D - 1) // 2  # 2 m < D
    kept = {} if kept is None else kept
    # the first block of masks of a state keeps up to keep_elements of its chunks' tables for
    # the backward pass (the costliest first), later ones none: what is kept does not grow
    # with the number of blocks, and the default schedule's one block recomputes little (a
    # recomputed block keeps none: its second run must keep as its first did)
    keep = 0 if kept.get("kept_chunks") or recomputing() else keep_elements
    kept["kept_chunks"] = True
    if not bool((mask.sum(-1) <= few).any()):
        return DenseIndependentSums.apply(S, x, loc, mask, max_elements, m.site, o, 0, None, keep)
    key = ("precision", torch.is_grad_enabled())
    if key not in kept:
        kept[key] = None
        with not_recomputed():  # made once, for this block and every later one
            if precision_route_fits(S[None]):
                Lam = torch.cholesky_inverse(torch.linalg.cholesky(S))
                kept[key] = (Lam, (x - loc) @ Lam)
    if kept[key] is None:
        return DenseIndependentSums.apply(S, x, loc, mask, max_elements, m.site, o, 0, None, keep)
    Lam, y = kept[key]
    bits = pack_bits(mask)  # kept once by the two routes' Functions
    out = PrecisionTargetSums.apply(Lam, y, mask, max_elements, o, few, bits, keep // 2)
    if bool((mask.sum(-1) > few).any()):
        out = out + DenseIndependentSums.apply(
            S, x, loc, mask, max_elements, m.site, o, few + 1, bits, keep - keep // 2)
    return out
