r"""The interface every conditional engine implements.

An engine answers one question: given a datapoint's tokens :math:`x`, a context
set :math:`\mathcal R` and a target token :math:`j \notin \mathcal R`, what is
:math:`\log p(x_j \mid x_{\mathcal R})` with the model's latents integrated out?

It does so in two steps, so that the model-dependent work is done once per loss
evaluation and shared by every block of queries:

1. :meth:`ConditionalEngine.prepare` runs the Pyro model (and guide) on the
   observed tokens and returns a *state* (a Gaussian marginal, a quadrature
   table, ...), differentiable in the model's parameters.
2. :meth:`ConditionalEngine.mask_log_prob` and
   :meth:`ConditionalEngine.chain_log_prob` answer blocks of queries from the
   state, vectorized over queries and datapoints.
"""

import traceback
from abc import ABC, abstractmethod

import torch

from ..code_origin import PACKAGE, is_library, is_own

__all__ = [
    "ConditionalEngine",
    "EngineFallbackWarning",
    "EngineNotApplicable",
    "NumericalWarning",
    "QuadratureAccuracyWarning",
    "SlowEngineWarning",
    "model_failed",
    "fits_form",
    "ordering_ranks",
]


class EngineNotApplicable(ValueError):
    """Raised by :meth:`ConditionalEngine.prepare` when the model is outside what
    the engine serves; the message names the site and what to use instead.
    ``conditionals="auto"`` catches it and tries the next engine."""


class NumericalWarning(UserWarning):
    """A numerical rescue changed the computation, e.g. jitter added to a
    near-singular covariance; the message names the site and the amount.

    :param str message: the warning text.
    :param str site: the observed site concerned.
    :param float jitter: the amount added to the covariance diagonal.
    """

    def __init__(self, message, *, site=None, jitter=None):
        super().__init__(message)
        self.site = site
        self.jitter = jitter


class QuadratureAccuracyWarning(UserWarning, RuntimeWarning):
    r"""A quadrature rule is estimated to be less accurate than the docs state
    (``docs/numerics.md``): the masked conditionals, or :math:`\log p(x)`, move
    by more than the tolerance between the rule and coarser ones. The message
    names the site, the largest estimate and ``num_nodes``, the knob to raise.
    A ``UserWarning`` (and, as before, a ``RuntimeWarning``).

    :param str message: the warning text.
    :param str site: the observed site concerned.
    :param float error: the largest estimated error (nats).
    """

    def __init__(self, message, *, site=None, error=None):
        super().__init__(message)
        self.site = site
        self.error = error


class SlowEngineWarning(UserWarning):
    """``conditionals="auto"`` chose an engine much slower than an alternative
    the model also allows, e.g. a quadrature grid of hundreds of nodes when an
    amortized guide is given; the message names the engine, its size and the
    alternatives. Choose the engine by name to silence it.

    :param str message: the warning text.
    :param str engine: the engine chosen.
    :param int size: its size (quadrature: nodes per datapoint).
    """

    def __init__(self, message, *, engine=None, size=None):
        super().__init__(message)
        self.engine = engine
        self.size = size


class EngineFallbackWarning(UserWarning):
    """``conditionals="auto"`` passed over an engine made for the model's form
    because running the model (or guide) under it raised an error, and chose a
    later engine instead, e.g. prior importance sampling (approximate) after
    exact enumeration failed on a shape bug in the model. The message names the
    engines and the error. Fix the model as the error says, or choose the engine
    by name to silence it.

    :param str message: the warning text.
    :param str engine: the engine chosen.
    :param dict failed: ``{engine: reason}`` of the engines passed over because the
        model failed under them.
    """

    def __init__(self, message, *, engine=None, failed=None):
        super().__init__(message)
        self.engine = engine
        self.failed = dict(failed or {})


def ordering_ranks(order):
    """Each token's position in its ordering: ``ranks[..., order[..., t]] = t``, the same
    shape as ``order`` (long, ``(..., D)``). The first ``t + 1`` positions of an ordering
    are the mask ``ranks <= t``.

    Example::

        >>> ordering_ranks(torch.tensor([[2, 0, 1]]))   # tensor([[1, 2, 0]])
    """
    D = order.shape[-1]
    return torch.empty_like(order).scatter_(-1, order, torch.arange(D, device=order.device).expand_as(order))


