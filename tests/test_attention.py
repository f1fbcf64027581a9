"""attention.choose: the backend per model and device, and the errors for what a model or
device cannot run; attention.share_sdpa_masks: one float mask for all layers, the same
numbers; attention.padding_needs_mask: right-padded batches without the padding mask where
causal attention alone keeps padding unseen. (Packed masks per architecture:
tests/launch/test_architectures.py.)"""

import pytest
import torch

from llmtrain.attention import choose, describe_pattern, layer_types
from llmtrain.errors import AttentionError
from tests.support.architectures import ARCHITECTURES


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(num_hidden_layers=2)


def test_auto_is_flex_for_packed_data_on_a_gpu_and_sdpa_otherwise():
    cls, mcfg = llama()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose("auto", cls, mcfg, True, cuda).name == "flex_attention"
    assert choose("auto", cls, mcfg, False, cuda).name == "sdpa"
    assert choose("auto", cls, mcfg, True, cpu).name == "sdpa"
    assert choose("eager", cls, mcfg, True, cuda).name == "eager"
    with pytest.raises(AttentionError, match="^model.attn_implementation: flex_attention cannot train on CPU"):
        choose("flex_attention", cls, mcfg, True, cpu)


def test_auto_takes_what_a_model_without_sdpa_supports():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    mcfg = Gemma2Config(num_hidden_layers=2)
    cpu = choose("auto", Gemma2ForCausalLM, mcfg, True, torch.device("cpu"))
    assert cpu.name == "eager" and "soft-capped attention scores" in cpu.reason
    assert choose("auto", Gemma2ForCausalLM, mcfg, False, torch.device("cuda")).name == "flex_attention"
    with pytest.raises(
        AttentionError, match="^model.attn_implementation: Gemma2ForCausalLM does not support sdpa; use"
    ):
        choose("sdpa", Gemma2ForCausalLM, mcfg, False, torch.device("cpu"))


def test_an_unknown_backend_names_the_known_ones():
    cls, mcfg = llama()
    with pytest.raises(
        AttentionError, match=r"^model.attn_implementation: unknown backend 'bogus'; use one of auto, eager,"
    ):
        choose("bogus", cls, mcfg, False, torch.device("cpu"))


def test_the_pattern_is_read_per_layer_from_the_config():
    from transformers import Gemma3TextConfig, Llama4TextConfig, MistralConfig, Qwen2Config

    assert describe_pattern(llama()[1]) == "full causal on all 2 layers"
    assert describe_pattern(MistralConfig(num_hidden_layers=3, sliding_window=64)) == (
        "sliding window of 64 tokens on all 3 layers"
    )
    g3 = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    assert describe_pattern(g3) == "sliding window of 512 tokens on 5 layers, full causal on 1 layer"
    assert layer_types(Qwen2Config(num_hidden_layers=2)) == ["full_attention"] * 2  # use_sliding_window off
    l4 = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=16)
    assert describe_pattern(l4) == "chunks of 16 tokens on 3 layers, full causal on 1 layer"


def test_packing_is_refused_where_samples_could_not_be_kept_apart():
    from transformers import BloomConfig, BloomForCausalLM, MistralConfig, MistralForCausalLM

    with pytest.raises(AttentionError, match="^data.packing: BloomForCausalLM takes no position_ids"):
        choose("auto", BloomForCausalLM, BloomConfig(n_layer=2), True, torch.device("cpu"))
    choose("auto", BloomForCausalLM, BloomConfig(n_layer=2), False, torch.device("cpu"))  # unpacked is fine
    mixed = MistralConfig(num_hidden_layers=2, sliding_window=8)
    mixed.layer_types = ["sliding_attention", "full_attention"]  # Mistral's code takes one mask for all layers
    with pytest.raises(AttentionError, match="^data.packing: MistralForCausalLM mixes layer types"):
        choose("auto", MistralForCausalLM, mixed, True, torch.device("cpu"))


