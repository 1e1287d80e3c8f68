r"""Train the guide by the ELBO while another loss trains the model.

Masked pre-training trains the *model* :math:`p_\theta(x)`; the sampling
engines (``"encode_decode"``, ``"importance"``) and importance-sampled
evidence use the guide :math:`q_\phi(z \mid x)` as a posterior approximation,
but the MPT objective itself does not ask the guide to approximate the
posterior (its gradient through the encoder rewards predicting masked tokens,
which tends to make the encoder overconfident, a poor proposal). A common
remedy, as in wake–sleep style training, is to give the guide its own
objective: :class:`WithGuideELBO` adds the gradients of an ELBO with respect to
the **guide's parameters only** to those of any loss:

.. math::

    \nabla_\theta \leftarrow \nabla_\theta \mathcal L_{\text{loss}}, \qquad
    \nabla_\phi \leftarrow \nabla_\phi \mathcal L_{\text{loss}}
        + w\,\nabla_\phi(-\text{ELBO}).

With ``EncodeDecodeConditionals(encoder_grad=False)`` the guide is then trained
by the ELBO alone and the model by MPT alone.
"""

import math
from numbers import Real

import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.elbo import ELBO
from pyro.infer.util import torch_item

__all__ = ["WithGuideELBO"]


class WithGuideELBO(ELBO):
    """A loss for the model plus ELBO gradients for the guide's parameters.

    :param loss: the model's loss (e.g. :class:`~pyro_mpt.loss.MaskedPretrainingLoss`),
        any object with ``loss`` and ``loss_and_grads``.
    :param guide_loss: the guide's objective (default ``Trace_ELBO()``); any
        Pyro ELBO with ``differentiable_loss``.
    :param float weight: weight :math:`w` of the guide's objective.

    The reported loss value is that of ``loss``.

    Example::

        >>> mpt = MaskedPretrainingLoss(conditionals=EncodeDecodeConditionals(encoder_grad=False), masks=0.33)
        >>> svi = SVI(vae.model, vae.guide, Adam({"lr": 1e-3}), WithGuideELBO(mpt))
    """

    def __init__(self, loss, guide_loss=None, weight=1.0):
        super().__init__()
        for label, value in (("loss", loss), ("guide_loss", guide_loss)):
            if isinstance(value, type):
                # WithGuideELBO(Trace_ELBO) failed later with "'_get_traces'"
                raise TypeError(f"WithGuideELBO({label}={value.__name__}): give an instance, {value.__name__}().")
        if getattr(weight, "shape", None) == () and not isinstance(weight, bool):
            weight = weight.item()  # a 0-dim tensor or array (taken as 0.5 before the check)
        if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"WithGuideELBO(weight={weight!r}): give a finite number >= 0, the factor on the guide's ELBO gradient.")
        self.inner = loss
        self.guide_loss = guide_loss if guide_loss is not None else Trace_ELBO()
        self.weight = float(weight)

    def __repr__(self):
        return f"WithGuideELBO({self.inner!r}, {type(self.guide_loss).__name__})"

    def _get_trace(self, model, guide, args, kwargs):
        return self.inner._get_trace(model, guide, args, kwargs)

    def loss(self, model, guide, *args, **kwargs):
        """The inner loss's value (float)."""
        return self.inner.loss(model, guide, *args, **kwargs)

    def _guide_params(self, guide, args, kwargs):
        with poutine.block(), poutine.trace(param_only=True) as tr:
            guide(*args, **kwargs)
        return [site["value"].unconstrained() for site in tr.trace.nodes.values()]

    def differentiable_loss(self, model, guide, *args, **kwargs):
        r"""The inner loss as a differentiable scalar whose gradient with respect to the guide's
        parameters carries :math:`w\,\nabla_\phi(-\text{ELBO})` too, for Pyro's module style
        (``WithGuideELBO(loss)(model, guide)(x).backward()``): the ELBO's guide gradients enter as
        :math:`\sum_p \langle p, g_p\rangle` less its detached value, so the value stays the
        inner loss's and the model's parameters get the inner loss's gradient alone. A
        parameter that the model and the guide share (a tied loading) is a guide parameter
        too: it gets both gradients.

        :returns: a scalar tensor.
        """
        value = self.inner.differentiable_loss(model, guide, *args, **kwargs)
        extra = sum((p * g).sum() for p, g in self._guide_grads(model, guide, args, kwargs))
        return value if not torch.is_tensor(extra) else value + (extra - extra.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Back-propagate the inner loss, then add the guide-only ELBO gradients.

        :returns: the inner loss's value (float).
        """
        # the guide gets the ELBO's gradients here, after the inner loss's backward pass: the
        # inner loss's check of the guide's training is off while it runs, and only then (setting
        # it off for good turned it off for the loss used on its own too)
        checks = getattr(self.inner, "checks_guide_training", None)
        if checks is not None:
            self.inner.checks_guide_training = False
        try:
            value = self.inner.loss_and_grads(model, guide, *args, **kwargs)
        finally:
            if checks is not None:
                self.inner.checks_guide_training = checks
        for p, g in self._guide_grads(model, guide, args, kwargs):
            p.grad = g if p.grad is None else p.grad + g
        return torch_item(value) if torch.is_tensor(value) else value

    def _guide_grads(self, model, guide, args, kwargs):
        """``[(p, g)]``: the guide's parameters and their gradients of the weighted negative
        ELBO (none without a guide, or for a parameter the ELBO does not reach)."""
        if guide is None:
            return []
        params = [p for p in self._guide_params(guide, args, kwargs) if p.requires_grad]
        if not params:
            return []
        elbo = self.guide_loss.differentiable_loss(model, guide, *args, **kwargs)
        grads = torch.autograd.grad(self.weight * elbo, params, allow_unused=True)
        return [(p, g) for p, g in zip(params, grads) if g is not None]
