"""Fig. 5 (right) / Table 2: MPT curves of pre-trained vs randomly initialized BERT.

For each GLUE subset (AX, CoLA, QNLI, MRPC) the script draws the mean
masked-token log-probability at every masking rate 1 %..99 % for
``bert-base-uncased`` and for a random initialization of the same
architecture, and prints the areas: the paper's Table 2 convention
(:func:`pyro_mpt.adapters.table2_area`, sum of the 99 curve values x 0.01 x
512) next to the per-sentence approximation :math:`L_i \\sum_k w_k S_i(r_k)`.

Offline (no hub), the same pipeline runs on AntiBERTy, the pre-trained BERT
masked LM for antibody sequences shipped in ``antiberty==0.1.3``, with heavy
chains, light chains and residue-shuffled heavy chains in place of the GLUE
subsets; the script says so on its first line. Each offline subset holds 100
full-length chains (``--limit``): the six real ones of
:mod:`pyro_mpt.adapters.antibodies` and point-mutated variants of them
(:func:`~pyro_mpt.adapters.antibodies.variants`, 5 % of residues, seeded). To
keep the run to minutes, offline curves use 11 rates (1 %, 10 %, ..., 90 %,
99 %; ``--rates paper`` for the 99) and report the area on the Table-2 scale,
512 times the integral of S(r) over [0, 1] by the rate grid's Riemann sum, with its standard
error over chains. Pair tasks are scored as BERT sentence pairs
(``[CLS] a [SEP] b [SEP]``).

    python examples/bert_glue_curves.py                    # online: 50 sentences per subset
    python examples/bert_glue_curves.py --offline          # the fallback: about 5 minutes on 2 CPU cores
    python examples/bert_glue_curves.py --device cuda --limit 500 --num-masks 4
"""

import argparse
import json
import time

import numpy as np
import torch

from pyro_mpt.adapters import PAPER_MLM_RATES, MaskedLMScorer, table2_area
from pyro_mpt.adapters.antibodies import HEAVY, LIGHT, shuffled, spaced, variants
from pyro_mpt.adapters.loading import ResourceUnavailable, load_masked_lm, load_texts

#: the offline grid: 11 rates keep 100 full-length chains per subset to minutes on a CPU
COARSE_RATES = np.array([0.01, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99])

#: name -> (GLUE config, split, text columns); AX has labels only in its test split
GLUE = {
    "AX": ("ax", "test", ["premise", "hypothesis"]),
    "CoLA": ("cola", "validation", ["sentence"]),
    "QNLI": ("qnli", "validation", ["question", "sentence"]),
    "MRPC": ("mrpc", "validation", ["sentence1", "sentence2"]),
}


def load_online(args):
    model, tok = load_masked_lm(args.model, quiet=True)
    subsets = {
        name: load_texts(dataset="glue", config=cfg, split=split, columns=cols, limit=args.limit or 50)
        for name, (cfg, split, cols) in GLUE.items()
    }
    random_model, _ = load_masked_lm(args.model, random_init=True, seed=args.seed, quiet=True)
    return model, random_model, tok, subsets


