#!/usr/bin/env python
"""The DualKV core attention under context parallelism: time and memory per rank, CP=1 vs CP=2.

    torchrun --nproc_per_node 2 tools/gpu_cp_attention_cost.py --out cp_attention.json
    torchrun --nproc_per_node 2 tools/gpu_cp_attention_cost.py --tiny   # CPU, gloo, reference backend

Only the attention, no projections (those are per-token work, exactly halved by CP; the model-level
step is tools/gpu_cp_check.py's cost phase): q/k/v of the Qwen3-8B head shape (Hq 32, Hkv 8, D 128,
bf16) for one group of N responses (default N=16, P=32K, R=2K), forward and backward with a random
output gradient, in these configurations:

  cp1             every rank attends the whole micro-batch (the entry point, as one GPU would)
  cp2_all_gather  the rank's rows of the cost-balanced partition; K/V all-gathered, local queries
                  (megatron_dualkv.cp.cp_dualkv_attention; dK/dV reduce-scattered back)
  cp2_a2a         heads split over the ranks by all-to-all (megatron_dualkv.cp.ulysses_dualkv_attention)
  cp1@<backend>   CP=1 again on a backend that a CP=2 row ran and cp1 did not (a same-kernel reference,
                  e.g. flex while the CUDA kernel does not take local queries)

Per row and rank: the backend the entry point selects for exactly those inputs
(megatron_dualkv.ops.attention.select_backend with the same request, dtype, device and local-query
flag), its forward output against cp1's on the same rows (max abs and norm-wise relative difference;
same inputs on every rank), median forward and forward+backward milliseconds after a warm-up call, peak
memory of the attention's tensors (q, k, v, output gradient, outputs, gathered K/V, gradients,
workspace: max allocated minus what was allocated before they were made), the rank's attended
(query, key) pairs and its useful TFLOP/s. Rank 0 prints one JSON summary (and writes --out).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rank_report import report_and_leave, write_json_report  # noqa: E402 (tools/, the script's folder, is on sys.path)

GIB = 2 ** 30


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU + gloo, tiny shapes, reference backend (tests this script)")
    ap.add_argument("--shape", default="16x32768x2048", help="NxPxR of the group")
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D (Qwen3-8B; 30B-A3B is 32,4,128: a2a needs Hkv %% 2 == 0)")
    ap.add_argument("--configs", default="cp1,cp2_all_gather,cp2_a2a")
    ap.add_argument("--backend", default="auto", help="attention backend for every row (auto: the entry point's choice)")
    ap.add_argument("--no-same-kernel-reference", action="store_true", help="do not add cp1@<backend> rows")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--chunks-per-rank", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.shape, args.heads, args.iters, args.backend = "3x40x12", "4,2,16", 1, "reference"
    return args


class Bench:
    def __init__(self, args):
        from megatron_dualkv.cp import cp_partition, key_counts
        from megatron_dualkv.layout import Group, build_layout

        self.args = args
        if args.tiny:
            dist.init_process_group("gloo")
            self.device, self.dtype, chunk_multiple = torch.device("cpu"), torch.float64, 2
        else:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            self.device, self.dtype, chunk_multiple = torch.device("cuda", local), torch.bfloat16, 128
        if dist.get_world_size() != 2:
            raise SystemExit("run with exactly 2 ranks: torchrun --nproc_per_node 2 tools/gpu_cp_attention_cost.py")
        self.rank, self.group = dist.get_rank(), dist.group.WORLD
        self.hq, self.hkv, self.d = (int(x) for x in args.heads.split(","))
        self.backend = None if args.backend in ("auto", "None") else args.backend
        n, p, r = (int(x) for x in args.shape.split("x"))
        g = torch.Generator().manual_seed(3)
        ids = lambda k: torch.randint(0, 1000, (k,), generator=g)
        self.layout = build_layout([Group.of(ids(p), [ids(r) for _ in range(n)])], vocab_size=1000).to(self.device)
        self.part = cp_partition(self.layout, 2, args.chunks_per_rank, chunk_multiple)
        self.shard = self.part.shard(self.rank).to(self.device)
        self.total_pairs = int(key_counts(self.layout.segments).sum())
        self.rank_pairs = [int(c) for c in self.part.rank_cost]

    # -- one configuration --------------------------------------------------------------------
    def inputs(self, rows, seed: int):
        """Leaf q, k, v and an output gradient for the packed rows `rows` (None: the unpadded
        micro-batch's rows 0..T-1) of full tensors that are the same on every rank (same seed)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        n = self.part.layout.num_tokens  # CP-padded length
        full = lambda h: torch.randn(n, h, self.d, generator=g, device=self.device, dtype=torch.float32).to(self.dtype)
        out = []
        for h in (self.hq, self.hkv, self.hkv, self.hq):
            x = full(h)
            x = x[: self.layout.num_tokens] if rows is None else x.index_select(0, rows)
            out.append(x.clone())
            del x
        q, k, v, dout = out
        return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), dout

    def configuration(self, name: str, backend):
        """(attention function of this rank's q, k, v; the packed rows it holds, None for all of the
        unpadded micro-batch; whether the entry point gets local queries; the q shape it gets;
        this rank's useful forward FLOPs)."""
        from megatron_dualkv.cp import cp_dualkv_attention, ulysses_dualkv_attention
        from megatron_dualkv.flops import attention_flops
        from megatron_dualkv.ops import dualkv_attention

        kind = name.split("@")[0]
        if kind == "cp1":
            fn = lambda q, k, v: dualkv_attention(q, k, v, self.layout, None, backend)
            return fn, None, False, (self.layout.num_tokens, self.hq, self.d), \
                attention_flops(self.total_pairs, self.hq, self.d)
        if kind == "cp2_all_gather":
            fn = lambda q, k, v: cp_dualkv_attention(q, k, v, self.shard, self.group, None, backend)
            return fn, self.shard.rows, True, (self.shard.num_local, self.hq, self.d), \
                attention_flops(self.rank_pairs[self.rank], self.hq, self.d)
        if kind == "cp2_a2a":
            from megatron_dualkv.cp import ulysses_problem

            problem = ulysses_problem(self.hq, self.hkv, 2)
            if problem:
                raise ValueError(problem)
            fn = lambda q, k, v: ulysses_dualkv_attention(q, k, v, self.shard, self.group, None, backend)
            # every rank attends the whole (CP-padded) micro-batch for half of the heads
            pairs = int(sum(self.rank_pairs))
            return fn, self.shard.rows, False, (2 * self.shard.num_local, self.hq // 2, self.d), \
                attention_flops(pairs, self.hq // 2, self.d)
        raise ValueError(f"unknown configuration {name!r} (cp1, cp2_all_gather, cp2_a2a)")

    def selected_backend(self, backend, local: bool, q_shape) -> tuple[str, str]:
        from megatron_dualkv.ops.attention import select_backend

        probe = torch.empty(q_shape, device=self.device, dtype=self.dtype)
        return select_backend(probe, backend, local_queries=local)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn, reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            self.sync()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    def run(self, name: str, reference=None) -> tuple[dict, torch.Tensor]:
        """One configuration's row, and its forward output (compared with `reference`, the cp1
        output of the unpadded rows, where given)."""
        backend = name.split("@")[1] if "@" in name else self.backend
        fn, rows, local, q_shape, fwd_flops = self.configuration(name, backend)
        chosen, reason = self.selected_backend(backend, local, q_shape)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(self.device)
        q, k, v, dout = self.inputs(rows, seed=11)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)

        def fwd():  # inputs require grad: the training-time (compiled) configuration, no extra compile
            return fn(q, k, v)

        t0 = time.perf_counter()
        fwd_bwd()  # warm-up: compilation, block masks, work lists
        self.sync()
        warmup = time.perf_counter() - t0
        both = self.timed(fwd_bwd, self.args.iters)
        peak = (torch.cuda.max_memory_allocated(self.device) - base) / GIB if cuda else None
        only_fwd = self.timed(fwd, self.args.iters)
        with torch.no_grad():
            out = fwd().detach()
        diff = rel = None
        if reference is not None:
            if rows is None:
                got, want = out.float(), reference.float()
            else:  # this rank's rows of the unpadded micro-batch (CP padding rows have no reference)
                real = rows < self.layout.num_tokens
                got, want = out[real].float(), reference.index_select(0, rows[real]).float()
            diff = float((got - want).abs().max())
            rel = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))
        step = statistics.median(both)
        total_flops = fwd_flops * self._fwd_bwd_factor()
        del q, k, v, dout
        row = {"backend": chosen, "backend_reason": reason, "local_queries": local,
               "rows": self.layout.num_tokens if rows is None else int(rows.numel()),
               "q_shape_at_entry_point": list(q_shape), "warmup_s": warmup,
               "fwd_ms": 1e3 * statistics.median(only_fwd), "fwd_bwd_ms": 1e3 * step,
               "peak_gib": peak, "useful_fwd_bwd_tflops": total_flops / step / 1e12,
               "out_max_abs_diff_vs_cp1": diff, "out_rel_norm_diff_vs_cp1": rel}
        return row, out

    @staticmethod
    def _fwd_bwd_factor() -> float:
        from megatron_dualkv.flops import attention_flops

        return attention_flops(1, 1, 1, backward=True) / attention_flops(1, 1, 1)


