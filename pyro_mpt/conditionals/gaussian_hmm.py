r"""Exact masked conditionals of an observed ``dist.GaussianHMM``, by Kalman filtering and smoothing.

A ``GaussianHMM`` (a linear dynamical system, see
:class:`~pyro_mpt.conditionals.linear_dynamical.LinearDynamicalParts`) observes
:math:`x_t = z_tC_t + v_t`, :math:`v_t \sim \mathcal N(d_t, R_t)`, at every step
:math:`t < T`; its tokens are the :math:`T\cdot O` elements :math:`x_{t,o}`
(token ``t * O + o``). For a context :math:`\mathcal R` (the tokens a mask leaves
visible), step :math:`t` contributes the factor over :math:`(z_{t-1}, z_t)` made of
the transition density and the likelihood of the step's context elements, whose
noise precision is :math:`W_t = (M_tR_tM_t + I - M_t)^{-1} \circ c_tc_t^\top` with
:math:`c_t` the step's context indicator and :math:`M_t = \operatorname{diag}(c_t)`
(:math:`R_t`'s context block inverted, zeros elsewhere: one batched factorization
serves every mask). The forward messages :math:`\alpha_t(z_t) = \int
p(z_{-1})f_0\cdots f_t` and backward messages :math:`\beta_t(z_t) = \int f_{t+1}\cdots
f_{T-1}` are Gaussian factors in information form (precision, information vector,
log-normalizer), so :math:`\alpha_t\beta_t` is the smoothed :math:`z_t \mid
x_{\mathcal R} \sim \mathcal N(\hat m_t, \hat P_t)` and :math:`\int\alpha_{T-1} =
p(x_{\mathcal R})`. A target :math:`x_{t,o}` depends on the context only through
:math:`z_t` and the step's own context elements :math:`x_{t,c}`:

.. math::

    x_{t,o} \mid z_t, x_{t,c} \sim \mathcal N\big(z_t\tilde C_{t,o} + d_{t,o}
        + g_o(x_{t,c} - d_{t,c}),\; R_{t,oo} - g_oR_{t,co}\big),
    \qquad g_o = R_{t,oc}R_{t,cc}^{-1},\quad \tilde C_{t,o} = C_{t,o} - C_{t,c}\,g_o^\top,

so :math:`\log p(x_{t,o} \mid x_{\mathcal R})` is a univariate Normal density with
mean :math:`\hat m_t\tilde C_{t,o} + d_{t,o} + g_o(x_{t,c} - d_{t,c})` and variance
:math:`\tilde C_{t,o}^\top\hat P_t\tilde C_{t,o} + R_{t,oo} - g_oR_{t,co}` (with a
diagonal :math:`R_t`, :math:`g_o = 0`). ``log_evidence`` and every chain-rule sum are
:math:`\log p(x)`, the normalizer of the product of all the steps' factors (multiplied in
pairs, ``_total``).

Each mask costs :math:`O(T(H^3 + O^3))`, against :math:`O(T^3O^3)` for the dense
covariance of the whole sequence
(:func:`~pyro_mpt.conditionals.linear_dynamical.gaussian_hmm_moments`, which the
Gaussian engine uses for a ``GaussianHMM`` with latents or inside other
structure). The messages run in blocks of about :math:`\sqrt T` steps
(``_messages``), vectorized over masks, datapoints and blocks, in float64 (the
covariances of a long chain lose digits in float32); the result is in the dtype of
the model's parameters and data. Masks shared by the batch go to the dense
covariance (the ``"gaussian"`` engine), whose aggregated forms factorize each mask
once for all the datapoints, where smoothing costs every datapoint its own pass.

Explosive dynamics (a transition matrix of spectral radius :math:`\rho > 1`) grow a
state's variance as :math:`\rho^{2k}` over :math:`k` steps without context, which the
information form's prediction loses to cancellation and the dense covariance to its
span of :math:`\rho^{2T}`. For them the later context's information comes from a
product form (``_backward_information``), the earlier's from the information form at
the steps where the smoothed precision keeps its digits and from a square-root
information filter elsewhere (``_root_filter``, a step at a time), and the evidence
from the square-root filter; see docs/numerics.md for the measured accuracy and the
refusals (``gaussian-hmm-ill-conditioned``, ``gaussian-hmm-not-finite``).
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import pyro.distributions as dist

from ..recompute import recomputed
from .base import ConditionalEngine, EngineNotApplicable
from .distributions import base_distribution, check_one_sequence, check_sequence_alone
from .gaussian import GaussianConditionals
from .gaussian_linalg import LOG_2PI, tril_inverse
from .linear_dynamical import LinearDynamicalParts, gaussian_hmm_parts

__all__ = ["GaussianHMMConditionals", "GaussianHMMState", "AUTO_MIN_TOKENS", "WIDE_HIDDEN"]

_WHO = "conditionals='gaussian_hmm'"


#: the sequence length (tokens, :math:`T\cdot O`) from which ``"auto"`` takes this engine over
#: the dense covariance: loss and gradient at H = 2, O = 1, N = 20, one thread, the
#: default masks break even at about 250 tokens and ``masks="all"`` at about 450
#: (the dense path's cost grows as :math:`T^3` a mask, this one's as :math:`T`)
AUTO_MIN_TOKENS = 256


#: above this hidden dim the engine's sequences must hold ``min_tokens * H / WIDE_HIDDEN`` tokens:
#: its steps' batched LAPACK routines grow with :math:`H` while the dense covariance's cost does
#: not, and the break-even rises (loss and gradient, O = 1, N = 20, one thread, default masks:
#: about 256 tokens at H = 12 and 16, 450 at H = 20, 520 at H = 32, where at 256 tokens this
#: engine took 2.8 s and the dense covariance 1.1 s)
WIDE_HIDDEN = 12


#: the span :math:`\rho^{2T}` of a sequence's variances from which this engine serves it
#: however short (the dense covariance's factorization keeps about 16 - log10 of it digits)
EXPLOSIVE_SPAN = 1e6


#: matrices up to this size are multiplied, factorized and solved with elementwise operations
#: over the batch: the batched GEMM and LAPACK routines loop over the matrices at about a
#: microsecond each (1.4 ms a Cholesky solve of 1780 2 x 2 matrices, 60 us a product, against
#: 3 us a vectorized multiply), and the filter runs several a step
SMALL = 6


@dataclass
class GaussianHMMState:
    """The linear dynamical system of one evaluation.

    :param LinearDynamicalParts parts: float64, each with a leading dim of ``n`` rows
        or one (shared by the datapoints), then its time dim (``T`` or 1).
    :param str site: the observed site, for error messages.
    :param bool diagonal_noise: whether every :math:`R_t` is diagonal (the step's other
        elements then carry no information on a target beyond :math:`z_t`).
    :param torch.dtype dtype: the dtype of the results.
    :param tuple prepared_from: ``(tokens, model, guide, args, kwargs)``, from which masks
        shared by the batch prepare the dense covariance's state (``dense``, made once).
    :param float radius: the largest spectral radius of the transition matrices.
    :param float noise_precision: the largest eigenvalue of the transition noise's precisions
        :math:`Q_t^{-1}`, the scale of the information form's rounding errors.
    """

    parts: LinearDynamicalParts = field(repr=False)
    site: str
    diagonal_noise: bool
    dtype: torch.dtype
    num_data: int
    num_tokens: int
    num_steps: int
    prepared_from: tuple = field(default=None, repr=False)
    dense: tuple = field(default=None, repr=False)
    radius: float = 0.0
    noise_precision: float = 1.0

    @property
    def explosive(self):
        """Whether a transition matrix has a spectral radius above 1: the smoother then checks
        the information form's digits and takes the square-root filter (``_root_filter``)
        where they are lost, and never sends masks to the dense covariance."""
        return self.radius > 1.0


def _rows(t, batch_shape, event_ndim):
    """``t`` ``(..., *tail)`` (``event_ndim`` dims in ``tail``) broadcastable to
    ``(*batch, *tail)`` -> ``(n|1, *tail)``."""
    tail = tuple(t.shape[t.dim() - event_ndim :])
    lead = t.shape[: t.dim() - len(tail)]
    if all(s == 1 for s in lead):
        return t.reshape((1,) + tail)
    return t.expand(tuple(batch_shape) + tail).reshape((-1,) + tail)


def _mm(a, b):
    """Batched products of small matrices, as a broadcast multiply and sum (see ``SMALL``)."""
    if a.shape[-1] > SMALL or b.shape[-1] > SMALL:
        return a @ b
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _mv(v, M):
    """Row vectors ``v`` ``(..., a)`` times ``M`` ``(..., a, b)``."""
    return (v.unsqueeze(-1) * M).sum(-2)



def _entries(A):
    """The entries of ``(..., n, m)`` matrices as a list of rows of ``(...)`` tensors (by
    ``unbind``: the backward pass of an indexed entry allocates a zero tensor of the whole
    input, and a loop over the entries would allocate one per entry)."""
    return [row.unbind(-1) for row in A.unbind(-2)]


def _cholesky(A):
    """Lower Cholesky factor ``(..., n, n)``."""
    n = A.shape[-1]
    if n > SMALL:
        return torch.linalg.cholesky(A)
    a = _entries(A)
    L = [[None] * n for _ in range(n)]
    for j in range(n):
        s = a[j][j]
        for k in range(j):
            s = s - L[j][k] * L[j][k]
        L[j][j] = s.sqrt()
        for i in range(j + 1, n):
            s = a[i][j]
            for k in range(j):
                s = s - L[i][k] * L[j][k]
            L[i][j] = s / L[j][j]
    zero = torch.zeros_like(L[0][0])
    return torch.stack([torch.stack([L[i][j] if j <= i else zero for j in range(n)], -1) for i in range(n)], -2)


def _solve_lower(L, B):
    """``L^{-1} B`` for lower-triangular ``L`` ``(..., n, n)`` and ``B`` ``(..., n, m)``."""
    n = L.shape[-1]
    if n > SMALL:
        return torch.linalg.solve_triangular(L, B, upper=False)
    return torch.stack(_forward_rows(_entries(L), B.unbind(-2)), -2)


def _forward_rows(l, b):
    """Forward substitution with the entries ``l`` of a lower-triangular matrix, over the rows ``b``."""
    y = []
    for i in range(len(b)):
        s = b[i]
        for k in range(i):
            s = s - l[i][k].unsqueeze(-1) * y[k]
        y.append(s / l[i][i].unsqueeze(-1))
    return y


def _cholesky_solve(B, L):
    """``A^{-1} B`` from the Cholesky factor ``L`` of ``A``."""
    n = L.shape[-1]
    if n > SMALL:
        return torch.cholesky_solve(B, L)
    l = _entries(L)
    y = _forward_rows(l, B.unbind(-2))
    x = [None] * n
    for i in range(n - 1, -1, -1):
        s = y[i]
        for k in range(i + 1, n):
            s = s - l[k][i].unsqueeze(-1) * x[k]
        x[i] = s / l[i][i].unsqueeze(-1)
    return torch.stack(x, -2)


class _Factor(NamedTuple):
    r"""Gaussian factors over pairs :math:`(a, b)` of states, in information form:
    :math:`\exp(-\tfrac12[a;b]^\top J[a;b] + h_a^\top a + h_b^\top b + c)`,
    leading dim the step."""

    Jaa: torch.Tensor
    Jab: torch.Tensor
    Jbb: torch.Tensor
    ha: torch.Tensor
    hb: torch.Tensor
    c: torch.Tensor


class _Message(NamedTuple):
    r"""Gaussian factors over one state, :math:`\exp(-\tfrac12 z^\top Jz + h^\top z + c)`."""

    J: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor


def _time_first(part):
    """A part ``(n|1, T|1, ...)`` as ``(T|1, 1, n|1, ...)``: time, then masks, then datapoints."""
    return part.transpose(0, 1).unsqueeze(1)


def _logdet(L):
    r""":math:`\log|LL^\top|` from a Cholesky factor."""
    return 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def _context_block(R, c):
    r"""The Cholesky factor of :math:`R`'s context block, embedded (the identity at the other
    elements: one factorization for every mask), and the context pairs ``c c^T``, for noise
    covariances ``R`` ``(..., O, O)`` and context indicators ``c`` ``(..., O)`` (float)."""
    cc = c.unsqueeze(-1) * c.unsqueeze(-2)
    return _cholesky(R * cc + torch.diag_embed(1 - c)), cc


def _context_precision(R, c):
    r"""The inverse of :math:`R`'s context block, embedded with zeros, ``(..., O, O)``, and the
    block's Cholesky factor (see :func:`_context_block`)."""
    L, cc = _context_block(R, c)
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    return _cholesky_solve(eye.expand_as(L), L) * cc, L


