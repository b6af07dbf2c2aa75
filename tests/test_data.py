"""Rollout records: JSONL/Parquet round trips, every validation error, advantages, flat-row conversion,
the shipped default rollouts."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_dualkv.data import (
    DEFAULT_ROLLOUTS, DEFAULT_ROLLOUTS_VOCAB_SIZE, AdvantageEstimator, RolloutError, RolloutGroup,
    compute_advantages, groups_from_flat, read_rollouts, rows_from_sequences, write_rollouts,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_records(seed=0, n=6, vocab=300, full=True):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        p, k = int(rng.integers(1, 20)), int(rng.integers(1, 5))
        lens = rng.integers(1, 12, size=k)
        kw = {}
        if full:
            kw = dict(
                rewards=rng.normal(size=k), advantages=rng.normal(size=k),
                old_logprobs=[-rng.exponential(size=int(r)) for r in lens],
                ref_logprobs=[-rng.exponential(size=int(r)) for r in lens],
                generation_logprobs=[-rng.exponential(size=int(r)) for r in lens],
                loss_mask=[rng.integers(0, 2, size=int(r)) for r in lens],
            )
        out.append(RolloutGroup(f"g{g}", rng.integers(0, vocab, size=p), [rng.integers(0, vocab, size=int(r)) for r in lens], **kw))
    return out


def f32(x):
    return float(np.float32(x))


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


def test_jsonl_round_trip_is_exact(tmp_path):
    recs = random_records(1) + [RolloutGroup(7, [1, 2], [[3]])]  # integer id, optional fields absent
    path = str(tmp_path / "r.jsonl")
    write_rollouts(recs, path)
    back = read_rollouts(path)
    assert back == recs
    assert back[-1].group_id == "7" and back[-1].rewards is None and back[-1].loss_mask is None
    # absent optional fields are left out of the line, present ones are plain JSON lists
    lines = open(path).read().splitlines()
    assert set(json.loads(lines[-1])) == {"group_id", "prompt", "responses"}
    assert json.loads(lines[0])["old_logprobs"][0] == list(recs[0].old_logprobs[0])


def test_parquet_round_trip_rounds_only_token_logprobs_to_float32(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = random_records(2) + [RolloutGroup("bare", [5], [[6, 7]])]
    path = str(tmp_path / "r.parquet")
    write_rollouts(recs, path)
    back = read_rollouts(path)
    assert len(back) == len(recs)
    for a, b in zip(recs, back):
        assert (b.group_id, b.prompt, b.responses, b.rewards, b.advantages, b.loss_mask) == \
               (a.group_id, a.prompt, a.responses, a.rewards, a.advantages, a.loss_mask)
        for name in ("old_logprobs", "ref_logprobs", "generation_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            if x is None:
                assert y is None
            else:
                assert y == tuple(tuple(f32(v) for v in r) for r in x)
    schema = pq.read_schema(path)
    assert schema.field("prompt").type == pa.list_(pa.int32())
    assert schema.field("old_logprobs").type == pa.list_(pa.list_(pa.float32()))
    # a second round trip is exact (float32 values survive)
    path2 = str(tmp_path / "r2.parquet")
    write_rollouts(back, path2)
    assert read_rollouts(path2) == back


def test_tensors_and_arrays_are_accepted_and_normalised():
    r = RolloutGroup("t", torch.tensor([1, 2, 3]), [np.array([4, 5], dtype=np.int32), (6,)],
                     rewards=torch.tensor([1.0, 0.0]), loss_mask=[torch.tensor([True, False]), [1]])
    assert r.prompt == (1, 2, 3) and r.responses == ((4, 5), (6,))
    assert r.rewards == (1.0, 0.0) and r.loss_mask == ((1, 0), (1,))
    assert all(type(x) is int for x in r.prompt) and r.to_group().prompt == (1, 2, 3)


# --------------------------------------------------------------------------------------------
# Validation errors
# --------------------------------------------------------------------------------------------

BASE = dict(group_id="g7", prompt=[1, 2, 3], responses=[[4, 5], [6]])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(responses=[]), "group 'g7': responses: empty group"),
        (dict(responses=[[4], []]), "group 'g7': responses[1]: empty response"),
        (dict(prompt=[]), "group 'g7': prompt: empty"),
        (dict(group_id=""), "group_id: missing"),
        (dict(group_id=None), "group_id: missing"),
        (dict(group_id=1.5), "group_id: expected a string or an integer"),
        (dict(prompt=[1, 2.5]), "group 'g7': prompt: token ids must be integers, got 2.5"),
        (dict(responses=[[4, "x"], [6]]), "group 'g7': responses[0]: token ids must be integers"),
        (dict(responses=[[4, True], [6]]), "responses[0]: token ids must be integers, got True"),
        (dict(responses=[[4, 5], [[6]]]), "responses[1]: expected a flat list of token ids"),
        (dict(prompt="123"), "prompt: expected a list of integer token ids, got str"),
        (dict(prompt=[1, -3]), "group 'g7': prompt: token 1 has negative id -3"),
        (dict(rewards=[1.0]), "group 'g7': rewards: has 1 entries but the group has 2 responses"),
        (dict(advantages=[1.0, 2.0, 3.0]), "advantages: has 3 entries but the group has 2 responses"),
        (dict(rewards=[1.0, math.nan]), "group 'g7': rewards: value 1 is nan"),
        (dict(advantages=[math.inf, 0.0]), "group 'g7': advantages: value 0 is inf"),
        (dict(rewards=["a", "b"]), "rewards: expected numbers"),
        (dict(old_logprobs=[[-1.0], [-1.0]]), "group 'g7': old_logprobs[0]: has 1 values but responses[0] has 2"),
        (dict(old_logprobs=[[-1.0, -1.0]]), "old_logprobs: has 1 entries but the group has 2 responses"),
        (dict(ref_logprobs=[[-1.0, -1.0], [-1.0, -2.0]]), "ref_logprobs[1]: has 2 values but responses[1] has 1"),
        (dict(old_logprobs=[[-1.0, math.nan], [-1.0]]), "group 'g7': old_logprobs[0]: value 1 is nan"),
        (dict(ref_logprobs=[[-1.0, -1.0], [-math.inf]]), "group 'g7': ref_logprobs[1]: value 0 is -inf"),
        (dict(old_logprobs=[[-1.0, 0.7], [-1.0]]), "old_logprobs[0]: value 1 is 0.7, a log-probability must be <= 0"),
        (dict(generation_logprobs=[[-1.0, -1.0], [1.0]]), "generation_logprobs[1]: value 0 is 1.0, a log-probability"),
        (dict(loss_mask=[[1, 1], [1, 0]]), "group 'g7': loss_mask[1]: has 2 values but responses[1] has 1"),
        (dict(loss_mask=[[1, 2], [1]]), "group 'g7': loss_mask[0]: value 1 is 2, the loss mask holds 0 or 1"),
    ],
)
def test_each_validation_error_names_group_and_field(change, message):
    with pytest.raises(RolloutError) as exc:
        RolloutGroup(**{**BASE, **change})
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": [1], "responses": [[2]]}, "group (no id): group_id: missing required field"),
        ({"group_id": "a", "responses": [[2]]}, "group 'a': prompt: missing required field"),
        ({"group_id": "a", "prompt": [1], "responses": None}, "group 'a': responses: missing required field"),
        ({"group_id": "a", "prompt": [1], "responses": [[2]], "advantage": [1.0]}, "group 'a': advantage: unknown field"),
        ([1, 2], "expected a record"),
    ],
)
def test_record_structure_errors(record, message):
    with pytest.raises(RolloutError) as exc:
        RolloutGroup.from_dict(record)
    assert message in str(exc.value)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"group_id": "a", "prompt": [1], "responses": [[2]]})
    path.write_text(good + "\n" + json.dumps({"group_id": "b", "prompt": [1], "responses": [[2, 3]],
                                              "loss_mask": [[1]]}) + "\n")
    with pytest.raises(RolloutError, match=r"bad.jsonl line 2: group 'b': loss_mask\[0\]: has 1 values"):
        read_rollouts(str(path))
    path.write_text(good + "\n\n" + '{"group_id": "c", "prompt": [1,' + "\n")
    with pytest.raises(RolloutError, match=r"bad.jsonl line 3: invalid JSON"):
        read_rollouts(str(path))
    # NaN is not valid JSON but Python writes it; the validator names it
    path.write_text('{"group_id": "n", "prompt": [1], "responses": [[2]], "rewards": [NaN]}\n')
    with pytest.raises(RolloutError, match=r"line 1: group 'n': rewards: value 0 is nan"):
        read_rollouts(str(path))
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(RolloutError, match=r"group 'a': group_id: duplicate \(records 0 and 1\)"):
        read_rollouts(str(path))
    path.write_text("\n")
    with pytest.raises(RolloutError, match="no rollout records"):
        read_rollouts(str(path))
    with pytest.raises(ValueError, match="cannot tell the rollout format"):
        read_rollouts(str(tmp_path / "x.csv"))


def test_vocabulary_check_names_record_field_and_token(tmp_path):
    path = str(tmp_path / "v.jsonl")
    write_rollouts([RolloutGroup("a", [1, 2], [[3]]), RolloutGroup("b", [1, 2], [[3, 4, 300]])], path)
    assert len(read_rollouts(path, vocab_size=301)) == 2
    with pytest.raises(RolloutError, match=r"record 1: group 'b': responses\[0\]: token 2 has id 300, outside the vocabulary \[0, 300\)"):
        read_rollouts(path, vocab_size=300)


def test_parquet_errors_name_the_row_and_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"group_id": ["a", "b"], "prompt": [[1], [1]], "responses": [[[2]], [[]]]}), path)
    with pytest.raises(RolloutError, match=r"bad.parquet row 1: group 'b': responses\[0\]: empty response"):
        read_rollouts(path)
    pq.write_table(pa.table({"group_id": ["a"], "prompt": [[1]]}), path)
    with pytest.raises(RolloutError, match="missing required column"):
        read_rollouts(path)
    pq.write_table(pa.table({"group_id": ["a"], "prompt": [[1]], "responses": [[[2]]], "score": [1.0]}), path)
    with pytest.raises(RolloutError, match="unknown column"):
        read_rollouts(path)
    pq.write_table(pa.table({"group_id": ["a"], "prompt": [[1.5]], "responses": [[[2]]]}), path)
    with pytest.raises(RolloutError, match=r"row 0: group 'a': prompt: token ids must be integers, got 1.5"):
        read_rollouts(path)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def test_advantages_of_records_match_the_formulas():
    r = [1.0, 0.0, 0.0, 1.0, 1.0]
    recs = [RolloutGroup("a", [1], [[2]] * 5, rewards=r), RolloutGroup("b", [1], [[2]]),
            RolloutGroup("c", [1], [[2]] * 3, rewards=[0.5, 0.5, 0.5])]
    x = np.array(r)
    grpo, loo, plain = (compute_advantages(recs, AdvantageEstimator(**kw)) for kw in
                        [{}, {"baseline": "leave_one_out"}, {"normalize_std": False}])
    np.testing.assert_allclose(grpo[0], (x - x.mean()) / (x.std(ddof=1) + 1e-6), rtol=1e-12)
    others = [np.delete(x, i) for i in range(5)]
    np.testing.assert_allclose(loo[0], [(x[i] - o.mean()) / (o.std(ddof=1) + 1e-6) for i, o in enumerate(others)], rtol=1e-12)
    np.testing.assert_allclose(plain[0], x - x.mean(), rtol=1e-12)
    assert grpo[1] is None  # no rewards
    assert grpo[2] == (0.0, 0.0, 0.0)  # equal rewards: no signal
    with pytest.raises(ValueError, match="baseline must be one of"):
        AdvantageEstimator(baseline="median")


# --------------------------------------------------------------------------------------------
# Flat rows -> groups
# --------------------------------------------------------------------------------------------


def test_flat_rows_group_by_id_in_order_and_back():
    rows = [
        {"prompt_id": "q2", "prompt": [7, 8], "response": [1], "reward": 1.0, "old_logprobs": [-0.1]},
        {"prompt_id": "q1", "prompt": [5], "response": [2, 3], "reward": 0.0, "old_logprobs": [-0.2, -0.3]},
        {"prompt_id": "q2", "prompt": [7, 8], "response": [4, 4, 4], "reward": 0.5, "old_logprobs": [-1, -1, -1]},
        {"prompt_id": "q1", "prompt": [5], "response": [9], "reward": torch.tensor(1.0), "old_logprobs": [-0.5]},
        {"prompt_id": "q2", "prompt": [7, 8], "response": [6], "reward": np.float32(0.25), "old_logprobs": [-2]},
    ]
    fg = groups_from_flat(rows)
    assert [g.group_id for g in fg.groups] == ["q2", "q1"]  # first appearance
    q2, q1 = fg.groups
    assert q2.prompt == (7, 8) and q2.responses == ((1,), (4, 4, 4), (6,))  # row order kept
    assert q2.rewards == (1.0, 0.5, 0.25) and q2.old_logprobs == ((-0.1,), (-1.0,) * 3, (-2.0,))
    assert q1.responses == ((2, 3), (9,)) and q1.rewards == (0.0, 1.0)
    assert fg.rows == ((0, 2, 4), (1, 3))
    back = fg.to_rows([[r for r in g.responses] for g in fg.groups])
    assert back == [tuple(r["response"]) for r in rows]
    # the same rows as columns
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    assert groups_from_flat(cols).groups == fg.groups


def test_flat_rows_prompt_mismatch_and_partial_fields_are_errors():
    rows = [{"prompt_id": 3, "prompt": [1, 2, 3], "response": [4]}, {"prompt_id": 4, "prompt": [1], "response": [4]},
            {"prompt_id": 3, "prompt": [1, 2, 9], "response": [5]}]
    with pytest.raises(RolloutError, match=r"flat rows \[0, 2\] \(prompt_id 3\): .*row 1 differs from row 0 at token 2"):
        groups_from_flat(rows)
    rows[2]["prompt"] = [1, 2, 3]
    rows[0]["reward"] = 1.0
    with pytest.raises(RolloutError, match=r"'reward' is present in some rows of the group but not in rows \[2\]"):
        groups_from_flat(rows)
    with pytest.raises(RolloutError, match=r"flat row 1: missing 'prompt_id'"):
        groups_from_flat([rows[1], {"prompt": [1], "response": [2]}])
    with pytest.raises(RolloutError, match="name the same group id"):
        groups_from_flat([{"prompt_id": 1, "prompt": [1], "response": [2]}, {"prompt_id": "1", "prompt": [1], "response": [2]}])
    with pytest.raises(RolloutError, match=r"responses\[0\]: empty response"):
        groups_from_flat([{"prompt_id": "e", "prompt": [1], "response": []}])


def test_flat_rows_with_renamed_keys_verl_style():
    cols = {"uid": ["a", "a", "b"], "prompts": [[1, 2], [1, 2], [3]], "responses": [[4], [5, 6], [7]],
            "token_level_scores": [1.0, 0.0, 1.0]}
    fg = groups_from_flat(cols, keys={"group_id": "uid", "prompt": "prompts", "response": "responses",
                                      "rewards": "token_level_scores"})
    assert [(g.group_id, g.prompt, g.responses, g.rewards) for g in fg.groups] == [
        ("a", (1, 2), ((4,), (5, 6)), (1.0, 0.0)), ("b", (3,), ((7,),), (1.0,))]
    with pytest.raises(ValueError, match="unknown key mapping"):
        groups_from_flat(cols, keys={"uid": "uid"})


def test_rows_from_nemo_rl_style_sequences_with_multi_turn_mask():
    # row 0: prompt [1 2 3], response [4 5 | tool 6 7 | 8], padded; row 1: same prompt; row 2: other prompt
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 9, 9, 0, 0, 0, 0], [5, 6, 1, 0, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([8, 5, 3])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0]])
    lp = -torch.arange(27, dtype=torch.float32).reshape(3, 9) / 10
    rows = rows_from_sequences(input_ids, lengths, mask, ["x", "x", "y"], old_logprobs=lp, reward=torch.tensor([1.0, 0.0, 1.0]))
    fg = groups_from_flat(rows)
    x, y = fg.groups
    assert x.prompt == (1, 2, 3) and x.responses == ((4, 5, 6, 7, 8), (9, 9))
    assert x.loss_mask == ((1, 1, 0, 0, 1), (1, 1))
    assert x.old_logprobs == (tuple(f32(v) for v in lp[0, 3:8].tolist()), tuple(f32(v) for v in lp[1, 3:5].tolist()))
    assert x.rewards == (1.0, 0.0) and y.prompt == (5, 6) and y.responses == ((1,),)
    no_response = mask.clone()
    no_response[1] = 0
    with pytest.raises(RolloutError, match="sequence row 1: token_mask marks no generated token"):
        rows_from_sequences(input_ids, lengths, no_response, ["x", "x", "y"])
    with pytest.raises(RolloutError, match="sequence row 0: token_mask marks token 0 as generated"):
        rows_from_sequences(input_ids[:1], lengths[:1], torch.ones_like(mask[:1]), ["x"])


# --------------------------------------------------------------------------------------------
# The shipped default rollouts
# --------------------------------------------------------------------------------------------


def test_default_rollouts_are_valid_small_and_regenerate_identically(tmp_path):
    recs = read_rollouts(DEFAULT_ROLLOUTS, vocab_size=DEFAULT_ROLLOUTS_VOCAB_SIZE)
    assert 20 <= len(recs) <= 30 and os.path.getsize(DEFAULT_ROLLOUTS) < 200_000
    assert all(16 <= len(r.prompt) <= 96 and 2 <= r.num_responses <= 8 for r in recs)
    assert all(1 <= n <= 64 for r in recs for n in r.response_lengths)
    assert all(r.rewards is not None and r.advantages is not None for r in recs)
    assert any(r.loss_mask is not None and 0 in sum(r.loss_mask, ()) for r in recs)
    assert any(any(a != 0 for a in r.advantages) for r in recs)
    # the stored advantages are the GRPO advantages of the stored rewards (stored to 12 significant
    # digits; a wrong estimator, e.g. the biased std or no std at all, is off by > 1e-2)
    stripped = [RolloutGroup(r.group_id, r.prompt, r.responses, rewards=r.rewards) for r in recs]
    for r, a in zip(recs, compute_advantages(stripped)):
        np.testing.assert_allclose(r.advantages, a, rtol=1e-11, atol=0)
    out = tmp_path / "again.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_default_rollouts.py"), "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.read_bytes() == open(DEFAULT_ROLLOUTS, "rb").read()
