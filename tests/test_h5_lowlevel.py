"""Writers make HDF5 objects through h5py's low-level API (`store.h5_lowlevel`) to save CPU: the
files must be the ones h5py's high-level calls make, and attributes must read back exactly as h5py
reads them, or files written before (and their attribute digests) would stop verifying."""
import hashlib

import h5py
import numpy as np
import pytest

from mpickpt.store import attr_digest, h5_lowlevel, shard_file
from mpickpt.store.shard_file import CRC_SUFFIX, block_crcs, open_hdf5, read_rows, write_dataset

ARRAYS = {"weight": np.arange(11 * 3, dtype=np.float32).reshape(11, 3),
          "gids": np.arange(100, 111, dtype=np.int64), "sum": np.linspace(0, 1, 11, dtype=np.float16),
          "empty": np.zeros((0, 4), dtype=np.float32), "one": np.array(7, dtype=np.int32)}


def test_datasets_are_the_ones_h5py_makes_and_blocks_land_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file, "BLOCK_ROWS", 4)  # 11 rows: blocks of 4, 4, 3 (hyperslabs)
    with open_hdf5(str(tmp_path / "low.h5"), "w") as low, \
            open_hdf5(str(tmp_path / "high.h5"), "w") as high:
        for name, a in ARRAYS.items():
            write_dataset(low.require_group("t/3"), name, a)
            high.require_group("t/3").create_dataset(name, data=a.reshape(-1) if a.ndim == 0
                                                     else a)
        for name, a in ARRAYS.items():
            got, ref = low[f"t/3/{name}"], high[f"t/3/{name}"]
            assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
            np.testing.assert_array_equal(got[()], ref[()])
            plist, ref_plist = got.id.get_create_plist(), ref.id.get_create_plist()
            assert plist.get_layout() == ref_plist.get_layout() == h5py.h5d.CONTIGUOUS
            assert not plist.get_obj_track_times() and not ref_plist.get_obj_track_times()
            low_group, high_group = low["t/3"], high["t/3"]
            assert low_group.id.links.get_info(name.encode()).cset == \
                high_group.id.links.get_info(name.encode()).cset
            np.testing.assert_array_equal(low[f"t/3/{name}{CRC_SUFFIX}"][()],
                                          block_crcs(got[()], 4))
        assert low["t/3/one"].attrs["scalar"]


VALUES = {"int": 5, "big": np.int64(2**40), "float": 0.25, "vector": np.arange(3, dtype=np.int64),
          "f16": np.float16(1.5), "text": "codec {\"bits\": 4}", "bytes": np.bytes_(b"abc"),
          "flag": True, "strings": np.array(["a", "bc"], dtype=h5py.string_dtype()),
          "none": h5py.Empty("f4"), "pairs": np.zeros(2, dtype="(3,)i4")}


def test_attributes_set_and_read_as_h5py_does(tmp_path):
    with open_hdf5(str(tmp_path / "a.h5"), "w") as f:
        low, high = h5_lowlevel.create_group(f, "low/g"), f.create_group("high/g")
        h5_lowlevel.set_attrs(low, VALUES)
        high.attrs.update(VALUES)
        h5_lowlevel.set_attrs(low, {"int": 6})  # replaces
        high.attrs["int"] = 6
        got = dict(h5_lowlevel.read_attrs(low.id))
        ref = {k: high.attrs[k] for k in high.attrs}
        assert set(got) == set(ref) == set(VALUES)
        for key, value in ref.items():
            assert type(got[key]) is type(value), key
            if isinstance(value, h5py.Empty):
                assert got[key].dtype == value.dtype
                continue
            assert np.asarray(got[key]).dtype == np.asarray(value).dtype, key
            np.testing.assert_array_equal(got[key], value)
            assert np.asarray(low.attrs[key]).dtype == np.asarray(value).dtype, key
        assert got["int"] == 6 and got["text"] == VALUES["text"]
        for key in VALUES:  # the same HDF5 types on disk (a str: vlen UTF-8), not only values
            stored, ref_type = low.attrs.get_id(key).get_type(), high.attrs.get_id(key).get_type()
            assert stored.equal(ref_type), key
            if isinstance(VALUES[key], str):
                assert stored.is_variable_str() and stored.get_cset() == h5py.h5t.CSET_UTF8