def _log_normalizer(J, h, c):
    r""":math:`\log\int\exp(-\tfrac12 z^\top Jz + h^\top z + c)\,dz`."""
    L = _cholesky(J)
    y = _cholesky_solve(h.unsqueeze(-1), L).squeeze(-1)
    return c + 0.5 * (h * y).sum(-1) - 0.5 * _logdet(L) + 0.5 * J.shape[-1] * LOG_2PI


def _prior_message(parts, J_batch, h_batch):
    """The initial state's density as a message, its precision broadcast to ``J_batch``, its
    information vector and normalizer to ``h_batch``."""
    m0, S0 = parts.init_loc, parts.init_cov  # (n|1, H), (n|1, H, H)
    H = m0.shape[-1]
    L = _cholesky(S0)
    J = _cholesky_solve(torch.eye(H, dtype=S0.dtype, device=S0.device).expand_as(S0), L)
    h = _mv(m0, J)
    c = -0.5 * (m0 * h).sum(-1) - 0.5 * _logdet(L) - 0.5 * H * LOG_2PI
    return _Message(J.expand(J_batch + (H, H)), h.expand(h_batch + (H,)), c.expand(h_batch))


def _step_factors(parts, x, context):
    r"""Each step's factor over :math:`(z_{t-1}, z_t)`: the transition density times the
    likelihood of the step's context elements, from tokens ``x`` ``(T, n, O)`` and contexts
    ``(T, q, n|1, O)``: precisions ``(T, q, n|1, H, H)`` (one row for masks shared by the
    batch and shared parameters), information vectors and normalizers ``(T, q, n, ...)``."""
    _, _, A, b, Q, C, d, R = (_time_first(t) for t in parts)
    H = A.shape[-1]
    eye = torch.eye(H, dtype=A.dtype, device=A.device)
    # transition: -(z_t - z_{t-1} A - b) Q^-1 (...)^T / 2 (row vectors, as Pyro writes it)
    LQ = _cholesky(Q)
    Qi = _cholesky_solve(eye.expand_as(Q), LQ)
    AQi = _mm(A, Qi)
    Qib = _mv(b, Qi)
    c_trans = -0.5 * (b * Qib).sum(-1) - 0.5 * _logdet(LQ) - 0.5 * H * LOG_2PI
    # the context elements' likelihood: R's context block inverted, embedded with zeros
    c = context
    W, LR = _context_precision(R, c)
    e = x.unsqueeze(1) - d
    We = _mv(e, W)
    CW = _mm(C, W)
    factor = _Factor(
        _mm(AQi, A.transpose(-1, -2)),
        -AQi,
        Qi + _mm(CW, C.transpose(-1, -2)),
        -_mv(Qib, A.transpose(-1, -2)),
        Qib + _mv(We, C.transpose(-1, -2)),
        c_trans - 0.5 * (e * We).sum(-1) - 0.5 * _logdet(LR) - 0.5 * LOG_2PI * c.sum(-1),
    )
    # two batch shapes: the precisions depend on the masks and the parameters only, so masks
    # shared by the batch factorize once for every datapoint (the information vectors and
    # normalizers carry the data); the scan concatenates steps, so each part is expanded to its own
    J_shape = torch.broadcast_shapes(*(t.shape[:-2] for t in factor[:3]))
    h_shape = torch.broadcast_shapes(J_shape, factor.c.shape, *(t.shape[:-1] for t in factor[3:5]))
    shapes = (J_shape,) * 3 + (h_shape,) * 3
    return _Factor(*(t.expand(b + t.shape[t.dim() - k :]) for t, b, k in zip(factor, shapes, (2, 2, 2, 1, 1, 0))))


