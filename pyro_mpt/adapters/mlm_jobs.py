r"""Which masked copies of a sequence a masked-LM query needs, and running them in
packed batches.

A *job* of a sequence with :math:`L` maskable tokens is a pair ``(mask,
weight)`` of bool and float64 ``(J, L)`` tensors: row :math:`c` is one masked
copy, and its result is :math:`\sum_j w_{cj}\log p(x_j \mid x_{\mathcal R_c})`
over its masked positions. :func:`rate_jobs` (the MPT curve),
:func:`schedule_jobs` (a :class:`~pyro_mpt.masks.MaskSchedule`) and
:func:`pll_jobs` (pseudo-log-likelihood) build them; :func:`run_jobs` packs the
copies of equal-length sequences into forward passes of at most ``max_tokens``
tokens and scatters the results back per sequence.
"""

import torch

from ..mask_blocks import ChainBlock, MaskBlock
from ..random_streams import seeded_streams
from .batching import group_by_length, pack
from .rates import item_seed

__all__ = ["rate_jobs", "schedule_jobs", "pll_jobs", "run_jobs"]


def rate_jobs(ranks, counts):
    r"""Masked copies for an MPT curve: the masks of ``K`` nested orderings at each
    distinct mask size, weighted :math:`1/M` (a mean over the masked tokens).

    :param ranks: long ``(K, L)``, each row a permutation of ``0..L-1``; a mask
        of size :math:`M` masks the tokens of rank below :math:`M`.
    :param counts: long ``(R,)`` mask size per rate.
    :returns: ``(mask, weight, inverse)``: bool and float64 ``(K U, L)`` over
        the :math:`U` distinct sizes (row ``k U + u``), and long ``(R,)`` the
        index of each rate's size among them.

    Example::

        >>> mask, weight, inverse = rate_jobs(torch.tensor([[2, 0, 1]]), torch.tensor([1, 1, 3]))
        >>> mask.int().tolist(), inverse.tolist()
        ([[0, 1, 0], [1, 1, 1]], [0, 0, 1])
    """
    sizes, inverse = torch.unique(counts, return_inverse=True)
    mask = ranks[:, None, :] < sizes[None, :, None]  # (K, U, L)
    weight = mask.double() / sizes[None, :, None].double()
    L = ranks.shape[-1]
    return mask.reshape(-1, L), weight.reshape(-1, L), inverse


def schedule_jobs(schedule, seed, item, L):
    r"""Masked copies for a mask schedule's estimate of :math:`\sum_{M=1}^L S(x; M)`.

    The schedule draws its masks from a stream seeded by ``(seed, item)``, so a
    sequence's masks do not depend on the batch or on sharding. A
    :class:`~pyro_mpt.mask_blocks.MaskBlock` row is weighted ``weight / size`` on
    each masked token; a :class:`~pyro_mpt.mask_blocks.ChainBlock` ordering
    :math:`\pi` becomes :math:`L` copies, copy :math:`t` masking
    :math:`\pi_0..\pi_t` and scoring :math:`\pi_t` alone.

    :param schedule: a :class:`~pyro_mpt.masks.MaskSchedule`.
    :returns: ``(mask, weight)``, bool and float64 ``(J, L)``.
    """
    with seeded_streams(item_seed(seed, item)):
        blocks = list(schedule.blocks(1, L, max_elements=max(2**22, 4 * L * L), device="cpu"))
    masks, weights = [], []
    for b in blocks:
        if isinstance(b, MaskBlock):
            m = b.masks()[:, 0, :]
            w = b.weight.double().reshape(-1) / b.size.double().reshape(-1)
            masks.append(m)
            weights.append(m.double() * w[:, None])
        elif isinstance(b, ChainBlock):
            order = b.orders()[:, 0, :]  # (p, L)
            rank = order.argsort(-1)  # position of each token in its ordering
            t = torch.arange(L, device="cpu")
            m = rank[:, None, :] <= t[None, :, None]  # (p, t, L): tokens pi_0..pi_t masked
            w = torch.zeros(order.shape[0], L, L, dtype=torch.float64, device="cpu")
            w.scatter_(2, order[:, :, None], b.weight.double().reshape(-1, 1, 1).expand(-1, L, 1))
            masks.append(m.reshape(-1, L))
            weights.append(w.reshape(-1, L))
        else:  # pragma: no cover - new block types must be wired here
            raise TypeError(f"Unsupported block type {type(b).__name__}.")
    return torch.cat(masks), torch.cat(weights)


