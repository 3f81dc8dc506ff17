"""`param_block`: any block of a stacked parameter, assembled from only the HF tensors that meet it, equals the
same block of the whole parameter built with numpy (per-layer [out, in] tensors transposed, fused halves side by
side). This is what each process of a multi-process run reads for its devices' shards."""
import itertools

import numpy as np

from surojax.models.registry import WeightRow
from surojax.weights.hf_checkpoint import param_block

L, D, F = 3, 4, 6  # layers, in, out (each fused half F/2)


def test_blocks_read_only_the_tensors_they_need_and_equal_the_whole_parameter():
    rng = np.random.default_rng(0)
    gate = WeightRow("l.{i}.gate", "mlp.gate_up", transpose=True, half=0)
    up = WeightRow("l.{i}.up", "mlp.gate_up", transpose=True, half=1)
    tensors = {f"l.{i}.{k}": rng.standard_normal((F // 2, D)).astype(np.float32) for i in range(L) for k in ("gate", "up")}
    items = [(f"l.{i}.{k}", row, (i,)) for i in range(L) for k, row in (("gate", gate), ("up", up))]
    whole = np.stack([np.concatenate([tensors[f"l.{i}.gate"].T, tensors[f"l.{i}.up"].T], axis=-1) for i in range(L)])

    cuts = {0: [slice(0, 1), slice(1, 3), slice(None)], 1: [slice(0, 2), slice(None)],
            2: [slice(0, 3), slice(2, 5), slice(3, 6), slice(None)]}
    for index in itertools.product(*cuts.values()):
        read = []
        block = param_block((L, D, F), np.float32, items, index,
                            lambda name: read.append(name) or tensors[name])
        np.testing.assert_array_equal(block, whole[index])
        layers = range(*index[0].indices(L))
        halves = [k for k, part in (("gate", slice(0, 3)), ("up", slice(3, 6)))
                  if max(part.start, index[2].indices(F)[0]) < min(part.stop, index[2].indices(F)[1])]
        assert sorted(read) == sorted(f"l.{i}.{k}" for i in layers for k in halves), (index, read)
