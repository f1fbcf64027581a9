"""Rollouts: the training micro-batches of recipes/grpo.py, generated from the policy as
the loop draws them (the loop's data source, beside core/source.LoaderBatches).

A pass over the prompts is a seeded order (batches.EpochSampler: seed and pass only). Its
generation rounds take P = train.micro_batch_size x train.grad_accum_steps x processes
prompts each, in order, whatever the layout; the last incomplete round is left out
(`RolloutSettings.steps_per_epoch`, which `llmtrain plan` reads too). In a round each
process generates grpo.num_generations completions for each of its prompts
(sampling.sample_seed: a seed per completion, so layout and resume never change one),
scores them, and the rewards of the whole global batch go to every process for the
advantages (groups are never split), which the objective's estimator computes
(loss.GRPOLoss.advantages). The round's micro-batches (train.micro_batch_size prompts'
completions each) then feed grpo.num_iterations optimizer steps; from the second on, the
loss compares with the log-probs the completions were sampled with, and a checkpoint taken
within the round keeps the round (`saved`), so a resumed run trains on the very
completions the interrupted one had.

Rollouts reads no config: its settings are a RolloutSettings (`from_config` names the keys).
What the loop uses of it is the data source's protocol (core/source.Batches): items,
steps_per_epoch, metrics, epoch, empty_batch, saved, restore, evaluates, evaluate, shown.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object, send_to_device

from ..config import DataConfig
from ..data.batches import Collator, EpochSampler
from ..data.mixture import Mixture
from ..data.rows import IGNORE, shift, stop_ids
from ..errors import ConfigError, DataError, RewardError, ToolError
from ..processor import SEQUENCE_INPUTS, processor_of
from ..vision import IMAGE_COLUMNS, extended, image_inputs
from .advantages import nanstd
from .agent import ENV_REWARD, Start
from .correction import correction_weights, mismatch_metrics
from .episodes import Trajectory, play
from .heldout import evaluate_prompts
from .prompts import as_rewards_see, as_rewards_see_all, asked, decoded, prompt_columns
from .rewards import score, trainer_state
from .sampling import sample_seed


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollouts take from the run's settings; `from_config` reads them from the
    grpo, train and data sections."""

    group: int  # grpo.num_generations: completions per prompt
    iterations: int  # grpo.num_iterations: optimizer steps on each generation round
    micro: int  # train.micro_batch_size: prompts per micro-batch
    accum: int  # train.grad_accum_steps: micro-batches per process and step
    seed: int  # train.seed: the order of each pass, and each completion's sampling seed
    total_steps: Callable[[int], int]  # train.total_steps: the run's steps from the steps per pass
    shuffle: bool = True  # data.shuffle: a seeded order per pass, or the data's
    reward_weights: tuple[float, ...] = ()  # grpo.reward_weights, one per reward function; empty: 1 each
    log_completions: int = 0  # grpo.log_completions: prompts whose first completion is printed per round
    correction: str = "none"  # grpo.importance_correction: tis, mis or none (rl/correction.py)
    correction_level: str = "token"  # grpo.importance_level
    correction_cap: float = 3.0  # grpo.importance_cap
    max_image_pixels: int = DataConfig.max_image_pixels  # data.max_image_pixels: images decoded again
    eval_samples: int = 1  # grpo.eval_samples: completions per evaluation prompt (1: greedy)
    eval_pass_threshold: float = 1.0  # grpo.eval_pass_threshold: the score that passes a function

    @classmethod
    def from_config(cls, cfg) -> RolloutSettings:
        g, t = cfg.grpo, cfg.train
        return cls(
            group=g.num_generations,
            iterations=g.num_iterations,
            micro=t.micro_batch_size,
            accum=t.grad_accum_steps,
            seed=t.seed,
            total_steps=t.total_steps,
            shuffle=cfg.data.shuffle,
            reward_weights=tuple(g.reward_weights),
            log_completions=g.log_completions,
            correction=g.importance_correction,
            correction_level=g.importance_level,
            correction_cap=g.importance_cap,
            max_image_pixels=cfg.data.max_image_pixels,
            eval_samples=g.eval_samples,
            eval_pass_threshold=g.eval_pass_threshold,
        )

    def per_round(self, world: int) -> int:
        """Prompts per generation round on `world` processes: one optimizer step's."""
        return self.micro * self.accum * world

    def rounds(self, prompts: int, world: int) -> int:
        """Generation rounds in a pass over `prompts` prompts: whole ones only."""
        return prompts // self.per_round(world)

    def steps_per_epoch(self, prompts: int, world: int) -> int:
        """Optimizer steps in a pass over `prompts` prompts: each round's `iterations`."""
        return self.rounds(prompts, world) * self.iterations


