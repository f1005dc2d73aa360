"""DataProto behaviour: construction, selection, splitting, joining, errors, pickling, gather."""

import os
import pickle

import numpy as np
import pytest
import torch
from helpers.world import free_port

from rlframe.protocol import DataProto, all_gather_data_proto, pad_dataproto_to_divisor, unpad_dataproto


def make(n=5, seqlen=3):
    ids = torch.arange(n * seqlen).view(n, seqlen)
    return DataProto.from_dict(
        {"input_ids": ids, "mask": torch.ones(n, seqlen)},
        {"uid": [f"u{i}" for i in range(n)], "raw": [[i, i + 1] for i in range(n)]},
        {"temperature": 1.0},
    )


def test_from_dict_and_len():
    data = make()
    assert len(data) == 5
    assert data.non_tensor_batch["uid"].dtype == object
    assert data.non_tensor_batch["raw"][2] == [2, 3]  # lists stay per-sample lists


def test_from_single_dict_routes_tensors_and_objects():
    data = DataProto.from_single_dict({"x": torch.zeros(2, 1), "tag": np.array(["a", "b"], dtype=object)})
    assert data.batch_keys == ["x"] and list(data.non_tensor_batch) == ["tag"]


def test_mismatched_lengths_between_batch_and_non_tensor_is_valueerror():
    with pytest.raises(ValueError, match="different lengths"):
        DataProto.from_dict({"x": torch.zeros(3, 1)}, {"uid": ["a", "b"]})


def test_non_tensor_in_tensors_is_typeerror_naming_the_key():
    with pytest.raises(TypeError, match="tensors\\['x'\\] must be a torch.Tensor, got ndarray"):
        DataProto.from_dict({"x": np.zeros((2, 1))})


def test_tensors_with_different_batch_sizes_is_valueerror():
    with pytest.raises(ValueError, match="different batch sizes"):
        DataProto.from_dict({"x": torch.zeros(3), "y": torch.zeros(2)})


def test_index_by_int_slice_array_tensor_and_bool():
    data = make()
    assert data[1].non_tensor_batch["uid"].tolist() == ["u1"]
    assert data[-1].non_tensor_batch["uid"].tolist() == ["u4"]
    assert data[1:3].batch["input_ids"][:, 0].tolist() == [3, 6]
    assert data[[4, 0]].non_tensor_batch["uid"].tolist() == ["u4", "u0"]
    assert data[torch.tensor([2, 2])].batch["input_ids"][:, 0].tolist() == [6, 6]
    assert len(data[np.array([True, False, True, False, False])]) == 2
    assert data["uid"][0] == "u0"
    with pytest.raises(IndexError):
        data[5]


def test_select_and_pop():
    data = make()
    sub = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=["uid"])
    assert sub.batch_keys == ["input_ids"] and list(sub.non_tensor_batch) == ["uid"]
    popped = data.pop(batch_keys=["mask"], non_tensor_batch_keys=["raw"], meta_info_keys=["temperature"])
    assert popped.batch_keys == ["mask"] and "raw" in popped.non_tensor_batch
    assert data.batch_keys == ["input_ids"] and "raw" not in data.non_tensor_batch
    assert "temperature" not in data.meta_info
    with pytest.raises(KeyError, match="nope"):
        data.select(batch_keys=["nope"])


def test_union_merges_and_rejects_conflicts():
    a = make()
    b = DataProto.from_dict({"extra": torch.ones(5)}, {"uid": a.non_tensor_batch["uid"]}, {"step": 3})
    a.union(b)
    assert "extra" in a.batch_keys and a.meta_info["step"] == 3
    c = DataProto.from_dict({"extra": torch.zeros(5)})
    with pytest.raises(ValueError, match="extra"):
        a.union(c)
    d = DataProto.from_dict(non_tensors={"uid": ["x"] * 5})
    with pytest.raises(ValueError, match="uid"):
        a.union(d)


