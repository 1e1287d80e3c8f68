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
from .mixture_chunks import others_sum

__all__ = ["DiscreteHMMConditionals", "DiscreteHMMState"]

_WHO = "conditionals='hmm'"


def _log_matmul(a, b):
    """Log-semiring matrix product over the last two dims."""
    return (a.unsqueeze(-1) + b.unsqueeze(-3)).logsumexp(-2)


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
    return (a.unsqueeze(-1) + M).logsumexp(-2)


@dataclass
class DiscreteHMMState:
    """The HMM of one evaluation, in token layout.

    :param torch.Tensor initial: log initial probabilities ``(n|1, S)``.
    :param torch.Tensor transition: log transition matrices ``(n|1, T|1, S, S)`` (old, new).
    :param torch.Tensor emission: :math:`\\log p(x_{te} \\mid h_t = s)`, ``(n, T, S, E)``;
        token ``t * E + e`` is element ``e`` of step ``t``.
    """

    initial: torch.Tensor = field(repr=False)
    transition: torch.Tensor = field(repr=False)
    emission: torch.Tensor = field(repr=False)
    num_data: int
    num_tokens: int


def _rows(t, batch_shape, tail):
    """``t`` ``(*batch, *tail)`` to ``(n|1, *tail)``: one row when it is shared."""
    lead = t.shape[: t.dim() - len(tail)]
    if all(s == 1 for s in lead):
        return t.reshape((1,) + tuple(t.shape[len(lead):]))
    return t.expand(tuple(batch_shape) + tuple(t.shape[len(lead):])).reshape((-1,) + tuple(t.shape[len(lead):]))


class DiscreteHMMConditionals(LeaveOneOutQueries, ConditionalEngine):
    r"""Exact masked conditionals of an observed ``dist.DiscreteHMM`` (forward--backward).

    Serves a model whose observed site is a ``pyro.distributions.DiscreteHMM``
    (in a plate over sequences, or alone) and that has no other latent site;
    the time steps are the tokens. The emission distribution's base must have
    no event dims (a scalar per step, or ``.to_event(1)`` elements that are
    independent given the state). See the module docstring.

    :param int max_elements: bound on ``q * n * T * S^3`` per chunk of queries.

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
                             "each sequence in the event (time) dim of the site.")
        obs = base_distribution(hmm.observation_dist)
        if obs.event_shape:
            raise EngineNotApplicable(
                f"{_WHO} needs the emissions of the DiscreteHMM at site {tokens.name!r} "
                f"to be independent elements given the state, but its observation_dist "
                f"is {type(obs).__name__} with event shape {tuple(obs.event_shape)}. Write "
                f"it as independent elements, e.g. dist.Normal(loc, scale).to_event(1)."
            )
        check_one_sequence(tokens, hmm, _WHO)
        obs_event = hmm.event_shape[1:]
        value = tokens.site_value  # (*batch, T, *obs_event), missing tokens filled
        T = value.shape[len(tokens.site_batch_shape)]
        E = max(1, tokens.num_tokens // max(T, 1))
        S = hmm.initial_logits.shape[-1]
        # the state dim sits left of the emission's event dims
        elp = obs.log_prob(value.unsqueeze(-1 - len(obs_event)))  # (*batch, T, S, *obs_event)
        elp = elp.expand(tuple(tokens.site_batch_shape) + (T, S) + tuple(obs_event))
        emission = elp.reshape(tokens.num_data, T, S, E)
        initial = _rows(hmm.initial_logits, tokens.site_batch_shape, (S,))
        trans = hmm.transition_logits
        trans = trans if trans.dim() > 2 else trans.unsqueeze(0)  # (..., T|1, S, S)
        transition = _rows(trans, tokens.site_batch_shape, trans.shape[-3:])
        return DiscreteHMMState(initial, transition, emission, tokens.num_data, tokens.num_tokens)

    def _messages(self, state, context):
        """Forward, backward messages ``(q, n, T, S)`` and ``log p(x_R)`` ``(q, n)`` for
        contexts ``(q, n|1, D)``."""
        n, T, S, E = state.emission.shape
        q = context.shape[0]
        ctx = context.reshape(q, context.shape[1], T, 1, E)
        zero = torch.zeros((), dtype=state.emission.dtype, device=state.emission.device)
        phi = torch.where(ctx, state.emission, zero).sum(-1)  # (q, n, T, S)
        M = state.transition + phi.unsqueeze(-2)  # (q, n, T, S, S)
        alpha = _messages_forward(state.initial, M)  # (q, n, T, S)
        # M_t ... M_{T-1} 0, the forward messages of the reversed, transposed chain
        zero_start = torch.zeros(S, dtype=M.dtype, device=M.device)
        suffix = _messages_forward(zero_start, M.flip(-3).transpose(-1, -2)).flip(-2)  # (q, n, T, S)
        beta = torch.cat([suffix[..., 1:, :], torch.zeros_like(suffix[..., :1, :])], -2)
        den = alpha[..., -1, :].logsumexp(-1)
        # the chain's probabilities sum to one: an empty context has normalizer 1 exactly
        den = torch.where(context.any(-1), den, torch.zeros_like(den))
        return alpha, beta, den

    def mask_log_prob(self, state, x, mask):
        self._check_x(state, x)
        n, T, S, E = state.emission.shape
        q = mask.shape[0]
        if q > 1 and bool((mask.sum(-1) == 1).all()) and bool(torch.isfinite(state.emission).all()):
            return torch.where(mask, self.leave_one_out_table(state), torch.zeros((), dtype=state.emission.dtype))
        per = max(1, self.max_elements // max(1, n * T * S**3))

        def chunk(context):
            alpha, beta, den = self._messages(state, context)
            # (qc, n, T, S, 1) + (n, T, S, E) -> sum over states
            num = (alpha + beta).unsqueeze(-1).add(state.emission).logsumexp(-2)  # (qc, n, T, E)
            return num.reshape(num.shape[0], n, T * E) - den.unsqueeze(-1)

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
        """The leave-one-out table needs finite emissions (see :meth:`leave_one_out_table`)."""
        return bool(torch.isfinite(state.emission).all())

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
        alpha, beta, _ = self._messages(state, context)
        alpha, beta = alpha[0], beta[0]  # (n, T, S)
        start = state.initial[:, None, :].expand(alpha.shape[0], 1, S)
        previous = torch.cat([start, alpha[:, :-1, :]], -2)  # alpha_{t-1}, the initial state's before step 0
        predictive = (previous.unsqueeze(-1) + state.transition).logsumexp(-2)  # (n, T, S)
        others = others_sum(state.emission, -1)  # (n, T, S, E), no difference of sums
        c = (predictive + beta).unsqueeze(-1) + others
        out = (c + state.emission).logsumexp(-2) - c.logsumexp(-2)  # (n, T, E)
        return out.reshape(out.shape[0], T * E)

    def log_evidence(self, state, x, observed=None):
        r""":math:`\log p(x_i)` (of the observed tokens when ``observed`` is given), ``(n,)``."""
        self._check_x(state, x)
        context = torch.ones_like(x, dtype=torch.bool) if observed is None else observed
        return self._messages(state, context[None])[2][0]

    def chain_sums_reads_order(self, state):
        r"""False: :meth:`chain_sums` is :math:`\log p(x)` whatever the orderings."""
        return False

    def chain_sums(self, state, x, order, observed=None):
        r"""Chain-rule sums along orderings, ``(p, n)``: each equals :meth:`log_evidence`."""
        return self.log_evidence(state, x, observed).expand(order.shape[0], -1)
