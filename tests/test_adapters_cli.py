"""`pyro-mpt mlm-curve` / `mae-curve`: end to end on local tiny models, and the offline error path."""

import json
import time

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from pyro_mpt.cli import main  # noqa: E402

from models import tiny_bert, tiny_vit_mae  # noqa: E402


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
    out = main(["mlm-curve", str(d), "--text-file", str(texts), "--rates", "0.1:0.9:0.2", "--num-masks", "2",
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
    main(["mlm-curve", str(d), "--text-file", str(texts), "--scores", "--no-plot", "--json", str(js)])
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
        main(["mlm-curve", "no-such-org/no-such-model", "--text-file", str(texts), "--json", str(tmp_path / "x.json")])
    assert err.value.code == 2 and time.perf_counter() - t0 < 3.0
    msg = capsys.readouterr().err
    assert "no-such-org/no-such-model" in msg and "HF_HUB_OFFLINE" in msg and "local directory" in msg
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit) as err:
        main(["mlm-curve", str(d), "--dataset", "glue", "--dataset-config", "cola", "--split", "validation"])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert "'glue'" in msg and "--text-file" in msg and "save_to_disk" in msg
    with pytest.raises(SystemExit) as err:
        main(["mae-curve", "facebook/vit-mae-base", "--image-folder", str(tmp_path)])
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
    main(["mae-curve", str(model_dir), "--image-folder", str(tmp_path / "images"), "--rates", "0.25,0.5,0.75",
          "--sigma2", "mle", "--json", str(js), "--plot", str(png)])
    data = json.loads(js.read_text())
    assert data["num_images"] == 3 and data["num_patches"] == 16 and data["rates"] == [0.25, 0.5, 0.75]
    assert len(data["per_image"]["mse"]) == 3 and png.stat().st_size > 1000
    assert data["sigma2"] == pytest.approx(np.mean(data["per_image"]["mse"]))


def test_help_reads_well(capsys):
    for cmd in ("mlm-curve", "mae-curve"):
        with pytest.raises(SystemExit) as err:
            main([cmd, "--help"])
        assert err.value.code == 0
        text = capsys.readouterr().out
        assert "examples:" in text and "--rates" in text and "--json" in text
