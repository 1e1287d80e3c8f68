"""Finding the observed token site and the latent sites of a Pyro model.

Everything in pyro_mpt sees data the same way: the *tokens* of a datapoint are
the flattened event elements of one observed sample site, and the datapoints are
the elements of that site's batch shape, which must come from ``pyro.plate``.
:func:`trace_tokens` runs the guide and the model once and returns an
:class:`ObservedTokens` record that the schedules, the conditional engines and
the evidence estimators all share.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from pyro import poutine
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample

__all__ = ["ObservedTokens", "trace_tokens", "guess_max_plate_nesting", "check_local_latent"]


@dataclass
class ObservedTokens:
    """The observed site of a model, flattened to a ``(n, D)`` token matrix.

    :param str name: name of the observed sample site.
    :param torch.Tensor value: observed values of shape ``(n, D)``, where
        ``n = prod(batch_shape)`` and ``D = prod(event_shape)``.
    :param torch.Size batch_shape: the site's batch shape (from its plates).
    :param torch.Size event_shape: the site's event shape.
    :param torch.Tensor scale: per-datapoint scale of shape ``(n,)``; carries the
        ``N / batch_size`` factor of subsampled plates and any ``poutine.scale``.
    :param model_trace: the model trace (replayed against the guide trace).
    :param guide_trace: the guide trace (empty when there is no guide).
    :param list latent_names: names of the model's latent sample sites.
    :param int max_plate_nesting: number of plate dims the model uses.
    """

    name: str
    value: torch.Tensor
    batch_shape: torch.Size
    event_shape: torch.Size
    scale: torch.Tensor
    model_trace: Trace
    guide_trace: Trace
    latent_names: list = field(default_factory=list)
    max_plate_nesting: int = 0

    @property
    def num_tokens(self):
        """``D``, the number of tokens per datapoint."""
        return self.value.shape[-1]

    @property
    def num_data(self):
        """``n``, the number of datapoints in this (mini)batch."""
        return self.value.shape[0]

    @property
    def site(self):
        return self.model_trace.nodes[self.name]

    def latent_sites(self):
        return [self.model_trace.nodes[name] for name in self.latent_names]

    def subsample_trace(self):
        """A trace holding only the subsample sites, to replay the same minibatch."""
        trace = Trace()
        for name, site in self.model_trace.nodes.items():
            if site["type"] == "sample" and site_is_subsample(site):
                trace.add_node(name, **site)
        return trace

    def unflatten(self, values):
        """Reshape ``(..., n)`` per-datapoint values to ``(..., *batch_shape)``."""
        return values.reshape(values.shape[:-1] + self.batch_shape)


def check_local_latent(tokens, site, error=ValueError):
    """Raise ``error`` unless latent ``site`` is local to each datapoint.

    Per-datapoint masked conditionals need every latent inside exactly the data
    plates of the observed site: a latent outside them is shared by all
    datapoints (``log p(x_i)`` no longer factorizes), and one in an extra plate
    has batch dims the tokens lack.
    """
    def frames(s):
        return {f for f in s["cond_indep_stack"] if f.vectorized and f.size > 1}

    obs_frames, own = frames(tokens.site), frames(site)
    name = site["name"]
    missing = obs_frames - own
    if missing:
        plates = ", ".join(repr(f.name) for f in missing)
        raise error(
            f"Latent site {name!r} is outside the plate(s) {plates} of observed "
            f"site {tokens.name!r}: it is shared by all datapoints (a global "
            f"latent), so log p(x_i) does not factorize over datapoints. Make it "
            f"a pyro.param, or move it inside the data plate."
        )
    extra = own - obs_frames
    if extra:
        plates = ", ".join(repr(f.name) for f in extra)
        raise error(
            f"Latent site {name!r} sits in plate(s) {plates} that observed site "
            f"{tokens.name!r} lacks; declare a datapoint's latent dims as event "
            f"dims instead, e.g. dist.Normal(0, 1).expand([K]).to_event(1)."
        )


def _sample_sites(trace):
    return [
        site
        for site in trace.nodes.values()
        if site["type"] == "sample" and not site_is_subsample(site)
    ]


def guess_max_plate_nesting(*traces):
    """The number of vectorized plate dims used by the sites of ``traces``."""
    dims = [
        frame.dim
        for trace in traces
        for site in _sample_sites(trace)
        for frame in site["cond_indep_stack"]
        if frame.vectorized
    ]
    return -min(dims) if dims else 0


def trace_tokens(model, guide, args, kwargs, obs_site=None, max_plate_nesting=None):
    """Run ``guide`` then ``model`` (replayed on the guide) and locate the tokens.

    :param callable model: a Pyro model with one observed site (or ``obs_site``).
    :param callable guide: a Pyro guide, or ``None``.
    :param tuple args: positional arguments of model and guide.
    :param dict kwargs: keyword arguments of model and guide.
    :param str obs_site: name of the observed site holding the tokens; needed
        when the model observes more than one site.
    :param int max_plate_nesting: plate dims the model uses; guessed from the
        trace when ``None``.
    :returns: the observed tokens and the traces.
    :rtype: ObservedTokens
    """
    if guide is None:
        guide_trace = Trace()
        model_trace = poutine.trace(model).get_trace(*args, **kwargs)
    else:
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
    if max_plate_nesting is None or max_plate_nesting == float("inf"):
        max_plate_nesting = guess_max_plate_nesting(model_trace, guide_trace)

    sites = _sample_sites(model_trace)
    observed = [s for s in sites if s["is_observed"]]
    if obs_site is None:
        if not observed:
            raise ValueError(
                "The model has no observed sample site: masked pre-training needs "
                "data. Pass the data with pyro.sample(name, dist, obs=x)."
            )
        if len(observed) > 1:
            names = ", ".join(repr(s["name"]) for s in observed)
            raise ValueError(
                f"The model observes several sites ({names}); say which one holds "
                f"the tokens with obs_site=<name>."
            )
        site = observed[0]
    else:
        if obs_site not in model_trace.nodes:
            names = ", ".join(repr(s["name"]) for s in observed) or "none"
            raise ValueError(
                f"obs_site={obs_site!r} is not a site of the model; observed sites: {names}."
            )
        site = model_trace.nodes[obs_site]
        if site["type"] != "sample" or not site["is_observed"]:
            raise ValueError(
                f"obs_site={obs_site!r} is not an observed sample site; pass the data "
                f"with pyro.sample({obs_site!r}, dist, obs=x)."
            )
    name = site["name"]
    fn = site["fn"]
    event_shape = fn.event_shape
    batch_shape = fn.batch_shape
    if len(event_shape) == 0:
        raise ValueError(
            f"Observed site {name!r} has no event dims, so it has no tokens. Declare "
            f"the tokens of one datapoint as event dims, e.g. "
            f"dist.Normal(loc, scale).to_event(1), inside a pyro.plate over datapoints."
        )
    plate_dims = {f.dim for f in site["cond_indep_stack"] if f.vectorized}
    for i, size in enumerate(batch_shape):
        dim = i - len(batch_shape)
        if size > 1 and dim not in plate_dims:
            raise ValueError(
                f"Observed site {name!r} has batch shape {tuple(batch_shape)} but its "
                f"dim {dim} (size {size}) is not a pyro.plate: put the datapoints in "
                f"a pyro.plate, or move token dims into the event with .to_event()."
            )
    if site.get("mask") is not None and not (
        site["mask"] is True or (torch.is_tensor(site["mask"]) and bool(site["mask"].all()))
    ):
        raise ValueError(
            f"Observed site {name!r} carries a mask (missing data); masked "
            f"pre-training with missing tokens is not supported yet. Drop the mask, "
            f"or impute the missing tokens."
        )
    value = site["value"]
    if not torch.is_floating_point(value):
        value = value.to(torch.get_default_dtype())
    value = value.expand(batch_shape + event_shape)
    if not torch.isfinite(value).all():
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(
            f"Observed site {name!r} contains {bad} NaN or infinite value(s); remove "
            f"or impute them before computing masked pre-training scores."
        )
    n = math.prod(batch_shape)
    D = math.prod(event_shape)
    scale = site["scale"]
    scale = torch.as_tensor(scale, dtype=value.dtype, device=value.device)
    scale = scale.expand(batch_shape).reshape(n)
    latent_names = [s["name"] for s in sites if not s["is_observed"]]
    return ObservedTokens(
        name=name,
        value=value.reshape(n, D),
        batch_shape=batch_shape,
        event_shape=event_shape,
        scale=scale,
        model_trace=model_trace,
        guide_trace=guide_trace,
        latent_names=latent_names,
        max_plate_nesting=int(max_plate_nesting),
    )