@dataclass
class Sample:
    """One completion of one prompt, with what training on it needs."""

    position: int  # the prompt's place in the pass
    index: int  # the completion's number in its group
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    old_logps: list[float] | None = None  # one per trained (sampled) completion token
    ref_logps: list[float] | None = None
    # Which completion tokens the policy sampled (1) and which a tool or the template wrote
    # between turns (0: context only, never trained); None: all sampled (a single turn).
    sampled: list[int] | None = None
    sampler_logps: list[float] | None = None  # the sampler's, one per trained token (kept until the correction)
    correction: list[float] | None = None  # the sampler correction's weight per trained token
    row: int = -1  # the prompt's row in the prompt set: a vision-language model's images are read there
    # An episode's prompt (rendered again with its environment's text) with images: the
    # processor's per-token inputs of prompt_ids (processor.SEQUENCE_INPUTS); None: its row's.
    inputs: dict[str, list[int]] | None = None

    def trained(self) -> int:
        """How many of its completion tokens are trained: the sampled ones."""
        return len(self.completion_ids) if self.sampled is None else sum(self.sampled)

    def labels(self) -> list[int]:
        """Its completion's labels: the sampled tokens, IGNORE for the others."""
        if self.sampled is None:
            return list(self.completion_ids)
        return [t if m else IGNORE for t, m in zip(self.completion_ids, self.sampled)]


