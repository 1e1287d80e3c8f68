#!/usr/bin/env python
r"""Speed of the defaults a new user meets, printed as ratios measured in one run.

Four measurements, float32, on one thread unless ``--threads`` says otherwise
(on a machine shared with other jobs, several OpenMP threads wait on each other
and make small batched kernels 10-100 times slower at random; one thread gives
reproducible times):

1. ``schedules`` -- loss + gradient of PPCA (K=5, N=200) for ``masks="all"``
   (the paper's estimator: independent random masks for every size) against
   ``masks="nested"`` (the first M tokens of one permutation), with masks
   independent per datapoint and shared by the batch, at D = 64, 128, 200.
   Equal query counts, so the ratio measures the cost of drawing a fresh mask
   per query.
2. ``curve`` -- ``MaskedPretrainingLoss().curve(ppca, None, x)`` with its
   defaults on PPCA (K=40) of scikit-learn's ``load_digits`` (N=1797, D=64),
   against the same curve with masks drawn per datapoint
   (``MaskedPretrainingLoss(share_masks=False)``, the default before curves
   shared their masks); goal: the default at most 2 s.
3. ``first`` -- the first ``Evidence`` call and the first loss evaluation in a
   fresh interpreter, minus a second identical call: the one-off import and
   tracing overhead; goal at most 0.5 s.
4. ``evidence`` -- ``Evidence(ppca)(x).sum()`` with its gradient at K=50,
   D=512, N=1000, against a bare
   ``LowRankMultivariateNormal(mu, W, s^2 I).log_prob(x).sum()`` with its
   gradient; goal at most 1.5x.

Measured on the 2-core development machine, idle (one thread; ratios are
from one run; earlier runs, with other jobs on the machine, in parentheses):

* schedules: "all" / "nested" = 1.08-1.19x per datapoint (the extra cost is
  drawing a mask per query: integer keys and a counting pass,
  ``pyro_mpt.mask_draws.smallest_keys``), 1.05-1.20x shared (0.9-1.3x, 1.0-1.2x);
* curve: 0.12 s with the defaults since shared "all" masks are drawn two a size
  (0.030 s with one a size, whose standard errors were too small), 7.0 s with masks per
  datapoint (57x); before that change: 0.030 s and 4.3 s with masks per
  datapoint (144x) (loaded: 0.46-0.78 s and 23-32 s);
* first call: 0.003 s of overhead for Evidence (2.4 s before, when
  ``torch.broadcast_shapes`` imported sympy), 0.001 s for the loss after it;
* evidence: 1.33x (9 ms against 7 ms; 1.1-1.4x loaded). What remains beyond
  the bare log-density is the model's own trace (its ``z @ W.T`` and Pyro's
  argument checks), the marginal's derivation and the value checks of the
  data (one sum: finite iff every token is). Earlier: 10-35x, from the
  backward pass through the (K + 2, N, D) expansion of the observation's
  location, then 1.5-1.7x with an elementwise finiteness and support check of
  the data (3.4 of 16 ms).

Usage::

    python benchmarks/defaults_speed.py                 # all four
    python benchmarks/defaults_speed.py curve first     # some of them
"""

import argparse
import math
import os
import subprocess
import sys
import textwrap

import torch

import pyro
import pyro.distributions as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the sibling harness
from harness import Timing, machine_line, run_timed  # noqa: E402


def ppca_model(D, K, x0, seed=0):
    """A PPCA Pyro model with random parameters registered in the param store."""
    g = torch.Generator().manual_seed(seed)
    pyro.clear_param_store()
    W0 = torch.randn(D, K, generator=g, dtype=x0.dtype) / math.sqrt(K)
    mu0 = x0.mean(0)
    pyro.param("W", W0)
    pyro.param("mu", mu0)
    pyro.param("s", torch.tensor(0.5, dtype=x0.dtype), constraint=dist.constraints.positive)

    def ppca(x):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    return ppca


def ppca_data(N, D, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=dtype) / math.sqrt(K)
    return torch.randn(N, K, generator=g, dtype=dtype) @ W.T + 0.5 * torch.randn(N, D, generator=g, dtype=dtype)


def timed(fn, repeats=3, warmup=1):
    """Median wall time of ``fn()`` over ``repeats`` measurements after ``warmup`` (the harness's
    :func:`~harness.run_timed`; inputs are fixed, so its per-round seed is unused)."""
    times, _ = run_timed(lambda seed: None, lambda _: fn(), repeats, warmup)
    return Timing(times).median


def params():
    return [pyro.param(n).unconstrained() for n in ("W", "mu", "s")]


def loss_grad(loss, model, x):
    def run():
        for p in params():
            p.grad = None
        loss.differentiable_loss(model, None, x).backward()

    return run


