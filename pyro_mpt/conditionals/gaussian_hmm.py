r"""Exact masked conditionals of an observed ``dist.GaussianHMM``, by Kalman filtering and smoothing.

A ``GaussianHMM`` (a linear dynamical system, see
:class:`~pyro_mpt.conditionals.linear_dynamical.LinearDynamicalParts`) observes
:math:`x_t = z_tC_t + v_t`, :math:`v_t \sim \mathcal N(d_t, R_t)`, at every step
:math:`t < T`; its tokens are the :math:`T\cdot O` elements :math:`x_{t,o}`
(token ``t * O + o``). For a context :math:`\mathcal R` (the tokens a mask leaves
visible), step :math:`t` contributes the factor over :math:`(z_{t-1}, z_t)` made of
the transition density and the likelihood of the step's context elements, whose
noise precision is :math:`W_t = (M_tR_tM_t + I - M_t)^{-1} \circ c_tc_t^\top` with
:math:`c_t` the step's context indicator and :math:`M_t = \operatorname{diag}(c_t)`
(:math:`R_t`'s context block inverted, zeros elsewhere: one batched factorization
serves every mask). The forward messages :math:`\alpha_t(z_t) = \int
p(z_{-1})f_0\cdots f_t` and backward messages :math:`\beta_t(z_t) = \int f_{t+1}\cdots
f_{T-1}` are Gaussian factors in information form (precision, information vector,
log-normalizer), so :math:`\alpha_t\beta_t` is the smoothed :math:`z_t \mid
x_{\mathcal R} \sim \mathcal N(\hat m_t, \hat P_t)` and :math:`\int\alpha_{T-1} =
p(x_{\mathcal R})`. A target :math:`x_{t,o}` depends on the context only through
:math:`z_t` and the step's own context elements :math:`x_{t,c}`:

.. math::

    x_{t,o} \mid z_t, x_{t,c} \sim \mathcal N\big(z_t\tilde C_{t,o} + d_{t,o}
        + g_o(x_{t,c} - d_{t,c}),\; R_{t,oo} - g_oR_{t,co}\big),
    \qquad g_o = R_{t,oc}R_{t,cc}^{-1},\quad \tilde C_{t,o} = C_{t,o} - C_{t,c}\,g_o^\top,

so :math:`\log p(x_{t,o} \mid x_{\mathcal R})` is a univariate Normal density with
mean :math:`\hat m_t\tilde C_{t,o} + d_{t,o} + g_o(x_{t,c} - d_{t,c})` and variance
:math:`\tilde C_{t,o}^\top\hat P_t\tilde C_{t,o} + R_{t,oo} - g_oR_{t,co}` (with a
diagonal :math:`R_t`, :math:`g_o = 0`). ``log_evidence`` and every chain-rule sum are
:math:`\log p(x)`, the normalizer of the product of all the steps' factors (multiplied in
pairs, ``total_factor``).

Each mask costs :math:`O(T(H^3 + O^3))`, against :math:`O(T^3O^3)` for the dense
covariance of the whole sequence
(:func:`~pyro_mpt.conditionals.linear_dynamical.gaussian_hmm_moments`, which the
Gaussian engine uses for a ``GaussianHMM`` with latents or inside other
structure). The messages run in blocks of about :math:`\sqrt T` steps
(``forward_messages``), vectorized over masks, datapoints and blocks, in float64 (the
covariances of a long chain lose digits in float32); the result is in the dtype of
the model's parameters and data. Masks shared by the batch go to the dense
covariance (the ``"gaussian"`` engine), whose aggregated forms factorize each mask
once for all the datapoints, where smoothing costs every datapoint its own pass.

Explosive dynamics (a transition matrix of spectral radius :math:`\rho > 1`) grow a
state's variance as :math:`\rho^{2k}` over :math:`k` steps without context, which the
information form's prediction loses to cancellation and the dense covariance to its
span of :math:`\rho^{2T}`. For them the later context's information comes from a
product form (``backward_information``), the earlier's from the information form at
the steps where the smoothed precision keeps its digits and from a square-root
information filter elsewhere (``root_filter``, a step at a time), and the evidence
from the square-root filter; see docs/numerics.md for the measured accuracy and the
refusals (``gaussian-hmm-ill-conditioned``, ``gaussian-hmm-not-finite``).
"""

import math
from dataclasses import dataclass, field

import torch
import pyro.distributions as dist

