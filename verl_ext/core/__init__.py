"""The method's math, device-agnostic and free of engine code.

Everything the papers define lives here, as functions of tensors: the unified constrained surrogate
(ATR-GRPO Eq. 5) and its constraints, the divergences and their ratio bounds, ERC's entropy-ratio band,
the coarsened full-vocabulary KL of ``kl_full`` (Eq. 4), the cancellation-free fp32 entropy, the chunked
vocabulary pass and the on-policy gauge. None of it imports verl's engines or workers, lazily or not
(``tests/test_layout.py`` checks the source and a fresh interpreter): how the numbers are obtained inside
verl's actor engine is :mod:`verl_ext.engine`'s business.

Modules, each importing only those above it (and torch, :mod:`verl_ext.config`, verl's ``agg_loss``)::

    divergences    per-token divergences, Lambert-W ratio bounds of KL3 and friends
    entropy        entropy_fp32 (cancellation-free, graph-free), chunk sizes
    erc            ERC's ratio rho_t, its band (one NaN rule), the gradient gate, its metrics
    gauge          the on-policy gauge: |log w|, ratio-clip and ERC fractions on an on-policy batch
    coarsened_kl   pi_old's top-k + tail bucket, the coarsened KL, kl_full's metrics
    vocab_pass     log pi, entropy and top-k from the hidden states, logits never materialised
    region         what a constraint is (inputs, trust region, spec) and the CONSTRAINTS table
    constraints    the constraints: clip, gppo, kl3, kl1, kl2, is_kl3, trgppo, seq_kl3, kl_full, dcpo
    surrogate      the Eq. 5 operator, constrained_policy_loss, and its metrics
"""
