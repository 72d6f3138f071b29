"""A quorum answer as the service builds one for a caller (`services/quorum/answers.py`), given
what the caller holds: for the codec and decode-cache tests, which choose `held` themselves."""

from __future__ import annotations

from collections.abc import Collection

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.domain import Quorum


def answer(
    quorum: Quorum, caller: str, form: codec.MembersForm, held: Collection[str] = ()
) -> pb.QuorumResponse:
    """The shared part, then the endpoints `caller` needs and does not hold (encoded, then
    parsed)."""
    parts = [codec.quorum_to_pb(quorum, form=form).SerializeToString()]
    parts += [
        codec.endpoints_to_pb(quorum.member(rid))
        for rid in quorum.needed_by(caller)
        if rid not in held
    ]
    return pb.QuorumResponse.FromString(b"".join(parts))
