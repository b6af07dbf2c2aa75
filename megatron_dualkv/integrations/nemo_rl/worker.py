"""The NeMo-RL MegatronPolicyWorker extension (pass its path as `worker_extension_cls_fqn`).

    worker_extension_cls_fqn: megatron_dualkv.integrations.nemo_rl.worker.DualKVMegatronPolicyWorker

`DualKVMegatronPolicyWorker` is built on first access (PEP 562 module __getattr__), so importing
this module never imports NeMo-RL; the class subclasses NeMo-RL's Megatron worker
(MegatronPolicyWorkerImpl where it exists, else the class under MegatronPolicyWorker's Ray actor)
with `DualKVWorkerMixin` first and is made a Ray actor class like NeMo-RL's own.

The mixin replaces train() and get_logprobs() (get_reference_policy_logprobs runs get_logprobs
under NeMo-RL's reference-weights context, so it follows) with `DualKVPolicyRunner`, when the
policy config has `dualkv.enabled: true`; otherwise it defers to NeMo-RL. What it reads from the
host worker: `self.cfg` (the policy config: `dualkv`, `train_global_batch_size`,
`generation.temperature`), `self.model`, `self.optimizer` (Megatron optimizer: step() ->
(ok, grad_norm, num_zeros)), `self.scheduler` (step(increment=gbs) once per train() call; get_lr /
get_wd when present). The train() result has NeMo-RL's keys: global_loss (per global batch,
summed over data-parallel ranks), grad_norm, rank, all_mb_metrics (per micro-batch shares / number
of global batches, with grad_norm, global_valid_toks / seqs, lr, wd). This glue is written against
NeMo-RL's public code and is not exercised here (NeMo-RL is not installable in this project's CI);
everything it calls (conversion, runner, loss adapter) is tested without NeMo-RL.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .convert import to_dualkv_model
from .loss_adapter import ClippedPGAdapter
from .runner import DualKVPolicyRunner, DualKVSettings

NEMO_RL_WORKER_MODULES = (
    "nemo_rl.models.policy.workers.megatron_policy_worker",
    "nemo_rl.models.policy.megatron_policy_worker",
)


class DualKVWorkerMixin:
    """train / get_logprobs through DualKV when `policy.dualkv.enabled` (see module docstring)."""

    _dualkv: Optional[DualKVPolicyRunner] = None

    def _dualkv_runner(self) -> Optional[DualKVPolicyRunner]:
        section = dict(self.cfg.get("dualkv") or {})
        if not section.get("enabled", False):
            return None
        if self._dualkv is None:
            from megatron.core import parallel_state

            settings = DualKVSettings.from_dict(section)
            generation = self.cfg.get("generation") or {}
            top_k, top_p = generation.get("top_k"), generation.get("top_p")
            if top_k not in (None, 0, -1) or top_p not in (None, 1.0):
                # NeMo-RL then filters the training logprobs to the top-k/top-p support; DualKV does not
                raise ValueError(f"policy.dualkv: generation top_k={top_k} / top_p={top_p} are not supported "
                                 f"(training logprobs would need the same filtering); use top_k null, top_p 1.0")
            to_dualkv_model(self.model)
            temperature = float(generation.get("temperature", 1.0))
            self._dualkv = DualKVPolicyRunner(self.model, settings, temperature=temperature,
                                              dp_group=parallel_state.get_data_parallel_group())
        return self._dualkv

    def get_logprobs(self, *args, data=None, micro_batch_size: Optional[int] = None, **kwargs):
        runner = self._dualkv_runner()
        if runner is None:
            return super().get_logprobs(*args, data=data, micro_batch_size=micro_batch_size, **kwargs)
        if args:
            data = args[0]
        self.model.eval()
        return _batched_data_dict(logprobs=runner.get_logprobs(data).cpu())

    def train(self, data, loss_fn, eval_mode: bool = False, gbs: Optional[int] = None,
              mbs: Optional[int] = None, **kwargs) -> dict[str, Any]:
        runner = self._dualkv_runner()
        if runner is None:
            return super().train(data, loss_fn, eval_mode, gbs=gbs, mbs=mbs, **kwargs)
        from megatron.core import parallel_state

        gbs = gbs or self.cfg["train_global_batch_size"]
        dp = parallel_state.get_data_parallel_world_size()
        if gbs % dp:
            raise ValueError(f"train_global_batch_size {gbs} is not a multiple of the data-parallel size {dp}")
        adapter = ClippedPGAdapter.from_loss_fn(loss_fn)
        grad_norms: list[float] = []

        def zero_grad():
            # Megatron DDP keeps gradients in its buffers; a bare module in .grad
            getattr(self.model, "zero_grad_buffer", self.model.zero_grad)()
            self.optimizer.zero_grad()

        def optimizer_step():
            ok, grad_norm, _ = self.optimizer.step()
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            return {"update_successful": ok, "grad_norm": grad_norm}

        if eval_mode:
            self.model.eval()
        else:
            self.model.train()
        with torch.no_grad() if eval_mode else contextlib.nullcontext():
            out = runner.train(data, adapter, local_batch_size=gbs // dp, zero_grad=zero_grad,
                               optimizer_step=optimizer_step, eval_mode=eval_mode)
        if not eval_mode:
            self.scheduler.step(increment=gbs)  # once per train() call, as NeMo-RL's worker
        return {
            "global_loss": out["loss"],  # already summed over data-parallel ranks
            "grad_norm": torch.tensor(grad_norms, dtype=torch.float64),
            "rank": torch.distributed.get_rank(),
            "all_mb_metrics": self._nemo_rl_mb_metrics(out, grad_norms),
            "dualkv_micro_batch_stats": out["micro_batch_stats"],
        }

    def _nemo_rl_mb_metrics(self, out: dict, grad_norms: list[float]) -> dict[str, list[float]]:
        """NeMo-RL's all_mb_metrics: name -> one value per micro-batch of this rank, each metric
        share divided by the number of global batches, with the step's grad_norm, normalisers and
        (when the scheduler reports them) lr / wd."""
        num_steps = len(out["mb_metrics"])
        extra: dict[str, float] = {}
        get_lr, get_wd = getattr(self.scheduler, "get_lr", None), getattr(self.scheduler, "get_wd", None)
        if get_lr is not None and hasattr(self.optimizer, "param_groups"):
            extra["lr"] = float(get_lr(self.optimizer.param_groups[0]))
        if get_wd is not None:
            extra["wd"] = float(get_wd())
        merged: dict[str, list[float]] = {}
        for step, (mbs, (toks, seqs)) in enumerate(zip(out["mb_metrics"], out["global_counts"])):
            for m in mbs:
                row = {k: v / num_steps for k, v in m.items()}
                row.update(extra, global_valid_toks=toks, global_valid_seqs=seqs)
                if step < len(grad_norms):
                    row["grad_norm"] = grad_norms[step]
                for k, v in row.items():
                    merged.setdefault(k, []).append(v)
        return merged


def _batched_data_dict(**tensors):
    """NeMo-RL's BatchedDataDict when importable (inside a worker it always is), else a dict."""
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:
        return dict(tensors)
    return BatchedDataDict(tensors)


def _build_worker_class():
    import importlib

    module = None
    for name in NEMO_RL_WORKER_MODULES:
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    if module is None:
        raise ImportError(f"NeMo-RL's Megatron policy worker is not importable (tried {NEMO_RL_WORKER_MODULES}); "
                          f"DualKVMegatronPolicyWorker needs NeMo-RL installed")
    import ray

    base = getattr(module, "MegatronPolicyWorkerImpl", None) or module.MegatronPolicyWorker
    base = getattr(getattr(base, "__ray_metadata__", None), "modified_class", base)  # under @ray.remote
    cls = type("DualKVMegatronPolicyWorker", (DualKVWorkerMixin, base), {"__module__": __name__})
    try:
        from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker

        return ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))(cls)
    except ImportError:
        return ray.remote(cls)


_CACHE: dict[str, Any] = {}


def __getattr__(name: str):
    if name == "DualKVMegatronPolicyWorker":
        if name not in _CACHE:
            _CACHE[name] = _build_worker_class()
        return _CACHE[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
