"""Prompt rows for online RL: a `prompt` (a string, or a list of messages) plus any other
columns, which the reward functions receive (an `answer`, test cases, ...).

A string prompt is a user message when the tokenizer has a chat template (as in the
preference recipe), and plain text otherwise; messages are read as chat rows' are
(`data/rows.message`), data.system_prompt goes first where the prompt has no system
message, and the template is rendered with its generation prompt, so the model's
completion is the assistant's answer (or, after a last message of the assistant's own, the
rest of that message). A prompt must leave grpo.max_completion_length
tokens within data.max_seq_len: a longer one is dropped, refused or cut from the left,
by data.overlong. `prompt_kind` is the kind the one row pipeline (data/prepare.prepare)
makes of them.
"""

from __future__ import annotations

import hashlib
import json
from functools import partial

from ..config import DataConfig
from ..data.kind import DataKind
from ..data.packing import PackedDataset
from ..data.rows import (
    IGNORE,
    NothingToTrain,
    RowError,
    SystemPrompt,
    check_control_tokens,
    check_line,
    check_rendered,
    length_status,
    message,
    render_chat,
    text_of,
)
from ..errors import DataError, RewardError, ToolError, warn
from ..processor import processor_of
from ..vision import image_kind, kept_whole, no_inputs, read_images, with_images
from .rewards import PASSED, load_rewards, usable_answer


def prompt_messages(row: dict, tokenizer, cfg: DataConfig, images: list | None = None):
    """The row's prompt as the model is asked it: a message list, or a string without a
    chat template. `images` as rows.message takes it (a vision-language model's prompts)."""
    check_line(row)
    prompt = row.get("prompt")
    if prompt is None:
        raise RowError(f"a prompt row needs 'prompt' (a string or a list of messages); this row has {sorted(row)[:8]}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise NothingToTrain("empty prompt")
        if not tokenizer.chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, dict):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RowError("'prompt' must be a string or a non-empty list of {role, content} messages")
    messages = [message(m, i, "prompt", images) for i, m in enumerate(prompt)]
    messages = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, SystemPrompt(role="system", content=cfg.system_prompt))
    return messages


def prompt_ids(prompt, tokenizer, tools=None) -> list[int]:
    """The prompt's token ids: a string as it is; messages through the chat template
    (`prompt_text`)."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return tokenizer(prompt_text(prompt, tokenizer, tools), add_special_tokens=False)["input_ids"]


def prompt_tokens(prompt, tokenizer, tools, pictures: list) -> tuple[list[int], dict, list[int]]:
    """(ids, the processor's per-token inputs, the image tokens' positions) of a prompt
    (`prompt_ids`), with the tokens of its images `pictures` (decoded) inserted by the
    processor where the chat template put their placeholders."""
    if not pictures:
        ids = prompt_ids(prompt, tokenizer, tools)
        return ids, no_inputs(len(ids)), []
    text = prompt_text(prompt, tokenizer, tools)
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, _, inputs, at = with_images(processor_of(tokenizer), text, plain, [IGNORE] * len(plain), pictures)
    return ids, inputs, at


def prompt_text(prompt: list[dict], tokenizer, tools=None) -> str:
    """The chat template's text of prompt messages, with its generation prompt, or, when
    the last message is the assistant's (a prefilled start of the answer), stopping inside
    it for the model to continue, as TRL does."""
    check_control_tokens(prompt, tools, tokenizer)
    if prompt[-1]["role"] == "assistant" and not prompt[-1]["content"].strip():
        prompt = prompt[:-1]  # an empty start of the answer: the answer starts afresh
    prefilled = prompt[-1]["role"] == "assistant"

    def render(msgs, tools_=tools) -> str:
        return render_chat(tokenizer, msgs, tools_, generation_prompt=not prefilled, continue_final=prefilled)

    text = render(prompt)
    check_rendered(prompt, tools, text, render)
    return text


def as_rewards_see(prompt, text: str) -> tuple[object, object]:
    """(prompt, completion) as the reward functions receive them, as TRL gives them: for a
    string prompt the completion's text; for messages an assistant message, which begins
    with a prefilled last assistant message (taken from the prompt) where there is one."""
    if isinstance(prompt, str):
        return prompt, text
    if prompt and prompt[-1]["role"] == "assistant":  # its start, continued (or empty: none)
        return prompt[:-1], [{"role": "assistant", "content": prompt[-1]["content"] + text}]
    return prompt, [{"role": "assistant", "content": text}]


def as_rewards_see_all(prompts: list, texts: list[str]) -> tuple[list, list]:
    """(prompts, completions) of a batch, each as `as_rewards_see` gives them."""
    pairs = [as_rewards_see(p, t) for p, t in zip(prompts, texts)]
    return [p for p, _ in pairs], [c for _, c in pairs]


def asked(prompt) -> str:
    """What a prompt asks, for the log: a string, or its last message that is not the
    assistant's."""
    if isinstance(prompt, str):
        return prompt
    last = next((m for m in reversed(prompt) if m["role"] != "assistant"), prompt[-1])
    return text_of(last["content"])  # a vision-language model's: the text of its parts


