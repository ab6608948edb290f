"""Hybrid models' token mixers that are not softmax attention, made exact under sequence parallelism.

A recurrent mixer (gated DeltaNet, Mamba / Mamba2) carries a state from every token to the next, and a short
causal convolution reads the ``K - 1`` tokens before each token: on a rank's slice of the sequence (zigzag,
balanced, several runs of positions), running them as if the slice were the whole sequence is wrong. usp wraps
each mixer module of a class in :data:`MIXER_SCHEMES` (the module is not replaced: same parameters, same state
dict keys) so that every rank gets exactly the unsharded mixer's outputs and gradients for its own tokens, with
each packed document run on its own (the state and the convolution window start fresh at a document boundary):

``gather`` (the other recurrent mixers)
    One differentiable all-gather over the sp group brings the whole sequence (``[B, S, hidden]``) to every
    rank, the mixer runs once per document in natural order, and the rank keeps its own tokens' outputs.
    Backward: each rank's gradient of its inputs is summed over the ranks (an all-to-all). Exact with every
    layout and mixer, transformers' own code on every rank; the cost is the price of that simplicity: each
    rank computes the mixer over all ``S`` tokens (``sp_degree`` x the work) and holds the mixer's activations
    for ``S`` tokens, and the all-gather sends ``(P - 1) * S/P * hidden`` elements per rank and layer. The
    planner counts both (docs/attention.md, "Hybrid layers").
``heads`` (gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba2: Bamba, Granite-4 hybrids, Nemotron-H, Falcon-H1)
    A head all-to-all: each rank runs every token of its share of the heads, ``S / P`` work and memory
    (:mod:`usp.model.gated_deltanet`, :mod:`usp.model.mamba2`); when the heads do not split over the ranks,
    the ``gather`` scheme.
``halo`` (short convolutions, receptive field ``K``)
    The output at position ``t`` depends on inputs ``t - K + 1 .. t`` only. Each rank sends the last ``K - 1``
    tokens of each of its runs of consecutive positions (one small all-gather), and runs the mixer on each run
    with the ``K - 1`` tokens before it prepended (fewer at a document start), dropping the prepended outputs.
    Work and memory stay ``S / P`` per rank; traffic is ``(P - 1) * runs * (K - 1) * hidden`` per rank.

Document boundaries arrive as the attention's do: the decoder passes the model call's ``cu_seq_lens_q`` (or
``cu_seqlens``), global int32 offsets, through to the mixer. Plans (which positions a rank holds, its runs, the
halo table) are cached per ``(length, mesh, boundaries)``: a training step computes each once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from usp.attention.comm import all_gather_dim1
from usp.model import gated_deltanet, mamba2
from usp.parallel import SPMesh
from usp.parallel.sequence import _token_indices

logger = logging.getLogger(__name__)

GATHER = "gather"
HALO = "halo"
HEADS = "heads"

MIXER_SCHEMES: dict[str, str] = {
    "Qwen3NextGatedDeltaNet": HEADS,
    "Qwen3_5GatedDeltaNet": HEADS,
    "OlmoHybridGatedDeltaNet": GATHER,
    "NemotronHMamba2Mixer": HEADS,
    "FalconH1Mixer": HEADS,
    "BambaMixer": HEADS,
    "GraniteMoeHybridMambaLayer": HEADS,
    "JambaMambaMixer": GATHER,
    "KimiLinearDeltaAttention": GATHER,
    "MiniMaxLightningAttention": GATHER,
    "Lfm2ShortConv": HALO,
    "Lfm2MoeShortConv": HALO,
}
"""transformers mixer classes usp runs exactly under sequence parallelism, and how (checked per family against
the unsharded model by ``tests/test_model_families.py``). Any other mixer is refused by the capability gate."""

_ATTENTION_SIGNATURE = {"MiniMaxLightningAttention"}
"""Mixers called like an attention module: ``forward(hidden_states, position_embeddings, attention_mask)``
returning ``(output, weights)``; the rest take ``hidden_states`` and return the output."""

_STATE_ATTR = "usp_mixer_state"


def _head_scheme(cls: type) -> tuple[Callable[[nn.Module, int], bool], Callable[..., torch.Tensor]]:
    """(whether the head all-to-all applies at an sp degree, its forward) for a ``heads`` mixer class."""
    module = gated_deltanet if cls.__name__.endswith("GatedDeltaNet") else mamba2
    return module.supports_heads, module.forward


def _attention_like(forward: Callable[..., object]) -> Callable[..., torch.Tensor]:
    def call(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return forward(module, hidden_states, None, None)[0]

    return call


@dataclass(frozen=True)
class MixerState:
    """What a wrapped mixer needs: the mesh, the scheme, the receptive field (``halo``) and the class's own
    ``forward``."""

    mesh: SPMesh
    scheme: str
    receptive_field: int
    base_forward: Callable[..., torch.Tensor]


def receptive_field(module: nn.Module) -> int:
    """Tokens a ``halo`` mixer's output reads (itself included): its causal convolution's kernel size."""
    conv = getattr(module, "conv", None)
    assert isinstance(conv, nn.Conv1d), f"{type(module).__name__}: no causal convolution named 'conv'"
    return int(conv.kernel_size[0])


def mixer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's non-attention token mixers of a class usp implements, by qualified name."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in MIXER_SCHEMES]


def _bounds(seq_len: int, cu: torch.Tensor | None) -> tuple[int, ...]:
    return (0, seq_len) if cu is None else tuple(int(b) for b in cu.tolist())


@lru_cache(maxsize=64)
def _plan(
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    sp_rank: int,
    ring_layout: str,
    bounds: tuple[int, ...],
    halo: int,
) -> dict[str, object]:
    """Where every sp rank's tokens sit (positions in sp-rank order), this rank's runs split at documents,
    and for ``halo > 0`` the tail slots each rank sends and where each run's halo is in the gathered tails."""
    cu = torch.tensor(bounds, dtype=torch.int32) if len(bounds) > 2 else None
    ranks = [
        _token_indices(seq_len, ring_degree, ulysses_degree, r, u, ring_layout, cu).numpy()
        for r in range(ring_degree)
        for u in range(ulysses_degree)
    ]
    order = np.concatenate(ranks)  # global position of each gathered slot, sp-rank order
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    edges = np.asarray(bounds)

    def runs(pos: np.ndarray) -> list[tuple[int, int]]:
        """Local index ranges ``[i, j)`` of consecutive positions."""
        cut = np.flatnonzero(np.diff(pos) != 1) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [pos.size]])
        return list(zip(starts.tolist(), ends.tolist()))

    tails = [[i for a, b in runs(pos) for i in range(max(a, b - halo), b)] if halo else [] for pos in ranks]
    width = max(len(t) for t in tails)
    slot = {int(ranks[r][i]): r * width + k for r, t in enumerate(tails) for k, i in enumerate(t)}
    mine = ranks[sp_rank]
    pieces = []  # (local i, local j, gathered-tail slots of the halo before it)
    for a, b in runs(mine):
        start = int(mine[a])
        inner = [int(e) for e in edges if start < e < start + (b - a)]  # document starts inside the run
        cuts = [a] + [a + (e - start) for e in inner] + [b]
        for i, j in zip(cuts[:-1], cuts[1:]):
            first = int(mine[i])
            doc_start = int(edges[np.searchsorted(edges, first, side="right") - 1])
            before = range(max(doc_start, first - halo), first) if halo else range(0)
            pieces.append((i, j, [slot[p] for p in before]))
    return {
        "order": torch.from_numpy(order),
        "inverse": torch.from_numpy(inverse),
        "local": torch.from_numpy(mine.copy()),
        "tail_slots": torch.tensor(tails[sp_rank], dtype=torch.long),
        "tail_width": width,
        "pieces": pieces,
    }


