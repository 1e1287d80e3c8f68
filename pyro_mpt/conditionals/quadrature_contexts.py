r"""Context-centred grids: each masked conditional integrated on a grid fitted to its context.

The adaptive rule of :mod:`~pyro_mpt.conditionals.quadrature` centres one grid
per datapoint on the posterior given *all* its tokens. A conditional

.. math::

    \log p(x_j \mid x_{\mathcal R}) = \log
      \frac{\int \pi(u)\, p(x_{\mathcal R}\mid u)\, p(x_j \mid u)\, du}
           {\int \pi(u)\, p(x_{\mathcal R}\mid u)\, du}
    = \log \mathbb E_{p(u \mid x_{\mathcal R})}\big[p(x_j \mid u)\big]

is a posterior expectation under the *context's* posterior, which is wider
than the full one and, when a hidden token is outlying, centred elsewhere: on
the full grid its integrand grows away from the nodes and the rule is off
(0.57 nats with 8 x 8 nodes for a leave-one-out Poisson count). Here every
(query, datapoint) pair gets its own grid, centred and scaled on a Gaussian
approximation of :math:`p(u \mid x_{\mathcal R})`, with the same
change-of-variables weights as the adaptive rule (so it is a valid rule for any
centre), and both integrals use its nodes.

**The context's Gaussian, without a search per context.** On the full grid
:math:`u = c + S e` each token's log-likelihood :math:`\ell_d(e)` and the
prior's :math:`\log\pi(e)` are projected onto quadratics by the Gauss–Hermite
rule itself (Stein's identities under :math:`\mathcal N(0, I)`):

.. math::

    b_d = \mathbb E[\ell_d(e)\, e], \qquad
    A_d = \mathbb E\big[\ell_d(e)\,(e e^\top - I)\big],

the posterior-averaged gradient and Hessian (exact for quadratics). The
context's log joint is then about :math:`h_{\mathcal R}^\top e - \tfrac12 e^\top
P_{\mathcal R} e` with :math:`h_{\mathcal R} = b_\pi + \sum_{r\in\mathcal R} b_r`
and :math:`P_{\mathcal R} = -(A_\pi + \sum_{r\in\mathcal R} A_r)`: two matrix
products with the context masks, vectorized over queries and datapoints. Its
eigenvalues are floored at a quarter of the prior's smallest precision (a
context never makes the posterior wider than about twice the prior), and the
grid is :math:`e = P_{\mathcal R}^{-1} h_{\mathcal R} + P_{\mathcal R}^{-1/2}\hat e`.

**Which queries get a grid.** A query keeps the full grid where its context's
Gaussian model sits close enough to the full posterior that a rule of
:data:`KEEP_RULE_NODES` nodes per dim, in the full grid's frame, integrates it
to :func:`resolved_tol` (:func:`full_grid_resolves`). The full rule itself is
no test of that: with the 32 nodes of a 1-D latent it integrates a Gaussian
three times as wide as the full posterior to 1e-6, but the context's true
posterior is not Gaussian, and in a latent's unconstrained coordinates (a
Gamma rate's log) its tails are heavier than the model's: a Gamma-Poisson
conditional given one of five counts was 1.7e-2 nats off on the full grid,
2.8e-5 on a grid of its own.

**Cost.** One model run per node of each query's grid: ``q`` times the full
table (``q`` masks per datapoint), in chunks of at most ``max_elements``
entries under activation checkpointing, reduced by
:class:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk` with the
(query, datapoint) pairs as its rows.
"""

import math

import torch

from ..recompute import recomputed
from .mixture import combine_partials
from .mixture_chunks import MixtureChunk
from .quadrature_rules import affine_grid, gaussian_grid

__all__ = [
    "KEEP_RULE_NODES", "GAUSSIAN_TOL", "nonquadratic_rms", "concave_part", "model_precision", "gaussian_datapoints", "resolved_tol", "full_grid_resolves", "unresolved_targets", "prior_quadratic", "TokenQuadratics", "ContextFrames", "token_quadratics", "context_models",
    "full_frames", "context_frames", "with_models", "PRIOR_REACH", "gaussian_corrections", "context_partials",
]


#: the largest root-mean-square non-quadratic part (nats, over the full grid) of a token's
#: or the prior's log-density for which :func:`gaussian_datapoints` treats it as
#: quadratic (a multiple of the values' scale where that is larger)
GAUSSIAN_TOL = 1e-9


def resolved_tol(dtype):
    """The error on a query's Gaussian model (nats) of the rule :func:`full_grid_resolves`
    applies, above which the query gets a grid of its own: 1e-6, or 100 eps of ``dtype`` where that is larger
    (rounding of the rule's log-sums).

    :param torch.dtype dtype: the table's dtype.
    :returns: float.

    Example::

        >>> resolved_tol(torch.float32)   # 1.19e-05
    """
    return max(1e-6, 100 * torch.finfo(dtype).eps)


#: Nodes per dim of the rule that decides whether a query keeps the full grid
#: (:func:`full_grid_resolves`): the adaptive defaults for K >= 2 (8, 6, 5) keep
#: their own rule; a 1-D latent's 32 nodes resolve Gaussian models far wider than
#: the full posterior, where the non-Gaussian integrand they stand for is off.
#: 12, not 8: the same accuracy on the conjugate models of the tests, and the
#: leave-one-out contexts of 20 tokens keep the full grid (masks='pll' on a
#: Poisson-lognormal model, 200 x 20, one thread: 17 ms a step as before, 42 ms
#: with 8; masks='all' 153 ms against 106 ms before the rule).
KEEP_RULE_NODES = 12


