"""Release artifacts: the manylinux wheel a cluster installs on nodes without Go
(scripts/wheel.sh), installed in a fresh virtualenv without Go, reads a file through the
cache; the Spack recipe (packaging/spack/package.py) parses."""

import ast
import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_manylinux_wheel_installs_without_go_and_reads(tmp_path):
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "wheel.sh"), str(tmp_path / "dist")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    wheel = out.stdout.split()[-1]
    assert "-py3-none-manylinux_" in os.path.basename(wheel), wheel
    names = zipfile.ZipFile(wheel).namelist()
    for part in ("fitcache/libfitcache.so", "fitcache/bin/fitcache", "fitcache/libfitcache_preload.so"):
        assert part in names, f"{part} not in the wheel: {names}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    no_go = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}  # Go lives elsewhere
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--no-deps", wheel],
                             env=no_go, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"from the cache " * 1000)
    shm = f"/dev/shm/fitcache-test-release-{os.getpid()}"
    code = ("import sys, fitcache\n"
            f"opts = dict(runtime_dir={str(tmp_path / 'run')!r}, tiers='memory:{shm}:64MiB')\n"
            f"with fitcache.Client({str(data)!r}, **opts) as c:\n"
            "    for _ in range(2):\n"
            "        buf = c.read('a.bin'); ok = bytes(buf) == b'from the cache ' * 1000; buf.release()\n"
            "        assert ok\n"
            "    print(c.stats()['server']['source_reads'])\n")
    try:
        run = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=no_go, cwd=str(tmp_path),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.split()[-1] == "1", run.stdout + run.stderr
    finally:
        subprocess.run([str(venv / "bin" / "fitcache"), "stop"], env={**no_go, "FITCACHE_RUNTIME_DIR": str(tmp_path / "run")},
                       capture_output=True, timeout=60)
        subprocess.run(["rm", "-rf", shm], timeout=60)


def test_the_spack_recipe_parses():
    path = os.path.join(REPO, "packaging", "spack", "package.py")
    tree = ast.parse(open(path).read(), path)
    (recipe,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert recipe.name == "Fitcache" and [b.id for b in recipe.bases] == ["PythonPackage"]
    calls = {n.func.id: n for n in ast.walk(recipe) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"version", "depends_on"} <= calls.keys()
    header = open(os.path.join(REPO, "capi", "fitcache.h")).read()  # FITCACHE_VERSION: the version's source
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "version" and
               f'#define FITCACHE_VERSION "{n.args[0].value}"' in header
               for n in ast.walk(recipe)), "the recipe's version is not the package's"
