"""Blocks of queries are recomputed in the backward pass: same gradients, bounded saved memory.

``MaskedPretrainingLoss`` evaluates every block after the first under activation
checkpointing, so that the intermediates of all blocks are not alive together for
``backward()``. The references here evaluate the same blocks with the engine's public
``block_scores`` in a plain loop, with every intermediate kept (no recomputation).
"""

import gc
import math
import weakref

import pytest
import torch
import pyro
import pyro.distributions as dist
from pyro.infer import config_enumerate
from torch.distributions import constraints
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_mpt import MaskedPretrainingLoss
from pyro_mpt.conditionals import (
    EncodeDecodeConditionals,
    GaussianHMMConditionals,
    EnumerateConditionals,
    GaussianConditionals,
    ImportanceConditionals,
    QuadratureConditionals,
)
from pyro_mpt.estimate import block_scores
from pyro_mpt.mask_blocks import ChainBlock, MaskBlock
from pyro_mpt.masks import AllSizes, MaskSchedule, RandomOrders
from pyro_mpt.observed_tokens import trace_tokens

from models import assert_close_to_rounding, exact_posterior_guide, make_ppca


class Replay(MaskSchedule):
    """Yields the blocks it was given, whatever the chunk size."""

    def __init__(self, blocks):
        super().__init__(1)
        self._blocks = blocks

    def blocks(self, n, D, *, max_elements=2**22, device=None):
        yield from self._blocks


def make_gmm(N=6, D=3, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.softmax(torch.randn(K, generator=g, dtype=torch.float64), 0)
    locs0 = 2 * torch.randn(K, D, generator=g, dtype=torch.float64)
    x = locs0[torch.multinomial(w0, N, True, generator=g)] + torch.randn(N, D, generator=g, dtype=torch.float64)

    @config_enumerate
    def gmm(x):
        weights = pyro.param("weights", w0.clone(), constraint=constraints.simplex)
        locs = pyro.param("locs", locs0.clone())
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(locs[z], 1.0).to_event(1), obs=x)

    gmm(x)
    return gmm, x


#: name -> (engine factory, model, guide)
CASES = {
    "gaussian-lowrank": (lambda: GaussianConditionals("lowrank"), "ppca", None),
    "gaussian-dense": (lambda: GaussianConditionals("dense"), "ppca", None),
    "quadrature": (lambda: QuadratureConditionals(16), "ppca1", None),
    "importance-prior": (lambda: ImportanceConditionals(64, proposal="prior"), "ppca", None),
    # sampling engines that draw per query: the recomputation must redraw the very same samples
    "importance-guide": (lambda: ImportanceConditionals(16, proposal="guide"), "ppca", exact_posterior_guide),
    "encode_decode": (lambda: EncodeDecodeConditionals(4, 2), "ppca", exact_posterior_guide),
    "enumerate": (lambda: EnumerateConditionals(), "gmm", None),
}


def problem(kind):
    pyro.clear_param_store()
    if kind == "gmm":
        return make_gmm()
    model, x, _ = make_ppca(5, 1 if kind == "ppca1" else 2, N=6, seed=3)
    return model, x


def params():
    return [p.unconstrained() for p in pyro.get_param_store().values()]


def draw(schedule, n, D, chunk):
    torch.manual_seed(11)
    blocks = list(schedule.blocks(n, D, max_elements=chunk))
    for block in blocks:
        if isinstance(block, ChainBlock):
            block.orders()  # orderings per datapoint are drawn when first read: now, for both evaluations
    return blocks


