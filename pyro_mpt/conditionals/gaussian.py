r"""Closed-form conditionals of Gaussian-marginal models.

For :math:`x \sim \mathcal N(\mu, \Sigma)` and a context set :math:`\mathcal R`,

.. math::

    p(x_j \mid x_{\mathcal R}) = \mathcal N\big(x_j;\;
        \mu_j + \Sigma_{j\mathcal R}\Sigma_{\mathcal R\mathcal R}^{-1}
        (x_{\mathcal R} - \mu_{\mathcal R}),\;
        \Sigma_{jj} - \Sigma_{j\mathcal R}\Sigma_{\mathcal R\mathcal R}^{-1}
        \Sigma_{\mathcal R j}\big).

Two paths, batched over queries and datapoints with no Python loop over masks,
tokens or datapoints (only over memory chunks):

* **low-rank** (Woodbury), for :math:`\Sigma = F F^\top + \operatorname{diag}(\psi)`
  with :math:`F \in \mathbb R^{D\times R}`: the context defines the latent
  posterior precision :math:`\Lambda_{\mathcal R} = I + F_{\mathcal R}^\top
  \Psi_{\mathcal R}^{-1} F_{\mathcal R}` and
  :math:`\eta_{\mathcal R} = F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}(x_{\mathcal R}
  - \mu_{\mathcal R})`, so that
  :math:`\mathbb E[x_j\mid x_{\mathcal R}] = \mu_j + f_j^\top\Lambda^{-1}\eta` and
  :math:`\operatorname{Var} = \psi_j + f_j^\top \Lambda^{-1} f_j`. A mask costs
  :math:`O(DR^2 + R^3)` and each target token :math:`O(R^2)`, instead of the
  :math:`O(|\mathcal R|^3)` of inverting :math:`\Sigma_{\mathcal R\mathcal R}`.
* **dense**, for a full :math:`\Sigma`: the context block is embedded in a
  :math:`D\times D` matrix (identity on masked tokens) and factorized once per
  query.

For complete orderings (the ``"order"`` schedule) both paths have a sequential
form: the contexts are nested, so the low-rank path accumulates
:math:`\Lambda_t` and :math:`\eta_t` with a reverse cumulative sum over positions
(:math:`O(DR^3)` per ordering plus :math:`O(nDR)` for the data), and the dense
path reads every conditional off one Cholesky factor of the permuted covariance.
"""

import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from .base import ConditionalEngine, NumericalWarning
from .distributions import take_rows
from .gaussian_blocks import BlockGaussianState, block_marginal
from .plate_runs import RunMemory
from .gaussian_marginal import GaussianMarginal, gaussian_marginal

__all__ = ["GaussianConditionals", "GaussianMemory"]

_LOG_2PI = math.log(2 * math.pi)


def _normal_log_prob(x, mean, var):
    return -0.5 * (_LOG_2PI + var.log() + (x - mean) ** 2 / var)


class _NotPositiveDefinite(ValueError):
    """A Cholesky factorization failed; :meth:`GaussianConditionals._rescued` catches it."""


def _cholesky(A, what, site=None):
    """Cholesky factor of ``A``; raises :class:`_NotPositiveDefinite` when it fails
    or when a pivot :math:`L_{kk}^2` falls below ``10 eps`` times its diagonal
    entry: rounding errors in a pivot are of order ``eps`` times the diagonal,
    so such a pivot (and the log-determinant and solves built on it) has lost
    all its digits even where the factorization happens to succeed."""
    L, info = torch.linalg.cholesky_ex(A)
    with torch.no_grad():
        pivots = torch.diagonal(L, dim1=-2, dim2=-1).pow(2)
        diag = torch.diagonal(A, dim1=-2, dim2=-1)
        # one host sync for both checks (the pivots of a failed factor are junk, but then info says so)
        bad = bool(((info != 0) | (pivots < 10 * torch.finfo(A.dtype).eps * diag).any(-1)).any())
    if bad:
        where = "" if site is None else f" of site {site!r}"
        raise _NotPositiveDefinite(
            f"The {what}{where} is not positive definite to working precision (its "
            f"Cholesky factorization failed or lost all digits)"
        )
    return L


def _first_jitter(dtype):
    """The first relative jitter of the rescue: 1e-8 in float64, 1e-5 in float32
    (a power of ten well above the ``10 eps`` pivot floor of :func:`_cholesky`,
    so that the blocks of the jittered covariance clear it too)."""
    return 10.0 ** math.ceil(math.log10(max(1e-8, 50 * torch.finfo(dtype).eps)))


#: up to this rank, masks shared by the batch are evaluated by products with the
#: whole residual table (memory-bound gathers cost more than the extra products)
_EMBEDDED_MAX_RANK = 8

#: elements of a block's gathered tables (masks x data x tokens) below which its
#: masks are evaluated in one group however different their sizes
_SMALL_TABLE = 2**20

#: the rounding error, relative to the quantities summed into a log-density, up to
#: which a path computes in the data's dtype; beyond it the engine widens the dtype
#: (float32 -> float64) or, when float64 is not enough either, changes path
_PRECISION = 1e-3


def _lowrank_dtype(F, psi, dtypes=None):
    r"""The first of ``dtypes`` (default: ``F``'s dtype, then float64) in which the
    low-rank pieces of :math:`\Sigma = FF^\top + \Psi` are accurate; None when
    none is (or :math:`\Psi` has zeros).

    With :math:`\kappa = \max_i \operatorname{tr}(F^\top\Psi^{-1}F)`, the
    largest total signal-to-noise ratio over the datapoints, a context
    precision :math:`I + F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}`
    is formed with rounding errors up to :math:`\epsilon\kappa`. When the
    loading is rank-deficient (two equal columns) or a context is smaller than
    the rank, that matrix has eigenvalues near 1, and errors of
    :math:`\epsilon\kappa` change them, and log p, by about as much:
    :math:`\epsilon\kappa` must stay below ``_PRECISION``. With one column
    (:math:`R = 1`) the precision is a scalar :math:`1 + g^2` that no rounding
    cancels, and the bound is that of the centred residual
    :math:`e^2/\psi`, :math:`\epsilon^2\kappa`.
    """
    if dtypes is None:
        dtypes = tuple(dict.fromkeys((F.dtype, torch.float64)))
    with torch.no_grad():
        psi = psi.double()
        ratio = F.double().pow(2).sum(-1) / psi.clamp_min(torch.finfo(torch.float64).tiny)
        kappa = float(torch.where(psi > 0, ratio, math.inf).sum(-1).max())
    power = 2 if F.shape[-1] == 1 else 1
    for dtype in dtypes:
        if torch.finfo(dtype).eps ** power * kappa <= _PRECISION:
            return dtype
    return None


