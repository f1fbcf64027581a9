"""The log-probability of each trained label: the one function the preference losses (DPO and
its kin, KTO, their reference passes) and the RL loss (GRPO, its reference) read the model's
log-probs through.

`label_logps` returns one float32 value per trained position (labels != IGNORE; labels are
already shifted, so labels[t] is the token position t predicts), flat in row-major order.
With an output layer `head` the values are computed inside it, `chunk` positions at a time
(`objective.trained_head`): [tokens, vocabulary] logits never exist whole. Without one they
come from the model's whole logits. Both take the logits to float32 before the
log-softmax, so they agree to rounding.

`temperature` scales the logits first (the distribution completions were sampled from,
rl/sampling.py); at 1 the logits are not divided, which is exact anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.rows import IGNORE
from .objective import trained_head


def label_logps(
    model, inputs: dict, labels: torch.Tensor, head=None, chunk: int = 0, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs (float32, of the distribution at `temperature`) of the trained labels of
    `labels` [rows, T], flat in row-major order, from the model's forward on `inputs` (its
    keyword arguments: objective.model_inputs): inside the output layer `head`, `chunk` (> 0)
    positions at a time, or from whole logits without a head (heads the chunked path cannot
    stand in for: objective.loss_head)."""
    if head is not None:
        with trained_head(head, labels, chunk, _chunk_logps(temperature), torch.cat):
            return model(**inputs).logits
    trained = labels != IGNORE
    logits = _tempered(model(**inputs).logits[trained].float(), temperature)
    return logits.log_softmax(-1).gather(1, labels[trained][:, None]).squeeze(1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def _chunk_logps(temperature: float):
    def per_chunk(hidden, weight, bias, labels):
        logits = _tempered(F.linear(hidden, weight, bias).float(), temperature)
        return -F.cross_entropy(logits, labels, reduction="none")

    return per_chunk
