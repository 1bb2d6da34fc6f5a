"""The method protocol: what the toolkit needs to know of any way a model may attend.

A method is an object that transformers' attention function hands every attention call to,
``method(module, query, key, value, attention_mask, **kwargs) -> (output, None)``, with q
(B,H,Nq,D) and k/v (B,Hkv,Nk,D) rotated at their true positions (Nq < Nk while decoding
against a KV cache). It declares what it supports, so that a recipe, the evaluation CLI and
the experiment refuse a use it cannot serve before a model loads; it may take over
generation (ParallelComp ranks context chunks by the question). A method that leaves
attention to the model (the model's own attention, RoPE scaling) says
``replaces_attention = False`` and only prepares the model in :meth:`Method.apply`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from attn_patterns.algorithm import Algorithm
from attn_patterns.kernels import triton_unsupported
from attn_patterns.registry import Registry
from sparse_ft.modeling.attention import install_method
from sparse_ft.modeling.rope import context_length


@dataclass(frozen=True)
class Supports:
    """What a method can serve; checked where it is used, before anything loads."""

    training: bool = False  # differentiable and defined on whole training sequences
    ppl: bool = True  # assigns a probability to every token of a text
    no_ppl_reason: str = ""  # said when ``eval ppl`` refuses it
    kv_cache: bool = False  # decodes against a KV cache; otherwise generation re-runs the sequence
    padding: tuple[str, ...] = ("left", "right")  # padding sides of a batch it computes exactly
    backends: tuple[Optional[str], ...] = (None,)  # kernel choices its ``backend`` parameter takes


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding instead of greedy: ``temperature`` > 0 and nucleus ``top_p`` in (0, 1],
    nothing else (transformers' default top-k of 50 is switched off)."""

    temperature: float
    top_p: float = 1.0

    def generate_kwargs(self) -> dict[str, Any]:
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


