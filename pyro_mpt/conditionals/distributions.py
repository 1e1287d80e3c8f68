r"""Distribution helpers the engines share.

An engine reads the observed site's per-token log-densities off its *base*
distribution (the one under ``Independent`` and mask wrappers), keeps
parameters that all datapoints share at size one, and needs the tokens to be
independent given the latents, i.e. the observed log-density to factorize,

.. math::

    \log p(x \mid z) = \sum_{d=1}^D \log p(x_d \mid z),

which holds exactly when the base distribution has no event dims.
"""

import math

import torch
import pyro.distributions as dist
from pyro.distributions.hmm import HiddenMarkovModel

from .base import EngineNotApplicable

__all__ = ["unwrap", "affine_normal", "base_distribution", "token_log_prob", "compact", "take_rows", "check_factorized",
           "check_sequence_alone", "check_one_sequence"]


def unwrap(fn, masks=False):
    """Strip ``Independent`` wrappers; return the base distribution and the event dims they added.

    :param fn: a distribution.
    :param bool masks: strip ``MaskedDistribution`` wrappers too (for the
        observed site, whose mask :func:`~pyro_mpt.observed_tokens.trace_tokens` has read
        into ``tokens.observed``).
    :returns: ``(base, reinterpreted)``.

    Example::

        >>> unwrap(dist.Normal(torch.zeros(3), 1.0).to_event(1))  # (Normal, 1)
    """
    reinterpreted = 0
    while True:
        if isinstance(fn, (dist.Independent, torch.distributions.Independent)):
            reinterpreted += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        elif masks and isinstance(fn, dist.MaskedDistribution):
            fn = fn.base_dist
        else:
            return fn, reinterpreted


def _elementwise_affine_parts(transforms):
    """The ``AffineTransform`` s of a transform list with ``ComposeTransform`` s and
    ``IndependentTransform`` s opened (both keep an elementwise map elementwise), or None
    where any part is not affine."""
    parts = []
    for t in transforms:
        while isinstance(t, torch.distributions.transforms.IndependentTransform):
            t = t.base_transform
        if isinstance(t, torch.distributions.ComposeTransform):
            inner = _elementwise_affine_parts(t.parts)
            if inner is None:
                return None
            parts.extend(inner)
        elif isinstance(t, torch.distributions.AffineTransform):
            parts.append(t)
        else:
            return None
    return parts


def affine_normal(fn):
    r"""The ``Normal`` that a ``TransformedDistribution`` of a ``Normal`` by affine maps is, or None.

    ``TransformedDistribution(Normal(m, s), [AffineTransform(a, b)])`` is
    :math:`\mathcal N(a + b m, |b| s)` (elementwise; ``Independent`` wrappers
    of the base are stripped, the transforms' ``event_dim`` does not change an
    elementwise map). So is any chain of them: several ``AffineTransform`` s,
    ``ComposeTransform`` s and ``IndependentTransform`` s of them, and a base that
    is itself such a ``TransformedDistribution``. Its batch and event dims are
    ``fn``'s, flattened into one ``Normal`` of shape ``fn.batch_shape + fn.event_shape``.

    Example::

        >>> affine_normal(dist.TransformedDistribution(dist.Normal(0., 1.), [AffineTransform(1., 2.)]))  # Normal(1, 2)
    """
    if not isinstance(fn, torch.distributions.TransformedDistribution):
        return None
    base, _ = unwrap(fn.base_dist)
    # a nested TransformedDistribution (pyro flattens those it builds, users' own may not be)
    base = affine_normal(base) or base
    if type(base) not in (dist.Normal, torch.distributions.Normal):
        return None
    parts = _elementwise_affine_parts(fn.transforms)
    if parts is None:
        return None
    loc, scale = base.loc, base.scale
    for t in parts:
        loc, scale = t.loc + t.scale * loc, torch.as_tensor(t.scale, dtype=loc.dtype, device=loc.device).abs() * scale
    shape = fn.batch_shape + fn.event_shape
    try:
        loc, scale = torch.as_tensor(loc).expand(shape), torch.as_tensor(scale).expand(shape)
    except RuntimeError:
        return None
    return dist.Normal(loc, scale)


def base_distribution(fn):
    """``fn`` without its ``Independent`` and ``MaskedDistribution`` wrappers.

    Example::

        >>> base_distribution(dist.Bernoulli(p).to_event(1).mask(m))  # Bernoulli
    """
    return unwrap(fn, masks=True)[0]


