"""The seam into verl 0.9.1's actor engine: one entry point, :func:`verl_ext.engine.seam.install`, which wraps each
verl symbol once after checking it; the other modules are its features (the math is :mod:`verl_ext.core`).
Imports :mod:`verl_ext.core` and verl; never :mod:`verl_ext.registry` or the actor loss. docs/engine.md.
"""
