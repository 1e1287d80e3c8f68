r"""Checks on the guide: its sites match the model's latents, and as a proposal it has a density.

Two mistakes give silently wrong numbers rather than errors:

* **Names that do not match.** The model is replayed on the guide's trace by
  site name, so a guide whose sites are named differently from the model's
  latents (``"zz"`` for ``"z"``) is ignored: the closed-form and quadrature
  engines never read it, and the importance engines and encode_decode fall back to the prior.
  :func:`check_guide_sites` warns, as Pyro's ``Trace_ELBO`` does ("Found vars
  in model but not guide"). A guide that samples nothing (the no-op guide
  ``lambda x: None`` of masked pre-training) is not a mismatch; sites marked
  ``infer={"is_auxiliary": True}`` are skipped, as in Pyro.
* **A proposal without a density.** Importance sampling with proposal
  :math:`q` estimates :math:`p(x) = \mathbb E_q[p(x, z)/q(z)]` only when
  :math:`q` has a density that covers the posterior. A point mass at
  :math:`z_0` (``AutoDelta``, a ``dist.Delta`` site, a ``Normal`` whose scale
  rounds to zero) gives the single weight :math:`p(x, z_0)`: the estimate is
  :math:`\log p(x, z_0)` with zero spread, thousands of nats off and looking
  perfect. :func:`check_proposal_density` refuses it. It reads the guide
  trace's distributions, not their class: a latent site is a point mass at a
  datapoint when two further draws from its distribution repeat the traced
  value exactly (for a continuous latent, a probability-zero event otherwise)
  and, for a discrete latent, the traced value has probability one.

A guide given to SVI with this loss is often not trained at all: the exact engines
integrate the latents themselves and never read it, and the sampling engines use it as a
proposal without a gradient (``guide_grad=False``, ``encoder_grad=False``), so an
``AutoNormal``'s parameters stay at their initial values, silently.
:class:`GuideTrainingCheck` says so once, after the first two steps (from the parameters the
steps' own guide traces read: no extra run of the guide), and points to
:class:`~pyro_mpt.guide_elbo.WithGuideELBO`.

And one mistake gives a silently biased gradient: an importance-weighted
estimate differentiated through draws that have no reparameterized sampler
(a ``Categorical`` guide site) misses the score-function term of those draws,
so the guide's parameters get a biased gradient.
:func:`warn_not_reparameterized` says so once per site.
"""

import math
import warnings

import torch
import pyro.distributions as dist
from .code_origin import user_stacklevel
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import site_is_subsample

__all__ = [
    "GuideTrainingCheck", "check_guide_sites", "check_proposal_density", "guide_params", "warn_not_reparameterized",
    "warn_untrained_guide",
]


def _guide_sample_sites(guide_trace):
    return [
        site
        for site in guide_trace.nodes.values()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("is_auxiliary")
    ]


def _names(names):
    return ", ".join(repr(n) for n in names) or "none"


