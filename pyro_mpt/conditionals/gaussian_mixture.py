r"""Masked conditionals of a finite mixture of Gaussians over the tokens.

The counterpart of :class:`~pyro_mpt.conditionals.mixture.MixtureTable` for
components that are Gaussian but not factorized over the tokens (e.g. a
mixture of PPCA), used by :mod:`~pyro_mpt.conditionals.enumerate`.
"""

import math

import torch

from .base import ordering_ranks
from .gaussian_dense_precision import dense_context_conditionals
from .mixture import normalize_empty
from .mixture_chunks import stable_logsumexp

__all__ = ["GaussianMixtureTable"]


def _solve_rows(L, b):
    """``A^-1 b_i`` for rows ``b`` ``(..., n, R)`` and Cholesky factors ``L`` ``(..., n|1, R, R)``
    of ``A``. A factor shared by the rows solves them as the columns of one right-hand side:
    broadcast against each row's column instead, the solves and their gradients held a
    ``(..., n, R, R)`` copy of it (a Gaussian mixture with D = 50, masks shared: 46 s a step)."""
    if L.shape[-3] == 1:
        return torch.cholesky_solve(b.transpose(-1, -2), L[..., 0, :, :]).transpose(-1, -2)
    return torch.cholesky_solve(b.unsqueeze(-1), L)[..., 0]


