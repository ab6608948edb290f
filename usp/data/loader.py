"""Resumable loaders over packed rows, and ``build_dataloaders`` (the trainer's one entry point to data).

Sample order. The training rows are read as one endless stream: epoch ``e`` is a permutation of the rows
drawn from ``(seed, e)``, and epochs follow each other. Every step takes the next ``dp_degree x B`` samples
of the stream; data-parallel rank ``d`` takes samples ``[d*B, (d+1)*B)`` of them, and every sp rank of that
dp group gets its slice of the same samples. So within an epoch every row is used exactly once across all
ranks (no drop, no duplicate; a step may straddle two epochs). The state is one number, the samples
consumed, so resume continues with the next unseen sample, even under a different ``dp_degree``.

The validation loader is finite: one pass over the held-out rows in a fixed order per ``iter()``, in whole
steps of ``dp_degree x B`` (the few rows that cannot fill a last step are skipped: ``tokens_dropped``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from datasets import Dataset, load_from_disk

from usp.config import DataConfig
from usp.data.batch import collate_rows
from usp.data.pack import LengthShaping
from usp.data.prepare import prepare_dataset
from usp.data.prepared import preparation_key, read_stats, tokenizer_identity
from usp.data.sources import check_inputs, is_prepared_dataset
from usp.data.tokenize import check_tokenizer
from usp.parallel import SPMesh, check_sequence_length
from usp.parallel.agree import on_rank0

logger = logging.getLogger(__name__)
STATE_VERSION = 1
TINY_INPUTS = {"chat": "tiny_chats.jsonl", "preference": "tiny_preferences.jsonl"}
"""``data.build_tiny_corpus``: the synthetic input written in the cache dir per ``data.format`` (text:
``tiny_corpus.jsonl``)."""


class PackedLoader:
    """Iterable of this rank's batches (see :func:`usp.data.batch.collate_rows` for the item layout).

    Every batch also carries ``row_index``: per sample, the global index of its row in ``dataset`` (the
    same on every sp rank of a dp group; e.g. the key of per-row cached values such as DPO reference
    log-probabilities). Preference rows add ``document_roles`` and ``document_index``.

    Args:
        dataset: packed rows (``input_ids``, ``document_lengths``, ``first_position``).
        indices: the rows of ``dataset`` this loader serves (its split), ``int64 [N]``.
        micro_batch_size: rows per dp rank per step (``B``).
        seed: shuffle seed (the order of epoch ``e`` is a permutation drawn from ``(seed, e)``).
        dp_rank, dp_degree: this rank's data-parallel coordinate.
        mesh: the sp layout used to slice each row (``None``: no slicing, one process).
        document_masking: labels/positions/cu_seqlens per document (see ``collate_rows``).
        infinite: endless shuffled epochs (training) or one ordered pass per ``iter()`` (validation).
        tokens_dropped: tokens of the corpus this loader never yields (reported, not used).
    """

    def __init__(
        self,
        dataset: Dataset,
        indices: np.ndarray,
        *,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        mesh: SPMesh | None = None,
        document_masking: bool = True,
        infinite: bool = True,
        tokens_dropped: int = 0,
    ) -> None:
        assert 0 <= dp_rank < dp_degree and micro_batch_size >= 1
        self.dataset = dataset.with_format("numpy")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.mesh = mesh
        self.document_masking = document_masking
        self.infinite = infinite
        self.samples_per_step = dp_degree * micro_batch_size
        if len(self.indices) < self.samples_per_step:
            raise ValueError(
                f"only {len(self.indices)} rows for one step of dp_degree x micro_batch_size = "
                f"{self.samples_per_step}; prepare more data, lower trainer.micro_batch_size, or lower "
                "data.validation_fraction."
            )
        self._consumed = 0  # samples of the stream consumed by all dp ranks together
        self._perm_cache: tuple[int, np.ndarray] | None = None
        self.tokens_dropped = tokens_dropped
        if not infinite:
            self.tokens_dropped += (len(self.indices) % self.samples_per_step) * self.seq_len

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    @property
    def seq_len(self) -> int:
        return len(self.dataset[int(self.indices[0])]["input_ids"])

    @property
    def steps_per_epoch(self) -> int:
        """Steps for one pass over the rows (validation: exactly the steps of one ``iter()``)."""
        return self.num_samples // self.samples_per_step

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("the training loader is endless; use steps_per_epoch")
        return self.steps_per_epoch

    def _row_index(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.num_samples)
        if not self.infinite:
            return int(self.indices[offset])
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (
                epoch,
                np.random.default_rng([self.seed, epoch]).permutation(self.num_samples),
            )
        return int(self.indices[self._perm_cache[1][offset]])

    def sample_ids(self, step_start: int) -> list[int]:
        """Dataset rows this rank reads for the step that starts at stream position ``step_start``."""
        first = step_start + self.dp_rank * self.micro_batch_size
        return [self._row_index(first + j) for j in range(self.micro_batch_size)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            if not self.infinite and self._consumed + self.samples_per_step > self.num_samples:
                self._consumed = 0  # the next iter() is a fresh pass
                return
            ids = self.sample_ids(self._consumed)
            rows = [self.dataset[i] for i in ids]
            self._consumed += self.samples_per_step
            yield collate_rows(rows, mesh=self.mesh, document_masking=self.document_masking, row_indices=ids)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "samples_consumed": self._consumed,
            "epoch": self._consumed // self.num_samples,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last sample recorded in ``state`` (same rows and seed required)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r} is not {STATE_VERSION}.")
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data loader state was made for {state['num_samples']} rows with seed "
                f"{state['seed']}, but this run has {self.num_samples} rows with seed {self.seed}: the data, "
                "data.validation_fraction or the seed changed. Resume with the same data and seeds, or start "
                "a fresh run."
            )
        self._consumed = int(state["samples_consumed"])


def _run_once_on_rank0(fn: Callable[[], Path]) -> Path:
    """Run ``fn`` on global rank 0, share its result (or its error) with every rank.

    Collective: one ``broadcast_object_list`` that every rank reaches (``fn`` runs on rank 0 only, so a
    check that fails on one rank cannot leave the others waiting in another collective). Afterwards each
    rank checks that it can read the path; that may fail on some ranks only (the caller, e.g. the trainer's
    ``on_every_rank``, shares such errors).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    payload = on_rank0(lambda: str(fn()), "data preparation")
    path = Path(payload)
    if not is_prepared_dataset(path):
        raise ValueError(
            f"rank {dist.get_rank()} cannot read the prepared data at {path} that rank 0 found: it must be on a "
            "filesystem shared by all nodes (data.prepared_path, or data.cache_dir / the run's cache dir for "
            "on-the-fly preparation)."
        )
    return path


