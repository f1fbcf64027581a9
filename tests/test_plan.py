import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.config import Config, load_config
from llmtrain.demo import make_rows, write_jsonl
from llmtrain.errors import ConfigError
from llmtrain.methods import METHODS, demo_config
from llmtrain.plan import Launch, count_params, memory_estimate
from tests.support import accelerate_config
from tests.support.runs import ROOT, run_python

LLMTRAIN = str(Path(sys.executable).parent / "llmtrain")


def plan(*args, env=None):
    """`llmtrain plan *args`, the installed entry point, run by this Python."""
    return run_python([sys.executable, LLMTRAIN, "plan", *args], dict(os.environ) if env is None else env, 300)


def test_plan_shows_batch_steps_memory_and_a_marked_row(base_config, tiny_model, chat_file, cache_env):
    args = [
        "--config",
        str(base_config),
        "--accelerate-config",
        "accelerate_configs/cpu_ddp.yaml",
        f"model.name_or_path={tiny_model}",
        f"data.train={chat_file}",
        f"data.eval={chat_file}",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
    ]
    proc = plan(*args, env=dict(cache_env, ACCELERATE_USE_CPU="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "data.eval: 20/20 rows kept" in out
    assert "WARNING: this config" not in out
    assert "train.warmup_steps" not in proc.stderr
    without = plan(*args, "train.warmup_steps=3", env={k: v for k, v in cache_env.items() if k != "ACCELERATE_USE_CPU"})
    assert "WARNING: this config starts 2 CPU processes, but ACCELERATE_USE_CPU=1 is not set" in without.stdout
    assert "warning: train.warmup_steps: 3 is not below the run's 3 steps" in without.stderr  # as the run warns
    assert "world size: 2" in out
    assert "global batch: 8 sequences = micro_batch_size 2 x grad_accum_steps 2 x 2 process(es)" in out
    assert "steps per epoch: 3" in out  # 20 rows, 8 per step: 8, 8, 4
    assert "== memory per GPU (rough estimate) ==" in out and "optimizer state:" in out
    row = out.split("the rest masked) ==\n", 1)[1]
    assert "<|im_start|>assistant\n\u27e6" in row and "<|im_end|>\n\u27e7" in row
    assert "<|im_start|>user\n\u27e6" not in row  # user turns are masked
    assert "output_dir:" in out  # the resolved config
    assert "== attention (CPU) ==\n  backend: sdpa (auto: PyTorch's fused attention" in out
    assert "pattern: full causal on all 2 layers" in out


def test_plan_says_which_attention_a_model_gets_and_why(base_config, zoo, chat_file, cache_env):
    """Gemma 2 on CPU: eager, because it does not support SDPA; its sliding and full layers."""
    args = ["--config", str(base_config), f"model.name_or_path={zoo('gemma2')}", f"data.train={chat_file}"]
    proc = plan(*args, "data.packing=true", env=cache_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend: eager (auto: Gemma2ForCausalLM does not support SDPA (soft-capped attention scores)" in proc.stdout
    assert "pattern: sliding window of 8 tokens on 1 layer, full causal on 1 layer" in proc.stdout
    assert "packed: each sample gets that pattern from its own first token" in proc.stdout
    refused = plan(*args, "model.attn_implementation=sdpa", env=cache_env)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: model.attn_implementation: Gemma2ForCausalLM does not support sdpa; use auto or one of eager, "
        "flex_attention"
    )


def test_plan_of_a_preference_run_shows_a_pair_and_its_reference(base_config, tiny_model, cache_env, tmp_path):
    from llmtrain.demo import make_pairs, write_jsonl

    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(make_pairs(20, seed=4), pairs)
    common = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={pairs}"]
    proc = plan(*common, "dpo.beta=0.2", "train.micro_batch_size=4", env=cache_env)  # a dpo key: dpo.py's config
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "global batch: 4 pairs = micro_batch_size 4" in out and "steps per epoch: 5" in out
    assert "== preference (sigmoid, beta 0.2) ==" in out and "reference: the starting weights" in out
    pair = out.split("the rest masked) ==\n", 1)[1]
    chosen, rejected = pair.split("-- rejected --")
    assert chosen.count("\u27e6") == 1 and rejected.count("\u27e6") == 1  # only the answers are trained
    assert chosen.split("\u27e6")[0].replace("-- chosen --\n", "") == rejected.split("\u27e6")[0].lstrip("\n")
    lora = plan(*common, "--recipe", "dpo", "model.lora.enabled=true", "data.packing=true", env=cache_env)
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert "packed sequences of whole pairs" in lora.stdout and "adapters off" in lora.stdout
    sft = plan(*common, env=cache_env)  # read as finetune.py's: pairs are not SFT rows
    assert sft.returncode == 2 and "Traceback" not in sft.stderr
    reward = plan(*common, "--recipe", "reward", env=cache_env)  # no reward key in the config: named
    assert reward.returncode == 0, reward.stderr[-3000:]
    assert "== reward model (Bradley-Terry, centring 0) ==" in reward.stdout


def test_plan_of_an_rl_run_counts_its_generations_and_reference(base_config, tiny_model, cache_env, tmp_path):
    from llmtrain.demo import make_prompts, write_jsonl

    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(make_prompts(50, seed=4), prompts)
    common = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={prompts}"]
    grpo = ["grpo.num_generations=4", "grpo.max_completion_length=16", "grpo.num_iterations=2", "grpo.beta=0.1"]
    proc = plan(*common, *grpo, "train.micro_batch_size=3", "train.grad_accum_steps=2", env=cache_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "global batch: 6 prompts = micro_batch_size 3 x grad_accum_steps 2" in out
    assert "steps per epoch: 16;" in out  # 50 // 6 = 8 rounds, 2 steps each
    assert "per micro-batch: 3 prompt(s) x 4 = 12 sequences" in out and "generation KV cache" in out
    assert "KL reference: the starting weights: a frozen copy" in out and "reference model:" in out
    assert out.rstrip().endswith("<|im_start|>assistant")  # the first prompt, rendered for generation
    missing = plan(*common, "--recipe", "grpo", "grpo.rewards=[accuracy,format]", env=cache_env)
    assert missing.returncode == 2 and "grpo.format_pattern: the 'format' reward needs" in missing.stderr
    # plan imports reward modules (docs/grpo.md): one that leaves a thread running at its top
    # is named, and plan still exits (it waited for the thread forever).
    threads = tmp_path / "threads.py"
    threads.write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), name='poller').start()\n"
        "def f(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    proc = plan(*common, *grpo, "--recipe", "grpo", f"grpo.rewards=[{threads}:f]", env=cache_env)
    assert proc.returncode == 0 and f"grpo.rewards: {threads}:f: its import started thread(s) 'poller'" in proc.stderr
    assert "warning: thread(s) 'poller' still running 5 s after the run was over" in proc.stderr


def test_plan_of_a_stream_samples_its_start(base_config, tiny_model, chat_file, cache_env, tmp_path):
    more = tmp_path / "more.jsonl"
    write_jsonl(make_rows(10, seed=4), more)
    proc = plan(
        "--config",
        str(base_config),
        f"model.name_or_path={tiny_model}",
        f"data.train=[{{path: {chat_file}, fraction: 2}}, {more}]",
        "data.streaming=true",
        "train.max_steps=50",
        env=cache_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streamed; the first rows read: data.train: 30/30 rows kept" in proc.stdout
    assert f"  {chat_file} (fraction 2): 20/20 rows kept, " in proc.stdout  # each source's counts
    assert f"  {more}: 10/10 rows kept, " in proc.stdout
    assert "end of pass" not in proc.stderr  # a sample, not a pass of a run
    assert "steps per pass: not known ahead (streamed); total steps: 50" in proc.stdout
    assert "<|im_start|>assistant\n\u27e6" in proc.stdout.split("the rest masked) ==\n", 1)[1]


def test_plan_flags_a_deepspeed_accumulation_conflict(base_config, tiny_model, chat_file, cache_env, tmp_path):
    ds = tmp_path / "zero2.yaml"
    ds.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
        "deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 4\n"
    )
    proc = plan(
        "--config",
        str(base_config),
        "--accelerate-config",
        str(ds),
        f"model.name_or_path={tiny_model}",
        f"data.train={chat_file}",
        env=cache_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "CONFLICT: deepspeed_config.gradient_accumulation_steps=4 in " + str(ds) + " but train.grad_accum_steps=1"
    ) in proc.stdout
    assert "DeepSpeed ZeRO-2" in proc.stdout


def test_plan_rejects_unknown_keys_like_the_recipe(cache_env):
    proc = plan("train.lrr=1", env=cache_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: train.lrr: unknown key; did you mean 'train.lr'?"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_counted_in_the_width_they_are_computed_in(tmp_path, checkpointing):
    """float32 weights without bf16/fp16 mixed precision compute float32 activations: twice
    the 16-bit figure (it was 16-bit whatever the precision, half the real one on CPU)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    common = [f"model.name_or_path={tmp_path}", "data.train=x", "train.micro_batch_size=2", "data.max_seq_len=512"]
    common.append(f"model.gradient_checkpointing={str(checkpointing).lower()}")
    per_token_layer = 2 if checkpointing else 34  # bytes x hidden in 16 bits: a layer's input, or all it keeps
    layers16 = 4 * 2 * 512 * 256 * per_token_layer + (2 * 512 * 256 * 34 if checkpointing else 0)
    activations = {}
    for dtype in ("float32", "bfloat16", "auto"):  # auto: this config names no dtype, so float32
        cfg = load_config(None, [*common, f"model.dtype={dtype}"])
        for precision in ("no", "bf16"):
            activations[dtype, precision] = memory_estimate(
                cfg, METHODS["finetune"], Launch(mixed_precision=precision), *count_params(cfg)
            )["activations"]
    assert activations["float32", "no"] - activations["float32", "bf16"] == layers16
    assert activations["auto", "no"] == activations["float32", "no"]
    assert activations["bfloat16", "no"] == activations["bfloat16", "bf16"] == activations["float32", "bf16"]


def test_memory_estimate_for_a_1b_llama_shards_with_zero(tmp_path):
    """Llama-3.2-1B's shape on the meta device: no weights are created."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tmp_path}",
            "data.train=x",
            "model.dtype=bfloat16",
            "train.micro_batch_size=1",
            "data.max_seq_len=2048",
        ],
    )
    total, trainable, mcfg, chunkable, _ = count_params(cfg)
    assert total == trainable == pytest.approx(1.236e9, rel=0.01) and chunkable
    single = memory_estimate(cfg, METHODS["finetune"], Launch(), total, trainable, mcfg, chunkable)
    assert single["weights"] == 2 * total and single["optimizer state"] == 4 * total
    zero3 = memory_estimate(
        cfg, METHODS["finetune"], Launch(num_processes=8, zero_stage=3), total, trainable, mcfg, chunkable
    )
    assert zero3["weights"] == single["weights"] / 8 and zero3["gradients"] == single["gradients"] / 8
    zero1 = memory_estimate(
        cfg, METHODS["finetune"], Launch(num_processes=8, zero_stage=1), total, trainable, mcfg, chunkable
    )
    assert zero1["weights"] == single["weights"] and zero1["optimizer state"] == single["optimizer state"] / 8

    # LoRA on the output layer: the chunked loss cannot stand in for it, so whole fp32
    # logits (and their gradient) count, 2048 tokens x 128256 x 4 bytes x 2, against a chunk
    # of 2**27 // 128256 positions.
    lora = {}
    for targets in ("[q_proj]", "[q_proj,lm_head]"):
        over = load_config(
            None,
            [
                f"model.name_or_path={tmp_path}",
                "data.train=x",
                "model.dtype=bfloat16",
                "train.micro_batch_size=1",
                "data.max_seq_len=2048",
                "model.lora.enabled=true",
                f"model.lora.target_modules={targets}",
            ],
        )
        counts = count_params(over)
        lora[targets] = (counts[3], memory_estimate(over, METHODS["finetune"], Launch(), *counts)["activations"])
    assert lora["[q_proj]"][0] and not lora["[q_proj,lm_head]"][0]
    assert lora["[q_proj,lm_head]"][1] - lora["[q_proj]"][1] == 2 * (2048 - 2**27 // 128256) * 128256 * 4


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("distributed_type: MULTI_GUP\n", "ValueError: 'MULTI_GUP' is not a valid DistributedType"),
        ("num_processes: [\n", "ParserError: while parsing"),
        ("num_processes: 2\n", "ValueError: A `distributed_type` must be specified"),
    ],
)
def test_an_accelerate_config_that_cannot_be_read_is_one_error(tmp_path, text, why):
    from llmtrain.errors import ConfigError
    from llmtrain.plan import read_launch

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_launch(str(path), load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"]))
    assert e.value.problems[0].startswith(f"--accelerate-config: cannot read {path} ({why}")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("num_processes: " + "[" * 100_000 + "\n", "line 1: is nested more than"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi")
            ),
            "line ",
        ),
        ("x" * (2 << 20), "larger than"),
    ],
)
def test_a_hostile_accelerate_config_is_one_error_before_accelerate_reads_it(tmp_path, text, why):
    """Accelerate's reader has no bounds: a deeply nested file was a RecursionError
    traceback, an alias bomb a memory blow-up. llmtrain reads it first, bounded."""
    from llmtrain.errors import ConfigError
    from llmtrain.plan import read_launch

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_launch(str(path), load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"]))
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"--accelerate-config: {path}")
    assert why in e.value.problems[0] and "\n" not in e.value.problems[0]


