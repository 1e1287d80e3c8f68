r"""Where the observed tokens enter the model and guide, and what the guide covers.

The sampling engines run the guide on imputed data, so they must know which
argument of ``model(*args, **kwargs)`` / ``guide(...)`` holds the observed
tokens (:func:`locate_data_arg`, :class:`DataArgument`); they refuse missing
tokens on those paths (:func:`refuse_missing`) and ask which latents the guide
samples (:func:`guide_latents`).

**Which argument is the data.** To run the guide on imputed data the runner
must know which argument of ``model(*args, **kwargs)`` / ``guide(...)`` holds
the observed tokens. By default it is the argument that *is* the value passed
to the observed site (``obs=x``), or else the only tensor argument equal to it;
``data_arg=`` (a position or a keyword name) overrides. The argument holds the
minibatch's tokens, or, in Pyro's minibatch idiom (``pyro.plate("data", N,
subsample_size=B) as idx`` and ``x[idx]`` inside it), the whole dataset whose rows
at the plate's subsample indices are the tokens: imputed copies then replace those
rows, one guide call a copy (indexing ``x[idx]`` reads the first dim, so copies cannot
be stacked along it).
"""

import inspect
from dataclasses import dataclass
from typing import Optional, Union

import torch
from pyro.poutine.util import site_is_subsample

from .base import EngineNotApplicable

__all__ = ["DataArgument", "locate_data_arg", "refuse_missing", "whole_datapoints_missing", "guide_latents"]


@dataclass
class DataArgument:
    """Where the observed tokens enter ``model(*args, **kwargs)`` and the guide.

    :param key: the position (int) in ``args`` or the keyword (str) in ``kwargs``.
    :param torch.Tensor value: the original argument.
    :param bool rows: True when the argument's leading dim holds the ``n``
        datapoints, so that imputed copies can be stacked along it.
    :param torch.Tensor index: the data plate's subsample indices where the argument is
        the whole dataset, indexed inside the model (``x[idx]``); None where it is the batch.
    """

    key: Union[int, str]
    value: torch.Tensor
    rows: bool
    tokens: object = None
    index: Optional[torch.Tensor] = None

    def substitute(self, args, kwargs, xt):
        """``(args, kwargs)`` with the data replaced by imputed tokens.

        :param torch.Tensor xt: ``(n, D)``, or ``(B, n, D)`` stacked along the
            leading dim (needs ``rows``).
        """
        if self.index is not None:
            # the whole dataset with the minibatch's rows replaced (copies one at a time: rows=False)
            batch = self.value[self.index]
            site = self.tokens.to_site(xt).reshape(batch.shape).to(dtype=self.value.dtype, device=self.value.device)
            new = self.value.detach().clone()
            new[self.index] = site
            return self._placed(args, kwargs, new)
        shape = self.value.shape
        site = xt if self.tokens is None else self.tokens.to_site(xt)  # the site's layout
        if xt.dim() == 3:
            new = site.reshape((xt.shape[0] * shape[0],) + tuple(shape[1:]))
        else:
            new = site.reshape(shape)
        new = new.to(dtype=self.value.dtype, device=self.value.device)
        return self._placed(args, kwargs, new)

    def _placed(self, args, kwargs, new):
        if isinstance(self.key, int):
            args = tuple(new if i == self.key else a for i, a in enumerate(args))
        else:
            kwargs = dict(kwargs)
            kwargs[self.key] = new
        return args, kwargs

    def describe(self):
        return f"positional argument {self.key}" if isinstance(self.key, int) else f"keyword argument {self.key!r}"


def _subsample_index(tokens):
    """The subsample indices of the observed site's one subsampled data plate, or None."""
    frames = [f for f in tokens.data_frames if f.full_size is not None and f.full_size != f.size]
    if len(frames) != 1 or len(tokens.datapoint_shape) != 1:
        return None
    site = tokens.model_trace.nodes.get(frames[0].name)
    if site is None or not site_is_subsample(site) or not torch.is_tensor(site["value"]):
        return None
    return site["value"]


def _indexed_matches(a, index, tokens):
    """Whether ``a[index]`` holds the tokens: ``a`` the whole dataset, rows along its first dim."""
    if not torch.is_tensor(a) or a.dim() < 1 or a.shape[0] <= int(index.max()):
        return False
    return _matches(a[index.to(a.device)], tokens)


def _matches(a, tokens):
    """Whether ``a`` holds the tokens: equal at the observed ones (the traced tokens carry
    other values in place of missing ones, e.g. a padding row's placeholders)."""
    n, D = tokens.value.shape
    if not torch.is_tensor(a) or a.numel() != n * D:
        return False
    try:
        flat = tokens.to_tokens(a.detach().reshape(tokens.site_shape)).reshape(n, D).to(tokens.value)
    except RuntimeError:
        return False
    if tokens.observed is not None:
        flat = torch.where(tokens.observed.to(flat.device), flat, tokens.value)
    return bool(torch.equal(flat, tokens.value))


