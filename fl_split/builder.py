"""From a :class:`~fl_split.config.RunConfig` to parties ready to train.

Three layers, so that a Flower node can build only its own party:

* :func:`prepare_data` — load the dataset, split the shared IDs, partition the columns, let
  each party align and encode its own slice (cached per process: Flower simulation calls it
  once per node process, not once per message);
* :func:`plan_run` — the public facts every party agrees on: architecture, cut, batch
  schedule, each party's input and cut-layer shapes (widths are public metadata in VFL), and each
  role's privacy facts (:class:`RolePlan`: protected, ledger, DP-SGD, importance allocation),
  resolved from the configuration once;
* :func:`make_guest` / :func:`make_host` — one party with its own secret, modules (initialised
  from the secret), local-update policy, mechanisms and ledger. This is the one place that reads
  the run configuration for a party: parties get what they need explicitly.
  :func:`make_monolithic` builds the no-split reference from the same modules.

Secrets: each party's :class:`~fl_split.seeding.PartySecret` is fresh OS entropy unless a
``private_seed`` is given (reproducible research runs: split ≡ monolithic, local ≡ Flower). The
private seed is not part of :class:`~fl_split.config.RunConfig` — the configuration is public (it is
sent to every party and written to the results) — and is passed next to it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fl_split.config import AUTO, RunConfig
from fl_split.data.base import PartyData, apply_padding, feature_parties, partition, prepare_party, split_ids
from fl_split.data.registry import dataset_info, load_dataset
from fl_split.errors import ConfigError
from fl_split.devices import apply_deterministic
from fl_split.merge import Merge, merged_shape
from fl_split.local_update import DpSgdUpdate, FrozenUpdate, LocalUpdate, OptimizerSettings, OptimizerUpdate
from fl_split.models.registry import build_bottom, build_top, get_architecture, output_shape
from fl_split.models.user import UserArchitecture, is_model_factory, is_user_model
from fl_split.parties import GuestParty, HostParty, Importance, MechanismSchedule, resolve_device
from fl_split.privacy import factory as privacy_factory
from fl_split.privacy.validate import check_opacus_compatible, check_record_independent
from fl_split.schedule import BatchSchedule
from fl_split.seeding import PartySecret, numpy_rng
from fl_split.tasks import HEADLINE, Objective, balanced_weights, kind_of
from fl_split.tasks import resolve as resolve_task


@dataclass
class PreparedData:
    dataset: str
    task: str
    metric: str
    num_classes: int
    parties: dict[str, PartyData]
    train_ids: np.ndarray
    test_ids: np.ndarray
    #: one-shot mode: each party's *public* records (pretraining only), as PartyData whose
    #: train split is the public records
    public: dict[str, PartyData] = dataclasses.field(default_factory=dict)
    #: own data (``--data``): how the shared ID list was agreed (public / psi, its size, PSI traffic)
    alignment: dict = dataclasses.field(default_factory=dict)


def _data_key(cfg: RunConfig) -> tuple:
    return (cfg.dataset, cfg.data_root, cfg.guests, cfg.host_features, cfg.columns, cfg.padding,
            cfg.test_fraction, cfg.limit, cfg.seed, cfg.public_fraction if cfg.one_shot else 0.0,
            (cfg.data, cfg.id_column, cfg.label_column, cfg.align, cfg.data_name, cfg.encode,
             _encode_items(cfg.encode), cfg.psi_max_peer_ids) if cfg.data else (), cfg.task)


def _encode_items(spec: str) -> tuple:
    """``--encode`` parsed (an ``@FILE``'s entries as they are now: a changed file is another key)."""
    from fl_split.data.encoding import parse_encode

    return tuple(sorted(parse_encode(spec).items())) if spec else ()


@functools.lru_cache(maxsize=4)
def _prepare(key: tuple) -> PreparedData:
    dataset, root, guests, host_features, columns, padding, test_fraction, limit, seed, public_fraction, own, task_ = key
    alignment: dict = {}
    if own:  # --data: the user's tables (fl_split.data.own), aligned by ID as --align says
        from fl_split.data.own import load_own

        data, id_column, label_column, align, data_name, encode, _, max_peer_ids = own
        loaded = load_own(RunConfig(data=data, id_column=id_column, label_column=label_column, align=align,
                                    psi_max_peer_ids=max_peer_ids,
                                    data_name=data_name, encode=encode, guests=guests, host_features=host_features,
                                    columns=columns, test_fraction=test_fraction, limit=limit, seed=seed, task=task_))
        dataset, task, metric, num_classes = loaded["name"], loaded["task"], loaded["metric"], loaded["num_classes"]
        parties, train_ids, test_ids = loaded["parties"], loaded["train_ids"], loaded["test_ids"]
        alignment = loaded["alignment"]
    else:
        ds = load_dataset(dataset, root)
        dataset, task, metric, num_classes = ds.name, ds.task, ds.metric, ds.num_classes
        train_ids, test_ids = split_ids(ds, test_fraction, seed, limit)
        slices = partition(ds, guests, host_features, columns, seed=seed)
        parties = {name: prepare_party(sl, train_ids, test_ids) for name, sl in slices.items()}
    # the run's task (fl_split/tasks.py): public, like the number of classes; its headline metric follows
    task = resolve_task(task_, task, num_classes, dataset)
    metric = HEADLINE[task]
    parties = {p: dataclasses.replace(d, task=task, metric=metric) for p, d in parties.items()}
    if padding:
        parties = apply_padding(parties)
    public: dict[str, PartyData] = {}
    if public_fraction:
        # one-shot: a seeded subset of the training IDs plays the public pretraining data
        n_pub = int(round(len(train_ids) * public_fraction))
        if n_pub < 1 or n_pub >= len(train_ids):
            raise ConfigError("public-fraction", public_fraction, "a fraction leaving at least one public and "
                              "one private training record", reason=f"{len(train_ids)} training records")
        is_pub = np.zeros(len(train_ids), dtype=bool)
        is_pub[numpy_rng(seed, "public", dataset).permutation(len(train_ids))[:n_pub]] = True
        public = {p: _train_subset(d, is_pub) for p, d in parties.items()}
        parties = {p: _train_subset(d, ~is_pub) for p, d in parties.items()}
        train_ids = train_ids[~is_pub]
    return PreparedData(dataset=dataset, task=task, metric=metric, num_classes=num_classes,
                        parties=parties, train_ids=train_ids, test_ids=test_ids, public=public, alignment=alignment)


def _train_subset(d: PartyData, keep: np.ndarray) -> PartyData:
    """``d`` with only the training rows where ``keep`` (encoding statistics unchanged)."""
    rows = torch.from_numpy(np.flatnonzero(keep))
    return dataclasses.replace(
        d, train_ids=d.train_ids[keep],
        x_train=d.x_train.index_select(0, rows) if d.x_train is not None else None,
        y_train=d.y_train.index_select(0, rows) if d.y_train is not None else None)


def prepare_data(cfg: RunConfig) -> PreparedData:
    """Every party's aligned, encoded data for ``cfg`` (simulation: all parties in one process)."""
    return _prepare(_data_key(cfg))


@dataclass(frozen=True)
class RolePlan:
    """How the run treats the parties of one role (``guest`` / ``host``), resolved once from the
    configuration by :func:`plan_run` (public: it follows from the public configuration). The party
    factories read these facts instead of asking :mod:`fl_split.privacy.factory` again."""

    role: str
    #: a boundary defence covers this role's releases (a guest's forward, the host's backward)
    protected: bool
    #: it claims differential privacy for something it releases: it keeps a ledger
    claims_dp: bool
    #: what it claims, in words (the module-validation error names it)
    claims: str
    #: it trains its own model with DP-SGD
    dpsgd: bool
    #: R3eLU's importance allocation shapes its releases (001 Eq. 8–10)
    importance: bool


def _role_plan(cfg: RunConfig, role: str) -> RolePlan:
    protected = privacy_factory.protects_guests(cfg) if role == "guest" else privacy_factory.protects_host(cfg)
    dpsgd = privacy_factory.uses_dpsgd(cfg, role)
    words = []
    if protected and privacy_factory.is_boundary(cfg):
        words.append(f"--defense {cfg.defense} protects its {'forward' if role == 'guest' else 'backward'} releases")
    if dpsgd:
        words.append("it trains with DP-SGD")
    return RolePlan(role=role, protected=protected, claims_dp=privacy_factory.claims_dp(cfg, role),
                    claims=" and ".join(words), dpsgd=dpsgd,
                    importance=cfg.defense == "r3elu" and cfg.allocation != "uniform" and protected)


@dataclass
class RunPlan:
    """What every party of a run agrees on before training (all public)."""

    cfg: RunConfig
    arch: str
    cut: int
    schedule: BatchSchedule
    input_shapes: dict[str, tuple[int, ...]]
    cut_shapes: dict[str, tuple[int, ...]]
    merged_shape: tuple[int, ...]
    num_outputs: int
    metric: str
    guest_cut_activation: str
    #: binary, multiclass, regression or next-item (fl_split/tasks.py; public, like the number of outputs)
    task: str = "multiclass"
    #: each role's privacy facts, resolved once (:class:`RolePlan`)
    roles: dict[str, RolePlan] = dataclasses.field(default_factory=dict)

    def role(self, party: str) -> RolePlan:
        """The :class:`RolePlan` of ``party`` (``host`` or ``guest-N``)."""
        return self.roles["host" if party == "host" else "guest"]

    def releases(self, direction: str, width: int) -> MechanismSchedule:
        """The mechanism schedule of one crossing: a guest's ``forward`` releases of ``width``
        elements per record, or the host's ``backward`` releases to a guest of that width."""
        make = privacy_factory.forward_mechanism if direction == "forward" else privacy_factory.backward_mechanism
        return MechanismSchedule(lambda i: make(self.cfg, width, i), self.schedule.num_train_batches(),
                                 constant=self.cfg.schedule == "constant")

    @property
    def guests(self) -> list[str]:
        return [f"guest-{i}" for i in range(1, self.cfg.guests + 1)]

    @property
    def sample_rate(self) -> float:
        """``B/N``: the share of the training records in one batch (used by the accountants)."""
        return min(1.0, self.cfg.batch_size / max(self.schedule.n_train, 1))


def model_name(cfg: RunConfig) -> str:
    if cfg.model != AUTO:
        return cfg.model
    return "mlp" if cfg.data else dataset_info(cfg.dataset).default_model  # own data: tables, the generic MLP


def _architecture(cfg: RunConfig, num_outputs: int | None = None, metric: str | None = None):
    """The configured architecture (``--hidden`` for the generic mlp, ``--norm`` for any model
    that has normalisation layers), or the user's ``--model package.module:function``
    (:mod:`fl_split.models.user`; ``num_outputs`` and ``metric`` are passed on in its spec)."""
    hidden = None if cfg.hidden == AUTO else tuple(int(h) for h in cfg.hidden.split(","))
    if is_user_model(cfg.model) or is_model_factory(cfg.model):
        arch = UserArchitecture(cfg.model, None if cfg.cut_layer == AUTO else int(cfg.cut_layer), num_outputs, metric)
        return arch.configure(hidden=hidden, norm=cfg.norm)
    return get_architecture(model_name(cfg)).configure(hidden=hidden, norm=cfg.norm)


def _plan_architecture(plan: "RunPlan"):
    """:func:`_architecture` with the plan's public task facts (a user model's spec needs them)."""
    return _architecture(plan.cfg, plan.num_outputs, plan.metric)


def guest_cut_activation(cfg: RunConfig) -> str:
    """The activation that ends a guest's bottom, as the defence requires (see privacy.factory)."""
    return privacy_factory.guest_cut_activation(cfg)


def plan_run(cfg: RunConfig, prepared: PreparedData | None = None) -> RunPlan:
    privacy_factory.check(cfg)
    prepared = prepared or prepare_data(cfg)
    arch = _architecture(cfg, prepared.num_classes, prepared.metric)
    cut = arch.default_cut if cfg.cut_layer == AUTO else int(cfg.cut_layer)
    arch.check_cut(cut, cfg.merge)
    holders = feature_parties(cfg.guests, cfg.host_features)
    input_shapes = {p: prepared.parties[p].input_shape for p in holders}
    if arch.inputs == "image" and any(len(s) != 3 for s in input_shapes.values()):
        raise ConfigError("model", arch.name, "a vector model (e.g. mlp) for a table dataset",
                          reason=f"'{arch.name}' needs image inputs and '{cfg.dataset}' is a table")
    act = guest_cut_activation(cfg)
    # shapes only: throwaway modules, no party's secret involved
    cut_shapes = {p: output_shape(build_bottom(arch, p, s, cut, act, None), s) for p, s in input_shapes.items()}
    schedule = BatchSchedule(len(prepared.train_ids), len(prepared.test_ids), cfg.batch_size, cfg.seed)
    return RunPlan(cfg=cfg, arch=arch.name, cut=cut, schedule=schedule, input_shapes=input_shapes,
                   cut_shapes=cut_shapes, merged_shape=merged_shape(cfg.merge, cut_shapes),
                   num_outputs=prepared.num_classes, metric=prepared.metric, guest_cut_activation=act,
                   task=kind_of(getattr(prepared, "task", "classification"), prepared.num_classes),
                   roles={r: _role_plan(cfg, r) for r in ("guest", "host")})


def objective(cfg: RunConfig, plan: RunPlan, host_data: PartyData) -> Objective:
    """The host's loss for the plan's task; ``--class-weight balanced`` weighs classes by the host's own
    training labels (the weights never leave the host)."""
    weights = None
    if cfg.class_weight == "balanced":
        if plan.task not in ("binary", "multiclass"):
            raise ConfigError("class-weight", cfg.class_weight, "none for a " + plan.task + " task",
                              reason="class weights weigh classes")
        weights = balanced_weights(host_data.y_train, plan.num_outputs)
    return Objective(plan.task, weights)


def make_ledger(cfg: RunConfig, party: str, role: RolePlan | None = None):
    """The party's ledger, or ``None`` when the party claims no differential privacy (``role``: its
    resolved :class:`RolePlan`; else resolved here)."""
    role = role or _role_plan(cfg, "host" if party == "host" else "guest")
    if not role.claims_dp:
        return None
    from fl_split.privacy.ledger import Ledger

    return Ledger(party, accountant=cfg.accountant, delta=cfg.delta,
                  budget=None if cfg.budget == AUTO else float(cfg.budget), amplification=cfg.amplification)


def optimizer_settings(cfg: RunConfig) -> OptimizerSettings:
    return OptimizerSettings(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)


def _update_policy(plan: RunPlan, party: str, modules: list[nn.Module], frozen: bool = False) -> LocalUpdate:
    """The party's local-update policy over its ``modules``, after refusing modules that would
    make its per-record guarantee wrong (``fl_split.privacy.validate``)."""
    cfg, role = plan.cfg, plan.role(party)
    if role.claims_dp:
        check_record_independent(party, {f"model {i + 1}" if len(modules) > 1 else "model": m
                                         for i, m in enumerate(modules)}, role.claims)
    if frozen:
        return FrozenUpdate(modules)
    if role.dpsgd:
        for m in modules:
            check_opacus_compatible(party, m)
        return DpSgdUpdate(modules, optimizer_settings(cfg), privacy_factory.dpsgd_sigma(cfg), cfg.max_grad_norm,
                           expected_batch_size=cfg.batch_size)
    return OptimizerUpdate(modules, optimizer_settings(cfg))


def allocation_epsilon(cfg: RunConfig) -> float:
    """ε of each release of an R3eLU importance allocation (``--allocation-epsilon``; auto = a tenth
    of ``--epsilon``)."""
    return float(cfg.epsilon) / 10.0 if cfg.allocation_epsilon == AUTO else float(cfg.allocation_epsilon)


def _layer(module: nn.Module, last: bool) -> nn.Module:
    """The first (``last=False``) or last Linear/Conv layer of ``module``."""
    found = [m for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    if not found:
        raise ConfigError("allocation", "importance", "uniform for this model",
                          reason="importance allocation scores the neurons of a Linear or Conv layer, and the "
                                 "model has none")
    return found[-1] if last else found[0]


def party_secret(party: str, private_seed: int | None) -> PartySecret:
    """A party's secret: fresh OS entropy, or derived from ``private_seed`` (research runs)."""
    return PartySecret.for_party(party, private_seed)


def make_guest(plan: RunPlan, data: PartyData, name: str, device: str | None = None, *,
               private_seed: int | None = None, secret: PartySecret | None = None) -> GuestParty:
    cfg = plan.cfg
    apply_deterministic(cfg.deterministic)  # before the party's first CUDA op (fl_split.devices)
    secret = secret or party_secret(name, private_seed)
    arch = _plan_architecture(plan)
    bottom = build_bottom(arch, name, plan.input_shapes[name], plan.cut, plan.guest_cut_activation, secret)
    if cfg.one_shot:
        bottom.load_state_dict(pretrained_bottom(cfg, name, secret))
    if cfg.init_from:  # continue from this guest's own saved part (fl_split/serving.py)
        from fl_split.serving import init_state

        bottom.load_state_dict(init_state(cfg.init_from, name, plan)["bottom"])
    dev = resolve_device(device or cfg.device)
    update = _update_policy(plan, name, [bottom.to(dev)], frozen=cfg.one_shot)
    width = int(np.prod(plan.cut_shapes[name]))
    importance = None
    if plan.role(name).importance:
        from fl_split.privacy.r3elu import AllocationRelease, ImportanceTracker

        tracker = ImportanceTracker(_layer(update.modules[0], last=True), side="output")
        importance = Importance(tracker, AllocationRelease(tracker.n, allocation_epsilon(cfg)), cfg.importance_refresh)
    guest = GuestParty(name, data, plan.schedule, update=update, cut_shape=plan.cut_shapes[name],
                       mechanisms=plan.releases("forward", width),
                       secret=secret, ledger=make_ledger(cfg, name, plan.role(name)), sample_rate=plan.sample_rate,
                       grad_postprocess=privacy_factory.postprocess(cfg, "backward"), importance=importance,
                       device=dev, max_test_requests=int(cfg.max_test_requests),
                       host_mechanisms=plan.releases("backward", width))
    guest.check_budget_covers_an_epoch()
    return guest


def _host_importance(plan: RunPlan, top: nn.Module):
    """001 Eq. 8–10 for the host's backward releases: the importance of each cut-layer feature the
    host receives, from the parameters of its top's first layer connected to it (the host owns
    those, not the guest's cut layer), and per guest the part that scores its features."""
    from fl_split.privacy.r3elu import AllocationRelease, ImportanceTracker

    cfg = plan.cfg
    layer = _layer(top, last=False)
    tracker = ImportanceTracker(layer, side="input")
    n = tracker.n
    widths = {g: int(np.prod(plan.cut_shapes[g])) for g in plan.guests}
    parts: dict = {}
    if isinstance(layer, nn.Linear) and n == int(np.prod(plan.merged_shape)):
        if cfg.merge == "concat":
            if len(plan.merged_shape) != 1:
                raise ConfigError("allocation", cfg.allocation, "uniform with --protect host for this model",
                                  reason="the backward importance of image feature maps concatenated along the "
                                         "width axis is not supported")
            offset = sum(int(np.prod(s)) for p, s in plan.cut_shapes.items() if p == "host")
            for g in plan.guests:
                parts[g] = (lambda u, a=offset, b=offset + widths[g]: u[a:b])
                offset += widths[g]
        # element-wise merges: every guest's feature i feeds the same input i
    elif not (isinstance(layer, (nn.Conv1d, nn.Conv2d)) and all(w % n == 0 for w in widths.values())):
        raise ConfigError("allocation", cfg.allocation, "uniform with --protect host for this model",
                          reason=f"the top's first layer has {n} inputs, which do not map onto the guests' "
                                 f"cut-layer features")
    return Importance(tracker, AllocationRelease(n, allocation_epsilon(cfg)), cfg.importance_refresh), parts


def make_host(plan: RunPlan, data: PartyData, device: str | None = None, *, private_seed: int | None = None,
              secret: PartySecret | None = None) -> HostParty:
    cfg = plan.cfg
    apply_deterministic(cfg.deterministic)  # before the party's first CUDA op (fl_split.devices)
    secret = secret or party_secret("host", private_seed)
    arch = _plan_architecture(plan)
    bottom = None
    if cfg.host_features:
        bottom = build_bottom(arch, "host", plan.input_shapes["host"], plan.cut, "native", secret)
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, secret)
    if cfg.init_from:  # continue from the host's own saved part (fl_split/serving.py)
        from fl_split.serving import init_state

        saved = init_state(cfg.init_from, "host", plan)
        top.load_state_dict(saved["top"])
        if bottom is not None:
            bottom.load_state_dict(saved["bottom"])
    dev = resolve_device(device or cfg.device)
    modules = [m.to(dev) for m in (bottom, top) if m is not None]
    update = _update_policy(plan, "host", modules)
    guest_shapes = {g: plan.cut_shapes[g] for g in plan.guests}
    widths = {g: int(np.prod(s)) for g, s in guest_shapes.items()}
    mechanisms = {g: plan.releases("backward", w) for g, w in widths.items()}
    importance, parts = (_host_importance(plan, update.modules[-1]) if plan.role("host").importance else (None, {}))
    host = HostParty(data, plan.schedule, update=update, has_bottom=bottom is not None, merge=Merge(cfg.merge),
                     guest_shapes=guest_shapes, backward_mechanisms=mechanisms, secret=secret,
                     ledger=make_ledger(cfg, "host", plan.role("host")), sample_rate=plan.sample_rate,
                     act_postprocess=privacy_factory.postprocess(cfg, "forward"), one_shot=cfg.one_shot,
                     importance=importance, importance_parts=parts, report_metrics=cfg.report_metrics,
                     metrics_file=cfg.host_metrics, device=dev, objective=objective(cfg, plan, data),
                     loss_alarm=cfg.loss_alarm,
                     guest_mechanisms={g: plan.releases("forward", w) for g, w in widths.items()})
    host.check_budget_covers_an_epoch()
    return host


@functools.lru_cache(maxsize=4)
def _pretrained(key: tuple, cfg: RunConfig, party: str, secret: PartySecret) -> dict:
    """The pretraining itself: the monolithic reference's training loop (:func:`train_monolithic_epoch`,
    the one :class:`~fl_split.engine.MonolithicEngine` runs), without its per-epoch evaluation (which
    changes no weight). It lives here, not in the engine, so that the builder never imports the
    engine that imports it (one-way layers, docs/design.md)."""
    from fl_split.devices import with_device

    pre = with_device(cfg.replace(one_shot=False, epochs=cfg.pretrain_epochs, progress=False,
                                  report_metrics="epoch", host_metrics=""))
    model, data, plan = make_monolithic(pre, public=True, secret=secret)
    device = resolve_device(pre.device)
    model.to(device)
    optimizer = optimizer_settings(pre).make(model.parameters())
    for epoch in range(1, pre.epochs + 1):
        train_monolithic_epoch(model, optimizer, data, plan, epoch, device)
    return {k: v.detach().clone() for k, v in model.bottoms[party].state_dict().items()}


def pretrained_bottom(cfg: RunConfig, party: str, secret: PartySecret) -> dict:
    """One-shot mode (002 §3): guest ``party``'s bottom pretrained on *public* records.

    002 loads the first layers of a model pretrained on a public same-domain dataset and freezes
    them. Here the public data are ``--public-fraction`` of the training IDs (every party's columns
    of them are public), removed from the private training set (:func:`prepare_data`). The guest
    trains a whole model on them (no privacy is needed for public records) for
    ``--pretrain-epochs`` and keeps its bottom. The initialisation and the shuffling of that
    pretraining come from the guest's own secret, so nobody else can recompute its frozen weights.
    """
    key = _data_key(cfg) + (cfg.pretrain_epochs, cfg.model, cfg.cut_layer, cfg.hidden, cfg.norm, cfg.lr,
                            cfg.optimizer, cfg.defense, cfg.protect, cfg.merge)
    return _pretrained(key, cfg, party, secret)


def make_parties(cfg: RunConfig, private_seed: int | None = None) -> tuple[HostParty, dict[str, GuestParty], RunPlan]:
    """All parties of a run in this process (the local engine's view), each with its own secret."""
    prepared = prepare_data(cfg)
    plan = plan_run(cfg, prepared)
    host = make_host(plan, prepared.parties["host"], private_seed=private_seed)
    guests = {g: make_guest(plan, prepared.parties[g], g, private_seed=private_seed) for g in plan.guests}
    return host, guests, plan


class MonolithicModel(nn.Module):
    """The split model's modules as one network: ``top(merge(bottom_p(x_p) for p))``."""

    def __init__(self, bottoms: dict[str, nn.Module], merge: Merge, top: nn.Module) -> None:
        super().__init__()
        self.bottoms = nn.ModuleDict(bottoms)
        self.merge = merge
        self.top = top

    def forward(self, xs: dict):  # noqa: D102
        return self.top(self.merge([self.bottoms[p](xs[p]) for p in self.bottoms]))


def make_monolithic(cfg: RunConfig, public: bool = False, private_seed: int | None = None,
                    secret: PartySecret | None = None) -> tuple[MonolithicModel, PreparedData, RunPlan]:
    """The no-split reference: the modules of the split parties, in one model.

    Each module is initialised from its party's secret derived from ``private_seed`` — exactly the
    split parties' initial weights — or, with ``secret``, every module from that one secret (one
    party training a whole model alone: one-shot pretraining). Without either, fresh entropy.
    ``public=True`` trains on the one-shot public records instead."""
    apply_deterministic(cfg.deterministic)  # before the model's first CUDA op (fl_split.devices)
    prepared = prepare_data(cfg)
    if public:
        one_shot = prepare_data(cfg.replace(one_shot=True))
        prepared = dataclasses.replace(one_shot, parties=one_shot.public,
                                       train_ids=one_shot.public["host"].train_ids, public={})
    plan = plan_run(cfg, prepared)
    if secret is not None:
        plan = dataclasses.replace(plan, schedule=BatchSchedule(plan.schedule.n_train, plan.schedule.n_test,
                                                                cfg.batch_size, secret.derive("pretrain-order")))
    arch = _plan_architecture(plan)
    owner = (lambda p: secret) if secret is not None else (lambda p: party_secret(p, private_seed))
    bottoms = {p: build_bottom(arch, p, s, plan.cut, plan.guest_cut_activation, owner(p))
               for p, s in plan.input_shapes.items()}
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, owner("host"))
    return MonolithicModel(bottoms, Merge(cfg.merge), top), prepared, plan


