r"""Masked conditionals by self-normalized importance sampling.

For a model whose tokens are independent given latents :math:`z` local to each
datapoint, with draws :math:`z_s \sim r(z)` from a proposal,

.. math::

    p(x_j \mid x_{\mathcal R}) \approx
    \frac{\sum_s w_s\, p(x_j \mid z_s)}{\sum_s w_s}, \qquad
    w_s = \frac{p(x_{\mathcal R} \mid z_s)\, p(z_s)}{r(z_s)},

consistent as :math:`S \to \infty` for any proposal that covers the posterior
:math:`p(z \mid x_{\mathcal R})`. Any number of latent sites and dims, any
factorized observation (Bernoulli, Normal, Categorical, Poisson, ...).

Two proposals (``proposal=``):

* ``"prior"`` -- :math:`r = p(z)`, so :math:`w_s = p(x_{\mathcal R} \mid z_s)`.
  One model run with :math:`S` prior draws per datapoint gives a table
  :math:`T_{sd} = \log p(x_d \mid z_s)` shared by every query; each block of
  masks is then two matrix products (the machinery of
  :mod:`~pyro_mpt.conditionals.quadrature`, with the draws as equally weighted
  nodes). All conditionals then come from one joint -- the empirical mixture
  :math:`\frac1S\sum_s p(x \mid z_s)` -- so the chain rule telescopes exactly to
  its :math:`\log p(x)` estimate and the ``"order"`` schedule has zero variance
  given the draws. Good for few tokens or broad posteriors; with many tokens
  the posterior is much narrower than the prior and the effective sample size
  collapses (watch the ``"ess"`` of
  :meth:`ImportanceConditionals.mask_log_prob_and_diagnostics`). Reparameterized
  draws carry the prior's parameters' gradient along their path; discrete ones by
  the score function, a term :math:`\log p(z_s) - \log p(z_s)|_{\text{detached}}`
  of value 0 in each draw's weight (a sampled mixture's weights got no gradient
  without it).
* ``"guide"`` -- a mixture of the guide run on *imputed* data,
  :math:`r(z) = \frac1C\sum_{c=1}^C q(z \mid \tilde x^{(c)})`, where
  :math:`\tilde x^{(c)} = (x_{\mathcal R}, \tilde x^{(c)}_{\mathcal M})` are
  the states of ``num_chains`` (:math:`C`) encode–decode chains after
  ``num_iterations`` sampling rounds (see
  :class:`~pyro_mpt.conditionals.encode_decode.EncodeDecodeConditionals`;
  masked tokens start at ``init``). Since
  :math:`p(z \mid x_{\mathcal R}) = \mathbb E_{p(x_{\mathcal M}\mid x_{\mathcal R})}
  [p(z \mid x_{\mathcal R}, x_{\mathcal M})]`, this mixture approaches the
  posterior given the context when the guide is close to the full posterior
  and the chains mix, whereas a single :math:`q(z \mid \tilde x)` is as narrow
  as the posterior given all :math:`D` tokens and makes the weights
  heavy-tailed. A share ``prior_weight`` (:math:`\alpha`, default 0.1) of the
  draws comes from the prior, making the proposal the *defensive* mixture
  :math:`\alpha\,p(z) + (1-\alpha)\,r(z)` (Hesterberg 1995), whose weights
  are bounded by :math:`p(x_{\mathcal R}\mid z)/\alpha`: without it, a
  proposal narrower than the posterior gives weights with no finite variance,
  and both the estimate and its standard error are unreliable. Equal shares of
  the remaining draws come from each chain, and every draw is scored under all
  :math:`C` components (one extra guide run with the draws replayed). Draws are per query,
  vectorized over queries as in encode–decode. If the argument holding the data
  cannot be found (see
  :func:`~pyro_mpt.conditionals.data_args.locate_data_arg`), or with
  ``impute=False``, the guide runs on the original data, in the same defensive
  mixture with the prior (it is as narrow as the posterior given all tokens);
  the engine says so once, at INFO level on the ``"pyro_mpt"`` logger, where the
  argument was not found.
  Pyro's autoguides (``AutoNormal``, ``AutoDiagonalNormal``,
  ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``, an
  ``AutoGuideList`` of them) do not read the data, so imputation would not
  change them: their proposal is the defensive mixture
  :math:`\alpha\,p(z) + (1-\alpha)\,q(z)` for every query, drawn once per
  call into a table shared by all queries (as for the prior), with the
  density :math:`q(z)` of :class:`~pyro_mpt.conditionals.guide_proposals.AutoguideProposal`.
  The estimate trains the model only: its gradient does not reach the
  guide's parameters (``guide_grad=False``, as ``"encode_decode"``'s
  ``encoder_grad=False``), since the exact conditionals do not depend on the
  proposal; train the guide toward the posterior alongside, with
  :class:`~pyro_mpt.guide_elbo.WithGuideELBO`.
* ``"auto"`` (default) -- ``"guide"`` when a guide that samples the model's
  latents is given, else ``"prior"`` (e.g. with the no-op guide
  ``lambda x: None`` usual for MPT). With missing (masked) tokens beside
  observed ones in a datapoint ``"auto"`` is ``"prior"``: the prior proposal
  leaves missing tokens out exactly, and the guide proposal refuses them;
  datapoints masked out whole (padding rows) do not count, they score 0.

**Diagnostics.** :meth:`ImportanceConditionals.mask_log_prob_and_diagnostics`
(and ``chain_log_prob_and_diagnostics``) return with the log-conditionals
(detached) ``"ess"`` -- the effective sample size
:math:`(\sum_s w_s)^2 / \sum_s w_s^2` per query and datapoint, ``(q, n)``
(``(p, n, D)`` per position for orderings) -- and, for mask queries,
``"stderr"`` ``(q, n, D)``: the delta-method standard error of each
log-conditional,

.. math::

    \widehat{\operatorname{se}}^2 = \frac{S}{S-1}\sum_s (\pi_{sj} - \omega_s)^2,
    \quad \omega_s = \frac{w_s}{\sum_t w_t},\;
    \pi_{sj} = \frac{w_s p(x_j\mid z_s)}{\sum_t w_t p(x_j\mid z_t)}.
"""

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..counts import is_count
from ..guide_checks import check_proposal_density
from .guide_proposals import is_autoguide
from ..importance_weights import effective_sample_size, poor_weights, psis_khat, warn_poor_weights
from .base import ConditionalEngine, EngineNotApplicable, ordering_ranks
from .distributions import check_factorized
from .encode_decode import initial_tokens
from .data_args import guide_latents, locate_data_arg, refuse_missing, whole_datapoints_missing
from .draw_table import DrawTable
from .importance_guide import autoguide_draws, guide_draws
from .importance_self_normalized import self_normalized_conditionals
from .latent_runs import GuideMemory, LatentRunner, check_draws_log_density, logmeanexp
from .mixture import chain_terms, combine_partials, normalize_empty
from ..recompute import recomputed, rerunning

