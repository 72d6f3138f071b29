"""The Manager's cross-replica ring: its settings under a Manager, the bound of one exchange,
the endpoints a replica publishes, and rebuilding the ring for a step's plan."""

from __future__ import annotations

import dataclasses

from fthsdp.services.quorum.client import RankEndpoint
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.ftar import FtarAbortedError, FtarConfig, FtarRing
from fthsdp.worker.ftar.auth import ring_key
from fthsdp.worker.notice_relay import NoticeRelay, relay_for
from fthsdp.worker.plan import StepPlan
from fthsdp.worker.replica_group import ReplicaGroup
from fthsdp.worker.ring_watch import RingWatch


def ring_config(config: ManagerConfig, ftar: FtarConfig | None) -> FtarConfig:
    """The ring's settings under a Manager: its rings admit only ranks of this job (a key from
    the token), and one exchange bound holds, `ManagerConfig.exchange_timeout`, so no ring
    exchange runs on after the step gave up on it."""
    ftar = ftar or FtarConfig()
    bound = config.exchange_timeout
    if ftar.exchange_timeout not in (bound, FtarConfig().exchange_timeout):
        raise ValueError(
            "the exchange bound is ManagerConfig.exchange_timeout; leave "
            "FtarConfig.exchange_timeout unset under a Manager"
        )
    return dataclasses.replace(
        ftar,
        auth_key=ftar.auth_key or ring_key(config.token),
        exchange_timeout=bound,
        chunk_timeout=min(ftar.chunk_timeout, bound),
    )


def exchange_timeout(config: ManagerConfig, plan: StepPlan) -> float:
    """The configured bound, or on a step trained without the quorum service twice the grace
    plus half a second: every member that also went on without the service decided within about
    one grace of the others, so a longer wait means some member is waiting on the service
    instead (or is dead) and this step cannot commit."""
    grace = config.control_plane_grace
    if plan.fallback and grace is not None:
        return 2 * grace.total_seconds() + 0.5
    return config.exchange_timeout.total_seconds()


def ensure_ring(ring: FtarRing, watch: RingWatch, plan: StepPlan, replica_id: str) -> None:
    """Rebuilds `ring` for `plan` unless it is already that quorum's and intact. A plan that
    holds a replica the watch saw evicted after the plan formed is doomed: raising here spares
    waiting for a neighbour that is not coming."""
    if ring.epoch == plan.quorum_id and not ring.broken:
        return
    gone = watch.gone_from(plan)
    if gone is not None:
        raise FtarAbortedError(
            f"ring member {gone} was evicted after quorum {plan.quorum_id} formed"
        )
    position = plan.ring_replicas.index(replica_id)
    ring.reconfigure(list(plan.ring), position, plan.quorum_id)


def gather_endpoints(
    group: ReplicaGroup, ring_address: str, config: ManagerConfig
) -> tuple[NoticeRelay | None, list[RankEndpoint], list[str]]:
    """This rank's notice relay (None for a leaf; on the ring's host), then every rank's
    endpoints and relay address ("" for a leaf): a collective."""
    host = ring_address.rpartition(":")[0]
    relay = relay_for(group.rank, group.world_size, host, config.token)
    mine = f"{ring_address}|{config.checkpoint_url}|{relay.address if relay else ''}".encode()
    endpoints, relays = [], []
    for raw in group.all_gather_bytes(mine):
        ftar, _, rest = raw.decode().partition("|")
        checkpoint, _, relay_address = rest.rpartition("|")
        endpoints.append(RankEndpoint(ftar=ftar, checkpoint=checkpoint))
        relays.append(relay_address)
    return relay, endpoints, relays
