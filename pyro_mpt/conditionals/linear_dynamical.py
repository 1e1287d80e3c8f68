r"""The Gaussian marginal of a ``dist.GaussianHMM`` (a linear dynamical system).

Pyro's ``GaussianHMM`` is the model

.. math::

    z_{-1} \sim \mathcal N(m_0, S_0), \qquad
    z_t = z_{t-1} A_t + w_t,\; w_t \sim \mathcal N(b_t, Q_t), \qquad
    x_t = z_t C_t + v_t,\; v_t \sim \mathcal N(d_t, R_t)

(row vectors, as Pyro writes it), with the hidden chain integrated out inside
the distribution. With :math:`\varepsilon = (z_{-1}, w_0, \dots, w_{T-1})` and
:math:`\Phi(s, t) = A_{s+1}\cdots A_t` (the identity when :math:`s = t`),
:math:`x_t = \sum_{s \le t} \varepsilon_s \Phi(s, t) C_t + v_t`, so the
:math:`T \cdot O` observed elements are jointly Gaussian:

.. math::

    \mathbb E[x_t] = \sum_{s \le t} \bar\varepsilon_s G_{ts} + d_t, \qquad
    \operatorname{Cov}(x_t, x_u) = \sum_{s} G_{ts}^\top S_s G_{us} + \delta_{tu} R_t,
    \qquad G_{ts} = \Phi(s, t) C_t,

with :math:`S_s` the covariance of :math:`\varepsilon_s`. The Gaussian engine
then answers every masked conditional of the sequence in closed form.

The distribution keeps its factors in information form (precision and
information vector over ``(old, new)`` pairs); the matrices, locations and
covariances above are read back from those blocks: for a factor built from
``matrix`` :math:`M` and noise :math:`\mathcal N(b, Q)`, the precision is
:math:`\begin{pmatrix} M Q^{-1} M^\top & -M Q^{-1} \\ -Q^{-1} M^\top & Q^{-1}\end{pmatrix}`
and the information vector :math:`(-M Q^{-1} b, Q^{-1} b)`; a diagonal noise
is kept as :math:`M`, :math:`b` and the scales directly.
"""

from typing import NamedTuple

import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)

from .distributions import compact

__all__ = ["LinearDynamicalParts", "gaussian_hmm_parts", "gaussian_hmm_moments"]


def _factor_parts(gaussian, left):
    """``(M, b, Q)`` of a pair factor whose first ``left`` coordinates are the old state."""
    if hasattr(gaussian, "matrix"):
        # Pyro keeps a diagonal noise as matrix, loc and scale (an AffineNormal); compacted, a loc or
        # scale shared by the coordinates (dist.Normal(0., 0.5).expand([H]).to_event(1)) keeps one
        # entry, which the moments must not
        M, loc, scale = compact(gaussian.matrix), compact(gaussian.loc), compact(gaussian.scale)
        loc, scale = (t.expand(t.shape[:-1] + M.shape[-1:]) for t in (loc, scale))
        return M, loc, torch.diag_embed(scale.pow(2))
    P = compact(gaussian.precision)
    P_xy, P_yy = P[..., :left, left:], P[..., left:, left:]
    Q = torch.cholesky_inverse(torch.linalg.cholesky(P_yy))
    M = -P_xy @ Q
    b = (Q @ compact(gaussian.info_vec)[..., left:].unsqueeze(-1)).squeeze(-1)
    return M, b, Q


def _over_time(t, batch, T, event_ndim):
    """``(..., T|1, *event)`` -> ``(*batch, T, *event)`` (a view)."""
    return t.expand(batch + (T,) + t.shape[t.dim() - event_ndim :])


class LinearDynamicalParts(NamedTuple):
    r"""The parts of a ``dist.GaussianHMM`` in moment form (row vectors, as Pyro writes it):
    :math:`z_{-1} \sim \mathcal N(m_0, S_0)`, :math:`z_t = z_{t-1}A_t + w_t`,
    :math:`w_t \sim \mathcal N(b_t, Q_t)`, :math:`x_t = z_tC_t + v_t`,
    :math:`v_t \sim \mathcal N(d_t, R_t)`. Leading dims broadcast to the batch
    shape (size 1 where the distribution's parts are broadcast, e.g. by a plate);
    the time dim is :math:`T` or 1 (homogeneous).

    Example::

        >>> m0, S0, A, b, Q, C, d, R = gaussian_hmm_parts(hmm)
        >>> gaussian_hmm_parts(hmm).batch_shape   # the parts' broadcast batch shape
    """

    #: :math:`m_0` ``(..., H)``
    init_loc: torch.Tensor
    #: :math:`S_0` ``(..., H, H)``
    init_cov: torch.Tensor
    #: :math:`A_t` ``(..., T|1, H, H)``
    transition: torch.Tensor
    #: :math:`b_t` ``(..., T|1, H)``
    trans_loc: torch.Tensor
    #: :math:`Q_t` ``(..., T|1, H, H)``
    trans_cov: torch.Tensor
    #: :math:`C_t` ``(..., T|1, H, O)``
    observation: torch.Tensor
    #: :math:`d_t` ``(..., T|1, O)``
    obs_loc: torch.Tensor
    #: :math:`R_t` ``(..., T|1, O, O)``
    obs_cov: torch.Tensor

    @property
    def batch_shape(self):
        """The broadcast batch shape of the parts (time and event dims excluded)."""
        return torch.Size(broadcast_shape(
            self.init_loc.shape[:-1], self.init_cov.shape[:-2], self.transition.shape[:-3],
            self.trans_loc.shape[:-2], self.trans_cov.shape[:-3], self.observation.shape[:-3],
            self.obs_loc.shape[:-2], self.obs_cov.shape[:-3],
        ))


