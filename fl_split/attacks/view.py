"""The adversary's view: what one party legitimately holds after a training run.

An attack is mounted by one party (issue 9, ``docs/attacks.md``) on what that party holds — and on
nothing else. The separation is structural:

* a :class:`Session` is the *world* of a simulated run: it builds every party (the local engine's
  :class:`~fl_split.engine.LocalTransport`), runs :func:`~fl_split.engine.coordinate` through an
  :class:`ObservingTransport` that keeps, per party, the blobs delivered **to** it (its inbox) and
  the blobs it **sent** (its outbox), in order, and it holds the ground truth
  (:class:`~fl_split.attacks.truth.Referee`). An attack never receives a session;
* :meth:`Session.view` builds an :class:`AdversaryView` from exactly: the adversary's own party
  object (its data, models, optimizer, ledger and its own secret), its decoded inbox and outbox,
  the public run configuration and plan (schedule, shapes), the run's public results (final
  metric, history, every party's privacy report) and the auxiliary data its threat model
  grants (:class:`Grant`), copied. It holds no reference to another party's object, secret,
  model or data (``tests/test_attacks.py`` walks its object graph to check);
* attacks are functions of a view (and their hyper-parameters) that return a guess; the runner
  scores the guess with the referee.

Batch membership is derived from the public schedule (``plan.schedule.positions(key)`` into the
shared train/test ID lists), never from a message's header. Observations are decoded from the
very bytes that crossed (:mod:`fl_split.protocol`), so a view sees exactly what the wire carried:
perturbed releases, never a party's private values.

A malicious host (FSHA, :mod:`fl_split.attacks.fsha`) replaces the honest host in the transport
(:meth:`Session.hijack_host`); the guests stay honest :class:`~fl_split.parties.GuestParty` objects
with their defences on.

Under the Flower engine each party records what it holds on its own node and the attack process
rebuilds it from that (:mod:`fl_split.attacks.flower`); the view is then the same.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fl_split.attacks.truth import Referee
from fl_split.builder import PreparedData, make_guest, make_host, plan_run, prepare_data
from fl_split.config import RunConfig
from fl_split.engine import LocalTransport, coordinate
from fl_split.errors import ConfigError
from fl_split.models.registry import build_bottom
from fl_split.protocol import decode
from fl_split.schedule import BatchKey
from fl_split.seeding import numpy_rng


# -- observations ------------------------------------------------------------------------------------
class NotObserved(LookupError):
    """The adversary did not observe what an attack asked for."""


@dataclass(frozen=True)
class Observation:
    """One message as a party saw it: ``direction`` ``"in"`` (delivered to it) or ``"out"`` (sent)."""

    direction: str
    kind: str
    sender: str
    receiver: str
    round: int
    key: BatchKey
    tensor: torch.Tensor
    encoding: str


@dataclass
class Records:
    """Per-record values of one phase: row ``i`` of ``values`` belongs to shared position
    ``positions[i]`` (into the train or test ID list) and ID ``ids[i]``."""

    phase: str
    positions: np.ndarray
    ids: np.ndarray
    values: Any  # torch.Tensor or np.ndarray, one row per record

    def __len__(self) -> int:
        return len(self.positions)

    def subset(self, keep: np.ndarray) -> "Records":
        keep = np.asarray(keep)
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        values = self.values[torch.as_tensor(idx)] if isinstance(self.values, torch.Tensor) else self.values[idx]
        return Records(self.phase, self.positions[idx], self.ids[idx], values)

    def select(self, positions: np.ndarray) -> "Records":
        """The rows at shared ``positions`` (each must be present)."""
        where = {int(p): i for i, p in enumerate(self.positions)}
        missing = [int(p) for p in positions if int(p) not in where]
        if missing:
            raise KeyError(f"no {self.phase} record at positions {missing[:5]}")
        return self.subset(np.array([where[int(p)] for p in positions], dtype=np.int64))


class ObservingTransport:
    """A :class:`~fl_split.engine.Transport` that records every blob as it is delivered to a party
    (``boxes[party]["in"]``) or returned by it (``boxes[party]["out"]``), then passes it on unchanged."""

    def __init__(self, inner, boxes: dict[str, dict[str, list[bytes]]]) -> None:
        self.inner = inner
        self.guests = list(inner.guests)
        self.boxes = boxes

    def _keep(self, party: str, box: str, blobs_by_party: dict[str, list[bytes]]) -> None:
        for blobs in blobs_by_party.values():
            self.boxes[party][box].extend(blobs)

    def guest_step(self, owed, keys, round_):
        for g in self.guests:
            self.boxes[g]["in"].extend(owed.get(g, []))
        out = self.inner.guest_step(owed, keys, round_)
        for g, blobs in out.items():
            self.boxes[g]["out"].extend(blobs)
        return out

    def host_train(self, keys, acts, round_):
        self._keep("host", "in", acts)
        grads = self.inner.host_train(keys, acts, round_)
        self._keep("host", "out", grads)
        return grads

    def host_evaluate(self, keys, acts, round_):
        self._keep("host", "in", acts)
        return self.inner.host_evaluate(keys, acts, round_)

    def reports(self):
        return self.inner.reports()

    def __getattr__(self, name: str):
        # optional transport services (checkpoints, dropping a failed guest) pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


# -- what a threat model grants -------------------------------------------------------------------------
GRANT_KINDS = ("property-labels", "victim-features", "public-records", "known-labels", "victim-model")


@dataclass(frozen=True)
class Grant:
    """One piece of auxiliary knowledge a threat model gives the adversary (copied into its view).

    * ``property-labels``: the binary property ``prop`` of ``victim``'s data for a ``fraction`` of
      the training records (001 §2.3: the adversary's labelled auxiliary data for Eq. 1);
    * ``victim-features``: ``victim``'s encoded input rows of a ``fraction`` of the training records
      (leaked pairs of input and ID, for a learned inversion decoder);
    * ``public-records``: the public split — ``--public-fraction`` of the training IDs taken out of
      training, every party's columns and the labels (same-domain public data: FSHA's public set,
      the shadow models' data);
    * ``known-labels``: the labels of ``per_class`` training records of each class (Fu et al. 2022;
      Li et al. 2022's reference gradients);
    * ``victim-model``: a copy of ``victim``'s bottom model, architecture and weights at the end
      of training (He et al. 2019's white-box inversion; Luo et al. 2021's known model) — never its
      secret, optimizer or data.

    Which records are granted is drawn from the public seed (``numpy_rng(seed, "attack-aux", …)``),
    so every attack on a run sees the same auxiliary part.
    """

    kind: str
    victim: str = ""
    fraction: float = 0.0
    per_class: int = 0
    prop: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRANT_KINDS:
            raise ValueError(f"unknown grant {self.kind!r}; allowed: {GRANT_KINDS}")

    def describe(self) -> str:
        if self.kind == "property-labels":
            return (f"the property '{self.prop}' of {self.victim}'s data for {self.fraction:.0%} of the training "
                    f"records (labelled auxiliary data)")
        if self.kind == "victim-features":
            return f"{self.victim}'s raw inputs for {self.fraction:.0%} of the training records (leaked pairs)"
        if self.kind == "public-records":
            return ("public same-domain records: the public split (--public-fraction of the training IDs, removed "
                    "from training), all columns and labels")
        if self.kind == "known-labels":
            return f"the labels of {self.per_class} training records per class"
        return (f"{self.victim}'s bottom model, architecture and weights, copied at the end of training "
                f"(not its secret, optimizer or data)")


@dataclass
class Auxiliary:
    """The auxiliary data of a view (only what its grants name; everything copied)."""

    property_labels: Records | None = None
    property_name: str = ""
    victim_features: Records | None = None
    public: dict[str, Any] | None = None  # {"x": {party: tensor}, "y": tensor, "ids": array}
    known_labels: Records | None = None
    victim_model: nn.Module | None = None
    grants: list[str] = field(default_factory=list)


# -- the view -------------------------------------------------------------------------------------------
class AdversaryView:
    """Everything one party legitimately holds after the run (see the module docstring).

    ``me`` is the adversary's own party object; ``inbox``/``outbox`` its decoded messages in order;
    ``plan`` (with ``plan.cfg``) and ``results`` are public; ``aux`` is what the threat model
    grants. Attack randomness comes from the adversary's own secret (:meth:`generator`,
    :meth:`seeded`): fresh per run, reproducible with ``--private-seed``.
    """

    def __init__(self, party: str, me: Any, plan, inbox: tuple[Observation, ...], outbox: tuple[Observation, ...],
                 results: dict, aux: Auxiliary, threat_model: list[str]) -> None:
        self.party = party
        self.role = "host" if party == "host" else "guest"
        self.me = me
        self.plan = plan
        self.inbox = inbox
        self.outbox = outbox
        self.results = results
        self.aux = aux
        self.threat_model = threat_model

    @property
    def cfg(self) -> RunConfig:
        return self.plan.cfg

    @property
    def device(self) -> torch.device:
        return torch.device(self.me.device)

    @property
    def progress(self) -> bool:
        return bool(self.cfg.progress)

    @property
    def data(self):
        """The adversary's own data (a host without features still holds the labels)."""
        return self.me.data

    def shared_ids(self, phase: str) -> np.ndarray:
        d = self.me.data
        return d.train_ids if phase == "train" else d.test_ids

    def n(self, phase: str) -> int:
        return len(self.shared_ids(phase))

    # -- randomness (the adversary's own) -----------------------------------------------------------
    def generator(self, *purpose: object, device: torch.device | str | None = None) -> torch.Generator:
        return self.me.secret.torch_generator("attack", *purpose, device=device or self.device)

    def rng(self, *purpose: object) -> np.random.Generator:
        return self.me.secret.numpy_rng("attack", *purpose)

    @contextlib.contextmanager
    def seeded(self, *purpose: object) -> Iterator[None]:
        """Build modules under the adversary's private seed for ``purpose`` (caller's RNG restored)."""
        with self.me.secret.seeded_torch("attack", *purpose):
            yield

    # -- messages -----------------------------------------------------------------------------------
    def _box(self, box: str) -> tuple[Observation, ...]:
        if box not in ("in", "out"):
            raise ValueError(f"box must be 'in' or 'out', got {box!r}")
        return self.inbox if box == "in" else self.outbox

    def _matching(self, kind: str, phase: str, box: str, peer: str | None) -> list[Observation]:
        out = []
        for o in self._box(box):
            other = o.sender if box == "in" else o.receiver
            if o.kind == kind and o.key.phase == phase and (peer is None or other == peer):
                out.append(o)
        return out

    def epochs(self, kind: str, phase: str = "train", box: str = "in", peer: str | None = None) -> list[int]:
        return sorted({o.key.epoch for o in self._matching(kind, phase, box, peer)})

    def records(self, kind: str, phase: str = "train", epoch: int | str = "last", *, box: str = "in",
                peer: str | None = None) -> Records:
        """The per-record tensors of ``kind`` messages of one epoch (``"last"``: the latest observed),
        from the inbox (``box="in"``, ``peer`` = sender) or the outbox (``peer`` = receiver).
        Records are placed by the public schedule and returned in shared-position order."""
        obs = self._matching(kind, phase, box, peer)
        if not obs:
            raise NotObserved(f"{self.party} observed no {phase} '{kind}' messages"
                              f"{f' with {peer}' if peer else ''} ({'received' if box == 'in' else 'sent'})")
        if epoch == "last":
            epoch = max(o.key.epoch for o in obs)
        obs = [o for o in obs if o.key.epoch == int(epoch)]
        if not obs:
            raise NotObserved(f"{self.party} observed no {phase} '{kind}' messages in epoch {epoch}")
        n = self.n(phase)
        sample_shape = tuple(obs[0].tensor.shape[1:])
        values = torch.zeros((n, *sample_shape), dtype=torch.float32)
        seen = np.zeros(n, dtype=bool)
        for o in obs:
            pos = self.plan.schedule.positions(o.key)
            values[torch.from_numpy(pos)] = o.tensor
            seen[pos] = True
        pos = np.flatnonzero(seen)
        return Records(phase, pos, self.shared_ids(phase)[pos], values[torch.from_numpy(pos)])

    def records_over_epochs(self, kind: str, phase: str = "train", epochs: Sequence[int] | str = "all", *,
                            box: str = "in", peer: str | None = None) -> Records:
        """Like :meth:`records`, stacked over ``epochs`` (``"all"``: every observed epoch):
        ``values`` has shape ``(n, E, *sample_shape)``, only records present in every epoch."""
        if epochs == "all":
            epochs = self.epochs(kind, phase, box, peer)
        per = [self.records(kind, phase, e, box=box, peer=peer) for e in epochs]
        common = per[0].positions
        for r in per[1:]:
            common = np.intersect1d(common, r.positions)
        per = [r.select(common) for r in per]
        return Records(phase, common, self.shared_ids(phase)[common], torch.stack([r.values for r in per], dim=1))

    def describe(self) -> dict[str, Any]:
        """The threat model in words and keys (what this view holds)."""
        kinds_in = sorted({(o.kind, o.sender) for o in self.inbox})
        kinds_out = sorted({(o.kind, o.receiver) for o in self.outbox})
        return {"adversary": self.party, "role": self.role,
                "holds": list(self.threat_model),
                "received": [f"{k} from {s}" for k, s in kinds_in],
                "sent": [f"{k} to {r}" for k, r in kinds_out],
                "messages_received": len(self.inbox), "messages_sent": len(self.outbox),
                "granted": list(self.aux.grants)}


def _decode_box(blobs: list[bytes], direction: str) -> tuple[Observation, ...]:
    out = []
    for b in blobs:
        m = decode(b)
        out.append(Observation(direction, m.kind, m.sender, m.receiver, int(m.round), m.key, m.tensor, m.encoding))
    return tuple(out)


# -- the world of a simulated run ---------------------------------------------------------------------
def architecture(plan):
    """The run's architecture (public: the run configuration names it), a built-in one or the
    user's ``--model package.module:function`` (which the attacker can call as the parties do)."""
    from fl_split.builder import _plan_architecture

    return _plan_architecture(plan)


def _inner_module(m: nn.Module) -> nn.Module:
    """The module inside an Opacus ``GradSampleModule`` (DP-SGD parties), else ``m``."""
    return getattr(m, "_module", m)


class Session:
    """One configured training run with every party in this process, observed message by message.

    ``public=True`` takes the public split out of training first (``--public-fraction`` of the
    training IDs, chosen from the public seed as ``--one-shot`` does): attacks whose threat model
    grants public same-domain records train on the rest. The session is the *world* (all parties,
    the ground truth): attacks get :meth:`view`, never the session.
    """

    #: the engines this session trains with (:class:`fl_split.attacks.flower.FlowerSession`: flower)
    ENGINES = ("local",)

    def __init__(self, cfg: RunConfig, private_seed: int | None = None, *, public: bool = False) -> None:
        if cfg.engine not in self.ENGINES:
            raise ConfigError("engine", cfg.engine, " or ".join(self.ENGINES),
                              reason=f"this session trains with the {self.ENGINES[0]} engine")
        if cfg.monolithic:
            raise ConfigError("monolithic", True, "false (an attack needs a split run)")
        self.cfg = cfg
        self.private_seed = private_seed
        prepared = prepare_data(cfg)
        if public and not cfg.one_shot:
            prepared = prepare_data(cfg.replace(one_shot=True))  # the same carve-out as --one-shot
        self.prepared: PreparedData = prepared
        self.public_parties = dict(prepared.public) if public else {}
        self.plan = plan_run(cfg, dataclasses.replace(prepared, public={}))
        if self.plan.task == "regression":
            raise ConfigError("dataset", cfg.data_name if cfg.data else cfg.dataset, "a classification dataset for an "
                              "attack", reason="the attacks (label, membership, reconstruction scoring) are built for "
                                               "class labels, and this run's task is regression")
        self.referee = Referee(cfg, prepared.parties)
        self._host = None
        self._guests: dict[str, Any] | None = None
        self._boxes: dict[str, dict[str, list[bytes]]] = {p: {"in": [], "out": []} for p in ["host", *self.plan.guests]}
        self._acting_host: Any = None
        self.results: dict | None = None

    @classmethod
    def finished(cls, cfg: RunConfig, private_seed, host, guests: dict[str, Any], boxes: dict[str, dict[str, list]],
                 results: dict) -> "Session":
        """The session of a run already trained elsewhere through an :class:`ObservingTransport` of
        frames into ``boxes`` (the Python API's ``Run``, :mod:`fl_split.api`): its parties and their
        boxes, so that :meth:`view` gives each adversary exactly what it would give after
        :meth:`run`. No public split, no hijacked host."""
        session = cls(cfg, private_seed)
        if sorted(boxes) != sorted(session._boxes):
            raise ValueError(f"boxes of parties {sorted(boxes)}, the plan has {sorted(session._boxes)}")
        session._host, session._guests, session._boxes, session.results = host, dict(guests), boxes, results
        return session

    def _build(self) -> None:
        """Build the parties (on first need: checks on the plan run before any party exists)."""
        if self._host is None:
            prepared, seed = self.prepared, self.private_seed
            self._host = make_host(self.plan, prepared.parties["host"], private_seed=seed)
            self._guests = {g: make_guest(self.plan, prepared.parties[g], g, private_seed=seed)
                            for g in self.plan.guests}

    @property
    def host(self):
        self._build()
        return self._host

    @property
    def guests(self) -> dict[str, Any]:
        self._build()
        return self._guests

    @property
    def parties(self) -> dict[str, Any]:
        return {"host": self.host, **self.guests}

    def hijack_host(self, factory: Callable[[Any, Any, Auxiliary], Any], grants: Sequence[Grant] = ()) -> Any:
        """Replace the honest host in the transport by ``factory(host, plan, aux)`` (a malicious host
        built from the honest host's own objects and the grants available before training)."""
        if self.results is not None:
            raise RuntimeError("the run is over; hijack the host before run()")
        aux = self._auxiliary("host", grants, trained=False)
        self._acting_host = factory(self.host, self.plan, aux)
        return self._acting_host

    def run(self) -> dict:
        """Train (once) and return the results dictionary."""
        if self.results is None:
            host = self._acting_host if self._acting_host is not None else self.host
            # frames, not in-process hand-overs: the adversary sees what a deployment's wire carries
            transport = ObservingTransport(LocalTransport(host, self.guests, codec=True), self._boxes)
            self.results = coordinate(self.cfg, self.plan, transport, "local")
        return self.results

    def public_results(self) -> dict:
        """The run's results (all public: configuration, plan, history, final metric, privacy reports)."""
        return copy.deepcopy(self.run())

    def view(self, party: str, grants: Sequence[Grant] = ()) -> AdversaryView:
        """``party``'s :class:`AdversaryView` with the auxiliary data of ``grants``."""
        results = self.public_results()
        if party == "host":
            me = self._acting_host if self._acting_host is not None else self.host
        elif party in self.guests:
            me = self.guests[party]
        else:
            raise ConfigError("guest", party, f"one of {', '.join(self.guests)}")
        inbox = _decode_box(self._boxes[party]["in"], "in")
        outbox = _decode_box(self._boxes[party]["out"], "out")
        aux = self._auxiliary(party, grants, trained=True)
        holds = [f"its own party object ({party}): its data, models, optimizer, ledger and secret",
                 "every message delivered to it and every message it sent, decoded from the wire",
                 "the public run configuration, plan and batch schedule (seed, shared ID lists, shapes)",
                 "the run's public results: per-epoch aggregates, final metric, every party's privacy report",
                 *aux.grants]
        return AdversaryView(party, me, self.plan, inbox, outbox, results, aux, holds)

    # -- grants ---------------------------------------------------------------------------------------
    def _aux_positions(self, kind: str, victim: str, fraction: float) -> np.ndarray:
        n = self.referee.n("train")
        k = int(round(n * fraction))
        if not 1 <= k < n:
            raise ConfigError("aux-fraction", fraction, "a fraction leaving at least one auxiliary and one target "
                              "training record", reason=f"{n} training records")
        return np.sort(numpy_rng(self.cfg.seed, "attack-aux", kind, victim).permutation(n)[:k])

    def _auxiliary(self, party: str, grants: Sequence[Grant], trained: bool) -> Auxiliary:
        aux = Auxiliary()
        ref = self.referee
        for g in grants:
            if g.kind == "property-labels":
                pos = self._aux_positions("property", g.victim, g.fraction)
                aux.property_labels = Records("train", pos, ref.ids("train", pos),
                                              ref.property(g.prop, g.victim, "train", pos))
                aux.property_name = g.prop
            elif g.kind == "victim-features":
                pos = self._aux_positions("features", g.victim, g.fraction)
                aux.victim_features = Records("train", pos, ref.ids("train", pos),
                                              ref.features(g.victim, "train", pos))
            elif g.kind == "public-records":
                if not self.public_parties:
                    raise RuntimeError("this session has no public split (Session(..., public=True))")
                host = self.public_parties["host"]
                aux.public = {"x": {p: d.x_train.clone() for p, d in self.public_parties.items() if d.has_features},
                              "y": host.y_train.clone(), "ids": host.train_ids.copy()}
            elif g.kind == "known-labels":
                y = ref.labels("train", np.arange(ref.n("train")))
                order = numpy_rng(self.cfg.seed, "attack-aux", "labels").permutation(len(y))
                pos = np.sort(np.concatenate([order[y[order] == c][: g.per_class] for c in np.unique(y)]))
                aux.known_labels = Records("train", pos, ref.ids("train", pos), y[pos].copy())
            elif g.kind == "victim-model":
                if not trained:
                    raise RuntimeError("the victim's model is granted at the end of training")
                aux.victim_model = self._copy_bottom(g.victim)
            aux.grants.append(g.describe())
        return aux

    def _copy_bottom(self, victim: str) -> nn.Module:
        """A fresh module of ``victim``'s public architecture with a copy of its final weights."""
        src = _inner_module(self.guests[victim].bottom)
        plan = self.plan
        module = build_bottom(architecture(plan), victim, plan.input_shapes[victim], plan.cut,
                              plan.guest_cut_activation, None)
        module.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()})
        return module.eval()
