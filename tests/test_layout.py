"""The layout: segments, rotary positions, loss edges, padding and every validation error."""

import pytest
import torch

from megatron_dualkv import Group, LayoutError, SegmentTable, build_layout


def test_segments_positions_and_edges_of_two_groups():
    lay = build_layout([([1, 2, 3], [[4, 5], [6]]), ([7], [[8, 9, 10]])], vocab_size=11, pad_to_multiple=4)
    seg = lay.segments
    assert seg.host_start == (0, 3, 5, 6, 7, 10)
    assert seg.host_length == (3, 2, 1, 1, 3, 2)
    assert seg.host_parent == (-1, 0, 0, -1, 3, -1)  # last segment is padding, its own root
    assert seg.depth == 2
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 0, 1]
    # the first token of every response is predicted by the last prompt row
    assert lay.source_rows.tolist() == [2, 3, 2, 6, 7, 8]
    assert lay.target_rows.tolist() == [3, 4, 5, 7, 8, 9]
    assert lay.target_ids.tolist() == [4, 5, 6, 8, 9, 10]
    assert lay.edge_response.tolist() == [0, 0, 1, 2, 2, 2]
    assert lay.token_weight.tolist() == [2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert lay.padding_mask.tolist() == [False] * 10 + [True] * 2
    assert lay.num_real_tokens == 10 and lay.num_tokens == 12
    assert lay.replicated_num_tokens() == (3 + 2) + (3 + 1) + (1 + 3)


def test_positions_and_edges_match_the_replicated_sequences():
    torch.manual_seed(0)
    groups = []
    for _ in range(3):
        p = torch.randint(0, 50, (int(torch.randint(1, 9, ())),)).tolist()
        rs = [torch.randint(0, 50, (int(torch.randint(1, 7, ())),)).tolist() for _ in range(int(torch.randint(1, 5, ())))]
        groups.append((p, rs))
    lay = build_layout(groups)
    ids, pos = lay.input_ids.tolist(), lay.position_ids.tolist()
    offs = lay.response_edge_offsets
    m = 0
    for p, rs in groups:
        for r in rs:
            seq = p + r
            e = slice(offs[m], offs[m + 1])
            # edge t predicts seq[len(p)+t] from a row holding seq[len(p)+t-1] at that position
            for t, (src, tgt) in enumerate(zip(lay.source_rows[e].tolist(), lay.target_ids[e].tolist())):
                assert tgt == seq[len(p) + t]
                assert ids[src] == seq[len(p) + t - 1] and pos[src] == len(p) + t - 1
            m += 1


@pytest.mark.parametrize(
    "groups, kwargs, message",
    [
        ([([1, 2], [])], {}, "group 0: no responses"),
        ([([1, 2], [[3]]), ([1], [[2], []])], {}, "group 1: response 1 is empty"),
        ([([], [[3]])], {}, "group 0: empty prompt"),
        ([([1, 2], [[3, 99]])], {"vocab_size": 50}, "group 0: response 0 token 1 has id 99, outside the vocabulary"),
        ([([1, -2], [[3]])], {"vocab_size": 50}, "group 0: prompt token 1 has id -2"),
        ([([1, 2, 3], [[4, 5], [6, 7]])], {"max_tokens": 6}, "7 packed tokens, over its budget of 6"),
        ([], {}, "at least one group"),
    ],
)
def test_bad_input_names_the_problem(groups, kwargs, message):
    with pytest.raises(LayoutError, match=message):
        build_layout(groups, **kwargs)


def test_group_from_replicated_rows_checks_the_prompts():
    g = Group.from_pairs([([1, 2, 3], [4]), ([1, 2, 3], [5, 6])], name="rollout-7")
    assert g.prompt == (1, 2, 3) and g.responses == ((4,), (5, 6))
    with pytest.raises(LayoutError, match=r"rollout-7: prompts are not identical inside the group: row 1 differs from row 0 at token 2"):
        Group.from_pairs([([1, 2, 3], [4]), ([1, 2, 9], [5])], name="rollout-7")
    with pytest.raises(LayoutError, match="group 1 \\(rollout-9\\): response 0 is empty"):
        build_layout([Group.of([1], [[2]]), Group.of([1], [[]], name="rollout-9")])


def test_non_integer_ids_are_rejected():
    with pytest.raises(LayoutError, match="token ids must be integers"):
        build_layout([(torch.tensor([1.0, 2.0]), [[3]])])


def test_segment_table_from_group_lengths_matches_build_layout():
    """The length-only constructor (kernel tests, benchmarks) describes what the packer builds."""
    groups = [([1, 2, 3], [[4, 5], [6]]), ([7], [[8, 9, 10]])]
    lay = build_layout(groups, pad_to_multiple=4)
    seg = SegmentTable.from_group_lengths([(3, [2, 1]), (1, [3])], pad=2)
    assert (seg.host_start, seg.host_length, seg.host_parent) == (
        lay.segments.host_start, lay.segments.host_length, lay.segments.host_parent)
    assert seg.tree_ranges() == [(0, 6), (6, 10), (10, 12)]
