"""Triggers of every user-facing error and warning of pyro_mpt, one module per area of the code.

Importing the package registers every trigger in :data:`error_triggers.registry.TRIGGERS`;
``tests/test_errors.py`` checks them against docs/errors.md. A new row's trigger goes in the
module of the code that raises it, decorated with ``@trigger("row-id")``.
"""

import importlib
import pkgutil

from error_triggers.registry import TRIGGERS, trigger

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["TRIGGERS", "trigger"]