@pytest.mark.parametrize("n,k", [(10, 3), (7, 7), (3, 5), (8, 4)])
def test_chunk_sizes_differ_by_at_most_one_and_keep_order(n, k):
    data = make(n)
    parts = data.chunk(k)
    sizes = [len(p) for p in parts]
    assert len(parts) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert DataProto.concat(parts).batch["input_ids"].equal(data.batch["input_ids"])


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_chunk_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="chunk"):
        make().chunk(bad)


def test_chunks_and_slices_are_views_not_copies():
    data = make(6)
    first = data.chunk(3)[0]
    assert first.batch["input_ids"].data_ptr() == data.batch["input_ids"].data_ptr()
    assert data[2:4].batch["mask"].data_ptr() == data.batch["mask"][2:4].data_ptr()
    assert data[::-1].non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(5, -1, -1)]  # still works


def test_split_by_size():
    assert [len(p) for p in make(7).split(3)] == [3, 3, 1]


def test_concat_merges_metric_lists_and_rejects_different_keys():
    a, b = make(2), make(3)
    a.meta_info["metrics"] = {"loss": [1.0]}
    b.meta_info["metrics"] = {"loss": [2.0, 3.0], "kl": [0.1]}
    out = DataProto.concat([a, b])
    assert len(out) == 5
    assert out.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0], "kl": [0.1]}
    c = make(2)
    c.pop(batch_keys=["mask"])
    with pytest.raises(ValueError, match="mask"):
        DataProto.concat([a, c])


def test_repeat_interleave_and_tile():
    data = make(2)
    assert data.repeat(3, interleave=True).non_tensor_batch["uid"].tolist() == ["u0"] * 3 + ["u1"] * 3
    assert data.repeat(2, interleave=False).non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1"]


def test_reorder_permutes_and_rejects_non_permutation():
    data = make(4)
    data.reorder(torch.tensor([3, 1, 0, 2]))
    assert data.non_tensor_batch["uid"].tolist() == ["u3", "u1", "u0", "u2"]
    assert data.batch["input_ids"][:, 0].tolist() == [9, 3, 0, 6]
    with pytest.raises(ValueError, match="permutation"):
        data.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match="permutation"):
        data.reorder([0, 1])


def test_pad_and_unpad_round_trip():
    data = make(5)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    assert pad == 3 and len(padded) == 8
    back = unpad_dataproto(padded, pad)
    assert back.batch["input_ids"].equal(data.batch["input_ids"])
    assert pad_dataproto_to_divisor(data, 5)[1] == 0


def test_pickle_and_disk_round_trip(tmp_path):
    data = make()
    clone = pickle.loads(pickle.dumps(data))
    assert clone.batch["input_ids"].equal(data.batch["input_ids"])
    assert clone.non_tensor_batch["raw"][1] == [1, 2] and clone.meta_info == data.meta_info
    path = tmp_path / "d.pkl"
    data.save_to_disk(str(path))
    loaded = DataProto.load_from_disk(str(path))
    assert loaded.batch["mask"].equal(data.batch["mask"])


def test_pickle_of_large_batch_is_one_buffer_per_tensor():
    # 64 MB of int64: pickling size stays within a few KB of the raw tensor bytes.
    ids = torch.zeros(8192, 1024, dtype=torch.int64)
    data = DataProto.from_dict({"input_ids": ids})
    blob = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) - ids.numel() * 8 < 64 * 1024


def test_to_device_returns_self():
    data = make()
    assert data.to("cpu") is data


def _gather_worker(rank, world, port, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = rank + 1  # ranks hold different numbers of samples
    data = DataProto.from_dict({"x": torch.full((n, 2), rank)}, {"who": [f"r{rank}"] * n})
    out = all_gather_data_proto(data)
    queue.put((rank, out.batch["x"][:, 0].tolist(), out.non_tensor_batch["who"].tolist()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_all_gather_data_proto_over_two_gloo_processes():
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (x, w)) for r, x, w in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(2):
        assert results[rank] == ([0, 1, 1], ["r0", "r1", "r1"])
