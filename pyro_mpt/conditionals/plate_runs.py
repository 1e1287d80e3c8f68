r"""Running a Pyro model (or guide) at many latent values at once, in an extra vectorized plate.

Several engines evaluate the model at a batch of ``P`` latent values per
datapoint: the Gaussian marginal at noise points
(:mod:`~pyro_mpt.conditionals.gaussian_marginal`), quadrature at grid nodes
(:mod:`~pyro_mpt.conditionals.quadrature`), the hierarchical engine at noise
points (:mod:`~pyro_mpt.conditionals.hierarchical`), the sampling engines at
particles (:mod:`~pyro_mpt.conditionals.latent_runs`). Each runs the callable once inside
``pyro.plate(name, P, dim=-(max_plate_nesting + 1))`` (:func:`run_in_plate`),
with the subsample sites of the traced minibatch replayed so that minibatches
match, with a messenger that sets the latents, and with the runs' sample sites
hidden from outer handlers (SVI's parameter capture still sees the params).

**One fallback policy** (:func:`run_with_fallback`). A model may not broadcast
the way the fastest run needs (shared parameters kept at size one, a copy of
the data stacked per imputation, ...). The runs are then tried as *modes* in
order of preference; the first that works is used and remembered in a
:class:`RunMemory` kept by the engine, so that the next call starts with it and
does not pay for the failing modes again. An error that says the model is
outside the engine's reach (``EngineNotApplicable``) is not a reason to try
another mode: it passes through. When every mode fails, the caller's error is
raised from the last failure.

**Setting the latents.** One messenger per way of choosing the latents'
values: :class:`CoordinateLatents` at given coordinates (engines that set all
latents from one coordinate vector :math:`u \in \mathbb R^K` per point give
each latent site a :class:`LatentSlice` of it, :func:`latent_layout`), and
:class:`MeanLatents` at their means. Given values themselves are replayed.
"""

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to

from ..token_site import vectorized_frames
from ..model_keys import callable_key
from .base import EngineNotApplicable
from .distributions import affine_normal, compact, unwrap

__all__ = ["LatentSlice", "latent_layout", "PROBE_REACH", "PROBE_SEED", "affinity_probes", "fixed_probes", "probe_coordinates", "alternating_signs", "reaches_points", "CoordinateLatents", "MeanLatents", "most_probable", "run_in_plate", "RunMemory", "agrees_with_point_run", "run_with_fallback"]

_LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class LatentSlice:
    """The coordinates ``u[..., offset : offset + numel]`` of one latent site.

    :param str name: the site.
    :param int offset: first coordinate.
    :param int numel: number of coordinates (the event's size, or the
        unconstrained size of a ``"transform"`` latent with event dims).
    :param torch.Size event_shape: the site's event shape.
    :param str kind: how the engine parameterizes it (e.g. ``"normal"``,
        ``"mvn"``, ``"transform"``).
    :param tuple plates: ``((dim, size), ...)``: the site's plates that are
        neither data nor token plates of the observed site (a datapoint's
        latent dims declared as ``pyro.plate("k", K)``), taken as event dims:
        the coordinates are ``(*sizes, *event_shape)`` flattened, so
        ``numel`` counts them.
    :param torch.dtype dtype: the dtype of the site's traced value (the model's
        own sample); the site's values at the coordinates are given in it, or in
        the coordinates' dtype when None.
    :param torch.Size coord_shape: the coordinates' event shape where it is not
        ``event_shape``: a ``"transform"`` latent whose support has event dims
        (a ``Dirichlet``'s simplex of K entries has K - 1 unconstrained
        coordinates, ``biject_to(support).inverse_shape``); None otherwise.
    """

    name: str
    offset: int
    numel: int
    event_shape: torch.Size
    kind: str
    plates: tuple = ()
    dtype: torch.dtype = None
    coord_shape: torch.Size = None


