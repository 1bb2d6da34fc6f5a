"""``sparse-ft generate``: answer prompts with a model, an adapter or a training-free method,
loaded as ``sparse-ft eval`` loads them (its flags, ``--method``, an adapter's RoPE restored
before the weights).

Prompts come from the arguments or from ``--file`` (``-``: stdin): one prompt per line (blank
lines skipped), or with ``--jsonl`` (the default for a ``.jsonl`` name) one JSON object per
line, ``{"prompt": ...}``, with an optional ``"context"`` before it (ParallelComp answers a
prompt about a context, and needs one). Everything that can be checked without the weights is
checked before they load: the prompts, the sampling values, the output file, and after
tokenizing, each prompt's length against what the method allows on the model's config
(``Method.max_length``).

The prompts run in left-padded batches through the method's own generation
(``Method.generate_batch``, what passkey and RULER answer with: every row as it is alone),
greedy or sampled. stdout holds the results only, one line per prompt in order (a
completion's newlines and backslashes escaped, so line i is prompt i's answer); a single
prompt's completion is streamed as it comes, as it is. Everything else goes to stderr.
``--output`` writes JSON lines, one object per prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_ft.evaluation.cli import loading_flags, overwrite_flag

HELP = "answer prompts with a model, an adapter or a training-free method, loaded as eval loads them"
WRITER = "sparse-ft generate"
JSONL_KEYS = ("prompt", "context")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to answer (or --file; a prompt starting "
                   "with '-' goes after '--')")
    p.add_argument("--file", default=None, help="prompts, one per line, or JSON lines with \"prompt\" (and "
                   "\"context\"); '-' reads stdin (default: none, the PROMPT arguments)")
    p.add_argument("--jsonl", action="store_true", help="read --file as JSON lines (the default for a .jsonl name)")
    loading_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily; above 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature: the smallest set "
                   "of tokens whose probability reaches it (1: all)")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling (the same prompts, batch size and seed give "
                   "the same text on one machine)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per left-padded batch")
    p.add_argument("--output", type=Path, default=None, help="a .jsonl file: one JSON object per prompt (default: "
                   "none, stdout only)")
    overwrite_flag(p)
    p.set_defaults(func=run)


# --- prompts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """A prompt, where it came from (for messages), and the context it is about, if any."""

    text: str
    where: str
    context: str = ""


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of the arguments or of ``--file``, in order; none, both, or an empty one is
    refused naming where."""
    if args.prompts and args.file is not None:
        raise ValueError("give prompts as arguments or with --file, not both")
    if args.file is None:
        prompts = [Prompt(text, f"prompt {index}") for index, text in enumerate(args.prompts, 1)]
    else:
        prompts = _read_file(args.file, jsonl=args.jsonl or args.file.endswith(".jsonl"))
    for prompt in prompts:
        if not prompt.text.strip():
            raise ValueError(f"{prompt.where} is empty")
    if not prompts:
        given = f"--file {args.file} holds none" if args.file else "no PROMPT argument and no --file"
        raise ValueError(f"no prompts ({given}); give PROMPT arguments or --file PATH (one prompt per line, or JSON "
                         "lines with \"prompt\"; '-' reads stdin)")
    return prompts


