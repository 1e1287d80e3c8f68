r"""The Gaussian marginal :math:`p(x) = \mathcal N(\mu, \Sigma)` of a Pyro model.

Two kinds of models have one:

* models without latents whose observed site is Gaussian over its tokens
  (``MultivariateNormal``, ``LowRankMultivariateNormal``,
  ``Normal(...).to_event(k)``);
* *linear-Gaussian* latent models written the ordinary way: Normal (or
  MultivariateNormal, LowRankMultivariateNormal) latents :math:`z_l = m_l + L_l \varepsilon_l` whose
  location may be affine in earlier latents, and a Normal observation whose
  location is affine in the latents and whose scale does not depend on them
  (PPCA, factor analysis, models with covariates, hierarchies of such).

For the second kind the marginal is derived from the model itself: with
:math:`\varepsilon \in \mathbb R^K` the stacked standard-normal noises of all
latents, the observed location is :math:`\mu + W\varepsilon`, so
:math:`x \sim \mathcal N(\mu, W W^\top + \Psi)`. The model is run once on the
:math:`K + 4` points :math:`\varepsilon \in \{0, e_1, \dots, e_K, \varepsilon_r,
3s, -3s\}` (vectorized in a plate): :math:`W_{:,k} = \text{loc}(e_k) - \text{loc}(0)`,
and the three probes verify that the location really is affine and that no
scale depends on the latents. :math:`\varepsilon_r` is a random normal point,
:math:`s` a random sign vector: the probes :math:`\pm 3s` put every noise
coordinate at both :math:`+3` and :math:`-3` prior standard deviations, so a
piecewise-linear location (``relu(z + 1)``, ``clamp``, ``abs``) whose kinks lie
within them is refused, where the points near 0 alone may all fall on one
linear piece (``relu(z + 1)`` at :math:`0, e_k, \varepsilon_r` did, and got the
value of the model without the ``relu``).

The data may put a datapoint's posterior far outside those probes (a datapoint at
6 prior standard deviations), where a clamp or a saturation they never reach
changes :math:`\log p(x_i)`. So the model runs once more, each datapoint at a
point of its posterior under the derived model (its mean, or the mean plus 3
posterior standard deviations), and the location there must be affine too. The
check costs about two products of the data with the loading, so it runs under
Pyro's validation only, once per model, data and parameters (the last few that
passed are kept per model function: a repeated evaluation does not pay for it
again, a training step that moves the parameters does).
"""

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import pyro.distributions as dist
from pyro.infer.util import is_validation_enabled

from ..observed_tokens import check_local_latent
from ..model_keys import PassedChecks
from .base import EngineNotApplicable, SlowEngineWarning
from .distributions import affine_normal, unwrap
from .gaussian_blocks import block_diagonal_parts, is_block_gaussian
from .marginal_rows import basis_rows, common_rows, rows_equal, shared_loading
from .structural_zeros import diagonal_variances
from .plate_runs import (PROBE_REACH, CoordinateLatents, agrees_with_point_run, alternating_signs, fixed_probes,
                         latent_layout, probe_coordinates, reaches_points, run_in_plate, run_with_fallback)
from ..code_origin import user_stacklevel

__all__ = ["GaussianMarginal", "gaussian_marginal", "loading_nonzeros_in_chunks", "NotLinearGaussianError", "RUN_MODES"]

#: the ways :func:`gaussian_marginal` runs the model on the noise points, in the
#: order it tries them: one vectorized run with the shared latent parameters
#: kept at size 1, one with full batch shapes, one run per point
RUN_MODES = ("compact", "full", "per_point")

#: noise points (K + 4) from which running the model once per point is worth a
#: SlowEngineWarning: a few runs cost less than the warning's noise
MIN_WARNED_POINTS = 32


class NotLinearGaussianError(EngineNotApplicable):
    """The model has no closed-form Gaussian marginal."""


class _LayoutDeclined(Exception):
    """The run's observed site has batch dims the data lacks: the model moved the
    points' plate dim (e.g. by transposing a latent declared in a plate of its
    own); the next run mode asks less of it."""


def _check_run_rows(batch_shape, tokens):
    if math.prod(batch_shape[1:]) not in (1, math.prod(tokens.batch_shape)):
        raise _LayoutDeclined()


class _RowsDeclined(Exception):
    """The run at per-datapoint points found no shared loading; the K + 4 points follow."""


