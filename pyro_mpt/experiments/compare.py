r"""Train one model with several losses for the same budget and compare held-out evidence.

:func:`compare` is the "MPT vs ELBO" experiment as a function: every loss
starts from the same initialization (the model factory is called after
``pyro.clear_param_store()`` and ``pyro.set_rng_seed(seed)``), sees the same
minibatches in the same order for the same number of epochs with the same
optimizer, and is scored by the importance-sampled log-marginal likelihood of
held-out data (``Evidence(method="importance")`` with the trained guide as
proposal), with standard errors, PSIS :math:`\hat k` and training wall time.

Loss specifications (strings, see :func:`make_loss`):

========================  ====================================================
``"elbo"``                ``pyro.infer.Trace_ELBO()``
``"iwae[:K]"``            :class:`~pyro_mpt.importance_weighted_elbo.ImportanceWeightedELBO`
                          with ``K`` particles (default 8): the IWAE bound with
                          the minibatch scale outside the log-mean-exp
``"renyi[:K[:alpha]]"``   Pyro's ``RenyiELBO(alpha, num_particles=K)`` (default
                          alpha 0, i.e. IWAE); correct only without subsampling
                          scales, which holds here (the model sees minibatches
                          as its whole data)
``"mpt[:masks[:cond]]"``  :class:`~pyro_mpt.loss.MaskedPretrainingLoss` with
                          ``masks`` (a name such as ``uniform`` or a rate such
                          as ``0.33``; default ``uniform``) and conditional
                          engine ``cond`` (default ``encode_decode``)
========================  ====================================================

MPT trains the model; the guide, which the sampling engines and the evaluation
use as a posterior approximation, is trained by the ELBO alongside
(``mpt_encoder="elbo"``, :class:`~pyro_mpt.guide_elbo.WithGuideELBO`) or by
the MPT loss through the encoder (``mpt_encoder="mpt"``).
"""

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import pyro
from pyro.infer import SVI, RenyiELBO, Trace_ELBO
from pyro.infer.elbo import ELBO
from pyro.optim import Adam

from ..conditionals import ENGINES, EncodeDecodeConditionals, EngineNotApplicable
from ..evidence import Evidence
from ..guide_elbo import WithGuideELBO
from ..importance_weighted_elbo import ImportanceWeightedELBO
from ..importance_weights import ImportanceSamplingWarning
from ..loss import MaskedPretrainingLoss

__all__ = ["compare", "make_loss", "RunResult", "Comparison", "heldout_evidence", "khat_summary"]


