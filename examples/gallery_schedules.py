r"""Gallery, beyond the paper: the variance of the mask schedules and the bias of a fixed rate.

Both studies use a PPCA at its generating parameters (``K = 2``, noise std 0.5,
``W, mu ~ N(0, 1)``, data drawn from the model), in float64, so the target
:math:`\log p(x)` is known exactly (:class:`pyro_mpt.Evidence`).

* ``schedule_variance.png`` -- the standard deviation of one estimate of
  :math:`\log p(x_i)` (per datapoint, over ``--repeats`` independent mask
  draws) against its compute, for ``masks="all"`` (the paper's estimator: an
  independent mask per size), ``"nested"`` (every size, the masks nested in one
  permutation), ``"uniform"``, ``"stratified"`` and ``"order"`` with
  ``num_masks = P``. Compute is counted in *token-queries*, the log-conditionals
  :math:`\log p(x_j \mid x_{\mathcal R})` evaluated per datapoint:
  ``P D (D + 1) / 2`` for ``"all"`` and ``"nested"``, ``P (D + 1) / 2``
  on average for ``"uniform"`` and ``"stratified"`` (one mask of mean size
  ``(D + 1) / 2``), ``P D`` for ``"order"``. The right panel shows the mean
  error with 2 standard errors: every schedule is unbiased.
  ``"order"`` is the chain rule along random orderings; with the closed-form
  Gaussian engine every ordering gives :math:`\log p(x)` exactly, so its
  standard deviation is 0 (measured exactly 0.0 in float64). A log axis cannot
  show 0: it is drawn on the bottom edge of the axes and labelled as such. (With
  a sampling engine, e.g. importance sampling with a prior proposal, the
  orderings still telescope to the engine's own evidence estimate, whose spread
  over draws then becomes a floor for every schedule.) ``"stratified"`` starts
  at ``P = 2``: with one mask per datapoint it stratifies sizes across the
  batch, which leaves each datapoint's variance that of ``"uniform"``.
* ``fixed_rate_bias.png`` -- the bias of a fixed masking rate :math:`r`,
  :math:`D\,S(x; \operatorname{round}(rD)) - \log p(x)` (mean per datapoint),
  against :math:`r`, from :meth:`MaskedPretrainingLoss.curve`: exact at
  ``D = 16`` (``masks="exhaustive"``: every subset), estimated with ``P`` masks
  per size at larger D (``masks="all"``, ± 2 standard errors). The 15 % (BERT)
  and 20 % (the paper's Fig. 2) rates are marked, together with the library's
  fixed-rate estimator itself (``masks=0.15`` / ``0.2``), whose mean lands on
  the curve. By Proposition 1 the bias averages to zero over the D sizes.

Run ``python examples/gallery_schedules.py`` (about a minute on 2 CPU cores) or
``--quick`` (reduced sizes, CI).
"""

import argparse
import os
import sys
import time

import numpy as np
import pyro
import torch

from pyro_mpt import Evidence, FixedRate, MaskedPretrainingLoss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling gallery_common

from gallery_common import add_out_dir, compact_png, make_ppca, ppca_data, resolve_out_dir  # noqa: E402
from gallery_report import report_schedules  # noqa: E402

SCHEDULES = ("all", "nested", "uniform", "stratified", "order")
RATES = (0.15, 0.2)


def ppca64(D, K, N, seed):
    """PPCA at its generating parameters and N datapoints from it, in float64."""
    pyro.clear_param_store()
    truth, x = ppca_data(D, K, N, seed)
    return make_ppca(*(t.double() for t in truth)), x.double()


def token_queries(masks, P, D):
    """Log-conditionals evaluated per datapoint by ``P`` masks of a schedule (mean, for random sizes)."""
    per_mask = {"all": D * (D + 1) / 2, "nested": D * (D + 1) / 2, "uniform": (D + 1) / 2, "stratified": (D + 1) / 2,
                "order": D}
    return P * per_mask[masks]


# ---------------------------------------------------------------------- (a) variance at equal compute
def schedule_variance(model, x, lml, masks, P, repeats, seed):
    """Spread over ``repeats`` independent estimates of each log p(x_i).

    The data are stacked ``repeats`` times; with independent masks per row
    (``share_masks=False``) one call gives ``repeats`` independent estimates
    per datapoint.
    """
    N = x.shape[0]
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        est = MaskedPretrainingLoss(masks=masks, num_masks=P, share_masks=False).score(model, None, x.repeat(repeats, 1))
    err = (est.reshape(repeats, N) - lml).detach().numpy()
    return dict(masks=masks, P=P, compute=token_queries(masks, P, x.shape[1]),
                std=float(np.sqrt(err.var(0, ddof=1).mean())),  # RMS over datapoints of the per-datapoint std
                mean_error=float(err.mean()), mean_error_se=float(err.std(ddof=1) / np.sqrt(err.size)))


