"""Speculative decoding (dflash_jax.decode): lossless greedy decoding against target-only
decoding with the same target code, the ring's contents against the target's own features,
the reduced draft vocab against the full vocab restricted the same way, and input errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import decode as D
from dflash_jax.drafter import step as S
from dflash_jax.models import load_target, save_target
from dflash_jax.models import qwen3 as Q
import tiny_models as TM
from benchmarks.oracle import Oracle

PROMPT_LENGTHS = (1, 2, 3, 7, 12, 20)
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
  tcfg, tp = TM.target(seed=0)
  return tcfg, tp, TM.drafter(tcfg, tp, seed=1)


@pytest.fixture(scope="module")
def prompts(pair):
  rng = np.random.default_rng(2)
  return [rng.integers(0, pair[0].vocab_size, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(pair, prompts):
  """Target-only greedy continuations, and an EOS id that stops some slots early."""
  tcfg, tp, _ = pair
  g = D.generate_target_only(tp, tcfg, prompts, MAX_NEW)
  assert [len(t) for t in g.tokens] == [MAX_NEW] * len(prompts)
  assert g.hist.sum() == g.rounds.sum() == MAX_NEW * len(prompts)
  eos = g.tokens[0][9]
  ge = D.generate_target_only(tp, tcfg, prompts, MAX_NEW, eos_ids=(eos,))
  for full, cut in zip(g.tokens, ge.tokens):
    want = full[:full.index(eos) + 1] if eos in full else full
    assert cut == want
  assert any(len(t) < MAX_NEW for t in ge.tokens)
  return g.tokens, eos, ge.tokens


def _noisy_oracle(prompts, continuations, seed, vocab=97, length=128):
  """start()'s keywords for the oracle proposer (tiny_models.noisy_oracle_state)."""
  return dict(proposer_state=TM.noisy_oracle_state(prompts, continuations, seed, vocab, length))


@pytest.mark.parametrize("width, oracle", [(8, False), (5, True)], ids=["random-w8", "oracle-w5"])
def test_greedy_speculative_is_lossless(pair, prompts, reference, width, oracle):
  tcfg, tp, dp = pair
  ref, eos, ref_eos = reference
  m = TM.models(tcfg, tp, dp)
  dcfg = D.DecodeConfig(width=width, impl="xla", proposer=Oracle() if oracle else D.Drafter())
  orc = _noisy_oracle(prompts, ref, seed=width) if oracle else {}
  streamed = {i: [] for i in range(len(prompts))}
  g = D.generate(m, dcfg, prompts, MAX_NEW, **orc, rounds_per_call=2,
                 on_tokens=lambda i, t: streamed[i].extend(t))
  assert g.tokens == ref
  assert [streamed[i] for i in range(len(prompts))] == ref
  assert (g.hist.sum(1) == g.rounds).all()
  # Every round commits n_ok + 1 tokens; the last one may overshoot max_new.
  committed = (g.hist * np.arange(1, width + 1)).sum(1)
  assert (committed >= MAX_NEW).all() and (committed < MAX_NEW + width).all()
  if oracle:
    assert (g.hist[:, 1:].sum() > 0) and g.hist[:, -1].sum() > 0, g.hist   # long accepts, bonus
    assert g.tau > 2
  ge = D.generate(m, dcfg, prompts, MAX_NEW, **orc, eos_ids=(eos,))
  assert ge.tokens == ref_eos


