"""Generation (llmtrain/rl/sampling.py): each completion drawn from its own seed, whatever
else shares its batch; the filters as transformers defines them; stopping and clipping."""

import pytest
import torch

from llmtrain.rl import sampling
from llmtrain.rl.sampling import HFGenerator, ReservedLayer, SeededSampling, filtered_logits, sample_seed
from tests.support.architectures import ARCHITECTURES

CONTINUED = sampling.continued  # the real one, which a test wraps to see it called


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), AutoTokenizer.from_pretrained(
        tiny_model
    )


def test_seeds_are_fixed_and_distinct():
    seeds = {sample_seed(7, e, p, j) for e in range(3) for p in range(50) for j in range(8)}
    assert len(seeds) == 3 * 50 * 8 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(7, 1, 2, 3) == sample_seed(7, 1, 2, 3) != sample_seed(8, 1, 2, 3)


def test_filters_keep_what_transformers_keeps():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.8), (10, 0.5), (0, 0.05)):
        want = logits / 0.7
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1:
            want = TopPLogitsWarper(top_p)(None, want)
        got = filtered_logits(logits, 0.7, top_k, top_p)
        assert torch.equal(got.isinf(), want.isinf()), (top_k, top_p)
        torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()])


def test_draws_follow_the_distribution():
    """4000 rows, each its own seed, one draw each from the same four-token distribution."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    sampler = SeededSampling([sample_seed(0, 0, i, 0) for i in range(n)], temperature=1.0)
    out = sampler(None, probs.log().expand(n, 4).clone())
    picked = out.argmax(1)
    assert torch.equal(out.isinf().sum(1), torch.full((n,), 3))  # one token left possible per row
    freq = torch.bincount(picked, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_a_completion_does_not_depend_on_what_shares_its_batch(model_and_tokenizer):
    """The same prompt and seed give the same completion alone, beside a longer prompt
    (so left-padded), and in another order."""
    model, tokenizer = model_and_tokenizer
    gen = HFGenerator(tokenizer, max_new_tokens=10, temperature=1.0)
    model.train()
    a, b = tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Reverse the word: lamp, please now")["input_ids"]
    alone = gen.generate(model, [a], [11]).ids[0]
    together = gen.generate(model, [b, a, a], [5, 11, 12])
    assert together.ids[1] == alone and together.ids[2] != alone
    assert gen.generate(model, [a, b], [11, 5]).ids == [alone, together.ids[0]]
    assert model.training  # back in training mode (generation ran in eval mode)
    model.eval()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_the_sampler_reports_each_tokens_log_prob_under_what_it_sampled_from(model_and_tokenizer, top_k, top_p):
    """Completions.logps: each drawn token's log-prob under the tempered, filtered
    distribution; without filters the trainer's log-probs of the same tokens (a full forward,
    right-padded), to float rounding; with them at least those (the filtered distribution
    renormalises its kept tokens), the gap the sampler correction weighs."""
    model, tokenizer = model_and_tokenizer
    gen = HFGenerator(tokenizer, max_new_tokens=12, temperature=0.8, top_k=top_k, top_p=top_p)
    a, b = tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Reverse the word: lamp, please now")["input_ids"]
    out = gen.generate(model, [a, b], [3, 4])
    assert [len(q) for q in out.logps] == [len(c) for c in out.ids] and all(len(c) > 2 for c in out.ids)
    assert gen.generate(model, [a], None).logps is None  # greedy: nothing sampled
    for prompt, ids, q in zip([a, b], out.ids, out.logps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / 0.8
        trainer = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        if top_k or top_p < 1:
            assert (torch.tensor(q) >= trainer - 1e-5).all() and (torch.tensor(q) > trainer + 1e-3).any()
        else:
            torch.testing.assert_close(torch.tensor(q), trainer, rtol=0, atol=1e-5)


def test_completions_stop_at_the_end_of_turn_or_are_clipped(model_and_tokenizer):
    """Greedy (seeds None) is transformers' own greedy decoding; a completion ends at the
    first stop token the model's generation config names (kept, as the turn's end is
    trained), or is clipped at max_new_tokens."""
    model, tokenizer = model_and_tokenizer
    gen = HFGenerator(tokenizer, max_new_tokens=6, temperature=1.0)
    prompt = tokenizer("What is 2 + 2?")["input_ids"]
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id]
        with torch.no_grad():
            plain = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=-1)
        plain = plain[0, len(prompt) :].tolist()
        greedy = gen.generate(model, [prompt], None)
        if tokenizer.eos_token_id not in plain:
            assert greedy.ids == [plain] and greedy.ended == [False]
        stop = plain[2]  # a token greedy decoding reaches: made a stop token
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
        greedy = gen.generate(model, [prompt], None)
        assert greedy.ids == [plain[: plain.index(stop) + 1]] and greedy.ended == [True]
        sampled = gen.generate(model, [prompt] * 8, list(range(8)))
        for ids, ended in zip(sampled.ids, sampled.ended):
            stops = [i for i, t in enumerate(ids) if t in (stop, tokenizer.eos_token_id)]
            assert stops == ([len(ids) - 1] if ended else []) and (ended or len(ids) == 6)
    finally:
        model.generation_config.eos_token_id = saved


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_samples_a_prompt_alike_alone_and_left_padded(zoo, tokenizer, arch, monkeypatch):
    """Generation left-pads a batch's prompts: for absolute positions (GPT-2), sliding
    windows, experts and fused projections alike, a seeded completion is the one the prompt
    gets alone, and the training forward (right-padded, as the loss sees it) gives its
    tokens the log-probs they have alone, so the policy that sampled is the one scored.
    The reserved KV cache gives what transformers' own cache gives, to the bit."""
    from transformers import AutoModelForCausalLM

    from llmtrain.core.logps import label_logps
    from llmtrain.core.objective import model_inputs
    from llmtrain.data.batches import Collator
    from llmtrain.data.rows import IGNORE, shift

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(zoo(arch), dtype=torch.float32).eval()
    gen = HFGenerator(tokenizer, max_new_tokens=6, temperature=1.0)
    a, b = (
        tokenizer("What is 2 + 2?")["input_ids"],
        tokenizer("Reverse the word: lamp, please, and be quick")["input_ids"],
    )
    alone = gen.generate(model, [a], [3]).ids[0]
    padded = gen.generate(model, [b, a], [4, 3])
    assert padded.ids[1] == alone, arch
    assert sampling.reserved_cache(model, 8) is not None, arch
    # A next turn continues the kept cache where every layer attends to all (full attention):
    # the completion is the one a fresh call on the whole context draws.
    after = [b + padded.ids[0] + a[:3], a + padded.ids[1] + b[:5]]
    fresh = gen.generate(model, after, [7, 8])
    continued = []
    monkeypatch.setattr(sampling, "continued", lambda *args: continued.append(CONTINUED(*args)) or continued[-1])
    with gen.multi_turn():
        gen.generate(model, [b, a], [4, 3])
        again = gen.generate(model, after, [7, 8])
    assert gen.kept is None  # let go on leaving
    assert again.ids == fresh.ids, arch
    torch.testing.assert_close(again.logps, fresh.logps, rtol=0, atol=1e-5, msg=arch)
    # Repeated prompts (a group's) run once into a cache each continues: the same draws.
    grouped = gen.generate(model, [a, b, a, b], [3, 4, 5, 6])
    assert [c is not None for c in continued[1:]] == [True] * len(continued[1:]), arch
    with monkeypatch.context() as m:
        m.setattr(HFGenerator, "shared", lambda *args: None)
        each = gen.generate(model, [a, b, a, b], [3, 4, 5, 6])
    assert grouped.ids == each.ids and grouped.ids[0] == alone, arch
    torch.testing.assert_close(grouped.logps, each.logps, rtol=0, atol=1e-5, msg=arch)
    full_attention = sampling.reusable(sampling.reserved_cache(model, 8))
    assert full_attention == (arch not in ("mistral", "gemma2", "gemma3", "cohere2", "gpt_oss")), arch
    assert [c is not None for c in continued] == ([True, True] if full_attention else []), arch
    monkeypatch.setattr(sampling, "reserved_cache", lambda model, length: None)  # generate's own DynamicCache
    assert gen.generate(model, [b, a], [4, 3]) == padded, arch

    def batch(rows):
        examples = [{"input_ids": p + c, "labels": shift([IGNORE] * len(p) + c)} for p, c in rows]
        return Collator(tokenizer.pad_token_id)(examples)

    def token_logps(b):
        return label_logps(model, model_inputs(model, b), b["labels"])

    with torch.no_grad():
        one = token_logps(batch([(a, alone)]))
        other = gen.generate(model, [b], [4]).ids[0]
        both = token_logps(batch([(b, other), (a, alone)]))
    torch.testing.assert_close(both[len(other) :], one, rtol=1e-4, atol=1e-5, msg=arch)


