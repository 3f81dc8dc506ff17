"""Model caches behind one protocol (`protocol.py`): attention calls `LayerKV.update_and_attend` once, a
linear-attention layer reads and writes its `LayerState`; the decoder drives a `Cache` with one part per layer
stack. `dense.py`: the plain KV cache of generation; `paged.py`: the serving pool, read through block tables
(gather, multiply + reduce, or the Pallas kernel: `PagedKernel`); `recurrent.py`: the linear / short-conv layers' states
and the hybrid cache (KV + states); `meta.py`: the typed per-call metadata and the attention mask."""
from surojax.models.kv.dense import DenseLayerKV, KVCache, StackedLayerKV, StacksKVCache
from surojax.models.kv.meta import MASKED, AttendSpec, KVMeta, PagedKVMeta, attention_mask, softmax_with_sinks
from surojax.models.kv.paged import PagedKernel, PagedKVCache, PagedLayerKV, reduce_decode_attention
from surojax.models.kv.protocol import Cache, CarriedLayerKV, LayerKV, OneStack, StackCache
from surojax.models.kv.recurrent import (ATTENTION_STACK, CONV_STACK, LINEAR_STACK, STATE_STACKS, ConvShape,
                                         HybridCache, LayerState, StackedLayerState, StateCache, StateShape,
                                         TokenStateCache, state_stack)

__all__ = ["ATTENTION_STACK", "CONV_STACK", "LINEAR_STACK", "MASKED", "STATE_STACKS", "AttendSpec", "Cache",
           "CarriedLayerKV", "ConvShape", "DenseLayerKV",
           "HybridCache", "KVCache", "KVMeta", "LayerKV", "LayerState", "OneStack", "PagedKVCache", "PagedKVMeta",
           "PagedKernel", "PagedLayerKV", "StackCache", "StackedLayerKV", "StacksKVCache", "StackedLayerState", "StateCache",
           "StateShape", "TokenStateCache", "attention_mask", "reduce_decode_attention", "softmax_with_sinks", "state_stack"]
