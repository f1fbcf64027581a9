"""The preference wing's methods: dpo (recipes/dpo.py: DPO, IPO, SimPO and ORPO on pairs, KTO
on labelled rows) and reward (recipes/reward.py: reward models on pairs), as the method
table (llmtrain/methods.py) lists them."""

from __future__ import annotations

from ..attention import transformers_model
from ..core.method import TRAINED_CLOSE, TRAINED_OPEN, Method, Parts, PlanFigures, preview_row
from ..core.objective import chunk_positions
from ..core.source import loader_source
from ..errors import warn
from ..model import (
    check_reference,
    chunkable_head,
    disable_dropout,
    load_frozen,
    pad_id,
)
from ..processor import processor_of
from .config import DPOConfig, RewardConfig
from .kto import KTOLoss
from .loss import PreferenceLoss
from .pairs import PairCollator
from .reference import ReferencePass
from .reward_model import REWARD_PAIRS, RewardLoss, score_head
from .unpaired import UnpairedCollator, preference_data


def dpo_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The preference loss, pair batches (KTO: row batches) and, for a full fine-tune or
    dpo.reference, the pass that computes the reference log-probs before training."""
    disable_dropout(model)
    d, logits = cfg.dpo, cfg.train.loss_chunk_logits
    adapters_off = None
    if cfg.model.lora.enabled and not d.reference:  # the reference is the base model: no second copy
        adapters_off = lambda m: accelerator.unwrap_model(m).disable_adapter()  # noqa: E731

    def make(head, adapters_off=None):
        chunk = chunk_positions(head, logits)
        if d.loss == "kto":
            return KTOLoss(d.beta, d.desirable_weight, d.undesirable_weight, chunk, head, adapters_off)
        return PreferenceLoss(d.loss, d.beta, d.simpo_gamma, d.sft_weight, chunk, head, adapters_off)

    objective = make(chunkable_head(model) if logits else None, adapters_off)
    kind = preference_data(cfg)
    images = processor_of(tokenizer), cfg.data.max_image_pixels  # a vision-language model's (or None)
    if d.loss == "kto":
        collator = UnpairedCollator(pad_id(tokenizer), *images)
        rows = getattr(train_set, "examples", train_set)  # a data.train with fractions is a Mixture of them
        line, warnings = rows.notes(d.desirable_weight, d.undesirable_weight)
        accelerator.print(line)
        for message in warnings:
            warn(message)
    else:
        width = kind.width * cfg.data.max_seq_len if cfg.data.packing else 0
        collator = PairCollator(pad_id(tokenizer), width, False, *images)
    source = loader_source(cfg, accelerator, objective, train_set, eval_set, collator)
    if not objective.needs_reference_pass:
        return Parts(objective, source)

    def reference_model():
        ref = load_frozen(cfg.model, d.reference)  # whole on each process (ReferencePass places it)
        return ref, make(chunkable_head(ref) if logits else None)  # its own output layer

    sets = [train_set, eval_set]
    after = ReferencePass(cfg, objective, sets, collator, reference_model if d.reference else None, kind.index)
    return Parts(objective, source, after)


def reward_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    """The Bradley-Terry loss over pair batches that carry each pair's margin."""
    disable_dropout(model)
    pad = pad_id(tokenizer)
    # Where transformers' sequence classifiers read a sequence's score (its last token that
    # is not padding): set before training, so final/config.json carries it.
    transformers_model(model).config.pad_token_id = pad
    objective = RewardLoss(score_head(model), pad, cfg.reward.center_coefficient)
    width = REWARD_PAIRS.width * cfg.data.max_seq_len if cfg.data.packing else 0
    collator = PairCollator(pad, width, margins=True)
    return Parts(objective, loader_source(cfg, accelerator, objective, train_set, eval_set, collator))


def check_dpo(cfg, tokenizer) -> None:
    """dpo.reference reads the policy's token ids (model.check_reference)."""
    check_reference(cfg.dpo.reference, "dpo.reference", cfg.model, tokenizer)