def _mesh_plan(mesh: SPMesh, seq_len: int, cu: torch.Tensor | None, halo: int) -> dict[str, object]:
    """:func:`_plan` for this rank (the layout reads the boundaries only under ``balanced``)."""
    return _plan(
        seq_len,
        mesh.ring_degree,
        mesh.ulysses_degree,
        mesh.sp_rank,
        mesh.ring_layout,
        _bounds(seq_len, cu),
        halo,
    )


def _gathered(module: nn.Module, state: MixerState, x: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    mesh = state.mesh
    seq_len = x.size(1) * mesh.sp_degree
    plan = _mesh_plan(mesh, seq_len, cu, 0)
    full = all_gather_dim1(x, mesh.sp_group, "mixer_gather")  # [B, S, hidden], sp-rank order
    full = full.index_select(1, plan["inverse"].to(x.device))  # [B, S, hidden], natural order
    bounds = _bounds(seq_len, cu)
    out = torch.cat(
        [state.base_forward(module, full[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1
    )  # [B, S, hidden]: each document from a fresh state
    return out.index_select(1, plan["local"].to(x.device))  # [B, S/P, hidden], this rank's tokens


def _haloed(module: nn.Module, state: MixerState, x: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    mesh = state.mesh
    seq_len = x.size(1) * mesh.sp_degree
    plan = _mesh_plan(mesh, seq_len, cu, state.receptive_field - 1)
    width = plan["tail_width"]
    tails = None
    if mesh.sp_degree > 1 and width:
        mine = x.index_select(1, plan["tail_slots"].to(x.device))  # [B, tails, hidden]
        mine = nn.functional.pad(mine, (0, 0, 0, width - mine.size(1)))  # [B, width, hidden]
        tails = all_gather_dim1(mine, mesh.sp_group, "mixer_halo")  # [B, P * width, hidden]
    outs = []
    for i, j, before in plan["pieces"]:
        piece = x[:, i:j]
        if before:
            halo = tails.index_select(1, torch.tensor(before, device=x.device))
            outs.append(state.base_forward(module, torch.cat([halo, piece], 1))[:, len(before) :])
        else:
            outs.append(state.base_forward(module, piece))
    out = torch.cat(outs, dim=1)  # [B, S/P, hidden] in local order
    if tails is not None and not any(before for _, _, before in plan["pieces"]):
        # this rank reads no halo, but the gather's backward is a collective every rank must join
        out = out + 0.0 * tails.sum()
    return out


def sequence_parallel_mixer_forward(
    self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    """A wrapped mixer's forward: ``hidden_states`` ``[B, S/P, hidden]`` (this rank's tokens, local order) ->
    the unsharded mixer's outputs at those tokens. No cache (training and prefill-free evaluation) and no
    padding mask (documents are packed, as for attention)."""
    state: MixerState = getattr(self, _STATE_ATTR)
    if kwargs.get("attention_mask") is not None or kwargs.get("mamba_attention_mask") is not None:
        raise ValueError(
            "apply_usp'd models take no attention_mask: pack documents and pass cu_seqlens instead."
        )
    cache = kwargs.get("cache", kwargs.get("cache_params", kwargs.get("past_key_values")))
    if cache is not None or any(a is not None for a in args):
        raise ValueError(
            f"{type(self).__name__} under apply_usp runs without a cache (use_cache=False): usp's decoding "
            "cache covers softmax attention only."
        )
    cu = _documents(kwargs)
    if (
        cu is None
    ):  # a decoder layer that does not hand its kwargs to the mixer (jamba): its pre-hook's record
        cu = getattr(self, _DOCUMENTS_ATTR, None)
    if state.scheme == HALO:
        out = _haloed(self, state, hidden_states, cu)
    elif state.scheme == HEADS:
        seq_len = hidden_states.size(1) * state.mesh.sp_degree
        plan = _mesh_plan(state.mesh, seq_len, cu, 0)
        forward = _head_scheme(type(self)._usp_base)[1]
        out = forward(self, hidden_states, state.mesh, plan, _bounds(seq_len, cu))
    else:
        out = _gathered(self, state, hidden_states, cu)
    return (out, None) if type(self).__name__ in _ATTENTION_SIGNATURE else out


_DOCUMENTS_ATTR = "usp_mixer_documents"


def _documents(kwargs: dict) -> torch.Tensor | None:
    """The call's packed-document boundaries (global int32 offsets, on the host), or None."""
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    return cu.cpu() if isinstance(cu, torch.Tensor) else None


def _record_documents(mixer: nn.Module) -> Callable[..., None]:
    """A forward pre-hook for the mixer's decoder layer: keeps the layer call's document boundaries on the
    mixer for every call (recomputation under activation checkpointing included), so the boundaries reach
    mixers whose layer calls them without its keyword arguments."""

    def hook(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("usp_kv_cache") is not None:
            raise ValueError(
                f"{type(mixer).__name__} carries a recurrent / convolution state that usp's sharded KV-cache "
                "decoding does not keep; evaluate hybrid models by perplexity (eval=ppl)."
            )
        if kwargs.get("usp_shared_prefix") is not None:
            raise ValueError(
                f"{type(mixer).__name__} is a recurrent / convolution mixer: a document linked to a shared prefix "
                "(trainer.dpo.shared_prompt) would need the prefix's final state, which usp does not carry; set "
                "trainer.dpo.shared_prompt=false (and prepare the data without --shared-prompt)."
            )
        setattr(mixer, _DOCUMENTS_ATTR, _documents(kwargs))

    return hook


_WRAPPED: dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    """``cls`` with :func:`sequence_parallel_mixer_forward` as its forward (same name, made once per class)."""
    if cls not in _WRAPPED:
        _WRAPPED[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": sequence_parallel_mixer_forward,
                "_usp_base": cls,
                "__module__": cls.__module__,  # the family's module, where its kernels live
            },
        )
    return _WRAPPED[cls]


def apply_sequence_mixers(model: nn.Module, mesh: SPMesh) -> dict[str, str]:
    """Make every mixer of :data:`MIXER_SCHEMES` in ``model`` exact over ``mesh`` (in place); returns each
    mixer's scheme by qualified module name (logged once per class on the first rank).

    The module's class becomes a subclass with the wrapping forward (parameters, buffers, names and state dict
    unchanged); applying twice re-targets the mesh.
    """
    schemes: dict[str, str] = {}
    for name, m in mixer_modules(model):
        base = getattr(type(m), "_usp_base", type(m))
        scheme = MIXER_SCHEMES[base.__name__]
        if scheme == HEADS and not _head_scheme(base)[0](m, mesh.sp_degree):
            scheme = GATHER  # the heads do not split over the ranks: every rank runs the whole sequence
        field = receptive_field(m) if scheme == HALO else 0
        if not hasattr(m, _STATE_ATTR):
            layer = model.get_submodule(name.rpartition(".")[0])
            layer.register_forward_pre_hook(_record_documents(m), with_kwargs=True)
        call = _attention_like(base.forward) if base.__name__ in _ATTENTION_SIGNATURE else base.forward
        setattr(m, _STATE_ATTR, MixerState(mesh, scheme, field, call))
        m.__class__ = _wrapped_class(base)
        schemes[name] = scheme
    if schemes and mesh.sp_rank == 0 and mesh.dp_rank == 0:
        by_class: dict[str, list[str]] = {}
        for name, m in mixer_modules(model):
            by_class.setdefault(f"{type(m).__name__} ({schemes[name]})", []).append(name)
        for what, names in by_class.items():
            logger.info("usp: %d mixer layers %s over %d sp ranks", len(names), what, mesh.sp_degree)
    return schemes
