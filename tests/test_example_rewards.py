"""The example scripts' ready-made accuracy rewards (`examples/rewards.py`)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from rewards import format_reward, gsm8k_reward, knights_knaves_reward, math_reward  # noqa: E402


def test_gsm8k_reward():
    answers = ["Natalia sold 48+24 = 72 clips.\n#### 72", "#### 1,000", "10"]
    completions = ["so the answer is 72.", [{"role": "assistant", "content": "total: 1000"}], "it is \\boxed{11}"]
    assert gsm8k_reward(completions, answers) == [1.0, 1.0, 0.0]
    assert gsm8k_reward(["5"], [None]) == [None]


def test_math_reward():
    solutions = ["so $x = \\boxed{\\dfrac{1}{2}}$.", "answer \\boxed{\\left( 3, 4 \\right)}"]
    completions = ["thus \\boxed{\\frac{1}{2}}", "\\boxed{(3,5)}"]
    assert math_reward(completions, solution=solutions) == [1.0, 0.0]
    assert math_reward(["\\boxed{7}"], answer=["7"]) == [1.0]


def test_knights_knaves_reward():
    ref = ["Amelia is a hero, and Elizabeth is a villain."]
    assert knights_knaves_reward(["Amelia is a hero, and Elizabeth is a villain"], ref) == [1.0]
    assert knights_knaves_reward(["Amelia is a hero. Elizabeth is a hero."], ref) == [0.0]
    assert knights_knaves_reward(["I do not know."], ref) == [0.0]


def test_format_reward():
    assert format_reward(["work...\nanswer: 12", "no idea", "\\boxed{x}"]) == [1.0, 0.0, 1.0]
