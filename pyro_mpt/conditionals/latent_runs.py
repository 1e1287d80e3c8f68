r"""Running a Pyro model and its guide at many latent values at once.

The sampling engines (:mod:`~pyro_mpt.conditionals.encode_decode`,
:mod:`~pyro_mpt.conditionals.importance`) and the importance-sampled evidence
(:mod:`~pyro_mpt.evidence.importance`) need the same few operations on a
Pyro model and guide:

* **encode** -- run the guide on (possibly imputed) data and read the latent
  values it draws (or their means) and :math:`\log q(z \mid \tilde x)` per
  datapoint;
* **decode** -- run the model with its latents set to given values and read
  :math:`\log p(z)` per datapoint and the observation
  :math:`p(x \mid z)` token by token (its log-density at the data, its mean, a
  sample);
* **sample the prior** -- run the model alone, its latents drawn from the prior.

All runs are vectorized: the model (or guide) runs once inside an extra
``pyro.plate("_mpt_particles", P, dim=-(max_plate_nesting + 1))``, with the
subsample sites of the traced minibatch replayed, so every latent gets ``P``
values per datapoint. Per-datapoint quantities are read off each site's
unscaled ``fn.log_prob(value)``: dims of the observed site's plates are kept,
dims of any other plate (e.g. a plate over a datapoint's latent dims) are
summed, and the scale of subsampled plates is *not* applied (the caller applies
it outside any log-sum-exp).

**Which argument is the data** is found by
:mod:`~pyro_mpt.conditionals.data_args`.

**Many imputations per datapoint.** To encode ``B`` imputed versions of the
batch (one per mask query and chain) in one guide call, the runner stacks them
along the data argument's leading dim (``B * n`` rows), which works for the
usual amortized guide that reads its plate size from the data
(``pyro.plate("data", x.shape[0])``). When that fails (nested data plates,
subsampled plates, other per-datapoint arguments) it falls back to one guide
call per imputed version, each vectorized over particles and datapoints.
"""

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample

from ..observed_tokens import check_local_latent
from .base import EngineNotApplicable, SlowEngineWarning
from .decoded import Decoded, Encoded, StackedDecoded, pad_batch, site_log_prob
from .plate_runs import MeanLatents, RunMemory, agrees_with_point_run, run_in_plate, run_with_fallback
from ..code_origin import user_stacklevel
from ..model_keys import callable_key

__all__ = [
    "PARTICLE_PLATE",
    "GuideMemory",
    "LatentRunner",
    "check_draws_log_density",
    "logmeanexp",
]

#: name of the vectorized particle plate the runs use
PARTICLE_PLATE = "_mpt_particles"


def logmeanexp(t, dim):
    """:math:`\\log \\frac1S \\sum_s e^{t_s}` along ``dim``."""
    return torch.logsumexp(t, dim) - math.log(t.shape[dim])


def check_draws_log_density(runner, T, proposal):
    r"""Raise where the observed site's log-density at the drawn latents is NaN.

    A draw far out (a guide whose outputs ran away, a prior's tail under an overflowing link)
    gives a rate of inf and a log-density of inf - inf; every estimate averaging over that
    draw would be NaN, with no word of where it came from.

    :param LatentRunner runner: the runs that drew the latents.
    :param torch.Tensor T: the tokens' log-densities ``(..., n, D)`` at the draws.
    :param str proposal: what drew the latents, for the message (e.g. ``"the guide"``).
    :raises ValueError: naming the site, the count and what to do.

    Example::

        >>> check_draws_log_density(runner, dec.token_log_prob(x), "the prior")
    """
    bad = torch.isnan(T)
    if bool(bad.any()):
        raise ValueError(
            f"{runner.who}: the log-density of observed site {runner.tokens.name!r} is NaN at "
            f"{int(bad.sum())} of its {T.numel()} values at the latents drawn from {proposal} (a "
            f"latent so far out that the model's parameters overflow, e.g. a Poisson rate "
            f"exp(z) of inf). Bound the proposal (clamp or tanh the guide's location), "
            f"keep the model's parameters finite there (e.g. clamp the link's input), or "
            f"compute in float64."
        )


