"""Prompt-lookup drafter: latest match, longest n-gram first, periodic copy, exactly block_size - 1 ids."""

from __future__ import annotations

import time

import pytest

from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter


def test_proposes_tokens_after_the_match() -> None:
    drafter = PromptLookupDrafter(block_size=4)
    # suffix 3-gram (1, 2, 3) occurred at the start, followed by 4, 5, 6
    assert drafter.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == [4, 5, 6]


def test_latest_occurrence_wins() -> None:
    drafter = PromptLookupDrafter(block_size=3, max_ngram=2)
    # (7, 8) occurs twice before the suffix: followed by 1, 1 first, then by 2, 2 (latest)
    assert drafter.propose([7, 8, 1, 1, 7, 8, 2, 2, 7, 8]) == [2, 2]


def test_longest_ngram_first() -> None:
    drafter = PromptLookupDrafter(block_size=3, max_ngram=3)
    # 1-gram (3,) latest match is followed by 40; the 3-gram (1, 2, 3) match is followed by 10, 11
    committed = [1, 2, 3, 10, 11, 5, 3, 40, 0, 1, 2, 3]
    assert drafter.propose(committed) == [10, 11]


def test_falls_back_to_shorter_ngrams() -> None:
    drafter = PromptLookupDrafter(block_size=3, max_ngram=3)
    # neither (8, 9, 5) nor (9, 5) occurred earlier; (5,) did, followed by 6, 7
    assert drafter.propose([5, 6, 7, 8, 9, 5]) == [6, 7]


def test_a_short_continuation_goes_on_with_its_period() -> None:
    drafter = PromptLookupDrafter(block_size=6)
    # (1, 2) matched at 0; only 3, 1, 2 follow before the end: the period (3, 1, 2) repeats
    assert drafter.propose([1, 2, 3, 1, 2]) == [3, 1, 2, 3, 1]


def test_a_two_token_loop_fills_the_block() -> None:
    drafter = PromptLookupDrafter(block_size=8)
    # the latest match of (4, 200, 4) is two tokens back; the loop continues through the block
    assert drafter.propose([9, 200, 4, 200, 4, 200, 4]) == [200, 4, 200, 4, 200, 4, 200]


def test_no_match_repeats_the_last_committed_token() -> None:
    drafter = PromptLookupDrafter(block_size=5)
    assert drafter.propose([1, 2, 3, 4]) == [4, 4, 4, 4]
    assert drafter.propose([9]) == [9, 9, 9, 9]


def test_suffix_itself_is_not_a_match() -> None:
    drafter = PromptLookupDrafter(block_size=3, max_ngram=2, min_ngram=2)
    assert drafter.propose([4, 5]) == [5, 5]


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_always_exactly_block_size_minus_one(block_size: int) -> None:
    drafter = PromptLookupDrafter(block_size=block_size)
    for committed in ([3], [1, 2, 1], list(range(40)) + [5, 6], [7] * 30):
        assert len(drafter.propose(committed)) == block_size - 1


def test_min_ngram_limits_the_fallback() -> None:
    drafter = PromptLookupDrafter(block_size=3, max_ngram=3, min_ngram=2)
    # only a 1-gram match exists, which min_ngram=2 forbids
    assert drafter.propose([5, 6, 7, 8, 9, 5]) == [5, 5]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PromptLookupDrafter(block_size=0)
    with pytest.raises(ValueError):
        PromptLookupDrafter(block_size=4, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        PromptLookupDrafter(block_size=4).propose([])


def test_fast_on_long_sequences() -> None:
    drafter = PromptLookupDrafter(block_size=16)
    committed = list(range(4000)) + [123456]  # worst case: no match for any n
    start = time.perf_counter()
    for _ in range(20):
        drafter.propose(committed)
    assert (time.perf_counter() - start) / 20 < 0.01
