r"""The importance-weighted bound (IWAE) as a Pyro ELBO, with the minibatch scale outside the log-mean-exp.

One ELBO per module, as in Pyro's ``pyro/infer``: the bound's log-weights are
those of ``Evidence(method="importance")`` with the guide as proposal and
:math:`K` particles (:func:`~pyro_mpt.evidence.importance.importance_log_weights`).
"""


import difflib

import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import torch_item
from pyro.util import warn_if_nan

from .conditionals.latent_runs import logmeanexp
from .evidence.importance import importance_log_weights
from .guide_checks import check_guide_sites, warn_not_reparameterized
from .observed_tokens import check_latent_scales, trace_tokens
from .counts import is_count

__all__ = ["ImportanceWeightedELBO"]


#: Pyro's ELBO options, which this loss refuses with what it does instead
_PYRO_ELBO_OPTIONS = frozenset(
    {"vectorize_particles", "retain_graph", "strict_enumeration_warning", "ignore_jit_warnings", "jit_options",
     "tail_adaptive_beta"}
)
#: its own options, for the hint at a misspelled one
_OWN_OPTIONS = ("num_particles", "obs_site", "token_plates", "max_plate_nesting", "chunk_size")


class ImportanceWeightedELBO(ELBO):
    r"""The importance-weighted bound (IWAE) with the minibatch scale outside the log-mean-exp.

    .. math::

        \mathcal L = -\sum_i s_i \log \frac1K \sum_{k=1}^K
            \frac{p(x_i, z_{ik})}{q(z_{ik} \mid x_i)},

    with :math:`s_i` the datapoint's plate scale (``N / B`` for a subsampled
    plate). Pyro 1.9's ``RenyiELBO(alpha=0)`` computes the same bound for
    :math:`s_i = 1` but puts :math:`s_i` inside the log-sum-exp; this class is
    correct under subsampling and offers ``differentiable_loss``. The guide's
    sites must be reparameterizable (``has_rsample``) for unbiased gradients
    (a ``UserWarning`` names any that is not).
    Latents must be local to each datapoint.

    :param int num_particles: :math:`K`.
    :param str obs_site: the observed site (when the model observes several).
    :param tuple token_plates: the observed site's plates over tokens (see
        :class:`~pyro_mpt.MaskedPretrainingLoss`); None detects them.
    :param int max_plate_nesting: plate dims of the model (guessed when inf).
    :param int chunk_size: particles per vectorized run (default: all).

    Example::

        >>> svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-3}), ImportanceWeightedELBO(num_particles=8))
    """

    def __init__(
        self, num_particles=8, *, obs_site=None, token_plates=None, max_plate_nesting=float("inf"), chunk_size=None,
        **elbo_options,
    ):
        unknown = sorted(set(elbo_options) - _PYRO_ELBO_OPTIONS)
        if unknown:
            close = difflib.get_close_matches(unknown[0], _OWN_OPTIONS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(f"ImportanceWeightedELBO got an unexpected keyword argument {unknown[0]!r}{hint}.")
        if elbo_options:
            # Pyro's ELBO options, written out of habit: a bare "unexpected keyword argument" before
            raise ValueError(
                f"ImportanceWeightedELBO takes no {', '.join(sorted(elbo_options))}: its particles are always "
                f"drawn in vectorized runs (chunk_size=<particles a run> bounds their memory), and "
                f"it takes num_particles, obs_site, token_plates, max_plate_nesting and chunk_size."
            )
        # num_particles=0 ended in "range() arg 3 must not be zero", chunk_size=-1 in torch.cat's error
        for label, value, none_ok in (("num_particles", num_particles, False), ("chunk_size", chunk_size, True)):
            if (value is None and none_ok) or is_count(value):
                continue
            raise ValueError(
                f"ImportanceWeightedELBO({label}={value!r}): give a positive integer"
                f"{' (particles per vectorized run), or None for all at once' if none_ok else ' (particles per datapoint)'}."
            )
        super().__init__(num_particles=int(num_particles), max_plate_nesting=max_plate_nesting)
        self.obs_site = obs_site
        self.token_plates = token_plates
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self._warned = set()  # guide sites already named by the not-reparameterized warning

    def _tokens(self, model, guide, args, kwargs):
        mpn = None if self.max_plate_nesting == float("inf") else self.max_plate_nesting
        tokens = trace_tokens(model, guide, args, kwargs, self.obs_site, mpn, self.token_plates)
        check_guide_sites(tokens)
        check_latent_scales(tokens, "ImportanceWeightedELBO")
        return tokens

    def _get_trace(self, model, guide, args, kwargs):
        tokens = self._tokens(model, guide, args, kwargs)
        return tokens.model_trace, tokens.guide_trace

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """:math:`-\\sum_i s_i \\log\\hat p_K(x_i)`, a differentiable scalar."""
        tokens = self._tokens(model, guide, args, kwargs)
        warn_not_reparameterized(tokens, "ImportanceWeightedELBO", self._warned)
        K = self.num_particles
        lw = importance_log_weights(
            tokens, model, guide, args, kwargs, K, self.chunk_size or K, who="ImportanceWeightedELBO",
            instead="MaskedPretrainingLoss, which leaves missing tokens out exactly",
            density_instead="a guide with a density over the latents (e.g. AutoNormal); for MAP "
            "estimation with AutoDelta use Trace_ELBO",
        )
        loss = -(tokens.scale * logmeanexp(lw, 0)).sum()
        warn_if_nan(loss, "loss")
        return loss

    def loss(self, model, guide, *args, **kwargs):
        """The loss as a float, without gradients."""
        with torch.no_grad():
            return torch_item(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """The loss as a float; also back-propagates it into the parameters."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        return torch_item(loss)
