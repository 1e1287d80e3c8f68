#!/usr/bin/env python
r"""Where an SVI step goes with the amortized and mixture engines, on Pyro's tutorial VAE.

The model is the VAE of Pyro's tutorial as :class:`pyro_mpt.experiments.vae.DeepVAE`
writes it: :math:`z \in \mathbb R^4`, a 4-400-784 Softplus decoder with a
Bernoulli observation of the 784 pixels, a 784-400-8 encoder as the guide;
a batch of 256 binarized images (scikit-learn's digits, upsampled to 28x28:
the timings do not depend on the pixels), float32, one thread.

For each engine (``"encode_decode"``, ``"importance"``, ``"quadrature"`` and
what ``"auto"`` picks with this guide), with its defaults and the loss's
default schedule (one uniform-size mask per datapoint), the script times an
SVI step (loss + gradient + Adam) interleaved, round by round, with

* a ``Trace_ELBO`` step on the same model and guide, and
* the engine's **unavoidable evaluations** ("floor"): the encoder and decoder
  forward passes, the observation's log-densities or draws, and the backward
  pass through the decoder that the engine's algorithm needs at its sizes,
  written in plain PyTorch (no Pyro, no reductions; the Bernoulli log-density
  by its cheapest closed form, :math:`-\operatorname{softplus}(\ell(1-2x))`, as the
  engines read it): one trace of model and
  guide on the batch (to read the tokens), then

  - ``encode_decode`` (``S`` samples, ``T`` rounds, ``q`` masks): the decoder
    at the prior mean; ``T`` rounds of encoder + decoder + Bernoulli draw on
    ``S q n`` completed inputs; the encoder on them once more; the decoder
    with its gradient on the ``S q n`` final draws;
  - ``importance`` (guide proposal, ``S`` draws, ``C`` chains, ``T`` rounds,
    prior share ``alpha``): the decoder at the prior mean; ``T`` rounds on
    ``C q n`` chains; the encoder on the chains' states once more; the
    guide's density of every draw under every chain's component; the prior
    density; the decoder with its gradient on the ``S q n`` draws;
  - ``quadrature`` (``Q = m^K`` nodes): the decoder with its gradient on the
    ``Q n`` node values (in the engine's node chunks), and on ``Q n`` more for
    each query with a context grid of its own (``context_grids``, counted in one
    evaluation of the loss before the timings). The adaptive grid's Newton search
    is not in the floor: its cost is its own column.

The ratio *step / floor* is how far the engine is from the work it cannot
avoid. One more, instrumented step per engine splits the step into the
time inside the encoder and decoder forward passes, inside the observation's
``log_prob``/``sample``, inside Pyro's tracing (exclusive of the networks),
inside the backward pass (exclusive of any forward recomputation), and the
rest: the engine's reductions (log-sum-exps, weights, diagnostics) and
Python.

``--knobs`` also times the knobs that trade accuracy for time: the number of
samples and encode-decode rounds, the number of importance draws, the
quadrature nodes per dimension, each as a ratio to ``Trace_ELBO``.

Usage::

    python benchmarks/amortized_speed.py                        # all engines (~5 min on 2 idle cores)
    python benchmarks/amortized_speed.py encode_decode importance --repeats 5
    python benchmarks/amortized_speed.py --knobs --out-md docs/benchmarks.md
"""

import argparse
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import Adam

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import EncodeDecodeConditionals, ImportanceConditionals, QuadratureConditionals
from pyro_mpt.conditionals.quadrature_rules import default_num_nodes
from pyro_mpt.experiments.vae import DeepVAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import Timing, fmt_ratio, machine_line, run_interleaved, timed, write_markdown  # noqa: E402

ENGINES = ("encode_decode", "importance", "quadrature", "auto")
BEGIN, END = "<!-- amortized_speed:begin -->", "<!-- amortized_speed:end -->"


# ---------------------------------------------------------------------- data and model
def make_data(n, seed=0):
    """``n`` binarized 28x28 digits, ``(n, 784)`` float32."""
    from sklearn.datasets import load_digits

    img = torch.tensor(load_digits().images, dtype=torch.float32)[:, None] / 16.0
    img = F.interpolate(img, size=(28, 28), mode="bilinear", align_corners=False)[:, 0]
    x = (img > 0.5).float().reshape(-1, 784)
    g = torch.Generator().manual_seed(seed)
    return x[torch.randint(0, x.shape[0], (n,), generator=g)]


def make_vae(latent, hidden, seed=0):
    torch.manual_seed(seed)
    return DeepVAE(784, latent_dim=latent, hidden=(hidden,))


def engine_for(name, **options):
    if name == "auto":
        return "auto"
    cls = {"encode_decode": EncodeDecodeConditionals, "importance": ImportanceConditionals,
           "quadrature": QuadratureConditionals}[name]
    return cls(**options)


