"""`python -m dflash_jax convert SRC DST`: a drafter from GGUF to an HF checkpoint folder, or back.

Every family converts (DFlash, DFlash2, DSpark); what GGUF cannot hold (a DSpark gated or rnn
Markov head, a confidence head without the Markov feature, per-layer DFlash2 causality, an
input embedding scale) is refused with the reason.

SRC is a drafter GGUF or an HF checkpoint folder (or its config.json); DST is a `.gguf` file or
a folder (created if needed; --format overrides the choice by name). --type is the stored
matrix type: F32, F16, BF16 or Q8_0 for GGUF, f32, f16 or bf16 for HF (any case; default F32,
lossless). Norm weights always stay F32, so F32<->f32, BF16<->bf16 and F16<->f16 conversions
are exact. Errors are one line naming the argument, with exit status 2.
"""
from __future__ import annotations

from dflash_jax.cli import CLIError

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0")
HF_TYPES = ("f32", "f16", "bf16")


def register(sub) -> None:
  c = sub.add_parser("convert", help="convert a drafter between GGUF and an HF checkpoint folder",
                     description=__doc__.split("\n\n")[0])
  c.add_argument("src", metavar="SRC", help="drafter GGUF, or HF checkpoint folder")
  c.add_argument("dst", metavar="DST", help="output: a .gguf file, or an HF folder")
  c.add_argument("--type", default=None,
                 help="matrix type: F32|F16|BF16|Q8_0 for GGUF, f32|f16|bf16 for HF (default F32)")
  c.add_argument("--format", choices=("gguf", "hf"), default=None,
                 help="output format (default: gguf for a .gguf name, else hf)")
  c.set_defaults(run=convert)


def _error(argument: str, message) -> CLIError:
  return CLIError(f"argument {argument}: {' '.join(str(message).split())}")


def convert(args) -> int:
  from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
  fmt = args.format or ("gguf" if args.dst.lower().endswith(".gguf") else "hf")
  types = GGUF_TYPES if fmt == "gguf" else HF_TYPES
  requested = args.type or types[0]
  tensor_type = next((t for t in types if t.lower() == requested.lower()), None)
  if tensor_type is None:
    raise _error("--type", f"{requested!r} is not {'a GGUF' if fmt == 'gguf' else 'an HF'} "
                  f"type (choose from {', '.join(types)})")
  try:
    cfg, w = load_drafter(args.src)
  except (DrafterFormatError, OSError) as e:
    raise _error("SRC", e)
  try:
    save_drafter(args.dst, cfg, w, tensor_type=tensor_type, format=fmt)
  except (DrafterFormatError, ValueError, OSError) as e:
    raise _error("DST", e)
  print(f"{args.src} -> {args.dst}: {fmt}, {tensor_type}, {cfg.n_layer} layers, {len(w)} tensors")
  return 0
