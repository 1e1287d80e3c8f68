"""Triggers of the package's own errors (``pyro_mpt/__init__.py``)."""

import pyro_mpt

from error_triggers.registry import trigger


@trigger("package-unknown-name")
def _():
    pyro_mpt.MaskedPretrainingLos
