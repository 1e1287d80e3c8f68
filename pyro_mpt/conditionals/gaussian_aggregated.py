r"""The weighted sum over masks shared by the batch as one quadratic form per datapoint.

A loss without a curve needs, from a group of masks shared by the batch, only
:math:`\sum_m a_m \sum_{j\in\mathcal M_m}\log p(x_{ij}\mid x_{i\mathcal R_m})`
(:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum`). For a
Gaussian each mask's summed log-conditional is a data-free log-determinant plus
a quadratic form :math:`y_i^\top Q_m y_i` in a per-datapoint vector :math:`y_i`,
so the weighted sum over all masks is **one** quadratic form
:math:`y_i^\top A y_i` with :math:`A = \sum_m a_m Q_m`: the masks cost
:math:`O(P\,\dim(y)^2 R)` for all :math:`P` of them (:math:`R` the rank; a few
large matrix products) and the data :math:`O(n \dim(y)^2)` once, instead of
:math:`O(P n D R)` products of the data with every mask's factors. That is
cheaper when :math:`\dim(y)^2 \lesssim nD`; the engine picks the path by this
count (:func:`aggregated_cheaper`).

The vectors :math:`y` are chosen so that no large terms cancel inside
:math:`y^\top A y`, which matters in float32: on the low-rank path the
full-data residual and the residual of the normal equations, on the dense path
the whitened data.
"""

import torch

from .gaussian_linalg import LOG_2PI, cholesky

__all__ = [
    "aggregated_cheaper", "aggregated_elements", "lowrank_aggregate_data", "lowrank_weighted_sum", "dense_weighted_sum",
]


def aggregated_cheaper(n, D, R=None):
    r"""Whether the aggregated form costs fewer flops than per-mask products with the data.

    Low-rank (rank ``R``): about :math:`2R(D+R)^2` per mask against
    :math:`4nDR`; dense (``R`` None): about :math:`6D^3` per mask (its factor,
    the whitened regression and its share of :math:`A`) against :math:`nD^2`.
    """
    if R is None:
        return 6 * D <= n
    return (D + R) ** 2 <= 2 * n * D


def aggregated_elements(D, R=None):
    """Elements of the aggregated form's largest intermediate per mask (the stacked
    :math:`D\times D` regressions, or the :math:`R\times(D+R)` pieces of the low-rank form)."""
    return D * D if R is None else R * (D + R)