def _combine(f, g):
    """The factor over ``(a, c)`` of ``f`` over ``(a, b)`` times ``g`` over ``(b, c)``, ``b``
    integrated out."""
    L = _cholesky(f.Jbb + g.Jaa)
    H = L.shape[-1]
    Y = _cholesky_solve(torch.cat([f.Jab.transpose(-1, -2), g.Jab], -1), L)
    Ya, Yc = Y[..., :H], Y[..., H:]
    y = _cholesky_solve((f.hb + g.ha).unsqueeze(-1), L).squeeze(-1)
    return _Factor(
        f.Jaa - _mm(f.Jab, Ya),
        -_mm(f.Jab, Yc),
        g.Jbb - _mm(g.Jab.transpose(-1, -2), Yc),
        f.ha - _mv(y, f.Jab.transpose(-1, -2)),
        g.hb - _mv(y, g.Jab),
        f.c + g.c + 0.5 * ((f.hb + g.ha) * y).sum(-1) - 0.5 * _logdet(L) + 0.5 * H * LOG_2PI,
    )


def _through(m, f):
    """The message over ``b`` of message ``m`` over ``a`` times ``f`` over ``(a, b)``, ``a``
    integrated out."""
    L = _cholesky(m.J + f.Jaa)
    H = L.shape[-1]
    k = m.h + f.ha
    Yb = _cholesky_solve(f.Jab, L)
    y = _cholesky_solve(k.unsqueeze(-1), L).squeeze(-1)
    return _Message(
        f.Jbb - _mm(f.Jab.transpose(-1, -2), Yb),
        f.hb - _mv(y, f.Jab),
        m.c + f.c + 0.5 * (k * y).sum(-1) - 0.5 * _logdet(L) + 0.5 * H * LOG_2PI,
    )


def _messages(start, f):
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
        pad = _Factor(eye, -eye, eye, zero_h, zero_h, f.c.new_full((B * b - T,) + f.c.shape[1:], -0.5 * H * LOG_2PI))
        f = _Factor(*(torch.cat([t, p], 0) for t, p in zip(f, pad)))
    # the steps by unbind (indexing each would allocate a zero gradient of the whole table)
    steps = [_Factor(*t) for t in zip(*(t.reshape((B, b) + t.shape[1:]).unbind(1) for t in f))]
    block = steps[0]
    for step in steps[1:]:
        block = _combine(block, step)
    entering, m = [], start
    for step in zip(*(t.unbind(0) for t in block)):
        entering.append(m)
        m = _through(m, _Factor(*step))
    m = _Message(*(torch.stack(t, 0) for t in zip(*entering)))  # (B, ...)
    inside = []
    for step in steps:
        m = _through(m, step)
        inside.append(m)
    return _Message(*(torch.stack(t, 1).reshape((B * b,) + t[0].shape[1:])[:T] for t in zip(*inside)))


def _total(f):
    r"""The factor over :math:`(z_{-1}, z_{T-1})` of the product of the steps' factors ``f``
    ``(T, ...)``, the states between them integrated out, by combining neighbours in pairs:
    :math:`\lceil\log_2 T\rceil` batched levels, where the messages take about
    :math:`3\sqrt T` (the evidence needs no message but the last)."""
    while f.c.shape[0] > 1:
        T = f.c.shape[0]
        k = T // 2
        # pairs by reshape and unbind (indexing each would allocate a zero gradient of the whole table)
        pairs = [t[: 2 * k].reshape((k, 2) + t.shape[1:]).unbind(1) for t in f]
        merged = _combine(_Factor(*(p[0] for p in pairs)), _Factor(*(p[1] for p in pairs)))
        if T % 2:
            merged = _Factor(*(torch.cat([m, t[2 * k :]], 0) for m, t in zip(merged, f)))
        f = merged
    return _Factor(*(t[0] for t in f))


def _per_step(t, T):
    """The ``T`` steps of a part ``(T|1, ...)`` as a list (by ``unbind``; a homogeneous part repeated)."""
    return list(t.unbind(0)) if t.shape[0] == T else [t[0]] * T


class _Steps(NamedTuple):
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


