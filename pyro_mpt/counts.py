"""Counts a user passes: masks, samples, nodes, particles, iterations, chunk sizes.

One predicate for every such argument, so that each check takes the same values:
Python and numpy integers (``numbers.Integral``: a grid of settings made with
``np.arange`` gives ``np.int64``), never a bool (``True`` is an ``int``), never a
float (``batch_size=2.5`` once ran as 2). Each caller writes its own message, which
names the argument and what it counts.

Example::

    >>> is_count(np.int64(4)), is_count(True), is_count(2.0), is_count(0, minimum=0)
    (True, False, False, True)
"""

from numbers import Integral

__all__ = ["is_count"]


def is_count(value, minimum=1):
    """Whether ``value`` is an integer (Python's or numpy's, not a bool) of at least ``minimum``.

    :param value: the argument as given.
    :param int minimum: the smallest count accepted (1; 0 where none is meaningful).
    :rtype: bool
    """
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum
