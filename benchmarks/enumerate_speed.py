#!/usr/bin/env python
r"""Exact enumeration vs prior importance sampling on a Gaussian mixture (issue 13).

The model is Pyro's GMM tutorial form (a ``Categorical`` assignment in the data
plate, diagonal ``Normal`` components, parameters as ``pyro.param``). For each
engine the script times one SVI step of ``MaskedPretrainingLoss(masks="uniform")``
(median ± sd of ``--repeats`` after one warm-up step, by the shared harness) and
measures the error of the exhaustive score against
``sklearn.mixture.GaussianMixture.score_samples`` with the same parameters. It
prints the time ratio importance / enumerate and both errors.

Usage::

    .venv/bin/python benchmarks/enumerate_speed.py            # N=500, D=5, K=4, S=256
    .venv/bin/python benchmarks/enumerate_speed.py --quick
"""

import argparse
import os
import sys

import numpy as np
import torch
import pyro
import pyro.distributions as dist
from pyro.distributions import constraints
from pyro.infer import SVI
from pyro.optim import Adam
from sklearn.mixture import GaussianMixture

from pyro_mpt import MaskedPretrainingLoss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import Timing, fmt_ratio, machine_line, run_timed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--N", type=int, default=500)
    parser.add_argument("--D", type=int, default=5)
    parser.add_argument("--K", type=int, default=4)
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    if a.quick:
        a.N, a.repeats = 100, 2
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    w0 = torch.softmax(torch.randn(a.K, generator=g), 0)
    locs0 = 3 * torch.randn(a.K, a.D, generator=g)
    scales0 = 0.5 + torch.rand(a.K, a.D, generator=g)
    z = torch.multinomial(w0, a.N, replacement=True, generator=g)
    x = locs0[z] + scales0[z] * torch.randn(a.N, a.D, generator=g)

    def gmm(x):
        weights = pyro.param("weights", w0.clone(), constraint=constraints.simplex)
        locs = pyro.param("locs", locs0.clone())
        scales = pyro.param("scales", scales0.clone(), constraint=constraints.positive)
        with pyro.plate("data", x.shape[0]):
            assignment = pyro.sample("assignment", dist.Categorical(weights))
            pyro.sample("obs", dist.Normal(locs[assignment], scales[assignment]).to_event(1), obs=x)

    gm = GaussianMixture(a.K, covariance_type="diag")
    gm.weights_, gm.means_, gm.covariances_ = w0.numpy(), locs0.numpy(), scales0.numpy() ** 2
    gm.precisions_cholesky_ = 1 / scales0.numpy()
    ref = gm.score_samples(x.numpy())

    print(f"# {machine_line()}")
    results = {}
    for name, options in [("enumerate", {}), ("importance", {"num_samples": a.num_samples, "proposal": "prior"})]:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        score = MaskedPretrainingLoss(conditionals=name, masks="exhaustive", **options).score(gmm, None, x)
        err = np.abs(score.detach().numpy() - ref).max()
        svi = SVI(gmm, lambda x: None, Adam({"lr": 0.01}), MaskedPretrainingLoss(conditionals=name, **options))
        times, _ = run_timed(lambda seed: None, lambda _: svi.step(x), a.repeats)
        results[name] = Timing([1e3 * t for t in times])
        print(f"{name:>10}: {results[name].cell()} ms per SVI step; max |exhaustive - sklearn| = {err:.2e} nats")
    ratio = results["importance"].median / results["enumerate"].median
    print(f"importance (S={a.num_samples}) / enumerate time per step: {fmt_ratio(ratio)}")


if __name__ == "__main__":
    main()
