package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/embedded"
)

// stopCmd stops the embedded server of the runtime directory: SIGTERM to the pid its
// server lock names, once that process is known to be a fitcache server of this user, then
// a bounded wait for it to let go of the lock. The server finishes the files it is writing
// and exits; its tiers keep what they hold (fitcache clear removes it).
func stopCmd(args []string) error {
	fset := flag.NewFlagSet("stop", flag.ExitOnError)
	timeout := fset.Duration("timeout", 10*time.Second, "how long to wait for the server to exit")
	fset.Usage = func() {
		fmt.Fprintln(fset.Output(), "usage: fitcache stop [--timeout D]\n\n"+
			"Stops the embedded server of this runtime directory (FITCACHE_RUNTIME_DIR). The cache stays in its tiers.")
		fset.PrintDefaults()
	}
	fset.Parse(args)
	if fset.NArg() != 0 {
		fset.Usage()
		os.Exit(2)
	}
	cfg, err := config.Load(nil)
	if err != nil {
		return err
	}
	pid := embedded.RunningPID(cfg.RuntimeDir)
	if pid == 0 {
		fmt.Printf("no embedded server runs in %s\n", cfg.RuntimeDir)
		return nil
	}
	if err := checkServerProcess(pid); err != nil {
		return fmt.Errorf("not stopping pid %d, which holds the server lock in %s: %w", pid, cfg.RuntimeDir, err)
	}
	start := time.Now()
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal pid %d: %w", pid, err)
	}
	for embedded.RunningPID(cfg.RuntimeDir) == pid {
		if time.Since(start) > *timeout {
			return fmt.Errorf("the embedded server (pid %d) still runs after %s (it finishes the files it is writing first; "+
				"see %s/%s); 'kill -KILL %d' ends it at once", pid, *timeout, cfg.RuntimeDir, embedded.LogName, pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Printf("stopped the embedded server (pid %d) in %s\n", pid, time.Since(start).Round(time.Millisecond))
	return nil
}

// errNotOurServer reports a process that is not an embedded fitcache server of this user.
var errNotOurServer = errors.New("not an embedded fitcache server of this user")

// checkServerProcess makes sure that pid is a process of this user running
// `... serve --embedded`, the command line an embedded server has.
func checkServerProcess(pid int) error {
	proc := "/proc/" + strconv.Itoa(pid)
	var st syscall.Stat_t
	if err := syscall.Stat(proc, &st); err != nil {
		return fmt.Errorf("%w: %v", errNotOurServer, err)
	}
	if int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: it runs as uid %d", errNotOurServer, st.Uid)
	}
	cmdline, err := os.ReadFile(proc + "/cmdline")
	if err != nil {
		return fmt.Errorf("%w: %v", errNotOurServer, err)
	}
	argv := bytes.Split(bytes.TrimRight(cmdline, "\x00"), []byte{0})
	isEmbedded := false
	for _, a := range argv[min(2, len(argv)):] {
		isEmbedded = isEmbedded || string(a) == "--embedded"
	}
	if len(argv) < 2 || string(argv[1]) != "serve" || !isEmbedded {
		return fmt.Errorf("%w: its command is %q", errNotOurServer, bytes.Join(argv, []byte(" ")))
	}
	return nil
}
