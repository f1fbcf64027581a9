import json

import pytest
import torch

from llmtrain.output.checkpoint import STATE_FILE, CheckpointError, complete_checkpoints, find_resume, manifest


def fake_checkpoint(root, name, complete=True):
    path = root / "checkpoints" / name
    (path / "pytorch_model").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "pytorch_model" / "shard_0.pt").write_bytes(b"optimizer shard")
    torch.save({"torch_manual_seed": torch.get_rng_state()}, path / "random_states_0.pkl")
    if complete:
        step = int(name.rsplit("-", 1)[1])  # a checkpoint's step is its directory's
        (path / STATE_FILE).write_text(json.dumps(POSITION | {"step": step, "settings": {}, "files": manifest(path)}))
    return path


POSITION = {"step": 1, "epoch": 0, "batches_in_epoch": 1}


@pytest.mark.parametrize(
    "fault",
    [
        "truncated",
        "flipped",
        "missing_rng",
        "garbled_rng",
        "no_position",
        "no_file_list",
        "bad_json",
        "no_settings",
        "settings_a_list",
        "a_layout_setting_a_string",
        "run_record_a_string",
        "negative_step",
        "step_not_its_own",
        "epoch_a_bool",
        "losses_garbled",
        "skips_a_string",
        "an_entry_without_size",
        "empty_file_list",
        "a_file_left_out",
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, fault):
    fake_checkpoint(tmp_path, "step-2")
    newest = fake_checkpoint(tmp_path, "step-4")
    if fault == "truncated":
        (newest / "pytorch_model" / "shard_0.pt").write_bytes(b"opt")
    elif fault == "flipped":  # same size, other content: only the checksum sees it
        (newest / "pytorch_model" / "shard_0.pt").write_bytes(b"optimizer shart")
    elif fault == "missing_rng":
        (newest / "random_states_0.pkl").unlink()
    elif fault == "garbled_rng":  # same size, not a pickle Accelerate can read
        rng = newest / "random_states_0.pkl"
        rng.write_bytes(bytes(rng.stat().st_size))
    elif fault == "no_position":
        (newest / STATE_FILE).write_text(json.dumps({"files": manifest(newest)}))
    elif fault == "no_file_list":
        (newest / STATE_FILE).write_text(json.dumps(POSITION))
    elif fault == "bad_json":
        (newest / STATE_FILE).write_text('{"step": 4, "fi')
    else:  # train_state.json edited by hand: every field is checked for its type
        state = json.loads((newest / STATE_FILE).read_text())
        rel = "pytorch_model/shard_0.pt"
        edits = {
            "no_settings": lambda s: s.pop("settings"),
            "settings_a_list": lambda s: s.update(settings=[]),
            # a resume converts the position with these: a string would be multiplied as text
            "a_layout_setting_a_string": lambda s: s.update(settings={"train.micro_batch_size": "abc"}),
            "run_record_a_string": lambda s: s.update(run="finetune"),
            "negative_step": lambda s: s.update(step=-5),
            "step_not_its_own": lambda s: s.update(step=1000),  # step-4 says 1000
            "epoch_a_bool": lambda s: s.update(epoch=True),
            "losses_garbled": lambda s: s.update(recent_losses="garbage"),
            "skips_a_string": lambda s: s.update(skips_in_a_row="x"),
            "an_entry_without_size": lambda s: s["files"][rel].pop("size"),
            "empty_file_list": lambda s: s.update(files={}),
            "a_file_left_out": lambda s: s["files"].pop(rel),
        }
        edits[fault](state)
        (newest / STATE_FILE).write_text(json.dumps(state))
    warnings = []
    assert find_resume(str(tmp_path), "auto", warnings.append).name == "step-2"
    assert len(warnings) == 1 and "step-4 is damaged" in warnings[0]
    with pytest.raises(CheckpointError, match="step-4 is damaged"):
        find_resume(str(tmp_path), str(newest))


@pytest.mark.parametrize("fault", ["missing", "garbled"])
def test_rng_state_may_be_waived_with_a_warning(tmp_path, fault):
    path = fake_checkpoint(tmp_path, "step-4")
    rng = path / "random_states_0.pkl"
    rng.unlink() if fault == "missing" else rng.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="random_states_0.pkl"):
        find_resume(str(tmp_path), "auto")
    warnings = []
    assert find_resume(str(tmp_path), "auto", warnings.append, rng_required=False) == path
    assert len(warnings) == 1 and "random_states_0.pkl missing or unreadable; resuming without it" in warnings[0]
    warnings.clear()
    assert find_resume(str(tmp_path), str(path), warnings.append, rng_required=False) == path
    assert len(warnings) == 1