def _matmul_rows(M, b):
    """``M_i b_i`` for rows ``b`` ``(..., n, B)`` and matrices ``M`` ``(..., n|1, A, B)``, ``(..., n, A)``
    (a matrix shared by the rows: one product with all of them)."""
    if M.shape[-3] == 1:
        return b @ M[..., 0, :, :].transpose(-1, -2)
    return (M @ b.unsqueeze(-1))[..., 0]


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
    datapoints; contexts drawn per datapoint with covariances shared by the batch go
    to :class:`~pyro_mpt.conditionals.gaussian_dense_independent.DenseContextConditionals`,
    whose backward pass is written out. Same interface as :class:`~pyro_mpt.conditionals.mixture.MixtureTable` for masks and evidence.

    :param torch.Tensor log_weights: ``(K,)`` or ``(K, n)``.
    :param torch.Tensor loc: :math:`\mu_k`, ``(K, n|1, D)``.
    :param torch.Tensor covariance: :math:`\Sigma_k`, ``(K, n|1, D, D)``, or None with
        ``low_rank``.
    :param torch.Tensor x: the tokens, ``(n, D)``.
    :param int max_elements: bound on ``q * K * n * D * D`` per chunk of queries.
    :param tuple low_rank: :math:`\Sigma_k = F_kF_k^\top + \operatorname{diag}(\psi_k)`
        as ``(F (K, n|1, D, R), psi (K, n|1, D))``, for components of rank
        :math:`R < D` (e.g. a mixture of PPCA): each context is then handled by the
        Woodbury identity, :math:`R\times R` factorizations instead of :math:`D\times D`.
    """

    def __init__(self, log_weights, loc, covariance, x, *, normalized=True, max_elements=2**24, low_rank=None):
        if log_weights.dim() == 1:
            log_weights = log_weights[:, None]
        self.log_weights = log_weights  # (K, n|1)
        self.loc = loc
        self.covariance = covariance
        self.low_rank = low_rank
        self.x = x
        self.normalized = bool(normalized)
        self.max_elements = int(max_elements)

    def _lowrank_partials(self, context):
        r"""``_partials`` for low-rank components: with :math:`c` the context indicator,
        :math:`\Lambda = I + F^\top\operatorname{diag}(c/\psi)F`, :math:`\hat z =
        \Lambda^{-1}F^\top\operatorname{diag}(c/\psi)r` and :math:`e = r - F\hat z`, the
        context density has :math:`r_{\mathcal R}^\top\Sigma_{\mathcal R\mathcal R}^{-1}r_{\mathcal R}
        = \sum_{j\in\mathcal R}e_j^2/\psi_j + \hat z^\top\hat z` (two small non-negative
        terms, where the Woodbury form subtracts two large ones) and log-determinant
        :math:`\sum_{j\in\mathcal R}\log\psi_j + \log\det\Lambda`; a target's conditional
        has mean :math:`F_j\hat z` and variance :math:`\psi_j + F_j\Lambda^{-1}F_j^\top`."""
        F, psi = self.low_rank  # (K, n|1, D, R), (K, n|1, D)
        c = context[:, None].to(F.dtype)  # (q, 1, n|1, D)
        cw = c / psi  # (q, K, n|1, D)
        Lam = (F * cw.unsqueeze(-1)).transpose(-1, -2) @ F
        Lam.diagonal(dim1=-2, dim2=-1).add_(1)
        L = torch.linalg.cholesky(Lam)  # (q, K, n|1, R, R)
        r = self.x - self.loc[None]  # (1, K, n, D)
        # F^T (c r / psi) row by row; a loading shared by the rows makes it one product with all
        # of them (as a batch of (1, D) @ (D, R) products it was a third of a step)
        eta = _matmul_rows(F.transpose(-1, -2), cw * r)  # (q, K, n, R)
        zhat = _solve_rows(L, eta)
        e = r - _matmul_rows(F, zhat)
        quad = (c * e * e / psi).sum(-1) + zhat.pow(2).sum(-1)
        logdet = (c * psi.log()).sum(-1) + 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
        log_pR = -0.5 * (quad + logdet + c.sum(-1) * math.log(2 * math.pi))  # (q, K, n)
        V = torch.linalg.solve_triangular(L, F.transpose(-1, -2), upper=False)  # (q, K, n|1, R, D)
        var = psi + V.pow(2).sum(-2)
        # e is also the targets' residual from their conditional mean F_j zhat
        log_c = -0.5 * (e * e / var + var.log() + math.log(2 * math.pi))  # (q, K, n, D)
        return self._mix(log_c, log_pR)

    def _mix(self, log_c, log_pR):
        """``(num, den)`` of :meth:`_partials` from the components' log-conditionals
        ``(q, K, n, D)`` and context log-densities ``(q, K, n)``."""
        base = self.log_weights[None] + log_pR  # (q, K, n)
        return stable_logsumexp(base[..., None] + log_c, 1), stable_logsumexp(base, 1)

    def _partials(self, context, keep_elements=0):
        """``(num (q, n, D), den (q, n))`` for contexts ``(q, n|1, D)``; ``keep_elements``:
        what the per-datapoint path may keep for its backward pass."""
        if self.low_rank is not None:
            return self._lowrank_partials(context)
        D = self.x.shape[1]
        if context.shape[1] > 1 and self.covariance.shape[1] == 1:
            # contexts per datapoint, covariances shared: the components' pieces with their backward
            # pass written out, in cache-sized chunks (recorded op by op, the factorizations' and
            # solves' backward passes made a full-covariance GMM's default loss 0.9 s a step at D = 50)
            return self._mix(*dense_context_conditionals(
                self.covariance[:, 0], self.x, self.loc, context, self.max_elements, None, keep_elements
            ))
        cq = context[:, None]  # (q, 1, n|1, D)
        C = self.covariance[None]  # (1, K, n|1, D, D)
        eye = torch.eye(D, dtype=C.dtype, device=C.device)
        Ct = torch.where(cq[..., :, None] & cq[..., None, :], C, eye)
        L = torch.linalg.cholesky(Ct)
        zero = torch.zeros((), dtype=C.dtype, device=C.device)
        r = torch.where(cq, self.x - self.loc[None], zero)  # (q, K, n, D)
        a = _solve_rows(L, r)
        logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)  # (q, K, n|1)
        size = cq.sum(-1).to(C.dtype)
        log_pR = -0.5 * ((r * a).sum(-1) + logdet + size * math.log(2 * math.pi))  # (q, K, n)
        mean = self.loc[None] + _matmul_rows(C, a)
        G = torch.where(cq[..., :, None], C, zero)  # rows in the context
        Y = torch.linalg.solve_triangular(L, G, upper=False)
        var = torch.diagonal(C, dim1=-2, dim2=-1) - Y.pow(2).sum(-2)
        # context tokens get a finite placeholder (their "conditional" is not asked for)
        var = torch.where(cq, torch.ones((), dtype=C.dtype, device=C.device), var)
        log_c = -0.5 * ((self.x - mean).pow(2) / var + var.log() + math.log(2 * math.pi))  # (q, K, n, D)
        return self._mix(log_c, log_pR)

    def log_conditionals(self, context, target=None):
        r""":math:`\log p(x_j \mid x_{\mathcal R_q})` for contexts ``(q, n|1, D)``, ``(q, n, D)``."""
        K, n, D = self.loc.shape[0], self.x.shape[0], self.x.shape[1]
        per = max(1, self.max_elements // max(1, K * n * D * D))
        outs = []
        # the query chunks share max_elements of tables kept for the backward pass (the
        # estimate's blocks after the first are recomputed whole, one at a time)
        keep = self.max_elements // -(-context.shape[0] // per)
        for start in range(0, context.shape[0], per):
            c = context[start : start + per]
            num, den = self._partials(c, keep)
            if self.normalized:
                den = normalize_empty(den, c)
            outs.append(num - den[..., None])
        out = torch.cat(outs, 0)
        if target is not None:
            out = torch.where(target, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

    def leave_one_out(self):
        r""":math:`\log p(x_j \mid x_{-j})` of every token given all the others, ``(n, D)``,
        from one factorization of each component's covariance (queries that each hide one
        token, the ``"pll"`` schedule, would take one per token). With the component's
        precision :math:`\Lambda_k = \Sigma_k^{-1}` and :math:`r_k = x - \mu_k`, its
        leave-one-out conditional :math:`\ell_{kj} = \log p_k(x_j \mid x_{-j})` has
        precision :math:`\Lambda_{k,jj}` and mean residual :math:`(\Lambda_kr_k)_j/\Lambda_{k,jj}`
        (Rasmussen & Williams 2006, eqs. 5.10--5.12), and since
        :math:`p(x_{-j}) = \sum_k w_k\,p_k(x)/p_k(x_j \mid x_{-j})`,

        .. math::

            \log p(x_j \mid x_{-j}) = \operatorname{logsumexp}_k[\log w_k + \log p_k(x)]
                - \operatorname{logsumexp}_k[\log w_k + \log p_k(x) - \ell_{kj}].

        Example::

            >>> table.leave_one_out()   # (n, D)
        """
        if self.low_rank is not None:
            F, psi = self.low_rank  # (K, n|1, D, R), (K, n|1, D)
            cov = F @ F.transpose(-1, -2) + torch.diag_embed(psi)
        else:
            cov = self.covariance  # (K, n|1, D, D)
        L = torch.linalg.cholesky(cov)
        prec = torch.cholesky_inverse(L)
        r = self.x - self.loc  # (K, n, D)
        pr = _matmul_rows(prec, r)
        D = self.x.shape[1]
        log_p = -0.5 * ((r * pr).sum(-1) + 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1) + D * math.log(2 * math.pi))
        d = torch.diagonal(prec, dim1=-2, dim2=-1)
        ell = -0.5 * (math.log(2 * math.pi) - d.log() + pr.pow(2) / d)  # (K, n, D)
        base = self.log_weights + log_p  # (K, n)
        return stable_logsumexp(base, 0).unsqueeze(-1) - stable_logsumexp(base.unsqueeze(-1) - ell, 0)

    def log_evidence(self, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        if observed is None:  # one context for every datapoint: each component factored once
            context = torch.ones_like(self.x[:1], dtype=torch.bool)
        else:
            context = observed
        return self._partials(context[None])[1][0]

    def chain_log_prob(self, order):
        r"""Chain-rule terms along orderings ``(p, n|1, D)``, ``(p, n, D)`` (one mask per position)."""
        p, rows, D = order.shape
        ranks = ordering_ranks(order)
        t = torch.arange(D, device=order.device)
        context = ranks[:, None] > t[None, :, None, None]  # (p, D, rows, D): context after position t
        logc = self.log_conditionals(context.reshape(p * D, rows, D)).reshape(p, D, -1, D)
        target = order.expand(p, logc.shape[2], D).transpose(1, 2)[..., None]  # (p, D, n, 1)
        return logc.gather(-1, target)[..., 0].transpose(1, 2)
