"""The C library's record checksums against the crc32c package's (runtime/checksum.py's reference)."""
import shutil
import threading

import numpy as np
import pytest

from edgekv.runtime import native_build
from edgekv.runtime.checksum import package_sums, record_sums_by, sums_at
from edgekv.runtime.disk_store import aligned_zeros
from tests.conftest import run_in_threads


@pytest.mark.parametrize("record_bytes", [8, 1000, 4099, 65536])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 9])
def test_native_record_sums_equal_the_packages(n, record_bytes):
    """Records four at a time (their chains interleaved), then the rest one by one, tails shorter than 8 bytes."""
    if record_sums_by() is package_sums:
        pytest.skip("no C compiler: the package is the only implementation here")
    rng = np.random.default_rng(n * record_bytes)
    records = aligned_zeros((n, record_bytes + 13), 4096)
    records[:] = rng.integers(0, 256, records.shape, dtype=np.uint8)
    addresses = records.ctypes.data + np.arange(n, dtype=np.int64) * records.shape[1]
    groups = rng.integers(0, 1 << 20, n)
    fast = sums_at(addresses, record_bytes, 7, groups)
    assert fast.tolist() == package_sums(addresses, record_bytes, 7, groups).tolist()
    records[n - 1, record_bytes - 1] ^= 1  # a flip in the last record's last byte changes only its sum
    flipped = sums_at(addresses, record_bytes, 7, groups)
    assert flipped[n - 1] != fast[n - 1] and flipped[: n - 1].tolist() == fast[: n - 1].tolist()


def test_threads_that_first_need_a_library_at_once_all_get_it(tmp_path, monkeypatch):
    """The engine's two I/O threads verify their first records at the same moment: each must find the library one
    build made (two builds into one temporary file left one thread without it, and the checksums on the slow path)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    barrier = threading.Barrier(4, timeout=30)
    found = []

    def build():
        barrier.wait()
        found.append(native_build.build("crc32c"))

    assert run_in_threads(build, 4) == [] and len(set(found)) == 1 and found[0].parent == tmp_path / "native"
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [found[0].name]  # no temporary left
