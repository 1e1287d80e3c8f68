"""MAEScorer on a tiny random ViT-MAE: exact masks, the model's own loss, curves end to end."""

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyro_mpt.adapters import MAEScorer, PAPER_MAE_RATES  # noqa: E402
from pyro_mpt.adapters.rates import item_generator, mask_counts, nested_ranks  # noqa: E402
from pyro_mpt.adapters.vit_mae import init_position_embeddings  # noqa: E402

from models import assert_close_to_rounding, tiny_vit_mae  # noqa: E402


def tiny_mae(norm_pix_loss=False, image_size=16, patch_size=4):
    return tiny_vit_mae(image_size=image_size, patch_size=patch_size, hidden_size=32, num_hidden_layers=2,
                        intermediate_size=64, decoder_hidden_size=16, decoder_intermediate_size=32,
                        norm_pix_loss=norm_pix_loss)


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_exact_masks_and_model_loss_at_each_rate(norm_pix_loss):
    model = tiny_mae(norm_pix_loss)
    scorer = MAEScorer(model)
    N = scorer.num_patches
    assert N == 16 and scorer.patch_dim == 48
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ranks = nested_ranks(torch.Generator().manual_seed(2), 3, N)
    ratio = model.config.mask_ratio
    for M in mask_counts(PAPER_MAE_RATES, [N])[0].tolist() + [N]:
        rec = scorer.reconstruction(x, M, ranks)
        assert rec["mask"].sum(-1).tolist() == [M] * 3
        # the masked patches are exactly those of lowest rank
        assert torch.equal(rec["mask"].bool(), ranks < M)
        recomputed = (rec["patch_error"] * rec["mask"]).sum() / rec["mask"].sum()
        assert abs(recomputed.item() - rec["loss"].item()) < 1e-6
    assert model.config.mask_ratio == ratio  # restored


def test_curves_end_to_end():
    model = tiny_mae(norm_pix_loss=True)
    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    rates = [0.05, 0.25, 0.5, 0.75, 0.95]
    scorer = MAEScorer(model, batch_size=4, seed=3)
    out = scorer.curves(x, rates=rates, num_masks=2)
    mse, logd = out["mse"], out["log_density"]
    assert mse.score.shape == (5,) and mse.per_item.shape == (5, 5) and (mse.count == 10).all()
    assert np.all(np.isfinite(mse.score)) and np.all(mse.score > 0)
    np.testing.assert_allclose(mse.sizes, [1, 4, 8, 12, 15])  # round(r * 16), halves up
    # sigma2 = 1: per-patch Gaussian log-density is affine in the MSE, d = 48
    np.testing.assert_allclose(logd.score, -24 * math.log(2 * math.pi) - 24 * mse.score, rtol=1e-12)
    assert logd.area() == pytest.approx(16 * np.sum(logd.score * np.diff([0, 0.15, 0.375, 0.625, 0.85, 1.0])))
    # per image and rate, the value is the mean error over that image's masked patches
    g = item_generator(3, 1)
    ranks = nested_ranks(g, 2, 16)
    rec = scorer.reconstruction(x[[1, 1]], 8, ranks)
    direct = ((rec["patch_error"] * rec["mask"]).sum(-1) / 8).mean().item()
    assert_close_to_rounding(direct, mse.per_item[1, 2])  # a batch of 2 copies against one of 4
    # batch size does not change the masks; values agree to float32 rounding
    other = MAEScorer(model, batch_size=7, seed=3).curves(x, rates=rates, num_masks=2)
    assert_close_to_rounding(other["mse"].per_item, mse.per_item)
    # sigma2="mle": the pooled MSE over every scored copy
    mle = MAEScorer(model, batch_size=4, seed=3, sigma2="mle").curves(x, rates=rates, num_masks=2)
    assert mle["sigma2"] == pytest.approx(mse.per_item.mean(), rel=1e-9)
    assert mle["log_density"].area() > logd.area()  # a fitted variance beats sigma2=1 here (MSE < 1)


