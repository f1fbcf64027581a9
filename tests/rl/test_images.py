"""GRPO prompts of vision-language models (llmtrain/rl/prompts.py, sampling.py and rollout.py
with llmtrain/vision.py): a prompt's images become its image tokens and travel with it, a
completion sampled from a prompt with images is the same whatever shares its generation
batch, and an episode's turns see its prompt's images (its environment's text added to the
prompt rendered with them again). The runs: tests/launch/test_vision.py."""

import pytest
import torch

from llmtrain.config import Config, DataConfig
from llmtrain.data.rows import FileRow
from llmtrain.errors import ToolError
from llmtrain.model import load_model
from llmtrain.processor import placeholder_ids, processor_of
from llmtrain.rl.agent import Agent, AgentSettings
from llmtrain.rl.config import GRPOConfig
from llmtrain.rl.episodes import play
from llmtrain.rl.prompts import prompt_kind
from llmtrain.rl.rollout import Rollouts
from llmtrain.rl.sampling import Completions, HFGenerator
from llmtrain.rl.tools import ToolBox, load_tools
from llmtrain.rl.turns import check_parser
from llmtrain.vision import IMAGE_COLUMNS, image_inputs, rows_kind
from tests.rl.test_environments import GAMES
from tests.rl.test_episodes import call
from tests.rl.test_tools import TOOLS
from tests.rl.test_turns import CHATML_TOOLS
from tests.support.vision_models import build_all, loaded, pictures

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "llava")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_all(tmp_path_factory.mktemp("vlms"), FAMILIES)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return pictures(tmp_path_factory.mktemp("images"))


def prompt_row(image: str | None, root, text: str = "what colour?") -> FileRow:
    part = [{"type": "image", "image": image}] if image else []
    row = FileRow({"prompt": [{"role": "user", "content": [*part, {"type": "text", "text": text}]}], "answer": "x"})
    row.root = root
    return row


KIND = prompt_kind(8).images  # a vision-language model's single-turn prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_images_become_its_image_tokens_and_travel_with_it(family, models, images):
    _, tokenizer = loaded(models[family])
    example = KIND.process(prompt_row("red.png", images), tokenizer, DataConfig())
    assert example["status"] == "ok", example["status"]
    assert example["prompt_ids"].count(tokenizer.image_token_id) > 0
    assert example["images"] == [(images / "red.png").read_bytes()]
    assert all(len(example[k]) == len(example["prompt_ids"]) for k in IMAGE_COLUMNS if k != "images")
    text = KIND.process(prompt_row(None, images), tokenizer, DataConfig())
    assert text["status"] == "ok" and text["images"] == [] and tokenizer.image_token_id not in text["prompt_ids"]
    # A prompt too long for its completion's room is cut from the left only where its image stays whole.
    long = prompt_row("red.png", images, "word " * 60)
    whole = KIND.process(long, tokenizer, DataConfig(max_seq_len=2048))["prompt_ids"]
    kept = KIND.process(long, tokenizer, DataConfig(max_seq_len=len(whole) + 8 - 1))  # its first token cut
    assert kept["status"] == "truncated" and kept["prompt_ids"] == whole[1:]
    assert kept["images"] and len(kept[IMAGE_COLUMNS[1]]) == len(kept["prompt_ids"])
    into = whole.index(tokenizer.image_token_id) + 1  # a cut that takes an image token
    cut = KIND.process(long, tokenizer, DataConfig(max_seq_len=len(whole) + 8 - into))
    assert cut["status"].startswith("too long (") and "image tokens that a cut" in cut["status"]


def test_the_kinds_a_vision_model_gets(models):
    _, tokenizer = loaded(models["qwen2_5_vl"])
    kind = prompt_kind(8)
    assert rows_kind(kind, tokenizer, Config()) is kind.images and kind.images.version.endswith("-images-v1")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "llava"])
def test_a_completion_with_images_is_the_same_whatever_shares_its_batch(family, models, images):
    """Seeded sampling (one generator per completion) from prompts padded on the left with
    their images: the completion of a prompt alone is the one it gets beside a text prompt
    and another image's prompt, and its log-probs are those the sampler reports."""
    cfg, tokenizer = loaded(models[family])
    model = load_model(cfg).eval()
    rows = [prompt_row("red.png", images), prompt_row(None, images, "no picture here, what colour?")]
    rows.append(prompt_row("green.png", images, "and this one?"))
    examples = [KIND.process(r, tokenizer, DataConfig()) for r in rows]
    prompts = [e["prompt_ids"] for e in examples]
    shown = [{k: e[k] for k in IMAGE_COLUMNS} for e in examples]
    generator = HFGenerator(tokenizer, 6, temperature=1.0)
    together = generator.generate(model, prompts, [11, 12, 13], shown=shown)
    for i in (0, 2):
        alone = generator.generate(model, [prompts[i]], [11 + i], shown=[shown[i]])
        assert alone.ids[0] == together.ids[i]
        torch.testing.assert_close(torch.tensor(alone.logps[0]), torch.tensor(together.logps[i]), atol=1e-4, rtol=0)
    assert processor_of(tokenizer) is not None
    # A vision-language model never continues a cache, even for text prompts (Qwen-VL's rope
    # deltas are set by a call's first forward): repeated prompts are each run whole.
    assert not generator.continues(None)
    with generator.multi_turn():
        generator.generate(model, [prompts[1], prompts[1]], [3, 4])
        assert generator.kept is None


