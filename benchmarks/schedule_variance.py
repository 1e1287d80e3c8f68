#!/usr/bin/env python
r"""Choosing a schedule: variance, bias and cost of every ``masks=`` at equal compute.

PPCA at its generating parameters (``K = 2``, noise std 0.5, ``W, mu ~ N(0, 1)``,
data drawn from the model), float64, the exact Gaussian engine, so the target
:math:`\log p(x_i)` of every datapoint is known (:class:`pyro_mpt.Evidence`).

Compute is counted in *conditionals*: the log-conditionals
:math:`\log p(x_j \mid x_{\mathcal R})` a call evaluates per datapoint
(one per masked token). With ``P = num_masks``:

* ``"all"``, ``"nested"``: :math:`P\,D(D+1)/2` (every size, once per repetition);
* ``"uniform"``, ``"stratified"``: :math:`P\,(D+1)/2` on average (one mask of
  uniform size);
* ``"order"``: :math:`P\,D` (one conditional per position of an ordering);
* a rate :math:`r`: :math:`P \operatorname{round}(rD)`;
* ``"pll"``: :math:`D` (deterministic; ``num_masks`` is unused);
* ``"exhaustive"``: :math:`\sum_M M\binom{D}{M} = D\,2^{D-1}` (deterministic).

Every random schedule gets ``num_masks`` chosen so that it spends the same
budget, ``4 D (D + 1) / 2`` conditionals per datapoint (``"all"`` with
``P = 4``). Each schedule is called once per seed (``--seeds`` fixed seeds,
masks drawn per datapoint); per datapoint, the spread of the estimates over
the seeds is its standard deviation, and the table prints the RMS over the
datapoints. The bias column is the mean over seeds and datapoints of
``estimate - log p(x_i)`` with its standard error. The seconds are the median
over the seeds of one ``score`` call on the N datapoints (no gradient),
measured with ``benchmarks/harness.py``.

``D = 16`` by default, the largest D ``"exhaustive"`` accepts
(:data:`pyro_mpt.masks.MAX_EXHAUSTIVE_TOKENS`); a larger ``--D`` leaves it out.

Usage::

    .venv/bin/python benchmarks/schedule_variance.py            # D = 16, N = 200, 200 seeds (~1 min)
    .venv/bin/python benchmarks/schedule_variance.py --D 20      # without "exhaustive"
    .venv/bin/python benchmarks/schedule_variance.py --out-md docs/benchmarks.md
"""

import argparse
import math
import os
import statistics
import sys

import numpy as np
import pyro
import pyro.distributions as dist
import torch

from pyro_mpt import Evidence, MaskedPretrainingLoss
from pyro_mpt.masks import MAX_EXHAUSTIVE_TOKENS, FixedRate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import fmt_s, machine_line, timed, write_markdown  # noqa: E402

MD_BEGIN = "<!-- schedule_variance:begin -->"
MD_END = "<!-- schedule_variance:end -->"
RATE = 0.15