def test_prompt_lookup_is_lossless(pair, prompts, reference):
  """Prompt lookup (n-gram drafts, no drafter) through the same loop: the target-only output,
  with some drafts accepted (the random target's greedy text repeats itself)."""
  tcfg, tp, _ = pair
  ref, eos, ref_eos = reference
  m = D.Models(target=tp, drafter=None, d2t=None, target_cfg=tcfg)
  dcfg = D.DecodeConfig(width=5, impl="xla", proposer=D.Lookup(max_ngram=2))
  g = D.generate(m, dcfg, prompts, MAX_NEW, rounds_per_call=3)
  assert g.tokens == ref
  assert (g.hist.sum(1) == g.rounds).all() and g.hist[:, 1:].sum() > 0, g.hist
  assert D.generate(m, dcfg, prompts, MAX_NEW, eos_ids=(eos,)).tokens == ref_eos
  with pytest.raises(ValueError, match="Models.drafter and Models.d2t must be None"):
    D.check_models(TM.models(tcfg, tp, pair[2]), dcfg)
  with pytest.raises(ValueError, match="proposer_state arrays need a leading slot axis of 6"):
    D.start(m, dcfg, prompts, 4, proposer_state=np.zeros((2, 9), np.int32))
  with pytest.raises(ValueError, match="width 1 is target-only decoding"):
    D.check_models(TM.models(tcfg, tp, pair[2]), D.DecodeConfig(width=1))
  with pytest.raises(ValueError, match="sampled proposals"):
    D.check_models(m, D.DecodeConfig(width=4, proposer=D.Lookup(),
                                     sampling=D.Sampling(temperature=1.0, proposals="sampled")))
  with pytest.raises(ValueError, match="proposer must be a Proposer"):
    D.DecodeConfig(width=4, proposer="ngram")
  with pytest.raises(ValueError, match="max_ngram must be an int >= 1"):
    D.Lookup(max_ngram=0)


def _python_drafts(seq, n_draft, max_ngram):
  """Longest suffix (<= max_ngram tokens, ending at seq[-1]) that occurred before; its most
  recent earlier occurrence's continuation, read periodically; else seq[-1] repeated."""
  n_past = len(seq) - 1
  for n in range(min(max_ngram, len(seq)), 0, -1):
    suffix = seq[-n:]
    ends = [e for e in range(n - 1, n_past) if seq[e - n + 1:e + 1] == suffix]
    if ends:
      e = max(ends)
      period = n_past - e
      return [seq[e + 1 + i % period] for i in range(n_draft)]
  return [seq[-1]] * n_draft


# (committed tokens, max_ngram, the 4 drafts, worked out by hand)
HAND_MADE = [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2, 3]),              # [1 2 3] at 0..2: its continuation
    ([5, 6, 7], 3, [7, 7, 7, 7]),                          # no match: id_last repeated
    ([5], 2, [5, 5, 5, 5]),                                # n_past 0
    ([1, 2, 9, 5, 2, 8, 1, 2], 3, [9, 5, 2, 8]),           # the longer [1 2] beats a later [2]
    ([1, 2, 9, 5, 2, 8, 1, 2], 1, [8, 1, 2, 8]),           # [2] alone: the latest, periodic
    ([4, 7, 4, 7, 4], 3, [7, 4, 7, 4]),                    # a match 2 back: period 2
    ([1, 2, 3, 7, 9, 3, 8, 1, 2, 3], 3, [7, 9, 3, 8]),
    ([1, 2, 3, 7, 9, 3, 8, 1, 2, 3], 1, [8, 1, 2, 3]),
]


def test_ngram_drafts_hand_made_and_plain_statement():
  """decode.ngram_drafts on hand-made sequences (drafts worked out by hand, and the plain
  Python statement agrees), then on random ones against the plain statement; tokens past
  n_past are scratch (99) the drafts must not depend on."""
  fn = jax.jit(jax.vmap(D.ngram_drafts, in_axes=(0, 0, None, None)), static_argnums=(2, 3))
  size = 40

  def run(seqs, n_draft, max_ngram):
    bufs = np.full((len(seqs), size), 99, np.int32)
    for i, q in enumerate(seqs):
      bufs[i, :len(q)] = q
    n_past = jnp.asarray([len(q) - 1 for q in seqs], jnp.int32)
    return np.asarray(fn(jnp.asarray(bufs), n_past, n_draft, max_ngram))

  for seq, max_ngram, want in HAND_MADE:
    assert _python_drafts(seq, 4, max_ngram) == want, seq
    np.testing.assert_array_equal(run([seq], 4, max_ngram)[0], want, err_msg=str(seq))
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, size))).tolist()
          for _ in range(64)]   # small vocabularies: matches of every length occur
  got = run(seqs, 6, 3)
  np.testing.assert_array_equal(got, [_python_drafts(q, 6, 3) for q in seqs])
  assert (got != 99).all()


def test_greedy_pallas_interpret(pair, prompts, reference):
  """The drafter's Pallas kernels (interpret mode) in the loop: still lossless."""
  tcfg, tp, dp = pair
  g = D.generate(TM.models(tcfg, tp, dp),
                 D.DecodeConfig(width=4, impl="pallas", proposer=Oracle()), prompts[3:4], 6,
                 **_noisy_oracle(prompts[3:4], reference[0][3:4], seed=3))
  assert g.tokens == [reference[0][3][:6]]