from ..recompute import not_recomputed, recomputed
from .base import ConditionalEngine, EngineNotApplicable
from .chain_messages import (
    Factor, Message, backward_information, chain_steps, context_block, context_precision, forward_messages,
    information_moments, log_normalizer, message_through, prior_message, root_filter, root_smoothed, step_factors,
    time_first, total_factor,
)
from .distributions import base_distribution, check_one_sequence, check_sequence_alone
from .gaussian import GaussianConditionals
from .gaussian_linalg import LOG_2PI
from .linear_dynamical import LinearDynamicalParts, gaussian_hmm_parts
from .small_matrices import small_cholesky_solve, small_mm, small_mv

__all__ = ["GaussianHMMConditionals", "GaussianHMMState", "AUTO_MIN_TOKENS", "WIDE_HIDDEN"]

_WHO = "conditionals='gaussian_hmm'"


#: the sequence length (tokens, :math:`T\cdot O`) from which ``"auto"`` takes this engine over
#: the dense covariance: loss and gradient at H = 2, O = 1, N = 20, one thread, the
#: default masks break even at about 250 tokens and ``masks="all"`` at about 450
#: (the dense path's cost grows as :math:`T^3` a mask, this one's as :math:`T`)
AUTO_MIN_TOKENS = 256


#: above this hidden dim the engine's sequences must hold ``min_tokens * H / WIDE_HIDDEN`` tokens:
#: its steps' batched LAPACK routines grow with :math:`H` while the dense covariance's cost does
#: not, and the break-even rises (loss and gradient, O = 1, N = 20, one thread, default masks:
#: about 256 tokens at H = 12 and 16, 450 at H = 20, 520 at H = 32, where at 256 tokens this
#: engine took 2.8 s and the dense covariance 1.1 s)
WIDE_HIDDEN = 12


#: the span :math:`\rho^{2T}` of a sequence's variances from which this engine serves it
#: however short (the dense covariance's factorization keeps about 16 - log10 of it digits)
EXPLOSIVE_SPAN = 1e6


@dataclass
class GaussianHMMState:
    """The linear dynamical system of one evaluation.

    :param LinearDynamicalParts parts: float64, each with a leading dim of ``n`` rows
        or one (shared by the datapoints), then its time dim (``T`` or 1).
    :param str site: the observed site, for error messages.
    :param bool diagonal_noise: whether every :math:`R_t` is diagonal (the step's other
        elements then carry no information on a target beyond :math:`z_t`).
    :param torch.dtype dtype: the dtype of the results.
    :param tuple prepared_from: ``(tokens, model, guide, args, kwargs)``, from which masks
        shared by the batch prepare the dense covariance's state (``dense``, made once).
    :param float radius: the largest spectral radius of the transition matrices.
    :param float noise_precision: the largest eigenvalue of the transition noise's precisions
        :math:`Q_t^{-1}`, the scale of the information form's rounding errors.
    """

    parts: LinearDynamicalParts = field(repr=False)
    site: str
    diagonal_noise: bool
    dtype: torch.dtype
    num_data: int
    num_tokens: int
    num_steps: int
    prepared_from: tuple = field(default=None, repr=False)
    dense: tuple = field(default=None, repr=False)
    radius: float = 0.0
    noise_precision: float = 1.0

    @property
    def explosive(self):
        """Whether a transition matrix has a spectral radius above 1: the smoother then checks
        the information form's digits and takes the square-root filter (``root_filter``)
        where they are lost, and never sends masks to the dense covariance."""
        return self.radius > 1.0


def _rows(t, batch_shape, event_ndim):
    """``t`` ``(..., *tail)`` (``event_ndim`` dims in ``tail``) broadcastable to
    ``(*batch, *tail)`` -> ``(n|1, *tail)``."""
    tail = tuple(t.shape[t.dim() - event_ndim :])
    lead = t.shape[: t.dim() - len(tail)]
    if all(s == 1 for s in lead):
        return t.reshape((1,) + tail)
    return t.expand(tuple(batch_shape) + tail).reshape((-1,) + tail)


def _spectral_radius(A):
    """The largest spectral radius of transition matrices ``A`` ``(..., H, H)`` (infinite where
    an entry is not finite: LAPACK's eigenvalue routines do not return on those)."""
    A = A.detach()
    if not bool(torch.isfinite(A).all()):
        return math.inf
    return float(torch.linalg.eigvals(A).abs().max()) if A.numel() else 0.0


def _noise_precision(Q):
    """The largest eigenvalue of the precisions of noise covariances ``Q`` ``(..., H, H)``."""
    return float(1.0 / torch.linalg.eigvalsh(Q.detach()).min())


