"""Environments used by the course."""
from rlcourse.envs.gridworld import ACTION_ARROWS, ACTION_NAMES, LAYOUTS, GridWorld

GRIDWORLD_ID = "rlcourse/GridWorld-v0"

__all__ = ["GridWorld", "GRIDWORLD_ID", "LAYOUTS", "ACTION_NAMES", "ACTION_ARROWS"]
