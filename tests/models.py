"""Small Pyro models shared by the tests."""

import os

import torch
import pyro
import pyro.distributions as dist


def make_ppca(D, K, N, seed=0, sigma=0.5, dtype=torch.float64):
    """A PPCA model with fixed parameters as pyro.params, data from the model, exact marginal."""
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g, dtype=dtype)
    mu0 = torch.randn(D, generator=g, dtype=dtype)
    z = torch.randn(N, K, generator=g, dtype=dtype)
    x = z @ W0.T + mu0 + sigma * torch.randn(N, D, generator=g, dtype=dtype)

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.param("mu", mu0.clone())
        s = pyro.param("s", torch.tensor(sigma, dtype=dtype), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=dtype), 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    def exact(x):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        S = W @ W.T + s**2 * torch.eye(D, dtype=dtype)
        return torch.distributions.MultivariateNormal(mu, S).log_prob(x)

    model(x)  # register the params
    return model, x, exact


def make_full_gaussian(D, N, seed=0, dtype=torch.float64):
    """A latent-free model with a full-covariance MultivariateNormal observation."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g, dtype=dtype)
    S0 = A @ A.T / D + 0.5 * torch.eye(D, dtype=dtype)
    mu0 = torch.randn(D, generator=g, dtype=dtype)
    x = torch.distributions.MultivariateNormal(mu0, S0).sample((N,))

    def model(x):
        L = pyro.param("L", torch.linalg.cholesky(S0))
        mu = pyro.param("mu", mu0.clone())
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.MultivariateNormal(mu, scale_tril=torch.tril(L)), obs=x)

    def exact(x):
        L = torch.tril(pyro.param("L"))
        return torch.distributions.MultivariateNormal(pyro.param("mu"), scale_tril=L).log_prob(x)

    model(x)  # register the params
    return model, x, exact


#: the vocabulary of the tiny BERT tokenizers: special tokens, then ten letters
TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghij")


def tiny_bert(vocab_dir=None, seed=0, **config):
    """A randomly initialized one-layer ``BertForMaskedLM`` over :data:`TINY_VOCAB` and,
    when ``vocab_dir`` is given, its ``BertTokenizer`` (the vocab file is written there)."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(TINY_VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32, max_position_embeddings=32)
    cfg.update(config)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**cfg)).eval()
    if vocab_dir is None:
        return model, None
    path = os.path.join(str(vocab_dir), "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(TINY_VOCAB) + "\n")
    return model, transformers.BertTokenizer(vocab=path, do_lower_case=False)


def tiny_vit_mae(init=True, seed=0, **config):
    """A randomly initialized one-layer ``ViTMAEForPreTraining`` on 8x8 RGB images of 4x4 patches;
    ``init`` fills its (otherwise uninitialized) fixed sin-cos position embeddings."""
    import transformers
    from pyro_mpt.adapters.vit_mae import init_position_embeddings

    torch.manual_seed(seed)
    cfg = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
               num_attention_heads=2, intermediate_size=32, decoder_hidden_size=8, decoder_num_hidden_layers=1,
               decoder_num_attention_heads=2, decoder_intermediate_size=16)
    cfg.update(config)
    model = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**cfg)).eval()
    return init_position_embeddings(model) if init else model
