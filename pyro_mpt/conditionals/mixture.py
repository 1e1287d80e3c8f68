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

Engines that stream their points in chunks (a table too large to keep) combine
the unnormalized partial sums of :meth:`MixtureTable.mask_partials`,
:meth:`MixtureTable.chain_partials` and :meth:`MixtureTable.joint` across
chunks with ``torch.logaddexp`` and normalize once.
"""

import math

import torch

__all__ = ["MixtureTable", "GaussianMixtureTable"]


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
        if not self.normalized:
            return den
        empty = ~context.any(-1)  # (q, n|1)
        return torch.where(empty, torch.zeros_like(den), den)

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
        L = self.chain_partials(order)
        if self.normalized:
            L = torch.cat([L[..., :-1], torch.zeros_like(L[..., -1:])], -1)
        return L[..., :-1] - L[..., 1:]

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


class GaussianMixtureTable:
    r"""A finite mixture of Gaussians over the tokens, per datapoint.

    For mixtures whose components are Gaussian but not factorized (e.g. a
    mixture of PPCA: a discrete latent plus Normal latents),
    :math:`p(x) = \sum_k w_k\, \mathcal N(x; \mu_k, \Sigma_k)`, the conditionals
    are ratios of sums over the components of Gaussian marginals and
    conditionals:

    .. math::

        p(x_j \mid x_{\mathcal R}) = \frac{\sum_k w_k\,
            \mathcal N(x_{\mathcal R}; \mu_{k\mathcal R}, \Sigma_{k\mathcal R\mathcal R})\,
            p_k(x_j \mid x_{\mathcal R})}{\sum_k w_k\,
            \mathcal N(x_{\mathcal R}; \mu_{k\mathcal R}, \Sigma_{k\mathcal R\mathcal R})}.

    Each context is handled by one batched Cholesky factorization of
    :math:`\Sigma_k` with the rows and columns outside :math:`\mathcal R`
    replaced by those of the identity, vectorized over queries, components and
    datapoints. Same interface as :class:`MixtureTable` for masks and evidence.

    :param torch.Tensor log_weights: ``(K,)`` or ``(K, n)``.
    :param torch.Tensor loc: :math:`\mu_k`, ``(K, n|1, D)``.
    :param torch.Tensor covariance: :math:`\Sigma_k`, ``(K, n|1, D, D)``.
    :param torch.Tensor x: the tokens, ``(n, D)``.
    :param int max_elements: bound on ``q * K * n * D * D`` per chunk of queries.
    """

    def __init__(self, log_weights, loc, covariance, x, *, normalized=True, max_elements=2**24):
        if log_weights.dim() == 1:
            log_weights = log_weights[:, None]
        self.log_weights = log_weights  # (K, n|1)
        self.loc = loc
        self.covariance = covariance
        self.x = x
        self.normalized = bool(normalized)
        self.max_elements = int(max_elements)

    def _partials(self, context):
        """``(num (q, n, D), den (q, n))`` for contexts ``(q, n|1, D)``."""
        D = self.x.shape[1]
        cq = context[:, None]  # (q, 1, n|1, D)
        C = self.covariance[None]  # (1, K, n|1, D, D)
        eye = torch.eye(D, dtype=C.dtype, device=C.device)
        Ct = torch.where(cq[..., :, None] & cq[..., None, :], C, eye)
        L = torch.linalg.cholesky(Ct)
        zero = torch.zeros((), dtype=C.dtype, device=C.device)
        r = torch.where(cq, self.x - self.loc[None], zero)  # (q, K, n, D)
        Lb = L.expand(r.shape[:-1] + (D, D)) if L.shape[-3] != r.shape[-2] else L
        y = torch.linalg.solve_triangular(Lb, r[..., None], upper=False)
        a = torch.linalg.solve_triangular(Lb.transpose(-1, -2), y, upper=True)[..., 0]
        logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)  # (q, K, n|1)
        size = cq.sum(-1).to(C.dtype)
        log_pR = -0.5 * ((r * a).sum(-1) + logdet + size * math.log(2 * math.pi))  # (q, K, n)
        mean = self.loc[None] + (C @ a[..., None])[..., 0]
        G = torch.where(cq[..., :, None], C, zero)  # rows in the context
        Y = torch.linalg.solve_triangular(L, G, upper=False)
        var = torch.diagonal(C, dim1=-2, dim2=-1) - Y.pow(2).sum(-2)
        # context tokens get a finite placeholder (their "conditional" is not asked for)
        var = torch.where(cq, torch.ones((), dtype=C.dtype, device=C.device), var)
        log_c = -0.5 * ((self.x - mean).pow(2) / var + var.log() + math.log(2 * math.pi))  # (q, K, n, D)
        base = self.log_weights[None] + log_pR
        return (base[..., None] + log_c).logsumexp(1), base.logsumexp(1)

    def log_conditionals(self, context, target=None):
        r""":math:`\log p(x_j \mid x_{\mathcal R_q})` for contexts ``(q, n|1, D)``, ``(q, n, D)``."""
        K, n, D = self.loc.shape[0], self.x.shape[0], self.x.shape[1]
        per = max(1, self.max_elements // max(1, K * n * D * D))
        outs = []
        for start in range(0, context.shape[0], per):
            c = context[start : start + per]
            num, den = self._partials(c)
            if self.normalized:
                den = torch.where(c.any(-1), den, torch.zeros_like(den))
            outs.append(num - den[..., None])
        out = torch.cat(outs, 0)
        if target is not None:
            out = torch.where(target, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

    def log_evidence(self, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        context = torch.ones_like(self.x, dtype=torch.bool) if observed is None else observed
        return self._partials(context[None])[1][0]

    def chain_log_prob(self, order):
        r"""Chain-rule terms along orderings ``(p, n|1, D)``, ``(p, n, D)`` (one mask per position)."""
        p, rows, D = order.shape
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(D, device=order.device).expand_as(order))
        t = torch.arange(D, device=order.device)
        context = ranks[:, None] > t[None, :, None, None]  # (p, D, rows, D): context after position t
        logc = self.log_conditionals(context.reshape(p * D, rows, D)).reshape(p, D, -1, D)
        target = order.expand(p, logc.shape[2], D).transpose(1, 2)[..., None]  # (p, D, n, 1)
        return logc.gather(-1, target)[..., 0].transpose(1, 2)
