r"""Gallery: training curves of MPT vs the LML (paper Fig. 2 and Fig. 3), from the example scripts.

Runs three examples in-process and records their numbers in RESULTS.md:

* Fig. 2 -- ``ppca_mpt_vs_elbo.py``: PPCA (``N = 2000``, ``D = 10``, ``K = 2``,
  data drawn from the model with independent noise per token), five
  initializations per method, one random mask per datapoint and epoch; per
  epoch the negative MPT loss and the exact LML, the LML of the generating
  parameters dashed. The paper's panels are "MPT uniform" (mask sizes
  unfixed) and "MPT fixed 20%"; the figure also shows "all", "order" and the
  ELBO, and the exact LML of every run minus the maximum-likelihood LML.
  -> ``fig2_training.png``
* Fig. 3 (top) -- ``linear_vae.py``: linear VAE with a Bernoulli likelihood
  (K = 2), MPT with quadrature conditionals vs the ELBO, LML by quadrature.
  Offline data: scikit-learn's 8x8 digits (1797 images, D = 64), not the
  paper's 2000 MNIST / Fashion-MNIST images (``--vae-dataset mnist`` when
  torchvision and the network are available). -> ``fig3_linear_vae.png``
* Fig. 3 (bottom) -- ``deep_vae.py``: an MLP VAE with a Gaussian likelihood
  (the paper's), MPT with a fixed 33 % mask (recursive encoding-decoding
  conditionals) and with uniform sizes vs the ELBO, held-out LML by importance
  sampling with the encoder as proposal; digits offline (the paper: MNIST).
  Twice: in the paper's setting, encoder and decoder trained through the MPT
  loss (-> ``fig3_deep_vae.png``), and with the encoder trained by the ELBO
  alongside the MPT-trained decoder (-> ``fig3_deep_vae_elbo_encoder.png``),
  since encode-decode conditionals and the evaluation both lean on the encoder
  as a posterior approximation, which the MPT loss does not ask it to be.

Run ``python examples/gallery_training.py`` (about 10 minutes on 2 CPU cores, 7 of
them the linear VAE; each section's time is in RESULTS.md) or
``--quick`` (each example's reduced setting).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling examples

from gallery_common import add_out_dir, compact_png, resolve_out_dir  # noqa: E402
from gallery_report import fig2_markdown, fig3_markdown, settings_markdown, update_results  # noqa: E402

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="each example's reduced setting (CI)")
    add_out_dir(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-dataset", default="digits", choices=["digits", "mnist", "fashion-mnist"],
                   help="data of the two VAE examples (mnist / fashion-mnist need torchvision and the network)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's Fig. 3: linear VAE on 2000 MNIST and 2000 Fashion-MNIST images, deep VAE on "
                        "MNIST (torchvision and the network needed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of every example (default 1: tiny tensors, shared machines)")
    args = p.parse_args(argv)
    resolve_out_dir(args)
    if args.paper:
        if args.quick:
            p.error("--paper and --quick exclude each other")
        args.vae_dataset = "mnist"
    os.makedirs(args.out_dir, exist_ok=True)
    import deep_vae
    import linear_vae
    import ppca_mpt_vs_elbo

    quick = ["--quick"] if args.quick else []
    seed = ["--seed", str(args.seed), "--threads", str(args.threads)]
    results_md = os.path.join(args.out_dir, "RESULTS.md")
    out = {"png": []}

    t0 = time.time()
    png = os.path.join(args.out_dir, "fig2_training.png")
    out["fig2"] = ppca_mpt_vs_elbo.main(quick + seed + ["--no-progress", "--out", png])
    update_results(results_md, "fig2", fig2_markdown(out["fig2"], time.time() - t0))
    out["png"].append(png)

    t0 = time.time()
    png = os.path.join(args.out_dir, "fig3_linear_vae.png")
    out["linear_vae"] = linear_vae.main(quick + seed + ["--no-progress", "--dataset", args.vae_dataset, "--out", png])
    out["png"].append(png)
    if args.paper:  # the paper's second panel
        png = os.path.join(args.out_dir, "fig3_linear_vae_fashion_mnist.png")
        out["linear_vae_fashion"] = linear_vae.main(seed + ["--no-progress", "--dataset", "fashion-mnist", "--out", png])
        out["png"].append(png)
    lin_seconds = time.time() - t0

    t0 = time.time()
    deep_runs = {}
    for encoder, name in (("mpt", "fig3_deep_vae.png"), ("elbo", "fig3_deep_vae_elbo_encoder.png")):
        png = os.path.join(args.out_dir, name)
        deep_data = "digits" if args.vae_dataset == "digits" else "mnist"  # the paper's deep VAE is on MNIST
        deep_args = quick + seed + ["--dataset", deep_data, "--likelihood", "gaussian",
                                    "--mpt-encoder", encoder, "--out", png]
        if args.vae_dataset != "digits":
            deep_args += ["--n-train", "2000"]
        deep_runs[encoder] = (deep_vae.main(deep_args), vars(deep_vae.parse_args(deep_args)))
        out["png"].append(png)
    out["deep_vae"] = deep_runs["mpt"][0]
    out["deep_vae_elbo_encoder"] = deep_runs["elbo"][0]
    deep_seconds = time.time() - t0

    update_results(results_md, "fig3", fig3_markdown(out, deep_runs, args, lin_seconds, deep_seconds))
    update_results(results_md, "settings", settings_markdown())
    for png in out["png"]:
        compact_png(png)  # the examples save at 120 dpi in full colour
    print(f"wrote {', '.join(out['png'])} and {results_md}")
    return out


if __name__ == "__main__":
    main()
