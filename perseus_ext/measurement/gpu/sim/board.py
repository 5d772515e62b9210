"""Cross-process dependencies between simulated devices: the simulator's stand-in for NCCL.

On a real GPU a pipeline stage's forward waits for its input ON THE DEVICE (an NCCL recv on the
stream), while the host has long moved on. Simulated devices of different ranks (different
processes under torchrun) express the same with a board: a directory of small files, one per
published key, holding the device time at which the publishing computation completed. The
waiting device's engine thread polls for its keys; no host thread ever waits here.

perf_counter is CLOCK_MONOTONIC on Linux, shared by all processes of one machine, so published
times are directly comparable. The board is therefore single-machine, like the simulator.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from perseus_ext.measurement.gpu.common import GPUError

DEFAULT_TRANSFER_S = 0.0001  # device-to-device hand-over added to every dependency (NVLink-ish)
POLL_S = 0.002  # how often a waiting device engine looks for its keys (late keys still start on time)


def board_directory(job_id: str) -> Path:
    """Where the board of `job_id` lives (under the system temp directory)."""
    if not job_id:
        raise GPUError(
            "the simulated device board needs a non-empty job_id (the same on all ranks)"
        )
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:64]
    digest = hashlib.sha1(job_id.encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"perseus-sim-board-{safe}-{digest}"


class Board:
    """One rank's membership of a job's board; the last member to leave removes it."""

    def __init__(self, job_id: str, rank: int, *, transfer_s: float = DEFAULT_TRANSFER_S) -> None:
        if transfer_s < 0:
            raise GPUError(f"board transfer_s={transfer_s}; it must be >= 0 seconds")
        self.job_id = job_id
        self.rank = rank
        self.transfer_s = transfer_s
        self.directory = board_directory(job_id)
        self._members = self.directory / "members"
        self._keys = self.directory / "keys"
        self._member_file = self._members / f"rank{rank}-pid{os.getpid()}"
        with self._membership_lock():
            self._clear_if_stale()
            self._members.mkdir(parents=True, exist_ok=True)
            self._keys.mkdir(parents=True, exist_ok=True)
            self._member_file.write_text(str(os.getpid()))
        self._closed = False

    def publish(self, key: str, device_time_s: float) -> None:
        """Publish `key` as completed at `device_time_s` (atomic: readers see all or nothing)."""
        target = self._key_file(key)
        scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        scratch.write_text(repr(device_time_s))
        os.replace(scratch, target)

    def lookup(self, key: str) -> float | None:
        """Device time `key` completed at, None while nobody has published it."""
        try:
            return float(self._key_file(key).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise GPUError(
                f"simulated device board {self.directory}: key {key!r} unreadable ({exc})"
            ) from exc

    def close(self) -> None:
        """Leave the board; remove it when no member is left."""
        if self._closed:
            return
        self._closed = True
        with self._membership_lock() as lock_path:
            self._member_file.unlink(missing_ok=True)
            if not self._live_members():
                shutil.rmtree(self.directory, ignore_errors=True)
                lock_path.unlink(missing_ok=True)  # waiters notice and retry on a fresh file

    @contextlib.contextmanager
    def _membership_lock(self) -> Iterator[Path]:
        """Joining and leaving are serialised across processes, so that a rank joining while the
        last one leaves (or while a stale board is cleared) never loses its directory. The last
        to leave removes the lock file too; whoever then holds the removed file retries."""
        lock_path = self.directory.with_name(self.directory.name + ".lock")
        while True:
            with open(lock_path, "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    if _same_file(handle.fileno(), lock_path):
                        yield lock_path
                        return
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _key_file(self, key: str) -> Path:
        return self._keys / hashlib.sha1(key.encode()).hexdigest()

    def _live_members(self) -> list[Path]:
        try:
            entries = list(self._members.iterdir())
        except FileNotFoundError:
            return []
        return [entry for entry in entries if _pid_alive(entry.name.rpartition("pid")[2])]

    def _clear_if_stale(self) -> None:
        """A board left by a crashed run of the same job_id would satisfy keys it never
        published: remove it when none of its members is alive any more."""
        if self.directory.exists() and not self._live_members():
            shutil.rmtree(self.directory, ignore_errors=True)


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether the open lock file is still the one at `path` (not removed by a leaver)."""
    try:
        return os.fstat(descriptor).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _pid_alive(text: str) -> bool:
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