def test_a_pickle_that_is_not_plain_data_is_never_executed(tmp_path):
    """RNG states are read with weights_only: a pickle that would run code is refused."""
    path = fake_checkpoint(tmp_path, "step-4")
    marker = tmp_path / "ran"
    torch.save({"torch_manual_seed": Boom(str(marker))}, path / "random_states_0.pkl")
    (path / STATE_FILE).write_text(json.dumps(POSITION | {"step": 4, "settings": {}, "files": manifest(path)}))
    with pytest.raises(CheckpointError, match="random_states_0.pkl cannot be read"):
        find_resume(str(tmp_path), "auto")
    assert not marker.exists()


class Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_only_damaged_checkpoints_is_an_error_not_a_fresh_start(tmp_path):
    path = fake_checkpoint(tmp_path, "step-4")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step-4: model.safetensors is missing"):
        find_resume(str(tmp_path), "auto")
    (path / STATE_FILE).unlink()  # a published checkpoint that lost its state file is damaged too
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step-4: train_state.json is missing"):
        find_resume(str(tmp_path), "auto")
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=none but .* holds checkpoints"):
        find_resume(str(tmp_path), "none")


def test_published_checkpoints_count_and_one_without_its_state_is_damaged(tmp_path):
    """A step-N directory is complete when published (renamed from .tmp-step-N): one without
    train_state.json has lost it, and is skipped with a warning, not taken for none."""
    fake_checkpoint(tmp_path, "step-10")
    fake_checkpoint(tmp_path, "step-2")
    fake_checkpoint(tmp_path, ".tmp-step-20")  # being written when the job died
    fake_checkpoint(tmp_path, "step-30", complete=False)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 10, 30]
    warnings = []
    assert find_resume(str(tmp_path), "auto", warnings.append).name == "step-10"
    assert len(warnings) == 1 and "step-30 is damaged (train_state.json is missing)" in warnings[0]


def test_resume_modes(tmp_path):
    assert find_resume(str(tmp_path), "auto") is None
    assert find_resume(str(tmp_path), "none") is None
    path = fake_checkpoint(tmp_path, "step-4")
    assert find_resume(str(tmp_path), str(path)) == path
    with pytest.raises(CheckpointError, match="checkpoint.resume=none but .* holds checkpoints of an earlier run"):
        find_resume(str(tmp_path), "none")
    with pytest.raises(CheckpointError, match="checkpoint.resume: no such directory: .*step-99; give a checkpoints/"):
        find_resume(str(tmp_path), str(tmp_path / "checkpoints" / "step-99"))
    with pytest.raises(CheckpointError, match="checkpoint.resume: .* is not a complete llmtrain checkpoint"):
        find_resume(str(tmp_path), str(tmp_path))


