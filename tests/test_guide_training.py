"""Whether SVI with MaskedPretrainingLoss trains the guide: the loss trains the model; a guide
whose parameters get no gradient from it is said so once, and WithGuideELBO trains it."""

import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam

from pyro_mpt import EncodeDecodeConditionals, MaskedPretrainingLoss
from pyro_mpt.guide_elbo import WithGuideELBO


def _regression():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, generator=g)
    y = 1.5 + X @ torch.tensor([2.0, -1.0]) + 0.7 * torch.randn(40, generator=g)

    def model(X, y):
        a = pyro.sample("a", dist.Normal(0.0, 10.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        sigma = pyro.param("sigma", torch.tensor(3.0), constraint=dist.constraints.positive)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(a + X @ w, sigma), obs=y)

    return model, X, y


def _small_ppca(seed):
    """Data ``(30, 3)``, a PPCA model with one latent dim and a fixed loading, and the loading."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(30, 3, generator=g)
    W = torch.randn(3, 1, generator=g)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    return x, model, W


def _steps(loss, guide_wrap=None, n=3, seed=0):
    model, X, y = _regression()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.05}), guide_wrap(loss) if guide_wrap else loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = [svi.step(X, y) for _ in range(n)]
    untrained = [w for w in caught if "get no gradient from MaskedPretrainingLoss" in str(w.message)]
    return values, untrained, float(pyro.param("AutoNormal.locs.a")), float(pyro.param("sigma"))


def test_an_autoguide_under_an_exact_engine_is_said_to_stay_untrained_once():
    """Bayesian regression, AutoNormal guide, the Gaussian engine (which integrates a and w
    itself): the guide's locations stayed at 0 with no word. One warning over three steps; the
    model's sigma moves; the guide's location does not."""
    values, untrained, loc, sigma = _steps(MaskedPretrainingLoss(token_plates=("data",), masks="order"))
    assert len(untrained) == 1
    assert "conditionals='gaussian'" in str(untrained[0].message) and "WithGuideELBO" in str(untrained[0].message)
    assert loc == 0.0 and abs(sigma - 3.0) > 0.1


def test_with_guide_elbo_trains_the_guide_without_the_warning():
    _, untrained, loc, sigma = _steps(MaskedPretrainingLoss(token_plates=("data",), masks="order"), WithGuideELBO)
    assert not untrained
    assert loc != 0.0 and abs(sigma - 3.0) > 0.1


def test_the_check_leaves_the_steps_random_draws_alone():
    """The check reads the guide's parameters off the step's own guide trace, without running the
    guide once more: the steps' values with and without the check are the same (a random mask
    schedule, a fresh AutoNormal whose first run draws its initial values; an extra run of the
    guide moved the first step's loss from 97.36 to 94.93)."""
    loss = MaskedPretrainingLoss(token_plates=("data",), masks="uniform")
    checked, untrained, _, _ = _steps(loss)
    unchecked_loss = MaskedPretrainingLoss(token_plates=("data",), masks="uniform")
    unchecked_loss.checks_guide_training = False
    unchecked, none, _, _ = _steps(unchecked_loss)
    assert len(untrained) == 1 and not none
    assert checked == unchecked


def test_an_encoder_trained_through_the_estimate_is_not_warned_about():
    """encode_decode with encoder_grad=True gives the encoder's parameters a gradient: no warning."""
    x, model, W = _small_ppca(1)

    def guide(x):
        A = pyro.param("A", torch.full((3, 1), 0.3))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x @ A, 0.8).to_event(1))

    for encoder_grad, expected in [(True, 0), (False, 1)]:
        pyro.clear_param_store()
        loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(encoder_grad=encoder_grad))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            svi = SVI(model, guide, Adam({"lr": 0.01}), loss)
            svi.step(x)
            svi.step(x)  # the check looks at two steps
        assert sum("get no gradient" in str(w.message) for w in caught) == expected, encoder_grad


def test_a_proposal_with_zero_gradients_and_an_untrained_part_of_a_guide_are_warned_about():
    """The importance engine's guide proposal (guide_grad=False) gets gradients of zeros, not
    None, and an AutoGuideList's AutoNormal over the local latent that the Gaussian engine
    integrates gets none while its AutoDelta over the global mean is trained: both stayed at
    their initial values without the warning, which now names the untrained parameters."""
    from pyro.infer.autoguide import AutoDelta, AutoGuideList

    x, ppca, W = _small_ppca(2)

    def global_mean(x):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(mu + z @ W.T, 0.5).to_event(1), obs=x)

    def warned(model, guide, loss):
        pyro.clear_param_store()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            svi = SVI(model, guide, Adam({"lr": 0.01}), loss)
            svi.step(x)
            svi.step(x)
        return [str(w.message) for w in caught if "get no gradient" in str(w.message)]

    messages = warned(ppca, AutoNormal(ppca), MaskedPretrainingLoss(conditionals="importance", num_samples=16))
    # the scales too: they got a gradient of rounding (two paths through them that cancelled),
    # went unnamed, and Adam moved them by steps of its full size
    assert len(messages) == 1 and "'AutoNormal.locs.z', 'AutoNormal.scales.z'" in messages[0]
    assert "conditionals='importance'" in messages[0]
    guide = AutoGuideList(global_mean)
    guide.append(AutoDelta(pyro.poutine.block(global_mean, expose=["mu"])))
    guide.append(AutoNormal(pyro.poutine.block(global_mean, expose=["z"])))
    messages = warned(global_mean, guide, MaskedPretrainingLoss())
    assert len(messages) == 1 and "locs.z" in messages[0] and "mu" not in messages[0].split(")")[0]