@dataclass
class GaussianMarginal:
    r"""A batch of Gaussian marginals over ``D`` tokens.

    Either low-rank, :math:`\Sigma = F F^\top + \operatorname{diag}(\psi)`, or
    dense. The leading dim is the batch size ``n`` or 1 when shared by all
    datapoints.

    :param torch.Tensor loc: ``(n|1, D)``.
    :param torch.Tensor cov_factor: ``(n|1, D, R)`` or None.
    :param torch.Tensor cov_diag: ``(n|1, D)`` or None.
    :param torch.Tensor covariance: ``(n|1, D, D)`` or None (dense form).
    :param tuple parts: ``(kind, noise, W)``, what the dense form is computed from:
        :math:`\Sigma = \Sigma_{\text{noise}} + W W^\top` with ``kind`` ``"cov"``
        (``noise`` is :math:`\Sigma_{\text{noise}}`) or ``"tril"`` (``noise`` is its
        Cholesky factor :math:`T`, :math:`\Sigma_{\text{noise}} = T T^\top`, a
        MultivariateNormal observation's ``scale_tril``); ``W`` is None without
        latents. None when the form has no such parts. The engine computes
        :math:`\Sigma` from them again in float64 when its dtype cannot hold it:
        float32's rounding of :math:`T T^\top` or :math:`W W^\top` alone can exceed a
        small noise.
    :param str site: the observed site, for error messages.
    :param float jitter: jitter already added to the diagonal by
        :class:`~pyro_mpt.conditionals.GaussianConditionals`' rescue.
    :param torch.Tensor factor: the Cholesky factor of the covariance (dense,
        ``(n|1, D, D)``) or of the posterior precision
        :math:`I + F^\top\Psi^{-1}F` (low-rank, ``(n|1, R, R)``), kept by
        :meth:`GaussianConditionals.prepare <pyro_mpt.conditionals.GaussianConditionals.prepare>`
        for the exact log-density; None when not computed (or stale after a
        change of the jitter).
    :param torch.dtype data_dtype: the dtype of the results -- torch's
        promotion of the model's parameters and the data -- when the engine
        computes in a wider one (float64 for float32 data whose low-rank
        pieces or covariance that dtype cannot hold); None otherwise.
    :param tuple data_pieces: ``(x, pieces)``: what the engine's low-rank
        paths for masks shared by the batch compute from the tokens ``x`` and
        no mask (the full-data posterior mean and residuals), filled at the
        first such query and read by every later one on the same ``x``: one
        estimate asks for its blocks of masks one by one on one state. None
        when not computed (or stale after a change of the jitter). It lives and
        dies with the state, which :meth:`GaussianConditionals.prepare
        <pyro_mpt.conditionals.GaussianConditionals.prepare>` builds per call.
    :param GaussianMarginal dense_twin: a low-rank state's dense form
        (:math:`FF^\top + \Psi`, factored), made by the engine at the first masks drawn
        per datapoint where they cost less on it (a rank near :math:`D`); None until then.
    """

    loc: torch.Tensor
    cov_factor: Optional[torch.Tensor] = None
    cov_diag: Optional[torch.Tensor] = None
    covariance: Optional[torch.Tensor] = None
    site: Optional[str] = None
    jitter: float = 0.0
    factor: Optional[torch.Tensor] = None
    data_dtype: Optional[torch.dtype] = None
    data_pieces: Optional[tuple] = None
    parts: Optional[tuple] = None
    dense_twin: Optional["GaussianMarginal"] = None

    @property
    def is_low_rank(self):
        return self.covariance is None

    @property
    def num_tokens(self):
        return self.loc.shape[-1]

    @property
    def rank(self):
        return 0 if self.cov_factor is None else self.cov_factor.shape[-1]

    def dense(self):
        """The covariance matrix, ``(n|1, D, D)``."""
        if self.covariance is not None:
            return self.covariance
        cov = torch.diag_embed(self.cov_diag)
        if self.cov_factor is not None:
            cov = cov + self.cov_factor @ self.cov_factor.transpose(-1, -2)
        return cov


def _latent_kind(tokens, site):
    """Check a latent site: Normal, MultivariateNormal or LowRankMultivariateNormal
    (set through its ``scale_tril``, a K x K factor), local to each datapoint."""
    base, _ = unwrap(site["fn"])
    if affine_normal(base) is not None:
        # TransformedDistribution(Normal, [AffineTransform]): a Normal
        check_local_latent(tokens, site, NotLinearGaussianError)
        return "normal"
    if not isinstance(base, (dist.Normal, dist.MultivariateNormal, dist.LowRankMultivariateNormal)):
        # quadrature integrates continuous latents only: a discrete one goes to the enumeration
        instead = (
            "conditionals='enumerate' (it sums discrete latents, beside Normal ones where each of their "
            "values leaves a linear-Gaussian model) or 'importance'"
            if site["fn"].support.is_discrete else "conditionals='quadrature' (low-dimensional latents) or 'importance'"
        )
        raise NotLinearGaussianError(
            f"conditionals='gaussian' needs Normal, MultivariateNormal or LowRankMultivariateNormal latents; "
            f"latent site {site['name']!r} is {type(base).__name__}. Use {instead}."
        )
    check_local_latent(tokens, site, NotLinearGaussianError)
    return "normal" if isinstance(base, dist.Normal) else "mvn"


