"""The paged KV path (``PagedKVCache``): the decoder reads and writes the paged pool in place through block
tables. Against the reference gather -> dense view -> scatter path: the same pool contents after a step (exact,
fp32 on CPU: same S, same mask, same reduction order), the same greedy tokens from the engine (single steps,
multi-step decode, stop ids, concurrent = sequential)."""
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.cli.serve import serve_config
from surojax.generation.sampling import BatchMode
from surojax.serve.config import EngineConfig, KVPath
from surojax.serve.engine import Engine
from surojax.serve.input_batch import InputBatch, StepSettings
from surojax.serve.kv_reference import reference_multi_step_decode, reference_step
from surojax.serve.multi_step import multi_step_decode_paged
from surojax.serve.runner import paged_step
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import SMALL, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
GREEDY = BatchMode(sample=False, penalties=False, logprobs=False)
BS = 4


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, attention="xla")


def _pools(cfg, num_blocks, rng):
    shape = (cfg.num_layers, num_blocks * BS, cfg.num_kv_heads, cfg.head_dim)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _tables(R, nb, num_blocks, rng):
    return rng.permutation(num_blocks)[: R * nb].reshape(R, nb).astype(np.int32)


def _slots(table, start, stop):
    p = np.arange(start, stop)
    return table[p // BS] * BS + p % BS


def _greedy_rows(R, step):
    return dict(temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                min_p=np.zeros(R, np.float32), seed=np.zeros(R, np.uint32), step=np.asarray(step, np.int32))


@pytest.mark.parametrize("T", [1, 5])  # a decode step; a prefill chunk with a padded row
def test_single_step_pool_equals_reference(model, T):
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(T)
    R, S, num_blocks = 3, 32, 40
    nb = S // BS
    k_pool, v_pool = _pools(model.cfg, num_blocks, rng)
    table = _tables(R, nb, num_blocks, rng)
    ctx_len = np.array([7, 0, 20], np.int32)
    n = np.array([T, T, max(T - 2, 1)])  # row 2 has padding tokens when T > 1
    tokens = rng.integers(1, 500, (R, T)).astype(np.int32)
    positions = (ctx_len[:, None] + np.arange(T)).astype(np.int32)
    segments = (np.arange(T)[None, :] < n[:, None]).astype(np.int32)
    ctx = np.zeros((R, S), np.int32)
    write = np.full((R, T), k_pool.shape[1], np.int32)
    for r in range(R):
        ctx[r, :ctx_len[r]] = _slots(table[r], 0, ctx_len[r])
        write[r, :n[r]] = _slots(table[r], ctx_len[r], ctx_len[r] + n[r])
    common = dict(tokens=tokens, start=ctx_len, sampling=_greedy_rows(R, ctx_len + n), positions=positions,
                  segment_ids=segments, last_idx=(n - 1).astype(np.int32), adapter_rows=np.zeros(R, np.int32))
    settings = StepSettings(block_size=BS, mode=GREEDY)
    k1, v1, out1 = reference_step(graphdef, state, k_pool.copy(), v_pool.copy(),
                                  InputBatch(ctx_slots=ctx, write_slots=write, **common),
                                  StepSettings(block_size=BS, mode=GREEDY, kv_in_place=True))
    k2, v2, out2 = paged_step(graphdef, state, k_pool.copy(), v_pool.copy(), InputBatch(block_table=table, **common),
                              settings)
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(k2))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2))
    np.testing.assert_array_equal(np.asarray(out1["ids"]), np.asarray(out2["ids"]))
    assert not np.array_equal(np.asarray(k1), np.asarray(k_pool))  # the step did write


