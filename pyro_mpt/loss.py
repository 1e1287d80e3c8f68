r"""``MaskedPretrainingLoss``: masked pre-training as a Pyro ``ELBO``-style loss.

The loss traces the Pyro model, hands its observed tokens to a mask schedule
(:mod:`pyro_mpt.masks`) and a conditional engine (:mod:`pyro_mpt.conditionals`),
and reduces the weighted log-conditionals to one estimate of
:math:`\log p(x_i)` per datapoint:

.. math::

    \mathcal L_{\text{MPT}} = -\sum_{i} s_i\, \widehat{\log p}(x_i), \qquad
    \widehat{\log p}(x_i) = \sum_q w_q\, \frac{1}{M_q}
        \sum_{j \in \mathcal M_q} \log p(x_{ij} \mid x_{i\mathcal R_q}),

where :math:`s_i` is the scale Pyro attaches to datapoint :math:`i` (``N / B``
in a subsampled ``pyro.plate`` of size ``N`` and batch ``B``, times any
``poutine.scale``), so a minibatch loss is an unbiased estimate of the
full-data loss whenever the schedule is unbiased.
"""

import copy
import difflib
import math
from dataclasses import dataclass, field

import pyro.distributions as dist
import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import torch_item
from pyro.util import get_rng_state, set_rng_state, warn_if_nan

from .arg_checks import Revalidate, args_valid, checkable, quiet_or_validated
from .conditionals import ENGINES, auto_engine, engine_name, make_engine, option_names
from .conditionals.base import EngineNotApplicable
from .model_keys import callable_key
from .curve import CurveAccumulator
from .estimate import mpt_estimate
from .guide_checks import GuideTrainingCheck, check_guide_sites, guide_params
from .hidden_randomness import check_no_hidden_randomness, hidden_randomness_checked
from .masks import MaskSchedule, make_schedule
from .observed_tokens import LATENT_MEANS, check_latent_scales, trace_tokens
from .point_latents import log_prior, trace_with_point_globals
from .counts import checked_flag, is_count

__all__ = ["MaskedPretrainingLoss", "LossMemory"]


#: keyword options of Pyro's ``ELBO`` that this loss does not take (it draws no particles from the guide)
_ELBO_OPTIONS = frozenset(
    {"num_particles", "vectorize_particles", "retain_graph", "strict_enumeration_warning",
     "ignore_jit_warnings", "jit_options", "tail_adaptive_beta"}
)


@dataclass
class LossMemory:
    """All that a :class:`MaskedPretrainingLoss` remembers across calls.

    :param dict auto_engines: the engine ``conditionals="auto"`` chose, per
        ``(callable_key(model), observed site)`` (``callable_key`` of
        ``model_keys``: a bound method is a new object at each access,
        so it is identified by its owner and function). An engine keeps its
        own memory across steps (e.g.
        :class:`~pyro_mpt.conditionals.quadrature.QuadratureMemory`'s
        warm-started grids); keeping the chosen engine keeps that memory, and
        spares the engines before it in ``ENGINES`` a failing ``prepare`` at
        every step. It is asked first at the next call; when it no longer
        applies, ``"auto"`` chooses again. ``auto_engines.clear()`` forgets
        them.
    :param set quiet_traces: the models (``callable_key``) whose next step traces them
        without Pyro's argument validation: at the last validated step their engine built
        every distribution of the trace again under it
        (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.validates_model`; a
        full-covariance GMM's sampled trace checked ``scale_tril[a]`` at ``(N, D, D)``, a
        sixth of its step at D = 50), or :mod:`~pyro_mpt.arg_checks` checks their
        distributions at their arguments' own shapes (a latent mean's
        ``MultivariateNormal`` checked its ``scale_tril`` expanded to ``(N, D, D)``, half of
        its step at D = 200). Should anything fail there, the step traces again with
        validation (Pyro's own error) and the model leaves this set: the model and guide
        then run twice in that step (their side effects too), the second time from the
        torch, numpy and ``random`` states of the first (a CUDA generator's draws differ).
    :param set mean_traces: the models among ``quiet_traces`` whose engine reads no latent
        draw of the trace (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.reads_latent_draws`):
        their quiet trace puts each latent at its prior mean (``init_to_mean``) instead of
        drawing it.
    :param dict guide_checks: per guide, keyed by the names of its parameters, the
        :class:`~pyro_mpt.guide_checks.GuideTrainingCheck` of its first steps in
        :meth:`MaskedPretrainingLoss.loss_and_grads`.
    """

    auto_engines: dict = field(default_factory=dict)
    quiet_traces: set = field(default_factory=set)
    mean_traces: set = field(default_factory=set)
    guide_checks: dict = field(default_factory=dict)

    def forget_collected(self):
        """Drop what is remembered for models that no longer exist (a loss reused across
        many models kept an entry for each)."""
        for key in [k for k in self.auto_engines if not k[0].alive()]:
            del self.auto_engines[key]
        self.quiet_traces = {k for k in self.quiet_traces if k.alive()}
        self.mean_traces = {k for k in self.mean_traces if k.alive()}


