"""The Gated DeltaNet kernels (pallas_kernels/gdn.py; interpret mode on CPU) and their jnp
twins against a float64 numpy statement of the rule, token by token; the replay commit
against the verify kernel's own snapshots; the chunked prefill against the recurrence."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gdn as G


def _rule(q, k, v, g, beta, s0):
  """The gated delta rule in float64, one row and one value head at a time.
  q, k [B, T, nk, dk]; v [B, T, nv, dv]; g, beta [B, T, nv]; s0 [B, nv, dk, dv].
  Returns (o [B, T, nv, dv], states [B, T, nv, dk, dv] after each row)."""
  q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
  s = s.copy()
  bsz, t, nk, _ = q.shape
  nv = v.shape[2]
  o = np.zeros(v.shape)
  states = np.zeros((bsz, t) + s.shape[1:])
  for b in range(bsz):
    for i in range(t):
      for j in range(nv):
        kh = j // (nv // nk)
        s[b, j] = np.exp(g[b, i, j]) * s[b, j]
        u = (v[b, i, j] - s[b, j].T @ k[b, i, kh]) * beta[b, i, j]
        s[b, j] = s[b, j] + np.outer(k[b, i, kh], u)
        o[b, i, j] = s[b, j].T @ q[b, i, kh]
      states[b, i] = s[b]
  return o, states


def _inputs(seed, bsz=2, t=5, nk=2, nv=4, dk=16, dv=16, layers=3):
  """Random rule inputs as the model makes them: q, k l2-normed (q / sqrt(dk)), g < 0,
  beta in (0, 1); a random stacked state."""
  rng = np.random.default_rng(seed)
  l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  q = l2(rng.standard_normal((bsz, t, nk, dk))) / np.sqrt(dk)
  k = l2(rng.standard_normal((bsz, t, nk, dk)))
  v = rng.standard_normal((bsz, t, nv, dv))
  g = -rng.uniform(0.01, 1.0, (bsz, t, nv))
  beta = rng.uniform(0.0, 1.0, (bsz, t, nv))
  state = 0.3 * rng.standard_normal((bsz, layers, nv, dk, dv))
  return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("t", [1, 5, 16])
def test_recurrent_matches_the_rule(t):
  """o and the per-row snapshots, kernel (two value blocks per head, GQA 2) and twin; the
  state is only read; with an aliased snapshot buffer the other layers stay as they were."""
  q, k, v, g, beta, state = _inputs(t, t=t)
  lay = 1
  o_ref, states = _rule(q, k, v, g, beta, state[:, lay])
  knobs = G.Knobs(block_v=8)
  o = G.recurrent(q, k, v, g, beta, state, lay, knobs=knobs)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  o2, snaps = G.recurrent(q, k, v, g, beta, state, lay, snapshot_layers=3, knobs=knobs)
  np.testing.assert_array_equal(o2, o)
  np.testing.assert_allclose(snaps[:, lay], states, rtol=1e-5, atol=1e-5)
  o3, snaps3 = G.recurrent_reference(q, k, v, g, beta, state, lay, snapshot_layers=3)
  np.testing.assert_allclose(o3, o_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(snaps3[:, lay], states, rtol=1e-5, atol=1e-5)
  # Into an existing buffer: layer 2's rows written, layers 0 and 1 untouched.
  buf = jnp.full((2, 3, t, 4, 16, 16), 7.0, jnp.float32)
  _, out = G.recurrent(q, k, v, g, beta, state, 2, buf, knobs=knobs)
  np.testing.assert_array_equal(out[:, :2], 7.0)
  np.testing.assert_allclose(out[:, 2], _rule(q, k, v, g, beta, state[:, 2])[1], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("t", [1, 6])
def test_replay_is_the_verifys_own_state(t):
  """replay(n_keep) == the recurrent kernel's snapshot after row n_keep - 1, bitwise (the
  same row code; rows past n_keep run as g = beta = 0), for every n_keep in 0..T and every
  layer at once; n_keep = 0 leaves the state bitwise as it was. The twins agree to a
  tolerance (XLA fuses their two programs differently)."""
  q, k, v, g, beta, state = _inputs(10 + t, t=t)
  knobs = G.Knobs(block_v=8)
  # Each layer its own rows: the inputs scaled per layer (g, beta stay in range).
  per_layer = [[a * (1 - 0.1 * lay) for a in (q, k, v, g, beta)] for lay in range(3)]
  rows = [G.recurrent(*per_layer[lay], state, lay, snapshot_layers=3, knobs=knobs)[1][:, lay]
          for lay in range(3)]
  twin_rows = [G.recurrent_reference(*per_layer[lay], state, lay, snapshot_layers=3)[1][:, lay]
               for lay in range(3)]
  args = [jnp.stack([per_layer[lay][i] for lay in range(3)], axis=1) for i in range(5)]
  for n0 in range(t + 1):
    n_keep = jnp.asarray([n0, t - n0], jnp.int32)
    got = G.replay(*args, jnp.array(state), n_keep, knobs=knobs)
    twin = G.replay_reference(*args, state, n_keep)
    for lay in range(3):
      for b, n in enumerate((n0, t - n0)):
        want = state[b, lay] if n == 0 else rows[lay][b, n - 1]
        np.testing.assert_array_equal(got[b, lay], want, err_msg=f"layer {lay} b {b} n {n}")
        want_twin = state[b, lay] if n == 0 else twin_rows[lay][b, n - 1]
        np.testing.assert_allclose(twin[b, lay], want_twin, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t, chunk", [(7, 16), (37, 16), (64, 32)])
def test_chunked_equals_token_by_token(t, chunk):
  """The chunked form (kernel and twin; T padded to whole chunks inside) == the rule row by
  row (float64) == the recurrent twin run over the same rows; only [layer] of the state
  moves."""
  q, k, v, g, beta, state = _inputs(20 + t, t=t)
  lay = 2
  o_ref, states = _rule(q, k, v, g, beta, state[:, lay])
  o, new = G.chunked(q, k, v, g, beta, jnp.array(state), lay,
                     knobs=G.Knobs(block_v=16, chunk=chunk))
  o2, new2 = G.chunked_reference(q, k, v, g, beta, state, lay, chunk=chunk)
  for got_o, got_s in ((o, new), (o2, new2)):
    np.testing.assert_allclose(got_o, o_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_s[:, lay], states[:, -1], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got_s[:, :lay], state[:, :lay])
  # The same rows one at a time through the recurrent twin (in pieces of <= 16 rows).
  s, outs = state, []
  for i in range(0, t, 16):
    sl = slice(i, i + 16)
    oo, sn = G.recurrent_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, lay,
                                   snapshot_layers=3)
    outs.append(oo)
    s = s.at[:, lay].set(sn[:, lay, -1])
  np.testing.assert_allclose(o, jnp.concatenate(outs, 1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(new[:, lay], s[:, lay], rtol=1e-4, atol=1e-5)


def test_chunked_no_op_rows_keep_the_state():
  """Rows with g = beta = 0 (prefill padding) leave S where the rows before them left it."""
  q, k, v, g, beta, state = _inputs(30, t=20)
  n = jnp.asarray([13, 4])
  keep = (jnp.arange(20)[None, :] < n[:, None])[..., None]
  g0, b0 = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
  _, states = _rule(q, k, v, g, beta, state[:, 0])
  for fn in (lambda *a: G.chunked(*a, knobs=G.Knobs(block_v=16, chunk=16)),
             lambda *a: G.chunked_reference(*a, chunk=16)):
    _, new = fn(q, k, v, g0, b0, jnp.array(state), 0)
    for b in range(2):
      np.testing.assert_allclose(new[b, 0], states[b, int(n[b]) - 1], rtol=1e-4, atol=1e-5)


def test_unit_lower_inverse():
  rng = np.random.default_rng(0)
  a = np.tril(rng.uniform(-1, 1, (32, 32)), -1)
  got = G.unit_lower_inverse(jnp.asarray(a, jnp.float32))
  np.testing.assert_allclose(got, np.linalg.inv(np.eye(32) + a), rtol=1e-4, atol=1e-4)


def test_input_errors():
  q, k, v, g, beta, state = _inputs(0)
  with pytest.raises(ValueError, match="gdn.recurrent: nv must be a multiple of nk"):
    G.recurrent(q[:, :, :1].repeat(3, 2), k[:, :, :1].repeat(3, 2), v, g, beta, state, 0)
  with pytest.raises(ValueError, match="gdn.recurrent: q dtype must be float32"):
    G.recurrent(q.astype(jnp.bfloat16), k, v, g, beta, state, 0)
  with pytest.raises(ValueError, match="gdn.chunked: knobs.block_v must be a power of 2 in "
                                       r"\[16, dv\]"):
    G.chunked(q, k, v, g, beta, state, 0, knobs=G.Knobs(block_v=8))
  with pytest.raises(ValueError, match="gdn.recurrent: state must be"):
    G.recurrent(q, k, v, g, beta, state[:, 0], 0)
  with pytest.raises(ValueError, match=r"gdn.recurrent: dk must be a power of 2 in \[16, 256\]"):
    G.recurrent(q[..., :12], k[..., :12], v, g, beta, state[..., :12, :], 0)


# --- Triton lowering for sm90 (no GPU needed) ------------------------------------------------

def _lowering_cases() -> dict:
  """Every kernel and mode at the Qwen3.6-27B-like shapes (one sequence, 48 GDN layers,
  16 key / 48 value heads x 128): interpret mode runs the same kernels at small dims; this
  checks that Triton lowering takes them (power-of-2 tensors, no register slicing)."""
  from jax import ShapeDtypeStruct as S
  f32, i32 = jnp.float32, jnp.int32
  b, nl, nk, nv, dk, dv = 1, 48, 16, 48, 128, 128

  def rows(t, lead=(b,)):
    return (S(lead + (t, nk, dk), f32),) * 2 + (S(lead + (t, nv, dv), f32),) + (
        S(lead + (t, nv), f32),) * 2

  state, layer = S((b, nl, nv, dk, dv), f32), S((), i32)
  cases = {}
  for t in (1, 5, 16):
    cases[f"recurrent_t{t}"] = (lambda *a: G.recurrent(*a, interpret=False),
                                rows(t) + (state, layer))
  cases["recurrent_t16_new_snapshots"] = (
      lambda *a: G.recurrent(*a, snapshot_layers=nl, interpret=False), rows(16) + (state, layer))
  cases["recurrent_t16_aliased_snapshots"] = (
      lambda *a: G.recurrent(*a, interpret=False),
      rows(16) + (state, layer, S((b, nl, 16, nv, dk, dv), f32)))
  cases["replay_t16"] = (lambda *a: G.replay(*a, interpret=False),
                         rows(16, (b, nl)) + (state, S((b,), i32)))
  for t, chunk, prec in ((128, 32, "ieee"), (300, 64, "tf32x3")):
    cases[f"chunked_t{t}_c{chunk}_{prec}"] = (
        lambda *a, c=chunk, p=prec: G.chunked(*a, knobs=G.Knobs(chunk=c, precision=p),
                                              interpret=False), rows(t) + (state, layer))
  return cases


@pytest.mark.parametrize("name", list(_lowering_cases()))
def test_kernels_lower_for_sm90(name):
  from test_kernels_lowering import assert_lowers_for_sm90
  assert_lowers_for_sm90(*_lowering_cases()[name])


# --- on the GPU: compiled kernels at the Qwen3.6-27B-like shapes ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
def test_recurrent_and_replay_gpu(t):
  """nk 16 / nv 48 heads of 128 x 128: the compiled recurrent kernel against its twin and the
  float64 rule (one sequence of two), snapshots included; the replay bitwise the kernel's
  own snapshots for every n_keep."""
  q, k, v, g, beta, state = _inputs(40 + t, bsz=2, t=t, nk=16, nv=48, dk=128, dv=128, layers=2)
  o, snaps = G.recurrent(q, k, v, g, beta, state, 1, snapshot_layers=2)
  o2, snaps2 = G.recurrent_reference(q, k, v, g, beta, state, 1, snapshot_layers=2)
  np.testing.assert_allclose(o, o2, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(snaps[:, 1], snaps2[:, 1], rtol=1e-4, atol=1e-5)
  o_ref, states = _rule(q[:1], k[:1], v[:1], g[:1], beta[:1], state[:1, 1])
  np.testing.assert_allclose(o[:1], o_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(snaps[:1, 1], states, rtol=1e-4, atol=1e-5)
  stack = lambda a: jnp.stack([a, a], axis=1)
  for n0 in sorted({0, 1, t // 2, t}):
    n_keep = jnp.asarray([n0, t - n0], jnp.int32)
    got = G.replay(stack(q), stack(k), stack(v), stack(g), stack(beta), jnp.array(state),
                   n_keep)
    for b, n in enumerate((n0, t - n0)):
      want = state[b, 1] if n == 0 else snaps[b, 1, n - 1]
      np.testing.assert_array_equal(got[b, 1], want)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk, precision", [(32, "ieee"), (64, "ieee"), (64, "tf32x3")])
def test_chunked_gpu(chunk, precision):
  """A 300-row prefill at the real head shapes: the compiled chunked kernel against its twin
  and against the recurrence row by row (the recurrent twin)."""
  t = 300
  q, k, v, g, beta, state = _inputs(50, bsz=1, t=t, nk=16, nv=48, dk=128, dv=128, layers=2)
  o, new = G.chunked(q, k, v, g, beta, jnp.array(state), 1,
                     knobs=G.Knobs(chunk=chunk, precision=precision))
  o2, new2 = G.chunked_reference(q, k, v, g, beta, state, 1, chunk=chunk)
  tol = dict(rtol=1e-3, atol=1e-4) if precision == "tf32x3" else dict(rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(o, o2, **tol)
  np.testing.assert_allclose(new[:, 1], new2[:, 1], **tol)
  s, outs = state, []
  for i in range(0, t, 16):
    sl = slice(i, i + 16)
    oo, sn = G.recurrent_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, 1,
                                   snapshot_layers=2)
    outs.append(oo)
    s = s.at[:, 1].set(sn[:, 1, -1])
  np.testing.assert_allclose(o, jnp.concatenate(outs, 1), **tol)
  np.testing.assert_allclose(new[:, 1], s[:, 1], **tol)
