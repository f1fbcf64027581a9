"""Names users bring from other tools (Transformers' TrainingArguments, TRL's configs), and
what llmtrain calls them: a config key, or a flag of `accelerate launch`. An unknown key
(in a YAML file or an override, in any section) or an unknown option (`--learning_rate
1e-5`) with one of these names is answered with ours (load.unknown_key_problem,
cli.option_problems), with a note where the meaning differs. Names that llmtrain has too,
in a section (weight_decay, max_steps, seed, gradient_checkpointing), need no entry: the
schema itself says where they go (load.key_for).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ours:
    """What a foreign name is here: a config `key`, or a `flag` of accelerate launch; `note`
    where the two differ in meaning, and `value`, what to give the key where it is not the
    value given to the foreign name (warmup_ratio's share of the run is no warmup_steps)."""

    key: str = ""
    flag: str = ""
    note: str = ""
    value: str = ""


STEPS_NOT_SHARE = "a number of steps, not a share of the run: 0.03 of 1000 steps is train.warmup_steps=30"
MIXED = "model.dtype is the dtype the weights load in"
EVERY_N = "every N steps; 0 evaluates at the end only"
LOSS_ON = "assistant, the default, trains the answers; all, every token"

FOREIGN = {
    # transformers.TrainingArguments
    "learning_rate": Ours("train.lr"),
    "per_device_train_batch_size": Ours("train.micro_batch_size"),
    "per_device_eval_batch_size": Ours("eval.micro_batch_size"),
    "gradient_accumulation_steps": Ours("train.grad_accum_steps"),
    "num_train_epochs": Ours("train.epochs", note="whole epochs; train.max_steps for a part of one"),
    "warmup_ratio": Ours("train.warmup_steps", note=STEPS_NOT_SHARE, value="<steps>"),
    "lr_scheduler_type": Ours("train.schedule", note="cosine, linear or constant, each after train.warmup_steps"),
    "adam_epsilon": Ours("train.adam_eps"),
    "logging_steps": Ours("log.every_steps"),
    "save_steps": Ours("checkpoint.every_steps"),
    "save_total_limit": Ours("checkpoint.keep_last"),
    "eval_steps": Ours("eval.every_steps"),
    "eval_strategy": Ours("eval.every_steps", note=EVERY_N, value="<N>"),
    "evaluation_strategy": Ours("eval.every_steps", note=EVERY_N, value="<N>"),
    "save_strategy": Ours("checkpoint.every_steps", note="and by time: checkpoint.every_minutes", value="<N>"),
    "report_to": Ours("log.tracker"),
    "resume_from_checkpoint": Ours("checkpoint.resume", note="auto, the default, continues the newest checkpoint"),
    "data_seed": Ours("train.seed", note="one seed sets the data order and the weights of new modules"),
    "dataloader_num_workers": Ours("data.num_workers"),
    "torch_compile": Ours("train.compile"),
    "bf16": Ours(flag="--mixed_precision bf16", note=MIXED),
    "fp16": Ours(flag="--mixed_precision fp16", note=MIXED),
    "mixed_precision": Ours(flag="--mixed_precision", note=MIXED),
    "deepspeed": Ours(flag="--config_file accelerate_configs/ds_zero2.yaml", note="or ds_zero1/ds_zero3.yaml"),
    "fsdp": Ours(flag="--config_file accelerate_configs/fsdp2.yaml"),
    # TRL's SFTConfig and ModelConfig, and the example scripts' arguments
    "max_seq_length": Ours("data.max_seq_len"),
    "max_length": Ours("data.max_seq_len"),
    "model_name_or_path": Ours("model.name_or_path"),
    "model_revision": Ours("model.revision"),
    "torch_dtype": Ours("model.dtype"),
    "dataset_name": Ours("data.train"),
    "use_peft": Ours("model.lora.enabled"),
    "lora_r": Ours("model.lora.r"),
    "lora_alpha": Ours("model.lora.alpha"),
    "lora_dropout": Ours("model.lora.dropout"),
    "lora_target_modules": Ours("model.lora.target_modules"),
    "load_in_4bit": Ours("model.quantization", note="nf4 or fp4, with model.lora.enabled=true", value="nf4"),
    "load_in_8bit": Ours("model.quantization", note="with model.lora.enabled=true", value="int8"),
    "assistant_only_loss": Ours("data.loss_on", note=LOSS_ON, value="assistant"),
    "completion_only_loss": Ours("data.loss_on", note=LOSS_ON, value="assistant"),
}
