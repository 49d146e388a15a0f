"""The model-cost figures training and the tuner both need, below both (it imports neither
`train` nor `tune`): what a run holds (inventory.py), the FLOPs of its steps (flops.py), the
GPUs known by name and their peaks (devices.py)."""
