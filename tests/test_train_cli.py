"""The training / evaluation subcommands reject bad arguments with one line and exit 2."""
import jax
import pytest

from dflash_jax.__main__ import main
from dflash_jax.cli.train_drafter import default_target_layers
from dflash_jax.models import qwen3, save_target


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
  assert main(argv) == 2
  assert _one_line_error(capsys, argument).startswith(f"python -m dflash_jax {argv[0]}: error:")


def test_value_errors_name_the_argument(tmp_path, capsys):
  out = str(tmp_path / "out")
  assert main(["train-target", "--out", out, "--steps", "5", "--warmup", "5"]) == 2
  _one_line_error(capsys, "--warmup")
  assert main(["train-target", "--out", out, "--heads", "6", "--kv-heads", "4"]) == 2
  _one_line_error(capsys, "--heads")
  (tmp_path / "empty").mkdir()
  assert main(["train-target", "--out", out, "--corpus", str(tmp_path / "empty"),
               "--batch", "2", "--seq-len", "16"]) == 2
  assert "no .py files" in _one_line_error(capsys, "--corpus")
  assert main(["eval", "--target", "T", "--widths", "16,1"]) == 2
  _one_line_error(capsys, "--widths")
  assert main(["train-drafter", "--target", "T", "--out", out]) == 2   # no such folder
  _one_line_error(capsys, "--target")


def test_a_drafter_the_kernels_cannot_run_is_refused_before_training(tmp_path, capsys):
  tcfg = qwen3.TargetConfig(vocab_size=272, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16)
  folder = save_target(str(tmp_path / "t"), tcfg, qwen3.init_params(tcfg, jax.random.key(0)))
  argv = ["train-drafter", "--target", folder, "--out", str(tmp_path / "d"), "--head-dim", "24"]
  assert main(argv) == 2
  assert "--any-shape" in _one_line_error(capsys, "--head-dim")
  assert not (tmp_path / "d").exists()


def test_default_target_layers_end_at_the_last_layer():
  assert default_target_layers(8) == (3, 5, 8)
  assert default_target_layers(36, 5) == (7, 14, 22, 29, 36)
  assert default_target_layers(2) == (1, 2)
