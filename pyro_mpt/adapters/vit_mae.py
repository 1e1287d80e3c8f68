r"""MPT curves for HuggingFace ViT-MAE (``ViTMAEForPreTraining``).

A masked autoencoder sees an image as :math:`N` patches of
:math:`d = p^2 C` values, hides a random subset :math:`\mathcal M` of
:math:`M` patches, and regresses their pixels (per-patch normalized when
``config.norm_pix_loss``) from the visible ones. Fig. 6 of the paper draws,
for masking rates 5 %..95 %, the mean reconstruction error of the masked
patches; :class:`MAEScorer` computes that curve with exact masks.

**Exact masks.** ``ViTMAEModel`` keeps ``int(N * (1 - config.mask_ratio))``
patches, chosen by ``argsort(noise)``. The scorer sets the ratio so that the
truncation yields exactly :math:`N - M` kept patches,
:math:`M = \max(1, \operatorname{round}(rN))`, and passes ``noise`` built
from seeded per-image permutations (nested across rates), then checks the
returned ``mask``.

**MSE is not a log-density.** The squared error is turned into one by the
Gaussian decoder the MSE objective implies,
:math:`p(x_j \mid x_{\mathcal R}) = \mathcal N(x_j; \hat x_j, \sigma^2 I_d)`
for patch :math:`j`, whose log-density is

.. math:: \log p(x_j\mid x_{\mathcal R}) = -\frac d2\log(2\pi\sigma^2)
    - \frac{d}{2\sigma^2}\,e_j, \qquad
    e_j = \frac1d\lVert x_j - \hat x_j\rVert^2 .

The log-density curve is :math:`S(x; M) = \frac1M\sum_{j\in\mathcal M}
\log p(x_j\mid x_{\mathcal R})` (per patch, in nats). :math:`\sigma^2` is a
modelling choice the network does not provide: the default 1 matches the unit
per-patch variance of ``norm_pix_loss`` targets; ``sigma2="mle"`` uses the
mean of the per-copy errors :math:`\hat e_{ikp}` over every image, rate and
mask (one value for the whole curve, so rates stay comparable): the
:math:`\sigma^2` that maximizes the curve's mean height, each rate weighing
alike (not the pooled error over all scored patches, which would weigh each
rate by its number of masked patches). With ``norm_pix_loss`` the
density is over normalized patches, not raw pixels.
"""

import math
import warnings
from numbers import Real
from contextlib import contextmanager, nullcontext
from collections.abc import Mapping

import numpy as np
import torch

from .columns import check_image_column
from .batching import check_not_empty, eval_mode, gather_rows, place_model, positive_count, shard
from ..code_origin import user_stacklevel
from .rates import PAPER_MAE_RATES, check_rates, item_generator, mask_counts, nested_ranks, rate_curve

__all__ = ["MAEScorer", "init_position_embeddings", "check_pixel_dtype"]


def init_position_embeddings(model, reinit=False):
    """Give a ``ViTMAEForPreTraining`` its fixed 2-D sin-cos position embeddings.

    ViT-MAE's position embeddings are frozen sin-cos tables (He et al., 2022),
    stored in checkpoints. transformers 5 leaves them at zero when the model is
    built from a config (``ViTMAEForPreTraining(config)``), so a "random init"
    would also be blind to patch positions. This fills the encoder's and the
    decoder's tables as the architecture specifies and keeps every other weight
    (the model's own initializer also re-draws the patch projection, the CLS
    token and the decoder's mask token: a model whose other weights were trained
    lost them); with ``reinit`` it re-draws those too, as that initializer does
    for a model freshly built from a config. Returns the model.

    Example::

        >>> model = init_position_embeddings(ViTMAEForPreTraining(config), reinit=True)
    """
    emb = model.vit.embeddings
    proj = emb.patch_embeddings.projection
    kept = [] if reinit else [proj.weight, emb.cls_token, model.decoder.mask_token]
    saved = [t.detach().clone() for t in kept]
    # the initializer skips the modules and the tensors flagged as initialized, which every
    # tensor that from_pretrained loaded is: the tables of a loaded model stayed zero
    flagged = [proj, proj.weight, emb.position_embeddings, emb.cls_token, model.decoder.decoder_pos_embed,
               model.decoder.mask_token]
    flags = [getattr(obj, "_is_hf_initialized", None) for obj in flagged]
    for obj in flagged:
        obj._is_hf_initialized = False
    try:
        with torch.no_grad():
            emb.initialize_weights()
            model.decoder.initialize_weights(emb.patch_embeddings.num_patches)
            for t, value in zip(kept, saved):
                t.copy_(value)
    finally:
        for obj, flag in zip(flagged, flags):
            if flag is None:
                del obj._is_hf_initialized
            else:
                obj._is_hf_initialized = flag
    return model