def test_oracle_round_compiles_the_drafters_whole_round(pair):
  """Benchmarks time oracle rounds as drafted rounds: the compiled oracle round keeps every
  GEMM of the drafter's round (block step, LM head), not only its inject; a discarded draft
  would let XLA drop them as dead code."""
  import re
  tcfg, tp, dp = pair
  m = TM.models(tcfg, tp, dp)
  seq = [[1, 2, 3, 4, 5] + list(range(6, 50))]

  def dots(proposer):
    dcfg = D.DecodeConfig(width=5, impl="xla", proposer=proposer)
    st = D.start(m, dcfg, [seq[0][:5]], 16, proposer_state=Oracle.state(seq, 64))
    txt = jax.jit(lambda s: D.one_round(m, dcfg, s)).lower(st).compile().as_text()
    return sorted(re.findall(r"= (\S+) dot\(", txt))

  drafted, oracle = dots(D.Drafter()), dots(Oracle())
  lm_head = [d for d in drafted if f",{tcfg.vocab_size}]" in d]
  assert lm_head, drafted
  missing = list(drafted)
  for d in oracle:
    if d in missing:
      missing.remove(d)
  assert not missing, missing
  assert len(dots(Oracle(run_drafter=False))) < len(drafted)


def test_ring_holds_the_committed_features(pair, prompts, reference):
  """After some rounds, the drafter's ring holds exactly the target's features of the
  committed tokens at positions 0 .. n_past - n_new - 1 (the last round's rows pending)."""
  tcfg, tp, dp = pair
  m = TM.models(tcfg, tp, dp)
  dcfg = D.DecodeConfig(width=5, impl="xla", proposer=Oracle())
  st = D.start(m, dcfg, prompts, MAX_NEW, **_noisy_oracle(prompts, reference[0], seed=5))
  st = D.run_rounds(m, dcfg, st, jnp.int32(4))
  n_past, n_new = np.asarray(st.n_past), np.asarray(st.n_new)
  np.testing.assert_array_equal(st.cache.length, n_past)
  assert (n_new >= 1).all() and len(set(n_new.tolist())) > 1
  tokens = np.asarray(st.tokens)
  for s in range(len(prompts)):
    got = tokens[s, :n_past[s] + 1]
    np.testing.assert_array_equal(got, prompts[s] + reference[0][s][:len(got) - len(prompts[s])])
  # Causal: the features of each slot's committed rows do not depend on the rows after them.
  _, feats = Q.forward_jit(tp, tcfg, tokens, capture_layers=dp.cfg.target_layers,
                           with_logits=False)
  n_in = n_past - n_new
  ring = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(prompts), *a.shape)),
                      S.init_ring(dp.cfg, dp.cfg.window))
  want = jax.jit(jax.vmap(lambda r, f, n: S.inject(
      dp, r, S.encode(dp, f, impl="xla"), jnp.arange(f.shape[0]), n, impl="xla")))(
          ring, feats, jnp.asarray(n_in))
  for got, exp in zip(jax.tree.leaves(st.ring), jax.tree.leaves(want)):   # positions, K, V
    if jnp.issubdtype(got.dtype, jnp.integer):
      np.testing.assert_array_equal(got, exp)
    else:
      np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-4)
  for s in range(len(prompts)):
    np.testing.assert_allclose(st.pending[s, :n_new[s]], feats[s, n_in[s]:n_past[s]],
                               rtol=1e-4, atol=1e-4)


def test_full_attention_cache_has_the_loops_capacity(pair, prompts):
  """A drafter with a full-attention layer: `start` sizes its cache to the loop's capacity
  (the positions the target cache holds), not the config's context length, and the prefill
  injects each prompt's positions 0 .. n_past - 1 there."""
  import dflash_jax as dfj
  from dflash_jax.config import FULL, SLIDING
  tcfg, tp, _ = pair
  cfg, _ = TM.drafter_weights(tcfg)
  cfg = dataclasses.replace(cfg, n_layer=2, layer_types=(SLIDING, FULL), context_length=4096)
  w = dfj.synthetic_drafter(cfg, seed=1, with_target=False)
  w["tok_embd"], w["lm_head"] = np.asarray(tp.embed), np.asarray(tp.head)
  m = TM.models(tcfg, tp, dfj.prepare_weights(cfg, w))
  st = D.start(m, D.DecodeConfig(width=4, impl="xla"), prompts, 8)
  cap = st.cache.capacity
  assert cap == 32 and st.ring.full.k.shape[-2] == cap and st.ring.full.pos.shape == (6, cap)
  for s, p in enumerate(prompts):
    want = np.full(cap, -1)
    want[:len(p) - 1] = np.arange(len(p) - 1)
    np.testing.assert_array_equal(st.ring.full.pos[s], want)