# --- episodes of turns (grpo.tools, grpo.environment) ---------------------------------------

# Qwen's tool-calling ChatML (the test_turns template) with Qwen-VL's image parts.
QWEN_VL_TOOLS = CHATML_TOOLS.replace(
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>",
    "{%- else %}<|im_start|>{{ message.role }}\n{%- if message.content is string %}{{ message.content }}"
    "{%- else %}{%- for part in message.content %}{%- if part.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- else %}{{ part.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}<|im_end|>",
)


@pytest.fixture
def agent_files(tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    (tmp_path / "games.py").write_text(GAMES)
    return tmp_path


def tool_tokenizer(path):
    cfg, tokenizer = loaded(path)
    assert "<|image_pad|>" in QWEN_VL_TOOLS
    tokenizer.chat_template = QWEN_VL_TOOLS
    check_parser(tokenizer)
    return cfg, tokenizer


def agent_of(**grpo) -> Agent:
    cfg = GRPOConfig()
    for k, v in grpo.items():
        setattr(cfg.grpo, k, v)
    return Agent.load(cfg)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_an_environments_text_joins_a_prompt_rendered_again_with_its_images(family, models, images, agent_files):
    _, tok = tool_tokenizer(models[family])
    agent = agent_of(environment=f"{agent_files}/games.py:GuessingGame")
    kind = prompt_kind(32, agent=agent).images
    row = prompt_row("red.png", images, "Play.")
    row["secret"] = 4
    ex = kind.process(row, tok, DataConfig(max_seq_len=600))
    assert ex["status"] == "ok" and ex["images"] == [(images / "red.png").read_bytes()]
    assert "guess" in tok.decode(ex["prompt_ids"])  # the environment's tools, rendered
    start = agent.start(ex, tok)
    text = tok.decode(start.prompt_ids)
    assert text.endswith("Play.Guess my number from 1 to 10.<|im_end|>\n<|im_start|>assistant\n")
    image = tok.image_token_id
    assert start.prompt_ids.count(image) == ex["prompt_ids"].count(image) > 0
    assert start.shown["images"] == ex["images"]
    assert start.shown["mm_token_type_ids"] == [int(t == image) for t in start.prompt_ids]
    # Too long with the environment's text: cut from the left where the image stays whole, else refused.
    n = len(start.prompt_ids)
    agent.settings = AgentSettings(5, 5.0, 100, prompt_budget=n - 1, truncate=True)
    cut = agent.start(ex, tok)
    assert (
        cut.prompt_ids == start.prompt_ids[1:]
        and cut.shown["mm_token_type_ids"] == start.shown["mm_token_type_ids"][1:]
    )
    agent.settings = AgentSettings(5, 5.0, 100, prompt_budget=n - start.prompt_ids.index(image) - 1, truncate=True)
    with pytest.raises(ToolError, match=r"GuessingGame.reset's text makes a prompt \d+ tokens.*split an image"):
        agent.start(ex, tok)


class FirstTurnCalls:
    """A Generator whose first turn is a tool call, written out, and whose later turns the
    model samples (`inner`); it checks that each prompt's per-token inputs cover its context."""

    def __init__(self, inner, first: list[int]):
        self.inner, self.first, self.turn = inner, first, 0
        self.max_new_tokens = inner.max_new_tokens

    def generate(self, model, contexts, seeds, limits=None, shown=None):
        for context, s in zip(contexts, shown or []):
            assert all(len(s[k]) == len(context) for k in IMAGE_COLUMNS if k != "images")
        self.turn += 1
        if self.turn == 1:
            return Completions([list(self.first) for _ in contexts], [True] * len(contexts))
        return self.inner.generate(model, contexts, seeds, limits, shown=shown)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_an_episodes_later_turns_see_its_images_whatever_shares_its_batch(family, models, images, agent_files):
    """After a tool call and its result, the next turn is sampled from the whole context with
    the prompt's image (its 3-D positions from the per-token inputs, grown over the
    completion): its log-probs are the trained model's on the episode with its image, and it
    is the same turn as the episode played alone, beside a text prompt and another picture's."""
    cfg, tok = tool_tokenizer(models[family])
    model = load_model(cfg).eval()
    kind = prompt_kind(32, agent=agent_of(tools=[f"{agent_files}/my_tools.py:add"])).images
    rows = [prompt_row("red.png", images, "What is 2 + 3?"), prompt_row(None, images, "What is 9 + 0?")]
    rows.append(prompt_row("green.png", images, "And 1 + 1?"))
    examples = [kind.process(r, tok, DataConfig(max_seq_len=600)) for r in rows]
    assert [e["status"] for e in examples] == ["ok"] * 3
    tools = load_tools([f"{agent_files}/my_tools.py:add"])
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok(call(2, 3), add_special_tokens=False)["input_ids"] + [stop]

    def played(which: list[int]):
        gen = FirstTurnCalls(HFGenerator(tok, 5, temperature=1.0), first)
        prompts = [examples[i]["prompt_ids"] for i in which]
        shown = [{k: examples[i][k] for k in IMAGE_COLUMNS} for i in which]
        boxes = [ToolBox(tools, 5.0, 100) for _ in which]
        return play(gen, model, tok, prompts, [11 + i for i in which], boxes, 2, 300, [stop], shown=shown)

    together = played([0, 1, 2])
    for i in (0, 2):
        alone = played([i])[0]
        assert alone.turns == 2 and alone.calls == 1 and alone.sampled.count(0) > 0
        assert alone.ids == together[i].ids and alone.logps == pytest.approx(together[i].logps, abs=1e-4)
        # The second turn's tokens (the episode's last), scored as training scores them.
        ex, last = examples[i], len(alone.logps)
        full = ex["prompt_ids"] + alone.ids
        row = {
            "input_ids": full,
            "images": ex["images"],
            "mm_token_type_ids": ex["mm_token_type_ids"] + [0] * len(alone.ids),
        }
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([full]), **image_inputs([row], len(full), processor_of(tok), 10**6)
            ).logits
        logits[..., placeholder_ids(model.config)] = float("-inf")  # never sampled (HFGenerator)
        logps = torch.log_softmax(logits[0, -last - 1 : -1].float(), -1).gather(1, torch.tensor(full[-last:])[:, None])
        assert alone.logps == pytest.approx(logps[:, 0].tolist(), abs=1e-4)


