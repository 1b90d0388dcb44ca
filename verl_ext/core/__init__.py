"""The method's math as functions of tensors, device-agnostic: the ATR-GRPO Eq. 5 surrogate and its constraints,
the divergences and their ratio bounds, ERC's band, ``kl_full``'s coarsened KL (Eq. 4), the fp32 entropy, the
vocabulary pass and the on-policy gauge. None of it imports verl's engines or workers (:mod:`verl_ext.engine` does).
"""
