r"""Exact masked conditionals of models with discrete latents, by enumeration.

When every latent of a datapoint is discrete with finite support --
``Categorical``, ``Bernoulli``, ``OneHotCategorical``, ``Binomial``, ... in the
data plate, with or without ``@config_enumerate``, also with event dims such as
binary features ``Bernoulli(p).expand([L]).to_event(1)``, whose joint support is
the :math:`2^L` value vectors (Pyro enumerates no ``Independent``; this engine
does), or written as a plate of their own, ``pyro.plate("features", L)`` inside
the data plate (Pyro would enumerate each element apart; this engine enumerates
the :math:`2^L` arrays jointly, so the model must keep the plate's dim where it
reads them, e.g. ``(f.unsqueeze(-1) * W.unsqueeze(-2)).sum(-3, keepdim=True)``) --
and the tokens are
independent given them, the model is a finite mixture over the latents' joint
support :math:`\mathcal Z = \mathcal Z_1 \times \dots \times \mathcal Z_L`:

.. math::

    p(x) = \sum_{z \in \mathcal Z} p(z) \prod_d p(x_d \mid z),

and every masked conditional is an exact ratio of two sums over
:math:`\mathcal Z` (see :mod:`~pyro_mpt.conditionals.mixture`). The engine runs
the model once under Pyro's parallel enumeration (``poutine.enum``, each latent
in its own batch dim left of the plates), reads :math:`\log p(z)` from the
latent sites and :math:`T_{zd} = \log p(x_d \mid z)` from the observed site's
base distribution, and hands both to a
:class:`~pyro_mpt.conditionals.mixture.MixtureTable`. Latents may depend on
each other (a ``Bernoulli`` whose probability is indexed by a ``Categorical``);
the table holds the whole joint support, so it refuses supports larger than
``max_support`` (use ``conditionals="importance"`` there).

**Mixtures written as one observation.** An observed site
``dist.MixtureSameFamily(dist.Categorical(w), components)`` with no latent site,
whose components factorize over the tokens (``dist.Normal(locs, scales).to_event(1)``),
is the same finite mixture with the component index in place of a latent: its
weights are :math:`\log p(z)` and its components' per-token log-densities the table.
Components that are ``MultivariateNormal`` (or ``LowRankMultivariateNormal``), a
full-covariance Gaussian mixture, go to the Gaussian mixture table below; so does
an observation ``dist.MultivariateNormal(locs[z], covs[z])`` indexed by discrete
latent sites, whose components are read from the enumerated run.

**Linear-Gaussian components.** Normal latents beside the discrete ones (a
mixture of PPCA: :math:`z \sim \mathrm{Categorical}(w)`,
:math:`u \sim \mathcal N(0, I)`, :math:`x \mid z, u \sim \mathcal N(W_z u + \mu_z,
\sigma_z^2 I)`) make each component a Gaussian over the tokens, which no longer
factorize. The engine then conditions the model on each joint value of the
discrete latents, derives that component's Gaussian marginal with
:func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal` (one call per
support point), and reduces the Gaussian mixture with
:class:`~pyro_mpt.conditionals.gaussian_mixture.GaussianMixtureTable`. Normal latents in a
token plate (a class per group beside a random effect per item) make each component a
linear-Gaussian hierarchy, whose marginal
:func:`~pyro_mpt.conditionals.hierarchical.hierarchical_marginal` reads. The discrete
latents' prior must not depend on the Normal ones: sampled first, it cannot;
sampled after them, Pyro's provenance tracking
(:func:`pyro.infer.inspect.get_dependencies`) checks that it does not read them.

**A discrete latent per token** (a zero-inflation switch :math:`s_d` in the token
plate, ``token_plates=("tokens",)``, possibly depending on the datapoint's latents
:math:`c`) is summed in its token's entry of the table,
:math:`T_{cd} = \log \sum_{s_d} p(s_d \mid c)\, p(x_d \mid s_d, c)`, so the
mixture runs over :math:`c` alone. The observation then has no event dims beside
the token plates, and the other latents are discrete.

**A mixture of HMMs.** A ``dist.DiscreteHMM`` observation whose parameters the discrete
latents pick (a class per sequence: ``trans[c]``, ``locs[c]``) makes each joint value a
chain; :class:`~pyro_mpt.conditionals.hmm.DiscreteHMMMixture` sums the components'
forward--backward sums (continuous latents beside them are refused).

Latents drawn inside ``pyro.markov`` get a dim each all the same (the joint is summed
here, not eliminated variable by variable), so a chain observed as one site is one
finite mixture of at most ``max_support`` values. An HMM with one observed site per step
is refused (its tokens are several sites): write the chain as one ``dist.DiscreteHMM``
observation, served exactly by :mod:`~pyro_mpt.conditionals.hmm` at any length.
"""

import itertools
import math
import warnings
from dataclasses import dataclass, field, replace

import torch
from pyro import poutine
import pyro.distributions as dist
from pyro.poutine.messenger import Messenger
from pyro.infer.inspect import get_dependencies

from ..code_origin import user_stacklevel
from ..model_keys import PassedChecks, callable_key
from ..observed_tokens import check_local_latent
from ..token_site import vectorized_frames
from .base import ConditionalEngine, EngineNotApplicable, SlowEngineWarning
from .distributions import base_distribution, check_factorized, check_one_sequence, compact, token_log_prob, unwrap
from .gaussian_marginal import gaussian_marginal
from .gaussian_mixture import GaussianMixtureTable
from .hierarchical import hierarchical_marginal
from .hmm import DiscreteHMMMixture, discrete_hmm_state
from .leave_one_out_queries import LeaveOneOutQueries
from .mixture import MixtureTable
from .plate_runs import agrees_with_point_run

