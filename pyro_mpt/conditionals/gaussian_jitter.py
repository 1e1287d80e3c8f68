r"""The Gaussian engine's jitter rescue: a covariance that fails a Cholesky factorization gets jitter on its diagonal.

The jitter goes into the model's covariance (the state), not into the one
matrix that failed, so all conditionals keep coming from one joint
:math:`\mathcal N(\mu, \Sigma + \tau I)`. :math:`\tau` grows tenfold per retry
from ``gaussian_linalg.first_jitter`` times the mean
diagonal of :math:`\Sigma` up to ``max_jitter`` times it, and each increase
warns (:class:`~pyro_mpt.conditionals.base.NumericalWarning`) with the total
and its estimated change of :math:`\log p` (:func:`log_det_change`). The
relative jitter reached is kept per ``(observed site, dtype)`` in the engine's
:class:`~pyro_mpt.conditionals.gaussian.GaussianMemory`, so that the next
call, where its covariance as it is fails again, starts from it
(:func:`resume_jitter`) and warns only when it grows.
"""

import math
import warnings

import torch

from .base import NumericalWarning
from .gaussian_linalg import NotPositiveDefinite, cholesky, first_jitter, lowrank_dtype, posterior_precision_factor
from ..code_origin import user_stacklevel

__all__ = ["factor_whole", "add_jitter", "resume_jitter", "mean_diagonal", "set_jitter", "log_det_change"]


def factor_whole(state, precision_checked=False):
    """Factor the state's covariance and keep the factor on the state (with its
    gradient, for the exact log-density). On the low-rank path, a noise
    variance with zeros, or too small against the loading for the state's
    dtype (see ``gaussian_linalg.lowrank_dtype``), fails like a Cholesky factorization,
    so that the rescue's jitter raises it.

    :param bool precision_checked: the caller chose the state's dtype by
        ``gaussian_linalg.lowrank_dtype`` on this loading and a noise variance
        no larger (exactly widened; the jitter only raises it), so both checks
        pass: skip them rather than repeat them at every call."""
    if not state.is_low_rank:
        state.factor = cholesky(state.covariance, "covariance", state.site)
        return
    F, psi = state.cov_factor, state.cov_diag
    if precision_checked:
        state.factor = posterior_precision_factor(F, psi, state.site)
        return
    zeros = int((psi.detach() <= 0).sum())
    if zeros:
        raise NotPositiveDefinite(
            f"The covariance of site {state.site!r} is not positive definite (its "
            f"noise variance has {zeros} zero entries)"
        )
    if lowrank_dtype(F, psi, (state.loc.dtype,)) is None:
        raise NotPositiveDefinite(
            f"The covariance of site {state.site!r} is not positive definite to "
            f"working precision on the low-rank path (its noise variance is too "
            f"small against the loading: rounding errors swamp the identity in "
            f"I + F^T Psi^-1 F)"
        )
    state.factor = posterior_precision_factor(F, psi, state.site)


def _diagonal(state):
    """The diagonal of the state's covariance, the rescue's jitter included."""
    with torch.no_grad():
        if state.is_low_rank:
            return state.cov_diag + state.cov_factor.pow(2).sum(-1)
        return torch.diagonal(state.covariance, dim1=-2, dim2=-1)


def mean_diagonal(state):
    """The mean diagonal of the state's covariance without the rescue's jitter."""
    return float(_diagonal(state).mean()) - state.jitter


#: the most jitter, relative to the smallest variance of a token, that the rescue adds: above
#: it the jitter changes that token's conditionals by more than about 0.005 nats (half the
#: ratio, the least it changes a Normal's log-density by through its variance)
MAX_JITTER_PER_VARIANCE = 1e-2


def _check_token_scale(state, tau, rel, scale, error):
    r"""Refuse a jitter :math:`\tau` of at least :data:`MAX_JITTER_PER_VARIANCE` times the
    smallest variance of a token: the covariance's scales span more digits than its dtype
    has, and the jittered model would give that token's conditionals the jitter's
    numbers, not the model's (a jitter relative to the mean diagonal, dominated by the
    largest variances). The dense path only: on the low-rank one a tiny noise variance is
    what makes the covariance singular, and the jitter that raises it is the rescue's purpose
    (and warns with its effect on log p)."""
    if state.is_low_rank:
        return
    smallest = float(_diagonal(state).min()) - state.jitter
    if tau < MAX_JITTER_PER_VARIANCE * smallest:
        return
    raise ValueError(
        f"{error}, and the jitter that would make it so, {tau:.3g} ({rel:.0e} x its mean "
        f"diagonal {scale:.3g}), is {tau / smallest:.3g} x its smallest variance {smallest:.3g} "
        f"(more than {MAX_JITTER_PER_VARIANCE:g}): it would change the conditionals of that token "
        f"materially. The covariance's variances span more digits than its dtype has (e.g. "
        f"a GaussianHMM with explosive dynamics, whose variance grows as rho^(2 t) with the "
        f"transition matrices' spectral radius rho > 1: conditionals='gaussian_hmm' serves "
        f"one without other latents exactly). Rescale the tokens to comparable variances, "
        f"or keep the dynamics stable."
    ) from None


def set_jitter(state, tau):
    """Make the rescue's jitter on the state's diagonal ``tau`` in total."""
    delta = tau - state.jitter
    state.factor = None  # the factor of the old covariance
    state.data_pieces = None  # computed with the old one
    if state.is_low_rank:
        state.cov_diag = state.cov_diag + delta
    else:
        eye = torch.eye(state.num_tokens, dtype=state.loc.dtype, device=state.loc.device)
        state.covariance = state.covariance + delta * eye
    state.jitter = tau


def add_jitter(state, error, max_jitter, reached):
    """Raise the jitter of ``state`` tenfold (or to the first jitter) after ``error``, and warn; record it in ``reached``.

    :param Exception error: the failed factorization (``gaussian_linalg.NotPositiveDefinite``).
    :param float max_jitter: the most jitter, relative to the mean diagonal.
    :param dict reached: relative jitter per ``(observed site, dtype)``, updated.
    :raises ValueError: when the jitter would exceed ``max_jitter`` times the mean diagonal.
    """
    scale = mean_diagonal(state)
    dtype = state.loc.dtype
    if state.jitter:
        k = round(math.log10(state.jitter / scale)) + 1
    else:
        k = round(math.log10(first_jitter(dtype)))
    rel = 10.0**k
    if not (scale > 0 and math.isfinite(scale)) or rel > max_jitter * (1 + 1e-9):
        raise ValueError(
            f"{error} even with jitter up to {max_jitter:g} x the mean diagonal "
            f"{scale:.3g} of its covariance: the covariance is singular or ill-conditioned. "
            f"Try float64 data and parameters, more observation noise, or "
            f"GaussianConditionals(jitter=...) with a larger value."
        ) from None
    tau = rel * scale
    _check_token_scale(state, tau, rel, scale, error)
    set_jitter(state, tau)
    reached[(state.site, dtype)] = rel
    change = log_det_change(state)
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
    warnings.warn(warning, stacklevel=user_stacklevel())


def log_det_change(state):
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


def resume_jitter(state, reached):
    """Start ``state`` from the relative jitter an earlier call reached for its site and dtype (it warned then).

    :param dict reached: relative jitter per ``(observed site, dtype)``, as :func:`add_jitter` records it.
    """
    rel = reached.get((state.site, state.loc.dtype))
    if rel is not None:
        scale = mean_diagonal(state)
        if scale > 0 and math.isfinite(scale):
            set_jitter(state, rel * scale)
