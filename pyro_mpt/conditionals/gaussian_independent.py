r"""Summed low-rank conditionals for masks drawn per datapoint, in cache-sized chunks.

For :math:`\Sigma = FF^\top + \Psi` (rank :math:`K`), a mask with targets
:math:`\mathcal M` and context :math:`\mathcal R` of datapoint :math:`i` has
the latent precision :math:`\Lambda = I + F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}
= \Lambda_0 - F_{\mathcal M}^\top\Psi_{\mathcal M}^{-1}F_{\mathcal M}`
(:math:`\Lambda_0 = I + F^\top\Psi^{-1}F`) and, with the centred residuals
:math:`e_i = r_i - F\hat z_i` (:math:`\hat z_i` the full-data posterior mean,
so that :math:`F^\top\Psi^{-1}e_i = \hat z_i` up to rounding), the masked
residual of token :math:`j \in \mathcal M`

.. math::

    d_j = e_j + f_j^\top\Lambda^{-1}\big(\delta_i + F_{\mathcal M}^\top\Psi_{\mathcal M}^{-1}e_{\mathcal M}\big),
    \qquad \delta_i = \hat z_i - F^\top\Psi^{-1}e_i \approx 0,

exact for any :math:`\hat z_i`; the variance is
:math:`v_j = \psi_j + f_j^\top\Lambda^{-1}f_j`. So a (mask, datapoint) pair needs
only sums over its masked tokens (over its context instead where the targets
hold more than half of the signal :math:`\sum_j |f_j|^2/\psi_j`, so that
:math:`\Lambda` is never a small difference of large sums), matrix products
of the 0/1 mask table with :math:`K(K+1)/2 + K` per-token features, and per
masked token a few multiply-adds, a logarithm and a division.

:class:`IndependentLowRankSums` evaluates this over chunks of (mask, datapoint)
rows small enough to stay in the core's cache, and its backward pass
recomputes each chunk's tables instead of keeping them: the graph keeps the
mask-free inputs, the masks as bits and, where they take at most twice the
bytes of a row's bits (small K, :data:`KEPT_PIECES_BITS_RATIO`), each row's
small pieces (:math:`\Lambda^{-1}`, :math:`w`, :math:`u`: :math:`(K + 1)^2 + K`
numbers a row), nothing of size ``(q, n, D)`` in the working dtype (so
:func:`~pyro_mpt.estimate.mpt_estimate` need not checkpoint the block). Where
those pieces are kept, they are solved once for the whole block, and both
passes stream the block's tables through slices of :data:`STREAM_ELEMENTS`
tokens, small enough for the core's L2 cache (one thread, PPCA D = 512, K = 2,
N = 1000, float32, masks per datapoint ``"all"``: the engine's loss and gradient
3.3-3.4 s in chunks that each solve their rows, 2.6-2.7 s streamed).
"""

import torch

from ..mask_bits import pack_bits, unpack_bits
from .gaussian_linalg import LOG_2PI, SymmetricPacking, cholesky
from .workspace import Workspace
from .written_backward import first_order_backward

#: tokens of one chunk's (rows, D) tables: large enough that the Python overhead
#: of its few dozen kernels stays small against their work, small enough that
#: its four tables stay in cache
CHUNK_ELEMENTS = 2**19

#: tokens of one slice of the elementwise passes where a block's small pieces are
#: solved for all its rows at once (small K, where they are kept): a slice's few tables then
#: stay in the core's L2 cache (2 MB here), where a pass runs two to three times
#: faster than from L3, and a slice costs a dozen kernels, not the sixty of a chunk
#: that also solves its rows' precisions
STREAM_ELEMENTS = 2**17

#: the backward pass reads each row's small pieces kept by the forward pass (instead
#: of summing and inverting its precision again) when they take at most this many
#: times the bytes of the row's mask bits, which the graph keeps anyway
KEPT_PIECES_BITS_RATIO = 2


