r"""Masked conditionals of a finite mixture: one table, every reduction.

Several engines turn a model into a finite mixture over latent points
:math:`z_1, \dots, z_K` -- the joint support of discrete latents, quadrature
nodes, prior importance draws:

.. math::

    p(x) = \sum_k w_k \prod_d p(x_d \mid z_k), \qquad
    T_{kd} = \log p(x_d \mid z_k).

Every masked conditional is then a ratio of two sums over the same points,

.. math::

    \log p(x_j \mid x_{\mathcal R}) =
      \operatorname{logsumexp}_k \Big[\log w_k + \sum_{r \in \mathcal R} T_{kr} + T_{kj}\Big]
    - \operatorname{logsumexp}_k \Big[\log w_k + \sum_{r \in \mathcal R} T_{kr}\Big],

so the conditionals of every context come from one joint: the chain rule along
any ordering telescopes to :math:`\log \sum_k w_k e^{\sum_d T_{kd}}` and the
exhaustive schedule equals it exactly. :class:`MixtureTable` holds
:math:`\log w` and :math:`T` and offers the mask, chain and evidence
reductions, the empty-context rule (with normalized weights
:math:`\log p(x_\emptyset) = 0` exactly, not up to rounding) and the effective
sample size of the posterior weights, each vectorized over queries, points and
datapoints and split into chunks of at most ``max_elements`` entries.

Engines with many points (quadrature nodes, prior importance draws) hold the
table in chunks of points, :class:`MixtureChunk`, in the layout
``(n, Q_c, D)`` whose mask reduction is two matrix products in exp-space with
max shifts (:meth:`MixtureChunk.mask_partials`); a table too large to keep is
streamed. The unnormalized partial sums of the chunks are combined with
:func:`combine_partials` and normalized once: :func:`normalize_empty` (the
empty context has normalizer one) and :func:`chain_terms`.
"""

import math

import torch

from .distributions import take_rows

__all__ = [
    "MixtureTable",
    "MixtureChunk",
    "combine_partials",
    "normalize_empty",
    "chain_terms",
    "exp_floor",
    "stable_logsumexp",
]


def _slices(total, step):
    return [slice(s, min(total, s + step)) for s in range(0, total, step)]