def test_reduced_draft_vocab_equals_restricted_full_vocab(pair, prompts):
  """A drafter whose head keeps only the d2t rows proposes what the full-vocab drafter
  proposes when its logits are restricted to those rows, in target ids."""
  tcfg, tp, dp = pair
  d2t = np.sort(np.random.default_rng(7).choice(tcfg.vocab_size, 40, replace=False))
  full = TM.models(tcfg, tp, dp)
  reduced = TM.models(tcfg, tp, TM.drafter(tcfg, tp, seed=1, d2t=d2t), d2t=d2t)
  # The two drafters differ only in the LM head, so one prefilled state serves both.
  st = D.start(reduced, D.DecodeConfig(width=6, impl="xla"), prompts, 8)
  _, _, logits = jax.jit(jax.vmap(lambda r, f, nn, i, p: S.draft_round(
      full.drafter, r, f, nn, i, p, impl="xla", width=6)))(
          st.ring, st.pending, st.n_new, st.id_last, st.n_past)
  restricted = logits[:, 1:6][..., d2t]
  keys = jax.random.split(jax.random.key(3), len(prompts))
  dcfg = D.DecodeConfig(width=6, impl="xla")
  ring, proposal = jax.jit(dcfg.proposer.propose, static_argnums=1)(reduced, dcfg, st, keys)
  np.testing.assert_array_equal(proposal.drafts, d2t[np.argmax(restricted, -1)])   # target ids
  assert proposal.q is None
  # Sampled proposals over a reduced vocab (q scattered to target ids) are checked for
  # losslessness statistically in test_sampling.py.


def test_input_errors(pair):
  tcfg, tp, dp = pair
  m = TM.models(tcfg, tp, dp)
  dcfg = D.DecodeConfig(width=4, impl="xla")
  with pytest.raises(ValueError, match="capacity 20 < longest prompt 5 \\+ max_new 16 \\+ width 4"):
    D.start(m, dcfg, [[1, 2, 3, 4, 5]], 16, capacity=20)
  with pytest.raises(ValueError, match="exceed the target's max_position_embeddings 512"):
    D.start(m, dcfg, [[1] * 500], 16)
  with pytest.raises(ValueError, match="outside the vocab \\[0, 97\\)"):
    D.start(m, dcfg, [[1, 97]], 4)
  with pytest.raises(ValueError, match="non-empty"):
    D.start(m, dcfg, [[]], 4)
  with pytest.raises(ValueError, match="max_new must be an int >= 1"):
    D.start(m, dcfg, [[1]], 0)
  with pytest.raises(ValueError, match="eos ids \\[200\\]"):
    D.start(m, dcfg, [[1]], 4, eos_ids=(200,))
  with pytest.raises(ValueError, match=r"must lie in \[2, 8\] with a dflash drafter of "
                                       r"block_size 8"):
    D.check_models(m, D.DecodeConfig(width=9))
  with pytest.raises(ValueError, match="width 4 needs a drafter"):
    D.check_models(m.replace(drafter=None), dcfg)
  with pytest.raises(ValueError, match="a reduced draft vocab needs d2t"):
    D.check_models(TM.models(tcfg, tp, TM.drafter(tcfg, tp, d2t=np.arange(10))), dcfg)
  with pytest.raises(ValueError, match="distinct target ids"):
    D.check_models(TM.models(tcfg, tp, TM.drafter(tcfg, tp, d2t=np.arange(10)),
                             d2t=np.zeros(10, int)), dcfg)
  deep = dataclasses.replace(dp.cfg, target_layers=(1, 3))
  with pytest.raises(ValueError, match="capture_layers \\[3\\] outside \\[0, 2\\]"):
    D.check_models(m.replace(drafter=dp.replace(cfg=deep)), dcfg)
  np.testing.assert_array_equal(D.d2t_from_offsets([5, 5, 6]), [5, 6, 8])
  # The drafter's head may have fewer rows than tok_embd (a draft vocab), never more.
  import dflash_jax as dfj
  dc, w = TM.drafter_weights(tcfg)
  w["tok_embd"], w["lm_head"] = np.zeros((97, 64)), np.zeros((98, 64))
  with pytest.raises(ValueError, match="tensor 'lm_head' has shape \\(98, 64\\), expected \\(97, 64\\)"):
    dfj.prepare_weights(dc, w)


