r"""What every path of the Gaussian engine shares: a Cholesky factorization that
fails when its pivots lose their digits, the first jitter of the engine's rescue,
the dtype each path computes in, the normal log-density, token gathers and the
packing of symmetric matrices.

Used by :mod:`~pyro_mpt.conditionals.gaussian` and its kernels
(``gaussian_lowrank``, ``gaussian_dense``, ``gaussian_shared``).
"""

import functools
import math
import weakref

import torch

#: :math:`\log 2\pi`, the constant of every normal log-density
LOG_2PI = math.log(2 * math.pi)


def normal_log_prob(x, mean, var):
    r""":math:`\log\mathcal N(x; \text{mean}, \text{var})`, elementwise."""
    return -0.5 * (LOG_2PI + var.log() + (x - mean) ** 2 / var)


class NotPositiveDefinite(ValueError):
    """A Cholesky factorization failed; ``GaussianConditionals._rescued`` catches it."""


def cholesky(A, what, site=None, overwrite=False):
    """Cholesky factor of ``A``; raises :class:`NotPositiveDefinite` when it fails
    or when a pivot :math:`L_{kk}^2` falls below ``10 eps`` times its diagonal
    entry: rounding errors in a pivot are of order ``eps`` times the diagonal,
    so such a pivot (and the log-determinant and solves built on it) has lost
    all its digits even where the factorization happens to succeed.

    :param bool overwrite: factor in ``A``'s own storage (no gradient: ``A`` is then
        the factor). Where ``A`` is batched column-major, the layout LAPACK works in,
        no table is allocated, where a fresh one of a megabyte or more is faulted in
        page by page (50 float64 matrices of 50 x 50, one thread: 0.91 ms with a fresh
        table, 0.36 ms in place)."""
    if overwrite:
        diag = torch.diagonal(A, dim1=-2, dim2=-1).clone()  # before A turns into L
        info = torch.empty(A.shape[:-2], dtype=torch.int32, device=A.device)
        L, info = torch.linalg.cholesky_ex(A, out=(A, info))
    else:
        L, info = torch.linalg.cholesky_ex(A)
        diag = torch.diagonal(A, dim1=-2, dim2=-1)
    with torch.no_grad():
        pivots = torch.diagonal(L, dim1=-2, dim2=-1).pow(2)
        # one host sync for both checks (the pivots of a failed factor are junk, but then info says so)
        bad = bool(((info != 0) | (pivots < 10 * torch.finfo(A.dtype).eps * diag).any(-1)).any())
    if bad:
        where = "" if site is None else f" of site {site!r}"
        raise NotPositiveDefinite(
            f"The {what}{where} is not positive definite to working precision (its "
            f"Cholesky factorization failed or lost all digits)"
        )
    return L


def first_jitter(dtype):
    """The first relative jitter of the rescue: 1e-8 in float64, 1e-5 in float32
    (a power of ten well above the ``10 eps`` pivot floor of :func:`cholesky`,
    so that the blocks of the jittered covariance clear it too)."""
    return 10.0 ** math.ceil(math.log10(max(1e-8, 50 * torch.finfo(dtype).eps)))


#: the rounding error, relative to the quantities summed into a log-density, up to
#: which a path computes in the data's dtype; beyond it the engine widens the dtype
#: (float32 -> float64) or, when float64 is not enough either, changes path
PRECISION = 1e-3


def signal_to_noise(F, psi):
    r""":math:`\kappa = \max_i \operatorname{tr}(F^\top\Psi^{-1}F)`, the largest total
    signal-to-noise ratio over the datapoints, a float (inf where :math:`\Psi` has zeros).

    The last pair of tensors asked about is remembered (by identity and version counter):
    the engine asks it of the same state several times a call (its dtype, whether the
    aggregated form keeps its digits), each a host sync and half a dozen kernels."""
    key = _tensor_key(F, psi)
    last = _LAST_SIGNAL_TO_NOISE[0]
    if key is not None and last is not None and last[0]() is F and last[1]() is psi and last[2] == key:
        return last[3]
    kappa = _signal_to_noise(F, psi)
    if key is not None:
        _LAST_SIGNAL_TO_NOISE[0] = (weakref.ref(F), weakref.ref(psi), key, kappa)
    return kappa


