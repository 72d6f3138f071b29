"""fthsdp: fault-tolerant hybrid-sharded data-parallel training, replicas as the unit of failure."""
