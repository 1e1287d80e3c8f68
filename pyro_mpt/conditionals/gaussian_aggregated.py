r"""The weighted sum over masks shared by the batch as one quadratic form per datapoint.

A loss without a curve needs, from a group of masks shared by the batch, only
:math:`\sum_m a_m \sum_{j\in\mathcal M_m}\log p(x_{ij}\mid x_{i\mathcal R_m})`
(:meth:`~pyro_mpt.conditionals.ConditionalEngine.weighted_mask_sum`). For a
Gaussian each mask's summed log-conditional is a data-free log-determinant plus
a quadratic form :math:`y_i^\top Q_m y_i` in a per-datapoint vector :math:`y_i`,
so the weighted sum over all masks is **one** quadratic form
:math:`y_i^\top A y_i` with :math:`A = \sum_m a_m Q_m`: the masks cost
:math:`O(P\,\dim(y)^2 R)` for all :math:`P` of them (:math:`R` the rank; a few
large matrix products) and the data :math:`O(n \dim(y)^2)` once, instead of
:math:`O(P n D R)` products of the data with every mask's factors. That is
cheaper when :math:`\dim(y)^2 \lesssim nD`; the engine picks the path by this
count (:func:`aggregated_cheaper`).

The vectors :math:`y` are chosen so that no large terms cancel inside
:math:`y^\top A y`, which matters in float32: on the low-rank path the
full-data residual and the residual of the normal equations, on the dense path
the whitened data.
"""

import torch

from .gaussian_linalg import LOG_2PI, PRECISION, cholesky, signal_to_noise, tril_inverse
from .gaussian_target_form import TargetBlockForm, lowrank_precision, target_form_groups, target_form_split
from .written_backward import first_order_backward
from .gaussian_lowrank_form import LowRankForm, lowrank_form_chunks

__all__ = [
    "aggregated_cheaper", "aggregated_elements", "lowrank_form_dtype", "FORM_TOLERANCE", "lowrank_aggregate_data", "lowrank_weighted_sum", "dense_weighted_sum",
    "DenseForm", "WhitenedQuad", "QuadraticRows",
]


def aggregated_cheaper(n, D, R=None, masks=None):
    r"""Whether the aggregated form costs fewer flops than per-mask products with the data.

    Low-rank (rank ``R``): about :math:`2R(D+R)^2` per mask against
    :math:`4nDR`; dense (``R`` None): about :math:`6D^3` per mask (its factor,
    the whitened regression and its share of :math:`A`) against :math:`nD^2`.
    With ``masks``, the number :math:`P` of masks in the sum, the low-rank
    form's one product of the data with the :math:`(D+R)^2` form,
    :math:`2n(D+R)^2`, counts too: :math:`P(4nDR - 2R(D+R)^2) \ge 2n(D+R)^2`,
    so that a few masks (the loss of one mask per call) take the per-mask
    products (at :math:`n = 1000`, :math:`R = 2`: below 4 masks at
    :math:`D = 10`, 14 at :math:`D = 50`).
    """
    if R is None:
        return 6 * D <= n
    if masks is None:
        return (D + R) ** 2 <= 2 * n * D
    return masks * (4 * n * D * R - 2 * R * (D + R) ** 2) >= 2 * n * (D + R) ** 2


#: nats per datapoint the aggregated low-rank form may lose to rounding, by dtype: float64
#: keeps the 1e-8 to which exhaustive masks and orderings are exact (docs/numerics.md);
#: other dtypes the bound ``PRECISION`` their states are chosen by
FORM_TOLERANCE = {torch.float64: 1e-8}


