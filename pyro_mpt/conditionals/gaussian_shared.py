r"""Summed conditionals of the Gaussian engine for masks shared by the batch: each
mask's factor computed once, the data entering through batched matrix products
over its gathered targets (masks grouped by size), low-rank and dense.
"""

import torch

from .gaussian_embedded import EmbeddedSums
from .gaussian_linalg import LOG_2PI, cholesky, posterior_precision_factor, tril_inverse


#: whole residual table (memory-bound gathers cost more than the extra products)
EMBEDDED_MAX_RANK = 8

#: elements of a block's gathered tables (masks x data x tokens) below which its
#: masks are evaluated in one group however different their sizes
SMALL_TABLE = 2**20


def shared_sums_elements(n, D, R=None):
    r"""Elements a mask of the shared-mask sums keeps for the backward pass, for ``n``
    datapoints of ``D`` tokens, as measured by autograd's saved-tensor hooks (masks of
    random sizes, ``n`` from 1 to 1000, ``D`` from 50 to 2000): :math:`2nD + 7DR` for
    :func:`lowrank_shared_sums` (its gathered loading rows, their products and its
    residual tables), :math:`nD/2 + 5D(R + 1)` for :func:`lowrank_shared_sums_embedded`
    (:math:`R \le` ``EMBEDDED_MAX_RANK``), :math:`2nD + 5D^2` for
    :func:`dense_shared_sums` (``R`` None: its covariance blocks and their factors).
    With few datapoints of many tokens the per-mask factors dominate.

    :param int n: datapoints.
    :param int D: tokens per datapoint.
    :param int R: the rank of the shared loading (low-rank path), or None (dense path).
    :returns: int.

    Example::

        >>> shared_sums_elements(1, 1000, 86)   # one datapoint of 1000 tokens, rank 86
        604000
    """
    if R is None:
        return 2 * n * D + 5 * D * D
    if R <= EMBEDDED_MAX_RANK:
        return n * D // 2 + 5 * D * (R + 1)
    return 2 * n * D + 7 * D * R