# ---------------------------------------------------------------------- floors
def bernoulli_log_prob(logits, x):
    """The Bernoulli log-density at binary tokens by its cheapest closed form (as the engines read it)."""
    return -F.softplus(logits * (1 - 2 * x))


def _encode(vae, x):
    h = vae.encoder(x)
    K = vae.latent_dim
    return h[..., :K], F.softplus(h[..., K:]) + 1e-4


def _trace_once(vae, x):
    """The model and guide run once on the batch, as tracing them does."""
    with torch.no_grad():
        loc, scale = _encode(vae, x)
        z = loc + scale * torch.randn_like(loc)
        bernoulli_log_prob(vae.decoder(z), x)


def _rounds(vae, x, mask, chains, rounds):
    """``rounds`` sampling encode-decode rounds on ``chains`` copies; returns the states."""
    n, D = x.shape
    with torch.no_grad():
        init = torch.sigmoid(vae.decoder(x.new_zeros(n, vae.latent_dim)))
        m = mask.expand(chains, n, D)
        xt = torch.where(m, init, x).reshape(chains * n, D)
        m = m.reshape(chains * n, D)
        for _ in range(rounds):
            loc, scale = _encode(vae, xt)
            z = loc + scale * torch.randn_like(loc)
            new = dist.Bernoulli(logits=vae.decoder(z)).sample()
            xt = torch.where(m, new, xt)
    return xt


def floor_encode_decode(vae, x, mask, S, T, stochastic=True):
    _trace_once(vae, x)
    if stochastic:  # S chains, one draw from each
        xt = _rounds(vae, x, mask, S, T)
        with torch.no_grad():
            loc, scale = _encode(vae, xt)
            z = loc + scale * torch.randn_like(loc)
        bernoulli_log_prob(vae.decoder(z), x.repeat(S, 1)).sum().backward()
        return
    # deterministic rounds (means): one chain, S draws from its final encoding
    n, D = x.shape
    with torch.no_grad():
        xt = torch.where(mask, torch.sigmoid(vae.decoder(x.new_zeros(n, vae.latent_dim))), x)
        for _ in range(T):
            loc, _ = _encode(vae, xt)
            xt = torch.where(mask, torch.sigmoid(vae.decoder(loc)), xt)
        loc, scale = _encode(vae, xt)
        z = loc + scale * torch.randn(S, n, vae.latent_dim)
    bernoulli_log_prob(vae.decoder(z), x).sum().backward()


def floor_importance(vae, x, mask, S, C, T, alpha):
    n, D = x.shape
    K = vae.latent_dim
    share = max(1, S - int(round(alpha * S)))
    C = min(C, share)
    S_g = C * (share // C)
    _trace_once(vae, x)
    xt = _rounds(vae, x, mask, C, T)
    with torch.no_grad():
        loc, scale = _encode(vae, xt)  # (C n, K)
        loc, scale = loc.reshape(C, n, K), scale.reshape(C, n, K)
        zg = (loc + scale * torch.randn(S_g // C, C, n, K)).reshape(S_g, n, K)
        z = torch.cat([zg, torch.randn(S - S_g, n, K)], 0)
        log_q = dist.Normal(loc, scale).log_prob(z[:, None]).sum(-1)  # (S, C, n)
        log_p = dist.Normal(0.0, 1.0).log_prob(z).sum(-1)
        del log_q, log_p
    bernoulli_log_prob(vae.decoder(z), x).sum().backward()  # (S, n, D)


def floor_quadrature(vae, x, Q, chunk):
    n, D = x.shape
    _trace_once(vae, x)
    for s in range(0, Q, chunk):
        z = torch.randn(min(chunk, Q - s), n, vae.latent_dim)
        bernoulli_log_prob(vae.decoder(z), x).sum().backward()


# ---------------------------------------------------------------------- instrumented step
class Timers:
    """Exclusive wall time per region (regions nest: a region's time excludes its children's)."""

    def __init__(self):
        self.total = {}
        self.stack = []

    @contextmanager
    def region(self, name):
        t0 = time.perf_counter()
        self.stack.append(0.0)
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            child = self.stack.pop()
            self.total[name] = self.total.get(name, 0.0) + dt - child
            if self.stack:
                self.stack[-1] += dt

    def wrap(self, name, fn):
        def wrapped(*a, **k):
            with self.region(name):
                return fn(*a, **k)

        return wrapped


@contextmanager
def instrumented(vae, timers):
    """Patch the networks, the Bernoulli observation, Pyro's tracing and backward with timers."""
    patches = [
        (vae.encoder, "forward", timers.wrap("networks", vae.encoder.forward)),
        (vae.decoder, "forward", timers.wrap("networks", vae.decoder.forward)),
    ]
    cls_patches = [
        (torch.distributions.Bernoulli, "log_prob", "observation"),
        (torch.distributions.Bernoulli, "sample", "observation"),
        (poutine.trace_messenger.TraceHandler, "get_trace", "pyro tracing"),
        (torch.Tensor, "backward", "backward"),
    ]
    # the engines' closed-form token log-densities, where a module imported it
    import importlib

    for mod_name in ("latent_runs", "quadrature_nodes", "plate_runs"):
        try:
            mod = importlib.import_module(f"pyro_mpt.conditionals.{mod_name}")
        except ImportError:
            continue
        if hasattr(mod, "token_log_prob"):
            cls_patches.append((mod, "token_log_prob", "observation"))
    saved = []
    for obj, attr, new in patches:
        setattr(obj, attr, new)
    for cls, attr, name in cls_patches:
        old = vars(cls)[attr]
        saved.append((cls, attr, old))
        setattr(cls, attr, timers.wrap(name, old))
    try:
        yield
    finally:
        for obj, attr, _ in patches:
            delattr(obj, attr)
        for cls, attr, old in saved:
            setattr(cls, attr, old)


def breakdown(vae, step, x):
    timers = Timers()
    with instrumented(vae, timers):
        _, total = timed(lambda: step(x))
    parts = {k: timers.total.get(k, 0.0) for k in ("networks", "observation", "pyro tracing", "backward")}
    parts["reductions and rest"] = total - sum(parts.values())
    return total, parts


# ---------------------------------------------------------------------- runs
def make_step(vae, loss):
    pyro.clear_param_store()
    svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-4}), loss)
    return lambda x: svi.step(x)


