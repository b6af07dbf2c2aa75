"""Megatron pretrain-style GRPO training on DualKV packed rollouts (docs/TRAINING.md).

    args.py        our command-line arguments, Qwen3 presets as Megatron flags, PP/CP refusal
    providers.py   model_provider / datasets_provider for megatron.training.pretrain()
    data.py        RolloutStepStream: rollout batches -> packed micro-batch slots per step and rank
    step.py        PolicyForwardStep: forward_step + loss_func (DualKV or replicated), reference
                   policy, old-logprob cache
    log.py         StepLog: loss, KL, clip fraction, tokens/s, dedup ratio, TFLOP/s, MFU per step
    throughput.py  device peaks (the step FLOPs are megatron_dualkv.model_shape's)
    runner.py      the loop on Megatron-Core's schedule and optimizer (CPU path), checkpoints

The script is examples/pretrain_grpo_dualkv.py. Importing this package imports nothing heavy;
its modules import megatron.core where they need it.
"""