def check_guide_sites(tokens):
    """Warn when the guide samples sites the model lacks, or leaves some of the model's latents out.

    A per-step check: like Pyro's own ``check_model_guide_match``, it runs only
    while Pyro's validation is on (:func:`pyro.infer.util.is_validation_enabled`).

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens (with the guide trace).
    :returns: ``(extra, missing)``: guide sites that are not latents of the
        model, and model latents the guide does not sample (both empty while
        validation is off).
    """
    sampled = _guide_sample_sites(tokens.guide_trace)
    if not sampled or not is_validation_enabled():
        return [], []
    model_latents = {
        name
        for name, site in tokens.model_trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }
    names = [s["name"] for s in sampled]
    extra = [n for n in names if n not in model_latents]
    missing = [n for n in tokens.latent_names if n not in names]
    if extra or missing:
        warnings.warn(
            f"The guide does not match the model: guide site(s) not in the model: "
            f"{_names(extra)}; model latent(s) the guide does not sample: {_names(missing)} "
            f"(the model's latents: {_names(tokens.latent_names)}). Pyro matches sites by "
            f"name, so the closed-form and quadrature engines ignore this guide, the "
            f"importance engines draw the latents it leaves out from the prior, and so does "
            f"conditionals='encode_decode' at every round, whose chains then never condition "
            f"those latents on the data, so its estimate can be far off. Name the "
            f"guide's sites after the model's latents (as pyro.infer.autoguide does), mark "
            f"helper sites infer={{'is_auxiliary': True}}, or pass no guide.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return extra, missing


def _point_mass(site, discrete):
    """Bool tensor over the site's batch shape: the distribution is a point mass there."""
    fn, value = site["fn"], site["value"]
    devices = [value.device.index or 0] if value.is_cuda else []
    try:
        # the extra draws must not move the caller's random stream
        with torch.random.fork_rng(devices=devices):
            draws = fn.sample((2,))
    except NotImplementedError:
        return None
    same = (draws == value).all(0)
    event_dim = len(fn.event_shape)
    if event_dim:
        same = same.flatten(-event_dim).any(-1)  # one point-mass coordinate suffices
    log_q = fn.log_prob(value)
    if discrete:
        # probability one, to the rounding of normalizing the probabilities
        same = same & (log_q >= -16 * torch.finfo(log_q.dtype).eps)
    # a density that is infinite or undefined at its own draw (e.g. a singular covariance)
    return same | torch.isnan(log_q) | (log_q == math.inf)


def check_proposal_density(tokens, who, instead):
    """Refuse a guide that is a point mass at some latent site and datapoint.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens (with the guide trace).
    :param str who: the caller, named in the message.
    :param str instead: what to use instead, named in the message.
    :raises ValueError: naming the site, its distribution and the datapoints.

    Guides with auxiliary or extra sites (e.g. ``AutoMultivariateNormal``,
    whose latent sites are ``Delta`` transforms of one auxiliary draw) are left
    to the engines' own checks.
    """
    sampled = _guide_sample_sites(tokens.guide_trace)
    latent = set(tokens.latent_names)
    if any(s["name"] not in latent for s in sampled) or any(
        s["infer"].get("is_auxiliary") for s in tokens.guide_trace.nodes.values() if s["type"] == "sample"
    ):
        return
    for site in sampled:
        model_fn = tokens.model_trace.nodes[site["name"]]["fn"]
        discrete = bool(getattr(model_fn.support, "is_discrete", False))
        with torch.no_grad():
            point = _point_mass(site, discrete)
        if point is None or not bool(point.any()):
            continue
        fn = site["fn"]
        base = fn
        while hasattr(base, "base_dist"):
            base = base.base_dist
        if isinstance(base, dist.Delta):
            advice = f"A MAP guide (AutoDelta, dist.Delta) cannot be a proposal; use {instead}."
        elif discrete:
            advice = (
                f"A {type(base).__name__} guide site with all its mass on one value (a one-hot "
                f"Categorical, a MAP value) cannot be a proposal; give it mass on every value the "
                f"posterior can take (logits that are not one-hot), or leave the discrete latent to "
                f"conditionals='enumerate' (Evidence(method='exact')), which sums it."
            )
        else:
            advice = (
                f"Its {type(base).__name__} scale rounds to zero there (the guide collapsed: e.g. "
                f"training diverged at too large a learning rate), and such a guide cannot be a "
                f"proposal; use {instead}."
            )
        raise ValueError(
            f"{who}: guide site {site['name']!r} ({type(base).__name__}) is a point mass at "
            f"{int(point.sum())} of {math.prod(point.shape) or 1} value(s), so as an importance "
            f"proposal it has no density over the model's latent space: its weights "
            f"p(x, z0) / q(z0) give log p(x, z0) at one point, not the evidence, with zero "
            f"spread. {advice}"
        )


def warn_not_reparameterized(tokens, who, warned):
    r"""Warn, once per guide site, that a draw without ``rsample`` biases its parameters' gradient.

    An importance-weighted estimate :math:`\log\frac1S\sum_s p(x, z_s)/q_\phi(z_s)` is
    differentiated through its draws; a draw :math:`z_s` with no reparameterized sampler
    contributes only :math:`-\nabla_\phi\log q_\phi(z_s)` through its weight, not the
    score-function term :math:`\nabla_\phi\log q_\phi(z_s)` of the draw itself, so the
    gradient with respect to :math:`\phi` is biased (as in Pyro's ``RenyiELBO``). Only
    sites whose log-density depends on something that requires a gradient are named:
    the model's gradient (draws held fixed) is the estimate's own.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens (with the guide trace).
    :param str who: the caller, named in the message.
    :param set warned: names of the sites already warned about; updated in place.

    Example::

        >>> warn_not_reparameterized(tokens, "ImportanceWeightedELBO", self._warned)
    """
    if not torch.is_grad_enabled():
        return
    sites = []
    for site in _guide_sample_sites(tokens.guide_trace):
        fn = site["fn"]
        if getattr(fn, "has_rsample", True) or site["name"] in warned:
            continue
        if fn.log_prob(site["value"]).requires_grad:
            sites.append((site["name"], type(fn).__name__))
    if sites:
        warned.update(name for name, _ in sites)
        names = ", ".join(f"{name!r} ({kind})" for name, kind in sites)
        warnings.warn(
            f"{who}: guide site(s) {names} have no reparameterized sampler (has_rsample=False): "
            f"the estimate's gradient flows through the log-densities of their draws but not "
            f"through the draws (no score-function term), so the guide's parameters get a biased "
            f"gradient, as with Pyro's RenyiELBO. Reparameterize the site, sum a discrete latent "
            f"out in the model (TraceEnum_ELBO), or train the guide by Trace_ELBO "
            f"(pyro_mpt.guide_elbo.WithGuideELBO).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def guide_params(guide_trace):
    """The unconstrained tensors of the parameters a guide trace read, ``{name: tensor}``
    (none without a trace)."""
    if guide_trace is None:
        return {}
    return {name: site["value"].unconstrained() for name, site in guide_trace.nodes.items() if site["type"] == "param"}


class GuideTrainingCheck:
    """Which of a guide's parameters the loss's backward passes reach, over its first
    ``STEPS`` steps; then a warning naming those it never reached, once.

    A parameter counts as reached where its gradient is not None and not all zeros at some
    step: the exact engines leave the guide out of the graph (None), the importance proposal
    (``guide_grad=False``) detaches an autoguide's distributions (None; they met it through two
    paths that cancelled, leaving an ``AutoNormal``'s scales a gradient of rounding, 1e-17,
    which went unnamed and which Adam turned into steps of its full size) and meets a guide of
    the user's through detached draws (zeros, or such rounding). No threshold on the
    gradient's size: Adam trains a
    parameter whatever its gradient's scale (an encoder behind a factor of 1e-5 was named
    untrained by one). Two steps, not one: a layer behind a zero-initialized one (a residual
    encoder's start) gets a zero gradient at the first step only.

    Example::

        >>> check = GuideTrainingCheck()
        >>> check.record(guide_params(guide_trace), "gaussian")
    """

    STEPS = 2

    def __init__(self):
        self.steps = 0
        self.params = {}  # name -> reached at some step
        self.done = False

    def record(self, guide, engine_name):
        """After a step's backward pass: note which of ``guide``'s parameters (``{name: tensor}``,
        :func:`guide_params`) it reached; after the last step, warn about those never reached."""
        for name, p in guide.items():
            if not p.requires_grad:
                continue
            reached = p.grad is not None and bool(p.grad.any())
            self.params[name] = self.params.get(name, False) or reached
        self.steps += 1
        if self.steps >= self.STEPS:
            self.done = True
            warn_untrained_guide([name for name, reached in self.params.items() if not reached], engine_name)


def warn_untrained_guide(untrained, engine_name):
    """Warn that the guide's parameters ``untrained`` (names) got no gradient from the loss.

    :param list untrained: parameter names; nothing happens where it is empty.
    :param str engine_name: the engine that served the loss, for the message.
    """
    if not untrained:
        return
    names = ", ".join(repr(n) for n in untrained[:3]) + (", …" if len(untrained) > 3 else "")
    warnings.warn(
        f"The guide's parameters ({names}) get no gradient from MaskedPretrainingLoss "
        f"(conditionals={engine_name!r}): it trains the model only, and by it alone they "
        f"stay at their initial values. To fit the guide as a posterior approximation too, train with "
        f"WithGuideELBO(loss) (pyro_mpt.guide_elbo), which adds the ELBO's gradients for the "
        f"guide's parameters; or pass a no-op guide (lambda *args: None) where none is needed.",
        stacklevel=user_stacklevel(),
    )
