"""The seed drafter's kernels lower exactly as the tuned kernels did before any-shape masking.

Issue 13 asks that the shapes the tiles already fit (seed drafter: block 16, G 4, head_dim
128, a 2048-slot ring; the step's skinny GEMM shapes) pay nothing for masking. Every such
launch is lowered for an sm90 target (jax.export to "cuda", which needs no GPU once Pallas'
GPU query is stubbed) and its Triton IR plus the XLA wrapper around it (reshapes, pads) are
compared by SHA-256 with the lowering of commit d6f6ae0, the kernels benchmarked in
benchmarks/RESULTS.md run 10. Same IR, same compiled kernel, same speed.

The expected hashes were made by this module's `lowered_text` on d6f6ae0 (whose
ring_attention had no `window`: it was the slot count, 2048, as passed here). They are tied to
jax 0.11.2 (pinned in constraints.txt). A deliberate change to a tuned kernel shows here:
benchmark it (RESULTS.md), then replace its hash with the one the failure prints.
"""
from __future__ import annotations

import functools
import hashlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import pallas_call_registration as triton_registration

from dflash_jax.dispatch import KernelPolicy
from pallas_kernels import inject as I
from pallas_kernels import norm_rope as N
from pallas_kernels import ring_attention as R
from pallas_kernels import skinny_gemm as G

S = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
W_DTYPE = {"bf16": BF16, "fp8": jnp.float8_e4m3fn, "q8_0": jnp.int8}
POLICY = KernelPolicy()   # the default knobs' thresholds