def test_log_density_is_the_gaussian_log_prob_of_the_reconstruction():
    """Independently of the adapter's formula: the log-density curve of an image at a rate
    is the mean, over its masked patches, of Normal(reconstruction, sigma).log_prob of the
    patch's pixels, summed over the patch."""
    model = tiny_mae()  # raw pixels as the regression targets
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    sigma2, N, M = 0.7, 16, 8
    logd = MAEScorer(model, seed=5, sigma2=sigma2).curve(x, rates=[0.25, 0.5])  # the rate 0.5 masks M = 8
    old = model.config.mask_ratio
    model.config.mask_ratio = 0.5  # ViTMAE keeps int(16 * (1 - 0.5)) = 8 patches, those of highest rank
    try:
        for i in range(2):
            ranks = nested_ranks(item_generator(5, i), 1, N)  # the scorer's masks for image i
            with torch.no_grad():
                out = model(pixel_values=x[i : i + 1], noise=-ranks.float())
            masked = out.mask.bool()
            assert torch.equal(masked, ranks < M)
            patch_lp = torch.distributions.Normal(out.logits, math.sqrt(sigma2)).log_prob(model.patchify(x[i : i + 1]))
            expected = float(patch_lp.sum(-1)[masked].mean())
            assert logd.per_item[i, 1] == pytest.approx(expected, rel=1e-5)
    finally:
        model.config.mask_ratio = old


def test_image_inputs_and_validation():
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    model = tiny_mae()
    proc = transformers.ViTImageProcessor(size={"height": 16, "width": 16})
    rng = np.random.default_rng(0)
    pil = [Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8), mode="L") for _ in range(3)]
    scorer = MAEScorer(model, proc, seed=1)
    rates = [0.25, 0.75]
    ref = scorer.curve(pil, rates=rates, kind="mse")
    # a datasets.Dataset with an image column, and a torchvision-style (image, label) list
    ds = datasets.Dataset.from_dict({"image": pil, "label": [0, 1, 2]}).cast_column("image", datasets.Image())
    np.testing.assert_allclose(scorer.curve(ds, rates=rates, kind="mse").per_item, ref.per_item, atol=1e-6)
    pairs = [(im, 0) for im in pil]
    np.testing.assert_allclose(scorer.curve(pairs, rates=rates, kind="mse").per_item, ref.per_item, atol=1e-6)
    tensors = proc(images=[im.convert("RGB") for im in pil], return_tensors="pt")["pixel_values"]
    np.testing.assert_allclose(MAEScorer(model, seed=1).curve(tensors, rates=rates, kind="mse").per_item, ref.per_item, atol=1e-6)
    with pytest.raises(ValueError, match="image_processor"):
        MAEScorer(model).curve(pil, rates=rates)
    with pytest.raises(ValueError, match=r"\(n, C, H, W\)"):
        MAEScorer(model).curve(tensors[0], rates=rates)
    for bad in (0, True, float("nan"), "1.0"):
        with pytest.raises(ValueError, match="sigma2"):
            MAEScorer(model, sigma2=bad)
    with pytest.raises(ValueError, match="kind"):
        scorer.curve(pil, kind="nll")


def test_zero_position_embeddings_are_restored_and_flagged():
    model = tiny_vit_mae(init=False, patch_size=2, decoder_hidden_size=16, decoder_intermediate_size=32)
    if model.vit.embeddings.position_embeddings.any():
        pytest.skip("this transformers version initializes the position embeddings itself")
    with pytest.warns(UserWarning, match="position embeddings"):
        MAEScorer(model)
    # the other weights are kept (the model's initializer re-drew the patch projection, the CLS
    # and the mask token: the warning's advice wiped a trained model's weights)
    others = [model.vit.embeddings.patch_embeddings.projection.weight, model.vit.embeddings.cls_token,
              model.decoder.mask_token]
    with torch.no_grad():
        for k, t in enumerate(others):
            t.fill_(0.125 * (k + 1))
    init_position_embeddings(model)
    for k, t in enumerate(others):
        assert torch.equal(t, torch.full_like(t, 0.125 * (k + 1)))
    pe = model.vit.embeddings.position_embeddings[0, 1:]
    # the fixed 2-D sin-cos table: entries in [-1, 1], every patch distinct
    assert pe.abs().max() <= 1 and torch.unique(pe, dim=0).shape[0] == 16
    # encoder and decoder have the same width here, so the same table
    torch.testing.assert_close(model.decoder.decoder_pos_embed, model.vit.embeddings.position_embeddings)
    init_position_embeddings(model, reinit=True)  # a fresh model's initializer: the others re-drawn
    assert all(not torch.equal(t, torch.full_like(t, 0.125 * (k + 1))) for k, t in enumerate(others))


