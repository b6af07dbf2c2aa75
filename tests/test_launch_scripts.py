"""The launch scripts of examples/launch, dry: their argument sets pass Megatron's validate_args at
the scripts' world size, and the packer accepts the issue-8 workload (N=32, P=8K, R=2K) at their
token budget within the micro-batches a step runs.

Each script is run with stand-ins for torchrun / srun / scontrol on PATH: torchrun writes the
arguments it was given instead of starting workers. Those arguments go through the training
script's own build_argv + parse_megatron_args (Megatron's parse_and_validate_args and our
check_parallelism) with WORLD_SIZE set, then through the same rollout stream the dataset provider
builds (rollout_stream_from_args: budget rounding, TP padding, FLOP balance weights).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH = os.path.join(ROOT, "examples", "launch")

# torchrun: record the environment variable Megatron checks, then the arguments (one per line; the
# scripts' arguments hold no newline)
FAKE_TORCHRUN = ('#!/usr/bin/env bash\n'
                 'printf "%s\\n" "${CUDA_DEVICE_MAX_CONNECTIONS:-unset}" "$@" > "$LAUNCH_ARGV_OUT"\n')
# srun: drop its own options, run the command (one task, the first node)
FAKE_SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
FAKE_SCONTROL = '#!/usr/bin/env bash\necho node0\n'


def launch_argv(script: str, tmp_path, env: dict | None = None) -> tuple[str, list[str]]:
    """CUDA_DEVICE_MAX_CONNECTIONS as torchrun sees it, and the training script's arguments as the
    launch script passes them to torchrun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("torchrun", FAKE_TORCHRUN), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "argv.txt"
    inherited = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}  # the script sets it
    full_env = {**inherited, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAUNCH_ARGV_OUT": str(out),
                "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "1",
                **(env or {})}
    subprocess.run(["bash", os.path.join(LAUNCH, script), str(tmp_path / "rollouts.parquet"), str(tmp_path / "ckpt")],
                   env=full_env, check=True, timeout=60)
    words = out.read_text().splitlines()
    entry = next(i for i, w in enumerate(words) if w.endswith("pretrain_grpo_dualkv.py"))
    return words[0], words[entry + 1:]


@contextlib.contextmanager
def world(size: int, max_connections: str):
    """WORLD_SIZE / RANK and the launch script's CUDA_DEVICE_MAX_CONNECTIONS for Megatron's argument
    parsing, and the GPU architecture it asks for when TP > 1."""
    sys.path.insert(0, HERE)
    import megatron.training.arguments as arguments
    from megatron.training.global_vars import unset_global_variables
    from megatron_cpu import _patched

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS")}
    os.environ.update(WORLD_SIZE=str(size), RANK="0", LOCAL_RANK="0")
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if max_connections != "unset":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = max_connections
    saved_argv = list(sys.argv)
    try:
        # Hopper: the architecture asked for TP > 1, the capability for --moe-grouped-gemm
        with _patched(arguments, "get_device_arch_version", lambda: 9), \
                _patched(arguments.torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)):
            yield
    finally:
        unset_global_variables()  # parse_and_validate_args sets Megatron's global args once per process
        sys.argv = saved_argv
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def validated_args(launched: tuple[str, list[str]], world_size: int):
    max_connections, argv = launched
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_grpo_dualkv as script

    with world(world_size, max_connections):
        return script.parse_megatron_args(script.build_argv(argv), quiet=True)


@pytest.fixture(scope="module")
def issue8_rollouts(tmp_path_factory):
    """128 groups of the issue-8 shape: 32 responses of 2048 tokens on an 8192-token prompt."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_synthetic_rollouts import make_synthetic_rollouts

    from megatron_dualkv.data import write_rollouts

    path = tmp_path_factory.mktemp("issue8") / "rollouts.parquet"
    write_rollouts(make_synthetic_rollouts(128, 32, 8192, 2048, None, vocab_size=512, seed=0), str(path))
    return str(path)


def first_step_plan(args, rollouts: str):
    """The packing plan of the first rollout batch, built the way datasets_provider builds it."""
    from megatron_dualkv.training.providers import model_shape_from_args, rollout_stream_from_args

    args.rollouts = rollouts
    micro_batches = args.global_batch_size // args.data_parallel_size
    stream = rollout_stream_from_args(args, dp_size=args.data_parallel_size, dp_rank=0,
                                      micro_batches_per_step=micro_batches, shape=model_shape_from_args(args))
    _, plan = stream.plan_batch(0)  # raises when a step needs more micro-batches than it runs
    return plan, micro_batches


# (script, world size, environment, expected degrees, responses per sub-group at the budget)
CASES = {
    "8b": ("qwen3_8b_single_node.sh", 8, {},
           dict(tensor_model_parallel_size=2, data_parallel_size=4, sequence_parallel=True,
                recompute_granularity="full", global_batch_size=4 * 48, seq_length=30720), 11),
    "8b-tp4-no-recompute": ("qwen3_8b_single_node.sh", 8, {"TP": "4", "RECOMPUTE": "none"},
                            dict(tensor_model_parallel_size=4, data_parallel_size=2, sequence_parallel=True,
                                 recompute_granularity=None, global_batch_size=2 * 96), 11),
    "30b-a3b": ("qwen3_30b_a3b_slurm.sh", 16, {},
                dict(tensor_model_parallel_size=4, data_parallel_size=4, sequence_parallel=True,
                     expert_model_parallel_size=8, expert_tensor_parallel_size=1, num_experts=128,
                     moe_router_dtype="fp32",
                     recompute_granularity="full", global_batch_size=4 * 64, seq_length=40960), 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_launch_script_arguments_validate_and_pack_the_issue8_workload(case, tmp_path, issue8_rollouts):
    script, world_size, env, degrees, per_subgroup = CASES[case]
    args = validated_args(launch_argv(script, tmp_path, env), world_size)
    for name, want in degrees.items():
        assert getattr(args, name) == want, f"{script} {env}: {name} = {getattr(args, name)!r}, expected {want!r}"

    plan, micro_batches = first_step_plan(args, issue8_rollouts)
    pieces = [pc for rank in plan.ranks for mb in rank for pc in mb]
    sizes = sorted({len(pc.responses) for pc in pieces}, reverse=True)
    assert sizes[0] == per_subgroup, f"{script}: largest sub-group {sizes[0]} responses, expected {per_subgroup}"
    # the prompt is computed once per sub-group: ceil(32 / per_subgroup) times per group
    assert len(pieces) == args.groups_per_step * -(-32 // per_subgroup)
    assert plan.num_micro_batches_per_rank <= micro_batches
    assert max(pc.tokens for pc in pieces) <= args.max_tokens_per_micro_batch


def test_the_previous_budgets_could_not_hold_the_issue8_workload(tmp_path, issue8_rollouts):
    """Negative control: the 30B script's former 8,192-token budget is refused by the packer."""
    argv = launch_argv("qwen3_30b_a3b_slurm.sh", tmp_path, {"TOKENS_PER_MICRO_BATCH": "8192"})
    args = validated_args(argv, 16)
    with pytest.raises(ValueError, match="does not fit one micro-batch"):
        first_step_plan(args, issue8_rollouts)
