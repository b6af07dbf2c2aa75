"""A training loop on Megatron-Core's own pieces, without megatron.training.pretrain().

    ddp, optimizer = build_ddp_and_optimizer(model, model_cfg, pg_collection=pgs, lr=1e-3)
    train_steps(ddp, optimizer, forward_step, items, num_steps=4, num_microbatches=m, log=log)
    save_checkpoint(dir, step, ddp, optimizer); step = load_checkpoint(dir, ddp, optimizer)

pretrain() needs CUDA; this loop is what the script runs on a machine without a GPU (the caller
provides a CPU-capable Megatron runtime: tests/megatron_cpu.py's shims). It is the core of
Megatron's train_step: zero the DDP gradient buffers, `get_forward_backward_func()` over the
step's micro-batches with our forward_step (per-token loss: finalize_model_grads divides every
gradient by the step's summed counts), then the step of Megatron's optimizer
(`megatron.core.optimizer.get_megatron_optimizer`, Adam; no distributed optimizer).

Checkpoints here are torch.save files, one per rank (model and optimizer state dicts, the step,
the RNG states); the pretrain() path uses Megatron's own --save/--load instead.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .log import StepLog, StepRecord


def build_ddp_and_optimizer(model: torch.nn.Module, transformer_config, *, pg_collection=None, lr: float = 1e-3,
                            weight_decay: float = 0.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                            adam_eps: float = 1e-8, clip_grad: float = 0.0):
    """Megatron DDP around `model` and Megatron's Adam over it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    transformer_config.calculate_per_token_loss = True
    transformer_config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        transformer_config,
        DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
        model, pg_collection=pg_collection,
    )
    params_dtype = next(model.parameters()).dtype
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
        adam_eps=adam_eps, clip_grad=clip_grad, use_distributed_optimizer=False, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False, pg_collection=pg_collection)
    return ddp, optimizer


def train_steps(ddp, optimizer, forward_step, data_iterator: Iterator, *, num_steps: int, num_microbatches: int,
                log: Optional[StepLog] = None, pg_collection=None, progress: bool = False,
                on_step: Optional[Callable[[int, Optional[StepRecord]], None]] = None) -> list[Optional[StepRecord]]:
    """Run `num_steps` optimizer steps of `num_microbatches` micro-batches each."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_steps, desc="policy update", unit="step", dynamic_ncols=True)
    records = []
    try:
        for i in range(num_steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(
                forward_step_func=forward_step, data_iterator=data_iterator, model=[ddp],
                num_microbatches=num_microbatches, seq_length=0, micro_batch_size=1, forward_only=False,
                pg_collection=pg_collection,
            )
            ok, grad_norm, _ = optimizer.step()
            if not ok:
                raise RuntimeError(f"Megatron's optimizer skipped step {i} (non-finite gradients?)")
            rec = log.end_step(grad_norm=None if grad_norm is None else float(grad_norm)) if log else None
            records.append(rec)
            if bar is not None:
                if rec is not None:
                    bar.set_postfix_str(f"loss {rec.loss:+.4f} kl {rec.kl:.4f} clip {rec.clip_fraction:.3f}")
                bar.update(1)
            if on_step is not None:
                on_step(i, rec)
    finally:
        if bar is not None:
            bar.close()
    return records


# ------------------------------------------------------------------------------------------------
# Checkpoints (torch.save, one file per rank)
# ------------------------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_file(directory: str, rank: Optional[int] = None) -> str:
    return os.path.join(directory, f"rank{_rank() if rank is None else rank:05d}.pt")


def save_checkpoint(directory: str, step: int, ddp, optimizer, extra: Optional[dict] = None) -> str:
    """Model, optimizer, the number of steps done and the RNG states, for an exact resume."""
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_file(directory)
    state = {
        "step": step,
        "model": ddp.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "extra": extra or {},
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(directory: str, ddp, optimizer) -> tuple[int, dict]:
    """Restore what save_checkpoint wrote; returns (steps done, extra)."""
    path = checkpoint_file(directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint for rank {_rank()} at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    ddp.module.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"]), state.get("extra", {})
