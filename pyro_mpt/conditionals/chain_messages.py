r"""Gaussian factors and messages in information form along a chain of states.

A linear dynamical system's steps are factors over pairs :math:`(z_{t-1}, z_t)` of states,
:math:`\exp(-\tfrac12[a;b]^\top J[a;b] + h_a^\top a + h_b^\top b + c)` (:class:`Factor`); a
mask's context enters each step's factor through the likelihood of the step's context
elements (:func:`step_factors`). Forward messages :math:`\alpha_t` (:func:`forward_messages`,
in blocks of :math:`\sqrt T` steps), the product of all the steps (:func:`total_factor`,
:math:`\log p(x_{\mathcal R})`, in pairs) and the smoothed moments
(:func:`information_moments`) follow by Gaussian integrals over the shared state.

For explosive dynamics (a transition matrix of spectral radius above 1) the information
form's prediction loses the state's growing variance to cancellation; there a square-root
information filter (:func:`root_filter`), the later context's information in product form
(:func:`backward_information`) and their combination (:func:`root_smoothed`) keep the digits.
:class:`~pyro_mpt.conditionals.gaussian_hmm.GaussianHMMConditionals` builds the masked
conditionals on these.

Example::

    >>> f = step_factors(parts, x, context)            # (T, q, n, ...) factors
    >>> alpha = forward_messages(prior_message(parts, f.Jaa.shape[1:-2], f.ha.shape[1:-1]), f)
"""

import math
from typing import NamedTuple

import torch

from .gaussian_linalg import LOG_2PI, tril_inverse
from .small_matrices import (
    cholesky_logdet, small_cholesky, small_cholesky_solve, small_mm, small_mv, small_solve_lower,
)

__all__ = [
    "Factor", "Message", "ChainSteps", "CONDITION_RTOL", "time_first", "context_block", "context_precision",
    "log_normalizer", "prior_message", "step_factors", "message_through", "forward_messages", "total_factor",
    "chain_steps", "root_filter", "backward_information", "root_smoothed", "information_moments",
]


class Factor(NamedTuple):
    r"""Gaussian factors over pairs :math:`(a, b)` of states, in information form:
    :math:`\exp(-\tfrac12[a;b]^\top J[a;b] + h_a^\top a + h_b^\top b + c)`,
    leading dim the step."""

    Jaa: torch.Tensor
    Jab: torch.Tensor
    Jbb: torch.Tensor
    ha: torch.Tensor
    hb: torch.Tensor
    c: torch.Tensor


class Message(NamedTuple):
    r"""Gaussian factors over one state, :math:`\exp(-\tfrac12 z^\top Jz + h^\top z + c)`."""

    J: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor


def time_first(part):
    """A part ``(n|1, T|1, ...)`` as ``(T|1, 1, n|1, ...)``: time, then masks, then datapoints."""
    return part.transpose(0, 1).unsqueeze(1)


def context_block(R, c):
    r"""The Cholesky factor of :math:`R`'s context block, embedded (the identity at the other
    elements: one factorization for every mask), and the context pairs ``c c^T``, for noise
    covariances ``R`` ``(..., O, O)`` and context indicators ``c`` ``(..., O)`` (float)."""
    cc = c.unsqueeze(-1) * c.unsqueeze(-2)
    return small_cholesky(R * cc + torch.diag_embed(1 - c)), cc


def context_precision(R, c):
    r"""The inverse of :math:`R`'s context block, embedded with zeros, ``(..., O, O)``, and the
    block's Cholesky factor (see :func:`context_block`)."""
    L, cc = context_block(R, c)
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    return small_cholesky_solve(eye.expand_as(L), L) * cc, L


def log_normalizer(J, h, c):
    r""":math:`\log\int\exp(-\tfrac12 z^\top Jz + h^\top z + c)\,dz`."""
    L = small_cholesky(J)
    y = small_cholesky_solve(h.unsqueeze(-1), L).squeeze(-1)
    return c + 0.5 * (h * y).sum(-1) - 0.5 * cholesky_logdet(L) + 0.5 * J.shape[-1] * LOG_2PI


