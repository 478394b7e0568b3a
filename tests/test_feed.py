"""`Feed.apply` puts the previous step's sampled ids into the step's input ids: in a decode batch that kept
its order (row i takes pick i, the steady state, done with one copy) and in any other mapping."""
import torch

from kiln.runtime.step import Feed


def fed(rows: list[int], picks: list[int], sampled: list[int]) -> list[int]:
    input_ids = torch.full((6,), -1, dtype=torch.int32)
    Feed(rows, picks, torch.tensor(sampled, dtype=torch.long)).apply(input_ids)
    return input_ids.tolist()


def test_a_batch_in_the_previous_order_takes_the_ids_as_they_are():
    assert fed([0, 1, 2], [0, 1, 2], [11, 12, 13, 14]) == [11, 12, 13, -1, -1, -1]


def test_other_mappings_take_each_row_its_pick():
    assert fed([0, 1, 2], [2, 0, 1], [11, 12, 13]) == [13, 11, 12, -1, -1, -1]
    assert fed([1, 4], [0, 1], [11, 12]) == [-1, 11, -1, -1, 12, -1]     # a prefill chunk between
    assert fed([0, 1], [1, 2], [11, 12, 13]) == [12, 13, -1, -1, -1, -1]  # the first sequence finished