def reference_source(cfg) -> str:
    """Where a dpo run's reference log-probs come from, for its plan."""
    d = cfg.dpo
    if d.loss == "simpo":
        return "none (SimPO compares the policy's own per-token log-probs)"
    if d.loss == "orpo":
        return "none (ORPO compares the odds of the policy's own per-token log-probs)"
    every = "every row (its completion and KL sequence)" if d.loss == "kto" else "every pair"
    if d.reference:
        return f"{d.reference}: its log-probs for {every}, computed once before training (cached in output_dir)"
    if cfg.model.lora.enabled:
        extra = "three extra forwards" if d.loss == "kto" else "one extra forward"
        return f"the same model with its LoRA adapters off (no second copy; {extra} per micro-batch)"
    return f"the starting weights: log-probs for {every} computed once before training (cached in output_dir)"


def describe_pairs(cfg, first: dict, tokenizer) -> list[str]:
    lines = [
        f"\n== preference ({cfg.dpo.loss}, beta {cfg.dpo.beta:g}) ==",
        f"  reference: {reference_source(cfg)}",
    ]
    if cfg.dpo.loss == "kto":
        d = cfg.dpo
        return lines + [
            f"  weights: desirable {d.desirable_weight:g}, undesirable {d.undesirable_weight:g}; each row's KL "
            "completion is the next row's completion after its own prompt",
            f"\n== first training row ({TRAINED_OPEN}trained{TRAINED_CLOSE}, the rest masked) ==",
            f"-- {'desirable' if first['desirable'] else 'undesirable'} --\n{preview_row(first, tokenizer)}",
        ]
    lines.append(f"\n== first training pair ({TRAINED_OPEN}trained{TRAINED_CLOSE}, the rest masked) ==")
    for side in ("chosen", "rejected"):
        row = {"input_ids": first[f"{side}_input_ids"], "labels": first[f"{side}_labels"]}
        lines.append(f"-- {side} --\n{preview_row(row, tokenizer)}")
    return lines


def describe_reward_pairs(cfg, first: dict, tokenizer) -> list[str]:
    lines = [
        f"\n== reward model (Bradley-Terry, centring {cfg.reward.center_coefficient:g}) ==",
        "  score: the score head's output at each sequence's last token that is not padding",
        f"  margin column: {first.get('margin', 0.0):g} for the first pair (0 where a row has none)",
        "\n== first training pair ==",
    ]
    for side in ("chosen", "rejected"):
        lines.append(f"-- {side} --\n{tokenizer.decode(first[f'{side}_input_ids'])}")
    return lines


# A pair is two sequences (packed: rows of twice the length); a KTO row is its completion
# and its KL sequence.
TWO_SEQUENCES = PlanFigures(sequences=lambda cfg: 2)

DPO = Method(
    name="dpo",
    schema=DPOConfig,
    description=(
        "Preference-tune a causal LM (full or LoRA): DPO, IPO, SimPO or ORPO on chosen/rejected pairs, KTO on "
        "labelled rows."
    ),
    data=preference_data,
    parts=dpo_parts,
    describe=describe_pairs,
    demo="dpo_demo.yaml",
    template="dpo_lora.yaml",
    check=check_dpo,
    plan=TWO_SEQUENCES,
    tags=lambda cfg: ["dpo"] + ([cfg.dpo.loss] if cfg.dpo.loss != "sigmoid" else []),
)

REWARD = Method(
    name="reward",
    schema=RewardConfig,
    description=(
        "Train a reward model (full or LoRA): a causal LM with a one-number score head, on chosen/rejected pairs."
    ),
    data=REWARD_PAIRS,
    parts=reward_parts,
    describe=describe_reward_pairs,
    demo="reward_demo.yaml",
    template="reward.yaml",
    plan=TWO_SEQUENCES,
    tags=lambda cfg: ["reward-model"],
)
