"""``pyro-mpt mlm-curve`` and ``pyro-mpt mae-curve``: MPT curves from the command line.

:func:`register` adds both subcommands to :data:`pyro_mpt.experiments.cli.SUBCOMMANDS`.
Each writes a JSON file (rates, curve, standard errors, areas, per-item
scores, settings) and a PNG plot. A model or dataset that cannot be reached
fails at once with what was tried and how to use a local copy (exit code 2).
Arguments and the input data are checked before the model is loaded; every
usage error is one line on stderr and exit status 2 (see :func:`pyro_mpt.experiments.cli.main`).

Data-parallel runs shard the items across processes and gather the results::

    accelerate launch --num_processes 4 -m pyro_mpt.experiments.cli mlm-curve bert-base-uncased \\
        --dataset glue --dataset-config cola --split validation --column sentence --distributed
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

__all__ = ["register", "SUBCOMMANDS", "positive_int", "positive_float", "seed_int", "check_device", "prepare_outputs", "check_output_path",
           "dataset_options", "plot_path"]

_MLM_EPILOG = """\
examples:
  pyro-mpt mlm-curve antiberty --text-file antibodies.txt --num-masks 4
  pyro-mpt mlm-curve bert-base-uncased --dataset glue --dataset-config cola \\
      --split validation --column sentence --limit 500 --json cola.json --plot cola.png
  pyro-mpt mlm-curve ./my-local-bert --random-init --text-file sentences.txt

MODEL is a local directory (config.json + weights), a hub name, or 'antiberty'
(the masked LM shipped in the antiberty==0.1.3 package). --text-file holds one
sequence per line; AntiBERTy's are chains of space-separated residues (E V Q L ...),
e.g. those of pyro_mpt.adapters.antibodies (see docs/cli.rst). Offline, point MODEL
and --dataset at local copies; the command says what it tried when it cannot.
The JSON holds the curve (mean masked-token log-probability per rate), its
standard errors, the area L*sum_k w_k S(r_k) with L the mean number of maskable
tokens, the paper's Table 2 area (sum_k S(r_k) * 0.01 * 512, on the 1..99% grid),
and per-sequence scores.
"""

_MAE_EPILOG = """\
examples:
  pyro-mpt mae-curve facebook/vit-mae-base --dataset fashion_mnist --split test --limit 200
  pyro-mpt mae-curve ./vit-mae-dir --image-folder ./images --sigma2 mle

The JSON holds two curves per rate: the mean squared error of the masked
patches (what ViT-MAE minimizes) and the Gaussian log-density
-d/2 log(2 pi sigma2) - d/(2 sigma2) * MSE per patch, d = patch_size^2 * channels.
"""


def positive_int(text):
    """``argparse`` type of counts and budgets: refuses 0, negatives and non-integers at
    parse time (exit status 2), before any model or data is loaded."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def seed_int(text):
    """``argparse`` type of ``--seed``: an integer that numpy's and torch's seeding both take,
    0 .. 2**32 - 1 (numpy refused -1 with a traceback after the data had loaded)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**32 - 1, got {text!r}")
    return value


def positive_float(text):
    """``argparse`` type of rates such as a learning rate: refuses 0, negatives, NaN and
    infinities at parse time (exit status 2), before any model is trained."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _common(p, default_rates):
    g = p.add_argument_group("masking")
    g.add_argument("--rates", default=default_rates, metavar="SPEC",
                   help=f"masking rates: start:stop:step (inclusive) or a comma list (default {default_rates})")
    g.add_argument("--num-masks", type=positive_int, default=1, metavar="K", help="random masks per item and rate (default 1)")
    g.add_argument("--seed", type=seed_int, default=0, help="mask seed, 0 .. 2**32 - 1 (default 0)")
    c = p.add_argument_group("compute")
    c.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    c.add_argument("--bf16", action="store_true", help="bfloat16 autocast (GPU)")
    c.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    c.add_argument("--distributed", action="store_true",
                   help="shard items across the processes of an `accelerate launch` run and gather the results")
    c.add_argument("--progress", action="store_true", help="show a progress bar")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="JSON output (default: <command>.json)")
    o.add_argument("--plot", default=None, metavar="PATH",
                   help="plot; its extension picks the format (.png, .pdf, .svg, ...), none gives .png "
                        "(default: <command>.png)")
    o.add_argument("--no-plot", action="store_true", help="skip the plot")
    o.add_argument("--label", default=None, help="legend label (default: the model name)")
    return g