def _shaping(cfg: DataConfig) -> LengthShaping:
    return LengthShaping(
        min_doc_tokens=cfg.min_doc_tokens,
        long_doc_threshold=cfg.long_doc_threshold,
        long_doc_factor=cfg.long_doc_factor,
    )


def _resolve_prepared(
    cfg: DataConfig, *, tokenizer: Any, seq_len: int, cache_dir: Path, shared_prompt: bool = False
) -> Path:
    """The packed dataset to train on: ``prepared_path``, a prepared input, or an on-the-fly cache entry.

    Every check that reads the filesystem runs inside the rank-0 function (inputs may exist on node 0 only),
    so all ranks reach the same broadcast whatever fails.
    """
    shaping = _shaping(cfg)
    hf_cache = cfg.cache_dir or str(cache_dir / "hf_datasets")

    def resolve() -> Path:
        if cfg.prepared_path:
            if not is_prepared_dataset(cfg.prepared_path):
                raise ValueError(
                    f"data.prepared_path={cfg.prepared_path!r} is not a usp-prepare-data output (a directory "
                    "with input_ids and document_lengths). Run usp-prepare-data --output there, or fix the path."
                )
            return Path(cfg.prepared_path)
        if len(cfg.inputs) == 1 and is_prepared_dataset(cfg.inputs[0]):
            return Path(cfg.inputs[0])
        inputs = list(cfg.inputs)
        tiny = not inputs and cfg.build_tiny_corpus
        if tiny:
            inputs = [str(cache_dir / TINY_INPUTS.get(cfg.format, "tiny_corpus.jsonl"))]
        else:
            check_inputs(inputs, cfg.weights)
        check_tokenizer(tokenizer, setting="model.path")
        if tiny and not Path(inputs[0]).exists():
            from usp.tiny import build_tiny_chats, build_tiny_corpus

            if cfg.format == "chat":
                build_tiny_chats(inputs[0], seed=cfg.seed)
            elif cfg.format == "preference":
                from usp.data.preference import build_tiny_preferences

                build_tiny_preferences(inputs[0], seed=cfg.seed)
            else:
                build_tiny_corpus(inputs[0], seed=cfg.seed, text_field=cfg.text_field)
        if cfg.format in ("chat", "preference"):
            return _prepare_with_options(
                cfg,
                inputs,
                tokenizer=tokenizer,
                seq_len=seq_len,
                cache_dir=cache_dir,
                hf_cache=hf_cache,
                shared_prompt=shared_prompt,
            )
        key = preparation_key(
            inputs,
            tokenizer=tokenizer,
            seq_len=seq_len,
            text_field=cfg.text_field,
            weights=cfg.weights,
            seed=cfg.seed,
            streaming=cfg.streaming,
            shaping=shaping,
        )
        entry = cache_dir / "packed" / f"seq{seq_len}-{key}"
        return _prepare_entry(
            cfg,
            entry,
            "data",
            prepare_dataset,
            inputs,
            tokenizer,
            seq_len,
            hf_cache,
            text_field=cfg.text_field,
            shaping=shaping,
        )

    return _run_once_on_rank0(resolve)


