"""DualKV against the replicated batch, on a tiny Qwen3-shaped model (dense and MoE).

    python examples/equivalence_demo.py [--groups 8] [--dtype float32|float64] [--rollouts FILE]

Packs groups of the shipped rollout file (or FILE) into one DualKV micro-batch, runs the DualKV
model and the stock Megatron GPTModel (same weights) on the replicated batch ([prompt | response]
per response), applies the same GRPO loss to both, and prints the token and attention-FLOP
reduction and the largest differences in logprobs, loss and parameter gradients.

Runs on a GPU when one is visible, else on the CPU (Megatron-Core needs a few CUDA calls
answered for a CPU: the test suite's shims, tests/megatron_cpu.py, are reused for that).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|full scope is deprecated).*")
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # "GPTModel IS DEPRECATED"

from megatron_dualkv import Group, build_layout
from megatron_dualkv.data import DEFAULT_ROLLOUTS, read_rollouts
from megatron_dualkv.flops import attended_pairs, group_pairs
from megatron_dualkv.loss import PolicyBatch, PolicyLossConfig, policy_loss
from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model, copy_weights, qwen3_config, replicated_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def megatron_runtime(device: str):
    """World-size-1 process group + Megatron model parallelism (TP=EP=1) on `device`."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if device == "cpu":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from megatron_cpu import cuda_runtime_as_cpu, model_parallel

        dist.init_process_group("gloo", rank=0, world_size=1)
        with cuda_runtime_as_cpu(), model_parallel(tp=1) as pgs:
            yield pgs
    else:
        dist.init_process_group("nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield ProcessGroupCollection.use_mpu_process_groups()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def pick_groups(n: int, path: str, vocab: int) -> tuple[list[Group], torch.Tensor]:
    records = read_rollouts(path, vocab_size=vocab)[:n]
    groups = [Group.of(r.prompt, r.responses, name=r.group_id) for r in records]
    adv = [a for r in records for a in (r.advantages or [0.0] * len(r.responses))]
    return groups, torch.tensor(adv)


def compare(size: str, groups: list[Group], advantages: torch.Tensor, dtype: torch.dtype, device: str, pgs) -> dict:
    cfg = qwen3_config(size, vocab_size=512, params_dtype=dtype, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_dualkv_model(cfg, pg_collection=pgs).to(device)
    base = build_replicated_model(cfg, pg_collection=pgs).to(device)
    copy_weights(model, base)
    layout = build_layout(groups, vocab_size=cfg.vocab_size, device=device)

    loss_cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.01)
    gen = torch.Generator().manual_seed(1)
    # old/ref policies a little off the current one, so clipping and the KL are exercised
    old = None
    results = {}
    for name, net, run in (("dualkv", model, lambda: model(layout=layout)),
                           ("replicated", base, lambda: replicated_logprobs(base, layout))):
        net.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = run()
        lp = out.logprobs
        if old is None:
            noise = torch.randn(lp.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=lp.dtype)
            old = (lp.detach() + 0.3 * noise, lp.detach() - 0.2 * noise.abs())
        batch = PolicyBatch(advantages=advantages.to(device=device, dtype=lp.dtype), old_logprobs=old[0], ref_logprobs=old[1])
        loss, metrics = policy_loss(lp, batch, layout, loss_cfg)
        loss.backward()
        elapsed = time.perf_counter() - t0
        grads = {k: p.grad.detach().clone() for k, p in net.named_parameters() if p.grad is not None}
        results[name] = (lp.detach(), loss.detach(), grads, metrics, elapsed)

    lp_d, loss_d, g_d, metrics, t_d = results["dualkv"]
    lp_r, loss_r, g_r, _, t_r = results["replicated"]
    missing = sorted(set(g_r) ^ set(g_d))
    if missing:
        raise RuntimeError(f"parameters with a gradient in only one model: {missing}")
    grad_rel = max(((g_d[k] - g_r[k]).norm() / g_r[k].norm().clamp_min(1e-30)).item() for k in g_r)
    grad_abs = max((g_d[k] - g_r[k]).abs().max().item() for k in g_r)
    return {
        "layout": layout, "logprob_max_abs": (lp_d - lp_r).abs().max().item(),
        "loss_abs": (loss_d - loss_r).abs().item(), "loss": loss_d.item(),
        "grad_max_rel": grad_rel, "grad_max_abs": grad_abs, "num_params": len(g_r),
        "clip_fraction": (metrics["clip_low_count"] + metrics["clip_high_count"]).item() / max(metrics["num_tokens"].item(), 1),
        "seconds": (t_d, t_r),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8, help="groups packed into the micro-batch")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--rollouts", default=DEFAULT_ROLLOUTS, help="rollout file (JSONL or Parquet)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    # float32: rounding of the two summation orders. float64: exact to 1e-10, except that
    # Megatron's top-k router takes its softmax in float32 even in a float64 model.
    tols = {"float32": {"tiny": 1e-4, "tiny-moe": 1e-4}, "float64": {"tiny": 1e-10, "tiny-moe": 1e-6}}[args.dtype]
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    groups, adv = pick_groups(args.groups, args.rollouts, 512)
    dedup_tok = sum(g.num_packed_tokens for g in groups)
    repl_tok = sum(g.num_replicated_tokens for g in groups)
    pairs = [group_pairs(len(g.prompt), [len(r) for r in g.responses]) for g in groups]
    dedup_pairs, repl_pairs = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    print(f"micro-batch: {len(groups)} groups, {sum(g.num_responses for g in groups)} responses, "
          f"P {min(len(g.prompt) for g in groups)}..{max(len(g.prompt) for g in groups)}, "
          f"N {min(g.num_responses for g in groups)}..{max(g.num_responses for g in groups)}  ({args.device}, {args.dtype})")
    print(f"tokens per layer:          {dedup_tok:>8} packed vs {repl_tok:>8} replicated  ({repl_tok / dedup_tok:.2f}x fewer)")
    print(f"attention (query,key) pairs:{dedup_pairs:>7} packed vs {repl_pairs:>8} replicated  ({repl_pairs / dedup_pairs:.2f}x fewer FLOPs)")

    ok = True
    with megatron_runtime(args.device) as pgs:
        rows = []
        for size in ("tiny", "tiny-moe"):
            r = compare(size, groups, adv, dtype, args.device, pgs)
            assert attended_pairs(r["layout"]) == dedup_pairs
            good = max(r["logprob_max_abs"], r["loss_abs"], r["grad_max_rel"]) < tols[size]
            ok &= good
            rows.append((size, r, good, tols[size]))
    print()
    print(f"{'model':<10} {'max|dlogprob|':>14} {'|dloss|':>10} {'max rel dgrad':>14} {'params':>7} {'loss':>10} {'s dualkv/repl':>14}  equal?")
    for size, r, good, tol in rows:
        print(f"{size:<10} {r['logprob_max_abs']:>14.2e} {r['loss_abs']:>10.2e} {r['grad_max_rel']:>14.2e} {r['num_params']:>7} "
              f"{r['loss']:>10.5f} {r['seconds'][0]:>6.2f}/{r['seconds'][1]:<6.2f}  {'yes' if good else 'NO'} (tol {tol:g})")
    print("\nDualKV " + ("matches" if ok else "DOES NOT match") + " the replicated batch (logprobs, GRPO loss, every parameter gradient).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