def _add_mlm_arguments(p):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _MLM_EPILOG
    p.add_argument("model", metavar="MODEL", help="masked LM: local directory, hub name, or 'antiberty'")
    m = p.add_argument_group("model")
    m.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer directory, hub name or BERT vocab.txt (default: the model's)")
    m.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                   help="lowercase texts (default: the tokenizer's saved setting; a BERT vocab.txt without "
                        "one, as --tokenizer FILE or the model directory's only tokenizer file, is lower-cased "
                        "only when none of its tokens has an upper-case letter)")
    m.add_argument("--random-init", action="store_true", help="same architecture, random weights (the paper's baseline)")
    d = p.add_argument_group("data (one source)")
    d.add_argument("--text-file", default=None, metavar="FILE", help="one sequence per line")
    d.add_argument("--dataset", default=None, metavar="NAME",
                   help="datasets hub name, a save_to_disk directory, or a csv/json/parquet file")
    d.add_argument("--dataset-config", default=None, metavar="CFG", help="dataset configuration (e.g. cola)")
    d.add_argument("--split", default=None, help="dataset split (default validation)")
    d.add_argument("--column", nargs="+", default=None, metavar="COL",
                   help="text column, or two columns for sentence pairs (default: text/sentence)")
    d.add_argument("--limit", type=positive_int, default=None, metavar="N", help="score the first N sequences")
    g = _common(p, "0.01:0.99:0.01")
    g.add_argument("--scores", nargs="*", default=["uniform"], choices=["uniform", "order", "all", "pll", "pll-word-l2r"],
                   help="per-sequence scores to add (default: uniform); none with an empty list")
    g.add_argument("--score-masks", type=positive_int, default=8, metavar="P", help="masks/orderings per sequence for --scores (default 8)")
    c = [a for a in p._action_groups if a.title == "compute"][0]
    c.add_argument("--max-tokens", type=positive_int, default=8192, metavar="N", help="token budget per forward pass (default 8192)")


def _add_mae_arguments(p):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _MAE_EPILOG
    p.add_argument("model", metavar="MODEL", help="ViTMAEForPreTraining: local directory or hub name")
    m = p.add_argument_group("model")
    m.add_argument("--processor", default=None, metavar="PATH", help="image processor directory or hub name (default: the model's)")
    m.add_argument("--random-init", action="store_true", help="same architecture, random weights")
    m.add_argument("--init-position-embeddings", action="store_true",
                   help="fill the fixed sin-cos position embeddings of a checkpoint saved with them at zero "
                        "(a model built from a config by transformers 5); the other weights are kept")
    d = p.add_argument_group("data (one source)")
    d.add_argument("--image-folder", default=None, metavar="DIR", help="folder of png/jpg images (recursive)")
    d.add_argument("--dataset", default=None, metavar="NAME", help="datasets hub name, save_to_disk directory or data file")
    d.add_argument("--dataset-config", default=None, metavar="CFG")
    d.add_argument("--split", default=None, help="dataset split (default test)")
    d.add_argument("--column", default=None, metavar="COL", help="image column (default image)")
    d.add_argument("--limit", type=positive_int, default=None, metavar="N", help="score the first N images")
    g = _common(p, "0.05:0.95:0.05")
    g.add_argument("--sigma2", default="1.0", metavar="S2",
                   help="variance of the Gaussian decoder: a positive number or 'mle' (default 1.0)")
    c = [a for a in p._action_groups if a.title == "compute"][0]
    c.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="masked copies per forward pass (default 64)")