def mixed_blocks(n, D, first=0):
    """Blocks of every kind in one schedule, the kind ``first`` first, the others first met
    in a recomputed block: masks shared by the batch, masks per datapoint with weights per
    datapoint, one token a query, orderings. What an engine keeps on its state for one
    kind of block (its data's pieces, a check made once) is then made inside a recomputed
    region."""
    shared = draw(AllSizes(1, share_masks=True), n, D, chunk=2 * n * D)[0]
    per_datapoint = draw(AllSizes(1), n, D, chunk=2 * n * D)[1]
    mask = per_datapoint.masks()
    q = mask.shape[0]
    weighted = MaskBlock(
        mask, per_datapoint.size.expand(q, n),
        torch.linspace(0.5, 1.5, q * n, dtype=torch.float64).reshape(q, n),
    )
    targets = torch.tensor([D - 1, 0, 1])
    single = torch.zeros(3, 1, D, dtype=torch.bool)
    single[torch.arange(3), 0, targets] = True
    one_token = MaskBlock(single, torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.float64))
    chain = draw(RandomOrders(1), n, D, chunk=n * D)[0]
    kinds = [shared, weighted, one_token, chain]
    return kinds[first:] + kinds[:first] + [weighted]


@pytest.mark.filterwarnings("ignore:conditionals='importance'")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("schedule", ["all", "all-shared", "order", "mixed0", "mixed1", "mixed2", "mixed3"])
def test_recomputed_gradients_equal_the_stored_ones(name, schedule):
    make_engine, kind, guide = CASES[name]
    model, x = problem(kind)
    n, D = x.shape
    if schedule.startswith("mixed"):
        blocks = mixed_blocks(n, D, int(schedule[-1]))
    else:
        sched = {
            "all": AllSizes(2),
            "all-shared": AllSizes(2, share_masks=True),
            "order": RandomOrders(3),
        }[schedule]
        # several blocks: of up to 3 masks, or of one ordering
        blocks = draw(sched, n, D, chunk=(1 if schedule == "order" else 3) * n * D)
    assert len(blocks) >= 2

    pyro.set_rng_seed(5)
    loss = MaskedPretrainingLoss(conditionals=make_engine(), masks=Replay(blocks))
    value = loss.differentiable_loss(model, guide, x)
    grads = torch.autograd.grad(value, params())

    # the same blocks, evaluated in a plain loop that keeps every intermediate
    pyro.set_rng_seed(5)
    engine = make_engine()
    tokens = trace_tokens(model, guide, (x,), {})
    state = engine.prepare(tokens, model, guide, (x,), {})
    estimate = x.new_zeros(n)
    for block in blocks:
        shat, _, weight = block_scores(block, engine, state, tokens.value)
        estimate = estimate + (weight * shat).sum(0)
    expected = -(tokens.scale * estimate).sum()
    expected_grads = torch.autograd.grad(expected, params())

    assert_close_to_rounding(value.detach(), expected.detach(), torch.float64)
    for g, e in zip(grads, expected_grads):
        assert_close_to_rounding(g, e, torch.float64)


def saved_bytes(fn):
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs (each storage once)."""
    kept = []

    def pack(t):
        kept.append(t)  # alive until counted: no freed storage's address is reused meanwhile
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    storages = {(t.untyped_storage().data_ptr(), t.device): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()), out


@pytest.mark.filterwarnings("ignore:conditionals='importance'")
@pytest.mark.parametrize("name", ["gaussian-lowrank", "gaussian-dense", "importance-guide"])
def test_saved_memory_does_not_grow_with_the_number_of_blocks(name):
    """One query per block (``chunk_size = n * D``): 2 or 12 masks per datapoint save the
    same bytes for backward (an engine that recomputes its own tables: at most its masks'
    bits and two rows of sums more per block), where keeping every block's intermediates
    would save 6 times more."""
    make_engine, kind, guide = CASES[name]
    model, x = problem(kind)
    n, D = x.shape

    def run(num_masks):
        loss = MaskedPretrainingLoss(
            conditionals=make_engine(), masks="uniform", num_masks=num_masks, share_masks=False, chunk_size=n * D
        )
        return saved_bytes(lambda: loss.differentiable_loss(model, guide, x))

    few, value_few = run(2)
    many, value_many = run(12)
    assert value_few.requires_grad and value_many.requires_grad
    if name.startswith("gaussian"):
        # its engine recomputes its tables in its own backward pass
        # (GaussianConditionals.recomputes_mask_sums): a block keeps only its masks as
        # bits and a few (q, n) rows of sums, not its (q, n, D) tables
        per_block = n * ((D + 7) // 8) + 2 * n * x.element_size()
        assert 0 <= many - few <= 10 * per_block
    else:
        assert many == few

    # without recomputation the same loop saves more with every block: the check can fail
    def plain(num_masks):
        engine = make_engine()
        tokens = trace_tokens(model, guide, (x,), {})
        state = engine.prepare(tokens, model, guide, (x,), {})
        sched = MaskedPretrainingLoss(masks="uniform", num_masks=num_masks).schedule
        est = x.new_zeros(n)
        for block in sched.blocks(n, D, max_elements=n * D):
            shat, _, weight = block_scores(block, engine, state, tokens.value)
            est = est + (weight * shat).sum(0)
        return est.sum()

    assert saved_bytes(lambda: plain(12))[0] > saved_bytes(lambda: plain(2))[0]


class _MadeTensors(TorchDispatchMode):
    """Weak references to every tensor an operation makes while the mode is on."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out


