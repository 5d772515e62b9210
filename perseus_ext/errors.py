"""Typed errors shared by every layer of perseus-ext.

Each error says what is wrong *and* how to fix it, so users never have to read a traceback
to learn which field of which file or config key was bad.
"""

from __future__ import annotations


class PerseusError(Exception):
    """Base class of every error perseus-ext raises on purpose."""


class ProfileError(PerseusError, ValueError):
    """A stage profile (CSV or in-memory table) is malformed."""


class ScheduleError(PerseusError, ValueError):
    """A pipeline schedule was asked for with impossible parameters."""


class SolverError(PerseusError, RuntimeError):
    """The frontier solver could not produce a plan."""


class ConfigError(PerseusError, ValueError):
    """A `perseus` config section or `--perseus-*` flag has a bad value."""