def lowrank_independent_sums(m, x, mask, data, observed=None):
    r"""Summed Woodbury log-conditionals for masks ``(q, n, D)`` drawn per datapoint, ``(q, n)``.

    :param m: the low-rank state, its loading and noise shared by the batch.
    :param torch.Tensor x: ``(n, D)``, in the state's dtype.
    :param torch.Tensor mask: bool ``(q, n, D)``, True at a token outside the context.
    :param dict data: the mask-free pieces of ``gaussian_shared.lowrank_shared_data``
        (``zhat`` ``(K, n)``, ``eT`` ``(D, n)``, ``Fp`` ``(D, K)``); this path's own
        mask-free pieces are added to it under ``"independent"``.
    :param torch.Tensor observed: bool ``(n, D)`` or None: the targets are the tokens
        of ``mask`` that are observed, the others (missing tokens) are neither context
        nor summed (the masked residuals are exact whatever their placeholder values);
        None: every token of ``mask`` is a target.
    :returns: ``(q, n)``, in the state's dtype.

    Example::

        >>> lowrank_independent_sums(state, x, mask, lowrank_shared_data(state, x))   # (q, n)
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, K), (D,)
    if "independent" not in data:
        # mask-free, kept with the data pieces: every block of masks shares them
        # (and the backward pass keeps one copy, not one per block)
        K = F.shape[-1]
        e = data["eT"].T.contiguous()  # (n, D), row-major like the mask tables
        ep = e / psi
        delta = data["zhat"].T - ep @ F  # (n, K), ~0: keeps the identity exact for any zhat
        phi = SymmetricPacking(K, F.dtype, F.device).features(F)  # (D, P)
        lam0 = torch.eye(K, dtype=F.dtype, device=F.device) + data["Fp"].T @ F
        data["independent"] = (e, ep, delta, F, psi, phi, phi / psi.unsqueeze(-1), lam0)
        # one set of scratch tables for every block's forward and backward passes (which
        # run one at a time): a block's fresh tables were faulted in page by page, and
        # freed between the blocks' kept pieces they fragmented the heap (peak RSS
        # 0.49 GB against 0.38 GB, PPCA D = 512, K = 2, N = 1000, float32, "all")
        data["independent_workspace"] = Workspace(F.dtype, F.device)
    o = None if observed is None else observed.to(F.dtype)
    sums = IndependentLowRankSums.apply(mask, *data["independent"], m.site, o, data["independent_workspace"])
    return -0.5 * sums


def _chunks(q, n, D, elements=None):
    """Slices ``(qs, ns)`` of the ``(q, n)`` rows, about ``elements`` (default
    :data:`CHUNK_ELEMENTS`) tokens each."""
    rows = max(1, (CHUNK_ELEMENTS if elements is None else elements) // D)
    if rows >= n:
        q_step = max(1, rows // n)
        for i in range(0, q, q_step):
            yield slice(i, min(q, i + q_step)), slice(0, n)
    else:
        for i in range(q):
            for j in range(0, n, rows):
                yield slice(i, i + 1), slice(j, min(n, j + rows))


class IndependentLowRankSums(torch.autograd.Function):
    r""":math:`\sum_{j\in\mathcal M}[\log 2\pi + \log v_j + d_j^2/v_j]` per (mask, datapoint),
    ``(q, n)``, with the backward pass written out (see the module docstring).

    With :math:`a_j = d_j / v_j` and upstream weight :math:`g`,
    :math:`\partial/\partial v_j = g(1/v_j - a_j^2)` and
    :math:`\partial/\partial d_j = 2 g a_j` on the targets; through
    :math:`v = \psi + \phi\,\mathrm{vec}(B)` (:math:`B = \Lambda^{-1}`),
    :math:`d = e + F u` (:math:`u = B w`, :math:`w = \delta + F_{\mathcal M}^\top
    \Psi_{\mathcal M}^{-1} e_{\mathcal M}`) and
    :math:`\partial\Lambda = -B\,(\partial B)\,B` these become matrix products
    of the chunk's tables with the per-token features. The chunk's tables live
    in the buffers of one :class:`~pyro_mpt.conditionals.workspace.Workspace`,
    reused by every chunk (four forward, five backward); the backward pass
    recomputes them from the masks, kept as bits. Where each row's ``B``, ``u``
    and ``w`` are as small as its bits (``_pieces_kept``), they are solved for
    the whole block at once from sums made in slices of :data:`STREAM_ELEMENTS`
    tokens (``_BlockPieces``) and kept for the backward pass, and both passes
    stream the block's tables in such slices; else each chunk solves its own
    rows, in the forward pass and again in the backward pass.

    Inputs: ``mask`` bool ``(q, n, D)``; ``e``, ``ep`` (:math:`e/\psi`) ``(n, D)``;
    ``delta`` ``(n, K)``; ``F`` ``(D, K)``; ``psi`` ``(D,)``; ``phi``
    (:math:`f_{ja}f_{jb}`, ``a <= b``) and ``phi_p`` (:math:`\phi/\psi`) ``(D, P)``;
    ``lam0`` ``(K, K)``; ``site`` (for errors); ``observed`` 0/1 ``(n, D)`` in the
    working dtype or None, the tokens of the mask that are summed (the others are
    only left out of the context); ``bufs`` the
    :class:`~pyro_mpt.conditionals.workspace.Workspace` both passes' tables are made in
    (kept for the backward pass; None: a fresh one).
    """

    @staticmethod
    def forward(ctx, mask, e, ep, delta, F, psi, phi, phi_p, lam0, site, observed=None, bufs=None):
        """The sums ``(q, n)``."""
        q, n, D = mask.shape
        factors = _Factors(F, psi, phi, phi_p)
        bufs = Workspace(e.dtype, e.device) if bufs is None else bufs
        ctx.site, ctx.D, ctx.bufs = site, D, bufs
        ctx.observed = observed
        if _pieces_kept(F.shape[-1], D, e.dtype):
            # each row's small pieces, solved for the whole block, kept for the backward pass
            out, pieces = _streamed_sums(mask, e, ep, delta, factors, lam0, site, observed, bufs)
            ctx.flips = pieces.flips
            # the masks as bits, an eighth of the bool table, for the backward pass
            bits = pack_bits(mask)
            ctx.save_for_backward(bits, e, ep, delta, F, psi, phi, phi_p, lam0, *pieces.tensors())
            return out
        out = e.new_empty(q, n)
        # the masks as bits, packed a chunk at a time, while the chunk's masks are in cache
        bits = torch.empty((q, n, -(-D // 8)), dtype=torch.uint8, device=mask.device)
        # buffers: 0 the targets, 1 and 2 the chunk's scratch, then v and d; 3 the terms
        for qs, ns in _chunks(q, n, D):
            bits[qs, ns] = pack_bits(mask[qs, ns])
            c = _Chunk(bufs, mask[qs, ns], ep[ns], delta[ns], factors, lam0, site)
            shape = c.t.shape
            v, d = c.residuals(bufs.take(1, shape), bufs.take(2, shape), e[ns], factors)
            terms = torch.log(v, out=bufs.take(3, shape))
            terms.addcdiv_(d.square_(), v).mul_(c.t)
            count = c.count
            if observed is not None:
                terms.mul_(observed[ns])
                count = (c.t * observed[ns]).sum(-1)
            # the constant log(2 pi) per target from the counts the chunk has made
            torch.add(terms.sum(-1), count, alpha=LOG_2PI, out=out[qs, ns])
        ctx.flips = None
        ctx.save_for_backward(bits, e, ep, delta, F, psi, phi, phi_p, lam0)
        return out

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of every input but the mask and the site."""
        bits, e, ep, delta, F, psi, phi, phi_p, lam0, *kept = ctx.saved_tensors
        D = ctx.D
        factors = _Factors(F, psi, phi, phi_p)
        de, dep, ddelta = torch.zeros_like(e), torch.zeros_like(ep), torch.zeros_like(delta)
        # the products with a table's transpose come out as (k, D): accumulated so
        grads = _Grads(de, dep, ddelta, torch.zeros_like(factors.FT), torch.zeros_like(factors.phi_psi),
                       torch.zeros_like(factors.phi_pT), torch.zeros_like(lam0))
        if kept:
            _streamed_backward(g, bits, D, e, ep, factors, kept, ctx.flips, ctx.observed, grads, ctx.bufs)
        else:
            _chunked_backward(g, bits, D, e, ep, delta, factors, lam0, ctx.site, ctx.observed, grads, ctx.bufs)
        P = phi.shape[-1]
        dF, dphi, dpsi, dphi_p = grads.FT.T, grads.phi_psi[:P].T, grads.phi_psi[P], grads.phi_pT.T
        return (None, de, dep, ddelta, dF, dpsi, dphi, dphi_p, grads.lam0, None, None, None)