def prior_message(parts, J_batch, h_batch):
    """The initial state's density as a message, its precision broadcast to ``J_batch``, its
    information vector and normalizer to ``h_batch``."""
    m0, S0 = parts.init_loc, parts.init_cov  # (n|1, H), (n|1, H, H)
    H = m0.shape[-1]
    L = small_cholesky(S0)
    J = small_cholesky_solve(torch.eye(H, dtype=S0.dtype, device=S0.device).expand_as(S0), L)
    h = small_mv(m0, J)
    c = -0.5 * (m0 * h).sum(-1) - 0.5 * cholesky_logdet(L) - 0.5 * H * LOG_2PI
    return Message(J.expand(J_batch + (H, H)), h.expand(h_batch + (H,)), c.expand(h_batch))


def step_factors(parts, x, context):
    r"""Each step's factor over :math:`(z_{t-1}, z_t)`: the transition density times the
    likelihood of the step's context elements, from tokens ``x`` ``(T, n, O)`` and contexts
    ``(T, q, n|1, O)``: precisions ``(T, q, n|1, H, H)`` (one row for masks shared by the
    batch and shared parameters), information vectors and normalizers ``(T, q, n, ...)``."""
    _, _, A, b, Q, C, d, R = (time_first(t) for t in parts)
    H = A.shape[-1]
    eye = torch.eye(H, dtype=A.dtype, device=A.device)
    # transition: -(z_t - z_{t-1} A - b) Q^-1 (...)^T / 2 (row vectors, as Pyro writes it)
    LQ = small_cholesky(Q)
    Qi = small_cholesky_solve(eye.expand_as(Q), LQ)
    AQi = small_mm(A, Qi)
    Qib = small_mv(b, Qi)
    c_trans = -0.5 * (b * Qib).sum(-1) - 0.5 * cholesky_logdet(LQ) - 0.5 * H * LOG_2PI
    # the context elements' likelihood: R's context block inverted, embedded with zeros
    c = context
    W, LR = context_precision(R, c)
    e = x.unsqueeze(1) - d
    We = small_mv(e, W)
    CW = small_mm(C, W)
    factor = Factor(
        small_mm(AQi, A.transpose(-1, -2)),
        -AQi,
        Qi + small_mm(CW, C.transpose(-1, -2)),
        -small_mv(Qib, A.transpose(-1, -2)),
        Qib + small_mv(We, C.transpose(-1, -2)),
        c_trans - 0.5 * (e * We).sum(-1) - 0.5 * cholesky_logdet(LR) - 0.5 * LOG_2PI * c.sum(-1),
    )
    # two batch shapes: the precisions depend on the masks and the parameters only, so masks
    # shared by the batch factorize once for every datapoint (the information vectors and
    # normalizers carry the data); the scan concatenates steps, so each part is expanded to its own
    J_shape = torch.broadcast_shapes(*(t.shape[:-2] for t in factor[:3]))
    h_shape = torch.broadcast_shapes(J_shape, factor.c.shape, *(t.shape[:-1] for t in factor[3:5]))
    shapes = (J_shape,) * 3 + (h_shape,) * 3
    return Factor(*(t.expand(b + t.shape[t.dim() - k :]) for t, b, k in zip(factor, shapes, (2, 2, 2, 1, 1, 0))))


def _combine(f, g):
    """The factor over ``(a, c)`` of ``f`` over ``(a, b)`` times ``g`` over ``(b, c)``, ``b``
    integrated out."""
    L = small_cholesky(f.Jbb + g.Jaa)
    H = L.shape[-1]
    Y = small_cholesky_solve(torch.cat([f.Jab.transpose(-1, -2), g.Jab], -1), L)
    Ya, Yc = Y[..., :H], Y[..., H:]
    y = small_cholesky_solve((f.hb + g.ha).unsqueeze(-1), L).squeeze(-1)
    return Factor(
        f.Jaa - small_mm(f.Jab, Ya),
        -small_mm(f.Jab, Yc),
        g.Jbb - small_mm(g.Jab.transpose(-1, -2), Yc),
        f.ha - small_mv(y, f.Jab.transpose(-1, -2)),
        g.hb - small_mv(y, g.Jab),
        f.c + g.c + 0.5 * ((f.hb + g.ha) * y).sum(-1) - 0.5 * cholesky_logdet(L) + 0.5 * H * LOG_2PI,
    )


