"""final/ as save_pretrained lays it out, in shards of at most export.max_shard_size, written
shard by shard when the model is sharded over processes; a full disk while exporting, or
while writing metrics, loses nothing it need not. (Under FSDP2 and ZeRO-3 with several
processes: tests/launch/test_fsdp.py and tests/launch/test_deepspeed.py.)"""

import json
import weakref
from types import SimpleNamespace

import pytest
import torch

from llmtrain.config import ExportConfig, load_config
from llmtrain.distributed.topology import Topology
from llmtrain.errors import CheckpointError, UserError
from llmtrain.output import export
from llmtrain.output.export import save_final
from tests.support.runs import final_weights


def fake_accelerator(model):
    return SimpleNamespace(
        is_main_process=True,
        distributed_type="NO",
        mixed_precision="no",
        unwrap_model=lambda m: m,
        wait_for_everyone=lambda: None,
    )


@pytest.fixture
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model)


@pytest.fixture
def as_if_sharded(monkeypatch):
    """Take the path of a model sharded over processes (write_weights) in this one process,
    where each gathered weight is the parameter itself."""
    pretend_sharded(monkeypatch)


def pretend_sharded(monkeypatch):
    """Export as under FSDP2 (each process holding a shard), whatever the accelerator."""
    fsdp = Topology(deepspeed=False, zero_stage=None, fsdp=True, mixed_precision="no")
    monkeypatch.setattr(export, "Topology", SimpleNamespace(of=lambda accelerator: fsdp))


SHARD = 100_000  # bytes; the tiny model's 461 KB of weights make 5 shards