def test_position_embeddings_of_a_loaded_checkpoint_are_filled(tmp_path):
    """A checkpoint saved with zero tables (built from a config by transformers 5) and loaded
    with from_pretrained: its tensors are flagged as initialized, which the model's initializer
    skips, so init_position_embeddings left the tables at zero (and MAEScorer warned again).
    They now equal the tables of the same model built from its config and filled, the other
    weights are kept, and the flags are as they were."""
    import warnings

    from transformers import ViTMAEForPreTraining

    model = tiny_vit_mae(init=False, patch_size=2, decoder_hidden_size=16, decoder_intermediate_size=32)
    if model.vit.embeddings.position_embeddings.any():
        pytest.skip("this transformers version initializes the position embeddings itself")
    model.save_pretrained(tmp_path)
    loaded = ViTMAEForPreTraining.from_pretrained(tmp_path)
    assert not loaded.vit.embeddings.position_embeddings.any()
    flags = {name: getattr(t, "_is_hf_initialized", None) for name, t in loaded.named_parameters()}
    kept = {name: t.detach().clone() for name, t in loaded.named_parameters() if "pos_embed" not in name
            and "position_embeddings" not in name}
    init_position_embeddings(loaded)
    want = init_position_embeddings(ViTMAEForPreTraining(loaded.config))
    torch.testing.assert_close(loaded.vit.embeddings.position_embeddings, want.vit.embeddings.position_embeddings,
                               rtol=0, atol=0)
    torch.testing.assert_close(loaded.decoder.decoder_pos_embed, want.decoder.decoder_pos_embed, rtol=0, atol=0)
    assert loaded.vit.embeddings.position_embeddings.abs().max() > 0.5
    for name, t in loaded.named_parameters():
        assert getattr(t, "_is_hf_initialized", None) == flags[name]
        if name in kept:
            assert torch.equal(t, kept[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MAEScorer(loaded)


def _hand_mse(model, x, M, ranks, dtype):
    """Masked-patch MSE of each image by the model's own forward and patchify, one image at a time."""
    N = ranks.shape[-1]
    model.config.mask_ratio, old = 1 - (N - M + 0.5) / N, model.config.mask_ratio
    try:
        out = []
        for i in range(x.shape[0]):
            with torch.no_grad():
                o = model(pixel_values=x[i : i + 1].to(dtype), noise=-ranks[i : i + 1].to(dtype))
            e = ((o.logits[0] - model.patchify(x[i : i + 1].to(dtype))[0]) ** 2).mean(-1)
            out.append(e[o.mask[0].bool()].mean())
        return torch.stack(out).double()
    finally:
        model.config.mask_ratio = old


def test_model_in_train_mode_is_scored_without_dropout_and_keeps_its_mode():
    model = tiny_vit_mae(image_size=16, patch_size=4, hidden_size=32, hidden_dropout_prob=0.5,
                         attention_probs_dropout_prob=0.5)
    scorer = MAEScorer(model)
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    ranks = nested_ranks(torch.Generator().manual_seed(5), 3, 16)
    expected = _hand_mse(model.eval(), x, 6, ranks, torch.float32)
    model.train()
    for _ in range(2):
        rec = scorer.reconstruction(x, 6, ranks)
        got = (rec["patch_error"] * rec["mask"]).sum(-1) / 6
        # dropout at 0.5 moves these by tens of percent; eval mode agrees to float32 rounding
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    assert model.training and model.decoder.training


def test_float64_model_keeps_float64_errors():
    model = tiny_vit_mae(image_size=16, patch_size=4, hidden_size=32).double()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    ranks = nested_ranks(torch.Generator().manual_seed(7), 2, 16)
    rec = MAEScorer(model).reconstruction(x, 5, ranks)
    assert rec["patch_error"].dtype == torch.float64
    got = (rec["patch_error"] * rec["mask"]).sum(-1) / 5
    torch.testing.assert_close(got, _hand_mse(model, x, 5, ranks, torch.float64), rtol=1e-12, atol=0)
    # float64 pixels through the curve's inputs stay float64 (they were rounded to float32 first:
    # 2.4e-9 off this reference)
    x64 = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 1.2345678901
    per_item = MAEScorer(model).curves(x64, rates=[0.5], num_masks=1, seed=0)["mse"].per_item[:, 0]
    ranks = torch.cat([nested_ranks(item_generator(0, i), 1, 16) for i in range(2)])
    np.testing.assert_allclose(per_item, _hand_mse(model, x64, 8, ranks, torch.float64).numpy(), rtol=1e-12, atol=0)


def test_numpy_integer_num_masks_is_taken():
    """num_masks=np.int64(2) (from a numpy grid of settings) was refused as 'not a positive integer'."""
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(8))
    scorer = MAEScorer(tiny_mae())
    a = scorer.curves(x, rates=[0.25, 0.75], num_masks=np.int64(2))["mse"]
    b = scorer.curves(x, rates=[0.25, 0.75], num_masks=2)["mse"]
    assert a.per_item.shape == (2, 2) and (a.count == 4).all()
    np.testing.assert_array_equal(a.per_item, b.per_item)  # the same computation, same shapes


def test_image_size_given_as_a_pair():
    """ViTMAEConfig(image_size=(16, 16)) builds and runs in transformers; MAEScorer raised a
    TypeError computing its patch count. Its curve equals the model's own masked-patch MSE."""
    model = tiny_vit_mae(image_size=(16, 16), patch_size=4, hidden_size=32)
    scorer = MAEScorer(model)
    assert scorer.num_patches == 16
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    ranks = nested_ranks(torch.Generator().manual_seed(10), 2, 16)
    rec = scorer.reconstruction(x, 7, ranks)
    got = (rec["patch_error"] * rec["mask"]).sum(-1) / 7
    torch.testing.assert_close(got.double(), _hand_mse(model, x, 7, ranks, torch.float32), rtol=1e-5, atol=0)


def test_loader_fallback_processor_fits_pairs_and_grayscale(tmp_path):
    """A model directory without a processor gets a ViTImageProcessor at the model's size and
    channels: image_size=(16, 16) gave size {'height': (16, 16), ...} (unusable), and a 1-channel
    model ImageNet's 3 means ('mean must have 1 elements'). Grayscale images then score."""
    from PIL import Image

    from pyro_mpt.adapters.loading import load_vit_mae

    for size, C in (((16, 16), 3), (16, 1)):
        d = tmp_path / f"mae{C}"
        tiny_vit_mae(image_size=size, patch_size=4, hidden_size=32, num_channels=C).save_pretrained(d)
        with pytest.warns(UserWarning, match="No image processor found"):
            model, proc = load_vit_mae(str(d))
        assert (proc.size["height"], proc.size["width"]) == (16, 16) and len(proc.image_mean) == C
        images = [Image.fromarray(np.random.default_rng(i).integers(0, 255, (20, 20), dtype=np.uint8)) for i in range(2)]
        pixels = MAEScorer(model, proc).pixel_values(images, [0, 1])
        assert pixels.shape == (2, C, 16, 16)
        # the processor's normalization: (x / 255 - mean) / std, resized
        assert abs(float(pixels.mean()) - (127.5 / 255 - proc.image_mean[0]) / proc.image_std[0]) < 0.3


def test_colour_images_for_a_grayscale_model_are_converted_to_luminance():
    """A 1-channel ViT-MAE fed RGB PIL images failed in the model ('Expected 1 but got 3'); they
    are converted to 'L' as grayscale images are converted to RGB for 3-channel models."""
    from PIL import Image

    model = tiny_vit_mae(image_size=16, patch_size=4, hidden_size=32, num_channels=1)
    proc = transformers.ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5], image_std=[0.5])
    rng = np.random.default_rng(0)
    rgb = [Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)) for _ in range(2)]
    scorer = MAEScorer(model, proc)
    got = scorer.pixel_values(rgb, [0, 1])
    expected = proc(images=[im.convert("L") for im in rgb], return_tensors="pt")["pixel_values"]
    assert got.shape == (2, 1, 16, 16)
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)
    assert np.isfinite(scorer.curves(rgb, rates=[0.5])["mse"].score).all()


