r"""A deep (MLP) variational autoencoder written as a Pyro model and guide.

.. math::

    z_i \sim \mathcal N(0, I_K), \qquad
    x_{id} \mid z_i \sim \operatorname{Bernoulli}(\sigma(f_\theta(z_i)_d))
    \;\text{ or }\; \mathcal N(f_\theta(z_i)_d, s_d^2),

with an amortized Gaussian encoder :math:`q_\phi(z \mid x) =
\mathcal N(\mu_\phi(x), \operatorname{diag}\sigma_\phi(x)^2)` as the guide. The
tokens of datapoint :math:`i` are its :math:`D` pixels, independent given
:math:`z_i`, so every sampling engine (``"encode_decode"``, ``"importance"``)
and ``Evidence(method="importance")`` serve it, and for :math:`K \le 4`
``"quadrature"`` too. The guide reads the data through its first argument and
its plate size from ``x.shape[0]``, so engines can encode many imputed copies
of a batch in one call.
"""

import torch
import pyro
import pyro.distributions as dist
from torch import nn
from torch.nn import functional as F

__all__ = ["DeepVAE", "mlp"]


def mlp(sizes, activation=nn.Softplus):
    """A multilayer perceptron with ``activation`` between the linear layers."""
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class DeepVAE(nn.Module):
    """MLP VAE with ``model(x)`` and ``guide(x)`` methods for Pyro.

    :param int num_tokens: ``D``, pixels per image.
    :param int latent_dim: ``K``.
    :param tuple hidden: hidden layer widths of decoder and encoder.
    :param str likelihood: ``"bernoulli"`` (binary pixels) or ``"gaussian"``
        (pixels in [0, 1], a learned scale per pixel of at least ``min_scale``).
    :param float min_scale: lower bound of the Gaussian scales: pixels that are
        constant in the data (image borders) would otherwise drive the
        likelihood to infinity.
    :param str name: prefix of the modules' names in Pyro's param store.

    Example::

        >>> vae = DeepVAE(64, latent_dim=4)
        >>> svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-3}), Trace_ELBO())
        >>> svi.step(x)
    """

    def __init__(self, num_tokens, latent_dim=4, hidden=(128,), likelihood="bernoulli", min_scale=0.05, name="vae"):
        super().__init__()
        if likelihood not in ("bernoulli", "gaussian"):
            raise ValueError(f"DeepVAE(likelihood={likelihood!r}): use 'bernoulli' or 'gaussian'.")
        self.num_tokens = int(num_tokens)
        self.latent_dim = int(latent_dim)
        self.likelihood = likelihood
        self.min_scale = float(min_scale)
        self.name = name
        hidden = tuple(hidden)
        self.decoder = mlp((self.latent_dim,) + hidden + (self.num_tokens,))
        self.encoder = mlp((self.num_tokens,) + hidden + (2 * self.latent_dim,))
        if likelihood == "gaussian":
            self.noise = nn.Module()
            self.noise.raw_scale = nn.Parameter(torch.full((self.num_tokens,), 0.0))

    def scale(self):
        """Per-pixel observation scale of the Gaussian likelihood, ``(D,)``."""
        return self.min_scale + F.softplus(self.noise.raw_scale)

    def model(self, x):
        """The generative model :math:`p(z)\\,p(x \\mid z)`; ``x`` is ``(n, D)``."""
        pyro.module(f"{self.name}_decoder", self.decoder)
        if self.likelihood == "gaussian":
            pyro.module(f"{self.name}_noise", self.noise)
        K = self.latent_dim
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(K), x.new_ones(K)).to_event(1))
            out = self.decoder(z)
            if self.likelihood == "bernoulli":
                fn = dist.Bernoulli(logits=out)
            else:
                fn = dist.Normal(out, self.scale())
            pyro.sample("x", fn.to_event(1), obs=x)

    def guide(self, x):
        """The amortized encoder :math:`q(z \\mid x)`; ``x`` is ``(n, D)``."""
        pyro.module(f"{self.name}_encoder", self.encoder)
        K = self.latent_dim
        with pyro.plate("data", x.shape[0]):
            h = self.encoder(x)
            loc, scale = h[..., :K], F.softplus(h[..., K:]) + 1e-4
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))