class Method:
    """Base class; see the module docstring. Subclasses registered with :func:`register`
    take their parameters as keyword arguments of their constructor (its signature is
    what recipes and ``--method-arg`` are checked against)."""

    name: str = "method"
    supports: Supports = Supports()
    replaces_attention: bool = True

    def __call__(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: Optional[torch.Tensor], **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        raise NotImplementedError(f"method {self.name!r} leaves attention to the model")

    @property
    def backend(self) -> Optional[str]:
        """The kernel this method was asked for (None: its automatic choice)."""
        return None

    def check_model(self, config: Any) -> None:
        """Refuse a model this method cannot run when it is switched to, not mid-forward."""

    def check_device(self, device: str, dtype: torch.dtype) -> None:
        """Refuse, before the weights load, a kernel asked for that cannot run on ``device`` in
        ``dtype``: the block-sparse Triton kernel needs CUDA (or the interpreter the tests set),
        and a CPU user would otherwise learn it at the first forward, after the model loaded."""
        if self.backend == "triton" and device != "auto":
            why = triton_unsupported(torch.device(device).type, dtype)
            if why is not None:
                raise ValueError(f"{self.name}: backend='triton' cannot run here: {why}; leave backend unset (automatic) "
                                 "or use sdpa")

    def check_length(self, seq_len: int) -> None:
        """Refuse a sequence length this method degenerates at (``ValueError``), before a model
        loads: recipes check ``data.seq_len``, ``eval`` every ``--lengths``."""

    def max_length(self, config: Any) -> Optional[int]:
        """The longest sequence (prompt and generated tokens) this method runs a model with
        ``config`` at, or None for no bound: by default the model's context, which a method
        made to go beyond it (RoPE scaling to the length asked, DCA, LongHeads, ParallelComp)
        lifts. ``generate`` refuses a longer prompt before the weights load."""
        return context_length(config)

    def describe(self, config: Any) -> Optional[str]:
        """The settings this method takes from a model with ``config``, for the CLI to say
        (None: nothing beyond the parameters the user gave)."""
        return None

    def apply(self, model: torch.nn.Module, length: int) -> None:
        """Make ``model`` attend with this method for sequences of ``length`` tokens
        (evaluation calls it per length)."""
        install_method(model, self)

    def generate(self, model: torch.nn.Module, tokenizer: Any, *, context_ids: list[int], question_ids: list[int],
                 max_new_tokens: int) -> list[int]:
        """Greedy answer to ``question_ids`` after ``context_ids``: the new token ids."""
        generate = cached_generate if self.supports.kv_cache else reprefill_generate
        return generate(model, tokenizer, context_ids=context_ids, question_ids=question_ids,
                        max_new_tokens=max_new_tokens)

    @property
    def decodes_itself(self) -> bool:
        """Whether :meth:`generate` is the method's own greedy loop (ParallelComp), not
        transformers' ``generate``: then it samples nothing and streams nothing."""
        return type(self).generate is not Method.generate

    def generate_batch(self, model: torch.nn.Module, tokenizer: Any, *, prompts: Sequence[tuple[list[int], list[int]]],
                       max_new_tokens: int, sampling: Optional[Sampling] = None, streamer: Any = None) -> list[list[int]]:
        """:meth:`generate` for several ``(context_ids, question_ids)`` prompts at once: one
        left-padded batch through transformers' ``generate`` (every row as it is alone, greedy
        or with ``sampling``; ``streamer`` is transformers' streamer), or prompt by prompt for
        a method that generates its own way (ParallelComp: greedy, nothing streamed)."""
        if self.decodes_itself:
            if sampling is not None or streamer is not None:
                raise ValueError(f"{self.name} decodes greedily in its own loop: it takes no sampling and no streamer")
            return [self.generate(model, tokenizer, context_ids=context, question_ids=question,
                                  max_new_tokens=max_new_tokens) for context, question in prompts]
        return left_padded_generate(model, tokenizer, prompts=[[*c, *q] for c, q in prompts],
                                    max_new_tokens=max_new_tokens, use_cache=self.supports.kv_cache, sampling=sampling,
                                    streamer=streamer)

    def check_inputs(self, attention_mask: Optional[torch.Tensor], dropout: float = 0.0) -> None:
        """For training-free methods (no attention dropout) that compute padded batches only
        for the sides in ``supports.padding``."""
        if dropout:
            raise ValueError(f"{self.name}: attention dropout={dropout} is not supported; "
                             f"{self.name} is training-free (set model.eval())")
        if attention_mask is None or attention_mask.dim() != 2:
            return
        real = attention_mask.bool()
        if "left" not in self.supports.padding and bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise ValueError(
                f"{self.name} supports right padding only (a real token follows a padding token); "
                "set tokenizer.padding_side='right'"
            )

    def __repr__(self) -> str:
        return f"{self.name}()"


class AlgorithmMethod(Method):
    """A method around a pure-torch attention algorithm (``algorithm_class``: DCA, LongHeads)
    whose parameters it takes as its own: one parameter list, checked in one place. The
    method supplies what the algorithm needs from the model (its RoPE frequencies, its
    context) and what KV-cache decoding needs."""

    algorithm_class: type[Algorithm] = Algorithm

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = inspect.signature(cls.algorithm_class)

    def __init__(self, **params: Any) -> None:
        self.algorithm = self.algorithm_class(**params)

    def __repr__(self) -> str:
        return repr(self.algorithm)

    @property
    def backend(self) -> Optional[str]:
        return getattr(self.algorithm, "backend", None)

    def max_length(self, config: Any) -> Optional[int]:
        """None: positions beyond the context are what the algorithm is for."""
        return None


METHODS: Registry[Method] = Registry("method", Method)
register = METHODS.register


# --- generation ----------------------------------------------------------------------------
def greedy(next_logits: Callable[[Optional[int]], torch.Tensor], max_new_tokens: int, eos: Optional[int]) -> list[int]:
    """Greedy decoding around ``next_logits(token)``: the next-token logits after the prompt
    (``token=None``) or after feeding ``token``. One loop, whatever feeds the model."""
    new: list[int] = []
    if max_new_tokens < 1:
        return new
    logits = next_logits(None)
    while True:
        new.append(int(logits.argmax()))
        if new[-1] == eos or len(new) == max_new_tokens:
            return new
        logits = next_logits(new[-1])


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def cached_generate(model: torch.nn.Module, tokenizer: Any, *, context_ids: list[int], question_ids: list[int],
                    max_new_tokens: int) -> list[int]:
    """transformers' own ``generate`` with the KV cache."""
    ids = torch.tensor([list(context_ids) + list(question_ids)], device=model_device(model))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def left_padded_generate(model: torch.nn.Module, tokenizer: Any, *, prompts: Sequence[list[int]], max_new_tokens: int,
                         use_cache: bool, sampling: Optional[Sampling] = None, streamer: Any = None) -> list[list[int]]:
    """New tokens of each prompt, greedy or with ``sampling``, the prompts left-padded into one
    batch as ``generate`` expects (positions counted from each row's first real token), each
    row's up to its EOS; ``streamer`` (transformers') sees the tokens as they come."""
    if not prompts:
        return []
    longest = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts], device=model_device(model))
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
    decoding = sampling.generate_kwargs() if sampling is not None else {"do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, use_cache=use_cache,
                         pad_token_id=pad, streamer=streamer, **decoding)
    rows = out[:, longest:].tolist()
    eos = tokenizer.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


@torch.inference_mode()
def reprefill_generate(model: torch.nn.Module, tokenizer: Any, *, context_ids: list[int], question_ids: list[int],
                       max_new_tokens: int) -> list[int]:
    """Greedy decoding without a KV cache: each new token from a forward over the whole
    sequence, so a pattern defined on whole sequences is applied exactly as defined."""
    ids = torch.tensor([list(context_ids) + list(question_ids)], device=model_device(model))

    def next_logits(token: Optional[int]) -> torch.Tensor:
        nonlocal ids
        if token is not None:
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]

    return greedy(next_logits, max_new_tokens, tokenizer.eos_token_id)
