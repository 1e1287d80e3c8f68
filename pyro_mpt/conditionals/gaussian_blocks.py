r"""Gaussian observations that cover a datapoint's tokens in independent blocks.

A Gaussian distribution with event dims of its own (``MultivariateNormal``,
``LowRankMultivariateNormal`` over :math:`N` elements, ``GaussianHMM`` over
:math:`T \times O`) can sit in an observed site whose tokens are more than its
own elements:

* with extra event dims, e.g. ``MultivariateNormal(f_loc, K).expand_by([B]).to_event(1)``,
  what ``pyro.contrib.gp.models.GPRegression`` writes for outputs ``y`` of
  shape ``(B, N)`` (a multi-output GP whose outputs share the kernel);
* inside a token plate.

A datapoint's :math:`D = B N` tokens are then :math:`B` independent Gaussian
blocks of :math:`N` consecutive tokens (token :math:`bN + k` is element
:math:`k` of block :math:`b`), and its covariance is block-diagonal, so

.. math::

    \log p(x) = \sum_b \log p_b(x_b), \qquad
    p(x_j \mid x_{\mathcal R}) = p_b(x_j \mid x_{\mathcal R \cap b})
    \quad (j \in b).

Without latents the Gaussian engine answers every query on the blocks as
:math:`nB` datapoints of :math:`N` tokens (:class:`BlockGaussianState`); a
covariance shared by every block and datapoint (outputs sharing a kernel) is
stored and factorized once, and no :math:`D \times D` matrix is formed. With
latents (their loading couples the blocks) the covariance is assembled densely
by :func:`block_diagonal_parts`.
"""

import math
from dataclasses import dataclass

import torch
import pyro.distributions as dist

from .distributions import base_distribution
from .linear_dynamical import gaussian_hmm_moments

__all__ = [
    "BlockGaussianState",
    "block_diagonal_parts",
    "block_marginal",
    "is_block_gaussian",
]

#: Gaussian distributions with event dims of their own
_GAUSSIANS = (dist.MultivariateNormal, dist.LowRankMultivariateNormal, dist.GaussianHMM)


def _own_event_ndim(base):
    return len(base.event_shape)


def is_block_gaussian(base, fn, tokens):
    """True when the observation's tokens need this module: its base is a
    Gaussian with event dims that covers several blocks, or a ``GaussianHMM``
    (whose moments are built here).

    :param base: the observation's distribution under its wrappers.
    :param fn: the observed site's distribution.
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :rtype: bool

    Example::

        >>> is_block_gaussian(mvn, mvn.expand_by([2]).to_event(1), tokens)  # True: 2 blocks
    """
    if not isinstance(base, _GAUSSIANS):
        return False
    return isinstance(base, dist.GaussianHMM) or bool(tokens.token_dims) or len(fn.event_shape) != _own_event_ndim(base)


def _moments(base, own_shape):
    """``("dense", loc, cov)`` or ``("lowrank", loc, F, psi)`` over the ``N`` own elements."""
    if isinstance(base, dist.GaussianHMM):
        loc, cov = gaussian_hmm_moments(base, own_shape[0])
        return "dense", loc, cov
    if isinstance(base, dist.LowRankMultivariateNormal):
        return "lowrank", base.loc, base.cov_factor, base.cov_diag
    if "covariance_matrix" not in vars(base) and base.scale_tril.dtype != torch.float64:
        # built from its factor (GPRegression's scale_tril): L L^T formed in float64, as the
        # single-output marginal forms it; torch's float32 product lost a GP's small noise
        # (noise 1e-6, three outputs: log p 3832 nats off)
        L = base.scale_tril.double()
        return "dense", base.loc, L @ L.transpose(-1, -2)
    return "dense", base.loc, base.covariance_matrix


def _tails(kind, N, R=None):
    """The trailing shapes of the moment tensors."""
    return ((N,), (N, N)) if kind == "dense" else ((N,), (N, R), (N,))


def _layout(t, tokens, lead, outer, tail):
    """``t`` broadcastable to ``(*lead, *site_batch_shape, *outer, *tail)`` ->
    ``(*lead, *datapoint_shape, *token_plate_sizes, *outer, *tail)``: the token
    plates move next to the outer event dims (as in the token layout)."""
    sb = tuple(tokens.site_batch_shape)
    t = t.expand(tuple(lead) + sb + tuple(outer) + tuple(tail))
    L, S, T = len(lead), len(sb), len(tokens.token_dims)
    if T:
        src = [L + S + d for d in sorted(tokens.token_dims)]
        t = t.movedim(src, list(range(L + S - T, L + S)))
    return t


def _shape_parts(base, fn, tokens):
    """``(lead, outer, own_shape)`` of the observation, ``lead`` being batch dims left of
    the site's (e.g. the basis plate of a vectorized run)."""
    e = _own_event_ndim(base)
    outer = tuple(fn.event_shape[: len(fn.event_shape) - e])
    own = tuple(tokens.event_shape[len(tokens.event_shape) - e :])
    lead = tuple(fn.batch_shape[: len(fn.batch_shape) - len(tokens.site_batch_shape)])
    return lead, outer, own


