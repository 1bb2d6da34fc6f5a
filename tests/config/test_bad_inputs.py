"""Nothing lost, nothing silent: every bad input ends in one line naming
the key, flag or file, the value and what is allowed, with exit status 2, before the model
loads and before anything is written. ``CASES`` are ``train.py``'s, run in-process through its
``main`` (one subprocess checks the real command line); ``CLI_CASES`` the other commands'
(``sparse-ft eval | merge | pretrain | experiment | bench``), through ``sparse_ft.cli.main``."""

import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_LINE = json.dumps({"text": "def f():\n    return 1\n" * 20})
CHAT_LINE = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
CHAT_TEMPLATE = "data.chat_template='{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}'"


def jsonl(content):
    """The data column: writes ``docs.jsonl`` (text or bytes) into the test's directory."""
    return lambda tmp: _write(tmp / "docs.jsonl", content)


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def file(name, content, *, given=None):
    """The data column: writes ``name`` into the test's directory; DATA is ``given`` (a name in
    that directory) when set, else the file."""
    return lambda tmp: (_write(tmp / name, content), tmp / (given or name))[1]


def model_dir(*files, config=None):
    """The data column: a model directory holding ``config.json`` and ``files`` ((name, bytes))."""
    def make(tmp):
        _write(tmp / "m" / "config.json", json.dumps(config or {"model_type": "llama"}))
        for name, content in files:
            _write(tmp / "m" / name, content)
        return tmp / "m"
    return make


TINY_RECIPE = "inherit: tiny\n"
PICKLED = [("pytorch_model.bin", b"\x80\x04pickled")]
CUT_SHORT = [("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{}")]
# issue 31: nine levels of aliases, 9^9 tags once expanded (grew past 1 GB before it was refused)
ALIAS_BOMB = "[&a [x,x,x,x,x,x,x,x,x], " + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")) + "]"