class Rollouts:
    """The loop's data source for GRPO (see the module docstring): rounds of completions
    generated by `generator` from `model` (the prepared policy), scored by `rewards`, with
    advantages from `objective` (loss.GRPOLoss), reference log-probs from `reference`
    (batch -> flat log-probs, or None) and the held-out reward on `eval_set` (or None).
    `beat` tells the watchdog what a long wait is doing."""

    def __init__(
        self,
        settings: RolloutSettings,
        accelerator,
        model,
        tokenizer,
        prompts,
        objective,
        generator,
        rewards,
        reference,
        beat,
        eval_set=None,
        agent=None,
        eval_generator=None,
    ):
        self.settings, self.accelerator, self.model, self.tokenizer = settings, accelerator, model, tokenizer
        self.objective, self.generator, self.rewards, self.reference, self.beat = (
            objective,
            generator,
            rewards,
            reference,
            beat,
        )
        self.items = "prompts"  # what a micro-batch of train.micro_batch_size holds
        self.group, self.iterations = settings.group, settings.iterations
        self.micro, self.accum, self.world = settings.micro, settings.accum, accelerator.num_processes
        self.local = self.micro * self.accum  # prompts per process and round
        self.per_round = settings.per_round(self.world)
        mix = prompts.mix if isinstance(prompts, Mixture) else None
        self.prompts = prompts.examples if isinstance(prompts, Mixture) else prompts
        self.sampler = EpochSampler(len(self.prompts), settings.seed, settings.shuffle, mix)
        self.columns = prompt_columns(self.prompts)  # every row's, for the reward functions
        self.images = "images" in getattr(self.prompts, "column_names", ())  # a vision-language model's prompts
        self.agent = agent  # agent.Agent: completions are episodes of turns with tool calls; None: one turn
        self.eval_set, self.evaluates = eval_set, eval_set is not None
        self.eval_generator = eval_generator or generator  # grpo.eval_temperature's, for sampled evaluations
        self.eval_columns: set[str] | None = None
        names = [r.name for r in rewards] + ([ENV_REWARD] if agent is not None and agent.env_reward else [])
        self.labels = reward_labels(names)  # each reward's name in the metrics
        self.rounds = settings.rounds(len(self.sampler), self.world)
        if self.rounds == 0:
            raise DataError(
                f"data.train: {len(self.sampler)} prompts per pass, fewer than one step's {self.per_round} "
                f"(train.micro_batch_size={self.micro} x train.grad_accum_steps={self.accum} x {self.world} "
                "process(es)); give more prompts or lower those"
            )
        self.steps_per_epoch = settings.steps_per_epoch(len(self.sampler), self.world)
        weights = settings.reward_weights or [1.0] * len(names)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.collator = Collator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.metrics: dict[str, float] = {}  # the current round's, logged with each of its steps
        self.to_show: list[str] = []  # printed with the next logged row (`shown`)
        self.current: tuple[int, int, list[Sample]] | None = None  # (epoch, round, this process's samples)
        self.restored: tuple[int, int, list[Sample]] | None = None
        self.total_steps = settings.total_steps(self.steps_per_epoch)  # for the rewards' trainer_state
        # The tokens that end a turn, as the generator stops at them (a multi-turn run's turns).
        self.stops = stop_ids(getattr(self.model_for_generation(), "generation_config", None), tokenizer)

    # --- the loop's view -----------------------------------------------------------------

    def epoch(self, epoch: int, skip: int = 0):
        """An iterator over pass `epoch`'s micro-batches after its first `skip` micro-batches
        (whole steps' worth: the loop resumes at a step's start)."""
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
        samples, ended, episodes = [], [], []
        for m in range(0, self.local, self.micro):
            self.beat(f"generating completions for prompts {first + m} to {first + m + self.micro - 1}")
            part, seeds, positions, rows = [], [], [], []
            for k, ex in enumerate(examples[m : m + self.micro]):
                for j in range(self.group):
                    part.append(ex)
                    seeds.append(sample_seed(self.settings.seed, epoch, first + m + k, j))
                    positions.append((first + m + k, j))
                    rows.append(mine[m + k])  # its prompt's row in the prompt set
            if self.agent is None:
                prompts = [list(ex["prompt_ids"]) for ex in part]
                out = self.generator.generate(self.model_for_generation(), prompts, seeds, **self.shown_to(part))
                logps = out.logps or [None] * len(prompts)
                for (p, j), ids, c, q, i in zip(positions, prompts, out.ids, logps, rows):
                    samples.append(Sample(p, j, ids, c, sampler_logps=q, row=i))
                ended += out.ended
                continue
            played = self.play(part, seeds)
            for (p, j), (start, t), i in zip(positions, played, rows):
                inputs = {k: start.shown[k] for k in SEQUENCE_INPUTS} if start.shown else None
                drawn = dict(sampled=t.sampled, sampler_logps=t.logps, row=i, inputs=inputs)
                samples.append(Sample(p, j, start.prompt_ids, t.ids, **drawn))
                ended.append(not t.truncated)
            episodes += played
        generation_s = time.perf_counter() - started
        self.beat("scoring completions")
        texts = self.texts(samples, episodes)
        step = epoch * self.steps_per_epoch + r * self.iterations
        table, failure = self.score(examples, self.group, samples, texts, episodes, step)
        k = len(self.labels)
        stats = episode_stats(samples, ended, episodes)
        local = torch.cat([table, torch.full((len(samples), 1), float(bool(failure))), stats], 1)
        # One exchange: every process's rewards (for the advantages), failures, lengths.
        everyone = self.accelerator.gather(local.to(self.accelerator.device)).cpu()
        if everyone[:, k].any():  # a reward function failed somewhere: all stop, with its line
            raise RewardError(next(m for m in gather_object([failure]) if m))
        rewards = everyone[:, :k]
        adv, total, zero_spread = self.objective.advantages(rewards, self.weights, self.group)
        mine = slice(rank * len(samples), (rank + 1) * len(samples))
        for s, a in zip(samples, adv[mine].tolist()):
            s.advantage = a
        self.metrics = self.round_metrics(rewards, total, zero_spread, everyone[:, k + 1 :], bool(episodes))
        self.metrics["generation_s"] = generation_s
        self.show(examples, texts, [t for _, t in episodes], total[mine])
        self.beat("computing the log-probs the completions were sampled with")
        self.log_probs(samples)
        for s in samples:  # used (by the correction) or not needed: a checkpoint does not keep them
            s.sampler_logps = None
        return samples

    def play(self, examples: list[dict], seeds: list[int] | None, generator=None) -> list[tuple[Start, Trajectory]]:
        """The episodes of `examples` (one each; greedy turns for seeds None), each with its
        start (agent.Start: its prompt, tools, environment), played by `generator` (the
        training one by default)."""
        generator = generator or self.generator
        starts = [self.agent.start(ex, self.tokenizer) for ex in examples]
        model = self.model_for_generation()
        trajectories = play(
            generator,
            model,
            self.tokenizer,
            [st.prompt_ids for st in starts],
            seeds,
            [st.box for st in starts],
            self.agent.settings.max_turns,
            generator.max_new_tokens,
            self.stops,
            keep_going=self.keep_going,
            shown=[st.shown for st in starts] if self.images else None,
        )
        return list(zip(starts, trajectories))

    def keep_going(self, mine: bool) -> bool:
        """Whether any process still has episodes going: under ZeRO-3 and FSDP2 each generate
        call is a collective, so all take part in every turn any of them plays."""
        if not getattr(self.generator, "synced", False):
            return mine
        flag = torch.tensor([float(mine)], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).max() > 0)

    def texts(self, samples: list[Sample], episodes: list) -> list[str]:
        """Single-turn completions as text, for the rewards and the log; none for episodes,
        which both read as messages."""
        if episodes:
            return []
        return [self.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]

    def score(
        self, examples: list[dict], each: int, samples: list, texts: list[str], episodes: list, step: int, names=None
    ):
        """([completions, rewards] rewards: each function's, then the environment's), ''), or
        (NaN, the error line) when a function failed: raised on every process together, after
        the exchange. `each`: completions per example, in order. In a multi-turn run a
        completion is the episode's assistant and tool messages, as TRL gives it."""
        asked_as, columns = [], []
        for ex in examples:
            p, c = decoded(ex)
            asked_as += [p] * each
            columns += [c] * each
        if episodes:
            prompts, completions = as_rewards_see_episodes(asked_as, [t.messages for _, t in episodes])
        else:
            prompts, completions = as_rewards_see_all(asked_as, texts)
        ids = [s.completion_ids for s in samples]
        state = trainer_state(step, self.total_steps, step // self.steps_per_epoch)
        try:
            names = self.columns if names is None else names
            table = score(self.rewards, prompts, completions, ids, columns, state, names)
        except RewardError as e:
            return torch.full((len(samples), len(self.labels)), float("nan")), str(e)
        if self.agent is not None and self.agent.env_reward:
            try:
                scored = [None if st.environment is None else st.environment.outcome() for st, _ in episodes]
            except ToolError as e:  # stopped on every process together, as a failed reward function
                return torch.full((len(samples), len(self.labels)), float("nan")), str(e)
            env = torch.tensor([float("nan") if v is None else v for v in scored], dtype=torch.float32)
            table = torch.cat([table, env[:, None]], 1)
        return table, ""

    def round_metrics(self, rewards, total, zero_spread, stats, episodes: bool) -> dict[str, float]:
        out = {"reward": float(total.nanmean()), "reward_std": float(nanstd(total))}
        for i, name in enumerate(self.labels):
            column = rewards[:, i]
            out[f"reward_{name}"] = float(column.nanmean())
            out[f"reward_{name}_std"] = float(nanstd(column))
        lengths, clipped = stats[:, 0], stats[:, 1]
        out |= {
            "zero_spread_groups": float(zero_spread.float().mean()),
            "completion_len": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "clipped_completions": float(clipped.mean()),
        }
        if episodes:  # per episode: means, and the share of episodes each flag marks
            for i, name in enumerate(EPISODE_STATS):
                out[name] = float(stats[:, 2 + i].mean())
            out["turns_max"] = float(stats[:, 2].max())
        return {k: v for k, v in out.items() if not math.isnan(v)}

    def shown(self) -> list[str]:
        """The lines to print with the next logged row (a round's completions), once."""
        lines, self.to_show = self.to_show, []
        return lines

    def show(self, examples: list[dict], texts: list[str], episodes: list, total: torch.Tensor) -> None:
        """The first completion of each of the first grpo.log_completions prompts, for the log
        (an episode's turns with their tool calls and results)."""
        self.to_show = []
        for k in range(min(self.settings.log_completions, len(examples))):
            i = k * self.group
            question = asked(json.loads(examples[k]["prompt"]))
            said = " | ".join(episode_lines(episodes[i].messages)) if episodes else repr(texts[i])
            self.to_show.append(f"completion> {question!r} -> {said} (reward {float(total[i]):.3g})")

    # --- evaluation ----------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out reward at `step` (heldout.evaluate_prompts): grpo.eval_samples
        completions per evaluation prompt (one greedy, or sampled with seeds of their own),
        scored by every reward function (which see the training state, as in training):
        their mean reward, each function's, and pass@k."""
        each = self.settings.eval_samples
        if self.eval_columns is None:  # read once: the evaluation prompts stay the same
            self.eval_columns = prompt_columns(self.eval_set)

        def draw(examples: list[dict], seeds: list[int] | None):
            repeated = [e for e in examples for _ in range(each)]
            if self.agent is None:
                prompts = [list(e["prompt_ids"]) for e in repeated]
                out = self.eval_generator.generate(
                    self.model_for_generation(), prompts, seeds, **self.shown_to(repeated)
                )
                return [Sample(0, 0, p, c) for p, c in zip(prompts, out.ids)], []
            episodes = self.play(repeated, seeds, self.eval_generator)
            return [Sample(0, 0, st.prompt_ids, t.ids, sampled=t.sampled) for st, t in episodes], episodes

        def scored(examples: list[dict], drawn) -> torch.Tensor:
            samples, episodes = drawn
            texts = self.texts(samples, episodes)
            rewards, failure = self.score(examples, each, samples, texts, episodes, step, self.eval_columns)
            if failure:
                raise RewardError(failure)
            return rewards

        s = self.settings
        return evaluate_prompts(
            self.eval_set,
            each,
            s.seed,
            self.micro,
            self.accelerator,
            draw,
            scored,
            self.labels,
            self.weights,
            s.eval_pass_threshold,
            self.beat,
        )

    def log_probs(self, samples: list[Sample]) -> None:
        """old_logps (needed from a round's second step on, and by the sampler correction) and
        ref_logps (grpo.beta > 0), one no-grad pass per micro-batch, as the policy stands
        before the round's updates; then the sampler correction's weights."""
        correcting = self.settings.correction != "none"
        if self.iterations == 1 and self.reference is None and not correcting:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            for m in range(0, len(samples), self.micro * self.group):
                part = samples[m : m + self.micro * self.group]
                batch = send_to_device(self.collate(part), self.accelerator.device)
                lengths = [s.trained() for s in part]
                with torch.no_grad():
                    if self.iterations > 1 or correcting:
                        for s, v in zip(part, split(self.objective.logps(self.model, batch), lengths)):
                            s.old_logps = v
                    if self.reference is not None:
                        for s, v in zip(part, split(self.reference(batch), lengths)):
                            s.ref_logps = v
        finally:
            self.model.train(was_training)
        if correcting:
            self.correct(samples)

    def correct(self, samples: list[Sample]) -> None:
        """Each sample's sampler correction weights (rl/correction.py), from its old_logps
        and the sampler's; the round's mismatch metrics from every process's samples."""
        settings = self.settings
        if any(s.sampler_logps is None or len(s.sampler_logps) != s.trained() for s in samples):
            raise ConfigError(
                [
                    "grpo.importance_correction: the generator did not return the log-probs it sampled each token "
                    "with; set grpo.importance_correction=none, or use a generator that returns them"
                ]
            )
        lengths = [s.trained() for s in samples]
        trainer = torch.tensor([x for s in samples for x in s.old_logps], dtype=torch.float64)
        sampler = torch.tensor([x for s in samples for x in s.sampler_logps], dtype=torch.float64)
        weights, _ = correction_weights(
            trainer, sampler, lengths, settings.correction, settings.correction_level, settings.correction_cap
        )
        for s, w in zip(samples, split(weights, lengths)):
            s.correction = w
        parts = gather_object([(trainer.tolist(), sampler.tolist(), lengths)])  # every process's, in order
        joined = [torch.tensor([x for p in parts for x in p[i]], dtype=torch.float64) for i in (0, 1)]
        counts = [n for p in parts for n in p[2]]
        self.metrics |= mismatch_metrics(*joined, counts, settings.correction_level, settings.correction_cap)

    def model_for_generation(self):
        """The module whose generate() runs: the model inside the DDP, DeepSpeed or FSDP
        wrapper (whose own forward, with mixed precision, it keeps)."""
        return self.accelerator.unwrap_model(self.model)

    def shown_to(self, examples: list[dict]) -> dict:
        """What the generator is given of prompt `examples`' images (a vision-language
        model's: their IMAGE_COLUMNS), as keyword arguments; none for text prompts."""
        if "images" not in (examples[0] if examples else {}):
            return {}
        return {"shown": [{k: e[k] for k in IMAGE_COLUMNS} for e in examples]}

    def collate(self, samples: list[Sample]) -> dict:
        rows = []
        for s in samples:
            labels = [IGNORE] * len(s.prompt_ids) + s.labels()
            rows.append({"input_ids": s.prompt_ids + s.completion_ids, "labels": shift(labels)})
            if self.images and s.row >= 0:  # its prompt's images
                prompt = self.prompts[s.row]
                inputs = s.inputs or {k: prompt[k] for k in SEQUENCE_INPUTS}
                rows[-1] |= extended({"images": prompt["images"]} | inputs, len(s.completion_ids))
        batch = self.collator(rows)
        if any("images" in r for r in rows):
            processor = processor_of(self.tokenizer)
            batch |= image_inputs(rows, batch["input_ids"].shape[1], processor, self.settings.max_image_pixels)
        batch["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        for key in ("old_logps", "ref_logps", "correction"):
            if all(getattr(s, key) is not None for s in samples) and samples:
                aligned = torch.zeros(batch["labels"].shape, dtype=torch.float32)
                for row, s in enumerate(samples):
                    start = len(s.prompt_ids) - 1  # the position that predicts the first completion token
                    marks = s.sampled or [1] * len(s.completion_ids)
                    where = [start + i for i, m in enumerate(marks) if m]  # the trained tokens' positions
                    aligned[row, where] = torch.tensor(getattr(s, key))
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
        nothing = torch.zeros(1, 1)
        return batch | {"advantages": torch.zeros(1), "old_logps": nothing, "ref_logps": nothing, "correction": nothing}


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
        "row": torch.tensor([s.row for s in samples]),
    }
    for key in ("old_logps", "ref_logps", "correction"):
        if samples and getattr(samples[0], key) is not None:
            out[key] = torch.tensor([x for s in samples for x in getattr(s, key)], dtype=torch.float32)
    if samples and samples[0].inputs is not None:  # episodes' prompts with images: their per-token inputs
        out |= {f"inputs.{k}": cat(s.inputs[k] for s in samples) for k in SEQUENCE_INPUTS}
    if any(s.sampled is not None for s in samples):  # a multi-turn run's: which tokens were sampled
        out["sampled"] = torch.tensor(
            [m for s in samples for m in (s.sampled or [1] * len(s.completion_ids))], dtype=torch.int8
        )
    return out


def unpack_samples(t: dict[str, torch.Tensor]) -> tuple[int, int, list[Sample]]:
    epoch, r = t["round"].tolist()
    prompt_len, completion_len = t["prompt_len"].tolist(), t["completion_len"].tolist()
    prompts = torch.split(t["prompt_ids"], prompt_len)
    completions = torch.split(t["completion_ids"], completion_len)
    sampled = torch.split(t["sampled"], completion_len) if "sampled" in t else None
    trained = [int(m.sum()) for m in sampled] if sampled is not None else completion_len
    old = torch.split(t["old_logps"], trained) if "old_logps" in t else None
    ref = torch.split(t["ref_logps"], trained) if "ref_logps" in t else None
    correction = torch.split(t["correction"], trained) if "correction" in t else None
    samples = []
    rows = t["row"].tolist() if "row" in t else [-1] * len(prompt_len)  # a checkpoint of before images: none
    inputs = {k: torch.split(t[f"inputs.{k}"], prompt_len) for k in SEQUENCE_INPUTS if f"inputs.{k}" in t}
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
                sampled[i].tolist() if sampled is not None else None,
                correction=correction[i].tolist() if correction is not None else None,
                row=rows[i],
                inputs={k: v[i].tolist() for k, v in inputs.items()} or None,
            )
        )
    return epoch, r, samples


