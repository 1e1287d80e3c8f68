"""The Python snippets of README.md, docs/quickstart.rst and docs/quadrature.md, run as a
user copies them into a fresh script, and the numbers their comments promise checked
against numpy / scipy references written here.

The README's training loop runs 30 steps instead of 1000 (the one edit, asserted to
match the text); everything else is the documented code, verbatim.
"""

import re

import matplotlib
import numpy as np
import pyro
import pytest
import torch
from scipy.stats import multivariate_normal

from models import ROOT

matplotlib.use("Agg")


def python_blocks(path):
    """The Python code blocks of a Markdown (```python) or reStructuredText
    (``.. code-block:: python``) file, in order, dedented."""
    text = (ROOT / path).read_text(encoding="utf-8")
    if path.endswith(".md"):
        return re.findall(r"```python\n(.*?)```", text, re.S)
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text)
    return ["\n".join(line[3:] for line in b.splitlines()) + "\n" for b in blocks]


def _run(code, namespace):
    pyro.clear_param_store()
    exec(compile(code, "<snippet>", "exec"), namespace)
    return namespace


def _exact_ppca_lml(ns):
    """Per-datapoint log N(x_i; 0, W W^T + sigma^2 I) in float64 with scipy, at the trained W."""
    W = pyro.param("W").detach().double().numpy()
    C = W @ W.T + ns["sigma"] ** 2 * np.eye(ns["D"])
    return multivariate_normal(np.zeros(ns["D"]), C).logpdf(ns["x"].double().numpy())


def test_readme_quickstart_runs_and_quickstart_page_repeats_it():
    import matplotlib.pyplot as plt

    readme = python_blocks("README.md")[0]
    page = python_blocks("docs/quickstart.rst")
    assert page[0].strip() == readme.strip(), "docs/quickstart.rst and README.md show different quickstarts"
    loop = "for step in range(1000):"
    assert loop in readme
    pyro.set_rng_seed(0)
    plt.close("all")
    ns = _run(readme.replace(loop, "for step in range(30):"), {})
    # the last line drew the curve: one line per mask size
    line = plt.gca().get_lines()[0]
    assert len(line.get_xdata()) == ns["D"]
    plt.close("all")
    exact = _exact_ppca_lml(ns)
    evidence = ns["Evidence"](ns["ppca"], method="exact")(ns["x"]).detach().double().numpy()
    # float32 data and parameters: agreement to float32 rounding of values of magnitude ~20
    np.testing.assert_allclose(evidence, exact, rtol=1e-5, atol=1e-4)

    # "Next steps" on the trained model, with the comments' claims
    ns.update(curve=None)
    pyro.set_rng_seed(1)
    code = page[1]
    exec(compile(code, "<snippet>", "exec"), ns)
    loss_cls = ns["MaskedPretrainingLoss"]
    order = loss_cls(masks="order").score(ns["ppca"], None, ns["x"]).detach().double().numpy()
    np.testing.assert_allclose(order, exact, rtol=1e-5, atol=1e-4)  # "exact here: the chain rule"
    curve = ns["curve"]
    # "≈ Evidence(ppca)(x).mean()": the "all" curve's area, 10 masks a size, within 4 standard errors
    assert abs(curve.area() - exact.mean()) < 4 * curve.area_stderr()
    for code in page[2:]:
        exec(compile(code, "<snippet>", "exec"), ns)


def test_quadrature_page_snippet_runs_and_its_evidence_matches_a_grid_integral():
    pytest.importorskip("sklearn")
    (code,) = python_blocks("docs/quadrature.md")
    pyro.set_rng_seed(0)
    ns = _run(code, {})
    x, W, b = ns["x"][:5].double().numpy(), pyro.param("W").detach().double().numpy(), pyro.param("b").detach().double().numpy()
    estimate = ns["Evidence"](ns["linear_vae"], method="quadrature").estimate(ns["x"][:5])
    # log p(x_i) = log ∫ N(z; 0, I) Π_d Bernoulli(x_id; σ(w_d·z + b_d)) dz on a 401 x 401 grid over [-8, 8]^2
    g = np.linspace(-8, 8, 401)
    z = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    logits = z @ W.T + b  # (G, D)
    loglik = x @ (-np.logaddexp(0, -logits)).T + (1 - x) @ (-np.logaddexp(0, logits)).T  # (5, G)
    log_prior = -0.5 * (z**2).sum(-1) - np.log(2 * np.pi)
    cell = (g[1] - g[0]) ** 2
    a = loglik + log_prior
    reference = a.max(1) + np.log(np.exp(a - a.max(1, keepdims=True)).sum(1) * cell)
    np.testing.assert_allclose(estimate.log_evidence.detach().double().numpy(), reference, rtol=0, atol=1e-4)


def test_theory_page_fixed_rate_bias_snippet_equals_brute_force():
    """docs/theory.rst's bias of a fixed rate, run on a PPCA of 8 tokens, against numpy: every
    mask of the fixed size enumerated, Gaussian conditionals by solving the covariance."""
    from itertools import combinations

    from scipy.stats import norm

    (code,) = [b for b in python_blocks("docs/theory.rst") if "FixedRate" in b]
    g = torch.Generator().manual_seed(0)
    N, D, K, sigma = 50, 8, 2, 0.5
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, K, generator=g, dtype=torch.float64) @ W.T + sigma * torch.randn(N, D, generator=g, dtype=torch.float64)

    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", pyro.distributions.Normal(torch.zeros(K, dtype=torch.float64), 1.0).to_event(1))
            pyro.sample("x", pyro.distributions.Normal(z @ W.T, sigma).to_event(1), obs=x)

    ns = _run(code, {"model": model, "x": x, "MaskedPretrainingLoss": __import__("pyro_mpt").MaskedPretrainingLoss})
    C = (W @ W.T).numpy() + sigma**2 * np.eye(D)
    X = x.numpy()
    M = ns["M"]
    assert M == 2  # round(0.2 * 8)
    total, count = 0.0, 0
    for masked in combinations(range(D), M):
        rest = [j for j in range(D) if j not in masked]
        for j in masked:
            coef = np.linalg.solve(C[np.ix_(rest, rest)], C[rest, j])
            total += norm.logpdf(X[:, j], X[:, rest] @ coef, np.sqrt(C[j, j] - C[j, rest] @ coef)).mean()
        count += 1
    lml = multivariate_normal(np.zeros(D), C).logpdf(X).mean()
    assert abs(ns["bias"] - (D * total / count / M - lml)) < 1e-8
