"""``GuestParty`` and ``HostParty``: the trust boundary.

A party is the unit of trust (design principle 1, ``docs/references.md``): its data, models,
optimizer, secret and ledger never leave the object; what leaves is a :mod:`fl_split.protocol`
blob produced by its mechanism and charged to its ledger first, and — for the host — per-epoch
aggregate metrics declared in its privacy report. A party is given exactly what it needs (its
data slice, the public batch schedule, its own modules wrapped in a local-update policy, its
mechanisms, its :class:`~fl_split.seeding.PartySecret`, its ledger and the public sample rate);
it never reads the run configuration. The same classes run under the in-process
:class:`~fl_split.engine.LocalEngine` and inside Flower ClientApps; a party's whole state can be
exported and restored (:meth:`export_state`), which is how a Flower node keeps it in
``context.state`` between messages.

Per batch (spec §2):

1. guest ``g``: ``v_g = bottom_g(x_g[b])``, releases ``ã_g = M_fwd(v_g)``;
2. host: ``z = merge(a_h, ã_1 … ã_G)``, ``ŷ = top(z)``, loss ``L(ŷ, y[b])``; backward; for each guest
   ``δ_g = ∂L/∂ã_g`` is released as ``δ̃_g = M_bwd(δ_g)``; the host steps its optimizer;
3. guest ``g`` backpropagates ``δ̃_g`` through its mechanism's local derivative and its bottom,
   and steps.

A guest may release several batches before their gradients come back (``batches_per_round >
1``). It then applies the gradients in order, each to a forward recomputed with its *current*
weights (FedBCD-style local updates). With one batch per round the weights have not moved in
between and the kept autograd graph is used directly: exact sequential training.

Every random draw of a party comes from its secret, keyed by purpose and a **draw counter** that
only increases (``secret.torch_generator("release", counter)``; :meth:`_Party._draw`): unpredictable
to every other party, reproducible with ``--private-seed`` (same run, same requests ⇒ same
counters ⇒ same numbers, on every transport), and continued exactly by a restored party (the
counter is part of its exported state). A party never draws the same noise twice: were draws keyed
by the batch, a peer that asks for one batch again would get the same noise twice and subtract it
(issue 16). **A repeated request** for a released batch — a test batch asked again, or a training
batch asked again after its gradient came back (one that awaits its gradient is refused) — is
released again with fresh, independent noise, charged to the ledger as another release of those
records (so ``--budget`` bounds the repetitions), and one warning names the batch and how often it
was released (``docs/accounting.md``, "Threat model"). A guest releases one *test* batch at most
``--max-test-requests`` times (default 1): a request beyond that is refused before anything is
charged or drawn (issue 25).

**Resume.** A party restored from a checkpoint re-makes the releases its write-ahead log recorded
after it. A re-made release may use the counter the log recorded for it only when its value is
bit-identical to the logged one (nothing new leaves: not charged again); otherwise the value made
with the old counter is discarded, never sent, and the release is drawn with a counter beyond every
one the log ever recorded, and charged (:meth:`_Party.resume_draws`). No counter is ever used for
two different released values. From that floor on every draw is also keyed by a fresh salt of the
resume (OS entropy), so a log restored from an older copy cannot make the party repeat noise it
released after that copy (issue 25; the counters the old log records keep their keys). DP-SGD steps follow the same rule (a step whose parameters differ
from the logged ones is undone and taken again with a fresh counter).

**Hostile peers** (``docs/robustness.md``). Before any state changes a party checks a request and
every message in it: the request's round follows the last one it handled (a replayed or stale
request is refused), its batch keys exist in the schedule, are unique and of the expected phase;
each frame is no larger than the receiver expects, decodes, and is exactly the expected message
(kind, sender, receiver, batch and its digest, round, per-sample shape, float32, every value finite
and within ``protocol.MAX_ABS``). Any violation raises :class:`~fl_split.errors.ProtocolError`
naming the peer, and the party's models, optimizer, secret, pending batches and ledger are as
before. The host does not update on a batch whose loss is not finite.

**Bounded trust** (issue 16, :mod:`fl_split.privacy.bounds`). A well-formed message can still hold
values the sender's mechanism cannot produce (a guest multiplying its releases by 1,000). Each
receiver knows its peer's mechanism from the public configuration and checks every release against
its public range (or, with no defence, the peer's running scale) right after the protocol checks,
before any state changes; a violation raises :class:`~fl_split.errors.ReleaseOutOfRange` naming the
sender, the statistic and the bound. Receiver-side denoising runs after the check.

**Write-ahead releases.** When the party's ledger has a write-ahead log (``--checkpoint-dir``) the
party settles every charge before the values leave (:meth:`Ledger.settle
<fl_split.privacy.ledger.Ledger.settle>`): a digest of each released message — for a DP-SGD step,
of the parameters after it — goes to the log, fsynced (``fl_split.checkpoint``).

The code lives in four modules: :mod:`~fl_split.parties.base` (what both roles share),
:mod:`~fl_split.parties.guest`, :mod:`~fl_split.parties.host` and :mod:`~fl_split.parties.schedule`
(mechanism schedules and R3eLU's importance allocation).
"""

from fl_split.parties.base import HIT_AT, batch_metric, export_flat, import_flat, resolve_device, set_mode
from fl_split.parties.guest import GuestParty
from fl_split.parties.host import HostParty
from fl_split.parties.schedule import Importance, MechanismSchedule

__all__ = ["HIT_AT", "GuestParty", "HostParty", "Importance", "MechanismSchedule", "batch_metric", "export_flat",
           "import_flat", "resolve_device", "set_mode"]
