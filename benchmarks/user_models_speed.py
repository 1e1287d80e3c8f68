#!/usr/bin/env python
r"""Models written the way Pyro users write them, timed against what the user would compare with.

Each row is **loss + gradient** (``differentiable_loss`` and ``torch.autograd.grad``
into the model's parameters), float32 unless said, one thread (the machine is shared:
several OpenMP threads wait on each other), median of ``--repeats`` after a warm-up,
interleaved with its reference by :func:`harness.run_interleaved` so that the load
hits both alike. The ratio is measured in this run.

1. ``pll`` -- ``MaskedPretrainingLoss(masks="pll")`` (every leave-one-out query)
   against ``Evidence(model)`` with its gradient, the exact log-density of the same
   model: one factorization serves both, so the goal is a small constant ratio. On
   Pyro's varying-intercept (radon) regression and a Bayesian linear regression
   scored as one datapoint (``token_plates=("data",)``), a GP written with a
   ``MultivariateNormal`` observation, ``GPRegression`` with three outputs, and a
   linear-Gaussian hierarchy (``conditionals="hierarchical"``), and factor analysis
   with a noise scale per datapoint (a covariance per datapoint), PPCA on 4 datapoints
   of many tokens, and a logistic factor model with one latent under
   ``conditionals="quadrature"``. Before the
   leave-one-out paths each query factored its own context: 100--350 times the
   evidence.
2. ``missing`` -- PPCA with 10 % of the tokens missing (``dist.Normal(...).mask(m)``),
   ``masks="all"`` with masks per datapoint, against the same loss without missing
   tokens: missing tokens hide themselves in the independent sums rather than
   taking the per-(mask, datapoint) conditionals (6.6x before, at D = 200).
3. ``memory`` -- ``masks="all"`` on one datapoint of many tokens (the radon model):
   the step peak resident memory (:class:`harness.PeakRSS`, the first step: a
   warm-up's freed memory would hide it). What the backward pass keeps is bounded by
   ``chunk_size`` (``2**22`` elements a group), the forward pass's transient tables by
   the engine's ``max_elements`` (``2**24``); before, every mask's factors were kept
   for the backward pass (peak RSS 2.9 GB at 1000 houses, now 0.47 GB).
4. ``order`` -- ``masks="order"`` against ``Evidence`` with its gradient on the
   linear-Gaussian hierarchies (every ordering of one Gaussian joint telescopes to the
   evidence; the hierarchical engine took each ordering's suffix sums: 287 ms against
   11 ms at 200 units of 20 tokens).
5. ``recompute`` -- ``masks="all"`` on one datapoint of many tokens (Bayesian linear
   regression, 2000 observations) with the default ``chunk_size`` (groups recomputed in
   the backward pass, peak memory bounded) against ``chunk_size=2**30`` (nothing
   recomputed, every mask's factors kept): the price of the memory bound.
6. ``gaussian_hmm`` -- an observed ``dist.GaussianHMM`` (H = 2, one element a step, 256
   steps), ``masks="all"`` with masks per datapoint, ``conditionals="auto"`` against
   ``conditionals="gaussian"`` (the dense covariance): ``"auto"`` took the Kalman engine
   there at about twice the dense engine's time until a cost rule sent such masks to the
   dense covariance below about 470 tokens.
7. ``mixture`` -- a full-covariance Gaussian mixture as in Pyro's GMM tutorial
   (``MultivariateNormal(locs[a], scale_tril=tril[a])``, the assignment enumerated), the
   default loss (one mask per datapoint) against a ``TraceEnum_ELBO`` step: every
   datapoint's context is factored once per component. The pairs are sorted by context
   size and each chunk factors its largest context, no longer every context embedded in a
   ``D x D`` matrix (at D = 50, K = 4, N = 1000: 350 -> 220 ms, 53x -> 32x ``TraceEnum_ELBO``),
   and the mixture's log-sum-exps clamp the terms below float32's exp underflow, where
   torch's exp is 40-100x slower (220 -> 163 ms, 23x; ``masks="all"`` with shared masks
   1.10 -> 0.59 s), and the chunks' factors are kept for the backward pass up to the
   table's ``max_elements`` instead of recomputed (163 -> 129 ms, 19x), and the pairs with
   fewer targets than context tokens factor their targets' block of each component's
   precision instead of their context's block of its covariance (111 -> 67 ms, 11x), and
   from the second step on the loss's sampled trace runs without Pyro's validation, whose
   check of ``tril[a]`` at ``(N, D, D)`` the enumeration makes again per component
   (73.7 -> 65.1 ms, 9.9x). A mixture of PPCA
   (low-rank components, K = 4, R = 3, D = 50) with ``masks="all"`` and shared masks:
   714 -> 372 ms once its loading's products with the data were one matrix product
   instead of a batch of ``(1, D) @ (D, R)`` ones.
8. ``dense`` -- a full-covariance ``MultivariateNormal`` observation with a learned
   ``scale_tril`` (its mean a param, or a latent per datapoint), the default loss (one mask
   per datapoint) against ``Evidence`` with its gradient: the pairs with fewer targets than
   context tokens factor their targets' block of the precision (``routed_dense_sums``), the
   first block keeps its costliest chunks for the backward pass, and the latent mean's trace
   runs without Pyro's validation after the first step (its ``scale_tril``, held expanded to
   ``(N, D, D)``, is checked at its own shape: ``arg_checks``). One thread, N = 1000, D = 200,
   A/B in alternating processes: 490 -> 190 ms (param mean), 686 -> about 210 ms (latent).
9. ``hmm`` -- an observed ``dist.DiscreteHMM`` (S = 4 states, Normal emissions, 50 steps,
   200 sequences), ``masks="all"`` (50 masks) against ``DiscreteHMM.log_prob`` with its
   gradient: the forward messages of many masks run step by step (S^2 work a step, not the
   blocks' S^3), and the steps are unbound once instead of indexed (each index's backward
   made a zero gradient of the whole table): 4.2 -> 1.0 s, 220x -> 55x (about 1.1x a mask).
10. ``bernoulli`` -- a mixture of K = 10 Bernoulli products over D = 784 binary pixels (the
    assignment enumerated), as a user fits binarized digits: the default loss, ``masks="pll"``
    and ``masks="all"`` with masks per datapoint (D = 50: D queries a datapoint) against a
    ``TraceEnum_ELBO`` step, and the
    peak RSS of the ``"all"`` loss over its first step and after three more (fresh process
    state: :func:`harness.max_rss_mb`). Before: ``"pll"`` took one pass over the whole
    ``(K, n, D)`` table per block of ``chunk_size / (n D)`` queries (147 passes a step at
    D = 784, killed at 15 GB); every block recomputed in the backward pass leaked its saved
    tensors (a reference cycle through the recomputed graph: the peak grew with every step);
    the numerators' log-sum-exps kept two floats per query, point, datapoint and token.

Usage::

    python benchmarks/user_models_speed.py            # all ten (a few minutes)
    python benchmarks/user_models_speed.py --quick    # smaller sizes (< 1 min)
    python benchmarks/user_models_speed.py pll
"""

