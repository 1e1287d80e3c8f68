"""Global latents at a guide's point mass (MAP), as in Pyro's GMM tutorial: held fixed, log-prior added."""

import math

import numpy as np
import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDelta
from scipy import integrate
from scipy.stats import norm, poisson

from pyro_mpt import Evidence, MaskedPretrainingLoss

K = 2


@config_enumerate
def tutorial_gmm(data, subsample_size=None):
    """Pyro's Gaussian-mixture tutorial model, verbatim but for the minibatch option."""
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(K, dtype=data.dtype)))
    scale = pyro.sample("scale", dist.LogNormal(torch.tensor(0.0, dtype=data.dtype), 2.0))
    with pyro.plate("components", K):
        locs = pyro.sample("locs", dist.Normal(torch.tensor(0.0, dtype=data.dtype), 10.0))
    with pyro.plate("data", len(data), subsample_size=subsample_size) as i:
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data[i])


def _map_guide(model, dtype=torch.float64):
    init = {"weights": torch.tensor([0.4, 0.6], dtype=dtype), "scale": torch.tensor(1.5, dtype=dtype),
            "locs": torch.tensor([1.0, 9.0], dtype=dtype)}
    return AutoDelta(poutine.block(model, expose=["weights", "locs", "scale"]), init_loc_fn=lambda site: init[site["name"]])


def test_tutorial_gmm_with_a_map_guide_equals_traceenum_elbo():
    """The tutorial's model and AutoDelta guide (before: refused, "a MAP guide cannot be a
    proposal"): every exact schedule's loss and its gradients equal TraceEnum_ELBO's,
    -[sum_i log p(x_i | theta) + log p(theta)], also on a minibatch (N / B on the data
    term, none on the prior)."""
    data = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0, 2.0, 9.5], dtype=torch.float64)
    for subsample_size in [None, 3]:
        pyro.clear_param_store()
        guide = _map_guide(tutorial_gmm)
        guide(data, subsample_size)
        params = [pyro.param(name).unconstrained() for name in pyro.get_param_store().keys()]
        pyro.set_rng_seed(0)
        ref = TraceEnum_ELBO(max_plate_nesting=1).differentiable_loss(tutorial_gmm, guide, data, subsample_size)
        ref_grads = torch.autograd.grad(ref, params)
        for masks in ["order", "exhaustive", "uniform"]:
            pyro.set_rng_seed(0)  # the same minibatch
            got = MaskedPretrainingLoss(masks=masks).differentiable_loss(tutorial_gmm, guide, data, subsample_size)
            assert abs(got.item() - ref.item()) < 1e-10 * abs(ref.item())
            for a, b in zip(torch.autograd.grad(got, params), ref_grads):
                assert torch.allclose(a, b, rtol=0, atol=1e-10)
    # the scores are log p(x_i | theta), the prior left out
    pyro.clear_param_store()
    guide = _map_guide(tutorial_gmm)
    score = MaskedPretrainingLoss(masks="order").score(tutorial_gmm, guide, data).detach().numpy()
    ref = np.logaddexp(math.log(0.4) + norm.logpdf(data.numpy(), 1.0, 1.5), math.log(0.6) + norm.logpdf(data.numpy(), 9.0, 1.5))
    assert np.allclose(score, ref, atol=1e-12)
    # Evidence likewise: log p(x_i | theta) (before: refused by every method)
    assert np.allclose(Evidence(tutorial_gmm, guide, "exact")(data).detach().numpy(), ref, atol=1e-12)
    pyro.set_rng_seed(0)
    result = Evidence(tutorial_gmm, guide, "importance", num_samples=4000).estimate(data)
    z = (result.log_evidence.detach().numpy() - ref) / result.stderr.numpy()
    assert np.abs(z).max() < 4  # the prior over the assignment as proposal: within 4 standard errors


