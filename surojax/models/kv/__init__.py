"""KV caches behind one protocol (`protocol.py`): attention calls `LayerKV.update_and_attend` once, the
decoder drives a `Cache`. `dense.py`: the plain cache of generation; `paged.py`: the serving pool, read through
block tables (gather, multiply + reduce, or the Pallas kernel: `PagedKernel`); `meta.py`: the typed per-call
metadata and the attention mask."""
from surojax.models.kv.dense import DenseLayerKV, KVCache, StackedLayerKV
from surojax.models.kv.meta import MASKED, AttendSpec, KVMeta, PagedKVMeta, attention_mask, softmax_with_sinks
from surojax.models.kv.paged import PagedKernel, PagedKVCache, PagedLayerKV, reduce_decode_attention
from surojax.models.kv.protocol import Cache, CarriedLayerKV, LayerKV

__all__ = ["MASKED", "AttendSpec", "Cache", "CarriedLayerKV", "DenseLayerKV", "KVCache", "KVMeta", "LayerKV",
           "PagedKVCache", "PagedKVMeta", "PagedKernel", "PagedLayerKV", "StackedLayerKV", "attention_mask",
           "reduce_decode_attention", "softmax_with_sinks"]
