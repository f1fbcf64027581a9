"""Every architecture in tests/support/architectures.py trains as it infers: packed samples get
the model's own attention pattern (sliding windows, per-layer types) and nothing of each
other, in every backend the model supports on CPU; auto picks a backend the model takes."""

import importlib.util
import json
import math

import pytest
import torch

from llmtrain.attention import choose, layer_types
from llmtrain.config import DataConfig
from llmtrain.core.objective import model_inputs
from llmtrain.data.batches import Collator
from llmtrain.data.packing import PackedDataset
from llmtrain.data.rows import process_row
from llmtrain.demo import make_rows
from tests.support.architectures import ARCHITECTURES, MOE, SLIDING, WINDOW
from tests.support.data import packed_samples, rows_dataset
from tests.support.runs import ROOT, recipe_args


@pytest.fixture(scope="module")
def examples(tokenizer):
    rows = [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(10, seed=11)]
    return rows_dataset(rows, "architecture-examples")


def backends(name):
    return ["eager"] if name in ("gemma2", "gpt_oss") else ["sdpa", "eager"]


@pytest.mark.parametrize(
    "name,attn", [(n, a) for n in ARCHITECTURES for a in backends(n)], ids=lambda x: x if isinstance(x, str) else None
)
def test_packed_logits_equal_each_sample_run_alone(zoo, tokenizer, examples, name, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation=attn).eval()
    assert min(examples["length"]) > WINDOW  # every sample is longer than the window
    packed = PackedDataset(examples, capacity=256)
    assert max(len(b) for b in packed.bins) > 1
    batch = Collator(tokenizer.pad_token_id, pack_width=256)([packed[j] for j in range(len(packed))])
    with torch.no_grad():
        logits = model(**model_inputs(model, batch)).logits
        # A causal mask within each sample that knows no windows (what packing trained before).
        docs = batch["doc_ids"]
        causal = (docs[:, :, None] == docs[:, None, :]) & torch.ones(docs.shape[1], docs.shape[1]).tril().bool()
        causal = (
            causal[:, None]
            if attn == "sdpa"
            else torch.zeros(causal[:, None].shape).masked_fill(~causal[:, None], -1e30)
        )
        causal_only = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=causal
        ).logits
        differs = 0
        for j, span, ids in packed_samples(packed, examples):
            alone = model(input_ids=ids).logits[0]
            torch.testing.assert_close(logits[j, span], alone, atol=2e-5, rtol=1e-5)
            differs += not torch.allclose(causal_only[j, span], alone, atol=1e-4)
    assert (differs > 0) == (name in SLIDING), "the window must matter exactly for the sliding-window models"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_auto_picks_a_backend_the_model_loads_with(zoo, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    mcfg = AutoConfig.from_pretrained(zoo(name))
    cls = type(AutoModelForCausalLM.from_config(mcfg))
    for packing in (True, False):
        attention = choose("auto", cls, mcfg, packing, torch.device("cpu"))
        assert attention.name == ("eager" if name in ("gemma2", "gpt_oss") else "sdpa")
        AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation=attention.name)
    gpu = choose("auto", cls, mcfg, True, torch.device("cuda"))
    assert gpu.name == ("sdpa" if name == "gpt2" else "flex_attention")  # GPT-2 alone has no FlexAttention
    types = layer_types(mcfg)
    assert len(types) == 2 and (set(types) != {"full_attention"}) == (name in SLIDING)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_flex_block_mask_keeps_the_window_on_a_gpu(zoo, tokenizer, examples, name):
    """FlexAttention's BlockMask (what auto takes for packed data on a GPU) against the
    dense mask of the model's other backend, with windows shorter than the samples:
    same logits, same loss and gradients, and each sample's logits as run alone."""
    from transformers import AutoModelForCausalLM

    from llmtrain.core.objective import TokenLoss

    packed = PackedDataset(examples, capacity=256)
    batch = Collator(tokenizer.pad_token_id, pack_width=256)([packed[j] for j in range(len(packed))])
    batch = {k: v.cuda() for k, v in batch.items()}
    results = {}
    for attn in ("flex_attention", backends(name)[0]):
        model = AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation=attn).cuda()
        with torch.no_grad():
            logits = model.eval()(**model_inputs(model, batch)).logits
        loss = TokenLoss()(model.train(), batch).total
        loss.backward()
        grads = {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}
        results[attn] = logits, loss.detach(), grads
    (flex, l_flex, g_flex), (dense, l_dense, g_dense) = results.values()
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l_flex, l_dense, atol=1e-3, rtol=1e-5)
    for key, g in g_dense.items():
        torch.testing.assert_close(g_flex[key], g, atol=1e-4, rtol=1e-3)
    for j, span, ids in packed_samples(packed, examples):
        if j == 0:  # the pack compared above
            with torch.no_grad():
                alone = model.eval()(input_ids=ids.cuda()).logits[0]
            torch.testing.assert_close(flex[0, span], alone, atol=1e-4, rtol=1e-4)


LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
MODES = {
    "full": [],
    "lora": [*LORA, "model.lora.dropout=0.05"],  # with dropout: the experts of MoE models get no adapters
    "lora_experts": LORA,  # MoE models only: without dropout (the default) the fused expert weights too
    "qlora": [*LORA, "model.quantization=nf4"],  # where bitsandbytes is installed; MoE experts too
}
RUNS = [
    (name, mode)
    for name in ARCHITECTURES
    for mode in MODES
    if (mode != "lora_experts" or name in MOE) and (mode != "qlora" or importlib.util.find_spec("bitsandbytes"))
]


@pytest.fixture(scope="module")
def trained(zoo, base_config, chat_file, cache_env, tmp_path_factory):
    """(architecture, mode) -> its output_dir, after a packed run of 2 steps of each, all
    in one process (tests/support/arch_runs.py)."""
    import json
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("arch-runs")
    runs = {
        f"{name}-{mode}": recipe_args(
            base_config,
            zoo(name),
            chat_file,
            root / f"{name}-{mode}",
            "data.packing=true",
            "train.max_steps=2",
            "train.micro_batch_size=2",
            "checkpoint.every_steps=0",
            *extra,
        )
        for name, mode in RUNS
        for extra in [MODES[mode]]
    }
    (root / "runs.json").write_text(json.dumps(runs))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "arch_runs.py"), str(root / "runs.json")],
        env=cache_env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {tuple(key.rsplit("-", 1)): (root / key, outcome) for key, outcome in results.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", RUNS, ids=[f"{n}-{m}" for n, m in RUNS])
def test_a_packed_run_trains_and_exports_a_model_transformers_generates_from(trained, tokenizer, name, mode):
    from transformers import AutoModelForCausalLM

    out, outcome = trained[name, mode]
    assert outcome == "ok", outcome
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    lora = mode != "full"
    assert (out / "final" / ("adapter_config.json" if lora else "config.json")).is_file()
    if lora:  # the adapters sit where all-linear puts them: never the router, the experts only without dropout
        adapted = json.loads((out / "final" / "adapter_config.json").read_text())
        assert "gate" not in adapted["target_modules"] and "router" not in adapted["target_modules"]
        experts = mode == "lora_experts" or (mode == "qlora" and name in MOE)
        assert bool(adapted["target_parameters"]) == experts, adapted["target_parameters"]
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()  # a LoRA final/ loads through peft
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    new = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert len(new) >= 1