import argparse
import os
import subprocess
import sys
import time
import warnings

import torch

import pyro
import pyro.distributions as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import PeakRSS, Timing, fmt_ratio, machine_line, run_interleaved  # noqa: E402

from pyro_mpt import Evidence, MaskedPretrainingLoss  # noqa: E402


def grad_step(value):
    """The gradient of ``value`` into every param of the store; returns ``float(value)``."""
    leaves = [p.unconstrained() for p in pyro.get_param_store().values()]
    torch.autograd.grad(value, leaves, allow_unused=True)
    return float(value)


def step(loss, model, args):
    """One loss + gradient into every param of the store."""
    return grad_step(loss.differentiable_loss(model, None, *args))


def evidence_step(evidence, args):
    return grad_step(evidence(*args).sum())


def random_intercepts(N, G, seed=0, global_mean=False):
    """Random intercepts of G groups (ragged sizes, N / G on average), the N observations
    one datapoint. Without ``global_mean`` the loading's nonzeros split into G groups; with
    it (a mean shared by the groups, as Pyro's radon model) they form one."""
    g = torch.Generator().manual_seed(seed)
    grp, u = torch.randint(0, G, (N,), generator=g), torch.randn(N, generator=g)
    y = torch.randn(G, generator=g)[grp] + 0.5 * u + 0.7 * torch.randn(N, generator=g)

    def model(grp, u, y):
        b = pyro.param("b", torch.tensor(0.0))
        sa = pyro.param("sa", torch.tensor(1.0), constraint=dist.constraints.positive)
        sy = pyro.param("sy", torch.tensor(1.0), constraint=dist.constraints.positive)
        mu_a = pyro.sample("mu_a", dist.Normal(0.0, 10.0)) if global_mean else 0.0
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(mu_a, sa))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(a[..., grp] + b * u, sy), obs=y)

    return model, (grp, u, y), dict(token_plates=("data",))


