"""What the replica leader tells its ranks after each quorum, and each rank's view of it.

The leader sends the quorum as canonical JSON (never pickle); every rank validates it and
derives its own `StepPlan`: its ring (rank i of every member, the addresses of its neighbours),
the contributors, its sources."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fthsdp.services.quorum.client import MicroSteps, Quorum

_MAX_PAYLOAD_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """A healthy replica this rank may fetch state from."""

    replica_id: str
    """The source replica."""
    url: str
    """The checkpoint sidecar serving that replica's rank of the same index."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """One quorum, seen from one rank."""

    quorum_id: int
    """The epoch: a new value means the ring must be rebuilt."""
    max_step: int
    """The step the healthy replicas are at; this replica trains it or catches up to it."""
    ring: tuple[str, ...]
    """FTAR addresses of this rank's ring (rank i of every member), in ring order: its own and
    its neighbours', "" for the members it never connects to (see `FtarRing.reconfigure`)."""
    ring_replicas: tuple[str, ...]
    """The replica at each ring position."""
    healthy: tuple[str, ...]
    """Replicas at max_step: the contributors of this step's gradient."""
    sources: tuple[Source, ...]
    """For a recovering replica: where this rank fetches state, in preference order."""
    serve: bool
    """Whether this replica is a source for some recovering replica (publish a snapshot)."""
    fallback: bool = False
    """The leader could not reach the quorum service and reused the previous quorum for this
    step (see `fallback_payload`); its exchange gets a short timeout."""
    micro_steps: MicroSteps = field(default_factory=MicroSteps)
    """Micro-steps each member trains in this step and its next (fail-slow mitigation)."""

    @property
    def num_healthy(self) -> int:
        """How many replicas contribute to this step's gradient."""
        return len(self.healthy)

    @property
    def total_micro_steps(self) -> int:
        """Micro-steps the healthy replicas train together in this step."""
        return self.micro_steps.total(self.healthy)

    def left_of(self, replica_id: str) -> str | None:
        """The replica whose rank sends to `replica_id`'s in this ring; None alone or absent."""
        if len(self.ring_replicas) < 2 or replica_id not in self.ring_replicas:
            return None
        return self.ring_replicas[self.ring_replicas.index(replica_id) - 1]

    def gradient_scale(self) -> float:
        """What the exchanged gradient (summed over the healthy replicas, divided by their
        number) is multiplied by so that every micro-step weighs the same: 1.0 for an even
        split of one micro-step each."""
        total = self.total_micro_steps
        return 1.0 if total in (0, self.num_healthy) else self.num_healthy / total


def encode_quorum(quorum: Quorum, replica_id: str) -> bytes:
    """The leader's broadcast: the quorum as this replica needs it."""
    serves = replica_id in quorum.healthy and any(
        replica_id in ids for per_rank in quorum.sources.values() for ids in per_rank
    )
    body: dict[str, Any] = {
        "quorum_id": quorum.quorum_id,
        "max_step": quorum.max_step,
        # Every member, with the endpoints of the few this replica needs (itself, its ring
        # neighbours, its sources): the quorum service sends no others.
        "members": [
            {"replica_id": m.replica_id, "ranks": [[r.ftar, r.checkpoint] for r in m.ranks]}
            for m in quorum.members
        ],
        "healthy": list(quorum.healthy),
        "sources": [list(ids) for ids in quorum.sources.get(replica_id, ())],
        "serve": serves,
    }
    micro = quorum.micro_steps
    if micro != MicroSteps():
        body["micro_steps"] = {
            "even": micro.even,
            "trained": dict(micro.trained),
            "next": dict(micro.next),
        }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_failure(error: str) -> bytes:
    """The leader's broadcast when it has no quorum to offer: every rank raises."""
    return json.dumps({"error": error or "no quorum"}).encode()


_STEP_KEY = b'"max_step":'


def _split_at_step(payload: bytes) -> tuple[bytes, int, bytes] | None:
    """(everything up to the step's digits, the step, what follows) of an encoded quorum; None for
    anything else. The first `"max_step":` is the top-level key: inside a JSON string every quote is
    escaped, and no nested object has that key."""
    at = payload.find(_STEP_KEY)
    if at < 0:
        return None
    start = end = at + len(_STEP_KEY)
    while end < len(payload) and 48 <= payload[end] <= 57:  # ASCII digits
        end += 1
    if end == start:
        return None
    return payload[:start], int(payload[start:end]), payload[end:]


def steady_max_step(previous: bytes | None, payload: bytes) -> int | None:
    """The new `max_step` if `payload` repeats `previous` in everything but it (the steady
    state: same quorum, same members, the step moved on), else None. Then the leader broadcasts
    only that number and every rank reuses its previous plan with it. A byte comparison: at
    98K ranks a plan is megabytes, and parsing two of them took ~0.1 s a step."""
    if previous is None:
        return None
    old, new = _split_at_step(previous), _split_at_step(payload)
    if old is None or new is None or old[0] != new[0] or old[2] != new[2]:
        return None
    return new[1]


