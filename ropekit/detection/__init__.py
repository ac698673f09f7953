"""3-D detection from RGB-D: synthetic scenes, box geometry, matching, loss and metrics.

pybullet is imported only when scenes are rendered, so the geometry, loss and metrics work without it.
"""

from .._optional import require_extra

require_extra("studies", "ropekit.detection")  # before the submodules import what it installs

from .boxes import (
    CORNER_SIGNS,
    box12_from_parts,
    box12_to_corners,
    box_iou_3d,
    box_iou_3d_pairwise,
    box_volume,
    corners_to_box12,
    points_in_box,
    rotation_from_6d,
)
from .matching import (
    DetectionEvaluator,
    DetectionLossConfig,
    average_precision,
    batch_match_cost,
    detection_loss,
    hungarian_match,
    linear_assignment,
    match_cost,
    postprocess,
)
from .scenes import (
    CLASS_NAMES,
    SceneConfig,
    SceneDataset,
    SceneSet,
    collate_detection,
    generate_scenes,
    make_scenes_main,
    project_points,
    render_scene,
)

__all__ = [
    "CORNER_SIGNS",
    "box12_from_parts",
    "box12_to_corners",
    "box_iou_3d",
    "box_iou_3d_pairwise",
    "box_volume",
    "corners_to_box12",
    "points_in_box",
    "rotation_from_6d",
    "DetectionEvaluator",
    "DetectionLossConfig",
    "average_precision",
    "detection_loss",
    "batch_match_cost",
    "hungarian_match",
    "linear_assignment",
    "match_cost",
    "postprocess",
    "CLASS_NAMES",
    "SceneConfig",
    "SceneDataset",
    "SceneSet",
    "collate_detection",
    "generate_scenes",
    "make_scenes_main",
    "project_points",
    "render_scene",
]
