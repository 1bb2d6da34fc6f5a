"""What an evaluation task's checks call its parameters: ``sparse-ft eval``'s flags
(``--trials -1``) or a recipe's keys (``validation.params.passkey.trials=-1``). Each task has
one check of its parameters (``Task.check``), which eval and validation during training both
run, so a value refused by one is refused by the other, and each says it as its user typed it.
"""

from __future__ import annotations

from typing import Any, Callable


class BadParameter(ValueError):
    """A task parameter refused by its check; the message starts with the parameter's name as
    :class:`Names` says it (a recipe prefixes ``recipe key``)."""


class Names:
    """Names a task parameter: ``key(param)`` the flag or recipe key alone, ``say(param,
    value)`` with its value (``--trials -1``, ``validation.params.passkey.trials=-1``),
    ``entry(param, value)`` one entry of a list (``--lengths 1``, ``validation.lengths entry 1``)."""

    def __init__(self, key: Callable[[str], str], *, recipe: bool) -> None:
        self.key, self.recipe = key, recipe

    def say(self, param: str, value: Any) -> str:
        return f"{self.key(param)}={value!r}" if self.recipe else f"{self.key(param)} {value}"

    def entry(self, param: str, value: Any) -> str:
        return f"{self.key(param)} entry {value!r}" if self.recipe else f"{self.key(param)} {value}"


def flags(renamed: dict[str, str]) -> Names:
    """eval's flags: ``--`` and the parameter with dashes, or the flag ``renamed`` gives it."""
    return Names(lambda param: renamed.get(param, "--" + param.replace("_", "-")), recipe=False)


FLAGS = flags({})
