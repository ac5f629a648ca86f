"""Pure-torch RLHF math (ALGORITHMS.md): tensors in, tensors (+ stats dict) out.

Nothing here imports Lightning, Hydra, transformers or W&B (tests/core/test_import_boundary.py).
"""