def lowrank_weighted_sum(m, mask, coef, data):
    r"""Aggregated weighted sum for :math:`\Sigma = FF^\top + \Psi`, ``(n,)``.

    With :math:`r = x - \mu`, :math:`\Lambda_0 = I + F^\top\Psi^{-1}F`, the
    posterior mean :math:`\hat z = \Lambda_0^{-1}F^\top\Psi^{-1}r` as computed,
    :math:`e = r - F\hat z` and :math:`\delta = \hat z - F^\top\Psi^{-1}e` (zero
    up to rounding; carrying it keeps every identity below exact for the
    :math:`\hat z` actually computed): for a mask with target indicator
    :math:`t` and context :math:`c = 1 - t`, :math:`\Lambda = I +
    F^\top\operatorname{diag}(c/\psi)F = LL^\top`, the conditional variances
    :math:`v = \psi + \operatorname{diag}(F\Lambda^{-1}F^\top)`,
    :math:`w = t/v`, and the conditional residuals

    .. math::

        d = e + V^\top h, \qquad V = L^{-1}F^\top, \qquad
        h = L^{-1}\big(F^\top\Psi^{-1}\operatorname{diag}(t)\,e + \delta\big) = K y,

    with :math:`y = [e; \delta] \in \mathbb R^{D+R}` and :math:`K = L^{-1}
    [(t \circ F/\psi)^\top,\ I_R]`: the context's projection
    :math:`F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}e_{\mathcal R} = \hat z + \delta - F^\top\Psi^{-1}\operatorname{diag}(t)e`
    is written through the targets, so that the form holds small centred terms only.
    Then :math:`\sum_j w_j d_j^2 = e^\top W e + y^\top K^\top N y` with
    :math:`N = 2(V\circ w)E + (VWV^\top)K` (:math:`E = [I_D, 0]`), and over
    the masks with coefficients :math:`a_m`,

    .. math::

        \sum_m a_m \sum_j w_{mj} d_{mj}^2 = e^\top\operatorname{diag}\Big(\sum_m a_m w_m\Big) e
            + y^\top \big[K_1^\top \cdots K_P^\top\big]
              \begin{bmatrix} a_1 N_1 \\ \vdots \\ a_P N_P\end{bmatrix} y,

    one :math:`(D+R)\times PR\times(D+R)` matrix product for all masks. The
    result is :math:`-\tfrac12\big(\sum_m a_m \sum_j t_{mj}\log(2\pi v_{mj}) +
    \text{the form}\big)`.

    :param m: the low-rank state (cov_factor ``(1, D, R)``, cov_diag ``(1, D)``).
    :param torch.Tensor mask: bool ``(P, D)``.
    :param torch.Tensor coef: ``(P,)``.
    :param dict data: the mask-free pieces (``gaussian_shared.lowrank_shared_data``,
        completed by :func:`lowrank_aggregate_data`).
    :returns: ``(n,)``.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    D, R = F.shape
    P = mask.shape[0]
    dtype = F.dtype
    a = coef.to(dtype)
    t = mask.to(dtype)
    G = data["Fp"]  # F / psi
    eye = torch.eye(R, dtype=dtype, device=F.device)
    FF = (F[:, :, None] * F[:, None, :]).reshape(D, R * R)
    L = cholesky((((1 - t) / psi) @ FF).reshape(P, R, R) + eye, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    # Lambda >= I, so L^-1 has norm <= 1: its explicit inverse is accurate
    Linv = torch.linalg.solve_triangular(L, eye.expand(P, R, R), upper=False)
    V = Linv @ F.T  # (P, R, D)
    var = psi + V.pow(2).sum(-2)  # (P, D)
    w = t / var
    Vw = V * w.unsqueeze(-2)  # (P, R, D), zero at the context
    Z = (Vw @ V.transpose(-1, -2)) @ Linv  # V W V^T L^-1, (P, R, R)
    # the stacked [K_1^T ... K_P^T] = [t o (G L^-T); L^-T], built in its (D+R, P R)
    # layout (no copy), and N = a [2 V o w + (Z G^T) o t, Z] as (P R, D+R)
    LT = Linv.transpose(-1, -2).permute(1, 0, 2).reshape(R, P * R)  # [L_1^-T ... L_P^-T]
    Kt = torch.cat([(G @ LT).view(D, P, R).mul(t.T.unsqueeze(-1)).view(D, P * R), LT], 0)
    N = torch.cat([2 * Vw + (Z @ G.T) * t.unsqueeze(-2), Z], 2) * a[:, None, None]  # (P, R, D+R)
    A = Kt @ N.view(P * R, D + R)
    diag = a @ w  # (D,)
    logdet = a @ (t * (LOG_2PI + var.log())).sum(-1)
    y = data["y"]  # (n, D + R)
    quad = ((y @ A) * y).sum(-1) + data["e2"] @ diag
    return -0.5 * (logdet + quad)


def lowrank_aggregate_data(data):
    """Adds ``e`` ``(n, D)``, ``y = [e, delta]`` ``(n, D + R)`` to the mask-free pieces."""
    if "y" not in data:
        e = data["eT"].T
        delta = data["zhat"].T - e @ data["Fp"]  # (n, R), zero up to rounding
        data["e"], data["y"] = e, torch.cat([e, delta], -1)
    return data


def dense_weighted_sum(m, x, mask, coef):
    r"""Aggregated weighted sum for a dense :math:`\Sigma = L_0L_0^\top`, ``(n,)``.

    For a mask with targets :math:`\mathcal M` and context :math:`\mathcal R`,
    the conditional residuals are :math:`d = r_{\mathcal M} - B^\top r_{\mathcal R}
    = P_m r` with :math:`B = \Sigma_{\mathcal R\mathcal R}^{-1}\Sigma_{\mathcal R\mathcal M}`
    (:math:`P_m` is :math:`D\times D`, zero rows at the context), and in the
    whitened data :math:`\varepsilon = L_0^{-1}r`, :math:`d = U_m\varepsilon`
    with :math:`U_m = P_mL_0`, whose target rows have norm :math:`\sqrt{v_j}`
    (the conditional standard deviations): no large terms cancel. Then

    .. math::

        \sum_m a_m \sum_{j\in\mathcal M_m} \frac{d_{mj}^2}{v_{mj}}
            = \varepsilon^\top \Big(\sum_m a_m U_m^\top W_m U_m\Big) \varepsilon,

    one :math:`D\times PD\times D` product for all masks, and the result is
    :math:`-\tfrac12\big(\sum_m a_m\sum_{j\in\mathcal M_m}\log(2\pi v_{mj}) +
    \text{the form}\big)`. The context block is factored embedded in a
    :math:`D\times D` matrix (identity at the targets).

    :param m: the dense state (covariance ``(1, D, D)``, factor its Cholesky factor).
    :param torch.Tensor x: ``(n, D)``.
    :param torch.Tensor mask: bool ``(P, D)``.
    :param torch.Tensor coef: ``(P,)``.
    :returns: ``(n,)``.
    """
    S = m.covariance[0]
    L0 = m.factor[0] if m.factor is not None else cholesky(S, "covariance", m.site)
    D = S.shape[-1]
    P = mask.shape[0]
    a = coef.to(S.dtype)
    t = mask.to(S.dtype)
    c = 1 - t
    S_emb = S * (c.unsqueeze(-1) * c.unsqueeze(-2)) + torch.diag_embed(t)  # (P, D, D)
    L = cholesky(S_emb, "context covariance S_RR", m.site)
    W = torch.linalg.solve_triangular(L, S * (c.unsqueeze(-1) * t.unsqueeze(-2)), upper=False)  # L^-1 S_RM
    # the variances as a sum of squares: accurate to eps cond(L), not eps cond(S)
    var = torch.where(mask, torch.diagonal(S) - W.pow(2).sum(-2), torch.ones((), dtype=S.dtype, device=S.device))
    B = torch.linalg.solve_triangular(L.transpose(-1, -2), W, upper=True)  # zero rows at the targets
    U = (torch.diag_embed(t) - B.transpose(-1, -2)) @ L0  # P_m L0, (P, D, D)
    aw = a.unsqueeze(-1) * t / var  # (P, D)
    A = U.reshape(P * D, D).T @ (U * aw.unsqueeze(-1)).reshape(P * D, D)
    logdet = a @ (t * (LOG_2PI + var.log())).sum(-1)
    eps = torch.linalg.solve_triangular(L0, (x - m.loc).T, upper=False).T  # (n, D)
    return -0.5 * (logdet + ((eps @ A) * eps).sum(-1))