def locate_data_arg(tokens, fn, args, kwargs, data_arg=None, who="this engine"):
    """Find the argument that holds the observed tokens.

    :param ~pyro_mpt.observed_tokens.ObservedTokens tokens: the traced tokens.
    :param callable fn: the guide (used to map a keyword ``data_arg`` to a position).
    :param tuple args: positional arguments of model and guide.
    :param dict kwargs: keyword arguments.
    :param data_arg: None (find it), an int position or a str keyword.
    :param str who: engine name for error messages.
    :rtype: DataArgument
    :raises EngineNotApplicable: when no argument, or several different ones, hold the data.
    """
    n, D = tokens.value.shape
    name = tokens.name
    hint = (
        f"Pass data_arg=<position or keyword> to say which argument holds the tokens "
        f"of site {name!r}: the minibatch itself (shape {tuple(tokens.site_shape)}), or the "
        f"whole dataset indexed by the data plate's subsample indices inside the model (x[idx])."
    )
    if data_arg is not None:
        if isinstance(data_arg, bool) or not isinstance(data_arg, (int, str)):
            raise ValueError(f"{who}: data_arg must be an int position or a str keyword, got {data_arg!r}.")
        key = data_arg
        if isinstance(key, str) and key not in kwargs:
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                params = []
            if key in params and params.index(key) < len(args):
                key = params.index(key)
            else:
                raise ValueError(
                    f"{who}: data_arg={data_arg!r} is neither a keyword argument of this "
                    f"call nor a positional parameter of the guide."
                )
        if isinstance(key, int):
            if not -len(args) <= key < len(args):
                raise ValueError(f"{who}: data_arg={data_arg} but the model got {len(args)} positional argument(s).")
            key = key % len(args)
            value = args[key]
        else:
            value = kwargs[key]
        index = None if _matches(value, tokens) else _subsample_index(tokens)
        if index is not None and _indexed_matches(value, index, tokens):
            return DataArgument(key, value, False, tokens, index)
        if not _matches(value, tokens):
            raise ValueError(
                f"{who}: data_arg={data_arg!r} does not hold the tokens of observed site "
                f"{name!r} (expected a tensor with {n * D} elements equal to them). {hint}"
            )
    else:
        target = tokens.site["value"]
        items = list(enumerate(args)) + list(kwargs.items())
        found = [(k, a) for k, a in items if a is target]
        if not found:
            found = [(k, a) for k, a in items if _matches(a, tokens)]
        index = None
        if not found:
            index = _subsample_index(tokens)
            if index is not None:
                # Pyro's minibatch idiom: the whole dataset, indexed inside the plate (x[idx])
                found = [(k, a) for k, a in items if _indexed_matches(a, index, tokens)]
        if not found:
            raise EngineNotApplicable(
                f"{who} runs the guide on imputed data, but no argument of the model "
                f"equals the value of observed site {name!r}. {hint}"
            )
        if len({id(a) for _, a in found}) > 1:
            keys = ", ".join(repr(k) for k, _ in found)
            raise EngineNotApplicable(
                f"{who}: several arguments ({keys}) equal the tokens of site {name!r}; "
                f"pass data_arg=<position or keyword> to pick one."
            )
        key, value = found[0]
        if index is not None:
            return DataArgument(key, value, False, tokens, index)
    # copies stack along the leading dim only when it is the one datapoint dim
    # and every token plate sits to its right
    rows = (
        len(tokens.datapoint_shape) == 1
        and all(d > -len(tokens.site_batch_shape) for d in tokens.token_dims)
        and value.dim() >= 1
        and value.shape[0] == n
        and value.numel() == n * D
    )
    return DataArgument(key, value, rows, tokens)


_LEAVE_OUT = (
    "conditionals='gaussian', 'quadrature' or 'importance' with proposal='prior' "
    "(each leaves missing tokens out exactly)"
)


def refuse_missing(tokens, who, error=EngineNotApplicable, instead=_LEAVE_OUT):
    """Raise ``error`` when a datapoint has missing (masked) tokens beside observed ones.

    For the paths that run the guide on the data: the guide would read the
    missing tokens' placeholder values as data. Datapoints masked out whole pass
    (:func:`whole_datapoints_missing`).

    :param str instead: the options that leave missing tokens out exactly, named
        in the message (None when the caller has none).
    """
    if tokens.observed is not None and not whole_datapoints_missing(tokens):
        partial = ~tokens.observed.all(-1) & tokens.observed.any(-1)
        k = int((~tokens.observed[partial]).sum())
        fix = "Impute" if instead is None else f"Use {instead}, or impute"
        raise error(
            f"{who} runs the guide on the data, which does not support missing tokens: "
            f"observed site {tokens.name!r} has {k} missing (masked) token(s) in "
            f"{int(partial.sum())} datapoint(s) with observed tokens too. {fix} the missing tokens, "
            f"or drop the datapoints that have them (datapoints masked out whole, such as padding "
            f"rows, are served: each scores 0)."
        )


def whole_datapoints_missing(tokens):
    r"""Whether every missing token of the observed site belongs to a datapoint that has no
    observed token (padding rows masked out whole): the guide reads their placeholder values,
    but a datapoint without observations contributes :math:`\log p(\varnothing) = 0` to the
    estimate whatever they are."""
    observed = tokens.observed
    return observed is not None and bool((observed.all(-1) | ~observed.any(-1)).all())


def guide_latents(tokens):
    """Names of the model's latents that the traced guide samples (empty for a no-op guide)."""
    latent = set(tokens.latent_names)
    return [
        name
        for name, site in tokens.guide_trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site) and name in latent
    ]