#: the smallest eigenvalue of a smoothed state's precision, relative to the transition noise's,
#: from which the information form's rounding errors (about float64's eps times the noise's
#: precision, from the prediction's subtraction) leave it 9 digits
INFORMATION_RTOL = 1e-7


def _reliable(J, state):
    r"""Where the smoothed precisions ``J`` ``(T, q, n|1, H, H)`` from the information form
    are finite, and where moreover each eigenvalue is at least :data:`INFORMATION_RTOL` times
    the noise's precision, ``(T, q, n|1)`` each; below, the state's variance has outgrown the
    noise's (explosive dynamics over a stretch without context) and the information form has
    lost it."""
    finite = torch.isfinite(J).all(-1).all(-1)
    finite = finite & finite.all(0)  # a non-finite step spoils its whole sequence's messages
    J = torch.where(finite[..., None, None], J, torch.zeros((), dtype=J.dtype, device=J.device))
    smallest = torch.linalg.eigvalsh(J)[..., 0]
    return finite, finite & (smallest > INFORMATION_RTOL * state.noise_precision)


def _refuse_ill_conditioned(state):
    """Raise for smoothed states too ill-conditioned for float64 (see :func:`root_smoothed`)."""
    raise ValueError(
        f"{_WHO}: the conditionals of site {state.site!r} cannot be computed to float64's "
        f"precision. The transition matrices' spectral radius is {state.radius:.3g} > 1, and a "
        f"direction of the state that they expand is hardly informed by the context of some "
        f"masks (e.g. masks that leave a token or two of a long sequence visible, or an "
        f"observation matrix with equal columns and a transition matrix near a multiple of the "
        f"identity): the states' covariances span more digits than float64 has. Keep the dynamics stable (e.g. parametrize the transition matrix with a "
        f"spectral radius below 1), or mask shorter stretches."
    )


def _check_finite(state, value):
    r"""Refuse non-finite results: with explosive dynamics a state's variance grows as
    :math:`\rho^{2k}` over :math:`k` steps without context (:math:`\rho` the transition
    matrices' spectral radius), and past float64's largest number (about :math:`10^{308}`)
    nothing finite is left to condition on."""
    if bool(torch.isfinite(value).all()):
        return
    radius = state.radius
    raise ValueError(
        f"{_WHO}: the conditionals of site {state.site!r} are not finite. The transition "
        f"matrices' spectral radius is {radius:.3g}"
        + (
            f" > 1: the states' variance grows as {radius:.3g}^(2 k) over k steps without context, "
            f"beyond float64's range (about 1e308) over the masked stretches of these {state.num_steps} steps. "
            if radius > 1
            else ": the model's covariances lose all their digits in float64. "
        )
        + "Keep the dynamics stable (e.g. parametrize the transition matrix with a spectral "
        "radius below 1) or score shorter sequences."
    )


