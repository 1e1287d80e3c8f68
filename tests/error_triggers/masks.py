"""Triggers of the docs/errors.md rows raised by masks.py."""

import torch
import pyro
import pyro.distributions as dist

import pyro_mpt
import pyro_mpt.experiments.compare
import pyro_mpt.experiments.datasets
import pyro_mpt.masks
import pyro_mpt.experiments.vae
from pyro_mpt import MaskedPretrainingLoss


from error_triggers.registry import trigger
from error_triggers.common import _missing_ppca, _observed, _ppca, _x


@trigger("masks-num-masks")
def _():
    MaskedPretrainingLoss(num_masks=0)


@trigger("masks-num-masks-beside-instance")
def _():
    MaskedPretrainingLoss(masks=pyro_mpt.masks.UniformSizes(2), num_masks=8)


@trigger("masks-share-masks-beside-instance")
def _():
    MaskedPretrainingLoss(masks=pyro_mpt.masks.UniformSizes(2), share_masks=True)


@trigger("masks-share-masks-not-bool")
def _():
    MaskedPretrainingLoss(masks="all", share_masks="no")


@trigger("masks-flag-not-bool")
def _():
    from pyro_mpt.masks import AllSizes

    AllSizes(2, nested="no")


@trigger("masks-no-tokens")
def _():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1), obs=x)

    MaskedPretrainingLoss().loss(model, None, torch.zeros(4, 0))


@trigger("masks-check-no-tokens")
def _():
    pyro_mpt.masks.make_schedule("uniform").check(0)


@trigger("masks-exhaustive-too-many-tokens")
def _():
    model, x = _ppca(D=17)
    MaskedPretrainingLoss(masks="exhaustive").loss(model, None, x)


@trigger("masks-rate-out-of-range")
def _():
    MaskedPretrainingLoss(masks=1.5)


@trigger("masks-rate-one-token")
def _():
    model, x = _ppca(D=1)
    MaskedPretrainingLoss(masks=0.5).loss(model, None, x)


@trigger("masks-rate-rounds-to-zero")
def _():
    model, x = _ppca(D=3)
    MaskedPretrainingLoss(masks=0.1).loss(model, None, x)


@trigger("masks-rate-rounds-to-zero-missing")
def _():
    model, _ = _missing_ppca(_observed())
    MaskedPretrainingLoss(masks=0.2).loss(model, None, _x())


@trigger("loss-schedule-without-observed")
def _():
    from pyro_mpt.masks import RandomOrders

    class OldSchedule(RandomOrders):
        """A schedule written before missing tokens: its blocks take no observed=."""

        def blocks(self, n, D, *, max_elements=2**22, device=None):
            return super().blocks(n, D, max_elements=max_elements, device=device)

    model, _ = _missing_ppca(_observed())
    MaskedPretrainingLoss(masks=OldSchedule()).loss(model, None, _x())


@trigger("mask-block-dtype")
def _():
    from pyro_mpt.mask_blocks import MaskBlock
    from pyro_mpt.masks import MaskSchedule

    class ByteSchedule(MaskSchedule):
        """Yields its masks as 0/1 bytes instead of bool."""

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            mask = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 1, 1, 0]], dtype=torch.uint8)[:, None]
            yield MaskBlock(mask, torch.tensor([[2], [3]]), torch.ones(2, 1))

    model, x = _ppca(D=5)
    MaskedPretrainingLoss(masks=ByteSchedule()).loss(model, None, x)


@trigger("mask-block-size")
def _():
    from pyro_mpt.mask_blocks import MaskBlock
    from pyro_mpt.masks import MaskSchedule

    class SizeOneSchedule(MaskSchedule):
        """Gives every query size 1, whatever its mask hides."""

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            mask = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 1, 1, 0]], dtype=torch.bool)[:, None]
            yield MaskBlock(mask, torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1))

    model, x = _ppca(D=5)
    MaskedPretrainingLoss(masks=SizeOneSchedule()).loss(model, None, x)


@trigger("mask-block-targets-size")
def _():
    from pyro_mpt.mask_blocks import MaskBlock

    MaskBlock(None, torch.full((2, 1), 2), torch.ones(2, 1), targets=torch.tensor([0, 1]),
              draw=lambda: torch.eye(5, dtype=torch.bool)[:2, None])


@trigger("estimate-unknown-block")
def _():
    from pyro_mpt.masks import MaskSchedule

    class TupleSchedule(MaskSchedule):
        """Yields its masks as bare tuples instead of MaskBlock."""

        def blocks(self, n, D, *, max_elements=2**22, device=None, observed=None):
            yield (torch.ones(1, 1, D, dtype=torch.bool), torch.full((1, 1), D), torch.ones(1, 1))

    model, x = _ppca()
    MaskedPretrainingLoss(masks=TupleSchedule()).loss(model, None, x)


@trigger("masks-unknown-name")
def _():
    MaskedPretrainingLoss(masks="random")


@trigger("masks-wrong-type")
def _():
    MaskedPretrainingLoss(masks=[1, 2])




@trigger("recompute-not-deterministic")
def _():
    from pyro_mpt.recompute import recomputed

    runs = []

    def block(a):
        # the first run saves 4 tensors (two exps, the product's two factors), the second 1
        runs.append(1)
        return (a.exp() * a.exp()).sum() if len(runs) == 1 else a.exp().sum()

    recomputed(block, torch.ones(3, requires_grad=True)).backward()