@dataclass
class RunResult:
    """The outcome of training with one loss.

    :param str name: the loss's label.
    :param float heldout: mean held-out :math:`\\log p(x_i)` (nats per datapoint).
    :param float stderr: its standard error over held-out datapoints.
    :param float mc_stderr: its Monte Carlo standard error,
        :math:`\\sqrt{\\sum_i \\widehat{se}_i^2}/n`.
    :param float khat_frac: fraction of held-out datapoints with PSIS
        :math:`\\hat k > 0.7` (their estimates are unreliable), among those whose
        :math:`\\hat k` is defined (NaN when none is; see :func:`khat_summary`).
    :param float khat_max: the largest defined :math:`\\hat k`.
    :param float train_time: seconds spent in the optimization steps (``svi.step``) of all
        epochs, not in held-out evaluations; one untimed warm-up step before the run (its
        parameter updates undone) takes the one-time costs of a process's or a loss's first
        step, which would otherwise be charged to whichever loss ran first (see :func:`compare`).
    :param float final_loss: mean training loss per datapoint in the last epoch.
    :param list history: dicts with ``epoch``, ``loss`` (per datapoint) and,
        at evaluations, ``heldout``, ``stderr``.
    :param list values: the final per-datapoint held-out estimates (for paired
        comparisons, see :meth:`Comparison.paired`).
    :param str error: the error message when training failed, else None.
    """

    name: str
    heldout: float = math.nan
    stderr: float = math.nan
    mc_stderr: float = math.nan
    khat_frac: float = math.nan
    khat_max: float = math.nan
    train_time: float = 0.0
    final_loss: float = math.nan
    history: list = field(default_factory=list)
    values: list = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class Comparison:
    """Results of :func:`compare`, one :class:`RunResult` per loss."""

    results: list
    settings: dict = field(default_factory=dict)

    def __getitem__(self, name):
        for r in self.results:
            if r.name == name:
                return r
        names = ", ".join(repr(r.name) for r in self.results)
        raise KeyError(f"No loss named {name!r} in this comparison; its losses are {names}.")

    def paired(self, a, b):
        """Mean held-out difference ``a - b`` over the same datapoints, and its standard error.

        Both models are scored on the same held-out images, so the paired
        standard error is much smaller than either model's own.
        """
        va = torch.tensor(self[a].values, dtype=torch.float64, device="cpu")
        vb = torch.tensor(self[b].values, dtype=torch.float64, device="cpu")
        d = va - vb
        return float(d.mean()), float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else math.nan

    def table(self, reference="elbo"):
        """A plain-text table of the final numbers.

        :param str reference: a loss name; adds the paired difference to it
            (``Δ``, with its paired standard error) when present.
        """
        ok = {r.name for r in self.results if r.error is None and r.values}
        ref = reference if reference in ok else None
        head = f"{'loss':<22} {'held-out log p(x)':>18} {'± s.e.':>8} {'MC s.e.':>8} {'k>0.7':>6} {'time (s)':>9}"
        if ref:
            head += f"  {'Δ vs ' + ref + ' (paired s.e.)':>26}"
        lines = [head, "-" * len(head)]
        for r in self.results:
            if r.error is not None:
                lines.append(f"{r.name:<22} failed: {r.error}")
                continue
            line = (
                f"{r.name:<22} {r.heldout:>18.3f} {r.stderr:>8.3f} {r.mc_stderr:>8.3f} "
                f"{_percent(r.khat_frac):>6} {r.train_time:>9.1f}"
            )
            if ref and r.name in ok and r.name != ref:
                d, se = self.paired(r.name, ref)
                line += f"  {d:>+17.3f} ({se:.3f})"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def to_dict(self):
        """The settings and results as plain data, NaN (an undefined number) as None, so
        that ``json.dump`` writes JSON's ``null``, not the ``NaN`` strict parsers refuse."""
        return _nan_as_none({"settings": self.settings, "results": [asdict(r) for r in self.results]})


def _nan_as_none(obj):
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_as_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_as_none(v) for v in obj]
    return obj


def _number(text, kind, spec):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"Loss spec {spec!r}: {text!r} is not a valid {kind.__name__}.") from None


def _particles(text, spec):
    # 'iwae:0' trained and failed on 'range() arg 3 must not be zero' after the other losses ran
    K = _number(text, int, spec)
    if K < 1:
        raise ValueError(f"Loss spec {spec!r}: K={K} particles; give a positive integer, e.g. '{spec.split(':')[0]}:8'.")
    return K


def make_loss(spec, *, mpt_encoder="elbo", engine_options=None):
    """Build a loss from a specification string (see the module docstring).

    :param spec: a string, a Pyro ``ELBO`` instance (returned as is) or a
        callable returning one.
    :param str mpt_encoder: ``"elbo"`` (the guide is trained by the ELBO
        alongside MPT) or ``"mpt"`` (by the MPT loss through the encoder).
    :param dict engine_options: options for the MPT conditional engine.
    """
    if not isinstance(spec, str):
        if isinstance(spec, type) or (callable(spec) and not hasattr(spec, "loss_and_grads")):
            return spec()  # a class or a factory
        if isinstance(spec, ELBO) or hasattr(spec, "loss_and_grads"):
            return spec
        raise TypeError(f"A loss spec must be a string, an ELBO or a callable, got {spec!r}.")
    if mpt_encoder not in ("elbo", "mpt"):
        raise ValueError(f"mpt_encoder={mpt_encoder!r}: use 'elbo' or 'mpt'.")
    kind, *parts = spec.split(":")
    if kind == "elbo" and not parts:
        return Trace_ELBO()
    if kind == "iwae" and len(parts) <= 1:
        return ImportanceWeightedELBO(_particles(parts[0], spec) if parts else 8)
    if kind == "renyi" and len(parts) <= 2:
        K = _particles(parts[0], spec) if parts else 8
        alpha = _number(parts[1], float, spec) if len(parts) > 1 else 0.0
        if alpha == 1:  # the ELBO's limit, which RenyiELBO refuses in words of its own
            raise ValueError(f"Loss spec {spec!r}: alpha=1 is the ELBO; use 'elbo' (or another alpha, e.g. "
                             f"'renyi:{K}:0.5').")
        return RenyiELBO(alpha=alpha, num_particles=K)
    if kind == "mpt" and len(parts) <= 2:
        masks = parts[0] if parts else "uniform"
        try:
            masks = float(masks)
        except ValueError:
            pass
        cond = parts[1] if len(parts) > 1 else "encode_decode"
        options = dict(engine_options or {})
        if cond == "encode_decode":
            options.setdefault("encoder_grad", mpt_encoder == "mpt")
            engine = EncodeDecodeConditionals(**options)
        elif cond in ENGINES:
            if mpt_encoder == "mpt" and cond != "importance":
                # nothing would train the encoder that the held-out evidence samples from
                raise ValueError(
                    f"Loss spec {spec!r} with mpt_encoder='mpt' (--mpt-encoder mpt): conditionals={cond!r} "
                    f"never runs the guide, so the MPT loss cannot train the encoder, which the held-out "
                    f"evidence then samples from untrained. Use mpt_encoder='elbo' (the default), or "
                    f"conditionals 'encode_decode' or 'importance'."
                )
            if cond == "importance":
                options.setdefault("guide_grad", mpt_encoder == "mpt")
            engine = ENGINES[cond](**options)
        else:
            raise ValueError(f"Loss spec {spec!r}: unknown conditionals {cond!r}; use one of {', '.join(ENGINES)}.")
        loss = MaskedPretrainingLoss(conditionals=engine, masks=masks)
        return WithGuideELBO(loss) if mpt_encoder == "elbo" else loss
    raise ValueError(
        f"Unknown loss spec {spec!r}; use 'elbo', 'iwae[:K]', 'renyi[:K[:alpha]]' or "
        f"'mpt[:masks[:conditionals]]' (e.g. 'mpt:0.33', 'mpt:uniform:importance')."
    )


