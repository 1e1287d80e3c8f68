"""Fig. 6: MPT curves of ViT-MAE on image test sets, pre-trained vs random init.

For masking rates 5 %..95 % the script draws, per dataset, the mean squared
error of the masked patches (what ViT-MAE minimizes) and the Gaussian
log-density curve it implies (:class:`pyro_mpt.adapters.MAEScorer`, fixed
:math:`\\sigma^2`), for ``facebook/vit-mae-base`` and for a random
initialization of the same architecture, on Fashion-MNIST, CIFAR-100 and
Tiny-ImageNet test images.

Offline (no hub), a clearly labelled fallback trains a tiny ViT-MAE (8x8
images, 2x2 patches) for a few hundred steps on scikit-learn's bundled digits,
at masking rates drawn uniformly from 10 %..90 %, and draws its curves on
held-out digits at several points of training: the random initialization
(step 0) gives a flat, low curve, and training lifts the low-rate end, as in
the paper's figures.

    python examples/vit_mae_curves.py                       # online: 32 test images per dataset
    python examples/vit_mae_curves.py --device cuda --limit 1000 --num-masks 2
    python examples/vit_mae_curves.py --offline             # force the fallback (about 2 minutes on CPU)
"""

import argparse
import json
import time

import numpy as np
import torch

from pyro_mpt.adapters import PAPER_MAE_RATES, MAEScorer
from pyro_mpt.adapters.loading import ResourceUnavailable, load_images, load_vit_mae
from pyro_mpt.adapters.vit_mae import init_position_embeddings

#: name -> (dataset, config, split, image column)
DATASETS = {
    "Fashion-MNIST": ("fashion_mnist", None, "test", "image"),
    "CIFAR-100": ("cifar100", None, "test", "img"),
    "Tiny-ImageNet": ("zh-plus/tiny-imagenet", None, "valid", "image"),
}


def online(args):
    model, proc = load_vit_mae(args.model, quiet=True)
    random_model, _ = load_vit_mae(args.model, random_init=True, seed=args.seed, quiet=True)
    data = {
        name: (load_images(dataset=ds, config=cfg, split=split, column=col, limit=args.limit), col)
        for name, (ds, cfg, split, col) in DATASETS.items()
    }
    results = {}
    for name, (images, col) in data.items():
        for which, m in (("pre-trained", model), ("random init", random_model)):
            scorer = MAEScorer(m, proc, batch_size=args.batch_size, sigma2=args.sigma2, device=args.device,
                               image_column=col, seed=args.seed, progress=args.progress)
            results[f"{name}, {which}"] = scorer.curves(images, rates=PAPER_MAE_RATES, num_masks=args.num_masks,
                                                        label=f"{name}, {which}")
    return results


