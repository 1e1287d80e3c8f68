r"""Gallery: the LML as the area under the MPT curve (paper Fig. 4 and Fig. 5, left).

Proposition 1 of Moreno-Muñoz, Recasens & Hauberg (NeurIPS 2023) reads the
log-marginal likelihood as the area under the curve of the masked pre-training
score, ``log p(x) = sum_M S(x; M)``. This script draws that curve
(:meth:`pyro_mpt.MPTCurve.plot`) for PPCA models and compares its area with the
exact LML (:class:`pyro_mpt.Evidence`):

* Fig. 4, at the paper's sizes: PPCA at its generating parameters
  (``D = 200``, ``K = 5``), the curve estimated with ``P = 1`` and ``P = 100``
  random masks per size (``masks="all"``, the paper's estimator), and a
  ``K = 50`` model (``D = 200``) whose curve decays from ~50 % masking. As in
  the paper, one mask set serves the whole batch (``share_masks=True``), so the
  ``P = 1`` curve shows the noise of a single mask per size; the standard error
  drawn is over datapoints and leaves the shared mask draw out. Black lines mark
  the 15 % and 85 % masking rates, as in the paper.
* Fig. 5 (left): a PPCA trained from a random initialization by SVI with the
  MPT loss (``masks="uniform"``, one mask per datapoint, full batch,
  ``pyro.optim.Adam``); curves at epochs 0, 100, ..., 600. The area climbs from
  a flat, low curve to the true LML (of the generating parameters).

Data are drawn from the model (independent Gaussian noise per token); seeds
are fixed. Run ``python examples/gallery_area.py`` or ``--quick`` (CI).
"""

import argparse
import os
import time

import pyro
import torch
from pyro.infer import SVI

from pyro_mpt import Evidence, MaskedPretrainingLoss

import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling gallery_common

from gallery_common import add_out_dir, make_ppca, ppca_data, resolve_out_dir  # noqa: E402
from gallery_report import report_area  # noqa: E402


def guide(x):
    pass


def lml(model, x):
    with torch.no_grad():
        return float(Evidence(model)(x).mean())


def curve(model, x, P, seed, label, share_masks=True):
    pyro.set_rng_seed(seed)
    c = MaskedPretrainingLoss(masks="all", num_masks=P, share_masks=share_masks).curve(model, None, x)
    c.label = label
    return c


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced sizes for CI (< 20 s)")
    add_out_dir(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paper", action="store_true", help="the paper's setting: the default already is (D=200, K=5, 50)")
    args = p.parse_args(argv)
    resolve_out_dir(args)
    if args.paper and args.quick:
        p.error("--paper and --quick exclude each other")
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = time.time()
    q = args.quick
    N, D, K = (300, 50, 5) if q else (1000, 200, 5)  # Fig. 4 left and centre (paper: D=200, K=5)
    N50, D50, K50, P50 = (200, 100, 50, 10) if q else (1000, 200, 50, 100)  # Fig. 4 right (paper: K=50)
    Nt, Dt, Kt = (300, 20, 2) if q else (1000, 20, 2)  # Fig. 5 left
    epochs = 300 if q else 600
    every = 100
    P_train_curve = 10 if q else 100
    lr = 0.01
    out = {"settings": dict(quick=q, N=N, D=D, K=K, N50=N50, D50=D50, K50=K50, P50=P50, epochs=epochs, lr=lr,
                            P_train_curve=P_train_curve, Nt=Nt, Dt=Dt, Kt=Kt, seed=args.seed)}

    # ---------------------------------------------------------------- Fig. 4
    pyro.clear_param_store()
    truth, x = ppca_data(D, K, N, seed=args.seed + 1)
    model = make_ppca(*truth)
    true_lml = lml(model, x)
    c1 = curve(model, x, 1, args.seed + 11, "P=1")
    c100 = curve(model, x, 100, args.seed + 12, "P=100")
    pyro.clear_param_store()
    truth50, x50 = ppca_data(D50, K50, N50, seed=args.seed + 2)
    model50 = make_ppca(*truth50)
    true_lml50 = lml(model50, x50)
    c50 = curve(model50, x50, P50, args.seed + 13, f"K={K50}, P={P50}")
    fig4 = {
        "lml": true_lml, "area_P1": c1.area(), "area_P1_stderr": c1.area_stderr(),
        "area_P100": c100.area(), "area_P100_stderr": c100.area_stderr(),
        "lml_K50": true_lml50, "area_K50": c50.area(), "area_K50_stderr": c50.area_stderr(),
    }
    out["fig4"] = fig4
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, c, t, title in [(axes[0], c1, true_lml, f"D={D}, K={K}, P=1"), (axes[1], c100, true_lml, f"D={D}, K={K}, P=100"),
                            (axes[2], c50, true_lml50, f"D={D50}, K={K50}, P={P50}")]:
        c.plot(ax)
        for rate in (15, 85):  # the paper's marks of a 15 % and an 85 % masking rate
            ax.axvline(rate, color="k", lw=1.0)
        ax.set_title(f"{title}; true LML {t:.2f}")
    fig.tight_layout()
    fig4_path = os.path.join(args.out_dir, "fig4_area.png")
    fig.savefig(fig4_path, dpi=110)
    plt.close(fig)

    # ---------------------------------------------------------------- Fig. 5 (left)
    pyro.clear_param_store()
    truth_t, xt = ppca_data(Dt, Kt, Nt, seed=args.seed + 1)
    true_lml_t = lml(make_ppca(*truth_t), xt)
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(args.seed + 3)
    init = (0.1 * torch.randn(Dt, Kt, generator=g), torch.zeros(Dt), torch.tensor(1.0))
    tmodel = make_ppca(*init)
    pyro.set_rng_seed(args.seed + 4)
    svi = SVI(tmodel, guide, pyro.optim.Adam({"lr": lr}), loss=MaskedPretrainingLoss(masks="uniform", num_masks=1))
    snaps = []
    for epoch in range(epochs + 1):
        if epoch % every == 0:
            c = curve(tmodel, xt, P_train_curve, args.seed + 100 + epoch, f"epoch {epoch}", share_masks=False)
            snaps.append(dict(epoch=epoch, area=c.area(), area_stderr=c.area_stderr(), lml=lml(tmodel, xt), curve=c))
        if epoch < epochs:
            svi.step(xt)
    out["fig5"] = [{k: v for k, v in s.items() if k != "curve"} for s in snaps]
    out["fig5_true_lml"] = true_lml_t
    fig, ax = plt.subplots(figsize=(6.5, 4))
    cmap = plt.get_cmap("viridis")
    for i, s in enumerate(snaps):
        s["curve"].plot(ax, color=cmap(i / max(1, len(snaps) - 1)), fill=False)
    ax.set_title(f"PPCA trained with MPT (D={Dt}, K={Kt}); true LML {true_lml_t:.2f}")
    ax.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig5_path = os.path.join(args.out_dir, "fig5_training_area.png")
    fig.savefig(fig5_path, dpi=110)
    plt.close(fig)
    out["png"] = [fig4_path, fig5_path]
    out["seconds"] = time.time() - t0

    report_area(out, args)
    return out


if __name__ == "__main__":
    main()
