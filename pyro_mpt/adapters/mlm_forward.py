"""One forward pass of a masked LM over a packed batch of masked copies, and the
log-probabilities of the true tokens at the scored positions.

For the classes in :data:`HEADS` the model splits into encoder and head
(:func:`masked_lm_head`), so the vocabulary projection -- the largest matrix of
a small masked LM -- runs on the scored positions only, in chunks of at most
``max_logits`` logits; other classes compute full logits.
"""

import inspect
from contextlib import nullcontext

import torch

from .mlm_inputs import model_vocab_size

__all__ = ["HEADS", "masked_lm_head", "check_masked_lm", "attends_to_later_tokens", "MaskedForward"]

#: Masked-LM classes whose head can run on the masked positions alone:
#: class name -> (encoder attribute, head attribute(s) applied in order).
#: Each was checked against the class's ``forward`` (encoder output [0] -> head).
HEADS = {
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
    # pre-training classes: the masked-LM head beside a next-sentence / sentence-order head
    "BertForPreTraining": ("bert", ("cls.predictions",)),
    "MegatronBertForPreTraining": ("bert", ("cls.predictions",)),
    "ErnieForPreTraining": ("ernie", ("cls.predictions",)),
    "AlbertForPreTraining": ("albert", ("predictions",)),
}

# the masked-position head runs on a multiple of this many rows (see MaskedForward.__call__)
_HEAD_ROWS = 16


def masked_lm_head(model):
    """Split a masked LM into ``(encoder, head)`` when its class is known.

    ``encoder(**inputs)[0]`` gives hidden states ``(B, T, H)`` and ``head(h)``
    maps hidden states ``(N, H)`` to logits ``(N, V)``, so the vocabulary
    projection runs on the masked positions only. Returns ``None`` for other
    classes, which then compute full logits.

    Example::

        >>> encoder, head = masked_lm_head(BertForMaskedLM.from_pretrained(path))
        >>> logits = head(encoder(**inputs)[0][is_masked])  # (masked tokens, V)
    """
    spec = HEADS.get(type(model).__name__)
    if spec is None:
        return None
    enc_name, head_names = spec
    encoder = getattr(model, enc_name, None)
    heads = [_attribute(model, h) for h in head_names]
    if encoder is None or any(h is None for h in heads):
        return None

    def head(h):
        for module in heads:
            h = module(h)
        return h

    return encoder, head


def _attribute(obj, dotted):
    """``obj.a.b`` for ``"a.b"``, or None when a link is missing."""
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def check_masked_lm(model):
    """Refuse models that give no masked-token distribution over the vocabulary.

    A model without a language-model head (``BertModel``, a sequence or token
    classifier) has no vocabulary logits; a decoder (``config.is_decoder``,
    e.g. ``BertLMHeadModel`` as a causal LM) attends to the left only, so its
    prediction at a masked position ignores the tokens after it.

    :param model: the model given to :class:`~pyro_mpt.adapters.MaskedLMScorer`.
    :raises ValueError: naming the class and what to load instead.

    Example::

        >>> check_masked_lm(BertForMaskedLM(config))   # passes
        >>> check_masked_lm(BertModel(config))         # raises: no language-model head
    """
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_decoder", False):
        raise ValueError(
            f"{name} is configured as a decoder (config.is_decoder=True): its attention is causal, so its "
            f"prediction at a masked position sees only the tokens to the left. Load the checkpoint as a "
            f"masked LM: AutoModelForMaskedLM.from_pretrained(...) (is_decoder=False)."
        )
    if masked_lm_head(model) is None and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is None:
        raise ValueError(
            f"{name} has no language-model head (get_output_embeddings() is None), so it gives no "
            f"distribution over the vocabulary at a masked position. Load the checkpoint as a masked LM: "
            f"AutoModelForMaskedLM.from_pretrained(...)."
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model (config.is_encoder_decoder=True): it predicts a target "
            f"sequence from its decoder, not the tokens at masked positions of its input. Load an "
            f"encoder-only masked LM: AutoModelForMaskedLM.from_pretrained(...)."
        )
    if not attends_to_later_tokens(model):
        raise ValueError(
            f"{name} attends to the left only: its logits at the first position do not change when the "
            f"last token does (a causal LM, e.g. GPT-2, whose config has no is_decoder flag), so its "
            f"prediction at a masked position would ignore the tokens after it. Load a masked LM: "
            f"AutoModelForMaskedLM.from_pretrained(...)."
        )


