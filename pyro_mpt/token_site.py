r"""Where the tokens are in a Pyro trace: the observed token site, its latents, its token plates and layout.

:func:`~pyro_mpt.observed_tokens.trace_tokens` runs the model and asks this module which
sample site holds the tokens (:func:`locate_site`) and how they sit in its
value (:func:`site_layout`); the errors name the site and say what to pass
instead.

**Token plates.** A site written ``with pyro.plate("tokens", D, dim=-1):
pyro.sample("x", dist.Normal(loc, s), obs=x)`` inside a data plate has its
tokens in a plate instead of in its event. ``token_plates=("tokens",)`` says so
explicitly; without it a plate of the observed site is taken as a token plate
when no latent site sits in it while every latent inside the other plates of
the observed site sits in all of them (their elements are then the datapoints,
and the token plate's elements share those latents, so they cannot be
datapoints themselves). The flattened token order is the site's layout: the
token-plate dims in their batch order, then the event dims. Latents one per
token as well (a zero-inflation switch ``with pyro.plate("tokens", D)`` beside
a datapoint's class) leave the plates that every latent sits in as the data
plates, when some latent sits in those alone. Plates are told apart by the latents
in them, first on the plates of more than one element, then, where those leave no
token plate, on all: a batch of one datapoint and one token per datapoint keep the
roles their plates have in larger batches. A plate's size is the data set's
(:func:`plate_size`: a subsampled plate's ``full_size``), not the minibatch's, and a
scalar observation in several plates whose latents do not tell their roles apart is
refused whatever their sizes.
"""

import re
import pyro.distributions as dist
from pyro.poutine.util import site_is_subsample

from .site_checks import data_event_shape, elementwise, is_factor
from .token_layout import TokenLayout

__all__ = ["locate_site", "site_layout", "vectorized_frames", "plate_size", "sample_sites", "missing_value_sites"]


def plate_size(frame):
    """The number of elements of a plate frame in the whole data set: its ``full_size``
    where it subsamples (a minibatch of one from a plate of N is a plate of N), else its
    size. Plates play their roles (datapoints, tokens, a global latent's outside) by it."""
    return frame.size if frame.full_size is None else frame.full_size


def vectorized_frames(site, min_size=1):
    """The vectorized plate frames of a trace site with at least ``min_size`` elements
    (:func:`plate_size`)."""
    return {f for f in site["cond_indep_stack"] if f.vectorized and plate_size(f) >= min_size}


def sample_sites(trace):
    """The sample sites of ``trace``, in trace order, without the plates' subsample sites."""
    return [
        site
        for site in trace.nodes.values()
        if site["type"] == "sample" and not site_is_subsample(site)
    ]


def holds_no_data(site):
    """Whether an observed sample site only records a value: ``pyro.deterministic`` (and the
    combined site Pyro records for ``obs_mask``), or the ``Delta(...).mask(False)`` that
    ``poutine.reparam`` leaves at a reparameterized latent (``LocScaleReparam``,
    ``TransformReparam``: the value computed from the new latent, log-density 0).

    :param dict site: a trace site of type ``"sample"``.
    :returns: bool.

    Example::

        >>> [n for n, s in trace.nodes.items() if s["type"] == "sample" and holds_no_data(s)]   # ['z'] under LocScaleReparam of 'z'
    """
    if site["infer"].get("_deterministic"):
        return True
    fn = site["fn"]
    return (
        isinstance(fn, dist.MaskedDistribution)
        and fn._mask is False
        and isinstance(elementwise(fn.base_dist), dist.Delta)
    )


def _describe_plates(frames):
    return ", ".join(f"{f.name!r} (dim {f.dim}, size {f.size})" for f in sorted(frames, key=lambda f: f.dim))


_EVENT_DIMS_HINT = (
    "Declare the tokens of one datapoint as event dims, e.g. dist.Normal(loc, scale).to_event(1), "
    "inside a pyro.plate over datapoints"
)


