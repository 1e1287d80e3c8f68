"""Loading models, tokenizers and data for the adapters, failing fast when offline.

``transformers`` and ``datasets`` retry unreachable hosts for a while before
giving up, with messages that do not say how to use a local copy. These
loaders decide up front -- local path, hub cache, hub reachability (a 3 s
probe) -- and raise :class:`ResourceUnavailable` with what was tried and how
to point at a local copy.

``"antiberty"`` names the pretrained AntiBERTy masked LM (26M parameters,
BERT architecture, amino-acid vocabulary) shipped inside the
``antiberty==0.1.3`` package: a real masked LM that works without network.
"""

import glob
import importlib
import json
import os
import socket
import threading
import warnings
from urllib.parse import urlparse

from .columns import check_image_column, text_columns
from .optional_packages import missing_package_message
from ..code_origin import user_stacklevel

__all__ = [
    "ResourceUnavailable",
    "antiberty_paths",
    "bare_vocab_lowercase",
    "load_masked_lm",
    "load_vit_mae",
    "load_texts",
    "load_images",
    "saved_dataset_kind",
    "hub_reachable",
    "quiet_transformers",
    "check_complete_weights",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class ResourceUnavailable(OSError):
    """A model or dataset could not be found locally nor reached on the hub."""


def optional_import(module, purpose, instead=""):
    """``importlib.import_module(module)`` for a package of the ``hf`` extra, or
    :class:`ResourceUnavailable` naming the package, what needed it and how to install it.

    :param str module: e.g. ``"datasets"`` or ``"transformers"``.
    :param str purpose: what needs it, for the message (``"Loading a dataset (--dataset)"``).
    :param str instead: a way around it, appended to the message.

    Example::

        >>> optional_import("json", "Reading JSON").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ResourceUnavailable(missing_package_message(module.split(".")[0], purpose, err) + instead) from err


def _truthy(name):
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_offline():
    return _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE")


def hub_reachable(timeout=3.0):
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` s.

    DNS lookups ignore socket timeouts, so the probe runs in a daemon thread.
    """
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    result = []

    def probe():
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])


def _in_hub_cache(repo_id, filename="config.json", repo_type="model"):
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
    except Exception:  # invalid repo ids raise; they are not cached either
        return False
    return isinstance(path, str)


def _go_offline():
    """Make huggingface_hub and datasets use their caches without network retries."""
    try:
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover
        pass
    try:
        import datasets.config as dc

        dc.HF_HUB_OFFLINE = True
        dc.HF_DATASETS_OFFLINE = True
    except ImportError:
        pass


def _resolve_hub(name, what, hint, repo_type="model", filename="config.json"):
    """``"local"``, ``"hub"`` or ``"cache"`` (hub unreachable, cached copy); else raise."""
    if os.path.exists(name):
        return "local"
    offline = _hub_offline() if repo_type == "model" else (_hub_offline() or _truthy("HF_DATASETS_OFFLINE"))
    if not offline and hub_reachable():
        return "hub"
    if repo_type == "model" and _in_hub_cache(name, filename):
        return "cache"
    if repo_type == "dataset":
        return "cache"  # datasets resolves its own cache; its failure is reported by the caller
    why = "HF_HUB_OFFLINE is set" if offline else "the HuggingFace hub cannot be reached (no network)"
    raise ResourceUnavailable(
        f"Could not load {what} {name!r}. Tried: (1) a local path {os.path.abspath(name)!r} -- it does "
        f"not exist; (2) the HuggingFace hub -- {why}; (3) the hub cache -- no copy of {name!r}. "
        f"{hint}"
    )


def quiet_transformers():
    """Silence transformers' load reports and weight-loading progress bars.

    AntiBERTy's checkpoint carries extra heads (species, chain, graft) that
    BertForMaskedLM reports as unexpected keys; they are not used.
    """
    logging = optional_import("transformers.utils.logging", "The HuggingFace adapters")
    logging.set_verbosity_error()
    logging.disable_progress_bar()


