"""Devices: every engine, the loss, Evidence, curves and the adapters run where the model and data are.

Two kinds of tests:

* **CUDA** (skipped without a GPU): the same computations with the model's
  parameters and the data on ``cuda``, compared to the CPU results, with
  every output on ``cuda``.
* **Default device set to "meta"** (runs on CPU everywhere): the data and
  parameters stay on the CPU while ``torch.set_default_device("meta")`` is in
  force, so any tensor the library creates without an explicit ``device=``
  (``torch.zeros(n)``, ``torch.arange(D)``, ``torch.as_tensor(array)``, a
  ``randperm`` from a generator, ...) lands on the meta device, which holds no
  data: combining it with the CPU tensors, or reading it, fails loudly, and
  an output built from it ends up on meta. Each case must therefore return
  CPU tensors equal to the ones computed without the meta default (same
  seeds). This catches the "hidden default-device tensor" that would break on
  CUDA (or under ``set_default_device("cuda")``) without a GPU. It does not
  catch tensors moved to the CPU on purpose (``.cpu()``, CPU generators);
  those are reviewed by hand (host-side bookkeeping in the adapters, the
  PSIS diagnostic through numpy) and exercised by the CUDA tests.

The test models pass ``device=`` to their plates and build every constant
from tensors on the data's device, as a model meant to run on a GPU does.
"""

import warnings

import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_mpt import (
    EncodeDecodeConditionals,
    Evidence,
    GaussianConditionals,
    ImportanceConditionals,
    ImportanceWeightedELBO,
    MaskedPretrainingLoss,
    QuadratureConditionals,
)

from models import tiny_bert, tiny_vit_mae

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

D, K, N = 5, 2, 4


pytestmark = pytest.mark.usefixtures("one_thread")


def ppca(device, dtype=torch.float64):
    """PPCA whose parameters (pyro.params) and data live on ``device``; returns model, guide, x."""
    g = torch.Generator().manual_seed(0)
    host = dict(generator=g, dtype=dtype, device="cpu")
    W0, mu0 = torch.randn(D, K, **host), torch.randn(D, **host)
    x = (torch.randn(N, K, **host) @ W0.T + mu0 + 0.5 * torch.randn(N, D, **host)).to(device)
    pyro.clear_param_store()

    def model(x):
        W = pyro.param("W", lambda: W0.to(device))
        mu = pyro.param("mu", lambda: mu0.to(device))
        s = pyro.param("s", lambda: torch.tensor(0.5, dtype=dtype, device=device), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0], device=x.device):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=dtype, device=x.device), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    def guide(x):
        """The exact posterior."""
        W, mu, s = pyro.param("W"), pyro.param("mu"), pyro.param("s")
        cov = torch.linalg.inv(torch.eye(K, dtype=dtype, device=x.device) + W.T @ W / s**2)
        loc = ((x - mu) @ W / s**2) @ cov
        with pyro.plate("data", x.shape[0], device=x.device):
            pyro.sample("z", dist.MultivariateNormal(loc, covariance_matrix=cov))

    model(x)
    return model, guide, x


def _score(engine, masks="uniform", guide=False, **kw):
    def run(model, g, x):
        return MaskedPretrainingLoss(conditionals=engine(), masks=masks, num_masks=2, **kw).score(model, g if guide else None, x)

    return run


def _svi_step(engine, guide=False):
    def run(model, g, x):
        svi = SVI(model, g if guide else (lambda x: None), Adam({"lr": 0.01}), MaskedPretrainingLoss(conditionals=engine()))
        svi.step(x)
        return torch.cat([pyro.param(k).detach().reshape(-1) for k in ("W", "mu", "s")])

    return run


