import pytest
import torch

from llmtrain.data.batches import Collator
from llmtrain.observe.throughput import PEAK_BF16, device_peak_flops, document_sizes, matmul_params, step_flops
from tests.support.runs import recipe_args, run_recipe, train_rows


def test_document_sizes_count_each_packed_document_and_skip_padding():
    collate = Collator(pad_id=0)
    packed = collate(
        [
            {"input_ids": [1] * 5, "labels": [1] * 5, "position_ids": [0, 1, 2, 0, 1], "doc_ids": [0, 0, 0, 1, 1]},
            {"input_ids": [1] * 2, "labels": [1] * 2, "position_ids": [0, 1], "doc_ids": [0, 0]},
        ]
    )
    assert document_sizes(packed) == (3 + 2 + 2, 9 + 4 + 4)
    padded = collate([{"input_ids": [1] * 4, "labels": [1] * 4}, {"input_ids": [1], "labels": [1]}])
    assert document_sizes(padded) == (5, 17)


def test_step_flops_formula():
    # two documents of 3 and 2 tokens, N=10 matmul parameters, 2 layers of width 4
    assert step_flops(5, 13, n_params=10, layers=2, hidden=4) == 6 * 10 * 5 + 12 * 2 * 4 * 13
    # the chunked loss runs a 3-parameter output layer on the 2 trained tokens only
    assert (
        step_flops(5, 13, n_params=10, layers=2, hidden=4, head_params=3, head_tokens=2)
        == 6 * 7 * 5 + 6 * 3 * 2 + 12 * 2 * 4 * 13
    )


def test_matmul_params_count_the_head_once(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)  # tied embeddings
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == total
    model.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(model.config)
    emb = untied.get_input_embeddings().weight.numel()
    assert matmul_params(untied) == sum(p.numel() for p in untied.parameters()) - emb


def test_peak_table_matches_the_most_specific_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert device_peak_flops(torch.device("cuda", 0)) == PEAK_BF16["H100 NVL"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(torch.device("cuda", 0)) == PEAK_BF16["H100"]
    assert device_peak_flops(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_reports_mfu(common_args, cache_env, tmp_path):
    out = tmp_path / "gpu"
    run_recipe(common_args(out) + ["train.max_steps=5", "data.packing=true"], cache_env)
    rows = train_rows(out)
    assert all(0 < r["mfu"] < 1 and r["peak_mem_gib"] > 0 for r in rows)


@pytest.fixture
def common_args(base_config, tiny_model, chat_file):
    def args(out):
        return recipe_args(base_config, tiny_model, chat_file, out)

    return args
