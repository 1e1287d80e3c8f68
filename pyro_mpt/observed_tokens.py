r"""The observed site's tokens and traces: :class:`ObservedTokens`, built by :func:`trace_tokens`.

Everything in pyro_mpt sees data the same way: the *tokens* of a datapoint are
the flattened event elements of one observed sample site, together with the
elements of any *token plates* (``pyro.plate`` s over the tokens rather than over
datapoints), and the datapoints are the elements of the site's other plates.
:func:`trace_tokens` runs the guide and the model once and returns an
:class:`ObservedTokens` record -- the observed site's tokens, their
:class:`~pyro_mpt.token_layout.TokenLayout` and the traces, built once and frozen -- that the
schedules, the conditional engines and the evidence estimators all share.
Which site holds the tokens and which plates run over them is found by
:mod:`pyro_mpt.token_site`; the checks of the site's data live in
:mod:`pyro_mpt.site_checks`.

**Missing tokens.** Observed sites may carry a mask: ``obs_mask=`` (Pyro then
records a ``<name>_observed`` site and a ``<name>_unobserved`` latent, which is
dropped here: the missing tokens are integrated out), ``dist.mask(m)`` on the
observation, or ``poutine.mask``. The ``observed`` field of :class:`ObservedTokens` marks
the observed tokens; missing ones are never context and never targets, and the
values they carry are kept where finite and in the support, else replaced by an
observed value of the same token, or by a draw of the site's distribution where
that value lies outside the datapoint's support (so that every engine sees finite
numbers in the support).

**Validation.** While Pyro's validation is on (``pyro.enable_validation``, its
default; :func:`pyro.infer.util.is_validation_enabled`), each trace checks the
observed tokens as Pyro's own ``log_prob`` would: finite values, values in the
support of the observation's distribution (evaluated at the latent values of
this trace, as ``Trace_ELBO`` does), and a scale constant over the tokens.
``pyro.enable_validation(False)`` turns these per-step checks off. Data whose
shape does not fit the observation, low-precision (float16/bfloat16)
computation and empty plates are refused whatever the setting: they would end
in an error from inside torch or Pyro.

**Other observed sites and factors.** The tokens are one observed site, and
every estimate is :math:`\log p(x_i)` of that site alone: the conditional
engines integrate the latents against the prior (or a proposal) and score only
that site. Another observed site ``y`` therefore counts as integrated out
(:math:`\log p(x_i)`, not :math:`\log p(x_i \mid y_i)`), and a ``pyro.factor``
is dropped, which changes the model. :func:`trace_tokens` refuses such a model
unless ``extra_sites="drop"`` asks for exactly that computation.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import pyro.distributions as dist
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger, init_to_mean
from pyro.infer.util import is_validation_enabled
from pyro.poutine.indep_messenger import IndepMessenger
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample

from .random_streams import draw_apart, seeded_streams
from .site_checks import (check_dtype, check_extra_sites, check_integer_data, check_latent_dtypes, check_shape,
                          observation_dtype, tokens_in_support, validate_values)
from .token_layout import TokenLayout
from .token_site import locate_site, missing_value_sites, plate_size, sample_sites, site_layout, vectorized_frames

__all__ = ["ObservedTokens", "trace_tokens", "LATENT_MEANS", "guess_max_plate_nesting", "check_local_latent", "user_scale",
           "check_latent_scales"]


@dataclass(frozen=True)
class ObservedTokens(TokenLayout):
    """The observed site of a model, flattened to a ``(n, D)`` token matrix, with its traces.

    Built once by :func:`trace_tokens` and never changed; the shapes of the
    layout (:class:`~pyro_mpt.token_layout.TokenLayout`) and everything derived from them are
    properties.

    :param str name: name of the observed sample site.
    :param torch.Tensor value: observed values of shape ``(n, D)``, where ``n``
        is the number of datapoints and ``D`` the number of tokens (token-plate
        sizes times event size); missing tokens hold a fill value.
    :param torch.Tensor scale: per-datapoint scale of shape ``(n,)``; carries the
        ``N / batch_size`` factor of subsampled plates and any ``poutine.scale``.
    :param model_trace: the model trace (replayed against the guide trace).
    :param guide_trace: the guide trace (empty when there is no guide).
    :param tuple latent_names: names of the model's latent sample sites.
    :param int max_plate_nesting: number of plate dims the model uses.
    :param tuple token_plates: the names of the token plates.
    :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens;
        None when no token is missing.
    :param torch.Tensor site_value: the observed value in the site's layout, with missing
        tokens filled; in the site's dtype, or for integer data in ``value``'s.
    """

    name: str
    value: torch.Tensor
    scale: torch.Tensor
    model_trace: Trace
    guide_trace: Trace
    latent_names: tuple = ()
    max_plate_nesting: int = 0
    token_plates: tuple = ()
    observed: Optional[torch.Tensor] = None
    site_value: Optional[torch.Tensor] = None

    @property
    def site(self):
        """The observed site in the model trace."""
        return self.model_trace.nodes[self.name]

    @property
    def present(self):
        """Bool ``(n,)``: the datapoints with at least one observed token (the others, masked
        out whole, score 0 and are in no curve); None when no token is missing."""
        return None if self.observed is None else self.observed.any(-1)

    @property
    def data_frames(self):
        """The plate frames of the observed site that run over datapoints (all but the token plates)."""
        token_plates = set(self.token_plates)
        return {f for f in vectorized_frames(self.site) if f.name not in token_plates}

    def latent_sites(self):
        """The model's latent sample sites, in trace order."""
        return [self.model_trace.nodes[name] for name in self.latent_names]

    def subsample_trace(self):
        """A trace holding only the subsample sites, to replay the same minibatch."""
        trace = Trace()
        for name, site in self.model_trace.nodes.items():
            if site["type"] == "sample" and site_is_subsample(site):
                trace.add_node(name, **site)
        return trace