def _evidence(method, guide=False, **options):
    def run(model, g, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Evidence(model, g if guide else None, method=method, **options)(x)

    return run


def _curve(engine, guide=False, masks="all"):
    def run(model, g, x):
        curve = MaskedPretrainingLoss(conditionals=engine(), masks=masks).curve(model, g if guide else None, x)
        return torch.as_tensor(curve.score, device="cpu")

    return run


def _iwae(model, g, x):
    return torch.tensor(ImportanceWeightedELBO(4).loss(model, g, x), device="cpu")


CASES = {
    "gaussian-lowrank": _score(lambda: GaussianConditionals(method="lowrank")),
    "gaussian-lowrank-shared": _score(lambda: GaussianConditionals(method="lowrank"), share_masks=True),
    "gaussian-dense": _score(lambda: GaussianConditionals(method="dense")),
    "gaussian-order": _score(GaussianConditionals, masks="order"),
    "gaussian-exhaustive": _score(GaussianConditionals, masks="exhaustive"),
    "gaussian-stratified": _score(GaussianConditionals, masks="stratified"),
    "gaussian-rate": _score(GaussianConditionals, masks=0.4),
    "quadrature-adaptive": _score(QuadratureConditionals),
    "quadrature-prior": _score(lambda: QuadratureConditionals(adaptive=False)),
    "quadrature-order": _score(QuadratureConditionals, masks="order"),
    "encode_decode": _score(lambda: EncodeDecodeConditionals(4, 2), guide=True),
    "importance-prior": _score(lambda: ImportanceConditionals(32, proposal="prior")),
    "importance-prior-order": _score(lambda: ImportanceConditionals(32, proposal="prior"), masks="order"),
    "importance-guide": _score(lambda: ImportanceConditionals(16, proposal="guide"), guide=True),
    "svi-step-gaussian": _svi_step(GaussianConditionals),
    "svi-step-quadrature": _svi_step(QuadratureConditionals),
    "svi-step-importance": _svi_step(lambda: ImportanceConditionals(16, proposal="guide"), guide=True),
    "evidence-exact": _evidence("exact"),
    "evidence-quadrature": _evidence("quadrature"),
    "evidence-importance": _evidence("importance", guide=True, num_samples=20),
    "curve-gaussian": _curve(GaussianConditionals),
    "curve-gaussian-exhaustive": _curve(GaussianConditionals, masks="exhaustive"),
    "curve-encode_decode": _curve(lambda: EncodeDecodeConditionals(4, 1), guide=True),
    "iwae": _iwae,
}


def _run(case, device):
    pyro.set_rng_seed(0)
    model, guide, x = ppca(device)
    return CASES[case](model, guide, x)


@pytest.mark.parametrize("case", list(CASES))
def test_no_tensor_is_created_on_the_default_device(case):
    """With the default device set to "meta", results are CPU tensors equal to the plain run's."""
    expected = _run(case, "cpu")
    torch.set_default_device("meta")
    try:
        got = _run(case, "cpu")
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu"
    assert torch.equal(got, expected), (got, expected)


# ---------------------------------------------------------------------- CUDA
# deterministic given the data: masks that do not depend on the random stream,
# or estimates that are exact whatever the draws (the exact posterior as proposal)
CUDA_EXACT = [
    "gaussian-order", "gaussian-exhaustive", "quadrature-order", "evidence-exact", "evidence-quadrature",
    "evidence-importance", "curve-gaussian-exhaustive",
]


@cuda_only
@pytest.mark.parametrize("case", CUDA_EXACT)
def test_cuda_matches_cpu(case):
    cpu = _run(case, "cpu")
    got = _run(case, "cuda")
    assert got.device.type == ("cpu" if case.startswith("curve") else "cuda")
    assert torch.allclose(got.cpu(), cpu, atol=1e-6, rtol=1e-9), (case, got, cpu)


@cuda_only
@pytest.mark.parametrize("case", sorted(set(CASES) - set(CUDA_EXACT)))
def test_cuda_runs_every_engine_on_the_gpu(case):
    """Random masks and draws differ between the CPU and CUDA streams: check the
    device, finiteness and (for unbiased estimates of log p(x)) the size of the values."""
    got = _run(case, "cuda")
    if case.startswith("svi-step"):
        assert all(pyro.param(k).device.type == "cuda" for k in ("W", "mu", "s"))
    else:
        assert got.device.type == ("cpu" if case in ("iwae",) or case.startswith("curve") else "cuda")
    assert bool(torch.isfinite(got).all())
    if case.startswith(("gaussian", "quadrature", "importance")):
        exact = _run("evidence-exact", "cpu")
        assert float((got.cpu() - exact).abs().max()) < 10.0  # same order as log p(x_i) (about -8 here)


@cuda_only
def test_cuda_sampling_engines_are_exact_with_the_exact_posterior():
    model, guide, x = ppca("cuda")
    exact = Evidence(model, method="exact")(x)
    from pyro_mpt.sites import trace_tokens

    tokens = trace_tokens(model, guide, (x,), {})
    for engine in (EncodeDecodeConditionals(8, 1), ImportanceConditionals(8, proposal="guide", impute=False)):
        state = engine.prepare(tokens, model, guide, (x,), {})
        value = engine.log_evidence(state, x)
        assert value.device.type == "cuda"
        assert torch.allclose(value, exact, atol=1e-8, rtol=0)


# ---------------------------------------------------------------------- adapters
TEXTS = ["a b c d e", "f g", "h i j a"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_bert(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def mae():
    pytest.importorskip("transformers")
    return tiny_vit_mae()


IMAGES = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _adapter_results(bert, mae, device):
    """Curve scores, schedule scores and PLLs of the masked LM, and MAE curves, as CPU float64 tensors."""
    from pyro_mpt.adapters import MAEScorer, MaskedLMScorer

    model, tok = bert
    out = {}
    for head in ("auto", "full"):
        scorer = MaskedLMScorer(model, tok, head=head, device=device)
        out[f"curve-{head}"] = torch.as_tensor(scorer.curve(TEXTS, rates=[0.3, 0.6, 0.9], num_masks=2).per_item, device="cpu")
        out[f"order-{head}"] = scorer.score(TEXTS, masks="order", num_masks=2)
        out[f"uniform-{head}"] = scorer.score(TEXTS, masks="uniform", num_masks=2)
        out[f"pll-{head}"] = scorer.pll(TEXTS)
    curves = MAEScorer(mae, device=device).curves(IMAGES, rates=[0.25, 0.5, 0.75], num_masks=2)
    out["mae-mse"] = torch.as_tensor(curves["mse"].per_item, device="cpu")
    out["mae-log-density"] = torch.as_tensor(curves["log_density"].per_item, device="cpu")
    for k, v in out.items():
        assert v.device.type == "cpu" and v.dtype == torch.float64, k
    return out


def test_adapters_create_no_tensor_on_the_default_device(bert, mae):
    """The adapters pack their batches on the host with explicit devices: under a
    "meta" default device they give the same numbers."""
    expected = _adapter_results(bert, mae, "cpu")
    torch.set_default_device("meta")
    try:
        got = _adapter_results(bert, mae, "cpu")
    finally:
        torch.set_default_device(None)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@cuda_only
def test_adapters_on_cuda_match_cpu(bert, mae):
    """Masks come from per-item CPU generators, so CUDA and CPU score the same masked copies."""
    cpu = _adapter_results(bert, mae, "cpu")
    gpu = _adapter_results(bert, mae, "cuda")
    for key in cpu:
        assert torch.allclose(gpu[key], cpu[key], atol=1e-4, rtol=1e-4), key
    assert next(bert[0].parameters()).device.type == "cuda"  # place_model moved it
    bert[0].cpu()
    mae.cpu()
