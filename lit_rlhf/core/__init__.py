"""Pure-torch RLHF math (docs/algorithms.md): tensors in, tensors (+ stats dict) out.

Nothing here imports Lightning, Hydra, transformers or W&B (tests/core/test_import_boundary.py).
"""