# overrides (DATA: the path the data column returns, else the test's directory), data, message
CASES = {
    "quantization unknown": (
        ["model.quantization=nf8"], None, r"recipe key model.quantization='nf8' is invalid: allowed: none, nf4$"),
    "loss unknown": (["train.loss=fused"], None, r"recipe key train.loss='fused' is invalid: allowed: chunked, model$"),
    "offload without checkpointing": (
        ["train.offload_activations=true", "train.gradient_checkpointing=false"], None,
        r"recipe key train.offload_activations=True is invalid: offloads the layer inputs gradient checkpointing keeps; "
        r"set train.gradient_checkpointing=true$"),
    "mlp tiles negative": (["train.mlp_tile_tokens=-1"], None, r"recipe key train.mlp_tile_tokens=-1 is invalid: must be >= 0$"),
    "loss chunk of no tokens": (["train.loss_chunk_tokens=0"], None, r"recipe key train.loss_chunk_tokens=0 is invalid: must be >= 1$"),
    "resume not auto/never/a checkpoint": (
        ["train.resume=maybe"], None,
        r"recipe key train.resume='maybe' is invalid: allowed: auto, never, or a checkpoint-N directory with meta.json; no such directory"),
    "save_total_limit negative": (
        ["train.save_total_limit=-3"], None,
        r"recipe key train.save_total_limit=-3 is invalid: must be >= 1 \(checkpoints kept\), or 0 to keep every checkpoint"),
    "save_minutes negative": (
        ["train.save_minutes=-5"], None,
        r"recipe key train.save_minutes=-5.0 is invalid: must be > 0 \(minutes between checkpoints by the clock\), or 0 for none"),
    "learning rate infinite": (
        ["train.lr=.inf"], None, r"recipe key train.lr=inf is invalid: must be a finite number \(not .inf or .nan\)$"),
    "gradient clipping nan": (
        ["train.max_grad_norm=.nan"], None, r"recipe key train.max_grad_norm=nan is invalid: must be a finite number"),
    "learning rate inf as a word": (["train.lr=inf"], None, r"recipe key train.lr=inf is invalid: must be a finite number"),
    "a beta nan": (["train.betas=[0.9,.nan]"], None, r"recipe key train.betas\[1\]=nan is invalid: must be a finite number"),
    "save_minutes infinite": (["train.save_minutes=.inf"], None, r"recipe key train.save_minutes=inf is invalid: must be a finite number"),
    "a pattern parameter infinite": (
        ["attention.params={chunks: .inf}"], None, r"recipe key attention.params.chunks=inf is invalid: must be a finite number"),
    # issue 34 item 1: sink tokens, refused by the pattern's check before the model loads
    "sink tokens negative": (
        ["attention.params.sink_tokens=-1"], None,
        r"recipe key attention.pattern / attention.params: scca_flow: sink_tokens=-1 must be an integer >= 0$"),
    "sink tokens as wide as a chunk": (
        ["attention.params.sink_tokens=128"], None,
        r"recipe key attention.params=\{'chunks': 4, 'sink_tokens': 128\} is invalid: scca_flow\(chunks=4, sink_tokens=128\): "
        r"sink_tokens=128 must be in \[0, 128\) at sequence length 512 \(below the chunk width 128\)"),
    "a tiny model number nan": (
        ["model.tiny.rms_norm_eps=.nan"], None, r"recipe key model.tiny.rms_norm_eps=nan is invalid: must be a finite number"),
    "output_dir is a file": (
        ["train.output_dir=DATA"], jsonl(TINY_LINE + "\n"),
        r"recipe key train.output_dir='.*docs.jsonl' is invalid: a directory .*; this is a file"),
    "unknown model.tiny key": (
        ["model.tiny.hiden_size=32"], None,
        r"recipe key model.tiny=\{'hiden_size': 32\} is invalid: unknown LlamaConfig parameter\(s\) hiden_size "
        r"\(did you mean hidden_size\?\); allowed: .*num_attention_heads"),
    "tiny hidden size not divisible by heads": (
        ["model.tiny.hidden_size=60"], None,
        r"model.tiny=\{'hidden_size': 60\} is invalid: The hidden size \(60\) is not a multiple of the number of attention heads \(8\)"),
    "tiny vocabulary smaller than the tokenizer's": (
        ["model.tiny.vocab_size=10"], None, r"model.tiny=\{'vocab_size': 10\} is invalid: vocab_size=10 must be >= 384"),
    "tiny heads not divisible by kv heads": (
        ["model.tiny.num_key_value_heads=3"], None,
        r"model.tiny=\{'num_key_value_heads': 3\} is invalid: num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    "tiny config no model can be built from": (
        ["model.tiny.intermediate_size=-1"], None,
        r"model.tiny=\{'intermediate_size': -1\} is invalid: a llama model cannot be built from it \(RuntimeError: .*negative dimension"),
    # issue 31 item 4: sizes bounded before anything is built for them
    "target length past float32 positions": (
        ["model.target_length=1000000000000"], None,
        r"recipe key model.target_length=1000000000000 is invalid: at most 16,777,216 tokens \(RoPE positions are float32"),
    "target length of 31 digits": (
        [f"model.target_length={10**30}"], None,
        r"model.target_length=1000000000000000000000000000000 is invalid: at most 16,777,216"),
    "target length whose RoPE factor is past the limit": (
        ["model.target_length=1000000000000", "data.seq_len=512"], None,
        r"model.target_length=1000000000000 is invalid: at most 16,777,216"),
    "RoPE factor past the limit": (
        ["model.target_length=1000000", "data.seq_len=512"], None,
        r"recipe key model.target_length=1000000 is invalid: RoPE factor 3,906.25 \(the model's pretraining context of 256 tokens "
        r"extended 3,906.25x\) is above 64: published PI / YaRN extensions reach 16-32x; at most 16,384 tokens on this model$"),
    # issue 32 item 4: the pretraining context a config overstates (Qwen2.5-7B), from which RoPE extends
    "native length past the config's window": (
        ["model.native_length=512"], None,
        r"recipe key model.native_length=512 is invalid: native_length=512 must be a positive integer up to the config's "
        r"max_position_embeddings=256$"),
    "native length of zero": (
        ["model.native_length=0"], None,
        r"recipe key model.native_length=0 is invalid: a positive number of tokens \(the model's pretraining context\), or null"),
    # issue 34 item 3: dense layers and a dense tail, refused before the model loads
    "dense layer outside the model": (
        ["attention.dense_layers=[0,2]"], None,
        r"recipe key attention.dense_layers=\[0, 2\] is invalid: layer indices in \[0, 1\], each once \(the model has 2 layers\), "
        r"or 'last n'$"),
    "dense layers last 0": (
        ["attention.dense_layers=last 0"], None,
        r"recipe key attention.dense_layers='last 0' is invalid: 'last n' with n in \[1, the model's layers\]$"),
    "dense layers last past the model": (
        ["attention.dense_layers=last 3"], None,
        r"recipe key attention.dense_layers='last 3' is invalid: 'last n' with n in \[1, 2\] \(the model has 2 layers\)$"),
    "dense layers malformed": (
        ["attention.dense_layers=first 2"], None,
        r"recipe key attention.dense_layers='first 2' is invalid: a list of layer indices \(e.g. \[0, 5\]\) or 'last n'"),
    "dense layers a number": (
        ["attention.dense_layers=1"], None, r"recipe key attention.dense_layers=1 is invalid: expected list or str, got int$"),
    "dense tail fraction above 1": (
        ["train.dense_final_fraction=1.5"], None,
        r"recipe key train.dense_final_fraction=1.5 is invalid: must be in \[0, 1\] \(the fraction of the steps"),
    "dense layers with full attention": (
        ["attention.pattern=full", "attention.dense_layers=[0]"], None,
        r"attention.dense_layers=\[0\] is invalid: applies to a sparse pattern; attention.pattern=full attends fully"),
    "pattern chunks of 400 digits": (
        [f"attention.params.chunks={'1' * 400}"], None,
        r"attention.params: scca_flow: chunks=111111\.\.\. \(400 digits\) must be an integer <= 1,024 \(one head group each"),
    "dilation past any length": (
        ["attention.pattern=sda", f"attention.params.dilation={10**30}"], None,
        r"sda: dilation=1000000000000000000000000000000 must be an integer <= 16,777,216 \(RoPE positions are float32"),
    "validation length past any length": (
        ["validation.lengths=[512,100000000000]"], None,
        r"recipe key validation.lengths=\[512, 100000000000\] is invalid: at most 16,777,216 tokens"),
    "tiny model larger than the machine": (
        ["model.tiny.hidden_size=1000000"], None,
        r"model.tiny=\{'hidden_size': 1000000\} is invalid: its 5,001,541,000,000 parameters take 18,632.2 GiB in float32, "
        r"more than this machine's .* GiB of memory$"),
    "LoRA rank past the layers' sides": (
        ["lora.r=100000000"], None,
        r"recipe key lora.r=100000000 is invalid: at most 16, the smaller side of model.layers.0.self_attn.k_proj \(16 x 64\): "
        r"a rank past it adds parameters, not rank$"),
    "heads not divisible by the pattern": (
        ["attention.params.chunks=3"], None,
        r"recipe key attention.params=\{'chunks': 3\} is invalid: scca_flow: num_heads=8 must be divisible by 3"),
    "sequence parallelism without DeepSpeed": (
        ["train.sequence_parallel_size=2"], None,
        r"recipe key train.sequence_parallel_size=2 is invalid: > 1 needs DeepSpeed \(Ulysses is DeepSpeed's\)"),
    "sequence parallelism not dividing the sequence": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=2", "data.seq_len=511"], None,
        r"train.sequence_parallel_size=2 is invalid: must divide the sequence length data.seq_len=511"),
    "gpus the recipe is written for not a multiple of the sequence-parallel size": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=2", "train.gpus=3"], None,
        r"recipe key train.gpus=3 is invalid: a positive multiple of train.sequence_parallel_size=2 \(the GPUs the recipe "
        r"is written for\), or null$"),
    "unknown packing": (
        ["data.packing=tight"], None, r"recipe key data.packing='tight' is invalid: allowed: blocks, padding_free"),
    "sequence parallelism not dividing the heads": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=16"], None,
        r"train.sequence_parallel_size=16 is invalid: must divide the model's num_attention_heads=8"),
    "sequence parallelism not dividing the processes": (
        ["deepspeed=zero3_cpu_fp32", "train.sequence_parallel_size=2"], None,
        r"train.sequence_parallel_size=2 is invalid: must divide the number of processes, 1 \(data parallelism"),
    "validation task unknown": (
        ["validation.every_steps=2", "validation.tasks=[perplexity]"], None,
        r"recipe key validation.tasks=\['perplexity'\] is invalid: entries allowed: ppl, passkey, ruler, "),
    "validation task parameter unknown": (
        ["validation.at_end=true", "validation.data=DATA", "validation.params={ppl: {windows: 2}}"], jsonl(TINY_LINE + "\n"),
        r"recipe key validation.params.ppl=\{'windows': 2\} is invalid: ppl: parameter\(s\) windows unknown; allowed: lengths, "),
    "validation parameters of a task not run": (
        ["validation.at_end=true", "validation.data=DATA", "validation.params={passkey: {trials: 2}}"], jsonl(TINY_LINE + "\n"),
        r"recipe key validation.params.passkey=\{'trials': 2\} is invalid: a mapping of parameters of a task in validation.tasks \(ppl\)"),
    "validation ppl without held-out data": (
        ["validation.every_steps=2"], None, r"recipe key validation.data=None is invalid: the held-out data ppl scores: "),
    "validation held-out file missing": (
        ["validation.every_steps=2", "validation.data=DATA/held_out.jsonl"], None,
        r"recipe key validation.data='.*/held_out.jsonl' is invalid: .*held_out.jsonl does not exist"),
    # issue 31: the held-out data's errors name validation.data, not training's data.source
    "validation held-out directory without data files": (
        ["validation.every_steps=2", "validation.data=DATA"], lambda tmp: (tmp / "held").mkdir() or tmp / "held",
        r"recipe key validation.data='(.*/held)' is invalid: \1: directory holds no .jsonl, .json, .parquet, .txt files$"),
    "validation steps negative": (["validation.every_steps=-1"], None, r"recipe key validation.every_steps=-1 is invalid: must be >= 0"),
    "validation attention unknown": (
        ["validation.attention=s2"], None, r"recipe key validation.attention='s2' is invalid: allowed: full, training"),
    "validation generating under ZeRO-3": (
        ["deepspeed=zero3_cpu_fp32", "validation.at_end=true", "validation.tasks=[passkey]"], None,
        r"recipe key validation.tasks=\['passkey'\] is invalid: under ZeRO-3 \(deepspeed=zero3_cpu_fp32\) only ppl: passkey generate"),
    "validation length the training pattern refuses": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.attention=training", "validation.lengths=[3]"], None,
        r"recipe key validation.lengths=\[3\] is invalid: .* \(passkey through validation.attention=training: scca_flow\)"),
    # issue 31: what eval refuses, checked by the same code, naming the recipe's key, before anything is written
    "validation ppl window of one token": (
        ["validation.at_end=true", "validation.data=DATA", "validation.lengths=[1]"], jsonl(TINY_LINE + "\n"),
        r"recipe key validation.lengths entry 1: a window needs >= 2 tokens \(its first predicts the second\)$"),
    "validation ppl stride longer than the window": (
        ["validation.at_end=true", "validation.data=DATA", "validation.lengths=[256]", "validation.params={ppl: {stride: 300}}"],
        jsonl(TINY_LINE + "\n"), r"recipe key validation.params.ppl.stride=300 is longer than the window validation.lengths "
        r"entry 256: the 44 tokens between two windows would never be scored; use validation.params.ppl.stride <= 256$"),
    "validation ppl scoring unknown": (
        ["validation.at_end=true", "validation.data=DATA", "validation.params={ppl: {scoring: bogus}}"], jsonl(TINY_LINE + "\n"),
        r"recipe key validation.params.ppl.scoring='bogus' is unknown; allowed: standard, longlora$"),
    "validation passkey length shorter than its prompt": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.lengths=[16]"], None,
        r"recipe key validation.lengths entry 16 is shorter than the passkey prompt without filler: \d+ tokens of this tokenizer$"),
    "validation harness limit": (
        ["validation.at_end=true", "validation.tasks=[harness]", "validation.params={harness: {tasks: [x], limit: 1.5}}"], None,
        r"recipe key validation.params.harness.limit=1.5 must be a whole number >= 1 or a fraction in \(0, 1\)$"),
    "validation harness without tasks": (
        ["validation.at_end=true", "validation.tasks=[harness]"], None,
        r"recipe key validation.params.harness.tasks=None must list lm-eval task, group or tag names$"),
    "validation passkey trials negative": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.params={passkey: {trials: -1}}"], None,
        r"recipe key validation.params.passkey.trials=-1 must be an integer >= 1$"),
    "validation passkey depth outside [0, 1]": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.params={passkey: {depths: [0.5, 2]}}"], None,
        r"recipe key validation.params.passkey.depths entry 2 must be a number in \[0, 1\]$"),
    "validation task length not positive": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.params={passkey: {lengths: [512, 0]}}"], None,
        r"recipe key validation.params.passkey.lengths entry 0 must be a positive integer$"),
    "validation task length beyond what RoPE takes": (
        ["validation.at_end=true", "validation.tasks=[passkey]", "validation.params={passkey: {lengths: [1000000000000]}}"],
        None, r"recipe key validation.params.passkey.lengths entry 1000000000000: at most 16,777,216 tokens"),
    "validation RULER prompts beyond memory": (
        ["validation.at_end=true", "validation.tasks=[niah_single_1]", "validation.lengths=[1000000]",
         "validation.params={niah_single_1: {samples: 100000000}}"], None,
        r"recipe key validation.lengths entry 1000000: its prompts need about [\d,.]+ GiB of memory \(1024 bytes a "
        r"token to build one, and 48 a token to keep each of its 100000000 prompts per length\), more than the [\d,.]+ "
        r"GiB available here; lower it$"),
    "validation RULER length beyond its words": (
        ["validation.at_end=true", "validation.tasks=[fwe]", "validation.params={fwe: {coded_wordlen: 2}}",
         "validation.lengths=[100000]"], None,
        r"recipe key validation.lengths entry 100000 is longer than fwe can build: at most 16,999 tokens \(a coded word per "
        r"50 tokens, and 2-letter words give 338 \(half of 26\^2\); raise coded_wordlen or set vocab_size\)$"),
    "flash in float32": (
        ["attention.backend=flash"], None,
        r"recipe key attention.backend='flash' is invalid: flash-attn computes in float16/bfloat16 only and model.dtype is float32"),
    "flash where flash-attn cannot run": (
        ["attention.backend=flash", "model.dtype=bfloat16"], None,
        r"recipe key attention.backend='flash' is invalid: flash-attn cannot run here "
        r"\(it needs the flash-attn package and a CUDA device\)"),
    "missing local model path": (
        ["model.name_or_path=DATA/no-model"], None,
        r"recipe key model.name_or_path='.*/no-model' is invalid: no such local directory \(a Hub model is named like"),
    "local directory without config.json": (
        ["model.name_or_path=DATA"], lambda tmp: (tmp / "model").mkdir() or tmp / "model",  # beside train.output_dir, not holding it
        r"recipe key model.name_or_path='.*' is invalid: a local model is a directory with config.json; this has none"),
    "hub id that cannot be reached": (
        ["model.name_or_path=nobody-here/no-model"], None,
        r"model.name_or_path='nobody-here/no-model' is invalid: not a local directory, and its config cannot be read: "),
    "lora target that names nothing": (
        ["lora.target_modules=[q_proj,foo_proj]"], None,
        r"recipe key lora.target_modules=\['q_proj', 'foo_proj'\] is invalid: 'foo_proj' names no module; "
        r"the model's layers LoRA can adapt: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    "lora target LoRA cannot adapt": (
        ["lora.target_modules=[mlp]"], None, r"lora.target_modules=\['mlp'\] is invalid: 'mlp' names a LlamaMLP, which LoRA cannot adapt"),
    "extra_trainable that matches nothing": (
        ["lora.extra_trainable=[embed_tokens,foo]"], None,
        r"recipe key lora.extra_trainable=\['embed_tokens', 'foo'\] is invalid: 'foo' ends no module name; "
        r"the model's names end in: .*embed_tokens.*post_attention_layernorm"),
    "missing data file": (
        ["data.source=DATA/missing.jsonl"], None, r"data.source .*/missing.jsonl does not exist"),
    "empty jsonl": (
        ["data.source=DATA"], jsonl(""), r"data.source .*/docs.jsonl: no documents"),
    "malformed jsonl": (
        ["data.source=DATA"], jsonl(TINY_LINE + "\n" + '{"text": "a" "b"}\n' + TINY_LINE + "\n"),
        r"data.source .*/docs.jsonl line 2: not valid JSON \(Expecting ',' delimiter at column 14\)$"),
    "truncated jsonl": (
        ["data.source=DATA"], jsonl(TINY_LINE + "\n" + TINY_LINE[:30]),
        r"data.source .*/docs.jsonl line 2: not valid JSON \(Unterminated string starting at column 10\); "
        r"the file ends in this line without a newline: was it cut short\?"),
    "jsonl that is not UTF-8": (
        ["data.source=DATA"], jsonl(b'{"text": "\xff"}\n'),
        r"data.source .*/docs.jsonl line 1: not UTF-8 text \(invalid start byte\)"),
    "jsonl rows that are not objects": (
        ["data.source=DATA"], jsonl("[1, 2]\n"), r"data.source .*/docs.jsonl item 0: a JSON int, not an object with a 'text' field"),
    "jsonl without the text column": (
        ["data.source=DATA", "data.text_column=body"], jsonl(TINY_LINE + "\n"),
        r"data.source .*/docs.jsonl has no column 'body'; its columns: text \(set data.text_column\)"),
    # issue 32: chat and instruction rows, their template
    "data format unknown": (
        ["data.format=sharegpt"], None, r"recipe key data.format='sharegpt' is invalid: allowed: text, chat, instruction$"),
    "chat row without an assistant turn": (
        ["data.source=DATA", "data.format=chat", CHAT_TEMPLATE], jsonl(CHAT_LINE.replace("assistant", "user") + "\n"),
        r"data.source .*/docs.jsonl line 1: no assistant turn; the loss trains on assistant turns alone, "
        r"so a chat row needs at least one$"),
    "chat row with an unknown role": (
        ["data.source=DATA", "data.format=chat", CHAT_TEMPLATE], jsonl(CHAT_LINE + "\n" + CHAT_LINE.replace("user", "human") + "\n"),
        r"data.source .*/docs.jsonl line 2: message 0 has role 'human'; allowed: system, user, assistant, tool$"),
    "chat row without messages": (
        ["data.source=DATA", "data.format=chat", CHAT_TEMPLATE], jsonl(TINY_LINE + "\n"),
        r"data.source .*/docs.jsonl line 1: a chat row holds 'messages', a non-empty list of \{role, content\} objects; "
        r"this row's keys: text$"),
    "chat template the tokenizer lacks": (
        ["data.source=DATA", "data.format=chat"], jsonl(CHAT_LINE + "\n"),
        r"^train.py: error: data.chat_template is not set and the model's tokenizer has no chat template: set data.chat_template"),
    "chat template not Jinja": (
        ["data.source=DATA", "data.format=chat", "data.chat_template='{% for %}'"], jsonl(CHAT_LINE + "\n"),
        r"data.chat_template: not a valid Jinja template \(line 1: Expected an expression, got 'end of statement block'\)$"),
    "chat template failing on a row": (
        ["data.source=DATA", "data.format=chat", "data.chat_template='{{ raise_exception(\"no tools here\") }}'"],
        jsonl(CHAT_LINE + "\n"), r"data.source .*/docs.jsonl line 1: data.chat_template cannot render this row \(no tools here\)$"),
    "chat template file missing": (
        ["data.format=chat", "data.chat_template=DATA/chat.jinja"], None,
        r"recipe key data.chat_template='.*/chat.jinja' is invalid: a Jinja chat template \(text with \{\{ or \{%\), or the path"),
    "chat template without chat rows": (
        [CHAT_TEMPLATE], None, r"recipe key data.chat_template=.* is invalid: only applies with data.format=chat, not text$"),
    "instruction row without output": (
        ["data.source=DATA", "data.format=instruction"], jsonl(json.dumps({"instruction": "Say hi.", "answer": "hi"}) + "\n"),
        r"data.source .*/docs.jsonl line 1: an instruction row holds text 'instruction' and 'output' \(and 'input', optional\); "
        r"its 'output' is missing$"),
    # issue 20: tracebacks before, one line now
    "recipe given as a path without .yaml": (
        ["recipe=DATA"], file("mine.yaml", TINY_RECIPE, given="mine"),
        r"recipe=.*/mine: no such recipe file; a path names the file with its .yaml suffix \(did you mean .*/mine.yaml\?\)"),
    "recipe that is a directory": (["recipe=DATA"], lambda tmp: tmp, r"recipe file .* is a directory; name a .yaml file"),
    "recipe that is not UTF-8": (["recipe=DATA"], file("r.yaml", b"\xff\xfe"), r"recipe .*/r.yaml is not UTF-8 text \(byte 0\)"),
    "recipe that is not YAML": (
        ["recipe=DATA"], file("r.yaml", "model: {name_or_path: tiny\n"),
        r"recipe .*/r.yaml is not valid YAML: expected ',' or '}', but got '<stream end>' at line 2, column 1$"),
    "recipe inheriting a list": (
        ["recipe=DATA"], file("r.yaml", "inherit: [tiny]\n"),
        r"recipe .*/r.yaml: inherit=\['tiny'\] must name one recipe \(a name under recipes/ or a .yaml path\)"),
    # issue 31: bounded parsing, no key silently given twice
    "recipe with an alias bomb under a valid key": (
        ["recipe=DATA"], file("r.yaml", f"inherit: tiny\ntrain:\n  wandb:\n    tags: {ALIAS_BOMB}\n"),
        r"recipe .*/r.yaml: YAML anchor &a at line 4, column 12 is refused \(anchors and aliases can expand"),
    "override with an alias bomb": (
        [f"attention.params.x={ALIAS_BOMB}"], None, r"override 'attention.params.x=\[&a .*': YAML anchor &a at line 1, column 2"),
    "recipe with an alias": (
        ["recipe=DATA"], file("r.yaml", "inherit: tiny\nmodel:\n  target_length: &n 1024\ndata:\n  seq_len: *n\n"),
        r"recipe .*/r.yaml: YAML anchor &n at line 3, column 18 is refused"),
    "recipe with a section given twice": (
        ["recipe=DATA"], file("r.yaml", "inherit: tiny\ntrain:\n  lr: 1.0e-3\ntrain:\n  max_steps: 2\n"),
        r"recipe .*/r.yaml: key train is given twice, at lines 2 and 4; keep one \(YAML would silently keep the last\)$"),
    "recipe with a key given twice": (
        ["recipe=DATA"], file("r.yaml", "inherit: tiny\ntrain:\n  lr: 1.0e-3\n  max_steps: 2\n  lr: 5.0\n"),
        r"recipe .*/r.yaml: key train.lr is given twice, at lines 3 and 5; keep one"),
    "inherited recipe with a key given twice": (
        ["recipe=DATA"], lambda tmp: (_write(tmp / "base.yaml", "inherit: tiny\nattention:\n  params: {chunks: 2, chunks: 4}\n"),
                                      _write(tmp / "r.yaml", "inherit: base.yaml\n"))[1],
        r"recipe .*/base.yaml: key attention.params.chunks is given twice, at line 3, columns 12 and 23"),
    "override with a key given twice": (
        ["model.tiny={hidden_size: 32, hidden_size: 64}"], None,
        r"override 'model.tiny=\{hidden_size: 32, hidden_size: 64\}': key hidden_size is given twice, at line 1, columns 2 and 19"),
    "DeepSpeed JSON with a key given twice": (
        ["deepspeed=DATA"], file("ds.json", '{"zero_optimization": {"stage": 2},\n "zero_optimization": {"stage": 3}}'),
        r"recipe key deepspeed='.*/ds.json': key zero_optimization is given twice, at lines 1 and 2; keep one \(JSON would"),
    "DeepSpeed JSON that is a list": (
        ["deepspeed=DATA"], file("ds.json", "[1, 2]"),
        r"recipe key deepspeed='.*/ds.json' holds a JSON list, not an object of DeepSpeed settings"),
    "DeepSpeed section that is not an object": (
        ["deepspeed=DATA"], file("ds.json", '{"bf16": true}'), r"deepspeed='.*/ds.json': bf16=True must be an object"),
    "DeepSpeed stage that is a string": (
        ["deepspeed=DATA"], file("ds.json", '{"zero_optimization": {"stage": "3"}}'),
        r"deepspeed='.*/ds.json': zero_optimization.stage='3' must be 0, 1, 2 or 3"),
    "DeepSpeed batch size of 0": (
        ["deepspeed=DATA"], file("ds.json", '{"train_micro_batch_size_per_gpu": 0}'),
        r"train_micro_batch_size_per_gpu=0 must be a positive integer or \"auto\""),
    "DeepSpeed setting DeepSpeed refuses": (
        ["deepspeed=DATA"], file("ds.json", '{"zero_optimization": {"stage": 3, "overlap_comm": "maybe"}}'),
        r"deepspeed config .*/ds.json: zero_optimization.overlap_comm='maybe' is invalid: Input should be a valid boolean"),
    "DeepSpeed setting misspelt": (
        ["deepspeed=DATA"], file("ds.json", '{"zero_optimization": {"stage": 2, "overlap_com": true}}'),
        r"deepspeed config .*/ds.json: zero_optimization.overlap_com=True is invalid: Extra inputs are not permitted"),
    "cache directory that is a file": (
        ["data.cache_dir=DATA"], jsonl(TINY_LINE + "\n"),
        r"recipe key data.cache_dir='.*docs.jsonl' is invalid: a directory \(to be created, or an earlier run's\); this is a file"),
    "output directory inside a file": (
        ["train.output_dir=DATA/run"], jsonl(TINY_LINE + "\n"), r"train.output_dir='.*docs.jsonl/run' is invalid: .*docs.jsonl is a file"),
    "empty extra_trainable name": (
        ["lora.extra_trainable=['']"], None, r"lora.extra_trainable=\[''\] is invalid: module names, none empty"),
    "extra_trainable holding LoRA's targets": (
        ["lora.extra_trainable=[layers]"], None,
        r"lora.extra_trainable=\['layers'\] is invalid: 'layers' matches model.layers, which holds LoRA's targets"),
    "chunks larger than the sequence": (
        ["attention.params.chunks=600"], None,
        r"recipe key attention.params=\{'chunks': 600\} is invalid: scca_flow\(chunks=600\) at sequence length 512: .*"
        r"fewer than 2 keys per chunk"),
    "sequence too short for the chunks": (
        ["data.seq_len=4"], None, r"attention.params=\{'chunks': 4\} is invalid: scca_flow\(chunks=4\) at sequence length 4: "),
    "dilation as long as the sequence": (
        ["attention.pattern=sda", "attention.params.dilation=512"], None,
        r"attention.params=\{'dilation': 512\} is invalid: sda\(dilation=512\) at sequence length 512: "),
    "FlexAttention training without CUDA": (
        ["attention.backend=flex"], None, r"recipe key attention.backend='flex' is invalid: FlexAttention has no backward on CPU"),
    "flash-attn named as a pattern parameter": (
        ["attention.params.backend=flash"], None,
        r"recipe key attention.params.backend='flash' is invalid: flash-attn cannot run here"),
    "backend named twice, as attention.backend and a pattern parameter": (
        ["attention.backend=auto", "attention.params.backend=sdpa"], None,
        r"attention.params: attention.backend='auto' and attention.params.backend='sdpa' both choose the kernel; set one"),
    "tiny model without a context": (
        ["model.tiny.max_position_embeddings=0"], None,
        r"recipe key model.tiny=\{'max_position_embeddings': 0\} is invalid: its max_position_embeddings=0: extending the "
        r"context needs a positive one"),
    "pattern missing a required parameter": (
        ["attention.pattern=mixed"], None, r"mixed: parameter\(s\) parts required \(it has no default\); allowed: parts, backend"),
    "pattern unknown lists the trainable ones only": (
        ["attention.pattern=scca"], None,
        r"pattern='scca' is unknown; allowed: full, causal, sda, s2, scca_fixed, scca_flow, longmixed, sf_attn, mixed$"),
    "training-free method as the pattern": (
        ["attention.pattern=dca"], None, r"pattern='dca' cannot train \(it is a training-free method\); allowed: full, causal, "),
    "base with pickled weights only": (
        ["model.name_or_path=DATA"], model_dir(*PICKLED),
        r"model.name_or_path='.*/m' is invalid: .*/m holds pickled weights only \(pytorch_model.bin\); sparse-ft reads safetensors only"),
    "base whose weights were cut short": (
        ["model.name_or_path=DATA"], model_dir(*CUT_SHORT),
        r"model.name_or_path='.*/m' is invalid: .*/m: model.safetensors cannot be read as safetensors \(.*\); was it cut short\?"),
    "text document that is not UTF-8": (
        ["data.source=DATA"], file("d.txt", b"def f():\xff\n"), r"data.source .*/d.txt: not UTF-8 text \(byte 8: invalid start byte\)"),
    "parquet file that is not parquet": (
        ["data.source=DATA"], file("d.parquet", "not parquet"), r"data.source .*/d.parquet: not a parquet file \(Parquet magic bytes"),
}


