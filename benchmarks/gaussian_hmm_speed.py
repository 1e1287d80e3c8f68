#!/usr/bin/env python
r"""The Kalman engine (``conditionals="gaussian_hmm"``) vs the dense covariance of the sequence
(``conditionals="gaussian"``) on an observed ``dist.GaussianHMM``, as users write it.

Model: ``N`` sequences of ``T`` steps, hidden dim ``H = 2``, one observed element a step, the
transition matrix, loading and noise scale ``pyro.param`` s. For each ``T`` and schedule (the
default masks per datapoint, ``"order"``, and ``"all"`` up to ``--max-all-steps``) the script
times loss + gradient with both engines on the same masks (interleaved, by the shared harness),
prints the ratio dense / Kalman and the two losses' relative difference (float32 data; both
compute in float64). Below :data:`~pyro_mpt.conditionals.AUTO_MIN_TOKENS` tokens the dense
covariance is the faster one, and ``"auto"`` takes it there.

Usage::

    .venv/bin/python benchmarks/gaussian_hmm_speed.py              # T = 100, 300, 1000
    .venv/bin/python benchmarks/gaussian_hmm_speed.py --quick      # T = 100, 300
"""

import argparse
import os
import statistics
import sys

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import GaussianConditionals, GaussianHMMConditionals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import fmt_ratio, fmt_s, machine_line, run_interleaved  # noqa: E402

H, O = 2, 1


def model(x):
    A = pyro.param("A", torch.tensor([[0.9, 0.1], [-0.1, 0.9]]))
    C = pyro.param("C", torch.ones(H, O))
    s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
    init = dist.MultivariateNormal(torch.zeros(H), torch.eye(H))
    trans = dist.MultivariateNormal(torch.zeros(H), 0.1 * torch.eye(H))
    with pyro.plate("sequences", x.shape[0]):
        pyro.sample("x", dist.GaussianHMM(init, A, trans, C, dist.Normal(torch.zeros(O), s).to_event(1)), obs=x)


def step(engine, masks, x, seed):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    kw = {} if masks == "default" else {"masks": masks}
    loss = MaskedPretrainingLoss(conditionals=engine, **kw).differentiable_loss(model, None, x)
    loss.backward()
    return float(loss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--quick", action="store_true", help="T = 100 and 300 only")
    p.add_argument("--num-sequences", type=int, default=20)
    p.add_argument("--max-all-steps", type=int, default=300, help='longest T timed with masks="all"')
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = [100, 300] if args.quick else args.steps
    print(machine_line())
    print(f"GaussianHMM, H = {H}, O = {O}, N = {args.num_sequences}, loss + gradient, {args.threads} thread(s)")
    print("| T | masks | dense | Kalman | dense / Kalman | rel. diff of the losses |")
    print("|---|---|---|---|---|---|")
    for T in steps:
        x = 0.1 * torch.randn(args.num_sequences, T, O, generator=torch.Generator().manual_seed(T)).cumsum(1)
        for masks in ("default", "order", "all"):
            if masks == "all" and T > args.max_all_steps:
                continue
            runs = [lambda seed, e=e: step(e, masks, x, seed) for e in (GaussianConditionals("dense"), GaussianHMMConditionals())]
            (dense, kalman), _ = run_interleaved(lambda seed: seed, runs, args.repeats)
            td, tk = statistics.median(dense[0]), statistics.median(kalman[0])
            diff = max(abs(a - b) / abs(a) for a, b in zip(dense[1], kalman[1]))
            print(f"| {T} | {masks} | {fmt_s(td)} s | {fmt_s(tk)} s | {fmt_ratio(td / tk)} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
