"""Preference-tune a causal LM (full or LoRA): DPO, IPO, SimPO or ORPO on chosen/rejected pairs, KTO on labelled rows.

    accelerate launch recipes/dpo.py                            # offline demo (recipes/configs/dpo_demo.yaml)
    accelerate launch recipes/dpo.py --config recipes/configs/dpo_lora.yaml \\
        model.name_or_path=runs/sft/final data.train=prefs.jsonl
    python recipes/dpo.py dpo.loss=ipo dpo.beta=0.5                      # one process, same thing
    python recipes/dpo.py --config recipes/configs/kto_demo.yaml         # KTO: {prompt, completion, label} rows
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/dpo.py   # DDP on CPU

The same config tree and outputs as finetune.py, plus the dpo section (beta, loss,
simpo_gamma, sft_weight, reference, desirable_weight, undesirable_weight). The step's loss
is the mean over every pair (KTO: every row) of the global batch; a pair's two answers
always sit in one micro-batch.
"""

import sys
from pathlib import Path

from llmtrain.cli import run_cli
from llmtrain.config import DPOConfig
from llmtrain.core.objective import chunk_positions
from llmtrain.errors import warn
from llmtrain.model import (
    check_reference,
    chunkable_head,
    disable_dropout,
    load_model,
    pad_id,
    reference_config,
    whole_models,
)
from llmtrain.preference.kto import KTOLoss
from llmtrain.preference.loss import PreferenceLoss
from llmtrain.preference.pairs import PairCollator
from llmtrain.preference.reference import ReferencePass
from llmtrain.preference.unpaired import UnpairedCollator, preference_data
from llmtrain.recipe import Parts, Recipe, run


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
    if d.loss == "kto":
        collator, index = UnpairedCollator(pad_id(tokenizer)), "row_index"
        rows = getattr(train_set, "examples", train_set)  # a data.train with fractions is a Mixture of them
        line, warnings = rows.notes(d.desirable_weight, d.undesirable_weight)
        accelerator.print(line)
        for message in warnings:
            warn(message)
    else:
        collator, index = (
            PairCollator(pad_id(tokenizer), 2 * cfg.data.max_seq_len if cfg.data.packing else 0),
            "pair_index",
        )
    if not objective.needs_reference_pass:
        return Parts(objective, collator)

    def reference_model():
        with whole_models():  # a whole copy on each process: ZeRO-3 would partition it as it loads
            ref = load_model(reference_config(cfg.model, d.reference))
        return ref, make(chunkable_head(ref) if logits else None)  # its own output layer

    sets = [train_set, eval_set]
    after = ReferencePass(cfg, objective, sets, collator, reference_model if d.reference else None, index)
    return Parts(objective, collator, after)


RECIPE = Recipe(
    schema=DPOConfig,
    default_config=Path(__file__).parent / "configs" / "dpo_demo.yaml",
    description=__doc__.splitlines()[0],
    data=preference_data,
    parts=dpo_parts,
    name="dpo",
    check=check_reference,
)


def main(argv=None):
    run(RECIPE, argv)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