def attends_to_later_tokens(model):
    """Whether ``model``'s logits at the first position of a short input change when its last
    token does: False for causal attention, whatever the config says (GPT-2's has no
    ``is_decoder``). One forward pass of two 4-token inputs, in eval mode (dropout would
    change the logits anyway); True where the probe cannot run (the scorer's own first pass
    then says why).

    Example::

        >>> attends_to_later_tokens(BertForMaskedLM(config)), attends_to_later_tokens(GPT2LMHeadModel(config))
        (True, False)
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    params = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if not vocab or vocab < 3 or params is None:
        return True
    ids = torch.tensor([[1, 2, 1, 2], [1, 2, 1, 0]], device=params.device) % vocab
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    except Exception:  # noqa: BLE001 - a model the probe cannot run is judged by the scorer's own passes
        return True
    finally:
        model.train(training)
    return not torch.equal(logits[0, 0], logits[1, 0])


class MaskedForward:
    r"""Log-probabilities of the true tokens at the scored positions of masked inputs.

    :param model: a masked LM, already on ``device``.
    :param torch.device device: where batches run.
    :param str head: ``"auto"`` (masked positions only when the class is in
        :data:`HEADS`), ``"masked"`` (require it) or ``"full"`` (full logits).
    :param int max_logits: bound on the logits held at once (positions x
        vocabulary); the head runs in chunks beyond it.
    :param bool bf16: autocast the forward pass to bfloat16 (log-softmax stays
        float32).

    :ivar encoder: the encoder of the split model, or None when full logits are computed.

    Example::

        >>> forward = MaskedForward(model, torch.device("cpu"))
        >>> lp = forward(inp, sel, inp_true[sel], None)  # (N,) log p(x_j | masked input)
    """

    def __init__(self, model, device, *, head="auto", max_logits=2**22, bf16=False):
        self.model = model
        self.device = device
        self.max_logits = int(max_logits)
        self.bf16 = bool(bf16)
        split = None if head == "full" else masked_lm_head(model)
        if head == "masked" and split is None:
            raise ValueError(
                f'head="masked" is not available for {type(model).__name__}: its head is not in '
                f'pyro_mpt.adapters.mlm_forward.HEADS. Use head="auto" (full logits) instead.'
            )
        check_masked_lm(model)
        self.encoder, self.head = split if split is not None else (None, None)
        self.vocab_size = model_vocab_size(model) or 1
        forward = (self.encoder or self.model).forward
        self.takes_token_types = "token_type_ids" in inspect.signature(forward).parameters

    def _autocast(self):
        if not self.bf16:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def __call__(self, inp, sel, targets, types):
        """Log-probabilities of ``targets`` at positions ``sel`` of masked inputs.

        :param inp: long ``(B, T)`` masked input ids (host or device).
        :param sel: bool ``(B, T)``, positions to score.
        :param targets: long ``(N,)`` true ids at ``sel`` (row-major order).
        :param types: long ``(B, T)`` token type ids, or None.
        :returns: float ``(N,)`` on the device.
        """
        dev = self.device
        inp, sel, targets = inp.to(dev), sel.to(dev), targets.to(dev)
        kw = {"input_ids": inp, "attention_mask": torch.ones_like(inp)}
        if types is not None and self.takes_token_types:
            kw["token_type_ids"] = types.to(dev)
        out = []
        with self._autocast():
            if self.encoder is not None:
                hidden = self.encoder(**kw)[0][sel]
                # bound the (positions, vocabulary) logits held at once
                step = max(_HEAD_ROWS, self.max_logits // self.vocab_size // _HEAD_ROWS * _HEAD_ROWS)
                for start in range(0, hidden.shape[0], step):
                    h = hidden[start : start + step]
                    n = h.shape[0]
                    # BLAS picks kernels (and rounding) by row count; padding the rows to a
                    # multiple of _HEAD_ROWS keeps the head's shapes, hence most of its rounding,
                    # independent of the batch (the encoder's shapes still vary with it)
                    pad = -n % _HEAD_ROWS
                    if pad:
                        h = torch.cat([h, h[:1].expand(pad, -1)])
                    logits = self.head(h)[:n]
                    out.append(_gather(logits, targets[start : start + step]))
            else:
                result = self.model(**kw)
                # pre-training classes name their masked-LM logits prediction_logits
                logits = getattr(result, "logits", None)
                logits = result.prediction_logits if logits is None else logits
                out.append(_gather(logits[sel], targets))
        return torch.cat(out) if out else torch.zeros(0, device=inp.device)


def _gather(logits, targets):
    # half-precision logits are normalized in float32; float64 models keep their precision
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
