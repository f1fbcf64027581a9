"""recipes/finetune.py on tiny vision-language models (tests/support/vision_models.py) and
chat rows with images, launched as a user launches it: each family trains with its vision
tower frozen and exports a final/ (model and processor) that plain transformers loads and
asks about an image; LoRA trains adapters in the language model only and exports merged; the
step is the same on one process and two (the loss weighted over the global batch); a run
stopped after a checkpoint resumes to the same weights; careless rows are one line each.
Every family's rows and one training step without a launch: tests/test_vision.py."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from llmtrain.processor import load_processor
from tests.rl.test_environments import GAMES
from tests.rl.test_images import QWEN_VL_TOOLS
from tests.support.runs import (
    DPO_RECIPE,
    ROOT,
    assert_same_rounds,
    assert_same_weights,
    check_card,
    launch,
    recipe_args,
    rewind,
    run_recipe,
    train_rows,
)
from tests.support.vision_models import COLOURS, build_all

pytestmark = pytest.mark.slow

# Rows without an image among those with: a micro-batch of such rows alone runs no vision tower
# unless processor.vision_in_every_forward makes it (ZeRO-3 and FSDP2 need every process to).
TEXT_ONLY = (5, 6, 11, 14)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """16 rows asking the colour of a square (images in a folder beside the data file, named
    relative to it), some through the `images` column's placeholders, and rows without an
    image among them (TEXT_ONLY, and one at the end)."""
    root = tmp_path_factory.mktemp("colours")
    (root / "img").mkdir()
    names = sorted(COLOURS)
    lines = []
    for i in range(16):
        colour = names[i % 3]
        Image.new("RGB", (32 + 8 * (i % 2), 32), COLOURS[colour]).save(root / "img" / f"{i}.png")
        image = {"type": "image", "image": f"img/{i}.png"} if i % 4 else {"type": "image"}
        row = {
            "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "what colour?"}]},
                {"role": "assistant", "content": colour},
            ]
        }
        if not i % 4:
            row["images"] = [f"img/{i}.png"]
        if i in TEXT_ONLY:
            row = {
                "messages": [
                    {"role": "user", "content": "no picture: what colour?"},
                    {"role": "assistant", "content": "none"},
                ]
            }
        lines.append(row)
    lines.append({"messages": [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "none"}]})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root / "train.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_all(tmp_path_factory.mktemp("vlms"), ("qwen2_5_vl", "gemma3", "llava", "idefics3"))


RUN = ["train.max_steps=4", "train.micro_batch_size=4", "data.max_seq_len=160", "log.every_steps=1"]


def ask(final: Path, image: Path) -> str:
    """final/ loaded by transformers (the processor as AutoProcessor, or without its video
    processor where torchvision is missing: llmtrain.vision.load_processor) answering a
    question about `image`."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(str(final))
    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.parametrize(("family", "packing"), [("qwen2_5_vl", False), ("gemma3", True), ("llava", True)])