def full_grid_resolves(quad, full, num_nodes, max_elements):
    r"""Which queries keep the full grid: ``(q,)`` bool, True where a rule of
    :math:`\min(m, \text{KEEP\_RULE\_NODES})` nodes per dim in the full grid's
    frame integrates every datapoint's context Gaussian model to :func:`resolved_tol`.

    The margin against the full rule of :math:`m` nodes is for the integrands the
    model stands for, whose tails are heavier than its own where the context
    posterior is wider than the full one (see the module docstring).

    :param TokenQuadratics quad: from :func:`token_quadratics`.
    :param ContextFrames full: :func:`full_frames` of the queries.
    :param int num_nodes: nodes per dim of the full grid, :math:`m`.
    :param int max_elements: entries per intermediate of :func:`gaussian_corrections`.
    :returns: bool ``(q,)``.

    Example::

        >>> keep = full_grid_resolves(quad, full_frames(quad, h, P, C), 32, 2**22)
    """
    K = quad.grad.shape[-1]
    dtype = quad.grad.dtype
    e, log_w = gaussian_grid(min(int(num_nodes), KEEP_RULE_NODES), K, dtype, quad.grad.device)
    dden = gaussian_corrections(quad, full, None, e, log_w, max_elements)[1]
    # a query's grid runs the model for all datapoints: all of them use it
    return (dden.abs() <= resolved_tol(dtype)).all(1)


def unresolved_targets(quad, frames, target, num_nodes, max_elements):
    r"""Which targets' numerators the grid of their query does not resolve: ``(q, n, D)`` bool.

    A numerator :math:`\int \pi(u)\, p(x_{\mathcal R}\mid u)\, p(x_j\mid u)\, du`
    has the Gaussian model of its context plus target :math:`j`'s quadratic. Where one
    token is much more informative than the context (an empty context, a count in the
    prior's tail) that model sits away from the context's grid and the rule misses its
    peak (Poisson-lognormal, K = 1, D = 8: exhaustive MPT 1.2e-2 nats off). True where a
    rule of :math:`\min(m, \text{KEEP\_RULE\_NODES})` nodes per dim in the query's
    frame integrates that model with an error above :func:`resolved_tol`, as
    :func:`full_grid_resolves` asks of the normalizers.

    :param TokenQuadratics quad: from :func:`token_quadratics`.
    :param ContextFrames frames: the frames the queries are integrated in
        (:func:`full_frames`, or :func:`context_frames` for queries with grids of their own).
    :param torch.Tensor target: bool ``(q, n, D)``.
    :param int num_nodes: nodes per dim of the grids, :math:`m`.
    :param int max_elements: entries per intermediate of :func:`gaussian_corrections`.
    :returns: bool ``(q, n, D)``, False off the targets.

    Example::

        >>> bad = unresolved_targets(quad, full_frames(quad, h, P, C), mask, 8, 2**22)
    """
    K = quad.grad.shape[-1]
    dtype = quad.grad.dtype
    e, log_w = gaussian_grid(min(int(num_nodes), KEEP_RULE_NODES), K, dtype, quad.grad.device)
    dnum = gaussian_corrections(quad, frames, target, e, log_w, max_elements)[0]
    return target & (dnum.abs() > resolved_tol(dtype))


def prior_quadratic(centre, sqrt_cov, prior_centre, prior_sqrt_cov):
    r"""The Laplace approximation of the prior as a quadratic in the full grid's coordinates.

    With :math:`\log\pi(u) \approx -\tfrac12 (u - c_0)^\top (S_0 S_0^\top)^{-1} (u - c_0)`
    and :math:`u = c + S e`, the gradient and Hessian at :math:`e = 0` are

    .. math::

        b_\pi = -M^\top S_0^{-1}(c - c_0), \qquad A_\pi = -M^\top M,
        \qquad M = S_0^{-1} S.

    Contexts of few tokens are dominated by the prior, and the projection of a
    prior that is not Gaussian in :math:`u` onto the full grid (near the posterior
    given all tokens) extrapolates badly: a ``HalfCauchy`` scale's log-density in
    :math:`\log s` is nearly flat far from its mode (curvature :math:`-4e^{2u}/(1+e^{2u})^2`),
    and the contexts' grids were centred far off (exhaustive MPT of a scale mixture
    of five Normal tokens 9.2e-2 nats off; an ``InverseGamma`` variance 0.14;
    8.5e-5 and 6.1e-6 with this model of the prior).

    :param torch.Tensor centre: :math:`c`, ``(r, K)``.
    :param torch.Tensor sqrt_cov: :math:`S`, ``(r, K, K)``.
    :param torch.Tensor prior_centre: :math:`c_0`, ``(r0, K)``.
    :param torch.Tensor prior_sqrt_cov: :math:`S_0`, ``(r0, K, K)``.
    :returns: ``(b_pi (r, K), A_pi (r, K, K))``.

    Example::

        >>> grad, hess = prior_quadratic(c, S, c0, S0)
    """
    M = torch.linalg.solve(prior_sqrt_cov, sqrt_cov)
    d = torch.linalg.solve(prior_sqrt_cov, (centre - prior_centre).unsqueeze(-1))
    Mt = M.transpose(-1, -2)
    return -(Mt @ d).squeeze(-1), -(Mt @ M)