def _dense_dtype(cov):
    r"""``cov``'s dtype when Cholesky solves with it are accurate in that dtype, else float64.

    Solves with a Cholesky factor of :math:`\Sigma` carry relative errors of about
    ``eps`` times the condition number of the diagonally scaled
    :math:`S^{-1/2}\Sigma S^{-1/2}` (:math:`S` the diagonal of :math:`\Sigma`),
    and so do the Mahalanobis terms of log p. That condition number is estimated
    as :math:`D / \lambda_{\min}` (:math:`D` bounds the largest eigenvalue, the
    trace), with :math:`\lambda_{\min}` from a few steps of inverse iteration on
    the factor; it must stay below ``_PRECISION / eps``.
    """
    if cov.dtype == torch.float64:
        return cov.dtype
    with torch.no_grad():
        d = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(torch.finfo(cov.dtype).tiny).sqrt()
        L, info = torch.linalg.cholesky_ex(cov / (d.unsqueeze(-1) * d.unsqueeze(-2)))
        if bool((info != 0).any()):
            return torch.float64
        D = cov.shape[-1]
        # a start with a component along every eigenvector, unlike a constant one could miss
        v = torch.linspace(1.0, 2.0, D, dtype=cov.dtype, device=cov.device).expand(L.shape[:-1]).unsqueeze(-1)
        for _ in range(8):
            v = torch.cholesky_solve(v, L)
            v = v / v.norm(dim=-2, keepdim=True)
        lam_min = 1.0 / torch.cholesky_solve(v, L).norm(dim=-2)
        bad = bool((~(torch.finfo(cov.dtype).eps * D / lam_min <= _PRECISION)).any())
    return torch.float64 if bad else cov.dtype


def _to_work(state, x):
    """The data in the dtype the state computes in."""
    return x if state.data_dtype is None else x.to(state.loc.dtype)


def _to_data(state, out):
    """A result back in the data's dtype."""
    return out if state.data_dtype is None else out.to(state.data_dtype)


@dataclass
class GaussianMemory:
    """All that a :class:`GaussianConditionals` engine remembers across calls.

    :param ~pyro_mpt.conditionals.plate_runs.RunMemory run_mode: which entry
        of :data:`~pyro_mpt.conditionals.gaussian_marginal.RUN_MODES` ran the
        model at the noise points; tried first at the next call, so that a
        model that does not broadcast is not run in the failing modes at every
        step.
    :param dict jitter: the relative jitter the Cholesky rescue reached, per
        ``(observed site, dtype)``; later calls start from it and warn only
        when it grows.
    """

    run_mode: RunMemory = field(default_factory=RunMemory)
    jitter: dict = field(default_factory=dict)


