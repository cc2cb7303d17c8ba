"""Acceptance and speed of trained drafters, end to end, against target-only decoding and a
prompt-lookup (n-gram) baseline, all with the same target code (`dflash_jax.decode`).

Every prompt is decoded alone (batch 1: the latency setting speculative decoding is for);
the timed seconds are the decoding rounds after prefill, and each configuration is run once
untimed first so compiles are excluded. Each speedup comes with a bootstrap interval over
the prompts (`speedup_interval`): small evaluations are noisy, and the interval says how much. tau = mean tokens committed per round (accepted drafts
plus the target's own token).

Prompt lookup is decode's loop with `DecodeConfig(proposer=Lookup(max_ngram))`
(`decode.ngram_drafts`): the same verify, accept and commit as the drafters' rounds; only the proposer differs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from dflash_jax import decode
from dflash_jax.models import qwen3
from dflash_jax.drafter.weights import DrafterParams


@dataclasses.dataclass
class EvalRow:
  """One method on all prompts: hist[j] = rounds that accepted j drafts (summed over prompts);
  same_as_target = prompts whose output equals target-only greedy decoding; prompt_tokens /
  prompt_seconds: each prompt's generated tokens and decoding seconds (the spread)."""
  method: str
  width: int
  tau: float
  hist: list[int]
  n_tokens: int
  seconds: float
  same_as_target: int
  n_prompts: int
  prompt_tokens: list[int] = dataclasses.field(default_factory=list)
  prompt_seconds: list[float] = dataclasses.field(default_factory=list)

  @property
  def tokens_per_s(self) -> float:
    return self.n_tokens / max(self.seconds, 1e-12)


def speedup_interval(row: EvalRow, base: EvalRow, level: float = 0.95, n_boot: int = 2000,
                     seed: int = 0) -> tuple[float, float] | None:
  """A bootstrap interval (percentiles, `level`) of row's speedup over base (tokens/s over
  tokens/s, both summed over the prompts), resampling the prompts with replacement, each
  prompt's two timings together. None with fewer than 2 prompts or no per-prompt times."""
  n = len(row.prompt_seconds)
  if n < 2 or len(base.prompt_seconds) != n:
    return None
  tok, sec = np.asarray(row.prompt_tokens, float), np.asarray(row.prompt_seconds, float)
  btok, bsec = np.asarray(base.prompt_tokens, float), np.asarray(base.prompt_seconds, float)
  idx = np.random.default_rng(seed).integers(0, n, (n_boot, n))
  ratio = (tok[idx].sum(1) / sec[idx].sum(1)) / (btok[idx].sum(1) / bsec[idx].sum(1))
  lo, hi = np.percentile(ratio, [50 * (1 - level), 50 * (1 + level)])
  return float(lo), float(hi)


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
                 same_as_target=same, n_prompts=len(gens),
                 prompt_tokens=[len(t) for t in toks], prompt_seconds=[g.seconds for g in gens])


def evaluate(target: qwen3.TargetParams, tcfg: qwen3.TargetConfig,
             drafters: Sequence[tuple[str, DrafterParams]], prompts: Sequence[Sequence[int]],
             max_new: int, widths: Sequence[int] = (16, 8), *, lookup: bool = True,
             max_ngram: int = 3, impl: str = "pallas", target_impl: str = "xla",
             cache_dtype: Any = "fp32", ring_dtype: Any = "fp32", out=print) -> list[EvalRow]:
  """Target-only greedy decoding, then each (name, drafter) at each width (rows verified per
  round, each <= the drafter's `max_verify_width`: a ValueError otherwise), then prompt lookup
  at each width; every prompt decoded alone, all greedy, no EOS stop."""
  for name, dp in drafters:
    over = [w for w in widths if w > dp.cfg.max_verify_width]
    if over:
      raise ValueError(f"widths {over} exceed drafter {name}'s max_verify_width "
                       f"{dp.cfg.max_verify_width}")
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
      dcfg = decode.DecodeConfig(width=w, impl=impl, target_impl=target_impl)
      gens = _run_each(lambda ps: decode.generate(models, dcfg, ps, max_new,
                                                  ring_dtype=ring_dtype, **kw), prompts)
      rows.append(_row(name, w, gens, ref))
      out(f"{name} width {w}: tau {rows[-1].tau:.2f}, {rows[-1].tokens_per_s:.1f} tok/s")
  if lookup:
    models = decode.Models(target=target, drafter=None, d2t=None, target_cfg=tcfg)
    for w in widths:
      dcfg = decode.DecodeConfig(width=w, impl=impl, target_impl=target_impl,
                                 proposer=decode.Lookup(max_ngram))
      gens = _run_each(lambda ps: decode.generate(models, dcfg, ps, max_new, **kw), prompts)
      rows.append(_row(f"prompt lookup (n <= {max_ngram})", w, gens, ref))
      out(f"prompt lookup width {w}: tau {rows[-1].tau:.2f}, {rows[-1].tokens_per_s:.1f} tok/s")
  return rows


def markdown_table(rows: Sequence[EvalRow]) -> str:
  """The eval table: tau, speed and speedup over target-only (with its 95% bootstrap interval
  over the prompts, `speedup_interval`), losslessness, histogram."""
  base_row = next((r for r in rows if r.width == 1), None)
  base = base_row.tokens_per_s if base_row else None
  lines = ["| method | block | tau | tokens/s | speedup | 95% interval | = target | accepted "
           "drafts per round: rounds with 0, 1, 2, ... |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    speed = f"{r.tokens_per_s / base:.2f}x" if base else "-"
    ci = speedup_interval(r, base_row) if base_row is not None and r is not base_row else None
    interval = f"{ci[0]:.2f}-{ci[1]:.2f}x" if ci else "-"
    hist = "-" if r.width == 1 else " ".join(str(h) for h in r.hist)
    lines.append(f"| {r.method} | {r.width} | {r.tau:.2f} | {r.tokens_per_s:.1f} | {speed} | "
                 f"{interval} | {r.same_as_target}/{r.n_prompts} | {hist} |")
  return "\n".join(lines)