# Per episode of a multi-turn round, in the metrics: means over episodes (turns_max too);
# malformed_turns and out_of_turns are the shares of episodes they end.
EPISODE_STATS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "malformed_turns",
    "out_of_turns",
    "sampled_tokens",
    "context_tokens",
)


def episode_stats(samples: list[Sample], ended: list[bool], episodes: list) -> torch.Tensor:
    """[samples, stats]: each completion's length and whether it was cut, then (a multi-turn
    round's) its episode's EPISODE_STATS."""
    rows = []
    for i, (s, e) in enumerate(zip(samples, ended)):
        row = [len(s.completion_ids), float(not e)]
        if episodes:
            t = episodes[i][1]
            trained = s.trained()
            row += [t.turns, t.calls, t.errors, t.malformed, t.out_of_turns, trained, len(s.completion_ids) - trained]
        rows.append([float(x) for x in row])
    width = 2 + (len(EPISODE_STATS) if episodes else 0)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(samples), width)


def as_rewards_see_episodes(prompts: list, episodes: list[list[dict]]) -> tuple[list, list]:
    """(prompts, completions) as the reward functions receive a multi-turn round's, as TRL
    gives them: the prompt's messages, and each episode's assistant and tool messages (a
    prefilled start of the answer, taken from the prompt, begins its first)."""
    out_prompts, out = [], []
    for prompt, messages in zip(prompts, episodes):
        messages = [dict(m) for m in messages]
        asked_as, first = as_rewards_see(prompt, messages[0]["content"] if messages else "")
        if messages:
            messages[0]["content"] = first[0]["content"]
        out_prompts.append(asked_as)
        out.append(messages)
    return out_prompts, out


def episode_lines(messages: list[dict], width: int = 200) -> list[str]:
    """An episode for the log: each turn's text and calls, each tool's result."""
    lines = []
    for m in messages:
        if m["role"] == "tool":
            content = m["content"] if len(m["content"]) <= width else m["content"][:width] + "..."
            lines.append(f"{m['name']} -> {content!r}")
            continue
        said = [repr(m["content"])] if m.get("content") else []
        for call in m.get("tool_calls") or []:
            f = call["function"]
            said.append(f"{f['name']}({json.dumps(f['arguments'], ensure_ascii=False, default=str)})")
        lines.append(" ".join(said) or "''")
    return lines