def make_bernoulli_mixture(N=40, D=6, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(N, D, generator=g, dtype=torch.float64) < 0.4).to(torch.float64)
    p0 = 0.2 + 0.6 * torch.rand(K, D, generator=g, dtype=torch.float64)

    @config_enumerate
    def mixture(x):
        w = pyro.param("w", torch.full((K,), 1.0 / K, dtype=torch.float64), constraint=constraints.simplex)
        p = pyro.param("p", p0.clone(), constraint=constraints.unit_interval)
        with pyro.plate("data", x.shape[0]):
            a = pyro.sample("a", dist.Categorical(w))
            pyro.sample("x", dist.Bernoulli(p[a]).to_event(1), obs=x)

    return mixture, x


@pytest.mark.filterwarnings("ignore:conditionals='importance'")
@pytest.mark.parametrize("name", sorted(CASES) + ["bernoulli-mixture"])
@pytest.mark.parametrize("share", [False, True])
def test_a_step_leaves_no_graph_alive_after_its_backward_pass(name, share):
    """After loss + gradient with every block after the first recomputed (chunk_size = n * D),
    no tensor of the step's graphs outlives it (what an engine keeps across steps, such as
    a warm-started grid, is detached). The recomputation's own graph once held the tensors
    it saved, and ops that save their output (exp, logsumexp) held their own grad_fn through
    them: a cycle of C++ references, so every recomputed block leaked what it saved (a
    Bernoulli mixture, masks="all", N = 4000: 80 MB a block, growing with every step)."""
    if name == "bernoulli-mixture":
        pyro.clear_param_store()
        (model, x), make_engine, guide = make_bernoulli_mixture(), EnumerateConditionals, None
    else:
        make_engine, kind, guide = CASES[name]
        model, x = problem(kind)
    n, D = x.shape
    loss = MaskedPretrainingLoss(conditionals=make_engine(), masks="all", share_masks=share, chunk_size=n * D)
    loss.differentiable_loss(model, guide, x)  # the engine's choices and memory made outside the count
    made = _MadeTensors()
    with made:
        value = loss.differentiable_loss(model, guide, x)
        grads = torch.autograd.grad(value, params(), allow_unused=True)
    assert value.requires_grad and any(g is not None for g in grads)
    del value, grads
    gc.collect()
    alive = [t for t in (r() for r in made.refs) if t is not None and (t.grad_fn is not None or t.requires_grad)]
    assert len(made.refs) > 100 and not alive, [(tuple(t.shape), t.grad_fn) for t in alive[:5]]