def _token_frames(site, latents, token_plates):
    """The frames of observed ``site`` that are token plates (see the module docstring);
    empty when none is."""
    name = site["name"]
    frames = vectorized_frames(site)
    if token_plates is not None:
        names = (token_plates,) if isinstance(token_plates, str) else tuple(token_plates)
        unknown = [p for p in names if p not in {f.name for f in frames}]
        if unknown:
            raise ValueError(
                f"token_plates={names!r}: observed site {name!r} is in no plate named "
                f"{', '.join(map(repr, unknown))}; its plates: {_describe_plates(frames) or 'none'}."
            )
        return {f for f in frames if f.name in names}
    # latents are matched to plates by identity, whatever their size (a data plate of one
    # datapoint still holds the latents). Plates of size 1 are left out first: the layouts
    # of the latents are read on the plates that tell them apart (a latent also in a plate
    # "groups" of one element, beside latents in the data plate alone); where those find no
    # token plate, they count too: a data set of one datapoint, a lone group of a hierarchy
    # (its members were taken for datapoints and its latent for a global one), one member
    # per group (refused as having no tokens)
    in_latents = [vectorized_frames(s) & frames for s in latents]
    for min_size in (2, 1):
        found = _token_plates_beside(
            {f for f in frames if plate_size(f) >= min_size},
            [{f for f in fr if plate_size(f) >= min_size} for fr in in_latents if fr],
        )
        if found:
            return found
    # every plate, whatever its size: the roles are as ambiguous with one datapoint or one
    # token (a per-token switch alone was refused at 2 x 3 and read as 3 datapoints at 1 x 3)
    if not site["fn"].event_shape and len(frames) > 1:
        where = "; ".join(
            f"{s['name']!r} in {', '.join(repr(f.name) for f in sorted(fr, key=lambda f: f.dim))}"
            for s, fr in zip(latents, in_latents) if fr
        )
        raise ValueError(
            f"Observed site {name!r} has no event dims and sits in the plates "
            f"{_describe_plates(frames)}; which of them run over tokens and which over "
            f"datapoints is ambiguous (the latent sites do not tell them apart"
            f"{': ' + where if where else ''}; a latent in some of these plates and not the "
            f"others is shared by the others' elements, a global latent there). "
            f"Pass token_plates=(<names>) to MaskedPretrainingLoss / Evidence, "
            f"or: {_EVENT_DIMS_HINT}."
        )
    return set()


def _token_plates_beside(frames, local):
    """The token plates among ``frames`` (the observed site's) given ``local``, the plates
    among them of each latent that sits in any; empty when these do not tell."""
    holding = set().union(*local) if local else set()
    candidates = frames - holding
    if candidates and local and all(fr == holding for fr in local):
        return candidates
    if local:
        # latents one per token too (a zero-inflation switch in plates "data" and "tok"):
        # the plates that every latent sits in are the data plates when some latent sits in
        # those alone (a datapoint's own latent; were "tok" a data plate, that latent would be
        # shared by its elements), and the observed site's other plates are the token plates
        inner = set.intersection(*local)
        rest = frames - inner
        if inner and rest and any(fr == inner for fr in local):
            return rest
    return set()


def _one_token_per_datapoint(site, latents):
    """Whether a scalar observation (no event dims, no token plate) is one token per
    datapoint: some latent sits in every plate of the site
    (e.g. Pyro's 1-D GMM, ``a ~ Categorical(w)``, ``x ~ Normal(locs[a], s)`` in one data
    plate). The plates' elements then each have their own latent, so they are the
    datapoints, not tokens that share one; without such a latent it stays ambiguous."""
    # every plate, also of one element: a batch of one datapoint is no different
    frames = vectorized_frames(site)
    return bool(frames) and any(frames <= vectorized_frames(s) for s in latents)


def missing_value_sites(model_trace, token_site=None, read=None):
    """The latent sites in which Pyro draws the missing values of an observation given
    ``obs_mask=`` (``'<name>_unobserved'`` beside ``'<name>_observed'``): integrating them
    out is leaving the missing tokens out, so no estimate treats them as latents, unless the
    model reads them.

    :param model_trace: a model trace (Pyro ``Trace``).
    :param str token_site: the token site's name; its own draws are always left out.
    :param callable read: ``read(name)``, whether the model reads the draws of site ``name``
        elsewhere (another site's distribution depends on the filled-in values); such draws of
        another observed site stay latents, integrated like any other. None: none is read.
    :returns: a set of site names.

    Example::

        >>> missing_value_sites(poutine.trace(ppca).get_trace(x, mask))  # PPCA with obs_mask=
        {'x_unobserved'}
    """
    out = set()
    for name, site in model_trace.nodes.items():
        if site["type"] == "sample" and site["is_observed"] and name.endswith("_observed") and site.get("mask") is not None:
            companion = name[: -len("_observed")] + "_unobserved"
            node = model_trace.nodes.get(companion)
            if node is None or node["type"] != "sample" or node["is_observed"]:
                continue
            # another site's filled-in values that the model reads (y ~ N(f(x_filled))) are latents
            # of log p(y): dropping them gave random numbers (up to 1.1 nats off, no word why)
            if name != token_site and read is not None and read(companion):
                continue
            out.add(companion)
    return out


