r"""One chunk of a mixture's points, reduced by matrix products in exp-space.

The engines with many latent points (quadrature nodes, prior importance
draws) keep the table of :class:`~pyro_mpt.conditionals.mixture.MixtureTable`
in chunks of ``Q_c`` points in the layout ``(n, Q_c, D)``. A chunk's mask
reduction is two matrix products in exp-space with max shifts, with a
hand-written backward; its partial log-sums are combined across chunks with
:func:`~pyro_mpt.conditionals.mixture.combine_partials` and normalized once
(:func:`~pyro_mpt.conditionals.mixture.normalize_empty`,
:func:`~pyro_mpt.conditionals.mixture.chain_terms`).
"""

import math

import torch

from .distributions import take_rows
from .written_backward import first_order_backward

__all__ = ["MixtureChunk", "exp_floor", "others_sum", "stable_logsumexp"]


def exp_floor(dtype):
    """``log(sqrt(tiny))`` of ``dtype``.

    Exponents are clamped here so that no exp, product or sum meets subnormal
    numbers (which are slow on CPUs); the clamp changes a sum of ``Q_c`` terms
    by at most ``Q_c * sqrt(tiny)``.
    """
    return 0.5 * math.log(torch.finfo(dtype).tiny)


def _floored_square(t):
    """``t ** 2`` of exp-space factors clamped at ``exp(exp_floor)``, in place: the square of a
    factor at the floor is tiny, and products of two such squares are subnormal (a matrix
    product of them ran 20 times slower)."""
    return t.square_().clamp_min_(math.exp(exp_floor(t.dtype)))


def stable_logsumexp(t, dim):
    """``torch.logsumexp`` without subnormals (see :func:`exp_floor`); keeps ``-inf``.

    Example::

        >>> stable_logsumexp(torch.tensor([0.0, -math.inf]), 0)  # tensor(0.)
    """
    top = t.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    s = torch.exp((t - m).clamp_min(exp_floor(t.dtype))).sum(dim, keepdim=True)
    out = (s.log() + m).squeeze(dim)
    allneg = torch.isneginf(top).squeeze(dim)  # every term -inf (read from the max: no pass over t)
    return torch.where(allneg, torch.full_like(out, -math.inf), out) if bool(allneg.any()) else out


def others_sum(t, dim=-1):
    r"""The sum of the other entries along ``dim``, :math:`\sum_{d \ne j} t_d` at each
    :math:`j`, from a prefix and a suffix sum: no entry is added and then taken away
    (``t.sum(dim) - t`` kept none of the other entries' digits beside one log-density of
    :math:`-10^9` in float32: a leave-one-out conditional 1.4 nats off).

    Example::

        >>> others_sum(torch.tensor([1.0, -1e9, 2.0]))   # tensor([-1.0000e+09, 3.0000e+00, -1.0000e+09])
    """
    dim = dim % t.dim()
    size = t.shape[dim]
    zero = torch.zeros_like(t.narrow(dim, 0, 1))
    if size == 1:
        return zero
    head = t.narrow(dim, 0, size - 1).cumsum(dim)  # entries 0..j-1, at j = 1..D-1
    tail = t.narrow(dim, 1, size - 1).flip(dim).cumsum(dim).flip(dim)  # entries j+1..D-1, at j = 0..D-2
    return torch.cat([zero, head], dim) + torch.cat([tail, zero], dim)