def latent_layout(tokens, kind_of):
    """Give each latent site of ``tokens`` a :class:`LatentSlice` of the stacked coordinates.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable kind_of: ``kind_of(site) -> str``; checks the site (raising
        the engine's error when it cannot serve it) and names its kind.
    :returns: ``(layout, K)``: ``{name: LatentSlice}`` in site order and the
        total number of coordinates.

    Example::

        >>> layout, K = latent_layout(tokens, lambda site: "normal")
    """
    layout, offset = {}, 0
    data = {f.name for f in tokens.data_frames} | set(tokens.token_plates)
    for site in tokens.latent_sites():
        kind = kind_of(site)
        event_shape = site["fn"].event_shape
        # kind_of accepted any plate the observed site lacks as event dims of the latent
        plates = tuple(sorted((f.dim, f.size) for f in vectorized_frames(site, 2) if f.name not in data))
        coord_shape = None
        if kind == "transform" and len(event_shape):
            # a support with event dims (a simplex) has its own unconstrained shape
            coord_shape = torch.Size(biject_to(site["fn"].support).inverse_shape(event_shape))
        numel = math.prod(size for _, size in plates) * (event_shape if coord_shape is None else coord_shape).numel()
        dtype = site["value"].dtype if site["value"].is_floating_point() else None
        layout[site["name"]] = LatentSlice(site["name"], offset, numel, event_shape, kind, plates, dtype, coord_shape)
        offset += numel
    return layout, offset


#: how far the affinity probes reach, in prior standard deviations of each noise coordinate
PROBE_REACH = 3.0


def affinity_probes(K, generator, dtype, device):
    r"""The points at which a model's location must equal its affine prediction, ``(3, K)``.

    The engines that read a linear-Gaussian model off its runs at :math:`0`
    and the unit vectors :math:`e_k` of the stacked standard-normal noises
    check the location at three more points: a normal draw
    :math:`\varepsilon_r`, and :math:`\pm r s` with :math:`s` a random sign
    vector and :math:`r` = :data:`PROBE_REACH` (each coordinate's size drawn
    in :math:`[r - 1/2, r + 1/2]`, :func:`alternating_signs`). Every coordinate
    then sits at both :math:`+r` and :math:`-r`: a piecewise-linear location
    (``relu(z + 1)``, ``clamp``, ``abs``) with a kink within :math:`r - 1/2` prior
    standard deviations of a coordinate's mean is caught, where points near 0
    may all fall on one linear piece; and a quadratic or cross term is nonzero
    at :math:`\pm r s`.

    :param int K: number of noise coordinates.
    :param torch.Generator generator: a CPU generator with a fixed seed (the
        check must not consume the user's random stream).
    :returns: ``torch.stack([eps_r, r s, -r s])``.

    Example::

        >>> affinity_probes(2, torch.Generator().manual_seed(0), torch.float64, "cpu").shape  # (3, 2)
    """
    eps_r = torch.randn(1, K, generator=generator, dtype=dtype, device="cpu")  # the generator's device
    return torch.cat([eps_r, alternating_signs(2, K, generator, dtype, "cpu")]).to(device)  # r s, -r s


#: the seed of the affinity checks' generator: fixed, so that the checks do not consume the
#: user's random stream and a model is checked at the same points every call
PROBE_SEED = 20231207


def fixed_probes(K, dtype, device):
    """:func:`affinity_probes` drawn from a generator seeded with :data:`PROBE_SEED`, and that
    generator, in the state the draw left it, for any further probes.

    The draw is the same every call for ``(K, dtype)``: it is kept (a dozen small kernels a call
    otherwise, 40 us of a 4 ms step of a small model), the generator restored to its state.

    :returns: ``(probes, generator)``, probes ``(3, K)`` on ``device``.

    Example::

        >>> probes, gen = fixed_probes(2, torch.float64, "cpu")
        >>> probes.equal(affinity_probes(2, torch.Generator().manual_seed(PROBE_SEED), torch.float64, "cpu"))
        True
    """
    probes, state = _probe_draw(K, dtype)
    generator = torch.Generator(device="cpu")
    generator.set_state(state)
    # a copy: the kept draw must not change with what a caller does to its probes
    return probes.to(device, copy=True), generator


