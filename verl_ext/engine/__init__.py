"""The seam into verl 0.9.1's actor engine: one entry point, :func:`verl_ext.engine.seam.install`.

Everything verl-divclip changes inside verl's actor engine per step is installed by :mod:`~verl_ext.engine.seam`,
which wraps each verl symbol once after checking it (:mod:`~verl_ext.engine.guard`). The other modules are its
features and compute nothing themselves (the math is :mod:`verl_ext.core`). Imports :mod:`verl_ext.core` and
verl; never :mod:`verl_ext.registry` or the actor loss. docs/engine.md.
"""
