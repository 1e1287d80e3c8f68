"""examples/gmm_hmm_mpt.py run as a subprocess in a shortened setting (seed 0).

A GMM and an HMM trained by MPT and by TraceEnum_ELBO from the same start: both
objectives are exact in expectation, so both fits must reach the same log-likelihood.
Thresholds are measured values (in the comments) with a margin.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gmm_hmm")
    png, result = out / "figs" / "gmm_hmm.png", out / "r.json"
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "examples", "gmm_hmm_mpt.py"), "--seed", "0",
           "--gmm-iters", "150", "--hmm-iters", "80", "--every", "25", "--out", str(png), "--json", str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(result) as f:
        return json.load(f), proc.stdout, png


def test_writes_the_table_and_a_png(run):
    _, stdout, png = run
    assert "GMM    MPT - TraceEnum_ELBO:" in stdout and "HMM    MPT - TraceEnum_ELBO:" in stdout
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000  # two panels of curves


def test_gmm_fits_reach_the_em_maximum(run):
    """measured: start -8.907; TraceEnum_ELBO -4.2501, sklearn EM -4.2501, MPT -4.2551 nats per point."""
    r, _, _ = run
    gmm = r["gmm"]
    start = gmm["MPT"]["curve"][0][1]
    assert start == gmm["TraceEnum_ELBO"]["curve"][0][1]
    assert gmm["TraceEnum_ELBO"]["final"] > start + 4
    if r["gmm_em"] is not None:
        assert abs(gmm["TraceEnum_ELBO"]["final"] - r["gmm_em"]) < 2e-3
    assert abs(gmm["MPT"]["final"] - gmm["TraceEnum_ELBO"]["final"]) < 0.02
    # the same clusters: sorted means within 0.15 of each other
    for a, b in zip(gmm["MPT"]["locs"], gmm["TraceEnum_ELBO"]["locs"]):
        assert max(abs(u - v) for u, v in zip(a, b)) < 0.15


def test_hmm_fits_agree(run):
    """measured: start -14.465; TraceEnum_ELBO -11.5960, MPT -11.5999 nats per sequence."""
    r, _, _ = run
    hmm = r["hmm"]
    start = hmm["MPT"]["curve"][0][1]
    assert hmm["TraceEnum_ELBO"]["final"] > start + 2.5
    assert abs(hmm["MPT"]["final"] - hmm["TraceEnum_ELBO"]["final"]) < 0.02
    assert max(abs(u - v) for u, v in zip(hmm["MPT"]["locs"], hmm["TraceEnum_ELBO"]["locs"])) < 0.1
