"""eval.tasks: generation tasks evaluated in any recipe's run and by `llmtrain eval`.

A task is a file of prompt rows (as recipes/grpo.py reads them: a 'prompt' and the columns
its reward functions read) and the functions that score the model's answers (as
grpo.rewards names them). At each evaluation the model answers every prompt
eval.tasks[].samples times (one greedy, or sampled with seeds of their own) and the
answers are scored: heldout.evaluate_prompts, the same evaluation as GRPO's held-out
reward, so a task's figures are the same on one process or many, at every evaluation of
the same weights, and with evaluation on or off the training is the same (generation draws
from seeded generators of its own and puts the model back in training mode).

The prompts are read and the functions loaded (`load`) before any weights load, so a bad
row or function stops the run at once; `bind` gives the tasks the prepared model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.launch import main_first
from ..errors import RewardError
from ..vision import IMAGE_COLUMNS
from .heldout import evaluate_prompts
from .prompts import as_rewards_see_all, check_prompts, decoded, prompt_kind
from .rewards import Reward, score, trainer_state
from .rollout import reward_labels
from .sampling import HFGenerator


@dataclass
class Task:
    """One eval.tasks entry, read: its settings (config EvalTask), prompts and functions."""

    settings: object  # config.schema.EvalTask
    prompts: object  # prepared prompt examples (prompts.prompt_kind)
    columns: set[str]  # every prompt row's columns, passed to each function
    rewards: list[Reward]
    labels: list[str]  # each function's name in the figures (rollout.reward_labels)


class Tasks:
    """The run's eval.tasks: `load` reads them, `bind` gives them the model, `evaluate`
    runs them all."""

    def __init__(self, tasks: list[Task], cfg, accelerator, tokenizer):
        self.tasks, self.cfg, self.accelerator, self.tokenizer = tasks, cfg, accelerator, tokenizer
        self.model = None
        self.synced = False
        self.beat = lambda what: None

    @classmethod
    def load(cls, cfg, accelerator, tokenizer) -> Tasks | None:
        """eval.tasks' prompts, tokenized as the run's data (data.max_seq_len leaving each
        task's max_new_tokens; the main process first, the others read its cache), and their
        reward functions checked against the rows; None without tasks."""
        if not cfg.eval.tasks:
            return None
        tasks = []
        for i, entry in enumerate(cfg.eval.tasks):
            key, names = f"eval.tasks[{i}]", entry.reward_names()
            with main_first(accelerator):
                prompts, stats = prompt_kind(entry.max_new_tokens).prepare(
                    f"{key}.prompts", [entry.prompts], tokenizer, cfg.data
                )
            accelerator.print(stats.summary(f"{key}.prompts ({entry.name})"))
            rewards, columns = check_prompts(
                f"{key}.prompts", [entry.prompts], prompts, names, entry.format_pattern, f"{key}.rewards"
            )
            tasks.append(Task(entry, prompts, columns, rewards, reward_labels(names)))
        return cls(tasks, cfg, accelerator, tokenizer)

    def bind(self, model, synced: bool, beat) -> None:
        """The prepared model the tasks are answered by (its unwrapped module generates);
        `synced`: a sharded model's generate calls are collectives (ZeRO-3, FSDP2 on several
        processes); `beat` tells the watchdog what a long wait is doing."""
        self.model, self.synced, self.beat = model, synced, beat

    def shown(self) -> set[str]:
        """The figures of each task a run prints: its reward and its pass@ of every sample."""
        return {f"eval_{t.settings.name}/{k}" for t in self.tasks for k in ("reward", f"pass@{t.settings.samples}")}

    def evaluate(self, step: int, total_steps: int = 0, epoch: int = 0) -> dict[str, float]:
        """Every task's figures at `step` (the reward functions see it as trainer_state)."""
        out: dict[str, float] = {}
        state = trainer_state(step, total_steps, epoch)
        micro = self.cfg.eval.micro_batch_size or self.cfg.train.micro_batch_size
        model = self.accelerator.unwrap_model(self.model)
        for task in self.tasks:
            t = task.settings
            pixels = self.cfg.data.max_image_pixels
            generator = HFGenerator(
                self.tokenizer, t.max_new_tokens, t.temperature, synced=self.synced, max_image_pixels=pixels
            )

            def draw(examples: list[dict], seeds, t=t, generator=generator) -> list[list[int]]:
                repeated = [e for e in examples for _ in range(t.samples)]
                shown = {}
                if "images" in repeated[0]:  # a vision-language model's prompts
                    shown = {"shown": [{k: e[k] for k in IMAGE_COLUMNS} for e in repeated]}
                return generator.generate(model, [list(e["prompt_ids"]) for e in repeated], seeds, **shown).ids

            def scored(examples: list[dict], ids: list[list[int]], task=task) -> torch.Tensor:
                asked, columns = [], []
                for ex in examples:
                    prompt, row = decoded(ex)
                    asked += [prompt] * task.settings.samples
                    columns += [row] * task.settings.samples
                texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
                prompts, completions = as_rewards_see_all(asked, texts)
                try:
                    return score(task.rewards, prompts, completions, ids, columns, state, task.columns)
                except RewardError as e:
                    raise RewardError(f"{e} (task {task.settings.name})") from None

            figures = evaluate_prompts(
                task.prompts,
                t.samples,
                self.cfg.train.seed,
                micro,
                self.accelerator,
                draw,
                scored,
                task.labels,
                torch.ones(len(task.labels)),
                t.pass_threshold,
                self.beat,
                prefix=f"eval_{t.name}/",
            )
            if len(task.labels) == 1:  # one function: its own figures are the task's
                figures = {k: v for k, v in figures.items() if not k.endswith(f"_{task.labels[0]}")}
            out |= figures
        return out
