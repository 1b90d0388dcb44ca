"""Every config rule of verl-divclip: each refusal of a combination of config keys, one function per rule.

The one home of the rules, in three files (none over 600 lines): :mod:`.policy` -- the key names and the
policy-loss config against the loss-mode registry (the loss's own check); :mod:`.composed` -- the composed
config, before Ray starts; :mod:`.verl_keys` -- the verl keys the divclip path replaces or never reads (the
refusals :mod:`recipe.verl_keys`' table points at). This ``__init__`` imports nothing.

A *rule* refuses a value of one key given the values of others (``loss_mode`` with ``adaptive_delta_target``,
ERC with ``entropy_coeff``, ``separate_async`` with the rollout pool), or a value the divclip path would drop
without a word (a verl key it replaces or never reads). Every rule is here, each naming the keys it reads in
its error (``ValueError``). Two callers run them: ``recipe.main``'s validation before Ray starts
(:func:`recipe.config_checks.validate_divclip_config`, which reports them as ``ConfigError``), and the loss's
own config check (:func:`check_policy_config`, run by ``DivClipPolicyLossConfig.__post_init__`` once
:mod:`verl_ext.registry` is imported, and by :func:`verl_ext.registry.resolve_policy_config`;
:func:`check_entropy_as_mask`, run by :func:`verl_ext.engine.request.entropy_as_mask`).

Not rules, so not here: a dataclass' checks of its own fields (types, ranges, and which of its own fields
go together), kept in its ``__post_init__`` as verl keeps them (:class:`verl_ext.config.DivClipPolicyLossConfig`,
:func:`verl_ext.config.check_clip_ratios`); the keys of ``rollout.custom.validation``, parsed and refused by
their own feature (:mod:`recipe.validation.length`, which this package may not import); and runtime guards
on what an engine really holds (the seam's).
"""