def probe_coordinates(n, K, dtype, device):
    """Two probe points, each datapoint at its own coordinates, ``(2, n, K)``: standard normal
    draws from a generator seeded with :data:`PROBE_SEED` (on the CPU, whatever the default
    device), for the checks of a vectorized run against runs at each point alone.

    Example::

        >>> probe_coordinates(3, 2, torch.float64, "cpu").shape
        torch.Size([2, 3, 2])
    """
    generator = torch.Generator(device="cpu").manual_seed(PROBE_SEED)
    return torch.randn(2, n, K, generator=generator, dtype=dtype, device="cpu").to(device)


@functools.lru_cache(maxsize=64)
def _probe_draw(K, dtype):
    generator = torch.Generator(device="cpu").manual_seed(PROBE_SEED)
    probes = affinity_probes(K, generator, dtype, "cpu")
    return probes, generator.get_state()


def alternating_signs(n, K, generator, dtype, device):
    r"""``(n, K)`` probes of size about :math:`r` (:data:`PROBE_REACH`) with random signs, row :math:`2i + 1` the negative of row :math:`2i`.

    One probe per datapoint for runs that give each datapoint its own
    coordinates: consecutive datapoints take opposite signs, so that two
    datapoints put every coordinate at both :math:`+r` and :math:`-r` (as
    :func:`affinity_probes` does). The sizes are drawn uniformly in
    :math:`[r - 1/2, r + 1/2]`: with sizes all equal to :math:`r`, loadings
    that differ by datapoint along a direction orthogonal to a row's signs
    (two latents entering as ``z1 - z2`` with sign vector ``(1, 1)``) would
    predict that row exactly.

    Example::

        >>> alternating_signs(3, 2, torch.Generator().manual_seed(0), torch.float64, "cpu").abs()  # in [2.5, 3.5]
    """
    half = (n + 1) // 2
    signs = torch.randint(0, 2, (half, K), generator=generator, device="cpu").to(dtype).mul_(2).sub_(1)
    sizes = PROBE_REACH - 0.5 + torch.rand(half, K, generator=generator, dtype=dtype, device="cpu")
    rows = torch.stack([signs * sizes, -signs * sizes], 1).reshape(2 * half, K)[:n]
    return rows.to(device)


def reaches_points(fn, dim):
    r"""Whether the distribution ``fn`` of a run in the points' plate at dim ``-dim`` varies over it.

    The latents carry the points' dim, and a distribution whose parameters are
    computed from them carries it too. One that does not was either computed
    without the latents or had that dim moved by the model: ``z.reshape(n, K)``
    of a latent ``(P, 1, K)`` (kept at one row for the whole batch) succeeds
    when the batch has ``n = P`` datapoints and turns the points into
    datapoints; Pyro's plate then expands the result over the points, with
    stride 0. Reading such a run gives a wrong model (a zero loading, one
    node's likelihood for every node), so the callers decline it and run the
    model in a mode that asks less of it (one point at a time).

    The parameters are looked for wherever the distribution keeps them: its
    own tensors (whose trailing dims may be more than its event dims, as a
    ``Categorical``'s logits ``batch + (V,)``), the distributions it wraps
    (``TransformedDistribution``'s base, ``MixtureSameFamily``'s parts,
    Pyro's ``ExpandedDistribution``) and a ``TransformedDistribution``'s
    transforms (an ``AffineTransform`` whose location is computed from the
    latents).

    :param fn: the site's distribution in the run (``Independent`` and mask
        wrappers allowed).
    :param int dim: the plate's dim counted from the right of the site's batch
        shape (``max_plate_nesting + 1``).
    :returns: True when some tensor parameter has the points' dim with a
        nonzero stride (or the plate has one point).

    Example::

        >>> reaches_points(trace.nodes["x"]["fn"], tokens.max_plate_nesting + 1)
    """
    batch = fn.batch_shape
    if len(batch) < dim or batch[len(batch) - dim] == 1:
        return True
    return _varies_along(fn, len(batch) - dim)


