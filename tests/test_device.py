"""Devices: every engine, the loss, Evidence, curves and the adapters run where the model and data are.

Two kinds of tests:

* **CUDA** (skipped without a GPU): the same computations with the model's
  parameters and the data on ``cuda``, every output on ``cuda``. The
  deterministic ones (exact schedules, the exact posterior as proposal, SGD
  steps on the exact ``"order"`` loss) match the CPU to 1e-6; the random ones
  (masks and draws come from the device's stream) are compared in
  distribution: the mean of 64 runs per device (each on 16 copies of the
  data) agrees with the CPU's within 4 standard errors, and with the exact
  value where the estimate is unbiased for one.
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
from pyro.infer import SVI
from pyro.optim import SGD

from pyro_mpt import (
    EncodeDecodeConditionals,
    GaussianConditionals,
    ImportanceConditionals,
    ImportanceWeightedELBO,
    MaskedPretrainingLoss,
    QuadratureConditionals,
)
from pyro_mpt.observed_tokens import trace_tokens

from models import evidence_case, exact_posterior_guide, make_ppca, score_case, tiny_bert, tiny_vit_mae

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

D, K, N = 5, 2, 4


def _svi_step(engine, masks="order", guide=False):
    """One SGD step from the model's start: the loss, then the updated params (a plain
    gradient step, so the params carry the gradient's values, not only its signs)."""

    def run(model, g, x):
        loss = MaskedPretrainingLoss(conditionals=engine(), masks=masks)
        value = SVI(model, g if guide else (lambda x: None), SGD({"lr": 0.01}), loss).step(x)
        params = [pyro.param(k).detach().reshape(-1) for k in ("W", "mu", "s")]
        return torch.cat([torch.tensor([value], dtype=params[0].dtype, device=params[0].device)] + params)

    return run


