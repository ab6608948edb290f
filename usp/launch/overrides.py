"""Hydra override strings as the launcher sees them: plain ``key=value`` parsing and the degree checks.

The checks take overrides, so that a mistake on the command line is reported in the user's own words; the
launcher also runs them on the composed config's degrees (``usp.launch.cli.config_degrees``), so degrees a
recipe sets are checked too. Either way the most common mistake, degrees that do not fit the processes about
to be launched, is reported before anything is started or queued.
"""

from __future__ import annotations

from collections.abc import Sequence


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def override_key(override: str) -> str:
    """The config key an override sets: ``++a.b=1`` / ``+a.b=1`` / ``a.b=1`` / ``~a.b`` -> ``a.b``."""
    head = override.split("=", 1)[0]
    return head.lstrip("+~")


def validate_override_syntax(overrides: Sequence[str]) -> None:
    """Reject words that are not Hydra overrides (``key=value``, ``+key=value``, ``++key=value`` or ``~key``).

    Raises:
        ValueError: naming the bad word and the expected form.
    """
    for word in overrides:
        if word.startswith("-"):
            raise ValueError(
                f"unknown option {word!r}: see `usp-launch --help` for the options (Hydra overrides are key=value)."
            )
        if "=" not in word and not word.startswith("~"):
            raise ValueError(
                f"{word!r} is not a Hydra override: write key=value (e.g. recipe=tiny, parallel.ring_degree=2)."
            )
        if not override_key(word):
            raise ValueError(f"{word!r} has an empty key: write key=value (e.g. trainer.max_steps=100).")


def find_override(overrides: Sequence[str], key: str) -> str | None:
    """The value of the last override that sets ``key``, or None when the command line does not set it."""
    value = None
    for word in overrides:
        if "=" in word and override_key(word) == key:
            value = word.split("=", 1)[1]
    return value


def has_override(overrides: Sequence[str], key: str) -> bool:
    return any(override_key(word) == key for word in overrides)


def _degree(overrides: Sequence[str], key: str) -> int | None:
    """An integer degree from the command line; None when absent or ``auto`` (left to the planner)."""
    raw = find_override(overrides, key)
    if raw is None:
        return None
    text = raw.strip().strip("'\"")
    if text.lower() in ("auto", "null", "~"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 and not (key == "parallel.dp_degree" and value == -1):
        allowed = "an integer >= 1, or -1 for the remaining ranks" if key == "parallel.dp_degree" else (
            "an integer >= 1, or auto"
        )
        raise ValueError(f"{key}={raw} is invalid: use {allowed}.")
    return value


DEGREE_KEYS = ("parallel.ulysses_degree", "parallel.ring_degree", "parallel.dp_degree", "parallel.node_size")


def check_degree_values(overrides: Sequence[str]) -> None:
    """Each degree the command line sets is an integer >= 1 (``auto`` for ulysses/ring, -1 for dp).

    Raises:
        ValueError: naming the setting and the values it accepts.
    """
    for key in DEGREE_KEYS:
        _degree(overrides, key)


def check_degrees(overrides: Sequence[str], *, nodes: int, nproc_per_node: int) -> None:
    """Check the degrees given as integer overrides against ``nodes x nproc_per_node`` processes.

    Checks, for whatever the command line sets (``auto`` and absent keys are accepted as-is):

    - ``parallel.ulysses_degree x parallel.ring_degree`` divides the world size ``nodes * nproc_per_node``;
    - ``parallel.dp_degree`` (when not -1) times that product equals the world size;
    - ``parallel.node_size`` (default: ``nproc_per_node``, what ``LOCAL_WORLD_SIZE`` will be) divides the world;
    - ``parallel.ulysses_degree`` divides the node size, so Ulysses groups stay inside a node (unless
      ``parallel.allow_cross_node_ulysses=true``).

    Raises:
        ValueError: with the numbers and the fix.
    """
    world = nodes * nproc_per_node
    where = f"{nodes} node(s) x {nproc_per_node} process(es) per node = {world} ranks"
    ulysses = _degree(overrides, "parallel.ulysses_degree")
    ring = _degree(overrides, "parallel.ring_degree")
    dp = _degree(overrides, "parallel.dp_degree")
    node_size = _degree(overrides, "parallel.node_size")

    given = {k: v for k, v in (("ulysses_degree", ulysses), ("ring_degree", ring)) if v is not None}
    product = 1
    for value in given.values():
        product *= value
    if world % product != 0:
        terms = " x ".join(f"parallel.{k}={v}" for k, v in given.items())
        if len(given) > 1:
            terms += f" = {product}"
        raise ValueError(
            f"{terms} does not divide the world size: {where}. "
            f"Choose degrees whose product divides {world} (divisors: {_divisors(world)}), "
            f"or launch another number of processes (--nodes, --nproc-per-node)."
        )
    if dp is not None and dp != -1 and ulysses is not None and ring is not None and dp * product != world:
        raise ValueError(
            f"parallel.dp_degree={dp} x ulysses_degree={ulysses} x ring_degree={ring} = {dp * product} "
            f"!= {where}. Set parallel.dp_degree={world // product} or -1 (the remaining ranks)."
        )
    if node_size is not None and world % node_size != 0:
        raise ValueError(
            f"parallel.node_size={node_size} does not divide the world size: {where}. "
            f"Use one of {_divisors(world)}, or leave it unset to use LOCAL_WORLD_SIZE={nproc_per_node}."
        )
    node = node_size if node_size is not None else nproc_per_node
    cross_node = (find_override(overrides, "parallel.allow_cross_node_ulysses") or "").lower() == "true"
    if ulysses is not None and node % ulysses != 0 and not cross_node:
        origin = "parallel.node_size" if node_size is not None else "ranks per node (LOCAL_WORLD_SIZE)"
        raise ValueError(
            f"parallel.ulysses_degree={ulysses} does not divide the {origin} = {node}: Ulysses groups would "
            f"span nodes (all-to-all over the network). Use a ulysses_degree in {_divisors(node)} and put the "
            f"rest in parallel.ring_degree, or set parallel.allow_cross_node_ulysses=true if you mean it."
        )
