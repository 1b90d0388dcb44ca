"""Every config rule of verl-divclip: each refusal of a combination of config keys, one function per rule.

:mod:`.policy` checks the key names and the policy-loss config against the loss-mode registry (the loss's own
check), :mod:`.composed` the composed config before Ray starts, :mod:`.verl_keys` the verl keys the divclip path
replaces or never reads. Each rule names the keys it reads in its ``ValueError``; a dataclass' checks of its own
fields stay in its ``__post_init__``. This ``__init__`` imports nothing.
"""
