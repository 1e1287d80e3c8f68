r"""Closed-form conditionals of Gaussian-marginal models.

For :math:`x \sim \mathcal N(\mu, \Sigma)` and a context set :math:`\mathcal R`,

.. math::

    p(x_j \mid x_{\mathcal R}) = \mathcal N\big(x_j;\;
        \mu_j + \Sigma_{j\mathcal R}\Sigma_{\mathcal R\mathcal R}^{-1}
        (x_{\mathcal R} - \mu_{\mathcal R}),\;
        \Sigma_{jj} - \Sigma_{j\mathcal R}\Sigma_{\mathcal R\mathcal R}^{-1}
        \Sigma_{\mathcal R j}\big).

Two paths, batched over queries and datapoints with no Python loop over masks,
tokens or datapoints (only over memory chunks):

* **low-rank** (Woodbury), for :math:`\Sigma = F F^\top + \operatorname{diag}(\psi)`
  with :math:`F \in \mathbb R^{D\times R}`: the context defines the latent
  posterior precision :math:`\Lambda_{\mathcal R} = I + F_{\mathcal R}^\top
  \Psi_{\mathcal R}^{-1} F_{\mathcal R}` and
  :math:`\eta_{\mathcal R} = F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}(x_{\mathcal R}
  - \mu_{\mathcal R})`, so that
  :math:`\mathbb E[x_j\mid x_{\mathcal R}] = \mu_j + f_j^\top\Lambda^{-1}\eta` and
  :math:`\operatorname{Var} = \psi_j + f_j^\top \Lambda^{-1} f_j`. A mask costs
  :math:`O(DR^2 + R^3)` and each target token :math:`O(R^2)`, instead of the
  :math:`O(|\mathcal R|^3)` of inverting :math:`\Sigma_{\mathcal R\mathcal R}`.
* **dense**, for a full :math:`\Sigma`: the context block is embedded in a
  :math:`D\times D` matrix (identity on masked tokens) and factorized once per
  query.

For complete orderings (the ``"order"`` schedule) both paths have a sequential
form: the contexts are nested, so the low-rank path accumulates
:math:`\Lambda_t` and :math:`\eta_t` with a reverse cumulative sum over positions
(:math:`O(DR^3)` per ordering plus :math:`O(nDR)` for the data), and the dense
path reads every conditional off one Cholesky factor of the permuted covariance.
"""

from dataclasses import dataclass, field
from numbers import Real

import torch

from ..recompute import not_recomputed
from ..model_keys import callable_key
from .base import ConditionalEngine
from .distributions import take_rows
from .gaussian_aggregated import (
    aggregated_cheaper,
    aggregated_elements,
    dense_weighted_sum,
    lowrank_aggregate_data,
    lowrank_form_dtype,
    lowrank_weighted_sum,
)
from .gaussian_blocks import BlockGaussianState, block_marginal
from .gaussian_global_groups import (
    GlobalGroupsConditionals, GlobalGroupsState, global_group_colors, global_groups, global_groups_state,
)
from .gaussian_groups import colored_marginal, dropped_zeros_structural, grouped_colors, grouped_marginal, grouped_state
from .gaussian_dense import dense_chain, dense_log_prob, dense_masks
from .gaussian_dense_precision import routed_dense_sums
from .gaussian_independent import lowrank_independent_sums
from .gaussian_jitter import add_jitter, factor_whole, resume_jitter
from .gaussian_leave_one_out import (
    dense_leave_one_out, leave_one_out_targets, lowrank_leave_one_out, lowrank_leave_one_out_observed,
    lowrank_leave_one_out_rows,
)
from .gaussian_linalg import NotPositiveDefinite, dense_dtype, lowrank_dtype
from .gaussian_lowrank import (
    lowrank_chain,
    lowrank_log_prob,
    lowrank_masks,
    lowrank_shared_chain,
)
from .gaussian_shared import (
    EMBEDDED_MAX_RANK,
    dense_shared_sums,
    lowrank_shared_data,
    lowrank_shared_sums,
    lowrank_shared_sums_embedded,
    shared_sums_elements,
)
from .plate_runs import RunMemory
from .gaussian_marginal import GaussianMarginal, gaussian_marginal, loading_nonzeros_in_chunks

__all__ = ["GaussianConditionals", "GaussianMemory", "CHUNKED_MIN_TABLE", "DENSE_TWIN_RATIO"]

#: masks drawn per datapoint take a low-rank state's dense twin where
#: :math:`K^2(D + K/3) \ge` this times :math:`D^3` (``GaussianConditionals._dense_twin``; measured
#: crossovers at K = 0.3 D for D = 40 and 80, 0.4--0.5 D for D = 10 and 20, where fixed costs weigh)
DENSE_TWIN_RATIO = 0.12

#: the entries (tokens times latent dims) of a one-datapoint loading from which its groups are
#: sought a chunk of latents at a time, without the whole table (below it the table is small:
#: 2**24 entries, 64 MB in float32)
CHUNKED_MIN_TABLE = 2**24


def _to_work(state, x):
    """The data in the dtype the state computes in."""
    return x if state.data_dtype is None else x.to(state.loc.dtype)


def _to_data(state, out):
    """A result back in the data's dtype."""
    return out if state.data_dtype is None else out.to(state.data_dtype)


