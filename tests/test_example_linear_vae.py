"""examples/linear_vae.py (paper Fig. 3, top) run in-process with --quick.

The quick setting (300 binarized digits, 30 full-batch epochs) is run once per
module; the checks hold whatever the library's random stream: MPT with
quadrature conditionals raises the quadrature LML well above the start, and its
objective tracks the LML. Thresholds are measured values with a margin.
"""

import builtins

import numpy as np
import pytest

from models import load_script


def _load_example():
    return load_script("examples/linear_vae.py")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("linear_vae") / "figs" / "fig3.png"
    results = _load_example().main(["--quick", "--no-progress", "--out", str(out)])
    return results, out


def test_writes_png(demo):
    _, out = demo
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000


def test_curves_and_final_lml(demo):
    results, _ = demo
    cfg = results["config"]
    assert cfg["dataset"] == "digits" and cfg["num_data"] == 300 and cfg["num_tokens"] == 64
    mpt, elbo = results["methods"]["MPT"], results["methods"]["ELBO"]
    for r, epochs in ((mpt, cfg["epochs"]), (elbo, cfg["elbo_epochs"])):
        assert r["objective"].shape == (epochs,)
        assert r["lml_epochs"][0] == 0 and r["lml_epochs"][-1] == epochs
        assert np.isfinite(r["lml"]).all() and np.isfinite(r["objective"]).all()
        assert r["lml_error"] < 0.05  # two-rule error estimate of the quadrature LML
    # both start from the same decoder
    assert mpt["lml"][0] == pytest.approx(elbo["lml"][0], abs=1e-4)
    # measured: -24.6 -> -22.1 nats per image in 30 epochs
    assert mpt["lml"][-1] - mpt["lml"][0] > 1.5
    # the negative MPT loss is an unbiased estimate of the LML (measured gap 0.5)
    assert abs(mpt["objective"][-10:].mean() - mpt["lml"][-1]) < 1.0
    # the ELBO runs longer (--elbo-epochs) and is evaluated as many times; a lower bound on the LML at the end
    assert cfg["elbo_epochs"] > cfg["epochs"] and len(elbo["lml_epochs"]) == len(mpt["lml_epochs"])
    assert elbo["objective"][-10:].mean() < elbo["lml"][-1] + 0.05


def test_mnist_without_torchvision_says_so(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_torchvision(name, *args, **kwargs):
        if name == "torchvision" or name.startswith("torchvision."):
            raise ImportError("No module named 'torchvision'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchvision)
    with pytest.raises(SystemExit) as info:
        _load_example().main(["--dataset", "mnist", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "torchvision" in err and "--dataset digits" in err


def test_torchvision_path_with_a_stand_in(monkeypatch, tmp_path):
    """MNIST / Fashion-MNIST go through torchvision.datasets (a stand-in here:
    the real package and the network may be missing)."""
    import sys
    import types

    import torch

    calls = []

    class FakeMNIST:
        def __init__(self, root, train=True, download=False):
            calls.append((type(self).__name__, root, train, download))
            g = torch.Generator().manual_seed(0)
            self.data = torch.randint(0, 256, (2500, 28, 28), generator=g, dtype=torch.uint8)

    class FakeFashionMNIST(FakeMNIST):
        pass

    class Offline:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=FakeMNIST, FashionMNIST=FakeFashionMNIST)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    example = _load_example()
    x = example.load_images("mnist", None, 0, str(tmp_path))
    assert x.shape == (2000, 784) and set(x.unique().tolist()) <= {0.0, 1.0}
    assert calls[-1] == ("FakeMNIST", str(tmp_path), True, True)
    x = example.load_images("fashion-mnist", 300, 0, str(tmp_path))
    assert x.shape == (300, 784) and calls[-1][0] == "FakeFashionMNIST"
    fake.datasets.MNIST = Offline
    with pytest.raises(example.DataUnavailable, match="could not load mnist.*--dataset digits"):
        example.load_images("mnist", None, 0, str(tmp_path))


def test_gallery_fig3_section(demo):
    """examples/gallery_training.py writes this run's numbers into docs/gallery/RESULTS.md (examples/gallery_report.py)."""
    gallery = load_script("examples/gallery_report.py")
    results, _ = demo
    text = gallery.linear_vae_markdown(results)
    for name, r in results["methods"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert f"{r['lml'][0]:.3f}" in row and f"{r['lml'][-1]:.3f}" in row
    assert "not comparable" in text  # digits, not the paper's MNIST
