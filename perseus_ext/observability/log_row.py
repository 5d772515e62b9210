"""One row of the runtime's JSONL log (`perseus.log_path`): the model the runtime writes and
`perseus-ext report` reads back, so the two can never disagree on a field's name or type.

Why one model for both ends: the writer used to build a dict and the reader a pydantic model
whose phase names were repeated by hand; a field renamed on one side would have gone unnoticed
until a user's report broke. The file format is unchanged: `to_json_line` writes the keys in the
order and the encoding logs have always had, and rows of older logs (without `job`,
`timestamp`, `pipeline`, `stage`, ...) still read, those fields None. Rows of a simulated GPU end
with its power samples (`power_bin_s`, `power_first_bin`, `power_bins_w`); other rows have none
of these keys.

The writer does not validate (`of_record` builds the row from the runtime's typed record): a
physically odd reading must cost neither the row nor the training step; the reader validates
every row and refuses a bad one with an error naming the file, the line and the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.phase import PhaseName
from perseus_ext.observability.power_samples import PowerSamples

MAX_ITERATION = 1 << 53  # past a double's integers, an iteration count cannot be summed exactly
MAX_RANK = 1 << 24  # 16 M ranks
MAX_TIME_S = 1e6  # an iteration of 11 days is not a measurement
MAX_ENERGY_J = 1e12  # 1 TJ in one iteration of one stage is not a measurement
MAX_CLOCK_MHZ = 1e5  # no GPU clocks at 100 GHz
MAX_POWER_W = 1e6  # no single GPU draws a megawatt
MAX_POWER_BINS = 1 << 22  # over an hour of 1 ms samples in one iteration
MAX_COVERAGE = 1.0 + 1e-9  # a share, summed from segments: a rounding past 1 is still full coverage

Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_TIME_S)]


class LogRow(BaseModel):
    """One iteration of one rank, as a line of its JSONL log (fields in the file's key order)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, frozen=True, extra="ignore")

    timestamp: Optional[Annotated[float, Field(ge=0.0)]] = None  # wall clock (s since the epoch)
    job: Optional[Annotated[str, Field(max_length=64)]] = None  # the job's id, the same on every rank
    iteration: Annotated[int, Field(ge=0, le=MAX_ITERATION)]
    rank: Rank
    pipeline: Optional[Rank] = None
    stage: Optional[Rank] = None
    phase: PhaseName
    setting: Optional[Annotated[str, Field(max_length=200)]] = None  # what it ran at, in words
    plan: Optional[Annotated[int, Field(ge=0)]] = None  # the frontier plan's index (deployed)
    profiled_clock_mhz: Optional[Annotated[int, Field(gt=0, le=MAX_CLOCK_MHZ)]] = None
    power_limit_w: Optional[Annotated[float, Field(gt=0.0, le=MAX_POWER_W)]] = None
    factor: Optional[Annotated[float, Field(gt=0.0, le=1e6)]] = None  # the slowdown planned for
    fell_back: bool = False
    probe: bool = False
    time_s: Seconds
    compute_s: Optional[Seconds] = None
    energy_j: Optional[Annotated[float, Field(ge=0.0, le=MAX_ENERGY_J)]] = None
    coverage: Optional[Annotated[float, Field(ge=0.0, le=MAX_COVERAGE)]] = None
    # the GPU's power as the mean over each `power_bin_s` of device time, from bin `power_first_bin`
    # (bin b spans [b power_bin_s, (b + 1) power_bin_s)), where the device knows it that finely
    # (observability.power_samples); absent on real GPUs
    power_bin_s: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    power_first_bin: Optional[Annotated[int, Field(ge=-MAX_ITERATION, le=MAX_ITERATION)]] = None
    power_bins_w: Optional[Annotated[list[Annotated[float, Field(ge=0.0, le=MAX_POWER_W)]],
                                     Field(max_length=MAX_POWER_BINS)]] = None

    @classmethod
    def of_record(cls, record: IterationRecord, job: str | None) -> LogRow:
        """The row of one finished iteration (not validated: see the module docstring)."""
        setting = record.setting
        return cls.model_construct(
            timestamp=record.wall_time, job=job, iteration=record.iteration, rank=record.rank,
            pipeline=record.pipeline, stage=record.stage, phase=setting.phase.value, setting=setting.describe(),
            plan=setting.plan, profiled_clock_mhz=setting.profiled_clock_mhz, power_limit_w=setting.power_limit_w,
            factor=setting.factor, fell_back=setting.fell_back, probe=setting.probe, time_s=record.time_s,
            compute_s=record.compute_s, energy_j=record.energy_j, coverage=record.coverage,
            **_power_fields(record.power))

    def power_samples(self) -> PowerSamples | None:
        """The row's power samples, when it carries them (all three fields)."""
        if self.power_bin_s is None or self.power_first_bin is None or not self.power_bins_w:
            return None
        watts = np.asarray(self.power_bins_w, dtype=float)
        watts.flags.writeable = False
        return PowerSamples(self.power_bin_s, self.power_first_bin, watts)

    def to_json_line(self) -> str:
        """The row as the log holds it: one JSON object, the fields in declaration order, no newline;
        the power fields only where the row has power samples (a real GPU's rows are unchanged)."""
        return json.dumps({name: getattr(self, name) for name in type(self).model_fields
                           if name not in POWER_FIELDS or self.power_bins_w is not None})


POWER_FIELDS = ("power_bin_s", "power_first_bin", "power_bins_w")
POWER_DECIMALS = 3  # milliwatts: far below any swing, and a third of the digits of a float's repr


def _power_fields(samples: PowerSamples | None) -> dict[str, object]:
    if samples is None:
        return {"power_bin_s": None, "power_first_bin": None, "power_bins_w": None}
    return {"power_bin_s": samples.period_s, "power_first_bin": int(samples.first_bin),
            "power_bins_w": [round(float(w), POWER_DECIMALS) for w in samples.watts]}
