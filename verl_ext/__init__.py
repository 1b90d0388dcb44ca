"""verl_ext: the divclip method as verl 0.9.1 extensions -- its math, its place in verl's registry, its
actor loss, and the one seam into verl's engine.

The folders show the design:

* :mod:`verl_ext.core` -- the method's math, device-agnostic, importing no engine code: the unified
  constrained surrogate (ATR-GRPO Eq. 5) and its constraints, the divergences, ERC's band, the coarsened
  KL of ``kl_full`` (Eq. 4), the fp32 entropy, the vocabulary pass and the on-policy gauge.
* :mod:`verl_ext.engine` -- the one guarded seam into verl's actor engine
  (:func:`verl_ext.engine.seam.install`): ERC's fp32 entropy in both passes, the vocabulary pass, pi_old's
  top-k, the old-log-prob pass packed as the update, the on-policy flag, the per-step path record.
* :mod:`verl_ext.cpu` -- verl without a GPU (platform, Ray resource check, ``hf_cpu`` rollout); only
  ``plugin`` imports it, and only under ``VERL_PLATFORM=cpu``.

and beside them, the glue to verl's trainer-side APIs:

* ``config`` -- ``DivClipPolicyLossConfig``, the dataclass verl composes ``policy_loss.*`` into; it
  checks its values alone (a leaf: verl and the standard library).
* ``config_rules`` -- every config rule (a refusal of a combination of keys), one function each: the
  policy-loss config against the loss-mode registry, the composed config before Ray starts, and the verl
  keys the divclip path replaces or never reads.
* ``registry`` -- the constraints in verl's ``POLICY_LOSS_REGISTRY`` (never shadowing verl's own), the
  entry for ERC on verl's own modes, and the inputs the actor loss supplies to them for one ``ppo_loss`` call.
* ``verl_modes`` -- ERC on verl's own losses, and what each of them reads; ``knobs`` -- the knobs every loss
  mode and feature declares it reads (``config_rules`` refuses the rest); ``adaptive_delta`` -- the opt-in controller
  of the KL budget delta (ATR section 6.5); ``token_dump`` -- the per-token dump for ERC's Figure 3.
* ``actor_loss`` -- the loss installed with ``set_loss_fn``: verl's own ``ppo_loss`` with what its registry
  signature lacks (both entropies, pi_old's top-k) supplied to the registered function, plus the on-policy
  gauge and path metrics; it declares what its engine must do and installs the seam in the worker.
* ``plugin`` -- the ``verl.plugins`` entry point: registers the modes in every process that imports verl.

Who may import it: :mod:`recipe`, benchmarks, tests and verl itself (through the plugin). It imports verl
and torch, never :mod:`recipe` or :mod:`data_prep`. This ``__init__`` imports nothing, so
``import verl_ext.x`` loads only ``x`` and what it needs.

Imports run one way (``tests/test_layout.py`` parses them, lazy ones included, and asserts that they form
exactly this graph -- a subpackage is one node -- and that it has no cycle; only ``engine`` and ``cpu``
import verl's engine or worker modules)::

    config        -> (verl and the standard library only: a leaf)
    token_dump    -> (no verl_ext module)
    core          -> config
    engine        -> core
    config_rules  -> config, core, engine, knobs
    registry      -> config, config_rules, core, verl_modes
    verl_modes    -> config, core
    knobs         -> config, core, verl_modes
    adaptive_delta -> config, config_rules, core
    actor_loss    -> config, config_rules, core, engine, registry, token_dump, verl_modes
    plugin        -> core, registry; cpu (only under VERL_PLATFORM=cpu)

``config`` still runs the registry's check at construction: ``config_rules.policy`` registers
``check_policy_config`` with ``config.register_mode_check`` when it is imported (``registry`` imports it, and
every process that imports verl imports that, through the plugin), and every consumer of a config calls it too.
"""
