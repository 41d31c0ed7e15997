"""Capacity planner behind `tokenmill plan`: presets and model files, the device table, the roofline.

Light on imports (no torch) so `tokenmill plan` answers instantly; only --measure loads torch and the engine.
"""

from tokenmill.planner.common import PlanError
from tokenmill.planner.hardware import GPUS, Hardware, cpu_hardware, get_hardware
from tokenmill.planner.model_files import load_model
from tokenmill.planner.models import PRESETS, ModelShape
from tokenmill.planner.recommend import Recommendation, recommend
from tokenmill.planner.roofline import Deployment, Plan, kv_bytes_per_token, min_tp_to_fit, plan

__all__ = [
    "GPUS", "PRESETS", "Deployment", "Hardware", "ModelShape", "Plan", "PlanError", "Recommendation",
    "cpu_hardware", "get_hardware", "kv_bytes_per_token", "load_model", "min_tp_to_fit", "plan", "recommend",
]
