r"""Pyro's autoguides as importance proposals: their draws and their density at any latent value.

An autoguide draws each latent :math:`z` of the model as a bijection
:math:`z = t(u)` of an *auxiliary* unconstrained draw :math:`u` (sites marked
``infer={"is_auxiliary": True}``), and records :math:`z` as a ``Delta`` whose
``log_density`` is :math:`\log |\det \partial u / \partial z|`. Its density
over the model's latents is therefore

.. math::

    \log q(z) = \log q_u\bigl(t^{-1}(z)\bigr)
        + \log \Bigl|\det \frac{\partial t^{-1}(z)}{\partial z}\Bigr|,

which :class:`AutoguideProposal` evaluates at any :math:`z` (the guide's own
draws, or the prior's draws of a defensive mixture), per datapoint:

* ``AutoNormal`` -- one ``Normal(loc, scale)`` per latent site, inside the
  site's plates: :math:`q_u` factorizes over datapoints;
* ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
  ``AutoLowRankMultivariateNormal`` -- one Gaussian over the packed vector
  :math:`u` of all the latents of all datapoints, outside every plate. For a
  per-datapoint estimate of :math:`\log p(x_i)` the proposal of datapoint
  :math:`i` is the *marginal* of :math:`q_u` over the coordinates of
  :math:`z_i` (a draw of the joint is a draw of each marginal, so the weights
  :math:`p(x_i, z_i)/q_i(z_i)` stay unbiased), a Gaussian with the matching
  blocks of the mean and covariance (for the low-rank form: the rows of the
  factor and the diagonal). When every latent is global -- the whole dataset
  is one datapoint, ``token_plates=("data",)`` -- it is the joint density;
* ``AutoGuideList`` of these -- the sum over its parts.

``AutoDelta`` (and any part that is a point mass) has no density and is
refused, as are guides whose joint has no closed-form marginals (normalizing
flows). Other guides keep the generic path of
:class:`~pyro_mpt.conditionals.latent_runs.LatentRunner`.
"""

import contextlib

import torch
import pyro
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuide,
    AutoGuideList,
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from torch.distributions import biject_to
import pyro.distributions as dist

from ..token_site import missing_value_sites
from .latent_runs import PARTICLE_PLATE

__all__ = ["AUTOGUIDES", "is_autoguide", "per_datapoint_autoguide", "has_point_mass", "AutoguideProposal"]

#: the autoguides served (also as parts of an ``AutoGuideList``)
AUTOGUIDES = (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal)

_SERVED = "AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal"


def is_autoguide(guide):
    """Whether ``guide`` is one of Pyro's autoguides (or an ``AutoGuideList``), served here."""
    return isinstance(guide, AutoGuide)


def per_datapoint_autoguide(guide):
    """The class name of ``guide`` when it is an autoguide (or an ``AutoGuideList``) made only
    of :data:`AUTOGUIDES` and ``AutoDelta`` parts, whose parameters are per datapoint: such a
    guide never reads the data, so it is no encoder. None otherwise.

    Example::

        >>> per_datapoint_autoguide(AutoDiagonalNormal(model))  # 'AutoDiagonalNormal'
    """
    if not isinstance(guide, AutoGuide):
        return None
    parts = list(guide) if isinstance(guide, AutoGuideList) else [guide]
    if all(isinstance(p, AUTOGUIDES + (AutoDelta,)) or per_datapoint_autoguide(p) for p in parts):
        return type(guide).__name__
    return None


def has_point_mass(guide):
    """Whether ``guide`` is an ``AutoDelta`` or an ``AutoGuideList`` with one among its parts
    (a MAP guide: no proposal for importance sampling).

    Example::

        >>> has_point_mass(AutoDelta(model)), has_point_mass(AutoNormal(model))   # (True, False)
    """
    if isinstance(guide, AutoDelta):
        return True
    return isinstance(guide, AutoGuideList) and any(has_point_mass(p) for p in guide)