class TokenQuadratics:
    r"""Gauss–Hermite projections of the prior and of every token's log-likelihood onto quadratics.

    In the standardized coordinates :math:`e` of the full adaptive grid
    (:math:`u = c + S e`):

    :ivar torch.Tensor prior_grad: :math:`b_\pi`, ``(n, K)``.
    :ivar torch.Tensor prior_hess: :math:`A_\pi`, ``(n, K, K)``.
    :ivar torch.Tensor grad: :math:`b_d`, ``(n, D, K)``.
    :ivar torch.Tensor hess: :math:`A_d`, ``(n, D, K, K)``.
    :ivar torch.Tensor finite: ``(n,)``, False where some projected value was
        not finite (those datapoints keep the full grid).
    """

    def __init__(self, prior_grad, prior_hess, grad, hess, finite):
        self.prior_grad = prior_grad
        self.prior_hess = prior_hess
        self.grad = grad
        self.hess = hess
        self.finite = finite
        # gaussian_datapoints of the same table, for the datapoints asked so far
        self._gaussian = self._asked = None

    def gaussian_rows(self, need, std_nodes, std_log_weights, parts):
        """:func:`gaussian_datapoints` of the same table, ``(n,)`` bool, right at least
        where ``need`` (``(n,)`` bool) is True: a pass over the rows of the table not
        asked before only (the rows of a few unresolved targets, not the whole table).

        :param parts: the table's parts, as :func:`token_quadratics` takes them.
        """
        if self._gaussian is None:
            self._gaussian = torch.zeros_like(self.finite)
            self._asked = torch.zeros_like(self.finite)
        todo = need & ~self._asked
        if bool(todo.any()):
            rows = todo.nonzero().squeeze(-1)
            sub = ((sl, lp if lp.shape[0] == 1 else lp[rows], T[rows]) for sl, lp, T in parts)
            self._gaussian[rows] = gaussian_datapoints(self, std_nodes, std_log_weights, sub, rows)
            self._asked |= todo
        return self._gaussian


def _project(T, basis):
    """``(n, D, B)``: ``sum_q T[n, q, d] basis[q, b]``, one matrix product over the
    table's node dim (the engine's chunks are ``(Q_c, n, D)`` in memory)."""
    n, Qc, D = T.shape
    X = T.transpose(0, 1)
    if X.is_contiguous():
        return (basis.T @ X.reshape(Qc, n * D)).reshape(-1, n, D).permute(1, 2, 0)
    return torch.einsum("nqd,qb->ndb", T, basis)


def _small_solve(M, beta):
    """``(log det M, M^{-1} beta, ok)`` for a batch of symmetric ``K x K`` matrices, ``ok``
    where ``M`` is positive definite; closed forms for ``K <= 3`` (batched LAPACK calls
    on 2 x 2 matrices cost more than the rest of the corrections)."""
    K = M.shape[-1]
    if K == 1:
        d = M[..., 0, 0]
        ok = d > 0
        return d.clamp_min(1e-300).log(), beta / torch.where(ok, d, torch.ones_like(d))[..., None], ok
    if K in (2, 3):
        if K == 2:
            a, b, c = M[..., 0, 0], M[..., 0, 1], M[..., 1, 1]
            det = a * c - b * b
            ok = (a > 0) & (det > 0)
            adj = torch.stack([torch.stack([c, -b], -1), torch.stack([-b, a], -1)], -2)
        else:
            r0, r1, r2 = M[..., 0, :], M[..., 1, :], M[..., 2, :]
            c0, c1, c2 = torch.linalg.cross(r1, r2), torch.linalg.cross(r2, r0), torch.linalg.cross(r0, r1)
            det = (r0 * c0).sum(-1)
            minor2 = M[..., 0, 0] * M[..., 1, 1] - M[..., 0, 1] * M[..., 1, 0]
            ok = (M[..., 0, 0] > 0) & (minor2 > 0) & (det > 0)
            adj = torch.stack([c0, c1, c2], -1)  # symmetric M: the adjugate's columns
        safe = torch.where(ok, det, torch.ones_like(det))
        y = (adj @ beta.unsqueeze(-1)).squeeze(-1) / safe[..., None]
        return safe.log(), y, ok
    eye = torch.eye(K, dtype=M.dtype, device=M.device)
    chol, info = torch.linalg.cholesky_ex(M)
    ok = info == 0
    chol = torch.where(ok[..., None, None], chol, eye.expand_as(chol))
    y = torch.cholesky_solve(beta.unsqueeze(-1), chol).squeeze(-1)
    return 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1), y, ok