def check_local_latent(tokens, site, error=ValueError, *, allow_token_plates=False,
                       consequence="log p(x_i) does not factorize over datapoints"):
    """Raise ``error`` unless latent ``site`` is local to each datapoint.

    Per-datapoint masked conditionals need every latent inside every data
    plate of the observed site: a latent outside one is shared by all
    datapoints (``log p(x_i)`` no longer factorizes). A latent in a plate that
    is neither a data nor a token plate of the observed site (``pyro.plate("k",
    K)`` around a datapoint's latent dims) is local: every engine takes such a
    plate's elements as elements of the datapoint's latent (its dims as event
    dims, :func:`~pyro_mpt.conditionals.plate_runs.latent_layout`; enumerated
    jointly by the enumeration engine; summed by the sampling engines).

    :param ObservedTokens tokens: the traced tokens.
    :param dict site: the latent's trace site.
    :param type error: the exception class raised (an engine's own, so that
        ``conditionals="auto"`` can go on to the next engine).
    :param bool allow_token_plates: accept latents in the observed site's token
        plates too (one latent per unit of tokens: engines that integrate such
        latents, the hierarchical and the sampling ones).
    :param str consequence: what a shared latent breaks, for the message.
    :raises ValueError: (or the ``error`` given) naming the data plates the latent
        is outside of, or the token plates it sits in.

    Example::

        >>> check_local_latent(tokens, tokens.latent_sites()[0], EngineNotApplicable)   # None, or raises
    """
    # by the data set's plate sizes: a minibatch of one datapoint subsampled from N still has
    # its latent outside the others' (a global latent was integrated per datapoint, 2 nats off)
    obs_frames = {f for f in tokens.data_frames if plate_size(f) > 1}
    own = vectorized_frames(site, 2)
    name = site["name"]
    missing = obs_frames - own
    if missing:
        plates = ", ".join(repr(f.name) for f in sorted(missing, key=lambda f: f.dim))
        # the plates to make token plates: these and those that already are, outermost
        # first (naming only these, the message sent the user from one plate to the other)
        stack = tokens.model_trace.nodes[tokens.name]["cond_indep_stack"]
        tokens_too = {f.name for f in missing} | set(tokens.token_plates)
        names = tuple(f.name for f in sorted(stack, key=lambda f: f.dim) if f.name in tokens_too)
        raise error(
            f"Latent site {name!r} is outside the plate(s) {plates} of observed "
            f"site {tokens.name!r}: it is shared by all datapoints (a global "
            f"latent), so {consequence}. The quantity to ask for is then the whole "
            f"dataset's evidence log p(x_1..N): pass token_plates={names!r} so that all "
            f"observations are the tokens of one datapoint (exact for linear-Gaussian "
            f"hierarchies with conditionals='hierarchical' or Evidence(method='exact'); "
            f"otherwise conditionals='importance' or Evidence(method='importance') with a "
            f"guide over all the latents). Or make it a pyro.param, or fit it by MAP: a "
            f"guide with a point mass at it (AutoDelta over the global latents, as in Pyro's "
            f"GMM tutorial) holds it fixed."
        )
    token_names = set(tokens.token_plates)
    inside = sorted(f.name for f in own if f.name in token_names)
    if inside and not allow_token_plates:
        raise error(
            f"Latent site {name!r} sits in token plate(s) {', '.join(map(repr, inside))} "
            f"of observed site {tokens.name!r}: one latent per unit of tokens, which this "
            f"engine does not integrate (it needs the latents of a whole datapoint). Use "
            f"conditionals='hierarchical' (or Evidence(method='exact')) when the model is "
            f"linear-Gaussian, conditionals='importance' (or Evidence(method='importance')) "
            f"otherwise; or integrate it out in the observation (a Normal per-token offset "
            f"adds its variance to the noise)."
        )