def test_resume_with_other_data_settings_is_refused(tmp_path):
    from types import SimpleNamespace

    from llmtrain.config import Config
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import load, position_settings

    cfg = Config()
    path = fake_checkpoint(tmp_path, "step-4")
    (path / STATE_FILE).write_text(
        json.dumps({"step": 4, "settings": position_settings(cfg, 2), "files": manifest(path)})
    )
    cfg.train.micro_batch_size, cfg.train.seed = 16, 3  # 2 processes x 4 -> 1 x 16: another global batch
    with pytest.raises(CheckpointError, match=r"global_batch was 8, now 16; train.seed was 42, now 3"):
        load(SimpleNamespace(num_processes=1), path, cfg, TrainState(), position_settings(cfg, 1))
    cfg.train.micro_batch_size, cfg.train.seed, cfg.data.streaming = 8, 42, True  # the same, but a stream
    with pytest.raises(CheckpointError, match=r"train.micro_batch_size was 4, now 8; world_size was 2, now 1"):
        load(SimpleNamespace(num_processes=1), path, cfg, TrainState(), position_settings(cfg, 1))
    cfg.train.micro_batch_size, cfg.data.num_workers = 4, 0
    stream = position_settings(cfg, 1)
    (path / STATE_FILE).write_text(json.dumps({"step": 4, "settings": stream, "files": manifest(path)}))
    cfg.data.num_workers = 2  # a stream's order depends on its loader workers
    with pytest.raises(CheckpointError, match=r"other data settings \(data.num_workers was 0, now 2\)"):
        load(SimpleNamespace(num_processes=1), path, cfg, TrainState(), position_settings(cfg, 1))
    del stream["data.num_workers"]  # written before it was recorded: taken as unchanged
    (path / STATE_FILE).write_text(json.dumps({"step": 4, "settings": stream, "files": manifest(path)}))
    with pytest.raises(CheckpointError) as e:  # past the settings, to the fake checkpoint's files
        load(SimpleNamespace(num_processes=1), path, cfg, TrainState(), position_settings(cfg, 1))
    assert "data settings" not in str(e.value)
    (path / STATE_FILE).write_text(
        json.dumps({"step": 4, "settings": position_settings(Config(), 2), "files": manifest(path)})
    )
    from accelerate.utils import DistributedType

    # The same global batch on 1 process: DeepSpeed's partitions cannot follow.
    cfg.data.streaming, cfg.train.micro_batch_size, cfg.data.num_workers = False, 8, 0
    deepspeed = SimpleNamespace(
        num_processes=1,
        distributed_type=DistributedType.DEEPSPEED,
        mixed_precision="no",
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)),
    )
    with pytest.raises(CheckpointError, match=r"written by 2 DeepSpeed processes.*cannot be resharded to 1"):
        load(deepspeed, path, cfg, TrainState(), position_settings(cfg, 1))


class FakeAccelerator:
    """One process; save_state writes part of a checkpoint, then the disk is full."""

    is_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        import errno
        from pathlib import Path

        (Path(path) / "model.safetensors").write_bytes(b"half a model")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_mid_checkpoint_is_one_clear_error_and_keeps_the_previous_one(tmp_path):
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import save

    previous = fake_checkpoint(tmp_path, "step-2")
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint: writing .*\.tmp-step-4 failed \(No space left on device\); "
        r"the newest complete checkpoint, .*step-2, is intact",
    ):
        save(FakeAccelerator(), str(tmp_path), TrainState(step=4), {}, "", keep_last=1)
    assert not (tmp_path / "checkpoints" / ".tmp-step-4").exists()  # the partial write is cleaned up
    assert find_resume(str(tmp_path), "auto") == previous


class RecordingAccelerator(FakeAccelerator):
    """One process whose save_state writes a file and whose load_state does nothing."""

    def save_state(self, path):
        from pathlib import Path

        (Path(path) / "model.safetensors").write_bytes(b"weights")

    def load_state(self, path):
        pass


def test_the_train_state_is_saved_and_loaded_whole(tmp_path):
    """Every field of the run's state comes back from a checkpoint, the spike window with
    it; a checkpoint written before skips_in_a_row was saved loads with 0 skips."""
    from llmtrain.config import Config
    from llmtrain.core.spike import SpikeGuard
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import load, position_settings, save

    cfg = Config()
    state = TrainState(step=7, epoch=1, batches_in_epoch=12, skips_in_a_row=2, spikes=SpikeGuard(2.0, 3, [1.0, 2.0]))
    path = save(RecordingAccelerator(), str(tmp_path), state, position_settings(cfg, 1), "", keep_last=0)
    assert path.name == "step-7" and find_resume(str(tmp_path), "auto") == path
    loaded = TrainState(spikes=SpikeGuard(2.0, 3))
    load(RecordingAccelerator(), path, cfg, loaded, position_settings(cfg, 1))
    assert loaded.state_dict() == state.state_dict() and loaded.spikes.window == 3
    saved = json.loads((path / STATE_FILE).read_text())
    del saved["skips_in_a_row"]
    (path / STATE_FILE).write_text(json.dumps(saved))
    load(RecordingAccelerator(), path, cfg, loaded, position_settings(cfg, 1))
    assert (loaded.step, loaded.skips_in_a_row, loaded.spikes.recent) == (7, 0, [1.0, 2.0])


def test_an_unwritable_output_dir_is_refused_at_start_up(tmp_path):
    from llmtrain.output.rundir import check_writable

    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match=r"output_dir: cannot write to .*a_file/run \(Not a directory\)"):
        check_writable(str(tmp_path / "a_file" / "run"))
    check_writable(str(tmp_path / "new" / "run"))
    assert list((tmp_path / "new" / "run").iterdir()) == []  # the probe is gone