__all__ = ["EnumerateConditionals", "EnumerateState"]

_WHO = "conditionals='enumerate'"

#: the models whose enumerated run's log-densities agreed with runs at single values (``(data shape, sizes)``)
_VALUE_RUNS_AGREE = PassedChecks(keep=8)

#: the most joint values of the discrete latents for which a model that does not run on all
#: of them at once is run once per value (each run a model run with its graph, every step)
MAX_VALUE_RUNS = 64


def _support_size(fn):
    return int(fn.enumerate_support(expand=False).shape[0])


class _JointSupport(dist.TorchDistribution):
    """A discrete latent whose elements are enumerated jointly: the elements of its event
    dims (``Bernoulli(p).to_event(1)``: Pyro enumerates no ``Independent``) and of the plates
    it sits in that the observation lacks (binary features written as
    ``pyro.plate("features", L)``: Pyro enumerates a plate's elements one by one, which the
    observation, reading all of them, does not allow). Its support is every array of element
    values, ``m ** E`` of them (``m`` values per element, ``E`` elements); those plate dims
    have size one in its batch shape, and :meth:`log_prob` sums over them.

    :param fn: the site's distribution, broadcast to its plates.
    :param tuple plate_dims: the dims of ``fn.batch_shape`` (negative) to enumerate jointly.
    """

    arg_constraints = {}
    has_enumerate_support = True

    def __init__(self, fn, plate_dims=()):
        self.fn = fn
        self.plate_dims = tuple(plate_dims)
        nb = len(fn.batch_shape)
        # the value's shape (without the enumeration dim): the plates' sizes, 1 at the other batch dims
        self.layout = torch.Size(fn.batch_shape[i] if i - nb in self.plate_dims else 1 for i in range(nb))
        super().__init__(torch.Size(1 if i - nb in self.plate_dims else b for i, b in enumerate(fn.batch_shape)),
                         fn.event_shape, validate_args=False)

    @property
    def support(self):
        return self.fn.support

    def enumerate_support(self, expand=True):
        fn = self.fn
        if fn.has_enumerate_support:
            # an element is one native value (a one-hot vector of OneHotCategorical)
            values = fn.enumerate_support(expand=False)
            cell = tuple(fn.event_shape)
            values = values.reshape((values.shape[0],) + cell)
            layout = tuple(self.layout)
        else:
            values = unwrap(fn)[0].enumerate_support(expand=False).reshape(-1)
            cell = ()
            layout = tuple(self.layout) + tuple(fn.event_shape)
        E = math.prod(layout)
        index = torch.cartesian_prod(*[torch.arange(values.shape[0], device=values.device)] * E).reshape(-1, E)
        support = values[index].reshape((-1,) + layout + cell)
        if expand:
            support = support.expand((support.shape[0],) + self.fn.batch_shape + self.event_shape)
        return support

    def log_prob(self, value):
        lp = self.fn.log_prob(value)
        for d in self.plate_dims:
            if lp.dim() >= -d:
                lp = lp.sum(d, keepdim=True)
        return lp


def _event_discrete(fn):
    """The ``(base, reinterpreted dims)`` of a discrete latent with event dims made of
    elementwise discrete values (``Bernoulli(p).to_event(1)``, ``Categorical(probs).to_event(1)``),
    else None."""
    if fn.has_enumerate_support or not fn.event_shape:
        return None
    base, reinterpreted = unwrap(fn)
    if not base.has_enumerate_support or base.event_shape or reinterpreted != len(fn.event_shape):
        return None
    return base, reinterpreted


def _enumerable(fn):
    return fn.has_enumerate_support or _event_discrete(fn) is not None


def _extra_plates(tokens, site):
    """``{dim: size}`` of the plates of latent ``site`` that are neither data nor token plates
    of the observed site: a datapoint's latent elements, enumerated jointly (:class:`_JointSupport`)."""
    data = {f.name for f in tokens.data_frames} | set(tokens.token_plates)
    return {f.dim: f.size for f in vectorized_frames(site, 2) if f.name not in data}


def _per_token(tokens, site):
    """Whether latent ``site`` holds one finite value per token: it sits in every token plate of
    the observed site, whose event has no dims (so a token plate element is one token), has no
    event dims or plates of its own to enumerate jointly, and enumerates its support."""
    token_names = set(tokens.token_plates)
    own = {f.name for f in vectorized_frames(site, 2)}
    return (
        bool(token_names) and token_names <= own and not tokens.event_shape
        and site["fn"].has_enumerate_support and not site["fn"].event_shape
        and not _extra_plates(tokens, site)
    )


def _in_token_plates(tokens, name):
    """Whether latent ``name`` sits in a token plate of the observed site (one value per unit)."""
    plates = set(tokens.token_plates)
    return any(f.name in plates for f in tokens.model_trace.nodes[name]["cond_indep_stack"])


def _joint_support_size(fn, plates):
    """Values of a latent's joint support: ``m ** E`` over its ``E`` elements (the plates'
    elements times the event's, or its native values per plate element)."""
    elements = math.prod(plates.values())
    if fn.has_enumerate_support:
        return _support_size(fn) ** elements
    base, _ = _event_discrete(fn)
    return _support_size(base) ** (elements * math.prod(fn.event_shape))