def _parts(guide, who):
    parts = list(guide) if isinstance(guide, AutoGuideList) else [guide]
    out = []
    for part in parts:
        if isinstance(part, AutoGuideList):
            out.extend(_parts(part, who))
            continue
        if isinstance(part, AutoDelta):
            raise ValueError(
                f"{who}: guide part {type(part).__name__} is a point mass (a MAP guide), so as an "
                f"importance proposal it has no density over the model's latents: its weights give "
                f"log p(x, z0) at one point, not the evidence. Use a guide with a density ({_SERVED})."
            )
        if isinstance(part, AutoLaplaceApproximation):
            raise ValueError(
                f"{who}: guide part AutoLaplaceApproximation is a point mass (a MAP guide) until its "
                f"Laplace approximation is taken, so as an importance proposal it has no density. "
                f"After training, pass guide.laplace_approximation(*args) (an AutoMultivariateNormal "
                f"at the MAP point with the inverse Hessian as its covariance)."
            )
        if not isinstance(part, AUTOGUIDES):
            raise ValueError(
                f"{who}: autoguide {type(part).__name__} is not served as an importance proposal "
                f"(its density over each datapoint's latents has no closed form here). Use one of "
                f"{_SERVED}, or an AutoGuideList of them."
            )
        out.append(part)
    return out


def _latent_nodes(part):
    return [(name, site) for name, site in part.prototype_trace.iter_stochastic_nodes()]


