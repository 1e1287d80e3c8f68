r"""The datapoint rows of a Gaussian marginal's pieces, shared by the batch where they can be.

:func:`~pyro_mpt.conditionals.gaussian_marginal.gaussian_marginal` runs the
model on a few noise points and reads its location and noise off them, as
``(points, n, *event)`` tensors. A piece that every datapoint shares (a
parameter expanded over the data plate, or written out per datapoint with equal
rows) is kept at one row, ``(points, 1, *event)``: stored and differentiated
once, and, for the covariance, factored once per mask instead of once per
datapoint.
"""

import torch

from .distributions import compact

__all__ = ["to_rows", "basis_rows", "equal_rows_once", "rows_equal", "common_rows", "shared_loading"]

def to_rows(t, batch_shape, event_ndim, rows):
    """``t`` broadcastable to ``(rows, *batch_shape, *event)`` -> ``(rows, n|1, *event)``.

    Batch dims that are all expanded (stride 0) collapse to one shared row, so
    parameters shared by the datapoints are stored (and differentiated) once.
    """
    event = t.shape[t.dim() - event_ndim :]
    nb = len(batch_shape)
    full = torch.Size((rows,) + tuple(batch_shape)) + event
    t = t.expand(full)
    c = compact(t)
    if all(s == 1 for s in c.shape[1 : 1 + nb]):
        c = c.expand((rows,) + (1,) * nb + event)
        return c.reshape((rows, 1) + event)
    return t.reshape((rows, -1) + event)
def basis_rows(loc, noise, batch_shape, rows):
    """Bring location and noise tensors to ``(rows, n|1, *event)``."""
    event_ndims = {"diag": (1,), "lowrank": (2, 1), "dense": (2,), "tril": (2,)}[noise[0]]
    loc = to_rows(loc, batch_shape, 1, rows)
    parts = tuple(equal_rows_once(to_rows(t, batch_shape, e, rows)) for t, e in zip(noise[1:], event_ndims))
    return loc, (noise[0],) + parts
def equal_rows_once(t):
    """``(rows, n, *event)`` at ``(rows, 1, *event)`` when every datapoint's row is
    the first's: a noise scale written out per datapoint (``s * torch.ones_like(x)``)
    is shared by the batch as much as an expanded one, and kept per datapoint it
    would make the engine factor every mask once per datapoint."""
    return t[:, :1] if t.shape[1] > 1 and rows_equal(t, dim=1) else t
def rows_equal(t, dim=0):
    """Whether every slice of ``t`` along ``dim`` equals the first (stride-0 dims without comparing;
    a 0-dim tensor has one row)."""
    if t.dim() == 0:
        return True
    t = compact(t)
    return t.shape[dim] == 1 or bool(torch.equal(t, t.narrow(dim, 0, 1).expand_as(t)))
def common_rows(*ts, dim=0):
    """Broadcast the (n|1) dim ``dim`` of several tensors to a common size."""
    rows = max(t.shape[dim] for t in ts)
    out = []
    for t in ts:
        if t.shape[dim] != rows:
            shape = list(t.shape)
            shape[dim] = rows
            t = t.expand(shape)
        out.append(t)
    return tuple(out)

def shared_loading(loc_k, mu):
    r"""The loading :math:`W_k = \mathrm{loc}(e_k) - \mathrm{loc}(0)`, ``(K, n|1, D)``,
    at one shared row when every datapoint's agrees with the first's to rounding.

    A location with covariates (:math:`c_i B + W z`) varies by datapoint while
    its loading does not; the difference of two per-datapoint locations is then
    a per-datapoint tensor whose rows differ only by the rounding of the
    locations (at most :math:`\epsilon(|\mathrm{loc}| + |\mu|)` each). Kept
    per datapoint, the marginal's covariance would not be shared by the batch
    and every mask's factor would be computed once per datapoint (100 times
    slower at :math:`n = 1000`, :math:`D = 200`); one row is exact to that
    rounding and carries the same gradient with respect to the loading.
    A loading that depends on the datapoint (e.g. scaled by a covariate)
    differs between rows by far more and stays per datapoint.
    """
    if loc_k.shape[1] == 1 and mu.shape[0] == 1:
        return loc_k - mu
    # the check runs outside autograd and returns the loading from the first
    # rows only: recorded on the (K, n, D) differences, the check and the
    # slice's backward cost 50 times the exact log-density at K=50, D=200
    with torch.no_grad():
        W = loc_k - mu
        dev = (W - W[:, :1]).abs().amax(1, keepdim=True)  # (K, 1, D)
        # rounding of the two locations (each a sum with the covariate term),
        # bounded by each token's largest magnitude, with slack
        size = loc_k.abs().amax(1, keepdim=True) + mu.abs().amax(0, keepdim=True)
        shared = bool((dev <= 16 * torch.finfo(W.dtype).eps * size).all())
    if shared:
        return loc_k[:, :1] - mu[:1]
    return loc_k - mu