def _result_dtype(state):
    """The dtype of the state's results: torch's promotion of the model's parameters and
    the data (:func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal`), whatever
    wider dtype the state computes in."""
    return state.loc.dtype if state.data_dtype is None else state.data_dtype


@dataclass
class GaussianMemory:
    """All that a :class:`GaussianConditionals` engine remembers across calls.

    :param ~pyro_mpt.conditionals.plate_runs.RunMemory run_mode: which entry
        of :data:`~pyro_mpt.conditionals.gaussian_marginal.RUN_MODES` ran the
        model at the noise points; tried first at the next call, so that a
        model that does not broadcast is not run in the failing modes at every
        step.
    :param dict jitter: the relative jitter the Cholesky rescue reached, per
        ``(observed site, dtype)``; later calls start from it and warn only
        when it grows.
    :param dict groups: whether a sparse loading's dropped zeros carry no
        gradient, per site and pattern of independent groups
        (:func:`~pyro_mpt.conditionals.gaussian_groups.grouped_marginal`): checked
        once, not at every step.
    :param dict colors: the groups of a sparse loading per ``(model, observed site)``
        (:class:`~pyro_mpt.conditionals.gaussian_groups.LoadingColors`): later calls
        derive the loading from one model run a colour, checked by the probes.
    :param set ungrouped: the ``(model, observed site)`` whose large loading had no groups
        in its chunks' nonzeros: later calls derive the whole marginal at once instead of
        searching again (a regression of 200 weights on 100000 observations paid the
        search's model runs at every step).
    """

    run_mode: RunMemory = field(default_factory=RunMemory)
    jitter: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    colors: dict = field(default_factory=dict)
    ungrouped: set = field(default_factory=set)


