"""Backends that run a rollout for the job manager: local.py (in this process), ray.py (Ray actors
running worker.py's RolloutWorker). Both build their node with control/node.py."""
