r"""Every leave-one-out conditional :math:`\log p(x_j \mid x_{-j})` of a Gaussian from one
factorization of its covariance, for queries that each hide one token (the ``"pll"``
schedule).

With the precision :math:`P = \Sigma^{-1}` and the residual :math:`r = x - \mu`, the
conditional of token :math:`j` given all the others has variance :math:`1/P_{jj}` and
mean residual :math:`(Pr)_j / P_{jj}` (Rasmussen & Williams 2006, eqs. 5.10--5.12), so

.. math::

    \log p(x_j \mid x_{-j}) = -\tfrac12\Big(\log 2\pi - \log P_{jj}
        + \frac{(Pr)_j^2}{P_{jj}}\Big).

One factorization serves the :math:`D` queries, instead of one factorization of a
:math:`(D-1)`-token context per query: :math:`O(D^3 + nD^2)` on the dense path and
:math:`O(DR^2 + nDR)` on the low-rank one, where the per-query path costs :math:`D`
times as much.

On the low-rank path :math:`\Sigma = FF^\top + \Psi`, with :math:`\Lambda_0 = I +
F^\top\Psi^{-1}F = L_0L_0^\top`, the full-data posterior mean :math:`\hat z` and the
centred residual :math:`e = r - F\hat z`: :math:`(Pr)_j = e_j/\psi_j` and
:math:`P_{jj} = (1 - s_j)/\psi_j` with :math:`s_j = \lVert L_0^{-1}f_j\rVert^2/\psi_j
\in [0, 1)` (Sherman--Morrison), so that

.. math::

    \log p(x_j \mid x_{-j}) = -\tfrac12\Big(\log 2\pi + \log\psi_j - \log(1 - s_j)
        + \frac{e_j^2}{\psi_j(1 - s_j)}\Big),

small centred terms, as in the engine's other low-rank paths.
"""

import torch

from .gaussian_linalg import LOG_2PI, cholesky, posterior_precision_factor, tril_inverse

__all__ = [
    "lowrank_leave_one_out",
    "lowrank_leave_one_out_rows",
    "lowrank_leave_one_out_observed",
    "dense_leave_one_out",
    "leave_one_out_targets",
    "leave_one_out_from_full",
]


def leave_one_out_targets(mask):
    """The target token of each query when every query of ``mask`` hides exactly one
    token and there are several queries; else None (the queries take the per-mask paths).

    :param torch.Tensor mask: bool ``(q, D)``, True at a target.
    :returns: int64 ``(q,)``, or None.

    Example::

        >>> leave_one_out_targets(torch.eye(3, dtype=torch.bool)[[2, 0]])
        tensor([2, 0])
    """
    # one count over the whole table (a per-row sum of bools promotes them to int64:
    # 60 ms at 4000 x 4000, against 4 ms), then each row's first target must be one
    if mask.shape[0] < 2 or int(torch.count_nonzero(mask)) != mask.shape[0]:
        return None
    # max's indices, not argmax: 2.5 times faster over uint8 rows (8000 x 8000, one thread:
    # 45 against 114 ms; "pll" on one datapoint of 40000 tokens called it on 40000 x 40000);
    # which maximum it picks does not matter, the gather below checks it
    targets = mask.view(torch.uint8).max(-1).indices
    if not bool(mask.gather(-1, targets.unsqueeze(-1)).all()):
        return None  # a query without a target, so another with several
    return targets


def leave_one_out_from_full(e, psi, spread, observed=None):
    r""":math:`\log p(x_j \mid x_{-j})` from the full-data posterior of a linear-Gaussian
    model :math:`x_j = \mu_j + c_j^\top\varepsilon + \sqrt{\psi_j}\,\xi_j`,
    :math:`\varepsilon \sim \mathcal N(0, I)`: with the residual :math:`e_j` of the
    full-data posterior mean and :math:`c_j^\top P^{-1}c_j` (``spread``, :math:`P` the
    full-data posterior precision), :math:`s_j` = ``spread / psi``,

    .. math::

        \log p(x_j \mid x_{-j}) = -\tfrac12\Big(\log 2\pi + \log\psi_j - \log(1 - s_j)
            + \frac{e_j^2}{\psi_j(1 - s_j)}\Big)

    (removing token :math:`j` from :math:`P` by Sherman--Morrison).

    :param torch.Tensor e: the residuals :math:`x_j - \mathbb E[x_j \mid x]`.
    :param torch.Tensor psi: the noise variances :math:`\psi_j`.
    :param torch.Tensor spread: :math:`c_j^\top P^{-1} c_j`, the latent part of the
        full-data posterior predictive variance.
    :param torch.Tensor observed: bool, True at an observed token (the posterior is then the
        one given the observed tokens), or None: the log-conditionals are 0 at a missing one.
    :returns: the log-conditionals, of the three's broadcast shape.

    Example::

        >>> leave_one_out_from_full(x - mean, psi, var - psi)   # (n, D)
    """
    keep = 1.0 - spread / psi  # psi_j / v_j, v_j the conditional variance: in (0, 1]
    table = -0.5 * (LOG_2PI + psi.log() - keep.log() + e.pow(2) / (psi * keep))
    if observed is None:
        return table
    return torch.where(observed, table, torch.zeros((), dtype=table.dtype, device=table.device))


