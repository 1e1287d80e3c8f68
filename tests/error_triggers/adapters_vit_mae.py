"""Triggers of the docs/errors.md rows raised by adapters: ViT-MAE."""

import contextlib

import numpy as np
import pytest
import torch


from error_triggers.registry import trigger
from error_triggers.common import _mae


@trigger("mae-sigma2")
def _():
    _mae(sigma2=0.0)


@trigger("mae-batch-size")
def _():
    _mae(batch_size=0)


@trigger("mae-model-type")
def _():
    from pyro_mpt.adapters import MAEScorer

    MAEScorer(torch.nn.Linear(2, 2))


@trigger("mae-zero-position-embeddings")
def _():
    _mae(init=False)


@trigger("mae-image-batch-shape")
def _():
    _mae().curves(torch.zeros(3, 8, 8), rates=[0.5])


@trigger("mae-image-column")
def _():
    datasets = pytest.importorskip("datasets")
    _mae().curves(datasets.Dataset.from_dict({"img": [[0.0]]}), rates=[0.5])


@trigger("mae-needs-processor")
def _():
    _mae().curves([np.zeros((8, 8, 3))], rates=[0.5])


@trigger("mae-num-masked")
def _():
    scorer = _mae()
    scorer.reconstruction(torch.zeros(1, 3, 8, 8), 0, torch.arange(4)[None])


@trigger("mae-masks-not-honoured")
def _():
    scorer = _mae()
    scorer._keep_exactly = lambda num_kept: contextlib.nullcontext()  # a model that ignores the ratio
    scorer.reconstruction(torch.zeros(1, 3, 8, 8), 2, torch.arange(4)[None])


@trigger("mae-num-masks")
def _():
    _mae().curves(torch.zeros(1, 3, 8, 8), rates=[0.5], num_masks=0)


@trigger("mae-curve-kind")
def _():
    _mae().curve(torch.zeros(1, 3, 8, 8), rates=[0.5], kind="nll")




@trigger("mae-integer-pixels")
def _():
    pixels = torch.arange(2 * 3 * 8 * 8).reshape(2, 3, 8, 8) % 256
    _mae().curves(pixels.to(torch.uint8), rates=[0.5])
