"""recipe: the runnable recipe around :mod:`verl_ext` -- training entry points, reward, evaluation.

What lives here, one part per name:

* ``main`` (``python -m recipe.main``: verl's trainer with the divclip actor loss), ``trainer``
  (the divclip subclasses of verl's trainer classes, in verl's trainer registry), ``config_checks``
  (fail-fast checks of a composed config, before Ray starts: ``ConfigError`` names the key).
* :mod:`recipe.validation` -- in-training validation at each benchmark's own response length and
  sample count: ``length`` (the plan, its checks, the trainer mixin), ``rollout`` (the agent loop).
* :mod:`recipe.reward` -- the math reward: ``score`` (``reward.custom_reward_function.path``: answer
  extraction and scoring), ``workers`` (math-verify in killable worker processes, its hang-proofing).
* ``sft`` and ``sft_dataset`` -- the SFT stage before RL, through verl's own SFT trainer.
* :mod:`recipe.eval` -- offline evaluation (``python -m recipe.eval generate|score``), a package
  split by job.
* ``plots`` -- training curves and the ERC Figure 3 scatter.
* :mod:`recipe.smoke` -- the CPU smoke run: ``task`` (its generated workload), ``report`` (its verdict).
* :mod:`recipe.bench` -- benchmarks (``python -m recipe.bench``).

Who may import it: its own entry points and tests; neither :mod:`verl_ext` nor :mod:`data_prep`
does. It imports :mod:`verl_ext`, :mod:`data_prep` and verl, never ``tests/``; :mod:`recipe.eval`,
:mod:`recipe.reward` and ``plots`` work without verl's trainer (and without a GPU). This ``__init__``
(and each subpackage's) imports nothing.
"""
