r"""The aggregated form of masks with few targets, from blocks of the precision matrix.

For a Gaussian :math:`\mathcal N(\mu, \Sigma)` with precision :math:`P = \Sigma^{-1}`,
the targets :math:`\mathcal M` of a mask given its context :math:`\mathcal R`
have the conditional covariance :math:`C = P_{\mathcal M\mathcal M}^{-1}` and the
conditional residual

.. math::

    d = x_{\mathcal M} - \mathbb E[x_{\mathcal M} \mid x_{\mathcal R}]
      = C\,(P(x - \mu))_{\mathcal M},

so the mask's weighted sum of squared residuals over its targets,
:math:`\sum_j a\,d_j^2/v_j` with :math:`v = \operatorname{diag}(C)`, is the quadratic form
:math:`u_{\mathcal M}^\top\, C W C\, u_{\mathcal M}` in :math:`u = P(x - \mu)`, with
:math:`W = \operatorname{diag}(a/v)`. Summed over masks it is one form
:math:`u^\top A u` whose :math:`A` gathers each mask's :math:`M\times M` block
:math:`CWC` at its targets: an :math:`M\times M` factorization a mask, where the
context side (:class:`~pyro_mpt.conditionals.gaussian_lowrank_form.LowRankForm`)
costs :math:`O(RD(D + R))` a mask whatever its size. Masks with few targets are
therefore cheaper here (:func:`target_form_cheaper`), the others there; the
engine splits a schedule between the two
(:func:`~pyro_mpt.conditionals.gaussian_aggregated.lowrank_weighted_sum`). For
:math:`\Sigma = FF^\top + \Psi`, :math:`u = \Psi^{-1}e` with the centred residual
:math:`e = r - F\hat z` (:math:`P r = \Psi^{-1}(r - F\Lambda_0^{-1}F^\top\Psi^{-1}r)`),
so no large terms cancel in :math:`u`.
"""

import math

import torch

from .gaussian_linalg import LOG_2PI, cholesky, posterior_precision_factor, tril_inverse_transposed
from .written_backward import first_order_backward

__all__ = [
    "TargetBlockForm", "lowrank_precision", "target_form_cheaper", "target_form_condition", "target_form_groups",
    "target_form_possible", "target_form_split",
]

#: measured costs, in the units in which the context side costs ``R D (D + 3R)`` a mask (its
#: matrix products run near the machine's rate): a target block of ``M`` tokens about
#: ``TARGET_UNIT * M**3 + TARGET_OVERHEAD``, with one thread or two,
#: and a call that takes any about ``TARGET_CALL`` more (the precision, the groups); measured at
#: D = 50, K = 20, ``"all"``: 7.6 ms without the blocks, 10 ms with 14 masks there, where the
#: masks save less than that
TARGET_UNIT = 3.0
TARGET_OVERHEAD = 1e5
TARGET_CALL = 2e7
#: a group's fixed steps (gathers, factorization calls, the backward pass's) against a block of
#: M tokens, in units of M^3: measured 0.2 ms a group against 0.4 ms a block at M = 100
TARGET_GROUP = 5e5
#: a group of blocks of ``Mp`` tokens takes its conditional covariances from the context's
#: ``R x R`` precision (:class:`TargetBlockForm` with ``factor``) where ``Mp**3 >= CONTEXT_ROUTE * R**2 * D``
#: (0.5 since that route's factorizations run in one batch for all its groups: PPCA D = 200, K = 50,
#: float32, one thread, blocks of 63 to 77 tokens moved there: the form 0.6 ms faster; float64 and
#: D = 512 unchanged)
CONTEXT_ROUTE = 0.5


def target_form_possible(P, D, R):
    """Whether any of ``P`` masks could repay the target blocks at all: the most one
    mask can save (one target) times ``P`` against the call's fixed cost, from the
    sizes alone (no look at the masks).

    Example::

        >>> target_form_possible(10, D=10, R=2), target_form_possible(200, D=200, R=50)
        (False, True)
    """
    return P * _saving(1, D, R) >= TARGET_CALL