def user_scale(site):
    """The scale of a trace site without its plates' subsampling factors: what
    ``poutine.scale`` (or a scaled model) put there, batch-shaped or a number.

    A subsampled ``pyro.plate`` of size ``N`` and batch ``B`` multiplies its
    sites' scale by ``N / B``; dividing those factors out leaves the user's own.

    :param dict site: a sample site of a Pyro trace.
    :returns: a tensor or a float (1.0 when nothing scaled the site).

    Example::

        >>> user_scale(trace.nodes["z"])   # 0.1 inside poutine.scale(scale=0.1)
    """
    factor = 1.0
    for frame in site["cond_indep_stack"]:
        if frame.full_size is not None and frame.full_size != frame.size:
            factor = factor * frame.full_size / frame.size
    return site["scale"] / factor


def _same_scale(a, b):
    """Whether two user scales (tensors or numbers) agree wherever they broadcast together,
    to the rounding of the products that formed them."""
    tol = 64 * torch.finfo(torch.float32).eps
    if not torch.is_tensor(a) and not torch.is_tensor(b):
        return math.isclose(float(a), float(b), rel_tol=tol, abs_tol=0.0)
    ref = a if torch.is_tensor(a) else b  # numbers join it on its device, none on the default one
    dtype = ref.dtype if ref.is_floating_point() else torch.float32
    a, b = (torch.as_tensor(t, dtype=dtype, device=ref.device) for t in (a, b))
    try:
        a, b = torch.broadcast_tensors(a, b)
    except RuntimeError:
        return False
    return bool(torch.isclose(a, b, rtol=tol, atol=0.0).all())