def token_quadratics(std_nodes, std_log_weights, parts):
    r"""Project the prior and the table onto quadratics in :math:`e`, chunk by chunk.

    .. math::

        b = \sum_q w_q f_q\, e_q, \qquad A = \sum_q w_q f_q\, (e_q e_q^\top - I),

    with :math:`(e_q, w_q)` the standard Gauss–Hermite grid ``std_nodes``
    ``(Q, K)``, ``std_log_weights`` ``(Q,)``. For :math:`f(e) = a + \beta^\top e
    + \tfrac12 e^\top \alpha e` it returns :math:`b = \beta`, :math:`A = \alpha`
    exactly (a rule with at least 3 nodes per dim). Both sums are linear in
    :math:`f`, so the table is read one chunk of nodes at a time.

    :param parts: iterable of ``(slice, log_prior (r, Q_c), table (n, Q_c, D))``
        over the grid's nodes, in order.
    :returns: :class:`TokenQuadratics`.

    Example::

        >>> quad = token_quadratics(e, log_w, [(slice(0, Q), log_pi, T)])   # quad.grad (n, D, K)
    """
    K = std_nodes.shape[-1]
    eye = None
    acc = None
    shift_T = shift_pi = None
    finite = None
    for sl, log_pi, T in parts:
        dtype = T.dtype
        e = std_nodes[sl].to(dtype)
        w = std_log_weights[sl].to(dtype).exp()
        if eye is None:
            eye = torch.eye(K, dtype=dtype, device=e.device)
            # a constant per token (and for the prior) leaves b and A unchanged (E[e] = 0,
            # E[e e^T - I] = 0 over the whole grid) and keeps a large log-likelihood from
            # swamping them in rounding: take the first node's values
            shift_T = torch.nan_to_num(T[:, :1].detach(), nan=0.0, posinf=0.0, neginf=0.0)
            shift_pi = torch.nan_to_num(log_pi[:, :1].detach(), nan=0.0, posinf=0.0, neginf=0.0)
        # the K first and K^2 second Hermite functions, weighted: one matrix product each
        basis = w[:, None] * torch.cat([e, (e[:, :, None] * e[:, None, :] - eye).reshape(-1, K * K)], -1)
        Tc, lc = T - shift_T, log_pi - shift_pi
        tok = _project(Tc, basis)
        pri = lc @ basis  # (r, K + K^2)
        # a non-finite entry leaves its token's projections non-finite (the weights are
        # positive): found on the small results, not the table
        ok = torch.isfinite(tok).all(-1).all(-1) & torch.isfinite(pri).all(-1)
        if not bool(ok.all()):
            tok = _project(torch.nan_to_num(Tc, nan=0.0, posinf=0.0, neginf=0.0), basis)
            pri = torch.nan_to_num(lc, nan=0.0, posinf=0.0, neginf=0.0) @ basis
        finite = ok if finite is None else finite & ok
        part = (
            pri[:, :K],
            pri[:, K:].reshape(-1, K, K),
            tok[..., :K],
            tok[..., K:].reshape(tok.shape[0], tok.shape[1], K, K),
        )
        acc = part if acc is None else tuple(a + b for a, b in zip(acc, part))
    prior_grad, prior_hess, grad, hess = acc
    n = grad.shape[0]
    sym = lambda A: 0.5 * (A + A.transpose(-1, -2))  # noqa: E731
    return TokenQuadratics(
        prior_grad.expand(n, K), sym(prior_hess).expand(n, K, K), grad, sym(hess), finite.expand(n)
    )


def concave_part(hess):
    r"""A summed curvature with its positive eigenvalues set to 0.

    A context's or a numerator's Gaussian model extrapolates its tokens' quadratics from
    the full posterior to where that context's posterior lies. Tokens whose summed
    log-likelihood is convex there (a Student-t's tail, whose location the full posterior
    puts far from the token) extrapolate to a model that grows without bound: with the
    prior's precision used up, a numerator's model was 30 times wider than its integrand,
    and its closed-form correction made log p(x_0 | x_1) +30.3 for -2.69 (z ~ N(0, 1),
    x_d ~ StudentT(4, b_d + w_d z, 0.5)). The sum over a model's tokens, not each token's
    curvature, is clipped: a near-full context of x_d ~ N(w_d z + c_d z^2, 0.4) has
    tokens of positive curvature in a concave sum, and clipping each token took the
    correction's local accuracy (leave-one-out 0.15 nats off for 8e-6). Log-concave
    likelihoods, Gaussian ones included, have nothing to clip.

    :param torch.Tensor hess: symmetric ``(..., K, K)``, e.g. a context's sum of
        the ``hess`` of a :class:`TokenQuadratics`.
    :returns: the same shape.

    Example::

        >>> P = -(quad.prior_hess + concave_part(curvature))
    """
    K = hess.shape[-1]
    if K == 1:
        return hess.clamp_max(0)
    # a Cholesky factor of -hess (plus rounding's worth) exists exactly where no eigenvalue
    # is positive: the eigendecomposition is paid for the other tokens only
    scale = hess.diagonal(dim1=-2, dim2=-1).abs().amax(-1)[..., None, None]
    eye = torch.eye(K, dtype=hess.dtype, device=hess.device)
    _, info = torch.linalg.cholesky_ex(-hess + (10 * K * torch.finfo(hess.dtype).eps) * scale * eye)
    convex = info != 0
    if not bool(convex.any()):
        return hess
    H = hess[convex]
    with torch.no_grad():
        lam, V = torch.linalg.eigh(H)
        # the divided differences of min(lam, 0) (Daleckii-Krein): V (G o V^T H V) V^T is
        # V min(Lambda, 0) V^T at H, and linear in H with the clip's derivative, also where
        # eigenvalues repeat (eigh's own backward divides by their differences)
        neg = lam.clamp_max(0)
        gap = lam.unsqueeze(-1) - lam.unsqueeze(-2)
        slope = (lam < 0).to(lam.dtype)
        tied = gap.abs() <= 1e-12 * lam.abs().amax(-1, keepdim=True).unsqueeze(-1).clamp_min(1.0)
        G = torch.where(tied, 0.5 * (slope.unsqueeze(-1) + slope.unsqueeze(-2)),
                        (neg.unsqueeze(-1) - neg.unsqueeze(-2)) / torch.where(tied, torch.ones_like(gap), gap))
    Vt = V.transpose(-1, -2)
    out = hess.clone()
    out[convex] = V @ (G * (Vt @ H @ V)) @ Vt
    return out