def prompt_example(row: dict, tokenizer, cfg: DataConfig, max_completion_length: int, tools_for=None) -> dict | str:
    """One row -> {prompt_ids, prompt (JSON: the prompt as the reward functions see it: a
    string as given, or the messages), columns (JSON: the row's other fields), length,
    n_trained, status}, or why the row is dropped (the prompt kind's make). `tools_for(row)`:
    the schemas of the tools a multi-turn run's episodes of the row may call (agent.Agent),
    rendered into the prompt; the prompt is then always messages, as its episodes are. A
    vision-language model's prompts may show images (as chat rows do): the example then
    holds them as bytes, with the processor's per-token inputs
    (vision.IMAGE_COLUMNS), and the prompt is cut from the left only where every image
    token stays."""
    if tools_for is not None and not tokenizer.chat_template:
        raise RowError("grpo.tools and grpo.environment need a chat template, to render tools and their results")
    vision = processor_of(tokenizer) is not None
    refs: list | None = [] if vision else None
    prompt = prompt_messages(row, tokenizer, cfg, refs)
    images, pictures = read_images(refs, row, cfg) if vision else ([], [])
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list of tool definitions")
    if tools_for is not None:
        if tools is not None:
            raise RowError(
                "a row's 'tools' column describes tools that grpo.tools and grpo.environment do not call; remove it"
            )
        try:
            tools = tools_for(row) or None
        except ToolError as e:  # a row naming no environment of the run's: a bad row
            raise RowError(str(e)) from None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
    ids, inputs, at = prompt_tokens(prompt, tokenizer, tools, pictures)
    if not ids:
        return "empty prompt"
    budget = cfg.max_seq_len - max_completion_length
    status = length_status(len(ids), budget, cfg, f"{len(ids) + max_completion_length} tokens with the completion")
    if status == "truncated":
        if not kept_whole(at, len(ids) - budget, budget):
            return f"too long ({len(ids)} tokens, image tokens that a cut to leave the completion room would split)"
        inputs = {k: v[len(ids) - budget :] for k, v in inputs.items()}
        ids = ids[len(ids) - budget :]  # the end of a prompt is what it asks
    elif status != "ok":
        return status
    columns = {k: v for k, v in row.items() if k != "prompt" and not k.startswith("__")}
    # The rewards see the prompt as the row gives it, a string or messages, as in TRL (the
    # messages in a multi-turn run, whose completions are messages).
    shown = row["prompt"] if isinstance(row["prompt"], str) and tools_for is None else prompt
    example = {
        "prompt_ids": ids,
        "prompt": json.dumps(shown),
        "columns": json.dumps(columns, default=str),
        "length": len(ids),
        "n_trained": 0,
        "status": status,
    }
    return example | {"images": images} | inputs if vision else example


def prompt_source_columns(src, tokenizer, cfg: DataConfig) -> None:
    """A source of prompts has a 'prompt' column, and no column named like an argument
    that every reward call passes itself (the prompt kind's columns check)."""
    if "prompt" not in src.columns:
        raise DataError(
            f"{src.key}: {src.name}: prompt rows need a 'prompt' column (a string or a list of messages), plus the "
            f"columns your rewards read; found columns {sorted(src.columns)}"
        )
    check_column_names(src.columns, f"{src.key}: {src.name}")


