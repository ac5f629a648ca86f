"""lit_rlhf: RLHF of causal language models as PyTorch Lightning modules, configured with Hydra.

Importing the package is cheap: ``lit_rlhf.core`` (the math) needs only torch; Lightning,
transformers and Hydra load when a module, builder or data module is imported.
"""

__version__ = "0.2.0"  # the one home of the version (pyproject.toml reads it; CHANGELOG.md)