def uniform_mask(n, D, seed):
    """One uniform-size random mask per datapoint, as ``masks="uniform"`` draws them."""
    g = torch.Generator().manual_seed(seed)
    size = torch.randint(1, D + 1, (n, 1), generator=g)
    ranks = torch.rand(n, D, generator=g).argsort(-1).argsort(-1)
    return ranks < size


def floor_for(name, vae, x, engine_options, resolved):
    """The floor function of the engine ``resolved`` (what ``name`` ran as)."""
    n, D = x.shape
    if resolved == "encode_decode":
        e = EncodeDecodeConditionals(**engine_options)
        return lambda x, mask: floor_encode_decode(
            vae, x, mask, e.num_samples, e.num_iterations, e.stochastic
        ), e
    if resolved == "importance":
        e = ImportanceConditionals(**engine_options)
        return lambda x, mask: floor_importance(
            vae, x, mask, e.num_samples, e.num_chains, e.num_iterations, e.prior_weight
        ), e
    e = QuadratureConditionals(**engine_options)
    m = e.num_nodes or default_num_nodes(vae.latent_dim, e.adaptive)
    chunk = max(1, e.max_elements // (n * D))
    grids = 1 + context_grid_queries(vae, x, engine_options)
    return lambda x, mask: floor_quadrature(vae, x, grids * m**vae.latent_dim, chunk), e


def context_grid_queries(vae, x, engine_options):
    """Queries that get a context grid of their own in an evaluation of the default loss
    with the quadrature engine after its first (whose one-time error check runs coarser
    grids too): each runs the decoder on its grid's ``Q n`` node values."""
    import pyro_mpt.conditionals.quadrature as quadrature

    rows = []
    context_partials = quadrature.context_partials

    def spy(runner, e, log_w, centre, sqrt_cov, ctx, *args, **kwargs):
        rows.append(ctx.shape[0])
        return context_partials(runner, e, log_w, centre, sqrt_cov, ctx, *args, **kwargs)

    loss = MaskedPretrainingLoss(conditionals=QuadratureConditionals(**engine_options))
    pyro.set_rng_seed(0)
    with torch.no_grad():
        loss.loss(vae.model, vae.guide, x)
        quadrature.context_partials = spy
        try:
            loss.loss(vae.model, vae.guide, x)
        finally:
            quadrature.context_partials = context_partials
    return sum(rows)


def resolve(name, vae, x):
    """The engine ``"auto"`` picks for this model and guide (one evaluation, no gradients)."""
    if name != "auto":
        return name
    loss = MaskedPretrainingLoss()
    with torch.no_grad():
        loss.loss(vae.model, vae.guide, x)
    from pyro_mpt.conditionals import ENGINES

    chosen = type(next(iter(loss.memory.auto_engines.values())))
    return next(k for k, cls in ENGINES.items() if cls is chosen)


def run_engine(name, vae, x, repeats, engine_options=None):
    """Interleaved timings of Trace_ELBO, the engine's step and its floor; then the breakdown."""
    engine_options = dict(engine_options or {})
    resolved = resolve(name, vae, x)
    n, D = x.shape
    floor, _ = floor_for(name, vae, x, engine_options, resolved)
    elbo = make_step(vae, Trace_ELBO())
    pyro.clear_param_store()
    if name == "auto":
        loss = MaskedPretrainingLoss(conditionals="auto", **engine_options)
    else:
        loss = MaskedPretrainingLoss(conditionals=engine_for(name, **engine_options))
    svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-4}), loss)
    step = lambda x: svi.step(x)  # noqa: E731

    def prepare(seed):
        pyro.set_rng_seed(seed)
        return x, uniform_mask(n, D, seed)

    def run_floor(p):
        vae.zero_grad(set_to_none=True)
        floor(*p)

    # a Trace_ELBO step is ~100x shorter than the others, so a moment of load on
    # the machine swamps one timing of it: each round keeps the fastest of 5
    elbo_best = []

    def run_elbo(p):
        elbo_best.append(min(timed(lambda: elbo(p[0]))[1] for _ in range(5)))

    (_, _), (t_step, _), (t_floor, _) = run_interleaved(
        prepare, [run_elbo, lambda p: step(p[0]), run_floor], repeats
    )[0]
    t_elbo = elbo_best[-len(t_step):]
    total, parts = breakdown(vae, step, x)
    return {
        "name": name,
        "resolved": resolved,
        "options": engine_options,
        "elbo": Timing(t_elbo),
        "step": Timing(t_step),
        "floor": Timing(t_floor),
        "total": total,
        "parts": parts,
    }


