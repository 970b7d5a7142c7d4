"""Unit tests: cost model, policy validation, lengths files, rank balancing."""

from __future__ import annotations

import pytest

from pipeline.modes import OverBudgetPolicy
from pipeline.planner.cost_model import CostModel
from pipeline.planner.lengths_file import LengthsFileError, parse_lengths, read_lengths
from pipeline.planner.policy import LOOKAHEAD_BUDGETS, MAX_WINDOW_SAMPLES, BatchingPolicy
from pipeline.planner.rank_balancer import group_by_cost, rank_order
from pipeline.planner.types import Collate, MeasuredSample


def test_cost_model_padded_packed_compute():
    padded = CostModel(Collate.PADDED)
    packed = CostModel("packed")
    assert padded.token_cost([3, 5, 2]) == 15
    assert packed.token_cost([3, 5, 2]) == 10
    assert padded.token_cost([]) == packed.token_cost([]) == 0
    assert padded.compute_is_tokens and padded.compute_cost([3, 5, 2]) == 15
    attn = CostModel(Collate.PACKED, attn_a=2.0, attn_b=0.5)
    assert attn.compute_cost([2, 4]) == (2 * 2 + 0.5 * 4) + (2 * 4 + 0.5 * 16)
    assert CostModel(Collate.PADDED, 1.0, 1.0).compute_cost([1, 3]) == 2 * (3 + 9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attn_a": -1.0}, "attn_a must be a finite number >= 0, got -1.0"),
        ({"attn_b": float("nan")}, "attn_b must be a finite number >= 0"),
        ({"attn_a": 0.0, "attn_b": 0.0}, "cannot both be 0"),
    ],
)
def test_cost_model_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_budget": 0}, "token_budget must be > 0, got 0"),
        ({"token_budget": -5}, "token_budget must be > 0, got -5"),
        ({"token_budget": 1.5}, "token_budget must be an integer, got 1.5"),
        ({"token_budget": 10, "max_window_samples": 0},
         "max_window_samples must be an integer >= 1, got 0"),
        ({"token_budget": 10, "lookahead_tokens": 9},
         r"lookahead_tokens must be an integer >= token_budget \(10\) or None, got 9"),
        ({"token_budget": 10, "max_visual_tokens": 0}, "max_visual_tokens must be a positive"),
        ({"token_budget": 10, "collate": "ragged"}, "collate must be one of"),
        ({"token_budget": 10, "over_budget": "drop"}, "over_budget must be one of"),
        ({"token_budget": 10, "attn_b": -1.0}, "attn_b must be"),
    ],
)
def test_policy_validation_names_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchingPolicy(**kwargs)


def test_lookahead_defaults_relative_to_the_budget():
    assert BatchingPolicy(100).lookahead_tokens == LOOKAHEAD_BUDGETS * 100
    assert BatchingPolicy(100, lookahead_tokens=100).lookahead_tokens == 100
    assert BatchingPolicy(100).max_window_samples == MAX_WINDOW_SAMPLES


def test_policy_coerces_strings():
    p = BatchingPolicy(100, collate="packed", over_budget="quarantine")
    assert p.collate is Collate.PACKED and p.over_budget is OverBudgetPolicy.QUARANTINE
    assert p.cost_model == CostModel(Collate.PACKED)


def test_lengths_plain_ids_are_line_numbers():
    got = parse_lengths(["5", "", " 7 ", "0"])
    assert got == [MeasuredSample(0, 5), MeasuredSample(2, 7), MeasuredSample(3, 0)]


def test_lengths_jsonl():
    lines = [
        '{"sample_id": "a:1", "num_tokens": 10}',
        '{"sample_id": 7, "num_tokens": 3, "num_visual_tokens": 2}',
    ]
    assert parse_lengths(lines) == [MeasuredSample("a:1", 10), MeasuredSample(7, 3, 2)]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["1", "x2"], "line 2: expected an integer token count, got 'x2'"),
        (["1", "-3"], "line 2: token count must be >= 0, got -3"),
        (['{"sample_id": 1, "num_tokens": 1}', "{oops"], "line 2: invalid JSON"),
        (['{"sample_id": 1}'], "line 1: missing field 'num_tokens'"),
        (['{"num_tokens": 1}'], "line 1: missing field 'sample_id'"),
        (['{"sample_id": 1, "num_tokens": "9"}'], "line 1: num_tokens must be an integer"),
        (
            ['{"sample_id": 1, "num_tokens": 1}', '{"sample_id": 1, "num_tokens": 2}'],
            "line 2: duplicate sample_id 1",
        ),
        (['{"sample_id": [1], "num_tokens": 1}'], "sample_id must be an integer or string"),
        (['{"sample_id": 1, "num_tokens": 1, "num_visual_tokens": -1}'], "must be >= 0"),
    ],
)
def test_lengths_errors_name_the_line(lines, message):
    with pytest.raises(LengthsFileError, match=message):
        parse_lengths(lines, name="f.txt")


def test_read_lengths_missing_file(tmp_path):
    with pytest.raises(LengthsFileError, match="lengths file not found"):
        read_lengths(tmp_path / "nope.txt")
    with pytest.raises(LengthsFileError, match="is a directory"):
        read_lengths(tmp_path)


def test_group_by_cost_puts_similar_costs_together():
    costs = [10, 1, 9, 2, 11, 3]
    assert group_by_cost(costs, 2) == [[4, 0], [2, 5], [3, 1]]
    assert group_by_cost(costs, 4) == [[4, 0, 2, 5], [3, 1]]
    assert group_by_cost([], 3) == []
    with pytest.raises(ValueError):
        group_by_cost([1], 0)


def test_rank_order_is_a_seeded_permutation():
    a = rank_order(1, 5, 8)
    assert sorted(a) == list(range(8))
    assert a == rank_order(1, 5, 8)
    assert any(rank_order(1, s, 8) != a for s in range(6, 12))
    assert rank_order(1, 5, 1) == [0]
