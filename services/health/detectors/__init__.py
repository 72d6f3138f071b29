"""Pure detectors of the health service: each reads domain records, takes the clock as an
argument, and returns `Incident`s. No I/O and no grpc/fastapi/redis/torch imports here."""

from fthsdp.services.health.detectors.config import DetectorConfig, FailSlowPolicy
from fthsdp.services.health.detectors.failstop import FailStopDetector

__all__ = ["DetectorConfig", "FailSlowPolicy", "FailStopDetector"]
