"""The batch-invariant target (issue 41): every row of a Qwen3-family target pass is bitwise
independent of how many rows share the call (impl="pallas", the default policy), so greedy
speculative decoding equals target-only greedy decoding token for token in bf16 as in fp32.

CPU (interpret mode, small dims): a 16-row verify of 3 sequences against 5-row verifies,
each sequence alone, sixteen 1-row decodes, a cache of another capacity, with and without
captured features; the cache rows they write; the decoding loop at widths 5 and 16 over 3
slots against target-only decoding. GPU: the same at Qwen3-8B widths, and 512 tokens of the
8B-shaped bf16 target at k = 3, 7, 15 forced-accepted drafts against target-only decoding;
the verify's cache updated in place, one command buffer, the launches per layer.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.oracle import Oracle
from dflash_jax import decode as D
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.config import FULL, SLIDING
from dflash_jax.models import muse_glimmer as M
from dflash_jax.models import qwen3 as Q
from dflash_jax.models.base import prefill_bucket

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

CFG = Q.TargetConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                     max_position_embeddings=512)
# Muse-Glimmer: sandwich joints, a full NoPE layer between two sliding ones whose rings hold
# window 8 + RING_SLACK 64 = 72 slots.
MUSE = M.MuseGlimmerConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rope_theta=1e4, sliding_window=8,
                           layer_types=(SLIDING, FULL, SLIDING), layer_rope_theta=(1e4, 0.0, 1e4),
                           max_position_embeddings=512)
LENGTHS = (5, 9, 13)   # the 3 sequences' prefilled lengths
W = 16


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _prefilled(cfg, params, dtype, tokens, lengths, capacity, impl="pallas", model=Q):
  """A cache holding each sequence's first lengths[b] tokens (one prefill, bucketed)."""
  cache = cfg.init_cache(len(lengths), capacity, dtype)
  bucket = prefill_bucket(max(lengths))
  cache, _ = model.prefill_jit(params, cfg, cache, tokens[:, :bucket],
                               jnp.asarray(lengths, jnp.int32), impl=impl)
  return cache


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def check_rows_invariant(cfg, params, dtype, lengths, capacity, widths=(5,), decode_slots=(0,),
                         capture=(1, 2), reference=None, model=Q, other_capacity=True):
  """A W-row verify of every sequence (capturing features) against: w-row verifies for w in
  widths; each sequence in decode_slots alone, as W 1-row decodes committed one by one (no
  capture, as target-only decoding runs); its first rows again in a cache of another
  capacity. Logits and the cache rows written are compared bit for bit. reference(tokens
  [T]) -> logits [T, V]: the W-row verify's logits are also checked against it. model: the
  target family's module (its prefill_jit / verify_jit; cfg gives the cache and commit).
  other_capacity False: no decodes in a wider cache (a ring's slots are not padding)."""
  b = len(lengths)
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, cfg.vocab_size, (b, prefill_bucket(max(lengths)) + W)).astype(np.int32)
  cache = _prefilled(cfg, params, dtype, tokens, lengths, capacity, model=model)
  vt = np.stack([tokens[i, n:n + W] for i, n in enumerate(lengths)])
  big_cache, big, _ = model.verify_jit(params, cfg, _copy(cache), vt, capture_layers=capture,
                                       impl="pallas")
  if reference is not None:
    for i, n in enumerate(lengths):
      np.testing.assert_allclose(big[i], reference(tokens[i, :n + W])[n:], rtol=1e-4,
                                 atol=1e-4)
  big = _bits(big)
  for w in widths:
    _, got, _ = model.verify_jit(params, cfg, _copy(cache), vt[:, :w], impl="pallas")
    np.testing.assert_array_equal(_bits(got), big[:, :w], err_msg=f"{w}-row verify")
  for cap, steps in ((capacity, W),) + (((capacity + 24, 3),) if other_capacity else ()):
    for s in decode_slots:
      one = _copy(jax.tree.map(lambda a: a[s:s + 1], cache))
      if cap != capacity:
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, cap - capacity), (0, 0)))
        one = one.replace(k=tuple(map(pad, one.k)), v=tuple(map(pad, one.v)))
      for i in range(steps):
        one, got, _ = model.verify_jit(params, cfg, one, vt[s:s + 1, i:i + 1], impl="pallas")
        one = cfg.commit(one, jnp.ones((1,), jnp.int32))
        np.testing.assert_array_equal(_bits(got)[0, 0], big[s, i],
                                      err_msg=f"slot {s} row {i}, capacity {cap}")
      upto = lengths[s] + steps   # the committed slots: the prompt's and the decoded rows'
      for l in range(cfg.num_hidden_layers):
        for got_c, big_c in ((one.k[l], big_cache.k[l]), (one.v[l], big_cache.v[l])):
          np.testing.assert_array_equal(_bits(got_c)[0, :, :upto], _bits(big_c)[s, :, :upto],
                                        err_msg=f"cache layer {l}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_rows_equal_one_row_decodes(dtype):
  """3 sequences x 16 rows (48 GEMM rows) against 5-row verifies, one sequence's sixteen
  1-row decodes (alone, no capture), and a wider cache: bit for bit; in fp32 the 16-row
  verify also against the float64 numpy forward."""
  from reference.targets.qwen3 import hidden_states
  params = Q.init_params(CFG, jax.random.key(1), dtype)
  ref = (lambda toks: hidden_states(params, CFG, toks)[1]) if dtype == "fp32" else None
  check_rows_invariant(CFG, params, dtype, LENGTHS, 48, widths=(5,), decode_slots=(1,),
                       reference=ref)


def test_llama_variant_rows_are_invariant():
  """No q/k norm, a tied head (the Llama-3 variant), a 1-sequence verify: the same."""
  cfg = dataclasses.replace(CFG, qk_norm=False, tie_word_embeddings=True)
  params = Q.init_params(cfg, jax.random.key(2), "bf16")
  check_rows_invariant(cfg, params, "bf16", (11,), 40, widths=(), decode_slots=(0,),
                       capture=(0, 2))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muse_glimmer_rows_are_invariant(dtype):
  """Muse-Glimmer's Pallas path, 3 sequences past their rings' first lap (positions 75-105
  in rings of 72 slots): the same, and in fp32 against the float64 numpy reference."""
  from reference.targets import muse_glimmer as RM
  params = M.init_params(MUSE, jax.random.key(3), dtype)
  ref = None
  if dtype == "fp32":
    tensors = {n: np.asarray(a, np.float64) for n, a in M.params_to_hf(MUSE, params).items()}
    ref = lambda toks: RM.hidden_states(MUSE.to_hf(), tensors, toks)[1]
  assert MUSE.ring_slots(128) == 72
  check_rows_invariant(MUSE, params, dtype, (75, 80, 90), 128, widths=(5,), decode_slots=(2,),
                       capture=(1, 3), reference=ref, model=M, other_capacity=False)


def test_wide_prefill_on_the_pallas_path_matches_the_reference():
  """impl="pallas" with a prefill wider than target_pallas_max_width (a 40-token prompt in a
  64-row bucket: XLA's attention, the Pallas norms and GEMMs), then 5-row verifies of 2
  sequences: the float64 forward's logits (fp32 weights)."""
  from reference.targets.qwen3 import hidden_states
  params = Q.init_params(CFG, jax.random.key(8), "fp32")
  tokens = np.random.default_rng(9).integers(0, CFG.vocab_size, (2, 70)).astype(np.int32)
  cache = Q.init_cache(CFG, 2, 80, "fp32")
  cache, _ = Q.prefill_jit(params, CFG, cache, tokens[:, :64], jnp.asarray([40, 33], jnp.int32),
                           impl="pallas")
  vt = np.stack([tokens[0, 40:45], tokens[1, 33:38]])
  _, logits, _ = Q.verify_jit(params, CFG, cache, vt, impl="pallas")
  for i, n in enumerate((40, 33)):
    want = hidden_states(params, CFG, tokens[i, :n + 5])[1][n:]
    np.testing.assert_allclose(logits[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, family", [("fp32", "qwen3"), ("bf16", "qwen3"),
                                           ("bf16", "muse")])
def test_greedy_speculative_equals_target_only(dtype, family):
  """The decoding loop with the Pallas target: target-only decoding (1 row per slot) against
  speculative rounds of 5 and 16 rows per slot over 3 slots with oracle drafts (the target's
  own continuation with a quarter of its tokens changed: every acceptance length, rollbacks,
  bonus tokens): the same tokens, in bf16 too. Muse-Glimmer (bf16: where invariance is what
  makes it hold) with its longest prompt past its rings' first lap."""
  cfg, module, lengths, capacity = {"qwen3": (CFG, Q, (3, 8, 17), 64),
                                    "muse": (MUSE, M, (3, 8, 77), 128)}[family]
  params = module.init_params(cfg, jax.random.key(5), dtype)
  models = D.Models(target=params, drafter=None, d2t=None, target_cfg=cfg)
  rng = np.random.default_rng(6)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
  kw = dict(capacity=capacity, cache_dtype=dtype, rounds_per_call=4)
  base = D.generate_target_only(params, cfg, prompts, 24, target_impl="pallas", **kw).tokens
  for width in (5, 16):
    noisy = []
    for p, c in zip(prompts, base):
      c = np.array(c)
      bad = rng.random(len(c)) < 0.25
      c[bad] = (c[bad] + 1 + rng.integers(0, cfg.vocab_size - 2, bad.sum())) % cfg.vocab_size
      noisy.append(p + c.tolist())
    dcfg = D.DecodeConfig(width=width, target_impl="pallas", proposer=Oracle(run_drafter=False))
    g = D.generate(models, dcfg, prompts, 24, proposer_state=Oracle.state(noisy, capacity),
                   **kw)
    assert g.tokens == base, width
    assert g.hist[:, 1:].sum() > 0 and g.hist[:, 0].sum() > 0, g.hist


# --- GPU: Qwen3-8B shapes ----------------------------------------------------------------------

QWEN3_8B = Q.TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_qwen3_8b_widths_rows_are_invariant(dtype):
  """Qwen3-8B's widths and vocab, 2 layers: 3 sequences x 16 rows (48 GEMM rows) against
  5-row verifies and sixteen 1-row decodes of one sequence, bit for bit (the GPU's kernels)."""
  cfg = dataclasses.replace(QWEN3_8B, num_hidden_layers=2)
  params = Q.init_params(cfg, jax.random.key(0), dtype)
  check_rows_invariant(cfg, params, dtype, (100, 700, 1500), 2048, widths=(5,),
                       decode_slots=(2,))


@pytest.fixture(scope="module")
def qwen3_8b_bf16():
  """The 36-layer Qwen3-8B-shaped bf16 target and its target-only greedy continuation of a
  128-token prompt (512 + 16 tokens: every k's oracle)."""
  params = Q.init_params(QWEN3_8B, jax.random.key(0), "bf16")
  prompt = np.random.default_rng(0).integers(0, QWEN3_8B.vocab_size, 128).tolist()
  g = D.generate_target_only(params, QWEN3_8B, [prompt], 528, target_impl="pallas",
                             capacity=1024, cache_dtype="bf16", rounds_per_call=64)
  return params, prompt, g.tokens[0]


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3, 7, 15])
def test_gpu_qwen3_8b_greedy_lossless_512_tokens(qwen3_8b_bf16, k):
  """512 tokens of the bf16 8B-shaped target, k drafts per round forced accepted (the oracle
  is target-only decoding's own output): every draft of every round is accepted on the first
  run and the tokens equal target-only decoding's."""
  params, prompt, base = qwen3_8b_bf16
  models = D.Models(target=params, drafter=None, d2t=None, target_cfg=QWEN3_8B)
  dcfg = D.DecodeConfig(width=k + 1, target_impl="pallas", proposer=Oracle(run_drafter=False))
  g = D.generate(models, dcfg, [prompt], 512, capacity=1024, cache_dtype="bf16",
                 rounds_per_call=64, proposer_state=Oracle.state([prompt + base], 1024))
  assert g.tokens[0] == base[:512]
  rounds = -(-512 // (k + 1))
  assert int(g.rounds.sum()) == rounds and g.hist[0, k] == rounds, g.hist


def _copies_with_bytes(hlo: str) -> list[str]:
  """The copy instructions of an HLO text whose result holds any element. XLA copies the
  empty features output ([B, w, 0]: no capture layers) into its own buffer; that moves no
  byte, so only the others count."""
  copied = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
  return [dims for dims in copied if 0 not in [int(d) for d in dims.split(",") if d]]


def test_copies_with_bytes_reads_hlo_copies():
  hlo = ("  %copy.19 = f32[1,16,0]{2,1,0} copy(%get-tuple-element.20)\n"
         "  %copy.3 = bf16[1,8,4096,128]{3,2,1,0} copy(%p.1)\n"
         "  %c = s32[] copy(%y)\n"
         "  ROOT %tuple.15 = (bf16[1,8,4096,128]{3,2,1,0}) tuple(%copy.19)\n")
  assert _copies_with_bytes(hlo) == ["1,8,4096,128", ""]
  assert _copies_with_bytes(hlo.splitlines()[0]) == []


@pytest.mark.gpu
def test_gpu_verify_updates_the_cache_in_place():
  """The Pallas verify (donated cache) aliases every K/V buffer: no copy in the program."""
  cfg = dataclasses.replace(QWEN3_8B, num_hidden_layers=2, vocab_size=32768)
  params = Q.init_params(cfg, jax.random.key(0), "bf16")
  cache = Q.init_cache(cfg, 1, 4096, "bf16").replace(length=jnp.array([100], jnp.int32))
  tokens = jnp.ones((1, 16), jnp.int32)
  compiled = Q.verify_jit.lower(params, cfg, cache, tokens, impl="pallas").compile()
  hlo = compiled.as_text()
  assert "input_output_alias" in hlo
  assert not _copies_with_bytes(hlo) and "copy-start" not in hlo
  kv = sum(a.nbytes for a in jax.tree.leaves((cache.k, cache.v)))
  assert compiled.memory_analysis().alias_size_in_bytes >= kv
  ptrs = [a.unsafe_buffer_pointer() for a in jax.tree.leaves((cache.k, cache.v))]
  new, _, _ = Q.verify_jit(params, cfg, cache, tokens, impl="pallas")
  assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves((new.k, new.v))] == ptrs


