"""Unlikelihood fine-tuning pieces: which tokens count as repeats, the repetition rate, the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_cli.demo.unlikelihood import repeated_ngram_mask, repetition_rate, unlikelihood_loss


def test_mask_marks_every_token_of_a_repeated_ngram_in_the_continuation() -> None:
    # prompt 7 8 | continuation 1 2 3 1 2 9: the 2-gram (1, 2) repeats at positions 5-6
    seq = np.array([7, 8, 1, 2, 3, 1, 2, 9])
    assert repeated_ngram_mask(seq, 2, 2).tolist() == [False] * 5 + [True, True, False]


def test_copying_from_the_prompt_is_not_a_repeat() -> None:
    seq = np.array([1, 2, 3, 1, 2, 3])
    assert not repeated_ngram_mask(seq, 3, 2).any()


def test_a_loop_is_masked_from_its_second_period_on() -> None:
    seq = np.array([5] + [1, 2] * 4)
    mask = repeated_ngram_mask(seq, 1, 2)
    assert mask.tolist() == [False, False, False] + [True] * 6


def test_repetition_rate_counts_ngrams_seen_anywhere_earlier() -> None:
    # n=2, prompt (1, 2); continuation 1 2 4: 2-grams (2,1) new, (1,2) seen in the prompt, (2,4) new
    assert repetition_rate(np.array([1, 2, 1, 2, 4]), 2, n=2) == pytest.approx(1 / 3)
    assert repetition_rate(np.array([1, 2, 3]), 3, n=2) == 0.0


def test_unlikelihood_loss_is_minus_log_one_minus_p_over_masked_positions() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]]))
    targets = torch.tensor([[0, 0]])
    only_first = torch.tensor([[1.0, 0.0]])
    assert unlikelihood_loss(logits, targets, only_first).item() == pytest.approx(-math.log(0.5))
    both = torch.ones(1, 2)
    assert unlikelihood_loss(logits, targets, both).item() == pytest.approx(-(math.log(0.5) + math.log(0.1)) / 2)
    assert unlikelihood_loss(logits, targets, torch.zeros(1, 2)).item() == 0.0
