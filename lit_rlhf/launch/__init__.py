"""The config machinery above the stages: Hydra schemas of the typed configs, the command line's
pre-check of overrides, and what a composed config's strategy is. Imports the stages by path
(docs/architecture.md "Layout"); nothing below imports it."""