def nonquadratic_rms(std_nodes, std_log_weights, parts):
    r"""Root mean square over the grid of what each token's log-likelihood, and the prior's
    log-density, is beyond its quadratic projection (:func:`token_quadratics`).

    The Hermite functions :math:`1, e_i, e_i^2 - 1, e_i e_j\ (i < j)` are orthogonal under
    the standard Gauss--Hermite weights (exactly, with at least 3 nodes per dim), with
    squared norms 1, 1, 2, 1; so the energy left outside the quadratic is
    :math:`E[f^2] - a^2 - |b|^2 - \sum_i A_{ii}^2/2 - \sum_{i<j} A_{ij}^2`. One pass over
    the table in float64, with the weights normalized there: the energy is a difference
    of sums of squares (float32 weights sum to :math:`1 - 6\cdot 10^{-8}`, which alone
    leaves 3e-3 nats of a value scale of 14).

    :param parts: the table's parts, as :func:`token_quadratics` takes them.
    :returns: ``(tokens (n, D), prior (r,), scale (n,))``, float64; ``scale`` is the
        largest root mean square of a datapoint's values (shifted by their first node's).

    Example::

        >>> tokens, prior, scale = nonquadratic_rms(e, log_w, [(slice(0, Q), log_pi, T)])
    """
    K = std_nodes.shape[-1]
    w_all = std_log_weights.double().exp()
    w_all = w_all / w_all.sum()
    eye = torch.eye(K, dtype=torch.float64, device=std_nodes.device)
    moments = shift_T = shift_pi = None
    for sl, log_pi, T in parts:
        Tf = torch.nan_to_num(T.double(), nan=0.0, posinf=0.0, neginf=0.0)
        lf = torch.nan_to_num(log_pi.double(), nan=0.0, posinf=0.0, neginf=0.0)
        if shift_T is None:
            # the energy does not depend on a constant per token: one keeps the squares small
            shift_T, shift_pi = Tf[:, :1], lf[:, :1]
        Tf, lf = Tf - shift_T, lf - shift_pi
        e, w = std_nodes[sl].double(), w_all[sl]
        basis = w[:, None] * torch.cat(
            [torch.ones_like(e[:, :1]), e, (e[:, :, None] * e[:, None, :] - eye).reshape(-1, K * K)], -1
        )
        step = (_project(Tf, basis), _project(Tf * Tf, w[:, None])[..., 0], lf @ basis, (lf * lf) @ w)
        moments = step if moments is None else tuple(a + b for a, b in zip(moments, step))
    t_proj, t_sq, p_proj, p_sq = moments
    scale = t_sq.clamp_min(0).sqrt().amax(-1).maximum(p_sq.clamp_min(0).sqrt())
    return _nonquadratic(t_proj, t_sq, K), _nonquadratic(p_proj, p_sq, K), scale


def gaussian_datapoints(quad, std_nodes, std_log_weights, parts, rows=None):
    r"""``(n,)`` bool: datapoints whose prior and every token's log-likelihood are quadratic
    in :math:`e` over the grid, to rounding, e.g. PPCA: their Gaussian corrections
    (:func:`gaussian_corrections`) are then exact for every query and target.

    A second pass over the table (:func:`nonquadratic_rms`), so it is asked only where it
    can spare work: before grids of their own for unresolved targets, a model run each.
    The bound is :data:`GAUSSIAN_TOL`, or the larger of 30 square roots of float64's eps
    (the energy's rounding) and 1000 eps of the table's dtype, times the values' scale.

    :param TokenQuadratics quad: from :func:`token_quadratics` (its ``finite``; its dtype
        is the table's).
    :param parts: the table's parts, as :func:`token_quadratics` takes them.
    :param torch.Tensor rows: optional long ``(r,)``: ``parts`` hold these datapoints'
        rows only, and the answer is theirs, ``(r,)``.

    Example::

        >>> gaussian_datapoints(quad, e, log_w, state.detached_parts())   # all True for PPCA
    """
    tokens, prior, scale = nonquadratic_rms(std_nodes, std_log_weights, parts)
    worst = tokens.amax(-1).maximum(prior)
    rel = max(30 * math.sqrt(torch.finfo(torch.float64).eps), 1000 * torch.finfo(quad.grad.dtype).eps)
    finite = quad.finite if rows is None else quad.finite[rows]
    return finite & (worst <= torch.clamp_min(rel * scale, GAUSSIAN_TOL))


def _nonquadratic(proj, mean_sq, K):
    """The root of the energy outside the quadratic (:func:`nonquadratic_rms`), from the
    projections ``proj`` (constant, K first, K^2 second Hermite functions) and ``E[f^2]``."""
    mean, grad = proj[..., 0], proj[..., 1 : K + 1]
    hess = proj[..., K + 1 :].reshape(*proj.shape[:-1], K, K)
    hess = 0.5 * (hess + hess.transpose(-1, -2))
    diag = torch.diagonal(hess, dim1=-2, dim2=-1)
    off = (hess.square().sum((-1, -2)) - diag.square().sum(-1)) / 2
    left = mean_sq - mean.square() - grad.square().sum(-1) - diag.square().sum(-1) / 2 - off
    return left.clamp_min(0).sqrt()


class ContextFrames:
    r"""Each context's Gaussian, in the full grid's standardized coordinates and in ``u``.

    :ivar torch.Tensor centre: :math:`c_{\mathcal R} = c + S m_{\mathcal R}`, ``(q, n, K)``.
    :ivar torch.Tensor sqrt_cov: :math:`S_{\mathcal R} = S L_{\mathcal R}`, ``(q, n, K, K)``.
    :ivar torch.Tensor shift: :math:`m_{\mathcal R}`, ``(q, n, K)``.
    :ivar torch.Tensor root: :math:`L_{\mathcal R}`, ``(q, n, K, K)``.
    :ivar torch.Tensor grad: :math:`h_{\mathcal R}` (unfloored model), ``(q, n, K)``.
    :ivar torch.Tensor precision: :math:`P_{\mathcal R}` (unfloored model), ``(q, n, K, K)``.
    :ivar torch.Tensor fitted: ``(q, n)``, False where the full grid's frame was kept.
    :ivar torch.Tensor curvature: :math:`C_{\mathcal R}`, the context tokens' summed
        curvature (unclipped), ``(q, n, K, K)``: a numerator's model adds its target's
        before the clip (:func:`gaussian_corrections`).
    """

    def __init__(self, centre, sqrt_cov, shift, root, grad, precision, fitted, curvature):
        self.centre = centre
        self.sqrt_cov = sqrt_cov
        self.shift = shift
        self.root = root
        self.grad = grad
        self.precision = precision
        self.fitted = fitted
        self.curvature = curvature


