r"""Gallery: MPT curves of pre-trained vs randomly initialized transformers (paper Fig. 5 right, Table 2, Fig. 6).

Runs two examples in-process and records their numbers in RESULTS.md beside
the paper's:

* Fig. 5 (right) / Table 2 -- ``bert_glue_curves.py``: the mean masked-token
  log-probability at every masking rate 1 %..99 % for a pre-trained masked LM
  and a random initialization of the same architecture, and the paper's
  Table 2 area (sum over the 99 rates x 0.01 x 512).
  -> ``fig5_right_mlm_curves.png``
* Fig. 6 -- ``vit_mae_curves.py``: ViT-MAE curves (MSE of the masked patches and
  the Gaussian log-density it implies) at masking rates 5 %..95 %.
  -> ``fig6_vit_mae_curves.png``

**Offline by default**, so that ``make gallery`` runs anywhere in minutes:
the paper's models and data (``bert-base-uncased`` on four GLUE sets,
``facebook/vit-mae-base`` on three image test sets) are replaced by

* AntiBERTy, the pre-trained BERT masked LM for antibody sequences shipped in
  the ``antiberty`` package, on heavy chains, light chains and residue-shuffled
  heavy chains (a control: real residues in an order the model never saw);
* a tiny ViT-MAE (8x8 images, 2x2 patches) trained here on scikit-learn's
  digits, with curves at several points of its training.

The numbers are therefore *not* comparable with the paper's; only the
pattern is (random initialization: a flat, low curve; pre-training lifts the
low-rate end and the area). ``--online`` tries the paper's models and data
from the HuggingFace hub first (falling back offline when unreachable).

Run ``python examples/gallery_adapters.py`` (about 2 minutes on 2 CPU cores) or
``--quick`` (a few sequences and training steps, CI).
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling examples

from gallery_common import compact_png, settings_markdown, update_results  # noqa: E402

PAPER_TABLE2 = {"AX": (-5245.31, -1715.75), "CoLA": (-5283.52, -1657.68), "QNLI": (-5343.98, -1770.28),
                "MRPC": (-5362.21, -1773.45)}  # (random init, pre-trained)


def table2_markdown(res, seconds=None):
    """The Fig. 5 (right) / Table 2 section of RESULTS.md from ``bert_glue_curves.main``."""
    rows, mode = res["rows"], res["mode"]
    names = list(dict.fromkeys(r["subset"] for r in rows))
    get = {(r["subset"], r["weights"]): r for r in rows}
    n, L = rows[0]["n"], rows[0]["mean_tokens"]
    md = ["## Fig. 5 (right) and Table 2: masked-LM curves (`examples/bert_glue_curves.py`)", "",
          f"Mode: **{mode}**" + (f"; {seconds:.0f} s." if seconds is not None else "."), "",
          "![Fig. 5 right](fig5_right_mlm_curves.png)", ""]
    offline = mode.startswith("OFFLINE")
    if offline:
        md += [f"Offline fallback: AntiBERTy (a 26M-parameter BERT masked LM of antibody sequences, vocabulary of "
               f"25 tokens) on {n} chains per subset of {L:.0f} residues on average (the six real chains of each kind "
               "and point-mutated variants of them, 5 % of residues, seeded), not BERT-base (30522 tokens) on GLUE. The "
               "numbers are not comparable with the paper's; the pattern is: random initialization gives a flat "
               "curve near -log(vocabulary size) and a low area, pre-training a higher curve with a long tail at "
               "high masking rates. The shuffled chains are a control: the pre-trained model is confidently wrong "
               "on residue orders it never saw, so its area falls *below* the random initialization's.", ""]
    if rows[0].get("table2_area") is None:  # a coarser rate grid than the paper's 99 rates
        md += [f"Table-2 scale: 512 x the Riemann sum of the mean masked-token log-probability over the {rows[0]['rates']} "
               "rates (1 %, 10 %, ..., 90 %, 99 %), i.e. 512 x the integral of S(r) over [0, 1], ± its standard error "
               "over chains (higher is better). On the paper's 99-rate grid this equals the paper's convention up to "
               "the two half-cells at 0-1 % and 99-100 %.", ""]
        cell = lambda r: f"{r['table2_scale_area']:.2f} ± {r['table2_scale_stderr']:.2f}"  # noqa: E731
    else:
        md += ["Table 2 convention: sum over the 99 rates of the mean masked-token log-probability x 0.01 x 512 "
               "(higher is better).", ""]
        cell = lambda r: f"{r['table2_area']:.2f}"  # noqa: E731
    md += ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for which in ("random init", "pre-trained"):
        md.append(f"| AREA / {which.upper()} (this run) | "
                  + " | ".join(cell(get[(nm, which)]) for nm in names) + " |")
    md += ["", "| paper (BERT-base on GLUE) | " + " | ".join(PAPER_TABLE2) + " |", "|---|" + "---|" * 4,
           "| AREA / RANDOM INIT. | " + " | ".join(f"{v[0]:.2f}" for v in PAPER_TABLE2.values()) + " |",
           "| AREA / PRE-TRAINED | " + " | ".join(f"{v[1]:.2f}" for v in PAPER_TABLE2.values()) + " |"]
    return "\n".join(md)


def fig6_markdown(res, seconds=None):
    """The Fig. 6 section of RESULTS.md from ``vit_mae_curves.main``."""
    mode, curves = res["mode"], res["curves"]
    md = ["## Fig. 6: ViT-MAE curves (`examples/vit_mae_curves.py`)", "",
          f"Mode: **{mode}**" + (f"; {seconds:.0f} s." if seconds is not None else "."), "",
          "![Fig. 6](fig6_vit_mae_curves.png)", ""]
    if mode.startswith("OFFLINE"):
        md += ["Offline fallback: a tiny ViT-MAE (8x8 images, 2x2 patches, 3 layers) trained here on scikit-learn's "
               "digits at masking rates drawn from 10 %..90 %, curves on held-out digits at several training steps "
               "(step 0 is the random initialization), not `facebook/vit-mae-base` on Fashion-MNIST, CIFAR-100 "
               "and Tiny-ImageNet. The numbers are not comparable with the paper's (which gives curves, no numbers); "
               "the pattern is: a flat curve at random initialization, and training lowers the error most at low "
               "masking rates, as in the paper's figure.", ""]
    from pyro_mpt.adapters.rates import rate_weights

    first = next(iter(curves.values()))
    s2, logd = first["sigma2"], first["log_density"]
    w = rate_weights(logd.rates)
    md += [f"Log-density per patch: Gaussian with sigma^2={s2:.3g} (pixels standardized); area = "
           f"{logd.num_tokens:g} patches x sum_k w_k S(r_k) over the {len(w)} rates, with S(r_k) the mean "
           f"log-density at rate r_k and w_k the widths of the Riemann-sum cells of the integral over r in "
           f"(0, 1) ({w[0]:.3g} at the two ends, {w[1]:.3g} between).", "",
           "| curve | MSE at 5 % | MSE at 50 % | MSE at 95 % | log-density area |", "|---|---|---|---|---|"]
    for name, c in curves.items():
        mse = c["mse"]
        i50 = int(np.argmin(np.abs(mse.rates - 0.5)))
        md.append(f"| {name} | {mse.score[0]:.4f} | {mse.score[i50]:.4f} | {mse.score[-1]:.4f} | "
                  f"{c['log_density'].area():.2f} |")
    return "\n".join(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few sequences, images and training steps (CI)")
    p.add_argument("--out-dir", default="docs/gallery")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--online", action="store_true",
                   help="try the paper's models and data on the HuggingFace hub first (BERT on GLUE, ViT-MAE)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1; raise it on an idle machine)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's models and data (implies --online), 500 sentences / images per subset")
    args = p.parse_args(argv)
    if args.paper:
        if args.quick:
            p.error("--paper and --quick exclude each other")
        args.online = True
    os.makedirs(args.out_dir, exist_ok=True)
    import bert_glue_curves
    import torch
    import vit_mae_curves

    threads = torch.get_num_threads()
    results_md = os.path.join(args.out_dir, "RESULTS.md")
    common = ["--seed", str(args.seed), "--threads", str(args.threads), "--json", ""]
    offline = [] if args.online else ["--offline"]
    out = {"png": []}
    try:
        t0 = time.time()
        png = os.path.join(args.out_dir, "fig5_right_mlm_curves.png")
        size = ["--limit", "8", "--max-residues", "24"] if args.quick else (["--limit", "500"] if args.paper else [])
        out["table2"] = bert_glue_curves.main(common + offline + size + ["--plot", png])
        update_results(results_md, "table2", table2_markdown(out["table2"], time.time() - t0))
        out["png"].append(png)

        t0 = time.time()
        png = os.path.join(args.out_dir, "fig6_vit_mae_curves.png")
        size = ["--limit", "60", "--train-steps", "40"] if args.quick else (["--limit", "500"] if args.paper else [])
        out["fig6"] = vit_mae_curves.main(common + offline + size + ["--plot", png])
        update_results(results_md, "fig6", fig6_markdown(out["fig6"], time.time() - t0))
        out["png"].append(png)
    finally:
        torch.set_num_threads(threads)
    update_results(results_md, "settings", settings_markdown())
    for png in out["png"]:
        compact_png(png)  # the examples save at 130 dpi in full colour
    print(f"wrote {', '.join(out['png'])} and {results_md}")
    return out


if __name__ == "__main__":
    main()