def locate_site(model_trace, obs_site, read=None):
    """The observed token site of a model trace, its latent sites and its other observed and factor sites.

    :param model_trace: a model trace (Pyro ``Trace``).
    :param str obs_site: the name of the token site; None takes the one observed site.
    :param callable read: for :func:`missing_value_sites`: whether the model reads the
        missing-value draws of another observed site.
    :returns: ``(site, latents, others)``: the token site, the list of latent
        sites and the list of other observed and ``pyro.factor`` sites.
    :raises ValueError: when there is no such site, or several and no ``obs_site``.
    """
    sites = sample_sites(model_trace)
    # pyro.deterministic sites (and the combined site Pyro records for obs_mask, and
    # poutine.reparam's record of a reparameterized latent) hold no data
    observed = [s for s in sites if s["is_observed"] and not holds_no_data(s)]
    factors = [s for s in observed if is_factor(s)]
    observed = [s for s in observed if not is_factor(s)]
    if obs_site is None:
        if not observed:
            raise ValueError(
                "The model has no observed sample site: masked pre-training needs "
                "data. Pass the data with pyro.sample(name, dist, obs=x)."
            )
        if len(observed) > 1:
            names = ", ".join(repr(s["name"]) for s in observed)
            # the state space model's distribution for the latents the model has
            latents = [s for s in sites if not s["is_observed"] and not holds_no_data(s)]
            discrete = bool(latents) and all(getattr(s["fn"], "has_enumerate_support", False) for s in latents)
            hmm = ("dist.DiscreteHMM site (discrete states)" if discrete else
                   "dist.GaussianHMM site (linear-Gaussian states; dist.DiscreteHMM for discrete ones)")
            # three or more names that differ only in a trailing number: one observation written in a
            # Python loop (Pyro's SVI tutorial's coin, obs_0..obs_9), where obs_site= would score one
            # of them (two, x1 and x2, are as often two views of the data)
            stems = [re.sub(r"_?\d+$", "", s["name"]) for s in observed]
            if any(stems.count(stem) >= 3 for stem in stems):
                looped = [s["name"] for s, stem in zip(observed, stems) if stems.count(stem) >= 3]
                raise ValueError(
                    f"The model observes several sites ({names}); {looped[0]!r}, {looped[1]!r}, … look like "
                    f"one observation written in a Python loop, one site a datapoint or step. The tokens "
                    f"come from one site: write it as one site in a pyro.plate over the data (with "
                    f"pyro.plate('data', len(data)): pyro.sample('obs', dist, obs=data)), and pass "
                    f"token_plates=('data',) when latents outside the plate are shared by all the data "
                    f"(the dataset is then one datapoint); a state space model is one {hmm} whose "
                    f"event dim is time."
                )
            raise ValueError(
                f"The model observes several sites ({names}); say which one holds "
                f"the tokens with obs_site=<name>. (The tokens of a datapoint come from "
                f"one site: a state space model written with one observed site per step "
                f"is one {hmm} whose event dim is time.)"
            )
        site = observed[0]
    else:
        if obs_site not in model_trace.nodes:
            names = ", ".join(repr(s["name"]) for s in observed) or "none"
            raise ValueError(
                f"obs_site={obs_site!r} is not a site of the model; observed sites: {names}."
            )
        site = model_trace.nodes[obs_site]
        if site["type"] == "sample" and site["infer"].get("_deterministic"):
            # obs_mask=... records the data at '<name>_observed'
            site = model_trace.nodes.get(f"{obs_site}_observed", site)
        if site["type"] != "sample" or not site["is_observed"] or holds_no_data(site):
            raise ValueError(
                f"obs_site={obs_site!r} is not an observed sample site; pass the data "
                f"with pyro.sample({obs_site!r}, dist, obs=x)."
            )
    # obs_mask=m makes Pyro sample the missing values as '<base>_unobserved': integrating
    # them out is exactly leaving the missing tokens out, so it is not a latent here; nor is
    # that of another observed site, which the estimates leave out whole (extra_sites="drop":
    # scoring y beside an x with obs_mask refused 'x_unobserved' as a masked latent, and
    # quadrature counted its dims)
    ignored = missing_value_sites(model_trace, site["name"], read)
    latents = [s for s in sites if not s["is_observed"] and s["name"] not in ignored]
    others = [s for s in observed + factors if s is not site]
    return site, latents, others


