"""A package's public names imported from their modules on first use (PEP 562).

``import pyro_mpt`` and ``import pyro_mpt.adapters`` then load neither torch,
Pyro nor transformers, so the ``pyro-mpt`` command answers ``--help`` and its
usage errors at once instead of after the 3-4 s those imports take.

Example::

    >>> __getattr__, __dir__ = lazy_exports(__name__, {"Evidence": ".evidence"})
"""

import importlib
import importlib.util

__all__ = ["lazy_exports"]


def lazy_exports(package, sources):
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose names come on first use.

    :param str package: the package's ``__name__``.
    :param dict sources: each public name -> the module that defines it, relative to
        ``package`` (``".loss"``).
    :returns: ``(__getattr__, __dir__)``, to be assigned at the package's top level;
        ``__getattr__`` also imports the package's submodules by name.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name):
        source = sources.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source, package), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            # a submodule as an attribute (``pyro_mpt.masks.AllSizes`` after ``import pyro_mpt``),
            # as when the package imported its modules eagerly
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later lookups find it without this function
        return value

    def __dir__():
        return sorted(set(namespace) | set(sources))

    return __getattr__, __dir__
