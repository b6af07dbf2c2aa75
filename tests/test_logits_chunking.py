"""Opt-in chunked output layer (megatron_dualkv.megatron.chunked_logits) == the one-pass path.

- TP=2 + sequence parallelism over gloo (two spawned workers), dense and MoE, float32 and
  float64: logprobs, entropy and EVERY parameter's main_grad after Megatron's training path
  (DistributedDataParallel, forward_backward_no_pipelining over two micro-batches,
  finalize_model_grads) are equal with chunks of 1, 7 and more than the edges, and without.
- CP=2 (MoE, one rank without loss edges in a micro-batch): the same with chunks of 5.
- single process: the forward keyword overrides the constructor's setting; bad values are refused.
- memory (vocab 4096): bytes kept for backward and the fwd+bwd peak drop by about the
  [edges, vocab] float32 logits; `pytest -s` prints the table quoted in docs/MEGATRON.md.
"""

from __future__ import annotations

import pytest
import torch

from megatron_cpu import GlooWorkers, model_parallel

VOCAB = 256
CHUNKS = (1, 7, 10_000)  # 10,000 > edges: one chunk, still recomputed in backward
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _config(size: str, dtype, tp: int, vocab: int = VOCAB, **overrides):
    from megatron.core.distributed import finalize_model_grads
    from megatron_dualkv.megatron import qwen3_config

    cfg = qwen3_config(size, vocab_size=vocab, use_cpu_initialization=True, params_dtype=dtype,
                       tensor_model_parallel_size=tp, sequence_parallel=tp > 1, calculate_per_token_loss=True,
                       finalize_model_grads_func=finalize_model_grads, **overrides)
    assert not cfg.transformer.gradient_accumulation_fusion  # weight grads go through .grad and the DDP hook
    return cfg


def _microbatches(seed: int) -> list:
    from test_distributed import make_microbatch

    return [make_microbatch(seed + i, pad_to_multiple=2) for i in range(2)]


def chunked_training_step(size: str, dtype, chunks: tuple, overlap_grad_reduce: bool) -> dict:
    """Worker: one model, the same two micro-batches through Megatron's training path once per
    chunk setting (None first); returns logprobs, entropy and every main_grad per setting. Every
    parameter's AccumulateGrad (where Megatron's DDP hook sits) must run once per micro-batch:
    with overlap_grad_reduce a second run would also trip the hook's own assertion."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dualkv.megatron import build_dualkv_model
    from test_distributed import grpo_loss_sum

    mbs = _microbatches(11)
    total = float(sum(mb["layout"].num_edges for mb in mbs))
    with model_parallel(tp=2) as pgs:
        cfg = _config(size, dtype, tp=2)
        model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
        with torch.no_grad():  # norm weights off 1 so that their gradient paths matter
            for n, p in model.named_parameters():
                if "layernorm" in n:
                    p.add_(0.1 * torch.randn_like(p))
        if dtype == torch.float64:
            model.double()
        ddp = DistributedDataParallel(cfg.transformer, DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce),
                                      model, pg_collection=pgs)
        fired = {n: 0 for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
        results = {}
        for chunk in (None,) + tuple(chunks):
            model.logits_chunk_rows = chunk
            ddp.zero_grad_buffer()
            fired.update({n: 0 for n in fired})
            outs = []

            def forward_step(data_iterator, m):
                mb = next(data_iterator)
                out = m(layout=mb["layout"], with_entropy=True)
                outs.append((out.logprobs.detach().clone(), out.entropy.detach().clone()))
                w = torch.linspace(-1, 1, mb["layout"].num_edges, dtype=out.entropy.dtype)

                def loss_func(out):
                    loss = grpo_loss_sum(out.logprobs, mb, total) + 0.3 * (out.entropy * w).sum()
                    return loss, torch.tensor(mb["layout"].num_edges, dtype=torch.int), {}

                return out, loss_func

            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp], num_microbatches=len(mbs),
                seq_length=0, micro_batch_size=1, forward_only=False, pg_collection=pgs,
            )
            for n, p in model.named_parameters():  # the DDP hook moved every .grad into main_grad
                assert p.grad is None, f"{n}: .grad left behind (DDP hook did not run)"
                assert fired[n] == len(mbs), f"chunk {chunk}: {n} accumulated {fired[n]} times for {len(mbs)} micro-batches"
            results[chunk] = {
                "out": outs,
                "grads": {n: p.main_grad.detach().clone() for n, p in model.named_parameters()},
            }
        return results


@pytest.fixture(scope="module")
def workers():
    with GlooWorkers(2) as w:
        yield w


@pytest.mark.parametrize("size,dtype,overlap", [
    ("tiny", torch.float32, True), ("tiny-moe", torch.float32, False), ("tiny", torch.float64, False),
    ("tiny-moe", torch.float64, True),
])
def test_chunked_equals_one_pass_under_tp2_sequence_parallel(workers, size, dtype, overlap):
    for rank, res in enumerate(workers.run(chunked_training_step, size, dtype, CHUNKS, overlap)):
        want = res[None]
        assert any(g.abs().max() > 0 for g in want["grads"].values())
        for chunk in CHUNKS:
            got = res[chunk]
            for (lp, ent), (lp0, ent0) in zip(got["out"], want["out"], strict=True):
                assert lp.dtype == dtype
                torch.testing.assert_close(lp, lp0, **TOL[dtype])
                torch.testing.assert_close(ent, ent0, **TOL[dtype])
            assert got["grads"].keys() == want["grads"].keys()
            for name, g0 in want["grads"].items():
                torch.testing.assert_close(got["grads"][name], g0, **TOL[dtype],
                                           msg=lambda m: f"rank {rank} chunk {chunk} {name}: {m}")


def cp_step_with_chunks(chunk, *args) -> dict:
    """Worker: tests/test_context_parallel.py's training step, the model built with `chunk`."""
    import megatron_dualkv.megatron as mm
    from test_context_parallel import cp_train_step

    build = mm.build_dualkv_model

    def chunked_build(*a, **k):
        model = build(*a, **k)
        model.logits_chunk_rows = chunk
        return model

    mm.build_dualkv_model = chunked_build
    try:
        return cp_train_step(*args)
    finally:
        mm.build_dualkv_model = build


