"""Cost of the quadrature engine's context grids: the loss with its gradient, one grid vs context grids.

Linear Bernoulli VAE (K = 2, data drawn from the model), float32, one torch
thread; ``QuadratureConditionals(context_grids=False)`` (every conditional on
the grid centred on the full posterior) against the default (a grid of its own
for each query the full grid does not resolve, docs/quadrature.md), timed
interleaved on the same masks. Prints the ratio per mask schedule, at loadings
W ~ N(0, 1) and at loadings three times larger (as informative as a trained
model's: the posteriors given small contexts move away from the full one, and
more queries and masked tokens ask grids of their own; a cost that grew 15-fold
there went unseen at the first scale alone).

    python benchmarks/quadrature_contexts_speed.py            # N = 1797, D = 64 and N = 300, D = 784
    python benchmarks/quadrature_contexts_speed.py --quick    # smoke test
"""

import argparse
import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import fmt_ratio, fmt_s, machine_line, run_interleaved, Timing  # noqa: E402

from pyro_mpt import MaskedPretrainingLoss  # noqa: E402
from pyro_mpt.conditionals.quadrature import QuadratureConditionals  # noqa: E402


def linear_vae(N, D, K=2, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    W0 = scale * torch.randn(D, K, generator=g)
    x = torch.bernoulli(torch.sigmoid(torch.randn(N, K, generator=g) @ W0.T), generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        b = pyro.param("b", torch.zeros(D))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T + b).to_event(1), obs=x)

    return model, x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if args.quick:
        cases = [(200, 32, 1.0, ("uniform",)), (200, 32, 3.0, ("uniform",))]
    else:
        cases = [(1797, 64, 1.0, ("uniform", "pll")), (1797, 64, 3.0, ("uniform", "pll")), (300, 784, 1.0, ("uniform",))]
    repeats = 2 if args.quick else 5
    print(machine_line())
    print(f"{'N':>5} {'D':>4} {'W':>3} {'masks':>8} {'one grid':>16} {'context grids':>16} {'ratio':>7}")
    for N, D, scale, schedules in cases:
        pyro.clear_param_store()  # each case its own loadings
        model, x = linear_vae(N, D, scale=scale)
        for masks in schedules:
            losses = [
                MaskedPretrainingLoss(masks=masks, conditionals=QuadratureConditionals(context_grids=cg))
                for cg in (False, True)
            ]

            def step(loss):
                def run(seed):
                    pyro.set_rng_seed(seed)
                    value = loss.differentiable_loss(model, lambda x: None, x)
                    value.backward()
                    return float(value)

                return run

            times, _ = run_interleaved(lambda seed: seed, [step(loss) for loss in losses], repeats)
            one, ctx = Timing(times[0][0]), Timing(times[1][0])
            print(
                f"{N:>5} {D:>4} {scale:>3g} {masks:>8} {fmt_s(one.median):>16} {fmt_s(ctx.median):>16} "
                f"{fmt_ratio(ctx.median / one.median):>7}",
                flush=True,
            )


if __name__ == "__main__":
    main()
