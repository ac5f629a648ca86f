"""How a stage runs under a strategy: the FSDP and DeepSpeed strategies as the stages use them
(one FSDP root per model, gathered rollouts, norms across shards) and atomic checkpoint saving.
Above ``models`` and ``utils``, below ``modules`` (docs/architecture.md "Layout")."""