__all__ = ["ImportanceConditionals", "ImportanceState"]

#: the warning's pointer to the exact engines: not one engine by name, since the model at hand
#: may meet none of them ("auto" has then already tried each, and its INFO log says why each
#: declined; naming 'gaussian' or 'quadrature' sent users to engines that refused their model)
EXACT_ENGINES_HINT = (
    "an exact engine where one serves the model ('gaussian', 'enumerate', 'hmm', 'hierarchical', "
    "'quadrature': conditionals='auto' tries each first, and logging at INFO level says why each "
    "declined)."
)


@dataclass
class ImportanceState:
    """State of one loss evaluation.

    :param str proposal: ``"prior"`` or ``"guide"``.
    :param table: for the prior (or an autoguide): the
        :class:`~pyro_mpt.conditionals.draw_table.DrawTable` of the ``S`` draws shared by
        every query (log-weights ``(1|n, S)``, :math:`T` ``(n, S, D)``, in chunks).
    :param runner: the :class:`~pyro_mpt.conditionals.latent_runs.LatentRunner`.
    :param init: for the guide: initial masked tokens ``(n|1, D)``.
    :param bool imputed: for the guide: whether it sees imputed data.
    """

    proposal: str
    num_data: int
    num_tokens: int
    runner: LatentRunner = field(repr=False)
    table: Optional[DrawTable] = field(default=None, repr=False)
    init: Optional[torch.Tensor] = None
    imputed: bool = True
    #: the weights' diagnostics over this evaluation, per datapoint: ``"khat"``
    #: (largest :math:`\hat k`, NaN where undefined) and ``"ess"`` (smallest ESS)
    diagnostics: dict = field(default_factory=dict)
    warned: bool = False
    #: bool ``(n,)``, the datapoints with observed tokens, or None (all): a datapoint masked out
    #: whole scores 0 whatever its weights, so they are not judged
    present: Optional[torch.Tensor] = None