def _floating(pixels):
    """Pixel tensors as float32, or as they are in float64: a float64 model scored float64
    pixels rounded to float32 (2.4e-9 off a float64 reference)."""
    return pixels if pixels.dtype == torch.float64 else pixels.float()


def check_pixel_dtype(pixels):
    """Refuse image tensors of an integer dtype, given where preprocessed ``pixel_values`` are
    meant: raw 0..255 pixels were scored as they were (an MSE in the tens of thousands, no
    warning), while the model reads floats normalized by its image processor.

    :param torch.Tensor pixels: the image tensor given as is (no image processor runs on it).
    :raises ValueError: naming the dtype and the range, and what to pass instead.
    """
    if pixels.dtype.is_floating_point:
        return
    lo, hi = (int(pixels.min()), int(pixels.max())) if pixels.numel() else (0, 0)
    raise ValueError(
        f"Image tensors of dtype {pixels.dtype} (values {lo}..{hi}) are raw pixels, but tensors are taken "
        f"as the model's pixel_values: floats normalized as its image processor does. Pass the images "
        f"as a list (PIL images or arrays) with image_processor=AutoImageProcessor.from_pretrained(...), "
        f"or pass the processor's pixel_values (a float tensor)."
    )


class MAEScorer:
    r"""Reconstruction-error and Gaussian log-density MPT curves of a ViT-MAE.

    :param model: a ``transformers.ViTMAEForPreTraining``; every forward pass
        runs it in eval mode (no dropout) and gives it back in the mode it was in.
    :param image_processor: turns PIL images / arrays into ``pixel_values``
        (e.g. ``AutoImageProcessor.from_pretrained(...)``); not needed for
        tensors that are already preprocessed.
    :param int batch_size: masked copies per forward pass.
    :param sigma2: variance :math:`\sigma^2` of the Gaussian decoder: a
        positive real scalar (a float, a numpy scalar, a 0-dim tensor), or ``"mle"``.
    :param device: default the model's device.
    :param bool bf16: autocast to bfloat16 (GPU); errors are computed in float32.
    :param str image_column: image column of a ``datasets.Dataset``.
    :param int chunk_images: images preprocessed and held at once.
    :param int seed: default mask seed.
    :param bool progress: tqdm progress bar.
    :param accelerator: ``accelerate.Accelerator`` (or True): images are
        sharded across processes and results gathered.

    Example::

        >>> from transformers import AutoImageProcessor, ViTMAEForPreTraining
        >>> model = ViTMAEForPreTraining.from_pretrained("facebook/vit-mae-base")
        >>> proc = AutoImageProcessor.from_pretrained("facebook/vit-mae-base")
        >>> scorer = MAEScorer(model, proc, batch_size=64)
        >>> curves = scorer.curves(dataset, num_masks=2)   # dataset: datasets.Dataset with "image"
        >>> curves["mse"].score, curves["log_density"].area()
    """

    def __init__(
        self,
        model,
        image_processor=None,
        *,
        batch_size=64,
        sigma2=1.0,
        device=None,
        bf16=False,
        image_column="image",
        chunk_images=256,
        seed=0,
        progress=False,
        accelerator=None,
    ):
        given = sigma2
        if isinstance(sigma2, (torch.Tensor, np.ndarray)) and sigma2.ndim == 0:
            sigma2 = sigma2.item()  # a 0-dim tensor or array (np.float32 and kin are Real already)
        # True is an int equal to 1: a flag passed where a variance is meant
        number = isinstance(sigma2, Real) and not isinstance(sigma2, (bool, np.bool_))
        if not (isinstance(sigma2, str) and sigma2 == "mle" or (number and math.isfinite(sigma2) and sigma2 > 0)):
            raise ValueError(f'sigma2 must be a positive finite float or "mle", got {given!r}.')
        sigma2 = sigma2 if isinstance(sigma2, str) else float(sigma2)
        batch_size = positive_count(batch_size, "MAEScorer(batch_size=...), masked copies per forward pass,")
        chunk_images = positive_count(chunk_images, "MAEScorer(chunk_images=...), images preprocessed at once,")
        for attr in ("vit", "decoder", "patchify"):
            if not hasattr(model, attr):
                raise TypeError(
                    f"MAEScorer needs a ViTMAEForPreTraining (with .vit, .decoder, .patchify); got {type(model).__name__}."
                )
        self.model, self.device, self.accelerator = place_model(model, device, accelerator)
        # the model's own dtype for the pixels (float32 processors feed float64 or half models too)
        dtype = next(self.model.parameters()).dtype
        self._pixel_dtype = dtype if dtype.is_floating_point else None
        self.image_processor = image_processor
        self.batch_size = int(batch_size)
        self.sigma2 = sigma2
        self.bf16 = bool(bf16)
        self.image_column = image_column
        self.chunk_images = int(chunk_images)
        self.seed = seed
        self.progress = progress
        cfg = model.config
        # the patch embedding knows its grid; config.image_size may be an (h, w) pair
        self.num_patches = int(model.vit.embeddings.patch_embeddings.num_patches)
        if not model.vit.embeddings.position_embeddings.detach().any():
            warnings.warn(
                "This ViT-MAE has all-zero position embeddings (transformers 5 leaves them so when a model is "
                "built from a config); call pyro_mpt.adapters.vit_mae.init_position_embeddings(model) first, "
                "which fills the fixed sin-cos tables and keeps the other weights (pyro-mpt mae-curve: "
                "--init-position-embeddings; a checkpoint trained with zero position embeddings is scored as it is).",
                stacklevel=user_stacklevel(),
            )
        self.patch_dim = cfg.patch_size**2 * cfg.num_channels

    # ------------------------------------------------------------------ inputs
    def _len(self, inputs):
        if isinstance(inputs, torch.Tensor):
            if inputs.dim() != 4:
                raise ValueError(
                    f"Image tensors must be a batch (n, C, H, W), got shape {tuple(inputs.shape)}; "
                    f"use images[None] for one image."
                )
            return inputs.shape[0]
        return len(inputs)

    def pixel_values(self, inputs, indices):
        """Preprocessed ``pixel_values`` ``(len(indices), C, H, W)`` of some inputs.

        :param inputs: a tensor ``(n, C, H, W)`` (used as is), a
            ``datasets.Dataset`` with ``image_column``, a torchvision-style
            dataset of ``(image, label)`` pairs, or a list of images (PIL,
            arrays or ``(C, H, W)`` tensors). PIL images are converted to the
            model's channels: grayscale to RGB for 3-channel models, colour to
            luminance (``"L"``) for 1-channel ones.
        """
        indices = [int(i) for i in indices]
        if isinstance(inputs, torch.Tensor):
            check_pixel_dtype(inputs)
            return _floating(inputs[indices])
        if hasattr(inputs, "column_names") and not isinstance(inputs, Mapping):
            if self.image_column not in inputs.column_names:
                raise ValueError(
                    f"image_column {self.image_column!r} not in the dataset's columns {inputs.column_names}; "
                    f"pass MAEScorer(..., image_column='...')."
                )
            check_image_column(inputs, self.image_column, "the dataset", "MAEScorer(..., image_column=...)")
            # a list: a dataset in torch format gives a Column (datasets 5), which torch.stack refused
            images = list(inputs.select(indices)[self.image_column])
        else:
            images = [inputs[i] for i in indices]
            images = [im[0] if isinstance(im, (tuple, list)) else im for im in images]
        if self.image_processor is None:
            if all(isinstance(im, torch.Tensor) and im.dim() == 3 for im in images):
                images = torch.stack(images)
                check_pixel_dtype(images)
                return _floating(images)
            raise ValueError(
                "These images need preprocessing: pass image_processor=AutoImageProcessor.from_pretrained(...) "
                "(or a ViTImageProcessor), or give preprocessed tensors (n, C, H, W)."
            )
        if self.model.config.num_channels == 3:
            # Fashion-MNIST and other grayscale sets: the processor expects RGB
            images = [im.convert("RGB") if hasattr(im, "convert") and getattr(im, "mode", "RGB") != "RGB" else im for im in images]
        elif self.model.config.num_channels == 1:
            # a grayscale model (e.g. trained on MNIST) fed colour or RGBA PIL images: their luminance
            images = [im.convert("L") if hasattr(im, "convert") and getattr(im, "mode", "L") != "L" else im for im in images]
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"].float()

    # ------------------------------------------------------------- forward
    @contextmanager
    def _keep_exactly(self, num_kept):
        """Make ``int(N * (1 - mask_ratio))`` equal ``num_kept`` for one forward."""
        cfg = self.model.vit.embeddings.config
        old = cfg.mask_ratio
        # the half-token offset makes the model's int() truncation land on num_kept
        cfg.mask_ratio = 1.0 - (num_kept + 0.5) / self.num_patches
        try:
            yield
        finally:
            cfg.mask_ratio = old

    def reconstruction(self, pixel_values, num_masked, ranks):
        r"""One forward pass with exact masks; per-patch errors and the model's loss.

        :param torch.Tensor pixel_values: ``(B, C, H, W)``.
        :param int num_masked: :math:`M`, masked patches per image.
        :param torch.Tensor ranks: long ``(B, N)``; patch ``j`` is masked iff
            ``ranks[:, j] < num_masked``.
        :returns: dict with ``patch_error`` ``(B, N)`` (:math:`e_j`, mean
            squared error over the patch's :math:`d` values against the
            normalized target when ``norm_pix_loss``), ``mask`` ``(B, N)``
            (1 = masked, from the model) and ``loss`` (the model's own scalar).
        """
        N = self.num_patches
        if not 1 <= num_masked <= N:
            raise ValueError(f"num_masked must be in 1..{N} (patches per image), got {num_masked}.")
        pv = pixel_values.to(self.device, dtype=self._pixel_dtype or pixel_values.dtype)
        # argsort(noise) keeps the lowest noise: the highest ranks stay visible
        noise = -ranks.to(self.device).float()
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()
        with torch.inference_mode(), eval_mode(self.model), self._keep_exactly(N - num_masked), amp:
            out = self.model(pixel_values=pv, noise=noise)
        # errors in float32 at least: bf16/half models lose nothing, float64 models keep float64
        work = torch.promote_types(out.logits.dtype, torch.float32)
        target = self.model.patchify(pv).to(work)
        if self.model.config.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        err = ((out.logits.to(work) - target) ** 2).mean(-1)
        mask = out.mask.float()
        counts = mask.sum(-1)
        if not torch.all(counts == num_masked):
            raise RuntimeError(
                f"The model masked {counts.tolist()} patches instead of {num_masked}; "
                f"this ViT-MAE does not honour noise/mask_ratio as expected. Use a "
                f"transformers ViTMAEForPreTraining, whose random masking reads both."
            )
        return {"patch_error": err, "mask": mask.to(work), "loss": out.loss.to(work)}

    # ------------------------------------------------------------- curves
    def curves(self, inputs, rates=PAPER_MAE_RATES, num_masks=1, seed=None, label=None):
        r"""The MSE and Gaussian log-density MPT curves over masking rates.

        For image :math:`i`, rate :math:`r_k` and mask :math:`p` with
        :math:`M = \max(1, \operatorname{round}(r_k N))` masked patches,

        .. math:: \hat e_{ikp} = \frac1M\sum_{j\in\mathcal M_{ikp}} e_{ij},\qquad
            \hat S_{ikp} = -\frac d2\log(2\pi\sigma^2) - \frac{d}{2\sigma^2}\hat e_{ikp}.

        :param inputs: see :meth:`pixel_values`.
        :param rates: ``(R,)`` rates in (0, 1); default 5 %, 10 %, ..., 95 %.
        :param int num_masks: masks per image and rate.
        :returns: dict with ``"mse"`` and ``"log_density"``
            :class:`~pyro_mpt.adapters.rates.RateCurve` (``per_item`` ``(n, R)``)
            and ``"sigma2"``, the variance used.
        """
        from tqdm.auto import tqdm

        rates = check_rates(rates)
        K = positive_count(num_masks, "num_masks")
        seed = self.seed if seed is None else seed
        n = self._len(inputs)
        check_not_empty(n, "image")
        N = self.num_patches
        counts = mask_counts(rates, [N])[0].tolist()
        items = shard(n, self.accelerator)
        values = torch.zeros((len(items), len(rates), K), dtype=torch.float64, device="cpu")
        main = self.accelerator is None or self.accelerator.is_local_main_process
        bar = tqdm(total=len(items) * len(rates) * K, desc="MAE curve", unit="copy", disable=not (self.progress and main))
        for c0 in range(0, len(items), self.chunk_images):
            chunk = items[c0 : c0 + self.chunk_images]
            pixels = self.pixel_values(inputs, chunk)
            ranks = torch.stack([nested_ranks(item_generator(seed, i), K, N) for i in chunk])  # (n_c, K, N)
            # copies of the chunk, image-major: copy c is image c // K, mask c % K
            img = torch.arange(len(chunk), device="cpu").repeat_interleave(K)
            ranks = ranks.reshape(-1, N)
            for k, M in enumerate(counts):
                for b0 in range(0, img.numel(), self.batch_size):
                    sl = slice(b0, b0 + self.batch_size)
                    rec = self.reconstruction(pixels[img[sl]], M, ranks[sl])
                    per_copy = (rec["patch_error"] * rec["mask"]).sum(-1) / M
                    flat = torch.arange(b0, min(b0 + self.batch_size, img.numel()), device="cpu")
                    values[c0 + flat // K, k, flat % K] = per_copy.double().cpu()
                    bar.update(flat.numel())
        bar.close()
        mse = gather_rows(values, items, n, self.accelerator)
        sigma2 = float(mse.mean()) if self.sigma2 == "mle" else float(self.sigma2)
        d = self.patch_dim
        logd = -0.5 * d * math.log(2 * math.pi * sigma2) - d / (2 * sigma2) * mse
        lengths = np.full(n, N)
        base = label or "ViT-MAE"
        return {
            "mse": rate_curve(mse, rates, lengths, label=f"{base} MSE"),
            "log_density": rate_curve(logd, rates, lengths, label=f"{base} log-density"),
            "sigma2": sigma2,
        }

    def curve(self, inputs, rates=PAPER_MAE_RATES, num_masks=1, seed=None, label=None, kind="log_density"):
        """One of :meth:`curves`: ``kind="log_density"`` (default) or ``"mse"``."""
        if kind not in ("log_density", "mse"):
            raise ValueError(f'kind must be "log_density" or "mse", got {kind!r}.')
        return self.curves(inputs, rates, num_masks, seed, label)[kind]