def check_column_names(columns, where: str) -> None:
    """Refuse a column named like an argument every reward call passes itself
    (rewards.PASSED): the two cannot both reach a function (TRL's call fails on the
    duplicate keyword argument; taken silently, the column would replace the argument)."""
    if clash := sorted(set(columns) & set(PASSED)):
        raise DataError(
            f"{where}: column {', '.join(map(repr, clash))} has the name of an argument that every reward function "
            f"receives ({', '.join(PASSED)}), so the functions could not receive the column; rename it"
        )


def prompt_kind(max_completion_length: int, check_split=None, agent=None) -> DataKind:
    """The DataKind of recipes/grpo.py's prompts (never packed: completions are generated),
    which leave `max_completion_length` tokens of data.max_seq_len to the completion.
    `check_split(key, prompts)` sees each split as soon as it is read, before any weights
    load (the reward functions' parameters against its columns). With an `agent`
    (agent.Agent), each prompt renders the tools its episodes may call, and the cache key
    holds their schemas."""
    version = f"prompts-v2-{max_completion_length}"
    tools_for = None
    if agent is not None:
        described = json.dumps(agent.described(), sort_keys=True)
        version += f"-tools-{hashlib.sha256(described.encode()).hexdigest()[:16]}"
        tools_for = agent.schemas
    kind = DataKind(
        prompt_source_columns,
        version,
        partial(prompt_example, max_completion_length=max_completion_length, tools_for=tools_for),
        {"prompt_ids": [], "prompt": "", "columns": "", "length": 0, "n_trained": 0},
        PackedDataset,
        unit="prompts",
        batched=("prompts", "prompts"),
        check_split=check_split,
    )
    return image_kind(kind, f"{version}-images-v1")  # a vision-language model's prompts


def grpo_prompts(cfg, agent=None) -> DataKind:
    """recipes/grpo.py's data: prompt rows, each split's columns checked against the
    reward functions (grpo.rewards) as soon as it is read (`check_prompts`). With the
    `agent` of a multi-turn run (agent.Agent), prompts render the tools their episodes may
    call."""

    def check_split(key, prompts):
        files = cfg.data.names("eval" if key == "data.eval" else "train")
        check_prompts(key, files, prompts, cfg.reward_names(), cfg.grpo.format_pattern)

    return prompt_kind(cfg.grpo.max_completion_length, check_split, agent)


def check_prompts(
    key: str, files: list[str], prompts, names: list[str], pattern: str, rewards_key="grpo.rewards"
) -> tuple[list, set[str]]:
    """A split of prompts (`key`, read from `files`) against the reward functions `names`
    (the config key `rewards_key`; the format reward's `pattern`): every row's columns,
    and for the accuracy reward its answers: none usable is an error (the reward would
    teach nothing), some missing a warning (their completions go unscored). Returns the
    functions, loaded, and every row's columns."""
    columns, usable, rows = set(), 0, 0
    for text in prompts["columns"]:  # each row decoded once, for all three checks
        row = json.loads(text)
        columns |= row.keys()
        usable += usable_answer(row.get("answer"))
        rows += 1
    # The sources' checks saw the columns of their first rows; here are every row's.
    check_column_names(columns, f"{key} ({', '.join(files)}): a row")
    conversations = any(p.startswith("[") for p in prompts["prompt"])  # each a JSON string or message list
    try:
        rewards = load_rewards(names, columns, pattern, conversations, rewards_key)
    except RewardError as e:
        raise RewardError(f"{e} ({key})") from None
    if "accuracy" not in names:
        return rewards, columns
    if usable == 0:
        raise RewardError(
            f"{rewards_key}: accuracy: no prompt of {key} has a usable 'answer' (text or a number), so it would "
            "score no completion; fix the answers, or use other rewards"
        )
    if usable < rows:
        warn(
            f"{rewards_key}: accuracy: {rows - usable} of {rows} prompts of {key} have no usable 'answer' (text "
            "or a number); their completions go unscored by it"
        )
    return rewards, columns


def prompt_columns(prompts) -> set[str]:
    """The columns the prompt rows carry besides the prompt (any row's)."""
    found: set[str] = set()
    for text in prompts["columns"]:
        found |= set(json.loads(text))
    return found


def decoded(example: dict) -> tuple[object, dict]:
    """(prompt, other columns) of a prepared example, as the reward functions receive them."""
    return json.loads(example["prompt"]), json.loads(example["columns"])
