"""Triggers of the docs/errors.md rows raised by enumerate / hmm / mixture."""

import torch
import pyro
import pyro.distributions as dist

import pyro_mpt
import pyro_mpt.experiments.compare
import pyro_mpt.experiments.datasets
import pyro_mpt.masks
import pyro_mpt.experiments.vae
from pyro_mpt import MaskedPretrainingLoss


from error_triggers.registry import trigger
from error_triggers.common import _bernoulli_model, _ppca, _x


def _categorical_model(obs="normal", max_support=None):
    w = torch.tensor([0.2, 0.3, 0.5])
    locs = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(w))
            if obs == "student":  # not Gaussian: no Gaussian mixture table either
                pyro.sample("x", dist.MultivariateStudentT(4.0, locs[z], torch.eye(3)), obs=x)
            elif obs == "reshape":  # a reshape to the data's shape does not broadcast
                pyro.sample("x", dist.Normal(locs[z].reshape(x.shape), 1.0).to_event(1), obs=x)
            else:
                pyro.sample("x", dist.Normal(locs[z], 1.0).to_event(1), obs=x)

    return model


def _hmm_obs(emission=None, latent=False):
    def model(x):
        if latent:
            with pyro.plate("data", x.shape[0]):
                pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("sequences", x.shape[0]):
            obs = emission if emission is not None else dist.Normal(torch.zeros(2), 1.0)
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), obs), obs=x)

    return model


@trigger("enumerate-no-latent")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(0.0, 1.0).expand([x.shape[0], 3]).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("enumerate-not-discrete")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_bernoulli_model(), None, torch.ones(4, 3))


@trigger("enumerate-support-too-large")
def _():
    MaskedPretrainingLoss(conditionals="enumerate", max_support=2).loss(_categorical_model(), None, _x())


@trigger("enumerate-tokens-not-independent")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_categorical_model("student"), None, _x())


def _wide_reshape_model(K=65):
    # more values than the engine runs one at a time (MAX_VALUE_RUNS = 64)
    locs = torch.randn(K, 3, generator=torch.Generator().manual_seed(0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(torch.ones(K) / K))
            pyro.sample("x", dist.Normal(locs[z].reshape(x.shape), 1.0).to_event(1), obs=x)

    return model


@trigger("enumerate-model-failed")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_wide_reshape_model(), None, _x())


@trigger("enumerate-per-value")
def _():
    MaskedPretrainingLoss(conditionals="enumerate").loss(_categorical_model("reshape"), None, _x())


@trigger("enumerate-fails-per-value")
def _():
    locs = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(torch.ones(3) / 3))
            # fails on the enumerated values (a reshape to the data's shape) and where every
            # datapoint has one class (a value check of the model's own)
            if bool((z == z.reshape(-1)[0]).all()):
                raise ValueError("this model needs two classes in a batch")
            pyro.sample("x", dist.Normal(locs[z].reshape(x.shape), 1.0).to_event(1), obs=x)

    pyro.set_rng_seed(1)  # a draw with two classes for the model's trace
    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


def _features_summed_from_the_left():
    W = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))

    def feat(x):
        with pyro.plate("data", x.shape[0]):
            with pyro.plate("features", 3):
                f = pyro.sample("f", dist.Bernoulli(0.3))
            logits = (f.unsqueeze(-1) * W.unsqueeze(-2)).sum(-3)  # keepdim=True and .sum(-2) keep the left dims
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    return feat


@trigger("enumerate-enumerated-dims-moved")
def _():
    x = torch.bernoulli(torch.full((50, 6), 0.4), generator=torch.Generator().manual_seed(0))
    MaskedPretrainingLoss(conditionals="enumerate").loss(_features_summed_from_the_left(), None, x)


def _squeezed_mixture(K):
    # locs[z.squeeze(-1)]: a no-op on sampled values (n,), and on the enumerated ones (K, 1) it puts the
    # K values on the datapoints' dim, which Pyro's plate takes for the datapoints where K = n
    locs = torch.randn(K, 2, generator=torch.Generator().manual_seed(0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(torch.ones(K) / K))
            pyro.sample("x", dist.Normal(locs[z.squeeze(-1)], 1.0).to_event(1), obs=x)

    return model, torch.randn(K, 2, generator=torch.Generator().manual_seed(1))


@trigger("enumerate-values-moved")
def _():
    model, x = _squeezed_mixture(65)
    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, x)


@trigger("enumerate-per-value-values-moved")
def _():
    model, x = _squeezed_mixture(3)
    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, x)


@trigger("sites-markov-observed-sites")
def _():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    locs = torch.tensor([[-1.0, 0.0], [1.0, 2.0]])

    def markov_hmm(y):
        with pyro.plate("sequences", y.shape[0]):
            h = 0
            for t in pyro.markov(range(y.shape[1])):
                h = pyro.sample(f"h_{t}", dist.Categorical(probs[h]))
                pyro.sample(f"y_{t}", dist.Normal(locs[h], 1.0).to_event(1), obs=y[:, t])

    MaskedPretrainingLoss(obs_site="y_0").loss(markov_hmm, None, torch.randn(3, 4, 2))


