"""The single-process training path for real: a plain-torch run of the tiny recipe, a run killed
by SIGKILL and one that crashes mid-save, both resumed to the uninterrupted loss curve, half
precision over fp32 masters (every trainable pattern in bf16 and fp16), and the merged model. The two-process DeepSpeed run is in
test_train_deepspeed.py; faults of every kind in test_faults.py."""

import json
import math
import os
import runpy
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.helpers_train import (ROOT, STEPS, SimulatedCrash, assert_adapter_reproduces_probe, common, curve, losses,  # noqa: F401
                           one_thread, reference, start, wait_for)
from sparse_ft import methods
from sparse_ft.config import load_recipe
from sparse_ft.modeling.model_io import load_adapter_model
from sparse_ft.train import checkpoint
from sparse_ft.train.checkpoint import complete_checkpoints, find_resume
from sparse_ft.train.cli import parse_argv
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.trainer import train


@pytest.mark.slow
def test_single_process_run_composes_rope_and_saves_a_complete_adapter(reference):
    out, summary = reference
    assert summary["steps"] == STEPS and summary["world_size"] == 1 and len(losses(out)) == STEPS
    meta = assert_adapter_reproduces_probe(out)
    assert meta["rope_parameters"]["rope_type"] == "linear" and meta["rope_parameters"]["factor"] == 4.0
    assert meta["max_position_embeddings"] == 512 and meta["original_context"] == 256
    record = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"} <= set(record)
    assert record["tokens_per_s"] > 0 and record["peak_mem_mib"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "recipe.resolved.yaml").is_file()
    # nothing pickled: checkpoints are safetensors + JSON
    assert complete_checkpoints(out) == [2, 4, 6, 8]  # the last step's too
    # .md: the model card (sparse_ft.train.model_card)
    assert {p.suffix for p in (out / "checkpoint-4").iterdir()} == {".safetensors", ".json", ".md"}
    ckpt = json.loads((out / "checkpoint-4" / "meta.json").read_text())
    assert ckpt["data"]["micro_batches"] == 4 * 2 and len(ckpt["history"]) == 4 and ckpt["optimizer_steps"] == 4
    assert (ckpt["data"]["epoch"], ckpt["data"]["consumed"]) == (0, 4 * 2)  # 8 samples of epoch 0's order
    assert len(ckpt["data"]["sha256"]) == 64 and {"adapter_config.json", "adapter_model.safetensors"} <= set(ckpt["files"])
    optimizer = load_file(str(out / "checkpoint-4" / "optimizer.safetensors"))
    assert any(k.endswith("::exp_avg_sq") and v.abs().sum() > 0 for k, v in optimizer.items())


