"""Reshard: plan Layout A → Layout B as collectives (planner), run them (execute)."""
from .api import plan_layouts, plan_reshard, reshard
from .planner import PlannedStep, ReshardPlan

__all__ = ["plan_layouts", "plan_reshard", "reshard", "PlannedStep", "ReshardPlan"]