def _steps(parts, x, context):
    """The :class:`_Steps` of ``parts`` with tokens ``x`` ``(T, n, O)`` and contexts ``(T, q, n|1, O)``."""
    _, _, A, b, Q, C, d, R = (_time_first(t) for t in parts)
    T = x.shape[0]
    W, LR = _context_precision(R, context)
    B = context.unsqueeze(-1) * tril_inverse(LR).transpose(-1, -2)
    CW = _mm(C, W)
    e = x.unsqueeze(1) - d
    UQ = torch.linalg.cholesky(Q).transpose(-1, -2)
    return _Steps(*(_per_step(t, T) for t in (A, b, C, UQ, B, LR, CW, _mv(e, CW.transpose(-1, -2)), e, context)))


def _root_filter(parts, steps):
    r"""The forward filter for explosive dynamics, a step at a time over :class:`_Steps`: the
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
    that relative to the largest (see :func:`_reliable`). The evidence sums the steps'
    predictive densities, each quadratic form the least-squares residual :math:`|\hat w_t|^2 +
    |e_tB_t|^2 - |w_t|^2`.
    """
    T = len(steps.A)
    H = steps.A[0].shape[-1]
    eye = torch.eye(H, dtype=steps.A[0].dtype, device=steps.A[0].device)
    tri = torch.linalg.solve_triangular
    S = torch.linalg.cholesky(parts.init_cov).transpose(-1, -2)  # P = S^T S
    w = _mv(parts.init_loc, tri(S, eye.expand_as(S), upper=True))  # the mean whitened, m = w S
    Rf, hf, mf, Sf = [], [], [], []
    log_p = 0.0
    for t in range(T):
        Qo, Sh = _stacked_qr(_mm(S, steps.A[t]), steps.UQ[t])  # predicted covariance Sh^T Sh
        Shi = tri(Sh, eye.expand_as(Sh), upper=True)
        wh = _mv(w, Qo[..., :H, :]) + _mv(steps.b[t], Shi)
        # a step without context keeps the prediction: the QR of an ill-conditioned Sh^-T alone
        # would give back its smallest root to eps times the largest (0.07 nats of a target's
        # log-density at condition 1e29); the identity stands in for it, whose unused gradient
        # stays finite where that of a root of 1e-70 would overflow
        none = steps.c[t].sum(-1) == 0
        Vt = torch.where(none[..., None, None], eye, Shi.transpose(-1, -2))
        Qo, Rt = _stacked_qr(Vt, _mm(steps.C[t], steps.B[t]).transpose(-1, -2))
        eB = _mv(steps.e[t], steps.B[t])
        w = _mv(wh, Qo[..., :H, :]) + _mv(eB, Qo[..., H:, :])
        S = tri(Rt, eye.expand_as(Rt), upper=True).transpose(-1, -2)
        quad = wh.pow(2).sum(-1) + eB.pow(2).sum(-1) - w.pow(2).sum(-1)
        logdets = _abs_logdet(Sh) + _abs_logdet(Rt) + _logdet(steps.LR[t])
        S = torch.where(none[..., None, None], Sh, S)
        w = torch.where(none[..., None], wh, w)
        Rt = torch.where(none[..., None, None], Shi.transpose(-1, -2), Rt)
        quad = torch.where(none, 0.0, quad)
        logdets = torch.where(none, 0.0, logdets)
        log_p = log_p - 0.5 * (quad + logdets + LOG_2PI * steps.c[t].sum(-1))
        Rf.append(Rt)
        hf.append(_mv(w, Rt))
        mf.append(_mv(w, S))
        Sf.append(S)
    return (_stacked(Rf), _stacked(hf), _stacked(mf), _stacked(Sf)), log_p


def _backward_information(steps):
    r"""The information :math:`(J_t, h_t)` of the later context on each state, ``(T, ...)``,
    a step at a time over :class:`_Steps`: that on :math:`z_{t-1}` is :math:`A_t(Q_t +
    G_t^{-1})^{-1}A_t^\top` with :math:`G_t` that on :math:`z_t` (its own context's
    included), written as the product :math:`Q_t^{-1}(Q_t^{-1} + G_t)^{-1}G_t`: no
    subtraction, exactly zero without later context (where the information form's
    :math:`G - G(Q^{-1} + G)^{-1}G` leaves rounding errors of the noise's scale, which
    explosive dynamics make larger than the state's own precision).

    A direction of the state that the later context does not inform (or hardly) has zero
    information, but the expanding dynamics multiply the rounding errors along it by
    :math:`\rho^2` a step; negative eigenvalues are therefore set to zero at every step
    (:func:`_psd`), where they would grow until the factorization fails."""
    T = len(steps.A)
    J = [None] * T
    h = [None] * T
    Jb, hb = 0.0, 0.0
    for t in range(T - 1, 0, -1):
        G = Jb + _mm(steps.CW[t], steps.C[t].transpose(-1, -2))
        g = hb + steps.hl[t]
        Qi = torch.cholesky_inverse(steps.UQ[t], upper=True)
        L = torch.linalg.cholesky(Qi + G)
        N = _mm(Qi, torch.cholesky_solve(G, L))
        N = 0.5 * (N + N.transpose(-1, -2))
        k = _mv(torch.cholesky_solve(g.unsqueeze(-1), L).squeeze(-1), Qi)
        At = steps.A[t].transpose(-1, -2)
        Jb, hb = _psd(_mm(_mm(steps.A[t], N), At)), _mv(k - _mv(steps.b[t], N), At)
        J[t - 1], h[t - 1] = Jb, hb
    J[T - 1] = torch.zeros_like(J[T - 2]) if T > 1 else torch.zeros_like(_mm(steps.CW[0], steps.C[0].transpose(-1, -2)))
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
    projected = _mm(V * lam.clamp_min(0).unsqueeze(-2), V.transpose(-1, -2))
    return torch.where(negative[..., None, None], projected, J)


def _root_smoothed(forward, Jb, hb):
    r"""The smoothed means and covariance roots ``(T, ...)`` from :func:`_root_filter`'s
    ``forward`` and :func:`_backward_information`'s ``(Jb, hb)``: :math:`J = R^\top R + J_b`,
    except where there is no later context (:math:`J_b = 0`), where the smoothed state is the
    filtered one and keeps its root (its covariance may be too ill-conditioned to factorize
    from the precision)."""
    Rf, hf, mf, Sf = forward
    H = Rf.shape[-1]
    eye = torch.eye(H, dtype=Rf.dtype, device=Rf.device)
    Jb, hb = torch.broadcast_tensors(Jb, Rf)[0], torch.broadcast_tensors(hb, hf)[0]
    last = (Jb == 0).all(-1).all(-1)
    J = torch.where(last[..., None, None], eye, _mm(Rf.transpose(-1, -2), Rf) + Jb)
    # a direction that expands and that the context hardly informs on either side (e.g. C =
    # (1, 1) with A near a multiple of the identity leaves (1, -1) so) leaves the smoothed
    # precision too ill-conditioned for float64: the caller refuses such steps
    with torch.no_grad():
        # past float64's range (not finite) the caller's finiteness check refuses instead
        finite = torch.isfinite(J).all(-1).all(-1)
        lam = torch.linalg.eigvalsh(torch.where(finite[..., None, None], J, eye))
        bad = finite & ~(lam[..., 0] > CONDITION_RTOL * lam[..., -1])
    J = torch.where(bad[..., None, None], eye, J)
    m, S = _moments(J, hf + hb)
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