# --- python -m dflash_jax generate ---------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(pair, tmp_path_factory):
  """The pair on disk: an HF target folder with a word-level tokenizer.json, a drafter GGUF."""
  import dflash_jax as dfj
  from tokenizers import Tokenizer, models, pre_tokenizers
  tcfg, tp, _ = pair
  root = tmp_path_factory.mktemp("generate")
  save_target(root / "target", tcfg, tp, dtype="f32")
  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(tcfg.vocab_size)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(root / "target" / "tokenizer.json"))
  dcfg, w = TM.drafter_weights(tcfg, seed=1)
  dfj.save_drafter(str(root / "drafter.gguf"), dcfg, w)
  return root, tok


def test_generate_cli(folders, capsys):
  from dflash_jax.__main__ import main
  root, tok = folders
  target, drafter = str(root / "target"), str(root / "drafter.gguf")
  assert main(["generate", "--target", target, "--drafter", drafter, "--prompt", "w5 w9 w3",
               "--max-new", "12", "--impl", "xla", "--block", "4", "--sync-every", "2",
               "--compare"]) == 0
  out = capsys.readouterr().out
  tcfg, tparams = load_target(target)
  want = D.generate_target_only(tparams, tcfg, [[5, 9, 3]], 12).tokens[0]
  assert out.splitlines()[0] == tok.decode(want)   # the streamed text, detokenized
  import re
  rounds, tau = re.search(r"tokens:  12 in (\d+) rounds; tau ([\d.]+) \(mean tokens", out).groups()
  hist = [int(c) for c in re.search(r"per round \(count\): 0:(\d+) 1:(\d+) 2:(\d+) 3:(\d+)\n",
                                    out).groups()]
  assert sum(hist) == int(rounds) and abs(float(tau) - np.dot(hist, [1, 2, 3, 4]) / sum(hist)) < 0.01
  assert "output identical (expected: greedy decoding is lossless)" in out
  # Without a tokenizer.json the ids stream; the same run with ids gives the same tokens.
  (root / "target" / "tokenizer.json").rename(root / "tokenizer.json")
  try:
    assert main(["generate", "--target", target, "--drafter", drafter, "--prompt-ids", "5,9,3",
                 "--max-new", "12", "--impl", "xla", "--block", "4", "--sync-every", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, want))
    assert main(["generate", "--target", target, "--drafter", drafter, "--prompt", "w1"]) == 2
    assert "--prompt: text needs" in capsys.readouterr().err
  finally:
    (root / "tokenizer.json").rename(root / "target" / "tokenizer.json")


def test_generate_cli_compare_bf16_pallas_is_identical(folders, capsys):
  """--compare in bf16 with the Pallas kernels (the batch-invariant target): the speculative
  output is target-only decoding's, token for token."""
  from dflash_jax.__main__ import main
  root, _ = folders
  assert main(["generate", "--target", str(root / "target"), "--drafter",
               str(root / "drafter.gguf"), "--prompt", "w5 w9 w3 w7", "--max-new", "12",
               "--dtype", "bf16", "--impl", "pallas", "--block", "5", "--compare"]) == 0
  assert "output identical" in capsys.readouterr().out


