"""The Python fallback read of a source file (fitcache.dataset._read_source: what a forked
DataLoader worker reads with when the native library cannot be used) keeps to the dataset
root as the Go (core.OpenSource) and C (capi hit path) source reads do: no path, link or
special file takes it outside the root or makes it wait."""

import errno
import os

import pytest

from fitcache import _native
from fitcache.dataset import _read_source


@pytest.fixture
def tree(tmp_path):
    """root/ with a file, a subdirectory, links inside and out, a FIFO; a secret outside."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.bin").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "b.bin").write_bytes(b"outside too")
    os.symlink(tmp_path / "secret", root / "link-out")  # a file link leading out
    os.symlink(tmp_path / "outdir", root / "dir-out")  # a directory link leading out
    os.symlink("sub/a.bin", root / "link-in")  # a link that stays inside
    os.mkfifo(root / "fifo")
    return str(root), os.path.realpath(root)


def read(path, tree):
    root, real_root = tree
    return _read_source(path, root, real_root)


def test_files_inside_the_root_are_read(tree):
    assert bytes(read("sub/a.bin", tree)) == b"inside"
    assert bytes(read(os.path.join(tree[0], "sub", "a.bin"), tree)) == b"inside"  # absolute, inside
    assert bytes(read("sub/../sub/a.bin", tree)) == b"inside"  # normalised, stays inside
    assert bytes(read("link-in", tree)) == b"inside"


@pytest.mark.parametrize("path", ["../secret", "sub/../../secret", "/etc/passwd", "./../root/../secret"])
def test_paths_that_leave_the_root_are_refused(tree, path):
    with pytest.raises(_native.PermissionDenied) as e:
        read(path, tree)
    assert e.value.errno == errno.EACCES
    assert "outside the dataset root" in str(e.value)


@pytest.mark.parametrize("path", ["link-out", "dir-out/b.bin"])
def test_links_that_lead_out_of_the_root_are_refused(tree, path):
    with pytest.raises(_native.PermissionDenied, match="resolves to"):
        read(path, tree)


def test_a_root_named_like_a_prefix_of_another_is_not_a_way_out(tmp_path):
    """/x/root does not contain /x/root-evil, though the string starts the same."""
    (tmp_path / "root").mkdir()
    (tmp_path / "root-evil").mkdir()
    (tmp_path / "root-evil" / "f").write_bytes(b"evil")
    root = str(tmp_path / "root")
    with pytest.raises(_native.PermissionDenied):
        _read_source("../root-evil/f", root, os.path.realpath(root))


def test_special_files_and_errors(tree):
    with pytest.raises(_native.FitCacheError) as e:
        read("fifo", tree)  # refused at once, never waiting for a writer
    assert e.value.errno == errno.EINVAL
    with pytest.raises(_native.IsADirectory):
        read("sub", tree)
    with pytest.raises(_native.NotFound):
        read("sub/missing.bin", tree)
    with pytest.raises(ValueError):
        read("sub/a\0.bin", tree)