class _Grads:
    """The backward pass's accumulators: ``de``, ``dep`` ``(n, D)``, ``ddelta`` ``(n, K)``
    and the transposed ``FT`` ``(K, D)``, ``phi_psi`` ``(P + 1, D)``, ``phi_pT`` ``(P, D)``,
    ``lam0`` ``(K, K)``."""

    def __init__(self, de, dep, ddelta, FT, phi_psi, phi_pT, lam0):
        self.de, self.dep, self.ddelta = de, dep, ddelta
        self.FT, self.phi_psi, self.phi_pT, self.lam0 = FT, phi_psi, phi_pT, lam0

    def add_targets(self, gr, ga, ns):
        """``de += 2 g t a`` for a slice's rows (``gr`` ``(qc, nc)``, ``ga`` ``(qc, nc, D)``)."""
        if ga.shape[0] == 1:
            self.de[ns].addcmul_(ga[0], gr[0].unsqueeze(-1), value=2.0)
        else:
            self.de[ns].add_((ga * gr.unsqueeze(-1)).sum(0), alpha=2.0)

    def add_weighted(self, t, z, dw2, bufs, ns, factors):
        """Through ``w = delta + z F``, ``z = t e / psi`` ``(qc, nc, D)``: ``dF += z^T dw``
        and ``dep += t (dw F^T)`` for a chunk's rows, ``dw2`` ``(rows, K)`` (``dw F^T`` in
        buffer 3)."""
        shape = t.shape
        rows, D = shape[0] * shape[1], shape[2]
        self.FT += _t_times(z.view(rows, D), dw2)
        dz = torch.mm(dw2, factors.FT, out=bufs.take(3, (rows, D))).view(shape)
        if shape[0] == 1:
            self.dep[ns].addcmul_(dz[0], t[0])
        else:
            self.dep[ns].add_(dz.mul_(t).sum(0))


