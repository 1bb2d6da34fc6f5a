"""The kernel asked for is the kernel that ran: a library that routes attention around the
installed method after sparse-ft installed it (its own backend choice switching the model back
to sdpa, a layer replaced; axolotl PR #3928 trained the wrong loss and gradients with no error)
stops a run at its first step, and ``sparse-ft eval`` at its first forward, in one line naming
the layers and what they ran. A normal run passes (every training test runs the check)."""

import copy
import json

import pytest

from tests.train.helpers_train import one_thread, train_py  # noqa: F401
from sparse_ft import use_attention
from sparse_ft.modeling.attention import AttentionNotCalled, FirstForwardCheck, checked_calls, current_method, pretrained
from tests.modeling.test_attention_integration import build, ids_of


def switched(model):
    """What a library's automatic backend choice does: the model back on transformers' sdpa."""
    pretrained(model).set_attn_implementation("sdpa")
    return model


def replaced(model):
    """What a library's own attention layer does: layer 1 a module that never calls the method."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    base = pretrained(model)
    config = copy.deepcopy(base.config)
    config._attn_implementation = "sdpa"
    layer = base.model.layers[1]
    own = LlamaAttention(config, layer_idx=1)
    own.load_state_dict(layer.self_attn.state_dict(), strict=False)
    layer.self_attn = own
    return model


BROKEN = {"switched": (switched, "layer(s) 0, 1 of 2", "attn_implementation='sdpa'"),
          "replaced": (replaced, "layer(s) 1 of 2", "attn_implementation='sdpa'")}


def test_a_model_that_runs_its_method_passes_and_keeps_nothing():
    model = use_attention(build("llama"), "s2")
    method = current_method(model)
    with checked_calls(model, when="x"):
        model(ids_of((1, 24)))
    assert all(layer.self_attn._sparse_ft_method is method for layer in model.model.layers)  # the counters are gone
    use_attention(model, "full")  # the model's own attention: nothing installed, nothing to check
    with checked_calls(model, when="x"):
        model(ids_of((1, 24)))


@pytest.mark.parametrize("how", BROKEN)
def test_layers_that_did_not_call_the_method_are_named(how):
    breaks, layers, ran = BROKEN[how]
    model = breaks(use_attention(build("llama"), "s2"))
    with pytest.raises(AttentionNotCalled) as raised, checked_calls(model, when="step 1"):
        model(ids_of((1, 24)))
    assert str(raised.value).startswith(f"step 1: attention {layers} did not call the installed method 's2' (they ran "
                                        f"LlamaAttention with {ran})")


@pytest.mark.parametrize("how", BROKEN)
def test_a_run_whose_attention_is_routed_around_stops_at_its_first_step(tmp_path, how, monkeypatch, capsys):
    from sparse_ft.train.trainer import Trainer

    breaks, layers, ran = BROKEN[how]
    build_model = Trainer.build_model
    monkeypatch.setattr(Trainer, "build_model", lambda self: breaks(build_model(self)))
    out = tmp_path / "run"
    code = train_py("recipe=tiny", f"train.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "deepspeed=null",
                    "train.report_to=[none]", "train.max_steps=2", "train.save_steps=1", "attention.pattern=s2",
                    "attention.params={}")
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]  # after the progress bars, the one line
    assert line.startswith(f"train.py: error: step 1: attention {layers} did not call the installed method 's2' "
                           f"(they ran LlamaAttention with {ran})") and line.endswith("nothing of this step was saved")
    assert not list(out.glob("checkpoint-*")) and not (out / "adapter").exists()


def test_eval_stops_at_its_first_forward_through_another_attention(tmp_path, monkeypatch, capsys):
    from sparse_ft.cli import main
    from sparse_ft.methods import base

    monkeypatch.setattr(base, "install_method", lambda model, method: switched(use_attention(model, method)))
    data, out = tmp_path / "d.jsonl", tmp_path / "ppl.json"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(4)))
    argv = ["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64", "--method", "s2", "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("sparse-ft eval: error: --method s2: attention layer(s) 0, 1 of 2 did not call "
                                       "the installed method 's2'") in err.strip().splitlines()[-1], err  # after a bar
    assert not out.exists()


def test_generate_stops_at_its_first_forward_through_another_attention(tmp_path, monkeypatch, capsys):
    """``sparse-ft generate`` runs eval's check: nothing is printed or written from another kernel."""
    from sparse_ft.cli import main
    from sparse_ft.methods import base

    out = tmp_path / "o.jsonl"
    argv = ["generate", "--model", "tiny", "--method", "s2", "--max-new-tokens", "2", "--output", str(out), "a b c d e f g h"]
    assert main(argv) == 0  # the control: the method installed runs
    capsys.readouterr()
    out.unlink()
    monkeypatch.setattr(base, "install_method", lambda model, method: switched(use_attention(model, method)))
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == "" and not out.exists()
    assert captured.err.strip().splitlines()[-1].startswith(
        "sparse-ft generate: error: --method s2: attention layer(s) 0, 1 of 2 did not call the installed method 's2'"), captured.err


def test_eval_checks_its_first_forward_with_a_method_only():
    """Forwards on the model's own attention wait; the first with a method is checked, then
    the hooks are gone."""
    model = build("llama")
    FirstForwardCheck(model, when="x")
    model(ids_of((1, 8)))  # full: not checked, still armed
    assert model.model._forward_hooks and model.model._forward_pre_hooks  # on the decoder, which scoring runs alone
    use_attention(model, "s2")
    model(ids_of((1, 8)))
    assert not model.model._forward_hooks and not model.model._forward_pre_hooks
    switched(model)
    model(ids_of((1, 8)))  # later forwards are not checked (and cost nothing)
