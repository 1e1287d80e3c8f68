"""Triggers of the docs/errors.md rows raised by latent_runs.py."""

import warnings

import torch
import pyro
import pyro.distributions as dist

from pyro_mpt import EncodeDecodeConditionals, Evidence, ImportanceConditionals, MaskedPretrainingLoss

from models import exact_posterior_guide, make_ppca

from error_triggers.registry import trigger
from error_triggers.common import _global_latent_model, _guided_ppca, _missing_ppca, _mm_model, _observed, _ppca, _x


@trigger("data-arg-type")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=0.5)).loss(model, guide, x)


@trigger("data-arg-unknown-keyword")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg="data")).loss(model, guide, x)


@trigger("data-arg-position")
def _():
    model, guide, x = _guided_ppca()
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=2)).loss(model, guide, x)


def _two_arg_models():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model2(x, y):
        model(x)

    def guide2(x, y):
        guide(x)

    return model2, guide2, x


@trigger("data-arg-not-the-data")
def _():
    model, guide, x = _two_arg_models()
    loss = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(data_arg=1))
    loss.loss(model, guide, x, torch.zeros(4, 3))


@trigger("data-arg-not-found")
def _():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model0():
        model(x)

    def guide0():
        guide(x)

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model0, guide0)


@trigger("data-arg-ambiguous")
def _():
    model, x = _ppca()
    guide = exact_posterior_guide

    def model2(x, y):
        model(x + 0)  # the observed value is a new tensor, equal to both arguments

    def guide2(x, y):
        guide(x)

    MaskedPretrainingLoss(conditionals="encode_decode").loss(model2, guide2, x, x.clone())


@trigger("runner-global-latent")
def _():
    MaskedPretrainingLoss(conditionals="importance").loss(_global_latent_model, None, _x())


@trigger("runner-model-does-not-broadcast")
def _():
    # a model that fails in every run after its first (vectorized or one point at a time)
    runs = []

    def model(x):
        runs.append(1)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(1, dtype=x.dtype), 1.0).to_event(1))
            if len(runs) > 1:
                raise RuntimeError("the data source is exhausted")
            pyro.sample("x", dist.Normal(z.expand(z.shape[:-1] + (3,)), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="importance").loss(model, None, _x())


@trigger("runner-per-point-fallback")
def _():
    Evidence(_mm_model, method="importance", num_samples=20)(_x())


@trigger("runner-observation-does-not-broadcast")
def _():
    # runs, but the reshape by the batch size puts the latent values into the event
    y = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))

    def image(y):
        with pyro.plate("data", y.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=y.dtype), 1.0).to_event(1))
            loc = (z @ torch.ones(2, 6, dtype=y.dtype)).reshape(y.shape[0], 2, -1)
            pyro.sample("x", dist.Normal(loc, 1.0).to_event(2), obs=y)

    Evidence(image, method="importance", num_samples=20)(y)


@trigger("runner-per-point-too-many")
def _():
    Evidence(_mm_model, method="importance", num_samples=3000)(_x())


@trigger("runner-guide-extra-site")
def _():
    model, x = _ppca()

    def guide(x):
        pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    engine = ImportanceConditionals(proposal="guide", impute=False)
    MaskedPretrainingLoss(conditionals=engine).loss(model, guide, x)


def _mm_guide(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))
    torch.mm(z, torch.ones(1, 1, dtype=z.dtype))  # 2-D only: fails with a particle dim on the left


@trigger("runner-guide-does-not-broadcast")
def _():
    model, x = _ppca()
    engine = ImportanceConditionals(proposal="guide", impute=False)
    MaskedPretrainingLoss(conditionals=engine).loss(model, _mm_guide, x)


@trigger("runner-guide-fails-on-imputed-data")
def _():
    model, x = _ppca()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        MaskedPretrainingLoss(conditionals="encode_decode").loss(model, _mm_guide, x)


@trigger("runner-guide-stacking-fallback")
def _():
    model, x = _ppca()

    def guide(x):
        with pyro.plate("data", 4):  # a fixed plate size: stacked copies do not fit
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 1), num_masks=2).loss(model, guide, x)


@trigger("runner-guide-stacking-fallback-subsampled")
def _():
    W = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))

    def model(idx, x):
        with pyro.plate("data", 10, subsample=idx):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    def guide(idx, x):  # the subsampled plate of Pyro's minibatch idiom
        with pyro.plate("data", 10, subsample=idx):
            pyro.sample("z", dist.Normal(x[:, :2], 1.0).to_event(1))

    idx = torch.tensor([0, 3, 5, 8])
    MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(4, 1), num_masks=2).loss(
        model, guide, idx, torch.randn(4, 5))


@trigger("missing-tokens-guide-engine")
def _():
    model, guide = _missing_ppca(_observed())
    MaskedPretrainingLoss(conditionals="encode_decode").loss(model, guide, _x())


@trigger("importance-poor-weights")
def _():
    model, x, _ = make_ppca(20, 2, 4, sigma=0.1)
    engine = ImportanceConditionals(256, proposal="prior")
    MaskedPretrainingLoss(conditionals=engine, masks="order").loss(model, None, x)


