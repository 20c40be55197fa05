"""Device <-> host copiers: shard maps, CPU copies, and the CUDA copier's stream/event logic.

The CUDA copier runs here on CPU tensors through a stand-in runtime
(``fake_cuda.FakeRuntime``): its copies are real, its streams and events are
recorded, so the tests check ordering (who waits for what), pinned vs staged
copies and completion polling. Nothing here needs a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from chunkstore.device import (  # noqa: E402
    CudaCopier,
    HostCopier,
    ImageCopier,
    ShardMap,
    select_copier,
)
from chunkstore.errors import ConfigError  # noqa: E402
from chunkstore.format import ATTENTION, MLA, ChunkLayout, KVSpec, LayerGroup  # noqa: E402

from .fake_cuda import FakeRuntime  # noqa: E402

BF16 = torch.bfloat16
SPEC = KVSpec(
    "transfer-test",
    "BF16",
    16,
    (LayerGroup(ATTENTION, (0, 1), num_kv_heads=4, head_dim=8), LayerGroup(MLA, (2,), 1, 24)),
)
LAYOUT = ChunkLayout(SPEC)


def _covered(maps: list[ShardMap]) -> list[int]:
    counts = [0] * LAYOUT.payload_size
    for m in maps:
        for payload_off, _, length in m.runs:
            for b in range(payload_off, payload_off + length):
                counts[b] += 1
    return counts


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_write_maps_of_all_ranks_cover_the_payload_exactly_once(tp):
    maps = [ShardMap.build(LAYOUT, r, tp, for_write=True) for r in range(tp)]
    assert set(_covered(maps)) == {1}
    for r, m in enumerate(maps):
        ranges = LAYOUT.rank_ranges(r, tp, for_write=True)
        assert m.image_size == sum(x.length for x in ranges)
        # Same bytes as the format's own rank ranges (file offsets = payload + data_offset).
        spans = {(p + LAYOUT.data_offset, n) for p, _, n in m.runs}
        assert spans == {(x.offset, x.length) for x in ranges}
    if tp == 1:
        assert maps[0].runs == ((0, 0, LAYOUT.payload_size),)


def test_read_map_holds_the_rank_heads_and_the_replicated_latent():
    m = ShardMap.build(LAYOUT, 1, 2, for_write=False)
    shapes = {t.name: t.shape for t in m.tensors}
    assert shapes["layers.0.k"] == (2, 16, 8)
    assert shapes["layers.2.latent"] == (16, 24)
    writes = ShardMap.build(LAYOUT, 1, 2, for_write=True)
    assert "layers.2.latent" not in {t.name for t in writes.tensors}


def _fill(views: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = {name: torch.randn(v.shape, generator=g).to(BF16) for name, v in views.items()}
    for name, v in views.items():
        v.copy_(values[name])
    return values


def _copiers():
    return {
        "host": HostCopier(),
        "image": ImageCopier("cpu"),
        "cuda-pinned": CudaCopier("cpu", FakeRuntime(pinned=True)),
        "cuda-staged": CudaCopier("cpu", FakeRuntime(pinned=False)),
    }


@pytest.mark.parametrize("kind", ["host", "image", "cuda-pinned", "cuda-staged"])
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1), (8, 3)])
def test_save_then_load_round_trips_the_rank_bytes(kind, tp, rank):
    copier = _copiers()[kind]
    shard = ShardMap.build(LAYOUT, rank, tp, for_write=True)
    payloads = [bytearray(LAYOUT.payload_size) for _ in range(3)]
    with copier.saving(payloads, shard, BF16) as batch:
        written = [_fill(v, seed=j) for j, v in enumerate(batch.views)]
    assert batch.fence is not None
    batch.fence.wait()
    assert batch.nbytes == 3 * shard.image_size
    outside = bytearray(LAYOUT.payload_size)
    for j, payload in enumerate(payloads):
        whole = torch.frombuffer(payload, dtype=torch.uint8)
        for t in shard.tensors:
            got = whole[t.payload_offset : t.payload_offset + t.nbytes].view(BF16).view(t.shape)
            assert torch.equal(got, written[j][t.name])
        # Bytes of other ranks are untouched.
        covered = set()
        for p, _, n in shard.runs:
            covered.update(range(p, p + n))
        assert all(payload[b] == outside[b] for b in range(len(payload)) if b not in covered)

    with copier.loading([bytes(p) for p in payloads], shard, BF16, block_compute=True) as batch:
        for j, views in enumerate(batch.views):
            for name, v in views.items():
                assert torch.equal(v, written[j][name])
    assert batch.fence is not None and batch.fence.poll()


def test_cuda_saves_order_streams_and_complete_on_the_event():
    rt = FakeRuntime(pinned=True, auto_complete=False)
    copier = CudaCopier("cpu", rt)
    shard = ShardMap.build(LAYOUT, 0, 1, for_write=True)
    payloads = [bytearray(LAYOUT.payload_size)]
    with copier.saving(payloads, shard, BF16) as batch:
        # Conversion kernels run on the side stream, after the forward pass.
        assert rt.current_stream() is copier.stream
        assert copier.stream.waited == [rt.compute]
        _fill(batch.views[0], seed=1)
    gathered, start, done = rt.events
    assert gathered.stream is copier.stream and done.stream is copier.stream
    # The forward pass waits for the gather only, not for the copy to host.
    assert rt.compute.waited == [gathered]
    fence = batch.fence
    assert fence is not None and not fence.poll() and fence.seconds is None
    rt.complete_all()
    assert fence.poll() and fence.seconds == pytest.approx(0.0025)


def test_cuda_saves_into_unpinned_memory_go_through_staging_until_complete():
    rt = FakeRuntime(pinned=False, auto_complete=False)
    copier = CudaCopier("cpu", rt)
    shard = ShardMap.build(LAYOUT, 0, 1, for_write=True)
    payload = bytearray(LAYOUT.payload_size)
    with copier.saving([payload], shard, BF16) as batch:
        _fill(batch.views[0], seed=2)
    assert copier.staged_batches == 1 and rt.pinned_allocs == 1
    assert not any(payload)  # still in the staging buffer, "on its way"
    assert batch.fence is not None and not batch.fence.poll()
    rt.complete_all()
    assert batch.fence.poll()
    assert any(payload)


@pytest.mark.parametrize("block_compute", [True, False])
def test_cuda_loads_make_the_forward_pass_wait_only_when_synchronous(block_compute):
    rt = FakeRuntime(pinned=True, auto_complete=False)
    copier = CudaCopier("cpu", rt)
    shard = ShardMap.build(LAYOUT, 0, 2, for_write=False)
    with copier.loading([bytes(LAYOUT.payload_size)], shard, BF16, block_compute=block_compute):
        assert rt.current_stream() is copier.stream
    start, done = rt.events
    assert rt.compute.waited == ([done] if block_compute else [])
    assert copier.stream.waited == [rt.compute]  # after the blocks were zeroed


def test_cuda_index_tensors_come_from_pinned_memory():
    copier = CudaCopier("cpu", FakeRuntime())
    assert copier.index([3, 1, 2]).tolist() == [3, 1, 2]


def test_select_copier_by_device():
    assert isinstance(select_copier("cpu"), HostCopier)
    assert type(select_copier("meta")) is ImageCopier
    assert isinstance(select_copier("cuda:0", FakeRuntime()), CudaCopier)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            select_copier("cuda:0")