def radon(N, G=85, seed=0):
    """Pyro's radon regression: county intercepts around a global mean."""
    return random_intercepts(N, G, seed, global_mean=True)


def regression(N, P=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, P, generator=g)
    y = X @ torch.randn(P, generator=g) + 0.5 * torch.randn(N, generator=g)

    def model(X, y):
        sigma = pyro.param("sigma", torch.tensor(1.0), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([P]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 10.0))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal((X * w).sum(-1) + b, sigma), obs=y)

    return model, (X, y), dict(token_plates=("data",))


def gp(N, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.linspace(0, 10, N)
    y = torch.sin(X) + 0.1 * torch.randn(N, generator=g)

    def model(X, y):
        ls = pyro.param("ls", torch.tensor(1.0), constraint=dist.constraints.positive)
        K = torch.exp(-0.5 * (X[:, None] - X[None]) ** 2 / ls**2) + 0.01 * torch.eye(N)
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(N), covariance_matrix=K), obs=y)

    return model, (X, y), {}


def multi_output_gp(N, B=3, seed=0):
    import pyro.contrib.gp as pgp

    g = torch.Generator().manual_seed(seed)
    X = torch.linspace(0, 5, N)
    y = torch.sin(X) + 0.1 * torch.randn(B, N, generator=g)
    gpr = pgp.models.GPRegression(X, y, pgp.kernels.RBF(1), noise=torch.tensor(0.1))

    def model():
        return gpr.model()

    return model, (), {}


def hierarchy(units, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    A, W0 = torch.randn(2, 2, generator=g), torch.randn(D, 2, generator=g)
    x = torch.randn(units, D, generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", units):
            z = pyro.sample("z", dist.Normal(mu @ A.T, 0.8).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)

    return model, (x,), dict(token_plates=("data",), conditionals="hierarchical")


def global_mean_ppca(units, D=20, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g) * 0.3
    x = torch.randn(units, D, generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        mu = pyro.sample("mu", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", units):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, 0.5).to_event(1), obs=x)

    return model, (x,), dict(token_plates=("data",))


def heteroscedastic_fa(N, D=50, K=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g) * 0.3
    u = torch.randn(N, generator=g)
    x = torch.randn(N, K, generator=g) @ W0.T + 0.5 * torch.randn(N, D, generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        a = pyro.param("a", torch.tensor(0.3))
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, (a * u).exp().unsqueeze(-1)).to_event(1), obs=x)

    return model, (x,), {}


def wide_ppca(D, N=4, K=5, seed=0):
    """PPCA on a few datapoints of many tokens (``"pll"``: D queries of one target each)."""
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g) * 0.3
    x = torch.randn(N, K, generator=g) @ W0.T + 0.5 * torch.randn(N, D, generator=g)

    def model(x):
        W = pyro.param("W", W0.clone())
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).to_event(1), obs=x)

    return model, (x,), {}