def summary(args, bench, results: dict) -> dict:
    """Every rank's rows so far (a collective: all ranks call it after each configuration)."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, results)
    n, p, r = args.shape.split("x")
    return {
        "device": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu",
        "shape": {"N": int(n), "P": int(p), "R": int(r), "tokens": bench.layout.num_tokens},
        "heads": {"q": bench.hq, "kv": bench.hkv, "dim": bench.d}, "dtype": str(bench.dtype),
        "requested_backend": args.backend, "iters": args.iters,
        "cp2_rows_per_rank": bench.shard.num_local,
        "cp2_padding_rows": bench.part.layout.num_tokens - bench.layout.num_tokens,
        "cp2_attention_imbalance": bench.part.imbalance, "pairs_total": bench.total_pairs,
        "pairs_per_rank_all_gather": bench.rank_pairs,
        "per_rank": per_rank,
    }


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron_dualkv").setLevel(logging.INFO)  # the entry point's backend line
    bench = Bench(args)
    results: dict = {}
    out = {}

    def record(name: str, reference=None):
        """Run one configuration and rewrite --out with every row so far: a configuration that
        crashes the process (a kernel fault) leaves the earlier rows behind."""
        nonlocal out
        results[name], output = bench.run(name, reference)
        out = summary(args, bench, results)
        if bench.rank == 0 and args.out:
            write_json_report(out, args.out, echo=False)
        return output

    names = [c for c in args.configs.split(",") if c]
    # cp1 first (the other rows' outputs are compared with it), then the variants that need no local
    # queries, the all-gather (local queries) last
    names.sort(key=lambda n: (n != "cp1", n == "cp2_all_gather"))
    reference = record(names.pop(0)) if names and names[0] == "cp1" else None
    for name in names:
        record(name, reference)
    if not args.no_same_kernel_reference and "cp1" in results:
        extra = sorted({r["backend"] for n, r in results.items() if n.startswith("cp2")} - {results["cp1"]["backend"]})
        for backend in extra:
            record(f"cp1@{backend}", reference)
    del reference
    # float64 (--tiny): CP must reproduce CP=1's output to rounding; bf16 differences are informational
    bad = {f"rank {rank} {n}": r["out_max_abs_diff_vs_cp1"] for rank, res in enumerate(out.get("per_rank", []))
           for n, r in res.items() if bench.dtype == torch.float64 and (r["out_max_abs_diff_vs_cp1"] or 0.0) > 1e-9}
    if bad:
        out["failed"] = f"outputs differ from CP=1 (float64): {bad}"
    report_and_leave(out, args.out)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
