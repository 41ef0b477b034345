// Package embedded runs the per-user embedded server: the zero-set-up mode in which a client
// with no servers configured talks to a FitCache server on this node over a Unix socket,
// starting it on demand.
//
// Everything lives in one runtime directory (0700, see config.Config.RuntimeDir):
//
//	server.sock   the server's socket
//	server.lock   held (flock) by the running server for its whole life: at most one runs
//	spawn.lock    held by the client that is starting a server: at most one starts it, the
//	              other clients wait for it
//	server.log    the server's log
//
// Usage (client side):
//
//	err := embedded.EnsureRunning(ctx, cfg, ping)
package embedded

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/rpc"
)

// File names inside the runtime directory.
const (
	SocketName = "server.sock"
	serverLock = "server.lock"
	spawnLock  = "spawn.lock"
	LogName    = "server.log"
)

// ErrAlreadyRunning reports that another embedded server holds the server lock.
var ErrAlreadyRunning = errors.New("an embedded fitcache server is already running")

// SocketPath returns the embedded server's socket in a runtime directory.
func SocketPath(runtimeDir string) string { return filepath.Join(runtimeDir, SocketName) }

// PrepareDir creates the runtime directory (and missing parents) with mode 0700 and refuses
// one that is not private (see privdir): a symbolic link, or another user's directory. Its
// socket must reach only this user's server. A directory of ours with a looser mode is set to
// 0700 without following links.
func PrepareDir(dir string) error {
	d, err := privdir.Make(dir, true)
	if errors.Is(err, privdir.ErrNotPrivate) {
		return fmt.Errorf("runtime directory: %w (set FITCACHE_RUNTIME_DIR to a directory of yours)", err)
	}
	if err != nil {
		return fmt.Errorf("runtime directory: %w", err)
	}
	return d.Close()
}

// CheckSocket makes sure that a client talking to the embedded server in dir talks to this
// user's server: an existing runtime directory must be this user's (see PrepareDir), and a socket
// file in it that is not a socket of this user (left there while the directory was open to
// others) is removed, so that a server of this user is started instead. A missing directory
// is fine: EnsureRunning creates it.
func CheckSocket(dir string) error {
	if err := privdir.Inspect(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err := PrepareDir(dir); err != nil { // ours with a loose mode is made private
		return err
	}
	path := SocketPath(dir)
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return nil // no server yet
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFSOCK || int(st.Uid) != os.Geteuid() {
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("%s is not a socket of this user and cannot be removed: %w", path, err)
		}
	}
	return nil
}

// LockServer takes the lock that a running embedded server holds until it exits, waiting up
// to wait for a server that is exiting to release it. It returns an error wrapping
// ErrAlreadyRunning when another server still holds it. Closing the file releases the lock
// (so does the process's death, whatever kills it).
func LockServer(dir string, wait time.Duration) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, serverLock), os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(wait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, err
		}
		if time.Now().After(deadline) {
			f.Close()
			return nil, fmt.Errorf("%w (pid %d)", ErrAlreadyRunning, RunningPID(dir))
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.Truncate(0)
	fmt.Fprintf(f, "%d\n", os.Getpid())
	return f, nil
}

// RunningPID returns the pid of the embedded server running in dir, or 0 if none runs.
func RunningPID(dir string) int {
	f, err := os.OpenFile(filepath.Join(dir, serverLock), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return 0
	}
	defer f.Close()
	if syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB) == nil {
		return 0 // nobody holds the lock
	}
	var pid int
	fmt.Fscan(f, &pid)
	return pid
}

// ErrNotAnswering reports an embedded server that holds the server lock but does not answer
// (stopped, hung, or still rescanning its tiers): clients read the source meanwhile.
var ErrNotAnswering = errors.New("the embedded fitcache server does not answer")