def test_multi_step_pool_equals_reference(model):
    """K steps, a row stopped by a stop id, a row with a smaller limit, a padding row (limit 0)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(7)
    R, K, S, num_blocks = 4, 4, 32, 40
    nb = S // BS
    k_pool, v_pool = _pools(model.cfg, num_blocks, rng)
    table = _tables(R, nb, num_blocks, rng)
    start = np.array([9, 3, 17, 0], np.int32)
    limit = np.array([4, 2, 4, 0], np.int32)
    tokens = rng.integers(1, 500, R).astype(np.int32)
    ctx = np.zeros((R, S), np.int32)
    write = np.full((R, K), k_pool.shape[1], np.int32)
    for r in range(R):
        ctx[r, :start[r]] = _slots(table[r], 0, start[r])
        write[r, :limit[r]] = _slots(table[r], start[r], start[r] + limit[r])
    # row 2 stops on the token it samples first (found by a reference run without stop ids)
    free = dict(tokens=tokens, start=start, limit=limit, adapter_rows=np.zeros(R, np.int32),
                sampling=_greedy_rows(R, start))
    settings = StepSettings(block_size=BS, mode=GREEDY, num_steps=K)
    _, _, probe = reference_multi_step_decode(
        graphdef, state, k_pool.copy(), v_pool.copy(),
        InputBatch(ctx_slots=ctx, write_slots=write, stop_ids=np.full((R, 1), -1, np.int32), **free), settings)
    stop = np.full((R, 1), -1, np.int32)
    stop[2, 0] = int(probe["ids"][2, 1])
    k1, v1, out1 = reference_multi_step_decode(graphdef, state, k_pool.copy(), v_pool.copy(),
                                               InputBatch(ctx_slots=ctx, write_slots=write, stop_ids=stop, **free),
                                               StepSettings(block_size=BS, mode=GREEDY, num_steps=K, kv_in_place=True))
    k2, v2, out2 = multi_step_decode_paged(graphdef, state, k_pool.copy(), v_pool.copy(),
                                           InputBatch(block_table=table, stop_ids=stop, **free), settings)
    assert list(np.asarray(out1["count"])) == [4, 2, 2, 0]
    np.testing.assert_array_equal(np.asarray(out1["count"]), np.asarray(out2["count"]))
    real = np.arange(K)[None, :] < np.asarray(out1["count"])[:, None]  # a stopped row's later ids are garbage
    np.testing.assert_array_equal(np.asarray(out1["ids"])[real], np.asarray(out2["ids"])[real])
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(k2))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2))


def _engine_prompts():
    """Concurrent prompts, two sharing an 8-token prefix (prefix-cache hits)."""
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 500, size=8).tolist()
    return [rng.integers(1, 500, size=n).tolist() for n in (9, 6, 13)] + [shared + [5, 6], shared + [7]]


def _engine(model, path, k):
    eng = Engine(model, engine_config(decode_steps=k, kv_path=path, **SMALL))
    assert eng.runner.kv_path is path and eng.runner.paged is (path is not KVPath.REFERENCE)
    return eng


@pytest.fixture(scope="module")
def reference_tokens(model):
    """The reference (gather -> dense view -> scatter) path's greedy tokens for `_engine_prompts`, computed once for
    every paged path below."""
    return _engine(model, KVPath.REFERENCE, 1).generate(_engine_prompts(), 7)


def test_engine_tokens_equal_reference(model, reference_tokens):
    """Single steps and multi-step decode, concurrent prompts (with a shared prefix: prefix-cache hits):
    the paged path gives the reference path's tokens, and concurrent == one at a time."""
    ps = _engine_prompts()
    for k in (1, 4):
        assert _engine(model, KVPath.PAGED, k).generate(ps, 7) == reference_tokens, k
    eng = _engine(model, KVPath.PAGED, 4)
    assert [eng.generate([p], 7)[0] for p in ps] == reference_tokens


@pytest.mark.parametrize("kernel", [KVPath.PALLAS, KVPath.REDUCE])
def test_engine_decode_kernel_tokens_equal_reference(model, reference_tokens, kernel):
    """KVPath.PALLAS (decode attention in the Pallas kernel, interpret mode on CPU) and REDUCE
    (multiply + reduce over the gather): the reference path's greedy tokens, one step and 4 per call."""
    for k in (1, 4):
        assert _engine(model, kernel, k).generate(_engine_prompts(), 7) == reference_tokens, (kernel, k)


def test_a_kv_path_is_typed():
    with pytest.raises(TypeError, match="kv_path"):
        EngineConfig(kv_path="pallas")
    with pytest.raises(ValueError):
        KVPath("triton")


