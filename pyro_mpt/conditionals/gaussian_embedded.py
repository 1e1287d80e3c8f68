r"""The shared-mask sums of a small-rank Gaussian as products of the whole residual table, with their backward pass.

For :math:`\Sigma = FF^\top + \Psi` of a small rank :math:`R` and a few masks
shared by the batch, ``gaussian_shared.lowrank_shared_sums_embedded``
expands each mask's summed log-conditionals into products of the residual
table :math:`e` with mask-weighted copies of :math:`F` (:class:`EmbeddedSums`
has the formulas). Recorded op by op, its backward pass ran about 150 small
kernels for one mask (PPCA D = 10, K = 2, n = 1000); written out it takes
about forty, with the products of the data stacked two by two. Second
derivatives (``create_graph=True``), which this path served before its
backward pass was written out, replay the forward pass recorded op by op and
differentiate it (:func:`recorded_sums`).
"""

import torch

from .gaussian_linalg import LOG_2PI, cholesky

__all__ = ["EmbeddedSums", "recorded_sums"]


def _rows_outer(F):
    """``(D, R * R)``: each row's outer product :math:`F_jF_j^\\top`, flattened."""
    return (F[:, :, None] * F[:, None, :]).reshape(F.shape[0], -1)


class EmbeddedSums(torch.autograd.Function):
    r"""Each mask's summed log-conditionals, ``(q, n)``, from the whole residual table.

    With :math:`e = r - F\hat z` the residuals of the full-data posterior mean
    :math:`\hat z` (``lowrank_shared_data``), mask :math:`m`'s target
    indicator :math:`t_m`, context weights :math:`c_m = (1 - t_m)/\psi`,
    :math:`\Lambda_m = I + F^\top\operatorname{diag}(c_m)F`, variances
    :math:`v_m = \psi + \operatorname{diag}(F\Lambda_m^{-1}F^\top)`,
    :math:`w_m = t_m/v_m` and :math:`u_{mi} = \Lambda_m^{-1}(\hat z_i - F^\top
    \operatorname{diag}(c_m)e_i)`, datapoint :math:`i`'s conditional residuals are
    :math:`e_i + Fu_{mi}` and

    .. math::

        s_{mi} = -\tfrac12\Big(\sum_j t_{mj}\log(2\pi v_{mj})
            + (e_i\circ e_i)^\top w_m + 2 (e_i^\top\operatorname{diag}(w_m)F) u_{mi}
            + u_{mi}^\top F^\top\operatorname{diag}(w_m)F u_{mi}\Big).

    The data enter through products of :math:`e` ``(n, D)`` with the ``(D, qR)``
    tables :math:`\operatorname{diag}(c_m)F` and :math:`\operatorname{diag}(w_m)F`;
    the backward pass stacks its two products of the same kind into one each.

    :param F: ``(D, R)``. :param psi: ``(D,)``. :param e: ``(n, D)``.
    :param zhat: ``(n, R)``. :param e2: ``(n, D)``, :math:`e\circ e` (its own
        input, so that its gradient reaches ``e`` through the caller's graph).
    :param t: the targets, 0/1 in ``F``'s dtype, ``(q, D)``.
    :param str site: for error messages.
    :returns: ``(q, n)``.

    Example::

        >>> EmbeddedSums.apply(F, psi, e, zhat, e * e, mask.to(F.dtype), "x")  # (q, n)
    """

    @staticmethod
    def forward(ctx, F, psi, e, zhat, e2, t, site):
        """``(q, n)``."""
        q = t.shape[0]
        D, R = F.shape
        FF = _rows_outer(F)
        cw = (1 - t) / psi  # (q, D)
        Lam = (cw @ FF).view(q, R, R)
        Lam.diagonal(dim1=-2, dim2=-1).add_(1)
        L = cholesky(Lam, "context precision I + F_R^T Psi_R^-1 F_R", site)
        # Lambda >= I: its inverse has norm <= 1 and is accurate, and turns the
        # solves over the data into products
        Li = torch.cholesky_inverse(L)  # (q, R, R)
        var = psi + (FF @ Li.reshape(q, R * R).T).T  # (q, D)
        w = t / var
        # the context's projections, stacked with the targets' weighted ones: one product of the data
        cwF_wF = torch.cat([cw, w]).unsqueeze(-1) * F  # (2q, D, R)
        Ep, We = (e @ cwF_wF.permute(1, 0, 2).reshape(D, 2 * q * R)).view(-1, 2, q, R).unbind(1)  # (n, q, R)
        y = zhat.T.unsqueeze(0) - Ep.permute(1, 2, 0)  # (q, R, n)
        u = Li @ y
        Mw = (w @ FF).view(q, R, R)
        Wu = We.permute(1, 2, 0)  # (q, R, n)
        quad = (e2 @ w.T).T + ((2 * Wu + Mw @ u) * u).sum(-2)
        logdet = (t * (LOG_2PI + var.log())).sum(-1, keepdim=True)
        ctx.save_for_backward(F, psi, e, zhat, e2, t, FF, Li, Mw, var, y, u, Wu)
        ctx.site = site
        return -0.5 * (logdet + quad)

    @staticmethod
    def backward(ctx, g):
        """The gradients of ``F``, ``psi``, ``e``, ``zhat`` and ``e2``."""
        F, psi, e, zhat, e2, t, FF, Li, Mw, var, y, u, Wu = ctx.saved_tensors
        if torch.is_grad_enabled():
            # a graph of the gradient (second derivatives): the saved pieces, made without
            # one, would be constants in it; the recorded forward pass has them all
            return _replayed_backward(ctx, g, (F, psi, e, zhat, e2), t)
        q = t.shape[0]
        D, R = F.shape
        G = -0.5 * g  # (q, n), the gradient of the bracket
        cw, w = (1 - t) / psi, t / var
        Gu = u * G.unsqueeze(-2)  # (q, R, n)
        # quad = e2 w + 2 Wu.u + u^T Mw u
        ge2 = G.T @ w
        gMw = Gu @ u.transpose(-1, -2)
        gu = 2 * (Wu * G.unsqueeze(-2) + Mw @ Gu)
        # u = Li y
        gy = Li @ gu
        gLi = gu @ y.transpose(-1, -2)
        gzhat = gy.sum(0).T
        # We (through Wu, gradient 2 Gu) and Ep (through y, gradient -gy) are products of e with
        # diag(w) F and diag(cw) F: their gradients, stacked
        gWE = torch.cat([2 * Gu, -gy])  # (2q, R, n)
        ge = gWE.reshape(2 * q * R, -1).T @ (torch.cat([w, cw]).unsqueeze(1) * F.T).reshape(2 * q * R, D)
        B = (gWE @ e).view(2, q, R, D)  # the gradients of diag(w) F and diag(cw) F, transposed
        gw = G @ e2 + (B[0] * F.T).sum(-2) + (FF @ gMw.reshape(q, R * R).T).T
        gcw = (B[1] * F.T).sum(-2)
        gF = (B[0] * w.unsqueeze(-2) + B[1] * cw.unsqueeze(-2)).sum(0).T
        # logdet = sum t log var, w = t / var
        gvar = (G.sum(-1, keepdim=True) * t - gw * w) / var
        # var = psi + diag(F Li F^T)
        gLi = 0.5 * (gLi + gLi.transpose(-1, -2)) + (gvar @ FF).view(q, R, R)
        # Lambda = I + F^T diag(cw) F, Li = Lambda^-1
        gLam = -(Li @ gLi @ Li)
        gcw = gcw + (FF @ gLam.reshape(q, R * R).T).T
        # every row's gradient through its outer product F_j F_j^T (in Mw, var and Lambda)
        rows = torch.cat([w, gvar, cw]).T @ torch.cat([gMw, Li, gLam]).reshape(3 * q, R * R)  # (D, R * R)
        rows = rows.view(D, R, R)
        gF = gF + ((rows + rows.transpose(-1, -2)) @ F.unsqueeze(-1)).squeeze(-1)
        gpsi = gvar.sum(0) - (gcw * cw).sum(0) / psi
        return gF, gpsi, ge, gzhat, ge2, None, None


