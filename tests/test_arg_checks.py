"""Pyro's argument checks at the arguments' own shapes (``pyro_mpt.arg_checks``), and the
loss's traces without validation that rely on them.

References: torch itself, building each distribution with ``validate_args=True`` (its
``ValueError`` or not), and the loss's fully validated path (a fresh loss) for values and
errors.
"""

import inspect

import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from torch.distributions import Distribution, constraints

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.arg_checks import CHECKED, WRAPPERS, args_valid, checkable


def test_checked_classes_validate_only_through_torchs_loop_over_their_arguments():
    """What :func:`args_valid` replays is ``Distribution.__init__``'s loop over
    ``arg_constraints``: no class it trusts (nor a wrapper) checks anything else of its own
    under validation when it is built."""
    for cls in CHECKED + WRAPPERS:
        for k in cls.__mro__:
            if k is Distribution:
                break
            init = k.__dict__.get("__init__")
            if init is not None:
                assert "_validate_args" not in inspect.getsource(init), (cls, k)


def torch_says(build):
    """Whether torch accepts the distribution that ``build()`` makes under validation."""
    with pyro.validation_enabled(True):
        try:
            build()
        except ValueError:
            return False
    return True


def trace_of(build, plate=4):
    """A trace without validation of one site observing ``build()`` in a plate (observed:
    drawing from a bad distribution fails in torch before any check)."""
    def model():
        with pyro.plate("data", plate):
            fn = build()
            pyro.sample("x", fn, obs=torch.zeros(torch.Size([plate]) + fn.event_shape))

    with pyro.validation_enabled(False):
        return poutine.trace(model).get_trace()


D = 3
L0 = torch.linalg.cholesky(torch.eye(D) + 0.5)
CASES = {
    "mvn": lambda L: (lambda: dist.MultivariateNormal(torch.randn(4, D), scale_tril=L)),  # L expanded to (4, D, D)
    "lowrank": lambda L: (lambda: dist.LowRankMultivariateNormal(torch.zeros(4, D), L, L.diagonal().abs() + 0.1)),
}


@pytest.mark.parametrize("bad", [None, "upper", "negative_diagonal", "nan", "expanded_row"])
def test_args_valid_agrees_with_torch_on_an_expanded_scale_tril(bad):
    """``MultivariateNormal`` with a mean per datapoint holds its ``scale_tril`` expanded over
    the batch: the check of one slice agrees with torch's check of all of them, also for a
    matrix whose rows are one row expanded (stride 0 along an event dim: not narrowed there,
    or ``[[1, 0, 0]] * 3`` would pass as lower-triangular with a positive diagonal)."""
    L = L0.clone()
    if bad == "upper":
        L = L0.T.clone()
    elif bad == "negative_diagonal":
        L[1, 1] = -1.0
    elif bad == "nan":
        L[2, 0] = float("nan")
    elif bad == "expanded_row":
        L = torch.tensor([1.0, 0.0, 0.0]).expand(D, D)
    build = CASES["mvn"](L)
    fn = trace_of(build).nodes["x"]["fn"]
    assert fn.scale_tril.stride(0) == 0  # the case this is for: an argument expanded over the batch
    assert args_valid(trace_of(build)) == torch_says(build) == (bad is None)


@pytest.mark.parametrize("case", [
    ("normal", lambda s: dist.Normal(torch.zeros(1), torch.tensor([s]).expand(4)).to_event(0), True),
    ("independent", lambda s: dist.Normal(torch.zeros(4, 2), s).to_event(1), True),
    ("masked", lambda s: dist.Normal(torch.zeros(4), s).mask(torch.tensor([True, False, True, True])), True),
    ("categorical", lambda s: dist.Categorical(torch.tensor([0.5, 0.5 * s])), True),
    ("dirichlet", lambda s: dist.Dirichlet(torch.tensor([1.0, s]).expand(4, 2)), True),
    ("lognormal", lambda s: dist.LogNormal(torch.zeros(4), s), False),  # a transformed distribution: not checked here
])
@pytest.mark.parametrize("scale", [1.0, -1.0])
def test_args_valid_agrees_with_torch_through_wrappers(case, scale):
    """Through ``Independent`` and ``MaskedDistribution`` and on expanded arguments: the
    verdict equals torch's own when the class is one :data:`CHECKED`; a class outside it is
    never called valid (the loss then traces with validation)."""
    name, make, trusted = case
    build = lambda: make(scale)  # noqa: E731
    trace = trace_of(build)
    assert checkable(trace) == trusted
    if trusted:
        assert args_valid(trace) == torch_says(build) == (scale > 0)
    else:
        assert not args_valid(trace)