def _chunk_gradients(ga, dv, tv_shape, gr, factors, grads, ns, Bp1, u):
    """The gradients from a slice's ``a`` and ``1/v - a^2`` tables (``t a``, ``t (1/v - a^2)``):
    into ``psi``, ``phi``, ``e`` and ``F`` directly, and the products with ``F`` and
    ``phi`` that the rows' small pieces take, ``(rows, K)`` and ``(rows, P)``, returned
    without the row weights."""
    qc, nc, D = tv_shape
    rows = qc * nc
    g2 = gr.reshape(rows, 1)
    dv2, ga2 = dv.view(rows, D), ga.view(rows, D)
    # psi and phi together: v = [Bp, 1] [phi^T; psi]
    grads.phi_psi += _t_times(dv2, g2 * Bp1)
    grads.add_targets(gr, ga, ns)
    grads.FT += _t_times(ga2, (2.0 * g2) * u.reshape(rows, -1))
    return _times(ga2, factors.FT), _times(dv2, factors.phiT)


def _target_tables(t, v, d, observed):
    """``t a`` (in ``d``) and ``t (1/v - a^2)`` (in ``v``), ``a = d / v``: dL/dd and dL/dv
    over the row weight ``g`` (half of dL/dd), in place."""
    tv = torch.div(t, v, out=v)  # t / v
    if observed is not None:
        tv.mul_(observed)  # the targets: t o / v ((t o)^2 = t o below)
    ga = d.mul_(tv)  # t a
    return ga, tv.addcmul_(ga, ga, value=-1.0)  # t (1/v - a^2) (t^2 = t)


def _pieces_gradients(B, w, flip, du, dvphi, factors, grads):
    """From the rows' ``dL/du`` and ``dL/dB`` parts (``du`` ``(..., K)``, ``dvphi`` the packed
    ``dL/dB`` ``(..., P)``, weighted), ``dw = B du`` and the packed ``dS`` ``(rows, P)``
    of each row's summed table (``+`` on flipped rows, ``-`` on the others); adds
    ``dlam0``."""
    lead = du.shape[:-1]
    dB = factors.unpacked(dvphi.reshape(-1, dvphi.shape[-1]), lead)  # (.., K, K)
    dB.add_(du.unsqueeze(-1) * w.unsqueeze(-2))
    dw = (B @ du.unsqueeze(-1)).squeeze(-1)
    dlam = B @ dB @ B
    dlam = (dlam + dlam.transpose(-1, -2)).mul_(-0.5)  # symmetric: -B dB B
    # Lambda = I + S(context) on flipped rows, lam0 - S(targets) on the others
    dS = factors.packed(dlam)
    rows = dS.shape[0]
    flips = int(flip.sum())
    if flips == 0:
        dS.neg_()
        grads.lam0 += dlam.sum(tuple(range(len(lead))))
    elif flips < rows:
        dS.mul_(torch.where(flip, 1.0, -1.0).to(dlam.dtype).view(rows, 1))
        grads.lam0 += (dlam * (~flip).to(dlam.dtype)[..., None, None]).sum(tuple(range(len(lead))))
    return dw, dS