def lowrank_form_dtype(F, psi):
    r"""The dtype in which :func:`lowrank_weighted_sum` keeps its digits for this
    loading and noise: ``F``'s own, else float64, else None.

    Its :math:`y^\top Ay` cancels terms of size :math:`\kappa = \max_i
    \operatorname{tr}(F^\top\Psi^{-1}F)` (``gaussian_linalg.signal_to_noise``): it
    loses about :math:`2\epsilon\kappa` nats per datapoint (measured 0.8--1.9
    :math:`\epsilon\kappa` in float64, 1.5--3.9 in float32), where the per-mask sums
    keep float64 to about 1e-9. So the engine takes the form only in a dtype whose
    :math:`2\epsilon\kappa` stays within ``FORM_TOLERANCE`` (1e-8 in float64;
    ``PRECISION`` in other dtypes), and the per-mask sums where none does. Before,
    noise sd 1e-4 against a unit loading (D = 10, K = 2, float64) put the exhaustive
    score 2.3e-7 nats off the exact log p; one column in float32 with noise sd 1e-4 (a
    state kept in float32 by its :math:`\epsilon^2\kappa` bound), 108 nats.

    A float32 state (kept by ``lowrank_dtype`` up to :math:`\epsilon\kappa \le`
    1e-3) above the float32 bound computes the form in float64, about twice the cost
    of float32, where the per-mask sums cost 5--8 times more: PPCA D = 512, K = 2,
    noise sd 0.3 (:math:`\kappa` about 6000), masks shared, one thread: 0.50 s per
    step on the per-mask path, 0.10 s on the form in float64.

    The engine asks the same of the sums over masks drawn per datapoint
    (:mod:`~pyro_mpt.conditionals.gaussian_independent`), whose values keep their
    digits but whose noise gradient does not: in float64 at D = 12, K = 11, noise
    variance 1e-6 (:math:`2\epsilon\kappa` = 6e-8) it was 1.5e-6 relative off the
    per-mask conditionals' (1e-8), at 1e-8 6e-4, and at D = 12, K = 5, 1e-10, 14%.

    :param F: ``(1, D, R)``. :param psi: ``(1, D)``.
    :returns: a ``torch.dtype`` or None.

    Example::

        >>> lowrank_form_dtype(state.cov_factor, state.cov_diag)
        torch.float32
    """
    kappa = signal_to_noise(F, psi)
    for dtype in dict.fromkeys((F.dtype, torch.float64)):
        if 2 * torch.finfo(dtype).eps * kappa <= FORM_TOLERANCE.get(dtype, PRECISION):
            return dtype
    return None


def aggregated_elements(D, R=None):
    r"""Elements of the aggregated form's working set per mask: the stacked
    :math:`D\times D` regressions of the dense form; the :math:`R\times R` and
    :math:`D`-vector pieces the low-rank form keeps for its backward pass
    (:class:`~pyro_mpt.conditionals.gaussian_lowrank_form.LowRankForm`; the rest
    of its pieces are made in chunks of masks within the engine's ``max_elements``)."""
    return D * D if R is None else 2 * (R * R + D)


