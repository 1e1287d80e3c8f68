"""The gallery scripts in their --quick setting.

gallery_convergence (Fig. 1, Table 1), gallery_area (Fig. 4, Fig. 5 left),
gallery_schedules (schedule variance, fixed-rate bias) and gallery_adapters
(Fig. 5 right, Table 2, Fig. 6; offline fallbacks) run here; gallery_training
(Fig. 2, Fig. 3) runs the examples ppca_mpt_vs_elbo.py, linear_vae.py and
deep_vae.py, whose quick runs are tested in test_example_ppca_demo.py,
test_example_linear_vae.py and test_compare.py (which also check the RESULTS.md
sections built from them); here its plumbing runs with stand-in examples.
"""

import itertools
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from pyro_mpt import FixedRate

from models import load_script

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    return load_script(f"examples/{name}.py")


@pytest.fixture(scope="module")
def convergence(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery_convergence")
    return out, _load("gallery_convergence").main(["--quick", "--out-dir", str(out)])


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery_area")
    return out, _load("gallery_area").main(["--quick", "--out-dir", str(out)])


def _authors_lml(broadcast):
    """Mean log N(x_i; 0, W W^T + 0.2 I) over the authors' Table 1 data, by scipy in float64."""
    from scipy.stats import multivariate_normal

    sys.path.insert(0, EXAMPLES)
    from gallery_common import authors_ppca_data

    (W, _, s), x = authors_ppca_data(200, 5, 1000, seed=1991, broadcast_noise=broadcast)
    W = W.double().numpy()
    cov = W @ W.T + float(s) ** 2 * np.eye(200)
    return float(multivariate_normal(np.zeros(200), cov).logpdf(x.double().numpy()).mean())


def test_table1_on_the_authors_data(convergence):
    _, res = convergence
    t, ti = res["table1"], res["table1_independent"]
    # the paper's true LML, -60.34, on the authors' own generator (seed 1991, broadcast noise)
    assert t["lml"] == pytest.approx(-60.3436, abs=5e-4)
    assert t["lml"] == pytest.approx(_authors_lml(True), abs=1e-3)
    assert ti["lml"] == pytest.approx(_authors_lml(False), abs=1e-3)
    assert ti["lml"] < -130  # independent noise of variance 0.2 per token: far below -60.34
    for table in (t, ti):
        for P in (1, 10):
            mean, std = table[P]
            assert abs(mean - table["lml"]) <= 3 * std, (P, mean, std, table["lml"])
        assert table[10][1] < table[1][1]  # the spread shrinks with P (~1/sqrt(P))
    # the paper's estimator: the P=1 spread over 5 mask seeds near the paper's 0.47 (and the authors' script's
    # 0.476); 5 seeds leave the std estimate ~35 % uncertain, so a factor 2.5 either way here (1.5 in `make gallery`)
    assert 0.47 / 2.5 < t[1][1] < 0.47 * 2.5
    # over 20 seeds the std is known to ~16 %: within the factor 1.5 of the paper's 0.47
    assert t["spread_seeds"] == 20
    assert 0.47 / 1.5 < t["spread_P1"] < 0.47 * 1.5, t["spread_P1"]
    # and the "at 5 seeds": the mean 5-seed std over the 4 disjoint groups of 5 seeds
    assert len(t["spread_P1_groups"]) == 4
    assert 0.47 / 1.5 < np.mean(t["spread_P1_groups"]) < 0.47 * 1.5, t["spread_P1_groups"]


def test_fig1_bias_cause(convergence):
    _, res = convergence
    c = res["fig1_bias_causes"]
    broadcast, independent = c["authors' data (broadcast noise)"], c["authors' W, Z, independent noise"]
    # the broadcast noise inflates the fixed-rate bias (+5.1 % of |LML| in `make gallery`) ...
    assert 0.035 < broadcast["rel_bias"] < 0.08
    # ... while the same W, Z with the noise the model assumes give ~2 %, the size of the gallery's own bias
    assert 0.01 < independent["rel_bias"] < 0.03
    assert broadcast["rel_bias"] > 1.8 * independent["rel_bias"]


def test_fig1_all_sizes_converge_to_lml(convergence):
    _, res = convergence
    d5, d50, _ = res["fig1"]
    # D <= 16: the exhaustive curve's area is exactly the LML (Prop. 1)
    assert d5["exhaustive_area"] == pytest.approx(d5["lml"], abs=1e-3)
    for panel in (d5, d50):
        first = sum(abs(r) for r in panel["rel_first"]) / len(panel["rel_first"])
        final = sum(abs(r) for r in panel["rel_final"]) / len(panel["rel_final"])
        assert final < first, panel
        # unbiased: each seed's running mean within 4 of its standard errors of the LML
        for value, se in zip(panel["final"], panel["stderr_final"]):
            assert abs(value - panel["lml"]) < 4 * se, panel


def test_fig1_fixed_rate_converges_to_bias(convergence):
    _, res = convergence
    pn = res["fig1"][2]
    assert pn["D"] == 512 and pn["M"] == FixedRate(0.15).size(512)
    # a fixed 15 % rate is biased upwards by ~1.7 % of |LML| here
    assert pn["rel_bias"] > 0.01
    for rel, value, se in zip(pn["rel_final"], pn["final"], pn["stderr_final"]):
        # near the computed bias: within 4 of the running mean's standard errors (the
        # bias's own estimate, from many masks per datapoint, is far more precise)
        assert abs(value - pn["biased_value"]) < 4 * se, pn
        assert abs(rel) > 0.5 * pn["rel_bias"]  # not near the LML


def test_fig4_areas(area):
    _, res = area
    f = res["fig4"]
    # one mask set shared by the batch (the paper's P=1 curve): the area's error is the mask draw's, whose
    # spread at P=1 is ~0.5 nats at these sizes (Table 1's P=1 column), and 10x less at P=100
    assert abs(f["area_P1"] - f["lml"]) < 2.0
    assert abs(f["area_P100"] - f["lml"]) < 0.25
    assert abs(f["area_K50"] - f["lml_K50"]) < 1.0


def test_fig5_training_area_approaches_lml(area):
    _, res = area
    snaps, true_lml = res["fig5"], res["fig5_true_lml"]
    assert snaps[0]["epoch"] == 0 and snaps[-1]["epoch"] >= 300
    gaps = [abs(s["area"] - true_lml) for s in snaps]
    assert gaps[0] > 10.0  # random init: flat, low curve
    assert gaps[-1] < 0.5
    assert all(b < a for a, b in zip(gaps[:-1], gaps[1:-1]))  # climbs while training
    for s in snaps:  # the area tracks the exact LML of the current parameters
        assert abs(s["area"] - s["lml"]) < 0.3


def test_outputs_written(convergence, area):
    for out, res in (convergence, area):
        for png in res["png"]:
            assert os.path.getsize(png) > 10_000
        text = (out / "RESULTS.md").read_text()
        assert "paper" in text
    assert math.isfinite(convergence[1]["table1"][10][0])
    # every figure's paper setting, default and difference are listed
    text = (convergence[0] / "RESULTS.md").read_text()
    section = text.split("## Paper settings and gallery defaults")[1]
    for fig in ("Fig. 1", "Table 1", "Fig. 2", "Fig. 3 top", "Fig. 3 bottom", "Fig. 4", "Fig. 5 left",
                "Fig. 5 right, Table 2", "Fig. 6"):
        assert f"\n| {fig} |" in section, fig


def test_paper_and_quick_exclude_each_other():
    for name in ("gallery_convergence", "gallery_area", "gallery_training", "gallery_adapters"):
        with pytest.raises(SystemExit) as e:
            _load(name).main(["--quick", "--paper"])
        assert e.value.code == 2, name


# ---------------------------------------------------------------------- gallery_schedules
@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery_schedules")
    return out, _load("gallery_schedules").main(["--quick", "--out-dir", str(out)])


def test_order_has_zero_variance_and_all_schedules_are_unbiased(schedules):
    _, res = schedules
    rows = res["variance"]
    assert {r["masks"] for r in rows} == {"all", "nested", "uniform", "stratified", "order"}
    for r in rows:
        if r["masks"] == "order":
            # the Gaussian engine's chain rule is log p(x) along every ordering (float64)
            assert r["std"] <= 1e-10 and abs(r["mean_error"]) <= 1e-10, r
        else:
            assert r["std"] > 0.1, r
            assert abs(r["mean_error"]) <= 4 * r["mean_error_se"], r
    for masks in ("all", "nested", "uniform", "stratified"):
        rs = [r for r in rows if r["masks"] == masks]
        ratio = rs[-1]["std"] / rs[0]["std"]
        expected = math.sqrt(rs[0]["P"] / rs[-1]["P"])  # independent masks: std ~ P^(-1/2)
        assert 0.7 * expected < ratio < 1.4 * expected, (masks, ratio, expected)


def test_the_papers_all_has_less_spread_than_nested(schedules):
    """At equal compute the paper's estimator ("all", independent masks per size) spreads
    less than the nested masks: measured 0.61x (P=1) and 0.58x (P=4) in the quick run (D=10, 40 repeats);
    asserted below 0.85x."""
    _, res = schedules
    std = {(r["masks"], r["P"]): r["std"] for r in res["variance"]}
    for P in (1, 4):
        assert std[("all", P)] < 0.85 * std[("nested", P)], (P, std[("all", P)], std[("nested", P)])


def _brute_force_bias(D, K, N, seed, M):
    """D S(x; M) - log p(x), mean over the data, from every subset of size M, by hand."""
    sys.path.insert(0, EXAMPLES)
    from gallery_common import ppca_data

    (W, mu, s), x = ppca_data(D, K, N, seed)
    W, mu, s, x = W.double(), mu.double(), s.double(), x.double()
    S = W @ W.T + s**2 * torch.eye(D, dtype=torch.float64)
    lml = torch.distributions.MultivariateNormal(mu, S).log_prob(x).mean()
    total, count = torch.zeros(N, dtype=torch.float64), 0
    for m in itertools.combinations(range(D), M):
        m = list(m)
        r = [d for d in range(D) if d not in m]
        A = torch.linalg.solve(S[r][:, r], S[r][:, m]).T  # (M, |R|)
        mean = mu[m] + (x[:, r] - mu[r]) @ A.T
        var = torch.diagonal(S[m][:, m] - A @ S[r][:, m])
        total += torch.distributions.Normal(mean, var.sqrt()).log_prob(x[:, m]).sum(-1) / M
        count += 1
    return float(D * (total / count).mean() - lml)


def test_fixed_rate_bias_matches_brute_force(schedules):
    _, res = schedules
    pn = res["bias"][0]
    assert pn["exact"] and pn["D"] == 14
    # Proposition 1: the exhaustive curve's area is the LML, so the bias averages to 0 over the sizes
    assert abs(pn["area_minus_lml"]) < 1e-10
    assert abs(np.mean(pn["bias"])) < 1e-10
    ms = [pt["M"] for pt in pn["points"].values()]
    assert ms == [FixedRate(0.15).size(14), FixedRate(0.2).size(14)] == [2, 3]
    for rate, pt in pn["points"].items():
        exact = _brute_force_bias(pn["D"], pn["K"], pn["N"], pn["seed"], pt["M"])
        assert pt["bias"] == pytest.approx(exact, abs=1e-8)
        assert pt["bias"] > 1.0  # a low fixed rate overestimates the LML (measured +2.7 and +2.6)
        # the library's fixed-rate estimator lands on the curve
        assert abs(pt["estimator"] - exact) < 4 * pt["estimator_se"], (rate, pt, exact)
    # the Monte Carlo curve ("all", P masks per size) agrees with the exhaustive one
    chk = res["bias_check"]
    z = (chk["bias"] - pn["bias"]) / chk["bias_se"]
    assert np.abs(z).max() < 4.5, z


# ---------------------------------------------------------------------- gallery_adapters (offline fallbacks)
@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("antiberty")
    old = torch.get_num_threads()
    out = tmp_path_factory.mktemp("gallery_adapters")
    try:
        res = _load("gallery_adapters").main(["--quick", "--threads", "1", "--out-dir", str(out)])
    finally:
        torch.set_num_threads(old)
    return out, res


def test_table2_offline_fallback(adapters):
    out, res = adapters
    t2 = res["table2"]
    assert t2["mode"].startswith("OFFLINE FALLBACK")
    rows = {(r["subset"], r["weights"]): r for r in t2["rows"]}
    # offline: 8 chains per subset (6 real + 2 variants) on the coarse 11-rate grid, the Table-2 scale
    assert all(len(curve.score) == 11 for curve in t2["curves"]) and all(r["n"] == 8 for r in t2["rows"])
    uniform = -math.log(25) * 512  # AntiBERTy's 25-token vocabulary, uniform predictions, 512 x the integral
    for subset in ("VH (heavy)", "VL (light)"):
        random, trained = rows[(subset, "random init")], rows[(subset, "pre-trained")]
        assert random["table2_scale_area"] == pytest.approx(uniform, rel=0.15)
        assert trained["table2_scale_area"] > random["table2_scale_area"] + 300
        assert 0 < trained["table2_scale_stderr"] < 0.2 * abs(trained["table2_scale_area"])
    # the control: shuffled chains are far less likely under the pre-trained model than real ones
    shuffled = rows[("VH shuffled", "pre-trained")]["table2_scale_area"]
    assert shuffled < rows[("VH (heavy)", "pre-trained")]["table2_scale_area"] - 300
    text = (out / "RESULTS.md").read_text()
    assert "not comparable" in text and "-5245.31" in text and "AREA / PRE-TRAINED (this run)" in text


def test_antibody_variants_are_reproducible_mutants():
    from pyro_mpt.adapters.antibodies import HEAVY, variants

    a, b = variants(HEAVY, 50, seed=3), variants(HEAVY, 50, seed=3)
    assert a == b and a != variants(HEAVY, 50, seed=4)
    for k, chain in enumerate(a):
        parent = HEAVY[k % len(HEAVY)]
        assert len(chain) == len(parent)
        assert set(chain) <= set("ACDEFGHIKLMNPQRSTVWY")
    # 5 % of residues mutate: over 50 chains of ~120 residues, within 5 binomial standard errors
    diffs = sum(x != y for k, chain in enumerate(a) for x, y in zip(chain, HEAVY[k % len(HEAVY)]))
    total = sum(len(c) for c in a)
    assert abs(diffs - 0.05 * total) < 5 * math.sqrt(total * 0.05 * 0.95)


def test_fig6_offline_fallback(adapters):
    out, res = adapters
    f6 = res["fig6"]
    assert f6["mode"].startswith("OFFLINE FALLBACK")
    curves = list(f6["curves"].values())
    first, last = curves[0], curves[-1]
    assert 0.8 < first["mse"].score.mean() < 1.3  # random init on standardized pixels (measured 1.01)
    assert last["log_density"].area() > first["log_density"].area() + 5.0  # measured +16 in 40 steps
    for png in res["png"]:
        assert os.path.getsize(png) > 10_000
    assert "## Fig. 6" in (out / "RESULTS.md").read_text()


def test_fig6_rows_reproducible_at_another_thread_count(adapters, tmp_path):
    """A second quick Fig. 6 run with the same seed, on 2 threads, after other draws from torch's
    global stream: the same training rows (the scoring may round differently on 2 threads)."""
    _, res = adapters
    old = torch.get_num_threads()
    torch.rand(17)
    try:
        again = _load("vit_mae_curves").main(["--offline", "--seed", "0", "--threads", "2", "--json", "",
                                              "--limit", "60", "--train-steps", "40",
                                              "--plot", str(tmp_path / "fig6.png")])
    finally:
        torch.set_num_threads(old)
    first = res["fig6"]["curves"]
    assert list(again["curves"]) == list(first) and len(first) == 4  # steps 0, 5, 20, 40
    for name, c in first.items():
        np.testing.assert_allclose(again["curves"][name]["mse"].per_item, c["mse"].per_item, rtol=1e-5, atol=0)


def test_fig6_training_ignores_threads_and_global_stream():
    """The cause of the irreproducible Fig. 6 rows: training must depend on the seed alone.

    Both runs pin the steps to one thread, so the same float operations run in the
    same order and the trained weights are compared bitwise; before the fix, a run
    on 2 threads or after a draw from torch's global stream (ViT-MAE's masking
    noise) moved the weights by up to 1.1e-6 (2 threads) or 0.028 (one global draw) in
    these 8 steps, and a default run on 2 threads ended with another Fig. 6 table.
    """
    pytest.importorskip("transformers")
    vit = _load("vit_mae_curves")
    train = torch.randn(256, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    old = torch.get_num_threads()
    weights = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model = vit.tiny_vit_mae(seed=0)
            torch.rand(threads)  # a draw from the global stream between initialization and training
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
            vit.train_steps(model, opt, train, 8, torch.Generator().manual_seed(0))
            weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    finally:
        torch.set_num_threads(old)
    init = vit.tiny_vit_mae(seed=0).state_dict()
    assert any(not torch.equal(init[k], weights[0][k]) for k in init)  # training moved the weights
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


# ---------------------------------------------------------------------- gallery_training (plumbing)
def test_gallery_training_runs_the_examples(tmp_path, monkeypatch):
    """The examples themselves are tested elsewhere; here stand-ins record the calls."""
    from PIL import Image

    from pyro_mpt.experiments.compare import Comparison, RunResult

    calls = {}

    def stand_in(name, result):
        def main(argv):
            calls[name] = argv
            path = argv[argv.index("--out") + 1]
            Image.new("RGB", (8, 8), "white").save(path)
            return result

        module = types.SimpleNamespace(main=main)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    methods = {name: dict(final_lml=np.array([-11.0, -11.1]), final_objective=np.array([-10.9, -11.0]))
               for name in ("MPT uniform", "MPT fixed 20%")}
    stand_in("ppca_mpt_vs_elbo", dict(config=dict(quick=True, num_data=500, inits=2, epochs=100, lr=0.3, seed=0),
                                      true_lml=-11.2, ml_lml=-10.95, methods=methods))
    lin = dict(objective=np.linspace(-24, -22, 30), lml=np.array([-24.6, -22.1]), lml_epochs=np.array([0, 30]))
    stand_in("linear_vae", dict(config=dict(dataset="digits", num_data=300, num_tokens=64, epochs=30, elbo_epochs=60,
                                            masks="uniform", num_masks=1), methods=dict(MPT=lin, ELBO=lin)))
    deep = stand_in("deep_vae", Comparison(
        [RunResult("elbo", heldout=-30.0, stderr=0.5, history=[dict(epoch=0, loss=40.0, heldout=-40.0)])],
        dict(epochs=4, batch_size=128, final_samples=100, num_train=300, num_test=60)))
    deep.parse_args = lambda argv: types.SimpleNamespace(dataset="digits", likelihood="gaussian", latent_dim=5,
                                                         mpt_encoder=argv[argv.index("--mpt-encoder") + 1])
    res = _load("gallery_training").main(["--quick", "--out-dir", str(tmp_path)])
    demo_argv = calls["ppca_mpt_vs_elbo"]
    assert demo_argv[demo_argv.index("--out") + 1] == str(tmp_path / "fig2_training.png")
    assert all("--quick" in argv for argv in calls.values())
    names = [os.path.basename(p) for p in res["png"]]
    assert names == ["fig2_training.png", "fig3_linear_vae.png", "fig3_deep_vae.png", "fig3_deep_vae_elbo_encoder.png"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "<!-- BEGIN fig2 -->" in text and "<!-- BEGIN fig3 -->" in text
    assert "| MPT uniform | -11.0500 ± 0.0707 | -0.1000 |" in text
    assert "| elbo | -40.000 | -30.000 ± 0.500 |" in text


@pytest.mark.parametrize("name", ["gallery_adapters", "gallery_area", "gallery_convergence", "gallery_schedules",
                                  "gallery_training"])
def test_quick_runs_do_not_write_into_the_committed_gallery(name, monkeypatch):
    """Without --out-dir a --quick run writes under outputs/ (git-ignored), a full run into
    docs/gallery: a user's quick run replaced the committed figures and RESULTS.md sections
    (12 tracked files). The first folder each script makes is where it writes."""
    made = []

    class Made(Exception):
        pass

    def makedirs(path, *a, **k):
        made.append(path)
        raise Made

    module = _load(name)
    monkeypatch.setattr(os, "makedirs", makedirs)
    for argv, where in ((["--quick"], "outputs/gallery-quick"), ([], "docs/gallery")):
        with pytest.raises(Made):
            module.main(argv)
        assert made[-1] == where, (name, argv)