#: the loss's own keywords: an unknown keyword goes to the engine, so a misspelled one
#: (``mask="all"``) would otherwise be blamed on the engine
_OWN_KEYWORDS = ("conditionals", "masks", "num_masks", "obs_site", "extra_sites", "token_plates",
                 "max_plate_nesting", "share_masks", "chunk_size", "progress")


def _check_misspelled_keywords(engine_options):
    """Refuse an engine option that no engine takes and that is spelled like one of the loss's own."""
    engine_names = set().union(*(option_names(cls) for cls in ENGINES.values()))
    for name in engine_options:
        close = difflib.get_close_matches(name, _OWN_KEYWORDS, n=1, cutoff=0.75)
        if name not in engine_names and close:
            raise ValueError(
                f"MaskedPretrainingLoss got {name}={engine_options[name]!r}, which is not one of its "
                f"keywords, so it would go to the conditional engine, and no engine takes it: did "
                f"you mean {close[0]}={engine_options[name]!r}?"
            )


class MaskedPretrainingLoss(ELBO):
    r"""The negative masked pre-training score of a Pyro model, for ``SVI``.

    Proposition 1 of Moreno-Muñoz, Recasens & Hauberg (NeurIPS 2023) shows that
    the cumulative masked pre-training score equals the log-marginal likelihood,

    .. math::

        \log p(x) = \sum_{M=1}^D S(x; M), \qquad
        S(x; M) = \frac1M\,\mathbb E_{|\mathcal M| = M}
            \Big[\sum_{j\in\mathcal M}\log p(x_j\mid x_{\mathcal R})\Big],

    so minimizing this loss maximizes an unbiased estimate of :math:`\log p(x)`
    (or, with a fixed masking rate, a known biased version of it). The latents
    are integrated out by a conditional engine, so no guide is needed for the
    closed-form and quadrature engines: pass a no-op guide. A guide's point mass
    (``AutoDelta``) at latents outside the data plates fits them by MAP, as in
    Pyro's GMM tutorial: they are held at the guide's values and the loss adds
    :math:`-\log p(\hat\theta)` (:mod:`~pyro_mpt.point_latents`).

    :param conditionals: how :math:`\log p(x_j\mid x_{\mathcal R})` is computed:
        ``"auto"`` (the first engine that serves the model, in the order
        below), ``"gaussian"`` (closed form), ``"quadrature"`` (grids over
        low-dimensional latents), ``"encode_decode"`` (recursive
        encoding-decoding with an amortized guide), ``"importance"``
        (self-normalized importance sampling), or a
        :class:`~pyro_mpt.conditionals.ConditionalEngine`.
    :param masks: the mask schedule: ``"uniform"`` (default; one uniform size
        per mask, unbiased), ``"stratified"``, ``"all"`` (every size with
        independent masks, the paper's cumulative MPT), ``"nested"`` (every
        size, masks nested in one permutation: more variance), ``"order"``
        (chain rule along random orderings), ``"exhaustive"`` (every subset,
        small D), ``"pll"`` (the pseudo-log-likelihood
        :math:`\sum_j \log p(x_j\mid x_{-j})`, not an estimate of
        :math:`\log p(x)`), a float rate in (0, 1) (fixed size, biased), or a
        :class:`~pyro_mpt.masks.MaskSchedule`.
    :param int num_masks: masks (or orderings) per datapoint and step.
    :param str obs_site: the observed site holding the tokens; needed when the
        model observes several sites.
    :param str extra_sites: observed sites other than ``obs_site`` and
        ``pyro.factor`` sites are left out of every estimate, so the loss is
        :math:`-\sum_i s_i \widehat{\log p}(x_i)` of the token site alone:
        another observed site :math:`y` is integrated out (:math:`\log p(x_i)`,
        not :math:`\log p(x_i \mid y_i)`) and a factor is dropped (a different
        model). ``"error"`` (default) refuses such a model, naming the sites;
        ``"drop"`` accepts that computation.
    :param tuple token_plates: names of the observed site's ``pyro.plate`` s that
        run over tokens rather than datapoints (their elements become tokens,
        flattened with the event dims); None detects them when unambiguous,
        ``()`` takes every plate as a datapoint plate (see :mod:`pyro_mpt.observed_tokens`).
    :param int max_plate_nesting: plate dims of the model; guessed when inf, and
        raised to the dims the traced model's plates use when smaller.
    :param bool share_masks: one mask set for the whole batch (True) or
        independent masks per datapoint (False). The default None draws masks
        per datapoint for the loss and :meth:`score`, and one set for the
        batch in :meth:`curve` (see there). Sharing has the same expectation
        and is cheaper, but the mask noise then does not average out over the
        batch. A :class:`~pyro_mpt.masks.MaskSchedule` instance carries its own
        choice, for the loss and the curve alike (given here, it must equal it).
    :param int chunk_size: bound on ``queries * datapoints * D`` per block of
        queries; lower it to save memory. Peak memory is bounded by one
        block's working set *with gradients too*: every block after the first
        is recomputed in the backward pass (activation checkpointing) instead
        of kept alive for it, at the cost of a second forward evaluation of
        those blocks; sampling engines redraw the same samples. Small blocks
        cost time: PPCA N = 200, D = 40, K = 5, ``"all"`` shared, ``2**8`` took 10
        times the default's time, ``2**12`` 1.8 times. Masks drawn per datapoint are
        drawn block by block, so under one seed other values of ``chunk_size`` draw
        other masks (of the same distribution: the estimate's expectation is the same).
    :param bool progress: show a progress bar in :meth:`score` and :meth:`curve`.
    :param engine_options: keyword options for the engine chosen by name or
        by ``"auto"`` (e.g. ``jitter=1e-6``).
    :ivar LossMemory memory: what the loss remembers across calls (the
        engines ``"auto"`` chose).

    Example::

        >>> loss = MaskedPretrainingLoss(masks="uniform", num_masks=1)
        >>> svi = SVI(ppca, lambda x: None, Adam({"lr": 1e-2}), loss=loss)
        >>> svi.step(x)
        >>> loss.score(ppca, None, x)        # (N,) estimates of log p(x_i)
        >>> loss.curve(ppca, None, x).plot() # S(x; M) against the masking rate
        >>> # tokens in a plate: pyro.sample("x", dist.Normal(loc, s), obs=x) inside plate "tokens"
        >>> MaskedPretrainingLoss(token_plates=("tokens",)).score(model, None, x)
        >>> # two observed sites: score log p(x) with y integrated out
        >>> MaskedPretrainingLoss(obs_site="x", extra_sites="drop").score(model_xy, None, x, y)
    """

    #: whether :meth:`loss_and_grads` checks, over the first steps with a guide, that the guide's
    #: parameters get a gradient (and warns about those that do not);
    #: :class:`~pyro_mpt.guide_elbo.WithGuideELBO` turns it off while it calls the loss it wraps,
    #: whose guide it trains by the ELBO
    checks_guide_training = True

    def __init__(
        self,
        *,
        conditionals="auto",
        masks="uniform",
        num_masks=1,
        obs_site=None,
        extra_sites="error",
        token_plates=None,
        max_plate_nesting=float("inf"),
        share_masks=None,
        chunk_size=2**22,
        progress=False,
        **engine_options,
    ):
        elbo_options = sorted(set(engine_options) & _ELBO_OPTIONS)
        if elbo_options:
            # written out of habit from Trace_ELBO(num_particles=...): no engine takes them
            raise ValueError(
                f"MaskedPretrainingLoss takes no {', '.join(elbo_options)}: those are options of Pyro's "
                f"ELBO, which draws particles from the guide; this loss integrates the latents in its "
                f"conditional engine instead. For more masks per datapoint and step pass num_masks=<n>; "
                f"for more importance samples per conditional, conditionals='importance' with num_samples=<n>."
            )
        _check_misspelled_keywords(engine_options)
        if not is_count(chunk_size):
            # int() let 2.5 through as 2, and 0 or -5 silently ran one query per block
            raise ValueError(
                f"MaskedPretrainingLoss(chunk_size={chunk_size!r}): give a positive integer, the bound on "
                f"queries * datapoints * D per block of queries (default 2**22); lower it to save memory."
            )
        super().__init__(num_particles=1, max_plate_nesting=max_plate_nesting)
        self.schedule = make_schedule(masks, num_masks, share_masks)
        # curves share one mask set unless asked otherwise (by share_masks=False,
        # or by a schedule instance, which carries its own choice)
        self._curve_share = share_masks
        if isinstance(masks, MaskSchedule):
            self._curve_share = None
        elif share_masks is None:
            self._curve_share = True
        self.engine_options = engine_options
        self.engine = make_engine(conditionals, **engine_options)
        self.memory = LossMemory()
        self.obs_site = obs_site
        self.extra_sites = extra_sites
        self.token_plates = token_plates
        self.chunk_size = int(chunk_size)
        self.progress = checked_flag(progress, "progress", "a progress bar in score() and curve()", "none")

    # ------------------------------------------------------------------ internals
    def _trace_tokens(self, model, guide, args, kwargs, check=True, validate_model=True, latent_init=None):
        mpn = None if self.max_plate_nesting == float("inf") else self.max_plate_nesting
        tokens = trace_tokens(
            model, guide, args, kwargs, self.obs_site, mpn, self.token_plates, extra_sites=self.extra_sites,
            validate_model=validate_model, latent_init=latent_init,
        )
        if check:
            check_guide_sites(tokens)
        return tokens

    def _prepare(self, model, guide, args, kwargs):
        """``(tokens, engine, state)`` for the estimates (see :meth:`_prepare_with_prior`)."""
        return self._prepare_with_prior(model, guide, args, kwargs)[:3]

    def _prepare_with_prior(self, model, guide, args, kwargs):
        r"""``(tokens, engine, state, prior)``: ``prior`` is :math:`\log p(\hat\theta)` of the
        global latents at the guide's point masses (0. without; see :mod:`~pyro_mpt.point_latents`),
        which the engines then see as fixed."""
        user_model = callable_key(model)  # the memory's key (see LossMemory), not the fixed twin's
        quiet = user_model in self.memory.quiet_traces and dist.is_validation_enabled()

        def validated():
            if quiet:
                # the quiet trace failed: the validated one fails as it always did (Pyro's own
                # error for a bad argument), and this model stays validated at this step
                self.memory.quiet_traces.discard(user_model)
            return self._prepare_traced(model, guide, args, kwargs, user_model, True, remember=not quiet)

        # the latents at their prior means, not drawn, where the remembered engine reads no draw
        init = LATENT_MEANS if user_model in self.memory.mean_traces else None
        return quiet_or_validated(
            quiet,
            lambda: self._prepare_traced(model, guide, args, kwargs, user_model, validate_model=False, latent_init=init),
            validated,
        )

    def _prepare_traced(self, model, guide, args, kwargs, user_model, validate_model, remember=True, latent_init=None):
        """:meth:`_prepare_with_prior` with the model traced with Pyro's argument validation
        (``validate_model``; then ``user_model`` joins :attr:`LossMemory.quiet_traces` where
        it may, if ``remember``) or without it, where the remembered
        engine builds every distribution again under validation
        (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.validates_model`) or
        :func:`~pyro_mpt.arg_checks.args_valid` checks them (else :class:`Revalidate`)."""
        tokens, model, guide, points = trace_with_point_globals(
            lambda model, guide: self._trace_tokens(
                model, guide, args, kwargs, check=False, validate_model=validate_model, latent_init=latent_init
            ),
            model, guide,
        )
        key = (user_model, tokens.name)
        if not validate_model and points:
            raise Revalidate  # the point masses' log-prior checks their support while validating
        prior = log_prior(points)
        check_guide_sites(tokens)
        check_latent_scales(tokens)
        if not validate_model:
            engine = self.engine if self.engine is not None else self.memory.auto_engines.get(key)
            if latent_init is not None and (engine is None or engine.reads_latent_draws()):
                raise Revalidate  # a trace without draws serves only the engine remembered for it
            if engine is not None and engine.validates_model(tokens):
                return tokens, engine, engine.prepare(tokens, model, guide, args, kwargs), prior
            if not args_valid(tokens.model_trace):
                raise Revalidate
        tokens, engine, state = self._prepare_engine(tokens, key, model, guide, args, kwargs)
        if latent_init is not None and engine.reads_latent_draws():
            raise Revalidate  # "auto" chose again, an engine that reads the draws
        if validate_model and remember:
            if not points and (engine.validates_model(tokens) or checkable(tokens.model_trace)):
                self.memory.quiet_traces.add(user_model)
            else:
                self.memory.quiet_traces.discard(user_model)
            if not points and not engine.reads_latent_draws():
                self.memory.mean_traces.add(user_model)
            else:
                self.memory.mean_traces.discard(user_model)
        return tokens, engine, state, prior

    def _prepare_engine(self, tokens, key, model, guide, args, kwargs):
        if self.engine is None:
            engine = self.memory.auto_engines.get(key)
            if engine is not None:
                try:
                    return tokens, engine, engine.prepare(tokens, model, guide, args, kwargs)
                except EngineNotApplicable:
                    pass
            engine, state = auto_engine(tokens, model, guide, args, kwargs, **self.engine_options)
            self.memory.forget_collected()
            self.memory.auto_engines[key] = engine
        else:
            engine = self.engine
            state = engine.prepare(tokens, model, guide, args, kwargs)
        return tokens, engine, state

    def _estimate(self, schedule, tokens, engine, state, accumulator=None, desc=None):
        """Per-datapoint estimate of :math:`\\log p(x_i)`, shape ``(n,)`` (see :func:`~pyro_mpt.estimate.mpt_estimate`)."""
        progress = desc if self.progress else None
        return mpt_estimate(
            schedule, tokens, engine, state, max_elements=self.chunk_size, accumulator=accumulator, progress=progress
        )

    # ------------------------------------------------------------------ Pyro's ELBO contract
    def _get_trace(self, model, guide, args, kwargs):
        """The model trace (replayed on the guide) and the guide trace."""
        tokens = self._trace_tokens(model, guide, args, kwargs)
        return tokens.model_trace, tokens.guide_trace

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """The negative MPT estimate summed over datapoints, each with its plate scale.

        :returns: a scalar tensor that can be differentiated.
        """
        return self._loss_parts(model, guide, args, kwargs)[0]

    def _loss_parts(self, model, guide, args, kwargs):
        tokens, engine, state, prior = self._prepare_with_prior(model, guide, args, kwargs)
        estimate = self._estimate(self.schedule, tokens, engine, state)
        loss = -(tokens.scale * estimate).sum() - prior
        warn_if_nan(loss, "loss")
        return loss, engine, tokens

    def loss(self, model, guide, *args, **kwargs):
        """The loss as a float, without gradients.

        :rtype: float
        """
        with torch.no_grad():
            return torch_item(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """The loss as a float; also back-propagates it into the parameters.

        Over the first steps with a guide it checks that the guide's own parameters get a
        gradient, and warns about those that do not
        (:class:`~pyro_mpt.guide_checks.GuideTrainingCheck`;
        :class:`~pyro_mpt.guide_elbo.WithGuideELBO` trains them, and turns the check off
        during its calls through :attr:`checks_guide_training`).

        :rtype: float
        """
        loss, engine, tokens = self._loss_parts(model, guide, args, kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        params = guide_params(tokens.guide_trace) if self.checks_guide_training and guide is not None else {}
        if params:
            # one check per set of guide parameters, not per guide object: a guide made anew at
            # every step (a lambda written in the loop, a bound method of a new object) is the
            # same guide, and a check per object never saw its second step
            check = self.memory.guide_checks.setdefault(frozenset(params), GuideTrainingCheck())
            if not check.done:
                check.record(params, engine_name(engine))
        return torch_item(loss)

    # ------------------------------------------------------------------ estimates
    def score(self, model, guide, *args, **kwargs):
        r"""Per-datapoint estimate of :math:`\sum_M S(x_i; M)`, the estimated :math:`\log p(x_i)`.

        :returns: a tensor of the observed site's batch shape (differentiable).
        """
        self._check_hidden_draws(model, guide, args, kwargs, "MaskedPretrainingLoss.score()")
        tokens, engine, state = self._prepare(model, guide, args, kwargs)
        return tokens.unflatten(self._estimate(self.schedule, tokens, engine, state, desc="MPT score"))

    def _check_hidden_draws(self, model, guide, args, kwargs, who):
        """Refuse, once per model, a model that draws randomness its trace does not see,
        unless this loss's engine averages over it: the estimates of an engine that
        integrates the trace's latents are then another number at every call (a hidden
        offset in PPCA: -493, -374, -189 in three calls of ``score()``). Before the engine
        runs (a quadrature grid blamed its own coarseness), from the random state it found.
        Training takes such draws as noise of its gradient, as ``Trace_ELBO`` does (dropout)."""
        if self.engine is not None and self.engine.averages_hidden_draws():
            return
        if hidden_randomness_checked(model):
            return
        state = get_rng_state()
        try:
            tokens = self._trace_tokens(model, guide, args, kwargs, check=False)
            check_no_hidden_randomness(
                tokens, model, args, kwargs, who,
                advice="; or use conditionals='importance', which averages over it", key=model,
            )
        finally:
            set_rng_state(state)

    def curve(self, model, guide, *args, **kwargs):
        r"""The MPT curve :math:`S(x; M)` for :math:`M = 1..D`, averaged over the data.

        Uses this loss's schedule when it covers every mask size (``"all"``,
        ``"nested"``, ``"order"``, ``"exhaustive"``), else ``"all"`` with this
        loss's ``num_masks``; ``"pll"`` gives the single point :math:`M = 1`,
        exact (its area is refused: it has no other sizes). With missing tokens
        a datapoint with :math:`D_i` observed tokens counts :math:`S(x_i; M) = 0`
        for :math:`M > D_i`, so the area is the mean :math:`\log p(x_{O_i})`; a datapoint
        with no observed token (a padding row under ``poutine.mask``) is left out of the
        means.

        **Masks are shared by the batch by default** (unless the loss was built
        with ``share_masks=False`` or with a schedule instance): one random mask
        per size and repetition for all datapoints, as the paper's code draws
        them. With the Gaussian engine this is about 16 times faster (load_digits
        PPCA, :math:`D = 64`, :math:`K = 40`, :math:`N = 1797`, one thread: 0.073 s
        instead of 1.16 s, ``benchmarks/defaults_speed.py curve``) and the curve's expectation is the same, but its mask noise no
        longer averages over the data: the spread of the curve and of its area
        over mask seeds shrinks as :math:`1/\sqrt P` with ``num_masks``, not as
        :math:`1/\sqrt{NP}`; the curve's ``stderr`` and
        :meth:`~pyro_mpt.curve.MPTCurve.area_stderr` add the mask draw's
        variance to the data's (:class:`~pyro_mpt.curve.CurveAccumulator`).
        Build the loss with ``share_masks=False`` for masks per datapoint. Shared ``"all"``
        masks are drawn two a size at least, whose spread gives the mask draw's variance
        (one a size left it to a model of the curve's shape, which understated it: area
        z-scores over 30 seeds of RMS 1.4--2.2 on PPCA). One set of shared nested masks or
        orderings moves the whole area with its draw, which no spread shows: its
        :meth:`~pyro_mpt.curve.MPTCurve.area_stderr` is NaN (it was the data's alone, z RMS
        7.7); ``num_masks = P >= 2`` sets estimate it from their spread, with :math:`P - 1`
        degrees of freedom.

        :rtype: ~pyro_mpt.curve.MPTCurve
        """
        schedule = self.schedule.for_curve(self._curve_share)
        with torch.no_grad():
            self._check_hidden_draws(model, guide, args, kwargs, "MaskedPretrainingLoss.curve()")
            tokens, engine, state = self._prepare(model, guide, args, kwargs)
            # with missing tokens every schedule draws its masks per datapoint
            shared = schedule.curve_mask_sharing() if tokens.observed is None else False
            if tokens.num_data == 1 and not shared:
                # one datapoint's masks are the batch's: their draw is its curve's whole error (with
                # missing tokens too, whose masks are drawn among its observed ones: its error was NaN)
                alike = copy.copy(schedule)
                alike.share_masks = True
                shared = alike.curve_mask_sharing()
            if shared == "sizes" and schedule.num_masks < 2:
                # one shared mask a size left its noise to a model of the curve's shape, which
                # understated it (PPCA, 30 seeds: area z-scores of RMS 1.4-2.2); two masks a
                # size give it from their spread, summed over the sizes
                schedule = copy.copy(schedule)
                schedule.num_masks = 2
            # a datapoint without observed tokens (masked out whole) is not one of the curve's
            observed = None if tokens.observed is None or tokens.num_data != 1 else int(tokens.observed.sum())
            acc = CurveAccumulator(tokens.num_tokens, shared=shared, present=tokens.present, observed_tokens=observed)
            if shared in (True, "orders") and schedule.num_masks > 1:
                # nested masks or orderings shared by the batch move their sizes together: the
                # area's mask noise is the spread of the P sets' areas, each set a run of its own
                one = copy.copy(schedule)
                one.num_masks = 1
                for _ in range(schedule.num_masks):
                    acc.start_replicate()
                    acc.add_items(self._estimate(one, tokens, engine, state, acc, desc="MPT curve"))
            else:
                acc.add_items(self._estimate(schedule, tokens, engine, state, acc, desc="MPT curve"))
        curve = acc.result(label=f"{type(schedule).__name__}")
        if shared == "orders" and math.isnan(curve.area_mask_variance) and not engine.chain_sums_reads_order(state):
            # conditionals of one joint: every ordering's area is log p(x_i), whatever the ordering
            curve.area_mask_variance = 0.0
        return curve
