"""Coordinates for position encodings beyond the patch grid.

* :mod:`ropekit.coords.canonical` -- canonical coordinates (cylindrical, spherical) in which rotations about an
  axis become translations, so a commuting encoding makes a model invariant to them.

(Patch-grid coordinates, jitter and centroids live in :mod:`ropekit.nn.coords`.)
"""

from .canonical import (
    RADIUS_MODES, axis_frame, cylindrical, freeze_periodic_, from_cylindrical, from_spherical, integer_frequencies,
    periodicity_error, rotate_about_axis, spherical,
)

__all__ = [
    "RADIUS_MODES", "axis_frame", "cylindrical", "from_cylindrical", "spherical", "from_spherical",
    "rotate_about_axis", "integer_frequencies", "freeze_periodic_", "periodicity_error",
]
