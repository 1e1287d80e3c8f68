r"""PPCA trained by masked pre-training on PyTorch distributed data parallelism, through PyTorch Lightning.

The pattern of Pyro's own ``svi_lightning`` example, with
:class:`~pyro_mpt.MaskedPretrainingLoss` in place of ``Trace_ELBO``:

* the model is a :class:`~pyro.nn.PyroModule` whose parameters are ordinary
  ``torch.nn.Parameter`` s (``pyro.settings.set(module_local_params=True)``), so
  ``DistributedDataParallel`` sees, broadcasts and all-reduces them;
* the loss is a module, ``loss_fn = MaskedPretrainingLoss(...)(model, guide)``
  (Pyro's ``ELBO.__call__``); the guide is a no-op module, because the Gaussian
  engine integrates the latents out in closed form;
* the data plate is subsampled with the **global** size,
  ``pyro.plate("data", N, subsample=idx)``, so each datapoint carries the scale
  :math:`N/B` and every rank's loss is an unbiased estimate of the full-data
  loss;
* the module shards the data with a ``DistributedSampler`` of its own (its
  ``train_dataloader``; ``--shuffle 0`` reads each shard in order, which
  Lightning's injected sampler would not) and Lightning averages the gradients
  over the ranks.

Why the average is the single-machine gradient: with :math:`R` ranks of local
batch :math:`B` each, rank :math:`r` minimizes
:math:`\mathcal L_r = -\frac NB \sum_{i\in\mathcal B_r}\widehat{\log p}(x_i)`,
and DDP steps along :math:`\frac1R\sum_r\nabla\mathcal L_r
= -\frac{N}{RB}\sum_{i\in\cup_r\mathcal B_r}\nabla\widehat{\log p}(x_i)`,
the gradient of one process with the global batch :math:`RB` (scale
:math:`N/(RB)`) -- exactly when the per-datapoint estimates do not depend on
the rank, e.g. with ``masks="order"`` or ``"exhaustive"`` and the Gaussian
engine (both give :math:`\log p(x_i)` itself), and in expectation for the
random schedules, whose masks each rank draws from its own stream.
``tests/test_ddp.py`` checks the equality with 2 CPU processes (gloo).

Launch (one process per device; Lightning re-runs this script for ranks 1..R-1)::

    python examples/ppca_lightning_ddp.py --accelerator cpu --devices 2 --strategy ddp
    python examples/ppca_lightning_ddp.py --accelerator gpu --devices 4 --strategy ddp   # one node, 4 GPUs
    # several nodes: add --num-nodes and start the script on every node (torchrun or a SLURM job)

With the defaults (N = 4000, D = 20, K = 3, ``masks="uniform"``, 600 steps of
2 x 200 datapoints; about 30 s on 2 CPU cores) the exact log-marginal
likelihood ends at about -21.36 per datapoint (-21.3601 on this project's 2-core
machine), against -21.345 at the closed-form maximum-likelihood parameters.

``--save-grads DIR`` writes, from every rank, the parameters, the averaged
gradients and the datapoint indices of the first step (what the test reads).
"""

import argparse
import os

import lightning
import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam

from pyro_mpt import MaskedPretrainingLoss


class PPCA(PyroModule):
    r"""Probabilistic PCA, :math:`x_i = W z_i + \mu + \sigma\epsilon_i`, on a subsampled plate of global size N."""

    def __init__(self, num_data, num_tokens, num_latents, seed=0, dtype=torch.float32):
        super().__init__()
        # the same initial values on every rank (DDP would broadcast rank 0's anyway)
        g = torch.Generator().manual_seed(seed)
        self.num_data, self.num_latents = num_data, num_latents
        self.W = PyroParam(torch.randn(num_tokens, num_latents, generator=g, dtype=dtype))
        self.mu = PyroParam(torch.zeros(num_tokens, dtype=dtype))
        self.sigma = PyroParam(torch.ones((), dtype=dtype), constraint=dist.constraints.positive)

    def forward(self, idx, x):
        with pyro.plate("data", self.num_data, subsample=idx):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([self.num_latents]).to_event(1))
            pyro.sample("x", dist.Normal(z @ self.W.T + self.mu, self.sigma).to_event(1), obs=x)


class NoGuide(PyroModule):
    """The guide of a model whose latents the loss integrates out: samples nothing."""

    def forward(self, idx, x):
        pass


