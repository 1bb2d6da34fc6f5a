"""DeepSpeed Ulysses on two CPU ranks (gloo), launched as the docs say: each sequence split
over both ranks, each rank attending with half the heads, gives the single-process run's
per-step losses, gradients (every trainable tensor's, before each update), gradient norms and
adapter for s2, scca_flow and longmixed, for every registered pattern on padding-free
packed documents (several per sample, cut between the ranks), and on chat rows (labels on the
answers alone, a rank's half may hold none); a resume from a checkpoint whose position falls
inside the adapter's round of batches continues that curve, and so does one in a single process
without sequence parallelism.
One launch trains all of them (each launch costs ~30 s here): run as a script, this module is
what every rank runs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attn_patterns
from tests.train.helpers_train import DEEPSPEED, ROOT, assert_adapter_reproduces_probe, one_thread, overrides  # noqa: F401
from tests.modeling.test_attention_integration import PARAMS
from tests.train.test_train_deepspeed import free_port

PATTERNS = ("s2", "scca_flow", "longmixed")
RESUMED = "scca_flow"
# 2 steps of 3 micro-batches: the resume from step 1 starts at micro-batch 3, rank 1's half
# of the adapter's second round. No LoRA dropout: its masks would come from per-rank RNGs.
SETTINGS = ["train.max_steps=2", "train.gradient_accumulation_steps=3", "train.save_steps=1",
            "train.save_total_limit=10", "lora.dropout=0", "deepspeed=zero3_cpu_fp32"]


def recipe_args(out: Path, cache: Path, pattern: str, *extra: str) -> list[str]:
    return overrides(out, cache, f"attention.pattern={pattern}", *SETTINGS, *extra)


# padding-free packing of short documents, every registered pattern (DeepSpeed gathers the
# restarting positions after its all-to-all, so each rank's heads see the documents as documents)
PACKED = "-padding_free"
PACKED_RUNS = tuple(f"{name}{PACKED}" for name in attn_patterns.names())


def short_documents(root: Path) -> Path:
    return root / "short.jsonl"


# chat rows (data.format: chat, recipes/tiny_chat.yaml's template): positions restart at every
# conversation and labels are -100 outside the answers; of 512-token samples, some hold several
# conversations, one cut between the ranks, and some a rank's half without a target
CHAT_RUN = "scca_flow-chat"


def chat_rows(root: Path) -> Path:
    return root / "chat.jsonl"


def conversation(i: int) -> dict:
    turns = [{"role": "user", "content": f"question {i}: " + "word " * (2 + i * 37 % 61)},
             {"role": "assistant", "content": f"answer {i}" + " yes" * (1 + i % 5)}]
    return {"messages": turns * (1 + i % 2)}


def recipe_of(run: str) -> str:
    return "tiny_chat" if run == CHAT_RUN else "tiny"


def run_args(out: Path, cache: Path, run: str, *extra: str) -> list[str]:
    if run == CHAT_RUN:
        return recipe_args(out, cache, "scca_flow", f"data.source={chat_rows(out.parents[1])}", *extra)
    if not run.endswith(PACKED):
        return recipe_args(out, cache, run, *extra)
    pattern = run.removesuffix(PACKED)
    return recipe_args(out, cache, pattern, f"attention.params={json.dumps(PARAMS.get(pattern, {}))}",
                       "data.packing=padding_free", f"data.source={short_documents(out.parents[1])}", "data.min_tokens=0",
                       *extra)


class Gradients:
    """Every trainable tensor's gradient at each optimizer step of a run, complete and not yet
    applied, saved by rank 0 to ``path`` (None: not recorded), through a hook on the engine
    this process trains with."""

    path = None
    steps: list = []

    @classmethod
    def start(cls, path) -> None:
        cls.path = path
        cls.steps.clear()

    @classmethod
    def record(cls, named, gradient, rank: int = 0) -> None:
        if cls.path is None:
            return
        cls.steps.append({name: gradient(p).detach().float().cpu().clone() for name, p in named if p.requires_grad})
        if rank == 0:
            torch.save(cls.steps, cls.path)

    @classmethod
    def single_process(cls, monkeypatch) -> None:
        """The plain engine: the gradient is ``.grad`` when the optimizer step begins."""
        from sparse_ft.train.engine import Engine

        step = Engine.optimizer_step

        def recorded(engine):
            cls.record(engine.model.named_parameters(), lambda p: p.grad)
            return step(engine)

        monkeypatch.setattr(Engine, "optimizer_step", recorded)

    @classmethod
    def deepspeed(cls) -> None:
        """DeepSpeed's engine (ZeRO-3: partitioned, gathered on every rank) at the accumulation
        boundary, before its step applies it."""
        import torch.distributed as dist
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        step = DeepSpeedEngine.step

        def recorded(engine, *args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                cls.record(engine.module.named_parameters(), safe_get_full_grad, dist.get_rank())
            return step(engine, *args, **kwargs)

        DeepSpeedEngine.step = recorded


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def adapter(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_ulysses_two_ranks_train_exactly_like_one_process_and_resume(tmp_path, monkeypatch):
    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    cache = tmp_path / "cache"
    short_documents(tmp_path).write_text(
        "".join(json.dumps({"text": f"document {i}: " + "word " * (8 + i % 37)}) + "\n" for i in range(64)))
    chat_rows(tmp_path).write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(48)))
    argv = [*DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(Path(__file__)), str(tmp_path), str(cache)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {tmp_path / 'sp' / RESUMED / 'checkpoint-1'} at step 1" in done.stdout

    Gradients.single_process(monkeypatch)
    for run_name in (*PATTERNS, *PACKED_RUNS, CHAT_RUN):
        single = tmp_path / "single" / run_name
        Gradients.start(tmp_path / "single" / f"{run_name}.pt")
        train(load_recipe(recipe_of(run_name), run_args(single, cache, run_name, "deepspeed=null")))
        sp = tmp_path / "sp" / run_name
        assert json.loads((sp / "train_summary.json").read_text())["world_size"] == 2
        runs = [sp / "uninterrupted.jsonl", sp / "log.jsonl"] if run_name == RESUMED else [sp / "log.jsonl"]
        want = records(single / "log.jsonl")
        for run in runs:
            got = records(run)
            assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=2e-6), run_name
            assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5), run_name
        expected = torch.load(tmp_path / "single" / f"{run_name}.pt")
        got = torch.load(tmp_path / "sp" / f"{run_name}.pt")
        assert len(got) == len(expected) == 2 and got[0].keys() == expected[0].keys()
        for step, gradients in enumerate(got):
            for name, gradient in gradients.items():
                torch.testing.assert_close(gradient, expected[step][name], atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{run_name} step {step + 1} {name}: {m}")
        expected = adapter(single)
        for name, tensor in adapter(sp).items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5)
    Gradients.start(None)
    # the probe written under SP (evaluation runs whole sequences per rank) is the saved adapter's
    assert_adapter_reproduces_probe(tmp_path / "sp" / RESUMED)
    # the SP run's step-1 checkpoint resumed in one process without SP continues the single-process curve
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(tmp_path / "sp" / RESUMED / "checkpoint-1", moved / "checkpoint-1")
    allow = "train.resume_allow_changes=[world_size,train.sequence_parallel_size]"
    train(load_recipe("tiny", recipe_args(moved, cache, RESUMED, "deepspeed=null", allow)))
    got, want = records(moved / "log.jsonl"), records(tmp_path / "single" / RESUMED / "log.jsonl")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=2e-6)


def _ranks_main(root: Path, cache: Path) -> None:
    """Every rank: the three patterns, then every pattern on packed documents, then the chat
    rows, with sequence_parallel_size=2, then the resumed one again from its step-1 checkpoint."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    Gradients.deepspeed()

    def run(run_name: str, gradients=None) -> None:
        Gradients.start(gradients)
        train(load_recipe(recipe_of(run_name), run_args(root / "sp" / run_name, cache, run_name,
                                                        "train.sequence_parallel_size=2")))
        # a run owns its process; the next one here makes its own SP groups and ZeRO-3 config
        parallel_state_sp._release_sequence_parallel_groups()
        unset_hf_deepspeed_config()

    for run_name in (*PATTERNS, *PACKED_RUNS, CHAT_RUN):
        run(run_name, root / "sp" / f"{run_name}.pt")
    out = root / "sp" / RESUMED
    if dist.get_rank() == 0:  # as if killed after step 1
        (out / "log.jsonl").rename(out / "uninterrupted.jsonl")
        shutil.rmtree(out / "checkpoint-2")
        (out / "train_summary.json").unlink()
    dist.barrier()
    run(RESUMED)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    _ranks_main(Path(sys.argv[-2]), Path(sys.argv[-1]))
