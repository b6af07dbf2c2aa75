"""Run examples/pretrain_grpo_dualkv.py's GPU path - megatron.training.pretrain() - on a CPU.

    python tests/pretrain_on_cpu.py [script arguments...]

For tests only: pretrain() asserts CUDA, so the script's pretrain path cannot run on a machine
without a GPU. This harness answers Megatron's CUDA calls for the CPU (tests/megatron_cpu.py's
shims, plus `torch.cuda.is_available() -> True`, one device, an empty CUDA generator state and zero memory statistics for its
memory report, no warm-up of the torch.compile'd fusions) and runs the script's `run_pretrain` with gloo, Megatron's RNG tracker that does not
touch CUDA state, and no gradient clipping (Megatron's clipping asserts CUDA tensors). What it
checks is the glue: argument handling, model and dataset providers, forward_step/loss_func in
Megatron's training loop, our step log, Megatron's checkpoint save and --load resume.
"""

from __future__ import annotations

import contextlib
import os
import sys

# torch.compile'd Megatron helpers (jit_fuser) would trace with CUDA generator state once
# is_available() says yes: run them eagerly
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

CPU_ARGV = ["--distributed-backend", "gloo", "--rerun-mode", "disabled", "--no-load-rng", "--inference-rng-tracker", "--clip-grad", "0.0", "--peak-tflops", "1.0",
            "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion"]


@contextlib.contextmanager
def cuda_for_pretrain():
    import torch
    from megatron_cpu import _patched, cuda_rng_state_on_cpu, megatron_cpu_shims

    zero = lambda *a, **k: 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(torch.cuda, "is_available", lambda: True))
        stack.enter_context(_patched(torch.cuda, "device_count", lambda: 1))
        stack.enter_context(_patched(torch.cuda, "is_current_stream_capturing", lambda: False))  # torch Adam asks
        # checkpoints save and restore the CUDA generator: there is none (an empty state)
        stack.enter_context(_patched(torch.cuda, "get_rng_state", lambda device="cuda": torch.empty(0, dtype=torch.uint8)))
        stack.enter_context(_patched(torch.cuda, "set_rng_state", lambda state, device="cuda": None))
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            stack.enter_context(_patched(torch.cuda, name, zero))
        # pretrain() warms up its torch.compile'd fusions on CUDA tensors: nothing to warm on a CPU
        import megatron.training.training as training

        stack.enter_context(_patched(training, "set_jit_fusion_options", lambda *a, **k: None))
        # argument validation asks the GPU architecture when TP > 1: answer Hopper
        import megatron.training.arguments as arguments

        stack.enter_context(_patched(arguments, "get_device_arch_version", lambda: 9))
        # and its compute capability for --moe-grouped-gemm
        stack.enter_context(_patched(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)))
        stack.enter_context(megatron_cpu_shims())
        stack.enter_context(cuda_rng_state_on_cpu())
        yield


def main() -> int:
    # the backend probe would believe the patched is_available(): force the CPU backend
    os.environ["MEGATRON_DUALKV_ATTENTION_BACKEND"] = "reference"
    import pretrain_grpo_dualkv as script

    argv = script.build_argv(sys.argv[1:]) + CPU_ARGV
    with cuda_for_pretrain():
        return script.run_pretrain(argv)


if __name__ == "__main__":
    sys.exit(main())
