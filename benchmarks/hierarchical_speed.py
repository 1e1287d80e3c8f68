#!/usr/bin/env python
r"""The hierarchical engine vs a dense (N·D)² Gaussian on a linear-Gaussian hierarchy (issue 13 §4).

Model: ``mu ~ N(0, I_G)``, ``z_n ~ N(A mu, 0.8² I_K)``, ``x_n ~ N(W z_n + c, 0.5² I_D)``
for ``n = 1..N``, scored as one datapoint of ``N·D`` tokens (``token_plates=("data",)``).
For each route the script times (median ± sd of ``--repeats``, by the shared harness)

* the evidence ``log p(x_1..N)``: ``Evidence(method="exact")`` (the hierarchical
  engine: loadings from the model, then the arrowhead solve, linear in N·D) vs a
  Cholesky factorization of the dense ``N·D × N·D`` covariance built from the same
  loadings (what a dense Gaussian path costs);
* ``--masks`` masked-conditional queries (random masks, half the tokens hidden):
  the engine's ``mask_log_prob`` vs the dense conditionals, one Cholesky of the
  context block per mask;

and one ordering of the ``"order"`` schedule by the engine's suffix sums (its terms
must sum to the evidence); it prints the ratios dense / hierarchical and the largest difference between the
two routes' numbers (float64).

Usage::

    .venv/bin/python benchmarks/hierarchical_speed.py            # N=1000, D=4 (4000 tokens)
    .venv/bin/python benchmarks/hierarchical_speed.py --quick
"""

import argparse
import math
import os
import sys

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence
from pyro_mpt.conditionals import HierarchicalGaussianConditionals
from pyro_mpt.observed_tokens import trace_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import Timing, fmt_ratio, machine_line, run_interleaved, timed  # noqa: E402


def dense_moments(state):
    """Mean and dense covariance of the N·D tokens from the engine's loadings."""
    a, b, psi = state.a[0], state.b[0], state.psi[0]  # (U, E, Kg), (U, E, Kl), (D,)
    U, E, Kl = b.shape
    A = a.reshape(U * E, -1)
    cov = A @ A.T + torch.diag(psi)
    blocks = b @ b.transpose(-1, -2)  # (U, E, E)
    cov = cov + torch.block_diag(*blocks)
    return state.loc[0], cov


def dense_evidence(mean, cov, x):
    return torch.distributions.MultivariateNormal(mean, cov).log_prob(x)


def dense_masks(mean, cov, x, mask):
    out = torch.zeros(mask.shape, dtype=x.dtype)
    for q in range(mask.shape[0]):
        m = mask[q]
        R = ~m
        L = torch.linalg.cholesky(cov[R][:, R])
        K = torch.cholesky_solve(cov[R][:, m], L)  # Σ_RR^{-1} Σ_Rm
        mu = mean[m] + K.T @ (x[R] - mean[R])
        var = torch.diagonal(cov[m][:, m]) - (cov[R][:, m] * K).sum(0)
        out[q, m] = -0.5 * (math.log(2 * math.pi) + var.log() + (x[m] - mu) ** 2 / var)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--N", type=int, default=1000)
    parser.add_argument("--D", type=int, default=4)
    parser.add_argument("--K", type=int, default=2)
    parser.add_argument("--G", type=int, default=2)
    parser.add_argument("--masks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    if a.quick:
        a.N, a.repeats = 250, 2
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    W, A, c = torch.randn(a.D, a.K, generator=g), torch.randn(a.K, a.G, generator=g), torch.randn(a.D, generator=g)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(a.G), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(mu @ A.T, 0.8).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + c, 0.5).to_event(1), obs=x)

    x = torch.randn(a.N, a.D, generator=g)
    ND = a.N * a.D
    engine = HierarchicalGaussianConditionals()
    tokens = trace_tokens(model, None, (x,), {}, token_plates=("data",))
    state = engine.prepare(tokens, model, None, (x,), {})
    flat = tokens.value[0]

    def prepare(seed):
        m = torch.rand(a.masks, ND, generator=torch.Generator().manual_seed(seed)) < 0.5
        return m

    def hier_evidence(_):
        return Evidence(model, method="exact", token_plates=("data",))(x)

    def dense_ev(_):
        mean, cov = dense_moments(state)
        return dense_evidence(mean, cov, flat)

    def hier_masks(m):
        return engine.mask_log_prob(state, tokens.value, m[:, None, :])[:, 0]

    def dense_m(m):
        mean, cov = dense_moments(state)
        return dense_masks(mean, cov, flat, m)

    (t_he, o_he), (t_de, o_de), (t_hm, o_hm), (t_dm, o_dm) = run_interleaved(
        prepare, [hier_evidence, dense_ev, hier_masks, dense_m], a.repeats
    )[0]
    err_ev = max(abs(float(p) - float(q)) for p, q in zip(o_he, o_de))
    masks = prepare(a.repeats)  # compare on one set of masks
    err_m = float((hier_masks(masks) - dense_m(masks))[masks].abs().max())
    he, de, hm, dm = (Timing(t) for t in (t_he, t_de, t_hm, t_dm))
    print(machine_line())
    print(f"linear-Gaussian hierarchy: N={a.N} units x D={a.D} tokens = {ND} tokens, "
          f"G={a.G} global and K={a.K} local latent dims per unit")
    print(f"evidence   hierarchical {he.cell()} s (model runs included)   dense {de.cell()} s   "
          f"dense/hierarchical {fmt_ratio(de.median / he.median)}   |diff| {err_ev:.2e}")
    order = torch.randperm(ND, generator=torch.Generator().manual_seed(0))[None, None, :]
    chain, t_order = timed(lambda: engine.chain_log_prob(state, tokens.value, order))
    err_o = abs(float(chain.sum()) - float(o_he[0]))
    print(f"one ordering ('order' schedule, suffix sums): hierarchical {t_order:.3g} s   "
          f"|sum of its terms - evidence| {err_o:.2e}")
    print(f"{a.masks} masks    hierarchical {hm.cell()} s   dense {dm.cell()} s   "
          f"dense/hierarchical {fmt_ratio(dm.median / hm.median)}   max |diff| {err_m:.2e}")


if __name__ == "__main__":
    main()