def test_batch_sizes_are_positive_integers():
    """batch_size=2.5 ran as 2 (int() of it); numpy integers are counts too."""
    mae = tiny_mae()
    for kw in ({"batch_size": 2.5}, {"batch_size": 0}, {"chunk_images": 1.5}, {"batch_size": True}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"MAEScorer\({name}=\.\.\.\), .* must be a positive integer"):
            MAEScorer(mae, **kw)
    scorer = MAEScorer(mae, batch_size=np.int64(3), chunk_images=np.int32(2))
    assert (scorer.batch_size, scorer.chunk_images) == (3, 2) and type(scorer.batch_size) is int


def test_sigma2_takes_any_real_scalar():
    """np.float32 and 0-dim tensors were refused while np.float64 was taken."""
    model = tiny_mae()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = MAEScorer(model, sigma2=0.5).curves(x, rates=[0.5])
    for s2 in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64),
               np.array(0.5), np.int64(2) / 4):
        out = MAEScorer(model, sigma2=s2).curves(x, rates=[0.5])
        assert out["sigma2"] == 0.5 and type(out["sigma2"]) is float
        np.testing.assert_array_equal(out["log_density"].per_item, ref["log_density"].per_item)
    for bad in (torch.tensor(True), np.bool_(True), torch.tensor([0.5]), np.float32("nan"), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match='sigma2 must be a positive finite float or "mle"'):
            MAEScorer(model, sigma2=bad)


