r"""A sparse loading with a few global columns: groups of tokens joined only through global latents.

Pyro's radon model -- a mean :math:`\mu_a` shared by the groups, intercepts
:math:`a_g \sim \mathcal N(\mu_a, \sigma_a^2)` of :math:`G` groups and
:math:`y_j \sim \mathcal N(a_{g(j)} + \beta x_j, \sigma^2)` for :math:`D`
observations scored as one datapoint (``token_plates=("data",)``) -- has the
marginal :math:`\mathcal N(\mu, FF^\top + \operatorname{diag}\psi)` with a
:math:`D \times (G + 1)` loading on the latents' standard-normal noises: one
column, :math:`\mu_a`'s, loads on every token, the others on their group's tokens
alone. The global column joins every token into one component, so the groups of
:mod:`~pyro_mpt.conditionals.gaussian_groups` do not apply, and the dense loading
costs :math:`O(DG^2)` a query (20000 observations in 2000 groups: 40 s a step).

Without the global columns (the fewest of the widest, at most :data:`MAX_GLOBALS`,
whose removal leaves groups that pay) the loading splits into groups; the tokens are then
conditionally independent across groups given the global noises, which is the
arrowhead posterior of :mod:`~pyro_mpt.conditionals.hierarchical` with the groups
as its units (padded to the largest, as in
:mod:`~pyro_mpt.conditionals.gaussian_groups`: a padded token has zero loading,
zero residual and unit noise, sits in every context, where it changes nothing, and
is never a target). A query then costs :math:`O(D(K_g + r)^2 + Cr^3 + K_g^3)`.
:class:`GlobalGroupsConditionals` maps tokens, masks and orderings onto the units'
layout and back, and answers with
:class:`~pyro_mpt.conditionals.hierarchical.HierarchicalGaussianConditionals`' algebra.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .gaussian_groups import GROUPED_MIN_GAIN, LoadingColors, group_layout, loading_nonzeros
from .hierarchical import HierarchicalGaussianConditionals, HierarchicalGaussianState

__all__ = [
    "GlobalGroupsState", "GlobalGroupsConditionals", "global_group_colors", "global_groups", "global_groups_state",
    "MAX_GLOBALS",
]

#: the most global columns (the widest, see :func:`global_group_colors`) split off
MAX_GLOBALS = 8


@dataclass
class GlobalGroupsState:
    r"""The Gaussian engine's state for groups joined by global latents (:func:`global_groups`).

    :param ~pyro_mpt.conditionals.hierarchical.HierarchicalGaussianState inner: over the
        ``C N`` tokens of the padded units (unit-major), in float64.
    :param torch.Tensor index: ``(C, N)`` long, each unit's tokens, ``-1`` at padding.
    :param int num_data: 1.
    :param int num_tokens: :math:`D`.
    :param torch.dtype dtype: the dtype of the results (the data's).
    """

    inner: HierarchicalGaussianState
    index: torch.Tensor
    num_data: int
    num_tokens: int
    dtype: torch.dtype

    def __post_init__(self):
        flat = self.index.reshape(-1)
        # a padded slot reads the extra column D of the padded token tensor
        self._gather = torch.where(flat >= 0, flat, self.num_tokens)
        self._positions = flat.argsort()[flat.numel() - self.num_tokens :]  # slot of each token

    @property
    def num_pads(self):
        return self.index.numel() - self.num_tokens

    def units(self, t, fill=0):
        """Token tensor ``(*lead, D)`` -> ``(*lead, C N)``, ``fill`` at padding."""
        pad = torch.full(t.shape[:-1] + (1,), fill, dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], -1)[..., self._gather]

    def tokens(self, t):
        """Inverse of :meth:`units`: ``(*lead, C N)`` -> ``(*lead, D)``, padding dropped."""
        return t[..., self._positions]


def global_groups(marginal, num_data, nonzeros=None):
    r"""The colouring of a loading whose groups are joined only by a few global latents, or None.

    Taken for one datapoint with a low-rank marginal shared by the batch, when removing the
    widest columns of the loading (the most tokens each), at most :data:`MAX_GLOBALS` of
    them, fewest first, splits the tokens into two or more groups whose arrowhead's cost
    :math:`CN(K_g + r)^2` undercuts the dense loading's :math:`DR^2` by
    :data:`~pyro_mpt.conditionals.gaussian_groups.GROUPED_MIN_GAIN`. Each group's row of
    the colouring lists its :math:`r` latents, then the :math:`K_g` global ones
    (``num_globals``): the model run at one point a colour gives every token's loading on
    them (:func:`~pyro_mpt.conditionals.gaussian_groups.colored_marginal`), and
    :func:`global_groups_state` the state. Whether the entries the groups drop carry a
    gradient is :func:`~pyro_mpt.conditionals.gaussian_groups.dropped_zeros_structural`'s
    to say.

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal marginal: ``loc``
        ``(1, D)``, ``cov_factor`` ``(1, D, R)``, ``cov_diag`` ``(1, D)``.
    :param int num_data: :math:`n`; taken only for 1.
    :param dict nonzeros: the loading's nonzeros under ``"pairs"`` when
        :func:`~pyro_mpt.conditionals.gaussian_groups.grouped_marginal` found them (kept
        there otherwise).
    :rtype: ~pyro_mpt.conditionals.gaussian_groups.LoadingColors

    Example::

        >>> colors = global_groups(gaussian_marginal(tokens, radon, args, {}), 1)
        >>> colors.num_colors, colors.num_globals   # (2, 1): an intercept a county, one mean
    """
    F, psi, loc = marginal.cov_factor, marginal.cov_diag, marginal.loc
    if num_data != 1 or not marginal.is_low_rank or F is None or F.shape[0] != 1:
        return None
    if loc.shape[0] != 1 or psi.shape[0] != 1:
        return None
    D, R = F.shape[-2:]
    if nonzeros is None:
        nonzeros = {}
    if "pairs" not in nonzeros:
        nonzeros["pairs"] = loading_nonzeros(F)
    return global_group_colors(nonzeros["pairs"], D, R, marginal.site, F.device)


def global_group_colors(nonzeros, D, R, site, device=None):
    r""":func:`global_groups` from the loading's nonzeros ``(rows, cols)`` and its shape
    ``(D, R)`` (:func:`~pyro_mpt.conditionals.gaussian_groups.loading_nonzeros`, or
    :func:`~pyro_mpt.conditionals.gaussian_marginal.loading_nonzeros_in_chunks` without the
    table).

    Example::

        >>> colors = global_group_colors((rows, cols), D, R, "y")
    """
    if R < 3 or D < 4:
        return None
    rows, cols = nonzeros
    # the global latents: the fewest of the widest columns (most tokens) whose removal leaves
    # groups that pay; any such split is exact, the widest first only find one soonest (a
    # mean slope on a covariate that is 1 for 30 % of the observations loads on those alone)
    widest = np.argsort(-np.bincount(cols, minlength=R), kind="stable")[:MAX_GLOBALS]
    for K_g in range(1, min(MAX_GLOBALS, R - 2) + 1):
        is_global = np.zeros(R, dtype=bool)
        is_global[widest[:K_g]] = True
        colors = _split(rows, cols, D, R, is_global, site, device)
        if colors is not None:
            return colors
    return None


def _split(rows, cols, D, R, is_global, site, device):
    """The colouring of the groups left by the ``is_global`` columns, or None where they do not pay."""
    K_g = int(is_global.sum())
    # the groups of the other columns' nonzeros: a global latent is left without tokens
    local = ~is_global[cols]
    layout = group_layout((rows[local], cols[local]), D, R)
    if layout is None:
        return None  # one group
    token_comp, latent_comp, index, lat_index = layout
    if not (latent_comp >= 0).any():
        return None  # the global latents alone (a regression): the dense loading is small
    C, N = index.shape
    r = lat_index.shape[1]
    if GROUPED_MIN_GAIN * C * N * (K_g + r) ** 2 > D * R**2:
        return None
    # every group's row ends with the global latents: one colour each
    latents = np.concatenate([lat_index, np.repeat(np.flatnonzero(is_global)[None], C, 0)], 1)
    pattern = hash((site, D, R, token_comp.tobytes(), latent_comp.tobytes(), is_global.tobytes()))
    return LoadingColors(torch.as_tensor(index, device=device), torch.as_tensor(latents, device=device),
                         torch.as_tensor(token_comp, device=device), R, pattern=pattern, num_globals=K_g)


def global_groups_state(inner, colors):
    r"""The :class:`GlobalGroupsState` of the groups' marginal ``inner``
    (:func:`~pyro_mpt.conditionals.gaussian_groups.colored_marginal` of ``colors``: ``C``
    rows of ``N`` tokens, loading ``(C, N, r + K_g)``), in float64.

    Example::

        >>> state = global_groups_state(colored_marginal(colors, tokens, radon, args, {}), colors)
    """
    F, loc, psi = inner.cov_factor, inner.loc, inner.cov_diag
    C, N, width = F.shape
    r = width - colors.num_globals
    state = HierarchicalGaussianState(
        num_data=1,
        num_tokens=C * N,
        loc=loc.to(torch.float64).reshape(1, -1),
        psi=psi.to(torch.float64).reshape(1, -1),
        a=F[..., r:].to(torch.float64).unsqueeze(0),
        b=F[..., :r].to(torch.float64).unsqueeze(0),
        site=inner.site,
    )
    D = int((colors.tokens >= 0).sum())
    return GlobalGroupsState(state, colors.tokens, 1, D, loc.dtype)


class GlobalGroupsConditionals:
    r"""The queries of a :class:`GlobalGroupsState`, answered on the units' layout by the
    arrowhead algebra of :class:`~pyro_mpt.conditionals.hierarchical.HierarchicalGaussianConditionals`
    (what :class:`~pyro_mpt.conditionals.GaussianConditionals` delegates to for such states).

    :param int max_elements: as the hierarchical engine's.

    Example::

        >>> GlobalGroupsConditionals().log_evidence(state, x)   # (1,), log p(x)
    """

    def __init__(self, max_elements=2**24):
        self.engine = HierarchicalGaussianConditionals(max_elements=max_elements)

    def _x(self, state, x):
        return state.units(x.to(torch.float64))

    def _out(self, state, t):
        return state.tokens(t).to(state.dtype)

    def mask_log_prob(self, state, x, mask):
        """``(q, 1, D)`` conditionals of every token given each mask's context."""
        out = self.engine.mask_log_prob(state.inner, self._x(state, x), state.units(mask, fill=False))
        return self._out(state, out)

    def mask_sums(self, state, x, mask):
        """``(q, 1)``: each mask's targets' summed conditionals."""
        out = self.engine.mask_sums(state.inner, self._x(state, x), state.units(mask, fill=False))
        return out.to(state.dtype)

    def leave_one_out_log_prob(self, state, x, observed=None):
        """``(1, D)``: every token given all the other (observed) ones, 0 at a missing token."""
        seen = None if observed is None else state.units(observed, fill=False)
        return self._out(state, self.engine.leave_one_out_log_prob(state.inner, self._x(state, x), seen))

    def chain_log_prob(self, state, x, order):
        """``(p, 1, D)`` chain-rule terms by position: the padding first in every ordering
        (context to all, bearing on none), its terms left out."""
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        padded = state.units(ranks, fill=-1).argsort(-1)
        out = self.engine.chain_log_prob(state.inner, self._x(state, x), padded)
        return out[..., state.num_pads :].to(state.dtype)

    def log_evidence(self, state, x, observed=None):
        """``(1,)``: :math:`\\log p(x)` (of the observed tokens with ``observed``)."""
        seen = torch.ones_like(x, dtype=torch.bool) if observed is None else observed
        return self.engine.log_evidence(state.inner, self._x(state, x), state.units(seen, fill=False)).to(state.dtype)
