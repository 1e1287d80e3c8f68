r"""The dense kernels of the Gaussian engine, for a full covariance :math:`\Sigma`:
the exact log-density from a Cholesky factor, masked conditionals with the context
block embedded in a :math:`D\times D` matrix, and the chain rule from one factor
of the permuted covariance.
"""

import torch

from .gaussian_linalg import LOG_2PI, cholesky, gather_tokens, missing_as_standard_normal, normal_log_prob


def dense_log_prob(m, x, observed=None):
    r""":math:`\log\mathcal N(x; \mu, \Sigma)` per datapoint, ``(n,)``, from a Cholesky
    factor of :math:`\Sigma`; with ``observed`` the density of each observed
    sub-vector (the missing tokens as in :func:`lowrank_log_prob`)."""
    r = x - m.loc  # (n, D)
    if observed is None:
        L = m.factor if m.factor is not None else cholesky(m.covariance, "covariance", m.site)
    else:
        o, missing = missing_as_standard_normal(observed, x)
        r = r * o
        S = m.covariance * (o.unsqueeze(-1) * o.unsqueeze(-2)) + torch.diag_embed(1.0 - o)  # (n, D, D)
        L = cholesky(S, "covariance", m.site)
    if L.shape[0] == 1:
        # a factor shared by the batch solves all residuals as the columns of one
        # matrix: broadcast against each datapoint's column, the solve and its
        # gradient would hold an (n, D, D) copy of the factor (67x slower at
        # n=1000, D=100)
        u = torch.linalg.solve_triangular(L[0], r.transpose(-1, -2), upper=False).transpose(-1, -2)
    else:
        u = torch.linalg.solve_triangular(L, r.unsqueeze(-1), upper=False).squeeze(-1)
    logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
    out = -0.5 * (x.shape[-1] * LOG_2PI + logdet + u.pow(2).sum(-1))
    return out if observed is None else out + missing


def dense_masks(m, x, mask):
    """Dense conditionals for masks ``(q, n|1, D)``; returns ``(q, n, D)``."""
    S = m.covariance  # (r, D, D)
    ctx = (~mask).to(x.dtype)  # (q, m, D)
    cS = ctx.unsqueeze(-1) * S  # rows of the context, (q, m', D, D)
    S_ctx = cS * ctx.unsqueeze(-2) + torch.diag_embed(1.0 - ctx)
    L = cholesky(S_ctx, "context covariance S_RR", m.site)
    resid = x - m.loc
    alpha = torch.cholesky_solve((ctx * resid).unsqueeze(-1), L)  # (q, n, D, 1)
    mean = (S @ alpha).squeeze(-1)
    B = torch.linalg.solve_triangular(L, cS, upper=False)
    var = torch.diagonal(S, dim1=-2, dim2=-1) - B.pow(2).sum(-2)
    # context tokens have variance ~0 (they are known); keep them finite so that
    # gradients through the caller's masking stay finite
    var = torch.where(mask, var, torch.ones((), dtype=var.dtype, device=var.device))
    mean = torch.where(mask, mean, resid)
    return normal_log_prob(resid, mean, var)


def dense_chain(m, x, order):
    """Chain rule from one Cholesky factor of the reversed-order covariance."""
    S = m.covariance  # (r, D, D)
    rev = order.flip(-1)  # Cholesky conditions each token on those before it
    p, rows, D = rev.shape
    k = max(rows, S.shape[0])
    idx = rev.expand(p, k, D)
    Sp = S.unsqueeze(0).expand(p, k, D, D)
    Sp = torch.gather(Sp, 2, idx.unsqueeze(-1).expand(p, k, D, D))
    Sp = torch.gather(Sp, 3, idx.unsqueeze(-2).expand(p, k, D, D))
    L = cholesky(Sp, "covariance", m.site)
    resid = gather_tokens(x - m.loc, rev)  # (p, n, D)
    u = torch.linalg.solve_triangular(L, resid.unsqueeze(-1), upper=False).squeeze(-1)
    diag = torch.diagonal(L, dim1=-2, dim2=-1)
    logc = -0.5 * (LOG_2PI + u.pow(2)) - diag.log()
    return logc.flip(-1)