@pytest.mark.gpu
def test_gpu_verify_runs_as_one_command_buffer(tmp_path):
  """XLA records the whole Pallas verify, its kernels included, into one command buffer."""
  script = textwrap.dedent("""
      import dataclasses, jax, jax.numpy as jnp
      from dflash_jax.models import qwen3 as Q
      cfg = Q.TargetConfig(vocab_size=32768, hidden_size=4096, intermediate_size=12288,
                           num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128)
      params = Q.init_params(cfg, jax.random.key(0), "bf16")
      cache = Q.init_cache(cfg, 1, 2048, "bf16").replace(length=jnp.array([100], jnp.int32))
      _, logits, _ = Q.verify_jit(params, cfg, cache, jnp.ones((1, 16), jnp.int32),
                                  impl="pallas")
      jax.block_until_ready(logits)
  """)
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}")
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.getcwd())
  files = glob.glob(str(tmp_path / "*verify*thunk_sequence_after_thunk_passes.txt"))
  assert files, os.listdir(tmp_path)[:20]
  text = open(files[0]).read()
  top = [l for l in text.splitlines() if l and not l.startswith(" ")]
  assert len(top) == 1 and "kCommandBuffer" in top[0], top
  for kernel in ("qk_norm_rope_cache", "cache_attn_partial", "cache_attn_combine",
                 "add_rms_norm", "skinny_matmul"):
    assert kernel in text, kernel


