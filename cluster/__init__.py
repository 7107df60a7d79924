"""Placement, worker groups, weight sync, job config and the driver functions (RL and SFT)."""
