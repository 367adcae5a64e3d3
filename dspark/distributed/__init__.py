"""Tensor parallelism over torch.distributed: the rank's groups (parallel_state.py), the worker
processes and their watchdog (launch.py, worker.py)."""
