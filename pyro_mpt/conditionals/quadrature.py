r"""Quadrature conditionals for factorized-likelihood models with low-dimensional latents.

For a model whose tokens are conditionally independent given a latent
:math:`z \in \mathbb R^K` (:math:`K \le 4`),

.. math::

    p(x) = \int p(z) \prod_{d=1}^D p(x_d \mid z)\, dz
         \approx \sum_{q=1}^Q \omega_q \prod_{d=1}^D p(x_d \mid z_q),

a quadrature rule with nodes :math:`z_q` and weights :math:`\omega_q` turns the
latent model into a finite mixture. Every masked conditional is then a ratio of
two mixture sums over the same nodes,

.. math::

    \log p(x_j \mid x_{\mathcal R}) =
      \operatorname*{logsumexp}_q \Big[\log\omega_q + T_{qj} + \sum_{r\in\mathcal R} T_{qr}\Big]
    - \operatorname*{logsumexp}_q \Big[\log\omega_q + \sum_{r\in\mathcal R} T_{qr}\Big],
    \qquad T_{qd} = \log p(x_d \mid z_q),

On one grid all conditionals come from one joint measure (the mixture):
Proposition 1 holds exactly for them, with :math:`\log p(x)` the mixture's
evidence. The normalizer of the empty context is taken as exactly one (the
prior's integral, which the prior-centred Gauss–Hermite rule for Normal latents
reproduces to rounding): the chain rule then telescopes to the rule's
:math:`\log \sum_q \omega_q \prod_d p(x_d\mid z_q)`, which is accurate for
adaptive grids, rather than to that value minus the log of the grid's (poor)
estimate of :math:`\int p(z)\,dz`. The default adaptive rule gives a query
whose context the full-posterior grid does not resolve a grid of its own
(*context grids*, :mod:`~pyro_mpt.conditionals.quadrature_contexts`): each
conditional is then accurate by itself, and exhaustive MPT recovers the true
:math:`\log p(x)` to the rule's accuracy instead of the mixture's to rounding.

**The table.** :math:`T` (per datapoint, ``(Q, D)``) is read off the Pyro model
itself (:class:`~pyro_mpt.conditionals.quadrature_nodes.NodeRunner`): the
model runs once per chunk of nodes inside an extra vectorized plate
``_mpt_nodes`` at dim ``-(max_plate_nesting + 1)``, with every latent site set to
its node values by a messenger (subsample sites are replayed so minibatches
match), and the observed site's distribution is unwrapped from ``Independent``
to evaluate one log-density per token. A model that does not broadcast over
that plate runs once per node without it (the engines' one fallback policy,
:func:`~pyro_mpt.conditionals.plate_runs.run_with_fallback`; remembered in
:class:`QuadratureMemory`). Any observation whose base distribution
has no event dims works (Bernoulli, Normal, Categorical over a vocabulary,
Poisson, Beta, ...).

**Rules** (:mod:`~pyro_mpt.conditionals.quadrature_rules`), in coordinates
:math:`u` in which each latent is generated from its (conditional) prior:

* Normal and MultivariateNormal latents use whitened coordinates
  :math:`z = \mu + L u` with :math:`u \sim \mathcal N(0, I)`, for any loc/scale,
  including locs that depend on earlier latents or on covariates. The
  prior-centred rule is the tensor Gauss–Hermite rule, exact for integrands
  polynomial of degree :math:`\le 2m - 1` in each whitened coordinate.
* Other continuous scalar latents (Gamma, Beta, Uniform, LogNormal, Exponential,
  HalfNormal, StudentT, ...) use the unconstrained coordinate
  :math:`u = T^{-1}(z)` with :math:`T` = ``biject_to(support)`` and prior density
  :math:`\pi(u) = p(T(u))\,|T'(u)|`. The prior-centred rule is Gauss–Hermite on
  the Laplace approximation :math:`\mathcal N(c, SS^\top)` of :math:`\pi` with
  change-of-variables weights :math:`w_q / \mathcal N(u_q; c, SS^\top)`: exact in
  the limit, and accurate when :math:`\pi` has Gaussian or lighter tails in
  :math:`u` (not Cauchy-like priors). A latent with event dims whose support
  ``biject_to`` maps from an unconstrained space (a ``Dirichlet``: the
  :math:`K - 1` stick-breaking coordinates of its simplex) is handled the same
  way, with :math:`|\det T'(u)|`.
* ``adaptive=True`` centres and scales the grid, per datapoint, on the Laplace
  approximation of the posterior given *all* its tokens
  (:class:`~pyro_mpt.conditionals.laplace.LaplaceSearch`: Newton steps with
  line search to convergence, started from the best node of a coarse grid or
  the previous call's centres, ending with a full step and the Hessian at the
  final centre so that the start does not show; detached from the autograd
  graph), with the same change-of-variables weights, so the rule stays valid
  for any centre. Prior-centred grids need hundreds of nodes per dimension
  once D is large, because the posterior is much narrower than the prior; the
  adaptive grid needs about a dozen.
* ``context_grids=True`` (with ``adaptive``, the default): a masked
  conditional is an expectation under the posterior given its *context*, which
  is wider than the full one and, when an outlying token is hidden, centred
  elsewhere. Each query whose context's Gaussian model is too far from the full
  posterior (:func:`~pyro_mpt.conditionals.quadrature_contexts.full_grid_resolves`)
  is integrated on a grid centred and scaled on that model, and every log-sum
  gets the closed-form correction that makes the rule exact for Gaussian
  likelihoods (:func:`~pyro_mpt.conditionals.quadrature_contexts.gaussian_corrections`).
  ``log_evidence`` and the chain-rule sums use the full grid (they telescope to
  :math:`\log p(x)` whatever the grid); ``chain_log_prob`` (per-position terms along
  orderings, for curves) asks one mask per position, so each term gets the grid of
  its context.

**Cost and memory.** A block of ``q`` masks costs one ``(Q, D) x (D, q)`` and one
``(q, Q) x (Q, D)`` matrix product per datapoint (in exp-space with max shifts,
falling back to an exact log-sum-exp where the product underflows). The chain
rule along orderings uses cumulative sums of the table. The table is built in
chunks of ``Q_c = max(1, max_elements // (n D))`` nodes; the leading chunks, up to
``cache_elements`` entries (all of them when the table is that small), are kept
with their graph for the loss evaluation, the others are streamed: every query
block re-runs the model on them chunk by chunk
(:func:`~pyro_mpt.conditionals.streamed_sums.streamed_log_sums`: the value from
a pass without a graph, the gradient from one recomputed region per chunk, so
that neither a chunk nor its partial sums are kept), so that peak memory is
about ``cache_elements`` kept entries (each with the model's intermediates) plus
``(c + 3) * max(max_elements, n D)`` elements (``c`` the model's own
intermediates per table entry; a chunk holds at least one node, and the model
runs on the whole batch) plus the block's ``q n D`` outputs, whatever ``Q``. A
streamed chunk costs model runs per pass (one without a graph, one with it, one
more in the backward pass), so the default cache (``2**27`` entries,
about 2 GB with the tutorial VAE's decoder) keeps the tables of typical
minibatches whole: Pyro's tutorial VAE (batch 256, 625 nodes) streamed cost
1.8-2.0 times the model evaluations it needs, kept 1.25 times
(``docs/benchmarks.md``); lower it where memory is scarce.
With the defaults (``max_elements = 2**24``) N=2000, D=784, K=2 runs in about
1.1 GB (float32, adaptive 8 x 8 grid; see ``docs/quadrature.md``).
"""

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from .base import ConditionalEngine, QuadratureAccuracyWarning, ordering_ranks
from .distributions import check_factorized
from .laplace import LaplaceSearch
from .mixture import chain_terms, normalize_empty
from .mixture_chunks import MixtureChunk, stable_logsumexp
from .plate_runs import RunMemory
from .quadrature_contexts import (
    KEEP_RULE_NODES,
    context_frames,
    context_models,
    context_partials,
    full_frames,
    full_grid_resolves,
    gaussian_corrections,
    model_precision,
    prior_quadratic,
    resolved_tol,
    token_quadratics,
    unresolved_targets,
    with_models,
)
from .quadrature_leave_one_out import QuadratureLeaveOneOut
from .quadrature_table import QuadratureState
from .quadrature_nodes import (
    ALTERNATIVES,
    MAX_NODE_RUNS,
    NodeRunner,
    NotQuadratureError,
    latent_dtype,
    prior_start,
    quadrature_layout,
)
from .quadrature_rules import (
    MAX_LATENT_DIM,
    RESOLVED_AXIS_ESS,
    affine_grid,
    default_num_nodes,
    effective_nodes,
    gaussian_grid,
)
from ..code_origin import user_stacklevel
from ..model_keys import callable_key
from ..recompute import not_recomputed
from ..counts import is_count

