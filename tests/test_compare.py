"""The MPT-vs-ELBO comparison utility, the pyro-mpt CLI and the deep VAE example (quick mode)."""

import json
import math

import numpy as np
import pytest
import torch
import pyro
from pyro.infer import RenyiELBO, Trace_ELBO

from pyro_mpt import EncodeDecodeConditionals, ImportanceConditionals, ImportanceWeightedELBO, MaskedPretrainingLoss
from pyro_mpt.experiments.cli import run as cli_run
from pyro_mpt.experiments.compare import compare, heldout_evidence, khat_summary, make_loss
from pyro_mpt.experiments.datasets import load_dataset
from pyro_mpt.guide_elbo import WithGuideELBO
from pyro_mpt.masks import FixedRate, UniformSizes
from pyro_mpt.experiments.vae import DeepVAE

from models import exact_posterior_guide, load_script, make_ppca


def test_make_loss_parses_specs():
    loss = make_loss("mpt:0.33")
    assert isinstance(loss, WithGuideELBO)
    assert isinstance(loss.inner.schedule, FixedRate) and loss.inner.schedule.rate == 0.33
    assert isinstance(loss.inner.engine, EncodeDecodeConditionals) and not loss.inner.engine.encoder_grad
    loss = make_loss("mpt", mpt_encoder="mpt", engine_options={"num_samples": 3})
    assert isinstance(loss, MaskedPretrainingLoss) and isinstance(loss.schedule, UniformSizes)
    assert loss.engine.encoder_grad and loss.engine.num_samples == 3
    assert isinstance(make_loss("mpt:uniform:importance").inner.engine, ImportanceConditionals)
    assert isinstance(make_loss("elbo"), Trace_ELBO)
    assert make_loss("iwae:5").num_particles == 5
    renyi = make_loss("renyi:4:0.5")
    assert isinstance(renyi, RenyiELBO) and renyi.alpha == 0.5 and renyi.num_particles == 4
    custom = Trace_ELBO()
    assert make_loss(custom) is custom
    assert isinstance(make_loss(Trace_ELBO), Trace_ELBO)
    assert isinstance(make_loss(lambda: ImportanceWeightedELBO(3)), ImportanceWeightedELBO)
    with pytest.raises(ValueError, match="Unknown loss spec"):
        make_loss("vi")
    with pytest.raises(ValueError, match="not a valid int"):
        make_loss("iwae:many")
    with pytest.raises(ValueError, match="unknown conditionals"):
        make_loss("mpt:0.2:magic")


def test_our_iwae_equals_pyros_renyi_without_subsampling():
    model, x, exact = make_ppca(5, 2, N=12)
    guide = exact_posterior_guide
    ours = ImportanceWeightedELBO(num_particles=6).loss(model, guide, x)
    pyros = RenyiELBO(alpha=0.0, num_particles=6).loss(model, guide, x)
    assert ours == pytest.approx(-float(exact(x).detach().sum()), abs=1e-6)
    assert pyros == pytest.approx(ours, abs=1e-6)


def test_compare_trains_each_loss_from_the_same_start_and_reports_errors():
    train, test = load_dataset("digits", n_train=96, n_test=40)
    D = train.shape[1]

    def make_model():
        return DeepVAE(D, latent_dim=3, hidden=(16,))

    def broken():
        raise RuntimeError("boom")

    losses = {"mpt:0.5": "mpt:0.5", "elbo": "elbo", "iwae:4": "iwae:4", "renyi:4": "renyi:4", "broken": broken}
    res = compare(
        make_model, train, test, losses, epochs=2, batch_size=32, lr=1e-2, eval_every=1,
        eval_samples=20, final_samples=50, engine_options={"num_samples": 2, "num_iterations": 1},
    )
    assert [r.name for r in res.results] == list(losses)
    for r in res.results[:4]:
        assert r.error is None, r.error
        assert math.isfinite(r.heldout) and -64 * math.log(2) - 5 < r.heldout < 0
        assert r.stderr > 0 and r.mc_stderr >= 0 and r.train_time > 0
        assert [h["epoch"] for h in r.history] == [1, 2]
        assert all("heldout" in h for h in r.history)
    # same initialization: after one epoch of similar objectives the models are close
    first = [r.history[0]["heldout"] for r in res.results[:4]]
    assert max(first) - min(first) < 3.0
    assert "RuntimeError: boom" in res["broken"].error
    table = res.table()
    assert "mpt:0.5" in table and "failed: RuntimeError: boom" in table and "vs elbo" in table
    d, se = res.paired("iwae:4", "elbo")
    assert d == pytest.approx(res["iwae:4"].heldout - res["elbo"].heldout, abs=1e-5)
    assert 0 < se < res["elbo"].stderr
    assert res.to_dict()["settings"]["epochs"] == 2


