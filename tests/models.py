"""Small Pyro models and helpers shared by the tests."""

import functools
import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
from scipy.linalg import block_diag
from scipy.stats import norm
import pyro
import pyro.distributions as dist

from pyro_mpt import Evidence, MaskedPretrainingLoss

ROOT = Path(__file__).resolve().parents[1]


def make_ppca(D, K, N, seed=0, sigma=0.5, dtype=torch.float64, device="cpu"):
    """A PPCA model with fixed parameters as pyro.params, data from the model, exact marginal.

    Parameters and data are drawn in float64 on the CPU, then cast to ``dtype`` and moved
    to ``device``: one seed gives the same model in every dtype (up to rounding) and on
    every device. The model builds its constants on the data's device, as a model meant
    to run on a GPU does. Its params keep the values already in the param store: clear
    the store before building a second model in one test.
    """
    g = torch.Generator().manual_seed(seed)
    host = dict(generator=g, dtype=torch.float64, device="cpu")  # explicit: the default device may be another
    W0 = torch.randn(D, K, **host)
    mu0 = torch.randn(D, **host)
    z = torch.randn(N, K, **host)
    x = z @ W0.T + mu0 + sigma * torch.randn(N, D, **host)
    W0, mu0, x = (t.to(dtype=dtype, device=device) for t in (W0, mu0, x))

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.param("mu", mu0.clone())
        s = pyro.param("s", torch.tensor(sigma, dtype=dtype, device=device), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0], device=x.device):
            prior = dist.Normal(torch.zeros((), dtype=dtype, device=x.device), 1.0).expand([K]).to_event(1)
            z = pyro.sample("z", prior)
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    def exact(x):
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        S = W @ W.T + s**2 * torch.eye(D, dtype=dtype, device=W.device)
        return torch.distributions.MultivariateNormal(mu, S).log_prob(x)

    model(x)  # register the params
    return model, x, exact


