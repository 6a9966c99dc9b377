""":class:`GuestParty`: a party that holds features only (spec §2, steps 1 and 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_split.checkpoint import value_digest
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.local_update import LocalUpdate
from fl_split.parties.base import _outgoing, _Party, _Pending, set_mode
from fl_split.parties.schedule import Importance, MechanismSchedule
from fl_split.privacy.base import Mechanism, PostProcess
from fl_split.privacy.bounds import PeerTrust, ScaleMonitor
from fl_split.privacy.diagnostics import LocalDiagnostics
from fl_split.privacy.disclosure import party_privacy_report
from fl_split.protocol import Message, frame_limit, open_message, receive_expected, wire_bytes
from fl_split.schedule import BatchKey, BatchSchedule
from fl_split.seeding import PartySecret

if TYPE_CHECKING:
    from fl_split.privacy.ledger import Ledger


class GuestParty(_Party):
    """Holds features only: a bottom model (inside its local-update policy), its forward
    mechanism, its secret and its ledger.

    Privacy (spec §3, §5): every release is charged to :attr:`ledger` *before* anything is
    computed or leaves, for all batches of the request at once, so a refused request
    (``BudgetExceeded``) releases nothing. A DP-SGD update policy charges its steps too.
    """

    role = "guest"

    def __init__(self, name: str, data: PartyData, schedule: BatchSchedule, *, update: LocalUpdate,
                 cut_shape: tuple[int, ...], mechanisms: MechanismSchedule, secret: PartySecret,
                 ledger: "Ledger | None" = None, sample_rate: float = 1.0,
                 grad_postprocess: PostProcess | None = None, importance: Importance | None = None,
                 device: torch.device | str = "cpu", host_mechanisms: MechanismSchedule | None = None,
                 max_test_requests: int | None = None) -> None:
        super().__init__(name, data, schedule, secret, ledger, sample_rate, device)
        #: ``--max-test-requests``: how many times one test batch is released (``None``: no cap)
        self.max_test_requests = max_test_requests
        #: what this guest checks of the host's gradients: the public range of the host's backward
        #: mechanism (``host_mechanisms``, from the public configuration), else their running scale,
        #: which refuses nothing in the first epoch: honest partial losses can grow 23x in one batch
        #: while the host's top model starts (diabetes regression, batch 32; docs/robustness.md)
        self.trust = PeerTrust(name, "gradients", {"host": host_mechanisms} if host_mechanisms is not None else {},
                               warmup=max(ScaleMonitor.WARMUP, schedule.num_train_batches()))
        if not data.has_features:
            raise ValueError(f"{name}: a guest must hold feature columns")
        self.update = update
        self.bottom = update.modules[0]
        self.cut_shape = tuple(cut_shape)
        self.mechanisms = mechanisms
        #: receiver-side post-processing of received gradients (denoising), identity by default
        self.grad_postprocess = grad_postprocess or PostProcess()
        self.importance = importance
        self.diagnostics = LocalDiagnostics(name, int(np.prod(self.cut_shape)))
        self._pending: dict[BatchKey, _Pending] = {}
        #: secure merge (fl_split/privacy/secure_merge.py): this guest's signing identity, every guest's
        #: pinned public identity, and the current session's masks (``None``: releases are not masked)
        self.secure_identity = None
        self.secure_roster: dict[str, bytes] = {}
        self.secure = None

    @property
    def mechanism(self) -> Mechanism:
        """The first iteration's mechanism (what reports describe)."""
        return self.mechanisms()

    # -- forward ----------------------------------------------------------------------------
    def release(self, keys: list[BatchKey] | tuple[BatchKey, ...], round_: int, in_process: bool = False) -> list[bytes]:
        """Compute and release the cut-layer output of each batch in ``keys``: frames, or with
        ``in_process`` :class:`~fl_split.protocol.Handoff` messages for a receiver in this process
        (charged, logged and checked the same; :func:`_outgoing`)."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ProtocolError(f"{self.name}: a batch is asked for twice in one request ({[str(k) for k in keys]})")
        for key in keys:
            if key.phase == "train" and key in self._pending:
                raise ProtocolError(f"{self.name}: {key} was already released and awaits its gradient")
            n = self._times.get(key, 0)
            if key.phase == "test" and self.max_test_requests is not None and n >= self.max_test_requests:
                # before anything is charged or computed: a refused request spends nothing (issue 25)
                raise ProtocolError(f"{self.name}: {key} requested again (round {round_}); refused: it was released "
                                    f"{n} time{'s' if n != 1 else ''} and --max-test-requests {self.max_test_requests} "
                                    f"allows no more (each repeat is another noisy copy of the same records)")
        if (self.secure_identity is not None or getattr(self.mechanisms(), "name", "") == "skellam-share") and \
                (self.secure is None or not self.secure.ready):  # before anything is charged or computed
            raise ProtocolError(f"{self.name}: secure merge: a release before the key agreement; refused (a "
                                f"share is charged against the honest shares' sum and never leaves unmasked)")
        costs = [self.mechanisms(key).cost() for key in keys]
        # an importance allocation released at a key is charged before that key's release
        alloc = self.importance.plan(keys, updates_per_key=0) if self.importance is not None else set()
        entries = []
        for key, c in zip(keys, costs):
            if key in alloc:
                entries.append(self.importance.entry(round_, key, self.data.train_ids))
            if c is not None:
                entries.append(self._entry(round_, key, "forward", c))
        charge = self._charge(entries)
        out = _outgoing(in_process)
        blobs: list[bytes] = []
        digests: list[str] = []
        draws: list[int | None] = []
        for key, cost in zip(keys, costs):
            if key.phase == "test" and key.index == 0:
                m = self.mechanisms(key)  # the epoch's training is over
                self.diagnostics.check(key.epoch, m.name, m.public_diagnostics().get("snr_bound"))
            train = key.phase == "train" and self.update.trains
            x = self.rows(key)
            mech = self.mechanisms(key)
            if self.importance is not None:
                u, shares, drawn = self.importance.take(key, self._release_allocation, release=key in alloc)
                self.importance.give(mech, u)
                if shares is not None:
                    digests.append(value_digest(shares))
                    draws.append(drawn)
            set_mode(self.bottom, train)
            if train and self.update.keeps_release_graph:
                v = self.bottom(x)
            else:
                # DP-SGD guests forward without the graph (Opacus must not capture activations of
                # this pass) and recompute when the gradient arrives
                with torch.no_grad():
                    v = self.bottom(x)
            # a Skellam share is charged against the honest shares' sum: it never leaves unmasked
            masked = self.secure_identity is not None or getattr(mech, "name", "") == "skellam-share"
            wire = self._secure_wire(round_, key) if masked else (lambda value: value)
            rel, blob, c = self._release(mech, v.detach(), lambda r: out(Message(
                "activations", self.name, "host", round_, key, self.digest(key), wire(r.value), r.encoding)))
            self.diagnostics.add(key.epoch, rel.stats)
            blobs.append(blob)
            if cost is not None and charge is not None:  # the log's digest: only when there is a log
                digests.append(value_digest(wire_bytes(blob)))
                draws.append(c)
            self._count_release(key)
            self.released["batches"] += 1
            self.released["records"] += len(v)
            if train:
                self._pending[key] = _Pending(round_, self.steps, rel.ctx,
                                              v if self.update.keeps_release_graph else None)
        self._settle(charge, digests, draws)
        return blobs

    # -- secure merge (fl_split/privacy/secure_merge.py) -------------------------------------------
    def secure_announce(self, session: bytes, members: list[str]) -> bytes:
        """Start secure-merge session ``session`` among ``members``: a fresh ephemeral X25519 key (a
        private draw: never the same twice), announced signed by this guest's identity."""
        from fl_split.privacy.secure_merge import MaskingGuest, SkellamShare

        if self.secure_identity is None:
            raise ProtocolError(f"{self.name}: secure merge asked of a guest without a secure-merge identity")
        _, c = self._draw("secure-merge-key")
        seed = self.secret.derive_bytes("secure-merge-key", c, bytes(session).hex())
        self.secure = MaskingGuest(self.name, self.secure_identity, self.secure_roster, bytes(session),
                                   list(members), seed)
        mech = self.mechanisms()
        if isinstance(mech, SkellamShare):  # each share is mu / (G_active - k)
            mech.active = len(members)
        return self.secure.announce()

    def relayed_announce(self, session: bytes, members, pad: bool) -> bytes:
        """:meth:`secure_announce` for a relayed request (the coordinator's on the relay and at a run's
        start, the host's on the direct data plane after a guest failed), after checking who is in the
        session. Every guest of the run must be in it — a session of fewer guests would leave this one's
        release masked only towards them, or unmasked — except with ``--on-guest-failure pad``: then the
        guests of this guest's current session less those the run went on without (a session only
        shrinks within a run, and this guest stays in it; docs/flower.md, "Secure merge on Flower")."""
        name = self.name
        if not 16 <= len(session) <= 64:
            raise ProtocolError(f"{name}: secure merge: a session id of 16 to 64 bytes expected")
        roster = sorted(self.secure_roster)
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members) \
                or len(set(members)) != len(members):
            raise ProtocolError(f"{name}: secure merge: a session of {members!r}; refused (a list of guests expected)")
        if not pad:
            if sorted(members) != roster:
                raise ProtocolError(f"{name}: secure merge: a session of {members!r}; refused (every guest of the "
                                    f"run, {roster}, must be in it)")
        else:
            current = sorted(self.secure.members) if self.secure is not None else roster
            if name not in members or not set(members) <= set(current):
                raise ProtocolError(f"{name}: secure merge: a session of {members!r}; refused (with "
                                    f"--on-guest-failure pad: this guest and guests of its current session {current} "
                                    f"only)")
        return self.secure_announce(session, list(members))

    def secure_agree(self, announcements: list[bytes]) -> None:
        """Check the peers' announcements (relayed by the host) and derive the pairwise mask keys."""
        if self.secure is None:
            raise ProtocolError(f"{self.name}: secure merge: key announcements before a session was started")
        self.secure.agree(announcements)

    def _secure_wire(self, round_: int, key: BatchKey):
        """The encoder of a masked release: fixed-point value + masks on the ring, as float32. A second
        call for the same batch (a value the resume rule kept from leaving) reuses the mask: the first
        value never left."""
        if self.secure is None or not self.secure.ready:
            raise ProtocolError(f"{self.name}: secure merge: a release before the key agreement; refused")
        calls = [0]

        def wire(value: torch.Tensor) -> torch.Tensor:
            ints = value.detach().cpu().double().numpy().astype(np.int64)
            masked = self.secure.mask(ints, round_, key.as_tuple(), fresh=calls[0] == 0)
            calls[0] += 1
            return torch.from_numpy(masked.astype(np.float32))

        return wire

    def redo(self, keys, round_: int, in_process: bool = False) -> list[bytes]:
        """Release ``keys`` again in a new secure-merge session (a guest of the round failed: the host
        never unmasks a sum with a missing mask). Fresh noise and masks; charged again. Only the round this
        guest served last, and only in a session that has not masked it yet (one agreed since): checked
        before anything is charged."""
        keys = list(keys)
        if round_ != self.last_round:
            raise ProtocolError(f"{self.name}: round {round_} asked again, but the last round served is "
                                f"{self.last_round}; refused (only the round just served is released again)")
        if self.secure is not None and any(self.secure.masked(round_, k.as_tuple()) for k in keys):
            raise ProtocolError(f"{self.name}: round {round_} asked again in the session that masked it; refused "
                                f"(a round is released again only after a new key agreement)")
        for key in keys:
            self._pending.pop(key, None)
        return self.release(keys, round_, in_process)

    def _epoch_entries(self, epoch: int) -> list["LedgerEntry"]:
        """Epoch ``epoch``'s forward releases (training and test batches) and DP-SGD updates."""
        entries = []
        update = self.update.cost()
        for key in self.schedule.train_keys(epoch) + self.schedule.test_keys(epoch):
            c = self.mechanisms(key).cost()
            if c is not None:
                entries.append(self._entry(0, key, "forward", c))
            if update is not None and key.phase == "train":
                entries.append(self._entry(0, key, "update", update))
        return entries

    # -- backward ---------------------------------------------------------------------------
    def apply_gradients(self, blobs: list[bytes], round_: int | None = None) -> None:
        """Backpropagate the released partial losses of every pending batch, in order.

        All messages are decoded and checked first: a bad message raises
        :class:`ProtocolError` and leaves the party exactly as it was.
        """
        owed = sorted(self._pending)
        if not isinstance(blobs, (list, tuple)):
            raise ProtocolError(f"{self.name}: gradients from host: expected a list of messages, got "
                                f"{type(blobs).__name__}")
        if len(blobs) != len(owed):
            raise ProtocolError(f"{self.name}: {len(blobs)} gradient messages received, but owed for "
                                f"{[str(k) for k in owed]}")
        msgs = self._gradients_in_order(blobs, owed)
        if msgs is None:
            limit = frame_limit(self.schedule.batch_size, self.cut_shape)  # only training batches are owed
            msgs = [open_message(b, max_bytes=limit) for b in blobs]
            got = [m.key for m in msgs]
            if sorted(got) != owed or len(set(got)) != len(got):
                raise ProtocolError(f"{self.name}: gradients received for {[str(k) for k in got]}, "
                                    f"but owed for {[str(k) for k in owed]}")
            for m in msgs:
                m.check(kind="gradients", sender="host", receiver=self.name, key=m.key, ids=self.ids(m.key),
                        sample_shape=self.cut_shape, digest=self.digest(m.key), round_=self._pending[m.key].round)
        for m in msgs:  # bounded trust: within the host's public mechanism (before anything changes)
            self.trust.check("host", m.key, m.tensor, self._pending[m.key].round)
        for m in msgs:
            self.trust.record("host", m.key, m.tensor)
        cost = self.update.cost()
        charge = None
        if cost is not None and msgs:
            charge = self._charge([self._entry(-1 if round_ is None else round_, m.key, "update", cost) for m in msgs])
        digests: list[str] = []
        draws: list[int | None] = []
        for m in msgs:
            p = self._pending.pop(m.key)
            out = p.out if (p.out is not None and p.version == self.steps) else self._recompute(m.key)
            gen = self._gen("denoise") if self.grad_postprocess.random else None
            grad = self.grad_postprocess(m.tensor.to(self.device), gen)
            grad = self.mechanisms(m.key).local_grad(p.ctx, grad)
            self.update.zero_grad()
            self.update.backward(out, grad)
            if self.importance is not None:
                self.importance.update()
            d, c = self._step(cost is not None, charge is not None)
            self.steps += 1
            if charge is not None:
                digests.append(d)
                draws.append(c)
        self._settle(charge, digests, draws)

    def _gradients_in_order(self, blobs, owed: list[BatchKey]) -> list[Message] | None:
        """The fast path of :meth:`apply_gradients`: every blob is exactly the gradient message owed
        for the batch at its position (:func:`~fl_split.protocol.decode_expected`); ``None`` if any
        is not (the caller then decodes and checks each, and says what is wrong)."""
        msgs = []
        for b, k in zip(blobs, owed):
            m = receive_expected(b, kind="gradients", sender="host", receiver=self.name,
                                round_=self._pending[k].round, key=k, rows=len(self.schedule.positions(k)),
                                sample_shape=self.cut_shape, digest=self.digest(k))
            if m is None:
                return None
            msgs.append(m)
        return msgs

    def step(self, grad_blobs: list[bytes], keys, round_: int, in_process: bool = False) -> list[bytes]:
        """One round for this guest: apply the gradients it is owed, then release ``keys``
        (the request is checked first: a replayed round or a bad key changes nothing).
        ``in_process``: the host is in this process; release :class:`~fl_split.protocol.Handoff`
        messages instead of frames (``grad_blobs`` may be either)."""
        keys = self._request(keys, round_)
        self.apply_gradients(grad_blobs, round_)
        blobs = self.release(keys, round_, in_process)
        self._done(round_)
        return blobs

    def _recompute(self, key: BatchKey) -> torch.Tensor:
        """Forward ``key`` again with the current weights, leaving normalisation statistics
        untouched (they were already updated when the batch was first released)."""
        # the forward updates scratch copies of the buffers; the originals are put back by
        # reference (not copied in place: the new graph may have saved the scratch tensors)
        saved = [(m, name, buf) for m in self.bottom.modules() for name, buf in m.named_buffers(recurse=False)]
        for m, name, buf in saved:
            setattr(m, name, buf.clone())
        set_mode(self.bottom, True)
        try:
            return self.bottom(self.rows(key))
        finally:
            for m, name, buf in saved:
                setattr(m, name, buf)

    @property
    def pending_keys(self) -> list[BatchKey]:
        return sorted(self._pending)

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights, no secret)."""
        mech = self.mechanism
        dp = self.update.describe() if self.update.cost() is not None else None
        return {"role": "guest", "optimizer_steps": self.steps, "mechanism": mech.describe(),
                **self._allocation_report({"host": (mech, None)}),
                "postprocess": self.grad_postprocess.describe(), "released": dict(self.released),
                "privacy": party_privacy_report(role="guest", ledger=self.ledger, mechanism=mech, update=dp,
                                                released=self.released, cut_width=int(np.prod(self.cut_shape)),
                                                randomness=self.secret.source, aggregates=False,
                                                per_epoch=self.epsilons_per_epoch())}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            **self._common_state(),
            "model": self.bottom.state_dict(),
            "optimizer": self.update.state_dict(),
            "pending": [[list(k.as_tuple()), p.round, p.version, p.ctx] for k, p in sorted(self._pending.items())],
            "importance": self.importance.state_dict() if self.importance is not None else None,
            "diagnostics": self.diagnostics.state_dict(),
            **({} if self.secure_identity is None else  # --secure-merge: the pinned roster, the session
               {"secure": {"roster": {g: k.hex() for g, k in sorted(self.secure_roster.items())},
                           "session": None if self.secure is None else self.secure.state_dict()}}),
        }

    def import_state(self, state: dict[str, Any]) -> None:
        self._load_common(state)
        self.bottom.load_state_dict(state["model"])
        self.update.load_state_dict(state["optimizer"])
        self._pending = {BatchKey(str(k[0]), int(k[1]), int(k[2])): _Pending(int(r), int(v), dict(ctx), None)
                         for k, r, v, ctx in state["pending"]}
        if self.importance is not None:
            self.importance.load_state_dict(state["importance"])
        self.diagnostics.load_state_dict(state["diagnostics"])
        if state.get("secure") is not None and self.secure_identity is not None:
            from fl_split.privacy.secure_merge import MaskingGuest, SkellamShare

            self.secure_roster = {str(g): bytes.fromhex(k) for g, k in state["secure"]["roster"].items()}
            session = state["secure"]["session"]
            self.secure = None if session is None else MaskingGuest.from_state(self.name, self.secure_identity,
                                                                               self.secure_roster, session)
            mech = self.mechanisms()
            if self.secure is not None and isinstance(mech, SkellamShare):  # as secure_announce set it
                mech.active = len(self.secure.members)