__all__ = ["QuadratureConditionals", "QuadratureMemory", "CHECK_TOL", "CHECK_EVIDENCE_TOL", "rule_rounding"]


def rule_rounding(value):
    r""":math:`8\varepsilon(|\log p(x)| + 1)` per datapoint: the rounding of a rule's log-sum of terms
    of size :math:`|\log p(x)|` in ``value``'s dtype, part of the rules' error estimates. More
    nodes cannot lower it, so the accuracy checks judge the rest against their tolerances (in
    float32 it alone passed 1e-3 from :math:`|\log p(x)| \approx 1000`: a warning to use more
    nodes at every such datapoint, whose true error was 1.6e-4).

    Example::

        >>> rule_rounding(torch.tensor([-1260.0]))   # tensor([0.0012]), float32's eps 1.19e-7
    """
    return 8 * torch.finfo(value.dtype).eps * (value.abs() + 1)


def _ranks_in_groups(keys, num_groups):
    """Each entry's position among the entries of its group, for ``keys`` (long, sorted,
    in ``[0, num_groups)``); and each group's size, ``(num_groups,)``."""
    size = torch.bincount(keys, minlength=num_groups)
    return torch.arange(keys.shape[0], device=keys.device) - (size.cumsum(0) - size)[keys], size


#: the default ``check_tol`` of :class:`QuadratureConditionals` (nats per conditional):
#: the accuracy the docs state for the default grids' conditionals, else a warning (it was
#: 0.1, and errors of 1e-2 -- HalfCauchy scales, the default Dirichlet grid -- never warned)
CHECK_TOL = 1e-2
#: the default ``check_evidence_tol`` (nats per datapoint): the chain-rule sums along
#: orderings are the full grid's :math:`\log p(x)`, checked like ``Evidence(method="quadrature")``
#: (whose ``warn_tol`` is the same 1e-3)
CHECK_EVIDENCE_TOL = 1e-3


@dataclass
class QuadratureMemory:
    """All that a :class:`QuadratureConditionals` engine remembers across calls.

    :param ~pyro_mpt.conditionals.plate_runs.RunMemory run_mode: whether the
        model ran at the nodes with its shared latent parameters kept at size
        one (``"compact"``), only at full batch shape (``"full"``), or only one
        node at a time (``"per_node"``, a model that does not broadcast over
        the node plate; see
        :data:`~pyro_mpt.conditionals.quadrature_nodes.RUN_MODES`); the working
        mode is tried first at the next call.
    :param tuple warm_key: the model (:func:`~pyro_mpt.model_keys.callable_key`), the data
        and minibatch indices (cloned) of the last adaptive search.
    :param bool checked: whether the first evaluation's conditionals were
        checked against coarser rules (``check_tol`` of the engine).
    :param bool evidence_checked: whether the first chain-rule evaluation's
        log p(x) was (``check_evidence_tol``).
    :param torch.Tensor warm_centres: the converged posterior centres of that
        search, ``(n, K)`` (detached); with ``warm_start=True`` the next search
        of the same model on the same data and minibatch, with as many latent dims,
        starts there. The search runs to convergence, and the other modes are searched
        for again (the parameters may have moved another mode above the one tracked),
        so this changes the cost, not the value (to the Newton tolerance).
    :param bool modes_warned: whether the engine warned of other modes (once per engine).
    """

    run_mode: RunMemory = field(default_factory=RunMemory)
    warm_key: Optional[tuple] = None
    warm_centres: Optional[torch.Tensor] = None
    checked: bool = False
    evidence_checked: bool = False
    modes_warned: bool = False


