"""recipe: the runnable recipe around :mod:`verl_ext` -- training entry points, reward, evaluation.

What lives here:

* ``main`` (``python -m recipe.main``: verl's trainer with the divclip actor loss), ``trainer``
  (the ``PPOTrainerSync`` subclass / task runner), ``validation`` (fail-fast config checks),
  ``validation_length`` / ``validation_rollout`` (in-training validation at each benchmark's own
  response length and sample count).
* ``sft`` and ``sft_dataset`` -- the SFT stage before RL, through verl's own SFT trainer.
* ``reward`` -- the math reward (``reward.custom_reward_function.path``): answer extraction and
  scoring; ``reward_workers`` -- math-verify in killable worker processes, its hang-proofing.
* :mod:`recipe.eval` -- offline evaluation (``python -m recipe.eval generate|score``), a package
  split by job.
* ``plots`` -- training curves and the ERC Figure 3 scatter; ``smoke_task`` / ``smoke_report`` --
  the CPU smoke run's generated workload and its verdict.
* :mod:`recipe.bench` -- benchmarks (``python -m recipe.bench``).

Who may import it: its own entry points and tests; neither :mod:`verl_ext` nor :mod:`data_prep`
does. It imports :mod:`verl_ext`, :mod:`data_prep` and verl, never ``tests/``; :mod:`recipe.eval`,
``reward`` and ``plots`` work without verl's trainer (and without a GPU). This ``__init__``
imports nothing.
"""
