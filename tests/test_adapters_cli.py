"""`pyro-mpt mlm-curve` / `mae-curve`: end to end on local tiny models, and the offline error path."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from pyro_mpt.experiments.cli import main, run  # noqa: E402

from models import ROOT, TINY_VOCAB, tiny_bert, tiny_vit_mae  # noqa: E402


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_bert")
    model, tok = tiny_bert(d, hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    texts = d / "texts.txt"
    texts.write_text("a b c d e\n\nj i h g\nc c c\n")  # the blank line is skipped
    return d, texts


def test_mlm_curve_end_to_end(bert_dir, tmp_path, capsys):
    d, texts = bert_dir
    js, png = tmp_path / "out.json", tmp_path / "out.png"
    out = run(["mlm-curve", str(d), "--text-file", str(texts), "--rates", "0.1:0.9:0.2", "--num-masks", "2",
                "--scores", "uniform", "pll", "--score-masks", "3", "--max-tokens", "64", "--device", "cpu",
                "--json", str(js), "--plot", str(png)])
    assert png.stat().st_size > 1000
    data = json.loads(js.read_text())
    assert data["num_sequences"] == 3 and data["rates"] == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert len(data["score"]) == len(data["stderr"]) == 5 and data["table2_area"] is None
    assert set(data["per_sequence"]) == {"curve_area", "num_tokens", "score_uniform", "pll"}
    assert data["per_sequence"]["num_tokens"] == [5, 4, 3]
    # the library gives the same numbers
    from pyro_mpt.adapters import MaskedLMScorer

    model = transformers.BertForMaskedLM.from_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    lines = ["a b c d e", "j i h g", "c c c"]
    scorer = MaskedLMScorer(model, tok)
    curve = scorer.curve(lines, rates=[0.1, 0.3, 0.5, 0.7, 0.9], num_masks=2)
    assert data["area"] == pytest.approx(curve.area(), rel=1e-12)
    np.testing.assert_allclose(data["per_sequence"]["pll"], scorer.pll(lines).numpy())
    assert out["area"] == data["area"]
    assert "area" in capsys.readouterr().out


def test_mlm_curve_paper_grid_reports_table2(bert_dir, tmp_path):
    d, texts = bert_dir
    js = tmp_path / "t2.json"
    assert main(["mlm-curve", str(d), "--text-file", str(texts), "--scores", "--no-plot", "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert len(data["rates"]) == 99
    assert data["table2_area"] == pytest.approx(sum(data["score"]) * 0.01 * 512)
    assert set(data["per_sequence"]) == {"curve_area", "num_tokens"}


def test_offline_errors_are_fast_and_clear(bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    d, texts = bert_dir
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as err:
        run(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(texts), "--json", str(tmp_path / "x.json")])
    assert err.value.code == 2 and time.perf_counter() - t0 < 3.0
    msg = capsys.readouterr().err
    assert "no-such-org/no-such-model" in msg and "HF_HUB_OFFLINE" in msg and "local directory" in msg
    assert not (tmp_path / "x.json").exists()
    if importlib.util.find_spec("datasets") is not None:  # without it: the test below
        with pytest.raises(SystemExit) as err:
            run(["mlm-curve", str(d), "--dataset", "glue", "--dataset-config", "cola", "--split", "validation"])
        assert err.value.code == 2
        msg = capsys.readouterr().err
        assert "'glue'" in msg and "--text-file" in msg and "save_to_disk" in msg
    with pytest.raises(SystemExit) as err:
        run(["mae-curve", "facebook/vit-mae-base", "--image-folder", str(tmp_path)])
    assert err.value.code == 2  # no images in the folder
    assert "No images" in capsys.readouterr().err


def test_mae_curve_end_to_end(tmp_path):
    from PIL import Image

    model_dir = tmp_path / "mae"
    tiny_vit_mae(image_size=16, hidden_size=32, intermediate_size=64, decoder_hidden_size=16,
                 decoder_intermediate_size=32).save_pretrained(model_dir)
    transformers.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(model_dir)
    images = tmp_path / "images" / "sub"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(images / f"{i}.png")
    js, png = tmp_path / "mae.json", tmp_path / "mae.png"
    assert main(["mae-curve", str(model_dir), "--image-folder", str(tmp_path / "images"), "--rates", "0.25,0.5,0.75",
                 "--sigma2", "mle", "--json", str(js), "--plot", str(png)]) == 0
    data = json.loads(js.read_text())
    assert data["num_images"] == 3 and data["num_patches"] == 16 and data["rates"] == [0.25, 0.5, 0.75]
    assert len(data["per_image"]["mse"]) == 3 and png.stat().st_size > 1000
    assert len(data["per_image"]["file"]) == 3 and all(os.path.isfile(f) for f in data["per_image"]["file"])
    assert data["sigma2"] == pytest.approx(np.mean(data["per_image"]["mse"]))


def test_main_returns_the_exit_status(capsys):
    """main() returns 0, 2 or 1, as its docstring and docs/cli.rst say (it raised SystemExit,
    so that rc = main([...]) in a script failed on every error); run() raises."""
    assert main(["compare", "--epochs", "0"]) == 2
    assert "--epochs" in capsys.readouterr().err
    assert main(["mae-curve", "--help"]) == 0
    with pytest.raises(SystemExit) as err:
        run(["compare", "--epochs", "0"])
    assert err.value.code == 2


def test_main_returns_2_for_an_unreadable_image_and_1_for_an_unexpected_error(tmp_path, capsys, monkeypatch):
    """A file in --image-folder that is no image: PIL's UnidentifiedImageError came out of main()
    after the model had loaded; it is now a usage error (2) naming the file, before any model
    loads. An unexpected error: its traceback on stderr and status 1, returned."""
    (tmp_path / "0.png").write_bytes(b"not a png at all")
    assert main(["mae-curve", "no-such-org/no-such-model", "--image-folder", str(tmp_path), "--no-plot"]) == 2
    assert "0.png" in capsys.readouterr().err
    import pyro_mpt.experiments.cli as cli

    monkeypatch.setattr(cli, "run", lambda argv=None: 1 / 0)
    assert cli.main(["compare"]) == 1
    assert "ZeroDivisionError" in capsys.readouterr().err


def test_mae_curve_fills_zero_position_embeddings_on_request(tmp_path):
    """A checkpoint saved with zero position embeddings (built from a config by transformers 5):
    the command warned and a user of the command line could not call init_position_embeddings;
    --init-position-embeddings fills them (no warning) and changes the scores."""
    from PIL import Image

    model = tiny_vit_mae(init=False, image_size=16, hidden_size=32, intermediate_size=64, decoder_hidden_size=16,
                         decoder_intermediate_size=32)
    if model.vit.embeddings.position_embeddings.any():
        pytest.skip("this transformers version initializes the position embeddings itself")
    model_dir = tmp_path / "mae"
    model.save_pretrained(model_dir)
    transformers.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(model_dir)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(images / f"{i}.png")
    argv = ["mae-curve", str(model_dir), "--image-folder", str(images), "--rates", "0.5", "--no-plot"]
    with pytest.warns(UserWarning, match="--init-position-embeddings"):
        zero = run([*argv, "--json", str(tmp_path / "zero.json")])
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*position embeddings")
        filled = run([*argv, "--init-position-embeddings", "--json", str(tmp_path / "filled.json")])
    assert filled["per_image"]["mse"] != zero["per_image"]["mse"]


def test_help_reads_well(capsys):
    for cmd in ("mlm-curve", "mae-curve"):
        with pytest.raises(SystemExit) as err:
            run([cmd, "--help"])
        assert err.value.code == 0
        text = capsys.readouterr().out
        assert "examples:" in text and "--rates" in text and "--json" in text


# ---------------------------------------------------------------------- the console script
def _console_script():
    """The installed ``pyro-mpt`` (next to this interpreter, else on PATH)."""
    path = Path(sys.executable).with_name("pyro-mpt")
    path = str(path) if path.exists() else shutil.which("pyro-mpt")
    if path is None:
        pytest.skip("the pyro-mpt console script is not installed (pip install -e .)")
    return path


def _pyro_mpt(*argv, cwd, first=None):
    """Run the console script as a user's shell does: a subprocess importing this checkout
    (and, with ``first``, that folder's modules ahead of every installed one)."""
    path = [str(p) for p in (first, ROOT) if p is not None] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", MPLBACKEND="Agg")
    return subprocess.run([_console_script(), *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_console_script_exit_statuses(bert_dir, tmp_path):
    """0 on success with the summary on stdout and nothing of the result on stderr; 2 on a
    usage error with one line on stderr; non-zero (1) when the run fails."""
    d, texts = bert_dir
    js = tmp_path / "ok.json"
    ok = _pyro_mpt("mlm-curve", d, "--text-file", texts, "--rates", "0.2,0.6", "--scores", "--no-plot",
                   "--json", js, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "3 sequences, 2 rates: area" in ok.stdout and f"wrote {js}" in ok.stdout
    assert "{" not in ok.stderr and "Traceback" not in ok.stderr  # the result dict is not printed there
    assert json.loads(js.read_text())["num_sequences"] == 3
    # usage error: parsed before anything is loaded (the model name does not even exist)
    bad = _pyro_mpt("mlm-curve", "no-such-org/no-such-model", "--text-file", texts, "--num-masks", "0", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "argument --num-masks: must be a positive integer, got '0'" in bad.stderr and "Traceback" not in bad.stderr
    # an unexpected failure inside the run: Python's traceback and status 1
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "bert", "vocab_size": "many"}')
    fail = _pyro_mpt("mlm-curve", tmp_path / "broken", "--tokenizer", d, "--text-file", texts, "--rates", "0.5",
                     "--no-plot", "--json", js, cwd=tmp_path)
    assert fail.returncode == 1 and "Traceback" in fail.stderr


def test_dataset_without_the_datasets_package_is_a_usage_error(bert_dir, tmp_path):
    """A user without the hf extras' ``datasets`` who passes --dataset: status 2 and one message
    naming the package, its install command and the way around it, no traceback (before, a
    bare ModuleNotFoundError traceback). ``datasets`` is shadowed by a module that fails to import."""
    d, texts = bert_dir
    shadow = tmp_path / "shadow" / "datasets"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("no datasets here (a test shadow)")\n')
    csv = tmp_path / "d.csv"
    csv.write_text("text\nACDEF\n")
    out = _pyro_mpt("mlm-curve", d, "--dataset", csv, "--no-plot", cwd=tmp_path, first=shadow.parent)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "needs the 'datasets' package" in out.stderr and "pip install 'pyro-mpt[hf]'" in out.stderr
    assert "--text-file" in out.stderr
    # the same run with its text given as a file needs no datasets
    ok = _pyro_mpt("mlm-curve", d, "--text-file", texts, "--rates", "0.5", "--scores", "--no-plot", cwd=tmp_path,
                   first=shadow.parent)
    assert ok.returncode == 0, ok.stderr


def test_main_returns_zero_and_run_the_result(bert_dir, tmp_path):
    d, texts = bert_dir
    argv = ["mlm-curve", str(d), "--text-file", str(texts), "--rates", "0.5", "--scores", "--no-plot",
            "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    assert run(argv)["num_sequences"] == 3


@pytest.mark.parametrize("flag", ["--num-masks", "--max-tokens", "--score-masks", "--limit", "--threads"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_counts_are_refused_before_loading(flag, value, tmp_path, capsys):
    """Refused at parse time: the model named here does not exist, and is never looked up."""
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as err:
        run(["mlm-curve", "no-such-org/no-such-model", "--text-file", "missing.txt", flag, value])
    assert err.value.code == 2 and time.perf_counter() - t0 < 1.0
    assert f"argument {flag}: must be a positive integer, got '{value}'" in capsys.readouterr().err


def test_mae_batch_size_zero_is_refused(capsys):
    with pytest.raises(SystemExit) as err:
        run(["mae-curve", "no-such-org/no-such-model", "--image-folder", ".", "--batch-size", "0"])
    assert err.value.code == 2
    assert "argument --batch-size: must be a positive integer, got '0'" in capsys.readouterr().err


def test_empty_input_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """An empty text file is reported as such although the model (offline, unknown) could not load."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SystemExit) as err:
        run(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(empty)])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert f"no sequences to score: --text-file '{empty}' is empty" in msg and "no-such-model" not in msg


def test_empty_or_unreadable_data_is_a_usage_error_naming_it(bert_dir, tmp_path, capsys):
    """--dataset with a zero-byte CSV: a 62-line DatasetGenerationError traceback (exit 1); with a
    header-only CSV: datasets' 'Instruction "train" corresponds to no data!'; with a DatasetDict
    folder one of whose splits (not even the one asked for) has no rows: an IndexError traceback.
    Now one line naming the file, folder or split and what to do, before the model loads (the
    model named does not exist); the DatasetDict's other splits are read."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "zero.csv").write_text("")
    (tmp_path / "header.csv").write_text("text\n")
    (tmp_path / "bad.parquet").write_text("not parquet")
    t = datasets.Dataset.from_dict({"text": ["a b c", "d e"]})
    datasets.DatasetDict({"validation": t, "test": t.select([])}).save_to_disk(tmp_path / "dd")
    capsys.readouterr()
    cases = (
        (["--dataset", "zero.csv"], "The data file 'zero.csv' has no rows; give a file with at least one row of data, "
                                    "or another --dataset."),
        (["--dataset", "header.csv"], "The data file 'header.csv' has no rows (only a header); give a file"),
        (["--dataset", "dd", "--split", "test"],
         "Split 'test' of 'dd' has no rows; pass --split with one that has rows: ['validation']."),
        (["--dataset", "bad.parquet"], "Cannot read the data file 'bad.parquet' (ArrowInvalid: "),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        for data, line in cases:
            with pytest.raises(SystemExit) as err:
                run(["mlm-curve", "no-such-org/no-such-model", *data, "--no-plot"])
            out = capsys.readouterr()
            assert err.value.code == 2, out.err
            assert out.err.startswith(f"pyro-mpt: error: {line}") and out.err.count("\n") == 1, out.err
        assert main(["mlm-curve", str(bert_dir[0]), "--dataset", "dd", "--rates", "0.5", "--no-plot"]) == 0
    assert json.loads((tmp_path / "mlm-curve.json").read_text())["num_sequences"] == 2


def test_split_and_config_of_a_saved_dataset_that_has_none_are_refused(bert_dir, tmp_path, capsys):
    """--split and --dataset-config with the folder of one saved Dataset (one table) were ignored,
    the whole table scored, and the JSON recorded them as applied; --dataset-config with a
    DatasetDict's folder (splits, no configs) likewise. Now usage errors before the model loads;
    without them the table is read and the JSON records no split."""
    datasets = pytest.importorskip("datasets")
    t = datasets.Dataset.from_dict({"text": ["a b c", "d e"]})
    t.save_to_disk(tmp_path / "one")
    datasets.DatasetDict({"validation": t}).save_to_disk(tmp_path / "dd")
    capsys.readouterr()
    cases = (
        (["one", "--split", "test"], "--split chooses within a hub dataset or a DatasetDict's save_to_disk() folder; "
         f"the Dataset that save_to_disk() wrote in '{tmp_path / 'one'}' is one table, so it would be ignored: leave it out."),
        (["one", "--dataset-config", "x", "--split", "test"], "--dataset-config and --split choose within"),
        (["dd", "--dataset-config", "x"], "--dataset-config chooses a configuration of a hub dataset; the DatasetDict "
         f"that save_to_disk() wrote in '{tmp_path / 'dd'}' has none, so it would be ignored: leave it out (--split "
         "chooses among its splits)."),
    )
    for (folder, *extra), line in cases:
        with pytest.raises(SystemExit) as err:
            run(["mlm-curve", "no-such-org/no-such-model", "--dataset", str(tmp_path / folder), *extra, "--no-plot"])
        out = capsys.readouterr()
        assert err.value.code == 2 and out.err.startswith(f"pyro-mpt: error: {line}"), out.err
    js = tmp_path / "r.json"
    assert main(["mlm-curve", str(bert_dir[0]), "--dataset", str(tmp_path / "one"), "--rates", "0.5", "--no-plot",
                 "--json", str(js)]) == 0
    data = json.loads(js.read_text())["data"]
    assert data["split"] is None and data["config"] is None and data["column"] == ["text"]


def test_a_plot_path_without_extension_reports_the_file_written(bert_dir, tmp_path, capsys):
    """--plot out/curve printed 'wrote out/curve' while matplotlib wrote out/curve.png."""
    d, texts = bert_dir
    plot = tmp_path / "out" / "curve"
    assert main(["mlm-curve", str(d), "--text-file", str(texts), "--rates", "0.5", "--plot", str(plot),
                 "--json", str(tmp_path / "r.json")]) == 0
    assert f"wrote {plot}.png\n" in capsys.readouterr().out
    assert os.listdir(tmp_path / "out") == ["curve.png"]


def test_the_documented_antibodies_file_is_made_and_read_by_antiberty(tmp_path, capsys):
    """cli.rst and adapters.md ran `--text-file antibodies.txt`, a file that does not ship, in a
    format they did not give. The command they now give, run as written, makes it: 12 chains of
    space-separated residues, which AntiBERTy reads without unknown tokens."""
    pytest.importorskip("antiberty")
    import re

    commands = [re.findall(r"^ *(python -c .* > antibodies\.txt)$", (ROOT / "docs" / doc).read_text(), re.M)
                for doc in ("cli.rst", "adapters.md")]
    assert commands[0] == commands[1] and len(commands[0]) == 1, commands
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               PYTHONPATH=str(ROOT))
    subprocess.run(["bash", "-c", commands[0][0]], cwd=tmp_path, env=env, check=True, timeout=60)
    lines = (tmp_path / "antibodies.txt").read_text().splitlines()
    assert len(lines) == 12 and lines[0].startswith("E V Q L V E S G G G L V Q P G G ")
    js = tmp_path / "ab.json"
    assert main(["mlm-curve", "antiberty", "--text-file", str(tmp_path / "antibodies.txt"), "--limit", "2",
                 "--rates", "0.5", "--no-plot", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["per_sequence"]["num_tokens"][0] == len(lines[0].split())


def test_model_dir_without_tokenizer_is_refused(tmp_path, capsys):
    """transformers gives a directory without tokenizer files a 5-token tokenizer (special tokens
    only), which would turn every residue into [UNK]: refused, naming both vocabulary sizes."""
    model, _ = tiny_bert(hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    model.save_pretrained(tmp_path / "m")
    texts = tmp_path / "t.txt"
    texts.write_text("a b c\n")
    with pytest.raises(SystemExit) as err:
        run(["mlm-curve", str(tmp_path / "m"), "--text-file", str(texts), "--no-plot"])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert f"has 5 tokens but the model's vocabulary (config.vocab_size) has {len(TINY_VOCAB)}" in msg
    assert "--tokenizer" in msg
    # the same model with its vocabulary given runs
    (tmp_path / "vocab.txt").write_text("\n".join(TINY_VOCAB) + "\n")
    assert main(["mlm-curve", str(tmp_path / "m"), "--tokenizer", str(tmp_path / "vocab.txt"), "--text-file",
                 str(texts), "--rates", "0.5", "--scores", "--no-plot", "--json", str(tmp_path / "o.json")]) == 0


def test_unknown_residues_exit_2_with_the_reason(bert_dir, tmp_path, capsys):
    d, _ = bert_dir
    texts = tmp_path / "upper.txt"
    texts.write_text("a b c\nA B C\n")  # the tiny vocabulary is lower case
    with pytest.raises(SystemExit) as err:
        run(["mlm-curve", str(d), "--text-file", str(texts), "--no-plot"])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert "Sequence 1 has no maskable token: all its 3 token(s) are the unknown token '[UNK]'" in msg


def test_a_data_file_records_its_column_and_refuses_splits_and_columns_that_are_not_text(bert_dir, tmp_path):
    """Through the console script, a CSV --dataset: without --column the text column is chosen
    and recorded in the JSON (before: "column": null) with no split (before: "validation",
    which a file has not); --split or --dataset-config, which a file cannot honour, and a
    column of integers (before: a traceback, exit 1) are usage errors: exit 2, one line."""
    pytest.importorskip("datasets")
    d, _ = bert_dir
    csv = tmp_path / "ab.csv"
    csv.write_text('label,seq\n1,"a b c"\n0,"d e f g"\n')
    js = tmp_path / "r.json"
    ok = _pyro_mpt("mlm-curve", d, "--dataset", csv, "--rates", "0.5", "--no-plot", "--json", js, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    data = json.loads(js.read_text())
    assert data["data"]["column"] == ["seq"] and data["data"]["split"] is None and data["num_sequences"] == 2
    for extra, needle in ((["--split", "test"], "--split chooses within a hub dataset"),
                          (["--dataset-config", "x"], "--dataset-config chooses within a hub dataset"),
                          (["--column", "seq", "label"], "Column 'label' of"),
                          # three columns: a traceback (exit 1) of the tokenizer's call after the model loaded
                          (["--column", "seq", "label", "seq"], "--column (load_texts(columns=...)) takes one text column")):
        bad = _pyro_mpt("mlm-curve", d, "--dataset", csv, "--rates", "0.5", "--no-plot", *extra, cwd=tmp_path)
        assert bad.returncode == 2, bad.stderr
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], bad.stderr


def test_output_folders_are_created_and_unwritable_outputs_refused_before_the_run(bert_dir, tmp_path):
    """A run must not fail at its last line: --json / --plot folders are created up front, and a
    path that cannot be written is a usage error before anything is loaded (the model named in
    the refused runs does not exist)."""
    d, texts = bert_dir
    js, png = tmp_path / "results" / "cola" / "r.json", tmp_path / "figures" / "r.png"
    ok = _pyro_mpt("mlm-curve", d, "--text-file", texts, "--rates", "0.5", "--scores", "--json", js, "--plot", png,
                   cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(js.read_text())["num_sequences"] == 3 and png.stat().st_size > 1000
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    under_file = _pyro_mpt("mlm-curve", "no-such-org/no-such-model", "--text-file", texts,
                           "--json", blocker / "r.json", cwd=tmp_path)
    assert under_file.returncode == 2 and "Traceback" not in under_file.stderr
    assert f"--json '{blocker / 'r.json'}': cannot write in its folder '{blocker}'" in under_file.stderr
    folder = _pyro_mpt("mae-curve", "no-such-org/no-such-model", "--image-folder", tmp_path,
                       "--plot", tmp_path, cwd=tmp_path)
    assert folder.returncode == 2 and f"--plot '{tmp_path}' is a folder; give a file path" in folder.stderr
    # an extension matplotlib cannot write: refused before the run, not after it (exit 1, a traceback)
    text_plot = _pyro_mpt("mlm-curve", "no-such-org/no-such-model", "--text-file", texts,
                          "--plot", tmp_path / "curve.txt", cwd=tmp_path)
    assert text_plot.returncode == 2 and "Traceback" not in text_plot.stderr
    assert "matplotlib cannot write .txt files; give a path ending in one of" in text_plot.stderr


def test_device_and_sigma2_are_usage_errors(bert_dir, tmp_path):
    """Exit status 2 and one line naming the argument, before any model is loaded, instead of a
    traceback (status 1) once the model had loaded."""
    import torch

    _, texts = bert_dir
    devices = ["gpu"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        bad = _pyro_mpt("mlm-curve", "no-such-org/no-such-model", "--text-file", texts, "--device", device,
                        cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert f"pyro-mpt: error: --device '{device}' cannot be used on this machine" in bad.stderr
        assert "pass --device cpu" in bad.stderr
    for sigma2 in ["-1", "inf"]:
        bad = _pyro_mpt("mae-curve", "no-such-org/no-such-model", "--image-folder", tmp_path, "--sigma2", sigma2,
                        cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert f"--sigma2 must be a positive number or 'mle', got '{sigma2}'." in bad.stderr
    # rates out of (0, 1) or not increasing: the message speaks the command line's spec, not Python
    for spec in ["0:0.5:0.25", "0.5,0.2"]:
        bad = _pyro_mpt("mlm-curve", "no-such-org/no-such-model", "--text-file", texts, "--rates", spec, cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert f"pyro-mpt: error: Rates '{spec}' give" in bad.stderr and "np." not in bad.stderr


def test_one_sequence_reports_its_error_over_masks_or_none(bert_dir, tmp_path, capsys):
    """--limit 1: one mask gives an unknown error ('n/a', JSON null), not '+- 0.00'; several
    masks give the spread of the masks' areas / sqrt(K)."""
    from pyro_mpt.adapters.rates import rate_weights

    d, texts = bert_dir
    js = tmp_path / "one.json"
    base = ["mlm-curve", str(d), "--text-file", str(texts), "--limit", "1", "--rates", "0.2,0.6", "--scores",
            "--no-plot", "--json", str(js)]
    main(base)
    out = capsys.readouterr().out
    assert "1 sequences, 2 rates: area" in out and "+- n/a" in out
    data = json.loads(js.read_text())
    assert data["area_stderr"] is None and data["stderr"] == [None, None]
    main(base + ["--num-masks", "4"])
    assert "+- n/a" not in capsys.readouterr().out
    data = json.loads(js.read_text())
    from pyro_mpt.adapters import MaskedLMScorer

    scorer = MaskedLMScorer(transformers.BertForMaskedLM.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d))
    per_mask = scorer.curve(["a b c d e"], rates=[0.2, 0.6], num_masks=4).per_mask  # (rates, masks)
    areas = 5 * (rate_weights([0.2, 0.6]) @ per_mask)
    assert data["area_stderr"] == pytest.approx(areas.std(ddof=1) / 2, rel=1e-6)


def test_dataset_options_need_a_dataset_and_default_with_one(bert_dir, tmp_path, capsys):
    """--split / --dataset-config / --column beside --text-file (or --image-folder) were ignored:
    the file was scored as if they were not there. Now a usage error before the model loads;
    with a hub --dataset the split still defaults to validation; a csv has none (its one
    table is read, and the JSON records no split)."""
    d, texts = bert_dir
    for extra, names in ((["--split", "test"], "--split chooses"),
                         (["--column", "a", "b", "--dataset-config", "c"], "--dataset-config and --column choose")):
        with pytest.raises(SystemExit) as err:
            run(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(texts), *extra])
        assert err.value.code == 2
        msg = capsys.readouterr().err
        assert f"{names} what to read from --dataset; with --text-file" in msg and "no-such-model" not in msg
    with pytest.raises(SystemExit) as err:
        run(["mae-curve", "no-such-org/no-such-model", "--image-folder", str(tmp_path), "--split", "train"])
    assert err.value.code == 2 and "with --image-folder it would be ignored" in capsys.readouterr().err
    pytest.importorskip("datasets")
    csv = tmp_path / "d.csv"
    csv.write_text("text\na b c\nd e\n")
    js = tmp_path / "r.json"
    assert main(["mlm-curve", str(d), "--dataset", str(csv), "--rates", "0.5", "--scores", "--no-plot",
                 "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["num_sequences"] == 2 and data["data"]["split"] is None and data["data"]["column"] == ["text"]


def test_a_checkpoint_without_the_models_weights_is_refused(bert_dir, tmp_path):
    """An encoder saved without its masked-LM head (BertModel), loaded by mlm-curve: transformers
    drew the missing weights at random behind the quiet load, and the command printed scores that
    changed from run to run under one seed (exit 0). Now exit 2, naming the checkpoint and the
    missing weights; --random-init still runs. (A BERT checkpoint given to mae-curve is another
    kind of model: test_a_checkpoint_of_another_kind_is_refused_with_or_without_random_init.)"""
    import transformers

    d, texts = bert_dir
    enc = tmp_path / "encoder_only"
    model = transformers.BertForMaskedLM.from_pretrained(d)
    model.bert.save_pretrained(enc)
    transformers.BertTokenizer.from_pretrained(d).save_pretrained(enc)
    bad = _pyro_mpt("mlm-curve", enc, "--text-file", texts, "--rates", "0.5", "--no-plot", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert f"pyro-mpt: error: Checkpoint '{enc}' lacks weights of the" in bad.stderr
    assert "model_type 'bert'" in bad.stderr and "--random-init" in bad.stderr
    ok = _pyro_mpt("mlm-curve", enc, "--text-file", texts, "--rates", "0.5", "--no-plot", "--random-init",
                   "--json", tmp_path / "r.json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_a_checkpoint_of_another_kind_is_refused_with_or_without_random_init(bert_dir, tmp_path, capsys):
    """A BERT folder given to mae-curve: refused (exit 2) with the advice to pass --random-init,
    which then crashed (AttributeError: 'BertConfig' object has no attribute 'image_size', exit 1).
    Now one line naming the folder's model_type, the same with or without --random-init and
    without that advice; a ViT-MAE folder given to mlm-curve likewise (before: transformers'
    two-line 'Unrecognized configuration class' with the hint to point MODEL at a folder holding
    config.json, which it did)."""
    from PIL import Image

    d, texts = bert_dir
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (8, 8), (10, 200, 30)).save(images / "a.png")
    mae = tmp_path / "mae"
    tiny_vit_mae(image_size=16, hidden_size=32, intermediate_size=64, decoder_hidden_size=16,
                 decoder_intermediate_size=32).save_pretrained(mae)
    capsys.readouterr()  # the save's progress bar
    cases = ((["mae-curve", d, "--image-folder", images],
              f"pyro-mpt: error: Model '{d}' is a checkpoint of model_type 'bert', not a ViT-MAE (model_type 'vit_mae'), "
              "with or without random_init (--random-init, which keeps the checkpoint's architecture). "
              "Point MODEL at a ViT-MAE checkpoint."),
             (["mlm-curve", mae, "--text-file", texts],
              f"pyro-mpt: error: Model '{mae}' is a checkpoint of model_type 'vit_mae', not a masked LM (model_type "
              "'albert', 'bart', 'bert', ... ("))
    for argv, line in cases:
        for extra in ([], ["--random-init"]):
            with pytest.raises(SystemExit) as err:
                run([*map(str, argv), *extra, "--rates", "0.5", "--no-plot", "--json", str(tmp_path / "x.json")])
            out = capsys.readouterr()
            assert err.value.code == 2 and out.out == "", out.err
            lines = out.err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(line), out.err
    assert not (tmp_path / "x.json").exists()


def test_mae_curve_column_of_labels_is_a_usage_error_before_the_model_loads(tmp_path):
    """mae-curve --column naming a column of integers: a transformers TypeError traceback,
    exit 1, after the model had loaded. Now exit 2 with one line naming the column, what it
    holds and the image columns; the model named here does not exist, so nothing was loaded."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    ds = datasets.Dataset.from_dict({"img": [Image.new("RGB", (8, 8))] * 3, "label": [2, 0, 1]})
    datasets.DatasetDict({"test": ds.cast_column("img", datasets.Image())}).save_to_disk(tmp_path / "ds")
    bad = _pyro_mpt("mae-curve", "no-such-org/no-such-model", "--dataset", tmp_path / "ds", "--column", "label",
                    "--rates", "0.5", "--no-plot", "--json", tmp_path / "x.json", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"pyro-mpt: error: Column 'label' of '{tmp_path / 'ds'}' holds int64 values (int 2 at row 0), not images; "
        f"pass --column with one of its image columns ['img']."]
    assert not (tmp_path / "x.json").exists()


def test_a_bare_vocab_file_is_read_alike_from_the_model_directory_and_as_tokenizer(tmp_path):
    """A model directory whose only tokenizer file is an upper-case vocab.txt (AntiBERTy's kind):
    `mlm-curve DIR` lower-cased it (transformers' BERT default), turning 'E V Q L' into [UNK]s
    and telling the user to write upper case, while `--tokenizer DIR/vocab.txt` kept the case.
    Now both keep it and give the same numbers; --lowercase forces it, and the message then
    names the lower-casing and --no-lowercase."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "E", "V", "Q", "L", "S", "G"]
    d = tmp_path / "upper"
    model, _ = tiny_bert(vocab_size=len(vocab))
    model.save_pretrained(d)
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    texts = tmp_path / "t.txt"
    texts.write_text("E V Q L V E S G\nQ V Q L\n")
    common = ["--text-file", texts, "--rates", "0.3,0.7", "--scores", "pll", "--no-plot"]
    runs = {}
    for name, extra in (("dir", []), ("file", ["--tokenizer", d / "vocab.txt"]), ("dir-cased", ["--no-lowercase"])):
        out = _pyro_mpt("mlm-curve", d, *extra, *common, "--json", tmp_path / f"{name}.json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for name in ("file", "dir-cased"):
        assert runs[name]["score"] == runs["dir"]["score"]
        assert runs[name]["per_sequence"]["pll"] == runs["dir"]["per_sequence"]["pll"]
    assert runs["dir"]["per_sequence"]["num_tokens"] == [8, 4]
    for extra in ([], ["--tokenizer", d / "vocab.txt"]):
        bad = _pyro_mpt("mlm-curve", d, *extra, "--lowercase", *common, cwd=tmp_path)
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.strip().splitlines() == [
            "pyro-mpt: error: Sequence 0 has no maskable token: all its 8 token(s) are the unknown token '[UNK]', "
            "because the tokenizer lower-cases the text (do_lower_case=True) while its vocabulary of 11 tokens has "
            "the text's words as written ('E', 'V', 'Q', 'L'). Load the tokenizer with do_lower_case=False (on the "
            "command line: --no-lowercase)."]
    # an uncased (all lower-case) bare vocabulary is still lower-cased, from the directory or the file
    lower = tmp_path / "lower"
    model.save_pretrained(lower)
    (lower / "vocab.txt").write_text("\n".join(v if v.startswith("[") else v.lower() for v in vocab) + "\n")
    for extra in ([], ["--tokenizer", lower / "vocab.txt"]):
        ok = _pyro_mpt("mlm-curve", lower, *extra, *common, "--json", tmp_path / "l.json", cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr
        assert json.loads((tmp_path / "l.json").read_text())["per_sequence"]["pll"] == runs["dir"]["per_sequence"]["pll"]


def test_random_init_is_seeded_and_leaves_the_global_stream_alone(bert_dir):
    """load_masked_lm(random_init=True) initialized the weights after torch.manual_seed(seed),
    which left the caller's global stream reseeded; the weights are drawn on a stream of their
    own now: the same weights under one seed, other weights under another, the caller's state
    as it was."""
    import torch

    from pyro_mpt.adapters.loading import load_masked_lm

    d, _ = bert_dir
    torch.manual_seed(123)
    state = torch.get_rng_state()
    weights = [load_masked_lm(str(d), random_init=True, seed=s, quiet=True)[0].state_dict() for s in (0, 0, 1)]
    assert torch.equal(torch.get_rng_state(), state)
    name = next(k for k, v in weights[0].items() if v.dtype.is_floating_point and v.std() > 0)
    assert torch.equal(weights[0][name], weights[1][name]) and not torch.equal(weights[0][name], weights[2][name])