def token_log_prob(base, value):
    r"""``base.log_prob(value)``, by a cheaper closed form for the common token distributions.

    For a ``Bernoulli`` given by its logits :math:`\ell` at binary tokens,
    :math:`\log p(x \mid \ell) = -\operatorname{softplus}(\ell\,(1 - 2x))`: one
    product and one softplus, about half the passes of
    ``binary_cross_entropy_with_logits`` (which ``Bernoulli.log_prob`` calls and
    negates) over tables of millions of entries. Other distributions, and
    non-binary values, go to ``base.log_prob``.

    :param base: a distribution with no event dims (see :func:`base_distribution`).
    :param torch.Tensor value: tokens broadcastable against its batch shape.
    :returns: the per-token log-densities, broadcast shape of the two.

    Example::

        >>> token_log_prob(dist.Bernoulli(logits=l), x)  # == dist.Bernoulli(logits=l).log_prob(x)
    """
    if (
        type(base) in (dist.Bernoulli, torch.distributions.Bernoulli)
        and "logits" in base.__dict__  # given by its logits (no conversion from probs)
        and torch.is_tensor(value)
        and torch.is_floating_point(value)
        and bool(((value == 0) | (value == 1)).all())
    ):
        y = base.logits * (1 - 2 * value)
        # softplus(y) = y above the threshold; torch's default (20) is off by
        # exp(-20) = 2e-9, visible in float64: put it where exp(-t) is below rounding
        threshold = 2.0 - math.log(torch.finfo(y.dtype).eps)
        return torch.nn.functional.softplus(y, threshold=threshold).neg_()
    return base.log_prob(value)


def compact(t):
    """Narrow every stride-0 (expanded) dim of size > 1 to size 1.

    Exact (the narrowed dims hold copies) and keeps gradients, so a parameter
    shared by all datapoints is stored and differentiated once. When ``t`` is a
    view (distributions expand their parameters by broadcasting), the result is
    taken as a view of the view's base: the backward pass of ``narrow`` would
    allocate and sum a zero gradient of ``t``'s full expanded size (26 M
    elements for PPCA's K + 4 noise points at N = 1000, D = 512, K = 50), where
    the base's gradient has the base's size.

    Example::

        >>> compact(torch.zeros(3).expand(5, 3)).shape  # torch.Size([1, 3])
    """
    dims = [d for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if stride == 0 and size > 1]
    if not dims:
        return t
    base = t._base
    if base is not None and base.numel() < t.numel():
        shape = [1 if d in dims else size for d, size in enumerate(t.shape)]
        return base.as_strided(shape, t.stride(), t.storage_offset())
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def take_rows(t, idx):
    """Rows ``idx`` of a tensor whose leading dim is ``n``, or ``t`` itself when it is 1 (shared).

    Example::

        >>> take_rows(torch.zeros(1, 4), [0, 2]).shape  # torch.Size([1, 4])
    """
    return t if t.shape[0] == 1 else t[idx]


