"""Quorum answers as bytes: the part every participant of a round shares, encoded once per round,
and the endpoints each caller needs on top (`MembersForm` and `QuorumResponse.endpoints` in
protos/quorum.proto).

A caller names the last quorum it holds (`known_quorum_id`). The answer lists every member unless
that is this very quorum (SAME: a few bytes), and carries the endpoints of the members the caller
needs (`Quorum.needed_by`: itself, its ring neighbours, its sources) except those it holds
already: its own ring in the known quorum, at the same incarnations, and under the same quorum
what the round before sent it (a recovering caller's sources change only when the healthy set
does). So a steady round costs O(1) bytes per caller, and a membership change O(replicas) small
entries to each caller plus the endpoints of the new neighbours of the few callers whose
neighbours changed: never replicas x ranks endpoints to anyone.

A caller that does not hold what this assumes (it missed a round) finds a needed member without
endpoints, and asks again naming no quorum (`QuorumDecodeCache.decode`): everything it needs."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.core import Formation
from fthsdp.services.quorum.domain import Member, Quorum, ring_of

log = logging.getLogger(__name__)

_REMEMBERED_QUORUMS = 16
"""Quorums whose membership is kept to answer callers that name one as known (a caller lagging
further behind gets its whole neighbourhood again)."""
_ENCODED_ROUNDS = 32
_ENCODED_MEMBERS = 1 << 16
"""Members whose encoded endpoints are kept (a job's replicas and their recent incarnations)."""


@dataclass(frozen=True, slots=True)
class _Ring:
    """An answered quorum's membership: what a caller naming it holds."""

    ids: tuple[str, ...]
    """Member replica ids, sorted (the ring order)."""
    incarnations: tuple[int, ...]
    """Their incarnations, in the same order."""

    def incarnation(self, replica_id: str) -> int | None:
        index = bisect.bisect_left(self.ids, replica_id)
        if index < len(self.ids) and self.ids[index] == replica_id:
            return self.incarnations[index]
        return None


class Answers:
    """Encodes the answers of formed rounds (one per server; its event loop only)."""

    def __init__(self) -> None:
        self._shared: dict[tuple[int, int, int], bytes] = {}
        """(leader epoch, round) and form -> the shared part of that round's answers."""
        self._rings: dict[int, _Ring] = {}
        """Quorum id -> its membership, for the last few quorums answered."""
        self._distrusted: set[int] = set()
        """Quorum ids seen naming two memberships: no caller naming one holds what it says."""
        self._round: tuple[int, int] | None = None
        """The newest (leader epoch, round) answered."""
        self._before: Quorum | None = None
        """The round before it, when of the same quorum id: what its callers were sent."""
        self._now: Quorum | None = None
        self._encoded_endpoints: dict[tuple[str, int], bytes] = {}
        """(replica id, incarnation) -> its endpoints as an answer part."""

    def encode(self, formation: Formation, *, caller: str, known: int, epoch: int) -> bytes:
        """The answer to `caller`, a participant of `formation` holding quorum `known`."""
        quorum = formation.quorum
        before = self._enter(formation, epoch)
        same = known == quorum.quorum_id and known not in self._distrusted
        form = codec.SAME if same else codec.FULL
        key = (epoch, formation.record.round, form)
        shared = self._shared.get(key)
        if shared is None:
            if len(self._shared) >= _ENCODED_ROUNDS:
                self._shared.clear()
            message = codec.quorum_to_pb(quorum, form=form)
            message.leader_epoch = epoch
            shared = self._shared[key] = message.SerializeToString()
        if same:
            # Its ring in this quorum, and what the round before sent it (its sources move only
            # when the healthy set does).
            held = set(quorum.ring_of(caller))
            if before is not None:
                held.update(before.needed_by(caller))
        else:
            ring = None if known in self._distrusted else self._rings.get(known)
            held = _ring_held(ring, quorum, caller)
        needed = [rid for rid in quorum.needed_by(caller) if rid not in held]
        return b"".join([shared, *(self._endpoints(quorum.member(rid)) for rid in needed)])

    def _endpoints(self, member: Member) -> bytes:
        """The member's endpoints, encoded once per incarnation: the callers that need them
        get the same bytes (at 8,192 ranks a member's endpoints take ~30 ms to encode)."""
        key = (member.replica_id, member.incarnation)
        data = self._encoded_endpoints.get(key)
        if data is None:
            if len(self._encoded_endpoints) >= _ENCODED_MEMBERS:
                self._encoded_endpoints.clear()
            data = self._encoded_endpoints[key] = codec.endpoints_to_pb(member)
        return data

    def _enter(self, formation: Formation, epoch: int) -> Quorum | None:
        """Notes a round at its first answer; returns the round before it when that had the
        same quorum id (None for any other, or for a late answer to an older round). Records the
        membership of each quorum id once: a quorum id names one membership (I3), and a
        violation costs its callers a FULL answer rather than trust in endpoints of another
        incarnation."""
        key = (epoch, formation.record.round)
        quorum = formation.quorum
        if key == self._round:
            return self._before
        if self._round is not None and key < self._round:
            return None
        same_id = self._now is not None and self._now.quorum_id == quorum.quorum_id
        self._round, self._before, self._now = key, self._now if same_id else None, quorum
        members = formation.record.members
        current = _Ring(
            ids=tuple(rid for rid, _ in members), incarnations=tuple(inc for _, inc in members)
        )
        recorded = self._rings.get(quorum.quorum_id)
        if recorded is not None and recorded != current:
            log.error(
                "quorum id %d names two memberships; answering its callers in full",
                quorum.quorum_id,
            )
            self._distrusted.add(quorum.quorum_id)
            self._before = None
        self._rings[quorum.quorum_id] = current
        while len(self._rings) > _REMEMBERED_QUORUMS:
            del self._rings[next(iter(self._rings))]
        return self._before


def _ring_held(known: _Ring | None, quorum: Quorum, caller: str) -> set[str]:
    """The members of `quorum` whose endpoints `caller` holds, holding quorum `known`: its ring
    there (itself and its neighbours), those still members at the same incarnation. Sources it
    may hold as well are not counted: they are sent again."""
    if known is None or known.incarnation(caller) is None:
        return set()
    return {
        rid
        for rid in ring_of(known.ids, caller)
        if quorum.is_member(rid) and quorum.member(rid).incarnation == known.incarnation(rid)
    }