# ---------------------------------------------------------------------- (b) bias of a fixed rate
def bias_curve(D, K, N, P, P_rate, seed):
    """``D S(x; M) - log p(x)`` for M = 1..D (mean per datapoint) and the fixed-rate estimators.

    Exact (every subset) for D <= 16, else ``P`` masks per size; the estimators
    ``masks=rate`` use ``P_rate`` masks per datapoint.
    """
    model, x = ppca64(D, K, N, seed)
    with torch.no_grad():
        lml = float(Evidence(model)(x).mean())
    exact = D <= 16  # masks="exhaustive" enumerates 2^D - 1 subsets, up to D = 16
    pyro.set_rng_seed(seed + 1)
    # masks per datapoint, so that the curve's standard errors count the mask noise
    loss = (MaskedPretrainingLoss(masks="exhaustive") if exact
            else MaskedPretrainingLoss(masks="all", num_masks=P, share_masks=False))
    curve = loss.curve(model, None, x)
    out = dict(D=D, N=N, K=K, seed=seed, P=None if exact else P, exact=exact, lml=lml, rates=curve.rates,
               bias=D * curve.score - lml, bias_se=D * curve.stderr, area_minus_lml=curve.area() - lml, points={})
    for rate in RATES:
        M = FixedRate(rate).size(D)  # the size masks=rate uses: round(rate * D), halves up
        pyro.set_rng_seed(seed + 2)
        with torch.no_grad():  # P_rate one-mask estimates per datapoint, from the stacked data
            est = MaskedPretrainingLoss(masks=rate).score(model, None, x.repeat(P_rate, 1)).reshape(P_rate, N)
        # the standard error of the masks alone (the data are the same as the curve's)
        mc_se = np.sqrt(est.var(0).mean().item() / (P_rate * N))
        out["points"][rate] = dict(M=M, bias=float(out["bias"][M - 1]), bias_se=float(out["bias_se"][M - 1]),
                                   estimator=float(est.mean()) - lml, estimator_se=float(mc_se))
    return out


