r"""The guide's proposals for the ``"importance"`` engine
(:mod:`~pyro_mpt.conditionals.importance`): one table of draws shared by every
query for a Pyro autoguide, and per-query draws from the mixture of the guide
run on imputed data (encode--decode chains), defended by a share of prior draws.
"""

import contextlib
import math

import torch

from .guide_proposals import AutoguideProposal
from .encode_decode import run_chains
from .latent_runs import LatentRunner, check_draws_log_density


def through_draws(log_q, log_q_fixed):
    r""":math:`\log q(z)` with its gradient through the draws :math:`z` alone.

    ``log_q_fixed`` is the same density at the detached draws, so its gradient is
    the guide parameters' part of ``log_q``'s; subtracting it leaves the draws'
    part (a prior draw's, which depends on the model's parameters), with the value
    unchanged. The two parts cancel to rounding, not exactly: the autoguides' proposal
    detaches the guide's distributions instead (``AutoguideProposal.log_prob`` with
    ``fixed_guide``); a guide of the user's cannot be detached generically.

    :param torch.Tensor log_q: :math:`\log q_\phi(z)` at the draws.
    :param torch.Tensor log_q_fixed: :math:`\log q_\phi(\bar z)` at the detached draws.
    :returns: a tensor equal to ``log_q`` whose gradient reaches no guide parameter.

    Example::

        >>> log_q = through_draws(proposal.log_prob(trace, values, S), proposal.log_prob(trace, fixed, S))
    """
    return log_q - log_q_fixed + log_q_fixed.detach()


def _detached(values):
    return {k: v.detach() for k, v in values.items()}


def _prior_draws(runner, like, count):
    """``count`` draws of the latents of ``like`` (name -> ``(rows, ...)``) from the prior, in
    its shapes: the defensive share of every guide proposal."""
    prior = runner.sample_prior(count)
    return {k: prior.latent_value(k).expand((count,) + v.shape[1:]) for k, v in like.items()}


def _joined(first, then):
    """Two sets of draws (name -> ``(rows, ...)``) as one, ``first``'s rows first."""
    return {k: torch.cat([v, then[k]], 0) for k, v in first.items()}


def autoguide_draws(tokens, model, guide, args, kwargs, who, num_samples, prior_weight, guide_grad=False):
    r"""The draws of one set shared by every query, for a Pyro autoguide.

    An autoguide does not read the data (its parameters are per datapoint or
    global), so imputing the masked tokens would not change it: the
    proposal is the defensive mixture :math:`\alpha p(z) + (1-\alpha) q(z)`
    for every query, and its draws form a table like the prior's, with
    per-datapoint log-weights :math:`\log p(z_s) - \log r(z_s) - \log S`.

    :param int num_samples: :math:`S`, the draws.
    :param float prior_weight: the share :math:`\alpha` of them taken from the prior.
    :param bool guide_grad: let the estimate's gradient reach the guide's parameters
        (see :class:`~pyro_mpt.conditionals.importance.ImportanceConditionals`).
    :returns: ``(runner, draw)``: the
        :class:`~pyro_mpt.conditionals.latent_runs.LatentRunner` and ``draw(start, rows)``
        -> the log-weights ``(n, rows)`` and the table ``(n, rows, D)`` of the draws
        ``start .. start + rows - 1``, as :class:`~pyro_mpt.conditionals.draw_table.DrawTable`
        takes it (the prior's share spread over the chunks so that the whole set has it).
    """
    runner = LatentRunner(tokens, model, guide, args, kwargs, None, who)
    source = AutoguideProposal(guide, runner, who)
    S = num_samples
    S_p = min(S - 1, int(round(prior_weight * S)))
    alpha = S_p / S

    def draw(start, rows):
        # this chunk's share of prior draws, so that the whole set has S_p of them
        k_p = (start + rows) * S_p // S - start * S_p // S
        # without guide_grad, the guide's distributions are made without a graph: the gradient of
        # log q reaches the prior draws alone (two paths through the guide's parameters that
        # cancel left their rounding, which Adam turned into steps of its full size)
        with torch.no_grad() if not guide_grad else contextlib.nullcontext():
            values, trace = source.sample(rows)
        if k_p:
            values = _joined({name: v[: rows - k_p] for name, v in values.items()}, _prior_draws(runner, values, k_p))
        log_q = source.log_prob(trace, values, rows, fixed_guide=not guide_grad)
        dec = runner.decode(values, rows)
        log_p = dec.log_prior()
        log_r = log_q
        if S_p:
            log_r = torch.logaddexp(log_q + math.log1p(-alpha), log_p + math.log(alpha))
        return (log_p - log_r).T - math.log(S), dec.token_log_prob(tokens.value).transpose(0, 1)

    return runner, draw