def antiberty_paths():
    """``(model_dir, vocab_file)`` of the AntiBERTy model shipped in ``antiberty==0.1.3``."""
    try:
        import antiberty
    except ImportError:
        raise ResourceUnavailable(
            "The 'antiberty' model ships in the antiberty package: pip install antiberty==0.1.3"
        ) from None
    root = os.path.join(os.path.dirname(antiberty.__file__), "trained_models")
    model_dir, vocab = os.path.join(root, "AntiBERTy_md_smooth"), os.path.join(root, "vocab.txt")
    if not (os.path.isdir(model_dir) and os.path.isfile(vocab)):
        raise ResourceUnavailable(f"The antiberty package at {root} lacks its trained model; reinstall antiberty==0.1.3.")
    return model_dir, vocab


_MODEL_HINT = (
    "Point MODEL at a local directory holding config.json and the weights (e.g. written by "
    "model.save_pretrained(DIR) / tokenizer.save_pretrained(DIR), or fetched with "
    "`huggingface-cli download NAME --local-dir DIR` where the hub is reachable), or use "
    "'antiberty', a masked LM that ships inside the antiberty==0.1.3 package."
)

_MAE_HINT = _MODEL_HINT.split(", or use 'antiberty'")[0] + "."


def bare_vocab_lowercase(path):
    """Whether a BERT ``vocab.txt`` that comes without a saved tokenizer setting should be read
    lower-cased: True when none of its tokens (special ``[...]`` tokens aside) has an upper-case
    letter (an uncased vocabulary: lower-casing the text only helps), False otherwise (a cased
    vocabulary, or AntiBERTy's upper-case residues, which lower-casing turns into unknown tokens).

    Before, ``mlm-curve DIR`` lower-cased such a vocabulary (transformers' BERT default) while
    ``--tokenizer DIR/vocab.txt`` kept the case: the same vocabulary read two ways.

    :param str path: the ``vocab.txt`` file.
    """
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f]
    return not any(t != t.lower() for t in tokens if t and not (t.startswith("[") and t.endswith("]")))


def load_tokenizer(spec, model_dir=None, lowercase=None, where="local"):
    """A tokenizer from a ``vocab.txt`` file (BERT WordPiece), a directory or a hub name.

    :param str spec: the tokenizer; None for the model's (``model_dir``).
    :param lowercase: lower-case the texts (``do_lower_case``); None: the tokenizer's saved
        setting, and for a bare ``vocab.txt`` (a file, or a directory whose only tokenizer file
        it is) :func:`bare_vocab_lowercase`, the same for both.
    :param str where: how ``model_dir`` resolved (``"local"``, ``"hub"``, ``"cache"``).
    """
    transformers = optional_import("transformers", "Loading a tokenizer")
    AutoTokenizer, BertTokenizer = transformers.AutoTokenizer, transformers.BertTokenizer

    if spec is not None and os.path.isfile(spec):
        # transformers 5 ignores vocab_file=; the vocabulary goes in vocab=
        return BertTokenizer(vocab=spec, do_lower_case=bare_vocab_lowercase(spec) if lowercase is None else lowercase)
    name = spec or model_dir
    if spec:
        hint = (
            "Point --tokenizer at an existing BERT vocab.txt file or a local directory holding the tokenizer's "
            "files (e.g. written by tokenizer.save_pretrained(DIR)), or leave --tokenizer out to use the model's."
        )
        where = _resolve_hub(name, "tokenizer", hint, filename="tokenizer_config.json")
    kw = {"local_files_only": True} if where == "cache" else {}
    vocab = os.path.join(name, "vocab.txt") if os.path.isdir(name) else None
    bare = vocab is not None and os.path.isfile(vocab) and not any(
        os.path.isfile(os.path.join(name, f)) for f in ("tokenizer_config.json", "tokenizer.json"))
    if lowercase is None and bare:
        # a directory whose only tokenizer file is vocab.txt saved no setting (transformers would
        # lower-case, BERT's default): read it as --tokenizer DIR/vocab.txt reads it
        lowercase = bare_vocab_lowercase(vocab)
    if lowercase is not None:
        kw["do_lower_case"] = lowercase
    try:
        return AutoTokenizer.from_pretrained(name, **kw)
    except (OSError, ValueError) as err:
        if vocab and os.path.isfile(vocab):
            return BertTokenizer(vocab=vocab, do_lower_case=bare_vocab_lowercase(vocab) if lowercase is None else lowercase)
        raise ResourceUnavailable(
            f"Could not load a tokenizer from {name!r} ({err}). Pass --tokenizer with a tokenizer "
            f"directory or a BERT vocab.txt file."
        ) from None


