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

Multi-process layer (below `destroy_cpu_megatron`): the same shims as context managers that restore
what they patch (`megatron_cpu_shims`), plus a torch-function mode for literal device="cuda"
placements (schedules, DDP, optimizer), `model_parallel()`
(initialise/destroy per test) and `GlooWorkers`, a launcher that runs a test function on N spawned
gloo ranks with a timeout and re-raises worker failures in pytest with their tracebacks.
docs/TESTING.md says why each shim exists.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

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


# ------------------------------------------------------------------------------------------------
# Multi-process layer: restoring shims, model_parallel(), GlooWorkers
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set obj.name = value for the duration of the block, then restore the original."""
    missing = object()
    old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means a CUDA device to torch
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except (RuntimeError, TypeError):
            return False
    return False


class CudaPlacementOnCpu(TorchFunctionMode):
    """Redirects tensors that Megatron places on CUDA by a literal to the CPU.

    Megatron creates bookkeeping tensors with `device="cuda"` or `torch.cuda.current_device()`
    (the token counter in the schedules, the causal mask, DDP's warm-up tensor, the optimizer's
    grad-norm buffers) and calls `.cuda()` on a few. A torch-function mode sees every torch call,
    so it fixes all of these places at once without naming them (and drops the CUDA-only
    `Tensor.record_stream`). Modes are not active in autograd's backward; nothing there needs it.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.record_stream:
            return None
        return func(*args, **kwargs)