def logistic_factor(D, N=100, seed=0):
    """Bernoulli tokens with one Normal latent per datapoint (``conditionals="quadrature"``)."""
    g = torch.Generator().manual_seed(seed)
    a0, b0 = torch.randn(D, generator=g), torch.randn(D, generator=g)
    x = torch.bernoulli(torch.sigmoid(torch.randn(N, 1, generator=g) * a0 + b0), generator=g)

    def model(x):
        a, b = pyro.param("a", a0.clone()), pyro.param("b", b0.clone())
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=z * a + b).to_event(1), obs=x)

    return model, (x,), dict(conditionals="quadrature")


def ppca_missing(N, D, K, missing, seed=0):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g) * 0.3
    x = torch.randn(N, K, generator=g) @ W0.T + 0.5 * torch.randn(N, D, generator=g)
    observed = torch.rand(N, D, generator=g) >= missing

    def model(x):
        W = pyro.param("W", W0.clone())
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        with pyro.plate("data", N):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T, s).mask(observed).to_event(1), obs=x)

    return model, (x,), {}


def gaussian_hmm(N, T, seed=0):
    H = 2
    x = 0.1 * torch.randn(N, T, 1, generator=torch.Generator().manual_seed(seed)).cumsum(1)

    def model(x):
        A = pyro.param("A", torch.tensor([[0.9, 0.1], [-0.1, 0.9]]))
        C = pyro.param("C", torch.ones(H, 1))
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        init = dist.MultivariateNormal(torch.zeros(H), torch.eye(H))
        trans = dist.MultivariateNormal(torch.zeros(H), 0.1 * torch.eye(H))
        with pyro.plate("sequences", N):
            pyro.sample("x", dist.GaussianHMM(init, A, trans, C, dist.Normal(torch.zeros(1), s).to_event(1)), obs=x)

    return model, (x,), {}


def full_covariance_gmm(N, D, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.softmax(torch.randn(K, generator=g), 0)
    locs0 = 3 * torch.randn(K, D, generator=g)
    A = 0.3 * torch.randn(K, D, D, generator=g)
    tril0 = torch.linalg.cholesky(A @ A.mT + torch.eye(D))
    z = torch.multinomial(w0, N, replacement=True, generator=g)
    x = locs0[z] + (tril0[z] @ torch.randn(N, D, 1, generator=g)).squeeze(-1)

    @pyro.infer.config_enumerate
    def model(x):
        weights = pyro.param("weights", w0.clone(), constraint=dist.constraints.simplex)
        locs = pyro.param("locs", locs0.clone())
        tril = pyro.param("tril", tril0.clone(), constraint=dist.constraints.lower_cholesky)
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Categorical(weights))
            pyro.sample("obs", dist.MultivariateNormal(locs[a], scale_tril=tril[a]), obs=x)

    return model, (x,), {}


def full_covariance_mvn(N, D, latent_mean=False, seed=0):
    """A ``MultivariateNormal`` observation with a learned ``scale_tril``, its mean a param
    or a latent per datapoint (``MultivariateNormal(z, scale_tril=L)``, ``z`` standard normal)."""
    g = torch.Generator().manual_seed(seed)
    A = 0.3 * torch.randn(D, D, generator=g)
    L0 = torch.linalg.cholesky(A @ A.T + torch.eye(D))
    x = torch.randn(N, D, generator=g) @ L0.T + 1.0

    def model(x):
        L = pyro.param("L", L0.clone(), constraint=dist.constraints.lower_cholesky)
        with pyro.plate("data", x.shape[0]):
            if latent_mean:
                loc = pyro.sample("z", dist.Normal(torch.zeros(D), 1.0).to_event(1))
            else:
                loc = pyro.param("loc", torch.zeros(D))
            pyro.sample("x", dist.MultivariateNormal(loc, scale_tril=L), obs=x)

    return model, (x,), {}