def _load_model(name, label, hint, from_config, from_pretrained, random_init, seed, quiet, kind=None, model_types=None):
    """``(model, where, hub_kwargs)``: the weights of ``name``, or with ``random_init`` its
    config freshly initialized under ``seed``; unreachable or unreadable files raise
    :class:`ResourceUnavailable` naming ``label`` and ``hint``, a config whose ``model_type``
    is not among ``model_types`` (when given; those of a ``kind`` of model) a ValueError."""
    where = _resolve_hub(name, "model", hint)
    if quiet:
        quiet_transformers()

    AutoConfig = optional_import("transformers", f"Loading {label} {name!r}").AutoConfig

    kw = {"local_files_only": True} if where == "cache" else {}
    try:
        config = AutoConfig.from_pretrained(name, **kw)
    except (OSError, ValueError) as err:  # missing files; a config transformers cannot read
        raise ResourceUnavailable(f"Could not load {label} {name!r}: {str(err).rstrip('.')}. {hint}") from None
    if model_types and config.model_type not in model_types:
        # before the weights: a BERT config built as a ViT-MAE crashed with --random-init (no
        # image_size), and without it was refused with the advice to pass --random-init
        types = sorted(model_types)
        shown = ", ".join(map(repr, types[:3])) + (f", ... ({len(types)} in all)" if len(types) > 3 else "")
        raise ValueError(
            f"Model {name!r} is a checkpoint of model_type {config.model_type!r}, not a {kind} "
            f"(model_type {shown}), with or without random_init (--random-init, which keeps the "
            f"checkpoint's architecture). Point MODEL at a {kind} checkpoint."
        )
    try:
        if random_init:
            from ..random_streams import seeded_streams

            # the user's random streams are left as they were
            with seeded_streams(seed):
                model = from_config(config)
        else:
            model, info = from_pretrained(name, output_loading_info=True, **kw)
    except (OSError, ValueError) as err:  # missing files; a config transformers cannot read
        raise ResourceUnavailable(f"Could not load {label} {name!r}: {str(err).rstrip('.')}. {hint}") from None
    if not random_init and info.get("missing_keys"):
        # the checkpoint's own kind (the model's config is the class's, whatever it read)
        check_complete_weights(name, model, info, config.model_type)
    return model, where, kw


def check_complete_weights(name, model, info, kind=None):
    """Refuse a checkpoint that lacks weights of the model built from it.

    transformers initializes them at random and reports it in the load report, which a
    quiet load (the CLI's) hides: an encoder-only ``BertModel`` checkpoint loaded as a masked
    LM gets a random head, a BERT checkpoint loaded as a ViT-MAE random everything, and the
    scores change from run to run under one seed.

    :param str name: the checkpoint, for the message.
    :param model: the loaded model.
    :param dict info: ``from_pretrained(..., output_loading_info=True)``'s report.
    :param str kind: the checkpoint's ``model_type``, when known.
    :raises ValueError: naming the checkpoint, the missing weights and what to do.
    """
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f", ... ({len(missing)} in all)" if len(missing) > 3 else "")
        raise ValueError(
            f"Checkpoint {name!r} lacks weights of the {type(model).__name__} built from it ({shown}): "
            f"transformers would draw them at random, so the scores would mean nothing and change "
            f"from run to run ({'a checkpoint of model_type ' + repr(kind) if kind else 'a checkpoint'}: "
            f"an encoder saved without its masked-LM head, or another kind of model, lacks them). Load a "
            f"checkpoint saved from {type(model).__name__}, or pass random_init=True (--random-init) to score a "
            f"randomly initialized model on purpose."
        )