def site_layout(site, latents, token_plates):
    """The token site's :class:`~pyro_mpt.token_layout.TokenLayout` and the names of its token plates.

    :param dict site: the token site, from :func:`locate_site`.
    :param list latents: the latent sites (they tell token plates from data plates).
    :param token_plates: the names of the token plates, or None to detect them
        (see the module docstring).
    :returns: ``(layout, names)``.
    :raises ValueError: for a layout the engines cannot serve (no tokens, a
        subsampled token plate, a batch dim that is no plate).
    """
    name = site["name"]
    event_shape = data_event_shape(site["fn"], site["value"])
    site_batch_shape = site["fn"].batch_shape
    tframes = _token_frames(site, latents, token_plates)
    if not tframes and not event_shape and not (token_plates is None and _one_token_per_datapoint(site, latents)):
        named = "" if token_plates is None else f" and token_plates={token_plates!r} names none of its plates"
        big = sorted(vectorized_frames(site, 2), key=lambda f: f.dim)
        if token_plates is None and big and latents and not any(vectorized_frames(s) & set(big) for s in latents):
            # Pyro's Bayesian regression: weights outside the data plate, a scalar observation in it
            shared = ", ".join(repr(s["name"]) for s in latents)
            plates = tuple(f.name for f in big)
            raise ValueError(
                f"Observed site {name!r} has no event dims, and its latent site(s) {shared} sit outside its "
                f"plate(s) {', '.join(map(repr, plates))}: they are shared by all the plate's elements, so "
                f"log p of one element is not defined apart from the others. To score the whole dataset "
                f"as one datapoint, log p(x_1..x_N) (e.g. a Bayesian linear regression), pass "
                f"token_plates={plates!r} to MaskedPretrainingLoss / Evidence; or declare a datapoint's "
                f"tokens as event dims with a latent per datapoint."
            )
        raise ValueError(
            f"Observed site {name!r} has no event dims{named}, so it has no tokens. "
            f"{_EVENT_DIMS_HINT}; or, when a pyro.plate runs over the tokens, name it "
            f"with token_plates=(<name>,)."
        )
    token_names = {f.name for f in tframes}
    for f in tframes:
        if f.full_size is not None and f.size != f.full_size:
            raise ValueError(
                f"Token plate {f.name!r} of observed site {name!r} subsamples {f.size} of "
                f"{f.full_size} tokens; masked pre-training needs every token of a "
                f"datapoint. Subsample a datapoint plate instead; where the token plate runs over "
                f"the whole data set as one datapoint (latents shared by all its units), log p of "
                f"the data set has no minibatch estimate: train on the full data, or fit the shared "
                f"latents by MAP (an AutoDelta guide over them, which holds them fixed) with a plate "
                f"of datapoints that may be subsampled."
            )
    plate_dims = {f.dim for f in site["cond_indep_stack"] if f.vectorized}
    for i, size in enumerate(site_batch_shape):
        dim = i - len(site_batch_shape)
        if size > 1 and dim not in plate_dims:
            raise ValueError(
                f"Observed site {name!r} has batch shape {tuple(site_batch_shape)} but its "
                f"dim {dim} (size {size}) is not a pyro.plate: put the datapoints in "
                f"a pyro.plate, or move token dims into the event with .to_event()."
            )
    layout = TokenLayout(site_batch_shape, event_shape, tuple(sorted(f.dim for f in tframes)))
    return layout, tuple(sorted(token_names))
