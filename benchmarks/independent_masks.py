#!/usr/bin/env python
r"""Masks drawn per datapoint against masks shared by the batch, on PPCA (low-rank path).

``masks="all"`` (the paper's estimator: for every size M = 1..D an independent
random mask) with ``share_masks=False`` (one mask per datapoint, the default)
and with ``share_masks=True``, loss + gradient with respect to the PPCA
parameters, N = 1000, one thread, interleaved in one run; the ratio is the
issue's measure (target: independent <= 3x shared). Each configuration runs in
a fresh process, whose peak RSS (``ru_maxrss``, the whole process) is printed
(target: <= 2 GB at D = 512, K = 2, float32).

The independent step includes drawing the masks (N D^2 token draws), which
the shared step does D times fewer of.

Usage::

    .venv/bin/python benchmarks/independent_masks.py                  # D in {200, 512}, K = 2, float32
    .venv/bin/python benchmarks/independent_masks.py --D 512 --K 2 --dtype float64
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts
from harness import machine_line, run_interleaved  # noqa: E402


def one(D, K, dtype, repeats):
    from ppca_speed import make_problem
    from pyro_mpt import MaskedPretrainingLoss

    torch.set_num_threads(1)
    model, x, leaves = make_problem(1000, D, K, getattr(torch, dtype))
    losses = [MaskedPretrainingLoss(masks="all", share_masks=share) for share in (True, False)]

    def prepare(seed):
        torch.manual_seed(seed)

    def step(loss):
        def run(_):
            value = loss.differentiable_loss(model, None, x)
            torch.autograd.grad(value, leaves)
            return float(value.detach())

        return run

    (shared, _), (indep, _) = run_interleaved(prepare, [step(l) for l in losses], repeats)[0]
    ts, ti = statistics.median(shared), statistics.median(indep)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {D} | {K} | {dtype} | {ts:.3f} s | {ti:.2f} s | {ti / ts:.0f}x | {rss:.0f} MB |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--D", type=int, nargs="+", default=[200, 512])
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args.D[0], args.K, args.dtype, args.repeats)
        return
    print(machine_line())
    print("| D | K | dtype | shared masks | independent masks | ratio | peak RSS (independent run) |")
    print("|---|---|---|---|---|---|---|")
    for D in args.D:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--D", str(D), "--K", str(args.K),
               "--dtype", args.dtype, "--repeats", str(args.repeats)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