def test_kept_row_pieces_stay_within_their_bound_of_the_mask_bits():
    """Masks per datapoint on the low-rank Gaussian path at D = 360, K = 2, float64: each
    row's small pieces (89 bytes) fit KEPT_PIECES_BITS_RATIO times its 45 bytes of mask
    bits, so the backward pass reads them; a block then saves more than its bits (the
    pieces are kept) and at most its bits, the pieces and two rows of sums: never its
    (q, n, D) tables (2880 bytes a row)."""
    from pyro_mpt.conditionals import gaussian_independent

    pyro.clear_param_store()
    model, x, _ = make_ppca(360, 2, N=6, seed=3)
    n, D = x.shape
    K = 2
    bits = -(-D // 8)
    pieces = ((K + 1) ** 2 + K) * x.element_size() + 1
    assert bits < pieces <= gaussian_independent.KEPT_PIECES_BITS_RATIO * bits

    def run(num_masks):
        loss = MaskedPretrainingLoss(
            conditionals=GaussianConditionals("lowrank"), masks="uniform", num_masks=num_masks, share_masks=False, chunk_size=n * D
        )
        return saved_bytes(lambda: loss.differentiable_loss(model, None, x))[0]

    grown = run(12) - run(2)  # ten blocks of one mask per datapoint more
    assert 10 * n * (bits + pieces - 1) <= grown <= 10 * n * (bits + pieces + 2 * x.element_size())


def _one_datapoint_regression(D=36, P=11, seed=4):
    """Bayesian linear regression written the Pyro way: global weights, D responses in
    the data plate, scored as one datapoint of D tokens (``token_plates=("data",)``).
    Its marginal is N(0, tau^2 X X^T + sigma^2 I): rank P over D tokens."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(D, P, generator=g, dtype=torch.float64)
    y = X @ torch.randn(P, generator=g, dtype=torch.float64) + 0.7 * torch.randn(D, generator=g, dtype=torch.float64)

    def blr(X, y):
        tau = pyro.param("tau", torch.tensor(0.8, dtype=torch.float64), constraint=constraints.positive)
        sigma = pyro.param("sigma", torch.tensor(0.6, dtype=torch.float64), constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=torch.float64), tau).to_event(1))
        with pyro.plate("data", D):
            pyro.sample("y", dist.Normal((X * w).sum(-1), sigma), obs=y)

    blr(X, y)  # registers the params
    return blr, X, y


def _loop_loss(X, y, blocks):
    """The schedule's loss by conditioning the dense covariance on each mask's context,
    in numpy (value) and torch (the same loop, for its gradient in tau and sigma)."""
    import numpy as np

    tau_u, sigma_u = (pyro.get_param_store().get_param(k).unconstrained() for k in ("tau", "sigma"))
    tau, sigma = tau_u.exp(), sigma_u.exp()  # constraints.positive: exp of the unconstrained value
    S = tau**2 * X @ X.T + sigma**2 * torch.eye(len(y), dtype=X.dtype)
    Sn, yn = S.detach().numpy(), y.numpy()
    value, total = 0.0, 0.0
    for block in blocks:
        for mask, size, weight in zip(block.masks()[:, 0], block.size[:, 0], block.weight[:, 0]):
            t, c = mask.numpy(), ~mask.numpy()
            coef = float(weight) / int(size)
            B = np.linalg.solve(Sn[np.ix_(c, c)], Sn[np.ix_(c, t)])
            mean, var = B.T @ yn[c], np.diag(Sn[np.ix_(t, t)]) - np.einsum("ct,ct->t", Sn[np.ix_(c, t)], B)
            value -= coef * (-0.5 * (np.log(2 * np.pi * var) + (yn[t] - mean) ** 2 / var)).sum()
            tm, cm = mask, ~mask
            Bt = torch.linalg.solve(S[cm][:, cm], S[cm][:, tm])
            m_t, v_t = Bt.T @ y[cm], S[tm][:, tm].diagonal() - (S[cm][:, tm] * Bt).sum(0)
            total = total - coef * (-0.5 * (torch.log(2 * math.pi * v_t) + (y[tm] - m_t) ** 2 / v_t)).sum()
    return value, torch.autograd.grad(total, [tau_u, sigma_u])


@pytest.mark.parametrize("P, method", [(11, "lowrank"), (3, "lowrank"), (11, "dense")])
def test_one_datapoint_of_many_tokens_saves_one_group_and_meets_the_loop(P, method):
    """One datapoint of D tokens, masks="all": each mask's factors ((D, R) loading rows or
    (D, D) covariance blocks) outgrow its n * D = D conditionals, so the engine declares
    them (GaussianConditionals.weighted_sum_elements) and the schedule's one block is
    split into groups recomputed in the backward pass: saved memory near one group's
    chunk_size, not the whole schedule's (Pyro's radon model, D = 1000 houses, 85
    counties: 2.9 GB -> 0.47 GB peak). Loss and gradients against the numpy/torch loop
    over the masks."""
    pyro.clear_param_store()
    model, X, y = _one_datapoint_regression(P=P)
    D = len(y)
    torch.manual_seed(2)
    blocks = list(AllSizes(1).blocks(1, D, max_elements=2**30))
    expected, expected_grads = _loop_loss(X, y, blocks)

    def run(chunk):
        loss = MaskedPretrainingLoss(conditionals=GaussianConditionals(method), masks=Replay(blocks),
                                     token_plates=("data",), chunk_size=chunk)
        params = [pyro.get_param_store().get_param(k).unconstrained() for k in ("tau", "sigma")]
        saved, value = saved_bytes(lambda: loss.differentiable_loss(model, None, X, y))
        return saved, value, torch.autograd.grad(value, params)

    from pyro_mpt.conditionals.gaussian_shared import shared_sums_elements

    chunk = 4 * shared_sums_elements(1, D, P if method == "lowrank" else None)  # four masks a group
    saved, value, grads = run(chunk)
    whole, value_whole, _ = run(2**40)
    assert abs(value.item() - expected) <= 1e-8 * abs(expected)
    assert abs(value_whole.item() - expected) <= 1e-8 * abs(expected)
    for g, e in zip(grads, expected_grads):
        assert abs(g.item() - e.item()) <= 1e-8 * max(1.0, abs(e.item()))
    # one group's worth (its declared elements, 8 bytes each, with slack for the
    # checkpoints' inputs), where the whole schedule in one group saves several times more
    assert saved <= 2 * chunk * 8
    assert whole > 3 * saved


def test_importance_evidence_keeps_one_chunk_of_draws_for_its_gradient():
    """Evidence(method="importance") with several chunks of draws recomputes every chunk
    after the first in the backward pass: the bytes saved for backward do not grow with
    num_samples (FA, N = 1000, D = 50, 2000 draws: 1.78 -> 0.94 GB peak RSS), and a value
    and gradient that are never differentiated cost nothing more. With the exact posterior
    as the proposal every log-weight is log p(x) as a function of the parameters, so value
    and gradient equal torch.distributions' LowRankMultivariateNormal (1e-8) through the
    recomputation."""
    from pyro_mpt import Evidence

    pyro.clear_param_store()
    model, x, _ = make_ppca(6, 2, N=5, seed=7)
    leaves = [pyro.param(k).unconstrained() for k in ("W", "mu", "s")]

    def run(num_samples):
        torch.manual_seed(3)
        evidence = Evidence(model, exact_posterior_guide, method="importance", num_samples=num_samples,
                            chunk_size=2, psis=False)
        return saved_bytes(lambda: evidence(x).sum())

    few, _ = run(4)
    many, value = run(12)
    # four chunks more: their checkpoints' inputs and random states (80 bytes each),
    # not their graphs (3.5 kB each here)
    assert 0 <= many - few <= 4 * 128
    W, mu, s = (pyro.param(k) for k in ("W", "mu", "s"))
    ref = torch.distributions.LowRankMultivariateNormal(mu, W, s**2 * torch.ones_like(mu)).log_prob(x).sum()
    assert abs(value.item() - ref.item()) <= 1e-8 * abs(ref.item())
    for got, want in zip(torch.autograd.grad(value, leaves), torch.autograd.grad(ref, leaves)):
        assert torch.allclose(got, want, rtol=1e-8, atol=1e-8 * float(want.abs().max()))


def test_recomputed_regions_match_plain_autograd_with_random_draws_nesting_and_retained_graphs():
    """pyro_mpt.recompute.recomputed against the same function without recomputation
    (float64): a region drawing random numbers gets the same value and gradient (its second
    run redraws the same numbers) and leaves the global random state as the plain call
    does; nested regions and a second backward pass through a retained graph too."""
    from pyro_mpt.recompute import recomputed

    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def inner(a):
        return (a @ w).tanh() * torch.rand(a.shape[0], 4, dtype=torch.float64)

    def outer(a, nest):
        h = recomputed(inner, a) if nest else inner(a)
        return (h.exp() * h).sum() + (a.sin() @ w).pow(2).sum()

    grads = []
    for region in (lambda f, *a: f(*a), recomputed):
        for nest in (False, True):
            torch.manual_seed(7)
            value = region(outer, x, nest)
            first = torch.autograd.grad(value, [w, x], retain_graph=True)
            second = torch.autograd.grad(value, [w, x])
            after = torch.rand(3)  # the random state the call left
            grads.append((value.detach(), first, second, after))
    for value, first, second, after in grads[1:]:
        assert abs(float(value - grads[0][0])) < 1e-12 * abs(float(grads[0][0]))
        for a, b, c in zip(first, second, grads[0][1]):
            assert torch.allclose(a, c, rtol=1e-12, atol=0) and torch.allclose(b, c, rtol=1e-12, atol=0)
        assert torch.equal(after, grads[0][3])


def test_pieces_kept_across_regions_are_made_outside_them():
    """A piece the first region to need it makes and keeps for later ones (as engines keep
    their data's pieces on their state), made under not_recomputed: each region's second
    run, which finds it made, saves what its first did, and the gradients equal plain
    autograd's (1e-12); recomputing() is True inside a region's runs, False within
    not_recomputed and outside. Made inside the region, backward() raised."""
    from pyro_mpt.recompute import not_recomputed, recomputed, recomputing

    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    seen = []

    def block(a, kept, scale):
        seen.append(recomputing())
        if "piece" not in kept:
            with not_recomputed():
                seen.append(recomputing())
                kept["piece"] = (w.exp() * w).cumsum(0)
        return (kept["piece"] * (a * scale).sin()).sum()

    a = torch.randn(4, dtype=torch.float64)
    kept = {}
    value = block(a, {}, 1.0) + block(a, {}, 2.0)
    expected = torch.autograd.grad(value, [w])[0]
    seen.clear()
    value = recomputed(block, a, kept, 1.0) + recomputed(block, a, kept, 2.0)
    assert not recomputing()
    (grad,) = torch.autograd.grad(value, [w])
    # first runs: True, then False within not_recomputed; the second region's; their second runs
    assert seen == [True, False, True, True, True]
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)


def test_the_first_recomputed_step_imports_no_compiler():
    """A loss whose blocks are recomputed in the backward pass does not import torch._dynamo
    (torch.utils.checkpoint reads a dynamo setting on each call: its first call imported the
    compiler stack and sympy, 3.8 s of a first step of 0.4 s); checked in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pyro, pyro.distributions as dist\n"
        "from pyro_mpt import MaskedPretrainingLoss\n"
        "x = torch.randn(20, 6)\n"
        "def ppca(x):\n"
        "    W = pyro.param('W', torch.ones(6, 2))\n"
        "    with pyro.plate('data', 20):\n"
        "        z = pyro.sample('z', dist.Normal(0., 1.).expand([2]).to_event(1))\n"
        "        pyro.sample('x', dist.Normal(z @ W.T, 0.5).to_event(1), obs=x)\n"
        "loss = MaskedPretrainingLoss(masks='all', share_masks=True, chunk_size=8)  # 6 groups, 5 recomputed\n"
        "loss.differentiable_loss(ppca, None, x).backward()\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("clean"), out.stdout


def _auto_models():
    """name -> (model, data, engine or None for "auto"): engines CASES leaves out, each on
    a model with parameters."""
    g = torch.Generator().manual_seed(7)
    f64 = dict(dtype=torch.float64)

    def hierarchy(x):  # random intercepts around a global mean, units in groups
        mu = pyro.param("mu", torch.tensor(0.3, **f64))
        with pyro.plate("groups", x.shape[0]):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(a[:, None].expand(x.shape), pyro.param("s", torch.tensor(0.6, **f64),
                                                                                 constraint=constraints.positive)).to_event(1), obs=x)

    def lds(x):  # a linear-Gaussian state space, one element a step
        H = 2
        eye = torch.eye(H, **f64)
        A = pyro.param("A", 0.5 * eye)
        C = pyro.param("C", torch.ones(H, 1, **f64))
        hmm = dist.GaussianHMM(dist.MultivariateNormal(0 * eye[0], eye), A, dist.MultivariateNormal(0 * eye[0], 0.5 * eye),
                               C, dist.Normal(torch.zeros(1, **f64), 0.7).to_event(1), duration=x.shape[1])
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", hmm, obs=x)

    def discrete_hmm(x):
        locs = pyro.param("locs", torch.tensor([-1.0, 0.5, 2.0], **f64))
        trans = pyro.param("trans", torch.zeros(3, 3, **f64))
        with pyro.plate("sequences", x.shape[0]):
            pyro.sample("x", dist.DiscreteHMM(torch.zeros(3, **f64), trans, dist.Normal(locs, 0.8)), obs=x)

    def poisson(x):  # a two-dimensional latent: quadrature
        W = pyro.param("W", 0.3 * torch.randn(x.shape[1], 2, generator=torch.Generator().manual_seed(1), **f64))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, **f64), 1.0).to_event(1))
            pyro.sample("x", dist.Poisson((z @ W.T).exp()).to_event(1), obs=x)

    return {
        "hierarchical": (hierarchy, torch.randn(4, 5, generator=g, **f64), None),
        "gaussian-hmm": (lds, torch.randn(3, 6, 1, generator=g, **f64), GaussianHMMConditionals),
        "discrete-hmm": (discrete_hmm, torch.randn(3, 6, generator=g, **f64), None),
        "quadrature-2d": (poisson, torch.poisson(torch.full((5, 4), 2.0, **f64), generator=g), None),
    }