@contextlib.contextmanager
def all_to_all_split_sizes_as_lists() -> Iterator[None]:
    """The alltoall token dispatcher hands all_to_all_single its split sizes as tensors that it
    converts to numpy only when they live on CUDA; on a CPU they stay tensors, which gloo's
    binding rejects. Lists of ints are what every backend accepts. (Patched on the module, not
    in CudaPlacementOnCpu: torch-function modes are not active in autograd's backward, where the
    dispatcher's transposed all-to-all runs.)"""
    stock = dist.all_to_all_single
    as_list = lambda x: x.tolist() if hasattr(x, "tolist") else x

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return stock(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    with _patched(dist, "all_to_all_single", all_to_all_single):
        yield


@contextlib.contextmanager
def uneven_collectives_on_gloo() -> Iterator[None]:
    """all_gather into, and reduce_scatter from, tensors of different sizes, which gloo lacks.

    Under TP x EP the alltoall dispatcher gathers the routed tokens over the TP group with
    per-rank counts (`gather_from_sequence_parallel_region(..., output_split_sizes)`), and its
    backward reduce-scatters them with the same uneven split. NCCL takes uneven tensor lists;
    gloo needs equal sizes (and has no list reduce_scatter). Emulated exactly: the gather pads
    every piece to the largest and slices; the reduce-scatter all-reduces the concatenation and
    keeps this rank's piece. Even-sized calls go to torch unchanged."""
    stock_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return stock_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("uneven all_gather on gloo: async_op is not emulated")
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        stock_all_gather(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces):
            out.copy_(piece[: out.shape[0]])
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            raise NotImplementedError("reduce_scatter on gloo: async_op is not emulated")
        full = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(full, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(full[start: start + output.numel()].view_as(output))
        return None

    with _patched(dist, "all_gather", all_gather), _patched(dist, "reduce_scatter", reduce_scatter):
        yield


@contextlib.contextmanager
def cuda_runtime_as_cpu() -> Iterator[None]:
    """torch.cuda entry points that Megatron calls unconditionally, answered for a CPU.

    current_device -> "cpu" (used as `device=` everywhere); Stream/Event/current_stream/stream
    become no-ops (DDP's communication stream, the alltoall dispatcher's device-to-host stream);
    synchronize/empty_cache do nothing. Any of these would otherwise initialise CUDA and fail.
    """
    cuda = torch.cuda
    replacements = {
        "current_device": lambda: "cpu",
        "Stream": _CPUStream,
        "Event": _CPUEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "set_device": lambda device: None,
    }
    with contextlib.ExitStack() as stack:
        for name, value in replacements.items():
            stack.enter_context(_patched(cuda, name, value))
        yield


@contextlib.contextmanager
def megatron_cpu_shims() -> Iterator[None]:
    """All process-local shims at once (enter after torch.distributed is initialised)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_runtime_as_cpu())
        stack.enter_context(all_to_all_split_sizes_as_lists())
        stack.enter_context(uneven_collectives_on_gloo())
        stack.enter_context(cuda_rng_state_on_cpu())
        stack.enter_context(CudaPlacementOnCpu())
        yield


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    etp: Optional[int] = None,
    seed: int = 1234,
):
    """Megatron's model-parallel state over the current gloo world; yields the ProcessGroupCollection.

    The RNG tracker is Megatron's inference tracker (forking it is a no-op): the stock tracker
    saves and restores CUDA generator states. Tests run without dropout, so nothing needs it.
    Destroys the model-parallel state on exit so that the next test can choose other sizes, and
    starts and ends with a fresh MoE metrics tracker (process-global: metric entries left by an
    earlier test would otherwise make ranks disagree on which metrics to reduce).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if not dist.is_initialized():
        raise RuntimeError("model_parallel() needs torch.distributed initialised (gloo)")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,  # the default groups already are gloo groups
    )
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    destroy_moe_metrics_tracker()
    torch.manual_seed(seed)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        destroy_moe_metrics_tracker()
        parallel_state.destroy_model_parallel()
        tensor_parallel.random.initialize_rng_tracker(force_reset=True, inference_rng_tracker=True)


# ------------------------------------------------------------------------------------------------
# Launcher: N persistent worker processes, one gloo world per task
# ------------------------------------------------------------------------------------------------


class WorkerError(AssertionError):
    """A task failed on a worker; the message carries every failing rank's traceback."""


def free_port() -> int:
    return _free_port()


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """A world-size-1 gloo default group for the block, unless one exists already (a GlooWorkers
    worker's, or an enclosing fixture's), which is then left as it is."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def _worker_main(rank: int, conn) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl.logging).*")
    patch_cuda_for_cpu()  # a dedicated process: the permanent patch is harmless and matches init_cpu_megatron
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, world_size, port, timeout_s, args, kwargs = task
        # what torchrun would set, for code that reads the environment rather than torch.distributed
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            with megatron_cpu_shims():
                result = fn(*args, **kwargs)
            reply = ("ok", result)
        except BaseException:  # noqa: BLE001 - everything goes back to pytest
            reply = ("error", traceback.format_exc())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            conn.send(reply)
        except Exception:  # the result could not be pickled
            conn.send(("error", traceback.format_exc()))


class GlooWorkers:
    """A pool of `size` spawned processes that run test tasks as gloo worlds.

    `run(fn, *args, world_size=k)` runs fn(*args) on ranks 0..k-1, each inside a fresh gloo world
    with the shims entered, and returns the k results in rank order. A task that raises on any
    rank raises WorkerError here with that rank's traceback; one that outlives `timeout_s` raises
    TimeoutError. Either way the workers are killed (a rank that failed may leave the others
    blocked in a collective) and restarted lazily by the next task.

    Workers start with OMP_NUM_THREADS=1 and persist across tasks, so Megatron is imported once
    per worker, not once per test. `fn` must be importable by name (a module-level function).
    """

    def __init__(self, size: int, timeout_s: float = 180.0, startup_timeout_s: float = 300.0):
        self.size = size
        self.timeout_s = timeout_s  # per task, not counting the workers' start
        self.startup_timeout_s = startup_timeout_s
        self._procs: list = []
        self._conns: list = []

    # -- lifecycle --------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for rank in range(self.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(rank, child), daemon=True,
                                   name=f"gloo-worker-{rank}")
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        # Wait for every worker to have imported torch, so that a task's timeout counts the task
        # only (a loaded CI machine can take long to start Python processes).
        deadline = time.monotonic() + self.startup_timeout_s
        for rank, conn in enumerate(self._conns):
            left = deadline - time.monotonic()
            try:
                ready = conn.poll(max(left, 0)) and conn.recv()[0] == "ready"
            except (EOFError, OSError):
                ready = False
            if not ready:
                self._kill()
                raise RuntimeError(f"gloo worker {rank} did not start within {self.startup_timeout_s:.0f}s")

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> "GlooWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tasks ------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, world_size: Optional[int] = None,
            timeout_s: Optional[float] = None, **kwargs) -> list:
        world_size = self.size if world_size is None else world_size
        if not 1 <= world_size <= self.size:
            raise ValueError(f"world_size {world_size} must be in [1, {self.size}]")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self._procs:
            self._start()
        port = free_port()
        conns = self._conns[:world_size]
        for conn in conns:
            conn.send((fn, world_size, port, timeout_s, args, kwargs))
        return self._collect(fn, conns, timeout_s)

    def _collect(self, fn: Callable, conns: Sequence, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        results: dict = {}
        errors: dict = {}
        pending = {conn: rank for rank, conn in enumerate(conns)}
        name = getattr(fn, "__qualname__", repr(fn))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise TimeoutError(
                    f"{name}: ranks {sorted(pending.values())} did not finish within {timeout_s:.0f}s "
                    f"(a hang in a collective?); workers killed")
            ready = multiprocessing.connection.wait(
                list(pending) + [self._procs[r].sentinel for r in pending.values()], timeout=left)
            for obj in ready:
                conn = next((c for c, r in pending.items() if obj is c or obj == self._procs[r].sentinel), None)
                if conn is None:
                    continue
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "error", f"worker {rank} died (exit code {self._procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if errors:
                # Give the other ranks a few seconds to report their own error (the root cause may
                # be theirs); one blocked in a collective will not, and is killed below.
                grace = min(deadline, time.monotonic() + 5.0)
                while pending and time.monotonic() < grace:
                    ready = multiprocessing.connection.wait(list(pending), timeout=grace - time.monotonic())
                    for conn in ready:
                        rank = pending.pop(conn)
                        with contextlib.suppress(EOFError, OSError):
                            status, value = conn.recv()
                            if status == "error":
                                errors[rank] = value
                self._kill()
                detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise WorkerError(f"{name} failed on rank(s) {sorted(errors)}:\n{detail}")
        return [results[r] for r in range(len(conns))]


# ------------------------------------------------------------------------------------------------
# Activation recomputation (added for tests/test_megatron_model.py)
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_rng_state_on_cpu() -> Iterator[None]:
    """Megatron's activation recomputation (tensor_parallel.checkpoint, the RNG tracker's fork)
    saves and restores the CUDA generator state, which initialises CUDA. On a CPU there is no
    such state: getting returns an empty tensor and setting does nothing (tests use no dropout,
    so recomputation draws no random numbers)."""
    from megatron.core.tensor_parallel import random as megatron_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.empty(0, dtype=torch.uint8)

    def set_state(new_state, device=-1, graph_safe=False):
        return None

    with _patched(megatron_random, "_get_cuda_rng_state", get_state), \
            _patched(megatron_random, "_set_cuda_rng_state", set_state):
        yield