def model_failed(error):
    """Whether an :class:`EngineNotApplicable` comes from the model or guide failing
    when an engine ran it, rather than from the engine's checks of the model's form:
    the first exception of its chain (``raise ... from``) is not one of pyro_mpt's
    exception types, and the innermost frame of its traceback outside torch, Pyro
    and the standard library (which models and engines both call) is not pyro_mpt's
    own: a torch shape error or a Pyro error in the model's own lines, the user's own
    exception. A model whose every line is library code (``pyro.contrib``) is not
    blamed.

    Example::

        >>> try:
        ...     engine.prepare(tokens, model, None, args, kwargs)
        ... except EngineNotApplicable as e:
        ...     model_failed(e)   # True for a shape bug in the model
    """
    if getattr(error, "blames_model", False):
        return True  # an engine that ran the model and found its output shaped wrong says so
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    if root is error or type(root).__module__.startswith(PACKAGE):
        return False
    for frame in reversed(traceback.extract_tb(root.__traceback__)):
        if is_own(frame.filename):
            return False
        if not is_library(frame.filename):
            return True
    return False


def fits_form(error):
    """Whether an engine's refusal ``error`` (an :class:`EngineNotApplicable`) is of an
    engine made for the model's form that cannot read the way it is written, and says what to
    write instead (a hierarchy's groups declared inside their observations): the refusals that
    ``Evidence(method='exact')`` puts first and that ``"auto"`` warns about when it goes on,
    as for :func:`model_failed`. The engine sets ``error.fits_form = True``.

    Example::

        >>> try:
        ...     HierarchicalGaussianConditionals().prepare(tokens, model, None, args, kwargs)
        ... except EngineNotApplicable as e:
        ...     fits_form(e)   # True: "Declare the plates the other way round ..."
    """
    return bool(getattr(error, "fits_form", False))


