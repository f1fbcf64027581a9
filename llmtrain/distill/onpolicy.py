"""The steps whose answers the student samples itself (distill.on_policy_fraction): the
training micro-batches of recipes/distill.py, made from the prepared rows as the loop draws
them.

Each step of a pass is on-policy or not by a coin seeded from (train.seed, pass, the step's
number in the pass), as GKD draws a batch on-policy with probability lambda (TRL's lmbda),
and an on-policy row's answer is sampled from a seed of (train.seed, pass, the row's index in
the training set) (rl/sampling.sample_seed). Neither depends on the number of processes, the
micro-batch size or where a resumed run restarted: a step's batch is a function of its
position and the student's weights, which a checkpoint keeps, and nothing else needs saving.
An on-policy row is the row's prompt (its tokens before its last trained span: for a chat row,
everything before the last assistant answer, as TRL's GKD takes the prompt) and the student's
answer, sampled at distill.temperature up to distill.max_completion_length tokens or the end
of its turn; only that answer is trained. Other steps train on the data's rows, with their
own labels.

A run with on-policy steps trains whole steps only: the last incomplete global batch of a
pass is left out, as GRPO leaves out an incomplete round (`whole_steps`), so that every
process draws the same micro-batches in every step. Under ZeRO-3 and FSDP2 each forward of
generation is a collective, and every process then makes the same generate calls.

The student generates with transformers' `generate` on the training model (rl/sampling's
HFGenerator), one call per on-policy micro-batch.
"""

from __future__ import annotations

import torch
from accelerate.utils import send_to_device

from ..data.batches import Collator
from ..data.rows import IGNORE, shift
from ..errors import DataError
from ..processor import SEQUENCE_INPUTS
from ..rl.sampling import sample_seed
from ..vision import IMAGE_COLUMNS, extended, image_inputs

INDEX = "index"  # the column numbering the training rows (the data kind's index)


class DistillCollator(Collator):
    """Pads examples as SFT's collator does and keeps each row's index (and whether it is on
    the student's own answer, `on_policy`). A vision-language model's (with its `processor`)
    also carry what the model reads of their images, and the images themselves with their
    per-token inputs (`shown`, vision.IMAGE_COLUMNS), which the student's answers are
    sampled with."""

    columns = ("input_ids", "labels", INDEX)

    def __init__(self, pad_id: int, processor=None, max_pixels: int = 0):
        super().__init__(pad_id)
        self.processor, self.max_pixels = processor, max_pixels
        if processor is not None:
            self.columns = (*DistillCollator.columns, *IMAGE_COLUMNS)

    def __call__(self, examples: list[dict]) -> dict:
        batch = super().__call__(examples)
        batch[INDEX] = torch.tensor([e.get(INDEX, -1) for e in examples], dtype=torch.long)
        batch["on_policy"] = torch.tensor([float(e.get("on_policy", 0.0)) for e in examples])
        if self.processor is not None:
            batch |= image_inputs(examples, batch["input_ids"].shape[1], self.processor, self.max_pixels)
            batch["shown"] = [{k: e[k] for k in IMAGE_COLUMNS if k in e} for e in examples]
        return batch


def shown(batch: dict, r: int) -> dict:
    """Row `r`'s images and per-token inputs (vision.IMAGE_COLUMNS) where the batch has them."""
    return dict(batch["shown"][r]) if "shown" in batch else {}


def cut_to(row: dict, n: int) -> dict:
    """A row's images with its per-token inputs cut to its first `n` tokens (its prompt)."""
    return {k: v[:n] if k in SEQUENCE_INPUTS else v for k, v in row.items() if k in IMAGE_COLUMNS}


def on_policy_step(seed: int, epoch: int, step: int, fraction: float) -> bool:
    """Whether step `step` of pass `epoch` trains on the student's own answers: a coin seeded
    by the three, heads with probability `fraction`."""
    if fraction >= 1:
        return True
    return sample_seed(seed, epoch, step, 1) / 2**63 < fraction


def whole_steps(rows: int, micro: int, accum: int, world: int) -> int:
    """Optimizer steps of whole global batches in a pass over `rows` rows."""
    return rows // (micro * accum * world)