def with_models(frames, h, P, C):
    r"""``frames`` with the Gaussian models ``(h, P, C)`` in place of their own, the grids
    (``centre``, ``sqrt_cov``, ``shift``, ``root``, ``fitted``) kept: the models of the
    table's projection with its graph (:func:`token_quadratics` of parts that have one),
    where the frames were fitted without it. The corrections of :func:`gaussian_corrections`
    are then differentiable in the model's parameters on grids that are not: the corrected
    log-sums' gradient is that of their value (without it, the rule's own gradient on a grid
    that does not resolve the integrand: 6 % off a linear-Gaussian model's, up to 118 %).

    :returns: :class:`ContextFrames`.
    """
    return ContextFrames(frames.centre, frames.sqrt_cov, frames.shift, frames.root, h, P, frames.fitted, C)


def context_models(quad, ctx):
    r"""Each context's quadratic log joint :math:`h_{\mathcal R}^\top e - \tfrac12 e^\top P_{\mathcal R} e`,
    with :math:`P_{\mathcal R} = -(A_\pi + \operatorname{concave}(C_{\mathcal R}))` and
    :math:`C_{\mathcal R} = \sum_{r\in\mathcal R} A_r` (:func:`concave_part`).

    :param TokenQuadratics quad: from :func:`token_quadratics`.
    :param torch.Tensor ctx: context masks, float, 1 in the context, ``(q, n, D)``.
    :returns: ``(h (q, n, K), P (q, n, K, K), C (q, n, K, K))``.
    """
    ctx = ctx.to(quad.grad.dtype)
    h = quad.prior_grad + torch.einsum("qnd,ndk->qnk", ctx, quad.grad)
    C = torch.einsum("qnd,ndkl->qnkl", ctx, quad.hess)
    C = 0.5 * (C + C.transpose(-1, -2))
    return h, model_precision(quad, C), C


def model_precision(quad, curvature):
    r"""The precision :math:`-(A_\pi + \operatorname{concave}(C))` of a model whose tokens'
    summed curvature is ``curvature`` ``(..., n, K, K)`` (:func:`concave_part`)."""
    P = -(quad.prior_hess + concave_part(curvature))
    return 0.5 * (P + P.transpose(-1, -2))


def full_frames(quad, h, P, C):
    r"""The full grid itself as every context's frame (:math:`m = 0`, :math:`L = I`).

    :param TokenQuadratics quad: from :func:`token_quadratics`.
    :param torch.Tensor h: :math:`h_{\mathcal R}` ``(q, n, K)`` (:func:`context_models`).
    :param torch.Tensor P: :math:`P_{\mathcal R}` ``(q, n, K, K)``.
    :param torch.Tensor C: :math:`C_{\mathcal R}` ``(q, n, K, K)``.
    :returns: :class:`ContextFrames` without ``centre`` and ``sqrt_cov``.

    Example::

        >>> frames = full_frames(quad, *context_models(quad, (~mask).double()))   # h, P, C
    """
    q, n, K = h.shape
    eye = torch.eye(K, dtype=h.dtype, device=h.device)
    fitted = quad.finite[None, :].expand(q, n)
    return ContextFrames(None, None, torch.zeros_like(h), eye.expand(q, n, K, K), h, P, fitted, C)


#: How far a context's centre may lie beyond the full posterior's distance from the prior's
#: mode, in prior standard deviations (:func:`context_frames`).
PRIOR_REACH = 6.0


def _within_prior_reach(quad, shift):
    """Shrink context centres ``(q, n, K)`` towards the prior's mode to within
    :data:`PRIOR_REACH` prior standard deviations beyond the full posterior's distance.

    A context lies between the prior and the full posterior; a quadratic fitted near
    the full posterior and extrapolated to a context of one or two tokens of a
    location-scale model (m ~ N(0, 2), s ~ HalfCauchy, the one-token posterior a ridge
    s -> 0 at m = x) put the centre thousands of prior standard deviations away, where
    the model's log-likelihoods were 1e24 and exhaustive MPT 6e22 nats off."""
    lam_pi = -quad.prior_hess  # (n, K, K), the prior's precision in e
    try:
        e0 = torch.linalg.solve(lam_pi, quad.prior_grad.unsqueeze(-1)).squeeze(-1)  # its mode
    except RuntimeError:  # a singular prior quadratic: no reach to bound
        return shift
    if not bool(torch.isfinite(e0).all()):
        return shift
    d = shift - e0
    dist = (d.unsqueeze(-2) @ lam_pi @ d.unsqueeze(-1)).squeeze(-1).squeeze(-1).clamp_min(0).sqrt()  # (q, n)
    reach = (e0.unsqueeze(-2) @ lam_pi @ e0.unsqueeze(-1)).squeeze(-1).squeeze(-1).clamp_min(0).sqrt() + PRIOR_REACH
    factor = torch.where(dist > reach, reach / dist.clamp_min(torch.finfo(d.dtype).tiny), torch.ones_like(dist))
    return e0 + d * factor.unsqueeze(-1)