def _saving(M, D, R):
    # a mask's context-side cost less its target block's. The unit is not scaled by torch's
    # threads: it was (the blocks' factorizations run on about one thread), but with two threads
    # a unit of 3 beat 6 on this project's current machine (PPCA, "all" shared, loss + gradient,
    # interleaved medians: D = 200, K = 50 float32 107 -> 96 ms, 104 masks on the blocks instead
    # of 82; D = 512 float32 684 -> 635 ms; float64 and D = 100 within the noise), and 3 stays
    # the one-thread choice
    return R * D * (D + 3 * R) - TARGET_UNIT * M**3 - TARGET_OVERHEAD


def target_form_cheaper(M, D, R):
    r"""Bool tensor like ``M``: the masks whose ``M`` targets cost less as target blocks
    (:math:`\propto M^3`, plus a fixed cost) than on the low-rank context side
    (:math:`\propto RD(D + 3R)`); none where their savings would not repay the call's
    fixed cost.

    :param torch.Tensor M: long ``(P,)``, the masks' numbers of targets.
    :param int D: tokens.
    :param int R: rank of the covariance's low-rank factor.
    :returns: bool ``(P,)``.

    Example::

        >>> target_form_cheaper(torch.tensor([2] * 10 + [150]), D=200, R=50)   # 10 x True, False
        >>> target_form_cheaper(torch.tensor([2]), D=200, R=50)   # False: one mask saves too little
    """
    saving = _saving(M.to(torch.float64), D, R)
    small = saving >= 0
    return small if float(saving[small].sum()) >= TARGET_CALL else torch.zeros_like(small)


def target_form_condition(F, psi):
    r"""A bound on the condition number of every target block :math:`P_{\mathcal M\mathcal M}`
    of :math:`P = (FF^\top + \Psi)^{-1}`: its eigenvalues lie between
    :math:`\lambda_{\min}(P) \ge 1/(\psi_{\max} + \|F\|_2^2)` and :math:`1/\psi_{\min}`.

    :param torch.Tensor F: the covariance's low-rank factor, ``(D, R)``.
    :param torch.Tensor psi: its diagonal, ``(D,)``.
    :returns: float, :math:`(\psi_{\max} + \|F\|_2^2)/\psi_{\min}`.

    Example::

        >>> target_form_condition(torch.zeros(3, 0), torch.tensor([1.0, 2.0, 4.0]))   # 4.0
    """
    with torch.no_grad():
        F, psi = F.double(), psi.double()
        if not bool(torch.isfinite(F).all() and torch.isfinite(psi).all()):
            # no blocks: the context side meets non-finite parameters as before (and eigvalsh
            # would stop with a LAPACK convergence error)
            return float("inf")
        top = torch.linalg.eigvalsh(F.T @ F)[-1] if F.shape[-1] else F.new_zeros(())
        return float((psi.max() + top) / psi.min())


def target_form_split(F, psi, mask, tolerance):
    r"""Bool ``(P,)``: the masks that take target blocks, for :math:`\Sigma = FF^\top + \Psi`:
    those :func:`target_form_cheaper` picks, where the blocks keep ``tolerance``
    (:math:`2\epsilon\,\mathrm{cond}\sqrt{P'} \le` ``tolerance``, with the bound
    :func:`target_form_condition` and :math:`P'` the masks picked); none elsewhere.

    :param F: ``(D, R)``. :param psi: ``(D,)``. :param mask: bool ``(P, D)``, True at the targets.
    :param float tolerance: nats the form may lose to rounding in ``F``'s dtype.
    :returns: bool ``(P,)``.

    Example::

        >>> F, psi = torch.randn(200, 50) / 50**0.5, torch.full((200,), 0.5)
        >>> mask = torch.rand(200, 200).argsort(-1) < torch.arange(1, 201)[:, None]
        >>> target_form_split(F, psi, mask, 1e-3).sum()   # the masks with few targets
    """
    D, R = F.shape
    if not target_form_possible(mask.shape[0], D, R):
        # the per-call test of the small paths (D = 10: 'all' costs 4.6 ms), without a host sync
        return mask.new_zeros(mask.shape[0])
    small = target_form_cheaper(mask.sum(-1), D, R)
    if not bool(small.any()):
        return small
    rounding = 2 * torch.finfo(F.dtype).eps * target_form_condition(F, psi) * math.sqrt(int(small.sum()))
    return small if rounding <= tolerance else torch.zeros_like(small)