class MixtureChunk:
    r"""One chunk of ``Q_c`` points of a mixture, in the layout of the matrix-product reductions.

    :param torch.Tensor log_weights: :math:`\log w_k`, ``(r, Q_c)`` with ``r``
        1 (shared) or ``n``.
    :param torch.Tensor table: :math:`T_{ikd} = \log p(x_{id} \mid z_k)`,
        ``(n, Q_c, D)``.

    The reductions return *unnormalized* partial log-sums over the chunk's
    points; combine chunks with :func:`~pyro_mpt.conditionals.mixture.combine_partials`.

    Example::

        >>> chunk = MixtureChunk(torch.full((1, S), -math.log(S)), T)  # T (n, S, D)
        >>> num, den = chunk.mask_partials((~mask).to(T.dtype))
    """

    __slots__ = ("log_weights", "table", "_shift", "_exp_table", "_impossible")

    def __init__(self, log_weights, table):
        # float32 latents (torch's default dtype) with float64 data give float32 weights and
        # a float64 table, as in Pyro's own log-densities: the reductions run in the wider one
        dtype = torch.promote_types(log_weights.dtype, table.dtype)
        self.log_weights = log_weights.to(dtype)
        self.table = table.to(dtype)
        self._shift = None
        self._exp_table = None
        self._impossible = None

    def exp_table(self):
        """``(exp(T - m), m)`` with ``m`` the per-token max over points, kept; both
        detached: :meth:`mask_partials` differentiates through them by hand."""
        if self._exp_table is None:
            with torch.no_grad():
                T = self.table
                m = T.amax(1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                self._shift = m
                self._exp_table = (T - m).clamp_min_(exp_floor(T.dtype)).exp_()
        return self._exp_table, self._shift

    def detached(self):
        """The chunk with its weights and table detached (sharing the exp-space table)."""
        out = MixtureChunk(self.log_weights.detach(), self.table.detach())
        out._exp_table, out._shift, out._impossible = self._exp_table, self._shift, self._impossible
        return out

    def impossible(self):
        r"""Whether a token is impossible at some point (:math:`T = -\infty`), asked once."""
        if self._impossible is None:
            self._impossible = bool(torch.isneginf(self.table.detach()).any())
        return self._impossible

    def narrowed(self, points):
        """The points ``points`` (a slice) of the chunk, as views (sharing the exp-space table's)."""
        out = MixtureChunk(self.log_weights[:, points], self.table[:, points])
        if self._exp_table is not None:
            # the shift is each token's max over all the chunk's points: still a valid shift
            out._exp_table, out._shift = self._exp_table[:, points], self._shift
        out._impossible = self._impossible
        return out

    def squared(self):
        r"""The chunk of the squared weights and likelihoods, :math:`(2 \log w, 2T)`, detached:
        what the importance weights' second moments sum (effective sample sizes). Its
        exp-space table is the square of this one's, where a new shift and exponential were
        two passes."""
        B, m = self.exp_table()
        out = MixtureChunk(2 * self.log_weights.detach(), 2 * self.table.detach())
        out._exp_table, out._shift, out._impossible = _floored_square(B.clone()), 2 * m, self._impossible
        return out

    def joint(self):
        """Per-point log-joints ``log w + sum_d T``, ``(n, Q_c)``."""
        return self.log_weights + self.table.sum(-1)

    def leave_one_out_partials(self):
        r"""Partial log-sums of the queries that each hide one token (every other one the context).

        :returns: ``(num, den)``, shapes ``(n,)`` and ``(n, D)``, with
            ``num[i] = logsumexp_k(logw_k + sum_d T_ikd)`` (every numerator's: target and
            context make up all the tokens) and ``den[i, j] = logsumexp_k(logw_k + sum_{d != j}
            T_ikd)`` (:func:`others_sum`): :math:`O(nQ_cD)` where :meth:`mask_partials` of the
            :math:`D` contexts costs :math:`O(nQ_cD^2)`.
        """
        others = self.log_weights.unsqueeze(-1) + others_sum(self.table, -1)  # (n, Q_c, D)
        return stable_logsumexp(self.joint(), -1), stable_logsumexp(others, 1)

    def mask_partials(self, ctx):
        """Partial log-sums for context masks ``ctx`` (float, 1 in the context) ``(q, r, D)``.

        :returns: ``(num, den)``, shapes ``(q, n, D)`` and ``(q, n)``, with
            ``num[q, i, j] = logsumexp_k(logw_k + (T_i ctx_q)_k + T_ikj)`` and
            ``den[q, i] = logsumexp_k(logw_k + (T_i ctx_q)_k)``.

        Both are matrix products in exp-space with max shifts, differentiated by
        hand (``_MaskPartials``); where a product underflows against the
        clamped exponents, those entries alone are computed again by an exact
        log-sum-exp, with autograd (``_exact_at``).
        """
        B, mT = self.exp_table()  # (n, Qc, D), (n, 1, D)
        ctx = ctx.to(self.table.dtype)
        num, den, bad = _MaskPartials.apply(self.log_weights, self.table, ctx, B, mT, self.impossible())
        if bool(bad.any()):
            num = self._exact_at(num, bad, ctx)
        return num.transpose(0, 1), den.T

    def second_moments(self, ctx):
        r"""The partial log-sums of the squared weights that standard errors and effective
        sample sizes need, for context masks ``ctx`` (float, 1 in the context) ``(q, r, D)``;
        detached, without a graph.

        With :math:`b_{qk} = \log w_k + (T_i c_q)_k`:
        ``b2[q, i, j] = logsumexp_k(2 b_qk + 2 T_ikj)``, ``a2[q, i] = logsumexp_k(2 b_qk)`` and
        ``c[q, i, j] = logsumexp_k(2 b_qk + T_ikj)``. One context product and two matrix
        products in exp-space, where :meth:`mask_partials` of the squared chunk and of the
        chunk with squared weights made two context products and two more exponentials of
        the table; a product that underflows is computed again at its entries in log space.

        :returns: ``(b2, a2, c)``, shapes ``(q, n, D)``, ``(q, n)``, ``(q, n, D)``.
        """
        with torch.no_grad():
            T, logw = self.table.detach(), self.log_weights.detach()
            B, mT = self.exp_table()
            n, Qc, D = T.shape
            base = logw[:, None, :] + _context_sums(T, ctx.to(T.dtype), self.impossible())  # (n, q, Qc)
            mb = base.amax(-1, keepdim=True)
            mb = torch.where(torch.isfinite(mb), mb, torch.zeros_like(mb))
            A2 = _floored_square((base - mb).clamp_min_(exp_floor(T.dtype)).exp_())
            a2 = 2 * mb.squeeze(-1) + A2.sum(-1).log()
            out = []
            for table, shift, power in ((_floored_square(B.clone()), 2 * mT, 2.0), (B, mT, 1.0)):
                S = torch.bmm(A2, table)  # (n, q, D)
                bad = _underflow(S, Qc)
                part = torch.where(bad, torch.ones_like(S), S).log_().add_(2 * mb).add_(shift)
                if bool(bad.any()):
                    i, k, j = bad.nonzero(as_tuple=True)
                    part[i, k, j] = stable_logsumexp(2 * base[i, k, :] + power * T[i, :, j], -1)
                out.append(part.transpose(0, 1))
            return out[0], a2.T, out[1]

    def target_partials(self, ctx, target):
        r"""Partial log-sums of queries with one target each: ``(num, den)``, both ``(n,)``.

        Row :math:`i`'s query has context ``ctx[i]`` and the single target token
        ``target[i]``: ``num[i] = logsumexp_k(logw_k + (T_i ctx_i)_k + T_{ik,target_i})`` and
        ``den[i] = logsumexp_k(logw_k + (T_i ctx_i)_k)``. One pass over the table, where
        :meth:`mask_partials` makes every token's numerator (a ``D`` times larger result,
        and its exp-space table).

        :param torch.Tensor ctx: float context masks, 1 in the context, ``(n, D)``.
        :param torch.Tensor target: long token indices ``(n,)``.
        """
        T = self.table
        base = self.log_weights + _context_sums(T, ctx.to(T.dtype).unsqueeze(0), self.impossible())[:, 0]  # (n, Q_c)
        picked = torch.gather(T, 2, target.view(-1, 1, 1).expand(-1, T.shape[1], 1)).squeeze(-1)
        return stable_logsumexp(base + picked, -1), stable_logsumexp(base, -1)

    def _exact_at(self, num, bad, ctx):
        """``num`` ``(n, q, D)`` with its entries ``bad`` (the products that underflow) computed
        again as exact log-sum-exps, with autograd; the fast path gives them no gradient.
        Before, the whole chunk was redone with autograd at the first such entry: a copy of
        the exp-space table with its graph at every block of queries (PPCA, D = 200, 256 prior
        draws, masks="all": 6 of 14 blocks, for 516 of 1.6e7 entries)."""
        logw, T = self.log_weights, self.table
        i, k, j = bad.nonzero(as_tuple=True)
        base = logw[:, None, :] + _context_sums(T, ctx, self.impossible())  # (n, q, Qc)
        exact = stable_logsumexp(base[i, k, :] + T[i, :, j], -1)
        return num.index_put((i, k, j), exact)

    def chain_partials(self, order, max_elements):
        """Partial suffix log-sums along orderings ``(p, r, D)``: ``(p, n, D + 1)`` whose entry
        ``t`` is ``logsumexp_k(logw_k + sum_{s >= t} T_{k, order_s})`` (0 sum at ``t = D``).

        :param int max_elements: bound on the entries of each intermediate.
        """
        logw, T = self.log_weights, self.table
        n, Qc, D = T.shape
        p = order.shape[0]
        per = max(1, max_elements // (Qc * (D + 1)))  # (ordering, datapoint) pairs per piece
        n_step = min(n, per)
        p_step = max(1, per // n_step)
        out = []
        for ps in range(0, p, p_step):
            o = order[ps : ps + p_step]
            pc = o.shape[0]
            parts = []
            for ns in range(0, n, n_step):
                rows = torch.arange(ns, min(n, ns + n_step), device=T.device)
                Ti = T[rows]  # (nc, Qc, D)
                oi = o if o.shape[1] == 1 else o[:, rows]
                nc = Ti.shape[0]
                idx = oi[:, :, None, :].expand(pc, nc, Qc, D)
                Tp = torch.gather(Ti.unsqueeze(0).expand(pc, nc, Qc, D), -1, idx)
                C = Tp.flip(-1).cumsum(-1).flip(-1)
                C = torch.cat([C, torch.zeros_like(C[..., :1])], -1)
                C = C + take_rows(logw, rows)[None, :, :, None]
                parts.append(stable_logsumexp(C, 2))  # (pc, nc, D + 1)
            out.append(torch.cat(parts, 1))
        return torch.cat(out, 0)


def _context_sums(T, ctx, impossible=None):
    r"""``(n, q, Q_c)``: each point's log-likelihood of each query's context, ``sum_d ctx_qd T_ikd``.

    A token impossible at a point (:math:`T = -\infty`: a Poisson rate of 0 under a count, a
    Binomial's total below its count) is left out of the contexts without it by the 0 of the
    mask, not multiplied by it: :math:`0 \cdot (-\infty)` made every query NaN, silently
    (``Poisson(relu(2 + a))``, quadrature: the exhaustive and uniform scores and the loss).
    Such entries enter the product at a floor that no sum of ``D`` of them overflows, and a
    sum that holds one goes back to :math:`-\infty`. ``impossible``: whether ``T`` holds
    such an entry, when known (a chunk asks once, not at every block of queries)."""
    if impossible is None:
        impossible = bool(torch.isneginf(T).any())
    if impossible:
        floor = torch.finfo(T.dtype).min / (4 * (T.shape[-1] + 1))
        sums = _context_sums(torch.where(torch.isneginf(T), torch.full_like(T, floor), T), ctx, False)
        return sums.masked_fill(sums < floor / 2, -math.inf)
    if ctx.shape[1] == 1:  # a batched product: T may be a strided view
        return torch.matmul(T, ctx[:, 0, :].T).transpose(1, 2)
    return torch.bmm(ctx.transpose(0, 1), T.transpose(1, 2))


def _underflow(S, Qc):
    """Where an exp-space sum of ``Q_c`` terms is not large against the clamped exponents.

    The clamp moves ``S`` by at most ``3 Q_c sqrt(tiny)``; where ``S`` is not large
    against that (relative precision eps), the log-sum-exp is recomputed exactly.
    """
    return S < 3 * Qc * math.exp(exp_floor(S.dtype)) / torch.finfo(S.dtype).eps


class _MaskPartials(torch.autograd.Function):
    r"""``(num, den, bad)`` of :meth:`MixtureChunk.mask_partials` in the ``(n, q, .)``
    layout, with a hand-written backward.

    With :math:`b_{qk} = \log w_k + \sum_d c_{qd} T_{kd}`, :math:`A_{qk} = e^{b_{qk} - m_q}`,
    :math:`B_{kd} = e^{T_{kd} - m_d}` and :math:`S = AB` (per datapoint),
    :math:`\text{num}_{qd} = \log S_{qd} + m_q + m_d` and
    :math:`\text{den}_q = \log\sum_k A_{qk} + m_q`. For upstream gradients
    :math:`G, g` and :math:`H = G / S`,

    .. math::

        \frac{\partial L}{\partial b} = A \odot \big(H B^\top + g / \textstyle\sum_k A\big), \qquad
        \frac{\partial L}{\partial T} = B \odot (A^\top H) + \Big(\frac{\partial L}{\partial b}\Big)^{\!\top} c,

    three matrix products and one elementwise pass over the ``(n, Q_c, D)``
    table, where autograd through the exponentials would keep and pass over
    several copies of it. The clamped exponents (see :func:`exp_floor`) are
    treated as unclamped: their share of a sum is below its rounding.
    ``bad`` marks the products that underflow; the caller then redoes the chunk.
    """

    @staticmethod
    def forward(fctx, logw, T, ctx, B, mT, impossible):
        n, Qc, D = T.shape
        base = logw[:, None, :] + _context_sums(T, ctx, impossible)  # (n, q, Qc)
        mb = base.amax(-1, keepdim=True)
        mb = torch.where(torch.isfinite(mb), mb, torch.zeros_like(mb))
        A = base.sub_(mb).clamp_min_(exp_floor(T.dtype)).exp_()
        sA = A.sum(-1)
        den = mb.squeeze(-1) + sA.log()
        S = torch.bmm(A, B)  # (n, q, D)
        bad = _underflow(S, Qc)
        # 1 where the product underflows: the caller computes those entries exactly, and
        # the gradient that reaches them here is 0 (G / 1, where G / S was 0 / 0)
        S = torch.where(bad, torch.ones_like(S), S)
        num = S.log().add_(mb).add_(mT)
        fctx.save_for_backward(A, sA, S, B, ctx)
        fctx.logw_rows = logw.shape[0]
        fctx.mark_non_differentiable(bad)
        return num, den, bad

    @staticmethod
    @first_order_backward
    def backward(fctx, G, g, _):
        A, sA, S, B, ctx = fctx.saved_tensors
        n, Qc, D = B.shape
        H = G / S  # (n, q, D)
        grad_base = torch.bmm(H, B.transpose(1, 2)).add_((g / sA).unsqueeze(-1)).mul_(A)  # (n, q, Qc)
        grad_logw = grad_base.sum(1)
        if fctx.logw_rows == 1:
            grad_logw = grad_logw.sum(0, keepdim=True)
        grad_T = None
        if fctx.needs_input_grad[1]:
            grad_T = torch.bmm(A.transpose(1, 2), H).mul_(B)  # (n, Qc, D)
            if ctx.shape[1] == 1:
                grad_T += (grad_base.transpose(1, 2).reshape(n * Qc, -1) @ ctx[:, 0, :]).reshape(n, Qc, D)
            else:
                grad_T.baddbmm_(grad_base.transpose(1, 2), ctx.transpose(0, 1))
        return grad_logw if fctx.needs_input_grad[0] else None, grad_T, None, None, None, None
