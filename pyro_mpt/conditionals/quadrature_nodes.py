r"""The quadrature engine's model runs: latents at grid nodes, token log-likelihoods out.

The nodes live in coordinates :math:`u \in \mathbb R^K` in which each latent
is generated from its (conditional) prior (see
:mod:`~pyro_mpt.conditionals.quadrature`): Normal and MultivariateNormal
latents are :math:`z = \mu + L u`, other continuous latents (scalar, or on a
support such as a ``Dirichlet``'s simplex) :math:`z = T(u)` with :math:`T` =
``biject_to(support)``. :class:`NodeRunner`
runs the model once per chunk of nodes in the plate ``_mpt_nodes`` with every
latent set to its node values (or, for a model that does not broadcast over
that plate, once per node without it: :data:`RUN_MODES`), and returns the prior log-density of the nodes
in :math:`u`, :math:`\log \pi(u)`, with the table
:math:`T_{qd} = \log p(x_d \mid z_q)`.
"""


import warnings

import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)
import pyro.distributions as dist
from torch.distributions import biject_to

from ..observed_tokens import check_local_latent
from .base import EngineNotApplicable, SlowEngineWarning
from .distributions import token_log_prob, unwrap
from .plate_runs import (CoordinateLatents, RunMemory, agrees_with_point_run, latent_layout, probe_coordinates, reaches_points,
                         run_in_plate, run_with_fallback)
from ..code_origin import user_stacklevel
from ..model_keys import callable_key

__all__ = ["NotQuadratureError", "quadrature_layout", "prior_start", "NodeRunner", "latent_dtype", "NODE_PLATE",
           "ALTERNATIVES", "RUN_MODES", "MAX_NODE_RUNS", "PRIOR_START_DRAWS"]

#: the plate the nodes run in
NODE_PLATE = "_mpt_nodes"
#: the engines named when quadrature cannot serve a model
ALTERNATIVES = "conditionals='importance' or 'encode_decode'"
#: how :class:`NodeRunner` runs the model, most preferred first: in the node
#: plate with the latents' shared parameters at size one (``"compact"``) or
#: expanded to full batch shape (``"full"``), or once per node without the
#: plate, its latents at their traced shapes (``"per_node"``; exact, but one
#: model run per node)
RUN_MODES = ("compact", "full", "per_node")
#: the most model runs one evaluation (a ``prepare`` and its queries) may make one node at
#: a time (mode ``"per_node"``): the largest default grid (4096 nodes, K = 3 or 4 on the
#: prior) with room for the adaptive search; beyond it :class:`NodeRunner` refuses the model
#: before running it (``max_node_runs=`` of the engine)
MAX_NODE_RUNS = 8192


#: prior draws per transformed latent whose median starts the search for the prior's mode
PRIOR_START_DRAWS = 64


def prior_start(tokens, layout, n, K, dtype, device, draws=PRIOR_START_DRAWS):
    r"""Where the search for the prior's mode in the node coordinates starts, ``(n, K)``.

    Normal latents' coordinates are standardized (their prior mode is 0); a
    transformed latent's, :math:`u = T^{-1}(z)`, start at the median of
    :math:`T^{-1}` over ``draws`` draws of its traced prior (one value per
    site). From 0, a prior whose unconstrained mode is far away, with a curvature
    that grows exponentially towards it, sent Newton's method off the float
    range: an ``InverseGamma(3, 2e-4)`` variance (data in units of 0.01) has its
    mode at :math:`\log(b/a) = -9.6` and curvature :math:`2\cdot10^{-4}` at
    0, and the search ended at :math:`u = -388`, where the log-density is not
    finite, and the model was refused.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param dict layout: ``{name: LatentSlice}`` (:func:`quadrature_layout`).
    :param int n: datapoints.
    :param int K: coordinates.
    :param int draws: prior draws per transformed latent.
    :returns: ``(n, K)``.

    Example::

        >>> layout, K = quadrature_layout(tokens)
        >>> start = prior_start(tokens, layout, tokens.num_data, K, torch.float64, None)
    """
    u = torch.zeros(n, K, dtype=dtype, device=device)
    for sl in layout.values():
        if sl.kind != "transform":
            continue
        fn = tokens.model_trace.nodes[sl.name]["fn"]
        try:
            # the caller's random stream is left as it was (the masks drawn after it)
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if torch.device(device or "cpu").type == "cuda" else []):
                v = biject_to(fn.support).inv(fn.sample((draws,)))
        except NotImplementedError:  # no sampler or no bijection: start at 0 as before
            continue
        v = v[torch.isfinite(v)]
        if v.numel():
            u[:, sl.offset : sl.offset + sl.numel] = v.to(dtype).median()
    return u


