"""The drafter train step: online features = features cached in npy shards, float32 masters
under bf16 compute, and a checkpointed run resumes to the same weights as an uninterrupted
one; the trained weights export to GGUF and HF folders that load_drafter reads back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.train import checkpoint as C
from dflash_jax.train import features as FS
from dflash_jax.train import forward as F
from dflash_jax.train import recipes
from dflash_jax.train import trainer as TR

from _train_common import CFG, TC, TCFG, drafter_step, setup_data



def test_online_features_equal_cached_feature_shards(tmp_path):
  target, data = setup_data()
  m = FS.write_feature_shards(str(tmp_path), target, TCFG, CFG.target_layers, data.tokens,
                              batch_size=8, shard_rows=8)
  assert [s["rows"] for s in m["shards"]] == [8, 8]
  shards = FS.FeatureShards(str(tmp_path), CFG.target_layers)
  b = data.batch(0)
  w = F.init_drafter(CFG, seed=1)

  def both(w, target, b, cached):
    online = TR.target_features(target, TCFG, CFG.target_layers, b.tokens)
    return (online, TR.drafter_loss(w, target, b, cfg=CFG, target_cfg=TCFG, tc=TC)[0],
            TR.drafter_loss(w, target, b, cached, cfg=CFG, target_cfg=TCFG, tc=TC)[0])

  cached = shards.rows(data.rows(0))
  online, loss_online, loss_cached = jax.jit(both)(w, target, b, cached)
  np.testing.assert_allclose(cached, np.asarray(online), rtol=1e-5, atol=1e-5)
  assert np.isfinite(float(loss_online))
  np.testing.assert_allclose(float(loss_online), float(loss_cached), rtol=1e-5)

  with pytest.raises(ValueError, match="the drafter needs"):
    FS.FeatureShards(str(tmp_path), (1,))
  (tmp_path / "features-00001.npy").write_bytes(b"")
  with pytest.raises(ValueError, match="features-00001.npy: not a readable npy shard"):
    FS.FeatureShards(str(tmp_path))


def _run(state, target, data, steps):
  losses = []
  for s in steps:
    state, m = drafter_step(state, target, data.batch(s), cfg=CFG, target_cfg=TCFG,
                                         tc=TC)
    losses.append(float(m["loss"]))
  return state, losses


def test_resume_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path):
  target, data = setup_data()
  fresh = lambda: TR.init_state(F.init_drafter(CFG, seed=1), TC.optim)
  straight, losses = _run(fresh(), target, data, range(6))
  assert all(np.isfinite(losses))
  for k, v in straight.params.items():
    assert v.dtype == jnp.float32, k   # masters stay float32 under bf16 compute

  first, _ = _run(fresh(), target, data, range(3))
  C.save_checkpoint(str(tmp_path / "ck"), first, {"seed": data.seed})
  assert C.latest_step(str(tmp_path / "ck")) == 3
  restored, record = C.restore_checkpoint(str(tmp_path / "ck"), fresh())
  assert record == {"seed": data.seed} and int(restored.step) == 3
  # The data order resumes from the restored step alone.
  resumed, _ = _run(restored, target, data, range(int(restored.step), 6))
  for k in straight.params:
    np.testing.assert_array_equal(np.asarray(resumed.params[k]), np.asarray(straight.params[k]),
                                  err_msg=k)
  np.testing.assert_array_equal(int(resumed.step), 6)

  # Export: the trained weights are keyed like the host weights, so save_drafter writes them.
  host = recipes.host_weights(resumed.params)
  for name, fmt, typ in (("d.gguf", "gguf", "F32"), ("d-hf", "hf", "f32")):
    cfg, back = dfj.load_drafter(dfj.save_drafter(str(tmp_path / name), CFG, host,
                                                  tensor_type=typ, format=fmt))
    assert cfg == CFG and set(back) == set(host)
    for k in host:
      np.testing.assert_array_equal(back[k], host[k], err_msg=f"{fmt} {k}")


def test_restore_from_an_empty_directory_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    C.restore_checkpoint(str(tmp_path / "none"), TR.init_state(F.init_drafter(CFG), TC.optim))
