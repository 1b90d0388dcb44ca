"""verl_ext: the divclip method as verl 0.9.1 extensions (policy losses, actor loss, config, plugin).

The method core is device-agnostic and lives at the top of the package:

* ``losses`` -- Eq. (5): one constrained-surrogate operator; each method (Clip, KL3/ATR, KL1/KL2,
  IS-KL3, TRGPPO, DCPO, GPPO, ERC, dual-clip) a small constraint registered with verl's
  ``POLICY_LOSS_REGISTRY``.
* ``divergences`` -- the per-token divergences and their ratio bounds (Lambert-W for KL3).
* ``erc`` -- ERC's entropy-ratio band and gradient gate, one implementation for the divclip
  operator and verl's own modes.
* ``config`` -- ``DivClipPolicyLossConfig``, the dataclass verl composes ``policy_loss.*`` into;
  it checks its values alone. ``losses.check_policy_config`` checks a config against the mode
  registry (known ``loss_mode``, adaptive delta on KL-budget modes, ERC / dual-clip on verl's modes).
* ``actor_loss`` -- the entropy-aware actor loss installed with ``set_loss_fn`` (ERC needs both
  entropies, which verl's loss registry does not pass).
* ``entropy`` -- the one fp32 entropy function both of ERC's passes use (pi_old and pi_theta), and
  the hook that installs it on verl's engine; runs without ERC keep verl's entropy.
* ``onpolicy`` -- under ERC the old-log-prob pass packed as the update's first epoch (on-policy
  logits bit-identical in every packing), and the ``onpolicy/*`` gauge of the first mini-batch.
* ``vocab_pass`` -- the chunked LM-head pass (log-probs, the fp32 entropy and top-k from the final
  hidden states, logits never materialised); ``vocab_pass_engine`` -- its hook into verl's engine
  (``policy_loss.vocab_pass``).
* ``full_kl`` -- pi_old's top-k stored by the old-log-prob pass, pi_theta's log-masses on it in the
  update (one engine hook, on verl's logits or on the vocabulary pass), and the coarsened
  full-vocabulary KL of ``kl_full`` (ATR-GRPO Eq. 4).
* ``verl_modes`` -- ERC and dual-clip on verl's own losses; ``adaptive_delta`` -- the opt-in
  controller of the KL budget delta (ATR section 6.5); ``token_dump`` -- the opt-in per-token
  dump for ERC's Figure 3.
* ``plugin`` -- the ``verl.plugins`` entry point: registers the modes in every process that
  imports verl.

:mod:`verl_ext.cpu` holds the support for running verl without a GPU (platform, Ray resource
check, ``hf_cpu`` rollout); only ``plugin`` imports it, and only under ``VERL_PLATFORM=cpu``.

Who may import it: :mod:`recipe`, benchmarks, tests and verl itself (through the plugin). It
imports verl and torch, never :mod:`recipe` or :mod:`data_prep`; its core modules never import
:mod:`verl_ext.cpu`. This ``__init__`` imports nothing, so ``import verl_ext.x`` loads only ``x``
and what it needs.

Inside the package imports run one way (``tests/test_layout.py`` parses them, lazy ones included,
and asserts that they form exactly this graph and that it has no cycle)::

    config        -> (verl and the standard library only: a leaf)
    divergences, entropy, token_dump -> (no verl_ext module)
    erc           -> config
    full_kl       -> config, entropy, vocab_pass, vocab_pass_engine
    losses        -> config, divergences, erc, full_kl
    verl_modes    -> config, erc, losses
    adaptive_delta -> config, losses
    onpolicy      -> entropy
    vocab_pass    -> entropy
    vocab_pass_engine -> entropy, vocab_pass
    actor_loss    -> config, entropy, full_kl, losses, onpolicy, token_dump, verl_modes, vocab_pass_engine
    plugin        -> losses; cpu (only under VERL_PLATFORM=cpu)

``config`` still runs the registry's check at construction: ``losses`` registers
``check_policy_config`` with ``config.register_mode_check`` when it is imported (every process
that imports verl imports it, through the plugin), and every consumer of a config calls it too.
"""
