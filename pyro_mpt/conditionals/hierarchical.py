r"""Exact conditionals of linear-Gaussian hierarchies: global latents, and local latents per unit of tokens.

A model with latents shared by all datapoints (``mu`` outside the data plate)
has one honest quantity, the whole dataset's evidence
:math:`\log p(x_1, \dots, x_N)`: with ``token_plates=("data",)`` every
observation is a token of one datapoint, and the data plate's elements become
*units* of :math:`E` tokens each (the observation's event elements). Latents
then come in two kinds:

* **global** latents :math:`g` (outside the unit plate), :math:`K_g` coordinates;
* **local** latents :math:`z_u` (inside the unit plate), :math:`K_l` per unit.

For a *linear-Gaussian* hierarchy -- Normal latents whose locations are affine
in earlier latents, e.g. :math:`\mu \sim \mathcal N(0, I)`,
:math:`z_u \sim \mathcal N(A\mu, \cdot)`, and a Normal observation
:math:`x_u \sim \mathcal N(W z_u + \dots, \operatorname{diag}\psi_u)` affine in
them with a scale that does not depend on them -- each token is
:math:`x_t = \mu_t + a_t^\top\varepsilon_g + b_t^\top\varepsilon_{u(t)} + \sigma_t\xi_t`
in the standard-normal noises of the latents. Given a context
:math:`\mathcal R`, the posterior precision of the noises is an *arrowhead*
matrix: with :math:`w_t = [t\in\mathcal R]/\psi_t`,

.. math::

    P_{gg} = I + \sum_t w_t a_t a_t^\top, \quad
    P_{gu} = \sum_{t\in u} w_t a_t b_t^\top, \quad
    P_{uu} = I + \sum_{t\in u} w_t b_t b_t^\top,

and no block between two units. Eliminating the units (one :math:`K_l\times K_l`
factor each) leaves the Schur complement
:math:`S = P_{gg} - \sum_u P_{gu}P_{uu}^{-1}P_{ug}` over the globals, so

.. math::

    \mathbb E[x_t \mid x_{\mathcal R}] = \mu_t + a_t^\top m_g + b_t^\top m_{u(t)},
    \qquad
    \operatorname{Var}[x_t \mid x_{\mathcal R}] = \psi_t
        + b_t^\top P_{uu}^{-1} b_t + h_t^\top S^{-1} h_t,
    \quad h_t = a_t - P_{gu}P_{uu}^{-1} b_t,

with :math:`m_g = S^{-1}\tilde\eta`, :math:`m_u = P_{uu}^{-1}(\eta_u - P_{ug}m_g)`.
The evidence follows from the determinant lemma,
:math:`\log|\Sigma| = \sum_t\log\psi_t + \sum_u\log|P_{uu}| + \log|S|`.
A query costs :math:`O(D(K_g + K_l)^2 + UK_l^3 + K_g^3)`: linear in the number
of tokens :math:`D = UE`, where the Gaussian engine's dense path costs
:math:`O(D^3)` and its low-rank path :math:`O(D(K_g + UK_l)^2)`.

**Orderings.** The contexts of an ordering are nested, so the ``"order"``
schedule reads all :math:`D` chain-rule terms off suffix sums along it
(:func:`chain_terms`), at :math:`O(D(K_g + K_l)^3)` per ordering.

**Reading the model.** The loadings come from :math:`K_g + K_l + 4` runs of the
model in one vectorized plate: every noise at 0, each global coordinate at 1,
each local coordinate at 1 *in every unit at once* (a unit's loading is read
off its own tokens), and three probes at which the location must equal its
affine prediction (a normal point and :math:`\pm 3` in every coordinate,
:func:`~pyro_mpt.conditionals.plate_runs.affinity_probes`). That check fails (the model is refused) when the location
is not affine, or when a unit's tokens depend on another unit's local latents
-- the units are then not conditionally independent given the globals.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import pyro.distributions as dist
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use (seconds)

from ..code_origin import user_stacklevel
from ..observed_tokens import check_local_latent
from ..token_site import vectorized_frames
from .base import ConditionalEngine, EngineNotApplicable, NumericalWarning, ordering_ranks
from .distributions import affine_normal, unwrap
from .gaussian_leave_one_out import leave_one_out_from_full, leave_one_out_targets
from .gaussian_linalg import PRECISION
from .gaussian_marginal import GaussianMarginal
from .marginal_rows import rows_equal
from .plate_runs import CoordinateLatents, LatentSlice, alternating_signs, fixed_probes, run_in_plate

__all__ = [
    "HierarchicalGaussianConditionals", "HierarchicalGaussianState", "NotHierarchicalError", "hierarchical_loadings",
    "hierarchical_marginal", "chain_terms",
]

_LOG_2PI = math.log(2 * math.pi)
_WHO = "conditionals='hierarchical'"


class NotHierarchicalError(EngineNotApplicable):
    """The model is not a linear-Gaussian hierarchy with local latents in a token plate."""


class _GrownShape(Exception):
    """A run in the noise points' plate whose observation grew a dim (the model does
    not broadcast there); ``refusal`` is raised if running point by point fails too."""

    def __init__(self, refusal):
        super().__init__(str(refusal))
        self.refusal = refusal


def _not_linear_gaussian(site, detail, discrete=False):
    """The refusal of a model with local latents in a token plate that is not linear-Gaussian."""
    return NotHierarchicalError(
        f"{_WHO} cannot serve the model of observed site {site!r}: {detail}, so it is not "
        f"a linear-Gaussian hierarchy. "
        + ("Use conditionals='enumerate' (or Evidence(method='exact')), which sums over the discrete "
           "latents where each of their values leaves a linear-Gaussian hierarchy; otherwise "
           if discrete else "Use ")
        + "conditionals='importance' (and "
        "Evidence(method='importance') with a guide over all the latents) for it."
    )


@dataclass
class HierarchicalGaussianState:
    r"""The loadings of one evaluation.

    :param torch.Tensor loc: :math:`\mu`, ``(n|1, D)``.
    :param torch.Tensor psi: the observation variances :math:`\psi`, ``(n|1, D)``.
    :param torch.Tensor a: global loadings, ``(n|1, U, E, K_g)``.
    :param torch.Tensor b: local loadings, ``(n|1, U, E, K_l)``.
    :param torch.dtype data_dtype: the dtype of the results when the state computes in a
        wider one (float64 for float32 data whose posterior precision float32 cannot
        hold, see :func:`hierarchical_loadings`); None otherwise.
    :param float roundoff: :math:`\epsilon\operatorname{tr}P` in the dtype the state computes in
        (:math:`P` the posterior precision of the noises given every token): about the nats a
        masked conditional given fewer context tokens than latent dimensions loses to rounding.
    """

    num_data: int
    num_tokens: int
    loc: torch.Tensor
    psi: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    site: Optional[str] = None
    data_dtype: Optional[torch.dtype] = None
    roundoff: float = 0.0

    @property
    def units(self):
        return self.b.shape[-3]


def _unit_plate(tokens):
    """``(dim, name)`` of the token plate whose elements are the units.

    With several token plates (an observation in nested plates, groups around
    their observations) the units are the outermost one: the tokens are
    flattened outermost plate first, so each unit's tokens are contiguous, and
    the inner token plates run over a unit's own tokens, like event dims.
    """
    # token_plates is sorted by name, token_dims by dim: pair them through the site's frames
    dims = {f.name: f.dim for f in tokens.site["cond_indep_stack"] if f.name in tokens.token_plates}
    name = min(dims, key=dims.get)
    return dims[name], name


def hierarchical_loadings(tokens, model, args, kwargs):
    """Read :math:`\\mu, \\psi` and the loadings of a linear-Gaussian hierarchy off the model.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: traced with the unit plate as
        a token plate (e.g. ``token_plates=("data",)``).
    :returns: :class:`HierarchicalGaussianState`.
    :raises NotHierarchicalError: naming the site, when the model is not one.

    Example::

        >>> tokens = trace_tokens(model, None, (x,), {}, token_plates=("data",))
        >>> state = hierarchical_loadings(tokens, model, (x,), {})
    """
    if not tokens.token_dims:
        raise NotHierarchicalError(
            f"{_WHO} needs a token plate over the units of observed site {tokens.name!r} "
            f"(e.g. token_plates=('data',) over datapoints that share global latents); it has none."
        )
    unit_dim, unit_plate = _unit_plate(tokens)
    U = tokens.site_batch_shape[unit_dim]
    D = tokens.num_tokens
    E = D // U
    global_layout, local_layout, K_g, K_l = {}, {}, 0, 0
    inner_units = set()  # inner token plates that hold latents (the units declared inside)
    for site in tokens.latent_sites():
        base, _ = unwrap(site["fn"])
        # TransformedDistribution(Normal, [AffineTransform, ...]) is a Normal (8 schools' theta
        # as mu + tau * N(0, 1)): it went to importance sampling, 0.16 nats off
        base = affine_normal(base) or base
        if not isinstance(base, (dist.Normal, dist.MultivariateNormal)) or isinstance(
            base, dist.LowRankMultivariateNormal
        ):
            raise _not_linear_gaussian(tokens.name, f"latent site {site['name']!r} is {type(base).__name__}, "
                                       f"not Normal or MultivariateNormal", discrete=site["fn"].support.is_discrete)
        check_local_latent(tokens, site, NotHierarchicalError, allow_token_plates=True, consequence=f"{_WHO} cannot serve it")
        frames = {f.name: f for f in vectorized_frames(site, 2)}
        local = unit_plate in frames
        others = [f for f in frames if f != unit_plate and f not in {g.name for g in tokens.data_frames}]
        lacking = [f for f in others if f not in tokens.token_plates]
        if lacking and local:
            raise _not_linear_gaussian(tokens.name, f"latent site {site['name']!r} sits in plate(s) "
                                       f"{', '.join(map(repr, lacking))} that the observation lacks "
                                       f"(declare such dims as event dims, .to_event(1))")
        event_shape = site["fn"].event_shape
        kind = "mvn" if isinstance(base, dist.MultivariateNormal) else "normal"
        # the model meets each latent in the dtype of its own sample (float32 latents with
        # float64 data: a float32 matmul in the model would refuse float64 noises)
        dtype = site["value"].dtype if site["value"].is_floating_point() else None
        # a latent's plates other than the units' (global: its own plates; local: the token plates
        # inside the unit, a latent per token) are its event dims
        plates = tuple(sorted((frames[f].dim, frames[f].size) for f in others))
        numel = math.prod(size for _, size in plates) * event_shape.numel()
        if local:
            # a latent per token of a unit (an offset in the inner token plate) was refused as sitting
            # in a plate "the observation lacks", and "auto" sampled it
            local_layout[site["name"]] = LatentSlice(site["name"], K_l, numel, event_shape, kind, plates, dtype)
            K_l += numel
        else:
            inner_units.update(f for f in others if f in tokens.token_plates)
            global_layout[site["name"]] = LatentSlice(site["name"], K_g, numel, event_shape, kind, plates, dtype)
            K_g += numel
    if K_l == 0 and inner_units:
        inner = ", ".join(map(repr, sorted(inner_units)))
        refusal = NotHierarchicalError(
            f"{_WHO} takes the outermost token plate {unit_plate!r} of observed site {tokens.name!r} "
            f"as its units (each unit's tokens must be contiguous), but the local latents sit in "
            f"token plate(s) {inner}, declared inside it. Declare the plates the other way round, "
            f"the units' plate at the dim further left (e.g. pyro.plate({sorted(inner_units)[0]!r}, "
            f"dim={unit_dim}) around pyro.plate({unit_plate!r}, dim=-1), the data transposed to match)."
        )
        refusal.fits_form = True  # the model's form is this engine's: Evidence leads with this, "auto" warns
        raise refusal
    if K_l == 0:
        raise NotHierarchicalError(
            f"{_WHO} serves latents inside the token plate {unit_plate!r} of observed site "
            f"{tokens.name!r}; this model has none there (use conditionals='gaussian')."
        )
    value = tokens.value
    dt, dev = value.dtype, value.device
    # a fixed generator: the affinity check must not consume the user's random stream
    # three probes (see affinity_probes): a normal point, and +-3 in every
    # coordinate with random signs (the units' local ones alternating)
    rg, gen = fixed_probes(K_g, dt, dev)
    sl = alternating_signs(U, K_l, gen, dt, dev)
    rl = torch.stack([torch.randn(U, K_l, generator=gen, dtype=dt, device="cpu").to(dev), sl, -sl])
    B = K_g + K_l + 4
    eps_g = torch.zeros(B, K_g, dtype=dt, device=dev)
    eps_l = torch.zeros(B, U, K_l, dtype=dt, device=dev)
    eps_g[1 : 1 + K_g] = torch.eye(K_g, dtype=dt, device=dev)
    eps_l[1 + K_g : 1 + K_g + K_l] = torch.eye(K_l, dtype=dt, device=dev)[:, None, :]
    eps_g[-3:], eps_l[-3:] = rg, rl
    rank = tokens.max_plate_nesting + 1
    shape = torch.Size((B,)) + tokens.site_shape
    local_batch = (U,) + (1,) * (-unit_dim - 1)

    def observation(trace):
        base, _ = unwrap(trace.nodes[tokens.name]["fn"], masks=True)
        base = affine_normal(base) or base
        if not isinstance(base, dist.Normal):
            raise _not_linear_gaussian(tokens.name, f"the observation is {type(base).__name__}, not Normal")
        return base

    def in_plate():
        # the global noises are shared by the units, the local ones lie along the unit plate's dim
        handlers = [
            CoordinateLatents(global_layout, eps_g[:, None], rank, compact=False),
            CoordinateLatents(local_layout, eps_l, rank, local_batch, compact=False),
        ]
        trace = run_in_plate(model, args, kwargs, name="_mpt_basis", size=B, dim=rank,
                             replay=tokens.subsample_trace(), inside=handlers, validation=False)
        base = observation(trace)
        for part in ("loc", "scale"):
            # a model that does not broadcast over the extra plate grows the observation's shape instead
            # (e.g. a leading dim added twice); reading it as tokens would then mix noise points and datapoints
            got = tuple(getattr(base, part).shape)
            if broadcast_shape(got, tuple(shape)) != tuple(shape):
                raise _GrownShape(_not_linear_gaussian(tokens.name, f"run at {B} noise points in a pyro.plate at dim {-rank}, "
                                           f"the observation's {part} has shape {got}, which does not broadcast to "
                                           f"{tuple(shape)} (the noise points, then the site's shape "
                                           f"{tuple(tokens.site_shape)}); write the model so that it broadcasts over "
                                           f"an extra batch dim on the left (e.g. g @ W.T rather than W @ g, no "
                                           f"unsqueeze that assumes the latents' shape)"))
        return base.loc.expand(shape), base.scale.expand(shape), {**handlers[0].scales, **handlers[1].scales}

    def per_point():
        # a model that does not broadcast over an extra batch dim (a prior written
        # out per datapoint with .expand(n, K)) runs once per noise point, without
        # the plate: B = K_g + K_l + 4 runs, exact
        locs, obs_scales, scales = [], [], {}
        for p in range(B):
            handlers = [
                CoordinateLatents(global_layout, eps_g[p : p + 1], None, compact=False),
                CoordinateLatents(local_layout, eps_l[p], None, local_batch, compact=False),
            ]
            trace = run_in_plate(model, args, kwargs, replay=tokens.subsample_trace(), inside=handlers,
                                 validation=False)
            base = observation(trace)
            locs.append(base.loc.expand(tokens.site_shape))
            obs_scales.append(base.scale.expand(tokens.site_shape))
            for name, scale in {**handlers[0].scales, **handlers[1].scales}.items():
                scales.setdefault(name, []).append(scale[None])
        return torch.stack(locs), torch.stack(obs_scales), {k: torch.cat(v) for k, v in scales.items()}

    try:
        loc, scale, latent_scales = in_plate()
    except EngineNotApplicable:
        raise
    except Exception as first:  # e.g. a shape error: the model does not broadcast over the plate
        try:
            loc, scale, latent_scales = per_point()
        except EngineNotApplicable:
            raise
        except Exception as e:
            if isinstance(first, _GrownShape):
                raise first.refusal from e
            raise _not_linear_gaussian(tokens.name, f"the model failed when run at {B} noise points in a "
                                       f"pyro.plate at dim {-rank} ({type(first).__name__}: {first}; write it so "
                                       f"that it broadcasts over an extra batch dim on the left)") from e
    for name, latent_scale in latent_scales.items():
        if not rows_equal(latent_scale.detach()):  # the noise points' dim first
            raise _not_linear_gaussian(tokens.name, f"the scale of latent site {name!r} depends on other latents")
    loc = tokens.to_tokens(loc).reshape(B, -1, D)
    scale = tokens.to_tokens(scale).reshape(B, -1, D)
    if not rows_equal(scale.detach()):
        raise _not_linear_gaussian(tokens.name, "the observation's scale depends on the latents")
    # the state computes in torch's promotion of the model's location (its parameters and
    # latents) and the data, as Pyro's log-density of the observation does
    # (the affinity check's tolerance is that of the dtype the model computed in)
    eps = torch.finfo(loc.dtype).eps
    dt = torch.promote_types(loc.dtype, dt)
    loc, scale, rg, rl = loc.to(dt), scale.to(dt), rg.to(dt), rl.to(dt)
    mu = loc[0]  # (n, D)
    A = (loc[1 : 1 + K_g] - mu).permute(1, 2, 0)  # (n, D, K_g)
    Bl = (loc[1 + K_g : 1 + K_g + K_l] - mu).permute(1, 2, 0)  # (n, D, K_l)
    n = mu.shape[0]
    a = A.reshape(n, U, E, K_g)
    b = Bl.reshape(n, U, E, K_l)
    pred = mu + (A @ rg.T).movedim(-1, 0) + torch.einsum("nuek,puk->pnue", b, rl).reshape(3, n, D)
    err = (loc[-3:] - pred).abs().amax()
    tol = eps ** 0.5 * (mu.abs().amax() + loc.abs().amax() * (K_g + K_l + 1) + 1.0)
    if not bool(err <= tol):
        raise _not_linear_gaussian(tokens.name, f"its location is not affine in the latents with each unit "
                                   f"of plate {unit_plate!r} reading only its own local latents (off "
                                   f"by {float(err):.3g} at a random point)")
    psi = scale[0] ** 2
    # the posterior precision of the noises, P = I + sum_t (a_t a_t^T + b_t b_t^T) / psi_t, formed
    # with rounding errors of eps tr P: where a context leaves eigenvalues near 1 (fewer tokens than
    # latent dims) they and the conditionals move by about as much. Beyond PRECISION (float32 at
    # D = 600 and noise sd 1e-2: about 2 nats, and a failed Cholesky at 1e-3) the state computes in
    # float64, by casts, so gradients reach the model; float64 beyond it warns in the masked queries
    data_dtype = None
    with torch.no_grad():
        trace = K_g + K_l + float(((A.pow(2).sum(-1) + Bl.pow(2).sum(-1)) / psi).sum(-1).max())
    if dt != torch.float64 and torch.finfo(dt).eps * trace > PRECISION:
        data_dtype, (mu, psi, a, b) = dt, (t.to(torch.float64) for t in (mu, psi, a, b))
    roundoff = torch.finfo(mu.dtype).eps * trace
    return HierarchicalGaussianState(n, D, mu, psi, a, b, tokens.name, data_dtype, roundoff)


def hierarchical_marginal(tokens, model, args, kwargs):
    r"""The Gaussian marginal over a datapoint's tokens of a linear-Gaussian hierarchy,
    :math:`\Sigma = AA^\top + \operatorname{blockdiag}_u(B_uB_u^\top) + \operatorname{diag}(\psi)`,
    as a low-rank :class:`~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal` of rank
    :math:`K_g + UK_l` (the global loadings, then each unit's local ones, zero outside its tokens).

    For the components of a mixture (:mod:`~pyro_mpt.conditionals.enumerate`) whose Normal
    latents sit in a token plate: a class per group with a random effect per item.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: as for :func:`hierarchical_loadings`.
    :returns: :class:`~pyro_mpt.conditionals.gaussian_marginal.GaussianMarginal`, ``cov_factor``
        ``(n|1, D, K_g + U K_l)``, in the data's dtype.
    :raises NotHierarchicalError: naming the site, when the model is not one.

    Example::

        >>> m = hierarchical_marginal(tokens, component, (y,), {})   # tokens of token_plates=("items",)
        >>> m.cov_factor @ m.cov_factor.mT + torch.diag_embed(m.cov_diag)   # Sigma, (n|1, D, D)
    """
    state = hierarchical_loadings(tokens, model, args, kwargs)
    a, b = state.a, state.b  # (n|1, U, E, K_g), (n|1, U, E, K_l)
    _, U, E, K_l = b.shape
    rows = max(a.shape[0], b.shape[0])
    eye = torch.eye(U, dtype=b.dtype, device=b.device)
    local = torch.einsum("nuek,uv->nuevk", b, eye).reshape(b.shape[0], U * E, U * K_l)
    F = torch.cat([a.reshape(a.shape[0], U * E, -1).expand(rows, -1, -1), local.expand(rows, -1, -1)], -1)
    dt = state.data_dtype or F.dtype
    return GaussianMarginal(state.loc.to(dt), cov_factor=F.to(dt), cov_diag=state.psi.to(dt), site=state.site)


def _warn_roundoff(state):
    """Warn where the masked conditionals given small contexts lose more than ``PRECISION`` nats
    to rounding (``state.roundoff``, in float64: no wider dtype to compute in)."""
    if state.roundoff > PRECISION:
        warnings.warn(NumericalWarning(
            f"{_WHO}: the noise of observed site {state.site!r} is tiny against its loadings "
            f"(eps tr P = {state.roundoff:.2g} in float64, P the posterior precision of the latents' "
            f"noises): masked conditionals given fewer context tokens than latent dimensions may lose "
            f"up to about that many nats each to rounding. log p (Evidence, masks='order' in a loss) and "
            f"masks='pll' keep their digits; for the other schedules a larger observation noise "
            f"(a floor on its scale) keeps them."
        ), stacklevel=user_stacklevel())


def _to_work(state, x):
    return x if state.data_dtype is None else x.to(state.loc.dtype)


def _to_data(state, out):
    return out if state.data_dtype is None else out.to(state.data_dtype)


def _posterior(state, r, ctx):
    r"""The arrowhead posterior of the noises given contexts ``ctx`` ``(q, n, D)``.

    :returns: ``(L_u, L_S, X, m_g, m_u)``: the Cholesky factors of
        :math:`P_{uu}` ``(q, n, U, K_l, K_l)`` and :math:`S` ``(q, n, K_g, K_g)``,
        :math:`X = P_{uu}^{-1}P_{ug}` ``(q, n, U, K_l, K_g)``, and the posterior means
        ``(q, n, K_g)``, ``(q, n, U, K_l)``.
    """
    a, b = state.a, state.b
    n_, U, E, K_l = b.shape
    K_g = a.shape[-1]
    q = ctx.shape[0]
    w = (ctx / state.psi).reshape(q, -1, U, E)
    r = r.reshape(-1, U, E)
    eye_l = torch.eye(K_l, dtype=b.dtype, device=b.device)
    eye_g = torch.eye(K_g, dtype=b.dtype, device=b.device)
    wb = w.unsqueeze(-1) * b  # (q, n, U, E, K_l)
    P_uu = eye_l + wb.transpose(-1, -2) @ b
    P_ug = wb.transpose(-1, -2) @ a  # (q, n, U, K_l, K_g)
    wa = w.unsqueeze(-1) * a
    P_gg = eye_g + torch.einsum("qnuek,nuel->qnkl", wa, a.expand(w.shape[1:] + (K_g,)))
    L_u = torch.linalg.cholesky(P_uu)
    X = torch.cholesky_solve(P_ug, L_u)
    S = P_gg - (P_ug.transpose(-1, -2) @ X).sum(-3)
    L_S = torch.linalg.cholesky(S)
    eta_u = (wb * r.unsqueeze(-1)).sum(-2)  # (q, n, U, K_l)
    eta_g = torch.einsum("qnuek,nue->qnk", wa, r.expand(w.shape[1:]))
    # eliminate the units, solve over the globals, back-substitute
    y = torch.cholesky_solve(eta_u.unsqueeze(-1), L_u).squeeze(-1)
    eta_s = eta_g - (P_ug.transpose(-1, -2) @ y.unsqueeze(-1)).squeeze(-1).sum(-2)
    m_g = torch.cholesky_solve(eta_s.unsqueeze(-1), L_S).squeeze(-1)  # (q, n, K_g)
    m_u = y - (X @ m_g[:, :, None, :, None]).squeeze(-1)  # (q, n, U, K_l)
    return L_u, L_S, X, m_g, m_u


def _fit(state, m_g, m_u):
    r"""``(q, n, D)``: the tokens' loadings times the posterior means of the noises,
    :math:`a_t^\top m_g + b_t^\top m_{u(t)}` (the conditional means less :math:`\mu`)."""
    fit = torch.einsum("nuek,qnk->qnue", state.a, m_g) + torch.einsum("nuel,qnul->qnue", state.b, m_u)
    return fit.reshape(fit.shape[:2] + (-1,))


class HierarchicalGaussianConditionals(ConditionalEngine):
    r"""Exact masked conditionals and evidence of linear-Gaussian hierarchies, linear in the tokens.

    Serves models whose observed site has one token plate of *units* (e.g. the
    data plate under ``token_plates=("data",)``; with nested token plates, the
    outermost, e.g. groups around their observations), Normal latents inside it
    (local) and outside it (global), and a Normal observation affine in them;
    see the module docstring for the algebra. Latents outside the data plate
    make the whole dataset one datapoint: ``score`` and ``Evidence`` then give
    :math:`\log p(x_1, \dots, x_N)`.

    :param int max_elements: bound on the elements of intermediate tensors
        (queries are answered in chunks).

    Example::

        >>> loss = MaskedPretrainingLoss(conditionals="hierarchical", token_plates=("data",), masks="order")
        >>> loss.score(model, None, x)   # log p(x_1..N), one number
        >>> Evidence(model, method="exact", token_plates=("data",))(x)
    """

    def prepare(self, tokens, model, guide, args, kwargs):
        return hierarchical_loadings(tokens, model, args, kwargs)

    def _per_chunk(self, state):
        U, E, K_l = state.b.shape[-3:]
        K = state.a.shape[-1] + K_l
        per = state.num_data * state.num_tokens * (K + 1) + state.num_data * U * K_l * (K + 1)
        return max(1, self.max_elements // max(1, per))

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        _warn_roundoff(state)
        step = self._per_chunk(state)
        x = _to_work(state, x)
        return _to_data(state, torch.cat([self._masks(state, x, mask[s : s + step]) for s in range(0, mask.shape[0], step)], 0))

    def mask_sums(self, state, x, mask):
        targets = leave_one_out_targets(mask[:, 0]) if mask.shape[1] == 1 else None
        if targets is None:
            return super().mask_sums(state, x, mask)
        # queries that each hide one token (the "pll" schedule): all from the full-data
        # posterior, one query's work instead of one per token
        table = self.leave_one_out_log_prob(state, x)
        if table is None:  # a subclass without the table
            return super().mask_sums(state, x, mask)
        return table.T[targets]

    def leave_one_out_log_prob(self, state, x, observed=None):
        """Every leave-one-out conditional from the full-data posterior, ``(n, D)``; with missing
        tokens (``observed``) from the posterior given the observed ones, 0 at a missing token
        (removing an observed token from that posterior is the same rank-one update)."""
        self._check_x(state, x)
        hidden = torch.zeros_like(x, dtype=torch.bool) if observed is None else ~observed
        x = _to_work(state, x)
        mean, spread = self._moments(state, x, hidden[None])
        return _to_data(state, leave_one_out_from_full(x - mean[0], state.psi, spread[0], observed))

    def weighted_sum_elements(self, state, x, mask=None):
        """Elements of the working set per query: ``n`` for masks ``(q, D)`` that each hide
        one token (the ``"pll"`` schedule: the full-data posterior serves them all, so
        :func:`~pyro_mpt.estimate.mpt_estimate` keeps them in one group instead of
        blocks that each redo it, recomputed in the backward pass), else ``n * D``."""
        if mask is not None and leave_one_out_targets(mask) is not None:
            return x.shape[0]
        return super().weighted_sum_elements(state, x, mask)

    def _masks(self, state, x, mask):
        mean, spread = self._moments(state, x, mask)
        var = state.psi + spread
        return -0.5 * (_LOG_2PI + var.log() + (x - mean) ** 2 / var)

    def _moments(self, state, x, mask):
        """The conditional means ``(q, n, D)`` of every token given the context of each
        mask, and their variances' latent part (without psi), summed as squares."""
        ctx = (~mask).to(state.loc.dtype)
        r = x - state.loc
        L_u, L_S, X, m_g, m_u = _posterior(state, r, ctx)
        a, b = state.a, state.b
        U, E = b.shape[-3], b.shape[-2]
        q = ctx.shape[0]
        mean = state.loc + _fit(state, m_g, m_u)
        Q = X.shape[1]
        bt = b.expand((q, Q) + b.shape[-3:])
        # P_uu^{-1/2} b_t, and h_t = a_t - X^T b_t
        Vb = torch.linalg.solve_triangular(L_u, bt.transpose(-1, -2), upper=False)  # (q, n, U, K_l, E)
        h = a - (bt @ X)  # (q, n, U, E, K_g)
        Vh = torch.linalg.solve_triangular(L_S[:, :, None], h.transpose(-1, -2), upper=False)  # (q, n, U, K_g, E)
        return mean, (Vb.pow(2).sum(-2) + Vh.pow(2).sum(-2)).reshape(q, Q, U * E)

    def chain_log_prob(self, state, x, order):
        """Chain-rule terms along orderings ``(p, n|1, D)``, ``(p, n, D)``, by suffix sums
        (see :func:`chain_terms`), in chunks of orderings."""
        self._check_x(state, x)
        _warn_roundoff(state)
        U, E, K_l = state.b.shape[-3:]
        K = state.a.shape[-1] + K_l
        per = max(1, self.max_elements // max(1, state.num_data * state.num_tokens * K * K * 8))
        x = _to_work(state, x)
        return _to_data(state, torch.cat([chain_terms(state, x, order[s : s + per]) for s in range(0, order.shape[0], per)], 0))

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Every complete ordering of the hierarchy's one Gaussian joint telescopes to
        :math:`\log p(x)` (the chain rule), so the sums are :meth:`log_evidence`, one
        posterior factorization, instead of the ordering's suffix sums
        (:meth:`chain_log_prob`, :math:`O(D K^2)` an ordering); with ``observed``
        (missing tokens first in every ordering) the density of the observed tokens."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], x.shape[0])

    def log_evidence(self, state, x, observed=None):
        r""":math:`\log p(x)` per datapoint, ``(n,)``; with ``observed`` ``(n, D)`` the density of the observed tokens."""
        self._check_x(state, x)
        x = _to_work(state, x)
        ctx = torch.ones_like(x)[None] if observed is None else observed.to(x.dtype)[None]
        r = x - state.loc
        L_u, L_S, X, m_g, m_u = _posterior(state, r, ctx)
        logdet = 2 * torch.diagonal(L_u, dim1=-2, dim2=-1).log().sum((-1, -2)) + 2 * torch.diagonal(
            L_S, dim1=-2, dim2=-1
        ).log().sum(-1)
        # r^T Sigma^-1 r as the minimum it is, of |e|^2_psi + |m|^2 with the residual e = r - a m_g - b m_u
        # at the posterior means m: positive terms only. Written as r^T Psi^-1 r - eta^T m it
        # cancelled terms of size tr P down to the form's (float64, noise sd 1e-7 against unit
        # loadings, 60 tokens: 12 nats off); the means' rounding enters the minimum to second order
        e = r - _fit(state, m_g, m_u)
        quad = (ctx * e**2 / state.psi).sum(-1) + m_g.pow(2).sum(-1) + m_u.pow(2).sum((-1, -2))
        logpsi = (ctx * state.psi.log()).sum(-1)
        D_obs = ctx.sum(-1)
        return _to_data(state, (-0.5 * (D_obs * _LOG_2PI + logpsi + logdet + quad))[0])


def _suffix(t, dim):
    """Inclusive suffix sums along ``dim``: entry ``i`` is the sum of entries ``>= i``."""
    return t.flip(dim).cumsum(dim).flip(dim)


def _after(inclusive, dim):
    """Exclusive suffix sums from inclusive ones: entry ``i`` is the sum of entries ``> i``, the
    inclusive sums shifted by one (a zero last), not ``inclusive - t``: with tiny noise the terms
    are of size ``1/psi`` and their difference lost the small context's sum to rounding."""
    shifted = torch.zeros_like(inclusive)
    n = inclusive.shape[dim]
    shifted.narrow(dim, 0, n - 1).copy_(inclusive.narrow(dim, 1, n - 1))
    return shifted


def _chol_parts(P, Pug, eta):
    """Cholesky factor of ``P``, :math:`X = P^{-1}P_{ug}`, :math:`y = P^{-1}\\eta`,
    :math:`\\Gamma = P_{ug}^\\top X` and :math:`\\tau = P_{ug}^\\top y`."""
    L = torch.linalg.cholesky(P)
    X = torch.cholesky_solve(Pug, L)
    y = torch.cholesky_solve(eta.unsqueeze(-1), L)
    PgU = Pug.transpose(-1, -2)
    return L, X, y.squeeze(-1), PgU @ X, (PgU @ y).squeeze(-1)


def chain_terms(state, x, order):
    r"""Chain-rule terms of :class:`HierarchicalGaussianConditionals` along orderings, ``(p, n, D)``.

    The contexts of an ordering are nested, so every quantity is a suffix sum
    along it: a unit's :math:`P_{uu}, P_{ug}, \eta_u` over its tokens after
    position :math:`t` (its tokens sorted by position, a suffix sum along the
    :math:`E` tokens of each unit), and the Schur complement
    :math:`S_t = I + \sum_{s > t} (w_s a_s a_s^\top - \Delta\Gamma_s)`, where
    :math:`\Delta\Gamma_s` is the change of the unit's term
    :math:`P_{gu}P_{uu}^{-1}P_{ug}` when token :math:`s` joins its context (the
    terms of a unit telescope). Cost :math:`O(D(K_g + K_l)^3)` per ordering,
    with no loop over positions.
    """
    a, b, psi = state.a, state.b, state.psi
    nb, U, E, K_l = b.shape
    K_g = a.shape[-1]
    p = order.shape[0]
    n = x.shape[0]
    D = U * E
    order = order.expand(p, n, D)
    rank = ordering_ranks(order)
    r = (x - state.loc).reshape(n, U, E)
    w = (1.0 / psi).expand(n, D).reshape(n, U, E)
    a_, b_ = a.expand(n, U, E, K_g), b.expand(n, U, E, K_l)
    own = {  # each token's own term, when it joins the context
        "uu": (w[..., None, None] * b_.unsqueeze(-1) * b_.unsqueeze(-2)),
        "ug": (w[..., None, None] * b_.unsqueeze(-1) * a_.unsqueeze(-2)),
        "eu": (w * r).unsqueeze(-1) * b_,
        "gg": (w[..., None, None] * a_.unsqueeze(-1) * a_.unsqueeze(-2)),
        "eg": (w * r).unsqueeze(-1) * a_,
    }
    # each unit's tokens in the order they leave the context (ascending position)
    srt = rank.reshape(p, n, U, E).argsort(-1)

    def sorted_(t):
        idx = srt.reshape(srt.shape + (1,) * (t.dim() - 3))
        return torch.gather(t.expand((p,) + t.shape), 3, idx.expand((p,) + t.shape))

    eye_l = torch.eye(K_l, dtype=b.dtype, device=b.device)
    o_uu, o_ug, o_eu = sorted_(own["uu"]), sorted_(own["ug"]), sorted_(own["eu"])
    suf_uu, inc_ug, inc_eu = _suffix(o_uu, 3), _suffix(o_ug, 3), _suffix(o_eu, 3)
    inc_uu = suf_uu + eye_l
    exc_uu, exc_ug, exc_eu = _after(suf_uu, 3) + eye_l, _after(inc_ug, 3), _after(inc_eu, 3)
    _, _, _, G_inc, t_inc = _chol_parts(inc_uu, inc_ug, inc_eu)
    L_ex, X_ex, y_ex, G_ex, t_ex = _chol_parts(exc_uu, exc_ug, exc_eu)

    def positions(t_sorted):
        """A per-token quantity in sorted layout ``(p, n, U, E, ...)`` -> position order ``(p, n, D, ...)``."""
        tail = t_sorted.shape[4:]
        idx = srt.reshape(srt.shape + (1,) * len(tail)).expand(t_sorted.shape)
        tok = torch.empty_like(t_sorted).scatter_(3, idx, t_sorted).reshape((p, n, D) + tail)
        return torch.gather(tok, 2, order.reshape(order.shape + (1,) * len(tail)).expand((p, n, D) + tail))

    gg = positions(sorted_(own["gg"]) - (G_inc - G_ex))
    eg = positions(sorted_(own["eg"]) - (t_inc - t_ex))
    # the context of position t: positions after it (exclusive suffix sums)
    S = _after(_suffix(gg, 2), 2) + torch.eye(K_g, dtype=b.dtype, device=b.device)
    eta = _after(_suffix(eg, 2), 2)
    L_S = torch.linalg.cholesky(S)
    m_g = torch.cholesky_solve(eta.unsqueeze(-1), L_S).squeeze(-1)  # (p, n, D, K_g)
    L_ex, X_ex, y_ex, exc_ug = positions(L_ex), positions(X_ex), positions(y_ex), positions(exc_ug)
    tok = lambda t: torch.gather(t.reshape((n, D) + t.shape[3:]).expand((p, n, D) + t.shape[3:]), 2,  # noqa: E731
                                 order.reshape(order.shape + (1,) * (t.dim() - 3)).expand((p, n, D) + t.shape[3:]))
    at, bt = tok(a_), tok(b_)
    m_u = y_ex - (X_ex @ m_g.unsqueeze(-1)).squeeze(-1)
    mean = torch.gather(state.loc.expand(n, D).expand(p, n, D), 2, order) + (at * m_g).sum(-1) + (bt * m_u).sum(-1)
    Vb = torch.linalg.solve_triangular(L_ex, bt.unsqueeze(-1), upper=False).squeeze(-1)
    h = at - (X_ex.transpose(-1, -2) @ bt.unsqueeze(-1)).squeeze(-1)
    Vh = torch.linalg.solve_triangular(L_S, h.unsqueeze(-1), upper=False).squeeze(-1)
    var = torch.gather(psi.expand(n, D).expand(p, n, D), 2, order) + Vb.pow(2).sum(-1) + Vh.pow(2).sum(-1)
    xt = torch.gather(x.expand(p, n, D), 2, order)
    return -0.5 * (_LOG_2PI + var.log() + (xt - mean) ** 2 / var)