def lowrank_precision(F, psi, site):
    r""":math:`P = (FF^\top + \Psi)^{-1} = \Psi^{-1} - \Psi^{-1}F\Lambda_0^{-1}F^\top\Psi^{-1}`,
    ``(D, D)``, differentiable in ``F`` and ``psi``.

    :param F: ``(D, R)``. :param psi: ``(D,)``. :param str site: for error messages.

    Example::

        >>> lowrank_precision(F, psi, "x")   # torch.linalg.inv(F @ F.T + torch.diag(psi)), to rounding
    """
    Fp = F / psi.unsqueeze(-1)
    G = torch.linalg.solve_triangular(posterior_precision_factor(F, psi, site), Fp.T, upper=False)
    return torch.diag(1 / psi) - G.T @ G


def target_form_groups(mask, max_elements):
    r"""Groups of masks for :class:`TargetBlockForm`: ``(rows, idx)`` pairs, ``rows``
    the masks' positions in ``mask`` and ``idx`` ``(g, Mp)`` their target tokens in
    increasing order, padded with ``D`` to the group's largest count ``Mp``.

    The masks are sorted by their number of targets and a group is cut where its
    padding would cost more than a group's own steps (``TARGET_GROUP`` in units of
    :math:`M^3`: the :math:`\sum_m (M_p^3 - M_m^3)` of its masks, bounded by that of
    its smallest) or its blocks ``g Mp^2`` would exceed ``max_elements / 8``.

    :param torch.Tensor mask: bool ``(P, D)``, True at the targets.
    :param int max_elements: memory bound, as the engine's.
    :returns: list of ``(rows (g,), idx (g, Mp))`` long tensors.

    Example::

        >>> mask = torch.tensor([[True, False, True], [False, True, False]])
        >>> target_form_groups(mask, 2**20)   # [(tensor([1, 0]), tensor([[1, 3], [0, 2]]))]
    """
    P, D = mask.shape
    M = mask.sum(-1)
    order = torch.argsort(M, stable=True)
    sizes = M[order].tolist()
    # every mask's targets in increasing order, padded with D, in the sorted order (once for all
    # groups: per group, these steps cost about 0.03 ms each)
    sub = mask.index_select(0, order)
    slot = sub.cumsum(-1) - 1  # each target's rank among its mask's targets
    m_of, j_of = sub.nonzero(as_tuple=True)
    targets = torch.full((P, max(1, sizes[-1])), D, dtype=torch.long, device=mask.device)
    targets[m_of, slot[m_of, j_of]] = j_of
    groups, start = [], 0
    budget = max(1, max_elements // 8)
    for end in range(1, P + 1):
        if end < P:
            top = sizes[end]
            if (end + 1 - start) * top * top <= budget and (end - start) * (top**3 - sizes[start] ** 3) <= TARGET_GROUP:
                continue
        groups.append((order[start:end], targets[start:end, : max(1, sizes[end - 1])].contiguous()))
        start = end
    return groups


class TargetBlockForm(torch.autograd.Function):
    r"""The masks' target blocks of the aggregated form: ``(A, logdet)`` with

    .. math::

        A = \sum_m E_m^\top\, C_m W_m C_m\, E_m, \qquad
        \text{logdet} = \sum_m a_m \sum_{j\in\mathcal M_m}\log(2\pi v_{mj}),

    :math:`C_m = (P_{\mathcal M_m\mathcal M_m})^{-1}`, :math:`v_m = \operatorname{diag}(C_m)`,
    :math:`W_m = \operatorname{diag}(a_m/v_m)` and :math:`E_m` the rows of the identity
    at the targets. The backward pass is written out: with :math:`G_m` the target block
    of :math:`A`'s symmetric gradient, :math:`\bar C = G CW + WCG + \operatorname{diag}(\bar v)`,
    :math:`\bar v = -\operatorname{diag}(CGC)\,a/v^2 + \bar\ell\,a/v` and
    :math:`\bar P_{\mathcal M\mathcal M} = -C\bar CC`, gathered into :math:`\bar P`: four
    batched products, no differentiation of the factorization.

    With ``factor`` :math:`(F, \psi)` such that :math:`P = (FF^\top + \Psi)^{-1}`, the groups
    of large blocks (:math:`M_p^3 \ge` ``CONTEXT_ROUTE`` :math:`R^2D`, :math:`F` of rank :math:`R`) take :math:`C` as
    :math:`\Psi_{\mathcal M} + F_{\mathcal M}\Lambda^{-1}F_{\mathcal M}^\top`,
    :math:`\Lambda = I + F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}` (an
    :math:`R\times R` factorization and products, where the :math:`M\times M` factorization and
    inverse of small blocks run far below the machine's rate: PPCA D = 200, K = 50, five blocks
    of 100 tokens, 0.55 -> 0.30 ms float32); the backward pass is the same.

    :param P: ``(D, D)``, symmetric positive definite.
    :param list groups: :func:`target_form_groups` of the masks.
    :param coef: ``(masks,)``.
    :param str site: for error messages.
    :param tuple factor: ``(F (D, R), psi (D,))`` of ``P``, or None; taken without gradient
        (``P``'s carries it).
    :returns: ``A`` ``(D, D)``, ``logdet`` ``()``.

    Example::

        >>> A, logdet = TargetBlockForm.apply(P, target_form_groups(mask, 2**24), coef, "x")
    """

    @staticmethod
    def forward(ctx, P, groups, coef, site, factor=None):
        """``(A, logdet)``."""
        D = P.shape[-1]
        # the padding token D: gathered from a zero row and column of P, then an identity
        # block (weight 0): every slot padded is its own token
        Pext = torch.nn.functional.pad(P, (0, 1, 0, 1))
        A = P.new_zeros((D + 1) * (D + 1))
        logdet = P.new_zeros(())
        saved = []
        routes = [factor is not None and idx.shape[-1] ** 3 >= CONTEXT_ROUTE * factor[0].shape[-1] ** 2 * D for _, idx in groups]
        if any(routes):
            F, psi = factor[0].detach(), factor[1].detach()
            Linv = _context_inverse_factors(F, psi, [idx for (_, idx), route in zip(groups, routes) if route], site)
            Fx, psix = torch.cat([F, F.new_zeros(1, F.shape[-1])]), torch.cat([psi, psi.new_ones(1)])
            k = 0
        for (rows, idx), route in zip(groups, routes):
            # int32: the gathers and scatters take it as fast, and it is kept for the backward pass
            idx32 = idx.to(torch.int32)
            flat = torch.add(idx32.unsqueeze(-1) * (D + 1), idx32.unsqueeze(-2)).view(-1)
            if route:
                C = _conditional_covariance(Fx, psix, idx, Linv[k : k + idx.shape[0]])
                k += idx.shape[0]
            else:
                block = Pext.view(-1).index_select(0, flat).view(idx.shape + idx.shape[-1:])
                block.diagonal(dim1=-2, dim2=-1).add_(idx == D)
                X = tril_inverse_transposed(cholesky(block, "target block P_MM of the precision", site))
                C = X @ X.transpose(-1, -2)  # (L L^T)^-1: cholesky_inverse takes 1.3-1.7x longer
            v = torch.diagonal(C, dim1=-2, dim2=-1)
            a = coef.index_select(0, rows).unsqueeze(-1) * (idx < D)
            logv = v.log()
            logdet += torch.dot(a.view(-1), logv.add_(LOG_2PI).view(-1))
            aw = a / v
            A.index_add_(0, flat, (C @ (aw.unsqueeze(-1) * C)).view(-1))
            saved += (flat, C, aw)
        # saved through autograd (not on ctx), so that a backward pass that does not retain the
        # graph frees them as it ends, before the passes that follow it (PPCA D = 200, K = 50:
        # megabytes that raised the step's peak, each step's pages faulted in again)
        ctx.save_for_backward(*saved)
        ctx.D = D
        return A.view(D + 1, D + 1)[:D, :D], logdet

    @staticmethod
    @first_order_backward
    def backward(ctx, gA, glog):
        """The gradient of ``P``."""
        D = ctx.D
        G = torch.nn.functional.pad(_symmetric_part(gA), (0, 1, 0, 1)).view(-1)
        gP = G.new_zeros((D + 1) * (D + 1))
        saved = ctx.saved_tensors
        for k in range(0, len(saved), 3):
            flat, C, aw = saved[k : k + 3]
            v = torch.diagonal(C, dim1=-2, dim2=-1)
            Gm = G.index_select(0, flat).view(C.shape)
            GC = Gm @ C
            # W's gradient diag(C G C); v enters through w = a / v and the log-determinant:
            # gv = (glog a - aw gw) / v = aw (glog - gw / v)
            gw = (C * GC).sum(-2)
            gv = torch.addcdiv(glog, gw, v, value=-1).mul_(aw)
            gC = GC.mul_(aw.unsqueeze(-2))
            gC = gC + gC.transpose(-1, -2)
            gC.diagonal(dim1=-2, dim2=-1).add_(gv)
            gP.index_add_(0, flat, (C @ gC @ C).view(-1), alpha=-1)
        return gP.view(D + 1, D + 1)[:D, :D], None, None, None, None


def _symmetric_part(X):
    # one fresh table, scaled in place
    return torch.add(X, X.T).mul_(0.5)


def _context_inverse_factors(F, psi, idxs, site):
    r""":math:`L^{-1}` of every mask's context precision :math:`\Lambda = LL^\top = I +
    F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}F_{\mathcal R}`, ``(n, R, R)`` for the ``n`` masks of
    the groups whose target tokens are ``idxs`` (a list of ``(g, Mp)``, padded with ``D``), in
    one batch: the :math:`R\times R` factors do not depend on the group's size, and a call a
    group cost its own factorization, inverse and check (PPCA D = 200, K = 50, six groups of
    83 to 104 targets, float32, one thread: 1.0 -> 0.5 ms)."""
    D = F.shape[0]
    with torch.no_grad():
        context = torch.ones(sum(idx.shape[0] for idx in idxs), D + 1, dtype=F.dtype, device=F.device)
        start = 0
        for idx in idxs:
            context[start : start + idx.shape[0]].scatter_(1, idx, 0.0)
            start += idx.shape[0]
        Lam = torch.matmul(F.T * (context[:, :D] / psi).unsqueeze(1), F)
        Lam.diagonal(dim1=-2, dim2=-1).add_(1)
        L = cholesky(Lam, "context precision I + F_R^T Psi_R^-1 F_R", site)
        # Lambda >= I: L^-1 has norm <= 1, its explicit inverse is accurate
        return tril_inverse_transposed(L).transpose(-1, -2)


def _conditional_covariance(Fx, psix, idx, Linv):
    r"""The targets' conditional covariances :math:`\Psi_{\mathcal M} + F_{\mathcal M}\Lambda^{-1}
    F_{\mathcal M}^\top` of a group, ``(g, Mp, Mp)``, with :math:`\Lambda^{-1} = L^{-\top}L^{-1}`
    (``Linv`` ``(g, R, R)``, :func:`_context_inverse_factors`) over each mask's context; ``Fx``
    ``(D + 1, R)`` and ``psix`` ``(D + 1,)``: the loading's rows and the noise with a zero row and
    a one for the padding token ``D``, which so gets an identity block, as :class:`TargetBlockForm`'s."""
    flat = idx.reshape(-1)
    V = torch.matmul(Linv, Fx.index_select(0, flat).view(*idx.shape, -1).transpose(1, 2))
    C = torch.matmul(V.transpose(1, 2), V)
    C.diagonal(dim1=-2, dim2=-1).add_(psix.index_select(0, flat).view(idx.shape))
    return C
