"""recipes/distill.py's config tree: Config plus the distill section (the teacher, the
divergence, how many answers the student samples itself), with the checks distillation
makes of the shared sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from ..config import Config
from ..config.validate import ASSET, AT_LEAST_1, FRACTION, POSITIVE
from .loss import ESTIMATORS, LOSSES


@dataclass
class DistillSection:
    teacher: Annotated[str, ASSET] = ""
    """The teacher: a hub name or directory of a causal LM with the student's tokenizer
    (checked at start), frozen, held whole on each process."""
    loss: Literal[tuple(LOSSES)] = "jsd"
    """jsd: the generalized Jensen-Shannon divergence between the student's and the teacher's
    next-token distributions at every trained position (GKD; distill.beta picks the mix);
    reverse_kl: on-policy distillation, the student's own samples scored token by token by
    the teacher (needs distill.on_policy_fraction=1) (docs/distill.md)."""
    beta: Annotated[float, FRACTION] = 0.5
    """With distill.loss=jsd: 0 is the forward KL(teacher || student), as classic knowledge
    distillation; 1 the reverse KL(student || teacher); between, the generalized JSD (TRL's
    GKD beta)."""
    on_policy_fraction: Annotated[float, FRACTION] = 0.5
    """The share of steps whose rows the student answers itself (from each row's prompt)
    instead of the data's answers: 0 is offline distillation on the data's answers, 1 fully
    on-policy; each step's draw is seeded, so it does not depend on the layout (GKD's lambda,
    TRL's lmbda)."""
    temperature: Annotated[float, POSITIVE] = 1.0
    """Both distributions are compared at this temperature, and the student samples at it."""
    top_k: int = 0
    """With distill.loss=jsd: the teacher's distribution cut to its k most likely tokens
    (renormalised), as when its logits are stored; 0 for all. Not with distill.beta=1,
    whose reverse KL needs the teacher's whole distribution."""
    estimator: Literal[tuple(ESTIMATORS)] = "k1"
    """With distill.loss=reverse_kl: each sampled token's signal, k1 = log p_student -
    log p_teacher as a per-token reward of the policy gradient, or k3 = exp(-k1) + k1 - 1
    minimised directly (docs/distill.md)."""
    forward_top_k: int = 0
    """With distill.loss=reverse_kl: adds the forward KL over the teacher's k most likely
    tokens (renormalised) at every sampled position; 0 for none."""
    shard_teacher: bool = False
    """Under ZeRO-3 or FSDP2 with several processes: shard the teacher as the student is
    (each process holds a part, each forward gathers it), for a teacher too large to hold
    whole on each device; slower. Otherwise the teacher is held whole on each process."""
    max_completion_length: Annotated[int, AT_LEAST_1] = 256
    """Tokens the student samples per answer at most (with distill.on_policy_fraction > 0); a
    prompt must leave room for it within data.max_seq_len."""


@dataclass
class DistillConfig(Config):
    """recipes/distill.py's tree: every section of Config, plus distill."""

    RECIPE: ClassVar[str] = "recipes/distill.py"

    distill: DistillSection = field(default_factory=DistillSection)

    def on_policy(self) -> bool:
        """Whether the student samples answers itself in any step."""
        return self.distill.on_policy_fraction > 0

    def problems(self) -> list[str]:
        p, d = super().problems(), self.distill
        if not d.teacher:
            p.append("distill.teacher: required; the teacher model (a hub name or directory) the student learns from")
        if d.loss == "reverse_kl" and d.on_policy_fraction != 1:
            p.append(
                "distill.loss: reverse_kl scores the student's own samples; set distill.on_policy_fraction=1, or use "
                "distill.loss=jsd for the data's answers"
            )
        if d.top_k < 0 or d.forward_top_k < 0:
            p.append("distill.top_k: give a number of tokens, or 0 for all")
        if d.top_k and (d.loss != "jsd" or d.beta == 1):
            p.append(
                "distill.top_k: the reverse KL (distill.beta=1, distill.loss=reverse_kl) needs the teacher's whole "
                "distribution; remove distill.top_k, or lower distill.beta"
            )
        if d.forward_top_k and d.loss != "reverse_kl":
            p.append("distill.forward_top_k: used only with distill.loss=reverse_kl; remove it")
        if self.on_policy():
            if d.max_completion_length >= self.data.max_seq_len:
                p.append(
                    f"distill.max_completion_length: {d.max_completion_length} leaves no room for a prompt within "
                    f"data.max_seq_len={self.data.max_seq_len}; raise data.max_seq_len or lower it"
                )
            if self.data.packing:
                p.append(
                    "data.packing: the student's own answers (distill.on_policy_fraction > 0) are not packed; remove "
                    "data.packing, or set distill.on_policy_fraction=0"
                )
            if self.data.streaming:
                p.append(
                    "data.streaming: the student's own answers are drawn per row of a prepared set; set "
                    "data.streaming=false, or distill.on_policy_fraction=0"
                )
        return p
