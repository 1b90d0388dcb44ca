"""The method's math, device-agnostic and free of engine code.

Everything the papers define lives here, as functions of tensors: the ATR-GRPO Eq. 5 surrogate and its
constraints, the divergences and their ratio bounds, ERC's entropy-ratio band, ``kl_full``'s coarsened KL (Eq. 4),
the fp32 entropy, the vocabulary pass and the on-policy gauge. None of it imports verl's engines or workers
(``tests/test_layout.py``); how the numbers are obtained inside verl's actor engine is :mod:`verl_ext.engine`'s.
"""