def check_latent_scales(tokens, who="MaskedPretrainingLoss"):
    r"""Refuse a latent that the estimate integrates out but that carries a scale of its own.

    Every estimate of pyro_mpt is :math:`s_i \log p(x_i)`, the datapoint's scale
    times a log-marginal likelihood in which the latents are integrated out;
    :math:`s_i` is the observed site's scale (a subsampled plate's ``N / B``
    times any ``poutine.scale`` on it, e.g. datapoint weights). A latent may
    carry no scale of its own (only its plates' ``N / B``) or the observed
    site's (``poutine.scale`` around the whole model scales every site alike).
    Any other scale on a latent -- KL annealing, :math:`\beta` times the
    prior's term of an ELBO -- weights a term that the marginal likelihood
    does not have, so an engine would ignore it and return a number the user
    did not ask for: refused here, naming the site. Global latents at a
    guide's point mass are no longer latents here
    (:mod:`~pyro_mpt.point_latents`): their scale weights their log-prior
    term, as in Pyro.

    The guide's sites of those latents likewise (a proposal's density has no scale in the
    weights :math:`p(x, z)/q(z)`: ``poutine.scale`` around the guide alone was ignored).

    A mask on a latent (``poutine.mask``, ``dist.mask``) is a scale of 0 or 1:
    it may leave a latent out only at datapoints whose tokens are all missing
    too (a mask around the whole datapoint); masked at a datapoint with
    observed tokens, it is refused likewise.

    :param ObservedTokens tokens: the traced tokens (latents integrated out).
    :param str who: the caller, named in the message.
    :raises ValueError: naming the latent, its scale (or the datapoints its mask
        drops) and the observed site's.

    Example::

        >>> check_latent_scales(trace_tokens(model, None, (x,), {}))   # None, or ValueError
    """
    observed = user_scale(tokens.site)
    for site in tokens.latent_sites():
        scale = _stray_scale(site, observed)
        if scale is None:
            continue
        raise ValueError(
            f"{who}: latent site {site['name']!r} has scale {_describe(scale)} (poutine.scale) "
            f"but observed site {tokens.name!r} has {_describe(observed)}. The estimate integrates "
            f"{site['name']!r} out: it is the datapoint's scale times log p(x_i), which has no term "
            f"for a scale on a latent alone (e.g. KL annealing, beta * KL) to weight, so the scale "
            f"would be ignored. Remove poutine.scale around {site['name']!r}; to weight datapoints or "
            f"scale the loss, scale the observed site alone or the whole model "
            f"(poutine.scale(model, scale=s)); for a beta-weighted ELBO use Trace_ELBO."
        )
    guide = tokens.guide_trace
    latents = set(tokens.latent_names)
    for site in guide.nodes.values() if guide is not None else ():
        if site["type"] != "sample" or site["name"] not in latents or site["is_observed"]:
            continue
        scale = _stray_scale(site, observed)
        if scale is None:
            continue
        raise ValueError(
            f"{who}: the guide's site {site['name']!r} has scale {_describe(scale)} (poutine.scale) "
            f"but observed site {tokens.name!r} has {_describe(observed)}. The guide only proposes "
            f"{site['name']!r}, which the estimate integrates out: its weights p(x, z) / q(z) have no "
            f"place for a scale on q alone, so the scale would be ignored. Remove poutine.scale "
            f"from the guide, or scale the model and the guide alike."
        )
    seen = None
    for site in tokens.latent_sites():
        kept = _observed_mask(site)
        if kept is None:
            continue
        if seen is None:
            # the datapoints with at least one observed token, in the plates' layout
            seen = torch.ones(tokens.num_data, dtype=torch.bool, device=kept.device)
            if tokens.observed is not None:
                seen = tokens.present.to(kept.device)
            seen = seen.reshape(tokens.batch_shape)
        event = len(site["fn"].event_shape)
        kept = kept.flatten(-event).all(-1) if event else kept
        try:
            dropped = int((~kept & seen).sum())
        except RuntimeError:  # the latent's plates do not line up with the datapoints'
            dropped = int((~kept).sum())
        if dropped and site["name"] in missing_value_sites(tokens.model_trace):
            # Pyro's draws of another site's missing values that the model reads (token_site keeps
            # them as latents then): the advice to mask or obs_mask= was no help
            base = site["name"][: -len("_unobserved")]
            raise ValueError(
                f"{who}: latent site {site['name']!r} holds Pyro's draws of the missing values of observed "
                f"site {base!r} (obs_mask=), and the model reads them (another site depends on {base!r}'s "
                f"filled-in values): they are latents of log p of {tokens.name!r}, masked where {base!r} is "
                f"observed, which this estimate cannot integrate. Use Evidence(method='exact') or "
                f"Evidence(method='importance'), or impute {base!r}'s missing values before the model reads them."
            )
        if dropped:
            raise ValueError(
                f"{who}: latent site {site['name']!r} is masked (poutine.mask or dist.mask) at "
                f"{dropped} element(s) of datapoints whose tokens at observed site {tokens.name!r} "
                f"are observed. The estimate integrates {site['name']!r} out: log p(x_i) has no term "
                f"for a mask on a latent alone to drop, so the mask would be ignored. Mask the "
                f"observation too (poutine.mask around the latent and the observation, or obs_mask=) "
                f"to leave those datapoints out, or remove the mask."
            )


