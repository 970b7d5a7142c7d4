"""Seeded permutations that never change: the same on every machine and every library version.

A permutation is the stable argsort of splitmix64 hashes of (key, index), the key derived from
a tuple of names (job seed, epoch, source, pass, block, ...) by BLAKE2b. numpy's `Generator`
methods may change between numpy versions (NEP 19); a job's order must not, or an upgrade in
the middle of an epoch would serve a sample twice.
"""

from __future__ import annotations

import hashlib

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def stream_key(*parts: object) -> int:
    """A 64-bit key for a tuple of names (ints and strings)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def random_keys(key: int, n: int) -> np.ndarray:
    """splitmix64 of key + i * golden, for i < n: n well-mixed uint64s."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def permutation(n: int, *parts: object) -> np.ndarray:
    """A uniformly random permutation of range(n) (int64), fixed by `parts`."""
    return np.argsort(random_keys(stream_key(*parts), n), kind="stable").astype(np.int64)