def prompt_length(input_ids: list[int], labels: list[int]) -> int | None:
    """The tokens before a row's last trained span (labels shifted: labels[i] trains token
    i + 1), or None for a row with nothing trained."""
    end = next((i for i in range(len(labels) - 1, -1, -1) if labels[i] != IGNORE), None)
    if end is None:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return start + 1


class OnPolicyBatches:
    """The loop's data source (core/source.Batches) for a run with on-policy steps: `rows`
    (source.LoaderBatches over the prepared rows, with DistillCollator; `accum` micro-batches
    a step on each process), `steps` whole steps a pass, with each on-policy micro-batch's
    rows answered by `generator` from `model` (module docstring)."""

    def __init__(
        self,
        rows,
        generator,
        model,
        collator: DistillCollator,
        seed: int,
        fraction: float,
        max_len: int,
        accum: int,
        steps: int,
    ):
        if steps == 0:
            raise DataError(
                "data.train: fewer rows than one step's global batch (train.micro_batch_size x "
                "train.grad_accum_steps x processes), and with distill.on_policy_fraction > 0 only whole steps are "
                "trained; give more rows or lower those"
            )
        self.rows, self.generator, self.model, self.collator = rows, generator, model, collator
        self.seed, self.fraction, self.max_len, self.accum = seed, fraction, max_len, accum
        self.items, self.steps_per_epoch, self.metrics = rows.items, steps, rows.metrics
        self.evaluates = rows.evaluates

    def epoch(self, epoch: int, skip: int = 0):
        for k, batch in enumerate(self.rows.epoch(epoch, skip), start=skip):
            if k >= self.steps_per_epoch * self.accum:  # the pass's last, incomplete global batch
                return
            on = on_policy_step(self.seed, epoch, k // self.accum, self.fraction)
            yield self.answered(batch, epoch) if on else batch

    def answered(self, batch: dict, epoch: int) -> dict:
        """The micro-batch with its rows' answers sampled by the student."""
        rows = []
        for r in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][r].sum())
            ids, labels = batch["input_ids"][r, :n].tolist(), batch["labels"][r, :n].tolist()
            rows.append({"input_ids": ids, "labels": labels, INDEX: int(batch[INDEX][r])} | shown(batch, r))
        lengths = {r: prompt_length(row["input_ids"], row["labels"]) for r, row in enumerate(rows) if row[INDEX] >= 0}
        chosen = [r for r, n in lengths.items() if n is not None]
        prompts = [rows[r]["input_ids"][: lengths[r]] for r in chosen]
        seeds = [sample_seed(self.seed, epoch, rows[r][INDEX], 0) for r in chosen]
        limits = [max(1, self.max_len - len(p)) for p in prompts]
        if not chosen:
            if getattr(self.generator, "synced", False):  # the other processes generate: a collective
                self.generator.generate(self.model, [batch["input_ids"][0, :1].tolist()], [0], [1])
            return batch
        # A vision-language model's prompts are answered with their images in view.
        cut = [cut_to(rows[r], len(p)) for r, p in zip(chosen, prompts)]
        images = {"shown": cut} if "shown" in batch else {}
        out = self.generator.generate(self.model, prompts, seeds, limits, **images)
        for r, prompt, answer, limit, before in zip(chosen, prompts, out.ids, limits, cut):
            answer = answer[:limit]
            labels = shift([IGNORE] * len(prompt) + answer)
            rows[r] |= {"input_ids": prompt + answer, "labels": labels, "on_policy": 1.0}
            rows[r] |= extended(before, len(answer))
        return send_to_device(self.collator(rows), batch["input_ids"].device)

    def empty_batch(self) -> dict:
        return self.rows.empty_batch()

    def saved(self, batches_in_epoch: int):
        return None  # a step's rows and answers follow from the position and the weights

    def restore(self, tensors) -> None:
        pass

    def evaluate(self, step: int) -> dict[str, float]:
        return self.rows.evaluate(step)  # the divergence on the held-out rows' own answers

    def shown(self) -> list[str]:
        return []
