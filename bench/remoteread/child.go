package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strings"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// The servers run in child processes, so that each side's CPU time is its own: the parent
// reads a child's process CPU clock. A child is this program run again with roleEnv set; it
// prints the address it listens on, then serves until its standard input closes. A line
// "profile PATH" on its input starts a CPU profile, "stop" ends it (answered with "ok").
const (
	roleEnv  = "REMOTEREAD_ROLE" // "fitcache" or "plain"
	dataEnv  = "REMOTEREAD_DATA" // the directory of the files served
	tierEnv  = "REMOTEREAD_TIER" // the FitCache server's memory tier
	benchJob = "remoteread-bench-token"
)

// child is a server process started by the parent.
type child struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	addr string
	cpu  cpuClock
}

// startChild runs this program as the server role over the files in data.
func startChild(role, data, tier string) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), roleEnv+"="+role, dataEnv+"="+data, tierEnv+"="+tier)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, in: in, out: bufio.NewReader(out), cpu: processCPU(cmd.Process.Pid)}
	line, err := c.out.ReadString('\n')
	if err != nil {
		c.stop()
		return nil, fmt.Errorf("%s server did not start: %w", role, err)
	}
	c.addr = strings.TrimSpace(line)
	return c, nil
}

// profile starts (path set) or stops (path empty) the child's CPU profile.
func (c *child) profile(path string) error {
	cmd := "stop\n"
	if path != "" {
		cmd = "profile " + path + "\n"
	}
	if _, err := io.WriteString(c.in, cmd); err != nil {
		return err
	}
	_, err := c.out.ReadString('\n')
	return err
}

// stop ends the child and waits for it.
func (c *child) stop() {
	c.in.Close()
	c.cmd.Wait()
}

// runChild serves as the role in the environment, if any, and reports whether it did.
func runChild() bool {
	role := os.Getenv(roleEnv)
	if role == "" {
		return false
	}
	rpc.QuietKitexLogs()
	data := os.Getenv(dataEnv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	switch role {
	case "fitcache":
		engine, err := core.NewEngine(core.EngineConfig{Roots: []string{data},
			Tiers: []tiers.Config{{Dir: os.Getenv(tierEnv), Kind: tiers.Memory, Budget: "8GiB"}}}, nil)
		if err != nil {
			log.Fatal(err)
		}
		defer engine.Close()
		srv, _, _ := rpc.Serve(engine, ln, rpc.ServerConfig{Token: benchJob, ID: "bench"})
		defer srv.Stop()
	case "plain":
		go servePlain(ln, loadFiles(data))
	default:
		log.Fatalf("unknown role %q", role)
	}
	fmt.Println(ln.Addr().String())
	commands(os.Stdin, os.Stdout)
	return true
}

// commands runs the parent's commands until its input closes.
func commands(in io.Reader, out io.Writer) {
	lines := bufio.NewScanner(in)
	for lines.Scan() {
		cmd, arg, _ := strings.Cut(lines.Text(), " ")
		switch cmd {
		case "profile":
			f, err := os.Create(arg)
			if err == nil {
				err = pprof.StartCPUProfile(f)
			}
			if err != nil {
				log.Fatal(err)
			}
		case "stop":
			pprof.StopCPUProfile()
		}
		fmt.Fprintln(out, "ok")
	}
	pprof.StopCPUProfile()
}

// loadFiles reads every file of dir into memory, by path.
func loadFiles(dir string) map[string][]byte {
	data := map[string][]byte{}
	entries, err := os.ReadDir(dir)
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(p)
		if err != nil {
			log.Fatal(err)
		}
		data[p] = b
	}
	return data
}

// servePlain answers "path\n" with an 8-byte length and the file's bytes from memory: the
// least any remote read can cost.
func servePlain(ln net.Listener, data map[string][]byte) {
	for {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer conn.Close()
			r := bufio.NewReader(conn)
			for {
				line, err := r.ReadString('\n')
				if err != nil {
					return
				}
				b := data[strings.TrimSuffix(line, "\n")]
				var hdr [8]byte
				binary.LittleEndian.PutUint64(hdr[:], uint64(len(b)))
				bufs := net.Buffers{hdr[:], b}
				if _, err := bufs.WriteTo(conn); err != nil {
					return
				}
			}
		}()
	}
}