def monolithic_batch(data: PreparedData, plan: RunPlan, key, device) -> tuple[dict, torch.Tensor]:
    """Every feature holder's inputs and the labels of batch ``key`` (a :class:`~fl_split.schedule.BatchKey`)."""
    pos = torch.from_numpy(plan.schedule.positions(key))
    split = "train" if key.phase == "train" else "test"
    xs = {p: getattr(data.parties[p], f"x_{split}").index_select(0, pos).to(device) for p in plan.input_shapes}
    y = getattr(data.parties["host"], f"y_{split}").index_select(0, pos).to(device)
    return xs, y


def train_monolithic_epoch(model: MonolithicModel, optimizer, data: PreparedData, plan: RunPlan, epoch: int,
                           device, on_batch=None) -> tuple[float, int]:
    """One training epoch of the no-split reference over the plan's batch order; returns the summed
    loss and the number of records (``on_batch()`` after each batch: a progress bar)."""
    model.train()
    loss_sum, n = 0.0, 0
    loss_of = objective(plan.cfg, plan, data.parties["host"])  # the split host's loss, the same object
    for key in plan.schedule.train_keys(epoch):
        xs, y = monolithic_batch(data, plan, key, device)
        loss = loss_of(model(xs), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(y)
        n += len(y)
        if on_batch is not None:
            on_batch()
    return loss_sum, n
