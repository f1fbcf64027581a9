"""Rollouts: the training micro-batches of recipes/grpo.py, generated from the policy as
the loop draws them (the loop's `data`, in place of batches.TrainBatches).

A pass over the prompts is a seeded order (batches.EpochSampler: seed and pass only). Its
generation rounds take P = train.micro_batch_size x train.grad_accum_steps x processes
prompts each, in order, whatever the layout; the last incomplete round is left out. In a
round each process generates grpo.num_generations completions for each of its prompts
(sampling.sample_seed: a seed per completion, so layout and resume never change one),
scores them, and the rewards of the whole global batch go to every process for the
advantages (groups are never split). The round's micro-batches (train.micro_batch_size
prompts' completions each) then feed grpo.num_iterations optimizer steps; from the
second on, the loss compares with the log-probs the completions were sampled with, and a
checkpoint taken within the round keeps the round (`saved`), so a resumed run trains on
the very completions the interrupted one had.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object, send_to_device

from ..data.batches import Collator, EpochSampler
from ..data.mixture import Mixture
from ..data.rows import IGNORE, shift
from ..errors import DataError, RewardError
from .loss import advantages, nanstd
from .prompts import as_rewards_see_all, asked, decoded, prompt_columns
from .rewards import score, trainer_state
from .sampling import sample_seed


@dataclass
class Sample:
    """One completion of one prompt, with what training on it needs."""

    position: int  # the prompt's place in the pass
    index: int  # the completion's number in its group
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    old_logps: list[float] | None = None
    ref_logps: list[float] | None = None


class Rollouts:
    def __init__(
        self, cfg, accelerator, model, tokenizer, prompts, eval_set, objective, generator, rewards, reference, beat
    ):
        g, t = cfg.grpo, cfg.train
        self.items = "prompts"
        self.eval_set, self.evaluates = eval_set, eval_set is not None
        self.cfg, self.accelerator, self.model, self.tokenizer = cfg, accelerator, model, tokenizer
        self.objective, self.generator, self.rewards, self.reference, self.beat = (
            objective,
            generator,
            rewards,
            reference,
            beat,
        )
        self.group, self.iterations = g.num_generations, g.num_iterations
        self.micro, self.accum, self.world = t.micro_batch_size, t.grad_accum_steps, accelerator.num_processes
        self.local = self.micro * self.accum  # prompts per process and round
        self.per_round = self.local * self.world
        mix = prompts.mix if isinstance(prompts, Mixture) else None
        self.prompts = prompts.examples if isinstance(prompts, Mixture) else prompts
        self.sampler = EpochSampler(len(self.prompts), t.seed, cfg.data.shuffle, mix)
        self.columns = prompt_columns(self.prompts)  # every row's, for the reward functions
        self.eval_columns: set[str] | None = None
        self.labels = reward_labels([r.name for r in rewards])  # each reward's name in the metrics
        self.rounds = len(self.sampler) // self.per_round
        if self.rounds == 0:
            raise DataError(
                f"data.train: {len(self.sampler)} prompts per pass, fewer than one step's {self.per_round} "
                f"(train.micro_batch_size={self.micro} x train.grad_accum_steps={self.accum} x {self.world} "
                "process(es)); give more prompts or lower those"
            )
        self.steps_per_epoch = self.rounds * self.iterations
        weights = g.reward_weights or [1.0] * len(rewards)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.collator = Collator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.metrics: dict[str, float] = {}  # the current round's, logged with each of its steps
        self.samples_shown: list[str] = []
        self.current: tuple[int, int, list[Sample]] | None = None  # (epoch, round, this process's samples)
        self.restored: tuple[int, int, list[Sample]] | None = None
        self.total_steps = t.total_steps(self.steps_per_epoch)  # for the rewards' trainer_state

    # --- the loop's view -----------------------------------------------------------------

    def epoch(self, epoch: int, skip: int = 0):
        """An iterator over pass `epoch`'s micro-batches after its first `skip` (whole steps)."""
        per_round = self.accum * self.iterations
        first, within = divmod(skip, per_round)
        self.sampler.set_epoch(epoch)
        order = list(iter(self.sampler))
        for r in range(first, self.rounds):
            if r == first and within:
                samples = self.resumed(epoch, r)
            else:
                samples = self.generate(epoch, r, order[r * self.per_round : (r + 1) * self.per_round])
            self.current = (epoch, r, samples)
            batches = self.micro_batches(samples)
            for k in range(within if r == first else 0, per_round):
                yield batches[k % self.accum]

    def saved(self, batches_in_epoch: int) -> dict[str, torch.Tensor] | None:
        """What a checkpoint at this position must keep: the round in progress, whole (every
        process's samples), when the next step is not its first; else None. Called on
        every process (a collective)."""
        if (batches_in_epoch // self.accum) % self.iterations == 0 or self.current is None:
            return None
        e, r, samples = self.current
        every = [s for part in gather_object([samples]) for s in part]
        metrics = {f"metric.{k}": torch.tensor(v, dtype=torch.float64) for k, v in self.metrics.items()}
        return pack_samples(every, e, r) | metrics  # the round's metrics: logged with its later steps too

    def restore(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """A checkpoint's round in progress (from `saved`), taken up by `epoch` on resume."""
        if tensors is None:
            return
        e, r, samples = unpack_samples(tensors)
        self.metrics = {k.removeprefix("metric."): float(v) for k, v in tensors.items() if k.startswith("metric.")}
        mine = range(self.accelerator.process_index * self.local, (self.accelerator.process_index + 1) * self.local)
        start = r * self.per_round
        self.restored = (e, r, [s for s in samples if s.position - start in mine])

    def resumed(self, epoch: int, r: int) -> list[Sample]:
        if self.restored is None or self.restored[:2] != (epoch, r):
            raise DataError(
                f"checkpoint.resume: the checkpoint stops within generation round {r} of pass {epoch} but does not "
                "hold that round's completions (rollout.safetensors); resume from another checkpoint"
            )
        return self.restored[2]

    # --- a round -------------------------------------------------------------------------

    def generate(self, epoch: int, r: int, order: list[int]) -> list[Sample]:
        rank = self.accelerator.process_index
        first = r * self.per_round + rank * self.local  # this process's first prompt position
        mine = order[rank * self.local : (rank + 1) * self.local]
        examples = [self.prompts[i] for i in mine]
        started = time.perf_counter()
        samples, ended = [], []
        for m in range(0, self.local, self.micro):
            self.beat(f"generating completions for prompts {first + m} to {first + m + self.micro - 1}")
            prompts, seeds, positions = [], [], []
            for k, ex in enumerate(examples[m : m + self.micro]):
                for j in range(self.group):
                    prompts.append(list(ex["prompt_ids"]))
                    seeds.append(sample_seed(self.cfg.train.seed, epoch, first + m + k, j))
                    positions.append((first + m + k, j))
            out = self.generator.generate(self.model_for_generation(), prompts, seeds)
            samples += [Sample(p, j, ids, c) for (p, j), ids, c in zip(positions, prompts, out.ids)]
            ended += out.ended
        generation_s = time.perf_counter() - started
        self.beat("scoring completions")
        texts = [self.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
        table, failure = self.score(examples, samples, texts, epoch * self.steps_per_epoch + r * self.iterations)
        k = len(self.rewards)
        lengths = [[len(s.completion_ids), float(not e)] for s, e in zip(samples, ended)]
        local = torch.cat([table, torch.full((len(samples), 1), float(bool(failure))), torch.tensor(lengths)], 1)
        # One exchange: every process's rewards (for the advantages), failures, lengths.
        everyone = self.accelerator.gather(local.to(self.accelerator.device)).cpu()
        if everyone[:, k].any():  # a reward function failed somewhere: all stop, with its line
            raise RewardError(next(m for m in gather_object([failure]) if m))
        rewards = everyone[:, :k]
        adv, total, zero_spread = advantages(rewards, self.weights, self.group, self.cfg.grpo.scale_rewards)
        mine = slice(rank * len(samples), (rank + 1) * len(samples))
        for s, a in zip(samples, adv[mine].tolist()):
            s.advantage = a
        self.metrics = self.round_metrics(rewards, total, zero_spread, everyone[:, k + 1], everyone[:, k + 2])
        self.metrics["generation_s"] = generation_s
        self.show(examples, texts, total[mine])
        self.beat("computing the log-probs the completions were sampled with")
        self.log_probs(samples)
        return samples

    def score(self, examples: list[dict], samples: list[Sample], texts: list[str], step: int):
        """([completions, functions] rewards, ''), or (NaN, the error line) when a function
        failed: raised on every process together, after the exchange."""
        asked_as, columns = [], []
        for ex in examples:
            p, c = decoded(ex)
            asked_as += [p] * self.group
            columns += [c] * self.group
        prompts, completions = as_rewards_see_all(asked_as, texts)
        ids = [s.completion_ids for s in samples]
        state = trainer_state(step, self.total_steps, step // self.steps_per_epoch)
        try:
            return score(self.rewards, prompts, completions, ids, columns, state, self.columns), ""
        except RewardError as e:
            return torch.full((len(samples), len(self.rewards)), float("nan")), str(e)

    def round_metrics(self, rewards, total, zero_spread, lengths, clipped) -> dict[str, float]:
        out = {"reward": float(total.nanmean()), "reward_std": float(nanstd(total))}
        for i, name in enumerate(self.labels):
            column = rewards[:, i]
            out[f"reward_{name}"] = float(column.nanmean())
            out[f"reward_{name}_std"] = float(nanstd(column))
        out |= {
            "zero_spread_groups": float(zero_spread.float().mean()),
            "completion_len": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "clipped_completions": float(clipped.mean()),
        }
        return {k: v for k, v in out.items() if not math.isnan(v)}

    def show(self, examples: list[dict], texts: list[str], total: torch.Tensor) -> None:
        """The first completion of each of the first grpo.log_completions prompts, for the log."""
        self.samples_shown = []
        for k in range(min(self.cfg.grpo.log_completions, len(examples))):
            i = k * self.group
            question = asked(json.loads(examples[k]["prompt"]))
            self.samples_shown.append(f"completion> {question!r} -> {texts[i]!r} (reward {float(total[i]):.3g})")

    # --- evaluation ----------------------------------------------------------------------

    def shown(self) -> list[str]:
        """The completions `show` picked, once."""
        lines, self.samples_shown = self.samples_shown, []
        return lines

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out reward at `step`: one greedy completion per evaluation prompt, scored
        by every reward function (which see the training state, as in training). Each process
        takes every world-th prompt, all in the same number of generate calls (sharded
        models generate together)."""
        eval_set = self.eval_set
        n, rank = len(eval_set), self.accelerator.process_index
        state = trainer_state(step, self.total_steps, step // self.steps_per_epoch)
        if self.eval_columns is None:  # read once: the evaluation prompts stay the same
            self.eval_columns = prompt_columns(eval_set)
        names = self.eval_columns
        mine = list(range(rank, n, self.world))
        calls = math.ceil(math.ceil(n / self.world) / self.micro)
        table = []
        for c in range(calls):
            self.beat(f"evaluating: generating for evaluation prompts, batch {c + 1} of {calls}")
            part = mine[c * self.micro : (c + 1) * self.micro]
            examples = [eval_set[i] for i in part] or [eval_set[0]]  # a process with none still generates
            out = self.generator.generate(self.model_for_generation(), [list(e["prompt_ids"]) for e in examples], None)
            if not part:
                continue
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in out.ids]
            asked_as, columns = zip(*(decoded(e) for e in examples))
            prompts, completions = as_rewards_see_all(asked_as, texts)
            try:
                rewards = score(self.rewards, prompts, completions, out.ids, list(columns), state, names)
            except RewardError as e:
                raise RewardError(f"{e} (on the evaluation prompts)") from None
            table.append(rewards)
        local = torch.cat(table) if table else torch.zeros(0, len(self.rewards))
        sums = torch.stack([local.nan_to_num(0).sum(0), (~local.isnan()).sum(0).float()])
        total = (local * self.weights).nansum(1)
        weighted = torch.tensor([[float(total.sum()), float(len(total))]])
        both = torch.cat([sums.reshape(1, -1), weighted], 1).to(self.accelerator.device)
        summed = self.accelerator.reduce(both, reduction="sum").cpu()[0]
        k = len(self.rewards)
        out = {"eval_reward": float(summed[-2] / summed[-1])}
        for i, name in enumerate(self.labels):
            if summed[k + i] > 0:
                out[f"eval_reward_{name}"] = float(summed[i] / summed[k + i])
        return out

    def log_probs(self, samples: list[Sample]) -> None:
        """old_logps (needed from a round's second step on) and ref_logps (grpo.beta > 0),
        one no-grad pass per micro-batch, as the policy stands before the round's updates."""
        if self.iterations == 1 and self.reference is None:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            for m in range(0, len(samples), self.micro * self.group):
                part = samples[m : m + self.micro * self.group]
                batch = send_to_device(self.collate(part), self.accelerator.device)
                lengths = [len(s.completion_ids) for s in part]
                with torch.no_grad():
                    if self.iterations > 1:
                        for s, v in zip(part, split(self.objective.logps(self.model, batch), lengths)):
                            s.old_logps = v
                    if self.reference is not None:
                        for s, v in zip(part, split(self.reference(batch), lengths)):
                            s.ref_logps = v
        finally:
            self.model.train(was_training)

    def model_for_generation(self):
        """The module whose generate() runs: the model inside the DDP, DeepSpeed or FSDP
        wrapper (whose own forward, with mixed precision, it keeps)."""
        return self.accelerator.unwrap_model(self.model)

    def collate(self, samples: list[Sample]) -> dict:
        rows = []
        for s in samples:
            labels = [IGNORE] * len(s.prompt_ids) + list(s.completion_ids)
            rows.append({"input_ids": s.prompt_ids + s.completion_ids, "labels": shift(labels)})
        batch = self.collator(rows)
        batch["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        for key in ("old_logps", "ref_logps"):
            if all(getattr(s, key) is not None for s in samples) and samples:
                aligned = torch.zeros(batch["labels"].shape, dtype=torch.float32)
                for row, s in enumerate(samples):
                    start = len(s.prompt_ids) - 1  # the position that predicts the first completion token
                    aligned[row, start : start + len(s.completion_ids)] = torch.tensor(getattr(s, key))
                batch[key] = aligned
        return batch

    def micro_batches(self, samples: list[Sample]) -> list[dict]:
        size = self.micro * self.group
        return [
            send_to_device(self.collate(samples[m : m + size]), self.accelerator.device)
            for m in range(0, len(samples), size)
        ]

    def empty_batch(self) -> dict:
        """A batch with nothing to train (batches.Collator's), for the shared loop."""
        batch = self.collator.empty_batch(False)
        return batch | {"advantages": torch.zeros(1), "old_logps": torch.zeros(1, 1), "ref_logps": torch.zeros(1, 1)}


def reward_labels(names: list[str]) -> list[str]:
    """Each reward's name in the metrics (reward_<name>, reward_<name>_std): a built-in's,
    the function's own (file.py:fn is fn), or reward_model for a reward model. A name two
    rewards share gets each one's place in grpo.rewards (short_1, short_2), and so does one
    whose metrics would meet another's (len beside len_std, or std beside the total
    reward_std), so that no reward's figures replace another's."""
    labels = ["reward_model" if n.startswith("reward_model:") else n.rsplit(":", 1)[-1] for n in names]
    labels = [f"{b}_{i + 1}" if labels.count(b) > 1 else b for i, b in enumerate(labels)]

    def keys(label: str) -> set[str]:
        return {label, f"{label}_std"}

    for i in range(len(labels)):
        while "std" in keys(labels[i]) or any(keys(labels[i]) & keys(o) for j, o in enumerate(labels) if j != i):
            labels[i] = f"{labels[i]}_{i + 1}"
    return labels


def split(flat: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [part.tolist() for part in torch.split(flat.float().cpu(), lengths)]


def pack_samples(samples: list[Sample], epoch: int, r: int) -> dict[str, torch.Tensor]:
    """A round's samples as flat tensors (for rollout.safetensors in a checkpoint)."""

    def cat(lists) -> torch.Tensor:
        flat = [x for part in lists for x in part]
        return torch.tensor(flat, dtype=torch.float32 if flat and isinstance(flat[0], float) else torch.int64)

    out = {
        "round": torch.tensor([epoch, r]),
        "position": torch.tensor([s.position for s in samples]),
        "index": torch.tensor([s.index for s in samples]),
        "prompt_len": torch.tensor([len(s.prompt_ids) for s in samples]),
        "completion_len": torch.tensor([len(s.completion_ids) for s in samples]),
        "prompt_ids": cat(s.prompt_ids for s in samples),
        "completion_ids": cat(s.completion_ids for s in samples),
        "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    }
    for key in ("old_logps", "ref_logps"):
        if samples and getattr(samples[0], key) is not None:
            out[key] = torch.tensor([x for s in samples for x in getattr(s, key)], dtype=torch.float32)
    return out


def unpack_samples(t: dict[str, torch.Tensor]) -> tuple[int, int, list[Sample]]:
    epoch, r = t["round"].tolist()
    prompt_len, completion_len = t["prompt_len"].tolist(), t["completion_len"].tolist()
    prompts = torch.split(t["prompt_ids"], prompt_len)
    completions = torch.split(t["completion_ids"], completion_len)
    old = torch.split(t["old_logps"], completion_len) if "old_logps" in t else None
    ref = torch.split(t["ref_logps"], completion_len) if "ref_logps" in t else None
    samples = []
    for i, (pos, j) in enumerate(zip(t["position"].tolist(), t["index"].tolist())):
        samples.append(
            Sample(
                pos,
                j,
                prompts[i].tolist(),
                completions[i].tolist(),
                float(t["advantage"][i]),
                old[i].tolist() if old is not None else None,
                ref[i].tolist() if ref is not None else None,
            )
        )
    return epoch, r, samples