@pytest.mark.gpu
def test_gpu_launches_per_target_layer():
  """Per decoder layer: 9 on the Pallas path (pre-norm, qkv, norm + rope + cache write,
  attention partial + combine, o, pre-norm, gate+up, down), at 1 and 16 rows; XLA's
  path for comparison (printed: the count before issue 41's kernels)."""
  from benchmarks import common as C
  for w in (1, 16):
    n, names = C.target_layer_launches(QWEN3_8B, "pallas", w, 2048, 128, KernelPolicy())
    assert n == 9, (w, n, names)
  print("xla launches per layer (w = 1, 16):",
        [C.target_layer_launches(QWEN3_8B, "xla", w, 2048, 128)[0] for w in (1, 16)])


@pytest.mark.gpu
def test_gpu_muse_glimmer_launches_per_layer():
  """Muse-Glimmer-30B's layer on the Pallas path: 9 kernels (sandwich joint, qkvg, q/k norm
  (+ rope) + cache write, attention partial + combine (with the output gate), o, sandwich
  joint, gate+up, down), at 1 and 16 rows, a sliding layer (the 3-layer model's extra one) in a ring that has
  wrapped; XLA's path printed for comparison."""
  from benchmarks import common as C
  cfg = M.MuseGlimmerConfig(vocab_size=32768, hidden_size=6656, intermediate_size=19968,
                            num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=2,
                            head_dim=128, rope_theta=5e5)
  for w in (1, 16):
    n, names = C.target_layer_launches(cfg, "pallas", w, 4096, 3000, KernelPolicy(), module=M)
    assert n == 9, (w, n, names)
  print("xla launches per layer (w = 1, 16):",
        [C.target_layer_launches(cfg, "xla", w, 4096, 3000, module=M)[0] for w in (1, 16)])


@pytest.mark.gpu
def test_gpu_muse_glimmer_widths_rows_are_invariant():
  """Muse-Glimmer-30B's widths (hidden 6656, 32/2 heads x 128, ffn 19968), a sliding layer of
  window 64 (a 128-slot ring, wrapped), a full NoPE layer and another sliding one, vocab
  32768: 3 sequences x 16 rows against 5-row verifies and sixteen 1-row decodes, bit for bit
  (the GPU's kernels)."""
  cfg = M.MuseGlimmerConfig(vocab_size=32768, hidden_size=6656, intermediate_size=19968,
                            num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=2,
                            head_dim=128, rope_theta=5e5, sliding_window=64,
                            layer_types=(SLIDING, FULL, SLIDING),
                            layer_rope_theta=(5e5, 0.0, 5e5))
  params = M.init_params(cfg, jax.random.key(0), "bf16")
  check_rows_invariant(cfg, params, "bf16", (150, 300, 700), 1024, widths=(5,),
                       decode_slots=(2,), capture=(1, 3), model=M, other_capacity=False)
