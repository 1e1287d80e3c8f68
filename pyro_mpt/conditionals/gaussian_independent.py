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
:func:`~pyro_mpt.estimate.mpt_estimate` need not checkpoint the block).
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
    o = None if observed is None else observed.to(F.dtype)
    sums = IndependentLowRankSums.apply(mask, *data["independent"], m.site, o)
    return -0.5 * sums


def _chunks(q, n, D):
    """Slices ``(qs, ns)`` of the ``(q, n)`` rows, about ``CHUNK_ELEMENTS`` tokens each."""
    rows = max(1, CHUNK_ELEMENTS // D)
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
    recomputes them from the masks, kept as bits, and reads each row's ``B``,
    ``u`` and ``w`` kept by the forward pass where they are as small
    (``_KeptRows``), else recomputes them too.

    Inputs: ``mask`` bool ``(q, n, D)``; ``e``, ``ep`` (:math:`e/\psi`) ``(n, D)``;
    ``delta`` ``(n, K)``; ``F`` ``(D, K)``; ``psi`` ``(D,)``; ``phi``
    (:math:`f_{ja}f_{jb}`, ``a <= b``) and ``phi_p`` (:math:`\phi/\psi`) ``(D, P)``;
    ``lam0`` ``(K, K)``; ``site`` (for errors); ``observed`` 0/1 ``(n, D)`` in the
    working dtype or None, the tokens of the mask that are summed (the others are
    only left out of the context).
    """

    @staticmethod
    def forward(ctx, mask, e, ep, delta, F, psi, phi, phi_p, lam0, site, observed=None):
        """The sums ``(q, n)``."""
        q, n, D = mask.shape
        out = e.new_empty(q, n)
        factors = _Factors(F, psi, phi, phi_p)
        # buffers: 0 the targets, 1 and 2 the chunk's scratch, then v and d; 3 the terms
        bufs = Workspace(e.dtype, e.device)
        kept = _KeptRows(q, n, F.shape[-1], e) if _KeptRows.worth(F.shape[-1], D, e.dtype) else None
        # the masks as bits, an eighth of the bool table, for the backward pass: packed a
        # chunk at a time, while the chunk's masks are in cache
        bits = torch.empty((q, n, -(-D // 8)), dtype=torch.uint8, device=mask.device)
        for qs, ns in _chunks(q, n, D):
            bits[qs, ns] = pack_bits(mask[qs, ns])
            c = _Chunk(bufs, mask[qs, ns], ep[ns], delta[ns], factors, lam0, site)
            if kept is not None:
                kept.keep(qs, ns, c)
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
        ctx.site, ctx.D = site, D
        ctx.observed = observed
        ctx.flips = None if kept is None else kept.flips
        # and each row's small pieces where they are as small
        pieces = () if kept is None else kept.tensors()
        ctx.save_for_backward(bits, e, ep, delta, F, psi, phi, phi_p, lam0, *pieces)
        return out

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of every input but the mask and the site."""
        bits, e, ep, delta, F, psi, phi, phi_p, lam0, *kept = ctx.saved_tensors
        q, n, D = bits.shape[0], bits.shape[1], ctx.D
        K = F.shape[-1]
        factors = _Factors(F, psi, phi, phi_p)
        de, dep, ddelta = torch.zeros_like(e), torch.zeros_like(ep), torch.zeros_like(delta)
        # the products with a table's transpose come out as (k, D): accumulated so
        dFT, dpsi_phi = torch.zeros_like(factors.FT), torch.zeros_like(factors.phi_psi)
        dphi_pT, dlam0 = torch.zeros_like(factors.phi_pT), torch.zeros_like(lam0)
        # buffers: 0 the targets, 1 the precision's table (while it differs from
        # them), 2 the weighted residuals t e / psi, 3 v, 4 d
        bufs = Workspace(e.dtype, e.device)
        for k, (qs, ns) in enumerate(_chunks(q, n, D)):
            mask = unpack_bits(bits[qs, ns], D)
            if kept:
                c = _Chunk.kept(bufs, mask, ep[ns], kept, qs, ns, ctx.flips[k])
            else:
                c = _Chunk(bufs, mask, ep[ns], delta[ns], factors, lam0, ctx.site)
            shape = c.t.shape
            rows = shape[0] * shape[1]
            v, d = c.residuals(bufs.take(3, shape), bufs.take(4, shape), e[ns], factors)
            # dL/dv = g t (1/v - a^2) and dL/dd = 2 g t a (a = d / v), in place; the
            # row weights g go into the small factors of the products instead
            gr = g[qs, ns]
            g2 = gr.reshape(rows, 1)
            tv = torch.div(c.t, v, out=v)  # t / v
            if ctx.observed is not None:
                tv.mul_(ctx.observed[ns])  # the targets: t o / v ((t o)^2 = t o below)
            ga = d.mul_(tv)  # t a, half of dL/dd over g
            dv = tv.addcmul_(ga, ga, value=-1.0)  # t (1/v - a^2) (t^2 = t), dL/dv over g
            dv2, ga2 = dv.view(rows, D), ga.view(rows, D)
            # psi and phi together: v = [Bp, 1] [phi^T; psi]
            dpsi_phi += _t_times(dv2, g2 * c.Bp1)
            if shape[0] == 1:
                de[ns].addcmul_(ga[0], gr[0].unsqueeze(-1), value=2.0)
            else:
                de[ns].add_((ga * gr.unsqueeze(-1)).sum(0), alpha=2.0)
            u2 = c.u.view(rows, K)
            dFT += _t_times(ga2, (2.0 * g2) * u2)
            du = (2.0 * g2 * _times(ga2, factors.FT)).view(c.u.shape)
            dB = factors.unpacked(g2 * _times(dv2, factors.phiT), c.u.shape[:-1])  # (.., K, K)
            dB.add_(du.unsqueeze(-1) * c.w.unsqueeze(-2))
            dw = (c.B @ du.unsqueeze(-1)).squeeze(-1)
            dlam = c.B @ dB @ c.B
            dlam = (dlam + dlam.transpose(-1, -2)).mul_(-0.5)  # symmetric: -B dB B
            # Lambda = I + S(context) on flipped rows, lam0 - S(targets) on the others
            dS = factors.packed(dlam)
            if c.flips == 0:
                dS.neg_()
                dlam0 += dlam.sum((0, 1))
            elif c.flips < rows:
                dS.mul_(torch.where(c.flip, 1.0, -1.0).to(dlam.dtype).view(rows, 1))
                dlam0 += (dlam * (~c.flip).to(dlam.dtype)[..., None, None]).sum((0, 1))
            dphi_pT += _t_times(c.tl.view(rows, D), dS)
            ddelta[ns].add_(dw.sum(0))
            # w = delta + z F, z = t e / psi (still in buffer 2)
            dw2 = dw.view(rows, K)
            dFT += _t_times(c.z.view(rows, D), dw2)
            dz = torch.mm(dw2, factors.FT, out=bufs.take(3, (rows, D))).view(shape)
            if shape[0] == 1:
                dep[ns].addcmul_(dz[0], c.t[0])
            else:
                dep[ns].add_(dz.mul_(c.t).sum(0))
        P = phi.shape[-1]
        dF, dphi, dpsi, dphi_p = dFT.T, dpsi_phi[:P].T, dpsi_phi[P], dphi_pT.T
        return (None, de, dep, ddelta, dF, dpsi, dphi, dphi_p, dlam0, None, None)


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


class _KeptRows:
    """Every row's small pieces from the forward pass, ``(q, n, ...)``: the
    backward pass reads them instead of summing and inverting the precisions again
    (``(K + 1)^2 + K`` numbers a row, against ``D`` tokens)."""

    def __init__(self, q, n, K, like):
        P = K * (K + 1) // 2
        self.B, self.u, self.w = like.new_empty(q, n, K, K), like.new_empty(q, n, K), like.new_empty(q, n, K)
        self.Bp1 = like.new_empty(q, n, P + 1)
        self.flip = torch.empty(q, n, dtype=torch.bool, device=like.device)
        self.flips = []

    @staticmethod
    def worth(K, D, dtype):
        """Whether a row's pieces take at most :data:`KEPT_PIECES_BITS_RATIO` times the
        bytes of its mask's bits (so that what the graph keeps stays a small multiple
        of the bits)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return ((K + 1) ** 2 + K) * itemsize + 1 <= KEPT_PIECES_BITS_RATIO * -(-D // 8)

    def keep(self, qs, ns, c):
        self.B[qs, ns], self.u[qs, ns], self.w[qs, ns] = c.B, c.u, c.w
        self.Bp1[qs, ns] = c.Bp1.view(self.Bp1[qs, ns].shape)
        self.flip[qs, ns] = c.flip
        self.flips.append(c.flips)

    def tensors(self):
        return self.B, self.u, self.w, self.Bp1, self.flip


class _Chunk:
    """One chunk's 0/1 targets ``t`` (buffer 0), the table the latent precision is
    summed from ``tl`` (``t``, or ``1 - t`` on the rows whose context holds the
    smaller share of the signal; buffer 1 when it differs), ``z = t e / psi``
    (buffer 2), and its small pieces: the precision's inverse ``B`` (packed with
    doubled off-diagonal entries, and a 1 for psi, as ``Bp1``), ``w`` and
    ``u = B w``; made from the sums, or (:meth:`kept`) read from the forward pass."""

    @classmethod
    def kept(cls, bufs, mask, ep, kept, qs, ns, flips):
        """The chunk with its small pieces read from ``kept`` (:class:`_KeptRows`
        tensors ``B, u, w, Bp1, flip``) and ``flips`` flipped rows."""
        c = cls.__new__(cls)
        B, u, w, Bp1, flip = kept
        c.t = t = bufs.take(0, mask.shape).copy_(mask.view(torch.uint8))
        c.flip, c.flips = flip[qs, ns], flips
        c.tl = _flipped(bufs, t, c.flip, flips)
        c.z = torch.mul(t, ep, out=bufs.take(2, mask.shape))
        c.B, c.u, c.w = B[qs, ns], u[qs, ns], w[qs, ns]
        c.Bp1 = Bp1[qs, ns].reshape(t.shape[0] * t.shape[1], -1)
        return c

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
        qc, nc, D = self.t.shape
        rows = qc * nc
        torch.mm(self.Bp1, factors.phi_psi, out=v.view(rows, D))
        if qc == 1:
            torch.addmm(e, self.u.view(nc, -1), factors.FT, out=d.view(nc, D))
        else:
            torch.baddbmm(e, self.u, factors.FT.expand(qc, -1, -1), out=d)
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