class Sevens:
    """A Generator whose every turn is '7' and the end of the turn."""

    def __init__(self, tok):
        self.tok, self.max_new_tokens = tok, 8
        self.stop = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, model, contexts, seeds, limits=None, shown=None):
        return Completions(
            [self.tok("7", add_special_tokens=False)["input_ids"] + [self.stop]] * len(contexts), [True] * len(contexts)
        )


def test_an_episode_trains_on_its_prompt_as_played_and_a_checkpoint_keeps_it(models, images, agent_files):
    """The environment's text joins the prompt, which is then cut from the left to its
    budget: the batch trained on holds the prompt as played, its per-token inputs marking
    its image tokens where they now are, and rollout.safetensors gives the round back whole."""
    import datasets

    from llmtrain.rl.loss import GRPOLoss
    from llmtrain.rl.rewards import Reward
    from llmtrain.rl.rollout import pack_samples, unpack_samples
    from tests.rl.test_rollout import OneProcess, settings

    cfg, tok = tool_tokenizer(models["qwen2_5_vl"])
    agent = agent_of(environment=f"{agent_files}/games.py:GuessingGame")
    kind = prompt_kind(8, agent=agent).images
    rows = [prompt_row(name, images, "Play.") for name in ("red.png", "green.png")]
    for r in rows:
        r["secret"] = 4
    data = datasets.Dataset.from_list([kind.process(r, tok, DataConfig(max_seq_len=600)) for r in rows])
    played = len(agent.start(data[0], tok).prompt_ids)
    agent.settings = AgentSettings(2, 5.0, 100, prompt_budget=played - 3, truncate=True)

    def nothing(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    source = Rollouts(
        settings(group=2, iterations=1, micro=2, accum=1, total_steps=lambda per_epoch: per_epoch),
        OneProcess(),
        load_model(cfg),
        tok,
        data,
        GRPOLoss("dapo"),
        Sevens(tok),
        [Reward("nothing", nothing, None)],
        None,
        lambda what: None,
        None,
        agent,
    )
    batch = next(iter(source.epoch(0)))
    image = batch["input_ids"] == tok.image_token_id
    assert image.sum(1).tolist() == [data[0]["prompt_ids"].count(tok.image_token_id)] * 4  # 2 prompts, 2 each
    assert torch.equal(batch["mm_token_type_ids"].bool(), image) and "pixel_values" in batch
    samples = source.current[2]
    assert all(len(s.prompt_ids) == played - 3 and s.inputs for s in samples)
    assert unpack_samples(pack_samples(samples, 0, 0))[2] == samples