def context_frames(quad, h, P, C, centre, sqrt_cov):
    r"""Centre and scale of each context's Gaussian.

    :param TokenQuadratics quad: from :func:`token_quadratics`.
    :param torch.Tensor h: :math:`h_{\mathcal R}` ``(q, n, K)`` (:func:`context_models`).
    :param torch.Tensor P: :math:`P_{\mathcal R}` ``(q, n, K, K)``.
    :param torch.Tensor C: :math:`C_{\mathcal R}` ``(q, n, K, K)``.
    :param torch.Tensor centre: the full grid's :math:`c`, ``(r, K)``.
    :param torch.Tensor sqrt_cov: its :math:`S`, ``(r, K, K)``.
    :returns: :class:`ContextFrames` with :math:`m_{\mathcal R} = P_{\mathcal R}^{-1}
        h_{\mathcal R}` and :math:`L_{\mathcal R} L_{\mathcal R}^\top = P_{\mathcal R}^{-1}`
        (eigenvalues floored); the full grid's frame where the projection was not finite.

    Example::

        >>> h, P, C = context_models(quad, (~mask).double())
        >>> frames = context_frames(quad, h, P, C, c, S)
        >>> frames.centre.shape   # (q, n, K)
    """
    dtype = h.dtype
    lam, V = torch.linalg.eigh(P)
    # a context never leaves the posterior wider than the prior; the floor keeps a
    # quadratic fitted near the full posterior from extrapolating to a flat one
    prior_lam = torch.linalg.eigvalsh(-quad.prior_hess)[..., :1]  # (n, 1)
    floor = (0.25 * prior_lam).clamp_min(torch.finfo(dtype).eps ** 0.5)
    lam = torch.maximum(lam, floor)
    shift = (V @ ((V.transpose(-1, -2) @ h.unsqueeze(-1)) / lam.unsqueeze(-1))).squeeze(-1)  # (q, n, K)
    shift = _within_prior_reach(quad, shift)
    root = V * lam.rsqrt().unsqueeze(-2)  # P^{-1/2} up to rotation
    c = centre.to(dtype)
    S = sqrt_cov.to(dtype)
    q, n, K = h.shape
    fitted = quad.finite[None, :].expand(q, n)
    keep = ~fitted[..., None]
    eye = torch.eye(K, dtype=dtype, device=h.device)
    c_R = torch.where(keep, c.expand(q, n, K), c + (S @ shift.unsqueeze(-1)).squeeze(-1))
    S_R = torch.where(keep[..., None], S.expand(q, n, K, K), S @ root)
    shift = torch.where(keep, torch.zeros_like(shift), shift)
    root = torch.where(keep[..., None], eye.expand(q, n, K, K), root)
    return ContextFrames(c_R, S_R, shift, root, h, P, fitted, C)