def _stray_scale(site, observed):
    """A site's own scale (:func:`user_scale`) where it is neither 1 nor the observed site's
    ``observed`` (a whole-model scale), else None."""
    scale = user_scale(site)
    return None if _same_scale(scale, 1.0) or _same_scale(scale, observed) else scale


def _describe(scale):
    """A scale for a message: the number, or its range when it varies."""
    if not torch.is_tensor(scale):
        return f"{float(scale):g}"
    lo, hi = float(scale.min()), float(scale.max())
    return f"{lo:g}" if lo == hi else f"{lo:g} to {hi:g}"


def guess_max_plate_nesting(*traces):
    """The number of vectorized plate dims used by the sites of ``traces``."""
    dims = [
        frame.dim
        for trace in traces
        for site in sample_sites(trace)
        for frame in site["cond_indep_stack"]
        if frame.vectorized
    ]
    return -min(dims) if dims else 0


def _observed_mask(site):
    """The site's observation mask in its full shape (batch + event), or None when unmasked."""
    fn = site["fn"]
    # the value's event dims: a DiscreteHMM without duration declares event shape (1,)
    # whatever its number of steps
    event = tuple(site["value"].shape[site["value"].dim() - len(fn.event_shape):])
    shape = fn.batch_shape + event
    masks = []
    m = site.get("mask")
    if m is not None and m is not True:
        m = torch.as_tensor(m, dtype=torch.bool)
        if m.dim() > len(fn.batch_shape) or any(a not in (1, b) for a, b in zip(m.shape[::-1], fn.batch_shape[::-1])):
            # poutine.mask multiplies the log-density, whose shape is the batch shape: a mask
            # over the event's elements would be read as a batch of masks (Pyro's ELBOs fail on
            # it with a broadcasting error)
            raise ValueError(
                f"Observed site {site['name']!r} has a poutine.mask mask of shape {tuple(m.shape)}, which "
                f"does not broadcast to the site's batch shape {tuple(fn.batch_shape)} (the shape of its "
                f"log_prob; its event shape {event} holds the tokens). Mask whole "
                f"datapoints with a mask of the batch shape, or single tokens inside the event with "
                f"dist.Normal(...).mask(m).to_event(1) or a token plate (a GaussianHMM's elements "
                f"cannot be masked one by one; a DiscreteHMM's steps can, through its observation_dist: "
                f"dist.Poisson(rate).mask(m[..., None]))."
            )
        masks.append(m.reshape(m.shape + (1,) * len(fn.event_shape)))
    level, remaining = _distribution_masks(fn, len(fn.event_shape), masks)
    if isinstance(level, dist.DiscreteHMM):
        emission = _emission_mask(site, level)
        if emission is not None:
            masks.append(emission)
    if not masks:
        return None
    out = torch.ones(shape, dtype=torch.bool, device=masks[0].device)
    for m in masks:
        out = out & m.to(out.device)
    return None if bool(out.all()) else out


def _distribution_masks(fn, remaining, masks):
    """Appends to ``masks`` the masks of ``fn``'s ``.mask()`` levels, each with ``remaining``
    (``fn``'s event dims) trailing dims, through its ``.to_event()`` levels; returns the
    first other level and its number of event dims left."""
    level = fn
    while True:
        if isinstance(level, (dist.Independent, torch.distributions.Independent)):
            remaining -= level.reinterpreted_batch_ndims
            level = level.base_dist
        elif isinstance(level, dist.MaskedDistribution):
            m = level._mask
            if m is not True and m is not None:
                m = torch.as_tensor(m, dtype=torch.bool).expand(level.batch_shape)
                masks.append(m.reshape(m.shape + (1,) * remaining))
            level = level.base_dist
        else:
            return level, remaining