@pytest.mark.slow
def test_killed_run_resumes_with_the_uninterrupted_loss_curve(tmp_path, common, reference):
    out = tmp_path / "killed"
    proc = start([str(ROOT / "train.py"), "recipe=tiny", *common, f"train.output_dir={out}"])
    wait_for(out / "checkpoint-4" / "meta.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "adapter").exists()
    assert find_resume(out, "auto") is not None
    resumed = train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    assert curve(resumed) == curve(reference[1])
    assert losses(out) == losses(reference[0])


@pytest.mark.slow
def test_crash_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path, common, reference, monkeypatch):
    out = tmp_path / "crashed"
    real_write = checkpoint.write_synced

    def crash_in_save_6(path, data):
        if path.parent.name.startswith("checkpoint-6") and path.name == "optimizer.safetensors":
            raise SimulatedCrash("while writing checkpoint-6")
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "write_synced", crash_in_save_6)
    with pytest.raises(SimulatedCrash):
        train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    monkeypatch.undo()
    half = [p for p in out.iterdir() if p.name.startswith("checkpoint-6")]
    assert len(half) == 1 and (half[0] / "trainable.safetensors").exists() and not (half[0] / "meta.json").exists()
    assert complete_checkpoints(out) == [2, 4] and find_resume(out, "auto") == out / "checkpoint-4"
    resumed = train(load_recipe("tiny", [*common, f"train.output_dir={out}"]))
    assert curve(resumed) == curve(reference[1])
    assert complete_checkpoints(out) == [2, 4, 6, 8] and not [p for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_resume_refuses_a_changed_data_order(tmp_path, common, reference):
    out = tmp_path / "changed"
    out.mkdir()
    os.symlink(reference[0] / "checkpoint-2", out / "checkpoint-2")
    with pytest.raises(ValueError, match=r"other settings \(train\.seed: 42 then, 7 now\)"):
        train(load_recipe("tiny", [*common, f"train.output_dir={out}", "train.seed=7"]))


def test_half_written_checkpoints_are_never_resumed(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainable.safetensors").write_bytes(b"weights")
    checkpoint.seal(tmp_path / "checkpoint-2", {"step": 2}, ["trainable.safetensors"])
    (tmp_path / "checkpoint-4.tmp").mkdir()  # crashed mid-save
    (tmp_path / "checkpoint-6").mkdir()  # renamed but meta missing: impossible by construction, ignored anyway
    assert complete_checkpoints(tmp_path) == [2]
    assert find_resume(tmp_path, "auto") == tmp_path / "checkpoint-2"
    assert find_resume(tmp_path, "never") is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        find_resume(tmp_path, str(tmp_path / "checkpoint-4.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_without_deepspeed_trains_the_norms_in_fp32_masters(tmp_path, common, dtype):
    """At a 7B recipe's lr a norm weight's update (~2e-5) is far below half precision's spacing
    near 1: updated in bf16/fp16 no norm would ever move. Over fp32 masters every one moves, the
    adapter holds exactly the masters, and a resume (fp16: with its loss scale) is exact."""
    out = tmp_path / dtype
    run = [*common, f"model.dtype={dtype}", "train.lr=2e-5", "train.max_steps=4", "train.warmup_steps=0"]
    summary = train(load_recipe("tiny", [*run, f"train.output_dir={out}"]))
    masters = load_file(str(out / "checkpoint-4" / "trainable.safetensors"))
    norms = {k.replace(".modules_to_save.default", ""): v for k, v in masters.items() if k.endswith("norm.modules_to_save.default.weight")}
    assert len(norms) == 2 * 2 + 1 and all(v.dtype == torch.float32 for v in masters.values())
    assert all((v != 1).all() for v in norms.values())  # every weight of every norm moved ...
    assert all((v.to(getattr(torch, dtype)) == 1).all() for v in norms.values())  # ... by less than half precision resolves
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(adapter[k], v) for k, v in norms.items())
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    assert curve(train(load_recipe("tiny", [*run, f"train.output_dir={resumed}"]))) == curve(summary)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("pattern", methods.names(lambda supports: supports.training))
def test_every_trainable_pattern_trains_in_half_precision_without_deepspeed(tmp_path, common, pattern, dtype):
    """Autocast over fp32 masters hands a pattern inputs of two dtypes (test_patterns checks
    each against the dense reference so); here the whole run: two steps, finite numbers, the
    adapter reproducing the trained logits."""
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={tmp_path}", f"model.dtype={dtype}",
                                         f"attention.pattern={pattern}", "train.max_steps=2", "train.gradient_accumulation_steps=1"]))
    assert len(summary["history"]) == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in summary["history"])
    assert load_adapter_model(tmp_path / "adapter") is not None and (tmp_path / "adapter_probe.safetensors").is_file()


def test_plain_torch_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="deepspeed=null trains in one process.*WORLD_SIZE=2"):
        init_distributed(use_deepspeed=False)


@pytest.mark.parametrize("argv", [["--local_rank=1", "recipe=tiny", "a.b=1"], ["--local_rank", "1", "recipe=tiny", "a.b=1"],
                                  ["recipe=tiny", "--local-rank=1", "a.b=1"]])
