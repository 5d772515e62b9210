"""What one rank publishes for its observers: who it is, each iteration the device finished, and
the saving measured so far; the metrics writers read this feed, never the runtime.

Why a feed instead of the runtime object: the writers used to be handed the whole runtime and
reached into its deployment, probes, GPU, config and control plane for a figure each, so any
change inside the runtime could silently break a dashboard. Now the runtime's recorder publishes
each finished `IterationRecord` (the planned clock included) and the writers take them in
batches, typed, with the saving as it stands when they take them.

Unread records are kept up to `MAX_UNREAD`: a job without a metrics writer does not grow a
buffer for weeks, and a writer that reads every iteration never comes near the bound.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from perseus_ext.config.sections import PrometheusConfig
from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.saving_estimate import Comparison

logger = logging.getLogger(__name__)

MAX_UNREAD = 1024


@dataclass(frozen=True)
class RankIdentity:
    """Where the publishing rank sits in its job (the Prometheus exporter's labels)."""

    job_id: str  # the same on every rank
    rank: int  # global rank
    local_rank: int  # on its node (which port it serves metrics on)
    pipeline: int
    stage: int


@dataclass(frozen=True)
class FeedBatch:
    """The iterations finished since the last read, in order, and this rank's measured saving
    when they were read (None before the first baseline probe has an energy reading)."""

    records: tuple[IterationRecord, ...]
    saving: Comparison | None


class RankFeed:
    """The runtime publishes into it (`publish`, `close`); one reader takes from it (`take`)
    and may ask to be told when the rank closes (`on_close`)."""

    def __init__(self, identity: RankIdentity, prometheus: PrometheusConfig | None,
                 saving: Callable[[], Comparison | None]) -> None:
        self.identity = identity
        self.prometheus = prometheus  # the rank's exporter settings (None: environment or off)
        self._saving = saving
        self._unread: deque[IterationRecord] = deque(maxlen=MAX_UNREAD)
        self._close_hooks: list[Callable[[], None]] = []

    def publish(self, record: IterationRecord) -> None:
        self._unread.append(record)

    def take(self) -> FeedBatch:
        """Everything published since the last call (never blocks)."""
        records = tuple(self._unread)
        self._unread.clear()
        return FeedBatch(records, self._saving() if records else None)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run `hook` when the rank has recorded its last iteration (its last records are in)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """The rank's last records are published: every hook, each failure logged, never raises."""
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("perseus-ext: a metrics writer failed at close")
