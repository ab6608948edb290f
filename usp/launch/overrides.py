"""Hydra overrides as ``usp-launch`` reads them: through Hydra's own override parser, never by splitting on ``=``.

The launcher reads only a few things from the command line itself: whether a word is an override at all,
whether the user set a key (``--cpu`` adds ``trainer.device=cpu`` unless the user set it), the job size a
``cluster.*`` override gives, and, when Hydra flags after ``--`` stop it from composing the run config, the
degrees the command line sets. Everything else comes from the composed run config (:mod:`usp.launch.common`),
and every degree rule from :class:`usp.parallel.ParallelLayout` (:mod:`usp.launch.preflight`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Parse ``overrides`` with Hydra's grammar (``key=value``, ``+key=value``, ``++key=value``, ``~key[=value]``,
    ``group=option``, quoted strings, lists, dicts, interpolations).

    Raises:
        ValueError: naming the first word that is an option rather than an override, that Hydra cannot
            parse, or whose key is empty, with the expected form.
    """
    for word in overrides:
        if word.startswith("-"):
            raise ValueError(
                f"unknown option {word!r}: see `usp-launch --help` for the options (Hydra overrides are key=value)."
            )
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        lines = str(exc).splitlines()[:-1]  # without Hydra's link to its grammar
        why = " ".join(
            ln.strip() for ln in lines if ln.strip() and not ln.startswith("Error parsing override")
        )
        raise ValueError(
            f"{exc.override!r} is not a Hydra override ({why}): write key=value "
            f"(e.g. recipe=tiny, parallel.ring_degree=2; quote a value with spaces or commas)."
        ) from exc
    for word, override in zip(overrides, parsed):
        if not override.key_or_group:
            raise ValueError(f"{word!r} has an empty key: write key=value (e.g. trainer.max_steps=100).")
    return parsed


def validate_override_syntax(overrides: Sequence[str]) -> None:
    """:func:`parse_overrides` for its errors only: every word is a Hydra override."""
    parse_overrides(overrides)


def override_key(override: str) -> str:
    """The config key (or group) an override sets: ``++a.b=1`` / ``+a.b=1`` / ``a.b=1`` / ``~a.b`` -> ``a.b``."""
    return parse_overrides([override])[0].key_or_group


def overrides_among(words: Sequence[str]) -> list[Override]:
    """The words that are Hydra overrides, parsed, in order; options (``--cfg``) and the words Hydra cannot
    parse as an override (an option's value: ``job``) are skipped. For reading a command line that may carry
    Hydra's flags after ``--``; :func:`parse_overrides` is the strict form."""
    parser = OverridesParser.create()
    found = []
    for word in words:
        if word.startswith("-"):
            continue
        try:
            found.extend(parser.parse_overrides([word]))
        except OverrideParseException:
            continue
    return found


def _last_values(words: Sequence[str]) -> dict[str, Any]:
    """key -> the value its last override gives (None for a deletion ``~key``)."""
    return {o.key_or_group: None if o.is_delete() else o.value() for o in overrides_among(words)}


def find_override(overrides: Sequence[str], key: str) -> Any | None:
    """The value the last override setting ``key`` gives, as Hydra parses it (``2`` -> int, ``'2'`` -> str,
    ``[a,b]`` -> list, ``null`` -> None); None when no override sets it, or the last one deletes it (``~key``).
    Words that are not overrides are ignored (:func:`overrides_among`)."""
    return _last_values(overrides).get(key)


def has_override(overrides: Sequence[str], key: str) -> bool:
    """Whether any override sets, adds or deletes ``key`` (words that are not overrides are ignored)."""
    return any(override.key_or_group == key for override in overrides_among(overrides))


def check_degrees(overrides: Sequence[str], *, nodes: int, nproc_per_node: int) -> None:
    """The degrees ``overrides`` set, against ``nodes x nproc_per_node`` processes, when there is no composed
    run config to check (Hydra flags after ``--``, which may be among ``overrides``):
    :func:`usp.launch.preflight.check_known_degrees` on the values the command line gives; what it leaves
    unset, ``auto`` or not an integer is left to ``usp.train``.

    Raises:
        ValueError: from :class:`usp.parallel.ParallelLayout`, with the numbers and the fix.
    """
    from usp.launch.preflight import LAYOUT_FIELDS, check_known_degrees

    values = _last_values(overrides)
    given = {name: values.get(f"parallel.{name}") for name in LAYOUT_FIELDS}
    check_known_degrees(given, world_size=nodes * nproc_per_node, local_world_size=nproc_per_node)
