"""`trainer/compat.py`: the declared TRL range and the import-time check of the `GRPOTrainer` hooks we override."""

import re
from pathlib import Path

import pytest
from trl import GRPOTrainer

from trl_infinite.trainer.compat import SUPPORTED_TRL, TRL_HOOKS, check_trl_hooks, hook_mismatches

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_installed_trl_has_the_expected_hooks():
    assert hook_mismatches(GRPOTrainer) == []
    check_trl_hooks()


def test_an_older_hook_signature_raises_naming_the_supported_range():
    class OldTRL(GRPOTrainer):  # trl < 1.16 called `_generate_single_turn` with three arguments
        def _generate_single_turn(self, prompts, images):
            raise AssertionError

    with pytest.raises(ImportError, match=re.escape(f"trl{SUPPORTED_TRL}")) as info:
        check_trl_hooks(OldTRL, "1.10.0")
    assert "_generate_single_turn" in str(info.value) and "1.10.0" in str(info.value)
    assert set(TRL_HOOKS) >= {"_generate_single_turn", "_calculate_rewards", "_generate_and_score_completions"}


def test_pyproject_declares_the_supported_range():
    assert f'"trl{SUPPORTED_TRL}"' in PYPROJECT.read_text()
