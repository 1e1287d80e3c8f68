#!/usr/bin/env python
r"""A multi-output GP served as independent blocks vs as one dense Gaussian (issue 13 §5).

``pyro.contrib.gp.models.GPRegression`` with outputs ``y`` of shape ``(B, N)``
observes ``MultivariateNormal(0, K).expand_by([B]).to_event(1)``: the Gaussian
engine serves its :math:`BN` tokens as :math:`B` independent blocks sharing one
:math:`N \times N` factor. The alternative a user could write is one
``MultivariateNormal`` over all :math:`BN` tokens with the block-diagonal
covariance. For both, the script times (median ± sd of ``--repeats``, by the
shared harness) ``Evidence``, one SVI step of ``MaskedPretrainingLoss(masks="uniform")``
and the pseudo-log-likelihood ``masks="pll"``, checks that both give the same
numbers, and prints the ratios dense / blocks.

Usage::

    .venv/bin/python benchmarks/multi_output_speed.py            # B=3, N=150
    .venv/bin/python benchmarks/multi_output_speed.py --quick
"""

import argparse
import os
import sys

import torch
import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_mpt import Evidence, MaskedPretrainingLoss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import Timing, fmt_ratio, machine_line, run_interleaved  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=3, help="outputs")
    parser.add_argument("--N", type=int, default=150, help="inputs per output")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    if a.quick:
        a.N, a.repeats = 60, 2
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    X = 5 * torch.rand(a.N, 1, generator=g)
    y = torch.sin(X[:, 0]) + 0.3 * torch.randn(a.B, a.N, generator=g)
    gpr = gp.models.GPRegression(X, y, gp.kernels.RBF(1), noise=torch.tensor(0.1))

    def dense(y):
        K = gpr.kernel(X) + (gpr.noise + gpr.jitter) * torch.eye(a.N)
        cov = torch.block_diag(*[K] * a.B)
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(a.B * a.N), cov), obs=y.reshape(-1))

    models = {"blocks": (gpr.model, ()), "dense": (dense, (y,))}
    print(f"# {machine_line()}")
    print(f"# GPRegression, B = {a.B} outputs of N = {a.N}: {a.B * a.N} tokens")
    for task in ("evidence", "svi_step", "pll"):
        runs = []
        for model, args in models.values():
            if task == "evidence":
                runs.append(lambda _, m=model, ar=args: float(Evidence(m)(*ar).detach()))
            elif task == "pll":
                runs.append(lambda _, m=model, ar=args: float(MaskedPretrainingLoss(masks="pll").score(m, None, *ar).detach()))
            else:
                svi = SVI(model, lambda *_: None, Adam({"lr": 1e-3}), MaskedPretrainingLoss(masks="uniform"))
                runs.append(lambda _, s=svi, ar=args: s.step(*ar))
        (t_b, out_b), (t_d, out_d) = run_interleaved(lambda seed: pyro.set_rng_seed(seed), runs, a.repeats)[0]
        blocks, dense_t = Timing(t_b), Timing(t_d)
        same = "" if task == "svi_step" else f"; |blocks - dense| = {abs(out_b[-1] - out_d[-1]):.2e}"
        print(f"{task:>9}: blocks {blocks.cell()} s, dense {dense_t.cell()} s, "
              f"dense / blocks {fmt_ratio(dense_t.median / blocks.median)}{same}")

if __name__ == "__main__":
    main()
