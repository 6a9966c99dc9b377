"""One validated run configuration.

:class:`RunConfig` is the single source of truth for every run option. Each field carries its
help text and its rule in ``metadata``; from that one declaration come

* the CLI flags of ``fl-split train`` (``--batch-size`` for ``batch_size``),
* the Flower run-config keys (``batch-size``, same spelling as the flag, see
  ``[tool.flwr.app.config]`` in ``pyproject.toml``),
* validation with errors that name the flag, the value and what is allowed.

Values that depend on the dataset (how many parties its columns allow, which model fits) are
checked when the run is built (:func:`fl_split.builder.build_run`), with the same error type.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fl_split.errors import ConfigError

#: Sentinel spelled in configs for "let fl_split choose" (Flower run-config has no null).
AUTO = "auto"
#: in a deployment node's ``checkpoint-dir`` (and a kit's job): replaced by the run's identity, so every
#: run of a long-lived SuperNode checkpoints into its own folder (docs/deploy.md, "After the first run")
RUN_PLACEHOLDER = "{run}"

MERGE_OPS = ("concat", "sum", "avg", "max", "min", "mul")
#: options that decide what a party's data file contains (``fl-split export-parties``); a run must
#: use the same values as the export
DATA_KEYS = ("dataset", "guests", "host_features", "columns", "padding", "test_fraction", "limit", "seed", "task")
DEFENSES = ("none", "laplace", "gaussian", "r3elu", "rr", "dpsgd")


def _opt(default: Any, help: str, *, choices: tuple | Callable[[], tuple] | None = None,
         check: Callable[[Any], bool] | None = None, allowed: str | None = None,
         kind: str | None = None, group: str = "core", flag: str | None = None,
         flag_help: str | None = None) -> Any:
    """Declare one option: default, help, and its rule (``choices`` or ``check`` + ``allowed``)."""
    meta = {"help": help, "choices": choices, "check": check, "allowed": allowed,
            "kind": kind, "group": group, "flag": flag, "flag_help": flag_help}
    return field(default=default, metadata=meta)


def _peer_limit_ok(v: str) -> bool:
    from fl_split.psi import check_peer_limit

    return check_peer_limit(v)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _nonneg_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _open_unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1


def _device_ok(v: str) -> bool:
    """``--device``: auto, cpu, cuda or cuda:N (whether GPU N exists is checked where the parties run,
    :func:`fl_split.devices.resolve`)."""
    if v in (AUTO, "cpu", "cuda"):
        return True
    return v.startswith("cuda:") and v[5:].isdigit() and str(int(v[5:])) == v[5:]


def _dataset_names() -> tuple:
    from fl_split.data.registry import dataset_names

    return tuple(dataset_names())


def _accountant_names() -> tuple:
    from fl_split.privacy.accountants import accountant_names

    return tuple(accountant_names())


def _model_names() -> tuple:
    from fl_split.models.catalog import model_names

    return (AUTO, *model_names())


def is_user_model(value: Any) -> bool:
    """``package.module:function`` (syntax only: the module is imported where a party builds it)."""
    import re

    dotted = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
    return isinstance(value, str) and re.fullmatch(rf"{dotted}:{dotted}", value) is not None


def is_model_factory(value: Any) -> bool:
    """A Python callable given as ``model`` (the Python API, ``docs/api.md``): called like a
    ``package.module:function`` (:mod:`fl_split.models.user`), in the process that builds the party."""
    return callable(value) and not isinstance(value, str)


def factory_label(fn: Any) -> str:
    """``module:qualname`` of a model factory: its name in results, manifests and checkpoints (a lambda
    or a local function reads ``__main__:<lambda>`` or ``mod:f.<locals>.g``: a label, not importable)."""
    fn = getattr(fn, "func", fn)  # functools.partial: the wrapped function's name
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


def importable_name(fn: Any) -> str | None:
    """``package.module:function`` when the ClientApp processes can import ``fn`` by that name (a
    function defined at the top level of an importable module, not ``__main__``), else ``None``."""
    import importlib

    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or not is_user_model(f"{module}:{qualname}"):
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - not importable by that name
        return None
    return f"{module}:{qualname}" if obj is fn else None


@dataclass(frozen=True)
class RunConfig:
    """Every option of a run. Field ``x_y`` is flag ``--x-y`` and Flower key ``x-y``."""

    # --- data and partitioning -------------------------------------------------------------
    dataset: str = _opt("digits", "dataset name (see `fl-split datasets`)", choices=_dataset_names)
    guests: int = _opt(1, "number of guest parties G (features only); with one --data table per party it is read "
                          "from --data (guest-1 … guest-G)", check=_positive_int,
                       allowed="an integer >= 1 (and at most the dataset's feature columns)")
    host_features: bool = _opt(True, "the host holds feature columns too (off: host = labels + top model only)",
                               flag="no-host-features",
                               flag_help="the host holds no feature columns (labels and top model only, as the "
                                         "server of papers 000/003)")
    columns: str = _opt("", "explicit column ownership, e.g. 'host=Income,Debt;guest-1=Age,Job' "
                            "(tables) or 'host=0:4;guest-1=4:8' (image pixel-column ranges); "
                            "empty = the dataset's documented default")
    padding: bool = _opt(False, "zero-pad each party's raw features into the full-width vector (001 Table 1)")
    test_fraction: float = _opt(0.2, "fraction of the shared IDs held out for testing", check=_open_unit,
                                allowed="a number strictly between 0 and 1")
    limit: int = _opt(0, "use only the first N shared IDs after shuffling (0 = all); for quick runs",
                      check=_nonneg_int, allowed="an integer >= 0")
    data_root: str = _opt("", "where downloadable datasets are stored (default: $FL_SPLIT_DATA or "
                              "~/.cache/fl_split)")
    party_files: str = _opt("", "local engine: build each party from its own data file in this directory (written "
                                "by `fl-split export-parties`: host.npz|csv|parquet, guest-1.…) instead of preparing "
                                "the dataset; every file is checked before training; empty = prepare the dataset")
    data: str = _opt("", "your own data instead of --dataset: one CSV or Parquet table per party, "
                         "'host=PATH;guest-1=PATH;…' (the flag may be repeated: --data host=PATH --data guest-1=PATH), "
                         "or one table PATH whose columns --columns assigns (docs/datasets.md); empty = --dataset",
                     check=lambda v: isinstance(v, str) and "\n" not in v,
                     allowed="'party=PATH;…' or one PATH")
    id_column: str = _opt("id", "with --data: every table's ID column (integers or text, e.g. customer numbers or "
                                "e-mails), or several joined by commas for a composite key ('name,birth_date'); "
                                "values match exactly after stripping spaces (docs/datasets.md, \"Join keys\")",
                          check=lambda v: isinstance(v, str) and v.strip() != "", allowed="a column name")
    label_column: str = _opt("label", "with --data: the name of the label column (the host's table only)",
                             check=lambda v: isinstance(v, str) and v.strip() != "", allowed="a column name")
    align: str = _opt("public", "with --data: how the parties' rows are aligned by ID: public = the host's IDs "
                                "are the shared list, sent to every party, and every guest must hold each of them; "
                                "psi = private set intersection (ECDH-PSI): the run trains on the intersection "
                                "and no party learns another's IDs outside it", choices=("public", "psi"))
    psi_max_peer_ids: str = _opt("", "with --align psi: the largest ID set of another party this run's parties align "
                                     "with, N IDs or RATIOx their own set's size (e.g. 50000 or 25x); a larger "
                                     "announced set is refused before any of it is blinded. Empty = the larger of 4x "
                                     "the own set and the own set + 10,000. A deployment node takes its own from its "
                                     "node config psi-max-peer-ids; this key can only lower it (docs/threat-model.md, "
                                     "\"Alignment\")",
                                 check=lambda v: isinstance(v, str) and _peer_limit_ok(v),
                                 allowed="empty, a number of IDs N or a ratio RATIOx (e.g. 50000 or 25x)")
    task: str = _opt("auto", "what the host's top model learns: binary (2 classes; accuracy, AUC, F1, precision, "
                             "recall, KS), multiclass (accuracy), regression (a numeric label, MSE loss; R2, MAE, RMSE); "
                             "auto = the dataset's own task, 2 classes binary, more multiclass, and for --data a numeric "
                             "label with non-integer values and more than 10 distinct values regression, whole "
                             "numbers with more than 20 values regression when under 5 rows per value, refused "
                             "(choose --task) when more (fl_split/tasks.py; docs/results.md)", choices=("auto", "binary", "multiclass", "regression"))
    class_weight: str = _opt("none", "binary/multiclass: weigh each class's loss by n / (K n_k) from the host's training "
                                     "labels (balanced, for imbalanced classes); none = unweighted",
                             choices=("none", "balanced"))
    data_name: str = _opt("own", "with --data: the data's name in the results; with --seed it keys the "
                                 "train/test split draw", check=lambda v: isinstance(v, str) and v.strip() != "",
                          allowed="a non-empty name")
    encode: str = _opt("", "with --data: per-column encoding overrides, 'COLUMN=KIND;…' with KIND numeric, "
                           "categorical or drop (e.g. 'Age=numeric;Pclass=categorical;Name=drop'), or '@FILE' "
                           "holding such entries; each party applies the entries naming its own columns. Without "
                           "one: text columns one-hot, numbers standardised, empty cells imputed plus a missing "
                           "indicator, all fitted on the party's own training rows (docs/datasets.md)",
                       check=lambda v: isinstance(v, str) and "\n" not in v,
                       allowed="'COLUMN=KIND;…' (KIND numeric, categorical or drop; '@FILE' entries read from a "
                               "file)")

    # --- model ----------------------------------------------------------------------------
    model: str = _opt(AUTO, "architecture name (see `fl-split models`), or your own as 'package.module:function' "
                            "returning each party's nn.Module (docs/models.md); auto = the dataset's default",
                      check=lambda v: is_model_factory(v) or v in _model_names() or is_user_model(v),
                      allowed="one of " + ", ".join(_model_names()) + ", or 'package.module:function' "
                              "(your own model, docs/models.md)")
    cut_layer: Any = _opt(AUTO, "how many layers of the architecture sit in each bottom model "
                                "(the cut position); auto = the architecture's default",
                          kind="int_or_auto", allowed="'auto' or an integer >= 1")
    hidden: str = _opt(AUTO, "hidden widths of model 'mlp', e.g. '128,64'; auto = the model's default",
                       check=lambda v: v == AUTO or (all(p.strip().isdigit() and int(p) > 0 for p in v.split(","))),
                       allowed="'auto' or comma-separated positive integers")
    norm: str = _opt(AUTO, "normalisation layers of the architectures that have them (MLPs, ResNets): batch, "
                           "group, layer or none; auto = the architecture's own. BatchNorm mixes the records of a "
                           "batch, so a party that claims differential privacy needs group, layer or none",
                     choices=(AUTO, "batch", "group", "layer", "none"))
    merge: str = _opt("concat", "how the host merges cut-layer outputs", choices=MERGE_OPS)

    # --- optimisation ---------------------------------------------------------------------
    epochs: int = _opt(5, "training epochs", check=_positive_int, allowed="an integer >= 1")
    batch_size: int = _opt(32, "mini-batch size", check=_positive_int, allowed="an integer >= 1")
    lr: float = _opt(0.01, "learning rate", check=_positive_float, allowed="a number > 0")
    optimizer: str = _opt("adam", "optimizer of every party", choices=("sgd", "adam"))
    momentum: float = _opt(0.0, "SGD momentum", check=lambda v: _nonneg_float(v) and v < 1,
                           allowed="a number in [0, 1)")
    weight_decay: float = _opt(0.0, "L2 weight decay", check=_nonneg_float, allowed="a number >= 0")
    seed: int = _opt(0, "public run seed: the data split, the batch order and the round plan that every party "
                        "shares. It is public: each party's private draws (initialisation, noise, masks) come "
                        "from its own secret, see --private-seed", check=_nonneg_int, allowed="an integer >= 0")
    monolithic: bool = _opt(False, "train the same modules as one model with one optimizer (no split)")

    # --- execution ------------------------------------------------------------------------
    engine: str = _opt("local", "local = in-process parties; flower = a Flower simulation on Ray",
                       choices=("local", "flower"))
    device: str = _opt(AUTO, "where parties put their tensors: auto, cpu, cuda or cuda:N (GPU number N of this "
                             "machine)", check=lambda v: isinstance(v, str) and _device_ok(v),
                       allowed="auto, cpu, cuda or cuda:N (N an integer >= 0)")
    threads: Any = _opt(AUTO, "torch intra-op threads of each party: auto = 1 per party, or the whole CPUs its Flower "
                              "ClientApp reserves (docs/flower.md, \"CPUs and threads\")",
                        kind="int_or_auto", allowed="'auto' or an integer >= 1")
    deterministic: bool = _opt(False, "deterministic cuDNN/cuBLAS kernels in every process that builds a party "
                                      "(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8): on a GPU "
                                      "the same seeds then give the same numbers in every engine; CPU runs are "
                                      "deterministic without it (docs/flower.md, \"Devices\")")
    batches_per_round: Any = _opt(1, "mini-batches carried by one Flower round ('epoch' = all of an "
                                     "epoch); 1 = exact sequential semantics", group="flower",
                                  kind="int_or_epoch", allowed="'epoch' or an integer >= 1")
    data_plane: str = _opt("direct", "how the per-batch tensors of --engine flower travel: direct = straight between "
                                     "guests and host over gRPC streams, Flower carrying one control message per party "
                                     "per epoch; flower = every tensor inside Flower messages (relay: for parties that "
                                     "cannot reach each other; --batches-per-round trades exactness for speed)",
                           choices=("direct", "flower"), group="flower")
    dataplane_timeout: float = _opt(60.0, "direct data plane: seconds a party waits for its peers to connect and for "
                                          "every reply; a guest that disconnects or stalls longer is named and the run "
                                          "stops", check=_positive_float, allowed="a number > 0", group="flower")
    epochs_per_message: Any = _opt(AUTO, "direct data plane: epochs one control message covers (fewer Flower round "
                                         "trips; the coordinator hears of its epochs when it ends, and every party "
                                         "still checkpoints each epoch end); auto = the whole run in a deployment "
                                         "(the host logs each epoch on its own machine), 1 in a simulation",
                                   kind="int_or_auto", allowed="'auto' or an integer >= 1", group="flower")
    num_cpus: Any = _opt(AUTO, "CPUs reserved per Flower client (Ray actor); auto = the CPUs Ray has, shared by "
                               "the G + 1 ClientApps (fractions allowed; docs/flower.md, \"CPUs and threads\")",
                         kind="float_or_auto", allowed="'auto' or a number > 0", group="flower")
    num_gpus: float = _opt(0.0, "GPUs reserved per Flower client (Ray actor)", check=_nonneg_float,
                           allowed="a number >= 0", group="flower")
    node_timeout: float = _opt(120.0, "seconds the coordinator waits for nodes to register and reply",
                               check=_positive_float, allowed="a number > 0", group="flower")
    ray_address: str = _opt("", "address of an existing Ray cluster to run the simulation on "
                                "(e.g. 127.0.0.1:6379); empty = a local Ray instance", group="flower")
    progress: bool = _opt(True, "show progress bars", flag="no-progress", flag_help="do not show progress bars")
    out: str = _opt("", "write the results JSON here (written once, at the end)")

    # --- robustness (docs/robustness.md) ----------------------------------------------------
    checkpoint_dir: str = _opt("", "checkpoint every party's whole state, its write-ahead log of releases and the "
                                   "coordinator's round into this directory (a party's files hold its secret: keep "
                                   "the directory private); empty = no checkpoints. Flower: with the direct data plane, at "
                                   "the end of each control message; a deployment node keeps its own in its node-config "
                                   "checkpoint-dir",
                               group="robustness")
    checkpoint_every: Any = _opt("epoch", "when to checkpoint: 'epoch' = after each epoch's evaluation, N = every N "
                                          "rounds", kind="int_or_epoch", allowed="'epoch' or an integer >= 1",
                                 group="robustness")
    resume: bool = _opt(False, "go on from the last checkpoint in --checkpoint-dir (same options; the releases made "
                               "after it are replayed from the parties' logs, so no spent budget is forgotten)",
                        group="robustness")
    on_guest_failure: str = _opt("stop", "a guest that fails or stops answering: stop = name it and stop (resume "
                                         "later from the last checkpoint); pad = go on with its embedding "
                                         "zero-filled from that round (results: guest_failures)",
                                 choices=("stop", "pad"), group="robustness")
    loss_alarm: bool = _opt(False, "the host refuses a training round whose loss jumps and one guest's zero-fill "
                                   "undoes the jump, twice in 3 batches (a guest poisoning inside the public range, "
                                   "e.g. permuting its records; docs/threat-model.md); costs one extra forward "
                                   "pass per batch", group="robustness")

    # --- serving (docs/serving.md) -----------------------------------------------------------
    save_model: str = _opt("", "after training, each party saves its own part into DIR/<party>/ (bottom, its "
                               "preprocessing, public mechanism parameters; the host: top, merge, task), owner-only, "
                               "for `fl-split predict` (local engine); empty = not saved", group="serving")
    init_from: str = _opt("", "start from a saved model (--save-model DIR of an earlier run with the same "
                              "architecture and shapes): each party loads its own part; empty = fresh initialisation",
                          group="serving")

    # --- privacy (spec §3, §5) ------------------------------------------------------------
    defense: str = _opt("none", "mechanism on the cut-layer crossings: a built-in name, or your own class "
                                "'package.module:Class' (docs/plugins.md)",
                        check=lambda v: v in DEFENSES or is_user_model(v),
                        allowed="one of " + ", ".join(DEFENSES) + " or 'package.module:Class' (docs/plugins.md)",
                        group="privacy")
    defense_options: str = _opt("", "parameters of a plug-in --defense, 'key=value,key=value' (given to the class "
                                    "as spec.options); empty for the built-in defences", group="privacy")
    protect: str = _opt("guest", "whose data the defense protects: guest = forward releases, "
                                 "host = backward releases, both", choices=("guest", "host", "both"),
                        group="privacy")
    epsilon: float = _opt(1.0, "epsilon of releasing one record's whole cut-layer tensor once (geometric schedule: the total over epochs)",
                          check=_positive_float, allowed="a number > 0", group="privacy")
    delta: float = _opt(1e-5, "delta of (epsilon, delta)-DP reports", check=_open_unit,
                        allowed="a number strictly between 0 and 1", group="privacy")
    sigma: float = _opt(0.7, "Gaussian noise std on the tanh-bounded cut layer (003)",
                        check=_positive_float, allowed="a number > 0", group="privacy")
    laplace_b: Any = _opt(AUTO, "Laplace noise scale b; auto = sensitivity / epsilon",
                          kind="float_or_auto", allowed="'auto' or a number > 0", group="privacy")
    clip_c: Any = _opt(AUTO, "clipping bound C of forward releases (R3eLU ClipK, Laplace bound); auto = per defence: "
                             "laplace 0.01, r3elu 0.1 (they train on the default data at epsilon 1), otherwise 10",
                       kind="float_or_auto", allowed="'auto' or a number > 0", group="privacy")
    clip_c_backward: Any = _opt(AUTO, "clipping bound C of backward releases; auto = --clip-c",
                                kind="float_or_auto", allowed="'auto' or a number > 0", group="privacy")
    top_k: Any = _opt(AUTO, "R3eLU K (entries kept by ClipK); auto = the cut width / 32 (at least 1), "
                            "half = half the cut width (001's setting)",
                      kind="int_or_auto_half", allowed="'auto', 'half' or an integer >= 1", group="privacy")
    allocation: str = _opt("uniform", "R3eLU budget allocation across cut-layer features: importance = 001 "
                                      "Eq. 8-10 and Cor. 6 as published; importance-tight = same proportions, "
                                      "smallest scales costing the same epsilon (ours)",
                           choices=("uniform", "importance", "importance-tight"), group="privacy")
    allocation_epsilon: Any = _opt(AUTO, "R3eLU importance allocation: epsilon of each release of the allocation "
                                         "(noisy importance shares, charged to every training record at each "
                                         "refresh: the receiver can read the allocation back); auto = epsilon / 10",
                                   kind="float_or_auto", allowed="'auto' or a number > 0", group="privacy")
    schedule: str = _opt("constant", "per-iteration budget schedule (001 §3.4: geometric eps_T/2^i)",
                         choices=("constant", "geometric"), group="privacy")
    denoise: str = _opt("none", "post-processing of noisy releases (003): scale = lambda*x, "
                                "mask = Bernoulli(p) keep, no rescale", choices=("none", "scale", "mask"),
                        group="privacy")
    denoise_param: float = _opt(0.2, "lambda of scale or p of mask", check=_open_unit,
                                allowed="a number strictly between 0 and 1", group="privacy")
    importance_refresh: str = _opt("epoch", "R3eLU importance allocation: when the neuron importances U are "
                                            "refreshed (001 §3.4: before each epoch; batch = before every release)",
                                   choices=("epoch", "batch"), group="privacy")
    denoise_side: str = _opt("forward", "which releases are denoised (by their receiver)",
                             choices=("forward", "backward", "both"), group="privacy")
    accountant: str = _opt("pld", "accountant whose epsilon is reported and budgeted", choices=_accountant_names,
                           group="privacy")
    budget: Any = _opt(AUTO, "per-party epsilon budget; a release that would exceed it is refused "
                             "and the run stops; auto = no budget",
                       kind="float_or_auto", allowed="'auto' or a number > 0", group="privacy")
    amplification: bool = _opt(False, "account with subsampling amplification (off: the host knows "
                                      "batch IDs, so amplification is doubtful)", group="privacy")
    max_test_requests: int = _opt(1, "how many times a guest releases one test batch; a request for it beyond "
                                     "that is refused with nothing spent (each repeat is another noisy copy of "
                                     "the same records: five cut the effective noise from 50 to 22)",
                                  check=_positive_int, allowed="an integer >= 1", group="privacy")
    one_shot: bool = _opt(False, "002 workflow: frozen pretrained guest bottoms release each record once",
                          group="privacy")
    public_fraction: float = _opt(0.2, "one-shot: fraction of the training IDs treated as public data, "
                                       "used only to pretrain the guest bottoms", check=_open_unit,
                                  allowed="a number strictly between 0 and 1", group="privacy")
    pretrain_epochs: int = _opt(5, "one-shot: epochs of (non-private) pretraining on the public records",
                                check=_positive_int, allowed="an integer >= 1", group="privacy")
    max_grad_norm: float = _opt(1.0, "DP-SGD per-sample gradient clipping norm (Opacus max_grad_norm)",
                                check=_positive_float, allowed="a number > 0", group="privacy")
    dp_sgd: str = _opt("none", "which parties also train their own models with DP-SGD (Opacus; noise multiplier "
                               "--dp-sgd-sigma), on top of --defense on their releases; accounted in the same "
                               "ledger. --defense dpsgd is DP-SGD alone on the --protect parties",
                       choices=("none", "guest", "host", "both"), group="privacy")
    dp_sgd_sigma: Any = _opt(AUTO, "noise multiplier of --dp-sgd; auto = --sigma", kind="float_or_auto",
                             allowed="'auto' or a number > 0", group="privacy")
    secure_merge: bool = _opt(False, "with --merge sum|avg: each guest sends its cut-layer output masked by pairwise "
                                     "masks (fixed point on a ring, keys agreed under the parties' identities) and the "
                                     "host unmasks only the guests' sum; with --defense gaussian each guest adds a "
                                     "Skellam share of the noise --sigma and is accounted against the honest shares' sum "
                                     "(docs/threat-model.md, \"Secure merge\"; docs/accounting.md, \"Distributed noise\")",
                              group="privacy")
    secure_merge_collusion: str = _opt("all", "with --secure-merge: how many guests k the host may collude with; each "
                                              "guest's noise share is sigma^2/(G - k) and its epsilon holds against any "
                                              "host + k guests; all = G - 1 (every other guest: each guest adds the whole "
                                              "noise, the safe default)",
                                       check=lambda v: v == "all" or (isinstance(v, str) and v.isdigit()),
                                       allowed="'all' or an integer k >= 0", group="privacy")
    report_metrics: str = _opt("epoch", "what the host tells the coordinator: epoch = per-epoch aggregates (train "
                                        "loss, test metric and loss; declared as not covered by DP); none = nothing, "
                                        "the host writes them to --host-metrics", choices=("epoch", "none"),
                               group="privacy")
    host_metrics: str = _opt("", "the host's own metrics file (JSON), written by the host as each epoch ends; "
                                 "needed with --report-metrics none", group="privacy")

    # ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if is_model_factory(self.model) and importable_name(self.model):
            # a module-level function is its 'package.module:function': one name in every engine and file
            object.__setattr__(self, "model", importable_name(self.model))
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name))
        if self.data:  # one table per party: the guests are read from --data
            from fl_split.data.own import infer_parties

            infer_parties(self)
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Rules between options that need no data (the dataset-dependent ones are in the builder)."""
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume", True, "--resume together with --checkpoint-dir DIR",
                              reason="there is no checkpoint directory to resume from")
        if self.checkpoint_dir and self.monolithic:
            raise ConfigError("checkpoint-dir", self.checkpoint_dir, "empty with --monolithic",
                              reason="checkpoints are of split runs (parties and their ledgers)")
        if self.checkpoint_dir and self.engine == "flower" and self.data_plane != "direct":
            raise ConfigError("checkpoint-dir", self.checkpoint_dir, "empty with --data-plane flower",
                              reason="under Flower, checkpoints are taken at the end of the direct data plane's "
                                     "control messages (use --data-plane direct, or the local engine)")
        if self.checkpoint_dir and self.engine == "flower" and self.checkpoint_every != "epoch":
            raise ConfigError("checkpoint-every", self.checkpoint_every, "epoch with --engine flower",
                              reason="a Flower node checkpoints at each epoch end (inside its control message, "
                                     "which may cover --epochs-per-message epochs)")
        if self.party_files and (self.engine == "flower" or self.monolithic or self.one_shot):
            what = "--engine flower" if self.engine == "flower" else "--monolithic" if self.monolithic else "--one-shot"
            raise ConfigError("party-files", self.party_files, f"empty with {what}",
                              reason="party files are read by the local engine's parties (a Flower deployment node "
                                     "reads its own through node-config data-path)")
        if self.data:
            from fl_split.data.own import check_data_option

            check_data_option(self)
        if self.encode:
            if not self.data:
                raise ConfigError("encode", self.encode, "empty without --data",
                                  reason="--encode overrides how each party encodes the raw columns of its own table "
                                         "(--data); the built-in datasets have their own encoding")
            from fl_split.data.encoding import parse_encode

            for col in parse_encode(self.encode):  # the syntax and the kinds; the owners: where tables are read
                if col in (self.id_column, self.label_column):
                    raise ConfigError("encode", self.encode, "entries naming feature columns",
                                      reason=f"{col!r} is the {'ID' if col == self.id_column else 'label'} column, "
                                             f"not a feature")
        if self.defense_options and not is_user_model(self.defense):
            raise ConfigError("defense-options", self.defense_options, "empty with a built-in --defense",
                              reason="--defense-options are a plug-in class's own parameters (docs/plugins.md)")
        if self.budget != AUTO and self.defense == "none" and self.dp_sgd == "none":
            raise ConfigError("budget", self.budget, "auto without a defense, or --budget with --defense "
                              + "|".join(d for d in DEFENSES if d != "none") + " or --dp-sgd",
                              reason="with --defense none and no --dp-sgd nothing is charged to any party, so the "
                                     "budget would never bind")
        for key, value in (("save-model", self.save_model), ("init-from", self.init_from)):
            if value and self.monolithic:
                raise ConfigError(key, value, "empty with --monolithic", reason="a monolithic run has no parties to save")
        if is_model_factory(self.model) and self.engine == "flower":
            raise ConfigError("model", factory_label(self.model), "with --engine flower a function the ClientApp "
                              "processes can import: defined at the top level of a module on their import path "
                              "(or 'package.module:function')",
                              reason="a lambda, a local function or one defined in __main__ (a notebook, a script) "
                                     "exists only in this process")
        if self.secure_merge:
            self._check_secure_merge()
        if self.on_guest_failure == "pad" and self.merge == "mul":
            raise ConfigError("on-guest-failure", "pad", "stop with --merge mul",
                              reason="a zero-filled embedding makes a product merge zero for every sample")

    def _check_secure_merge(self) -> None:
        """What ``--secure-merge`` works with (docs/threat-model.md, "Secure merge")."""
        if self.merge not in ("sum", "avg"):
            raise ConfigError("merge", self.merge, "sum or avg with --secure-merge",
                              reason="the host unmasks only the guests' sum; concat, max, min and mul need each "
                                     "guest's own part")
        if self.guests < 2:
            raise ConfigError("guests", self.guests, "at least 2 with --secure-merge",
                              reason="the sum of one guest is that guest's release")
        if self.defense not in ("none", "gaussian"):
            raise ConfigError("defense", self.defense, "gaussian or none with --secure-merge",
                              reason="the distributed noise is the Gaussian defence's --sigma carried by Skellam "
                                     "shares; another mechanism would noise each guest's part on its own")
        if self.defense == "gaussian" and self.accountant not in ("pld", "basic"):
            raise ConfigError("accountant", self.accountant, "pld or basic with --secure-merge --defense gaussian",
                              reason="the Skellam shares are accounted from their exact distribution (PLD)")
        for flag, on, why in (("one-shot", self.one_shot, "one-shot caches each guest's own release"),
                              ("loss-alarm", self.loss_alarm, "the alarm zero-fills one guest at a time, and the "
                                                              "host holds only the sum"),
                              ("monolithic", self.monolithic, "a monolithic run has no guests")):
            if on:
                raise ConfigError(flag, True, "off with --secure-merge", reason=why)
        if self.secure_merge_collusion != "all" and int(self.secure_merge_collusion) >= self.guests:
            raise ConfigError("secure-merge-collusion", self.secure_merge_collusion,
                              f"'all' or an integer k with 0 <= k <= {self.guests - 1}",
                              reason=f"the host can collude with at most the G - 1 = {self.guests - 1} other guests")

    # convenience views ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain ``{snake_case: value}``, as saved in results JSON (a model factory by its label)."""
        d = dataclasses.asdict(self)
        if is_model_factory(self.model):
            d["model"] = factory_label(self.model)
        return d

    def to_flower(self) -> dict[str, Any]:
        """``{kebab-key: value}`` for a Flower run-config (booleans stay booleans)."""
        return {key_of(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    @property
    def parties(self) -> list[str]:
        """Party names in merge order: ``host`` first, then ``guest-1`` … ``guest-G``."""
        return ["host", *guest_names(self.guests)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "RunConfig":
        """Build from ``{key: value}`` with kebab- or snake-case keys and string or typed values.

        Used for Flower run-configs and JSON. Unknown keys are an error (a typo must not be
        silently ignored).
        """
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, raw in values.items():
            name = str(raw_key).replace("-", "_")
            if name not in names:
                raise ConfigError(str(raw_key).replace("_", "-"), raw, "one of the known options: "
                                  + ", ".join(key_of(n) for n in names), reason="unknown option")
            kwargs[name] = coerce(names[name], raw)
        return cls(**kwargs)


def guest_names(n: int) -> list[str]:
    return [f"guest-{i}" for i in range(1, n + 1)]


def key_of(name: str) -> str:
    """``batch_size`` → ``batch-size`` (CLI flag without dashes, Flower run-config key)."""
    return name.replace("_", "-")


def option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(RunConfig)


def allowed_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta["allowed"]:
        return meta["allowed"]
    choices = meta["choices"]
    if choices is not None:
        values = choices() if callable(choices) else choices
        return "one of " + ", ".join(map(str, values))
    if f.type in ("bool", bool):
        return "true or false"
    return "a string"


#: the words an ``*_or_*`` option takes besides its number
WORDS = {"int_or_auto": (AUTO,), "float_or_auto": (AUTO,), "int_or_epoch": ("epoch",),
         "int_or_auto_half": (AUTO, "half")}


def coerce(f: dataclasses.Field, raw: Any) -> Any:
    """Turn a CLI string or a Flower run-config value into the field's type (no range checks)."""
    key = key_of(f.name)
    kind = f.metadata["kind"]
    default = f.default
    if f.name == "model" and is_model_factory(raw):  # a function (the Python API): kept as it is
        return raw
    if kind in WORDS:
        if isinstance(raw, str) and raw.strip().lower() in WORDS[kind]:
            return raw.strip().lower()
        try:
            if kind == "float_or_auto":
                return float(raw)
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(key, raw, allowed_text(f)) from None
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(key, raw, "true or false")
    if isinstance(default, int):
        if isinstance(raw, bool):
            raise ConfigError(key, raw, allowed_text(f))
        try:
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError
                return int(raw)
            return int(str(raw).strip())
        except ValueError:
            raise ConfigError(key, raw, allowed_text(f)) from None
    if isinstance(default, float):
        if isinstance(raw, bool):
            raise ConfigError(key, raw, allowed_text(f))
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(key, raw, allowed_text(f)) from None
    return str(raw)


def _validate(f: dataclasses.Field, value: Any) -> None:
    key = key_of(f.name)
    meta = f.metadata
    kind = meta["kind"]
    if kind in ("int_or_auto", "int_or_epoch", "int_or_auto_half"):
        if value in WORDS[kind] or _positive_int(value):
            return
        raise ConfigError(key, value, allowed_text(f))
    if kind == "float_or_auto":
        if value == AUTO or _positive_float(value):
            return
        raise ConfigError(key, value, allowed_text(f))
    if isinstance(f.default, bool) and not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")
    choices = meta["choices"]
    if choices is not None:
        values = choices() if callable(choices) else choices
        if value not in values:
            raise ConfigError(key, value, allowed_text(f))
    check = meta["check"]
    if check is not None and not check(value):
        raise ConfigError(key, value, allowed_text(f))