def test_tutorial_gmm_without_a_guide_names_the_global_latents_and_the_map_guide():
    """Without the guide the globals are integrated out per datapoint, which no engine can:
    each engine's reason is the global latent, with the MAP guide among the ways out (before,
    the enumeration engine blamed the order, "sampled after the continuous latent(s) ...
    Sample the discrete latents first", which would not have helped)."""
    data = torch.tensor([0.0, 1.0, 10.0, 11.0], dtype=torch.float64)
    with pytest.raises(ValueError) as refusal:
        MaskedPretrainingLoss().loss(tutorial_gmm, None, data)
    message = str(refusal.value)
    assert "sampled after" not in message
    assert "conditionals='enumerate' cannot sum it per datapoint" in message
    assert "AutoDelta over the global latents" in message


def _poisson_glmm():
    """Counts, covariate and a Poisson GLMM: a global slope, a random intercept per datapoint."""
    counts = torch.tensor([[0.0, 2.0, 1.0], [4.0, 3.0, 6.0], [1.0, 0.0, 2.0]], dtype=torch.float64)
    t = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)

    def glmm(x):
        beta = pyro.sample("beta", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 2.0))
        with pyro.plate("data", x.shape[0]):
            u = pyro.sample("u", dist.Normal(torch.tensor(0.5, dtype=torch.float64), 0.7))
            pyro.sample("x", dist.Poisson(torch.exp(u.unsqueeze(-1) + beta * t)).to_event(1), obs=x)

    return counts, t, glmm


def test_map_global_with_a_continuous_local_latent_against_scipy():
    """A Poisson GLMM: a global slope at a point mass, a random intercept per datapoint
    integrated by quadrature: the loss is -[sum_i log p(x_i | beta) + log p(beta)], each
    log p(x_i | beta) by scipy.integrate.quad."""
    counts, t, glmm = _poisson_glmm()

    def guide(x):
        pyro.sample("beta", dist.Delta(torch.tensor(0.3, dtype=torch.float64)))

    def log_p(row):
        f = lambda u: math.exp(norm.logpdf(u, 0.5, 0.7) + poisson.logpmf(row, np.exp(u + 0.3 * t.numpy())).sum())
        return math.log(integrate.quad(f, -10, 10, epsabs=0, epsrel=1e-12, limit=200)[0])

    ref = sum(log_p(row) for row in counts.numpy()) + norm.logpdf(0.3, 0.0, 2.0)
    got = MaskedPretrainingLoss(masks="order", conditionals="quadrature").loss(glmm, guide, counts)
    assert abs(got + ref) < 1e-8 * abs(ref)


def test_autoguide_list_of_a_map_part_and_an_autonormal_part():
    """``AutoGuideList(AutoDelta over the global slope, AutoNormal over the local intercepts)``:
    the AutoDelta part is dropped with the fixed latent, the AutoNormal part stays an
    autoguide for the importance engine (before the part was unwrapped it was refused, its
    auxiliary sites unreplayable). Quadrature equals scipy to 1e-9; importance with the
    AutoNormal proposal (4000 draws, fixed seed) is within 0.1 nats of it."""
    from pyro.infer.autoguide import AutoGuideList, AutoNormal

    counts, t, glmm = _poisson_glmm()

    guide = AutoGuideList(glmm)
    guide.append(AutoDelta(poutine.block(glmm, expose=["beta"]),
                           init_loc_fn=lambda site: torch.tensor(0.3, dtype=torch.float64)))
    guide.append(AutoNormal(poutine.block(glmm, expose=["u"]), init_scale=0.5))

    def log_p(row):
        f = lambda u: math.exp(norm.logpdf(u, 0.5, 0.7) + poisson.logpmf(row, np.exp(u + 0.3 * t.numpy())).sum())
        return math.log(integrate.quad(f, -10, 10, epsabs=0, epsrel=1e-12, limit=200)[0])

    ref = np.array([log_p(row) for row in counts.numpy()])
    exact = MaskedPretrainingLoss(masks="order", conditionals="quadrature").score(glmm, guide, counts)
    assert np.allclose(exact.detach().numpy(), ref, atol=1e-9)
    pyro.set_rng_seed(0)
    sampled = MaskedPretrainingLoss(masks="order", conditionals="importance", num_samples=4000).score(glmm, guide, counts)
    assert np.abs(sampled.detach().numpy() - ref).max() < 0.1


