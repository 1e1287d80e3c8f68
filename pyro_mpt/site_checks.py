r"""Checks of an observed site's data: which models and values the tokens can come from.

:func:`~pyro_mpt.observed_tokens.trace_tokens` runs them on every trace. The shape,
dtype and extra-site checks always run (what they refuse would end in an
error from inside torch or Pyro, or in a silently different model);
:func:`validate_values` (finite values, values in the support) runs only
while Pyro's validation is on, as Pyro gates its own ``log_prob`` checks
(:func:`pyro.infer.util.is_validation_enabled`).
"""

import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)
import pyro.distributions as dist
from pyro.distributions.hmm import HiddenMarkovModel
from torch.distributions import constraints

__all__ = [
    "observation_dtype",
    "elementwise",
    "data_event_shape",
    "is_factor",
    "check_extra_sites",
    "check_dtype",
    "check_latent_dtypes",
    "check_integer_data",
    "check_shape",
    "support_ok",
    "tokens_in_support",
    "validate_values",
]


def elementwise(fn):
    """The distribution under the ``Independent`` and mask wrappers of ``fn``: its
    support is checked element by element."""
    while isinstance(fn, (dist.Independent, torch.distributions.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def data_event_shape(fn, value):
    """The event shape the data give ``fn``: a hidden Markov model without a fixed
    ``duration`` declares one time step and takes the number of steps from its data."""
    event = fn.event_shape
    hmm = elementwise(fn)
    if isinstance(hmm, HiddenMarkovModel) and hmm.duration is None:
        if value.dim() >= len(event):
            # time is the HMM's own first event dim, right of any dims .to_event added
            t = len(event) - len(hmm.event_shape)
            steps = value.shape[value.dim() - len(event) + t]
            return torch.Size(tuple(event[:t]) + (steps,) + tuple(event[t + 1 :]))
    return event


def is_factor(site):
    """Whether an observed site is a ``pyro.factor`` (a ``Unit`` distribution)."""
    return isinstance(site["fn"], dist.Unit)


def check_extra_sites(site, others, extra_sites, order=None):
    """Refuse observed sites and factors other than ``site`` that the estimate would drop,
    unless ``extra_sites="drop"``.

    :param dict site: the token site (a trace site).
    :param list others: the model trace's other observed sample sites and factors.
    :param str extra_sites: ``"error"`` (refuse them) or ``"drop"`` (score ``site`` alone).
    :param list order: the model trace's site names in program order (None: every other
        observed site is taken to come after ``site``). A site observed before the token
        site may feed it (``poutine.condition`` on a latent): its value stays in the model
        as given, so the message says the result is conditional on it, not marginal.
    :raises ValueError: naming the sites and what the result would be without them.

    Example::

        >>> check_extra_sites(site, others, "error", order=list(model_trace.nodes))
    """
    if extra_sites not in ("error", "drop"):
        raise ValueError(
            f"extra_sites={extra_sites!r}: use 'error' (refuse models with other observed "
            f"sites or pyro.factor sites) or 'drop' (score {site['name']!r} alone)."
        )
    if not others or extra_sites == "drop":
        return
    observed = [s["name"] for s in others if not is_factor(s)]
    factors = [s["name"] for s in others if is_factor(s)]
    parts = []
    position = {name: i for i, name in enumerate(order or [])}
    here = position.get(site["name"], -1)
    before = [o for o in observed if position.get(o, here + 1) < here]
    after = [o for o in observed if o not in before]
    name = site["name"]
    if before:
        given = ", ".join(before)
        parts.append(
            f"the log-density of observed site(s) {', '.join(map(repr, before))}, sampled "
            f"before {name!r} (their values stay where the model reads them, as given: the "
            f"result is log of the integral of p({name} | latents, {given}) over the "
            f"latents' prior, which is log p({name} | {given}) when {given} depend(s) on no latent)"
        )
    if after:
        parts.append(
            f"observed site(s) {', '.join(map(repr, after))} (integrated out: the "
            f"result is log p({name}), not log p({name} | {', '.join(after)}))"
        )
    if factors:
        parts.append(
            f"pyro.factor site(s) {', '.join(map(repr, factors))} (left out: the result "
            f"is that of the model without them)"
        )
    # one observed site per time step (Pyro's HMM tutorial) means the tokens are spread
    # over sites; pyro_mpt reads tokens from one site, so point to the one-site form
    markov = any("_markov_scope" in s["infer"] for s in others + [site])
    hint = (
        " The observed sites are steps of a pyro.markov chain: write the sequence as one "
        "dist.DiscreteHMM site whose event dim is time (conditionals='hmm'), so that its "
        "steps are the tokens."
        if markov
        else ""
    )
    raise ValueError(
        f"Masked pre-training and the evidence score observed site {site['name']!r} "
        f"alone and would drop {' and '.join(parts)}.{hint} Pass extra_sites=\"drop\" to "
        f"MaskedPretrainingLoss / Evidence to accept exactly that, or remove those sites "
        f"from the model (e.g. poutine.block(model, hide=[...]))."
    )


def _levels(fn):
    """``fn`` and the distributions it wraps (``base_dist`` chain)."""
    while fn is not None:
        yield fn
        fn = getattr(fn, "base_dist", None)


def observation_dtype(site, raw):
    """The floating dtype the observation computes in (its data and stored parameters
    promoted), or None when none of them is floating: integer counts of a float64 model
    compute in float64, as Pyro's own ``log_prob`` does, not in torch's default dtype.

    Example::

        >>> observation_dtype(site, torch.tensor([[3, 0, 2]]))  # Poisson(rate float64)
        torch.float64
    """
    tensors = [raw] + [
        v
        for level in _levels(site["fn"])
        for k in getattr(level, "arg_constraints", {})
        for v in [level.__dict__.get(k)]  # stored parameters only: no lazy property is computed
        if isinstance(v, torch.Tensor)
    ]
    floats = [t.dtype for t in tensors if torch.is_floating_point(t)]
    if not floats:
        return None
    dtype = floats[0]
    for d in floats[1:]:
        dtype = torch.promote_types(dtype, d)
    return dtype


def check_dtype(site, raw):
    """Refuse an observation that computes in float16 or bfloat16.

    :param dict site: the observed sample site.
    :param torch.Tensor raw: its value, the data.
    :raises ValueError: naming the site and the dtype to use instead.

    Example::

        >>> check_dtype(site, x.half())   # ValueError: float16
    """
    dtype = observation_dtype(site, raw)
    if dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"Observed site {site['name']!r} computes in {name} (its data and the "
            f"parameters of its {type(elementwise(site['fn'])).__name__} distribution); "
            f"pyro_mpt needs float32 or float64: torch has no {name} Cholesky on the CPU, "
            f"and {name} keeps too few digits for log-densities summed over tokens. Convert "
            f"the data and the model's parameters, e.g. x.double() and module.double()."
        )


def check_latent_dtypes(latents, obs_name):
    """Refuse latent sites drawn in float16 or bfloat16 (the observation's check sees only its
    own dtype, which float32 data promote: a float16 latent's model then computed its location
    in float16, and the quadrature engine failed in torch's slogdet).

    :param list latents: the latent sample sites.
    :param str obs_name: the observed site, for the message.
    :raises ValueError: naming the site and the dtype to use instead.

    Example::

        >>> check_latent_dtypes([site_z], "x")   # ValueError where z is float16
    """
    for site in latents:
        v = site["value"]
        if torch.is_tensor(v) and v.dtype in (torch.float16, torch.bfloat16):
            name = str(v.dtype).replace("torch.", "")
            raise ValueError(
                f"Latent site {site['name']!r} (of observed site {obs_name!r}) is drawn in {name}; "
                f"pyro_mpt needs float32 or float64: torch has no {name} Cholesky or log-determinant "
                f"on the CPU, and {name} keeps too few digits for the model's location. Convert the "
                f"prior's and the model's parameters, e.g. module.double() or .float()."
            )


#: (distribution class, data dtype, parameters' dtype) whose log_prob took integer data once
_SCORES_INTEGER_DATA = set()


def check_integer_data(site, raw):
    """Refuse integer or bool data that the observation's ``log_prob`` cannot score.

    torch's Bernoulli (and others) raise a dtype error on int64 or bool values;
    Trace_ELBO fails the same way, but inside an engine the error names no
    site and follows a misleading fallback warning. Poisson, Categorical and
    the like score integers and pass. One ``log_prob`` at zeros per
    distribution class and dtypes decides; values outside the support are left
    to :func:`validate_values`, which names them.

    :param dict site: the observed sample site.
    :param torch.Tensor raw: its value, the data.
    :raises ValueError: naming the site, the data's dtype and the ``x.to(<dtype>)`` to pass.

    Example::

        >>> check_integer_data(site, torch.tensor([[0, 1, 1]]))   # a Bernoulli site: ValueError
    """
    if torch.is_floating_point(raw) or torch.is_complex(raw):
        return
    fn = site["fn"]
    dtype = observation_dtype(site, raw) or torch.get_default_dtype()
    key = (type(elementwise(fn)), raw.dtype, dtype)
    if key in _SCORES_INTEGER_DATA:
        return
    try:
        # zeros, not the data: missing tokens may hold any placeholder (-1 for a Categorical),
        # and 0 is in the support of the integer distributions, so only the dtype can fail
        fn.log_prob(torch.zeros_like(raw))
    except RuntimeError as e:
        name = str(raw.dtype).replace("torch.", "")
        raise ValueError(
            f"Observed site {site['name']!r} holds {name} data, which its "
            f"{type(elementwise(fn)).__name__} distribution's log_prob cannot score (torch: {e}). "
            f"Pass the data as floating point in the model's dtype, e.g. x.to({dtype})."
        ) from e
    except ValueError:
        return  # outside the support: validate_values names the value
    _SCORES_INTEGER_DATA.add(key)


def check_shape(site, raw):
    """Refuse observed data whose shape does not fit the site's distribution."""
    fn = site["fn"]
    event, batch = tuple(data_event_shape(fn, raw)), tuple(fn.batch_shape)
    E = len(event)
    shape = tuple(raw.shape)
    fits = len(shape) >= E and shape[len(shape) - E:] == event
    if fits:
        try:
            fits = tuple(broadcast_shape(shape[: len(shape) - E], batch)) == tuple(batch)
        except ValueError:
            fits = False
    if not fits:
        raise ValueError(
            f"Observed site {site['name']!r} got data of shape {shape}, but its "
            f"{type(elementwise(fn)).__name__} distribution has batch shape {batch} and "
            f"event shape {event}: the data's last {E} dim(s) must equal {event} and the others must "
            f"broadcast to {batch}. Pass data with the model's number of tokens per "
            f"datapoint, or build the model for this data (e.g. sizes read from x.shape)."
        )


def _support(site):
    """The elementwise support of the site's distribution, or None when it declares none.

    A hidden Markov model declares its observations' support as ``independent(..., 1)`` over
    its steps: checked as such, one step's bad value failed the whole sequence, so that its
    missing steps' placeholders counted against its observed ones; the steps are checked
    one by one instead (each step's own event dims stay reduced)."""
    try:
        support = elementwise(site["fn"]).support
    except NotImplementedError:  # a user distribution that declares no support
        return None
    if isinstance(elementwise(site["fn"]), HiddenMarkovModel):
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        if _per_token_bounds(support):
            # bounds per hidden state (a Binomial's total_count a state): a step's value is in the
            # support of some state, which a check against the bounds as they are cannot tell
            return None
    return support


def support_ok(layout, site, support, value=None):
    """Bool ``(n, D)``: True where a token's observed value is in the support of the
    site's distribution; None when the support cannot be checked.

    :param ~pyro_mpt.token_layout.TokenLayout layout: the site's token layout.
    :param dict site: the observed trace site.
    :param support: the site's elementwise support (``_support``), or None.
    :param value: the values to check, at the site's shape (default: the site's own).
    """
    if support is None or constraints.is_dependent(support):
        return None
    ok = support.check((site["value"] if value is None else value).expand(layout.site_shape))
    ok = ok.reshape(ok.shape + (1,) * (len(layout.site_shape) - ok.dim())).expand(layout.site_shape)
    return layout.to_tokens(ok).reshape(layout.num_data, -1)


def tokens_in_support(layout, site, value=None):
    """:func:`support_ok` with the site's own elementwise support: bool ``(n, D)``, or None
    when the support cannot be checked token by token.

    Example::

        >>> tokens_in_support(tokens.layout, tokens.site)  # (n, D)
    """
    return support_ok(layout, site, _support(site), value)


#: said where the support's bounds differ between tokens or datapoints: they may come from a
#: latent (Uniform(0, z)), which the trace draws once, so valid data can fall outside them
_LATENT_SUPPORT_HINT = (
    " If a latent sets the bounds (Uniform(0, z)), they are at the trace's draw: "
    "pyro.validation_enabled(False) skips this check."
)


def _per_token_bounds(support):
    """A support's bounds per token or datapoint (tensors of more than one element, which
    may have been computed from a latent), by attribute name."""
    return {k: v for k, v in vars(support).items() if torch.is_tensor(v) and v.numel() > 1}


def _support_text(support, layout, i, j):
    """``(support, where)`` for the message: a support with bounds per token (a Binomial's
    total_count) would print its whole bound tensors, so it is named with its bounds at the
    offending token instead."""
    cls = type(support).__name__.lstrip("_")
    bounds = _per_token_bounds(support)
    if not bounds:
        return str(support), ""
    parts = []
    for k, v in vars(support).items():
        if k in bounds:
            try:
                v = layout.to_tokens(v.detach())[i, j]
            except (RuntimeError, ValueError, IndexError):
                return f"{cls} (bounds per token)", ""
        if torch.is_tensor(v) or isinstance(v, (int, float)):
            parts.append(f"{k.strip('_')}={float(v):g}")
    return f"{cls} (bounds per token)", f", where it is {cls}({', '.join(parts)})"


def validate_values(layout, site, flat, observed):
    """Refuse non-finite tokens and tokens outside the support of the site's distribution
    (observed ones only: missing tokens may hold any placeholder).

    :param ~pyro_mpt.token_layout.TokenLayout layout: the site's token layout.
    :param dict site: the observed trace site.
    :param torch.Tensor flat: the tokens ``(n, D)``.
    :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens, or None.
    :raises ValueError: naming the site, the count and a first offending token.
    """
    name = site["name"]
    # one reduction decides the common case: a sum is finite only if every term is
    # (NaN and infinities propagate); only a sum that is not (a bad token, or an
    # overflow of large finite ones) needs the elementwise look that finds the culprit
    if not bool(torch.isfinite(flat.sum())):
        finite = torch.isfinite(flat)
        if observed is not None:
            finite = finite | ~observed
        if not finite.all():
            bad = int((~finite).sum())
            # a mask that marks every token observed (obs_mask of all True) leaves observed None:
            # its site is masked all the same, and the advice to pass obs_mask= misled
            masked = observed is not None or site.get("mask") is not None
            raise ValueError(
                f"Observed site {name!r} contains {bad} NaN or infinite value(s)"
                f"{' at observed tokens' if masked else ''}; remove "
                f"or impute them before computing masked pre-training scores"
                f"{'' if masked else ', or mark them missing with obs_mask='}."
            )
    support, base = _support(site), elementwise(site["fn"])
    if support is constraints.real:
        # every finite (observed) token is real: the support check would repeat the one above
        return
    if getattr(base, "_validate_args", None) is False:
        # built with validate_args=False (Pyro's VAE tutorial: a Bernoulli of gray levels in
        # [0, 1]): its log_prob takes such values, and Trace_ELBO's does without a complaint
        return
    ok = support_ok(layout, site, support)
    if ok is None:
        return
    if observed is not None:
        ok = ok | ~observed
    if not ok.all():
        i, j = (~ok).nonzero()[0].tolist()
        text, where = _support_text(support, layout, i, j)
        raise ValueError(
            f"Observed site {name!r} has {int((~ok).sum())} value(s) outside the support "
            f"{text} of its {type(base).__name__} distribution, e.g. "
            f"{float(flat[i, j]):g} at datapoint {i}, token {j}{where}; Pyro's log_prob refuses "
            f"such data (Trace_ELBO raises on it). Pass data in the support (e.g. 0/1 for a "
            f"Bernoulli, non-negative integers for a Poisson), use an observation "
            f"distribution whose support holds the data (or built with validate_args=False, not "
            f"checked), or mark the values missing with "
            + (
                "the observation distribution's .mask() (observation_dist.mask(m[..., None]) "
                "for a mask m of the steps)."
                if isinstance(base, HiddenMarkovModel)
                else "obs_mask=."
            )
            + (_LATENT_SUPPORT_HINT if _per_token_bounds(support) else "")
        )
