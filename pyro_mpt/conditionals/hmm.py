r"""Exact masked conditionals of an observed ``dist.DiscreteHMM``, by forward--backward.

The tokens of a datapoint are the time steps of a sequence (and, for a vector
emission written as independent elements, the elements of each step). The
hidden chain :math:`h_{-1} \sim \pi`, :math:`h_t \mid h_{t-1} \sim A_t` is
summed inside the distribution, so a context :math:`\mathcal R` is scored by
the forward algorithm with the emissions of the other tokens left out (their
log-probabilities set to 0). With

.. math::

    M_t[i, j] = \log A_t[i, j] + \phi_t(j), \qquad
    \phi_t(j) = \sum_{e:\,(t, e) \in \mathcal R} \log p(x_{te} \mid h_t = j),

the forward messages :math:`\alpha_t = \pi \otimes M_0 \otimes \dots \otimes M_t`
and backward messages :math:`\beta_t = M_{t+1} \otimes \dots \otimes M_{T-1}
\otimes 0` (:math:`\otimes` the log-semiring matrix product) give, for a target
token :math:`j = (t, e) \notin \mathcal R`,

.. math::

    \log p(x_j \mid x_{\mathcal R}) =
      \operatorname{logsumexp}_s\big[\alpha_t(s) + \beta_t(s) + \log p(x_j \mid h_t = s)\big]
    - \operatorname{logsumexp}_s \alpha_{T-1}(s).

The messages are computed in blocks of about :math:`\sqrt T` steps
(``_messages_forward``: about :math:`3\sqrt T` batched steps, :math:`O(TS^3)`
work), vectorized over queries and datapoints, or step by step (:math:`T` batched
steps, :math:`O(TS^2)` work) when a step's tables hold ``SEQUENTIAL_ELEMENTS`` or more
(many masks: ``masks="all"`` on 200 sequences of 50 steps, S = 4, went from 4.2 to
1.0 s a step, 55x ``DiscreteHMM.log_prob`` for its 50 masks); the exhaustive schedule
and every ordering therefore equal :math:`\log p(x)` (``DiscreteHMM.log_prob``) to
rounding.

**Correlated emissions.** A ``MultivariateNormal`` ``observation_dist`` (full
covariance :math:`\Sigma_s` per state) has elements that are not independent given the
state: :math:`\phi_t(j)` is then the log-density of the step's context elements
:math:`C_t` under their marginal :math:`\mathcal N(\mu_{s,C}, \Sigma_{s,CC})`, and a
target element's term is its Gaussian conditional given them,
:math:`\log \mathcal N(x_{te};\ \mu_{s,e} + \Sigma_{s,eC}\Sigma_{s,CC}^{-1}(x_{C} - \mu_{s,C}),\
\Sigma_{s,ee} - \Sigma_{s,eC}\Sigma_{s,CC}^{-1}\Sigma_{s,Ce})` (``_gaussian_step_terms``:
one Cholesky factor per query, datapoint, step and state, of the covariance with the
elements outside :math:`C_t` replaced by the identity).

An HMM written the Pyro-tutorial way (``for t in pyro.markov(range(T))`` with
one observed site per step) has its tokens in several sites; write it as one
``dist.DiscreteHMM`` site instead (the tutorial's model with
``initial_logits``, ``transition_logits`` and an ``observation_dist`` whose
batch shape ends in the number of states).
"""

import math
from dataclasses import dataclass, field

import torch
import pyro.distributions as dist

from ..recompute import recomputed
from .base import ConditionalEngine, EngineNotApplicable
from .distributions import base_distribution, check_one_sequence, check_sequence_alone
from .leave_one_out_queries import LeaveOneOutQueries
from .mixture_chunks import others_sum, stable_logsumexp

__all__ = ["DiscreteHMMConditionals", "DiscreteHMMState", "DiscreteHMMMixture", "discrete_hmm_state"]

_WHO = "conditionals='hmm'"
#: emissions with correlated elements, served through their covariance
_CORRELATED = (torch.distributions.MultivariateNormal, torch.distributions.LowRankMultivariateNormal)


def _log_matmul(a, b):
    """Log-semiring matrix product over the last two dims."""
    return stable_logsumexp(a.unsqueeze(-1) + b.unsqueeze(-3), -2)


#: elements of one step's ``(..., S, S)`` table from which the messages run step by step
SEQUENTIAL_ELEMENTS = 2**14


