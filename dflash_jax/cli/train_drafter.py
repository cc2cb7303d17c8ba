"""`python -m dflash_jax train-drafter --target DIR --out DIR`: train a DFlash, DFlash2 or DSpark
drafter (--family) against a frozen target (SPEC.md section 10, SPEC_dflash2_dspark).

--data distill (default): the sequences are training-file prompts followed by the target's own
greedy continuations, with the loss on the continuations (what decoding rewards); --data
corpus: the training files themselves, loss everywhere. Target features are computed online in
every step (--features online) or once into npy shards under DIR/features (--features cached,
for targets too large to run beside the drafter). Writes DIR/drafter.gguf (or an HF folder
with --format hf) and DIR/train_log.json; the distilled sequences are kept in DIR/distill.npz
and reused (and completed) by a later run with the same data arguments. A run whose
estimated memory does not fit the machine is refused before any work. --max-minutes bounds
the whole command: distillation ends at 40% of it and feature caching at 60% with the
sequences done by then, training stops (checkpointed) in time for the export. Errors are one
line naming the argument, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import time

from dflash_jax.cli import add_common_args, int_in
from dflash_jax.cli import train_common as C
from dflash_jax.config import FAMILIES, MARKOV_HEADS
from dflash_jax.io import DrafterFormatError, atomic

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0")
# Where each data stage must end, as a share of --max-minutes (training takes the rest).
DISTILL_SHARE, FEATURES_SHARE = 0.4, 0.6


def _nonnegative(text: str) -> float:
  v = float(text)
  if not v >= 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
  return v


def register(sub) -> None:
  p = sub.add_parser("train-drafter", help="train a DFlash drafter against a frozen target",
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--target", required=True, help="target HF folder (train-target's output)")
  p.add_argument("--out", required=True, help="output folder")
  C.add_corpus_args(p)
  p.add_argument("--data", choices=("distill", "corpus"), default="distill",
                 help="training sequences: the target's greedy continuations of corpus "
                      "prompts, or the corpus itself")
  p.add_argument("--prompts", type=int_in(1), default=8192,
                 help="distill: training prompts")
  p.add_argument("--prompt-len", type=int_in(2), default=128, help="distill: prompt tokens")
  p.add_argument("--gen-len", type=int_in(1), default=384,
                 help="distill: greedy tokens generated per prompt")
  p.add_argument("--gen-batch", type=int_in(1), default=512,
                 help="distill: prompts continued per call")
  p.add_argument("--seq-len", type=int_in(1), default=512, help="corpus: sequence length")
  p.add_argument("--layers", type=int_in(1), default=3, help="drafter layers")
  p.add_argument("--ffn", type=int_in(1), default=None, help="default: the target's")
  p.add_argument("--heads", type=int_in(1), default=None, help="default: the target's")
  p.add_argument("--kv-heads", type=int_in(1), default=None, help="default: the target's")
  p.add_argument("--head-dim", type=int_in(1), default=None, help="default: the target's")
  p.add_argument("--family", choices=FAMILIES, default="dflash",
                 help="drafter family: DFlash, DFlash2 (convolutions + candidate selector) or "
                      "DSpark (shifted rows, Markov head, confidence head)")
  p.add_argument("--block", type=int_in(1), default=None,
                 help="block size B (default 16; dspark 7)")
  p.add_argument("--target-layers", type=C.int_list, default=None,
                 help="captured target layers, llama.cpp convention (HF hidden_states index; "
                      "default: 3 spread over the target ending at its last)")
  p.add_argument("--window", type=int_in(1), default=512,
                 help="sliding window of the drafter's sliding layers")
  p.add_argument("--full-layers", type=C.int_list, default=(),
                 help="drafter layers with full attention (none: every layer slides)")
  p.add_argument("--anchors", type=int_in(1), default=32, help="anchors per sequence")
  p.add_argument("--batch", type=int_in(1), default=32, help="sequences per step")
  p.add_argument("--gamma", type=C.positive_float, default=None,
                 help="loss decay (default: 7 for B=16, 5 for B=10, 4 for B=8; dspark 4 for "
                      "B=7)")
  g = p.add_argument_group("dflash2")
  g.add_argument("--conv-kernel", type=int_in(1), default=2, help="taps per convolution")
  g.add_argument("--conv-group", type=int_in(1), default=16,
                 help="channels per dynamic coefficient (divides the hidden size)")
  g.add_argument("--selector-rank", type=int_in(1), default=256, help="codebook rank")
  g.add_argument("--selector-top-k", type=int_in(1), default=16, help="candidates per row")
  g.add_argument("--causal", action="store_true", help="causal block attention")
  g.add_argument("--selector-weight", type=_nonnegative, default=1.0,
                 help="the selector loss's weight next to the block loss")
  g = p.add_argument_group("dspark")
  g.add_argument("--markov-rank", type=int_in(0), default=256, help="0: no Markov head")
  g.add_argument("--markov-head", choices=MARKOV_HEADS, default="vanilla",
                 help="the Markov head's form (docs/SPEC_dflash2_dspark.md section 11)")
  g.add_argument("--confidence", choices=("markov", "hidden", "off"), default="markov",
                 help="confidence head on [h ; W1[prev]], on h, or none")
  g.add_argument("--confidence-weight", type=_nonnegative, default=1.0,
                 help="the confidence BCE's weight next to the CE")
  C.add_optim_args(p, steps=2000, lr=1e-3, warmup=100)
  p.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16",
                 help="GEMM inputs of the drafter and the frozen target (masters, grads and "
                      "optimizer state are float32)")
  p.add_argument("--features", choices=("online", "cached"), default="online",
                 help="target features computed in every step, or once to DIR/features")
  p.add_argument("--feature-dtype", choices=("float32", "float16"), default="float32",
                 help="cached features' storage")
  p.add_argument("--save-type", default="BF16", help=f"GGUF matrix type {GGUF_TYPES} "
                 "(HF: f32|f16|bf16)")
  p.add_argument("--format", choices=("gguf", "hf"), default="gguf",
                 help="output: OUT/drafter.gguf or the HF folder OUT/drafter-hf")
  p.add_argument("--any-shape", action="store_true",
                 help="train a shape the Pallas kernels cannot run (decode it with impl xla)")
  C.add_run_args(p)
  add_common_args(p)
  p.set_defaults(run=train_drafter)


def family_fields(args, n_embd: int):
  """The family's DFlash2Fields / DSparkFields from the arguments (None for dflash)."""
  from dflash_jax.config import DFlash2Fields, DSparkFields

  if args.family == "dflash2":
    try:
      return DFlash2Fields(conv_kernel_size=args.conv_kernel, conv_group_size=args.conv_group,
                           selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                           is_causal=args.causal)
    except ValueError as e:
      raise C.arg_error("--conv-kernel/--conv-group/--selector-rank/--selector-top-k", e)
  if args.family == "dspark":
    conf = args.confidence != "off"
    try:
      return DSparkFields(sample_from_anchor=True, markov_rank=args.markov_rank,
                          markov_head_type=args.markov_head if args.markov_rank else None,
                          confidence_head=conf,
                          confidence_with_markov=conf and args.confidence == "markov")
    except ValueError as e:
      raise C.arg_error("--markov-rank/--confidence", e)
  return None