def load_masked_lm(name, tokenizer=None, random_init=False, lowercase=None, seed=0, quiet=False):
    """``(model, tokenizer)`` for a local directory, a hub name or ``"antiberty"``.

    :param str name: model directory, hub id, or ``"antiberty"``.
    :param str tokenizer: tokenizer directory / hub id / ``vocab.txt`` file;
        default the model's.
    :param bool random_init: same config, freshly initialized weights (seeded).
    :param bool quiet: silence transformers' load report (:func:`quiet_transformers`).
    :raises ResourceUnavailable: at once when nothing can be reached.
    :raises ValueError: when the tokenizer does not fit the model (:func:`~pyro_mpt.adapters.mlm_inputs.check_tokenizer`).
    """
    if name == "antiberty":
        name, vocab = antiberty_paths()
        tokenizer = tokenizer or vocab
    AutoModelForMaskedLM = optional_import("transformers", "Loading a masked LM").AutoModelForMaskedLM

    from .mlm_inputs import check_tokenizer

    try:  # the kinds AutoModelForMaskedLM builds; where transformers moves the table, its own error stands
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked_lms
    except ImportError:  # pragma: no cover
        masked_lms = None
    model, where, _ = _load_model(name, "model", _MODEL_HINT, AutoModelForMaskedLM.from_config,
                                  AutoModelForMaskedLM.from_pretrained, random_init, seed, quiet, "masked LM", masked_lms)
    tok = load_tokenizer(tokenizer, model_dir=name, lowercase=lowercase, where=where)
    check_tokenizer(tok, model)
    return model.eval(), tok


def load_vit_mae(name, processor=None, random_init=False, seed=0, quiet=False):
    """``(ViTMAEForPreTraining, image_processor)`` from a directory or hub name.

    Falls back to a ``ViTImageProcessor`` with the config's image size and
    ImageNet statistics (those of ``facebook/vit-mae-base``) when the model
    directory has no processor file.
    """
    transformers = optional_import("transformers", "Loading a ViT-MAE")
    AutoImageProcessor, ViTMAEForPreTraining = transformers.AutoImageProcessor, transformers.ViTMAEForPreTraining

    from .vit_mae import init_position_embeddings

    model, _, kw = _load_model(name, "ViT-MAE", _MAE_HINT, lambda c: init_position_embeddings(ViTMAEForPreTraining(c), reinit=True),
                               ViTMAEForPreTraining.from_pretrained, random_init, seed, quiet, "ViT-MAE", {"vit_mae"})
    try:
        proc = AutoImageProcessor.from_pretrained(processor or name, **kw)
    except (OSError, ValueError):
        s = model.config.image_size
        h, w = (s, s) if isinstance(s, int) else tuple(s)  # ViTMAEConfig takes an int or an (h, w) pair
        C = model.config.num_channels
        # ImageNet's statistics for RGB models; 0.5 / 0.5 per channel for others (e.g. grayscale)
        mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if C == 3 else ([0.5] * C, [0.5] * C)
        warnings.warn(
            f"No image processor found for {processor or name!r}; using ViTImageProcessor with size {h}x{w} "
            f"and mean {mean}, std {std} (ImageNet's for RGB, as facebook/vit-mae-base). Pass --processor / "
            f"processor= to choose.",
            stacklevel=user_stacklevel(),
        )
        # looked up here only: without torchvision, transformers prints a line when it is first named
        proc = transformers.ViTImageProcessor(size={"height": h, "width": w}, image_mean=mean, image_std=std)
    return model.eval(), proc


_DATA_HINT = (
    "Use a local copy instead: --text-file FILE (one sequence per line), a CSV/JSON/Parquet file or a "
    "directory written by Dataset.save_to_disk() as --dataset PATH, or fetch the dataset where the hub "
    "is reachable and copy its cache (HF_HOME) here."
)