// EnsureRunning makes sure an embedded server answers ping, starting one if none runs.
// Among clients that call it at the same time, the one that takes the spawn lock starts the
// server and the others wait for the lock, then find the server running.
//
// It never waits long on a server that cannot answer: if ping fails while a server holds the
// server lock, it returns ErrNotAnswering at once, and it stops waiting as soon as the
// server it started exits. Otherwise it gives up when ctx ends or after cfg.StartTimeout.
func EnsureRunning(ctx context.Context, cfg config.Config, ping func(context.Context) error) error {
	err := ping(ctx)
	if err == nil {
		return nil
	}
	if pid := RunningPID(cfg.RuntimeDir); pid != 0 && !rpc.IsRefused(err) {
		return fmt.Errorf("%w (pid %d, which holds %s): %v", ErrNotAnswering, pid,
			filepath.Join(cfg.RuntimeDir, serverLock), err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancel()
	if err := PrepareDir(cfg.RuntimeDir); err != nil {
		return err
	}
	unlock, err := lockSpawn(ctx, cfg.RuntimeDir)
	if err != nil {
		return err
	}
	defer unlock()
	if ping(ctx) == nil { // another client started it while we waited
		return nil
	}
	proc, err := spawn(cfg)
	if err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- proc.Wait() }() // reap it if it exits while we live
	logPath := filepath.Join(cfg.RuntimeDir, LogName)
	for {
		if ping(ctx) == nil {
			return nil
		}
		select {
		case err := <-exited:
			// Exit 0: it found another server holding the lock that did not let go in time.
			if ping(ctx) == nil {
				return nil
			}
			if pid := RunningPID(cfg.RuntimeDir); err == nil && pid != 0 {
				return fmt.Errorf("%w: another server (pid %d) holds the lock (see %s)", ErrNotAnswering, pid, logPath)
			}
			if err == nil {
				return fmt.Errorf("embedded fitcache server %s exited without serving (see %s)", proc.Path, logPath)
			}
			return fmt.Errorf("embedded fitcache server exited: %v (see %s)", err, logPath)
		case <-ctx.Done():
			return fmt.Errorf("embedded fitcache server did not answer within %s (see %s)", cfg.StartTimeout, logPath)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// HoldOff keeps an embedded server from starting in dir while the caller works on its tiers
// without one: it takes the spawn lock (a client that would start a server waits for it, up
// to its start_timeout) and then the server lock (a server started by hand exits at once).
// It fails with an error wrapping ErrAlreadyRunning when a server runs. release gives both
// locks back.
func HoldOff(ctx context.Context, dir string) (release func(), err error) {
	if err := PrepareDir(dir); err != nil {
		return nil, err
	}
	unlock, err := lockSpawn(ctx, dir)
	if err != nil {
		return nil, err
	}
	lock, err := LockServer(dir, 0)
	if err != nil {
		unlock()
		return nil, err
	}
	return func() { lock.Close(); unlock() }, nil
}

// lockSpawn takes the spawn lock, polling so that the wait honours ctx.
func lockSpawn(ctx context.Context, dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, spawnLock), os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, err
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for another process to start the fitcache server: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// spawn starts `fitcache serve --embedded` detached from the caller (own session, output to
// the log), passing the configuration through the environment.
func spawn(cfg config.Config) (*exec.Cmd, error) {
	bin := cfg.ServerBin
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("fitcache"); err != nil {
			return nil, errors.New("cannot start the embedded fitcache server: no server_bin option, " +
				"FITCACHE_SERVER_BIN or fitcache executable on PATH")
		}
	}
	logf, err := os.OpenFile(filepath.Join(cfg.RuntimeDir, LogName), os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "serve", "--embedded")
	cmd.Env = append(ServerEnviron(os.Environ()),
		"FITCACHE_TIERS="+cfg.Tiers,
		"FITCACHE_IDLE_TIMEOUT="+cfg.IdleTimeout.String(),
		"FITCACHE_VERIFY="+strconv.FormatBool(cfg.Verify),
		"FITCACHE_PREFETCH="+strconv.Itoa(cfg.Prefetch),
		"FITCACHE_BLOCK_SIZE="+strconv.FormatInt(cfg.BlockBytes, 10),
		"FITCACHE_MEMORY_AT_EXIT="+string(cfg.MemoryAtExit),
		"FITCACHE_MEMORY_RESERVE="+cfg.MemoryReserve.String(),
		"FITCACHE_MEMORY_LIMIT="+map[bool]string{true: "cgroup", false: "none"}[cfg.FollowCgroup])
	if cfg.RuntimeDirWarning == "" {
		// Else the runtime directory is the private stand-in for the default one: the server
		// finds it the same way, and reports why.
		cmd.Env = append(cmd.Env, "FITCACHE_RUNTIME_DIR="+cfg.RuntimeDir)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start embedded fitcache server %s: %w", bin, err)
	}
	return cmd, nil
}

// ServerEnviron returns env without what makes a process read through the preload shim (the
// shim in LD_PRELOAD, FITCACHE_PRELOAD_*): a server started from a program run by `fitcache
// run` must read the sources themselves. Go opens files with system calls, not through
// libc, so the shim would not see them anyway; this keeps it out of the server's cgo code and
// of what the server starts. Other preloaded libraries stay.
func ServerEnviron(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		switch {
		case strings.HasPrefix(kv, "FITCACHE_PRELOAD_"):
			continue
		case strings.HasPrefix(kv, "LD_PRELOAD="):
			var kept []string
			for _, lib := range strings.FieldsFunc(kv[len("LD_PRELOAD="):], func(r rune) bool { return r == ' ' || r == ':' }) {
				if filepath.Base(lib) != PreloadLibrary {
					kept = append(kept, lib)
				}
			}
			if len(kept) == 0 {
				continue
			}
			kv = "LD_PRELOAD=" + strings.Join(kept, " ")
		}
		out = append(out, kv)
	}
	return out
}

// PreloadLibrary is the file name of the preload shim (preload/).
const PreloadLibrary = "libfitcache_preload.so"
