"""The mmap KV tier (kv_offload.py's HostKVStore, backend ``mmap``) on a disk that cannot hold it:
a clear ENOSPC error when it is made, naming the folder and the sizes, never a sparse file that
SIGBUSes the engine at its first write of an unbacked page. One that fits is written and read."""

import errno
import os

import pytest
import torch

from kvserve.engine.kv_offload import HostKVStore


def _caches():
    return [(torch.zeros(4, 16, 1, 8), torch.zeros(4, 16, 1, 8))]  # one layer: [blocks, bs, kv_heads, head_dim]


def test_an_mmap_tier_larger_than_the_free_disk_is_refused_at_start(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    slot_bytes = 2 * 16 * 1 * 8 * 4  # K and V of one block, float32
    with pytest.raises(OSError) as e:
        HostKVStore(_caches(), free // slot_bytes + 1024, "mmap", str(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert str(tmp_path) in str(e.value) and "kv_offloading_path" in str(e.value)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_an_mmap_tier_that_fits_holds_its_blocks(tmp_path):
    store = HostKVStore(_caches(), 8, "mmap", str(tmp_path))
    store.data[0, 1, 7] = 3.0
    assert float(store.data[0, 1, 7].sum()) == 3.0 * 16 * 8
    assert os.listdir(tmp_path) == []  # unlinked at once: it lives as long as the store
