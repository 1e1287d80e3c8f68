"""The engine guide's worked example (docs/snippets/latent_class_engine.py) runs, is exact,
and prints the numbers docs/engines.rst shows."""

import re

from models import ROOT, load_script


def _printed():
    """The two lines of output quoted in docs/engines.rst."""
    text = (ROOT / "docs" / "engines.rst").read_text(encoding="utf-8")
    gaps = re.search(r"\|sum_i score_i - log p\(x\)\|: \{'order': '(\S+)', 'exhaustive': '(\S+)'\}", text)
    lml = re.search(r"log p\(x\) per datapoint: (-?\d+\.\d+) at init, (-?\d+\.\d+) after MPT", text)
    assert gaps and lml, "docs/engines.rst no longer quotes the example's output"
    return [float(g) for g in gaps.groups()], lml.groups()


def test_latent_class_engine_prints_what_the_guide_says():
    (order, exhaustive), (before, after) = _printed()
    result = load_script("docs/snippets/latent_class_engine.py").main()  # the guide's run: 150 steps, seed 0
    # the chain rule and the exhaustive Proposition-1 sum reproduce Pyro's enumerated
    # log p(x) to rounding (300 datapoints, float64); the guide prints gaps of that size
    assert result["gaps"]["order"] < 1e-12 and result["gaps"]["exhaustive"] < 1e-12
    assert order < 1e-12 and exhaustive < 1e-12
    # the log-likelihood per datapoint before and after MPT, to the printed digits
    assert f"{result['log_px_before']:.3f}" == before and f"{result['log_px_after']:.3f}" == after
