"""Sequence-parallel torch norms (megatron_dualkv/megatron/norms.py): what the local spec builds.

The numerical contract (TP=2 with sequence parallelism equal to TP=1, every gradient) is in
tests/test_distributed.py and tests/test_context_parallel.py, which now build these norms
through the package's specs (no test shim)."""

import dataclasses

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_dualkv.megatron import specs
from megatron_dualkv.megatron.config import qwen3_config
from megatron_dualkv.megatron.norms import SequenceParallelTorchNorm, map_spec, with_sequence_parallel_norms


def norm_classes(spec) -> list:
    """The torch-norm classes a spec names, in order (walked by the package's map_spec)."""
    found = []
    map_spec(spec, lambda x: (found.append(x) if x in (WrappedTorchNorm, SequenceParallelTorchNorm) else None) or x)
    return found


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_local_specs_name_only_the_sequence_parallel_norm(size):
    cfg = qwen3_config(size).transformer
    stock = norm_classes(specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                          normalization=cfg.normalization, pp_rank=0))
    assert stock and set(stock) == {WrappedTorchNorm}
    for block in (specs.get_dualkv_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=0),
                  specs.get_replicated_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=0)):
        ours = norm_classes(block)
        assert len(ours) == len(stock) and set(ours) == {SequenceParallelTorchNorm}
    layer = specs.get_dualkv_layer_spec(qk_layernorm=True, normalization="RMSNorm", use_transformer_engine=False)
    assert set(norm_classes(layer)) == {SequenceParallelTorchNorm}
    assert with_sequence_parallel_norms(ModuleSpec(module=torch.nn.Identity)).module is torch.nn.Identity


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_norm_flags_its_parameters_only_under_sequence_parallelism(normalization):
    on = qwen3_config("tiny", normalization=normalization, sequence_parallel=True,
                      tensor_model_parallel_size=2).transformer
    off = qwen3_config("tiny", normalization=normalization).transformer
    norm = SequenceParallelTorchNorm(on, 16, 1e-6)
    assert isinstance(norm, getattr(torch.nn, normalization)) and norm.eps == 1e-6
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    stock = SequenceParallelTorchNorm(off, 16, 1e-6)
    assert type(stock) is type(WrappedTorchNorm(off, 16, 1e-6))
    assert not any(getattr(p, "sequence_parallel", False) for p in stock.parameters())


def test_unsupported_settings_raise():
    cfg = qwen3_config("tiny", sequence_parallel=True, tensor_model_parallel_size=2).transformer
    with pytest.raises(ValueError, match="normalization"):
        SequenceParallelTorchNorm(dataclasses.replace(cfg, normalization="L2Norm"), 16)
    with pytest.raises(ValueError, match="persist_layer_norm"):
        SequenceParallelTorchNorm(dataclasses.replace(cfg, persist_layer_norm=True), 16)
