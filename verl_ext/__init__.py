"""verl_ext: the divclip method as verl 0.9.1 extensions.

* :mod:`verl_ext.core` -- the method's math, device-agnostic, importing no engine code.
* :mod:`verl_ext.engine` -- the one guarded seam into verl's actor engine (:func:`verl_ext.engine.seam.install`).
* :mod:`verl_ext.cpu` -- verl without a GPU; only ``plugin`` imports it, and only under ``VERL_PLATFORM=cpu``.
* ``config`` -- ``DivClipPolicyLossConfig``, the dataclass verl composes ``policy_loss.*`` into.
* ``config_rules`` -- every config rule (a refusal of a combination of keys), one function each.
* ``registry`` -- the constraints in verl's ``POLICY_LOSS_REGISTRY`` (never shadowing verl's own) and the
  inputs the actor loss supplies them for one ``ppo_loss`` call; ``verl_modes`` -- ERC on verl's own losses.
* ``knobs`` -- the knobs every mode and feature reads; ``adaptive_delta`` -- the opt-in controller of delta
  (ATR Sec. 6.5); ``token_dump`` -- the per-token dump for ERC's Figure 3.
* ``actor_loss`` -- the loss installed with ``set_loss_fn``: verl's ``ppo_loss`` with what its registry signature
  lacks supplied, plus the on-policy gauge and path metrics; it installs the seam in the worker.
* ``plugin`` -- the ``verl.plugins`` entry point: registers the modes in every process that imports verl.

Imported by :mod:`recipe`, benchmarks, tests and verl (through the plugin); imports verl and torch, never
:mod:`recipe` or :mod:`data_prep`. This ``__init__`` imports nothing, so ``import verl_ext.x`` loads only ``x``.

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
