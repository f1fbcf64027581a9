"""A full disk while exporting, or while writing metrics, loses nothing it need not."""

from types import SimpleNamespace

import pytest

from llmtrain.checkpoint import CheckpointError
from llmtrain.export import save_final


def fake_accelerator(model):
    return SimpleNamespace(
        is_main_process=True,
        distributed_type="NO",
        get_state_dict=lambda m: m.state_dict(),
        unwrap_model=lambda m: m,
        wait_for_everyone=lambda: None,
    )


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_a_full_disk_while_exporting_is_one_error_saying_what_is_kept(
    tiny_model, tokenizer, tmp_path, monkeypatch, with_checkpoint
):
    from transformers import AutoModelForCausalLM

    from .test_checkpoint import fake_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model)

    def full(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", full)
    if with_checkpoint:
        fake_checkpoint(tmp_path, "step-8")
    with pytest.raises(CheckpointError) as e:
        save_final(fake_accelerator(model), model, tokenizer, str(tmp_path), "", False, {"step": 8})
    message = str(e.value)
    assert message.startswith(f"export: writing {tmp_path}/.tmp-final failed (No space left: Exception: Error while")
    if with_checkpoint:
        assert f"the newest checkpoint, {tmp_path}/checkpoints/step-8, is intact" in message
    else:
        assert message.endswith("no checkpoint was written (checkpoint.every_steps=0)")
    assert not (tmp_path / ".tmp-final").exists() and not (tmp_path / "final").exists()


def test_metrics_that_cannot_be_written_do_not_stop_training(tmp_path, capsys):
    from llmtrain.metrics import MetricsLog

    accelerator = SimpleNamespace(is_main_process=True, log=lambda *a, **k: None)
    log = MetricsLog(accelerator, str(tmp_path), None)
    log.path.unlink()
    log.path.mkdir()  # any write now fails with an OSError, as on a full disk
    log.log({"step": 1, "loss": 1.0})
    log.log({"step": 2, "loss": 0.9})
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "metrics.jsonl: cannot write (Is a directory); training goes on" in warnings[0]