def test_chunked_equals_one_pass_under_context_parallelism(workers):
    """CP=2: each rank chunks its own edges (one rank has none in the third micro-batch)."""
    from test_context_parallel import SPECS, make_microbatch

    mbs = [make_microbatch(40 + i, spec) for i, spec in enumerate(SPECS)]
    step = (True, 2, 1, False, (), [mbs], None, 2)  # MoE, CP=2, TP=1, no SP, weights: seeded
    want = workers.run(cp_step_with_chunks, None, *step)
    got = workers.run(cp_step_with_chunks, 5, *step)
    assert any(len(edges) == 0 for res in want for _, edges in res["split"])
    for w, g in zip(want, got, strict=True):
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32])
        for name, (_, g0) in w["grads"].items():
            torch.testing.assert_close(g["grads"][name][1], g0, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# single process
# ------------------------------------------------------------------------------------------------


def _model(pgs, vocab=VOCAB, **kw):
    from megatron_dualkv.megatron import build_dualkv_model

    torch.manual_seed(7)
    model = build_dualkv_model(_config("tiny", torch.float32, tp=1, vocab=vocab), pg_collection=pgs,
                               use_transformer_engine=False)
    for k, v in kw.items():
        setattr(model, k, v)
    return model


def test_forward_keyword_overrides_and_refusals(pgs):
    from megatron_dualkv.megatron.chunked_logits import check_chunk_rows

    layout = _microbatches(3)[0]["layout"]
    model = _model(pgs)
    want = model(layout=layout, temperature=0.7, with_entropy=True)
    for chunk in (2, layout.num_edges):
        got = model(layout=layout, temperature=0.7, with_entropy=True, logits_chunk_rows=chunk)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # without autograd the chunks are plain slices
        torch.testing.assert_close(model(layout=layout, logits_chunk_rows=3).logprobs,
                                   model(layout=layout).logprobs, rtol=1e-5, atol=1e-6)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="logits_chunk_rows"):
            model(layout=layout, logits_chunk_rows=bad)
        with pytest.raises(ValueError, match="logits_chunk_rows"):  # what DualKVGPTModel.__init__ calls
            check_chunk_rows(bad)


