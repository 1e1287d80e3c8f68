r"""Dense log-conditionals for masks drawn per datapoint, with the backward pass written out:
their sums (:class:`DenseIndependentSums`, the Gaussian engine) and, per token and
component, with the contexts' densities (:class:`DenseContextConditionals`, Gaussian
mixtures).

For a full covariance :math:`\Sigma` shared by the batch and a mask per
(query, datapoint) pair with targets :math:`\mathcal M` and context
:math:`\mathcal R`, the pair's share of the estimate is

.. math::

    s = -\tfrac12\sum_{j\in\mathcal M}\Big[\log 2\pi v_j + \frac{d_j^2}{v_j}\Big],\qquad
    d = r_{\mathcal M} - \Sigma_{\mathcal M\mathcal R}\alpha,\quad
    \alpha = X^{-1}r_{\mathcal R},\quad
    v_j = \Sigma_{jj} - \Sigma_{j\mathcal R}X^{-1}\Sigma_{\mathcal Rj},

with :math:`X = \Sigma_{\mathcal R\mathcal R}` (factored embedded in a
:math:`D\times D` matrix, identity at the targets, as the per-mask conditionals
do) and :math:`r = x - \mu`. Recorded op by op, the backward pass of the
factorization and the two triangular solves makes about twenty passes over
``(pairs, D, D)`` tables, and activation checkpointing runs the forward pass a
second time (measured: 90 % of a training step at D = 200). Here, with
:math:`\bar d_j = -g\,d_j/v_j`, :math:`\bar v_j = -\tfrac g2(1/v_j - d_j^2/v_j^2)`
(zero at the context), :math:`B = X^{-1}\Sigma_{\mathcal R\cdot}` and
:math:`u = B\bar d`:

.. math::

    \bar r = \bar d - u,\qquad
    \bar\Sigma = \operatorname{sym}\big(u\alpha^\top - \alpha\bar d^\top
        - 2B\operatorname{diag}(\bar v)\big) + B\operatorname{diag}(\bar v)B^\top
        + \operatorname{diag}(\bar v),

summed over the pairs (the sum of the last products is one matrix product over
the stacked pairs), :math:`\operatorname{sym}(K) = \tfrac12(K + K^\top)`: the
gradient of a function of the symmetric :math:`\Sigma`. The backward pass
recomputes each chunk's factor, so that nothing of the size of the pairs'
tables outlives the forward pass.
"""

import torch

from ..mask_bits import pack_bits, unpack_bits
from .gaussian_linalg import LOG_2PI, cholesky
from .written_backward import first_order_backward

__all__ = ["DenseContextConditionals", "DenseIndependentSums", "dense_independent_sums"]


def dense_independent_sums(m, x, mask, max_elements, observed=None):
    r""":math:`\sum_{j\in\mathcal M}\log p(x_j\mid x_{\mathcal R})` for dense masks drawn
    per datapoint, ``(q, n)``.

    :param m: the dense state, its covariance shared by the batch (``(1, D, D)``).
    :param torch.Tensor x: ``(n, D)``, in the state's dtype.
    :param torch.Tensor mask: bool ``(q, n, D)``, True at a target token.
    :param int max_elements: elements of one ``(pairs, D, D)`` table of a chunk.

    Example::

        >>> dense_independent_sums(state, x, mask, 2**24)   # (q, n)
    """
    o = None if observed is None else observed.to(x.dtype)
    return DenseIndependentSums.apply(m.covariance[0], x, m.loc, mask, max_elements, m.site, o)


#: bytes of one ``(pairs, D, D)`` table of a chunk on the CPU: the dozen passes over a
#: chunk's tables then run in a core's cache (measured at D = 200: 1.5x faster than 64 MB
#: tables); a GPU takes chunks of ``max_elements``, as many pairs as its kernels can fill
CHUNK_BYTES = 2**20


