"""ours_lora: nightshift's path with `[train] method = "lora"` (the base in bf16), beside `ours` (qlora)."""

from benchmarks.stacks.ours import run

__all__ = ["run"]
