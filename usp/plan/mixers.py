"""A hybrid model's recurrent mixer layers, for the planner: parameters, FLOPs, bytes sent and bytes kept.

Hybrid families replace softmax attention in some layers by a recurrent mixer (:class:`MixerSpec`, learned by
:func:`mixer_spec_of`); the layer's norms and MLP (dense or MoE) are the same as an attention layer's. usp runs
a mixer layer under sequence parallelism on one of two schemes (:mod:`usp.model.mixers`), chosen per degree
exactly as the trainer chooses (:meth:`MixerSpec.scheme`):

``heads``
    A head all-to-all: each of the ``P = ulysses x ring`` ranks runs every token of ``1 / P`` of the heads
    (gated DeltaNet when ``Hk >= P``; Mamba2 when ``H % P == 0`` and ``G % P == 0`` or ``P % G == 0``).
``gather``
    An all-gather of the layer input: every rank runs the whole mixer over all ``S`` tokens (``P`` x the
    work and the activations of the heads scheme).
``halo`` (short convolutions)
    Each rank runs its own tokens with the ``K - 1`` tokens before each of its runs (:data:`HALO_RUNS`).

Families (``model_type``): gated DeltaNet ``qwen3_next``, ``qwen3_5_text``; Mamba2 ``bamba``; short
convolutions ``lfm2``. Others whose layers this model does not describe (attention and a mixer in one layer,
MLP-only blocks, shared MLPs, Mamba1, KDA, lightning attention, LFM2's MoE) are refused with a ``ValueError``
(:data:`UNMODELLED_HYBRIDS`), never estimated as attention.

Parameters (checked against transformers' modules on the meta device, ``tests/test_plan_hybrid.py``), ``h``
hidden; gated DeltaNet with ``Hk`` key heads of ``dk``, ``Hv`` value heads of ``dv``, convolution width ``K``
over ``conv_dim = 2 Hk dk + Hv dv`` channels: projections ``h (2 Hk dk + 2 Hv dv + 2 Hv)`` in (q, k, v, z,
b, a) and ``Hv dv h`` out, the convolution ``conv_dim K``, ``dt_bias`` and ``A_log`` (``Hv`` each), the gated
norm ``dv``. Mamba2 with ``H`` heads of ``dh`` (``inner = H dh``), ``G`` groups of state ``N``: projections
``h (2 inner + 2 G N + H)`` in and ``inner h`` out, the convolution ``(inner + 2 G N) K`` (and a bias of that
many when ``conv_bias``), ``dt_bias``, ``A_log`` and ``D`` (``H`` each), the gated norm ``inner``. LFM2's short
convolution: projections ``3 h^2`` in (B, C, x) and ``h^2`` out, the convolution ``h K`` (and ``h`` when
``conv_bias``). Projection biases are not counted, as attention's are not.

FLOPs per token, forward (2 per multiply-add), chunk length ``C``: the projections' ``2 x`` matmul weights
(in :attr:`usp.plan.models.ModelSpec.matmul_params`, so in the model FLOPs and the MFU, as the trainer counts
them); the depthwise convolution ``2 K conv_dim``; the chunked scan (hardware time only, as the trainer's MFU
leaves it out): gated DeltaNet ``Hv (4 C dk + 2 C dv + 6 dk dv + C (dk + dv))`` (the matmuls of the chunked
delta rule, measured with ``FlopCounterMode`` on transformers' torch code in the tests, and the triangular
solve it does not count); Mamba2 ``2 C G N + H (2 C dh + 4 N dh)`` (the chunk's ``C B^T`` per group, the
intra-chunk output, the state update and read-out). Backward: :data:`MIXER_BWD_OVER_FWD` forwards (the
kernels recompute their chunk intermediates).

Bytes sent per layer and micro step by the busiest rank (forward + backward), ``s`` local tokens, ``B`` the
compute dtype's size: gated DeltaNet heads ``s (Hk + (P - 2) c) (W + r dv) B`` with ``c = ceil(Hk / P)``,
``r = Hv / Hk``, ``W = 2 dk + 2 r dv + 2 r`` (the grouped projections out and the heads' outputs back);
Mamba2 heads ``2 (P - 1) s (W + (H / P) dh) B`` with ``W = (H / P) dh + 2 max(G / P, 1) N + H / P``; the
gather ``2 (P - 1) s h B``; the halo ``2 (P - 1) runs (K - 1) h B``, whatever the length. Each is on the critical path (the next step needs it), at NVLink speed while the sp
group fits in a node.

Activations kept for backward per local token, heads scheme, besides the layer's two norms and its MLP (the
fused kernels' own saves included; a prediction whose torch-path part is checked against autograd in the
tests): gated DeltaNet ``2 conv_dim B`` (the convolution's input and the kernel's q, k, v), ``12 Hv`` (the
fp32 decay path), ``B Hv`` (beta), ``Hv dv (12 + 2 B) + 4 Hv`` (the gated norm), ``B Hv dv`` (the output
projection's input), ``8 Hk + 64 B Hv`` (flash-linear-attention's q/k norms and its ``[T, Hv, 64]`` chunk
matrix); Mamba2 ``B (H dh + 2 max(G, P) N + H)`` (the exchanged rows), ``B H`` (dt), ``B (H dh + 2 max(G, P)
N)`` (the scan's inputs), ``(16 + 2 B) inner + 4 G`` (the gated norm and the output projection's input),
``B H dh + 4 H`` (mamba-ssm's output and fp32 ``dA`` cumsum); a short convolution ``6 h B`` (B, C, x, the
convolution's input and output, the output projection's input; checked against autograd). Uneven DeltaNet heads scale the head terms by
``c P / Hk``; the gather keeps ``P`` x the heads scheme's and the gathered input ``P h B``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GATED_DELTANET = "gated_deltanet"
MAMBA2 = "mamba2"
SHORT_CONV = "short_conv"
MIXER_BWD_OVER_FWD = 2.5
"""A chunked scan's backward over its forward in hardware FLOPs (it recomputes the chunk intermediates), as
a fused attention kernel's (:data:`usp.plan.compute.ATTN_BWD_OVER_FWD_HW`); an estimate."""
HALO_RUNS = 2
"""Runs of consecutive positions per rank the halo exchange sends the tails of: 2 under the zigzag layout (the
planner's count; the balanced layout's extra runs add ``(K - 1) h B`` each, small)."""
DELTANET_CHUNK = 64
"""The chunk length of flash-linear-attention's and transformers' chunked gated delta rule."""

