"""Run Megatron-Core on a CPU with gloo, for tests only (never imported by the package).

Megatron-Core assumes CUDA in a few places that a forward/backward on CPU touches. This module
patches those, once per process, and initialises model parallelism over gloo:

    from megatron_cpu import init_cpu_megatron, destroy_cpu_megatron
    pgs = init_cpu_megatron(tp=1, ep=1)        # world size taken from torch.distributed / env
    ...build GPTModel(..., pg_collection=pgs)...
    destroy_cpu_megatron()                     # between tests that need other sizes

Shims (why each is needed):
- torch.cuda.current_device() -> "cpu": modules allocate buffers/params on it.
- the RNG tracker: `initialize_rng_tracker(inference_rng_tracker=True)` never touches CUDA RNG
  state, so `get_cuda_rng_tracker().fork()` works on CPU.
- torch.cuda.Stream/Event/current_stream/stream: no-op stand-ins (alltoall dispatcher, DDP).
- torch.distributed: a gloo default group (world size 1 unless RANK/WORLD_SIZE say otherwise).
Multi-process tests add their own shims here (additively): numpy split sizes for gloo
all_to_all, device="cuda" literals in schedules/optimizer.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist

_PATCHED = False


class _CPUEvent:
    """Stands in for torch.cuda.Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CPUStream:
    """Stands in for torch.cuda.Stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CPUEvent()

    def synchronize(self):
        pass


_DEFAULT_STREAM = _CPUStream()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_cuda_for_cpu() -> None:
    """Idempotent: make the CUDA calls Megatron makes on a forward/backward resolve to the CPU."""
    global _PATCHED
    if _PATCHED:
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # The alltoall dispatcher (and DDP overlap) use a side stream for device->host copies.
    torch.cuda.Stream = _CPUStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _CPUEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    _PATCHED = True


def init_cpu_megatron(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, etp: int | None = None, seed: int = 1234):
    """Initialise torch.distributed (gloo) and Megatron model parallelism on CPU.

    Returns the ProcessGroupCollection of the initialised groups (pass it to models as
    pg_collection). Safe to call again with the same sizes; call destroy_cpu_megatron() first
    to change them.
    """
    patch_cuda_for_cpu()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            "gloo",
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    else:
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, cp, ep):
            raise RuntimeError(f"Megatron already initialised with (tp, pp, cp, ep) = {have}; call destroy_cpu_megatron() first")
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_cpu_megatron() -> None:
    """Tear down Megatron's model-parallel groups (the gloo default group stays)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
