"""MaskedLMScorer: masks, batching invariance, heads, schedules, PLL, and the real AntiBERTy model."""

import itertools
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyro_mpt.adapters import MaskedLMScorer, PAPER_MLM_RATES, table2_area  # noqa: E402
from pyro_mpt.adapters.rates import mask_counts, rate_weights  # noqa: E402

from models import TINY_VOCAB, assert_close_to_rounding, tiny_bert  # noqa: E402

LETTERS = "".join(TINY_VOCAB[5:])  # the letters after the special tokens


def _roberta_tokenizer():
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for i, c in enumerate(LETTERS):
        vocab[c] = 5 + i
        vocab["\u0120" + c] = 15 + i
    vocab["\u0120"] = 25
    # no merges: every character is a token, so words span several tokens
    return transformers.RobertaTokenizer(vocab=vocab, merges=[])


def _tiny(kind, tmp_path_factory):
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if kind == "bert":
        return tiny_bert(tmp_path_factory.mktemp("bert_vocab"), max_position_embeddings=64, **common)
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(
        vocab_size=26, max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common
    )
    return transformers.RobertaForMaskedLM(cfg).eval(), _roberta_tokenizer()


@pytest.fixture(scope="module", params=["bert", "roberta"])
def tiny(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


TEXTS_BERT = ["a b c d e f g", "j i h", "a a b b c c d d e e f f", "c"]
TEXTS_ROBERTA = ["abc de fgh", "ji", "aab bcc dde eff gha", "c"]


def _texts(tok):
    return TEXTS_BERT if isinstance(tok, transformers.BertTokenizer) else TEXTS_ROBERTA


def _encoder(model):
    return model.bert if hasattr(model, "bert") else model.roberta


def _padded(tok, texts):
    return tok(texts, padding=True, return_tensors="pt")


def test_special_tokens_and_padding_never_masked(tiny):
    model, tok = tiny
    texts = _texts(tok)
    batch = _padded(tok, texts)
    assert (batch["attention_mask"] == 0).any(), "the test needs padding"
    seen = []
    scorer = MaskedLMScorer(model, tok, max_tokens=40)  # its check's probe is not a scored input
    hook = _encoder(model).embeddings.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    rates = [0.05, 0.5, 0.99]
    try:
        scorer.curve(batch, rates=rates, num_masks=3)
    finally:
        hook.remove()
    special = set(tok.all_special_ids) - {tok.mask_token_id}
    lengths = batch["attention_mask"].sum(1).tolist()
    for ids in seen:
        T = ids.shape[1]
        # padding is stripped: each forward holds copies of one unpadded sequence length
        assert T in lengths
        assert ids[:, 0].eq(tok.cls_token_id).all() and ids[:, -1].eq(tok.sep_token_id).all()
        assert not any(int(v) == tok.pad_token_id for v in ids.flatten())
        inner = ids[:, 1:-1]
        assert not torch.isin(inner, torch.tensor(sorted(special))).any()
        m = (inner == tok.mask_token_id).sum(1)
        allowed = mask_counts(rates, [T - 2])[0]
        assert torch.isin(m, allowed).all()
    # the masks themselves, over unpadded positions
    masks = scorer.curve_masks(batch, rates=rates, num_masks=3)
    for i, m in enumerate(masks):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        spec = torch.isin(ids, torch.tensor(tok.all_special_ids))
        assert not m[..., spec].any()
        assert m.shape == (3, 3, ids.numel())


def test_exact_mask_counts_and_nesting(tiny):
    model, tok = tiny
    scorer = MaskedLMScorer(model, tok)
    rates = PAPER_MLM_RATES
    masks = scorer.curve_masks(_texts(tok), rates=rates, num_masks=2, seed=3)
    enc = scorer.encode(_texts(tok))
    for m, L in zip(masks, enc.lengths):
        expected = np.minimum(L, np.maximum(1, np.floor(rates * L + 0.5))).astype(int)
        assert (m.sum(-1).numpy() == expected[:, None]).all()
        # nested: a mask contains every smaller-rate mask of the same draw
        assert (m[1:] >= m[:-1]).all()
    # round half away from zero: L = 12 at 12.5 % gives 1.5 -> 2 masked tokens
    assert mask_counts([0.125], [12]).item() == 2


def test_reproducible_under_seed(tiny):
    model, tok = tiny
    scorer = MaskedLMScorer(model, tok, seed=11)
    rates = [0.1, 0.4, 0.8]
    a = scorer.curve(_texts(tok), rates=rates, num_masks=2)
    b = scorer.curve(_texts(tok), rates=rates, num_masks=2)
    c = scorer.curve(_texts(tok), rates=rates, num_masks=2, seed=12)
    # the same kernels on the same shapes: bitwise equal
    np.testing.assert_array_equal(a.score, b.score)
    np.testing.assert_array_equal(a.per_item, b.per_item)
    assert not np.array_equal(a.per_item, c.per_item)
    # an item's masks do not depend on the other items; scored alone it runs in other
    # batch shapes, so its numbers agree to float32 rounding
    alone = scorer.curve(_texts(tok)[:1], rates=rates, num_masks=2)
    assert_close_to_rounding(alone.per_item[0], a.per_item[0])
    assert torch.equal(scorer.curve_masks(_texts(tok)[:1], rates, 2)[0], scorer.curve_masks(_texts(tok), rates, 2)[0])


def test_same_results_for_any_batch_budget(tiny):
    """Same masks for any budget; the numbers agree to float32 rounding (256 eps relative:
    other batch shapes pick other BLAS kernels, measured 2.4e-7 apart on some CPUs)."""
    model, tok = tiny
    texts = _texts(tok)
    rates = [0.05, 0.3, 0.6, 0.95]
    out = []
    for budget in (1, 37, 100_000):
        s = MaskedLMScorer(model, tok, max_tokens=budget)
        out.append((s.curve(texts, rates=rates, num_masks=3), s.pll(texts), s.score(texts, "uniform", num_masks=4)))
    for curve, pll, score in out[1:]:
        assert_close_to_rounding(curve.per_item, out[0][0].per_item)
        assert_close_to_rounding(curve.score, out[0][0].score)
        assert_close_to_rounding(pll, out[0][1])
        assert_close_to_rounding(score, out[0][2])
    # the tolerance still resolves a change of masks: another seed fails it
    with pytest.raises(AssertionError):
        assert_close_to_rounding(MaskedLMScorer(model, tok, seed=1).curve(texts, rates=rates, num_masks=3).per_item,
                                 out[0][0].per_item)


def test_masked_head_matches_full_logits(tiny):
    model, tok = tiny
    texts = _texts(tok)
    fast = MaskedLMScorer(model, tok, head="masked", max_logits=7)  # tiny chunks of the head
    full = MaskedLMScorer(model, tok, head="full")
    assert fast.forward.encoder is not None and full.forward.encoder is None
    rates = [0.1, 0.5, 0.9]
    np.testing.assert_allclose(
        fast.curve(texts, rates=rates, num_masks=2).per_item,
        full.curve(texts, rates=rates, num_masks=2).per_item, rtol=0, atol=1e-5,
    )
    torch.testing.assert_close(fast.pll(texts), full.pll(texts), rtol=0, atol=1e-5)


def _log_probs(model, tok, ids, masked):
    """log p(x_j | x with `masked` replaced by the mask token) at every position, one forward."""
    x = ids.masked_fill(masked, tok.mask_token_id)
    with torch.no_grad():
        return model(input_ids=x[None]).logits[0].log_softmax(-1).gather(-1, ids[:, None])[:, 0].double()


def test_pll_and_word_l2r_match_direct_computation(tmp_path_factory):
    model, tok = _tiny("roberta", tmp_path_factory)
    texts = ["abc de", "fgh ij a"]
    scorer = MaskedLMScorer(model, tok)
    total, per_tok = scorer.pll(texts, per_token=True)
    total_l2r = scorer.pll(texts, word_l2r=True)
    for i, text in enumerate(texts):
        enc = tok(text)
        ids = torch.tensor(enc["input_ids"])
        words = enc.word_ids()
        direct, direct_l2r = [], []
        for j in range(1, ids.numel() - 1):
            only = torch.zeros(ids.numel(), dtype=torch.bool)
            only[j] = True
            direct.append(_log_probs(model, tok, ids, only)[j])
            # within-word l2r: also mask the rest of the word to the right
            right = torch.tensor([k >= j and words[k] == words[j] for k in range(ids.numel())])
            direct_l2r.append(_log_probs(model, tok, ids, right)[j])
        torch.testing.assert_close(per_tok[i], torch.stack(direct), rtol=0, atol=1e-5)
        assert abs(total_l2r[i].item() - sum(direct_l2r).item()) < 1e-5
    # multi-character words: the variant differs from plain PLL
    assert (total_l2r - total).abs().max() > 1e-4


def test_exhaustive_score_matches_enumeration_and_schedules_agree(tmp_path_factory):
    model, tok = _tiny("bert", tmp_path_factory)
    text = "a b c d"
    ids = torch.tensor(tok(text)["input_ids"])
    L = ids.numel() - 2
    exact = 0.0
    for M in range(1, L + 1):
        subsets = list(itertools.combinations(range(1, L + 1), M))
        for S in subsets:
            masked = torch.zeros(ids.numel(), dtype=torch.bool)
            masked[list(S)] = True
            exact += _log_probs(model, tok, ids, masked)[list(S)].sum().item() / M / len(subsets)
    scorer = MaskedLMScorer(model, tok)
    assert abs(scorer.score([text], masks="exhaustive").item() - exact) < 1e-5
    # unbiased schedules estimate the same number: with 300 masks, measured |error| <= 0.019
    # over seeds 0-4 (uniform), <= 0.009 (all), < 1e-4 (order: a near-uniform random init is
    # almost consistent)
    for masks in ("uniform", "all", "order"):
        est = scorer.score([text], masks=masks, num_masks=300, seed=1).item()
        assert abs(est - exact) < 0.05, (masks, est, exact)
    # the fixed-rate schedule is the known biased one: D * S(x; M) with M = round(0.5 * 4) = 2
    s2 = np.mean([
        _log_probs(model, tok, ids, torch.isin(torch.arange(ids.numel()), torch.tensor(S)))[list(S)].mean().item()
        for S in itertools.combinations(range(1, L + 1), 2)
    ])
    assert abs(scorer.score([text], masks=0.5, num_masks=400).item() - L * s2) < 0.15


def test_all_score_draws_an_independent_mask_per_size_and_nested_one_permutation(tmp_path_factory):
    """The docs said score(masks="all") used nested masks; it draws, like the loss's "all", an
    independent mask of each size ("nested" nests them). Both equal a loop of plain forward
    passes over the masks they draw, read back from the copies the scorer runs (1e-5)."""
    model, tok = _tiny("bert", tmp_path_factory)
    text = "a b c d e"
    ids = torch.tensor(tok(text)["input_ids"])
    L = ids.numel() - 2
    scorer = MaskedLMScorer(model, tok)
    seen = []
    forward = scorer.forward.__class__.__call__

    def spy(self, input_ids, *args, **kwargs):
        seen.append(input_ids.detach().cpu().clone())
        return forward(self, input_ids, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(scorer.forward.__class__, "__call__", spy)
    try:
        got = {m: [scorer.score([text], masks=m, num_masks=1, seed=s).item() for s in range(3)] for m in ("all", "nested")}
    finally:
        mp.undo()
    masks = torch.cat([b.reshape(-1, b.shape[-1]) for b in seen]) == tok.mask_token_id  # (2 schedules x 3 seeds x L, L + 2)
    masks = masks.view(2, 3, L, L + 2)
    nested = lambda m: bool((m[:-1] <= m[1:]).all())  # noqa: E731  each copy holds the one before
    for k, name in enumerate(("all", "nested")):
        for s in range(3):
            m = masks[k, s]
            m = m[m.sum(-1).argsort()]  # by size 1..L
            assert m.sum(-1).tolist() == list(range(1, L + 1))
            want = sum(_log_probs(model, tok, ids, row)[row].mean().item() for row in m)
            assert abs(got[name][s] - want) < 1e-5
        assert all(nested(masks[k, s][masks[k, s].sum(-1).argsort()]) for s in range(3)) == (name == "nested")


def test_inputs_dataset_pairs_and_validation(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    model, tok = _tiny("bert", tmp_path_factory)
    scorer = MaskedLMScorer(model, tok, text_column="sentence")
    ds = datasets.Dataset.from_dict({"sentence": TEXTS_BERT[:2], "other": ["c d", "e"]})
    from_ds = scorer.pll(ds)
    torch.testing.assert_close(from_ds, scorer.pll(TEXTS_BERT[:2]), rtol=0, atol=0)
    pairs = scorer.encode(ds, text_column=("sentence", "other"))
    assert pairs.token_type_ids[0].max() == 1  # the second segment
    assert pairs.lengths.tolist() == [7 + 2, 3 + 1]
    with pytest.raises(ValueError, match="text_column"):
        scorer.encode(ds, text_column="nope")
    with pytest.raises(TypeError, match="wrap it"):
        scorer.curve("a b c")
    with pytest.raises(ValueError, match="no maskable token"):
        scorer.pll([""])
    with pytest.raises(ValueError, match="rates"):
        scorer.curve(TEXTS_BERT, rates=[0.0, 0.5])
    with pytest.raises(ValueError, match="num_masks"):
        scorer.curve(TEXTS_BERT, num_masks=0)
    with pytest.raises(ValueError, match="word boundaries"):
        scorer.pll({"input_ids": [[2, 5, 6, 3]]}, word_l2r=True)


def test_accelerate_single_process_matches(tmp_path_factory):
    accelerate = pytest.importorskip("accelerate")
    model, tok = _tiny("bert", tmp_path_factory)
    rates = [0.2, 0.7]
    plain = MaskedLMScorer(model, tok)
    acc = MaskedLMScorer(model, tok, accelerator=accelerate.Accelerator(cpu=True))
    # same masks; accelerate may change the device placement or thread settings: equal to rounding
    assert_close_to_rounding(
        acc.curve(TEXTS_BERT, rates=rates, num_masks=2).per_item,
        plain.curve(TEXTS_BERT, rates=rates, num_masks=2).per_item,
    )
    assert_close_to_rounding(acc.pll(TEXTS_BERT), plain.pll(TEXTS_BERT))
    assert_close_to_rounding(acc.score(TEXTS_BERT, "order"), plain.score(TEXTS_BERT, "order"))


def test_areas_and_table2_convention(tmp_path_factory):
    model, tok = _tiny("bert", tmp_path_factory)
    curve = MaskedLMScorer(model, tok).curve(TEXTS_BERT, num_masks=1)
    assert curve.rates.shape == (99,)
    w = rate_weights(curve.rates)
    assert abs(w.sum() - 1) < 1e-12 and abs(w[1] - 0.01) < 1e-12 and abs(w[0] - 0.015) < 1e-12
    assert table2_area(curve) == pytest.approx(curve.score.sum() * 0.01 * 512, rel=1e-12)
    assert curve.area() == pytest.approx(curve.num_tokens * np.sum(w * curve.score), rel=1e-12)
    np.testing.assert_allclose(curve.per_item_area(), curve.lengths * (curve.per_item @ w))
    with pytest.raises(ValueError, match="99-rate grid"):
        table2_area(MaskedLMScorer(model, tok).curve(TEXTS_BERT, rates=[0.1, 0.5]))
    # a random-init BERT predicts ~uniformly: Table 2 gives about -log(V) * 0.99 * 512
    assert table2_area(curve) == pytest.approx(-math.log(len(tok)) * 0.99 * 512, rel=0.1)


# ------------------------------------------------------------------ sentence pairs, lengths, padding
def _wordpiece_bert(tmp_path_factory):
    """The tiny BERT with a WordPiece vocabulary whose words span several tokens
    ('abc' -> a ##b ##c): TINY_VOCAB, then ##a..##j (25 tokens)."""
    d = tmp_path_factory.mktemp("wordpiece")
    # a wide initialization: its predictions depend on the context far beyond float32 rounding
    model, _ = tiny_bert(vocab_size=25, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                         max_position_embeddings=64, initializer_range=0.5)
    path = d / "vocab.txt"
    path.write_text("\n".join(TINY_VOCAB + ["##" + c for c in LETTERS]) + "\n")
    return model, transformers.BertTokenizer(vocab=str(path), do_lower_case=False)


def test_word_l2r_on_sentence_pairs_matches_brute_force(tmp_path_factory):
    """PLL-word-l2r of a pair: scoring a token masks the rest of ITS word in ITS sentence only.
    Word indices restart in sentence B, so word k of A and word k of B share an index; a loop
    over the tokens, masking by (sentence, word), is the reference."""
    model, tok = _wordpiece_bert(tmp_path_factory)
    pairs = [("abc de", "fgh ij"), ("ab cde f", "ghij ab")]
    scorer = MaskedLMScorer(model, tok)
    total, per_tok = scorer.pll(pairs, word_l2r=True, per_token=True)
    for i, (a, b) in enumerate(pairs):
        enc = tok(a, b)
        ids, types = torch.tensor(enc["input_ids"]), torch.tensor(enc["token_type_ids"])
        words, seqs = enc.word_ids(), enc.sequence_ids()
        assert words.count(0) >= 4  # word 0 of A and word 0 of B: the case that went wrong
        direct, wrong = [], []
        for j in range(ids.numel()):
            if words[j] is None:
                continue

            def log_p(rule):
                masked = torch.tensor([k >= j and words[k] is not None and rule(k) for k in range(ids.numel())])
                x = ids.masked_fill(masked, tok.mask_token_id)
                with torch.no_grad():
                    logits = model(input_ids=x[None], token_type_ids=types[None]).logits[0]
                return logits.log_softmax(-1)[j, ids[j]].double()

            direct.append(log_p(lambda k: words[k] == words[j] and seqs[k] == seqs[j]))
            wrong.append(log_p(lambda k: words[k] == words[j]))  # keyed by word only
        direct, wrong = torch.stack(direct), torch.stack(wrong)
        assert_close_to_rounding(per_tok[i], direct)
        assert_close_to_rounding(total[i], direct.sum())
        # the reference tells the two apart: keying by word alone masks sentence B too
        assert (wrong - direct).abs().max() > 0.05
    # pre-tokenized pairs with HF word_ids (restarting in B) give the same numbers
    enc = tok([a for a, _ in pairs], [b for _, b in pairs])
    data = {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
            "word_ids": [enc.word_ids(i) for i in range(len(pairs))]}
    torch.testing.assert_close(scorer.pll(data, word_l2r=True), total, rtol=0, atol=0)  # same shapes


def test_pretokenized_ids_longer_than_the_model_are_refused(tmp_path_factory):
    model, tok = _tiny("bert", tmp_path_factory)  # 64 positions
    scorer = MaskedLMScorer(model, tok)
    at_max = [2] + [5] * 62 + [3]
    assert scorer.encode({"input_ids": [at_max]}).ids[0].numel() == 64
    with pytest.raises(ValueError, match=r"input_ids\[0\] has 65 tokens \(padding removed\), more than the maximum "
                                         r"of 64 the model takes \(config.max_position_embeddings\)"):
        scorer.encode({"input_ids": [at_max[:1] + [6] + at_max[1:]]})
    # padding does not count; an explicit max_length is the limit when given
    padded = at_max + [tok.pad_token_id] * 3
    assert scorer.encode({"input_ids": [padded], "attention_mask": [[1] * 64 + [0] * 3]}).ids[0].numel() == 64
    with pytest.raises(ValueError, match=r"has 64 tokens .* maximum of 10 the model takes \(max_length\)"):
        MaskedLMScorer(model, tok, max_length=10).encode({"input_ids": [at_max]})


def test_a_roberta_limit_says_why_it_is_below_max_position_embeddings(tmp_path_factory):
    """RoBERTa numbers positions from pad_token_id + 1, so 66 position embeddings take 64 tokens:
    65 ids are refused, and the message says where 64 comes from (it named the setting alone,
    which reads 66); 64 ids are scored, and max_length=65 is refused alike."""
    model, tok = _tiny("roberta", tmp_path_factory)
    scorer = MaskedLMScorer(model, tok)
    ids = [0] + [10] * 62 + [2]
    assert torch.isfinite(torch.as_tensor(scorer.pll({"input_ids": [ids]}))).all()
    why = r"config.max_position_embeddings = 66, less 2: the model numbers its positions from pad_token_id \+ 1"
    with pytest.raises(ValueError, match=rf"has 65 tokens .* maximum of 64 the model takes \({why}\)"):
        scorer.pll({"input_ids": [ids[:1] + [11] + ids[1:]]})
    with pytest.raises(ValueError, match=rf"max_length=65 is more than the 64 positions the model takes \({why}\)"):
        MaskedLMScorer(model, tok, max_length=65)
    unset = transformers.RobertaConfig(vocab_size=26, max_position_embeddings=66, pad_token_id=None)
    from pyro_mpt.adapters.mlm_inputs import position_limit, position_limit_words

    assert position_limit(unset) == 64
    assert position_limit_words(unset).endswith("from the padding index + 1 (pad_token_id unset: 1 taken)")


def test_swapped_model_and_tokenizer_are_named(tmp_path_factory):
    """MaskedLMScorer(tokenizer, model) failed inside transformers ("BertTokenizer has no
    attribute parameters"): the first argument is named as the model, the swap as such."""
    model, tok = _tiny("bert", tmp_path_factory)
    with pytest.raises(TypeError, match=r"first argument is the model, .* got BertTokenizer \(the arguments look swapped\)"):
        MaskedLMScorer(tok, model)
    with pytest.raises(TypeError, match=r"got str\. The tokenizer comes second"):
        MaskedLMScorer("bert-base-uncased")
    with pytest.raises(TypeError, match=r"got the class BertForMaskedLM, not a model \(load one: BertForMaskedLM.from_pretrained"):
        MaskedLMScorer(type(model), tok)


def test_padded_ids_without_attention_mask_are_refused(tiny):
    """Unmasked padding would be read as context (the issue measured a PLL 1.76 off)."""
    model, tok = tiny
    batch = _padded(tok, _texts(tok))
    with pytest.raises(ValueError, match=rf"input_ids\[0\] holds the padding token \(id {tok.pad_token_id}\) .* no "
                                         r"attention_mask was given"):
        MaskedLMScorer(model, tok).pll({"input_ids": batch["input_ids"]})
    # with the mask, padded ids score as the unpadded texts
    scorer = MaskedLMScorer(model, tok)
    assert_close_to_rounding(scorer.pll(batch), scorer.pll(_texts(tok)))
    # without a tokenizer, the config's pad id counts only when it is among the special ids
    bare = MaskedLMScorer(model, mask_token_id=tok.mask_token_id, special_token_ids=tok.all_special_ids)
    with pytest.raises(ValueError, match="holds the padding token"):
        bare.pll({"input_ids": batch["input_ids"]})


def test_truncation_warning_only_beyond_the_maximum(tmp_path_factory, recwarn):
    """64 positions: 62 letters + [CLS] [SEP] fit exactly (no warning), 63 are cut to 64."""
    model, tok = _tiny("bert", tmp_path_factory)
    scorer = MaskedLMScorer(model, tok)
    letters = (LETTERS * 7)[:63]
    enc = scorer.encode([" ".join(letters[:62])])
    assert enc.ids[0].numel() == 64
    assert not [w for w in recwarn if "truncated" in str(w.message)]
    with pytest.warns(UserWarning, match=r"^1 sequence\(s\) were longer than max_length=64 tokens and were truncated"):
        enc = scorer.encode([" ".join(letters[:62]), " ".join(letters)])
    assert [x.numel() for x in enc.ids] == [64, 64]
    # pairs: [CLS] A [SEP] B [SEP] with 30 + 31 letters is exactly 64
    recwarn.clear()
    scorer.encode([(" ".join(letters[:30]), " ".join(letters[30:61]))])
    assert not [w for w in recwarn if "truncated" in str(w.message)]
    with pytest.warns(UserWarning, match="1 sequence"):
        scorer.encode([(" ".join(letters[:30]), " ".join(letters[30:62]))])


def test_tokenizer_must_fit_the_model_and_unknown_text_is_explained(tmp_path_factory):
    model, tok = _tiny("bert", tmp_path_factory)  # 15 tokens, vocab_size 15
    special_only = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(TINY_VOCAB[:5])})
    with pytest.raises(ValueError, match=r"has 5 tokens but the model's vocabulary \(config.vocab_size\) has 15"):
        MaskedLMScorer(model, special_only)
    big, wide = _wordpiece_bert(tmp_path_factory)
    small_model, _ = tiny_bert(vocab_size=12)  # 25 tokens for a 12-token embedding
    with pytest.raises(ValueError, match="has 25 tokens .* has 12: .*its ids would fall outside the embedding"):
        MaskedLMScorer(small_model, wide)
    MaskedLMScorer(big, wide)  # a matching pair passes
    scorer = MaskedLMScorer(model, tok)
    for text, n in (("A B C", 3), ("abc", 1)):  # upper case; unspaced (one unknown word)
        with pytest.raises(ValueError, match=rf"Sequence 0 has no maskable token: all its {n} token\(s\) are the "
                                             r"unknown token '\[UNK\]'.*vocabulary of 15 tokens"):
            scorer.pll([text])


# ------------------------------------------------------------------ AntiBERTy
ANTIBODIES = [
    "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIH",
    "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVA",
    "QVQLVQSGAEVKKPGASVKVSCKASGYTFTSYGI",
    "EIVLTQSPGTLSLSPGERATLSCRASQSVSSSYLA",
]


@pytest.fixture(scope="module")
def antiberty():
    pytest.importorskip("antiberty")
    from pyro_mpt.adapters.loading import load_masked_lm

    model, tok = load_masked_lm("antiberty", quiet=False)
    return model, tok, [" ".join(s) for s in ANTIBODIES]


def test_antiberty_pll_matches_per_position_loop(antiberty):
    model, tok, seqs = antiberty
    seqs = [" ".join(s[:18]) for s in ANTIBODIES[:2]]
    scorer = MaskedLMScorer(model, tok, max_tokens=512)
    total, per_tok = scorer.pll(seqs, per_token=True)
    for i in range(2):
        ids = torch.tensor(tok(seqs[i])["input_ids"])
        direct = torch.stack([
            _log_probs(model, tok, ids, torch.arange(ids.numel()) == j)[j] for j in range(1, ids.numel() - 1)
        ])
        torch.testing.assert_close(per_tok[i], direct, rtol=0, atol=1e-5)
        assert abs(total[i].item() - direct.sum().item()) < 1e-5
    # a real model: antibody framework residues are easy given the rest (measured about -0.1 per token)
    assert (total / 18).max() > -1.0


def test_antiberty_curve_decays_and_random_init_is_flat(antiberty):
    model, tok, seqs = antiberty
    rates = [0.05, 0.5, 0.9]
    trained = MaskedLMScorer(model, tok).curve(seqs, rates=rates, num_masks=2)
    # measured: -0.05 at 5 %, -0.32 at 50 %, -2.87 at 90 %
    assert trained.score[0] > -0.2
    assert trained.score[0] > trained.score[1] > trained.score[2]
    assert trained.score[0] - trained.score[2] > 2.0
    torch.manual_seed(0)
    random = transformers.BertForMaskedLM(model.config).eval()
    flat = MaskedLMScorer(random, tok).curve(seqs, rates=rates, num_masks=2)
    # measured over init seeds 0-2 (2 masks): every rate within 0.13 of -log(25) = -3.22,
    # spread 0.02-0.18 (sampling noise, stderr 0.04-0.10), while the trained curve falls by 2.8
    assert np.ptp(flat.score) < 0.25
    np.testing.assert_allclose(flat.score, -math.log(model.config.vocab_size), atol=0.2)
    assert np.ptp(trained.score) > 10 * np.ptp(flat.score)
    assert trained.area() > flat.area()


def _hand_pll(model, tok, text, dtype):
    """Per-token PLL by one forward per token, the model in eval mode, log-softmax in ``dtype``."""
    ids = torch.tensor(tok(text)["input_ids"])
    out = []
    for j in range(1, ids.numel() - 1):
        x = ids.clone()
        x[j] = tok.mask_token_id
        with torch.no_grad():
            out.append(model(input_ids=x[None]).logits[0, j].to(dtype).log_softmax(-1)[ids[j]])
    return torch.stack(out).double()


def test_model_in_train_mode_is_scored_without_dropout_and_keeps_its_mode(tmp_path_factory):
    # a scorer built once and queried between training steps: the model is in train mode then
    model, tok = tiny_bert(tmp_path_factory.mktemp("dropout_vocab"), hidden_dropout_prob=0.5,
                           attention_probs_dropout_prob=0.5)
    scorer = MaskedLMScorer(model, tok)
    texts = ["a b c d e f", "g h i"]
    expected = [_hand_pll(model.eval(), tok, t, torch.float32) for t in texts]
    model.train()
    model.bert.embeddings.eval()  # a submodule in its own mode (e.g. frozen embeddings)
    for _ in range(2):
        total, per_tok = scorer.pll(texts, per_token=True)
        for i in range(len(texts)):
            # dropout at 0.5 moves these by nats; eval mode agrees to float32 rounding
            torch.testing.assert_close(per_tok[i], expected[i], rtol=0, atol=1e-5)
        curve = scorer.curve(texts, rates=[0.3, 0.7], num_masks=2)
        np.testing.assert_allclose(curve.per_item, scorer.curve(texts, rates=[0.3, 0.7], num_masks=2).per_item,
                                   rtol=0, atol=1e-6)
    assert model.training and model.cls.training and not model.bert.embeddings.training


def test_float64_model_keeps_float64_log_probs(tmp_path_factory):
    model, tok = tiny_bert(tmp_path_factory.mktemp("f64_vocab"))
    model = model.double()
    texts = ["a b c d e f g h", "j i"]
    _, per_tok = MaskedLMScorer(model, tok).pll(texts, per_token=True)
    for i, text in enumerate(texts):
        # float64 rounding; a float32 log-softmax is ~1e-7 off
        torch.testing.assert_close(per_tok[i], _hand_pll(model, tok, text, torch.float64), rtol=0, atol=1e-12)


def test_texts_are_truncated_to_the_model_positions_when_the_tokenizer_allows_more(tmp_path_factory):
    # a tokenizer saved for a larger model of the family (bert-base's 512) with a 32-position model
    model, tok = tiny_bert(tmp_path_factory.mktemp("long_vocab"))
    tok.model_max_length = 512
    letters = LETTERS * 5
    text = " ".join(letters[:40])  # 42 tokens with CLS and SEP
    with pytest.warns(UserWarning, match="longer than max_length=32"):
        _, per_tok = MaskedLMScorer(model, tok).pll([text], per_token=True)
    # the first 30 letters between CLS and SEP, scored by a loop over the positions
    ids = torch.tensor(tok(text, truncation=True, max_length=32)["input_ids"])
    assert ids.numel() == 32
    direct = torch.stack([
        _log_probs(model, tok, ids, torch.arange(32) == j)[j] for j in range(1, 31)
    ])
    torch.testing.assert_close(per_tok[0], direct, rtol=0, atol=1e-5)


def test_fixed_rate_score_masks_at_least_one_token_of_short_sequences(tmp_path_factory):
    """masks=0.15 on a corpus with 1- and 3-token sentences (round(0.15 L) = 0) was refused; it
    masks max(1, round(r L)) tokens, the rule of curve()."""
    from pyro_mpt.masks import FixedRate

    model, tok = tiny_bert(tmp_path_factory.mktemp("rate_vocab"))
    scorer = MaskedLMScorer(model, tok)
    texts = ["c", "a b c", "a b c d e f g h i j a b c d e f g h i j"]
    P = 400
    score = scorer.score(texts, masks=0.15, num_masks=P, seed=3)
    # one token: M = 1 masks it, L * S(x; 1) = log p(x_1 | [CLS] [MASK] [SEP]), no randomness
    ids = torch.tensor(tok("c")["input_ids"])
    assert abs(score[0].item() - _log_probs(model, tok, ids, torch.arange(3) == 1)[1].item()) < 1e-5
    # three tokens: M = 1, so the estimate's expectation is 3 S(x; 1), the PLL, from P random tokens
    ids = torch.tensor(tok("a b c")["input_ids"])
    single = torch.stack([_log_probs(model, tok, ids, torch.arange(5) == j)[j] for j in (1, 2, 3)])
    stderr = 3 * single.std(unbiased=False).item() / math.sqrt(P)
    assert abs(score[1].item() - single.sum().item()) < 4 * stderr  # fixed seed, 4 standard errors
    # where round(r L) >= 1 the masks and the number are FixedRate's own
    expected = scorer.score(texts[2:], masks=FixedRate(0.15, P), seed=3)
    alone = scorer.score(texts[2:], masks=0.15, num_masks=P, seed=3)
    assert_close_to_rounding(alone, expected)


@pytest.mark.parametrize("head", ["auto", "full"])
def test_pretraining_classes_are_scored_by_their_masked_lm_head(tmp_path_factory, head):
    """BertForPreTraining (MLM + next-sentence heads) crashed ('no attribute logits'); its
    masked-LM head is served, split or as full prediction_logits, equal to a loop over positions."""
    _, tok = tiny_bert(tmp_path_factory.mktemp("pretraining_vocab"))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(TINY_VOCAB), hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    model = transformers.BertForPreTraining(config).eval()
    _, per_tok = MaskedLMScorer(model, tok, head=head).pll(["a b c d e", "j i"], per_token=True)
    for i, text in enumerate(["a b c d e", "j i"]):
        ids = torch.tensor(tok(text)["input_ids"])
        direct = []
        for j in range(1, ids.numel() - 1):
            x = ids.clone()
            x[j] = tok.mask_token_id
            with torch.no_grad():
                direct.append(model(input_ids=x[None]).prediction_logits[0, j].log_softmax(-1)[ids[j]].double())
        torch.testing.assert_close(per_tok[i], torch.stack(direct), rtol=0, atol=1e-5)


def test_models_without_a_masked_lm_head_are_refused(tmp_path_factory):
    _, tok = tiny_bert(tmp_path_factory.mktemp("nohead_vocab"))
    config = dict(vocab_size=len(TINY_VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=32)
    for cls in (transformers.BertModel, transformers.BertForSequenceClassification):
        with pytest.raises(ValueError, match=f"{cls.__name__} has no language-model head"):
            MaskedLMScorer(cls(transformers.BertConfig(**config)), tok)
    with pytest.raises(ValueError, match="configured as a decoder"):
        MaskedLMScorer(transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **config)), tok)


