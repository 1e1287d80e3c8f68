r"""Randomness of a model that Pyro's trace does not see.

The exact and quadrature engines integrate the latents that the model's trace
records. A draw the trace does not see (a sample site hidden by
``poutine.block(model, hide=[...])``, a ``torch.randn`` or ``numpy.random`` call
inside the model) is then neither integrated nor fixed: every evaluation sees
another value of it, and the result is a different number at every call (a
hidden Normal offset moved ``Evidence(method="quadrature")`` by 2 nats between
two calls, with no warning). Importance sampling averages over such draws
like over the latents it samples: ``Evidence(method="importance")`` takes them.

:func:`check_no_hidden_randomness` runs the model once more with every sample
site of its trace replayed and the random state elsewhere, and compares the
tokens' log-density: equal for a model whose only randomness is its trace's.

Example::

    >>> tokens = trace_tokens(model, None, (x,), {})
    >>> check_no_hidden_randomness(tokens, model, (x,), {}, "Evidence(method='exact')")
"""

import pyro
import torch
from pyro import poutine
from pyro.util import get_rng_state, set_rng_state

from .model_keys import PassedChecks

__all__ = ["check_no_hidden_randomness", "hidden_randomness_checked", "HIDDEN_SEED"]

#: the seed of the second run: any state other than the first run's draws the hidden values anew
HIDDEN_SEED = 20231208

#: the models that passed: once per model and process (a model is identified by weak
#: references: a bound method's owner by its id alone, a new instance at a collected one's
#: address skipped the check)
_PASSED = PassedChecks()


def hidden_randomness_checked(key):
    """Whether the model ``key`` passed :func:`check_no_hidden_randomness` (in this process),
    so that a caller need not trace it for the check."""
    return _PASSED.passed(key)


def check_no_hidden_randomness(tokens, model, args, kwargs, who, advice="", key=None):
    r"""Raise a ``ValueError`` when the tokens' log-density changes between the trace of
    ``tokens`` and a second run of ``model`` with every sample site of that trace replayed
    (from another random state of torch, numpy and ``random``; the caller's state is
    restored).

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable model: the model that made ``tokens.model_trace``.
    :param tuple args: its positional arguments. :param dict kwargs: its keyword arguments.
    :param str who: the caller, for the message. :param str advice: added to the message.
    :param callable key: the user's model: a model that passed once is not run again (None:
        always checked).
    :raises ValueError: naming the site and the two log-densities of a datapoint where they differ.
    """
    if key is not None and _PASSED.passed(key):
        return
    with torch.no_grad():
        _check(tokens, model, args, kwargs, who, advice)
    if key is not None:
        _PASSED.add(key)


def _check(tokens, model, args, kwargs, who, advice):
    site = tokens.site
    # missing tokens (obs_mask) filled: the raw value holds NaN there, which a validated
    # distribution refuses
    value = site["value"] if tokens.site_value is None else tokens.site_value
    first = site["fn"].log_prob(value).detach()
    state = get_rng_state()
    try:
        pyro.set_rng_seed(HIDDEN_SEED)
        trace = poutine.trace(poutine.replay(model, trace=tokens.model_trace)).get_trace(*args, **kwargs)
    finally:
        set_rng_state(state)
    again = trace.nodes[tokens.name]
    second = again["fn"].log_prob(value).detach()
    if first.shape == second.shape:
        tol = 1e3 * torch.finfo(first.dtype).eps if first.is_floating_point() else 0.0
        same = torch.isclose(first, second, rtol=tol, atol=tol, equal_nan=True)
        if bool(same.all()):
            return
        k = int((~same).reshape(-1).nonzero()[0, 0])
        a, b = float(first.reshape(-1)[k]), float(second.reshape(-1)[k])
        detail = f"its log-density at the same latent values was {a:.6g}, then {b:.6g}"
    else:
        detail = f"its log-density had shape {tuple(first.shape)}, then {tuple(second.shape)}"
    raise ValueError(
        f"{who}: the model draws randomness that Pyro's trace does not see: with every latent of "
        f"the trace fixed, two runs gave site {tokens.name!r} different distributions ({detail}). "
        f"A sample site hidden by poutine.block, or torch/numpy random numbers inside the model, "
        f"are neither integrated nor fixed, so the result would change at every call. Let the "
        f"trace see the draw (a pyro.sample site not hidden), or make the model deterministic "
        f"given its latents{advice}."
    )
