"""Triggers of the docs/errors.md rows raised by curve, compare, vae, datasets."""

import builtins
import math
import sys

import numpy as np
import pytest
import torch

import pyro_mpt
import pyro_mpt.experiments.compare
import pyro_mpt.experiments.datasets
import pyro_mpt.masks
import pyro_mpt.experiments.vae
from pyro_mpt import MPTCurve


from error_triggers.registry import trigger

@trigger("curve-area-incomplete")
def _():
    MPTCurve(np.arange(1, 4), 3, np.array([-1.0, np.nan, -2.0]), np.zeros(3)).area()


@trigger("compare-spec-number")
def _():
    pyro_mpt.experiments.compare.make_loss("iwae:eight")


@trigger("compare-spec-particles")
def _():
    pyro_mpt.experiments.compare.make_loss("iwae:0")


@trigger("compare-spec-renyi-alpha-one")
def _():
    pyro_mpt.experiments.compare.make_loss("renyi:8:1")


@trigger("compare-mpt-encoder-unused")
def _():
    pyro_mpt.experiments.compare.make_loss("mpt:uniform:quadrature", mpt_encoder="mpt")


@trigger("compare-spec-type")
def _():
    pyro_mpt.experiments.compare.make_loss(3)


@trigger("compare-mpt-encoder")
def _():
    pyro_mpt.experiments.compare.make_loss("elbo", mpt_encoder="guide")


@trigger("compare-spec-conditionals")
def _():
    pyro_mpt.experiments.compare.make_loss("mpt:0.3:exact")


@trigger("compare-spec-unknown")
def _():
    pyro_mpt.experiments.compare.make_loss("kl")


@trigger("compare-unknown-loss-name")
def _():
    pyro_mpt.experiments.compare.Comparison([pyro_mpt.experiments.compare.RunResult("elbo")])["iwae"]


@trigger("compare-loss-diverged")
def _():
    from pyro.infer import Trace_ELBO

    class NaNLoss(Trace_ELBO):
        def loss_and_grads(self, model, guide, *args, **kwargs):
            return math.nan

    vae = pyro_mpt.experiments.vae.DeepVAE(3, 1, (4,))
    result = pyro_mpt.experiments.compare.compare(
        lambda: vae, torch.ones(4, 3), torch.ones(2, 3), {"nan": NaNLoss()}, epochs=1, eval_samples=2
    )
    # compare records the failure as "TypeName: message" instead of raising it:
    # re-raise the recorded type, so the row checks the library's exception type
    name, message = result["nan"].error.split(": ", 1)
    raise getattr(builtins, name)(message)


@trigger("compare-loss-exploded")
def _():
    train, test = pyro_mpt.experiments.datasets.load_dataset("digits", n_train=200, n_test=20)
    result = pyro_mpt.experiments.compare.compare(
        lambda: pyro_mpt.experiments.vae.DeepVAE(64), train, test, ["elbo"], epochs=1, lr=1e6, eval_samples=20
    )
    name, message = result["elbo"].error.split(": ", 1)  # recorded, as in compare-loss-diverged
    raise getattr(builtins, name)(message)


@trigger("vae-likelihood")
def _():
    pyro_mpt.experiments.vae.DeepVAE(3, likelihood="poisson")


@trigger("datasets-n-test")
def _():
    pytest.importorskip("sklearn")
    pyro_mpt.experiments.datasets.load_dataset("digits", n_test=5000)


@trigger("datasets-unknown")
def _():
    pyro_mpt.experiments.datasets.load_dataset("cifar")


@trigger("datasets-needs-sklearn")
def _():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sklearn.datasets", None)
        pyro_mpt.experiments.datasets.load_dataset("digits")


@trigger("datasets-needs-torchvision")
def _():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torchvision", None)
        pyro_mpt.experiments.datasets.load_dataset("mnist")