def test_integer_pixels_empty_inputs_and_non_image_columns_are_refused():
    """Raw uint8 pixels were scored as pixel values (an MSE in the tens of thousands); empty
    inputs failed on a reshape; a column of labels failed inside transformers' image loading."""
    model = tiny_mae()
    raw = (torch.arange(2 * 3 * 16 * 16) % 256).reshape(2, 3, 16, 16).to(torch.uint8)
    message = ("Image tensors of dtype torch.uint8 (values 0..255) are raw pixels, but tensors are taken as the "
               "model's pixel_values: floats normalized as its image processor does.")
    with pytest.raises(ValueError) as err:
        MAEScorer(model).curves(raw, rates=[0.5])
    assert str(err.value).startswith(message) and "image_processor=AutoImageProcessor" in str(err.value)
    with pytest.raises(ValueError, match=r"dtype torch.int64 \(values 0..255\)"):
        MAEScorer(model).curves(list(raw.long()), rates=[0.5])  # (C, H, W) tensors, no processor
    # with a processor the same raw images are rescaled and normalized by it
    proc = transformers.ViTImageProcessor(size={"height": 16, "width": 16})
    mse = MAEScorer(model, proc).curves(list(raw), rates=[0.5])["mse"].score
    assert 0 < mse[0] < 10
    for empty in (torch.zeros(0, 3, 16, 16), []):
        with pytest.raises(ValueError, match=r"^inputs is empty: pass at least one image\.$"):
            MAEScorer(model).curves(empty, rates=[0.5])
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    ds = datasets.Dataset.from_dict({"img": [Image.new("RGB", (16, 16))] * 2, "label": [3, 1]})
    ds = ds.cast_column("img", datasets.Image())
    with pytest.raises(ValueError) as err:
        MAEScorer(model, proc, image_column="label").curves(ds, rates=[0.5])
    assert str(err.value) == ("Column 'label' of the dataset holds int64 values (int 3 at row 0), not images; pass "
                              "MAEScorer(..., image_column=...) with one of its image columns ['img'].")
    assert MAEScorer(model, proc, image_column="img").curves(ds, rates=[0.5])["mse"].per_item.shape == (2, 1)


def test_a_dataset_of_pixel_tensors_in_torch_format_is_read():
    """A datasets.Dataset of preprocessed pixels in torch format gives a Column for its image
    column (datasets 5), which torch.stack refused with a TypeError: it is scored as the
    tensor it holds."""
    datasets = pytest.importorskip("datasets")
    model = tiny_mae()
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    want = MAEScorer(model).curves(x, rates=[0.5], seed=0)["mse"].per_item
    ds = datasets.Dataset.from_dict({"pixel_values": x.numpy()}).with_format("torch")
    got = MAEScorer(model, image_column="pixel_values").curves(ds, rates=[0.5], seed=0)["mse"].per_item
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
