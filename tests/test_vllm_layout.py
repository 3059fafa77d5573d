"""The vLLM connector's pure parts, without vLLM: where blocks lie, what the two
instances must agree on, and the params a prefill instance hands on."""

from __future__ import annotations

import os

import numpy as np
import pytest

import freight
from freight.vllm.layout import (Geometry, block_descs, block_indices, dim_order, every_block, layer_blocks, mismatches,
                                 page_spans, regions)
from freight.vllm.params import Handoff, Place, done_message, parse_done

# A CPU layer: [num_blocks, kv_heads, block_size, 2 * head_size] of bf16.
CPU_SHAPE = (10, 4, 32, 128)
CPU_STRIDES = (4 * 32 * 128, 32 * 128, 128, 1)


def geometry(**changes) -> Geometry:
    base = dict(model="tiny", dtype="bfloat16", block_size=32, num_layers=2, kv_heads=4, head_size=64,
                block_bytes=4 * 32 * 128 * 2, block_shape=CPU_SHAPE[1:], dim_order=(0, 1, 2, 3), tensor_parallel=1)
    base.update(changes)
    return Geometry(**base)


def test_a_dense_layer_is_one_run_of_bytes_per_block():
    layer = layer_blocks("l0", 0x10000, CPU_SHAPE, CPU_STRIDES, 2)
    assert (layer.base, layer.stride, layer.block_bytes, layer.num_blocks) == (0x10000, 32768, 32768, 10)
    # Blocks outermost, inner dimensions permuted (a GPU backend's NHD order): still dense.
    nhd = layer_blocks("l1", 0, (10, 4, 32, 128), (4 * 32 * 128, 128, 4 * 128, 1), 2)
    assert nhd.block_bytes == 32768
    assert dim_order((4 * 32 * 128, 128, 4 * 128, 1)) == (0, 2, 1, 3)


def test_a_cross_layer_layout_has_blocks_further_apart_than_their_size():
    # vLLM's BLNHC: block b of all 3 layers side by side, each layer a view at its offset.
    block = 4 * 32 * 128
    strides = (3 * block, 128, 4 * 128, 1)
    layers = [layer_blocks(f"l{i}", 0x100000 + i * block * 2, (10, 4, 32, 128), strides, 2) for i in range(3)]
    assert [(l.stride, l.block_bytes) for l in layers] == [(3 * block * 2, block * 2)] * 3
    assert regions(layers) == [(0x100000, 30 * block * 2)]
    rows = block_descs(layers, [2])
    assert rows[:, 0].tolist() == [0x100000 + 2 * 3 * block * 2 + i * block * 2 for i in range(3)]


@pytest.mark.parametrize("shape,strides", [
    ((10, 4, 32, 128), (1, 10, 40, 1280)),          # blocks innermost
    ((2, 10, 4, 32, 64), (10 * 4 * 32 * 64, 4 * 32 * 64, 32 * 64, 64, 1)),  # [2, blocks, ...]: K and V apart
    ((10,), (1,)),
    ((10, 4, 32, 128), (32 * 128, 10 * 32 * 128, 128, 1)),  # heads outside blocks (vLLM's LHBNC)
], ids=["blocks-innermost", "k-and-v-apart", "one-dimension", "heads-outside-blocks"])
def test_a_layer_whose_blocks_are_not_one_run_is_refused_by_name(shape, strides):
    with pytest.raises(freight.InvalidArgumentError, match="KV cache bad"):
        layer_blocks("bad", 0, shape, strides, 2, num_blocks=10)


def test_descriptors_cover_every_layers_blocks_in_order():
    layers = [layer_blocks(f"l{i}", 0x100000 * (i + 1), CPU_SHAPE, CPU_STRIDES, 2) for i in range(2)]
    rows = block_descs(layers, [3, 4, 7], device=0)
    assert rows.shape == (6, 3) and rows.dtype == np.uint64
    assert rows[:, 0].tolist() == [0x100000 + b * 32768 for b in (3, 4, 7)] + [0x200000 + b * 32768 for b in (3, 4, 7)]
    assert set(rows[:, 1].tolist()) == {32768}
    assert block_descs(layers, []).shape == (0, 3)
    with pytest.raises(freight.InvalidArgumentError, match="past the 10 blocks"):
        block_descs(layers, [10])


def test_layers_are_registered_one_region_each_unless_they_interleave():
    apart = [layer_blocks(f"l{i}", 0x100000 * (i + 1), CPU_SHAPE, CPU_STRIDES, 2) for i in range(2)]
    assert regions(apart) == [(0x100000, 10 * 32768), (0x200000, 10 * 32768)]
    # Layers side by side (one allocation, or two that meet): a region each, so that
    # none spans two GPU allocations; shared in place as one run of pages on a host.
    touching = [layer_blocks(f"l{i}", 0x100000 + i * 10 * 32768, CPU_SHAPE, CPU_STRIDES, 2) for i in range(3)]
    assert regions(touching) == [(0x100000 + i * 10 * 32768, 10 * 32768) for i in range(3)]
    assert page_spans(regions(touching)) == [(0x100000, 30 * 32768)]


def test_every_difference_between_the_instances_is_named_with_both_values():
    assert mismatches(geometry(), geometry()) == []
    wrong = mismatches(geometry(), geometry(num_layers=3, dtype="float16", tensor_parallel=2))
    assert wrong == ["dtype: prefill 'bfloat16', decode 'float16'", "num_layers: prefill 2, decode 3",
                     "tensor_parallel: prefill 1, decode 2"]


