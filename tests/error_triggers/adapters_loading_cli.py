"""Triggers of the docs/errors.md rows raised by adapters: loading and CLI."""

import contextlib
import io
import os
import sys
import types
from pathlib import Path

import pytest

import pyro_mpt
import pyro_mpt.experiments.compare
import pyro_mpt.experiments.datasets
import pyro_mpt.masks
import pyro_mpt.experiments.vae


from error_triggers.registry import trigger
from error_triggers.common import _bert, _mae, _tmpdir


@contextlib.contextmanager
def _offline():
    """The hub and datasets offline within, as they were after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


def _loading():
    pytest.importorskip("transformers")
    from pyro_mpt.adapters import loading

    return loading


@trigger("load-unreachable")
def _():
    loading = _loading()
    with _offline():
        loading.load_masked_lm("no-such-org/no-such-model")


@trigger("load-antiberty-not-installed")
def _():
    loading = _loading()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "antiberty", None)
        loading.antiberty_paths()


@trigger("load-antiberty-incomplete")
def _():
    loading = _loading()
    fake = types.ModuleType("antiberty")
    fake.__file__ = str(Path(_tmpdir()) / "__init__.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "antiberty", fake)
        loading.antiberty_paths()


@trigger("load-tokenizer")
def _():
    _loading().load_tokenizer(None, model_dir=_tmpdir())


@trigger("load-model")
def _():
    loading = _loading()
    d = Path(_tmpdir())
    (d / "config.json").write_text("{}")
    loading.load_masked_lm(str(d))


@trigger("load-vit-mae")
def _():
    loading = _loading()
    d = Path(_tmpdir())
    (d / "config.json").write_text('{"model_type": "vit_mae"}')
    loading.load_vit_mae(str(d))


@trigger("load-missing-weights")
def _():
    import transformers

    loading = _loading()
    d = _tmpdir()
    model, tok = _bert(d)
    transformers.BertModel(model.config).save_pretrained(d)  # the encoder alone: no masked-LM head
    tok.save_pretrained(d)
    loading.load_masked_lm(d, quiet=True)


@trigger("load-model-kind")
def _():
    loading = _loading()
    d = _tmpdir()
    model, tok = _bert(d)
    model.save_pretrained(d)
    loading.load_vit_mae(d, random_init=True)


@trigger("load-image-processor-fallback")
def _():
    loading = _loading()
    d = _tmpdir()
    _mae().model.config.save_pretrained(d)
    loading.load_vit_mae(d, random_init=True)


@trigger("load-split-missing")
def _():
    datasets = pytest.importorskip("datasets")
    loading = _loading()
    d = str(Path(_tmpdir()) / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(d)
    loading.load_texts(dataset=d, split="validation")


def _load_data_file(name, text):
    pytest.importorskip("datasets")
    path = Path(_tmpdir()) / name
    path.write_text(text)
    _loading().load_texts(dataset=str(path))


@trigger("load-data-empty")
def _():
    _load_data_file("h.csv", "text\n")


@trigger("load-data-unreadable")
def _():
    _load_data_file("bad.parquet", "garbage")


@trigger("load-file-type")
def _():
    pytest.importorskip("datasets")
    loading = _loading()
    path = Path(_tmpdir()) / "data.xml"
    path.write_text("<a/>")
    loading.load_texts(dataset=str(path))


@trigger("load-dataset-unreachable")
def _():
    pytest.importorskip("datasets")
    loading = _loading()
    with _offline():
        loading.load_texts(dataset="no-such-org/no-such-dataset")


@trigger("load-missing-package")
def _():
    loading = _loading()
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "datasets", None)  # what an environment without it imports
    try:
        loading.load_texts(dataset=_csv("text\na\n"))
    finally:
        mp.undo()


@trigger("accelerate-missing")
def _():
    from pyro_mpt.adapters.batching import resolve_accelerator

    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "accelerate", None)  # what an environment without it imports
    try:
        resolve_accelerator(True)
    finally:
        mp.undo()


@trigger("load-one-text-source")
def _():
    _loading().load_texts()


@trigger("load-text-file-missing")
def _():
    _loading().load_texts(text_file=str(Path(_tmpdir()) / "missing.txt"))


def _csv(text):
    path = Path(_tmpdir()) / "data.csv"
    path.write_text(text)
    return str(path)


@trigger("load-no-text-column")
def _():
    pytest.importorskip("datasets")
    _loading().load_texts(dataset=_csv("label,score\n1,2\n"))


@trigger("load-column-missing")
def _():
    pytest.importorskip("datasets")
    _loading().load_texts(dataset=_csv("text,label\na,1\n"), columns=["sentence"])


@trigger("load-one-image-source")
def _():
    _loading().load_images()


@trigger("load-image-folder-missing")
def _():
    _loading().load_images(image_folder=str(Path(_tmpdir()) / "missing"))


@trigger("load-no-images")
def _():
    _loading().load_images(image_folder=_tmpdir())


@trigger("load-image-column-not-images")
def _():
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    d = str(Path(_tmpdir()) / "ds")
    images = [Image.new("RGB", (8, 8)) for _ in range(2)]
    ds = datasets.Dataset.from_dict({"img": images, "label": [0, 1]}).cast_column("img", datasets.Image())
    ds.save_to_disk(d)
    _loading().load_images(dataset=d, column="label")  # the CLI's mae-curve --column label


@trigger("load-image-column")
def _():
    datasets = pytest.importorskip("datasets")
    d = str(Path(_tmpdir()) / "ds")
    datasets.Dataset.from_dict({"img": [0]}).save_to_disk(d)
    _loading().load_images(dataset=d)


def _cli(argv):
    """Run ``pyro-mpt argv``; turn its exit (status 2, message on stderr) into SystemExit(message)."""
    pytest.importorskip("transformers")
    from pyro_mpt.experiments.cli import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run(argv)
        except SystemExit as e:
            assert e.code == 2, e.code
            raise SystemExit(err.getvalue()) from None


@trigger("cli-sigma2")
def _():
    _cli(["mae-curve", "model", "--image-folder", _tmpdir(), "--sigma2", "big"])


@trigger("cli-image-unreadable")
def _():
    folder = _tmpdir()
    with open(os.path.join(folder, "0.png"), "wb") as f:
        f.write(b"not a png at all")
    _cli(["mae-curve", "model", "--image-folder", folder])


@trigger("cli-device")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--device", "gpu"])


@trigger("cli-output-is-folder")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--json", _tmpdir()])


@trigger("cli-output-unwritable")
def _():
    blocker = Path(_tmpdir()) / "a-file"
    blocker.write_text("")
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--json", str(blocker / "r.json")])


@trigger("cli-plot-format")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--plot", str(Path(_tmpdir()) / "curve.txt")])


@trigger("cli-resource-unavailable")
def _():
    text = Path(_tmpdir()) / "t.txt"
    text.write_text("a b\n")
    with _offline():
        _cli(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(text), "--no-plot"])


@trigger("cli-empty-input")
def _():
    d = Path(_tmpdir())
    model, tok = _bert(d)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    text = d / "t.txt"
    text.write_text("\n\n")
    _cli(["mlm-curve", str(d), "--text-file", str(text), "--no-plot"])


@trigger("cli-positive-int")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--num-masks", "0"])


@trigger("cli-positive-float")
def _():
    _cli(["compare", "--lr", "0"])


@trigger("cli-seed")
def _():
    _cli(["compare", "--seed", "-1"])


@trigger("cli-n-train")
def _():
    _cli(["compare", "--n-train", "5000", "--losses", "elbo"])


@trigger("cli-seed-curve")
def _():
    _cli(["mlm-curve", "model", "--text-file", "t.txt", "--seed", "-1"])


@trigger("cli-compare-failed")
def _():
    from pyro_mpt.experiments.cli import run

    mp = pytest.MonkeyPatch()
    mp.setattr(pyro_mpt.experiments.compare, "heldout_evidence", lambda *a, **k: 1 / 0)  # fails after training
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run(["compare", "--n-train", "8", "--n-test", "4", "--epochs", "1", "--hidden", "4", "--losses", "elbo",
                  "--quiet"])
    except SystemExit as e:
        assert e.code == 1, e.code
        raise SystemExit(err.getvalue()) from None
    finally:
        mp.undo()




@trigger("cli-dataset-option-without-dataset")
def _():
    _cli(["mlm-curve", "no-such-org/no-such-model", "--text-file", "t.txt", "--split", "test"])


@trigger("cli-dataset-file-split")
def _():
    path = Path(_tmpdir()) / "ab.csv"
    path.write_text('seq,label\n"E V Q L",1\n')
    _cli(["mlm-curve", "no-such-org/no-such-model", "--dataset", str(path), "--split", "test"])


@trigger("load-texts-column-not-text")
def _():
    pytest.importorskip("datasets")
    path = Path(_tmpdir()) / "ab.csv"
    path.write_text('seq,label\n"E V Q L",1\n')
    _loading().load_texts(dataset=str(path), columns=["seq", "label"])


@trigger("load-tokenizer-unreachable")
def _():
    loading = _loading()
    with _offline():
        loading.load_tokenizer("/nonexist/vocab.txt")


@trigger("cli-dataset-config-saved")
def _():
    datasets = pytest.importorskip("datasets")
    d = str(Path(_tmpdir()) / "ds")
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(d)
    _cli(["mlm-curve", "no-such-org/no-such-model", "--dataset", d, "--dataset-config", "cola"])
