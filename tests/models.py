"""Small Pyro models shared by the tests."""

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
