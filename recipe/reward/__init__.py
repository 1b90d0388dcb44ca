"""The math reward and its hang-proofing.

* :mod:`recipe.reward.score` -- what verl calls (``reward.custom_reward_function.path=recipe/reward/score.py``,
  ``name=compute_score``): anchored answer extraction and scoring;
* :mod:`recipe.reward.workers` -- math-verify in killable worker processes (a timeout, not a hung reward loop).

This ``__init__`` imports nothing: a math-verify worker process loads only ``workers``.
"""