class _JointEnumeration(Messenger):
    """Give the named discrete sites a :class:`_JointSupport` over their event dims and the
    given plate dims, so that ``poutine.enum`` enumerates their joint support."""

    def __init__(self, plates):
        super().__init__()
        self.plates = plates  # {name: (dim, ...)}

    def _pyro_sample(self, msg):
        if msg["name"] in self.plates and not msg["is_observed"]:
            msg["fn"] = _JointSupport(msg["fn"], self.plates[msg["name"]])


class _GlobalEnumDims(Messenger):
    """Drop the ``pyro.markov`` scopes of the sites it sees, so that ``poutine.enum`` gives
    every discrete latent a dim of its own.

    ``pyro.markov`` tells Pyro's variable elimination which latents a site depends on, and
    the enumeration recycles the dims of those out of scope. This engine sums the joint
    support itself, so recycled dims would put two latents on one dim; and a model whose
    observation reads every step (a stack of the chain's states) is not Markov in the
    sense ``pyro.markov`` declares, which the joint enumeration does not need."""

    def _pyro_sample(self, msg):
        msg["infer"].pop("_markov_scope", None)
        msg["infer"].pop("_markov_depth", None)


@dataclass
class EnumerateState:
    """The mixture over the latents' joint support, for one evaluation.

    :param mixture: the :class:`~pyro_mpt.conditionals.mixture.MixtureTable`
        (weights :math:`\\log p(z)` ``(K, n)``, table ``(K, n, D)``), or a
        :class:`~pyro_mpt.conditionals.gaussian_mixture.GaussianMixtureTable` when the
        model has Normal latents besides the discrete ones.
    :param dict support: support size of each latent site, in enumeration order.
    """

    mixture: object = field(repr=False)
    num_data: int
    num_tokens: int
    support: dict


_GAUSSIANS = (torch.distributions.MultivariateNormal, torch.distributions.LowRankMultivariateNormal)


def _component_rows(t, K, batch, n, tail):
    """A component parameter ``(*b, K, *tail)`` as ``(K, n|1, *tail)``: one row when
    the datapoints share it."""
    t = t.movedim(-1 - len(tail), 0)
    if t[0].numel() == math.prod(tail):
        return t.reshape((K, 1) + tail)
    return t.expand((K,) + tuple(batch) + tail).reshape((K, n) + tail)


def _mixture_observation(tokens):
    """The observed site's ``MixtureSameFamily`` when it is the whole datapoint's
    distribution (its event dims are the tokens, no token plates), else None."""
    fn = base_distribution(tokens.site["fn"])
    if not isinstance(fn, torch.distributions.MixtureSameFamily):
        return None
    if tuple(fn.event_shape) != tuple(tokens.event_shape) or tokens.site_batch_shape != tokens.batch_shape:
        return None
    return fn


def _gaussian_observation(tokens):
    """The observed site's ``MultivariateNormal`` (or low-rank) when it is the whole
    datapoint's distribution (its one event dim holds the tokens, no token plates), else None."""
    fn = base_distribution(tokens.site["fn"])
    if not isinstance(fn, _GAUSSIANS) or tuple(fn.event_shape) != tuple(tokens.event_shape):
        return None
    return fn if tokens.site_batch_shape == tokens.batch_shape else None


def _hmm_observation(tokens):
    """The observed site's ``DiscreteHMM``, or None."""
    fn = base_distribution(tokens.site["fn"])
    return fn if isinstance(fn, dist.DiscreteHMM) else None


def _check_discrete_prior_free_of(tokens, model, args, kwargs, sizes, continuous):
    r"""Refuse a discrete latent sampled after continuous ones whose prior reads them.

    The mixture's weights are the discrete latents' :math:`\log p(z)`, read with the
    continuous latents held at one value, so they must not depend on them. Sampled
    first, they cannot; sampled later (``u ~ N(0, I)`` and then ``z ~ Categorical(w)``,
    the same joint distribution), Pyro's provenance tracking
    (:func:`pyro.infer.inspect.get_dependencies`) says whether they do.
    """
    order = list(tokens.latent_names)
    first = min(order.index(c) for c in continuous)
    late = [k for k in sizes if order.index(k) > first]
    if not late:
        return
    try:
        prior = get_dependencies(model, args, kwargs)["prior_dependencies"]
        reads = {k: sorted(set(prior[k]) & set(continuous)) for k in late}
        why = next(((k, v) for k, v in reads.items() if v), None)
        if why is None:
            return
        because = f"its distribution reads {', '.join(map(repr, why[1]))}"
    except Exception as e:  # a model that provenance tracking cannot run: unknown
        why = (late[0], None)
        because = (f"Pyro's dependency tracking could not run the model ({type(e).__name__}: {e}), "
                   f"so its distribution may depend on them")
    raise EngineNotApplicable(
        f"{_WHO}: discrete latent {why[0]!r} is sampled after the continuous latent(s) "
        f"{', '.join(map(repr, continuous))} and {because}: the model is not a mixture of "
        f"Gaussians whose weights are the discrete latents' prior. Use conditionals='importance'."
    )


