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

__all__ = ["LaplaceSearch", "ESCAPES", "FAR"]

#: the most times :meth:`LaplaceSearch.laplace` leaves a stationary point that is no mode
ESCAPES = 4
#: posterior standard deviations beyond which :meth:`LaplaceSearch.other_modes` looks for another mode
FAR = 4.0
#: where :meth:`LaplaceSearch.other_modes` reads the log joint between the centre and a far node
SEGMENT_POINTS = (0.25, 0.5, 0.75)


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
        # torch.inference_mode() is not lifted by enable_grad(): the log joint would come back
        # without a graph, read as flat, and the grid built on zero curvature (Evidence -73196
        # for -86.3); lifted here, as autograd needs
        with torch.inference_mode(False), torch.enable_grad():
            v = u.detach().clone()[None].requires_grad_(True)
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
        r"""Newton's method for the mode of the log joint, per datapoint, from ``u`` ``(n, K)``.

        Each step is a modified Newton step (absolute eigenvalues of the negative
        Hessian) shortened, per datapoint, until the log joint does not decrease;
        the search stops when every Newton decrement (with a Hessian taken at the
        current point) is below a tolerance. The Hessian is recomputed only when
        the gradient at the new point is not yet small under the previous one.

        A search that stops at a stationary point which is no mode (a minimum or a
        saddle: the gradient vanishes, the Hessian has a positive eigenvalue) leaves it
        along that eigenvector, to the better of the two points one unit away, and
        goes on (at most :data:`ESCAPES` times): a symmetric bimodal posterior,
        :math:`x_d \sim \mathcal N(z^2, \sigma)`, started at :math:`z = 0` and stopped
        there, and the grid built on its Hessian (clamped positive) gave
        :math:`\log p(x) = -1.1\cdot 10^8` for a true :math:`-4.1`.

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
        u, step, converged, negH = self._search(runner, u, include_lik)
        for _ in range(ESCAPES):
            lam, V = torch.linalg.eigh(negH)
            flat = math.sqrt(torch.finfo(u.dtype).eps) * lam.abs().amax(-1).clamp_min(1.0)
            no_mode = converged & (lam[:, 0] < -flat)
            if not bool(no_mode.any()):
                break
            v = V[..., 0]
            cands = torch.stack([u + v, u - v])  # (2, n, K)
            pick = self.log_joint(runner, cands, include_lik).argmax(0)
            away = cands.gather(0, pick.view(1, -1, 1).expand(1, *u.shape))[0]
            u, step, converged, negH = self._search(runner, torch.where(no_mode.unsqueeze(-1), away, u), include_lik)
        # the last, tiny Newton step (no line search needed) and the Hessian at
        # its end: the rule then no longer shows where the search started
        u = torch.where(converged.unsqueeze(-1), u + step, u)
        J, g, negH = self.derivatives(runner, u, include_lik)
        lam, V = torch.linalg.eigh(negH)
        lam = lam.clamp_min(1e-4)
        S = V * lam.rsqrt().unsqueeze(-2)  # S S^T = V diag(1/lam) V^T
        return u, S, converged

    def _search(self, runner, u, include_lik):
        """The Newton iterations of :meth:`laplace`: ``(u, step, converged, negH)``, with ``step``
        the Newton step at ``u`` from the negative Hessian ``negH`` there."""
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
        return u, step, decrement < tol, negH

    def coarse_grid(self, runner, c0, S0, K, n):
        """The coarse grid on the prior frame ``(c0, S0)`` and its log joints: ``(u0 (n, G, K),
        J (G, n))``."""
        m0 = self.init_nodes or {1: 7, 2: 5, 3: 3, 4: 3}[K]
        e0, lw0 = gaussian_grid(m0, K, c0.dtype, c0.device)
        u0, _ = affine_grid(e0, lw0, c0, S0)  # (r, G, K)
        J = self.log_joint(runner, u0.transpose(0, 1), include_lik=True)  # (G, n)
        return u0.expand(n, -1, -1), J

    def best_node(self, runner, c0, S0, K, n, coarse=None):
        """Best node per datapoint of a coarse grid on the prior frame ``(c0, S0)``
        (``coarse``: :meth:`coarse_grid`'s, made here when None)."""
        u0, J = self.coarse_grid(runner, c0, S0, K, n) if coarse is None else coarse
        best = J.argmax(0)
        return u0[torch.arange(n, device=u0.device), best]

    def other_modes(self, runner, centre, sqrt_cov, coarse, reach=None):
        r"""The mass of the posterior's modes that the grid on the Laplace approximation
        :math:`\mathcal N(c, SS^\top)` at ``centre`` does not reach, per datapoint.

        A Newton search starts from a point beyond ``reach`` of the posterior's standard
        deviations from :math:`c` (the grid's outermost node, at least :data:`FAR`): mass
        there is all but lost to the grid. Along the segment from :math:`c` to each node of
        the coarse grid ``coarse`` (:meth:`coarse_grid`) that far, the log joint of a
        log-concave posterior falls; the highest point where it rises again starts the
        search. Where it ends at another mode :math:`c_2`, as far, the
        Laplace masses :math:`Z_k = e^{J(c_k)}|\det S_k|` give the log-evidence a grid at
        :math:`c` leaves out, :math:`\log(1 + Z_2/Z_1)`. On :math:`z \sim \mathcal N(0, 2)`,
        :math:`x_d \sim \mathcal N(z^2, 0.5)` with two equal modes at :math:`\pm 2`
        the grid at one returned :math:`\log p(x)` exactly :math:`\log 2` low, with an
        error estimate of :math:`10^{-14}` (its coarser rules share its centre).
        One mode more is looked for, from one start: it finds a second mode, not every one.

        :returns: ``(log_ratio (n,), other (n, K), other_sqrt_cov (n, K, K))``:
            :math:`\log(Z_2/Z_1)` (:math:`-\infty` where no other mode was found), the
            other mode and its Laplace scale (``centre`` and ``sqrt_cov`` there).
        """
        u0, J0 = coarse
        n, K = centre.shape
        # each coarse node's distance from the centre in the posterior's standard deviations
        sds = torch.linalg.solve(sqrt_cov.unsqueeze(1), (u0 - centre.unsqueeze(1)).unsqueeze(-1))
        reach = FAR if reach is None else max(FAR, float(reach))
        far = sds.squeeze(-1).norm(dim=-1) > reach  # (n, G)
        # along the segment from the centre to a far node the log joint of a posterior with one
        # mode falls (log-concave: monotonically); where it rises again, another mode's slope
        # begins, and the highest such point starts the search (a node on the centre's own slope
        # climbed back to it, at twice the cost; the midpoint alone missed modes at +-1 with the
        # coarse node at the minimum 0 between them)
        Jc = self.log_joint(runner, centre[None], include_lik=True)[0]  # (n,)
        t = torch.tensor(SEGMENT_POINTS, dtype=centre.dtype, device=centre.device).view(-1, 1, 1, 1)
        path = centre.unsqueeze(1) + t * (u0 - centre.unsqueeze(1))  # (T, n, G, K)
        T, G = path.shape[0], u0.shape[1]
        Jp = self.log_joint(runner, path.permute(0, 2, 1, 3).reshape(T * G, n, K), include_lik=True)
        seq = torch.cat([Jc.expand(1, G, n), Jp.view(T, G, n), J0[None]])  # (T + 2, G, n)
        pts = torch.cat([centre.expand(1, G, n, K), path.permute(0, 2, 1, 3), u0.transpose(0, 1)[None]])
        noise = 16 * torch.finfo(Jc.dtype).eps * Jc.abs().clamp_min(1.0)
        low = torch.cummin(seq, 0).values
        rises = torch.zeros_like(seq, dtype=torch.bool)
        rises[1:] = seq[1:] > low[:-1] + noise
        ok = rises & far.T & torch.isfinite(seq)
        Jf = torch.where(ok, seq, torch.full_like(seq, -math.inf)).reshape(-1, n)
        best = Jf.argmax(0)
        has = torch.isfinite(Jf.amax(0))
        if not bool(has.any()):
            return torch.full_like(Jc, -math.inf), centre, sqrt_cov
        chosen = pts.reshape(-1, n, K)[best, torch.arange(n, device=u0.device)]
        start = torch.where(has.unsqueeze(-1), chosen, centre)
        other, S2, converged = self.laplace(runner, start, include_lik=True)
        d2 = torch.linalg.solve(sqrt_cov, (other - centre).unsqueeze(-1)).squeeze(-1).norm(dim=-1)
        found = has & converged & (d2 > reach)
        J2 = self.log_joint(runner, other[None], include_lik=True)[0]
        log_ratio = (J2 + torch.linalg.slogdet(S2)[1]) - (Jc + torch.linalg.slogdet(sqrt_cov)[1])
        log_ratio = torch.where(found, log_ratio, torch.full_like(log_ratio, -math.inf))
        return log_ratio, torch.where(found.unsqueeze(-1), other, centre), torch.where(found[:, None, None], S2, sqrt_cov)