def test_each_family_trains_with_its_vision_tower_frozen_and_exports_what_transformers_loads(
    family, packing, models, rows, base_config, cache_env, tmp_path, request
):
    if family == "qwen2_5_vl":  # the unpacked run the layout tests below compare with: trained once
        out = request.getfixturevalue("one_process")
    else:
        out = tmp_path / "run"
        run = [*RUN, f"data.packing={str(packing).lower()}"]
        proc = run_recipe(recipe_args(base_config, models[family], rows, out, *run), cache_env)
        assert "17/17 rows kept" in proc.stdout and ("packed 17 rows into" in proc.stdout) == packing
    losses = [r["loss"] for r in train_rows(out)]
    assert len(losses) == 4 and all(loss == loss for loss in losses)
    before, after = load_file(models[family] / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    vision = {k for k in before if any(v in k for v in ("visual", "vision", "projector"))}
    assert vision and not changed & vision and changed  # the language model trained, the rest as it was
    assert (out / "final" / "processor_config.json").is_file() and (out / "final" / "chat_template.jinja").is_file()
    ask(out / "final", rows.parent / "img" / "1.png")
    assert check_card(out / "final", ["sft", "vision-language"], "AutoModelForImageTextToText")["pipeline_tag"] == (
        "image-text-to-text"
    )


@pytest.mark.parametrize(("family", "packing"), [("qwen2_5_vl", True), ("idefics3", True)])
def test_lora_adapts_the_language_model_alone_and_exports_merged(
    family, packing, models, rows, base_config, cache_env, tmp_path
):
    out = tmp_path / "lora"
    lora = ["model.lora.enabled=true", "export.merge_lora=true", f"data.packing={str(packing).lower()}"]
    run_recipe(recipe_args(base_config, models[family], rows, out, *RUN, *lora), cache_env)
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    inside = "text_model" if family == "idefics3" else "language_model"
    assert adapter and all(inside in k for k in adapter)
    ask(out / "final", rows.parent / "img" / "2.png")


@pytest.fixture(scope="module")
def one_process(models, rows, base_config, cache_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    run = [*RUN, "checkpoint.every_steps=2"]
    run_recipe(recipe_args(base_config, models["qwen2_5_vl"], rows, out, *run), cache_env)
    return out


def test_two_processes_take_the_same_steps_as_one(models, rows, base_config, cache_env, one_process, tmp_path):
    """Qwen2.5-VL (positions in three dimensions for image tokens): 2 processes x micro-batch
    1 x 2 accumulated give the losses and weights of one process with micro-batch 4."""
    out = tmp_path / "two"
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "checkpoint.every_steps=2"]
    run = [r for r in RUN if not r.startswith("train.micro_batch_size")]
    run_recipe(recipe_args(base_config, models["qwen2_5_vl"], rows, out, *run, *layout), cache_env, nproc=2)
    want = [r["loss"] for r in train_rows(one_process)]
    assert [r["loss"] for r in train_rows(out)] == pytest.approx(want, rel=1e-5)
    assert_same_weights(out, one_process, "2 processes")


def test_a_trained_llava_tower_takes_the_same_steps_on_two_processes(models, rows, base_config, cache_env, tmp_path):
    """LLaVA reads an inner layer's image features, so its tower's post_layernorm feeds no
    forward: with the tower trained (model.freeze_vision=false), DDP must not wait for its
    gradients (it failed at the second step), and 2 processes take the steps of one."""
    run = [r for r in RUN if not r.startswith("train.micro_batch_size")] + ["model.freeze_vision=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(recipe_args(base_config, models["llava"], rows, one, *run, "train.micro_batch_size=4"), cache_env)
    run_recipe(
        recipe_args(base_config, models["llava"], rows, two, *run, "train.micro_batch_size=2"), cache_env, nproc=2
    )
    assert [r["loss"] for r in train_rows(two)] == pytest.approx([r["loss"] for r in train_rows(one)], rel=1e-5)
    assert len(train_rows(one)) >= 2  # the second step is where DDP failed
    assert_same_weights(two, one, "2 processes")


@pytest.mark.parametrize("topology", ["ds_zero3", "fsdp2"])
def test_sharded_runs_take_the_same_steps_and_export_the_same_model(
    models, rows, base_config, cache_env, one_process, tmp_path, topology
):
    """ZeRO-3 and FSDP2 (the vision tower's blocks wrapped as the language model's, frozen):
    the steps of one process, and a final/ that loads to the same weights. One row per
    micro-batch, so that a process meets a row without an image while the other meets one
    (processor.vision_in_every_forward keeps their layers in step)."""
    from transformers import AutoModelForImageTextToText

    if topology.startswith("ds_"):
        pytest.importorskip("deepspeed")
    out = tmp_path / topology
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "checkpoint.every_steps=2"]
    run = [r for r in RUN if not r.startswith("train.micro_batch_size")]
    launch(recipe_args(base_config, models["qwen2_5_vl"], rows, out, *run, *layout), cache_env, topology)
    want = [r["loss"] for r in train_rows(one_process)]
    assert [r["loss"] for r in train_rows(out)] == pytest.approx(want, rel=1e-5)
    got = AutoModelForImageTextToText.from_pretrained(out / "final").state_dict()
    for key, value in AutoModelForImageTextToText.from_pretrained(one_process / "final").state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert (out / "final" / "processor_config.json").is_file()


def test_a_run_stopped_after_a_checkpoint_resumes_to_the_same_weights(
    models, rows, base_config, cache_env, one_process, tmp_path
):
    out = tmp_path / "resumed"
    rewind(out, 2, source=one_process)
    run = [*RUN, "checkpoint.every_steps=2", "checkpoint.resume=auto"]
    proc = run_recipe(recipe_args(base_config, models["qwen2_5_vl"], rows, out, *run), cache_env)
    assert "resumed from" in proc.stdout
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(one_process)]
    for key, value in load_file(one_process / "final" / "model.safetensors").items():
        torch.testing.assert_close(load_file(out / "final" / "model.safetensors")[key], value, rtol=0, atol=0)


