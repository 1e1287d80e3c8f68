r"""Pyro's argument checks of a model trace's distributions, at the arguments' own shapes.

torch checks a distribution's arguments when it is built (while Pyro's validation is
on), at the shapes the distribution holds them in. ``MultivariateNormal(z, scale_tril=L)``
with a mean per datapoint holds ``L`` expanded to ``(N, D, D)``, and its
``lower_cholesky`` check reads all :math:`N D^2` entries: a latent-mean model's trace at
``N = 1000``, ``D = 200`` took 237 ms validated against 1.5 ms without, half of a
training step. A constraint's check is elementwise over the batch dims, so on an argument
expanded along a batch dim (stride 0) one slice along it decides the same:
:func:`args_valid` checks the arguments of the classes in :data:`CHECKED` that way,
reading each distinct entry once.

:class:`~pyro_mpt.MaskedPretrainingLoss` traces a model without Pyro's validation (from
its second step on), and :class:`~pyro_mpt.evidence.Evidence` (``method="exact"``, from
its second call on), when every distribution of the trace is one of these, check them
here, and trace again with validation when a check fails, so that the error is Pyro's
own, as before.

What the trace does not record is not checked: a distribution the model builds without
sampling from it (``dist.Normal(0, s).icdf(u)`` as another site's argument) or samples
inside ``poutine.block`` raises Pyro's error for a bad argument at the first step only;
from the second step on the loss computes with it (with ``s < 0``, a finite number)
unless the model's engine builds every distribution again under validation
(:meth:`~pyro_mpt.conditionals.base.ConditionalEngine.validates_model`).
"""

import pyro.distributions as dist
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution
from pyro.poutine.util import site_is_subsample
from pyro.util import get_rng_state, set_rng_state
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

__all__ = ["CHECKED", "WRAPPERS", "Revalidate", "args_valid", "checkable", "quiet_or_validated"]

#: the distribution classes whose check when built is exactly torch's loop over their
#: ``arg_constraints`` in ``Distribution.__init__`` (no check of their own in ``__init__``:
#: ``test_arg_checks.py`` reads their sources)
CHECKED = (
    dist.Normal, dist.MultivariateNormal, dist.LowRankMultivariateNormal, dist.Categorical, dist.OneHotCategorical,
    dist.Bernoulli, dist.Binomial, dist.Poisson, dist.Gamma, dist.Exponential, dist.Dirichlet, dist.StudentT,
    dist.Laplace, dist.Cauchy,
)

#: wrappers with no argument of their own to check: their base distribution is checked
WRAPPERS = (dist.Independent, MaskedDistribution, ExpandedDistribution)


class Revalidate(Exception):
    """A trace made without Pyro's validation does not serve: make it again with validation
    (raised by the callers that trace without it, caught by themselves)."""


def quiet_or_validated(quiet, run, validated):
    """``run()`` (the model traced without Pyro's validation) where ``quiet`` and Pyro's
    validation is on; should it raise anything (:class:`Revalidate` or an error of its
    own), ``validated()`` from the random state ``run`` started from (torch, numpy and
    ``random``; not CUDA's), so that a bad argument raises Pyro's own error as a validated
    trace does; ``validated()`` also where not ``quiet`` or with validation off.

    :param bool quiet: whether the caller's memory lets this call trace quietly.
    :param callable run: the quiet call.
    :param callable validated: the validated call.

    Example::

        >>> quiet_or_validated(False, lambda: "quiet", lambda: "validated")
        'validated'
    """
    if quiet and dist.is_validation_enabled():
        rng = get_rng_state()
        try:
            return run()
        except Exception:
            set_rng_state(rng)
    return validated()


def _distributions(trace):
    """The distributions of the trace's sample sites (through the wrappers), or None when
    one of them is not in :data:`CHECKED`."""
    out = []
    for site in trace.nodes.values():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        fn = site["fn"]
        while type(fn) in WRAPPERS:
            fn = fn.base_dist
        if type(fn) not in CHECKED:
            return None
        out.append(fn)
    return out


def checkable(trace):
    """Whether every distribution of ``trace``'s sample sites is one :func:`args_valid` checks.

    :param pyro.poutine.Trace trace: a model trace.
    :returns: bool.

    Example::

        >>> checkable(poutine.trace(model).get_trace(x))
        True
    """
    return _distributions(trace) is not None


def _distinct(value, event_dim):
    """``value`` narrowed to one slice along each batch dim it is expanded over (stride 0).
    Not along an event dim: a check there is not elementwise (a matrix whose rows are one
    expanded row is not lower-triangular with a positive diagonal where that row alone is)."""
    for d in range(value.dim() - event_dim):
        if value.stride(d) == 0 and value.shape[d] > 1:
            value = value.narrow(d, 0, 1)
    return value


def args_valid(trace):
    """Whether the distributions of ``trace`` pass the checks torch makes when it builds
    them under Pyro's validation, each argument checked at its distinct entries; False
    also where one of them is not in :data:`CHECKED` (:func:`checkable`).

    :param pyro.poutine.Trace trace: a model trace (made with or without validation).
    :returns: bool.

    Example::

        >>> with pyro.validation_enabled(False):
        ...     trace = poutine.trace(model).get_trace(x)
        >>> args_valid(trace)   # what building them with validation would have said
        True
    """
    fns = _distributions(trace)
    if fns is None:
        return False
    for fn in fns:
        for param, constraint in fn.arg_constraints.items():
            if constraints.is_dependent(constraint):
                continue
            if param not in fn.__dict__ and isinstance(getattr(type(fn), param), lazy_property):
                continue  # torch skips the lazily computed arguments too
            if not bool(constraint.check(_distinct(getattr(fn, param), constraint.event_dim)).all()):
                return False
    return True
