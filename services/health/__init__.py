"""fthsdp health service (planned: see the health issue)."""
