"""The timing harness every benchmark script shares.

Benchmarks here print *ratios measured in one run* on whatever machine runs
them (speed goals never live in timed tests). They share:

* :func:`timed` / :func:`timed_cpu`: one call, for costs that happen once
  (a first call, a whole curve);
* :func:`run_interleaved` / :func:`run_timed`: repeated timings of several
  implementations on the same inputs, interleaved round by round so that a
  change in the machine's load hits all of them alike; :class:`Timing`
  summarizes them (median ± sd, times an extrapolation factor);
* :class:`PeakRSS` (a sampler thread) and :func:`max_rss_mb` (the kernel's
  high-water mark) for peak memory;
* :func:`gemm_gflops`: the machine's float32 matrix-product rate, the ceiling
  that FLOP-count columns are measured against;
* :func:`machine_line` and :func:`write_markdown`: the provenance line and the
  regenerated block of a docs page.

Run a benchmark from the repository root, e.g. ``python benchmarks/ppca_speed.py``;
the scripts import this module as their sibling.
"""

import math
import os
import platform
import resource
import statistics
import threading
import time

import torch

__all__ = [
    "Timing", "fmt_s", "fmt_ratio", "timed", "timed_cpu", "run_interleaved", "run_timed", "PeakRSS", "max_rss_mb",
    "gemm_gflops", "machine_line", "write_markdown",
]

#: a warm-up slower than this (seconds) counts as the first of only two timed runs
SLOW_RUN_S = 8.0
#: a function faster than this is called several times per measurement (the mean is kept)
MIN_MEASURE_S = 0.1


class Timing:
    """Median and standard deviation of repeated timings, times a factor (an extrapolation)."""

    def __init__(self, seconds, factor=1.0, note=""):
        self.raw = seconds
        self.factor = factor
        self.note = note

    @property
    def median(self):
        return statistics.median(self.raw) * self.factor

    @property
    def sd(self):
        return (statistics.stdev(self.raw) if len(self.raw) > 1 else 0.0) * self.factor

    @property
    def extrapolated(self):
        return self.factor != 1.0

    def cell(self):
        mark = "*" if self.extrapolated else ""
        return f"{fmt_s(self.median)} ± {fmt_s(self.sd)}{mark}"


def fmt_s(t):
    """Seconds with the digits that matter."""
    if t >= 100:
        return f"{t:.0f}"
    if t >= 10:
        return f"{t:.1f}"
    if t >= 1:
        return f"{t:.2f}"
    if t >= 0.01:
        return f"{t:.3f}"
    return f"{t:.2g}"


def fmt_ratio(r):
    return f"{r:.0f}×" if r >= 100 else f"{r:.1f}×" if r >= 10 else f"{r:.2f}×"


def timed(fn):
    """``(fn(), seconds)``."""
    t = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t


def timed_cpu(fn):
    """``(fn(), wall seconds, CPU seconds of this process)``: a CPU time above the wall
    time means several threads worked; far below it, the process waited (load, I/O)."""
    t, c = time.perf_counter(), time.process_time()
    r = fn()
    return r, time.perf_counter() - t, time.process_time() - c


def run_interleaved(prepare, runs, repeats, warmup=1, first_seed=0):
    """Time several functions on the same inputs, interleaved.

    ``prepare(seed)`` is untimed; each ``run(prepared)`` of ``runs`` is timed.
    Seed ``r`` prepares round ``r``, so every repeat sees fresh inputs (e.g.
    masks). A function faster than :data:`MIN_MEASURE_S` is called several
    times per measurement; a round slower than :data:`SLOW_RUN_S` ends the
    warm-up and caps the repeats at two.

    :returns: per function ``(times, outputs)`` of the timed rounds, and the
        seeds of those rounds.
    """
    times = [[] for _ in runs]
    outs = [[] for _ in runs]
    calls = [1 for _ in runs]  # calls per measurement, set from the first round
    seeds = []
    r = first_seed
    while len(times[0]) < repeats:
        prepared = prepare(r)
        round_times, round_outs = [], []
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            for _ in range(calls[i]):
                out = run(prepared)
            round_times.append((time.perf_counter() - t0) / calls[i])
            round_outs.append(out)
            if r == first_seed:
                calls[i] = max(1, min(50, math.ceil(MIN_MEASURE_S / max(round_times[-1], 1e-6))))
        slow = max(round_times) > SLOW_RUN_S
        if r >= first_seed + warmup or slow:
            seeds.append(r)
            for i in range(len(runs)):
                times[i].append(round_times[i])
                outs[i].append(round_outs[i])
        if slow:
            repeats = min(repeats, 2)
        r += 1
    return list(zip(times, outs)), seeds


def run_timed(prepare, run, repeats, warmup=1, first_seed=0):
    """:func:`run_interleaved` for one function: ``(times, outputs)``."""
    return run_interleaved(prepare, [run], repeats, warmup, first_seed)[0][0]


class PeakRSS(threading.Thread):
    """Samples this process's resident memory every few ms; ``stop()`` returns the largest seen (bytes).

    Unlike :func:`max_rss_mb`, it measures the peak of one stretch of code, not of the process's life.
    """

    def __init__(self, interval=0.002):
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_event = interval, self.rss(), threading.Event()

    @staticmethod
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def stop(self):
        self._stop_event.set()
        self.join()
        return self.peak


def max_rss_mb():
    """The process's resident-memory high-water mark so far, in MiB (the kernel's count)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def gemm_gflops(m, k, n, threads=None, repeats=5, dtype=torch.float32):
    """GFLOP/s of an ``(m, k) @ (k, n)`` matrix product, best of ``repeats``: the machine's ceiling."""
    if threads is not None:
        torch.set_num_threads(threads)
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    best = min(timed(lambda: a @ b)[1] for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def machine_line():
    """CPU, cores, library versions, threads and load: the provenance of a table."""
    import pyro

    try:
        load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), pyro {pyro.__version__}, "
        f"Python {platform.python_version()}; load average (1/5/15 min) {load}"
    )


def write_markdown(path, text, begin, end, title="# Benchmarks"):
    """Replace the block between the markers ``begin`` and ``end`` of ``path`` (appended if absent)."""
    block = f"{begin}\n{text}\n{end}"
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if begin in old and end in old:
            pre, rest = old.split(begin, 1)
            post = rest.split(end, 1)[1]
            new = pre + block + post
        else:
            new = old.rstrip("\n") + "\n\n" + block + "\n"
    else:
        new = f"{title}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(new)
