package discovery

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestTopologyGivesEachNodeItsDomain(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "topology.conf")
	os.WriteFile(conf, []byte("# Slurm's tree topology\nSwitchName=s1 Nodes=gpu[001-002]\n"+
		"SwitchName=s2 Nodes=gpu[003-004] LinkSpeed=100\nSwitchName=top Switches=s[1-2]\n"), 0o644)
	pairs := filepath.Join(dir, "racks")
	os.WriteFile(pairs, []byte("gpu001 rackA\ngpu002 rackA # same rack\n\ngpu003 rackB\n"), 0o644)
	for _, tc := range []struct {
		topology string
		want     map[string]string // node -> domain
	}{
		{"", map[string]string{"gpu001": "", "gpu004": ""}},
		{"@" + conf, map[string]string{"gpu001": "s1", "gpu002": "s1", "gpu003": "s2", "gpu004": "s2"}},
		{"@" + pairs, map[string]string{"gpu001": "rackA", "gpu002": "rackA", "gpu003": "rackB", "gpu004": ""}},
		{`re:^gpu00([12])`, map[string]string{"gpu001": "1", "gpu002": "2", "gpu003": ""}},
		{`re:^gpu`, map[string]string{"gpu001": "gpu"}},
	} {
		members, err := Discover(Spec{Servers: "gpu001,gpu002,gpu003,gpu004", Topology: tc.topology})
		if err != nil {
			t.Fatalf("%s: %v", tc.topology, err)
		}
		got := map[string]string{}
		for _, m := range members {
			got[m.Node] = m.Domain
		}
		for node, want := range tc.want {
			if got[node] != want {
				t.Errorf("topology %q: %s in %q, want %q", tc.topology, node, got[node], want)
			}
		}
	}
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte("gpu001 rackA extra\n"), 0o644)
	for _, topology := range []string{"rack", "re:(", "@" + bad, "@" + filepath.Join(dir, "missing")} {
		if _, err := Discover(Spec{Servers: "gpu001", Topology: topology}); err == nil {
			t.Errorf("topology %q: no error", topology)
		}
	}
}

// A topology or hostfile put in place by someone else is read by every client process at
// start: a FIFO, a directory or a device is refused without blocking, a file over
// maxFileBytes is refused from its size, and a few lines naming millions of hosts are
// refused at maxHosts in all.
func TestHostileListFilesAreRefused(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big")
	var lines strings.Builder
	for i := 0; lines.Len() <= maxFileBytes; i++ {
		fmt.Fprintf(&lines, "gpu%07d rack%d\n", i, i%64) // each line valid: only the size is wrong
	}
	if err := os.WriteFile(big, []byte(lines.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	wide := filepath.Join(dir, "wide") // 40 lines of 100,000 hosts each, 1.5 KB
	lines.Reset()
	for i := range 40 {
		fmt.Fprintf(&lines, "SwitchName=s%d Nodes=h%02d-[000000-099999]\n", i, i)
	}
	if err := os.WriteFile(wide, []byte(lines.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	hostfile := filepath.Join(dir, "hosts")
	if err := os.WriteFile(hostfile, []byte("gpu001\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		spec     Spec
		wantErrs []string // each in the error
	}{
		{"topology FIFO", Spec{Servers: "gpu001", Topology: "@" + fifo}, []string{fifo, "not a regular file (a FIFO)"}},
		{"hostfile FIFO", Spec{Servers: "@" + fifo}, []string{fifo, "not a regular file (a FIFO)"}},
		{"topology directory", Spec{Servers: "gpu001", Topology: "@" + dir}, []string{"not a regular file (a directory)"}},
		{"topology device", Spec{Servers: "gpu001", Topology: "@/dev/zero"}, []string{"not a regular file (a character device)"}},
		{"topology too large", Spec{Servers: "gpu001", Topology: "@" + big}, []string{big, "more than the 8388608"}},
		{"hostfile too large", Spec{Servers: "@" + big}, []string{big, "more than the 8388608"}},
		{"topology of too many hosts", Spec{Servers: "@" + hostfile, Topology: "@" + wide},
			[]string{wide + ":2:", "100000 hosts in the file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				_, err := Discover(tc.spec)
				done <- err
			}()
			var err error
			select {
			case err = <-done:
			case <-time.After(20 * time.Second):
				// Release an open blocked on the FIFO (the code before this test) so that
				// the goroutine ends: an open for writing lets it through, to EOF.
				if w, werr := os.OpenFile(fifo, os.O_RDWR, 0); werr == nil {
					w.Close()
				}
				t.Fatalf("Discover(%+v) still blocked after 20 s", tc.spec)
			}
			if err == nil {
				t.Fatalf("Discover(%+v): no error", tc.spec)
			}
			for _, want := range tc.wantErrs {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Discover(%+v): error %q, want it to say %q", tc.spec, err, want)
				}
			}
		})
	}
}

// A file that grows past maxFileBytes after its size was checked fails rather than being
// read whole or cut short.
func TestListFileThatGrowsIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(path, []byte("gpu001\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := openListFile("hostfile", path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.Truncate(path, maxFileBytes+1); err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, f)
	if err == nil || !strings.Contains(err.Error(), "grew past") {
		t.Errorf("read %d bytes of a file grown past %d: error %v, want one saying it grew past", n, maxFileBytes, err)
	}
}
