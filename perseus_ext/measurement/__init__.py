"""Measurement: the GPU device layer (`gpu`: NVML and simulated backends) and time/energy
measurement windows (`windows`). See docs/device.md."""