def saved_dataset_kind(path):
    """What ``save_to_disk`` wrote in the folder ``path``: ``"dict"`` (a ``DatasetDict``, whose
    splits ``--split`` chooses), ``"dataset"`` (one ``Dataset``: one table, no splits), or None
    (not a folder written by ``save_to_disk``)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "dict"
    if os.path.isfile(os.path.join(path, "state.json")):
        return "dataset"
    return None


def _saved_splits(path):
    with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
        return list(json.load(f).get("splits", []))


def _saved_data_files(path):
    """The arrow files of a ``save_to_disk`` Dataset folder (none where it saved no rows)."""
    try:
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            return json.load(f).get("_data_files") or []
    except (OSError, ValueError):
        return None


def _root_cause(err):
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _no_rows(what, why, todo):
    return ValueError(f"{what[0].upper()}{what[1:]} has no rows{why}; {todo}")


def _read(datasets, what, read, empty, empty_todo, unreadable_todo):
    """``read()``, whose failures (datasets' own exceptions, pandas', pyarrow's, an IndexError of
    an empty split) become one ValueError naming ``what``: the no-rows message when ``empty()``
    says the data holds none, else what could not be read and why."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    # its 'Failed to read schema' lines and a bar of 'Generating train split: 0 examples' came
    # before the one line that says what went wrong; a local file is read in moments
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        return read()
    except Exception as err:
        if empty():
            raise _no_rows(what, "", empty_todo) from None
        raise ValueError(f"Cannot read {what} ({_root_cause(err)}); {unreadable_todo}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _load_saved(datasets, name, split):
    if saved_dataset_kind(name) == "dict":
        splits = _saved_splits(name)
        if split not in splits:
            raise ValueError(f"Split {split!r} not in {name}; available: {splits}. Pass --split.")
        # the split alone: load_from_disk of the whole DatasetDict failed (an IndexError) where a
        # split that was never asked for had no rows
        path, what = os.path.join(name, split), f"split {split!r} of {name!r}"
        with_rows = [s for s in splits if _saved_data_files(os.path.join(name, s))]
        todo = f"pass --split with one that has rows: {with_rows}." if with_rows else "save it with at least one row."
    else:
        path, what = name, f"the dataset folder {name!r}"
        todo = "save it with at least one row, or pass another --dataset."
    ds = _read(datasets, what, lambda: datasets.load_from_disk(path), lambda: _saved_data_files(path) == [], todo,
               "pass a folder written by Dataset.save_to_disk() or DatasetDict.save_to_disk(), a data file or a "
               "hub dataset name.")
    if len(ds) == 0:
        raise _no_rows(what, "", todo)
    return ds


def _load_file(datasets, name, ext, builder, **kw):
    what = f"the data file {name!r}"
    todo = "give a file with at least one row of data, or another --dataset."

    def blank():
        with open(name, "rb") as f:
            return not f.read(1 << 16).strip()

    def read():
        # load_dataset's steps, so that a file of no rows is told by its row count, not by the
        # "Instruction 'train' corresponds to no data!" that as_dataset raises then
        loader = datasets.load_dataset_builder(builder, data_files=name, **kw)
        loader.download_and_prepare()
        splits = loader.info.splits or {}
        if "train" not in splits or not splits["train"].num_examples:
            return None
        return loader.as_dataset(split="train")

    fmt = "Parquet" if ext == "parquet" else ext.upper()
    ds = _read(datasets, what, read, blank, todo,
               f"check that it is a valid {fmt} file, or give the data another way (--text-file for plain text).")
    if ds is None or len(ds) == 0:
        raise _no_rows(what, " (only a header)" if builder == "csv" else "", todo)
    return ds


def load_dataset_split(name, config=None, split="validation"):
    """A ``datasets.Dataset``: a ``save_to_disk`` directory, a data file, or a hub dataset.

    :raises ValueError: a local file or folder that cannot be read, or that holds no rows
        (naming it and what to do).
    """
    datasets = optional_import(
        "datasets", "Loading a dataset (--dataset, dataset=)",
        " Or give the data without it: --text-file FILE (one sequence per line) or --image-folder DIR.",
    )
    if os.path.isdir(name):
        return _load_saved(datasets, name, split)
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower().lstrip(".")
        builder = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json", "parquet": "parquet"}.get(ext)
        if builder is None:
            raise ValueError(f"Cannot read {name!r}: use .csv/.tsv/.json/.jsonl/.parquet, or --text-file for plain text.")
        return _load_file(datasets, name, ext, builder, **({"delimiter": "\t"} if ext == "tsv" else {}))
    offline = _truthy("HF_DATASETS_OFFLINE") or _hub_offline()
    if offline or not hub_reachable():
        _go_offline()
        why = "offline mode is set (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)" if offline else "the hub cannot be reached (no network)"
    else:
        why = None
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises ConnectionError, FileNotFoundError, ValueError...
        tried = f"(1) a local path {os.path.abspath(name)!r} -- it does not exist; (2) the hub"
        tried += f" -- {why}, and the datasets cache has no copy" if why else f" -- {type(err).__name__}: {err}"
        raise ResourceUnavailable(
            f"Could not load dataset {name!r} (config={config!r}, split={split!r}). Tried: {tried}. {_DATA_HINT}"
        ) from None


def load_texts(text_file=None, dataset=None, config=None, split="validation", columns=None, limit=None,
               with_columns=False):
    """Texts (or ``(text, pair)`` tuples) from a file with one per line, or a dataset.

    :param str split: the split of a hub dataset or of a ``save_to_disk`` directory (a data
        file has one table, read whatever ``split`` says).
    :param list columns: one column, or two for sentence pairs (e.g. QNLI's
        ``question sentence``); default ``text``/``sentence``, the first string
        column otherwise.
    :param bool with_columns: return ``(texts, columns)``, the columns read (None for a
        text file).
    :raises ValueError: a column that holds other values than text (numbers, empty cells).
    """
    if (text_file is None) == (dataset is None):
        raise ValueError("Give exactly one data source: --text-file FILE or --dataset NAME.")
    if text_file is not None:
        if not os.path.isfile(text_file):
            raise ResourceUnavailable(
                f"Text file {text_file!r} does not exist; pass --text-file with an existing "
                f"file (one sequence per line)."
            )
        with open(text_file, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        texts = texts[:limit] if limit else texts
        return (texts, None) if with_columns else texts
    if columns:  # before any loading: a usage error
        columns = text_columns(columns, "--column (load_texts(columns=...))")
    ds = load_dataset_split(dataset, config, split)
    if limit:
        ds = ds.select(range(min(limit, len(ds))))
    if not columns:
        strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        preferred = [c for c in ("text", "sentence", "premise") if c in strings]
        if not strings:
            raise ValueError(f"No text column in {dataset!r}: columns {ds.column_names}. Pass --column.")
        columns = preferred[:1] or strings[:1]
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"Column(s) {missing} not in {dataset!r}; columns are {ds.column_names}. Pass --column.")
    values = [list(ds[c]) for c in columns]
    for c, column in zip(columns, values):
        bad = next((i for i, v in enumerate(column) if not isinstance(v, str)), None)
        if bad is not None:
            v = column[bad]
            what = "an empty cell" if v is None else f"{type(v).__name__} {v!r}"
            raise ValueError(
                f"Column {c!r} of {dataset!r} holds {what} at row {bad}, not text; pass --column with text "
                f"columns (one, or two for sentence pairs), or fill the empty cells."
            )
    texts = values[0] if len(columns) == 1 else list(zip(*values))
    return (texts, list(columns)) if with_columns else texts


class _ImageFiles:
    """Lazily opened image files, indexable like a dataset."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image

        try:
            with Image.open(self.paths[i]) as im:
                return im.convert("RGB")
        except OSError as e:  # PIL's UnidentifiedImageError, a truncated file
            raise _unreadable(self.paths[i], e) from e

    def check(self):
        """Open each file's header (no pixels decoded), so that a file that is no image is a
        usage error before the model loads, not a traceback midway through the scoring."""
        from PIL import Image

        for path in self.paths:
            try:
                Image.open(path).close()
            except OSError as e:
                raise _unreadable(path, e) from e
        return self


def _unreadable(path, error):
    return ValueError(f"Image file {path!r} cannot be read ({error}); remove or re-save it.")


def load_images(image_folder=None, dataset=None, config=None, split="test", column="image", limit=None):
    """Images from a folder (recursively; png/jpg/...) or an image dataset."""
    if (image_folder is None) == (dataset is None):
        raise ValueError("Give exactly one data source: --image-folder DIR or --dataset NAME.")
    if image_folder is not None:
        if not os.path.isdir(image_folder):
            raise ResourceUnavailable(
                f"Image folder {image_folder!r} does not exist; pass --image-folder with an "
                f"existing directory of images."
            )
        paths = sorted(
            p for p in glob.glob(os.path.join(image_folder, "**", "*"), recursive=True)
            if p.lower().endswith(IMAGE_EXTENSIONS)
        )
        if not paths:
            raise ValueError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) under {image_folder!r}.")
        return _ImageFiles(paths[:limit] if limit else paths).check()
    ds = load_dataset_split(dataset, config, split)
    if column not in ds.column_names:
        guess = [c for c in ds.column_names if c in ("img", "image", "pixel_values")]
        raise ValueError(
            f"Image column {column!r} not in {dataset!r} (columns {ds.column_names}); pass --column {guess[0] if guess else '...'}."
        )
    check_image_column(ds, column, repr(dataset), "--column")  # before the model loads
    if limit:
        ds = ds.select(range(min(limit, len(ds))))
    return ds
