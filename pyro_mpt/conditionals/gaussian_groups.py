r"""A low-rank Gaussian marginal whose loading is sparse: independent groups of tokens.

A random-intercept model, :math:`u_g \sim \mathcal N(0, \sigma_u^2)` for
:math:`G` groups and :math:`y_j \sim \mathcal N(\beta x_j + u_{g(j)}, \sigma^2)`
for :math:`D` observations scored as one datapoint (``token_plates=("data",)``),
has the marginal :math:`\mathcal N(\mu, F F^\top + \operatorname{diag}(\psi))`
with a :math:`D \times G` loading :math:`F` that has one nonzero a row. Held
dense, every Woodbury step costs :math:`O(D G^2)` (10000 observations in 1000
groups: seconds a step).

The nonzeros of :math:`F` join tokens and latents into the connected components
of a bipartite graph (token :math:`j` -- latent :math:`k` where
:math:`F_{jk} \ne 0`). With :math:`c(j)` a token's component and
:math:`\mathcal K_c` the latents of component :math:`c`,
:math:`F F^\top` is block-diagonal over the components, so

.. math::

    \log p(x) = \sum_c \log \mathcal N\big(x_c;\; \mu_c,\;
        F_{c\mathcal K_c} F_{c\mathcal K_c}^\top + \operatorname{diag}(\psi_c)\big), \qquad
    p(x_j \mid x_{\mathcal R}) = p_{c(j)}(x_j \mid x_{\mathcal R \cap c(j)}).

:func:`grouped_marginal` finds the components and stores them as :math:`C`
rows of :math:`N = \max_c |c|` tokens and :math:`r = \max_c |\mathcal K_c|`
latents (``(C, N, r)``), the shorter ones padded with tokens of zero loading,
unit noise and zero residual (independent of every other token, so a padded
token in a context changes no conditional; it is never a target, and the
density leaves it out as a missing token). A step then costs
:math:`O(C N r^2)` instead of :math:`O(D G^2)`: random intercepts
(:math:`r = 1`) and nested groups (a top-level group and its subgroups are one
component) scale linearly in the number of groups. Global latents (a mean
shared by every group) join every token into one component: without them the
groups are the units of an arrowhead posterior
(:mod:`~pyro_mpt.conditionals.gaussian_global_groups`). Crossed effects keep
the dense path, exactly as before.

The first call finds the components from the whole loading (the model run at
:math:`R + 4` points); :class:`LoadingColors` then lets every later call derive
the groups' loading from :math:`r + 4` points (5 for random intercepts), checked
at random probes, with no :math:`D \times R` table. A zero of :math:`F` that is
zero only in value (a loading parameter that starts at zero) still carries a
gradient: the components are taken only when :func:`dropped_zeros_structural`
finds the dropped entries' derivatives negligible.
"""

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from .gaussian_blocks import BlockGaussianState
from .gaussian_marginal import GaussianMarginal, NotLinearGaussianError, gaussian_marginal
from .structural_zeros import derivatives_negligible

__all__ = [
    "GroupedGaussianState",
    "LoadingColors",
    "colored_marginal",
    "dropped_zeros_structural",
    "group_layout",
    "grouped_colors",
    "grouped_marginal",
    "grouped_state",
    "loading_components",
    "loading_nonzeros",
    "padded_layout",
    "GROUPED_MIN_GAIN",
]

#: the factor by which the padded groups' cost (C N r^2) must undercut the dense
#: loading's (D R^2) before the groups are taken
GROUPED_MIN_GAIN = 4


def loading_nonzeros(F):
    """The nonzeros of a loading ``(r, D, R)`` (in any of its rows) as numpy ``(rows, cols)``.

    Example::

        >>> loading_nonzeros(torch.tensor([[[1.0, 0.0], [0.0, 2.0]]]))
        (array([0, 1]), array([0, 1]))
    """
    F = F.detach()
    nonzero = F[0] != 0 if F.shape[0] == 1 else (F != 0).any(0)  # no copy of a one-row loading
    if nonzero.dim() == 2 and nonzero.stride(0) == 1 and nonzero.shape[1] > 1:
        # a loading made column by column (its transpose contiguous): nonzero() walks the
        # transpose in memory order (40000 x 4001: 0.74 s, against 6.2 s across it)
        cols, rows = nonzero.T.nonzero(as_tuple=True)
    else:
        rows, cols = nonzero.nonzero(as_tuple=True)
    return rows.cpu().numpy(), cols.cpu().numpy()


