"""lm-evaluation-harness's own ``HFLM`` on a model already loaded by sparse-ft and attending
through a method: the harness's tasks (LongBench, RULER, anything its index or a local YAML
defines) answered through the same path as ``eval ppl`` / ``passkey`` / ``ruler``.

Why HFLM and not an LM of our own: what turns a task into requests and numbers (prompt
formatting, few-shot, tokenisation with the context/continuation split, left truncation to
``max_length``, continuation slicing, caching of one-token continuations, stop sequences,
metrics) is the harness's, exactly what published harness numbers went through. Only where a
method differs from the model's own attention does this class step in:

* log-likelihoods: the model's forward already attends through the method (installed by
  ``Method.apply`` before the harness runs), so HFLM's ``_model_call`` is kept. HFLM pads a
  batch on the right and passes no mask, and a pattern's blocks, DCA's logit scale and
  dynamic NTK's factor follow the padded length: batches of more than one request are
  therefore only for ``full`` (``check_batch``), every other method scores each request alone.
* generation: ``Method.generate``, one request at a time (greedy): a pattern is defined on
  whole sequences and re-runs the sequence per token instead of using a KV cache, DCA and
  LongHeads decode against the cache through their own attention. HFLM's ``model.generate``
  would run a pattern against a KV cache it is not defined for. The harness still cuts the
  answer at the task's stop sequences; the method decodes up to ``max_gen_toks`` or EOS.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from sparse_ft.evaluation.prompt_tokens import leading_specials
from sparse_ft.methods import Method


def check_batch(method: Method, batch_size: int) -> None:
    """Refuse batching where lm-eval's unmasked right padding would change what a method computes."""
    if batch_size > 1 and method.name != "full":
        raise ValueError(f"--batch-size {batch_size} with --method {method.name}: lm-eval pads a batch without a mask, "
                         "which changes what a method computes; use --batch-size 1 (batches are for --method full)")


class MethodLM(HFLM):
    """HFLM whose generation goes through ``method`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, method: Method, max_length: int,
                 batch_size: int = 1) -> None:
        check_batch(method, batch_size)
        # the tokenizer's special tokens where it puts a BOS in front of a text (HFLM's default);
        # none where it only appends an EOS (T5-style, the tiny model's), which would end every
        # context there and split the continuation one token late
        bos = None if leading_specials(tokenizer) else False
        super().__init__(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=batch_size,
                         add_bos_token=bos)
        self.method = method

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any) -> torch.Tensor:
        """Each left-padded row's real tokens answered by the method; rows returned as HFLM
        expects them (the padded context, then the new tokens, padded with EOS, which the
        harness drops when it decodes)."""
        mask = generation_kwargs.pop("attention_mask")
        budget = max_length - context.shape[1]
        rows = []
        for ids, real in zip(context.tolist(), mask.bool().tolist()):
            prompt = [token for token, keep in zip(ids, real) if keep]
            rows.append(ids + self.method.generate(self.model, self.tokenizer, context_ids=prompt, question_ids=[],
                                                   max_new_tokens=budget))
        width = max(len(row) for row in rows)
        end = self.tokenizer.eos_token_id
        return torch.tensor([row + [end] * (width - len(row)) for row in rows], device=context.device)


def evaluate(model: torch.nn.Module, tokenizer: Any, method: Method, *, tasks: Sequence[Any], task_manager: Any,
             max_length: int, limit: Optional[float] = None, batch_size: int = 1, num_fewshot: Optional[int] = None,
             log_samples: bool = False) -> dict:
    """lm-eval's results for ``tasks`` (names or loaded Task/Group objects of ``task_manager``)
    with ``model`` attending through ``method`` applied at ``max_length``, the length the
    harness truncates prompts to."""
    method.apply(model, max_length)
    lm = MethodLM(model, tokenizer, method=method, max_length=max_length, batch_size=batch_size)
    return simple_evaluate(lm, tasks=list(tasks), task_manager=task_manager, limit=limit, num_fewshot=num_fewshot,
                           log_samples=log_samples)