@pytest.mark.parametrize("sharded", [False, True], ids=["save_pretrained", "shard_by_shard"])
def test_a_model_bigger_than_max_shard_size_is_written_in_shards_with_an_index(
    model, tokenizer, tmp_path, monkeypatch, sharded
):
    from transformers import AutoModelForCausalLM

    if sharded:
        pretend_sharded(monkeypatch)
    want = tmp_path / "save_pretrained"
    model.save_pretrained(want, max_shard_size=SHARD)
    final = save_final(
        fake_accelerator(model), model, tokenizer, str(tmp_path), "", ExportConfig(max_shard_size=SHARD), {"step": 1}
    )
    index = json.loads((final / "model.safetensors.index.json").read_text())
    files = sorted(final.glob("model-*.safetensors"))
    assert [f.name for f in files] == [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert index["metadata"] == json.loads((want / "model.safetensors.index.json").read_text())["metadata"]
    assert not (final / "model.safetensors").exists()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    for f in files:  # a shard exceeds the limit only when one weight alone does
        assert f.stat().st_size <= max(SHARD, largest) + 4096  # + the safetensors header
    got, expected = final_weights(final), final_weights(want)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert (final / "config.json").read_text() == (want / "config.json").read_text()
    assert (final / "generation_config.json").read_text() == (want / "generation_config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_model_within_max_shard_size_is_one_file(model, tokenizer, tmp_path, as_if_sharded):
    final = save_final(fake_accelerator(model), model, tokenizer, str(tmp_path), "", ExportConfig(), {"step": 1})
    assert sorted(f.name for f in final.glob("model*")) == ["model.safetensors"]
    assert final_weights(final).keys() == final_weights(tmp_path / "final").keys()


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("base_cache", [True, False])
def test_the_exported_model_keeps_the_base_models_cache_setting(
    model, tokenizer, tiny_model, tmp_path, monkeypatch, sharded, base_cache
):
    """Training turns use_cache off; final/ is for inference, with the base's own setting."""
    from transformers import AutoModelForCausalLM

    from llmtrain.config import ModelConfig

    base = tmp_path / "base"
    model.config.use_cache = base_cache
    model.save_pretrained(base)
    if sharded:
        pretend_sharded(monkeypatch)
    model.config.use_cache = False  # as model.load_model leaves it
    out = tmp_path / "out"
    out.mkdir()
    final = save_final(
        fake_accelerator(model), model, tokenizer, str(out), "", ExportConfig(), {"step": 1}, ModelConfig(str(base))
    )
    assert json.loads((final / "config.json").read_text())["use_cache"] is base_cache
    again = AutoModelForCausalLM.from_pretrained(final)
    assert (again(input_ids=torch.tensor([[3, 4, 5]])).past_key_values is not None) is base_cache


@pytest.mark.parametrize("sharded", [False, True])
def test_a_base_model_ending_turns_otherwise_than_sequences_stops_at_the_end_of_turn(
    model, tokenizer, tmp_path, monkeypatch, sharded
):
    """A base model whose end of sequence is not the chat template's end of turn (Llama 3's
    <|end_of_text|> and <|eot_id|>): tuned on the template it ends answers with the end of
    turn, so final/'s generation config lists it, and the samples stop there too."""
    import copy

    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmtrain.data.rows import end_of_turn_ids, stop_ids

    if sharded:
        pretend_sharded(monkeypatch)
    base = copy.deepcopy(tokenizer)
    base.eos_token = "<unk>"  # a base model's own end of sequence
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(base) == [end_of_turn] and base.eos_token_id != end_of_turn
    model.generation_config = GenerationConfig(eos_token_id=base.eos_token_id)
    final = save_final(fake_accelerator(model), model, base, str(tmp_path), "", ExportConfig(), {"step": 1})
    saved = AutoModelForCausalLM.from_pretrained(final).generation_config
    assert saved.eos_token_id == [base.eos_token_id, end_of_turn]
    assert stop_ids(saved, base) == sorted([base.eos_token_id, end_of_turn])
    assert end_of_turn_ids(copy.deepcopy(base)) == [end_of_turn]
    plain = copy.deepcopy(base)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # nothing after an answer
    assert end_of_turn_ids(plain) == []
    needs_system = copy.deepcopy(base)
    needs_system.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    assert end_of_turn_ids(needs_system) == [end_of_turn]


def test_shard_by_shard_export_holds_one_shard_at_a_time(model, tokenizer, tmp_path, monkeypatch, as_if_sharded):
    """Every gathered weight is freed once its shard is written: the bytes alive at once
    never exceed one shard (or one weight larger than a shard)."""
    gather = export.gathered
    alive, peak = [0], [0]

    def counted(tensor, main):
        copy = gather(tensor, main).clone()  # what a gather from other processes returns: a new tensor
        size = copy.numel() * copy.element_size()
        alive[0] += size
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(copy, lambda: alive.__setitem__(0, alive[0] - size))
        return copy

    monkeypatch.setattr(export, "gathered", counted)
    save_final(
        fake_accelerator(model), model, tokenizer, str(tmp_path), "", ExportConfig(max_shard_size=SHARD), {"step": 1}
    )
    total = json.loads((tmp_path / "final" / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert alive[0] == 0 and 0 < peak[0] <= SHARD < total


@pytest.mark.parametrize("value", ["5GB", "500MB", "1.5GB", 1000])
def test_max_shard_size_takes_bytes_or_a_size_with_a_unit(base_config, value):
    cfg = load_config(base_config, ["model.name_or_path=m", "data.train=t.jsonl", f"export.max_shard_size={value}"])
    assert cfg.export.shard_bytes() == {"5GB": 5 * 10**9, "500MB": 5 * 10**8, "1.5GB": 15 * 10**8}.get(value, value)


@pytest.mark.parametrize("value", ["5GiB", "lots", "0", "-1MB"])
def test_a_max_shard_size_that_is_not_a_size_is_one_error_naming_the_key(base_config, value):
    with pytest.raises(UserError) as e:
        load_config(base_config, ["model.name_or_path=m", "data.train=t.jsonl", f"export.max_shard_size={value}"])
    assert str(e.value).splitlines() == [
        f"export.max_shard_size: {value} is not a positive size; give bytes or a number with KB, MB, GB "
        "or TB, such as 5GB"
    ]


def test_a_full_disk_between_shards_stops_the_export_and_keeps_the_checkpoint(
    model, tokenizer, tmp_path, monkeypatch, as_if_sharded
):
    from safetensors.torch import save_file

    from tests.output.test_checkpoint import fake_checkpoint

    written = []

    def fills_up(tensors, filename, metadata=None):
        if written:
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename, metadata=metadata)
        written.append(filename)

    monkeypatch.setattr("safetensors.torch.save_file", fills_up)
    fake_checkpoint(tmp_path, "step-8")
    with pytest.raises(CheckpointError) as e:
        save_final(
            fake_accelerator(model),
            model,
            tokenizer,
            str(tmp_path),
            "",
            ExportConfig(max_shard_size=SHARD),
            {"step": 8},
        )
    assert len(written) == 1 and "No space left" in str(e.value)
    assert f"the newest checkpoint, {tmp_path}/checkpoints/step-8, is intact" in str(e.value)
    assert not (tmp_path / ".tmp-final").exists() and not (tmp_path / "final").exists()


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_a_full_disk_while_exporting_is_one_error_saying_what_is_kept(
    model, tokenizer, tmp_path, monkeypatch, with_checkpoint
):
    from tests.output.test_checkpoint import fake_checkpoint

    def full(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", full)
    if with_checkpoint:
        fake_checkpoint(tmp_path, "step-8")
    with pytest.raises(CheckpointError) as e:
        save_final(fake_accelerator(model), model, tokenizer, str(tmp_path), "", ExportConfig(), {"step": 8})
    message = str(e.value)
    assert message.startswith(f"export: writing {tmp_path}/.tmp-final failed (No space left: Exception: Error while")
    if with_checkpoint:
        assert f"the newest checkpoint, {tmp_path}/checkpoints/step-8, is intact" in message
    else:
        assert message.endswith("no checkpoint holds the run (checkpoint.every_steps, checkpoint.every_minutes)")
    assert not (tmp_path / ".tmp-final").exists() and not (tmp_path / "final").exists()


def test_a_full_disk_before_the_export_starts_is_the_same_one_error(model, tokenizer, tmp_path, monkeypatch):
    """The export's directory cannot even be made: the main process says so to every
    process before any of them gathers a weight, not a traceback on one of them."""
    import errno

    from llmtrain import safefs

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safefs, "fresh_dir", full)
    with pytest.raises(CheckpointError) as e:
        save_final(fake_accelerator(model), model, tokenizer, str(tmp_path), "", ExportConfig(), {"step": 8})
    assert str(e.value) == (
        f"export: writing {tmp_path}/.tmp-final failed (No space left on device); "
        "no checkpoint holds the run (checkpoint.every_steps, checkpoint.every_minutes)"
    )


def test_metrics_that_cannot_be_written_do_not_stop_training(tmp_path, capsys):
    from llmtrain.observe.metrics import MetricsLog

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, log=lambda *a, **k: None)
    log = MetricsLog(accelerator, str(tmp_path), None)
    log.path.unlink()
    log.path.mkdir()  # any write now fails with an OSError, as on a full disk
    log.log({"step": 1, "loss": 1.0})
    log.log({"step": 2, "loss": 0.9})
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "metrics.jsonl: cannot write (Is a directory); training goes on" in warnings[0]


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, tiny_model):
    """The tiny Llama as a model that brings its own code (config.json's auto_map), which
    transformers loads only with trust_remote_code."""
    import shutil

    root = tmp_path_factory.mktemp("remote") / "tiny-remote"
    shutil.copytree(tiny_model, root)
    (root / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_remote'\n"
    )
    (root / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    config = json.loads((root / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        auto_map={
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    )
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_a_model_loaded_again_after_training_is_loaded_as_training_loaded_it(
    remote_code_model, tokenizer, tmp_path, as_if_sharded, merge
):
    """A sharded or quantized LoRA run merges by loading the base again, and a sharded
    run samples from final/ loaded back: both with model.trust_remote_code (and
    model.revision) as training had them. They used to load the base with neither, so a
    model with its own code failed its export on every rerun."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.config import ModelConfig

    base = ModelConfig(name_or_path=str(remote_code_model), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(remote_code_model, trust_remote_code=True)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    want = model(ids).logits
    accelerator = fake_accelerator(model)
    accelerator.device = torch.device("cpu")
    final = save_final(
        accelerator, model, tokenizer, str(tmp_path), "", ExportConfig(merge_lora=merge), {"step": 1}, base
    )
    if merge:
        merged = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
        torch.testing.assert_close(merged(ids).logits, want)
        assert not any("lora" in name for name in final_weights(final))
    else:
        loaded = export.model_for_sampling(accelerator, model, final, base)
        torch.testing.assert_close(loaded(ids).logits, want)


def tied_llama(tokenizer, layers: int):
    """A tiny random Llama whose input and output embeddings share one tensor."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("reload", [False, True])  # the in-memory copy; the base loaded again (sharded, 4-bit)
@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_a_merged_adapter_on_a_tied_embedding_changes_that_layer_alone(tokenizer, tmp_path, target, reload):
    """Input and output embeddings that share one tensor (tie_word_embeddings): an adapter on
    either, merged, must change that layer only, and final/ must load as it was merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.config import ModelConfig

    torch.manual_seed(0)
    base = tied_llama(tokenizer, layers=1)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", target], lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_" in name:  # a trained adapter: peft starts lora_B at zero
            torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        if reload:
            merged = export._merged_from_adapter(model, tmp_path / "adapter", ModelConfig(str(tmp_path / "base")))
        else:
            merged = export._merged_copy(model)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        merged.save_pretrained(tmp_path / "final")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert again.lm_head.weight is not again.model.embed_tokens.weight
    assert base.lm_head.weight is base.model.embed_tokens.weight  # the training model is as it was


def test_a_merge_that_leaves_the_embeddings_alone_keeps_them_tied(tokenizer):
    """Other sharing (one block used twice, as some models do) is not the embeddings' tie:
    the merged model keeps tie_word_embeddings, so a reload gets its output layer back."""
    from peft import LoraConfig, get_peft_model

    base = tied_llama(tokenizer, layers=2)
    base.model.layers[1] = base.model.layers[0]
    merged = export._merged_copy(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0)))
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