def check_factorized(fn, name, who, error=EngineNotApplicable,
                     instead="for a Gaussian marginal use conditionals='gaussian'"):
    """Raise ``error`` unless the tokens of ``fn`` are independent given the latents.

    :param fn: the observed site's distribution (wrappers allowed).
    :param str name: the observed site, for the message.
    :param str who: the engine, for the message (e.g. ``"conditionals='importance'"``).
    :param type error: the exception class.
    :param str instead: what else to do, ending the message.
    :returns: the base distribution.
    :raises EngineNotApplicable: (or ``error``) when the base has event dims.

    Example::

        >>> check_factorized(tokens.site["fn"], tokens.name, "conditionals='importance'")
    """
    base = base_distribution(fn)
    if len(base.event_shape) > 0 and isinstance(base, (dist.Multinomial, dist.DirichletMultinomial)):
        # counts are a summary of draws: the draws are the tokens
        draws = "dist.Categorical(probs.unsqueeze(-2).expand(..., total_count, K)).to_event(1)"
        if isinstance(base, dist.DirichletMultinomial):
            # its draws share the Dirichlet: a latent, not independent tokens
            draws = (f"probs = pyro.sample(..., dist.Dirichlet(concentration)) in the data plate, "
                     f"then {draws}")
        raise error(
            f"{who} needs the tokens of observed site {name!r} to be independent given "
            f"the latents, but it is {type(base).__name__}: its count vector of event "
            f"shape {tuple(base.event_shape)} does not factorize over categories. Observe "
            f"the draws as Categorical tokens instead, {draws} (log p of the counts is "
            f"that of the draws plus log of the multinomial coefficient, a constant); {instead}."
        )
    if isinstance(base, dist.OneHotCategorical):
        # the one-hot elements of a draw are not independent (one of them is 1): the draw is the token
        raise error(
            f"{who} needs the tokens of observed site {name!r} to be independent given "
            f"the latents, but it is OneHotCategorical: the {base.event_shape[-1]} elements of a "
            f"one-hot vector are one draw, not independent tokens. Observe the category index "
            f"instead, dist.Categorical(probs) with obs=x.argmax(-1) (several draws a datapoint: "
            f"dist.Categorical(probs).to_event(1)); log p is the same; {instead}."
        )
    if isinstance(base, HiddenMarkovModel):
        # the advice for other event dims (independent tokens) cannot be followed by a chain
        raise error(
            f"{who} needs the tokens of observed site {name!r} to be independent given "
            f"the latents, but it is {type(base).__name__}: its time steps depend on one another "
            f"through the hidden chain. With no latent beside the chain, conditionals='hmm' "
            f"(DiscreteHMM) or 'gaussian_hmm' (GaussianHMM) sums it exactly, and a discrete class "
            f"per sequence that picks a DiscreteHMM's parameters is summed by 'enumerate'; with a "
            f"continuous latent beside it no engine computes its masked conditionals, and "
            f"Evidence(method='importance') estimates its log p(x)."
        )
    if len(base.event_shape) > 0:
        gaussian = isinstance(base, (torch.distributions.MultivariateNormal,
                                     torch.distributions.LowRankMultivariateNormal))
        raise error(
            f"{who} needs the tokens of observed site {name!r} to be independent given "
            f"the latents, but its distribution is {type(base).__name__} with event "
            f"shape {tuple(base.event_shape)}, whose log-density does not factorize over "
            f"tokens. Write it as independent tokens, e.g. "
            f"dist.Normal(loc, scale).to_event(1); {instead}"
            # the 'gaussian' engine the advice names needs the latents out of the covariance:
            # say where a scale mixture (a latent inside it) stands, so the advice is no circle
            + (". A latent inside the covariance (a scale mixture) leaves the tokens neither "
               "independent nor jointly Gaussian: no engine computes its masked conditionals, "
               "and Evidence(method='importance') estimates its log p(x)." if gaussian else ".")
        )
    return base


def check_sequence_alone(tokens, seq, who, verb, advice):
    """Refuse a model with latents or token plates beside an observed sequence
    distribution whose hidden chain an engine integrates (``DiscreteHMM``, ``GaussianHMM``).

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param seq: the site's base distribution.
    :param str who: the engine, for the message.
    :param str verb: what the engine does to the chain ("sums", "integrates").
    :param str advice: the message's end: what to do instead.
    :raises EngineNotApplicable: naming the other latents or the token plates.

    Example::

        >>> check_sequence_alone(tokens, hmm, "conditionals='hmm'", "sums", ". Make the other latents pyro.params.")
    """
    if tokens.latent_names or tokens.token_dims:
        what = (
            f"latent site(s) {', '.join(map(repr, tokens.latent_names))}"
            if tokens.latent_names
            else f"token plate(s) {', '.join(map(repr, tokens.token_plates))}"
        )
        raise EngineNotApplicable(
            f"{who} {verb} the hidden chain of the {type(seq).__name__} at site {tokens.name!r} "
            f"and nothing else, but the model has {what}{advice}"
        )


def check_one_sequence(tokens, seq, who, advice=""):
    """Refuse an observed site that holds several sequences per datapoint (a sequence
    distribution with extra event dims, e.g. ``.expand_by([2]).to_event(1)``).

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param seq: the site's base distribution.
    :param str who: the engine, for the message.
    :param str advice: appended to the message (another engine that serves such sites).
    :raises EngineNotApplicable: naming the number of sequences per datapoint.

    Example::

        >>> check_one_sequence(tokens, hmm, "conditionals='hmm'")
    """
    outer = len(tokens.event_shape) - len(seq.event_shape)
    if outer:
        raise EngineNotApplicable(
            f"{who} reads one sequence per datapoint, but observed site {tokens.name!r} "
            f"holds {tokens.event_shape[:outer].numel()} per datapoint (a {type(seq).__name__} with "
            f"{outer} extra event dim(s), e.g. .to_event(1) over a batch of sequences). Put "
            f"the sequences in a pyro.plate instead, so that each is a datapoint{advice}."
        )