def test_causal_lms_without_a_decoder_flag_are_refused(tmp_path_factory):
    """GPT-2's config has no is_decoder: its causal attention is found by a probe (the first
    position's logits do not move with the last token), where it was scored as a masked LM
    (a curve of -3.3 at every rate, silently). Bidirectional models pass, in train mode too."""
    _, tok = tiny_bert(tmp_path_factory.mktemp("causal_vocab"))
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(TINY_VOCAB), n_embd=16, n_layer=1,
                                                               n_head=2, n_positions=32))
    assert not getattr(gpt.config, "is_decoder", False)
    with pytest.raises(ValueError, match="GPT2LMHeadModel attends to the left only"):
        MaskedLMScorer(gpt, tok)
    assert gpt.training  # the probe left the mode as it was
    config = dict(vocab_size=len(TINY_VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=32)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(**config))
    MaskedLMScorer(bert.train(), tok)
    assert bert.training


def test_progress_bar_counts_to_the_number_of_masked_copies(tmp_path_factory, capsys):
    """The curve's and PLL's bars know their totals (an ETA on long corpora); they ran without one."""
    model, tok = tiny_bert(tmp_path_factory.mktemp("bar_vocab"))
    scorer = MaskedLMScorer(model, tok, progress=True)
    texts = ["a b c d e f g h", "a b"]
    scorer.curve(texts, rates=[0.1, 0.2, 0.5, 0.9], num_masks=3)
    # mask sizes max(1, round(r L)): L = 8 -> 1, 2, 4, 7 (4 sizes); L = 2 -> 1, 1, 1, 2 (2 sizes)
    assert "18/18" in capsys.readouterr().err  # 3 masks x (4 + 2) sizes
    scorer.pll(texts)
    assert "10/10" in capsys.readouterr().err  # one copy per token


