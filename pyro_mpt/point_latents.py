r"""Global latents at the guide's point estimate (MAP), as in Pyro's mixture tutorial.

Pyro's Gaussian-mixture tutorial samples the mixture's weights, locations and
scale as *global* latents (outside the data plate), fits them by MAP with an
``AutoDelta`` guide and enumerates the assignments: ``TraceEnum_ELBO`` then
maximizes

.. math::

    \log p(x \mid \hat\theta) + \log p(\hat\theta)
    = \sum_i \log p(x_i \mid \hat\theta) + \log p(\hat\theta),

the point mass of the guide at :math:`\hat\theta` contributing no entropy. A
guide with a point mass (``dist.Delta``) at a latent outside every data plate of
the observed site asks for the same of :class:`~pyro_mpt.loss.MaskedPretrainingLoss`:
the latent is held at the guide's value in the model (a parameter for the
engines, see :func:`fix_latents`), the masked pre-training estimates are of
:math:`\log p(x_i \mid \hat\theta)`, and the loss adds :math:`-\log p(\hat\theta)`
(:func:`log_prior`) once, outside the minibatch scale, as Pyro does. Point
masses at local latents stay refused (as importance proposals they give
:math:`\log p(x, z_0)`, not an evidence; see :mod:`~pyro_mpt.guide_checks`).
"""

import pyro.distributions as dist
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoDelta, AutoGuide, AutoGuideList
from pyro.poutine.messenger import Messenger

from .conditionals.distributions import unwrap
from .token_site import vectorized_frames

__all__ = ["point_global_latents", "fix_point_globals", "trace_with_point_globals", "fix_latents", "hide_sites", "log_prior"]


def point_global_latents(tokens, guide=None):
    """The model's latent sites outside every data plate of the observed site at which the guide
    puts a point mass, by name, from the model trace.

    A point mass is a site of an ``AutoDelta`` (also as a part of an ``AutoGuideList``), or a
    ``dist.Delta`` site of a guide without auxiliary sites. The ``Delta`` sites of the other
    autoguides (``AutoNormal``, ``AutoMultivariateNormal``, ...) are transforms of an auxiliary
    draw, not point masses.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: traced with the guide.
    :param guide: the guide (or None).
    :returns: ``{name: model site}`` (empty without such latents).

    Example::

        >>> point_global_latents(trace_tokens(gmm, guide, (x,), {}), guide)  # {'locs': ..., ...}
    """
    if guide is None or tokens.guide_trace is None:
        return {}
    points = _point_mass_sites(guide, tokens.guide_trace)
    data = tokens.data_frames
    return {site["name"]: site for site in tokens.latent_sites()
            if site["name"] in points and not (vectorized_frames(site) & data)}


def _point_mass_sites(guide, guide_trace):
    if isinstance(guide, AutoDelta):
        return set(_part_sites(guide))
    if isinstance(guide, AutoGuideList):
        return set().union(*(_point_mass_sites(part, guide_trace) for part in guide))
    if isinstance(guide, AutoGuide):
        return set()
    sites = [s for s in guide_trace.nodes.values() if s["type"] == "sample" and not s["is_observed"]]
    if any(s["infer"].get("is_auxiliary") for s in sites):
        return set()
    return {s["name"] for s in sites if isinstance(unwrap(s["fn"], masks=True)[0], dist.Delta)}


def fix_point_globals(tokens, model, guide):
    """The model and guide with the guide's point-mass global latents held fixed.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: traced with ``guide``.
    :returns: ``(model, guide, sites)``: ``model`` with those latents fixed at the
        guide's values (and the traced minibatch replayed), ``guide`` without them
        (:func:`hide_sites`), and ``{name: model site}`` (:func:`point_global_latents`);
        ``model`` and ``guide`` unchanged when there are none.

    Example::

        >>> model, guide, sites = fix_point_globals(tokens, gmm, AutoDelta(globals_of_gmm))
    """
    sites = point_global_latents(tokens, guide)
    if not sites:
        return model, guide, sites
    replay = tokens.subsample_trace()
    fixed = poutine.replay(fix_latents(model, {name: site["value"] for name, site in sites.items()}), trace=replay)
    return fixed, hide_sites(guide, sites, replay), sites


def trace_with_point_globals(trace, model, guide):
    """The tokens of ``model`` and ``guide`` with the guide's point-mass globals held fixed.

    :param callable trace: ``trace(model, guide)`` -> the traced tokens
        (:func:`~pyro_mpt.observed_tokens.trace_tokens` with the caller's options).
    :returns: ``(tokens, model, guide, sites)`` as :func:`fix_point_globals` gives them,
        ``tokens`` traced again with the fixed model and guide when there are such sites.

    Example::

        >>> tokens, model, guide, sites = trace_with_point_globals(lambda m, g: trace_tokens(m, g, (x,), {}), gmm, guide)
    """
    tokens = trace(model, guide)
    model, guide, sites = fix_point_globals(tokens, model, guide)
    if sites:
        tokens = trace(model, guide)
    return tokens, model, guide, sites


class _FixedLatents(Messenger):
    # the sites become deterministic (as pyro.deterministic records them): no latents, no log-density
    def __init__(self, values):
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg):
        value = self.values.get(msg["name"])
        if value is None or msg["is_observed"]:
            return
        msg["fn"] = dist.Delta(value, event_dim=len(msg["fn"].event_shape)).mask(False)
        msg["value"] = value
        msg["is_observed"] = True
        msg["infer"] = {**msg["infer"], "_deterministic": True}


def fix_latents(model, values):
    """``model`` with the latent sites ``values`` held at those values, as deterministic sites.

    :param callable model: a Pyro model.
    :param dict values: ``{name: tensor}``; gradients flow into the tensors.
    :returns: a callable with the model's signature.

    Example::

        >>> fixed = fix_latents(gmm, {"locs": torch.tensor([0.0, 10.0])})
    """

    def fixed(*args, **kwargs):
        with _FixedLatents(values):
            return model(*args, **kwargs)

    return fixed


def log_prior(sites):
    r""":math:`\log p(\hat\theta)`: the log-density of the model sites at their traced values,
    with their scale and mask, summed (a scalar tensor; 0. without sites).

    :param dict sites: ``{name: model site}`` (:func:`point_global_latents`).
    """
    total = 0.0
    for site in sites.values():
        lp = site["fn"].log_prob(site["value"])
        total = total + scale_and_mask(lp, site["scale"], site["mask"]).sum()
    return total


def hide_sites(guide, names, subsample_trace=None):
    """``guide`` without the sites ``names`` (the fixed latents are no longer the model's),
    replaying the minibatch of ``subsample_trace`` when given.

    Example::

        >>> hide_sites(guide, ["locs", "scale"], tokens.subsample_trace())
    """
    if guide is None:
        return None
    if isinstance(guide, AutoGuideList):
        # an AutoDelta part over the fixed latents beside an autoguide over the local ones:
        # the remaining part itself, so that the engines still serve it as an autoguide
        rest = [part for part in guide if not set(_part_sites(part)) <= set(names)]
        if len(rest) == 1 and not set(_part_sites(rest[0])) & set(names):
            # not wrapped in a replay either: the model follows the part's own minibatch, if
            # it draws one, and the fixed values do not depend on the minibatch
            return rest[0]
    guide = poutine.block(guide, hide=list(names))
    return guide if subsample_trace is None else poutine.replay(guide, trace=subsample_trace)


def _part_sites(part):
    trace = getattr(part, "prototype_trace", None)
    return [] if trace is None else [name for name, _ in trace.iter_stochastic_nodes()]