class MPTModule(lightning.LightningModule):
    """Adam on the masked pre-training loss; one batch of ``(idx, x)`` per step."""

    def __init__(self, loss_fn, dataset, batch_size, shuffle=True, lr=0.05, seed=0, save_grads=None):
        super().__init__()
        self.loss_fn = loss_fn
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.lr = lr
        self.seed = seed
        self.save_grads = save_grads
        self._batch_idx = None

    def train_dataloader(self):
        # the shards' sampler is made here (the Trainer's use_distributed_sampler=False): the one
        # Lightning injects shuffles every training loader whatever its shuffle= says, so
        # --shuffle 0 did nothing; Lightning still calls its set_epoch, which reshuffles
        sampler = torch.utils.data.DistributedSampler(
            self.dataset, num_replicas=self.trainer.world_size, rank=self.global_rank,
            shuffle=self.shuffle, seed=self.seed, drop_last=True,
        )
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def setup(self, stage):
        # the masks come from torch's global stream: one stream per rank, so
        # that the ranks draw independent masks rather than the same ones
        pyro.set_rng_seed(self.seed + 1000 * self.global_rank)

    def training_step(self, batch, batch_idx):
        idx, x = batch
        self._batch_idx = idx
        loss = self.loss_fn(idx, x)
        # per datapoint of the full data set: the plate scale already holds N / B
        self.log("loss_per_datapoint", loss / self.loss_fn.model.num_data, prog_bar=True, sync_dist=True)
        return loss

    def on_after_backward(self):
        # DDP has all-reduced the gradients by now; keep the first step's
        if self.save_grads and self.global_step == 0:
            named = dict(self.loss_fn.named_parameters())
            torch.save({"rank": self.global_rank, "world_size": self.trainer.world_size,
                        "idx": self._batch_idx.cpu(),
                        "params": {k: p.detach().cpu() for k, p in named.items()},
                        "grads": {k: p.grad.detach().cpu() for k, p in named.items()}},
                       os.path.join(self.save_grads, f"rank{self.global_rank}.pt"))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        # 10x down over the run: one random mask per datapoint makes the gradient
        # noisy, and a constant rate leaves the parameters jittering short of the optimum
        steps = max(self.trainer.max_steps, 1)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1 ** (1.0 / steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_data(num_data, num_tokens, num_latents, seed, dtype):
    """PPCA data from random generating parameters, the same on every rank."""
    g = torch.Generator().manual_seed(seed + 1)
    W = torch.randn(num_tokens, num_latents, generator=g, dtype=torch.float64)
    z = torch.randn(num_data, num_latents, generator=g, dtype=torch.float64)
    x = z @ W.T + 1.0 + 0.5 * torch.randn(num_data, num_tokens, generator=g, dtype=torch.float64)
    return x.to(dtype)


def exact_lml(x, W, mu, sigma):
    """Mean over datapoints of log N(x_i; mu, W W^T + sigma^2 I)."""
    cov = W @ W.T + sigma**2 * torch.eye(W.shape[0], dtype=W.dtype)
    return float(torch.distributions.MultivariateNormal(mu, cov).log_prob(x).mean())


def max_likelihood_lml(x, K):
    """The same at the closed-form maximum-likelihood parameters (Tipping & Bishop, 1999)."""
    mu = x.mean(0)
    evals, evecs = torch.linalg.eigh((x - mu).T @ (x - mu) / x.shape[0])
    evals, evecs = evals.flip(0), evecs.flip(1)
    sigma2 = evals[K:].mean()
    return exact_lml(x, evecs[:, :K] * (evals[:K] - sigma2).clamp(min=0).sqrt(), mu, sigma2.sqrt())


def build(args):
    """Model, guide, loss module and data set of a run (also used by the test for its reference).

    Build and call them with ``pyro.settings.set(module_local_params=True)``.
    """
    dtype = getattr(torch, args.dtype)
    x = make_data(args.num_data, args.num_tokens, args.num_latents, args.seed, dtype)
    model = PPCA(args.num_data, args.num_tokens, args.num_latents, seed=args.seed, dtype=dtype)
    loss = MaskedPretrainingLoss(conditionals="gaussian", masks=args.masks, num_masks=args.num_masks,
                                 max_plate_nesting=1)
    loss_fn = loss(model, NoGuide())
    dataset = torch.utils.data.TensorDataset(torch.arange(args.num_data), x)
    return loss_fn, dataset


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--num-data", type=int, default=4000, help="N, the global data set size")
    p.add_argument("--num-tokens", type=int, default=20)
    p.add_argument("--num-latents", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=200, help="per process; the global batch is devices x this")
    p.add_argument("--masks", default="uniform", type=lambda s: float(s) if s[0].isdigit() else s)
    p.add_argument("--num-masks", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", type=int, default=1,
                   help="1: reshuffle every epoch (seeded, the same on every rank); 0: each rank reads its shard "
                        "in order (rank r of R: datapoints r, r + R, ...)")
    p.add_argument("--save-grads", default=None, help="directory for the first step's gradients of every rank")
    p.add_argument("--root-dir", default=None, help="Lightning's default_root_dir")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # the global seed (the sampler's shuffling has --seed too); data and parameters have
    # their own generators, masks a stream per rank
    lightning.seed_everything(args.seed)
    # parameters of PyroModules as torch.nn.Parameters, not in the global param store, for DDP to see
    pyro.settings.set(module_local_params=True)
    loss_fn, dataset = build(args)
    module = MPTModule(loss_fn, dataset, args.batch_size, shuffle=bool(args.shuffle), lr=args.lr, seed=args.seed,
                       save_grads=args.save_grads)
    if args.save_grads:
        os.makedirs(args.save_grads, exist_ok=True)
    trainer = lightning.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
        max_steps=args.max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.root_dir, use_distributed_sampler=False,
    )
    trainer.fit(module)
    if trainer.is_global_zero:
        x = dataset.tensors[1].double()
        W, mu, sigma = (getattr(loss_fn.model, k).detach().double() for k in ("W", "mu", "sigma"))
        lml, ml = exact_lml(x, W, mu, sigma), max_likelihood_lml(x, args.num_latents)
        print(f"{trainer.world_size} process(es), {trainer.global_step} steps: exact log p(x) per datapoint "
              f"{lml:.4f} (maximum likelihood: {ml:.4f})")
        return lml
    return None


if __name__ == "__main__":
    main()
