"""`python -m dflash_jax train-target --out DIR`: train a small Qwen3-shaped target LM in JAX.

The corpus is the Python standard library's sources (or --corpus), byte-tokenized (256 bytes
+ EOS, MASK, PAD; vocab 272), files split train / held-out by a hash of their path. Writes
the target to DIR as an HF folder (config.json + safetensors + tokenizer.json, which
`generate --prompt` and `eval` read text with) and DIR/train_log.json (the arguments, corpus
sizes and the logged losses). A run whose estimated memory does not fit the machine is
refused before any work. Errors are one line naming the argument, exit status 2.
"""
from __future__ import annotations

import os
import time

from dflash_jax.cli import add_common_args, int_in
from dflash_jax.cli import train_common as C
from dflash_jax.io import atomic


def register(sub) -> None:
  p = sub.add_parser("train-target", help="train a small target LM on the stdlib sources",
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="output folder (HF layout)")
  C.add_corpus_args(p)
  p.add_argument("--seq-len", type=int_in(1), default=512, help="tokens per sequence")
  p.add_argument("--batch", type=int_in(1), default=64, help="sequences per step")
  p.add_argument("--layers", type=int_in(1), default=8, help="decoder layers")
  p.add_argument("--hidden", type=int_in(1), default=384, help="hidden size")
  p.add_argument("--heads", type=int_in(1), default=6, help="query heads")
  p.add_argument("--kv-heads", type=int_in(1), default=3,
                 help="6 / 3: a power-of-2 GQA group, which fills the drafter's kernel tiles "
                      "(the drafter takes the target's head layout)")
  p.add_argument("--head-dim", type=int_in(1), default=64, help="head size")
  p.add_argument("--ffn", type=int_in(1), default=1024, help="FFN (intermediate) size")
  p.add_argument("--rope-theta", type=C.positive_float, default=1e4, help="rope base")
  C.add_optim_args(p, steps=2000, lr=2e-3, warmup=100)
  p.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16",
                 help="GEMM inputs (masters, grads and optimizer state are float32)")
  p.add_argument("--save-dtype", choices=("bf16", "f32"), default="bf16",
                 help="stored weights")
  p.add_argument("--max-shard-mb", type=C.positive_float, default=None,
                 help="split the safetensors into shards of at most this many MB (default: one "
                      "file)")
  C.add_run_args(p)
  add_common_args(p)
  p.set_defaults(run=train_target)


def train_target(args) -> int:
  import jax

  from dflash_jax.models import qwen3, save_target
  from dflash_jax.train import budget
  from dflash_jax.train import data as D
  from dflash_jax.train import recipes

  deadline = budget.Deadline.minutes(args.max_minutes)
  tok = D.TOKENIZER
  try:
    tcfg = qwen3.TargetConfig(
        vocab_size=tok.vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=args.rope_theta,
        max_position_embeddings=max(4096, args.seq_len), eos_token_ids=(tok.eos_id,))
  except ValueError as e:
    raise C.arg_error("--heads/--kv-heads/--head-dim", e)
  oc = C.optim_config(args)
  C.check_out(args.out, args.force)
  C.check_memory({"a training step": budget.target_step_bytes(tcfg, args.batch, args.seq_len)},
                 "lower --batch or --seq-len (or the model's --layers/--hidden/--ffn); the "
                 "README's CPU recipe fits 4 GB")
  try:
    train_s, held_s, train_f, held_f = recipes.corpus_streams(args.corpus, args.max_files,
                                                              args.holdout_every)
    train_seqs, held_seqs = D.chunk(train_s, args.seq_len), D.chunk(held_s, args.seq_len)
  except ValueError as e:
    raise C.arg_error("--corpus", e)
  if train_seqs.shape[0] < args.batch:
    raise C.arg_error("--batch", f"{args.batch} exceeds the {train_seqs.shape[0]} "
                       f"training sequences of {args.seq_len} tokens")
  os.makedirs(args.out, exist_ok=True)
  print(f"corpus: {len(train_f)} train files ({train_s.size / 1e6:.2f} M tokens, "
        f"{train_seqs.shape[0]} sequences of {args.seq_len}), {len(held_f)} held-out files "
        f"({held_s.size / 1e6:.2f} M tokens)")
  n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: qwen3.init_params(tcfg, jax.random.key(0)))))
  print(f"target: {tcfg.num_hidden_layers} layers x {tcfg.hidden_size}, {n_params / 1e6:.2f} M "
        f"params, vocab {tcfg.vocab_size}; {args.steps} steps of {args.batch} x {args.seq_len} "
        f"tokens; {jax.devices()[0].device_kind}"
        + ("" if args.max_minutes is None else f"; time limit {args.max_minutes:g} min"))
  t0 = time.perf_counter()
  ckpt = os.path.join(args.out, "checkpoints") if args.checkpoint_every else None
  params, log = recipes.pretrain_target(
      tcfg, train_seqs, held_seqs, oc, args.batch, seed=args.seed,
      compute_dtype=args.compute_dtype, log_every=args.log_every, eval_every=args.eval_every,
      checkpoint_dir=ckpt, checkpoint_every=args.checkpoint_every,
      stop_at=deadline.at() - C.export_reserve(deadline))
  seconds = time.perf_counter() - t0
  save_target(args.out, tcfg, params, dtype=args.save_dtype,
              max_shard_bytes=None if args.max_shard_mb is None
              else int(args.max_shard_mb * 2**20))
  atomic.write_text(os.path.join(args.out, "tokenizer.json"), tok.hf_json())
  final = log[-1]
  atomic.write_json(os.path.join(args.out, "train_log.json"), dict(
      kind="target", args=vars(args) | {"run": None}, tokenizer="bytes", corpus=dict(
          train_files=len(train_f), held_out_files=len(held_f), train_tokens=int(train_s.size),
          held_out_tokens=int(held_s.size)), n_params=int(n_params), seconds=seconds, log=log))
  print(f"done: {final['step']} steps in {seconds:.1f} s; held-out loss "
        f"{final.get('eval_loss', float('nan')):.4f} nats/byte, accuracy "
        f"{final.get('eval_acc', float('nan')):.3f}; target and tokenizer.json saved to "
        f"{args.out} ({time.perf_counter() - deadline.start:.0f} s in all)")
  return 0
