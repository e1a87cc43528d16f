"""Which rows or columns of each parameter shard s of n holds (tensor parallelism).

Pure index arithmetic (tp.py places the pieces). A parameter is replicated or split along one dim;
shard s holds `shard_indices(...)` of that dim, in that order, and the TP-global array is the pieces
concatenated along the dim (so its contiguous split gives each device exactly its piece):

    embed, lm_head          [V, E]     dim 0, contiguous (vocabulary-parallel)
    mtp.draft_head          [V, E]     dim 0, contiguous (the optional FP8 copy of lm_head for drafts,
                                       or its rows of a draft vocabulary: [Vs, E])
    mtp.draft_vocab         [Vs]       replicated (the token ids of those rows, qmtp/model/draft_vocab.py)
    q_proj                  [2HqD, E]  dim 0, contiguous: rows are per head [query | gate], whole heads
    k_proj, v_proj          [HkvD, E]  dim 0 by KV head; with fewer KV heads than shards, shard s takes
                                       KV head s * Hkv // n (KV heads replicated n / Hkv times)
    o_proj                  [E, HqD]   dim 1, contiguous (row-parallel: partial sums, psum after)
    mlp_gate, mlp_up        [F, E]     dim 0, contiguous
    mlp_down                [E, F]     dim 1, contiguous (row-parallel)
    in_proj_qkv, conv       [C, ...]   dim 0, per shard [q_s | k_s | v_s]: the checkpoint's rows are
                                       [q all heads | k | v], so a contiguous split would not hold whole
                                       heads; the TP layout permutes them (conv channels identically)
    in_proj_z               [HvDv, E]  dim 0, contiguous
    in_proj_b, in_proj_a, A_log, dt_bias   [Hv, ...] dim 0, contiguous
    in_proj_ba              [2Hv, E]   dim 0, per shard [b_s | a_s] (load.fuse_gate_projections)
    out_proj                [E, HvDv]  dim 1, contiguous (row-parallel)
    experts_gate_up         [X, 2I, E] dim 1, per shard [gate_s | up_s] of every expert (each expert's
                                       width split: every device reads its share of each chosen expert)
    experts_down            [X, E, I]  dim 2, contiguous (row-parallel)
    shared_mlp_gate / _up   [S, E]     dim 0, contiguous; shared_mlp_down [E, S] dim 1 (row-parallel)
    norms, mtp.fc, router, shared_gate,  replicated
    router_gate [X+1, E]

GDN key and value heads split together (value head j uses key head j // (Hv / Hk)). With n = 1 every
index list is the identity: one shard's TP layout is the checkpoint layout.
"""

from __future__ import annotations

from qmtp.model.config import FP8_BLOCK, ModelConfig

REPLICATED = None
_CONTIGUOUS_0 = {"embed", "lm_head", "draft_head", "q_proj", "mlp_gate", "mlp_up", "in_proj_z", "in_proj_b",
                 "in_proj_a", "A_log", "dt_bias", "shared_mlp_gate", "shared_mlp_up"}
_CONTIGUOUS_1 = {"o_proj", "mlp_down", "out_proj", "shared_mlp_down"}
_CONTIGUOUS_2 = {"experts_down"}
_KV_HEADS = {"k_proj", "v_proj"}
_QKV = {"in_proj_qkv", "conv"}
_BA = {"in_proj_ba"}  # [b | a]
_GATE_UP = {"experts_gate_up"}  # [gate | up] along dim 1
_REPLICATED = {"final_norm", "input_norm", "post_norm", "q_norm", "k_norm", "gdn_norm", "fc",
               "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "draft_vocab", "router", "shared_gate",
               "router_gate"}


def split_dim(key: str) -> int | None:
    """The dim a parameter (by its key in the tree) is split along, or None when replicated."""
    if key in _CONTIGUOUS_0 or key in _KV_HEADS or key in _QKV or key in _BA:
        return 0
    if key in _CONTIGUOUS_1 or key in _GATE_UP:
        return 1
    if key in _CONTIGUOUS_2:
        return 2
    if key in _REPLICATED:
        return REPLICATED
    raise KeyError(f"no tensor-parallel layout for parameter {key!r}")


def kv_heads_per_shard(cfg: ModelConfig, n: int) -> int:
    """KV heads each shard holds: Hkv / n, or 1 when KV heads are replicated (n a multiple of Hkv)."""
    return max(cfg.num_key_value_heads // n, 1)


def shard_indices(cfg: ModelConfig, key: str, length: int, n: int, s: int) -> list[int]:
    """Indices along split_dim(key) (of the checkpoint-layout tensor, `length` long) held by shard s."""
    if not 0 <= s < n:
        raise ValueError(f"shard {s} of {n}")
    if key in _KV_HEADS:
        d, hkv = cfg.head_dim, cfg.num_key_value_heads
        if hkv % n == 0:
            return _contiguous(length, n, s)
        first = s * hkv // n
        return list(range(first * d, (first + 1) * d))
    if key in _QKV:
        kd, vd = cfg.key_dim, cfg.value_dim
        q = _contiguous(kd, n, s)
        return q + [kd + i for i in q] + [2 * kd + i for i in _contiguous(vd, n, s)]
    if key in _BA or key in _GATE_UP:
        if length % 2:
            halves = "[b | a]" if key in _BA else "[gate | up]"
            raise ValueError(f"{key} has {length} rows: expected two halves {halves}")
        half = _contiguous(length // 2, n, s)
        return half + [length // 2 + i for i in half]
    return _contiguous(length, n, s)


def _contiguous(length: int, n: int, s: int) -> list[int]:
    if length % n:
        raise ValueError(f"a dim of {length} cannot be split {n} ways")
    w = length // n
    return list(range(s * w, (s + 1) * w))


def block_indices(indices: list[int], what: str) -> list[int]:
    """FP8 scale-grid indices of a selection that is a sequence of whole 128-blocks (or one ragged
    final block reaching the end); anything else cannot carry its block scales and is refused."""
    blocks = []
    for start in range(0, len(indices), FP8_BLOCK):
        chunk = indices[start:start + FP8_BLOCK]
        if chunk[0] % FP8_BLOCK or chunk != list(range(chunk[0], chunk[0] + len(chunk))):
            raise ValueError(f"{what}: the tensor-parallel shard is not made of whole {FP8_BLOCK}-blocks of the FP8 "
                             "scale grid; this checkpoint cannot be split this many ways")
        blocks.append(chunk[0] // FP8_BLOCK)
    return blocks


def ranges(indices: list[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive indices (what to read from a file for a selection)."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
