r"""Self-normalized importance sampling of every token's log-conditional, with a
hand-written backward: the kernel of the ``"importance"`` engine's guide proposal
(:mod:`~pyro_mpt.conditionals.importance`).
"""

import torch

from .written_backward import first_order_backward


class SelfNormalized(torch.autograd.Function):
    r"""Self-normalized importance-sampled log-conditionals with a hand-written backward.

    With log-weights :math:`\ell_s = \ell^0_s + \sum_d c_d T_{sd}` (:math:`c` the
    context indicator), :math:`\omega_s = \operatorname{softmax}_s \ell_s` and
    :math:`\pi_{sd} = \operatorname{softmax}_s(\ell_s + T_{sd})`,

    .. math::

        o_d = \log\sum_s e^{\ell_s + T_{sd}} - \log\sum_s e^{\ell_s}, \qquad
        \frac{\partial L}{\partial T_{sd}} = G_d \pi_{sd} + c_d\, r_s, \quad
        \frac{\partial L}{\partial \ell^0_s} = r_s = \sum_d G_d (\pi_{sd} - \omega_s)

    for an upstream gradient :math:`G = \partial L / \partial o`. The table
    :math:`\pi` (``S q n D`` entries) is formed once, in place, and kept for the
    backward; autograd through ``logsumexp`` would form and keep several such
    tables and pass over them many times more.

    Inputs: ``lw0`` ``(S, q, n)``, ``T`` ``(S, q, n, D)``, ``ctx`` ``(q, n, D)``.
    Outputs: ``out`` ``(q, n, D)``; and, detached, the log-weights ``(S, q, n)``,
    :math:`\omega` ``(S, q, n)``, :math:`\sum_s \pi_{sd}^2` and
    :math:`\sum_s \pi_{sd}\omega_s` ``(q, n, D)`` for the diagnostics.
    """

    @staticmethod
    def forward(fctx, lw0, T, ctx):
        lw = lw0 + torch.einsum("sqnd,qnd->sqn", T, ctx)
        den = torch.logsumexp(lw, 0)
        omega = torch.exp(lw - den)
        pi = T + lw.unsqueeze(-1)
        m = pi.amax(0)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        pi.sub_(m).exp_()
        Z = pi.sum(0)
        pi.div_(Z.clamp_min(torch.finfo(Z.dtype).tiny))  # a token impossible under every draw: pi = 0
        out = Z.log_() + m - den.unsqueeze(-1)
        sum_pi2 = torch.einsum("sqnd,sqnd->qnd", pi, pi)
        sum_pi_omega = torch.einsum("sqnd,sqn->qnd", pi, omega)
        fctx.save_for_backward(pi, omega, ctx)
        fctx.mark_non_differentiable(lw, omega, sum_pi2, sum_pi_omega)
        return out, lw, omega, sum_pi2, sum_pi_omega

    @staticmethod
    @first_order_backward
    def backward(fctx, G, *_):
        pi, omega, ctx = fctx.saved_tensors
        r = torch.einsum("sqnd,qnd->sqn", pi, G) - omega * G.sum(-1)
        grad_T = (pi * G).addcmul_(ctx, r.unsqueeze(-1)) if fctx.needs_input_grad[1] else None
        return r if fctx.needs_input_grad[0] else None, grad_T, None


def self_normalized_conditionals(lw0, T, ctx):
    r"""Self-normalized importance-sampled log-conditionals of every token, with their weights.

    :param torch.Tensor lw0: :math:`\log p(z_s) - \log r(z_s)` per draw, query and
        datapoint, ``(S, q, n)``.
    :param torch.Tensor T: :math:`\log p(x_d \mid z_s)`, ``(S, q, n, D)``.
    :param torch.Tensor ctx: 1.0 at context tokens, 0.0 at targets, ``(q, n, D)``.
    :returns: ``(out, lw, omega, sum_pi2, sum_pi_omega)``: the log-conditionals
        ``(q, n, D)`` (differentiable in ``lw0`` and ``T``), and, detached, the
        log-weights and normalized weights ``(S, q, n)`` and
        :math:`\sum_s \pi_{sd}^2`, :math:`\sum_s \pi_{sd}\omega_s` ``(q, n, D)``.

    Example::

        >>> out = self_normalized_conditionals(lw0, T, (~mask).to(T.dtype))[0]
    """
    return SelfNormalized.apply(lw0, T, ctx)
