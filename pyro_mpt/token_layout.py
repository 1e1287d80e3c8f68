"""Where an observed site's tokens sit in its values: :class:`TokenLayout`.

The tokens of a datapoint are the flattened event elements of the observed
site together with the elements of its token plates (see
:mod:`pyro_mpt.observed_tokens`); a layout maps tensors between the site's shape and the
``(n, D)`` token matrix every engine works on.
"""

import math
from dataclasses import dataclass

import torch
from pyro.distributions.util import broadcast_shape

__all__ = ["TokenLayout"]


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens sit in an observed site's values: its shapes and token-plate dims.

    :param torch.Size site_batch_shape: the site's own batch shape.
    :param torch.Size event_shape: the site's event shape.
    :param tuple token_dims: the batch dims (negative, from the right) of the
        site's token plates; empty when the tokens are the event dims only.

    Example::

        >>> layout = TokenLayout(torch.Size([5, 3]), torch.Size([2]), token_dims=(-1,))
        >>> layout.datapoint_shape, layout.num_tokens     # (torch.Size([5]), 6)
    """

    site_batch_shape: torch.Size
    event_shape: torch.Size
    token_dims: tuple

    @property
    def site_shape(self):
        """The observed site's shape, ``site_batch_shape + event_shape``."""
        return self.site_batch_shape + self.event_shape

    @property
    def batch_shape(self):
        """The datapoints' batch shape in the site's plate layout: the site's batch
        shape with token-plate dims set to 1 (the batch shape of a latent local to
        each datapoint)."""
        nb = len(self.site_batch_shape)
        return torch.Size(1 if i - nb in self.token_dims else s for i, s in enumerate(self.site_batch_shape))

    @property
    def datapoint_shape(self):
        """The site's batch shape without its token-plate dims: the shape of per-datapoint results."""
        nb = len(self.site_batch_shape)
        drop = {nb + d for d in self.token_dims}
        return torch.Size(s for i, s in enumerate(self.site_batch_shape) if i not in drop)

    @property
    def num_data(self):
        """``n``, the number of datapoints in this (mini)batch."""
        return math.prod(self.datapoint_shape)

    @property
    def num_tokens(self):
        """``D``, the number of tokens per datapoint."""
        return math.prod(self.site_shape) // max(self.num_data, 1)

    def unflatten(self, values):
        """Reshape ``(..., n)`` per-datapoint values to ``(..., *datapoint_shape)``."""
        return values.reshape(values.shape[:-1] + self.datapoint_shape)

    def to_tokens(self, t):
        """Bring a tensor in the site's layout to token layout.

        :param torch.Tensor t: broadcastable to ``(*lead, *site_batch_shape,
            *event_shape)`` (any leading dims, e.g. a particle plate's).
        :returns: ``(*lead, *datapoint_shape, D)``: the token-plate dims move
            next to the event dims and are flattened with them. Dims that are
            broadcast (stride 0) outside the tokens stay broadcast.
        """
        E = len(self.event_shape)
        # pyro's broadcast_shape: torch.broadcast_shapes imports sympy on first use (seconds)
        shape = torch.Size(broadcast_shape(t.shape, self.site_shape))
        t = t.expand(shape)
        nb = len(shape) - E
        T = len(self.token_dims)
        if T:
            src = [nb + d for d in sorted(self.token_dims)]
            t = t.movedim(src, list(range(nb - T, nb)))
        keep = len(shape) - T - E
        # narrow broadcast leading dims before flattening so they are not materialized
        lead = t.shape[:keep]
        for i in range(keep):
            if t.stride(i) == 0 and t.shape[i] > 1:
                t = t.narrow(i, 0, 1)
        t = t.reshape(t.shape[:keep] + (-1,))
        return t.expand(lead + (t.shape[-1],))

    def to_site(self, x):
        """Inverse of :meth:`to_tokens` for ``(*lead, n, D)`` token tensors.

        :returns: ``(*lead, *site_batch_shape, *event_shape)``.
        """
        lead = x.shape[:-2]
        sizes = [self.site_batch_shape[d] for d in sorted(self.token_dims)]
        t = x.reshape(lead + self.datapoint_shape + tuple(sizes) + self.event_shape)
        T = len(self.token_dims)
        if T:
            nd = len(lead) + len(self.datapoint_shape)
            nb = len(lead) + len(self.site_batch_shape)
            t = t.movedim(list(range(nd, nd + T)), [nb + d for d in sorted(self.token_dims)])
        return t