def test_budgets_are_positive_integers(tmp_path):
    """max_tokens=2.5 ran as 2 (int() of it); numpy integers are budgets too."""
    model, tok = tiny_bert(tmp_path)
    for kw in ({"max_tokens": 2.5}, {"max_tokens": 0}, {"max_logits": 1e6}, {"max_tokens": False}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"MaskedLMScorer\({name}=\.\.\.\), .* must be a positive integer"):
            MaskedLMScorer(model, tok, **kw)
    assert MaskedLMScorer(model, tok, max_tokens=np.int64(64)).max_tokens == 64


def test_sequences_with_some_unknown_tokens_warn_that_their_scores_sum_fewer_tokens(tmp_path):
    """A symbol outside the vocabulary becomes the unknown token, which is never masked nor
    scored: the sequence's PLL sums fewer terms (AntiBERTy: 'E V X Q L' read -16.6 against
    -24.8 for 'E V Q L', silently). encode warns with the counts; sequences without one do not."""
    import warnings

    from pyro_mpt.adapters import MaskedLMScorer

    model, tok = tiny_bert(tmp_path)
    scorer = MaskedLMScorer(model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scorer.encode(["a b c", "d e"])
    with pytest.warns(UserWarning, match=r"2 of 3 sequence\(s\) hold the unknown token '\[UNK\]' \(3 token\(s\); sequence 0 has 1\)"):
        enc = scorer.encode(["a zzz b", "c d", "e yy xx f"])
    # the unknown tokens are context, not targets: two maskable tokens in the first sequence
    assert [int(m.numel()) for m in enc.maskable] == [2, 2, 2]


@pytest.mark.parametrize("kind", ["mpnet", "esm"])
def test_models_numbering_positions_after_padding_take_max_positions_less_the_offset(kind):
    """MPNet and ESM (absolute positions) number positions from pad_token_id + 1, as RoBERTa:
    ids of max_position_embeddings - 2 tokens are scored (the PLL equals a loop written in
    transformers), one more is refused with the length message (it failed inside the model
    with an IndexError, the limit being read as max_position_embeddings)."""
    torch.manual_seed(0)
    common = dict(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=12, pad_token_id=1)
    if kind == "mpnet":
        model = transformers.MPNetForMaskedLM(transformers.MPNetConfig(**common)).eval()
    else:
        model = transformers.EsmForMaskedLM(transformers.EsmConfig(
            mask_token_id=4, position_embedding_type="absolute", **common)).eval()
    model = model.double()
    scorer = MaskedLMScorer(model, None, mask_token_id=4, special_token_ids=[0, 1, 2, 3, 4])
    ids = torch.tensor([0] + list(range(5, 13)) + [2])  # 10 tokens
    got = scorer.pll({"input_ids": [ids]})
    want = 0.0
    with torch.no_grad():
        for j in range(1, 9):
            masked = ids.clone()
            masked[j] = 4
            want += torch.log_softmax(model(input_ids=masked[None]).logits[0, j], -1)[ids[j]].item()
    assert abs(float(got[0]) - want) < 1e-10
    with pytest.raises(ValueError, match=r"has 11 tokens \(padding removed\), more than the maximum of 10"):
        scorer.pll({"input_ids": [torch.cat([ids[:1], torch.tensor([13]), ids[1:]])]})


def test_masks_depend_on_the_seed_and_the_index_only(tmp_path_factory):
    """What the docs claim (MaskedLMScorer's docstring, docs/adapters.md): a sequence's masks
    depend on the seed and its index, not on the other sequences' content nor on max_tokens; the
    same sequence at another index gets other masks (the docs claimed before that the input
    order did not matter)."""
    model, tok = _tiny("bert", tmp_path_factory)
    scorer = MaskedLMScorer(model, tok)
    a, b, c = "a b c d e f g h", "j i h g f e d c", "c d c d c d c d"  # 8 tokens each
    rates = [0.25, 0.5, 0.75]
    ab, ac, ba = (scorer.curve_masks(x, rates, 3, seed=5) for x in ([a, b], [a, c], [b, a]))
    assert torch.equal(ab[0], ac[0]) and torch.equal(ab[1], ac[1])  # the other sequence's content: no effect
    assert not torch.equal(ab[0], ba[1])  # a at index 1 instead of 0: other masks, drawn alike
    assert ab[0][:, :, 1:-1].sum(-1).tolist() == ba[1][:, :, 1:-1].sum(-1).tolist() == [[2] * 3, [4] * 3, [6] * 3]
    # the numbers follow the masks: a's row is the same beside b or c, for any budget
    small, large = MaskedLMScorer(model, tok, max_tokens=9), MaskedLMScorer(model, tok, max_tokens=10_000)
    assert_close_to_rounding(small.curve([a, b], rates, 3, seed=5).per_item[0],
                             large.curve([a, c], rates, 3, seed=5).per_item[0])
    doc = " ".join(MaskedLMScorer.__doc__.split())
    assert "seeded by ``(seed, the sequence's index in the inputs)``" in doc and "input order" not in doc
    assert "the same sequence at another index gets other masks" in doc


def test_empty_inputs_of_every_kind_are_refused(tmp_path_factory):
    """Before, only [] was refused: a (0, T) ids tensor failed on a reshape, an empty Dataset
    with an IndexError."""
    datasets = pytest.importorskip("datasets")
    model, tok = _tiny("bert", tmp_path_factory)
    scorer = MaskedLMScorer(model, tok)
    empty = datasets.Dataset.from_dict({"text": []})
    for call in (lambda: scorer.curve({"input_ids": torch.zeros((0, 5), dtype=torch.long)}, rates=[0.5]),
                 lambda: scorer.curve({"input_ids": []}, rates=[0.5]),
                 lambda: scorer.curve(empty, rates=[0.5]), lambda: scorer.pll(empty), lambda: scorer.score(empty),
                 lambda: scorer.curve_masks(empty, [0.5]), lambda: scorer.curve([], rates=[0.5])):
        with pytest.raises(ValueError, match=r"^inputs is empty: pass at least one sequence\.$"):
            call()
    # a missing column is still named first
    with pytest.raises(ValueError, match="text_column"):
        scorer.pll(empty, text_column="nope")


def test_ids_outside_the_vocabulary_are_refused(tmp_path_factory):
    """Before: a bare IndexError ('index out of range in self') from the embedding."""
    model, tok = _tiny("bert", tmp_path_factory)  # vocab_size 15
    scorer = MaskedLMScorer(model, tok)
    for ids, bad, pos in (([2, 5, 99, 3], 99, 2), ([2, 5, 6, -5, 3], -5, 3), ([2, 15, 3], 15, 1)):
        with pytest.raises(ValueError) as err:
            scorer.pll({"input_ids": [[2, 5, 3], ids]})
        assert str(err.value) == (f"input_ids[1] holds id {bad} at position {pos}, outside the model's vocabulary "
                                  f"of 15 tokens (config.vocab_size: ids 0..14); pass ids from the model's tokenizer.")
    assert scorer.pll({"input_ids": [[2, 14, 5, 3]]}).shape == (1,)  # the last id is taken


def test_text_unknown_only_because_lower_cased_says_so():
    """A vocabulary of upper-case symbols read by a lower-casing tokenizer: the message named
    upper case as the fix, which the text already was; now it names the lower-casing and
    do_lower_case=False. Without lower-casing the same text is scored; a text unknown in any
    case keeps the general message."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "A", "B", "C"])}
    model, _ = tiny_bert(vocab_size=8)
    lowering = MaskedLMScorer(model, transformers.BertTokenizer(vocab=vocab, do_lower_case=True))
    with pytest.raises(ValueError) as err:
        lowering.pll(["A B C B"])
    assert str(err.value) == (
        "Sequence 0 has no maskable token: all its 4 token(s) are the unknown token '[UNK]', because the tokenizer "
        "lower-cases the text (do_lower_case=True) while its vocabulary of 8 tokens has the text's words as written "
        "('A', 'B', 'C'). Load the tokenizer with do_lower_case=False (on the command line: --no-lowercase).")
    cased = MaskedLMScorer(model, transformers.BertTokenizer(vocab=vocab, do_lower_case=False))
    assert torch.isfinite(cased.pll(["A B C B"])).all() and cased.encode(["A B C B"]).lengths.tolist() == [4]
    with pytest.raises(ValueError, match="knows none of the text's symbols. Write the text as the vocabulary expects"):
        lowering.pll(["X Y"])