@trigger("guide-point-mass")
def _():
    from pyro.infer.autoguide import AutoDelta

    model, x = _ppca()
    Evidence(model, AutoDelta(model), method="importance", num_samples=10)(x)


@trigger("guide-point-mass-collapsed")
def _():
    model, x = _ppca()

    def collapsed(x):
        # a Normal encoder whose scale rounds to zero against its mean (a diverged training run)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(torch.full((x.shape[0], 1), 1e15, dtype=x.dtype), 1e-4).to_event(1))

    Evidence(model, collapsed, method="importance", num_samples=10)(x)


@trigger("guide-point-mass-discrete")
def _():
    def mixture(x):
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.ones(3, dtype=x.dtype) / 3))
            pyro.sample("x", dist.Normal(torch.tensor([-2.0, 0.0, 2.0], dtype=x.dtype)[c], 1.0), obs=x)

    def one_hot(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("c", dist.Categorical(torch.tensor([1.0, 0.0, 0.0], dtype=x.dtype)))

    Evidence(mixture, one_hot, method="importance", num_samples=10)(torch.tensor([0.1, -1.5, 2.2], dtype=torch.float64))


@trigger("guide-sites-mismatch")
def _():
    model, x = _ppca()

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("zz", dist.Normal(torch.zeros(x.shape[0], 1, dtype=x.dtype), 1.0).to_event(1))

    MaskedPretrainingLoss().loss(model, guide, x)


def _shared_aux_guide(x):
    # a hand-written guide with one auxiliary draw for all datapoints (not one of Pyro's autoguides)
    u = pyro.sample("u", dist.Normal(torch.zeros(x.shape[0], dtype=x.dtype), 1.0).to_event(1),
                    infer={"is_auxiliary": True})
    with pyro.plate("data", x.shape[0]):
        pyro.sample("z", dist.Delta(u[..., None], event_dim=1))


def _local_aux_guide(x):
    with pyro.plate("data", x.shape[0]):
        u = pyro.sample("z_u", dist.Normal(torch.zeros(x.shape[0], 1, dtype=x.dtype), 1.0).to_event(1),
                        infer={"is_auxiliary": True})
        pyro.sample("z", dist.Delta(u, event_dim=1))


@trigger("runner-auxiliary-outside-data-plate")
def _():
    model, x = _ppca()
    Evidence(model, _shared_aux_guide, method="importance", num_samples=10)(x)


@trigger("runner-auxiliary-not-replayable")
def _():
    model, x = _ppca()
    engine = ImportanceConditionals(16, proposal="guide")
    MaskedPretrainingLoss(conditionals=engine).loss(model, _local_aux_guide, x)


@trigger("autoguide-part-point-mass")
def _():
    from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal

    model, x = _split_latent_ppca()
    guide = AutoGuideList(model)
    guide.append(AutoNormal(pyro.poutine.block(model, expose=["a"])))
    guide.append(AutoDelta(pyro.poutine.block(model, expose=["b"])))
    Evidence(model, guide, method="importance", num_samples=10)(x)


@trigger("autoguide-laplace-not-taken")
def _():
    from pyro.infer.autoguide import AutoLaplaceApproximation

    model, x, _ = make_ppca(3, 2, 4)
    guide = AutoLaplaceApproximation(model)
    guide(x)
    Evidence(model, guide, method="importance", num_samples=10)(x)


@trigger("autoguide-not-served")
def _():
    from pyro.infer.autoguide import AutoIAFNormal

    model, x, _ = make_ppca(3, 2, 4, dtype=torch.float32)  # the flow's networks are float32
    Evidence(model, AutoIAFNormal(model), method="importance", num_samples=10)(x)


def _split_latent_ppca():
    W = torch.tensor([[1.0, 0.5], [0.2, 1.0], [0.3, -0.4]], dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
            pyro.sample("x", dist.Normal(torch.stack([a, b], -1) @ W.T, 1.0).to_event(1), obs=x)

    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return model, x




@trigger("autoguide-foreign-site")
def _():
    from pyro.infer.autoguide import AutoNormal

    model, x = _split_latent_ppca()
    other, _ = _ppca()
    guide = AutoNormal(other)
    guide(x)  # built on another model, whose latent is 'z'
    Evidence(model, guide, method="importance", num_samples=10)(x)


@trigger("guide-untrained")
def _():
    from pyro.infer import SVI
    from pyro.infer.autoguide import AutoNormal
    from pyro.optim import Adam

    X = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    y = X @ torch.tensor([2.0, -1.0])

    def regression(X, y):
        a = pyro.sample("a", dist.Normal(0.0, 10.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(a + X @ w, 0.7), obs=y)

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(token_plates=("data",), masks="order")
    svi = SVI(regression, AutoNormal(regression), Adam({"lr": 0.01}), loss)
    svi.step(X, y)
    svi.step(X, y)  # the check looks at the first two steps
