"""Inputs of a masked LM: texts, sentence pairs, pre-tokenized ids or datasets
normalized into :class:`Encoded` sequences (padding removed, maskable positions
and word boundaries known), and the check that a tokenizer belongs to a model.

:func:`encode_inputs` is what :meth:`MaskedLMScorer.encode
<pyro_mpt.adapters.masked_lm.MaskedLMScorer.encode>` runs. Sequences stay on the
host; the scorer moves each packed batch to the model's device.
"""

import functools
import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ..code_origin import user_stacklevel
from .batching import check_not_empty, positive_count
from .columns import text_columns

__all__ = ["Encoded", "encode_inputs", "check_tokenizer", "lowercases", "model_vocab_size", "position_limit",
           "position_limit_words"]

#: model types known to number positions from ``pad_token_id + 1`` where their modeling
#: module cannot be read (a config defined outside transformers' own ``models`` package)
_ROBERTA_LIKE = {"roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "longformer", "mpnet", "esm"}


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

    Example::

        >>> enc = MaskedLMScorer(model, tokenizer).encode(["a sentence", "another one"])
        >>> len(enc), enc.ids[0].shape  # 2 sequences; the first one's T_0 ids
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


def model_vocab_size(model):
    """The model's vocabulary size (``config.vocab_size``, else the rows of its
    output embedding), or None when neither is known."""
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = getattr(model.config, "vocab_size", None) or getattr(getattr(emb, "weight", None), "shape", [None])[0]
    return int(vocab) if vocab else None


def lowercases(tokenizer):
    """Whether ``tokenizer`` lower-cases its texts: its ``do_lower_case`` (BERT's), its basic
    tokenizer's, else the ``lowercase`` flag of its fast backend's normalizer; False when none
    says so (or without a tokenizer).

    Example::

        >>> lowercases(BertTokenizer(vocab="vocab.txt", do_lower_case=True))
        True
    """
    if tokenizer is None:
        return False
    for owner in (tokenizer, getattr(tokenizer, "basic_tokenizer", None)):
        flag = getattr(owner, "do_lower_case", None)
        if flag is not None:
            return bool(flag)
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return bool(getattr(normalizer, "lowercase", False))


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
    V = model_vocab_size(model)
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


def position_limit(config):
    """The longest sequence the model's position embeddings take, or None.

    Models whose modeling module numbers positions from ``pad_token_id + 1``
    (transformers' ``create_position_ids_from_input_ids``: RoBERTa, MPNet, ESM with
    absolute positions, XLM-R, LUKE, ...) take ``pad_token_id + 1`` fewer tokens than
    ``max_position_embeddings``: a hand-kept list of RoBERTa's kin missed MPNet and ESM,
    whose ids at the limit it gave then failed inside the model with an ``IndexError``.
    ESM with rotary positions has no table to overrun (None)."""
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if getattr(config, "model_type", "") == "esm" and getattr(config, "position_embedding_type", "absolute") == "rotary":
        return None
    if not _positions_after_padding(type(config)):
        return int(n)
    pad = getattr(config, "pad_token_id", None)
    return int(n) - (int(pad) + 1 if pad is not None else 2)


def position_limit_words(config):
    """Where :func:`position_limit` comes from, for messages: ``config.max_position_embeddings``,
    less the positions up to the padding index where the model numbers them from there (a
    RoBERTa of 40 positions takes 38 tokens, which a message naming the 40 alone left unexplained)."""
    n = getattr(config, "max_position_embeddings", None)
    limit = position_limit(config)
    if n is None or limit is None or limit == int(n):
        return "config.max_position_embeddings"
    pad = getattr(config, "pad_token_id", None)
    start = "pad_token_id + 1" if pad is not None else "the padding index + 1 (pad_token_id unset: 1 taken)"
    return f"config.max_position_embeddings = {int(n)}, less {int(n) - limit}: the model numbers its positions from {start}"


@functools.lru_cache(maxsize=None)
def _positions_after_padding(config_class):
    """Whether the modeling module beside ``config_class``'s numbers positions from the
    padding index (reads its source for ``create_position_ids_from_input_ids``)."""
    name = config_class.__module__
    if ".configuration_" in name:
        try:
            spec = importlib.util.find_spec(name.replace(".configuration_", ".modeling_"))
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                return "create_position_ids_from_input_ids" in f.read()
    return getattr(config_class, "model_type", "") in _ROBERTA_LIKE


def encode_inputs(inputs, *, tokenizer, config, special_token_ids, max_length=None, text_column="text"):
    """Normalize inputs into an :class:`Encoded` (padding removed).

    :param inputs: a list of strings; a list of ``(text, text_pair)`` tuples; a
        mapping with ``input_ids`` (``(n, T)`` tensor or list of lists) and
        optionally ``attention_mask``, ``token_type_ids``, ``word_ids``; a
        ``datasets.Dataset`` with a text column (or pair of columns); or an
        :class:`Encoded` (returned as is).
    :param tokenizer: needed for text inputs; may be None for ids.
    :param config: the model's ``config`` (position limit, padding id).
    :param special_token_ids: long tensor of the ids never masked nor scored.
    :param int max_length: truncate texts to (and refuse ids longer than) this
        many tokens; default the smaller of the tokenizer's ``model_max_length``
        and the model's position limit (:func:`position_limit`).
    :param text_column: column (or pair of columns) of a ``datasets.Dataset``.
    :rtype: Encoded

    Example::

        >>> enc = encode_inputs(["a b c"], tokenizer=tok, config=model.config,
        ...                     special_token_ids=torch.tensor(tok.all_special_ids))
        >>> enc.lengths
        array([3])
    """
    if isinstance(inputs, Encoded):
        return inputs
    # 0 warned "truncated to 0 tokens" and truncated nothing, -1 failed inside the tokenizer, 2.5 ran
    if max_length is not None:
        max_length = positive_count(max_length, "max_length, the most tokens of a sequence,")
    source = _Source(tokenizer, config, special_token_ids, max_length)
    if hasattr(inputs, "column_names") and not isinstance(inputs, Mapping):
        cols = text_columns(text_column)
        missing = [c for c in cols if c not in inputs.column_names]
        if missing:
            raise ValueError(
                f"text_column {missing} not in the dataset's columns {inputs.column_names}; "
                f"pass text_column='...' (or a pair of column names)."
            )
        check_not_empty(len(inputs), "sequence")
        texts = [inputs[c] for c in cols]
        return source.tokenize(*texts)
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError(
                f"A mapping input needs 'input_ids' (and 'attention_mask' if padded); got keys {list(inputs)}."
            )
        return source.from_ids(inputs)
    if isinstance(inputs, str):
        raise TypeError("inputs must be a list of strings, not one string: wrap it as [text].")
    inputs = list(inputs)
    check_not_empty(len(inputs), "sequence")
    if all(isinstance(t, str) for t in inputs):
        return source.tokenize(inputs)
    if all(isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(s, str) for s in t) for t in inputs):
        return source.tokenize([t[0] for t in inputs], [t[1] for t in inputs])
    raise TypeError(
        "inputs must be a list of strings, a list of (text, text_pair) tuples, a mapping with "
        "'input_ids', a datasets.Dataset, or an Encoded."
    )