def test_serve_cli_kv_path():
    from surojax.cli.main import build_parser, load_command

    parser = build_parser("serve", load_command("serve"))
    assert parser.parse_args(["serve", "m"]).kv_path == "auto"
    assert parser.parse_args(["serve", "m", "--kv-path", "paged"]).kv_path == "paged"
    assert parser.parse_args(["serve", "m", "--kv-path", "pallas"]).kv_path == "pallas"
    assert parser.parse_args(["serve", "m", "--kv-path", "reduce"]).kv_path == "reduce"
    assert serve_config(parser.parse_args(["serve", "m", "--kv-path", "reference"])).engine.kv_path is KVPath.REFERENCE


def test_pallas_kernel_warns_where_it_does_not_apply(model, monkeypatch):
    from surojax.serve import runner

    monkeypatch.setattr(runner, "kernel_applies", lambda *a: False)
    with pytest.warns(UserWarning, match="gathers instead"):
        runner.PagedRunner(model, num_blocks=8, block_size=BS, kv_path=KVPath.PALLAS)


def test_pallas_caps_an_auto_sized_pool(model, monkeypatch):
    """An auto-sized pool is capped where the kernel's int32 slot indices end (the cap shrunk to 24 blocks here)."""
    from surojax.serve import engine as engine_mod

    monkeypatch.setattr(engine_mod, "num_kv_blocks", lambda *a, **k: 10 ** 6)
    monkeypatch.setattr(engine_mod, "max_pool_blocks", lambda *a: 24)
    eng = engine_mod.Engine(model, engine_config(block_size=BS, max_model_len=64, kv_path=KVPath.PALLAS))
    assert eng.runner.num_slots == 24 * BS and eng.config.num_blocks == 24