# ---------------------------------------------------------------------- figures
def plot_variance(rows, D, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = dict(zip(SCHEDULES, ("tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:red")))
    labels = {"all": "all (paper: independent masks per size)", "nested": "nested (one permutation per repetition)"}
    zero = []
    for masks in SCHEDULES:
        r = [row for row in rows if row["masks"] == masks]
        c = np.array([row["compute"] for row in r])
        s = np.array([row["std"] for row in r])
        if s.max() > 1e-10:
            ax.loglog(c, s, "o-", color=colors[masks], label=labels.get(masks, masks))
        else:  # exact up to rounding: no room for it on a log axis scaled to the others
            zero.append((masks, c, s.max()))
        m = np.array([row["mean_error"] for row in r])
        se = np.array([row["mean_error_se"] for row in r])
        ax2.errorbar(c, m, yerr=2 * se, fmt="o-", color=colors[masks], capsize=3, label=masks)
    u = [row for row in rows if row["masks"] == "uniform"]
    c0, s0 = u[0]["compute"], u[0]["std"]
    cs = np.array([c0, u[-1]["compute"]])
    ax.loglog(cs, s0 * np.sqrt(c0 / cs), "k:", lw=1, label=r"$\propto$ compute$^{-1/2}$")
    # a log axis cannot show 0: schedules with no spread at all sit on the bottom edge
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo / 2, hi)
    for masks, c, top in zero:
        value = "exactly 0" if top == 0 else f"<= {top:.0e}"
        ax.plot(c, np.full(len(c), lo / 2), "v-", color=colors[masks], ms=8, clip_on=False,
                label=f"{masks}: std {value} (drawn on the axis floor)")
    ax.set_xlabel("token-queries per datapoint (log-conditionals evaluated)")
    ax.set_ylabel("std of the estimate of log p(x_i) (nats)")
    ax.set_title(f"PPCA D={D}, K=2 at the true parameters, Gaussian engine", fontsize=10)
    ax.legend(fontsize=8)
    ax2.axhline(0.0, color="k", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_xlabel("token-queries per datapoint")
    ax2.set_ylabel("mean estimate - exact log p(x) (± 2 s.e.)")
    ax2.set_title("every schedule is unbiased", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bias(panels, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for pn in panels:
        r, b, se = 100 * pn["rates"], pn["bias"], pn["bias_se"]
        how = "exact (every subset)" if pn["exact"] else f"{pn['P']} masks per size, ± 2 s.e."
        for a in (ax, ax2):
            (line,) = a.plot(r, b, "-", lw=1.5, label=f"D={pn['D']}: {how}")
            if not pn["exact"]:
                a.fill_between(r, b - 2 * se, b + 2 * se, color=line.get_color(), alpha=0.25, lw=0)
        for rate, pt in pn["points"].items():
            ax2.plot(100 * pt["M"] / pn["D"], pt["bias"], "o", color=line.get_color(), ms=6)
            ax2.errorbar(100 * pt["M"] / pn["D"], pt["estimator"], yerr=2 * pt["estimator_se"], fmt="x", color="k",
                         ms=7, capsize=2)
    for rate in RATES:
        ax2.axvline(100 * rate, color="gray", ls="--", lw=0.8)
        ax2.text(100 * rate, 0.02, f" {100 * rate:.0f}%", transform=ax2.get_xaxis_transform(), fontsize=8)
    ax2.plot([], [], "o", color="gray", label="M = round(rD), r = 15 %, 20 %")
    ax2.plot([], [], "x", color="k", label="masks=r estimator, mean ± 2 s.e.")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title("bias of a fixed masking rate (symlog axis)", fontsize=10)
    ax2.set_xlim(0, 50)
    top = [b for pn in panels for b in pn["bias"][pn["rates"] <= 0.5]]
    ax2.set_ylim(min(0.0, min(top)) - 0.5, max(top) + 2.5)  # room for the legend
    ax2.set_title("low rates: where BERT-style training sits", fontsize=10)
    for a in (ax, ax2):
        a.set_xlabel("masking rate r = M / D (%)")
        a.set_ylabel(r"$D\,S(x; M) - \log p(x)$ (nats per datapoint)")
    ax.legend(fontsize=8, loc="lower left")
    ax2.legend(fontsize=8, loc="upper right")
    fig.suptitle("PPCA (K=2, noise std 0.5) at the true parameters", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- entry point
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced sizes for CI (a few seconds)")
    add_out_dir(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, help="independent estimates per datapoint (default 100, quick 40)")
    args = p.parse_args(argv)
    resolve_out_dir(args)
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    q = args.quick
    D, K = 10, 2
    N = 20 if q else 40
    repeats = args.repeats or (40 if q else 100)
    P_list = {"all": [1, 4] if q else [1, 2, 4, 8, 16], "nested": [1, 4] if q else [1, 2, 4, 8, 16],
              "uniform": [2, 8, 32] if q else [2, 8, 32, 128],
              "stratified": [2, 8, 32] if q else [2, 8, 32, 128], "order": [1, 4] if q else [1, 4, 16, 64]}
    bias_settings = [(14, 100, None)] if q else [(16, 100, None), (50, 200, 200), (100, 200, 200)]  # (D, N, P)
    bias_check_P = 100 if q else 200  # masks of the fixed-rate estimators and of the Monte Carlo check
    out = dict(settings=dict(quick=q, seed=args.seed, variance=dict(D=D, K=K, N=N, repeats=repeats, P=P_list),
                             bias=dict(settings=bias_settings, K=K, check_P=bias_check_P)))

    # (a) variance of the schedules at equal compute
    model, x = ppca64(D, K, N, args.seed + 20)
    with torch.no_grad():
        lml = Evidence(model)(x)
    rows = [schedule_variance(model, x, lml, masks, P, repeats, seed=1000 * args.seed + 10 * i + P)
            for i, masks in enumerate(SCHEDULES) for P in P_list[masks]]
    out["variance"], out["variance_lml"] = rows, float(lml.mean())
    var_png = os.path.join(args.out_dir, "schedule_variance.png")
    plot_variance(rows, D, var_png)

    # (b) bias of a fixed masking rate; at the exhaustive D, also the Monte Carlo curve, as a check
    panels = [bias_curve(Dn, K, Nn, Pn, bias_check_P, seed=args.seed + Dn) for Dn, Nn, Pn in bias_settings]
    Dx, Nx, _ = bias_settings[0]
    model, x = ppca64(Dx, K, Nx, args.seed + Dx)
    pyro.set_rng_seed(args.seed + 3)
    mc = MaskedPretrainingLoss(masks="all", num_masks=bias_check_P, share_masks=False).curve(model, None, x)
    out["bias_check"] = dict(D=Dx, P=bias_check_P, bias=Dx * mc.score - panels[0]["lml"], bias_se=Dx * mc.stderr)
    out["bias"] = panels
    bias_png = os.path.join(args.out_dir, "fixed_rate_bias.png")
    plot_bias(panels, bias_png)
    out["png"] = [var_png, bias_png]
    for png in out["png"]:
        compact_png(png)
    out["seconds"] = time.time() - t0
    report_schedules(out, args)
    return out


if __name__ == "__main__":
    main()