@pytest.fixture(scope="module")
def train_main():
    return runpy.run_path(str(ROOT / "train.py"))["main"]


def argv(out, cache, *overrides):
    """train.py's arguments; a ``recipe=`` among ``overrides`` replaces ``recipe=tiny``."""
    recipe = [o for o in overrides if o.startswith("recipe=")] or ["recipe=tiny"]
    return ["train.py", *recipe, "deepspeed=null", "train.max_steps=1", f"train.output_dir={out}",
            "train.report_to=[none]", f"data.cache_dir={cache}", *(o for o in overrides if not o.startswith("recipe="))]


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


def run_refused(train_main, monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", args)
    code = train_main()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, err
    (line,) = err.strip().splitlines()  # one line
    return line


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_in_one_line_before_anything_loads(case, tmp_path, monkeypatch, capsys, train_main):
    import attn_patterns.kernels

    import torch

    monkeypatch.setattr(attn_patterns.kernels, "flash_available", lambda: False)  # the same answer on a GPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides, data, message = CASES[case]
    where = data(tmp_path) if data else tmp_path
    overrides = [o.replace("DATA", str(where)) for o in overrides]
    out = tmp_path / "run"
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", *overrides))
    assert line.startswith("train.py: error: ")
    assert re.search(message, line), line
    assert not out.exists()  # nothing written: not even the resolved recipe or the tiny base model
    assert not (tmp_path / "cache").exists()


def test_an_earlier_runs_directory_is_left_as_it_was(tmp_path, monkeypatch, capsys, train_main):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)  # a save that never finished: no meta.json
    (out / "log.jsonl").write_text("{}\n")
    before = listing(out)
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", f"train.resume={out / 'checkpoint-2'}"))
    assert "it has no meta.json" in line
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", "lora.target_modules=[foo_proj]"))
    assert "'foo_proj' names no module" in line
    assert listing(out) == before and (out / "log.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("place", ["a file", "a read-only directory"])
def test_a_bad_tensorboard_directory_is_refused_before_anything_loads(place, tmp_path, monkeypatch, capsys, train_main):
    """Issue 31: TENSORBOARD_LOGGING_DIR is checked in preflight as train.output_dir is (it was a
    traceback once the model had loaded). The suite may run as root, who writes anywhere: the
    read-only place is simulated."""
    target = tmp_path / "tb"
    if place == "a file":
        target.write_text("x")
        why = f"{target} is a file"
    else:
        target.mkdir()
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != target and access(path, mode, **kw))
        why = f"{target} is not writable here"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(target))
    out = tmp_path / "run"
    line = run_refused(train_main, monkeypatch, capsys, argv(out, tmp_path / "cache", "train.report_to=[tensorboard]"))
    assert line == (f"train.py: error: TENSORBOARD_LOGGING_DIR={target}: TensorBoard's directory {target} (train.report_to "
                    f"has tensorboard) cannot be made: {why}; name a writable directory, or unset TENSORBOARD_LOGGING_DIR "
                    "(then train.output_dir/tensorboard)")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """Issue 31: the 9^9-tag recipe (and the same as an override) is refused while it is parsed,
    not once it has grown; the valid key it sits under changes nothing."""
    import time

    from sparse_ft.config import load_recipe

    recipe = _write(tmp_path / "r.yaml", f"inherit: tiny\ntrain:\n  wandb:\n    tags: {ALIAS_BOMB}\n")
    for name, overrides in ((str(recipe), []), ("tiny", [f"attention.params.x={ALIAS_BOMB}"])):
        began = time.perf_counter()
        with pytest.raises(ValueError, match="YAML anchor &a at line"):
            load_recipe(name, overrides)
        assert time.perf_counter() - began < 0.5