def gaussian_corrections(quad, frames, target, std_nodes, std_log_weights, max_elements):
    r"""The rule's error on the Gaussian model of each numerator and normalizer, in closed form.

    In a frame's coordinates :math:`\hat e` (:math:`e = m + L\hat e`) the
    quadratic model of the normalizer's integrand over the rule's density is
    :math:`\exp(\beta_0^\top \hat e + \tfrac12 \hat e^\top \alpha_0 \hat e)`, with
    :math:`\beta_0 = L^\top(h - P m)`, :math:`\alpha_0 = I - L^\top P L` (both zero
    for a context's own frame unless the eigenvalue floor acted), and target
    :math:`j`'s numerator has :math:`h + b_j` and the precision of the curvature
    :math:`C + A_j` (:func:`model_precision`) in their place. For :math:`g(\hat e) = \exp(\beta^\top\hat e +
    \tfrac12\hat e^\top\alpha\hat e)`

    .. math::

        \log \mathbb E_{\mathcal N(0, I)}[g] = -\tfrac12\log|I - \alpha|
          + \tfrac12 \beta^\top (I - \alpha)^{-1}\beta,

    and the correction is that minus the rule's :math:`\log\sum_k w_k g(\hat e_k)`:
    added to the rule's log-sums it makes them exact for Gaussian
    likelihoods (a control variate), and its size is the rule's error on the
    model, which says how far the grid is from resolving the integrand.

    :param TokenQuadratics quad: the projection.
    :param ContextFrames frames: the contexts' frames.
    :param torch.Tensor target: bool ``(q, n, D)``; numerators are corrected there
        only (None: none, the normalizers alone).
    :param torch.Tensor std_nodes: the standard grid ``(Q, K)``.
    :param torch.Tensor std_log_weights: ``(Q,)``.
    :param int max_elements: entries per intermediate ``(rows, Q)``.
    :returns: ``(num (q, n, D), den (q, n))`` (``num`` None without targets: a
        :math:`(q, n, D)` table of zeros is :math:`D^2n` entries for the :math:`D`
        leave-one-out queries); 0 off the targets, where the
        model's integral diverges (:math:`I - \alpha` not positive definite) and
        where the projection was not finite.

    Example::

        >>> dnum, dden = gaussian_corrections(quad, frames, mask, e, log_w, 2**22)
    """
    L, m = frames.root, frames.shift
    q, n, K = m.shape
    D = quad.grad.shape[1]
    dtype = L.dtype
    eye = torch.eye(K, dtype=dtype, device=L.device)
    Lt = L.transpose(-1, -2)
    beta0 = (Lt @ (frames.grad - (frames.precision @ m.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).squeeze(-1)
    alpha0 = eye - Lt @ frames.precision @ L  # (q, n, K, K)
    e = std_nodes.to(dtype)
    lw = std_log_weights.to(dtype)
    # the linear and quadratic forms on the nodes as one product:
    # beta^T e + e^T alpha e / 2 = <(beta, vec(alpha)), (e, vec(e e^T) / 2)>
    features = torch.cat([e, 0.5 * (e[:, :, None] * e[:, None, :]).reshape(-1, K * K)], -1).T  # (K + K^2, Q)

    def rule(beta, alpha):  # (t, K), (t, K, K) -> log sum_k w_k g(e_k), (t,)
        step = max(1, max_elements // max(1, e.shape[0]))
        out = []
        for s in range(0, beta.shape[0], step):
            coef = torch.cat([beta[s : s + step], alpha[s : s + step].reshape(-1, K * K)], -1)
            out.append(torch.logsumexp(torch.addmm(lw, coef, features), -1))
        return torch.cat(out) if out else beta.new_zeros(0)

    def correction(beta, alpha):
        M = eye - 0.5 * (alpha + alpha.transpose(-1, -2))
        logdet, y, ok = _small_solve(M, beta)
        corr = -0.5 * logdet + 0.5 * (beta * y).sum(-1) - rule(beta, alpha)
        ok = ok & torch.isfinite(corr)
        return torch.where(ok, corr, torch.zeros_like(corr))

    dden = correction(beta0.reshape(-1, K), alpha0.reshape(-1, K, K)).reshape(q, n)
    dden = torch.where(frames.fitted, dden, torch.zeros_like(dden))
    if target is None:
        return None, dden
    dnum = torch.zeros(q, n, D, dtype=dtype, device=L.device)
    # only the targets' numerators: a leave-one-out query has one per datapoint
    a, i, j = (target & frames.fitted[..., None]).nonzero(as_tuple=True)
    Lr, mr = L[a, i], m[a, i]
    bj, Aj = quad.grad[i, j], quad.hess[i, j]  # (t, K), (t, K, K)
    # the numerator's model: the context's tokens and target j, their summed curvature clipped
    Pt = -(quad.prior_hess[i] + concave_part(frames.curvature[a, i] + Aj))
    Lrt = Lr.transpose(-1, -2)
    beta = (Lrt @ (frames.grad[a, i] + bj - (Pt @ mr.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).squeeze(-1)
    alpha = eye - Lrt @ Pt @ Lr
    dnum[a, i, j] = correction(beta, alpha)
    return dnum, dden


def context_partials(runner, std_nodes, std_log_weights, centre, sqrt_cov, ctx, max_elements, keep_elements=0, targets=None):
    r"""Numerators and normalizers of every query on its own grid.

    :param runner: the :class:`~pyro_mpt.conditionals.quadrature_nodes.NodeRunner`.
    :param torch.Tensor std_nodes: the standard grid ``(Q, K)``.
    :param torch.Tensor std_log_weights: its log-weights ``(Q,)``.
    :param torch.Tensor centre: per-query centres ``(q, n, K)`` (:func:`context_frames`).
    :param torch.Tensor sqrt_cov: per-query scales ``(q, n, K, K)``.
    :param torch.Tensor ctx: context masks, float, ``(q, n|1, D)``.
    :param int max_elements: entries per model run and reduction chunk.
    :param int keep_elements: keep the tables with their graph when all of
        them hold at most this many entries; otherwise each chunk runs under
        activation checkpointing (the backward pass runs the model again).
    :param torch.Tensor targets: optional long ``(q, n)``: each query's single
        target token, whose numerator alone is made
        (:meth:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk.target_partials`);
        ``num`` is then ``(q, n)``.
    :returns: ``(num (q, n, D), den (q, n))``: the log-sums
        :math:`\log\sum_k W_k \pi(u_k) p(x_{\mathcal R}, x_j\mid u_k)` and
        :math:`\log\sum_k W_k \pi(u_k) p(x_{\mathcal R}\mid u_k)` over the
        query's nodes (unnormalized, as
        :meth:`~pyro_mpt.conditionals.mixture_chunks.MixtureChunk.mask_partials`).

    Example::

        >>> num, den = context_partials(runner, e, log_w, c_R, S_R, ctx, 2**24)
    """
    q, n, K = centre.shape
    D = ctx.shape[-1]
    Q = std_nodes.shape[0]
    ctx = ctx.expand(q, n, D)
    nodes, log_W = affine_grid(std_nodes, std_log_weights, centre.reshape(q * n, K), sqrt_cov.reshape(q * n, K, K))
    nodes = nodes.reshape(q, n, Q, K).detach()
    log_W = log_W.reshape(q, n, Q).detach()
    per_query = Q * n * D
    q_step = max(1, max_elements // max(1, per_query))
    node_step = Q if per_query <= max_elements else max(1, max_elements // max(1, n * D))
    nums, dens = [], []
    for qs in range(0, q, q_step):
        qsl = slice(qs, min(q, qs + q_step))
        qc = qsl.stop - qsl.start
        c_ctx = ctx[qsl].reshape(1, qc * n, D)
        total = None
        for ks in range(0, Q, node_step):
            ksl = slice(ks, min(Q, ks + node_step))

            def run(c_ctx, qsl=qsl, ksl=ksl, qc=qc):
                u = nodes[qsl, :, ksl]  # (qc, n, Qk, K)
                Qk = u.shape[2]
                log_pi, logp = runner.run(u.permute(0, 2, 1, 3).reshape(qc * Qk, n, K))
                log_pi = log_pi.expand(qc * Qk, n).reshape(qc, Qk, n).permute(0, 2, 1)
                logp = logp.reshape(qc, Qk, n, D).permute(0, 2, 1, 3)  # (qc, n, Qk, D)
                logw = (log_W[qsl, :, ksl] + log_pi).reshape(qc * n, Qk)
                chunk = MixtureChunk(logw, logp.reshape(qc * n, Qk, D))
                if targets is None:
                    return chunk.mask_partials(c_ctx)
                return chunk.target_partials(c_ctx[0], targets[qsl].reshape(qc * n))

            if torch.is_grad_enabled() and q * per_query > keep_elements:
                part = recomputed(run, c_ctx)
            else:
                part = run(c_ctx)
            total = combine_partials(total, part)
        num, den = total
        nums.append(num.reshape((qc, n, D) if targets is None else (qc, n)))
        dens.append(den.reshape(qc, n))
    return torch.cat(nums, 0), torch.cat(dens, 0)

