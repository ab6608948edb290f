"""``eval=ruler``: RULER's synthetic long-context tasks (Hsieh et al. 2024) on the training mesh.

Retrieval (``niah_single_1..3``, ``niah_multikey_1..3``, ``niah_multivalue``, ``niah_multiquery``), multi-hop
tracing (``vt``) and aggregation (``cwe``, ``fwe``), each prompt fitted to the evaluated length in this
tokenizer's tokens, answered by greedy decoding with the sharded KV cache and scored by string match.

- :mod:`usp.eval.ruler.haystack`: the filler text (noise, generated essay-like prose, ``eval.ruler.haystack``);
- :mod:`usp.eval.ruler.tasks`: what each task's prompt says and expects;
- :mod:`usp.eval.ruler.fit`: seeding, rendering (plain or chat template) and bisection to the length;
- :mod:`usp.eval.ruler.scoring`: string-match scores, per-length means, the effective length;
- :mod:`usp.eval.ruler.run`: checks and the decoding loop on the mesh;
- :mod:`usp.eval.ruler.report`: heatmap, per-length plot, wandb tables, the stdout table.
"""