def _se(value):
    """A standard error for the summary line; unknown (one item, one mask) as 'n/a'."""
    return "n/a" if value is None or value != value else f"{value:.2f}"


def _fail(err):
    print(f"pyro-mpt: error: {err}", file=sys.stderr)
    raise SystemExit(2)


def check_device(text):
    """The ``--device`` argument, checked before any model is loaded: a device name torch
    reads and that this machine has (``cuda`` on a CPU-only build, ``cuda:3`` on a one-GPU
    machine and ``gpu`` are usage errors, not tracebacks after the model has loaded).

    :param str text: the value of ``--device``.
    :returns: ``text``, unchanged.
    :raises ValueError: naming the argument and what to pass instead.

    Example::

        >>> check_device("cpu")
        'cpu'
        >>> check_device("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --device 'gpu' cannot be used on this machine (...); pass --device cpu, ...
    """
    import torch

    try:
        torch.empty(0, device=torch.device(text))
    except (RuntimeError, AssertionError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"--device {text!r} cannot be used on this machine ({reason}); pass --device cpu, "
            f"or leave --device out (cuda when available, else cpu)."
        ) from None
    return text


def dataset_options(args, source_flag, source, split, column=None):
    """Check that the dataset's options come with ``--dataset``, and fill their defaults.

    :param argparse.Namespace args: the parsed ``dataset``, ``dataset_config``, ``split``
        and ``column`` (changed in place: ``split`` and ``column`` get their defaults).
    :param str source_flag: the other data source (``"--text-file"``), for the message.
    :param source: its value (None: not given).
    :param str split: the default split. :param column: the default column.
    :raises ValueError: an option of the dataset beside the other source, where it was
        ignored before (``--text-file t.txt --split test`` scored the file); ``--split`` or
        ``--dataset-config`` with a data file or a ``Dataset``'s ``save_to_disk()`` folder (one
        table), ``--dataset-config`` with a ``DatasetDict``'s (splits, no configs).

    Example::

        >>> a = argparse.Namespace(dataset="glue", dataset_config="cola", split=None, column=None)
        >>> dataset_options(a, "--text-file", None, "validation"); a.split
        'validation'
    """
    if args.dataset is None:
        if source is None:
            return  # no source at all: load_texts / load_images say so
        given = [flag for flag, value in (("--dataset-config", args.dataset_config), ("--split", args.split),
                                          ("--column", args.column)) if value is not None]
        if given:
            one = len(given) == 1
            names = given[0] if one else ", ".join(given[:-1]) + " and " + given[-1]
            raise ValueError(f"{names} {'chooses' if one else 'choose'} what to read from --dataset; with "
                             f"{source_flag} {'it' if one else 'they'} would be ignored: leave "
                             f"{'it' if one else 'them'} out, or pass --dataset.")
        return
    from ..adapters.loading import saved_dataset_kind

    kind = "file" if os.path.isfile(args.dataset) else saved_dataset_kind(args.dataset)
    if kind in ("file", "dataset"):
        # a data file (csv, json, parquet) or a Dataset's save_to_disk() folder is one table: it
        # has no configs nor splits (the folder's were ignored, and the JSON recorded them)
        given = [flag for flag, value in (("--dataset-config", args.dataset_config), ("--split", args.split))
                 if value is not None]
        if given:
            one = len(given) == 1
            table = (f"the data file {args.dataset!r}" if kind == "file"
                     else f"the Dataset that save_to_disk() wrote in {args.dataset!r}")
            raise ValueError(f"{' and '.join(given)} {'chooses' if one else 'choose'} within a hub dataset or a "
                             f"DatasetDict's save_to_disk() folder; {table} is one table, so "
                             f"{'it' if one else 'they'} would be ignored: leave {'it' if one else 'them'} out.")
    else:
        if kind == "dict" and args.dataset_config is not None:
            raise ValueError(f"--dataset-config chooses a configuration of a hub dataset; the DatasetDict that "
                             f"save_to_disk() wrote in {args.dataset!r} has none, so it would be ignored: leave it "
                             f"out (--split chooses among its splits).")
        args.split = split if args.split is None else args.split
    args.column = column if args.column is None else args.column


