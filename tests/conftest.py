"""The suite's fixtures: the recipes' environment (private caches; it starts and stops the
fork server), a tiny Llama and its tokenizer built locally, the model zoo, a chat file, a
base config, a finished run the tests read, and a planted link's target. Helpers the tests
import (launching runs, reading them, shared rows) are in tests/support/."""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain.demo import build_model_dir, make_rows, write_jsonl
from tests.support.architectures import build
from tests.support.links import VICTIM_TEXT
from tests.support.runs import BASE_CONFIG, FORKS, recipe_args, run_recipe

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # the cores are shared between the suite's workers
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """Environment for recipe subprocesses: private caches, no network, no tracker noise."""
    root = tmp_path_factory.mktemp("cache")
    env = dict(os.environ)
    env.update(
        LLMTRAIN_CACHE=str(root / "llmtrain"),
        HF_DATASETS_CACHE=str(root / "datasets"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # DeepSpeed's CPU ops (shared-memory collectives, CPU Adam) are compiled on first use into
        # torch's extensions folder, by default one per user: a build by another virtualenv (a
        # fresh clone) has other include paths, so each would rebuild them (1 to 2 minutes) in turn.
        # Trackers stay local and quiet: trackio's database and wandb's offline files in the
        # test's own folders (a run puts wandb's under its output_dir/logs).
        TRACKIO_DIR=str(root / "trackio"),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions"),
    )
    FORKS.env = dict(env)
    yield env
    FORKS.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama with the demo's character tokenizer and chat template."""
    rows = make_rows(200, seed=0)
    corpus = [m["content"] for r in rows for m in r["messages"]]
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", corpus, hidden_size=64, num_layers=2)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory, tokenizer):
    """name -> a saved tiny model of that architecture (tests/support/architectures.py),
    built on first use with the tiny model's tokenizer."""
    root, built = tmp_path_factory.mktemp("zoo"), {}

    def get(name):
        if name not in built:
            built[name] = build(name, root / name, tokenizer)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    """20 chat rows whose trained-token counts differ (1 or 2 exchanges, answers of 1-6 chars)."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    write_jsonl(make_rows(20, seed=3), path)
    return path


@pytest.fixture(scope="session")
def finished_run(base_config, tiny_model, chat_file, cache_env, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4, and the arguments that made
    it, shared by the tests that read it; a test that changes it works on a copy
    (`copy_run`)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    args = recipe_args(
        base_config,
        tiny_model,
        chat_file,
        out,
        "train.micro_batch_size=2",
        "train.max_steps=4",
        "checkpoint.every_steps=2",
    )
    run_recipe(args, cache_env)
    return out, args


@pytest.fixture(scope="session")
def base_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "base.yaml"
    path.write_text(BASE_CONFIG)
    return path


@pytest.fixture
def victim(tmp_path):
    """A file and a directory outside output_dir that a planted link points at."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file").write_text(VICTIM_TEXT)
    (outside / "dir" / "keep").write_text(VICTIM_TEXT)
    out = tmp_path / "run"
    out.mkdir()
    return SimpleNamespace(out=out, file=outside / "file", dir=outside / "dir")
