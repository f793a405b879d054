"""Bad inputs of the ``longnet`` command found by ``lab/bad_inputs/cli.yaml``, each
reported in a few lines naming the file and the fix (no traceback, exit status 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longnet.cli import main
from longnet.cli.errors import bad_config_file
from longnet.training import CausalLMModule

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"


@pytest.mark.parametrize(
    ("content", "holds"),
    [("", "is empty"), ("# only a comment\n", "is empty"), ("- trainer\n- model\n", "holds a list"),
     ("trainer\n", "holds a str")],
)
def test_a_config_that_is_not_a_mapping_is_named(tmp_path, capsys, content, holds):
    """jsonargparse says only "Unexpected config: <content>" (nothing for an empty file)."""
    config = tmp_path / "run.yaml"
    config.write_text(content)
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"longnet: error: {config} {holds}, not a config: a config is a YAML mapping" in err
    assert "configs/smoke.yaml" in err and "Traceback" not in err, err
    assert len(err.splitlines()) <= 3, err


def test_an_inline_config_that_is_not_a_mapping_is_named():
    assert bad_config_file(["fit", "--config=[1, 2]"]).startswith(
        "--config '[1, 2]' holds a list, not a config")


def test_mapping_configs_are_left_to_the_parser():
    assert bad_config_file(["fit", "--config", str(SMOKE), "--config", str(SMOKE)]) is None
    assert bad_config_file(["fit", "--config"]) is None


def test_a_config_that_is_not_valid_yaml_is_named_with_the_line(tmp_path, capsys):
    """jsonargparse says "Problems parsing config: ... in "<unicode string>", line 3"."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: [1\n")
    assert main(["fit", "--config", str(SMOKE), "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"longnet: error: {broken} is not valid YAML: " in err and "line 3" in err, err
    assert "<unicode string>" not in err and len(err.splitlines()) <= 3, err


def test_a_strategy_that_refuses_its_arguments_says_why(tmp_path, capsys, monkeypatch):
    """Among the union's alternatives (a strategy name, a strategy class) the class's own
    refusal is the reason printed, not "Expected a <class 'str'>"."""
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "sequence_parallel.yaml"
    assert main(["fit", "--config", str(config),
                 "--trainer.strategy.init_args.sequence_parallel_size", "0"]) == 2
    err = capsys.readouterr().err
    assert "sequence_parallel_size must be a positive integer, got 0" in err, err
    assert "Expected a" not in err


def test_a_warmup_longer_than_the_run_is_said(recwarn):
    """The learning rate of such a run never reaches its peak: legitimate for a quick check, so
    a warning naming both numbers, not an error."""
    tiny = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "max_positions": 16,
            "segment_lengths": [16], "dilation_rates": [1]}
    CausalLMModule(model="longnet-tiny", overrides=tiny, warmup_steps=4,
                   total_steps=5).configure_optimizers()
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]
    with pytest.warns(UserWarning, match=r"warmup_steps 50 is not below the schedule's 5 steps"):
        CausalLMModule(model="longnet-tiny", overrides=tiny, warmup_steps=50,
                       total_steps=5).configure_optimizers()


@pytest.mark.parametrize("value", ["0", "-2"])
def test_accumulate_grad_batches_below_one_is_refused_before_any_work(tmp_path, capsys, value):
    """Lightning takes any integer (0 failed at the first step with ZeroDivisionError)."""
    assert main(["fit", "--config", str(SMOKE), f"--trainer.logger.init_args.save_dir={tmp_path}",
                 f"--trainer.accumulate_grad_batches={value}"]) == 2
    err = capsys.readouterr().err
    assert (f"trainer.accumulate_grad_batches must be a positive integer, got {value}."
            in err), err
    assert "Traceback" not in err and not (tmp_path / "smoke").exists()


@pytest.mark.parametrize(("option", "value", "says"), [
    ("val_check_interval", "0", "trainer.val_check_interval must be positive"),
    ("val_check_interval", "-0.5", "trainer.val_check_interval must be positive"),
    ("gradient_clip_val", "-1", "trainer.gradient_clip_val must be >= 0"),
])
def test_trainer_values_lightning_cannot_use_are_refused_before_any_work(
        tmp_path, capsys, option, value, says):
    """Lightning took them: an interval of 0 failed at the first step (ZeroDivisionError), a
    negative clipping norm trained without clipping."""
    assert main(["fit", "--config", str(SMOKE), f"--trainer.logger.init_args.save_dir={tmp_path}",
                 f"--trainer.{option}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"{says}" in err and f"got {value}" in err, err
    assert "Traceback" not in err and not (tmp_path / "smoke").exists()


def test_a_fit_from_a_checkpoint_past_max_steps_is_refused(tmp_path, capsys):
    """It trained nothing, yet tested and exported again and saved a config.yaml saying
    max_steps 1 for a model trained 2 steps."""
    args = ["fit", "--config", str(SMOKE), f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1"]
    assert main([*args, "--trainer.max_steps=2"]) == 0
    run = tmp_path / "smoke"
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    capsys.readouterr()
    assert main([*args, "--trainer.max_steps=1", "--ckpt_path=last"]) == 2
    err = capsys.readouterr().err
    last = run / "checkpoints" / "last.ckpt"
    assert f"--ckpt_path {last} is at step 2, past --trainer.max_steps 1" in err, err
    assert "Traceback" not in err
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before
    assert main([*args, "--trainer.max_steps=2", "--ckpt_path=last"]) == 0  # a re-run: fine


def test_a_data_module_that_refuses_its_arguments_says_why_in_two_lines(tmp_path, capsys,
                                                                         monkeypatch):
    """jsonargparse wraps the data module's own error in its union's alternatives (9 lines with
    "Given value: Namespace(...)"); the command prints the data module's message alone."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(SMOKE), "--data.init_args.seq_len", "0"]) == 2
    err = capsys.readouterr().err
    assert "longnet: configuration error: seq_len must be a positive integer, got 0." in err
    assert "Union" not in err and "Namespace" not in err and len(err.splitlines()) <= 3, err


def test_a_write_that_finds_no_room_is_a_few_lines_naming_the_fix(tmp_path, capsys,
                                                                   monkeypatch):
    """A full disk, a file size limit or a read-only file system while saving (``OSError``
    EFBIG, ENOSPC, EROFS) says what to do and how to continue; another ``OSError`` keeps its
    traceback."""
    import errno

    import longnet.cli.entry as entry

    for code, fix in ((errno.EFBIG, "Raise the file size limit (ulimit -f)"),
                      (errno.ENOSPC, "Free space on the disk"),
                      (errno.EROFS, "Give a path on a writable file system")):
        def full(args, code=code):
            raise OSError(code, "no room", "runs/x/last.ckpt")

        monkeypatch.setattr(entry, "run_cli", full)
        assert main(["fit"]) == 2
        err = capsys.readouterr().err
        assert "a write to runs/x/last.ckpt failed: no room" in err and fix in err, err
        assert "--ckpt_path last" in err and "Traceback" not in err

    def broken(args):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(entry, "run_cli", broken)
    with pytest.raises(OSError, match="input/output"):
        main(["fit"])
