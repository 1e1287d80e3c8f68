"""Models written the ordinary way that are as cheap as PPCA must not take a slower
path of the Gaussian engine (issue 14 §2, "no slow corner").

Each test checks the structure that makes the path cheap -- the largest tensor
that a loss + gradient creates, or the shapes of the marginal -- and the numbers
against references written outside the library (numpy, torch.distributions).
"""

import numpy as np
import torch
import pyro
import pyro.distributions as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_mpt import Evidence


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest storage any op returns
    (forward and backward passes alike; views count by their storage, so an
    expanded tensor counts as what it was expanded from)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.untyped_storage().nbytes() // t.element_size())
        return out


def _numpy_mvn_log_prob(x, loc, cov):
    L = np.linalg.cholesky(cov)
    u = np.linalg.solve(L, (x - loc).T)
    return -0.5 * (x.shape[1] * np.log(2 * np.pi) + 2 * np.log(np.diag(L)).sum() + (u**2).sum(0))


def test_exact_evidence_of_a_dense_shared_covariance_solves_the_batch_at_once():
    # a MultivariateNormal observation with one covariance for the batch: the
    # exact log-density solves its factor against all residuals as one matrix.
    # Broadcast against each datapoint, the solve and its gradient held an
    # (n, D, D) copy of the factor (67x slower at n=1000, D=100).
    n, D, K = 300, 40, 3
    g = torch.Generator().manual_seed(5)
    W0 = torch.randn(D, K, generator=g, dtype=torch.float64)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    Psi = A @ A.T / D + 0.5 * torch.eye(D, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * 2

    def model(x):
        W = pyro.param("W", W0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z @ W.T, covariance_matrix=Psi), obs=x)

    pyro.clear_param_store()
    evidence = Evidence(model)
    evidence(x)
    W = pyro.param("W").unconstrained()
    # without validation: torch's check of the model's own covariance, broadcast
    # to the batch, is paid by any inference of this model (Trace_ELBO too)
    with pyro.validation_enabled(False), LargestTensor() as largest:
        lp = evidence(x)
        (grad,) = torch.autograd.grad(lp.sum(), W)
    assert largest.numel <= 4 * (n * D + D * D), largest.numel  # n * D * D = 480000

    S = (W0 @ W0.T + Psi).numpy()
    assert np.allclose(lp.detach().numpy(), _numpy_mvn_log_prob(x.numpy(), 0.0, S), atol=1e-8, rtol=0)
    Wr = W0.clone().requires_grad_()
    ref = dist.MultivariateNormal(torch.zeros(D, dtype=torch.float64), Wr @ Wr.T + Psi).log_prob(x).sum()
    (grad_ref,) = torch.autograd.grad(ref, Wr)
    assert torch.allclose(grad, grad_ref, atol=1e-8, rtol=1e-10)
