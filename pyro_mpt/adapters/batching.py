"""Packing masked copies into forward passes, and sharding items across processes.

Scoring a masked model means one forward pass per masked copy of an item. The
adapters pack many copies into one batch under a *token budget* (copies x
sequence length), so memory stays bounded whatever the input length, and never
mix items of different lengths in one batch: there is no padding, so an item's
numbers do not depend on its batch neighbours (to float rounding: other batch
shapes may run other BLAS kernels).

For corpora that outgrow one machine, :func:`shard` splits the items across
the processes of a HuggingFace ``accelerate`` launch and :func:`gather_rows`
puts the per-item results back together on every process.
"""

import math
from collections import defaultdict
from contextlib import contextmanager

import torch

from .optional_packages import missing_package_message
from ..counts import is_count

__all__ = ["positive_count", "check_not_empty", "group_by_length", "pack", "shard", "gather_rows", "resolve_accelerator", "place_model", "eval_mode"]


def positive_count(value, name):
    """``value`` as an int, where it is a positive integer (numpy integers too, as from
    ``np.arange``); else a ``ValueError`` naming ``name`` (``batch_size=2.5`` ran as 2).

    Example::

        >>> positive_count(np.int64(4), "num_masks")
        4
    """
    if not is_count(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def check_not_empty(count, what):
    """Refuse an input with no items: an empty list, a ``(0, ...)`` tensor or ids mapping, an
    empty ``datasets.Dataset`` (before: an ``IndexError`` or a reshape error deep inside).

    :param int count: the number of items.
    :param str what: one item, for the message (``"sequence"``, ``"image"``).
    :raises ValueError: when ``count`` is 0.

    Example::

        >>> check_not_empty(3, "sequence")   # None; check_not_empty(0, "image") raises
    """
    if count == 0:
        raise ValueError(f"inputs is empty: pass at least one {what}.")


def group_by_length(indices, lengths):
    """``[(T, [items...]), ...]``, longest first; items keep their order.

    :param indices: item indices to group.
    :param lengths: ``lengths[i]`` is the sequence length of item ``i``.
    """
    groups = defaultdict(list)
    for i in indices:
        groups[int(lengths[i])].append(int(i))
    return sorted(groups.items(), key=lambda kv: -kv[0])


def pack(groups, num_jobs, max_tokens):
    """Plan batches of masked copies under a token budget.

    :param groups: ``[(T, [items])]`` from :func:`group_by_length`.
    :param callable num_jobs: ``num_jobs(item)``, the number of copies of an item.
    :param int max_tokens: bound on ``copies * T`` per batch; one copy per
        batch when ``T > max_tokens``.
    :returns: a generator of ``(T, [(item, start, stop), ...])``: copies
        ``start:stop`` of ``item`` go into the batch, in order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive token budget, got {max_tokens}.")
    for T, items in groups:
        cap = max(1, max_tokens // T)
        pending, filled = [], 0
        for item in items:
            J, start = num_jobs(item), 0
            while start < J:
                take = min(J - start, cap - filled)
                pending.append((item, start, start + take))
                filled += take
                start += take
                if filled == cap:
                    yield T, pending
                    pending, filled = [], 0
        if pending:
            yield T, pending


def resolve_accelerator(accelerator):
    """``None`` stays ``None``; ``True`` builds an ``accelerate.Accelerator()``."""
    if accelerator is None or accelerator is False:
        return None
    if accelerator is True:
        try:
            from accelerate import Accelerator
        except ImportError as err:
            # not loading.optional_import: loading's ViT-MAE load imports this module
            raise ImportError(missing_package_message("accelerate", "accelerator=True", err)) from err
        return Accelerator()
    return accelerator


def place_model(model, device=None, accelerator=None):
    """Put ``model`` on its device; return ``(model, device, accelerator)``.

    The device is the accelerator's when one is used (``accelerate`` assigns one
    per process), else ``device``, else where the model's parameters already are.
    The model's train/eval mode is left alone: the scorers run each query under
    :func:`eval_mode`.
    """
    accelerator = resolve_accelerator(accelerator)
    if accelerator is not None:
        device = accelerator.device
    if device is not None:
        model = model.to(device)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    return model, device, accelerator


@contextmanager
def eval_mode(model):
    """Run a block with ``model`` in eval mode, then give every submodule back its own mode.

    A scorer built once and queried between training steps sees the model in
    train mode, where dropout would make every log-probability a random draw;
    setting eval mode once at construction is not enough, and leaving it set
    would switch dropout off in the user's training.

    Example::

        >>> with eval_mode(model):
        ...     logits = model(input_ids).logits   # deterministic, whatever model.training was
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def shard(n, accelerator):
    """Item indices this process scores: ``range(rank, n, world)``, or all."""
    if accelerator is None:
        return list(range(n))
    return list(range(accelerator.process_index, n, accelerator.num_processes))


def gather_rows(rows, index, n, accelerator, fill=float("nan")):
    """Scatter per-item rows computed on each process into one ``(n, ...)`` tensor.

    :param torch.Tensor rows: ``(n_local, ...)`` results of this process.
    :param torch.Tensor index: ``(n_local,)`` global item indices of ``rows``.
    :param int n: total number of items.
    :param accelerator: ``accelerate.Accelerator`` or None.
    :returns: ``(n, ...)`` CPU tensor; rows no process computed hold ``fill``.
    """
    rows = rows.detach().cpu()
    index = torch.as_tensor(index, dtype=torch.long, device="cpu")
    if accelerator is not None:
        # gather wants equal shapes on every process: pad to ceil(n / world) rows
        per = math.ceil(n / accelerator.num_processes)
        pad = per - rows.shape[0]
        rows = torch.cat([rows, rows.new_full((pad,) + rows.shape[1:], fill)])
        index = torch.cat([index, index.new_full((pad,), -1)])
        rows = accelerator.gather(rows.to(accelerator.device)).cpu()
        index = accelerator.gather(index.to(accelerator.device)).cpu()
    out = rows.new_full((n,) + rows.shape[1:], fill)
    keep = index >= 0
    out[index[keep]] = rows[keep]
    return out