def test_train_time_leaves_one_time_costs_to_an_untimed_warm_up():
    """The first step of a process pays one-time costs (about 2 s of imports and set-up in
    `pyro-mpt compare`), which went into the time of whichever loss ran first: listed first,
    the ELBO took 2.4 s, listed second 0.4 s. A loss whose first call costs 1 s stands for them
    here. Now an untimed step on a throwaway model takes them, and the run's numbers are those
    of a run without it (a loss instance, which gets no warm-up)."""
    import time

    class SlowStart(Trace_ELBO):
        started = False

        def loss_and_grads(self, model, guide, *args, **kwargs):
            if not SlowStart.started:
                SlowStart.started = True
                time.sleep(1.0)
            return super().loss_and_grads(model, guide, *args, **kwargs)

    train, test = load_dataset("digits", n_train=64, n_test=10)

    def make_model():
        return DeepVAE(train.shape[1], latent_dim=2, hidden=(8,))

    res = compare(make_model, train, test, {"slow start": SlowStart, "elbo": "elbo", "elbo, no warm-up": Trace_ELBO()},
                  epochs=1, batch_size=32, eval_samples=10)
    assert res["slow start"].error is None and SlowStart.started
    assert res["slow start"].train_time < 0.5, res["slow start"].train_time
    assert res["elbo"].values == res["elbo, no warm-up"].values
    assert res["elbo"].history == res["elbo, no warm-up"].history


def test_the_warm_up_leaves_a_shared_model_untrained():
    """A make_model that returns the same modules at every call (closures over one DeepVAE):
    the warm-up's optimizer step trained them, so the run started one untimed step in (its
    decoder moved by one Adam step with epochs=0). The warm-up step's updates are now undone
    (values restored, gradients cleared): with epochs=0 the parameters are those the model
    started with."""
    train, test = load_dataset("digits", n_train=64, n_test=10)
    pyro.set_rng_seed(0)
    vae = DeepVAE(train.shape[1], latent_dim=2, hidden=(8,))
    before = {k: v.detach().clone() for k, v in vae.state_dict().items()}
    res = compare(lambda: vae, train, test, {"elbo": "elbo"}, epochs=0, batch_size=32, eval_samples=10, lr=0.05)
    assert res["elbo"].error is None
    for k, v in vae.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in vae.parameters())


def test_a_learning_rate_that_blows_up_training_is_named_as_the_reason(capsys):
    """`compare --losses elbo --lr 1e6`: the loss went from 47 to 4e30 nats per image while
    staying finite, the encoder's means reached 1e15 with scales of 1e-4 (a point mass in float32),
    and the table said the guide was a point mass and a MAP guide (AutoDelta, dist.Delta) cannot
    be a proposal, of a Normal encoder. Now it says training diverged and names the learning rate."""
    with pytest.raises(SystemExit) as err:
        cli_run(["compare", "--losses", "elbo", "--lr", "1e6", "--epochs", "1", "--n-train", "200", "--n-test", "20",
                  "--final-samples", "20", "--quiet"])
    assert err.value.code == 1
    table = capsys.readouterr().out
    assert ("elbo                   failed: FloatingPointError: training diverged: the loss per datapoint went from "
            in table), table
    assert "most likely because the learning rate lr=1e+06 is too large for this model; lower it (pyro-mpt compare " \
           "--lr, whose default is 0.003)" in table
    assert "AutoDelta" not in table and "point mass" not in table


def test_cli_compare_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    res = cli_run([
        "compare", "--n-train", "64", "--n-test", "32", "--epochs", "1", "--hidden", "8",
        "--latent-dim", "2", "--losses", "mpt:0.5", "elbo", "--final-samples", "20",
        "--num-samples", "2", "--num-iterations", "1", "--json", str(out), "--quiet",
    ])
    printed = capsys.readouterr().out
    assert "held-out log p(x)" in printed and "mpt:0.5" in printed and "elbo" in printed
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["results"]] == ["mpt:0.5", "elbo"]
    assert all(r["error"] is None for r in data["results"])
    assert res["elbo"].heldout == pytest.approx(data["results"][1]["heldout"])
    with pytest.raises(SystemExit):
        cli_run([])  # a subcommand is required


