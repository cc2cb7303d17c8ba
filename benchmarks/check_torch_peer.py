"""Certify benchmarks/torch_peer.py against the numpy reference (reference/dflash_ref.py).

The peer needs torch, the reference needs dflash_jax (jax); one venv may not hold both, so
the reference can be computed in one interpreter and checked in another:

  .venv/bin/python benchmarks/check_torch_peer.py --make-ref /tmp/peer_ref.npz
  <torch python> benchmarks/check_torch_peer.py --check /tmp/peer_ref.npz [--device cuda]
  python benchmarks/check_torch_peer.py            # both at once, where jax and torch coexist

Tiny dims (TINY_CONFIG, window 32, block 8), synthetic weights. The ring goes through an empty
state, a partly filled one, and a wrapped one stepped at n_past below, at, and far past the
newest position. fp32 must match to ~1e-4; bf16 (weights and ring rounded to bf16, as the
reference's bf16 mode) to bf16 tolerance, with greedy drafts equal wherever the reference's
top-2 gap is clear of it. On CUDA the graphed step must also equal the eager one bitwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = ("fp32", "bf16")
# (positions injected before the stage's steps, [(id_last, n_past), ...]); injections accumulate.
STAGES = [
    (range(0), [(3, 0)]),
    (range(0, 20), [(5, 20), (7, 20)]),        # slots 20..31 empty; 7 is the mask token itself
    (range(20, 46), [(11, 46), (0, 40), (13, 60), (2, 100)]),  # wrapped ring, window 32
]
# Max |peer - reference| allowed, relative to max |reference logit|. bf16's budget covers the
# rounding of GEMM outputs and SDPA inputs that torch does and the reference does not.
TOL = {"fp32": 1e-5, "bf16": 1.5e-2}


def make_reference() -> dict[str, np.ndarray]:
  from dflash_jax.config import TINY_CONFIG
  from dflash_jax.synthetic import synthetic_drafter, synthetic_features
  from reference.dflash_ref import DFlashRef

  cfg = TINY_CONFIG
  w = synthetic_drafter(cfg, seed=0, n_vocab=96)
  # Every scalar field; the peer picks the ones it needs (this side may lack torch).
  out = {f"cfg.{k}": np.asarray(v) for k, v in dataclasses.asdict(cfg).items()
         if isinstance(v, (int, float))}
  out.update({f"w.{k}": v for k, v in w.items()})
  n_pos = max(p for positions, _ in STAGES for p in positions) + 1
  for dt in DTYPES:
    ref = DFlashRef(cfg, w, dtype=dt, ring_dtype=dt)
    h = ref.encode(synthetic_features(cfg, n_pos, seed=1))
    for s, (positions, calls) in enumerate(STAGES):
      if len(positions):
        ref.inject(h[positions.start:positions.stop], np.asarray(positions))
      out[f"s{s}.calls"] = np.asarray(calls, np.int64)
      out[f"{dt}.s{s}.ring_k"], out[f"{dt}.s{s}.ring_v"] = ref.ring_k.copy(), ref.ring_v.copy()
      out[f"{dt}.s{s}.ring_pos"] = ref.ring_pos.copy()
      out[f"{dt}.s{s}.logits"] = np.stack([ref.step(i, n) for i, n in calls])
  return out


def check(ref: dict[str, np.ndarray], device: str) -> tuple[int, int]:
  import torch
  from benchmarks.torch_peer import GQA_MODES, TorchDrafterStep

  fields = {k[4:]: v.item() for k, v in ref.items() if k.startswith("cfg.")}
  weights = {k[2:]: v for k, v in ref.items() if k.startswith("w.")}
  passed = failed = 0
  for dt, tdt in zip(DTYPES, (torch.float32, torch.bfloat16)):
    for gqa in GQA_MODES:
      for s in range(len(STAGES)):
        peer = TorchDrafterStep(fields, weights, ref[f"{dt}.s{s}.ring_k"], ref[f"{dt}.s{s}.ring_v"],
                                ref[f"{dt}.s{s}.ring_pos"], dtype=tdt, device=device, gqa=gqa)
        replay = peer.capture() if device == "cuda" else None
        for (id_last, n_past), want in zip(ref[f"s{s}.calls"], ref[f"{dt}.s{s}.logits"]):
          got = peer.step(int(id_last), int(n_past)).cpu().numpy()
          scale = max(1.0, float(np.abs(want).max()))
          err = float(np.abs(got - want).max()) / scale
          ok = got.shape == want.shape and err <= TOL[dt]
          # Drafts must agree on rows whose reference top-2 gap is clear of the tolerance.
          top2 = np.sort(want[1:], axis=-1)[:, -2:]
          clear = (top2[:, 1] - top2[:, 0]) > 2 * TOL[dt] * scale
          same = np.argmax(got[1:], -1) == np.argmax(want[1:], -1)
          ok &= bool(np.all(same[clear]))
          note = ""
          if replay is not None:
            graphed = replay(int(id_last), int(n_past)).cpu().numpy()
            bitwise = np.array_equal(graphed, got)
            ok &= bitwise
            note = f" graph==eager {bitwise}"
          print(f"{'ok  ' if ok else 'FAIL'} {dt} gqa={gqa:10s} id_last={id_last:3d} "
                f"n_past={n_past:3d} rel_err {err:.2e} drafts {same[clear].sum()}/{clear.sum()} "
                f"clear rows agree{note}")
          passed, failed = passed + ok, failed + (not ok)
  return passed, failed


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--make-ref", metavar="NPZ", help="write weights, rings and reference logits")
  mode.add_argument("--check", metavar="NPZ", help="check the peer against a --make-ref file")
  p.add_argument("--device", default="cpu", help="torch device for the peer (cpu or cuda)")
  a = p.parse_args(argv)
  if a.make_ref:
    np.savez(a.make_ref, **make_reference())
    print(f"wrote {a.make_ref}")
    return 0
  ref = dict(np.load(a.check)) if a.check else make_reference()
  passed, failed = check(ref, a.device)
  print(f"{passed} passed, {failed} failed")
  return int(failed > 0)


if __name__ == "__main__":
  sys.exit(main())
