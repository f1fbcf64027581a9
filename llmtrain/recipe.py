"""What every recipe does around its method: read the config, take the output directory,
find where to resume, prepare the data, set up and train, write final/ and print samples. A
method supplies only what is its own (core/method.Method, listed in methods.METHODS): its
config tree, its data, its objective and data source. A recipe script is

    def main(argv=None):
        run("dpo", argv)
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import demo, safefs
from .cli import parse_args, run_cli
from .config import to_yaml
from .config.load import absolute_paths, check
from .core.window import Outcome
from .data.build import build_datasets
from .distributed.launch import main_first, setup_accelerator
from .distributed.stop import StopRequest
from .distributed.topology import Topology
from .distributed.watchdog import Watchdog
from .errors import warn
from .methods import METHODS, demo_config, sections
from .model import attention_backend, check_model, check_vocab, load_model, load_tokenizer, meta_model
from .observe.metrics import METRICS_FILE, describe_run, plot_losses, read_metrics
from .output import card, checkpoint, rundir
from .output.evals import CheckpointEvals
from .output.export import model_for_sampling, sample, save_final
from .processor import is_vision, processor_of, vision_in_every_forward
from .rl.tasks import Tasks
from .train import keep_writing, setup, train
from .vision import rows_kind


def run(name: str, argv: list[str] | None = None) -> None:
    """Run the method `name` of methods.METHODS as its recipe: recipes/<name>.py, whose demo
    config sits in configs/ beside it."""
    method = METHODS[name]
    stop = StopRequest().install()  # SIGUSR1/SIGTERM/SIGINT: exit; while training, after a checkpoint
    beside = Path(sys.argv[0]).resolve().parent / "configs"  # the script's, wherever llmtrain is installed
    cfg, args = parse_args(argv, method, demo_config(method, beside), sections())
    absolute_paths(cfg)  # before any code of the user's runs, which may change the working directory
    safefs.check_caches(demo.uses_demo(cfg))  # an unusable cache is one line now, not a traceback later
    accelerator = setup_accelerator(cfg)
    with main_first(accelerator):
        demo.resolve_demo_names(cfg)  # builds the offline demo model and data once
    sample_tokens = cfg.eval.sample_max_new_tokens if cfg.eval.sample_prompts else 0
    mcfg = check_model(cfg.model, cfg.data.max_seq_len, sample_tokens)
    attention = attention_backend(cfg.model, mcfg, cfg.data.packing, accelerator.device)
    cfg.model.attn_implementation = attention.name
    check(cfg)  # the config that runs is a checked one
    accelerator.print(f"attention: {attention.name} ({attention.reason}); {attention.pattern}")
    start = rundir.prepare(
        cfg, accelerator, method.name, rundir.output_bytes(meta_model(cfg.model, mcfg, Topology.of(accelerator).zero3))
    )
    if start.finished_at is not None:
        if accelerator.is_main_process and not (Path(cfg.output_dir) / "loss.png").exists():
            plot_losses(Path(cfg.output_dir) / "metrics.jsonl", Path(cfg.output_dir) / "loss.png")  # stopped before it
        accelerator.print(
            f"{cfg.output_dir} already finished at step {start.finished_at} with these settings; final/ is up to date"
        )
        return
    resume_from, identity = start.resume_from, start.identity

    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template_text(), is_vision(mcfg))
    check_vocab(cfg.model, mcfg, tokenizer)
    if method.check is not None:
        method.check(cfg, tokenizer)
    kind = rows_kind(method.kind(cfg), tokenizer, cfg, mcfg)
    train_set, eval_set = build_datasets(cfg, accelerator, tokenizer, kind)
    tasks = Tasks.load(cfg, accelerator, tokenizer)  # eval.tasks' prompts and functions, before any weights
    if args.prepare_only:  # the tokenized data is in the datasets cache now
        return
    model = load_model(cfg.model, Topology.of(accelerator).zero3)
    if accelerator.num_processes > 1 and processor_of(tokenizer) is not None:
        vision_in_every_forward(model, processor_of(tokenizer))  # every process runs the same layers
    parts = method.parts(cfg, accelerator, model, tokenizer, train_set, eval_set)
    # What a checkpoint's data position means, recorded with every checkpoint and final/.
    settings = checkpoint.position_settings(cfg, accelerator.num_processes, method.position(cfg))

    # From here on a dead or hung rank ends the job within train.hang_timeout_s.
    with Watchdog(cfg.train.hang_timeout_s, accelerator.process_index, accelerator.num_processes) as watchdog:
        evals = checkpoint_evals(cfg, method.name, accelerator)
        training = setup(cfg, accelerator, model, parts, resume_from, stop, watchdog, settings, tasks, evals)
        training.state.identity = identity  # recorded in every checkpoint and final/
        if rundir.up_to_date(cfg, training.state.step, training.total_steps, accelerator.num_processes):
            accelerator.print(
                f"nothing left to train at step {training.state.step}; final/ is up to date, and changed settings "
                "apply to no step: to train with them, choose another output_dir (to export again with other export.* "
                "settings, change those alone)"
            )
            accelerator.end_training()
            return
        # config.yaml, run.json, going back to an earlier checkpoint: only now that the run trains
        if start.going_back:
            rundir.set_aside_later(cfg.output_dir, resume_from, accelerator)
        describe_run(cfg, accelerator, resume_from, identity, start.started_from)
        with stop.deferred():  # a signal stops the loop at an agreed step, or waits for final/
            outcome = train(training)
            if outcome is Outcome.FINISHED:
                config = to_yaml(cfg)
                state = training.state.state_dict() | {"settings": settings}  # what a rerun compares
                rundir.keep_finished(cfg, accelerator)  # an earlier final/ trained otherwise is kept
                facts = None
                if accelerator.is_main_process:  # the model card's (final/README.md)
                    facts = card.gather(
                        cfg,
                        method,
                        training.state,
                        training.objective.unit,
                        accelerator,
                        accelerator.unwrap_model(training.model),
                        read_metrics(Path(cfg.output_dir) / METRICS_FILE),
                        demo.demo_name,
                    )
                final = keep_writing(
                    training,
                    "final/",
                    lambda: save_final(
                        accelerator,
                        training.model,
                        tokenizer,
                        cfg.output_dir,
                        config,
                        cfg.export,
                        state,
                        cfg.model,
                        facts,
                    ),
                )
                stop.agree(accelerator, "; final/ is saved")  # a signal to one process stops all alike
    if outcome is Outcome.STOPPED:
        accelerator.end_training()
        sys.exit(stop.exit_code())
    if accelerator.is_main_process:
        plot_losses(Path(cfg.output_dir) / "metrics.jsonl", Path(cfg.output_dir) / "loss.png")
        print(f"saved {final}")
        prompts = cfg.eval.sample_prompts
        if prompts:
            model = model_for_sampling(accelerator, training.model, final, cfg.model)
            answers = sample(model, tokenizer, prompts, cfg.eval.sample_max_new_tokens)
            for prompt, answer in zip(prompts, answers):
                print(f"sample> {prompt!r} -> {answer!r}")
    accelerator.end_training()  # closes trackers and the process group: last


def checkpoint_evals(cfg, recipe: str, accelerator) -> CheckpointEvals | None:
    """eval.lm_eval_tasks on each checkpoint (output/evals.py), where `llmtrain eval` loads
    them (not a QLoRA run's); else None, said once."""
    if not cfg.eval.lm_eval_tasks:
        return None
    if cfg.model.quantization != "none":
        warn(
            "eval.lm_eval_tasks: a QLoRA run's checkpoints are not evaluated as they are written; measure the model "
            f"with llmtrain eval {cfg.output_dir}/final --config ... after the run"
        )
        return None
    if not cfg.checkpoint.every_steps:
        warn(
            "eval.lm_eval_tasks: they run on each checkpoint, and checkpoint.every_steps=0 writes none by step; "
            f"set it, or measure the model with llmtrain eval {cfg.output_dir}/final --config ... after the run"
        )
    return CheckpointEvals(cfg.output_dir, recipe, accelerator.is_main_process)


if __name__ == "__main__":  # python -m llmtrain.recipe NAME [args]: recipes/NAME.py, as `llmtrain verify` launches it
    run_cli(lambda argv: run(argv[0], argv[1:]), sys.argv[1:])
