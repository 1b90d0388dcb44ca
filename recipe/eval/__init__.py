"""Offline evaluation: sample a checkpoint on the eval sets, then score mean@k / pass@k / maj@k.

``python -m recipe.eval {generate,score} ...`` (docs/evaluation.md): ``generate`` samples and scores responses
with vLLM, ``score`` reads them (or verl's validation dumps) into Markdown tables.
One job per module (each imports only the ones above it):

============================  =====================================================================
``recipe.eval.metrics``       pass@k / mean@k / maj@k estimators, per-benchmark averages (pure)
``recipe.eval.presets``       benchmark names and order, the papers' sampling presets, validation
``recipe.eval.problems``      evaluation parquets, run folders, the reward scorer (shared inputs)
``recipe.eval.generate``      ``generate``: plan, vLLM sampler (the only vLLM import), JSONL writer
``recipe.eval.readers``       ``score``'s inputs: generate files and verl validation dumps
``recipe.eval.tables``        ``score``'s output: metrics per checkpoint, Markdown, mean ± std
``recipe.eval.cli``           argument parsing and the two commands (``__main__`` runs it)
============================  =====================================================================

Who may import it: anyone (CLI users, :mod:`recipe.plots`, tests); it imports :mod:`recipe.reward.score`
lazily (scoring) and vLLM only inside :func:`recipe.eval.generate.vllm_sampler`, never verl_ext. This
``__init__`` imports nothing: import each name from its module.
"""