def test_an_output_dir_that_is_a_file_or_a_link_to_no_directory_says_so(tmp_path):
    from llmtrain.output.rundir import check_writable

    (tmp_path / "a_file").write_text("")
    (tmp_path / "to_file").symlink_to(tmp_path / "a_file")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "to_dir").symlink_to(tmp_path / "new", target_is_directory=True)
    (tmp_path / "new").mkdir()
    with pytest.raises(CheckpointError, match=r"^output_dir: .*a_file is a file, not a directory; choose another"):
        check_writable(str(tmp_path / "a_file"))
    with pytest.raises(CheckpointError, match=r"^output_dir: .*to_file is a link to .*a_file, which is a file; make"):
        check_writable(str(tmp_path / "to_file"))
    with pytest.raises(CheckpointError, match=r"dangling is a link to .*gone, which is nothing \(its target"):
        check_writable(str(tmp_path / "dangling"))
    assert not (tmp_path / "gone").exists()
    check_writable(str(tmp_path / "to_dir"))  # a link to a directory is taken, as the user made it


def test_output_size_estimate_and_free_space_check(tmp_path, monkeypatch, capsys):
    import shutil
    from types import SimpleNamespace

    from llmtrain.output.rundir import check_free_space, output_bytes

    model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.Linear(10, 10, bias=False))
    model[1].weight.requires_grad_(False)  # frozen: saved, but no optimizer state
    need = output_bytes(model)
    assert need == {"export": 4 * (1010 + 100), "checkpoint": 4 * (1010 + 100) + 2 * 4 * 1010}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=need["checkpoint"] + need["export"]))
    check_free_space(str(tmp_path), need, keep_last=0)  # keep all: no count to warn about
    assert capsys.readouterr().err == ""
    check_free_space(str(tmp_path), need, keep_last=2)  # starts, warned: 3 checkpoints exist while one is written
    assert "but not the 3 checkpoints that exist while one is written with checkpoint.keep_last=2" in (
        capsys.readouterr().err
    )
    room = 3 * need["checkpoint"] + need["export"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=room))
    check_free_space(str(tmp_path), need, keep_last=2)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(CheckpointError, match=r"output_dir: .* has 0.00 GiB free, but one checkpoint .* need"):
        check_free_space(str(tmp_path), need, keep_last=2)


