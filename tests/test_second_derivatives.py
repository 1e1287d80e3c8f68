"""Second derivatives through the engines' backward passes written out for first
derivatives are refused (``written_backward.first_order_backward``), not silently
wrong: the mixture chunks' partial sums (quadrature, enumeration, importance with
prior draws) and the importance engine's self-normalized weights, like the Gaussian
engine's forms (``test_gaussian_aggregated``)."""

import pytest
import torch
import pyro

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import ImportanceConditionals

from models import exact_posterior_guide, make_ppca
from test_enumerate import make_gmm

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("engine,kernel", [
    ("quadrature", "_MaskPartials"),
    ("importance-prior", "_MaskPartials"),
    ("importance-guide", "SelfNormalized"),
])
def test_second_derivatives_are_refused_and_first_ones_kept(engine, kernel):
    pyro.set_rng_seed(0)
    guide, name = None, "W"
    model, x, _ = make_ppca(5, 1, N=20)
    conditionals = engine
    if engine == "importance-prior":
        conditionals = ImportanceConditionals(64, proposal="prior")
    elif engine == "importance-guide":
        conditionals, guide = ImportanceConditionals(64, proposal="guide", num_chains=2, num_iterations=1), exact_posterior_guide
    loss = MaskedPretrainingLoss(conditionals=conditionals)
    p = pyro.param(name).unconstrained()
    with pytest.raises(RuntimeError, match=rf"Second derivatives \(create_graph=True\) through pyro_mpt's {kernel}"):
        torch.autograd.grad(loss.differentiable_loss(model, guide, x), p, create_graph=True)
    pyro.set_rng_seed(0)
    (g,) = torch.autograd.grad(loss.differentiable_loss(model, guide, x), p)
    assert torch.isfinite(g).all() and bool(g.ne(0).any())


def test_enumeration_second_derivatives_equal_finite_differences():
    # the Gaussian mixture table is recorded by autograd: its Hessian-vector
    # product is the central difference of the gradient (O(eps^2) = 1e-10)
    pyro.set_rng_seed(0)
    model, x = make_gmm(2, 3, 30)
    model(x)
    loss = MaskedPretrainingLoss(masks="all", share_masks=True, conditionals="enumerate")
    p = pyro.param("locs").unconstrained()

    def grad(create=False):
        pyro.set_rng_seed(1)  # the same masks each time
        return torch.autograd.grad(loss.differentiable_loss(model, None, x), p, create_graph=create)[0]

    v = torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype)
    hv = torch.autograd.grad((grad(True) * v).sum(), p)[0]
    eps = 1e-5
    with torch.no_grad():
        p += eps * v
    gp = grad()
    with torch.no_grad():
        p -= 2 * eps * v
    gm = grad()
    fd = (gp - gm) / (2 * eps)
    assert float((hv - fd).abs().max()) <= 1e-6 * float(fd.abs().max())
