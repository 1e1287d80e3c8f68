"""The main demo, examples/ppca_mpt_vs_elbo.py, run in-process with --quick.

The demo is run once per module (about 10 s of CPU) and its returned results
are checked against facts that hold whatever the library's random stream:
the closed-form maximum likelihood bounds every trained model, the unbiased
"uniform" MPT schedule gets close to it, "order" equals the exact LML at every
epoch, and a fixed masking rate gives an objective far from the LML (the
paper's bias). Tolerances come from measurements of the quick setting over data
seeds 0-4 (see the comments), with a margin.
"""


import numpy as np
import pytest

from models import load_script


def _load_example():
    return load_script("examples/ppca_mpt_vs_elbo.py")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # a directory that does not exist yet: the demo must create it
    out = tmp_path_factory.mktemp("demo") / "figures" / "x.png"
    results = _load_example().main(["--quick", "--no-progress", "--out", str(out)])
    return results, out


def test_writes_png(demo):
    _, out = demo
    assert out.is_file()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000  # six panels of curves, not an empty canvas


def test_results_shape(demo):
    results, _ = demo
    cfg = results["config"]
    assert cfg["quick"] and cfg["inits"] >= 2
    assert set(results["methods"]) == {
        "MPT all", "MPT uniform", "MPT order", "MPT fixed 20%", "ELBO AutoNormal"
    }
    for r in results["methods"].values():
        assert r["final_lml"].shape == (cfg["inits"],)
        assert r["lml_curve"].shape == r["objective_curve"].shape == (cfg["inits"], cfg["epochs"])
        assert np.isfinite(r["lml_curve"]).all() and np.isfinite(r["objective_curve"]).all()


def test_references(demo):
    results, _ = demo
    ml, true = results["ml_lml"], results["true_lml"]
    # ML maximizes the likelihood of this sample; the generating parameters are
    # close behind (measured: 0.013 nats/datapoint at N=500)
    assert true <= ml
    assert ml - true < 0.05
    assert -11.5 < ml < -10.5


def test_library_evidence_matches_closed_form(demo):
    results, _ = demo
    # float32 params and data; measured max |difference| 7e-6 nats/datapoint
    for r in results["methods"].values():
        assert r["evidence_mismatch"] < 1e-4


def test_no_method_beats_maximum_likelihood(demo):
    results, _ = demo
    for name, r in results["methods"].items():
        assert (r["final_lml"] <= results["ml_lml"] + 1e-4).all(), name


def test_every_method_increases_the_lml(demo):
    results, _ = demo
    for name, r in results["methods"].items():
        assert (r["final_lml"] > r["lml_curve"][:, 0] + 1.0).all(), name


def test_uniform_mpt_reaches_maximum_likelihood(demo):
    results, _ = demo
    gap = results["ml_lml"] - results["methods"]["MPT uniform"]["final_lml"]
    # measured over data seeds 0-4 and 6 mask streams: at most 0.039 nats/datapoint
    assert (gap < 0.1).all(), gap


def test_order_objective_is_the_exact_lml(demo):
    results, _ = demo
    r = results["methods"]["MPT order"]
    # the chain rule along any ordering is log p(x) exactly; float32, measured <= 4e-6
    assert np.abs(r["objective_curve"] - r["lml_curve"]).max() < 1e-3
    assert (results["ml_lml"] - r["final_lml"] < 0.05).all()


def test_fixed_rate_objective_is_biased(demo):
    results, _ = demo
    r = results["methods"]["MPT fixed 20%"]
    # D * S(x; 2) sits far above log p(x): measured 2.30-3.12 nats/datapoint
    bias = r["final_objective"] - r["final_lml"]
    assert (bias > 1.5).all(), bias
    # while the unbiased schedule's objective (a 10-epoch average of one-mask
    # estimates) only scatters around the LML: measured |difference| <= 0.20
    u = results["methods"]["MPT uniform"]
    assert (np.abs(u["final_objective"] - u["final_lml"]) < 0.5).all()


def test_gallery_fig2_section(demo):
    """examples/gallery_training.py writes this run's numbers into docs/gallery/RESULTS.md (examples/gallery_report.py)."""
    gallery = load_script("examples/gallery_report.py")
    results, _ = demo
    text = gallery.fig2_markdown(results, seconds=1.0)
    assert f"{results['true_lml']:.4f}" in text and f"{results['ml_lml']:.4f}" in text
    for name, r in results["methods"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert f"{r['final_lml'].mean():.4f}" in row
    assert "biased value" in text and "--quick" in text


def test_fixed_rate_optimum_script_objective_is_the_exhaustive_fixed_rate_score(capsys):
    """examples/ppca_fixed_rate_optimum.py writes D S(x; 2) in plain torch (all 45 masks);
    it equals D times pyro_mpt's exhaustive curve at M = 2, and its main() runs on a small
    data set and prints one line per start."""
    import torch
    import pyro
    import pyro.distributions as dist
    from pyro_mpt import MaskedPretrainingLoss

    script = load_script("examples/ppca_fixed_rate_optimum.py")
    g = torch.Generator().manual_seed(3)
    D, K = 10, 2
    x = torch.randn(50, D, generator=g, dtype=torch.float64)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    mu = torch.randn(D, generator=g, dtype=torch.float64)
    log_s = torch.tensor(-0.3, dtype=torch.float64)

    def ppca(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(K, dtype=x.dtype), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z @ W.T + mu, log_s.exp()).to_event(1), obs=x)

    curve = MaskedPretrainingLoss(masks="exhaustive").curve(ppca, None, x)
    expected = D * float(curve.score[list(curve.sizes).index(2)])
    assert abs(float(script.fixed_rate_objective(x, W, mu, log_s, 2)) - expected) < 1e-10
    script.main(num_data=100, starts=1)
    out = capsys.readouterr().out
    assert "start 0: objective at its maximum" in out and "W x 0.9" in out