class GaussianHMMConditionals(ConditionalEngine):
    r"""Exact masked conditionals of an observed ``dist.GaussianHMM`` by Kalman smoothing.

    Serves a model whose observed site is a ``pyro.distributions.GaussianHMM``
    (in a plate over sequences, or alone) and that has no latent site; the
    :math:`T\cdot O` elements of a sequence are its tokens. Each mask's
    conditionals :math:`\log p(x_{t,o} \mid x_{\mathcal R})` cost
    :math:`O(T(H^3 + O^3))` (see the module docstring), where the dense covariance
    of the sequence costs :math:`O(T^3O^3)` a mask. ``"auto"`` takes this engine
    before the Gaussian one for such models from :data:`AUTO_MIN_TOKENS` tokens a
    sequence.

    :param int min_tokens: sequences with fewer tokens (:math:`T\cdot O`) are declined
        (``EngineNotApplicable``), and with fewer than ``min_tokens * H / WIDE_HIDDEN``
        above hidden dim :data:`WIDE_HIDDEN`. 0 by default; ``"auto"`` asks for
        :data:`AUTO_MIN_TOKENS`, below which the dense covariance is faster.
    :param bool dense_per_datapoint: send masks drawn per datapoint to the dense
        covariance (``"gaussian"``'s sums over the pairs) where a measured cost rule says
        it is cheaper (sequences of fewer than about 470 tokens at H = 2; the rule is in
        ``_dense_cheaper_per_datapoint``). False by default, so that this engine, asked
        for by name, smooths them; ``"auto"`` asks for True. Masks shared by the batch
        follow their own cost rule either way.
    :param int max_elements: bound on the elements the filter and smoother keep
        per chunk of ``(mask, datapoint)`` pairs (the steps' factors and
        messages); the chunks of one call are recomputed in the backward
        pass when there are several.

    Example::

        >>> def lds(x):
        ...     with pyro.plate("sequences", x.shape[0]):
        ...         pyro.sample("x", dist.GaussianHMM(init, A, trans, C, obs, duration=T), obs=x)
        >>> MaskedPretrainingLoss(conditionals="gaussian_hmm").differentiable_loss(lds, None, x)
    """

    def __init__(self, *, min_tokens=0, dense_per_datapoint=False, max_elements=2**24):
        super().__init__(max_elements=max_elements)
        self.min_tokens = int(min_tokens)
        self.dense_per_datapoint = bool(dense_per_datapoint)

    def prepare(self, tokens, model, guide, args, kwargs):
        hmm = base_distribution(tokens.site["fn"])
        if not isinstance(hmm, dist.GaussianHMM):
            raise EngineNotApplicable(
                f"{_WHO} needs observed site {tokens.name!r} to be a dist.GaussianHMM; "
                f"it is {type(hmm).__name__}."
            )
        check_sequence_alone(tokens, hmm, _WHO, "integrates", " (conditionals='gaussian' serves a GaussianHMM "
                             "with Normal latents through its dense covariance).")
        check_one_sequence(tokens, hmm, _WHO, " (conditionals='gaussian' serves them as blocks)")
        H = hmm.hidden_dim
        parts = gaussian_hmm_parts(hmm)
        radius = _spectral_radius(parts.transition.to(torch.float64))
        needed = self.min_tokens * max(1.0, H / WIDE_HIDDEN)
        # explosive dynamics: the dense covariance's variances span up to rho^(2T), and past
        # EXPLOSIVE_SPAN lose the digits of its factorization (measured: radius 1.3 over 60
        # steps, 1e14, 0.55 nats off), so this engine serves such sequences of any length
        T = tokens.event_shape[0]
        if tokens.num_tokens < needed and not 2 * T * math.log10(max(radius, 1.0)) > math.log10(EXPLOSIVE_SPAN):
            wide = f" times hidden_dim {H} / {WIDE_HIDDEN}" if H > WIDE_HIDDEN else ""
            raise EngineNotApplicable(
                f"{_WHO} declines the GaussianHMM at site {tokens.name!r}: {tokens.num_tokens} "
                f"tokens a sequence, fewer than {math.ceil(needed)} (min_tokens={self.min_tokens}{wide}), "
                f"below which the dense covariance (conditionals='gaussian') is faster."
            )
        dtype = torch.promote_types(tokens.value.dtype, parts.transition.dtype)
        rows = []
        for part, event_ndim in zip(parts, (1, 2, 3, 2, 3, 3, 2, 3)):
            rows.append(_rows(part.to(torch.float64), tokens.site_batch_shape, event_ndim))
        parts = LinearDynamicalParts(*rows)
        R = parts.obs_cov
        diagonal = bool((R - torch.diag_embed(R.diagonal(dim1=-2, dim2=-1)) == 0).all())
        return GaussianHMMState(parts, tokens.name, diagonal, dtype, tokens.num_data, tokens.num_tokens, T,
                                (tokens, model, guide, args, kwargs), radius=radius,
                                noise_precision=_noise_precision(parts.trans_cov) if radius > 1.0 else 1.0)

    def _per_pair(self, state):
        """Elements kept per ``(mask, datapoint)`` pair for the backward pass: the steps'
        factors, messages and their intermediates (bounds the saved-tensor hooks' counts,
        e.g. 340 a step at H = 2, O = 1 with a full noise, 1700 at H = 4, O = 3)."""
        H = state.parts.transition.shape[-1]
        O = state.parts.observation.shape[-1]
        return state.num_steps * (96 * H * H + 16 * H * O + 16 * O * O + 64)

    def _chunks(self, state, x, context, fn):
        """``fn(x, context_chunk)`` over chunks of the masks (dim 1), concatenated; each chunk
        under activation checkpointing when there are several and gradients are recorded."""
        q, n = context.shape[1], x.shape[1]
        per = max(1, self.max_elements // max(1, n * self._per_pair(state)))
        if per >= q:
            return fn(x, context)
        recompute = torch.is_grad_enabled()
        outs = []
        for start in range(0, q, per):
            chunk = context[:, start : start + per]
            outs.append(recomputed(fn, x, chunk) if recompute else fn(x, chunk))
        return tuple(torch.cat(parts, 1) for parts in zip(*outs))

    def _smoothed(self, state, x, context):
        r"""For contexts ``(T, q, n|1, O)`` (float, 1 at context elements) and tokens
        ``(T, n, O)``: the smoothed means ``(T, q, n, H)`` and covariances ``(T, q, n, H, H)``
        of the states."""
        if not state.explosive:
            return information_moments(*self._smoothed_information(state.parts, x, context))
        # explosive dynamics: the later context's information by products (exact zero where
        # there is none), the earlier's in information form at the steps where the smoothed
        # precision keeps its digits (blocked, faster), by the square-root filter at the others;
        # each on its own (mask, datapoint) pairs, as a pair's non-finite intermediates would
        # make every gradient NaN
        q, n, T = context.shape[1], x.shape[1], x.shape[0]
        Jb, hb = backward_information(chain_steps(state.parts, x, context))
        with torch.no_grad():
            alpha = self._forward_information(state.parts, x, context)
            finite, ok = _reliable(alpha.J + Jb, state)
        finite, ok = finite.expand(T, q, n), ok.expand(T, q, n)
        if bool(ok.all()):
            alpha = self._forward_information(state.parts, x, context)
            return information_moments(alpha.J + Jb, alpha.h + hb)
        H = state.parts.transition.shape[-1]
        ms = x.new_zeros((q * n, T, H))  # pairs first, for index_put
        Ss = x.new_zeros((q * n, T, H, H))
        eye = torch.eye(H, dtype=x.dtype, device=x.device)
        for pairs, information in ((finite.all(0), True), (~ok.all(0), False)):
            qi, ni = pairs.nonzero(as_tuple=True)
            if qi.numel() == 0:
                continue
            parts = LinearDynamicalParts(*(t[ni] if t.shape[0] > 1 else t for t in state.parts))
            ctx = context.expand(-1, -1, n, -1)[:, qi, ni].unsqueeze(1)
            Jb_, hb_ = (t.expand((T, q, n) + t.shape[3:])[:, qi, ni].unsqueeze(1) for t in (Jb, hb))
            keep = ok[:, qi, ni].unsqueeze(1)  # (T, 1, pairs): the information form's steps
            if information:
                alpha = self._forward_information(parts, x[:, ni], ctx)
                m, S = information_moments(torch.where(keep[..., None, None], alpha.J + Jb_, eye), alpha.h + hb_)
            else:
                m, S, bad = root_smoothed(root_filter(parts, chain_steps(parts, x[:, ni], ctx))[0], Jb_, hb_)
                if bool((bad & ~keep).any()) and bool(torch.isfinite(m).all()):
                    _refuse_ill_conditioned(state)
            m, S = m[:, 0].movedim(0, 1), S[:, 0].movedim(0, 1)  # (pairs, T, ...)
            i = qi * n + ni
            if not information:
                keep = keep[:, 0].transpose(0, 1)
                m = torch.where(keep[..., None], ms[i], m)
                S = torch.where(keep[..., None, None], Ss[i], S)
            ms, Ss = ms.index_put((i,), m), Ss.index_put((i,), S)
        return ms.reshape(q, n, *ms.shape[1:]).movedim(2, 0), Ss.reshape(q, n, *Ss.shape[1:]).movedim(2, 0)

    @staticmethod
    def _forward_information(parts, x, context):
        """The forward messages :math:`\\alpha_t` in information form (blocked, ``forward_messages``)."""
        f = step_factors(parts, x, context)
        return forward_messages(prior_message(parts, f.Jaa.shape[1:-2], f.c.shape[1:]), f)

    @staticmethod
    def _smoothed_information(parts, x, context):
        """The smoothed states in information form, ``(T, q, n|1, H, H)`` and ``(T, q, n, H)``:
        the forward and backward messages, each in blocks (``forward_messages``)."""
        f = step_factors(parts, x, context)
        H = f.Jaa.shape[-1]
        T = x.shape[0]
        J_batch, h_batch = f.Jaa.shape[1:-2], f.c.shape[1:]
        alpha = forward_messages(prior_message(parts, J_batch, h_batch), f)
        zero = Message(f.Jaa.new_zeros(J_batch + (H, H)), f.ha.new_zeros(h_batch + (H,)), f.c.new_zeros(h_batch))
        # beta_t: the reversed chain's messages, beta_{T-2} .. beta_{-1}; beta_{T-1} is flat
        back = forward_messages(zero, Factor(f.Jbb.flip(0), f.Jab.transpose(-1, -2).flip(0), f.Jaa.flip(0),
                                       f.hb.flip(0), f.ha.flip(0), f.c.flip(0)))
        beta = Message(*(torch.cat([t[: T - 1].flip(0), z.unsqueeze(0)], 0) for t, z in zip(back, zero)))
        return alpha.J + beta.J, alpha.h + beta.h

    def _conditionals(self, state, x, context):
        """Means and variances ``(T, q, n, O)`` of every token given the context."""
        ms, Ss = self._smoothed(state, x, context)
        C, d, R = (time_first(t) for t in state.parts[5:])  # (T|1, 1, n|1, ...)
        var_noise = R.diagonal(dim1=-2, dim2=-1)
        offset = d
        if not state.diagonal_noise:
            # g = R_oc R_cc^-1 for every element o (zero columns outside the context)
            c = context
            Rc = R * c.unsqueeze(-2)
            L, _ = context_block(R, c)
            # rows of the context elements zeroed: their own values are no context of theirs (the
            # variance would be 0, its log-density and gradient not finite where no target is)
            g = small_cholesky_solve(Rc.transpose(-1, -2), L).transpose(-1, -2) * (1 - c).unsqueeze(-1)
            C = C - small_mm(C, g.transpose(-1, -2))
            offset = d + small_mv(x.unsqueeze(1) - d, g.transpose(-1, -2))
            var_noise = var_noise - (g * R).sum(-1)
        mean = small_mv(ms, C) + offset
        var = small_mm(Ss, C).pow(2).sum(-2) + var_noise
        return mean, var

    def _dense(self, state):
        """The ``"gaussian"`` engine and its state on the sequence's dense covariance, for
        masks shared by the batch: there its aggregated quadratic forms take each mask's
        factorization once for all the datapoints (``masks="all", share_masks=True`` at
        T = 300, H = 2, N = 20: 0.8 s, against 19 s of smoothing every datapoint here)."""
        if state.dense is None:
            engine = GaussianConditionals("dense", max_elements=self.max_elements)
            with not_recomputed():  # made once, for this block and every later one
                state.dense = (engine, engine.prepare(*state.prepared_from))
        return state.dense

    @staticmethod
    def _dense_cheaper(state, masks):
        r"""Whether ``masks`` masks shared by the batch cost less on the dense covariance
        (:meth:`_dense`) than smoothed for every datapoint. Measured (loss and gradient, H = 2,
        O = 1, N = 20, one thread), the dense path costs about :math:`(15 + q)\,D^3` units
        (preparing the covariance, then each mask's factorization, aggregated over the
        datapoints) and smoothing :math:`2.5\cdot10^5\,q\,n\,D` (a step's few dozen small
        operations per datapoint, a chunk recomputed in the backward pass): ``masks="all"``
        at T = 300, 0.8 s dense against 19 s smoothed; 8 masks at T = 1000, 1.6 s against
        3.8 s; one mask at T = 1000, 1.2 s against 0.17 s, at T = 2000, 14 s and 2.4 GB
        against 0.55 s and 0.34 GB. Once this evaluation has prepared the dense covariance
        (the first block's masks decided so) its cost is sunk and later blocks, which
        :func:`~pyro_mpt.estimate.mpt_estimate` may split into single masks, stay there."""
        if state.explosive:
            return False
        if state.dense is not None:
            return True
        D, n = state.num_tokens, state.num_data
        return (15 + masks) * D * D < 2.5e5 * masks * n

    @staticmethod
    def _dense_cheaper_per_datapoint(state, masks):
        r"""Whether ``masks`` masks drawn per datapoint cost less on the dense covariance
        (its sums over each (mask, datapoint) pair with their backward pass written out,
        ``gaussian_dense_independent``) than smoothed. Measured (loss and gradient,
        ``masks="all"``, H = 2, O = 1, N = 4, one thread), a pair costs the dense path about
        :math:`530\,D^2` units at D = 256..384 (3.0 and 6.6 ms; its passes over the pair's
        :math:`D\times D` tables, not yet its :math:`D^3` factorization, set the pace),
        and smoothing :math:`2.5\cdot10^5\,D` (5.1 and 8.1 ms), plus the dense covariance's
        preparation, :math:`15\,D^3` once: they break even near D = 470, and the default
        single mask per datapoint near D = 290 at N = 20. Only where the sequences share
        their parameters (one covariance for the batch, which those sums need)."""
        if any(part.shape[0] != 1 for part in state.parts):
            return False
        D, n = state.num_tokens, state.num_data
        prepare = 0 if state.dense is not None else 15 * D
        return (prepare + 530 * masks * n) * D * D < 2.5e5 * masks * n * D

    def _dense_serves(self, state, mask, context=None):
        """Whether the dense covariance (:meth:`_dense`) takes the sums of ``mask`` ``(q, n|1, D)``
        (with ``context`` ``(1, n, D)``, the observed tokens): shared masks by
        :meth:`_dense_cheaper`, masks per datapoint by :meth:`_dense_cheaper_per_datapoint`."""
        if mask.shape[1] == 1:
            return self._dense_cheaper(state, mask.shape[0])
        if not self.dense_per_datapoint or (context is not None and context.shape[0] != 1):
            return False
        return self._dense_cheaper_per_datapoint(state, mask.shape[0])

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        if mask.shape[1] == 1 and self._single_targets(mask) is None and self._dense_cheaper(state, mask.shape[0]):
            engine, dense = self._dense(state)
            return engine.mask_log_prob(dense, x, mask)
        q, n, T = mask.shape[0], x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)  # (T, n, O)
        context = (~mask).to(torch.float64).reshape(q, mask.shape[1], T, -1).permute(2, 0, 1, 3)

        def fn(xs, context):
            mean, var = self._conditionals(state, xs, context)
            return (-0.5 * ((xs.unsqueeze(1) - mean).pow(2) / var + var.log() + LOG_2PI),)

        (logc,) = self._chunks(state, xs, context, fn)  # (T, q, n, O)
        _check_finite(state, logc)
        return logc.permute(1, 2, 0, 3).reshape(q, n, -1).to(state.dtype)

    def _leave_one_out(self, state, x, observed=None):
        r""":math:`\log p(x_{t,o} \mid x_{-(t,o)})` of every token given all the other
        (observed) ones, ``(n, D)`` (zero at missing tokens), from one smoothing pass
        with every (observed) token in context.

        With :math:`\Sigma` the sequence's covariance, the conditional of token
        :math:`j` given the rest has precision :math:`(\Sigma^{-1})_{jj}` and mean
        residual :math:`(\Sigma^{-1}r)_j/(\Sigma^{-1})_{jj}` (Rasmussen & Williams
        2006, eqs. 5.10--5.12). Writing the sequence as :math:`x = Gz + v` with the
        path of states :math:`z` and the block-diagonal noise, Woodbury gives
        :math:`\Sigma^{-1} = W - WG\hat PG^\top W` (:math:`W` the noise precision,
        :math:`\hat P` the smoothed covariance of the path) and
        :math:`\Sigma^{-1}r = W(x - d - G\hat m)`; both :math:`G` and :math:`W` are
        block-diagonal over the steps, so step :math:`t`'s block is
        :math:`K_t = W_t - (C_tW_t)^\top\hat P_t(C_tW_t)` and
        :math:`u_t = (x_t - d_t - \hat m_tC_t)W_t`, and
        :math:`\log p(x_{t,o} \mid x_{-(t,o)}) = -\tfrac12(\log 2\pi - \log K_{t,oo}
        + u_{t,o}^2/K_{t,oo})`. With missing tokens :math:`W_t` is the inverse of the
        observed block of :math:`R_t` (zeros elsewhere), as in the filter's factors."""
        n, T = x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)  # (T, n, O)
        if observed is None:
            context = torch.ones_like(xs[:, :1]).unsqueeze(1)  # (T, 1, 1, O)
        else:
            context = observed.to(torch.float64).reshape(n, T, -1).transpose(0, 1).unsqueeze(1)
        ms, Ss = self._smoothed(state, xs, context)  # (T, 1, n, H), (T, 1, n, H, H)
        C, d, R = (time_first(t) for t in state.parts[5:])
        W, _ = context_precision(R, context)
        u = small_mv(xs.unsqueeze(1) - d - small_mv(ms, C), W)
        CW = small_mm(C, W)
        K = W.diagonal(dim1=-2, dim2=-1) - small_mm(Ss, CW).pow(2).sum(-2)
        # a missing token's K is 0: a placeholder keeps its (unused) term and gradient finite
        kept = context.expand(K.shape) > 0
        K = torch.where(kept, K, torch.ones((), dtype=K.dtype, device=K.device))
        logc = torch.where(kept, -0.5 * (LOG_2PI - K.log() + u.pow(2) / K), torch.zeros((), dtype=K.dtype, device=K.device))
        _check_finite(state, logc)
        return logc[:, 0].permute(1, 0, 2).reshape(n, -1)  # (n, T * O)

    @staticmethod
    def _single_targets(mask):
        """The target of each query when every query of ``mask`` ``(q, n|1, D)`` hides exactly
        one token (the ``"pll"`` schedule), ``(q, n|1)`` long; else None."""
        if mask.shape[0] == 0 or not bool((mask.sum(-1) == 1).all()):
            return None
        return mask.to(torch.uint8).argmax(-1)

    def _gathered(self, state, table, targets):
        """``table[i, targets[q, i]]``, ``(q, n)``, in the results' dtype."""
        q, n = targets.shape[0], table.shape[0]
        index = targets.expand(q, n).unsqueeze(-1)
        return table.unsqueeze(0).expand(q, -1, -1).gather(-1, index).squeeze(-1).to(state.dtype)

    def leave_one_out_log_prob(self, state, x, observed=None):
        """Every leave-one-out conditional from one smoothing pass with the whole sequence
        (its observed tokens) as context, ``(n, T * O)``; 0 at a missing token."""
        self._check_x(state, x)
        return self._leave_one_out(state, x, observed).to(state.dtype)

    def mask_sums(self, state, x, mask):
        self._check_x(state, x)
        targets = self._single_targets(mask)
        table = None if targets is None else self.leave_one_out_log_prob(state, x)
        if table is not None:
            # queries that each hide one token: every leave-one-out conditional from one
            # smoothing pass, where each query would take its own filter and smoother
            return self._gathered(state, table, targets)
        if self._dense_serves(state, mask):
            engine, dense = self._dense(state)
            return engine.mask_sums(dense, x, mask)
        return super().mask_sums(state, x, mask)

    def mask_sums_within(self, state, x, mask, context):
        self._check_x(state, x)
        targets = self._single_targets(mask)
        if targets is not None and context.shape[0] == 1:
            # one target each, the context the observed tokens: a missing target scores 0
            return self._gathered(state, self._leave_one_out(state, x, context[0].expand(x.shape)), targets)
        if self._dense_serves(state, mask, context):
            engine, dense = self._dense(state)
            return engine.mask_sums_within(dense, x, mask, context)
        return super().mask_sums_within(state, x, mask, context)

    def recomputes_mask_sums(self, state, x, mask, context=None):
        if self._single_targets(mask) is None and self._dense_serves(state, mask, context):
            engine, dense = self._dense(state)
            return engine.recomputes_mask_sums(dense, x, mask, context)
        return super().recomputes_mask_sums(state, x, mask, context)

    def weighted_mask_sum(self, state, x, mask, coef):
        if self._single_targets(mask.unsqueeze(1)) is not None or not self._dense_cheaper(state, mask.shape[0]):
            return super().weighted_mask_sum(state, x, mask, coef)
        engine, dense = self._dense(state)
        return engine.weighted_mask_sum(dense, x, mask, coef)

    def weighted_sum_elements(self, state, x, mask=None):
        """Elements of the working set per query: ``n`` for masks ``(q, D)`` that each hide
        one token (one smoothing pass serves them all), the dense engine's count for other
        masks shared by the batch that it serves (``_dense_cheaper``), else ``n * D``."""
        if mask is not None and self._single_targets(mask.unsqueeze(1)) is not None:
            # one smoothing pass serves every such query: a row of sums each
            return x.shape[0]
        if mask is None or not self._dense_cheaper(state, mask.shape[0]):
            # masks drawn per datapoint (no weighted sum of shared masks), or smoothed
            return super().weighted_sum_elements(state, x, mask)
        engine, dense = self._dense(state)
        return engine.weighted_sum_elements(dense, x, mask)

    def log_evidence(self, state, x, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``:
        the normalizer of the initial state's density times every step's factor, the steps
        multiplied in pairs (no forward message but the last, no backward pass)."""
        self._check_x(state, x)
        n, T = x.shape[0], state.num_steps
        xs = x.to(torch.float64).reshape(n, T, -1).transpose(0, 1)
        context = torch.ones_like(xs) if observed is None else observed.to(torch.float64).reshape(n, T, -1).transpose(0, 1)
        if state.explosive:
            _, value = root_filter(state.parts, chain_steps(state.parts, xs, context.unsqueeze(1)))
            _check_finite(state, value[0])
            return value[0].to(state.dtype)
        # the product of all the steps' factors, then the initial state's density: no message
        # but the last is needed (nor the smoother's backward pass)
        f = step_factors(state.parts, xs, context.unsqueeze(1))
        last = message_through(prior_message(state.parts, f.Jaa.shape[1:-2], f.c.shape[1:]), total_factor(f))
        value = log_normalizer(*last)[0]
        _check_finite(state, value)
        return value.to(state.dtype)

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: each equals :meth:`log_evidence`."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], -1)