def lowrank_weighted_sum(m, mask, coef, data, max_elements=2**24):
    r"""Aggregated weighted sum for :math:`\Sigma = FF^\top + \Psi`, ``(n,)``.

    With :math:`r = x - \mu`, :math:`\Lambda_0 = I + F^\top\Psi^{-1}F`, the
    posterior mean :math:`\hat z = \Lambda_0^{-1}F^\top\Psi^{-1}r` as computed,
    :math:`e = r - F\hat z` and :math:`\delta = \hat z - F^\top\Psi^{-1}e` (zero
    up to rounding; carrying it keeps every identity below exact for the
    :math:`\hat z` actually computed): for a mask with target indicator
    :math:`t` and context :math:`c = 1 - t`, :math:`\Lambda = I +
    F^\top\operatorname{diag}(c/\psi)F = LL^\top`, the conditional variances
    :math:`v = \psi + \operatorname{diag}(F\Lambda^{-1}F^\top)`,
    :math:`w = t/v`, and the conditional residuals

    .. math::

        d = e + V^\top h, \qquad V = L^{-1}F^\top, \qquad
        h = L^{-1}\big(F^\top\Psi^{-1}\operatorname{diag}(t)\,e + \delta\big) = K y,

    with :math:`y = [e; \delta] \in \mathbb R^{D+R}` and :math:`K = L^{-1}
    [(t \circ F/\psi)^\top,\ I_R] = [V\operatorname{diag}(t/\psi),\ L^{-1}]`: the context's projection
    :math:`F_{\mathcal R}^\top\Psi_{\mathcal R}^{-1}e_{\mathcal R} = \hat z + \delta - F^\top\Psi^{-1}\operatorname{diag}(t)e`
    is written through the targets, so that the form holds small centred terms only.
    Then :math:`\sum_j w_j d_j^2 = e^\top W e + y^\top K^\top N y` with
    :math:`N = 2VWE + (VWV^\top)K` (:math:`E = [I_D, 0]`), and over
    the masks with coefficients :math:`a_m`,

    .. math::

        \sum_m a_m \sum_j w_{mj} d_{mj}^2 = e^\top\operatorname{diag}\Big(\sum_m a_m w_m\Big) e
            + y^\top \big[K_1^\top \cdots K_P^\top\big]
              \begin{bmatrix} a_1 N_1 \\ \vdots \\ a_P N_P\end{bmatrix} y,

    whose :math:`D\times D` block is one :math:`D\times PR\times D` matrix
    product for all masks; the blocks that meet
    :math:`\delta` reduce to sums over the masks of :math:`R\times R` pieces,
    :math:`\sum_m \operatorname{diag}(t_m/\psi)FQ_m` and
    :math:`\sum_m(\Lambda_m^{-1}F^\top\operatorname{diag}(2a_mw_m) +
    Q_mF^\top\operatorname{diag}(t_m/\psi))` with :math:`Q_m = a_m\Lambda_m^{-1}F^\top
    W_mF\Lambda_m^{-1}`, i.e. products with :math:`D\times P` tables (the form reads only
    the symmetric part of its matrix, so :class:`LowRankForm` returns the first of them
    transposed inside the second). The
    result is :math:`-\tfrac12\big(\sum_m a_m \sum_j t_{mj}\log(2\pi v_{mj}) +
    \text{the form}\big)`. The masks' part of the form, with its backward pass
    written out, is :class:`~pyro_mpt.conditionals.gaussian_lowrank_form.LowRankForm`.

    Masks with few targets cost less through the target blocks of the precision
    (:class:`~pyro_mpt.conditionals.gaussian_target_form.TargetBlockForm`, an
    :math:`M\times M` factorization a mask against the form's :math:`O(RD(D+R))`): they
    are split off by :func:`~pyro_mpt.conditionals.gaussian_target_form.target_form_split`
    where the blocks keep the form's digits (``FORM_TOLERANCE``), and their blocks join
    :math:`A`'s :math:`D\times D` block as a form in :math:`\Psi^{-1}e = P r`. PPCA, ``"all"`` shared, one thread, float32: D = 200, K = 50
    1.24x faster (104 of 200 masks on the blocks), D = 512, K = 50 1.18x, D = 100, K = 50
    1.36x; at K = 2 or D = 50 the rule keeps every mask on the form.

    :param m: the low-rank state (cov_factor ``(1, D, R)``, cov_diag ``(1, D)``).
    :param torch.Tensor mask: bool ``(P, D)``.
    :param torch.Tensor coef: ``(P,)``.
    :param dict data: the mask-free pieces (``gaussian_shared.lowrank_shared_data``,
        completed by :func:`lowrank_aggregate_data`).
    :param int max_elements: bound on the elements of the stacked pieces
        alive at once (chunks of masks, :func:`~pyro_mpt.conditionals.gaussian_lowrank_form.lowrank_form_chunks`).
    :returns: ``(n,)``.
    """
    F, psi = m.cov_factor[0], m.cov_diag[0]  # (D, R), (D,)
    D, R = F.shape
    small = target_form_split(F, psi, mask, FORM_TOLERANCE.get(F.dtype, PRECISION))
    logdet = F.new_zeros(())
    wsum = F.new_zeros(D)
    A = F.new_zeros(D + R, D + R)
    if not bool(small.all()):
        big = ~small
        chunks = lowrank_form_chunks(D, R, F.dtype, max_elements)
        A, wsum, logdet = LowRankForm.apply(F, psi, mask[big].to(F.dtype), coef[big].to(F.dtype), chunks, m.site)
    if bool(small.any()):
        rows = small.nonzero()[:, 0]
        groups = target_form_groups(mask.index_select(0, rows), max_elements)
        P = lowrank_precision(F, psi, m.site)
        At, logdet_t = TargetBlockForm.apply(P, groups, coef.index_select(0, rows).to(F.dtype), m.site, (F, psi))
        # the blocks' form is in u = P r = e / psi
        A = A + torch.nn.functional.pad(At / psi.unsqueeze(-1) / psi, (0, R, 0, R))
        logdet = logdet + logdet_t
    quad = QuadraticRows.apply(data["y"], A) + data["e2"] @ wsum  # y (n, D + R)
    return -0.5 * (logdet + quad)


