r"""MPT curves and likelihood-style scores for HuggingFace masked language models.

For a sequence :math:`x` with :math:`L` maskable tokens (special tokens and
padding are never masked nor scored), a masked LM gives, for any mask
:math:`\mathcal M`, the conditionals :math:`p_\theta(x_j \mid x_{\mathcal R})`,
:math:`j \in \mathcal M`, by replacing the masked tokens with ``[MASK]``.
Section 3.2 of the paper draws the MPT curve

.. math:: S(x; M) = \frac1M\,\mathbb E_{|\mathcal M| = M}
    \Big[\sum_{j\in\mathcal M}\log p_\theta(x_j\mid x_{\mathcal R})\Big]

against the masking rate :math:`M / L` and reads its area as an approximation of
the log-marginal likelihood. :class:`MaskedLMScorer` computes that curve
(:meth:`~MaskedLMScorer.curve`), the cumulative score
:math:`\sum_{M=1}^L S(x; M)` per sequence (:meth:`~MaskedLMScorer.score`) and
the pseudo-log-likelihood, its :math:`M = 1` term
(:meth:`~MaskedLMScorer.pll`).

**What the cumulative score is for a network.** A masked LM's conditionals need
not come from one joint distribution. For an ordering :math:`\pi` of the
tokens, the chain of conditionals
:math:`q_\pi(x) = \prod_{t=1}^L p_\theta(x_{\pi_t}\mid x_{\pi_{t+1}},\dots,x_{\pi_L})`
is a normalized distribution over the token identities (given the length and
special tokens), and

.. math:: \sum_{M=1}^L S(x; M) = \mathbb E_\pi\big[\log q_\pi(x)\big]
    \le \log \mathbb E_\pi\big[q_\pi(x)\big],

the expectation over uniform orderings of an order-specific log-likelihood:
a lower bound (Jensen) on the log-likelihood of the *mixture over orderings*.
It equals :math:`\log p(x)` only when the conditionals are consistent; it is
not BERT's exact likelihood, which BERT does not define.

The scorer is assembled from three modules with one job each:
:mod:`~pyro_mpt.adapters.mlm_inputs` (texts and ids into sequences),
:mod:`~pyro_mpt.adapters.mlm_jobs` (which masked copies a query needs, packed
into forward passes) and :mod:`~pyro_mpt.adapters.mlm_forward` (the forward
pass and the head at the scored positions).
"""

from numbers import Real

import torch

from ..masks import FixedRate, make_schedule
from .batching import eval_mode, gather_rows, place_model, positive_count, shard
from .mlm_forward import MaskedForward
from .columns import text_columns
from .mlm_inputs import check_tokenizer, encode_inputs, position_limit, position_limit_words
from .mlm_jobs import pll_jobs, rate_jobs, run_jobs, schedule_jobs
from .rates import PAPER_MLM_RATES, check_rates, item_generator, mask_counts, nested_ranks, rate_curve

__all__ = ["MaskedLMScorer"]


