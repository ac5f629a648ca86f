"""The job machinery above the stages: Hydra schemas of the typed configs (schemas.py), the command
line read once (cli.py), the presets in Python (presets.py), the inputs a job lacks (preflight.py),
its per-GPU memory plan (memory_plan.py) and one stage job from config to metrics (runner.py).
Imports the stages by path (docs/architecture.md "Layout"); only the pipelines and train.py import it."""