class ImportanceConditionals(ConditionalEngine):
    r"""Masked conditionals by self-normalized importance sampling.

    Serves models whose tokens are independent given latents local to each
    datapoint (any number of latent sites and dims, continuous or discrete).
    See the module docstring for the estimator, the proposals and the
    diagnostics.

    :param int num_samples: :math:`S`, draws per datapoint (prior) or per query
        and datapoint (guide).
    :param str proposal: ``"auto"``, ``"prior"`` or ``"guide"``.
    :param bool impute: for the guide: run it on imputed data (True) or on the
        original data (False).
    :param init: for the guide: initial masked tokens, ``"prior_mean"``,
        ``"data_mean"`` or a number.
    :param int num_chains: for the guide: :math:`C`, encode–decode chains whose
        states define the mixture proposal (at most the guide's share of the draws).
    :param float prior_weight: for the guide: share :math:`\alpha` of the draws
        taken from the prior, making the proposal the *defensive* mixture
        :math:`\alpha\, p(z) + (1 - \alpha)\, r(z)` whose weights are bounded
        by :math:`p(x_{\mathcal R} \mid z)/\alpha` (the draws are split
        deterministically: :math:`C\lfloor S(1-\alpha)/C\rfloor` from the chains,
        the rest from the prior, and the mixture uses those exact shares).
    :param int num_iterations: for the guide: sampling encode–decode rounds of
        each chain before the draws.
    :param data_arg: which model/guide argument holds the tokens (None: found).
    :param bool guide_grad: for the guide: let the estimate's gradient reach the
        guide's parameters through its draws and density. Off by default: the
        exact conditionals do not depend on the proposal, so that gradient
        only rewards the self-normalized estimate's bias, and trains the guide
        away from the posterior (an overconfident proposal; SVI with an
        ``AutoNormal`` guide ended 2.9 nats of log p(x) below the maximum
        likelihood fit on 200 Gamma-Poisson datapoints). The model's gradient is
        the same either way. Train the guide by its own objective,
        :class:`~pyro_mpt.guide_elbo.WithGuideELBO`, as for ``"encode_decode"``.
    :param bool diagnostics: compute the diagnostics (ESS, standard
        errors, :math:`\hat k`) at each call and warn when the weights are
        poor (once per engine: in a training loop every step is an evaluation,
        and a warning per step flooded the output; ``poor_weight_evaluations``
        counts the evaluations with poor weights, each state's ``diagnostics``
        holds their numbers); costs a few extra matrix products and one Pareto
        fit per datapoint and block of queries.
    :param float khat_threshold: warn when a :math:`\hat k` exceeds it.
    :param float min_ess: where :math:`\hat k` is undefined (tied weights of
        a discrete latent, :math:`S \le 20`) or not fitted, warn when the ESS is
        below it.
    :param bool psis: fit :math:`\hat k` (PSIS, as ``arviz.psislw``); False judges the
        weights by their ESS alone.
    :param int max_elements: bound on ``S * q * n * D`` per chunk of queries
        (guide; every chunk after the first is recomputed in the backward pass), on
        ``S_c * n * D`` per chunk of the shared table's draws (prior, autoguide) and on
        intermediates of the ordering path.
    :param int cache_elements: for the draws shared by every query (prior, autoguide):
        table entries (``S * n * D``) kept for the whole evaluation, in chunks of draws
        from the first; the other chunks are drawn again at every block of queries and in
        the backward pass, so that peak memory is about ``cache_elements`` kept entries (each
        with its exp-space copy, gradient buffer and one block's gradient, about 18 bytes in
        float32; not the model's intermediates) plus one chunk's working set (``max_elements``
        entries with the model's intermediates), whatever ``S * n * D``. 0 streams every
        chunk, at the price of model runs at every block of queries. See
        :mod:`~pyro_mpt.conditionals.draw_table`.

    Example::

        >>> engine = ImportanceConditionals(num_samples=1000, proposal="prior")
        >>> loss = MaskedPretrainingLoss(conditionals=engine, masks="order")
        >>> loss.score(model, None, x)
        >>> out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
        >>> diag["ess"].min()
    """

    def __init__(
        self,
        num_samples=256,
        *,
        proposal="auto",
        impute=True,
        init="prior_mean",
        num_chains=8,
        prior_weight=0.1,
        num_iterations=3,
        data_arg=None,
        guide_grad=False,
        diagnostics=True,
        khat_threshold=0.7,
        min_ess=10.0,
        psis=True,
        max_elements=2**24,
        cache_elements=2**27,
    ):
        super().__init__(max_elements=max_elements)
        #: evaluations whose weights were poor (the first one warns)
        self.poor_weight_evaluations = 0
        if not is_count(num_samples):
            raise ValueError(f"ImportanceConditionals(num_samples={num_samples!r}): give a positive integer.")
        if proposal not in ("auto", "prior", "guide"):
            raise ValueError(f"ImportanceConditionals(proposal={proposal!r}): use 'auto', 'prior' or 'guide'.")
        if not is_count(num_iterations, minimum=0):
            raise ValueError(f"ImportanceConditionals(num_iterations={num_iterations!r}): give an integer >= 0.")
        if not 0.0 <= float(prior_weight) < 1.0:
            raise ValueError(
                f"ImportanceConditionals(prior_weight={prior_weight!r}): give a fraction in [0, 1)."
            )
        if not is_count(cache_elements, minimum=0):
            raise ValueError(
                f"ImportanceConditionals(cache_elements={cache_elements!r}): give an integer >= 0, the "
                f"table entries kept for every query (0 streams the draws)."
            )
        self.cache_elements = int(cache_elements)
        if not is_count(num_chains):
            raise ValueError(f"ImportanceConditionals(num_chains={num_chains!r}): give a positive integer.")
        self.prior_weight = float(prior_weight)
        self.num_chains = int(num_chains)
        self.num_samples = int(num_samples)
        self.proposal = proposal
        self.impute = bool(impute)
        self.init = init
        self.num_iterations = int(num_iterations)
        self.data_arg = data_arg
        self.guide_grad = bool(guide_grad)
        self.diagnostics = bool(diagnostics)
        self.khat_threshold = float(khat_threshold)
        self.min_ess = float(min_ess)
        self.psis = bool(psis)
        self.memory = GuideMemory()  # what it remembers about the guide, see GuideMemory

    def __repr__(self):
        return f"ImportanceConditionals(num_samples={self.num_samples}, proposal={self.proposal!r})"

    # ------------------------------------------------------------------ prepare
    def averages_hidden_draws(self):
        """True: the values are averages over the model's runs at sampled latents (see
        :meth:`~pyro_mpt.conditionals.base.ConditionalEngine.averages_hidden_draws`)."""
        return True

    def prepare(self, tokens, model, guide, args, kwargs):
        who = "conditionals='importance'"
        check_factorized(tokens.site["fn"], tokens.name, who)
        proposal = self.proposal
        covered = guide is not None and bool(guide_latents(tokens))
        present = tokens.present
        if proposal == "auto":
            proposal = "guide" if covered and (tokens.observed is None or whole_datapoints_missing(tokens)) else "prior"
        if proposal == "guide":
            check_proposal_density(
                tokens, who, "a guide with a density over the latents (e.g. AutoNormal), "
                "proposal='prior', or conditionals='gaussian' / 'quadrature' where the model allows",
            )
            if is_autoguide(guide):
                # it does not read the data, so missing tokens are no obstacle
                runner, draw = autoguide_draws(
                    tokens, model, guide, args, kwargs, who, self.num_samples, self.prior_weight, self.guide_grad,
                )
                return ImportanceState(
                    "guide", tokens.num_data, tokens.num_tokens, runner, table=self._table(draw, tokens),
                    imputed=False, present=present,
                )
            refuse_missing(tokens, f"{who} with proposal='guide'")
        n, D = tokens.num_data, tokens.num_tokens
        if proposal == "prior":
            runner = LatentRunner(tokens, model, None, args, kwargs, None, who)
            S = self.num_samples

            def draw(start, rows):
                dec = runner.sample_prior(rows)
                T = dec.token_log_prob(tokens.value).transpose(0, 1)  # (n, rows, D)
                check_draws_log_density(runner, T, "the prior")
                logw = T.new_full((1, rows), -math.log(S))
                score = dec.drawn_score_terms()
                if score is not None:
                    # discrete draws carry their prior's parameters' gradient by the score function
                    logw = logw + score.T.to(logw.dtype)
                return logw, T

            return ImportanceState("prior", n, D, runner, table=self._table(draw, tokens), present=present)
        if not covered:
            raise ValueError(
                f"{who} with proposal='guide' needs a guide that samples the model's "
                f"latents ({', '.join(map(repr, tokens.latent_names))}); pass one, or "
                f"use proposal='prior'."
            )
        data = None
        if self.impute:
            try:
                data = locate_data_arg(tokens, guide, args, kwargs, self.data_arg, who)
            except EngineNotApplicable as e:
                if self.data_arg is not None:
                    raise
                # said (at INFO, once per engine): the proposal is then the guide on the full data,
                # not on imputed contexts, which a user passing a minibatch would not guess
                if not self.memory.said_original_data:
                    self.memory.said_original_data = True
                    logging.getLogger("pyro_mpt").info(
                        "%s runs the guide on the original data, not on imputed contexts (in the defensive "
                        "mixture with the prior): %s", who, e,
                    )
        runner = LatentRunner(tokens, model, guide, args, kwargs, data, who, self.memory)
        init = initial_tokens(runner, self.init, who) if data is not None else None
        return ImportanceState("guide", n, D, runner, init=init, imputed=data is not None, present=present)

    def _table(self, draw, tokens):
        n, D = tokens.num_data, tokens.num_tokens
        step = max(1, self.max_elements // max(1, n * D))
        return DrawTable(draw, self.num_samples, step, self.cache_elements, n, D)

    # ------------------------------------------------------------------ queries
    def mask_log_prob(self, state, x, mask):
        return self.mask_log_prob_and_diagnostics(state, x, mask)[0]

    def mask_log_prob_and_diagnostics(self, state, x, mask):
        r""":meth:`mask_log_prob` with the diagnostics of its weights.

        :returns: the log-conditionals ``(q, n, D)`` and a dict of detached
            tensors (None with ``diagnostics=False``): ``"ess"`` ``(q, n)``,
            ``"stderr"`` ``(q, n, D)``, ``"khat"`` ``(n,)`` (each datapoint's
            query with the fewest effective samples), ``"num_samples"`` and
            ``"proposal"``. See the module docstring.

        Example::

            >>> out, diag = engine.mask_log_prob_and_diagnostics(state, x, mask)
            >>> diag["ess"].min(), diag["khat"].max()
        """
        self._check_x(state, x)
        if state.table is not None:
            return self._prior_mask(state, mask)
        S = self.num_samples
        n, D = x.shape
        per = max(1, self.max_elements // (S * n * D))
        outs, ess, err, khats = [], [], [], []
        for start in range(0, mask.shape[0], per):
            # every chunk of queries after the first is recomputed in the backward pass: kept,
            # each would hold its S * q * n * D draws' intermediates to the end
            if start == 0:
                o, e, s, k = self._guide_block(state, x, mask[start : start + per])
            else:
                o, e, s, k = recomputed(self._guide_block, state, x, mask[start : start + per])
            outs.append(o)
            ess.append(e)
            err.append(s)
            khats.append(k)
        diagnostics = None
        if self.diagnostics:
            diagnostics = {
                "ess": torch.cat(ess, 0),
                "stderr": torch.cat(err, 0),
                "khat": functools.reduce(torch.fmax, khats),
                "num_samples": S,
                "proposal": "guide",
            }
        return torch.cat(outs, 0), diagnostics

    def leave_one_out_log_prob(self, state, x, observed=None):
        r"""Every token's conditional given all the others from the draws' one table
        (prior draws, or an autoguide's), ``(n, D)``:
        :math:`\operatorname{logsumexp}_s(\log w_s + L_s) - \operatorname{logsumexp}_s(\log w_s
        + L_s - T_{sj})` with :math:`L_s = \sum_d T_{sd}`, what the per-query path computes
        for the :math:`D` queries at :math:`O(SnD^2)`, here :math:`O(SnD)`; the weights'
        diagnostics (effective samples, :math:`\hat k` of each datapoint's worst query)
        as there. None for draws per query (a guide run on each context), a token
        impossible at a draw, or one token."""
        self._check_x(state, x)
        table = state.table
        if table is None or state.num_tokens < 2 or observed is not None:
            return None
        diagnose = self.diagnostics and not rerunning()
        moments = []  # each chunk's squared partials, made as the value's pass draws it
        visit = (lambda chunk: moments.append(chunk.squared().leave_one_out_partials()[1:])) if diagnose else None
        num, den = table.reduce(lambda chunk: chunk.leave_one_out_partials(), visit=visit)  # (n,), (n, D)
        if not (bool(torch.isfinite(num).all()) and bool(torch.isfinite(den).all())):
            return None
        if diagnose:
            with torch.no_grad():
                (den2,) = _combined(moments)
                ess = torch.exp(2 * den.detach() - den2)  # 1 / sum of the squared normalized weights
                worst = ess.argmin(-1)  # each datapoint's query with the fewest effective samples
                rows = torch.arange(x.shape[0], device=x.device)
                log_weights = torch.cat([c.joint() - c.table[rows, :, worst] for c in table.parts()], -1)  # (n, S)
                self._check_weights(state, log_weights.T, ess.amin(-1))
        return num.unsqueeze(-1) - den

    def _prior_mask(self, state, mask):
        table = state.table
        # the backward pass's second run of a block reports nothing: the first run did
        diagnose = self.diagnostics and not rerunning()
        moments = []  # each chunk's second moments, made as the value's pass draws it
        visit = (lambda chunk: moments.append(chunk.second_moments(~mask))) if diagnose else None
        num, den = table.reduce(lambda chunk, m: chunk.mask_partials((~m).to(chunk.table.dtype)), mask, visit=visit)
        den = normalize_empty(den, ~mask)
        out = num - den.unsqueeze(-1)
        diagnostics = None
        if diagnose:
            with torch.no_grad():
                ctx = (~mask).to(out.dtype)
                b2, a2, c = _combined(moments)
                a, b = den.detach(), num.detach()
                sum_w2 = torch.exp(a2 - 2 * a)
                S = self.num_samples
                var = torch.exp(b2 - 2 * b) - 2 * torch.exp(c - a.unsqueeze(-1) - b) + sum_w2.unsqueeze(-1)
                # an empty context's conditional is the plain average sum_s w_s p(x_j | z_s) (its
                # normalizer is 1, not the weights' sum): its delta-method variance has the equal
                # shares 1/S where the self-normalized one has omega_s. Equal for the prior's equal
                # weights; an autoguide's weights gave standard errors 0.7x the scatter over seeds
                empty = ~(ctx > 0).any(-1, keepdim=True)  # (q, n|1, 1)
                var = torch.where(empty, torch.exp(b2 - 2 * b) - 1.0 / S, var)
                err = (var.clamp_min(0) * S / max(S - 1, 1)).sqrt()
                ess = 1.0 / sum_w2
                n = ess.shape[1]
                worst = ess.argmin(0)  # each datapoint's query with the fewest effective samples
                ctx_w = ctx.expand(ess.shape + ctx.shape[-1:])[worst, torch.arange(n, device=worst.device)]
                khat = self._check_weights(state, _context_log_weights(table, ctx_w), ess.amin(0))
                diagnostics = {
                    "ess": ess,
                    "stderr": err,
                    "khat": khat,
                    "num_samples": S,
                    "proposal": state.proposal,
                }
        return out, diagnostics

    def _guide_block(self, state, x, mask):
        S = self.num_samples
        q = mask.shape[0]
        n, D = x.shape
        lw0, T = guide_draws(
            state.runner, x, mask, state.init, state.imputed,
            S, self.prior_weight, self.num_chains, self.num_iterations, self.guide_grad,
        )
        ctx = (~mask).to(T.dtype).expand(q, n, D)
        out, lw, omega, sum_pi2, sum_pi_omega = self_normalized_conditionals(lw0, T, ctx)
        ess = err = khat = None
        if self.diagnostics:
            with torch.no_grad():
                sum_omega2 = omega.pow(2).sum(0)
                ess = 1.0 / sum_omega2
                # sum_s (pi_sj - omega_s)^2, expanded so that no (S, q, n, D) temporary is formed
                var = (sum_pi2 - 2 * sum_pi_omega + sum_omega2.unsqueeze(-1)).clamp_min(0)
                err = (var * S / max(S - 1, 1)).sqrt()
                worst = ess.argmin(0)
                lw_w = lw[:, worst, torch.arange(n, device=worst.device)]
                khat = self._check_weights(state, lw_w, ess.amin(0))
        return out, ess, err, khat

    def chain_log_prob(self, state, x, order):
        return self.chain_log_prob_and_diagnostics(state, x, order)[0]

    def chain_log_prob_and_diagnostics(self, state, x, order):
        r""":meth:`chain_log_prob` with the diagnostics of its weights.

        :returns: the chain-rule terms ``(p, n, D)`` and a dict (None with
            ``diagnostics=False``) holding ``"num_samples"`` and
            ``"proposal"``; with the prior's draws also ``"ess"`` per position
            ``(p, n, D)`` and ``"khat"`` ``(n,)`` (each datapoint's position
            with the fewest effective samples). The guide's per-query
            diagnostics come from :meth:`mask_log_prob_and_diagnostics`.

        Example::

            >>> terms, diag = engine.chain_log_prob_and_diagnostics(state, x, order)
            >>> terms.sum(-1), diag["ess"].min()
        """
        self._check_x(state, x)
        table = state.table
        if table is None:
            terms = super().chain_log_prob(state, x, order)
            return terms, {"num_samples": self.num_samples, "proposal": state.proposal} if self.diagnostics else None
        diagnose = self.diagnostics and not rerunning()
        moments = []  # each chunk's squared partials, made as the value's pass draws it
        visit = (lambda chunk: moments.append((chunk.squared().chain_partials(order, self.max_elements),))) if diagnose else None
        (L,) = table.reduce(lambda chunk, o: (chunk.chain_partials(o, self.max_elements),), order, visit=visit)
        diagnostics = None
        if diagnose:
            with torch.no_grad():
                (L2,) = _combined(moments)
                # weights of position t use the context after it: entry t + 1 (the partials of
                # the weights themselves are L's, made above)
                ess = torch.exp(2 * L.detach()[..., 1:] - L2[..., 1:])
                khat = self._check_chain(state, table, order, ess)
                diagnostics = {
                    "ess": ess, "khat": khat, "num_samples": self.num_samples, "proposal": state.proposal
                }
        # the prior integrates to one: the empty context (last entry) has normalizer 1
        return chain_terms(L), diagnostics

    def log_evidence(self, state, x):
        r"""Importance-sampled :math:`\log p(x_i)`, ``(n,)``: the prior draws' mixture, or the guide on the full data."""
        self._check_x(state, x)
        if state.table is not None:
            joints = []  # each chunk's log-joints (n, S_c), made as the value's pass draws it
            visit = (lambda chunk: joints.append(chunk.joint())) if self.diagnostics else None
            (value,) = state.table.reduce(lambda chunk: (torch.logsumexp(chunk.joint(), -1),), visit=visit)
            if self.diagnostics:
                lw = torch.cat(joints, -1).T  # (S, n)
                with torch.no_grad():
                    self._check_weights(state, lw, effective_sample_size(lw))
            return value
        lw = state.runner.log_weights(self.num_samples)
        if self.diagnostics:
            with torch.no_grad():
                self._check_weights(state, lw.detach(), effective_sample_size(lw))
        return logmeanexp(lw, 0)

    # ------------------------------------------------------------------ diagnostics
    def _check_weights(self, state, log_weights, ess):
        """k-hat of ``log_weights`` ``(S, n)`` (each datapoint's worst query), folded into
        ``state.diagnostics``; warns at the engine's first evaluation with poor weights."""
        khat, _ = psis_khat(log_weights, fit=self.psis and log_weights.shape[0] >= 10)
        if state.present is not None:
            # what a datapoint's tied weights give (the prior proposal's for a row masked out whole)
            khat = torch.where(state.present, khat, torch.full((), -math.inf, dtype=khat.dtype, device=khat.device))
            ess = torch.where(state.present, ess, torch.full((), float(log_weights.shape[0]), dtype=ess.dtype, device=ess.device))
        diag = state.diagnostics
        if diag:
            diag["khat"] = torch.fmax(diag["khat"], khat)
            diag["ess"] = torch.fmin(diag["ess"], ess)
        else:
            diag["khat"], diag["ess"] = khat, ess
        if not state.warned and bool(poor_weights(khat, ess, self.khat_threshold, self.min_ess).any()):
            state.warned = True
            self.poor_weight_evaluations += 1
            if self.poor_weight_evaluations == 1:
                warn_poor_weights(
                    "conditionals='importance'",
                    "datapoint(s) (each judged by its query with the fewest effective samples)",
                    khat, ess,
                    ("The proposal is the guide: train it toward the posterior alongside the model, "
                     "e.g. SVI(..., loss=WithGuideELBO(MaskedPretrainingLoss(...))) (pyro_mpt.guide_elbo), "
                     "whose first steps still draw poorly; or use more samples (num_samples=...), or "
                     + EXACT_ENGINES_HINT
                     if state.proposal == "guide" else
                     "Use proposal='guide' with a guide close to the posterior, more samples "
                     "(num_samples=...), or " + EXACT_ENGINES_HINT),
                    self.khat_threshold, self.min_ess,
                )
        return khat

    def _check_chain(self, state, table, order, ess):
        """:meth:`_check_weights` for orderings: each datapoint's position with the fewest
        effective samples, ``ess`` ``(p, n, D)``; ``table`` the draws."""
        p, n, D = ess.shape
        k = ess.permute(1, 0, 2).reshape(n, p * D).argmin(1)
        i, t = k // D, k % D
        ranks = ordering_ranks(order)
        ranks = ranks.expand(p, n, D)[i, torch.arange(n, device=order.device)]  # (n, D)
        ctx = ranks > t[:, None]  # the context after position t
        return self._check_weights(state, _context_log_weights(table, ctx), ess.permute(1, 0, 2).reshape(n, -1).amin(1))


def _combined(parts):
    """The chunks' partial log-sums (an iterable of tuples), combined with logaddexp."""
    total = None
    for part in parts:
        total = combine_partials(total, part)
    return total


def _context_log_weights(table, ctx):
    r"""Each draw's log-weight given one context per datapoint, ``(S, n)``: :math:`\log w_{is} +
    \sum_d c_{id} T_{isd}` for ``ctx`` ``(n, D)`` (bool or float), detached. The draws' own
    log-weights are in it: an autoguide's table weighs them by :math:`p(z)/r(z)` (constant for the
    prior); without them its k-hat was that of the likelihood alone."""
    with torch.no_grad():
        parts = []
        for chunk in table.parts():
            c = ctx.to(chunk.table.dtype)
            parts.append(torch.einsum("nsd,nd->sn", chunk.table, c) + chunk.log_weights.T)
        return torch.cat(parts, 0)