#: ``(weakref F, weakref psi, versions, kappa)`` of the last :func:`signal_to_noise`
_LAST_SIGNAL_TO_NOISE = [None]


def _tensor_key(*tensors):
    # tensors made under inference_mode have no version counter: not remembered
    try:
        return tuple((id(t), t._version) for t in tensors)
    except RuntimeError:
        return None


def _signal_to_noise(F, psi):
    with torch.no_grad():
        psi = psi.double()
        ratio = F.double().pow(2).sum(-1) / psi.clamp_min(torch.finfo(torch.float64).tiny)
        return float(torch.where(psi > 0, ratio, math.inf).sum(-1).max())


def lowrank_dtype(F, psi, dtypes=None):
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
    :math:`\epsilon\kappa` must stay below ``PRECISION``. With one column
    (:math:`R = 1`) the precision is a scalar :math:`1 + g^2` that no rounding
    cancels, and the bound is that of the centred residual
    :math:`e^2/\psi`, :math:`\epsilon^2\kappa`.
    """
    if dtypes is None:
        dtypes = tuple(dict.fromkeys((F.dtype, torch.float64)))
    kappa = signal_to_noise(F, psi)
    power = 2 if F.shape[-1] == 1 else 1
    for dtype in dtypes:
        if torch.finfo(dtype).eps ** power * kappa <= PRECISION:
            return dtype
    return None


def dense_dtype(cov, noise=None):
    r"""``cov``'s dtype when Cholesky solves with it are accurate in that dtype, else float64.

    Solves with a Cholesky factor of :math:`\Sigma` carry relative errors of about
    ``eps`` times the condition number of the diagonally scaled
    :math:`S^{-1/2}\Sigma S^{-1/2}` (:math:`S` the diagonal of :math:`\Sigma`),
    and so do the Mahalanobis terms of log p. That condition number is estimated
    as :math:`D / \lambda_{\min}` (:math:`D` bounds the largest eigenvalue, the
    trace), with :math:`\lambda_{\min}` from a few steps of inverse iteration on
    the factor; it must stay below ``PRECISION / eps``. The bound
    :math:`\lambda_{\min} \ge 1/\operatorname{tr}\Sigma_s^{-1}` settles most
    covariances before the iteration.

    With ``noise``, a variance that the covariance has in every direction (the
    noise :math:`\psi` of :math:`\Sigma = FF^\top + \operatorname{diag}(\psi)`, which is
    :math:`\succeq \psi_{\min} I`): :math:`\lambda_{\min} \ge \psi_{\min}/\max_j\Sigma_{jj}`
    settles the covariance without a factorization when that bound passes with a factor
    2 to spare (for the rounding of :math:`\Sigma` itself, about ``eps`` :math:`D\max_j\Sigma_{jj}`);
    the estimate below is no smaller than :math:`\lambda_{\min}`, so it would pass too.

    :param torch.Tensor cov: ``(..., D, D)``.
    :param torch.Tensor noise: ``(..., D)`` or None.
    :returns: ``cov.dtype`` or ``torch.float64``.

    Example::

        >>> dense_dtype(F @ F.T + torch.diag(psi), noise=psi)
        torch.float32
    """
    if cov.dtype == torch.float64:
        return cov.dtype
    with torch.no_grad():
        if noise is not None:
            D = cov.shape[-1]
            largest = torch.diagonal(cov, dim1=-2, dim2=-1).amax(-1)
            bound = torch.finfo(cov.dtype).eps * D * largest <= 0.5 * PRECISION * noise.amin(-1)
            if bool(bound.all()):
                return cov.dtype
        d = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(torch.finfo(cov.dtype).tiny).sqrt()
        L, info = torch.linalg.cholesky_ex(cov / (d.unsqueeze(-1) * d.unsqueeze(-2)))
        if bool((info != 0).any()):
            return torch.float64
        D = cov.shape[-1]
        # eight steps of inverse iteration, v <- M v / |M v| with M = L^-T L^-1, are
        # M^8 v / |M^8 v|: M^8 from three squarings of the explicit inverse (scaled
        # by its trace, which bounds its largest eigenvalue: no power overflows, and
        # the direction is the same) is a dozen small ops in place of 48
        Linv = tril_inverse(L)
        trace = Linv.pow(2).sum((-2, -1), keepdim=True)  # tr M = |L^-1|_F^2
        # M's largest eigenvalue is at most its trace, so lambda_min >= 1 / tr M, and the
        # estimate below is no smaller: when that bound passes, so would the estimate
        if bool((torch.finfo(cov.dtype).eps * D * trace <= PRECISION).all()):
            return cov.dtype
        M = Linv.transpose(-1, -2) @ Linv
        M8 = M / trace
        for _ in range(3):
            M8 = M8 @ M8
        # a start with a component along every eigenvector, unlike a constant one could miss
        v = M8 @ torch.linspace(1.0, 2.0, D, dtype=cov.dtype, device=cov.device).unsqueeze(-1)
        v = v / v.norm(dim=-2, keepdim=True)
        lam_min = 1.0 / (M @ v).norm(dim=-2)
        bad = bool((~(torch.finfo(cov.dtype).eps * D / lam_min <= PRECISION)).any())
    return torch.float64 if bad else cov.dtype


def posterior_precision_factor(F, psi, site):
    r"""Cholesky factor of :math:`I + F^\top\Psi^{-1}F`, ``(..., R, R)``."""
    eye = torch.eye(F.shape[-1], dtype=F.dtype, device=F.device)
    return cholesky(eye + F.transpose(-1, -2) @ (F / psi.unsqueeze(-1)), "posterior precision I + F^T Psi^-1 F", site)


def tril_inverse(L):
    r""":math:`L^{-1}` of lower-triangular factors ``L`` ``(..., n, n)``, by a triangular solve
    against the identity (torch has no triangular inverse of its own; the solve keeps the
    result lower-triangular to rounding).

    Example::

        >>> L = torch.tensor([[2.0, 0.0], [1.0, 4.0]])
        >>> tril_inverse(L) @ L
        tensor([[1., 0.],
                [0., 1.]])
    """
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)


def tril_inverse_transposed(L):
    r""":math:`X = L^{-\top}` of lower-triangular factors ``L`` ``(..., n, n)``, by a triangular
    solve from the right (:math:`XL^\top = I`), and so :math:`(LL^\top)^{-1} = XX^\top`: on
    row-major batches the solve from the right runs in the layout LAPACK takes, without
    the transposed copies of a solve from the left (:func:`tril_inverse`): 96 factors of
    50 x 50, one thread, float32 0.47 -> 0.26 ms, and with the Gram product
    :math:`L^{-\top}L^{-1}` 0.74 -> 0.46 ms, the same numbers where ``cholesky_inverse``
    took 1.15 ms.

    Example::

        >>> L = torch.tensor([[2.0, 0.0], [1.0, 4.0]])
        >>> X = tril_inverse_transposed(L)
        >>> X @ X.mT  # torch.linalg.inv(L @ L.T)
        tensor([[ 0.2656, -0.0312],
                [-0.0312,  0.0625]])
    """
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(L.transpose(-1, -2), eye.expand_as(L), upper=True, left=False)


def missing_as_standard_normal(observed, x):
    """``(o, missing_term)``: the observed tokens as 0/1 weights, and the log-density
    ``0.5 log(2 pi)`` per missing token that undoes their stand-in ``N(0; 0, 1)``."""
    o = observed.to(x.dtype)
    return o, 0.5 * LOG_2PI * (1.0 - o).sum(-1)


def gather_tokens(t, order):
    """``t[..., order]`` along the token dim for ``t`` of shape ``(r, D, *rest)``."""
    p, rows, D = order.shape
    r = t.shape[0]
    k = max(rows, r)
    rest = t.shape[2:]
    idx = order.expand(p, k, D).reshape((p, k, D) + (1,) * len(rest)).expand((p, k, D) + rest)
    return torch.gather(t.unsqueeze(0).expand((p, k) + t.shape[1:]), 2, idx)


@functools.lru_cache(maxsize=16)
def packed_pairs(K, device):
    """The index pairs ``(a, b)``, ``a <= b``, of a symmetric ``K x K`` matrix's
    upper triangle, and the map ``(K, K)`` from each entry to its pair (cached:
    read-only index tensors)."""
    a, b = torch.triu_indices(K, K, device=device)
    full = torch.empty(K, K, dtype=torch.long, device=device)
    pos = torch.arange(a.numel(), device=device)
    full[a, b] = pos
    full[b, a] = pos
    return a, b, full


class SymmetricPacking:
    r"""The :math:`R(R+1)/2` entries :math:`a \le b` of symmetric :math:`R\times R`
    matrices: products with the rows' outer products :math:`F_jF_j^\top` in this
    packing (:meth:`features`) cost half the full ones.

    :param int R: the matrices' size.
    :param torch.dtype dtype: of :attr:`off`.
    :param device: of the index tensors.

    Example::

        >>> pk = SymmetricPacking(3, torch.float64, "cpu")
        >>> M = torch.eye(3)
        >>> pk.unpack(pk.pack(M)).equal(M)
        True
    """

    def __init__(self, R, dtype, device=None):
        self.R = R
        self.a, self.b, full = packed_pairs(R, device)
        self.upper = self.a * R + self.b
        self.full = full.reshape(-1)
        #: 1 on the diagonal, 2 off it: an off-diagonal entry stands for two
        self.off = 2 - (self.a == self.b).to(dtype)

    def features(self, F):
        r"""``(D, R)`` -> ``(D, R(R+1)/2)``: the rows' outer products :math:`F_{ja}F_{jb}`."""
        if F.element_size() == 8 and F.shape[-2] * self.R * self.R <= 2**22:
            # the full outer products, then the packed entries (the same products): index_select
            # copies 8-byte entries one at a time (see _select); measured inside the loss, PPCA
            # D = 200, K = 50, one thread: 1.5-2.1 -> 0.8-1.1 ms float64, where float32's
            # vectorized selections stay faster (0.43 against 1.0 ms)
            return self.pack(F.unsqueeze(-1) * F.unsqueeze(-2))
        return F.index_select(-1, self.a) * F.index_select(-1, self.b)

    def pack(self, M):
        """``(..., R, R)`` symmetric -> ``(..., R(R+1)/2)``."""
        return self._select(M.reshape(*M.shape[:-2], self.R * self.R), self.upper)

    def unpack(self, p):
        """``(..., R(R+1)/2)`` -> ``(..., R, R)``."""
        return self._select(p, self.full).view(*p.shape[:-1], self.R, self.R)

    @staticmethod
    def _select(x, index):
        # the last dim's entries at index: on CPU, index_select along the last dim copies 8-byte
        # entries one at a time (measured 2.3 ns each, 2-4x slower than gather with the index
        # broadcast over the rows); 4-byte ones take its vectorized path (faster than gather)
        if x.element_size() == 8 and x.dim() > 1:
            return torch.gather(x, -1, index.expand(*x.shape[:-1], -1))
        return x.index_select(-1, index)
