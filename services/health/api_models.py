"""The JSON shapes of the health service's HTTP API (`app.py`), as pydantic models: FastAPI
checks each response against its model and describes it in /openapi.json.

The responses are exactly what they were before they had models: every model keeps fields it
does not name (`extra="allow"`), nested shapes that are open stay `dict[str, Any]`, and numbers
are `Number` (a pydantic `float` would turn an int 5 into 5.0).

The detector settings are generated from `DetectorConfig` itself (its fields, defaults' types,
attribute docstrings, and the bounds of `_RANGES`), so the description cannot drift from what
`DetectorConfig.from_dict` accepts; that check stays the one validation of `PUT /v1/detectors`
(its status codes and error texts are the API's), `DetectorChanges` only describes its body."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model

from fthsdp.services.health.core import ReplicaState
from fthsdp.services.health.detectors.config import _RANGES, DetectorConfig, FailSlowPolicy
from fthsdp.services.health.detectors.failslow import Judgement
from fthsdp.services.health.telemetry import IncidentKind

Number = Annotated[int | float, WithJsonSchema({"type": "number"})]
"""A JSON number kept as it was computed (int or float)."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Replica(_Open):
    """One replica (`core.ReplicaView`)."""

    replica_id: str
    ranks: int = Field(description="How many of its ranks are known.")
    hosts: list[str] = Field(description="Hosts its ranks beat from, sorted.")
    last_step: int = Field(description="The highest step any rank reported (-1 before any).")
    state: ReplicaState
    last_seen: Number | None = Field(description="Its latest heartbeat (None: telemetry only).")
    fail_slow: Judgement = Field(description="What the fail-slow detector can say of it.")


class Node(_Open):
    """A node agent as the central service last heard from it (`service.NodeView`)."""

    node: str
    ranks: int
    last_seen: Number
    dropped: int = Field(description="Batches the agent dropped on the way here.")
    interval_s: Number | None = Field(description="The agent's forward cadence (None at first).")


class Replicas(_Open):
    """Every replica and node agent, on the engine's clock `now` (Unix seconds)."""

    now: Number
    replicas: list[Replica]
    nodes: list[Node]


class Incident(_Open):
    """One incident with its evidence (`client_codec.incident_to_json`)."""

    kind: IncidentKind
    replica_id: str
    rank: int | None
    host: str | None
    detected_at: Number
    summary: str
    evidence: dict[str, Any] = Field(description="The detector's evidence; its shape by kind.")


class Incidents(_Open):
    incidents: list[Incident] = Field(description="Newest first.")


class Records(_Open):
    records: list[dict[str, Any]] = Field(
        description="The newest telemetry records of the kind, newest first (`store.Record`)."
    )


class QuorumMember(_Open):
    replica_id: str
    incarnation: int
    step: int | None = Field(description="The last step it asked a quorum for (None: never).")
    live: bool
    last_seen_ago_s: Number


class Quorum(_Open):
    quorum_id: int
    round: int
    members: list[str]
    healthy: list[str]
    max_step: int
    reason: str
    formed_at: Number = Field(description="Unix seconds.")


class FailSlowDecision(_Open):
    """A change the quorum service's fail-slow planner made."""

    decided_at: Number = Field(description="Unix seconds.")
    step: int
    action: str = Field(description="keep, rebalance or evict.")
    shares: dict[str, int] = Field(description="Micro-steps per replica, where not the even share.")
    evicted: list[str]
    reason: str = Field(description="Why, with each option's predicted micro-steps per second.")


class QuorumHistory(_Open):
    """The quorum service's membership and recent quorums (`configured` false: no quorum
    service was given, and the rest is empty)."""

    configured: bool
    quorum_id: int
    members: list[QuorumMember]
    quorums: list[Quorum]
    failslow: list[FailSlowDecision] = Field(
        default_factory=list, description="The fail-slow planner's recent decisions, oldest first."
    )


class NodeRank(_Open):
    """A rank as its node agent sees it (`client_codec.NodeRank`)."""

    rank: dict[str, Any] = Field(description='{"replica_id", "rank"}')
    step: int
    silent_s: Number = Field(description="Seconds since the agent last heard from it.")
    process: str


class NodeStatus(_Open):
    """A node agent's state: its beating ranks and its forwarding counters."""

    node: str
    ranks: list[NodeRank]
    dropped: int
    forwarded: int


# ---- detector settings, from DetectorConfig ---------------------------------------------------

_OWN_RULES = {"slow_rank_min_fraction": {"exclusiveMinimum": 0.5, "maximum": 1.0}}
"""Bounds `DetectorConfig.__post_init__` checks outside `_RANGES`."""


def _attribute_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right after it in the class body)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): the schema goes without them
        return {}
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _setting_type(name: str, default: Any) -> Any:
    """The annotated type of one setting: its JSON type and bounds."""
    if isinstance(default, bool):
        return bool
    if name == "fail_slow_policy":
        return FailSlowPolicy
    if isinstance(default, int | float):
        integral = isinstance(default, int)
        base: Any = int if integral else int | float  # an int stays an int (see `Number`)
        bounds: dict[str, Any] = {"type": "integer" if integral else "number"}
        if name in _RANGES:
            bounds |= {"minimum": _RANGES[name][0], "maximum": _RANGES[name][1]}
        bounds |= _OWN_RULES.get(name, {})
        return Annotated[base, WithJsonSchema(bounds)]
    return type(default)


def _drop_defaults(schema: dict[str, Any]) -> None:
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)


def _settings_model(name: str, doc: str, *, partial: bool) -> type[BaseModel]:
    docs = _attribute_docs(DetectorConfig)
    defaults = DetectorConfig()
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(DetectorConfig):
        kind = _setting_type(f.name, getattr(defaults, f.name))
        described = (
            Field(default=None, description=docs.get(f.name))
            if partial
            else Field(description=docs.get(f.name))
        )
        fields[f.name] = (kind, described)
    config = (
        ConfigDict(extra="forbid", json_schema_extra=_drop_defaults)
        if partial
        else ConfigDict(extra="allow")
    )
    model: type[BaseModel] = create_model(name, __config__=config, __doc__=doc, **fields)
    return model


DetectorSettings = _settings_model(
    "DetectorSettings", "Every detector setting, as in force.", partial=False
)
DetectorChanges = _settings_model(
    "DetectorChanges",
    "Detector settings to change: the keys given override the current ones, the others stay. "
    "An unknown key, a value of the wrong type or out of its bounds, or a combination the "
    "detectors reject (collective_retention_s must exceed hang_timeout_s, "
    "slow_rank_min_samples must not exceed slow_rank_window, collective_groups_per_rank must "
    "not exceed collective_groups_total) is a 400 and changes nothing.",
    partial=True,
)
