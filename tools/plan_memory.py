"""Per-GPU memory and step time of a GRPO policy update, DualKV and stock, for a Megatron layout.

    # one configuration, DualKV and the replicated (stock) batch side by side
    python tools/plan_memory.py --model 30b-a3b --ep 8 --dp 16 --n 32 --p 8192 --r 2048 \\
        --responses-per-micro-batch 4 --recompute full
    # explicit shape instead of a preset
    python tools/plan_memory.py --layers 36 --hidden 4096 --ffn 12288 --heads 32 --query-groups 8 \\
        --kv-channels 128 --vocab 151936 --tp 2 --dp 4 --n 32 --p 8192 --r 2048 --max-tokens 40960
    # choose the degrees: every layout of --world GPUs that fits, fastest predicted step first
    python tools/plan_memory.py --model 30b-a3b --sweep --world 16 --n 32 --p 8192 --r 2048
    # a rollout file packed exactly as examples/pretrain_grpo_dualkv.py packs it (its first step),
    # DualKV and its --no-dualkv baseline (local spec: unfused attention), as docs/PLANNER.md compares
    python tools/plan_memory.py --model 8b --layers 4 --tp 2 --rollouts r.parquet --groups-per-step 8 \
        --max-tokens 16384 --no-distributed-optimizer --stock-logits edges --stock-attention unfused

The model behind it is megatron_dualkv/planner.py; docs/PLANNER.md states every formula and
every assumed rate. Times are predictions from assumed achieved rates, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.filterwarnings("ignore")

from megatron_dualkv.planner import (  # noqa: E402
    GIB, RECOMPUTE, Hardware, Implementation, ModelShape, Parallel, Workload, make_plan, packed_step, sweep,
)

PRESETS = ("tiny", "tiny-moe", "8b", "30b-a3b")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model (a preset, or every shape flag)")
    m.add_argument("--model", choices=PRESETS, default=None, help="qwen3_config preset")
    for flag, help_ in (("layers", "num_layers"), ("hidden", "hidden_size"), ("ffn", "ffn_hidden_size"),
                        ("heads", "attention heads"), ("query-groups", "KV heads"), ("kv-channels", "head dim"),
                        ("vocab", "vocabulary"), ("experts", "MoE experts (0: dense)"), ("topk", "MoE top-k"),
                        ("moe-ffn", "moe_ffn_hidden_size")):
        m.add_argument(f"--{flag}", type=int, default=None, help=help_ + " (overrides the preset)")
    p = ap.add_argument_group("parallel layout (PP = 1)")
    for flag in ("tp", "cp", "dp", "ep", "etp"):
        p.add_argument(f"--{flag}", type=int, default=1)
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (default: on when tp > 1)")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--cp-comm", choices=("all_gather", "a2a"), default="all_gather")
    w = ap.add_argument_group("work of one step")
    w.add_argument("--n", type=int, default=32, help="responses per group")
    w.add_argument("--p", type=int, default=8192, help="prompt tokens")
    w.add_argument("--r", type=int, default=2048, help="tokens per response")
    w.add_argument("--groups-per-step", type=int, default=16)
    w.add_argument("--responses-per-micro-batch", type=int, default=None,
                   help="DualKV: sub-groups of this many responses (each with the prompt); stock: sequences")
    w.add_argument("--groups-per-micro-batch", type=int, default=1)
    w.add_argument("--max-tokens", type=int, default=None, help="token budget of a micro-batch (packer's)")
    w.add_argument("--rollouts", default=None,
                   help="plan this rollout file's first step as the training script packs it (--groups-per-step, "
                        "--max-tokens, --packing-seed, padding to TP under SP) instead of uniform N, P, R")
    w.add_argument("--packing-seed", type=int, default=0, help="with --rollouts: the training script's --packing-seed")
    w.add_argument("--recompute", choices=RECOMPUTE, default="none")
    mode = w.add_mutually_exclusive_group()
    mode.add_argument("--no-dualkv", action="store_true", help="stock (replicated) batch only")
    mode.add_argument("--dualkv-only", action="store_true")
    i = ap.add_argument_group("implementation")
    i.add_argument("--norm", choices=("fused", "composite"), default="fused")
    i.add_argument("--rope", choices=("unfused", "fused"), default="unfused")
    i.add_argument("--swiglu", choices=("fused", "unfused"), default="fused")
    i.add_argument("--with-entropy", action="store_true")
    i.add_argument("--stock-logits", choices=("all_rows", "edges"), default="all_rows",
                   help="stock loss: Megatron's cross entropy over every row, or our --no-dualkv baseline (edges)")
    i.add_argument("--stock-attention", choices=("flash", "unfused"), default="flash",
                   help="stock core attention: TE/cuDNN flash, or Megatron's local unfused DotProductAttention "
                        "(what --no-dualkv runs without Transformer Engine)")
    i.add_argument("--expert-impl", choices=("sequential", "stacked"), default="sequential",
                   help="MoE experts: sequential (SequentialMLP, or TE's grouped experts) or stacked "
                        "(--moe-grouped-gemm without TE: each MoE layer keeps its stacked expert weights)")
    i.add_argument("--logits-chunk-rows", type=int, default=None,
                   help="the model's opt-in --logits-chunk-rows: logits computed and recomputed in chunks of rows")
    h = ap.add_argument_group("hardware and assumed rates (defaults: docs/PLANNER.md)")
    for f in dataclasses.fields(Hardware):
        if f.name != "name":
            h.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    s = ap.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true", help="rank every layout of --world GPUs that fits")
    s.add_argument("--world", type=int, default=8)
    s.add_argument("--max-cp", type=int, default=16)
    s.add_argument("--top", type=int, default=12, help="rows of the sweep table per mode")
    s.add_argument("--no-cp", action="store_true", help="sweep without context parallelism (what the script runs today)")
    return ap.parse_args(argv)


def shape_from(args) -> ModelShape:
    explicit = dict(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                    num_attention_heads=args.heads, num_query_groups=args.query_groups, kv_channels=args.kv_channels,
                    vocab_size=args.vocab, moe_router_topk=args.topk, moe_ffn_hidden_size=args.moe_ffn)
    explicit = {k: v for k, v in explicit.items() if v is not None}
    if args.experts is not None:
        explicit["num_moe_experts"] = args.experts or None
    if args.model is not None:
        base = dataclasses.asdict(ModelShape.preset(args.model))
        return ModelShape(**{**base, **explicit})
    need = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "vocab_size")
    missing = [k for k in need if k not in explicit]
    if missing:
        raise SystemExit(f"give --model or every shape flag; missing {missing}")
    return ModelShape(**explicit)


def hardware_from(args) -> Hardware:
    return Hardware(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware) if f.name != "name"})


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def describe(plan) -> dict:
    """One column of the single-configuration table."""
    m, t = plan.memory, plan.time
    mb = plan.largest
    return {
        "micro-batch at the peak": f"{mb.what}: {mb.tokens} tokens, {mb.logit_rows} logit rows",
        "micro-batches per DP rank": str(plan.micro_batches_per_rank),
        "weights bf16 GiB": gib(m["weights"]),
        "Megatron global buffer GiB": gib(m["buffers"]),
        "main grads fp32 GiB": gib(m["grads"]),
        "Adam fp32 (master, m, v) GiB": gib(m["optimizer"]),
        "activations saved GiB": gib(m["activations"]),
        "logits held fp32 GiB": gib(m["logits"]),
        "transient peak GiB": gib(m["transient"]),
        "total GiB (+reserve)": f"{gib(m['total'])} (+{plan.hw.reserve_gib:.0f}) / {plan.hw.memory_gib:.0f}",
        "fits": "yes" if plan.fits else "NO",
        "useful TFLOP per step": f"{plan.flops['useful'] / 1e12:.0f}",
        "executed TFLOP per step": f"{plan.flops['executed'] / 1e12:.0f}",
        "time: dense / expert / logits s": f"{t['dense']:.2f} / {t['expert']:.2f} / {t['logits']:.2f}",
        "time: attention s": f"{t['attention']:.2f}",
        "time: element-wise passes (HBM) s": f"{t['memory_bound']:.2f}",
        "time: TP / CP / EP comm s": f"{t['tp_comm']:.2f} / {t['cp_comm']:.2f} / {t['ep_comm']:.2f}",
        "time: grad sync + optimizer s": f"{t['grad_sync'] + t['optimizer']:.2f}",
        "step time s (predicted)": f"{plan.step_time_s:.2f}",
        "MFU (dedup FLOPs)": f"{100 * plan.mfu:.1f}%",
        "useful tokens/s": f"{plan.useful_tokens_per_s:,.0f}",
    }


def print_single(args, shape, hw) -> None:
    par = Parallel(tp=args.tp, cp=args.cp, dp=args.dp, ep=args.ep, etp=args.etp, sp=False if args.no_sp else None,
                   distributed_optimizer=not args.no_distributed_optimizer, cp_comm=args.cp_comm)
    impl = implementation_from(args)
    modes = [False] if args.no_dualkv else [True] if args.dualkv_only else [True, False]
    packed = packed_rollouts(args, shape, par) if args.rollouts else None
    cols, notes = {}, []
    for dualkv in modes:
        if packed is not None:
            records, packing, pad = packed
            work = packed_step(records, packing, dualkv, pad, name=os.path.basename(args.rollouts))
        else:
            work = Workload(n=args.n, p=args.p, r=args.r, groups_per_step=args.groups_per_step, dualkv=dualkv,
                            responses_per_micro_batch=args.responses_per_micro_batch,
                            groups_per_micro_batch=args.groups_per_micro_batch, max_tokens=args.max_tokens)
        plan = make_plan(shape, par, work, args.recompute, impl, hw)
        cols["DualKV" if dualkv else "stock (replicated)"] = describe(plan)
        notes += [n for n in plan.notes if n not in notes]
    what = (f"{args.rollouts}: {len(packed[0])} groups packed at {args.max_tokens} tokens per micro-batch" if packed
            else f"N={args.n} P={args.p} R={args.r}, {args.groups_per_step} groups per step")
    print(f"# {shape.name}: {shape.total_params() / 1e9:.2f}B parameters ({shape.active_params_per_token() / 1e9:.2f}B "
          f"active per token in the layers); {par.label()} on {par.world} x {hw.name}; {what}; recompute {args.recompute}\n")
    names = list(cols)
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in next(iter(cols.values())):
        print(f"| {row} | " + " | ".join(cols[n][row] for n in names) + " |")
    for n in notes:
        print(f"\nnote: {n}")


def implementation_from(args) -> Implementation:
    return Implementation(norm=args.norm, rope=args.rope, swiglu=args.swiglu, with_entropy=args.with_entropy,
                          stock_logits=args.stock_logits, logits_chunk_rows=args.logits_chunk_rows,
                          stock_attention=args.stock_attention, experts=args.expert_impl)


def packed_rollouts(args, shape, par):
    """(records, packing plan, padding multiple) of the rollout file's first step, packed by the
    training script's own code (training.data.RolloutStepStream) with its budgets and balance."""
    from megatron_dualkv.data import read_rollouts
    from megatron_dualkv.packing import PackingConfig, flop_work_weights
    from megatron_dualkv.training.data import RolloutStepStream

    if args.max_tokens is None:
        raise SystemExit("--rollouts needs --max-tokens (the training script's --max-tokens-per-micro-batch)")
    pad = par.tp if par.sp and par.tp > 1 else 1  # training.args.pad_to_multiple
    records = read_rollouts(args.rollouts, vocab_size=shape.vocab_size)
    weights = flop_work_weights(shape.num_layers, shape.num_attention_heads, shape.kv_channels,
                                shape.token_matmul_flops() / 2.0)
    cfg = PackingConfig(max_tokens=(args.max_tokens // pad) * pad, dp_size=par.dp, pad_to_multiple=pad,
                        vocab_size=shape.vocab_size, seed=args.packing_seed, **weights)
    stream = RolloutStepStream(records, groups_per_step=args.groups_per_step, micro_batches_per_step=len(records) * 64,
                               packing=cfg, dp_rank=0, seed=args.packing_seed)
    step_records, plan = stream.plan_batch(0)
    return step_records, plan, pad


def print_sweep(args, shape, hw) -> None:
    impl = implementation_from(args)
    modes = (False,) if args.no_dualkv else (True,) if args.dualkv_only else (True, False)
    plans = sweep(shape, args.world, args.n, args.p, args.r, args.groups_per_step, modes, impl, hw,
                  max_cp=1 if args.no_cp else args.max_cp)
    print(f"# {shape.name} on {args.world} x {hw.name}: N={args.n} P={args.p} R={args.r}, {args.groups_per_step} "
          f"groups per step; fastest predicted step first (best recomputation and micro-batch per layout)\n")
    for dualkv in modes:
        rows = [pl for pl in plans if pl.workload.dualkv == dualkv]
        print(f"## {'DualKV' if dualkv else 'stock (replicated)'}: {len(rows)} layouts fit\n")
        if not rows:
            print("nothing fits\n")
            continue
        print("| # | layout | recompute | micro-batch | mb/rank | GiB | act+logits GiB | step s | MFU | "
              "attn s | expert+dense s | comm s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for i, pl in enumerate(rows[: args.top], 1):
            m, t = pl.memory, pl.time
            comm = t["tp_comm"] + t["cp_comm"] + t["ep_comm"] + t["grad_sync"]
            print(f"| {i} | {pl.parallel.label()} | {pl.recompute} | {pl.largest.what} | {pl.micro_batches_per_rank} | "
                  f"{gib(m['total'])} | {gib(m['activations'] + m['logits'] + m['transient'])} | "
                  f"{pl.step_time_s:.2f} | {100 * pl.mfu:.1f}% | {t['attention']:.2f} | "
                  f"{t['expert'] + t['dense'] + t['logits']:.2f} | {comm:.2f} |")
        print()
    if len(modes) == 2:
        best = {d: next((pl for pl in plans if pl.workload.dualkv == d), None) for d in modes}
        if best[True] and best[False]:
            print(f"best DualKV {best[True].step_time_s:.2f} s ({best[True].parallel.label()}) vs best stock "
                  f"{best[False].step_time_s:.2f} s ({best[False].parallel.label()}): "
                  f"{best[False].step_time_s / best[True].step_time_s:.2f}x predicted")


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = shape_from(args)
    hw = hardware_from(args)
    if args.sweep:
        print_sweep(args, shape, hw)
    else:
        print_single(args, shape, hw)


if __name__ == "__main__":
    main()
