r"""Linear VAE on binarized images: masked pre-training (MPT) vs the ELBO, judged by the LML.

Reproduces the experiment of Fig. 3 (top row) of Moreno-Muñoz, Recasens & Hauberg,
"On Masked Pre-training and the Marginal Likelihood" (NeurIPS 2023): a *linear
VAE* (Lucas et al., 2019) with a Bernoulli likelihood,

.. math::

    z_i \sim \mathcal N(0, I_2), \qquad
    x_{id} \mid z_i \sim \operatorname{Bernoulli}\big(\sigma(w_d^\top z_i + b_d)\big),
    \quad d = 1, \dots, D,

trained on binarized images from the same initialization in two ways:

* **MPT** -- ``MaskedPretrainingLoss(conditionals="quadrature")``: the masked
  conditionals :math:`\log p(x_j \mid x_{\mathcal R})` integrate the two latents
  out numerically (adaptive Gauss–Hermite quadrature centred on each image's
  posterior), with one random mask of uniformly random size per image and epoch
  (``--masks uniform``, an unbiased estimate of the LML; ``--masks order`` is
  the chain rule along one random ordering, exact for quadrature conditionals);
  no guide is needed.
* **ELBO** -- ``Trace_ELBO`` with an amortized Gaussian guide (an MLP encoder
  :math:`x \mapsto (\mu(x), \sigma(x))`, one hidden layer of 256 units), the
  standard variational-inference training of a VAE.

Both runs are judged by the log-marginal likelihood of the training images,
:math:`\log p(x) = \sum_i \log \int p(z) \prod_d p(x_{id} \mid z)\, dz`, computed
by quadrature (``Evidence(model, method="quadrature")``, adaptive grid, with an
error estimate from a second, coarser grid) every ``--eval-every`` epochs.

Data (``--dataset``):

* ``digits`` (default): scikit-learn's bundled 8x8 handwritten digits
  (``sklearn.datasets.load_digits``; 1797 images, D = 64), pixels scaled to
  [0, 1] and thresholded at 0.5; works offline.
* ``mnist`` / ``fashion-mnist``: 28x28 images from ``torchvision.datasets``
  (downloaded to ``--root``; needs torchvision and a network connection the
  first time), thresholded at 0.5, a random subset of ``--num-data`` = 2000
  training images as in the paper (D = 784).

Outputs: the final LML of both methods (per image and in total), and a PNG in
the style of Fig. 3 (top): the training objective (negative MPT loss, or the
ELBO; light lines) and the LML (dark lines with markers) per image against the
epoch, for both methods.

Choices: full-batch steps (one SVI step per epoch) with Adam, the learning
rate decayed 10x over the run (``--lr`` 0.1 for MPT, ``--lr-elbo`` 0.01 for the
ELBO), float32, the same decoder initialization for both (W ~ 0.1 N(0, 1), b at
the logits of the pixel means). The ELBO needs the smaller rate: on digits, from
this initialization, Adam at 0.02 or more drives W to ~0 within 100 epochs (the
posterior-collapse optimum: the LML then stays at the independent-pixel value,
about -24.4 nats per image), whereas 0.01 escapes it. On one CPU core an MPT
epoch costs about 0.2 s on digits at the start and 1.1-1.4 s once the decoder
has trained (the quadrature table has 1797 x 64 nodes x 64 tokens, each masked
image's context grid as many, and as the decoder sharpens, more masked pixels
get grids of their own: docs/quadrature.md, "Context grids"), and about 13 s at
the start on 2000 MNIST images (2000 x 64 x 784; not measured trained); an ELBO
epoch costs a few milliseconds. Run ``python examples/linear_vae.py`` (digits,
about 7 minutes on one CPU core: 445 s in the gallery's last run, beside other
work) or add ``--quick`` for a reduced setting used by the tests.

What to expect on digits (measured): both objectives track the LML (the
negative MPT loss is an unbiased estimate of it, noisy with one mask per image;
the ELBO a lower bound, 0.01-0.05 nats below it here). MPT reaches its final
LML, about -21.88 nats per image, within ~100 epochs; the ELBO climbs more
slowly, to about -21.88 after its default 2000 epochs, in line with the paper, where both methods converge to a similar LML.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import ExponentialLR
from tqdm.auto import tqdm

from pyro_mpt import Evidence, MaskedPretrainingLoss

NUM_LATENTS = 2
DTYPE = torch.float32
DEFAULTS = dict(epochs=300, eval_every=10, elbo_epochs=2000)
QUICK = dict(epochs=30, eval_every=10, num_data=300, elbo_epochs=60)
DATASETS = ("digits", "mnist", "fashion-mnist")


# ---------------------------------------------------------------------- data
class DataUnavailable(RuntimeError):
    """The requested dataset cannot be loaded here (missing package or no network)."""


def load_images(name, num_data, seed, root):
    """Binarized images as a float tensor ``(N, D)`` of zeros and ones.

    :param str name: ``"digits"``, ``"mnist"`` or ``"fashion-mnist"``.
    :param int num_data: keep a random subset of this many images (None: all
        1797 digits, or 2000 MNIST images as in the paper).
    :raises DataUnavailable: when torchvision is missing or the download fails.
    """
    if name == "digits":
        from sklearn.datasets import load_digits

        x = torch.as_tensor(load_digits().data, dtype=torch.float64) / 16.0
    else:
        try:
            import torchvision
        except ImportError:
            raise DataUnavailable(
                f"--dataset {name} needs torchvision, which is not installed: "
                f"pip install torchvision (or pip install pyro-mpt[vision]), or run "
                f"with the default --dataset digits (scikit-learn, offline)."
            ) from None
        cls = torchvision.datasets.MNIST if name == "mnist" else torchvision.datasets.FashionMNIST
        root = os.path.expanduser(root)
        try:
            data = cls(root, train=True, download=True)
        except Exception as e:  # no network, proxy, disk...
            raise DataUnavailable(
                f"could not load {name} with torchvision into {root!r} "
                f"({type(e).__name__}: {e}). Download it once where the network "
                f"allows (the same command), pass --root to where the files are, or "
                f"run with --dataset digits."
            ) from e
        x = data.data.reshape(data.data.shape[0], -1).to(torch.float64) / 255.0
        num_data = 2000 if num_data is None else num_data
    if num_data is not None and num_data < x.shape[0]:
        g = torch.Generator().manual_seed(seed)
        x = x[torch.randperm(x.shape[0], generator=g)[:num_data]]
    return (x > 0.5).to(DTYPE)


# ---------------------------------------------------------------------- model and guide
def linear_vae(x):
    """The linear VAE decoder; its parameters are set by :func:`init_params`."""
    W = pyro.param("W")
    b = pyro.param("b")
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([NUM_LATENTS]).to_event(1))
        pyro.sample("x", dist.Bernoulli(logits=z @ W.T + b).to_event(1), obs=x)


class Encoder(torch.nn.Module):
    """Amortized Gaussian posterior ``q(z | x) = N(mu(x), diag(sigma(x)^2))``."""

    def __init__(self, D, K, hidden=256):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(D, hidden), torch.nn.Softplus(), torch.nn.Linear(hidden, 2 * K)
        )
        self.K = K

    def forward(self, x):
        h = self.net(x)
        return h[..., : self.K], torch.nn.functional.softplus(h[..., self.K :]) + 1e-4


def make_guide(D, seed):
    torch.manual_seed(seed)
    encoder = Encoder(D, NUM_LATENTS).to(DTYPE)

    def guide(x):
        pyro.module("encoder", encoder)
        loc, scale = encoder(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return guide


def init_params(x, seed):
    """The same starting decoder for both methods: small random W, b at the pixel logits."""
    g = torch.Generator().manual_seed(seed)
    D = x.shape[1]
    pyro.clear_param_store()
    mean = x.mean(0).clamp(0.01, 0.99)
    pyro.param("W", 0.1 * torch.randn(D, NUM_LATENTS, generator=g).to(DTYPE))
    pyro.param("b", (mean.log() - (1 - mean).log()).to(DTYPE))


# ---------------------------------------------------------------------- training
def lml(x, evidence):
    """Quadrature LML per image (mean) and its largest per-image error estimate."""
    with torch.no_grad():
        result = evidence.estimate(x)
    return float(result.log_evidence.double().mean()), float(result.stderr.max())


def train(x, method, args, bar):
    """One run from the parameters in the store; returns the curves.

    ``objective[t]`` is the training objective per image at the parameters
    before update ``t`` (what ``svi.step`` reports); ``lml_epochs`` and ``lml``
    the LML per image at the epochs where it was evaluated.
    """
    N, D = x.shape
    epochs = args.epochs if method == "MPT" else args.elbo_epochs
    # the same number of LML evaluations for both runs, however long each is
    eval_every = max(1, round(args.eval_every * epochs / args.epochs))
    pyro.set_rng_seed(args.seed + 1)
    if method == "MPT":
        guide = lambda x: None  # noqa: E731 -- the latents are integrated out
        loss = MaskedPretrainingLoss(
            conditionals="quadrature", masks=args.masks, num_masks=args.num_masks,
            **({"num_nodes": args.num_nodes} if args.num_nodes else {}),
        )
    else:
        guide, loss = make_guide(D, args.seed + 2), Trace_ELBO()
    gamma = 0.1 ** (1.0 / max(epochs, 1))
    lr = args.lr if method == "MPT" else args.lr_elbo
    optim = ExponentialLR({"optimizer": torch.optim.Adam, "optim_args": {"lr": lr}, "gamma": gamma})
    svi = SVI(linear_vae, guide, optim, loss=loss)
    # warn_tol=None: the per-image error estimate is the table's "LML error" column (warned at every
    # evaluation, 50 warnings a default run, each with its own numbers)
    evidence = Evidence(linear_vae, method="quadrature", warn_tol=None,
                        **({"num_nodes": args.num_nodes} if args.num_nodes else {}))
    objective = np.empty(epochs)
    lml_epochs, lml_values, lml_errors = [], [], []
    start = time.perf_counter()
    train_seconds = 0.0
    for t in range(epochs + 1):
        if t % eval_every == 0 or t == epochs:
            value, error = lml(x, evidence)
            lml_epochs.append(t)
            lml_values.append(value)
            lml_errors.append(error)
        if t == epochs:
            break
        tick = time.perf_counter()
        objective[t] = -svi.step(x) / N
        train_seconds += time.perf_counter() - tick
        optim.step()
        bar.update(1)
    return {
        "objective": objective,
        "lml_epochs": np.asarray(lml_epochs),
        "lml": np.asarray(lml_values),
        "lml_error": float(max(lml_errors)),
        "seconds": time.perf_counter() - start,
        "seconds_per_epoch": train_seconds / max(epochs, 1),
    }


# ---------------------------------------------------------------------- plotting
def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    colors = {"MPT": "tab:blue", "ELBO": "tab:orange"}
    labels = {"MPT": "negative MPT loss", "ELBO": "ELBO"}
    methods = results["methods"]
    top = max(max(r["lml"].max(), r["objective"].max()) for r in methods.values())
    for ax, zoom in zip(axes, (False, True)):
        lows = []
        for name, r in methods.items():
            c = colors[name]
            epochs = np.arange(len(r["objective"]))
            ax.plot(epochs, r["objective"], color=c, alpha=0.35, lw=1.0, label=f"{name}: {labels[name]}")
            ax.plot(r["lml_epochs"], r["lml"], color=c, lw=2.0, marker="o", ms=3, label=f"{name}: LML (quadrature)")
            # the first epochs of the ELBO (an untrained encoder) are far below: clip them
            skip = max(1, len(r["objective"]) // 5) if zoom else min(len(r["objective"]) - 1, 2)
            lows += [np.percentile(r["objective"][skip:], 1), r["lml"].min()]
        ax.set_ylim(min(lows) - (0.3 if zoom else 1.0), top + (0.2 if zoom else 0.5))
        if zoom:
            ax.set_title("zoom")
        else:
            ax.set_title(f"linear VAE, {cfg['dataset']}: N={cfg['num_data']}, D={cfg['num_tokens']}, K={NUM_LATENTS}")
        ax.set_xlabel("epoch (full-batch step)")
        ax.set_ylabel("nats per image")
        ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- entry point
def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="image data (default digits, offline)")
    p.add_argument("--num-data", type=int, help="images N (default: all 1797 digits; 2000 MNIST images; quick 300)")
    p.add_argument("--epochs", type=int, help=f"full-batch SVI steps per method (default {DEFAULTS['epochs']}, quick {QUICK['epochs']})")
    p.add_argument("--elbo-epochs", type=int,
                   help="full-batch SVI steps of the ELBO run, which climbs more slowly: run to convergence "
                        f"(default {DEFAULTS['elbo_epochs']}, quick {QUICK['elbo_epochs']}; the ELBO's LML at --epochs "
                        "is reported too)")
    p.add_argument("--eval-every", type=int, help="MPT epochs between LML evaluations (default 10; the ELBO run "
                                                   "evaluates as often in proportion)")
    p.add_argument("--lr", type=float, default=0.1, help="initial Adam learning rate of MPT, decayed 10x over the run (default 0.1)")
    p.add_argument("--lr-elbo", type=float, default=0.01, help="initial Adam learning rate of the ELBO run, decayed 10x (default 0.01)")
    p.add_argument("--masks", default="uniform", help="MPT mask schedule: uniform (default), stratified, all, order, or a rate")
    p.add_argument("--num-masks", type=int, default=1, help="MPT masks per image and epoch (default 1)")
    p.add_argument("--num-nodes", type=int, help="quadrature nodes per latent dim (default: the engine's, 8 adaptive)")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset, initialization and masks (default 0)")
    p.add_argument("--root", default="~/.cache/pyro_mpt", help="torchvision download folder for MNIST / Fashion-MNIST")
    p.add_argument("--out", help="PNG of the training curves (default outputs/linear_vae_<dataset>.png)")
    p.add_argument("--quick", action="store_true", help="reduced setting for tests (N=300, 30 epochs)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.epochs < 1 or args.elbo_epochs < 1 or args.eval_every < 1 or args.num_masks < 1:
        p.error("--epochs, --elbo-epochs, --eval-every and --num-masks must be >= 1")
    try:
        args.masks = float(args.masks)
    except ValueError:
        pass
    if args.out is None:
        args.out = os.path.join("outputs", f"linear_vae_{args.dataset}.png")
    return args


def run(args):
    x = load_images(args.dataset, args.num_data, args.seed, args.root)
    N, D = x.shape
    config = {k: getattr(args, k) for k in ("dataset", "epochs", "elbo_epochs", "lr", "lr_elbo", "masks", "num_masks", "num_nodes", "seed", "out", "quick")}
    config.update(num_data=N, num_tokens=D)
    results = {"config": config, "methods": {}}
    with tqdm(total=args.epochs + args.elbo_epochs, desc="training", unit="epoch", disable=args.no_progress, file=sys.stderr) as bar:
        for method in ("MPT", "ELBO"):
            bar.set_postfix_str(method)
            init_params(x, args.seed)
            results["methods"][method] = train(x, method, args, bar)
    return results


def print_table(results):
    cfg = results["config"]
    N = cfg["num_data"]
    print()
    print(
        f"linear VAE (Bernoulli), {cfg['dataset']}: N={N} images, D={cfg['num_tokens']} pixels, "
        f"K={NUM_LATENTS}; {cfg['epochs']} (MPT) / {cfg['elbo_epochs']} (ELBO) full-batch epochs, Adam lr={cfg['lr']} (MPT) / "
        f"{cfg['lr_elbo']} (ELBO), decayed 10x; "
        f"MPT masks={cfg['masks']!r} x{cfg['num_masks']}"
    )
    head = f"{'method':<8}{'final LML / image':>19}{'total LML':>14}{'final objective':>18}{'LML error':>11}{'s/epoch':>9}"
    print(head)
    print("-" * len(head))
    for name, r in results["methods"].items():
        final = r["lml"][-1]
        tail = r["objective"][-max(1, len(r["objective"]) // 10):].mean()
        print(
            f"{name:<8}{final:>19.4f}{final * N:>14.1f}{tail:>18.4f}{r['lml_error']:>11.1e}"
            f"{r['seconds_per_epoch']:>9.3f}"
        )
    print("-" * len(head))
    print("LML: log p(x) of the training images by adaptive quadrature; 'LML error' is the largest")
    print("per-image difference between two node counts. 'final objective': negative MPT loss or ELBO")
    print("per image, averaged over the last 10% of epochs.")


def main(argv=None):
    """Run the comparison; returns the results dict (curves per method)."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        results = run(args)
    except DataUnavailable as e:
        print(f"linear_vae.py: {e}", file=sys.stderr)
        raise SystemExit(2)
    finally:
        torch.set_num_threads(threads)
    out_dir = os.path.dirname(args.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    plot(results, args.out)
    results["seconds"] = time.perf_counter() - start
    print_table(results)
    print(f"saved {args.out}; total {results['seconds']:.1f} s")
    return results


if __name__ == "__main__":
    main()
