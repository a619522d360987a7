"""`trainer/rollout.py`: TRL's group layout reaches the engine as it is (each prompt `num_generations` times in a row, a
process's slice possibly starting or ending inside a group): nothing re-infers the groups from the prompt rows."""

import pytest

from trl_infinite.trainer.rollout import PromptRun, check_groups, trl_groups


def test_groups_of_a_whole_batch_and_of_a_process_slice():
    assert trl_groups(6, 3) == [PromptRun(0, 3), PromptRun(3, 3)]
    # 2 processes x 3 rows, G = 2: process 1 holds global rows 3..5, its first row ends a group split with process 0
    assert trl_groups(3, 2, first_row=3) == [PromptRun(0, 1), PromptRun(1, 2)]
    assert trl_groups(3, 2, first_row=0) == [PromptRun(0, 2), PromptRun(2, 1)]
    assert trl_groups(4, 1) == [PromptRun(i, 1) for i in range(4)]  # the tool loop: one row per sample


def test_identical_neighbouring_prompts_stay_separate_groups():
    rows = [[5, 6]] * 4  # the same prompt drawn twice in a row: two groups of G = 2, not one of 4
    assert trl_groups(len(rows), 2) == [PromptRun(0, 2), PromptRun(2, 2)]
    check_groups(rows, trl_groups(len(rows), 2))


def test_rows_that_do_not_follow_the_layout_are_refused():
    with pytest.raises(ValueError, match="rows 0..1 should hold one prompt"):
        check_groups([[1], [2], [3], [3]], trl_groups(4, 2))