def test_a_validation_failing_mid_training_saves_its_step_and_ends_in_one_line(tmp_path, monkeypatch, capsys, train_main):
    """What no check foresees (here a task running out of memory at step 1 of 3, checkpoints
    every 4): the step's checkpoint is saved, then one line and exit 1, no adapter. On the way,
    the recipe's pattern is built once for the whole run (checked, not built, when it loads)."""
    import functools

    from attn_patterns.patterns import SccaFlow
    from sparse_ft.evaluation.tasks.passkey import Passkey

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nsee the allocator's documentation")

    built, init = [], SccaFlow.__init__

    @functools.wraps(init)  # the signature the registry checks names against stays the class's
    def counted(self, *args, **kwargs):
        built.append(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Passkey, "evaluate", out_of_memory)
    monkeypatch.setattr(SccaFlow, "__init__", counted)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", argv(out, tmp_path / "cache", "train.max_steps=3", "train.save_steps=4",
                                          "validation.every_steps=1", "validation.tasks=[passkey]", "validation.lengths=[300]",
                                          "validation.params={passkey: {depths: [0.5], trials: 1}}"))
    code = train_main()
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if line.rsplit("\r", 1)[-1].strip()]
    assert lines[-1] == ("train.py: error: validation after step 1 failed (RuntimeError: CUDA out of memory. Tried to "
                         "allocate 2.00 GiB see the allocator's documentation); saved checkpoint-1: correct the recipe's "
                         "validation keys and resume with the same command"), err
    assert sum("error" in line for line in lines) == 1
    assert (out / "checkpoint-1" / "meta.json").is_file() and not (out / "adapter").exists()
    assert built == [{"chunks": 4}]  # the tiny recipe's scca_flow, once per run