def _varies_along(fn, index):
    # index: the points' dim counted from the left of fn.batch_shape, where
    # wrappers that keep the batch dims (Independent, masks, transformed and
    # mixture bases) have it too; an expanded distribution's base is aligned
    # to the right of the expanded batch instead
    batch, event = fn.batch_shape, fn.event_shape
    if isinstance(fn, dist.ExpandedDistribution):
        return _varies_along(fn.base_dist, index - (len(batch) - len(fn.base_dist.batch_shape)))
    if index < 0 or index >= len(batch):
        return False  # the wrapped distribution has no such dim: expanded over it
    for value in vars(fn).values():
        if isinstance(value, torch.distributions.Distribution):
            if _varies_along(value, index):
                return True
        elif torch.is_tensor(value) and _tensor_varies(value, batch, index, len(event)):
            return True
    if isinstance(fn, torch.distributions.TransformedDistribution):
        # a transform's parameters broadcast against the value, batch + event
        for t in _transform_parts(fn.transforms):
            for value in vars(t).values():
                if torch.is_tensor(value) and _varies_at(value, len(batch) + len(event) - index):
                    return True
    return False


def _tensor_varies(t, batch, index, event_dims):
    # a parameter laid out as batch + (its own trailing dims) is read from the
    # left; one broadcast from fewer dims, from the right of batch + event
    n = len(batch)
    if t.dim() >= n + event_dims and all(a in (1, b) for a, b in zip(t.shape[:n], batch)):
        return _varies_at(t, t.dim() - index)
    return _varies_at(t, n - index + event_dims)


def _varies_at(t, offset):
    # dim -offset of t exists, is not a broadcast 1 and is not expanded (stride 0)
    return t.dim() >= offset and t.shape[-offset] > 1 and t.stride(-offset) != 0


def _transform_parts(transforms):
    for t in transforms:
        if isinstance(t, torch.distributions.transforms.ComposeTransform):
            yield from _transform_parts(t.parts)
        else:
            yield t


