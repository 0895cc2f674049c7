"""The defences: what a peer checks before it trusts, stores or trains on what a stranger sent.

The threat model is ``docs/security.md``; this is its map from threat to check (module) and test. A new
defence goes here, with a row in both.

==============================================================  =====================  ==================================================
Threat                                                          Check (module)         Test
==============================================================  =====================  ==================================================
A stranger publishes a policy, or serves a forged manifest      ``trust``              ``tests/unit/guard/test_trust.py``,
(who the run's trainers are: trusted-trainers file or the                              ``tests/integration/test_impostor_trainers.py``,
owner's run record; every manifest signed by one of them)                              ``tests/integration/test_weights_distribution.py``
A sender pushes as fast as it can, or makes the trainer spend   ``quota``              ``tests/unit/guard/test_quota.py``
its CPU and bytes (per-sender token buckets, checked before
a byte is read)
Malformed, oversized, stale, forged-reward, replayed, wrongly   ``rollout_checks``     ``tests/unit/guard/test_rollout_checks.py``,
sampled or held-out rollout groups (schema, shapes, token                              ``tests/unit/fuzz/test_fuzz_rollouts.py``,
ranges, log-prob bounds, versions, prompt rebuilt from its id,                         ``tests/integration/test_poisoned_rollouts.py``
rewards re-scored by the task's verifier)
Valid-looking groups with made-up behaviour log-probs           ``reputation``         ``tests/unit/guard/test_reputation.py``,
(strikes, bans)                                                                        ``tests/integration/test_poisoned_rollouts.py``
Edited completions with true log-probs: tokens that are not     ``sampling_check``     ``tests/unit/guard/test_sampling_check.py``,
samples of the policy (randomised PIT and surprisal per token,                         ``benchmarks/sampling_check.py``
completions left out, a per-sender e-detector strikes)
Honest samplers banned after a large update (the allowance:     ``drift``              ``tests/unit/guard/test_drift.py``
how far the trainer's own policy moved since a group's version)
Feeding the checks above after every step; sharing bans among   ``sender_guard``       ``tests/unit/guard/test_reputation.py``
run's trusted trainers only (``BanRecord``)
==============================================================  =====================  ==================================================

Defences that live with what they guard, because they are part of its format or its loop:

- DHT records (signed by their writer, schema, one per key, bounded expiry; trainer-only keys): the
  validators in ``echo_p2p.net.records`` and ``echo_p2p.net.trainer_writers``; the owner-signed run record
  and rollbacks in ``echo_p2p.net.run_record`` (``tests/unit/test_records.py``,
  ``tests/unit/test_run_record.py``, ``tests/unit/test_trainer_writers.py``,
  ``tests/integration/test_record_security.py``).
- A push's frames, streams and duplicate content (``frame_too_large``, ``too_many_streams``,
  ``duplicate_content``, ``no_signal``, ``not_granted``): ``echo_p2p.transport.rollouts.ingest``
  (``tests/integration/test_rollout_transport.py``, ``tests/unit/transport/test_useless_help.py``);
  grants to strangers: ``echo_p2p.train.pacing`` (``tests/unit/train/test_pacing.py``).
- Weight chunks checked against the signed manifest, bad providers banned, slow providers hedged, dropped
  and banned when slow again and again: ``echo_p2p.transport.weights.fetch``
  (``tests/unit/transport/test_fetch_scheduling.py``, ``tests/unit/transport/test_fetch_rate.py``,
  ``tests/integration/test_weights_distribution.py``).
- Poison that still reaches the loss (completions far from the policy left out, ratio caps, non-finite
  losses and gradients dropped): ``echo_p2p.train.learner`` and ``echo_p2p.train.grpo``
  (``tests/unit/train/test_learner.py``, ``tests/unit/train/test_grpo_loss.py``).

Nothing is imported here: importing the package stays free of hivemind and torch.
"""
