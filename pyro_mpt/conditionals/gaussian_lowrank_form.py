r"""The low-rank aggregated form: every mask's pieces of the one quadratic form, with its backward pass.

For :math:`\Sigma = FF^\top + \Psi` (:math:`F` of rank :math:`R`) and masks
shared by the batch, :func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_weighted_sum`
needs, from the masks alone, a :math:`(D+R)\times(D+R)` matrix :math:`A`, a
weight per token and a log-determinant (see :class:`LowRankForm` for the
formulas). This module computes them and their gradients with respect to
:math:`F` and :math:`\psi`, written out: recorded op by op, the backward pass
keeps about a dozen :math:`(P, R, R)` and :math:`(P, D)` tables of the
:math:`P` masks alive and runs three times as many small matrix products as the
forward pass; here it keeps :math:`\Lambda_m^{-1}`, :math:`F^\top W_mF\Lambda_m^{-1}`
and the variances, and remakes the rest in chunks whose tables live in one
:class:`~pyro_mpt.conditionals.workspace.Workspace`.
"""

import torch

from .gaussian_linalg import LOG_2PI, SymmetricPacking, cholesky, tril_inverse_transposed
from .workspace import Workspace
from .written_backward import first_order_backward

__all__ = ["LowRankForm", "lowrank_form_chunks"]

#: bytes of one ``(c, R, D)`` table of a chunk of ``c`` masks: about eight such
#: tables are touched per chunk, and at this size they stay in a core's cache
#: between the passes (measured: 1.15-1.3x faster than 8 MB tables at D = 200-512)
CHUNK_BYTES = 2**20
#: the context path of a chunk of masks (:class:`LowRankForm`): taken where the rank is at least
#: ``CONTEXT_MIN_RANK`` (below it the gathers cost more than the products they save) and the
#: chunk's largest context is at most ``CONTEXT_FRACTION`` of the tokens
CONTEXT_MIN_RANK = 8
CONTEXT_FRACTION = 0.5


