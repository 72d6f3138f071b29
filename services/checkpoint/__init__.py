"""The checkpoint service: a per-host sidecar serving peer snapshots, writing durable checkpoints.

Training ranks never host a server. A rank copies its state once into a file in shared memory and
registers it with the sidecar on its host (`client.SnapshotPublisher`); the sidecar checksums it in
its own process and serves it over HTTP range requests, so a healthy replica never stalls while a
recovering one fetches (`client.fetch_snapshot`). The same sidecar persists snapshots as durable
checkpoints (a manifest with checksums + raw bytes, never pickle) and records data positions.

Modules named `client*` are everything a training process may import (the import rules of
DESIGN.md); the server modules (`app`, `server`, `core`, `snapshots`, `durable`, `store`) never
import torch, so the sidecar starts fast and stays small."""