def test_generate_cli_full_attention_drafter_and_draft_window(folders, capsys, tmp_path):
  """A drafter GGUF without a window runs full attention (its cache holds every position);
  --draft-window 8 runs its layers in an 8-slot ring instead. Both stay lossless."""
  import dflash_jax as dfj
  from dflash_jax.__main__ import main
  root, _ = folders
  target = str(root / "target")
  tcfg, tparams = load_target(target)
  dcfg, w = TM.drafter_weights(tcfg, seed=2)
  full = dataclasses.replace(dcfg, window=None, layer_types=("full_attention",) * dcfg.n_layer)
  drafter = dfj.save_drafter(str(tmp_path / "full.gguf"), full, w)
  assert dfj.load_drafter(drafter)[0].kinds == full.kinds
  want = " ".join(map(str, D.generate_target_only(tparams, tcfg, [[5, 9, 3]], 20).tokens[0]))
  base = ["generate", "--target", target, "--drafter", drafter, "--prompt-ids", "5,9,3",
          "--max-new", "20", "--impl", "xla", "--block", "4"]
  (root / "target" / "tokenizer.json").rename(root / "tokenizer.json")
  try:
    for extra in ([], ["--draft-window", "8"]):
      assert main(base + extra) == 0
      assert capsys.readouterr().out.splitlines()[0] == want, extra
  finally:
    (root / "tokenizer.json").rename(root / "target" / "tokenizer.json")


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,200"], "--prompt-ids: id 200 is outside the vocab [0, 97)"),
    (["--prompt-ids", "1", "--block", "9"], "--block: must lie in [2, 8]"),
    (["--prompt-ids", "1", "--eos", "500"], "--eos: ids must lie in [0, 97)"),
    (["--prompt-ids", "1", "--target", "/nonexistent"], "--target: /nonexistent: no such model folder"),
    (["--prompt-ids", "1", "--drafter", "/nonexistent.gguf"], "--drafter:"),
])
def test_generate_cli_errors(folders, capsys, argv, message):
  from dflash_jax.__main__ import main
  root, _ = folders
  base = ["generate", "--target", str(root / "target"), "--drafter", str(root / "drafter.gguf")]
  assert main(base + argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv", [["--top-p", "0"], ["--max-new", "0"], ["--prompt-ids", "a,b"],
                                  ["--temperature", "-1"]])
def test_generate_cli_rejects_bad_values(argv, capsys):
  from dflash_jax.__main__ import main
  assert main(["generate", "--target", "t", "--drafter", "d", "--prompt-ids", "1"] + argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("python -m dflash_jax generate: error: "), err


def test_benchmark_decode_smoke(tmp_path):
  """benchmarks/decode.py stays alive: its --smoke run at tiny dims (numbers are not results)."""
  import json
  from benchmarks import decode as B
  assert B.main(["--smoke", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "decode.json").read_text())
  r = res["round_ms"]
  for k in ("draft_full_vocab", "draft_reduced_vocab", "inject", "block_step_full_vocab",
            "verify_block", "decode1", "accept_commit"):
    assert r[k] > 0, k
  assert res["bytes"]["target_GB"] > 0 and res["target_only"]["tokens_per_s"] > 0
  (o,) = res["oracle"]
  assert o["k"] == 3 and sum(o["hist"]) == o["rounds"] and o["tokens"] == 24
  assert (tmp_path / "decode.md").read_text().startswith("- device:")


@pytest.mark.gpu
def test_greedy_lossless_1b_class_gpu():
  """A Llama-3.2-1B-shaped float32 target (16 layers, 2048 hidden, 32/8 heads x 64, vocab
  128256, tied) with a 5-layer drafter of its width, the Pallas kernels: speculative greedy
  output == target-only greedy output (noisy oracle drafts: every acceptance length)."""
  from benchmarks import common as C
  tcfg = Q.TargetConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, rope_theta=5e5, tie_word_embeddings=True, qk_norm=False)
  tp = Q.init_params(tcfg, jax.random.key(0))
  import dflash_jax as dfj
  dcfg = dataclasses.replace(dfj.QWEN3_8B_CONFIG, n_embd=2048, n_ff=6144, head_dim=64,
                             target_layers=(2, 5, 9, 12, 15), mask_token_id=128000)
  dp = C.random_params(dcfg, 16, "fp32").replace(tok_embd=tp.embed, lm_head=tp.head)
  m = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tcfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, tcfg.vocab_size, n).tolist() for n in (5, 40, 100)]
  ref = D.generate_target_only(tp, tcfg, prompts, 64).tokens
  for width in (16, 5):
    g = D.generate(m, D.DecodeConfig(width=width, proposer=Oracle()), prompts, 64,
                   **_noisy_oracle(prompts, ref, seed=width, vocab=tcfg.vocab_size, length=512))
    assert g.tokens == ref, width
    assert g.hist[:, 1:].sum() > 0
