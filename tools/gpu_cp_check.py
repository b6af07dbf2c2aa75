#!/usr/bin/env python
"""Context parallelism on two GPUs: CP=2 equals CP=1, and what it costs (time, memory per rank).

    torchrun --nproc_per_node 2 tools/gpu_cp_check.py --out cp_check.json
    torchrun --nproc_per_node 2 tools/gpu_cp_check.py --tiny          # CPU, gloo, tiny sizes (CI)

Both phases run one full training step (Megatron DDP, forward_backward_no_pipelining with the
per-token GRPO loss, finalize_model_grads) of a few-layer Qwen3-shaped DualKV model:

1. Exactness, float32 (TF32 off): a micro-batch of several groups, CP=1 vs CP=2 with the same
   weights, for both CP variants (K/V all-gather with local queries, and all-to-all heads). CP=1 runs on both ranks as two data-parallel replicas of the same micro-batch (the
   per-token normalisation makes that equal to one rank). Logprobs of every loss edge, the loss
   and every parameter gradient must agree to --rtol (max |diff| / max |reference| per tensor).
2. Cost, bf16: one long group (default N=16, P=32K, R=2K), CP=1 (each rank the whole micro-batch)
   vs CP=2 (each rank its shard; all-gather and all-to-all): median step time over --iters steps after a warm-up step
   (compilation), peak GPU memory per rank, the partition's attention-work imbalance, and the
   bf16 logprob difference CP=2 vs CP=1 (informational: both are bf16). Also the time of one
   layer's K/V all-gather against the rank's attention forward (why it is not overlapped).

The attention backend is the same for both (default flex; the exactness phase runs float32,
which the CUDA kernel does not take).
Rank 0 prints one JSON summary (and writes --out). Exit status 1 when the exactness check fails.
Expected time on two H100s: several minutes, most of it FlexAttention compilation (one per dtype,
head split and local/non-local query configuration); --skip-check / --skip-cost split the run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rank_report import report_and_leave  # noqa: E402 (tools/, the script's folder, is on sys.path)

GIB = 2 ** 30


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU + gloo, tiny model and micro-batches (tests this script)")
    ap.add_argument("--shape", default="16x32768x2048", help="NxPxR of the cost phase's group")
    ap.add_argument("--check-groups", default="4x3000x500,2x1500x700,3x700x300",
                    help="groups NxPxR,... of the float32 exactness phase")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", default="8b", help="qwen3_config size whose shape the model takes (8b, 30b-a3b)")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="vocabulary (Qwen3's 151936 makes float32 logits of 32K edges ~20 GiB at CP=1)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--backend", default="auto", help="attention backend for both CP=1 and CP=2 (auto: the entry point's choice, the CUDA kernel on Hopper)")
    ap.add_argument("--deterministic", action="store_true",
                    help="config.deterministic_mode in the cost phase: the attention's deterministic backward "
                         "(on the CUDA kernel also with CP's local queries)")
    ap.add_argument("--chunks-per-rank", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--check-size", default=None, help="qwen3_config size of the exactness phase (default: --size)")
    ap.add_argument("--skip-check", action="store_true", help="cost phase only")
    ap.add_argument("--skip-cost", action="store_true", help="exactness phase only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.shape = "3x40x12"
        args.check_groups = "3x13x5,2x7x9"
        args.size, args.vocab, args.iters = "tiny", 256, 1
        args.backend = "reference"
    return args


def shapes(spec: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in spec.split(",")]


# ------------------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------------------


def init(tiny: bool):
    if tiny:
        dist.init_process_group("gloo")
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from megatron_cpu import megatron_cpu_shims, patch_cuda_for_cpu  # CPU stand-ins: tests only

        patch_cuda_for_cpu()
        return torch.device("cpu"), megatron_cpu_shims()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", local), contextlib.nullcontext()


@contextlib.contextmanager
def parallel(cp: int, seed: int = 1234):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no dropout
    torch.manual_seed(seed)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()


def make_layout(spec, vocab: int, seed: int):
    from megatron_dualkv.layout import Group, build_layout

    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g)
    return build_layout([Group.of(ids(p), [ids(r) for _ in range(n)]) for n, p, r in spec], vocab_size=vocab)


def rollout_data(layout, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"advantages": torch.randn(layout.num_responses, generator=g),
            "ref_logprobs": -5.5 + 0.5 * torch.randn(layout.num_edges, generator=g)}


# ------------------------------------------------------------------------------------------------
# One configuration: build, load weights, train steps
# ------------------------------------------------------------------------------------------------


def run(args, device, cp: int, dtype, layout, data, weights, iters: int, chunk_multiple: int,
        comm: str = "all_gather", size: str = None) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dualkv.loss import PolicyBatch, PolicyLossConfig, policy_loss
    from megatron_dualkv.megatron import build_dualkv_model, cp_token_count, qwen3_config

    backend = None if args.backend in ("None", "auto") else args.backend
    # Megatron's DDP and the model it wraps form reference cycles: after `del` the previous run's
    # parameters and fp32 gradient buffer (5.9 GiB for 4 8B layers) stay allocated until Python's
    # cyclic GC happens to run, and counted in this run's peak when it had not (the a2a run of the
    # second session). Collect them first; start_gib says what is still allocated.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start_gib = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    with parallel(cp) as pgs:
        cfg = qwen3_config(
            size or args.size, num_layers=args.layers, vocab_size=args.vocab, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, context_parallel_size=cp, use_cpu_initialization=device.type == "cpu",
            calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads,
            deterministic_mode=bool(args.deterministic and dtype == torch.bfloat16),
            **({"cp_comm_type": comm} if cp > 1 else {}),
        )
        model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False, attention_backend=backend,
                                   cp_chunks_per_rank=args.chunks_per_rank, cp_chunk_multiple=chunk_multiple)
        # as Megatron's Float16Module does in training: every parameter in the run's dtype (torch
        # norms are built in float32 otherwise, which keeps RMSNorm off its fused kernel in bf16)
        model.to(device=device, dtype=dtype)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if weights is not None:
                    p.copy_(weights[n].to(device))
        initial = {n: p.detach().cpu() for n, p in model.named_parameters()}
        ddp = DistributedDataParallel(
            cfg.transformer, DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
            model, pg_collection=pgs)
        layout = layout.to(device)
        batch = PolicyBatch(advantages=data["advantages"].to(device), ref_logprobs=data["ref_logprobs"].to(device))
        total = float(layout.num_edges)
        out = {}

        def forward_step(data_iterator, model):
            next(data_iterator)
            lp = model(layout=layout).logprobs
            out["logprobs"] = lp.detach().float().cpu()

            def loss_func(lp):
                loss, _ = policy_loss(lp, batch, layout, PolicyLossConfig(clip_high=0.28, kl_beta=0.05),
                                      global_num_tokens=total)
                out["loss"] = float(loss)
                count = cp_token_count(torch.tensor(layout.num_edges, dtype=torch.int, device=device), pgs.cp)
                return loss * total, count, {"loss": loss.detach()}

            return lp, loss_func

        times = []
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for it in range(iters + 1):  # step 0: warm-up (compilation)
            if it == 1 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ddp.zero_grad_buffer()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
                seq_length=0, micro_batch_size=1, forward_only=False, pg_collection=pgs,
            )
            sync()
            times.append(time.perf_counter() - t0)
        out["step_s"] = statistics.median(times[1:]) if iters else times[0]
        out["warmup_s"] = times[0]
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        out["start_gib"] = start_gib
        out["grads"] = {n: p.main_grad.detach().float().cpu() for n, p in model.named_parameters()}
        out["initial"] = initial
        if cp > 1:
            from megatron_dualkv.cp import cp_partition

            part = cp_partition(layout, cp, args.chunks_per_rank, chunk_multiple)
            out["imbalance"] = part.imbalance
            out["rows_per_rank"] = part.num_local
            if comm == "all_gather":
                out["comm"] = kv_gather_vs_attention(cfg, part.shard(pgs.cp.rank()), pgs.cp, device, dtype, backend)
        del ddp, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return out


def kv_gather_vs_attention(cfg, shard, group, device, dtype, backend) -> dict:
    """Seconds of one layer's K/V all-gather and of the rank's attention forward (same inputs)."""
    from megatron_dualkv.cp import cp_dualkv_attention, gather_rows

    shard = shard.to(device)
    t = cfg.transformer
    n, hq, hkv, d = shard.num_local, t.num_attention_heads, t.num_query_groups, t.kv_channels
    # inputs that require grad: the training-time compiled attention is timed (forward only), no
    # extra compilation for an inference configuration
    q = torch.randn(n, hq, d, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(n, 2 * hkv, d, device=device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, reps=5):
        fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    gather = timed(lambda: gather_rows(kv, shard, group))
    attn = timed(lambda: cp_dualkv_attention(q, kv[:, :hkv], kv[:, hkv:], shard, group, None, backend))
    return {"kv_all_gather_s": gather, "attention_fwd_incl_gather_s": attn, "gather_fraction": gather / attn}


# ------------------------------------------------------------------------------------------------
# Comparisons
# ------------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(ref: dict, got: dict) -> dict:
    grads = {n: rel_err(got["grads"][n], g) for n, g in ref["grads"].items()}
    worst = max(grads, key=grads.get)
    zero = [n for n, g in ref["grads"].items() if not bool(g.abs().max() > 0)]
    return {"logprobs_rel": rel_err(got["logprobs"], ref["logprobs"]),
            "loss_rel": abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
            "grad_rel_max": grads[worst], "grad_rel_worst_param": worst, "zero_reference_grads": zero}


def check_exactness(args, device, chunk_multiple: int, summary: dict) -> None:
    spec = shapes(args.check_groups)
    size = args.check_size or args.size
    layout = make_layout(spec, args.vocab, seed=1)
    data = rollout_data(layout, seed=2)
    ref = run(args, device, 1, torch.float32, layout, data, None, 0, chunk_multiple, size=size)
    summary["exactness_float32"] = {"groups": args.check_groups, "tokens": layout.num_tokens, "size": size}
    for comm in ("all_gather", "a2a"):
        got = run(args, device, 2, torch.float32, layout, data, ref["initial"], 0, chunk_multiple, comm, size=size)
        check = compare(ref, got)
        check["passed"] = (check["logprobs_rel"] <= args.rtol and check["loss_rel"] <= args.rtol
                           and check["grad_rel_max"] <= args.rtol and not check["zero_reference_grads"])
        summary["exactness_float32"][f"cp2_{comm}"] = check


def main():
    args = parse_args()
    device, shims = init(args.tiny)
    if dist.get_world_size() != 2:
        raise SystemExit("run with exactly 2 ranks: torchrun --nproc_per_node 2 tools/gpu_cp_check.py")
    chunk_multiple = 2 if args.tiny else 128
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "model": f"qwen3 {args.size} shape, {args.layers} layers, vocab {args.vocab}", "backend": args.backend,
               "deterministic_cost_phase": args.deterministic}
    ok = True
    with shims:
        # 1. exactness in float32
        if not args.skip_check:
            check_exactness(args, device, chunk_multiple, summary)
            ok = all(v["passed"] for k, v in summary["exactness_float32"].items() if k.startswith("cp2_"))

        # 2. cost in bf16
        if not args.skip_cost:
            spec = shapes(args.shape)
            layout = make_layout(spec, args.vocab, seed=3)
            data = rollout_data(layout, seed=4)
            one = run(args, device, 1, torch.bfloat16, layout, data, None, args.iters, chunk_multiple)
            two = run(args, device, 2, torch.bfloat16, layout, data, one["initial"], args.iters, chunk_multiple)
            a2a = run(args, device, 2, torch.bfloat16, layout, data, one["initial"], args.iters, chunk_multiple, "a2a")
            per_rank = [None, None]
            dist.all_gather_object(per_rank, {
                "cp1_step_s": one["step_s"], "cp2_all_gather_step_s": two["step_s"], "cp2_a2a_step_s": a2a["step_s"],
                "cp1_peak_gib": one["peak_gib"], "cp2_all_gather_peak_gib": two["peak_gib"],
                "cp2_a2a_peak_gib": a2a["peak_gib"], "cp2_all_gather_comm": two["comm"],
                "start_gib": {"cp1": one["start_gib"], "cp2_all_gather": two["start_gib"], "cp2_a2a": a2a["start_gib"]}})
            summary["cost_bf16"] = {
                "shape": args.shape, "tokens": layout.num_tokens, "rows_per_rank_cp2": two["rows_per_rank"],
                "attention_imbalance_cp2": two["imbalance"], "per_rank": per_rank,
                "warmup_s": {"cp1": one["warmup_s"], "cp2_all_gather": two["warmup_s"], "cp2_a2a": a2a["warmup_s"]},
                "speedup_all_gather": one["step_s"] / two["step_s"], "speedup_a2a": one["step_s"] / a2a["step_s"],
                "bf16_vs_cp1": {
                    name: {"logprobs_max_abs_diff": float((x["logprobs"] - one["logprobs"]).abs().max()),
                           "grad_rel_max": compare(one, x)["grad_rel_max"]}
                    for name, x in (("all_gather", two), ("a2a", a2a))},
            }
    report_and_leave(summary, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
