"""Fine-tune a causal language model (full or LoRA) on instruction, chat or text data.

    accelerate launch recipes/finetune.py                       # offline demo (recipes/configs/demo.yaml)
    accelerate launch recipes/finetune.py --config recipes/configs/llama_full.yaml train.lr=2e-5
    python recipes/finetune.py output_dir=runs/try data.packing=true     # one process, same thing
    python recipes/finetune.py --config ... --prepare-only                # only tokenize into the cache
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/finetune.py   # DDP on CPU

Writes to output_dir: config.yaml, run.json, metrics.jsonl, loss.png, checkpoints/step-N/, final/.
SIGUSR1 (exit 0), SIGTERM or Ctrl-C (exit 128+signal) stop every process at the same step
after a complete checkpoint; run the same command again to continue.
"""

import sys
from pathlib import Path

from llmtrain import checkpoint, demo, rundir
from llmtrain.cli import parse_args, run_cli
from llmtrain.config import to_yaml
from llmtrain.data import resolve_chat_template
from llmtrain.errors import warn
from llmtrain.export import model_for_sampling, sample, save_final
from llmtrain.launch import main_first, setup_accelerator
from llmtrain.metrics import describe_run, plot_losses
from llmtrain.model import attention_backend, check_model, load_model, load_tokenizer, meta_model
from llmtrain.objective import TokenLoss
from llmtrain.stop import StopRequest
from llmtrain.train import build_datasets, setup, train
from llmtrain.watchdog import Watchdog
from llmtrain.window import Outcome

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def main(argv=None):
    stop = StopRequest().install()  # SIGUSR1/SIGTERM/SIGINT: exit; while training, after a checkpoint
    cfg, args = parse_args(argv, DEFAULT_CONFIG, description=__doc__.splitlines()[0])
    accelerator = setup_accelerator(cfg)
    with main_first(accelerator):
        demo.resolve_demo_names(cfg)  # builds the offline demo model and data once
    sample_tokens = cfg.eval.sample_max_new_tokens if cfg.eval.sample_prompts else 0
    mcfg = check_model(cfg.model, cfg.data.max_seq_len, sample_tokens)
    cfg.model.attn_implementation = attention_backend(cfg.model, cfg.data.packing, accelerator.device)
    checkpoint.check_writable(cfg.output_dir)
    rundir.lock(cfg.output_dir, accelerator)  # one run per output_dir, until this process ends
    if (step := rundir.already_finished(cfg)) is not None:
        accelerator.print(f"{cfg.output_dir} already finished at step {step} with these settings; final/ is up to date")
        return
    checkpoint.check_free_space(cfg.output_dir, checkpoint.output_bytes(meta_model(cfg.model, mcfg)))
    if accelerator.is_main_process:
        checkpoint.clean_leftovers(cfg.output_dir)  # what a killed run left half written or half deleted
    accelerator.wait_for_everyone()
    resume_from = checkpoint.find_resume(
        cfg.output_dir, cfg.checkpoint.resume, warn, cfg.checkpoint.require_rng_state, accelerator
    )
    rundir.check_rerun(cfg, resume_from)
    if resume_from is not None:
        rundir.warn_changes(resume_from, cfg)

    tokenizer = load_tokenizer(cfg.model, resolve_chat_template(cfg.data))
    train_set, eval_set = build_datasets(cfg, accelerator, tokenizer)
    if args.prepare_only:  # the tokenized data is in the datasets cache now
        return
    model = load_model(cfg.model)
    objective = TokenLoss.for_model(model, cfg.model.attn_implementation, cfg.train.loss_chunk_tokens)

    # From here on a dead or hung rank ends the job within train.hang_timeout_s.
    with Watchdog(cfg.train.hang_timeout_s, accelerator.process_index, accelerator.num_processes) as watchdog:
        run = setup(cfg, accelerator, model, tokenizer, objective, train_set, eval_set, resume_from, stop, watchdog)
        if rundir.up_to_date(cfg.output_dir, run.state.step, run.total_steps):
            accelerator.print(f"nothing left to train at step {run.state.step}; final/ is up to date")
            accelerator.end_training()
            return
        describe_run(cfg, accelerator, resume_from)  # config.yaml, run.json: only now that the run trains
        with stop.deferred():  # a signal stops the loop at an agreed step, or waits for final/
            outcome = train(run)
            if outcome is Outcome.FINISHED:
                watchdog.beat("writing final/")
                config, state = to_yaml(cfg), run.state.state_dict()
                final = save_final(
                    accelerator, run.model, tokenizer, cfg.output_dir, config, cfg.export.merge_lora, state
                )
    if outcome is Outcome.STOPPED:
        accelerator.end_training()
        sys.exit(stop.exit_code())
    if accelerator.is_main_process:
        plot_losses(Path(cfg.output_dir) / "metrics.jsonl", Path(cfg.output_dir) / "loss.png")
        print(f"saved {final}")
        prompts = cfg.eval.sample_prompts
        if prompts:
            model = model_for_sampling(accelerator, run.model, final)
            answers = sample(model, tokenizer, prompts, cfg.eval.sample_max_new_tokens, None)
            for prompt, answer in zip(prompts, answers):
                print(f"sample> {prompt!r} -> {answer!r}")
    accelerator.end_training()  # closes trackers and the process group: last


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
