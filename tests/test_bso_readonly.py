"""A shared batch-size store that this user may read but not write can still be listed.

The store is another user's SQLite file in WAL mode, in a folder this user cannot write, its
`-wal` and `-shm` files gone (the last writer closed). SQLite would have to create `-shm` to
read it: the listing said "attempt to write a readonly database". Write permission is taken
away the way the kernel enforces it: as an ordinary user, file modes; as root (who ignores
modes), in a user namespace without root's capabilities over the machine's files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from perseus_ext.policies.batch_size import BatchSizeOptimizer, RunOutcome

REPO = Path(__file__).resolve().parents[1]


def shared_store(folder: Path) -> Path:
    """A store with one job and one finished run, then made read-only (file and folder)."""
    folder.mkdir()
    path = folder / "bso.db"
    optimizer = BatchSizeOptimizer(str(path), "nightly", [8, 16], 16, eta=0.5, max_power_w=300.0)
    suggestion = optimizer.suggest()
    optimizer.report(suggestion.run_id, time_s=2.0, energy_j=500.0, outcome=RunOutcome.REACHED)
    optimizer.store.close()
    assert sorted(p.name for p in folder.iterdir()) == ["bso.db"]  # WAL checkpointed and removed
    path.chmod(0o444)
    folder.chmod(0o555)
    return path


def list_as_a_reader(*arguments: str) -> subprocess.CompletedProcess:
    """`perseus-ext batch-size ...` as a user who may not write the store's folder."""
    command = [sys.executable, "-m", "perseus_ext", "batch-size", *arguments]
    if os.geteuid() == 0:
        unshare = shutil.which("unshare")
        if unshare is None or subprocess.run([unshare, "--user", "true"], capture_output=True).returncode != 0:
            pytest.skip("running as root without user namespaces: cannot take write permission away")
        command = [unshare, "--user", *command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_a_store_in_a_folder_the_reader_cannot_write_is_listed(tmp_path):
    store = shared_store(tmp_path / "shared")
    try:
        done = list_as_a_reader(str(store))
        assert done.returncode == 0, done.stderr[-2000:]
        assert "job nightly: 1 runs" in done.stdout
        status = {line.split()[0]: line.split()[-1] for line in done.stdout.splitlines()
                  if line.split() and line.split()[0].isdigit()}
        assert status == {"8": "untried", "16": "best"}
        as_json = list_as_a_reader(str(store), "--json")
        assert as_json.returncode == 0 and '"best_batch_size": 16' in as_json.stdout
        # nothing was written beside it (no -shm, no -wal)
        assert sorted(p.name for p in store.parent.iterdir()) == ["bso.db"]
    finally:
        store.parent.chmod(0o755)
        store.chmod(0o644)