def test_deepspeed_files_are_checked_before_deepspeed_unpickles_them(tmp_path):
    """DeepSpeed loads *.pt with weights_only=False: a file carrying anything but tensors,
    plain data and DeepSpeed's own state classes is refused, and its code never runs."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from llmtrain.output.checkpoint import check_pickles

    path = fake_checkpoint(tmp_path, "step-4")
    (path / "pytorch_model" / "shard_0.pt").unlink()  # a stand-in, not a torch file
    torch.save(
        {"zero_stage": ZeroStageEnum.weights, "module": {"w": torch.ones(2)}},
        path / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    check_pickles(path)  # DeepSpeed's own state: fine
    marker = tmp_path / "ran"
    torch.save({"loss_scaler": Boom(str(marker))}, path / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError) as refused:
        check_pickles(path)
    assert not marker.exists()
    message = str(refused.value)
    assert (
        "refusing to unpickle" in message and "zero_pp_rank_1_mp_rank_00_optim_states.pt: it holds io.open" in message
    )
    assert "\n" not in message and "weights_only" not in message  # one line, and no advice to lower the guard


def test_a_same_size_corruption_is_named_by_its_file(tmp_path):
    fake_checkpoint(tmp_path, "step-2")
    newest = fake_checkpoint(tmp_path, "step-4")
    weights = newest / "model.safetensors"
    weights.write_bytes(b"wEights")  # one byte changed
    warnings = []
    assert find_resume(str(tmp_path), "auto", warnings.append).name == "step-2"
    assert warnings == [
        f"checkpoint {newest} is damaged (model.safetensors does not match the checksum it was written with); "
        "skipping it and trying the one before"
    ]


def test_a_checkpoint_listing_sizes_only_still_resumes(tmp_path):
    """Checkpoints written before checksums were kept list sizes: checked by size."""
    path = fake_checkpoint(tmp_path, "step-4")
    sizes = {rel: entry["size"] for rel, entry in manifest(path).items()}
    (path / STATE_FILE).write_text(json.dumps(POSITION | {"step": 4, "settings": {}, "files": sizes}))
    assert find_resume(str(tmp_path), "auto") == path


def test_checksums_are_shared_out_across_processes(tmp_path):
    """Each process hashes every N-th file and all get every result."""
    from types import SimpleNamespace
    from unittest import mock

    from llmtrain.output.checkpoint import checksum, checksums

    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 100)
    rels = [f"f{i}" for i in range(5)]
    hashed = []
    real = checksum

    def counting(path):
        hashed.append(path.name)
        return real(path)

    theirs = [("f0", real(tmp_path / "f0")), ("f2", real(tmp_path / "f2")), ("f4", real(tmp_path / "f4"))]
    with (
        mock.patch("llmtrain.output.checkpoint.checksum", counting),
        mock.patch("accelerate.utils.gather_object", lambda mine: theirs + mine),
    ):
        got = checksums(tmp_path, rels, SimpleNamespace(num_processes=2, process_index=1))
    assert hashed == ["f1", "f3"]  # this process's share only
    assert got == {rel: real(tmp_path / rel) for rel in rels}


def test_a_kill_while_pruning_never_leaves_a_half_deleted_step(tmp_path, monkeypatch):
    import shutil

    from llmtrain.output.checkpoint import clean_leftovers, remove

    old = fake_checkpoint(tmp_path, "step-2")
    fake_checkpoint(tmp_path, "step-4")

    def killed(path, ignore_errors=False):
        if ".deleting-" in str(path) and (path / "model.safetensors").exists():
            (path / "model.safetensors").unlink()  # part of it is gone...
            raise KeyboardInterrupt  # ...when the process dies
        real_rmtree(path, ignore_errors=ignore_errors)

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remove(old)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [p.name for _, p in complete_checkpoints(tmp_path)] == ["step-4"]
    assert (tmp_path / "checkpoints" / ".deleting-step-2").exists()
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4"]


def test_leftovers_of_a_killed_run_are_cleaned_or_put_back(tmp_path):
    from llmtrain.output.checkpoint import clean_leftovers

    root = tmp_path / "checkpoints"
    fake_checkpoint(tmp_path, ".tmp-step-6")  # being written
    fake_checkpoint(tmp_path, ".deleting-step-2")  # being deleted
    fake_checkpoint(tmp_path, ".old-step-4")  # set aside while step-4 was saved again, and step-4 not yet back
    fake_checkpoint(tmp_path, ".old-step-5")
    fake_checkpoint(tmp_path, "step-5")  # ...here the new one is in place
    (tmp_path / ".old-final").mkdir()
    (tmp_path / "final").mkdir()
    (root / ".tmp-notes").mkdir()  # not ours: left alone
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-notes", "step-4", "step-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "final"]
    assert find_resume(str(tmp_path), "auto").name == "step-5"


class FailingAccelerator(FakeAccelerator):
    def __init__(self, error):
        self.error = error

    def save_state(self, path):
        from pathlib import Path

        (Path(path) / "optimizer.bin").write_bytes(b"half")
        raise self.error


@pytest.mark.parametrize(
    "error, reported",
    [
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "unexpected pos"),
        (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), "No space left"),
    ],
    ids=["torch", "safetensors"],
)
def test_a_full_disk_is_reported_whatever_layer_raises_it(tmp_path, error, reported):
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import save

    with pytest.raises(CheckpointError, match=rf"checkpoint: writing .*\.tmp-step-4 failed \({reported}: "):
        save(FailingAccelerator(error), str(tmp_path), TrainState(step=4), {}, "", keep_last=1)
    assert not (tmp_path / "checkpoints" / ".tmp-step-4").exists()


def test_a_failure_that_is_not_a_write_fault_stays_a_bug(tmp_path):
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import save

    with pytest.raises(RuntimeError, match="a bug"):
        save(FailingAccelerator(RuntimeError("a bug")), str(tmp_path), TrainState(step=4), {}, "", keep_last=1)


def test_an_export_is_not_taken_for_a_checkpoint(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "llmtrain_config.yaml").write_text("train: {}\n")
    (final / STATE_FILE).write_text(json.dumps(POSITION))
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint.resume: {final} is an export \(final/\), not a checkpoint"
    ):
        find_resume(str(tmp_path), str(final))


def test_a_checkpoint_that_passes_the_checks_but_does_not_load_is_an_error_naming_it(tmp_path):
    """Say a file was deleted and taken out of the list, or the model settings changed."""
    from types import SimpleNamespace

    from llmtrain.config import load_config
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import load, position_settings

    cfg = load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"])
    path = fake_checkpoint(tmp_path, "step-4")
    torch.save({"exp_avg": torch.zeros(2)}, path / "pytorch_model" / "shard_0.pt")
    state = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps(state | {"settings": position_settings(cfg, 1), "files": manifest(path)}))

    def load_state(where):
        raise FileNotFoundError(f"No such file or directory: {where}/model.safetensors")

    accelerator = SimpleNamespace(num_processes=1, load_state=load_state)
    with pytest.raises(CheckpointError, match=rf"^checkpoint.resume: cannot load {path} \(FileNotFoundError: No such"):
        load(accelerator, path, cfg, TrainState(), position_settings(cfg, 1))


@pytest.mark.parametrize("saved", ["none", "nf4", "fp4", "int8"])
@pytest.mark.parametrize("now", ["none", "nf4", "fp4", "int8"])
def test_resume_with_another_quantization_is_refused(tmp_path, saved, now):
    """Any change of model.quantization between a checkpoint and its resume is refused (nf4
    and fp4 codes have the same shapes; int8 and none differ in dtype but the refusal names
    the key either way); the same one resumes. tests/launch/test_qlora.py runs it end to end."""
    from types import SimpleNamespace

    from llmtrain.output.checkpoint import check_weight_format

    (tmp_path / "config.yaml").write_text(f"model:\n  quantization: {saved}\n")
    cfg = SimpleNamespace(model=SimpleNamespace(quantization=now))
    if saved == now:
        check_weight_format(tmp_path, cfg)
        return
    refusal = f"model.quantization={saved}, now {now}.*Resume with model.quantization={saved}"
    with pytest.raises(CheckpointError, match=refusal):
        check_weight_format(tmp_path, cfg)


def test_a_refused_pickle_is_named_without_torchs_advice_to_load_it_unsafely(tmp_path):
    """torch's weights_only refusal says that loading with weights_only=False will likely
    succeed: on a file someone else wrote that runs its code. The resume error names what
    the file holds instead."""
    import pickle

    from llmtrain.output.checkpoint import refused_pickle

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "optimizer.bin"
    path.write_bytes(pickle.dumps(Payload(), protocol=2))  # the protocol torch writes
    with pytest.raises(Exception) as e:
        torch.load(path, weights_only=True)
    assert "weights_only" in str(e.value)  # torch's own message, with its advice
    why = refused_pickle(e.value)
    assert why.startswith("it holds ") and why.endswith("print, which is neither a tensor nor plain data")
    assert refused_pickle(ValueError("size mismatch for lm_head.weight")) is None


def test_a_position_this_run_cannot_be_at_is_refused(tmp_path):
    """A checkpoint's step past the end of the run (a train_state.json edited by hand, or the
    run made shorter), or a position past the end of a pass over the data (the data made
    smaller): one line naming the file and the key. The end itself, and a stream's position
    (no known pass length), pass."""
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import check_position

    path = tmp_path / "step-12"
    check_position(path, TrainState(step=10, epoch=1, batches_in_epoch=8), 10, 5, 2)  # the last step
    check_position(path, TrainState(step=3, epoch=0, batches_in_epoch=10), 10, 5, 2)  # a pass's last micro-batch
    check_position(path, TrainState(step=3, epoch=0, batches_in_epoch=10**6), 10, None, 2)  # a stream
    with pytest.raises(CheckpointError) as e:
        check_position(path, TrainState(step=12), 10, 5, 2)
    assert str(e.value) == (
        f"checkpoint.resume: {path}/{STATE_FILE}: step 12 is past the end of this run (10 steps); resume from an "
        "earlier checkpoint, or set train.max_steps to at least 12 to go on from this one"
    )
    with pytest.raises(CheckpointError) as e:
        check_position(path, TrainState(step=3, epoch=0, batches_in_epoch=11), 10, 5, 2)
    assert str(e.value).startswith(
        f"checkpoint.resume: {path}/{STATE_FILE}: batches_in_epoch: its position, 11 micro-batches into pass 0, is "
        "past the end of a pass over this run's data (10 on each process)"
    )
