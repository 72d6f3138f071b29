"""CRC-32 (the zlib polynomial), as fast as available: every checksum of the snapshot format, and
the state digest ranks send the health service (`worker.state.state_digest`).

ISA-L's implementation (the `isal` package, PCLMUL-based) gives the same values as `zlib.crc32`
at many times the speed: on the 2-core dev box 57 GB/s over cached data and 25 GB/s from memory,
against zlib's 4 GB/s. The fetcher's end-to-end check is the one pass over the bytes a raw copy
does not make. Both release the GIL over large buffers. `isal` is a dependency; where it is
missing (an image built without it), zlib gives the same values, slower."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # zlib computes the same values, slower
    from zlib import crc32

__all__ = ["crc32"]