class EnumerateConditionals(LeaveOneOutQueries, ConditionalEngine):
    r"""Exact masked conditionals by summing over the discrete latents' joint support.

    Serves models whose latents are all discrete with finite support
    (``has_enumerate_support``), local to each datapoint, with the tokens
    independent given them. See the module docstring.

    :param int max_support: refuse models whose latents' joint support
        (the product of the sites' support sizes) exceeds this.
    :param int max_elements: bound on ``q * K * n * D`` per chunk.

    Example::

        >>> @config_enumerate            # optional
        ... def gmm(x):
        ...     with pyro.plate("data", len(x)):
        ...         z = pyro.sample("z", dist.Categorical(weights))
        ...         pyro.sample("x", dist.Normal(locs[z], scales[z]).to_event(1), obs=x)
        >>> MaskedPretrainingLoss(conditionals="enumerate", masks="exhaustive").score(gmm, None, x)
    """

    def __init__(self, *, max_support=4096, max_elements=2**24):
        super().__init__(max_elements=max_elements)
        self.max_support = int(max_support)
        #: ``callable_key`` of the models that run once per value (the vectorized run failed)
        self.per_value_models = set()

    def __repr__(self):
        return f"EnumerateConditionals(max_support={self.max_support})"

    def _check(self, tokens):
        latents = tokens.latent_sites()
        if not latents and _mixture_observation(tokens) is not None:
            return None, None, None
        if not latents:
            raise EngineNotApplicable(
                f"{_WHO} sums over discrete latents, but the model of observed site "
                f"{tokens.name!r} has no latent site."
            )
        sizes, continuous, per_token = {}, [], []
        discrete = any(_enumerable(site["fn"]) for site in latents)
        for site in latents:
            fn = site["fn"]
            if _per_token(tokens, site):
                # one value per token (a zero-inflation switch): summed inside its token's
                # entry of the table, so it does not count in the joint support
                check_local_latent(tokens, site, EngineNotApplicable, allow_token_plates=True,
                                   consequence=f"{_WHO} cannot sum it per datapoint")
                per_token.append(site["name"])
                continue
            if not _enumerable(fn) and discrete:
                # a mixture of linear-Gaussian components (e.g. a mixture of PPCA): each
                # component's Gaussian marginal is derived, or refused, by gaussian_marginal
                # (by hierarchical_marginal where a latent sits in a token plate: a random
                # effect per item); a global one first gets the global latent's message
                check_local_latent(tokens, site, EngineNotApplicable, allow_token_plates=True,
                                   consequence=f"{_WHO} cannot sum it per datapoint")
                continuous.append(site["name"])
                continue
            if not _enumerable(fn):
                raise EngineNotApplicable(
                    f"{_WHO} needs every latent to be discrete with finite support, but "
                    f"latent site {site['name']!r} is {type(base_distribution(fn)).__name__}"
                    f"{' with event dims' if fn.event_shape else ''}, which has no "
                    f"enumerate_support. Use "
                    + ("conditionals='importance' (it samples the latent; 'quadrature' integrates "
                       "continuous latents only)." if fn.support.is_discrete
                       else "conditionals='quadrature' or 'importance'.")
                )
            check_local_latent(tokens, site, EngineNotApplicable,
                               consequence=f"{_WHO} cannot sum it per datapoint")
            sizes[site["name"]] = _joint_support_size(fn, _extra_plates(tokens, site))
        if per_token and continuous:
            raise EngineNotApplicable(
                f"{_WHO}: latent(s) {', '.join(map(repr, per_token))} sit one per token and "
                f"{', '.join(map(repr, continuous))} are continuous; summing per-token latents in "
                f"the table needs the other latents discrete. Use conditionals='importance'."
            )
        K = math.prod(sizes.values())
        if K > self.max_support:
            parts = " x ".join(f"{k!r} ({v})" for k, v in sizes.items())
            raise EngineNotApplicable(
                f"{_WHO}: the joint support of the discrete latents of observed site "
                f"{tokens.name!r} has {parts} = {K} values, more than max_support="
                f"{self.max_support}. Use conditionals='importance' (it samples the latents), "
                f"or raise max_support if a ({K}, {tokens.num_data}, {tokens.num_tokens}) table fits."
            )
        if _hmm_observation(tokens) is not None:
            # a mixture of chains (a class latent that picks a sequence's transitions)
            if continuous or per_token or tokens.token_dims:
                raise EngineNotApplicable(
                    f"{_WHO} sums discrete latents beside the DiscreteHMM at site {tokens.name!r} "
                    f"(a mixture of chains), one set of values a sequence; "
                    + (f"latent(s) {', '.join(map(repr, continuous))} are continuous. "
                       if continuous else "the model has latents or token plates within a sequence. ")
                    + "Use conditionals='importance'."
                )
            check_one_sequence(tokens, _hmm_observation(tokens), _WHO)
            return sizes, continuous, per_token
        if not continuous and _gaussian_observation(tokens) is None:
            check_factorized(
                tokens.site["fn"], tokens.name, _WHO,
                instead="a dist.DiscreteHMM observation is served by conditionals='hmm'",
            )
        return sizes, continuous, per_token

    def validates_model(self, tokens):
        """True where :meth:`prepare` enumerates: its run of the model, replayed on the
        tokens' trace with every discrete latent enumerated, constructs each distribution
        of the sampled trace at every value of those latents (the only path that does
        not, a ``MixtureSameFamily`` observation without latents, returns False)."""
        return bool(tokens.latent_sites())

    def prepare(self, tokens, model, guide, args, kwargs):
        sizes, continuous, per_token = self._check(tokens)
        if sizes is None:
            return self._mixture_same_family(tokens)
        mpn = tokens.max_plate_nesting
        names = set(sizes) | set(per_token)
        replayed = poutine.replay(model, trace=tokens.subsample_trace())
        if continuous:
            _check_discrete_prior_free_of(tokens, replayed, args, kwargs, sizes, continuous)
        if continuous:
            # only the discrete sites' log p(z) is read from this run: hold the others fixed
            fixed = {name: tokens.model_trace.nodes[name]["value"] for name in continuous}
            replayed = poutine.condition(replayed, data=fixed)
        # every latent is enumerated in parallel, whatever the model's own infer config says
        configured = poutine.infer_config(
            replayed, lambda msg: {"enumerate": "parallel"} if msg["name"] in names else {}
        )
        joint = {}
        for site in tokens.latent_sites():
            plates = _extra_plates(tokens, site)
            if site["name"] in names and (plates or not site["fn"].has_enumerate_support):
                joint[site["name"]] = tuple(plates)
        if joint:
            configured = _JointEnumeration(joint)(configured)
        configured = _GlobalEnumDims()(configured)
        by_value = not (continuous or per_token or joint) and _hmm_observation(tokens) is None and \
            math.prod(sizes.values()) <= MAX_VALUE_RUNS
        if by_value and callable_key(model) in self.per_value_models:
            return self._per_value(tokens, model, args, kwargs, sizes)
        try:
            trace = poutine.trace(poutine.enum(configured, first_available_dim=-(mpn + 1))).get_trace(*args, **kwargs)
        except Exception as e:  # the user's model fails on enumerated values: say how to fix it
            if by_value:
                return self._falling_back(tokens, model, args, kwargs, sizes, e)
            raise EngineNotApplicable(
                f"{_WHO} runs the model with all values of the discrete latents "
                f"({', '.join(map(repr, sizes))}) at once, in batch dims left of dim -{mpn}, and "
                f"the model failed there ({type(e).__name__}: {e}). Each latent has a dim of its "
                f"own there: broadcast latents before combining them (torch.stack(torch.broadcast_"
                f"tensors(*states), -1), not torch.stack(states, -1)), index parameters with the "
                f"latent (e.g. locs[z]) instead of branching on its value, or use "
                f"conditionals='importance'."
            ) from e
        try:
            state = self._tables(tokens, model, args, kwargs, trace, sizes, continuous, per_token, mpn)
        except RuntimeError as e:
            if isinstance(e, torch.linalg.LinAlgError):
                raise
            if by_value:
                return self._falling_back(tokens, model, args, kwargs, sizes, e)
            # the model ran, but its log-densities do not keep the enumerated values in the dims
            # left of the plates (a reduction or index counted from the left): a raw shape error of
            # torch's from inside the engine before, with nothing on what to change in the model
            error = EngineNotApplicable(
                f"{_WHO} ran the model with all values of the discrete latents "
                f"({', '.join(map(repr, sizes))}) at once, in batch dims left of dim -{mpn}, and the "
                f"log-densities it gave do not keep those values in those dims ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}): the model moves the enumerated dims, e.g. a sum over a "
                f"plate of latents counted from the left (.sum(-3)) or indexing like z[:, None]. Count "
                f"dims from the right (keepdim=True, '...' indexing, z[..., None]) so that extra batch "
                f"dims on the left pass through, or use conditionals='importance'."
            )
            error.blames_model = True
            raise error from e
        enumerated = {**sizes, **{name: _support_size(tokens.model_trace.nodes[name]["fn"]) for name in per_token}}
        detail = (tuple(tokens.value.shape), tuple(enumerated.items()))
        if not joint and not _VALUE_RUNS_AGREE.passed(model, detail):
            # once per model: the log-densities of the enumerated run at the first and the last
            # joint value against runs at each alone. A model that moves the enumerated values
            # into the datapoints' dim where the sizes happen to agree (locs[a.squeeze()] with as
            # many datapoints as classes) runs without error and every number is wrong. With Normal
            # latents beside, only the discrete sites' log p(z) is read from this run (each
            # component's Gaussian is derived by runs of its own): the observation's is not compared
            # (replayed holds the continuous latents at their traced values, as the enumerated run does)
            if not self._agrees_with_value_runs(tokens, replayed, args, kwargs, trace, enumerated,
                                                observation=not continuous):
                error = ValueError(
                    f"the log-densities of observed site {tokens.name!r} at a joint value of the latents "
                    f"differ from those of a run at that value alone: the model moves the enumerated values "
                    f"into the datapoints' or tokens' dims (e.g. z[:, None] where z[..., None] keeps the "
                    f"left dims)"
                )
                if by_value:
                    return self._falling_back(tokens, model, args, kwargs, sizes, error)
                refusal = EngineNotApplicable(f"{_WHO} ran the model with all values of the discrete latents "
                                              f"({', '.join(map(repr, enumerated))}) at once, and {error}. Count dims "
                                              f"from the right ('...' indexing, keepdim=True), or use "
                                              f"conditionals='importance'.")
                refusal.blames_model = True
                raise refusal
            _VALUE_RUNS_AGREE.add(model, detail)
        return state

    def _agrees_with_value_runs(self, tokens, at_values, args, kwargs, trace, enumerated, observation=True):
        """Whether the enumerated ``trace``'s log-densities (each enumerated site's and the
        observation's, at the tokens with missing ones filled) at the first and at the last
        value of every enumerated site equal those of runs of ``at_values`` with the sites set
        to those values. Log-densities that cannot be evaluated there cannot tell (True)."""
        names = [*enumerated, tokens.name] if observation else list(enumerated)
        for end in (0, -1):
            data = {}
            for name in enumerated:
                node = tokens.model_trace.nodes[name]
                data[name] = node["fn"].enumerate_support(expand=False)[end].expand(node["value"].shape)
            try:
                with torch.no_grad():
                    alone = poutine.trace(poutine.condition(at_values, data=data)).get_trace(*args, **kwargs)
                    for name in names:
                        node = trace.nodes[name]
                        value = tokens.site_value if name == tokens.name else node["value"]
                        together = node["fn"].log_prob(value)
                        index = [slice(None)] * together.dim()
                        for other in enumerated:
                            d = together.dim() + trace.nodes[other]["infer"]["_enumerate_dim"]
                            if 0 <= d:
                                index[d] = end if together.shape[d] > 1 else 0
                        together = together[tuple(index)]
                        value = tokens.site_value if name == tokens.name else alone.nodes[name]["value"]
                        single = alone.nodes[name]["fn"].log_prob(value)
                        if not agrees_with_point_run(*torch.broadcast_tensors(together, single)):
                            return False
            except (ValueError, RuntimeError):  # noqa: BLE001 -- not evaluable at these values: cannot tell
                return True
        return True

    def _falling_back(self, tokens, model, args, kwargs, sizes, error):
        """The state from runs at one joint value of the latents each, after the run at all
        of them failed with ``error`` (a model that indexes with ``index_select`` or a one-hot
        ``einsum`` with fixed letters: summed exactly that way where ``"auto"`` fell to
        importance sampling, 0.13 nats off); one :class:`SlowEngineWarning` per engine and model."""
        K = math.prod(sizes.values())
        state = self._per_value(tokens, model, args, kwargs, sizes, error)
        self.per_value_models.add(callable_key(model))
        warnings.warn(
            f"{_WHO}: the model failed when run with all {K} values of the discrete latents "
            f"({', '.join(map(repr, sizes))}) at once, in batch dims left of the plates "
            f"({type(error).__name__}: {str(error).splitlines()[0]}); running it once per value "
            f"instead ({K} model runs a step, exact but slower). Write the model so that it broadcasts "
            f"over extra batch dims on the left (locs[z] or locs[..., z, :] indexing, '...' in einsum, "
            f"keepdim=True) to run it once.",
            SlowEngineWarning,
            stacklevel=user_stacklevel(),
        )
        return state

    def _per_value(self, tokens, model, args, kwargs, sizes, error=None):
        """:class:`EnumerateState` from one model run per joint value of the latents in
        ``sizes`` (each set for every datapoint at once): the prior's log-density of the value
        and the observation's per-token log-densities, stacked into the mixture's table."""
        indices = itertools.product(*(range(size) for size in sizes.values()))
        log_w, table = self._value_runs(tokens, model, args, kwargs, sizes, indices, error)
        if isinstance(table, tuple):  # a Gaussian observation: its components' means and covariances
            mixture = GaussianMixtureTable(log_w, *table, tokens.value, max_elements=self.max_elements)
        else:
            mixture = MixtureTable(log_w, table, max_elements=self.max_elements)
        return EnumerateState(mixture, tokens.num_data, tokens.num_tokens, sizes)

    def _value_runs(self, tokens, model, args, kwargs, sizes, indices, error=None):
        """``(log p(z) (k, n), table (k, n, D))`` from one model run at each joint value of
        ``indices`` (a support index per latent of ``sizes``), set for every datapoint; for a
        Gaussian observation (``MultivariateNormal(locs[z], ...)``, tokens not independent)
        the table is ``(means (k, n, D), covariances (k, n|1, D, D))``."""
        names = list(sizes)
        sites = {name: tokens.model_trace.nodes[name] for name in names}
        supports = [sites[name]["fn"].enumerate_support(expand=False) for name in names]
        replayed = poutine.replay(model, trace=tokens.subsample_trace())
        n, D = tokens.num_data, tokens.num_tokens
        gaussian = _gaussian_observation(tokens) is not None
        log_w, table = [], []
        for index in indices:
            data = {name: support[i].expand(sites[name]["value"].shape)
                    for name, support, i in zip(names, supports, index)}
            try:
                trace = poutine.trace(poutine.condition(replayed, data=data)).get_trace(*args, **kwargs)
            except Exception as e:
                cause = error if error is not None else e
                raise EngineNotApplicable(
                    f"{_WHO} runs the model with all values of the discrete latents "
                    f"({', '.join(map(repr, names))}) at once, and then once per value; the model failed "
                    f"both ways ({type(cause).__name__}: {str(cause).splitlines()[0]}; at one value: "
                    f"{type(e).__name__}: {str(e).splitlines()[0]}). Use conditionals='importance'."
                ) from e
            w = 0
            for name in names:
                node = trace.nodes[name]
                w = w + node["fn"].log_prob(node["value"])
            log_w.append(torch.as_tensor(w).expand(tokens.batch_shape).reshape(n))
            obs = trace.nodes[tokens.name]
            if gaussian:
                component = base_distribution(obs["fn"])
                cov = compact(component.covariance_matrix)
                table.append((component.loc.expand(tokens.batch_shape + (D,)).reshape(n, D),
                              cov.expand(tokens.batch_shape + (D, D)).reshape(n, D, D) if math.prod(cov.shape[:-2]) > 1
                              else cov.reshape(1, D, D)))
                continue
            lp = token_log_prob(unwrap(obs["fn"], masks=True)[0], tokens.site_value)
            table.append(tokens.to_tokens(lp.expand(tokens.site_shape)).reshape(n, D))
        if gaussian:
            rows = max(c.shape[0] for _, c in table)
            return torch.stack(log_w), (torch.stack([m for m, _ in table]),
                                        torch.stack([c.expand(rows, D, D) for _, c in table]))
        return torch.stack(log_w), torch.stack(table)

    def _tables(self, tokens, model, args, kwargs, trace, sizes, continuous, per_token, mpn):
        """The prepared state from the enumerated trace (see :meth:`prepare`)."""
        # a dim of its own for each (_GlobalEnumDims)
        dims = {name: trace.nodes[name]["infer"]["_enumerate_dim"] for name in [*sizes, *per_token]}
        L = len(dims)
        # a per-token latent's dim is summed inside the table: size one in the mixture's shape
        by_dim = {d: sizes.get(name, 1) for name, d in dims.items()}
        enum_shape = torch.Size(by_dim[d] for d in range(-(mpn + L), -mpn))
        K = math.prod(enum_shape)
        n, D = tokens.num_data, tokens.num_tokens

        def full(t, tail):
            # left-pad to (enum dims, plate dims, tail) and expand the enum dims
            t = t.reshape((1,) * (L + mpn + len(tail) - t.dim()) + t.shape)
            return t.expand(enum_shape + t.shape[L:])

        batch = (1,) * (mpn - len(tokens.batch_shape)) + tuple(tokens.batch_shape)
        log_w = 0
        for name in sizes:
            site = trace.nodes[name]
            log_w = log_w + full(site["fn"].log_prob(site["value"]), ())
        if not sizes:  # per-token latents only: one mixture component, the tokens independent
            log_w = tokens.value.new_zeros(())
        log_w = log_w.expand(enum_shape + batch).reshape(K, n)
        if continuous:
            mixture = self._gaussian_components(tokens, model, args, kwargs, trace, dims, enum_shape, continuous, log_w)
            return EnumerateState(mixture, n, D, sizes)
        obs = trace.nodes[tokens.name]
        if _hmm_observation(tokens) is not None:
            # each joint value of the latents a chain: a mixture of HMMs
            hmm = base_distribution(obs["fn"])
            state = discrete_hmm_state(tokens, hmm, enum_shape, log_w)
            return EnumerateState(DiscreteHMMMixture(state, tokens.value, self.max_elements), n, D, sizes)
        if _gaussian_observation(tokens) is not None:
            # e.g. MultivariateNormal(locs[z], covs[z]): the tokens are not independent
            # given z, but each component is a Gaussian, read from the enumerated run
            gaussian = base_distribution(obs["fn"])

            def rows(t, tail):
                # a plate dim that Pyro's plate broadcast (stride 0) holds one value: compacted to one
                # row, the components' covariances are factored once for all the datapoints, not per
                # datapoint (a full-covariance GMM with D = 50, masks shared: 46 s a step); compact
                # narrows the other stride-0 dims too, and the expand restores them
                t = compact(full(t, tail))
                t = t.expand(enum_shape + t.shape[L:L + mpn] + tail)
                if all(size == 1 for size in t.shape[L:L + mpn]):  # shared by the datapoints
                    return t.reshape((K, 1) + tail)
                return t.expand(enum_shape + batch + tail).reshape((K, n) + tail)

            mixture = GaussianMixtureTable(
                log_w, rows(gaussian.loc, (D,)), rows(gaussian.covariance_matrix, (D, D)), tokens.value,
                max_elements=self.max_elements,
            )
            return EnumerateState(mixture, n, D, sizes)
        # the tokens with missing values filled, so the table is finite everywhere
        value = tokens.site_value
        lp = base_distribution(obs["fn"]).log_prob(value)
        if per_token:
            # log sum_{z_d} p(z_d | ...) p(x_d | z_d, ...) per token (no event dims: checked)
            lp = lp.reshape((1,) * (L + mpn - lp.dim()) + lp.shape)
            for name in per_token:
                site = trace.nodes[name]
                lp = lp + site["fn"].log_prob(site["value"])
            lp = lp.logsumexp([L + mpn + dims[name] for name in per_token], keepdim=True)
        lp = full(lp, tokens.event_shape)
        pad = (1,) * (mpn - len(tokens.site_batch_shape))
        lp = lp.expand(enum_shape + pad + tokens.site_shape)
        table = tokens.to_tokens(lp).reshape(K, n, D)
        mixture = MixtureTable(log_w, table, max_elements=self.max_elements)
        return EnumerateState(mixture, n, D, sizes)

    def _mixture_same_family(self, tokens):
        """The table of an observation written as ``dist.MixtureSameFamily``: its
        mixture weights are :math:`\\log p(z)` and its components' per-token
        log-densities the table, as if the component index were a latent site."""
        fn = _mixture_observation(tokens)
        event = len(fn.event_shape)
        n, D = tokens.num_data, tokens.num_tokens
        batch = tokens.site_batch_shape
        log_w = fn.mixture_distribution.logits.movedim(-1, 0)  # Categorical's logits are normalized
        K = log_w.shape[0]
        log_w = log_w.reshape((K,) + (1,) * (len(batch) + 1 - log_w.dim()) + log_w.shape[1:])
        log_w = log_w.expand((K,) + batch).reshape(K, n)
        gaussian = base_distribution(fn.component_distribution)
        if isinstance(gaussian, _GAUSSIANS) and gaussian.event_shape == fn.event_shape and event == 1:
            # a full-covariance Gaussian mixture: its components are the Gaussian table's
            loc = _component_rows(gaussian.loc, K, batch, n, (D,))
            cov = _component_rows(gaussian.covariance_matrix, K, batch, n, (D, D))
            mixture = GaussianMixtureTable(log_w, loc, cov, tokens.value, max_elements=self.max_elements)
            return EnumerateState(mixture, n, D, {tokens.name: K})
        base = check_factorized(
            fn.component_distribution, tokens.name, _WHO,
            instead="a dist.DiscreteHMM observation is served by conditionals='hmm'",
        )
        # the component dim sits left of the event dims in the component's batch shape
        lp = base.log_prob(tokens.site_value.unsqueeze(-1 - event)).movedim(-1 - event, 0)
        lp = lp.expand((K,) + tokens.site_shape)
        table = tokens.to_tokens(lp).reshape(K, n, D)
        mixture = MixtureTable(log_w, table, max_elements=self.max_elements)
        return EnumerateState(mixture, n, D, {tokens.name: K})

    def _gaussian_components(self, tokens, model, args, kwargs, trace, dims, enum_shape, continuous, log_w):
        """The Gaussian marginal of each joint value of the discrete latents, as a
        :class:`~pyro_mpt.conditionals.gaussian_mixture.GaussianMixtureTable`."""
        mpn = tokens.max_plate_nesting
        # the support values of each discrete site, in its own layout (enum dim first)
        support = {}
        for name, d in dims.items():
            v = trace.nodes[name]["value"]
            event = len(trace.nodes[name]["fn"].event_shape)
            v = v.movedim(v.dim() - event + d, 0)
            support[name] = v.reshape((v.shape[0],) + v.shape[v.dim() - event - mpn:])
        continuous_tokens = replace(tokens, latent_names=list(continuous))
        in_units = any(_in_token_plates(tokens, name) for name in continuous)
        marginal_of = hierarchical_marginal if in_units else gaussian_marginal
        locs, covs = [], []
        order = sorted(dims, key=lambda name: dims[name])  # the leftmost enum dim first
        for index in itertools.product(*(range(support[name].shape[0]) for name in order)):
            values = {name: support[name][i] for name, i in zip(order, index)}
            component = poutine.condition(model, data=values)
            try:
                marginal = marginal_of(continuous_tokens, component, args, kwargs)
            except EngineNotApplicable as e:
                # the Gaussian engine's own advice (quadrature) does not hold here: quadrature
                # refuses the discrete latents, and its refusal pointed back at this engine
                reason = str(e).split(" Use conditionals=")[0]
                raise EngineNotApplicable(
                    f"{_WHO} with continuous latents ({', '.join(map(repr, continuous))}) needs each "
                    f"component to be linear-Gaussian. {reason} No exact engine serves discrete "
                    f"latents beside other continuous ones (conditionals='quadrature' integrates "
                    f"continuous latents only): use conditionals='importance' (the prior or a guide "
                    f"as proposal) or 'encode_decode' (an encoder guide)."
                ) from e
            locs.append(marginal.loc)
            covs.append(marginal)
        D = tokens.num_tokens
        rows = max(t.shape[0] for t in locs + [m.cov_diag if m.is_low_rank else m.covariance for m in covs])
        loc = torch.stack([t.expand(rows, -1) for t in locs])
        rank = max((m.cov_factor.shape[-1] for m in covs if m.is_low_rank), default=D)
        if all(m.is_low_rank for m in covs) and rank < D:
            # components of low rank (a mixture of PPCA or of factor analysers): Woodbury per context,
            # R x R factorizations (ranks padded with zero columns, which add nothing)
            F = torch.stack([
                torch.nn.functional.pad(m.cov_factor, (0, rank - m.cov_factor.shape[-1])).expand(rows, -1, -1)
                for m in covs
            ])
            psi = torch.stack([m.cov_diag.expand(rows, -1) for m in covs])
            return GaussianMixtureTable(log_w, loc, None, tokens.value, max_elements=self.max_elements, low_rank=(F, psi))
        cov = torch.stack([m.dense().expand(rows, -1, -1) for m in covs])
        return GaussianMixtureTable(log_w, loc, cov, tokens.value, max_elements=self.max_elements)

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        mixture = state.mixture
        if mask.shape[0] > 1 and bool((mask.sum(-1) == 1).all()):
            # every query hides one token (the "pll" schedule): one pass over the table, or one
            # factorization of each Gaussian component, serves them all
            loo = mixture.leave_one_out()
            if loo is not None:
                return torch.where(mask, loo, torch.zeros((), dtype=loo.dtype, device=loo.device))
        return mixture.log_conditionals(~mask)

    def serves_leave_one_out(self, state):
        """Whether the mixture's ``leave_one_out`` gives a table, without computing it: a
        table with an impossible token (a ``-inf`` entry) has none."""
        mixture = state.mixture
        if isinstance(mixture, DiscreteHMMMixture):
            return mixture.serves_leave_one_out()
        return not isinstance(mixture, MixtureTable) or bool(torch.isfinite(mixture.table).all())

    def leave_one_out_table(self, state):
        r"""The mixture's :math:`\log p(x_j \mid x_{-j})` table ``(n, D)`` (one pass over its
        table, or one factorization of each Gaussian component)."""
        return state.mixture.leave_one_out()

    def chain_log_prob(self, state, x, order):
        self._check_x(state, x)
        return state.mixture.chain_log_prob(order)

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: each equals :meth:`log_evidence`
        (the conditionals come from one joint)."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], -1)

    def log_evidence(self, state, x, observed=None):
        r"""Exact :math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        self._check_x(state, x)
        return state.mixture.log_evidence(observed)
