"""Triggers of the docs/errors.md rows raised by adapters: masked LM."""

import pytest


from error_triggers.registry import trigger
from error_triggers.common import _bert


def _scorer(**kw):
    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = _bert()
    return MaskedLMScorer(model, tok, **kw)


@trigger("mlm-head-argument")
def _():
    _scorer(head="lm")


@trigger("mlm-budgets")
def _():
    _scorer(max_tokens=0)


@trigger("mlm-no-mask-token")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0])


@trigger("mlm-no-special-ids")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0], mask_token_id=4)


@trigger("mlm-head-masked-unknown-class")
def _():
    transformers = pytest.importorskip("transformers")
    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = _bert()

    class MyMaskedLM(transformers.BertForMaskedLM):
        pass

    MaskedLMScorer(MyMaskedLM(model.config), tok, head="masked")


@trigger("mlm-text-column")
def _():
    datasets = pytest.importorskip("datasets")
    _scorer().curve(datasets.Dataset.from_dict({"sentence": ["a b"]}), rates=[0.5])


@trigger("mlm-mapping-without-input-ids")
def _():
    _scorer().curve({"ids": [[2, 5, 3]]}, rates=[0.5])


@trigger("mlm-one-string")
def _():
    _scorer().curve("a b c", rates=[0.5])


@trigger("mlm-empty-inputs")
def _():
    _scorer().curve([], rates=[0.5])


@trigger("mlm-inputs-type")
def _():
    _scorer().curve([1, 2], rates=[0.5])


@trigger("mlm-text-needs-tokenizer")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    MaskedLMScorer(_bert(tokenizer=False)[0], mask_token_id=4, special_token_ids=[0, 2, 3, 4]).curve(["a b"])


@trigger("mlm-attention-mask-length")
def _():
    _scorer().curve({"input_ids": [[2, 5, 6, 3]], "attention_mask": [[1, 1, 1]]}, rates=[0.5])


@trigger("mlm-per-token-entries-length")
def _():
    # padded ids (the padding id 0) beside the unpadded tokens' word indices
    _scorer().pll({"input_ids": [[2, 5, 6, 3, 0]], "attention_mask": [[1, 1, 1, 1, 0]],
                   "word_ids": [[None, 0, 1, None]]}, word_l2r=True)


@trigger("mlm-no-maskable-token")
def _():
    _scorer().curve({"input_ids": [[2, 3]]}, rates=[0.5])


@trigger("mlm-word-l2r-needs-words")
def _():
    _scorer().pll({"input_ids": [[2, 5, 6, 3]]}, word_l2r=True)


@trigger("mlm-positive-int")
def _():
    _scorer().curve(["a b"], rates=[0.5], num_masks=0)


@trigger("mlm-truncation")
def _():
    _scorer(max_length=4).encode(["a b c d e f"])


@trigger("mlm-unknown-tokens")
def _():
    _scorer().encode(["a zzz b"])


@trigger("mlm-pair-without-token-types")
def _():
    scorer = _scorer()
    enc = scorer.tokenizer("a b", "c d")
    scorer.encode({"input_ids": [enc["input_ids"]]})


@trigger("mlm-max-length-beyond-positions")
def _():
    _scorer(max_length=64)


@trigger("mlm-no-lm-head")
def _():
    transformers = pytest.importorskip("transformers")
    model = _bert(tokenizer=False)[0]
    _scorer_for(transformers.BertForSequenceClassification(model.config))


@trigger("mlm-decoder")
def _():
    transformers = pytest.importorskip("transformers")
    config = _bert(tokenizer=False)[0].config
    config.is_decoder = True
    _scorer_for(transformers.BertLMHeadModel(config))


@trigger("mlm-causal")
def _():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    _scorer_for(transformers.GPT2LMHeadModel(config))


@trigger("mlm-encoder-decoder")
def _():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=30, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    _scorer_for(transformers.T5ForConditionalGeneration(config))


def _scorer_for(model):
    from pyro_mpt.adapters import MaskedLMScorer

    return MaskedLMScorer(model, _bert()[1])


@trigger("mlm-tokenizer-vocabulary")
def _():
    transformers = pytest.importorskip("transformers")
    from pyro_mpt.adapters import MaskedLMScorer

    special_only = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])})
    MaskedLMScorer(_bert(tokenizer=False)[0], special_only)


@trigger("mlm-all-unknown")
def _():
    _scorer().pll(["A B C"])


@trigger("mlm-model-not-module")
def _():
    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = _bert()
    MaskedLMScorer(tok, model)


@trigger("mlm-ids-too-long")
def _():
    _scorer().pll({"input_ids": [[2] + [5] * 31 + [3]]})


@trigger("mlm-padding-without-attention-mask")
def _():
    _scorer().pll({"input_ids": [[2, 5, 6, 3, 0, 0]]})


@trigger("antibodies-empty-parents")
def _():
    from pyro_mpt.adapters.antibodies import variants

    variants([], 3)


@trigger("antibodies-mutation-rate")
def _():
    from pyro_mpt.adapters.antibodies import HEAVY, variants

    variants(HEAVY, 3, rate=1.5)




@trigger("mlm-text-columns")
def _():
    _scorer(text_column=["a", "b", "c"])


@trigger("mlm-max-length")
def _():
    _scorer(max_length=0)


@trigger("mlm-all-unknown-lowercased")
def _():
    transformers = pytest.importorskip("transformers")
    from pyro_mpt.adapters import MaskedLMScorer

    from models import tiny_bert

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "A", "B", "C"])}
    tok = transformers.BertTokenizer(vocab=vocab, do_lower_case=True)
    MaskedLMScorer(tiny_bert(vocab_size=8)[0], tok).pll(["A B C"])


@trigger("mlm-ids-out-of-vocabulary")
def _():
    _scorer().pll({"input_ids": [[2, 5, 99, 3]]})
