"""The ``usp-prepare-data`` command line: parse the flags, then call :func:`usp.data.prepare.prepare_dataset`
(text), :func:`usp.data.chat_prepare.prepare_chat_dataset` (``--format chat``) or
:func:`usp.data.preference_prepare.prepare_preference_dataset` (``--format preference``) with plain arguments.

Examples and what the output holds: :mod:`usp.data.prepare`; conversations: :mod:`usp.data.chat_prepare`;
preference pairs: :mod:`usp.data.preference_prepare`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from usp.data.chat_prepare import ChatOptions, prepare_chat_dataset
from usp.data.pack import LengthShaping
from usp.data.preference_prepare import PreferenceOptions, prepare_preference_dataset
from usp.data.prepare import prepare_dataset
from usp.data.tokenize import load_tokenizer
from usp.errors import guarded, pop_verbose
from usp.modes import DATA_FORMATS, LONG_CONVERSATIONS, LOSS_ON, RING_LAYOUTS
from usp.parallel import check_sequence_length
from usp.units import parse_seq_len


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="usp-prepare-data",
        description="Tokenize and pack a corpus into fixed-length rows for long-context training.",
    )
    p.add_argument(
        "--input",
        action="extend",
        nargs="+",
        required=True,
        help="file, glob, saved dataset dir or hub name (owner/name[:config]); several after one --input (a glob "
        "the shell expanded) or --input repeated: one source each",
    )
    p.add_argument(
        "--text-field",
        nargs="+",
        default=["text"],
        help="column holding the document text (default: text); several names: one per --input, in order",
    )
    p.add_argument("--tokenizer", required=True, help="checkpoint or tokenizer directory")
    p.add_argument(
        "--seq-len", type=parse_seq_len, required=True, help="tokens per packed row (131072, 128K, 1M)"
    )
    p.add_argument("--output", required=True, help="directory to write (datasets.save_to_disk layout)")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--weights", type=float, nargs="+", help="mixing weights, one per --input")
    p.add_argument("--seed", type=int, default=0, help="seed for mixing and upsampling (default 0)")
    p.add_argument(
        "--streaming",
        action="store_true",
        help="read inputs as streams (corpora bigger than memory "
        "or disk for a full download); tokenizes in this process",
    )
    p.add_argument("--cache-dir", help="datasets cache for raw inputs and hub downloads")
    p.add_argument("--min-doc-tokens", type=int, default=0, help="drop documents shorter than this")
    p.add_argument(
        "--long-doc-threshold", type=int, help="documents with at least this many tokens are upsampled"
    )
    p.add_argument("--long-doc-factor", type=float, default=1.0, help="expected copies of each long document")
    p.add_argument("--max-documents", type=int, help="use only the first N documents (a quick sample)")
    p.add_argument(
        "--no-bos",
        action="store_true",
        help="do not prepend BOS to each document, or to text-form preference pairs (EOS is always added)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing usp-prepare-data output")
    p.add_argument(
        "--skip-non-text",
        action="store_true",
        help="drop (and count) rows whose text field is not a string, instead of stopping with the first one",
    )
    chat = p.add_argument_group("conversations (--format chat; docs/data.md, 'Chat data')")
    chat.add_argument(
        "--format",
        default="text",
        choices=list(DATA_FORMATS),
        help="text documents, conversations, or preference pairs (DPO)",
    )
    chat.add_argument(
        "--messages-field", default="messages", help="column holding the [{role, content}] list"
    )
    chat.add_argument(
        "--chat-template",
        help="Jinja chat template file (or a shipped one: chatml, tiny_chatml); also for chat-form preference pairs",
    )
    chat.add_argument("--loss-on", default="assistant", help=f"target tokens: {', '.join(LOSS_ON)}")
    chat.add_argument(
        "--long-conversations",
        default="truncate",
        choices=list(LONG_CONVERSATIONS),
        help="a conversation longer than --seq-len: keep its first tokens, or drop it",
    )
    chat.add_argument(
        "--split-long-conversations",
        action="store_true",
        help="cut conversations longer than --seq-len across rows instead",
    )
    pref = p.add_argument_group("preference pairs (--format preference; docs/data.md, 'Preference data')")
    pref.add_argument("--prompt-field", default="prompt", help="column holding the prompt (default: prompt)")
    pref.add_argument(
        "--chosen-field", default="chosen", help="column holding the preferred completion (default: chosen)"
    )
    pref.add_argument(
        "--rejected-field",
        default="rejected",
        help="column holding the dispreferred completion (default: rejected)",
    )
    pref.add_argument(
        "--shared-prompt",
        action="store_true",
        help="lay each pair out with its prompt once, [prompt + chosen | rejected] (trainer.dpo.shared_prompt)",
    )
    p.add_argument("--ring-degree", type=int, default=1, help="check --seq-len suits this training layout")
    p.add_argument("--ulysses-degree", type=int, default=1, help="check --seq-len suits this training layout")
    p.add_argument("--ring-layout", default="balanced", choices=list(RING_LAYOUTS), help="(for the check)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``usp-prepare-data``: a bad flag gets argparse's usage; a data error is one ``usp-prepare-data: error:``
    line alone (:func:`usp.errors.report`; its traceback with ``--verbose``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = pop_verbose(argv)
    args = build_parser().parse_args(argv)
    return guarded("usp-prepare-data", lambda: _run(args), verbose=verbose)


def _run(args: argparse.Namespace) -> int:
    """The parsed flags as the library's arguments; the work itself is :func:`prepare_dataset`,
    :func:`prepare_chat_dataset` or :func:`prepare_preference_dataset`."""
    check_sequence_length(
        args.seq_len, args.ring_degree, args.ulysses_degree, args.ring_layout, setting="--seq-len"
    )
    shaping = LengthShaping(args.min_doc_tokens, args.long_doc_threshold, args.long_doc_factor)
    tokenizer = load_tokenizer(args.tokenizer)
    common = dict(
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        output=args.output,
        weights=args.weights,
        seed=args.seed,
        streaming=args.streaming,
        num_proc=args.num_proc,
        cache_dir=args.cache_dir,
        max_documents=args.max_documents,
        overwrite=args.overwrite,
    )
    if args.format == "chat":
        options = ChatOptions(
            messages_field=args.messages_field,
            chat_template=args.chat_template,
            loss_on=args.loss_on,
            long_conversations=args.long_conversations,
            split_long_conversations=args.split_long_conversations,
        )
        prepare_chat_dataset(args.input, options=options, **common)
        return 0
    if args.format == "preference":
        prefs = PreferenceOptions(
            prompt_field=args.prompt_field,
            chosen_field=args.chosen_field,
            rejected_field=args.rejected_field,
            chat_template=args.chat_template,
            add_bos=not args.no_bos,
            shared_prompt=args.shared_prompt,
        )
        prepare_preference_dataset(args.input, options=prefs, **common)
        return 0
    prepare_dataset(
        args.input,
        text_field=args.text_field[0] if len(args.text_field) == 1 else args.text_field,
        shaping=shaping,
        add_bos=not args.no_bos,
        skip_non_text=args.skip_non_text,
        **common,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
