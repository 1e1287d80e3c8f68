"""Small models and data shared by the triggers."""

import pytest
import torch
import pyro
import pyro.distributions as dist


from models import exact_posterior_guide, make_ppca, tiny_bert, tiny_vit_mae


# triggers take no arguments; tests/test_errors.py points their files at pytest's tmp_path
TMP_BASE = {}


def _x(n=4, D=3):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(0))


def _ppca(D=3, K=1, n=4):
    model, x, _ = make_ppca(D, K, n)
    return model, x


def _bernoulli_model(K=1, D=3):
    W = torch.ones(D, K)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z @ W.T).to_event(1), obs=x)

    return model


def _global_latent_model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=x)


def _observed(n=4, D=3):
    m = torch.ones(n, D, dtype=torch.bool)
    m[0, 1:] = False  # datapoint 0 observes one token of three
    return m


def _missing_ppca(observed):
    """PPCA whose tokens are missing where ``observed`` is False (via dist.mask), with an
    amortized guide."""

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z.expand(-1, 3), 1.0).mask(observed).to_event(1), obs=x)

    def guide(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(x[:, :1], 1.0).to_event(1))

    return model, guide


def _mm_model(x):
    W = torch.ones(3, 1)
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        pyro.sample("x", dist.Normal(torch.mm(z, W.T), 1.0).to_event(1), obs=x)  # 2-D only


def _guided_ppca():
    model, x = _ppca(D=3, K=1)
    return model, exact_posterior_guide, x


def _tmpdir():
    import tempfile

    return tempfile.mkdtemp(dir=TMP_BASE.get("base"))


def _bert(tmp=None, tokenizer=True):
    pytest.importorskip("transformers")
    return tiny_bert((tmp or _tmpdir()) if tokenizer else None)


def _mae(**kw):
    pytest.importorskip("transformers")
    from pyro_mpt.adapters import MAEScorer

    return MAEScorer(tiny_vit_mae(init=kw.pop("init", True)), **kw)