# ---------------------------------------------------------------------- engine
class QuadratureConditionals(QuadratureLeaveOneOut, ConditionalEngine):
    r"""Masked conditionals by tensor-grid quadrature over low-dimensional latents.

    Serves Pyro models whose observed site is a factorized distribution over
    the tokens of each datapoint (``base.to_event(...)`` with a base that has no
    event dims: Bernoulli, Normal, Categorical, Poisson, Beta, ...) given
    continuous latents local to each datapoint with at most
    :data:`~pyro_mpt.conditionals.quadrature_rules.MAX_LATENT_DIM` dims in all.
    See the module docstring for the rules, the adaptive grid and the memory
    bound. What the engine remembers across calls (the run mode, the warm
    start) is its ``memory``, a :class:`QuadratureMemory`.

    :param int num_nodes: nodes per latent dimension (``Q = num_nodes ** K``);
        None picks :func:`~pyro_mpt.conditionals.quadrature_rules.default_num_nodes`.
    :param bool adaptive: centre and scale the grid on each datapoint's posterior
        given all its tokens (Laplace; the default, accurate with a few nodes per
        dim at any D); with False the grid is centred on the prior, which gives
        the exact conditionals for every context but needs hundreds of nodes per
        dim once the posterior is sharp.
    :param int newton_steps: Newton iterations for the Laplace centres.
    :param int init_nodes: nodes per dimension of the coarse grid that starts
        the adaptive Newton search (None: 7, 5, 3, 3 for K = 1..4).
    :param bool warm_start: start the adaptive search from the previous call's
        centres when the data (and the minibatch indices) are the same, as in
        full-batch SVI. The search runs to convergence and ends with a full
        Newton step and the Hessian at its end, so the same seed and inputs
        give the same number with and without a warm start (to 1e-10 in
        float64), unless the search did not converge in ``newton_steps`` (then
        it warns).
    :param float min_ess: raise when the posterior of some datapoint given all
        its tokens puts its mass on fewer than this many effective nodes, the
        sign that the grid is too coarse to resolve it; None disables the check.
    :param float ess_warning: warn (once per call) when the posterior of some
        datapoint has fewer than this many effective nodes along some grid axis
        (or fewer than ``ess_warning ** K`` in all), whatever ``adaptive``: the
        peak then falls between nodes and log p(x) can be off by nats (see
        :data:`~pyro_mpt.conditionals.quadrature_rules.RESOLVED_AXIS_ESS`, the
        default); None disables the warning.
    :param bool context_grids: with ``adaptive``, integrate each masked
        conditional on a grid of its own, centred and scaled on a Gaussian fit
        of the posterior given its *context*
        (:mod:`~pyro_mpt.conditionals.quadrature_contexts`; one more model run
        per node and query) instead of on the grid centred on the posterior
        given all tokens, which resolves contexts that leave out outlying or
        many tokens poorly (leave-one-out conditionals 0.57 nats off with the
        default 8 x 8 grid). :meth:`log_evidence` and the chain-rule sums use
        the full grid either way; :meth:`chain_log_prob`'s per-position terms are
        masks, on context grids where those are used.
    :param int target_grids: with context grids, a masked token whose numerator's
        Gaussian model (the context's plus the token's quadratic) its query's grid
        does not resolve gets a grid of its own, centred on that model (where one
        token is much more informative than its context); at most this many per
        query and datapoint (default 4), those the query's grid misses most: each
        costs a model run over all datapoints, and on a trained, informative model
        (a linear Bernoulli VAE) most tokens of a datapoint with many of them masked
        can ask one. 0 turns them off.
    :param float check_tol: on the engine's first conditionals (:meth:`mask_log_prob`,
        the ``"pll"`` table, or without context grids :meth:`chain_log_prob`'s first
        ordering), estimate their error (:meth:`mask_log_prob_error`, one more evaluation
        with the 2m/3- and, adaptive, (m-1)-node rules, once) and warn, naming the site, the largest
        estimate and ``num_nodes``, when it exceeds this many nats (default
        :data:`CHECK_TOL`, 1e-2; the estimate is conservative where measured, 1.4 to
        11 times the true error, but not a bound: 0.46 times on a one-token mixture-noise
        model); None: no check.
    :param float check_evidence_tol: with an adaptive grid, on the engine's first
        :meth:`chain_sums` (``masks="order"``), or :meth:`chain_log_prob` (curves along
        orderings) without context grids, estimate the error of the full grid's
        :math:`\log p(x_i)`, which they telescope to (:meth:`log_evidence_error`), and warn above this many nats
        (default :data:`CHECK_EVIDENCE_TOL`, 1e-3, as ``Evidence(method="quadrature")``);
        None: no check.
    :param bool check_modes: with an adaptive grid, look for a second mode of each
        datapoint's posterior beyond the grid's reach (one more Newton search per
        evaluation, from the best far node of the coarse starting grid; none on a warm
        start: see :meth:`~pyro_mpt.conditionals.laplace.LaplaceSearch.other_modes`), warn
        once per engine where it holds more than ``check_evidence_tol`` nats of
        :math:`\log p(x_i)`, and add its mass to :meth:`log_evidence_error` (the error
        estimates of coarser rules on the same centre do not see it).
    :param int max_latent_dim: refuse models with more latent dims than this.
    :param int cache_elements: keep the ``n x Q x D`` table, chunk by chunk from the
        first, up to this many entries (all of it when it has at most this many);
        stream the other chunks (each costs model runs at every pass: without and with
        a graph, and in the backward pass). The
        context grids' tables of one query block are kept with their graph when
        they fit in what the full table leaves of it, else each of their chunks is
        recomputed in the backward pass.
    :param int max_elements: entries per table chunk (``Q_c n D``) and per
        intermediate of the chain-rule path.
    :param int max_node_runs: for a model that does not broadcast over the
        node plate and so runs once per node, the most model runs one
        evaluation may make (:data:`~pyro_mpt.conditionals.quadrature_nodes.MAX_NODE_RUNS`
        by default: every default grid fits); a larger grid is refused before
        any run, naming the knobs.

    Example::

        >>> loss = MaskedPretrainingLoss(conditionals=QuadratureConditionals(adaptive=True))
        >>> svi = SVI(linear_vae, lambda x: None, Adam({"lr": 1e-2}), loss)
    """

    def __init__(
        self,
        num_nodes=None,
        *,
        adaptive=True,
        newton_steps=20,
        init_nodes=None,
        warm_start=True,
        min_ess=1.5,
        ess_warning=RESOLVED_AXIS_ESS,
        context_grids=True,
        target_grids=4,
        check_tol=CHECK_TOL,
        check_evidence_tol=CHECK_EVIDENCE_TOL,
        check_modes=True,
        max_latent_dim=MAX_LATENT_DIM,
        cache_elements=2**27,
        max_elements=2**24,
        max_node_runs=MAX_NODE_RUNS,
    ):
        super().__init__(max_elements=max_elements)
        for label, value in (("num_nodes", num_nodes), ("init_nodes", init_nodes)):
            if value is not None and not is_count(value):
                raise ValueError(
                    f"QuadratureConditionals({label}={value!r}): give a positive "
                    f"integer (nodes per latent dimension) or None for the default."
                )
        if not is_count(target_grids, minimum=0):
            raise ValueError(
                f"QuadratureConditionals(target_grids={target_grids!r}): give a non-negative "
                f"integer (numerators per query and datapoint that get grids of their own; "
                f"0 turns them off)."
            )
        if not 0 <= int(max_latent_dim) <= MAX_LATENT_DIM:
            raise ValueError(
                f"QuadratureConditionals(max_latent_dim={max_latent_dim}): tensor grids "
                f"support at most {MAX_LATENT_DIM} latent dims."
            )
        # numpy integers too (a grid of settings), kept as Python ints
        self.num_nodes = None if num_nodes is None else int(num_nodes)
        self.adaptive = bool(adaptive)
        self.newton_steps = int(newton_steps)
        self.init_nodes = None if init_nodes is None else int(init_nodes)
        self.warm_start = bool(warm_start)
        self.memory = QuadratureMemory()
        self.min_ess = min_ess
        self.ess_warning = ess_warning
        self.context_grids = bool(context_grids)
        self.target_grids = int(target_grids)
        self.check_tol = check_tol
        self.check_evidence_tol = check_evidence_tol
        self.check_modes = bool(check_modes)
        self.max_latent_dim = int(max_latent_dim)
        self.cache_elements = int(cache_elements)
        self.max_node_runs = int(max_node_runs)

    def __repr__(self):
        return (
            f"QuadratureConditionals(num_nodes={self.num_nodes}, adaptive={self.adaptive})"
        )

    # ------------------------------------------------------------------ prepare
    def prepare(self, tokens, model, guide, args, kwargs):
        layout, K = quadrature_layout(tokens)
        if K > self.max_latent_dim:
            sizes = ", ".join(f"{e.name!r}: {e.numel}" for e in layout.values())
            raise NotQuadratureError(
                f"conditionals='quadrature' uses tensor grids of num_nodes**K nodes and "
                f"supports at most K = {self.max_latent_dim} latent dims per datapoint; "
                f"the model of site {tokens.name!r} has K = {K} ({sizes}). Use "
                f"{ALTERNATIVES}."
            )
        check_factorized(
            tokens.site["fn"], tokens.name, "conditionals='quadrature'", NotQuadratureError,
            "for a Gaussian with latents use conditionals='gaussian'",
        )
        n, D = tokens.num_data, tokens.num_tokens
        dtype = latent_dtype(tokens)
        device = tokens.value.device
        runner = NodeRunner(tokens, model, args, kwargs, layout, self.memory.run_mode, self.max_node_runs)
        search = LaplaceSearch(self.newton_steps, self.max_elements, self.init_nodes)
        m = self.num_nodes or default_num_nodes(K, self.adaptive)
        e, log_w = gaussian_grid(m, K, dtype, device)
        runner.grid_nodes = e.shape[0]  # before any run: a model run per node refuses a larger grid up front
        all_normal = all(l.kind in ("normal", "mvn") for l in layout.values())

        frame = None
        prior_frame = None
        missing = None
        if K == 0:
            nodes = torch.zeros(1, 1, 0, dtype=dtype, device=device)
            log_W = torch.zeros(1, 1, dtype=dtype, device=device)
        elif all_normal and not self.adaptive:
            zero = torch.zeros(1, K, dtype=dtype, device=device)
            eye = torch.eye(K, dtype=dtype, device=device)[None]
            nodes, log_W = affine_grid(e, log_w, zero, eye)
        else:
            with torch.no_grad():
                if all_normal:
                    c0 = torch.zeros(1, K, dtype=dtype, device=device)
                    S0 = torch.eye(K, dtype=dtype, device=device)[None]
                else:
                    start = prior_start(tokens, layout, n, K, dtype, device)
                    c0, S0, _ = search.laplace(runner, start, include_lik=False)
                if self.adaptive:
                    start = self._warm_centre(tokens, model, n, K)
                    warm = start is not None
                    # the modes are searched for at every call: between two training steps the
                    # parameters may move another mode above the one a warm start tracks (a
                    # parameter from -2 to +2: -7.62 for -3.15, no warning, when a warm call
                    # kept the first call's search)
                    coarse = search.coarse_grid(runner, c0, S0, K, n) if not warm or self.check_modes else None
                    if start is None:
                        start = search.best_node(runner, c0, S0, K, n, coarse)
                    c, S, converged = search.laplace(runner, start, include_lik=True)
                    if not bool(converged.all()):
                        bad = int((~converged).sum())
                        warnings.warn(
                            f"QuadratureConditionals: the Newton search for the posterior "
                            f"modes of site {tokens.name!r} did not converge in "
                            f"newton_steps={self.newton_steps} steps for {bad} of {n} "
                            f"datapoint(s). The adaptive rule is still valid, but its "
                            f"value now depends on where the search started (a warm "
                            f"start from the previous call gives another number); raise "
                            f"newton_steps.",
                            RuntimeWarning,
                            stacklevel=user_stacklevel(),
                        )
                    if self.check_modes:
                        # beyond the rule's outermost node (a 50-node rule reaches 13 sds)
                        log_ratio, other, S2 = search.other_modes(runner, c, S, coarse, reach=float(e.abs().max()))
                        # the grid on the larger of the two modes (a search that ended at the
                        # smaller one left out 2.1 nats where the larger leaves 0.13)
                        larger = log_ratio > 0
                        c = torch.where(larger.unsqueeze(-1), other, c)
                        S = torch.where(larger[:, None, None], S2, S)
                        missing = torch.nn.functional.softplus(-log_ratio.abs())
                        self._warn_other_modes(tokens, missing)
                    self._remember_centre(tokens, model, c)
                else:
                    c, S = c0, S0
                nodes, log_W = affine_grid(e, log_w, c, S)
                frame = (c, S, e, log_w) if self.adaptive else None
                prior_frame = None if all_normal or not self.adaptive else (c0, S0)

        def on_grid(nodes, log_W, frame, missing):
            Q = nodes.shape[1]
            node_chunk = max(1, self.max_elements // max(1, n * D))
            state = QuadratureState(
                nodes=nodes.detach(),
                log_weights=log_W.detach(),
                num_data=n,
                num_tokens=D,
                node_chunk=node_chunk,
                runner=runner,
                frame=frame,
                prior_frame=prior_frame,
                missing_mass=missing,
            )
            slices = state.slices()
            # as many leading chunks as cache_elements holds are kept with their graph; the
            # rest stream (a kept chunk saves its model run in every later pass and in the
            # backward pass, so the cost falls smoothly as the cache grows)
            keep = len(slices) if Q * n * D <= self.cache_elements else self.cache_elements // max(1, node_chunk * n * D)
            if keep > 0:
                state.chunks = [state.compute_chunk(sl) for sl in slices[:keep]]
            return state

        state = on_grid(nodes, log_W, frame, missing)
        Q = nodes.shape[1]
        if frame is not None and self.check_modes and Q > 1 and state.streamed_slices() == []:
            moved = self._unresolved_to_larger_mode(state, search, coarse, missing)
            if moved is not None:
                frame, missing = moved
                self._remember_centre(tokens, model, frame[0])
                state = on_grid(*affine_grid(e, log_w, *frame[:2]), frame, missing)
        if Q > 1:  # the effective nodes' checks, and the NaN check that is always made
            if state.streamed_slices() == []:
                with torch.no_grad():
                    self._check_ess(state, torch.cat([c.joint() for c in state.chunks], -1))
            else:
                # streamed: checked on the first pass over the table (no extra pass)
                state.ess_pending = True
        return state

    def _warm_key(self, tokens, model):
        subsample = tuple(
            site["value"] for site in tokens.subsample_trace().nodes.values()
        )
        return callable_key(model), tokens.value, subsample

    def _warm_centre(self, tokens, model, n, K):
        """The last posterior centres when the model, the data (and minibatch) and the
        number of latent dims are the same (another model on the same data crashed on the
        last centres' shape, or started from the wrong posterior's)."""
        memory = self.memory
        if not self.warm_start or memory.warm_centres is None or memory.warm_centres.shape != (n, K):
            return None
        key, x, sub = memory.warm_key
        key_new, x_new, sub_new = self._warm_key(tokens, model)
        same = (
            key == key_new
            and x.shape == x_new.shape
            and x.dtype == x_new.dtype
            and len(sub) == len(sub_new)
            and all(a.shape == b.shape and bool(torch.equal(a, b)) for a, b in zip(sub, sub_new))
            and bool(torch.equal(x, x_new))
        )
        return memory.warm_centres if same else None

    def _remember_centre(self, tokens, model, centre):
        if self.warm_start:
            key, x, sub = self._warm_key(tokens, model)
            self.memory.warm_key = (key, x.detach().clone(), tuple(t.clone() for t in sub))
            self.memory.warm_centres = centre.detach()

    def _unresolved_to_larger_mode(self, state, search, coarse, missing):
        """Where the grid does not resolve a datapoint's posterior (fewer than
        ``RESOLVED_AXIS_ESS`` effective nodes along an axis), look for a larger mode nearer
        than the rule's outermost node too, and take it: the second-mode search looks only
        beyond that reach, and a mode of 250 times the mass 9.3 sds from the one the Newton
        search ended at lay within a 32-node rule's reach (10 sds) but between its sparse
        outer nodes (a tanh VAE, K = 1: refused as "too coarse", 1.37 effective nodes).
        Resolved datapoints keep their grid. Returns the new ``(frame, missing)`` or None."""
        c, S, e, log_w = state.frame
        with torch.no_grad():
            joints = torch.cat([chunk.joint() for chunk in state.chunks], -1)
            _, axis = effective_nodes(joints, state.latent_dim)
            low = axis.amin(-1) < RESOLVED_AXIS_ESS
            if not bool(low.any()):
                return None
            log_ratio, other, S2 = search.other_modes(state.runner, c, S, coarse)
            larger = low & (log_ratio > 0)
            if not bool(larger.any()):
                return None
            c2 = torch.where(larger.unsqueeze(-1), other, c)
            S2 = torch.where(larger[:, None, None], S2, S)
            # the mode left behind: its mass is out of the new grid where beyond its outermost node
            apart = torch.linalg.solve(S2, (c - c2).unsqueeze(-1)).squeeze(-1).norm(dim=-1)
            left = torch.nn.functional.softplus(-log_ratio.abs())
            left = torch.where(apart > float(e.abs().max()), left, torch.zeros_like(left))
            base = torch.zeros_like(left) if missing is None else missing.to(left.dtype)
            missing = torch.where(larger, left, base)
        self._warn_other_modes(state.runner.tokens, missing)
        return (c2, S2, e, log_w), missing

    def _warn_other_modes(self, tokens, missing):
        """Warn, once per engine, where the grid leaves out another mode's mass above
        ``check_evidence_tol`` (or :data:`CHECK_EVIDENCE_TOL`)."""
        tol = CHECK_EVIDENCE_TOL if self.check_evidence_tol is None else self.check_evidence_tol
        worst = float(missing.max())
        if self.memory.modes_warned or not worst > tol:
            return
        self.memory.modes_warned = True
        i = int(missing.argmax())
        warnings.warn(QuadratureAccuracyWarning(
            f"QuadratureConditionals: the posterior of the latents of site {tokens.name!r} given all "
            f"tokens has a second mode beyond the adaptive grid's reach for "
            f"{int((missing > tol).sum())} of {missing.numel()} datapoint(s); the grid is centred on "
            f"one mode, so log p(x) and the conditionals leave out about {worst:.3g} nats "
            f"(datapoint {i}; the Laplace masses of the two modes found: more modes leave out more), "
            f"and more nodes do not help. Use "
            f"method='importance' (Evidence) or conditionals='importance' with a guide that covers "
            f"the modes, or adaptive=False with nodes enough to resolve each mode (num_nodes=...); "
            f"check_modes=False skips this search.",
            site=tokens.name, error=worst),
            stacklevel=user_stacklevel(),
        )

    def _reduce(self, state, reducer, *inputs):
        return state.reduce(reducer, *inputs, check_ess=self._check_ess)

    def _check_ess(self, state, lj):
        """Effective number of nodes of each posterior given all tokens, in all
        and per grid axis, from the per-node log joints ``lj`` ``(n, Q)``; raise
        when below ``min_ess``, warn when below ``ess_warning``; raise where a log joint
        is NaN (every estimate would be NaN)."""
        K = state.latent_dim
        m = state.nodes_per_dim
        hint = (
            "use more nodes per dimension (num_nodes=...)"
            if self.adaptive
            else "use adaptive=True (the grid then follows each posterior) or more nodes (num_nodes=...)"
        )
        grid = f"{state.num_nodes} nodes ({m} per latent dim{', adaptive' if self.adaptive else ', prior-centred'})"
        name = state.runner.tokens.name
        nan = torch.isnan(lj)
        if bool(nan.any()):
            # e.g. a Poisson rate exp(4 z + 3) at the outer nodes of a prior-centred float32 grid:
            # inf - inf in its log-density, and NaN scores with no word why
            raise ValueError(
                f"QuadratureConditionals: the log-density of site {name!r} is NaN at "
                f"{int(nan.any(0).sum())} of the grid's {state.num_nodes} nodes, for "
                f"{int(nan.any(-1).sum())} of {state.num_data} datapoints (in {lj.dtype}): the "
                f"observation's parameters overflow or are undefined at those latent values; "
                f"{hint.replace('or more nodes', 'or fewer nodes')}, or compute in float64."
            )
        if self.min_ess is None and self.ess_warning is None:
            return
        with torch.no_grad():
            ess, axis_ess = effective_nodes(lj, state.latent_dim)
        state.ess, state.axis_ess = ess, axis_ess
        if self.min_ess is not None:
            low = ess < self.min_ess
            if bool(low.any()):
                worst = int(ess.argmin())
                raise ValueError(
                    f"QuadratureConditionals: the grid of {grid} is too "
                    f"coarse for site {name!r}: the posterior of {int(low.sum())} of "
                    f"{state.num_data} datapoints given their D={state.num_tokens} tokens "
                    f"sits on fewer than min_ess={self.min_ess} effective nodes (datapoint "
                    f"{worst}: {float(ess[worst]):.3g}), so the integrals are not resolved; "
                    f"{hint}, or pass min_ess=None to skip this check."
                )
        if self.ess_warning is not None and K > 0:
            per_axis = axis_ess.amin(-1)
            low = (per_axis < self.ess_warning) | (ess < self.ess_warning**K)
            if bool(low.any()):
                worst = int(per_axis.argmin())
                warnings.warn(
                    f"QuadratureConditionals: the grid of {grid} does not resolve the "
                    f"posterior of site {name!r} for {int(low.sum())} of {state.num_data} "
                    f"datapoints: it sits on fewer than {self.ess_warning:g} effective "
                    f"nodes along some latent axis (datapoint {worst}: "
                    f"{float(per_axis[worst]):.3g}), so log p(x) and the conditionals "
                    f"can be off by nats; {hint}.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )

    # ------------------------------------------------------------------ queries
    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        self._check_first_conditionals(state, x, mask)
        ctx = (~mask).to(state.nodes.dtype)
        if self._uses_context_grids(state):
            return self._context_log_prob(state, mask)
        num, den = self._reduce(state, MixtureChunk.mask_partials, ctx)
        # the prior integrates to one: an empty context has normalizer exactly 1
        return num - normalize_empty(den, ~mask).unsqueeze(-1)

    def _check_first_conditionals(self, state, x, mask):
        """The engine's first conditionals' check (:meth:`_check_conditionals`), on every
        grid: a prior-centred grid's effective nodes missed a bimodal posterior whose
        two sharp modes sat on a node each (leave-one-out conditionals 0.8 nats off,
        silently), and the one-mixture conditionals of ``context_grids=False`` had no
        check at all (3.9 nats off)."""
        if self.check_tol is None or self.memory.checked:
            return
        self.memory.checked = True  # before the check, which calls mask_log_prob again
        with not_recomputed():  # once per engine: a recomputed block's second run does not make it
            self._check_conditionals(state, x, mask)

    def _check_conditionals(self, state, x, mask):
        """Warn once per engine when the first evaluation's conditionals are estimated
        to be off by more than ``check_tol``."""
        try:
            err = self.mask_log_prob_error(state, x, mask)
        except NotQuadratureError:  # a model run one node at a time past max_node_runs: no check
            return
        self._warn_if_inaccurate(state, err, int(mask.expand_as(err).sum()))

    def _warn_if_inaccurate(self, state, err, count):
        worst = float(err.max())
        if worst > self.check_tol:
            m = state.nodes_per_dim
            bad = int((err > self.check_tol).sum())
            warnings.warn(QuadratureAccuracyWarning(
                f"QuadratureConditionals: the masked conditionals of site {state.runner.tokens.name!r} "
                f"are estimated to be off by up to {worst:.3g} nats ({bad} of {count} "
                f"conditionals of the first evaluation above check_tol={self.check_tol:g}; the difference "
                f"to the rules with {' and '.join(str(r) for r in self._error_rules(state))} nodes per dim) "
                f"with {m} nodes per latent dim. "
                f"Use more nodes (num_nodes=...); check_tol=None skips this check.",
                site=state.runner.tokens.name, error=worst),
                stacklevel=user_stacklevel(),
            )

    def _context_log_prob(self, state, mask):
        """:meth:`mask_log_prob` with context grids where the full grid does not resolve
        a query (see :mod:`~pyro_mpt.conditionals.quadrature_contexts`)."""
        n, D = state.num_data, state.num_tokens
        target = mask.expand(mask.shape[0], n, D)
        ctx = (~target).to(state.nodes.dtype)
        c, S, e, log_w = state.frame
        with torch.no_grad():
            quad = self._quadratics(state)
            h, P, C = context_models(quad, ctx)
            full = full_frames(quad, h, P, C)
            # a query whose context's Gaussian the full grid resolves (e.g. most
            # leave-one-out contexts) keeps it: no model run; the numerators' integrands
            # lie between that posterior and the full one, which the grid is built for
            own = ~full_grid_resolves(quad, full, state.nodes_per_dim, self.max_elements)  # (q,)
        # the corrections from the projection with the table's graph, on the grids fitted without it
        graded = self._graded_quadratics(state)
        models = context_models(graded, ctx) if graded is not quad else (h, P, C)
        kept = (~own).nonzero().squeeze(-1)
        rows = own.nonzero().squeeze(-1)
        parts = []
        if kept.numel() > 0:
            dnum, dden = gaussian_corrections(graded, with_models(full, *models), target, e, log_w, self.max_elements)
            num, den = self._reduce(state, MixtureChunk.mask_partials, ctx[kept])
            parts.append((kept, num + dnum[kept].to(num.dtype), den + dden[kept].to(den.dtype), dnum[kept]))
        if rows.numel() > 0:
            with torch.no_grad():
                frames = context_frames(quad, h[rows], P[rows], C[rows], c, S)
            frames = with_models(frames, *(t[rows] for t in models))
            dnum, dden = gaussian_corrections(graded, frames, target[rows], e, log_w, self.max_elements)
            num, den = context_partials(
                state.runner, e, log_w, frames.centre, frames.sqrt_cov, ctx[rows], self.max_elements,
                # one cache for both tables: what the full one keeps, the context ones cannot
                keep_elements=self.cache_elements - len(state.chunks or ()) * state.node_chunk * n * D,
            )
            parts.append((rows, num + dnum.to(num.dtype), den + dden.to(den.dtype), dnum))
        if len(parts) == 1:
            _, num, den, dnum = parts[0]
        else:
            order = torch.argsort(torch.cat([kept, rows]))
            num, den, dnum = (torch.cat([parts[0][k], parts[1][k]])[order] for k in (1, 2, 3))
        num = self._target_grids(state, quad, (h, P, C), own, target, ctx, num, dnum, graded, models)
        # the prior integrates to one: an empty context has normalizer exactly 1
        return num - normalize_empty(den, ~target).unsqueeze(-1)

    def _target_grids(self, state, quad, models, own, target, ctx, num, dnum, graded, graded_models):
        """Numerators that the grid of their context does not resolve, each on a grid
        of its own (:func:`~pyro_mpt.conditionals.quadrature_contexts.unresolved_targets`);
        ``dnum`` are the numerators' corrections on their queries' grids; ``models`` the
        contexts' ``(h, P, C)`` (:func:`~pyro_mpt.conditionals.quadrature_contexts.context_models`);
        ``graded`` and ``graded_models`` the same with the table's graph (the corrections')."""
        h, P, C = models
        c, S, e, log_w = state.frame
        n, D = state.num_data, state.num_tokens
        dnum = dnum.detach()
        with torch.no_grad():
            if state.nodes_per_dim <= KEEP_RULE_NODES:
                # the test's rule is the grid's own: its corrections are at hand
                bad = target & (dnum.abs() > resolved_tol(dnum.dtype))
            else:
                frames = full_frames(quad, h, P, C)
                if bool(own.any()):
                    fitted = context_frames(quad, h[own], P[own], C[own], c, S)
                    for name in ("shift", "root"):
                        value = getattr(frames, name).clone()
                        value[own] = getattr(fitted, name)
                        setattr(frames, name, value)
                bad = unresolved_targets(quad, frames, target, state.nodes_per_dim, self.max_elements)
            if bool(bad.any()):
                # where the prior and every token are quadratic (e.g. PPCA) the corrections on
                # the query's grid are exact: a grid of its own, a model run per target, adds
                # nothing; asked only now, since it is a second pass over the table, and once
                bad &= ~quad.gaussian_rows(bad.any(2).any(0), e, log_w, state.detached_parts())[None, :, None]
            a, i, j = bad.nonzero(as_tuple=True)
            if a.numel() == 0:
                return num
            # at most target_grids per query and datapoint, those whose Gaussian models the
            # query's grid misses most: a grid costs a model run over all datapoints, and a
            # datapoint of a trained, informative model with many masked tokens can have
            # nearly all of them unresolved (a trained linear VAE, float64, up to 16 a
            # datapoint: 4.7 s a step, 2.4 s with 4 a query at the same mean error per
            # datapoint, 1.5e-3 nats; 1.7 s with 2, 1.65e-3; Bernoulli loadings of scale 3:
            # 19.4 s, 1.3 s with 4). Ranked on a log scale of 1/16 octave, then in token
            # order, so that rounding (the chunking) does not reorder near-equal ones; per
            # query, so that how the queries are split into blocks does not matter
            miss = torch.floor(16 * torch.log2(dnum[a, i, j].abs().double()))
            first = torch.argsort(miss, descending=True, stable=True)
            first = first[torch.argsort((a * n + i)[first], stable=True)]
            rank, _ = _ranks_in_groups((a * n + i)[first], num.shape[0] * n)
            first = first[rank < self.target_grids]
            if first.numel() == 0:
                return num
            # each kept target takes a slot of a (B, n) batch in its datapoint's column, so
            # that one model run over the n datapoints serves B targets of each: B is the
            # most any one datapoint has, not the number of distinct (query, target) pairs
            by_row = first[torch.argsort(i[first], stable=True)]
            a, i, j = a[by_row], i[by_row], j[by_row]
            slot, count = _ranks_in_groups(i, n)
            B = int(count.max())
            # a slot no target takes holds query 0 and token 0 of its datapoint, made and unread
            A = torch.zeros(B, n, dtype=torch.long, device=num.device)
            J = torch.zeros(B, n, dtype=torch.long, device=num.device)
            A[slot, i] = a
            J[slot, i] = j
            rows = torch.arange(n, device=num.device).expand(B, n)
            # the numerator's Gaussian model: the context's plus the target's quadratic
            hj = h[A, rows] + quad.grad[rows, J]
            Cj = C[A, rows] + quad.hess[rows, J]
            tf = context_frames(quad, hj, model_precision(quad, Cj), Cj, c, S)
            one = torch.zeros(B, n, D, dtype=torch.bool, device=num.device)
            one[slot, i, j] = True
        # centred on the numerator; the corrections add target j's quadratic to the context's
        hg, Pg, Cg = graded_models
        tf_models = with_models(tf, hg[A, rows], Pg[A, rows], Cg[A, rows])
        tdnum, _ = gaussian_corrections(graded, tf_models, one, e, log_w, self.max_elements)
        tnum, _ = context_partials(
            state.runner, e, log_w, tf.centre, tf.sqrt_cov, ctx.expand(-1, n, D)[A, rows], self.max_elements,
            keep_elements=self.cache_elements - len(state.chunks or ()) * state.node_chunk * n * D, targets=J,
        )
        out = num.clone()
        out[a, i, j] = tnum[slot, i] + tdnum[slot, i, j].to(tnum.dtype)
        return out

    def _uses_context_grids(self, state):
        # the projection onto quadratics is exact only with at least 3 nodes per dim
        return self.context_grids and state.frame is not None and state.nodes_per_dim >= 3

    def _graded_quadratics(self, state):
        """:meth:`_quadratics` with the table's graph where it has one (its gradient is that of
        the Gaussian corrections), else the same object; once per state."""
        if not state.has_graph():
            return self._quadratics(state)
        if state.graded_quadratics is None:
            quad = self._quadratics(state)
            _, _, e, log_w = state.frame
            # kept on the state for later blocks: made outside a recomputed block's count
            with not_recomputed():
                graded = token_quadratics(e, log_w, state.graded_parts())
            # the prior's quadratic as the detached projection has it: the standard normal's
            # (whitened normal latents, fixed), or its Laplace quadratic (see _quadratics),
            # held fixed; and that projection's verdict on finite rows
            graded.prior_grad, graded.prior_hess, graded.finite = quad.prior_grad, quad.prior_hess, quad.finite
            state.graded_quadratics = graded
        return state.graded_quadratics

    def _quadratics(self, state):
        """The table's projection onto quadratics, once per state (one more pass over a
        streamed table, which also runs its pending effective-nodes check)."""
        if state.quadratics is None:
            joints = []

            def parts():
                for sl, log_prior, T in state.detached_parts():
                    if state.ess_pending:
                        joints.append(log_prior + state.log_weights[:, sl].to(T.dtype) + T.sum(-1))
                    yield sl, log_prior, T

            _, _, e, log_w = state.frame
            state.quadratics = token_quadratics(e, log_w, parts())
            if state.prior_frame is not None:
                # the prior's own Laplace quadratic, not its projection on the full grid: far
                # from its mode a heavy-tailed prior's log-density is nearly flat in u, and a
                # context of few tokens extrapolated from there was centred far off (HalfCauchy
                # scale, exhaustive MPT 9e-2 nats off; 8e-5 with this)
                c, S = state.frame[:2]
                grad, hess = prior_quadratic(c, S, *state.prior_frame)
                quad = state.quadratics
                quad.prior_grad = grad.to(quad.grad.dtype).expand_as(quad.prior_grad)
                quad.prior_hess = hess.to(quad.grad.dtype).expand_as(quad.prior_hess)
            if state.ess_pending:
                state.ess_pending = False
                self._check_ess(state, torch.cat(joints, -1))
        return state.quadratics

    def companion(self, state, num_nodes):
        r"""The same rule with ``num_nodes`` nodes per latent dim, for error estimates.

        It reuses this engine's options and (adaptive grids) its converged
        centres, so only the number of nodes differs; it neither raises nor
        warns about its effective nodes.

        :returns: ``(engine, state)`` for the same tokens.
        """
        opts = dict(
            adaptive=self.adaptive,
            newton_steps=self.newton_steps,
            init_nodes=self.init_nodes,
            warm_start=self.warm_start,
            min_ess=None,
            ess_warning=None,
            context_grids=self.context_grids,
            check_tol=None,
            check_evidence_tol=None,
            check_modes=False,
            max_latent_dim=self.max_latent_dim,
            cache_elements=self.cache_elements,
            max_elements=self.max_elements,
            max_node_runs=self.max_node_runs,
        )
        engine = QuadratureConditionals(int(num_nodes), **opts)
        engine.memory = QuadratureMemory(self.memory.run_mode, self.memory.warm_key, self.memory.warm_centres)
        runner = state.runner
        with torch.no_grad():
            other = engine.prepare(runner.tokens, runner.model, None, runner.args, runner.kwargs)
        return engine, other

    def mask_log_prob_error(self, state, x, mask, error_nodes=None):
        r"""Error estimate of :meth:`mask_log_prob`, per query and target, ``(q, n, D)``.

        .. math::

            \hat\epsilon_{j} = \max_{m'} \big|\log \hat p_m(x_j \mid x_{\mathcal R})
              - \log \hat p_{m'}(x_j \mid x_{\mathcal R})\big|,

        the largest difference to the same rule with :math:`m'` nodes per dim
        on the same centres: ``error_nodes``, or by default ``max(1, 2 m // 3)``
        and, for adaptive grids, :math:`m - 1`, as ``Evidence(method="quadrature")``
        does for :math:`\log p(x)`. An
        adaptive grid is centred on each posterior given *all* tokens, so the
        conditionals given few or unusual contexts converge more slowly in
        :math:`m` than :math:`\log p(x)`; this estimates their error (it
        assumes the finer rule is the more accurate; it is not a bound).
        Entries that are not targets are 0. It costs a table with
        :math:`m'^K` nodes per rule.

        :param state: from :meth:`prepare`.
        :param torch.Tensor x: the tokens of the state.
        :param torch.Tensor mask: target masks ``(q, n, D)`` or ``(q, 1, D)``.
        :param int error_nodes: nodes per dim of the second rule.

        Example::

            >>> lp = engine.mask_log_prob(state, x, mask)
            >>> err = engine.mask_log_prob_error(state, x, mask)  # same shape
        """
        # two rules can agree by chance (a leave-one-out error 11 times the 2m/3
        # difference, 6e-6 against 5e-7); two pairs rarely do, as in Evidence
        rules = self._error_rules(state) if error_nodes is None else [int(error_nodes)]
        with torch.no_grad():
            fine = self.mask_log_prob(state, x, mask)
            err = torch.zeros_like(fine)
            for nodes in rules:
                engine, other = self.companion(state, nodes)
                err = torch.maximum(err, (fine - engine.mask_log_prob(other, x, mask)).abs())
        return torch.where(mask.expand_as(err), err, torch.zeros_like(err))

    def chain_log_prob(self, state, x, order):
        self._check_x(state, x)
        if self._uses_context_grids(state):
            # a position's term is a conditional given the tokens after it, wider the later
            # it comes: one mixture's terms there were 0.4-0.7 nats off (curves along
            # orderings, Gamma and Poisson tokens) while they telescope to log p(x). As masks,
            # they get the context grids and the first evaluation's error check
            return super().chain_log_prob(state, x, order)
        self._check_evidence(state, x)
        if self.check_tol is not None and not self.memory.checked:
            # the terms are the one mixture's conditionals: checked on the first ordering's masks
            positions = torch.arange(x.shape[-1], device=order.device)
            self._check_first_conditionals(state, x, ordering_ranks(order[:1]) <= positions[:, None, None])
        (L,) = self._reduce(state, lambda c, o: (c.chain_partials(o, self.max_elements),), order)
        # the prior integrates to one: the empty context (last entry) has normalizer 1
        return chain_terms(L)

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: all equal to :meth:`log_evidence`.

        The conditionals are ratios of one mixture measure, so every ordering's
        terms telescope to :math:`\log \sum_q \omega_q \prod_d p(x_d\mid z_q)`
        (the empty context has normalizer one); this returns that value, at the
        cost of one pass over the table instead of ``p``. Missing tokens
        (``observed``, the state's ``tokens.observed``) have factor one in the
        table, so the value is already :math:`\log p(x_{O_i})`.
        """
        self._check_x(state, x)
        self._check_evidence(state, x)
        return self.log_evidence(state, x).expand(order.shape[0], -1)

    def _error_rules(self, state):
        """Nodes per dim of the coarser rules the error estimates compare with: 2m/3, and
        m - 1 for adaptive grids (two rules can agree by chance; two pairs rarely do)."""
        m = state.nodes_per_dim
        rules = [max(1, (2 * m) // 3)]
        if self.adaptive and m - 1 > rules[0]:
            rules.append(m - 1)
        return rules

    def log_evidence_error(self, state, x):
        r"""Error estimate of :meth:`log_evidence`, per datapoint, ``(n,)``.

        .. math::

            \hat\epsilon = \max_{m'} \big|\log\hat p_m(x) - \log\hat p_{m'}(x)\big|
              + 8\varepsilon(|\log\hat p_m(x)| + 1),

        over the rules with :math:`m' = 2m/3` and (adaptive grids) :math:`m - 1` nodes per
        dim on the same centres, :math:`\varepsilon` the dtype's epsilon: the estimate of
        ``Evidence(method="quadrature")`` for adaptive grids. It assumes the finer rule is
        the more accurate; it is not a bound.

        :param state: from :meth:`prepare`.
        :param torch.Tensor x: the tokens of the state.
        :returns: ``(n,)``.

        Example::

            >>> err = engine.log_evidence_error(state, x)   # (n,)
        """
        err, rounding = self._evidence_error_parts(state, x)
        return err + rounding

    def _evidence_error_parts(self, state, x):
        """:meth:`log_evidence_error` as its two parts, ``(rules, rounding)`` ``(n,)`` each: the
        rules' differences (with another mode's mass), which more nodes lower, and
        :func:`rule_rounding`, which they cannot."""
        with torch.no_grad():
            value = self.log_evidence(state, x)
            err = torch.zeros_like(value)
            for nodes in self._error_rules(state):
                engine, other = self.companion(state, nodes)
                err = torch.maximum(err, (value - engine.log_evidence(other, x)).abs())
            if state.missing_mass is not None:
                err = err + state.missing_mass.to(err.dtype)
            return err, rule_rounding(value)

    def _check_evidence(self, state, x):
        """Warn once per engine when the first chain-rule evaluation's log p(x) is
        estimated to be off by more than ``check_evidence_tol``."""
        tol = self.check_evidence_tol
        if tol is None or self.memory.evidence_checked or not self.adaptive or state.latent_dim == 0:
            return
        self.memory.evidence_checked = True
        try:
            # once per engine: a recomputed block's second run does not make it
            with not_recomputed():
                moved, rounding = self._evidence_error_parts(state, x)
        except NotQuadratureError:  # a model run one node at a time past max_node_runs: no check
            return
        err = moved + rounding
        worst = float(err.max())
        if bool((moved > tol).any()):
            rules = " and ".join(str(r) for r in self._error_rules(state))
            warnings.warn(QuadratureAccuracyWarning(
                f"QuadratureConditionals: log p(x) of site {state.runner.tokens.name!r}, which the "
                f"chain rule along orderings sums to, is estimated to be off by up to {worst:.3g} nats "
                f"({int((moved > tol).sum())} of {err.numel()} datapoints of the first evaluation above "
                f"check_evidence_tol={tol:g}; the difference to the rules with {rules} nodes per dim) "
                f"with {state.nodes_per_dim} nodes per latent dim. Use more nodes (num_nodes=...); "
                f"check_evidence_tol=None skips this check.",
                site=state.runner.tokens.name, error=worst),
                stacklevel=user_stacklevel(),
            )

    def log_evidence(self, state, x):
        r""":math:`\log \sum_q \omega_q \prod_d p(x_d \mid z_q)` per datapoint, ``(n,)``."""
        self._check_x(state, x)
        (lse,) = self._reduce(state, lambda c: (stable_logsumexp(c.joint(), -1),))
        return lse