@pytest.mark.slow
def test_the_command_line_exits_2_without_a_traceback(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", "")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, *argv(out, tmp_path / "cache", f"data.source={empty}")], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"train.py: error: data.source {empty}: "
                                                    "no documents (empty, or no row with a 'text' value)")
    assert not out.exists()


# --- the other commands: sparse-ft eval | merge | pretrain | experiment | bench ---------------------

def adapter_copy(edit):
    """The data column of ``CLI_CASES``: a copy of the trained adapter, damaged by ``edit``."""
    def make(tmp, adapter):
        copy = tmp / "a"
        shutil.copytree(adapter, copy)
        edit(copy)
        return copy
    return make


def base_copy(config_edit):
    """A copy of the tiny base whose config.json ``config_edit`` changes."""
    def make(tmp, adapter):
        copy = tmp / "b"
        shutil.copytree(ROOT / "assets" / "tiny-base", copy)
        config = json.loads((copy / "config.json").read_text())
        config_edit(config)
        (copy / "config.json").write_text(json.dumps(config))
        return copy
    return make


def cli_file(name, content):
    return lambda tmp, adapter: _write(tmp / name, content)


def token_file(size, sidecar):
    def make(tmp, adapter):
        if sidecar is not None:
            _write(tmp / "t.json", sidecar)
        return _write(tmp / "t.bin", bytes(size))
    return make


def _cut(copy):
    weights = copy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def _pickled(copy):
    (copy / "adapter_model.safetensors").rename(copy / "adapter_model.bin")


def _dca(value):
    return base_copy(lambda config: config.update(dual_chunk_attention_config=value))