def default_target_layers(n_layers: int, n: int = 3) -> tuple[int, ...]:
  """n capture indices spread evenly over 1..n_layers, the last being n_layers (the target's
  final hidden state)."""
  return tuple(sorted({max(1, round(n_layers * (i + 1) / n)) for i in range(n)}))


def train_drafter(args) -> int:
  import numpy as np

  import dflash_jax as dfj
  from dflash_jax.config import FULL, SLIDING
  from dflash_jax.models import load_target
  from dflash_jax.train import budget
  from dflash_jax.train import data as D
  from dflash_jax.train import recipes
  from dflash_jax.train import trainer as TR
  from dflash_jax.train.features import FeatureShards, write_feature_shards
  from dflash_jax.train.loss import resolve_gamma
  from pallas_kernels import limits

  deadline = budget.Deadline.minutes(args.max_minutes)
  tok = D.TOKENIZER
  C.check_out(args.out, args.force)
  # The frozen target computes (features, distilled continuations) in the compute dtype, as
  # `eval --dtype` decodes with it.
  try:
    tcfg, target = load_target(args.target, dtype=args.compute_dtype)
  except (ValueError, OSError) as e:
    raise C.arg_error("--target", e)
  layers = args.target_layers or default_target_layers(tcfg.num_hidden_layers)
  try:
    tcfg.check_capture_layers(layers)
  except ValueError as e:
    raise C.arg_error("--target-layers", e)
  bad = [l for l in args.full_layers if not 0 <= l < args.layers]
  if bad:
    raise C.arg_error("--full-layers", f"{bad} outside [0, {args.layers})")
  kinds = tuple(FULL if l in args.full_layers else SLIDING for l in range(args.layers))
  block = args.block or (7 if args.family == "dspark" else 16)
  try:
    cfg = dfj.DFlashConfig(
        n_layer=args.layers, n_embd=tcfg.hidden_size, n_ff=args.ffn or tcfg.intermediate_size,
        n_head=args.heads or tcfg.num_attention_heads,
        n_head_kv=args.kv_heads or tcfg.num_key_value_heads,
        head_dim=args.head_dim or tcfg.head_dim, rope_theta=tcfg.rope_theta,
        rope_scaling=tcfg.rope_scaling, eps=tcfg.rms_norm_eps, target_layers=layers,
        mask_token_id=tok.mask_id, block_size=block, window=args.window, layer_types=kinds,
        family=args.family, family_fields=family_fields(args, tcfg.hidden_size))
  except ValueError as e:
    raise C.arg_error("--layers/--heads/--block/--family", e)
  if args.family == "dflash2" and cfg.dflash2.selector_top_k > tcfg.vocab_size:
    raise C.arg_error("--selector-top-k", f"{cfg.dflash2.selector_top_k} exceeds the target "
                       f"vocab ({tcfg.vocab_size})")
  if not args.any_shape:
    try:   # fail before any work, not at eval time
      limits.check_drafter(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                           width=cfg.block_size)
    except ValueError as e:
      raise C.arg_error("--heads/--head-dim/--block", f"{e} (--any-shape trains it anyway)")
  if cfg.mask_token_id >= tcfg.vocab_size:
    raise C.arg_error("--target", f"vocab {tcfg.vocab_size} has no mask token "
                       f"{cfg.mask_token_id} (not a byte-level train-target model)")
  try:
    gamma = resolve_gamma(cfg.block_size, args.gamma, cfg.shifted_rows)
  except ValueError as e:
    raise C.arg_error("--gamma", e)
  fmt = args.format
  types = GGUF_TYPES if fmt == "gguf" else ("f32", "f16", "bf16")
  save_type = next((t for t in types if t.lower() == args.save_type.lower()), None)
  if save_type is None:
    raise C.arg_error("--save-type", f"{args.save_type!r} is not a {fmt} type "
                       f"(choose from {', '.join(types)})")
  oc = C.optim_config(args)
  distill = args.data == "distill"
  seq_len = args.prompt_len + args.gen_len if distill else args.seq_len
  if distill and seq_len > tcfg.max_position_embeddings:
    raise C.arg_error("--prompt-len/--gen-len", f"{args.prompt_len} + {args.gen_len} tokens "
                       f"exceed the target's max_position_embeddings "
                       f"{tcfg.max_position_embeddings}")
  stages = {"a training step": budget.drafter_step_bytes(
      cfg, tcfg, args.batch, seq_len, args.anchors, online=args.features == "online")}
  if distill:
    stages["distillation"] = budget.distill_bytes(tcfg, args.gen_batch, args.prompt_len,
                                                  args.gen_len)
  C.check_memory(stages, "lower --batch, --anchors or --gen-batch (or the sequence length); "
                 "the README's CPU recipe fits 4 GB")
  try:
    train_s, held_s, _, _ = recipes.corpus_streams(args.corpus, args.max_files,
                                                   args.holdout_every)
  except ValueError as e:
    raise C.arg_error("--corpus", e)
  os.makedirs(args.out, exist_ok=True)
  try:
    if distill:
      prompts = recipes.seeded_rows(D.chunk(train_s, args.prompt_len), args.prompts, args.seed)
      held_p = recipes.seeded_rows(D.chunk(held_s, args.prompt_len), 64, args.seed)
    else:
      seqs = D.chunk(train_s, args.seq_len)
      held_seqs = recipes.seeded_rows(D.chunk(held_s, args.seq_len), 64, args.seed)
  except ValueError as e:
    raise C.arg_error("--prompt-len/--seq-len", e)
  if distill:
    held_t, held_m = recipes.distill_data(target, tcfg, held_p, args.gen_len,
                                          args.gen_batch)
    tokens, mask = _distilled(args, target, tcfg, prompts, deadline)
  else:
    tokens, mask = seqs, np.ones(seqs.shape, bool)
    held_t, held_m = held_seqs, np.ones(held_seqs.shape, bool)
    print(f"corpus: {tokens.shape[0]} sequences of {args.seq_len}")
  if tokens.shape[0] < args.batch:
    raise C.arg_error("--batch", f"{args.batch} exceeds the {tokens.shape[0]} sequences")
  print(f"drafter: {cfg.family}, {cfg.n_layer} layers x {cfg.n_embd}, block {cfg.block_size}, "
        f"{cfg.family_fields or ''} target layers "
        f"{cfg.target_layers}, window {cfg.window}, {args.anchors} anchors x {args.batch} "
        f"sequences per step, gamma {gamma}")
  shards = None
  if args.features == "cached":
    # the drafter's layers, and DSpark's confidence target needs the target's final state
    capture = TR.training_capture_layers(cfg, tcfg)
    folder = os.path.join(args.out, "features")
    t2 = time.perf_counter()
    stop = deadline.at(FEATURES_SHARE)
    try:
      m = write_feature_shards(
          folder, target, tcfg, capture, tokens, batch_size=args.batch,
          dtype=args.feature_dtype, stop_at=stop,
          progress=budget.Progress("features", "sequences", tokens.shape[1], stop_at=stop))
    except ValueError as e:
      raise C.arg_error("--feature-dtype", e)
    shards = FeatureShards(folder, capture)
    if m["n_rows"] < tokens.shape[0]:
      print(f"features: stopped at {FEATURES_SHARE:.0%} of the time limit with "
            f"{m['n_rows']} of {tokens.shape[0]} sequences; training uses those")
      tokens, mask = tokens[:m["n_rows"]], mask[:m["n_rows"]]
      if tokens.shape[0] < args.batch:
        raise C.arg_error("--max-minutes", f"feature caching ended with {tokens.shape[0]} "
                           f"sequences, fewer than --batch {args.batch}")
    print(f"features: {m['n_rows']} x {m['seq_len']} x {m['width']} {m['dtype']} in "
          f"{len(m['shards'])} shards under {folder} ({time.perf_counter() - t2:.1f} s)")
  data = D.DrafterData(tokens, mask, batch_size=args.batch, n_anchors=args.anchors,
                       seed=args.seed)
  held = D.DrafterData(held_t, held_m, batch_size=min(args.batch, held_t.shape[0]),
                       n_anchors=args.anchors, seed=args.seed + 1)
  tc = TR.DrafterTrainConfig(optim=oc, gamma=gamma, window=cfg.window,
                             compute_dtype=args.compute_dtype,
                             selector_weight=args.selector_weight,
                             confidence_weight=args.confidence_weight)
  ckpt = os.path.join(args.out, "checkpoints") if args.checkpoint_every else None
  t1 = time.perf_counter()
  w, log = recipes.train_drafter(
      cfg, target, tcfg, data, tc, seed=args.seed, eval_data=held, log_every=args.log_every,
      eval_every=args.eval_every, checkpoint_dir=ckpt, checkpoint_every=args.checkpoint_every,
      stop_at=deadline.at() - C.export_reserve(deadline), features=shards)
  seconds = time.perf_counter() - t1
  path = os.path.join(args.out, "drafter.gguf" if fmt == "gguf" else "drafter-hf")
  try:
    dfj.save_drafter(path, cfg, recipes.host_weights(w), tensor_type=save_type, format=fmt)
  except (ValueError, DrafterFormatError) as e:
    where = f" (the trained state is in {ckpt})" if ckpt else ""
    raise C.arg_error("--format/--family", f"exporting the {cfg.family} drafter: {e}{where}")
  final = log[-1]
  atomic.write_json(os.path.join(args.out, "train_log.json"), dict(
      kind="drafter", args=vars(args) | {"run": None}, config=str(cfg), seconds=seconds,
      sequences=int(tokens.shape[0]), loss_tokens=int(mask.sum()), log=log))
  print(f"done: {final['step']} steps in {seconds:.1f} s; held-out loss "
        f"{final.get('eval_loss', float('nan')):.4f}, accepted drafts per block "
        f"{final.get('eval_accept', float('nan')):.2f}; drafter saved to {path} "
        f"({time.perf_counter() - deadline.start:.0f} s in all)")
  return 0