def _messages_forward(start, M):
    r"""The messages :math:`a_t = a \otimes M_0 \otimes \dots \otimes M_t`, ``(..., T, S)``, of
    ``start`` :math:`a` ``(..., S)`` through ``M`` ``(..., T, S, S)``, in blocks of
    :math:`b = \lceil\sqrt T\,\rceil` steps: each block's product (:math:`b` steps over
    all blocks at once), the messages entering the blocks (one step a block), then the
    messages inside them (:math:`b` steps over all blocks at once).

    About :math:`3\sqrt T` batched steps and :math:`O(TS^3)` work; a parallel scan over
    all prefixes takes :math:`\log_2 T` steps but :math:`O(TS^3\log T)` work in
    ``(..., T, S, S, S)`` temporaries (measured: 5-10x slower at T = 30). Where one
    step's ``(..., S, S)`` table holds ``SEQUENTIAL_ELEMENTS`` or more, the messages
    run step by step instead: :math:`T` batched steps, :math:`O(TS^2)` work."""
    T, S = M.shape[-3], M.shape[-1]
    if M[..., 0, :, :].numel() >= SEQUENTIAL_ELEMENTS:
        # a large batch: T vector-matrix steps do S times less work than the blocks, and
        # each step's tables are large enough that its kernels' fixed cost does not matter
        # (unbind: indexing a step at a time, the backward pass made a zero gradient of M's
        # full size per step)
        a = start.expand(M.shape[:-3] + (S,))
        out = []
        for Mt in M.unbind(-3):
            a = _log_vecmat(a, Mt)
            out.append(a)
        return torch.stack(out, -2)
    b = math.isqrt(T - 1) + 1 if T > 1 else 1
    B = -(-T // b)
    if B * b > T:
        # identity steps at the end (0 on the diagonal, -inf off it in the log semiring)
        eye = torch.full((S, S), -math.inf, dtype=M.dtype, device=M.device).fill_diagonal_(0)
        M = torch.cat([M, eye.expand(M.shape[:-3] + (B * b - T, S, S))], -3)
    steps = M.reshape(M.shape[:-3] + (B, b, S, S)).unbind(-3)  # b tables (..., B, S, S)
    block = steps[0]
    for Mi in steps[1:]:
        block = _log_matmul(block, Mi)
    a = start.expand(M.shape[:-3] + (S,))
    entering = []
    for Mk in block.unbind(-3):
        entering.append(a)
        a = _log_vecmat(a, Mk)
    a = torch.stack(entering, -2)  # (..., B, S)
    inside = []
    for Mi in steps:
        a = _log_vecmat(a, Mi)
        inside.append(a)
    return torch.stack(inside, -2).reshape(M.shape[:-3] + (B * b, S))[..., :T, :]


def _log_vecmat(a, M):
    """Log-semiring vector-matrix product ``a (..., S)`` by ``M (..., S, S)``."""
    return stable_logsumexp(a.unsqueeze(-1) + M, -2)


@dataclass
class DiscreteHMMState:
    """The HMM of one evaluation, in token layout: one chain a datapoint, or a finite mixture
    of chains (:func:`discrete_hmm_state` with ``log_weights``), whose rows are then the
    components' datapoints, component-major (row ``k * n + i``).

    :param torch.Tensor initial: log initial probabilities ``(rows|1, S)``.
    :param torch.Tensor transition: log transition matrices ``(rows|1, T|1, S, S)`` (old, new).
    :param torch.Tensor emission: :math:`\\log p(x_{te} \\mid h_t = s)`, ``(rows, T, S, E)``;
        token ``t * E + e`` is element ``e`` of step ``t``.
    :param torch.Tensor log_weights: the components' :math:`\\log p(k)` ``(K, n)``, or None
        for one chain a datapoint (``rows = n``).
    :param tuple gaussian: for a ``MultivariateNormal`` emission, ``(diff, cov)``: the tokens
        less each state's mean ``(rows, T, S, E)`` and the states' covariances
        ``(rows|1, T|1, S, E, E)``; ``emission`` then holds each element's own marginal.
        None for independent elements.
    """

    initial: torch.Tensor = field(repr=False)
    transition: torch.Tensor = field(repr=False)
    emission: torch.Tensor = field(repr=False)
    num_data: int
    num_tokens: int
    log_weights: torch.Tensor = field(default=None, repr=False)
    gaussian: tuple = field(default=None, repr=False)

    def mixed(self, lp, tail=0):
        """``lp`` ``(..., rows, *tail)``, log-densities of the rows (``tail`` trailing dims
        after them), as log-densities of the datapoints ``(..., n, *tail)``: summed over the
        components with their weights; unchanged for one chain a datapoint."""
        if self.log_weights is None:
            return lp
        K, n = self.log_weights.shape
        at = lp.dim() - 1 - tail
        lw = self.log_weights.reshape((K, n) + (1,) * tail)
        return stable_logsumexp(lp.unflatten(at, (K, n)) + lw, at)


def _gaussian_step_terms(diff, cov, context):
    """Each step's context log-density and each element's conditional given it, for
    ``MultivariateNormal`` emissions: ``context`` bool ``(q, rows|1, T, E)`` -> ``phi``
    ``(q, rows, T, S)`` and ``cond`` ``(q, rows, T, S, E)`` (arbitrary finite numbers at
    the context's own elements, which are no targets)."""
    c = context.unsqueeze(-2).to(diff.dtype)  # (q, rows|1, T, 1, E)
    # the context block of the covariance, the identity elsewhere: its factor gives the
    # context's marginal and, by solves, every other element's regression on the context
    masked = c.unsqueeze(-1) * cov * c.unsqueeze(-2) + torch.diag_embed(1 - c)
    chol = torch.linalg.cholesky(masked)
    cd = c * diff  # (q, rows, T, S, E)
    y = torch.cholesky_solve(cd.unsqueeze(-1), chol)  # Sigma_CC^{-1} d_C, 0 elsewhere
    half_log_det = chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    phi = -0.5 * (cd.unsqueeze(-1) * y).sum((-1, -2)) - half_log_det - 0.5 * math.log(2 * math.pi) * c.sum(-1)
    rows_c = c.unsqueeze(-1) * cov  # the covariance's context rows
    mean = (cov @ (c.unsqueeze(-1) * y)).squeeze(-1)  # Sigma_eC Sigma_CC^{-1} d_C
    var = cov.diagonal(dim1=-2, dim2=-1) - (rows_c * torch.cholesky_solve(rows_c, chol)).sum(-2)
    var = torch.where(c > 0, torch.ones_like(var), var).clamp_min(torch.finfo(var.dtype).tiny)
    cond = -0.5 * ((diff - mean) ** 2 / var + torch.log(2 * math.pi * var))
    return phi, cond


def _rows(t, lead, tail, mixture):
    """``t`` ``(*lead, *tail)`` (``lead``: the components' dims, then the plates') to
    ``(rows|1, *tail)``: one row when every component and datapoint shares it, else a row
    per datapoint, component-major with ``mixture``."""
    t = t.reshape((1,) * (len(lead) + len(tail) - t.dim()) + tuple(t.shape))
    tail = tuple(t.shape[len(lead):])
    if all(s == 1 for s in t.shape[: len(lead)]) and not mixture:
        return t.reshape((1,) + tail)
    return t.expand(tuple(lead) + tail).reshape((-1,) + tail)


def discrete_hmm_state(tokens, hmm, enum_shape=(), log_weights=None):
    r"""The :class:`DiscreteHMMState` of the ``dist.DiscreteHMM`` ``hmm`` at the observed site.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param hmm: the site's ``DiscreteHMM``, its batch shape the site's; or, for a mixture of
        chains, the one of a run under Pyro's parallel enumeration, with the discrete latents'
        values in the dims ``enum_shape`` left of ``tokens.max_plate_nesting`` plate dims.
    :param tuple enum_shape: the enumeration dims' sizes, :math:`K` values in all.
    :param torch.Tensor log_weights: the components' :math:`\log p(k)` ``(K, n)``, with ``enum_shape``.
    :returns: :class:`DiscreteHMMState`, with ``K n`` rows for a mixture.

    Example::

        >>> state = discrete_hmm_state(tokens, base_distribution(tokens.site["fn"]))
    """
    obs = base_distribution(hmm.observation_dist)
    obs_event = tuple(hmm.event_shape[1:])
    value = tokens.site_value  # (*batch, T, *obs_event), missing tokens filled
    batch = tuple(tokens.site_batch_shape)
    T = value.shape[len(batch)]
    E = max(1, tokens.num_tokens // max(T, 1))
    S = hmm.initial_logits.shape[-1]
    mixture = log_weights is not None
    if mixture:
        mpn = tokens.max_plate_nesting
        lead = tuple(enum_shape) + (1,) * (mpn - len(batch)) + batch
    else:
        lead = batch
    # the state dim sits left of the emission's event dims
    gaussian = None
    if isinstance(obs, _CORRELATED):
        # each element's own marginal stands in the emission table; the steps' terms come
        # from the covariances (_gaussian_step_terms)
        cov = obs.covariance_matrix
        diff = value.unsqueeze(-2) - obs.loc  # (*lead, T, S, E)
        diff = diff.reshape((1,) * (len(lead) + 3 - diff.dim()) + tuple(diff.shape))
        diff = diff.expand(lead + (T, S, E)).reshape(-1, T, S, E)
        var = cov.diagonal(dim1=-2, dim2=-1)
        elp = -0.5 * (diff**2 / var + torch.log(2 * math.pi * var))
        emission = elp.expand(diff.shape)
        cov = cov.reshape((1,) * (len(lead) + 4 - cov.dim()) + tuple(cov.shape))
        gaussian = (diff, cov.expand(lead + cov.shape[-4:]).reshape((-1,) + cov.shape[-4:]))
    else:
        elp = obs.log_prob(value.unsqueeze(-1 - len(obs_event)))  # (*lead, T, S, *obs_event)
        elp = elp.reshape((1,) * (len(lead) + 2 + len(obs_event) - elp.dim()) + tuple(elp.shape))
        emission = elp.expand(lead + (T, S) + obs_event).reshape(-1, T, S, E)
    initial = _rows(hmm.initial_logits, lead, (S,), mixture)
    trans = hmm.transition_logits
    trans = trans if trans.dim() > 2 else trans.unsqueeze(0)  # (..., T|1, S, S)
    transition = _rows(trans, lead, trans.shape[-3:], mixture)
    return DiscreteHMMState(initial, transition, emission, tokens.num_data, tokens.num_tokens,
                            None if log_weights is None else log_weights.reshape(-1, tokens.num_data), gaussian)


class DiscreteHMMConditionals(LeaveOneOutQueries, ConditionalEngine):
    r"""Exact masked conditionals of an observed ``dist.DiscreteHMM`` (forward--backward).

    Serves a model whose observed site is a ``pyro.distributions.DiscreteHMM``
    (in a plate over sequences, or alone) and that has no other latent site;
    the time steps are the tokens. The emission distribution's base must have
    no event dims (a scalar per step, or ``.to_event(1)`` elements that are
    independent given the state) or be a ``MultivariateNormal`` (correlated
    elements, each a token). See the module docstring.

    :param int max_elements: bound on ``q * n * T * S^3`` per chunk of queries (``q * n * T * S * E^2``
        where that is larger, for MultivariateNormal emissions of E elements).

    Example::

        >>> def hmm(x):
        ...     with pyro.plate("sequences", x.shape[0]):
        ...         pyro.sample("x", dist.DiscreteHMM(init_logits, trans_logits,
        ...                                           dist.Normal(locs, scale)), obs=x)
        >>> MaskedPretrainingLoss(conditionals="hmm", masks="order").score(hmm, None, x)
    """

    def prepare(self, tokens, model, guide, args, kwargs):
        hmm = base_distribution(tokens.site["fn"])
        if not isinstance(hmm, dist.DiscreteHMM):
            raise EngineNotApplicable(
                f"{_WHO} needs observed site {tokens.name!r} to be a dist.DiscreteHMM "
                f"(time steps as tokens); it is {type(hmm).__name__}."
            )
        check_sequence_alone(tokens, hmm, _WHO, "sums", ". Make the other latents pyro.params, and keep "
                             "each sequence in the event (time) dim of the site; discrete latents "
                             "a sequence (a mixture of HMMs) are summed by conditionals='enumerate'.")
        obs = base_distribution(hmm.observation_dist)
        if obs.event_shape and not (isinstance(obs, _CORRELATED) and len(obs.event_shape) == 1):
            raise EngineNotApplicable(
                f"{_WHO} needs the emissions of the DiscreteHMM at site {tokens.name!r} "
                f"to be independent elements given the state, or a MultivariateNormal, but its "
                f"observation_dist is {type(obs).__name__} with event shape {tuple(obs.event_shape)}. "
                f"Write it as independent elements (e.g. dist.Normal(loc, scale).to_event(1)) or as a "
                f"MultivariateNormal, or use Evidence(method='importance') for its log p(x)."
            )
        check_one_sequence(tokens, hmm, _WHO)
        return discrete_hmm_state(tokens, hmm)

    def _messages(self, state, context):
        """Forward, backward messages ``(q, rows, T, S)``, ``log p(x_R)`` ``(q, rows)`` and each
        token's term given its step's context and state ``(q|1, rows, T, S, E)``, for contexts
        ``(q, n|1, D)`` (each component's rows read their datapoint's)."""
        n, T, S, E = state.emission.shape
        q = context.shape[0]
        if state.log_weights is not None and context.shape[1] > 1:
            # every component's rows see their datapoint's context
            K = state.log_weights.shape[0]
            context = context.unsqueeze(1).expand(q, K, context.shape[1], context.shape[2]).reshape(q, n, -1)
        if state.gaussian is None:
            ctx = context.reshape(q, context.shape[1], T, 1, E)
            zero = torch.zeros((), dtype=state.emission.dtype, device=state.emission.device)
            phi = torch.where(ctx, state.emission, zero).sum(-1)  # (q, n, T, S)
            cond = state.emission
        else:
            phi, cond = _gaussian_step_terms(*state.gaussian, context.reshape(q, context.shape[1], T, E))
        M = state.transition + phi.unsqueeze(-2)  # (q, n, T, S, S)
        alpha = _messages_forward(state.initial, M)  # (q, n, T, S)
        # M_t ... M_{T-1} 0, the forward messages of the reversed, transposed chain
        zero_start = torch.zeros(S, dtype=M.dtype, device=M.device)
        suffix = _messages_forward(zero_start, M.flip(-3).transpose(-1, -2)).flip(-2)  # (q, n, T, S)
        beta = torch.cat([suffix[..., 1:, :], torch.zeros_like(suffix[..., :1, :])], -2)
        den = stable_logsumexp(alpha[..., -1, :], -1)
        # the chain's probabilities sum to one: an empty context has normalizer 1 exactly
        den = torch.where(context.any(-1), den, torch.zeros_like(den))
        return alpha, beta, den, cond

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        n, T, S, E = state.emission.shape
        q = mask.shape[0]
        if q > 1 and bool((mask.sum(-1) == 1).all()) and self.serves_leave_one_out(state):
            return torch.where(mask, self.leave_one_out_table(state), torch.zeros((), dtype=state.emission.dtype))
        # correlated emissions hold a (q, n, T, S, E, E) factor per chunk as well
        width = S**3 if state.gaussian is None else max(S**3, S * E * E)
        per = max(1, self.max_elements // max(1, n * T * width))

        def chunk(context):
            alpha, beta, den, cond = self._messages(state, context)
            # (qc, n, T, S, 1) + (qc|1, n, T, S, E) -> sum over states
            num = stable_logsumexp((alpha + beta).unsqueeze(-1).add(cond), -2)  # (qc, n, T, E)
            num = state.mixed(num.reshape(num.shape[0], n, T * E), tail=1)
            return num - state.mixed(den).unsqueeze(-1)

        # several chunks are recomputed in the backward pass: each keeps its (qc, n, T, S, S)
        # tables for it, a few times max_elements, and a block of a schedule holds many
        # (masks='all', S = 6, 100 sequences of 100 steps: 2.4 GB peak kept, one block)
        recompute = q > per and torch.is_grad_enabled()
        out = []
        for start in range(0, q, per):
            context = ~mask[start : start + per]
            out.append(recomputed(chunk, context) if recompute else chunk(context))
        return torch.cat(out, 0)

    def serves_leave_one_out(self, state):
        """The leave-one-out table needs finite emissions of independent elements (see
        :meth:`leave_one_out_table`)."""
        return state.gaussian is None and bool(torch.isfinite(state.emission).all())

    def leave_one_out_table(self, state):
        r""":math:`\log p(x_j \mid x_{-j})` for every token ``j``, ``(n, D)``, from one
        forward--backward pass over the whole sequence (queries that each hide one token,
        e.g. the ``"pll"`` schedule, need no pass of their own): with the predictive
        :math:`\pi_t(s) = \operatorname{logsumexp}_{s'}[\alpha_{t-1}(s') + \log A_t(s', s)]`
        and :math:`c_{te}(s) = \pi_t(s) + \beta_t(s) + \sum_{e' \ne e} \log p(x_{te'} \mid s)`,
        :math:`\log p(x_{te} \mid x_{-te}) = \operatorname{logsumexp}_s[c_{te}(s) + \log p(x_{te} \mid s)]
        - \operatorname{logsumexp}_s c_{te}(s)`, the other elements' sums by
        :func:`~pyro_mpt.conditionals.mixture_chunks.others_sum`. Needs finite emissions."""
        n, T, S, E = state.emission.shape
        context = torch.ones((1, 1, T * E), dtype=torch.bool, device=state.emission.device)
        alpha, beta = self._messages(state, context)[:2]
        alpha, beta = alpha[0], beta[0]  # (n, T, S)
        start = state.initial[:, None, :].expand(alpha.shape[0], 1, S)
        previous = torch.cat([start, alpha[:, :-1, :]], -2)  # alpha_{t-1}, the initial state's before step 0
        predictive = stable_logsumexp(previous.unsqueeze(-1) + state.transition, -2)  # (n, T, S)
        others = others_sum(state.emission, -1)  # (n, T, S, E), no difference of sums
        c = (predictive + beta).unsqueeze(-1) + others
        out = stable_logsumexp(c + state.emission, -2) - stable_logsumexp(c, -2)  # (n, T, E)
        out = out.reshape(out.shape[0], T * E)
        if state.log_weights is None:
            return out
        # a mixture of chains: log p(x) - log p(x_-j), each a sum over the components of
        # p_k(x) and of p_k(x_-j) = p_k(x) / p_k(x_j | x_-j)
        full = stable_logsumexp(alpha[:, -1], -1)  # (rows,) log p_k(x)
        return state.mixed(full).unsqueeze(-1) - state.mixed(full.unsqueeze(-1) - out, tail=1)

    def log_evidence(self, state, x, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        self._check_x(state, x)
        context = torch.ones_like(x, dtype=torch.bool) if observed is None else observed
        return state.mixed(self._messages(state, context[None])[2][0])

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: each equals :meth:`log_evidence`."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], -1)


class DiscreteHMMMixture:
    r"""A finite mixture of ``DiscreteHMM`` chains per datapoint, with the interface of
    :class:`~pyro_mpt.conditionals.mixture.MixtureTable` that
    :class:`~pyro_mpt.conditionals.EnumerateConditionals` reduces (a class latent that
    selects a sequence's transition matrix: a mixture of HMMs). Every conditional is a ratio
    of sums over the components of each chain's forward--backward sums,

    .. math::

        p(x_j \mid x_{\mathcal R}) = \frac{\sum_k w_k\, p_k(x_j, x_{\mathcal R})}
            {\sum_k w_k\, p_k(x_{\mathcal R})},

    computed by :class:`DiscreteHMMConditionals` on the components' rows.

    :param DiscreteHMMState state: from :func:`discrete_hmm_state` with ``log_weights``.
    :param torch.Tensor x: the tokens ``(n, D)``.
    :param int max_elements: as :class:`DiscreteHMMConditionals`'.

    Example::

        >>> mixture = DiscreteHMMMixture(discrete_hmm_state(tokens, hmm, enum_shape, log_w), tokens.value)
        >>> mixture.log_evidence()   # (n,)
    """

    def __init__(self, state, x, max_elements=2**24):
        self.state, self.x = state, x
        self.engine = DiscreteHMMConditionals(max_elements=max_elements)

    def log_conditionals(self, context):
        r""":math:`\log p(x_j \mid x_{\mathcal R_q})` for boolean contexts ``(q, n|1, D)``, ``(q, n, D)``."""
        return self.engine.mask_log_prob(self.state, self.x, ~context)

    def serves_leave_one_out(self):
        """Whether :meth:`leave_one_out` gives its table (finite emissions)."""
        return self.engine.serves_leave_one_out(self.state)

    def leave_one_out(self):
        r""":math:`\log p(x_j \mid x_{-j})` ``(n, D)`` from one forward--backward pass, or None."""
        return self.engine.leave_one_out_table(self.state) if self.serves_leave_one_out() else None

    def chain_log_prob(self, order):
        """Chain-rule terms along orderings ``(p, n|1, D)``, ``(p, n, D)``."""
        return self.engine.chain_log_prob(self.state, self.x, order)

    def log_evidence(self, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        return self.engine.log_evidence(self.state, self.x, observed)
