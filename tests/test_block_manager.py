"""BlockManager and StateSlotManager: exact ids handed out, free order, ref counts, integrity."""

from __future__ import annotations

import pytest

from deepinfer.scheduler.block_manager import BlockManager
from deepinfer.scheduler.state_slots import StateSlotManager


def test_allocate_hands_out_lowest_ids_first() -> None:
    blocks = BlockManager(8)
    assert blocks.allocate(3) == [0, 1, 2]
    assert blocks.allocate(2) == [3, 4]
    assert blocks.allocate(0) == []
    assert (blocks.num_free_blocks, blocks.num_used_blocks) == (3, 5)
    assert [blocks.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    blocks.check_integrity()


def test_free_appends_a_table_tail_first_and_reuses_fifo() -> None:
    blocks = BlockManager(8)
    table_a = blocks.allocate(3)  # [0, 1, 2]
    table_b = blocks.allocate(2)  # [3, 4]
    blocks.free(table_a)  # free list: [5, 6, 7, 2, 1, 0]
    assert (blocks.num_free_blocks, blocks.num_used_blocks) == (6, 2)
    assert blocks.allocate(4) == [5, 6, 7, 2]
    blocks.free(table_b)  # free list: [1, 0, 4, 3]
    assert blocks.allocate(4) == [1, 0, 4, 3]
    assert not blocks.can_allocate(1)
    blocks.check_integrity()


def test_can_allocate_counts_free_blocks() -> None:
    blocks = BlockManager(4)
    assert blocks.can_allocate(4)
    assert not blocks.can_allocate(5)
    blocks.allocate(3)
    assert blocks.can_allocate(1)
    assert not blocks.can_allocate(2)


def test_shared_block_returns_to_free_list_at_last_reference() -> None:
    blocks = BlockManager(4)
    assert blocks.allocate(2) == [0, 1]
    blocks.incref([0])
    assert blocks.ref_count(0) == 2
    blocks.free([0, 1])  # block 1 is freed, block 0 is still held once
    assert (blocks.num_free_blocks, blocks.num_used_blocks) == (3, 1)
    assert blocks.ref_count(0) == 1
    blocks.free([0])
    assert (blocks.num_free_blocks, blocks.num_used_blocks) == (4, 0)
    assert blocks.allocate(4) == [2, 3, 1, 0]
    blocks.check_integrity()


def test_double_free_and_over_allocation_are_assertion_errors() -> None:
    blocks = BlockManager(2)
    table = blocks.allocate(1)
    blocks.free(table)
    with pytest.raises(AssertionError, match="block 0 with ref count 0"):
        blocks.free(table)
    with pytest.raises(AssertionError, match=r"allocate\(3\) with only 2 of 2 free"):
        blocks.allocate(3)
    with pytest.raises(AssertionError, match="incref of free block 1"):
        blocks.incref([1])


def test_block_integrity_check_reports_the_numbers() -> None:
    blocks = BlockManager(4)
    blocks.allocate(2)
    blocks._num_used_blocks = 3
    with pytest.raises(RuntimeError, match=r"2 free \+ 3 used != 4 total"):
        blocks.check_integrity()
    blocks = BlockManager(4)
    blocks.allocate(2)
    blocks._ref_counts[3] = 1
    with pytest.raises(RuntimeError, match="block 3: ref count 1 but on the free list"):
        blocks.check_integrity()


def test_state_slots_lowest_free_id_first() -> None:
    slots = StateSlotManager(4)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    slots.free(1)
    slots.free(0)
    assert (slots.num_free_slots, slots.num_used_slots) == (3, 1)
    assert slots.used_slots == frozenset({2})
    assert [slots.allocate() for _ in range(3)] == [0, 1, 3]
    assert not slots.can_allocate()
    slots.check_integrity()


def test_state_slot_misuse_is_an_assertion_error() -> None:
    slots = StateSlotManager(1)
    slot = slots.allocate()
    with pytest.raises(AssertionError, match="all 1 state slots in use"):
        slots.allocate()
    slots.free(slot)
    with pytest.raises(AssertionError, match="state slot 0, which is not in use"):
        slots.free(slot)
    with pytest.raises(AssertionError, match="state slot 5, which is not in use"):
        slots.free(5)


def test_state_slot_integrity_check_reports_the_numbers() -> None:
    slots = StateSlotManager(3)
    slots.allocate()
    slots._used_slots.add(1)
    with pytest.raises(RuntimeError, match=r"2 free \+ 2 used != 3 total"):
        slots.check_integrity()
    slots = StateSlotManager(2)
    slots._free_slots.append(7)
    slots._used_slots.discard(0)
    slots._free_slots.remove(0)
    with pytest.raises(RuntimeError, match=r"ids outside 0\.\.1"):
        slots.check_integrity()