def shared_groups(mask, n, per_mask):
    r"""Masks ``(q, D)`` shared by the batch, in groups of similar size.

    Yields ``(rows, order, size)``: the group's rows of ``mask``, each mask's
    tokens with the context first (``order``, ``(g, D)``: a stable sort of the
    mask, so the context tokens and the targets each stay in token order) and
    its target count ``size`` ``(g,)``. Masks are sorted by size so that a
    group's gathered tables are padded to sizes close to each mask's own; a
    group holds at most ``per_mask(M_max)`` masks.
    """
    size = mask.sum(-1)
    by_size = torch.argsort(size, stable=True)
    order = torch.argsort(mask.to(torch.uint8), dim=-1, stable=True)
    sizes = size[by_size].tolist()  # one host sync per block
    D = mask.shape[-1]
    # padding to the group's largest size wastes (spread / D) of the work; small
    # tables are cheaper in one group than in several (fewer kernel launches)
    small = len(sizes) * n * D <= SMALL_TABLE
    start = 0
    while start < len(sizes):
        end = start + 1
        # grow the group while it fits the budget at its largest (last) mask's size
        while end < len(sizes) and end - start < per_mask(sizes[end]) and (
            small or sizes[end] - sizes[start] <= max(4, D // 8)
        ):
            end += 1
        rows = by_size[start:end]
        yield rows, order[rows], size[rows]
        start = end


def padded_targets(order, size, M):
    """Target tokens of each mask, padded to ``M``: ``(g, M)`` indices and validity.

    The targets are the last ``size`` entries of ``order``; the padding entries
    are context tokens, flagged invalid."""
    D = order.shape[-1]
    idx = order[:, D - M :]
    valid = torch.arange(D - M, D, device=order.device) >= (D - size).unsqueeze(-1)
    return idx, valid


def lowrank_shared_sums(m, x, mask, max_elements, data):
    r"""Summed Woodbury log-conditionals for masks ``(q, D)`` shared by the batch.

    Returns ``(q, n)``. With :math:`r = x - \mu = e + F\hat z` (:math:`\hat z` the
    full-data posterior mean, :math:`e` its residual), the masked residual of a
    mask with targets :math:`\mathcal M` and context :math:`\mathcal R` is
    :math:`r_{\mathcal M} - F_{\mathcal M}\Lambda^{-1}F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1} r_{\mathcal R}
    = e_{\mathcal M} + F_{\mathcal M}\Lambda^{-1}(\hat z - F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}e_{\mathcal R})`
    for any :math:`\hat z`: small centred terms, no cancellation between large
    ones (which matters in float32). Each mask's precision
    :math:`\Lambda = I + F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}`, its
    factor :math:`L`, :math:`V = L^{-1}F_{\mathcal M}^\top` (hence the variances
    :math:`\psi_j + \lVert V_{:j}\rVert^2`) and :math:`L^{-1}F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}`
    are computed once per mask; the data enter through batched matrix products
    over the gathered context and target residuals, :math:`O(nDR)` per mask.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    n, D = x.shape
    R = F.shape[-1]
    eye = torch.eye(R, dtype=x.dtype, device=x.device)
    Fp, eT, zhat = data["Fp"], data["eT"], data["zhat"]
    parts = []
    for rows, order, size in shared_groups(mask, n, lambda M: max_elements // max(1, 3 * n * D + D * R)):
        g = rows.shape[0]
        M, C = int(size.max()), D - int(size.min())
        if M == 0:
            parts.append((rows, x.new_zeros(g, n)))
            continue
        idx, valid = padded_targets(order, size, M)  # (g, M)
        v = valid.to(x.dtype)
        Fm = F[idx] * v.unsqueeze(-1)  # (g, M, R), zero at padding
        psim = psi[idx]
        if C > 0:
            cidx = order[:, :C]
            cv = (torch.arange(C, device=x.device) < (D - size).unsqueeze(-1)).to(x.dtype).unsqueeze(-1)  # (g, C, 1)
            Fpc = Fp[cidx] * cv  # (g, C, R), zero at padding
            L = cholesky(Fpc.transpose(-1, -2) @ F[cidx] + eye, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
            # Lambda >= I, so L^-1 has norm <= 1: its explicit inverse is accurate, and
            # turns the solves over the data into matrix products
            Linv = tril_inverse(L)
            Ec = eT.index_select(0, cidx.reshape(-1)).view(cidx.shape + (n,))  # (g, C, n)
            # h = L^-1 (zhat - F_R^T Psi_R^-1 e_R), V = L^-1 F_M^T
            h = torch.baddbmm(Linv @ zhat, Linv @ Fpc.transpose(-1, -2), Ec, alpha=-1)  # (g, R, n)
            V = Linv @ Fm.transpose(-1, -2)  # (g, R, M)
        else:
            h, V = zhat.expand(g, R, n), Fm.transpose(-1, -2)
        var = psim + V.pow(2).sum(-2)  # (g, M)
        E = eT.index_select(0, idx.reshape(-1)).view(idx.shape + (n,))  # (g, M, n)
        d = torch.baddbmm(E, V.transpose(-1, -2), h)  # masked residuals E + V^T h, (g, M, n)
        w = (v / var).unsqueeze(-2)  # (g, 1, M)
        quad = (w @ d.pow(2)).squeeze(-2)  # (g, n)
        logdet = (v * (LOG_2PI + var.log())).sum(-1, keepdim=True)
        parts.append((rows, -0.5 * (logdet + quad)))
    return scatter_rows(parts)


def lowrank_shared_sums_embedded(m, x, mask, data):
    r""":func:`lowrank_shared_sums` for a small rank :math:`R`, without gathers.

    The same centred residuals, expanded as :math:`\sum_{j\in\mathcal M}
    (e_j + f_j^\top u)^2/v_j` with :math:`u = \Lambda^{-1}(\hat z - F^\top C\Psi^{-1}e)`
    (:math:`C` the context indicator) into products of the whole residual table
    :math:`e` with mask-weighted copies of :math:`F`, ``(D, q R)``: at small
    :math:`R` these products are cheaper than gathering each mask's tokens
    (:class:`~pyro_mpt.conditionals.gaussian_embedded.EmbeddedSums`, with its
    backward pass written out).
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    t = mask.to(x.dtype)
    return EmbeddedSums.apply(F, psi, data["eT"].T, data["zhat"].T, data["e2"], t, m.site)


def lowrank_shared_data(m, x):
    """The pieces of :func:`lowrank_shared_sums` that depend on the data but on no
    mask: computed once per state and data, shared by every block of masks."""
    F, psi = m.cov_factor[0], m.cov_diag[0]
    Fp = F / psi.unsqueeze(-1)
    L0 = m.factor[0] if m.factor is not None else posterior_precision_factor(F, psi, m.site)
    r = x - m.loc  # (n, D)
    zhat = torch.cholesky_solve((r @ Fp).T, L0)  # (R, n)
    # centred residuals, token-major (D, n), for row gathers: one product accumulated into a
    # row-major copy of r^T (a difference of the transposed r, then a contiguous copy, took 1.5x
    # as long in float32, 3.8x in float64: n = 1000, D = 200, R = 50)
    eT = torch.addmm(r.T, F, zhat, alpha=-1)
    return {"Fp": Fp, "zhat": zhat, "eT": eT, "e2": (eT * eT).T}


def scatter_rows(parts):
    """The values of ``(rows, value)`` parts put back in row order."""
    if len(parts) == 1:
        rows, value = parts[0]
        return value.index_select(0, torch.argsort(rows))
    rows = torch.cat([p[0] for p in parts])
    value = torch.cat([p[1] for p in parts])
    return value.index_select(0, torch.argsort(rows))


def dense_shared_sums(m, x, mask, max_elements):
    r"""Summed dense log-conditionals for masks ``(q, D)`` shared by the batch.

    Returns ``(q, n)``. Per mask the context block :math:`\Sigma_{\mathcal R\mathcal R}`
    is gathered (padded with an identity) and factored once, and
    :math:`B = \Sigma_{\mathcal R\mathcal R}^{-1}\Sigma_{\mathcal R\mathcal M}` gives the
    variances; the data enter through one batched product
    :math:`r_{\mathcal M} - B^\top r_{\mathcal R}` per group of masks, instead of one
    solve per datapoint with the mask's factor broadcast against it.
    """
    S = m.covariance[0]  # (D, D)
    n, D = x.shape
    rT = (x - m.loc).T.contiguous()  # (D, n), token-major for row gathers
    diag = torch.diagonal(S)
    parts = []
    for rows, order, size in shared_groups(mask, n, lambda M: max_elements // max(1, 3 * n * D + D * D)):
        g = rows.shape[0]
        M = int(size.max())
        C = D - int(size.min())
        if M == 0:
            parts.append((rows, x.new_zeros(g, n)))
            continue
        idx, valid = padded_targets(order, size, M)  # (g, M)
        v = valid.to(x.dtype)
        d = rT.index_select(0, idx.reshape(-1)).view(idx.shape + (n,))  # (g, M, n)
        var = diag[idx]
        if C > 0:
            cidx = order[:, :C]
            cvalid = (torch.arange(C, device=x.device) < (D - size).unsqueeze(-1)).to(x.dtype)  # (g, C)
            S_CC = S[cidx.unsqueeze(-1), cidx.unsqueeze(-2)] * (cvalid.unsqueeze(-1) * cvalid.unsqueeze(-2))
            S_CC = S_CC + torch.diag_embed(1.0 - cvalid)
            S_CM = S[cidx.unsqueeze(-1), idx.unsqueeze(-2)] * cvalid.unsqueeze(-1)  # (g, C, M)
            L = cholesky(S_CC, "context covariance S_RR", m.site)
            W = torch.linalg.solve_triangular(L, S_CM, upper=False)  # L^-1 S_CM, (g, C, M)
            # the variances as a sum of squares: accurate to eps cond(L), not eps cond(S)
            var = var - W.pow(2).sum(-2)
            B = torch.linalg.solve_triangular(L.transpose(-1, -2), W, upper=True)  # S_CC^-1 S_CM
            Rc = rT.index_select(0, cidx.reshape(-1)).view(cidx.shape + (n,)) * cvalid.unsqueeze(-1)
            d = d - B.transpose(-1, -2) @ Rc
        # padding entries are context tokens (variance ~0): keep them finite
        var = torch.where(valid, var, torch.ones((), dtype=var.dtype, device=var.device))
        w = (v / var).unsqueeze(-2)
        quad = (w @ d.pow(2)).squeeze(-2)
        logdet = (v * (LOG_2PI + var.log())).sum(-1, keepdim=True)
        parts.append((rows, -0.5 * (logdet + quad)))
    return scatter_rows(parts)