UNMODELLED_HYBRIDS: dict[str, str] = {
    "falcon_h1": "its layers run attention and a Mamba2 mixer side by side",
    "nemotron_h": "its blocks are single mixers (Mamba2, attention or MLP) with no MLP in a Mamba2 block",
    "granitemoehybrid": "its layers add a shared MLP to the mixture of experts",
    "jamba": "its Mamba1 mixer runs on the gather scheme with a different scan",
    "lfm2_moe": "its mixture of experts beside short convolutions is not modelled",
    "kimi_linear": "its KDA layers are not modelled",
    "olmo_hybrid": "its DeltaNet layers are not modelled",
    "olmo3_hybrid": "its DeltaNet layers are not modelled",
    "minimax": "its lightning-attention layers are not modelled",
}
"""Hybrid families the planner does not model, and why."""


@dataclass(frozen=True)
class MixerSpec:
    """The recurrent mixer of a hybrid model's mixer layers (module docstring)."""

    kind: str
    """:data:`GATED_DELTANET`, :data:`MAMBA2` or :data:`SHORT_CONV` (LFM2: one channel per "head")."""
    layers: tuple[bool, ...]
    """Per decoder layer: True when the mixer replaces attention there."""
    heads: int
    """Value heads ``Hv`` (gated DeltaNet) or heads ``H`` (Mamba2)."""
    head_dim: int
    """``dv`` or ``dh``."""
    key_heads: int = 0
    """Gated DeltaNet's ``Hk`` (its q and k heads); Mamba2's groups ``G``."""
    key_dim: int = 0
    """Gated DeltaNet's ``dk``; Mamba2's state size ``N``."""
    conv_kernel: int = 4
    chunk: int = DELTANET_CHUNK
    conv_bias: bool = False

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def inner(self) -> int:
        """The mixer's value width: ``Hv dv`` or ``H dh``."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise convolution."""
        if self.kind == GATED_DELTANET:
            return 2 * self.key_heads * self.key_dim + self.inner
        return self.inner + 2 * self.key_heads * self.key_dim

    def matmul_params(self, hidden: int) -> int:
        """The projections' weights (input and output)."""
        if self.kind == SHORT_CONV:  # B, C, x in; out
            return 3 * hidden * hidden + hidden * hidden
        if self.kind == GATED_DELTANET:
            inputs = 2 * self.key_heads * self.key_dim + 2 * self.inner + 2 * self.heads
        else:
            inputs = 2 * self.inner + 2 * self.key_heads * self.key_dim + self.heads
        return hidden * inputs + self.inner * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of one mixer (module docstring)."""
        conv = self.conv_dim * self.conv_kernel + (self.conv_dim if self.conv_bias else 0)
        if self.kind == SHORT_CONV:
            own = 0
        elif self.kind == GATED_DELTANET:
            own = 2 * self.heads + self.head_dim  # dt_bias, A_log; the norm over one head
        else:
            own = 3 * self.heads + self.inner  # dt_bias, A_log, D; the grouped norm over the inner width
        return self.matmul_params(hidden) + conv + own

    # --- schemes and work ---------------------------------------------------------------------------------
    def scheme(self, sp_degree: int) -> str:
        """``heads``, ``gather`` or (short convolutions) ``halo`` at ``sp_degree`` ranks (:mod:`usp.model.mixers`'
        rule)."""
        P = sp_degree
        if self.kind == SHORT_CONV:
            return "halo"
        if self.kind == GATED_DELTANET:
            return "heads" if self.key_heads >= P else "gather"
        G = self.key_heads
        return "heads" if self.heads % P == 0 and (G % P == 0 or P % G == 0) else "gather"

    def head_share(self, sp_degree: int) -> float:
        """The busiest rank's heads over the mean under the heads scheme (uneven DeltaNet key heads)."""
        if self.kind != GATED_DELTANET:
            return 1.0
        return math.ceil(self.key_heads / sp_degree) * sp_degree / self.key_heads

    def scan_flops_per_token(self) -> float:
        """Forward FLOPs per token of the convolution and the chunked scan, all heads (module docstring)."""
        C, K = self.chunk, self.conv_kernel
        conv = 2.0 * K * self.conv_dim
        if self.kind == SHORT_CONV:
            return conv
        if self.kind == GATED_DELTANET:
            dk, dv = self.key_dim, self.head_dim
            return conv + self.heads * (4 * C * dk + 2 * C * dv + 6 * dk * dv + C * (dk + dv))
        G, N, H, dh = self.key_heads, self.key_dim, self.heads, self.head_dim
        return conv + 2.0 * C * G * N + H * (2 * C * dh + 4 * N * dh)

    def comm_bytes(self, local_tokens: float, sp_degree: int, hidden: int, compute_bytes: int) -> float:
        """Bytes the busiest rank sends for one mixer layer, forward + backward (module docstring)."""
        P, s, B = sp_degree, local_tokens, compute_bytes
        if P == 1:
            return 0.0
        if self.kind == SHORT_CONV:  # each rank's K - 1 last tokens of its runs, to every rank, and back
            return 2.0 * (P - 1) * HALO_RUNS * (self.conv_kernel - 1) * hidden * B
        if self.scheme(P) == "gather":
            return 2.0 * (P - 1) * s * hidden * B
        if self.kind == GATED_DELTANET:
            r = self.heads // self.key_heads
            dk, dv, c = self.key_dim, self.head_dim, math.ceil(self.key_heads / P)
            width = 2 * dk + 2 * r * dv + 2 * r
            return s * (self.key_heads + (P - 2) * c) * (width + r * dv) * B
        H, dh, G, N = self.heads, self.head_dim, self.key_heads, self.key_dim
        width = H // P * dh + 2 * max(G // P, 1) * N + H // P
        return 2.0 * (P - 1) * s * (width + H // P * dh) * B

    def kept_bytes_per_token(self, sp_degree: int, hidden: int, compute_bytes: int) -> float:
        """What one mixer layer keeps for backward per local token, its norms and MLP aside (module
        docstring)."""
        P, B = sp_degree, compute_bytes
        if (
            self.kind == SHORT_CONV
        ):  # B, C, x; B * x (the convolution's input); its output; C * it (out_proj's)
            return 6 * hidden * B
        heads_P = P if self.scheme(P) == "heads" else 1
        if self.kind == GATED_DELTANET:
            Hk, Hv, dv = self.key_heads, self.heads, self.head_dim
            kept = 2 * self.conv_dim * B + 12 * Hv + B * Hv + Hv * dv * (12 + 2 * B) + 4 * Hv + B * Hv * dv
            kept += 8 * Hk + 64 * B * Hv
            kept *= self.head_share(heads_P)
        else:
            H, dh, G, N = self.heads, self.head_dim, self.key_heads, self.key_dim
            rows = H * dh + 2 * max(G, heads_P) * N
            kept = B * (rows + H) + B * H + B * rows + (16 + 2 * B) * self.inner + 4 * G
            kept += B * H * dh + 4 * H
        if heads_P == 1 and P > 1:  # gather: the whole sequence's, and the gathered input
            return P * kept + P * hidden * B
        return kept

    def backward_bytes_per_token(self, sp_degree: int, hidden: int, compute_bytes: int) -> float:
        """What a mixer layer's backward allocates at its peak per local token (an estimate): the gradients of
        the scan kernel's inputs and of the exchanged rows in and out (``2 h B``); ``P`` x under the gather."""
        B = compute_bytes
        if self.kind == SHORT_CONV:
            return 5 * hidden * B  # the gradients of B, C, x and of the convolution's input and output
        grads = self.conv_dim * B + 8 * self.heads + 2 * hidden * B
        return grads * (sp_degree if self.scheme(sp_degree) == "gather" else 1)


def _layers_of(config: dict[str, Any]) -> tuple[bool, ...]:
    from usp.model.capabilities import layer_specs

    return tuple(spec.mixer for spec in layer_specs(config))


def mixer_spec_of(config: dict[str, Any]) -> MixerSpec | None:
    """The mixer of a hybrid model's ``config.json`` dict, or None when every layer is softmax attention.
    ``ValueError`` for a hybrid family the planner does not model (:data:`UNMODELLED_HYBRIDS`)."""
    model_type = str(config.get("model_type"))
    layers = () if model_type in UNMODELLED_HYBRIDS else _layers_of(config)
    if model_type not in UNMODELLED_HYBRIDS and not any(layers):
        return None
    if model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5"):
        return MixerSpec(
            kind=GATED_DELTANET,
            layers=layers,
            heads=int(config["linear_num_value_heads"]),
            head_dim=int(config["linear_value_head_dim"]),
            key_heads=int(config["linear_num_key_heads"]),
            key_dim=int(config["linear_key_head_dim"]),
            conv_kernel=int(config.get("linear_conv_kernel_dim") or 4),
        )
    if model_type == "lfm2":
        return MixerSpec(
            kind=SHORT_CONV,
            layers=layers,
            heads=int(config["hidden_size"]),
            head_dim=1,
            conv_kernel=int(config.get("conv_L_cache") or 3),
            conv_bias=bool(config.get("conv_bias", False)),
        )
    if model_type == "bamba":
        hidden = int(config["hidden_size"])
        heads, head_dim = int(config["mamba_n_heads"]), int(config["mamba_d_head"])
        if heads * head_dim != int(config.get("mamba_expand", 2)) * hidden:
            raise ValueError(
                f"mamba_n_heads x mamba_d_head = {heads * head_dim} is not mamba_expand x hidden_size; the "
                "config is inconsistent."
            )
        return MixerSpec(
            kind=MAMBA2,
            layers=layers,
            heads=heads,
            head_dim=head_dim,
            key_heads=int(config["mamba_n_groups"]),
            key_dim=int(config["mamba_d_state"]),
            conv_kernel=int(config.get("mamba_d_conv") or 4),
            chunk=int(config.get("mamba_chunk_size") or 256),
            conv_bias=bool(config.get("mamba_conv_bias", True)),
        )
    why = UNMODELLED_HYBRIDS.get(model_type, "its mixer layers are not modelled")
    raise ValueError(
        f"model_type {model_type!r} is a hybrid model the planner does not model ({why}); it gives no estimate "
        f"rather than a wrong one. Modelled hybrids: qwen3_next, qwen3_5_text (gated DeltaNet), bamba (Mamba2), "
        f"lfm2 (short convolutions). "
        f"Set parallel.ulysses_degree and parallel.ring_degree yourself (docs/attention.md, 'Hybrid layers')."
    )