def _observation_parts(fn, tokens):
    """Location, noise as (cov_factor, cov_diag) or dense covariance, and batch shape of the obs site.

    Location and noise come in token layout, ``(*batch_shape, D, ...)``, with the
    token-plate dims of ``fn.batch_shape`` flattened into ``D``.
    """
    name = tokens.name
    base, _ = unwrap(fn, masks=True)
    if affine_normal(base) is not None:
        # TransformedDistribution(Normal, [AffineTransform]): a Normal
        base = affine_normal(base)
    if is_block_gaussian(base, fn, tokens):
        # several independent blocks of tokens, or a GaussianHMM: moments built there
        return block_diagonal_parts(base, fn, tokens)
    if isinstance(base, dist.LowRankMultivariateNormal):
        return base.loc, ("lowrank", base.cov_factor, base.cov_diag), fn.batch_shape
    if isinstance(base, dist.MultivariateNormal):
        if "covariance_matrix" in vars(base):
            # the model's own matrix, as given: the float32 Cholesky factor torch made of it
            # has already lost a small noise (a GP's K + 1e-6 I, D = 30: T T^T's log p 55000
            # nats off K's), which no wider dtype brings back
            return base.loc, ("dense", base.covariance_matrix), fn.batch_shape
        # the factor, not its product, where the model gave one (scale_tril, or a precision):
        # a wider dtype multiplies it again where float32's rounding of T T^T would lose a small noise
        return base.loc, ("tril", base.scale_tril), fn.batch_shape
    if isinstance(base, dist.Normal):
        shape = fn.batch_shape + fn.event_shape
        loc = tokens.to_tokens(base.loc.expand(shape))
        scale = tokens.to_tokens(base.scale.expand(shape))
        return loc, ("diag", scale), loc.shape[:-1]
    raise NotLinearGaussianError(
        f"conditionals='gaussian' needs a Gaussian observed site; {name!r} is "
        f"{type(base).__name__}. Use conditionals='quadrature' (low-dimensional "
        f"latents) or 'importance'."
    )