class GaussianConditionals(ConditionalEngine):
    r"""Exact masked conditionals of linear-Gaussian and Gaussian models.

    Serves models whose tokens have a Gaussian marginal
    (:func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal` derives
    it from the Pyro model): observed ``MultivariateNormal``,
    ``LowRankMultivariateNormal`` or ``Normal(...).to_event`` without latents
    (also as independent blocks of tokens, e.g. a multi-output GP, see
    :mod:`~pyro_mpt.conditionals.gaussian_blocks`; and ``GaussianHMM``, see
    :mod:`~pyro_mpt.conditionals.linear_dynamical`), and Normal latents with a Normal observation affine in them (PPCA, factor
    analysis, models with covariates).

    Precision: where the data's dtype cannot hold the low-rank pieces (the
    noise is tiny against the loading; see ``_lowrank_dtype``) or the
    dense covariance (its scaled condition number exceeds ``1e-3 / eps``), the
    engine computes them in float64 from the parameters (gradients included)
    and returns results in the data's dtype; where float64 cannot hold the
    low-rank pieces either, ``"auto"`` takes the dense path. See
    ``docs/numerics.md``.

    :param str method: ``"auto"`` (low-rank when the marginal has rank below
        D and the low-rank pieces are accurate in float64, else dense),
        ``"lowrank"`` or ``"dense"``.
    :param float jitter: added to the marginal's diagonal; 0 by default.
    :param float max_jitter: when a Cholesky factorization fails (the
        covariance is singular or nearly so), add jitter :math:`10^{-8}`
        (float64; :math:`10^{-5}` in float32) times the covariance's mean
        diagonal to its diagonal and retry, ten times more at each retry up
        to ``max_jitter`` times it, warning
        (:class:`~pyro_mpt.conditionals.base.NumericalWarning`) with the
        amount and its estimated change of log p (``log_prob_change``); 0 disables the rescue. The engine keeps the relative jitter
        it reached per observed site and dtype (:class:`GaussianMemory`): later
        calls (the next training steps) start from it and warn only when it grows.
    :param bool vectorize: derive the marginal with one vectorized model run.
    :param int max_elements: bound on the elements of intermediate tensors.

    Example::

        >>> loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method="dense"))
    """

    def __init__(self, method="auto", *, jitter=0.0, max_jitter=1e-4, vectorize=True, max_elements=2**24):
        super().__init__(max_elements=max_elements)
        if method not in ("auto", "lowrank", "dense"):
            raise ValueError(
                f"GaussianConditionals(method={method!r}): use 'auto', 'lowrank' or 'dense'."
            )
        for label, value in (("jitter", jitter), ("max_jitter", max_jitter)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(
                    f"GaussianConditionals({label}={value!r}): give a number >= 0 "
                    f"({'added to the covariance diagonal' if label == 'jitter' else 'relative to the mean diagonal; 0 disables the rescue'})."
                )
        self.method = method
        self.jitter = float(jitter)
        self.max_jitter = float(max_jitter)
        self.vectorize = vectorize
        self.memory = GaussianMemory()
        self._shared_cache = None  # mask-free pieces of the last state and data (see mask_sums)

    def prepare(self, tokens, model, guide, args, kwargs):
        blocks = block_marginal(tokens, GaussianMarginal)
        if blocks is not None:
            # independent blocks of tokens (a multi-output GP): served as n * B datapoints
            marginal, num_blocks = blocks
            return BlockGaussianState(self._prepare_marginal(marginal, tokens.name), num_blocks, tokens.num_data)
        marginal = gaussian_marginal(tokens, model, args, kwargs, vectorize=self.vectorize, memory=self.memory.run_mode)
        return self._prepare_marginal(marginal, tokens.name)

    def _prepare_marginal(self, marginal, site):
        """The state of a marginal: its path, working dtype, jitter and factor."""
        D = marginal.num_tokens
        dense = self.method == "dense" or (
            self.method == "auto" and (not marginal.is_low_rank or marginal.rank >= D)
        )
        data_dtype = marginal.loc.dtype
        if not dense:
            if not marginal.is_low_rank:
                raise ValueError(
                    f"GaussianConditionals(method='lowrank'): the marginal of site "
                    f"{site!r} has a dense covariance; use method='dense' or 'auto'."
                )
            F, psi = marginal.cov_factor, marginal.cov_diag
            if F is None:
                F = psi.new_zeros(psi.shape + (1,))
            if self.jitter:
                psi = psi + self.jitter
            psi_min = float(psi.detach().min())  # one host sync for both checks of psi
            if psi_min < 0:
                raise ValueError(
                    f"The noise variance of site {site!r} has negative entries (min "
                    f"{psi_min:.3g}), so its covariance is not positive definite. "
                    f"Use a positive scale (e.g. a pyro.param with constraint=constraints.positive)."
                )
            # the low-rank pieces must be computable in some dtype: else the dense
            # path, whose own checks say when the covariance itself is singular
            work = _lowrank_dtype(F, psi)
            if work is None and self.method == "auto":
                dense = True
            else:
                # 'lowrank' asked for: the rescue raises the noise, in the widest dtype
                work = torch.float64 if work is None else work
                state = GaussianMarginal(
                    marginal.loc.to(work), cov_factor=F.to(work), cov_diag=psi.to(work), site=site,
                    data_dtype=None if work == data_dtype else data_dtype,
                )
        if dense:
            cov = marginal.dense()
            if self.jitter:
                cov = cov + self.jitter * torch.eye(D, dtype=cov.dtype, device=cov.device)
            work = _dense_dtype(cov)
            if work != cov.dtype and marginal.is_low_rank:
                # rounding F F^T in the data's dtype would already lose the small noise
                F = None if marginal.cov_factor is None else marginal.cov_factor.to(work)
                wide = GaussianMarginal(marginal.loc, cov_factor=F, cov_diag=marginal.cov_diag.to(work))
                cov = wide.dense()
                if self.jitter:
                    cov = cov + self.jitter * torch.eye(D, dtype=cov.dtype, device=cov.device)
            state = GaussianMarginal(
                marginal.loc.to(work), covariance=cov.to(work), site=site,
                data_dtype=None if work == data_dtype else data_dtype,
            )
        rel = self.memory.jitter.get((site, state.loc.dtype))
        if rel is not None:
            # start from the jitter an earlier call reached (it warned then)
            scale = self._mean_diagonal(state)
            if scale > 0 and math.isfinite(scale):
                self._set_jitter(state, rel * scale)
        # factor the whole covariance once, so that a near-singular one is
        # rescued before any query; its principal blocks are no worse conditioned
        self._rescued(state, lambda: self._factor_whole(state))
        return state

    # ------------------------------------------------------------------ jitter rescue
    @staticmethod
    def _factor_whole(state):
        """Factor the state's covariance and keep the factor on the state (with its
        gradient, for the exact log-density). On the low-rank path, a noise
        variance with zeros, or too small against the loading for the state's
        dtype (see ``_lowrank_dtype``), fails like a Cholesky factorization,
        so that the rescue's jitter raises it."""
        if not state.is_low_rank:
            state.factor = _cholesky(state.covariance, "covariance", state.site)
            return
        F, psi = state.cov_factor, state.cov_diag
        zeros = int((psi.detach() <= 0).sum())
        if zeros:
            raise _NotPositiveDefinite(
                f"The covariance of site {state.site!r} is not positive definite (its "
                f"noise variance has {zeros} zero entries)"
            )
        if _lowrank_dtype(F, psi, (state.loc.dtype,)) is None:
            raise _NotPositiveDefinite(
                f"The covariance of site {state.site!r} is not positive definite to "
                f"working precision on the low-rank path (its noise variance is too "
                f"small against the loading: rounding errors swamp the identity in "
                f"I + F^T Psi^-1 F)"
            )
        state.factor = _posterior_precision_factor(F, psi, state.site)

    def _rescued(self, state, compute):
        r"""``compute()``, retried with more jitter on the state's covariance while a
        Cholesky factorization fails.

        The jitter goes into the model's covariance (the state), not into the
        one matrix that failed, so all conditionals keep coming from one joint
        :math:`\mathcal N(\mu, \Sigma + \tau I)`; it grows tenfold per retry
        from :func:`_first_jitter` times the mean diagonal of :math:`\Sigma` up
        to ``max_jitter`` times it, and each increase warns with the total.
        """
        while True:
            try:
                return compute()
            except _NotPositiveDefinite as error:
                self._add_jitter(state, error)

    @staticmethod
    def _mean_diagonal(state):
        """The mean diagonal of the state's covariance without the rescue's jitter."""
        with torch.no_grad():
            if state.is_low_rank:
                diag = state.cov_diag + state.cov_factor.pow(2).sum(-1)
            else:
                diag = torch.diagonal(state.covariance, dim1=-2, dim2=-1)
            return float(diag.mean()) - state.jitter

    @staticmethod
    def _set_jitter(state, tau):
        """Make the rescue's jitter on the state's diagonal ``tau`` in total."""
        delta = tau - state.jitter
        state.factor = None  # the factor of the old covariance
        if state.is_low_rank:
            state.cov_diag = state.cov_diag + delta
        else:
            eye = torch.eye(state.num_tokens, dtype=state.loc.dtype, device=state.loc.device)
            state.covariance = state.covariance + delta * eye
        state.jitter = tau

    def _add_jitter(self, state, error):
        scale = self._mean_diagonal(state)
        dtype = state.loc.dtype
        if state.jitter:
            k = round(math.log10(state.jitter / scale)) + 1
        else:
            k = round(math.log10(_first_jitter(dtype)))
        rel = 10.0**k
        if not (scale > 0 and math.isfinite(scale)) or rel > self.max_jitter * (1 + 1e-9):
            raise ValueError(
                f"{error} even with jitter up to {self.max_jitter:g} x the mean diagonal "
                f"{scale:.3g} of its covariance: the covariance is singular or ill-conditioned. "
                f"Try float64 data and parameters, more observation noise, or "
                f"GaussianConditionals(jitter=...) with a larger value."
            ) from None
        tau = rel * scale
        self._set_jitter(state, tau)
        self.memory.jitter[(state.site, dtype)] = rel
        change = self._log_det_change(state)
        name = str(dtype).replace("torch.", "")
        if state.data_dtype is not None:
            name += f" (computed in {name} for {str(state.data_dtype).replace('torch.', '')} data)"
        warning = NumericalWarning(
            f"GaussianConditionals: the covariance of site {state.site!r} is not positive "
            f"definite in {name} (Cholesky failed: it is singular or nearly so); added "
            f"jitter {tau:.3g} ({rel:.0e} x its mean diagonal {scale:.3g}) to its diagonal, "
            f"which changes log p through its log-determinant by an estimated {change:.3g} "
            f"nats per datapoint. Use float64 data and parameters where they are not "
            f"float64 already, pass GaussianConditionals(jitter=...) to choose the amount, "
            f"or give the model more observation noise.",
            site=state.site,
            jitter=tau,
        )
        warning.log_prob_change = change
        warnings.warn(warning, stacklevel=4)

    @staticmethod
    def _log_det_change(state):
        r"""How much the rescue's jitter :math:`\tau` changes log p per datapoint
        through the log-determinant: :math:`\tfrac12\sum_k\log(1 + \tau/\lambda_k)`
        over the eigenvalues :math:`\lambda_k` of the covariance, the most over the
        datapoints. On the low-rank path the noise variances :math:`\psi_j` stand
        in for the eigenvalues (:math:`FF^\top + \Psi \succeq \Psi`), which makes
        it an upper bound; on the dense path eigenvalues below rounding (``eps``
        times the largest) are taken at that floor, which makes it an estimate
        from below."""
        tau = state.jitter
        with torch.no_grad():
            if state.is_low_rank:
                lam = (state.cov_diag - tau).double()
            else:
                eye = torch.eye(state.num_tokens, dtype=state.loc.dtype, device=state.loc.device)
                lam = torch.linalg.eigvalsh((state.covariance - tau * eye).double())
                lam = lam.clamp_min(torch.finfo(torch.float64).eps * float(lam.abs().max()))
            return float(0.5 * torch.log1p(tau / lam).sum(-1).max())

    def log_evidence(self, state, x, observed=None):
        r"""Exact :math:`\log\mathcal N(x_i; \mu, \Sigma)` per datapoint, ``(n,)``.

        :param torch.Tensor observed: bool ``(n, D)``, True at observed tokens; when
            given, the density of each datapoint's observed sub-vector,
            :math:`\log\mathcal N(x_{O_i}; \mu_{O_i}, \Sigma_{O_i O_i})`.
        """
        if isinstance(state, BlockGaussianState):
            blocks = None if observed is None else state.rows(observed)
            return state.per_datapoint(self.log_evidence(state.inner, state.rows(x), blocks))
        x = _to_work(state, x)
        log_prob = _lowrank_log_prob if state.is_low_rank else _dense_log_prob
        return _to_data(state, self._rescued(state, lambda: log_prob(state, x, observed)))

    # ------------------------------------------------------------------ chunking
    def _run_chunked(self, fn, state, x, index, per_item):
        """Apply ``fn(state, x, index)`` over chunks of queries and datapoints.

        ``per_item`` is the number of elements the largest intermediate needs
        per (query, datapoint) pair; chunks keep ``q * n * per_item`` under
        ``max_elements``. Rows shared by the batch (leading dim 1) are not split.
        """
        q, n = index.shape[0], x.shape[0]
        if q * n * per_item <= self.max_elements:
            return fn(state, x, index)
        n_step = max(1, min(n, self.max_elements // per_item))
        q_step = max(1, self.max_elements // (per_item * n_step))
        out = []
        for qs in range(0, q, q_step):
            idx_q = index[qs : qs + q_step]
            parts = []
            for ns in range(0, n, n_step):
                rows = torch.arange(ns, min(n, ns + n_step), device=x.device)
                idx = idx_q if idx_q.shape[1] == 1 else idx_q[:, rows]
                parts.append(fn(_slice_marginal(state, rows), x[rows], idx))
            out.append(torch.cat(parts, 1))
        return torch.cat(out, 0)

    # ------------------------------------------------------------------ masks
    def mask_log_prob(self, state, x, mask):
        if isinstance(state, BlockGaussianState):
            return state.tokens(self._active_blocks(self.mask_log_prob, state, x, mask, per_token=True))
        x = _to_work(state, x)
        return _to_data(state, self._rescued(state, lambda: self._mask_log_prob(state, x, mask)))

    def _mask_log_prob(self, state, x, mask):
        D = x.shape[-1]
        if state.is_low_rank:
            R = state.cov_factor.shape[-1]
            return self._run_chunked(_lowrank_masks, state, x, mask, D * (R + 2))
        return self._run_chunked(_dense_masks, state, x, mask, D * D)

    def mask_sums(self, state, x, mask):
        if isinstance(state, BlockGaussianState):
            return state.per_datapoint(self._active_blocks(self.mask_sums, state, x, mask, per_token=False))
        x_data, x = x, _to_work(state, x)
        if mask.shape[1] == 1:
            # masks shared by the batch: each mask's factor once, the data by batched
            # matrix products over its gathered targets
            shared = state.cov_factor if state.is_low_rank else state.covariance
            if shared.shape[0] == 1:
                return _to_data(state, self._rescued(state, lambda: self._shared_sums(state, x_data, x, mask[:, 0])))
        if state.is_low_rank and state.cov_factor.shape[0] == 1:
            # masks per datapoint, covariance shared: products over the flattened
            # (q n, D) contexts, in chunks of max_elements
            R = state.cov_factor.shape[-1]
            n, D = x.shape
            q_step = max(1, self.max_elements // max(1, n * (D * 4 + R * R)))
            return _to_data(state, self._rescued(state, lambda: torch.cat(
                [_lowrank_independent_sums(state, x, mask[i : i + q_step]) for i in range(0, mask.shape[0], q_step)]
            )))
        logc = self._rescued(state, lambda: self._mask_log_prob(state, x, mask))
        zero = torch.zeros((), dtype=logc.dtype, device=logc.device)
        return _to_data(state, torch.where(mask, logc, zero).sum(-1))

    @staticmethod
    def _active_blocks(method, state, x, mask, per_token):
        """``method`` (:meth:`mask_log_prob` or :meth:`mask_sums`) on the blocks, asked
        only for the (query, block) pairs that have a target: the others contribute
        nothing (a leave-one-out query has a target in one block of B). Returns
        ``(q, n B, ...)``, zeros for the pairs without a target."""
        xb, mb = state.rows(x), state.rows(mask)  # (n B, N), (q, n B, N)
        q_idx, r_idx = mb.any(-1).nonzero(as_tuple=True)
        tail = mb.shape[-1:] if per_token else ()
        if q_idx.numel() == 0:
            return xb.new_zeros(mb.shape[:2] + tail)
        out = method(_slice_marginal(state.inner, r_idx), xb[r_idx], mb[q_idx, r_idx].unsqueeze(0))[0]
        return out.new_zeros(mb.shape[:2] + tail).index_put((q_idx, r_idx), out)

    def _shared_sums(self, state, x_data, x, mask):
        if not state.is_low_rank:
            return _dense_shared_sums(state, x, mask, self.max_elements)
        # the mask-free pieces once per state and data: a loss evaluation asks
        # for its blocks of masks one by one, all on the same state and data
        cache = self._shared_cache
        key = (state.loc, state.cov_factor, state.cov_diag, state.factor)
        if cache is None or cache[0]() is not state or cache[1]() is not x_data or any(
            a is not b for a, b in zip(cache[2], key)
        ):
            data = _lowrank_shared_data(state, x)
            self._shared_cache = cache = (weakref.ref(state), weakref.ref(x_data), key, data)
        R = state.cov_factor.shape[-1]
        if R <= _EMBEDDED_MAX_RANK:
            n, D = x.shape
            step = max(1, self.max_elements // max(1, (n + D) * (R + 1)))
            return torch.cat([_lowrank_shared_sums_embedded(state, x, mask[i : i + step], cache[3]) for i in range(0, mask.shape[0], step)])
        return _lowrank_shared_sums(state, x, mask, self.max_elements, cache[3])

    def chain_log_prob(self, state, x, order):
        if isinstance(state, BlockGaussianState):
            # each block's chain runs along its own tokens' order in the global ordering
            sub_order = state.orders(order)
            inner = self.chain_log_prob(state.inner, state.rows(x), sub_order)
            return state.chain_by_position(inner, sub_order, order)
        x = _to_work(state, x)
        return _to_data(state, self._rescued(state, lambda: self._chain_log_prob(state, x, order)))

    def _chain_log_prob(self, state, x, order):
        D = x.shape[-1]
        if state.is_low_rank:
            R = state.cov_factor.shape[-1]
            if order.shape[1] == 1 and state.cov_factor.shape[0] == 1:
                return _lowrank_shared_chain(state, x, order, self.max_elements)
            return self._run_chunked(_lowrank_chain, state, x, order, D * R * (R + 2))
        return self._run_chunked(_dense_chain, state, x, order, D * D)

    def chain_sums(self, state, x, order, observed=None):
        r"""Every complete ordering of one Gaussian joint telescopes to
        :math:`\log\mathcal N(x; \mu, \Sigma)` (the chain rule), so the sums are
        the exact log-density, at the cost of one exact evaluation; with
        ``observed`` (missing tokens first in every ordering) the terms of the
        observed targets telescope to the density of the observed sub-vector."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], x.shape[0])


def _slice_marginal(m, idx):
    return GaussianMarginal(
        take_rows(m.loc, idx),
        cov_factor=None if m.cov_factor is None else take_rows(m.cov_factor, idx),
        cov_diag=None if m.cov_diag is None else take_rows(m.cov_diag, idx),
        covariance=None if m.covariance is None else take_rows(m.covariance, idx),
        site=m.site,
        jitter=m.jitter,
        factor=None if m.factor is None else take_rows(m.factor, idx),
        data_dtype=m.data_dtype,
    )


def _posterior_precision_factor(F, psi, site):
    r"""Cholesky factor of :math:`I + F^\top\Psi^{-1}F`, ``(..., R, R)``."""
    eye = torch.eye(F.shape[-1], dtype=F.dtype, device=F.device)
    return _cholesky(eye + F.transpose(-1, -2) @ (F / psi.unsqueeze(-1)), "posterior precision I + F^T Psi^-1 F", site)


def _missing_as_standard_normal(observed, x):
    """``(o, missing_term)``: the observed tokens as 0/1 weights, and the log-density
    ``0.5 log(2 pi)`` per missing token that undoes their stand-in ``N(0; 0, 1)``."""
    o = observed.to(x.dtype)
    return o, 0.5 * _LOG_2PI * (1.0 - o).sum(-1)


class _SharedLowRankLogProb(torch.autograd.Function):
    r""":math:`\log\mathcal N(x_i; \mu, FF^\top + \Psi)` for parameters shared by the
    batch, ``(n,)``, with its gradient in closed form.

    With :math:`\alpha_i = \Sigma^{-1} r_i = \Psi^{-1} e_i` (centred form, see
    :func:`_lowrank_log_prob`) and upstream weights :math:`g_i`,
    :math:`\partial/\partial x_i = -g_i\alpha_i`,
    :math:`\partial/\partial\Sigma = -\tfrac12(G\Sigma^{-1} - \sum_i g_i\alpha_i\alpha_i^\top)`
    (:math:`G = \sum_i g_i`), hence, with :math:`\Sigma^{-1}F = \Psi^{-1}F\Lambda^{-1}`
    and :math:`F^\top\alpha_i = \hat z_i`,
    :math:`\partial/\partial F = \sum_i g_i\alpha_i\hat z_i^\top - G\,\Psi^{-1}F\Lambda^{-1}` and
    :math:`\partial/\partial\psi_j = \tfrac12(\sum_i g_i\alpha_{ij}^2 - G[\Sigma^{-1}]_{jj})`.
    Autograd through the solves would instead keep one :math:`R\times R` gradient per
    datapoint of the shared factor (5 times a bare ``LowRankMultivariateNormal``
    at :math:`R = 50`, :math:`D = 512`); this costs :math:`O(nDR)` like the forward pass.
    """

    @staticmethod
    def forward(ctx, x, loc, F, psi, L, site):
        r = x - loc  # (n, D)
        Fp = F / psi.unsqueeze(-1)  # (D, R)
        if L is None:
            L = _posterior_precision_factor(F, psi, site)
        zhat = torch.cholesky_solve((r @ Fp).T, L).T  # (n, R)
        e = r - zhat @ F.T
        alpha = e / psi
        maha = (e * alpha).sum(-1) + zhat.pow(2).sum(-1)
        logdet = psi.log().sum() + 2 * torch.diagonal(L).log().sum()
        ctx.save_for_backward(alpha, zhat, Fp, psi, L)
        return -0.5 * (x.shape[-1] * _LOG_2PI + logdet + maha)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        alpha, zhat, Fp, psi, L = ctx.saved_tensors
        ga = alpha * g.unsqueeze(-1)  # (n, D)
        G = g.sum()
        dx = dloc = dF = dpsi = None
        if ctx.needs_input_grad[0]:
            dx = -ga
        if ctx.needs_input_grad[1]:
            dloc = ga.sum(0)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            SinvF = torch.cholesky_solve(Fp.T, L).T  # Sigma^-1 F, (D, R)
            if ctx.needs_input_grad[2]:
                dF = ga.T @ zhat - G * SinvF
            if ctx.needs_input_grad[3]:
                diag = 1.0 / psi - (SinvF * Fp).sum(-1)  # diagonal of Sigma^-1
                dpsi = 0.5 * ((ga * alpha).sum(0) - G * diag)
        return dx, dloc, dF, dpsi, None, None


def _lowrank_log_prob(m, x, observed=None):
    r""":math:`\log\mathcal N(x; \mu, FF^\top + \Psi)` per datapoint, ``(n,)``, in centred form.

    With :math:`r = x - \mu`, the posterior mean :math:`\hat z = \Lambda^{-1}
    F^\top\Psi^{-1} r` and :math:`e = r - F\hat z`,
    :math:`r^\top\Sigma^{-1} r = e^\top\Psi^{-1}e + \hat z^\top\hat z` (the
    minimum over :math:`z` of :math:`\lVert r - Fz\rVert^2_{\Psi^{-1}} +
    \lVert z\rVert^2`): a sum of two small non-negative terms, where the
    Woodbury form subtracts two large ones, and stationary in :math:`\hat z`, so
    rounding in :math:`\hat z` does not reach it (100 times more accurate in
    float32 at D = 512).

    With ``observed`` (bool ``(n, D)``), the density of each observed sub-vector:
    a missing token gets :math:`r_j = 0`, :math:`f_j = 0`, :math:`\psi_j = 1`, an
    independent standard normal at its mean, which leaves the observed block
    untouched and adds :math:`\log\mathcal N(0; 0, 1)`, taken off again.
    """
    F, psi = m.cov_factor, m.cov_diag  # (r, D, R), (r, D)
    if observed is None and F.shape[0] == 1 and m.loc.shape[0] == 1:
        L = None if m.factor is None else m.factor.detach()[0]
        return _SharedLowRankLogProb.apply(x, m.loc[0], F[0], psi[0], L, m.site)
    r = x - m.loc  # (n, D)
    L = m.factor
    if observed is not None:
        o, missing = _missing_as_standard_normal(observed, x)
        r = r * o
        F = F * o.unsqueeze(-1)  # (n, D, R)
        psi = torch.where(observed, psi, torch.ones((), dtype=psi.dtype, device=psi.device))
        L = None  # the observed block has its own posterior precision
    if L is None:
        L = _posterior_precision_factor(F, psi, m.site)
    Fp = F / psi.unsqueeze(-1)
    eta = (r.unsqueeze(-2) @ Fp).transpose(-1, -2)  # (n, R, 1)
    zhat = torch.cholesky_solve(eta, L)  # (n, R, 1)
    e = r - (F @ zhat).squeeze(-1)
    maha = (e * e / psi).sum(-1) + zhat.pow(2).sum((-1, -2))
    logdet = psi.log().sum(-1) + 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
    out = -0.5 * (x.shape[-1] * _LOG_2PI + logdet + maha)
    return out if observed is None else out + missing


def _dense_log_prob(m, x, observed=None):
    r""":math:`\log\mathcal N(x; \mu, \Sigma)` per datapoint, ``(n,)``, from a Cholesky
    factor of :math:`\Sigma`; with ``observed`` the density of each observed
    sub-vector (the missing tokens as in :func:`_lowrank_log_prob`)."""
    r = x - m.loc  # (n, D)
    if observed is None:
        L = m.factor if m.factor is not None else _cholesky(m.covariance, "covariance", m.site)
    else:
        o, missing = _missing_as_standard_normal(observed, x)
        r = r * o
        S = m.covariance * (o.unsqueeze(-1) * o.unsqueeze(-2)) + torch.diag_embed(1.0 - o)  # (n, D, D)
        L = _cholesky(S, "covariance", m.site)
    u = torch.linalg.solve_triangular(L, r.unsqueeze(-1), upper=False).squeeze(-1)
    logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
    out = -0.5 * (x.shape[-1] * _LOG_2PI + logdet + u.pow(2).sum(-1))
    return out if observed is None else out + missing


def _lowrank_masks(m, x, mask):
    """Woodbury conditionals for masks ``(q, n|1, D)``; returns ``(q, n, D)``."""
    F, psi = m.cov_factor, m.cov_diag  # (r, D, R), (r, D)
    R = F.shape[-1]
    ctx = (~mask).to(x.dtype)  # (q, m, D)
    cw = ctx / psi  # (q, max(m, r), D)
    FF = (F.unsqueeze(-1) * F.unsqueeze(-2)).reshape(F.shape[:-1] + (R * R,))
    A = (cw.transpose(0, 1) @ FF).transpose(0, 1).reshape(cw.shape[:2] + (R, R))
    A = A + torch.eye(R, dtype=x.dtype, device=x.device)
    resid = x - m.loc  # (n, D)
    eta = ((cw * resid).transpose(0, 1) @ F).transpose(0, 1)  # (q, n, R)
    L = _cholesky(A, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    V = torch.linalg.solve_triangular(L, F.transpose(-1, -2).unsqueeze(0), upper=False)
    h = torch.linalg.solve_triangular(L, eta.unsqueeze(-1), upper=False)  # (q, n, R, 1)
    var = psi + V.pow(2).sum(-2)  # (q, m', D)
    mean = (h.transpose(-1, -2) @ V).squeeze(-2)  # (q, n, D)
    return _normal_log_prob(resid, mean, var)


def _lowrank_independent_sums(m, x, mask):
    r"""Summed Woodbury log-conditionals for masks ``(q, n, D)`` drawn per datapoint, ``(q, n)``.

    With the context indicators :math:`C` flattened to ``(q n, D)``, every
    per-query quantity is a matrix product with the shared loading :math:`F`
    (no ``(q, n, R, D)`` table, no batched triangular solves):
    :math:`\Lambda = I + C\,(F \odot F / \psi)` (rows of :math:`R^2`),
    :math:`\eta_{qi} = \sum_j C_{qij} (r_{ij}/\psi_j) f_j` (one batched product
    per datapoint), and with :math:`B = \Lambda^{-1}` the conditional variance
    :math:`v_{qij} = \psi_j + f_j^	op B_{qi} f_j = \psi_j + \operatorname{vec}(B_{qi})^	op
    (f_j \otimes f_j)` and mean :math:`f_j^	op B_{qi}\eta_{qi}` are two more
    products over ``(q n, R^2) x (R^2, D)``.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    q, n, D = mask.shape
    R = F.shape[-1]
    r = x - m.loc  # (n, D)
    ctx = (~mask).to(x.dtype)  # (q, n, D)
    FF = (F.unsqueeze(-1) * F.unsqueeze(-2)).reshape(D, R * R)
    A = (ctx.reshape(q * n, D) @ (FF / psi.unsqueeze(-1))).reshape(q, n, R, R)
    A = A + torch.eye(R, dtype=x.dtype, device=x.device)
    # per datapoint, (q, D) contexts times its (D, R) weighted loading
    G = (r / psi).unsqueeze(-1) * F  # (n, D, R)
    eta = (ctx.transpose(0, 1) @ G).transpose(0, 1)  # (q, n, R)
    L = _cholesky(A, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    B = torch.cholesky_inverse(L)  # (q, n, R, R)
    c = (B @ eta.unsqueeze(-1)).reshape(q * n, R)
    var = (B.reshape(q * n, R * R) @ FF.T).reshape(q, n, D) + psi
    mean = (c @ F.T).reshape(q, n, D)
    terms = var.log() + (r - mean).pow(2) / var
    zero = torch.zeros((), dtype=terms.dtype, device=terms.device)
    return -0.5 * (torch.where(mask, terms, zero).sum(-1) + _LOG_2PI * mask.sum(-1).to(terms.dtype))


def _dense_masks(m, x, mask):
    """Dense conditionals for masks ``(q, n|1, D)``; returns ``(q, n, D)``."""
    S = m.covariance  # (r, D, D)
    ctx = (~mask).to(x.dtype)  # (q, m, D)
    cS = ctx.unsqueeze(-1) * S  # rows of the context, (q, m', D, D)
    S_ctx = cS * ctx.unsqueeze(-2) + torch.diag_embed(1.0 - ctx)
    L = _cholesky(S_ctx, "context covariance S_RR", m.site)
    resid = x - m.loc
    alpha = torch.cholesky_solve((ctx * resid).unsqueeze(-1), L)  # (q, n, D, 1)
    mean = (S @ alpha).squeeze(-1)
    B = torch.linalg.solve_triangular(L, cS, upper=False)
    var = torch.diagonal(S, dim1=-2, dim2=-1) - B.pow(2).sum(-2)
    # context tokens have variance ~0 (they are known); keep them finite so that
    # gradients through the caller's masking stay finite
    var = torch.where(mask, var, torch.ones((), dtype=var.dtype, device=var.device))
    mean = torch.where(mask, mean, resid)
    return _normal_log_prob(resid, mean, var)


def _shared_groups(mask, n, per_mask):
    r"""Masks ``(q, D)`` shared by the batch, in groups of similar size.

    Yields ``(rows, order, size)``: the group's rows of ``mask``, each mask's
    tokens with the context first (``order``, ``(g, D)``: a stable sort of the
    mask, so the context tokens and the targets each stay in token order) and
    its target count ``size`` ``(g,)``. Masks are sorted by size so that a
    group's gathered tables are padded to sizes close to each mask's own; a
    group holds at most ``per_mask(M_max)`` masks.
    """
    size = mask.sum(-1)
    by_size = torch.argsort(size, stable=True)
    order = torch.argsort(mask.to(torch.uint8), dim=-1, stable=True)
    sizes = size[by_size].tolist()  # one host sync per block
    D = mask.shape[-1]
    # padding to the group's largest size wastes (spread / D) of the work; small
    # tables are cheaper in one group than in several (fewer kernel launches)
    small = len(sizes) * n * D <= _SMALL_TABLE
    start = 0
    while start < len(sizes):
        end = start + 1
        # grow the group while it fits the budget at its largest (last) mask's size
        while end < len(sizes) and end - start < per_mask(sizes[end]) and (
            small or sizes[end] - sizes[start] <= max(4, D // 8)
        ):
            end += 1
        rows = by_size[start:end]
        yield rows, order[rows], size[rows]
        start = end


def _targets(order, size, M):
    """Target tokens of each mask, padded to ``M``: ``(g, M)`` indices and validity.

    The targets are the last ``size`` entries of ``order``; the padding entries
    are context tokens, flagged invalid."""
    D = order.shape[-1]
    idx = order[:, D - M :]
    valid = torch.arange(D - M, D, device=order.device) >= (D - size).unsqueeze(-1)
    return idx, valid


def _lowrank_shared_sums(m, x, mask, max_elements, data):
    r"""Summed Woodbury log-conditionals for masks ``(q, D)`` shared by the batch.

    Returns ``(q, n)``. With :math:`r = x - \mu = e + F\hat z` (:math:`\hat z` the
    full-data posterior mean, :math:`e` its residual), the masked residual of a
    mask with targets :math:`\mathcal M` and context :math:`\mathcal R` is
    :math:`r_{\mathcal M} - F_{\mathcal M}\Lambda^{-1}F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1} r_{\mathcal R}
    = e_{\mathcal M} + F_{\mathcal M}\Lambda^{-1}(\hat z - F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}e_{\mathcal R})`
    for any :math:`\hat z`: small centred terms, no cancellation between large
    ones (which matters in float32). Each mask's precision
    :math:`\Lambda = I + F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}`, its
    factor :math:`L`, :math:`V = L^{-1}F_{\mathcal M}^\top` (hence the variances
    :math:`\psi_j + \lVert V_{:j}\rVert^2`) and :math:`L^{-1}F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}`
    are computed once per mask; the data enter through batched matrix products
    over the gathered context and target residuals, :math:`O(nDR)` per mask.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    n, D = x.shape
    R = F.shape[-1]
    eye = torch.eye(R, dtype=x.dtype, device=x.device)
    Fp, eT, zhat = data["Fp"], data["eT"], data["zhat"]
    parts = []
    for rows, order, size in _shared_groups(mask, n, lambda M: max_elements // max(1, 3 * n * D + D * R)):
        g = rows.shape[0]
        M, C = int(size.max()), D - int(size.min())
        if M == 0:
            parts.append((rows, x.new_zeros(g, n)))
            continue
        idx, valid = _targets(order, size, M)  # (g, M)
        v = valid.to(x.dtype)
        Fm = F[idx] * v.unsqueeze(-1)  # (g, M, R), zero at padding
        psim = psi[idx]
        if C > 0:
            cidx = order[:, :C]
            cv = (torch.arange(C, device=x.device) < (D - size).unsqueeze(-1)).to(x.dtype).unsqueeze(-1)  # (g, C, 1)
            Fpc = Fp[cidx] * cv  # (g, C, R), zero at padding
            L = _cholesky(Fpc.transpose(-1, -2) @ F[cidx] + eye, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
            # Lambda >= I, so L^-1 has norm <= 1: its explicit inverse is accurate, and
            # turns the solves over the data into matrix products
            Linv = torch.linalg.solve_triangular(L, eye.expand(g, R, R), upper=False)
            Ec = eT.index_select(0, cidx.reshape(-1)).view(cidx.shape + (n,))  # (g, C, n)
            # h = L^-1 (zhat - F_R^T Psi_R^-1 e_R), V = L^-1 F_M^T
            h = torch.baddbmm(Linv @ zhat, Linv @ Fpc.transpose(-1, -2), Ec, alpha=-1)  # (g, R, n)
            V = Linv @ Fm.transpose(-1, -2)  # (g, R, M)
        else:
            h, V = zhat.expand(g, R, n), Fm.transpose(-1, -2)
        var = psim + V.pow(2).sum(-2)  # (g, M)
        E = eT.index_select(0, idx.reshape(-1)).view(idx.shape + (n,))  # (g, M, n)
        d = torch.baddbmm(E, V.transpose(-1, -2), h)  # masked residuals E + V^T h, (g, M, n)
        w = (v / var).unsqueeze(-2)  # (g, 1, M)
        quad = (w @ d.pow(2)).squeeze(-2)  # (g, n)
        logdet = (v * (_LOG_2PI + var.log())).sum(-1, keepdim=True)
        parts.append((rows, -0.5 * (logdet + quad)))
    return _scatter_rows(parts)


def _lowrank_shared_sums_embedded(m, x, mask, data):
    r""":func:`_lowrank_shared_sums` for a small rank :math:`R`, without gathers.

    The same centred residuals, expanded as :math:`\sum_{j\in\mathcal M}
    (e_j + f_j^\top u)^2/v_j` with :math:`u = \Lambda^{-1}(\hat z - F^\top C\Psi^{-1}e)`
    (:math:`C` the context indicator) into products of the whole residual table
    :math:`e` with mask-weighted copies of :math:`F`, ``(D, q R)``: at small
    :math:`R` these products are cheaper than gathering each mask's tokens.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    R = F.shape[-1]
    q = mask.shape[0]
    eye = torch.eye(R, dtype=x.dtype, device=x.device)
    ctx, tgt = (~mask).to(x.dtype), mask.to(x.dtype)  # (q, D)
    e, zhat = data["eT"].T, data["zhat"].T  # (n, D), (n, R)
    cw = ctx / psi  # (q, D)
    FF = (F[:, :, None] * F[:, None, :]).reshape(-1, R * R)
    L = _cholesky((cw @ FF).reshape(-1, R, R) + eye, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    P = torch.cholesky_solve(F.T.expand(q, R, -1), L)  # Lambda^-1 F^T, (q, R, D)
    var = psi + (F.T * P).sum(-2)  # (q, D)
    Ep = (e @ (cw[..., None] * F).permute(1, 0, 2).reshape(-1, q * R)).reshape(-1, q, R)
    u = torch.cholesky_solve((zhat[:, None] - Ep).permute(1, 2, 0), L)  # (q, R, n)
    w = tgt / var  # (q, D)
    t1 = data["e2"] @ w.T  # (n, q)
    We = (e @ (w[..., None] * F).permute(1, 0, 2).reshape(-1, q * R)).reshape(-1, q, R)
    t2 = (We * u.permute(2, 0, 1)).sum(-1)  # (n, q)
    Mw = (F.T * w[:, None]) @ F  # (q, R, R)
    t3 = ((Mw @ u) * u).sum(-2).T  # (n, q)
    logdet = (tgt * (_LOG_2PI + var.log())).sum(-1)  # (q,)
    return -0.5 * (logdet[:, None] + (t1 + 2 * t2 + t3).T)


def _lowrank_shared_data(m, x):
    """The pieces of :func:`_lowrank_shared_sums` that depend on the data but on no
    mask: computed once per state and data, shared by every block of masks."""
    F, psi = m.cov_factor[0], m.cov_diag[0]
    Fp = F / psi.unsqueeze(-1)
    L0 = m.factor[0] if m.factor is not None else _posterior_precision_factor(F, psi, m.site)
    r = x - m.loc  # (n, D)
    zhat = torch.cholesky_solve((r @ Fp).T, L0)  # (R, n)
    # centred residuals, token-major (D, n), for row gathers
    eT = (r.T - F @ zhat).contiguous()
    return {"Fp": Fp, "zhat": zhat, "eT": eT, "e2": (eT * eT).T}


def _scatter_rows(parts):
    """The values of ``(rows, value)`` parts put back in row order."""
    if len(parts) == 1:
        rows, value = parts[0]
        return value.index_select(0, torch.argsort(rows))
    rows = torch.cat([p[0] for p in parts])
    value = torch.cat([p[1] for p in parts])
    return value.index_select(0, torch.argsort(rows))


def _dense_shared_sums(m, x, mask, max_elements):
    r"""Summed dense log-conditionals for masks ``(q, D)`` shared by the batch.

    Returns ``(q, n)``. Per mask the context block :math:`\Sigma_{\mathcal R\mathcal R}`
    is gathered (padded with an identity) and factored once, and
    :math:`B = \Sigma_{\mathcal R\mathcal R}^{-1}\Sigma_{\mathcal R\mathcal M}` gives the
    variances; the data enter through one batched product
    :math:`r_{\mathcal M} - B^\top r_{\mathcal R}` per group of masks, instead of one
    solve per datapoint with the mask's factor broadcast against it.
    """
    S = m.covariance[0]  # (D, D)
    n, D = x.shape
    rT = (x - m.loc).T.contiguous()  # (D, n), token-major for row gathers
    diag = torch.diagonal(S)
    parts = []
    for rows, order, size in _shared_groups(mask, n, lambda M: max_elements // max(1, 3 * n * D + D * D)):
        g = rows.shape[0]
        M = int(size.max())
        C = D - int(size.min())
        if M == 0:
            parts.append((rows, x.new_zeros(g, n)))
            continue
        idx, valid = _targets(order, size, M)  # (g, M)
        v = valid.to(x.dtype)
        d = rT.index_select(0, idx.reshape(-1)).view(idx.shape + (n,))  # (g, M, n)
        var = diag[idx]
        if C > 0:
            cidx = order[:, :C]
            cvalid = (torch.arange(C, device=x.device) < (D - size).unsqueeze(-1)).to(x.dtype)  # (g, C)
            S_CC = S[cidx.unsqueeze(-1), cidx.unsqueeze(-2)] * (cvalid.unsqueeze(-1) * cvalid.unsqueeze(-2))
            S_CC = S_CC + torch.diag_embed(1.0 - cvalid)
            S_CM = S[cidx.unsqueeze(-1), idx.unsqueeze(-2)] * cvalid.unsqueeze(-1)  # (g, C, M)
            L = _cholesky(S_CC, "context covariance S_RR", m.site)
            W = torch.linalg.solve_triangular(L, S_CM, upper=False)  # L^-1 S_CM, (g, C, M)
            # the variances as a sum of squares: accurate to eps cond(L), not eps cond(S)
            var = var - W.pow(2).sum(-2)
            B = torch.linalg.solve_triangular(L.transpose(-1, -2), W, upper=True)  # S_CC^-1 S_CM
            Rc = rT.index_select(0, cidx.reshape(-1)).view(cidx.shape + (n,)) * cvalid.unsqueeze(-1)
            d = d - B.transpose(-1, -2) @ Rc
        # padding entries are context tokens (variance ~0): keep them finite
        var = torch.where(valid, var, torch.ones((), dtype=var.dtype, device=var.device))
        w = (v / var).unsqueeze(-2)
        quad = (w @ d.pow(2)).squeeze(-2)
        logdet = (v * (_LOG_2PI + var.log())).sum(-1, keepdim=True)
        parts.append((rows, -0.5 * (logdet + quad)))
    return _scatter_rows(parts)


def _lowrank_shared_chain(m, x, order, max_elements):
    """Chain rule along orderings shared by the batch: the ordering-only part
    (precisions, factors, variances) is computed once, the data part in chunks."""
    F, psi = m.cov_factor, m.cov_diag  # (1, D, R), (1, D)
    R = F.shape[-1]
    Fo = _gather_tokens(F, order)  # (p, 1, D, R)
    psio = _gather_tokens(psi, order)  # (p, 1, D)
    G = Fo.unsqueeze(-1) * Fo.unsqueeze(-2) / psio[..., None, None]
    Lam = _reverse_exclusive_cumsum(G, 2) + torch.eye(R, dtype=x.dtype, device=x.device)
    L = _cholesky(Lam, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    v = torch.linalg.solve_triangular(L, Fo.unsqueeze(-1), upper=False)
    var = psio + v.pow(2).sum((-1, -2))  # (p, 1, D)
    g = torch.linalg.solve_triangular(L.transpose(-1, -2), v, upper=True).squeeze(-1)  # (p, 1, D, R)
    n, D = x.shape
    step = max(1, max_elements // max(1, order.shape[0] * D * (R + 2)))
    out = []
    for start in range(0, n, step):
        rows = slice(start, start + step)
        loc = m.loc if m.loc.shape[0] == 1 else m.loc[rows]
        resid = _gather_tokens(x[rows] - loc, order)  # (p, c, D)
        eta = _reverse_exclusive_cumsum(Fo * (resid / psio).unsqueeze(-1), 2)  # (p, c, D, R)
        out.append(_normal_log_prob(resid, (g * eta).sum(-1), var))
    return torch.cat(out, 1)


def _gather_tokens(t, order):
    """``t[..., order]`` along the token dim for ``t`` of shape ``(r, D, *rest)``."""
    p, rows, D = order.shape
    r = t.shape[0]
    k = max(rows, r)
    rest = t.shape[2:]
    idx = order.expand(p, k, D).reshape((p, k, D) + (1,) * len(rest)).expand((p, k, D) + rest)
    return torch.gather(t.unsqueeze(0).expand((p, k) + t.shape[1:]), 2, idx)


def _reverse_exclusive_cumsum(t, dim):
    """``out[t] = sum_{s > t} in[s]`` along ``dim``."""
    inclusive = t.flip(dim).cumsum(dim).flip(dim)
    zero = torch.zeros_like(inclusive.narrow(dim, 0, 1))
    return torch.cat([inclusive.narrow(dim, 1, t.shape[dim] - 1), zero], dim)


def _lowrank_chain(m, x, order):
    """Chain rule along orderings ``(p, n|1, D)`` with nested Woodbury updates."""
    F, psi = m.cov_factor, m.cov_diag
    R = F.shape[-1]
    Fo = _gather_tokens(F, order)  # (p, k, D, R)
    psio = _gather_tokens(psi, order)  # (p, k, D)
    resid = _gather_tokens(x - m.loc, order)  # (p, n, D)
    G = Fo.unsqueeze(-1) * Fo.unsqueeze(-2) / psio[..., None, None]
    Lam = _reverse_exclusive_cumsum(G, 2) + torch.eye(R, dtype=x.dtype, device=x.device)
    L = _cholesky(Lam, "context precision I + F_R^T Psi_R^-1 F_R", m.site)
    v = torch.linalg.solve_triangular(L, Fo.unsqueeze(-1), upper=False)  # (p, k, D, R, 1)
    var = psio + v.pow(2).sum((-1, -2))
    g = torch.linalg.solve_triangular(L.transpose(-1, -2), v, upper=True).squeeze(-1)
    eta = _reverse_exclusive_cumsum(Fo * (resid / psio).unsqueeze(-1), 2)  # (p, n, D, R)
    mean = (g * eta).sum(-1)
    return _normal_log_prob(resid, mean, var)


def _dense_chain(m, x, order):
    """Chain rule from one Cholesky factor of the reversed-order covariance."""
    S = m.covariance  # (r, D, D)
    rev = order.flip(-1)  # Cholesky conditions each token on those before it
    p, rows, D = rev.shape
    k = max(rows, S.shape[0])
    idx = rev.expand(p, k, D)
    Sp = S.unsqueeze(0).expand(p, k, D, D)
    Sp = torch.gather(Sp, 2, idx.unsqueeze(-1).expand(p, k, D, D))
    Sp = torch.gather(Sp, 3, idx.unsqueeze(-2).expand(p, k, D, D))
    L = _cholesky(Sp, "covariance", m.site)
    resid = _gather_tokens(x - m.loc, rev)  # (p, n, D)
    u = torch.linalg.solve_triangular(L, resid.unsqueeze(-1), upper=False).squeeze(-1)
    diag = torch.diagonal(L, dim1=-2, dim2=-1)
    logc = -0.5 * (_LOG_2PI + u.pow(2)) - diag.log()
    return logc.flip(-1)
