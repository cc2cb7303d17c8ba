"""`python -m dflash_jax convert SRC DST`: a drafter from GGUF to an HF checkpoint folder, or back.

Every family converts (DFlash, DFlash2, DSpark); what GGUF cannot hold (a DSpark gated or rnn
Markov head, a confidence head without the Markov feature, per-layer DFlash2 causality, an
input embedding scale) is refused with the reason.

SRC is a drafter GGUF or an HF checkpoint folder (or its config.json); DST is a `.gguf` file or
a folder (created if needed; --format overrides the choice by name). --type is the stored
matrix type: F32, F16, BF16 or Q8_0 for GGUF, f32, f16 or bf16 for HF (any case); by default
the source's own (a Q8_0 source going to HF, or a source of mixed types, is written F32,
which holds every value exactly). Norm weights always stay F32, so F32<->f32, BF16<->bf16 and
F16<->f16 conversions are exact. DST must differ from SRC, and an existing DST (a file, or a
non-empty folder) is replaced only with --force; both are checked before anything is read.
Errors are one line naming the argument, with exit status 2.
"""
from __future__ import annotations

import os

from dflash_jax.cli import CLIError, add_common_args, check_new_output

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0")
HF_TYPES = ("f32", "f16", "bf16")


def register(sub) -> None:
  c = sub.add_parser("convert", help="convert a drafter between GGUF and an HF checkpoint folder",
                     description=__doc__.split("\n\n")[0])
  c.add_argument("src", metavar="SRC", help="drafter GGUF, or HF checkpoint folder")
  c.add_argument("dst", metavar="DST", help="output: a .gguf file, or an HF folder")
  c.add_argument("--type", default=None,
                 help="matrix type: F32|F16|BF16|Q8_0 for GGUF, f32|f16|bf16 for HF (default: "
                      "the source's, else F32)")
  c.add_argument("--format", choices=("gguf", "hf"), default=None,
                 help="output format (default: gguf for a .gguf name, else hf)")
  c.add_argument("--force", action="store_true",
                 help="replace an existing DST file, or write into a non-empty DST folder")
  add_common_args(c)
  c.set_defaults(run=convert)


def _error(argument: str, message) -> CLIError:
  return CLIError(f"argument {argument}: {' '.join(str(message).split())}")


def _source_types(src: str) -> set[str]:
  """The stored types of the source's matrices (GGUF names: F32, F16, BF16, Q8_0, ...)."""
  if os.path.isfile(src) and not src.endswith(".json"):
    import gguf
    return {gguf.GGMLQuantizationType(int(t.tensor_type)).name
            for t in gguf.GGUFReader(src).tensors if len(t.shape) == 2}
  from dflash_jax.io import safetensors as st
  folder = os.path.dirname(src) if src.endswith(".json") else src
  return {spec.dtype.upper() for spec in st.tensor_specs(folder).values()
          if len(spec.shape) == 2}


def _default_type(stored: set[str], fmt: str) -> tuple[str, str]:
  """(the type DST keeps the source's precision in, why)."""
  if len(stored) == 1:
    (t,) = stored
    if fmt == "gguf" and t in GGUF_TYPES:
      return t, "the source's"
    if fmt == "hf" and t.lower() in HF_TYPES:
      return t.lower(), "the source's"
    why = f"the source's {t} has no {fmt.upper()} form"
  else:
    why = f"the source mixes {', '.join(sorted(stored))}"
  return ("F32" if fmt == "gguf" else "f32"), f"{why}; F32 holds every value exactly"


def _same_place(src: str, dst: str) -> bool:
  a = os.path.realpath(os.path.dirname(src) if src.endswith("config.json") else src)
  return os.path.exists(dst) and os.path.samefile(a, os.path.realpath(dst))


def convert(args) -> int:
  from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
  fmt = args.format or ("gguf" if args.dst.lower().endswith(".gguf") else "hf")
  types = GGUF_TYPES if fmt == "gguf" else HF_TYPES
  tensor_type = None
  if args.type is not None:
    tensor_type = next((t for t in types if t.lower() == args.type.lower()), None)
    if tensor_type is None:
      raise _error("--type", f"{args.type!r} is not {'a GGUF' if fmt == 'gguf' else 'an HF'} "
                   f"type (choose from {', '.join(types)})")
  if not os.path.exists(args.src):
    raise _error("SRC", f"no such file or folder: {args.src!r}")
  if _same_place(args.src, args.dst):
    raise _error("DST", f"{args.dst!r} is SRC itself; write the conversion elsewhere")
  check_new_output(args.dst, "DST", args.force, folder=fmt == "hf")
  try:
    cfg, w = load_drafter(args.src)
    stored = _source_types(args.src)
  except (DrafterFormatError, OSError, ValueError) as e:
    raise _error("SRC", e)
  why = "--type"
  if tensor_type is None:
    tensor_type, why = _default_type(stored, fmt)
  try:
    save_drafter(args.dst, cfg, w, tensor_type=tensor_type, format=fmt)
  except (DrafterFormatError, ValueError, OSError) as e:
    raise _error("DST", e)
  print(f"{args.src} ({'/'.join(sorted(stored))}) -> {args.dst}: {fmt}, {tensor_type} ({why}), "
        f"{cfg.n_layer} layers, {len(w)} tensors")
  return 0