def train_pass(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """(logits, gradients, distinct float attention masks autograd kept) of one forward and
    backward pass of `model` on `batch`."""
    length = batch["input_ids"].shape[1]
    masks: set[int] = set()

    def pack(t):  # every tensor autograd keeps for the backward pass
        # A mask: [batch, 1, length, length], or broadcast over the heads as CUDA's
        # memory-efficient kernel keeps it (not the math kernel's attention weights).
        square = t.dim() == 4 and tuple(t.shape[-2:]) == (length, length)
        if t.is_floating_point() and square and (t.shape[1] == 1 or t.stride(1) == 0):
            masks.add(t.untyped_storage().data_ptr())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**batch).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], len(masks)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_sdpa_keeps_one_float_mask_for_all_layers_and_the_same_numbers(zoo, name, monkeypatch):
    """share_sdpa_masks: a boolean mask (packed, built by attention.packed_mask; padded,
    built by transformers inside the model) becomes one float mask that every layer shares,
    where torch's SDPA alone makes and keeps one per layer, and the logits and gradients are
    bit-identical. (gemma3 mixes sliding and full layers: a mask per layer type.)"""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from llmtrain.attention import _FLOAT_MASKS, _sdpa_sharing_masks, packed_mask

    model = AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    position_ids = torch.tensor([list(range(10)) + list(range(14)), list(range(24))])
    packed = {"input_ids": ids, "position_ids": position_ids}
    packed["attention_mask"] = packed_mask(model.config, position_ids, torch.float32)
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 24, [1] * 17 + [0] * 7])}
    layers = model.config.num_hidden_layers
    types = len(set(model.config.layer_types)) if getattr(model.config, "layer_types", None) else 1
    for batch in (packed, padded):
        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention_forward)
        stock_logits, stock_grads, stock_masks = train_pass(model, batch)
        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", _sdpa_sharing_masks)
        logits, grads, kept = train_pass(model, batch)
        assert torch.equal(logits, stock_logits)
        assert len(grads) == len(stock_grads) and all(torch.equal(a, b) for a, b in zip(grads, stock_grads))
        assert stock_masks == layers and kept == types
    del packed, padded, batch
    assert len(_FLOAT_MASKS) == 0  # the float masks went with their boolean masks


GPU = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)


def on_gpu(kernels: str):
    return pytest.param("cuda", kernels, marks=GPU.marks, id=f"cuda-{kernels}")


@pytest.mark.parametrize(("device", "kernels"), [("cpu", "default"), on_gpu("efficient"), on_gpu("default")])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_sdpa_shares_the_mask_in_the_dtype_attention_computes_in(zoo, weights, device, kernels, monkeypatch):
    """Under bf16 autocast (float32 weights; the query reaches attention in float32, and
    autocast casts SDPA's inputs to bf16) and with bf16 weights: one mask, in bf16, and the
    same numbers as torch's own conversion. On a GPU, first with the memory-efficient kernel
    for both passes (cuDNN's kernel off): the same numbers. Then with torch's own choice for
    torch's pass (cuDNN's kernel first, on an H100 with torch 2.11): llmtrain keeps cuDNN's
    kernel out of training calls with a mask (masked_training_kernels), so still one mask,
    and the same numbers within the rounding of two kernels."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from llmtrain.attention import _sdpa_sharing_masks

    model = AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa", dtype=weights).to(device)
    model.train()
    batch = {"input_ids": torch.randint(3, 50, (2, 20)), "attention_mask": torch.tensor([[1] * 20, [1] * 13 + [0] * 7])}
    batch = {k: v.to(device) for k, v in batch.items()}
    efficient = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    results = []
    with efficient if kernels == "efficient" else nullcontext():
        for attention in (sdpa_attention_forward, _sdpa_sharing_masks):
            monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", attention)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=weights == torch.float32):
                results.append(train_pass(model, batch))
    (stock, stock_grads, stock_masks), (logits, grads, kept) = results
    if device == "cpu":
        assert torch.equal(logits, stock)
        assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads, strict=True))
    else:  # the memory-efficient kernel's backward is not deterministic run to run
        same_kernel = kernels == "efficient"
        torch.testing.assert_close(logits, stock, **({} if same_kernel else dict(rtol=2e-2, atol=2e-2)))
        for a, b in zip(grads, stock_grads, strict=True):
            torch.testing.assert_close(a, b, **({} if same_kernel else dict(rtol=5e-2, atol=5e-2)))
    assert (stock_masks, kept) == (model.config.num_hidden_layers, 1)


def test_cudnns_kernel_is_kept_out_of_masked_training_calls_only(zoo, monkeypatch):
    """masked_training_kernels: on CUDA every kernel the user left on but cuDNN's; nothing
    changed elsewhere or where cuDNN's is off. And the wiring: a training pass with a mask
    runs SDPA with cuDNN's kernel off (here on CPU, with the CUDA answer put in), a no-grad
    pass and a pass without a mask with the kernels as they were."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, AutoModelForCausalLM

    import llmtrain.attention as attention

    flash, efficient, math_, cudnn = (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
        SDPBackend.CUDNN_ATTENTION,
    )
    assert attention.masked_training_kernels("cpu") is None
    with sdpa_kernel([flash, efficient, math_, cudnn]):
        assert attention.masked_training_kernels("cuda") == [flash, efficient, math_]
    with sdpa_kernel([flash, math_, cudnn]):  # the user turned the memory-efficient kernel off
        assert attention.masked_training_kernels("cuda") == [flash, math_]
    with sdpa_kernel([efficient, math_]):
        assert attention.masked_training_kernels("cuda") is None
    with sdpa_kernel([cudnn]):  # the user's choice, kept
        assert attention.masked_training_kernels("cuda") is None

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "masked_training_kernels", lambda device: [flash, efficient, math_])
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", attention._sdpa_sharing_masks)
    model = AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa", dtype=torch.float32)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 50, (2, 12))
    mask = torch.tensor([[1] * 12, [1] * 5 + [0] * 7])
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert seen == [False] * layers and torch.backends.cuda.cudnn_sdp_enabled()
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids).logits.sum().backward()  # no mask: transformers passes none with SDPA
    assert seen == [True] * 2 * layers