@trigger("enumerate-component-not-gaussian")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(torch.ones(2) / 2))
            r = pyro.sample("r", dist.Gamma(2.0, 1.0))
            pyro.sample("x", dist.Normal((z * r).unsqueeze(-1) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("enumerate-per-token-with-continuous")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("tokens", x.shape[-1], dim=-1):
                on = pyro.sample("on", dist.Bernoulli(0.5))
                pyro.sample("x", dist.Normal(on * z, 1.0), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate", token_plates=("tokens",)).loss(model, None, _x())


@trigger("enumerate-discrete-after-continuous")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            z = pyro.sample("z", dist.Bernoulli(logits=u))
            pyro.sample("x", dist.Normal((z + u).unsqueeze(-1) * torch.ones(3), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, _x())


@trigger("hmm-not-discrete-hmm")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="hmm").loss(model, None, x)


@trigger("hmm-other-latents")
def _():
    MaskedPretrainingLoss(conditionals="hmm").loss(_hmm_obs(latent=True), None, torch.randn(3, 5))


@trigger("enumerate-hmm-other-latents")
def _():
    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(torch.ones(2) / 2))
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            locs = torch.stack([u, -u], -1) + c.unsqueeze(-1)
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), dist.Normal(locs.unsqueeze(-2), 1.0)), obs=x)

    MaskedPretrainingLoss(conditionals="enumerate").loss(model, None, torch.randn(3, 5))


@trigger("hmm-emission-event")
def _():
    emission = dist.MultivariateStudentT(4.0, torch.zeros(2, 2), torch.eye(2))
    MaskedPretrainingLoss(conditionals="hmm").loss(_hmm_obs(emission), None, torch.randn(3, 5, 2))


@trigger("hmm-extra-event-dims")
def _():
    hmm = dist.DiscreteHMM(torch.zeros(2), torch.zeros(2, 2), dist.Normal(torch.zeros(2), 1.0))

    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", hmm.expand_by([2]).to_event(1), obs=x)

    MaskedPretrainingLoss(conditionals="hmm").loss(model, None, torch.randn(3, 2, 5))


@trigger("mixture-table-shape")
def _():
    pyro_mpt.conditionals.MixtureTable(torch.zeros(3), torch.zeros(3, 4))


@trigger("mixture-weights-shape")
def _():
    pyro_mpt.conditionals.MixtureTable(torch.zeros(2), torch.zeros(3, 4, 5))


def _gaussian_hmm_obs(latent=False, several=False):
    eye = torch.eye(2)
    lds = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(2), eye), 0.5 * eye,
                           dist.MultivariateNormal(torch.zeros(2), eye), eye, dist.Normal(torch.zeros(2), 1.0).to_event(1))

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            if latent:
                pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", lds.expand_by([2]).to_event(1) if several else lds, obs=x)

    return model


@trigger("gaussian-hmm-not-gaussian-hmm")
def _():
    model, x = _ppca()
    MaskedPretrainingLoss(conditionals="gaussian_hmm").loss(model, None, x)


@trigger("gaussian-hmm-other-latents")
def _():
    MaskedPretrainingLoss(conditionals="gaussian_hmm").loss(_gaussian_hmm_obs(latent=True), None, torch.randn(3, 4, 2))


@trigger("gaussian-hmm-extra-event-dims")
def _():
    MaskedPretrainingLoss(conditionals="gaussian_hmm").loss(_gaussian_hmm_obs(several=True), None, torch.randn(3, 2, 4, 2))


@trigger("gaussian-hmm-short")
def _():
    from pyro_mpt.conditionals import GaussianHMMConditionals

    MaskedPretrainingLoss(conditionals=GaussianHMMConditionals(min_tokens=100)).loss(_gaussian_hmm_obs(), None, torch.randn(3, 4, 2))


@trigger("gaussian-hmm-not-finite")
def _():
    eye = torch.eye(2)
    # 100^(2 k) passes float64's 1e308 after 77 steps without context
    lds = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(2), eye), 100.0 * eye, dist.MultivariateNormal(torch.zeros(2), eye),
                           torch.ones(2, 1), dist.Normal(torch.zeros(1), 1.0).to_event(1))

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", lds, obs=x)

    pyro.set_rng_seed(0)
    MaskedPretrainingLoss(conditionals="gaussian_hmm", masks="all").loss(model, None, torch.randn(2, 100, 1))


@trigger("gaussian-hmm-ill-conditioned")
def _():
    from pyro_mpt.conditionals import GaussianHMMConditionals
    from pyro_mpt.observed_tokens import trace_tokens

    # C = (1, 1), A near 1.35 I: the direction (1, -1) expands, informed only through A's
    # small off-diagonal part; 115 of 120 steps masked
    T, f64 = 120, torch.float64
    eye = torch.eye(2, dtype=f64)
    A = 1.35 * eye + 0.05 * torch.randn(2, 2, generator=torch.Generator().manual_seed(1), dtype=f64)
    lds = dist.GaussianHMM(dist.MultivariateNormal(torch.zeros(2, dtype=f64), eye), A,
                           dist.MultivariateNormal(torch.zeros(2, dtype=f64), 0.1 * eye), torch.ones(2, 1, dtype=f64),
                           dist.Normal(torch.zeros(1, dtype=f64), 0.5).to_event(1), duration=T)
    x = 0.3 * torch.randn(2, T, 1, generator=torch.Generator().manual_seed(0), dtype=f64).cumsum(1)

    def model(x):
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", lds, obs=x)

    tokens = trace_tokens(model, None, (x,), {})
    engine = GaussianHMMConditionals()
    state = engine.prepare(tokens, model, None, (x,), {})
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(8, 2, T, dtype=torch.bool)
    for a in range(8):
        for i in range(2):
            mask[a, i, torch.randperm(T, generator=g)[:115]] = True
    engine.mask_log_prob(state, tokens.value, mask)
