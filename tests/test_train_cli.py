"""The training / evaluation subcommands reject bad arguments with one line and exit 2."""
import pytest

from dflash_jax.__main__ import main
from dflash_jax.cli.train_drafter import default_target_layers


def _one_line_error(capsys, argument):
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "error:" in err[0] and argument in err[0], err
  return err[0]


@pytest.mark.parametrize("argv, argument", [
    (["train-target", "--out", "OUT", "--steps", "0"], "--steps"),
    (["train-target", "--out", "OUT", "--lr", "-1"], "--lr"),
    (["train-drafter", "--out", "OUT"], "--target"),
    (["train-drafter", "--target", "T", "--out", "O", "--target-layers", "1,x"], "--target-layers"),
    (["eval", "--target", "T", "--widths", "16,a"], "--widths"),
    (["eval", "--target", "T", "--impl", "cuda"], "--impl"),
])
def test_parse_errors_are_one_line_with_status_2(argv, argument, capsys):
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  _one_line_error(capsys, argument)


def test_value_errors_name_the_argument(tmp_path, capsys):
  out = str(tmp_path / "out")
  assert main(["train-target", "--out", out, "--steps", "5", "--warmup", "5"]) == 2
  _one_line_error(capsys, "--warmup")
  assert main(["train-target", "--out", out, "--heads", "6", "--kv-heads", "4"]) == 2
  _one_line_error(capsys, "--heads")
  (tmp_path / "empty").mkdir()
  assert main(["train-target", "--out", out, "--corpus", str(tmp_path / "empty")]) == 2
  assert "no .py files" in _one_line_error(capsys, "--corpus")
  assert main(["eval", "--target", "T", "--widths", "16,1"]) == 2
  _one_line_error(capsys, "--widths")


def test_default_target_layers_end_at_the_last_layer():
  assert default_target_layers(8) == (3, 5, 8)
  assert default_target_layers(36, 5) == (7, 14, 22, 29, 36)
  assert default_target_layers(2) == (1, 2)
