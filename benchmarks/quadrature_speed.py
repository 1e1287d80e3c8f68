#!/usr/bin/env python
r"""Speed, memory and accuracy of pyro_mpt's quadrature conditionals on a linear Bernoulli VAE.

The model is the linear VAE of the paper's Fig. 3 (top),
:math:`z \sim \mathcal N(0, I_K)`, :math:`x_d \sim \operatorname{Bernoulli}(\sigma(w_d^\top z + b_d))`,
with synthetic data drawn from it (``W`` with standard-normal entries).

1. **Speed and memory.** Time per SVI step (``MaskedPretrainingLoss(conditionals=
   QuadratureConditionals(...))``, one uniform-size mask per datapoint, loss +
   gradient + Adam update, float32) and peak resident memory, at
   :math:`(N, D, K) = (1797, 64, 2)` (the size of scikit-learn's digits) and
   :math:`(2000, 784, 2)` (the paper's 2000 MNIST images), for prior-centred
   and adaptive grids. Each configuration runs in a fresh subprocess, so its
   peak RSS is its own; "first step" includes the cold adaptive search (coarse
   grid + Newton), later steps start the search from the previous centres.
2. **Accuracy.** :math:`\log p(x)` per datapoint against a very fine reference
   (adaptive grid with 64 nodes per dim, float64, checked against one with 48)
   as a function of the number of nodes per latent dimension, for both rules,
   at D = 64 and D = 784.

Usage::

    .venv/bin/python benchmarks/quadrature_speed.py               # full run (~4 min on 2 idle cores, ~15 busy)
    .venv/bin/python benchmarks/quadrature_speed.py --quick       # smoke test (< 1 min)
    .venv/bin/python benchmarks/quadrature_speed.py --out-md outputs/quadrature_benchmark.md
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_mpt import Evidence, MaskedPretrainingLoss, QuadratureConditionals
from pyro_mpt.observed_tokens import trace_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import max_rss_mb, timed, timed_cpu  # noqa: E402

K = 2


def make_data(N, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    b0 = torch.randn(D, generator=g, dtype=torch.float64)
    z = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = torch.bernoulli(torch.sigmoid(z @ W0.T + b0), generator=g)
    return x.to(dtype), W0.to(dtype), b0.to(dtype)


def make_model(W_init, b_init):
    def model(x):
        W = pyro.param("W", W_init.clone())
        b = pyro.param("b", b_init.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T + b).to_event(1), obs=x)

    return model


# ---------------------------------------------------------------------- speed (worker)
def worker(N, D, num_nodes, adaptive, steps):
    """One speed/memory configuration; prints a JSON line."""
    x, W0, b0 = make_data(N, D)
    g = torch.Generator().manual_seed(1)
    model = make_model(0.5 * torch.randn(D, K, generator=g), torch.zeros(D))

    def make_svi():
        engine = QuadratureConditionals(num_nodes=num_nodes, adaptive=adaptive, min_ess=None)
        loss = MaskedPretrainingLoss(conditionals=engine, masks="uniform", num_masks=1)
        return engine, SVI(model, lambda x: None, Adam({"lr": 0.01}), loss)

    # warm-up on a few datapoints: one-time costs of torch and pyro (lazy imports)
    make_svi()[1].step(x[:4])
    engine, svi = make_svi()
    base = max_rss_mb()
    # one call per step: the first step (grids, warm starts) is reported apart from the later ones
    times, cpu = [], []
    for _ in range(steps):
        _, wall, c = timed_cpu(lambda: svi.step(x))
        times.append(wall)
        cpu.append(c)
    tokens = trace_tokens(model, None, (x,), {})
    with torch.no_grad():
        state = engine.prepare(tokens, model, None, (x,), {})
    later = lambda v: sum(v[1:]) / (len(v) - 1) if len(v) > 1 else None  # noqa: E731
    print(json.dumps({
        "N": N, "D": D, "num_nodes": num_nodes, "adaptive": adaptive,
        "Q": state.num_nodes, "streamed": state.chunks is None,
        "first": times[0], "later": later(times), "first_cpu": cpu[0], "later_cpu": later(cpu),
        "peak_mb": max_rss_mb(), "base_mb": base, "load": os.getloadavg()[0],
    }))


def run_speed(configs, steps, threads):
    rows = []
    for N, D, m, adaptive in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(N), str(D), str(m),
               str(int(adaptive)), str(steps), "--threads", str(threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"worker {cmd} failed:\n{out.stderr}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"  N={N} D={D} {'adaptive' if adaptive else 'prior'} m={m}: "
              f"first {row['first']:.2f} s, later {row['later'] or float('nan'):.2f} s, "
              f"peak {row['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------- accuracy
def log_evidence(model, x, num_nodes, adaptive):
    with torch.no_grad():
        return Evidence(model, method="quadrature", num_nodes=num_nodes, adaptive=adaptive,
                        error_nodes=1, min_ess=None)(x)


def run_accuracy(sizes, N, adaptive_nodes, prior_nodes, reference_nodes):
    results = {}
    for D in sizes:
        x, W0, b0 = make_data(N, D, seed=2, dtype=torch.float64)
        pyro.clear_param_store()
        model = make_model(W0, b0)
        ref = log_evidence(model, x, reference_nodes, True)
        check = log_evidence(model, x, (3 * reference_nodes) // 4, True)
        col = {"reference_check": float((ref - check).abs().max())}
        for adaptive, nodes in ((True, adaptive_nodes), (False, prior_nodes[D])):
            for m in nodes:
                v, sec = timed(lambda: log_evidence(model, x, m, adaptive))
                err = (v - ref).abs()
                col[(adaptive, m)] = (float(err.mean()), float(err.max()), sec)
                print(f"  D={D} {'adaptive' if adaptive else 'prior'} m={m}: mean |err| {float(err.mean()):.2e}",
                      file=sys.stderr, flush=True)
        results[D] = col
    return results


# ---------------------------------------------------------------------- tables
def speed_table(rows):
    lines = [
        "| N | D | K | grid | nodes/dim | Q | table | first step: wall / CPU (s) | later steps: wall / CPU (s) "
        "| peak RSS (MB) | RSS over baseline (MB) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        later = "" if r["later"] is None else f"{r['later']:.2f} / {r['later_cpu']:.2f}"
        lines.append(
            f"| {r['N']} | {r['D']} | {K} | {'adaptive' if r['adaptive'] else 'prior-centred'} | {r['num_nodes']} "
            f"| {r['Q']} | {'streamed' if r['streamed'] else 'cached'} | {r['first']:.2f} / {r['first_cpu']:.2f} "
            f"| {later} | {r['peak_mb']:.0f} | {r['peak_mb'] - r['base_mb']:.0f} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def accuracy_table(results, N, reference_nodes):
    sizes = list(results)
    lines = [
        "| grid | nodes/dim | " + " | ".join(f"D={D}: mean / max abs error (nats)" for D in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    keys = sorted({k for col in results.values() for k in col if k != "reference_check"}, key=lambda k: (not k[0], k[1]))
    for adaptive, m in keys:
        cells = []
        for D in sizes:
            v = results[D].get((adaptive, m))
            cells.append("--" if v is None else f"{v[0]:.1e} / {v[1]:.1e}")
        lines.append(f"| {'adaptive' if adaptive else 'prior-centred'} | {m} | " + " | ".join(cells) + " |")
    checks = ", ".join(f"D={D}: {results[D]['reference_check']:.1e}" for D in sizes)
    lines.append("")
    lines.append(
        f"Errors of log p(x) per datapoint (N={N} datapoints drawn from the model, true parameters, float64) "
        f"against an adaptive grid of {reference_nodes} nodes per dim; that reference moves by at most "
        f"{checks} nats when it uses {(3 * reference_nodes) // 4} nodes per dim instead."
    )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--steps", type=int, default=3, help="SVI steps per speed configuration (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out-md", help="also write the tables to this markdown file")
    p.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        N, D, m, adaptive, steps = args.worker
        worker(N, D, m, bool(adaptive), steps)
        return

    if args.quick:
        configs = [(300, 64, 16, False), (300, 64, 8, True), (200, 784, 8, True)]
        sizes, acc_N, adaptive_nodes = [64, 784], 10, [2, 4, 8]
        prior_nodes = {64: [16, 64], 784: [16]}
        reference_nodes = 24
    else:
        configs = [
            (1797, 64, 48, False), (1797, 64, 8, True), (1797, 64, 4, True),
            (2000, 784, 16, False), (2000, 784, 8, True), (2000, 784, 4, True),
        ]
        sizes, acc_N, adaptive_nodes = [64, 784], 20, [2, 3, 4, 6, 8, 12, 16]
        prior_nodes = {64: [8, 16, 32, 64, 128, 256], 784: [16, 32, 64, 128]}
        reference_nodes = 64

    start = time.perf_counter()
    print("speed and memory (one subprocess per configuration)...", file=sys.stderr)
    rows = run_speed(configs, args.steps, args.threads)
    print("accuracy...", file=sys.stderr)
    acc = run_accuracy(sizes, acc_N, adaptive_nodes, prior_nodes, reference_nodes)

    text = [
        "### Time per SVI step and peak memory (float32, one uniform mask per datapoint)",
        "",
        speed_table(rows),
        "",
        f"{args.steps} steps per configuration on {args.threads} torch threads; 'later steps' is their mean after the "
        f"first. CPU time counts all threads. 'load avg': the machine's 1-minute load average at the end of "
        f"the configuration (other jobs slow the wall times). 'table': whether the n x Q x D table of "
        f"log p(x_d | z_q) is kept for the step (cached) or re-computed node chunk by node chunk under "
        f"activation checkpointing (streamed).",
        "",
        "### Accuracy of log p(x) against the number of nodes",
        "",
        accuracy_table(acc, acc_N, reference_nodes),
    ]
    text = "\n".join(text)
    print()
    print(text)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.out_md:
        os.makedirs(os.path.dirname(args.out_md) or ".", exist_ok=True)
        with open(args.out_md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
