"""In-training validation at each benchmark's own response length and sample count.

* :mod:`recipe.validation.length` -- the plan read from ``actor_rollout_ref.rollout.custom.validation``,
  its checks before Ray starts, and the trainer mixin that runs validation per benchmark;
* :mod:`recipe.validation.rollout` -- the agent loop (and its manager) giving each row its own ``max_tokens``.

This ``__init__`` imports nothing.
"""