def _chunked_backward(g, bits, D, e, ep, delta, factors, lam0, site, observed, grads, bufs):
    """The backward pass that remakes each chunk's small pieces (large K: not kept)."""
    q, n = g.shape
    K = factors.FT.shape[0]
    # buffers: 0 the targets, 1 the precision's table (while it differs from
    # them), 2 the weighted residuals t e / psi, 3 v, 4 d
    for qs, ns in _chunks(q, n, D):
        mask = unpack_bits(bits[qs, ns], D)
        c = _Chunk(bufs, mask, ep[ns], delta[ns], factors, lam0, site)
        shape = c.t.shape
        rows = shape[0] * shape[1]
        v, d = c.residuals(bufs.take(3, shape), bufs.take(4, shape), e[ns], factors)
        gr = g[qs, ns]
        ga, dv = _target_tables(c.t, v, d, None if observed is None else observed[ns])
        du, dvphi = _chunk_gradients(ga, dv, shape, gr, factors, grads, ns, c.Bp1, c.u)
        g2 = gr.reshape(rows, 1)
        dw, dS = _pieces_gradients(c.B, c.w, c.flip, (2.0 * g2 * du).view(c.u.shape), (g2 * dvphi).view(shape[:2] + (-1,)),
                                   factors, grads)
        grads.phi_pT += _t_times(c.tl.view(rows, D), dS)
        grads.ddelta[ns].add_(dw.sum(0))
        grads.add_weighted(c.t, c.z, dw.view(rows, K), bufs, ns, factors)


class _Slices:
    """The slices of a block's ``(q, n)`` rows that stream its elementwise passes, about
    :data:`STREAM_ELEMENTS` tokens each, as ranges ``r`` of the flattened ``q n`` rows
    (each slice is one: a single query's datapoints, or whole queries) with the
    datapoints ``ns`` they cover and their shape ``(qc, nc, D)``; and the workspace's
    buffers viewed at each slice shape, made once per shape (a slice costs a dozen
    kernels, and remaking the views cost a third of that)."""

    def __init__(self, q, n, D, bufs, names):
        self.items = []
        for qs, ns in _chunks(q, n, D, STREAM_ELEMENTS):
            qc, nc = qs.stop - qs.start, ns.stop - ns.start
            r = slice(qs.start * n + ns.start, qs.start * n + ns.start + qc * nc)
            self.items.append((r, ns, (qc, nc, D)))
        self.bufs, self.names, self._views = bufs, names, {}

    def views(self, shape):
        """The buffers ``names`` as ``shape`` tables and as their ``(rows, D)`` views (the
        first slice is the largest, so that no buffer grows after its views are made)."""
        views = self._views.get(shape)
        if views is None:
            tables = [self.bufs.take(name, shape) for name in self.names]
            views = self._views[shape] = tables + [x.view(-1, shape[-1]) for x in tables]
        return views


def _streamed_sums(mask, e, ep, delta, factors, lam0, site, observed, bufs):
    """The forward pass for kept pieces: the rows' sums over their targets in slices of
    :data:`STREAM_ELEMENTS` tokens, every row's small pieces solved at once
    (:class:`_BlockPieces`), then the terms in slices again. Returns the sums ``(q, n)``
    and the pieces."""
    q, n, D = mask.shape
    # buffers: 0 the targets, 1 the precision's table (then v), 2 z (then d), 3 the terms
    slices = _Slices(q, n, D, bufs, (0, 1, 2, 3))
    masks = mask.reshape(q * n, D)
    pieces = _BlockPieces(slices, masks, ep, delta, factors, lam0, site)
    out = e.new_empty(q * n)
    count = pieces.count if observed is None else e.new_empty(q * n)
    Bp1, u = pieces.Bp1.view(q * n, -1), pieces.u.view(q * n, -1)
    bytes_ = masks.view(torch.uint8)
    for r, ns, shape in slices.items:
        t, v, d, terms, t2, v2, d2, terms2 = slices.views(shape)
        t2.copy_(bytes_[r])
        _residuals(v2, d2, Bp1[r], u[r], e[ns], factors, shape)
        torch.log(v, out=terms)
        terms.addcdiv_(d.square_(), v).mul_(t)
        if observed is not None:
            terms.mul_(observed[ns])
            torch.sum(t.mul_(observed[ns]).view(-1, D), -1, out=count[r])
        torch.sum(terms2, -1, out=out[r])
    # the constant log(2 pi) per target from the counts
    return out.add_(count, alpha=LOG_2PI).view(q, n), pieces


