"""In-training validation at each benchmark's own response length and sample count.

* :mod:`recipe.validation.length` -- the plan read from ``actor_rollout_ref.rollout.custom.validation``,
  its checks before Ray starts, and the trainer mixin that runs validation per benchmark;
* :mod:`recipe.validation.rollout` -- the agent loop (and its manager) that sends each validation row its
  own ``max_tokens``.

(Checks of a composed config before training are :mod:`recipe.config_checks`.) This ``__init__`` imports
nothing.
"""
