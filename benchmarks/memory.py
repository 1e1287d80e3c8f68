#!/usr/bin/env python
r"""Peak memory and time of masked pre-training with gradients, per schedule and engine.

Every measurement is **loss + gradient** (``differentiable_loss`` and
``torch.autograd.grad`` into the model's parameters) of
``MaskedPretrainingLoss(masks=..., share_masks=..., conditionals=...)`` at its
default ``chunk_size`` (``2**22`` elements per block of queries). Each
configuration runs in a **fresh subprocess**, so that the peaks of different
configurations do not mix: the subprocess builds the problem, runs one step and
reports

* *peak RSS*: the whole process's resident-memory high-water mark
  (``getrusage(RUSAGE_SELF).ru_maxrss``: Python, torch, pyro, the data, the
  masks and the step), and *step peak*: the largest resident memory sampled
  during the step minus the memory before it
  (:class:`harness.PeakRSS`), i.e. what the loss and its backward pass add;
* the step's wall time, and the ratio of the time with independent masks per
  datapoint (``share_masks=False``) to the time with one mask set shared by the
  batch (``share_masks=True``), both measured in this run.

Every block of queries after the first is recomputed in the backward pass
instead of kept alive for it (:func:`pyro_mpt.estimate.mpt_estimate`), so the
step peak is bounded by one block's working set: it does not grow with the
number of blocks, i.e. with N, D or ``num_masks`` at a fixed ``chunk_size``.
The second table shows it: the same configuration at N/4 and N.

Usage::

    .venv/bin/python benchmarks/memory.py                      # full run (~10 min on 2 loaded cores)
    .venv/bin/python benchmarks/memory.py --quick              # small sizes (< 1 min)
    .venv/bin/python benchmarks/memory.py --out-md docs/benchmarks.md
    .venv/bin/python benchmarks/memory.py --tables draws      # the importance engine's draws (~10 min)
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import PeakRSS, fmt_ratio, fmt_s, machine_line, max_rss_mb, write_markdown  # noqa: E402

MD_BEGIN = "<!-- memory:begin -->"
MD_END = "<!-- memory:end -->"
DRAWS_BEGIN = "<!-- memory-draws:begin -->"
DRAWS_END = "<!-- memory-draws:end -->"


# --------------------------------------------------------------------------- problems
def ppca_problem(N, D, K, dtype, seed=0):
    import pyro
    import pyro.distributions as dist

    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g, dtype=dtype) / math.sqrt(K)
    mu0 = torch.randn(D, generator=g, dtype=dtype)
    x = torch.randn(N, K, generator=g, dtype=dtype) @ W0.T + mu0 + 0.5 * torch.randn(N, D, generator=g, dtype=dtype)

    def ppca(x):
        W = pyro.param("W", W0)
        mu = pyro.param("mu", mu0)
        s = pyro.param("s", torch.tensor(0.7, dtype=dtype), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    return ppca, x


def gmm_problem(N, D, K, dtype, seed=0):
    import pyro
    import pyro.distributions as dist
    from pyro.infer import config_enumerate

    g = torch.Generator().manual_seed(seed)
    w0 = torch.softmax(torch.randn(K, generator=g, dtype=dtype), 0)
    locs0 = 3 * torch.randn(K, D, generator=g, dtype=dtype)
    x = locs0[torch.multinomial(w0, N, True, generator=g)] + torch.randn(N, D, generator=g, dtype=dtype)

    @config_enumerate
    def gmm(x):
        weights = pyro.param("weights", w0, constraint=dist.constraints.simplex)
        locs = pyro.param("locs", locs0)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(locs[z], 1.0).to_event(1), obs=x)

    return gmm, x


def engine_of(name, cfg=None):
    from pyro_mpt.conditionals import (
        EnumerateConditionals,
        GaussianConditionals,
        ImportanceConditionals,
        QuadratureConditionals,
    )

    return {
        "gaussian": lambda: GaussianConditionals(),
        "quadrature": lambda: QuadratureConditionals(),
        "importance": lambda: ImportanceConditionals(
            cfg.get("num_samples", 64), proposal="prior",
            **({"cache_elements": cfg["cache_elements"]} if "cache_elements" in cfg else {}),
        ),
        "enumerate": lambda: EnumerateConditionals(),
    }[name]()


# --------------------------------------------------------------------------- one configuration (subprocess)
def run_one(cfg):
    """Build the problem, run one loss + gradient step, return peaks and time."""
    import pyro
    from pyro_mpt import MaskedPretrainingLoss

    torch.set_num_threads(cfg["threads"])
    dtype = getattr(torch, cfg["dtype"])
    make = gmm_problem if cfg["model"] == "gmm" else ppca_problem
    model, x = make(cfg["N"], cfg["D"], cfg["K"], dtype)
    pyro.clear_param_store()
    model(x)  # register the parameters
    leaves = [p.unconstrained() for p in pyro.get_param_store().values()]
    loss = MaskedPretrainingLoss(
        masks=cfg["masks"], share_masks=cfg["share"], conditionals=engine_of(cfg["engine"], cfg), num_masks=1
    )
    pyro.set_rng_seed(0)
    before = PeakRSS.rss()
    sampler = PeakRSS()
    sampler.start()
    t0 = time.perf_counter()
    value = loss.differentiable_loss(model, None, x)
    torch.autograd.grad(value, leaves)
    seconds = time.perf_counter() - t0
    step_peak = sampler.stop() - before
    return {"seconds": seconds, "peak_mb": max_rss_mb(), "step_mb": step_peak / 2**20}


#: glibc's malloc raises its mmap threshold to the size of each freed large block, after
#: which blocks of that size come from the heap, where small long-lived allocations
#: between them keep freed memory from returning to the system: the resident set then
#: grows with the number of blocks although the live tensors do not. A fixed threshold
#: (this environment variable) turns that off; the bounded table is measured both ways.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def in_subprocess(cfg, env=None):
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)],
        capture_output=True, text=True, check=False, env=dict(os.environ, **(env or {})),
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the tables
def configurations(quick):
    """(label, config) rows: every schedule on the Gaussian engine, then the other engines."""
    N, D = (200, 128) if quick else (1000, 512)
    rows = []
    for masks in ["all", "nested", "uniform", "pll", "order"]:
        rows.append((f"`{masks}`, gaussian, PPCA N={N} D={D} K=2", dict(model="ppca", N=N, D=D, K=2, masks=masks, engine="gaussian")))
    n_small = 200 if quick else 1000
    rows.append((f"`exhaustive`, gaussian, PPCA N={n_small} D=12 K=2", dict(model="ppca", N=n_small, D=12, K=2, masks="exhaustive", engine="gaussian")))
    n_other, d_other = (100, 16) if quick else (400, 32)
    rows.append((f"`all`, quadrature, PPCA N={n_other} D={d_other} K=1", dict(model="ppca", N=n_other, D=d_other, K=1, masks="all", engine="quadrature")))
    rows.append((f"`all`, importance (64 prior draws), PPCA N={n_other} D={d_other} K=2", dict(model="ppca", N=n_other, D=d_other, K=2, masks="all", engine="importance")))
    rows.append((f"`all`, enumerate, GMM N={n_other} D={d_other} K=3", dict(model="gmm", N=n_other, D=d_other, K=3, masks="all", engine="enumerate")))
    return rows


def cell(r, key, fmt):
    return r["error"][:40] if "error" in r else fmt(r[key])


def allocator_cells(default, fixed):
    """The cells of one run with glibc's default malloc and with a fixed mmap threshold: peak
    RSS and step peak of each, then the time of each."""
    return (
        f"{cell(default, 'peak_mb', mb)} | {cell(default, 'step_mb', mb)} | {cell(fixed, 'peak_mb', mb)} "
        f"| {cell(fixed, 'step_mb', mb)} | {cell(default, 'seconds', fmt_s)} s | {cell(fixed, 'seconds', fmt_s)} s"
    )


def mb(v):
    return f"{v:.0f} MB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per subprocess")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out-md", default=None, help="write the tables into this markdown file")
    parser.add_argument("--tables", nargs="+", default=["schedules", "draws"], choices=["schedules", "draws"],
                        help="which tables: every schedule and engine with the chunk_size bound (schedules), "
                             "the importance engine's shared draws kept and streamed (draws)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    common = dict(threads=args.threads, dtype=args.dtype)
    base = in_subprocess(dict(common, model="ppca", N=10, D=4, K=1, masks="order", share=True, engine="gaussian"))
    lines = [
        f"Machine: {machine_line()}; {args.threads} torch thread(s) per run; {args.dtype}; default "
        f"`chunk_size` (2**22 elements per block); one loss + gradient step per fresh process. "
        f"A process that only imports and runs a tiny model peaks at {mb(base['peak_mb'])}.",
        "",
        "| schedule, engine, model | peak RSS, indep | peak RSS, shared | step peak, indep | step peak, shared "
        "| time, indep | time, shared | indep / shared |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if "draws" in args.tables:
        draws = [lines[0]] + draws_table(args.quick, common)
        if args.out_md:
            write_markdown(args.out_md, "\n".join(draws), DRAWS_BEGIN, DRAWS_END)
    if "schedules" not in args.tables:
        return
    print("\n".join(lines), flush=True)
    target = None
    for label, cfg in configurations(args.quick):
        res = {share: in_subprocess(dict(common, **cfg, share=share)) for share in (False, True)}
        ind, sh = res[False], res[True]
        if cfg["masks"] == "all" and cfg["engine"] == "gaussian":
            target = (cfg, ind)
        ratio = fmt_ratio(ind["seconds"] / sh["seconds"]) if "error" not in ind and "error" not in sh else "n/a"
        line = (
            f"| {label} | {cell(ind, 'peak_mb', mb)} | {cell(sh, 'peak_mb', mb)} | {cell(ind, 'step_mb', mb)} "
            f"| {cell(sh, 'step_mb', mb)} | {cell(ind, 'seconds', fmt_s)} s | {cell(sh, 'seconds', fmt_s)} s | {ratio} |"
        )
        lines.append(line)
        print(line, flush=True)
    lines += bounded_table(target, common)
    if args.out_md:
        write_markdown(args.out_md, "\n".join(lines), MD_BEGIN, MD_END)


def bounded_table(target, common):
    """The same schedule at N/4 and N (4x the blocks), with glibc's default malloc and with
    a fixed mmap threshold."""
    cfg, full = target
    lines = []
    N, D = cfg["N"], cfg["D"]
    lines += [
        "",
        f"Bounded by `chunk_size`: `all` with independent masks, gaussian, PPCA D={D} K=2, at N/4 and N "
        "(four times the blocks of queries), with glibc's default `malloc` and with "
        f"`MALLOC_MMAP_THRESHOLD_={2**20}` in the environment:",
        "",
        "| N | blocks | peak RSS, default malloc | step peak, default | peak RSS, fixed mmap threshold "
        "| step peak, fixed | time, default | time, fixed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in (N // 4, N):
        default = full if n == N else in_subprocess(dict(common, **dict(cfg, N=n, share=False)))
        fixed = in_subprocess(dict(common, **dict(cfg, N=n, share=False)), MALLOC_ENV)
        blocks = math.ceil(D / max(1, 2**22 // (n * D)))
        line = (
            f"| {n} | {blocks} | {allocator_cells(default, fixed)} |"
        )
        lines.append(line)
        print(line, flush=True)
    return lines


def draws_table(quick, common):
    """The importance engine's draws shared by every query, kept (default ``cache_elements``)
    or streamed (0), independent masks, both allocators. ``"all"`` (D queries per datapoint)
    at half the datapoints, so that its eight runs take minutes, not half an hour."""
    D, K, S = (64, 10, 64) if quick else (200, 10, 256)
    sizes = {"uniform": 400 if quick else 2000, "all": 200 if quick else 1000}
    lines = [
        "",
        f"The importance engine's prior draws shared by every query (`ImportanceConditionals({S}, "
        f'proposal="prior")`): PPCA D={D} K={K}, a table of S n D entries, masks per datapoint, '
        "kept (default `cache_elements=2**27`) or streamed (`cache_elements=0`):",
        "",
        "| masks | N | table | peak RSS, default malloc | step peak, default | peak RSS, fixed mmap threshold "
        "| step peak, fixed | time, default | time, fixed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for masks, N in sizes.items():
        for label, extra in (("kept", {}), ("streamed", {"cache_elements": 0})):
            cfg = dict(common, model="ppca", N=N, D=D, K=K, masks=masks, engine="importance", num_samples=S,
                       share=False, **extra)
            default, fixed = in_subprocess(cfg), in_subprocess(cfg, MALLOC_ENV)
            line = (
                f"| `{masks}` | {N} | {label}, {S * N * D:.3g} entries | {allocator_cells(default, fixed)} |"
            )
            lines.append(line)
            print(line, flush=True)
    return lines


if __name__ == "__main__":
    main()
