"""Benchmarks: ``python -m recipe.bench <name> [--json] ...``.

Every benchmark measures its baseline in the same process/run and prints ratios against it,
so figures stay comparable across machines. Results are recorded in docs/benchmarks.md.

What lives here: ``harness`` (verl's actor ``TrainingWorker`` built from a config, a synthetic
rollout batch, the old-log-prob pass and one update, on 1..N spawned ranks: the probes' engine and
the tests'), ``features`` (engine features declared on verl's plain loss; the path an engine took),
``child`` (run a variant in a fresh process, read its JSON line; the memory benches' RSS readings
and glibc settings), ``losses`` (forward+backward time of every divclip mode against verl's
``vanilla``), ``entropy_memory`` (peak host memory of an actor update with and without the
current-policy entropy), ``reward`` (reward throughput, ours against verl's), ``gpu`` (ERC's entropy
path against verl's on one CUDA GPU at bf16, FSDP1 and FSDP2), ``acceptance`` (every GPU figure beside its
target: ``gpu --acceptance``; its two child runs in ``acceptance_runs``, its targets and report in
``acceptance_report``), ``gpu_workload`` (the model shape and loss configs both share), ``onpolicy`` (ERC's
on-policy exactness under the configs' packings: the noise's source and the alignment's cost), ``full_kl``
(``kl_full``'s update against ``kl3``'s; bytes of the stored top-k), ``topk_tail`` (a checkpoint's
mass outside its top-k on teacher-forced solutions: what ``kl_full_top_k`` is chosen from),
``trainer_modes`` (samples per second of verl's sync and async trainer modes on the CPU smoke, and their
staleness);
``__main__`` dispatches by name.

Who may import it: only its own ``__main__`` and tests; nothing in :mod:`verl_ext` or the rest of
:mod:`recipe` depends on it. It imports :mod:`verl_ext`, :mod:`recipe.reward.score` and verl, never
``tests/``: every probe runs from an installed wheel (``tests/test_installed_wheel.py`` runs one there).
"""