def test_a_layer_behind_a_zero_initialized_one_is_trained_from_the_second_step():
    """A residual encoder h = skip(x) + l2(tanh(l1(x))) with l2 zero-initialized: l1's gradient
    is zero at the first step only (encode_decode, encoder_grad=True). The check warned that l1
    stays at its initial values, though it moves from the second step; it now looks at two."""
    from pyro.nn import PyroModule

    x, model, W = _small_ppca(4)

    class Encoder(PyroModule):
        def __init__(self):
            super().__init__()
            self.skip = PyroModule[torch.nn.Linear](3, 1)
            self.l1 = PyroModule[torch.nn.Linear](3, 4)
            self.l2 = PyroModule[torch.nn.Linear](4, 1)
            torch.nn.init.zeros_(self.l2.weight)
            torch.nn.init.zeros_(self.l2.bias)

        def forward(self, x):
            loc = self.skip(x) + self.l2(torch.tanh(self.l1(x)))
            with pyro.plate("data", x.shape[0]):
                pyro.sample("z", dist.Normal(loc, 0.8).to_event(1))

    pyro.clear_param_store()
    torch.manual_seed(0)
    guide = Encoder()
    before = guide.l1.weight.detach().clone()
    loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(encoder_grad=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi = SVI(model, guide, Adam({"lr": 0.01}), loss)
        for _ in range(3):
            svi.step(x)
    assert not [w for w in caught if "get no gradient" in str(w.message)]
    assert not torch.equal(guide.l1.weight.detach(), before)


def test_wrapping_a_loss_in_with_guide_elbo_leaves_its_own_check_on():
    """WithGuideELBO(loss) turned the loss's check off for good, so the same loss used on its
    own afterwards no longer warned; it is now off only while WithGuideELBO calls it."""
    loss = MaskedPretrainingLoss(token_plates=("data",), masks="order")
    _, untrained, _, _ = _steps(loss, WithGuideELBO)
    assert not untrained and loss.checks_guide_training
    _, untrained, _, _ = _steps(loss)
    assert len(untrained) == 1


def test_a_guide_made_anew_at_every_step_is_checked_too():
    """A guide passed as a lambda written inside the training loop is a new object at every
    step: the check, kept per guide object, never saw a second step and never warned. It is
    kept per set of guide parameters now: one warning over three steps."""
    model, X, y = _regression()
    pyro.clear_param_store()
    base = AutoNormal(model)
    loss = MaskedPretrainingLoss(token_plates=("data",), masks="order")
    optim = Adam({"lr": 0.05})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            SVI(model, lambda X, y: base(X, y), optim, loss).step(X, y)
    assert sum("get no gradient" in str(w.message) for w in caught) == 1


def test_with_guide_elbo_takes_a_0_dim_tensor_weight_and_refuses_bad_ones():
    """A 0-dim tensor weight was refused by the weight check added beside the class check; it is
    the number it holds. NaN, negative and bool weights, and a loss class for an instance, are
    refused by name."""
    import numpy as np
    from pyro.infer import Trace_ELBO

    assert WithGuideELBO(MaskedPretrainingLoss(), weight=torch.tensor(0.5)).weight == 0.5
    assert WithGuideELBO(MaskedPretrainingLoss(), weight=np.float32(2)).weight == 2.0
    for bad in (float("nan"), -1.0, True, "1"):
        with pytest.raises(ValueError, match="give a finite number >= 0"):
            WithGuideELBO(MaskedPretrainingLoss(), weight=bad)
    with pytest.raises(TypeError, match=r"give an instance, Trace_ELBO\(\)"):
        WithGuideELBO(MaskedPretrainingLoss(), Trace_ELBO)


@pytest.mark.parametrize("proposal", ["autoguide", "diagonal", "multivariate", "lowrank", "encoder", "encoder-original"])
def test_the_importance_proposal_leaves_the_guide_untouched(proposal):
    """Without guide_grad the importance proposal's guide gets no gradient at all: its
    parameters met the estimate through two paths that cancelled up to rounding (1e-17), and
    Adam, which normalizes a gradient's scale away, moved an AutoNormal's scales by 1.6e-2 in
    100 steps from 0.1; and an AutoDiagonalNormal's posterior, made without a graph, still held
    its loc parameter itself (a Normal keeps it as given), which got the full gradient (0.4 in
    10 steps). After 30 Adam steps every guide parameter is where it started, while the model's
    loading has moved."""
    from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoMultivariateNormal
    x, _, _ = _small_ppca(3)

    def model(x):
        W = pyro.param("W", 0.3 * torch.ones(3, 1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    autoguides = {"autoguide": AutoNormal, "diagonal": AutoDiagonalNormal, "multivariate": AutoMultivariateNormal,
                  "lowrank": AutoLowRankMultivariateNormal}
    if proposal in autoguides:
        guide = autoguides[proposal](model)
    else:
        encoder = torch.nn.Linear(3, 2)

        def guide(x):
            pyro.module("encoder", encoder)
            h = encoder(x)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("z", dist.Normal(h[..., :1], torch.nn.functional.softplus(h[..., 1:]) + 0.1).to_event(1))

    loss = MaskedPretrainingLoss(conditionals="importance", num_samples=32, impute=proposal == "encoder")
    svi = SVI(model, guide, Adam({"lr": 0.02}), loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svi.step(x)
        start = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        for _ in range(30):
            svi.step(x)
    moved = {k for k, v in pyro.get_param_store().items() if not torch.equal(v.detach(), start[k])}
    assert moved == {"W"}
