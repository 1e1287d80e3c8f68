r"""Whose code a frame is: pyro_mpt's own, a library's (torch, Pyro, the standard library), or the user's.

Two uses. Warnings point at the user's line: ``warnings.warn`` names the frame
``stacklevel`` levels up, and the number of pyro_mpt, Pyro and torch frames
between a warning and the user's code depends on the entry point (``svi.step``,
``loss(model, guide)(x)``, :class:`~pyro_mpt.Evidence`, a Lightning training
step), so :func:`user_stacklevel` counts them at run time instead of a fixed
number. And :func:`~pyro_mpt.conditionals.base.model_failed` tells a model's
own failure from an engine's by the frames of its traceback.

Example::

    >>> import warnings
    >>> def check(x):  # inside pyro_mpt
    ...     warnings.warn("x is odd", stacklevel=user_stacklevel())
"""

import os
import sys
from importlib.util import find_spec

__all__ = ["PACKAGE", "is_own", "is_library", "user_stacklevel"]

#: the top-level package name: exception types defined here have modules that start with it
PACKAGE = __name__.split(".")[0]
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# code that both a model and an engine call: its frames say neither whose code failed
# (found without importing them: the command line's usage errors import neither torch nor Pyro)
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (find_spec("torch").origin, find_spec("pyro").origin, os.__file__)
)


def is_own(path):
    """Whether the file ``path`` is one of pyro_mpt's modules."""
    return os.path.abspath(path).startswith(_OWN_DIR)


def is_library(path):
    """Whether the file ``path`` belongs to torch, Pyro or the standard library.

    Installed without a virtual environment, pyro_mpt lies inside the standard
    library's folder (``site-packages``): ask :func:`is_own` first."""
    return os.path.abspath(path).startswith(_LIBRARY_DIRS)


def user_stacklevel():
    """The ``stacklevel`` for a ``warnings.warn`` written in the calling frame that
    names the innermost frame outside pyro_mpt, torch, Pyro and the standard library:
    the user's line that called into them (or, when every frame is theirs, the
    innermost frame outside pyro_mpt)."""
    frame, level = sys._getframe(1), 1
    outside_own = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_own(path):
            if not is_library(path):
                return level
            outside_own = outside_own or level
        frame, level = frame.f_back, level + 1
    return outside_own or 1
