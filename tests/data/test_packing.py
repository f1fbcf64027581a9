import pytest
import torch

from llmtrain.attention import packed_mask
from llmtrain.config import DataConfig
from llmtrain.core.objective import TokenLoss, model_inputs
from llmtrain.data.batches import Collator
from llmtrain.data.packing import PackedDataset, pack_in_order, pack_lengths
from llmtrain.data.rows import process_row
from llmtrain.demo import make_rows
from tests.support.data import packed_samples, rows_dataset


def test_pack_lengths_fills_bins_without_overflow():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = pack_lengths(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert sum(lengths) / (128 * len(bins)) > 0.95  # best-fit decreasing packs tightly
    assert bins == pack_lengths(lengths, 128)  # deterministic


def test_pack_lengths_rejects_rows_longer_than_a_pack():
    with pytest.raises(ValueError, match="more than the pack capacity"):
        pack_lengths([10, 300], 256)


@pytest.fixture(scope="module")
def examples(tokenizer):
    rows = [process_row(r, "chat", tokenizer, DataConfig()) for r in make_rows(12, seed=5)]
    return rows_dataset(rows, "packing-examples")


def load(tiny_model, attn):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_do_not_see_each_other(tiny_model, tokenizer, examples, attn):
    """Each packed sample's logits equal those of the same sample run alone."""
    model = load(tiny_model, attn)
    packed = PackedDataset(examples, capacity=256)
    assert len(packed) < len(examples)  # several rows per pack
    batch = Collator(tokenizer.pad_token_id)([packed[j] for j in range(len(packed))])
    with torch.no_grad():
        logits = model(**model_inputs(model, batch)).logits
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        checked, leaked = 0, 0
        for j, span, ids in packed_samples(packed, examples):
            alone = model(input_ids=ids).logits[0]
            torch.testing.assert_close(logits[j, span], alone, atol=1e-5, rtol=1e-5)
            leaked += span.start > 0 and not torch.allclose(leaky[j, span], alone, atol=1e-3)
            checked += 1
    assert checked == len(examples)
    assert leaked > 0, "position_ids alone should leak across samples; the mask is what isolates them"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_and_unpacked_give_the_same_summed_loss(tiny_model, tokenizer, examples, attn):
    model = load(tiny_model, attn)
    collate = Collator(tokenizer.pad_token_id)
    packed = PackedDataset(examples, capacity=256)
    objective = TokenLoss()
    packed_batch = collate([packed[j] for j in range(len(packed))])
    padded_batch = collate([examples[i] for i in range(len(examples))])
    with torch.no_grad():
        p, u = objective(model, packed_batch).total, objective(model, padded_batch).total
    assert objective.count(packed_batch) == objective.count(padded_batch) == sum(examples["n_trained"])
    torch.testing.assert_close(p, u, rtol=1e-5, atol=1e-4)


def positions(lengths: list[list[int]], width: int) -> torch.Tensor:
    """position_ids of packed rows of samples of `lengths`, padding (positions from 0) to `width`."""
    rows = [[p for n in row for p in range(n)] for row in lengths]
    return torch.tensor([r + list(range(width - len(r))) for r in rows])


def packed_masks(lengths, width, window=None):
    """packed_mask of a Llama (or Mistral, with a window) config for each backend."""
    from transformers import LlamaConfig, MistralConfig

    out = {}
    for attn in ("sdpa", "flex_attention", "eager"):
        config = MistralConfig(sliding_window=window) if window else LlamaConfig()
        config._attn_implementation = attn
        out[attn] = packed_mask(config, positions(lengths, width), torch.float32)
    return out


@pytest.mark.parametrize("window", [None, 7, 200])
def test_packed_masks_allow_exactly_the_pairs_within_a_sample_and_its_window(window):
    """Every backend's mask allows (q, k) exactly when both are in one sample, k <= q, and
    q - k < window: samples whose lengths do not fall on FlexAttention's 128-token blocks,
    padding at the end. (Eager FlexAttention on CPU is checked forward only: CPU has no
    FlexAttention backward, so CPU training never uses it.)"""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    lengths, L = [[5, 130, 1, 90, 40], [299, 1]], 300
    doc = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] + [-1] * (L - sum(row)) for row in lengths])
    pos = positions(lengths, L)
    q_, k_ = torch.arange(L)[:, None], torch.arange(L)[None]
    expected = (doc[:, :, None] == doc[:, None, :]) & (k_ <= q_)
    if window:
        expected &= (pos[:, :, None] - pos[:, None, :]) < window
    masks = packed_masks(lengths, L, window)
    assert torch.equal(masks["sdpa"][:, 0][doc >= 0], expected[doc >= 0])
    assert torch.equal(masks["eager"][:, 0] == 0, masks["sdpa"][:, 0])
    q, k, v = (torch.randn(2, 4, L, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=masks["sdpa"])
    flex = flex_attention(q, k, v, block_mask=masks["flex_attention"])
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_block_mask_skips_blocks_no_sample_reaches():
    """With three samples on 128-token block bounds each query block visits one key block,
    where plain causal attention visits 1, 2 and 3."""
    blocks = packed_masks([[128, 128, 128]], 384)["flex_attention"]
    assert (blocks.kv_num_blocks + blocks.full_kv_num_blocks).flatten().tolist() == [1, 1, 1]


def test_flex_attention_model_on_packed_batches_matches_sdpa(tiny_model, tokenizer, examples):
    """transformers hands the BlockMask to FlexAttention unchanged (forward only on CPU)."""
    packed = PackedDataset(examples, capacity=256)
    batch = Collator(tokenizer.pad_token_id)([packed[j] for j in range(len(packed))])
    with torch.no_grad():
        flex, dense = load(tiny_model, "flex_attention"), load(tiny_model, "sdpa")
        flex, dense = flex(**model_inputs(flex, batch)).logits, dense(**model_inputs(dense, batch)).logits
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_padding_in_a_pack_is_its_own_block(tokenizer, examples):
    packed = PackedDataset(examples, capacity=512)
    batch = Collator(tokenizer.pad_token_id)(
        [packed[0], {"input_ids": [5], "labels": [-100], "position_ids": [0], "doc_ids": [0]}]
    )
    assert batch["doc_ids"][1, 1:].eq(-1).all() and batch["labels"][1, 1:].eq(-100).all()


def test_packed_batches_have_one_shape(tokenizer, examples):
    """Padded to the pack width, so compiled kernels see a single shape; unpacked rows
    are still padded only to the longest row."""
    collate = Collator(tokenizer.pad_token_id, pack_width=512)
    packed = PackedDataset(examples, capacity=512)
    assert {collate([packed[j]])["input_ids"].shape[1] for j in range(len(packed))} == {512}
    assert collate.empty_batch(packed=True)["input_ids"].shape == (1, 512)
    row = examples[0]
    assert collate([{"input_ids": row["input_ids"], "labels": row["labels"]}])["input_ids"].shape[1] == len(
        row["input_ids"]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_trains_like_the_dense_mask_on_a_gpu(tiny_model, tokenizer, examples):
    """Loss and gradients of a packed bf16 batch: FlexAttention with the block mask (what
    attn_implementation=auto picks for packed data on a GPU) against SDPA with the dense mask."""
    packed = PackedDataset(examples, capacity=256)
    batch = {k: v.cuda() for k, v in Collator(tokenizer.pad_token_id)([packed[j] for j in range(len(packed))]).items()}
    results = {}
    for attn in ("flex_attention", "sdpa"):
        model = load(tiny_model, attn).cuda().train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = TokenLoss.for_model(model, 64)(model, batch).total
        loss.backward()
        results[attn] = loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    (flex, g_flex), (dense, g_dense) = results["flex_attention"], results["sdpa"]
    torch.testing.assert_close(flex, dense, rtol=2e-2, atol=0)
    for name, g in g_dense.items():
        cos = torch.nn.functional.cosine_similarity(g_flex[name].flatten().float(), g.flatten().float(), dim=0)
        assert cos > 0.99, name


def test_packing_in_order_keeps_each_row_in_place():
    lengths = [100, 20, 140, 10, 120, 120, 8, 256]
    bins = pack_in_order(lengths, 256)
    assert bins == [[0, 1], [2, 3], [4, 5, 6], [7]]  # each row joins the sequence before it while it fits
    assert [i for b in bins for i in b] == list(range(len(lengths)))
    assert [i for b in pack_lengths(lengths, 256) for i in b] != list(range(len(lengths)))  # unlike best fit
    with pytest.raises(ValueError, match="more than the pack capacity"):
        pack_in_order([10, 300], 256)


def test_unshuffled_packed_training_reads_the_files_in_order(tmp_path, tokenizer, monkeypatch):
    """data.shuffle=false is a curriculum: packed, the sequences still read data.train's
    files in order, row after row (best-fit packing would group rows by length)."""
    from accelerate import Accelerator

    from llmtrain.config import load_config
    from llmtrain.data.build import build_datasets
    from llmtrain.demo import write_jsonl

    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl([{"text": f"a{i} " + "x" * (7 * i % 40)} for i in range(30)], a)
    write_jsonl([{"text": f"b{i} " + "y" * (11 * i % 40)} for i in range(30)], b)
    expected = [f"a{i}" for i in range(30)] + [f"b{i}" for i in range(30)]

    def read(*overrides):
        cfg = load_config(None, ["model.name_or_path=m", "output_dir=o", f"data.train=[{a}, {b}]", *overrides])
        train_set, _ = build_datasets(cfg, Accelerator(cpu=True), tokenizer)
        words = []
        for j in range(len(train_set)):
            seq = train_set[j]
            for d in sorted(set(seq["doc_ids"]) - {-1}):
                ids = [t for t, k in zip(seq["input_ids"], seq["doc_ids"]) if k == d]
                words.append(tokenizer.decode(ids, skip_special_tokens=True).split()[0])
        return words

    common = ["data.packing=true", "data.max_seq_len=64"]
    assert read(*common, "data.shuffle=false") == expected
    assert sorted(read(*common)) == sorted(expected) and read(*common) != expected  # the default groups by length