def _model_guide(made):
    if isinstance(made, tuple):
        return made
    return made.model, made.guide


def heldout_evidence(model, guide, data, num_samples, batch_size=None):
    """Held-out :math:`\\log p(x_i)` with diagnostics: exact where the model has an exact
    evidence (``Evidence(method="exact")``: a Gaussian marginal, discrete latents, an HMM),
    else importance-sampled with the guide as proposal. An importance estimate of a model
    with an exact one is biased low by about half its variance (PPCA without a guide, 4000
    draws: 0.020 nats, 2.4 of its Monte Carlo errors).

    :returns: dict with ``mean``, ``stderr`` (over datapoints), ``mc_stderr`` (0 when
        exact), ``khat_frac``, ``khat_max`` (NaN when exact), the per-datapoint ``values``
        and ``method``, ``"exact"`` or ``"importance"``.
    """
    batch_size = batch_size or data.shape[0]
    values, errs, khats = [], [], []
    method = "exact"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportanceSamplingWarning)
        for start in range(0, data.shape[0], batch_size):
            xb = data[start : start + batch_size]
            res = None
            if method == "exact":
                try:
                    res = Evidence(model, guide, method="exact").estimate(xb)
                except (EngineNotApplicable, ValueError):  # no exact evidence: sampled, from here on
                    method = "importance"
            if res is None:
                res = Evidence(model, guide, method="importance", num_samples=num_samples).estimate(xb)
            values.append(res.log_evidence.reshape(-1))
            errs.append(res.stderr.reshape(-1))
            k = res.diagnostics.get("khat")
            khats.append(k.reshape(-1) if k is not None else torch.full_like(values[-1], math.nan))
    v, e, k = torch.cat(values), torch.cat(errs), torch.cat(khats)
    n = v.numel()
    return {
        "mean": float(v.mean()),
        "stderr": float(v.std() / math.sqrt(n)) if n > 1 else math.nan,
        "mc_stderr": float(e.pow(2).sum().sqrt() / n),
        **khat_summary(k),
        "values": v,
        "method": method,
    }


def khat_summary(khat, threshold=0.7):
    r"""The held-out :math:`\hat k` in two numbers: the fraction above ``threshold`` and the
    largest, over the datapoints whose :math:`\hat k` is defined. A NaN (the tail of tied
    weights of a discrete latent, or fewer than 25 draws: see
    :func:`~pyro_mpt.importance_weights.psis_khat`) says nothing of the weights' reliability,
    so it counts neither as reliable nor as unreliable.

    :param torch.Tensor khat: ``(n,)``, NaN where undefined, :math:`-\infty` for equal weights.
    :param float threshold: the :math:`\hat k` above which an estimate is unreliable.
    :returns: dict with ``khat_frac`` and ``khat_max``, both NaN when no :math:`\hat k` is defined.

    Example::

        >>> khat_summary(torch.tensor([0.2, math.nan, 0.9]))   # {'khat_frac': 0.5, 'khat_max': 0.9}
    """
    known = khat[~torch.isnan(khat)]
    if known.numel() == 0:
        return {"khat_frac": math.nan, "khat_max": math.nan}
    return {"khat_frac": float((known > threshold).double().mean()), "khat_max": float(known.max())}