def _reference_digest(f) -> bytes:
    """The digest computed through h5py's high-level API only (what files were sealed with before
    the low-level reads)."""
    found = [("/", len(f.attrs))]
    f.visititems(lambda name, obj: found.append((name, len(obj.attrs))))
    h = hashlib.sha256()
    for name, count in sorted(found):
        if name.startswith(attr_digest.DIGEST):
            continue
        h.update(f"{name}\0".encode())
        attrs = (f if name == "/" else f[name]).attrs
        for key in sorted(attrs.keys()) if count else []:
            value = attr_digest._canonical(attrs[key])
            h.update(f"{key}\0{value.dtype.str}\0{value.shape}\0".encode())
            h.update(value.tobytes())
    return h.digest()


def test_the_attribute_digest_is_unchanged(tmp_path):
    with open_hdf5(str(tmp_path / "d.h5"), "w") as f:
        f.attrs.update({"format_version": shard_file.FORMAT_VERSION, "step": 3, "kind": "full",
                        "codec": "fp32"})
        g = f.create_group("tables/0")
        g.attrs.update({"gid_min": 0, "gid_max": 9})
        h5_lowlevel.set_attrs(f.create_group("tables/0/weight"), VALUES)
        write_dataset(g, "gids", np.arange(10))
        shard_file.seal_attributes(f)
    with h5py.File(str(tmp_path / "d.h5"), "r") as f:
        assert attr_digest.attrs_digest(f) == _reference_digest(f)
        f.close()
    shard_file.open_shard(str(tmp_path / "d.h5")).close()  # verifies against the sealed digest


def test_slabs_clamp_like_slices(tmp_path):
    with open_hdf5(str(tmp_path / "s.h5"), "w") as f:
        write_dataset(f, "w", ARRAYS["weight"])
        np.testing.assert_array_equal(read_rows(f["w"], 3, 9, "s.h5"), ARRAYS["weight"][3:9])
        ds = h5_lowlevel.write_array(f, "x", np.arange(10))
        assert h5_lowlevel.read_slab(ds, 8, 20).tolist() == [8, 9]
        assert h5_lowlevel.read_slab(ds, 12, 20).size == 0
        with pytest.raises(KeyError):
            h5_lowlevel.open_sibling(ds, b"/y")


def test_a_digest_from_the_writers_record_is_the_digest_read_back(tmp_path, monkeypatch):
    """A writer seals a file from the attributes it set (`AttrRecord`), not by reading them
    back: every value must digest as its read-back does. An object with attributes set outside
    the record, or with an Empty one, is read."""
    path, read = str(tmp_path / "r.h5"), []
    plain = {k: v for k, v in VALUES.items() if not isinstance(v, h5py.Empty)}
    monkeypatch.setattr(attr_digest, "read_attrs",
                        lambda obj: read.append(obj) or h5_lowlevel.read_attrs(obj))
    with open_hdf5(path, "w") as f:
        record = attr_digest.AttrRecord()
        record.set(f, {"format_version": shard_file.FORMAT_VERSION, **plain})
        record.set(h5_lowlevel.create_group(f, "rows"), {"tables": [(0, 0, 5, 0, 9)], **plain})
        record.set(h5_lowlevel.create_group(f, "rows/empty"), VALUES)
        record.set(h5_lowlevel.create_group(f, "rows/bytes"), {"b": b"xyz"})  # reads back as str
        vector = np.arange(4)
        record.set(h5_lowlevel.create_group(f, "rows/vector"), {"v": vector})
        vector[0] = 9  # changed after it was set: the file holds the old value
        g = h5_lowlevel.create_group(f, "rows/state")
        record.set(g, {"a": 1})
        g.attrs["b"] = 2.5  # not recorded
        write_dataset(f, "rows/gids", np.arange(10))
        shard_file.seal_attributes(f, record)
    assert len(read) == 3  # rows/empty, rows/bytes, rows/state; the others from the record
    with h5py.File(path, "r") as f:
        assert attr_digest.attrs_digest(f) == _reference_digest(f)
        assert f[attr_digest.DIGEST][()].tobytes() == attr_digest.attrs_digest(f)
    shard_file.open_shard(path).close()
    with open_hdf5(path, "r+") as f:  # an attribute that disagrees with the digest: damage
        f.attrs["int"] = 8
    with pytest.raises(shard_file.CheckpointCorruptError, match="digest"):
        shard_file.open_shard(path)


def test_a_digest_dataset_of_the_wrong_shape_is_damage(tmp_path):
    path = str(tmp_path / "z.h5")
    with open_hdf5(path, "w") as f:
        f.attrs["format_version"] = shard_file.FORMAT_VERSION
        f.create_dataset(attr_digest.DIGEST, data=np.uint8(1))  # 0-d, not the 32-byte digest
        f.create_dataset(attr_digest.DIGEST + CRC_SUFFIX, data=np.uint32(0))
    with pytest.raises(shard_file.CheckpointCorruptError, match="_attrs"):
        shard_file.open_shard(path)
