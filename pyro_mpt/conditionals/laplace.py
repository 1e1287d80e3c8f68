r"""Laplace centring of the adaptive quadrature grid: Newton's method per datapoint.

The adaptive rule of :mod:`~pyro_mpt.conditionals.quadrature` centres and
scales the grid, per datapoint, on the Laplace approximation
:math:`\mathcal N(c, SS^\top)` of the log joint :math:`J(u) = \log \pi(u) +
\sum_d \log p(x_d \mid z(u))` in node coordinates: :math:`c` its mode and
:math:`SS^\top` the inverse of its negative Hessian there. The search is
detached from the autograd graph; its derivatives are taken by automatic
differentiation through the model run at the points
(:class:`~pyro_mpt.conditionals.quadrature_nodes.NodeRunner`).
"""

import math

import torch

from .quadrature_rules import affine_grid, gaussian_grid

__all__ = ["LaplaceSearch"]


class LaplaceSearch:
    """Newton's method for the modes of the log joint, per datapoint.

    :param int newton_steps: Newton iterations at most.
    :param int max_elements: entries per chunk of points (``P n D``).
    :param int init_nodes: nodes per dimension of the coarse grid whose best
        node starts the search (None: 7, 5, 3, 3 for K = 1..4).

    Example::

        >>> search = LaplaceSearch(newton_steps=20, max_elements=2**24)
        >>> centre, sqrt_cov, converged = search.laplace(runner, start, include_lik=True)
    """

    def __init__(self, newton_steps, max_elements, init_nodes=None):
        self.newton_steps = int(newton_steps)
        self.max_elements = int(max_elements)
        self.init_nodes = init_nodes

    def log_joint(self, runner, u, include_lik):
        """Log prior density (and token log-likelihood) at points ``u`` ``(P, r, K)`` -> ``(P, n)``."""
        n, D = runner.tokens.num_data, runner.tokens.num_tokens
        step = max(1, self.max_elements // max(1, n * D))
        out = []
        for s in range(0, u.shape[0], step):
            log_pi, logp = runner.run(u[s : s + step])
            lj = log_pi.expand(logp.shape[0], n)
            if include_lik:
                lj = lj + logp.sum(-1)
            out.append(lj)
        return torch.nan_to_num(torch.cat(out, 0), nan=-math.inf, neginf=-math.inf, posinf=math.inf)

    def derivatives(self, runner, u, include_lik, hessian=True):
        """Log joint ``(n,)``, its gradient ``(n, K)`` and (with ``hessian``) its
        negative Hessian ``(n, K, K)`` at ``u`` ``(n, K)``, by automatic differentiation."""
        n, K = u.shape
        with torch.enable_grad():
            v = u.detach()[None].clone().requires_grad_(True)
            J = self.log_joint(runner, v, include_lik)[0]
            if not J.requires_grad:  # the log joint does not depend on the nodes
                zero = torch.zeros_like(u)
                return J.detach(), zero, (torch.zeros(n, K, K, dtype=u.dtype, device=u.device) if hessian else None)
            (g,) = torch.autograd.grad(J.sum(), v, create_graph=hessian)
            if not hessian:
                return J.detach(), g[0].detach(), None
            H = torch.zeros(n, K, K, dtype=u.dtype, device=u.device)
            if g.requires_grad:
                for k in range(K):
                    (h,) = torch.autograd.grad(
                        g[..., k].sum(), v, retain_graph=k < K - 1, allow_unused=True
                    )
                    if h is not None:
                        H[:, k] = h[0]
        negH = -0.5 * (H + H.transpose(-1, -2))
        return J.detach(), g[0].detach(), negH.detach()

    def laplace(self, runner, u, include_lik):
        """Newton's method for the mode of the log joint, per datapoint, from ``u`` ``(n, K)``.

        Each step is a modified Newton step (absolute eigenvalues of the negative
        Hessian) shortened, per datapoint, until the log joint does not decrease;
        the search stops when every Newton decrement (with a Hessian taken at the
        current point) is below a tolerance. The Hessian is recomputed only when
        the gradient at the new point is not yet small under the previous one.

        The rule must not depend on where the search started (the coarse grid's
        best node on a first call, the previous centres on a warm start): once
        converged, one more full Newton step puts the centre within about the
        square of the last step of the mode, and the scale is taken from the
        Hessian *at that centre*, so that two searches from different starts
        give the same rule up to a few ``tol`` (``tol`` = 1e-8 in float64, 1e-3
        in float32, on the decrement).

        :returns: ``(centre (n, K), sqrt_cov (n, K, K), converged (n,))`` with
            ``sqrt_cov @ sqrt_cov.T`` the inverse negative Hessian at the centre.
        """
        n, K = u.shape
        finfo = torch.finfo(u.dtype)
        tol = 1e-8 if u.dtype == torch.float64 else 1e-3
        J, g, negH = self.derivatives(runner, u, include_lik)
        if not bool(torch.isfinite(J).all()):
            bad = int((~torch.isfinite(J)).sum())
            raise ValueError(
                f"The log-density of the model of site {runner.tokens.name!r} is not "
                f"finite at the start of the Laplace search for {bad} datapoint(s); "
                f"check that the data lie in the support of the observation."
            )

        def newton_step(g, negH):
            lam, V = torch.linalg.eigh(negH)
            lam = lam.abs().clamp_min(1e-6)
            step = (V @ ((V.transpose(-1, -2) @ g.unsqueeze(-1)) / lam.unsqueeze(-1))).squeeze(-1)
            return step, (g * step).sum(-1)

        step, decrement = newton_step(g, negH)
        fresh = True  # negH was taken at u
        for _ in range(self.newton_steps):
            if fresh and float(decrement.max()) < tol:
                break
            noise = 16 * finfo.eps * J.abs().clamp_min(1.0)
            alpha = torch.ones(n, dtype=u.dtype, device=u.device)
            for _ in range(20):
                cand = u + alpha.unsqueeze(-1) * step
                Jc = self.log_joint(runner, cand[None], include_lik)[0]
                ok = Jc >= J - noise
                if bool(ok.all()):
                    break
                alpha = torch.where(ok, alpha, 0.25 * alpha)
            u = torch.where(ok.unsqueeze(-1), cand, u)
            J, g, _ = self.derivatives(runner, u, include_lik, hessian=False)
            step, decrement = newton_step(g, negH)
            fresh = False
            if float(decrement.max()) >= tol:
                J, g, negH = self.derivatives(runner, u, include_lik)
                step, decrement = newton_step(g, negH)
                fresh = True
        if not fresh:
            J, g, negH = self.derivatives(runner, u, include_lik)
            step, decrement = newton_step(g, negH)
        converged = decrement < tol
        # the last, tiny Newton step (no line search needed) and the Hessian at
        # its end: the rule then no longer shows where the search started
        u = torch.where(converged.unsqueeze(-1), u + step, u)
        J, g, negH = self.derivatives(runner, u, include_lik)
        lam, V = torch.linalg.eigh(negH)
        lam = lam.clamp_min(1e-4)
        S = V * lam.rsqrt().unsqueeze(-2)  # S S^T = V diag(1/lam) V^T
        return u, S, converged

    def best_node(self, runner, c0, S0, K, n):
        """Best node per datapoint of a coarse grid on the prior frame ``(c0, S0)``."""
        m0 = self.init_nodes or {1: 7, 2: 5, 3: 3, 4: 3}[K]
        e0, lw0 = gaussian_grid(m0, K, c0.dtype, c0.device)
        u0, _ = affine_grid(e0, lw0, c0, S0)  # (r, G, K)
        J = self.log_joint(runner, u0.transpose(0, 1), include_lik=True)  # (G, n)
        best = J.argmax(0)
        u0 = u0.expand(n, -1, -1)
        return u0[torch.arange(n, device=u0.device), best]