def _percent(frac):
    """A fraction as a whole percentage, "<1%" (not "0%") for one image in several hundred,
    "n/a" where no k-hat is defined (fewer draws than its fit needs)."""
    if math.isnan(frac):
        return "n/a"
    return "<1%" if 0 < frac < 0.005 else f"{100 * frac:.0f}%"


#: growth of the loss per datapoint over its first step's magnitude (plus one nat) taken for
#: divergence: no model trains through a loss a million times its start
DIVERGENCE_FACTOR = 1e6


def _check_divergence(loss, first, epoch, lr):
    """The first step's loss per datapoint (``first``, None before it), after refusing a step's
    ``loss`` that grew past :data:`DIVERGENCE_FACTOR` times it.

    Adam with too large a learning rate sends a VAE's loss from tens of nats to 1e30 in a step
    or two while it stays finite; the encoder's means then reach 1e15 with scales of 1e-4, which
    float32 rounds to a point mass, and the held-out evaluation refused the guide as a MAP guide
    (AutoDelta, dist.Delta) that the run never had.
    """
    if first is None:
        return loss
    if math.isfinite(loss) and abs(loss) > DIVERGENCE_FACTOR * (abs(first) + 1):
        raise FloatingPointError(
            f"training diverged: the loss per datapoint went from {first:.4g} at the first step to "
            f"{loss:.4g} at epoch {epoch}, most likely because the learning rate lr={lr:g} is too large "
            f"for this model; lower it (pyro-mpt compare --lr, whose default is 0.003)"
        )
    return first


def _fresh_loss(spec):
    """Whether ``make_loss(spec)`` builds a new loss (a string, a class or a factory), not the
    caller's instance."""
    return isinstance(spec, (str, type)) or (callable(spec) and not hasattr(spec, "loss_and_grads"))


