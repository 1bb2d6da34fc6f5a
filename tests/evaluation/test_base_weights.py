"""An adapter is evaluated and merged on the weights it was trained on. The
adapter records a fingerprint of its base's weights, read from the checkpoint's safetensors
files (so the same under ZeRO-3 and NF4 loading); another base, even one of the same shape, is
refused unless the user says so, and an adapter from before fingerprints gets one warning."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from sparse_ft.cli import main
from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer
from sparse_ft.modeling.weight_files import fingerprint, model_files

ROOT = Path(__file__).resolve().parents[2]


def save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_the_fingerprint_is_the_weights_not_the_files(tmp_path):
    """One tensor's change or another seed changes it; sharding, a bfloat16 copy and a second
    read do not. Reading it costs milliseconds (a few slices of each tensor)."""
    model = tiny_llama(seed=1)
    one = fingerprint(str(save(model, tmp_path / "one")))
    assert one.startswith("v1:") and one == fingerprint(str(tmp_path / "one"))
    sharded = save(model, tmp_path / "sharded", max_shard_size="100KB")
    assert len(model_files(sharded, "sharded")) > 1 and fingerprint(str(sharded)) == one
    assert fingerprint(str(save(model.to(torch.bfloat16), tmp_path / "bf16"))) == one
    assert fingerprint(str(save(tiny_llama(seed=2), tmp_path / "other"))) != one
    edited = tiny_llama(seed=1)
    with torch.no_grad():  # as a merged adapter changes a projection
        edited.model.layers[-1].self_attn.q_proj.weight.add_(1e-2)
    assert fingerprint(str(save(edited, tmp_path / "edited"))) != one
    assert fingerprint("nobody-here/no-model") is None  # offline, not cached: unknown, not an error


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    root = tmp_path_factory.mktemp("run")
    train(load_recipe("tiny", [f"train.output_dir={root}", f"data.cache_dir={root / 'cache'}", "deepspeed=null",
                               "train.max_steps=1", "train.report_to=[none]"]))
    return root


def test_training_records_its_bases_fingerprint(run):
    meta = json.loads((run / "adapter" / "sparse_ft.json").read_text())
    assert meta["base_fingerprint"] == fingerprint(str(run / "base-model"))


def test_an_adapter_loads_on_its_own_base_only_unless_allowed(run, capsys):
    """Also with NF4 loading: the fingerprint is read from the files, not from the 4-bit model."""
    from sparse_ft.evaluation import loading

    model, _ = loading.load(None, str(run / "adapter"), tokenizer=False)  # the default: its recorded base
    assert model.get_base_model().config.hidden_size == 64 and "warning" not in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"trained on other weights than those of .* pass --allow-other-base"):
        loading.load("tiny", str(run / "adapter"), load_in_4bit=True, tokenizer=False)
    loaded, _ = loading.load(str(run / "base-model"), str(run / "adapter"), load_in_4bit=True, tokenizer=False, device="cpu")
    assert any("4bit" in type(m).__name__ for m in loaded.modules())
    loading.load("tiny", str(run / "adapter"), tokenizer=False, allow_other_base=True)
    assert "; used anyway, as --allow-other-base asks" in capsys.readouterr().err


def test_an_adapter_without_a_fingerprint_gets_one_warning(run, tmp_path, capsys):
    """Adapters written before this change: evaluated as before, with one line saying why the
    base cannot be checked."""
    old = tmp_path / "old"
    shutil.copytree(run / "adapter", old)
    meta = json.loads((old / "sparse_ft.json").read_text())
    del meta["base_fingerprint"]
    (old / "sparse_ft.json").write_text(json.dumps(meta))
    text = tmp_path / "t.txt"
    text.write_text("def f():\n    return 1\n" * 100)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", "tiny", "--adapter", str(old), "--data", str(text), "--lengths", "128"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: adapter {old} records no fingerprint of its base's weights (written by an older "
                        "sparse-ft): cannot check that tiny is the base it was trained on"]


def test_merge_takes_the_recorded_base_and_refuses_another(run, tmp_path, capsys):
    assert main(["merge", "--adapter", str(run / "adapter"), "--base", "tiny", "--output", str(tmp_path / "m")]) == 2
    assert "--allow-other-base" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert main(["merge", "--adapter", str(run / "adapter"), "--output", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
