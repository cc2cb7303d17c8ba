"""PyTorch peer of the DFlash block step (SPEC.md section 3), written the way a vLLM-style user
writes it: cuBLAS GEMMs through F.linear, scaled_dot_product_attention with an explicit boolean
mask, optionally replayed as a CUDA graph.

Imports only torch and numpy, so it runs wherever torch does. GEMMs take `dtype` inputs (fp32
or bf16) and return `dtype` outputs, as F.linear does; norms, rope and the residual stream are
fp32. q/k/v and gate/up are each one fused GEMM (vLLM's QKVParallelLinear and
MergedColumnParallelLinear, and the same GEMM count as dflash_jax's step).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

CFG_FIELDS = ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "rope_theta", "eps",
              "block_size", "mask_token_id")
# How query heads reach their kv head (contiguous groups, h -> h // G):
#   repeat:     repeat_interleave K/V to n_head heads first, a copy: what HF transformers
#               (z-lab's drafter code) does whenever it passes a mask. The default.
#   enable_gqa: SDPA's own GQA flag; on CUDA, with a mask, only the math backend takes it.
#   fold:       fold each group's G heads into the query length, [Hkv, G*T, D]: no copy, and
#               the memory-efficient backend still applies. The fastest honest variant.
GQA_MODES = ("repeat", "enable_gqa", "fold")


def step_tensor_shapes(c: dict, n_vocab: int) -> dict[str, tuple[int, ...]]:
  """(out, in) shapes of the tensors the block step reads (no fc / enc.output_norm)."""
  e, hd = c["n_embd"], c["head_dim"]
  shapes = {"tok_embd": (n_vocab, e), "lm_head": (n_vocab, e), "output_norm": (e,)}
  for i in range(c["n_layer"]):
    p = f"blk.{i}."
    shapes.update({
        p + "attn_norm": (e,), p + "attn_q": (c["n_head"] * hd, e),
        p + "attn_k": (c["n_head_kv"] * hd, e), p + "attn_v": (c["n_head_kv"] * hd, e),
        p + "attn_output": (e, c["n_head"] * hd), p + "attn_q_norm": (hd,),
        p + "attn_k_norm": (hd,), p + "ffn_norm": (e,), p + "ffn_gate": (c["n_ff"], e),
        p + "ffn_up": (c["n_ff"], e), p + "ffn_down": (e, c["n_ff"])})
  return shapes


def _tensor(a: Any) -> torch.Tensor:
  """torch.Tensor, or a numpy array (float32 or ml_dtypes bfloat16) -> torch.Tensor."""
  if isinstance(a, torch.Tensor):
    return a
  a = np.asarray(a)
  if a.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it, but the bits are the same
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
  return torch.from_numpy(np.ascontiguousarray(a))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
  x = x.float()
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """NEOX rotate-half of x [T, H, D] (fp32) with cos/sin [T, 1, D/2]."""
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchDrafterStep:
  """One sequence's block step over a fixed K/V ring, eager (`step`) or CUDA-graphed (`capture`).

  The ring is copied once into a per-layer key buffer [L, Hkv, W + T, D] (likewise values)
  whose first W slots hold the ring as-is and whose last T slots each step overwrites with
  the block's own K/V, so attention reads one contiguous buffer as a paged-cache user's does.
  """

  def __init__(self, cfg_fields: dict, weights: dict[str, Any], ring_k: Any, ring_v: Any,
               ring_pos: Any, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
               gqa: str = "repeat"):
    missing = [f for f in CFG_FIELDS if f not in cfg_fields]
    if missing:
      raise ValueError(f"cfg_fields lacks {missing}")
    if dtype not in (torch.float32, torch.bfloat16):
      raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if gqa not in GQA_MODES:
      raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")
    c = self.cfg = {f: cfg_fields[f] for f in CFG_FIELDS}
    self.dtype, self.device, self.gqa = dtype, torch.device(device), gqa
    if "tok_embd" not in weights:
      raise ValueError("weights lack 'tok_embd' (the target's [n_vocab, n_embd] embedding)")
    self.n_vocab = int(_tensor(weights["tok_embd"]).shape[0])
    if not 0 <= c["mask_token_id"] < self.n_vocab:
      raise ValueError(f"mask_token_id {c['mask_token_id']} is outside the vocab "
                       f"[0, {self.n_vocab})")
    w = {}
    for name, shape in step_tensor_shapes(c, self.n_vocab).items():
      if name not in weights:
        raise ValueError(f"weights lack {name!r} (shape {shape})")
      t = _tensor(weights[name])
      if tuple(t.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
      # Norm weights stay fp32 (norm arithmetic is fp32); matrices go to the GEMM dtype.
      w[name] = t.to(self.device, torch.float32 if t.ndim == 1 else dtype)
    self._init_weights(w)
    self._init_ring(_tensor(ring_k), _tensor(ring_v), _tensor(ring_pos))

  @classmethod
  def random(cls, cfg_fields: dict, n_vocab: int, dtype: torch.dtype = torch.bfloat16,
             device: str = "cuda", seed: int = 0, *, window: int = 2048,
             n_filled: int | None = None, gqa: str = "repeat") -> "TorchDrafterStep":
    """Random weights and ring generated on `device` (no host floats), for timing at real dims.

    Scales follow dflash_jax.synthetic_drafter (N(0, 1/fan_in), residual branches shrunk by
    1/sqrt(2 L), norms 1 + 0.1 N). The ring holds the last `window` of positions
    0..n_filled-1 (default n_filled = window: a full ring) with unit-variance K and V; step at
    n_past = n_filled is then steady-state decoding.
    """
    c = cfg_fields
    g = torch.Generator(device=device).manual_seed(seed)
    branch = 1.0 / np.sqrt(2.0 * c["n_layer"])
    w = {}
    for name, shape in step_tensor_shapes(c, n_vocab).items():
      if len(shape) == 1:
        w[name] = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
        continue
      scale = 1.0 if name == "tok_embd" else 1.0 / np.sqrt(shape[1])
      if name.endswith(("attn_output", "ffn_down")):
        scale *= branch
      elif name == "lm_head":
        scale *= 4.0
      w[name] = torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(scale)
    n_filled = window if n_filled is None else n_filled
    shape = (c["n_layer"], c["n_head_kv"], window, c["head_dim"])
    ring_k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    ring_v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    ring_pos = torch.full((window,), -1, dtype=torch.int32, device=device)
    live = torch.arange(max(0, n_filled - window), n_filled, dtype=torch.int32, device=device)
    ring_pos[live % window] = live
    return cls(c, w, ring_k, ring_v, ring_pos, dtype=dtype, device=device, gqa=gqa)

  def _init_weights(self, w: dict[str, torch.Tensor]) -> None:
    c = self.cfg
    self.tok_embd, self.lm_head, self.out_norm = w["tok_embd"], w["lm_head"], w["output_norm"]
    self.layers = []
    for i in range(c["n_layer"]):
      p = f"blk.{i}."
      self.layers.append(dict(
          attn_norm=w[p + "attn_norm"], q_norm=w[p + "attn_q_norm"], k_norm=w[p + "attn_k_norm"],
          wqkv=torch.cat([w[p + "attn_q"], w[p + "attn_k"], w[p + "attn_v"]]),
          wo=w[p + "attn_output"], ffn_norm=w[p + "ffn_norm"],
          wgu=torch.cat([w[p + "ffn_gate"], w[p + "ffn_up"]]), wd=w[p + "ffn_down"]))
    i = np.arange(c["head_dim"] // 2, dtype=np.float64)
    inv_freq = (float(c["rope_theta"]) ** (-2.0 * i / c["head_dim"])).astype(np.float32)
    self.inv_freq = torch.from_numpy(inv_freq).to(self.device)

  def _init_ring(self, ring_k: torch.Tensor, ring_v: torch.Tensor, ring_pos: torch.Tensor) -> None:
    c = self.cfg
    L, hkv, d, t = c["n_layer"], c["n_head_kv"], c["head_dim"], c["block_size"]
    if ring_k.ndim != 4 or tuple(ring_k.shape[:2]) != (L, hkv) or ring_k.shape[3] != d:
      raise ValueError(f"ring_k must be [{L}, {hkv}, W, {d}], got {tuple(ring_k.shape)}")
    self.window = W = int(ring_k.shape[2])
    if tuple(ring_v.shape) != tuple(ring_k.shape) or tuple(ring_pos.shape) != (W,):
      raise ValueError(f"ring_v must be {tuple(ring_k.shape)} and ring_pos [{W}], got "
                       f"{tuple(ring_v.shape)} and {tuple(ring_pos.shape)}")
    self.k_buf = torch.zeros((L, hkv, W + t, d), dtype=self.dtype, device=self.device)
    self.v_buf = torch.zeros_like(self.k_buf)
    self.k_buf[:, :, :W] = ring_k.to(self.device)
    self.v_buf[:, :, :W] = ring_v.to(self.device)
    self.ring_pos = ring_pos.to(self.device, torch.int32)
    # Static inputs: step and graph replay both read the scalars from these device tensors.
    self.id_last = torch.zeros((), dtype=torch.int64, device=self.device)
    self.n_past = torch.zeros((), dtype=torch.int64, device=self.device)
    self.block_offsets = torch.arange(t, dtype=torch.int64, device=self.device)
    self.mask_tokens = torch.full((t - 1,), c["mask_token_id"], dtype=torch.int64,
                                  device=self.device)
    self.block_visible = torch.ones((t, t), dtype=torch.bool, device=self.device)

  def _set_inputs(self, id_last: int, n_past: int) -> None:
    if not 0 <= int(id_last) < self.n_vocab:
      raise ValueError(f"id_last {id_last} is outside the vocab [0, {self.n_vocab})")
    if int(n_past) < 0:
      raise ValueError(f"n_past must be >= 0, got {n_past}")
    # fill_ with a Python scalar is a kernel argument: no host-to-device copy, no sync.
    self.id_last.fill_(int(id_last))
    self.n_past.fill_(int(n_past))

  def _attend(self, l: int, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] in dtype over layer l's buffers -> [T, Hq*D] in dtype."""
    t, hq, d = q.shape
    # 4-D [1, H, S, D] operands: SDPA's fused CUDA backends refuse any other rank.
    k, v = self.k_buf[l : l + 1], self.v_buf[l : l + 1]  # [1, Hkv, W+T, D]
    g = hq // k.shape[1]
    q = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    if self.gqa == "fold":
      # Query head h = kvh*G + j lands at row j*T + t of kv head kvh's folded query.
      o = F.scaled_dot_product_attention(q.reshape(1, -1, g * t, d), k, v,
                                         attn_mask=mask.repeat(g, 1))
    elif self.gqa == "repeat":
      o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         attn_mask=mask)
    else:
      o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o.reshape(hq, t, d).transpose(0, 1).reshape(t, hq * d)

  def _forward(self) -> torch.Tensor:
    c = self.cfg
    t, hq, hkv, d, W = c["block_size"], c["n_head"], c["n_head_kv"], c["head_dim"], self.window
    eps, dt = c["eps"], self.dtype
    positions = self.n_past + self.block_offsets  # [T] int64
    angle = positions.float()[:, None] * self.inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    # SPEC visibility: ring slot j is visible to row t iff 0 <= pos[j] < n_past and
    # n_past + t - pos[j] < W; every block key is visible to every row.
    pos = self.ring_pos[None, :]
    ring_visible = (pos >= 0) & (pos < self.n_past) & (positions[:, None] - pos < W)
    mask = torch.cat([ring_visible, self.block_visible], dim=1)  # [T, W+T]
    tokens = torch.cat([self.id_last.view(1), self.mask_tokens])
    x = self.tok_embd[tokens].float()
    for l, lp in enumerate(self.layers):
      qkv = F.linear(_rms(x, lp["attn_norm"], eps).to(dt), lp["wqkv"])
      q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
      q = _rope(_rms(q.reshape(t, hq, d), lp["q_norm"], eps), cos, sin)
      k = _rope(_rms(k.reshape(t, hkv, d), lp["k_norm"], eps), cos, sin)
      self.k_buf[l, :, W:] = k.transpose(0, 1)
      self.v_buf[l, :, W:] = v.reshape(t, hkv, d).transpose(0, 1)
      x = x + F.linear(self._attend(l, q.to(dt), mask), lp["wo"]).float()
      gu = F.linear(_rms(x, lp["ffn_norm"], eps).to(dt), lp["wgu"])
      gate, up = gu.float().chunk(2, dim=-1)
      x = x + F.linear((F.silu(gate) * up).to(dt), lp["wd"]).float()
    return F.linear(_rms(x, self.out_norm, eps).to(dt), self.lm_head).float()

  @torch.inference_mode()
  def step(self, id_last: int, n_past: int) -> torch.Tensor:
    """Logits [block_size, n_vocab] float32 on the device, eager (no sync)."""
    self._set_inputs(id_last, n_past)
    return self._forward()

  @torch.inference_mode()
  def capture(self, warmup: int = 3) -> Callable[[int, int], torch.Tensor]:
    """CUDA-graph the step; returns replay(id_last, n_past) -> the graph's static logits buffer.

    The buffer is overwritten by the next replay: clone it to keep a result.
    """
    stream = torch.cuda.Stream(self.device)
    stream.wait_stream(torch.cuda.current_stream(self.device))
    # Warm-up on a side stream (as torch.cuda.graphs documents) so cuBLAS workspaces and
    # SDPA's backend choice are settled before capture.
    with torch.cuda.stream(stream):
      for _ in range(warmup):
        self._forward()
    torch.cuda.current_stream(self.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      out = self._forward()

    def replay(id_last: int, n_past: int) -> torch.Tensor:
      self._set_inputs(id_last, n_past)
      graph.replay()
      return out

    return replay


def time_step(fn: Callable[[], Any], iters: int = 200, warmup: int = 20) -> dict:
  """Milliseconds per call of fn (on the current CUDA stream) from CUDA events.

  median_ms / min_ms: events around each call, calls back to back with one sync at the end
  (so a launch-bound eager step is charged its launch time too). mean_ms: one event pair
  around a loop of `iters` calls.
  """
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(iters)]
  for start, end in pairs:
    start.record()
    fn()
    end.record()
  torch.cuda.synchronize()
  per_call = [s.elapsed_time(e) for s, e in pairs]
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(iters):
    fn()
  end.record()
  torch.cuda.synchronize()
  return dict(median_ms=statistics.median(per_call), min_ms=min(per_call),
              mean_ms=start.elapsed_time(end) / iters, iters=iters)
