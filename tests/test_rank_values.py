"""Values that combine with the rank (the Prometheus port plus the local rank, `{rank}` paths)
are checked for every rank of the job at the door, on every rank, before any of them trains:
a job whose local rank 7 would fail alone fails on all ranks at once, naming the key and flag."""

from __future__ import annotations

import argparse
import pytest

from perseus_ext.adapters.common import RankCounts, check_rank_values
from perseus_ext.adapters.megatron_args import FlagError, add_perseus_args
from perseus_ext.config import PerseusConfig
from perseus_ext.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    return add_perseus_args(argparse.ArgumentParser(exit_on_error=False)).parse_args(["--perseus", *argv])


@pytest.mark.parametrize("local_world_size, port, fails", [(8, 65528, False), (8, 65529, True), (1, 65535, False)])
def test_the_prometheus_port_is_checked_for_the_highest_local_rank(local_world_size, port, fails):
    config = PerseusConfig.from_dict({"enabled": True, "prometheus": {"port": port}})
    counts = RankCounts(world_size=16, local_world_size=local_world_size)
    if not fails:
        check_rank_values(config, counts)
        return
    with pytest.raises(ConfigError) as caught:
        check_rank_values(config, counts)
    assert caught.value.keys == ("perseus.prometheus.port",)
    assert f"local rank 7 (LOCAL_WORLD_SIZE 8) would need {port + 7}, past 65535; use a base port <= 65528" in str(
        caught.value)


def test_a_bad_port_for_a_later_local_rank_fails_at_the_megatron_door_on_rank_zero(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 itself would serve on 65530: fine alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(FlagError) as caught:
        parse("--perseus-mode", "observe", "--perseus-prometheus", '{"port": 65530}')
    assert caught.value.flags == ("--perseus-prometheus",)
    assert "would need 65537" in caught.value.usage_line()


def test_a_rank_path_is_checked_for_every_global_rank(tmp_path, monkeypatch):
    """{rank} in a directory: rank 3's "directory" is a file, ranks 0-2 have theirs."""
    for rank in range(3):
        (tmp_path / f"node{rank}").mkdir()
    (tmp_path / "node3").write_text("not a directory")
    template = str(tmp_path / "node{rank}" / "log.jsonl")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(FlagError) as caught:
        parse("--perseus-mode", "observe", "--perseus-log-path", template)
    assert caught.value.keys == ("perseus.log_path",) and caught.value.flags == ("--perseus-log-path",)
    assert (f"gives rank 3 the path {str(tmp_path / 'node3' / 'log.jsonl')!r}, which cannot be created: "
            f"{tmp_path / 'node3'} is a file") in str(caught.value)
    monkeypatch.setenv("WORLD_SIZE", "3")  # ranks 0-2 only: the same flags pass
    assert parse("--perseus-mode", "observe", "--perseus-log-path", template).perseus_log_path == template


def test_rank_counts_come_from_the_launcher():
    assert RankCounts.from_env({}) == RankCounts(1, 1)
    assert RankCounts.from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == RankCounts(16, 8)
    assert RankCounts.from_env({"LOCAL_RANK": "5"}) == RankCounts(1, 6)
    with pytest.raises(ConfigError, match="env WORLD_SIZE='x' must be a count of ranks"):
        RankCounts.from_env({"WORLD_SIZE": "x"})
