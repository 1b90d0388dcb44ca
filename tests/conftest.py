"""Shared test setup: make sure verl has loaded the divclip plugin before tests run."""

import verl  # noqa: F401  (runs the verl.plugins entry points)