def _distilled(args, target, tcfg, prompts, deadline):
  """(tokens, loss mask) of the distilled sequences: those OUT/distill.npz holds from an
  earlier run with the same data arguments, completed here up to --prompts (until
  DISTILL_SHARE of the time limit), and saved back."""
  import numpy as np

  from dflash_jax.train import budget
  from dflash_jax.train import recipes

  path = os.path.join(args.out, "distill.npz")
  key = dict(target=os.path.abspath(args.target), corpus=args.corpus, max_files=args.max_files,
             holdout_every=args.holdout_every, prompt_len=args.prompt_len,
             gen_len=args.gen_len, seed=args.seed, compute_dtype=args.compute_dtype)
  tokens = mask = None
  if os.path.isfile(path):
    with np.load(path) as z:
      if str(z["key"]) == repr(sorted(key.items())):
        tokens, mask = z["tokens"][:len(prompts)], z["mask"][:len(prompts)]
  done = 0 if tokens is None else tokens.shape[0]
  if done:
    print(f"distill: {done} of {len(prompts)} prompts' continuations from {path}")
  if done < len(prompts):
    t0 = time.perf_counter()
    stop = deadline.at(DISTILL_SHARE)
    new_t, new_m = recipes.distill_data(
        target, tcfg, prompts[done:], args.gen_len, args.gen_batch, stop_at=stop,
        progress=budget.Progress("distill", "prompts", args.gen_len, stop_at=stop))
    tokens = new_t if tokens is None else np.concatenate([tokens, new_t])
    mask = new_m if mask is None else np.concatenate([mask, new_m])
    with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
      np.savez(f, tokens=tokens, mask=mask, key=np.array(repr(sorted(key.items()))))
    print(f"distill: {tokens.shape[0]} prompts of {args.prompt_len} + {args.gen_len} greedy "
          f"target tokens ({mask.sum() / 1e6:.2f} M loss tokens; {new_t.shape[0]} new in "
          f"{time.perf_counter() - t0:.1f} s), kept in {path}"
          + ("" if tokens.shape[0] == len(prompts) else
             f"; stopped at {DISTILL_SHARE:.0%} of the time limit (a later run continues)"))
  return tokens, mask