def _replayed_backward(ctx, g, inputs, t):
    with torch.enable_grad():
        wanted = [i for i, (x, need) in enumerate(zip(inputs, ctx.needs_input_grad)) if need and x.requires_grad]
        out = recorded_sums(*inputs, t, ctx.site)
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], g, create_graph=True, allow_unused=True)
    result = [None] * 7
    for i, grad in zip(wanted, grads):
        result[i] = grad
    return tuple(result)


def recorded_sums(F, psi, e, zhat, e2, t, site):
    """:class:`EmbeddedSums`' values, ``(q, n)``, computed op by op under autograd (whose
    graph then has every derivative, second ones included).

    The parameters are :class:`EmbeddedSums`'; returns ``(q, n)``.

    Example::

        >>> s = recorded_sums(F, psi, e, zhat, e * e, t, "x")  # equals EmbeddedSums.apply(...)
        >>> torch.autograd.grad(s.sum(), F, create_graph=True)  # differentiable again
    """
    q = t.shape[0]
    D, R = F.shape
    FF = _rows_outer(F)
    cw = (1 - t) / psi
    eye = torch.eye(R, dtype=F.dtype, device=F.device)
    L = cholesky((cw @ FF).reshape(q, R, R) + eye, "context precision I + F_R^T Psi_R^-1 F_R", site)
    P = torch.cholesky_solve(F.T.expand(q, R, D), L)  # Lambda^-1 F^T, (q, R, D)
    var = psi + (F.T * P).sum(-2)
    Ep = (e @ (cw[..., None] * F).permute(1, 0, 2).reshape(D, q * R)).reshape(-1, q, R)
    u = torch.cholesky_solve((zhat[:, None] - Ep).permute(1, 2, 0), L)  # (q, R, n)
    w = t / var
    We = (e @ (w[..., None] * F).permute(1, 0, 2).reshape(D, q * R)).reshape(-1, q, R)
    Mw = (w @ FF).reshape(q, R, R)
    quad = (e2 @ w.T).T + 2 * (We.permute(1, 2, 0) * u).sum(-2) + ((Mw @ u) * u).sum(-2)
    logdet = (t * (LOG_2PI + var.log())).sum(-1, keepdim=True)
    return -0.5 * (logdet + quad)