def _chunks(pairs, D, itemsize, max_elements, device):
    step = max_elements // (D * D)
    if device.type == "cpu":
        step = min(step, CHUNK_BYTES // (D * D * itemsize))
    step = max(1, step)
    for start in range(0, pairs, step):
        yield slice(start, min(pairs, start + step))


class _Pieces:
    """A chunk's conditionals: the embedded context factor ``L``, ``B0 = L^-1 S_R.``,
    ``alpha``, the variances ``v`` and residuals ``d`` (1 and 0 at the context)."""

    def __init__(self, S, r, t, site, check_pivots=True):
        tf = t.to(S.dtype)
        c = 1 - tf
        # S's context rows, (P, D, D), and the symmetric X, both laid out column-major (as the
        # transposes of row-major tables: S is symmetric), as LAPACK reads them: row-major,
        # the factorization and the solve each began with a transposing copy (1.3x slower)
        cS = (S * c.unsqueeze(-2)).transpose(-1, -2)
        X = cS * c.unsqueeze(-2)
        X.diagonal(dim1=-2, dim2=-1).add_(tf)
        if check_pivots:  # the Gaussian engine's factorization, whose refusal starts its jitter rescue
            self.L = cholesky(X, "context covariance S_RR", site)
        else:  # a mixture's, as on its path for masks shared by the batch
            self.L = torch.linalg.cholesky(X)
        self.B0 = torch.linalg.solve_triangular(self.L, cS, upper=False)
        one = torch.ones((), dtype=S.dtype, device=S.device)
        # the column norms in one pass over B0 (pow and sum make two)
        self.v = torch.where(t, torch.diagonal(S) - torch.linalg.vector_norm(self.B0, dim=-2).square(), one)
        self.alpha = torch.cholesky_solve((c * r).unsqueeze(-1), self.L).squeeze(-1)  # 0 at the targets
        self.d = (r - self.alpha @ S) * tf
        self.tf, self.r = tf, r

    def log_conditionals(self):
        """``(P, D)``: the targets' log-conditionals, 0 at the context."""
        return -0.5 * self.tf * (LOG_2PI + self.v.log() + self.d * self.d / self.v)

    def log_context(self):
        r"""``(P,)``: :math:`\log\mathcal N(r_{\mathcal R}; 0, X)`."""
        size = (1 - self.tf).sum(-1)
        logdet = 2 * torch.diagonal(self.L, dim1=-2, dim2=-1).log().sum(-1)  # the identity adds 0
        return -0.5 * ((self.r * self.alpha).sum(-1) + logdet + size * LOG_2PI)

    def backward(self, S, gc, gR, gS, K):
        r"""One chunk's gradient: adds :math:`\bar\Sigma`'s symmetric terms to ``gS`` and
        those to be symmetrized to ``K`` (both ``(D, D)``), returns :math:`\bar r` ``(P, D)``.

        :param gc: the upstream gradient of the log-conditionals ``(P, D)``.
        :param gR: that of :math:`\log p(x_{\mathcal R})` ``(P,)``, or None."""
        D = S.shape[-1]
        gc = gc * self.tf
        gd = -gc * self.d / self.v
        gv = (-0.5 * gc) * (1 - self.d * self.d / self.v) / self.v
        # B = X^-1 S_R. = L^-T B0, read transposed: the stacked pairs' rows of B^T are one
        # matrix for the product over all pairs (LAPACK's solve leaves B column-major, so
        # this takes no copy)
        BT = torch.linalg.solve_triangular(self.L.transpose(-1, -2), self.B0, upper=True).transpose(-1, -2).contiguous()
        u = (gd.unsqueeze(-2) @ BT).squeeze(-2)  # B gd, nonzero at the context only
        gr = gd - u
        K.addmm_(u.T, self.alpha).addmm_(self.alpha.T, gd, alpha=-1)
        WT = BT * gv.unsqueeze(-1)  # (B diag(gv))^T
        K.sub_(WT.sum(0).T, alpha=2)
        gS.addmm_(WT.view(-1, D).T, BT.view(-1, D))  # sum_p B_p diag(gv_p) B_p^T
        gS.diagonal().add_(gv.sum(0))
        if gR is not None:
            # log N(r_R; 0, X): r_R's gradient -X^-1 r_R = -alpha, X's (alpha alpha^T - X^-1) / 2;
            # the embedded factor's inverse is the identity at the targets (exactly: its blocks
            # do not mix), taken off its diagonal
            gr -= gR.unsqueeze(-1) * self.alpha
            Xinv = torch.cholesky_inverse(self.L)
            Xinv.diagonal(dim1=-2, dim2=-1).sub_(self.tf)
            gS.addmm_(self.alpha.T, gR.unsqueeze(-1) * self.alpha, alpha=0.5)
            # (symmetric, left column-major by LAPACK: its transpose is the row-major view)
            gS.sub_((gR @ Xinv.transpose(-1, -2).reshape(-1, D * D)).view(D, D), alpha=0.5)
        return gr


class DenseIndependentSums(torch.autograd.Function):
    r"""The summed log-conditionals of dense masks drawn per datapoint, ``(q, n)``, with
    the backward pass written out (see the module docstring for the formulas).

    :param S: ``(D, D)``, symmetric positive definite. :param x: ``(n, D)``.
    :param loc: :math:`\mu`, ``(1|n, D)``. :param mask: bool ``(q, n, D)``, kept as
        bits (:func:`~pyro_mpt.mask_bits.pack_bits`) for the backward pass.
    :param int max_elements: elements of one ``(pairs, D, D)`` table of a chunk.
    :param str site: for error messages.
    :returns: ``(q, n)``.

    Example::

        >>> sums = DenseIndependentSums.apply(cov, x, loc, mask, 2**24, "x")  # mask (q, n, D)
        >>> sums.sum().backward()   # gradients of cov, x and loc; the chunks are recomputed
    """

    @staticmethod
    def forward(ctx, S, x, loc, mask, max_elements, site, observed=None):
        """``(q, n)``."""
        q, n, D = mask.shape
        r = x - loc
        flat = mask.reshape(q * n, D)
        out = S.new_empty(q * n)
        rows = torch.arange(q * n, device=r.device) % n
        for sl in _chunks(q * n, D, S.element_size(), max_elements, S.device):
            logc = _Pieces(S, r[rows[sl]], flat[sl], site).log_conditionals()
            out[sl] = (logc if observed is None else logc * observed[rows[sl]]).sum(-1)
        ctx.observed = observed
        # x and loc rather than r: they are shared by every block of masks, r would be one more
        # (n, D) table kept per block
        ctx.save_for_backward(S, x, loc, pack_bits(mask))
        ctx.max_elements, ctx.site, ctx.num_tokens = max_elements, site, D
        return out.view(q, n)

    @staticmethod
    @first_order_backward
    def backward(ctx, g):
        """The gradients of ``S``, ``x`` and ``loc``."""
        S, x, loc, bits = ctx.saved_tensors
        mask = unpack_bits(bits, ctx.num_tokens)
        q, n, D = mask.shape
        r = x - loc
        flat, gflat = mask.reshape(q * n, D), g.reshape(q * n, 1)
        rows = torch.arange(q * n, device=r.device) % n
        gS, gr = torch.zeros_like(S), torch.zeros_like(r)
        K = torch.zeros_like(S)  # the part of S's gradient that is symmetrized
        for sl in _chunks(q * n, D, S.element_size(), ctx.max_elements, S.device):
            pc = _Pieces(S, r[rows[sl]], flat[sl], ctx.site)
            gc = gflat[sl].expand(-1, D) if ctx.observed is None else gflat[sl] * ctx.observed[rows[sl]]
            gr.index_add_(0, rows[sl], pc.backward(S, gc, None, gS, K))
        gS += 0.5 * (K + K.T)
        gloc = (-gr).sum_to_size(loc.shape) if ctx.needs_input_grad[2] else None
        return gS, gr if ctx.needs_input_grad[1] else None, gloc, None, None, None, None


class DenseContextConditionals(torch.autograd.Function):
    r"""Per-token log-conditionals and context log-densities of Gaussian components for
    contexts drawn per datapoint, with the backward pass written out: for component
    :math:`k`, query :math:`q` and datapoint :math:`i` with context :math:`\mathcal R`,
    :math:`\log\mathcal N_k(x_{ij}\mid x_{i\mathcal R})` at the targets (0 at the
    context) and :math:`\log\mathcal N(x_{i\mathcal R}; \mu_{k\mathcal R},
    \Sigma_{k\mathcal R\mathcal R})`, what a mixture of Gaussians combines
    (:class:`~pyro_mpt.conditionals.gaussian_mixture.GaussianMixtureTable`). The
    gradients are those of :class:`DenseIndependentSums` with a weight per token, and of
    the context density :math:`\bar r_{\mathcal R} = -\bar\ell\,\alpha`,
    :math:`\bar\Sigma_{\mathcal R\mathcal R} = \tfrac{\bar\ell}2(\alpha\alpha^\top - X^{-1})`.

    :param S: ``(K, D, D)``, the components' covariances. :param x: ``(n, D)``.
    :param loc: ``(K, n|1, D)``. :param context: bool ``(q, n, D)``, kept as bits.
    :param int max_elements: elements of one ``(pairs, D, D)`` table of a chunk.
    :param str site: for error messages.
    :returns: ``(q, K, n, D)`` and ``(q, K, n)``.

    Example::

        >>> log_c, log_ctx = DenseContextConditionals.apply(covs, x, locs, context, 2**24, "x")
    """

    @staticmethod
    def forward(ctx, S, x, loc, context, max_elements, site):
        """``(log_c, log_ctx)``."""
        q, n, D = context.shape
        K = S.shape[0]
        flat = ~context.reshape(q * n, D)
        rows = torch.arange(q * n, device=x.device) % n
        log_c, log_ctx = S.new_empty(q * n, K, D), S.new_empty(q * n, K)
        for k in range(K):
            r = x - loc[k]
            for sl in _chunks(q * n, D, S.element_size(), max_elements, S.device):
                pc = _Pieces(S[k], r[rows[sl]], flat[sl], site, check_pivots=False)
                log_c[sl, k], log_ctx[sl, k] = pc.log_conditionals(), pc.log_context()
        ctx.save_for_backward(S, x, loc, pack_bits(context))
        ctx.max_elements, ctx.site, ctx.num_tokens = max_elements, site, D
        return log_c.view(q, n, K, D).transpose(1, 2), log_ctx.view(q, n, K).transpose(1, 2)

    @staticmethod
    @first_order_backward
    def backward(ctx, gc, gR):
        """The gradients of ``S``, ``x`` and ``loc``."""
        S, x, loc, bits = ctx.saved_tensors
        context = unpack_bits(bits, ctx.num_tokens)
        q, n, D = context.shape
        flat = ~context.reshape(q * n, D)
        rows = torch.arange(q * n, device=x.device) % n
        gc = gc.transpose(1, 2).reshape(q * n, -1, D)
        gR = gR.transpose(1, 2).reshape(q * n, -1)
        gS, gx, gloc = torch.zeros_like(S), torch.zeros_like(x), torch.zeros_like(loc)
        for k in range(S.shape[0]):
            r = x - loc[k]
            gr = torch.zeros_like(r)
            Kk = torch.zeros_like(S[k])
            for sl in _chunks(q * n, D, S.element_size(), ctx.max_elements, S.device):
                pc = _Pieces(S[k], r[rows[sl]], flat[sl], ctx.site, check_pivots=False)
                gr.index_add_(0, rows[sl], pc.backward(S[k], gc[sl, k], gR[sl, k], gS[k], Kk))
            gS[k] += 0.5 * (Kk + Kk.T)
            gx += gr
            gloc[k] -= gr.sum_to_size(loc[k].shape)
        return gS, gx, gloc, None, None, None