def _read_file(name: str, *, jsonl: bool) -> list[Prompt]:
    source = "stdin" if name == "-" else name
    if name != "-" and not Path(name).is_file():
        raise ValueError(f"--file {name}: no such file")
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--file {source} is not UTF-8 text (byte {err.start})") from None
    prompts = []
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"prompt {len(prompts) + 1} (line {number} of {source})"
        prompts.append(_json_prompt(line, where) if jsonl else Prompt(line, where))
    return prompts


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not JSON ({err.msg}); --jsonl reads one object per line, "
                         "e.g. {\"prompt\": \"...\"}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object like {{\"prompt\": \"...\"}}")
    unknown = sorted(set(row) - set(JSONL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(JSONL_KEYS)}")
    if "prompt" not in row:
        raise ValueError(f"{where} has no \"prompt\"")
    for key in JSONL_KEYS:
        if not isinstance(row.get(key, ""), str):
            raise ValueError(f"{where}: \"{key}\" is a JSON {type(row[key]).__name__}, not a string")
    return Prompt(row["prompt"], where, row.get("context", ""))


def tokenize(tokenizer: Any, prompts: list[Prompt]) -> list[tuple[list[int], list[int]]]:
    """``(context_ids, question_ids)`` as ``Method.generate`` takes them: the tokenizer's
    leading special tokens (a BOS), then the context and the prompt; a prompt without a
    context is all context (never an EOS some tokenizers append: it would end the prompt)."""
    from sparse_ft.evaluation.prompt_tokens import leading_specials, token_ids

    head = leading_specials(tokenizer)
    return [(head + token_ids(tokenizer, p.context), token_ids(tokenizer, p.text)) if p.context
            else (head + token_ids(tokenizer, p.text), []) for p in prompts]


# --- checks before the weights load ----------------------------------------------------------------
def sampling_of(args: argparse.Namespace):
    """The ``Sampling`` of ``--temperature`` / ``--top-p`` (None: greedy), every value checked."""
    from sparse_ft.methods import Sampling

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed {args.seed} must be in [0, 2**63)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.temperature == 0:
        if args.top_p != 1:
            raise ValueError(f"--top-p {args.top_p} samples, but --temperature 0 decodes greedily: give --temperature > 0")
        return None
    return Sampling(args.temperature, args.top_p)


def check_method(args: argparse.Namespace, method, prompts: list[Prompt], sampling) -> None:
    """What a method that decodes in its own loop (ParallelComp) cannot do: sample, or answer a
    prompt without a context."""
    if not method.decodes_itself:
        return
    if sampling is not None:
        raise ValueError(f"--method {args.method} decodes greedily in its own loop: leave --temperature at 0")
    bare = next((p for p in prompts if not p.context), None)
    if bare is not None:
        raise ValueError(f"{bare.where} has no context: --method {args.method} answers a prompt about a context "
                         "(it ranks the context's chunks by the prompt); give --jsonl rows {\"context\": ..., \"prompt\": ...}")


def check_lengths(args: argparse.Namespace, method, config: Any, *, prompts: list[Prompt],
                  ids: list[tuple[list[int], list[int]]]) -> None:
    """Each prompt fits what the method allows on a model with ``config``, the new tokens
    included (a pattern is also checked at the prompt's own length, below which it degenerates)."""
    limit = method.max_length(config)
    for prompt, (context, question) in zip(prompts, ids):
        tokens = len(context) + len(question)
        if limit is not None and tokens + args.max_new_tokens > limit:
            raise ValueError(
                f"{prompt.where} has {tokens} tokens; --method {args.method} allows {limit} on this model, "
                f"--max-new-tokens {args.max_new_tokens} included (at most {max(0, limit - args.max_new_tokens)} prompt "
                "tokens): shorten it, lower --max-new-tokens, or extend the context (e.g. --method yarn or dca)")
        try:
            method.check_length(tokens)
        except ValueError as err:
            raise ValueError(f"{prompt.where} ({tokens} tokens): {err}") from None


def check_output(args: argparse.Namespace) -> None:
    from sparse_ft.evaluation.cli import model_inputs
    from sparse_ft.files.outputs import check_apart, check_output_file

    if args.output is None:
        return
    if args.output.suffix != ".jsonl":
        raise ValueError(f"--output {args.output} must name a .jsonl file (one JSON object per prompt)")
    inputs = {**model_inputs(args), "--file": None if args.file in (None, "-") else args.file}
    check_apart(args.output, "--output", inputs)
    check_output_file(args.output, "--output", args.overwrite)


# --- the command ---------------------------------------------------------------------------------
def escape_line_breaks(text: str) -> str:
    """A completion on one line of stdout: backslashes, newlines and carriage returns escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def run(args: argparse.Namespace) -> int:
    """Prompts, sampling, method and output checked; the tokenizer, every prompt's length
    checked against the config before the weights load; then batch by batch, each batch's
    completions printed as it finishes (the first forward checked to run the method installed,
    as ``sparse-ft eval``'s); the JSON lines last."""
    import torch
    from tqdm import tqdm
    from transformers import TextStreamer

    from sparse_ft import methods
    from sparse_ft.evaluation import loading
    from sparse_ft.evaluation.cli import dense_layers_from_args, dense_layers_range, load_model, method_from_args
    from sparse_ft.modeling.attention import FirstForwardCheck

    prompts = read_prompts(args)
    sampling = sampling_of(args)
    method = method_from_args(args, [])
    dense = dense_layers_from_args(args, method)
    check_method(args, method, prompts, sampling)
    args.model = args.model or loading.recorded_base(args.adapter)
    check_output(args)
    tokenizer = loading.tokenizer_for(args.model, args.adapter, args.trust_remote_code)
    ids = tokenize(tokenizer, prompts)
    def check_config(config: Any) -> None:
        check_lengths(args, method, config, prompts=prompts, ids=ids)
        dense_layers_range(args)(config)

    model, _ = load_model(args, method, tokenizer=False, log=sys.stderr, check_config=check_config)
    if dense is not None:  # wrapped after the checks, as eval's: the pattern's own check is on the config
        method = methods.with_dense_layers(method, dense)
        args.method = methods.dense_layers_name(args.method, dense)  # what the JSON lines record
    method.apply(model, max(len(c) + len(q) for c, q in ids) + args.max_new_tokens)
    FirstForwardCheck(model, when=f"--method {args.method}")  # the method asked for is the one that runs, as eval's
    size = args.batch_size if "left" in method.supports.padding else 1
    stream = len(prompts) == 1 and not method.decodes_itself
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    torch.manual_seed(args.seed)
    answers: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="generate", unit="prompt", **({"disable": True} if stream else {}))
    for start in range(0, len(ids), size):
        with torch.inference_mode():
            batch = method.generate_batch(model, tokenizer, prompts=ids[start : start + size],
                                          max_new_tokens=args.max_new_tokens, sampling=sampling, streamer=streamer)
        answers += batch
        bar.update(len(batch))
        if not stream:
            texts = [tokenizer.decode(new, skip_special_tokens=True) for new in batch]
            tqdm.write("\n".join(texts if len(prompts) == 1 else map(escape_line_breaks, texts)), file=sys.stdout)
    bar.close()
    if args.output is not None:
        _write(args, tokenizer, prompts=prompts, ids=ids, answers=answers)
    return 0


def _write(args: argparse.Namespace, tokenizer: Any, *, prompts: list[Prompt], ids: list[tuple[list[int], list[int]]],
           answers: list[list[int]]) -> None:
    """One object per prompt, each carrying the writer (the first one's is what ``--overwrite`` reads)."""
    from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file

    with atomic_file(args.output) as f:
        for index, (prompt, (context, question), new) in enumerate(zip(prompts, ids, answers), 1):
            row = {OUTPUT_FIELD: WRITER, "index": index, **({"context": prompt.context} if prompt.context else {}),
                   "prompt": prompt.text, "completion": tokenizer.decode(new, skip_special_tokens=True),
                   "prompt_tokens": len(context) + len(question), "completion_tokens": len(new),
                   "stopped": "eos" if new and new[-1] == tokenizer.eos_token_id else "length",
                   "method": args.method}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)