def encode_steady(previous: tuple[Quorum, bytes] | None, quorum: Quorum, replica_id: str) -> bytes:
    """`encode_quorum`, reusing the previous (quorum, payload) when only the step moved on: the
    same quorum id (so the same members), the same healthy replicas, nobody recovering."""
    if previous is not None:
        last, payload = previous
        parts = _split_at_step(payload)
        if (
            parts is not None
            and last.quorum_id == quorum.quorum_id
            and last.healthy == quorum.healthy
            and last.micro_steps == quorum.micro_steps
            and not last.sources
            and not quorum.sources
        ):
            return parts[0] + str(quorum.max_step).encode() + parts[2]
    return encode_quorum(quorum, replica_id)


def fallback_payload(plan: StepPlan | None, sent: bytes | None, step: int) -> bytes | None:
    """The payload for training `step` without the quorum service, if that is safe; `plan` and
    `sent` are the replica's last plan and the last payload its leader broadcast in full.

    Only in the steady state: the previous step committed on a quorum whose members were all
    healthy (nobody recovering or serving), and this replica is at its next step. Then every
    member that also cannot reach the service takes the same plan: the same ring epoch, the
    same members, the step after. A commit needs every member of that ring to finish the same
    exchange, so it happens only if all of them went on together, which keeps the replicas
    identical (I1). A member that died, or one that did reach the service and got a new epoch,
    breaks the ring: the exchange fails, nothing commits, and the replica waits for the service
    as before. A minority cut off from the others can therefore never commit on its own (I6),
    and no new epoch is ever made up locally (I3): membership changes still need the service.
    Members that reached the service meanwhile wait there for the ones that went on without it:
    such a mixed step cannot commit, so its exchange is cut short (`manager_ring.exchange_timeout`)
    and the replica asks the service like after any failed step."""
    if plan is None or sent is None:
        return None
    steady = (
        len(plan.healthy) == len(plan.ring_replicas)
        and not plan.sources
        and not plan.serve
        and step == plan.max_step + 1
    )
    if not steady:
        return None
    body = json.loads(sent)
    body["max_step"] = step
    body["fallback"] = True
    micro = body.get("micro_steps")
    if micro is not None:  # every member trains what the last answer planned for this step
        micro["trained"] = micro["next"]
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class NoQuorumError(RuntimeError):
    """The replica leader could not obtain a quorum; the replica stops."""


def decode_plan(payload: bytes, *, replica_id: str, rank: int) -> StepPlan:
    """Validates the leader's broadcast and derives this rank's plan."""
    if len(payload) > _MAX_PAYLOAD_BYTES:
        raise ValueError("step plan too large")
    raw = json.loads(payload)
    if not isinstance(raw, dict):
        raise ValueError("a step plan must be a JSON object")
    if raw.get("error"):
        raise NoQuorumError(str(raw["error"]))
    try:
        return _plan(raw, replica_id=replica_id, rank=rank)
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"malformed step plan: {exc!r}") from exc


def _plan(raw: dict[str, Any], *, replica_id: str, rank: int) -> StepPlan:
    members = raw["members"]
    # "" for a member whose endpoints this replica was not sent: not its neighbour, not a source.
    ring = tuple(str(m["ranks"][rank][0]) if m["ranks"] else "" for m in members)
    ring_replicas = tuple(str(m["replica_id"]) for m in members)
    urls = {str(m["replica_id"]): str(m["ranks"][rank][1]) for m in members if m["ranks"]}
    mine = raw["sources"][rank] if raw["sources"] else []
    plan = StepPlan(
        quorum_id=int(raw["quorum_id"]),
        max_step=int(raw["max_step"]),
        ring=ring,
        ring_replicas=ring_replicas,
        healthy=tuple(str(r) for r in raw["healthy"]),
        sources=tuple(Source(replica_id=str(r), url=urls[str(r)]) for r in mine),
        serve=bool(raw["serve"]),
        fallback=raw.get("fallback") is True,
        micro_steps=_micro_steps(raw.get("micro_steps")),
    )
    if plan.max_step < 0 or plan.quorum_id < 0 or replica_id not in ring_replicas:
        raise ValueError("a step plan must include this replica and carry non-negative ids")
    me = ring_replicas.index(replica_id)
    if not all(ring[i % len(ring)] for i in (me - 1, me, me + 1)):
        raise ValueError("a step plan must carry this rank's and its ring neighbours' endpoints")
    return plan


def _micro_steps(raw: Any) -> MicroSteps:
    if raw is None:
        return MicroSteps()
    even = int(raw["even"])

    def shares(name: str) -> MappingProxyType[str, int]:
        table = raw[name]
        if not isinstance(table, dict):
            raise TypeError(f"micro_steps.{name} must be an object")
        return MappingProxyType({str(r): int(k) for r, k in table.items()})

    trained, upcoming = shares("trained"), shares("next")
    if even < 1 or any(k < 0 for k in (*trained.values(), *upcoming.values())):
        raise ValueError("micro-step shares must be non-negative and the even one positive")
    return MicroSteps(even=even, trained=trained, next=upcoming)
