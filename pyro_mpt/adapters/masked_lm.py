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
"""

import inspect
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ..masks import ChainBlock, MaskBlock, make_schedule
from .batching import gather_rows, group_by_length, pack, place_model, shard
from .rates import PAPER_MLM_RATES, check_rates, item_generator, item_seed, mask_counts, nested_ranks, rate_curve

__all__ = ["MaskedLMScorer", "Encoded", "masked_lm_head", "check_tokenizer"]

#: Masked-LM classes whose head can run on the masked positions alone:
#: class name -> (encoder attribute, head attribute(s) applied in order).
#: Each was checked against the class's ``forward`` (encoder output [0] -> head).
_HEADS = {
    "BertForMaskedLM": ("bert", ("cls",)),
    "MegatronBertForMaskedLM": ("bert", ("cls",)),
    "ErnieForMaskedLM": ("ernie", ("cls",)),
    "RobertaForMaskedLM": ("roberta", ("lm_head",)),
    "XLMRobertaForMaskedLM": ("roberta", ("lm_head",)),
    "CamembertForMaskedLM": ("roberta", ("lm_head",)),
    "RobertaPreLayerNormForMaskedLM": ("roberta_prelayernorm", ("lm_head",)),
    "AlbertForMaskedLM": ("albert", ("predictions",)),
    "EsmForMaskedLM": ("esm", ("lm_head",)),
    "MPNetForMaskedLM": ("mpnet", ("lm_head",)),
    "ElectraForMaskedLM": ("electra", ("generator_predictions", "generator_lm_head")),
    "DistilBertForMaskedLM": (
        "distilbert",
        ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"),
    ),
}

#: the masked-position head runs on a multiple of this many rows (see _target_log_probs)
_HEAD_ROWS = 16

_ROBERTA_LIKE = {"roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "longformer"}


def masked_lm_head(model):
    """Split a masked LM into ``(encoder, head)`` when its class is known.

    ``encoder(**inputs)[0]`` gives hidden states ``(B, T, H)`` and ``head(h)``
    maps hidden states ``(N, H)`` to logits ``(N, V)``, so the vocabulary
    projection runs on the masked positions only. Returns ``None`` for other
    classes, which then compute full logits.
    """
    spec = _HEADS.get(type(model).__name__)
    if spec is None:
        return None
    enc_name, head_names = spec
    encoder = getattr(model, enc_name, None)
    heads = [getattr(model, h, None) for h in head_names]
    if encoder is None or any(h is None for h in heads):
        return None

    def head(h):
        for module in heads:
            h = module(h)
        return h

    return encoder, head


def _model_vocab_size(model):
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = getattr(model.config, "vocab_size", None) or getattr(getattr(emb, "weight", None), "shape", [None])[0]
    return int(vocab) if vocab else None


def check_tokenizer(tokenizer, model):
    """Refuse a tokenizer whose vocabulary does not fit the model's.

    A tokenizer with more tokens than the model's vocabulary (``config.vocab_size``)
    produces ids the embedding cannot look up; one with fewer than half of them is
    not the model's -- typically the default tokenizer transformers builds from a
    model directory without tokenizer files, which knows only the special tokens
    and turns every word into the unknown token. Models pad their vocabulary by a
    few entries at most, so the check does not refuse a matching pair.

    :raises ValueError: naming both sizes and what to pass instead.
    """
    V = _model_vocab_size(model)
    if tokenizer is None or V is None:
        return
    n = len(tokenizer)
    if n > V or 2 * n < V:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        why = "its ids would fall outside the embedding" if n > V else "it would turn most words into the unknown token"
        raise ValueError(
            f"The tokenizer {name!r} has {n} tokens but the model's vocabulary (config.vocab_size) has {V}: "
            f"they do not belong together ({why}; "
            f"a model directory without tokenizer files gets a default tokenizer that knows only the "
            f"special tokens). Pass the model's tokenizer: tokenizer=AutoTokenizer.from_pretrained(...), "
            f"or on the command line --tokenizer DIR (or a BERT vocab.txt file)."
        )


@dataclass
class Encoded:
    """Tokenized inputs, padding removed.

    :param ids: per sequence, long ``(T_i,)`` token ids with special tokens.
    :param token_type_ids: per sequence ``(T_i,)``, or None.
    :param maskable: per sequence, long ``(L_i,)`` positions that may be masked
        (not special, not padding).
    :param word_ids: per sequence, long ``(L_i,)`` word index of each maskable
        token (-1 unknown), unique across the segments of a sentence pair (word
        indices restart in each segment; the segment is part of the key), or
        None when the tokenizer gives no word boundaries.
    """

    ids: List[torch.Tensor]
    token_type_ids: Optional[List[torch.Tensor]]
    maskable: List[torch.Tensor]
    word_ids: Optional[List[torch.Tensor]]

    def __len__(self):
        return len(self.ids)

    @property
    def lengths(self):
        """Maskable tokens per sequence, ``(n,)`` numpy array."""
        return np.array([m.numel() for m in self.maskable])


class MaskedLMScorer:
    r"""MPT curves, cumulative MPT scores and pseudo-log-likelihoods of a masked LM.

    Works with any ``AutoModelForMaskedLM``-style model (BERT, RoBERTa,
    DistilBERT, ALBERT, ELECTRA, ESM, ...). Every query is a masked copy of a
    sequence with the masked tokens replaced by the tokenizer's mask token;
    copies of equal-length sequences are packed into forward passes of at most
    ``max_tokens`` tokens (no padding), the LM head runs only where a
    log-probability is needed (for known architectures, :data:`_HEADS`), under
    :func:`torch.inference_mode`. Masks come from per-sequence seeded
    generators, so the masks do not depend on ``max_tokens``, on the input order
    or on sharding, and the results do not either, to float rounding (other
    batch shapes may run other BLAS kernels: agreement to about
    :math:`256\,\epsilon_{\text{float32}} \approx 3\cdot10^{-5}` relative).

    :param model: a masked LM (``transformers.PreTrainedModel``); put in eval mode.
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
        model's limit.
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
        if int(max_tokens) < 1 or int(max_logits) < 1:
            raise ValueError(
                f"max_tokens and max_logits must be positive budgets, got {max_tokens} and {max_logits}."
            )
        self.model, self.device, self.accelerator = place_model(model, device, accelerator)
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.max_logits = int(max_logits)
        self.bf16 = bool(bf16)
        self.text_column = text_column
        self.seed = seed
        self.progress = progress
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

        split = None if head == "full" else masked_lm_head(model)
        if head == "masked" and split is None:
            raise ValueError(
                f'head="masked" is not available for {type(model).__name__}: its head is not in '
                f'pyro_mpt.adapters.masked_lm._HEADS. Use head="auto" (full logits) instead.'
            )
        self._encoder, self._head = split if split is not None else (None, None)
        check_tokenizer(tokenizer, model)
        self._vocab_size = _model_vocab_size(model) or 1
        forward = (self._encoder or self.model).forward
        self._takes_token_types = "token_type_ids" in inspect.signature(forward).parameters

    # ------------------------------------------------------------------ inputs
    def _max_length(self):
        if self.max_length is not None:
            return int(self.max_length)
        limit = getattr(self.tokenizer, "model_max_length", None)
        if limit is not None and limit < 1_000_000:
            return int(limit)
        return self._position_limit()

    def _position_limit(self):
        """The longest sequence the model's position embeddings take, or None."""
        cfg = self.model.config
        n = getattr(cfg, "max_position_embeddings", None)
        if n is None:
            return None
        return int(n) - (2 if getattr(cfg, "model_type", "") in _ROBERTA_LIKE else 0)

    def _pad_token_id(self):
        """The padding id, when known: the tokenizer's, else the config's if it is a special id."""
        if self.tokenizer is not None:
            return getattr(self.tokenizer, "pad_token_id", None)
        pad = getattr(self.model.config, "pad_token_id", None)
        return pad if pad is not None and bool((self.special_token_ids == pad).any()) else None

    def encode(self, inputs, text_column=None):
        """Normalize inputs into an :class:`Encoded` (padding removed).

        :param inputs: a list of strings; a list of ``(text, text_pair)``
            tuples; a mapping with ``input_ids`` (``(n, T)`` tensor or list of
            lists) and optionally ``attention_mask``, ``token_type_ids``,
            ``word_ids``; a ``datasets.Dataset`` with a text column (or pair of
            columns); or an :class:`Encoded`.
        :param text_column: overrides the scorer's ``text_column``.
        :rtype: Encoded
        """
        if isinstance(inputs, Encoded):
            return inputs
        if hasattr(inputs, "column_names") and not isinstance(inputs, Mapping):
            col = text_column or self.text_column
            cols = [col] if isinstance(col, str) else list(col)
            missing = [c for c in cols if c not in inputs.column_names]
            if missing:
                raise ValueError(
                    f"text_column {missing} not in the dataset's columns {inputs.column_names}; "
                    f"pass text_column='...' (or a pair of column names)."
                )
            texts = [inputs[c] for c in cols]
            return self._tokenize(*texts)
        if isinstance(inputs, Mapping):
            if "input_ids" not in inputs:
                raise ValueError(
                    f"A mapping input needs 'input_ids' (and 'attention_mask' if padded); got keys {list(inputs)}."
                )
            return self._from_ids(inputs)
        if isinstance(inputs, str):
            raise TypeError("inputs must be a list of strings, not one string: wrap it as [text].")
        inputs = list(inputs)
        if not inputs:
            raise ValueError("inputs is empty: pass at least one sequence.")
        if all(isinstance(t, str) for t in inputs):
            return self._tokenize(inputs)
        if all(isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(s, str) for s in t) for t in inputs):
            return self._tokenize([t[0] for t in inputs], [t[1] for t in inputs])
        raise TypeError(
            "inputs must be a list of strings, a list of (text, text_pair) tuples, a mapping with "
            "'input_ids', a datasets.Dataset, or an Encoded."
        )

    def _tokenize(self, texts, pairs=None):
        if self.tokenizer is None:
            raise ValueError("Text inputs need a tokenizer: MaskedLMScorer(model, tokenizer).")
        max_len = self._max_length()
        kw = dict(truncation=max_len is not None, max_length=max_len, return_attention_mask=True)
        texts, pairs = list(texts), None if pairs is None else list(pairs)
        enc = self.tokenizer(texts, pairs, **kw)
        word_ids = None
        if getattr(enc, "is_fast", False) or getattr(self.tokenizer, "is_fast", False):
            try:
                word_ids = [enc.word_ids(i) for i in range(len(enc["input_ids"]))]
            except (ValueError, AttributeError):
                word_ids = None
        if max_len is not None:
            full = [k for k, ids in enumerate(enc["input_ids"]) if len(ids) >= max_len]
            if full:
                # a sequence of exactly max_len tokens was cut only if it is longer without
                # truncation: tokenize those few again with one more token of room
                again = self.tokenizer(
                    [texts[k] for k in full], None if pairs is None else [pairs[k] for k in full],
                    truncation=True, max_length=max_len + 1,
                )
                cut = sum(len(ids) > max_len for ids in again["input_ids"])
                if cut:
                    warnings.warn(
                        f"{cut} sequence(s) were longer than max_length={max_len} tokens and were truncated "
                        f"to it; the scores are those of the truncated sequences."
                    )
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if "token_type_ids" in enc:
            data["token_type_ids"] = enc["token_type_ids"]
        if word_ids is not None:
            data["word_ids"] = word_ids
        return self._from_ids(data, pretokenized=False)

    def _from_ids(self, data, pretokenized=True):
        ids = data["input_ids"]
        n = len(ids)
        attn = data.get("attention_mask")
        types = data.get("token_type_ids")
        words = data.get("word_ids")
        out_ids, out_types, out_mask, out_words = [], [] if types is not None else None, [], []
        pad = self._pad_token_id() if attn is None else None
        # texts are truncated by the tokenizer; pre-tokenized ids must fit the model as given
        limit = (int(self.max_length) if self.max_length is not None else self._position_limit()) if pretokenized else None
        for i in range(n):
            # inputs are kept on the host; each packed batch moves to the model's device
            x = torch.as_tensor(ids[i], dtype=torch.long, device="cpu").reshape(-1)
            if pad is not None and bool((x == pad).any()):
                raise ValueError(
                    f"input_ids[{i}] holds the padding token (id {pad}) {int((x == pad).sum())} time(s) but no "
                    f"attention_mask was given, so the padding would be read as context. Pass "
                    f"attention_mask (1 = token, 0 = padding) with padded input_ids, or remove the padding."
                )
            keep = torch.ones_like(x, dtype=torch.bool) if attn is None else torch.as_tensor(attn[i], device="cpu").reshape(-1).bool()
            if keep.shape != x.shape:
                raise ValueError(
                    f"attention_mask[{i}] has {keep.numel()} entries but input_ids[{i}] has {x.numel()}; "
                    f"give one mask entry per token (1 = keep, 0 = padding)."
                )
            x = x[keep]
            if limit is not None and x.numel() > limit:
                raise ValueError(
                    f"input_ids[{i}] has {x.numel()} tokens (padding removed), more than the maximum of {limit} "
                    f"the model takes ({'max_length' if self.max_length is not None else 'its max_position_embeddings'}); "
                    f"truncate the ids to {limit} tokens, or pass the texts, which are truncated."
                )
            maskable = torch.nonzero(~torch.isin(x, self.special_token_ids)).reshape(-1)
            if maskable.numel() == 0:
                unk = getattr(self.tokenizer, "unk_token_id", None)
                unknown = 0 if unk is None else int((x == unk).sum())
                if unknown:
                    raise ValueError(
                        f"Sequence {i} has no maskable token: all its {unknown} token(s) are the unknown token "
                        f"{self.tokenizer.unk_token!r}, so the tokenizer (vocabulary of {len(self.tokenizer)} tokens) "
                        f"knows none of the text's symbols. Write the text as the vocabulary expects (e.g. a "
                        f"protein model's residues separated by spaces and in upper case: 'E V Q L', not 'EVQL' "
                        f"or 'e v q l'), and check that the tokenizer is the model's."
                    )
                raise ValueError(
                    f"Sequence {i} has no maskable token (only special tokens or padding); remove it."
                )
            out_ids.append(x)
            out_mask.append(maskable)
            if types is not None:
                out_types.append(torch.as_tensor(types[i], dtype=torch.long, device="cpu").reshape(-1)[keep])
            if words is not None:
                w = torch.tensor([-1 if v is None else int(v) for v in words[i]], dtype=torch.long, device="cpu")[keep]
                # word indices restart in the second segment of a pair; segments are separated by
                # tokens without a word (CLS, SEP), so (tokens without a word so far, word index)
                # identifies a word across segments
                segment = torch.cumsum(w < 0, 0)
                key = torch.where(w >= 0, segment * (int(w.max()) + 1) + w, -1)
                out_words.append(key[maskable])
        return Encoded(out_ids, out_types, out_mask, out_words if words is not None else None)

    # ------------------------------------------------------------- forward
    def _autocast(self):
        if not self.bf16:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _target_log_probs(self, inp, sel, targets, types):
        """Log-probabilities of ``targets`` at positions ``sel`` of masked inputs.

        :param inp: long ``(B, T)`` masked input ids (on device).
        :param sel: bool ``(B, T)``, positions to score.
        :param targets: long ``(N,)`` true ids at ``sel`` (row-major order).
        :returns: float ``(N,)``.
        """
        kw = {"input_ids": inp, "attention_mask": torch.ones_like(inp)}
        if types is not None and self._takes_token_types:
            kw["token_type_ids"] = types
        out = []
        with self._autocast():
            if self._encoder is not None:
                hidden = self._encoder(**kw)[0][sel]
                # bound the (positions, vocabulary) logits held at once
                step = max(_HEAD_ROWS, self.max_logits // self._vocab_size // _HEAD_ROWS * _HEAD_ROWS)
                for start in range(0, hidden.shape[0], step):
                    h = hidden[start : start + step]
                    n = h.shape[0]
                    # BLAS picks kernels (and rounding) by row count; padding the rows to a
                    # multiple of _HEAD_ROWS keeps the head's shapes, hence most of its rounding,
                    # independent of the batch (the encoder's shapes still vary with it)
                    pad = -n % _HEAD_ROWS
                    if pad:
                        h = torch.cat([h, h[:1].expand(pad, -1)])
                    logits = self._head(h)[:n]
                    out.append(self._gather(logits, targets[start : start + step]))
            else:
                logits = self.model(**kw).logits
                out.append(self._gather(logits[sel], targets))
        return torch.cat(out) if out else torch.zeros(0, device=inp.device)

    @staticmethod
    def _gather(logits, targets):
        return logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)

    def _run(self, enc, items, make_jobs, desc):
        """Weighted log-probability sums of masked copies.

        :param items: indices of the sequences to score.
        :param callable make_jobs: ``make_jobs(i) -> (mask, weight)``, bool and
            float ``(J, L_i)`` over sequence ``i``'s maskable tokens: one masked
            copy per row.
        :returns: dict ``i -> (J,)`` float64 tensor of
            :math:`\\sum_j w_j \\log p(x_j \\mid x_{\\mathcal R})` over the masked
            positions of each copy.
        """
        from tqdm.auto import tqdm

        jobs, results = {}, {}

        def num_jobs(i):
            jobs[i] = make_jobs(i)
            results[i] = torch.zeros(jobs[i][0].shape[0], dtype=torch.float64, device="cpu")
            return jobs[i][0].shape[0]

        groups = group_by_length(items, [x.numel() for x in enc.ids])
        main = self.accelerator is None or self.accelerator.is_local_main_process
        bar = tqdm(desc=desc, unit="copy", disable=not (self.progress and main))
        with torch.inference_mode():
            for T, pieces in pack(groups, num_jobs, self.max_tokens):
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
                inp = ids.masked_fill(masked, self.mask_token_id)
                dev = self.device
                lp = self._target_log_probs(
                    inp.to(dev), sel.to(dev), targets.to(dev), None if types is None else types.to(dev)
                )
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
        bar.close()
        return results

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
        K = _positive_int(num_masks, "num_masks")
        seed = self._seed(seed)
        lengths = enc.lengths
        counts = mask_counts(rates, lengths)
        plan = {}

        def make_jobs(i):
            ranks = nested_ranks(item_generator(seed, i), K, int(lengths[i]))
            sizes, inverse = torch.unique(counts[i], return_inverse=True)
            plan[i] = (sizes.numel(), inverse)
            mask = ranks[:, None, :] < sizes[None, :, None]  # (K, U, L)
            weight = mask.double() / sizes[None, :, None].double()
            return mask.reshape(-1, ranks.shape[-1]), weight.reshape(-1, ranks.shape[-1])

        items = shard(len(enc), self.accelerator)
        res = self._run(enc, items, make_jobs, "MPT curve")
        rows = torch.stack(
            [res[i].view(K, plan[i][0])[:, plan[i][1]].T for i in items]
        ) if items else torch.zeros((0, len(rates), K), dtype=torch.float64, device="cpu")
        values = gather_rows(rows, items, len(enc), self.accelerator)
        return rate_curve(values, rates, lengths, label=label)

    def score(self, inputs, masks="uniform", num_masks=1, seed=None, text_column=None):
        r"""Per-sequence estimate of the cumulative MPT score :math:`\sum_{M=1}^{L} S(x; M)`.

        Uses the schedules of :class:`~pyro_mpt.MaskedPretrainingLoss`
        (:mod:`pyro_mpt.masks`), drawn per sequence from a seeded stream:

        * ``"uniform"``: :math:`\frac1P\sum_p L\,\hat S_p(x; M_p)`,
          :math:`M_p \sim \mathcal U\{1..L\}` (``P = num_masks`` forward passes);
        * ``"all"``: :math:`\frac1P\sum_p\sum_{M=1}^L \hat S_p(x; M)` with nested
          masks (``P L`` passes);
        * ``"order"``: the chain rule along ``P`` random orderings,
          :math:`\frac1P\sum_p\sum_t \log p(x_{\pi_p(t)}\mid x_{\pi_p(t+1:L)})`
          (``P L`` passes, one scored token each).

        Also accepts ``"stratified"``, ``"exhaustive"`` (:math:`L \le 16`), a
        fixed rate (biased), or a :class:`~pyro_mpt.masks.MaskSchedule`. All
        unbiased schedules estimate the same number: the expectation over
        orderings of an order-specific log-likelihood, a lower bound on the
        log-likelihood of the mixture over orderings (see the module
        docstring), not an exact likelihood of the network.

        :returns: float64 tensor ``(n,)``.
        """
        enc = self.encode(inputs, text_column)
        schedule = make_schedule(masks, num_masks)
        seed = self._seed(seed)
        lengths = enc.lengths

        def make_jobs(i):
            L = int(lengths[i])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(item_seed(seed, i))
                blocks = list(schedule.blocks(1, L, max_elements=max(2**22, 4 * L * L), device="cpu"))
            masks_, weights = [], []
            for b in blocks:
                if isinstance(b, MaskBlock):
                    m = b.mask[:, 0, :]
                    w = b.weight.double().reshape(-1) / b.size.double().reshape(-1)
                    masks_.append(m)
                    weights.append(m.double() * w[:, None])
                elif isinstance(b, ChainBlock):
                    order = b.order[:, 0, :]  # (p, L)
                    rank = order.argsort(-1)  # position of each token in its ordering
                    t = torch.arange(L, device="cpu")
                    m = rank[:, None, :] <= t[None, :, None]  # (p, t, L): tokens pi_0..pi_t masked
                    w = torch.zeros(order.shape[0], L, L, dtype=torch.float64, device="cpu")
                    w.scatter_(2, order[:, :, None], b.weight.double().reshape(-1, 1, 1).expand(-1, L, 1))
                    masks_.append(m.reshape(-1, L))
                    weights.append(w.reshape(-1, L))
                else:  # pragma: no cover - new block types must be wired here
                    raise TypeError(f"Unsupported block type {type(b).__name__}.")
            return torch.cat(masks_), torch.cat(weights)

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
            L = int(lengths[i])
            eye = torch.eye(L, dtype=torch.bool, device="cpu")
            mask = eye
            if word_l2r:
                w = enc.word_ids[i]
                same = (w[:, None] == w[None, :]) & (w[:, None] >= 0)
                mask = eye | (same & torch.ones(L, L, dtype=torch.bool, device="cpu").triu(1))
            return mask, eye.double()

        items = shard(len(enc), self.accelerator)
        res = self._run(enc, items, make_jobs, "PLL")
        width = int(lengths.max())
        rows = torch.full((len(items), width), float("nan"), dtype=torch.float64, device="cpu")
        for r, i in enumerate(items):
            rows[r, : res[i].numel()] = res[i]
        tokens = gather_rows(rows, items, len(enc), self.accelerator)
        totals = torch.stack([tokens[i, : lengths[i]].sum() for i in range(len(enc))])
        if per_token:
            return totals, [tokens[i, : lengths[i]].clone() for i in range(len(enc))]
        return totals


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