def message_through(m, f):
    """The message over ``b`` of message ``m`` over ``a`` times ``f`` over ``(a, b)``, ``a``
    integrated out."""
    L = small_cholesky(m.J + f.Jaa)
    H = L.shape[-1]
    k = m.h + f.ha
    Yb = small_cholesky_solve(f.Jab, L)
    y = small_cholesky_solve(k.unsqueeze(-1), L).squeeze(-1)
    return Message(
        f.Jbb - small_mm(f.Jab.transpose(-1, -2), Yb),
        f.hb - small_mv(y, f.Jab),
        m.c + f.c + 0.5 * (k * y).sum(-1) - 0.5 * cholesky_logdet(L) + 0.5 * H * LOG_2PI,
    )


def forward_messages(start, f):
    r"""The messages :math:`\alpha_t = \int \alpha_{-1}f_0\cdots f_t` over :math:`z_t`,
    ``(T, ...)``, of ``start`` over :math:`z_{-1}` through the factors ``f`` ``(T, ...)``,
    in blocks of :math:`b = \lceil\sqrt T\,\rceil` steps: each block's factor
    (:math:`b` steps over all blocks at once), the messages entering the blocks (one step
    a block), then the messages inside them (:math:`b` steps over all blocks at once):
    about :math:`3\sqrt T` batched steps, where the step-by-step recursion takes
    :math:`T`, each a few dozen small operations (measured, loss and gradient with the
    default masks at T = 300: 0.47 s step by step, 0.10 s in blocks)."""
    T = f.c.shape[0]
    b = math.isqrt(T - 1) + 1 if T > 1 else 1
    B = -(-T // b)
    if B * b > T:
        # steps past the end (their messages are dropped): z_t ~ N(z_{t-1}, I)
        H = f.Jaa.shape[-1]
        eye = torch.eye(H, dtype=f.Jaa.dtype, device=f.Jaa.device).expand((B * b - T,) + f.Jaa.shape[1:])
        zero_h = f.ha.new_zeros((B * b - T,) + f.ha.shape[1:])
        pad = Factor(eye, -eye, eye, zero_h, zero_h, f.c.new_full((B * b - T,) + f.c.shape[1:], -0.5 * H * LOG_2PI))
        f = Factor(*(torch.cat([t, p], 0) for t, p in zip(f, pad)))
    # the steps by unbind (indexing each would allocate a zero gradient of the whole table)
    steps = [Factor(*t) for t in zip(*(t.reshape((B, b) + t.shape[1:]).unbind(1) for t in f))]
    block = steps[0]
    for step in steps[1:]:
        block = _combine(block, step)
    entering, m = [], start
    for step in zip(*(t.unbind(0) for t in block)):
        entering.append(m)
        m = message_through(m, Factor(*step))
    m = Message(*(torch.stack(t, 0) for t in zip(*entering)))  # (B, ...)
    inside = []
    for step in steps:
        m = message_through(m, step)
        inside.append(m)
    return Message(*(torch.stack(t, 1).reshape((B * b,) + t[0].shape[1:])[:T] for t in zip(*inside)))


def total_factor(f):
    r"""The factor over :math:`(z_{-1}, z_{T-1})` of the product of the steps' factors ``f``
    ``(T, ...)``, the states between them integrated out, by combining neighbours in pairs:
    :math:`\lceil\log_2 T\rceil` batched levels, where the messages take about
    :math:`3\sqrt T` (the evidence needs no message but the last)."""
    while f.c.shape[0] > 1:
        T = f.c.shape[0]
        k = T // 2
        # pairs by reshape and unbind (indexing each would allocate a zero gradient of the whole table)
        pairs = [t[: 2 * k].reshape((k, 2) + t.shape[1:]).unbind(1) for t in f]
        merged = _combine(Factor(*(p[0] for p in pairs)), Factor(*(p[1] for p in pairs)))
        if T % 2:
            merged = Factor(*(torch.cat([m, t[2 * k :]], 0) for m, t in zip(merged, f)))
        f = merged
    return Factor(*(t[0] for t in f))


def _per_step(t, T):
    """The ``T`` steps of a part ``(T|1, ...)`` as a list (by ``unbind``; a homogeneous part repeated)."""
    return list(t.unbind(0)) if t.shape[0] == T else [t[0]] * T


class ChainSteps(NamedTuple):
    """Per-step lists (``T`` entries) of a sequence's parts and its context's terms, for the
    filters that go a step at a time."""

    A: list
    b: list
    C: list
    UQ: list  # Q = UQ^T UQ
    B: list  # W = B B^T, B = diag(c) L_R^{-T}: the context block's inverse, embedded with zeros
    LR: list
    CW: list
    hl: list  # e W C^T
    e: list  # x - d
    c: list


def chain_steps(parts, x, context):
    """The :class:`ChainSteps` of ``parts`` with tokens ``x`` ``(T, n, O)`` and contexts ``(T, q, n|1, O)``."""
    _, _, A, b, Q, C, d, R = (time_first(t) for t in parts)
    T = x.shape[0]
    W, LR = context_precision(R, context)
    B = context.unsqueeze(-1) * tril_inverse(LR).transpose(-1, -2)
    CW = small_mm(C, W)
    e = x.unsqueeze(1) - d
    UQ = torch.linalg.cholesky(Q).transpose(-1, -2)
    return ChainSteps(*(_per_step(t, T) for t in (A, b, C, UQ, B, LR, CW, small_mv(e, CW.transpose(-1, -2)), e, context)))


def root_filter(parts, steps):
    r"""The forward filter for explosive dynamics, a step at a time over :class:`ChainSteps`: the
    filtered precisions' triangular roots :math:`R_t` (:math:`J_t = R_t^\top R_t`), information
    vectors, means and covariance roots :math:`S_t = R_t^{-\top}` (:math:`P_t = S_t^\top S_t`),
    each ``(T, q, n|1 or n, ...)``, and :math:`\log p(x_{\mathcal R})` ``(q, n)``.

    The states' variance grows as :math:`\rho^{2k}` over :math:`k` steps without context,
    which the information form's prediction :math:`Q^{-1} - Q^{-1}A^\top(J +
    AQ^{-1}A^\top)^{-1}AQ^{-1}` loses (two numbers of the noise's scale subtracted to give one
    :math:`\rho^{2k}` times smaller). This filter predicts :math:`\hat P_t = A_t^\top
    P_{t-1}A_t + Q_t` as the triangular factor of the QR decomposition of :math:`[S_{t-1}A_t;\,
    U_{Q_t}]` and updates the precision :math:`J_t = \hat P_t^{-1} + C_tW_tC_t^\top` as that of
    :math:`[\hat S_t^{-\top};\, (C_tB_t)^\top]`, sums where the moment form's update
    subtracts, and carries the mean whitened, :math:`m_t = w_tS_t`, through the orthogonal
    factors (a square-root information filter). Its roots keep condition numbers up to about
    :math:`10^{32}` of the covariances, but only to float64's eps times the square root of
    that relative to the largest (the engine checks where they hold them). The evidence sums the steps'
    predictive densities, each quadratic form the least-squares residual :math:`|\hat w_t|^2 +
    |e_tB_t|^2 - |w_t|^2`.
    """
    T = len(steps.A)
    H = steps.A[0].shape[-1]
    eye = torch.eye(H, dtype=steps.A[0].dtype, device=steps.A[0].device)
    tri = torch.linalg.solve_triangular
    S = torch.linalg.cholesky(parts.init_cov).transpose(-1, -2)  # P = S^T S
    w = small_mv(parts.init_loc, tri(S, eye.expand_as(S), upper=True))  # the mean whitened, m = w S
    Rf, hf, mf, Sf = [], [], [], []
    log_p = 0.0
    for t in range(T):
        Qo, Sh = _stacked_qr(small_mm(S, steps.A[t]), steps.UQ[t])  # predicted covariance Sh^T Sh
        Shi = tri(Sh, eye.expand_as(Sh), upper=True)
        wh = small_mv(w, Qo[..., :H, :]) + small_mv(steps.b[t], Shi)
        # a step without context keeps the prediction: the QR of an ill-conditioned Sh^-T alone
        # would give back its smallest root to eps times the largest (0.07 nats of a target's
        # log-density at condition 1e29); the identity stands in for it, whose unused gradient
        # stays finite where that of a root of 1e-70 would overflow
        none = steps.c[t].sum(-1) == 0
        Vt = torch.where(none[..., None, None], eye, Shi.transpose(-1, -2))
        Qo, Rt = _stacked_qr(Vt, small_mm(steps.C[t], steps.B[t]).transpose(-1, -2))
        eB = small_mv(steps.e[t], steps.B[t])
        w = small_mv(wh, Qo[..., :H, :]) + small_mv(eB, Qo[..., H:, :])
        S = tri(Rt, eye.expand_as(Rt), upper=True).transpose(-1, -2)
        quad = wh.pow(2).sum(-1) + eB.pow(2).sum(-1) - w.pow(2).sum(-1)
        logdets = _abs_logdet(Sh) + _abs_logdet(Rt) + cholesky_logdet(steps.LR[t])
        S = torch.where(none[..., None, None], Sh, S)
        w = torch.where(none[..., None], wh, w)
        Rt = torch.where(none[..., None, None], Shi.transpose(-1, -2), Rt)
        quad = torch.where(none, 0.0, quad)
        logdets = torch.where(none, 0.0, logdets)
        log_p = log_p - 0.5 * (quad + logdets + LOG_2PI * steps.c[t].sum(-1))
        Rf.append(Rt)
        hf.append(small_mv(w, Rt))
        mf.append(small_mv(w, S))
        Sf.append(S)
    return (_stacked(Rf), _stacked(hf), _stacked(mf), _stacked(Sf)), log_p


def backward_information(steps):
    r"""The information :math:`(J_t, h_t)` of the later context on each state, ``(T, ...)``,
    a step at a time over :class:`ChainSteps`: that on :math:`z_{t-1}` is :math:`A_t(Q_t +
    G_t^{-1})^{-1}A_t^\top` with :math:`G_t` that on :math:`z_t` (its own context's
    included), written as the product :math:`Q_t^{-1}(Q_t^{-1} + G_t)^{-1}G_t`: no
    subtraction, exactly zero without later context (where the information form's
    :math:`G - G(Q^{-1} + G)^{-1}G` leaves rounding errors of the noise's scale, which
    explosive dynamics make larger than the state's own precision).

    A direction of the state that the later context does not inform (or hardly) has zero
    information, but the expanding dynamics multiply the rounding errors along it by
    :math:`\rho^2` a step; negative eigenvalues are therefore set to zero at every step
    (``_psd``), where they would grow until the factorization fails."""
    T = len(steps.A)
    J = [None] * T
    h = [None] * T
    Jb, hb = 0.0, 0.0
    for t in range(T - 1, 0, -1):
        G = Jb + small_mm(steps.CW[t], steps.C[t].transpose(-1, -2))
        g = hb + steps.hl[t]
        Qi = torch.cholesky_inverse(steps.UQ[t], upper=True)
        L = torch.linalg.cholesky(Qi + G)
        N = small_mm(Qi, torch.cholesky_solve(G, L))
        N = 0.5 * (N + N.transpose(-1, -2))
        k = small_mv(torch.cholesky_solve(g.unsqueeze(-1), L).squeeze(-1), Qi)
        At = steps.A[t].transpose(-1, -2)
        Jb, hb = _psd(small_mm(small_mm(steps.A[t], N), At)), small_mv(k - small_mv(steps.b[t], N), At)
        J[t - 1], h[t - 1] = Jb, hb
    J[T - 1] = torch.zeros_like(J[T - 2]) if T > 1 else torch.zeros_like(small_mm(steps.CW[0], steps.C[0].transpose(-1, -2)))
    h[T - 1] = torch.zeros_like(h[T - 2]) if T > 1 else torch.zeros_like(steps.hl[0])
    return _stacked(J), _stacked(h)


def _psd(J):
    """Symmetric matrices ``J`` with their negative eigenvalues set to zero (those without
    one unchanged, and out of the eigendecomposition, whose gradient is not finite at
    repeated eigenvalues, e.g. of a zero matrix)."""
    with torch.no_grad():
        finite = torch.isfinite(J).all(-1).all(-1)
        eye = torch.eye(J.shape[-1], dtype=J.dtype, device=J.device)
        negative = finite & (torch.linalg.eigvalsh(torch.where(finite[..., None, None], J, eye))[..., 0] < 0)
    if not bool(negative.any()):
        return J
    H = J.shape[-1]
    safe = torch.diag(torch.arange(1, H + 1, dtype=J.dtype, device=J.device))
    lam, V = torch.linalg.eigh(torch.where(negative[..., None, None], J, safe))
    projected = small_mm(V * lam.clamp_min(0).unsqueeze(-2), V.transpose(-1, -2))
    return torch.where(negative[..., None, None], projected, J)


def root_smoothed(forward, Jb, hb):
    r"""The smoothed means and covariance roots ``(T, ...)`` from :func:`root_filter`'s
    ``forward`` and :func:`backward_information`'s ``(Jb, hb)``: :math:`J = R^\top R + J_b`,
    except where there is no later context (:math:`J_b = 0`), where the smoothed state is the
    filtered one and keeps its root (its covariance may be too ill-conditioned to factorize
    from the precision)."""
    Rf, hf, mf, Sf = forward
    H = Rf.shape[-1]
    eye = torch.eye(H, dtype=Rf.dtype, device=Rf.device)
    Jb, hb = torch.broadcast_tensors(Jb, Rf)[0], torch.broadcast_tensors(hb, hf)[0]
    last = (Jb == 0).all(-1).all(-1)
    J = torch.where(last[..., None, None], eye, small_mm(Rf.transpose(-1, -2), Rf) + Jb)
    # a direction that expands and that the context hardly informs on either side (e.g. C =
    # (1, 1) with A near a multiple of the identity leaves (1, -1) so) leaves the smoothed
    # precision too ill-conditioned for float64: the caller refuses such steps
    with torch.no_grad():
        # past float64's range (not finite) the caller's finiteness check refuses instead
        finite = torch.isfinite(J).all(-1).all(-1)
        lam = torch.linalg.eigvalsh(torch.where(finite[..., None, None], J, eye))
        bad = finite & ~(lam[..., 0] > CONDITION_RTOL * lam[..., -1])
    J = torch.where(bad[..., None, None], eye, J)
    m, S = information_moments(J, hf + hb)
    return torch.where(last[..., None], mf, m), torch.where(last[..., None, None], Sf, S), bad


#: the smallest ratio of a smoothed precision's eigenvalues that the square-root smoother
#: accepts: below, the matrix is singular to float64's rounding
CONDITION_RTOL = 1e-14


def _stacked_qr(a, b):
    r"""The reduced QR decomposition :math:`[a; b] = QR` of the rows of ``a`` over those of
    ``b`` (batch dims broadcast): :math:`R^\top R = a^\top a + b^\top b`."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return torch.linalg.qr(torch.cat([a.expand(batch + a.shape[-2:]), b.expand(batch + b.shape[-2:])], -2))


def _abs_logdet(R):
    r""":math:`\log|R^\top R|` of triangular ``R`` (a QR factor, its diagonal of either sign)."""
    return 2 * R.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)


def _stacked(ts):
    """The tensors ``ts`` (of broadcastable shapes) stacked on a new leading dim."""
    shape = torch.broadcast_shapes(*(t.shape for t in ts))
    return torch.stack([t.expand(shape) for t in ts], 0)


def information_moments(J, h):
    r"""Means of Gaussians in information form ``(J, h)`` and square roots :math:`S` of their
    covariances, :math:`J^{-1} = S^\top S` (:math:`S = L^{-1}`, :math:`J = LL^\top`)."""
    L = small_cholesky(J)
    m = small_cholesky_solve(h.unsqueeze(-1), L).squeeze(-1)
    return m, small_solve_lower(L, torch.eye(J.shape[-1], dtype=J.dtype, device=J.device).expand_as(J))
