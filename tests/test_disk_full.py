"""A disk that fills up during a save, on a real size-limited file system (world size 2, gloo).

The test mounts an 8 MiB tmpfs in a mount namespace of its own (``unshare``: no privileges needed
where user namespaces are allowed; as root, directly) and runs the job inside it. See
dist_cases/disk_full.py for what is saved and checked.
"""

import json
import shutil
import subprocess

import pytest

from launch import case, launch

WORLD = 2


def _namespace_works() -> bool:
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)
    return probe.returncode == 0


def test_full_disk_fails_every_rank_and_keeps_the_earlier_saves(tmp_path):
    if shutil.which("unshare") is None or not _namespace_works():
        pytest.fail("this test needs `unshare --mount --map-root-user` (util-linux, user namespaces) to mount a "
                    "size-limited tmpfs; the machine refuses it")
    folder = tmp_path / "small"
    folder.mkdir()
    out = tmp_path / "result.json"
    mount = ["unshare", "--mount", "--map-root-user", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs "$0" && exec "$@"',
             str(folder)]
    proc = launch("disk_full.py", WORLD, out, (str(folder),), timeout=600, wrapper=mount)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    _, r = case((WORLD, json.loads(out.read_text())), "disk_full")
    for rank, (sharded, full) in enumerate(r["errors"]):
        for what, error in (("save_checkpoint", sharded), ("save", full)):
            assert "No space left on device" in error, f"rank {rank}, {what}: {error}"
    assert r["step"] == 1 and r["checkpoint_intact"] and r["file_intact"], r
    assert r["leftovers"] == ["ballast", "ckpt", "model.safetensors"], "a failed save left files behind"