class AutoguideProposal:
    r"""One of Pyro's autoguides as an importance proposal over the model's latents.

    :param guide: an autoguide (see :data:`AUTOGUIDES`) or an ``AutoGuideList`` of them,
        already run once (its prototype trace exists once the tokens are traced).
    :param runner: the :class:`~pyro_mpt.conditionals.latent_runs.LatentRunner`
        of the model (its particle plate, replayed minibatch and reductions).
    :param str who: the caller, named in error messages.
    :raises ValueError: for a part that is a point mass or has no closed-form marginals.

    Example::

        >>> proposal = AutoguideProposal(AutoMultivariateNormal(model), runner, "Evidence")
        >>> values, trace = proposal.sample(100)
        >>> proposal.log_prob(trace, values, 100).shape     # (100, n)
    """

    def __init__(self, guide, runner, who="importance sampling"):
        self.guide = guide
        self.runner = runner
        self.who = who
        self.parts = _parts(guide, who)
        tokens = runner.tokens
        latent = set(tokens.latent_names)
        self._index = {}  # id(part) -> its per-datapoint coordinates
        # an autoguide of a model with obs_mask= holds Pyro's draw of the missing values
        # ('x_unobserved'), which no estimate integrates: left out of q by its marginal (it was
        # refused as "not a latent of the model", of an autoguide built from this model)
        self._skip = missing_value_sites(tokens.model_trace) - latent
        for part in self.parts:
            for name, _ in self._estimated_nodes(part):
                if name not in latent:
                    raise ValueError(
                        f"{who}: autoguide site {name!r} is not a latent of the model (latents: "
                        f"{', '.join(map(repr, tokens.latent_names))}); build the autoguide from "
                        f"this model."
                    )

    def _estimated_nodes(self, part):
        """The part's latent sites less the missing-value draws (``_skip``)."""
        return [(name, site) for name, site in _latent_nodes(part) if name not in self._skip]

    # ------------------------------------------------------------------ draws
    def sample(self, rows):
        r"""Draw ``rows`` values of every latent per datapoint from the guide.

        :returns: ``(values, trace)``: latent name -> value ``(rows, ...)`` in the
            particle plate's layout, and the guide's trace (for :meth:`log_prob`).
        """
        r = self.runner
        rank = r.rank

        def wrapped(*a, **k):
            with pyro.plate(PARTICLE_PLATE, rows, dim=-rank):
                return self.guide(*a, **k)

        run = poutine.replay(wrapped, trace=r.replay)
        with poutine.block(hide_fn=lambda m: m["type"] == "sample"):
            trace = poutine.trace(run).get_trace(*r.args, **r.kwargs)
        latent = set(r.tokens.latent_names)
        values = {}
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or name not in latent:
                continue
            v = site["value"]
            E = len(site["fn"].event_shape)
            v = v.reshape((1,) * (rank + E - v.dim()) + tuple(v.shape))
            values[name] = v.expand((rows,) + tuple(v.shape[1:]))
        return values, trace

    def log_weights(self, rows):
        r"""Importance log-weights :math:`\log p(x_i, z_s) - \log q(z_s)` per datapoint, ``(rows, n)``."""
        values, trace = self.sample(rows)
        log_q = self.log_prob(trace, values, rows)
        dec = self.runner.decode(values, rows)
        return dec.log_prior() + dec.obs_log_prob() - log_q

    # ------------------------------------------------------------------ density
    def log_prob(self, trace, values, rows, fixed_guide=False):
        r""":math:`\log q(z)` per datapoint at latent values ``values``, ``(rows, n)``.

        :param trace: a trace of the guide in a particle plate of ``rows`` (from
            :meth:`sample`); it supplies the per-site scales of ``AutoNormal``
            (subsampled like the minibatch).
        :param dict values: latent name -> value ``(rows, ...)`` in the particle
            plate's layout (e.g. the guide's own draws, or prior draws).
        :param bool fixed_guide: the guide's parameters as constants (the joint autoguides'
            posterior made without a graph; ``AutoNormal``'s comes from ``trace``, sampled
            without one for this): the gradient reaches ``values`` alone.
        """
        r = self.runner
        total = r.tokens.value.new_zeros(rows, r.tokens.num_data)
        for part in self.parts:
            if isinstance(part, AutoNormal):
                total = total + self._normal_part(part, trace, values, rows, fixed_guide)
            else:
                total = total + self._joint_part(part, values, rows, fixed_guide)
        return total

    def _site_transform(self, name, z):
        """``(u, log|det du/dz|)`` of latent ``name`` at constrained values ``z``."""
        site = self.runner.tokens.model_trace.nodes[name]
        t = biject_to(site["fn"].support)
        u = t.inv(z)
        jac = t.inv.log_abs_det_jacobian(z, u)
        jac = sum_rightmost(jac, jac.dim() - z.dim() + site["fn"].event_dim)
        return u, jac

    def _normal_part(self, part, trace, values, rows, fixed_guide=False):
        r = self.runner
        out = 0.0
        for name, _ in self._estimated_nodes(part):
            aux = trace.nodes[name + "_unconstrained"]
            u, jac = self._site_transform(name, values[name])
            fn = _constant(aux["fn"]) if fixed_guide else aux["fn"]
            lq = fn.log_prob(u.reshape(u.shape[:1] + aux["value"].shape[1:]))
            out = out + r.per_datapoint(lq, rows) + r.per_datapoint(jac, rows)
        return out

    def _joint_part(self, part, values, rows, fixed_guide=False):
        r = self.runner
        us, jac = [], 0.0
        for name, _ in self._estimated_nodes(part):
            u, j = self._site_transform(name, values[name])
            us.append(u.reshape(rows, -1))
            jac = jac + r.per_datapoint(j, rows)
        if not us:
            return 0.0  # a part that holds only missing-value draws: no latent of the estimate
        u = torch.cat(us, -1)  # the packed unconstrained vector, in Pyro's order, less the skipped sites
        with torch.no_grad() if fixed_guide else contextlib.nullcontext():
            posterior = part.get_posterior(*r.args, **r.kwargs)
        if fixed_guide:
            posterior = _constant(posterior)
        if r.tokens.num_data == 1 and not any(name in self._skip for name, _ in _latent_nodes(part)):
            return posterior.log_prob(u).reshape(rows, 1) + jac
        # positions in the posterior's vector (with the skipped sites) and in u (without them)
        full, packed = self._datapoint_index(part)  # (n, k) each
        return _block_marginal(posterior)(full).log_prob(u[:, packed]) + jac

    def _datapoint_index(self, part):
        """``(full, packed)``, each ``(n, k)``: the coordinates that belong to each datapoint, in
        the guide's packed vector and in it less the skipped sites' (missing-value draws)."""
        key = id(part)
        if key in self._index:
            return self._index[key]
        r = self.runner
        rank = r.rank
        data_dims = sorted(r.data_dims)
        blocks, packed, pos, kept = [], [], 0, 0
        for name, site in _latent_nodes(part):
            U = biject_to(site["fn"].support).inv(site["value"]).shape
            size = int(torch.Size(U).numel())
            if name in self._skip:  # its coordinates stay in the guide's vector, not in q's marginal
                pos += size
                continue
            e = site["fn"].event_dim + len(U) - site["value"].dim()
            nb = len(U) - e
            local = torch.arange(size, device=r.tokens.value.device).reshape(U)
            local = local.reshape((1,) * (rank - 1 - nb) + tuple(U))
            # the data dims first (left to right, as per_datapoint flattens them), the rest per datapoint
            axes = [rank - 1 + d for d in data_dims]
            local = local.movedim(axes, list(range(len(axes))))
            sizes = [r.tokens.batch_shape[len(r.tokens.batch_shape) + d] for d in data_dims]
            local = local.expand(tuple(sizes) + tuple(local.shape[len(axes):])).reshape(r.tokens.num_data, -1)
            blocks.append(local + pos)
            packed.append(local + kept)
            pos += size
            kept += size
        out = (torch.cat(blocks, -1), torch.cat(packed, -1))
        self._index[key] = out
        return out