def gaussian_hmm_parts(hmm):
    r"""The moment-form parts of a ``dist.GaussianHMM``, with the dims that Pyro's
    broadcasting made stride 0 (a plate's expansion of shared parameters) compacted to size 1.

    :param pyro.distributions.GaussianHMM hmm: the distribution.
    :returns: :class:`LinearDynamicalParts`.

    Example::

        >>> parts = gaussian_hmm_parts(dist.GaussianHMM(init, A, trans, C, obs).expand([100]))
        >>> parts.transition.shape   # (1, 1, H, H): shared by the 100 sequences and the steps
    """
    H = hmm.hidden_dim
    init = hmm._init
    S0 = torch.cholesky_inverse(torch.linalg.cholesky(compact(init.precision)))
    m0 = (S0 @ compact(init.info_vec).unsqueeze(-1)).squeeze(-1)
    A, b, Q = _factor_parts(hmm._trans, H)
    C, d, R = _factor_parts(hmm._obs, H)
    # a part without a time dim (e.g. a homogeneous transition matrix (H, H)) has one step
    A, Q, C, R = (t if t.dim() > 2 else t.unsqueeze(-3) for t in (A, Q, C, R))
    b, d = (t if t.dim() > 1 else t.unsqueeze(-2) for t in (b, d))
    return LinearDynamicalParts(m0, S0, A, b, Q, C, d, R)


def gaussian_hmm_moments(hmm, num_steps):
    r"""Mean and covariance of the observations of a ``dist.GaussianHMM``.

    :param pyro.distributions.GaussianHMM hmm: the distribution.
    :param int num_steps: :math:`T`, the number of time steps of the data (a
        homogeneous ``GaussianHMM`` has a free time dim).
    :returns: ``(loc, covariance)`` of shapes ``(*batch, T * O)`` and
        ``(*batch, T * O, T * O)``, ``batch`` broadcastable to the distribution's batch
        shape (size 1 where its parts are broadcast); element ``t * O + o`` is
        :math:`x_{t, o}`.

    Building the marginal loops over the :math:`T` steps once (products of
    transition matrices, batched over the starting step); the conditionals
    built on it are vectorized.

    Example::

        >>> loc, cov = gaussian_hmm_moments(hmm, 20)
        >>> dist.MultivariateNormal(loc, cov).log_prob(x.reshape(-1, 20 * hmm.obs_dim))  # = hmm.log_prob(x)
    """
    H, O, T = hmm.hidden_dim, hmm.obs_dim, int(num_steps)
    # the parts' broadcast (stride-0) dims compacted: a GaussianHMM that Pyro's plate expanded to
    # every datapoint has one set of moments, built once (per datapoint, the loop over the steps
    # and its backward pass took 50x the time at N = 50, T = 500); the result broadcasts to
    # the batch shape
    parts = gaussian_hmm_parts(hmm)
    m0, S0, A, b, Q, C, d, R = parts
    batch = parts.batch_shape

    A, b, Q = (_over_time(t, batch, T, nd) for t, nd in ((A, 2), (b, 1), (Q, 2)))
    C, d, R = (_over_time(t, batch, T, nd) for t, nd in ((C, 2), (d, 1), (R, 2)))
    # Phi[..., s + 1] = Phi(s, t) for the current t, s = -1 .. T-1 (zero for s > t)
    eye = torch.eye(H, dtype=A.dtype, device=A.device)
    Phi = torch.zeros(batch + (T + 1, H, H), dtype=A.dtype, device=A.device)
    Phi[..., 0, :, :] = eye  # Phi(-1, -1): the initial state itself
    G = []
    for t in range(T):
        Phi = Phi @ A[..., t, None, :, :]
        Phi = torch.cat([Phi[..., : t + 1, :, :], eye.expand(batch + (1, H, H)), Phi[..., t + 2 :, :, :]], -3)
        G.append(Phi @ C[..., t, None, :, :])  # (..., T+1, H, O)
    G = torch.stack(G, -4)  # (..., T, T+1, H, O)
    mean_eps = torch.cat([m0.expand(batch + (H,)).unsqueeze(-2), b], -2)  # (..., T+1, H)
    chol = torch.linalg.cholesky(torch.cat([S0.expand(batch + (H, H)).unsqueeze(-3), Q], -3))
    loc = torch.einsum("...sh,...tsho->...to", mean_eps, G) + d
    F = torch.einsum("...tsho,...shk->...tosk", G, chol).reshape(batch + (T * O, (T + 1) * H))
    noise = (R.unsqueeze(-2) * torch.eye(T, dtype=R.dtype, device=R.device)[..., None, :, None]).reshape(
        batch + (T * O, T * O)
    )
    return loc.reshape(batch + (T * O,)), F @ F.transpose(-1, -2) + noise
