"""Chat and instruction rows for supervised fine-tuning (``data.format: chat | instruction``):
each row rendered to text, tokenised, and the tokens the loss trains on marked (the answers;
every other label is -100).

- **chat**: ``{"messages": [{"role": ..., "content": ...}, ...]}``, roles from :data:`ROLES`,
  at least one assistant turn. Rendered by a Jinja chat template: ``data.chat_template`` (the
  template itself, or the path of a file holding it) or else the tokenizer's own. The answer
  tokens are every assistant turn's, found by rendering the conversation prefix by prefix: the
  messages before the turn with the generation prompt (where an answer starts), then through
  the turn (where it ends, the template's end-of-turn text included: the model learns to stop).
  This works with any template that renders a conversation's first messages as the start of the
  whole; a template that rewrites earlier turns is refused naming the row. transformers'
  ``return_assistant_tokens_mask`` would need ``{% generation %}`` marks, which few shipped
  templates carry, so it is not used.
- **instruction**: ``{"instruction", "input" (optional), "output"}``, as LongAlpaca-12k. The
  prompt is the instruction as it stands, then a blank line and the input where the row has a
  non-empty one (``PROMPT``); the answer is the output followed by EOS. LongLoRA's
  supervised-fine-tune.py trains LongAlpaca so: its instructions carry their own prompt
  format (Llama-2's ``[INST]``), and it finds the answer by tokenising the prompt alone.

Texts are tokenised without special tokens, as text rows are (a chat template writes the BOS
it wants). A span's bounds are token counts: the number of the whole row's first tokens that
tokenising the prefix alone gives too. Where the pieces' tokens do not merge (always with
special tokens or whitespace at the joins, as in the shipped templates) that is the prefix's own
token count; a token that straddles a join goes to the text after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from sparse_ft.data.sources import iter_rows

ROLES = ("system", "user", "assistant", "tool")
PROMPT = ("{instruction}", "{instruction}\n\n{input}")  # without, with a non-empty input
TEMPLATE_MARKS = ("{{", "{%")


@dataclass
class Rendered:
    """A row as text, and each answer as the two prefixes of ``text`` around it."""

    text: str
    answers: list[tuple[str, str]]
    eos: bool  # an EOS follows the text, as a target (instruction rows)


def read_chat_template(value: str) -> str:
    """``data.chat_template``: text holding ``{{`` or ``{%`` is the template itself, anything
    else the path of a file holding it (``ValueError`` when there is none)."""
    if any(mark in value for mark in TEMPLATE_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError("a Jinja chat template (text with {{ or {%), or the path of a file holding one; no such file")
    return path.read_text(encoding="utf-8")


class Renderer:
    """Renders the rows of ``data_cfg.format`` with ``tokenizer`` and finds their answers."""

    def __init__(self, data_cfg: Any, tokenizer: Any) -> None:
        self.format, self.tokenizer = data_cfg.format, tokenizer
        self.template = None
        if self.format == "chat":
            given = data_cfg.chat_template
            self.template = read_chat_template(given) if given is not None else tokenizer.chat_template
            if not isinstance(self.template, str):
                raise ValueError("data.chat_template is not set and the model's tokenizer has no chat template: "
                                 "set data.chat_template to a Jinja template, or the path of a file holding one")

    def __call__(self, where: str, row: dict) -> Rendered:
        return self._chat(where, row) if self.format == "chat" else _instruction(where, row)

    def _chat(self, where: str, row: dict) -> Rendered:
        messages = _messages(where, row)
        full = self._render(where, messages, False)
        answers = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self._render(where, messages[:turn], True), self._render(where, messages[: turn + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise ValueError(f"data.source {where}: data.chat_template renders the messages before turn {turn} "
                                 "as other than the start of the whole conversation (it rewrites earlier turns); "
                                 "the answer tokens are found by rendering the conversation turn by turn, so "
                                 "give a template that renders a conversation's start as it stands")
            answers.append((before, through))
        return Rendered(full, answers, eos=False)

    def _render(self, where: str, messages: list[dict], generation_prompt: bool) -> str:
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"data.chat_template: not a valid Jinja template (line {err.lineno}: {err.message})") from None
        except Exception as err:  # the template's own raise_exception, undefined names, filters: any type
            message = " ".join(str(err).split()) or type(err).__name__
            raise ValueError(f"data.source {where}: data.chat_template cannot render this row ({message})") from None


def _messages(where: str, row: dict) -> list[dict]:
    """The row's messages, checked: a list of ``{role, content}`` with known roles and text
    content, holding an assistant turn (the only tokens the loss trains on)."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"data.source {where}: a chat row holds 'messages', a non-empty list of {{role, content}} "
                         f"objects; this row's keys: {', '.join(map(str, row)) or 'none'}")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"data.source {where}: message {turn} is not a {{role, content}} object with text content")
        if message.get("role") not in ROLES:
            raise ValueError(f"data.source {where}: message {turn} has role {message.get('role')!r}; "
                             f"allowed: {', '.join(ROLES)}")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"data.source {where}: no assistant turn; the loss trains on assistant turns alone, "
                         "so a chat row needs at least one")
    return messages


def _instruction(where: str, row: dict) -> Rendered:
    """An instruction row's prompt (``PROMPT``) and answer (its output, then EOS)."""
    fields = {name: row.get(name) for name in ("instruction", "input", "output")}
    for name, value in fields.items():
        if not isinstance(value, str) and not (name == "input" and value is None):
            raise ValueError(f"data.source {where}: an instruction row holds text 'instruction' and 'output' "
                             f"(and 'input', optional); its {name!r} is {'missing' if value is None else type(value).__name__}")
    prompt = PROMPT[bool(fields["input"])].format(**fields)
    return Rendered(prompt + fields["output"], [(prompt, prompt + fields["output"])], eos=True)


def iter_rendered(data_cfg: Any, tokenizer: Any, *, trust_remote_code: bool = False,
                  limit: Optional[int] = None) -> Iterator[Rendered]:
    """The source's rows rendered (at most ``limit``); the first bad row raises ``ValueError``
    naming it. A source without rows is an error once read to the end."""
    render, rows = Renderer(data_cfg, tokenizer), 0
    for where, row in iter_rows(data_cfg.source, data_cfg.split, data_cfg.streaming, trust_remote_code=trust_remote_code):
        if limit is not None and rows >= limit:
            return
        rows += 1
        yield render(where, row)
    if rows == 0:
        raise ValueError(f"data.source {data_cfg.source}: no rows")


def tokenize(rendered: list[Rendered], tokenizer: Any) -> list[tuple[list[int], list[bool]]]:
    """Each row's token ids and, for each, whether the loss trains on it; one batch call of the
    tokenizer for the texts and every prefix."""
    prefixes = [prefix for row in rendered for answer in row.answers for prefix in answer]
    ids = tokenizer([row.text for row in rendered] + prefixes, add_special_tokens=False)["input_ids"]
    whole, parts = ids[: len(rendered)], iter(ids[len(rendered):])
    out = []
    for row, tokens in zip(rendered, whole):
        mask = [False] * len(tokens)
        for _ in row.answers:
            start, end = _shared(next(parts), tokens), _shared(next(parts), tokens)
            mask[start:end] = [True] * (end - start)
        if row.eos:
            tokens, mask = [*tokens, tokenizer.eos_token_id], [*mask, True]
        out.append((tokens, mask))
    return out


def _shared(prefix: list[int], tokens: list[int]) -> int:
    """How many of ``tokens``' first tokens ``prefix`` starts with."""
    count = 0
    for a, b in zip(prefix, tokens):
        if a != b:
            break
        count += 1
    return count
