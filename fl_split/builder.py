"""From a :class:`~fl_split.config.RunConfig` to parties ready to train.

Three layers, so that a Flower node can build only its own party:

* :func:`prepare_data` — load the dataset, split the shared IDs, partition the columns, let
  each party align and encode its own slice (cached per process: Flower simulation calls it
  once per node process, not once per message);
* :func:`plan_run` — the public facts every party agrees on: architecture, cut, batch
  schedule, each party's input and cut-layer shapes (widths are public metadata in VFL);
* :func:`make_guest` / :func:`make_host` — one party with its own modules, optimizer and
  mechanisms. :func:`make_monolithic` builds the no-split reference from the same modules.
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
from fl_split.merge import Merge, merged_shape
from fl_split.models.registry import build_bottom, build_top, get_architecture, output_shape
from fl_split.parties import GuestParty, HostParty, resolve_device
from fl_split.privacy import factory as privacy_factory
from fl_split.schedule import BatchSchedule
from fl_split.seeding import numpy_rng


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


def _data_key(cfg: RunConfig) -> tuple:
    return (cfg.dataset, cfg.data_root, cfg.guests, cfg.host_features, cfg.columns, cfg.padding,
            cfg.test_fraction, cfg.limit, cfg.seed, cfg.public_fraction if cfg.one_shot else 0.0)


@functools.lru_cache(maxsize=4)
def _prepare(key: tuple) -> PreparedData:
    dataset, root, guests, host_features, columns, padding, test_fraction, limit, seed, public_fraction = key
    ds = load_dataset(dataset, root)
    train_ids, test_ids = split_ids(ds, test_fraction, seed, limit)
    slices = partition(ds, guests, host_features, columns, seed=seed)
    parties = {name: prepare_party(sl, train_ids, test_ids) for name, sl in slices.items()}
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
    return PreparedData(dataset=ds.name, task=ds.task, metric=ds.metric, num_classes=ds.num_classes,
                        parties=parties, train_ids=train_ids, test_ids=test_ids, public=public)


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


@dataclass
class RunPlan:
    """What every party of a run agrees on before training."""

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

    @property
    def guests(self) -> list[str]:
        return [f"guest-{i}" for i in range(1, self.cfg.guests + 1)]


def model_name(cfg: RunConfig) -> str:
    return dataset_info(cfg.dataset).default_model if cfg.model == AUTO else cfg.model


def _architecture(cfg: RunConfig):
    """The configured architecture (``--hidden`` / ``--batch-norm`` apply to ``mlp`` only)."""
    hidden = None if cfg.hidden == AUTO else tuple(int(h) for h in cfg.hidden.split(","))
    return get_architecture(model_name(cfg)).configure(hidden=hidden, batch_norm=True if cfg.batch_norm else None)


def guest_cut_activation(cfg: RunConfig) -> str:
    """The activation that ends a guest's bottom, as the defence requires (see privacy.factory)."""
    return privacy_factory.guest_cut_activation(cfg)


def plan_run(cfg: RunConfig, prepared: PreparedData | None = None) -> RunPlan:
    privacy_factory.check(cfg)
    prepared = prepared or prepare_data(cfg)
    arch = _architecture(cfg)
    cut = arch.default_cut if cfg.cut_layer == AUTO else int(cfg.cut_layer)
    arch.check_cut(cut, cfg.merge)
    holders = feature_parties(cfg.guests, cfg.host_features)
    input_shapes = {p: prepared.parties[p].input_shape for p in holders}
    if arch.inputs == "image" and any(len(s) != 3 for s in input_shapes.values()):
        raise ConfigError("model", arch.name, "a vector model (e.g. mlp) for a table dataset",
                          reason=f"'{arch.name}' needs image inputs and '{cfg.dataset}' is a table")
    act = guest_cut_activation(cfg)
    cut_shapes = {p: output_shape(build_bottom(arch, p, s, cut, act, cfg.seed), s) for p, s in input_shapes.items()}
    schedule = BatchSchedule(len(prepared.train_ids), len(prepared.test_ids), cfg.batch_size, cfg.seed)
    return RunPlan(cfg=cfg, arch=arch.name, cut=cut, schedule=schedule, input_shapes=input_shapes,
                   cut_shapes=cut_shapes, merged_shape=merged_shape(cfg.merge, cut_shapes),
                   num_outputs=prepared.num_classes, metric=prepared.metric, guest_cut_activation=act)


def make_ledger(cfg: RunConfig, party: str):
    """The party's ledger, or ``None`` when nothing it releases is protected."""
    role = "host" if party == "host" else "guest"
    protected = privacy_factory.protects_host(cfg) if role == "host" else privacy_factory.protects_guests(cfg)
    if not protected:
        return None
    from fl_split.privacy.ledger import Ledger

    return Ledger(party, accountant=cfg.accountant, delta=cfg.delta,
                  budget=None if cfg.budget == AUTO else float(cfg.budget), amplification=cfg.amplification)


