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

import functools
from dataclasses import dataclass

import numpy as np
from torch import nn

from fl_split.config import AUTO, RunConfig
from fl_split.data.base import PartyData, apply_padding, feature_parties, partition, prepare_party, split_ids
from fl_split.data.registry import dataset_info, load_dataset
from fl_split.errors import ConfigError
from fl_split.merge import Merge, merged_shape
from fl_split.models.registry import build_bottom, build_top, get_architecture, output_shape
from fl_split.parties import GuestParty, HostParty, resolve_device
from fl_split.schedule import BatchSchedule


@dataclass
class PreparedData:
    dataset: str
    task: str
    metric: str
    num_classes: int
    parties: dict[str, PartyData]
    train_ids: np.ndarray
    test_ids: np.ndarray


def _data_key(cfg: RunConfig) -> tuple:
    return (cfg.dataset, cfg.data_root, cfg.guests, cfg.host_features, cfg.columns, cfg.padding,
            cfg.test_fraction, cfg.limit, cfg.seed)


@functools.lru_cache(maxsize=4)
def _prepare(key: tuple) -> PreparedData:
    dataset, root, guests, host_features, columns, padding, test_fraction, limit, seed = key
    ds = load_dataset(dataset, root)
    train_ids, test_ids = split_ids(ds, test_fraction, seed, limit)
    slices = partition(ds, guests, host_features, columns, seed=seed)
    parties = {name: prepare_party(sl, train_ids, test_ids) for name, sl in slices.items()}
    if padding:
        parties = apply_padding(parties)
    return PreparedData(dataset=ds.name, task=ds.task, metric=ds.metric, num_classes=ds.num_classes,
                        parties=parties, train_ids=train_ids, test_ids=test_ids)


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
    """The activation that ends a guest's bottom, as the defence requires (see models.registry)."""
    return "native"


def plan_run(cfg: RunConfig, prepared: PreparedData | None = None) -> RunPlan:
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


def make_guest(plan: RunPlan, data: PartyData, name: str, device: str | None = None) -> GuestParty:
    cfg = plan.cfg
    arch = _architecture(cfg)
    bottom = build_bottom(arch, name, plan.input_shapes[name], plan.cut, plan.guest_cut_activation, cfg.seed)
    return GuestParty(name, cfg, plan.schedule, data, bottom, plan.cut_shapes[name],
                      device=resolve_device(device or cfg.device))


def make_host(plan: RunPlan, data: PartyData, device: str | None = None) -> HostParty:
    cfg = plan.cfg
    arch = _architecture(cfg)
    bottom = None
    if cfg.host_features:
        bottom = build_bottom(arch, "host", plan.input_shapes["host"], plan.cut, "native", cfg.seed)
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, cfg.seed)
    guest_shapes = {g: plan.cut_shapes[g] for g in plan.guests}
    return HostParty(cfg, plan.schedule, data, bottom, Merge(cfg.merge), top, guest_shapes,
                     device=resolve_device(device or cfg.device))


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


def make_monolithic(cfg: RunConfig) -> tuple[MonolithicModel, PreparedData, RunPlan]:
    """The no-split reference: same modules and initial weights as the split parties."""
    prepared = prepare_data(cfg)
    plan = plan_run(cfg, prepared)
    arch = _architecture(cfg)
    bottoms = {p: build_bottom(arch, p, s, plan.cut, plan.guest_cut_activation, cfg.seed)
               for p, s in plan.input_shapes.items()}
    top = build_top(arch, plan.merged_shape, plan.cut, plan.num_outputs, cfg.seed)
    return MonolithicModel(bottoms, Merge(cfg.merge), top), prepared, plan