def measure(model, layout, chunk) -> dict:
    """Bytes of the output path: saved for backward (saved_tensors_hooks, each storage once,
    parameters excluded: tensors a checkpoint keeps are invisible to these hooks, so also) live
    after forward and the forward+backward peak (every storage an op creates, until freed)."""
    from test_planner import LiveBytes

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    model(layout=layout, logits_chunk_rows=chunk, with_entropy=True).logprobs.sum().backward()  # warm caches
    model.zero_grad(set_to_none=False)
    saved: dict = {}
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            saved.setdefault(s.data_ptr(), s.nbytes())
        return t

    tracker = LiveBytes(params)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(layout=layout, logits_chunk_rows=chunk, with_entropy=True)
        tracker.track(())
        after_forward = sum(n for ref, n in tracker.refs.values() if not ref.expired())
        (out.logprobs.sum() + out.entropy.sum()).backward()
        del out
    return {"saved": sum(saved.values()), "after_forward": after_forward, "peak": tracker.peak}


def test_chunking_drops_the_logits_kept_for_backward(pgs):
    from megatron_dualkv import build_layout

    vocab = 4096
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()
    layout = build_layout([(ids(40), [ids(60) for _ in range(4)]), (ids(30), [ids(50) for _ in range(3)])],
                          vocab_size=vocab)
    model = _model(pgs, vocab=vocab)
    edges = layout.num_edges
    logits = edges * vocab * 4
    rows = {chunk: measure(model, layout, chunk) for chunk in (None, 64, 16)}
    print(f"\noutput path, tiny model (hidden 64, 2 layers), vocab {vocab}, {edges} edges; "
          f"[edges, vocab] float32 = {logits / 2**20:.2f} MiB")
    print(f"{'logits_chunk_rows':>18} {'saved (hooks) MiB':>18} {'live after fwd MiB':>19} {'fwd+bwd peak MiB':>17}")
    for chunk, m in rows.items():
        print(f"{str(chunk):>18} {m['saved'] / 2**20:18.2f} {m['after_forward'] / 2**20:19.2f} {m['peak'] / 2**20:17.2f}")
    one = rows[None]
    for chunk in (64, 16):
        m = rows[chunk]
        # one pass keeps the softmax p and z (entropy): two [edges, vocab] float32
        assert one["after_forward"] - m["after_forward"] > 1.8 * logits, (chunk, one, m)
        assert one["saved"] - m["saved"] > 1.8 * logits, (chunk, one, m)
        assert one["peak"] - m["peak"] > 1.8 * logits, (chunk, one, m)
    assert rows[16]["peak"] < rows[64]["peak"]


def test_flag_reaches_the_model_through_model_provider(pgs, monkeypatch):
    import argparse
    import types

    from megatron.training import global_vars
    from megatron_dualkv.training.args import add_dualkv_args, check_parallelism
    from megatron_dualkv.training.providers import model_provider

    parse = lambda *argv: add_dualkv_args(argparse.ArgumentParser()).parse_args(list(argv))
    assert parse().logits_chunk_rows is None  # default: one pass
    base = dict(pipeline_model_parallel_size=1, context_parallel_size=1, micro_batch_size=1, groups_per_step=2,
                updates_per_batch=1)
    with pytest.raises(ValueError, match="--logits-chunk-rows"):
        check_parallelism(types.SimpleNamespace(**{**vars(parse("--logits-chunk-rows", "0")), **base}))
    cfg = _config("tiny", torch.float32, tp=1)
    args = types.SimpleNamespace(
        **{**vars(parse("--logits-chunk-rows", "7")), **base}, transformer_impl="local", vocab_size=VOCAB, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        max_position_embeddings=cfg.max_sequence_length, rotary_base=cfg.rotary_base,
        untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
    )
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert model_provider(config=cfg.transformer, pg_collection=pgs).logits_chunk_rows == 7
    args.no_dualkv = True  # the replicated baseline has no loss-edge output path
    assert not hasattr(model_provider(config=cfg.transformer, pg_collection=pgs), "logits_chunk_rows")
