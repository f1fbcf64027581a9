import json

import pytest

from llmtrain.checkpoint import STATE_FILE, CheckpointError, complete_checkpoints, find_resume


def fake_checkpoint(root, name, complete=True):
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / STATE_FILE).write_text(json.dumps({"step": 1}))
    return path


def test_only_complete_checkpoints_count(tmp_path):
    fake_checkpoint(tmp_path, "step-10")
    fake_checkpoint(tmp_path, "step-2")
    fake_checkpoint(tmp_path, ".tmp-step-20")  # being written when the job died
    fake_checkpoint(tmp_path, "step-30", complete=False)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 10]
    assert find_resume(str(tmp_path), "auto").name == "step-10"


def test_resume_modes(tmp_path):
    assert find_resume(str(tmp_path), "auto") is None
    assert find_resume(str(tmp_path), "none") is None
    path = fake_checkpoint(tmp_path, "step-4")
    assert find_resume(str(tmp_path), str(path)) == path
    with pytest.raises(CheckpointError, match="checkpoint.resume=none but .* holds checkpoints of an earlier run"):
        find_resume(str(tmp_path), "none")
    with pytest.raises(CheckpointError, match="checkpoint.resume: .* is not a complete llmtrain checkpoint"):
        find_resume(str(tmp_path), str(tmp_path / "checkpoints" / "step-99"))


def test_resume_with_other_data_settings_is_refused(tmp_path):
    from types import SimpleNamespace

    from llmtrain.checkpoint import load, position_settings
    from llmtrain.config import Config

    cfg = Config()
    path = fake_checkpoint(tmp_path, "step-4")
    (path / STATE_FILE).write_text(json.dumps({"step": 4, "settings": position_settings(cfg, 2)}))
    cfg.train.micro_batch_size = 8
    with pytest.raises(CheckpointError, match=r"train.micro_batch_size was 4, now 8; world_size was 2, now 1"):
        load(SimpleNamespace(num_processes=1), path, cfg)