def test_help_lists_the_commands_and_recipes_and_succeeds():
    for args in (["--help"], ["plan", "-h"]):
        proc = subprocess.run([LLMTRAIN, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: llmtrain plan")
        for command in ("plan ", "recipes/finetune.py", "recipes/dpo.py", "recipes/grpo.py", "recipes/reward.py"):
            assert command in proc.stdout
        assert "llmtrain.demo score" in proc.stdout and "--recipe finetune|dpo|grpo|reward" in proc.stdout
    for shipped in ("recipes/finetune.py", "recipes/dpo.py", "recipes/grpo.py", "recipes/reward.py"):
        assert (ROOT / shipped).is_file()


@pytest.mark.parametrize("args", [[], ["train"]])
def test_no_command_or_an_unknown_one_is_one_error_line(args):
    proc = subprocess.run([LLMTRAIN, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("error: ") and "`llmtrain --help`" in proc.stderr


def test_plan_counts_quantized_weights_at_their_width(tiny_model):
    base = [f"model.name_or_path={tiny_model}", "data.train=d.jsonl", "model.lora.enabled=true"]
    weights, quantized = {}, {}
    for quant in ("none", "nf4", "int8"):
        cfg = load_config(None, [*base, f"model.quantization={quant}"])
        counts = count_params(cfg)
        total, trainable, _, _, quantized[quant] = counts
        assert (quantized[quant] > 0) == (quant != "none") and quantized[quant] < total - trainable  # output layer
        weights[quant] = memory_estimate(cfg, METHODS["finetune"], Launch(), *counts)["weights"]
    q = quantized["nf4"]
    assert weights["none"] - weights["nf4"] == pytest.approx(q * 3.5)  # fp32 -> half a byte each
    assert weights["none"] - weights["int8"] == pytest.approx(q * 3.0)


def test_plan_checks_the_eval_data_too(base_config, tiny_model, chat_file, cache_env, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"messages": "hi"}\n')
    proc = plan(
        "--config",
        str(base_config),
        f"model.name_or_path={tiny_model}",
        f"data.train={chat_file}",
        f"data.eval={bad}",
        env=cache_env,
    )
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.startswith("error")] == [
        f"error: data.eval: {bad} line 1: 'messages' must be a list of {{role, content}}; data.bad_rows=skip would "
        "drop malformed rows instead"
    ]


def test_a_demo_name_with_a_typo_gets_the_closest_one():
    from llmtrain.errors import UserError

    with pytest.raises(UserError) as e:
        load_config(None, ["model.name_or_path=demo:tiny-lama", "data.train=demo:train"])
    assert str(e.value).startswith(
        "model.name_or_path: demo:tiny-lama is not one of the demo's assets; did you mean demo:tiny-llama? they are "
    )


def test_memory_estimate_of_an_rl_run_counts_each_reward_model(tiny_model, tmp_path):
    """A reward_model: reward is loaded whole on each process, in the dtype it was saved
    in: its weight files' bytes count, once per reward model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from llmtrain.rl.config import GRPOConfig

    scorer = tmp_path / "scorer"
    AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(tiny_model, num_labels=1)
    ).save_pretrained(scorer)
    saved = (scorer / "model.safetensors").stat().st_size
    common = [f"model.name_or_path={tiny_model}", "data.train=x"]
    rewards = f"grpo.rewards=[accuracy, reward_model:{scorer}]"
    cfg = load_config(None, [*common, rewards], schema=GRPOConfig)
    memory = memory_estimate(cfg, METHODS["grpo"], Launch(), *count_params(cfg))
    assert memory[f"reward model {scorer}"] == saved
    without = memory_estimate(
        load_config(None, common, schema=GRPOConfig), METHODS["grpo"], Launch(), *count_params(cfg)
    )
    assert not any(k.startswith("reward model") for k in without)


def test_plan_reads_its_settings_by_the_recipes_rule(capsys, monkeypatch):
    """`llmtrain plan` reads its config through cli.run_config, as the recipes do: with no
    --config it plans the recipe named (or the one the overrides' section names) on its demo
    only while nothing names a model or data; a run of the user's takes no demo's data or
    output_dir, and the notes are the recipe's."""
    from llmtrain.plan import plan, recipe_named

    for name in METHODS:  # each demo is its recipe's config
        assert recipe_named(demo_config(METHODS[name]), []) == name
    assert recipe_named(None, []) == "finetune" and recipe_named(None, ["dpo.beta=0.2"]) == "dpo"
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as e:
        plan(["--recipe", "grpo", "model.name_or_path=org/m"])
    assert e.value.problems == ["data.train: required; a path, a list of paths, or a hub data set name"]
    note = "note: the command line names a model or data of your own (model.name_or_path) and no --config"
    assert capsys.readouterr().out.startswith(note)
    with pytest.raises(ConfigError) as e:
        plan(["--config", "recipes/configs/grpo_demo.yaml", "model.name_or_path=org/m", "data.train=p.jsonl"])
    assert [q.split(":")[0] for q in e.value.problems] == ["data.eval", "output_dir"]
    assert capsys.readouterr().out.startswith("note: recipes/configs/grpo_demo.yaml is a demo config, ")


def test_plan_of_a_demo_whose_model_is_not_trained_yet_trains_nothing(cache_env, tmp_path):
    """The GRPO demo on a fresh cache: plan builds what takes seconds (the base model, the
    prompts), plans the SFT model from the base model it shares config and tokenizer with,
    and says the run trains it first; before, plan trained it (minutes)."""
    cache = tmp_path / "cache"
    proc = plan("--recipe", "grpo", env=dict(cache_env, LLMTRAIN_CACHE=str(cache)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "== demo assets a run builds first ==\n  demo:tiny-llama-sft is not built yet: the run builds it" in proc.stdout
    )
    assert f"name_or_path: {cache / 'demo-v5' / 'tiny-llama'}\n" in proc.stdout
    assert "steps per epoch:" in proc.stdout
    built = sorted(p.name for p in (cache / "demo-v5").iterdir())
    assert built == ["eval.jsonl", "rl-words-eval.jsonl", "rl-words-train.jsonl", "tiny-llama", "train.jsonl"]


def answers_table() -> dict[str, list[tuple[str, str]]]:
    """docs/launching.md's answers to `accelerate config`: each machine's (question, answer)
    pairs in the order asked, the questions it is not asked left out."""
    text = (ROOT / "docs" / "launching.md").read_text()
    lines = ("| question |" + text.split("| question |", 1)[1]).splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]
    rows = rows[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    machines, body = rows[0], rows[2:]
    return {m: [(r[0], r[i]) for r in body if r[i] != "—"] for i, m in enumerate(machines) if i}


def launch_of(monkeypatch, tmp_path, config, use_cpu_env: bool):
    """What plan reads from `config` (an accelerate ClusterConfig), launched with or without
    ACCELERATE_USE_CPU=1."""
    from llmtrain.plan import read_launch

    path = tmp_path / "accelerate.yaml"
    config.to_yaml_file(str(path))
    if use_cpu_env:
        monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    else:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    return read_launch(str(path), load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"]))


def test_the_docs_answers_to_accelerate_config_start_the_processes_they_name(monkeypatch, tmp_path):
    """Each machine's answers in docs/launching.md give a config that starts its processes as
    one group (launched as the docs say: ACCELERATE_USE_CPU=1 for DDP on CPU)."""
    from llmtrain.plan import process_warning

    table = answers_table()
    want = {
        "CPU, one process": ("NO", 1, "no"),
        "CPU, DDP over 2 processes": ("MULTI_GPU", 2, "no"),
        "1 GPU, bf16": ("NO", 1, "bf16"),
        "8 GPUs, DDP, bf16": ("MULTI_GPU", 8, "bf16"),
    }
    assert set(table) == set(want)
    for machine, answers in table.items():
        launch = launch_of(
            monkeypatch, tmp_path, accelerate_config.answer(monkeypatch, answers), machine.startswith("CPU")
        )
        assert (launch.distributed_type, launch.num_processes, launch.mixed_precision) == want[machine], machine
        assert process_warning(launch) is None, machine


def test_a_multi_cpu_config_without_mpirun_is_one_process_in_the_plan(monkeypatch, tmp_path):
    """The issue's answers (multi-CPU, no mpirun, 2 processes): accelerate launch starts one
    process, with or without ACCELERATE_USE_CPU, so the plan says that and names the launch
    that works, not ACCELERATE_USE_CPU=1. With mpirun the processes start."""
    from llmtrain.plan import process_warning

    answers = accelerate_config.MULTI_CPU_ANSWERS
    config = accelerate_config.answer(monkeypatch, answers)
    config.to_yaml_file(str(tmp_path / "written.yaml"))
    assert (tmp_path / "written.yaml").read_text() == accelerate_config.MULTI_CPU_CONFIG  # what the tests launch
    for use_cpu_env in (False, True):
        warning = process_warning(launch_of(monkeypatch, tmp_path, config, use_cpu_env))
        assert warning.startswith(
            "distributed_type MULTI_CPU without mpirun starts ONE process on each machine, not the 2"
        )
        assert "distributed_type: MULTI_GPU with use_cpu: true" in warning and "is not set" not in warning
    at = [q for q, _ in answers].index("Do you want accelerate to launch mpirun?")
    mpirun = [(answers[at][0], "yes"), ("Please enter the path to the hostfile", "hosts")]
    config = accelerate_config.answer(monkeypatch, [*answers[:at], *mpirun, *answers[at + 1 :]])
    assert process_warning(launch_of(monkeypatch, tmp_path, config, False)) is None


def test_the_vision_towers_activations_count_its_patches_and_its_layers_when_it_trains():
    """plan.vision_memory: the patches of an image as each image processor lays them out
    (flattened rows, crops of squares), times the images, the tower's width and 34 bytes a
    value (float32: twice 16-bit's), for one layer when the tower is frozen, for all when it
    trains."""
    import io
    from types import SimpleNamespace

    from PIL import Image

    from llmtrain.plan import image_patches, vision_memory

    assert image_patches(torch.zeros(64, 1176), 14) == 64  # Qwen-VL: a row per patch
    assert image_patches(torch.zeros(1, 3, 336, 336), 14) == 576  # LLaVA: one picture
    assert image_patches(torch.zeros(1, 5, 3, 364, 364), 14) == 5 * 676  # Idefics3: crops
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    pixels = {"pixel_values": torch.zeros(1, 3, 28, 28)}  # one 28x28 picture: 4 patches of 14
    processor = SimpleNamespace(image_processor=lambda images, return_tensors: pixels)
    mcfg = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14, hidden_size=32, num_hidden_layers=3))
    cfg = Config()
    cfg.model.dtype = "float32"
    launch = SimpleNamespace(mixed_precision="no")
    rows = [{"images": [png.getvalue()]}]
    frozen = vision_memory(cfg, launch, mcfg, processor, rows, images=6)
    assert frozen == 6 * 4 * 32 * 34 * 2  # 6 images of 4 patches, one layer, float32
    cfg.model.freeze_vision = False
    assert vision_memory(cfg, launch, mcfg, processor, rows, images=6) == 3 * frozen
    assert vision_memory(cfg, launch, mcfg, processor, [{"images": []}], images=6) == 0.0


@pytest.mark.parametrize("freeze", [True, False])
def test_a_vision_models_trainable_count_is_the_loaded_models(freeze, tmp_path):
    """count_params on the meta model freezes the vision tower as loading does
    (model.freeze_vision), so gradients and optimizer state are counted for what trains."""
    from llmtrain.model import load_model
    from llmtrain.plan import count_params
    from tests.support.vision_models import build, loaded

    model_cfg, _ = loaded(build("llava", tmp_path / "llava"), freeze_vision=freeze)
    cfg = Config()
    cfg.model = model_cfg
    total, trainable, *_ = count_params(cfg)
    model = load_model(model_cfg)
    assert total == sum(p.numel() for p in model.parameters())
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (trainable < total) == freeze