def loading_components(F, nonzeros=None, shape=None):
    """Connected components of the tokens and latents joined by the nonzeros of a loading.

    :param torch.Tensor F: ``(r, D, R)``, the loading (rows per datapoint or one shared),
        or None with ``nonzeros`` and ``shape``.
    :param tuple nonzeros: its :func:`loading_nonzeros` (or a subset of them: the
        components of those entries alone), when already at hand.
    :param tuple shape: ``(D, R)`` when ``F`` is None.
    :returns: ``(token_comp, latent_comp)``, int64 numpy arrays ``(D,)`` and ``(R,)``:
        component labels ``0..C-1`` of the tokens (in order of each component's first
        token) and the latents' labels in the same numbering, ``-1`` for a latent no
        token loads on.

    Example::

        >>> F = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]])  # tokens 0, 2 on latent 0
        >>> loading_components(F)
        (array([0, 1, 0]), array([0, 1]))
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    D, R = F.shape[-2:] if shape is None else shape
    rows, cols = loading_nonzeros(F) if nonzeros is None else nonzeros
    graph = coo_matrix((np.ones(rows.size, dtype=np.int8), (rows, D + cols)), shape=(D + R, D + R))
    _, labels = connected_components(graph, directed=False)
    token, latent = labels[:D], labels[D:]
    # renumber by first token: components without tokens (latents no token loads on) go
    _, first, inverse = np.unique(token, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    token_comp = rank[inverse]
    relabel = np.full(labels.max() + 1, -1, dtype=np.int64)
    relabel[token[first[order]]] = np.arange(order.size)
    return token_comp.astype(np.int64), relabel[latent]


def padded_layout(comp, C):
    """``(index, width)``: ``index`` ``(C, width)`` numpy, the members of each component
    in their order, ``-1`` where a component has fewer than ``width``."""
    if comp.size == 0:
        return np.full((C, 1), -1, dtype=np.int64), 1
    sizes = np.bincount(comp, minlength=C)
    width = max(1, int(sizes.max()))
    members = np.argsort(comp, kind="stable")
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    slot = np.arange(comp.size) - np.repeat(start, sizes)
    index = np.full((C, width), -1, dtype=np.int64)
    index[comp[members], slot] = members
    return index, width


@dataclass
class LoadingColors:
    r"""The independent groups of a sparse loading, and a colouring of its latents.

    Latent :math:`k` in slot :math:`l` of its group's latents gets colour :math:`l`:
    no token loads on two latents of one colour (a token loads only on its own group's
    latents), so the model run at the sum of the unit noises of colour :math:`l`
    gives every token's loading on its group's :math:`l`-th latent at once:
    :func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal` derives the
    loading from :math:`r + 4` model runs (random intercepts: 5) instead of
    :math:`R + 4`, and the groups' rows of it without a :math:`D \times R` table.

    :param torch.Tensor tokens: ``(C, N)`` long, each group's tokens, ``-1`` at padding.
    :param torch.Tensor latents: ``(C, r)`` long, each group's latents (columns of the
        loading), ``-1`` at padding.
    :param torch.Tensor token_group: ``(D,)`` long, each token's group.
    :param int num_latents: :math:`R`, the loading's columns.
    :param int pattern: a hash of the components, the key of the check of the dropped zeros.
    :param bool gradient_checked: whether the loading was found with autograd on, so that
        the check that its dropped zeros carry no gradient was made (or had nothing to
        check); a colouring found without it serves only calls without gradients.
    :param torch.Tensor weights: ``(R,)`` or None: the points weigh latent :math:`k` by
        ``weights[k]`` (:func:`dropped_zeros_structural` runs the model at such points).
    :param int num_globals: the last ``num_globals`` colours are global latents, one
        each, in every group's row of ``latents`` (groups joined only through them,
        :mod:`~pyro_mpt.conditionals.gaussian_global_groups`); 0 for independent groups.

    Example::

        >>> colors = grouped_marginal(marginal, 1)[2]
        >>> colors.basis(R, x).shape    # (r, R): the points the model is run at
    """

    tokens: torch.Tensor
    latents: torch.Tensor
    token_group: torch.Tensor
    num_latents: int
    pattern: int = 0
    gradient_checked: bool = True
    weights: Optional[torch.Tensor] = None
    num_globals: int = 0

    @property
    def num_colors(self):
        return self.latents.shape[1]

    def basis(self, K, value):
        """The ``(r, K)`` points: row :math:`l` is 1 at the latents of colour :math:`l`.
        Refuses (``NotLinearGaussianError``) a model with another number of latent dims."""
        if K != self.num_latents or value.shape[-1] != self.token_group.numel():
            raise NotLinearGaussianError(
                f"{K} latent dims and {value.shape[-1]} tokens; the colouring was made for "
                f"{self.num_latents} and {self.token_group.numel()}"
            )
        out = torch.zeros(self.num_colors, K, dtype=value.dtype, device=value.device)
        valid = self.latents >= 0
        slots = torch.arange(self.num_colors, device=value.device).expand_as(self.latents)
        out[slots[valid], self.latents[valid]] = 1.0 if self.weights is None else self.weights.to(out.dtype)[self.latents[valid]]
        return out

    def predict(self, mu, W, probes):
        """The location the colouring implies at the ``probes`` ``(P, R)``, ``(P, 1, D)``, from
        the colours' loading ``W`` ``(r, 1, D)``, and the largest sum of the probes'
        magnitudes on one token's latents (the scale of the affinity check's rounding)."""
        E = probes[:, self.token_latents().clamp(min=0)] * self.token_scale(probes.dtype)  # (P, D, r)
        pred = mu + (E * W[:, 0].T).sum(-1)  # (P, D)
        return pred[:, None], E.abs().sum(-1).amax()

    def token_latents(self):
        """``(D, r)`` long: each token's latent of each colour, ``-1`` where its group has none."""
        return self.latents[self.token_group]

    def token_scale(self, dtype):
        """``(D, r)``: what turns the colours' loading into each token's loading on its
        latents, ``1 / weights`` there (1 without weights), 0 where its group has none."""
        lat = self.token_latents()
        if self.weights is None:
            return (lat >= 0).to(dtype)
        return torch.where(lat >= 0, 1.0 / self.weights.to(dtype)[lat.clamp(min=0)], 0.0)

    def rows_of_loading(self, F):
        """The groups' rows ``(C, N, r)`` of a whole loading ``(D, R)``."""
        t, lat = self.tokens.clamp(min=0), self.latents.clamp(min=0)
        return self._padded(F[t[:, :, None], lat[:, None, :]])

    def rows_of_colors(self, W):
        """The groups' rows ``(C, N, r)`` of the colours' loading ``(D, r)`` (column
        :math:`l` of token :math:`j`: its loading on its group's :math:`l`-th latent)."""
        return self._padded(W[self.tokens.clamp(min=0)])

    def _padded(self, Fg):
        pad = (self.tokens < 0)[:, :, None] | (self.latents < 0)[:, None, :]
        return torch.where(pad, torch.zeros((), dtype=Fg.dtype, device=Fg.device), Fg)

    def inner(self, marginal, Fg):
        """The groups' marginal: ``C`` rows of ``N`` tokens, loading ``Fg``; padded tokens
        with zero mean, unit noise."""
        pad = self.tokens < 0
        t = self.tokens.clamp(min=0)
        psi, loc = marginal.cov_diag[0], marginal.loc[0]
        psig = torch.where(pad, torch.ones((), dtype=psi.dtype, device=psi.device), psi[t])
        locg = torch.where(pad, torch.zeros((), dtype=loc.dtype, device=loc.device), loc[t])
        return GaussianMarginal(locg, cov_factor=Fg, cov_diag=psig, site=marginal.site)


def grouped_marginal(marginal, num_data, nonzeros=None):
    r"""The marginal split into the independent groups of its loading, or None.

    Taken for one datapoint (the whole dataset scored as one, where a loading with
    many latents meets many tokens) with a low-rank marginal whose components (see
    :func:`loading_components`) cut the cost :math:`D R^2` of the dense loading by
    :data:`GROUPED_MIN_GAIN` or more as padded groups, :math:`C N r^2`.

    :param ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal marginal: ``loc``
        ``(1, D)``, ``cov_factor`` ``(1, D, R)``, ``cov_diag`` ``(1, D)``.
    :param int num_data: :math:`n`; groups are taken only for 1.
    :param dict nonzeros: where the loading's :func:`loading_nonzeros` are kept under
        ``"pairs"`` for the next reader (:func:`~pyro_mpt.conditionals.gaussian_global_groups.global_groups`):
        one scan of a :math:`D \times R` table for both.
    :returns: ``(inner, index, colors)``: ``inner`` the marginal of ``C`` rows of ``N``
        tokens and ``r`` latents (padded tokens: zero loading and mean, unit noise),
        ``index`` ``(C, N)`` long, each row's tokens, ``-1`` at padding, ``colors`` the
        :class:`LoadingColors` that derive the next call's loading from :math:`r + 4`
        model runs; None where the groups do not pay. Whether a dropped zero of the
        loading carries a gradient is :func:`dropped_zeros_structural`'s to say.

    Example::

        >>> inner, index, colors = grouped_marginal(gaussian_marginal(tokens, model, args, {}), 1)
        >>> inner.cov_factor.shape   # (C, N, r): 1000 groups, at most N tokens each, r = 1
    """
    F, psi, loc = marginal.cov_factor, marginal.cov_diag, marginal.loc
    if num_data != 1 or not marginal.is_low_rank or F is None or F.shape[0] != 1:
        return None
    D, R = F.shape[-2:]
    if R < 2 or loc.shape[0] != 1 or psi.shape[0] != 1:
        return None
    if nonzeros is None:
        nonzeros = {}
    if "pairs" not in nonzeros:
        nonzeros["pairs"] = loading_nonzeros(F)
    colors = grouped_colors(nonzeros["pairs"], D, R, marginal.site, F.device)
    if colors is None:
        return None
    return colors.inner(marginal, colors.rows_of_loading(F[0])), colors.tokens, colors


def grouped_colors(nonzeros, D, R, site, device=None):
    r"""The :class:`LoadingColors` of the independent groups of a loading ``(D, R)`` from its
    nonzeros ``(rows, cols)`` (:func:`loading_nonzeros`, or
    :func:`~pyro_mpt.conditionals.gaussian_marginal.loading_nonzeros_in_chunks` without the
    table), or None where there are fewer than two groups or they do not pay
    (:data:`GROUPED_MIN_GAIN`, as :func:`grouped_marginal`).

    Example::

        >>> colors = grouped_colors((rows, cols), D, R, "y")   # one colour a latent of a group
    """
    if R < 2 or D == 0:
        return None
    layout = group_layout(nonzeros, D, R)
    if layout is None:
        return None
    token_comp, latent_comp, index, lat_index = layout
    C, N = index.shape
    r = lat_index.shape[1]
    if GROUPED_MIN_GAIN * C * N * max(1, min(r, N)) ** 2 > D * max(1, min(R, D)) ** 2:
        return None
    pattern = hash((site, D, R, token_comp.tobytes(), latent_comp.tobytes()))
    return LoadingColors(torch.as_tensor(index, device=device), torch.as_tensor(lat_index, device=device),
                         torch.as_tensor(token_comp, device=device), R, pattern=pattern)


def group_layout(nonzeros, D, R):
    """The groups of a loading ``(D, R)`` from its nonzeros ``(rows, cols)`` as padded rows:
    ``(token_comp, latent_comp, index, lat_index)`` -- the components of
    :func:`loading_components`, each group's tokens ``(C, N)`` and its latents (columns)
    ``(C, r)``, ``-1`` at padding; None for fewer than two groups.

    Example::

        >>> token_comp, latent_comp, index, lat_index = group_layout((rows, cols), D, R)
    """
    token_comp, latent_comp = loading_components(None, nonzeros, (D, R))
    C = int(token_comp.max()) + 1
    if C < 2:
        return None
    index, _ = padded_layout(token_comp, C)
    kept = np.flatnonzero(latent_comp >= 0)
    lat_index, _ = padded_layout(latent_comp[kept], C)
    # no latent in any group (every nonzero in the columns a caller set apart as global: a
    # random intercept whose data fall in one group): padding alone
    lat_index = np.where(lat_index >= 0, kept[np.maximum(lat_index, 0)], -1) if kept.size else np.full_like(lat_index, -1)
    return token_comp, latent_comp, index, lat_index


def _colored_run(colors, tokens, model, args, kwargs, vectorize, memory):
    """The marginal with the colours' loading ``(1, D, r)``, or None (see :func:`colored_marginal`)."""
    if tokens.num_data != 1:
        return None
    try:
        marginal = gaussian_marginal(tokens, model, args, kwargs, vectorize=vectorize, memory=memory, colors=colors)
    except NotLinearGaussianError:
        return None
    F = marginal.cov_factor
    if not marginal.is_low_rank or F is None or F.shape[0] != 1 or F.shape[-1] != colors.num_colors:
        return None
    return marginal


def colored_marginal(colors, tokens, model, args, kwargs, vectorize=True, memory=None):
    """The groups' marginal (as :func:`grouped_marginal`'s ``inner``) from the model run at
    the points of ``colors``, or None where the loading left the colouring's groups (the
    probes found it off the loading the colouring implies, e.g. new data with other
    groups) or has columns of its own (a low-rank observation noise).

    :param LoadingColors colors: from an earlier call's :func:`grouped_marginal`.
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable model: the Pyro model; ``args``, ``kwargs`` its arguments.
    :param bool vectorize: as :func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal`'s.
    :param memory: the run modes' memory, as there.
    :rtype: ~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal

    Example::

        >>> inner = colored_marginal(colors, tokens, model, args, {})   # 5 model runs for random intercepts
    """
    marginal = _colored_run(colors, tokens, model, args, kwargs, vectorize, memory)
    if marginal is None:
        return None
    return colors.inner(marginal, colors.rows_of_colors(marginal.cov_factor[0]))


def dropped_zeros_structural(colors, verdicts, tokens, model, args, kwargs, vectorize=True, memory=None):
    r"""Whether the loading's entries that the groups drop (zero in value: a token's
    loading on another group's latent) are zero in their derivatives too.

    A loading parameter at zero (a per-observation weight that starts at 0) makes an
    entry zero in value only; the groups would lose its gradient. The model is run at
    the colours' points twice, once with each latent weighted by a random
    :math:`c_k \in [\tfrac12, \tfrac32]`: token :math:`j`'s column :math:`l` is
    :math:`\sum_{k \in l} c_k F_{jk}`, so the weighted run divided by its own latent's
    weight, less the plain run, is :math:`\sum_{k \in l,\, k \text{ dropped}}
    (c_k / c_{k_l(j)} - 1) F_{jk}`: zero in value, and in its derivatives exactly
    when the dropped entries are (with probability one), which
    :func:`~pyro_mpt.conditionals.structural_zeros.derivatives_negligible` checks by
    one product of each Jacobian with a random vector: :math:`2(r + 4)` model runs and
    two backward passes over them, not a backward pass over the :math:`D \times R` table.

    :param LoadingColors colors: the groups, from :func:`grouped_marginal`.
    :param dict verdicts: kept across calls (by
        :class:`~pyro_mpt.conditionals.GaussianConditionals`): the verdict per pattern of
        groups (``colors.pattern``), checked once.
    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens; ``model``,
        ``args``, ``kwargs``, ``vectorize``, ``memory`` as :func:`colored_marginal`'s.
    :rtype: bool

    Example::

        >>> dropped_zeros_structural(colors, {}, tokens, model, args, {})   # False: w starts at 0
    """
    if not torch.is_grad_enabled():
        colors.gradient_checked = False
        return True  # nothing to check; such colours serve no gradient
    if colors.pattern in verdicts:
        return verdicts[colors.pattern]
    gen = torch.Generator(device="cpu").manual_seed(20240612)
    weights = 0.5 + torch.rand(colors.num_latents, generator=gen, dtype=torch.float64)
    plain = _colored_run(colors, tokens, model, args, kwargs, vectorize, memory)
    weighed = replace(colors, weights=weights.to(tokens.value.device))
    weighted = _colored_run(weighed, tokens, model, args, kwargs, vectorize, memory)
    if plain is None or weighted is None:
        verdict = False
    else:
        W, Ww = plain.cov_factor[0], weighted.cov_factor[0]  # (D, r)
        kept = colors.token_scale(W.dtype)
        verdict = derivatives_negligible(Ww * weighed.token_scale(W.dtype) - W, W * kept)
    verdicts[colors.pattern] = verdict
    return verdict


@dataclass
class GroupedGaussianState(BlockGaussianState):
    """The Gaussian engine's state for the independent groups of a sparse loading
    (:func:`grouped_marginal`): :class:`~pyro_mpt.conditionals.gaussian_blocks.BlockGaussianState`
    whose blocks are the groups' tokens gathered by ``index`` and padded.

    :param inner: the engine's state over the ``n C`` rows of ``N`` tokens.
    :param int num_blocks: :math:`C`, the groups.
    :param int num_data: :math:`n`.
    :param torch.Tensor index: ``(C, N)`` long, each group's tokens, ``-1`` at padding.
    """

    index: torch.Tensor = None

    def __post_init__(self):
        D = int((self.index >= 0).sum())
        flat = self.index.reshape(-1)
        # a padded slot reads the extra column D of the padded token tensor
        self._gather = torch.where(flat >= 0, flat, D)
        self._positions = flat.argsort()[flat.numel() - D :]  # slot of each token 0..D-1
        self._num_tokens = D

    @property
    def num_tokens(self):
        return self._num_tokens

    @property
    def pads(self):
        """Whether the groups are padded (some have fewer than ``N`` tokens)."""
        return self._num_tokens < self.index.numel()

    def rows(self, t, fill=0):
        """Token tensor ``(*lead, n|1, D)`` -> ``(*lead, n C, N)``, ``fill`` at padding."""
        C, N = self.index.shape
        if t.shape[-2] == 1 and self.num_data > 1:
            t = t.expand(t.shape[:-2] + (self.num_data, self._num_tokens))
        pad = torch.full(t.shape[:-1] + (1,), fill, dtype=t.dtype, device=t.device)
        t = torch.cat([t, pad], -1)[..., self._gather]
        return t.reshape(t.shape[:-2] + (t.shape[-2] * C, N))

    def tokens(self, t):
        """Inverse of :meth:`rows` for ``(*lead, n C, N)``: ``(*lead, n, D)``, padding dropped."""
        t = t.reshape(t.shape[:-2] + (self.num_data, self.index.numel()))
        return t[..., self._positions]

    def observed_rows(self, observed):
        """The groups' observed tokens ``(n C, N)`` for the density: padding unobserved."""
        if observed is None:
            if not self.pads:
                return None
            observed = torch.ones(self.num_data, self._num_tokens, dtype=torch.bool, device=self.index.device)
        return self.rows(observed, fill=False)

    def orders(self, order):
        """Each group's tokens in the order of the complete orderings ``(p, n|1, D)``:
        ``(p, n C|C, N)``, positions within the group, padding first (context to every
        token, on which it has no bearing)."""
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        return self.rows(ranks, fill=-1).argsort(-1)


def grouped_state(inner_state, num_data, index):
    """The :class:`GroupedGaussianState` of a prepared inner state.

    Example::

        >>> state = grouped_state(engine._prepare_marginal(inner, "y"), 1, index)
        >>> state.num_tokens   # D, the padding left out
    """
    return GroupedGaussianState(inner_state, index.shape[0], num_data, index=index)

