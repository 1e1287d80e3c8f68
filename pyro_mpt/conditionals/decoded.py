r"""What the model and guide runs of :mod:`~pyro_mpt.conditionals.latent_runs` return.

:class:`Encoded` holds the latent values a guide drew (and their
:math:`\log q`), laid out for decoding; :class:`Decoded` is the model run at
given latent values, read per datapoint (:math:`\log p(z)`,
:math:`\log p(x \mid z)`) or token by token (log-densities, means, draws).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)

from .base import EngineNotApplicable
from .distributions import check_factorized, token_log_prob

__all__ = ["Encoded", "Decoded", "StackedDecoded", "pad_batch", "site_log_prob"]


def pad_batch(t, rank):
    """Left-pad a batch tensor with size-1 dims to ``rank`` dims.

    Example::

        >>> pad_batch(torch.zeros(4), 3).shape  # torch.Size([1, 1, 4])
    """
    if t.dim() > rank:
        raise ValueError(
            f"A log-density of shape {tuple(t.shape)} has more than the {rank} batch dims "
            f"expected (max_plate_nesting + 1 for the particle plate); set max_plate_nesting "
            f"to the number of plate dims the model uses."
        )
    return t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))


def site_log_prob(site):
    """A trace site's log-density at its value, 0 where the site's mask is False.

    Example::

        >>> site_log_prob(trace.nodes["z"])  # the site's batch shape
    """
    lp = site["fn"].log_prob(site["value"])
    mask = site.get("mask")
    if torch.is_tensor(mask):
        lp = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return lp


@dataclass
class Encoded:
    """Latent values drawn by the guide, laid out for :meth:`~pyro_mpt.conditionals.latent_runs.LatentRunner.decode`.

    :param dict values: latent name -> value with leading dim ``P * B``
        (particles outer, imputed versions inner) in the particle plate's layout.
    :param torch.Tensor log_q: :math:`\\log q(z \\mid \\tilde x)` per datapoint,
        ``(P, B, n)``; None for means.
    """

    values: dict
    log_q: Optional[torch.Tensor]
    num_particles: int
    num_versions: int


class Decoded:
    """The model run at given latent values: a trace in a particle plate of size ``R``."""

    def __init__(self, runner, trace, rows, names):
        self.runner = runner
        self.trace = trace
        self.rows = rows
        self.names = names  # latents whose values were given (their log p is counted)

    @property
    def obs_fn(self):
        return self.trace.nodes[self.runner.tokens.name]["fn"]

    def latent_value(self, name):
        """The value of latent ``name`` in the run, with the particle plate's dim leading."""
        return self.trace.nodes[name]["value"]

    def outside_support(self):
        """Where some given latent lies outside its prior's support (prior density 0: a guide
        ``Normal`` for a ``Gamma`` latent), ``(R, n)`` bool, or None where none does.

        Those draws get importance weight 0 (:meth:`log_prior` is :math:`-\\infty` there) and
        the observation's log-density 0 in place of what the model computes at such a value
        (a ``Poisson`` rate below 0: NaN with Pyro's validation off, which made every
        estimate and diagnostic NaN, without a warning).
        """
        if not hasattr(self, "_outside"):
            r, outside = self.runner, None
            for name in self.names:
                site = self.trace.nodes[name]
                with torch.no_grad():
                    bad = ~site["fn"].support.check(site["value"])
                    mask = site.get("mask")
                    if torch.is_tensor(mask):
                        bad = bad & mask
                    if not bool(bad.any()):
                        continue
                    bad = r.per_datapoint(bad.to(r.tokens.value.dtype), self.rows) > 0
                outside = bad if outside is None else outside | bad
            self._outside = outside
        return self._outside

    def log_prior(self):
        """:math:`\\sum_l \\log p(z_l)` over the given latents, per datapoint, ``(R, n)``;
        :math:`-\\infty` at draws outside a prior's support (:meth:`outside_support`)."""
        r = self.runner
        total = None
        for name in self.names:
            lp = r.per_datapoint(site_log_prob(self.trace.nodes[name]), self.rows)
            total = lp if total is None else total + lp
        if total is None:
            total = r.tokens.value.new_zeros(self.rows, r.tokens.num_data)
        outside = self.outside_support()
        if outside is not None:
            total = torch.where(outside, torch.full((), -math.inf, dtype=total.dtype, device=total.device), total)
        return total

    def drawn_score_terms(self):
        r""":math:`\log p(z) - \log p(z)|_{\text{detached}}` summed over the latents the run
        drew itself without reparameterization (discrete ones), per datapoint, ``(R, n)``: of
        value 0, its gradient is the score :math:`\nabla\log p(z)` that their draws carry to
        the prior's parameters (a sampled mixture's weights got no gradient without it); None
        where there is no such latent or none of its log-densities has a gradient."""
        r = self.runner
        total = None
        for name in r.tokens.latent_names:
            site = self.trace.nodes.get(name)
            if site is None or name in self.names or getattr(site["fn"], "has_rsample", False):
                continue
            lp = r.per_datapoint(site_log_prob(site), self.rows)
            if lp.requires_grad:
                term = lp - lp.detach()
                total = term if total is None else total + term
        return total

    def obs_log_prob(self):
        """:math:`\\log p(x \\mid z)` at the data, per datapoint, ``(R, n)``.

        With missing tokens, the sum of :meth:`token_log_prob` over the observed ones.
        """
        r = self.runner
        if r.tokens.observed is not None:
            return self.token_log_prob(r.tokens.value).sum(-1)
        site = self.trace.nodes[r.tokens.name]
        self.check_broadcast()
        lp = site["fn"].log_prob(site["value"])
        self.check_broadcast(lp.shape)
        return self._zero_outside(r.per_datapoint(lp, self.rows))

    def _zero_outside(self, t):
        # 0 in place of the model's value at a latent it cannot take (weight 0 there anyway)
        outside = self.outside_support()
        if outside is None:
            return t
        outside = outside.reshape(outside.shape + (1,) * (t.dim() - outside.dim()))
        return torch.where(outside, torch.zeros((), dtype=t.dtype, device=t.device), t)

    def check_broadcast(self, batch_shape=None):
        """Refuse an observation that did not broadcast over the plate of latent values.

        Checked on the distribution before its log-density too: a model that
        reshapes by its own batch size (``loc.reshape(n, h, w)``) puts the
        latent values into the event dims, and the log-density would broadcast
        them against the data (a raw shape error, or gigabytes).
        """
        r = self.runner
        fn = self.obs_fn
        shape = fn.batch_shape if batch_shape is None else batch_shape
        bs = r.tokens.site_batch_shape
        expected = (self.rows,) + (1,) * (r.rank - 1 - len(bs)) + tuple(bs)
        event = r.tokens.site["fn"].event_shape
        padded = (1,) * (r.rank - len(shape)) + tuple(shape)
        if fn.event_shape != event or len(padded) != len(expected) or any(
            a != b and a != 1 for a, b in zip(padded, expected)
        ):
            raise EngineNotApplicable(
                f"Observed site {r.tokens.name!r} has batch shape {tuple(shape)} and event "
                f"shape {tuple(fn.event_shape)} when the model runs with {self.rows} latent "
                f"values per datapoint in a pyro.plate at dim {-r.rank}; expected {expected} "
                f"and {tuple(event)}. The model does not broadcast over that dim: keep the "
                f"latents' batch dims when computing the observation (e.g. unsqueeze the dim "
                f"of a plate you reduce over, or reshape with loc.shape[:-1] instead of the "
                f"batch size), or set max_plate_nesting."
            )

    def _token_tensor(self, t):
        r = self.runner
        fn = self.obs_fn
        full = broadcast_shape(t.shape, fn.batch_shape + fn.event_shape)
        t = r.tokens.to_tokens(t.expand(full))
        n, D = r.tokens.num_data, r.tokens.num_tokens
        if t.numel() != self.rows * n * D:
            raise EngineNotApplicable(
                f"Observed site {r.tokens.name!r} has shape {tuple(full)} when the model "
                f"runs in a plate of {self.rows} particles; expected {self.rows} x {n} "
                f"datapoints x {D} tokens. {r.who} needs every latent local to a datapoint."
            )
        return t.reshape(self.rows, n, D)

    def _base(self):
        return check_factorized(self.obs_fn, self.runner.tokens.name, self.runner.who)

    def token_log_prob(self, x):
        """:math:`\\log p(x_d \\mid z)` per token at tokens ``x`` ``(n, D)``: ``(R, n, D)``.

        Missing tokens (``tokens.observed``) get 0.
        """
        r = self.runner
        self.check_broadcast()
        base = self._base()
        xv = r.tokens.to_site(x)
        orig = self.trace.nodes[r.tokens.name]["value"]
        if torch.is_tensor(orig) and not torch.is_floating_point(orig):
            xv = xv.to(orig.dtype)  # integer tokens (Categorical, Poisson counts)
        out = self._token_tensor(token_log_prob(base, xv))
        if r.tokens.observed is not None:
            out = torch.where(r.tokens.observed, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return self._zero_outside(out)

    def mean(self):
        """The observation's mean per token (mode where the mean is not finite), ``(R, n, D)``."""
        base = self._base()
        try:
            m = base.mean
        except NotImplementedError:
            m = None
        if m is None or not bool(torch.isfinite(m).all()):
            m = base.mode
        return self._token_tensor(m)

    def sample(self):
        """One draw of the tokens from :math:`p(x \\mid z)`, ``(R, n, D)``."""
        return self._token_tensor(self._base().sample())


class StackedDecoded:
    """Several :class:`Decoded` runs of one point each, read as one run of ``R`` points.

    The per-point fallback of :meth:`~pyro_mpt.conditionals.latent_runs.LatentRunner.decode` and
    :meth:`~pyro_mpt.conditionals.latent_runs.LatentRunner.sample_prior` for models that do not run vectorized:
    every method concatenates the points' results along the leading dim.
    """

    def __init__(self, parts):
        self.parts = parts
        self.rows = len(parts)
        self.names = parts[0].names if parts else []

    def _cat(self, method, *args):
        return torch.cat([getattr(p, method)(*args) for p in self.parts], 0)

    def log_prior(self):
        return self._cat("log_prior")

    def latent_value(self, name):
        # each point ran without the particle plate: pad its value to the plate's rank
        # (plus the site's event dims) so the stack reads like one vectorized run's value
        values = []
        for part in self.parts:
            site = part.trace.nodes[name]
            v = site["value"]
            keep = part.runner.rank + len(site["fn"].event_shape)
            values.append(v.reshape((1,) * (keep - v.dim()) + tuple(v.shape)))
        return torch.cat(values, 0)

    def obs_log_prob(self):
        return self._cat("obs_log_prob")

    def drawn_score_terms(self):
        terms = [p.drawn_score_terms() for p in self.parts]
        return None if any(t is None for t in terms) else torch.cat(terms, 0)

    def token_log_prob(self, x):
        return self._cat("token_log_prob", x)

    def mean(self):
        return self._cat("mean")

    def sample(self):
        return self._cat("sample")
