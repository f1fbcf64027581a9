"""The preference wing's config trees: recipes/dpo.py's (Config plus the dpo section: DPO,
IPO, SimPO, ORPO and KTO) and recipes/reward.py's (Config plus the reward section), each
with the checks its recipe makes of the shared sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from ..config import Config, DataConfig
from ..config.validate import ASSET, POSITIVE


def pair_data_problems(data: DataConfig, recipe: str) -> list[str]:
    """What a recipe that reads preference pairs (dpo.py, reward.py) cannot take in data."""
    p = []
    if data.streaming:
        p.append(f"data.streaming: {recipe} prepares its pairs whole; set data.streaming=false")
    if data.format != "auto":
        p.append(f"data.format: {recipe} tells pair shapes by their fields; remove data.format={data.format}")
    if data.loss_on != "assistant":
        p.append(f"data.loss_on: {recipe} reads the answers only; remove data.loss_on=all")
    return p


@dataclass
class DPOSection:
    beta: Annotated[float, POSITIVE] = 0.1
    """How far the policy may move from the reference: the scale of the log-ratios in
    the loss (recipes/dpo.py). Lower lets it move further."""
    loss: Literal["sigmoid", "ipo", "simpo", "orpo", "kto"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO (squared, per-token log-ratios); simpo: SimPO (per-token
    log-probs of the policy alone, no reference); orpo: ORPO (the chosen answer's NLL plus
    beta x the odds-ratio term, no reference, no SFT stage first); kto: KTO, on unpaired
    rows {prompt, completion, label} instead of pairs (recipes/dpo.py, docs/preference.md)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (dpo.loss=simpo only)."""
    sft_weight: float = 0.0
    """Adds this much of the chosen answers' per-token negative log-likelihood to the
    loss (RPO); 0 for none (recipes/dpo.py)."""
    reference: Annotated[str, ASSET] = ""
    """The reference model: empty for the policy's starting weights (with LoRA, the same
    model with its adapters off; for a full fine-tune, log-probs computed once before
    training), or a hub name or directory of another model, whose log-probs are computed
    once before training (recipes/dpo.py)."""
    desirable_weight: Annotated[float, POSITIVE] = 1.0
    """KTO's weight on the loss of desirable rows (label true) (dpo.loss=kto only). The KTO
    paper advises desirable_weight x desirable rows / (undesirable_weight x undesirable
    rows) between 1 and 4/3: raise the weight of the rarer kind."""
    undesirable_weight: Annotated[float, POSITIVE] = 1.0
    """KTO's weight on the loss of undesirable rows (label false) (dpo.loss=kto only)."""


@dataclass
class DPOConfig(Config):
    """recipes/dpo.py's tree: every section of Config, plus dpo."""

    RECIPE: ClassVar[str] = "recipes/dpo.py"

    dpo: DPOSection = field(default_factory=DPOSection)

    def problems(self) -> list[str]:
        p = super().problems()
        if self.dpo.loss in ("simpo", "orpo") and self.dpo.reference:
            p.append(f"dpo.reference: dpo.loss={self.dpo.loss} uses no reference model; remove dpo.reference")
        if self.dpo.loss == "kto":
            if self.data.packing:
                p.append(
                    "data.packing: dpo.loss=kto trains on padded batches (each completion beside its KL completion); "
                    "set data.packing=false"
                )
            if self.dpo.sft_weight:
                p.append("dpo.sft_weight: dpo.loss=kto has no SFT term; remove dpo.sft_weight")
        return p + pair_data_problems(self.data, "recipes/dpo.py")


@dataclass
class RewardSection:
    center_coefficient: float = 0.0
    """Adds this much of the squared sum of each pair's two scores to the loss, which keeps
    scores centred on 0 (Eisenstein et al. 2023; TRL's center_rewards_coefficient, e.g.
    0.01); 0 for none (recipes/reward.py)."""


@dataclass
class RewardConfig(Config):
    """recipes/reward.py's tree: every section of Config, plus reward. model.head is
    'score'; a pair's rows may carry a 'margin' column (a number)."""

    RECIPE: ClassVar[str] = "recipes/reward.py"
    HEAD: ClassVar[str] = "score"
    MERGES_LORA: ClassVar[bool] = True

    reward: RewardSection = field(default_factory=RewardSection)

    def problems(self) -> list[str]:
        p = super().problems()
        if self.model.lora.enabled and not self.export.merge_lora:
            p.append(
                "export.merge_lora: a reward model's final/ is merged, so that it scores text in plain transformers "
                "and as a grpo.rewards reward_model (the adapter is written to final/adapter/ too); remove "
                "export.merge_lora=false"
            )
        if self.eval.sample_prompts:
            p.append("eval.sample_prompts: a reward model scores text and does not generate; remove them")
        return p + pair_data_problems(self.data, "recipes/reward.py")
