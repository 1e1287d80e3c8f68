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
table in chunks of points,
:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk`, whose mask
reduction is two matrix products in exp-space; a table too large to keep is
streamed. The unnormalized partial sums of the chunks are combined with
:func:`combine_partials` and normalized once: :func:`normalize_empty` (the
empty context has normalizer one) and :func:`chain_terms`.
"""


import torch

from .mixture_chunks import exp_floor, others_sum, stable_logsumexp

__all__ = ["MixtureTable", "combine_partials", "normalize_empty", "chain_terms"]


def _slices(total, step):
    return [slice(s, min(total, s + step)) for s in range(0, total, step)]


class _Numerators(torch.autograd.Function):
    r""":math:`\nu_{qij} = \operatorname{logsumexp}_k(b_{qki} + T_{kij})`, ``(q, n, D)``, from ``base``
    ``(q, K, n)`` and ``T`` ``(K, n, D)``, keeping only its inputs and output for the backward pass:

    .. math::

        \frac{\partial L}{\partial b_{qki}} = \sum_j G_{qij}\, e^{b_{qki} + T_{kij} - \nu_{qij}}, \qquad
        \frac{\partial L}{\partial T_{kij}} = \sum_q G_{qij}\, e^{b_{qki} + T_{kij} - \nu_{qij}}.

    Its ``(q, K, n, D)`` terms are the largest tensors of a mask reduction; recorded by
    autograd, two copies of them (the clamp's input and the exponential) were kept for the
    backward pass, ``K`` times the ``chunk_size`` elements of a block (a Bernoulli mixture,
    K = 100, D = 50, 500 datapoints, masks="all": 0.85 GB saved at ``chunk_size=2**20``).
    The backward pass is written with differentiable operations, so second derivatives
    still flow through it. Terms clamped in the forward pass (see
    :func:`~pyro_mpt.conditionals.mixture_chunks.exp_floor`) are treated as unclamped (their
    share of a sum is below its rounding); ``-inf`` terms get no gradient.
    """

    @staticmethod
    def forward(fctx, base, T):
        out = stable_logsumexp(base[..., None] + T[None], 1)
        fctx.save_for_backward(base, T, out)
        return out

    @staticmethod
    def backward(fctx, G):
        base, T, out = fctx.saved_tensors
        floor = exp_floor(base.dtype)
        if torch.is_grad_enabled():  # a graph for second derivatives: out of place
            share = torch.exp((base[..., None] + T[None] - out[:, None]).clamp_min(floor))
        else:
            share = (base[..., None] + T[None]).sub_(out[:, None]).clamp_min_(floor).exp_()  # (q, K, n, D)
        if not (bool(torch.isfinite(T).all()) and bool(torch.isfinite(base).all())):
            zero = torch.zeros((), dtype=share.dtype, device=share.device)
            share = torch.where(torch.isneginf(base[..., None] + T[None]) | torch.isneginf(out)[:, None], zero, share)
        share = share * G[:, None] if torch.is_grad_enabled() else share.mul_(G[:, None])
        grad_base = share.sum(-1) if fctx.needs_input_grad[0] else None
        grad_T = share.sum(0) if fctx.needs_input_grad[1] else None
        return grad_base, grad_T


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

    def leave_one_out(self):
        r""":math:`\log p(x_j \mid x_{-j})` of every token given all the others, ``(n, D)``,
        from one pass over the table (queries that each hide one token, the ``"pll"``
        schedule, would take one each): with :math:`c_{kj} = \log w_k + \sum_{d\ne j}T_{kd}`,
        :math:`\operatorname{logsumexp}_k[c_{kj} + T_{kj}] - \operatorname{logsumexp}_k c_{kj}`.
        The sums over the other tokens are :func:`~pyro_mpt.conditionals.mixture_chunks.others_sum`'s
        (a difference of sums lost the digits of an ordinary token beside a near-impossible
        one: 0.12 nats off in float32 a leave-one-out conditional of a GMM). None when the
        table has an infinite entry (an impossible token given a point).

        Example::

            >>> table.leave_one_out()   # (n, D), or None
        """
        T = self.table
        if not bool(torch.isfinite(T).all()):
            return None
        c = self.log_weights.unsqueeze(-1) + others_sum(T, -1)
        return stable_logsumexp(c + T, 0) - stable_logsumexp(c, 0)

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
                row_den.append(stable_logsumexp(base, 1))
                row_num.append(_Numerators.apply(base, T))  # (qc, nc, D)
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
                row.append(stable_logsumexp(C + self._weights(nsl)[None, :, :, None], 1))
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
    joint of the tokens from position ``t`` on (:meth:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk.chain_partials`);
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
