"""Deep VAE trained with masked pre-training vs the ELBO (paper Fig. 3, bottom row).

A VAE with MLP encoder and decoder (``pyro_mpt.experiments.vae.DeepVAE``) is trained on
binarized ``load_digits`` (Bernoulli pixels, D = 64) by

* MPT with a fixed 33 % mask (the paper's setting) -- masked conditionals by
  recursive encoding–decoding (``conditionals="encode_decode"``);
* MPT with uniformly random mask sizes (the unbiased schedule);
* the ELBO (``Trace_ELBO``),

from the same initialization with the same minibatches, and the
importance-sampled log-marginal likelihood of held-out images is tracked every
few epochs (``Evidence(method="importance")`` with the guide as proposal). MPT
trains the decoder; the encoder, which encode–decode and the evaluation use as
the posterior approximation, is trained by the ELBO alongside
(``--mpt-encoder mpt`` trains it through the MPT loss instead).

The figure shows the objectives per datapoint (light: the negative losses, i.e.
the ELBO and the MPT scores) and the held-out LML (dark), like Fig. 3 (bottom).

Usage::

    python examples/deep_vae.py                 # about 2-3 minutes on one CPU core
    python examples/deep_vae.py --quick         # a smoke run, < 30 s
    python examples/deep_vae.py --dataset mnist --likelihood gaussian --n-train 2000
"""

import argparse
import os
import sys

import torch

from pyro_mpt.experiments.compare import compare
from pyro_mpt.experiments.datasets import load_dataset
from pyro_mpt.experiments.vae import DeepVAE

LABELS = {"mpt:0.33": "MPT (33% masks)", "mpt:uniform": "MPT (uniform sizes)", "elbo": "ELBO (VI)"}
COLORS = {"mpt:0.33": "tab:red", "mpt:uniform": "tab:orange", "elbo": "tab:blue"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    p.add_argument("--likelihood", default="bernoulli", choices=["bernoulli", "gaussian"])
    p.add_argument("--latent-dim", type=int, default=5)
    p.add_argument("--hidden", type=int, nargs="+", default=[128])
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--final-samples", type=int, default=2000)
    p.add_argument("--num-samples", type=int, default=8, help="S: encoder draws per masked conditional")
    p.add_argument("--num-iterations", type=int, default=5, help="T: encode-decode rounds")
    p.add_argument("--mpt-encoder", default="elbo", choices=["elbo", "mpt"],
                   help="how the MPT runs train the encoder: alongside by the ELBO, or through the MPT loss "
                        "(the paper's setting: encoder and decoder trained by MPT with recursive encoding-decoding)")
    p.add_argument("--methods", nargs="+", default=["mpt:0.33", "mpt:uniform", "elbo"],
                   help="losses to compare (default: MPT with 33 %% masks, MPT with uniform sizes, the ELBO)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="deep_vae.png", help="where to save the figure ('' to skip)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test (< 30 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.n_train = args.n_train or 300
        args.epochs = min(args.epochs, 4)
        args.eval_every = 2
        args.eval_samples = 50
        args.final_samples = 100
        args.num_samples = 4
        args.num_iterations = 2
    return args


def plot(result, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in result.results:
        if r.error is not None or not r.history:
            continue
        color = COLORS.get(r.name, None)
        label = LABELS.get(r.name, r.name)
        epochs = [h["epoch"] for h in r.history]
        axes[0].plot(epochs, [-h["loss"] for h in r.history], color=color, alpha=0.35, lw=3, label=f"{label}: objective")
        ev = [h for h in r.history if "heldout" in h]
        xs = [h["epoch"] for h in ev]
        ys = torch.tensor([h["heldout"] for h in ev])
        se = torch.tensor([h["stderr"] for h in ev])
        for ax in axes:
            ax.plot(xs, ys, color=color, lw=2, label=f"{label}: held-out LML" if ax is axes[0] else label)
        axes[1].fill_between(xs, ys - se, ys + se, color=color, alpha=0.2)
    fig.suptitle(title)
    axes[0].set_title("objectives (light) and held-out LML (dark)")
    axes[1].set_title("held-out LML (importance sampled) ± s.e.")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.set_ylabel("nats per datapoint")
        ax.grid(alpha=0.3)
    lml = [h["heldout"] for r in result.results if r.error is None for h in r.history if "heldout" in h]
    if lml:
        top = max(lml)
        axes[1].set_ylim(top - 0.25 * (top - min(lml)) - 1.0, top + 0.5)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    """Run the experiment; returns the :class:`~pyro_mpt.experiments.compare.Comparison`."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    train, test = load_dataset(
        args.dataset, binarize=args.likelihood == "bernoulli", n_train=args.n_train, n_test=args.n_test, seed=args.seed
    )
    D = train.shape[1]
    print(
        f"{args.dataset}: {train.shape[0]} training / {test.shape[0]} held-out images, D={D}, "
        f"K={args.latent_dim}, {args.likelihood} likelihood, {args.epochs} epochs"
    )

    def make_model():
        return DeepVAE(D, args.latent_dim, tuple(args.hidden), args.likelihood)

    result = compare(
        make_model, train, test, list(args.methods),
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
        eval_samples=args.eval_samples, final_samples=args.final_samples, seed=args.seed,
        mpt_encoder=args.mpt_encoder,
        engine_options={"num_samples": args.num_samples, "num_iterations": args.num_iterations},
        log=lambda s: print(s, flush=True),
    )
    print()
    print(f"Final held-out log p(x) per image ({args.final_samples} importance samples each):")
    print(result.table())
    if args.out:
        title = f"Deep VAE, {args.dataset} ({args.likelihood}), K={args.latent_dim}"
        plot(result, args.out, title)
        print(f"saved {os.path.abspath(args.out)}")
    return result


if __name__ == "__main__":
    main()