def fit_guide(model, guide, *args, steps=300, lr=0.05):
    """``guide`` fitted to ``model`` at ``args`` by ``steps`` steps of Trace_ELBO with Adam
    (the tests' proposals for the importance engine and evidence); returns it."""
    from pyro.infer import SVI, Trace_ELBO
    from pyro.optim import Adam

    svi = SVI(model, guide, Adam({"lr": lr}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide


def exact_posterior_guide(x):
    """The exact posterior q(z | x) = p(z | x) of :func:`make_ppca`'s model, computed from
    its current params (in their dtype, on their device): a zero-variance proposal."""
    W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
    cov = torch.linalg.inv(torch.eye(W.shape[1], dtype=W.dtype, device=W.device) + W.T @ W / s**2)
    loc = ((x - mu) @ W / s**2) @ cov
    with pyro.plate("data", x.shape[0], device=x.device):
        pyro.sample("z", dist.MultivariateNormal(loc, covariance_matrix=cov))


def make_singular_ppca(noise, w=None, N=5, dtype=torch.float64):
    """PPCA whose loading W = [w, w] has two equal columns (rank 1) and a tiny noise scale:
    its covariance W W^T + noise^2 I is singular to working precision.

    :param w: the column, D values (default: 8 standard normal draws).
    :returns: the model, the data (drawn from the noise-free model) and W in float64.
    """
    g = torch.Generator().manual_seed(0)
    if w is None:
        w = torch.randn(8, generator=g, dtype=torch.float64)
    w = torch.as_tensor(w, dtype=torch.float64).reshape(-1, 1)
    W64 = torch.cat([w, w], 1)
    x = (torch.randn(N, 1, generator=g, dtype=torch.float64) @ w.T).to(dtype)
    W, s = W64.to(dtype), torch.tensor(noise, dtype=dtype)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    return model, x, W64


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
    return init_position_embeddings(model, reinit=True) if init else model


# ---------------------------------------------------------------------- estimators as cases
def score_case(engine, masks="uniform", num_masks=2, guide=False, **loss_options):
    """A case ``run(model, guide, x)``: the MPT score of each datapoint with a fresh ``engine()``
    (the guide is passed on only when ``guide`` is true)."""

    def run(model, g, x):
        loss = MaskedPretrainingLoss(conditionals=engine(), masks=masks, num_masks=num_masks, **loss_options)
        return loss.score(model, g if guide else None, x)

    return run


def evidence_case(method, guide=False, **options):
    """A case ``run(model, guide, x)``: ``Evidence(method=method, **options)`` of each datapoint."""

    def run(model, g, x):
        return Evidence(model, g if guide else None, method=method, **options)(x)

    return run


# ---------------------------------------------------------------------- scripts
@functools.cache
def load_script(path):
    """The module of the script at ``path``, relative to the repository root (e.g.
    ``"examples/gallery_training.py"``), executed once per session and cached."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- rounding tolerances
def rounding_tolerance(expected, dtype=torch.float32, ulps=256):
    """The largest difference float rounding explains between two computations of ``expected``
    that ran under different shapes, batchings, chunkings, thread counts or CPU kernels:
    ``ulps * eps(dtype) * max(1, |expected|)``, elementwise. ``dtype`` is the precision the
    computation ran in (the adapters' models run in float32 even where they return float64).
    Bitwise equality holds only for the same kernels on the same shapes; BLAS picks its
    kernels (and its summation order) by shape, thread count and CPU capability."""
    scale = torch.as_tensor(expected, dtype=torch.float64).abs().clamp(min=1.0)
    return ulps * torch.finfo(dtype).eps * scale


def assert_close_to_rounding(actual, expected, dtype=torch.float32, ulps=256):
    """``|actual - expected| <= rounding_tolerance(expected, dtype, ulps)`` elementwise
    (tensors or arrays of equal shapes; NaNs must sit at the same places)."""
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.equal(a.isnan(), e.isnan()), "NaNs at different places"
    err = (a - e).abs().nan_to_num(0.0)
    tol = rounding_tolerance(e.nan_to_num(0.0), dtype, ulps)
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g} > tolerance {tol.max().item():.3g}"


def sequences_model(hmm, n):
    """A model observing ``n`` sequences of the distribution ``hmm`` (a ``GaussianHMM`` or
    ``DiscreteHMM``) in a plate ``"sequences"``, at site ``"x"``."""

    def model(x):
        with pyro.plate("sequences", n):
            pyro.sample("x", hmm, obs=x)

    return model


def numpy_lds_moments(m0, S0, A, b, Q, C, d, R):
    """Mean and covariance of x_0..x_{T-1} for z_{-1} ~ N(m0, S0), z_t = z_{t-1} A_t + N(b_t, Q_t),
    x_t = z_t C_t + N(d_t, R_t) (row vectors; per-step arrays of length T), by writing every
    z_t as a linear map of the stacked noises."""
    T, H = len(A), m0.shape[0]
    K = (T + 1) * H
    Z = np.zeros((H, K))
    Z[:, :H] = np.eye(H)
    mz = m0.copy()
    rows, mean = [], []
    for t in range(T):
        E = np.zeros((H, K))
        E[:, H * (t + 1) : H * (t + 2)] = np.eye(H)
        Z = A[t].T @ Z + E
        mz = mz @ A[t] + b[t]
        rows.append(C[t].T @ Z)
        mean.append(mz @ C[t] + d[t])
    W = np.concatenate(rows, 0)
    return np.concatenate(mean), W @ block_diag(S0, *Q) @ W.T + block_diag(*R)


def numpy_leave_one_out(S, r):
    """log p(x_j | x_-j) of N(mu, S) for residuals r = x - mu, (n, D) or (D,): Rasmussen &
    Williams (2006) eqs. 5.10-5.12 by numpy's inverse."""
    Ki = np.linalg.inv(S)
    var = 1 / np.diag(Ki)
    d = (r @ Ki) * var  # x_j - mu_{j|-j}
    return -0.5 * (np.log(2 * np.pi * var) + d**2 / var)


def numpy_conditionals(mean, cov, x, mask):
    """log p(x_j | x_context) of x ~ N(mean, cov) for every target j of every (mask, datapoint):
    ``mask`` (q, n, D) bool, True at the targets, ``x`` (n, D); by conditioning in numpy, a
    solve per target. Returns (q, n, D), zero outside the targets."""
    q, n, D = mask.shape
    out = np.zeros((q, n, D))
    for a in range(q):
        for i in range(n):
            ctx = ~mask[a, i]
            for j in np.flatnonzero(mask[a, i]):
                if ctx.any():
                    gain = np.linalg.solve(cov[np.ix_(ctx, ctx)], cov[ctx, j])
                    m = mean[j] + gain @ (x[i, ctx] - mean[ctx])
                    v = cov[j, j] - gain @ cov[ctx, j]
                else:
                    m, v = mean[j], cov[j, j]
                out[a, i, j] = norm.logpdf(x[i, j], m, np.sqrt(v))
    return out


def outlying_poisson_counts(D=12, n=4, seed=0):
    """Poisson tokens with a 2-D standard normal latent, ``x_d ~ Poisson(exp(W_d z))`` with
    ``W = 0.7 randn(D, 2)``, and ``n`` datapoints drawn from it whose token 0 is set to an
    outlying count of 7 (a leave-one-out conditional far from the full posterior's grid).
    Returns the model, the data ``(n, D)`` and ``W``."""
    g = torch.Generator().manual_seed(seed)
    W = 0.7 * torch.randn(D, 2, generator=g, dtype=torch.float64)
    x = torch.poisson(torch.exp(torch.randn(n, 2, generator=g, dtype=torch.float64) @ W.T), generator=g)
    x[:, 0] = 7.0

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Poisson(torch.exp(z @ W.T)).to_event(1), obs=x)

    return model, x, W


def saved_numel(fn):
    """Elements of the tensors autograd saves for backward while ``fn()`` runs (each time it
    saves one, views included), and ``fn()``'s result."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved[0], out
