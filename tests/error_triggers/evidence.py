"""Triggers of the docs/errors.md rows raised by evidence."""

import torch
import pyro
import pyro.distributions as dist
from pyro import poutine

from pyro_mpt import Evidence, ImportanceWeightedELBO, MaskedPretrainingLoss

from models import make_ppca

from error_triggers.registry import trigger
from error_triggers.common import _bernoulli_model, _global_latent_model, _missing_ppca, _observed, _ppca, _x


@trigger("evidence-unknown-method")
def _():
    Evidence(lambda x: None, method="laplace")


@trigger("evidence-exact-not-gaussian")
def _():
    Evidence(_bernoulli_model(), method="exact")(torch.ones(4, 3))


@trigger("evidence-unknown-option")
def _():
    model, x = _ppca()
    Evidence(model, num_samples=500)(x)


@trigger("evidence-importance-chunk-size")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", num_samples=10, chunk_size=0)(x)


@trigger("iwelbo-counts")
def _():
    ImportanceWeightedELBO(num_particles=0)


@trigger("iwelbo-elbo-options")
def _():
    ImportanceWeightedELBO(vectorize_particles=True)


@trigger("iwelbo-unknown-option")
def _():
    ImportanceWeightedELBO(num_particle=4)


@trigger("guide-elbo-class")
def _():
    from pyro.infer import Trace_ELBO

    from pyro_mpt.guide_elbo import WithGuideELBO

    WithGuideELBO(MaskedPretrainingLoss(), Trace_ELBO)


@trigger("guide-elbo-weight")
def _():
    from pyro_mpt.guide_elbo import WithGuideELBO

    WithGuideELBO(MaskedPretrainingLoss(), weight=float("nan"))


@trigger("evidence-hidden-randomness")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal((z + w)[:, None], 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    Evidence(poutine.block(model, hide=["w"]), method="exact")(torch.randn(6, 3))


@trigger("loss-hidden-randomness")
def _():
    from pyro_mpt import MaskedPretrainingLoss

    def model(x):
        offset = torch.randn(())  # drawn outside the trace
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal((z + offset)[:, None], 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    MaskedPretrainingLoss(masks="order").score(model, None, torch.randn(6, 3))


@trigger("evidence-importance-num-samples")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", num_samples=0)(x)


@trigger("evidence-importance-proposal")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", proposal="posterior")(x)


@trigger("evidence-importance-needs-guide")
def _():
    model, x = _ppca()
    Evidence(model, method="importance", proposal="guide")(x)


@trigger("evidence-importance-global-latent")
def _():
    Evidence(_global_latent_model, method="importance")(_x())


@trigger("evidence-importance-khat")
def _():
    model, x, _ = make_ppca(20, 2, 4, sigma=0.1)
    Evidence(model, method="importance", num_samples=50)(x)


@trigger("missing-tokens-guide-evidence")
def _():
    model, guide = _missing_ppca(_observed())
    Evidence(model, guide, method="importance", proposal="guide")(_x())


@trigger("missing-tokens-iwelbo")
def _():
    from pyro_mpt.importance_weighted_elbo import ImportanceWeightedELBO

    model, guide = _missing_ppca(_observed())
    ImportanceWeightedELBO(4).loss(model, guide, _x())


@trigger("iwelbo-not-reparameterized")
def _():
    from pyro_mpt.importance_weighted_elbo import ImportanceWeightedELBO

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.ones(2, dtype=torch.float64) / 2))
            loc = torch.tensor([-1.0, 1.0], dtype=torch.float64)[c]
            pyro.sample("x", dist.Normal(loc[..., None].expand(c.shape + (3,)), 1.0).to_event(1), obs=x)

    def guide(x):
        logits = pyro.param("c_logits", torch.zeros(2, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(logits=logits))

    pyro.clear_param_store()
    ImportanceWeightedELBO(4).differentiable_loss(model, guide, _x())


@trigger("evidence-importance-few-effective-samples")
def _():
    probs = torch.tensor([0.999, 0.001], dtype=torch.float64)
    locs = torch.tensor([[0.0, 0.0, 0.0], [6.0, 6.0, 6.0]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(probs))
            pyro.sample("x", dist.Normal(locs[c], 1.0).to_event(1), obs=x)

    Evidence(model, method="importance", num_samples=2000)(torch.full((1, 3), 6.0, dtype=torch.float64))


