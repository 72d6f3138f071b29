"""Arbitrary `state_dict()` trees as named tensors plus one JSON document, never pickle.

A user's stateful objects (an LR scheduler, a GradScaler, RNG state, a data loader's state) travel
with catch-up and durable checkpoints next to the model. Their trees are split at the tensors:
each tensor goes out as raw bytes under its own name, and the rest of the tree becomes JSON with a
reference where a tensor was. Values JSON cannot say exactly are tagged, so a tree comes back as
it went in: tuples (`random.getstate()`), dicts with non-string keys, and dict keys that start
with `$`. Anything else (a function, a module, a numpy array) is refused with a `TypeError` that
names the key, when the tree is encoded, never later on the receiving side."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

MAX_DOCUMENT_BYTES = 16 << 20
"""Bound on a received state document, checked before parsing."""
MAX_DEPTH = 64
"""Bound on nesting, on both sides (a cycle or a hostile document fails fast)."""

_TENSOR = "$tensor"
_TUPLE = "$tuple"
_DICT = "$dict"
_FLOAT = "$float"
_KEY_TYPES = (str, int, float, bool, type(None))


class _Encoder:
    def __init__(self, prefix: str, dtypes: Collection[torch.dtype] | None) -> None:
        self.prefix = prefix
        self.dtypes = dtypes
        self.tensors: dict[str, torch.Tensor] = {}

    def value(self, value: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state {path} nests deeper than {MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            # JSON has no NaN or infinities; repr() round-trips every float exactly.
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, torch.Tensor):
            if self.dtypes is not None and value.dtype not in self.dtypes:
                raise TypeError(
                    f"state {path} is a {value.dtype} tensor, which the state format does not "
                    f"carry; convert it to one of {sorted(str(d) for d in self.dtypes)}"
                )
            name = f"{self.prefix}{len(self.tensors)}"
            self.tensors[name] = value.detach()
            return {_TENSOR: name}
        if isinstance(value, list):
            return [self.value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {_TUPLE: [self.value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            return self.mapping(value, path, depth)
        raise TypeError(
            f"state {path} is a {type(value).__name__}: only tensors and JSON values (None, bool, "
            "int, float, str, lists, tuples, dicts) can travel with a replica's state"
        )

    def mapping(self, value: Mapping[Any, Any], path: str, depth: int) -> Any:
        plain = all(isinstance(k, str) and not k.startswith("$") for k in value)
        if plain:
            return {k: self.value(v, f"{path}[{k!r}]", depth + 1) for k, v in value.items()}
        pairs = []
        for key, item in value.items():
            if not isinstance(key, _KEY_TYPES):
                raise TypeError(f"state {path} has a key of type {type(key).__name__}: {key!r}")
            pairs.append(
                [self.value(key, path, depth + 1), self.value(item, f"{path}[{key!r}]", depth + 1)]
            )
        return {_DICT: pairs}


def encode_tree(
    value: Any, *, prefix: str, name: str, dtypes: Collection[torch.dtype] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """`value` as a JSON-ready tree and the tensors it references (named `<prefix><n>`); the
    tensors are the caller's (not copied). `name` labels errors; `dtypes`, if given, are the only
    tensor dtypes accepted."""
    encoder = _Encoder(prefix, dtypes)
    return encoder.value(value, repr(name), 0), encoder.tensors


def decode_tree(tree: Any, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    """The value `encode_tree` produced `tree` from; tensors come from `tensors` by name."""
    if depth > MAX_DEPTH:
        raise ValueError(f"state document nests deeper than {MAX_DEPTH} levels")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [decode_tree(v, tensors, depth + 1) for v in tree]
    if not isinstance(tree, dict):
        raise ValueError(f"unexpected {type(tree).__name__} in a state document")
    if len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag == _TENSOR:
            if not isinstance(body, str) or body not in tensors:
                raise ValueError(f"state document references a missing tensor {body!r}")
            # A compact copy: received tensors are views into one fetch buffer, and some
            # consumers read storage from its start (torch.set_rng_state ignores the offset).
            return tensors[body].clone()
        if tag == _TUPLE:
            return tuple(decode_tree(_list(body), tensors, depth + 1))
        if tag == _FLOAT:
            if body not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad non-finite float {body!r}")
            return float(body)
        if tag == _DICT:
            out = {}
            for pair in _list(body):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ValueError("a tagged dict holds [key, value] pairs")
                key = decode_tree(pair[0], tensors, depth + 1)
                if not isinstance(key, _KEY_TYPES):
                    raise ValueError(f"bad key in a state document: {key!r}")
                out[key] = decode_tree(pair[1], tensors, depth + 1)
            return out
    if any(isinstance(k, str) and k.startswith("$") for k in tree):
        raise ValueError(f"unknown tag in a state document: {sorted(tree)}")
    return {k: decode_tree(v, tensors, depth + 1) for k, v in tree.items()}


def _list(body: Any) -> list[Any]:
    if not isinstance(body, list):
        raise ValueError("a tagged value must hold a list")
    return body


def document_tensor(document: Any) -> torch.Tensor:
    """A JSON document as a uint8 tensor, so it travels checksummed with the other tensors
    (snapshot metadata is bounded to short strings)."""
    raw = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise ValueError(
            f"replicated state document is {len(raw)} bytes (limit {MAX_DOCUMENT_BYTES})"
        )
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


def read_document(tensor: torch.Tensor) -> Any:
    """Parses a document written by `document_tensor` (received from a peer or a checkpoint)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError("a state document must be a 1-d uint8 tensor")
    if tensor.numel() > MAX_DOCUMENT_BYTES:
        raise ValueError("replicated state document too large")
    try:
        return json.loads(tensor.cpu().numpy().tobytes(), parse_constant=_no_constants)
    except RecursionError as exc:
        raise ValueError("replicated state document nests too deeply") from exc


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} in a state document (non-finite floats are tagged)")