def chat_options(cfg: DataConfig) -> Any:
    """The chat settings of ``cfg`` (``data.format=chat``) as :class:`usp.data.chat_prepare.ChatOptions`."""
    from usp.data.chat_prepare import ChatOptions

    return ChatOptions(
        messages_field=cfg.messages_field,
        chat_template=cfg.chat_template,
        loss_on=cfg.loss_on or "assistant",
        long_conversations=cfg.long_conversations,
        split_long_conversations=cfg.split_long_conversations,
    )


def preference_options(cfg: DataConfig, shared_prompt: bool = False) -> Any:
    """The preference settings of ``cfg`` (``data.format=preference``) as
    :class:`usp.data.preference_prepare.PreferenceOptions`: the columns are ``prompt``, ``chosen`` and
    ``rejected`` (other names: prepare with ``usp-prepare-data --prompt-field ...``); ``data.chat_template``
    renders chat-form rows; ``shared_prompt`` (``trainer.dpo.shared_prompt``) lays each prompt out once."""
    from usp.data.preference_prepare import PreferenceOptions

    return PreferenceOptions(chat_template=cfg.chat_template, shared_prompt=shared_prompt)


def _prepare_with_options(
    cfg: DataConfig,
    inputs: list[str],
    *,
    tokenizer: Any,
    seq_len: int,
    cache_dir: Path,
    hf_cache: str,
    shared_prompt: bool = False,
) -> Path:
    """On-the-fly ``--format chat`` or ``preference`` preparation into ``cache_dir/packed/<format>-seq<S>-<key>``
    (the key covers the format's settings and template; reused when there)."""
    if cfg.format == "chat":
        from usp.data.chat_prepare import chat_preparation_key as key_of
        from usp.data.chat_prepare import prepare_chat_dataset as prepare

        options, what = chat_options(cfg), "conversations"
    else:
        from usp.data.preference_prepare import preference_preparation_key as key_of
        from usp.data.preference_prepare import prepare_preference_dataset as prepare

        options, what = preference_options(cfg, shared_prompt), "preference pairs"
    options.check()
    key = key_of(inputs, tokenizer, seq_len, options, cfg.weights, cfg.seed, cfg.streaming, None)
    entry = cache_dir / "packed" / f"{cfg.format}-seq{seq_len}-{key}"
    return _prepare_entry(cfg, entry, what, prepare, inputs, tokenizer, seq_len, hf_cache, options=options)


def _prepare_entry(
    cfg: DataConfig,
    entry: Path,
    what: str,
    prepare: Callable[..., Any],
    inputs: list[str],
    tokenizer: Any,
    seq_len: int,
    hf_cache: str,
    **settings: Any,
) -> Path:
    """The cache entry ``entry``: reused when it holds prepared rows (logged, naming ``what``), else written by
    ``prepare`` with the data settings of ``cfg`` and the format's ``settings``."""
    if is_prepared_dataset(entry):
        logger.info("reusing prepared %s at %s", what, entry)
        return entry
    prepare(
        inputs,
        tokenizer=tokenizer,
        seq_len=seq_len,
        output=entry,
        weights=cfg.weights,
        seed=cfg.seed,
        streaming=cfg.streaming,
        num_proc=cfg.num_proc,
        cache_dir=hf_cache,
        log=logger.info,
        **settings,
    )
    return entry


