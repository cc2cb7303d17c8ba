"""bf16 training's GEMMs: the forward products accumulate in float32 and are unchanged; the
backward products take the cotangent rounded to bf16 and run bf16 x bf16 (dispatch's
bf16_dot_general / bf16_einsum), so no backward GEMM of a bf16 training step runs in float32.
The last test lowers a whole training step for CUDA (no GPU needed) and reads its dots."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.dispatch import bf16_dot_general, bf16_einsum

DIMS = (((1,), (1,)), ((), ()))


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def test_forward_is_the_plain_float32_accumulating_product():
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((7, 48)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((24, 48)), jnp.bfloat16)
  want = jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(bf16_dot_general(a, b, DIMS)), np.asarray(want))
  want = jnp.einsum("mk,nk->mn", a, b, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(bf16_einsum("mk,nk->mn", a, b)), np.asarray(want))


@pytest.mark.parametrize("which", ["dot_general", "einsum"])
def test_gradients_are_the_bf16_cotangents_products(which):
  """d/da and d/db of sum(c * (a b^T)) for a float32 cotangent c: float64 numpy products of
  the bf16-rounded c, within bf16 rounding of the result; and they differ from the products
  of the unrounded c by more than that (the rounding is there)."""
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.standard_normal((9, 64)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
  c = rng.standard_normal((9, 32)).astype(np.float32) * (1 + 1e-3 * rng.standard_normal((9, 32)))
  prod = ((lambda x, y: bf16_dot_general(x, y, DIMS)) if which == "dot_general"
          else (lambda x, y: bf16_einsum("mk,nk->mn", x, y)))
  da, db = jax.grad(lambda x, y: jnp.sum(prod(x, y) * c), argnums=(0, 1))(a, b)
  assert da.dtype == db.dtype == jnp.bfloat16
  cr = _bf16(c)
  for got, want in ((da, cr @ _bf16(b)), (db, cr.T @ _bf16(a))):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7,
                               atol=2 ** -7 * np.abs(want).max())


def _dots(text: str) -> list[tuple[str, str]]:
  return re.findall(r"stablehlo\.dot_general[^\n]*:\s*\(tensor<[^>]*x(\w+)>,\s*"
                    r"tensor<[^>]*x(\w+)>\)", text)


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_bf16_training_step_has_no_float32_gemm_on_cuda(family):
  """The drafter's value_and_grad (bf16 compute, float32 masters), lowered for CUDA: every
  dot takes bf16 operands, forward and backward (XLA's own transpose of a bf16 dot with a
  float32 result would take float32 operands)."""
  from benchmarks import train_throughput as T
  from dflash_jax.models import qwen3
  from dflash_jax.train import forward as F
  from dflash_jax.train import trainer as TR
  from dflash_jax.train.data import DrafterBatch
  from dflash_jax.train.loss import sample_anchors

  cfg, tcfg, n_vocab = T._configs("qwen3-8b", family, True)
  target = qwen3.init_params(tcfg, jax.random.key(0), jnp.bfloat16)
  tc = TR.DrafterTrainConfig(optim=TR.OptimConfig(total_steps=10, warmup_steps=1),
                             window=cfg.window, compute_dtype="bf16")
  params = F.init_drafter(cfg, 0, n_vocab=n_vocab)
  rng = np.random.default_rng(0)
  s, t = 2, 32
  tokens = rng.integers(0, n_vocab, (s, t)).astype(np.int32)
  mask = np.ones((s, t), bool)
  picks = [sample_anchors(mask[i], 4, rng) for i in range(s)]
  batch = DrafterBatch(tokens=tokens, loss_mask=mask, anchors=np.stack([a for a, _ in picks]),
                       anchor_valid=np.stack([v for _, v in picks]))
  capture = TR.training_capture_layers(cfg, tcfg)
  features = jnp.zeros((s, t, len(capture) * cfg.n_embd), jnp.float32)
  grad = jax.jit(jax.value_and_grad(TR.drafter_loss, has_aux=True),
                 static_argnames=("cfg", "target_cfg", "tc"))
  text = grad.trace(params, target, batch, features, cfg=cfg, target_cfg=tcfg,
                    tc=tc).lower(lowering_platforms=("cuda",)).as_text()
  dots = _dots(text)
  assert len(dots) >= 20, len(dots)
  assert all(d == ("bf16", "bf16") for d in dots), sorted(set(dots))