def block_diagonal_parts(base, fn, tokens):
    r"""Location and dense block-diagonal covariance of an observation :func:`is_block_gaussian`.

    :returns: ``(loc, ("dense", cov), batch_shape)`` with ``loc``
        ``(*lead, *datapoint_shape, D)`` and ``cov`` ``(*lead, *datapoint_shape, D, D)``
        in token layout, as the Gaussian marginal's observation parts:
        :math:`\Sigma = \operatorname{blockdiag}(\Sigma_1, \dots, \Sigma_B)`.

    Example::

        >>> loc, (kind, cov), batch_shape = block_diagonal_parts(base, fn, tokens)
    """
    lead, outer, own = _shape_parts(base, fn, tokens)
    N = math.prod(own)
    kind, loc, *noise = _moments(base, own)
    if kind == "lowrank":
        F, psi = noise
        cov = F @ F.transpose(-1, -2) + torch.diag_embed(psi)
    else:
        (cov,) = noise
    loc = _layout(loc, tokens, lead, outer, (N,))
    cov = _layout(cov, tokens, lead, outer, (N, N))
    keep = len(lead) + len(tokens.datapoint_shape)
    B = math.prod(loc.shape[keep:-1])
    loc = loc.reshape(loc.shape[:keep] + (B * N,))
    cov = cov.reshape(cov.shape[:keep] + (B, N, N))
    eye = torch.eye(B, dtype=cov.dtype, device=cov.device)
    dense = (cov.unsqueeze(-2) * eye[:, None, :, None]).reshape(cov.shape[:keep] + (B * N, B * N))
    return loc, ("dense", dense), loc.shape[:-1]


def _block_rows(t, tail):
    """``(*datapoint, *blocks, *tail)`` -> ``(n B, *tail)``, or ``(1, *tail)`` when every
    datapoint and block shares it (its batch dims are all broadcast)."""
    lead = t.dim() - len(tail)
    if all(t.stride(i) == 0 or t.shape[i] == 1 for i in range(lead)):
        return t[(0,) * lead].unsqueeze(0)
    return t.reshape((-1,) + tuple(tail))


def block_marginal(tokens, marginal_cls):
    """The Gaussian marginal of each block, when the model has no latent and its
    observation :func:`is_block_gaussian` covers several blocks; else None.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param type marginal_cls: the marginal's class (``GaussianMarginal``).
    :returns: ``(marginal, num_blocks)``: ``marginal`` over ``N`` tokens with
        leading dim ``n * num_blocks`` (datapoint-major), or 1 when shared.

    Example::

        >>> marginal, B = block_marginal(trace_tokens(gpr.model, None, (), {}), GaussianMarginal)
        >>> marginal.covariance.shape  # (1, N, N): the outputs share the kernel
    """
    if tokens.latent_names:
        return None
    fn = tokens.site["fn"]
    base = base_distribution(fn)
    if not is_block_gaussian(base, fn, tokens):
        return None
    lead, outer, own = _shape_parts(base, fn, tokens)
    N = math.prod(own)
    B = tokens.num_tokens // N
    if B == 1:
        return None
    kind, *parts = _moments(base, own)
    R = parts[1].shape[-1] if kind == "lowrank" else None
    tails = _tails(kind, N, R)
    parts = [_layout(p, tokens, lead, outer, tail) for p, tail in zip(parts, tails)]
    rows = [_block_rows(p, tail) for p, tail in zip(parts, tails)]
    common = max(r.shape[0] for r in rows)
    rows = [r.expand((common,) + r.shape[1:]) for r in rows]
    if kind == "lowrank":
        loc, F, psi = rows
        return marginal_cls(loc, cov_factor=F, cov_diag=psi, site=tokens.name), B
    loc, cov = rows
    return marginal_cls(loc, covariance=cov, site=tokens.name), B


@dataclass
class BlockGaussianState:
    """The Gaussian engine's state for independent blocks of ``N`` tokens.

    :param inner: the engine's state over the blocks (``n * num_blocks`` rows of ``N`` tokens).
    :param int num_blocks: :math:`B`.
    :param int num_data: :math:`n`.
    """

    inner: object
    num_blocks: int
    num_data: int

    @property
    def num_tokens(self):
        return self.num_blocks * self.block_size

    @property
    def block_size(self):
        return self.inner.num_tokens

    def rows(self, t):
        """Token tensor ``(*lead, n|1, D)`` -> ``(*lead, n B|B, N)`` (block rows)."""
        B, N = self.num_blocks, self.block_size
        if t.shape[-2] == 1 and self.num_data > 1:
            t = t.expand(t.shape[:-2] + (self.num_data, B * N))
        return t.reshape(t.shape[:-2] + (t.shape[-2] * B, N))

    def tokens(self, t):
        """Inverse of :meth:`rows` for ``(*lead, n B, N)``: ``(*lead, n, D)``."""
        return t.reshape(t.shape[:-2] + (self.num_data, self.num_tokens))

    def observed_rows(self, observed):
        """The blocks' observed tokens ``(n B, N)`` for the density, or None (all observed)."""
        return None if observed is None else self.rows(observed)

    def per_datapoint(self, t):
        """Sum per-block results ``(*lead, n B)`` over the blocks: ``(*lead, n)``."""
        return t.reshape(t.shape[:-1] + (self.num_data, self.num_blocks)).sum(-1)

    def orders(self, order):
        """Each block's tokens in the order of the complete orderings ``(p, n|1, D)``:
        ``(p, n B|B, N)`` long, positions within the block."""
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        return self.rows(ranks).argsort(-1)

    def chain_by_position(self, inner, sub_order, order):
        """Map chain terms of the blocks ``(p, n B, N)`` along ``sub_order`` back to the
        positions of the global ``order``: ``(p, n, D)``."""
        by_token = torch.empty_like(inner).scatter_(-1, sub_order.expand_as(inner), inner)
        by_token = self.tokens(by_token)  # (p, n, D), token-indexed
        return by_token.gather(-1, order.expand_as(by_token))
