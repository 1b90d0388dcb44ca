"""Every config rule of verl-divclip, one function per refused combination of keys, naming them in its ``ValueError``:
:mod:`.policy` (the policy-loss config against the loss-mode registry), :mod:`.composed` (the composed config before
Ray starts), :mod:`.verl_keys` (the verl keys the divclip path replaces or never reads). A dataclass' checks of its
own fields stay in its ``__post_init__``. This ``__init__`` imports nothing.
"""