class NotQuadratureError(EngineNotApplicable):
    """The model is outside what tensor-grid quadrature serves."""


def quadrature_layout(tokens):
    """Check the latent sites; give each a slice of the node coordinates.

    :returns: ``(layout, K)`` (see :func:`~pyro_mpt.conditionals.plate_runs.latent_layout`),
        each latent of kind ``"normal"``, ``"mvn"`` or ``"transform"``.
    :raises NotQuadratureError: naming the site the rule cannot cover.
    """
    return latent_layout(tokens, lambda site: _latent_kind(tokens, site))


def _latent_kind(tokens, site):
    name = site["name"]
    fn = site["fn"]
    base, _ = unwrap(fn)
    kind_name = type(base).__name__
    try:
        discrete = fn.support.is_discrete
    except NotImplementedError:  # a dependent support: decided by biject_to below
        discrete = False
    if discrete or getattr(base, "has_enumerate_support", False):
        raise NotQuadratureError(
            f"conditionals='quadrature' integrates continuous latents; latent site "
            f"{name!r} is discrete ({kind_name}). conditionals='enumerate' sums discrete latents "
            f"exactly (beside Normal latents too, when the observation is Normal and affine in "
            f"them); otherwise use {ALTERNATIVES}."
        )
    check_local_latent(tokens, site, NotQuadratureError)
    if isinstance(base, dist.Normal):
        kind = "normal"
    elif isinstance(base, (dist.MultivariateNormal, dist.LowRankMultivariateNormal)):
        kind = "mvn"
    elif isinstance(base, (dist.Delta, dist.VonMises)) or (len(base.event_shape) > 0 and not _unconstrained(base)):
        raise NotQuadratureError(
            f"conditionals='quadrature' cannot parameterize latent site {name!r} "
            f"({kind_name}{'' if not base.event_shape else ' with event shape ' + str(tuple(base.event_shape))}): "
            f"it supports Normal and MultivariateNormal latents, continuous "
            f"scalar latents on an interval or half-line (Gamma, Beta, Uniform, "
            f"LogNormal, ...) and latents whose support torch maps from an "
            f"unconstrained space (biject_to: Dirichlet's simplex, ...). "
            f"Reparameterize it with such latents, or use "
            f"{ALTERNATIVES}."
        )
    else:
        try:
            biject_to(base.support)
        except NotImplementedError:
            raise NotQuadratureError(
                f"Latent site {name!r} ({kind_name}) has support {base.support} "
                f"with no bijection to the real line, so the quadrature rule "
                f"cannot cover it; use {ALTERNATIVES}."
            ) from None
        kind = "transform"
    return kind


def _unconstrained(base):
    # a latent with event dims whose support maps from an unconstrained space
    # (a Dirichlet's simplex: K - 1 coordinates by stick breaking)
    try:
        t = biject_to(base.support)
        t.inverse_shape(base.event_shape)
    except (NotImplementedError, AttributeError):
        return False
    return True