@dataclass
class GuideMemory:
    """All that a sampling engine remembers about the guide across calls.

    :param ~pyro_mpt.conditionals.plate_runs.RunMemory stacking: whether the
        guide took imputed copies of the batch stacked along its data argument
        (``"stacked"``) or needed one call per copy (``"per_copy"``); decided
        on the first encode of several copies, and kept so that a guide that
        cannot stack is not tried (and warned about) at every step.
    :param tuple checked: ``callable_key`` of the guide last found amortized
        (:class:`~pyro_mpt.conditionals.EncodeDecodeConditionals` checks once).
    :param bool said_original_data: whether the importance engine said (at INFO) that it
        runs the guide on the original data, its data argument not found.
    :param tuple verified: ``callable_key`` of the model whose vectorized runs were checked
        against a run at one point alone (:meth:`LatentRunner.decode`).
    """

    stacking: RunMemory = field(default_factory=RunMemory)
    checked: Optional[tuple] = None
    said_original_data: bool = False
    verified: Optional[tuple] = None


#: the most model runs one call may make one point at a time, for a model that does not
#: run vectorized (:meth:`LatentRunner.decode`); beyond it the call is refused
MAX_POINT_RUNS = 2048


# ---------------------------------------------------------------------- runner
class LatentRunner:
    """Runs a model (and guide) at many latent values at once; see the module docstring.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable model: the Pyro model.
    :param callable guide: the guide or None.
    :param tuple args: model/guide arguments.
    :param dict kwargs: model/guide keyword arguments.
    :param DataArgument data: where the tokens enter the guide (needed by
        :meth:`encode` only).
    :param str who: the caller's name, for error messages.
    :param GuideMemory memory: what the engine remembers about the guide
        (None: a memory of this runner's own).
    :raises EngineNotApplicable: when a latent is shared by several datapoints.
    """

    def __init__(self, tokens, model, guide, args, kwargs, data=None, who="this engine", memory=None):
        self.tokens = tokens
        self.model = model
        self.guide = guide
        self.args = args
        self.kwargs = kwargs
        self.data = data
        self.who = who
        self.rank = tokens.max_plate_nesting + 1
        data_frames = tokens.data_frames
        self.data_dims = {f.dim for f in data_frames}
        self.replay = tokens.subsample_trace()
        self.memory = GuideMemory() if memory is None else memory
        self.warned_per_point = False
        for site in tokens.latent_sites():
            check_local_latent(tokens, site, EngineNotApplicable, allow_token_plates=True,
                               consequence=f"{who} cannot integrate it per datapoint")

    # ------------------------------------------------------------------ reductions
    def per_datapoint(self, log_p, rows, batch_shape=None):
        """Reduce a site's log-density to ``(rows, prod(batch_shape))``.

        Dims of the observed site's plates are kept, other plate dims summed.

        :param torch.Tensor log_p: a batch tensor with the particle dim at
            ``-(max_plate_nesting + 1)``.
        :param int rows: the particle plate's size.
        :param torch.Size batch_shape: the observed site's batch shape (default:
            the traced one).
        """
        rank = self.rank
        if batch_shape is None:
            batch_shape = self.tokens.batch_shape
        log_p = pad_batch(log_p, rank)
        dims = [i for i in range(1, rank) if (i - rank) not in self.data_dims and log_p.shape[i] > 1]
        if dims:
            log_p = log_p.sum(dims, keepdim=True)
        full = (rows,) + (1,) * (rank - 1 - len(batch_shape)) + tuple(batch_shape)
        return log_p.expand(full).reshape(rows, -1)

    # ------------------------------------------------------------------ running
    @property
    def stacking(self):
        """True when the guide takes the imputed copies stacked along its data argument."""
        return self.memory.stacking.recall(self.guide) == "stacked"

    def _run(self, fn, rows, args, kwargs, replay, handler=None):
        # the model's runs skip validation: the trace of the data checked its
        # observed values, and re-checking the (rows, n, D) parameters of the
        # observation (e.g. that Bernoulli logits are real) costs passes over
        # tables of millions of entries; the guide's runs, on imputed data, keep it
        validation = False if fn is self.model else None
        return run_in_plate(fn, args, kwargs, name=PARTICLE_PLATE, size=rows, dim=self.rank,
                            replay=replay, outside=handler, validation=validation)

    def _replay_with(self, values, subsample=True):
        """A trace to replay: the given latent values, after the minibatch's subsample sites."""
        replay = Trace()
        if subsample:
            for name, site in self.replay.nodes.items():
                replay.add_node(name, **site)
        for name, v in values.items():
            replay.add_node(name, type="sample", name=name, is_observed=False, value=v, infer={})
        return replay

    def _model_failed(self, e):
        return EngineNotApplicable(
            f"{self.who} runs the model with many latent values at once, in a "
            f"pyro.plate at dim {-self.rank}, and the model failed there "
            f"({type(e).__name__}: {e}). Write the model so that it broadcasts over "
            f"extra batch dims on the left (use '...' indexing, torch.matmul, .expand), "
            f"or set max_plate_nesting correctly."
        )

    def decode(self, values, rows):
        """Run the model in a particle plate of size ``rows`` with latents set to ``values``.

        Latents missing from ``values`` are drawn from the prior (their
        :math:`\\log p` is not counted in :meth:`~pyro_mpt.conditionals.decoded.Decoded.log_prior`).

        :param dict values: latent name -> value with leading dim ``rows``.
        :rtype: ~pyro_mpt.conditionals.decoded.Decoded
        """
        return self._decode(rows, values, self._replay_with(values))

    def _decode(self, rows, values, replay):
        """The model in the particle plate, or else once per point: a model that does not
        broadcast over the plate (e.g. ``nn.Linear`` with sampled weights, whose
        ``F.linear`` takes a 2-D weight only) still runs, slowly, warned once per runner."""

        def attempt(mode):
            if mode == "per_point":
                return self._point_runs(rows, values)
            trace = self._run(self.model, rows, self.args, self.kwargs, replay)
            decoded = Decoded(self, trace, rows, list(values or {}))
            # a model that ran but put the latent values into its observation's
            # event (loc.reshape(n, h, w)) runs one point at a time, as one that failed
            # (EngineNotApplicable would pass through the fallback)
            try:
                decoded.check_broadcast()
            except EngineNotApplicable as e:
                raise ValueError(str(e)) from e
            key = callable_key(self.model)
            if self.memory.verified != key:
                # a comparison of values, once per model: without a graph, so that a recomputed
                # region (a kept chunk of draws) whose first run made it and whose second does not
                # saves the same tensors in both
                with torch.no_grad():
                    if self._check_first_point(decoded, rows):
                        self.memory.verified = key
            return decoded

        def before_point_runs(mode, error):
            if rows > MAX_POINT_RUNS:
                raise EngineNotApplicable(
                    f"{self.who} runs the model with {rows} latent values at once, in a pyro.plate "
                    f"at dim {-self.rank}, and the model failed there ({type(error).__name__}: "
                    f"{error}); one run per value would take {rows} model runs, more than "
                    f"{MAX_POINT_RUNS}. Write the model so that it broadcasts over extra batch dims "
                    f"on the left (torch.matmul instead of nn.Linear / F.linear on sampled weights, "
                    f"'...' indexing, .expand), or use fewer samples per call (num_samples, chunk_size)."
                ) from error
            if not self.warned_per_point:
                self.warned_per_point = True  # once per runner: one evaluation, however many chunks
                warnings.warn(
                    f"{self.who}: the model failed when run with many latent values at once in a "
                    f"pyro.plate at dim {-self.rank} ({type(error).__name__}: {str(error).splitlines()[0]}); "
                    f"running it once per value instead, which is much slower. Write the model so "
                    f"that it broadcasts over extra batch dims on the left (torch.matmul instead of "
                    f"nn.Linear / F.linear on sampled weights) to run it vectorized.",
                    SlowEngineWarning,
                    stacklevel=user_stacklevel(),
                )

        # the per-point runs raise EngineNotApplicable themselves when the model fails at a point
        _, out = run_with_fallback(("vectorized", "per_point"), attempt, on_fallback=before_point_runs)
        return out

    def _check_first_point(self, decoded, rows):
        """Compare the vectorized run's first point with a run at that point alone, once per
        model: a model that broadcasts the particles' dim into the datapoints' runs without
        error where the sizes happen to agree (``z[:, None] + b`` with as many datapoints as
        tokens puts each datapoint's latent on the token axis), and every estimate is then
        wrong (1.7 nats at N = D = 3). Raises ``ValueError`` there, so that the points run apart.
        Returns whether the comparison could tell: where the first point's latents are
        equal for every datapoint (guide means of equal datapoints), a model that moves the
        datapoints onto the tokens gives the right numbers there, so the model is checked
        again at the next call until they differ (the quadrature engine's search, which
        starts every datapoint at one point, passed its check there and was then 2 nats
        off); a model without latents per datapoint has nothing to move."""
        names = [n for n in self.tokens.latent_names if n in decoded.trace.nodes]
        first, local, differs = {}, False, False
        for name in names:
            v = decoded.trace.nodes[name]["value"]
            if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] not in (1, rows):
                return True  # not laid out by point (the per-point runs could not replay it either)
            first[name] = v[:1]
            event = len(decoded.trace.nodes[name]["fn"].event_shape)
            entries = v[0].reshape((-1,) + v.shape[v.dim() - event:])
            local = local or entries.shape[0] > 1
            differs = differs or bool((entries != entries[:1]).any())
        # each datapoint's log-density (no factorization over tokens needed: the evidence's too)
        if not agrees_with_point_run(decoded.obs_log_prob()[0], self._point_runs(1, first).obs_log_prob()[0]):
            raise ValueError(
                f"{self.who}: the log-density of observed site {self.tokens.name!r} at the first "
                f"latent value differs when the model runs with many values at once in the "
                f"pyro.plate at dim {-self.rank} from when it runs at that value alone: the model "
                f"broadcasts the values' dim into the datapoints' or tokens' (e.g. z[:, None] "
                f"where z[..., None] keeps the left dims)."
            )
        return differs or not local

    def _point_runs(self, rows, values):
        shapes = {name: self.tokens.model_trace.nodes[name]["value"].shape for name in (values or {})}
        parts = []
        for i in range(rows):
            point = {name: v[i].reshape(shapes[name]) if v[i].numel() == shapes[name].numel() else v[i]
                     for name, v in (values or {}).items()}
            replay = self._replay_with(point)
            try:
                trace = run_in_plate(self.model, self.args, self.kwargs, replay=replay)
            except Exception as e:
                # the model fails at one point too
                raise self._model_failed(e) from e
            parts.append(Decoded(self, trace, 1, list(point)))
        return StackedDecoded(parts)

    def sample_prior(self, rows):
        """Run the model with ``rows`` prior draws of its latents per datapoint.

        :rtype: ~pyro_mpt.conditionals.decoded.Decoded
        """
        return self._decode(rows, None, self.replay)

    def prior_mean_tokens(self):
        """The observation's mean per token with every latent at its prior mean, ``(n, D)``."""
        handler = MeanLatents(set(self.tokens.latent_names))
        try:
            trace = self._run(self.model, 1, self.args, self.kwargs, self.replay, handler)
        except ValueError:
            raise
        except Exception as e:
            raise self._model_failed(e) from e
        return Decoded(self, trace, 1, []).mean()[0]

    # ------------------------------------------------------------------ guide
    def _guide_values(self, trace, rows, versions, stacked):
        """Latent values ``{name: (rows * versions, ...)}`` and ``log_q`` ``(rows, versions, n)``."""
        tokens = self.tokens
        n = tokens.num_data
        rank = self.rank
        latent = set(tokens.latent_names)
        values, log_q = {}, None
        batch = tokens.batch_shape
        if stacked:
            (d,) = self.data_dims
            batch = list(batch)
            batch[len(batch) + d] = versions * n
            batch = torch.Size(batch)
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
                continue
            if site["infer"].get("is_auxiliary") and name not in latent:
                # e.g. AutoNormal's '<name>_unconstrained': the latent is a Delta transform of
                # it whose log_density holds the Jacobian, so log q(z) = log q(u) + log_density
                dims = {f.dim for f in site["cond_indep_stack"] if f.vectorized}
                if not self.data_dims <= dims:
                    raise ValueError(
                        f"Auxiliary guide site {name!r} is outside the data plate(s) of observed "
                        f"site {tokens.name!r}, so its density is shared by all datapoints and "
                        f"{self.who} cannot form per-datapoint weights from it; use a guide with "
                        f"one distribution per datapoint, or one of Pyro's autoguides (AutoNormal, "
                        f"AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal), "
                        f"whose per-datapoint marginals are computed from their parameters."
                    )
                lq = self.per_datapoint(site_log_prob(site), rows, batch).reshape(rows, versions, n)
                log_q = lq if log_q is None else log_q + lq
                continue
            if name not in latent:
                raise ValueError(
                    f"Guide site {name!r} has no latent counterpart in the model (latents: "
                    f"{', '.join(repr(k) for k in tokens.latent_names) or 'none'}); "
                    f"{self.who} needs a guide over the model's latents only."
                )
            fn = site["fn"]
            E = len(fn.event_shape)
            v = site["value"]
            v = v.reshape((1,) * (rank + E - v.dim()) + tuple(v.shape))
            v = v.expand((rows,) + tuple(v.shape[1:]))
            if stacked:
                (d,) = self.data_dims
                i = rank + d
                if v.shape[i] != versions * n:
                    raise ValueError(
                        f"guide site {name!r} has size {v.shape[i]} along the data plate, "
                        f"expected {versions * n}"
                    )
                v = v.unflatten(i, (versions, n)).movedim(i, 1)
            else:
                v = v.unsqueeze(1)
            values[name] = v.reshape((rows * versions,) + tuple(v.shape[2:]))
            lq = self.per_datapoint(site_log_prob(site), rows, batch).reshape(rows, versions, n)
            log_q = lq if log_q is None else log_q + lq
        if log_q is None:
            log_q = tokens.value.new_zeros(rows, versions, n)
        return values, log_q

    def _guide_run(self, args, kwargs, rows, mean, replay):
        handler = MeanLatents() if mean else None
        return self._run(self.guide, rows, args, kwargs, replay, handler)

    def encode(self, xt, num_particles, mean=False):
        """Run the guide on imputed tokens.

        :param torch.Tensor xt: ``(B, n, D)`` imputed versions of the batch.
        :param int num_particles: draws per version and datapoint (``P``).
        :param bool mean: set each latent to the mean of its guide distribution
            instead of sampling (``P`` should be 1).
        :rtype: ~pyro_mpt.conditionals.decoded.Encoded
        """
        if self.guide is None or self.data is None:
            raise ValueError(f"{self.who}: encoding needs a guide and its data argument.")
        B = xt.shape[0]
        P = int(num_particles)

        def stacked():
            args, kwargs = self.data.substitute(self.args, self.kwargs, xt)
            trace = self._guide_run(args, kwargs, P, mean, None)
            values, log_q = self._guide_values(trace, P, B, stacked=True)
            return Encoded(values, None if mean else log_q, P, B)

        def per_copy():
            parts = []
            for b in range(B):
                args, kwargs = self.data.substitute(self.args, self.kwargs, xt[b])
                try:
                    trace = self._guide_run(args, kwargs, P, mean, self.replay)
                except Exception as e:
                    raise EngineNotApplicable(
                        f"{self.who} runs the guide on imputed data with {P} particle(s) in "
                        f"a pyro.plate at dim {-self.rank}, and the guide failed there "
                        f"({type(e).__name__}: {e}). The guide must take the data through "
                        f"{self.data.describe()} and broadcast over extra batch dims on the "
                        f"left."
                    ) from e
                parts.append(self._guide_values(trace, P, 1, stacked=False))
            values = {}
            for name in parts[0][0]:
                v = torch.stack([p[0][name] for p in parts], 1)  # (P, B, ...)
                values[name] = v.reshape((P * B,) + tuple(v.shape[2:]))
            log_q = None if mean else torch.cat([p[1] for p in parts], 1)
            return Encoded(values, log_q, P, B)

        def warn(mode, e):
            subsampled = [f.name for f in self.tokens.data_frames
                          if f.full_size is not None and f.full_size != f.size]
            if subsampled:
                # a plate sized from the data would replay its indices 0..n-1 into the model's
                # subsampled plate, which would then score other datapoints than the minibatch
                advice = (f"The data plate {subsampled[0]!r} is subsampled, and its subsample indices "
                          "are not the copies': keep them (a guide plate sized from the data, "
                          "x.shape[0], would replay indices 0..n-1 into the model's plate, which "
                          "would then score other datapoints than the minibatch); the copies then "
                          "run one at a time.")
            else:
                advice = ("Let the guide take its plate size from the data (pyro.plate('data', "
                          "x.shape[0])) and no other per-datapoint argument to stack the copies.")
            warnings.warn(
                f"{self.who}: the guide failed on {B} imputed copies of the batch "
                f"stacked along its {self.data.describe()} ({type(e).__name__}: {e}); "
                f"calling it once per copy instead, which is slower. {advice}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

        modes = ("stacked", "per_copy") if B > 1 and self.data.rows else ("per_copy",)
        runs = {"stacked": stacked, "per_copy": per_copy}
        _, out = run_with_fallback(
            modes, lambda mode: runs[mode](), memory=self.memory.stacking, fn=self.guide,
            # a guide over other sites than the model's latents fails in every mode
            passes=lambda e: "no latent counterpart" in str(e), on_fallback=warn,
        )
        return out

    def guide_log_prob(self, xt, values, num_particles):
        r"""Guide log-densities :math:`\log q(z_s \mid \tilde x_b)` of given latents under several inputs.

        :param torch.Tensor xt: ``(B, n, D)`` inputs, ``B = C * Q``; input ``b``
            belongs to query ``b % Q``.
        :param dict values: latent name -> value ``(S * Q, ...)`` in the layout of
            ``values`` of :class:`~pyro_mpt.conditionals.decoded.Encoded` (draws outer, queries inner).
        :param int num_particles: ``S``.
        :returns: ``(S, C, Q, n)``: every draw of query ``j`` scored under each of
            that query's ``C`` inputs.
        """
        B, n, _ = xt.shape
        S = int(num_particles)
        Q = next(iter(values.values())).shape[0] // S
        C = B // Q
        rank = self.rank
        if self.stacking:
            (d,) = self.data_dims
            i = rank + d + 2  # the data dim, after (S, C, Q)
            stacked = {}
            for name, v in values.items():
                v = v.reshape((S, Q) + tuple(v.shape[1:]))
                v = v.unsqueeze(1).expand((S, C) + tuple(v.shape[1:]))
                stacked[name] = v.movedim((1, 2), (i - 2, i - 1)).flatten(i - 2, i)
            replay = self._replay_with(stacked, subsample=False)
            args, kwargs = self.data.substitute(self.args, self.kwargs, xt)
            trace = self._run(self.guide, S, args, kwargs, replay)
            self._refuse_auxiliary(trace)
            _, log_q = self._guide_values(trace, S, B, stacked=True)
            return log_q.reshape(S, C, Q, n)
        out = []
        for b in range(B):
            j = b % Q
            replay = self._replay_with({name: v.reshape((S, Q) + tuple(v.shape[1:]))[:, j] for name, v in values.items()})
            args, kwargs = self.data.substitute(self.args, self.kwargs, xt[b])
            trace = self._run(self.guide, S, args, kwargs, replay)
            self._refuse_auxiliary(trace)
            out.append(self._guide_values(trace, S, 1, stacked=False)[1][:, 0])
        return torch.stack(out, 1).reshape(S, C, Q, n)

    def _refuse_auxiliary(self, trace):
        aux = [n for n, s in trace.nodes.items() if s["type"] == "sample" and s["infer"].get("is_auxiliary")]
        if aux:
            raise ValueError(
                f"{self.who} scores given latent values under the guide, but the guide draws them "
                f"through auxiliary site(s) {', '.join(map(repr, aux))}, whose values cannot be "
                f"replayed. Use one of Pyro's autoguides (served directly), impute=False (the guide on the original data), "
                f"proposal='prior', or a guide that samples the model's latents directly."
            )

    def encode_original(self, rows):
        """Run the guide on the original data with ``rows`` particles.

        :rtype: ~pyro_mpt.conditionals.decoded.Encoded (with ``B = 1``)
        """
        try:
            trace = self._guide_run(self.args, self.kwargs, rows, False, self.replay)
        except Exception as e:
            raise ValueError(
                f"{self.who} runs the guide with {rows} particles in a pyro.plate at dim "
                f"{-self.rank}, and it failed there ({type(e).__name__}: {e}). Write the "
                f"guide so that it broadcasts over extra batch dims on the left."
            ) from e
        values, log_q = self._guide_values(trace, rows, 1, stacked=False)
        return Encoded(values, log_q, rows, 1)

    def guide_log_prob_original(self, values, rows):
        r"""Guide log-densities :math:`\log q(z_s \mid x)` of given latents ``values`` (``rows``
        draws each) under the guide run on the original data, ``(rows, n)``.

        :param dict values: latent name -> value ``(rows, ...)`` as :meth:`encode_original` gives them.
        :param int rows: the number of draws.
        """
        trace = self._guide_run(self.args, self.kwargs, rows, False, self._replay_with(values))
        self._refuse_auxiliary(trace)
        return self._guide_values(trace, rows, 1, stacked=False)[1][:, 0]

    def log_weights(self, rows):
        r"""Importance log-weights :math:`\log p(x, z_s) - \log q(z_s \mid x)` per datapoint, ``(rows, n)``.

        The guide (when there is one) runs on the original data with ``rows``
        particles, the model is replayed on its draws; latents the guide does
        not cover are drawn from the prior and cancel. Without a guide the
        weights are :math:`\log p(x \mid z_s)`, :math:`z_s` from the prior.
        """
        if self.guide is None:
            return self.sample_prior(rows).obs_log_prob()
        enc = self.encode_original(rows)
        dec = self.decode(enc.values, rows)
        return dec.log_prior() + dec.obs_log_prob() - enc.log_q[:, 0]