EVAL = ["eval", "ppl", "--data", "TEXT", "--lengths", "256"]
PPL = [*EVAL, "--model", "BASE"]
BENCH = ["--lengths", "64", "--repeats", "1", "--warmup", "0"]
# argv (ADAPTER: a trained adapter, BASE: assets/tiny-base, TEXT: a text file, DATA: what the data
# column made, OUT: a place for outputs), data (tmp, adapter) -> path, message after "error: "
CLI_CASES = {
    "eval results and plot into one file": (
        [*PPL, "--output", "OUT/r.png", "--plot", "OUT/r.png"], None, r"--plot .*/out/r.png is also --output: name two different files"),
    # RoPE scaling at most rope.MAX_FACTOR over the pretraining context (tiny-base: 256 tokens), before the weights load
    "eval pi beyond 64x its context": (
        ["eval", "passkey", "--model", "BASE", "--method", "pi", "--lengths", "16385", "--trials", "1"], None,
        r"--method pi at length 16,385: RoPE factor 64\.0039 .* is above 64: .* at most 16,384 tokens on this model$"),
    "eval yarn with a fixed factor beyond 64": (
        [*PPL, "--method", "yarn", "--method-arg", "factor=100"], None,
        r"--method yarn at --method-arg factor=100: RoPE factor 100 .* is above 64"),
    # sparse-ft generate: the prompts, the sampling values and each prompt's length, before the weights load
    "generate without prompts": (
        ["generate", "--model", "BASE"], None, r"no prompts \(no PROMPT argument and no --file\); give PROMPT arguments or --file"),
    "generate an empty prompt": (["generate", "--model", "BASE", "x", " "], None, r"prompt 2 is empty$"),
    "generate a prompt longer than the model's context": (
        ["generate", "--model", "BASE", "--max-new-tokens", "16", "x", "y" * 250], None,
        r"prompt 2 has 250 tokens; --method full allows 256 on this model, --max-new-tokens 16 included \(at most 240 prompt tokens\)"),
    "generate from a JSON line without a prompt": (
        ["generate", "--model", "BASE", "--file", "DATA"], cli_file("p.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n'),
        r"prompt 2 \(line 3 of .*p.jsonl\): unknown key\(s\) text; allowed: prompt, context"),
    "generate at a negative temperature": (
        ["generate", "--model", "BASE", "--temperature", "-1", "x"], None, r"--temperature -1.0 must be a finite number >= 0"),
    "generate greedy with a top-p": (
        ["generate", "--model", "BASE", "--top-p", "0.9", "x"], None, r"--top-p 0.9 samples, but --temperature 0 decodes greedily"),
    "generate with a dense layer outside the model": (
        ["generate", "--model", "BASE", "--method", "s2", "--dense-layers", "0,4", "y" * 40], None,
        r"--dense-layers '0,4' is invalid: layer indices in \[0, 3\], each once \(the model has 4 layers\), or 'last n'$"),
    "generate with dense layers beside a method that is no pattern": (
        ["generate", "--model", "BASE", "--method", "dca", "--dense-layers", "last 1", "x"], None,
        r"--dense-layers 'last 1': the other layers run --method, which must be an attention pattern; --method dca is not"),
    "generate with parallelcomp without a context": (
        ["generate", "--model", "BASE", "--method", "parallelcomp", "x"], None,
        r"prompt 1 has no context: --method parallelcomp answers a prompt about a context"),
    "generate into a file that is not JSON lines": (
        ["generate", "--model", "BASE", "--output", "OUT/o.txt", "x"], None, r"--output .*o.txt must name a .jsonl file"),
    # part 4: honest evaluation
    "eval without --model or --adapter": (
        EVAL, None, r"--model is required without --adapter \(with one, its recorded base is the default\)"),
    "eval on a base of the same shape with other weights": (
        [*EVAL, "--model", "tiny", "--adapter", "ADAPTER"], None,
        r"adapter .*/adapter was trained on other weights than those of .* \(on .*/run/base-model: weights fingerprint "
        r"\w{12}; .*: \w{12}\): an adapter fits only the weights it was trained on; .* pass --allow-other-base"),
    "merge into a base of the same shape with other weights": (
        ["merge", "--adapter", "ADAPTER", "--base", "tiny", "--output", "OUT/m"], None,
        r"adapter .*/adapter was trained on other weights than those of .* pass --allow-other-base"),
    "stride longer than the window": (
        [*PPL, "--stride", "300"], None,
        r"--stride 300 is longer than the window --lengths 256: the 44 tokens between two windows would never be scored; "
        r"use --stride <= 256"),
    "window of one token": ([*PPL, "--lengths", "1"], None, r"--lengths 1: a window needs >= 2 tokens"),
    # issue 31: passkey and RULER lengths bounded by what can be built, as validation.* is (the same checks)
    "passkey length shorter than its prompt": (
        ["eval", "passkey", "--model", "BASE", "--lengths", "16"], None,
        r"--lengths 16 is shorter than the passkey prompt without filler: \d+ tokens of this tokenizer$"),
    "passkey trials negative": (["eval", "passkey", "--model", "BASE", "--trials", "-1"], None, r"--trials -1 must be an integer >= 1$"),
    "ruler length beyond what RoPE takes": (
        ["eval", "ruler", "--model", "BASE", "--lengths", "1000000000000"], None,
        r"--lengths 1000000000000: at most 16,777,216 tokens \(RoPE positions are float32"),
    "ruler prompts beyond memory": (
        ["eval", "ruler", "--model", "BASE", "--lengths", "1000000", "--samples", "100000000"], None,
        r"--lengths 1000000: its prompts need about [\d,.]+ GiB of memory \(1024 bytes a token to build one, and 48 "
        r"a token to keep each of its \d+ prompts per length\), more than the [\d,.]+ GiB available here; lower it$"),
    "RULER length beyond its words": (
        ["eval", "fwe", "--model", "BASE", "--lengths", "100000", "--task-arg", "fwe.coded_wordlen=2"], None,
        r"--lengths 100000 is longer than fwe can build: at most 16,999 tokens"),
    "chunks larger than the window": (
        [*PPL, "--method", "s2", "--method-arg", "chunks=300"], None,
        r"--method s2 with --method-arg chunks=300 at --lengths 256: s2\(chunks=300\) at sequence length 256: .*"
        r"fewer than 2 keys per chunk"),
    # issue 34 item 3: eval --dense-layers as attention.dense_layers, its range from the config before the weights load
    "eval dense layer outside the model": (
        [*PPL, "--method", "s2", "--dense-layers", "1,4"], None,
        r"--dense-layers '1,4' is invalid: layer indices in \[0, 3\], each once \(the model has 4 layers\), or 'last n'$"),
    "eval dense layers beside a method that is no pattern": (
        [*PPL, "--method", "yarn", "--dense-layers", "last 1"], None,
        r"--dense-layers 'last 1': the other layers run --method, which must be an attention pattern; --method yarn is not "
        r"one \(allowed: .*s2.*\)$"),
    "method argument with a YAML anchor": (
        [*PPL, "--method", "s2", "--method-arg", "chunks=&c 4"], None,
        r"--method-arg 'chunks=&c 4': YAML anchor &c at line 1, column 1 is refused"),
    # issue 31 item 4: sizes bounded before anything is built for them
    "plan of a target length past float32 positions": (
        ["plan", "recipe=tiny", "model.target_length=1000000000000"], None,
        r"model.target_length=1000000000000 is invalid: at most 16,777,216 tokens \(RoPE positions are float32"),
    "plan of a target length of 31 digits": (
        ["plan", "recipe=tiny", f"model.target_length={10**30}"], None, r"model.target_length=10{30} is invalid: at most 16,777,216"),
    "plan of pattern chunks of 400 digits": (
        ["plan", "recipe=tiny", f"attention.params.chunks={'1' * 400}"], None,
        r"scca_flow: chunks=111111\.\.\. \(400 digits\) must be an integer <= 1,024"),
    "plan of a tiny model larger than the machine": (
        ["plan", "recipe=tiny", "model.tiny.hidden_size=1000000"], None,
        r"model.tiny=\{'hidden_size': 1000000\} is invalid: its 5,001,541,000,000 parameters take 18,632.2 GiB"),
    "plan of a dense layer outside the model": (
        ["plan", "recipe=tiny", "attention.dense_layers=[5]"], None,
        r"recipe key attention.dense_layers=\[5\] is invalid: layer indices in \[0, 1\], each once \(the model has 2 layers\)"),
    "plan of a dense tail fraction below 0": (
        ["plan", "recipe=tiny", "train.dense_final_fraction=-0.1"], None,
        r"recipe key train.dense_final_fraction=-0.1 is invalid: must be in \[0, 1\]"),
    "plan of a LoRA rank past the layers' sides": (
        ["plan", "recipe=tiny", "lora.r=100000000"], None,
        r"lora.r=100000000 is invalid: at most 16, the smaller side of k_proj \(64 x 16\)"),
    "plan of lengths past float32 positions": (
        ["plan", "recipe=tiny", "--lengths", "512,100000000000"], None,
        r"--lengths 100000000000 is invalid: at most 16,777,216 tokens"),
    # RoPE factor at most rope.MAX_FACTOR, as train refuses it (tiny: 256 tokens; model.native_length honoured)
    "plan beyond 64x the tiny model's context": (
        ["plan", "recipe=tiny", "model.target_length=16400"], None,
        r"model.target_length=16400 is invalid: RoPE factor 64\.0625 .* is above 64: .* at most 16,384 tokens on this model$"),
    "plan of lengths beyond 64x the context": (
        ["plan", "recipe=tiny", "--lengths", "512,20000"], None, r"--lengths 20000 is invalid: RoPE factor 78\.125 .* is above 64"),
    "plan beyond 64x the native length": (
        ["plan", "recipe=tiny", "model.native_length=128", "model.target_length=8200"], None,
        r"model.target_length=8200 is invalid: RoPE factor 64\.0625 \(the model's pretraining context of 128 tokens"),
    "plan of Llama-3.1 beyond 64x with its own llama3 x8": (
        ["plan", "recipe=tiny", "model.name_or_path=meta-llama/Llama-3.1-8B", "model.target_length=1100000"], None,
        r"model.target_length=1100000 is invalid: RoPE factor 67\.1387 \(the model's pretraining context of 8,192 tokens"),
    "eval of a window past float32 positions": (
        [*EVAL[:-1], "1000000000000", "--model", "BASE"], None,
        r"--lengths 1000000000000: at most 16,777,216 tokens \(RoPE positions are float32"),
    "eval of pattern chunks of 400 digits": (
        [*PPL, "--method", "s2", "--method-arg", f"chunks={'1' * 400}"], None,
        r"local: chunks=111111\.\.\. \(400 digits\) must be an integer <= 16,777,216"),
    "dilation as long as the window": (
        [*PPL, "--method", "sda", "--method-arg", "dilation=256"], None,
        r"--method sda with --method-arg dilation=256 at --lengths 256: sda\(dilation=256\) at sequence length 256"),
    # part 6: tracebacks before
    "pattern missing a required parameter": (
        [*PPL, "--method", "mixed"], None, r"mixed: parameter\(s\) parts required \(it has no default\); allowed: parts, backend"),
    "dual_chunk_attention_config that is a list": (
        [*EVAL, "--model", "DATA", "--method", "dca"], _dca([1, 2]),
        r"the model's config.json dual_chunk_attention_config=\[1, 2\] is a list, not an object"),
    "dual_chunk_attention_config that is a string": (
        [*EVAL, "--model", "DATA", "--method", "dca"], _dca("yes"),
        r"the model's config.json dual_chunk_attention_config='yes' is a str, not an object"),
    "dual_chunk_attention_config with a bad value": (
        [*EVAL, "--model", "DATA", "--method", "dca"], _dca({"chunk_size": -5}),
        r"the model's config.json dual_chunk_attention_config=\{'chunk_size': -5\}: dca: chunk_size=-5 must be an integer >= 1"),
    "adapter cut short": (
        [*EVAL, "--adapter", "DATA"], adapter_copy(_cut),
        r"--adapter .*/a: adapter_model.safetensors cannot be read as safetensors \(.*\); was it cut short\?"),
    "merge of an adapter cut short": (
        ["merge", "--adapter", "DATA", "--output", "OUT/m"], adapter_copy(_cut),
        r"--adapter .*/a: adapter_model.safetensors cannot be read as safetensors"),
    "pickled adapter": (
        [*EVAL, "--adapter", "DATA"], adapter_copy(_pickled),
        r"--adapter .*/a holds pickled weights only \(adapter_model.bin\); sparse-ft reads safetensors only"),
    "merge of a pickled adapter": (
        ["merge", "--adapter", "DATA", "--output", "OUT/m"], adapter_copy(_pickled), r"--adapter .*/a holds pickled weights only"),
    "adapter without weights": (
        [*EVAL, "--adapter", "DATA"], adapter_copy(lambda a: (a / "adapter_model.safetensors").unlink()),
        r"--adapter .*/a: no adapter_model.safetensors \(the adapter's weights\)"),
    "adapter config that is a list": (
        [*EVAL, "--adapter", "DATA"], adapter_copy(lambda a: (a / "adapter_config.json").write_text("[1]")),
        r"--adapter .*/a: adapter_config.json holds a JSON list, not an object"),
    "adapter config without peft_type": (
        [*EVAL, "--adapter", "DATA"], adapter_copy(lambda a: (a / "adapter_config.json").write_text("{}")),
        r"--adapter .*/a: adapter_config.json names no peft_type"),
    "adapter metadata of the wrong type": (
        ["merge", "--adapter", "DATA", "--output", "OUT/m"],
        adapter_copy(lambda a: (a / "sparse_ft.json").write_text('{"base_shape": 5}')),
        r"--adapter .*/a: sparse_ft.json key base_shape=5 is not a dict"),
    "pickled base": (
        [*EVAL, "--model", "DATA"], lambda tmp, adapter: model_dir(*PICKLED)(tmp),
        r"--model .*/m holds pickled weights only \(pytorch_model.bin\)"),
    "base cut short": (
        [*EVAL, "--model", "DATA"], lambda tmp, adapter: model_dir(*CUT_SHORT)(tmp),
        r"--model .*/m: model.safetensors cannot be read as safetensors"),
    "model that is a file": ([*EVAL, "--model", "TEXT"], None, r"--model .*/t.txt is a file; a model is a directory with config.json"),
    "merge --method dca of a family the engines serve no DCA for": (
        ["merge", "--adapter", "ADAPTER", "--output", "OUT/m", "--method", "dca", "--context-length", "4096"], None,
        r"--method dca: model_type='llama': the engines read dual_chunk_attention_config only for qwen2, qwen3, qwen3_moe"),
    "merge --method-arg without --method dca": (
        ["merge", "--adapter", "ADAPTER", "--output", "OUT/m", "--method-arg", "chunk_size=64"], None,
        r"--method-arg and --context-length go with --method dca"),
    "an adapter directory as --model": (
        [*EVAL, "--model", "ADAPTER"], None,
        r"--model .* is an adapter directory \(adapter_config.json\), not a model: pass it as --adapter"),
    "merge into a base that does not exist": (
        ["merge", "--adapter", "ADAPTER", "--base", "OUT/none", "--output", "OUT/m"], None, r"--base .*/none: no such directory"),
    "merge into a Hub base that cannot be reached": (
        ["merge", "--adapter", "ADAPTER", "--base", "nobody-here/no-model", "--output", "OUT/m"], None,
        r"the base model nobody-here/no-model of adapter .*: its config cannot be read"),
    "token file sidecar that is a list": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--lengths", "4"], token_file(16, "[1]"),
        r"the sidecar of .*/t.bin: t.json holds a JSON list, not an object"),
    "token file sidecar that is not JSON": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--lengths", "4"], token_file(16, "{"),
        r"the sidecar of .*/t.bin: t.json is not valid JSON"),
    "token file of an odd size": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--lengths", "4"], token_file(15, None),
        r"--data .*/t.bin has 15 bytes, not a whole number of uint16 tokens"),
    "text data without its column": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--text-column", "body"], cli_file("d.jsonl", '{"text": "a"}\n'),
        r"d.jsonl has no column 'body'; its columns: text"),
    # issue 31: errors about --data name --data and --text-column, not training's data.source
    "text data without its column, by the flags": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--text-column", "body"], cli_file("d.jsonl", '{"text": "a"}\n'),
        r"error: --data .*/d.jsonl has no column 'body'; its columns: text \(set --text-column\)$"),
    "text data with a broken JSON line": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA"], cli_file("d.jsonl", '{"text": "a"}\n{"text" "b"}\n'),
        r"error: --data .*/d.jsonl line 2: not valid JSON \(Expecting ':' delimiter at column 9\)$"),
    "harness task folder without --trust-remote-code": (
        ["eval", "harness", "--model", "BASE", "--tasks", "mine", "--include-path", "DATA"],
        lambda tmp, adapter: (tmp / "tasks").mkdir() or tmp / "tasks",
        r"error: --include-path .*/tasks: lm-eval imports and runs the Python its task YAML files name \(!function\); "
        r"give --trust-remote-code to allow that$"),
    "text data shorter than the window": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA", "--lengths", "64"], cli_file("d.txt", "short"),
        r"--lengths 64 longer than the 6 tokens of --data \(lower it or add data\)"),
    "parquet data that is not parquet": (
        [*PPL[:2], "--model", "BASE", "--data", "DATA"], cli_file("d.parquet", "not parquet"), r"d.parquet: not a parquet file"),
    "picture in a format matplotlib cannot write": (
        [*PPL, "--plot", "OUT/ppl.xyz"], None, r"--plot .*/ppl.xyz: .xyz names no picture format; allowed: .*png"),
    "plot of a file that is no results file": (
        ["eval", "plot", "DATA", "--output", "OUT/p.png"], cli_file("r.json", "[1]"), r"r.json is not a results file"),
    "pretrain corpus that is a file": (
        ["pretrain", "--corpus", "TEXT", "--output", "OUT/p"], None, r"--corpus .*/t.txt is a file; a corpus is a directory"),
    "pretrain without key/value heads": (
        ["pretrain", "--num-key-value-heads", "0", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"num_key_value_heads=0 must be >= 1"),
    "pretrain of 0 steps": (["pretrain", "--steps", "0", "--corpus", "OUT/c", "--output", "OUT/p"], None, r"steps=0 must be >= 1"),
    "pretrain passkey fraction above 1": (
        ["pretrain", "--retrieval-fraction", "2", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--retrieval-fraction 2.0 must be within \[0, 1\]"),
    "pretrain with no pass of the text": (
        ["pretrain", "--text-passes", "0", "--corpus", "OUT/c", "--output", "OUT/p"], None, r"--text-passes 0 must be >= 1"),
    "pretrain copy fraction beyond the retrieval documents' share": (
        ["pretrain", "--copy-fraction", "0.8", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--copy-fraction 0.8 must be within \[0, 1 - --retrieval-fraction\]"),
    "pretrain lookup and copy documents beyond what the retrieval documents leave": (
        ["pretrain", "--lookup-fraction", "0.3", "--copy-fraction", "0.5", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--copy-fraction 0.5 must be within \[0, 1 - --retrieval-fraction - --lookup-fraction\]"),
    "pretrain at a RoPE base of at most 1": (
        ["pretrain", "--rope-theta", "0.5", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"rope_theta=0.5 must be 0 \(keep the model's\) or > 1"),
    "pretrain share of full documents above 1": (
        ["pretrain", "--full-fraction", "1.5", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--full-fraction 1.5 must be within \[0, 1\]"),
    "pretrain share of piece copies above 1": (
        ["pretrain", "--copy-fraction", "0.3", "--copy-pieces", "1.5", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--copy-pieces 1.5 must be within \[0, 1\]"),
    "pretrain piece copies without copy documents": (
        ["pretrain", "--copy-pieces", "0.5", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--copy-pieces 0.5 is a share of the copy documents; --copy-fraction 0 draws none \(set --copy-fraction above 0\)"),
    "pretrain share of names in piece spans above 1": (
        ["pretrain", "--copy-fraction", "0.3", "--copy-pieces", "1", "--copy-names", "2", "--corpus", "OUT/c", "--output", "OUT/p"],
        None, r"--copy-names 2.0 must be within \[0, 1\]"),
    "pretrain names in piece spans without piece spans": (
        ["pretrain", "--copy-fraction", "0.3", "--copy-names", "0", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--copy-names 0.0 is a share of the piece spans' items; --copy-pieces 0 draws none \(set --copy-pieces above 0\)"),
    "pretrain checkpoints at negative minutes": (
        ["pretrain", "--save-minutes", "-1", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"save_minutes=-1.0 must be > 0 \(minutes between checkpoints\), or 0 for none before the last step"),
    "pretrain run directory inside the output": (
        ["pretrain", "--run-dir", "OUT/p/run", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--output .*/p overlaps --run-dir .*/p/run; write the output outside it"),
    "pretrain run directory that is a file": (
        ["pretrain", "--run-dir", "TEXT", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"--run-dir .*/t.txt is a file, not a directory"),
    "pretrain with an unknown retrieval task": (
        ["pretrain", "--retrieval-tasks", "passkey,nope", "--corpus", "OUT/c", "--output", "OUT/p"], None,
        r"retrieval_tasks: 'nope' unknown; allowed: passkey, niah_single_1, .*, fwe, vt_drills, cwe_drills, cwe_pseudo_drills or all"),
    "pretrain on a corpus of another tokenizer": (
        ["pretrain", "--tokenizer", "bpe", "--corpus", "DATA", "--output", "OUT/p", "--steps", "1"],
        lambda tmp, adapter: _write(tmp / "c" / "corpus.json", '{"dtype": "uint16", "context": 256}').parent,
        r"--corpus .* was built with \{'tokenizer': 'ByT5Tokenizer'\}, these settings need \{'tokenizer': "),
    "pretrain on a corpus of other keys": (
        ["pretrain", "--tokenizer", "bpe", "--keys", "rare", "--corpus", "DATA", "--output", "OUT/p", "--steps", "1"],
        lambda tmp, adapter: _write(tmp / "c" / "corpus.json",
                                    '{"dtype": "uint16", "context": 256, "tokenizer": "TokenizersBackend"}').parent,
        r"--corpus .* was built with \{'keys': 'frequent'\}, these settings need \{'keys': 'rare'\}; name a new --corpus"),
    "pretrain corpus manifest that is not one": (
        ["pretrain", "--corpus", "DATA", "--output", "OUT/p", "--steps", "1"],
        lambda tmp, adapter: _write(tmp / "c" / "corpus.json", "{}").parent,
        r"corpus.json is not a corpus manifest of scripts/build_corpus.py \(KeyError: 'dtype'\)"),
    "pretrain corpus without blocks": (
        ["pretrain", "--corpus", "DATA", "--output", "OUT/p", "--steps", "1"],
        lambda tmp, adapter: (_write(tmp / "c" / "corpus.json", '{"dtype": "uint16", "context": 256}'),
                              _write(tmp / "c" / "train.bin", b""))[0].parent,
        r"train.bin holds 0 bytes, not whole blocks of 256 uint16 tokens"),
    "experiment output that is a file": (
        ["experiment", "--quick", "--output", "TEXT", "--runs", "OUT/r"], None, r"--output .*/t.txt: .*/t.txt is a file; name a directory"),
    "experiment on a base whose config does not state its context": (
        ["experiment", "--quick", "--base", "DATA", "--output", "OUT/e", "--runs", "OUT/r"],
        base_copy(lambda config: config.pop("max_position_embeddings")),
        r"--base .*/b: its config.json has no max_position_embeddings, so the base's context, from which every length"),
    "experiment with an unknown variant": (
        ["experiment", "--quick", "--variants", "sinks,dense", "--output", "OUT/e", "--runs", "OUT/r"], None,
        r"--variants 'dense' is unknown; allowed: sinks, sf_attn, dense_last, dense_tail$"),
    "bench attention on CUDA without CUDA": (
        ["bench", "attention", *BENCH, "--device", "cuda"], None,
        r"bench attention: --device 'cuda': torch sees no CUDA device here; use cpu \(or omit --device\)"),
    "bench train with a dense layer outside the model": (
        ["bench", "train", *BENCH, "--dense-layers", "last 9"], None,
        r"bench train: --dense-layers 'last 9' is invalid: 'last n' with n in \[1, 4\] \(the model has 4 layers\)$"),
    "bench train with a dense tail fraction above 1": (
        ["bench", "train", *BENCH, "--dense-final-fraction", "2"], None, r"bench train: --dense-final-fraction 2.0 must be in \[0, 1\]"),
    "bench attention with negative sink tokens": (
        ["bench", "attention", *BENCH, "--sink-tokens", "-1"], None,
        r"bench attention: --sink-tokens -1 must be in \[0, each pattern's chunk width at every --lengths value\)"),
    "bench train with sink tokens as wide as a chunk": (
        ["bench", "train", *BENCH, "--patterns", "s2", "--sink-tokens", "16"], None,
        r"bench train: --sink-tokens 16: s2\(chunks=4, sink_tokens=16\): sink_tokens=16 must be in \[0, 16\) at sequence length 64"),
    "bench train on CUDA without CUDA": (
        ["bench", "train", *BENCH, "--device", "cuda"], None, r"bench train: --device 'cuda': torch sees no CUDA device here"),
    "bench dca on CUDA without CUDA": (
        ["bench", "dca", *BENCH, "--device", "cuda"], None, r"bench dca: --device 'cuda': torch sees no CUDA device here"),
    "bench eval on CUDA without CUDA": (
        ["bench", "eval", *BENCH, "--device", "cuda"], None, r"bench eval: --device 'cuda': torch sees no CUDA device here"),
    "bench dca with an unknown LongHeads backend": (
        ["bench", "dca", *BENCH, "--longheads-backend", "cuda"], None,
        r"bench dca: --longheads-backend='cuda' is unknown; allowed: sdpa, efficient, flash, flex, math, triton"),
    "bench on a device that is none": (
        ["bench", "attention", *BENCH, "--device", "gpu0"], None, r"bench attention: --device 'gpu0' is not a device"),
    "bench on the auto device": (
        ["bench", "dca", *BENCH, "--device", "auto"], None, r"bench dca: --device auto: a benchmark runs on one device"),
    "bench output that is a directory": (
        ["bench", "attention", *BENCH, "--output", "OUT"], None, r"bench attention: --output .*/out is a directory; name a file"),
    "bench output inside a file": (
        ["bench", "attention", *BENCH, "--output", "TEXT/x.json"], None, r"bench attention: --output .*/t.txt/x.json: cannot write in"),
    "bench pattern missing a required parameter": (
        ["bench", "attention", *BENCH, "--patterns", "mixed"], None, r"mixed: parameter\(s\) parts required"),
    "bench without patterns": (["bench", "attention", *BENCH, "--patterns", ","], None,
                               r"bench attention: --patterns=',' names no pattern"),
    "bench eval of one-token windows": (["bench", "eval", *BENCH, "--lengths", "1"], None,
                                        r"bench eval: --lengths 1: a window needs >= 2 tokens"),
}


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """An adapter trained one step on the tiny recipe's base (materialised with the recipe's seed,
    42): the built-in ``tiny`` (seed 0) has its shape and other weights."""
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    root = tmp_path_factory.mktemp("trained")
    train(load_recipe("tiny", [f"train.output_dir={root / 'run'}", f"data.cache_dir={root / 'cache'}", "deepspeed=null",
                               "train.max_steps=1", "train.report_to=[none]"]))
    return root / "run" / "adapter"


def snapshot(root):
    """Every path under ``root`` with a digest of a file's bytes (None for a directory)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_input_to_any_command_fails_in_one_line(case, tmp_path, monkeypatch, capsys, trained_adapter):
    import torch

    from sparse_ft.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    args, data, message = CLI_CASES[case]
    text = _write(tmp_path / "t.txt", "def f():\n    return 1\n" * 200)
    (tmp_path / "out").mkdir()
    made = data(tmp_path, trained_adapter) if data else None
    adapter_before = snapshot(trained_adapter)
    before = snapshot(tmp_path)
    places = {"ADAPTER": trained_adapter, "BASE": ROOT / "assets" / "tiny-base", "TEXT": text, "DATA": made, "OUT": tmp_path / "out"}
    argv = [re.sub("|".join(places), lambda m: str(places[m.group()]), arg) for arg in args]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, err
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]  # a terminal shows what follows a bar's \r
    lines = [line for line in lines if line.strip()]
    assert sum("error:" in line for line in lines) == 1 and lines[-1].startswith(f"sparse-ft {argv[0]}: error: "), err
    assert re.search(message, lines[-1]), lines[-1]
    assert snapshot(tmp_path) == before and snapshot(trained_adapter) == adapter_before  # nothing written or changed


def test_the_adapters_base_is_evaluated_by_default(trained_adapter, tmp_path, capsys):
    """The control of the cases above: the same adapter on its own base, named or by default."""
    from sparse_ft.cli import main

    text = _write(tmp_path / "t.txt", "def f():\n    return 1\n" * 200)
    assert main(["eval", "ppl", "--adapter", str(trained_adapter), "--data", str(text), "--lengths", "256",
                 "--output", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["model"] == str(trained_adapter.parent / "base-model")
    assert main(["eval", "ppl", "--model", "tiny", "--adapter", str(trained_adapter), "--data", str(text), "--lengths", "256",
                 "--allow-other-base"]) == 0
    assert "used anyway, as --allow-other-base asks" in capsys.readouterr().err


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    """An unreadable file (permissions; the suite may run as root, so the refusal is simulated)
    is an OSError naming it: one line and exit 2, like every other bad input."""
    from pathlib import Path

    from sparse_ft.cli import main

    text = _write(tmp_path / "t.txt", "text " * 100)
    read_text = Path.read_text

    def refused(path, *args, **kwargs):
        if path == text:
            raise PermissionError(13, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    assert main(["eval", "ppl", "--model", str(ROOT / "assets" / "tiny-base"), "--data", str(text), "--lengths", "64"]) == 2
    err = capsys.readouterr().err
    assert err == f"sparse-ft eval: error: [Errno 13] Permission denied: '{text}'\n"
