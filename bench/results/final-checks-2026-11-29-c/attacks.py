"""Another user's attacks on a user's embedded server and warm tier (run as root; the
attacker is `nobody` through setpriv). Prints each attempt and whether it was refused, then
checks that the victim still reads the same bytes. Stops only the server it started."""
import hashlib, os, shutil, subprocess, sys, tempfile
import fitcache

work = tempfile.mkdtemp(prefix="fc-victim-")
os.chmod(work, 0o755)  # the attacker may reach the directory itself, as in a shared /tmp
data, run, tier = os.path.join(work, "data"), os.path.join(work, "run"), f"/dev/shm/fc-victim-{os.getpid()}"
os.makedirs(data)
names = [f"f{i}.bin" for i in range(200)]
for n in names:
    with open(os.path.join(data, n), "wb") as f:
        f.write(os.urandom(50_000))
opts = dict(runtime_dir=run, tiers=f"memory:{tier}:256MiB")

def digests(c):
    return {n: hashlib.sha256(c.read(n)).hexdigest() for n in names}

def as_nobody(code):
    p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=30)
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]

attacks = {
    "read the tier's index": f"open({tier!r} + '/fitcache.index', 'rb').read(1)",
    "truncate the tier's index": f"os.truncate({tier!r} + '/fitcache.index', 0)",
    "list the tier": f"os.listdir({tier!r})",
    "plant a file in the tier": f"open({tier!r} + '/x', 'w')",
    "plant a file in the runtime directory": f"open({run!r} + '/x', 'w')",
    "connect to the server's socket": f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({run!r} + '/server.sock')",
    "connect to the node socket": f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({run!r} + '/server.sock.node')",
}
try:
    with fitcache.Client(data, **opts) as c:
        want = digests(c)
        print("victim's runtime directory:", sorted(os.listdir(run)))
        for what, code in attacks.items():
            rc, last = as_nobody("import os\n" + code)
            print(f"{what}: {'refused' if rc != 0 else 'ALLOWED'} ({last[0][-90:]})")
        print("victim reads the same bytes after:", digests(c) == want)
    subprocess.run([shutil.which("fitcache") or "fitcache", "stop"], env={**os.environ, "FITCACHE_RUNTIME_DIR": run},
                   capture_output=True, timeout=30)
finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(tier, ignore_errors=True)