def _gemm(fmt: str, n: int, k: int, gate_up: bool, knobs: dict):
  scale = () if fmt == "bf16" else ((S((n,), F32),) if fmt == "fp8" else (S((n, k // 32), F32),))
  fn = G.skinny_matmul_gate_up if gate_up else G.skinny_matmul
  f = functools.partial(fn, fmt=fmt, num_stages=3, interpret=False,
                        **({"out_dtype": BF16} if gate_up else {}), **knobs)
  return (lambda x, w, *s: f(x, w, *s)), (S((16, k), F32), S((n, k), W_DTYPE[fmt])) + scale


def _cases() -> dict:
  cases = {}
  ring = lambda dt: (S((5, 8, 2048, 128), dt),) * 2 + (S((2048,), I32),)
  for dt, kn in ((BF16, dict(splits=16, block_k=128, terms=2)),
                 (F32, dict(splits=16, block_k=64, terms=3))):
    name = jnp.dtype(dt).name
    cases[f"ring_attention_{name}"] = (
        functools.partial(R.ring_attention, layer=3, window=2048, out_dtype=BF16,
                          interpret=False, **kn),
        (S((8, 64, 128), F32), S((8, 16, 128), F32), S((8, 16, 128), F32)) + ring(dt)
        + (S((), I32),))
    cases[f"inject_{name}"] = (
        functools.partial(I.inject, eps=1e-6, interpret=False),
        ring(dt) + (S((16, 5, 2, 8, 128), F32), S((5, 128), F32), S((16,), I32), S((), I32),
                    S((64,), F32)))
  for parts in (1, 4):
    cases[f"qk_norm_rope_{parts}_partials"] = (
        functools.partial(N.qk_norm_rope, n_head=32, n_head_kv=8, eps=1e-6, interpret=False),
        (S((parts, 16, 48 * 128), F32), S((128,), F32), S((128,), F32), S((), I32),
         S((64,), F32)))
  # The step's GEMMs at the seed dims with default_knobs' tiles (test_kernels_gemm checks
  # default_knobs gives these): fused qkv, o, down, lm_head (vocab 8192), fc, the inject
  # GEMM (every layer's wk/wv), gate+up.
  for fmt in ("bf16", "fp8", "q8_0"):
    wide_n = 32 if fmt == "q8_0" else 64
    bk = 256 if fmt == "q8_0" else 128
    for nm, n, k, kn in (("qkv", 6144, 6656, dict(block_n=wide_n, block_k=bk, split_k=4)),
                         ("o", 6656, 4096, dict(block_n=wide_n, block_k=bk, split_k=4)),
                         ("down", 6656, 19968, dict(block_n=64, block_k=256, split_k=5)),
                         ("lm_head", 8192, 6656, dict(block_n=wide_n, block_k=bk, split_k=4)),
                         ("fc", 6656, 33280, dict(block_n=64, block_k=256, split_k=5)),
                         ("inject", 10240, 6656, dict(block_n=wide_n, block_k=bk, split_k=4))):
      cases[f"gemm_{fmt}_{nm}"] = _gemm(fmt, n, k, False, kn)
    cases[f"gate_up_{fmt}"] = _gemm(fmt, 2 * 19968, 6656, True,
                                    dict(block_n=32, block_k=bk, split_k=1))
  return cases


def lowered_text(f, args) -> str:
  """Triton IR of every pallas_call in f (sm90), then the XLA module with the kernels' IR
  and source locations stripped."""
  captured = []
  lower = triton_lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = lower(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  class _Sm90:
    compute_capability = 90

  mp = pytest.MonkeyPatch()
  mp.setattr(triton_registration.gpu_info_lib, "get_gpu_info", lambda: _Sm90())
  mp.setattr(triton_registration.lowering, "lower_jaxpr_to_triton_module", capture)
  try:
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  finally:
    mp.undo()
  hlo = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir=<>", exp.mlir_module())
  hlo = "\n".join(re.sub(r"loc\(.*", "", line) for line in hlo.splitlines()
                  if not line.strip().startswith("#loc"))
  return "\n\n".join(captured) + "\n\n// XLA\n" + hlo


def assert_lowers_for_sm90(f, args) -> None:
  """f's Pallas kernels lower to Triton IR for sm90 and stand in the XLA module as Triton
  custom calls (Triton's own checks: power-of-2 tensors, no register slicing, casts it has)."""
  text = lowered_text(f, args)
  assert "tt.func" in text and "__gpu$xla.gpu.triton" in text


BASELINE = {  # SHA-256 of lowered_text at d6f6ae0
    "ring_attention_bfloat16": "a1f0d5941badf21ac7556c969c78f5a2398748b0854b6e2fcba70025cbac0dc7",
    "inject_bfloat16": "50083228a638cca8a79beb30a25d530bb6067ef257023328bf4aad5bf665a4c6",
    "ring_attention_float32": "171d9b75d50edf524f5fff04239c7fee530a6848122b274579e562543356a36e",
    "inject_float32": "182d602dfc1af598b883dc8ed399cac7097f4037d08ea714f6e64390c6fa06a5",
    "qk_norm_rope_1_partials": "6a3ce03e0dd2934afee2ef5324ce198f8b3b68a3bcdc2e472c34c048fee12e4e",
    "qk_norm_rope_4_partials": "2609f669034926426317f70ad0e5f6ba053e291061125c753378678593025896",
    "gemm_bf16_qkv": "5b8e3880b3837d50186393c82ba0ca9fd9d42595c25d51266ee3989ac926c215",
    "gemm_bf16_o": "3d9b313f2b1edeeea1ea298fd86974d95447b013457ac8f148807eb5d006c920",
    "gemm_bf16_down": "f13566dde9f431bc712cf8d300124baa037e704ae23a421fc0e71a5a4794c329",
    "gemm_bf16_lm_head": "5a5f3735670d4a1b11e2054474626f68718c396e9fd2127b3cbe2a983c4f2e2f",
    "gemm_bf16_fc": "86f81d1954b5ac19f25aba4b9da1fd65f452430711c0ce035e95857ad7b8a1db",
    "gemm_bf16_inject": "d9751e5bc768aa66b6cd40fed68ca1cdf9cf4edf8f2f98238a16c7bd472353ec",
    "gate_up_bf16": "eaa8d8501ab2252d66bb8d211e82b07261e6a45d1c9ac50bbf326dc58b55ebaa",
    "gemm_fp8_qkv": "ea45dc9f48710b835d10d9d407fea229a698ce17a17db6235307939f1c229b18",
    "gemm_fp8_o": "e78d066a565b3a7134901b5fc33e05aa93434cef33adab7a4164523d745c195b",
    "gemm_fp8_down": "1aa1745c885ba49f23e86644d1a02d1873ff19d967264bb816288531db1d35d7",
    "gemm_fp8_lm_head": "d68081d835d161d667ab2f1467a8554ba707d30e3d4048cb834ac8a77441552e",
    "gemm_fp8_fc": "1609e2038ece41befee3581719a215deaed0fb43c5b3d2236ecb31d9c9359208",
    "gemm_fp8_inject": "989144d7569b70719465187c5111c800be95c6807a8f486e5a3fbf17c8bd5d3c",
    "gate_up_fp8": "a81e934fe0762b4d4df755d8591732152ea6899496ffb11ef4b30734afa09dce",
    "gemm_q8_0_qkv": "74993f6c4247f843a41a8aa998396cdec651492eb5e6bc24d348ba9c5729ea72",
    "gemm_q8_0_o": "6f825db8e1b8337a40ac779ad1ba8c928befc0a93090155f191a972d39a83f6e",
    "gemm_q8_0_down": "da0a1a2b682a742779c293d2706b8afe1055a6005f5fc0c5acda79bfdf5ad269",
    "gemm_q8_0_lm_head": "22783e87485a048efba598a9ec8588e61d15e630454fdcb25d5c6776eb124738",
    "gemm_q8_0_fc": "40a01e09b0144bbc3cb3890543e317ffbe54deb5ed861d1b7d30107415f78525",
    "gemm_q8_0_inject": "f36a556955c24967586a90eb200a674e0fc094a216ad1b11fb452a8eb0d7cd97",
    "gate_up_q8_0": "b07cc26f254febebce4b1d99664afc40d0f93e3d2f2698dc9b70502d23bc322a",
}


@pytest.mark.parametrize("name", list(_cases()))
def test_seed_launch_lowers_as_the_tuned_baseline(name):
  f, args = _cases()[name]
  digest = hashlib.sha256(lowered_text(f, args).encode()).hexdigest()
  assert digest == BASELINE[name], (
      f"{name}: the seed-shape lowering changed (sha256 {digest}); benchmark the change "
      "before taking the new hash")


def _published_cases() -> dict:
  """One launch per masked code path, at published drafters' shapes (interpret mode runs the
  same kernels at small dims; this checks that Triton lowering takes them: power-of-2
  tensors only, no register slicing, casts the backend has)."""
  cases = {}
  for hkv, t, g, d, s, window, dt in (
      (8, 16, 3, 128, 2048, 2048, BF16),   # group 3: rows past T*G, scattered combine rows
      (8, 7, 4, 128, 3000, 3000, F32),     # block 7, window 3000: ragged last chunk
      (8, 10, 4, 96, 48, 48, BF16),        # block 10, head_dim 96, window 48
      (4, 16, 4, 256, 40960, None, BF16),  # head_dim 256, full cache: combine groups
      (2, 2, 16, 256, 256, None, F32)):    # a token's 16 heads in two combine programs
    kn = R.default_knobs(s, window, dt, head_dim=d,
                         fold_own_min_seqs=POLICY.fold_own_min_seqs).kwargs()
    cases[f"ring_attention_t{t}_g{g}_d{d}_s{s}"] = (
        functools.partial(R.ring_attention, layer=1, window=window, interpret=False, **kn),
        (S((hkv, t * g, d), F32), S((hkv, t, d), F32), S((hkv, t, d), F32),
         S((2, hkv, s, d), dt), S((2, hkv, s, d), dt), S((s,), I32), S((), I32)))
  for t, hkv, d, s, wrap in ((10, 8, 96, 3000, True), (7, 4, 256, 40960, False)):
    cases[f"inject_t{t}_d{d}_s{s}"] = (
        functools.partial(I.inject, eps=1e-6, wrap=wrap, interpret=False),
        (S((5, hkv, s, d), BF16),) * 2 + (S((s,), I32), S((t, 5, 2, hkv, d), BF16),
                                         S((5, d), F32), S((t,), I32), S((), I32),
                                         S((d // 2,), F32)))
  for t, g, d, parts in ((7, 3, 96, 4), (10, 5, 80, 1)):
    cases[f"qk_norm_rope_t{t}_g{g}_d{d}"] = (
        functools.partial(N.qk_norm_rope, n_head=8 * g, n_head_kv=8, eps=1e-6,
                          interpret=False),
        (S((parts, t, (8 * g + 16) * d), F32), S((d,), F32), S((d,), F32),
         S((), I32), S((d // 2,), F32)))
  for fmt in ("bf16", "fp8", "q8_0"):
    # lm_head of a 1000-token vocab (ragged N), K = 6696 / 6752 (masked tail, split 4), a
    # gate+up whose up half starts off a tile boundary.
    k_odd = 6752 if fmt == "q8_0" else 6696
    for nm, n, k, gate_up in (("lm_head1000", 1000, 6656, False), ("k_tail", 6144, k_odd, False),
                              ("gate_up_ragged", 20008, 6656, True)):
      kn = {key: v for key, v in G.default_knobs(
                fmt, n, k, gate_up, swap_ab_min_m=POLICY.skinny_fp8_swap_min_m).kwargs().items()
            if key != "num_stages"}
      cases[f"gemm_{fmt}_{nm}"] = _gemm(fmt, 2 * n if gate_up else n, k, gate_up, kn)
  return cases


@pytest.mark.parametrize("name", list(_published_cases()))
def test_published_shapes_lower_for_sm90(name):
  f, args = _published_cases()[name]
  assert_lowers_for_sm90(f, args)


def _target_cases() -> dict:
  """The target's kernels (issue 41) at Qwen3-8B shapes with the default policy's knobs, and
  at shapes that take their masked paths (group 3, head_dim 96, several sequences, 8-wide
  groups); lowered for sm90 as above (Triton's checks: power-of-2 tensors, no register
  slicing, casts it has)."""
  from dflash_jax.dispatch import target_attention
  from pallas_kernels import cache_attention as CA
  from pallas_kernels import rms_norm as RN
  cases = {}
  for dt in (BF16, F32):
    for t in (1, 16):
      kn = target_attention(t=t, group=4, head_dim=128, cache_dtype=dt, impl="pallas",
                            policy=POLICY).kwargs()
      cases[f"cache_attention_{jnp.dtype(dt).name}_t{t}"] = (
          functools.partial(CA.cache_attention, t=t, out_dtype=BF16, interpret=False, **kn),
          (S((1, 8, t * 4, 128), dt),) + (S((1, 8, 2048, 128), dt),) * 2 + (S((1,), I32),))
  for b, t, hkv, g, d, s in ((3, 5, 8, 3, 96, 1000), (1, 16, 4, 8, 128, 4096)):
    kn = target_attention(t=t, group=g, head_dim=d, cache_dtype=BF16, impl="pallas",
                          policy=POLICY).kwargs()
    cases[f"cache_attention_b{b}_t{t}_g{g}_d{d}"] = (
        functools.partial(CA.cache_attention, t=t, interpret=False, **kn),
        (S((b, hkv, t * g, d), BF16),) + (S((b, hkv, s, d), BF16),) * 2 + (S((b,), I32),))
  for qk_norm in (True, False):
    cases[f"qk_norm_rope_cache_qk{int(qk_norm)}"] = (
        functools.partial(N.qk_norm_rope_cache, n_head=32, n_head_kv=8, eps=1e-6,
                          qk_norm=qk_norm, interpret=False),
        (S((4, 1, 16, 48, 128), F32), S((128,), F32), S((128,), F32))
        + (S((1, 8, 2048, 128), BF16),) * 2 + (S((1,), I32), S((64,), F32)))
  cases["qk_norm_rope_cache_d96"] = (
      functools.partial(N.qk_norm_rope_cache, n_head=24, n_head_kv=8, eps=1e-6,
                        interpret=False),
      (S((1, 3, 5, 40, 96), F32), S((96,), F32), S((96,), F32))
      + (S((3, 8, 1000, 96), F32),) * 2 + (S((3,), I32), S((48,), F32)))
  # Muse-Glimmer (32 query heads over 2 kv heads, head_dim 128): the fused projection's parts
  # hold q, k, v and the output gate (2*32 + 2*2 heads); its sliding-window layers keep a ring
  # of 2112 slots (roped), its full layers are NoPE.
  for nm, rope, capacity, s in (("ring", True, 2112, 2112), ("nope", False, 0, 4096)):
    cases[f"qk_norm_rope_cache_glimmer_{nm}"] = (
        functools.partial(N.qk_norm_rope_cache, n_head=32, n_head_kv=2, eps=1e-6, rope=rope,
                          capacity=capacity, interpret=False),
        (S((4, 1, 16, 68, 128), F32), S((128,), F32), S((128,), F32))
        + (S((1, 2, s, 128), BF16),) * 2 + (S((1,), I32), S((64,), F32)))
  kn = CA.default_knobs(rows=16 * 16, head_dim=128, cache_dtype=BF16,
                        chunk=POLICY.target_attention_chunk).kwargs()
  for t in (1, 16):   # a window of 2048 over a 2112-slot ring, positions below 4096
    cases[f"cache_attention_glimmer_window_t{t}"] = (
        functools.partial(CA.cache_attention, t=t, window=2048, capacity=4096, out_dtype=BF16,
                          interpret=False, **kn),
        (S((1, 2, t * 16, 128), BF16),) + (S((1, 2, 2112, 128), BF16),) * 2 + (S((1,), I32),))
    # With the output gate read from the q/k/v/gate projection's 4 partials (68 heads).
    cases[f"cache_attention_glimmer_gated_t{t}"] = (
        functools.partial(CA.cache_attention, t=t, gate_col=36 * 128, window=2048,
                          capacity=4096, out_dtype=BF16, interpret=False, **kn),
        (S((1, 2, t * 16, 128), BF16),) + (S((1, 2, 2112, 128), BF16),) * 2
        + (S((1,), I32), S((4, 1, t, 68 * 128), F32)))
  cases["add_rms_norm"] = (functools.partial(RN.add_rms_norm, eps=1e-6, interpret=False),
                           (S((16, 4096), F32), S((4, 16, 4096), F32), S((4096,), F32)))
  cases["add_rms_norm_no_parts"] = (
      lambda x, w: RN.add_rms_norm(x, None, w, eps=1e-6, out_dtype=F32, interpret=False),
      (S((1, 4096), F32), S((4096,), F32)))
  # Qwen3-30B-A3B's grouped expert GEMMs at 1, 48 (three 16-row chunks: no power of 2) and
  # 64 rows over 8 slots.
  from pallas_kernels import moe_gemm as MG
  for m in (1, 48, 64):
    for gate_up, (n, k) in ((True, (768, 2048)), (False, (2048, 768))):
      cases[f"moe_matmul_{'gate_up_' if gate_up else ''}m{m}"] = (
          functools.partial(MG.moe_matmul, gate_up=gate_up, interpret=False,
                            **MG.default_knobs(n, k, gate_up)),
          (S((m, k), F32), S((128, 2 * n if gate_up else n, k), BF16), S((8,), I32)))
  # DFlash2's sublayer input at the seed width: 16 rows, float32 and bf16 out.
  cases["rms_norm_pair_seed"] = (
      functools.partial(RN.rms_norm_pair, eps=1e-6, interpret=False),
      (S((16, 6656), F32), S((6656,), F32)))
  # Qwen3-30B-A3B's router: 128 experts, 8 per token, its GEMM's 4 partials, 1 and 16 rows.
  from pallas_kernels import moe_route as MR
  for m in (1, 16):
    cases[f"moe_route_30b_a3b_m{m}"] = (
        functools.partial(MR.moe_route, k=8, norm_topk=True, interpret=False),
        (S((4, m, 128), F32),))
  # Muse-Glimmer's joints (hidden 6656): after a sublayer (5 partials), and the first one.
  cases["sandwich_rms_norm_glimmer"] = (
      functools.partial(RN.sandwich_rms_norm, eps=1e-5, post_eps=1e-8, offset=1.0,
                        post_offset=1.0, interpret=False),
      (S((16, 6656), F32), S((5, 16, 6656), F32), S((6656,), F32), S((6656,), F32)))
  cases["sandwich_rms_norm_glimmer_no_parts"] = (
      lambda x, w: RN.sandwich_rms_norm(x, None, None, w, eps=1e-5, offset=1.0,
                                        interpret=False),
      (S((1, 6656), F32), S((6656,), F32)))
  for name, n, k, gate_up in (("qkv", 6144, 4096, False), ("gate_up", 12288, 4096, True),
                              ("down", 4096, 12288, False)):
    kn = G.default_knobs("fp32", n, k, gate_up, swap_ab_min_m=POLICY.skinny_fp8_swap_min_m)
    fn = G.skinny_matmul_gate_up if gate_up else functools.partial(G.skinny_matmul,
                                                                   keep_splits=True)
    cases[f"gemm_fp32_{name}"] = (
        functools.partial(fn, fmt="fp32", interpret=False, **{**kn.kwargs(), "block_m": 16}),
        (S((16, k), F32), S((2 * n if gate_up else n, k), F32)))
    # The batch-invariant route past 16 rows: 16-row chunks of one program (48, 64 rows).
    for fmt, dt, rows in (("bf16", BF16, 64), ("bf16", BF16, 48), ("fp32", F32, 48)):
      kn = G.default_knobs(fmt, n, k, gate_up, 16, swap_ab_min_m=POLICY.skinny_fp8_swap_min_m)
      cases[f"gemm_{fmt}_{name}_{rows}_rows"] = (
          functools.partial(fn, fmt=fmt, interpret=False,
                            **{**kn.kwargs(), "block_m": 16, "row_chunks": -(-rows // 16)}),
          (S((rows, k), F32), S((2 * n if gate_up else n, k), dt)))
  return cases


@pytest.mark.parametrize("name", list(_target_cases()))
def test_target_kernels_lower_for_sm90(name):
  f, args = _target_cases()[name]
  assert_lowers_for_sm90(f, args)


def _selector_cases() -> dict:
  """DFlash2's selector kernels at its real shapes (a block of 16 rows, rows 1..15 ranked, k
  16; vocabularies of 8192 and 202048; 1 and 4 slots), default knobs, lowered for sm90."""
  from pallas_kernels import selector_walk as SW
  from pallas_kernels import top_k as TK
  cases = {}
  for s, v in ((1, 8192), (1, 202048), (4, 202048)):
    cases[f"top_k_s{s}_v{v}"] = (functools.partial(TK.top_k, k=16, first=1, interpret=False),
                                 (S((s, 16, v), F32),))
  for s in (1, 4):
    cases[f"selector_walk_s{s}"] = (functools.partial(SW.selector_walk, interpret=False),
                                    (S((s, 15, 16), F32), S((s, 15, 16, 16), F32)))
    cases[f"selector_walk_noisy_s{s}"] = (
        functools.partial(SW.selector_walk, interpret=False),
        (S((s, 15, 16), F32), S((s, 15, 16, 16), F32), S((s, 15, 16, 16), F32)))
  return cases


@pytest.mark.parametrize("name", list(_selector_cases()))
def test_selector_kernels_lower_for_sm90(name):
  f, args = _selector_cases()[name]
  assert_lowers_for_sm90(f, args)
