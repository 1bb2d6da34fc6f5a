"""The adapter's ``README.md``: a model card that says what a user without sparse-ft needs to
get the trained model back, in place of PEFT's empty template.

An adapter from a RoPE extension is only right over its base *with the extended RoPE*, and the
usual ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`` loads
the base's own config and silently loses it. The adapter directory therefore carries
``config.json`` (the base's config with the RoPE extension, written by ``write_adapter``), and
the card gives the lines that pass it; ``tests/test_adapter_card.py`` runs those lines and
compares their logits with ``load_adapter_model``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparse_ft.modeling import rope
from sparse_ft.modeling.model_io import META_FILE

CARD = "README.md"
# what the card's code names the adapter by: the directory moves (checkpoint renames, uploads)
ADAPTER_PLACEHOLDER = "path/to/this/adapter"


def _rope_line(meta: dict) -> str:
    params = rope.portable(meta["rope_parameters"])
    kind = params["rope_type"]
    name = rope.SCALINGS.get(kind, kind)
    if kind == "default":
        return (f"default RoPE (rope_theta {params.get('rope_theta')}), no scaling; "
                f"max_position_embeddings {meta['max_position_embeddings']}")
    extra = ", ".join(f"{k} {v}" for k, v in sorted(params.items()) if k not in ("rope_type", "factor"))
    return (f"`{kind}` ({name}) factor {params.get('factor')} ({extra}): pretraining context "
            f"{meta.get('original_context')} → max_position_embeddings {meta['max_position_embeddings']}")


def model_card(meta: dict, adapter_config: dict) -> str:
    """The card's text from the adapter's ``sparse_ft.json`` (``meta``) and its PEFT config."""
    base = meta["base_model"]
    attention = dict(meta.get("train_attention") or {"pattern": "full"})
    pattern = attention.pop("pattern")
    pattern_args = ", ".join(f"{k}={v}" for k, v in attention.items())
    targets = ", ".join(sorted(adapter_config.get("target_modules") or []))
    saved = ", ".join(adapter_config.get("modules_to_save") or []) or "none"
    quantised = meta.get("base_quantization", "none")
    trained_with = f"`{pattern}`{f' ({pattern_args})' if pattern_args else ''}"
    return f"""---
base_model: {meta.get('base_model_given') or base}
library_name: peft
pipeline_tag: text-generation
tags:
- lora
- sparse-ft
- long-context
- rope-{rope.portable(meta['rope_parameters'])['rope_type']}
---

# Long-context LoRA adapter (sparse-ft)

| | |
|---|---|
| base model | `{base}` (weights fingerprint `{meta.get('base_fingerprint')}`; quantised while training: {quantised}) |
| method | LoRA r={adapter_config.get('r')}, alpha={adapter_config.get('lora_alpha')} on {targets}; also trained in full: {saved} |
| RoPE | {_rope_line(meta)} |
| attention pattern trained with | {trained_with}: a training-time sparsity only; the model runs with ordinary full attention |
| target length | {meta.get('target_length')} tokens |
| recipe | `{meta.get('recipe')}` |

## Load it with transformers and PEFT (no sparse-ft)

The adapter is only right over its base **with the RoPE above**. `config.json` in this
directory is the base's config with that RoPE; pass it when loading the base:

```python
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

adapter = "{ADAPTER_PLACEHOLDER}"  # this directory, or its Hub id once uploaded
model = AutoModelForCausalLM.from_pretrained("{base}", config=AutoConfig.from_pretrained(adapter))
model = PeftModel.from_pretrained(model, adapter)
```

Without `config=`, `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`
and `AutoPeftModelForCausalLM.from_pretrained(adapter)` load the base's own config: the RoPE
extension is silently lost (`rope_type` of the base) and long inputs come out worse.
`AutoModelForCausalLM.from_pretrained(adapter)` stops with "no file named model.safetensors"
(this directory holds a config but no base weights): use the lines above.

## With sparse-ft

```python
import sparse_ft
model = sparse_ft.load("{ADAPTER_PLACEHOLDER}")  # base + adapter + RoPE, base weights checked
```

Training-free methods (DCA, LongHeads, ParallelComp) have no standard loading path: they need
sparse-ft, e.g. `sparse_ft.use_attention(model, "dca")`. To serve the model with vLLM or
SGLang, merge it first: `sparse-ft merge --adapter {ADAPTER_PLACEHOLDER} --output merged/`
(docs/serving.md in sparse-ft). `{META_FILE}` holds the same facts for sparse-ft.
"""


def write_model_card(directory: Path, meta: dict) -> None:
    """``README.md`` in the adapter ``directory`` (its ``adapter_config.json`` written)."""
    adapter_config = json.loads((directory / "adapter_config.json").read_text())
    (directory / CARD).write_text(model_card(meta, adapter_config))
