"""The size checks the transformer models share: one-line errors naming the ``model.`` key."""
from __future__ import annotations


def check_transformer_sizes(sizes: dict[str, int], width: int, heads: int, dropout: float) -> None:
    """Refuses a size that is not a positive whole number, a ``width`` that ``heads`` does not divide,
    and a ``dropout`` outside [0, 1).

    Raises:
        ValueError: naming the first bad key and what was expected.
    """
    for key, value in {**sizes, "width": width, "heads": heads}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{key}={value!r}: expected a positive whole number")
    if width % heads:
        raise ValueError(f"model.width={width} is not divisible by model.heads={heads}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout!r}: expected a number in [0, 1)")