def _streamed_backward(g, bits, D, e, ep, factors, kept, flips, observed, grads, bufs):
    """The backward pass with the rows' small pieces kept: the targets' tables in slices,
    the small pieces' gradients for every row at once, then the products with the
    targets and the summed tables in slices again."""
    B, u, w, Bp1, flip = kept
    q, n = g.shape
    K, P = factors.FT.shape[0], factors.phiT.shape[0]
    # the row weights in the small factors of the products
    gB = (Bp1 * g.unsqueeze(-1)).view(q * n, P + 1)
    g2u = (u * (2.0 * g).unsqueeze(-1)).view(q * n, K)
    # row-major by feature, so that each slice's product writes its columns (see _times)
    duT, dvphiT = e.new_empty(K, q * n), e.new_empty(P, q * n)
    # the block's masks, as its forward pass held them (a byte a token), read twice
    masks = unpack_bits(bits, D).view(q * n, D)
    # buffers: 0 the targets, 3 v, 4 d
    slices = _Slices(q, n, D, bufs, (0, 3, 4))
    Bp1, uf, gf = Bp1.view(q * n, -1), u.view(q * n, -1), g.view(q * n)
    gcol = g.view(q * n, 1)
    bytes_ = masks.view(torch.uint8)
    for r, ns, shape in slices.items:
        t, v, d, t2, v2, d2 = slices.views(shape)
        t2.copy_(bytes_[r])
        _residuals(v2, d2, Bp1[r], uf[r], e[ns], factors, shape)
        ga, dv = _target_tables(t, v, d, None if observed is None else observed[ns])
        # the row weights are in gB and g2u here, and applied to du and dvphi below
        grads.phi_psi.addmm_(gB[r].T, v2)
        if shape[0] == 1:
            grads.de[ns].addcmul_(d2, gcol[r], value=2.0)
        else:
            grads.add_targets(gf[r].view(shape[:2]), ga, ns)
        grads.FT.addmm_(g2u[r].T, d2)
        torch.mm(factors.FT, d2.T, out=duT[:, r])
        torch.mm(factors.phiT, v2.T, out=dvphiT[:, r])
    du = duT.mul_(2.0 * gf).T.reshape(q, n, K)
    dvphi = dvphiT.mul_(gf).T.reshape(q, n, P)
    dw, dS = _pieces_gradients(B, w, flip, du, dvphi, factors, grads)
    grads.ddelta.add_(dw.sum(0))
    dw = dw.view(q * n, K)
    flip = flip.view(q * n)
    # buffers: 1 the summed table, 2 z, 3 dz
    zs = _Slices(q, n, D, bufs, (2, 3))
    for k, (r, ns, shape) in enumerate(slices.items):
        views = slices.views(shape)
        t, t2 = views[0], views[3]
        t2.copy_(bytes_[r])
        tl = t2 if not flips[k] else _flipped(bufs, t, flip[r].view(shape[:2]), flips[k]).view(-1, D)
        grads.phi_pT.addmm_(dS[r].T, tl)
        z, dz, z2, dz2 = zs.views(shape)
        torch.mul(t, ep[ns], out=z)
        dwr = dw[r]
        grads.FT.addmm_(dwr.T, z2)
        torch.mm(dwr, factors.FT, out=dz2)
        if shape[0] == 1:
            grads.dep[ns].addcmul_(dz2, t2)
        else:
            grads.dep[ns].add_(dz.mul_(t).sum(0))


def _residuals(v2, d2, Bp1, u, e, factors, shape):
    """The variances ``v = [Bp, 1] phi_psi`` and masked residuals ``d = e + u F^T`` of a
    ``shape`` ``(qc, nc, D)`` slice's rows with pieces ``Bp1`` ``(rows, P + 1)`` and ``u``
    ``(rows, K)``, written into the ``(rows, D)`` views ``v2``, ``d2`` of its tables."""
    torch.mm(Bp1, factors.phi_psi, out=v2)
    if shape[0] == 1:
        torch.addmm(e, u, factors.FT, out=d2)
    else:
        torch.baddbmm(e, u.view(shape[0], shape[1], -1), factors.FT.expand(shape[0], -1, -1), out=d2.view(shape))


def _times(table, right_t):
    """``table @ right_t.T`` for a ``(rows, D)`` table and a thin ``(k, D)`` factor,
    ``(rows, k)``: computed as ``(right_t @ table.T).T``, which MKL runs three times
    faster than the product with the thin factor on the right at k <= 3."""
    return (right_t @ table.T).T


def _t_times(table, small):
    """``(table.T @ small).T`` for a ``(rows, D)`` table and a thin ``(rows, k)``
    factor, ``(k, D)``: as ``small.T @ table``, three times faster (see :func:`_times`)."""
    return small.T @ table