def _emission_mask(site, hmm):
    """The steps (and elements) a DiscreteHMM's masked ``observation_dist`` leaves out of its
    ``log_prob``, ``(*batch, T|1, *obs_event)``, or None: the missing tokens of a sequence.
    The emissions' batch shape ends in the state dim, along which the mask must not vary."""
    obs = hmm.observation_dist
    E = len(obs.event_shape)
    masks = []
    _distribution_masks(obs, E, masks)
    if not masks:
        return None
    out = None
    for m in masks:
        state = m.dim() - 1 - E
        if bool((m.any(state) != m.all(state)).any()):
            raise ValueError(
                f"Observed site {site['name']!r} is a DiscreteHMM whose observation_dist is masked "
                f"differently for different hidden states (mask of shape {tuple(m.shape)}, states at "
                f"dim {state - m.dim()}): a masked step is a missing token only when it is left out "
                f"under every state. Make the mask constant along the state dim, e.g. "
                f"dist.Poisson(rate).mask(m[..., None]) with m of shape (*batch, T)."
            )
        m = m.all(state)
        out = m if out is None else out & m
    return out


def _fill_missing(value, observed):
    """``value`` ``(n, D)`` with each missing token set to an observed value of the same
    token (of any token when none is observed in the batch), so it lies in the support."""
    n = value.shape[0]
    first = torch.where(observed, torch.arange(n, device=value.device)[:, None], n).amin(0)  # (D,)
    seen = first < n
    if bool(observed.any()):
        i, j = observed.nonzero()[0]
        fallback = value[i, j]
    else:
        fallback = torch.zeros((), dtype=value.dtype, device=value.device)
    cols = torch.arange(value.shape[1], device=value.device)
    per_token = torch.where(seen, value[first.clamp(max=n - 1), cols], fallback)
    return torch.where(observed, value, per_token.expand_as(value))


def _fill_from_draw(layout, fn, value, observed):
    """``value`` ``(n, D)`` with each missing token set to a draw of the site's distribution,
    on a random stream of its own (the global one left as it was): where the support differs
    by datapoint (a ``Binomial``'s ``total_count``), another datapoint's value of the token
    can lie outside it (7 successes where the datapoint has 2 trials), and Pyro refused the
    site at every estimate. Left as it is where the distribution cannot draw."""
    try:
        with seeded_streams(0), torch.no_grad():
            draw = fn.sample()
    except NotImplementedError:
        return value
    draw = layout.to_tokens(draw.expand(layout.site_shape)).reshape(value.shape)
    return torch.where(observed, value, draw.to(value.dtype))


def _empty_plate(error):
    """The name of the ``pyro.plate`` whose size 0 raised ``error`` (a ZeroDivisionError
    from Pyro's plate constructor), or None when it came from elsewhere."""
    tb, name = error.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if tb.tb_next is None and frame.f_code.co_name == "__init__":
            if isinstance(frame.f_locals.get("self"), IndepMessenger):
                name = frame.f_locals.get("name")
        tb = tb.tb_next
    return name


#: the init strategy of traces whose engine reads no latent draw: each latent at its prior mean,
#: else (no finite mean) one draw, on a stream of its own as without it; Pyro's own fallback,
#: the median, would draw 15 samples of the latent's whole shape
LATENT_MEANS = init_to_mean(fallback=draw_apart)


def _run_traces(model, guide, args, kwargs, validate_model=True, latent_init=None):
    """The guide trace (empty without a guide) and the model trace replayed on it; the
    model run without Pyro's distribution-argument validation unless ``validate_model``,
    its latents that the guide leaves unset at ``latent_init``'s values where given, else
    drawn on streams of their own (:func:`~pyro_mpt.random_streams.draw_apart`: whether
    a trace draws them or not, the global stream is left as it was)."""
    checks = contextlib.nullcontext() if validate_model else dist.validation_enabled(False)

    def initialized(fn):
        # outside the replay: the guide's values come first, the strategy fills the rest
        return InitMessenger(draw_apart if latent_init is None else latent_init)(fn)

    try:
        if guide is None:
            with checks:
                return Trace(), poutine.trace(initialized(model)).get_trace(*args, **kwargs)
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        with checks:
            model_trace = poutine.trace(initialized(poutine.replay(model, trace=guide_trace))).get_trace(*args, **kwargs)
        return guide_trace, model_trace
    except ZeroDivisionError as e:
        plate = _empty_plate(e)
        if plate is None:
            raise
        # Pyro refuses a plate of size 0 before any site exists, so name the plate
        raise ValueError(
            f"pyro.plate {plate!r} has size 0: the batch is empty, so there is no "
            f"datapoint to score. Pass at least one datapoint (skip empty minibatches)."
        ) from e