class CoordinateLatents(Messenger):
    r"""Set each latent site of a layout to its values at a batch of coordinates ``u``.

    By the latent's kind (:class:`LatentSlice`): ``"normal"``,
    :math:`z = \mu + \sigma u`; ``"mvn"``, :math:`z = \mu + L u`; ``"transform"``,
    :math:`z = T(u)` with :math:`T` = ``biject_to(support)``. Enter it inside
    the plate of the points (:func:`run_in_plate`'s ``inside``), so that it
    sees each distribution before the plate broadcasts it.

    :param dict layout: ``{name: LatentSlice}`` (:func:`latent_layout`).
    :param torch.Tensor u: coordinates ``(P, r, K)``, ``r`` 1 (shared by the
        datapoints) or ``n``; with ``dim=None`` (no plate) ``(1, K)`` or ``(n, K)``.
    :param int dim: the points' plate dim, counted from the batch end, or None.
    :param batch_shape: the observed site's batch shape (the layout of ``r = n``).
    :param bool compact: keep the latents' parameters shared by the
        datapoints at size one (:func:`~pyro_mpt.conditionals.distributions.compact`);
        else expand the values to the sites' full shapes.

    After the run, ``log_pi`` holds the log-density of the points in the
    coordinates, :math:`\sum_l \log \pi_l(u)`, ``(P, r')`` (``(1, r')``
    without plate; None without latents), and ``scales`` the scale (or ``scale_tril``) of
    each normal latent, with the points' dim first.

    Example::

        >>> handler = CoordinateLatents(layout, u, dim=2, batch_shape=(n,), compact=True)
        >>> trace = run_in_plate(model, (x,), {}, name="_mpt_nodes", size=P, dim=2, inside=handler)
    """

    def __init__(self, layout, u, dim, batch_shape=(), compact=True):
        super().__init__()
        self.layout = layout
        self.u = u
        self.dim = dim
        self.batch_shape = tuple(batch_shape)
        self.compact = compact
        self.log_pi = None
        self.scales = {}

    def _shape(self, event_shape):
        if self.dim is None:
            # one point for the batch, or one per datapoint
            return (self.batch_shape if self.u.shape[0] > 1 else ()) + tuple(event_shape)
        P, r = self.u.shape[:2]
        nb = len(self.batch_shape)
        batch = self.batch_shape if r > 1 else (1,) * nb
        return (P,) + (1,) * (self.dim - 1 - nb) + batch + tuple(event_shape)

    def _place(self, u, plates, event_shape):
        # u (P, r, numel) or, without plate, (r, numel); the layout of the
        # batch dims is that of _shape with each plate's elements at its dim,
        # where the observed site (hence the data layout) has size one
        lead, r = u.shape[:-2], u.shape[-2]
        dims, sizes = [d for d, _ in plates], [size for _, size in plates]
        L = max(len(self.batch_shape), -min(dims))
        data = list(self.batch_shape) if r > 1 else [1] * len(self.batch_shape)
        data = [1] * (L - len(data)) + data
        nl, m, E = len(lead), len(sizes), len(event_shape)
        v = u.reshape(*lead, *data, *sizes, *event_shape)
        block, displaced = list(range(nl, nl + L)), []
        for i, d in enumerate(dims):
            displaced.append(block[L + d])
            block[L + d] = nl + L + i
            data[L + d] = sizes[i]
        order = list(range(nl)) + block + displaced + list(range(nl + L + m, nl + L + m + E))
        pad = () if self.dim is None else (1,) * (self.dim - 1 - L)
        return v.permute(order).reshape(*lead, *pad, *data, *event_shape)

    def _pyro_sample(self, msg):
        name = msg["name"]
        if msg["is_observed"] or site_is_subsample(msg) or name not in self.layout:
            return
        entry = self.layout[name]
        fn = msg["fn"]
        base, _ = unwrap(fn)
        if entry.kind == "normal" and affine_normal(base) is not None:
            base = affine_normal(base)  # a Normal written as an affine transform of one
        E = len(fn.event_shape)
        u = self.u[..., entry.offset : entry.offset + entry.numel]
        if entry.dtype is not None:
            # a float32 latent stays float32 when the coordinates follow float64 data: the
            # model may combine it with float32 parameters (z @ W.T), as under Pyro's sampling
            u = u.to(entry.dtype)
        coords = fn.event_shape if entry.coord_shape is None else entry.coord_shape
        u = self._place(u, entry.plates, coords) if entry.plates else u.reshape(self._shape(coords))
        summed = E  # the event dims over which log_pi is still per element
        if entry.kind in ("normal", "mvn"):
            mvn = entry.kind == "mvn"
            loc, scale = (base.loc, base.scale_tril) if mvn else (base.loc, base.scale)
            if self.compact:
                loc, scale = compact(loc), compact(scale)
            value = loc + ((scale @ u.unsqueeze(-1)).squeeze(-1) if mvn else scale * u)
            log_pi = -0.5 * (u.pow(2) + _LOG_2PI)
            if self.dim is not None:
                # the scale with the points' dim first (a linear-Gaussian model's does not vary)
                bdim = scale.dim() - self.dim - E - mvn
                scale = scale.movedim(bdim, 0) if bdim >= 0 else scale[None]
            self.scales[name] = scale
        else:
            t = biject_to(base.support)
            value = t(u)
            # both terms already sum over the base's own event dims (a simplex's)
            log_pi = base.log_prob(value) + t.log_abs_det_jacobian(u, value)
            summed = E - len(base.event_shape)
            # points whose image hits the boundary in floating point carry no mass
            log_pi = torch.where(torch.isnan(log_pi), torch.full_like(log_pi, -math.inf), log_pi)
        if not self.compact:
            value = value.expand(broadcast_shape(value.shape, fn.shape()))
        if summed:
            log_pi = log_pi.sum(tuple(range(-summed, 0)))
        if entry.plates:
            log_pi = log_pi.sum(tuple(d for d, _ in entry.plates), keepdim=True)
        # without plate the coordinates are one point: a leading size-one dim
        log_pi = log_pi.reshape(1 if self.dim is None else self.u.shape[0], -1)
        self.log_pi = log_pi if self.log_pi is None else self.log_pi + log_pi
        msg["value"] = value
        msg["done"] = True