class _Factors:
    r"""The mask-free per-token factors as contiguous ``(k, D)`` rows, the layout of
    the chunks' products (:func:`_times`): ``FT`` (:math:`F^\top`), ``phiT``,
    ``phi_pT`` and ``phi_psi`` (:math:`\phi^\top` over :math:`\psi`, so that
    :math:`v = [B_p, 1]\,\mathrm{phi\_psi}` is one product without a bias copy)."""

    def __init__(self, F, psi, phi, phi_p):
        self.FT = F.T.contiguous()
        self.phiT = phi.T.contiguous()
        self.phi_pT = phi_p.T.contiguous()
        self.phi_psi = torch.cat([self.phiT, psi.unsqueeze(0)])
        # the packed features and a row of ones: one product gives a chunk's S(targets)
        # and its target counts; each token's signal |f_j|^2 / psi_j is the sum of its
        # diagonal features (a == b), which decides the side of a mask Lambda is summed from
        K = F.shape[-1]
        self.packing = pk = SymmetricPacking(K, F.dtype, F.device)
        snr = self.phi_pT[pk.a == pk.b].sum(0, keepdim=True)
        self.phi_p1T = torch.cat([self.phi_pT, torch.ones_like(snr), snr])
        self.snr_total = snr.sum()
        self.eye = torch.eye(K, dtype=F.dtype, device=F.device)

    def unpacked(self, packed, lead):
        """``(rows, P)`` packed symmetric matrices as ``lead + (K, K)`` (packed <-> (K, K)
        by index_select on flat views: a third of the cost of advanced indexing on
        these small tables)."""
        return self.packing.unpack(packed).view(lead + (self.packing.R, self.packing.R))

    def packed(self, sym):
        """``(..., K, K)`` symmetric matrices as ``(rows, P)``, off-diagonal entries doubled."""
        K = self.packing.R
        return self.packing.pack(sym.reshape(-1, K, K)).mul_(self.packing.off)


