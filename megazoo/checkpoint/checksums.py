"""Checksums of tensor bytes: which hash, computed how, and the name megazoo.json records.

    algorithm = default_algorithm()          # "xxh3_64" with xxhash installed, else "crc32"
    digest(raw, algorithm)                   # hex string, what megazoo.json stores per tensor
    check_algorithm(algorithm, where)        # ValueError if this install cannot compute it

megazoo.json names the hash in its "checksum" field and keeps the values under
`values_key(algorithm)`: CRC-32 under "checksums", the key older checkpoints use, xxh3 under
"checksums_xxh3_64", so a megazoo that knows only CRC-32 loads a new checkpoint unchecked
instead of calling every tensor corrupted. xxh3_64 (the optional `xxhash` package) is several
times faster than CRC-32 (zlib) and fast enough to hide beside the file I/O; CRC-32 is the
fallback. Both release the GIL while hashing a large buffer.
"""
from __future__ import annotations

import zlib

try:
    import xxhash
except ImportError:  # optional: CRC-32 is the fallback
    xxhash = None

CRC32, XXH3 = "crc32", "xxh3_64"
ALGORITHMS = (XXH3, CRC32)


def values_key(algorithm: str) -> str:
    """The megazoo.json key holding the checksums of `algorithm`."""
    return "checksums" if algorithm == CRC32 else f"checksums_{algorithm}"


def default_algorithm() -> str:
    """The hash new checkpoints record: xxh3_64 where xxhash is installed, else crc32."""
    return XXH3 if xxhash is not None else CRC32


def check_algorithm(algorithm: str, where: str) -> None:
    """ValueError naming `where` (the checkpoint) if this install cannot verify `algorithm`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where} records {algorithm!r} checksums, which this megazoo does not "
                         f"know ({', '.join(ALGORITHMS)}): update megazoo, or skip the check "
                         f"with --no-verify-checksums (verify_checksums=False)")
    if algorithm == XXH3 and xxhash is None:
        raise ValueError(f"{where} records xxh3_64 checksums and the xxhash package is not "
                         f"installed: pip install xxhash, or skip the check with "
                         f"--no-verify-checksums (verify_checksums=False)")


class Hasher:
    """Incremental checksum: `update(buf)` over consecutive pieces, then `hexdigest()`, equal
    to `digest` of the pieces joined (both hashes are defined to stream)."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self._xxh = xxhash.xxh3_64() if algorithm == XXH3 else None
        self._crc = 0

    def update(self, buf) -> None:
        if self._xxh is not None:
            self._xxh.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def hexdigest(self) -> str:
        return f"{self._xxh.intdigest():016x}" if self._xxh is not None else f"{self._crc:08x}"


def digest(raw, algorithm: str) -> str:
    """Hex checksum of the buffer `raw` (8 digits for crc32, 16 for xxh3_64)."""
    if algorithm == XXH3:
        return f"{xxhash.xxh3_64_intdigest(raw):016x}"
    if algorithm == CRC32:
        return f"{zlib.crc32(raw):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use one of {ALGORITHMS}")