def test_auto_kv_path_picks_the_kernel_only_where_it_applies(model, monkeypatch):
    """KVPath.AUTO: PALLAS on a GPU (no sliding window, pool under the cap), PAGED elsewhere."""
    import dataclasses

    import jax

    from surojax.serve.engine import resolve_kv_path

    cfg, auto = model.cfg, KVPath.AUTO
    assert resolve_kv_path(auto, cfg, BS, 8) is (KVPath.PALLAS if jax.default_backend() == "gpu" else KVPath.PAGED)
    assert Engine(model, engine_config(num_blocks=8, block_size=BS, max_model_len=16)).runner.kv_path is \
        resolve_kv_path(auto, cfg, BS, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_kv_path(auto, cfg, BS, None) is KVPath.PALLAS
    assert resolve_kv_path(auto, cfg, BS, 10 ** 9) is KVPath.PAGED  # over the kernel's 2^31-element pool
    assert resolve_kv_path(auto, dataclasses.replace(cfg, sliding_window=8), BS, 8) is KVPath.PAGED
    assert resolve_kv_path(KVPath.REDUCE, cfg, BS, 10 ** 9) is KVPath.REDUCE


def test_call_settings_are_cached_and_equal_to_fresh_ones():
    """`StepSettings.for_call`: one object per call part (jit's static lookup hits a cached hash), equal to and
    hashing like the settings built afresh, so a cached one never selects another compiled program."""
    import dataclasses

    base = StepSettings(block_size=BS, lora=True, unroll=True)
    multi = base.for_call(GREEDY, 4)
    assert base.for_call(GREEDY, 4) is multi and base.for_call(GREEDY) is not multi
    fresh = dataclasses.replace(base, mode=BatchMode(), num_steps=4)
    assert multi == fresh and hash(multi) == hash(fresh) and multi != base.for_call(BatchMode(sample=True), 4)
    batch = InputBatch(tokens=np.zeros((2, 1), np.int32), start=np.zeros(2, np.int32), sampling={})
    assert len(jax.tree.leaves(batch)) == 2  # the fields a call does not use send nothing


def test_prefills_of_new_prompts_are_fresh_calls(model, monkeypatch):
    """The runner marks a paged prefill call fresh (`StepSettings.fresh`: attention over the call's own tokens)
    exactly when no row has cached tokens: new prompts are; a prompt admitted on a prefix-cache hit, its later
    chunks and decode calls are not (their tokens equal the reference path's: test_engine_tokens_equal_reference)."""
    eng = _engine(model, KVPath.PAGED, 1)
    calls = []
    real = type(eng.runner)._device_call

    def spy(self, fn, batch, settings):
        calls.append((np.asarray(batch.tokens).shape[1] > 1, bool(np.asarray(batch.start).any()), settings.fresh))
        return real(self, fn, batch, settings)

    monkeypatch.setattr(type(eng.runner), "_device_call", spy)
    shared = _engine_prompts()[3]
    eng.generate([shared], 2)  # its blocks are cached: the next prompt starts after its full blocks
    eng.generate([shared[:8] + [9, 9, 9]], 2)
    prefills = [c for c in calls if c[0]]
    assert [fresh for *_, fresh in prefills] == [not has_context for _, has_context, _ in prefills]
    assert any(fresh for *_, fresh in prefills) and not all(fresh for *_, fresh in prefills)
    assert not any(fresh for is_prefill, _, fresh in calls if not is_prefill)


def test_fine_prefill_rows_pad_less_with_the_same_tokens(model, monkeypatch):
    """RunnerBuckets.fine_prefill_rows: five new prompts' prefill call has 6 rows (2^k or 1.5 x 2^k), not 8, and
    the greedy tokens are those of the default buckets."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, size=n).tolist() for n in (9, 6, 13, 4, 11)]
    cfg = dict(SMALL, buckets=dataclasses.replace(SMALL["buckets"], fine_prefill_rows=True))
    eng = Engine(model, engine_config(kv_path=KVPath.PAGED, **cfg))
    rows = []
    real = type(eng.runner)._device_call

    def spy(self, fn, batch, settings):
        rows.append(np.shape(batch.tokens))
        return real(self, fn, batch, settings)

    monkeypatch.setattr(type(eng.runner), "_device_call", spy)
    assert eng.generate(prompts, 7) == _engine(model, KVPath.PAGED, 1).generate(prompts, 7)
    assert rows[0][0] == 6 and rows[0][1] > 1


@pytest.mark.parametrize("path", [KVPath.PAGED, KVPath.REFERENCE])
def test_new_prompts_and_continuing_chunks_run_as_separate_calls(model, path, monkeypatch):
    """A step holding a new prompt and the next chunk of a chunked one runs them in two prefill calls (each row
    with its own kind: the new one fresh on the paged path), and the greedy tokens are those of the prompts one at
    a time with no chunking."""
    rng = np.random.default_rng(11)
    # 20 > the step's 16 tokens: its second chunk shares a step with the 6-token prompt (a prompt the budget would
    # cut short beside other prefills waits for the next step instead: the scheduler's rule)
    prompts = [rng.integers(1, 500, size=n).tolist() for n in (20, 6, 9)]
    eng = Engine(model, engine_config(kv_path=path, **dict(SMALL, max_num_batched_tokens=16)))
    steps: list[list[tuple[int, ...]]] = []
    real_execute, real_call = type(eng.runner).execute, type(eng.runner)._device_call

    def execute(self, *args, **kw):
        steps.append([])
        return real_execute(self, *args, **kw)

    def call(self, fn, batch, settings):
        if np.shape(batch.tokens)[1] > 1:
            steps[-1].append(tuple(np.asarray(batch.start)[np.asarray(batch.segment_ids).any(axis=1)].tolist()))
        return real_call(self, fn, batch, settings)

    monkeypatch.setattr(type(eng.runner), "execute", execute)
    monkeypatch.setattr(type(eng.runner), "_device_call", call)
    got = eng.generate(prompts, 5)
    assert any(len(s) == 2 and {bool(any(a)) for a in s} == {False, True} for s in steps), steps
    assert all(all(a) or not any(a) for s in steps for a in s)  # no call mixes new and continuing rows
    alone = Engine(model, engine_config(kv_path=KVPath.PAGED, **SMALL))
    assert got == [alone.generate([p], 5)[0] for p in prompts]