class GaussianConditionals(ConditionalEngine):
    r"""Exact masked conditionals of linear-Gaussian and Gaussian models.

    Serves models whose tokens have a Gaussian marginal
    (:func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal` derives
    it from the Pyro model): observed ``MultivariateNormal``,
    ``LowRankMultivariateNormal`` or ``Normal(...).to_event`` without latents
    (also as independent blocks of tokens, e.g. a multi-output GP, see
    :mod:`~pyro_mpt.conditionals.gaussian_blocks`; and ``GaussianHMM``, see
    :mod:`~pyro_mpt.conditionals.linear_dynamical`), and Normal latents with a Normal observation affine in them (PPCA, factor
    analysis, models with covariates).

    Precision: where the data's dtype cannot hold the low-rank pieces (the
    noise is tiny against the loading; see ``gaussian_linalg.lowrank_dtype``) or the
    dense covariance (its scaled condition number exceeds ``1e-3 / eps``), the
    engine computes them in float64 from the parameters (gradients included)
    and returns results in the data's dtype; where float64 cannot hold the
    low-rank pieces either, ``"auto"`` takes the dense path. See
    ``docs/numerics.md``.

    :param str method: ``"auto"`` (low-rank when the marginal has rank below
        D and the low-rank pieces are accurate in float64, else dense; masks drawn
        per datapoint take the dense form of a rank near D, see ``_dense_twin``),
        ``"lowrank"`` or ``"dense"``.
    :param float jitter: added to the marginal's diagonal; 0 by default.
    :param float max_jitter: when a Cholesky factorization fails (the
        covariance is singular or nearly so), add jitter :math:`10^{-8}`
        (float64; :math:`10^{-5}` in float32) times the covariance's mean
        diagonal to its diagonal and retry, ten times more at each retry up
        to ``max_jitter`` times it, warning
        (:class:`~pyro_mpt.conditionals.base.NumericalWarning`) with the
        amount and its estimated change of log p (``log_prob_change``); 0 disables the rescue. The engine keeps the relative jitter
        it reached per observed site and dtype (:class:`GaussianMemory`): later
        calls (the next training steps) start from it and warn only when it grows.
    :param bool vectorize: derive the marginal with one vectorized model run.
    :param bool groups: split a sparse loading of one datapoint into its independent
        groups (:mod:`~pyro_mpt.conditionals.gaussian_groups`), or into groups joined
        only by a few global latents, served by the arrowhead posterior
        (:mod:`~pyro_mpt.conditionals.gaussian_global_groups`; both exact, the same
        numbers to rounding); False keeps the dense loading (to measure what the groups save).
    :param int max_elements: bound on the elements of intermediate tensors.

    Example::

        >>> loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method="dense"))
    """

    def __init__(self, method="auto", *, jitter=0.0, max_jitter=1e-4, vectorize=True, groups=True, max_elements=2**24):
        super().__init__(max_elements=max_elements)
        if method not in ("auto", "lowrank", "dense"):
            raise ValueError(
                f"GaussianConditionals(method={method!r}): use 'auto', 'lowrank' or 'dense'."
            )
        for label, value in (("jitter", jitter), ("max_jitter", max_jitter)):
            if isinstance(value, bool) or not isinstance(value, Real) or not value >= 0:
                raise ValueError(
                    f"GaussianConditionals({label}={value!r}): give a number >= 0 "
                    f"({'added to the covariance diagonal' if label == 'jitter' else 'relative to the mean diagonal; 0 disables the rescue'})."
                )
        self.method = method
        self.jitter = float(jitter)
        self.max_jitter = float(max_jitter)
        self.vectorize = vectorize
        self.groups = groups and method != "dense"
        self.memory = GaussianMemory()
        self._global_groups = GlobalGroupsConditionals(max_elements)

    def reads_latent_draws(self):
        # the marginal comes from the engine's own runs of the model at fixed noise points
        return False

    def prepare(self, tokens, model, guide, args, kwargs):
        blocks = block_marginal(tokens, GaussianMarginal)
        if blocks is not None:
            # independent blocks of tokens (a multi-output GP): served as n * B datapoints
            marginal, num_blocks = blocks
            return BlockGaussianState(self._prepare_marginal(marginal, tokens.name), num_blocks, tokens.num_data)
        key = (callable_key(model), tokens.name)
        colors = self.memory.colors.get(key)
        if colors is not None and self.groups and (colors.gradient_checked or not torch.is_grad_enabled()):
            # the groups found at an earlier call: the loading from r + 4 model runs, not R + 4
            # (random intercepts of 1000 groups: 5 runs, no 10000 x 1000 table)
            inner = colored_marginal(colors, tokens, model, args, kwargs, self.vectorize, self.memory.run_mode)
            if inner is not None:
                return self._colored_state(inner, colors, tokens)
            del self.memory.colors[key]
        if self.groups and tokens.num_data == 1 and key not in self.memory.ungrouped:
            state = self._groups_without_the_table(tokens, model, args, kwargs, key)
            if state is not None:
                return state
        marginal = gaussian_marginal(tokens, model, args, kwargs, vectorize=self.vectorize, memory=self.memory.run_mode)
        nonzeros = {}  # the loading's nonzeros, found once for both kinds of groups
        groups = grouped_marginal(marginal, tokens.num_data, nonzeros) if self.groups else None
        if groups is not None and dropped_zeros_structural(groups[2], self.memory.groups, tokens, model, args, kwargs,
                                                           self.vectorize, self.memory.run_mode):
            # a sparse loading (random intercepts of many groups, one datapoint): its
            # independent groups as rows, O(C N r^2) a step instead of O(D R^2); their loading
            # from the colours' points already, so that the backward pass skips the whole
            # table's model runs (20000 observations in 2000 groups: 8 s of a 14 s first call)
            inner, _, colors = groups
            self.memory.colors[key] = colors
            inner = colored_marginal(colors, tokens, model, args, kwargs, self.vectorize, self.memory.run_mode) or inner
            return self._colored_state(inner, colors, tokens)
        colors = global_groups(marginal, tokens.num_data, nonzeros) if self.groups else None
        if colors is not None and dropped_zeros_structural(colors, self.memory.groups, tokens, model, args, kwargs,
                                                           self.vectorize, self.memory.run_mode):
            # groups joined only by a few global latents (Pyro's radon model): the arrowhead
            # posterior over the groups, O(D (K_g + r)^2) a query instead of O(D R^2)
            # (20000 observations in 2000 groups: 40 s a step before), its loading from
            # r + K_g + 4 model runs at this call's backward pass and every later call
            inner = colored_marginal(colors, tokens, model, args, kwargs, self.vectorize, self.memory.run_mode)
            if inner is not None:
                self.memory.colors[key] = colors
                return self._colored_state(inner, colors, tokens)
        return self._prepare_marginal(marginal, tokens.name)

    def _groups_without_the_table(self, tokens, model, args, kwargs, key):
        """The groups of a large loading (:data:`CHUNKED_MIN_TABLE` entries or more), found
        from its nonzeros a chunk of latents at a time
        (:func:`~pyro_mpt.conditionals.gaussian_marginal.loading_nonzeros_in_chunks`) instead
        of from the whole :math:`D \\times K` table (4000 groups of 10 around a global mean:
        2.2 GB and 3.7 s the first call); None where the pattern has no groups that pay or
        the chunked runs fail (the whole marginal is then derived, as before)."""
        found = loading_nonzeros_in_chunks(tokens, model, args, kwargs, self.max_elements // 4, CHUNKED_MIN_TABLE)
        if found is None:
            return None
        self.memory.ungrouped.add(key)  # taken back below where groups are found
        rows, cols, K = found
        if rows is None:
            return None  # the model's vectorized run failed: the whole marginal's modes
        for make in (grouped_colors, global_group_colors):
            colors = make((rows, cols), tokens.num_tokens, K, tokens.name, tokens.value.device)
            if colors is None or not dropped_zeros_structural(colors, self.memory.groups, tokens, model, args, kwargs,
                                                              self.vectorize, self.memory.run_mode):
                continue
            inner = colored_marginal(colors, tokens, model, args, kwargs, self.vectorize, self.memory.run_mode)
            if inner is None:
                return None
            self.memory.colors[key] = colors
            self.memory.ungrouped.discard(key)
            return self._colored_state(inner, colors, tokens)
        return None

    def _colored_state(self, inner, colors, tokens):
        """The state of a loading's groups (``colors``) from their marginal ``inner``: the
        arrowhead posterior where global latents join them, else the groups as rows."""
        if colors.num_globals:
            return global_groups_state(inner, colors)
        return grouped_state(self._prepare_marginal(inner, tokens.name), tokens.num_data, colors.tokens)

    def _prepare_marginal(self, marginal, site):
        """The state of a marginal: its path, working dtype, jitter and factor."""
        D = marginal.num_tokens
        dense = self.method == "dense" or (
            self.method == "auto" and (not marginal.is_low_rank or marginal.rank >= D)
        )
        data_dtype = marginal.loc.dtype
        checked = False  # whether lowrank_dtype chose the state's dtype
        if not dense:
            if not marginal.is_low_rank:
                raise ValueError(
                    f"GaussianConditionals(method='lowrank'): the marginal of site "
                    f"{site!r} has a dense covariance; use method='dense' or 'auto'."
                )
            F, psi = marginal.cov_factor, marginal.cov_diag
            if F is None:
                F = psi.new_zeros(psi.shape + (1,))
            if self.jitter:
                psi = psi + self.jitter
            psi_min = float(psi.detach().min())  # one host sync for both checks of psi
            if psi_min < 0:
                raise ValueError(
                    f"The noise variance of site {site!r} has negative entries (min "
                    f"{psi_min:.3g}), so its covariance is not positive definite. "
                    f"Use a positive scale (e.g. a pyro.param with constraint=constraints.positive)."
                )
            # the low-rank pieces must be computable in some dtype: else the dense
            # path, whose own checks say when the covariance itself is singular
            work = lowrank_dtype(F, psi)
            if work is None and self.method == "auto":
                dense = True
            else:
                # 'lowrank' asked for: the rescue raises the noise, in the widest dtype
                checked = work is not None
                work = torch.float64 if work is None else work
                state = GaussianMarginal(
                    marginal.loc.to(work), cov_factor=F.to(work), cov_diag=psi.to(work), site=site,
                    data_dtype=None if work == data_dtype else data_dtype,
                )
        if dense:
            cov = marginal.dense()
            if self.jitter:
                cov = cov + self.jitter * torch.eye(D, dtype=cov.dtype, device=cov.device)
            # a low-rank marginal's noise bounds the covariance's smallest eigenvalue: most
            # are settled without the factorization of dense_dtype's estimate
            noise = None
            if marginal.is_low_rank:
                noise = marginal.cov_diag + self.jitter
            work = dense_dtype(cov, noise)
            if work != cov.dtype and (marginal.is_low_rank or marginal.parts is not None):
                # rounding F F^T (or a dense noise's T T^T, plus W W^T) in the data's dtype would
                # already lose the small noise: add the terms again in the wider dtype
                if marginal.is_low_rank:
                    F = None if marginal.cov_factor is None else marginal.cov_factor.to(work)
                    cov = GaussianMarginal(marginal.loc, cov_factor=F, cov_diag=marginal.cov_diag.to(work)).dense()
                else:
                    kind, noise, W = marginal.parts
                    noise = noise.to(work)
                    cov = noise @ noise.transpose(-1, -2) if kind == "tril" else noise
                    if W is not None:
                        W = W.to(work)
                        cov = cov + W @ W.transpose(-1, -2)
                if self.jitter:
                    cov = cov + self.jitter * torch.eye(D, dtype=cov.dtype, device=cov.device)
            state = GaussianMarginal(
                marginal.loc.to(work), covariance=cov.to(work), site=site,
                data_dtype=None if work == data_dtype else data_dtype,
            )
        # factor the whole covariance once, so that a near-singular one is
        # rescued before any query; its principal blocks are no worse conditioned
        key = (state.site, state.loc.dtype)
        if key in self.memory.jitter:
            # an earlier call needed jitter: the covariance as it is now first, so that one
            # that is well-posed again (a GP's noise grown from 1e-15 to 1e-5 in training)
            # is not given the old jitter silently (0.1 nats off); else the remembered jitter
            # at once, without the ladder's failed factorizations below it
            try:
                factor_whole(state, precision_checked=checked)
                return state  # the jitter stays remembered: a relapse does not warn again
            except NotPositiveDefinite:
                state.factor = None
                resume_jitter(state, self.memory.jitter)
        self._rescued(state, lambda: factor_whole(state, precision_checked=checked))
        return state

    def _rescued(self, state, compute):
        """``compute()``, retried with more jitter on the state's covariance while a
        Cholesky factorization fails (see :mod:`~pyro_mpt.conditionals.gaussian_jitter`)."""
        while True:
            try:
                return compute()
            except NotPositiveDefinite as error:
                add_jitter(state, error, self.max_jitter, self.memory.jitter)

    def log_evidence(self, state, x, observed=None):
        r"""Exact :math:`\log\mathcal N(x_i; \mu, \Sigma)` per datapoint, ``(n,)``.

        :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens; when
            given, the density of each datapoint's observed sub-vector,
            :math:`\log\mathcal N(x_{O_i}; \mu_{O_i}, \Sigma_{O_i O_i})`.
        """
        if isinstance(state, GlobalGroupsState):
            return self._global_groups.log_evidence(state, x, observed)
        if isinstance(state, BlockGaussianState):
            blocks = state.observed_rows(observed)
            return state.per_datapoint(self.log_evidence(state.inner, state.rows(x), blocks))
        x = _to_work(state, x)
        log_prob = lowrank_log_prob if state.is_low_rank else dense_log_prob
        return _to_data(state, self._rescued(state, lambda: log_prob(state, x, observed)))

    # ------------------------------------------------------------------ chunking
    def _run_chunked(self, fn, state, x, index, per_item):
        """Apply ``fn(state, x, index)`` over chunks of queries and datapoints.

        ``per_item`` is the number of elements the largest intermediate needs
        per (query, datapoint) pair; chunks keep ``q * n * per_item`` under
        ``max_elements``. Rows shared by the batch (leading dim 1) are not split.
        """
        q, n = index.shape[0], x.shape[0]
        if q * n * per_item <= self.max_elements:
            return fn(state, x, index)
        n_step = max(1, min(n, self.max_elements // per_item))
        q_step = max(1, self.max_elements // (per_item * n_step))
        out = []
        for qs in range(0, q, q_step):
            idx_q = index[qs : qs + q_step]
            parts = []
            for ns in range(0, n, n_step):
                rows = torch.arange(ns, min(n, ns + n_step), device=x.device)
                idx = idx_q if idx_q.shape[1] == 1 else idx_q[:, rows]
                parts.append(fn(_slice_marginal(state, rows), x[rows], idx))
            out.append(torch.cat(parts, 1))
        return torch.cat(out, 0)

    # ------------------------------------------------------------------ masks
    def mask_log_prob(self, state, x, mask):
        if isinstance(state, GlobalGroupsState):
            return self._global_groups.mask_log_prob(state, x, mask)
        if isinstance(state, BlockGaussianState):
            return state.tokens(self._active_blocks(self.mask_log_prob, state, x, mask, per_token=True))
        x = _to_work(state, x)
        return _to_data(state, self._rescued(state, lambda: self._mask_log_prob(state, x, mask)))

    def _mask_log_prob(self, state, x, mask):
        D = x.shape[-1]
        if state.is_low_rank:
            R = state.cov_factor.shape[-1]
            return self._run_chunked(lowrank_masks, state, x, mask, D * (R + 2))
        return self._run_chunked(dense_masks, state, x, mask, D * D)

    def mask_sums(self, state, x, mask):
        if isinstance(state, GlobalGroupsState):
            return self._global_groups.mask_sums(state, x, mask)
        if mask.shape[1] == 1:
            targets = leave_one_out_targets(mask[:, 0])
            table = None if targets is None else self.leave_one_out_log_prob(state, x)
            if table is not None:
                # queries that each hide one token: one factorization for all of them
                return table.T[targets]
        if isinstance(state, BlockGaussianState):
            return state.per_datapoint(self._active_blocks(self.mask_sums, state, x, mask, per_token=False))
        x_data, x = x, _to_work(state, x)
        if mask.shape[1] == 1:
            # masks shared by the batch: each mask's factor once, the data by batched
            # matrix products over its gathered targets
            shared = state.cov_factor if state.is_low_rank else state.covariance
            if shared.shape[0] == 1:
                return _to_data(state, self._rescued(state, lambda: self._shared_sums(state, x_data, x, mask[:, 0])))
        if self._independent_sums(state) or self._dense_independent(state):
            return self._per_datapoint_sums(state, x_data, mask)
        logc = self._rescued(state, lambda: self._mask_log_prob(state, x, mask))
        zero = torch.zeros((), dtype=logc.dtype, device=logc.device)
        return _to_data(state, torch.where(mask, logc, zero).sum(-1))

    def mask_sums_within(self, state, x, mask, context):
        if self._independent_within(state, mask, context):
            # missing tokens per datapoint, loading shared: the independent sums over the
            # hidden tokens (targets and missing ones), summed over the targets
            hidden = mask | ~context
            return self._per_datapoint_sums(state, x, hidden, context[0].expand(hidden.shape[1:]))
        return super().mask_sums_within(state, x, mask, context)

    def _per_datapoint_sums(self, state, x_data, mask, observed=None):
        """The summed conditionals of masks drawn per datapoint ``(q, n, D)`` with a loading
        (:meth:`_independent_sums`) or a dense covariance (:meth:`_dense_independent`)
        shared by the batch, ``(q, n)``; with ``observed`` ``(n, D)``, the tokens of
        ``mask`` outside it are hidden but not summed (missing tokens). A loading of rank
        near ``D`` takes its dense twin (:meth:`_dense_twin`)."""
        twin = self._dense_twin(state)
        if twin is not None:
            return self._per_datapoint_sums(twin, x_data, mask, observed).to(_result_dtype(state))
        if state.is_low_rank:
            # products over the flattened (q n, D) contexts, in cache-sized chunks, none
            # kept for the backward pass
            def compute():
                form, xf = self._form_state(state, x_data)
                return lowrank_independent_sums(form, xf, mask, self._shared_data(form, x_data, xf), observed)

            return self._rescued(state, compute).to(_result_dtype(state))
        # the conditionals' sums with their backward pass written out; the precision route's
        # pieces computed once per state and data, for every block; the first block keeps up
        # to half of max_elements of its chunks' tables for the backward pass, which recomputes
        # the rest (one thread, loss + gradient, full-covariance MVN N = 1000: D = 200 241 ->
        # 190 ms float32, 336 -> 261 ms float64; D = 50 36 -> 28 ms; 2**24 kept: 182 ms)
        x = _to_work(state, x_data)
        return _to_data(state, self._rescued(state, lambda: routed_dense_sums(
            state, x, mask, self.max_elements, observed, self._kept(state, x_data), self.max_elements // 2)))

    def _dense_twin(self, state):
        r"""The dense form of a low-rank state with its loading shared by the batch, where masks
        drawn per datapoint cost less on it: with ``method="auto"`` and
        :math:`K^2(D + K/3) \ge` ``DENSE_TWIN_RATIO`` :math:`D^3` (a low-rank query per datapoint
        forms and factors its :math:`K\times K` context precision, a dense one factors a block of
        at most :math:`D` tokens); None elsewhere. Made once per state, factored, and kept on it.

        Measured (PPCA, N = 200, masks per datapoint, loss + gradient, one thread, float64):
        low-rank against dense ``"all"`` 0.35--0.58x at K = D/10--D/5, 1.0--1.25x at K = 0.3 D
        (D = 40, 80), 2.5--2.9x at K = D/2 (D = 40, 80 at 0.4), 8--19x at K = 0.75--0.95 D;
        ``"uniform"`` 1.0x at K = D/2 (D = 20, 40), 2.9--4.4x at K = 0.75--0.95 D (D = 80).
        """
        if self.method != "auto" or not state.is_low_rank or state.cov_factor.shape[0] != 1:
            return None
        D, K = state.cov_factor.shape[-2:]
        if K * K * (D + K / 3) < DENSE_TWIN_RATIO * D**3:
            return None
        if state.dense_twin is None:
            F, psi = state.cov_factor, state.cov_diag  # psi holds the engine's jitter already
            cov = GaussianMarginal(state.loc, cov_factor=F, cov_diag=psi).dense()
            work = dense_dtype(cov, psi)
            if work != cov.dtype:
                cov = GaussianMarginal(state.loc, cov_factor=F.to(work), cov_diag=psi.to(work)).dense()
            result = _result_dtype(state)
            twin = GaussianMarginal(
                state.loc.to(work), covariance=cov, site=state.site, data_dtype=None if work == result else result,
            )
            self._rescued(twin, lambda: factor_whole(twin))
            state.dense_twin = twin
        return state.dense_twin

    def _independent_within(self, state, mask, context):
        """Whether :meth:`mask_sums_within` takes the sums over masks drawn per datapoint
        (``gaussian_independent``'s or ``gaussian_dense_precision``'s): a context shared
        by the queries (the observed tokens) and a state those sums serve
        (:meth:`_independent_sums`, :meth:`_dense_independent`)."""
        return (
            not isinstance(state, (BlockGaussianState, GlobalGroupsState))
            and context.shape[0] == 1
            and (mask.shape[1] != 1 or context.shape[1] != 1)
            and (self._independent_sums(state) or self._dense_independent(state))
        )

    def recomputes_mask_sums(self, state, x, mask, context=None):
        """True for masks drawn per datapoint with a loading (low-rank path) or a
        covariance (dense path) shared by the batch:
        ``gaussian_independent.lowrank_independent_sums`` and
        ``gaussian_dense_precision.routed_dense_sums`` (both of its routes) keep only the
        masks (as bits) and recompute their chunks in their backward passes (the dense
        sums' first block of a state keeps its costliest chunks' tables within half of
        ``max_elements``: bounded, whatever the number of blocks); with a context
        (missing tokens), where :meth:`mask_sums_within` takes them."""
        if isinstance(state, GlobalGroupsState):
            return False
        if context is not None:
            return self._independent_within(state, mask, context)
        return (
            not isinstance(state, BlockGaussianState)
            and mask.shape[1] != 1
            and (self._independent_sums(state) or self._dense_independent(state))
        )

    @staticmethod
    def _dense_independent(state):
        """Whether masks per datapoint take ``gaussian_dense_precision``'s routed sums: a dense
        state whose covariance the batch shares."""
        return not state.is_low_rank and state.covariance.shape[0] == 1

    @staticmethod
    def _independent_sums(state):
        """Whether masks per datapoint take ``gaussian_independent``'s sums: a low-rank
        state whose loading the batch shares and whose signal-to-noise ratio keeps
        their digits in its dtype or in float64
        (:func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_form_dtype`); else the
        per-mask conditionals. Above that ratio the sums lose about eps kappa in their
        values and loading gradient (the rounding of the K x K precision
        I + S(context); float64, D = 8, K = 5, noise variance 1e-10: loading gradient
        2.6e-6 relative off an mpmath reference, the per-mask conditionals' 1.4e-9) and
        more in their noise gradient (terms of order 1/psi^2 that cancel), so they
        give way to the per-mask conditionals, which keep them."""
        return (
            state.is_low_rank
            and state.cov_factor.shape[0] == 1
            and lowrank_form_dtype(state.cov_factor, state.cov_diag) is not None
        )

    @staticmethod
    def _form_state(state, x_data):
        """The state the aggregated form and the sums over masks drawn per datapoint
        run on, and the data in its dtype: the state itself, or a float64 copy of it
        where only float64 keeps their digits
        (:func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_form_dtype`)."""
        dtype = lowrank_form_dtype(state.cov_factor, state.cov_diag)
        if dtype != state.loc.dtype:
            state = GaussianMarginal(
                state.loc.to(dtype), cov_factor=state.cov_factor.to(dtype), cov_diag=state.cov_diag.to(dtype),
                site=state.site, jitter=state.jitter, data_dtype=_result_dtype(state),
            )
        return state, x_data.to(dtype)

    @staticmethod
    def _active_blocks(method, state, x, mask, per_token):
        """``method`` (:meth:`mask_log_prob` or :meth:`mask_sums`) on the blocks, asked
        only for the (query, block) pairs that have a target: the others contribute
        nothing (a leave-one-out query has a target in one block of B). Returns
        ``(q, n B, ...)``, zeros for the pairs without a target."""
        xb, mb = state.rows(x), state.rows(mask)  # (n B, N), (q, n B, N)
        q_idx, r_idx = mb.any(-1).nonzero(as_tuple=True)
        tail = mb.shape[-1:] if per_token else ()
        if q_idx.numel() == 0:
            return xb.new_zeros(mb.shape[:2] + tail)
        out = method(_slice_marginal(state.inner, r_idx), xb[r_idx], mb[q_idx, r_idx].unsqueeze(0))[0]
        return out.new_zeros(mb.shape[:2] + tail).index_put((q_idx, r_idx), out)

    def _shared_data(self, state, x_data, x):
        """The mask-free pieces of the low-rank shared paths, once per state and
        data (kept on the state: :attr:`GaussianMarginal.data_pieces
        <pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal>`)."""
        pieces = self._kept(state, x_data)
        if "eT" not in pieces:
            with not_recomputed():  # made once, for this block and every later one
                pieces.update(lowrank_shared_data(state, x))
        return pieces

    @staticmethod
    def _kept(state, x_data):
        """The dict of what the state keeps for the data ``x_data``
        (:attr:`GaussianMarginal.data_pieces <pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal>`),
        emptied for other data."""
        if state.data_pieces is None or state.data_pieces[0] is not x_data:
            state.data_pieces = (x_data, {})
        return state.data_pieces[1]

    @staticmethod
    def _serves_leave_one_out(state):
        """Whether :meth:`_leave_one_out` serves the state: a dense one always, a low-rank
        one where it keeps its digits in its dtype or in float64
        (:func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_form_dtype`)."""
        if isinstance(state, BlockGaussianState):
            state = state.inner
        return not state.is_low_rank or lowrank_form_dtype(state.cov_factor, state.cov_diag) is not None

    def _leave_one_out(self, state, x_data):
        """Every leave-one-out conditional, ``(n, D)`` in the result dtype (on blocks, a
        token's conditional given the rest is the one given the rest of its block),
        computed once per state and data
        (:mod:`~pyro_mpt.conditionals.gaussian_leave_one_out`); None for other states,
        and for low-rank ones whose pieces lose their digits even in float64."""
        inner = state.inner if isinstance(state, BlockGaussianState) else state
        if not self._serves_leave_one_out(inner):
            return None
        if "leave_one_out" not in self._kept(inner, x_data):
            with not_recomputed():  # made once, for this block and every later one
                if inner is state:
                    table = self._leave_one_out_table(state, x_data)
                else:
                    table = state.tokens(self._leave_one_out_table(inner, state.rows(x_data)))
            self._kept(inner, x_data)["leave_one_out"] = table
        return self._kept(inner, x_data)["leave_one_out"]

    def leave_one_out_log_prob(self, state, x, observed=None):
        """Every leave-one-out conditional from one factorization of the state's covariance
        (:mod:`~pyro_mpt.conditionals.gaussian_leave_one_out`), kept for later calls with the
        same data; None for a low-rank state whose pieces lose their digits even in float64.
        With missing tokens (``observed``) on the low-rank path, each datapoint's posterior
        given its observed tokens (one :math:`R \\times R` factor a datapoint, 0 at a missing
        token); None on the dense path and for blocks."""
        if isinstance(state, GlobalGroupsState):
            return self._global_groups.leave_one_out_log_prob(state, x, observed)
        if observed is None:
            return self._leave_one_out(state, x)
        if isinstance(state, BlockGaussianState) or not self._serves_leave_one_out(state) or not state.is_low_rank:
            return None

        def compute():
            form, xf = self._form_state(state, x)
            return lowrank_leave_one_out_observed(form, xf, observed)

        return self._rescued(state, compute).to(_result_dtype(state))

    def _leave_one_out_table(self, state, x_data):
        if state.is_low_rank:
            def compute():
                form, xf = self._form_state(state, x_data)
                if form.cov_factor.shape[0] != 1 or form.cov_diag.shape[0] != 1:
                    # a loading or noise per datapoint: each datapoint's posterior apart
                    return lowrank_leave_one_out_rows(form, xf)
                return lowrank_leave_one_out(form, self._shared_data(form, x_data, xf))

            return self._rescued(state, compute).to(_result_dtype(state))
        return _to_data(state, self._rescued(state, lambda: dense_leave_one_out(state, _to_work(state, x_data))))

    def _shared_sums(self, state, x_data, x, mask):
        if not state.is_low_rank:
            return dense_shared_sums(state, x, mask, self.max_elements)
        data = self._shared_data(state, x_data, x)
        R = state.cov_factor.shape[-1]
        if R <= EMBEDDED_MAX_RANK:
            n, D = x.shape
            step = max(1, self.max_elements // max(1, (n + D) * (R + 1)))
            return torch.cat([lowrank_shared_sums_embedded(state, x, mask[i : i + step], data) for i in range(0, mask.shape[0], step)])
        return lowrank_shared_sums(state, x, mask, self.max_elements, data)

    def _aggregated_rank(self, state, x):
        """``(True, R)`` when :meth:`weighted_mask_sum` takes the aggregated form
        (``R`` the rank, None on the dense path), ``(False, None)`` when per-mask
        products with the data are cheaper, the covariance is not shared, or
        the form would lose its digits in the state's dtype and in float64
        (:func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_form_dtype`)."""
        if isinstance(state, BlockGaussianState):
            return False, None
        n, D = x.shape
        if state.is_low_rank:
            if state.cov_factor.shape[0] != 1:
                return False, None
            R = state.cov_factor.shape[-1]
            if lowrank_form_dtype(state.cov_factor, state.cov_diag) is None:
                return False, None
            return aggregated_cheaper(n, D, R), R
        if state.covariance.shape[0] != 1:
            return False, None
        return aggregated_cheaper(n, D), None

    def weighted_sum_elements(self, state, x, mask=None):
        if isinstance(state, GlobalGroupsState):
            return x.shape[0] * x.shape[1]
        if mask is not None and leave_one_out_targets(mask) is not None and self._serves_leave_one_out(state):
            # the leave-one-out table serves every such query: a row of sums each
            return x.shape[0]
        aggregated, R = self._aggregated_rank(state, x)
        if aggregated:
            return aggregated_elements(x.shape[-1], R)
        n, D = x.shape
        per_query = n * D
        if not isinstance(state, BlockGaussianState):
            # the per-mask factors of the shared-mask sums (a mask's (D, R) loading rows or
            # (D, D) covariance blocks) outgrow the n * D of its conditionals when the
            # data are few against the tokens (one datapoint of many tokens): declared, so
            # that mpt_estimate splits such blocks, each recomputed in the backward pass
            shared = state.cov_factor if state.is_low_rank else state.covariance
            if shared.shape[0] == 1:
                per_query = max(per_query, shared_sums_elements(n, D, R=shared.shape[-1] if state.is_low_rank else None))
        return per_query

    def weighted_mask_sum(self, state, x, mask, coef):
        r"""The weighted sum over masks shared by the batch as one quadratic form
        per datapoint, :math:`-\tfrac12(c + y_i^\top A y_i)` with
        :math:`A = \sum_q c_q Q_q` aggregated over the masks (see
        :mod:`~pyro_mpt.conditionals.gaussian_aggregated` for the forms), when
        that costs fewer flops than per-mask products with the data (the data
        are many against the tokens, :math:`(D+R)^2 \le 2nD` on the low-rank
        path, :math:`6D \le n` on the dense one; on the low-rank path also
        counting the form's one product with the data, which a few masks do
        not repay, see :func:`~pyro_mpt.conditionals.gaussian_aggregated.aggregated_cheaper`);
        else the per-mask sums."""
        if isinstance(state, GlobalGroupsState):
            return super().weighted_mask_sum(state, x, mask, coef)
        targets = leave_one_out_targets(mask)
        table = None if targets is None else self.leave_one_out_log_prob(state, x)
        if table is not None:
            # queries that each hide one token: one factorization for all of them
            weight = torch.zeros(mask.shape[-1], dtype=table.dtype, device=table.device)
            return table @ weight.index_add(0, targets, coef.to(table.dtype))
        aggregated, R = self._aggregated_rank(state, x)
        if aggregated and R is not None:
            aggregated = aggregated_cheaper(*x.shape, R, masks=mask.shape[0])
        if not aggregated:
            return super().weighted_mask_sum(state, x, mask, coef)
        x_data, x = x, _to_work(state, x)
        if state.is_low_rank:
            def compute():
                form, xf = self._form_state(state, x_data)
                data = lowrank_aggregate_data(self._shared_data(form, x_data, xf))
                return lowrank_weighted_sum(form, mask, coef, data, self.max_elements)
        else:
            def compute():
                return dense_weighted_sum(state, x, mask, coef)
        return self._rescued(state, compute).to(_result_dtype(state))

    def chain_log_prob(self, state, x, order):
        if isinstance(state, GlobalGroupsState):
            return self._global_groups.chain_log_prob(state, x, order)
        if isinstance(state, BlockGaussianState):
            # each block's chain runs along its own tokens' order in the global ordering
            sub_order = state.orders(order)
            inner = self.chain_log_prob(state.inner, state.rows(x), sub_order)
            return state.chain_by_position(inner, sub_order, order)
        x = _to_work(state, x)
        return _to_data(state, self._rescued(state, lambda: self._chain_log_prob(state, x, order)))

    def _chain_log_prob(self, state, x, order):
        D = x.shape[-1]
        if state.is_low_rank:
            R = state.cov_factor.shape[-1]
            if order.shape[1] == 1 and state.cov_factor.shape[0] == 1:
                return lowrank_shared_chain(state, x, order, self.max_elements)
            return self._run_chunked(lowrank_chain, state, x, order, D * R * (R + 2))
        return self._run_chunked(dense_chain, state, x, order, D * D)

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Every complete ordering of one Gaussian joint telescopes to
        :math:`\log\mathcal N(x; \mu, \Sigma)` (the chain rule), so the sums are
        the exact log-density, at the cost of one exact evaluation; with
        ``observed`` (missing tokens first in every ordering) the terms of the
        observed targets telescope to the density of the observed sub-vector."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], x.shape[0])


def _slice_marginal(m, idx):
    return GaussianMarginal(
        take_rows(m.loc, idx),
        cov_factor=None if m.cov_factor is None else take_rows(m.cov_factor, idx),
        cov_diag=None if m.cov_diag is None else take_rows(m.cov_diag, idx),
        covariance=None if m.covariance is None else take_rows(m.covariance, idx),
        site=m.site,
        jitter=m.jitter,
        factor=None if m.factor is None else take_rows(m.factor, idx),
        data_dtype=m.data_dtype,
    )
