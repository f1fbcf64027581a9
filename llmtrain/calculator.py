"""The calculator demo's tools (docs/agents.md), as grpo.tools names them:
`llmtrain.calculator:add` and `llmtrain.calculator:multiply`. Plain functions with type hints
and Google-style docstrings, as TRL's `tools=` takes them: a model sees their schemas. A
module of their own, importing nothing, so that loading them runs nothing else."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
