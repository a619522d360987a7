"""Example tools for tool-calling tests and benchmarks (`tools=[...]` of TRL's trainer, `apply_chat_template`):
plain functions with the docstrings transformers reads their JSON schema from."""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """
    Divides two numbers (raises `ZeroDivisionError` for `b == 0`: a failing tool call).

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b