def lowrank_form_chunks(D, R, dtype, max_elements):
    r"""Masks per chunk of :class:`LowRankForm` and what it may keep, ``(outer, inner, keep)``:
    the outer chunks' :math:`R\times R` and :math:`D`-vector pieces (about ``10 R^2 + 8 D``
    elements a mask alive at once) within ``max_elements``; the inner chunks'
    ``(c, R, D)`` tables within ``CHUNK_BYTES`` each and about eight of them
    within ``max_elements``; and ``keep``, the elements of the masks' :math:`Y_m`
    (``R D`` a mask) and then :math:`Q_m` (``R^2``) that the forward pass may keep for the backward pass
    (a quarter of ``max_elements``; beyond it the backward pass makes them again).

    Example::

        >>> lowrank_form_chunks(200, 50, torch.float32, 2**24)  # PPCA D = 200, K = 50
        (630, 26, 4194304)
    """
    itemsize = torch.finfo(dtype).bits // 8
    inner = max(1, min(CHUNK_BYTES // (R * D * itemsize), max_elements // (8 * R * D)))
    return max(inner, max_elements // (10 * R * R + 8 * D)), inner, max_elements // 4


class _Packing(SymmetricPacking):
    r"""The packing of :math:`R\times R` matrices with :math:`F`'s rows' outer
    products :math:`F_jF_j^\top`, held feature-major (``FFT``, ``(R(R+1)/2, D)``)."""

    def __init__(self, F):
        super().__init__(F.shape[1], F.dtype, F.device)
        # feature-major: the products of whole rows of F^T, selected along their first dim (the
        # row-major features select single entries along the last dim: D = 200, R = 50, one
        # thread, 0.59 -> 0.40 ms float64, 0.26 -> 0.17 ms float32); the products below take
        # the transposed operands as they come
        self.Ft = F.T.contiguous()
        self.FFT = self.Ft.index_select(0, self.a) * self.Ft.index_select(0, self.b)
        # the off-diagonal weights folded into the rows once, not into every packed table
        self.FFoT = self.FFT * self.off.unsqueeze(-1)
        self.lower = self.b * self.R + self.a

    def pack_sym(self, M):
        r"""``(P, R, R)`` -> ``(P, R(R+1)/2)``: the packed symmetric part :math:`(M + M^\top)/2`
        from the entries above and below the diagonal (``M + M.mT`` reads a transposed
        table: 1.7 ns an entry, 96 x 50 x 50 float32 tables)."""
        flat = M.reshape(*M.shape[:-2], self.R * self.R)
        return self._select(flat, self.upper).add_(self._select(flat, self.lower)).mul_(0.5)

    def inner(self, M):
        r"""``(P, R, R)`` -> ``(P, D)``: :math:`F_j^\top M_m F_j` (``M`` symmetric)."""
        return self.pack(M) @ self.FFoT

    def outer(self, c):
        r"""``(P, D)`` -> ``(P, R, R)``: :math:`\sum_j c_{mj}F_jF_j^\top`."""
        return self.unpack(c @ self.FFT.T)

    def rows_times_f(self, rowsT):
        r"""``(R(R+1)/2, D)`` -> ``(D, R)``: :math:`M_jF_j` for the symmetric :math:`M_j` packed
        in column :math:`j` of ``rowsT`` (which it overwrites), without unpacking them: each
        entry :math:`a \le b` adds to row :math:`a` times :math:`F_{jb}` and, off the diagonal, to
        row :math:`b` times :math:`F_{ja}` (the unpacked ``(D, R, R)`` tables' 8-byte gather:
        D = 200, R = 50, one thread, 0.78 -> 0.61 ms float64, 0.34 -> 0.27 ms float32)."""
        out = rowsT.new_zeros(self.R, rowsT.shape[1])
        out.index_add_(0, self.a, rowsT * self.Ft.index_select(0, self.b))
        rowsT.mul_(self.Ft.index_select(0, self.a)).mul_((self.off - 1).unsqueeze(-1))
        return out.index_add_(0, self.b, rowsT).T


def _symh(X):
    # one fresh table, scaled in place (0.5 * (X + X^T) makes two)
    return torch.add(X, X.transpose(-1, -2)).mul_(0.5)


class LowRankForm(torch.autograd.Function):
    r"""The masks' part of the aggregated low-rank form: ``(A, wsum, logdet)``.

    For mask :math:`m` with target indicator :math:`t_m`, context :math:`c_m = 1 - t_m`
    and coefficient :math:`a_m`: :math:`\Lambda_m = I + F^\top\operatorname{diag}(c_m/\psi)F`,
    the conditional variances :math:`v_m = \psi + \operatorname{diag}(F\Lambda_m^{-1}F^\top)`,
    :math:`w_m = a_m t_m/v_m`, :math:`s_m = t_m/\psi`,
    :math:`Q_m = \Lambda_m^{-1}F^\top\operatorname{diag}(w_m)F\Lambda_m^{-1}` and
    :math:`Y_m = \Lambda_m^{-1}F^\top\operatorname{diag}(2w_m) + Q_mF^\top\operatorname{diag}(s_m)`
    (:math:`R\times D`). Then

    .. math::

        A = \sum_m \begin{bmatrix}\operatorname{diag}(s_m)F \\ I_R\end{bmatrix}
            \begin{bmatrix} Y_m & Q_m\end{bmatrix},\qquad
        \text{wsum} = \sum_m w_m,\qquad
        \text{logdet} = \sum_m a_m \sum_j t_{mj}\log(2\pi v_{mj}).

    :math:`A_{ee}` and :math:`A_{de}` are products of height :math:`PR` over the
    stacked masks, made in chunks of masks; the form's only use, the quadratic form
    :math:`y^\top Ay`, reads only :math:`A`'s symmetric part, so :math:`A_{ed} =
    \sum_m\operatorname{diag}(s_m)FQ_m` is returned transposed inside :math:`A_{de}`
    (its :math:`\sum_mQ_mF^\top\operatorname{diag}(s_m)` is a term of :math:`\sum_mY_m`'s
    chunks) and :math:`A_{ed} = 0`; the :math:`R\times R`
    pieces come from products of :math:`P\times D` tables with the rows'
    outer products :math:`F_jF_j^\top`, all packed (:math:`R(R+1)/2` entries).
    The backward pass assumes what that use gives: a symmetric gradient of :math:`A`; and that
    :math:`y = [e; \delta]` with :math:`\delta = \hat z - F^\top\Psi^{-1}e` built
    with :math:`F^\top\Psi^{-1}` held constant: the form meets :math:`\delta` only in
    :math:`u_m = X_me + \delta` (:math:`X_m = F^\top\operatorname{diag}(s_m)`), so
    :math:`F^\top\Psi^{-1}`'s gradient through both is
    :math:`-\sum_m(\bar X_m\operatorname{diag}(1 - t_m))^\top`, which the backward pass
    makes from each mask's context columns (recorded apart, the two are terms of order
    :math:`1/\psi` that cancel).

    :math:`X_m` and :math:`Y_m` are zero at the context columns, so a mask's share of
    :math:`A_{ee}` lives on its targets; with :math:`X_m = F_p^\top - X^c_m`
    (:math:`F_p = \Psi^{-1}F`, :math:`X^c_m = F_p^\top\operatorname{diag}(1 - t_m)`),
    :math:`A_{ee} = F_p\sum_mY_m - \sum_m(X^c_m)^\top Y_m`, whose per-mask products run over
    the :math:`|\mathcal R_m|` context rows instead of all :math:`D` tokens, and so do the
    backward pass's. The masks are sorted by their number of
    context tokens and a chunk takes this context path where the rank is at least
    ``CONTEXT_MIN_RANK`` and its largest context at most ``CONTEXT_FRACTION`` of the tokens:
    the masks the target blocks leave to this form have many targets and few context tokens
    (PPCA D = 200, K = 50, ``"all"``: 96 masks with 0 to 95 context tokens; the form's loss +
    gradient 37 -> 30 ms float32, 71 -> 56 ms float64, one thread).

    :param F: ``(D, R)``. :param psi: ``(D,)``. :param t: the targets, 0/1 in
        ``F``'s dtype, ``(P, D)``. :param a: ``(P,)``. :param tuple chunks: masks
        per outer and inner chunk, and the elements of :math:`Y_m`, :math:`Q_m` kept for
        the backward pass (:func:`lowrank_form_chunks`): the
        :math:`R\times R` pieces of an outer chunk are alive at once, and the
        ``(c, R, D)`` tables of an inner one. :param str site: for error messages.
    :returns: ``A`` ``(D + R, D + R)``, ``wsum`` ``(D,)``, ``logdet`` ``()``.
    """

    @staticmethod
    def forward(ctx, F, psi, t, a, chunks, site):
        """``(A, wsum, logdet)``."""
        D, R = F.shape
        P = t.shape[0]
        # row-major: a loading that comes transposed (PPCA's W read as F = W^T^T) made the
        # selections along its rows (the packing's features, the padded rows) 3x slower
        # (features 0.77 -> 0.28 ms, D = 200, R = 50, float32); the copy is D x R
        F = F.contiguous()
        if R >= CONTEXT_MIN_RANK:
            # the masks by their number of context tokens, so that a chunk's contexts pad little
            order = torch.argsort(t.sum(-1), descending=True, stable=True)
            t, a = t.index_select(0, order), a.index_select(0, order)
        pk = _Packing(F)
        # what the backward pass keeps of every mask, 2(R^2 + D) with t (``aggregated_elements``: one
        # more R x R table a mask, such as Q, would split D = 512, K = 50 into two groups within the
        # default chunk_size, each with its own product with the data: 1.5x slower); Y_m and Q_m
        # only within the chunks' own keep budget, below
        Li, Mw, v = F.new_empty(P, R, R), F.new_empty(P, R, R), F.new_empty(P, D)
        A = F.new_zeros(D + R, D + R)
        wsum, logdet = F.new_zeros(D), F.new_zeros(())
        outer, inner, keep = chunks
        # tables kept for a backward pass that will not run would only hold memory
        keep = keep if any(ctx.needs_input_grad[:2]) else 0
        kept = []
        for o in range(0, P, outer):
            so = slice(o, o + outer)
            to, ao = t[so], a[so].unsqueeze(-1)
            Lam = pk.outer((1 - to) / psi)
            Lam.diagonal(dim1=-2, dim2=-1).add_(1)
            L = cholesky(Lam, "context precision I + F_R^T Psi_R^-1 F_R", site)
            # Lambda >= I, so L^-1 has norm <= 1: its explicit inverse is accurate
            X = tril_inverse_transposed(L)
            Lio = torch.matmul(X, X.transpose(-1, -2), out=Li[so])
            vo = torch.add(pk.inner(Lio), psi, out=v[so])
            w = ao * to / vo
            logdet += (ao * to * (LOG_2PI + vo.log())).sum()
            wsum += w.sum(0)
            Q = Lio @ torch.matmul(pk.outer(w), Lio, out=Mw[so])
            s = to / psi
            plan = _context_chunks(s, R, inner)
            Yk = _kept_tables(plan, R, D, F, keep)
            keep -= 0 if Yk is None else Yk.numel()
            # Q too, where it fits after the Y's (the backward pass makes it again otherwise)
            Qk = Q if Q.numel() <= keep else None
            keep -= 0 if Qk is None else Qk.numel()
            # the plan too: making it again costs its host syncs (0.3 ms at D = 200, K = 50)
            kept.append((Yk, Qk, plan))
            _forward_form(F, psi, Lio, Q, w, s, plan, A, Yk)
        ctx.save_for_backward(F, psi, t, a, Li, Mw, v)
        ctx.chunks, ctx.kept, ctx.pk = chunks, kept, pk
        return A, wsum, logdet

    @staticmethod
    @first_order_backward
    def backward(ctx, gA, gwsum, glog):
        """The gradients of ``F`` and ``psi``."""
        F, psi, t, a, Li, MwLi, v = ctx.saved_tensors
        D, R = F.shape
        P = t.shape[0]
        pk = ctx.pk
        G = _symh(gA)
        Gdd = G[D:, D:]
        outer = ctx.chunks[0]  # the inner chunks: the forward pass's plans, kept
        gF = torch.zeros_like(F)
        # X_m = Fp^T diag(t_m) (Fp = F / psi) enters the form only in u_m = X_m e + delta, and the
        # caller's delta = zhat - Fp^T e carries Fp without gradient: X_m and delta's Fp together
        # have Fp's gradient -sum_m (gX_m o c_m)^T (c = 1 - t), made here from the context columns
        # directly; apart, they are terms of order 1/psi that cancel to the gradient (float32 lost
        # up to 2 of its 7 digits of psi's gradient at D = 100, K = 20)
        gXc = F.new_zeros(R, D)
        # every row j's R x R gradient of F_j F_j^T, summed over the masks (packed), and psi's
        rows = None
        gpsi = torch.zeros_like(psi)
        for k, o in enumerate(range(0, P, outer)):
            so = slice(o, o + outer)
            Lio, vo, to = Li[so], v[so], t[so]
            Yk, Q, plan = ctx.kept[k]
            if Q is None:
                Q = MwLi[so].transpose(-1, -2) @ Lio  # Li Mw Li, Li and Mw symmetric
            w = a[so].unsqueeze(-1) * to / vo
            gu = torch.empty_like(w)
            gLi, gQ = torch.empty_like(Lio), torch.empty_like(Q)
            so_psi = to / psi
            _backward_form(F, psi, Lio, Q, w, so_psi, G, plan, Yk, gF, gXc, gu, gLi, gQ)
            # Li and Q are symmetric for every F and psi: only their gradients' symmetric parts
            # count, and the tables below are met only through packed symmetric parts (pack_sym),
            # so none is symmetrized in full (a transposed read of a table: 0.4 ms of 96 masks)
            gQ.add_(Gdd)
            # Q = Li Mw Li: Mw's gradient is sym(Li gQ Li)
            gMw = Lio @ gQ @ Lio
            # Mw = sum_j w_j F_j F_j^T, u = 2 w, w = a t / v, logdet = sum a t log v
            pMw = pk.pack_sym(gMw)
            gw = (pMw @ pk.FFoT).add_(gwsum).add_(gu, alpha=2)
            gv = w * (glog - gw / vo)
            # Li's gradient: sym(gLi) + sym(gQ) Li Mw + Mw Li sym(gQ) (through Q) + sum_j gv_j F_j F_j^T
            # (v = psi + F_j^T Li F_j); minus Lambda's gradient (Li = Lambda^-1, Lambda = I +
            # sum_j (c_j / psi_j) F_j F_j^T) is Li gLi Li, whose Q terms are sym(gMw) Mw Li and its
            # transpose: 2 sym(gMw) Mw Li within the symmetric part (the sign goes into its two uses)
            mgLam = Lio @ gLi.add_(pk.outer(gv)) @ Lio
            mgLam.baddbmm_(gMw, MwLi[so]).baddbmm_(gMw.transpose(-1, -2), MwLi[so])
            cpsi = (1 - to) / psi
            # the three terms of the rows' gradients, the one through Lambda first: psi's gradient
            # through Lambda, sum_m (c_mj / psi_j^2) F_j^T mgLam_m F_j, is its row j against
            # F_j F_j^T (no (P, D) product of every mask's mgLam); the first chunk's term starts
            # the rows (a fresh table filled with zeros costs its page faults once more)
            # (feature-major, R(R+1)/2 x D, as the packing's features)
            Crows = torch.mm(pk.pack_sym(mgLam).T, cpsi)
            gpsi += torch.linalg.vecdot(Crows, pk.FFoT, dim=0) / psi + gv.sum(0)  # a batched bmm: 6x slower
            rows = Crows.neg_() if rows is None else rows.sub_(Crows)
            rows.addmm_(pMw.T, w).addmm_(pk.pack(Lio).T, gv)
        gF += 2 * pk.rows_times_f(rows)
        gFp = -gXc.T
        gF += gFp / psi.unsqueeze(-1)
        gpsi -= (gFp * F).sum(1) / psi**2
        return gF, gpsi, None, None, None, None


def _context_chunks(s, R, inner):
    """The chunks of masks, a list of ``(slice, idx)``: ``idx`` ``(c, Rm)`` the context tokens
    of the chunk's masks (increasing, padded with ``D``) where the chunk takes the context
    path, else None. The masks come sorted by their number of context tokens (increasing); a
    context chunk's ``(c, Rm, D)`` gathers stay within the ``(inner, R, D)`` of a chunk's table."""
    P, D = s.shape
    if R < CONTEXT_MIN_RANK:
        return [(slice(i, i + inner), None) for i in range(0, P, inner)]
    context = s == 0
    counts = context.sum(-1).tolist()
    idx = None
    plan, i = [], 0
    while i < P:
        c = min(inner, P - i)
        if counts[i + c - 1] <= CONTEXT_FRACTION * D:
            if idx is None:
                # every mask's context tokens in increasing order, padded with D
                slot = context.cumsum(-1) - 1
                m_of, j_of = context.nonzero(as_tuple=True)
                idx = torch.full((P, max(1, max(counts))), D, dtype=torch.long, device=s.device)
                idx[m_of, slot[m_of, j_of]] = j_of
            c = min(c, max(1, inner * R // max(1, counts[i + c - 1])))
            plan.append((slice(i, i + c), idx[i : i + c, : max(1, counts[i + c - 1])]))
        else:
            plan.append((slice(i, i + c), None))
        i += c
    return plan


def _padded_fp(F, psi):
    r"""``(D + 1, R)``: the rows of :math:`F_p = \Psi^{-1}F` and a zero row for the padding token
    ``D`` of :func:`_context_chunks`' context indices."""
    return torch.cat([F / psi.unsqueeze(-1), F.new_zeros(1, F.shape[-1])])


def _kept_tables(plan, R, D, F, keep):
    """The ``(n, R, D)`` table of the context chunks' :math:`Y_m` that the forward pass keeps
    (``n`` the masks on the context path), or None: none there, or more than ``keep`` elements."""
    n = sum(sl.stop - sl.start for sl, idx in plan if idx is not None)
    return F.new_empty(n, R, D) if 0 < n * R * D <= keep else None


def _forward_form(F, psi, Li, Q, w, s, plan, A, Yk=None):
    r"""Adds the masks' share of ``A`` chunk by chunk: :math:`A_{de} = \sum_m Y_m` and
    :math:`A_{ee} = \sum_m X_m^\top Y_m`, as one product over the stacked masks of a chunk
    (the target path), or (the context path) as
    :math:`F_p\sum_m Y_m - \sum_m (X^c_m)^\top Y_m` with :math:`F_p = \Psi^{-1}F` and
    :math:`X^c_m = F_p^\top\operatorname{diag}(1 - t_m)`, whose products run over the
    masks' context rows only (:math:`X_m = F_p^\top - X^c_m`)."""
    D, R = F.shape
    Aee, Ade = A[:D, :D], A[D:, :D]
    Ft = F.T.contiguous()
    ws = Workspace(F.dtype, F.device)
    Fpx = Ysum = Aeec = None
    k = 0
    for sl, idx in plan:
        if idx is None:
            (X, Y), _, QX = _pieces(F, Ft, Li[sl], Q[sl], w[sl], s[sl], ws, qx=True)
            c = X.shape[0]
            Aee.addmm_(X.view(c * R, D).T, Y.view(c * R, D))
            Ade.add_(Y.sum(0)).add_(QX)
            continue
        if Fpx is None:
            Fpx = _padded_fp(F, psi)
            Ysum, Aeec = F.new_zeros(R, D), F.new_zeros(D + 1, D)
        c, Rm = idx.shape
        Yo = None if Yk is None else Yk[k : k + c]
        k += c
        (_, Y), _, QX = _pieces(F, Ft, Li[sl], Q[sl], w[sl], s[sl], ws, x=False, Y=Yo, qx=True)
        flat = idx.reshape(-1)
        Ade.add_(QX)
        Ysum.add_(Y.sum(0))
        rows = torch.matmul(Fpx.index_select(0, flat).view(c, Rm, R), Y, out=ws.take("rows", (c, Rm, D)))
        Aeec.index_add_(0, flat, rows.view(c * Rm, D))
    if Fpx is not None:
        Ade.add_(Ysum)
        Aee.addmm_(Fpx[:D], Ysum).sub_(Aeec[:D])
    A[D:, D:] += Q.sum(0)


def _backward_form(F, psi, Li, Q, w, s, G, plan, Yk, gF, gXc, gu, gLi, gQ):
    D, R = F.shape
    Gee, Gde = G[:D, :D], G[D:, :D]
    Ft = F.T.contiguous()
    ws = Workspace(F.dtype, F.device)
    Fpx = None
    k = 0
    for sl, idx in plan:
        if idx is None:
            _backward_chunk(F, Ft, Li[sl], Q[sl], w[sl], s[sl], Gee, Gde, gF, gXc, gu[sl], gLi[sl], gQ[sl], ws)
            continue
        if Fpx is None:
            Fpx = _padded_fp(F, psi)
            # X_m G_ee + G_de = F_p^T G_ee + G_de - X^c_m G_ee: the first two once for all masks
            H = torch.addmm(Gde, Fpx[:D].T, Gee)
            Geex = torch.cat([Gee, Gee.new_zeros(1, D)])
            gXcT, gFt = F.new_zeros(D + 1, R), F.new_zeros(R, D)
        c = idx.shape[0]
        Y = None if Yk is None else Yk[k : k + c]
        k += c
        _context_backward_chunk(
            F, Ft, Fpx, H, Geex, Gde, Li[sl], Q[sl], w[sl], s[sl], Y, idx, gFt, gXcT, gu[sl], gLi[sl], gQ[sl], ws
        )
    if Fpx is not None:
        gXc.add_(gXcT[:D].T)
        gF.add_(gFt.T)


def _pieces(F, Ft, Li, Q, w, s, ws, x=True, Y=None, qx=False):
    """A chunk's ``[X, Y]`` ``(2, c, R, D)`` with ``X = F^T o s`` (left unset where ``x``
    is False) and ``Y = [Li F^T] o 2w + [Q F^T] o s``, and ``[Li F^T, Q F^T]`` ``(2, c, R, D)``,
    in the workspace ``ws``; with ``Y`` given (``(c, R, D)``, where ``x`` is False), ``Y`` is
    made there and returned in ``[X, Y]``'s place; and where ``qx``, :math:`\\sum_m Q_mX_m` ``(R, D)``
    (else None)."""
    c, R, _ = Li.shape
    D = F.shape[0]
    # two products into the halves of one table, not one product of a stacked copy of Li and Q
    LQF = ws.take("LQF", (2, c * R, D))
    torch.matmul(Li.reshape(c * R, R), Ft, out=LQF[0])
    torch.matmul(Q.reshape(c * R, R), Ft, out=LQF[1])
    LQF = LQF.view(2, c, R, D)
    XY = ws.take("XY", (2, c, R, D)) if Y is None else (None, Y)
    s1 = s.unsqueeze(1)
    if x:
        torch.mul(Ft, s1, out=XY[0])  # F^T contiguous: read strided, this pass took 5x longer
    torch.mul(LQF[1], s1, out=XY[1])
    QX = XY[1].sum(0) if qx else None
    XY[1].addcmul_(LQF[0], (2 * w).unsqueeze(1))
    return XY, LQF, QX


def _backward_chunk(F, Ft, Li, Q, w, s, Gee, Gde, gF, gXc, gu, gLi, gQ, ws):
    r"""One chunk's share of the gradient through :math:`A_{ee} = \sum_m X_m^\top Y_m`
    and :math:`A_{de} = \sum_m Y_m`, with :math:`G` the symmetric gradient of
    :math:`A`: :math:`\bar Y_m = X_m G_{ee} + G_{de}`, :math:`\bar X_m = Y_m G_{ee}`,
    then through ``Y``'s factors; ``gF`` (but for its part through :math:`X`) and
    ``gXc`` (:math:`\sum_m \bar X_m\circ c_m` with :math:`\bar X_m` the gradient of
    every occurrence of :math:`X_m`, :math:`Y_mG_{ee} + Q_m(X_mG_{ee} + 2G_{de})`,
    and :math:`c_m = 1 - t_m`) are accumulated and ``gu`` (of :math:`u = 2w`),
    ``gLi``, ``gQ`` (the chunk's rows) written in place."""
    c, R, _ = Li.shape
    D = F.shape[0]
    XY, LQF, _ = _pieces(F, Ft, Li, Q, w, s, ws)
    gYX = torch.matmul(XY.view(2 * c * R, D), Gee, out=ws.take("gYX", (2 * c * R, D))).view(2, c, R, D)
    gY, gX = gYX[0], gYX[1]
    gY += Gde
    s1 = s.unsqueeze(1)
    gu.copy_((gY * LQF[0]).sum(1))
    # X_m's gradient from A_ee = X^T Y, Y's Q X and A_ed = X^T Q, at the context columns
    # (Q (gY + G_de), accumulated in place without a table for gY + G_de)
    gX.baddbmm_(Q, gY)
    gX.view(c * R, D).addmm_(Q.reshape(c * R, R), Gde)
    gXc.add_((gX * (s1 == 0)).sum(0))
    # Y's factors [Li F^T] o 2w and [Q F^T] o s
    Z = ws.take("Z", (2, c, R, D))
    torch.mul(gY, (2 * w).unsqueeze(1), out=Z[0])
    # (gY + G_de) o s: G_de's Q X term is A_ed's, folded into A_de
    torch.add(gY, Gde, out=Z[1]).mul_(s1)
    torch.matmul(Z[0].view(c * R, D), F, out=gLi.view(c * R, R))
    torch.matmul(Z[1].view(c * R, D), F, out=gQ.view(c * R, R))
    # Y's Li F^T factor (its Q F^T o s = Q X is X's, in gXc)
    gF.addmm_(Z[0].view(c * R, D).T, Li.reshape(c * R, R))


def _context_backward_chunk(F, Ft, Fpx, H, Geex, Gde, Li, Q, w, s, Y, idx, gFt, gXcT, gu, gLi, gQ, ws):
    r""":func:`_backward_chunk` on the context path: with the chunk's context tokens ``idx``
    ``(c, Rm)`` (padded with the zero row ``D`` of ``Fpx`` and ``Geex``),
    :math:`\bar Y_m = H - X^c_mG_{ee}` with :math:`H = F_p^\top G_{ee} + G_{de}`, and
    :math:`\bar X_m`'s context columns :math:`(Y_mG_{ee} + Q_m(\bar Y_m + G_{de}))_{:,\mathcal R_m}`,
    whose :math:`G_{ee}` columns are the rows of :math:`G_{ee}` at the context
    (symmetric): products of width :math:`|\mathcal R_m|` where the target path's are of
    width :math:`D`. ``gXcT`` ``(D + 1, R)`` takes them transposed (row ``D``: the padding).
    :math:`Y_m`'s factor :math:`\Lambda_m^{-1}F^\top\operatorname{diag}(2w_m)` has the gradients
    :math:`\Lambda_m^{-1}\bar Y_m\operatorname{diag}(2w_m)` of :math:`F^\top` (into ``gFt``) and
    :math:`\operatorname{diag}(F\Lambda_m^{-1}\bar Y_m)` of :math:`2w_m` from one product
    :math:`\Lambda_m^{-1}\bar Y_m`. ``Y``: the chunk's kept :math:`Y_m`, or None (made again)."""
    c, R, _ = Li.shape
    D = F.shape[0]
    Rm = idx.shape[1]
    if Y is None:
        (_, Y), _, _ = _pieces(F, Ft, Li, Q, w, s, ws, x=False)
    flat = idx.reshape(-1)
    Gc = torch.index_select(Geex, 0, flat, out=ws.take("Gc", (c * Rm, D))).view(c, Rm, D)
    Xc = Fpx.index_select(0, flat).view(c, Rm, R).transpose(1, 2)
    gY = torch.baddbmm(H, Xc, Gc, alpha=-1, out=ws.take("gY", (c, R, D)))
    LgY = torch.matmul(Li, gY, out=ws.take("LgY", (c, R, D)))
    u1 = (2 * w).unsqueeze(1)
    torch.sum(torch.mul(LgY, Ft, out=ws.take("Z", (c, R, D))), 1, out=gu)
    gFt.add_(LgY.mul_(u1).sum(0))
    # the tables are reused as they fall free (fewer tables a chunk: fewer cache misses, fewer
    # pages): LgY's takes gY o 2w, gY turns into gY + G_de (read at the context columns below),
    # then (gY + G_de) o s
    Z0 = torch.mul(gY, u1, out=LgY)
    gYd = gY.add_(Gde)
    # the padding's slots gather any column (clamped) and are scattered to row D
    near = idx.clamp(max=D - 1)
    gYc = torch.gather(gYd, 2, near.unsqueeze(1).expand(c, R, Rm))
    T = torch.matmul(Gc, Y.transpose(1, 2))
    T.baddbmm_(gYc.transpose(1, 2), Q)  # Q symmetric: (Q (gY + G_de))^T at the context columns
    gXcT.index_add_(0, flat, T.view(c * Rm, R))
    Z1 = gYd.mul_(s.unsqueeze(1))
    torch.matmul(Z0.view(c * R, D), F, out=gLi.view(c * R, R))
    torch.matmul(Z1.view(c * R, D), F, out=gQ.view(c * R, R))
