"""W&B and TensorBoard as their users expect: names from the recipe, else the usual
environment variables; the resolved recipe as the run's config; a resumed run continues its W&B
run; a tracker asked for but not installed stops the run before anything loads. W&B is not in
the test environment: a fake module records what the trainer hands it."""

import sys
import types

import pytest

from sparse_ft.cli import main
from sparse_ft.config import load_recipe
from sparse_ft.train import metrics
from sparse_ft.train.metrics import WANDB_ID_FILE, MetricLog, wandb_settings

VARIABLES = ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS", "TENSORBOARD_LOGGING_DIR")


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module whose ``init`` records its arguments and whose runs record their logs."""
    calls, logged = [], []

    def init(**kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(id=kwargs.get("id", f"run{len(calls)}"), finish=lambda: None,
                                     log=lambda values, step: logged.append((step, values)))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls, logged


def test_recipe_keys_win_over_the_environment_which_wins_over_the_defaults(env):
    recipe = load_recipe("tiny")
    assert wandb_settings(recipe) == {"project": "sparse-ft"}
    env.setenv("WANDB_PROJECT", "team")
    env.setenv("WANDB_ENTITY", "lab")
    env.setenv("WANDB_NAME", "from-env")
    env.setenv("WANDB_RUN_GROUP", "sweep")
    env.setenv("WANDB_TAGS", "long,tiny")
    assert wandb_settings(recipe) == {"project": "team", "entity": "lab", "name": "from-env", "group": "sweep",
                                      "tags": ["long", "tiny"]}
    recipe = load_recipe("tiny", ["train.wandb={project: mine, name: run-1, tags: [a]}"])
    assert wandb_settings(recipe) == {"project": "mine", "entity": "lab", "name": "run-1", "group": "sweep", "tags": ["a"]}


def test_the_run_gets_the_resolved_recipe_as_config_and_a_resume_continues_it(env, fake_wandb, tmp_path):
    calls, logged = fake_wandb
    recipe = load_recipe("tiny", ["train.wandb={project: mine}"])
    log = MetricLog(tmp_path, ["wandb"], [], recipe=recipe)
    log.write({"step": 1, "loss": 2.0})
    log.close()
    assert calls[0]["project"] == "mine" and calls[0]["config"] == recipe.to_dict() and "id" not in calls[0]
    assert logged == [(1, {"train/loss": 2.0})] and (tmp_path / WANDB_ID_FILE).read_text() == "run1\n"
    MetricLog(tmp_path, ["wandb"], [{"step": 1, "loss": 2.0}], recipe=recipe).close()
    assert calls[1]["id"] == "run1" and calls[1]["resume"] == "allow" and calls[1]["project"] == "mine"
    assert calls[1]["config"] == recipe.to_dict()


def test_tensorboard_writes_where_its_variable_says_with_the_recipe(env, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    (tmp_path / "out").mkdir()
    log = MetricLog(tmp_path / "out", ["tensorboard"], [], recipe=load_recipe("tiny"))
    log.write({"step": 1, "loss": 2.0})
    log.close()
    assert not (tmp_path / "out" / metrics.TENSORBOARD_DIR).exists()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert "recipe/text_summary" in events.Tags()["tensors"] and "train/loss" in events.Tags()["scalars"]


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_that_is_not_installed_stops_the_run_before_anything_loads(tracker, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(metrics.TRACKER_MODULES, tracker, ("sparse_ft_no_such_module", tracker))
    out = tmp_path / "run"
    assert main(["train", "recipe=tiny", f"train.report_to=[{tracker}]", f"train.output_dir={out}",
                 f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"sparse-ft train: error: recipe key train.report_to=['{tracker}'] is invalid: {tracker} is not "
                   f"installed here; pip install {tracker}, or remove {tracker} from train.report_to\n")
    assert not out.exists()


def test_an_unknown_wandb_key_is_refused_when_the_recipe_loads():
    with pytest.raises(ValueError, match=r"recipe key train.wandb.colour='red' is invalid: keys allowed: project"):
        load_recipe("tiny", ["train.wandb.colour=red"])
    with pytest.raises(ValueError, match=r"train.wandb.tags='a' is invalid"):
        load_recipe("tiny", ["train.wandb.tags=a"])
