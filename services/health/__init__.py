"""The health service: ranks' heartbeats and step telemetry in, root-cause verdicts out.

A node agent per host (`agent`) detects fail-stops of its own ranks and forwards the rest to the
central engine (`service`, its detectors in `detectors/`), which names hangs, slow ranks,
fail-slow replicas and silent data corruption, evicts through the quorum service, and serves
the HTTP API and the dashboard (`app`). Modules named `client*` are what a rank may import."""
