"""Ready-made accuracy rewards with TRL's reward-function signature (`completions`, dataset columns as kwargs).

- `gsm8k_reward`: the final number of the completion vs the `answer` column (GSM8K's "... #### 72" or "72").
- `math_reward`: the last `\\boxed{...}` of the completion vs the last one of `solution` (or `answer`).
- `knights_knaves_reward`: "<Name> is a <role>" statements vs the `answer` column (reasoning-gym's format).
- `format_reward`: 1 when the completion ends with a recognisable final answer (a number or a `\\boxed{}`).
All return 1.0 / 0.0 per completion, and None where the row has no reference (TRL then ignores it).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_STATEMENT = re.compile(r"\b([A-Z][a-z]+) is an? ([a-z]+)")


def completion_text(completion) -> str:
    """Plain text of a completion: a string, or the content of TRL's conversational `[{"role", "content"}]`."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The final answer as a number: after GSM8K's `####`, else inside the last `\\boxed{}`, else the last number."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    else:
        boxed = last_boxed(text)
        if boxed is not None:
            text = boxed
    found = _NUMBER.findall(text)
    return _as_number(found[-1]) if found else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces handled), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_math(answer: str) -> str:
    """Light normalisation of a LaTeX answer for exact-match comparison."""
    s = answer.strip().strip("$").rstrip(".")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle", " "):
        s = s.replace(token, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("^{\\circ}", "").replace("^\\circ", "")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    return s


def gsm8k_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion's final number equals the reference's (GSM8K `answer` column)."""
    out = []
    for c, ref in zip(completions, answer):
        target = last_number(str(ref)) if ref is not None else None
        got = last_number(completion_text(c))
        out.append(None if target is None else float(got is not None and abs(got - target) < 1e-6))
    return out


def math_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's last `\\boxed{}` matches the reference's (MATH `solution`, or an `answer`)."""
    refs = solution if solution is not None else answer
    out = []
    for c, ref in zip(completions, refs):
        target = last_boxed(str(ref)) if ref is not None else None
        target = target if target is not None else (str(ref) if ref is not None and answer is not None else None)
        got = last_boxed(completion_text(c))
        ok = got is not None and target is not None and normalize_math(got) == normalize_math(target)
        out.append(None if target is None else float(ok))
    return out


def role_assignment(text: str) -> dict[str, str]:
    """{name: role} from "<Name> is a <role>" statements (the last statement about a name wins)."""
    return {name: role for name, role in _STATEMENT.findall(text)}


def knights_knaves_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion assigns every person the reference role (reasoning-gym `knights_knaves`)."""
    out = []
    for c, ref in zip(completions, answer):
        target = role_assignment(str(ref)) if ref is not None else {}
        if not target:
            out.append(None)
            continue
        got = role_assignment(completion_text(c))
        out.append(float(all(got.get(name) == role for name, role in target.items())))
    return out


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion gives a final answer (a `\\boxed{}` or a number in its last line)."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        last_line = text.splitlines()[-1] if text else ""
        out.append(float(last_boxed(text) is not None or bool(_NUMBER.search(last_line))))
    return out


REWARDS = {
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "knights_knaves": knights_knaves_reward,
    "format": format_reward,
}
