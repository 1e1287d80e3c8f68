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

Run ``python examples/gallery_training.py`` (3-4 minutes on 2 CPU cores) or
``--quick`` (each example's reduced setting).
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling examples

from gallery_common import compact_png, settings_markdown, update_results  # noqa: E402

#: the paper's Fig. 2 and Fig. 3 give curves, not numbers: what they show
PAPER_FIG2 = {
    "MPT uniform": "negative MPT loss centred on the LML; exact LML converges to the GT LML",
    "MPT fixed 20%": "negative MPT loss converges to a biased value, the same from every initialization; "
                     "exact LML still maximized, converges to the GT LML",
}

#: the authors' own Fig. 2 script (their data: one noise draw per datapoint broadcast to all tokens, GT LML
#: -6.25), as run by the project's reviewers: final exact LML per method
AUTHORS_SCRIPT_FIG2 = {
    "MPT uniform": "final LML -6.23, above the GT LML -6.25 (the broadcast noise)",
    "MPT fixed 20%": "final LML -6.55 … -6.87, 0.30–0.62 short of the GT LML -6.25",
}


def fig2_markdown(results, seconds=None):
    """The Fig. 2 section of RESULTS.md from the results of ``ppca_mpt_vs_elbo.main``."""
    cfg, true, ml = results["config"], results["true_lml"], results["ml_lml"]
    md = ["## Fig. 2: PPCA training curves (`examples/ppca_mpt_vs_elbo.py`)", "",
          f"Settings: {'--quick' if cfg['quick'] else 'default'}; N={cfg['num_data']}, D=10, K=2, noise std 0.5, data "
          f"drawn from the model; {cfg['inits']} initializations per method, {cfg['epochs']} full-batch epochs, Adam "
          f"lr={cfg['lr']} decayed 10x, one mask per datapoint and epoch (the paper's P=1); seed {cfg['seed']}"
          + (f"; {seconds:.0f} s." if seconds is not None else "."), "",
          "![Fig. 2](fig2_training.png)", "",
          f"Per datapoint: LML of the generating parameters (GT, dashed in the figure) {true:.4f}, closed-form "
          f"maximum-likelihood LML {ml:.4f}. Final values, mean ± std over initializations; 'objective - LML' is the "
          "training objective (mean over the last 10 % of epochs) minus the exact LML at the end.", "",
          "| method | final exact LML | LML - ML LML | LML - GT LML | objective - LML | paper | authors' script |",
          "|---|---|---|---|---|---|---|"]
    for name, r in results["methods"].items():
        f = np.asarray(r["final_lml"])
        gap = np.asarray(r["final_objective"]) - f
        md.append(f"| {name} | {f.mean():.4f} ± {f.std(ddof=1) if f.size > 1 else 0:.4f} | {(f - ml).mean():+.4f} | "
                  f"{(f - true).mean():+.4f} | {gap.mean():+.3f} ± {gap.std(ddof=1) if gap.size > 1 else 0:.3f} | "
                  f"{PAPER_FIG2.get(name, '(not in the paper)')} | {AUTHORS_SCRIPT_FIG2.get(name, '')} |")
    fixed = results["methods"].get("MPT fixed 20%")
    short = f" ({np.mean(np.asarray(fixed['final_lml']) - ml):+.2f} nats from the ML LML in this run)" if fixed else ""
    md += ["", "The fixed 20 % objective settles at a biased value from every initialization, as in the paper. Its "
           f"exact LML rises too but stops short of the ML value{short}: with most tokens in context the objective "
           "is nearly flat in the scale of W (the docstring of `ppca_mpt_vs_elbo.py`). The paper's figure seems to "
           "show it reaching the ground truth, but the authors' own script stops short as well (-6.55 … -6.87 "
           "against -6.25, the authors'-script column). Their unfixed runs end *above* their ground truth (-6.23 "
           "against -6.25) because their data carry one noise draw per datapoint broadcast to all tokens, which "
           "their LML does not assume, so the generating parameters are not the best fit; our data are drawn from "
           "the model, and the unbiased runs end at the ML LML, within noise of the GT."]
    return "\n".join(md)


def linear_vae_markdown(results):
    """The Fig. 3 (top) part of RESULTS.md from the results of ``linear_vae.main``."""
    cfg = results["config"]
    md = [f"Fig. 3 (top), linear VAE (`examples/linear_vae.py`): {cfg['dataset']}, N={cfg['num_data']} binarized "
          f"images, D={cfg['num_tokens']}, K=2, full-batch epochs: {cfg['epochs']} for MPT (masks={cfg['masks']!r} x"
          f"{cfg['num_masks']} with quadrature conditionals), {cfg['elbo_epochs']} for the ELBO, which climbs more "
          f"slowly (`--elbo-epochs`); LML by adaptive quadrature.", "",
          f"| method | LML at epoch 0 | LML at epoch {cfg['epochs']} | final LML (epoch) | final objective | paper |",
          "|---|---|---|---|---|---|"]
    paper = {"MPT": "MPT and ELBO converge to a similar LML (MNIST / FMNIST, N=2000, D=784)",
             "ELBO": "(same panel)"}
    for name, r in results["methods"].items():
        tail = r["objective"][-max(1, len(r["objective"]) // 10):].mean()
        at = r["lml"][np.searchsorted(r["lml_epochs"], min(cfg["epochs"], r["lml_epochs"][-1]))]
        md.append(f"| {name} | {r['lml'][0]:.3f} | {at:.3f} | {r['lml'][-1]:.3f} ({r['lml_epochs'][-1]}) | "
                  f"{tail:.3f} | {paper[name]} |")
    m, e = results["methods"].get("MPT"), results["methods"].get("ELBO")
    if m is not None and e is not None:
        e_at = e["lml"][np.searchsorted(e["lml_epochs"], min(cfg["epochs"], e["lml_epochs"][-1]))]
        md += ["", f"At equal epochs ({cfg['epochs']}) the ELBO's LML is {m['lml'][-1] - e_at:.3f} nats below MPT's; run "
               f"to epoch {e['lml_epochs'][-1]} it ends {e['lml'][-1] - m['lml'][-1]:+.3f} nats from MPT's final LML."]
    if cfg["dataset"] == "digits":
        md += ["", "Offline data: scikit-learn's 8x8 digits, not the paper's MNIST / Fashion-MNIST subsets, so the "
               "values are not comparable with the paper's; the pattern is: both raise the LML from the same start "
               "and their objectives track it (the negative MPT loss around it, the ELBO below it)."]
    return "\n".join(md)


def deep_vae_markdown(result, args):
    """The Fig. 3 (bottom) part of RESULTS.md from the :class:`~pyro_mpt.experiments.compare.Comparison` of ``deep_vae.main``."""
    s = result.settings
    md = [f"Fig. 3 (bottom), deep VAE (`examples/deep_vae.py`): {args['dataset']} ({args['likelihood']} likelihood), "
          f"MPT encoder trained by {args['mpt_encoder'].upper()}, {s['num_train']} training / {s['num_test']} held-out images, K={args['latent_dim']}, {s['epochs']} epochs, "
          f"minibatches of {s['batch_size']}; held-out LML by importance sampling with the encoder as proposal "
          f"({s['final_samples']} samples at the end).", "",
          "| loss | held-out LML at first evaluation | final held-out LML (± s.e.) | minus ELBO's (paired s.e.) "
          "| paper |",
          "|---|---|---|---|---|"]
    paper = {"mpt:0.33": "33 % masks: held-out LML maximized along with the MPT objective (MNIST, Gaussian)"}
    ok = {r.name for r in result.results if r.error is None and r.values}
    below = []
    for r in result.results:
        if r.error is not None:
            md.append(f"| {r.name} | failed: {r.error} | | | |")
            continue
        first = next(h["heldout"] for h in r.history if "heldout" in h)
        diff = ""
        if r.name != "elbo" and {"elbo", r.name} <= ok:
            d, se = result.paired(r.name, "elbo")
            diff = f"{d:+.3f} ({se:.3f})"
            below.append(d < -2 * se)
        md.append(f"| {r.name} | {first:.3f} | {r.heldout:.3f} ± {r.stderr:.3f} | {diff} | {paper.get(r.name, '')} |")
    if args["dataset"] == "digits":
        data = "binarized 8x8 digits" if args["likelihood"] == "bernoulli" else "8x8 digits scaled to [0, 1]"
        md += ["", f"Offline data ({data}) and a small network: not comparable with the paper's values, "
               "only the pattern: every loss raises the held-out LML along with its objective."
               + (" Here the ELBO-trained model ends highest (the MPT rows' paired differences are more than 2 s.e. "
                  "below zero)." if below and all(below) else "")]
    return "\n".join(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="each example's reduced setting (CI)")
    p.add_argument("--out-dir", default="docs/gallery")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-dataset", default="digits", choices=["digits", "mnist", "fashion-mnist"],
                   help="data of the two VAE examples (mnist / fashion-mnist need torchvision and the network)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's Fig. 3: linear VAE on 2000 MNIST and 2000 Fashion-MNIST images, deep VAE on "
                        "MNIST (torchvision and the network needed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of every example (default 1: tiny tensors, shared machines)")
    args = p.parse_args(argv)
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

    md = ["## Fig. 3: linear and deep VAEs, MPT vs the ELBO (`examples/linear_vae.py`, `examples/deep_vae.py`)", "",
          f"Settings: {'--quick' if args.quick else ('--paper' if args.paper else 'default')} settings of both examples; seed {args.seed}; "
          f"{lin_seconds:.0f} s and {deep_seconds:.0f} s.", "",
          "![Fig. 3 top](fig3_linear_vae.png)", "", linear_vae_markdown(out["linear_vae"]), ""]
    if "linear_vae_fashion" in out:
        md += ["![Fig. 3 top, Fashion-MNIST](fig3_linear_vae_fashion_mnist.png)", "",
               linear_vae_markdown(out["linear_vae_fashion"]), ""]
    md += [
          "Deep VAE in the paper's setting: Gaussian likelihood, encoder and decoder trained through the MPT loss "
          "(`--mpt-encoder mpt`).", "",
          "![Fig. 3 bottom](fig3_deep_vae.png)", "", deep_vae_markdown(*deep_runs["mpt"]), "",
          "The same with the encoder of the MPT runs trained by the ELBO alongside (`--mpt-encoder elbo`): the MPT "
          "loss asks the encoder only for good masked conditionals, while the held-out LML is estimated by "
          "importance sampling with the encoder as proposal, so an MPT-trained encoder can make the evaluation, "
          "not the model, look worse. Both rows are shown so the model's quality can be told apart from the "
          "proposal's.", "",
          "![Fig. 3 bottom, ELBO encoder](fig3_deep_vae_elbo_encoder.png)", "", deep_vae_markdown(*deep_runs["elbo"])]
    update_results(results_md, "fig3", "\n".join(md))
    update_results(results_md, "settings", settings_markdown())
    for png in out["png"]:
        compact_png(png)  # the examples save at 120 dpi in full colour
    print(f"wrote {', '.join(out['png'])} and {results_md}")
    return out


if __name__ == "__main__":
    main()
