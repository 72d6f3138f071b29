"""The health service: ranks' heartbeats and step telemetry in, root-cause verdicts out.

Modules by role (the same roles as the other services): `core` (pure detection state), `central`
(the central engine: feeds `core`, runs the detectors in `detectors/`, stores incidents, applies
the policies: evicts through the quorum service), `agent` (the node agent: finds its own ranks'
fail-stops, forwards the rest), `server` (the gRPC ingest wire) and `app` (the HTTP wire: API and
dashboard), `process` (one embeddable process, central or agent, assembled from those), `store`,
`config`, `__main__`. `client*` and `domain` are what a rank may import."""
