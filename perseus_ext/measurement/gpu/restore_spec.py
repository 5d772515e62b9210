"""How another process re-opens a GPU to restore its clocks: one frozen model per backend kind.

`GPU.restore_spec()` returns one of these; the SIGKILL watchdog (actuation/watchdog.py) receives
it as JSON on its command line and validates it back into the same typed object, so a typed
object, never a dict, crosses the process boundary. The `backend` field tells the kinds apart.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_FROZEN = ConfigDict(strict=True, extra="forbid", frozen=True)


class SimRestoreSpec(BaseModel):
    """A simulated GPU whose state another process reaches through its state file."""

    model_config = _FROZEN
    backend: Literal["sim"] = "sim"
    preset: str = Field(min_length=1)
    state_file: str = Field(min_length=1)

    def describe(self) -> str:
        return self.state_file


class NVMLRestoreSpec(BaseModel):
    """A real GPU, found again by its NVML UUID."""

    model_config = _FROZEN
    backend: Literal["nvml"] = "nvml"
    uuid: str = Field(min_length=1)

    def describe(self) -> str:
        return self.uuid


ReaderRestoreSpec = Annotated[SimRestoreSpec | NVMLRestoreSpec, Field(discriminator="backend")]


class ZeusdRestoreSpec(BaseModel):
    """A GPU whose clocks zeusd sets (`reader` re-opens the device it reads from). The token is
    never part of it: it comes from the inherited ZEUSD_TOKEN (a command line anyone can read)."""

    model_config = _FROZEN
    backend: Literal["zeusd"] = "zeusd"
    gpu_id: int = Field(ge=0)
    reader: ReaderRestoreSpec
    socket_path: str | None = None
    host_port: str | None = None

    @model_validator(mode="after")
    def _one_endpoint(self) -> ZeusdRestoreSpec:
        if (self.socket_path is None) == (self.host_port is None):
            raise ValueError("a zeusd restore spec names socket_path or host_port, exactly one")
        return self

    def describe(self) -> str:
        return f"GPU {self.gpu_id} of zeusd at {self.socket_path or self.host_port} ({self.reader.describe()})"


RestoreSpec = Annotated[SimRestoreSpec | NVMLRestoreSpec | ZeusdRestoreSpec, Field(discriminator="backend")]
