package client_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/server"
	"github.com/fitcache/fitcache/tiers"
)

// freeAddr returns host:port with a port free on host now.
func freeAddr(t *testing.T, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// nodeJob is a job of two servers on two loopback nodes, A (the reader's node) and B, each a
// real cluster server with its node socket, its runtime directory and a memory tier.
type nodeJob struct {
	root     string
	addrs    [2]string
	runDirs  [2]string
	tierDirs [2]string
	servers  [2]*server.Server
	cluster  config.Config
}

func newNodeJob(t *testing.T, root string) *nodeJob {
	t.Helper()
	j := &nodeJob{root: root, addrs: [2]string{freeAddr(t, "127.0.0.1"), freeAddr(t, "127.0.0.2")}}
	var err error
	j.cluster, err = config.Load(map[string]string{"servers": strings.Join(j.addrs[:], ","), "token": "tok",
		"gossip_port_offset": "0", "wait_timeout": "1", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range j.addrs {
		// A short path: the node socket lives in the runtime directory, and a Unix socket's
		// path has room for 107 bytes (t.TempDir's, named after the test, are longer).
		short, err := os.MkdirTemp("", "fc")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(short) })
		j.runDirs[i], j.tierDirs[i] = filepath.Join(short, "run"), t.TempDir()
		j.start(t, i)
		if j.servers[i].NodeSocket() == "" {
			t.Fatalf("server %s has no node socket", j.addrs[i])
		}
	}
	t.Cleanup(func() {
		for i := range j.servers {
			j.stop(t, i)
		}
	})
	return j
}

// start starts server i (again, after stop: on its tiers as they are).
func (j *nodeJob) start(t *testing.T, i int) {
	t.Helper()
	s, err := server.Start(server.Config{Listen: j.addrs[i], Token: "tok", Roots: []string{j.root},
		Tiers: []tiers.Config{{Dir: j.tierDirs[i], Kind: tiers.Memory, Budget: "64MiB"}}, RuntimeDir: j.runDirs[i],
		Cluster: j.cluster, Prefetch: 4})
	if err != nil {
		t.Fatal(err)
	}
	j.servers[i] = s
}

// stop stops server i: its address refuses connections from then on, its tiers stay.
func (j *nodeJob) stop(t *testing.T, i int) {
	t.Helper()
	if j.servers[i] != nil {
		if err := j.servers[i].Close(); err != nil {
			t.Error(err)
		}
		j.servers[i] = nil
	}
}

// reader opens a new client on node A, as a fresh DataLoader worker there would (with
// direct, one that routes over the ring itself, as a reader without a server on its node).
func (j *nodeJob) reader(t *testing.T, direct bool) *client.Client {
	t.Helper()
	cfg, err := config.Load(map[string]string{"servers": strings.Join(j.addrs[:], ","), "token": "tok",
		"node": "127.0.0.1", "runtime_dir": j.runDirs[0], "wait_timeout": "1", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Direct = direct
	c, err := client.Open(j.root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// sourceReads returns the source reads of the servers running.
func (j *nodeJob) sourceReads() (n int64) {
	for _, s := range j.servers {
		if s != nil {
			n += s.Engine().Stats().SourceReads
		}
	}
	return n
}

// readAll reads every file through c and checks its bytes.
func readAll(t *testing.T, c *client.Client, want map[string][]byte) {
	t.Helper()
	for p, data := range want {
		b, err := c.Read(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		if !bytes.Equal(b.Bytes(), data) {
			t.Errorf("%s: %d bytes, not the source's %d", p, len(b.Bytes()), len(data))
		}
		b.Release()
	}
}

// ownStats returns a client's own counters.
func ownStats(t *testing.T, c *client.Client) client.ClientStats {
	t.Helper()
	js, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	var out struct {
		Client client.ClientStats `json:"client"`
	}
	if err := json.Unmarshal([]byte(js), &out); err != nil {
		t.Fatal(err)
	}
	return out.Client
}

// A node whose own server died keeps serving its readers from the server's tiers: a reader
// that starts after the death finds them through the record in the runtime directory, and
// serves a copy once it saw that the source is still the version the copy holds; the list it
// hands over for prefetch does not make the new owner read those files ahead. A copy of
// a file rewritten after the death (same size, same modification time: only its change time
// tells) is not served. The restarted server takes its tiers back: it serves the copies it
// kept, checked against their source, without reading them again.
func TestANodesDeadServersTiersServeItsReaders(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{}
	for i := range 40 {
		p := filepath.Join(root, fmt.Sprintf("f%02d.bin", i))
		want[p] = bytes.Repeat([]byte{byte(i), byte(i >> 8), 7}, 100+300*i)
		if err := os.WriteFile(p, want[p], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	j := newNodeJob(t, root)
	readAll(t, j.reader(t, false), want) // through A's node socket: A keeps every file
	ownedByA := j.servers[0].Engine().Stats().SourceReads
	if ownedByA == 0 || ownedByA == int64(len(want)) {
		t.Fatalf("A read %d of the %d files from the source: the test needs files of both servers", ownedByA, len(want))
	}
	atA, err := tiers.OpenDir(j.tierDirs[0], tiers.Memory)
	if err != nil {
		t.Fatal(err)
	}
	defer atA.Close()
	held := 0
	for p := range want {
		if tiers.Listed([]tiers.Dir{atA}, p) {
			held++
		}
	}
	if held < int(ownedByA) {
		t.Fatalf("A's tier holds %d files, fewer than the %d it read", held, ownedByA)
	}
	var changed string // a file A owns, in A's tier, rewritten after A died
	ring := j.reader(t, true)
	for p := range want {
		if tiers.Listed([]tiers.Dir{atA}, p) && ring.Owner(p) == j.addrs[0] {
			changed = p
			break
		}
	}
	if changed == "" {
		t.Fatal("A's tier holds none of A's files")
	}
	j.stop(t, 0)

	fi, err := os.Stat(changed)
	if err != nil {
		t.Fatal(err)
	}
	want[changed] = bytes.Repeat([]byte{0xEE}, len(want[changed]))
	if err := os.WriteFile(changed, want[changed], 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(changed, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}

	before := j.sourceReads()
	c := j.reader(t, false)
	// As FitCacheDataset does, the reader hands its list over first: the dead server's
	// files would be read ahead from the source by their new owner.
	paths := make([]string, 0, len(want))
	for p := range want {
		paths = append(paths, p)
	}
	if err := c.Prefetch(paths); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 500 && !c.PrefetchStatus().Terminal(); i++ {
		time.Sleep(20 * time.Millisecond)
	}
	readAll(t, c, want)
	st := ownStats(t, c)
	if got := j.sourceReads() - before + st.DirectReads; got != 1 {
		t.Errorf("with A dead, a new reader on A's node made %d source reads (%d by itself), want 1: "+
			"the rewritten file only, the %d others came from A's tier", got, st.DirectReads, held-1)
	}
	if st.DeadServerHits != int64(held-1) {
		t.Errorf("%d reads served from the dead server's tier, want %d", st.DeadServerHits, held-1)
	}

	j.start(t, 0)
	before = j.sourceReads() // B's; A counts anew
	c = j.reader(t, false)
	readAll(t, c, want)
	if again := j.sourceReads() - before + ownStats(t, c).DirectReads; again != 1 {
		t.Errorf("after A restarted, a new reader made %d source reads, want 1 (the rewritten file): "+
			"A took its tier back", again)
	}
	if s := j.servers[0].Engine().Stats(); s.SourceReads != 1 || s.StaleCopies != 1 || s.Tiers[0].Files < held {
		t.Errorf("the restarted A read %d files from the source, dropped %d stale copies and holds %d files, "+
			"want 1, 1 and at least %d", s.SourceReads, s.StaleCopies, s.Tiers[0].Files, held)
	}
}

// A reader that was running when its node's server died serves the copies its session had
// not had checked yet from the server's tiers too, once it saw their source unchanged,
// instead of reading them from the source.
func TestAReaderRunningWhenItsNodesServerDiesKeepsReadingItsTiers(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{}
	for i := range 20 {
		p := filepath.Join(root, fmt.Sprintf("g%02d.bin", i))
		want[p] = bytes.Repeat([]byte{byte(i), 9}, 500+200*i)
		if err := os.WriteFile(p, want[p], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	j := newNodeJob(t, root)
	readAll(t, j.reader(t, false), want) // an earlier job: A holds every file
	c := j.reader(t, false)              // a job of its own: A has checked no copy for it yet
	j.stop(t, 0)
	before := j.sourceReads()
	readAll(t, c, want)
	st := ownStats(t, c)
	if got := j.sourceReads() - before + st.DirectReads; got != 0 || st.DeadServerHits != int64(len(want)) {
		t.Errorf("after its node's server died, a running reader made %d source reads (%d by itself) and served "+
			"%d files from the dead server's tier, want 0, 0 and %d", got, st.DirectReads, st.DeadServerHits, len(want))
	}
}