def _warm_up(make_model, spec, batch, lr, seed, mpt_encoder, engine_options):
    """One untimed step of a fresh loss of ``spec``, whose parameter updates are undone.

    The first step of a process pays one-time costs (imports on first use, allocator and
    autograd set-up), about 2 s here, which the training time of whichever loss ran first
    absorbed; a loss's own first step pays its lazy set-up. The parameters the step touched get
    their values back and no gradient: a ``make_model`` that returns the same modules each time
    (closures over a global ``nn.Module``) had them trained by the warm-up step, one untimed
    step more in the run's numbers. Failures and warnings are left to the timed run,
    which reports them. A loss instance passed by the caller is not warmed up: a second model
    through it could change it (a JIT-compiled ELBO keeps the first model).
    """
    if not _fresh_loss(spec):
        return
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    params, saved = [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, guide = _model_guide(make_model())
            loss = make_loss(spec, mpt_encoder=mpt_encoder, engine_options=engine_options)
            # the parameters the step will touch, and their values before it
            with pyro.poutine.trace(param_only=True) as seen:
                loss.loss_and_grads(model, guide, batch)
            params = [site["value"].unconstrained() for site in seen.trace.nodes.values()]
            saved = [p.detach().clone() for p in params]
            for p in params:
                p.grad = None
            # a whole step: the optimizer's first step has one-time costs too (about 1 s)
            SVI(model, guide, Adam({"lr": lr}), loss).step(batch)
    except Exception:
        pass
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
            p.grad = None


def compare(
    make_model,
    train,
    test,
    losses=("mpt:0.33", "mpt:uniform", "elbo", "iwae:8"),
    *,
    epochs=20,
    batch_size=128,
    lr=1e-3,
    eval_every=None,
    eval_samples=500,
    final_samples=None,
    seed=0,
    mpt_encoder="elbo",
    engine_options=None,
    log=None,
):
    r"""Train a fresh copy of one model with each loss and compare held-out evidence.

    :param callable make_model: called with no arguments after
        ``pyro.clear_param_store(); pyro.set_rng_seed(seed)``; returns
        ``(model, guide)`` or an object with ``model`` and ``guide`` methods
        (e.g. :class:`~pyro_mpt.experiments.vae.DeepVAE`). Model and guide take one
        minibatch tensor ``(B, D)`` and plate over ``x.shape[0]``.
    :param torch.Tensor train: training data ``(N, D)``.
    :param torch.Tensor test: held-out data ``(N', D)``.
    :param losses: loss specs (see :func:`make_loss`), or a dict label -> spec.
    :param int epochs: passes over ``train``.
    :param int batch_size: minibatch size.
    :param float lr: Adam learning rate (``pyro-mpt compare``'s default is 3e-3).
    :param int eval_every: evaluate the held-out evidence every this many
        epochs (into ``history``); None: only at the end.
    :param int eval_samples: importance samples per held-out datapoint during training.
    :param int final_samples: importance samples for the final numbers (default ``eval_samples``).
    :param int seed: seed of initialization, minibatch order and sampling.
    :param str mpt_encoder: how MPT runs train the guide: ``"elbo"`` or ``"mpt"``.
    :param dict engine_options: options of the MPT conditional engine.
    :param callable log: called with a progress string after each evaluation (e.g. ``print``).
    :rtype: Comparison

    Before each loss's run, a fresh loss of the same spec takes one untimed step whose parameter
    updates are undone (values restored, gradients cleared), so that each
    ``train_time`` counts the loss's steps and not one-time costs (about 2 s of imports and
    first-call set-up went to whichever loss ran first); the run itself starts from the same
    seed and parameters as without it. A loss passed as an instance gets no such step.

    Example::

        >>> train, test = load_dataset("digits")
        >>> res = compare(lambda: DeepVAE(64, 4), train, test, ["mpt:0.33", "elbo"], epochs=10)
        >>> print(res.table())
    """
    if isinstance(losses, dict):
        items = list(losses.items())
    else:
        items = [(spec if isinstance(spec, str) else type(spec).__name__, spec) for spec in losses]
    final_samples = final_samples or eval_samples
    N = train.shape[0]
    results = []
    for name, spec in items:
        _warm_up(make_model, spec, train[:batch_size], lr, seed, mpt_encoder, engine_options)
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        model, guide = _model_guide(make_model())
        result = RunResult(name)
        try:
            loss = make_loss(spec, mpt_encoder=mpt_encoder, engine_options=engine_options)
            svi = SVI(model, guide, Adam({"lr": lr}), loss)
            order = torch.Generator().manual_seed(seed)
            first = None
            for epoch in range(1, epochs + 1):
                perm = torch.randperm(N, generator=order, device="cpu")
                total = 0.0
                start = time.perf_counter()
                for i in range(0, N, batch_size):
                    batch = train[perm[i : i + batch_size]]
                    step = svi.step(batch)
                    total += step
                    first = _check_divergence(step / batch.shape[0], first, epoch, lr)
                result.train_time += time.perf_counter() - start
                entry = {"epoch": epoch, "loss": total / N}
                if not math.isfinite(entry["loss"]):
                    raise FloatingPointError(
                        f"the loss became {entry['loss']} at epoch {epoch}; lower the learning "
                        f"rate (lr=...) or check the model's scales"
                    )
                if eval_every and (epoch % eval_every == 0 or epoch == epochs):
                    ev = heldout_evidence(model, guide, test, eval_samples)
                    entry.update(heldout=ev["mean"], stderr=ev["stderr"])
                    if log is not None:
                        log(f"[{name}] epoch {epoch}: loss/datapoint {entry['loss']:.3f}, held-out log p(x) {ev['mean']:.3f} ± {ev['stderr']:.3f}")
                result.history.append(entry)
            result.final_loss = result.history[-1]["loss"] if result.history else math.nan
            ev = heldout_evidence(model, guide, test, final_samples)
            result.heldout, result.stderr, result.mc_stderr = ev["mean"], ev["stderr"], ev["mc_stderr"]
            result.khat_frac, result.khat_max = ev["khat_frac"], ev["khat_max"]
            result.values = ev["values"].tolist()
        except Exception as e:  # record the failure, go on with the other losses
            result.error = f"{type(e).__name__}: {e}"
            if log is not None:
                log(f"[{name}] failed: {result.error}")
        results.append(result)
    settings = dict(
        epochs=epochs, batch_size=batch_size, lr=lr, eval_samples=eval_samples,
        final_samples=final_samples, seed=seed, mpt_encoder=mpt_encoder,
        num_train=N, num_test=test.shape[0],
    )
    return Comparison(results, settings)