def _draws_read(model, args, kwargs, model_trace, name):
    """Whether the model reads latent site ``name``'s draws elsewhere: run again with another
    draw there (every other latent replayed), does another site's log-density change? One
    model run, for the missing-value draws of an observed site other than the token site."""
    node = model_trace.nodes[name]
    trace = model_trace.copy()
    with seeded_streams(0), torch.no_grad():  # the user's random streams are left as they were
        other = node["fn"].sample()
        trace.nodes[name] = dict(node, value=other)
        with poutine.block(), dist.validation_enabled(False):
            rerun = poutine.trace(poutine.replay(model, trace=trace)).get_trace(*args, **kwargs)
        for key, site in model_trace.nodes.items():
            if key == name or site["type"] != "sample" or key not in rerun.nodes or site["infer"].get("_deterministic"):
                continue
            before = site["fn"].log_prob(site["value"])
            after = rerun.nodes[key]["fn"].log_prob(rerun.nodes[key]["value"])
            if before.shape != after.shape or not bool(torch.equal(before, after)):
                return True
    return False


def _token_values(layout, site, dtype, validate):
    """The tokens ``(n, D)`` in ``dtype``, the observed-token mask (or None) and the
    site's value with missing tokens filled, after the value checks when ``validate``."""
    raw = site["value"]
    n = layout.num_data
    raw_flat = layout.to_tokens(raw).reshape(n, -1)
    mask = _observed_mask(site)
    observed = None if mask is None else layout.to_tokens(mask).reshape(n, -1)
    if validate:
        validate_values(layout, site, raw_flat.to(dtype), observed)
    # integer data in the tokens' (the observation's) dtype at the site too: the engines that
    # evaluate the site's distribution there ran Poisson's lgamma(x + 1) of int64 counts in
    # torch's default float32 (a float64 model's enumeration and quadrature 1e-6 nats off)
    at_site = raw if torch.is_floating_point(raw) else raw.to(dtype)
    if observed is None:
        return raw_flat.to(dtype), None, at_site.expand(layout.site_shape)
    # fill the raw values once and cast; a placeholder the user gave that is finite and in the
    # support stays (one valid under every value of an enumerated latent, e.g. the lower end of
    # a Uniform whose width depends on the class, was replaced by another datapoint's value,
    # outside some class's support, and Pyro refused the site)
    valid = tokens_in_support(layout, site)  # the raw values (n, D), or None
    kept = observed if valid is None else observed | (valid & torch.isfinite(raw_flat))
    raw_flat = torch.where(kept, raw_flat, _fill_missing(raw_flat, observed))
    site_value = layout.to_site(raw_flat)
    filled_ok = tokens_in_support(layout, site, site_value)
    if filled_ok is not None and not bool(filled_ok.all()):
        raw_flat = _fill_from_draw(layout, site["fn"], raw_flat, observed)
        site_value = layout.to_site(raw_flat)
    return raw_flat.to(dtype), observed, site_value if torch.is_floating_point(raw) else site_value.to(dtype)


def _datapoint_scale(layout, site, token_plates, dtype, validate):
    """The scale of each datapoint ``(n,)``: the site's scale, which must not vary over
    its tokens (checked when ``validate``)."""
    scale = torch.as_tensor(site["scale"], dtype=dtype, device=site["value"].device)
    if layout.token_dims and scale.numel() > 1:
        # a scale is batch-shaped, so only token plates can make it vary over tokens;
        # compare it with its first entry along each token dim it has, unexpanded
        first = scale
        for d in layout.token_dims:
            if scale.dim() >= -d and scale.shape[d] > 1:
                first = first.narrow(d, 0, 1)
        if first.shape != scale.shape:
            if validate and not bool((scale == first).all()):
                raise ValueError(
                    f"Observed site {site['name']!r} has a scale that varies over its tokens; masked "
                    f"pre-training scales whole datapoints. Apply poutine.scale outside the "
                    f"token plate(s) {', '.join(map(repr, token_plates))}."
                )
            scale = first
    return scale.expand(layout.batch_shape).reshape(layout.num_data)