def tiny_vit_mae(seed):
    """The fallback's tiny ViT-MAE (8x8 single-channel images, 2x2 patches), initialized from ``seed``."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    cfg = ViTMAEConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, decoder_hidden_size=64, decoder_num_hidden_layers=2, decoder_num_attention_heads=4,
        decoder_intermediate_size=128, norm_pix_loss=False,
    )
    torch.manual_seed(seed)  # transformers initializes the weights from torch's global stream
    return init_position_embeddings(ViTMAEForPreTraining(cfg), reinit=True)


def train_steps(model, opt, train, steps, generator):
    """``steps`` AdamW steps of the MAE loss at masking rates drawn from 10 %..90 %.

    Reproducible from ``generator`` alone: it draws the batches, the masking
    rates and the masking noise (passed to the model as ``noise=``, which
    ViT-MAE otherwise draws from torch's global stream, where anything else in
    the process can move it). The steps run on one thread whatever
    ``torch.get_num_threads()`` says: other thread counts round the matrix
    products differently, and a few hundred steps of training amplify that
    rounding into a different model (before the steps were pinned, the
    default run gave MSE 0.3021 at step 600 on one thread, 0.2935 on two).
    """
    num_patches = (model.config.image_size // model.config.patch_size) ** 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(steps):
            idx = torch.randint(0, train.shape[0], (128,), generator=generator)
            # train across masking rates, as the uniform MPT schedule does
            model.config.mask_ratio = float(torch.empty(1).uniform_(0.1, 0.9, generator=generator))
            noise = torch.rand(idx.numel(), num_patches, generator=generator)
            loss = model(pixel_values=train[idx], noise=noise).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model


def offline(args):
    """Train a tiny ViT-MAE on sklearn digits; curves at a few training steps."""
    from sklearn.datasets import load_digits

    digits = load_digits().images.astype(np.float32)
    x = torch.from_numpy((digits - digits.mean()) / digits.std())[:, None]  # (1797, 1, 8, 8), unit variance
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(x.shape[0], generator=g)
    test, train = x[perm[: args.limit or 300]], x[perm[args.limit or 300:]]
    model = tiny_vit_mae(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    checkpoints = sorted({0, args.train_steps // 8, args.train_steps // 2, args.train_steps})
    results = {}
    step = 0
    for target in checkpoints:
        train_steps(model, opt, train, target - step, g)
        step = target
        scorer = MAEScorer(model, batch_size=args.batch_size, sigma2=args.sigma2, seed=args.seed)
        label = "random init (step 0)" if target == 0 else f"step {target}"
        results[f"digits, {label}"] = scorer.curves(test, rates=PAPER_MAE_RATES, num_masks=args.num_masks, label=label)
        print(f"  trained to step {target}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="facebook/vit-mae-base")
    p.add_argument("--limit", type=int, default=None, help="test images per dataset (default 32 online, 300 offline)")
    p.add_argument("--num-masks", type=int, default=1)
    p.add_argument("--sigma2", default=1.0, type=lambda s: s if s == "mle" else float(s))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-steps", type=int, default=1200, help="offline fallback: training steps")
    p.add_argument("--offline", action="store_true", help="skip the hub and run the fallback")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--plot", default="vit_mae_curves.png")
    p.add_argument("--json", default="vit_mae_curves.json", help="where to save the curves ('' to skip)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        if args.offline:
            raise ResourceUnavailable("--offline was given")
        results = online(args)
        mode = f"online: {args.model}"
    except ResourceUnavailable as err:
        mode = "OFFLINE FALLBACK: a tiny ViT-MAE trained here on sklearn digits, not facebook/vit-mae-base"
        print(f"[{mode}]\n  reason: {str(err).split('. ')[0]}.")
        results = offline(args)
    print(f"[{mode}] {time.perf_counter() - t0:.0f} s")
    print(f"  {'curve':34s} {'MSE 5%':>8s} {'MSE 50%':>8s} {'MSE 95%':>8s} {'log-density area':>17s}")
    for name, c in results.items():
        mse = c["mse"]
        i50 = int(np.argmin(np.abs(mse.rates - 0.5)))
        print(f"  {name:34s} {mse.score[0]:8.4f} {mse.score[i50]:8.4f} {mse.score[-1]:8.4f} "
              f"{c['log_density'].area():17.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in results.items():
        (line,) = a1.plot(100 * c["mse"].rates, c["mse"].score, label=name)
        a2.plot(100 * c["log_density"].rates, c["log_density"].score, color=line.get_color(), label=name)
    a1.set_ylabel("MSE of masked patches")
    s2 = next(iter(results.values()))["sigma2"]
    a2.set_ylabel(f"Gaussian log-density per patch ($\\sigma^2$={s2:.3g})")
    for a in (a1, a2):
        a.set_xlabel("masking rate (%)")
        a.legend(fontsize=7)
    fig.suptitle(mode, fontsize=9)
    fig.savefig(args.plot, dpi=130, bbox_inches="tight")
    plt.close(fig)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "curves": {k: {"mse": v["mse"].to_dict(), "log_density": v["log_density"].to_dict(),
                                                     "sigma2": v["sigma2"]} for k, v in results.items()}}, f, indent=1)
    print(f"wrote {args.plot}" + (f" and {args.json}" if args.json else ""))
    return {"mode": mode, "curves": results}


if __name__ == "__main__":
    main()