class MixtureTable:
    r"""A finite mixture over ``K`` latent points, per datapoint.

    :param torch.Tensor log_weights: :math:`\log w_k`, shape ``(K,)`` (shared by
        the datapoints) or ``(K, n)`` (per datapoint).
    :param torch.Tensor table: :math:`T_{kid} = \log p(x_{id} \mid z_k)`, shape
        ``(K, n, D)``.
    :param bool normalized: the weights sum to one for each datapoint, so a
        query with an empty context has normalizer one (set exactly).
    :param int max_elements: bound on the entries of the largest intermediate
        tensor (``q * K * n * D`` per chunk of queries and datapoints).

    Example::

        >>> mix = MixtureTable(torch.log(pi), T)            # pi (K,), T (K, n, D)
        >>> mix.log_evidence()                               # (n,): log p(x_i)
        >>> mix.log_conditionals(context=~mask)              # (q, n, D)
        >>> mix.chain_log_prob(order)                        # (p, n, D)
    """

    def __init__(self, log_weights, table, *, normalized=True, max_elements=2**24):
        if table.dim() != 3:
            raise ValueError(f"MixtureTable: table must have shape (K, n, D), got {tuple(table.shape)}.")
        K, n, D = table.shape
        if log_weights.dim() not in (1, 2) or log_weights.shape[0] != K or log_weights.shape[1:] not in ((), (1,), (n,)):
            raise ValueError(
                f"MixtureTable: log_weights must have shape ({K},) or ({K}, {n}) to match the "
                f"table ({K}, {n}, {D}), got {tuple(log_weights.shape)}."
            )
        if log_weights.dim() == 1:
            log_weights = log_weights[:, None]
        self.log_weights = log_weights  # (K, n|1)
        self.table = table
        self.normalized = bool(normalized)
        self.max_elements = int(max_elements)

    @property
    def num_points(self):
        """``K``."""
        return self.table.shape[0]

    @property
    def num_data(self):
        """``n``."""
        return self.table.shape[1]

    @property
    def num_tokens(self):
        """``D``."""
        return self.table.shape[2]

    def _chunks(self, q, rows, per_query):
        """Slices over queries and datapoints with ``q_c * n_c * per_query <= max_elements``."""
        per = max(1, self.max_elements // max(1, per_query))
        n_step = min(self.num_data, per)
        q_step = max(1, per // n_step)
        return _slices(q, q_step), _slices(self.num_data, n_step)

    def _weights(self, ns):
        w = self.log_weights
        return w if w.shape[1] == 1 else w[:, ns]

    # ------------------------------------------------------------------ reductions
    def joint(self, observed=None):
        r"""Per-point log-joints :math:`\log w_k + \sum_d T_{kid}`, shape ``(K, n)``.

        :param torch.Tensor observed: bool ``(n, D)``: sum only these tokens.
        """
        T = self.table
        if observed is not None:
            T = torch.where(observed, T, torch.zeros((), dtype=T.dtype, device=T.device))
        return self.log_weights + T.sum(-1)

    def log_evidence(self, observed=None):
        r""":math:`\log p(x_i) = \operatorname{logsumexp}_k (\log w_k + \sum_d T_{kid})`, ``(n,)``.

        :param torch.Tensor observed: bool ``(n, D)``; the density of the
            observed tokens only (missing ones summed out).
        """
        return self.joint(observed).logsumexp(0)

    def mask_partials(self, context):
        r"""Unnormalized log-sums for boolean contexts ``(q, n|1, D)``.

        :returns: ``(num, den)`` of shapes ``(q, n, D)`` and ``(q, n)``:
            :math:`\log p(x_j, x_{\mathcal R})` and :math:`\log p(x_{\mathcal R})`
            (no empty-context rule applied).
        """
        K, n, D = self.table.shape
        q = context.shape[0]
        qs, ns = self._chunks(q, n, K * D)
        zero = torch.zeros((), dtype=self.table.dtype, device=self.table.device)
        nums, dens = [], []
        for qsl in qs:
            row_num, row_den = [], []
            for nsl in ns:
                T = self.table[:, nsl]  # (K, nc, D)
                ctx = context[qsl] if context.shape[1] == 1 else context[qsl, nsl]
                # where, not a product: a -inf entry outside the context must not give nan
                lin = torch.where(ctx[:, None], T[None], zero).sum(-1)  # (qc, K, nc)
                base = self._weights(nsl)[None] + lin
                row_den.append(base.logsumexp(1))
                row_num.append((base[..., None] + T[None]).logsumexp(1))  # (qc, nc, D)
            nums.append(torch.cat(row_num, 1))
            dens.append(torch.cat(row_den, 1))
        return torch.cat(nums, 0), torch.cat(dens, 0)

    def _normalizer(self, den, context):
        return normalize_empty(den, context) if self.normalized else den

    def log_conditionals(self, context, target=None):
        r""":math:`\log p(x_j \mid x_{\mathcal R_q})` for boolean contexts ``(q, n|1, D)``.

        :param torch.Tensor target: bool ``(q, n|1, D)`` or None; entries outside
            the targets are set to 0.
        :returns: ``(q, n, D)``; every ``j`` (also context tokens, whose
            "conditional" is then not a probability) unless ``target`` is given.
        """
        num, den = self.mask_partials(context)
        out = num - self._normalizer(den, context)[..., None]
        if target is not None:
            out = torch.where(target, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

    def chain_partials(self, order):
        r"""Suffix log-sums along orderings ``(p, n|1, D)``.

        :returns: ``(p, n, D + 1)`` whose entry ``t`` is
            :math:`\operatorname{logsumexp}_k(\log w_k + \sum_{s \ge t} T_{k\pi_s})`
            (the last entry sums no token; no empty-context rule applied).
        """
        K, n, D = self.table.shape
        p = order.shape[0]
        ps, ns = self._chunks(p, n, K * (D + 1))
        out = []
        for psl in ps:
            row = []
            for nsl in ns:
                T = self.table[:, nsl]  # (K, nc, D)
                o = order[psl] if order.shape[1] == 1 else order[psl, nsl]
                pc, nc = o.shape[0], T.shape[1]
                Tp = T[None].expand(pc, K, nc, D).gather(-1, o[:, None].expand(pc, K, nc, D))
                C = Tp.flip(-1).cumsum(-1).flip(-1)
                C = torch.cat([C, torch.zeros_like(C[..., :1])], -1)  # (pc, K, nc, D + 1)
                row.append((C + self._weights(nsl)[None, :, :, None]).logsumexp(1))
            out.append(torch.cat(row, 1))
        return torch.cat(out, 0)

    def chain_log_prob(self, order):
        r"""Chain-rule terms along orderings ``(p, n|1, D)``: ``(p, n, D)`` whose entry
        ``t`` is :math:`\log p(x_{\pi_t} \mid x_{\pi_{t+1}}, \dots, x_{\pi_D})`."""
        return chain_terms(self.chain_partials(order), self.normalized)

    def ess(self, context=None):
        r"""Effective number of points of the posterior weights given a context.

        :math:`(\sum_k \omega_k)^2 / \sum_k \omega_k^2` with
        :math:`\omega_k = w_k \exp \sum_{r \in \mathcal R} T_{kr}`.

        :param torch.Tensor context: bool ``(q, n|1, D)``, or None for the
            posterior given all tokens.
        :returns: ``(q, n)``, or ``(n,)`` when ``context`` is None (detached).
        """
        with torch.no_grad():
            if context is None:
                base = self.joint()  # (K, n)
                return torch.exp(2 * base.logsumexp(0) - (2 * base).logsumexp(0))
            K, n, D = self.table.shape
            qs, ns = self._chunks(context.shape[0], n, K * D)
            zero = torch.zeros((), dtype=self.table.dtype, device=self.table.device)
            out = []
            for qsl in qs:
                row = []
                for nsl in ns:
                    ctx = context[qsl] if context.shape[1] == 1 else context[qsl, nsl]
                    lin = torch.where(ctx[:, None], self.table[:, nsl][None], zero).sum(-1)
                    base = self._weights(nsl)[None] + lin  # (qc, K, nc)
                    row.append(torch.exp(2 * base.logsumexp(1) - (2 * base).logsumexp(1)))
                out.append(torch.cat(row, 1))
            return torch.cat(out, 0)

    def __repr__(self):
        K, n, D = self.table.shape
        return f"MixtureTable(K={K}, n={n}, D={D}, normalized={self.normalized})"


# ---------------------------------------------------------------------- normalizing
def normalize_empty(den, context):
    r"""The empty-context rule: normalizers ``den`` ``(q, n)`` set to exactly 0 where the context is empty.

    With normalized weights (a prior, the rule's weights of a prior-centred
    grid, equally weighted prior draws) :math:`p(x_\emptyset) = 1`; setting it
    exactly makes the chain rule telescope to the mixture's evidence rather
    than to it minus the log of the weights' (rounded or estimated) total.

    :param torch.Tensor den: :math:`\log p(x_{\mathcal R_q})`, ``(q, n)``.
    :param torch.Tensor context: bool ``(q, n|1, D)``, True in the context.
    :returns: ``(q, n)``.

    Example::

        >>> num, den = chunk.mask_partials((~mask).to(dtype))
        >>> log_cond = num - normalize_empty(den, ~mask)[..., None]
    """
    empty = ~context.any(-1)  # (q, n|1)
    return torch.where(empty, torch.zeros_like(den), den)


def chain_terms(suffix, normalized=True):
    r"""Chain-rule terms from suffix log-sums ``(p, n, D + 1)``: ``(p, n, D)``.

    Entry ``t`` is :math:`L_t - L_{t+1}`, with :math:`L_t` the log-sum of the
    joint of the tokens from position ``t`` on (:meth:`MixtureChunk.chain_partials`);
    with ``normalized`` the last entry (no token: the empty context) is 0.

    Example::

        >>> chain_terms(chunk.chain_partials(order, 2**24))  # (p, n, D)
    """
    if normalized:
        suffix = torch.cat([suffix[..., :-1], torch.zeros_like(suffix[..., -1:])], -1)
    return suffix[..., :-1] - suffix[..., 1:]


def combine_partials(total, part):
    """Add the partial log-sums ``part`` of one chunk of points (a tuple) to ``total`` (None at first).

    Example::

        >>> total = None
        >>> for chunk in chunks:
        ...     total = combine_partials(total, chunk.mask_partials(ctx))
    """
    if total is None:
        return part
    return tuple(torch.logaddexp(a, b) for a, b in zip(part, total))


# ---------------------------------------------------------------------- exp-space
def exp_floor(dtype):
    """``log(sqrt(tiny))`` of ``dtype``.

    Exponents are clamped here so that no exp, product or sum meets subnormal
    numbers (which are slow on CPUs); the clamp changes a sum of ``Q_c`` terms
    by at most ``Q_c * sqrt(tiny)``.
    """
    return 0.5 * math.log(torch.finfo(dtype).tiny)


def stable_logsumexp(t, dim):
    """``torch.logsumexp`` without subnormals (see :func:`exp_floor`); keeps ``-inf``.

    Example::

        >>> stable_logsumexp(torch.tensor([0.0, -math.inf]), 0)  # tensor(0.)
    """
    m = t.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp((t - m).clamp_min(exp_floor(t.dtype))).sum(dim, keepdim=True)
    out = (s.log() + m).squeeze(dim)
    allneg = torch.isneginf(t).all(dim)
    return torch.where(allneg, torch.full_like(out, -math.inf), out) if bool(allneg.any()) else out


class MixtureChunk:
    r"""One chunk of ``Q_c`` points of a mixture, in the layout of the matrix-product reductions.

    :param torch.Tensor log_weights: :math:`\log w_k`, ``(r, Q_c)`` with ``r``
        1 (shared) or ``n``.
    :param torch.Tensor table: :math:`T_{ikd} = \log p(x_{id} \mid z_k)`,
        ``(n, Q_c, D)``.

    The reductions return *unnormalized* partial log-sums over the chunk's
    points; combine chunks with :func:`combine_partials`.

    Example::

        >>> chunk = MixtureChunk(torch.full((1, S), -math.log(S)), T)  # T (n, S, D)
        >>> num, den = chunk.mask_partials((~mask).to(T.dtype))
    """

    __slots__ = ("log_weights", "table", "_shift", "_exp_table")

    def __init__(self, log_weights, table):
        self.log_weights = log_weights
        self.table = table
        self._shift = None
        self._exp_table = None

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

    def joint(self):
        """Per-point log-joints ``log w + sum_d T``, ``(n, Q_c)``."""
        return self.log_weights + self.table.sum(-1)

    def mask_partials(self, ctx):
        """Partial log-sums for context masks ``ctx`` (float, 1 in the context) ``(q, r, D)``.

        :returns: ``(num, den)``, shapes ``(q, n, D)`` and ``(q, n)``, with
            ``num[q, i, j] = logsumexp_k(logw_k + (T_i ctx_q)_k + T_ikj)`` and
            ``den[q, i] = logsumexp_k(logw_k + (T_i ctx_q)_k)``.

        Both are matrix products in exp-space with max shifts, differentiated by
        hand (``_MaskPartials``); where a product underflows against the
        clamped exponents the whole chunk is redone with autograd and an exact
        log-sum-exp at those entries.
        """
        B, mT = self.exp_table()  # (n, Qc, D), (n, 1, D)
        num, den, bad = _MaskPartials.apply(self.log_weights, self.table, ctx, B, mT)
        if bool(bad.any()):
            return self._mask_partials_exact(ctx)
        return num.transpose(0, 1), den.T

    def _mask_partials_exact(self, ctx):
        """:meth:`mask_partials` by autograd, with an exact log-sum-exp where the products underflow."""
        logw, T = self.log_weights, self.table
        n, Qc, D = T.shape
        base = logw[:, None, :] + _context_sums(T, ctx)  # (n, q, Qc)
        mb = base.detach().amax(-1, keepdim=True)
        mb = torch.where(torch.isfinite(mb), mb, torch.zeros_like(mb))
        floor = exp_floor(T.dtype)
        A = torch.exp((base - mb).clamp_min(floor))
        den = mb.squeeze(-1) + A.sum(-1).log()  # (n, q)
        mT = self.exp_table()[1]
        B = torch.exp((T - mT).clamp_min(floor))
        S = torch.bmm(A, B)  # (n, q, D)
        bad = _underflow(S.detach(), Qc)
        num = torch.where(bad, torch.ones_like(S), S).log() + mb + mT
        i, k, j = bad.nonzero(as_tuple=True)
        exact = stable_logsumexp(base[i, k, :] + T[i, :, j], -1)
        num = num.index_put((i, k, j), exact)
        return num.transpose(0, 1), den.T

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


def _context_sums(T, ctx):
    """``(n, q, Q_c)``: each point's log-likelihood of each query's context, ``sum_d ctx_qd T_ikd``."""
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
    def forward(fctx, logw, T, ctx, B, mT):
        n, Qc, D = T.shape
        base = logw[:, None, :] + _context_sums(T, ctx)  # (n, q, Qc)
        mb = base.amax(-1, keepdim=True)
        mb = torch.where(torch.isfinite(mb), mb, torch.zeros_like(mb))
        A = base.sub_(mb).clamp_min_(exp_floor(T.dtype)).exp_()
        sA = A.sum(-1)
        den = mb.squeeze(-1) + sA.log()
        S = torch.bmm(A, B)  # (n, q, D)
        bad = _underflow(S, Qc)
        num = torch.where(bad, torch.ones_like(S), S).log_().add_(mb).add_(mT)
        fctx.save_for_backward(A, sA, S, B, ctx)
        fctx.logw_rows = logw.shape[0]
        fctx.mark_non_differentiable(bad)
        return num, den, bad

    @staticmethod
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
        return grad_logw if fctx.needs_input_grad[0] else None, grad_T, None, None, None
