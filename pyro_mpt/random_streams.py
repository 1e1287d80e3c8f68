"""Latent draws of a model trace on random streams of their own, so that what follows a
trace draws the same numbers whether it drew its latents or not.

The loss and ``Evidence`` trace the model before they draw their masks or samples. Their
first call draws the latents the guide leaves unset; later calls, once the engine is known
not to read them, set each at its prior mean and draw nothing. Drawn from the global
stream, the masks then depended on which call it was: three calls after
``pyro.set_rng_seed(0)`` gave 16.2376, 15.9085, 15.9085 (PPCA, ``masks="uniform"``), and a
finite-difference check at a fixed seed failed unless a call came first. A latent drawn
here takes its numbers from a stream seeded by a hash of the global state and the site's
name, read without drawing from it: the global stream is left as it was, and a seed set
before the trace still fixes the draw. What the trace draws through Pyro's own machinery
(a subsampled plate's minibatch, the guide's samples) stays on the global stream, as
under ``Trace_ELBO``.
"""

import contextlib
import hashlib

import torch

__all__ = ["state_seed", "seeded_streams", "draw_apart"]


def state_seed(key):
    """A 63-bit seed from torch's global CPU random state and ``key``, read without drawing
    from the state (a BLAKE2b hash of its bytes).

    :param str key: what tells apart the seeds of one state (a site's name).
    :returns: int.

    Example::

        >>> torch.manual_seed(0); a = state_seed("z")
        >>> torch.manual_seed(0); a == state_seed("z") != state_seed("w")
        True
    """
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8)
    digest.update(str(key).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


@contextlib.contextmanager
def seeded_streams(seed):
    """Within it, torch's random streams (the CPU's and, where CUDA is in use, every
    device's) are seeded with ``seed``; the global ones are restored after it.

    Example::

        >>> with seeded_streams(7):
        ...     a = torch.randn(3)
        >>> with seeded_streams(7):
        ...     torch.equal(a, torch.randn(3))
        True
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        # the streams fork_rng restores, not torch.manual_seed: that also seeds the backends
        # not in use (CUDA before its first use, XPU, MTIA) by a call queued for their
        # initialization, where it replaced the seed the user had set (and formatted the
        # stack for it: 0.7 ms a call)
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        yield


def draw_apart(site=None):
    """A Pyro init strategy (:class:`~pyro.infer.autoguide.initialization.InitMessenger`):
    the site's prior draw, on torch's random streams seeded by :func:`state_seed` of its
    name, the global ones restored after it (the CPU's and, where CUDA is in use, every
    device's).

    Example::

        >>> trace = poutine.trace(InitMessenger(draw_apart)(model)).get_trace(x)
    """
    if site is None:
        return draw_apart
    with seeded_streams(state_seed(site["name"])):
        value = site["fn"].sample().detach()
    value._pyro_custom_init = False
    return value