def test_params_round_trip_and_anything_else_is_a_clear_error():
    handoff = Handoff(request_id="cmpl-1", engine_id="e", block_ids=[5, 6],
                      ranks=[Place("127.0.0.1:7000", "vllm-e-tp0", [1 << 20, 2 << 20], [32768, 32768], 10)],
                      geometry=geometry())
    params = handoff.to_params()
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] == [5, 6]
    assert Handoff.from_params(params) == handoff
    with pytest.raises(freight.InvalidArgumentError, match="no 'freight' section"):
        Handoff.from_params({"do_remote_prefill": True, "remote_block_ids": [1]})
    with pytest.raises(freight.InvalidArgumentError, match="version 99"):
        Handoff.from_params({**params, "freight": {**params["freight"], "version": 99}})
    broken = {**params, "freight": {**params["freight"], "ranks": [{"agent_address": "x"}]}}
    with pytest.raises(freight.InvalidArgumentError, match="malformed"):
        Handoff.from_params(broken)
    with pytest.raises(freight.InvalidArgumentError, match="geometry is malformed"):
        Handoff.from_params({**params, "freight": {**params["freight"], "geometry": {"model": "x"}}})
    assert parse_done(done_message("cmpl-1")) == "cmpl-1"
    assert parse_done(b"something else") is None and parse_done(b"freight-vllm done \xff") is None


def test_spans_that_meet_inside_a_page_are_shared_as_one_run_of_whole_pages():
    # Two allocations a few bytes apart (one heap page holds the end of the first and
    # the start of the second), and a third far away.
    spans = [(0x10040, 0x3000), (0x13080, 0x1000), (0x40010, 0x10)]
    assert page_spans(spans) == [(0x10000, 0x5000), (0x40000, 0x1000)]
    assert page_spans([(0x2000, 0x1000)]) == [(0x2000, 0x1000)]


def test_block_indices_pick_every_layers_blocks_out_of_a_list_of_all_blocks():
    layers = [layer_blocks(f"l{i}", 0x100000 * (i + 1), CPU_SHAPE, CPU_STRIDES, 2) for i in range(3)]
    everything = block_descs(layers, range(10))
    picked = everything[block_indices(3, 10, [3, 4, 7])]
    assert (picked == block_descs(layers, [3, 4, 7])).all()
    # The strided list a worker prepares holds the same descriptors, a run per layer.
    runs = every_block(layers, 0, "DRAM")
    assert runs.runs == 3 and len(runs) == 30
    assert [tuple(d) for d in runs] == [tuple(int(x) for x in row) for row in everything]
    with pytest.raises(freight.InvalidArgumentError, match="block 10 is not one of the 10 blocks"):
        block_indices(3, 10, [2, 10])
    with pytest.raises(freight.InvalidArgumentError, match="block -1"):
        block_indices(3, 10, [-1])
    with pytest.raises(freight.InvalidArgumentError, match="block ids must be a list of integers"):
        block_indices(3, 10, ["3"])
    with pytest.raises(freight.InvalidArgumentError, match="block ids must be a list of integers"):
        block_indices(3, 10, [[1, 2]])


def test_settings_take_known_keys_and_name_whatever_is_wrong():
    from freight.vllm.config import Settings

    s = Settings.from_extra("kv_consumer", {}, environ={"FREIGHT_VLLM_TOKEN": "t"})
    assert (s.token, s.listen, s.share_host_memory, s.inline_copies, s.consumes, s.produces) == \
        ("t", "127.0.0.1:0", True, None, True, False)
    # Unset: inline where the engine has no cores to spare for its copy threads (it
    # wants 8 at least), on those threads elsewhere.
    spare = freight._native.host_has_spare_cores()
    assert s.copies_inline == (not spare)
    if len(os.sched_getaffinity(0)) < 8:
        assert not spare
    s = Settings.from_extra("kv_both", {"inline_copies": True, "lease_seconds": 5, "listen": "0.0.0.0:7000"}, environ={})
    assert (s.inline_copies, s.lease_seconds, s.listen, s.token) == (True, 5.0, "0.0.0.0:7000", None)
    bad = [
        ("kv_consumer", {"inline_copy": True}, "unknown setting(s) ['inline_copy']"),
        ("kv_reader", {}, "kv_role 'kv_reader'"),
        ("kv_consumer", {"token": ""}, "non-empty string"),
        ("kv_consumer", {"lease_seconds": 0}, "must be positive"),
        ("kv_consumer", {"connect_timeout": "soon"}, "kv_connector_extra_config"),
        ("kv_consumer", {"listen": "localhost"}, "give HOST:PORT"),
        ("kv_consumer", {"share_host_memory": "yes"}, "share_host_memory 'yes': give true or false"),
        ("kv_consumer", {"inline_copies": 1}, "inline_copies 1: give true or false"),
    ]
    for role, extra, says in bad:
        with pytest.raises(freight.InvalidArgumentError) as e:
            Settings.from_extra(role, extra, environ={})
        assert says in str(e.value), (extra, str(e.value))


def test_inline_copies_reach_the_agent_as_a_posting_thread_copy_of_any_size():
    from freight.vllm.config import Settings
    from freight.vllm.worker import WorkerSide

    side = WorkerSide(Settings(role="kv_consumer", token="t", inline_copies=True))
    assert side.agent_config().shm_inline_bytes >= 1 << 40
    side = WorkerSide(Settings(role="kv_consumer", token="t", inline_copies=False))
    assert side.agent_config().shm_inline_bytes == freight.AgentConfig().shm_inline_bytes
