"""Pieces shared by the gallery scripts: the PPCA they draw data from, and PNG compaction.

What they write into RESULTS.md is in ``gallery_report.py``."""

import pyro
import pyro.distributions as dist
import torch


def ppca_data(D, K, N, seed, noise=0.5):
    """Generating parameters and N datapoints drawn from the PPCA."""
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(D, K, generator=g)
    mu0 = torch.randn(D, generator=g)
    s0 = torch.tensor(float(noise))
    x = torch.randn(N, K, generator=g) @ W0.T + mu0 + s0 * torch.randn(N, D, generator=g)
    return (W0, mu0, s0), x


def authors_ppca_data(D, K, N, seed, beta=5.0, broadcast_noise=True, noise_seed=None):
    """PPCA data drawn as the paper's authors drew theirs, and the parameters their LML assumes.

    Their construction (``torch.manual_seed(seed)``, then ``W ~ N(0, 1)`` of
    shape (D, K), ``Z ~ N(0, 1)`` of shape (N, K), no mean) adds *one* noise
    draw of std ``1 / beta`` per datapoint, broadcast to all D tokens, while
    their exact LML assumes independent noise of variance ``1 / beta`` per
    token. ``broadcast_noise=False`` keeps the same W and Z and draws the noise
    the model assumes instead: independent, std ``sqrt(1 / beta)``, from
    ``noise_seed``.

    :returns: ``((W, mu, noise_std), x)`` with ``mu = 0`` and
        ``noise_std = sqrt(1 / beta)``, the model the authors' LML evaluates.
    """
    torch.manual_seed(seed)  # the authors seed the global generator and draw in this order
    W = torch.randn(D, K)
    Z = torch.randn(N, K)
    if broadcast_noise:
        eps = (1.0 / beta) * torch.randn(N, 1)
    else:
        g = torch.Generator().manual_seed(seed + 1 if noise_seed is None else noise_seed)
        eps = (1.0 / beta) ** 0.5 * torch.randn(N, D, generator=g)
    x = Z @ W.T + eps
    return (W, torch.zeros(D), torch.tensor((1.0 / beta) ** 0.5)), x


def make_ppca(W_init, mu_init, s_init):
    K = W_init.shape[1]

    def ppca(x):
        W = pyro.param("W", W_init.clone())
        mu = pyro.param("mu", mu_init.clone())
        s = pyro.param("s", s_init.clone(), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([K]).to_event(1))  # in the data's dtype
            pyro.sample("x", dist.Normal(z @ W.T + mu, s).to_event(1), obs=x)

    return ppca


def compact_png(path, colors=256):
    """Rewrite a matplotlib PNG with a 256-colour palette: line plots look the same at ~1/3 of the bytes."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


#: where ``--quick`` runs write when no ``--out-dir`` is given: not the committed gallery
QUICK_OUT_DIR = "outputs/gallery-quick"


def add_out_dir(parser):
    """The gallery scripts' ``--out-dir``: ``docs/gallery`` (the committed figures and
    RESULTS.md) for full runs, :data:`QUICK_OUT_DIR` for ``--quick`` runs, whose reduced
    results would otherwise replace the committed ones."""
    parser.add_argument(
        "--out-dir", default=None,
        help=f"where figures and RESULTS.md go (default: docs/gallery; with --quick, {QUICK_OUT_DIR})",
    )


def resolve_out_dir(args):
    """``args.out_dir`` with its default filled in (see :func:`add_out_dir`)."""
    if args.out_dir is None:
        args.out_dir = QUICK_OUT_DIR if args.quick else "docs/gallery"
    return args.out_dir