# --------------------------------------------------------------------------- 1
def bench_schedules(args):
    from pyro_mpt import MaskedPretrainingLoss

    print("1. loss + gradient, PPCA K=5, N=200, float32, num_masks=1: 'all' (independent masks per size) vs 'nested'")
    print(f"   {'D':>4s} {'masks':>9s} {'all':>9s} {'nested':>9s} {'all/nested':>10s}")
    for D in (64, 128, 200):
        x = ppca_data(200, D, 5)
        model = ppca_model(D, 5, x)
        row = {}
        for share in (False, True):
            for name in ("all", "nested"):
                loss = MaskedPretrainingLoss(conditionals="gaussian", masks=name, share_masks=share)
                row[name] = timed(loss_grad(loss, model, x), repeats=args.repeats)
            kind = "shared" if share else "per-datum"
            print(f"   {D:4d} {kind:>9s} {row['all']:8.3f}s {row['nested']:8.3f}s {row['all'] / row['nested']:9.2f}x")


# --------------------------------------------------------------------------- 2
def bench_curve(args):
    from sklearn.datasets import load_digits

    from pyro_mpt import MaskedPretrainingLoss

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    model = ppca_model(64, 40, x)
    default = timed(lambda: MaskedPretrainingLoss().curve(model, None, x), repeats=args.repeats)
    per_datum = timed(
        lambda: MaskedPretrainingLoss(share_masks=False).curve(model, None, x),
        repeats=1,
        warmup=0,
    )
    print("2. curve() on PPCA K=40 of load_digits (N=1797, D=64), float32")
    print(f"   defaults: {default:.3f} s (goal <= 2 s: {default / 2.0:.2f} of it)")
    print(f"   masks per datapoint (share_masks=False): {per_datum:.3f} s = {per_datum / default:.1f}x the default")


# --------------------------------------------------------------------------- 3
FIRST_CALL = textwrap.dedent(
    """
    import time
    t0 = time.perf_counter()
    import math, sys, torch, pyro, pyro.distributions as dist
    torch.set_num_threads(int(sys.argv[1]))
    from pyro_mpt import Evidence, MaskedPretrainingLoss
    t_import = time.perf_counter() - t0
    sys.path.insert(0, sys.argv[2])
    from harness import timed  # after the import time is taken: the harness imports torch
    torch.manual_seed(0)
    D, K, N = 20, 3, 100
    x = torch.randn(N, D)
    W = torch.randn(D, K)

    def ppca(x):
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    def once(fn):
        return timed(fn)[1]

    ev = lambda: Evidence(ppca)(x).sum()
    lo = lambda: MaskedPretrainingLoss(masks="uniform").loss(ppca, None, x)
    first_ev, second_ev = once(ev), once(ev)
    first_lo, second_lo = once(lo), once(lo)
    print(t_import, first_ev - second_ev, first_lo - second_lo, second_ev, second_lo)
    """
)


def bench_first(args):
    threads = str(torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, threads, HERE], capture_output=True, text=True, check=True)
    t_import, ev, lo, ev2, lo2 = map(float, out.stdout.split())
    print("3. fresh interpreter, PPCA D=20, K=3, N=100")
    print(f"   import torch + pyro + pyro_mpt: {t_import:.2f} s (not counted)")
    print(f"   first Evidence call overhead (first - second call): {ev:.3f} s (goal <= 0.5 s: {ev / 0.5:.2f} of it; "
          f"a warm call takes {ev2:.3f} s)")
    print(f"   first loss call overhead (after Evidence): {lo:.3f} s (a warm call takes {lo2:.3f} s)")


# --------------------------------------------------------------------------- 4
def bench_evidence(args):
    from pyro_mpt import Evidence

    D, K, N = 512, 50, 1000
    x = ppca_data(N, D, K)
    model = ppca_model(D, K, x)
    leaves = params()

    def ours():
        for p in leaves:
            p.grad = None
        Evidence(model)(x).sum().backward()

    def bare():
        for p in leaves:
            p.grad = None
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        cov_diag = (s**2).expand(D)
        torch.distributions.LowRankMultivariateNormal(mu, W, cov_diag).log_prob(x).sum().backward()

    t_ours, t_bare = timed(ours, repeats=args.repeats), timed(bare, repeats=args.repeats)
    print(f"4. log p(x) + gradient, PPCA D={D}, K={K}, N={N}, float32")
    print(f"   Evidence: {t_ours:.3f} s, bare LowRankMultivariateNormal.log_prob: {t_bare:.3f} s, "
          f"ratio {t_ours / t_bare:.2f}x (goal <= 1.5x)")


BENCHES = {"schedules": bench_schedules, "curve": bench_curve, "first": bench_first, "evidence": bench_evidence}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", nargs="*", choices=sorted(BENCHES) + [[]], default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    for name in args.which or list(BENCHES):
        BENCHES[name](args)


if __name__ == "__main__":
    main()