class QuadraticRows(torch.autograd.Function):
    r"""The quadratic forms :math:`y_i^\top A_s y_i`, ``(n,)``, with :math:`A_s =
    \tfrac12(A + A^\top)` and the backward pass written out: :math:`\bar y_i =
    2g_iA_sy_i` reuses the forward product and :math:`\bar A = \sum_i g_iy_iy_i^\top`,
    two matrix products with the data instead of the three recorded op by op.

    :param y: ``(n, d)``. :param A: ``(d, d)``.

    Example::

        >>> QuadraticRows.apply(y, A)  # (n,), ((y @ A) * y).sum(-1)
    """

    @staticmethod
    def forward(ctx, y, A):
        """``(n,)``."""
        yA = y @ (0.5 * (A + A.T))
        ctx.save_for_backward(y, yA)
        return (yA * y).sum(-1)

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of ``y`` and ``A``."""
        y, yA = ctx.saved_tensors
        gy = (2 * g).unsqueeze(-1) * yA if ctx.needs_input_grad[0] else None
        gA = _weighted_gram(y, g) if ctx.needs_input_grad[1] else None
        return gy, gA


#: the width from which :func:`_weighted_gram` makes only the blocks on and above the diagonal
#: (below it the four smaller products cost more than they save: measured d = 100 float32 0.17 -> 0.20 ms)
GRAM_BLOCKED_WIDTH = 150
#: the blocks it cuts the columns into (measured best at 4 of 2-4: n = 1000, one thread, d = 250
#: float64 1.66 -> 1.19 ms, float32 0.81 -> 0.59 ms; d = 562 float64 13.8 -> 10.8 ms)
GRAM_BLOCKS = 4


def _weighted_gram(y, g):
    r""":math:`y^\top\operatorname{diag}(g)y`, ``(d, d)``, for ``y`` ``(n, d)``: symmetric, so at
    ``d >= GRAM_BLOCKED_WIDTH`` the products of the column blocks on and above the diagonal
    (:math:`(b + 1)/2b` of the full product's operations with ``b = GRAM_BLOCKS``), the rest copied."""
    gy = g.unsqueeze(-1) * y
    d = y.shape[-1]
    if d < GRAM_BLOCKED_WIDTH:
        return y.T @ gy
    out = y.new_empty(d, d)
    cuts = [round(i * d / GRAM_BLOCKS) for i in range(GRAM_BLOCKS + 1)]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        torch.mm(y[:, lo:hi].T, gy[:, lo:], out=out[lo:hi, lo:])
        out[hi:, lo:hi] = out[lo:hi, hi:].T
    return out


def lowrank_aggregate_data(data):
    """Adds ``e`` ``(n, D)``, ``y = [e, delta]`` ``(n, D + R)`` to the mask-free pieces."""
    if "y" not in data:
        e = data["eT"].T
        # zero up to rounding; Fp's gradient through delta is LowRankForm's (with X's, whose
        # terms it cancels), so it is not recorded here
        delta = data["zhat"].T - e @ data["Fp"].detach()  # (n, R)
        data["e"], data["y"] = e, torch.cat([e, delta], -1)
    return data


def dense_weighted_sum(m, x, mask, coef):
    r"""Aggregated weighted sum for a dense :math:`\Sigma = L_0L_0^\top`, ``(n,)``.

    For a mask with targets :math:`\mathcal M` and context :math:`\mathcal R`,
    the conditional residuals are :math:`d = r_{\mathcal M} - B^\top r_{\mathcal R}
    = P_m r` with :math:`B = \Sigma_{\mathcal R\mathcal R}^{-1}\Sigma_{\mathcal R\mathcal M}`
    (:math:`P_m` is :math:`D\times D`, zero rows at the context), and in the
    whitened data :math:`\varepsilon = L_0^{-1}r`, :math:`d = U_m\varepsilon`
    with :math:`U_m = P_mL_0`, whose target rows have norm :math:`\sqrt{v_j}`
    (the conditional standard deviations): no large terms cancel. Then

    .. math::

        \sum_m a_m \sum_{j\in\mathcal M_m} \frac{d_{mj}^2}{v_{mj}}
            = \varepsilon^\top \Big(\sum_m a_m U_m^\top W_m U_m\Big) \varepsilon,

    one :math:`D\times PD\times D` product for all masks, and the result is
    :math:`-\tfrac12\big(\sum_m a_m\sum_{j\in\mathcal M_m}\log(2\pi v_{mj}) +
    \text{the form}\big)`. The context block is factored embedded in a
    :math:`D\times D` matrix (identity at the targets).

    The form does not depend on :math:`L_0`: with :math:`A = L_0^\top A' L_0`,
    :math:`\varepsilon^\top A\varepsilon = r^\top A' r` for any invertible
    :math:`L_0`, whose part is to keep the terms small. So no gradient flows
    through it (its Cholesky factorization, the whitening and the products with
    it are left out of the backward pass): the gradients of :math:`\Sigma`,
    :math:`\mu` and :math:`x` are those of the form at a fixed :math:`L_0`.

    :param m: the dense state (covariance ``(1, D, D)``, factor its Cholesky factor).
    :param torch.Tensor x: ``(n, D)``.
    :param torch.Tensor mask: bool ``(P, D)``.
    :param torch.Tensor coef: ``(P,)``.
    :returns: ``(n,)``.
    """
    S = m.covariance[0]
    with torch.no_grad():  # the result does not depend on L0 (see above)
        L0 = m.factor[0] if m.factor is not None else cholesky(S, "covariance", m.site)
        # the whitening as a product with L0^-1 (a D x D solve): the solve with n right-hand
        # sides costs about twice the product with the data
        M = tril_inverse(L0)
    A, logdet = DenseForm.apply(S, L0, mask, coef, m.site)
    return -0.5 * (logdet + WhitenedQuad.apply(x, m.loc, M, A))


class WhitenedQuad(torch.autograd.Function):
    r"""The quadratic forms :math:`\varepsilon_i^\top A_s\varepsilon_i` of the whitened
    data :math:`\varepsilon_i = M(x_i - \mu)`, ``(n,)``, with :math:`A_s =
    \tfrac12(A + A^\top)`, and the backward pass written out.

    With :math:`g` the gradient of the result, :math:`\bar\varepsilon_i =
    2g_iA_s\varepsilon_i` reuses the forward product :math:`A_s\varepsilon_i`,
    :math:`\bar A = \sum_i g_i\varepsilon_i\varepsilon_i^\top`,
    :math:`\bar M = \sum_i\bar\varepsilon_i(x_i - \mu)^\top`, and a location
    shared by the batch gets :math:`\bar\mu = -M^\top\sum_i\bar\varepsilon_i`,
    one vector product instead of a product with every datapoint (which only
    gradients of the data or of a location per datapoint need): two matrix
    products with the data instead of the four of the operations recorded one by one.

    :param x: ``(n, D)``. :param loc: ``(D,)``, ``(1, D)`` or ``(n, D)``.
    :param M: ``(D, D)``. :param A: ``(D, D)``.

    Example::

        >>> quad = WhitenedQuad.apply(x, mu, torch.linalg.inv(L0), A)  # (n,)
    """

    @staticmethod
    def forward(ctx, x, loc, M, A):
        """``(n,)``."""
        r = x - loc
        eps = r @ M.T
        epsA = eps @ (0.5 * (A + A.T))
        ctx.save_for_backward(r, M, eps, epsA)
        ctx.loc_shape = loc.shape
        return (epsA * eps).sum(-1)

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of ``x``, ``loc``, ``M`` and ``A``."""
        r, M, eps, epsA = ctx.saved_tensors
        need_x, need_loc, need_M, need_A = ctx.needs_input_grad
        geps = (2 * g).unsqueeze(-1) * epsA
        gx = gloc = gM = gA = None
        if need_A:
            gA = eps.T @ (g.unsqueeze(-1) * eps)
        if need_M:
            gM = geps.T @ r
        per_row = len(ctx.loc_shape) == 2 and ctx.loc_shape[0] == r.shape[0] > 1
        if need_x or (need_loc and per_row):
            gr = geps @ M
            gx = gr if need_x else None
            gloc = (-gr).sum_to_size(ctx.loc_shape) if need_loc else None
        elif need_loc:
            gloc = (-(geps.sum(0) @ M)).reshape(ctx.loc_shape)
        return gx, gloc, gM, gA


class DenseForm(torch.autograd.Function):
    r"""The dense form's data-free pieces: :math:`A = \sum_m a_m U_m^\top W_m U_m`
    ``(D, D)`` and :math:`\sum_m a_m \sum_{j\in\mathcal M_m}\log(2\pi v_{mj})`,
    from :math:`\Sigma` and its Cholesky factor :math:`L_0` (see
    :func:`dense_weighted_sum`), with the backward pass written out.

    Recorded op by op, the backward pass differentiates the context factor's
    Cholesky factorization and both triangular solves, about twice the forward
    time and as many ``(P, D, D)`` temporaries again. Here, with
    :math:`X = \Sigma_{\mathcal R\mathcal R}`, :math:`Y = \Sigma_{\mathcal R\mathcal M}`,
    :math:`B = X^{-1}Y` and :math:`v_j = \Sigma_{jj} - (Y^\top X^{-1}Y)_{jj}`:
    with :math:`G` the symmetric part of :math:`\bar A`, :math:`\bar U = 2WUG`,
    :math:`\bar v_j = -a_m t_j (UGU^\top)_{jj}/v_j^2 + \bar\ell\, a_m t_j/v_j`,
    :math:`\bar B = -L_0\bar U^\top` on the context-target block and
    :math:`H = X^{-1}\bar B`, the gradient is :math:`\bar Y = H - 2B\operatorname{diag}(\bar v)`,
    :math:`\bar X = B\operatorname{diag}(\bar v)B^\top - \operatorname{sym}(HB^\top)`
    (symmetric, as a Cholesky factorization's), :math:`\bar\Sigma_{jj} = \bar v_j`
    and :math:`\bar L_0 = \sum_m P_m^\top\bar U_m`, summed over the masks: a
    few products and one pair of triangular solves. Only the target rows of
    :math:`B^\top` and :math:`U` are nonzero (half of them on the ``"all"``
    schedule): they are packed over the masks into ``(sum_m M_m, D)`` tables,
    so that the products with :math:`L_0`, :math:`G` and the sums over the
    masks are single matrix products of that height, and :math:`\bar B^\top`,
    :math:`H^\top = \bar B^\top X^{-1}` are solved from the right in the
    embedded layout.

    :param S: ``(D, D)``. :param L0: ``(D, D)``. :param mask: bool ``(P, D)``.
    :param coef: ``(P,)``. :param str site: for error messages.
    """

    @staticmethod
    def forward(ctx, S, L0, mask, coef, site):
        """``(A, logdet)``."""
        D = S.shape[-1]
        # the embedded blocks as products with 0/1 rows and columns (exact for a
        # finite S), which is a third of the time of selections with broadcast bool masks.
        # Z = S diag(c) holds both blocks: its context rows are X's, its target rows Y^T's
        c, t = (~mask).to(S.dtype), mask.to(S.dtype)
        # column-major, the layout the solve from the right takes without a transposing copy
        Z = (c.unsqueeze(-1) * S.T.contiguous()).transpose(-1, -2)
        X = Z * c.unsqueeze(-1)
        X.diagonal(dim1=-2, dim2=-1).add_(t)  # identity at the targets
        # (in place: X, column-major like Z, is not needed after it)
        L = cholesky(X, "context covariance S_RR", site, overwrite=True)
        # W^T = S_MR L^-T and B^T = W^T L^-1, both solved from the right (no transposed
        # copies), and for Z's rows: a solve from the right treats
        # the rows apart, and only the target rows are kept, packed over the masks,
        # (sum_m M_m, D); so are U's and the variances
        # (in place: Z is the solves' own table, and a solve into a fresh one copies it first)
        Wt = torch.linalg.solve_triangular(L.transpose(-1, -2), Z, upper=True, left=False, out=Z)
        rows = mask.reshape(-1).nonzero()[:, 0]  # m D + j for the targets j of mask m
        m_of, j_of = rows // D, rows % D
        # the variances as a sum of squares: accurate to eps cond(L), not eps cond(S)
        var = torch.diagonal(S).index_select(0, j_of) - Wt.pow(2).sum(-1).reshape(-1).index_select(0, rows)
        Bt = torch.linalg.solve_triangular(L, Wt, upper=False, left=False, out=Wt)
        # the solves return column-major tables: gather the rows, not reshape (a transposing copy);
        # E - B^T, the target rows of P_m (B^T is zero at the targets)
        Bt = Bt[m_of, j_of]
        EB = Bt.neg()
        diag = torch.arange(rows.shape[0], device=rows.device) * D + j_of  # entries (r, j_r) of the packed rows
        EB.view(-1).index_fill_(0, diag, 1.0)
        U = EB @ L0  # target rows of P_m L0
        a = coef.to(S.dtype).index_select(0, m_of)
        aw = a / var
        A = U.T @ (U * aw.unsqueeze(-1))
        logdet = a @ (LOG_2PI + var.log())
        ctx.save_for_backward(L0, L, Bt, EB, U, var, aw, a, m_of, j_of, diag, c)
        return A, logdet

    @staticmethod
    @first_order_backward
    def backward(ctx, gA, glog):
        """The gradients of ``S`` and ``L0``."""
        L0, L, Bt, EB, U, var, aw, a, m_of, j_of, diag, c = ctx.saved_tensors
        P, D = c.shape
        G = 0.5 * (gA + gA.T)
        UG = U @ G
        gU = 2 * aw.unsqueeze(-1) * UG
        # aw = a / v and the log-determinant's a log v
        gvar = (glog * a - aw * (UG * U).sum(-1)) / var
        # U = (E - B^T) L0
        gL0 = EB.T @ gU if ctx.needs_input_grad[1] else None
        # B^T's gradient (sign in H), at the context columns of each target row (finite entries: exact)
        # (column-major, as the solve from the right takes it)
        gBt = torch.zeros(P, D, D, dtype=U.dtype, device=U.device).transpose(-1, -2)
        gBt[m_of, j_of] = (gU @ L0.T).mul_(c.index_select(0, m_of))
        # H^T = gB^T X^-1, X = L L^T: zero rows at the context
        torch.linalg.solve_triangular(L.transpose(-1, -2), gBt, upper=True, left=False, out=gBt)
        Ht = torch.linalg.solve_triangular(L, gBt, upper=False, left=False, out=gBt)
        Ht = Ht[m_of, j_of]
        Bvt = gvar.unsqueeze(-1) * Bt  # (B diag(gvar))^T, packed
        Yt = Bt.T @ (Bvt + Ht)
        # the rows H^T + 2 (B diag(gvar))^T at the context columns, and -gvar_j at the target's own
        # column (the diagonal's gradient gvar, with the sign of the transposed sum)
        rows_g = torch.add(Ht, Bvt, alpha=2)
        rows_g.view(-1).index_add_(0, diag, -gvar)
        cross = torch.zeros(D, D, dtype=U.dtype, device=U.device).index_add_(0, j_of, rows_g)
        gS = 0.5 * (Yt + Yt.T) - cross.T
        return gS, gL0, None, None, None
