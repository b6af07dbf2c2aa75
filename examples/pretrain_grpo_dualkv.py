"""GRPO/DAPO policy updates on deduplicated (DualKV) packed rollouts, Megatron pretrain-style.

    python examples/pretrain_grpo_dualkv.py            # the embedded default job (same as --demo)
    python examples/pretrain_grpo_dualkv.py --demo --train-iters 8 --no-dualkv   # the default, changed
    torchrun --nproc-per-node 8 examples/pretrain_grpo_dualkv.py --model-size 8b \\
        --rollouts rollouts.parquet --tensor-model-parallel-size 2 --sequence-parallel --bf16 ...
    # long prompts: every micro-batch split over 2 GPUs as well (DualKV context parallelism)
    torchrun --nproc-per-node 8 examples/pretrain_grpo_dualkv.py --model-size 8b ... \\
        --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --max-tokens-per-micro-batch 65536

Megatron's arguments plus ours (megatron_dualkv/training/args.py; docs/TRAINING.md lists them).
With a GPU it runs megatron.training.pretrain() with our model provider (Qwen3 DualKVGPTModel,
dense or MoE; `--no-dualkv`: the stock GPTModel on the replicated batch), dataset provider
(packed micro-batches of the rollout file) and forward_step/loss_func; checkpoints are Megatron's
(--save/--load). Without a GPU (pretrain() asserts CUDA) it runs the same forward_step/loss_func
through Megatron-Core's schedule (get_forward_backward_func) and Megatron's Adam in a plain
loop (megatron_dualkv/training/runner.py), on the CPU runtime of tests/megatron_cpu.py;
checkpoints are then torch.save files (--save/--load, same flags).

The default job: the tiny Qwen3-shaped model (random init, vocab 512, float32), the shipped
rollouts (megatron_dualkv/data/default_rollouts.jsonl), 4 Adam steps of 8 groups each, every
rollout batch used for 2 consecutive updates (old logprobs recorded at its first pass, so the
second update is off-policy and the ratio clips), KL to the initial policy (a frozen copy), with a
progress bar and a line per step: loss, KL, clip fraction, tokens/s, dedup ratio, TFLOP/s, MFU.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

warnings.filterwarnings("ignore", message=".*(Transformer Engine|transformer-engine|Apex|absl|full scope is deprecated|"
                                          "ModelConfig|Could not determine rank).*")
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"

# The embedded default job (what `make demo` runs).
DEMO_ARGV = [
    "--demo", "--model-size", "tiny", "--vocab-size", "512",
    "--groups-per-step", "8", "--max-tokens-per-micro-batch", "512", "--updates-per-batch", "2",
    "--kl-beta", "0.05", "--kl-reference", "initial",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
    "--lr", "3e-3", "--min-lr", "3e-3", "--lr-decay-style", "constant", "--weight-decay", "0.0",
    "--seed", "1234",
]

# Always set: the data path and the loss convention of our forward_step (Megatron must divide by
# the summed counts), and no evaluation (there is no validation set) unless asked for.
FORCED_ARGV = ["--dataloader-type", "external", "--calculate-per-token-loss"]
DEFAULT_ARGV = {"--eval-iters": "0", "--eval-interval": "1000000000"}


def build_argv(argv: list[str]) -> list[str]:
    """User arguments -> full Megatron argv: the default job when none are given (with --demo, the
    default job's flags followed by the given ones, which win), the model preset expanded in front
    (so that flags given after it win), our fixed flags."""
    from megatron_dualkv.training.args import preset_argv

    if not argv or "--demo" in argv:
        argv = list(DEMO_ARGV) + [a for a in argv if a != "--demo"]
    size = _flag_value(argv, "--model-size")
    vocab = _flag_value(argv, "--vocab-size")
    front = preset_argv(size, int(vocab) if vocab else None) if size else []
    per_run = {**DEFAULT_ARGV, "--seq-length": _seq_length(argv, front + argv),
               # Megatron's default "p2p" is TE's ring attention; DualKV CP is all_gather or a2a
               "--cp-comm-type": "all_gather"}
    defaults = [x for flag, value in per_run.items() if _flag_value(argv, flag) is None for x in (flag, value)]
    return front + defaults + argv + FORCED_ARGV + _without_te_argv(argv)


def _seq_length(argv: list[str], full_argv: list[str]) -> str:
    """Megatron requires --seq-length, but our micro-batches have their own lengths: it only has to
    pass Megatron's checks. It is the packed micro-batch budget, capped at --max-position-embeddings
    (Megatron asserts max_position_embeddings >= seq_length, while a packed micro-batch of several
    [prompt | responses] is longer than any position in it: P + N*R tokens, positions < P + R),
    and, under context parallelism, rounded down to a multiple of 2 * cp (Megatron asserts it for
    its zigzag split of one sequence; the DualKV partition pads each micro-batch itself)."""
    length = int(_flag_value(argv, "--max-tokens-per-micro-batch") or 4096)
    max_positions = _flag_value(full_argv, "--max-position-embeddings")
    if max_positions is not None:
        length = min(length, int(max_positions))
    step = 2 * int(_flag_value(argv, "--context-parallel-size") or 1)
    return str(max(step, length // step * step))


def _without_te_argv(argv: list[str]) -> list[str]:
    """Without Transformer Engine: Megatron's local layers and no TE-only fusions."""
    from megatron_dualkv.megatron import transformer_engine_available

    if transformer_engine_available():
        return []
    out = [] if "--transformer-impl" in argv else ["--transformer-impl", "local"]
    return out + ["--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                  "--no-masked-softmax-fusion"]


def _flag_value(argv: list[str], flag: str):
    """The value of the LAST occurrence of `flag` (argparse: the last one wins), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_megatron_args(argv: list[str], quiet: bool):
    """Megatron's parse_and_validate_args on `argv` with our arguments (validation output hidden when quiet)."""
    from megatron.training.arguments import parse_and_validate_args

    from megatron_dualkv.training.args import add_dualkv_args, check_parallelism

    sys.argv = [sys.argv[0]] + argv
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        args = parse_and_validate_args(extra_args_provider=add_dualkv_args)
    check_parallelism(args)
    return args


def rank0_sink(args, print_line=None):
    """Rank 0 prints each step's line (and appends its JSON record to --step-log)."""
    from megatron_dualkv.training.log import step_sink

    if args.rank != 0:
        return None
    return step_sink(print_line or (lambda line: print(line, flush=True)), args.step_log)


# ------------------------------------------------------------------------------------------------
# GPU: megatron.training.pretrain()
# ------------------------------------------------------------------------------------------------

def skip_dataset_helper_build() -> None:
    """pretrain() runs `make` in megatron/core/datasets (initialize._compile_dependencies) and exits
    when it fails; the megatron-core wheel ships those helpers compiled (helpers_cpp) but not their
    Makefile, so it always fails there. Our data path does not use the helpers at all: when the
    compiled module is present, skip the build."""
    import importlib.util

    from megatron.core.datasets import utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        utils.compile_helpers = lambda: None


def run_pretrain(argv: list[str]) -> int:
    import torch
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_dualkv.training.args import loss_config_from_args
    from megatron_dualkv.training.log import StepLog
    from megatron_dualkv.training.providers import datasets_provider, model_provider, model_shape_from_args
    from megatron_dualkv.training.step import OldLogprobCache, PolicyForwardStep, frozen_copy
    from megatron_dualkv.training.throughput import peak_tflops

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    skip_dataset_helper_build()
    args = parse_megatron_args(argv, quiet=False)
    # Neither the initial policy (--kl-reference initial) nor the old logprobs recorded at a rollout
    # batch's first pass (--updates-per-batch) are part of Megatron's checkpoint: refuse a resume
    # that would need them (the CPU runner's checkpoints hold both).
    if args.load and not args.finetune:
        tracker = os.path.join(args.load, "latest_checkpointed_iteration.txt")  # Megatron's tracker file
        text = open(tracker).read().strip() if os.path.isfile(tracker) else "0"
        start = int(text) if text.isdigit() else 0  # "release": a starting point, iteration 0
        if args.kl_reference == "initial" and start > 0:
            raise ValueError(f"--kl-reference initial cannot resume at iteration {start}: the initial policy is not in "
                             f"Megatron's checkpoint; give reference logprobs in the rollouts (--kl-reference data)")
        if start % args.updates_per_batch:
            raise ValueError(f"resuming at iteration {start}, inside a rollout batch of --updates-per-batch "
                             f"{args.updates_per_batch}: the old logprobs of its first pass are not in Megatron's "
                             f"checkpoint; save at multiples of {args.updates_per_batch}")
    log = StepLog(
        model_shape_from_args(args),
        dp_group=lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        world_size=args.world_size, peak_tflops=peak_tflops(args.peak_tflops), dualkv=not args.no_dualkv,
        sink=rank0_sink(args), sync=torch.cuda.synchronize,
    )
    dualkv = not args.no_dualkv
    reference_factory = None
    if args.kl_reference == "initial":
        # a frozen copy of the weights the run starts with (after Megatron's --load), built at the
        # first micro-batch with the same provider and parallel groups: one more model in memory
        reference_factory = lambda core: frozen_copy(
            core, lambda: model_provider(pg_collection=core.pg_collection), dualkv=dualkv, temperature=args.temperature)
    forward_step = PolicyForwardStep(loss_config_from_args(args), dualkv=dualkv, temperature=args.temperature, log=log,
                                     reference_factory=reference_factory,
                                     old_logprobs=OldLogprobCache() if args.updates_per_batch > 1 else None)
    # A step ends when Megatron's optimizer has stepped: close the log's step there (the hook fires
    # once per inner optimizer; the first closes the step, the others find none open).
    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(lambda *_: log.end_step())
    try:
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                 forward_step, model_provider=model_provider)
        log.close()
    finally:
        hook.remove()
    # pretrain() leaves the process groups up (torch warns "destroy_process_group() was not called
    # before program exit" on the GPU runs); tear them down so that their threads are joined before
    # the interpreter exits: a CPU CP=2 run of tests/test_training_context_parallel.py once aborted
    # at exit ("terminate called without an active exception") after finishing its steps.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------
# CPU: Megatron-Core schedule + optimizer in runner.train_steps
# ------------------------------------------------------------------------------------------------

def run_cpu(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from megatron_cpu import cuda_rng_state_on_cpu, megatron_cpu_shims, model_parallel

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    logging.getLogger("megatron").setLevel(logging.WARNING)  # DDP bucket and optimizer-config dumps
    # Megatron's fused bias-dropout-add and SwiGLU are torch.compile'd (jit_fuser): on a CPU that
    # costs ~30 s of C++ compilation for no gain at this size.
    args = parse_megatron_args(argv + ["--no-bias-dropout-fusion", "--no-bias-swiglu-fusion"], quiet=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    try:
        with megatron_cpu_shims(), cuda_rng_state_on_cpu(), \
                model_parallel(tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
                               cp=args.context_parallel_size, etp=args.expert_tensor_parallel_size,
                               seed=args.seed) as pgs:
            return cpu_job(args, pgs)
    finally:
        dist.destroy_process_group()


def cpu_job(args, pgs) -> int:
    """The training job on Megatron-Core's schedule and optimizer (runner.train_steps)."""
    import time

    import torch
    from tqdm import tqdm

    from megatron_dualkv.training.args import loss_config_from_args
    from megatron_dualkv.training.log import StepLog
    from megatron_dualkv.training.providers import (build_policy_model, log_stock_attention, model_config_from_args,
                                                    policy_model_options, rollout_stream_from_args)
    from megatron_dualkv.training.runner import build_ddp_and_optimizer, load_checkpoint, save_checkpoint, train_steps
    from megatron_dualkv.training.step import OldLogprobCache, PolicyForwardStep, ReferencePolicy
    from megatron_dualkv.model_shape import ModelShape

    t_start = time.perf_counter()
    cfg = model_config_from_args(args)
    cfg.transformer.use_cpu_initialization = True
    dualkv = not args.no_dualkv
    torch.manual_seed(args.seed)
    options = policy_model_options(args)
    model = build_policy_model(cfg, dualkv=dualkv, pg_collection=pgs, use_transformer_engine=False, **options)
    if not dualkv:
        log_stock_attention(model)
    reference = None
    if args.kl_reference == "initial":
        ref_model = build_policy_model(cfg, dualkv=dualkv, pg_collection=pgs, use_transformer_engine=False, **options)
        ref_model.load_state_dict(model.state_dict())
        reference = ReferencePolicy(ref_model, dualkv=dualkv, temperature=args.temperature)
    # Megatron's gradient clipping asserts CUDA tensors (clip_grads.py): none on the CPU.
    if args.clip_grad and args.rank == 0:
        print(f"note: --clip-grad {args.clip_grad} ignored on the CPU (Megatron's clipping needs CUDA tensors)")
    ddp, optimizer = build_ddp_and_optimizer(
        model, cfg.transformer, pg_collection=pgs, lr=args.lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=0.0)
    start = 0
    old_cache = OldLogprobCache() if args.updates_per_batch > 1 else None
    if args.load:
        start, extra = load_checkpoint(args.load, ddp, optimizer)
        if reference is not None:
            reference.model.load_state_dict(extra["reference"])
        if old_cache is not None:
            old_cache.load_state_dict(extra.get("old_logprobs", {}))

    dp_size = pgs.dp.size()
    m = args.global_batch_size // (args.micro_batch_size * dp_size)
    shape = ModelShape.of(cfg.transformer, cfg.vocab_size)
    stream = rollout_stream_from_args(args, dp_size=dp_size, dp_rank=pgs.dp.rank(), micro_batches_per_step=m,
                                      shape=shape, updates_per_batch=args.updates_per_batch)
    show = args.rank == 0
    log = StepLog(shape, dp_group=pgs.dp, world_size=args.world_size, peak_tflops=args.peak_tflops,
                  dualkv=dualkv, sink=rank0_sink(args, tqdm.write))
    forward_step = PolicyForwardStep(loss_config_from_args(args), dualkv=dualkv, temperature=args.temperature,
                                     log=log, reference=reference, old_logprobs=old_cache)
    steps = args.train_iters - start
    if show:
        first = stream.step_items(start)[0].totals if steps > 0 else None
        print(f"{'DualKV' if dualkv else 'replicated (--no-dualkv)'} GRPO on CPU (Megatron-Core schedule + "
              f"Megatron Adam): {cfg.transformer.num_layers} layers, hidden {cfg.transformer.hidden_size}, "
              f"{'MoE ' + str(cfg.transformer.num_moe_experts) + ' experts, ' if cfg.transformer.num_moe_experts else ''}"
              f"vocab {cfg.vocab_size}; {args.groups_per_step} groups/step, <= {m} micro-batches/rank of "
              f"<= {args.max_tokens_per_micro_batch} tokens; steps {start + 1}..{args.train_iters}", flush=True)
        if first is not None:
            print(f"step {start + 1} batch: {first.responses} responses, {first.packed_tokens} packed vs "
                  f"{first.replicated_tokens} replicated tokens ({first.dedup_ratio:.2f}x), attention pairs "
                  f"{first.attention_pairs} vs {first.replicated_attention_pairs} "
                  f"({first.replicated_attention_pairs / first.attention_pairs:.2f}x)", flush=True)

    def extra_state() -> dict:
        out = {}
        if reference is not None:
            out["reference"] = reference.model.state_dict()
        if old_cache is not None:
            out["old_logprobs"] = old_cache.state_dict()
        return out

    def on_step(i: int, rec) -> None:
        done = start + i + 1
        if args.save and args.save_interval and done % args.save_interval == 0 and done != args.train_iters:
            save_checkpoint(args.save, done, ddp, optimizer, extra_state())

    train_steps(ddp, optimizer, forward_step, stream.iterate(start_step=start), num_steps=steps,
                num_microbatches=m, log=log, pg_collection=pgs, progress=show, on_step=on_step)
    if args.save and steps > 0:
        path = save_checkpoint(args.save, args.train_iters, ddp, optimizer, extra_state())
        if show:
            print(f"saved checkpoint after step {args.train_iters}: {os.path.dirname(path)}")
    if show and log.history:
        h = log.history
        print(f"done: {len(h)} steps in {time.perf_counter() - t_start:.1f} s (incl. setup); loss "
              f"{h[0].loss:+.5f} -> {h[-1].loss:+.5f}, mean {sum(r.tokens_per_s for r in h) / len(h):,.0f} tok/s "
              f"(replicated-equivalent), dedup {h[-1].dedup_ratio:.2f}x")
    return 0


def main() -> int:
    argv = build_argv(sys.argv[1:])
    import torch

    if torch.cuda.is_available() and os.environ.get("MEGATRON_DUALKV_CPU_RUNNER") != "1":
        return run_pretrain(argv)
    return run_cpu(argv)


if __name__ == "__main__":
    sys.exit(main())