def lowrank_leave_one_out(m, data):
    r""":math:`\log p(x_j \mid x_{-j})` for every token of every datapoint, ``(n, D)``, of
    :math:`\mathcal N(\mu, FF^\top + \Psi)` with a loading shared by the batch.

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal m: low-rank state,
        ``cov_factor`` ``(1, D, R)``, ``cov_diag`` ``(1, D)``.
    :param dict data: the mask-free pieces of the data (``gaussian_shared.lowrank_shared_data``):
        the centred residuals ``eT`` ``(D, n)``.
    :returns: ``(n, D)``.

    Example::

        >>> lowrank_leave_one_out(state, lowrank_shared_data(state, x)).sum(-1)   # (n,) PLL
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    L0 = posterior_precision_factor(F, psi, m.site)
    V = torch.linalg.solve_triangular(L0, F.T, upper=False)  # L0^-1 F^T, (R, D)
    return leave_one_out_from_full(data["eT"].T, psi, V.pow(2).sum(0))


def lowrank_leave_one_out_rows(m, x):
    r""":func:`lowrank_leave_one_out` for a loading or noise that varies by datapoint
    (``cov_factor`` ``(n, D, R)``, ``cov_diag`` ``(n, D)``, e.g. a noise scale per
    datapoint): each datapoint's posterior precision factored apart.

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal m: low-rank state,
        ``cov_factor`` ``(n|1, D, R)``, ``cov_diag`` ``(n|1, D)``.
    :param torch.Tensor x: tokens ``(n, D)``, in the state's dtype.
    :returns: ``(n, D)``.

    Example::

        >>> lowrank_leave_one_out_rows(state, x).sum(-1)   # (n,) PLL
    """
    F, psi = m.cov_factor, m.cov_diag  # (n|1, D, R), (n|1, D)
    L0 = posterior_precision_factor(F, psi, m.site)  # (n|1, R, R)
    V = torch.linalg.solve_triangular(L0, F.transpose(-1, -2), upper=False)  # (n|1, R, D)
    r = x - m.loc
    zhat = torch.cholesky_solve(((r / psi).unsqueeze(-2) @ F).transpose(-1, -2), L0)  # (n, R, 1)
    e = r - (F @ zhat).squeeze(-1)  # the centred residuals
    return leave_one_out_from_full(e, psi, V.pow(2).sum(-2))


def lowrank_leave_one_out_observed(m, x, observed):
    r""":func:`lowrank_leave_one_out_rows` given each datapoint's observed tokens alone:
    :math:`\log p(x_j \mid x_{O \setminus j})` at its observed tokens :math:`O` (0 at a
    missing one), from the posterior precision :math:`I + F^\top\operatorname{diag}(o/\psi)F`
    of each datapoint (a missing token carries no information: its noise precision is 0).

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal m: low-rank state,
        ``cov_factor`` ``(n|1, D, R)``, ``cov_diag`` ``(n|1, D)``.
    :param torch.Tensor x: tokens ``(n, D)``, in the state's dtype.
    :param torch.Tensor observed: bool ``(n, D)``.
    :returns: ``(n, D)``.

    Example::

        >>> lowrank_leave_one_out_observed(state, x, observed).sum(-1)   # (n,) PLL of the observed tokens
    """
    F, psi = m.cov_factor, m.cov_diag  # (n|1, D, R), (n|1, D)
    w = observed.to(F.dtype) / psi  # (n, D)
    eye = torch.eye(F.shape[-1], dtype=F.dtype, device=F.device)
    L0 = cholesky(eye + F.transpose(-1, -2) @ (F * w.unsqueeze(-1)), "posterior precision I + F^T W F", m.site)
    V = torch.linalg.solve_triangular(L0, F.transpose(-1, -2), upper=False)  # (n, R, D)
    r = x - m.loc
    zhat = torch.cholesky_solve(((r * w).unsqueeze(-2) @ F).transpose(-1, -2), L0)  # (n, R, 1)
    e = r - (F @ zhat).squeeze(-1)
    return leave_one_out_from_full(e, psi, V.pow(2).sum(-2), observed)


def dense_leave_one_out(m, x):
    r""":math:`\log p(x_j \mid x_{-j})` for every token of every datapoint, ``(n, D)``, of
    :math:`\mathcal N(\mu, \Sigma)` with a covariance shared by the batch.

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal m: dense state,
        ``covariance`` ``(1, D, D)`` shared by the batch or ``(n, D, D)`` (its Cholesky
        ``factor`` when kept).
    :param torch.Tensor x: tokens ``(n, D)``.
    :returns: ``(n, D)``.

    Example::

        >>> dense_leave_one_out(state, x).sum(-1)   # (n,) the leave-one-out predictive density
    """
    S = m.covariance  # (n|1, D, D)
    L = m.factor if m.factor is not None else cholesky(S, "covariance", m.site)
    Linv = tril_inverse(L)
    p = Linv.pow(2).sum(-2)  # P_jj, the column norms of L^-1, (n|1, D)
    r = x - m.loc
    if S.shape[0] == 1:
        Pr = r @ Linv[0].T @ Linv[0]  # (P r)^T, (n, D): P is symmetric
    else:
        Pr = ((r.unsqueeze(-2) @ Linv.transpose(-1, -2)) @ Linv).squeeze(-2)
    return -0.5 * (LOG_2PI - p.log() + Pr.pow(2) / p)
