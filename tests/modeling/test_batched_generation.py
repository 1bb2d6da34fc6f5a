"""Batched generation as transformers' ``generate`` does it: prompts of different lengths
left-padded in one batch, positions counted from each row's first real token. Every method
that decodes gives each row what it gives that prompt alone, greedy: DCA and LongHeads with
the KV cache, every pattern re-running the sequence (``use_cache=False``)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn_patterns
from sparse_ft import methods, use_attention
from sparse_ft.modeling.tiny import tiny_tokenizer

BASE = Path(__file__).resolve().parents[2] / "assets" / "tiny-base"
TEXTS = ["The key is 4711. Remember it. " * 2, "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
         "Once upon a time, in a house by the sea, there lived " * 2]
# small chunks, so that prompts of 60-160 tokens cross them: DCA's inter-chunk piece and
# LongHeads' chunk selection are at work
CACHED = {"dca": {"chunk_size": 48, "local_window": 8, "pretraining_length": 64},
          "longheads": {"chunk_size": 8, "chunks": 4}}
PATTERN_PARAMS = {"sda": {"dilation": 2}, "mixed": {"parts": [("scca_flow", 0.5), ("sda", 0.5)]}}


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(BASE).eval()


@pytest.fixture(scope="module")
def prompts():
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer(TEXTS, add_special_tokens=False, padding=True, return_tensors="pt")
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 3  # rows of different lengths
    return batch, lengths


def check_rows_equal_alone(model, prompts, **generate_args):
    batch, lengths = prompts
    with torch.no_grad():
        together = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0, **generate_args)
        for row, length in enumerate(lengths):
            alone = model.generate(input_ids=batch["input_ids"][row : row + 1, -length:], max_new_tokens=8,
                                   do_sample=False, pad_token_id=0, **generate_args)
            assert torch.equal(together[row, -8:], alone[0, -8:]), f"row {row} ({length} prompt tokens)"


@pytest.mark.parametrize("name", sorted(CACHED))
def test_left_padded_batch_generates_each_row_as_alone_with_the_cache(model, prompts, name):
    use_attention(model, methods.get(name, **CACHED[name]))
    check_rows_equal_alone(model, prompts)
    use_attention(model, "full")


@pytest.mark.parametrize("name", attn_patterns.names())
def test_left_padded_batch_generates_each_row_as_alone_with_a_pattern(model, prompts, name):
    use_attention(model, methods.get(name, **PATTERN_PARAMS.get(name, {})))
    check_rows_equal_alone(model, prompts, use_cache=False)
    use_attention(model, "full")


def test_right_padding_is_refused_at_the_first_decode_step(model, prompts):
    """generate appends after the padding of a right-padded row: the row's tokens are then
    not contiguous, which no method can compute as one sequence."""
    batch, _ = prompts
    right = {key: value.flip(1) for key, value in batch.items()}
    use_attention(model, methods.get("dca", **CACHED["dca"]))
    with pytest.raises(ValueError, match=r"padding between the real tokens of one sequence; pad on the left"):
        model.generate(**right, max_new_tokens=2, do_sample=False, pad_token_id=0)
    use_attention(model, "full")


@pytest.mark.parametrize("name", ["dca", "longheads", "scca_flow", "parallelcomp"])
def test_generate_batch_equals_generate_prompt_by_prompt(model, name):
    """The evaluation's entry: ``Method.generate_batch`` gives each prompt's answer as
    ``Method.generate`` does alone (a method generating its own way, ParallelComp, prompt by
    prompt)."""
    tokenizer = tiny_tokenizer()
    method = methods.get(name, **CACHED.get(name, {}))
    method.apply(model, 256)
    prompts = [(tokenizer(text, add_special_tokens=False).input_ids, tokenizer(" Answer:", add_special_tokens=False).input_ids)
               for text in TEXTS]
    with torch.no_grad():
        together = method.generate_batch(model, tokenizer, prompts=prompts, max_new_tokens=6)
        alone = [method.generate(model, tokenizer, context_ids=c, question_ids=q, max_new_tokens=6) for c, q in prompts]
    assert together == alone and all(alone)
    use_attention(model, "full")
