"""Reward functions (grpo.rewards): the built-ins and the user's own, loaded by name and
called with TRL's signature, so functions written for TRL's GRPOTrainer work unchanged:

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

`prompts` and `completions` are strings, or message lists where the data's prompts are
messages (a completion is then [{"role": "assistant", "content": ...}]); the keyword
arguments are the data set's other columns (one value per completion) and
`trainer_state` (global_step, max_steps, epoch). A function names only the columns it
reads, or takes **kwargs. None (or NaN) leaves a completion unscored by that function.

A user's file is loaded by its path under a module name of its own (usercode.load_function), its
import and every call run contained (usercode.contained: whatever it raises, an exit
included, is one line; the process state it changes is put back), and every call gets its own
copies of its arguments, so no edit reaches the tokens that are trained or the next function.
Every call is checked: an exception, a wrong signature, a column the data lacks, or
anything but a number or None per completion is one line naming the function
(`RewardError`). The first generation batch is scored before any update, so a broken
function stops the run before it has trained anything.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..data.answers import answer_ids
from ..errors import RewardError, shown
from ..model import check_reference, load_error
from ..usercode import contained, load_function

STANDARD = ("prompts", "completions", "completion_ids")
PASSED = (*STANDARD, "trainer_state")  # what every call passes itself: no data column may take these names
FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards are held and combined in float32


def completion_text(completion) -> str:
    """A completion as text: a string, or a message list's answer: its last assistant
    message's content (an episode's last turn, after its tool calls and their results; a
    single turn's only message)."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role", "assistant") == "assistant"]
    return (said[-1].get("content") or "") if said else ""


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def accuracy(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 where the completion gives the row's `answer`, else 0.0 (None where the row has
    no answer it can compare: none, blank, or neither text nor a number). A numeric answer
    is compared as a number with the completion's last number (or its \\boxed{...}), so
    '1,000', '1000.0' and 'The answer is 1000' all match 1000; any other answer must be the
    whole completion, spaces and a final period aside."""
    out = []
    for completion, right in zip(completions, answer):
        if not usable_answer(right):  # none, or a list or mapping: nothing to compare with
            out.append(None)
            continue
        text = completion_text(completion).strip()
        boxed = BOXED.findall(text)
        text = boxed[-1].strip() if boxed else text
        want = as_number(str(right))
        if want is not None:
            found = NUMBER.findall(text)
            got = as_number(found[-1]) if found else None
            out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
        else:
            out.append(float(text.rstrip(".").strip() == str(right).strip().rstrip(".").strip()))
    return out


def usable_answer(answer) -> bool:
    """Text that is not blank, or a number: what accuracy compares a completion with."""
    if isinstance(answer, str):
        return bool(answer.strip())
    return isinstance(answer, (int, float)) and not isinstance(answer, bool)


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def format(completions, **kwargs) -> list[float]:  # noqa: A001 (the reward's name in the config)
        """1.0 where the whole completion (stripped) matches grpo.format_pattern, else 0.0."""
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return format


REWARD_MODEL = "reward_model:"


class RewardModelScore:
    """grpo.rewards=[reward_model:DIR]: a completion's reward is the score a reward model
    (recipes/reward.py's final/, or any one-label AutoModelForSequenceClassification) gives
    its prompt and completion, rendered as that recipe renders a pair's answer (the reward
    model's own chat template). Each process loads the model whole on its device, once, at
    the first call; an empty completion is left unscored."""

    batch = 16

    def __init__(self, spec: str, key: str = "grpo.rewards"):
        self.path, self.key = spec[len(REWARD_MODEL) :], key
        self.model = self.tokenizer = None
        from transformers import AutoConfig

        where = f"{key}: {spec}"
        try:
            config = AutoConfig.from_pretrained(self.path)
        except Exception as e:
            given = lambda path: f"{key}=[{REWARD_MODEL}{path}]"  # noqa: E731
            raise RewardError(str(load_error("a model config", self.path, e, where, given))) from None
        archs = getattr(config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in archs) or config.num_labels != 1:
            raise RewardError(
                f"{where}: {archs or 'this model'} with {config.num_labels} labels is not a reward model; give a "
                "one-label sequence-classification model (recipes/reward.py's final/)"
            )
        self.max_len = getattr(config, "max_position_embeddings", None)

    def load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)

    def check_prompts(self, conversations: bool) -> None:
        """Conversation prompts are rendered with the reward model's chat template, which
        it must have (checked once the data is read, before any weights load)."""
        if conversations:
            self.load_tokenizer()
            if not self.tokenizer.chat_template:
                raise RewardError(
                    f"{self.key}: {REWARD_MODEL}{self.path}: its tokenizer has no chat template to render the "
                    "prompts' conversations with; give it the template it was trained with (tokenizer_config.json), "
                    "or use text prompts"
                )

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.load_tokenizer()
        self.model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype="auto").to(device).eval()

    def ids(self, prompt, completion) -> list[int]:
        if isinstance(completion, str) and (not isinstance(prompt, str) or self.tokenizer.chat_template):
            completion = [{"role": "assistant", "content": completion}]
        if isinstance(prompt, str) and self.tokenizer.chat_template:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str) and not isinstance(completion, str):
            completion = completion_text(completion)
        ids = answer_ids(prompt, completion, self.tokenizer)[0]
        return ids[-self.max_len :] if self.max_len else ids  # the score is read at the end

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        if self.model is None:
            self.load()
        pad = self.model.config.pad_token_id
        rows = [self.ids(p, c) for p, c in zip(prompts, completions)]
        scores: list[float | None] = [None] * len(rows)
        todo = [i for i, ids in enumerate(rows) if ids]
        step = self.batch if pad is not None else 1  # without a pad token transformers scores one row at a time
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            width = max(len(rows[i]) for i in chunk)
            ids = torch.tensor([rows[i] + [pad] * (width - len(rows[i])) for i in chunk], device=self.model.device)
            mask = torch.tensor([[1] * len(rows[i]) + [0] * (width - len(rows[i])) for i in chunk], device=ids.device)
            for i, value in zip(chunk, self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()):
                scores[i] = value
        return scores


@dataclass
class Reward:
    name: str  # as grpo.rewards gives it
    fn: Callable
    takes: set[str] | None  # the keyword arguments it accepts; None: any (**kwargs)
    file: str | None = None  # the user's file that defines it (None: a built-in)
    key: str = "grpo.rewards"  # the config key that names it, for its errors

    def __call__(self, prompts, completions, completion_ids, columns: dict[str, list], state) -> list[float]:
        given = columns | {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        given["trainer_state"] = state
        if self.takes is not None:
            given = {k: v for k, v in given.items() if k in self.takes}
        # The function's own copies: an edit in place never reaches the tokens that are
        # trained, the rows, or what the next function receives (TRL passes copies too).
        given = copy.deepcopy(given)
        with contained(f"{self.key}: {self.name}", RewardError, "fix the function", self.file):
            out = self.fn(**given)
        return self.checked(out, len(completions))

    def checked(self, out, n: int) -> list[float]:
        if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":  # arrays, as TRL takes them
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else shown(out)
            raise RewardError(
                f"{self.key}: {self.name} returned {got} for {n} completions; return a list with one number (or "
                "None) per completion"
            )
        values = []
        for i, v in enumerate(out):
            if v is None:
                values.append(math.nan)
            elif isinstance(v, numbers.Real) and (math.isnan(v) or abs(v) <= FLOAT32_MAX):  # NaN: unscored
                values.append(float(v))
            else:
                raise RewardError(
                    f"{self.key}: {self.name} returned {shown(v)} for completion {i}; return a finite number "
                    "(within float32's range) or None per completion"
                )
        return values


BUILTINS = "a built-in (accuracy, format, reward_model:DIR)"


def load_rewards(
    names: list[str],
    columns: set[str] | None,
    format_pattern: str = "",
    conversations: bool = False,
    key: str = "grpo.rewards",
) -> list[Reward]:
    """The reward functions of grpo.rewards (or of the config key `key`: an evaluation
    task's), checked against the data's columns (None: not known yet): a parameter without a
    default that is neither a standard argument nor a column is an error now, not at the
    first call; so is a reward model without a chat template for prompts that are
    `conversations`."""
    rewards = []
    for name in names:
        file = None
        if name == "accuracy":
            fn = accuracy
            if columns is not None and "answer" not in columns:
                raise RewardError(
                    f"{key}: accuracy compares completions with an 'answer' column, which the prompt data "
                    f"lacks (its columns: {sorted(columns)}); add one, or use other rewards"
                )
        elif name == "format":
            fn = format_reward(format_pattern)
        elif name.startswith(REWARD_MODEL):
            fn = RewardModelScore(name, key)
            fn.check_prompts(conversations)
        else:
            fn, file = load_function(name, key, RewardError, BUILTINS)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = None
        takes = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
            takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
            if positional_only:
                raise RewardError(
                    f"{key}: {name} takes {positional_only} by position only; rewards are called with keyword "
                    f"arguments ({', '.join(STANDARD)}, the data's columns)"
                )
        if params is not None and columns is not None:
            needed = [
                p.name
                for p in params
                if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.name not in (*STANDARD, "trainer_state")
            ]
            missing = [n for n in needed if n not in columns]
            if missing:
                raise RewardError(
                    f"{key}: {name} needs column(s) {missing}, which the prompt data lacks (its columns: "
                    f"{sorted(columns)}); add them to the rows or give the parameters defaults"
                )
        rewards.append(Reward(name, fn, takes, file, key))
    return rewards


def check_grpo(cfg, tokenizer) -> None:
    """recipes/grpo.py's start-up checks, before any data or weights load: grpo.reference
    reads the policy's token ids, and every reward function loads (its columns are checked
    once the data is read: prompts.grpo_prompts)."""
    check_reference(cfg.grpo.reference, "grpo.reference", cfg.model, tokenizer)
    load_rewards(cfg.reward_names(), None, cfg.grpo.format_pattern)


def score(
    rewards: list[Reward],
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: list[dict],
    state,
    names: set[str] = frozenset(),
) -> torch.Tensor:
    """[completions, functions] rewards, NaN where a function left a completion unscored.
    Every column in `names` (the data's, any row's) is passed, None where a row lacks it, as
    TRL passes a dataset's columns: what a function receives must not depend on which rows
    were drawn together."""
    keys = sorted(names | {k for c in columns for k in c})
    by_column = {k: [c.get(k) for c in columns] for k in keys}
    table = [r(prompts, completions, completion_ids, by_column, state) for r in rewards]
    return torch.tensor(table, dtype=torch.float32).T.reshape(len(completions), len(rewards))


def even_tokens(completion_ids, **kwargs) -> list[float]:
    """The share of a completion's token ids that are even: a reward whose values a random
    model's completions spread over (`llmtrain verify` adds it, so that its runs of a
    shrunk random model have advantages to train on)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainer_state(step: int, max_steps: int, epoch: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=max_steps, epoch=epoch)