def _pieces_kept(K, D, dtype):
    """Whether a row's small pieces (``(K + 1)^2 + K`` numbers and a flag) take at most
    :data:`KEPT_PIECES_BITS_RATIO` times the bytes of its mask's bits, so that the
    forward pass keeps them for the backward pass (what the graph keeps then stays a
    small multiple of the bits)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return ((K + 1) ** 2 + K) * itemsize + 1 <= KEPT_PIECES_BITS_RATIO * -(-D // 8)


class _BlockPieces:
    """Every row's small pieces of a block of masks (``masks`` ``(q n, D)``), from sums made
    in its ``slices`` (:class:`_Slices`) and solved for all rows at once: ``count`` ``(q n,)``
    the targets, ``flip`` ``(q, n)`` the rows whose precision is summed over the context,
    ``B`` ``(q, n, K, K)``, ``w``, ``u = B w`` ``(q, n, K)``, ``Bp1`` ``(q, n, P + 1)``
    (``B`` packed with doubled off-diagonal entries, and a 1 for psi), and ``flips``, the
    flipped rows per slice."""

    def __init__(self, slices, masks, ep, delta, factors, lam0, site):
        D = masks.shape[-1]
        q, n = masks.shape[0] // ep.shape[0], ep.shape[0]
        K, P = factors.FT.shape[0], factors.phi_pT.shape[0]
        # per row: S(targets) (or S(context) on flipped rows), the target count, the targets'
        # signal; row-major by feature, so that each slice's product writes its columns
        # (the thin factor on the left, see _times)
        StT = ep.new_empty(P + 2, q * n)
        zFT = ep.new_empty(K, q * n)
        half = 0.5 * factors.snr_total
        self.flips = []
        bytes_ = masks.view(torch.uint8)
        for r, ns, shape in slices.items:
            t, _, z, _, t2, _, z2, _ = slices.views(shape)
            # bool -> float through uint8: a plain copy, a third of the cost of .to()
            t2.copy_(bytes_[r])
            torch.mm(factors.phi_p1T, t2.T, out=StT[:, r])
            # the side each row's precision is summed from, as _Chunk decides it
            flip = StT[P + 1, r] > half
            flips = int(flip.sum())
            self.flips.append(flips)
            if flips:
                tl = _flipped(slices.bufs, t, flip.view(shape[:2]), flips)
                torch.mm(factors.phi_pT, tl.view(-1, D).T, out=StT[:P, r])
            torch.mul(t, ep[ns], out=z)
            torch.mm(factors.FT, z2.T, out=zFT[:, r])
        self.count = StT[P]
        self.flip = (StT[P + 1] > half).view(q, n)
        S = factors.unpacked(StT[:P].T, (q, n))
        total = sum(self.flips)
        if total == q * n:
            lam = S.add_(factors.eye)
        elif total:
            lam = torch.where(self.flip[..., None, None], S + factors.eye, lam0 - S)
        else:
            lam = torch.sub(lam0, S)
        self.w = zFT.T.reshape(q, n, K).add_(delta)
        self.B = _spd_inverse(lam, site)
        self.u = (self.B @ self.w.unsqueeze(-1)).squeeze(-1)
        self.Bp1 = torch.cat([factors.packed(self.B), lam0.new_ones(q * n, 1)], 1).view(q, n, P + 1)

    def tensors(self):
        """``B, u, w, Bp1, flip``, as the backward pass reads them."""
        return self.B, self.u, self.w, self.Bp1, self.flip


class _Chunk:
    """One chunk's 0/1 targets ``t`` (buffer 0), the table the latent precision is
    summed from ``tl`` (``t``, or ``1 - t`` on the rows whose context holds the
    smaller share of the signal; buffer 1 when it differs), ``z = t e / psi``
    (buffer 2), and its small pieces: the precision's inverse ``B`` (packed with
    doubled off-diagonal entries, and a 1 for psi, as ``Bp1``), ``w`` and
    ``u = B w``, made from its sums: the path where the rows' pieces are not kept (large K),
    in the forward pass and again in the backward pass."""

    def __init__(self, bufs, mask, ep, delta, factors, lam0, site):
        qc, nc, D = mask.shape
        K = factors.FT.shape[0]
        rows = qc * nc
        # bool -> float through uint8: a plain copy, a third of the cost of .to()
        t = bufs.take(0, mask.shape).copy_(mask.view(torch.uint8))
        self.t = t
        P = factors.phi_pT.shape[0]
        # (rows, P + 2): S(targets), the target counts (exact: sums of ones below 2**24),
        # the targets' signal
        St = _times(t.view(rows, D), factors.phi_p1T)
        self.count = St[:, P].reshape(qc, nc)
        # lam0 - S(targets) loses about eps tr(lam0) to cancellation, which is small against
        # Lambda only where the targets hold at most half of the signal (by count instead,
        # one column with one token of high signal among the targets was 1.1 nats off in
        # float32, whose one-column bound is eps^2 kappa)
        self.flip = (St[:, P + 1] > 0.5 * factors.snr_total).view(qc, nc)
        self.flips = int(self.flip.sum())
        self.tl = tl = _flipped(bufs, t, self.flip, self.flips)
        S = factors.unpacked(St[:, :P] if tl is t else _times(tl.view(rows, D), factors.phi_pT), (qc, nc))
        if self.flips == rows:
            lam = S.add_(factors.eye)
        elif self.flips:
            lam = torch.where(self.flip[..., None, None], S + factors.eye, lam0 - S)
        else:
            lam = torch.sub(lam0, S)
        z = torch.mul(t, ep, out=bufs.take(2, mask.shape))
        self.z = z
        self.w = delta + _times(z.view(rows, D), factors.FT).reshape(qc, nc, K)
        self.B = _spd_inverse(lam, site)
        self.u = (self.B @ self.w.unsqueeze(-1)).squeeze(-1)  # (qc, nc, K)
        self.Bp1 = torch.cat([factors.packed(self.B), lam0.new_ones(rows, 1)], 1)

    def residuals(self, v, d, e, factors):
        """The variances and masked residuals, written into ``v`` and ``d`` ``(qc, nc, D)``."""
        qc, nc, D = v.shape
        rows = qc * nc
        _residuals(v.view(rows, D), d.view(rows, D), self.Bp1, self.u.view(rows, -1), e, factors, v.shape)
        return v, d


def _flipped(bufs, t, flip, flips):
    """``t``, or ``1 - t`` on the ``flips`` rows ``flip`` (buffer 1 when it differs)."""
    rows = t.shape[0] * t.shape[1]
    if flips == rows:
        return torch.neg(t, out=bufs.take(1, t.shape)).add_(1.0)  # one input, not three
    if flips:
        f = flip.to(t.dtype).unsqueeze(-1)
        return torch.addcmul(f, t, 1.0 - 2.0 * f, out=bufs.take(1, t.shape))
    return t


def _spd_inverse(lam, site):
    """The inverse of symmetric positive definite ``(..., K, K)`` matrices (closed
    form for K <= 2: a batched factorization costs more per 2 x 2 matrix)."""
    K = lam.shape[-1]
    if K == 1:
        return lam.reciprocal()
    if K == 2:
        flat = lam.reshape(-1, 4)  # (p, r, r, s) a row; r from the upper entry, as packed
        r = flat[:, 1:2]
        inv = flat.flip(-1)  # (s, ., ., p)
        torch.neg(r, out=inv[:, 1:2])
        inv[:, 2:3] = inv[:, 1:2]
        det = torch.addcmul(flat[:, 0:1] * flat[:, 3:4], r, r, value=-1.0)
        return inv.div_(det).view(lam.shape)
    L = cholesky(lam, "context precision I + F_R^T Psi_R^-1 F_R", site)
    return torch.cholesky_inverse(L)
