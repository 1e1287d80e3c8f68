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

Run ``python examples/gallery_adapters.py`` (about 10 minutes on 2 CPU cores: 560 s for the
masked-LM curves, 62 s for the ViT-MAE ones, in the run of ``docs/gallery/RESULTS.md``) or
``--quick`` (a few sequences and training steps, CI).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling examples

from gallery_common import add_out_dir, compact_png, resolve_out_dir  # noqa: E402
from gallery_report import fig6_markdown, settings_markdown, table2_markdown, update_results  # noqa: E402

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few sequences, images and training steps (CI)")
    add_out_dir(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--online", action="store_true",
                   help="try the paper's models and data on the HuggingFace hub first (BERT on GLUE, ViT-MAE)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1; raise it on an idle machine)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's models and data (implies --online), 500 sentences / images per subset")
    args = p.parse_args(argv)
    resolve_out_dir(args)
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
