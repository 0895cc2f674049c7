"""GRPO training, pure ML (no networking): what a trainer learns from and how (what it refuses is
``echo_p2p.guard``).

- ``config``: ``GRPOConfig`` (the update's hyper-parameters), ``OptimizerConfig`` (the AdamW of trainer peers
  and the co-located loop) and ``DerivedSettings`` (what the loss takes from the run, not from a setting);
  validated without torch.
- ``grpo``: advantages, per-token log-probs, the clipped GRPO loss and its KL term (pure functions).
- ``batching``: scored groups -> right-padded tensors and micro-batches.
- ``memory``: bytes per token of a forward/backward; the micro-batch token limit of a memory budget.
- ``learner``: ``Learner`` (forward/backward with gradient accumulation, drift probes).
- ``reference``: the frozen starting policy of the KL penalty.
- ``scored``: ``ScoredGroup``, a validated group with the rewards the trainer re-computed.
- ``buffer``: ``ReplayBuffer`` (staleness policy); pure Python, no torch.
- ``pacing``: how many groups a trainer grants each sender (the async swarm's pacing rule).
- ``journal``: acknowledged groups on disk until used (a killed trainer loses none).
- ``checkpoint``: atomic policy + optimizer checkpoints.
- ``evaluation``: held-out evaluation on a schedule with a time budget.
- ``trackers``: TensorBoard / wandb figures under TRL's names.

Used by the trainer peer and the co-located loop. Names are imported from the module that defines them;
nothing is imported here, so ``import echo_p2p.train.buffer`` (the trainer's ingest path) never imports torch.
"""
