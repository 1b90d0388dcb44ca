"""The CPU smoke run (``bash launch/run_smoke_cpu.sh``): verl's real trainer end to end on a tiny model.

* :mod:`recipe.smoke.task` -- ``python -m recipe.smoke.task``: the generated workload (prompts, the tiny
  random Qwen3, its tokenizer);
* :mod:`recipe.smoke.report` -- ``python -m recipe.smoke.report``: the run's verdict (curves, margin, gauge).

This ``__init__`` imports nothing.
"""