def trace_tokens(
    model, guide, args, kwargs, obs_site=None, max_plate_nesting=None, token_plates=None, extra_sites="error",
    validate_model=True, latent_init=None,
):
    r"""Run ``guide`` then ``model`` (replayed on the guide) and locate the tokens.

    :param callable model: a Pyro model with one observed site (or ``obs_site``).
    :param callable guide: a Pyro guide, or ``None``.
    :param tuple args: positional arguments of model and guide.
    :param dict kwargs: keyword arguments of model and guide.
    :param str obs_site: name of the observed site holding the tokens; needed
        when the model observes more than one site.
    :param int max_plate_nesting: plate dims the model uses; guessed from the
        trace when ``None``.
    :param token_plates: names of the observed site's plates that run over
        tokens (see the module docstring); None detects them when unambiguous,
        ``()`` takes every plate as a datapoint plate.
    :param str extra_sites: what to do with observed sites other than the tokens'
        and with ``pyro.factor`` sites, which every estimate leaves out (see the
        module docstring): ``"error"`` (default) refuses the model, naming them;
        ``"drop"`` scores the token site alone, :math:`\log p(x_i)` of the
        model without those factors, with the other observed sites integrated
        out (their values still enter wherever the model reads them).
    :param bool validate_model: False runs the model with Pyro's distribution-argument
        validation off (the checks of the tokens' values still run while it is on): for a
        caller whose engine constructs every distribution again under it
        (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.validates_model`).
    :param callable latent_init: a Pyro init strategy (e.g. :data:`LATENT_MEANS`) that gives the latents the guide does not
        sample their values in place of a prior draw: for a caller whose engine reads no latent draw
        (:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.reads_latent_draws`).
        None (default) draws them.
    :returns: the observed tokens and the traces.
    :rtype: ObservedTokens

    Example::

        >>> tokens = trace_tokens(model, None, (x,), {}, token_plates=("tokens",))
        >>> tokens.value.shape          # (n, D)
    """
    guide_trace, model_trace = _run_traces(model, guide, args, kwargs, validate_model, latent_init)
    used = guess_max_plate_nesting(model_trace, guide_trace)
    if max_plate_nesting is None or max_plate_nesting == float("inf") or max_plate_nesting < used:
        # the engines put their plate of points at dim -(max_plate_nesting + 1): a value
        # below the model's own plate dims would put it inside them (a collision that
        # surfaced as a misleading "does not broadcast" fallback or refusal); more is harmless
        max_plate_nesting = used
    site, latents, others = locate_site(
        model_trace, obs_site, read=lambda name: _draws_read(model, args, kwargs, model_trace, name)
    )
    check_extra_sites(site, others, extra_sites, order=list(model_trace.nodes))
    layout, plates = site_layout(site, latents, token_plates)
    raw = site["value"]
    check_shape(site, raw)
    check_dtype(site, raw)
    check_latent_dtypes(latents, site["name"])
    check_integer_data(site, raw)
    if layout.num_tokens == 0:
        # caught here, before any per-token bookkeeping indexes an empty token axis
        raise ValueError(
            f"Masked pre-training needs at least one token, got D=0 at observed site "
            f"{site['name']!r} (shape {tuple(layout.site_shape)}). Give each datapoint at least one token."
        )
    # integer data compute in the observation's parameters' dtype (torch's default dtype, float32,
    # gave a float64 Poisson model's quadrature 1e-6 nats off, its error estimate saying 3e-10)
    dtype = raw.dtype if torch.is_floating_point(raw) else (observation_dtype(site, raw) or torch.get_default_dtype())
    # Pyro's own log_prob checks run only while validation is on; so do the per-step ones here
    validate = is_validation_enabled()
    value, observed, site_value = _token_values(layout, site, dtype, validate)
    return ObservedTokens(
        site_batch_shape=layout.site_batch_shape,
        event_shape=layout.event_shape,
        token_dims=layout.token_dims,
        name=site["name"],
        value=value,
        scale=_datapoint_scale(layout, site, plates, dtype, validate),
        model_trace=model_trace,
        guide_trace=guide_trace,
        latent_names=tuple(s["name"] for s in latents),
        max_plate_nesting=int(max_plate_nesting),
        token_plates=plates,
        observed=observed,
        site_value=site_value,
    )