class _Source:
    """What turning texts or ids into :class:`Encoded` needs to know of the model."""

    def __init__(self, tokenizer, config, special_token_ids, max_length):
        self.tokenizer = tokenizer
        self.config = config
        self.special_token_ids = special_token_ids
        self.max_length = max_length

    def text_limit(self):
        if self.max_length is not None:
            return int(self.max_length)
        # a tokenizer saved for a larger model of the family (bert-base's 512 with a small
        # BERT of 128 positions) would let texts outgrow the position embeddings
        limits = [position_limit(self.config)]
        limit = getattr(self.tokenizer, "model_max_length", None)
        if limit is not None and limit < 1_000_000:
            limits.append(int(limit))
        limits = [n for n in limits if n is not None]
        return min(limits) if limits else None

    def pad_token_id(self):
        """The padding id, when known: the tokenizer's, else the config's if it is a special id."""
        if self.tokenizer is not None:
            return getattr(self.tokenizer, "pad_token_id", None)
        pad = getattr(self.config, "pad_token_id", None)
        return pad if pad is not None and bool((self.special_token_ids == pad).any()) else None

    def tokenize(self, texts, pairs=None):
        if self.tokenizer is None:
            raise ValueError("Text inputs need a tokenizer: MaskedLMScorer(model, tokenizer).")
        max_len = self.text_limit()
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
                        f"to it; the scores are those of the truncated sequences.",
                        stacklevel=user_stacklevel(),
                    )
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if "token_type_ids" in enc:
            data["token_type_ids"] = enc["token_type_ids"]
        if word_ids is not None:
            data["word_ids"] = word_ids
        return self.from_ids(data, pretokenized=False, texts=(texts, pairs))

    def warn_untyped_pairs(self, ids):
        """Warn where ids without ``token_type_ids`` hold the separator token twice or more (a
        pair of segments) for a model that tells segments apart (``type_vocab_size`` > 1):
        the model reads them all as the first segment, and the scores are another model's."""
        sep = getattr(self.tokenizer, "sep_token_id", None) if self.tokenizer is not None else None
        if sep is None or getattr(self.config, "type_vocab_size", 1) < 2:
            return
        paired = [i for i, x in enumerate(ids) if int((x == sep).sum()) >= 2]
        if paired:
            warnings.warn(
                f"{len(paired)} of {len(ids)} sequence(s) hold the separator token "
                f"{self.tokenizer.sep_token!r} twice or more (sequence {paired[0]} first: a pair of "
                f"segments?) but no token_type_ids were given, so the model reads every token as "
                f"the first segment (token type 0) and scores the pair as one segment (AntiBERTy's "
                f"PLL of two pairs: -41.57 and -38.60 so, -38.62 and -40.49 with the types). Pass "
                f"token_type_ids with the input_ids, or the texts as (text, text_pair) tuples.",
                stacklevel=user_stacklevel(),
            )

    def cased_words(self, texts, i):
        """The words of text ``i`` (and its pair) with upper-case letters that the tokenizer's
        vocabulary holds as written, when the tokenizer lower-cases: the words it turns into
        unknown tokens only because it lower-cases them. Empty otherwise.

        :param texts: ``(texts, pairs)`` as given to :meth:`tokenize`, or None (ids).
        """
        if texts is None or not lowercases(self.tokenizer):
            return []
        vocab = self.tokenizer.get_vocab()
        words = [w for t in (texts[0][i], texts[1][i] if texts[1] is not None else None) if t for w in t.split()]
        return [w for w in dict.fromkeys(words) if w != w.lower() and w in vocab]

    def from_ids(self, data, pretokenized=True, texts=None):
        ids = data["input_ids"]
        n = len(ids)
        check_not_empty(n, "sequence")  # a (0, T) tensor or an empty list of ids
        attn = data.get("attention_mask")
        types = data.get("token_type_ids")
        words = data.get("word_ids")
        out_ids, out_types, out_mask, out_words = [], [] if types is not None else None, [], []
        pad = self.pad_token_id() if attn is None else None
        # texts are truncated by the tokenizer; pre-tokenized ids must fit the model as given
        limit = (int(self.max_length) if self.max_length is not None else position_limit(self.config)) if pretokenized else None
        unk = getattr(self.tokenizer, "unk_token_id", None)
        vocab = getattr(self.config, "vocab_size", None)  # ids beyond it failed in the embedding (IndexError)
        with_unknown = []  # (sequence, unknown tokens) of the sequences that also have known ones
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
            if vocab is not None and x.numel() and not bool(((x >= 0) & (x < vocab)).all()):
                pos = int(torch.nonzero((x < 0) | (x >= vocab))[0])
                raise ValueError(
                    f"input_ids[{i}] holds id {int(x[pos])} at position {pos}, outside the model's vocabulary of "
                    f"{vocab} tokens (config.vocab_size: ids 0..{vocab - 1}); pass ids from the model's tokenizer."
                )
            if limit is not None and x.numel() > limit:
                raise ValueError(
                    f"input_ids[{i}] has {x.numel()} tokens (padding removed), more than the maximum of {limit} "
                    f"the model takes ({'max_length' if self.max_length is not None else position_limit_words(self.config)}); "
                    f"truncate the ids to {limit} tokens, or pass the texts, which are truncated."
                )
            maskable = torch.nonzero(~torch.isin(x, self.special_token_ids)).reshape(-1)
            unknown = 0 if unk is None else int((x == unk).sum())
            if maskable.numel() == 0:
                cased = self.cased_words(texts, i) if unknown else []
                if cased:
                    raise ValueError(
                        f"Sequence {i} has no maskable token: all its {unknown} token(s) are the unknown token "
                        f"{self.tokenizer.unk_token!r}, because the tokenizer lower-cases the text "
                        f"(do_lower_case=True) while its vocabulary of {len(self.tokenizer)} tokens has the "
                        f"text's words as written ({', '.join(map(repr, cased[:4]))}). Load the tokenizer "
                        f"with do_lower_case=False (on the command line: --no-lowercase)."
                    )
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
            if unknown:
                with_unknown.append((i, unknown))
            out_ids.append(x)
            out_mask.append(maskable)
            if types is not None:
                t = torch.as_tensor(types[i], dtype=torch.long, device="cpu").reshape(-1)
                out_types.append(t[_one_per_token("token_type_ids", t, i, keep)])
            if words is not None:
                w = torch.tensor([-1 if v is None else int(v) for v in words[i]], dtype=torch.long, device="cpu")
                w = w[_one_per_token("word_ids", w, i, keep)]
                # word indices restart in the second segment of a pair; segments are separated by
                # tokens without a word (CLS, SEP), so (tokens without a word so far, word index)
                # identifies a word across segments
                segment = torch.cumsum(w < 0, 0)
                key = torch.where(w >= 0, segment * (int(w.max()) + 1) + w, -1)
                out_words.append(key[maskable])
        if types is None:
            self.warn_untyped_pairs(out_ids)
        if with_unknown:
            first, count = with_unknown[0]
            total = sum(c for _, c in with_unknown)
            warnings.warn(
                f"{len(with_unknown)} of {n} sequence(s) hold the unknown token {self.tokenizer.unk_token!r} "
                f"({total} token(s); sequence {first} has {count}): symbols outside the tokenizer's vocabulary "
                f"of {len(self.tokenizer)} tokens. An unknown token is never masked nor scored, so such a "
                f"sequence's scores sum fewer tokens and read higher (AntiBERTy's PLL: 'E V Q L' -24.8, "
                f"'E V X Q L' -16.6). Write those symbols as the vocabulary has them, or leave those sequences out.",
                stacklevel=user_stacklevel(),
            )
        return Encoded(out_ids, out_types, out_mask, out_words if words is not None else None)


def _one_per_token(name, values, i, keep):
    """``keep`` (the tokens of ``input_ids[i]`` that are not padding), after checking that
    ``values`` (``name``'s entries for sequence ``i``) has one entry per token of
    ``input_ids[i]`` as given, padding included (a list of the unpadded tokens' entries
    beside padded ids failed with torch's IndexError on a boolean mask's shape)."""
    if values.shape != keep.shape:
        raise ValueError(
            f"{name}[{i}] has {values.numel()} entries but input_ids[{i}] has {keep.numel()} tokens "
            f"(padding included); give one entry per token of input_ids[{i}], at padding too "
            f"(word_ids: None there), or pass input_ids without padding."
        )
    return keep