def gaussian_marginal(tokens, model, args, kwargs, vectorize=True, memory=None, colors=None):
    """Derive the Gaussian marginal of the observed tokens from a Pyro model.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: from :func:`~pyro_mpt.observed_tokens.trace_tokens`.
    :param callable model: the Pyro model.
    :param tuple args: model arguments.
    :param dict kwargs: model keyword arguments.
    :param bool vectorize: run the :math:`K + 4` noise points in one vectorized
        plate (the model must broadcast over an extra batch dim on the left);
        with False the model is run once per point.
    :param ~pyro_mpt.conditionals.plate_runs.RunMemory memory: kept across
        calls (by :class:`~pyro_mpt.conditionals.GaussianConditionals`): the
        entry of :data:`RUN_MODES` that worked for the model, tried first next
        time (:func:`~pyro_mpt.conditionals.plate_runs.run_with_fallback`), so
        that a model that does not broadcast is not run in the failing modes at
        every step.
    :param colors: None, or the colouring of a known sparse loading
        (:class:`~pyro_mpt.conditionals.gaussian_groups.LoadingColors`): the model is
        run at :math:`L + 4` points instead of :math:`K + 4`, point :math:`l` the sum
        of the unit noises of colour :math:`l` (no token loads on two latents of one
        colour), and the returned ``cov_factor`` ``(1, D, L)`` holds in column
        :math:`l` each token's loading on its latent of colour :math:`l`; the
        probes check the loading the colouring implies.
    :returns: the marginal, with leading dim ``n``, or 1 when shared by the batch.
    :rtype: GaussianMarginal
    :raises NotLinearGaussianError: naming the site, when the model is not
        linear-Gaussian.

    Example::

        >>> tokens = trace_tokens(ppca, None, (x,), {})
        >>> gaussian_marginal(tokens, ppca, (x,), {}).dense()  # covariance, (n|1, D, D)
    """
    layout, K = latent_layout(tokens, lambda site: _latent_kind(tokens, site))
    if K == 0:
        fn = tokens.site["fn"]
        loc, noise, batch_shape = _observation_parts(fn, tokens)
        loc, noise = basis_rows(loc, noise, batch_shape, 1)
        return _assemble(loc[0], tuple(t[0] for t in noise[1:]), noise[0], None, tokens.value.dtype)

    value = tokens.value
    # a fixed generator: the affinity check must not consume the user's random stream
    probes, gen = fixed_probes(K, value.dtype, value.device)
    # one point a latent, or one a colour of a sparse loading (random intercepts: one for
    # every group, 5 model runs a step instead of G + 4)
    head = torch.eye(K, dtype=value.dtype, device=value.device) if colors is None else colors.basis(K, value)
    L = head.shape[0]
    basis = torch.cat([torch.zeros(1, K, dtype=value.dtype, device=value.device), head, probes], 0)
    P = basis.shape[0]
    replay = tokens.subsample_trace()
    mpn = tokens.max_plate_nesting

    def run(handler, size):
        # without validation: the trace of the data checked these distributions'
        # arguments already, here they are broadcast to P = K + 4 times their size
        trace = run_in_plate(model, args, kwargs, name="_mpt_basis", size=size, dim=mpn + 1,
                             replay=replay, inside=handler, validation=False)
        return trace.nodes[tokens.name]["fn"], handler.scales

    def vectorized(compact):
        handler = CoordinateLatents(layout, basis[:, None], mpn + 1, compact=compact)
        fn, scales = run(handler, P)
        if not reaches_points(fn, mpn + 1):
            # a model that moved the points' dim (z.reshape(n, K) with n = P: a
            # zero loading, 16.6 nats off at n = 4, K = 2): the next mode fails
            # on such a reshape or runs point by point
            raise _LayoutDeclined()
        check_probes("compact" if compact else "full", compact)
        loc, noise, batch_shape = _observation_parts(fn, tokens)
        _check_run_rows(batch_shape, tokens)
        for name, scale in scales.items():
            _check_scale_rows(name, scale)
        return basis_rows(loc, noise, batch_shape[1:], P)

    n = value.shape[0]

    def check_probes(mode, compact):
        # once per model and mode: the run at two probe points, each datapoint at its own
        # coordinates, against runs at each point alone. The points shared by the batch
        # cannot tell a model that moves the datapoints elsewhere where the sizes agree
        # (torch.stack([z1, z2], 1) with as many datapoints as latents transposes them): its
        # loading came out transposed, and Evidence refused a linear model as "affine near
        # the prior but not where the data put the posterior"
        detail = (mode, tuple(value.shape), K)
        if n == 1 or _PROBES_PASSED.passed(model, detail):
            return
        u = probe_coordinates(n, K, value.dtype, value.device)
        try:
            with torch.no_grad():
                fn, _ = run(CoordinateLatents(layout, u, mpn + 1, tokens.batch_shape, compact=compact), 2)
                loc = _observation_parts(fn, tokens)[0]
                together = loc.reshape((2, -1, loc.shape[-1]))
                alone = per_point(list(u))[0]
                agree = together.shape[1] in (1, n) and agrees_with_point_run(*torch.broadcast_tensors(together, alone))
        except Exception:  # noqa: BLE001 -- points per datapoint the model cannot take (latents shared by the batch) cannot tell
            agree = True
        if not agree:
            raise _LayoutDeclined(
                "its observation at points that differ by datapoint differs from runs at each point "
                "alone (e.g. torch.stack(..., 1) or z[:, None] where dim=-1 or z[..., None] keeps the left dims)"
            )
        _PROBES_PASSED.add(model, detail)

    def by_rows(vectorized):
        # three points, each datapoint at its own coordinates: 0, e_i for the
        # first K datapoints, and a probe each. A location that varies
        # by datapoint (covariates, a prior mean per datapoint) with a shared
        # loading then costs 3 n D instead of (K + 4) n D (and as much again
        # in the backward pass): 50 times the exact log-density at K=50, D=200;
        # a model that does not broadcast is run 3 times instead of K + 4.
        # The probes are 3 s_i with random signs, consecutive datapoints taking
        # opposite ones: as the K + 4 points, they reach +-3 in every coordinate
        u = torch.zeros(3, n, K, dtype=value.dtype, device=value.device)
        u[1, :K] = torch.eye(K, dtype=value.dtype, device=value.device)
        u[2] = alternating_signs(n, K, gen, value.dtype, value.device)
        loc, noise = at_rows(u, vectorized)
        if loc.shape[1] != n or not all(rows_equal(t) for t in noise[1:]):
            raise _RowsDeclined()
        mu = loc[0]
        W = loc[1, :K] - mu[:K]  # (K, D)
        with torch.no_grad():
            # exact to the rounding of K-term sums when the loading is shared
            # and the location affine; anything else takes the K + 4 points
            size = mu.abs() + u[2].abs() @ W.abs() + loc[2].abs()
            if not bool(((loc[2] - mu - u[2] @ W).abs() <= 4 * (K + 2) * torch.finfo(W.dtype).eps * size).all()):
                raise _RowsDeclined()
        return mu, W[:, None], noise

    def at_rows(u, vectorized):
        # the model at P points, each datapoint at its own coordinates u (P, n, K)
        if not vectorized:
            return per_point(list(u))
        handler = CoordinateLatents(layout, u, mpn + 1, tokens.batch_shape, compact=True)
        fn, scales = run(handler, u.shape[0])
        loc, noise, batch_shape = _observation_parts(fn, tokens)
        _check_run_rows(batch_shape, tokens)
        for name, scale in scales.items():
            _check_scale_rows(name, scale)
        return basis_rows(loc, noise, batch_shape[1:], u.shape[0])

    def at_points(loc_noise):
        loc, noise = loc_noise
        mu = loc[0]
        W = shared_loading(loc[1 : L + 1], mu)  # (L, n|1, D)
        _check_affine(loc[L + 1 :], mu, W, probes, tokens.name, colors)
        return mu, W, noise

    def per_point(points):
        locs, noises, all_scales = [], [], []
        for u_b in points:
            handler = CoordinateLatents(layout, u_b, None, tokens.batch_shape, compact=False)
            fn, scales = run(handler, None)
            loc_b, noise_b, batch_shape = _observation_parts(fn, tokens)
            loc_b, noise_b = basis_rows(loc_b, noise_b, batch_shape, 1)
            locs.append(loc_b)
            noises.append(noise_b)
            all_scales.append(scales)
        loc = torch.cat(common_rows(*locs, dim=1), 0)
        noise = (noises[0][0],) + tuple(
            torch.cat(common_rows(*[nz[i] for nz in noises], dim=1), 0)
            for i in range(1, len(noises[0]))
        )
        for name in layout:
            stacked = torch.stack(torch.broadcast_tensors(*[s[name] for s in all_scales]))
            _check_scale_rows(name, stacked)
        return loc, noise

    runs = {
        "rows": lambda: by_rows(True),
        "compact": lambda: at_points(vectorized(True)),
        "full": lambda: at_points(vectorized(False)),
        "rows_per_point": lambda: by_rows(False),
        "per_point": lambda: at_points(per_point([basis[b : b + 1] for b in range(P)])),
    }
    # e.g. a model that does not broadcast shared latents, or not over an extra
    # batch dim on the left: the next mode asks less of it. The "rows" modes
    # are tried once "compact" found a location that varies by datapoint, or
    # "per_point" a model that does not broadcast, with a shared loading
    modes = RUN_MODES if vectorize else ("per_point",)
    known = None if memory is None or colors is not None else memory.recall(model)
    if known == "rows" and vectorize:
        modes = ("rows",) + modes
    elif known == "rows_per_point":
        modes = ("rows_per_point", "per_point")
    def before_per_point(mode, error):
        # the next mode runs the model once per noise point, K + 4 runs a step: silent, it
        # made Evidence of a random-intercept model written with a[grp] (1000 groups)
        # 1.5 times the cost of a[..., grp] with no word why; the memory keeps the mode,
        # so this is said once per model
        if mode == "full" and P >= MIN_WARNED_POINTS:
            detail = str(error).splitlines()[0] if str(error) else "its observation did not keep the points' dim"
            warnings.warn(
                f"conditionals='gaussian': the model failed when run at its {P} noise points "
                f"(K + 4, K = {K} latent dims) at once in a pyro.plate at dim {-(mpn + 1)} "
                f"({type(error).__name__}: {detail}); running it "
                f"once per point instead ({P} model runs a step, which is much slower). Write the model "
                f"so that it broadcasts over extra batch dims on the left ('...' indexing such as "
                f"a[..., idx] instead of a[idx], torch.matmul, .expand) to run it vectorized.",
                SlowEngineWarning,
                stacklevel=user_stacklevel(),
            )

    mode, (mu, W, noise) = run_with_fallback(
        modes, lambda mode: runs[mode](), memory=memory, fn=model, passes=(NotLinearGaussianError,),
        on_fallback=before_per_point,
    )
    if memory is not None and mode in ("compact", "per_point") and mu.shape[0] > K > 1 and W.shape[1] == 1:
        memory.remember(model, "rows" if mode == "compact" else "rows_per_point")

    for t in noise[1:]:
        if not rows_equal(t):
            raise NotLinearGaussianError(
                f"The noise of observed site {tokens.name!r} depends on the latents, "
                f"so its marginal is not Gaussian; use conditionals='quadrature' or "
                f"'importance'."
            )
    checked = _posterior_fingerprint(value, mu, W) if colors is None and is_validation_enabled() else None
    if checked is not None and not _POSTERIOR_PASSED.passed(model, checked):
        # the probes above stay within 3 prior standard deviations; the data may put the
        # posterior far outside them, where a clamp or saturation the probes never reached
        # changes log p(x_i) (a clamp at 3.5 sd: -18.27 for a true -180.5, stderr 0). It
        # costs about two products of the data with the loading, so it runs once per model,
        # data and parameters and, like Pyro's checks, only under validation
        u = _posterior_points(value, tokens.observed, mu, W, noise)
        # vectorized where the derivation's own run was, with the engines' one fallback policy
        modes = ("vectorized", "per_point") if mode in ("rows", "compact", "full") else ("per_point",)
        with torch.no_grad():  # a check: no graph (a first call saved tensors no backward reads)
            _, (loc_u, noise_u) = run_with_fallback(modes, lambda m: at_rows(u, m == "vectorized"))
        _check_affine_at_posterior(loc_u, noise_u, mu, W, noise, u, tokens.name, gen)
        _POSTERIOR_PASSED.add(model, checked)
    return _assemble(mu, tuple(t[0] for t in noise[1:]), noise[0], W.permute(1, 2, 0), value.dtype)