def latent_mean_model(D=4, N=30, seed=3):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    L0 = torch.linalg.cholesky(A @ A.T + torch.eye(D, dtype=torch.float64))
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    runs = []

    def model(x, L):
        runs.append(dist.is_validation_enabled())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(D, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", dist.MultivariateNormal(z, scale_tril=L), obs=x)

    return model, x, L0, runs


def test_latent_mean_trace_runs_without_validation_after_the_first_step():
    """A latent mean with a full ``scale_tril`` (held expanded to ``(N, D, D)``, its check half
    of a step at D = 200): from the second step on the loss traces it without validation and
    checks the arguments at their own shapes; the loss and its gradient equal a fresh,
    fully validated loss's (every mask: the quiet trace draws no latent, so a random
    schedule would see other masks than the fresh loss under the same seed)."""
    model, x, L0, runs = latent_mean_model()
    L = L0.clone().requires_grad_()
    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="exhaustive")
    loss.differentiable_loss(model, None, x, L)
    assert runs[0] is True
    runs.clear()
    quiet = loss.differentiable_loss(model, None, x, L)
    assert runs[0] is False and dist.is_validation_enabled()
    fresh = MaskedPretrainingLoss(masks="exhaustive").differentiable_loss(model, None, x, L)
    torch.testing.assert_close(quiet, fresh, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(quiet, L)[0], torch.autograd.grad(fresh, L)[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad", ["upper", "negative_diagonal", "nan"])
def test_latent_mean_bad_scale_tril_at_a_later_step_raises_pyros_error(bad):
    """A ``scale_tril`` gone bad after the first step: the fresh loss's exact error (Pyro's
    validation), from a trace made again with validation; the step after a good one is
    quiet again only once validated anew."""
    model, x, L0, runs = latent_mean_model()
    pyro.clear_param_store()
    loss = MaskedPretrainingLoss()
    loss.differentiable_loss(model, None, x, L0)
    broken = L0.clone()
    if bad == "upper":
        broken = L0.T.clone()
    elif bad == "negative_diagonal":
        broken[1, 1] = -1.0
    else:
        broken[2, 0] = float("nan")
    pyro.set_rng_seed(6)
    with pytest.raises(Exception) as fresh:
        MaskedPretrainingLoss().differentiable_loss(model, None, x, broken)
    assert isinstance(fresh.value, ValueError) and "scale_tril" in str(fresh.value)
    runs.clear()
    pyro.set_rng_seed(6)
    with pytest.raises(Exception) as later:
        loss.differentiable_loss(model, None, x, broken)
    assert type(later.value) is type(fresh.value) and str(later.value) == str(fresh.value)
    assert runs[0] is False and runs[-1] is True
    runs.clear()
    loss.differentiable_loss(model, None, x, L0)  # validated, and remembered again
    loss.differentiable_loss(model, None, x, L0)
    assert runs[0] is True and runs[-1] is False


def test_dependent_and_lazy_arguments_are_skipped_as_torch_skips_them():
    """``MultivariateNormal`` built from ``scale_tril`` computes its covariance lazily, which
    torch does not check: nor does :func:`args_valid` (it would read a (N, D, D) product)."""
    build = CASES["mvn"](L0)
    fn = trace_of(build).nodes["x"]["fn"]
    assert "covariance_matrix" not in fn.__dict__
    assert args_valid(trace_of(build))
    assert constraints.is_dependent(dist.Binomial.arg_constraints["total_count"]) is False


def test_exact_evidence_of_a_latent_mean_traces_without_validation_after_the_first_call():
    """``Evidence(method="exact")`` after a first call, of this estimator or a fresh one of the
    same model: the model traced without Pyro's validation, its arguments checked at their
    own shapes; the values and their gradient equal those of a first, validated call (of a
    copy of the model, which nothing remembers); a bad ``scale_tril`` raises the validated
    call's exact error, and the next good call is validated again."""
    from pyro_mpt import Evidence

    model, x, L0, runs = latent_mean_model()
    twin, _, _, twin_runs = latent_mean_model()
    broken = L0.clone()
    broken[1, 1] = -1.0
    with pytest.raises(Exception) as want:
        Evidence(twin)(x, broken)
    assert isinstance(want.value, ValueError) and "scale_tril" in str(want.value)
    L = L0.clone().requires_grad_()
    evidence = Evidence(model)
    evidence(x, L)
    assert runs[0] is True
    for quiet_evidence in (evidence, Evidence(model)):
        runs.clear()
        quiet = quiet_evidence(x, L)
        assert runs[0] is False and dist.is_validation_enabled()
        twin, _, _, twin_runs = latent_mean_model()  # a new model: its first call, validated
        validated = Evidence(twin)(x, L)
        assert twin_runs[0] is True
        torch.testing.assert_close(quiet, validated, rtol=1e-12, atol=0)
        torch.testing.assert_close(
            torch.autograd.grad(quiet.sum(), L)[0], torch.autograd.grad(validated.sum(), L)[0], rtol=1e-12, atol=0
        )
    runs.clear()
    with pytest.raises(Exception) as got:
        Evidence(model)(x, broken)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert runs[0] is False and runs[-1] is True
    runs.clear()
    evidence(x, L0)
    assert runs[0] is True


def _recording_ppca(seen, N=40, D=5, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, K, generator=g, dtype=torch.float64) @ W.T + 0.5 * torch.randn(N, D, generator=g, dtype=torch.float64)
    m = torch.full((K,), 0.7, dtype=torch.float64)  # a nonzero prior mean, told apart from a zero fill

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(m, 1.0).to_event(1))
            if z.shape == (x.shape[0], K):  # the loss's own trace, not an engine's run at its points
                seen.append(z.detach().clone())
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    return model, x, m


@pytest.mark.filterwarnings("ignore::pyro_mpt.ImportanceSamplingWarning")
def test_gaussian_engine_steps_trace_the_latents_at_their_prior_mean_not_a_draw():
    """After the first (validated) step, the Gaussian engine's steps trace the model with
    each latent at its prior mean (it reads no draw): the model sees ``m`` at every
    datapoint, the values equal a fresh loss's, and no normal is drawn. An engine that reads
    the draws (prior importance sampling) still sees draws at every step."""
    seen = []
    model, x, m = _recording_ppca(seen)
    loss = MaskedPretrainingLoss(masks="exhaustive", conditionals="gaussian")
    first = loss.differentiable_loss(model, None, x)
    assert not torch.equal(seen[-1], m.expand_as(seen[-1]))  # the first step drew them
    state = torch.get_rng_state()
    later = loss.differentiable_loss(model, None, x)
    assert torch.equal(seen[-1], m.expand_as(seen[-1]))
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn: exhaustive masks, no latent
    torch.testing.assert_close(later, first, rtol=1e-12, atol=0)

    seen.clear()
    sampled = MaskedPretrainingLoss(masks="uniform", conditionals="importance", num_samples=8)
    for _ in range(2):
        sampled.differentiable_loss(model, None, x)
    assert len(seen) >= 2 and not any(torch.equal(z, m.expand_as(z)) for z in seen)


def test_a_guides_latents_are_replayed_under_the_mean_trace():
    """The mean fills only the latents a guide leaves unset: a guide that samples ``z``
    gives the model its values at every step."""
    seen = []
    model, x, m = _recording_ppca(seen)
    guide_values = []

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        guide_values.append(z.detach().clone())

    loss = MaskedPretrainingLoss(masks="exhaustive", conditionals="gaussian")
    for _ in range(3):
        start = len(seen)
        loss.differentiable_loss(model, guide, x)
        # the step's first model run is its trace (the marginal's runs, and at the first step the
        # check of its vectorized run at probe points, set z themselves)
        torch.testing.assert_close(seen[start], guide_values[-1], rtol=0, atol=0)


def test_exact_evidence_traces_the_latents_at_their_prior_mean_from_its_second_call():
    """``Evidence(method="exact")`` served by the Gaussian marginal: from its second call, and
    at the first call of a fresh estimator of the same model, the model sees the prior
    mean, draws nothing, and the values equal the first call's."""
    from pyro_mpt import Evidence
    from pyro_mpt.conditionals import GaussianConditionals

    seen = []
    model, x, m = _recording_ppca(seen)
    evidence = Evidence(model)
    first = evidence.estimate(x)
    assert isinstance(first.diagnostics["engine"], GaussianConditionals)
    assert not torch.equal(seen[-1], m.expand_as(seen[-1]))
    state = torch.get_rng_state()
    for later_evidence in (evidence, Evidence(model)):
        later = later_evidence(x)
        assert torch.equal(seen[-1], m.expand_as(seen[-1])) and torch.equal(torch.get_rng_state(), state)
        torch.testing.assert_close(later, first.log_evidence, rtol=1e-12, atol=0)