def load_offline(args):
    model, tok = load_masked_lm("antiberty", quiet=True)
    random_model, _ = load_masked_lm("antiberty", random_init=True, seed=args.seed, quiet=True)
    n = args.limit or 100
    heavy = (HEAVY + variants(HEAVY, max(0, n - len(HEAVY)), seed=args.seed))[:n]
    light = (LIGHT + variants(LIGHT, max(0, n - len(LIGHT)), seed=args.seed + 1))[:n]
    subsets = {
        "VH (heavy)": spaced(heavy, args.max_residues),
        "VL (light)": spaced(light, args.max_residues),
        "VH shuffled": spaced(shuffled(heavy, seed=args.seed), args.max_residues),
    }
    return model, random_model, tok, subsets


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--limit", type=int, default=None, help="sequences per subset (default 50 online, 100 offline)")
    p.add_argument("--max-residues", type=int, default=None, help="offline: truncate antibody chains (default: full length)")
    p.add_argument("--rates", choices=["paper", "coarse"], default=None,
                   help="paper: the 99 rates 1%%..99%% (default online); coarse: 1%%, 10%%, ..., 90%%, 99%% (default offline)")
    p.add_argument("--num-masks", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--offline", action="store_true", help="skip the hub and run the AntiBERTy fallback")
    p.add_argument("--plot", default="bert_glue_curves.png")
    p.add_argument("--json", default="bert_glue_curves.json", help="where to save the curves ('' to skip)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        if args.offline:
            raise ResourceUnavailable("--offline was given. ")
        model, random_model, tok, subsets = load_online(args)
        mode = f"online: {args.model} on GLUE"
        print(f"[{mode}]")
    except ResourceUnavailable as err:
        mode = "OFFLINE FALLBACK: AntiBERTy (antiberty==0.1.3) on antibody chains, not BERT on GLUE"
        print(f"[{mode}]\n  reason: {str(err).split('. ')[0]}.")
        model, random_model, tok, subsets = load_offline(args)

    offline = mode.startswith("OFFLINE")
    coarse = args.rates == "coarse" or (args.rates is None and offline)
    rates = COARSE_RATES if coarse else PAPER_MLM_RATES
    rows, curves = [], []
    for name, texts in subsets.items():
        for which, m in (("pre-trained", model), ("random init", random_model)):
            t0 = time.perf_counter()
            scorer = MaskedLMScorer(m, tok, max_tokens=args.max_tokens, device=args.device, seed=args.seed,
                                    progress=args.progress)
            curve = scorer.curve(texts, rates=rates, num_masks=args.num_masks, label=f"{name}, {which}")
            curves.append(curve)
            rows.append({
                "subset": name, "weights": which, "n": len(texts), "mean_tokens": curve.num_tokens,
                "table2_area": None if coarse else table2_area(curve), "rates": len(rates),
                "table2_scale_area": curve.area(num_tokens=512), "table2_scale_stderr": curve.area_stderr(num_tokens=512),
                "area": curve.area(), "area_stderr": curve.area_stderr(),
                "per_sequence_area": float(np.mean(curve.per_item_area())),
                "S_1pct": float(curve.score[0]), "S_99pct": float(curve.score[-1]),
                "seconds": time.perf_counter() - t0,
            })
            r = rows[-1]
            print(f"  {name:12s} {which:11s} n={r['n']:3d} L={r['mean_tokens']:6.1f}  "
                  f"512-scale area {r['table2_scale_area']:9.2f} ± {r['table2_scale_stderr']:6.2f}  "
                  f"area {r['area']:8.2f} ± {r['area_stderr']:5.2f}  "
                  f"S(1%) {r['S_1pct']:6.3f}  S(99%) {r['S_99pct']:6.3f}  ({r['seconds']:.0f} s)")

    key = "table2_scale_area" if coarse else "table2_area"
    print("\n" + ("Table-2 scale, 512 x Riemann sum of S over the rate grid:" if coarse
                  else "Table 2 convention (sum of the 99 rates x 0.01 x 512):"))
    names = list(subsets)
    print("  " + " " * 24 + "".join(f"{n:>14s}" for n in names))
    for which in ("random init", "pre-trained"):
        vals = [next(r[key] for r in rows if r["subset"] == n and r["weights"] == which) for n in names]
        print(f"  AREA / {which.upper():16s}" + "".join(f"{v:14.2f}" for v in vals))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, curve in enumerate(curves):
        c = colors[(k // 2) % len(colors)]
        ax.plot(100 * curve.rates, curve.score, color=c, linestyle="-" if k % 2 == 0 else "--", label=curve.label)
    ax.set_xlabel("masking rate (%)")
    ax.set_ylabel("mean masked-token log-prob")
    ax.set_title(mode if len(mode) < 60 else "offline fallback: AntiBERTy on antibody chains", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.savefig(args.plot, dpi=130, bbox_inches="tight")
    plt.close(fig)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "rows": rows, "curves": [c.to_dict() for c in curves]}, f, indent=1)
    print(f"wrote {args.plot}" + (f" and {args.json}" if args.json else ""))
    return {"mode": mode, "rows": rows, "curves": curves}


if __name__ == "__main__":
    main()
