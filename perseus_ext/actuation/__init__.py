"""Actuation: applying GPU clocks off the training thread (`controller`) and restoring them even
when the trainer is killed (`watchdog`). See docs/device.md."""
