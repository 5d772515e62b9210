"""Estimated figures for the computation kinds a forward/backward profile lacks.

Zero-bubble schedules split each backward into an input-gradient (I) and a weight-gradient (W)
computation; Megatron's combined_1f1b and DualPipeV run a forward and a backward as one
combined unit. Where those kinds were not measured (the emulator, a profile taken under 1F1B),
`derive_kinds` estimates them from each stage's forward (F) and backward (B) rows, clock by clock:

- input gradient:  time = s t_B,  energy = s e_B;
- weight gradient: time = (1 - s) t_B,  energy = (1 - s) e_B;
  with s = `DerivationRule.input_gradient_share` (default 0.5: a backward's two matrix products
  per layer, one for the input gradient and one for the weights, cost about the same, the
  split the zero-bubble paper uses, F ~ I ~ W);
- combined (a forward overlapped with a backward):
  time = t_F + t_B - o min(t_F, t_B),  energy = e_F + e_B;
  with o = `DerivationRule.overlap_share` (default 0: no overlap credited). The same arithmetic
  runs, so the energy is the parts' sum; what the overlap hides (communication, the all-to-all
  of expert parallelism) shortens the unit by o of its shorter part.

Measured rows always win: a kind the profile has is kept as measured. The rule is a model, not
a measurement, and says so wherever a figure it produced is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perseus_ext.errors import ProfileError
from perseus_ext.planning.profile import OperatingPoints, Profile


@dataclass(frozen=True)
class DerivationRule:
    """How I/W and combined figures follow from forward/backward ones (module docstring)."""

    input_gradient_share: float = 0.5
    overlap_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input_gradient_share", "overlap_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ProfileError(f"derivation rule: {name} must be a number, got {value!r}")
        if not 0.0 < self.input_gradient_share < 1.0:
            raise ProfileError(
                f"derivation rule: input_gradient_share must lie strictly between 0 and 1 (the "
                f"input gradient's share of a backward), got {self.input_gradient_share!r}"
            )
        if not 0.0 <= self.overlap_share <= 1.0:
            raise ProfileError(
                f"derivation rule: overlap_share must lie in [0, 1] (the share of the shorter part "
                f"of a combined unit hidden behind the longer), got {self.overlap_share!r}"
            )


DERIVED_KINDS = ("input_gradient", "weight_gradient", "combined")


def derive_kinds(profile: Profile, rule: DerivationRule | None = None,
                 kinds: tuple[str, ...] = DERIVED_KINDS) -> Profile:
    """`profile` with the `kinds` it lacks estimated from each stage's forward and backward rows
    (module docstring); measured rows are kept as they are."""
    rule = rule or DerivationRule()
    unknown = sorted(set(kinds) - set(DERIVED_KINDS))
    if unknown:
        raise ProfileError(f"derive_kinds estimates {', '.join(DERIVED_KINDS)}, not {unknown}")
    points = dict(profile.points)
    for stage in range(profile.num_stages):
        forward, backward = points.get((stage, "forward")), points.get((stage, "backward"))
        if backward is None:
            continue  # a stage measured with split gradients already: nothing to estimate from
        share = rule.input_gradient_share
        derived = {
            "input_gradient": OperatingPoints(backward.frequencies, backward.times * share,
                                              backward.energies * share),
            "weight_gradient": OperatingPoints(backward.frequencies, backward.times * (1.0 - share),
                                               backward.energies * (1.0 - share)),
            "combined": _combined(forward, backward, rule.overlap_share),
        }
        for kind in kinds:
            points.setdefault((stage, kind), derived[kind])
    return Profile(points, profile.source, list(profile.dropped))


def _combined(forward: OperatingPoints, backward: OperatingPoints, overlap_share: float) -> OperatingPoints:
    if forward.frequencies.tolist() != backward.frequencies.tolist():
        raise ProfileError("forward and backward rows of a stage must share their clocks to derive a combined unit")
    times = forward.times + backward.times - overlap_share * (forward.times.clip(max=backward.times))
    return OperatingPoints(forward.frequencies, times, forward.energies + backward.energies)