@pytest.mark.parametrize("first", range(4))
@pytest.mark.parametrize("name", ["hierarchical", "gaussian-hmm", "discrete-hmm", "quadrature-2d"])
def test_blocks_of_every_kind_recomputed_give_the_sum_of_their_losses(name, first):
    """A schedule of every kind of block, each kind first met in a recomputed block: its loss
    and gradients equal the sum of one-block losses (none recomputed, each on a state of its
    own), on the engines CASES leaves out. A piece an engine keeps on its state, made inside
    a region's first run, made it save fewer tensors in its second: backward() raised."""
    model, x, engine = _auto_models()[name]
    pyro.clear_param_store()
    make = (lambda: "auto") if engine is None else engine
    tokens = trace_tokens(model, None, (x,), {})
    n, D = tokens.value.shape
    blocks = mixed_blocks(n, D, first)
    value = MaskedPretrainingLoss(conditionals=make(), masks=Replay(blocks)).differentiable_loss(model, None, x)
    grads = torch.autograd.grad(value, params())
    expected = sum(MaskedPretrainingLoss(conditionals=make(), masks=Replay([b])).differentiable_loss(model, None, x)
                   for b in blocks)
    expected_grads = torch.autograd.grad(expected, params())
    assert_close_to_rounding(value.detach(), expected.detach(), torch.float64, ulps=4096)
    for g, e in zip(grads, expected_grads):
        assert_close_to_rounding(g, e, torch.float64, ulps=4096)