def most_probable(fn):
    """The most probable value of a discrete distribution, in ``fn.shape()``; None when unknown.

    Ties go to the first value of the support (a ``Bernoulli(0.5)`` gives 0,
    where torch's ``mode`` is NaN). Wrappers over event dims
    (``Independent``) are taken apart: their elements are independent, so the
    joint mode is the elementwise one.

    Example::

        >>> most_probable(dist.Bernoulli(torch.tensor([0.5, 0.7])))
        tensor([0., 1.])
    """
    base = fn
    while isinstance(base, torch.distributions.Independent):
        base = base.base_dist
    values = None
    if base.has_enumerate_support:
        try:
            values = base.enumerate_support(expand=True)  # (K,) + batch + event
        except NotImplementedError:  # e.g. a Binomial whose total counts differ: its mode serves
            values = None
    if values is not None:
        best = base.log_prob(values).argmax(0)
        index = best.reshape((1,) + best.shape + (1,) * len(base.event_shape)).expand((1,) + values.shape[1:])
        return values.gather(0, index)[0].expand(fn.shape())
    try:
        value = base.mode
    except NotImplementedError:
        return None
    return value.expand(fn.shape()) if bool(torch.isfinite(value).all()) else None


class MeanLatents(Messenger):
    """Set latent sites to the mean of their distribution (its mode when it has no finite mean).

    A discrete latent is set to its most probable value (:func:`most_probable`):
    its mean (a ``Bernoulli(0.4)``'s 0.4) is not a value the model can take, so
    the model would index or mix with it, and a guide's log-density of it
    fails Pyro's support check.

    :param set names: the latent sites to set; None: every latent site.

    Example::

        >>> trace = run_in_plate(guide, (x,), {}, outside=MeanLatents())   # the guide's means
    """

    def __init__(self, names=None):
        super().__init__()
        self.names = names

    def _pyro_sample(self, msg):
        if msg["is_observed"] or site_is_subsample(msg):
            return
        if self.names is not None and msg["name"] not in self.names:
            return
        fn = msg["fn"]
        try:
            discrete = fn.support.is_discrete
        except NotImplementedError:  # a distribution that does not declare its support
            discrete = False
        value = most_probable(fn) if discrete else None
        if value is not None:
            msg["value"] = value
            msg["done"] = True
            return
        # continuous, or discrete without a known mode: the mean, else the mode
        value = None
        try:
            value = fn.mean
        except NotImplementedError:
            pass
        if value is None or not bool(torch.isfinite(value).all()):
            try:
                value = fn.mode
            except NotImplementedError:
                raise ValueError(
                    f"Site {msg['name']!r} ({type(fn).__name__}) has neither a finite mean "
                    f"nor a mode, so it cannot be set to its mean; use sampling instead "
                    f"(encode='sample') or another init."
                ) from None
        msg["value"] = value.expand(fn.shape())
        msg["done"] = True


def run_in_plate(fn, args, kwargs, *, name=None, size=None, dim=None, replay=None,
                 inside=None, outside=None, validation=None):
    """Trace ``fn(*args, **kwargs)`` inside an extra vectorized plate.

    :param callable fn: the model or guide.
    :param tuple args: its arguments.
    :param dict kwargs: its keyword arguments.
    :param str name: the plate's name (None with ``size=None``: no plate).
    :param int size: the number of latent values per datapoint ``P``.
    :param int dim: the plate sits at dim ``-dim`` (``max_plate_nesting + 1``).
    :param ~pyro.poutine.Trace replay: sites to replay (the minibatch's
        subsample sites, given latent values), or None.
    :param inside: a messenger (or a sequence of them) entered inside the
        plate: it sees each site before the plate broadcasts its distribution.
    :param outside: a messenger wrapped around the plate and the replay: it
        sees each site after them.
    :param bool validation: None leaves Pyro's validation as it is; False
        turns it off for the run (the observed values were validated when the
        model was first traced).
    :rtype: ~pyro.poutine.Trace

    Example::

        >>> trace = run_in_plate(model, (x,), {}, name="_mpt_particles", size=8, dim=2,
        ...                      replay=tokens.subsample_trace())
    """

    def wrapped(*a, **k):
        with contextlib.ExitStack() as stack:
            if size is not None:
                stack.enter_context(pyro.plate(name, size, dim=-dim))
            for handler in (() if inside is None else inside if isinstance(inside, (list, tuple)) else (inside,)):
                stack.enter_context(handler)
            return fn(*a, **k)

    run = wrapped if replay is None else poutine.replay(wrapped, trace=replay)
    if outside is not None:
        run = outside(run)
    valid = contextlib.nullcontext() if validation is None else pyro.validation_enabled(validation)
    # hide the runs' samples from outer handlers (SVI still sees the params)
    with poutine.block(hide_fn=lambda m: m["type"] == "sample"), valid:
        return poutine.trace(run).get_trace(*args, **kwargs)