class MaskedLMScorer:
    r"""MPT curves, cumulative MPT scores and pseudo-log-likelihoods of a masked LM.

    Works with any ``AutoModelForMaskedLM``-style model (BERT, RoBERTa,
    DistilBERT, ALBERT, ELECTRA, ESM, ...). Every query is a masked copy of a
    sequence with the masked tokens replaced by the tokenizer's mask token;
    copies of equal-length sequences are packed into forward passes of at most
    ``max_tokens`` tokens (no padding), the LM head runs only where a
    log-probability is needed (for known architectures,
    :data:`~pyro_mpt.adapters.mlm_forward.HEADS`), under
    :func:`torch.inference_mode`. A sequence's masks come from a generator
    seeded by ``(seed, the sequence's index in the inputs)``: they depend on the
    seed and on that index only, not on ``max_tokens``, on batching, on sharding
    or on the other sequences' content (the same sequence at another index gets
    other masks, drawn alike), and the results do not either, to float rounding
    (other batch shapes may run other BLAS kernels: agreement to about
    :math:`256\,\epsilon_{\text{float32}} \approx 3\cdot10^{-5}` relative).

    :param model: a masked LM (``transformers.PreTrainedModel``); every query runs
        it in eval mode (no dropout) and gives it back in the mode it was in.
    :param tokenizer: its tokenizer; needed for text inputs. Pre-tokenized
        inputs work without one given ``mask_token_id`` and ``special_token_ids``.
    :param int max_tokens: token budget of one forward pass (copies x length).
    :param int max_logits: bound on the logits computed at once (positions x
        vocabulary); the head runs in chunks beyond it.
    :param device: where to run; default the model's device.
    :param bool bf16: autocast the forward pass to bfloat16 (GPU; log-softmax
        stays float32).
    :param str head: ``"auto"`` (masked positions only when the class is known),
        ``"masked"`` (require it) or ``"full"`` (always full logits).
    :param int max_length: truncate texts to this many tokens; default the
        model's limit (the smaller of the tokenizer's ``model_max_length`` and
        the model's positions). Refused beyond the model's positions.
    :param text_column: column of a ``datasets.Dataset`` (or a pair of columns).
    :param int seed: default seed of the masks.
    :param bool progress: show a tqdm progress bar.
    :param accelerator: an ``accelerate.Accelerator`` (or True to build one):
        sequences are sharded across its processes and results gathered.
    :param int mask_token_id: overrides the tokenizer's.
    :param special_token_ids: ids never masked nor scored; default the
        tokenizer's ``all_special_ids`` (CLS, SEP, PAD, MASK, UNK, ...).

    Example::

        >>> from transformers import AutoModelForMaskedLM, AutoTokenizer
        >>> model = AutoModelForMaskedLM.from_pretrained("bert-base-uncased")
        >>> tok = AutoTokenizer.from_pretrained("bert-base-uncased")
        >>> scorer = MaskedLMScorer(model, tok, max_tokens=8192)
        >>> curve = scorer.curve(["The cat sat on the mat."], num_masks=4)
        >>> curve.plot(); table2_area(curve)
        >>> scorer.pll(["The cat sat on the mat."])
        tensor([...], dtype=torch.float64)
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_tokens=8192,
        max_logits=2**22,
        device=None,
        bf16=False,
        head="auto",
        max_length=None,
        text_column="text",
        seed=0,
        progress=False,
        accelerator=None,
        mask_token_id=None,
        special_token_ids=None,
    ):
        if head not in ("auto", "masked", "full"):
            raise ValueError(f'head must be "auto", "masked" or "full", got {head!r}.')
        if not isinstance(model, torch.nn.Module):
            # MaskedLMScorer(tokenizer, model) failed in transformers: "BertTokenizer has no attribute parameters"
            swapped = " (the arguments look swapped)" if isinstance(tokenizer, torch.nn.Module) else ""
            given = (f"the class {model.__name__}, not a model (load one: {model.__name__}.from_pretrained(...))"
                     if isinstance(model, type) else f"{type(model).__name__}{swapped}")
            raise TypeError(
                f"MaskedLMScorer's first argument is the model, a torch.nn.Module such as "
                f"AutoModelForMaskedLM.from_pretrained(...); got {given}. The tokenizer "
                f"comes second: MaskedLMScorer(model, tokenizer)."
            )
        max_tokens = positive_count(max_tokens, "MaskedLMScorer(max_tokens=...), the token budget of a forward pass,")
        max_logits = positive_count(max_logits, "MaskedLMScorer(max_logits=...), the logits budget of a forward pass,")
        self.model, self.device, self.accelerator = place_model(model, device, accelerator)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        text_columns(text_column, "MaskedLMScorer(text_column=...)")
        self.text_column = text_column
        if max_length is not None:
            max_length = positive_count(max_length, "MaskedLMScorer(max_length=...), the most tokens of a sequence,")
        self.seed = seed
        self.progress = progress
        limit = position_limit(self.model.config)
        if max_length is not None and limit is not None and int(max_length) > limit:
            raise ValueError(
                f"max_length={max_length} is more than the {limit} positions the model takes "
                f"({position_limit_words(self.model.config)}); pass max_length <= {limit}, or leave it out to "
                f"truncate to the model's limit."
            )
        self.max_length = max_length

        if mask_token_id is None:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if mask_token_id is None:
            raise ValueError(
                "No mask token: pass a tokenizer with a mask token, or mask_token_id=... "
                "for pre-tokenized inputs."
            )
        self.mask_token_id = int(mask_token_id)
        if special_token_ids is None:
            if tokenizer is None:
                raise ValueError(
                    "Without a tokenizer, pass special_token_ids=[...] (the ids never to mask, "
                    "e.g. CLS, SEP, PAD)."
                )
            special_token_ids = tokenizer.all_special_ids
        self.special_token_ids = torch.tensor(sorted({int(i) for i in special_token_ids}), dtype=torch.long, device="cpu")
        #: the forward pass (:class:`~pyro_mpt.adapters.mlm_forward.MaskedForward`)
        self.forward = MaskedForward(self.model, self.device, head=head, max_logits=max_logits, bf16=bf16)
        check_tokenizer(tokenizer, model)

    def encode(self, inputs, text_column=None):
        """Normalize inputs into an :class:`~pyro_mpt.adapters.mlm_inputs.Encoded`
        (padding removed); see :func:`~pyro_mpt.adapters.mlm_inputs.encode_inputs`.

        :param inputs: a list of strings; a list of ``(text, text_pair)``
            tuples; a mapping with ``input_ids`` (``(n, T)`` tensor or list of
            lists) and optionally ``attention_mask``, ``token_type_ids``,
            ``word_ids``; a ``datasets.Dataset`` with a text column (or pair of
            columns); or an ``Encoded``.
        :param text_column: overrides the scorer's ``text_column``.
        :rtype: ~pyro_mpt.adapters.mlm_inputs.Encoded
        """
        return encode_inputs(
            inputs, tokenizer=self.tokenizer, config=self.model.config, special_token_ids=self.special_token_ids,
            max_length=self.max_length, text_column=text_column or self.text_column,
        )

    def _run(self, enc, items, make_jobs, desc, total=None):
        """:func:`~pyro_mpt.adapters.mlm_jobs.run_jobs` with this scorer's model, budget and
        progress bar (of ``total`` masked copies when known, so that it shows an ETA)."""
        from tqdm.auto import tqdm

        main = self.accelerator is None or self.accelerator.is_local_main_process
        bar = tqdm(desc=desc, unit="copy", total=total, disable=not (self.progress and main))
        try:
            with eval_mode(self.model):
                return run_jobs(enc, items, make_jobs, self.forward, self.mask_token_id, self.max_tokens, bar)
        finally:
            bar.close()

    def _seed(self, seed):
        return self.seed if seed is None else seed

    # ------------------------------------------------------------- public API
    def curve_masks(self, inputs, rates=PAPER_MLM_RATES, num_masks=1, seed=None):
        """The masks :meth:`curve` uses, over full sequence positions.

        :returns: per sequence a bool tensor ``(R, num_masks, T_i)``; True marks
            a masked token. Mask ``p`` at rate ``k`` has exactly
            :math:`\\max(1, \\operatorname{round}(r_k L_i))` tokens and grows
            with the rate (nested masks).
        """
        enc = self.encode(inputs)
        rates = check_rates(rates)
        seed = self._seed(seed)
        out = []
        for i in range(len(enc)):
            L = enc.maskable[i].numel()
            ranks = nested_ranks(item_generator(seed, i), num_masks, L)
            M = mask_counts(rates, [L])[0]
            full = torch.zeros((len(rates), num_masks, enc.ids[i].numel()), dtype=torch.bool, device="cpu")
            full[..., enc.maskable[i]] = ranks[None] < M[:, None, None]
            out.append(full)
        return out

    def curve(self, inputs, rates=PAPER_MLM_RATES, num_masks=1, seed=None, label=None, text_column=None):
        r"""The MPT curve: mean masked-token log-probability per masking rate.

        For sequence :math:`i` with :math:`L_i` maskable tokens, rate
        :math:`r_k` and mask :math:`p`, a uniformly random mask of exactly
        :math:`M = \max(1, \operatorname{round}(r_k L_i))` tokens gives

        .. math:: \hat S_{ikp} = \frac1M\sum_{j\in\mathcal M_{ikp}}
            \log p_\theta(x_{ij}\mid x_{i,\mathcal R_{ikp}}),

        and ``curve.score[k]`` is the mean of :math:`\hat S_{ikp}` over
        sequences and masks, with its standard error. A sequence's masks are
        nested across rates, and rates with equal :math:`M` share one forward
        pass (short sequences need fewer than ``len(rates)`` copies).

        :param inputs: see :meth:`encode`.
        :param rates: ``(R,)`` masking rates in (0, 1); default 1 %..99 %.
        :param int num_masks: random masks per sequence and rate.
        :param int seed: mask seed (default the scorer's).
        :param str label: legend label.
        :returns: a :class:`~pyro_mpt.adapters.rates.RateCurve` with ``per_item``
            ``(n, R)`` and ``lengths`` ``(n,)``.
        """
        enc = self.encode(inputs, text_column)
        rates = check_rates(rates)
        K = positive_count(num_masks, "num_masks")
        seed = self._seed(seed)
        lengths = enc.lengths
        counts = mask_counts(rates, lengths)
        plan = {}

        def make_jobs(i):
            ranks = nested_ranks(item_generator(seed, i), K, int(lengths[i]))
            mask, weight, plan[i] = rate_jobs(ranks, counts[i])
            return mask, weight

        items = shard(len(enc), self.accelerator)
        # K masks at each distinct mask size of a sequence (rates sharing a size share a copy)
        total = sum(K * len(torch.unique(counts[i])) for i in items)
        res = self._run(enc, items, make_jobs, "MPT curve", total)
        rows = torch.stack(
            [res[i].view(K, -1)[:, plan[i]].T for i in items]
        ) if items else torch.zeros((0, len(rates), K), dtype=torch.float64, device="cpu")
        values = gather_rows(rows, items, len(enc), self.accelerator)
        return rate_curve(values, rates, lengths, label=label)

    def score(self, inputs, masks="uniform", num_masks=1, seed=None, text_column=None):
        r"""Per-sequence estimate of the cumulative MPT score :math:`\sum_{M=1}^{L} S(x; M)`.

        Uses the schedules of :class:`~pyro_mpt.MaskedPretrainingLoss`
        (:mod:`pyro_mpt.masks`), drawn per sequence from a seeded stream:

        * ``"uniform"``: :math:`\frac1P\sum_p L\,\hat S_p(x; M_p)`,
          :math:`M_p \sim \mathcal U\{1..L\}` (``P = num_masks`` forward passes);
        * ``"all"``: :math:`\frac1P\sum_p\sum_{M=1}^L \hat S_p(x; M)`, an
          independent random mask of each size (``P L`` passes), as the loss's
          ``"all"``; ``"nested"`` draws the :math:`L` masks of a repetition nested in
          one permutation instead (more variance);
        * ``"order"``: the chain rule along ``P`` random orderings,
          :math:`\frac1P\sum_p\sum_t \log p(x_{\pi_p(t)}\mid x_{\pi_p(t+1:L)})`
          (``P L`` passes, one scored token each).

        Also accepts ``"nested"``, ``"stratified"``, ``"exhaustive"`` (:math:`L \le 16`), a
        fixed rate :math:`r` (biased: :math:`L\,\hat S(x; M)` with
        :math:`M = \max(1, \operatorname{round}(rL))`, the rule of :meth:`curve`,
        so short sequences are scored too), or a :class:`~pyro_mpt.masks.MaskSchedule`. All
        unbiased schedules estimate the same number: the expectation over
        orderings of an order-specific log-likelihood, a lower bound on the
        log-likelihood of the mixture over orderings (see the module
        docstring), not an exact likelihood of the network.

        :returns: float64 tensor ``(n,)``.
        """
        enc = self.encode(inputs, text_column)
        schedule = make_schedule(masks, num_masks)
        if isinstance(masks, Real) and not isinstance(masks, bool):
            # sequences vary in length: a rate masks max(1, round(r L)) tokens, as in curve()
            schedule = FixedRate(masks, num_masks, at_least_one=True)
        seed = self._seed(seed)
        lengths = enc.lengths

        def make_jobs(i):
            return schedule_jobs(schedule, seed, i, int(lengths[i]))

        items = shard(len(enc), self.accelerator)
        res = self._run(enc, items, make_jobs, f"MPT score ({masks})")
        rows = torch.stack([res[i].sum() for i in items]) if items else torch.zeros(0, dtype=torch.float64, device="cpu")
        return gather_rows(rows, items, len(enc), self.accelerator)

    def pll(self, inputs, word_l2r=False, per_token=False, text_column=None):
        r"""Pseudo-log-likelihood (Salazar et al., 2020), the :math:`M = 1` term.

        .. math:: \mathrm{PLL}(x) = \sum_{j=1}^{L} \log p_\theta(x_j \mid x_{\setminus j})
            = L\,S(x; 1)

        With ``word_l2r=True``, the within-word left-to-right variant (Kauf &
        Ivanova, 2023, "PLL-word-l2r"): scoring token :math:`j` also masks the
        tokens of the same word to its right, so a multi-token word cannot be
        read off its own continuation. Needs word boundaries (a fast tokenizer,
        or ``word_ids`` in pre-tokenized inputs).

        :param bool per_token: also return each token's log-probability.
        :returns: float64 tensor ``(n,)``; with ``per_token``, also a list of
            ``(L_i,)`` tensors in the order of the maskable tokens.
        """
        enc = self.encode(inputs, text_column)
        if word_l2r and enc.word_ids is None:
            raise ValueError(
                "word_l2r=True needs word boundaries: use a fast tokenizer (is_fast=True) or pass "
                "'word_ids' (one word index per token, None for special tokens) with input_ids."
            )
        lengths = enc.lengths

        def make_jobs(i):
            return pll_jobs(int(lengths[i]), enc.word_ids[i] if word_l2r else None)

        items = shard(len(enc), self.accelerator)
        res = self._run(enc, items, make_jobs, "PLL", int(sum(lengths[i] for i in items)))
        width = int(lengths.max())
        rows = torch.full((len(items), width), float("nan"), dtype=torch.float64, device="cpu")
        for r, i in enumerate(items):
            rows[r, : res[i].numel()] = res[i]
        tokens = gather_rows(rows, items, len(enc), self.accelerator)
        totals = torch.stack([tokens[i, : lengths[i]].sum() for i in range(len(enc))])
        if per_token:
            return totals, [tokens[i, : lengths[i]].clone() for i in range(len(enc))]
        return totals
