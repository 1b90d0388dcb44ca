"""The seam into verl 0.9.1's actor engine: one entry point, :func:`verl_ext.engine.seam.install`.

Everything verl-divclip changes inside verl's actor engine per step -- ERC's fp32 entropy in both passes,
the vocabulary pass, pi_old's top-k for ``kl_full``, the old-log-prob pass packed as the update, the
on-policy flag and the per-step path record -- is installed by :mod:`verl_ext.engine.seam`, which wraps
each verl symbol once after checking it (:mod:`verl_ext.engine.guard`). The modules below the seam are
its features; they compute nothing themselves (the math is :mod:`verl_ext.core`)::

    request          what a loss asks of its engine (EngineRequest), the supported strategies
    guard            the verl symbols the seam relies on, checked at install
    swap             one step's attribute swaps, applied together and restored
    entropy_path     the fp32 entropy's swaps
    vocab_pass_step  the vocabulary pass's swaps (LM head, inputs, outputs)
    topk_capture     pi_old's top-k: stored by the old pass, evaluated in the update
    packing          the old-log-prob pass packed as the update; the on-policy flag
    seam             install(): the wrappers, the engine's features, the order of a step

Imports :mod:`verl_ext.core` and verl; never :mod:`verl_ext.registry` or the actor loss.
"""