def ppca(D, K, N, seed, noise=0.5):
    """A float64 PPCA at its generating parameters and N datapoints drawn from it."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    mu = torch.randn(D, generator=g, dtype=torch.float64)
    s = torch.tensor(noise, dtype=torch.float64)
    x = torch.randn(N, K, generator=g, dtype=torch.float64) @ W.T + mu + s * torch.randn(
        N, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    return model, x


def per_mask_cost(masks, D):
    """Conditionals per datapoint of one repetition (the mean, for random sizes)."""
    return {"all": D * (D + 1) / 2, "nested": D * (D + 1) / 2, "uniform": (D + 1) / 2,
            "stratified": (D + 1) / 2, "order": D, RATE: FixedRate(RATE).size(D), "pll": D,
            "exhaustive": D * 2 ** (D - 1)}[masks]


FORMULA = {"all": "P D(D+1)/2", "nested": "P D(D+1)/2", "uniform": "P (D+1)/2 (mean)",
           "stratified": "P (D+1)/2 (mean)", "order": "P D", RATE: "P round(rD)", "pll": "D",
           "exhaustive": "D 2^(D-1)"}
UNBIASED = {"all": "yes", "nested": "yes", "uniform": "yes", "stratified": "yes",
            "order": "yes (exact with one joint)", RATE: "**no**: mean D S(x; round(rD))",
            "pll": "**no**: D S(x; 1)", "exhaustive": "yes (exact with one joint)"}
DETERMINISTIC = ("pll", "exhaustive")


def measure(model, x, lml, masks, P, seeds):
    """Estimates of every log p(x_i) under ``seeds`` mask seeds, and the seconds per call."""
    loss = MaskedPretrainingLoss(masks=masks, num_masks=P, share_masks=False)
    est, secs = [], []
    for seed in seeds:
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            e, t = timed(lambda: loss.score(model, None, x))
        est.append(e)
        secs.append(t)
    err = (torch.stack(est) - lml).numpy()  # (seeds, N)
    return dict(std=float(np.sqrt(err.var(0, ddof=1).mean())), bias=float(err.mean()),
                bias_se=float(err.std(ddof=1) / math.sqrt(err.size)), seconds=statistics.median(secs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--D", type=int, default=16)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--N", type=int, default=200)
    p.add_argument("--seeds", type=int, default=200, help="mask seeds per schedule")
    p.add_argument("--budget-reps", type=int, default=4,
                   help='the budget is this many repetitions of "all": B = reps D (D+1)/2 conditionals')
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-md", help="replace the schedule_variance block of this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    D, N = args.D, args.N
    model, x = ppca(D, args.K, N, seed=0)
    with torch.no_grad():
        lml = Evidence(model)(x)
    budget = args.budget_reps * D * (D + 1) / 2
    seeds = range(1, args.seeds + 1)
    schedules = ["all", "nested", "uniform", "stratified", "order", RATE, "pll"]
    if D <= MAX_EXHAUSTIVE_TOKENS:
        schedules.append("exhaustive")
    rows = []
    for masks in schedules:
        if masks in DETERMINISTIC:
            P, s = 1, seeds[:2]  # no randomness: two seeds show it
        else:
            P, s = max(1, round(budget / per_mask_cost(masks, D))), seeds
        r = measure(model, x, lml, masks, P, s)
        r.update(masks=masks, P=P, cost=P * per_mask_cost(masks, D), n_seeds=len(s))
        rows.append(r)
        print(f"  {masks!r}: P={P} std={r['std']:.4g} bias={r['bias']:+.4f}±{r['bias_se']:.4f} "
              f"{fmt_s(r['seconds'])} s", file=sys.stderr)

    ref = next(r for r in rows if r["masks"] == "all")
    lines = [
        f"PPCA D={D}, K={args.K}, N={N} at its generating parameters, float64, Gaussian engine; "
        f"exact log p(x) {float(lml.mean()):.4f} per datapoint. Budget: {budget:.0f} conditionals "
        f"per datapoint ({args.budget_reps} repetitions of \"all\"); masks per datapoint; "
        f"{args.seeds} mask seeds (2 for the deterministic schedules). "
        f"std: RMS over datapoints of the per-datapoint standard deviation of the estimate over seeds; "
        f"std x sqrt(cost): the std one conditional buys (lower is better at any budget); "
        f"mean - log p: over seeds and datapoints, ± 1 standard error.",
        "",
        "| `masks=` | P (`num_masks`) | conditionals per datapoint | at this P | std of log p estimate (nats) "
        "| std x sqrt(cost) | variance vs \"all\" | mean - log p | unbiased for log p? | s per call (N points) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"`{r['masks']}`" if isinstance(r["masks"], float) else f'`"{r["masks"]}"`'
        P = "-" if r["masks"] in DETERMINISTIC else str(r["P"])
        eff = f"{r['std'] * math.sqrt(r['cost']):.3g}"
        # a deterministic schedule has its own fixed cost: no equal-compute ratio
        ratio = "-" if r["masks"] in DETERMINISTIC else f"{(r['std'] / ref['std']) ** 2:.3g}"
        lines.append(
            f"| {name} | {P} | {FORMULA[r['masks']]} | {r['cost']:.0f} | {r['std']:.3g} | {eff} "
            f"| {ratio} | {r['bias']:+.4f} ± {r['bias_se']:.4f} | {UNBIASED[r['masks']]} "
            f"| {fmt_s(r['seconds'])} |")
    lines += ["", f"Machine: {machine_line()}; {args.threads} thread(s)."]
    text = "\n".join(lines)
    print(text)
    if args.out_md:
        write_markdown(args.out_md, text, MD_BEGIN, MD_END)
    return rows


if __name__ == "__main__":
    main()
