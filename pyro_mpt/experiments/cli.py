"""The ``pyro-mpt`` command line.

Subcommands register themselves in :data:`SUBCOMMANDS` as
``name -> (add_arguments(parser), run(args), help)``; :func:`main` builds one
``argparse`` subparser per entry, so new subcommands are one function pair and
one registry line (other modules add theirs through a ``register(SUBCOMMANDS)``
hook, see :func:`pyro_mpt.experiments.curve_cli.register`).

``pyro-mpt compare`` trains a deep VAE (:class:`~pyro_mpt.experiments.vae.DeepVAE`) on a
small image dataset with several losses for the same budget and prints the
held-out log-likelihoods with standard errors and wall times
(:func:`~pyro_mpt.experiments.compare.compare`)::

    pyro-mpt compare --dataset digits --losses mpt:0.33 mpt:uniform elbo iwae:8 renyi:8 --epochs 30
"""

import argparse
import json
import sys
import traceback

from .curve_cli import check_output_path, positive_float, positive_int, seed_int

__all__ = ["main", "run", "build_parser", "SUBCOMMANDS"]


def _add_compare_arguments(p):
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist"], help="data (default: digits, bundled with scikit-learn)")
    p.add_argument("--likelihood", default="bernoulli", choices=["bernoulli", "gaussian"], help="pixel likelihood; bernoulli binarizes the data")
    p.add_argument("--latent-dim", type=positive_int, default=4, help="K, latent dims of the VAE")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[128], help="hidden layer widths of encoder and decoder")
    p.add_argument("--n-train", type=positive_int, default=None, help="training images (default: all)")
    p.add_argument("--n-test", type=positive_int, default=None, help="held-out images")
    p.add_argument(
        "--losses", nargs="+", default=["mpt:0.33", "mpt:uniform", "elbo", "iwae:8"],
        help="loss specs: elbo, iwae[:K], renyi[:K[:alpha]], mpt[:masks[:conditionals]]",
    )
    p.add_argument("--epochs", type=positive_int, default=20)
    p.add_argument("--batch-size", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=3e-3, help="Adam learning rate (default 0.003)")
    p.add_argument("--eval-every", type=positive_int, default=None, help="evaluate held-out evidence every this many epochs")
    p.add_argument("--eval-samples", type=positive_int, default=200, help="importance samples per held-out datapoint during training")
    p.add_argument("--final-samples", type=positive_int, default=1000, help="importance samples for the final numbers")
    p.add_argument("--mpt-encoder", default="elbo", choices=["elbo", "mpt"], help="how MPT runs train the guide")
    p.add_argument("--num-samples", type=positive_int, default=None, help="S of the MPT conditional engine")
    p.add_argument("--num-iterations", type=positive_int, default=None, help="T of the encode-decode engine")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of data split, initialization and sampling (0 .. 2**32 - 1)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (1 is fastest for small models)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="print only the final table")


def _fail(err, status=2):
    print(f"pyro-mpt: error: {err}", file=sys.stderr)
    raise SystemExit(status)


def _run_compare(args):
    try:  # an unwritable --json is a usage error found before anything is imported
        if args.json:
            check_output_path("--json", args.json, "compare.json")
    except ValueError as err:
        _fail(err)
    import torch

    from .compare import compare, make_loss
    from .datasets import load_dataset
    from .vae import DeepVAE

    try:  # a misspelt loss or data that cannot be had is a usage error, found before any model is trained
        for spec in args.losses:
            make_loss(spec, mpt_encoder=args.mpt_encoder)
        # an --n-test the data cannot spare, or mnist without torchvision: before, a traceback (status 1)
        train, test = load_dataset(
            args.dataset, binarize=args.likelihood == "bernoulli", n_train=args.n_train, n_test=args.n_test, seed=args.seed
        )
    except (TypeError, ValueError, ImportError) as err:
        _fail(err)
    if args.n_train is not None and args.n_train > train.shape[0]:
        # before, the run went on with fewer images than asked for, and said so only in its log
        _fail(
            f"--n-train {args.n_train} asks for more training images than {args.dataset} has after "
            f"the held-out split ({train.shape[0]} of {train.shape[0] + test.shape[0]}, --n-test {test.shape[0]}); "
            f"pass --n-train {train.shape[0]} or less, or leave it out for all."
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    D = train.shape[1]

    def make_model():
        return DeepVAE(D, args.latent_dim, tuple(args.hidden), args.likelihood)

    engine_options = {}
    if args.num_samples is not None:
        engine_options["num_samples"] = args.num_samples
    if args.num_iterations is not None:
        engine_options["num_iterations"] = args.num_iterations
    log = None if args.quiet else (lambda s: print(s, flush=True))
    if log:
        log(f"{args.dataset}: {train.shape[0]} training / {test.shape[0]} held-out images, D={D}, K={args.latent_dim}, {args.likelihood}")
    result = compare(
        make_model, train, test, args.losses,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
        eval_samples=args.eval_samples, final_samples=args.final_samples, seed=args.seed,
        mpt_encoder=args.mpt_encoder, engine_options=engine_options or None, log=log,
    )
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    failed = [r.name for r in result.results if r.error is not None]
    if failed:
        _fail(f"{len(failed)} of {len(result.results)} losses failed to train ({', '.join(failed)}); "
              f"the table says why.", status=1)
    return result


#: subcommand name -> (add_arguments, run, help)
SUBCOMMANDS = {
    "compare": (_add_compare_arguments, _run_compare, "train a deep VAE with several losses (MPT, ELBO, IWAE) and compare held-out evidence"),
}

# mlm-curve and mae-curve (HuggingFace masked LMs and ViT-MAE) live in curve_cli
from .curve_cli import register as _register_curves  # noqa: E402

_register_curves(SUBCOMMANDS)


def build_parser():
    """The ``argparse`` parser with one subparser per :data:`SUBCOMMANDS` entry."""
    parser = argparse.ArgumentParser(prog="pyro-mpt", description="Masked pre-training for Pyro models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (add_arguments, run, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def run(argv=None):
    """Parse ``argv`` and run its subcommand; returns the subcommand's result
    (the JSON payload of ``mlm-curve`` / ``mae-curve``, the
    :class:`~pyro_mpt.experiments.compare.Comparison` of ``compare``).

    Usage errors -- bad arguments, unreadable inputs, a model or dataset that
    cannot be reached -- print one line on stderr and raise ``SystemExit(2)``
    (argparse's convention); a command that ran but failed raises
    ``SystemExit(1)`` after saying why.

    :param list argv: arguments (default ``sys.argv[1:]``).
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args._run(args)


def main(argv=None):
    """Entry point of the ``pyro-mpt`` console script: runs :func:`run` and returns
    the exit status, 0 on success (the console script calls ``sys.exit(main())``).

    Exit statuses: 0 success; 2 usage error (one line on stderr); 1 failure
    (a message on stderr, or Python's traceback for an unexpected error).

    :param list argv: arguments (default ``sys.argv[1:]``).
    :rtype: int

    Example::

        >>> main(["compare", "--epochs", "0"])  # a usage error: one line on stderr
        2
    """
    try:
        run(argv)
    except SystemExit as exit:
        # run() exits as argparse does; the status is returned here, as documented (it was raised,
        # so that rc = main([...]) in a script failed on every error)
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 -- an unexpected error: its traceback on stderr, status 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
