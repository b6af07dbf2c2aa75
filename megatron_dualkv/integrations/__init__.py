"""Adapters to RL frameworks (import the submodule you need: `megatron_dualkv.integrations.nemo_rl`)."""