def _quiet(case):
    """The case with its warnings silenced (PSIS's on a handful of draws)."""

    def run(model, g, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return case(model, g, x)

    return run


def _curve(engine, guide=False, masks="all"):
    def run(model, g, x):
        curve = MaskedPretrainingLoss(conditionals=engine(), masks=masks).curve(model, g if guide else None, x)
        return torch.as_tensor(curve.score, device="cpu")

    return run


def _iwae(model, g, x):
    return ImportanceWeightedELBO(4).differentiable_loss(model, g, x).detach()


CASES = {
    "gaussian-lowrank": score_case(lambda: GaussianConditionals(method="lowrank")),
    "gaussian-lowrank-shared": score_case(lambda: GaussianConditionals(method="lowrank"), share_masks=True),
    "gaussian-dense": score_case(lambda: GaussianConditionals(method="dense")),
    "gaussian-order": score_case(GaussianConditionals, masks="order"),
    "gaussian-exhaustive": score_case(GaussianConditionals, masks="exhaustive"),
    "gaussian-stratified": score_case(GaussianConditionals, masks="stratified"),
    "gaussian-rate": score_case(GaussianConditionals, masks=0.4),
    "quadrature-adaptive": score_case(QuadratureConditionals),
    "quadrature-prior": score_case(lambda: QuadratureConditionals(adaptive=False)),
    "quadrature-order": score_case(QuadratureConditionals, masks="order"),
    "quadrature-prior-order": score_case(lambda: QuadratureConditionals(adaptive=False), masks="order"),
    "encode_decode": score_case(lambda: EncodeDecodeConditionals(4, 2), guide=True),
    "importance-prior": score_case(lambda: ImportanceConditionals(32, proposal="prior")),
    "importance-prior-order": score_case(lambda: ImportanceConditionals(32, proposal="prior"), masks="order"),
    "importance-guide": score_case(lambda: ImportanceConditionals(16, proposal="guide"), guide=True),
    "svi-step-gaussian": _svi_step(GaussianConditionals),
    "svi-step-gaussian-uniform": _svi_step(GaussianConditionals, masks="uniform"),
    "svi-step-quadrature": _svi_step(QuadratureConditionals),
    "svi-step-importance": _svi_step(lambda: ImportanceConditionals(16, proposal="guide"), guide=True),
    "evidence-exact": evidence_case("exact"),
    "evidence-quadrature": evidence_case("quadrature"),
    "evidence-importance": _quiet(evidence_case("importance", guide=True, num_samples=20)),
    "curve-gaussian": _curve(GaussianConditionals),
    "curve-gaussian-exhaustive": _curve(GaussianConditionals, masks="exhaustive"),
    "curve-encode_decode": _curve(lambda: EncodeDecodeConditionals(4, 1), guide=True),
    "iwae": _iwae,
}


def _run(case, device, seed=0, copies=1):
    """The case's output; with ``copies``, on the data repeated that many times, averaged
    over the copies of each datapoint."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model, x, _ = make_ppca(D, K, N, device=device)
    out = CASES[case](model, exact_posterior_guide, x.repeat(copies, 1))
    per_datapoint = not case.startswith(("svi-step", "curve", "iwae"))
    return out.reshape(copies, N).mean(0) if per_datapoint else out


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
    "gaussian-order", "gaussian-exhaustive", "quadrature-order", "quadrature-prior-order", "svi-step-gaussian",
    "svi-step-quadrature", "evidence-exact", "evidence-quadrature", "evidence-importance",
    "curve-gaussian-exhaustive", "iwae",
]
# random masks or draws, unbiased for a value computed exactly on the CPU: the exact
# log p(x_i), the quadrature mixture's evidence (its chain rule telescopes), or the
# exhaustive curve
UNBIASED_FOR = {
    "gaussian-lowrank": "evidence-exact",
    "gaussian-lowrank-shared": "evidence-exact",
    "gaussian-dense": "evidence-exact",
    "gaussian-stratified": "evidence-exact",
    "quadrature-adaptive": "quadrature-order",
    "quadrature-prior": "quadrature-prior-order",
    "curve-gaussian": "curve-gaussian-exhaustive",
}
REPEATS, COPIES = 64, 16


@cuda_only
@pytest.mark.parametrize("case", CUDA_EXACT)
def test_cuda_matches_cpu(case):
    cpu = _run(case, "cpu")
    got = _run(case, "cuda")
    assert got.device.type == ("cpu" if case.startswith("curve") else "cuda")
    assert torch.allclose(got.cpu(), cpu, atol=1e-6, rtol=1e-9), (case, got, cpu)
    if case == "iwae":  # the exact posterior as proposal: zero variance, the exact value
        assert abs(float(got) + float(_run("evidence-exact", "cpu").sum())) < 1e-8
    if case.startswith("svi-step"):
        assert all(pyro.param(k).device.type == "cuda" for k in ("W", "mu", "s"))


def _repeat(case, device, seeds):
    """Mean and standard error of the case's output over independent runs (one per seed),
    each on COPIES copies of the data: the runs are independent even where a run shares
    masks or draws across its batch, so the standard error holds for every case."""
    runs = torch.stack([_run(case, device, seed, COPIES).cpu() for seed in seeds])
    return runs.mean(0), runs.std(0) / len(seeds) ** 0.5, runs


@cuda_only
@pytest.mark.parametrize("case", sorted(set(CASES) - set(CUDA_EXACT)))
def test_cuda_random_cases_agree_with_cpu_in_distribution(case):
    """Random masks and draws differ between the CPU and CUDA streams: the mean of
    REPEATS runs per device (different seeds) agree within 4 standard errors, and
    with the exact value where the estimate is unbiased for one."""
    got = _run(case, "cuda")
    if case.startswith("svi-step"):
        assert all(pyro.param(k).device.type == "cuda" for k in ("W", "mu", "s"))
    assert got.device.type == ("cpu" if case.startswith("curve") else "cuda")
    gpu, gpu_se, runs = _repeat(case, "cuda", range(REPEATS, 2 * REPEATS))
    cpu, cpu_se, _ = _repeat(case, "cpu", range(REPEATS))
    assert bool(torch.isfinite(runs).all())
    assert float(gpu_se.max()) > 0  # the runs are independent
    # 1e-6 for rounding where an entry does not vary (the curve at M = D has one mask)
    se = (gpu_se**2 + cpu_se**2).sqrt()
    assert bool(((gpu - cpu).abs() <= 4 * se + 1e-6).all()), (case, gpu, cpu, (gpu - cpu) / se)
    if case in UNBIASED_FOR:
        exact = _run(UNBIASED_FOR[case], "cpu")
        assert bool(((gpu - exact).abs() <= 4 * gpu_se + 1e-6).all()), (case, gpu, exact, (gpu - exact) / gpu_se)


@cuda_only
def test_cuda_sampling_engines_are_exact_with_the_exact_posterior():
    pyro.clear_param_store()
    model, x, exact = make_ppca(D, K, N, device="cuda")
    tokens = trace_tokens(model, exact_posterior_guide, (x,), {})
    for engine in (EncodeDecodeConditionals(8, 1), ImportanceConditionals(8, proposal="guide", impute=False)):
        state = engine.prepare(tokens, model, exact_posterior_guide, (x,), {})
        value = engine.log_evidence(state, x)
        assert value.device.type == "cuda"
        assert torch.allclose(value, exact(x), atol=1e-8, rtol=0)


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
