r"""The identity of a model (or guide) across calls, and the checks that passed for it.

Engines and checks remember things per model: the engine ``"auto"`` chose, the way of
running it that worked, a check that need not run again. A model is a function, a
lambda, a callable object or a bound method (a new object at every access, so it is
identified by its owner and function). Keys by ``id`` alone matched a new model whose
object took a collected model's address: a loss reused across models handed a
linear-Gaussian PPCA the importance engine chosen for an earlier tanh model (0.31--0.47
nats off, silently). :class:`CallableKey` holds the objects by weak references and
equals another key only while they are alive and the same.
"""

import weakref

__all__ = ["CallableKey", "callable_key", "PassedChecks"]


def callable_key(fn):
    """A key that identifies a callable across calls (bound methods are recreated at
    each access), for what engines remember per model or guide.

    :returns: :class:`CallableKey`, equal to another key only while the objects both
        name are alive and the same ones.

    Example::

        >>> callable_key(svi_module.model) == callable_key(svi_module.model)
        True
    """
    owner = getattr(fn, "__self__", None)
    return CallableKey((owner, getattr(fn, "__func__", fn)) if owner is not None else (fn,))


class CallableKey:
    """The identity of a callable (its owner and function, or the callable itself), held by
    weak references (see the module docstring). A pickled or copied key matches nothing:
    the copy of a loss chooses its engines again.

    :param tuple objects: the objects that make the callable.
    """

    __slots__ = ("_ids", "_refs", "__weakref__")

    def __init__(self, objects):
        self._ids = tuple(id(o) for o in objects)
        self._refs = tuple(_reference(o) for o in objects)

    def alive(self):
        """Whether every object of the key still exists."""
        return all(ref() is not None for ref in self._refs)

    def __hash__(self):
        return hash(self._ids)

    def __eq__(self, other):
        if not isinstance(other, CallableKey) or self._ids != other._ids:
            return False
        return all(a() is not None and a() is b() for a, b in zip(self._refs, other._refs))

    def __reduce__(self):
        return (_dead_key, (len(self._ids),))

    def __repr__(self):
        return f"CallableKey({self._ids}{'' if self.alive() else ', collected'})"


def _reference(obj):
    try:
        return weakref.ref(obj)
    except TypeError:  # no weak references (a builtin): held, so its id cannot be reused
        return lambda: obj


def _dead_key(size):
    key = CallableKey(())
    key._ids, key._refs = (None,) * size, (lambda: None,) * size
    return key


class PassedChecks:
    """The models (and details, e.g. a fingerprint of the data) a check passed for, so that
    it runs once per model: a fresh ``Evidence(model)(x)`` at every call otherwise paid a
    model run for each check every time (PPCA D = 512, K = 50: 1.4x a bare
    ``LowRankMultivariateNormal.log_prob`` -> 2.6x for the hidden-randomness check, 1.9x for
    the Gaussian marginal's posterior points).

    Kept per model function, weakly: a collected function takes its entries with it, and
    the entries of collected owners (bound methods) are dropped at the next :meth:`add`.

    :param int keep: the most entries kept per function (the newest), or None for all.

    Example::

        >>> checks = PassedChecks()
        >>> if not checks.passed(model):
        ...     run_the_check(model)
        ...     checks.add(model)
    """

    def __init__(self, keep=None):
        self.keep = keep
        self._by_function = weakref.WeakKeyDictionary()

    def passed(self, model, detail=()):
        """Whether the check passed for ``model`` with ``detail`` (hashable)."""
        try:
            kept = self._by_function.get(getattr(model, "__func__", model), ())
        except TypeError:  # not weakly referable: checked at every call
            return False
        return (callable_key(model), detail) in kept

    def add(self, model, detail=()):
        """Remember that the check passed for ``model`` with ``detail``."""
        fn = getattr(model, "__func__", model)
        key = (callable_key(model), detail)
        try:
            kept = [k for k in self._by_function.get(fn, ()) if k[0].alive() and k != key] + [key]
            self._by_function[fn] = kept if self.keep is None else kept[-self.keep:]
        except TypeError:
            pass

    def discard(self, model, detail=()):
        """Forget that the check passed for ``model`` with ``detail`` (if it had)."""
        fn = getattr(model, "__func__", model)
        key = (callable_key(model), detail)
        try:
            kept = self._by_function.get(fn)
            if kept is not None and key in kept:
                self._by_function[fn] = [k for k in kept if k != key]
        except TypeError:
            pass
