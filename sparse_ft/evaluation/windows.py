"""Which tokens each sliding window scores: the part every "cannot reproduce the paper's PPL"
report comes down to, kept in one place and tested by hand.

A window is ``Window(begin, end, first, last)``: the model reads tokens ``[begin, end)`` and
the predictions made at input positions ``[first, last)`` are scored (position ``p`` predicts
token ``p + 1``).

``standard`` (Hugging Face / Press et al.): windows of length L start at 0, stride,
2·stride, …; the first scores all its predictions, each later one only the tokens no earlier
window scored (its last ``end − previous end``); PPL = exp(total NLL / scored tokens).

``longlora`` (LongLoRA's eval.py): windows start every stride while ``start + L < N``, the
last of them dropped as its ``all_ix.pop()`` does; every prediction inside the window counts
(the model is called with ``labels=input_ids``, so a window of L tokens scores its L − 1
predictions of tokens ``begin+1 .. end−1``), and PPL = exp(mean over windows of the window's
mean loss). Tokens are scored many times over, so the number is not a perplexity of the
data in the usual sense; it exists to compare with LongLoRA's tables.

Either way a stride longer than the window would skip the tokens between two windows, which
no window scores: refused (``check``), since the PPL would then silently cover part of the data.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from sparse_ft.evaluation.names import FLAGS, BadParameter, Names

SCORINGS = ("standard", "longlora")


class Window(NamedTuple):
    begin: int
    end: int
    first: int
    last: int

    @property
    def scored(self) -> int:
        return self.last - self.first


def check(lengths: list[int], stride: int, names: Names = FLAGS) -> None:
    """Window lengths and the stride that score every token: a ``ValueError`` naming them as
    ``names`` says (eval's flags, or a recipe's keys)."""
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise BadParameter(f"{names.say('stride', stride)} must be an integer >= 1")
    short = [n for n in lengths if n < 2]
    if short:
        raise BadParameter(f"{names.entry('lengths', short[0])}: a window needs >= 2 tokens (its first predicts the second)")
    narrow = [n for n in lengths if n < stride]
    if narrow:
        raise BadParameter(f"{names.say('stride', stride)} is longer than the window {names.entry('lengths', narrow[0])}: "
                           f"the {stride - narrow[0]} tokens between two windows would never be scored; use "
                           f"{names.key('stride')} <= {min(lengths)}")


def plan(total: int, length: int, stride: int, scoring: str = "standard", *,
         max_windows: Optional[int] = None) -> list[Window]:
    if scoring not in SCORINGS:
        raise ValueError(f"--scoring {scoring!r} is unknown; allowed: {', '.join(SCORINGS)}")
    check([length], stride)
    if scoring == "standard":
        if total < 2:
            raise ValueError(f"{total} tokens: nothing to predict")
        windows, prev_end = [], 0
        for begin in range(0, total, stride):
            end = min(begin + length, total)
            windows.append(Window(begin, end, max(begin, prev_end - 1), end - 1))
            prev_end = end
            if end == total or (max_windows and len(windows) == max_windows):
                break
        return windows
    starts = list(range(0, total - length, stride))[:-1]
    if not starts:
        raise ValueError(f"--scoring longlora needs more than length+stride={length + stride} tokens, the data has {total}")
    windows = [Window(s, s + length, s, s + length - 1) for s in starts]
    return windows[:max_windows] if max_windows else windows