class ConditionalEngine(ABC):
    """Base class of conditional engines.

    Subclasses implement :meth:`prepare` and :meth:`mask_log_prob`; they may
    override :meth:`chain_log_prob` with a faster path for complete orderings
    and :meth:`log_evidence` when :math:`\\log p(x)` is available.

    :param int max_elements: bound on the number of elements of the largest
        intermediate tensor an engine creates per chunk; engines split blocks
        further to stay under it.

    Example (the whole engine, exact for a latent class model, is
    ``docs/snippets/latent_class_engine.py``; docs/engines.rst walks through it)::

        >>> class MyConditionals(ConditionalEngine):
        ...     def prepare(self, tokens, model, guide, args, kwargs):
        ...         return ...  # whatever mask_log_prob needs, from the traced model
        ...     def mask_log_prob(self, state, x, mask):
        ...         return ...  # (q, n, D): log p(x_j | x_context) at the targets
        >>> loss = MaskedPretrainingLoss(conditionals=MyConditionals())
    """

    def __init__(self, *, max_elements=2**24):
        self.max_elements = int(max_elements)

    @abstractmethod
    def prepare(self, tokens, model, guide, args, kwargs):
        """Build the engine state for one evaluation.

        :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced observed tokens.
        :param callable model: the Pyro model.
        :param callable guide: the Pyro guide or ``None``.
        :param tuple args: model arguments.
        :param dict kwargs: model keyword arguments.
        :returns: an engine-specific state object.
        """
        raise NotImplementedError

    @abstractmethod
    def mask_log_prob(self, state, x, mask):
        r"""Log-conditionals of the masked tokens given the unmasked ones.

        :param state: the object returned by :meth:`prepare`.
        :param torch.Tensor x: tokens, shape ``(n, D)``.
        :param torch.Tensor mask: bool, shape ``(q, n, D)`` or ``(q, 1, D)``;
            True marks a target, False a context token.
        :returns: :math:`\log p(x_j \mid x_{\neg\text{mask}})` at every masked
            ``j``, shape ``(q, n, D)``; entries at unmasked tokens are arbitrary
            finite numbers.
        """
        raise NotImplementedError

    def chain_log_prob(self, state, x, order):
        r"""Chain-rule terms along complete orderings.

        :param torch.Tensor order: long, shape ``(p, n, D)`` or ``(p, 1, D)``.
        :returns: ``(p, n, D)`` whose entry ``[.., t]`` is
            :math:`\log p(x_{\pi_t} \mid x_{\pi_{t+1}}, \dots, x_{\pi_D})`.

        The default asks :meth:`mask_log_prob` one mask per position (the
        first ``t + 1`` tokens of the ordering) and keeps the target's term;
        engines with a sequential structure override it.
        """
        p, rows, D = order.shape
        n = x.shape[0]
        ranks = ordering_ranks(order)
        # query k = i * D + t: ordering i's first t + 1 tokens hidden, all orderings in
        # blocks of masks rather than one ordering at a time
        per_block = max(1, self.max_elements // (n * D))
        terms = []
        for start in range(0, p * D, per_block):
            k = torch.arange(start, min(p * D, start + per_block), device=order.device)
            i, t = k // D, k % D
            mask = ranks[i] <= t[:, None, None]  # (c, rows, D)
            logc = self.mask_log_prob(state, x, mask)  # (c, n, D)
            target = order[i, :, t].unsqueeze(-1).expand(-1, n, 1)  # (c, n, 1)
            terms.append(logc.gather(-1, target).squeeze(-1))  # (c, n)
        return torch.cat(terms, 0).reshape(p, D, n).transpose(1, 2)

    def _check_x(self, state, x):
        """Refuse tokens ``x`` whose shape differs from the ``(n, D)`` the state was prepared for."""
        if x.dim() != 2 or x.shape[0] != state.num_data or x.shape[-1] != state.num_tokens:
            raise ValueError(
                f"{type(self).__name__}: x has shape {tuple(x.shape)} but the state was "
                f"prepared for ({state.num_data}, {state.num_tokens}) tokens; pass the "
                f"tokens the state was prepared with, or prepare() a state for these."
            )

    def mask_sums(self, state, x, mask):
        r"""Summed log-conditionals of each mask's targets, shape ``(q, n)``.

        :math:`\sum_{j \in \mathcal M_q} \log p(x_j \mid x_{\mathcal R_q})`, what the
        schedules consume. The default sums :meth:`mask_log_prob`; engines can
        override it to avoid forming the ``(q, n, D)`` table.
        """
        logc = self.mask_log_prob(state, x, mask)
        zero = torch.zeros((), dtype=logc.dtype, device=logc.device)
        return torch.where(mask, logc, zero).sum(-1)

    def mask_sums_within(self, state, x, mask, context):
        r"""Summed log-conditionals of each mask's targets given the context tokens
        alone, shape ``(q, n)``:
        :math:`\sum_{j \in \mathcal M_q} \log p(x_j \mid x_{\mathcal C \setminus \mathcal M_q})`.
        Tokens outside ``context`` (missing ones) are neither context nor summed.

        The default sums :meth:`mask_log_prob` with them hidden too; engines can
        override it to avoid forming the ``(q, n, D)`` table.

        :param torch.Tensor mask: bool ``(q, n|1, D)``, True at a target (inside ``context``).
        :param torch.Tensor context: bool ``(q|1, n, D)``, True at a token that may be context.
        :returns: ``(q, n)``.

        Example::

            >>> engine.mask_sums_within(state, x, mask, observed[None])   # missing tokens left out
        """
        logc = self.mask_log_prob(state, x, mask | ~context)
        zero = torch.zeros((), dtype=logc.dtype, device=logc.device)
        return torch.where(mask, logc, zero).sum(-1)

    def validates_model(self, tokens):
        """Whether :meth:`prepare` runs the model again and constructs there every
        distribution of ``tokens``' model trace (for every value its latents take there),
        under Pyro's argument validation as the caller left it. Where it does,
        :class:`~pyro_mpt.MaskedPretrainingLoss` traces the model without that validation at
        later steps, since a bad argument still raises Pyro's error here (and, should
        anything fail, it traces again with validation, as before). The default, False,
        is always safe.

        :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: what :meth:`prepare` took.
        :returns: bool.

        Example::

            >>> engine.validates_model(tokens)   # False unless the engine says so
            False
        """
        return False

    def averages_hidden_draws(self):
        """Whether the engine's values are Monte Carlo averages over runs of the model, which
        take a draw the trace does not see (a ``torch.randn`` inside the model) as they take
        the latents they sample (importance sampling, encoding--decoding). Where False (the
        default: the engine integrates the trace's latents), such a draw makes every call
        another number, and :meth:`~pyro_mpt.MaskedPretrainingLoss.score` and
        :meth:`~pyro_mpt.MaskedPretrainingLoss.curve` refuse the model, as
        :class:`~pyro_mpt.evidence.Evidence` does
        (:func:`~pyro_mpt.hidden_randomness.check_no_hidden_randomness`)."""
        return False

    def reads_latent_draws(self):
        """Whether :meth:`prepare` reads the values the model trace drew for the latents
        (a prior draw where there is no guide), not only their distributions, shapes and
        dtypes. Where it does not, :class:`~pyro_mpt.MaskedPretrainingLoss` traces the
        model at later steps with each latent at its prior mean (Pyro's ``init_to_mean``)
        instead of a draw: a PPCA step at N = 1000, K = 50 drew 50 000 normals it never
        read (1.5 ms in float64, a third of the step at D = 10). The default, True, is
        always safe.

        :returns: bool.

        Example::

            >>> GaussianConditionals().reads_latent_draws()   # the marginal comes from its own runs
            False
        """
        return True

    def chain_sums_reads_order(self, state):
        r"""Whether :meth:`chain_sums` reads the orderings' values, not only how many there are.

        Engines whose conditionals come from one joint distribution return
        False: every ordering telescopes to :math:`\log p(x)`, so their
        :meth:`chain_sums` is one evaluation of it, repeated. The estimator then
        draws no orderings for them (``n`` random permutations of ``D`` tokens,
        a sort of :math:`nD` keys, could cost several times that evaluation) and
        passes a stand-in of the orderings' shape ``(p, n, D)`` whose values are
        not orderings. The default, True, is always safe.

        :returns: bool.

        Example::

            >>> GaussianConditionals().chain_sums_reads_order(state)
            False
        """
        return True

    def recomputes_mask_sums(self, state, x, mask, context=None):
        """Whether :meth:`mask_sums` for these masks (:meth:`mask_sums_within` with
        ``context``) keeps nothing of the size of its
        conditionals for the backward pass (its own backward pass recomputes them,
        e.g. an autograd Function with a written backward), so that its memory
        stays bounded without activation checkpointing.

        :func:`~pyro_mpt.estimate.mpt_estimate` evaluates such a block once
        instead of under checkpointing (which evaluates it twice). The default,
        False, is always safe.

        :param torch.Tensor mask: bool, ``(q, n|1, D)``.
        :param torch.Tensor context: bool ``(q|1, n, D)`` or None, as :meth:`mask_sums_within` takes it.
        :returns: bool.

        Example::

            >>> engine.recomputes_mask_sums(state, x, mask)   # False unless the engine says so
            False
        """
        return False

    def weighted_mask_sum(self, state, x, mask, coef):
        r"""The coefficient-weighted sum of the summed log-conditionals of masks
        shared by the batch, shape ``(n,)``:

        .. math:: \sum_q c_q \sum_{j \in \mathcal M_q}
            \log p(x_{ij} \mid x_{i\mathcal R_q}),

        what a loss needs from a group of shared masks when no per-query score
        is kept (no curve): :func:`~pyro_mpt.estimate.mpt_estimate` asks it with
        :math:`c_q = w_q / M_q` (the schedule's weight over the mask size). The
        default sums :meth:`mask_sums`; an engine whose conditionals are
        quadratic forms in the data overrides it with one aggregated form for
        all queries (:class:`~pyro_mpt.conditionals.GaussianConditionals`).

        :param state: the object returned by :meth:`prepare`.
        :param torch.Tensor x: tokens, shape ``(n, D)``.
        :param torch.Tensor mask: bool, shape ``(q, D)``, shared by the batch;
            True marks a target.
        :param torch.Tensor coef: shape ``(q,)``, the coefficients :math:`c_q`.
        :returns: shape ``(n,)``.

        Example::

            >>> engine.weighted_mask_sum(state, x, mask, weight / mask.sum(-1))   # (n,)
        """
        sums = self.mask_sums(state, x, mask.unsqueeze(1))  # (q, n)
        return (coef.to(sums.dtype).unsqueeze(-1) * sums).sum(0)

    def leave_one_out_log_prob(self, state, x, observed=None):
        r"""Every token's conditional given all the others, from one pass, shape ``(n, D)``:

        .. math:: \ell_{ij} = \log p(x_{ij} \mid x_{i,-j}),

        or None where the engine has no such pass for ``state`` (the default). With
        ``observed`` (bool ``(n, D)``, missing tokens) the conditionals given the other
        observed tokens, :math:`\log p(x_{ij} \mid x_{i, O_i \setminus j})`, 0 at a missing
        token, or None where the engine has no such pass.
        :func:`~pyro_mpt.estimate.mpt_estimate` asks it for the queries that each hide
        one token, shared by the batch (a :class:`~pyro_mpt.mask_blocks.MaskBlock`
        with ``targets``, the ``"pll"`` schedule): :math:`D` queries then cost one pass
        and their masks (:math:`D^2` bits) are never made. Where it returns None they
        take :meth:`weighted_mask_sum` (or :meth:`mask_sums` for curves) like any
        other masks.

        :param state: the object returned by :meth:`prepare`.
        :param torch.Tensor x: tokens, shape ``(n, D)``.
        :param torch.Tensor observed: bool ``(n, D)`` or None.
        :returns: shape ``(n, D)`` in the dtype of the engine's results, or None.

        Example::

            >>> GaussianConditionals().leave_one_out_log_prob(state, x).sum(-1)   # (n,) the PLL
        """
        return None

    def weighted_sum_elements(self, state, x, mask=None):
        """Elements of :meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum`'s
        working set per query, for tokens ``x``.

        :func:`~pyro_mpt.estimate.mpt_estimate` merges the blocks of shared
        masks a schedule yields into groups of at most ``max_elements`` over
        this many queries, one
        :meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum` call each. The
        default, ``n * D``, is the size of one query's table of conditionals;
        an engine whose working set per query does not grow with the data
        declares less, and gets fewer, larger groups; one whose per-query
        factors outgrow the data (one datapoint of many tokens) declares
        more, and gets smaller groups, each recomputed in the backward pass.

        :param torch.Tensor mask: bool ``(q, D)``, the first block's masks when they
            are shared by the batch and already drawn, else None: an engine may
            declare less for masks it serves on a cheaper path.
        :returns: int.
        """
        return x.shape[0] * x.shape[1]

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along complete orderings, shape ``(p, n)``.

        :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens,
            or None. The orderings then list each datapoint's missing tokens
            first, so that no observed token is conditioned on one, and the sums
            leave out the terms whose target is missing: they estimate
            :math:`\log p(x_{O_i})`.

        The default sums :meth:`chain_log_prob` over positions.
        """
        logc = self.chain_log_prob(state, x, order)  # (p, n, D)
        if observed is not None:
            shape = logc.shape
            target_observed = observed.expand(shape).gather(-1, order.expand(shape))
            logc = torch.where(target_observed, logc, torch.zeros((), dtype=logc.dtype, device=logc.device))
        return logc.sum(-1)

    def log_evidence(self, state, x):
        """Per-datapoint :math:`\\log p(x)`, shape ``(n,)``, when the engine has it."""
        raise NotImplementedError(f"{type(self).__name__} does not compute log p(x).")

    def __repr__(self):
        return f"{type(self).__name__}()"