def guide_draws(runner, x, mask, init, imputed, num_samples, prior_weight, num_chains, num_iterations, guide_grad=False):
    r"""Draws of the guide proposal for masks ``(q, n|1, D)``, ``S`` per query and datapoint.

    The defensive mixture of the prior (share ``prior_weight``) and, with ``imputed``,
    the guide run on the states of ``num_chains`` encode--decode chains after
    ``num_iterations`` rounds from ``init``; else the guide on the original data.
    Without ``guide_grad`` no gradient reaches the guide's parameters (the prior
    draws keep theirs, through :func:`through_draws`).

    :returns: ``(lw0, T)``: :math:`\log p(z_s) - \log r(z_s)` ``(S, q, n)`` and
        :math:`\log p(x_d \mid z_s)` ``(S, q, n, D)``, as
        :func:`~pyro_mpt.conditionals.importance_self_normalized.self_normalized_conditionals` takes them.
    """
    S = num_samples
    q = mask.shape[0]
    n, D = x.shape
    if imputed:
        share = max(1, S - int(round(prior_weight * S)))
        C = min(num_chains, share)
        S_g = C * (share // C)
        S_p = S - S_g
        xt = run_chains(runner, x, mask, init, num_iterations, C)
        xt = xt.reshape(C * q, n, D)
        enc = runner.encode(xt, S_g // C)  # draw s = p * C + c uses chain c
        values = enc.values if guide_grad else _detached(enc.values)
        if S_p:
            values = _joined(values, _prior_draws(runner, values, S_p * q))
        if C == 1 and not S_p:
            log_r = enc.log_q.reshape(S, q, n)
            log_r = log_r if guide_grad else log_r.detach()
        else:
            scores = runner.guide_log_prob(xt, values, S)  # (S, C, q, n)
            if not guide_grad:
                scores = through_draws(scores, runner.guide_log_prob(xt, _detached(values), S)) if S_p else scores.detach()
            log_r = torch.logsumexp(scores, 1) - math.log(C)
    else:
        # the guide on the original data, q(z | x), is as narrow as the posterior given all D
        # tokens: the same defensive share of prior draws (without it the weights have no finite
        # variance, and exhaustive MPT of PPCA with the exact posterior as guide overstated
        # log p(x) by a nat a datapoint at 8192 draws)
        S_p = min(S - 1, int(round(prior_weight * S)))
        enc = runner.encode_original(S - S_p)
        values = enc.values if guide_grad else _detached(enc.values)
        log_q = enc.log_q[:, 0] if guide_grad else enc.log_q[:, 0].detach()
        if S_p:
            # one component (no chains): only the prior draws need the guide's density
            prior = _prior_draws(runner, values, S_p)
            log_q_prior = runner.guide_log_prob_original(prior, S_p)
            if not guide_grad:
                log_q_prior = through_draws(log_q_prior, runner.guide_log_prob_original(_detached(prior), S_p))
            values, log_q = _joined(values, prior), torch.cat([log_q, log_q_prior], 0)
        log_r = log_q.unsqueeze(1).expand(S, q, n)
        values = {k: v.repeat_interleave(q, 0) if q > 1 else v for k, v in values.items()}
    dec = runner.decode(values, S * q)
    log_p = dec.log_prior().reshape(S, q, n)
    if S_p:
        alpha = S_p / S
        log_r = torch.logaddexp(log_r + math.log1p(-alpha), log_p + math.log(alpha))
    T = dec.token_log_prob(x).reshape(S, q, n, D)
    check_draws_log_density(runner, T, "the guide and the prior" if S_p else "the guide")
    return log_p - log_r, T
