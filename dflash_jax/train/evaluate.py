"""Acceptance and speed of trained drafters, end to end, against target-only decoding and a
prompt-lookup (n-gram) baseline, all with the same target code (`dflash_jax.decode`).

Every prompt is decoded alone (batch 1: the latency setting speculative decoding is for);
the timed seconds are the decoding rounds after prefill, and each configuration is run once
untimed first so compiles are excluded. tau = mean tokens committed per round (accepted drafts
plus the target's own token).

Prompt lookup proposes, at each round, the tokens that followed the most recent earlier
occurrence of the longest suffix (up to max_ngram tokens, ending at id_last) of the committed
text, continued periodically when the match is closer than the block; with no match it
proposes id_last repeated. Its rounds are verified and committed exactly as decode's greedy
rounds (same verify, accept and commit; only the proposer differs).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax import decode
from dflash_jax import step
from dflash_jax.models import qwen3
from dflash_jax.params import DrafterParams


def ngram_drafts(tokens: jax.Array, n_past: jax.Array, n_draft: int, max_ngram: int
                 ) -> jax.Array:
  """Prompt-lookup drafts [n_draft] int32 for one sequence whose committed tokens are
  tokens[:n_past + 1] (tokens[n_past] = id_last); see the module doc."""
  size = tokens.shape[0]
  e = jnp.arange(size, dtype=jnp.int32)
  cand = e < n_past          # a match must end before the suffix itself
  chosen = jnp.int32(-1)
  for k in range(max_ngram):  # n-gram length k + 1; a longer match overrides a shorter one
    src = tokens[jnp.clip(e - k, 0, size - 1)]
    cand = cand & (e - k >= 0) & (n_past - k >= 0) & (src == tokens[jnp.maximum(n_past - k, 0)])
    last = jnp.max(jnp.where(cand, e, -1))
    chosen = jnp.where(last >= 0, last, chosen)
  period = jnp.maximum(n_past - chosen, 1)
  idx = chosen + 1 + jnp.arange(n_draft, dtype=jnp.int32) % period
  return jnp.where(chosen >= 0, tokens[jnp.clip(idx, 0, size - 1)], tokens[n_past])


def _lookup_round(target: qwen3.TargetParams, tcfg: qwen3.TargetConfig, width: int,
                  max_ngram: int, impl: str, target_impl: str,
                  st: decode.DecodeState) -> decode.DecodeState:
  n = width - 1
  s = st.n_past.shape[0]
  active = ~st.done
  drafts = jax.vmap(ngram_drafts, in_axes=(0, 0, None, None))(st.tokens, st.n_past, n,
                                                               max_ngram)
  vtok = jnp.concatenate([st.id_last[:, None], drafts], axis=1)
  cache, logits, _ = qwen3.verify(target, tcfg, st.cache, vtok, impl=target_impl)
  target_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  n_ok = step.accept(drafts, target_tokens[:, :n], impl=impl)
  t = jnp.take_along_axis(target_tokens, n_ok[:, None], axis=1)[:, 0]
  rows = jnp.arange(width, dtype=jnp.int32)[None]
  committed = jnp.where(rows < n_ok[:, None], jnp.concatenate([drafts, t[:, None]], axis=1),
                        t[:, None])
  tokens = jax.vmap(lambda b, c, p: lax.dynamic_update_slice(b, c, (p,)))(
      st.tokens, committed, st.n_past + 1)
  n_past = st.n_past + n_ok + 1
  is_eos = (committed[:, :, None] == st.eos[:, None, :]).any(-1) & (rows <= n_ok[:, None])
  stop = (n_past + 1 >= st.max_len) | is_eos.any(-1)

  def keep(new, old):
    return jnp.where(active.reshape(-1, *([1] * (new.ndim - 1))), new, old)

  return st.replace(
      cache=cache.replace(length=keep(n_past, st.cache.length)),
      tokens=keep(tokens, st.tokens), n_past=keep(n_past, st.n_past), id_last=keep(t, st.id_last),
      done=st.done | (active & stop), rounds=st.rounds + active,
      hist=st.hist.at[jnp.arange(s), n_ok].add(active.astype(jnp.int32)))


@functools.partial(jax.jit, static_argnames=("tcfg", "width", "max_ngram", "impl", "target_impl"),
                   donate_argnames=("st",))
def _lookup_rounds(target, st, *, tcfg, width, max_ngram, impl, target_impl):
  body = functools.partial(_lookup_round, target, tcfg, width, max_ngram, impl, target_impl)
  return lax.while_loop(lambda s: ~jnp.all(s.done), body, st)


def lookup_generate(target: qwen3.TargetParams, tcfg: qwen3.TargetConfig,
                    prompts: Sequence[Sequence[int]], max_new: int, width: int, *,
                    max_ngram: int = 3, impl: str = "pallas", target_impl: str = "xla",
                    cache_dtype: Any = "fp32") -> decode.Generation:
  """Greedy prompt-lookup speculative decoding of every prompt to max_new tokens."""
  if width < 2 or max_ngram < 1:
    raise ValueError(f"width must be >= 2 and max_ngram >= 1, got {width}, {max_ngram}")
  t0 = time.perf_counter()
  models = decode.Models(target=target, drafter=None, d2t=None, target_cfg=tcfg)
  longest = max(len(p) for p in prompts)
  cap = -(-(longest + max_new + width) // 16) * 16
  st = decode.start(models, decode.DecodeConfig(width=1), prompts, max_new, capacity=cap,
                    cache_dtype=cache_dtype)
  st = st.replace(hist=jnp.zeros((st.n_past.shape[0], width), jnp.int32))
  jax.block_until_ready(st.n_past)
  t1 = time.perf_counter()
  st = _lookup_rounds(target, st, tcfg=tcfg, width=width, max_ngram=max_ngram, impl=impl,
                      target_impl=target_impl)
  n_past, tokens, rounds, hist = jax.device_get((st.n_past, st.tokens, st.rounds, st.hist))
  t2 = time.perf_counter()
  n_prompt = np.array([len(p) for p in prompts])
  out = [tokens[i, n_prompt[i]:n_past[i] + 1][:max_new].tolist() for i in range(len(prompts))]
  return decode.Generation(tokens=out, rounds=rounds, hist=hist, seconds=t2 - t1,
                           prefill_seconds=t1 - t0)


@dataclasses.dataclass
class EvalRow:
  """One method on all prompts: hist[j] = rounds that accepted j drafts (summed over prompts);
  same_as_target = prompts whose output equals target-only greedy decoding."""
  method: str
  width: int
  tau: float
  hist: list[int]
  n_tokens: int
  seconds: float
  same_as_target: int
  n_prompts: int

  @property
  def tokens_per_s(self) -> float:
    return self.n_tokens / max(self.seconds, 1e-12)


def _run_each(fn, prompts) -> list[decode.Generation]:
  fn([prompts[0]])   # untimed: compiles
  return [fn([p]) for p in prompts]


def _row(method: str, width: int, gens: list[decode.Generation], ref: list[list[int]] | None
         ) -> EvalRow:
  hist = np.sum([g.hist.sum(0) for g in gens], axis=0)
  tau = float((hist * np.arange(1, len(hist) + 1)).sum() / max(hist.sum(), 1))
  toks = [g.tokens[0] for g in gens]
  same = len(toks) if ref is None else sum(a == b for a, b in zip(toks, ref))
  return EvalRow(method=method, width=width, tau=tau, hist=hist.astype(int).tolist(),
                 n_tokens=sum(len(t) for t in toks), seconds=sum(g.seconds for g in gens),
                 same_as_target=same, n_prompts=len(gens))


def evaluate(target: qwen3.TargetParams, tcfg: qwen3.TargetConfig,
             drafters: Sequence[tuple[str, DrafterParams]], prompts: Sequence[Sequence[int]],
             max_new: int, widths: Sequence[int] = (16, 8), *, lookup: bool = True,
             max_ngram: int = 3, impl: str = "pallas", target_impl: str = "xla",
             cache_dtype: Any = "fp32", ring_dtype: Any = "fp32", out=print) -> list[EvalRow]:
  """Target-only greedy decoding, then each (name, drafter) at each width <= its block size,
  then prompt lookup at each width; every prompt decoded alone, all greedy, no EOS stop."""
  prompts = [list(map(int, p)) for p in prompts]
  kw = dict(cache_dtype=cache_dtype)
  base = _run_each(lambda ps: decode.generate_target_only(target, tcfg, ps, max_new,
                                                          target_impl=target_impl, **kw), prompts)
  ref = [g.tokens[0] for g in base]
  rows = [_row("target only", 1, base, None)]
  out(f"target only: {rows[0].tokens_per_s:.1f} tok/s")
  for name, dp in drafters:
    models = decode.Models(target=target, drafter=dp, d2t=None, target_cfg=tcfg)
    for w in widths:
      if w > dp.cfg.block_size:
        continue
      dcfg = decode.DecodeConfig(width=w, impl=impl, target_impl=target_impl)
      gens = _run_each(lambda ps: decode.generate(models, dcfg, ps, max_new,
                                                  ring_dtype=ring_dtype, **kw), prompts)
      rows.append(_row(name, w, gens, ref))
      out(f"{name} width {w}: tau {rows[-1].tau:.2f}, {rows[-1].tokens_per_s:.1f} tok/s")
  if lookup:
    for w in widths:
      gens = _run_each(lambda ps: lookup_generate(target, tcfg, ps, max_new, w,
                                                  max_ngram=max_ngram, impl=impl,
                                                  target_impl=target_impl, **kw), prompts)
      rows.append(_row(f"prompt lookup (n <= {max_ngram})", w, gens, ref))
      out(f"prompt lookup width {w}: tau {rows[-1].tau:.2f}, {rows[-1].tokens_per_s:.1f} tok/s")
  return rows


def markdown_table(rows: Sequence[EvalRow]) -> str:
  """The eval table: tau, speed and speedup over target-only, losslessness, histogram."""
  base = next((r.tokens_per_s for r in rows if r.width == 1), None)
  lines = ["| method | block | tau | tokens/s | speedup | = target | accepted drafts per "
           "round: rounds with 0, 1, 2, ... |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    speed = f"{r.tokens_per_s / base:.2f}x" if base else "-"
    hist = "-" if r.width == 1 else " ".join(str(h) for h in r.hist)
    lines.append(f"| {r.method} | {r.width} | {r.tau:.2f} | {r.tokens_per_s:.1f} | {speed} | "
                 f"{r.same_as_target}/{r.n_prompts} | {hist} |")
  return "\n".join(lines)