def _moments(J, h):
    r"""Means of Gaussians in information form ``(J, h)`` and square roots :math:`S` of their
    covariances, :math:`J^{-1} = S^\top S` (:math:`S = L^{-1}`, :math:`J = LL^\top`)."""
    L = _cholesky(J)
    m = _cholesky_solve(h.unsqueeze(-1), L).squeeze(-1)
    return m, _solve_lower(L, torch.eye(J.shape[-1], dtype=J.dtype, device=J.device).expand_as(J))


def _spectral_radius(A):
    """The largest spectral radius of transition matrices ``A`` ``(..., H, H)`` (infinite where
    an entry is not finite: LAPACK's eigenvalue routines do not return on those)."""
    A = A.detach()
    if not bool(torch.isfinite(A).all()):
        return math.inf
    return float(torch.linalg.eigvals(A).abs().max()) if A.numel() else 0.0


def _noise_precision(Q):
    """The largest eigenvalue of the precisions of noise covariances ``Q`` ``(..., H, H)``."""
    return float(1.0 / torch.linalg.eigvalsh(Q.detach()).min())


#: the smallest eigenvalue of a smoothed state's precision, relative to the transition noise's,
#: from which the information form's rounding errors (about float64's eps times the noise's
#: precision, from the prediction's subtraction) leave it 9 digits
INFORMATION_RTOL = 1e-7


def _reliable(J, state):
    r"""Where the smoothed precisions ``J`` ``(T, q, n|1, H, H)`` from the information form
    are finite, and where moreover each eigenvalue is at least :data:`INFORMATION_RTOL` times
    the noise's precision, ``(T, q, n|1)`` each; below, the state's variance has outgrown the
    noise's (explosive dynamics over a stretch without context) and the information form has
    lost it."""
    finite = torch.isfinite(J).all(-1).all(-1)
    finite = finite & finite.all(0)  # a non-finite step spoils its whole sequence's messages
    J = torch.where(finite[..., None, None], J, torch.zeros((), dtype=J.dtype, device=J.device))
    smallest = torch.linalg.eigvalsh(J)[..., 0]
    return finite, finite & (smallest > INFORMATION_RTOL * state.noise_precision)


def _refuse_ill_conditioned(state):
    """Raise for smoothed states too ill-conditioned for float64 (see :func:`_root_smoothed`)."""
    raise ValueError(
        f"{_WHO}: the conditionals of site {state.site!r} cannot be computed to float64's "
        f"precision. The transition matrices' spectral radius is {state.radius:.3g} > 1, and a "
        f"direction of the state that they expand is hardly informed by the context of some "
        f"masks (e.g. masks that leave a token or two of a long sequence visible, or an "
        f"observation matrix with equal columns and a transition matrix near a multiple of the "
        f"identity): the states' covariances span more digits than float64 has. Keep the dynamics stable (e.g. parametrize the transition matrix with a "
        f"spectral radius below 1), or mask shorter stretches."
    )


def _check_finite(state, value):
    r"""Refuse non-finite results: with explosive dynamics a state's variance grows as
    :math:`\rho^{2k}` over :math:`k` steps without context (:math:`\rho` the transition
    matrices' spectral radius), and past float64's largest number (about :math:`10^{308}`)
    nothing finite is left to condition on."""
    if bool(torch.isfinite(value).all()):
        return
    radius = state.radius
    raise ValueError(
        f"{_WHO}: the conditionals of site {state.site!r} are not finite. The transition "
        f"matrices' spectral radius is {radius:.3g}"
        + (
            f" > 1: the states' variance grows as {radius:.3g}^(2 k) over k steps without context, "
            f"beyond float64's range (about 1e308) over the masked stretches of these {state.num_steps} steps. "
            if radius > 1
            else ": the model's covariances lose all their digits in float64. "
        )
        + "Keep the dynamics stable (e.g. parametrize the transition matrix with a spectral "
        "radius below 1) or score shorter sequences."
    )