def check_tokenizer_matches(path: Path, tokenizer: Any, setting: str) -> None:
    """Raise ``ValueError`` if the rows at ``path`` were tokenized with another tokenizer than ``tokenizer``.

    Uses ``max_token_id`` and ``tokenizer_identity`` from ``usp_prepare.json``; outputs of older versions
    without them are accepted with a warning.
    """
    extra = read_stats(path).get("extra", {})
    fix = (
        f"Re-run usp-prepare-data with --tokenizer set to model.path, or point {setting} / model.path at "
        "matching data and checkpoint."
    )
    max_id = extra.get("max_token_id")
    if max_id is not None and max_id >= len(tokenizer):
        raise ValueError(
            f"{setting}={str(path)!r} holds token id {max_id}, but the tokenizer of model.path has only "
            f"{len(tokenizer)} ids: the data was prepared with another tokenizer. {fix}"
        )
    stored = extra.get("tokenizer_identity")
    if stored is None or max_id is None:
        logger.warning(
            "%s=%s records no tokenizer fingerprint (prepared by an older version): cannot check that it "
            "matches model.path's tokenizer",
            setting,
            path,
        )
        return
    current = tokenizer_identity(tokenizer)
    differ = {k: (v, current.get(k)) for k, v in stored.items() if current.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: data {a!r} vs model {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"{setting}={str(path)!r} was prepared with another tokenizer than model.path's ({detail}). {fix}"
        )


def _check_loss_mask(cfg: DataConfig, path: Path, columns: list[str], shared_prompt: bool = False) -> None:
    """Chat settings need rows with ``loss_mask``; rows with it need document masking; preference settings
    need rows with ``document_roles``, and such rows need preference settings; ``trainer.dpo.shared_prompt``
    needs rows with ``shared_prefix`` (``--shared-prompt``), and such rows need it."""
    has_mask, has_roles = "loss_mask" in columns, "document_roles" in columns
    has_prefix = "shared_prefix" in columns
    if shared_prompt and cfg.format == "preference" and has_roles and not has_prefix:
        raise ValueError(
            f"trainer.dpo.shared_prompt=true but the preference pairs at {str(path)!r} were prepared with each "
            "prompt twice ([prompt + chosen] [prompt + rejected]). Prepare them with usp-prepare-data --format "
            "preference --shared-prompt, or set trainer.dpo.shared_prompt=false."
        )
    if has_prefix and not shared_prompt:
        raise ValueError(
            f"the preference pairs at {str(path)!r} were prepared with --shared-prompt (each prompt once, the "
            "rejected completion linked to it); set trainer.dpo.shared_prompt=true to train on them, or prepare "
            "them without --shared-prompt."
        )
    if cfg.format == "preference" and not has_roles:
        held = "conversations" if has_mask else "text documents"
        raise ValueError(
            f"data.format=preference but the prepared data at {str(path)!r} has no document_roles column (it "
            f"holds {held}). Prepare it with usp-prepare-data --format preference, or set data.format to "
            f"{'chat' if has_mask else 'text'}."
        )
    if has_roles and cfg.format != "preference":
        raise ValueError(
            f"the prepared data at {str(path)!r} holds preference pairs (document_roles: chosen and rejected "
            f"completions), but data.format={cfg.format}: training on them as {cfg.format} data would learn the "
            "rejected completions too. Set data.format=preference (with trainer.objective=dpo)."
        )
    if cfg.format == "chat" and not has_mask:
        raise ValueError(
            f"data.format=chat but the prepared data at {str(path)!r} has no loss_mask column (it holds text "
            "documents). Prepare it with usp-prepare-data --format chat, or set data.format=text."
        )
    if has_mask and not cfg.document_masking:
        raise ValueError(
            f"the prepared data at {str(path)!r} holds conversations (loss_mask) packed with padding; it needs "
            "data.document_masking=true."
        )


def split_rows(
    num_rows: int, validation_fraction: float, seed: int, min_rows: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted row indices ``(train, val)``; ``val`` is ``round(fraction * num_rows)`` seeded rows.

    With ``validation_fraction > 0``, at least ``min_rows`` rows are held out (a small fraction of a modest
    corpus would otherwise round to none), as long as at least as many remain for training; otherwise
    ``ValueError``.
    """
    n_val = int(round(validation_fraction * num_rows)) if validation_fraction > 0 else 0
    if validation_fraction > 0 and n_val < min_rows:
        if num_rows - min_rows < min_rows:
            raise ValueError(
                f"data.validation_fraction={validation_fraction} asks for a validation split, but the data has "
                f"only {num_rows} rows: holding out {min_rows} (one validation step) would leave fewer than "
                f"that for training. Set data.validation_fraction=0 or prepare more data."
            )
        logger.info(
            "data.validation_fraction=%s of %d rows rounds to %d; holding out %d rows (one validation step)",
            validation_fraction,
            num_rows,
            n_val,
            min_rows,
        )
        n_val = min_rows
    perm = np.random.default_rng([seed, 0x5EED]).permutation(num_rows)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def build_dataloaders(
    cfg: DataConfig,
    *,
    tokenizer: Any,
    seq_len: int,
    mesh: SPMesh | None,
    micro_batch_size: int,
    seed: int,
    cache_dir: str | os.PathLike,
    shared_prompt: bool = False,
) -> tuple[PackedLoader, PackedLoader | None]:
    """Train and validation loaders for this rank (validation ``None`` when ``validation_fraction == 0``).

    Preparation (tokenize + pack, when the inputs are not already prepared) runs once, on global rank 0,
    into ``cache_dir/packed/<hash>``; the other ranks wait for it and read the same memory-mapped rows.
    ``cfg.seed`` decides the data (mixing, upsampling, validation split); ``seed`` decides the training
    order. Raises ``ValueError`` for a ``seq_len`` that does not suit ``mesh`` before any tokenization.
    ``shared_prompt`` (``trainer.dpo.shared_prompt``): preference pairs laid out with each prompt once
    (prepared so on the fly; prepared data must hold that layout).
    """
    if mesh is not None:
        check_sequence_length(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
    elif seq_len < 1:
        raise ValueError(f"trainer.seq_len={seq_len} must be a positive number of tokens.")
    if micro_batch_size < 1:
        raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must be >= 1.")
    if not 0.0 <= cfg.validation_fraction < 1.0:
        raise ValueError(f"data.validation_fraction={cfg.validation_fraction} must be in [0, 1).")
    if not cfg.inputs and not cfg.prepared_path and not cfg.build_tiny_corpus:
        raise ValueError(
            "no data: set data.inputs (files or hub names), data.prepared_path (a usp-prepare-data output), "
            "or data.build_tiny_corpus=true for the synthetic demo corpus."
        )
    cache_dir = Path(cache_dir)
    path = _resolve_prepared(
        cfg, tokenizer=tokenizer, seq_len=seq_len, cache_dir=cache_dir, shared_prompt=shared_prompt
    )
    dataset = load_from_disk(str(path))
    row_len = len(dataset[0]["input_ids"])
    if row_len != seq_len:
        raise ValueError(
            f"the prepared data at {str(path)!r} has rows of {row_len} tokens but trainer.seq_len={seq_len}. "
            f"Re-run usp-prepare-data with --seq-len {seq_len}, or set trainer.seq_len={row_len}."
        )
    dp_rank, dp_degree = (mesh.dp_rank, mesh.dp_degree) if mesh is not None else (0, 1)
    _check_loss_mask(cfg, path, list(dataset.column_names), shared_prompt)
    setting = "data.prepared_path" if cfg.prepared_path else "data.inputs"
    check_tokenizer_matches(path, tokenizer, setting)
    need = dp_degree * micro_batch_size
    train_rows, val_rows = split_rows(len(dataset), cfg.validation_fraction, cfg.seed, min_rows=need)
    common = dict(
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        mesh=mesh,
        document_masking=cfg.document_masking,
    )
    tail = int(read_stats(path).get("tokens_dropped", 0))
    train = PackedLoader(dataset, train_rows, seed=seed, infinite=True, tokens_dropped=tail, **common)
    assert cfg.validation_fraction == 0 or len(val_rows) >= need
    val = None
    if len(val_rows):
        val = PackedLoader(dataset, val_rows, seed=seed, infinite=False, **common)
    logger.info(
        "data: %d rows x %d tokens from %s (%d train, %d validation); %d tail tokens dropped in preparation",
        len(dataset),
        seq_len,
        path,
        len(train_rows),
        len(val_rows),
        tail,
    )
    return train, val