class NodeRunner:
    """Runs the Pyro model with its latents at a batch of nodes, vectorized in a plate.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable model: the Pyro model.
    :param tuple args: its arguments.
    :param dict kwargs: its keyword arguments.
    :param dict layout: from :func:`quadrature_layout`.
    :param ~pyro_mpt.conditionals.plate_runs.RunMemory memory: the entry of
        :data:`RUN_MODES` that worked for the model, tried first next time;
        None: a memory of its own (decided on the first run).
    :param int max_runs: the most model runs this runner may make one node at
        a time (:data:`MAX_NODE_RUNS` by default).
    :ivar int grid_nodes: the nodes of the evaluation's grid, set by the engine
        before its first run: a per-node evaluation needs at least that many
        runs, so a grid larger than ``max_runs`` is refused before any.

    A model that fails in the node plate (or whose observation does not keep
    one value per node, datapoint and token there) is run once per node, with
    one :class:`~pyro_mpt.conditionals.base.SlowEngineWarning` when the
    fallback is found (the remembered mode is used silently afterwards), and
    at most ``max_runs`` runs in all: beyond them it raises
    :class:`NotQuadratureError` (so ``conditionals="auto"`` tries the next
    engine when this happens while preparing).
    """

    def __init__(self, tokens, model, args, kwargs, layout, memory=None, max_runs=MAX_NODE_RUNS):
        self.tokens = tokens
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.layout = layout
        self.replay = tokens.subsample_trace()
        self.node_dim = tokens.max_plate_nesting + 1
        self.memory = RunMemory() if memory is None else memory
        self.max_runs = int(max_runs)
        self.grid_nodes = 1
        self.node_runs = 0

    def _spend(self, P):
        """Count ``P`` runs one node at a time, refusing first when the evaluation would
        need more than ``max_runs`` of them (at least its grid's nodes)."""
        need = max(self.node_runs + P, self.grid_nodes)
        if need > self.max_runs:
            raise NotQuadratureError(
                f"conditionals='quadrature' runs the model of site {self.tokens.name!r} one node at a "
                f"time (it does not broadcast over the node plate at dim {-self.node_dim}), and this "
                f"evaluation needs at least {need} model runs (a grid of {self.grid_nodes} nodes, "
                f"{self.node_runs} runs made so far), more than max_node_runs={self.max_runs}. Write the "
                f"model so that it broadcasts over extra batch dims on the left ('...' indexing, "
                f"torch.matmul, .expand) to run the nodes at once; or use fewer nodes (num_nodes= per "
                f"latent dim, num_nodes**K in all; cache_elements= keeps a larger table from being "
                f"rerun at each pass); or pass max_node_runs=<n> to accept about one model run per "
                f"node; or use {ALTERNATIVES}."
            )
        self.node_runs += P

    def _trace(self, u, compact, plate=True):
        dim = self.node_dim if plate else None
        handler = CoordinateLatents(self.layout, u, dim, self.tokens.batch_shape, compact)
        # the observed values were validated when the model was first traced
        trace = run_in_plate(self.model, self.args, self.kwargs, name=NODE_PLATE if plate else None,
                             size=u.shape[0] if plate else None, dim=dim, replay=self.replay,
                             inside=handler, validation=False)
        return trace, handler

    def _failed(self, errors):
        first, e = errors[0], errors[-1]
        return NotQuadratureError(
            f"conditionals='quadrature' runs the model with its latents at "
            f"many nodes at once, in a pyro.plate at dim {-self.node_dim}, "
            f"and the model failed there ({type(first).__name__}: {str(first).splitlines()[0]}) "
            f"and also when run at one node at a time ({type(e).__name__}: {str(e).splitlines()[0]}). Write "
            f"the model so that it broadcasts over extra batch dims on the "
            f"left (use '...' indexing, torch.matmul, .expand) and runs at any "
            f"latent value of the prior's support, or set max_plate_nesting "
            f"correctly; or use {ALTERNATIVES}."
        )

    def _before_per_node(self, mode, error):
        if mode == "full":  # the next mode runs the model once per node
            warnings.warn(
                f"conditionals='quadrature': the model failed when run at many nodes at once in a "
                f"pyro.plate at dim {-self.node_dim} ({type(error).__name__}: "
                f"{str(error).splitlines()[0]}); running it once per node instead (exact, but one "
                f"model run per node, which is much slower). Write the model so that it broadcasts "
                f"over extra batch dims on the left ('...' indexing, torch.matmul, .expand) to run "
                f"it vectorized.",
                SlowEngineWarning,
                stacklevel=user_stacklevel(),
            )

    def run(self, u):
        """Per-node prior log-densities ``(P, r')`` and token log-likelihoods ``(P, n, D)``.

        :param torch.Tensor u: node coordinates ``(P, r, K)``, ``r`` in ``{1, n}``.
        """

        def attempt(mode):
            if mode == "per_node":
                self._spend(u.shape[0])
                parts = [self._run(u[p], compact=False, plate=False) for p in range(u.shape[0])]
                return torch.cat([lp for lp, _ in parts]), torch.cat([t for _, t in parts])
            out = self._run(u, compact=mode == "compact")
            # the data's shape too: a model checked at one datapoint (nothing to mix up) was
            # taken as checked for four, as many as its tokens, and was then 55 nats off
            key = (callable_key(self.model), mode, tuple(self.tokens.value.shape))
            if self.memory.verified != key:
                self._check_probe_nodes(u.shape[-1], u.dtype, u.device, compact=mode == "compact")
                self.memory.verified = key
            return out

        _, out = run_with_fallback(
            RUN_MODES, attempt, memory=self.memory, fn=self.model, failure=self._failed,
            on_fallback=self._before_per_node,
        )
        return out

    def _check_probe_nodes(self, K, dtype, device, compact):
        """Compare a run at two probe nodes in the node plate, each datapoint at its own
        coordinates (``plate_runs.probe_coordinates``), with runs at each
        node alone, once per model, mode and data shape: a model that broadcasts the node plate into the
        datapoints' dim runs without error where the sizes happen to agree (``z[:, None] + b``
        with as many datapoints as tokens puts each datapoint's latent on the token axis;
        ``torch.stack([z1, z2], 1)`` with as many datapoints as latents transposes them), and
        every number is then wrong. The check was made at the engine's own first nodes that
        differed by datapoint, where such a model can give the right numbers by coincidence
        (the adaptive search's start, one point for all; a symmetric table of coordinates):
        it passed, and the next nodes were off by up to 2 nats, without a warning. Raises
        ``ValueError`` there, so that the next mode is tried."""
        n = self.tokens.num_data
        probe = probe_coordinates(n, K, dtype, device)
        with torch.no_grad():
            together = self._run(probe, compact)[1]
            for p in range(probe.shape[0]):
                alone = self._run(probe[p], compact=False, plate=False)[1][0]
                if not agrees_with_point_run(together[p], alone):
                    raise ValueError(
                        f"Observed site {self.tokens.name!r}'s log-density at a quadrature node "
                        f"differs when the model runs at many nodes at once in the pyro.plate at dim "
                        f"{-self.node_dim} from when it runs at that node alone: the model broadcasts the "
                        f"nodes' dim into the datapoints' or tokens' (e.g. z[:, None] where z[..., None] "
                        f"keeps the left dims, or torch.stack(..., 1) where dim=-1 does)."
                    )

    def _run(self, u, compact, plate=True):
        # u (P, r, K) in the node plate; (r, K), one node, without it
        tokens = self.tokens
        P = u.shape[0] if plate else 1
        n, D = tokens.num_data, tokens.num_tokens
        trace, handler = self._trace(u, compact, plate)
        site = trace.nodes[tokens.name]
        fn = site["fn"]
        if plate and not reaches_points(fn, self.node_dim):
            # every node would get one node's likelihood (e.g. z.reshape(n, K) of
            # the (P, 1, K) nodes with a batch of n = P): the next mode runs it apart
            raise ValueError(
                f"Observed site {tokens.name!r} does not vary over the {P} quadrature nodes in "
                f"the pyro.plate at dim {-self.node_dim}: the model moved the nodes' dim."
            )
        base, _ = unwrap(fn, masks=True)
        # missing tokens are evaluated at a filled-in value and then zeroed: they
        # then add nothing to any context, joint or posterior of the table
        value = tokens.site_value
        logp = token_log_prob(base, value)
        full = broadcast_shape(logp.shape, fn.batch_shape + fn.event_shape)
        logp = tokens.to_tokens(logp.expand(full))
        if logp.numel() != P * n * D:
            raise ValueError(
                f"Observed site {tokens.name!r} has shape {tuple(full)} when the model "
                f"runs at {P} quadrature nodes; expected {P} x {n} datapoints x {D} "
                f"tokens. The observation must broadcast over the node plate at dim "
                f"{-self.node_dim} and keep one value per datapoint and token; check "
                f"max_plate_nesting."
            )
        logp = logp.reshape(P, n, D)
        if tokens.observed is not None:
            logp = torch.where(tokens.observed, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
        log_pi = handler.log_pi
        if log_pi is None:
            log_pi = logp.new_zeros(P, 1)
        return log_pi, logp


def latent_dtype(tokens):
    """The dtype of the first floating-point latent value (else the data's): the nodes' dtype."""
    for site in tokens.latent_sites():
        v = site["value"]
        if torch.is_tensor(v) and torch.is_floating_point(v):
            return v.dtype
    return tokens.value.dtype