def test_train_py_tolerates_the_launchers_local_rank(argv, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert parse_argv(argv) == ("tiny", ["a.b=1"])
    assert os.environ["LOCAL_RANK"] == "1"


@pytest.mark.slow
def test_merge_writes_a_plain_model_with_the_trained_positions(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    from sparse_ft.cli import main

    adapter = reference[0] / "adapter"
    assert main(["merge", "--adapter", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.rope_parameters["factor"] == 4.0 and merged.config.max_position_embeddings == 512
    assert not list((tmp_path / "merged").glob("*.bin"))
    unmerged = load_adapter_model(adapter).eval()
    ids = load_file(str(reference[0] / "adapter_probe.safetensors"))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_every_checkpoint_is_an_adapter_that_eval_and_merge_take(tmp_path, reference, capsys):
    """checkpoint-N is a PEFT adapter with the run's sparse_ft.json: the last one holds exactly
    the final adapter's tensors, and an earlier one evaluates and merges like it."""
    from transformers import AutoModelForCausalLM

    from sparse_ft.cli import main
    from sparse_ft.modeling.model_io import read_meta

    out = reference[0]
    last = load_file(str(out / "checkpoint-8" / "adapter_model.safetensors"))
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    assert read_meta(out / "checkpoint-4") == read_meta(out / "adapter")
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "README.md").read_text()[:3000])
    for name in ("checkpoint-4", "adapter"):
        assert main(["eval", "ppl", "--model", str(out / "base-model"), "--adapter", str(out / name), "--data", str(text),
                     "--lengths", "512", "--output", str(tmp_path / f"{name}.json")]) == 0, capsys.readouterr().err
    ppl = {name: json.loads((tmp_path / f"{name}.json").read_text())["results"][0]["ppl"] for name in ("checkpoint-4", "adapter")}
    assert all(0 < value < float("inf") for value in ppl.values()) and ppl["checkpoint-4"] != ppl["adapter"]
    assert main(["merge", "--adapter", str(out / "checkpoint-4"), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    unmerged = load_adapter_model(out / "checkpoint-4").eval()
    ids = load_file(str(out / "adapter_probe.safetensors"))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_prepare_train_builds_the_cache_the_trainer_reuses(tmp_path, common, reference, capsys):
    cache = Path(next(o for o in common if o.startswith("data.cache_dir=")).split("=", 1)[1])
    before = sorted(cache.rglob("*"))
    main = runpy.run_path(str(ROOT / "scripts" / "prepare_train.py"))["main"]
    assert main(["recipe=tiny", *common, f"train.output_dir={tmp_path / 'run'}"]) == 0
    assert "samples of 512 tokens" in capsys.readouterr().out
    assert sorted(cache.rglob("*")) == before  # found the trainer's cache instead of writing another


def test_checkpoints_from_before_a_key_existed_resume_at_its_default(tmp_path):
    """A checkpoint written before train.sequence_parallel_size existed ran without sequence
    parallelism: it resumes at sp=1 and is refused, by name, at sp=2."""
    from sparse_ft.train.fingerprint import check_resume

    old = {"train.seed": 42, "world_size": 1}
    check_resume(old, {"train.seed": 42, "train.sequence_parallel_size": 1, "world_size": 1}, [], tmp_path)
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size: 1 then, 2 now"):
        check_resume(old, {"train.seed": 42, "train.sequence_parallel_size": 2, "world_size": 1}, [], tmp_path)


@pytest.mark.parametrize("groups", [[2, 1, 2], [3, 1, 4, 2], [1, 3]])
def test_the_data_order_continues_an_epoch_on_any_number_of_processes(groups):
    """Resumed with another number of data-parallel groups at every third micro-batch, a run
    trains on each sample of an epoch at most once, drops fewer than one micro-batch's worth,
    and goes on into the next epoch; without a change it is the order of before (rank r's
    m-th batch: slot m × world + r of epoch m // per_epoch's permutation)."""
    from sparse_ft.train.data_order import DataOrder, DataPosition

    size, batch, seed = 23, 2, 5
    position, seen = DataPosition(), []
    for n in groups:
        order = DataOrder(size, batch, n, seed=seed)
        for micro in range(3):
            at = order.advance(position, micro)
            seen.append([i for g in range(n) for i in order.indices(at, g)] if order.advance(at, 1).epoch == 0 else [])
        position = order.advance(position, 3)
    first_epoch = [i for ids in seen for i in ids]
    assert len(first_epoch) == len(set(first_epoch)) > size - batch * max(groups)
    assert position.epoch >= 1 or position.consumed == len(first_epoch)

    for world in (1, 3):
        order, per_epoch = DataOrder(size, batch, world, seed=seed), size // (batch * world)
        for micro in range(2 * per_epoch + 1):
            epoch, within = divmod(micro, per_epoch)
            perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            for rank in range(world):
                first = (within * world + rank) * batch
                assert order.indices(order.advance(DataPosition(), micro), rank) == perm[first : first + batch]


def test_a_checkpoint_from_before_positions_were_recorded_resumes_where_it_stood(tmp_path):
    from sparse_ft.train.data_order import DataPosition, saved_position

    fingerprint = {"train.per_device_batch_size": 2, "train.sequence_parallel_size": 1}
    # 23 samples, 2 ranks of 2: 5 micro-batches an epoch; micro-batch 7 is the third of epoch 1
    assert saved_position({"samples": 23, "micro_batches": 7}, fingerprint, 2, tmp_path) == DataPosition(1, 8)
    sp = {**fingerprint, "train.sequence_parallel_size": 2}
    assert saved_position({"samples": 23, "micro_batches": 3}, sp, 2, tmp_path) == DataPosition(0, 6)  # one SP group
    with pytest.raises(ValueError, match=r"stopped inside a round of sequence-parallel batches \(1 of 2\)"):
        saved_position({"samples": 23, "micro_batches": 3}, sp, 4, tmp_path)
    assert saved_position({"samples": 23, "micro_batches": 9, "epoch": 1, "consumed": 8}, sp, 4, tmp_path) == DataPosition(1, 8)


def test_another_number_of_processes_is_refused_unless_allowed(tmp_path, capsys):
    from sparse_ft.train.fingerprint import check_resume

    with pytest.raises(ValueError, match=r"\(world_size: 2 then, 1 now\); restore them, list them in "
                                         r"train.resume_allow_changes=\[world_size\] to continue anyway"):
        check_resume({"world_size": 2}, {"world_size": 1}, [], tmp_path)
    check_resume({"world_size": 2}, {"world_size": 1}, ["world_size"], tmp_path)
    assert f"resuming {tmp_path} with world_size: 2 then, 1 now" in capsys.readouterr().out
    load_recipe("tiny", ["deepspeed=null", "train.resume_allow_changes=[world_size]"])  # an entry the recipe may list


def test_decay_ends_at_the_floor_and_matrices_alone_decay_on_request():
    """The one schedule serves fine-tuning (decay to 0, as before the floor existed) and
    pretraining (cosine to a fraction of the peak, no decay on norm weights)."""
    from sparse_ft.modeling.tiny import tiny_llama
    from sparse_ft.train.engine import param_groups, schedule

    plain = load_recipe("tiny", ["deepspeed=null", "train.warmup_steps=2", "train.scheduler=cosine"]).train
    floored = load_recipe("tiny", ["deepspeed=null", "train.warmup_steps=2", "train.scheduler=cosine", "train.min_lr_ratio=0.1"]).train
    assert [schedule(plain, 12)(s) for s in (0, 1, 2)] == [1 / 3, 2 / 3, 1.0] and schedule(plain, 12)(11) < 0.03
    assert schedule(floored, 12)(11) == pytest.approx(0.1 + 0.9 * schedule(plain, 12)(11)) and schedule(floored, 12)(99) == 0.1
    params = list(tiny_llama().parameters())
    assert param_groups(params, plain) is params
    matrices, vectors = param_groups(params, load_recipe("tiny", ["deepspeed=null", "train.weight_decay_on=matrices"]).train)
    assert all(p.dim() == 2 for p in matrices["params"]) and all(p.dim() == 1 for p in vectors["params"])
    assert vectors["weight_decay"] == 0.0 and len(matrices["params"]) + len(vectors["params"]) == len(params)