def discrete_hmm(N, T, S=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    locs0 = 3.0 * torch.arange(S).float()
    x = locs0[torch.randint(0, S, (N, T), generator=g)] + 0.5 * torch.randn(N, T, generator=g)

    def parts():
        init = pyro.param("init", torch.ones(S) / S, constraint=dist.constraints.simplex)
        trans = pyro.param("trans", torch.eye(S) * 0.8 + 0.2 / S, constraint=dist.constraints.simplex)
        locs = pyro.param("locs", locs0.clone())
        scale = pyro.param("scale", torch.tensor(0.5), constraint=dist.constraints.positive)
        return dist.DiscreteHMM(init.log(), trans.log(), dist.Normal(locs, scale))

    def model(x):
        with pyro.plate("sequences", N):
            pyro.sample("x", parts(), obs=x)

    return model, (x,), parts


def bernoulli_mixture(N, D, K=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = 0.1 + 0.8 * torch.rand(K, D, generator=g)
    x = torch.bernoulli(p0[torch.randint(0, K, (N,), generator=g)], generator=g)

    @pyro.infer.config_enumerate
    def model(x):
        weights = pyro.param("weights", torch.full((K,), 1.0 / K), constraint=dist.constraints.simplex)
        probs = pyro.param("probs", p0.clone(), constraint=dist.constraints.unit_interval)
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Categorical(weights))
            pyro.sample("x", dist.Bernoulli(probs[a]).to_event(1), obs=x)

    return model, (x,), {}


def timed_pair(a, b, repeats):
    """Median seconds of ``a`` and ``b`` (no arguments), interleaved."""
    (ta, _), (tb, _) = run_interleaved(lambda seed: torch.manual_seed(seed), [lambda _: a(), lambda _: b()], repeats)[0]
    return Timing(ta), Timing(tb)


def pll_rows(quick, repeats):
    cases = [
        ("radon regression, 85 counties", radon, 300 if quick else 1000),
        ("Bayesian linear regression, 10 features", regression, 500 if quick else 2000),
        ("GP, MultivariateNormal observation (float32)", gp, 100 if quick else 300),
        ("GPRegression, 3 outputs", multi_output_gp, 50 if quick else 150),
        ("linear-Gaussian hierarchy, 4 tokens a unit", hierarchy, 100 if quick else 250),
        ("factor analysis, a noise scale per datapoint (N = size, D = 50)", heteroscedastic_fa, 200 if quick else 1000),
        ("PPCA with a global latent mean, 20 tokens a unit", global_mean_ppca, 50 if quick else 200),
        ("PPCA, 4 datapoints of many tokens (K = 5)", wide_ppca, 10000 if quick else 40000),
        ("logistic factor model, one latent (quadrature), N = 100", logistic_factor, 200 if quick else 800),
    ]
    print("\n| model | tokens | `pll` loss + grad | Evidence + grad | pll / Evidence |")
    print("|---|---|---|---|---|")
    for name, build, size in cases:
        pyro.clear_param_store()
        model, args, options = build(size)
        loss = MaskedPretrainingLoss(masks="pll", **options)
        method = "quadrature" if options.get("conditionals") == "quadrature" else "exact"
        evidence = Evidence(model, method=method, **{k: v for k, v in options.items() if k == "token_plates"})
        tokens = size * {multi_output_gp: 3, hierarchy: 4, heteroscedastic_fa: 50, global_mean_ppca: 20, wide_ppca: 4,
                         logistic_factor: 100}.get(build, 1)
        tp, te = timed_pair(lambda: step(loss, model, args), lambda: evidence_step(evidence, args), repeats)
        print(f"| {name} | {tokens} | {tp.cell()} | {te.cell()} | {fmt_ratio(tp.median / te.median)} |", flush=True)


def missing_rows(quick, repeats):
    N, K = 1000, 5
    print("\n| PPCA, masks per datapoint | D | `all` with 10 % missing | without | ratio |")
    print("|---|---|---|---|---|")
    for D in [50] if quick else [50, 200]:
        pyro.clear_param_store()
        model, args, _ = ppca_missing(N, D, K, 0.1)
        full, full_args, _ = ppca_missing(N, D, K, 0.0)
        loss = MaskedPretrainingLoss(masks="all")
        tm, tf = timed_pair(lambda: step(loss, model, args), lambda: step(loss, full, full_args), repeats)
        print(f"| N={N}, K={K} | {D} | {tm.cell()} | {tf.cell()} | {fmt_ratio(tm.median / tf.median)} |", flush=True)


def order_rows(quick, repeats):
    cases = [
        ("linear-Gaussian hierarchy, 4 tokens a unit", hierarchy, 100 if quick else 250),
        ("PPCA with a global latent mean, 20 tokens a unit", global_mean_ppca, 50 if quick else 200),
    ]
    print("\n| model | units | `order` loss + grad | Evidence + grad | order / Evidence |")
    print("|---|---|---|---|---|")
    for name, build, size in cases:
        pyro.clear_param_store()
        model, args, options = build(size)
        loss = MaskedPretrainingLoss(masks="order", **options)
        evidence = Evidence(model, token_plates=options["token_plates"])
        to, te = timed_pair(lambda: step(loss, model, args), lambda: evidence_step(evidence, args), repeats)
        print(f"| {name} | {size} | {to.cell()} | {te.cell()} | {fmt_ratio(to.median / te.median)} |", flush=True)


def recompute_rows(quick, repeats):
    N = 500 if quick else 2000
    pyro.clear_param_store()
    model, args, options = regression(N)
    bounded = MaskedPretrainingLoss(masks="all", **options)
    kept = MaskedPretrainingLoss(masks="all", chunk_size=2**30, **options)
    tb, tk = timed_pair(lambda: step(bounded, model, args), lambda: step(kept, model, args), repeats)
    print("\n| Bayesian linear regression, one datapoint | observations | `all`, groups recomputed | nothing recomputed | ratio |")
    print("|---|---|---|---|---|")
    print(f"| 10 features | {N} | {tb.cell()} | {tk.cell()} | {fmt_ratio(tb.median / tk.median)} |", flush=True)


def groups_rows(quick, repeats):
    """Random intercepts scored as one datapoint, without and with a global mean (Pyro's
    radon model): the Gaussian engine's groups (``gaussian_groups``; with the mean,
    ``gaussian_global_groups``) against the dense loading (``groups=False``), interleaved, after
    one untimed step of each (the first call of the groups finds them from the whole
    loading and checks its dropped zeros: its own column); the dense loading only up to
    1000 groups (at 4000 its 40000 x 4000 table and O(D G^2) steps take minutes)."""
    from pyro_mpt.conditionals import GaussianConditionals

    print("\n| random intercepts, 10 observations a group | groups | loss | groups s | first call s | dense loading s "
          "| dense / groups |")
    print("|---|---|---|---|---|---|---|")
    for global_mean, G in [(g, G) for g in (False, True) for G in ([100, 250] if quick else [250, 1000, 4000])]:
        pyro.clear_param_store()
        model, args, options = random_intercepts(10 * G, G, global_mean=global_mean)
        label = "with a global mean (radon)" if global_mean else ""
        for masks in ["order", "pll", "uniform"]:
            grouped = MaskedPretrainingLoss(masks=masks, conditionals=GaussianConditionals(), **options)
            start = time.perf_counter()
            step(grouped, model, args)
            first = time.perf_counter() - start
            if G > 1000:
                tg, _ = timed_pair(lambda: step(grouped, model, args), lambda: 0.0, repeats)
                print(f"| {label} | {G} | `{masks}` | {tg.cell()} | {first:.3g} | -- | -- |", flush=True)
                continue
            dense = MaskedPretrainingLoss(masks=masks, conditionals=GaussianConditionals(groups=False), **options)
            step(dense, model, args)
            tg, td = timed_pair(lambda: step(grouped, model, args), lambda: step(dense, model, args), repeats)
            print(f"| {label} | {G} | `{masks}` | {tg.cell()} | {first:.3g} | {td.cell()} | {fmt_ratio(td.median / tg.median)} |",
                  flush=True)


def gaussian_hmm_rows(quick, repeats):
    N, T = (2, 256) if quick else (4, 256)
    print("\n| GaussianHMM, H = 2, masks per datapoint | T | `all`, auto | `all`, gaussian (dense) | auto / dense |")
    print("|---|---|---|---|---|")
    pyro.clear_param_store()
    model, args, _ = gaussian_hmm(N, T)
    auto, dense = MaskedPretrainingLoss(masks="all"), MaskedPretrainingLoss(masks="all", conditionals="gaussian")
    ta, td = timed_pair(lambda: step(auto, model, args), lambda: step(dense, model, args), repeats)
    print(f"| N={N} | {T} | {ta.cell()} | {td.cell()} | {fmt_ratio(ta.median / td.median)} |", flush=True)


def mixture_rows(quick, repeats):
    N, K = 1000, 4
    print("\n| full-covariance GMM, K = 4 | D | default loss + grad | TraceEnum_ELBO + grad | ratio |")
    print("|---|---|---|---|---|")
    for D in [20] if quick else [20, 50]:
        pyro.clear_param_store()
        model, args, _ = full_covariance_gmm(N, D, K)
        loss, elbo = MaskedPretrainingLoss(), pyro.infer.TraceEnum_ELBO(max_plate_nesting=1)

        def enum_step():
            grad_step(elbo.differentiable_loss(model, lambda x: None, *args))

        tm, te = timed_pair(lambda: step(loss, model, args), enum_step, repeats)
        print(f"| N={N} | {D} | {tm.cell()} | {te.cell()} | {fmt_ratio(tm.median / te.median)} |", flush=True)


def dense_rows(quick, repeats):
    N = 1000
    print("\n| full-covariance MVN, masks per datapoint | D | default loss + grad | Evidence + grad | ratio |")
    print("|---|---|---|---|---|")
    for latent_mean in (False, True):
        for D in [50] if quick else [50, 200]:
            pyro.clear_param_store()
            model, args, _ = full_covariance_mvn(N, D, latent_mean)
            loss, evidence = MaskedPretrainingLoss(), Evidence(model)
            tm, te = timed_pair(lambda: step(loss, model, args), lambda: evidence_step(evidence, args), repeats)
            name = "latent mean, `MultivariateNormal(z, scale_tril=L)`" if latent_mean else "`scale_tril` and mean params"
            print(f"| N={N}, {name} | {D} | {tm.cell()} | {te.cell()} | {fmt_ratio(tm.median / te.median)} |", flush=True)


def hmm_rows(quick, repeats):
    N, T = (50, 50) if quick else (200, 50)
    print("\n| DiscreteHMM, S = 4 | N, T | `all` loss + grad | `log_prob` + grad | ratio |")
    print("|---|---|---|---|---|")
    pyro.clear_param_store()
    model, args, parts = discrete_hmm(N, T)
    loss = MaskedPretrainingLoss(masks="all")

    def own():
        grad_step(parts().log_prob(args[0]).sum())

    step(loss, model, args)
    ta, to = timed_pair(lambda: step(loss, model, args), own, repeats)
    print(f"| sequences | {N}, {T} | {ta.cell()} | {to.cell()} | {fmt_ratio(ta.median / to.median)} |", flush=True)


def bernoulli_rows(quick, repeats):
    K = 10
    print("\n| Bernoulli mixture, K = 10 | N, D | loss + grad | TraceEnum_ELBO + grad | ratio |")
    print("|---|---|---|---|---|")
    elbo = pyro.infer.TraceEnum_ELBO(max_plate_nesting=1)
    # masks='all' asks D queries of every datapoint (D times the default's work): a smaller D
    cases = [
        ("default (one uniform mask per datapoint)", {}, (300, 196) if quick else (1000, 784)),
        ("`pll`", dict(masks="pll"), (300, 196) if quick else (1000, 784)),
        ("`all`, masks per datapoint", dict(masks="all"), (300, 20) if quick else (2000, 50)),
    ]
    for name, options, (N, D) in cases:
        pyro.clear_param_store()
        model, args, _ = bernoulli_mixture(N, D, K)
        loss = MaskedPretrainingLoss(**options)

        def enum_step():
            grad_step(elbo.differentiable_loss(model, lambda x: None, *args))

        tm, te = timed_pair(lambda: step(loss, model, args), enum_step, repeats)
        print(f"| {name} | {N}, {D} | {tm.cell()} | {te.cell()} | {fmt_ratio(tm.median / te.median)} |", flush=True)
    # peak RSS of the 'all' loss in a fresh interpreter: after one step and after four
    N, D = (300, 20) if quick else (2000, 50)
    code = (
        "import sys, torch, pyro; sys.path.insert(0, 'benchmarks'); torch.set_num_threads(1)\n"
        "from user_models_speed import bernoulli_mixture, step\nfrom harness import max_rss_mb\n"
        "from pyro_mpt import MaskedPretrainingLoss\n"
        f"model, args, _ = bernoulli_mixture({N}, {D}, {K})\nloss = MaskedPretrainingLoss(masks='all')\n"
        "peaks = []\nfor _ in range(4):\n    step(loss, model, args)\n    peaks.append(max_rss_mb())\n"
        "print(f'{peaks[0]:.0f} MB after one step, {peaks[-1]:.0f} MB after four')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"\n`all` with masks per datapoint (N = {N}, D = {D}), peak RSS of the whole process: "
          f"{out.stdout.strip() or out.stderr[-300:]}", flush=True)


def memory_rows(quick):
    N = 400 if quick else 1000
    pyro.clear_param_store()
    model, args, options = radon(N)
    loss = MaskedPretrainingLoss(masks="all", **options)
    # no warm-up: the allocator keeps what a first step freed, which would hide the peak
    sampler = PeakRSS()
    sampler.start()
    before = PeakRSS.rss()
    step(loss, model, args)
    peak = sampler.stop() - before
    print(f"\nradon regression, {N} houses (one datapoint), masks='all', float32: step peak "
          f"{peak / 2**20:.0f} MB above the {before / 2**20:.0f} MB before it (kept for the backward "
          f"pass: chunk_size = {loss.chunk_size} elements a group, {loss.chunk_size * 4 / 2**20:.0f} MB)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "parts", nargs="*",
        default=["pll", "missing", "memory", "order", "recompute", "groups", "gaussian_hmm", "mixture", "dense", "hmm",
                 "bernoulli"],
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    print(machine_line())
    if "pll" in a.parts:
        pll_rows(a.quick, a.repeats)
    if "missing" in a.parts:
        missing_rows(a.quick, a.repeats)
    if "memory" in a.parts:
        memory_rows(a.quick)
    if "order" in a.parts:
        order_rows(a.quick, a.repeats)
    if "recompute" in a.parts:
        recompute_rows(a.quick, a.repeats)
    if "groups" in a.parts:
        groups_rows(a.quick, a.repeats)
    if "gaussian_hmm" in a.parts:
        gaussian_hmm_rows(a.quick, a.repeats)
    if "mixture" in a.parts:
        mixture_rows(a.quick, a.repeats)
    if "dense" in a.parts:
        dense_rows(a.quick, a.repeats)
    if "hmm" in a.parts:
        hmm_rows(a.quick, a.repeats)
    if "bernoulli" in a.parts:
        bernoulli_rows(a.quick, a.repeats)


if __name__ == "__main__":
    main()