def test_compiled_blocks_keep_the_kernel_choice_of_masked_training_calls(zoo, monkeypatch):
    """With train.compile, torch.compile traces the blocks' attention, llmtrain's SDPA function
    with it: the kernels masked_training_kernels leaves on are traced too, so the compiled
    forward and backward are those kernels'. Here on CPU, with the math kernel alone put in as
    the answer: the traced graphs hold no call of CPU's fused kernel, which they do when the
    answer changes nothing."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.attention import SDPBackend
    from transformers import AttentionInterface, AutoModelForCausalLM

    import llmtrain.attention as attention

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", attention._sdpa_sharing_masks)
    model = AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa", dtype=torch.float32)
    ids = torch.randint(3, 50, (2, 12))
    mask = torch.tensor([[1] * 12, [1] * 5 + [0] * 7])

    def traced(kernels) -> list[str]:
        """The forward and backward graphs of the first block, compiled and trained once."""
        monkeypatch.setattr(attention, "masked_training_kernels", lambda device: kernels)
        torch._dynamo.reset()
        graphs = []

        def keep(graph, inputs):
            graphs.append(str(graph.graph))
            return make_boxed_func(graph.forward)

        block = model.model.layers[0]
        block.compile(backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        try:
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        finally:
            block._compiled_call_impl = None
            torch._dynamo.reset()
        assert len(graphs) == 2  # the forward and the backward
        return graphs

    fused = "_scaled_dot_product_flash_attention_for_cpu"
    assert all(fused in graph for graph in traced(None))
    assert not any(fused in graph for graph in traced([SDPBackend.MATH]))


def masked_attention_gradients(device: str, compiled: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of query, key and value through llmtrain's SDPA function with a causal
    mask, on pytorch/pytorch#196678's inputs (length 704, 64 past a multiple of 128, and every
    score near -120), as torch picks the kernel (through torch.compile if `compiled`, as
    train.compile runs it) and with the math kernel alone."""
    import math
    import types

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmtrain.attention import _sdpa_sharing_masks

    torch.manual_seed(0)
    length, dim = 704, 64
    q, k = (torch.randn(1, 1, length, dim, device=device) * 0.1 for _ in range(2))
    v = torch.randn(1, 1, length, dim, device=device)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(dim)
    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    out_grad = torch.randn(1, length, 1, dim, device=device, dtype=torch.bfloat16)  # transformers' [b, l, h, d]
    module = types.SimpleNamespace(is_causal=True, training=True)

    def gradients(attend):
        leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        attend(module, *leaves, mask)[0].backward(out_grad)
        return [t.grad.float() for t in leaves]

    if compiled:
        torch._dynamo.reset()
    ours = gradients(torch.compile(_sdpa_sharing_masks) if compiled else _sdpa_sharing_masks)
    with sdpa_kernel([SDPBackend.MATH]):
        return ours, gradients(_sdpa_sharing_masks)


