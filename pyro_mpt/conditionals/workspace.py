"""Scratch tables reused by every chunk of a chunked computation.

A chunk loop that allocates its tables afresh hands them back to the
allocator at the end of each chunk; tables of a megabyte or more are then often
returned to the operating system and faulted in again, page by page, by the
next chunk's first write: measured, that made a chunk's elementwise passes
five to seven times slower than the same passes over a table already mapped.
"""

import torch

__all__ = ["Workspace"]


class Workspace:
    """Named flat buffers that chunks take views of.

    :param torch.dtype dtype: of every buffer.
    :param device: of every buffer.

    Example::

        >>> ws = Workspace(torch.float32, "cpu")
        >>> a = ws.take("a", (3, 4))      # allocated once ...
        >>> b = ws.take("a", (2, 4))      # ... and reused: b shares a's storage
    """

    def __init__(self, dtype, device=None):
        self.dtype, self.device = dtype, device
        self._flat = {}

    def take(self, name, shape):
        """An uninitialized view ``shape`` of the buffer ``name`` (grown when too small)."""
        numel = 1
        for s in shape:
            numel *= s
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel:
            flat = self._flat[name] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return flat[:numel].view(shape)