def loading_nonzeros_in_chunks(tokens, model, args, kwargs, max_elements, min_table=0):
    r"""Where the loading of a one-datapoint marginal is nonzero, ``(rows, cols)`` numpy, from
    model runs at the noise points a chunk of latents at a time, without its :math:`D \times K`
    table. The caller derives the whole marginal (:func:`gaussian_marginal`, which says why)
    where the model's vectorized run fails (``rows`` and ``cols`` None) or where this finds
    nothing to look at (None).

    Random intercepts of 4000 groups around a global mean (40000 observations): the whole
    table's first call peaked at 2.2 GB; here each run holds :math:`(c + 1) D` entries,
    :math:`c` latents a run within ``max_elements``. Nothing here checks that the location
    is affine: the colouring found from the pattern is checked at random probes when the
    loading is derived from it
    (:func:`~pyro_mpt.conditionals.gaussian_groups.colored_marginal`).

    :param int max_elements: entries of one run's locations.
    :param int min_table: None where the whole table would hold fewer entries (:math:`DK`).
    :returns: ``(rows, cols, K)``; ``(None, None, K)`` where a run fails; None for no latent,
        several datapoints or a table below ``min_table``.

    Example::

        >>> rows, cols, K = loading_nonzeros_in_chunks(tokens, radon, args, {}, 2**22)
    """
    try:
        layout, K = latent_layout(tokens, lambda site: _latent_kind(tokens, site))
    except EngineNotApplicable:
        return None
    value = tokens.value
    if K == 0 or value.shape[0] != 1:
        return None
    D = value.shape[-1]
    if D * K < min_table:
        return None
    step = max(1, max_elements // max(1, D) - 1)
    replay = tokens.subsample_trace()
    mpn = tokens.max_plate_nesting
    rows, cols = [], []
    with torch.no_grad():
        for start in range(0, K, step):
            stop = min(K, start + step)
            basis = torch.zeros(1 + stop - start, K, dtype=value.dtype, device=value.device)
            basis[1:, start:stop] = torch.eye(stop - start, dtype=value.dtype, device=value.device)
            try:
                handler = CoordinateLatents(layout, basis[:, None], mpn + 1, compact=True)
                trace = run_in_plate(model, args, kwargs, name="_mpt_basis", size=basis.shape[0], dim=mpn + 1,
                                     replay=replay, inside=handler, validation=False)
                fn = trace.nodes[tokens.name]["fn"]
                if not reaches_points(fn, mpn + 1):
                    return None, None, K
                loc, noise, batch_shape = _observation_parts(fn, tokens)
                loc, _ = basis_rows(loc, noise, batch_shape[1:], basis.shape[0])
            except Exception:  # any failure: the whole marginal's runs, with their fallbacks and messages
                return None, None, K
            if loc.shape[1] != 1:
                return None, None, K
            latent, token = (loc[1:, 0] != loc[0, 0]).nonzero(as_tuple=True)
            rows.append(token)
            cols.append(latent + start)
    return torch.cat(rows).cpu().numpy(), torch.cat(cols).cpu().numpy(), K


def _assemble(mu, noise, kind, W, data_dtype):
    """Marginal from location, observation noise and the latent loading ``W``, in the wider
    of their dtype and the data's ``data_dtype``."""
    # float32 parameters (torch's default) with float64 data: Pyro's log-densities promote
    # to float64, and so does the marginal, which the engines then meet with the data
    dtype = torch.promote_types(mu.dtype, data_dtype)
    mu, W = mu.to(dtype), None if W is None else W.to(dtype)
    noise = tuple(t.to(dtype) for t in noise)
    # the covariance's pieces share a row count of their own, not the
    # location's: a location that varies by datapoint (covariates) leaves a
    # covariance shared by the batch at one row, which the engine factors once
    if kind == "diag":
        if W is None:
            return GaussianMarginal(mu, cov_diag=noise[0] ** 2)
        var, W = common_rows(noise[0] ** 2, W)
        return GaussianMarginal(mu, cov_factor=W, cov_diag=var)
    if kind == "lowrank":
        F, psi = noise
        factors = [F] if W is None else [W, F]
        psi, *factors = common_rows(psi, *factors)
        return GaussianMarginal(mu, cov_factor=torch.cat(factors, -1), cov_diag=psi)
    (cov,) = noise
    parts = ("cov", cov)
    if kind == "tril":
        parts = ("tril", cov)
        cov = cov @ cov.transpose(-1, -2)
    var = diagonal_variances(cov)
    if var is not None:
        if W is None:
            return GaussianMarginal(mu, cov_diag=var)
        var, W = common_rows(var, W)
        return GaussianMarginal(mu, cov_factor=W, cov_diag=var)
    if W is not None:
        cov, W = common_rows(cov, W)
        return GaussianMarginal(mu, covariance=cov + W @ W.transpose(-1, -2), parts=parts + (W,))
    return GaussianMarginal(mu, covariance=cov, parts=parts + (None,) if kind == "tril" else None)


def _check_scale_rows(name, scale):
    if scale.dim() > 0 and not rows_equal(scale):
        raise NotLinearGaussianError(
            f"The scale of latent site {name!r} depends on other latents, so the "
            f"model is not linear-Gaussian; use conditionals='quadrature' or "
            f"'importance'."
        )


#: the posterior checks that passed, per model: the last few fingerprints of each (a training
#: step that moves the parameters makes a new one)
_POSTERIOR_PASSED = PassedChecks(keep=8)

#: the probe checks of vectorized runs that passed, per model: ``(mode, data shape, K)``
_PROBES_PASSED = PassedChecks(keep=8)


def _posterior_fingerprint(x, mu, W):
    """What the posterior check passes for, beside the model: fingerprints of the data and
    of the derived location and loading (shapes, a sum and a sum weighted by position), so
    that other data -- a permutation of the same values too -- or parameters moved by a
    training step are checked again. About a dozen small kernels and one pass over the data."""
    with torch.no_grad():
        x2 = x.detach().reshape(x.shape[0], -1)
        n, D = x2.shape
        rows = torch.arange(1, n + 1, dtype=x2.dtype, device=x2.device)
        cols = torch.arange(1, D + 1, dtype=x2.dtype, device=x2.device)
        params = torch.cat([mu.detach().reshape(-1), W.detach().reshape(-1).to(mu.dtype)])
        at = torch.arange(1, params.numel() + 1, dtype=params.dtype, device=params.device)
        values = torch.stack([x2.sum().double(), ((x2 @ cols) @ rows).double(),
                              params.sum().double(), (params @ at).double()]).tolist()
    return (tuple(x.shape), tuple(mu.shape), tuple(W.shape), x.dtype, tuple(values))


def _noise_variances(kind, parts):
    """The observation noise's variance per token, ``(n|1, D)``, from its parts."""
    if kind == "diag":
        return parts[0] ** 2
    if kind == "lowrank":
        F, psi = parts
        return psi + F.pow(2).sum(-1)
    if kind == "tril":
        return parts[0].pow(2).sum(-1)
    return parts[0].diagonal(dim1=-2, dim2=-1)


def _posterior_points(x, observed, mu, W, noise):
    r"""One point per datapoint where the derived linear-Gaussian model puts its
    posterior over the latent noises, ``(1, n, K)``: the posterior mean
    :math:`\hat\varepsilon_i` at even datapoints, :math:`\hat\varepsilon_i +
    3\sigma_i \odot s_i` at odd ones (:math:`\sigma_i` the posterior standard
    deviations, :math:`s_i` signs in a checkerboard over datapoints and dims): one more
    run of the model (a model that does not broadcast is run once per point).

    The noise is taken as diagonal (its variances) and the posterior precision as that of
    a datapoint with every token observed: the points only need to lie where the
    posterior is, not at its exact mean; a missing token adds no residual, a datapoint
    whose tokens are not finite (data checks off) is probed at 0.
    """
    with torch.no_grad():
        kind, parts = noise[0], tuple(t[0] for t in noise[1:])
        K, n = W.shape[0], x.shape[0]
        dtype = torch.promote_types(mu.dtype, x.dtype)
        Wt = W.permute(1, 2, 0).to(dtype)  # (n|1, D, K)
        prec = 1.0 / _noise_variances(kind, tuple(t.to(dtype) for t in parts)).clamp_min(torch.finfo(dtype).tiny)
        r = (x.to(dtype) - mu.to(dtype)) * prec
        if observed is not None:
            r = r * observed.to(dtype)
        Lam = torch.eye(K, dtype=dtype, device=x.device) + Wt.transpose(-1, -2) @ (prec.unsqueeze(-1) * Wt)
        # a K x K inverse: no factorization that the engine's own (cached) ones are counted with
        cov, info = torch.linalg.inv_ex(Lam)
        if bool(info.any()):
            return torch.zeros(1, n, K, dtype=x.dtype, device=x.device)
        if Wt.shape[0] == 1:  # a loading shared by the batch: two matrix products, not n small ones
            mean = (r @ Wt[0]) @ cov[0]
        else:
            mean = (cov @ (Wt.transpose(-1, -2) @ r.unsqueeze(-1))).squeeze(-1).expand(n, K)
        sd = cov.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt().expand(n, K)
        # +-3 posterior sds at odd datapoints, the signs a checkerboard over (datapoint, dim)
        i = torch.arange(n, device=x.device).unsqueeze(-1)
        k = torch.arange(K, device=x.device)
        shift = (i % 2) * (1 - 2 * ((i // 2 + k) % 2))
        u = mean + PROBE_REACH * sd * shift.to(dtype)
        u = torch.where(torch.isfinite(u), u, torch.zeros((), dtype=dtype, device=x.device))
        return u.unsqueeze(0).to(x.dtype)


def _check_affine_at_posterior(loc_u, noise_u, mu, W, noise, u, name, generator):
    r"""Refuse a location that is not ``mu + W u`` at the posterior points ``u`` (1, n, K),
    or a noise that differs there.

    The locations are compared along a random direction :math:`v` (two matrix-vector
    products instead of the :math:`nDK` product :math:`Wu`): a location off the affine
    one by :math:`e_i` passes only where :math:`e_i \cdot v` rounds to zero.
    """
    with torch.no_grad():
        if loc_u.shape[1] != u.shape[1]:  # rows the run could not tell apart: nothing to check
            return
        dtype = loc_u.dtype
        v = torch.randn(mu.shape[-1], generator=generator, dtype=dtype, device=generator.device).to(mu.device)
        Wv = W.to(dtype) @ v  # (K, n|1)
        pred = mu.to(dtype) @ v + (u.to(dtype) * Wv.T).sum(-1)  # (1, n)
        err = (loc_u @ v - pred).abs().amax()
        size = (mu.abs().amax() + W.abs().amax() * u.abs().sum(-1).amax() + 1.0) * v.abs().sum()
        err, size, reach = torch.stack([err, size.to(dtype), u.abs().amax().to(dtype)]).tolist()
        rtol = torch.finfo(mu.dtype).eps ** 0.5
        noise_same = all(
            bool(((a[0] - b[0]).abs() <= rtol * b[0].abs()).all()) for a, b in zip(noise_u[1:], noise[1:])
        )
    tol = torch.finfo(mu.dtype).eps ** 0.5 * size
    if not err <= tol:
        raise NotLinearGaussianError(
            f"The location of observed site {name!r} is affine in the latents near their prior "
            f"(within {PROBE_REACH:g} prior standard deviations) but not where the data put the "
            f"posterior (off by {err:.3g} at latent noises up to {reach:.3g} prior standard "
            f"deviations, e.g. a clamp or a saturation there), so the model is not "
            f"linear-Gaussian; use conditionals='quadrature' (low-dimensional latents) or "
            f"'importance'."
        )
    if not noise_same:
        raise NotLinearGaussianError(
            f"The noise of observed site {name!r} depends on the latents where the data put "
            f"the posterior, so its marginal is not Gaussian; use conditionals='quadrature' or "
            f"'importance'."
        )


def _check_affine(loc_p, mu, W, probes, name, colors=None):
    # outside autograd, and one host sync for the error and its scale
    with torch.no_grad():
        if colors is None:
            pred = mu + (probes.to(W.dtype) @ W.reshape(W.shape[0], -1)).view((-1,) + W.shape[1:])
            eps_sum = probes.abs().sum(-1).amax()
        else:
            pred, eps_sum = colors.predict(mu, W, probes.to(W.dtype))
        mu_max, W_max, eps_sum, err = torch.stack(
            [mu.abs().amax(), W.abs().amax(), eps_sum, (loc_p - pred).abs().amax()]
        ).tolist()
    tol = torch.finfo(mu.dtype).eps ** 0.5 * (mu_max + W_max * eps_sum + 1.0)
    if not err <= tol:
        raise NotLinearGaussianError(
            f"The location of observed site {name!r} is not affine in the latents "
            f"(off by {err:.3g} at a random point), so the model is not "
            f"linear-Gaussian; use conditionals='quadrature' (low-dimensional "
            f"latents) or 'importance'."
        )