def test_autocontinuous_guides_are_densities_not_point_masses():
    # AutoMultivariateNormal / AutoDiagonalNormal record each latent as a Delta at a draw of
    # their auxiliary Normal; read as point masses, Evidence(method='importance') held the
    # globals at one draw and returned log p(x | theta_draw): -2.08 against the evidence
    # -7.67 on test_hierarchical's Poisson hierarchy. Here a Gaussian hierarchy, against scipy
    from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoMultivariateNormal
    from scipy.stats import multivariate_normal
    from pyro_mpt.point_latents import point_global_latents
    from pyro_mpt.observed_tokens import trace_tokens

    x = torch.tensor([[0.3, -0.2], [1.1, 0.4], [0.5, 0.9]], dtype=torch.float64)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            pyro.sample("x", dist.Normal(mu + z[..., None], 0.7).to_event(1), obs=x)

    pyro.set_rng_seed(0)
    for guide in (AutoMultivariateNormal(model), AutoDiagonalNormal(model)):
        guide(x)
        tokens = trace_tokens(model, guide, (x,), {}, token_plates=("data",))
        assert point_global_latents(tokens, guide) == {}
    # an AutoDelta part beside an AutoContinuous one: only the AutoDelta's sites are point masses
    listed = AutoGuideList(model)
    listed.append(AutoDelta(poutine.block(model, expose=["mu"])))
    listed.append(AutoDiagonalNormal(poutine.block(model, expose=["z"])))
    listed(x)
    assert set(point_global_latents(trace_tokens(model, listed, (x,), {}), listed)) == {"mu"}

    # the evidence of the whole dataset, with the AutoMultivariateNormal as proposal, within 4 standard errors
    cov = np.kron(np.ones((3, 3)), np.eye(2)) + np.kron(np.eye(3), np.ones((2, 2)) + 0.49 * np.eye(2))
    exact = multivariate_normal(np.zeros(6), cov).logpdf(x.numpy().ravel())
    from models import fit_guide

    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = fit_guide(model, AutoMultivariateNormal(model), x)
    res = Evidence(model, guide, method="importance", num_samples=4000, token_plates=("data",)).estimate(x)
    assert abs(float(res.log_evidence) - exact) < 4 * float(res.stderr) + 1e-3


def test_only_point_masses_are_fixed_not_the_delta_sites_of_other_autoguides():
    """AutoNormal and AutoMultivariateNormal record each latent as a ``Delta`` of an auxiliary
    draw: their globals keep their density (not fixed), while AutoDelta's (alone or in an
    AutoGuideList) and a hand-written ``dist.Delta`` are point masses."""
    from pyro.infer.autoguide import AutoGuideList, AutoMultivariateNormal, AutoNormal

    from pyro_mpt.observed_tokens import trace_tokens
    from pyro_mpt.point_latents import point_global_latents

    x = torch.randn(4, 3, dtype=torch.float64)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(mu, 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    def delta_guide(x):
        pyro.sample("mu", dist.Delta(torch.tensor(0.2, dtype=torch.float64)))

    both = AutoGuideList(model)
    both.append(AutoDelta(poutine.block(model, expose=["mu"])))
    cases = [(AutoNormal(model), set()), (AutoMultivariateNormal(model), set()), (AutoDelta(model), {"mu"}),
             (both, {"mu"}), (delta_guide, {"mu"})]
    for guide, expected in cases:
        pyro.clear_param_store()
        for token_plates in [None, ("data",)]:
            tokens = trace_tokens(model, guide, (x,), {}, token_plates=token_plates)
            assert set(point_global_latents(tokens, guide)) == expected, (guide, token_plates)