@dataclass
class RunMemory:
    """The mode of running that last worked, and for which callable.

    Kept by an engine across calls (see each engine's docstring for what it
    remembers). One slot: a different callable starts again from the first mode.

    :param tuple key: ``callable_key(fn)`` of the callable (see ``model_keys``).
    :param str mode: the mode that worked for it.
    :param tuple verified: ``(key, mode, data shape)`` of a callable whose vectorized runs in ``mode`` a
        caller checked against unvectorized ones (the quadrature engine's first node).
    """

    key: Optional[tuple] = None
    mode: Optional[str] = None
    verified: Optional[tuple] = None

    def recall(self, fn):
        """The remembered mode for ``fn``, or None."""
        return self.mode if self.key == callable_key(fn) else None

    def remember(self, fn, mode):
        self.key, self.mode = callable_key(fn), mode


def agrees_with_point_run(vectorized, alone):
    """Whether a vectorized run's log-densities at its first point equal those of a run at that
    point alone, to 1000 eps of their dtype relative (equal infinities agree): the check that a
    model did not broadcast the engine's extra left dim into the datapoints' (see
    :class:`~pyro_mpt.conditionals.quadrature_nodes.NodeRunner` and
    :class:`~pyro_mpt.conditionals.latent_runs.LatentRunner`).

    :param torch.Tensor vectorized: the first point's slice of the vectorized run.
    :param torch.Tensor alone: the same point's values from a run without the plate.
    :returns: bool.

    Example::

        >>> agrees_with_point_run(table[0], table_at_first_point[0])
        True
    """
    vectorized, alone = vectorized.detach(), alone.detach()
    eps = torch.finfo(vectorized.dtype).eps
    ok = (vectorized - alone).abs() <= 1e3 * eps * (1.0 + alone.abs())
    ok |= torch.isinf(vectorized) & (vectorized == alone)
    return bool(ok.all())


def run_with_fallback(modes, attempt, *, memory=None, fn=None, passes=(EngineNotApplicable,),
                      on_fallback=None, failure=None):
    """Try ``attempt(mode)`` for each mode in order; the one fallback policy of the engines.

    The mode remembered for ``fn`` in ``memory`` is tried first, and the modes
    before it are skipped (they failed for ``fn`` before). The first mode that
    works is remembered (when there was a choice) and its result returned.

    :param tuple modes: the modes, most preferred first.
    :param callable attempt: ``attempt(mode)`` runs one mode.
    :param RunMemory memory: where the working mode is kept (None: nowhere).
    :param callable fn: the callable the memory is about.
    :param passes: exception types (or a predicate on the exception) that
        pass through instead of triggering the next mode.
    :param callable on_fallback: ``on_fallback(mode, error)`` when ``mode``
        failed and a next one is tried (e.g. to warn).
    :param callable failure: ``failure(errors) -> Exception`` raised (from the
        last error) when every mode fails; by default the last error is raised
        from the first (the mode that asks least of the model, chained to the
        one that asks most).
    :returns: ``(mode, result)``.

    Example::

        >>> mode, trace = run_with_fallback(("compact", "full"), run, memory=engine_memory, fn=model)
    """
    known = None if memory is None else memory.recall(fn)
    if known in modes:
        modes = modes[modes.index(known):]
    passing = passes if callable(passes) and not isinstance(passes, type) else (lambda e: isinstance(e, passes))
    errors = []
    for i, mode in enumerate(modes):
        try:
            out = attempt(mode)
        except Exception as e:
            if passing(e):
                raise
            errors.append(e)
            if on_fallback is not None and i + 1 < len(modes):
                on_fallback(mode, e)
            continue
        if memory is not None and len(modes) > 1:
            memory.remember(fn, mode)
        return mode, out
    if failure is not None:
        raise failure(errors) from errors[-1]
    if len(errors) > 1:
        raise errors[-1] from errors[0]
    raise errors[0]