@pytest.mark.parametrize("argv, message", [
    (["--n-test", "5000"], "n_test=5000 leaves no training data out of 1797 images; pass n_test < 1797."),
    (["--dataset", "mnist"], "load_dataset('mnist') needs torchvision: pip install pyro-mpt[vision]"),
    (["--lr", "0"], "argument --lr: must be a positive number, got '0'"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got 'nan'"),
    (["--losses", "elbo", "iwae:0"], "Loss spec 'iwae:0': K=0 particles; give a positive integer, e.g. 'iwae:8'."),
    (["--losses", "renyi:-2:0.5"], "Loss spec 'renyi:-2:0.5': K=-2 particles; give a positive integer"),
    (["--losses", "renyi:8:1"], "Loss spec 'renyi:8:1': alpha=1 is the ELBO; use 'elbo'"),
    (["--seed", "-1"], "argument --seed: must be an integer from 0 to 2**32 - 1, got '-1'"),
    (["--losses", "mpt:uniform:quadrature", "--mpt-encoder", "mpt"], "never runs the guide, so the MPT loss cannot train the encoder"),
])
def test_cli_compare_refuses_data_rates_and_particles_before_training(argv, message, capsys, monkeypatch):
    """Usage errors (status 2, one line on stderr, nothing trained or printed): an --n-test the
    data cannot spare and mnist without torchvision were tracebacks (status 1); --lr 0 / nan,
    iwae:0 and renyi:-2 trained, and every such loss failed ("Invalid learning rate", "range()
    arg 3 must not be zero"), status 1 after the other losses' training."""
    monkeypatch.setitem(__import__("sys").modules, "torchvision", None)  # import torchvision fails
    with pytest.raises(SystemExit) as exit_:
        cli_run(["compare", "--epochs", "1", *argv])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()  # argparse's usage lines, then one error line
    assert sum("error:" in line for line in lines) == 1 and message in lines[-1]


def test_cli_compare_refuses_bad_outputs_and_widths_before_training(tmp_path):
    """Through the console script: a --json that cannot be written (its folder is a file) and
    a zero hidden width are usage errors (status 2, one line) before any training; a missing
    --json folder is created. Before, the first failed after training (FileNotFoundError,
    status 1) and a zero width trained broken models."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from models import ROOT

    script = Path(sys.executable).with_name("pyro-mpt")
    script = str(script) if script.exists() else shutil.which("pyro-mpt")
    if script is None:
        pytest.skip("the pyro-mpt console script is not installed (pip install -e .)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])), MPLBACKEND="Agg")

    def pyro_mpt(*argv):
        return subprocess.run([script, "compare", *map(str, argv)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = pyro_mpt("--losses", "elbo", "--json", blocker / "c.json")
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert f"--json '{blocker / 'c.json'}': cannot write in its folder" in bad.stderr
    width = pyro_mpt("--hidden", "16", "0")
    assert width.returncode == 2 and "argument --hidden: must be a positive integer, got '0'" in width.stderr
    # more training images than the data hold after the split: before, the run went on with 1498
    many = pyro_mpt("--n-train", "5000", "--losses", "elbo", "--epochs", "1")
    assert many.returncode == 2 and many.stdout == "" and "Traceback" not in many.stderr
    assert "--n-train 5000 asks for more training images than digits has after the held-out split (1498 of 1797" in many.stderr
    ok = pyro_mpt("--n-train", "32", "--n-test", "16", "--epochs", "1", "--hidden", "8", "--latent-dim", "2",
                  "--losses", "elbo", "--final-samples", "10", "--quiet", "--json", tmp_path / "runs" / "c.json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "runs" / "c.json").read_text())["results"][0]["name"] == "elbo"


def test_deep_vae_example_quick(tmp_path):
    module = load_script("examples/deep_vae.py")
    png = tmp_path / "fig.png"
    res = module.main(["--quick", "--out", str(png)])
    assert png.exists() and png.stat().st_size > 10_000
    names = [r.name for r in res.results]
    assert names == ["mpt:0.33", "mpt:uniform", "elbo"]
    for r in res.results:
        assert r.error is None and math.isfinite(r.heldout)
        # the held-out LML improved during training
        lml = [h["heldout"] for h in r.history if "heldout" in h]
        assert lml[-1] > lml[0]
    # examples/gallery_training.py writes these numbers into docs/gallery/RESULTS.md
    gallery = load_script("examples/gallery_report.py")
    text = gallery.deep_vae_markdown(res, vars(module.parse_args(["--quick"])))
    for r in res.results:
        assert f"| {r.name} | " in text and f"{r.heldout:.3f} ± {r.stderr:.3f}" in text


def test_khat_summary_counts_only_defined_khats():
    """The held-out k-hat fraction and maximum are taken over the datapoints whose k-hat is
    defined (numpy's nan-aware reference): an undefined (NaN) k-hat counts neither as reliable
    nor as unreliable, and with none defined both are NaN. Before, NaN counted as reliable
    (0 % above 0.7 for a run whose k-hats were all undefined) and the maximum was NaN."""
    k = torch.tensor([0.2, math.nan, 0.9, -math.inf, 0.75, math.nan], dtype=torch.float64)
    got = khat_summary(k)
    kn = k.numpy()
    assert got["khat_frac"] == pytest.approx(np.nanmean(np.where(np.isnan(kn), np.nan, kn > 0.7)))
    assert got["khat_max"] == pytest.approx(np.nanmax(kn))
    # fewer than 25 draws: every k-hat undefined (a deep VAE: no exact evidence, so sampled)
    vae = DeepVAE(4, 1, (3,), "bernoulli")
    x = (torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) > 0.5).to(torch.get_default_dtype())
    ev = heldout_evidence(vae.model, vae.guide, x, num_samples=10)
    assert ev["method"] == "importance"
    assert math.isnan(ev["khat_frac"]) and math.isnan(ev["khat_max"])
    assert np.isfinite(ev["mean"])


def test_table_shows_a_small_share_of_large_khat_as_below_one_percent():
    """One held-out image in 299 with k-hat > 0.7 read "0%" in the table; now "<1%", while
    none reads 0% and a third 33%."""
    from pyro_mpt.experiments.compare import Comparison, RunResult

    rows = [RunResult(name, -20.0, 0.2, 0.003, frac, 0.5, 1.0, -20.0, [], [-20.0], None)
            for name, frac in (("a", 1 / 299), ("b", 0.0), ("c", 1 / 3))]
    lines = Comparison(rows, {}).table(reference=None).splitlines()[2:]
    assert [line.split()[4] for line in lines] == ["<1%", "0%", "33%"]


def test_undefined_khat_share_reads_na_and_json_null():
    """With fewer draws than k-hat's fit needs, the share above 0.7 is undefined: the table read
    "nan%" and the JSON held a bare NaN, which strict parsers refuse; now "n/a" and null."""
    from pyro_mpt.experiments.compare import Comparison, RunResult

    rows = [RunResult("elbo", -20.0, 0.2, 0.003, math.nan, math.nan, 1.0, -20.0, [], [-20.0], None)]
    comparison = Comparison(rows, {"final_samples": 10})
    assert comparison.table(reference=None).splitlines()[2].split()[4] == "n/a"
    text = json.dumps(comparison.to_dict(), allow_nan=False)  # raises on NaN
    assert json.loads(text)["results"][0]["khat_frac"] is None


def test_heldout_evidence_is_exact_where_the_model_has_an_exact_one():
    """A model with an exact evidence (PPCA, the README's form, no guide) was scored on
    held-out data by importance sampling from the prior, biased low by about half its
    variance (0.020 nats at 4000 draws, 2.4 of its Monte Carlo errors). It is now scored
    exactly: scipy's marginal to 1e-10, no Monte Carlo error, no k-hat. A deep VAE, which
    has none, is still importance-sampled."""
    import pyro
    from scipy.stats import multivariate_normal

    pyro.clear_param_store()
    model, x, _ = make_ppca(6, 2, 40, seed=3)
    W, mu, s = (pyro.param(k).detach().numpy() for k in ("W", "mu", "s"))
    ref = multivariate_normal(mu, W @ W.T + s**2 * np.eye(6)).logpdf(x.numpy())
    ev = heldout_evidence(model, None, x, num_samples=50, batch_size=16)
    assert ev["method"] == "exact" and ev["mc_stderr"] == 0 and math.isnan(ev["khat_frac"])
    np.testing.assert_allclose(ev["values"].numpy(), ref, rtol=0, atol=1e-10)
    pyro.clear_param_store()
    vae = DeepVAE(8, 2, (4,), "bernoulli")
    xb = (torch.rand(5, 8, generator=torch.Generator().manual_seed(0)) > 0.5).double()
    ev = heldout_evidence(vae.model, vae.guide, xb.to(torch.get_default_dtype()), num_samples=30)
    assert ev["method"] == "importance" and ev["mc_stderr"] > 0