def prepare_outputs(args, command):
    """Check, before the run, that the JSON and the plot can be written: their folders are
    created when missing, and a path that is a folder or a folder that cannot be created is
    a usage error (a run of an hour must not fail at its last line).

    :param argparse.Namespace args: the parsed ``json``, ``plot`` and ``no_plot``.
    :param str command: the subcommand, whose name gives the default file names.
    :raises ValueError: naming the argument and the path.

    Example::

        >>> prepare_outputs(argparse.Namespace(json="runs/cola.json", plot=None, no_plot=False), "mlm-curve")
        >>> os.path.isdir("runs")   # created; the plot goes to ./mlm-curve.png
        True
    """
    check_output_path("--json", args.json or f"{command}.json", f"{command}.json")
    if not args.no_plot:
        # the path as given: a folder is refused, not taken as the stem of FOLDER.png beside it
        check_output_path("--plot", args.plot or f"{command}.png", f"{command}.png")
        check_plot_format(args.plot or f"{command}.png")


def plot_path(args, command):
    """The file the plot is written to: ``--plot``, or ``<command>.png``; a path without an
    extension gets matplotlib's default format's (``savefig.format``, png), as ``savefig`` adds
    it (``--plot out/curve`` writes ``out/curve.png``, and the command said it wrote ``out/curve``).

    Example::

        >>> plot_path(argparse.Namespace(plot="out/curve"), "mlm-curve")
        'out/curve.png'
    """
    path = args.plot or f"{command}.png"
    if os.path.splitext(path)[1]:
        return path
    from matplotlib import rcParams

    return f"{path}.{rcParams['savefig.format']}"


def check_plot_format(path):
    """Refuse a ``--plot`` path whose extension matplotlib cannot write, before the run.

    :raises ValueError: naming the extension and the formats that can be written.

    Example::

        >>> check_plot_format("curve.pdf")   # None; "curve.txt" raises
    """
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return  # matplotlib writes its default format, and plot_path names the file
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise ValueError(f"--plot {path!r}: matplotlib cannot write .{ext} files; give a path ending in one "
                         f"of {', '.join('.' + f for f in sorted(formats))}.")


def check_output_path(flag, path, example):
    """Create the folder of an output file and check it can be written there.

    :param str flag: the argument, for the message (``"--json"``).
    :param str path: the file to be written at the end of the run.
    :param str example: a file name for the message when ``path`` is a folder.
    :raises ValueError: when ``path`` is a folder, or its folder cannot be created or written.

    Example::

        >>> check_output_path("--json", "out/run.json", "run.json")   # creates out/
    """
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; give a file path, e.g. {os.path.join(path, example)}.")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise ValueError(f"{flag} {path!r}: cannot write in its folder {folder!r} ({err.strerror or err}); "
                         f"give a path in a folder you can write to.") from None


def _setup(args):
    import torch

    from ..adapters.batching import resolve_accelerator

    if args.threads:
        torch.set_num_threads(args.threads)
    acc = resolve_accelerator(True) if args.distributed else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return acc, device


def _say(acc, text):
    if acc is None or acc.is_main_process:
        print(text)


