"""The long-context data pipeline: sources -> tokenized documents -> packed rows -> sharded, resumable batches.

``usp-prepare-data`` (:mod:`usp.data.cli`; the work in :mod:`usp.data.prepare`) writes packed rows once
(``--format chat``: conversations with a ``loss_mask``, :mod:`usp.data.chat_prepare`; ``--format
preference``: DPO pairs with ``document_roles``, :mod:`usp.data.preference_prepare`; all publish through
:mod:`usp.data.prepared`); :func:`build_dataloaders` serves them to every rank (and prepares small corpora on
the fly with the same code).
"""

from usp.data.batch import (
    IGNORE_INDEX,
    collate_rows,
    cu_seqlens_of,
    document_index_of,
    row_labels,
    row_positions,
)
from usp.data.chat import ChatRenderer, conversation_of
from usp.data.chat_prepare import ChatOptions, prepare_chat_dataset
from usp.data.loader import PackedLoader, build_dataloaders, split_rows
from usp.data.pack import PACKED_FEATURES, LengthShaping, PackStats, pack_documents
from usp.data.pack_chat import CHAT_PACKED_FEATURES, LOSS_MASK_COLUMN, pack_conversations
from usp.data.pack_preference import (
    DOCUMENT_ROLES_COLUMN,
    PREFERENCE_PACKED_FEATURES,
    ROLE_CHOSEN,
    ROLE_PADDING,
    ROLE_REJECTED,
    pack_preference_pairs,
)
from usp.data.preference import PreferenceEncoder, build_tiny_preferences, preference_pair_of
from usp.data.preference_prepare import PreferenceOptions, prepare_preference_dataset
from usp.data.prepare import prepare_dataset
from usp.data.prepared import PreparedData, read_stats
from usp.data.sources import is_prepared_dataset, load_text_sources
from usp.data.tokenize import check_tokenizer, load_tokenizer, tokenize_documents

__all__ = [
    "CHAT_PACKED_FEATURES",
    "DOCUMENT_ROLES_COLUMN",
    "IGNORE_INDEX",
    "LOSS_MASK_COLUMN",
    "ChatOptions",
    "ChatRenderer",
    "PACKED_FEATURES",
    "PREFERENCE_PACKED_FEATURES",
    "ROLE_CHOSEN",
    "ROLE_PADDING",
    "ROLE_REJECTED",
    "PreferenceEncoder",
    "PreferenceOptions",
    "LengthShaping",
    "PackStats",
    "PackedLoader",
    "PreparedData",
    "build_dataloaders",
    "build_tiny_preferences",
    "check_tokenizer",
    "collate_rows",
    "conversation_of",
    "cu_seqlens_of",
    "document_index_of",
    "is_prepared_dataset",
    "load_text_sources",
    "load_tokenizer",
    "pack_conversations",
    "pack_documents",
    "pack_preference_pairs",
    "prepare_chat_dataset",
    "prepare_dataset",
    "prepare_preference_dataset",
    "preference_pair_of",
    "read_stats",
    "row_labels",
    "row_positions",
    "split_rows",
    "tokenize_documents",
]