def assert_finite_and_close(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """Finite, and within 2% (relative norm) of the reference. The query gradient's first
    component is left out: it is 120 times a sum that cancels to 0, so bf16 leaves only noise."""
    ours[0], reference[0] = ours[0][..., 1:], reference[0][..., 1:]
    for name, a, b in zip("qkv", ours, reference, strict=True):
        assert torch.isfinite(a).all(), name
        assert (a - b).norm() <= 0.02 * b.norm(), name


def test_masked_attention_gradients_are_finite_and_match_the_math_kernel():
    assert_finite_and_close(*masked_attention_gradients("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_masked_training_call_on_a_gpu_gets_finite_gradients(compiled):
    """cuDNN's attention backward, torch's first choice on an H100 since torch 2.11, returns
    NaN for the query's gradient on these inputs with a mask (pytorch/pytorch#196678);
    llmtrain keeps it out of masked training calls, compiled or not, so the gradients are
    finite and match the math kernel's."""
    assert_finite_and_close(*masked_attention_gradients("cuda", compiled))


@pytest.mark.parametrize("length", [20, 24])
def test_float_masks_are_aligned_as_the_memory_efficient_kernel_takes_them(length):
    """CUDA's memory-efficient kernel copies a mask whose strides are not multiples of 8 on
    every call (torch's preprocess_mask), which would make a copy per layer again: the
    shared mask's rows start at multiples of 8, and it holds torch's own 0/-inf."""
    from llmtrain.attention import float_mask

    mask = torch.rand(2, 1, length, length, generator=torch.Generator().manual_seed(0)) > 0.3
    made = float_mask(mask, torch.bfloat16)
    assert made.stride(-1) == 1 and all(s % 8 == 0 for s in made.stride()[:-1]), made.stride()
    assert torch.equal(made, torch.zeros_like(made).masked_fill(~mask, float("-inf")))
    assert float_mask(mask, torch.bfloat16) is made


def test_sdpa_leaves_masks_of_no_grad_passes_to_torch(zoo, monkeypatch):
    """Without autograd nothing is kept, so nothing is converted ahead (generation, the
    reference pass): torch's own per-call conversion runs and is freed at once."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from llmtrain.attention import _FLOAT_MASKS, _sdpa_sharing_masks

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", _sdpa_sharing_masks)
    model = AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa", dtype=torch.float32)
    mask = torch.tensor([[1] * 12, [1] * 5 + [0] * 7])
    with torch.no_grad():
        model(input_ids=torch.randint(3, 50, (2, 12)), attention_mask=mask)
    assert len(_FLOAT_MASKS) == 0


def test_masks_are_left_to_torch_where_it_might_pick_cudnn(monkeypatch):
    """torch fills a boolean mask's False with -65504 for cuDNN's SDPA, -inf elsewhere: the
    shared mask is made only where cuDNN's kernel is off (as masked_training_kernels turns
    it off for a masked training call), or off CUDA."""
    from llmtrain.attention import converts_like_torch

    assert converts_like_torch("cpu")
    assert not converts_like_torch("cuda")  # cuDNN's kernel on, as by default
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert converts_like_torch("cuda")


def test_a_mask_changed_in_place_gets_a_new_float_mask():
    from llmtrain.attention import float_mask

    mask = torch.tensor([[True, False], [True, True]])
    first = float_mask(mask, torch.float32)
    assert float_mask(mask, torch.float32) is first and first[0, 1] == float("-inf") and first[0, 0] == 0
    mask[0, 1] = True
    assert torch.equal(float_mask(mask, torch.float32), torch.zeros(2, 2))


def right_padded(vocab: int) -> dict:
    """Three rows of 24, 17 and 9 tokens (longer than the zoo's 8-token windows), padded on
    the right as batches.Collator pads them."""
    torch.manual_seed(0)
    lengths = [24, 17, 9]
    return {
        "input_ids": torch.randint(3, vocab, (len(lengths), 24)),
        "attention_mask": torch.tensor([[1] * n + [0] * (24 - n) for n in lengths]),
    }


def without_and_with_the_mask(model, kwargs: dict, batch: dict) -> list[tuple[torch.Tensor, dict]]:
    """(logits at real positions, {name: gradient}) of a forward and backward pass of `model`
    on `kwargs` (objective.model_inputs' arguments, without the padding mask), then on the
    same with the batch's padding mask; the loss reads real positions only."""
    real = batch["attention_mask"].bool()
    results = []
    for inputs in (kwargs, dict(kwargs, attention_mask=batch["attention_mask"])):
        model.zero_grad(set_to_none=True)
        logits = model(**inputs).logits[real]
        logits.float().logsumexp(-1).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    return results


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_right_padded_batches_train_alike_with_and_without_the_padding_mask(zoo, name):
    """objective.model_inputs leaves the padding mask out where attention.padding_needs_mask
    says causal attention alone keeps padding unseen (transformers' models with SDPA): the
    logits at real positions are the same to the bit, sliding windows still hold (rows are
    longer than the window), and the gradients differ by rounding only. Other backends
    (gemma2 and gpt-oss load with eager) keep the mask."""
    from transformers import AutoModelForCausalLM

    from llmtrain.core.objective import model_inputs

    model = AutoModelForCausalLM.from_pretrained(zoo(name), dtype=torch.float32)  # SDPA where the model supports it
    attention = model.config._attn_implementation
    model.eval()  # no dropout (GPT-2 has some), so the two passes can be compared; gradients still flow
    batch = right_padded(model.config.vocab_size)
    kwargs = model_inputs(model, batch)
    assert ("attention_mask" in kwargs) == (attention != "sdpa")
    (logits, grads), (masked_logits, masked_grads) = without_and_with_the_mask(model, kwargs, batch)
    assert torch.equal(logits, masked_logits)
    assert grads.keys() == masked_grads.keys()
    for key, grad in masked_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)


def test_the_padding_mask_is_kept_for_other_backends_and_for_a_models_own_code(zoo):
    """Only a transformers model loaded with SDPA goes without it: the flash kernels and
    FlexAttention use the mask to skip padding, and a model's own code (trust_remote_code)
    may not make attention without a mask causal."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from llmtrain.attention import padding_needs_mask

    class OwnCode(LlamaForCausalLM):  # defined outside transformers, as remote code is
        pass

    assert not padding_needs_mask(AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa"))
    assert padding_needs_mask(AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="eager"))
    assert padding_needs_mask(OwnCode.from_pretrained(zoo("llama"), attn_implementation="sdpa"))


def test_a_model_that_attends_both_ways_keeps_the_padding_mask_and_is_not_packed(tokenizer):
    """Gemma's use_bidirectional_attention: without the mask its real tokens would see the
    padding after them (the logits change), so it keeps the mask; and packed samples, which
    get causal masks, are refused for it."""
    from transformers import Gemma3ForCausalLM

    from llmtrain.attention import padding_needs_mask
    from tests.support.architectures import config

    mcfg = config("gemma3", tokenizer)
    mcfg.use_bidirectional_attention = True
    mcfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(mcfg).eval()
    assert padding_needs_mask(model)
    batch = right_padded(mcfg.vocab_size)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        masked = model(**batch).logits[real]
        unmasked = model(input_ids=batch["input_ids"]).logits[real]
    assert not torch.allclose(masked, unmasked)
    with pytest.raises(AttentionError, match=r"^data.packing: Gemma3ForCausalLM attends both ways"):
        choose("auto", Gemma3ForCausalLM, mcfg, True, torch.device("cpu"))


def test_a_model_sharded_by_fsdp2_is_still_taken_for_transformers_own(zoo, tmp_path):
    """fully_shard changes the model's class to a subclass torch makes: not the model's own code."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from llmtrain.attention import padding_needs_mask

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(zoo("llama"), attn_implementation="sdpa")
        fully_shard(model)
        assert type(model).__name__ == "FSDPLlamaForCausalLM"
        assert not padding_needs_mask(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_right_padded_batches_on_a_gpu_train_alike_without_the_padding_mask(zoo, name):
    """On CUDA, torch picks different kernels with and without a mask (flash or cuDNN's
    without; memory-efficient or cuDNN's with one), so the same numbers within bf16
    rounding, not to the bit."""
    from transformers import AutoModelForCausalLM

    from llmtrain.core.objective import model_inputs

    model = AutoModelForCausalLM.from_pretrained(zoo(name), attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
    batch = {k: v.cuda() for k, v in right_padded(model.config.vocab_size).items()}
    kwargs = model_inputs(model, batch)
    assert "attention_mask" not in kwargs
    (logits, grads), (masked_logits, masked_grads) = without_and_with_the_mask(model, kwargs, batch)
    torch.testing.assert_close(logits.float(), masked_logits.float(), rtol=2e-2, atol=2e-2)
    assert grads.keys() == masked_grads.keys()
    for key, masked in masked_grads.items():
        torch.testing.assert_close(grads[key].float(), masked.float(), rtol=5e-2, atol=5e-2, msg=key)