@pytest.mark.filterwarnings("ignore:conditionals='importance'")
def test_orderings_per_datapoint_drawn_for_a_sampling_engine_are_the_same_in_both_runs():
    """Orderings per datapoint are drawn when an engine first reads them. Drawn inside a
    recomputed block's first run and kept on the block, its second run skipped the draw and
    the importance samples after them shifted: the gradient was 0.25 off the loss's own
    central differences at the same seed (Poisson model, a Normal guide as proposal,
    masks="order" with three orderings in blocks of one; found by a helper). Now to 1e-6."""
    N, D = 6, 4
    x = torch.poisson(torch.full((N, D), 2.0, dtype=torch.float64), generator=torch.Generator().manual_seed(0))

    def model(x):
        a = pyro.param("a", torch.linspace(0.2, 0.8, D, dtype=torch.float64))
        b = pyro.param("b", torch.linspace(-0.5, 0.5, D, dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            pyro.sample("x", dist.Poisson((a + b * z[..., None]).exp()).to_event(1), obs=x)

    def guide(x):
        loc = pyro.param("loc", torch.zeros(x.shape[0], dtype=torch.float64))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("z", dist.Normal(loc, 0.8))

    pyro.clear_param_store()
    loss = MaskedPretrainingLoss(masks="order", num_masks=3, share_masks=False, chunk_size=N * D,
                                 conditionals=ImportanceConditionals(16, proposal="guide"))

    def value():
        pyro.set_rng_seed(5)
        return loss.differentiable_loss(model, guide, x)

    value()
    a = pyro.param("a").unconstrained()
    (grad,) = torch.autograd.grad(value(), [a])
    eps = 1e-5
    fd = []
    for j in range(D):
        with torch.no_grad():
            a[j] += eps
        up = float(value())
        with torch.no_grad():
            a[j] -= 2 * eps
        down = float(value())
        with torch.no_grad():
            a[j] += eps
        fd.append((up - down) / (2 * eps))
    assert float((grad - torch.tensor(fd, dtype=torch.float64)).abs().max()) < 1e-6 * (1 + float(grad.abs().max()))


@pytest.mark.filterwarnings("ignore:conditionals='importance'")
def test_importance_guide_queries_within_one_block_keep_one_chunk_of_draws():
    """The guide proposal draws per query, ``S * q * n * D`` entries, in chunks of queries of
    at most ``max_elements``: every chunk after the first is recomputed in the backward pass,
    so one block of 2 or 8 queries (one query per chunk) saves the same bytes for backward
    beside its checkpoints' inputs; before, each chunk's draws and their intermediates were
    kept to the end (S times the block's size). The gradient is finite and reaches every
    parameter."""
    model, x = problem("ppca")
    n, D = x.shape
    S = 16

    def run(num_masks):
        engine = ImportanceConditionals(S, proposal="guide", max_elements=S * n * D)
        loss = MaskedPretrainingLoss(conditionals=engine, masks="uniform", num_masks=num_masks, share_masks=False,
                                     chunk_size=num_masks * n * D)
        torch.manual_seed(0)
        return saved_bytes(lambda: loss.differentiable_loss(model, exact_posterior_guide, x))

    few, _ = run(2)
    many, value = run(8)
    assert many - few <= 0.05 * few
    grads = torch.autograd.grad(value, params())
    assert all(bool(torch.isfinite(g).all()) and float(g.abs().max()) > 0 for g in grads)


def test_rerunning_is_true_in_the_backward_pass_second_run_only():
    """rerunning() tells a region's second run (the backward pass's) from its first, nested
    regions included, so that what only reports on values (the importance engine's
    diagnostics) is made once; recomputing() is true in both."""
    from pyro_mpt.recompute import recomputed, recomputing, rerunning

    seen = []

    def inner(a):
        seen.append(("inner", recomputing(), rerunning()))
        return (a.exp() * a).sum()

    def outer(a):
        seen.append(("outer", recomputing(), rerunning()))
        return recomputed(inner, a.sin()) * 2

    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64, requires_grad=True)
    assert not recomputing() and not rerunning()
    y = recomputed(outer, x)
    assert seen == [("outer", True, False), ("inner", True, False)]
    (g,) = torch.autograd.grad(y, x)
    assert not rerunning()
    # the backward pass reran the outer region (its inner one inside it, a first run there
    # too, but within a second run) and then the inner region's own second run
    assert all(r for _, _, r in seen[2:]) and len(seen) >= 3
    u = x.detach().sin()
    assert torch.allclose(g, 2 * (u.exp() * (1 + u)) * x.detach().cos(), rtol=1e-12, atol=0)
