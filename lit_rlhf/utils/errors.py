"""The one base class of the errors a user can fix: a bad config value, bad input data, a model that
cannot be loaded, a reward function that fails, training that keeps producing non-finite values.
``train.py`` reports any of them in one line, without a traceback; anything else is a bug and keeps
its traceback."""

from __future__ import annotations


class UserError(Exception):
    """An error whose message says what to change (the key, file, row or path, and what is allowed)."""
