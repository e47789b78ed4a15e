"""Disk profiler: random-read bandwidth on each KV path vs block size and queue depth.

The profile describes the disk, not our reader: fio (JSON output, io_uring or libaio, O_DIRECT)
measures the device's limit, and the runtime's own reader is measured beside it on the same
file so the report shows reader/disk efficiency per block size.  Without fio only the
reader's figures exist and the profile says so.

With several KV paths each is profiled alone (one after the other, each for the profile's
``disk_seconds``: the slowest path bounds the plan, so no path's figures are cut short), and
``planned_mib_s`` gives the rate the solver plans with over all of them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgekv.runtime.disk_store import aligned_zeros
from edgekv.runtime.reader import ReadBatch, open_reader

log = logging.getLogger(__name__)

BLOCK_SIZES = (512, 4096, 16384, 65536, 262144, 1048576)
QUEUE_DEPTHS = (1, 8, 32)
TEST_FILE = "edgekv-disk-profile.bin"
OLD_FIELDS = {"kv_dir": "kv_path"}  # a disk profile's fields by the names files written before still hold


@dataclass(frozen=True)
class DiskPoint:
    block_bytes: int
    queue_depth: int
    reader_mib_s: float
    fio_mib_s: float | None = None

    @property
    def efficiency(self) -> float | None:
        return self.reader_mib_s / self.fio_mib_s if self.fio_mib_s else None


@dataclass
class DiskProfile:
    kv_path: str
    fingerprint: dict
    reference: str  # "fio <engine>" or "none (fio not installed)"
    reader: str
    o_direct: bool
    seconds: float
    points: list[DiskPoint] = field(default_factory=list)

    def read_mib_s(self, block_bytes: int, queue_depth: int, source: str = "reader") -> float | None:
        """Bandwidth at a block size (log-linear between measured sizes) for the nearest measured depth.

        ``source``: "reader" our reader's figures; "disk" fio's, or the reader's where fio did not run (what
        the solver plans with); "fio" fio's alone, None without fio (a ratio to the disk must never compare
        the reader with itself)."""
        depths = sorted({p.queue_depth for p in self.points})
        depth = min(depths, key=lambda d: (abs(np.log2(d) - np.log2(queue_depth)), -d))
        rows = sorted((p for p in self.points if p.queue_depth == depth), key=lambda p: p.block_bytes)
        if source == "fio" and any(p.fio_mib_s is None for p in rows):
            return None
        values = [p.reader_mib_s if source == "reader" else (p.fio_mib_s or p.reader_mib_s) for p in rows]
        x = np.log2([p.block_bytes for p in rows])
        return float(np.interp(np.log2(block_bytes), x, values))

    def to_json(self) -> dict:
        return {**asdict(self), "points": [asdict(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: dict) -> "DiskProfile":
        return cls(**{**data, "points": [DiskPoint(**p) for p in data["points"]]})


def renamed_fields(data, where: str):
    """``data`` (JSON holding disk profiles) with each field of an old name (``OLD_FIELDS``) under its new one,
    each old name said once in a warning naming ``where``: a file written before the rename still reads."""
    seen = set()

    def renamed(value):
        if isinstance(value, list):
            return [renamed(v) for v in value]
        if not isinstance(value, dict):
            return value
        seen.update(k for k in value if k in OLD_FIELDS)
        return {OLD_FIELDS.get(k, k): renamed(v) for k, v in value.items()}

    out = renamed(data)
    for old in sorted(seen):
        log.warning("%s: field '%s' is now '%s'; the old name is still read (REPROFILE=1 writes the new one)",
                    where, old, OLD_FIELDS[old])
    return out


def disk_fingerprint(kv_path: str | Path) -> dict:
    """What identifies the disk under ``kv_path``: device numbers, filesystem, model and size where sysfs has them."""
    st = os.stat(kv_path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    fs, source = "unknown", "unknown"
    best = ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, mount, kind = line.split()[:3]
        if str(Path(kv_path).resolve()).startswith(mount) and len(mount) > len(best):
            best, fs, source = mount, kind, dev
    sysdev = Path(f"/sys/dev/block/{major}:{minor}")
    model = _first_text([sysdev / "device/model", sysdev / "../device/model"])
    whole = sysdev.resolve().parent / "dev" if (sysdev / "partition").is_file() else sysdev / "dev"
    disk = _first_text([whole])
    return {"dev": f"{major}:{minor}", "disk": f"{major}:{minor}" if disk == "unknown" else disk, "source": source,
            "fs": fs, "mount": best, "model": model}


def device_of(profile: DiskProfile) -> str:
    """The device whose bandwidth a path draws on: the whole disk (partitions of one disk share it), else st_dev."""
    return profile.fingerprint.get("disk") or profile.fingerprint.get("dev") or profile.kv_path


def _by_device(profiles: list[DiskProfile]) -> dict[str, list[DiskProfile]]:
    by_device: dict[str, list[DiskProfile]] = {}
    for p in profiles:
        by_device.setdefault(device_of(p), []).append(p)
    return by_device


def shared_devices(profiles: list[DiskProfile]) -> dict[str, list[str]]:
    """{device: its KV paths} for every device that holds more than one path: those paths add no bandwidth."""
    return {dev: [p.kv_path for p in on] for dev, on in _by_device(profiles).items() if len(on) > 1}


def planned_mib_s(profiles: list[DiskProfile], block_bytes: int, queue_depth: int, source: str = "reader") -> float:
    """The rate a step's reads get when its records are spread evenly over the paths of ``profiles``.

    The reads end when the slowest path's share does: with N paths each holding 1/N of the bytes, all of them
    read at N x the slowest path's rate, never more than the sum.  k paths on one device share its rate (each
    was measured alone, so their mean is the device's): that device reads k/N of the bytes.  So the rate is
    min over devices of N x rate_d / k_d, each path's rate taken at this block size (one path: its own rate).
    """
    n = len(profiles)
    return min(n * float(np.mean([p.read_mib_s(block_bytes, queue_depth, source) for p in on])) / len(on)
               for on in _by_device(profiles).values())


def combine_profiles(profiles: list[DiskProfile]) -> DiskProfile:
    """The paths as one profile, ``planned_mib_s`` at each measured (block size, depth): what the solver plans with,
    kept in the config and the report.  One profile is returned as it is."""
    if len(profiles) == 1:
        return profiles[0]
    with_fio = all(pt.fio_mib_s for p in profiles for pt in p.points)
    points = [DiskPoint(pt.block_bytes, pt.queue_depth, round(planned_mib_s(profiles, pt.block_bytes, pt.queue_depth), 1),
                        round(planned_mib_s(profiles, pt.block_bytes, pt.queue_depth, "disk"), 1) if with_fio else None)
              for pt in profiles[0].points]
    return DiskProfile(", ".join(p.kv_path for p in profiles), {"paths": [p.fingerprint for p in profiles]},
                       " + ".join(dict.fromkeys(p.reference for p in profiles)),
                       " + ".join(dict.fromkeys(p.reader for p in profiles)),
                       all(p.o_direct for p in profiles), round(sum(p.seconds for p in profiles), 1), points)


def _first_text(paths) -> str:
    for p in paths:
        try:
            return p.read_text().strip()
        except OSError:
            continue
    return "unknown"


def make_test_file(path: Path, size_bytes: int) -> bool:
    """Write the test file (random bytes, so no device compression flatters it); True when O_DIRECT reads work."""
    chunk = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(max(1, size_bytes // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def reader_mib_s(backend: str, path: Path, block_bytes: int, queue_depth: int, seconds: float, o_direct: bool = True) -> tuple[float, str]:
    """The runtime's reader on random aligned blocks, in batches like one decode step's misses."""
    reader = open_reader(backend, queue_depth=queue_depth)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    try:
        blocks = os.fstat(fd).st_size // block_bytes
        batch = max(64, 4 * queue_depth) if block_bytes <= 65536 else max(8, queue_depth)
        dest = aligned_zeros((batch, block_bytes), 4096)
        addresses = dest.ctypes.data + np.arange(batch, dtype=np.int64) * block_bytes
        fds = np.full(batch, fd, dtype=np.int32)
        rng = np.random.default_rng(1)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or done == 0:
            offsets = rng.integers(0, blocks, batch, dtype=np.int64) * block_bytes
            reader.read(ReadBatch(fds, offsets, addresses, block_bytes))
            done += batch
        return done * block_bytes / (time.perf_counter() - start) / 2**20, reader.name
    finally:
        os.close(fd)
        reader.close()


def fio_engine() -> str | None:
    """The fio engine to use (io_uring, else libaio), or None without fio."""
    if not shutil.which("fio"):
        return None
    out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
    return "io_uring" if "io_uring" in out else "libaio" if "libaio" in out else "psync"


def fio_mib_s(path: Path, block_bytes: int, queue_depth: int, seconds: float, engine: str, o_direct: bool = True) -> float:
    cmd = ["fio", "--name=edgekv", f"--filename={path}", "--rw=randread", f"--bs={block_bytes}",
           f"--iodepth={queue_depth}", f"--ioengine={engine}", f"--direct={int(o_direct)}",
           f"--runtime={max(1, int(seconds * 1000))}ms", "--time_based", "--norandommap", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"fio failed ({' '.join(cmd)}): {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)["jobs"][0]["read"]["bw"] / 1024  # KiB/s -> MiB/s


def profile_disk(kv_path: str | Path, seconds: float = 60, file_mib: int = 1024, block_sizes=BLOCK_SIZES,
                 queue_depths=QUEUE_DEPTHS, backend: str = "auto", progress=None) -> DiskProfile:
    """Measure every (block size, depth) with fio and with the reader, within about ``seconds`` in all."""
    kv_path = Path(kv_path)
    kv_path.mkdir(parents=True, exist_ok=True)
    path = kv_path / TEST_FILE
    engine = fio_engine()
    n = len(block_sizes) * len(queue_depths) * (2 if engine else 1)
    per_point = max(0.25, seconds / n)
    start = time.perf_counter()
    try:
        o_direct = make_test_file(path, file_mib << 20)
        profile = DiskProfile(str(kv_path), disk_fingerprint(kv_path), f"fio {engine}" if engine else "none (fio not installed)",
                              "", o_direct, 0.0)
        for block in block_sizes:
            for depth in queue_depths:
                fio = fio_mib_s(path, block, depth, per_point, engine, o_direct) if engine else None
                mib, profile.reader = reader_mib_s(backend, path, block, depth, per_point, o_direct)
                profile.points.append(DiskPoint(block, depth, round(mib, 1), round(fio, 1) if fio else None))
                if progress:
                    progress()
        profile.seconds = round(time.perf_counter() - start, 1)
        return profile
    finally:
        path.unlink(missing_ok=True)


def plot_disk(profiles: list[DiskProfile], png: str | Path) -> None:
    """Bandwidth vs block size per queue depth, one panel per KV path: the disk (fio, solid) and our reader (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(6.4 * len(profiles), 4), squeeze=False)
    for profile, ax in zip(profiles, axes[0]):
        _plot_path(ax, profile)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _plot_path(ax, profile: DiskProfile) -> None:
    for i, depth in enumerate(sorted({p.queue_depth for p in profile.points})):
        rows = sorted((p for p in profile.points if p.queue_depth == depth), key=lambda p: p.block_bytes)
        x = [p.block_bytes / 1024 for p in rows]
        color = f"C{i}"
        if rows[0].fio_mib_s is not None:
            ax.plot(x, [p.fio_mib_s for p in rows], "-o", color=color, label=f"disk (fio) qd{depth}")
        ax.plot(x, [p.reader_mib_s for p in rows], "--s", color=color, label=f"{profile.reader} reader qd{depth}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (KiB)")
    ax.set_ylabel("random read (MiB/s)")
    ax.set_title(f"{profile.kv_path}: {profile.fingerprint.get('source')} ({profile.fingerprint.get('fs')}), "
                 f"O_DIRECT={profile.o_direct}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