def test_a_checkpoint_of_one_process_resumes_on_two(models, rows, base_config, cache_env, one_process, tmp_path):
    """The run of one process with micro-batch 4, stopped after its step-2 checkpoint and
    resumed on 2 processes x micro-batch 1 x 2 accumulated: the steps of the run it continues."""
    out = tmp_path / "relaid"
    rewind(out, 2, source=one_process)
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "checkpoint.every_steps=2"]
    run = [r for r in RUN if not r.startswith("train.micro_batch_size")]
    args = recipe_args(base_config, models["qwen2_5_vl"], rows, out, *run, *layout, "checkpoint.resume=auto")
    proc = run_recipe(args, cache_env, nproc=2)
    assert "resuming a run of 1 process(es) x 4 x 1 as 2 process(es) x 1 x 2" in proc.stdout
    want = [r["loss"] for r in train_rows(one_process)]
    assert [r["loss"] for r in train_rows(out)] == pytest.approx(want, rel=1e-5)
    assert_same_weights(out, one_process, "resumed on 2 processes")


def test_packed_qwen_rows_take_the_same_steps_on_two_processes(models, rows, base_config, cache_env, tmp_path):
    """Packed Qwen2.5-VL sequences (each sample with its own three-dimensional positions):
    2 processes x 1 sequence give the losses and weights of 1 process x 2 sequences."""
    run = [r for r in RUN if not r.startswith("train.micro_batch_size")] + ["data.packing=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(recipe_args(base_config, models["qwen2_5_vl"], rows, one, *run, "train.micro_batch_size=2"), cache_env)
    args = recipe_args(base_config, models["qwen2_5_vl"], rows, two, *run, "train.micro_batch_size=1")
    run_recipe(args, cache_env, nproc=2)
    assert [r["loss"] for r in train_rows(two)] == pytest.approx([r["loss"] for r in train_rows(one)], rel=1e-5)
    assert_same_weights(two, one, "packed, 2 processes")


def test_careless_rows_and_settings_are_one_line_each(models, rows, base_config, cache_env, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(rows.parent, bad)
    (bad / "img" / "3.png").write_bytes((bad / "img" / "3.png").read_bytes()[:40])  # truncated
    model = models["llava"]

    def error(data, *extra, model=model) -> str:
        proc = run_recipe(recipe_args(base_config, model, data, tmp_path / "out", *RUN, *extra), cache_env, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, proc.stderr[-3000:]
        return lines[0]

    assert "train.jsonl line 4: an image cannot be decoded" in error(bad / "train.jsonl")
    (bad / "img" / "3.png").unlink()
    assert "train.jsonl line 4: image 'img/3.png': no such file" in error(bad / "train.jsonl")
    assert "over data.max_image_pixels=100" in error(rows, "data.max_image_pixels=100")


def test_plan_counts_the_images_and_their_tokens(models, rows, base_config, cache_env):
    import os
    import sys

    from tests.support.runs import run_python

    llmtrain = str(Path(sys.executable).parent / "llmtrain")
    args = recipe_args(base_config, models["llava"], rows, "unused", *RUN)
    proc = run_python([sys.executable, llmtrain, "plan", *args], dict(os.environ) | cache_env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 12 of the 17 rows hold one image each (not TEXT_ONLY's, nor the last); LLaVA's tiny tower
    # makes 16 tokens of each
    assert (
        "images: 12 in the first 17 rows (12 rows hold any, at most 1 a row); image tokens per such row: mean 16"
        in (proc.stdout)
    )
    assert "  vision tower activations: " in proc.stdout


@pytest.fixture(scope="module")
def pairs(rows) -> Path:
    """Preference pairs about the same pictures (the right colour chosen, another rejected),
    and as KTO rows, beside the chat rows; some without a picture."""
    names = sorted(COLOURS)
    lines = []
    for i in range(12):
        colour, other = names[i % 3], names[(i + 1) % 3]
        shown = [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "what colour?"}]
        prompt = [{"role": "user", "content": shown}]
        lines.append({"prompt": prompt if i not in TEXT_ONLY else "no picture", "chosen": colour, "rejected": other})
    (rows.parent / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    unpaired = [
        {"prompt": p["prompt"], "completion": p["chosen"] if i % 2 else p["rejected"], "label": bool(i % 2)}
        for i, p in enumerate(lines)
    ]
    (rows.parent / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    return rows.parent / "pairs.jsonl"


@pytest.mark.parametrize(("loss", "topology"), [("kto", "ds_zero3")])
def test_preference_rows_with_images_take_the_same_steps_sharded_as_on_one_process(
    models, pairs, base_config, cache_env, tmp_path, loss, topology
):
    """recipes/dpo.py on pairs (and KTO rows) whose prompts show pictures, some without: 2
    processes under ZeRO-3 (FSDP2 for KTO) x 1 row take the steps of 1 process x 2 rows, and
    final/ holds the processor."""
    if topology.startswith("ds_"):
        pytest.importorskip("deepspeed")
    data = pairs if loss != "kto" else pairs.parent / "unpaired.jsonl"
    run = ["train.max_steps=3", "log.every_steps=1", f"dpo.loss={loss}"]
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    args = recipe_args(base_config, models["qwen2_5_vl"], data, one, *run, "train.micro_batch_size=2")
    proc = run_recipe(args, cache_env, recipe=DPO_RECIPE)
    assert "12/12" in proc.stdout
    args = recipe_args(base_config, models["qwen2_5_vl"], data, sharded, *run, "train.micro_batch_size=1")
    launch(args, cache_env, topology, recipe=DPO_RECIPE)
    want = [r["loss"] for r in train_rows(one)]
    assert len(want) == 3 and [r["loss"] for r in train_rows(sharded)] == pytest.approx(want, rel=1e-5)
    assert (sharded / "final" / "processor_config.json").is_file()


@pytest.mark.parametrize(("topology", "turns"), [("ds_zero3", "one"), ("fsdp2", "episodes")])
def test_grpo_prompts_with_images_take_the_same_rounds_sharded_as_on_one_process(
    models, pairs, base_config, cache_env, tmp_path, topology, turns
):
    """recipes/grpo.py on prompts that show pictures, and some that do not: the completions
    (sampled from the prompt with its image), rewards and update of one process, also on
    two under ZeRO-3, whose processes generate together; a KL term to the starting weights
    and two steps per round put every log-prob pass in play. As episodes (here under FSDP2,
    whose generate call encodes the images outside the model's forward), the prompts render
    an environment's tools, and its reset text joins each prompt rendered again with its
    image (tests/rl/test_images.py plays later turns)."""
    pytest.importorskip("deepspeed")
    prompts = [
        {"prompt": json.loads(line)["prompt"], "answer": json.loads(line)["chosen"], "secret": 3}
        for line in pairs.read_text().splitlines()
    ]
    data = pairs.parent / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def even(prompts, completions, completion_ids, **kwargs):\n"
        "    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]\n"
    )
    run = [
        "train.max_steps=2",
        "log.every_steps=1",
        "grpo.num_generations=2",
        "grpo.max_completion_length=6",
        "grpo.num_iterations=2",
        "grpo.beta=0.1",
        f"grpo.rewards=[{rewards}:even]",
    ]
    if turns == "episodes":
        (tmp_path / "games.py").write_text(GAMES)
        (tmp_path / "tools.jinja").write_text(QWEN_VL_TOOLS)
        run += [
            f"grpo.environment=[{tmp_path / 'games.py'}:GuessingGame]",
            f"data.chat_template={tmp_path / 'tools.jinja'}",
        ]
        run += ["grpo.max_turns=2", "grpo.max_completion_length=40"]
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    recipe = ROOT / "recipes" / "grpo.py"
    model = models["qwen2_5_vl"]
    run_recipe(recipe_args(base_config, model, data, one, *run, "train.micro_batch_size=2"), cache_env, recipe=recipe)
    args = recipe_args(base_config, model, data, sharded, *run, "train.micro_batch_size=1")
    launch(args, cache_env, topology, recipe=recipe)
    same = ["reward", "reward_even", "completion_len", "completion_len_max"]
    assert_same_rounds(sharded, one, topology, same, weights=False)
    assert (sharded / "final" / "processor_config.json").is_file()


def teacher_with_another_tower(student: Path, out: Path) -> Path:
    """`student` saved to `out` with its vision tower and projector drawn at random."""
    from transformers import AutoModelForImageTextToText

    from llmtrain.processor import save_processor, vision_parts

    teacher = AutoModelForImageTextToText.from_pretrained(student)
    torch.manual_seed(1)
    for _, part in vision_parts(teacher):
        for p in part.parameters():
            p.data.normal_(0, 0.2)
    teacher.save_pretrained(out)
    save_processor(load_processor(str(student)), out)
    return out


def test_offline_distillation_shows_both_models_the_images(models, rows, base_config, cache_env, tmp_path):
    """recipes/distill.py on rows with images, from a teacher that is the student with
    another vision tower: their logits differ only if both see the pictures, so a step's
    divergence is above zero only if the batches carry them (text-only rows would give 0)."""
    student, teacher = models["llava"], teacher_with_another_tower(models["llava"], tmp_path / "teacher")
    out = tmp_path / "run"
    args = recipe_args(base_config, student, rows, out, *RUN, f"distill.teacher={teacher}")
    run_recipe(
        [*args, "distill.on_policy_fraction=0", "train.max_steps=2"], cache_env, recipe=ROOT / "recipes" / "distill.py"
    )
    losses = [r["loss"] for r in train_rows(out)]
    assert len(losses) == 2 and all(loss > 1e-4 for loss in losses), losses


def test_on_policy_distillation_samples_and_scores_with_the_images(models, rows, base_config, cache_env, tmp_path):
    """The student answers each row with its picture in view, and both models score the
    answer with it: a teacher that differs from the student only in its vision tower gives
    a divergence above zero, which text-only batches would make 0."""
    student, teacher = models["llava"], teacher_with_another_tower(models["llava"], tmp_path / "teacher")
    out = tmp_path / "run"
    args = recipe_args(base_config, student, rows, out, *RUN, f"distill.teacher={teacher}")
    extra = ["distill.on_policy_fraction=1", "distill.max_completion_length=4", "train.max_steps=2"]
    run_recipe([*args, *extra], cache_env, recipe=ROOT / "recipes" / "distill.py")
    losses = [r["loss"] for r in train_rows(out)]
    assert len(losses) == 2 and all(loss > 1e-4 for loss in losses), losses
