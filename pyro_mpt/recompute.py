r"""Activation recomputation: a function's intermediate tensors are not kept for the
backward pass but computed again in it, from the same inputs and random state.

This is what non-reentrant ``torch.utils.checkpoint.checkpoint`` does, written
here on :func:`torch.autograd.graph.saved_tensors_hooks` because torch's reads a
``torch._dynamo`` setting on every call, so that its first call imports the
compiler stack (sympy included: 1--3 s, more than a whole training step of most
models; measured on a ``masks="pll"`` step of a linear-Gaussian hierarchy, 3.8 s
the first call against 0.4 s the next).

The forward pass runs once with every tensor autograd saves replaced by its
position; the first position the backward pass asks for runs the function again
(with the random state of the first run, under grad mode) with those tensors
kept, in the same order, and every later one takes its own (let go of then). Regions may nest: an
inner region's tensors are its own, so the outer region's positions count
the same tensors in both runs.

Both runs must save the same tensors, in the same order. What a region's first run
leaves behind for later code (an engine's pieces kept on its state across blocks, a
check made once per engine) is not there for its first run and is there for its
second: it is made under :func:`not_recomputed`, whose tensors the region does not
count, and a choice that depends on it asks :func:`recomputing` instead.
"""

import contextlib

import torch

__all__ = ["recomputed", "not_recomputed", "recomputing", "rerunning"]

# regions entered and not left, the backward pass's second runs included; within
# not_recomputed, 0 (autograd's backward runs each second run to its end before the next)
_depth = 0
# second runs in progress (the backward pass's), within not_recomputed too
_reruns = 0


class _Region:
    """One call's function, inputs, random state and, once recomputed, its saved tensors."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.cpu_state = torch.get_rng_state()
        # the random state of the current CUDA device too, when CUDA is in use: sampling
        # engines draw there, and the second run must draw the same numbers
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_device = torch.cuda.current_device() if self.cuda else None
        self.cuda_state = torch.cuda.get_rng_state(self.cuda_device) if self.cuda else None
        self.count = 0
        self.saved = None

    def pack(self, tensor):
        position = self.count
        self.count += 1
        return position

    def unpack(self, position):
        if self.saved is None or self.saved[position] is None:
            # the first position asked for; or one asked for again (a second backward pass
            # through a retained graph), after this pass let go of it
            self.saved = []
            devices = [self.cuda_device] if self.cuda else []
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(self.cpu_state)
                if self.cuda:
                    torch.cuda.set_rng_state(self.cuda_state, self.cuda_device)
                # run to its end: stopping it once every position is saved again would mean
                # raising from inside the model, whose callers may catch exceptions
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self.keep, _identity), _entered(), \
                        _rerun():
                    self.fn(*self.args)
            if len(self.saved) != self.count:
                raise RuntimeError(
                    f"A block recomputed in the backward pass saved {len(self.saved)} tensors for it "
                    f"in its second run and {self.count} in its first: the model (or guide) must "
                    f"compute the same way twice from the same torch random state. Draw random "
                    f"numbers with torch or pyro.sample, not numpy or Python's random, and do not "
                    f"branch on them; or raise chunk_size so that no block is recomputed. (A conditional "
                    f"engine that keeps a piece on its state for later blocks must make it under "
                    f"pyro_mpt.recompute.not_recomputed.)"
                )
        # each tensor is let go of once the backward pass has it: the allocator reuses its
        # memory for the gradients (kept to the end, the step took 20 % longer)
        tensor, self.saved[position] = self.saved[position], None
        return tensor

    def keep(self, tensor):
        # detached: the second run's graph is not needed, and would keep every one of its
        # intermediates alive through the saved tensors' grad_fn. Its nodes get the detached
        # tensor too: a node that saves its own output (exp, tanh, logsumexp) and held the
        # tensor itself would hold its own grad_fn, a cycle of C++ references that no garbage
        # collector frees, so every recomputed graph leaked with all it saved (a Bernoulli
        # mixture's masks="all", N = 4000: 80 MB a block, peak RSS growing with N and with
        # every step). Unpacking restores the autograd metadata from the node's own record.
        detached = tensor.detach()
        self.saved.append(detached)
        return detached


def _identity(tensor):
    return tensor


@contextlib.contextmanager
def _entered(depth=None):
    global _depth
    before = _depth
    _depth = before + 1 if depth is None else depth
    try:
        yield
    finally:
        _depth = before


@contextlib.contextmanager
def _rerun():
    global _reruns
    _reruns += 1
    try:
        yield
    finally:
        _reruns -= 1


@contextlib.contextmanager
def not_recomputed():
    """Within it, the tensors autograd saves are kept by the graph as usual, not by an
    enclosing recomputed region: for results that outlive the region's first run
    (pieces kept on an engine's state for later blocks, a check made once), which its
    second run finds made and does not make again. What is made within must not draw
    random numbers (the second run would not draw them).

    Example::

        >>> with not_recomputed():
        ...     pieces["factor"] = torch.linalg.cholesky(S)   # kept for every later block
    """
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity), _entered(0):
        yield


def recomputing():
    """Whether the caller runs inside a recomputed region (in either of its runs): a
    choice that would otherwise depend on what an earlier run left behind (keep this
    block's tables for the backward pass, or not) is made the same in both runs.

    :returns: bool.
    """
    return _depth > 0


def rerunning():
    """Whether the caller runs in a region's second run, the backward pass's: what only
    reports on the values (diagnostics, warnings) and saves no tensor for the graph may
    be skipped there, since the first run made it on the same values.

    :returns: bool.

    Example::

        >>> if diagnostics and not rerunning():
        ...     report(out.detach())
    """
    return _reruns > 0


def recomputed(fn, *args):
    """``fn(*args)`` with its intermediate tensors recomputed in the backward pass
    instead of kept (see the module docstring); a plain call when gradients are off.

    :param callable fn: a deterministic function of ``args`` and the random state
        (it is run again, from the same random state, in the backward pass).
    :returns: what ``fn`` returns.

    Example::

        >>> y = recomputed(lambda a: (a.exp() * a).sum(), x)   # x.exp() not kept
        >>> y.backward()
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    region = _Region(fn, args)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack), _entered():
        return fn(*args)
