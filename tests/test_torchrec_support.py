"""Loading TorchRec: the pinned pair loads; another version or a missing one is a clear error
naming what was found and the install command (issue 22, point 5)."""
import pytest

from mpickpt.model.torchrec_support import (TorchRecUnavailable, check_versions,
                                            installed_version, load_torchrec)


@pytest.mark.parametrize("versions,found", [
    ({"torchrec": "1.9.0", "fbgemm-gpu": "1.8.0"}, r"torchrec 1.9.0 \(expected 1.8.x\)"),
    ({"torchrec": "1.8.0", "fbgemm-gpu": None}, r"fbgemm-gpu not installed \(expected 1.8.x\)"),
])
def test_versions_outside_the_pin_are_refused_with_the_install_command(versions, found):
    with pytest.raises(TorchRecUnavailable, match=found + r".*pip install --no-deps -r "
                                                          r"requirements-torchrec.txt"):
        check_versions(versions)


def test_the_pinned_pair_loads():
    if installed_version("torchrec") is None:
        pytest.skip("torchrec is not installed (.ci/run installs it)")
    torchrec = load_torchrec()
    assert installed_version("torchrec").startswith("1.8.")
    assert hasattr(torchrec, "EmbeddingBagCollection")