def _write(args, command, payload, draw, acc):
    if acc is not None and not acc.is_main_process:
        return
    path = args.json or f"{command}.json"
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = draw()
        png = plot_path(args, command)
        fig.savefig(png, dpi=120, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {png}")


def _run_mlm(args):
    from ..adapters.loading import ResourceUnavailable, load_masked_lm, load_texts

    t0 = time.perf_counter()
    # arguments and data first: a usage error must not wait for (or hide behind) the model;
    # the checks that need no torch before those that import it
    try:
        dataset_options(args, "--text-file", args.text_file, "validation")
        prepare_outputs(args, "mlm-curve")
        from ..adapters.rates import PAPER_MLM_RATES, parse_rates, table2_area

        rates = parse_rates(args.rates)
        if args.device is not None:
            check_device(args.device)
        texts, columns = load_texts(args.text_file, args.dataset, args.dataset_config, args.split, args.column,
                                    args.limit, with_columns=True)
        args.column = columns  # the columns read, chosen when --column was left out
    except (ResourceUnavailable, ValueError) as err:
        _fail(err)
    if not texts:
        source = (f"--text-file {args.text_file!r}" if args.text_file else f"--dataset {args.dataset!r}"
                  + (f" (split {args.split!r})" if args.split else ""))
        _fail(f"no sequences to score: {source} is empty (blank lines are skipped); give one sequence per line.")
    try:
        model, tok = load_masked_lm(args.model, args.tokenizer, args.random_init, args.lowercase, args.seed,
                                    quiet=not args.progress)
    except (ResourceUnavailable, ValueError) as err:
        _fail(err)
    acc, device = _setup(args)
    from ..adapters.masked_lm import MaskedLMScorer

    label = args.label or (os.path.basename(os.path.normpath(args.model)) + (" (random init)" if args.random_init else ""))
    scorer = MaskedLMScorer(model, tok, max_tokens=args.max_tokens, device=None if acc else device, bf16=args.bf16,
                            seed=args.seed, progress=args.progress, accelerator=acc)
    try:  # texts the tokenizer cannot read are an input error, not a crash
        enc = scorer.encode(texts)
    except ValueError as err:
        _fail(err)
    curve = scorer.curve(enc, rates=rates, num_masks=args.num_masks, label=label)
    out = {
        "command": "mlm-curve",
        "model": args.model,
        "random_init": args.random_init,
        "data": {"text_file": args.text_file, "dataset": args.dataset, "config": args.dataset_config,
                 "split": None if args.text_file else args.split, "column": args.column, "limit": args.limit},
        "num_sequences": len(enc),
        "num_masks": args.num_masks,
        "seed": args.seed,
        **curve.to_dict(),
    }
    on_paper_grid = rates.shape == PAPER_MLM_RATES.shape and (abs(rates - PAPER_MLM_RATES) < 1e-9).all()
    out["table2_area"] = table2_area(curve) if on_paper_grid else None
    per_seq = {"curve_area": out.pop("per_item_area"), "num_tokens": out.pop("lengths")}
    for kind in args.scores or []:
        if kind.startswith("pll"):
            per_seq[kind] = scorer.pll(enc, word_l2r=kind == "pll-word-l2r").tolist()
        else:
            per_seq[f"score_{kind}"] = scorer.score(enc, masks=kind, num_masks=args.score_masks).tolist()
    out["per_sequence"] = per_seq
    out["seconds"] = time.perf_counter() - t0
    _say(acc, f"{len(enc)} sequences, {len(rates)} rates: area {curve.area():.2f} +- {_se(curve.area_stderr())}"
          + (f", Table 2 area {out['table2_area']:.2f}" if out["table2_area"] is not None else ""))

    def draw():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        curve.plot(ax)
        ax.set_title(f"MPT curve: {args.model}")
        return fig

    _write(args, "mlm-curve", out, draw, acc)
    return out


def _run_mae(args):
    from ..adapters.loading import ResourceUnavailable, load_images, load_vit_mae

    t0 = time.perf_counter()
    sigma2 = args.sigma2
    try:  # the checks that need no torch first, as in _run_mlm
        if sigma2 != "mle":
            try:
                sigma2 = float(sigma2)
            except ValueError:
                sigma2 = float("nan")
            if not (math.isfinite(sigma2) and sigma2 > 0):
                raise ValueError(f"--sigma2 must be a positive number or 'mle', got {args.sigma2!r}.")
        dataset_options(args, "--image-folder", args.image_folder, "test", "image")
        prepare_outputs(args, "mae-curve")
        from ..adapters.rates import parse_rates

        rates = parse_rates(args.rates)
        if args.device is not None:
            check_device(args.device)
        images = load_images(args.image_folder, args.dataset, args.dataset_config, args.split, args.column, args.limit)
        model, proc = load_vit_mae(args.model, args.processor, args.random_init, args.seed, quiet=not args.progress)
    except (ResourceUnavailable, ValueError) as err:
        _fail(err)
    acc, device = _setup(args)
    from ..adapters.vit_mae import MAEScorer, init_position_embeddings

    if args.init_position_embeddings:
        init_position_embeddings(model)

    label = args.label or (os.path.basename(os.path.normpath(args.model)) + (" (random init)" if args.random_init else ""))
    scorer = MAEScorer(model, proc, batch_size=args.batch_size, sigma2=sigma2, device=None if acc else device,
                       bf16=args.bf16, image_column=args.column or "image", seed=args.seed, progress=args.progress, accelerator=acc)
    curves = scorer.curves(images, rates=rates, num_masks=args.num_masks, label=label)
    mse, logd = curves["mse"].to_dict(), curves["log_density"].to_dict()
    out = {
        "command": "mae-curve",
        "model": args.model,
        "random_init": args.random_init,
        "data": {"image_folder": args.image_folder, "dataset": args.dataset, "config": args.dataset_config,
                 "split": None if args.image_folder else args.split, "column": args.column, "limit": args.limit},
        "num_images": len(images),
        "num_patches": scorer.num_patches,
        "patch_dim": scorer.patch_dim,
        "norm_pix_loss": bool(model.config.norm_pix_loss),
        "sigma2": curves["sigma2"],
        "num_masks": args.num_masks,
        "seed": args.seed,
        "rates": mse["rates"],
        "mse": {k: mse[k] for k in ("score", "stderr", "count")},
        "log_density": {k: logd[k] for k in ("score", "stderr", "count", "area", "area_stderr")},
        "per_image": {"mse": curves["mse"].per_item.tolist(), "log_density_area": logd["per_item_area"],
                      # which image each entry is: the folder's files in the order read
                      "file": list(getattr(images, "paths", None) or []) or None},
        "seconds": time.perf_counter() - t0,
    }
    _say(acc, f"{len(images)} images, {len(rates)} rates: log-density area {logd['area']:.2f} +- {_se(logd['area_stderr'])} "
          f"(sigma2={curves['sigma2']:.4g}); MSE {mse['score'][0]:.4f} at {100 * rates[0]:.0f}% .. "
          f"{mse['score'][-1]:.4f} at {100 * rates[-1]:.0f}%")

    def draw():
        import matplotlib.pyplot as plt

        # constrained: the right panel's long y label overlapped the left panel
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
        r = 100 * curves["mse"].rates
        a1.errorbar(r, curves["mse"].score, 2 * curves["mse"].stderr, label=label)
        a1.set_xlabel("masking rate (%)")
        a1.set_ylabel("MSE of masked patches")
        a1.legend()
        curves["log_density"].plot(a2)
        a2.set_ylabel(f"Gaussian log-density per patch ($\\sigma^2$={curves['sigma2']:.3g})")
        fig.suptitle(f"ViT-MAE MPT curves: {args.model}")
        return fig

    _write(args, "mae-curve", out, draw, acc)
    return out


#: subcommand name -> (add_arguments, run, help), the format of pyro_mpt.experiments.cli.SUBCOMMANDS
SUBCOMMANDS = {
    "mlm-curve": (_add_mlm_arguments, _run_mlm,
                  "MPT curve (mean masked-token log-prob per masking rate) of a HuggingFace masked LM"),
    "mae-curve": (_add_mae_arguments, _run_mae,
                  "MPT curves (masked-patch MSE and Gaussian log-density per rate) of a ViT-MAE"),
}


def register(subcommands):
    """Add ``mlm-curve`` and ``mae-curve`` to a ``name -> (add_arguments, run, help)`` registry."""
    subcommands.update(SUBCOMMANDS)