def _constant(fn):
    """A Normal-family guide distribution with its parameters detached. Made under ``no_grad``
    is not enough: a ``Normal`` keeps the guide's own parameter as its ``loc`` where no op
    reshapes it (``broadcast_all`` returns it as it is), and AutoDiagonalNormal's loc got the
    full gradient through the log-density taken afterwards (it moved by Adam's step, 0.4 in
    10 steps). Other distributions are returned as they are."""
    if isinstance(fn, dist.Independent):
        return _constant(fn.base_dist).to_event(fn.reinterpreted_batch_ndims)
    if isinstance(fn, dist.Normal):
        return dist.Normal(fn.loc.detach(), fn.scale.detach())
    if isinstance(fn, dist.LowRankMultivariateNormal):
        return dist.LowRankMultivariateNormal(fn.loc.detach(), fn.cov_factor.detach(), fn.cov_diag.detach())
    if isinstance(fn, dist.MultivariateNormal):
        return dist.MultivariateNormal(fn.loc.detach(), scale_tril=fn.scale_tril.detach())
    return fn


def _block_marginal(posterior):
    """The marginals of the Gaussian posterior of a joint autoguide (diagonal, low-rank or
    full covariance) on the index blocks ``idx`` ``(n, k)``: batch shape ``(n,)``, event ``(k,)``."""

    def marginal(idx):
        if isinstance(posterior, dist.Independent):
            base = posterior.base_dist
            return dist.Normal(base.loc[idx], base.scale[idx]).to_event(1)
        if isinstance(posterior, dist.LowRankMultivariateNormal):
            return dist.LowRankMultivariateNormal(posterior.loc[idx], posterior.cov_factor[idx], posterior.cov_diag[idx])
        L = posterior.scale_tril[idx]  # (n, k, K): the rows of the Cholesky factor for each block
        return dist.MultivariateNormal(posterior.loc[idx], covariance_matrix=L @ L.transpose(-1, -2))

    return marginal
