"""Distributed data parallel training: examples/ppca_lightning_ddp.py on 2 CPU processes (gloo).

The example is launched as a user would (``--accelerator cpu --devices 2
--strategy ddp``; Lightning starts the second rank itself) for one step, in
float64, with ``masks="exhaustive"``: with the Gaussian engine every datapoint's
estimate is then :math:`\\log p(x_i)` whatever the rank, so the gradient DDP
averages over the ranks must equal, to float64 rounding,

* the gradient of one process on the union of the two local batches (global
  batch 2B, plate scale N / 2B), computed here with the same loss module, and
* the gradient of :math:`-\\frac{N}{2B}\\sum_i \\log\\mathcal N(x_i;\\mu, WW^\\top+\\sigma^2 I)`,
  written with ``torch.distributions`` outside pyro_mpt.

A rank that did not average (a sum over ranks) or a plate scaled by the local
instead of the global batch would be off by a factor 2.
"""

import os
import subprocess
import sys

import pyro
import pytest
import torch

from models import load_script

pytest.importorskip("lightning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--num-data", "400", "--num-tokens", "5", "--num-latents", "2", "--batch-size", "30",
        "--masks", "exhaustive", "--dtype", "float64", "--max-steps", "1", "--seed", "3", "--shuffle", "0"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, os.path.join("examples", "ppca_lightning_ddp.py"), "--accelerator", "cpu",
           "--devices", "2", "--strategy", "ddp", "--save-grads", str(out), "--root-dir", str(out)] + ARGS
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def test_ranks_shard_the_data(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 for r in ranks)
    a, b = (set(r["idx"].tolist()) for r in ranks)
    assert len(a) == len(b) == 30 and not a & b  # disjoint local batches of B = 30
    # --shuffle 0: each rank reads its shard in order (before: Lightning's sampler shuffled anyway)
    for r in ranks:
        assert r["idx"].tolist() == list(range(r["rank"], 60, 2))
    # DDP starts both ranks from the same parameters and leaves them the same averaged gradient
    for k in ranks[0]["grads"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k])
        assert torch.equal(ranks[0]["grads"][k], ranks[1]["grads"][k])


def test_averaged_gradient_is_the_global_batch_gradient(ranks):
    with pyro.settings.context(module_local_params=True):
        _check_against_references(ranks)


def _check_against_references(ranks):
    example = load_script("examples/ppca_lightning_ddp.py")
    loss_fn, dataset = example.build(example.parse_args(ARGS))
    idx = torch.cat([r["idx"] for r in ranks])
    _, x = dataset[idx]
    named = dict(loss_fn.named_parameters())
    for k, p in named.items():
        assert torch.equal(p.detach(), ranks[0]["params"][k])  # the reference starts where the ranks did
    loss = loss_fn(idx, x)
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()))))

    # the same gradient from the closed-form marginal, outside pyro_mpt
    model = loss_fn.model
    W, mu, sigma = model.W, model.mu, model.sigma
    cov = W @ W.T + sigma**2 * torch.eye(W.shape[0], dtype=W.dtype)
    exact = -(model.num_data / idx.numel()) * torch.distributions.MultivariateNormal(mu, cov).log_prob(x).sum()
    assert torch.allclose(loss, exact, rtol=1e-10, atol=0)
    closed = dict(zip(named, torch.autograd.grad(exact, list(named.values()))))

    ddp = ranks[0]["grads"]
    assert set(ddp) == {"model.W_unconstrained", "model.mu_unconstrained", "model.sigma_unconstrained"}
    for k in named:
        scale = grads[k].abs().max()
        assert scale > 1.0  # a real gradient, far from the optimum
        torch.testing.assert_close(ddp[k], grads[k], rtol=1e-9, atol=1e-9 * float(scale))
        torch.testing.assert_close(ddp[k], closed[k], rtol=1e-9, atol=1e-9 * float(scale))