def test_the_reserved_cache_layer_holds_what_a_dynamic_one_does():
    """Prefill, decode steps past its capacity, a crop (a rolled-back step), a batch
    selection and a beam reorder: each step attends to the same keys and values as
    transformers' DynamicLayer, and the decode steps copy nothing while the storage lasts."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    reserved, dynamic = ReservedLayer(capacity=7), DynamicLayer()

    def step(n):
        k, v = torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)
        got, want = reserved.update(k, v), dynamic.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        assert reserved.get_seq_length() == dynamic.get_seq_length()

    step(5)
    storage = reserved.storage[0].data_ptr()
    step(1)
    step(1)
    assert reserved.storage[0].data_ptr() == storage  # written in place up to the capacity
    step(2)  # past it: taken again
    assert reserved.storage[0].shape[-2] >= 9
    for layer in (reserved, dynamic):
        layer.crop(-2)
    step(1)
    for layer in (reserved, dynamic):
        layer.batch_select_indices(torch.tensor([2, 0]))
    assert reserved.storage is None  # let go at once: a next turn's rows are copied anew
    k, v = torch.randn(2, 2, 1, 4, generator=g), torch.randn(2, 2, 1, 4, generator=g)
    assert all(torch.equal(x, y) for x, y in zip(reserved.update(k, v), dynamic.update(k, v)))
    for layer in (reserved, dynamic):
        layer.reorder_cache(torch.tensor([1, 1]))
    assert all(torch.equal(x, y) for x, y in zip(reserved.update(k, v), dynamic.update(k, v)))