def make_guest(plan: RunPlan, data: PartyData, name: str, device: str | None = None) -> GuestParty:
    cfg = plan.cfg
    arch = _architecture(cfg)
    bottom = build_bottom(arch, name, plan.input_shapes[name], plan.cut, plan.guest_cut_activation, cfg.seed)
    if cfg.one_shot:
        bottom.load_state_dict(pretrained_bottoms(cfg)[name])
    width = int(np.prod(plan.cut_shapes[name]))
    return GuestParty(name, cfg, plan.schedule, data, bottom, plan.cut_shapes[name],
                      mechanism=lambda epoch: privacy_factory.forward_mechanism(cfg, width, epoch),
                      grad_postprocess=privacy_factory.postprocess(cfg, "backward"),
                      device=resolve_device(device or cfg.device), ledger=make_ledger(cfg, name),
                      dpsgd=privacy_factory.uses_dpsgd(cfg, "guest"), frozen=cfg.one_shot,
                      importance=cfg.allocation != "uniform" and privacy_factory.protects_guests(cfg),
                      constant_schedule=cfg.schedule == "constant")


def make_host(plan: RunPlan, data: PartyData, device: str | None = None) -> HostParty:
    cfg = plan.cfg
    arch = _architecture(cfg)
    bottom = None
    if cfg.host_features:
        bottom = build_bottom(arch, "host", plan.input_shapes["host"], plan.cut, "native", cfg.seed)
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, cfg.seed)
    guest_shapes = {g: plan.cut_shapes[g] for g in plan.guests}
    widths = {g: int(np.prod(s)) for g, s in guest_shapes.items()}
    mechanisms = {g: (lambda epoch, w=w: privacy_factory.backward_mechanism(cfg, w, epoch)) for g, w in widths.items()}
    return HostParty(cfg, plan.schedule, data, bottom, Merge(cfg.merge), top, guest_shapes,
                     backward_mechanisms=mechanisms, act_postprocess=privacy_factory.postprocess(cfg, "forward"),
                     device=resolve_device(device or cfg.device), ledger=make_ledger(cfg, "host"),
                     dpsgd=privacy_factory.uses_dpsgd(cfg, "host"), one_shot=cfg.one_shot,
                     constant_schedule=cfg.schedule == "constant")


@functools.lru_cache(maxsize=2)
def _pretrained(key: tuple, cfg: RunConfig) -> dict[str, dict]:
    from fl_split.engine import MonolithicEngine

    engine = MonolithicEngine(cfg.replace(one_shot=False, epochs=cfg.pretrain_epochs, progress=False), public=True)
    engine.run()
    return {p: {k: v.detach().clone() for k, v in m.state_dict().items()} for p, m in engine.model.bottoms.items()}


def pretrained_bottoms(cfg: RunConfig) -> dict[str, dict]:
    """One-shot mode (002 §3): the guests' bottoms pretrained on *public* records.

    002 loads the first layers of a model pretrained on a public same-domain dataset and freezes
    them. Here the public data are ``--public-fraction`` of the training IDs, removed from the
    private training set (:func:`prepare_data`); the whole model is trained on them (no privacy
    is needed for public records) for ``--pretrain-epochs`` and each guest keeps its bottom.
    Deterministic from the config, so every node computes the same weights.
    """
    return _pretrained(_data_key(cfg) + (cfg.pretrain_epochs, cfg.model, cfg.cut_layer, cfg.hidden, cfg.lr,
                                         cfg.optimizer, cfg.defense, cfg.protect, cfg.merge), cfg)


def make_parties(cfg: RunConfig) -> tuple[HostParty, dict[str, GuestParty], RunPlan]:
    """All parties of a run in this process (the local engine's view)."""
    prepared = prepare_data(cfg)
    plan = plan_run(cfg, prepared)
    host = make_host(plan, prepared.parties["host"])
    guests = {g: make_guest(plan, prepared.parties[g], g) for g in plan.guests}
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


def make_monolithic(cfg: RunConfig, public: bool = False) -> tuple[MonolithicModel, PreparedData, RunPlan]:
    """The no-split reference: same modules and initial weights as the split parties.

    ``public=True`` trains on the one-shot public records instead (guest pretraining)."""
    prepared = prepare_data(cfg)
    if public:
        one_shot = prepare_data(cfg.replace(one_shot=True))
        prepared = dataclasses.replace(one_shot, parties=one_shot.public,
                                       train_ids=one_shot.public["host"].train_ids, public={})
    plan = plan_run(cfg, prepared)
    arch = _architecture(cfg)
    bottoms = {p: build_bottom(arch, p, s, plan.cut, plan.guest_cut_activation, cfg.seed)
               for p, s in plan.input_shapes.items()}
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, cfg.seed)
    return MonolithicModel(bottoms, Merge(cfg.merge), top), prepared, plan
