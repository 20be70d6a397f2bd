"""One prompt of a task with its reference answer (megatron_rz.rl.tasks), the type every task hands out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    prompt: str  # the prompt as plain text (what a model without a chat template sees)
    answer: str
    # data tasks: the chat messages of the prompt (system + user), and the source row / entry
    messages: tuple = field(default=(), compare=False)
    row: Any = field(default=None, compare=False)