class GaussianHMMConditionals(ConditionalEngine):
    r"""Exact masked conditionals of an observed ``dist.GaussianHMM`` by Kalman smoothing.

    Serves a model whose observed site is a ``pyro.distributions.GaussianHMM``
    (in a plate over sequences, or alone) and that has no latent site; the
    :math:`T\cdot O` elements of a sequence are its tokens. Each mask's
    conditionals :math:`\log p(x_{t,o} \mid x_{\mathcal R})` cost
    :math:`O(T(H^3 + O^3))` (see the module docstring), where the dense covariance
    of the sequence costs :math:`O(T^3O^3)` a mask. ``"auto"`` takes this engine
    before the Gaussian one for such models from :data:`AUTO_MIN_TOKENS` tokens a
    sequence.

    :param int min_tokens: sequences with fewer tokens (:math:`T\cdot O`) are declined
        (``EngineNotApplicable``), and with fewer than ``min_tokens * H / WIDE_HIDDEN``
        above hidden dim :data:`WIDE_HIDDEN`. 0 by default; ``"auto"`` asks for
        :data:`AUTO_MIN_TOKENS`, below which the dense covariance is faster.
    :param bool dense_per_datapoint: send masks drawn per datapoint to the dense
        covariance (``"gaussian"``'s sums over the pairs) where a measured cost rule says
        it is cheaper (sequences of fewer than about 470 tokens at H = 2; the rule is in
        ``_dense_cheaper_per_datapoint``). False by default, so that this engine, asked
        for by name, smooths them; ``"auto"`` asks for True. Masks shared by the batch
        follow their own cost rule either way.
    :param int max_elements: bound on the elements the filter and smoother keep
        per chunk of ``(mask, datapoint)`` pairs (the steps' factors and
        messages); the chunks of one call are recomputed in the backward
        pass when there are several.

    Example::

        >>> def lds(x):
        ...     with pyro.plate("sequences", x.shape[0]):
        ...         pyro.sample("x", dist.GaussianHMM(init, A, trans, C, obs, duration=T), obs=x)
        >>> MaskedPretrainingLoss(conditionals="gaussian_hmm").differentiable_loss(lds, None, x)
    """

    def __init__(self, *, min_tokens=0, dense_per_datapoint=False, max_elements=2**24):
        super().__init__(max_elements=max_elements)
        self.min_tokens = int(min_tokens)
        self.dense_per_datapoint = bool(dense_per_datapoint)

    def prepare(self, tokens, model, guide, args, kwargs):
        hmm = base_distribution(tokens.site["fn"])
        if not isinstance(hmm, dist.GaussianHMM):
            raise EngineNotApplicable(
                f"{_WHO} needs observed site {tokens.name!r} to be a dist.GaussianHMM; "
                f"it is {type(hmm).__name__}."
            )
        check_sequence_alone(tokens, hmm, _WHO, "integrates", " (conditionals='gaussian' serves a GaussianHMM "
                             "with Normal latents through its dense covariance).")
        check_one_sequence(tokens, hmm, _WHO, " (conditionals='gaussian' serves them as blocks)")
        H = hmm.hidden_dim
        parts = gaussian_hmm_parts(hmm)
        radius = _spectral_radius(parts.transition.to(torch.float64))
        needed = self.min_tokens * max(1.0, H / WIDE_HIDDEN)
        # explosive dynamics: the dense covariance's variances span up to rho^(2T), and past
        # EXPLOSIVE_SPAN lose the digits of its factorization (measured: radius 1.3 over 60
        # steps, 1e14, 0.55 nats off), so this engine serves such sequences of any length
        T = tokens.event_shape[0]
        if tokens.num_tokens < needed and not 2 * T * math.log10(max(radius, 1.0)) > math.log10(EXPLOSIVE_SPAN):
            wide = f" times hidden_dim {H} / {WIDE_HIDDEN}" if H > WIDE_HIDDEN else ""
            raise EngineNotApplicable(
                f"{_WHO} declines the GaussianHMM at site {tokens.name!r}: {tokens.num_tokens} "
                f"tokens a sequence, fewer than {math.ceil(needed)} (min_tokens={self.min_tokens}{wide}), "
                f"below which the dense covariance (conditionals='gaussian') is faster."
            )
        dtype = torch.promote_types(tokens.value.dtype, parts.transition.dtype)
        rows = []
        for part, event_ndim in zip(parts, (1, 2, 3, 2, 3, 3, 2, 3)):
            rows.append(_rows(part.to(torch.float64), tokens.site_batch_shape, event_ndim))
        parts = LinearDynamicalParts(*rows)
        R = parts.obs_cov
        diagonal = bool((R - torch.diag_embed(R.diagonal(dim1=-2, dim2=-1)) == 0).all())
        return GaussianHMMState(parts, tokens.name, diagonal, dtype, tokens.num_data, tokens.num_tokens, T,
                                (tokens, model, guide, args, kwargs), radius=radius,
                                noise_precision=_noise_precision(parts.trans_cov) if radius > 1.0 else 1.0)

    def _per_pair(self, state):
        """Elements kept per ``(mask, datapoint)`` pair for the backward pass: the steps'
        factors, messages and their intermediates (bounds the saved-tensor hooks' counts,
        e.g. 340 a step at H = 2, O = 1 with a full noise, 1700 at H = 4, O = 3)."""
        H = state.parts.transition.shape[-1]
        O = state.parts.observation.shape[-1]
        return state.num_steps * (96 * H * H + 16 * H * O + 16 * O * O + 64)

    def _chunks(self, state, x, context, fn):
        """``fn(x, context_chunk)`` over chunks of the masks (dim 1), concatenated; each chunk
        under activation checkpointing when there are several and gradients are recorded."""
        q, n = context.shape[1], x.shape[1]
        per = max(1, self.max_elements // max(1, n * self._per_pair(state)))
        if per >= q:
            return fn(x, context)
        recompute = torch.is_grad_enabled()
        outs = []
        for start in range(0, q, per):
            chunk = context[:, start : start + per]
            outs.append(recomputed(fn, x, chunk) if recompute else fn(x, chunk))
        return tuple(torch.cat(parts, 1) for parts in zip(*outs))

    def _smoothed(self, state, x, context):
        r"""For contexts ``(T, q, n|1, O)`` (float, 1 at context elements) and tokens
        ``(T, n, O)``: the smoothed means ``(T, q, n, H)`` and covariances ``(T, q, n, H, H)``
        of the states."""
        if not state.explosive:
            return _moments(*self._smoothed_information(state.parts, x, context))
        # explosive dynamics: the later context's information by products (exact zero where
        # there is none), the earlier's in information form at the steps where the smoothed
        # precision keeps its digits (blocked, faster), by the square-root filter at the others;
        # each on its own (mask, datapoint) pairs, as a pair's non-finite intermediates would
        # make every gradient NaN
        q, n, T = context.shape[1], x.shape[1], x.shape[0]
        Jb, hb = _backward_information(_steps(state.parts, x, context))
        with torch.no_grad():
            alpha = self._forward_information(state.parts, x, context)
            finite, ok = _reliable(alpha.J + Jb, state)
        finite, ok = finite.expand(T, q, n), ok.expand(T, q, n)
        if bool(ok.all()):
            alpha = self._forward_information(state.parts, x, context)
            return _moments(alpha.J + Jb, alpha.h + hb)
        H = state.parts.transition.shape[-1]
        ms = x.new_zeros((q * n, T, H))  # pairs first, for index_put
        Ss = x.new_zeros((q * n, T, H, H))
        eye = torch.eye(H, dtype=x.dtype, device=x.device)
        for pairs, information in ((finite.all(0), True), (~ok.all(0), False)):
            qi, ni = pairs.nonzero(as_tuple=True)
            if qi.numel() == 0:
                continue
            parts = LinearDynamicalParts(*(t[ni] if t.shape[0] > 1 else t for t in state.parts))
            ctx = context.expand(-1, -1, n, -1)[:, qi, ni].unsqueeze(1)
            Jb_, hb_ = (t.expand((T, q, n) + t.shape[3:])[:, qi, ni].unsqueeze(1) for t in (Jb, hb))
            keep = ok[:, qi, ni].unsqueeze(1)  # (T, 1, pairs): the information form's steps
            if information:
                alpha = self._forward_information(parts, x[:, ni], ctx)
                m, S = _moments(torch.where(keep[..., None, None], alpha.J + Jb_, eye), alpha.h + hb_)
            else:
                m, S, bad = _root_smoothed(_root_filter(parts, _steps(parts, x[:, ni], ctx))[0], Jb_, hb_)
                if bool((bad & ~keep).any()) and bool(torch.isfinite(m).all()):
                    _refuse_ill_conditioned(state)
            m, S = m[:, 0].movedim(0, 1), S[:, 0].movedim(0, 1)  # (pairs, T, ...)
            i = qi * n + ni
            if not information:
                keep = keep[:, 0].transpose(0, 1)
                m = torch.where(keep[..., None], ms[i], m)
                S = torch.where(keep[..., None, None], Ss[i], S)
            ms, Ss = ms.index_put((i,), m), Ss.index_put((i,), S)
        return ms.reshape(q, n, *ms.shape[1:]).movedim(2, 0), Ss.reshape(q, n, *Ss.shape[1:]).movedim(2, 0)

    @staticmethod
    def _forward_information(parts, x, context):
        """The forward messages :math:`\\alpha_t` in information form (blocked, ``_messages``)."""
        f = _step_factors(parts, x, context)
        return _messages(_prior_message(parts, f.Jaa.shape[1:-2], f.c.shape[1:]), f)

    @staticmethod
    def _smoothed_information(parts, x, context):
        """The smoothed states in information form, ``(T, q, n|1, H, H)`` and ``(T, q, n, H)``:
        the forward and backward messages, each in blocks (``_messages``)."""
        f = _step_factors(parts, x, context)
        H = f.Jaa.shape[-1]
        T = x.shape[0]
        J_batch, h_batch = f.Jaa.shape[1:-2], f.c.shape[1:]
        alpha = _messages(_prior_message(parts, J_batch, h_batch), f)
        zero = _Message(f.Jaa.new_zeros(J_batch + (H, H)), f.ha.new_zeros(h_batch + (H,)), f.c.new_zeros(h_batch))
        # beta_t: the reversed chain's messages, beta_{T-2} .. beta_{-1}; beta_{T-1} is flat
        back = _messages(zero, _Factor(f.Jbb.flip(0), f.Jab.transpose(-1, -2).flip(0), f.Jaa.flip(0),
                                       f.hb.flip(0), f.ha.flip(0), f.c.flip(0)))
        beta = _Message(*(torch.cat([t[: T - 1].flip(0), z.unsqueeze(0)], 0) for t, z in zip(back, zero)))
        return alpha.J + beta.J, alpha.h + beta.h

    def _conditionals(self, state, x, context):
        """Means and variances ``(T, q, n, O)`` of every token given the context."""
        ms, Ss = self._smoothed(state, x, context)
        C, d, R = (_time_first(t) for t in state.parts[5:])  # (T|1, 1, n|1, ...)
        var_noise = R.diagonal(dim1=-2, dim2=-1)
        offset = d
        if not state.diagonal_noise:
            # g = R_oc R_cc^-1 for every element o (zero columns outside the context)
            c = context
            Rc = R * c.unsqueeze(-2)
            L, _ = _context_block(R, c)
            # rows of the context elements zeroed: their own values are no context of theirs (the
            # variance would be 0, its log-density and gradient not finite where no target is)
            g = _cholesky_solve(Rc.transpose(-1, -2), L).transpose(-1, -2) * (1 - c).unsqueeze(-1)
            C = C - _mm(C, g.transpose(-1, -2))
            offset = d + _mv(x.unsqueeze(1) - d, g.transpose(-1, -2))
            var_noise = var_noise - (g * R).sum(-1)
        mean = _mv(ms, C) + offset
        var = _mm(Ss, C).pow(2).sum(-2) + var_noise
        return mean, var

    def _dense(self, state):
        """The ``"gaussian"`` engine and its state on the sequence's dense covariance, for
        masks shared by the batch: there its aggregated quadratic forms take each mask's
        factorization once for all the datapoints (``masks="all", share_masks=True`` at
        T = 300, H = 2, N = 20: 0.8 s, against 19 s of smoothing every datapoint here)."""
        if state.dense is None:
            engine = GaussianConditionals("dense", max_elements=self.max_elements)
            state.dense = (engine, engine.prepare(*state.prepared_from))
        return state.dense

    @staticmethod
    def _dense_cheaper(state, masks):
        r"""Whether ``masks`` masks shared by the batch cost less on the dense covariance
        (:meth:`_dense`) than smoothed for every datapoint. Measured (loss and gradient, H = 2,
        O = 1, N = 20, one thread), the dense path costs about :math:`(15 + q)\,D^3` units
        (preparing the covariance, then each mask's factorization, aggregated over the
        datapoints) and smoothing :math:`2.5\cdot10^5\,q\,n\,D` (a step's few dozen small
        operations per datapoint, a chunk recomputed in the backward pass): ``masks="all"``
        at T = 300, 0.8 s dense against 19 s smoothed; 8 masks at T = 1000, 1.6 s against
        3.8 s; one mask at T = 1000, 1.2 s against 0.17 s, at T = 2000, 14 s and 2.4 GB
        against 0.55 s and 0.34 GB. Once this evaluation has prepared the dense covariance
        (the first block's masks decided so) its cost is sunk and later blocks, which
        :func:`~pyro_mpt.estimate.mpt_estimate` may split into single masks, stay there."""
        if state.explosive:
            return False
        if state.dense is not None:
            return True
        D, n = state.num_tokens, state.num_data
        return (15 + masks) * D * D < 2.5e5 * masks * n

    @staticmethod
    def _dense_cheaper_per_datapoint(state, masks):
        r"""Whether ``masks`` masks drawn per datapoint cost less on the dense covariance
        (its sums over each (mask, datapoint) pair with their backward pass written out,
        ``gaussian_dense_independent``) than smoothed. Measured (loss and gradient,
        ``masks="all"``, H = 2, O = 1, N = 4, one thread), a pair costs the dense path about
        :math:`530\,D^2` units at D = 256..384 (3.0 and 6.6 ms; its passes over the pair's
        :math:`D\times D` tables, not yet its :math:`D^3` factorization, set the pace),
        and smoothing :math:`2.5\cdot10^5\,D` (5.1 and 8.1 ms), plus the dense covariance's
        preparation, :math:`15\,D^3` once: they break even near D = 470, and the default
        single mask per datapoint near D = 290 at N = 20. Only where the sequences share
        their parameters (one covariance for the batch, which those sums need)."""
        if any(part.shape[0] != 1 for part in state.parts):
            return False
        D, n = state.num_tokens, state.num_data
        prepare = 0 if state.dense is not None else 15 * D
        return (prepare + 530 * masks * n) * D * D < 2.5e5 * masks * n * D

    def _dense_serves(self, state, mask, context=None):
        """Whether the dense covariance (:meth:`_dense`) takes the sums of ``mask`` ``(q, n|1, D)``
        (with ``context`` ``(1, n, D)``, the observed tokens): shared masks by
        :meth:`_dense_cheaper`, masks per datapoint by :meth:`_dense_cheaper_per_datapoint`."""
        if mask.shape[1] == 1:
            return self._dense_cheaper(state, mask.shape[0])
        if not self.dense_per_datapoint or (context is not None and context.shape[0] != 1):
            return False
        return self._dense_cheaper_per_datapoint(state, mask.shape[0])

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        if mask.shape[1] == 1 and self._single_targets(mask) is None and self._dense_cheaper(state, mask.shape[0]):
            engine, dense = self._dense(state)
            return engine.mask_log_prob(dense, x, mask)
        q, n, T = mask.shape[0], x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)  # (T, n, O)
        context = (~mask).to(torch.float64).reshape(q, mask.shape[1], T, -1).permute(2, 0, 1, 3)

        def fn(xs, context):
            mean, var = self._conditionals(state, xs, context)
            return (-0.5 * ((xs.unsqueeze(1) - mean).pow(2) / var + var.log() + LOG_2PI),)

        (logc,) = self._chunks(state, xs, context, fn)  # (T, q, n, O)
        _check_finite(state, logc)
        return logc.permute(1, 2, 0, 3).reshape(q, n, -1).to(state.dtype)

    def _leave_one_out(self, state, x, observed=None):
        r""":math:`\log p(x_{t,o} \mid x_{-(t,o)})` of every token given all the other
        (observed) ones, ``(n, D)`` (zero at missing tokens), from one smoothing pass
        with every (observed) token in context.

        With :math:`\Sigma` the sequence's covariance, the conditional of token
        :math:`j` given the rest has precision :math:`(\Sigma^{-1})_{jj}` and mean
        residual :math:`(\Sigma^{-1}r)_j/(\Sigma^{-1})_{jj}` (Rasmussen & Williams
        2006, eqs. 5.10--5.12). Writing the sequence as :math:`x = Gz + v` with the
        path of states :math:`z` and the block-diagonal noise, Woodbury gives
        :math:`\Sigma^{-1} = W - WG\hat PG^\top W` (:math:`W` the noise precision,
        :math:`\hat P` the smoothed covariance of the path) and
        :math:`\Sigma^{-1}r = W(x - d - G\hat m)`; both :math:`G` and :math:`W` are
        block-diagonal over the steps, so step :math:`t`'s block is
        :math:`K_t = W_t - (C_tW_t)^\top\hat P_t(C_tW_t)` and
        :math:`u_t = (x_t - d_t - \hat m_tC_t)W_t`, and
        :math:`\log p(x_{t,o} \mid x_{-(t,o)}) = -\tfrac12(\log 2\pi - \log K_{t,oo}
        + u_{t,o}^2/K_{t,oo})`. With missing tokens :math:`W_t` is the inverse of the
        observed block of :math:`R_t` (zeros elsewhere), as in the filter's factors."""
        n, T = x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)  # (T, n, O)
        if observed is None:
            context = torch.ones_like(xs[:, :1]).unsqueeze(1)  # (T, 1, 1, O)
        else:
            context = observed.to(torch.float64).reshape(n, T, -1).transpose(0, 1).unsqueeze(1)
        ms, Ss = self._smoothed(state, xs, context)  # (T, 1, n, H), (T, 1, n, H, H)
        C, d, R = (_time_first(t) for t in state.parts[5:])
        W, _ = _context_precision(R, context)
        u = _mv(xs.unsqueeze(1) - d - _mv(ms, C), W)
        CW = _mm(C, W)
        K = W.diagonal(dim1=-2, dim2=-1) - _mm(Ss, CW).pow(2).sum(-2)
        # a missing token's K is 0: a placeholder keeps its (unused) term and gradient finite
        kept = context.expand(K.shape) > 0
        K = torch.where(kept, K, torch.ones((), dtype=K.dtype, device=K.device))
        logc = torch.where(kept, -0.5 * (LOG_2PI - K.log() + u.pow(2) / K), torch.zeros((), dtype=K.dtype, device=K.device))
        _check_finite(state, logc)
        return logc[:, 0].permute(1, 0, 2).reshape(n, -1)  # (n, T * O)

    @staticmethod
    def _single_targets(mask):
        """The target of each query when every query of ``mask`` ``(q, n|1, D)`` hides exactly
        one token (the ``"pll"`` schedule), ``(q, n|1)`` long; else None."""
        if mask.shape[0] == 0 or not bool((mask.sum(-1) == 1).all()):
            return None
        return mask.to(torch.uint8).argmax(-1)

    def _gathered(self, state, table, targets):
        """``table[i, targets[q, i]]``, ``(q, n)``, in the results' dtype."""
        q, n = targets.shape[0], table.shape[0]
        index = targets.expand(q, n).unsqueeze(-1)
        return table.unsqueeze(0).expand(q, -1, -1).gather(-1, index).squeeze(-1).to(state.dtype)

    def mask_sums(self, state, x, mask):
        self._check_x(state, x)
        targets = self._single_targets(mask)
        if targets is not None:
            # queries that each hide one token: every leave-one-out conditional from one
            # smoothing pass, where each query would take its own filter and smoother
            return self._gathered(state, self._leave_one_out(state, x), targets)
        if self._dense_serves(state, mask):
            engine, dense = self._dense(state)
            return engine.mask_sums(dense, x, mask)
        return super().mask_sums(state, x, mask)

    def mask_sums_within(self, state, x, mask, context):
        self._check_x(state, x)
        targets = self._single_targets(mask)
        if targets is not None and context.shape[0] == 1:
            # one target each, the context the observed tokens: a missing target scores 0
            return self._gathered(state, self._leave_one_out(state, x, context[0].expand(x.shape)), targets)
        if self._dense_serves(state, mask, context):
            engine, dense = self._dense(state)
            return engine.mask_sums_within(dense, x, mask, context)
        return super().mask_sums_within(state, x, mask, context)

    def recomputes_mask_sums(self, state, x, mask, context=None):
        if self._single_targets(mask) is None and self._dense_serves(state, mask, context):
            engine, dense = self._dense(state)
            return engine.recomputes_mask_sums(dense, x, mask, context)
        return super().recomputes_mask_sums(state, x, mask, context)

    def weighted_mask_sum(self, state, x, mask, coef):
        if self._single_targets(mask.unsqueeze(1)) is not None or not self._dense_cheaper(state, mask.shape[0]):
            return super().weighted_mask_sum(state, x, mask, coef)
        engine, dense = self._dense(state)
        return engine.weighted_mask_sum(dense, x, mask, coef)

    def weighted_sum_elements(self, state, x, mask=None):
        """Elements of the working set per query: ``n`` for masks ``(q, D)`` that each hide
        one token (one smoothing pass serves them all), the dense engine's count for other
        masks shared by the batch that it serves (``_dense_cheaper``), else ``n * D``."""
        if mask is not None and self._single_targets(mask.unsqueeze(1)) is not None:
            # one smoothing pass serves every such query: a row of sums each
            return x.shape[0]
        if mask is None or not self._dense_cheaper(state, mask.shape[0]):
            # masks drawn per datapoint (no weighted sum of shared masks), or smoothed
            return super().weighted_sum_elements(state, x, mask)
        engine, dense = self._dense(state)
        return engine.weighted_sum_elements(dense, x, mask)

    def log_evidence(self, state, x, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``:
        the normalizer of the initial state's density times every step's factor, the steps
        multiplied in pairs (no forward message but the last, no backward pass)."""
        self._check_x(state, x)
        n, T = x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)
        context = torch.ones_like(xs) if observed is None else observed.to(torch.float64).reshape(n, T, -1).transpose(0, 1)
        if state.explosive:
            _, value = _root_filter(state.parts, _steps(state.parts, xs, context.unsqueeze(1)))
            _check_finite(state, value[0])
            return value[0].to(state.dtype)
        # the product of all the steps' factors, then the initial state's density: no message
        # but the last is needed (nor the smoother's backward pass)
        f = _step_factors(state.parts, xs, context.unsqueeze(1))
        last = _through(_prior_message(state.parts, f.Jaa.shape[1:-2], f.c.shape[1:]), _total(f))
        value = _log_normalizer(*last)[0]
        _check_finite(state, value)
        return value.to(state.dtype)

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: each equals :meth:`log_evidence`."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], -1)