def pll_jobs(L, word_ids=None):
    r"""Masked copies for the pseudo-log-likelihood: copy :math:`j` masks and scores
    token :math:`j`; with ``word_ids`` (PLL-word-l2r) it also masks the later
    tokens of the same word.

    :param int L: maskable tokens.
    :param word_ids: long ``(L,)`` word of each token (-1 unknown), or None.
    :returns: ``(mask, weight)``, bool and float64 ``(L, L)``.
    """
    eye = torch.eye(L, dtype=torch.bool, device="cpu")
    mask = eye
    if word_ids is not None:
        w = word_ids
        same = (w[:, None] == w[None, :]) & (w[:, None] >= 0)
        mask = eye | (same & torch.ones(L, L, dtype=torch.bool, device="cpu").triu(1))
    return mask, eye.double()


def run_jobs(enc, items, make_jobs, log_probs, mask_token_id, max_tokens, bar):
    r"""Weighted log-probability sums of masked copies, packed into forward passes.

    :param enc: the :class:`~pyro_mpt.adapters.mlm_inputs.Encoded` sequences.
    :param items: indices of the sequences to score.
    :param callable make_jobs: ``make_jobs(i) -> (mask, weight)``, bool and
        float ``(J, L_i)`` over sequence ``i``'s maskable tokens: one masked
        copy per row.
    :param callable log_probs: ``log_probs(inp, sel, targets, types)``, e.g. a
        :class:`~pyro_mpt.adapters.mlm_forward.MaskedForward`.
    :param int mask_token_id: the id that replaces masked tokens.
    :param int max_tokens: token budget of one forward pass (copies x length).
    :param bar: a progress bar (``update(n)``).
    :returns: dict ``i -> (J,)`` float64 tensor of
        :math:`\sum_j w_j \log p(x_j \mid x_{\mathcal R})` over the masked
        positions of each copy.
    """
    jobs, results = {}, {}

    def num_jobs(i):
        jobs[i] = make_jobs(i)
        results[i] = torch.zeros(jobs[i][0].shape[0], dtype=torch.float64, device="cpu")
        return jobs[i][0].shape[0]

    groups = group_by_length(items, [x.numel() for x in enc.ids])
    with torch.inference_mode():
        for T, pieces in pack(groups, num_jobs, max_tokens):
            B = sum(stop - start for _, start, stop in pieces)
            # packed on the host, moved to the model's device in one copy per batch
            ids = torch.empty((B, T), dtype=torch.long, device="cpu")
            masked = torch.zeros((B, T), dtype=torch.bool, device="cpu")
            weight = torch.zeros((B, T), dtype=torch.float64, device="cpu")
            types = None if enc.token_type_ids is None else torch.empty((B, T), dtype=torch.long, device="cpu")
            r = 0
            for i, start, stop in pieces:
                m, w = jobs[i]
                j = stop - start
                pos = enc.maskable[i]
                ids[r : r + j] = enc.ids[i]
                masked[r : r + j, pos] = m[start:stop]
                weight[r : r + j, pos] = w[start:stop]
                if types is not None:
                    types[r : r + j] = enc.token_type_ids[i]
                r += j
            # a masked position with zero weight is context-free noise: no head needed
            sel = masked & (weight != 0)
            targets = ids[sel]
            inp = ids.masked_fill(masked, mask_token_id)
            lp = log_probs(inp, sel, targets, types)
            row = torch.nonzero(sel)[:, 0]
            sums = torch.zeros(B, dtype=torch.float64, device="cpu").index_add_(0, row, lp.double().cpu() * weight[sel])
            r = 0
            for i, start, stop in pieces:
                j = stop - start
                results[i][start:stop] = sums[r : r + j]
                r += j
                if stop == jobs[i][0].shape[0]:
                    del jobs[i]
            bar.update(B)
    return results
