"""Triggers of the docs/errors.md rows raised by adapters: rates, batching."""

import math

import torch


from error_triggers.registry import trigger

@trigger("rates-unreadable")
def _():
    from pyro_mpt.adapters import parse_rates

    parse_rates("0.1:x:0.1")


@trigger("rates-range-backwards")
def _():
    from pyro_mpt.adapters import parse_rates

    parse_rates("0.5:0.1:0.1")


@trigger("rates-spec-out-of-range")
def _():
    from pyro_mpt.adapters import parse_rates

    parse_rates("0:0.5:0.25")


@trigger("rates-out-of-range")
def _():
    from pyro_mpt.adapters.rates import check_rates

    check_rates([0.0, 0.5])


@trigger("rates-not-increasing")
def _():
    from pyro_mpt.adapters.rates import check_rates

    check_rates([0.5, 0.2])


def _rate_curve(values):
    from pyro_mpt.adapters.rates import rate_curve

    return rate_curve(torch.tensor(values, dtype=torch.float64)[:, :, None], [0.25, 0.5], [4])


@trigger("rates-area-nan")
def _():
    _rate_curve([[-1.0, math.nan]]).area()


@trigger("rates-no-per-item")
def _():
    curve = _rate_curve([[-1.0, -2.0]])
    curve.per_item = None
    curve.per_item_area()


@trigger("rates-table2-grid")
def _():
    from pyro_mpt.adapters import table2_area

    table2_area(_rate_curve([[-1.0, -2.0]]))


@trigger("batching-max-tokens")
def _():
    from pyro_mpt.adapters.batching import pack

    list(pack([(3, [0])], lambda i: 1, 0))