def engine_table(rows):
    cols = ["networks", "observation", "pyro tracing", "backward", "reductions and rest"]
    lines = [
        "| engine | step s | Trace_ELBO s | step / Trace_ELBO | floor s | step / floor | "
        + " | ".join(cols) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(cols),
    ]
    for r in rows:
        label = r["name"] if r["name"] == r["resolved"] else f"{r['name']} ({r['resolved']})"
        if r["options"]:
            label += " " + ", ".join(f"{k}={v}" for k, v in r["options"].items())
        e, s, f = r["elbo"].median, r["step"].median, r["floor"].median
        shares = " | ".join(f"{100 * r['parts'][c] / r['total']:.0f}%" for c in cols)
        lines.append(
            f"| {label} | {r['step'].cell()} | {r['elbo'].cell()} | {fmt_ratio(s / e)} | "
            f"{r['floor'].cell()} | {fmt_ratio(s / f)} | {shares} |"
        )
    return "\n".join(lines)


KNOBS = [
    ("encode_decode", {"num_samples": 2}),
    ("encode_decode", {"num_samples": 32}),
    ("encode_decode", {"num_iterations": 0}),
    ("encode_decode", {"num_iterations": 1}),
    ("encode_decode", {"encode": "mean", "decode": "mean"}),
    ("importance", {"num_samples": 32}),
    ("importance", {"num_samples": 64, "num_iterations": 1}),
    ("importance", {"num_samples": 256, "diagnostics": False}),
    ("quadrature", {"num_nodes": 3}),
    ("quadrature", {"num_nodes": 4}),
    ("quadrature", {"cache_elements": 2**25}),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engines", nargs="*", choices=list(ENGINES) + [[]], default=[])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--latent", type=int, default=4)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--knobs", action="store_true", help="also time the accuracy/time knobs")
    p.add_argument("--out-md", default=None, help="write the tables into this markdown file")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    engines = a.engines or list(ENGINES)
    x = make_data(a.batch)
    vae = make_vae(a.latent, a.hidden)
    start = time.time()
    out = [f"Machine: {machine_line()}.",
           f"Tutorial VAE: z={a.latent}, 784-{a.hidden}-784 Bernoulli decoder, 784-{a.hidden}-{2 * a.latent} "
           f"encoder, batch {a.batch}, float32; times are one SVI step (loss + gradient + Adam), "
           f"median ± sd over {a.repeats} rounds after one warm-up, interleaved with Trace_ELBO and the floor."]
    rows = []
    for name in engines:
        r = run_engine(name, vae, x, a.repeats)
        rows.append(r)
        print(engine_table([r]).split("\n")[-1], flush=True)
    out += ["", "**Step cost per engine (defaults)**", "", engine_table(rows)]
    if a.knobs:
        krows = []
        for name, options in KNOBS:
            r = run_engine(name, vae, x, max(2, a.repeats - 1), options)
            krows.append(r)
            print(engine_table([r]).split("\n")[-1], flush=True)
        out += ["", "**Knobs that trade accuracy for time**", "", engine_table(krows)]
    out += ["", f"Load at the end: {machine_line().split('; ')[-1]}. Whole run: {time.time() - start:.0f} s."]
    text = "\n".join(out)
    print(text)
    if a.out_md:
        write_markdown(a.out_md, text, BEGIN, END)


if __name__ == "__main__":
    main()
